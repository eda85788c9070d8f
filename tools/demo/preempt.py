"""The external preemption pattern, on the simulator: an unmodified training
program is paused from another shell mid-run (`npualloc pause <pid>`), its
device memory handed back, and resumed (`npualloc resume <pid>`) to finish
as if nothing happened.

    python tools/demo/preempt.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from launch import ROOT, TRAIN_STEP, sim_environment

sys.path.insert(0, str(ROOT))  # the checkout's npualloc, as the programs it starts use
from npualloc.region import Region  # noqa: E402


def npualloc(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "npualloc", *args], env=sim_environment(), cwd=ROOT, text=True,
                         capture_output=True)
    return out.stdout + out.stderr


def main() -> None:
    train = [sys.executable, "-m", "npualloc", "run", "--conf", "expandable_segments:True", "--",
             sys.executable, str(TRAIN_STEP), "--steps", "6", "--pause-at", "3"]
    proc = subprocess.Popen(train, env=sim_environment(), cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    pid = int(proc.stdout.readline().split()[1])  # "ready <pid>": mid-step, activations live
    print(f"$ npualloc pause {pid}    # taken at the program's next allocation")
    with Region(pid) as region:
        posted = region.command_seq()
        pause = subprocess.Popen([sys.executable, "-m", "npualloc", "pause", str(pid)], env=sim_environment(),
                                 cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while region.command_seq() == posted and pause.poll() is None:
            os.sched_yield()
    proc.stdin.write("go\n")
    proc.stdin.flush()
    print(pause.communicate()[0], end="")
    print(f"$ npualloc ls\n{npualloc('ls')}", end="")
    print(f"$ npualloc resume {pid}\n{npualloc('resume', str(pid))}", end="")
    result = json.loads(proc.stdout.read().splitlines()[-1][len("result "):])
    print(f"finished: {result['steps']} steps, exit {proc.wait()}")


if __name__ == "__main__":
    main()
