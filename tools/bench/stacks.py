"""What record_stacks:python costs per allocation: a pyACL loop of
acl.rt.malloc + acl.rt.free (cache hits, one size) under npualloc on the
simulated runtime, with history off, history on, history with the Python
stacks of the mallocs (context="alloc") and with those of the frees too
(context="all", torch's default), each in its own process; ns per
malloc+free pair, best of the
repeats within a process. The modes run in rounds, each mode once per round,
a round's processes pinned to one CPU (the rounds take the CPUs in turn),
and what history and the stacks add is taken within a round: on a shared
machine whose speed moves 2x from one second to the next, modes measured one
after the other compared the machine's phases (history once read 290 ns
cheaper than no history). The stacks are 12 frames deep.

    python tools/bench/stacks.py [--pairs N] [--repeats R] [--rounds K]   (BUILD=dir picks the build tree)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
import launch  # noqa: E402

from figures import fmt_spread, pinned, round_cpus, spread  # noqa: E402

LOOP = """
import acl, json, sys, time, npualloc
pairs, repeats, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
acl.init(); acl.rt.set_device(0)
if mode != "off":
    npualloc.record_memory_history(max_entries=1000, context="all" if mode == "freeing" else "alloc",
                                   stacks=None if mode == "history" else "python")
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


def measure_mode(mode: str, pairs: int, repeats: int, build: Path | None = None, cpu: int | None = None) -> float:
    env = launch.sim_environment(build)
    env["NPUSIM_MALLOC_US"] = env["NPUSIM_FREE_US"] = "0"
    proc = subprocess.run(launch.command([sys.executable, "-c", LOOP, str(pairs), str(repeats), mode], True),
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=pinned(cpu))
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: exit {proc.returncode}: {proc.stderr}")
    return float(json.loads(proc.stdout))


MODES = ("off", "history", "stacks", "freeing")


def measure(build: Path | None = None, pairs: int = 20000, repeats: int = 5, rounds: int = 5) -> dict[str, Any]:
    """ns per pair for history off, history on, history with the mallocs'
    stacks, with the frees' too, one list entry per round (`make bench`'s
    section 5)."""
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for cpu in round_cpus(rounds):
        for mode in MODES:
            runs[mode].append(measure_mode(mode, pairs, repeats, build, cpu))
    return {"pairs": pairs, "repeats": repeats, "rounds": rounds, **runs}


def markdown(r: dict[str, Any]) -> list[str]:
    history_adds = spread([h - o for h, o in zip(r["history"], r["off"])])
    stack_adds = spread([s - h for s, h in zip(r["stacks"], r["history"])])
    free_stack_adds = spread([f - s for f, s in zip(r["freeing"], r["stacks"])])
    return [
        "| pyACL malloc+free pair under npualloc | ns per pair: median [min-max of rounds] | added, within a round |",
        "|---|---:|---:|",
        f"| history off | {fmt_spread(spread(r['off']), '.0f')} | |",
        f"| record_history | {fmt_spread(spread(r['history']), '.0f')} | {fmt_spread(history_adds, '+.0f')} |",
        f"| + record_stacks:python (12 frames) | {fmt_spread(spread(r['stacks']), '.0f')} | "
        f"{fmt_spread(stack_adds, '+.0f')} for the stack |",
        f"| + record_context:all (the free's stack too) | {fmt_spread(spread(r['freeing']), '.0f')} | "
        f"{fmt_spread(free_stack_adds, '+.0f')} for the free's stack |",
        "",
        f"{r['pairs']} pairs of acl.rt.malloc(4096)+free (cache hits), best of {r['repeats']} within each process, "
        f"each mode in its own process, {r['rounds']} rounds of the four, a round pinned to one CPU "
        "(tools/bench/stacks.py). With "
        "record_stacks off it adds nothing to the hit path: its flag shares the word an allocation already reads "
        "(npa_entry_work); section 1 compares with a build without it.",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print("\n".join(markdown(measure(None, args.pairs, args.repeats, args.rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
