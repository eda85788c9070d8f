"""An unmodified MindTorch v2 training script (tests/mindtorch_programs/
train_mlp.py, MindTorch's public API only) on the simulated NPU: under
`python -m npualloc run` every tensor goes through npualloc, raw it shows what
MindTorch's own allocator does. The harness below only watches: it counts the
raw runtime calls after each step (aclsim's counters) and reports MindTorch's
own view of its memory."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, cann_root_command, installed_python, mindtorch_env

from npualloc.conf_env import CONF_VARIABLES

STEPS = 6
# The raw device allocations and frees counted after each step: plain
# (aclrtMalloc, or npualloc's segments' aclrtMallocAlign32, and aclrtFree) and
# the physical pages of expandable segments.
RAW_CALLS = ("mallocs", "frees", "pages", "pages_freed")

HARNESS = """
import json, sys
sys.path.insert(0, {programs!r})
import aclsim, train_mlp
counts = []
def on_step(step, loss):
    counts.append({{"step": step, "loss": loss, "mallocs": aclsim.device_malloc_count(),
                    "frees": aclsim.call_count("aclrtFree"), "outstanding": aclsim.bytes_outstanding(0),
                    "pages": aclsim.call_count("aclrtMallocPhysical"),
                    "pages_freed": aclsim.call_count("aclrtFreePhysical")}})
model, losses = train_mlp.train({device!r}, {steps}, on_step)
# MindTorch's autograd graphs are reference cycles that hold device tensors
# until Python's cyclic GC runs (about 0.5 MB here): collect them now, and no
# more, so the stats read below and `npualloc stats <pid>` meanwhile see the
# same state (a collection between the two once freed 835 KB in between).
import gc
gc.collect()
gc.disable()
import mindtorch_v2 as torch
from mindtorch_v2._backends.npu import allocator, aclnn
report = {{"steps": counts, "losses": losses}}
import npualloc
if npualloc.is_active():
    report.update(config=npualloc.get_config())
if {device!r} == "npu":
    report.update(allocator=type(allocator.get_allocator(0)).__name__,
                  stats=torch.npu.memory_stats(), allocated=torch.npu.memory_allocated(),
                  reserved=torch.npu.memory_reserved(), summary=torch.npu.memory_summary(),
                  deferred_executors=len(aclnn._DEFERRED_EXECUTORS))
print(json.dumps(report), flush=True)
if {wait}:
    sys.stdin.readline()   # the test reads `npualloc stats <pid>` meanwhile
"""


def harness(device: str, wait: bool = False) -> list[str]:
    code = HARNESS.format(programs=str(ROOT / "tests" / "mindtorch_programs"), device=device, steps=STEPS,
                          wait=wait)
    return ["-c", code]


def run(argv: list[str], env: dict[str, str]) -> tuple[dict, subprocess.CompletedProcess]:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    report, _ = run([sys.executable, *harness("cpu")], mindtorch_env())
    return report["losses"]


def test_under_npualloc_every_tensor_goes_through_npualloc(cpu_losses):
    python = installed_python()
    env = {name: value for name, value in mindtorch_env().items() if name not in CONF_VARIABLES}
    proc = subprocess.Popen(cann_root_command([python, "-m", "npualloc", "run", "--", python,
                                               *harness("npu", wait=True)]),
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line, f"no report; stderr:\n{proc.stderr.read()}"
        report = json.loads(line)
        # From another shell: the live process's tensors, as npualloc sees them.
        stats = subprocess.run([sys.executable, "-m", "npualloc", "stats", "--json", str(proc.pid)],
                               env=env, capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0, stats.stderr
        device0 = json.loads(stats.stdout)["devices"]["0"]
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "npualloc:" not in err, err
    # The same numbers as MindTorch's CPU backend, float32.
    assert report["losses"] == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    assert report["losses"][-1] < report["losses"][0]
    # MindTorch's allocator was replaced, and its stats are npualloc's.
    assert report["allocator"] == "PassThroughAllocator"
    assert "npualloc.cache_hits" in report["stats"] and report["stats"]["npualloc.cache_hits"] > 0
    assert report["allocated"] == report["stats"]["allocated_bytes.all.current"] > 0
    assert report["reserved"] >= report["allocated"]
    assert "NPU Memory Summary" in report["summary"] and str(report["allocated"]) in report["summary"]
    # No allocator config: the pass-through switched expandable segments on
    # before the first tensor, so the device memory is pages of reserved ranges.
    assert report["config"] == "expandable_segments:True"
    first = report["steps"][0]
    assert first["pages"] > 0 and report["stats"]["segment.all.peak"] == 0
    # After the first step no raw device malloc or free reaches the runtime.
    for later in report["steps"][1:]:
        assert ({k: later[k] for k in RAW_CALLS} == {k: first[k] for k in RAW_CALLS}), report["steps"]
        assert later["outstanding"] == first["outstanding"]
    # `npualloc stats <pid>` shows the live tensors (the model's parameters, its data).
    model_bytes = 4 * (32 * 128 + 128 + 128 * 8 + 8 + 64 * 32 + 64 * 8)
    assert device0["allocated_bytes.all.current"] >= model_bytes
    for key in ("allocated_bytes.all.current", "active_bytes.all.current", "reserved_bytes.all.current",
                "allocated_bytes.all.peak", "allocation.all.current", "segment.all.current"):
        assert device0[key] == report["stats"][key], key


@pytest.mark.parametrize("variable", ["MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF"])
def test_an_explicit_config_keeps_its_segments(cpu_losses, variable):
    """A user who set any allocator config chose: expandable_segments:False
    (npualloc's default, said out loud) keeps plain segments, with no page
    mapped and still no raw device call after the first step."""
    python = installed_python()
    report, proc = run(cann_root_command([python, "-m", "npualloc", "run", "--", python, *harness("npu")]),
                       mindtorch_env(**{variable: "expandable_segments:False"}))
    assert "npualloc:" not in proc.stderr, proc.stderr
    assert report["losses"] == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    assert report["allocator"] == "PassThroughAllocator"
    assert report["config"] == ""
    first = report["steps"][0]
    assert first["pages"] == 0 and first["mallocs"] > 0 and report["stats"]["segment.all.current"] > 0
    for later in report["steps"][1:]:
        assert ({k: later[k] for k in RAW_CALLS} == {k: first[k] for k in RAW_CALLS}), report["steps"]


def test_raw_mindtorch_allocator_only_grows(cpu_losses):
    """MindTorch alone: same losses, but its allocator never reuses a freed
    block (its event query compares pyACL's (status, ret) tuple to 0), so every
    step mallocs afresh and the device memory it holds only grows."""
    report, proc = run(cann_root_command([sys.executable, *harness("npu")]), mindtorch_env())
    assert report["losses"] == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    assert report["allocator"] == "NpuAllocator"
    mallocs = [s["mallocs"] for s in report["steps"]]
    assert all(b > a for a, b in zip(mallocs, mallocs[1:])), mallocs   # raw mallocs on every step
    held = [s["outstanding"] for s in report["steps"]]
    assert all(b > a for a, b in zip(held, held[1:])), held             # device memory only grows
    # The live set stops growing after step 2 (parameters, gradients, their
    # state), so all MindTorch holds beyond that is memory it never reuses.
    assert report["reserved"] - report["allocated"] >= held[-1] - held[1] > 0
    # The executor destroys MindTorch defers to exit would abort (CANN already
    # destroyed them at phase 2), but this pinned copy never queues one:
    # _defer_executor calls int() on a ctypes.c_void_p, which raises, and it
    # returns. So the raw run exits 0; the test records that.
    assert report["deferred_executors"] == 0
    assert proc.returncode == 0


def test_disabled_leaves_mindtorch_alone():
    python = installed_python()
    report, _ = run(cann_root_command([python, "-m", "npualloc", "run", "--", python, *harness("npu")]),
                    mindtorch_env(NPUALLOC_DISABLE="1"))
    assert report["allocator"] == "NpuAllocator"
