"""npualloc.h's stream-aware entry (npualloc_malloc_stream, npualloc_free_stream,
npualloc_record_stream) on the simulated runtime, through cffi as the
MindTorch pass-through calls it. A loop that allocates on a stream, launches
on it and frees on it reuses its blocks at once with no runtime call at all
after the first step, while its ops are still queued; a block recorded on
another stream is held back until that stream's work is done. Misuse is
caught by the simulator when the ops execute: an op's workspace handed to
another op while the first still runs is a workspace clobber."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import (SIM_LIB, cann_root_command, compile_c, compile_shim, installed_python, mindtorch_env,
                      preload_env, run_python)

PROGRAM = """
import json, sys, time
import acl
from aclsim import aclsim
from npualloc._ffi import ffi, loaded_library

lib = loaded_library()
assert lib is not None
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
s1, ret = acl.rt.create_stream(); assert ret == 0
s2, ret = acl.rt.create_stream(); assert ret == 0
COUNTED = ("aclrtMalloc", "aclrtMallocAlign32", "aclrtFree", "aclrtRecordEvent", "aclrtQueryEventStatus", "aclrtSynchronizeDevice",
           "aclrtSynchronizeStream", "aclrtCreateEvent")

def malloc(size, stream, flags=0):
    out = ffi.new("void **")
    assert lib.npualloc_malloc_stream(out, size, ffi.cast("void *", stream), flags) == 0
    return int(ffi.cast("uintptr_t", out[0]))

def free(ptr, stream):
    assert lib.npualloc_free_stream(ffi.cast("void *", ptr), ffi.cast("void *", stream)) == 0

def fill(dst, size, value, stream):
    ws_size, ex, st = ops.fill_get_workspace_size(dst, size, value); assert st == 0
    ws = malloc(ws_size, stream)
    assert ops.fill(ws, ws_size, ex, stream) == 0
    free(ws, stream)   # at once, as MindTorch frees a workspace after the launch
    return ws

mode, steps = sys.argv[1], int(sys.argv[2])
destroy_stream = acl.rt.destroy_stream_force if sys.argv[3:] == ["force"] else acl.rt.destroy_stream
N = 1 << 16
if mode == "loop":
    aclsim.set_op_duration_us(2000)   # the host runs ahead: frees come while the ops are queued
    before, addresses = None, set()
    for step in range(steps):
        if step == 1:
            before = {api: aclsim.call_count(api) for api in COUNTED}
        buf = malloc(N, s1)
        addresses.add((buf, fill(buf, N, step & 0xFF, s1)))
        free(buf, s1)
    calls = {api: aclsim.call_count(api) - before[api] for api in COUNTED}
    assert acl.rt.synchronize_device() == 0
    print(json.dumps({"calls_after_first_step": calls, "distinct_blocks": len(addresses),
                      "clobbers": aclsim.workspace_clobbers(), "invalid": aclsim.invalid_accesses()}))
elif mode == "churn":
    aclsim.set_op_duration_us(2000)   # each step's ops still queued when its stream is destroyed
    stats = ffi.new("npualloc_device_stats *")
    left = []
    for step in range(steps):
        s, ret = acl.rt.create_stream(); assert ret == 0
        buf = malloc(N, s)
        fill(buf, N, step & 0xFF, s)
        free(buf, s)
        assert destroy_stream(s) == 0
        assert lib.npualloc_get_stats(0, stats) == 0
        left.append((stats.reserved_bytes[0].current, aclsim.live_allocations(0)))
    print(json.dumps({"left": left, "clobbers": aclsim.workspace_clobbers(), "invalid": aclsim.invalid_accesses()}))
elif mode == "snapshot":
    import npualloc
    npualloc.record_memory_history(max_entries=100)
    buf = malloc(N, s1)
    plain, ret = acl.rt.malloc(N, 0); assert ret == 0
    snapshot = npualloc._snapshot()
    print(json.dumps({"streams": {seg["blocks"][0]["address"]: seg["stream"] for seg in snapshot["segments"]},
                      "events": [[e["action"], e["addr"], e["stream"]] for e in snapshot["device_traces"][0]],
                      "buf": buf, "plain": plain, "s1": s1}))
elif mode == "outlive":
    # Tensors that outlive their stream, freed on it afterwards as MindTorch frees them.
    s, ret = acl.rt.create_stream(); assert ret == 0
    aclsim.set_op_duration_us(2000)
    bufs = [malloc(N, s) for _ in range(steps)]
    for step, buf in enumerate(bufs):
        fill(buf, N, step & 0xFF, s)
    assert acl.rt.destroy_stream(s) == 0
    before = {api: aclsim.call_count(api) for api in COUNTED}
    for buf in bufs:
        free(buf, s)
    calls = {api: aclsim.call_count(api) - before[api] for api in COUNTED}
    stats = ffi.new("npualloc_device_stats *")
    assert lib.npualloc_get_stats(0, stats) == 0
    pending, reserved_after_frees = stats.num_pending_frees, stats.reserved_bytes[0].current
    # The program goes on with plain allocations: the first misses, which
    # records the fence over the live streams; after the program's own
    # synchronize that fence is done, and a poll within 65 mallocs (they
    # back off up to 64) hands the blocks back.
    first, ret = acl.rt.malloc(512, 0); assert ret == 0
    assert acl.rt.synchronize_device() == 0
    assert acl.rt.free(first) == 0
    for _ in range(70):
        ptr, ret = acl.rt.malloc(512, 0); assert ret == 0
        assert acl.rt.free(ptr) == 0
    assert lib.npualloc_get_stats(0, stats) == 0
    print(json.dumps({"calls": calls, "pending": pending, "reserved_after_frees": reserved_after_frees,
                      "reserved_later": stats.reserved_bytes[0].current,
                      "segments_later": stats.segment[0].current, "syncs": stats.num_sync_all_streams,
                      "invalid": aclsim.invalid_accesses()}))
else:
    record = mode == "record"
    slow_us = steps
    # A slow op on s2 uses a block allocated on s1 as its workspace.
    dst = malloc(N, s1)
    aclsim.set_op_duration_us(slow_us)
    ws_size, slow, st = ops.fill_get_workspace_size(dst, N, 1); assert st == 0
    aclsim.set_op_duration_us(0)
    ws = malloc(ws_size, s1)
    started, _ = acl.rt.create_event()
    assert acl.rt.record_event(started, s2) == 0
    assert ops.fill(ws, ws_size, slow, s2) == 0
    assert acl.rt.synchronize_event(started) == 0
    time.sleep(0.02)   # s2's worker has gone on into the slow op (the control below retries if not)
    after_slow, _ = acl.rt.create_event()
    assert acl.rt.record_event(after_slow, s2) == 0
    if record:
        assert lib.npualloc_record_stream(ffi.cast("void *", ws), ffi.cast("void *", s2)) == 0
    free(ws, s1)
    # s1 goes on: the next workspace of its size, used by a quick op on s1.
    again = fill(dst, N, 2, s1)
    assert acl.rt.synchronize_stream(s1) == 0
    raced = acl.rt.query_event_status(after_slow) == (0, 0)   # s1's op ended while s2's still ran
    assert acl.rt.synchronize_device() == 0
    lib.npualloc_empty_cache(0)   # the recorded block is back by now: its event completed
    stats = ffi.new("npualloc_device_stats *")
    assert lib.npualloc_get_stats(0, stats) == 0
    print(json.dumps({"reused": again == ws, "raced": raced, "clobbers": aclsim.workspace_clobbers(),
                      "invalid": aclsim.invalid_accesses(), "pending": stats.num_pending_frees,
                      "events": aclsim.call_count("aclrtRecordEvent")}))
"""


def run(mode: str, arg: int, policy: str = "safe", *extra: str) -> dict:
    proc = run_python(PROGRAM, preload_env(PYTORCH_NPU_ALLOC_CONF=f"reuse_policy:{policy}"),
                      args=[mode, str(arg), *extra])
    out = json.loads(proc.stdout)
    out["reports"] = [line for line in proc.stderr.splitlines() if line]
    return out


@pytest.mark.parametrize("policy", ["safe", "auto"])
def test_same_stream_loop_makes_no_runtime_call_after_the_first_step(policy):
    """Alloc on the stream, launch on it, free on it: from the second step on
    not one raw malloc or free, event or synchronize reaches the runtime
    (reuse_policy safe would fence every aclrtFree), the same two blocks
    come back every step while the ops are still queued, and the simulator
    sees no workspace reused under a running op."""
    out = run("loop", 40, policy)
    assert out["reports"] == []
    assert out["calls_after_first_step"] == {api: 0 for api in out["calls_after_first_step"]}
    assert out["distinct_blocks"] == 1
    assert out["clobbers"] == 0 and out["invalid"] == 0


@pytest.mark.parametrize("destroy", ["wait", "force"])
def test_a_stream_made_and_destroyed_per_step_leaves_nothing_reserved(destroy):
    """aclrtDestroyStream waits for the stream's queued work, and
    aclrtDestroyStreamForce drops what has not run: either way the memory
    cached for the stream goes back to the device there and then, so a
    program making a stream per step does not reserve a segment per step,
    and nothing went back while an op of the stream still used it."""
    out = run("churn", 30, "safe", destroy)
    assert out["reports"] == []
    assert out["left"] == [[0, 0]] * 30
    assert out["clobbers"] == 0 and out["invalid"] == 0


def test_snapshot_segments_and_trace_events_name_their_stream():
    """As torch's segmentInfo.stream and its trace entries' stream: a segment
    of a stream's pools, and each event of its blocks, names that stream;
    aclrtMalloc's (which carries none) stream 0. The events all read 0 once."""
    out = run("snapshot", 0)
    assert out["s1"] != 0
    assert out["streams"] == {str(out["buf"]): out["s1"], str(out["plain"]): 0}
    allocs = [[addr, stream] for action, addr, stream in out["events"] if action == "alloc"]
    assert allocs == [[out["buf"], out["s1"]], [out["plain"], 0]]
    segment_streams = [stream for action, _, stream in out["events"] if action == "segment_alloc"]
    assert segment_streams == [out["s1"], 0]


def test_blocks_that_outlive_their_stream_go_back_once_freed():
    """Freed on their stream after its destroy (which waited for their work):
    the handle may name a new stream by then, so they wait, as plain blocks
    do, for the fence the next poll records over the live streams (no event
    on the dead handle, no runtime call at the free, no synchronize), and
    then their segment goes back to the device with no empty_cache: only
    the segment of the program's own plain allocations stays."""
    out = run("outlive", 10)
    assert out["reports"] == []
    assert out["calls"] == {api: 0 for api in out["calls"]}
    assert out["pending"] == 10 and out["reserved_after_frees"] > 0
    assert out["segments_later"] == 1 and out["reserved_later"] == 2 << 20
    assert out["syncs"] == 0 and out["invalid"] == 0


def _raced(mode: str, caught: bool = False) -> dict:
    """Runs until s1's quick op ended while s2's slow op still ran (a slow
    machine retries with a longer op, never fails on time); with caught, also
    until the simulator saw the clobber (s2's op may not have written its
    stamp yet when s1's op ran)."""
    for retry in range(6):
        out = run(mode, 200_000 << retry)
        if out.pop("raced") and (not caught or out["clobbers"] >= 1):
            return out
    pytest.fail("s1's op never ran while s2's was still running" + (", caught" if caught else ""))


def test_recorded_block_waits_for_the_other_stream():
    out = _raced("record")
    assert out["reports"] == []
    assert out["reused"] is False
    assert out["clobbers"] == 0 and out["invalid"] == 0
    assert out["pending"] == 0
    assert out["events"] == 3   # the program's two, and npualloc's one (s2 only: not one per live stream)


def test_unrecorded_cross_stream_use_is_caught_by_the_simulator():
    """The control: the same program without record_stream breaks torch's
    contract, the block goes back to s1 at once, and the simulator reports
    the workspace clobbered under s2's running op. The test above can fail."""
    out = _raced("unrecorded", caught=True)
    assert out["reused"] is True
    assert any(line.startswith("aclsim: aclnnSimFill: workspace") for line in out["reports"]), out["reports"]
    assert out["events"] == 2   # the program's own two: npualloc recorded none


BAD = """
import threading
import acl
from npualloc._ffi import ffi, loaded_library
lib = loaded_library()
assert acl.init() == 0 and acl.rt.set_device(0) == 0
out = ffi.new("void **")
assert lib.npualloc_malloc_stream(out, 4096, ffi.NULL, 2) == 100000        # unknown flag
assert lib.npualloc_malloc_stream(out, 4096, ffi.NULL, 0) == 0              # the default stream
p = out[0]
assert lib.npualloc_record_stream(ffi.cast("char *", p) + 512, ffi.NULL) == 100000   # interior pointer
assert lib.npualloc_free_stream(p, ffi.NULL) == 0
assert lib.npualloc_free_stream(p, ffi.NULL) == 207002                      # double free
assert lib.npualloc_record_stream(p, ffi.NULL) == 100000                    # freed
# The integer forms: the same answers, the malloc's error kept per thread.
assert lib.npualloc_malloc_stream_addr(4096, 0, 2) == 0 and lib.npualloc_malloc_stream_error() == 100000
other = []
thread = threading.Thread(target=lambda: other.append(lib.npualloc_malloc_stream_error()))
thread.start(); thread.join()
assert other == [0] and lib.npualloc_malloc_stream_error() == 100000
addr = lib.npualloc_malloc_stream_addr(4096, 0, lib.NPUALLOC_STREAM_HOST_WRITES)
assert addr != 0 and lib.npualloc_malloc_stream_error() == 0
assert addr == int(ffi.cast("uintptr_t", p))                                 # the block freed above, reused
assert lib.npualloc_free_stream_addr(addr, 0) == 0
assert lib.npualloc_free_stream_addr(addr, 0) == 207002                     # double free
# Destroying the default stream is the runtime's to refuse; its pools serve on.
q = lib.npualloc_malloc_stream_addr(8192, 0, 0)
assert q != 0 and lib.npualloc_free_stream_addr(q, 0) == 0
assert acl.rt.destroy_stream(0) != 0
assert lib.npualloc_malloc_stream_addr(8192, 0, 0) == q
print("ok")
"""


def test_bad_calls_get_clear_errors():
    proc = run_python(BAD, preload_env())
    assert proc.stdout.strip() == "ok"
    warnings = [line for line in proc.stderr.splitlines() if line]
    assert all(line.startswith("npualloc: ") for line in warnings), proc.stderr
    assert any("npualloc_record_stream" in line for line in warnings), proc.stderr


MINDTORCH = """
import gc, json, sys
import aclsim
import mindtorch_v2 as torch
from mindtorch_v2._backends.npu import allocator
x = torch.ones(4096, device="npu")
side = torch.npu.Stream()
if sys.argv[1] == "record":
    x.record_stream(side)
torch.npu.synchronize()
before = aclsim.call_count("aclrtRecordEvent")
del x
gc.collect()
pending = torch.npu.memory_stats()["npualloc.pending_frees"]
z = torch.empty(4096, device="npu")   # its malloc fences the frees since the last one
print(json.dumps({"events": aclsim.call_count("aclrtRecordEvent") - before, "pending": pending,
                  "allocator": type(allocator.get_allocator(0)).__name__}))
"""


@pytest.mark.parametrize("mode,events", [("record", 2), ("plain", 1)])
def test_mindtorch_record_stream_reaches_npualloc(mode, events):
    """MindTorch's Tensor.record_stream goes to npualloc_record_stream: the
    freed tensor waits for an event on the recorded stream as well as on its
    own (MindTorch writes new tensors with synchronous copies, so the
    pass-through allocates NPUALLOC_STREAM_HOST_WRITES), one event per
    stream for the whole batch of frees."""
    python = installed_python()
    proc = subprocess.run(cann_root_command([python, "-m", "npualloc", "run", "--", python, "-c", MINDTORCH, mode]),
                          env=mindtorch_env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    assert "npualloc:" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["allocator"] == "PassThroughAllocator"
    assert out["pending"] >= 1
    assert out["events"] == events



DEVICES = """
import json, threading
import aclsim, npualloc
import mindtorch_v2 as torch
from mindtorch_v2._backends.npu import allocator
from npualloc._ffi import loaded_library
lib = loaded_library()
torch.ones(16, device="npu")   # device 0 current on this thread, as after any NPU op

def on(device):   # raw memory there: plain segments or the pages of expandable ones (MindTorch's default)
    held = aclsim.bytes_outstanding(device) + aclsim.physical_bytes_outstanding(device)
    return npualloc.memory_stats(device)["allocation.all.current"] == 1 and held > 0

def sets(call):
    before = aclsim.call_count("aclrtSetDevice")
    result = call()
    return result, aclsim.call_count("aclrtSetDevice") - before

out = {}
a0, a1 = allocator.get_allocator(0), allocator.get_allocator(1)
ptrs, out["same_device_sets"] = sets(lambda: [a0.malloc(4096) for _ in range(50)])
for p in ptrs:
    a0.free(p)
p1, out["other_device_sets"] = sets(lambda: a1.malloc(4096))   # from device 0's thread
out["p1_current"] = lib.npualloc_current_device()
out["p1_on_1"] = on(1)
p0, out["back_sets"] = sets(lambda: a0.malloc(4096))
out["back_current"] = lib.npualloc_current_device()

def thread(name, device):
    if device is not None:
        torch.npu.set_device(device)   # this thread's device, MindTorch's way
    mine = {0: a0, 1: a1}
    before = {d: npualloc.memory_stats(d)["allocation.all.current"] for d in (0, 1)}
    ptrs = {d: mine[d].malloc(1 << 20) for d in (0, 1)}
    out[name] = {d: npualloc.memory_stats(d)["allocation.all.current"] - before[d] for d in (0, 1)}
    for d, p in ptrs.items():
        mine[d].free(p)

for name, device in (("fresh_thread", None), ("thread_on_1", 1)):
    t = threading.Thread(target=thread, args=(name, device))
    t.start()
    t.join()
a1.free(p1)
a0.free(p0)
torch.npu.synchronize()
print(json.dumps(out))
"""


def test_mindtorch_allocations_land_on_their_device():
    """The pass-through makes its device current only when npualloc's record
    of the thread's device says it is another: fifty tensors on the current
    device make no aclrtSetDevice, while an allocator of another device, a
    thread that never set one and a thread on device 1 all allocate each
    device's blocks on that device (npualloc's stats and the simulator's
    raw memory per device)."""
    python = installed_python()
    proc = subprocess.run(cann_root_command([python, "-m", "npualloc", "run", "--", python, "-c", DEVICES]),
                          env=mindtorch_env(), capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    assert "npualloc:" not in proc.stderr, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same_device_sets"] == 0
    assert out["other_device_sets"] >= 1 and out["p1_current"] == 1 and out["p1_on_1"]
    assert out["back_sets"] >= 1 and out["back_current"] == 0
    for name in ("fresh_thread", "thread_on_1"):
        assert out[name] == {"0": 1, "1": 1}, (name, out[name])   # one block on each device


CACHING_ALLOCATOR = """
import json, threading
import acl, npualloc
from aclsim import aclsim
from npualloc._ffi import ffi, loaded_library
lib = loaded_library()
assert acl.init() == 0 and acl.rt.set_device(0) == 0
out = ffi.new("void **")
for device in (-1, 16):                                                      # outside NPUALLOC_MAX_DEVICES
    assert lib.npualloc_caching_allocator_alloc(out, 4096, device, ffi.NULL) == 100000
assert lib.npualloc_caching_allocator_alloc(ffi.NULL, 4096, 0, ffi.NULL) == 100000
assert lib.npualloc_caching_allocator_alloc(out, 0, 0, ffi.NULL) == 0 and out[0] == ffi.NULL  # torch's size 0
assert lib.npualloc_caching_allocator_delete(ffi.NULL) == 0
assert lib.npualloc_caching_allocator_alloc(out, 4096, 0, ffi.NULL) == 0
p = out[0]
assert lib.npualloc_caching_allocator_delete(ffi.cast("char *", p) + 64) == 207002   # interior pointer
assert lib.npualloc_caching_allocator_delete(p) == 0
assert lib.npualloc_caching_allocator_delete(p) == 207002                          # double delete
foreign, ret = acl.rt.malloc(4096, 3)  # HUGE_FIRST_P2P: the runtime's own block, never in the cache
assert ret == 0 and lib.npualloc_caching_allocator_delete(ffi.cast("void *", foreign)) == 207002
stats = npualloc.memory_stats()
assert stats["npualloc.foreign_frees"] == 0 and stats["npualloc.invalid_frees"] == 2
assert acl.rt.free(foreign) == 0                                    # still live: not handed to the runtime

def references_taken(call):
    sets, resets = aclsim.call_count("aclrtSetDevice"), aclsim.call_count("aclrtResetDevice")
    call()
    return (aclsim.call_count("aclrtSetDevice") - sets) - (aclsim.call_count("aclrtResetDevice") - resets)

def alloc(device):
    def call():
        assert lib.npualloc_caching_allocator_alloc(out, 4096, device, ffi.NULL) == 0
        assert lib.npualloc_caching_allocator_delete(out[0]) == 0
    return call

seen, errors = [], []
def fresh_thread():
    try:
        seen.append(acl.rt.get_device()[1] != 0)
        seen.append(references_taken(alloc(3)))
        seen.append(acl.rt.get_device())
    except BaseException as e:
        errors.append(repr(e))
thread = threading.Thread(target=fresh_thread)
thread.start()
thread.join()
assert not errors, errors
seen += [references_taken(alloc(1)), references_taken(alloc(1)), references_taken(alloc(0))]
assert acl.rt.get_device() == (0, 0) and lib.npualloc_current_device() == 0
assert acl.rt.reset_device_force(1) == 0
seen.append(references_taken(alloc(1)))
print(json.dumps(seen))
"""


def test_caching_allocator_exports():
    """npualloc_caching_allocator_alloc/_delete, torch's raw_alloc and
    raw_delete: a device outside the table and a NULL out pointer are
    refused, size 0 is a NULL block, NULL deletes nothing; a delete of what
    is no live block of the cache (inside a block, freed, the runtime's own)
    is refused, counted as an invalid free when inside the cache, and never
    handed to the runtime. The device guard's first switch into a device
    keeps that device's reference (a reset dropping its last one would
    release the block's memory), later ones pair each aclrtSetDevice with an
    aclrtResetDevice and the current device is the same afterwards; a thread
    that had no device is left on the kept one; aclrtResetDeviceForce
    releases it and the next allocation keeps it again."""
    proc = run_python(CACHING_ALLOCATOR, preload_env())
    assert proc.stderr == ""
    assert json.loads(proc.stdout) == [True, 1, [3, 0], 1, 0, 0, 1], proc.stdout


def test_a_program_reset_of_the_kept_device_is_kept_again():
    """A thread that had no device is left on the one a guard kept; when the
    program resets it there, that reset drops the kept reference, and the
    next guard into the device keeps one again. Before, the kept record
    stayed set, so the next guard paired its aclrtSetDevice with an
    aclrtResetDevice and left its block's device with no reference at all
    (the force reset below found none: 107000)."""
    proc = run_python("""
        import json, threading, acl
        import npualloc
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        seen = []
        def fresh_thread():
            p = npualloc.caching_allocator_alloc(4096, 1)
            seen.append(acl.rt.get_device())
            seen.append(acl.rt.reset_device(1))
            npualloc.caching_allocator_delete(p)
        t = threading.Thread(target=fresh_thread)
        t.start()
        t.join()
        q = npualloc.caching_allocator_alloc(4096, 1)
        seen += [acl.rt.get_device(), acl.rt.reset_device_force(1)]
        print(json.dumps(seen))
    """, preload_env())
    assert proc.stderr == ""
    assert json.loads(proc.stdout) == [[1, 0], 0, [0, 0], 0], proc.stdout


# What the interposers below see of a thread of theirs through /proc: the
# word a thread sleeps on in a futex wait (its syscall file: the call's
# number, then its first argument), and whether that word is libnpualloc.so's
# (dladdr), a lock of npualloc's held by the thread that waits for it. A
# wait on any other word, the simulator's, libc's (dlsym, malloc), a thread
# start's, is not one. Where /proc does not show the word the tests skip
# (futex_waits_seen).
FUTEX_WAIT_SEEN_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static void nap(void)
{
    const struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
}

/* Thread tid's /proc syscall line into text (NUL-terminated); its length, or -1. */
static ssize_t read_syscall(int tid, char *text, size_t size)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", tid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, text, size - 1);
    close(fd);
    text[n > 0 ? n : 0] = '\0';
    return n;
}

/* The word thread tid sleeps on in a futex call, or NULL where it is in none. */
static void *futex_word(int tid)
{
    char text[128], *word;
    if (read_syscall(tid, text, sizeof text) <= 0 || strtol(text, &word, 10) != SYS_futex)
        return NULL;
    return (void *)strtoull(word, NULL, 16);
}

static int waits_for_npualloc(int tid)
{
    Dl_info in;
    void *word = futex_word(tid);
    return word != NULL && dladdr(word, &in) && in.dli_fname != NULL && strstr(in.dli_fname, "libnpualloc") != NULL;
}
"""

# Whether /proc shows this kernel's threads' futex waits with their word: a
# thread sleeps on a word of the program's and the program looks for it
# (tries bounded, so that a kernel that never names the call ends). Exits 0
# where it is seen, else 1 with what /proc said.
FUTEX_WAIT_PROBE = FUTEX_WAIT_SEEN_C + r"""
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>

static int word, sleeper_tid;

static void *sleeper(void *unused)
{
    (void)unused;
    __atomic_store_n(&sleeper_tid, (int)syscall(SYS_gettid), __ATOMIC_RELEASE);
    while (!__atomic_load_n(&word, __ATOMIC_ACQUIRE))
        syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
    return NULL;
}

int main(void)
{
    pthread_t t;
    if (pthread_create(&t, NULL, sleeper, NULL))
        return 2;
    int tid;
    while ((tid = __atomic_load_n(&sleeper_tid, __ATOMIC_ACQUIRE)) == 0)
        nap();
    char text[128];
    ssize_t n;
    int seen = 0;
    for (int tries = 0; tries < 10000 && (n = read_syscall(tid, text, sizeof text)) >= 0; tries++) {
        if ((seen = futex_word(tid) == (void *)&word))
            break;
        nap();
    }
    int err = errno;
    __atomic_store_n(&word, 1, __ATOMIC_RELEASE);
    syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    pthread_join(t, NULL);
    if (!seen)
        printf("/proc/self/task/<tid>/syscall of a thread in a futex wait on %p: %s\n", (void *)&word,
               n < 0 ? strerror(err) : text);
    return !seen;
}
"""


@pytest.fixture(scope="module")
def futex_waits_seen(tmp_path_factory):
    """Skips a test whose interposer needs FUTEX_WAIT_SEEN_C where /proc
    does not show a futex wait's word (no syscall file, or one that never
    names the call): it would wait for a sign that never comes."""
    prog = compile_c(tmp_path_factory, "futex_wait_probe", FUTEX_WAIT_PROBE)
    proc = subprocess.run([str(prog)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.skip(f"/proc does not show a futex wait's word: {proc.stdout.strip() or proc.returncode}")


# An interposer between npualloc and the runtime (preloaded after npualloc, so
# its lookup of the runtime finds this first) that holds one call: once
# armed, the named thread's first aclrtSetDevice, aclrtResetDeviceForce or
# aclrtGetMemInfo on the device is held after the runtime's return until the
# program releases it, or until the other thread named sleeps on a lock of
# npualloc's (FUTEX_WAIT_SEEN_C: it waits for the held thread). That is the
# thread descheduled between the runtime's return and what follows.
HOLD_C = FUTEX_WAIT_SEEN_C + r"""
#include <stddef.h>

enum { HOLD_SET = 1, HOLD_RESET, HOLD_MEM_INFO };
static int armed, armed_device, held_tid, other_tid, held, released;

void hold_arm(int call, int device, int held_thread, int other_thread)
{
    armed_device = device;
    held_tid = held_thread;
    other_tid = other_thread;
    __atomic_store_n(&armed, call, __ATOMIC_RELEASE);
}
void hold_wait_held(void) { while (!__atomic_load_n(&held, __ATOMIC_ACQUIRE)) nap(); }
void hold_release(void) { __atomic_store_n(&released, 1, __ATOMIC_RELEASE); }

static void hold_if_armed(int call, int device)
{
    int expected = call;
    if (__atomic_load_n(&armed, __ATOMIC_ACQUIRE) != call || device != armed_device ||
        (int)syscall(SYS_gettid) != held_tid ||
        !__atomic_compare_exchange_n(&armed, &expected, 0, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    __atomic_store_n(&held, 1, __ATOMIC_RELEASE);
    while (!__atomic_load_n(&released, __ATOMIC_ACQUIRE) && !waits_for_npualloc(other_tid))
        nap();
}

static void *sim(const char *name) { return dlsym(RTLD_DEFAULT, name); }

int aclrtSetDevice(int device)
{
    int err = ((int (*)(int))sim("simrt_SetDevice"))(device);
    hold_if_armed(HOLD_SET, device);
    return err;
}

int aclrtResetDeviceForce(int device)
{
    int err = ((int (*)(int))sim("simrt_ResetDeviceForce"))(device);
    hold_if_armed(HOLD_RESET, device);
    return err;
}

int aclrtGetMemInfo(int attr, size_t *free_bytes, size_t *total_bytes)
{
    int err = ((int (*)(int, size_t *, size_t *))sim("simrt_GetMemInfo"))(attr, free_bytes, total_bytes);
    int device = -1;
    ((int (*)(int *))sim("simrt_GetDevice"))(&device);
    hold_if_armed(HOLD_MEM_INFO, device);
    return err;
}
"""

# Device 1 kept by a guard of the main thread, then the main thread's force
# reset of it racing a second thread's use of it (both threads on device 0),
# one call held as argv[2] says:
#   reset: the main thread's force reset, after the runtime's release, until
#          the second thread's guarded allocation on device 1 returned;
#   set:   the second thread's guarded allocation, in its aclrtSetDevice of
#          device 1, until the main thread's force reset returned; a guard
#          of the main thread's follows;
#   switch: the second thread's npualloc_mem_get_info of device 1, in the
#          runtime's, until the main thread reset the device and a guard of
#          its own kept it again.
# The device must hold a reference afterwards, whoever's guard kept it.
FORCE_RESET_RACE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { HOLD_SET = 1, HOLD_RESET, HOLD_MEM_INFO };
/* Every function from the global scope: a lookup through the runtime's
 * handle would hand npualloc the runtime's own, past the interposer. */
#define FN(name) ((int (*)())dlsym(RTLD_DEFAULT, name))
#define HOLD(name) ((void (*)(void))dlsym(RTLD_DEFAULT, name))
static int (*guarded_alloc)(void **, size_t, int, void *);
static pthread_barrier_t started;
static int mode, second_tid, second_err = -1;

static void *second_thread(void *block)
{
    FN("aclrtSetDevice")(0);
    second_tid = (int)syscall(SYS_gettid);
    pthread_barrier_wait(&started); /* the main thread arms the hold */
    pthread_barrier_wait(&started);
    if (mode == HOLD_RESET) {
        HOLD("hold_wait_held")(); /* the runtime released device 1 */
        second_err = guarded_alloc(block, 4096, 1, NULL);
        HOLD("hold_release")();
    } else if (mode == HOLD_SET) {
        second_err = guarded_alloc(block, 4096, 1, NULL);
    } else {
        size_t free_bytes, total_bytes;
        second_err = FN("npualloc_mem_get_info")(1, &free_bytes, &total_bytes);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))
        return 2;
    mode = !strcmp(argv[2], "set") ? HOLD_SET : !strcmp(argv[2], "reset") ? HOLD_RESET : HOLD_MEM_INFO;
    guarded_alloc = (int (*)(void **, size_t, int, void *))FN("npualloc_caching_allocator_alloc");
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0))
        return 3;
    void *first = NULL, *second = NULL, *third = NULL;
    if (guarded_alloc(&first, 4096, 1, NULL))
        return 4;
    pthread_barrier_init(&started, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, second_thread, &second);
    pthread_barrier_wait(&started);
    int main_tid = (int)syscall(SYS_gettid);
    void (*arm)(int, int, int, int) = (void (*)(int, int, int, int))dlsym(RTLD_DEFAULT, "hold_arm");
    if (mode == HOLD_RESET)
        arm(mode, 1, main_tid, second_tid);
    else
        arm(mode, 1, second_tid, main_tid);
    pthread_barrier_wait(&started);
    if (mode != HOLD_RESET)
        HOLD("hold_wait_held")(); /* the second thread holds a reference on device 1 */
    int reset = FN("aclrtResetDeviceForce")(1);
    if (mode == HOLD_SET) {
        HOLD("hold_release")();
        pthread_join(t, NULL);
    }
    int third_err = mode == HOLD_RESET ? 0 : guarded_alloc(&third, 4096, 1, NULL);
    if (mode == HOLD_MEM_INFO)
        HOLD("hold_release")();
    if (mode != HOLD_SET)
        pthread_join(t, NULL);
    printf("%d %d %d %d\n", reset, second_err, third_err, FN("aclrtResetDeviceForce")(1));
    return 0;
}
"""


def _run_under_shim(tmp_path_factory: pytest.TempPathFactory, name: str, program: str, shim_name: str,
                    shim_source: str, *args: str) -> list[str]:
    """Builds program and the interposer shim_source, runs the program with
    the shim preloaded after npualloc (between it and the simulator) and the
    simulator's libacl_rt.so as its first argument, and returns the words it
    printed; it must end cleanly, with nothing on stderr."""
    prog = compile_c(tmp_path_factory, name, program)
    shim = compile_shim(prog.parent, shim_name, shim_source)
    env = preload_env()
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{shim}"
    proc = subprocess.run([str(prog), str(SIM_LIB / "libacl_rt.so"), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("held", ["reset", "set", "switch"])
def test_a_force_reset_racing_a_guard_leaves_the_device_a_reference(tmp_path_factory, futex_waits_seen, held):
    """aclrtResetDeviceForce on one thread, device 1 in use on another, and
    afterwards a force reset found no reference on device 1 (107000), where
    a guard's block lives. reset: a guard's aclrtSetDevice came just after
    the runtime's release and found the kept record not yet cleared, so it
    paired it with an aclrtResetDevice, dropping the only reference under
    the block it had just allocated. set: the guard's aclrtSetDevice came
    before the release, and the guard found the record cleared by then and
    kept the reference the reset had dropped; the next guard took the record
    for its own and reset. switch: a device switch of npualloc's (mem info
    here) took its reference before the reset and dropped one after, the
    one a guard had kept since. A guard's aclrtSetDevice with its decision
    to keep, a switch's aclrtSetDevice or aclrtResetDevice and a force reset
    with the record's update are each one step now, and a switch whose
    reference a force reset dropped does not reset again."""
    printed = _run_under_shim(tmp_path_factory, "force_reset_race", FORCE_RESET_RACE, "hold", HOLD_C, held)
    assert printed == ["0", "0", "0", "0"], printed


# The runtime's reset drains the device's streams before it releases the
# device, and a stream's host callback (aclrtLaunchCallback, run by the
# thread that aclrtSubscribeReport named, in its aclrtProcessReport) is work
# it waits for. This interposer is such a runtime: once armed, its
# aclrtResetDeviceForce hands the callback to the report thread and waits
# until the callback has returned, or until the report thread sleeps on a
# lock of npualloc's (FUTEX_WAIT_SEEN_C), and only then releases the device.
DRAIN_C = FUTEX_WAIT_SEEN_C + r"""
static void (*armed)(void), (*posted)(void);
static int report_tid, done, outcome;

void drain_arm(int tid, void (*callback)(void))
{
    report_tid = tid;
    __atomic_store_n(&armed, callback, __ATOMIC_RELEASE);
}

/* The report thread's aclrtProcessReport: runs the one callback posted. */
void drain_process_report(void)
{
    void (*callback)(void);
    while ((callback = __atomic_load_n(&posted, __ATOMIC_ACQUIRE)) == NULL)
        nap();
    callback();
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
}

/* 1: the callback returned while the reset waited; 2: its thread slept on a lock. */
int drain_outcome(void) { return __atomic_load_n(&outcome, __ATOMIC_ACQUIRE); }

int aclrtResetDeviceForce(int device)
{
    void (*callback)(void) = __atomic_exchange_n(&armed, NULL, __ATOMIC_ACQ_REL);
    if (callback != NULL) {
        __atomic_store_n(&posted, callback, __ATOMIC_RELEASE);
        int seen = 0;
        while (!seen) {
            if (__atomic_load_n(&done, __ATOMIC_ACQUIRE))
                seen = 1;
            else if (waits_for_npualloc(report_tid))
                seen = 2;
            else
                nap();
        }
        __atomic_store_n(&outcome, seen, __ATOMIC_RELEASE);
    }
    return ((int (*)(int))dlsym(RTLD_DEFAULT, "simrt_ResetDeviceForce"))(device);
}
"""

# Device 1 kept by a guard of the main thread (device 0), then its force
# reset with a callback pending on one of its streams, which the report
# thread (device 0 current) runs: argv[2] says what the callback does,
#   guard:  a guarded allocation on device 1, the device being reset;
#   switch: npualloc_mem_get_info of device 2, a device switch of npualloc's.
DRAIN_PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define FN(name) ((int (*)())dlsym(RTLD_DEFAULT, name))
static int (*guarded_alloc)(void **, size_t, int, void *);
static int (*mem_get_info)(int, size_t *, size_t *);
static void (*process_report)(void);
static pthread_barrier_t started;
static int guard, report_tid, callback_err = -1;

static void stream_callback(void)
{
    void *block = NULL;
    size_t free_bytes, total_bytes;
    callback_err = guard ? guarded_alloc(&block, 4096, 1, NULL) : mem_get_info(2, &free_bytes, &total_bytes);
}

static void *report_thread(void *unused)
{
    (void)unused;
    if (FN("aclrtSetDevice")(0))
        return NULL;
    report_tid = (int)syscall(SYS_gettid);
    pthread_barrier_wait(&started);
    process_report();
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))
        return 2;
    guard = !strcmp(argv[2], "guard");
    guarded_alloc = (int (*)(void **, size_t, int, void *))FN("npualloc_caching_allocator_alloc");
    mem_get_info = (int (*)(int, size_t *, size_t *))FN("npualloc_mem_get_info");
    process_report = (void (*)(void))dlsym(RTLD_DEFAULT, "drain_process_report");
    void *first = NULL;
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0) || guarded_alloc(&first, 4096, 1, NULL))
        return 3;
    pthread_barrier_init(&started, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, report_thread, NULL);
    pthread_barrier_wait(&started);
    ((void (*)(int, void (*)(void)))dlsym(RTLD_DEFAULT, "drain_arm"))(report_tid, stream_callback);
    int reset = FN("aclrtResetDeviceForce")(1);
    pthread_join(t, NULL);
    printf("%d %d %d\n", reset, callback_err, FN("drain_outcome")());
    return 0;
}
"""


@pytest.mark.parametrize("callback", ["guard", "switch"])
def test_a_force_reset_waits_for_a_callback_that_switches_devices(tmp_path_factory, futex_waits_seen, callback):
    """A force reset waits for its device's streams, a host callback on one
    of them included, and the callback may call npualloc: a guarded
    allocation, a free or a query that switches devices. The force reset
    held ref_lock across the runtime's call, which every switch of ours
    takes: the callback waited for the lock and the reset for the callback,
    for good. Only the record's updates are under the lock now."""
    # The reset, the callback's call, and the callback's end before the release.
    printed = _run_under_shim(tmp_path_factory, "force_reset_drain", DRAIN_PROGRAM, "drain", DRAIN_C, callback)
    assert printed == ["0", "0", "1"], printed


# An interposer that puts a force reset of device 1 between the two calls
# of a switch's way back to device 1 (its aclrtSetDevice and
# aclrtResetDevice), with another thread's aclrtSetDevice of device 1 after
# the release: once armed, the switching thread's aclrtGetMemInfo waits for
# the force reset to begin, its aclrtSetDevice of device 1 then waits for
# the other thread's, and the first force reset releases the device only
# while that aclrtSetDevice waits.
SWITCH_BACK_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { BEGUN = 1, SWITCHING_BACK, RELEASED, OTHER_SET };
static int armed, reset_armed, switching_tid, stage;

static void nap(void)
{
    const struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
}

void back_arm(int tid)
{
    switching_tid = tid;
    __atomic_store_n(&reset_armed, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&armed, 1, __ATOMIC_RELEASE);
}
void back_wait(int until) { while (__atomic_load_n(&stage, __ATOMIC_ACQUIRE) < until) nap(); }
void back_reach(int reached) { __atomic_store_n(&stage, reached, __ATOMIC_RELEASE); }

static int on_switching_thread(void)
{
    return __atomic_load_n(&armed, __ATOMIC_ACQUIRE) && (int)syscall(SYS_gettid) == switching_tid;
}

static void *sim(const char *name) { return dlsym(RTLD_DEFAULT, name); }

int aclrtGetMemInfo(int attr, size_t *free_bytes, size_t *total_bytes)
{
    if (on_switching_thread())
        back_wait(BEGUN);
    return ((int (*)(int, size_t *, size_t *))sim("simrt_GetMemInfo"))(attr, free_bytes, total_bytes);
}

int aclrtSetDevice(int device)
{
    int err = ((int (*)(int))sim("simrt_SetDevice"))(device);
    if (device == 1 && on_switching_thread() && __atomic_load_n(&stage, __ATOMIC_ACQUIRE) == BEGUN) {
        back_reach(SWITCHING_BACK);
        back_wait(OTHER_SET);
    }
    return err;
}

int aclrtResetDeviceForce(int device)
{
    int held = __atomic_exchange_n(&reset_armed, 0, __ATOMIC_ACQ_REL);
    if (held) {
        back_reach(BEGUN);
        back_wait(SWITCHING_BACK);
    }
    int err = ((int (*)(int))sim("simrt_ResetDeviceForce"))(device);
    if (held)
        back_reach(RELEASED);
    return err;
}
"""

# The switching thread has device 1 current and asks npualloc_mem_get_info
# of device 2; the main thread force-resets device 1; a third thread sets
# device 1 once it is released. Printed: the force reset's result, the mem
# info's, and a force reset's afterwards (the third thread's reference).
SWITCH_BACK_PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

enum { BEGUN = 1, SWITCHING_BACK, RELEASED, OTHER_SET };
#define FN(name) ((int (*)())dlsym(RTLD_DEFAULT, name))
static void (*back_wait)(int), (*back_reach)(int);
static pthread_barrier_t started;
static int switching_tid, info_err = -1, other_err = -1;

static void *switching_thread(void *unused)
{
    (void)unused;
    size_t free_bytes, total_bytes;
    if (FN("aclrtSetDevice")(1))
        return NULL;
    switching_tid = (int)syscall(SYS_gettid);
    pthread_barrier_wait(&started); /* the main thread arms the interposer */
    pthread_barrier_wait(&started);
    info_err = FN("npualloc_mem_get_info")(2, &free_bytes, &total_bytes);
    return NULL;
}

static void *other_thread(void *unused)
{
    (void)unused;
    back_wait(RELEASED);
    other_err = FN("aclrtSetDevice")(1);
    back_reach(OTHER_SET);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))
        return 2;
    back_wait = (void (*)(int))dlsym(RTLD_DEFAULT, "back_wait");
    back_reach = (void (*)(int))dlsym(RTLD_DEFAULT, "back_reach");
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0))
        return 3;
    pthread_barrier_init(&started, NULL, 2);
    pthread_t switching, other;
    pthread_create(&switching, NULL, switching_thread, NULL);
    pthread_barrier_wait(&started);
    ((void (*)(int))dlsym(RTLD_DEFAULT, "back_arm"))(switching_tid);
    pthread_create(&other, NULL, other_thread, NULL);
    pthread_barrier_wait(&started);
    int reset = FN("aclrtResetDeviceForce")(1);
    pthread_join(switching, NULL);
    pthread_join(other, NULL);
    printf("%d %d %d %d\n", reset, info_err, other_err, FN("aclrtResetDeviceForce")(1));
    return 0;
}
"""


def test_a_switch_back_across_a_force_reset_drops_no_later_reference(tmp_path_factory):
    """A device switch of npualloc's goes back to the thread's device with
    an aclrtSetDevice and an aclrtResetDevice of it. With a force reset of
    that device between the two (the force reset no longer waits for our
    switches) and another thread's aclrtSetDevice after its release, the
    aclrtResetDevice dropped that thread's reference, the device's only
    one: a later force reset found none (107000). The way back leaves the
    reference alone while a force reset of its device is under way."""
    printed = _run_under_shim(tmp_path_factory, "switch_back", SWITCH_BACK_PROGRAM, "switch_back", SWITCH_BACK_C)
    assert printed == ["0", "0", "0", "0"], printed


# An interposer whose first force reset, once armed, waits before the
# runtime's call until the program says so.
RESET_HELD_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

static int armed, held, released;

void held_arm(void) { __atomic_store_n(&armed, 1, __ATOMIC_RELEASE); }
void held_release(void) { __atomic_store_n(&released, 1, __ATOMIC_RELEASE); }
void held_wait(void)
{
    const struct timespec ms = {0, 1000000};
    while (!__atomic_load_n(&held, __ATOMIC_ACQUIRE))
        nanosleep(&ms, NULL);
}

int aclrtResetDeviceForce(int device)
{
    const struct timespec ms = {0, 1000000};
    if (__atomic_exchange_n(&armed, 0, __ATOMIC_ACQ_REL)) {
        __atomic_store_n(&held, 1, __ATOMIC_RELEASE);
        while (!__atomic_load_n(&released, __ATOMIC_ACQUIRE))
            nanosleep(&ms, NULL);
    }
    return ((int (*)(int))dlsym(RTLD_DEFAULT, "simrt_ResetDeviceForce"))(device);
}
"""

# Device 1 kept by a guard of the main thread (device 0); another thread's
# force reset of it under way (held before the runtime's call) while the
# main thread forks. The child makes two guarded allocations on device 1,
# resets it once (the kept reference) and prints what a force reset then
# finds: no reference (107000) unless its guards left theirs behind.
FORK_DURING_RESET = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#define FN(name) ((int (*)())dlsym(RTLD_DEFAULT, name))
#define HELD(name) ((void (*)(void))dlsym(RTLD_DEFAULT, name))
static int reset_err = -1;

static void *resetting_thread(void *unused)
{
    (void)unused;
    reset_err = FN("aclrtResetDeviceForce")(1);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 2 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))
        return 2;
    int (*guarded_alloc)(void **, size_t, int, void *) =
        (int (*)(void **, size_t, int, void *))FN("npualloc_caching_allocator_alloc");
    void *block = NULL;
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0) || guarded_alloc(&block, 4096, 1, NULL))
        return 3;
    HELD("held_arm")();
    pthread_t t;
    pthread_create(&t, NULL, resetting_thread, NULL);
    HELD("held_wait")();
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        void *first = NULL, *second = NULL;
        int a = guarded_alloc(&first, 4096, 1, NULL), b = guarded_alloc(&second, 4096, 1, NULL);
        int plain = FN("aclrtResetDevice")(1);
        printf("%d %d %d %d\n", a, b, plain, FN("aclrtResetDeviceForce")(1));
        fflush(stdout);
        _exit(0);
    }
    HELD("held_release")();
    pthread_join(t, NULL);
    int status = -1;
    waitpid(child, &status, 0);
    printf("%d %d\n", reset_err, status);
    return 0;
}
"""


def test_a_force_reset_under_way_at_a_fork_is_not_the_childs(tmp_path_factory):
    """A force reset under way in another thread when the program forks
    never returns in the child, which had counted it as running for good:
    each of the child's guards on the device then left its reference
    behind. The child forgets it."""
    # The child's allocations and plain reset, its force reset finding no
    # reference; the parent's force reset and the child's exit status.
    printed = _run_under_shim(tmp_path_factory, "fork_during_reset", FORK_DURING_RESET, "reset_held", RESET_HELD_C)
    assert printed == ["0", "0", "0", "107000", "0", "0"], printed


def test_caching_allocator_with_the_cache_off():
    """NPUALLOC_DISABLE: the runtime's own allocation, on the device named,
    and its own free (the stream entry's contract with the cache off)."""
    proc = run_python("""
        import json, acl
        from aclsim import aclsim
        from npualloc._ffi import ffi, loaded_library
        lib = loaded_library()
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        out = ffi.new("void **")
        assert lib.npualloc_caching_allocator_alloc(out, 4096, 1, ffi.NULL) == 0
        seen = [aclsim.live_allocations(1), acl.rt.get_device()]
        seen.append(lib.npualloc_caching_allocator_delete(out[0]))
        seen.append(aclsim.live_allocations(1))
        seen.append(lib.npualloc_caching_allocator_delete(out[0]))  # the runtime's answer to a double free
        print(json.dumps(seen))
    """, preload_env(NPUALLOC_DISABLE="1"))
    assert json.loads(proc.stdout) == [1, [0, 0], 0, 0, 207002], proc.stdout + proc.stderr


def test_caching_allocator_delete_before_the_first_allocation(tmp_path):
    """Before a process's first allocation no block of npualloc's exists, nor
    in a forked child before its own: a delete there refuses the address
    (207002) as at any other time, never handing it to the runtime. It went
    to aclrtFree: the runtime refused 0x1000 with a line of its own, and the
    child freed its parent's block (a segment of its own) and was told 0."""
    proc = run_python("""
        import json, os, acl
        from aclsim import aclsim
        from npualloc._ffi import ffi, loaded_library
        lib = loaded_library()
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        seen = [lib.npualloc_caching_allocator_delete(ffi.cast("void *", 0x1000))]
        out = ffi.new("void **")
        assert lib.npualloc_caching_allocator_alloc(out, 20 << 20, 0, ffi.NULL) == 0
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1  # the child's failure fails the parent's wait
            try:
                child = [lib.npualloc_caching_allocator_delete(out[0]), aclsim.live_allocations(0)]
                os.write(w, json.dumps(child).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        assert os.waitpid(pid, 0)[1] == 0
        seen += json.loads(os.read(r, 4096))
        seen += [aclsim.call_count("aclrtFree"), lib.npualloc_caching_allocator_delete(out[0])]
        print(json.dumps(seen))
    """, preload_env(NPUALLOC_SHM_DIR=str(tmp_path)))
    assert json.loads(proc.stdout) == [207002, 207002, 1, 0, 0], proc.stdout + proc.stderr
    assert proc.stderr == ""
