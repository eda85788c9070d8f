"""`make bench`, MindTorch part: the unmodified MindTorch v2 training script
(make demo's) and MindTorch's allocator interface on the shipped traces
(tools/bench/mindtorch_traces.py), MindTorch alone vs under npualloc, each
trace in a fresh process, npualloc with MindTorch's defaults (expandable
segments) and with expandable_segments:False (plain segments). Prints the table and the goals per configuration,
MET or NOT MET from the numbers: under npualloc, peak device memory within
1.35x of the peak requested on every trace, and allocator calls under 5 us per
event from Python. `python tools/bench/mindtorch.py [--events N] [--steps N]`."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "demo"))
import mindtorch_run  # noqa: E402

import mindtorch_traces  # noqa: E402

PEAK_GOAL = 1.35
US_GOAL = 5.0
MIB = 1 << 20


# npualloc's configurations measured, set as a MindTorch user would: none
# (the pass-through then switches expandable segments on, segments grown in
# place over the VMM API), and the opt-out to plain segments.
CONFIGS = ("", "expandable_segments:False")


def trace_result(name: str, events: int, npualloc: bool, conf: str = "") -> dict:
    # Room for MindTorch alone, whose reserved memory only grows.
    extra = {"NPUSIM_HBM_MB": "400000"}
    if conf:
        extra["MINDTORCH_NPU_ALLOC_CONF"] = conf
    proc = mindtorch_run.start([str(Path(mindtorch_traces.__file__)), "--trace", name, "--events", str(events)],
                               npualloc, **extra)
    if proc.returncode != 0:
        return {"trace": name, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=6000, help="trace entries per trace (default 6000)")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    why = mindtorch_run.unavailable()
    if why is not None:
        print(f"MindTorch bench skipped: {why}")
        return 0
    print(f"MindTorch v2 allocator on the shipped traces (first {args.events} entries each; "
          "time = malloc/free calls from Python, wall and the thread's CPU time, timer floor = the same around a "
          "call that does nothing, wall / CPU, included in the times; peak = device memory held / "
          "peak requested); load average at start "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    header = f"{'trace':<14} {'allocator':<48} {'events':>7} {'us/event':>9} {'cpu us':>7} {'timer floor':>12} " \
             f"{'raw mallocs':>12} " \
             f"{'raw frees':>10} {'peak MiB':>10} {'peak/req':>9}"
    print(header)
    print("-" * len(header))
    runs = [(False, "")] + [(True, conf) for conf in CONFIGS]
    ours: dict[str, list] = {conf: [] for conf in CONFIGS}
    for name in mindtorch_traces.TRACES:
        for npualloc, conf in runs:
            r = trace_result(name, args.events, npualloc, conf)
            label = "MindTorch alone" if not npualloc else f"MindTorch + npualloc {conf or '(defaults)'}"
            if "error" in r:
                print(f"{name:<14} {label:<48} {r['error']}")
                if npualloc:
                    ours[conf].append(None)
                continue
            ratio = r["peak_device"] / r["peak_requested"]
            floor = f"{r['timer_us_per_event']:.1f} / {r['timer_cpu_us_per_event']:.1f}"
            print(f"{name:<14} {label:<48} {r['events']:>7} {r['us_per_event']:>9.1f} {r['cpu_us_per_event']:>7.1f} "
                  f"{floor:>12} {r['raw_mallocs']:>12} "
                  f"{r['raw_frees']:>10} {r['peak_device'] / MIB:>10.0f} {ratio:>9.2f}")
            if npualloc:
                ours[conf].append((ratio, r["cpu_us_per_event"]))
    for conf, results in ours.items():
        ok = [o for o in results if o is not None]
        complete = len(ok) == len(results)
        peak_met = complete and all(ratio <= PEAK_GOAL for ratio, _ in ok)
        us_met = complete and all(us < US_GOAL for _, us in ok)
        worst_peak = max((ratio for ratio, _ in ok), default=float("nan"))
        worst_us = max((us for _, us in ok), default=float("nan"))
        label = conf or "defaults"
        print(f"goal, npualloc {label}: peak device memory <= {PEAK_GOAL}x peak requested on every trace: "
              f"{'MET' if peak_met else 'NOT MET'} (worst {worst_peak:.2f}x)")
        print(f"goal, npualloc {label}: allocator calls < {US_GOAL:.0f} us per event from Python (CPU time): "
              f"{'MET' if us_met else 'NOT MET'} (worst {worst_us:.1f} us)")

    raw, npa = mindtorch_run.run(False, args.steps), mindtorch_run.run(True, args.steps)
    for label, r in (("MindTorch alone", raw), ("MindTorch + npualloc", npa)):
        later = sorted(s["ms"] for s in r["steps"][1:])
        median = f"{later[len(later) // 2]:.1f} ms" if later else "-"
        mallocs = [s["mallocs"] for s in r["steps"]]
        print(f"train_mlp.py {args.steps} steps, {label:<22}: median step {median}, raw mallocs "
              f"{mallocs[-1] if mallocs else '-'}, peak device {r['peak_device_bytes'] / MIB:.2f} MiB, "
              f"exit {r['exit_status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
