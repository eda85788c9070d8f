"""Writes tools/bench/trace_sizes.txt: the hot-path benchmark's size sequence,
drawn from the allocation sizes of the shipped real-model traces.

Run once, after re-recording a trace:
    .venv/bin/python tools/bench/extract_sizes.py

Every alloc event of gpt2_train, gpt2_decode and resnet_train goes into one
pool, and COUNT sizes are sampled from it with a fixed seed, so the sequence
follows the traces' size distribution (many small tensors, a tail of large
ones) and is the same on every run. The file is committed, so the benchmark
needs neither the traces' unpickling nor Python at run time.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from npualloc.replay import load_snapshot  # noqa: E402

TRACES = ("gpt2_train", "gpt2_decode", "resnet_train")
COUNT = 4096
SEED = 0
OUT = Path(__file__).resolve().parent / "trace_sizes.txt"


def main() -> None:
    pool: list[int] = []
    for name in TRACES:
        snapshot = load_snapshot(ROOT / "tools" / "traces" / f"{name}.pickle.gz")
        for trace in snapshot["device_traces"]:
            pool += [int(e["size"]) for e in trace if e.get("action") == "alloc"]
    sizes = random.Random(SEED).sample(pool, COUNT)
    with open(OUT, "w") as f:
        f.write(f"# {COUNT} allocation sizes in bytes, sampled (seed {SEED}) from the alloc events of "
                f"{', '.join(TRACES)} ({len(pool)} allocs); made by tools/bench/extract_sizes.py\n")
        f.write("".join(f"{s}\n" for s in sizes))
    print(f"{OUT}: {COUNT} sizes, median {sorted(sizes)[COUNT // 2]} B, max {max(sizes)} B")


if __name__ == "__main__":
    main()
