"""aclnn executors under npualloc. The simulator aborts on a destroy of an
executor that phase 2 already destroyed (the real runtime's double free) and
counts a repeatable executor destroyed while its launches are still queued.
MindTorch v2 binds aclDestroyAclOpExecutor with ctypes (a dlsym on the
library handle), as aclsim.Ops does here."""
from __future__ import annotations

import json

import pytest

from conftest import HEAP_IN_USE, NPUALLOC_LIB, compile_shim, preload_env, run_python, sim_env

PRELUDE = """
import json, os, ctypes
import acl
from aclsim import aclsim
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
stream, ret = acl.rt.create_stream(); assert ret == 0
def emit(**kw):
    print(json.dumps(kw), flush=True)
def launch_fill(dst, nbytes, value, repeatable=False, times=1):
    ws_size, ex, st = ops.fill_get_workspace_size(dst, nbytes, value); assert st == 0
    ws, ret = acl.rt.malloc(ws_size, 0); assert ret == 0
    if repeatable:
        assert ops.set_repeatable(ex) == 0
    for _ in range(times):
        assert ops.fill(ws, ws_size, ex, stream) == 0
    return ex, ws
# A repeatable fill launched behind ops of 50 ms << retry, `after` recorded
# behind it: still queued when looked at, unless the machine stalled that
# long (the caller tries again with a longer op).
def launch_queued(buf, after, retry):
    aclsim.set_op_duration_us(50_000 << retry)
    ex, _ = launch_fill(buf, 4096, 7, repeatable=True)
    assert acl.rt.record_event(after, stream) == 0
    return ex
"""


def run(code, env, **kw):
    proc = run_python(PRELUDE + code, env, check=False, **kw)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), proc


# MindTorch v2: keep every executor, destroy them all at the end.
MINDTORCH_DEFER_ALL = """
aclsim.set_op_duration_us(500)
buf, _ = acl.rt.malloc(1 << 16, 0)
deferred, workspaces = [], []
for i in range(30):
    ex, ws = launch_fill(buf, 4096, i, repeatable=(i % 5 == 0), times=2 if i % 5 == 0 else 1)
    deferred.append(ex)
    workspaces.append(ws)
assert acl.rt.synchronize_stream(stream) == 0
for ex in deferred:
    assert ops.destroy_executor(ex) == 0
for ws in workspaces:
    assert acl.rt.free(ws) == 0
assert acl.rt.free(buf) == 0
assert acl.rt.destroy_stream(stream) == 0
assert acl.rt.reset_device(0) == 0
assert acl.finalize() == 0
emit(live=aclsim.executors_live(), destroyed=aclsim.executors_destroyed(),
     forwarded=aclsim.call_count("aclDestroyAclOpExecutor"), violations=aclsim.executor_violations())
"""


def test_mindtorch_defer_all_pattern_runs_under_npualloc():
    out, proc = run(MINDTORCH_DEFER_ALL, preload_env())
    assert proc.returncode == 0, proc.stderr
    # 24 plain executors died in phase 2; the 6 repeatable ones reached the
    # runtime once each, so nothing is left and nothing was destroyed twice.
    assert out == {"live": 0, "destroyed": 30, "forwarded": 6, "violations": 0}
    assert proc.stderr == ""


def test_mindtorch_defer_all_pattern_aborts_without_npualloc():
    out, proc = run(MINDTORCH_DEFER_ALL, sim_env())
    assert proc.returncode != 0 and out is None
    assert "double free of aclOpExecutor" in proc.stderr


# torch-style per-op cleanup: destroy right after phase 2, work still queued.
PER_OP_DESTROY = """
aclsim.set_op_duration_us(20000)
buf, _ = acl.rt.malloc(1 << 16, 0)
rets = []
for i in range(10):
    ex, ws = launch_fill(buf, 4096, i)
    rets.append(ops.destroy_executor(ex))
    rets.append(ops.destroy_executor(ex))  # and once more for good measure
reached = aclsim.call_count("aclDestroyAclOpExecutor")
assert acl.rt.synchronize_stream(stream) == 0
emit(rets=sorted(set(rets)), reached=reached, live=aclsim.executors_live(), destroyed=aclsim.executors_destroyed())
"""


def test_per_op_destroy_after_phase2_is_a_skipped_noop():
    out, proc = run(PER_OP_DESTROY, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"rets": [0], "reached": 0, "live": 0, "destroyed": 10}
    assert proc.stderr == ""


def test_per_op_destroy_aborts_without_npualloc():
    _, proc = run(PER_OP_DESTROY, sim_env())
    assert proc.returncode != 0
    assert "double free of aclOpExecutor" in proc.stderr


# A repeatable executor destroyed while its launch is queued: npualloc waits
# for the queued work before the destroy reaches the runtime. An attempt
# counts only when an event recorded after the launches was still NOT_READY
# after the destroy (the work was queued then); a machine too slow for that
# retries with longer ops: events decide, never time.
REPEATABLE_IN_FLIGHT = """
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
for retry in range(8):
    aclsim.set_op_duration_us(50_000 << retry)
    ex, ws = launch_fill(buf, 4096, 7, repeatable=True, times=2)
    assert acl.rt.record_event(after, stream) == 0
    before = aclsim.call_count("aclDestroyAclOpExecutor")
    violations_before = aclsim.executor_violations()
    assert ops.destroy_executor(ex) == 0
    reached_at_once = aclsim.call_count("aclDestroyAclOpExecutor") - before
    queued = acl.rt.query_event_status(after) == (0, 0)
    assert acl.rt.synchronize_device() == 0  # the fence's events on every stream have run
    p, _ = acl.rt.malloc(512, 0)  # any later call drains the deferred destroy
    reached_later = aclsim.call_count("aclDestroyAclOpExecutor") - before
    violations = aclsim.executor_violations() - violations_before
    if queued:
        break
emit(queued=queued, reached_at_once=reached_at_once, reached_later=reached_later,
     violations=violations, live=aclsim.executors_live())
"""


def test_repeatable_destroy_waits_for_queued_work():
    out, proc = run(REPEATABLE_IN_FLIGHT, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "reached_at_once": 0, "reached_later": 1, "violations": 0, "live": 0}


def test_repeatable_destroy_in_flight_is_a_violation_without_npualloc():
    out, proc = run(REPEATABLE_IN_FLIGHT, sim_env())
    assert proc.returncode == 0, proc.stderr
    assert out["queued"] and out["violations"] == 1 and out["reached_at_once"] == 1


def test_deferred_destroys_left_at_exit_without_finalize():
    """Work still queued when the program ends, its executor's destroy
    deferred: the exit leaves the destroy to the runtime's teardown (README),
    so nothing destroys the executor under the queued work (the simulator
    would report it on stderr) and nothing hangs."""
    out, proc = run("""
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
for retry in range(8):  # until the launch is seen still queued after its destroy
    aclsim.set_op_duration_us(50_000 << retry)
    before = aclsim.call_count("aclDestroyAclOpExecutor")
    ex, ws = launch_fill(buf, 4096, 7, repeatable=True)
    assert acl.rt.record_event(after, stream) == 0
    assert ops.destroy_executor(ex) == 0
    reached = aclsim.call_count("aclDestroyAclOpExecutor") - before
    if acl.rt.query_event_status(after) == (0, 0):
        break
emit(reached=reached)
""", preload_env())
    assert proc.returncode == 0 and out == {"reached": 0}
    assert proc.stderr == ""


def test_executor_destroys_are_counted_in_stats():
    out, proc = run("""
aclsim.set_op_duration_us(0)
buf, _ = acl.rt.malloc(1 << 16, 0)
for i in range(4):
    ex, ws = launch_fill(buf, 4096, i, repeatable=(i == 0))
    assert acl.rt.synchronize_stream(stream) == 0
    ops.destroy_executor(ex)
    ops.destroy_executor(ex)
assert acl.rt.synchronize_device() == 0
acl.rt.malloc(512, 0)  # drains the deferred destroy
import npualloc
s = npualloc.memory_stats(0)
emit(skipped=s["npualloc.executor_destroys_skipped"], forwarded=s["npualloc.executor_destroys_forwarded"])
""", preload_env())
    assert proc.returncode == 0, proc.stderr
    # 3 plain executors destroyed twice + the repeatable one's second destroy
    assert out == {"skipped": 7, "forwarded": 1}


def test_executor_table_stays_small_over_millions_of_destroys():
    """Repeatable executors made and destroyed one at a time, at addresses
    that never repeat (the simulator's handles; a long run's heap moves too):
    one is live at a time, so the hook's table of them must not grow with
    the number made (each destroy leaves a tombstone, and the table once
    doubled at every rebuild: 8 MiB after a million)."""
    out, proc = run(HEAP_IN_USE + """
buf, _ = acl.rt.malloc(4096, 0)
before = heap_in_use()
for _ in range(400000):
    ws_size, ex, st = ops.fill_get_workspace_size(buf, 16, 1); assert st == 0
    assert ops.set_repeatable(ex) == 0
    assert ops.destroy_executor(ex) == 0
emit(grown=heap_in_use() - before,
     forwarded=aclsim.call_count("aclDestroyAclOpExecutor"))
""", preload_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert out["forwarded"] == 400000
    assert out["grown"] < (1 << 20), out



def test_destroy_without_a_device_enters_no_device_the_process_never_used():
    """A process on device 1 destroys executors where no device is current:
    from a thread that never set one, and after resetting its device (a
    common teardown order). The destroys are counted, on the device the
    process used; counting them on device 0 made npualloc's state for device
    0, whose memory it asked for by entering it (aclrtSetDevice,
    aclrtGetMemInfo, aclrtResetDevice), in a process that never touched it."""
    proc = run_python("""
import json, threading
import acl, npualloc
from aclsim import aclsim
assert acl.init() == 0 and acl.rt.set_device(1) == 0
ops = aclsim.Ops()
stream, ret = acl.rt.create_stream(); assert ret == 0
buf, _ = acl.rt.malloc(1 << 16, 0)
plain = []
for value in (1, 2):
    ws_size, ex, st = ops.fill_get_workspace_size(buf, 4096, value); assert st == 0
    ws, ret = acl.rt.malloc(ws_size, 0); assert ret == 0
    assert ops.fill(ws, ws_size, ex, stream) == 0  # plain: phase 2 destroyed it
    plain.append(ex)
assert acl.rt.synchronize_stream(stream) == 0
names = ("aclrtSetDevice", "aclrtGetMemInfo", "aclrtResetDevice")
calls = dict.fromkeys(names, 0)
def destroy(executor):
    before = {name: aclsim.call_count(name) for name in names}
    rets.append(ops.destroy_executor(executor))
    for name in names:
        calls[name] += aclsim.call_count(name) - before[name]
rets = []
thread = threading.Thread(target=destroy, args=(plain[0],))  # no device set there
thread.start(); thread.join()
assert acl.rt.destroy_stream(stream) == 0 and acl.rt.reset_device(1) == 0
destroy(plain[1])  # no device current after the reset
print(json.dumps(dict(rets=rets, calls=calls, skipped=npualloc.memory_stats(1)["npualloc.executor_destroys_skipped"])))
""", preload_env())
    assert json.loads(proc.stdout) == {"rets": [0, 0], "skipped": 2,
                                       "calls": {"aclrtSetDevice": 0, "aclrtGetMemInfo": 0, "aclrtResetDevice": 0}}
    assert proc.stderr == ""


def test_repeatable_destroy_after_finalize_is_forwarded_without_runtime_calls():
    """A C++ program's executor wrappers destroyed after aclFinalize (static
    destructors), the device still current: aclFinalize waited for the work,
    and after it nothing of npualloc's calls the runtime. The destroy used
    to fence the device (aclrtCreateEvent, then aclrtSynchronizeDevice, both
    refused), kept the executor for good and warned."""
    out, proc = run("""
buf, _ = acl.rt.malloc(1 << 16, 0)
ex, ws = launch_fill(buf, 4096, 7, repeatable=True)
assert acl.rt.synchronize_stream(stream) == 0 and acl.rt.destroy_stream(stream) == 0
assert acl.finalize() == 0
names = ("aclrtGetDevice", "aclrtSetDevice", "aclrtCreateEvent", "aclrtRecordEvent", "aclrtSynchronizeDevice")
before = {name: aclsim.call_count(name) for name in names}
ret = ops.destroy_executor(ex)
emit(ret=ret, live=aclsim.executors_live(), forwarded=aclsim.call_count("aclDestroyAclOpExecutor"),
     calls={name: aclsim.call_count(name) - before[name] for name in names})
""", preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"ret": 0, "live": 0, "forwarded": 1, "calls": dict.fromkeys(
        ("aclrtGetDevice", "aclrtSetDevice", "aclrtCreateEvent", "aclrtRecordEvent", "aclrtSynchronizeDevice"), 0)}
    assert proc.stderr == ""


def test_destroys_after_finalize_on_a_device_without_state_make_none():
    """Executors destroyed after aclFinalize on a thread whose current
    device npualloc never allocated on (device 1 here): counting them made
    npualloc's state for that device, which asks the runtime for its memory
    (aclrtGetMemInfo) after aclFinalize, where nothing of ours calls it. A
    device with state still counts them."""
    out, proc = run("""
import threading, npualloc
buf, _ = acl.rt.malloc(1 << 16, 0)
plain, _ = launch_fill(buf, 4096, 7)  # phase 2 destroyed it: its destroy is skipped
kept, _ = launch_fill(buf, 4096, 8, repeatable=True)
assert acl.rt.synchronize_stream(stream) == 0 and acl.rt.destroy_stream(stream) == 0
assert acl.rt.set_device(1) == 0 and acl.finalize() == 0
names = ("aclrtGetDevice", "aclrtSetDevice", "aclrtResetDevice", "aclrtGetMemInfo")
before = {name: aclsim.call_count(name) for name in names}
rets = [ops.destroy_executor(plain), ops.destroy_executor(kept)]
calls = {name: aclsim.call_count(name) - before[name] for name in names}
thread = threading.Thread(target=lambda: rets.append(ops.destroy_executor(plain)))
thread.start(); thread.join()  # no device there: counted on device 0, which has its state
s = npualloc.memory_stats(0)
emit(rets=rets, calls=calls, live=aclsim.executors_live(), skipped=s["npualloc.executor_destroys_skipped"])
""", preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"rets": [0, 0, 0], "calls": dict.fromkeys(
        ("aclrtGetDevice", "aclrtSetDevice", "aclrtResetDevice", "aclrtGetMemInfo"), 0), "live": 0, "skipped": 1}
    assert proc.stderr == ""


# realloc refused once, when armed, to a caller inside libnpualloc.so: the
# first growth of the list of deferred destroys.
REFUSED_GROWTH_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

extern void *__libc_realloc(void *ptr, size_t size);
static int armed;

void refuse_next_growth(void) { __atomic_store_n(&armed, 1, __ATOMIC_SEQ_CST); }

void *realloc(void *ptr, size_t size)
{
    Dl_info info;
    if (ptr == NULL && __atomic_load_n(&armed, __ATOMIC_SEQ_CST) &&
        dladdr(__builtin_return_address(0), &info) && info.dli_fname != NULL &&
        strstr(info.dli_fname, "libnpualloc") != NULL && __atomic_exchange_n(&armed, 0, __ATOMIC_SEQ_CST))
        return NULL;
    return __libc_realloc(ptr, size);
}
"""


def test_repeatable_destroy_with_no_room_to_defer_is_kept_when_the_device_cannot_be_synchronized(tmp_path):
    """No host memory to defer a repeatable executor's destroy, and the
    synchronize that stands in for its fence refused: nothing proves that
    the queued launch is done, so the executor is kept (as when no fence can
    be recorded), not destroyed under the launch."""
    shim = compile_shim(tmp_path, "refused_growth", REFUSED_GROWTH_C)
    out, proc = run(f"""
shim = ctypes.CDLL({str(shim)!r})
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
for retry in range(8):  # until the launch is seen still queued after its destroy
    ex = launch_queued(buf, after, retry)
    before = aclsim.call_count("aclDestroyAclOpExecutor")
    violations_before = aclsim.executor_violations()
    shim.refuse_next_growth()
    aclsim.fail_next_calls("aclrtSynchronizeDevice", 1, 500000)
    ret = ops.destroy_executor(ex)
    queued = acl.rt.query_event_status(after) == (0, 0)
    assert acl.rt.synchronize_device() == 0
    if queued:
        break
emit(queued=queued, ret=ret, reached=aclsim.call_count("aclDestroyAclOpExecutor") - before,
     violations=aclsim.executor_violations() - violations_before)
""", {**preload_env(), "LD_PRELOAD": f"{shim} {NPUALLOC_LIB}"})
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "ret": 0, "reached": 0, "violations": 0}
    assert proc.stderr.count("npualloc: cannot fence or synchronize device 0: an aclnn executor is kept") == 1


def test_a_destroy_the_runtime_refuses_returns_its_error_and_can_be_retried():
    """A repeatable executor's destroy forwarded at once (here after
    aclFinalize, which waited for the work) that the runtime refuses: the
    caller gets the runtime's error, as without npualloc, and the executor
    is still known to be repeatable, so the retry reaches the runtime and
    destroys it. It returned 0 and forgot the executor: the retry was
    skipped as a second destroy, and the executor was never destroyed."""
    out, proc = run("""
buf, _ = acl.rt.malloc(1 << 16, 0)
ex, ws = launch_fill(buf, 4096, 7, repeatable=True)
assert acl.rt.synchronize_stream(stream) == 0 and acl.rt.destroy_stream(stream) == 0
assert acl.finalize() == 0
aclsim.fail_next_calls("aclDestroyAclOpExecutor", 1, 561103)
rets = [ops.destroy_executor(ex)]
live = [aclsim.executors_live()]
rets.append(ops.destroy_executor(ex))
live.append(aclsim.executors_live())
rets.append(ops.destroy_executor(ex))  # a third: skipped, not a double free
emit(rets=rets, live=live, forwarded=aclsim.call_count("aclDestroyAclOpExecutor"))
""", preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"rets": [561103, 0, 0], "live": [1, 0], "forwarded": 2}
    assert proc.stderr == ""


def test_a_deferred_destroy_the_runtime_refuses_is_warned_and_the_executor_kept_tracked():
    """The runtime refuses a destroy npualloc deferred behind queued work:
    the caller was told 0 long before, so npualloc says so on stderr, once,
    and the executor, still live in the runtime, stays repeatable to it: a
    later destroy of it reaches the runtime."""
    out, proc = run("""
aclsim.set_op_duration_us(0)
buf, _ = acl.rt.malloc(1 << 16, 0)
ex, ws = launch_fill(buf, 4096, 7, repeatable=True)
aclsim.fail_next_calls("aclDestroyAclOpExecutor", 1, 561103)
assert ops.destroy_executor(ex) == 0  # deferred behind the fence
assert acl.rt.synchronize_device() == 0
acl.rt.malloc(512, 0)  # drains it: refused
live = [aclsim.executors_live()]
assert ops.destroy_executor(ex) == 0
assert acl.rt.synchronize_device() == 0
acl.rt.malloc(512, 0)
live.append(aclsim.executors_live())
emit(live=live, forwarded=aclsim.call_count("aclDestroyAclOpExecutor"))
""", preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"live": [1, 0], "forwarded": 2}
    assert proc.stderr.count("npualloc: ") == 1
    assert "npualloc: the runtime refused a deferred aclnn executor destroy (error 561103)" in proc.stderr


DESTROY_FROM_ANOTHER_THREAD = """
import threading
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
def destroy(executor):
    if DESTROYER_DEVICE is not None:
        assert acl.rt.set_device(DESTROYER_DEVICE) == 0
    rets.append(ops.destroy_executor(executor))
for retry in range(8):  # until the launch is seen still queued after its destroy
    ex = launch_queued(buf, after, retry)
    before = aclsim.call_count("aclDestroyAclOpExecutor")
    violations_before = aclsim.executor_violations()
    rets = []
    thread = threading.Thread(target=destroy, args=(ex,))
    thread.start(); thread.join()
    reached_at_once = aclsim.call_count("aclDestroyAclOpExecutor") - before
    queued = acl.rt.query_event_status(after) == (0, 0)
    assert acl.rt.synchronize_device() == 0
    acl.rt.malloc(512, 0)  # drains the deferred destroy
    if queued:
        break
emit(queued=queued, rets=rets, reached_at_once=reached_at_once,
     reached=aclsim.call_count("aclDestroyAclOpExecutor") - before,
     violations=aclsim.executor_violations() - violations_before, live=aclsim.executors_live())
"""


@pytest.mark.parametrize("destroyer_device", [None, 1], ids=["no-device", "another-device"])
def test_repeatable_destroy_from_a_thread_off_its_device_waits_for_its_launch(destroyer_device):
    """A repeatable executor made and launched on device 0, destroyed from
    a thread with no device current or with device 1: the destroy waits for
    the work queued on device 0, the device it was made repeatable on. It
    went to the runtime at once (no device: nothing to fence) or behind a
    fence of device 1, under the queued launch (the simulator counts a
    violation)."""
    out, proc = run(f"DESTROYER_DEVICE = {destroyer_device!r}\n" + DESTROY_FROM_ANOTHER_THREAD, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0], "reached_at_once": 0, "reached": 1, "violations": 0, "live": 0}
    assert proc.stderr == ""


def test_repeatable_destroy_after_the_last_reset_enters_no_device():
    """The common teardown order: the device reset (its last reference,
    which waits for its work), then the executors destroyed, on the thread
    that reset it and from another with no device. Fencing the device the
    executor was made on would enter it again, a full device init and
    teardown on real hardware for each destroy: the destroys go to the
    runtime at once, with no call to enter a device."""
    out, proc = run('''
import threading
buf, _ = acl.rt.malloc(1 << 16, 0)
aclsim.set_op_duration_us(20_000)
mine, _ = launch_fill(buf, 4096, 7, repeatable=True)
theirs, _ = launch_fill(buf, 4096, 8, repeatable=True)
assert acl.rt.destroy_stream(stream) == 0 and acl.rt.reset_device(0) == 0
names = ("aclrtSetDevice", "aclrtResetDevice", "aclrtSynchronizeDevice", "aclrtRecordEvent")
before = {name: aclsim.call_count(name) for name in names}
rets = [ops.destroy_executor(mine)]
thread = threading.Thread(target=lambda: rets.append(ops.destroy_executor(theirs)))
thread.start(); thread.join()
emit(rets=rets, live=aclsim.executors_live(), violations=aclsim.executor_violations(),
     calls={name: aclsim.call_count(name) - before[name] for name in names})
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"rets": [0, 0], "live": 0, "violations": 0,
                   "calls": dict.fromkeys(("aclrtSetDevice", "aclrtResetDevice", "aclrtSynchronizeDevice",
                                           "aclrtRecordEvent"), 0)}
    assert proc.stderr == ""


# A repeatable executor made and launched on device 0; teardown() (the
# caller's) runs on a helper thread; the executor is launched again, then
# destroyed from a thread with no device. An attempt counts only when an
# event recorded after the relaunch was still NOT_READY after the destroy;
# a machine too slow for that makes a new executor and tries again with a
# longer op: events decide, never time.
RELAUNCH_AFTER_A_TEARDOWN = '''
import threading
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
for retry in range(8):  # until the relaunch is seen still queued after its destroy
    aclsim.set_op_duration_us(50_000 << retry)  # the executor's launches', taken when it is made
    ex, ws = launch_fill(buf, 4096, 7, repeatable=True)
    thread = threading.Thread(target=teardown); thread.start(); thread.join()
    assert ops.fill(ws, 4096, ex, stream) == 0
    assert acl.rt.record_event(after, stream) == 0
    before = aclsim.call_count("aclDestroyAclOpExecutor")
    violations_before = aclsim.executor_violations()
    rets = []
    thread = threading.Thread(target=lambda: rets.append(ops.destroy_executor(ex))); thread.start(); thread.join()
    reached_at_once = aclsim.call_count("aclDestroyAclOpExecutor") - before
    queued = acl.rt.query_event_status(after) == (0, 0)
    assert acl.rt.synchronize_device() == 0
    acl.rt.malloc(512, 0)  # drains the deferred destroy
    violations = aclsim.executor_violations() - violations_before
    if queued:
        break
emit(queued=queued, rets=rets, reached_at_once=reached_at_once, violations=violations,
     live=aclsim.executors_live())
'''


def test_repeatable_destroy_after_a_reset_that_was_not_the_last_waits_for_its_launch():
    """A repeatable executor made and launched on device 0; a worker thread
    sets device 0 and resets it, which the main thread still holds (not the
    last reference: the runtime tears nothing down); the executor is
    launched again, then destroyed from a thread with no device. The reset
    made the executor forget device 0, as if the device were gone, so the
    destroy was fenced nowhere and went to the runtime under the queued
    launch. npualloc counts the device's references now: a reset that
    leaves one keeps the executor on its device, and the destroy waits."""
    out, proc = run('''
def teardown():
    assert acl.rt.set_device(0) == 0 and acl.rt.reset_device(0) == 0
''' + RELAUNCH_AFTER_A_TEARDOWN, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0], "reached_at_once": 0, "violations": 0, "live": 0}
    assert proc.stderr == ""


# A worker thread sets device 1, which only it holds, makes a repeatable
# executor there and launches it (into made), records an event behind it
# (into after) and resets the device: its last reference, so the reset
# synchronizes device 1 for the executor (npa_exec_settle).
LAST_RESET_BY_A_WORKER = '''
import threading
buf, _ = acl.rt.malloc(1 << 16, 0)
def worker(duration_us):
    assert acl.rt.set_device(1) == 0
    aclsim.set_op_duration_us(duration_us)
    dst, ret = acl.rt.malloc(1 << 16, 0); assert ret == 0
    ws_size, ex, st = ops.fill_get_workspace_size(dst, 4096, 7); assert st == 0
    ws, ret = acl.rt.malloc(ws_size, 0); assert ret == 0
    assert ops.set_repeatable(ex) == 0 and ops.fill(ws, ws_size, ex, 0) == 0
    made.append(ex)
    after.append(acl.rt.create_event()[0])
    assert acl.rt.record_event(after[0], 0) == 0
    assert acl.rt.reset_device(1) == 0
'''


def test_a_reset_waits_for_its_device_without_holding_the_executor_lock():
    """The last reset of a device synchronizes it for the repeatable
    executors made on it (npa_exec_settle). It did so holding the lock that
    making an executor repeatable, or destroying one, takes: a thread doing
    either while the device ran its queued work waited for all of it, and a
    host callback that the synchronize waits for (on real CANN) would wait
    for good. Here a worker launches on device 1, which only it holds, and
    resets it; a thread makes an executor repeatable once the reset's
    synchronize has begun, and returns while the launch is still queued."""
    out, proc = run(LAST_RESET_BY_A_WORKER + '''
def make_repeatable(synchronizes_before):
    while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before:
        pass
    results.append(ops.set_repeatable(other))
    results.append(acl.rt.query_event_status(after[0]) == (0, 0))
for retry in range(8):  # until the launch is seen still queued when the thread returns
    other, st = ops.fill_get_workspace_size(buf, 4096, 8)[1:]
    assert st == 0
    made, after, results = [], [], []
    maker = threading.Thread(target=make_repeatable, args=(aclsim.call_count("aclrtSynchronizeDevice"),))
    maker.start()
    thread = threading.Thread(target=worker, args=(50_000 << retry,))
    thread.start(); thread.join(); maker.join()
    assert acl.rt.synchronize_device() == 0 and ops.destroy_executor(other) == 0
    if results[1]:
        break
emit(ret=results[0], queued=results[1], violations=aclsim.executor_violations())
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"ret": 0, "queued": True, "violations": 0}
    assert proc.stderr == ""




def test_a_destroy_refused_during_a_resets_synchronize_leaves_the_executor_settled():
    """A destroy of a repeatable executor made on device 1 comes while the
    last reset of device 1 synchronizes it (npa_exec_settle, outside the
    lock), and the runtime refuses it: the executor, still live there, is
    tracked again. It was so under its device 1 and a new generation, which
    the settle's second look took for one made after its synchronize began
    (or missed, the destroy being deferred and refused later), so a thread
    on device 0 launching it after the reset then destroyed it behind a
    fence on device 1, under the queued launch on device 0."""
    out, proc = run(LAST_RESET_BY_A_WORKER + '''
def refused_destroy(synchronizes_before):
    while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before or not after:
        pass
    aclsim.fail_next_calls("aclDestroyAclOpExecutor", 1, 561103)
    rets.append(ops.destroy_executor(made[0]))
    queued.append(acl.rt.query_event_status(after[0]) == (0, 0))
for retry in range(8):  # until the destroy is seen inside the reset's synchronize
    made, after, queued, rets = [], [], [], []
    destroyer = threading.Thread(target=refused_destroy, args=(aclsim.call_count("aclrtSynchronizeDevice"),))
    destroyer.start()
    thread = threading.Thread(target=worker, args=(50_000 << retry,))
    thread.start(); thread.join(); destroyer.join()
    if queued[0]:
        break
acl.rt.malloc(512, 0)  # drains the deferred destroy: refused
live = aclsim.executors_live()
def relaunch_and_destroy():
    assert acl.rt.set_device(0) == 0
    other, _ = acl.rt.create_stream()
    ws, _ = acl.rt.malloc(1 << 16, 0)
    aclsim.set_op_duration_us(200_000)
    assert ops.fill(ws, 1 << 16, made[0], other) == 0
    rets.append(ops.destroy_executor(made[0]))
    assert acl.rt.synchronize_stream(other) == 0
    acl.rt.malloc(512, 0)
violations_before = aclsim.executor_violations()
thread = threading.Thread(target=relaunch_and_destroy)
thread.start(); thread.join()
emit(queued=queued[0], rets=rets, live=[live, aclsim.executors_live()],
     violations=aclsim.executor_violations() - violations_before)
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0, 0], "live": [1, 0], "violations": 0}


def test_a_context_destroy_after_the_last_reset_enters_no_device():
    """A repeatable executor made on device 0, the device then reset for
    good (settled), and a context destroyed on device 1, which settles every
    device: device 0 is not synchronized again (entered again, on real
    hardware), as no executor made on it is left unsettled."""
    out, proc = run('''
buf, _ = acl.rt.malloc(1 << 16, 0)
aclsim.set_op_duration_us(0)
made, _ = launch_fill(buf, 4096, 7, repeatable=True)
assert acl.rt.destroy_stream(stream) == 0 and acl.rt.reset_device(0) == 0
names = ("aclrtSynchronizeDevice",)
before = {name: aclsim.call_count(name) for name in names}
context, ret = acl.rt.create_context(1); assert ret == 0
assert acl.rt.destroy_context(context) == 0
emit(calls={name: aclsim.call_count(name) - before[name] for name in names}, ret=ops.destroy_executor(made),
     live=aclsim.executors_live())
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"calls": {"aclrtSynchronizeDevice": 0}, "ret": 0, "live": 0}
    assert proc.stderr == ""




@pytest.mark.parametrize("helper_device", [1, 0], ids=["another-device", "same-device"])
def test_repeatable_destroy_after_a_helper_context_is_destroyed_waits_for_its_launch(helper_device):
    """A repeatable executor made on device 0; a helper thread creates and
    destroys a context on device 1 (another-device) or on device 0, which
    the main thread holds too (same-device: not its last reference); the
    executor is launched again, then destroyed from a thread with no device.
    The context's destroy settled every device (the hook did not know the
    context's device), so the executor forgot device 0, was fenced nowhere
    and went to the runtime under its queued launch. The destroy settles
    only its device now, and only where it may be the last reference, and
    the executor's destroy waits for device 0."""
    out, proc = run(f'''
def teardown():
    ctx, ret = acl.rt.create_context({helper_device}); assert ret == 0
    assert acl.rt.destroy_context(ctx) == 0
''' + RELAUNCH_AFTER_A_TEARDOWN, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0], "reached_at_once": 0, "violations": 0, "live": 0}
    assert proc.stderr == ""


@pytest.mark.parametrize("created_by", ["program", "runtime"])
def test_repeatable_destroy_after_its_devices_last_context_is_destroyed_enters_no_device(created_by):
    """A context on device 1, the device's only reference, with a repeatable
    executor made and launched in it; the context destroyed (the device torn
    down), then the executor. Its destroy goes to the runtime at once with
    no call to enter a device: the context's destroy settled device 1, the
    device its creation named, or every device for a context the hook never
    saw created (made here by the simulator's own entry, past npualloc)."""
    out, proc = run(f"CREATED_BY = {created_by!r}\n" + '''
sim = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libaclsim.so"))
sim.simrt_CreateContext.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int32]
held, ret = acl.rt.malloc(512, 0); assert ret == 0  # device 0's state, where a destroy with no device counts
if CREATED_BY == "program":
    ctx, ret = acl.rt.create_context(1); assert ret == 0
else:
    handle = ctypes.c_void_p()
    assert sim.simrt_CreateContext(ctypes.byref(handle), 1) == 0
    ctx = handle.value
    acl.rt.set_context(ctx)  # through npualloc, which asks the runtime for the device now current
buf, ret = acl.rt.malloc(1 << 16, 0); assert ret == 0
aclsim.set_op_duration_us(20_000)
ws_size, ex, st = ops.fill_get_workspace_size(buf, 4096, 7); assert st == 0
ws, ret = acl.rt.malloc(ws_size, 0); assert ret == 0
assert ops.set_repeatable(ex) == 0
assert ops.fill(ws, ws_size, ex, 0) == 0  # device 1's default stream
assert acl.rt.destroy_context(ctx) == 0
names = ("aclrtSetDevice", "aclrtResetDevice", "aclrtSynchronizeDevice", "aclrtRecordEvent")
before = {name: aclsim.call_count(name) for name in names}
rets = [ops.destroy_executor(ex)]
emit(rets=rets, live=aclsim.executors_live(), violations=aclsim.executor_violations(),
     calls={name: aclsim.call_count(name) - before[name] for name in names})
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"rets": [0], "live": 0, "violations": 0,
                   "calls": dict.fromkeys(("aclrtSetDevice", "aclrtResetDevice", "aclrtSynchronizeDevice",
                                           "aclrtRecordEvent"), 0)}
    assert proc.stderr == ""


def test_a_context_outlived_by_a_force_reset_drops_no_reference_at_its_destroy():
    """A context on device 0, the device force-reset (every reference
    dropped, the context's with them), set again by the main thread, and
    the stale context destroyed: the runtime drops nothing then. npualloc
    dropped the context's reference a second time, so it counted none left
    on device 0 while the main thread held one, a worker's set-and-reset
    of device 0 counted as perhaps the last and settled the repeatable
    executor, and its destroy after a relaunch went to the runtime under
    the queued launch."""
    out, proc = run('''
stale, ret = acl.rt.create_context(0); assert ret == 0
assert acl.rt.reset_device_force(0) == 0
assert acl.rt.set_device(0) == 0
assert acl.rt.destroy_context(stale) == 0
stream, ret = acl.rt.create_stream(); assert ret == 0
def teardown():
    assert acl.rt.set_device(0) == 0 and acl.rt.reset_device(0) == 0
''' + RELAUNCH_AFTER_A_TEARDOWN, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0], "reached_at_once": 0, "violations": 0, "live": 0}
    assert proc.stderr == ""


def test_repeatable_destroy_after_a_default_contexts_refused_destroy_waits_for_its_launch():
    """A program destroys its device's default context (from
    aclrtGetCurrentContext), which the runtime refuses: nothing is torn
    down. npualloc did not know the context, took its destroy for perhaps
    the last reference of every device holding at most one, and settled
    the repeatable executor made on device 0, so after a relaunch its
    destroy from a thread with no device went to the runtime under the
    queued launch. A default context's destroy settles nothing now."""
    out, proc = run('''
default, ret = acl.rt.get_context(); assert ret == 0
def teardown():
    assert acl.rt.destroy_context(default) == 107000
''' + RELAUNCH_AFTER_A_TEARDOWN, preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"queued": True, "rets": [0], "reached_at_once": 0, "violations": 0, "live": 0}
    assert proc.stderr == ""


def test_a_teardowns_drain_waits_for_its_device_without_holding_the_executor_lock():
    """A repeatable executor's destroy deferred behind its queued launch; a
    worker resets the device (not its last reference), whose drain of the
    deferred destroys synchronizes the device for it. It did so holding
    the lock that making an executor repeatable, or destroying one, takes:
    a thread doing either meanwhile waited for all the device's queued
    work (and a host callback the synchronize waits for, doing either,
    would wait for good). The thread's set_repeatable returns while the
    launch is still queued now."""
    out, proc = run('''
import threading
buf, _ = acl.rt.malloc(1 << 16, 0)
after, _ = acl.rt.create_event()
def make_repeatable(synchronizes_before, other, results):
    while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before:
        pass
    results.append(ops.set_repeatable(other))
    results.append(acl.rt.query_event_status(after) == (0, 0))
def reset():
    assert acl.rt.set_device(0) == 0 and acl.rt.reset_device(0) == 0
for retry in range(8):  # until the launch is seen still queued when the thread returns
    violations_before = aclsim.executor_violations()
    ex = launch_queued(buf, after, retry)
    assert ops.destroy_executor(ex) == 0  # deferred behind the launch
    other = ops.fill_get_workspace_size(buf, 4096, 8)[1]
    results = []
    maker = threading.Thread(target=make_repeatable,
                             args=(aclsim.call_count("aclrtSynchronizeDevice"), other, results))
    maker.start()
    resetter = threading.Thread(target=reset)
    resetter.start(); resetter.join(); maker.join()
    assert acl.rt.synchronize_device() == 0 and ops.destroy_executor(other) == 0
    if results[1]:
        break
acl.rt.malloc(512, 0)  # drains what is left deferred
emit(ret=results[0], queued=results[1], violations=aclsim.executor_violations() - violations_before,
     live=aclsim.executors_live())
''', preload_env())
    assert proc.returncode == 0, proc.stderr
    assert out == {"ret": 0, "queued": True, "violations": 0, "live": 0}
    assert proc.stderr == ""
