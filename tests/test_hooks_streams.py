"""Stream-safe reuse (reuse_policy). aclrtFree carries no stream: a buffer
freed while a slow op on stream A still reads it, then reallocated and written
by stream B, corrupts A's result unless npualloc holds the block back until
work queued before the free has completed."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import HEAP_IN_USE, SIM_LIB, compile_c, preload_env, run_python
from sim_programs import WHILE_QUEUED

HAZARD = """
import json, ctypes, sys
import acl
from aclsim import aclsim
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
mode = sys.argv[1]  # "two": streams A and B; "config": the same made by create_stream_with_config;
                   # "one": the default stream; "late": B made after the free
copy_us = int(sys.argv[2])  # how long A's copy runs before it reads src
make = (lambda: acl.rt.create_stream_with_config(0, 0)) if mode == "config" else acl.rt.create_stream
sa, ret = make() if mode in ("two", "config") else (0, 0)
sb, ret = make() if mode in ("two", "config") else (0, 0)
N = 1 << 16
src, _ = acl.rt.malloc(N, 0)
dst, _ = acl.rt.malloc(N, 0)
host = ctypes.create_string_buffer(b"A" * N, N)
assert acl.rt.memcpy(src, N, ctypes.addressof(host), N, 1) == 0
aclsim.set_op_duration_us(copy_us)  # the copy reads src when it ends
ws_size, copy_ex, st = ops.copy_get_workspace_size(dst, src, N); assert st == 0
ws, _ = acl.rt.malloc(ws_size, 0)
aclsim.set_op_duration_us(0)
fill_ws, _ = acl.rt.malloc(ws_size, 0)
after_copy, _ = acl.rt.create_event()
assert ops.copy(ws, ws_size, copy_ex, sa) == 0
assert acl.rt.record_event(after_copy, sa) == 0
assert acl.rt.free(src) == 0  # the copy has not read it yet
if mode == "late":
    other, _ = acl.rt.malloc(4 << 20, 0)  # the program goes on allocating (another pool) before it makes a stream
    sb, ret = acl.rt.create_stream(); assert ret == 0
src2, _ = acl.rt.malloc(N, 0)  # same size, for stream B
ws2_size, fill_ex, st = ops.fill_get_workspace_size(src2, N, ord("B")); assert st == 0
assert ops.fill(fill_ws, ws2_size, fill_ex, sb) == 0
assert acl.rt.synchronize_stream(sb) == 0
raced = acl.rt.query_event_status(after_copy) == (0, 0)  # B's fill ended while A's copy still ran
assert acl.rt.synchronize_device() == 0
back = ctypes.create_string_buffer(N)
assert acl.rt.memcpy(ctypes.addressof(back), N, dst, N, 2) == 0
print(json.dumps({"reused": src2 == src, "corrupted": back.raw != b"A" * N, "raced": raced}))
"""


def hazard_run(policy, streams, copy_us=200_000):
    env = preload_env(PYTORCH_NPU_ALLOC_CONF=f"reuse_policy:{policy}") if policy else preload_env()
    proc = run_python(HAZARD, env, args=[streams, str(copy_us)])
    assert proc.stderr == ""
    return json.loads(proc.stdout)


def hazard(policy, streams):
    """Whether the block was reused and A's result corrupted; these do not
    depend on how fast the machine runs the two streams."""
    out = hazard_run(policy, streams)
    del out["raced"]
    return out


def test_eager_reuse_corrupts_a_cross_stream_read():
    """The hazard is real: eager hands the block straight back and B's write
    lands before A's read (what the raw runtime also allows). It shows only
    when B's fill ran while A's copy still did (an event says so); a machine
    too slow for that retries with a longer copy, never fails on time."""
    for retry in range(6):
        out = hazard_run("eager", "two", copy_us=200_000 << retry)
        if out.pop("raced"):
            assert out == {"reused": True, "corrupted": True}
            return
    pytest.fail("B's fill never ran while A's copy was still running")


@pytest.mark.parametrize("policy", ["safe", "auto", None])
def test_safe_and_auto_never_reuse_a_block_queued_work_still_reads(policy):
    assert hazard(policy, "two") == {"reused": False, "corrupted": False}


def test_streams_made_with_config_are_fenced_too():
    """MindTorch v2 and torch_npu make their streams with aclrtCreateStreamWithConfig."""
    assert hazard("auto", "config") == {"reused": False, "corrupted": False}


def test_auto_is_eager_on_the_default_stream_alone():
    """One stream runs in order, so reuse at once is safe and auto does it."""
    assert hazard("auto", "one") == {"reused": True, "corrupted": False}


def test_safe_fences_on_the_default_stream_too():
    assert hazard("safe", "one") == {"reused": False, "corrupted": False}


def test_auto_stays_safe_when_the_first_stream_comes_after_an_eager_free():
    """With the default stream alone a free is reusable at once; the first
    stream created must not let that block reach work on the new stream while
    default-stream work queued before the free still reads it."""
    assert hazard("auto", "late") == {"reused": True, "corrupted": False}


# The runtime fails the calls a fence depends on (issue 11 item 6), through the
# exported symbols: a block freed under reuse_policy:safe must stay pending,
# never handed out again nor its segment given back, until a fence or a
# synchronize succeeds. Error codes: the reference's 500000
# (ACL_ERROR_INTERNAL_ERROR) and 207004 (ACL_ERROR_RT_NO_DEVICE).
FAULTS = """
import json, sys
import acl
from aclsim import aclsim
import npualloc
INTERNAL, NO_DEVICE = 500000, 207004
SIZE = 4096
# Plain frees share a fence: a poll records one once this many are open
# (NPA_FENCE_BATCH_BLOCKS, interpose/src/core/pending.c), so the plain
# scenario frees that many to have every malloc try the fence.
FENCE_BATCH = 128
assert acl.init() == 0 and acl.rt.set_device(0) == 0
def malloc():
    p, ret = acl.rt.malloc(SIZE, 0); assert ret == 0, ret
    return p
def pending(device=0):
    return npualloc.memory_stats(device)["npualloc.pending_frees"]
def calls(api):
    return aclsim.call_count(api)
out = {}
if sys.argv[1] == "uses":
    # npualloc.h's stream entry: a block used on another stream waits for an
    # event on that stream (the uses batch), or a synchronize.
    from npualloc._ffi import ffi, loaded_library
    lib = loaded_library()
    s1, ret = acl.rt.create_stream(); assert ret == 0
    s2, ret = acl.rt.create_stream(); assert ret == 0
    def malloc():
        out = ffi.new("void **")
        assert lib.npualloc_malloc_stream(out, SIZE, ffi.cast("void *", s1), 0) == 0
        return int(ffi.cast("uintptr_t", out[0]))
    p = malloc()
    assert lib.npualloc_record_stream(ffi.cast("void *", p), ffi.cast("void *", s2)) == 0
    assert lib.npualloc_free_stream(ffi.cast("void *", p), ffi.cast("void *", s1)) == 0
    freed = [p]
elif sys.argv[1] == "fence":
    freed = [malloc() for _ in range(FENCE_BATCH)]
    for q in freed:
        assert acl.rt.free(q) == 0
    p = freed[0]
else:
    p = malloc()
    assert acl.rt.free(p) == 0
    freed = [p]
out["freed"] = len(freed)
assert pending() == len(freed)
if sys.argv[1] in ("fence", "uses"):
    # Neither an event can be recorded nor the device synchronized.
    aclsim.fail_next_calls("aclrtRecordEvent", 1 << 20, INTERNAL)
    aclsim.fail_next_calls("aclrtSynchronizeDevice", 1 << 20, INTERNAL)
    records, syncs, raw = calls("aclrtRecordEvent"), calls("aclrtSynchronizeDevice"), aclsim.live_allocations(0)
    handed = [malloc() for _ in range(5)]   # each malloc polls, and tries the fence again
    npualloc.empty_cache()                  # must synchronize first: cannot
    out["faulty"] = {"reused": any(q in handed for q in freed), "pending": pending(),
                     "raw_kept": aclsim.live_allocations(0) == raw,
                     "fence_tries": calls("aclrtRecordEvent") - records,
                     "sync_tries": calls("aclrtSynchronizeDevice") - syncs}
    aclsim.fail_next_calls("aclrtRecordEvent", 0, 0)
    aclsim.fail_next_calls("aclrtSynchronizeDevice", 0, 0)
    first = malloc()                        # records the fence now (done already if the stream was quick)
    assert acl.rt.synchronize_device() == 0 # done now
    # A poll that found the fence running asks again after a back-off of a
    # few mallocs (interpose/src/core/pending.c): one of these gets it back.
    later = [malloc() for _ in range(4)]
    out["cleared"] = {"reused": any(q in freed for q in [first, *later]), "pending": pending()}
else:
    # This thread moves to device 1; device 0 cannot be entered to synchronize it.
    assert acl.rt.set_device(1) == 0
    aclsim.fail_next_calls("aclrtSetDevice", 1 << 20, NO_DEVICE)
    enters, raw = calls("aclrtSetDevice"), aclsim.live_allocations(0)
    npualloc.empty_cache()
    out["faulty"] = {"pending": pending(), "raw_kept": aclsim.live_allocations(0) == raw,
                     "enter_tries": calls("aclrtSetDevice") - enters}
    aclsim.fail_next_calls("aclrtSetDevice", 0, 0)
    npualloc.empty_cache()
    out["cleared"] = {"pending": pending(), "raw_left": aclsim.live_allocations(0)}
print(json.dumps(out))
"""


def faults_run(scenario):
    proc = run_python(FAULTS, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"), args=[scenario])
    return json.loads(proc.stdout), proc.stderr


@pytest.mark.parametrize("scenario", ["fence", "uses"])
def test_a_fence_that_cannot_be_recorded_nor_replaced_keeps_the_block_pending(scenario):
    out, _ = faults_run(scenario)
    faulty = out["faulty"]
    assert not faulty["reused"] and faulty["pending"] == out["freed"] and faulty["raw_kept"]
    assert faulty["fence_tries"] >= 5 and faulty["sync_tries"] >= 5  # tried at every poll, failed each time
    # Once the runtime answers again the block is fenced, then handed out.
    assert out["cleared"] == {"reused": True, "pending": 0}


def test_a_device_that_cannot_be_entered_keeps_its_blocks_pending():
    out, stderr = faults_run("enter")
    assert out["faulty"]["enter_tries"] >= 1
    assert out["faulty"]["pending"] == out["freed"] == 1 and out["faulty"]["raw_kept"]
    assert out["cleared"] == {"pending": 0, "raw_left": 0}


# A plain block (aclrtMalloc) is the workspace of an op queued on stream S and
# freed with aclrtFree; S is destroyed meanwhile ("during": from another thread,
# while the op runs; "refused": first, from a thread with no current device,
# which the runtime refuses). The next aclrtMalloc of that size misses and fences
# the open frees: it may hand the block out only once S's op is done (an event
# recorded after the op says so; the simulator also reports a workspace
# changed while its op ran, when the op had stamped it).
DESTROYED_MEANWHILE = """
import ctypes, json, sys, threading
import acl
from aclsim import aclsim
mode, second = sys.argv[1], sys.argv[2] == "second"
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
""" + WHILE_QUEUED + """
rt = ctypes.CDLL(None); rt.aclrtDestroyStream.argtypes = [ctypes.c_void_p]
busy, _ = acl.rt.create_event()
started, _ = acl.rt.create_event()
WS = 20 << 20                          # alone in its segment: a malloc of its size misses
early = []
def attempt(duration_us):
    s, ret = acl.rt.create_stream(); assert ret == 0
    other = acl.rt.create_stream()[0] if second else None
    destroys = []
    if mode == "refused":
        t = threading.Thread(target=lambda: destroys.append(rt.aclrtDestroyStream(ctypes.c_void_p(s))))
        t.start(); t.join()
    dst, _ = acl.rt.malloc(1 << 16, 0)
    aclsim.set_op_duration_us(duration_us)
    n, ex, st = ops.fill_get_workspace_size(dst, 1 << 16, 1); assert st == 0
    ws, _ = acl.rt.malloc(WS, 0)
    assert acl.rt.record_event(started, s) == 0
    assert ops.fill(ws, n, ex, s) == 0 and acl.rt.record_event(busy, s) == 0
    assert acl.rt.free(ws) == 0
    assert acl.rt.synchronize_event(started) == 0   # the op has begun: it sees a write from now on
    if mode == "during":
        entered = aclsim.call_count("aclrtDestroyStream")
        def destroy():
            assert acl.rt.set_device(0) == 0
            destroys.append(acl.rt.destroy_stream(s))
        t = threading.Thread(target=destroy); t.start()
        while aclsim.call_count("aclrtDestroyStream") == entered and t.is_alive():
            pass                       # until the destroy has begun
    queued = still_queued(busy)
    q, _ = acl.rt.malloc(WS, 0)
    early.append(q == ws and still_queued(busy))   # handed out under the op
    assert acl.rt.memset(q, WS, 0x5A, WS) == 0   # its new owner writes it at once
    if mode == "during":
        t.join()
        assert destroys == [0], destroys
    else:
        assert destroys != [0] and acl.rt.destroy_stream(s) == 0, destroys
    if other is not None:
        assert acl.rt.destroy_stream(other) == 0
    assert acl.rt.synchronize_device() == 0
    for p in (q, dst):
        assert acl.rt.free(p) == 0
    return queued
while_queued(attempt)
print(json.dumps({"early": any(early), "clobbers": aclsim.workspace_clobbers(), "invalid": aclsim.invalid_accesses()}))
"""


@pytest.mark.parametrize("policy", ["auto", "safe"])
@pytest.mark.parametrize("mode,second", [("during", "only"), ("during", "second"), ("refused", "only")])
def test_a_block_freed_while_its_stream_is_destroyed_waits_for_its_work(policy, mode, second):
    proc = run_python(DESTROYED_MEANWHILE, preload_env(PYTORCH_NPU_ALLOC_CONF=f"reuse_policy:{policy}"),
                      args=[mode, second])
    assert json.loads(proc.stdout) == {"early": False, "clobbers": 0, "invalid": 0}, proc.stderr


# The start of a script: fenced_pairs(count) makes count plain 4 KiB pairs on
# the current device and returns what their fences cost, in synchronizes and
# event records.
FENCED_PAIRS = """
import acl
from aclsim import aclsim
def fenced_pairs(count):
    before = {api: aclsim.call_count(api) for api in ("aclrtSynchronizeDevice", "aclrtRecordEvent")}
    for _ in range(count):
        ptr, ret = acl.rt.malloc(4096, 0); assert ret == 0
        assert acl.rt.free(ptr) == 0
    return {api: aclsim.call_count(api) - n for api, n in before.items()}
"""

# After a stream goes away by force, 300 plain pairs under reuse_policy:safe,
# counting what their fences cost.
FENCES_AFTER = FENCED_PAIRS + """
import json, sys
assert acl.init() == 0 and acl.rt.set_device(0) == 0 and acl.rt.set_device(0) == 0
gone, ret = acl.rt.create_stream(); assert ret == 0
if sys.argv[1] == "destroy":
    kept, ret = acl.rt.create_stream(); assert ret == 0
    assert acl.rt.destroy_stream_force(gone) == 0
else:   # set twice: only the forced reset releases the device, its streams with it
    assert acl.rt.reset_device_force(0) == 0
    assert acl.rt.set_device(0) == 0
    kept, ret = acl.rt.create_stream(); assert ret == 0
print(json.dumps(fenced_pairs(300)))
"""


@pytest.mark.parametrize("force", ["destroy", "reset"])
def test_fences_leave_streams_gone_by_force_out(force):
    """A stream gone through aclrtDestroyStreamForce, or with its device
    through aclrtResetDeviceForce, is no live stream any more: the fences
    record on the others only, instead of failing on its handle and
    synchronizing the device for every batch."""
    proc = run_python(FENCES_AFTER, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"), args=[force])
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    assert out["aclrtSynchronizeDevice"] == 0 and out["aclrtRecordEvent"] > 0


# Threads that each set device 0, make a stream and reset the device (its
# last reference: the runtime takes the stream down with it), then three
# rounds of 300 plain pairs under reuse_policy:safe on a live stream beside
# them, counting what their fences cost: the first, the second, and the
# third after aclrtResetDeviceForce released the device for certain.
FENCES_AFTER_LAST_RESETS = FENCED_PAIRS + """
import json, threading
assert acl.init() == 0
errors = []
def step():
    try:
        assert acl.rt.set_device(0) == 0
        stream, ret = acl.rt.create_stream(); assert ret == 0
        assert acl.rt.reset_device(0) == 0
    except BaseException as e:
        errors.append(repr(e))
for _ in range(20):
    t = threading.Thread(target=step); t.start(); t.join()
assert errors == [], errors
assert acl.rt.set_device(0) == 0
kept, ret = acl.rt.create_stream(); assert ret == 0
rounds = [fenced_pairs(300), fenced_pairs(300)]
assert acl.rt.reset_device_force(0) == 0 and acl.rt.set_device(0) == 0
kept, ret = acl.rt.create_stream(); assert ret == 0
rounds.append(fenced_pairs(300))
print(json.dumps({"rounds": rounds, "invalid": aclsim.invalid_accesses()}))
"""


def test_fences_stop_recording_on_streams_a_last_reset_took_down():
    """A plain reset that drops the device's last reference destroys its
    streams, and npualloc cannot tell it from one that did not: such a
    stream stayed listed, so every fence tried an event on each one a
    program's threads had left that way (one more every step) before it
    synchronized. The first refusal now makes the device's fences
    synchronize without trying, until aclrtResetDeviceForce releases it."""
    proc = run_python(FENCES_AFTER_LAST_RESETS, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"))
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    first, second, released = out["rounds"]
    assert first["aclrtSynchronizeDevice"] > 0   # the dead streams refused: only a synchronize covers them
    assert second["aclrtRecordEvent"] == 0 and second["aclrtSynchronizeDevice"] == first["aclrtSynchronizeDevice"]
    assert released["aclrtSynchronizeDevice"] == 0 and released["aclrtRecordEvent"] > 0
    assert out["invalid"] == 0


# A step that makes a stream and resets the device at its last reference
# (the runtime takes the stream down with it, unseen by npualloc), 2,100
# steps and then 6,300 more, with npualloc's host memory after each; then
# 300 plain pairs under reuse_policy:safe on a live stream, counting what
# their fences cost.
STREAMS_LEFT_BY_LAST_RESETS = FENCED_PAIRS + HEAP_IN_USE + """
import json
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ptr, ret = acl.rt.malloc(4096, 0); assert ret == 0 and acl.rt.free(ptr) == 0
def steps(count):
    for _ in range(count):
        stream, ret = acl.rt.create_stream(); assert ret == 0
        assert acl.rt.reset_device(0) == 0 and acl.rt.set_device(0) == 0
steps(2100)
after_n = heap_in_use()
steps(6300)
after_4n = heap_in_use()
kept, ret = acl.rt.create_stream(); assert ret == 0
print(json.dumps({"grown": after_4n - after_n, "fences": fenced_pairs(300), "invalid": aclsim.invalid_accesses()}))
"""


def test_streams_a_last_reset_took_down_are_not_kept_without_bound():
    """A program that makes a stream and resets the device (its last
    reference) each step, with no fence in between to find the stream gone:
    each dead stream stayed listed, 8 bytes a step for as long as the run
    lasted (96 KiB more over 6,300 steps, in an array of 128 KiB; none now),
    and the first fence then tried an event on every one. No device holds more than
    2,048 streams (aclrtCreateStream's limit, its default stream included),
    so a longer list holds dead ones: the device's fences synchronize from
    then on, as after a fence found one (the test above)."""
    proc = run_python(STREAMS_LEFT_BY_LAST_RESETS, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"),
                      timeout=120)
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    assert out["grown"] < 64 << 10, out
    assert out["fences"]["aclrtRecordEvent"] == 0 and out["fences"]["aclrtSynchronizeDevice"] > 0, out
    assert out["invalid"] == 0


# One event refused by a live stream for a reason of the moment (500000,
# ACL_ERROR_INTERNAL_ERROR), between two rounds of 1000 plain pairs under
# reuse_policy:safe, and a third round after them.
FENCES_AFTER_ONE_REFUSAL = FENCED_PAIRS + """
import json
assert acl.init() == 0 and acl.rt.set_device(0) == 0
stream, ret = acl.rt.create_stream(); assert ret == 0
rounds = [fenced_pairs(1000)]
aclsim.fail_next_calls("aclrtRecordEvent", 1, 500000)
rounds += [fenced_pairs(1000), fenced_pairs(1000)]
print(json.dumps({"rounds": rounds, "invalid": aclsim.invalid_accesses()}))
"""


def test_a_refusal_of_the_moment_costs_one_synchronize_not_every_fence():
    """Only a refusal naming the stream unknown (a stream the runtime took
    down) makes the device's fences synchronize for good: one that says the
    event could not be taken this time made every later fence of the run
    synchronize (8 in each round of 1000 pairs, for the rest of the run)."""
    proc = run_python(FENCES_AFTER_ONE_REFUSAL, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"))
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    before, refused, after = out["rounds"]
    assert before["aclrtSynchronizeDevice"] == 0 and before["aclrtRecordEvent"] > 0
    assert refused["aclrtSynchronizeDevice"] == 1  # the fence whose event was refused
    assert after["aclrtSynchronizeDevice"] == 0 and after["aclrtRecordEvent"] > 0  # fenced by events again
    assert out["invalid"] == 0


DROPPED_FENCE = """
import acl, json
from aclsim import aclsim
import npualloc
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
kept, ret = acl.rt.create_stream(); assert ret == 0
N = 1 << 16
for retry in range(8):
    gone, ret = acl.rt.create_stream(); assert ret == 0
    busy, ret = acl.rt.create_event(); assert ret == 0
    target, _ = acl.rt.malloc(N, 0)
    aclsim.set_op_duration_us(50_000 << retry)
    size, slow, st = ops.fill_get_workspace_size(target, N, 7); assert st == 0
    aclsim.set_op_duration_us(0)
    ws, _ = acl.rt.malloc(max(size, 512), 0)
    assert ops.fill(ws, size, slow, gone) == 0
    assert acl.rt.record_event(busy, gone) == 0
    blocks = [acl.rt.malloc(N, 0)[0] for _ in range(40)]
    for ptr in blocks:
        assert acl.rt.free(ptr) == 0
    later, _ = acl.rt.malloc(N, 0)   # a miss: the 40 frees' fence, its event on gone behind the slow op
    assert acl.rt.destroy_stream_force(gone) == 0
    if acl.rt.query_event_status(busy) == (0, 0):
        break                        # dropped with everything queued behind the slow op
    for ptr in (target, ws, later):
        assert acl.rt.free(ptr) == 0
else:
    raise AssertionError("the slow op always ended before the destroy")
assert acl.rt.synchronize_device() == 0
for i in range(300):
    ptr, ret = acl.rt.malloc(N + 512 * (i % 7), 0); assert ret == 0
    assert acl.rt.free(ptr) == 0
stats = npualloc.memory_stats()
print(json.dumps({"pending": stats["npualloc.pending_frees"], "reserved": stats["reserved_bytes.all.current"],
                  "retries": stats["num_alloc_retries"], "invalid": aclsim.invalid_accesses()}))
"""


def test_fences_behind_work_a_forced_destroy_dropped_do_not_hold_frees():
    """The event a fence recorded on a stream behind work that
    aclrtDestroyStreamForce then dropped never completes on the simulator
    (the runtime does not say it will): such events are not waited for once
    the destroy returns. Waiting for them held that batch and, as batches
    complete in order, every plain free after it: 340 frees pending and a
    new segment every few steps."""
    proc = run_python(DROPPED_FENCE, preload_env(PYTORCH_NPU_ALLOC_CONF="reuse_policy:safe"))
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    assert out["pending"] < 40 and out["reserved"] <= 4 << 20
    assert out["retries"] == 0 and out["invalid"] == 0


# Two threads create the process's first streams at once while a slow op
# runs on the default stream. C, so that nothing like the GIL orders them.
FIRST_STREAMS = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

static void *rt, *ops;
#define FN(h, name) ((int (*)())dlsym(h, name))

static void *create_first(void *out)
{
    FN(rt, "aclrtSetDevice")(0);
    FN(rt, "aclrtCreateStream")((void **)out);
    return NULL;
}

int main(int argc, char **argv)
{
    rt = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    ops = dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL);
    uint64_t (*count)(const char *) = (uint64_t (*)(const char *))dlsym(rt, "aclsim_call_count");
    void (*duration)(uint64_t) = (void (*)(uint64_t))dlsym(rt, "aclsim_set_op_duration_us");
    if (FN(rt, "aclInit")(NULL) || FN(rt, "aclrtSetDevice")(0)) return 3;
    for (int retry = 0; retry < 8; retry++) {
        void *dst = NULL, *ws = NULL, *ex = NULL, *done = NULL, *first = NULL, *second = NULL;
        uint64_t ws_size = 0;
        int status = -1;
        FN(rt, "aclrtMalloc")(&dst, (size_t)4096, 0);
        duration((uint64_t)200000 << retry);
        FN(ops, "aclnnSimFillGetWorkspaceSize")(dst, (uint64_t)4096, 1, &ws_size, &ex);
        duration(0);
        FN(rt, "aclrtMalloc")(&ws, (size_t)(ws_size ? ws_size : 512), 0);
        FN(rt, "aclrtCreateEvent")(&done);
        FN(ops, "aclnnSimFill")(ws, ws_size, ex, NULL);
        FN(rt, "aclrtRecordEvent")(done, NULL);
        uint64_t syncs = count("aclrtSynchronizeDevice");
        pthread_t t;
        pthread_create(&t, NULL, create_first, &first);
        while (count("aclrtSynchronizeDevice") == syncs)
            ; /* until the first creator synchronizes */
        FN(rt, "aclrtQueryEventStatus")(done, &status);
        int running = status == 0;
        FN(rt, "aclrtCreateStream")(&second);
        FN(rt, "aclrtQueryEventStatus")(done, &status);
        pthread_join(t, NULL);
        if (running) {
            printf("second_returned_with_op_done=%d\n", status == 1);
            return 0;
        }
        FN(rt, "aclrtSynchronizeDevice")();
        FN(rt, "aclrtDestroyStream")(first);
        FN(rt, "aclrtDestroyStream")(second);
    }
    return 5; /* the op always ended before the second creator came */
}
"""


def test_a_second_first_stream_waits_for_the_first_ones_synchronize(tmp_path_factory):
    """Under reuse_policy:auto the first stream's creation synchronizes the
    devices in use (blocks freed eagerly until then may still be read by the
    default stream). A second thread creating a stream meanwhile found the
    count no longer 0 and handed its stream out before that synchronize
    ended; it now waits for it."""
    prog = compile_c(tmp_path_factory, "first_streams", FIRST_STREAMS)
    proc = subprocess.run([str(prog), str(SIM_LIB / "libacl_rt.so"), str(SIM_LIB / "libopapi.so")],
                          env=preload_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "second_returned_with_op_done=1"

