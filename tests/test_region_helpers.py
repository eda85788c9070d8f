"""The test helpers' own promises (region_helpers.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from conftest import ROOT

HUNG_WITH_A_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from region_helpers import Workload
    w = Workload(Path(sys.argv[1]))
    w.call("fork_child_sleeps()")  # holds the workload's stdout for 600 s
    w.ANSWER_LIMIT_S = 2  # the hung call's alone: a start slowed by a loaded machine is no hang
    try:
        w.call("time.sleep(3600)")
    except AssertionError as e:
        print("failed:", str(e).split(":")[0])
""")


def test_a_hung_workload_fails_its_call_though_a_child_holds_its_output(tmp_path: Path) -> None:
    """The watchdog killed the workload alone: a child it had forked (the
    helper's fork_child_sleeps) kept the pipe open, so the call read on, for
    the child's 600 s, instead of failing as for a workload that died. It
    kills the workload's process group."""
    proc = subprocess.run([sys.executable, "-c", HUNG_WITH_A_CHILD, str(tmp_path)], cwd=ROOT / "tests",
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "failed: workload died on 'time.sleep(3600)'\n"
