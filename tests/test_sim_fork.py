"""fork() and the simulated runtime: a child forked while other threads are
inside the runtime (holding its lock, waiting on its condition variables, or
running a stream's work) gets a runtime it can call without hanging."""
from __future__ import annotations

import json

from conftest import run_python, sim_env
from sim_programs import DEVICE_BUFFERS

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

