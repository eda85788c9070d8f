"""npualloc.memory_saver, torch_memory_saver's examples on the simulator
through pyACL: contents survive pause/resume with a CPU backup, tags pause
selectively, released memory is free for another process, and nothing is
lost when host memory, device memory or another process gets in the way.
Every scenario also asserts the simulator saw no access to paused memory."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import NPUALLOC_LIB, ROOT, preload_env, run_python, sim_env

PRELUDE = """\
import os, resource
import acl, aclsim
from npualloc import memory_saver as ms
from npualloc.errors import NpuallocError
MiB = 1 << 20
def ok(ret):
    assert ret == 0, ret
ok(acl.init()); ok(acl.rt.set_device(0))
def free_bytes():
    return acl.rt.get_mem_info(1)[0]
def malloc(size):
    ptr, ret = acl.rt.malloc(size, 0); ok(ret)
    return ptr
def fill(ptr, size):
    data = os.urandom(size)
    ok(acl.rt.memcpy(ptr, size, acl.util.bytes_to_ptr(data), size, 1))
    return data
def read(ptr, size):
    return acl.util.ptr_to_bytes(ptr, size)
def refused(call, *reasons):
    # call() must raise NpuallocError naming every reason.
    try:
        call()
    except NpuallocError as e:
        assert all(reason in str(e) for reason in reasons), e
    else:
        raise AssertionError(f"{call.__name__} did not fail")
"""


def saver(code: str, **env: str) -> subprocess.CompletedProcess:
    return run_python(PRELUDE + textwrap.dedent(code) + "\nassert aclsim.invalid_accesses() == 0\n",
                      preload_env(**env))


def test_values_survive_pause_and_resume_with_backup():
    saver("""
        plain = malloc(MiB); kept = fill(plain, MiB)
        with ms.region("weights", enable_cpu_backup=True):
            w = malloc(3 * MiB)           # two 2 MiB pages
        data = fill(w, 3 * MiB)
        import npualloc
        def shown_free():  # the device's free memory as `npualloc stats` shows it
            return npualloc.memory_stats()["npualloc.device_free_bytes"]
        before = free_bytes()
        assert shown_free() == before
        ms.pause()
        assert free_bytes() - before == 4 * MiB  # whole pages back to the device
        assert shown_free() == before + 4 * MiB
        assert ms.bytes_of() == {"allocated": 4 * MiB, "paused": 4 * MiB, "backup": 4 * MiB}
        ms.resume()
        assert free_bytes() == before and shown_free() == before
        assert read(w, 3 * MiB) == data and read(plain, MiB) == kept  # same address, same bytes
        assert ms.bytes_of("weights") == {"allocated": 4 * MiB, "paused": 0, "backup": 0}
        ok(acl.rt.free(w)); ok(acl.rt.free(plain))
        assert shown_free() == before + 4 * MiB  # the saver's pages went back; the cache keeps its segment
        assert aclsim.physical_bytes_outstanding(0) == 0
    """)


def test_tags_pause_selectively_and_disable_makes_ordinary_allocations():
    saver("""
        with ms.region("kv_cache"):
            kv = malloc(2 * MiB)
            with ms.disable():
                ordinary = malloc(2 * MiB)
        with ms.region("weights", enable_cpu_backup=True):
            w = malloc(2 * MiB)
        data = fill(w, 2 * MiB)
        assert ms.bytes_of() == {"allocated": 4 * MiB, "paused": 0, "backup": 0}
        before = free_bytes()
        ms.pause("kv_cache")
        assert free_bytes() - before == 2 * MiB
        assert ms.bytes_of("kv_cache")["paused"] == 2 * MiB and ms.bytes_of("weights")["paused"] == 0
        assert read(w, 2 * MiB) == data               # the other tag is untouched and usable
        ms.pause("weights")
        assert free_bytes() - before == 4 * MiB
        ms.resume("kv_cache")
        assert ms.bytes_of() == {"allocated": 4 * MiB, "paused": 2 * MiB, "backup": 2 * MiB}
        ms.resume()
        assert read(w, 2 * MiB) == data
        ok(acl.rt.memset(kv, 2 * MiB, 0, 2 * MiB))    # without backup: usable, contents undefined
        ok(acl.rt.free(ordinary))
    """)


def test_a_new_tag_every_step_works_for_as_long_as_the_program_runs():
    """Tags were slots in a 64-entry table, never reused: a program naming a
    tag per step (kv_cache_0, kv_cache_1, ...) was refused at its 65th. A
    tag is a name now; only its length is limited."""
    saver("""
        kept = {}
        for step in range(200):
            tag = f"kv_cache_{step}"
            with ms.region(tag, enable_cpu_backup=True):
                ptr = malloc(MiB)
            data = fill(ptr, MiB)
            ms.pause(tag)
            assert ms.bytes_of(tag) == {"allocated": 2 * MiB, "paused": 2 * MiB, "backup": 2 * MiB}
            ms.resume(tag)
            assert read(ptr, MiB) == data
            if step % 50 == 0:
                kept[tag] = (ptr, data)               # these stay, the others are freed
            else:
                ok(acl.rt.free(ptr))
        assert ms.bytes_of()["allocated"] == len(kept) * 2 * MiB
        ms.pause("kv_cache_100")                          # one tag of many, by name
        assert ms.bytes_of()["paused"] == 2 * MiB and ms.bytes_of("kv_cache_100")["paused"] == 2 * MiB
        ms.pause("kv_cache_7")                            # freed: selects nothing
        assert ms.bytes_of("kv_cache_7") == {"allocated": 0, "paused": 0, "backup": 0}
        ms.resume()
        for ptr, data in kept.values():
            assert read(ptr, MiB) == data
        refused(lambda: ms.region("x" * 64).__enter__(), "at most 63 bytes")
        with ms.region("x" * 63):
            assert ms.bytes_of("x" * 63)["allocated"] == 0
    """)


def test_saver_bytes_leaves_out_the_figures_passed_as_null():
    """A C caller passing NULL for a figure it does not want crashed the
    host program (a store through NULL): now that figure is left out."""
    saver("""
        import ctypes
        with ms.region("weights"):
            w = malloc(MiB)
        lib = ctypes.CDLL(None)
        size_t = ctypes.c_size_t
        lib.npualloc_saver_bytes.argtypes = [ctypes.c_char_p] + [ctypes.POINTER(size_t)] * 3
        assert lib.npualloc_saver_bytes(None, None, None, None) == 0
        paused = size_t(7)
        assert lib.npualloc_saver_bytes(b"weights", None, ctypes.byref(paused), None) == 0
        assert paused.value == 0
        ms.pause()
        assert lib.npualloc_saver_bytes(b"weights", None, ctypes.byref(paused), None) == 0
        assert paused.value == 2 * MiB
        ms.resume()
    """)


def test_a_paused_block_freed_is_simply_freed():
    saver("""
        with ms.region(enable_cpu_backup=True):
            a = malloc(MiB)
        ms.pause()
        ok(acl.rt.free(a))
        assert ms.bytes_of() == {"allocated": 0, "paused": 0, "backup": 0}
        ms.resume()                                   # nothing left to resume
        assert aclsim.physical_bytes_outstanding(0) == 0
    """)


def test_no_host_memory_for_the_backup_fails_the_pause_before_anything_is_unmapped():
    saver("""
        with ms.region(enable_cpu_backup=True):
            a, b = malloc(32 * MiB), malloc(32 * MiB)
        data = fill(a, 32 * MiB) + fill(b, 32 * MiB)
        before = free_bytes()
        # Room for one backup, not two: the first is taken, the second fails.
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + 48 * MiB, hard))
        refused(ms.pause, "no host memory", "nothing was paused")
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        assert ms.bytes_of() == {"allocated": 64 * MiB, "paused": 0, "backup": 0}
        assert free_bytes() == before and read(a, 32 * MiB) + read(b, 32 * MiB) == data
        ms.pause(); ms.resume()                        # and it works once memory is there
        assert read(a, 32 * MiB) + read(b, 32 * MiB) == data
    """)


def test_a_resume_without_device_memory_keeps_the_backup_and_can_be_retried():
    saver("""
        with ms.region(enable_cpu_backup=True):
            a = malloc(4 * MiB)
        data = fill(a, 4 * MiB)
        ms.pause()
        aclsim.fail_next_mallocs(1)                    # the device refuses the physical memory
        refused(ms.resume, "keeps its backup")
        assert ms.bytes_of() == {"allocated": 4 * MiB, "paused": 4 * MiB, "backup": 4 * MiB}
        ms.resume()
        assert read(a, 4 * MiB) == data
    """)


OWNER = PRELUDE + """\
import sys
with ms.region("engine", enable_cpu_backup=True):
    weights = malloc(40 * MiB)
data = fill(weights, 40 * MiB)
ms.pause("engine")
print("paused", flush=True)
sys.stdin.readline()                               # the other process holds the memory now
try:
    ms.resume("engine")
except NpuallocError as e:
    print("refused:", e, flush=True)
sys.stdin.readline()                               # the other process is gone
ms.resume("engine")
assert read(weights, 40 * MiB) == data
assert aclsim.invalid_accesses() == 0
print("resumed", flush=True)
if sys.stdin.readline() == "pause-and-die\\n":
    ms.pause("engine")
    print("paused again", flush=True)
    sys.stdin.readline()
"""
TAKER = PRELUDE + """\
import sys
p, ret = acl.rt.malloc(40 * MiB, 0)
print(ret, flush=True)
sys.stdin.readline()
"""


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env=preload_env(NPUSIM_HBM_MB="64"),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_another_process_uses_the_paused_memory_and_the_owner_resumes_after_it():
    owner = _start(OWNER)
    takers = []
    try:
        assert owner.stdout.readline() == "paused\n"
        takers.append(_start(TAKER))
        assert takers[0].stdout.readline() == "0\n"    # 40 MiB of a 64 MiB device: only free because paused
        owner.stdin.write("\n"); owner.stdin.flush()
        line = owner.stdout.readline()
        assert line.startswith("refused:") and "another process may hold it" in line, line
        takers[0].stdin.close(); assert takers[0].wait() == 0
        owner.stdin.write("\n"); owner.stdin.flush()
        assert owner.stdout.readline() == "resumed\n"
        owner.stdin.write("pause-and-die\n"); owner.stdin.flush()
        assert owner.stdout.readline() == "paused again\n"
        owner.kill(); owner.wait()                     # killed while paused: its backup and records go with it
        takers.append(_start(TAKER.replace("40 * MiB", "60 * MiB")))
        assert takers[1].stdout.readline() == "0\n"
        takers[1].stdin.close(); assert takers[1].wait() == 0
    finally:
        for proc in (owner, *takers):
            if proc.poll() is None:
                proc.kill(); proc.wait()


def test_the_readme_colocation_demo_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "demo" / "colocate.py")], capture_output=True,
                          text=True, timeout=120, env=sim_env())
    assert proc.returncode == 0, proc.stderr
    assert "engine paused: 2048 MiB free" in proc.stdout and "weights intact" in proc.stdout, proc.stdout


def test_saver_bytes_show_in_memory_stats_and_in_stats_from_another_shell():
    proc = saver("""
        import json, subprocess, sys
        import npualloc
        with ms.region("weights", enable_cpu_backup=True):
            w = malloc(3 * MiB)                         # two 2 MiB pages
        with ms.region("kv_cache"):
            kv = malloc(MiB)
        ms.pause("weights")
        s = npualloc.memory_stats()
        assert {k: s[k] for k in s if k.startswith("npualloc.saver_")} == {
            "npualloc.saver_allocations": 2, "npualloc.saver_allocated_bytes": 6 * MiB,
            "npualloc.saver_paused_bytes": 4 * MiB, "npualloc.saver_backup_bytes": 4 * MiB}, s
        assert s["allocated_bytes.all.current"] == 0    # never in the cache
        cli = [sys.executable, "-m", "npualloc", "stats", str(os.getpid())]
        shown = json.loads(subprocess.run(cli + ["--json"], capture_output=True, text=True, check=True).stdout)
        theirs = shown["devices"]["0"]
        assert {k: theirs[k] for k in theirs if k.startswith("npualloc.saver_")} == {
            k: s[k] for k in s if k.startswith("npualloc.saver_")}, theirs
        print(subprocess.run(cli, capture_output=True, text=True, check=True).stdout)
        ms.resume()
        assert npualloc.memory_stats()["npualloc.saver_paused_bytes"] == 0
        ok(acl.rt.free(w)); ok(acl.rt.free(kv))
        assert npualloc.memory_stats()["npualloc.saver_allocated_bytes"] == 0
    """)
    assert "memory_saver                6.00 MiB in 2 allocations, 4.00 MiB paused, 4.00 MiB host backup" \
        in proc.stdout, proc.stdout


def test_a_release_failing_half_way_maps_everything_back_intact():
    # aclrtUnmapMem refused (the range stays mapped), then aclrtFreePhysical
    # refused after a successful unmap (the handle stays live): either way the
    # pause fails saying so, what it released is mapped back with its
    # contents, and nothing is left paused.
    saver("""
        with ms.region(enable_cpu_backup=True):
            a, b = malloc(4 * MiB), malloc(4 * MiB)
        with ms.region("no_backup"):
            c = malloc(2 * MiB)
        data = fill(a, 4 * MiB) + fill(b, 4 * MiB)
        kept_c = fill(c, 2 * MiB)
        before = free_bytes()
        for api in ("aclrtUnmapMem", "aclrtFreePhysical"):
            failed = aclsim.injected_failures()
            aclsim.fail_release(api, n=1, skip=1)       # the first block goes, the second is refused
            refused(ms.pause, "failed (error 207002)", "nothing was paused")
            assert aclsim.injected_failures() == failed + 1
            assert ms.bytes_of() == {"allocated": 10 * MiB, "paused": 0, "backup": 0}
            assert free_bytes() == before
            assert read(a, 4 * MiB) + read(b, 4 * MiB) == data
        # The block refused first kept its memory in both cases: its contents
        # are there although it has no backup.
        ms.pause(); ms.resume()
        assert read(a, 4 * MiB) + read(b, 4 * MiB) == data
        # A free whose unmap is refused fails with the runtime's code and loses nothing.
        aclsim.fail_release("aclrtUnmapMem")
        assert acl.rt.free(a) == 207002
        assert read(a, 4 * MiB) == data[:4 * MiB] and ms.bytes_of()["allocated"] == 10 * MiB
        for p in (a, b, c):
            ok(acl.rt.free(p))
        assert aclsim.physical_bytes_outstanding(0) == 0
    """)


FORK = PRELUDE + """\
import json, threading
import npualloc
with ms.region("weights", enable_cpu_backup=True):
    w = malloc(4 * MiB)
data = fill(w, 4 * MiB)
stop = threading.Event()
rounds, errors = [0, 0], []
def churn(index):                                  # pausable allocations made and freed while forking
    try:
        ok(acl.rt.set_device(0))
        while not stop.is_set():
            with ms.region(f"churn{index}"):
                p = malloc(MiB)
            ok(acl.rt.free(p))
            rounds[index] += 1
    except BaseException as e:
        errors.append(repr(e))
threads = [threading.Thread(target=churn, args=(i,)) for i in range(2)]
for t in threads:
    t.start()
while min(rounds) == 0 and not errors:
    os.sched_yield()
results = []
for _ in range(8):
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        inherited = ms.bytes_of()                  # the parent's allocations are not the child's
        ms.pause(); ms.resume()                    # touches nothing of the parent's
        with ms.region("mine", enable_cpu_backup=True):
            mine = malloc(2 * MiB)
        own = fill(mine, 2 * MiB)
        ms.pause("mine")
        paused = ms.bytes_of()
        ms.resume("mine")
        intact = read(mine, 2 * MiB) == own
        shown = npualloc.memory_stats()["npualloc.saver_allocated_bytes"]
        ok(acl.rt.free(mine))
        os.write(wfd, json.dumps({"inherited": inherited, "paused": paused, "intact": intact,
                                  "saver_stats": shown}).encode())
        os._exit(0)
    os.close(wfd)
    status = os.waitpid(pid, 0)[1]
    results.append((status, json.loads(os.read(r, 4096) or b"null")))
    os.close(r)
stop.set()
for t in threads:
    t.join()
ms.pause(); ms.resume()                            # the parent's own, still there and whole
print(json.dumps({"results": results, "errors": errors, "intact": read(w, 4 * MiB) == data,
                  "bytes": ms.bytes_of()}))
"""


def test_a_forked_child_forgets_the_parents_pausable_allocations():
    import json
    MiB = 1 << 20
    out = json.loads(saver(FORK.removeprefix(PRELUDE)).stdout)
    assert out["errors"] == [] and out["intact"]
    assert out["bytes"] == {"allocated": 4 * MiB, "paused": 0, "backup": 0}
    assert len(out["results"]) == 8
    for status, child in out["results"]:
        assert status == 0 and child is not None
        assert child["inherited"] == {"allocated": 0, "paused": 0, "backup": 0}
        assert child["paused"] == {"allocated": 2 * MiB, "paused": 2 * MiB, "backup": 2 * MiB}
        assert child["intact"] and child["saver_stats"] == 2 * MiB  # its own region's figures


def test_a_tag_holding_a_nul_is_refused_not_cut_short():
    # C reads a tag up to its first NUL: "kv\0b" was the tag "kv", so pausing
    # it paused the "kv" blocks, and two tags differing after a NUL were one.
    saver("""
        with ms.region("kv", enable_cpu_backup=True):
            kv = malloc(MiB)
        kept = fill(kv, MiB)
        for call in (lambda: ms.region("kv\\0b").__enter__(), lambda: ms.pause("kv\\0b"),
                     lambda: ms.resume("kv\\0b"), lambda: ms.bytes_of("kv\\0b")):
            try:
                call()
            except ValueError as e:
                assert "NUL" in str(e), e
            else:
                raise AssertionError("a tag holding a NUL was taken")
        assert ms.bytes_of("kv") == {"allocated": 2 * MiB, "paused": 0, "backup": 0}
        with ms.region("b"):              # the refused region left this thread's as it was
            plain = malloc(MiB)
        assert ms.bytes_of("b")["allocated"] == 2 * MiB
        assert read(kv, MiB) == kept
    """)


# The threads inside a region, as the allocation entries count them: the
# high bits of the library's npa_entry_work word (hook.h), read from this
# process's own copy of the library at the offset nm gives.
IN_REGIONS = """\
import contextlib, ctypes, sys, threading
lib = ctypes.CDLL(None)
path, offset = sys.argv[1], int(sys.argv[2], 16)
base = min(int(line.split("-")[0], 16) for line in open("/proc/self/maps")
           if line.split()[-1] == path and line.split()[2] == "00000000")
word = ctypes.c_uint.from_address(base + offset)
def threads_in_regions():
    return word.value >> 8
failures = []  # an assertion failing in a thread fails the run (checked at its end)
threading.excepthook = lambda hook: failures.append(repr(hook.exc_value))
def ended(thread):
    # join returns before the thread's own exit runs its key destructors:
    # the thread is gone once its task is.
    thread.join()
    while os.path.exists(f"/proc/self/task/{thread.native_id}"):
        threading.Event().wait(0.001)
"""


def test_a_thread_that_ends_inside_a_region_is_no_longer_counted():
    # A worker thread of a C program that enters a region and ends without
    # leaving it stayed counted for good: every later allocation of every
    # thread then left the hit path (99 more instructions a malloc+free pair
    # under callgrind, for the rest of the run after one such thread).
    body = """
        def enter_and_end(tag, leave, inside=None, done=None):
            try:
                assert lib.npualloc_saver_region(tag, 0) == 0
            finally:  # a failure here fails the count below, not waits for good
                if inside:
                    inside.set()
            if inside:
                done.wait()
            if leave:
                assert lib.npualloc_saver_region(None, 0) == 0
        inside, done = threading.Event(), threading.Event()
        waiting = threading.Thread(target=enter_and_end, args=(b"w", False, inside, done), daemon=True)
        waiting.start()
        inside.wait()
        assert threads_in_regions() == 1  # counted while it lives
        done.set(); ended(waiting)
        assert threads_in_regions() == 0
        for leave in (False, True) * 4:  # ending inside, or after leaving (never taken out twice)
            t = threading.Thread(target=enter_and_end, args=(b"t", leave)); t.start(); ended(t)
        assert threads_in_regions() == 0
        with ms.region("main"):  # this thread's region works as before
            assert threads_in_regions() == 1
            p = malloc(MiB)
        assert threads_in_regions() == 0
        assert ms.bytes_of("main")["allocated"] == 2 * MiB
        ok(acl.rt.free(p))
    """
    counting(body)


def counting(body: str) -> None:
    """Runs body after PRELUDE with threads_in_regions() defined (IN_REGIONS)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to find npa_entry_work")
    symbols = subprocess.run([nm, str(NPUALLOC_LIB)], capture_output=True, text=True, check=True).stdout
    offset = next(line.split()[0] for line in symbols.splitlines() if line.endswith(" npa_entry_work"))
    end = "\nassert failures == [], failures\nassert aclsim.invalid_accesses() == 0\n"
    run_python(PRELUDE + IN_REGIONS + textwrap.dedent(body) + end, preload_env(),
               args=[str(NPUALLOC_LIB.resolve()), offset])


def test_a_forked_child_counts_only_its_own_thread_in_a_region():
    # The other threads of the parent are not the child's: those inside a
    # region stayed counted there, and the child's allocations left the
    # hit path for its whole life.
    counting("""
        ok(acl.rt.free(malloc(MiB)))  # the process uses the NPU: npualloc's fork handlers are in place
        inside, done = threading.Event(), threading.Event()
        def stay():
            try:
                assert lib.npualloc_saver_region(b"w", 0) == 0
            finally:
                inside.set()
            done.wait()
        waiting = threading.Thread(target=stay, daemon=True); waiting.start(); inside.wait()
        for mine in (False, True):
            with ms.region("forker") if mine else contextlib.nullcontext():
                assert threads_in_regions() == 1 + mine
                pid = os.fork()
                if pid == 0:
                    os._exit(0 if threads_in_regions() == mine else 1)
                assert os.waitpid(pid, 0)[1] == 0, f"child counted {'more than its own' if mine else 'a thread'}"
        done.set(); ended(waiting)
        assert threads_in_regions() == 0
    """)


def test_a_child_forked_before_the_first_allocation_counts_no_thread_of_the_parent():
    # npualloc's fork handlers were registered at the process's first
    # allocation (or stream): a thread that entered a region before it
    # stayed counted in a child forked meanwhile, for the child's life.
    counting("""
        inside, done = threading.Event(), threading.Event()
        def stay():
            assert lib.npualloc_saver_region(b"w", 0) == 0
            inside.set(); done.wait()
        waiting = threading.Thread(target=stay, daemon=True); waiting.start(); inside.wait()
        assert threads_in_regions() == 1
        pid = os.fork()
        if pid == 0:
            os._exit(threads_in_regions())
        counted = os.waitpid(pid, 0)[1] >> 8
        assert counted == 0, f"the child counted {counted} thread(s) of the parent"
        done.set(); ended(waiting)
        assert threads_in_regions() == 0
    """)


def test_another_threads_free_does_not_wait_for_a_saver_frees_synchronize():
    """Freeing a pausable allocation synchronizes its device (its physical
    memory goes back at once). It did so holding saver_lock, which every
    free of a pointer the cache does not own takes, to ask the saver: a
    thread freeing such a pointer (a runtime allocation made past npualloc)
    waited for all the device's queued work. Here that thread frees once
    the saver free's synchronize has begun, and returns while the launch
    it waits for is still queued."""
    saver("""
        import ctypes, threading
        sim = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libaclsim.so"))
        sim.simrt_Malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
        ops = aclsim.Ops()
        stream, ret = acl.rt.create_stream(); ok(ret)
        dst = malloc(1 << 16)
        after, ret = acl.rt.create_event(); ok(ret)
        def free_foreign(foreign, synchronizes_before, results):
            ok(acl.rt.set_device(0))
            while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before:
                pass
            results.append(acl.rt.free(foreign))
            results.append(acl.rt.query_event_status(after) == (0, 0))
        for retry in range(8):  # until the launch is seen still queued when the free returns
            with ms.region("weights"):
                w = malloc(2 * MiB)
            handle = ctypes.c_void_p()
            ok(sim.simrt_Malloc(ctypes.byref(handle), 4096, 0))
            aclsim.set_op_duration_us(50_000 << retry)
            ws_size, ex, st = ops.fill_get_workspace_size(dst, 4096, 7); ok(st)
            ws = malloc(ws_size)
            ok(ops.fill(ws, ws_size, ex, stream))
            ok(acl.rt.record_event(after, stream))
            results = []
            other = threading.Thread(target=free_foreign,
                                     args=(handle.value, aclsim.call_count("aclrtSynchronizeDevice"), results))
            other.start()
            ok(acl.rt.free(w))
            other.join()
            ok(acl.rt.synchronize_device())
            if results[1]:
                break
        assert results == [0, True], results
        assert ms.bytes_of() == {"allocated": 0, "paused": 0, "backup": 0}
        assert aclsim.physical_bytes_outstanding(0) == 0
    """)



SAVER_FREE_SYNCHRONIZING = """\
import threading
ops = aclsim.Ops()
stream, ret = acl.rt.create_stream(); ok(ret)
dst = malloc(1 << 16)
after, ret = acl.rt.create_event(); ok(ret)
def launch_queued(retry):
    aclsim.set_op_duration_us(50_000 << retry)
    ws_size, ex, st = ops.fill_get_workspace_size(dst, 4096, 7); ok(st)
    ok(ops.fill(malloc(ws_size), ws_size, ex, stream))
    ok(acl.rt.record_event(after, stream))
def once_synchronizing(call, synchronizes_before, seen):
    # call() once the saver free's synchronize has begun, noting whether
    # the launch it waits for was still queued then (the free under way).
    ok(acl.rt.set_device(0))
    while aclsim.call_count("aclrtSynchronizeDevice") == synchronizes_before:
        pass
    seen["queued"] = acl.rt.query_event_status(after) == (0, 0)
    seen["result"] = call()
def while_freeing(make_call):
    # A pausable allocation freed, its unmap refused, with make_call(it)()
    # called on another thread while the free synchronizes: the
    # allocation, the free's result and the call's.
    for retry in range(8):  # until the launch is seen queued when the call is made
        with ms.region("weights"):
            w = malloc(2 * MiB)
        launch_queued(retry)
        aclsim.fail_release("aclrtUnmapMem")
        seen = {}
        other = threading.Thread(target=once_synchronizing,
                                 args=(make_call(w), aclsim.call_count("aclrtSynchronizeDevice"), seen))
        other.start()
        freed = acl.rt.free(w)
        other.join()
        ok(acl.rt.synchronize_device())
        if seen["queued"]:
            return w, freed, seen["result"]
    raise AssertionError("the free's synchronize was never seen under way")
"""


def test_a_pause_during_a_failing_saver_free_pauses_the_block_the_free_kept():
    """A pausable allocation's free synchronizes its device without
    saver_lock. A pause of its tag made meanwhile skipped the block (taken
    out of the list) and said the tag was paused; the free, its unmap
    refused, put the block back mapped: the tag read 0 of its 2 MiB paused
    and its memory stayed in use. The pause now waits for the free's end."""
    saver(SAVER_FREE_SYNCHRONIZING + textwrap.dedent("""
        w, freed, paused = while_freeing(lambda w: lambda: ms.pause("weights"))
        assert (freed, paused) == (207002, None)
        assert ms.bytes_of("weights") == {"allocated": 2 * MiB, "paused": 2 * MiB, "backup": 0}
        assert aclsim.physical_bytes_outstanding(0) == 0
        ms.resume("weights")
        ok(acl.rt.free(w))
        assert ms.bytes_of() == {"allocated": 0, "paused": 0, "backup": 0}
        assert aclsim.physical_bytes_outstanding(0) == 0
    """))


def test_a_second_free_during_a_failing_saver_free_frees_the_block():
    """Two threads free one pausable allocation at once. The second, not
    finding the block the first had taken out of the list, went to the
    runtime's aclrtFree with a range it did not make, while the first, its
    unmap refused, put the block back: neither freed it. The second now
    waits for the first, as it waited for saver_lock, and frees it."""
    saver(SAVER_FREE_SYNCHRONIZING + textwrap.dedent("""
        w, freed, freed_again = while_freeing(lambda w: lambda: acl.rt.free(w))
        assert (freed, freed_again) == (207002, 0)
        assert ms.bytes_of() == {"allocated": 0, "paused": 0, "backup": 0}
        assert aclsim.physical_bytes_outstanding(0) == 0
    """))
