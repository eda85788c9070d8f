"""An unmodified MindTorch v2 training script (tests/mindtorch_programs/
train_mlp.py) on the simulator, raw or under `python -m npualloc run`, for
`make demo`: MindTorch loads CANN from /usr/local/Ascend only, so the run goes
through tools/aclsim/cann-root (a private mount namespace: needs root).

The script runs inside a small watcher (WATCH below) that times each step and
reads the simulator's counters at each step's end; the script itself is
unchanged. `python tools/demo/mindtorch_run.py [raw|npualloc] [STEPS]`
prints the result as JSON."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import launch

sys.path.insert(0, str(launch.ROOT / "tools"))
import devenv  # noqa: E402  (tools/ is not a package)

MINDTORCH_SRC = devenv.MINDTORCH_SRC
CANN_ROOT = launch.ROOT / "tools" / "aclsim" / "cann-root"
PROGRAMS = launch.ROOT / "tests" / "mindtorch_programs"

WATCH = """
import json, sys, time
sys.path.insert(0, {programs!r})
import aclsim, train_mlp
steps, peak, last = [], 0, [time.perf_counter()]
def on_step(step, loss):
    global peak
    now = time.perf_counter()
    # Raw device allocations and memory held: plain aclrtMalloc (MindTorch's),
    # npualloc's plain segments (aclrtMallocAlign32) and the physical pages of
    # expandable segments (MindTorch's default under npualloc).
    steps.append({{"ms": (now - last[0]) * 1e3,
                   "mallocs": aclsim.device_malloc_count() + aclsim.call_count("aclrtMallocPhysical")}})
    peak = max(peak, aclsim.bytes_outstanding(0) + aclsim.physical_bytes_outstanding(0))
    last[0] = time.perf_counter()
train_mlp.train("npu", {steps}, on_step)
print(json.dumps({{"steps": steps, "peak_device_bytes": peak}}), flush=True)
"""


def unavailable() -> str | None:
    """Why the MindTorch demo cannot run here, or None."""
    if not (MINDTORCH_SRC / "mindtorch_v2").is_dir():
        return f"MindTorch v2 not found at {MINDTORCH_SRC} (set NPUALLOC_MINDTORCH)"
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount the simulator at /usr/local/Ascend for one process tree"
    return None


def start(python_args: list[str], npualloc: bool, build: Path | None = None,
          **extra_env: str) -> subprocess.CompletedProcess:
    """`python PYTHON_ARGS` with MindTorch importable and the simulator at
    /usr/local/Ascend, raw or under `python -m npualloc run`; waits for it."""
    build = build or launch.build_dir()
    env = launch.sim_environment(build)
    env["PYTHONPATH"] = os.pathsep.join([str(MINDTORCH_SRC), env["PYTHONPATH"]])
    env.update(extra_env)
    # the interpreter with npualloc's startup hook installed, as `pip install .` leaves it
    python = str(devenv.ensure(build))
    args = [python, *python_args]
    if npualloc:
        args = [python, "-m", "npualloc", "run", "--", *args]
    return subprocess.run([str(CANN_ROOT), str(build / "aclsim"), *args], env=env, cwd=launch.ROOT,
                          capture_output=True, text=True, timeout=900)


def run(npualloc: bool, steps: int, build: Path | None = None) -> dict[str, Any]:
    proc = start(["-c", WATCH.format(programs=str(PROGRAMS), steps=steps)], npualloc, build)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {"steps": [], "peak_device_bytes": 0}
    result.update(exit_status=proc.returncode, stderr_tail=proc.stderr[-2000:])
    return result


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "npualloc"
    print(json.dumps(run(mode == "npualloc", int(sys.argv[2]) if len(sys.argv) > 2 else 20)))
