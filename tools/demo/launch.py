"""Running programs on the simulator from the build tree, raw or under
`python -m npualloc run`: shared by tools/demo.py, tools/bench/run.py and
their smoke test.

The build tree is $BUILD (default build/), as in the Makefile. The simulator's
latency model is left at its defaults (NPUSIM_* variables are dropped from the
caller's environment), so a raw device call costs what the simulator says it
costs (40 us malloc, 20 us free).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the checkout's npualloc: `make demo` does not install it
from npualloc.conf_env import CONF_VARIABLES  # noqa: E402
from npualloc.simulator import simulated_env  # noqa: E402

TRAIN_STEP = ROOT / "tools" / "demo" / "train_step.py"


def build_dir() -> Path:
    return ROOT / os.environ.get("BUILD", "build")


def sim_environment(build: Path | None = None) -> dict[str, str]:
    """The caller's environment, pointed at the build tree's simulator, with
    nothing preloaded and no allocator config inherited."""
    build = build or build_dir()
    drop = ("NPUSIM_", "NPUALLOC_", "LD_PRELOAD", "PYTORCH_NO_CUDA_MEMORY_CACHING") + CONF_VARIABLES
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tools")])
    env["PYTHONUNBUFFERED"] = "1"
    return simulated_env(build / "aclsim", env)


def command(args: list[str], npualloc: bool) -> list[str]:
    """ARGS as given, or as `python -m npualloc run -- ARGS` (which execs, so
    the pid is the program's)."""
    return [sys.executable, "-m", "npualloc", "run", "--", *args] if npualloc else args


def run_train_step(npualloc: bool, steps: int, layers: int = 6, build: Path | None = None,
                   while_paused: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Runs tools/demo/train_step.py and returns its result. With while_paused,
    the program stops mid-run (halfway) and while_paused(pid) is called before
    it is told to go on."""
    args = [sys.executable, str(TRAIN_STEP), "--steps", str(steps), "--layers", str(layers)]
    if while_paused:
        args += ["--pause-at", str(steps // 2)]
    proc = subprocess.Popen(command(args, npualloc), env=sim_environment(build), cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    result = None
    with proc:
        for line in proc.stdout:
            if line.startswith("ready ") and while_paused:
                try:
                    while_paused(int(line.split()[1]))
                finally:
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
            elif line.startswith("result "):
                result = json.loads(line[len("result "):])
        stderr = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"train_step.py exited {proc.returncode}:\n{stderr}")
    if result["npualloc"] != npualloc:
        raise RuntimeError(f"train_step.py ran with npualloc {'absent' if npualloc else 'loaded'}")
    return result
