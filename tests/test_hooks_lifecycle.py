"""The ends of a process's life with the NPU under npualloc: aclrtResetDevice
and aclFinalize give the cache back first and nothing of npualloc's calls the
runtime after aclFinalize; exits without finalizing (atexit order, os._exit,
an exception) neither hang nor spam; a fork while other threads allocate gives
the child an empty cache of its own and leaves the parent alone."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import SIM_LIB, compile_c, preload_env, run_python, sim_env

# A C program, so that its report runs at exit after npualloc's own exit
# handler (registered later, at the first allocation, so it runs earlier).
C_PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>

typedef uint64_t (*count_fn)(const char *);
static count_fn count;
static uint64_t (*live)(int32_t);
static const char *const apis[] = {"aclrtMalloc", "aclrtFree", "aclrtSynchronizeDevice", "aclrtCreateEvent",
    "aclrtRecordEvent", "aclrtQueryEventStatus", "aclrtDestroyEvent", "aclrtGetDevice", "aclrtSetDevice",
    "aclrtResetDevice", "aclrtGetMemInfo", "aclDestroyAclOpExecutor"};
#define NAPIS (sizeof(apis) / sizeof(apis[0]))
static uint64_t at_finalize[NAPIS];
static int finalized;

static void report(void)
{
    uint64_t after = 0;
    for (size_t i = 0; finalized && i < NAPIS; i++)
        after += count(apis[i]) - at_finalize[i];
    printf("calls_after_finalize=%llu\nexit_live=%llu\n", (unsigned long long)after, (unsigned long long)live(0));
}

#define CALL(fn, ...) ((int (*)())dlsym(h, fn))(__VA_ARGS__)

int main(int argc, char **argv)
{
    const char *mode = argv[2];
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    count = (count_fn)dlsym(h, "aclsim_call_count");
    live = (uint64_t (*)(int32_t))dlsym(h, "aclsim_live_allocations");
    atexit(report);
    /* force: the device is set twice, so only aclrtResetDeviceForce releases it */
    int force = strstr(mode, "force") != NULL;
    if (CALL("aclInit", NULL) || CALL("aclrtSetDevice", 0) || (force && CALL("aclrtSetDevice", 0))) return 3;
    void *streams[2];
    CALL("aclrtCreateStream", &streams[0]);
    CALL("aclrtCreateStream", &streams[1]); /* two streams: frees are fenced (auto) */
    void *keep = NULL;
    for (int i = 0; i < 20; i++) {
        void *p = NULL;
        if (CALL("aclrtMalloc", &p, (size_t)(1000 + 4096 * i), 0) || CALL("aclrtFree", p)) return 4;
    }
    CALL("aclrtMalloc", &keep, (size_t)4096, 0);
    if (strstr(mode, "keep") == NULL)
        CALL("aclrtFree", keep);
    const char *destroy = force ? "aclrtDestroyStreamForce" : "aclrtDestroyStream";
    CALL(destroy, streams[0]);
    CALL(destroy, streams[1]);
    if (strstr(mode, "reset")) {
        printf("reset=%d\n", CALL(force ? "aclrtResetDeviceForce" : "aclrtResetDevice", 0));
        printf("live_after_reset=%llu\n", (unsigned long long)live(0));
    }
    if (strstr(mode, "finalize")) {
        printf("finalize=%d\n", CALL("aclFinalize"));
        for (size_t i = 0; i < NAPIS; i++)
            at_finalize[i] = count(apis[i]);
        finalized = 1;
        printf("live_after_finalize=%llu\n", (unsigned long long)live(0));
    }
    if (strstr(mode, "keep"))
        printf("free_after=%d\n", CALL("aclrtFree", keep));
    fflush(stdout);
    return 0;
}
"""


@pytest.fixture(scope="module")
def c_program(tmp_path_factory):
    return compile_c(tmp_path_factory, "lifecycle", C_PROGRAM)


def run_c(prog, env, mode):
    proc = subprocess.run([str(prog), str(SIM_LIB / "libacl_rt.so"), mode], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines()), proc


@pytest.mark.parametrize("mode", ["finalize", "reset+finalize", "force+reset+finalize"])
def test_finalize_gives_the_cache_back_and_then_npualloc_is_silent(c_program, mode):
    """force: streams destroyed with aclrtDestroyStreamForce and the device,
    set twice, released by aclrtResetDeviceForce: the cache goes back there
    too."""
    out, proc = run_c(c_program, preload_env(), mode)
    assert out["finalize"] == "0"
    if "reset" in mode:
        assert out["reset"] == "0" and out["live_after_reset"] == "0"
    assert out["live_after_finalize"] == "0"
    assert out["calls_after_finalize"] == "0"  # not even at exit
    assert out["exit_live"] == "0"
    assert proc.stderr == ""


def test_exit_without_finalize_gives_the_cache_back(c_program):
    out, proc = run_c(c_program, preload_env(), "plain")
    assert out["exit_live"] == "0"
    assert proc.stderr == ""


def test_block_live_across_finalize_is_the_programs(c_program):
    """A block still held at aclFinalize stays the program's; freeing it
    afterwards gets the runtime's own answer, as without npualloc."""
    out, proc = run_c(c_program, preload_env(), "keep+finalize")
    raw, _ = run_c(c_program, sim_env(), "keep+finalize")
    assert out["free_after"] == raw["free_after"] != "0"
    assert out["live_after_finalize"] == "1"  # the kept block's segment, nothing cached
    assert out["calls_after_finalize"] == "1"  # only the program's own late free
    assert proc.stderr == ""


PY_PRELUDE = """
import os, sys, atexit
import acl
assert acl.init() == 0 and acl.rt.set_device(0) == 0
held = []
for i in range(30):
    p, ret = acl.rt.malloc(4096 * (i + 1), 0); assert ret == 0
    held.append(p)
for p in held[::2]:
    assert acl.rt.free(p) == 0
stream, _ = acl.rt.create_stream()
"""


@pytest.mark.parametrize("ending,rc", [
    ("pass", 0),                                       # falls off the end, blocks still held
    ("os._exit(3)", 3),                                # no atexit at all
    ("raise RuntimeError('boom')", 1),                 # a Python crash
    ("atexit.register(acl.finalize)", 0),              # MindTorch: finalize from Python's atexit
    ("acl.rt.reset_device(0); acl.finalize()", 0),     # torch_npu's explicit shutdown
])
def test_python_exits_neither_hang_nor_spam(ending, rc):
    proc = run_python(PY_PRELUDE + ending + "\n", preload_env(), check=False, timeout=30)
    assert proc.returncode == rc
    noise = [line for line in proc.stderr.splitlines() if line.startswith(("npualloc:", "aclsim:"))]
    assert noise == []
    if rc == 1:
        assert "RuntimeError: boom" in proc.stderr


FORK = """
import json, os, sys, threading, time, ctypes
import acl
from aclsim import aclsim
import npualloc
assert acl.init() == 0 and acl.rt.set_device(0) == 0
sizes = [512, 4096, 100000, 1 << 20, 3 << 20]
stop = threading.Event()
errors = []
rounds = [0] * 4
def worker(index):
    try:
        assert acl.rt.set_device(0) == 0
        while not stop.is_set():
            ps = []
            for s in sizes:
                p, ret = acl.rt.malloc(s, 0); assert ret == 0
                ps.append(p)
            for p in ps:
                assert acl.rt.free(p) == 0
            rounds[index] += 1
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(4)]
for t in threads:
    t.start()
# Fork while every thread is mid-churn: wait until each has done a round.
while min(rounds) == 0 and not errors:
    time.sleep(0.001)
rounds_at_fork = list(rounds)
children = []
for i in range(20):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        s = npualloc.memory_stats(0)
        frees = aclsim.call_count("aclrtFree")
        ctypes.CDLL(os.environ["LD_PRELOAD"]).npualloc_empty_cache(-1)
        freed_parent = aclsim.call_count("aclrtFree") - frees
        p, ret = acl.rt.malloc(4096, 0)
        ok = ret == 0 and acl.rt.free(p) == 0
        after = npualloc.memory_stats(0)
        files = sorted(os.listdir(os.path.join(os.environ["NPUALLOC_SHM_DIR"], f"npualloc-{os.geteuid()}")))
        os.write(w, json.dumps({"reserved_at_fork": s["reserved_bytes.all.current"], "freed_parent": freed_parent,
                                "ok": ok, "reserved": after["reserved_bytes.all.current"],
                                "own_region": f"npualloc.{os.getpid()}" in files}).encode())
        os._exit(0)
    os.close(w)
    children.append((pid, r))
    time.sleep(0.01)
results, statuses = [], []
for pid, r in children:
    # A child that hangs (a lock inherited held) hangs this wait: the test's
    # subprocess timeout reports it, whatever the machine's speed.
    statuses.append(os.waitpid(pid, 0)[1])
    data = os.read(r, 4096)
    os.close(r)
    if data:
        results.append(json.loads(data))
stop.set()
for t in threads:
    t.join()
after = npualloc.memory_stats(0)
print(json.dumps({"statuses": statuses, "errors": errors, "results": results, "rounds_at_fork": rounds_at_fork,
                  "parent_segment_frees": after["num_device_free"],
                  "parent_segments": after["segment.all.current"], "parent_reserved": after["reserved_bytes.all.current"],
                  "parent_raw_blocks": aclsim.live_allocations(0)}))
"""


def test_fork_while_threads_allocate(tmp_path):
    proc = run_python(FORK, preload_env(NPUALLOC_SHM_DIR=str(tmp_path)), timeout=120)
    out = json.loads(proc.stdout)
    assert out["statuses"] == [0] * 20 and out["errors"] == []
    assert len(out["results"]) == 20
    for child in out["results"]:
        assert child["reserved_at_fork"] == 0  # an empty cache of its own
        assert child["freed_parent"] == 0  # empty_cache in the child never frees the parent's segments
        assert child["ok"] and child["reserved"] == 2 << 20  # its own first segment
        assert child["own_region"]
    assert min(out["rounds_at_fork"]) >= 1  # every thread was churning when the forks began
    # The parent's cache is untouched: none of its segments was ever given
    # back (by its children or by the fork handlers), and every segment it
    # counts is still a raw block it holds.
    assert out["parent_segment_frees"] == 0
    assert out["parent_reserved"] > 0
    assert out["parent_segments"] == out["parent_raw_blocks"] > 0
    assert proc.stderr == ""


# A thread cancelled (deferred, the default) while it makes the process's
# first aclrtMalloc: npualloc's set-up there opens the region's file under
# its init lock. Then the main thread allocates.
CANCELLED = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

static void *rt;
static pthread_barrier_t posted;
#define FN(name) ((int (*)())dlsym(rt, name))

static void *worker(void *arg)
{
    int *result = arg;
    FN("aclrtSetDevice")(0);
    pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, NULL);
    pthread_barrier_wait(&posted); /* main cancels now */
    pthread_barrier_wait(&posted);
    pthread_setcancelstate(PTHREAD_CANCEL_ENABLE, NULL); /* not a cancellation point */
    void *p = NULL;
    *result = FN("aclrtMalloc")(&p, (size_t)4096, 0);
    if (*result == 0)
        FN("aclrtFree")(p);
    pthread_testcancel();
    return NULL;
}

int main(int argc, char **argv)
{
    rt = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0)) return 3;
    pthread_barrier_init(&posted, NULL, 2);
    int worker_result = -1;
    pthread_t t;
    pthread_create(&t, NULL, worker, &worker_result);
    pthread_barrier_wait(&posted);
    pthread_cancel(t);
    pthread_barrier_wait(&posted);
    void *res = NULL;
    pthread_join(t, &res);
    void *p = NULL;
    int main_result = FN("aclrtMalloc")(&p, (size_t)4096, 0);
    printf("cancelled=%d worker=%d main=%d\n", res == PTHREAD_CANCELED, worker_result, main_result);
    return 0;
}
"""


def test_a_thread_cancelled_in_its_first_allocation_leaves_no_lock_held(tmp_path_factory):
    """The cancel acted inside npualloc's set-up (the region's open under its
    init lock): the thread unwound with the lock held and the main thread's
    allocation waited for good. Cancellation is held off under npualloc's
    locks: the worker's allocation completes, the cancel acts at its next
    cancellation point, and the main thread allocates."""
    prog = compile_c(tmp_path_factory, "cancelled", CANCELLED)
    proc = subprocess.run([str(prog), str(SIM_LIB / "libacl_rt.so")], env=preload_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cancelled=1 worker=0 main=0"
    assert proc.stderr == ""


def test_another_threads_malloc_does_not_wait_for_a_resets_synchronize():
    """A reset gives its device's cache back (torch_npu's emptyCache), which
    synchronizes the device first. It did so holding the device's lock, so
    another thread's malloc on that device waited for all its queued work:
    here a worker resets device 0 (which the main thread still holds) while
    a launch is queued, and a thread on device 0 mallocs once the reset's
    synchronize has begun; its malloc returns while the launch is still
    queued."""
    proc = run_python("""
import json, threading
import acl
from aclsim import aclsim
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ops = aclsim.Ops()
stream, ret = acl.rt.create_stream(); assert ret == 0
dst, ret = acl.rt.malloc(1 << 16, 0); assert ret == 0
after, ret = acl.rt.create_event(); assert ret == 0
def reset():
    assert acl.rt.set_device(0) == 0 and acl.rt.reset_device(0) == 0
def malloc(synchronizes_before, results):
    assert acl.rt.set_device(0) == 0
    while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before:
        pass
    ptr, ret = acl.rt.malloc(512, 0)
    results.append(ret)
    results.append(acl.rt.query_event_status(after) == (0, 0))
    assert acl.rt.free(ptr) == 0
for retry in range(8):  # until the launch is seen still queued when the malloc returns
    cached, ret = acl.rt.malloc(4 << 20, 0); assert ret == 0
    assert acl.rt.free(cached) == 0  # a cached segment: the reset's release waits for the device
    aclsim.set_op_duration_us(50_000 << retry)
    ws_size, ex, st = ops.fill_get_workspace_size(dst, 4096, 7); assert st == 0
    ws, ret = acl.rt.malloc(ws_size, 0); assert ret == 0
    assert ops.fill(ws, ws_size, ex, stream) == 0
    assert acl.rt.record_event(after, stream) == 0
    results = []
    allocator = threading.Thread(target=malloc, args=(aclsim.call_count("aclrtSynchronizeDevice"), results))
    allocator.start()
    resetter = threading.Thread(target=reset)
    resetter.start(); resetter.join(); allocator.join()
    assert acl.rt.synchronize_device() == 0 and acl.rt.free(ws) == 0
    if results[1]:
        break
print(json.dumps(results))
""", preload_env())
    assert json.loads(proc.stdout.splitlines()[-1]) == [0, True]
    assert proc.stderr == ""
