"""fork() and the simulated runtime: a child forked while other threads are
inside the runtime (holding its lock, waiting on its condition variables, or
running a stream's work) gets a runtime it can call without hanging; the
parent's streams and events are not the child's (107000), its devices and
memory are."""
from __future__ import annotations

import json

from conftest import run_python, sim_env
from sim_programs import DEVICE_BUFFERS, WHILE_QUEUED

PARAM_INVALID = 107000

# Two threads keep the runtime busy while the main thread forks CHILDREN
# children: one fills a large block synchronously (the fill runs under the
# runtime's lock), the other queues the same fill on a stream and
# synchronizes (the stream's worker fills under the lock while this thread
# waits on the runtime's condition variable). Each child uses the runtime:
# its lock, a stream's worker and that condition variable. The parent then
# gives the children HANG_WAIT_S to exit; one that has not is counted as
# hung (and killed): a child that does not hang needs milliseconds.
BUSY_FORKS = DEVICE_BUFFERS + """\
import json, os, signal, threading, time
CHILDREN, HANG_WAIT_S, BIG = 20, 30, 64 << 20
big = dev(BIG)
stream, ret = acl.rt.create_stream(); ok(ret)
stop = threading.Event()
rounds, errors = [0, 0], []
def busy(index, fill):
    try:
        ok(acl.rt.set_device(0))
        while not stop.is_set():
            fill()
            rounds[index] += 1
    except BaseException as e:
        errors.append(repr(e))
def fill_here():
    ok(acl.rt.memset(big, BIG, 1, BIG))
def fill_on_stream():
    ok(acl.rt.memset_async(big, BIG, 2, BIG, stream))
    ok(acl.rt.synchronize_stream(stream))
threads = [threading.Thread(target=busy, args=(0, fill_here)), threading.Thread(target=busy, args=(1, fill_on_stream))]
for t in threads:
    t.start()
while min(rounds) == 0 and not errors:
    time.sleep(0.001)
rounds_at_fork = list(rounds)

def child():
    ok(acl.rt.set_device(0))
    p = dev(4096, 7)                                          # malloc, and a fill under the lock
    ok(acl.rt.memset_async(p, 4096, 9, 4096, 0))              # the default stream's worker
    ok(acl.rt.synchronize_stream(0))                          # the condition variable
    assert read(p, 4096) == b"\\x09" * 4096
    ok(acl.rt.free(p))
    ok(acl.rt.synchronize_device())

pids = []
for _ in range(CHILDREN):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    pids.append(pid)
    time.sleep(0.005)
stop.set()
for t in threads:
    t.join()
statuses, deadline = {}, time.monotonic() + HANG_WAIT_S
while len(statuses) < len(pids) and time.monotonic() < deadline:
    for pid in pids:
        if pid not in statuses:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[pid] = status
    time.sleep(0.01)
hung = [pid for pid in pids if pid not in statuses]
for pid in hung:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps({"hung": len(hung), "statuses": sorted(statuses.values()), "errors": errors,
                  "rounds_at_fork": rounds_at_fork}))
"""


def test_children_forked_while_the_runtime_is_busy_never_hang():
    proc = run_python(BUSY_FORKS, sim_env(), timeout=180)
    out = json.loads(proc.stdout)
    assert out["errors"] == [] and min(out["rounds_at_fork"]) >= 1  # both threads were busy when the forks began
    assert out["hung"] == 0
    assert out["statuses"] == [0] * 20  # and every child's calls succeeded
    assert proc.stderr == ""


# A child forked while the parent's stream still has work queued (an op, an
# event record behind it): it reports what it can do with the runtime.
CHILD_RUNTIME = DEVICE_BUFFERS + WHILE_QUEUED + """\
import json, os
p = dev(4096, 0x5A)
stream, ret = acl.rt.create_stream(); ok(ret)
ev, ret = acl.rt.create_event(); ok(ret)
ws = dev(ops.WORKSPACE_BYTES)

def in_child():
    report = {"device": acl.rt.get_device(), "inherited": read(p, 4096) == b"\\x5a" * 4096}
    # The parent's event and stream: unknown here, whatever was queued on them.
    report["parent_event"] = [acl.rt.synchronize_event(ev), acl.rt.query_event_status(ev)[1],
                              acl.rt.record_event(ev, 0), acl.rt.destroy_event(ev)]
    report["parent_stream"] = [acl.rt.synchronize_stream(stream), acl.rt.memset_async(p, 4096, 1, 4096, stream),
                               acl.rt.destroy_stream(stream)]
    # The device's work is the child's own: none of the parent's is waited for.
    report["sync_device"] = acl.rt.synchronize_device()
    ok(acl.rt.memset_async(p, 4096, 1, 4096, 0)); ok(acl.rt.synchronize_stream(0))
    report["default_stream"] = read(p, 4096) == b"\\x01" * 4096
    mine, ret = acl.rt.create_stream(); ok(ret)
    done, ret = acl.rt.create_event(); ok(ret)
    ok(acl.rt.memset_async(p, 4096, 2, 4096, mine)); ok(acl.rt.record_event(done, mine))
    ok(acl.rt.synchronize_event(done))
    report["own_stream"] = read(p, 4096) == b"\\x02" * 4096
    ok(acl.rt.destroy_event(done)); ok(acl.rt.destroy_stream(mine))
    ok(acl.rt.set_device(1)); ok(acl.rt.reset_device(1)); ok(acl.rt.set_device(0))
    report["finalize"] = [acl.rt.reset_device(0), acl.finalize()]
    return report

reports = []
def attempt(duration_us):
    aclsim.set_op_duration_us(duration_us)
    n, ex, st = ops.fill_get_workspace_size(p, 4096, 0x5A); ok(st)
    ok(ops.fill(ws, n, ex, stream))
    ok(acl.rt.record_event(ev, stream))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps(in_child()).encode())
        finally:
            os._exit(0)
    os.close(w)
    queued = still_queued(ev)                     # so the child was forked with both still queued
    reports.append(json.loads(os.read(r, 65536) or b"null"))
    os.close(r)
    assert os.waitpid(pid, 0)[1] == 0
    ok(acl.rt.synchronize_stream(stream))         # the parent's stream and event still work in the parent
    assert acl.rt.query_event_status(ev) == COMPLETE
    return queued
while_queued(attempt)
print(json.dumps(reports[-1]))
"""


def test_a_forked_child_has_the_parents_devices_and_memory_but_not_its_streams_or_events():
    proc = run_python(CHILD_RUNTIME, sim_env(), timeout=120)
    report = json.loads(proc.stdout)
    assert report == {
        "device": [0, 0],  # the forking thread's current device
        "inherited": True,
        "parent_event": [PARAM_INVALID] * 4,
        "parent_stream": [PARAM_INVALID] * 3,
        "sync_device": 0,
        "default_stream": True,
        "own_stream": True,
        "finalize": [0, 0],
    }
    assert proc.stderr == ""
