"""Writes tools/traces/tiny.pickle.gz: a hand-made trace, small enough that
every figure the replay reports can be worked out on paper
(tests/test_replay.py does, in its comments).

Two iterations of the same four tensors:
  iteration 1: a=1000 B, b=500000 B, c=4 MiB, free a, d=16 MiB, then a mark
  iteration 2: free b, c, d; then c, d, a, b again (a different order), a mark
plus one free of an address that was never allocated (the replay skips it and
counts it).

    python tools/traces/make_tiny.py tools/traces/tiny.pickle.gz
"""
from __future__ import annotations

import gzip
import pickle
import sys

MIB = 1 << 20
SIZES = {"a": 1000, "b": 500_000, "c": 4 * MIB, "d": 16 * MIB}
# Distinct fake device addresses per tensor and iteration, as a CUDA run would give.
FIRST = {"a": 0x7F0000000000, "b": 0x7F0000200000, "c": 0x7F0000400000, "d": 0x7F0001800000}
SECOND = {name: addr + 0x10000000 for name, addr in FIRST.items()}
NEVER_ALLOCATED = 0x7F00DEAD0000


def entry(action: str, addr: int, size: int, time_us: int) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": []}


def tiny_trace() -> list[dict]:
    steps: list[tuple[str, int, int]] = []

    def alloc(name: str, addrs: dict) -> None:
        steps.append(("alloc", addrs[name], SIZES[name]))

    def free(name: str, addrs: dict) -> None:
        steps.append(("free_requested", addrs[name], SIZES[name]))
        steps.append(("free_completed", addrs[name], SIZES[name]))

    for name in "abc":
        alloc(name, FIRST)
    free("a", FIRST)
    alloc("d", FIRST)
    steps.append(("snapshot", 0, 0))
    steps.append(("free_requested", NEVER_ALLOCATED, 4096))
    for name in "bcd":
        free(name, FIRST)
    for name in "cdab":
        alloc(name, SECOND)
    steps.append(("snapshot", 0, 0))
    return [entry(action, addr, size, 10 * i) for i, (action, addr, size) in enumerate(steps)]


def main(path: str) -> int:
    snapshot = {"segments": [], "device_traces": [tiny_trace()], "allocator_settings": {},
                "npualloc_recording": {"workload": "tiny", "command": "python tools/traces/make_tiny.py " + path}}
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as f:  # mtime 0: same bytes every time
        pickle.dump(snapshot, f, protocol=4)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "tools/traces/tiny.pickle.gz"))
