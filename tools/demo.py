"""`make demo`: a small training-like pyACL program on the simulated Ascend
runtime, run twice (on the runtime alone, then under `python -m npualloc run`),
and the comparison; halfway through the npualloc run, `python -m npualloc
stats <pid>` is taken from a second process while the program waits. Then
the same for an unmodified MindTorch v2 training script (tools/demo/
mindtorch_run.py), where root can mount the simulator at /usr/local/Ascend.

    .venv/bin/python tools/demo.py [--steps N]      (BUILD=dir picks the build tree)

The program is tools/demo/train_step.py; the simulator keeps its default
latency model (40 us per raw malloc, 20 us per raw free, 10 us per op).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "demo"))
import launch  # noqa: E402
import mindtorch_run  # noqa: E402

MIB = 1 << 20


def take_stats(pid: int, build: Path) -> str:
    """`python -m npualloc stats PID` as a user would type it in another shell."""
    proc = subprocess.run([sys.executable, "-m", "npualloc", "stats", str(pid)], cwd=launch.ROOT,
                          env=launch.sim_environment(build), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"npualloc stats {pid} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def comparison_table(raw: dict, npa: dict) -> list[str]:
    def row(label: str, left: str, right: str, note: str = "") -> str:
        return f"| {label:<30} | {left:>15} | {right:>15} | {note:<24} |"

    rule = "+" + "-" * 32 + "+" + "-" * 17 + "+" + "-" * 17 + "+" + "-" * 26 + "+"
    speedup = raw["step_ms_median"] / npa["step_ms_median"]
    return [
        rule,
        row("", "raw runtime", "npualloc", ""),
        rule.replace("-", "="),
        row("time per step (median)", f"{raw['step_ms_median']:.2f} ms", f"{npa['step_ms_median']:.2f} ms",
            f"{speedup:.1f}x faster"),
        row("first step", f"{raw['step_ms_first']:.2f} ms", f"{npa['step_ms_first']:.2f} ms",
            "npualloc fills its cache"),
        row(f"all {raw['steps']} steps", f"{raw['steps_seconds']:.2f} s", f"{npa['steps_seconds']:.2f} s", ""),
        row("raw device mallocs / frees", f"{raw['raw_mallocs']} / {raw['raw_frees']}",
            f"{npa['raw_mallocs']} / {npa['raw_frees']}", "during the steps"),
        row(f"mallocs since start, step {raw['steps'] // 2}", str(raw["raw_mallocs_since_start_mid"]),
            str(npa["raw_mallocs_since_start_mid"]), "= stats' device calls"),
        row("raw device calls after step 1", str(raw["raw_calls_after_first_step"]),
            str(npa["raw_calls_after_first_step"]), ""),
        row("peak device memory held", f"{raw['peak_device_bytes'] / MIB:.1f} MiB",
            f"{npa['peak_device_bytes'] / MIB:.1f} MiB", "npualloc: reserved"),
        row("bad accesses / clobbers", f"{raw['invalid_accesses']} / {raw['workspace_clobbers']}",
            f"{npa['invalid_accesses']} / {npa['workspace_clobbers']}", "checked by the sim"),
        rule,
    ]


def mindtorch_section(steps: int, build: Path) -> list[str]:
    """The same comparison for an unmodified MindTorch v2 script (its own
    allocator raw, the pass-through under npualloc)."""
    why = mindtorch_run.unavailable()
    if why is not None:
        return [f"MindTorch v2 part skipped: {why}"]
    raw, npa = mindtorch_run.run(False, steps, build), mindtorch_run.run(True, steps, build)

    def median_ms(result: dict) -> str:
        later = sorted(s["ms"] for s in result["steps"][1:])
        return f"{later[len(later) // 2]:.1f} ms" if later else "-"

    def mallocs(result: dict) -> str:
        counts = [s["mallocs"] for s in result["steps"]]
        return f"{counts[0]} + {counts[-1] - counts[0]}" if counts else "-"

    def row(label: str, left: str, right: str) -> str:
        return f"| {label:<34} | {left:>16} | {right:>16} |"

    rule = "+" + "-" * 36 + "+" + "-" * 18 + "+" + "-" * 18 + "+"
    lines = [f"MindTorch v2 (tests/mindtorch_programs/train_mlp.py, unmodified, {steps} steps; simulator mounted "
             "at /usr/local/Ascend by tools/aclsim/cann-root)", rule,
             row("", "MindTorch alone", "under npualloc"), rule.replace("-", "="),
             row("median step time (after step 1)", median_ms(raw), median_ms(npa)),
             row("raw device mallocs: step 1 + later", mallocs(raw), mallocs(npa)),
             row("peak device memory (at step ends)", f"{raw['peak_device_bytes'] / MIB:.2f} MiB",
                 f"{npa['peak_device_bytes'] / MIB:.2f} MiB"),
             row("exit status", str(raw["exit_status"]), str(npa["exit_status"])), rule]
    for name, result in (("MindTorch alone", raw), ("under npualloc", npa)):
        if result["exit_status"] != 0:
            lines.append(f"{name} stderr:\n{result['stderr_tail']}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--mindtorch-steps", type=int, default=20)
    args = parser.parse_args()
    build = launch.build_dir()
    started = time.perf_counter()
    print(f"npualloc demo · {datetime.now():%Y-%m-%d %H:%M:%S} · simulated Ascend runtime from {build.name}/aclsim "
          "(raw malloc 40 us, raw free 20 us, op 10 us)")
    print(f"program: tools/demo/train_step.py · {args.layers} layers · {args.steps} steps · sequence lengths "
          "64..256 · every op a two-phase aclnn call with its own workspace malloc\n")

    print("running on the raw runtime ...", flush=True)
    raw = launch.run_train_step(False, args.steps, args.layers, build)
    print("running under `python -m npualloc run` ...", flush=True)
    stats: list[str] = []
    npa = launch.run_train_step(True, args.steps, args.layers, build,
                                while_paused=lambda pid: stats.append(take_stats(pid, build)))
    print()
    print("\n".join(comparison_table(raw, npa)))
    print(f"\n$ python -m npualloc stats <pid>    (from a second process, at step {args.steps // 2} "
          f"of {args.steps}, the program live and waiting)")
    print("".join(stats).rstrip())
    print("\nrunning MindTorch v2's training script, alone then under npualloc ...", flush=True)
    print("\n".join(mindtorch_section(args.mindtorch_steps, build)))
    print(f"\ndemo done in {time.perf_counter() - started:.1f} s. Next: "
          "python -m npualloc replay tools/traces/gpt2_train.pickle.gz, or make bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
