"""A small training-like program on pyACL: what `make demo` and the bench's
pyACL section run, raw and under npualloc.

Each step is a transformer-ish forward and backward over LAYERS layers, with
the batch's sequence length changing from step to step (so activation sizes
vary, and cross the 1 MiB line between the small and the large pool). Every
op is an aclnn-style two-phase call through ctypes on libopapi.so, with its
workspace taken by acl.rt.malloc just before phase 2: the MindTorch v2
pattern, where workspaces bypass any framework cache and each op costs a raw
device malloc and free unless something like npualloc sits underneath.

Frees are deferred to after the stream synchronizes (the forward's end, the
backward's end), because on CANN 7+ aclrtFree does not wait for queued work:
a program on the raw runtime that freed an op's workspace right after
launching it would hand memory to the device that the op is still using.

    train_step.py [--steps N] [--layers L] [--pause-at STEP]

--pause-at STEP: after that step's forward (activations live), print
"ready <pid>" and wait for a line on stdin before going on, so another
process can look at this one (tools/demo.py runs `npualloc stats` then).
The last stdout line is "result <json>": step times (pause excluded), raw
device calls as the simulator counts them, peak device memory held.
Needs the simulator's environment (tools/demo/launch.py sets it up).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time

import acl
import aclsim

SEQ_LENS = (256, 64, 192, 128, 224, 96)   # tokens per sequence, one per step, cycling
BATCH = 4
D_MODEL = 768
FP16 = 2
WEIGHT_BYTES = D_MODEL * 4 * D_MODEL * FP16   # one MLP weight per layer (4.5 MiB)
POLICY_HUGE_FIRST = 0


def check(ret: int, what: str) -> None:
    if ret != 0:
        raise RuntimeError(f"{what} failed: {ret}")


class Ops:
    """aclnnSimFill / aclnnSimCopy bound with ctypes on libopapi.so, as MindTorch
    v2 binds aclnn ops, each run in two phases with its own workspace."""

    def __init__(self, stream: int) -> None:
        lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libopapi.so"),
                          mode=ctypes.RTLD_GLOBAL)
        u64, ptr = ctypes.c_uint64, ctypes.c_void_p
        out = [ctypes.POINTER(u64), ctypes.POINTER(ptr)]
        self.fill_ws = self._bind(lib.aclnnSimFillGetWorkspaceSize, ptr, u64, ctypes.c_int32, *out)
        self.copy_ws = self._bind(lib.aclnnSimCopyGetWorkspaceSize, ptr, ptr, u64, *out)
        self.fill_run = self._bind(lib.aclnnSimFill, ptr, u64, ptr, ptr)
        self.copy_run = self._bind(lib.aclnnSimCopy, ptr, u64, ptr, ptr)
        self.stream = stream
        self.deferred_frees: list[int] = []   # workspaces and buffers to free after the next sync

    @staticmethod
    def _bind(fn, *argtypes):
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int32
        return fn

    def _launch(self, phase1, phase2, *args) -> None:
        size, executor = ctypes.c_uint64(), ctypes.c_void_p()
        check(phase1(*args, ctypes.byref(size), ctypes.byref(executor)), phase1.__name__)
        workspace = 0
        if size.value:
            workspace = malloc(size.value)
            self.deferred_frees.append(workspace)
        check(phase2(workspace, size.value, executor, self.stream), phase2.__name__)

    def fill(self, dst: int, nbytes: int, value: int) -> None:
        self._launch(self.fill_ws, self.fill_run, dst, nbytes, value)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._launch(self.copy_ws, self.copy_run, dst, src, nbytes)

    def synchronize_and_free(self) -> None:
        check(acl.rt.synchronize_stream(self.stream), "synchronize_stream")
        for ptr in self.deferred_frees:
            check(acl.rt.free(ptr), "free")
        self.deferred_frees.clear()


def malloc(nbytes: int) -> int:
    ptr, ret = acl.rt.malloc(nbytes, POLICY_HUGE_FIRST)
    check(ret, f"malloc({nbytes})")
    return ptr


def raw_calls() -> tuple[int, int]:
    """Device mallocs and frees that reached the runtime since the process
    started (npualloc's own included, its segments through aclrtMallocAlign32):
    the same count as npualloc's num_device_alloc / num_device_free."""
    return aclsim.device_malloc_count(), aclsim.call_count("aclrtFree")


def step(ops: Ops, params: list[int], seq_len: int, peak: list[int], pause: bool, mid: list[tuple[int, int]]
         ) -> float:
    """One training step; returns the seconds spent paused in it. With mid,
    the runtime's call counts after the forward pass are appended to it."""
    act = BATCH * seq_len * D_MODEL * FP16
    saved = []
    for layer in range(len(params)):       # forward: MLP up (4x wide), then down
        wide = malloc(4 * act)
        ops.fill(wide, 4 * act, layer)
        out = malloc(act)
        ops.copy(out, wide, act)
        ops.deferred_frees.append(wide)
        saved.append(out)
    peak[0] = max(peak[0], aclsim.bytes_outstanding(0))
    ops.synchronize_and_free()             # the loss is read on the host
    paused = 0.0
    if mid is not None:
        mid.append(raw_calls())
    if pause:
        started = time.perf_counter()
        print(f"ready {os.getpid()}", flush=True)
        sys.stdin.readline()
        paused = time.perf_counter() - started
    for layer in reversed(range(len(params))):   # backward, then the optimizer's update
        grad = malloc(act)
        ops.copy(grad, saved[layer], act)
        weight_grad = malloc(WEIGHT_BYTES)
        ops.fill(weight_grad, WEIGHT_BYTES, 0)
        ops.copy(params[layer], weight_grad, WEIGHT_BYTES)
        ops.deferred_frees += [grad, weight_grad, saved[layer]]
    peak[0] = max(peak[0], aclsim.bytes_outstanding(0))
    ops.synchronize_and_free()
    return paused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--pause-at", type=int, metavar="STEP", help="hand over to another process mid-step")
    args = parser.parse_args()

    check(acl.init(), "acl.init")
    check(acl.rt.set_device(0), "set_device")
    stream, ret = acl.rt.create_stream()
    check(ret, "create_stream")
    ops = Ops(stream)
    params = [malloc(WEIGHT_BYTES) for _ in range(args.layers)]
    for param in params:
        ops.fill(param, WEIGHT_BYTES, 1)
    ops.synchronize_and_free()

    peak = [0]
    step_seconds = []
    calls_before = raw_calls()
    calls_mid: list[tuple[int, int]] = []
    calls_after_first_step = calls_before
    for n in range(args.steps):
        started = time.perf_counter()
        mid_step = args.pause_at if args.pause_at is not None else args.steps // 2
        paused = step(ops, params, SEQ_LENS[n % len(SEQ_LENS)], peak, n == args.pause_at,
                      calls_mid if n == mid_step else None)
        step_seconds.append(time.perf_counter() - started - paused)
        if n == 0:
            calls_after_first_step = raw_calls()
    calls_end = raw_calls()

    for param in params:
        check(acl.rt.free(param), "free")
    check(acl.rt.destroy_stream(stream), "destroy_stream")
    check(acl.rt.reset_device(0), "reset_device")
    check(acl.finalize(), "acl.finalize")
    result = {
        "steps": args.steps,
        "layers": args.layers,
        "npualloc": hasattr(ctypes.CDLL(None), "npualloc_is_active"),
        "step_ms_median": statistics.median(step_seconds) * 1e3,
        "step_ms_first": step_seconds[0] * 1e3,
        "step_ms_mean": statistics.fmean(step_seconds) * 1e3,
        "steps_seconds": sum(step_seconds),
        "raw_mallocs": calls_end[0] - calls_before[0],
        "raw_frees": calls_end[1] - calls_before[1],
        "raw_calls_after_first_step": sum(calls_end) - sum(calls_after_first_step),
        # Since the process started, at the forward end of the pause step (steps // 2 without one).
        "raw_mallocs_since_start_mid": calls_mid[0][0],
        "peak_device_bytes": peak[0],
        "invalid_accesses": aclsim.invalid_accesses(),
        "workspace_clobbers": aclsim.workspace_clobbers(),
    }
    print("result " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
