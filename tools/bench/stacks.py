"""What record_stacks:python costs per allocation: a pyACL loop of
acl.rt.malloc + acl.rt.free (cache hits, one size) under npualloc on the
simulated runtime, with history off, history on, and history with Python
stacks, each in its own process; ns per malloc+free pair, best of the
repeats, and the difference to history alone. The stacks are 12 frames deep.

    python tools/bench/stacks.py [--pairs N] [--repeats R]   (BUILD=dir picks the build tree)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
import launch  # noqa: E402

LOOP = """
import acl, json, sys, time, npualloc
pairs, repeats, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
acl.init(); acl.rt.set_device(0)
if mode != "off":
    npualloc.record_memory_history(max_entries=1000, stacks="python" if mode == "stacks" else None)
malloc, free = acl.rt.malloc, acl.rt.free
def loop(n):
    for _ in range(n):
        p, _ = malloc(4096, 0)
        free(p)
def nested(depth, n):
    return nested(depth - 1, n) if depth else loop(n)
best = []
for _ in range(repeats):
    started = time.perf_counter_ns()
    nested(10, pairs)
    best.append((time.perf_counter_ns() - started) / pairs)
print(json.dumps(min(best)))
"""


def measure(mode: str, pairs: int, repeats: int) -> float:
    env = launch.sim_environment()
    env["NPUSIM_MALLOC_US"] = env["NPUSIM_FREE_US"] = "0"
    proc = subprocess.run(launch.command([sys.executable, "-c", LOOP, str(pairs), str(repeats), mode], True),
                          env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: exit {proc.returncode}: {proc.stderr}")
    return float(json.loads(proc.stdout))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {mode: measure(mode, args.pairs, args.repeats) for mode in ("off", "history", "stacks")}
    print(f"pyACL malloc+free pair under npualloc, {args.pairs} pairs, best of {args.repeats}:")
    print(f"  history off             {results['off']:8.0f} ns")
    print(f"  record_history          {results['history']:8.0f} ns  (+{results['history'] - results['off']:.0f})")
    print(f"  + record_stacks:python  {results['stacks']:8.0f} ns  (+{results['stacks'] - results['history']:.0f} "
          "for the stack)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
