"""MindTorch v2's allocator interface on the shipped traces (tools/traces),
replayed from Python through mindtorch_v2's get_allocator(0): MindTorch's own
NpuAllocator when run plainly, npualloc's pass-through under `npualloc run`.
`make bench` runs it per trace in a fresh process (tools/bench/mindtorch.py),
alone and under npualloc, both through tools/aclsim/cann-root.

Per trace: allocator time per event (malloc/free calls only, from Python:
wall time, and the calling thread's CPU time, which a machine shared with
other work does not inflate; beside it the timer's own floor, the same
measurement around a call that does nothing),
raw device mallocs and frees reaching the runtime (aclsim's counters), peak
device memory held (aclsim: aclrtMalloc'd plus VMM physical, sampled after
every event) over the trace's peak requested bytes. Calls pass MindTorch's
current stream, as its tensor allocations do. --events caps each trace
(MindTorch alone scans every pending block on each malloc: its cost grows with
the trace)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from npualloc.replay import busiest_device, load_snapshot  # noqa: E402

TRACES = ("resnet_train", "gpt2_train", "gpt2_decode")


def device_bytes() -> int:
    """Device memory held: aclrtMalloc'd plus VMM physical (expandable_segments)."""
    import aclsim
    return aclsim.bytes_outstanding(0) + aclsim.physical_bytes_outstanding(0)


def _nothing(*args) -> int:
    return 0


def replay(name: str, max_events: int) -> dict:
    import aclsim  # the simulator's counters: only in the process on the simulator
    from mindtorch_v2._backends.npu import allocator as npu_allocator
    from mindtorch_v2._backends.npu import runtime as npu_runtime
    from mindtorch_v2._backends.npu import state as npu_state
    npu_runtime.get_runtime(0).activate()
    alloc = npu_allocator.get_allocator(0)
    stream = npu_state.current_stream(0).stream  # what MindTorch's tensor allocations pass
    snapshot = load_snapshot(ROOT / "tools" / "traces" / f"{name}.pickle.gz")
    trace = snapshot["device_traces"][busiest_device(snapshot)][:max_events]
    live: dict[int, tuple[int, int]] = {}
    requested = peak_requested = peak_device = events = 0
    spent = [0.0, 0.0]  # wall, this thread's CPU

    def timed(call, *args):
        wall, cpu = time.perf_counter(), time.thread_time()
        result = call(*args)
        spent[1] += time.thread_time() - cpu
        spent[0] += time.perf_counter() - wall
        return result

    # The floor of this measurement: timed() itself (its clock reads, which
    # are system calls for the thread's CPU time, and the call through it)
    # around a call that does nothing, once per trace entry. Reported beside
    # the figures, not subtracted from them.
    for _ in trace:
        timed(_nothing, 4096, stream)
    floor, spent[:] = [t / len(trace) * 1e6 for t in spent], [0.0, 0.0]
    mallocs0, frees0 = aclsim.device_malloc_count(), aclsim.call_count("aclrtFree")
    for entry in trace:
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc" and addr not in live:
            size = int(entry["size"])
            ptr = timed(alloc.malloc, size, stream)
            live[addr] = (ptr, size)
            requested += size
            peak_requested = max(peak_requested, requested)
        elif action in ("free_requested", "free") and addr in live:
            ptr, size = live.pop(addr)
            timed(alloc.free, ptr, stream)
            requested -= size
        else:
            continue
        events += 1
        peak_device = max(peak_device, device_bytes())
    for ptr, _ in live.values():
        alloc.free(ptr, stream=stream)
    alloc.synchronize()
    alloc.empty_cache()
    return {"trace": name, "events": events, "us_per_event": spent[0] / events * 1e6,
            "cpu_us_per_event": spent[1] / events * 1e6,
            "timer_us_per_event": floor[0], "timer_cpu_us_per_event": floor[1],
            "raw_mallocs": aclsim.device_malloc_count() - mallocs0,
            "raw_frees": aclsim.call_count("aclrtFree") - frees0,
            "peak_device": peak_device, "peak_requested": peak_requested,
            "allocator": type(alloc).__name__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6000)
    parser.add_argument("--trace", choices=TRACES, required=True)
    args = parser.parse_args()
    print(json.dumps(replay(args.trace, args.events)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
