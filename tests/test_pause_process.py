"""`npualloc pause <pid>` / `npualloc resume <pid>` on an unmodified pyACL
training loop: paused from another shell mid-run it stops at its next
allocation, gives its device memory back (another process can allocate it),
and after resume finishes with the same losses and checksum as an
uninterrupted run; every other thread that enters the allocator (or
memory_saver) waits until the resume. Nothing is lost when the pause cannot
be taken (plain segments, no host memory, the runtime refusing a release
half way) or the resume cannot get the memory back."""
from __future__ import annotations

import json
import os
import textwrap
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import NPUALLOC_LIB, SIM_LIB, compile_c, compile_shim, preload_env, run_python, sim_env

from npualloc._ffi import constants, ffi
from npualloc.region import Region, process_stopped, reader_library

MiB = 1 << 20
HBM_MB = "256"
# A training-like loop: weights persist on the device, activations of varying
# sizes come and go each step, and the weights are updated from what the step
# read back, so any lost or corrupted byte changes every later loss.
PRELUDE = """\
import acl, aclsim
def ok(ret):
    assert ret == 0, ret
ok(acl.init()); ok(acl.rt.set_device(0))
MiB = 1 << 20
def malloc(size):
    p, ret = acl.rt.malloc(size, 0); ok(ret)
    return p
def write(p, data):
    ok(acl.rt.memcpy(p, len(data), acl.util.bytes_to_ptr(data), len(data), 1))
"""
TRAIN = PRELUDE + """\
import hashlib, os, sys
def read(p, size):
    return acl.util.ptr_to_bytes(p, size)
def pattern(seed, size):
    block = hashlib.sha256(seed).digest()
    return (block * (size // len(block) + 1))[:size]
W = 3 * MiB
weights = [malloc(W) for _ in range(4)]
for i, w in enumerate(weights):
    write(w, pattern(b"init%d" % i, W))
for step in range(6):
    acts = []
    for i, w in enumerate(weights):
        a = malloc((1 + (step + i) % 4) * MiB + 4096 * step)
        ok(acl.rt.memcpy(a, MiB, w + step * 4096, MiB, 3))
        acts.append(a)
    digest = hashlib.sha256(b"".join(read(a + step * 65536, 256 * 1024) for a in acts)).digest()
    for i, w in enumerate(weights):
        write(w + i * 8192, pattern(digest + bytes([i]), 64 * 1024))
    for a in acts:
        ok(acl.rt.free(a))
    print("step", step, "loss", int.from_bytes(digest[:4], "little"), flush=True)
    if step in (1, 3) and sys.argv[1:2] == ["--wait"]:  # stops (outside the allocator) for the test
        if step == 1 and sys.argv[2:3]:                   # --wait API: the pause's 2nd release of it fails
            import npualloc
            kept = malloc(4096)                           # a small-pool page beside the weights' large one
            npualloc.empty_cache()                        # so the pause itself releases only those two
            aclsim.fail_release(sys.argv[2], n=1, skip=1)
            if sys.argv[3:4] == ["--no-map-back"]:        # and its roll-back finds no memory for the 1st
                aclsim.fail_next_mallocs(1)
        print("waiting", flush=True)
        sys.stdin.readline()
print("checksum", hashlib.sha256(b"".join(read(w, W) for w in weights)).hexdigest())
print("invalid accesses", aclsim.invalid_accesses())
"""
EXPANDABLE = "expandable_segments:True"


def _env(conf: str = EXPANDABLE) -> dict[str, str]:
    return preload_env(NPUSIM_HBM_MB=HBM_MB, PYTORCH_NPU_ALLOC_CONF=conf)


def _cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "npualloc", *args], env=sim_env(), capture_output=True, text=True,
                          timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _state(pid: int) -> dict:
    return json.loads(_cli("stats", str(pid), "--json").stdout)


def _probe(size_mb: int) -> str:
    """A second process on the same device: its free memory, and whether size_mb fits."""
    return run_python(f"""
        import acl
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        free, total, _ = acl.rt.get_mem_info(1)
        ptr, ret = acl.rt.malloc({size_mb} << 20, 0)
        print(free >> 20, ret)
    """, sim_env(NPUSIM_HBM_MB=HBM_MB)).stdout.strip()


class Trainer:
    """The loop, stopped after step 1 until go() (not in an allocator call)."""

    def __init__(self, conf: str = EXPANDABLE, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", TRAIN, "--wait", *args], env=_env(conf), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines = [self._line(), self._line()]
        assert self._line() == "waiting"

    def _line(self) -> str:
        return self.proc.stdout.readline().rstrip("\n")

    def pause_at_next_allocation(self, *extra: str) -> subprocess.CompletedProcess:
        """Posts the pause, then (once it is posted) lets the loop go on to its next allocation."""
        with Region(self.proc.pid) as region:
            posted = region.command_seq()
            cli = subprocess.Popen([sys.executable, "-m", "npualloc", "pause", str(self.proc.pid), "--timeout", "60",
                                    *extra], env=sim_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            while region.command_seq() == posted and cli.poll() is None:
                os.sched_yield()
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        out, err = cli.communicate(timeout=120)
        return subprocess.CompletedProcess(cli.args, cli.returncode, out, err)

    def finish(self) -> list[str]:
        out, err = self.proc.communicate("go\n", timeout=120)
        assert self.proc.returncode == 0, err
        self.stderr = err
        return self.lines + [line for line in out.splitlines() if line != "waiting"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _uninterrupted() -> list[str]:
    out = subprocess.run([sys.executable, "-c", TRAIN], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_paused_from_another_shell_releases_everything_and_finishes_the_same():
    expected = _uninterrupted()
    assert expected[-1] == "invalid accesses 0" and len(expected) == 8
    trainer = Trainer()
    try:
        running_free = _state(trainer.proc.pid)["devices"]["0"]["npualloc.device_free_bytes"]
        assert running_free <= (int(HBM_MB) - 12) * MiB      # the weights' pages at least
        paused = trainer.pause_at_next_allocation()
        assert paused.returncode == 0 and "paused" in paused.stdout, paused.stderr
        state = _state(trainer.proc.pid)
        assert state["state"] == "paused" and state["paused_bytes"] >= 12 * MiB and state["backup_bytes"] >= 12 * MiB
        # The stats show the device's memory as it is now, not as it was before the pause.
        assert state["devices"]["0"]["npualloc.device_free_bytes"] == int(HBM_MB) * MiB
        assert "[paused]" in _cli("ls").stdout
        # Its memory is the device's again: all of it, for another process.
        assert _probe(int(HBM_MB) - 8) == f"{HBM_MB} 0"
        assert trainer.proc.poll() is None   # still there, blocked in its allocation
        assert "resumed" in _cli("resume", str(trainer.proc.pid)).stdout
        assert trainer.finish() == expected  # same losses, same checksum, nothing touched paused memory
    finally:
        trainer.kill()


def test_a_pause_an_idle_program_did_not_take_in_time_is_withdrawn_and_never_applied():
    """A pause that timed out stayed posted: the program paused at its next
    allocation, long after the scheduler had been told the pause failed, and
    waited there for a resume nobody knew was needed."""
    expected = _uninterrupted()
    trainer = Trainer()
    try:
        late = _cli("pause", str(trainer.proc.pid), "--timeout", "0.5", check=False)
        assert late.returncode == 8 and "withdrawn, nothing was applied" in late.stderr, late.stderr
        assert trainer.finish() == expected  # runs to the end, never paused
        assert "paused" not in trainer.stderr
    finally:
        trainer.kill()


def test_a_withdrawn_resume_leaves_the_program_paused():
    """The paused thread answers requests itself: one withdrawn before it
    looked (the program stopped by SIGSTOP meanwhile) is not applied."""
    expected = _uninterrupted()
    trainer = Trainer()
    try:
        assert trainer.pause_at_next_allocation().returncode == 0
        os.kill(trainer.proc.pid, signal.SIGSTOP)
        with Region(trainer.proc.pid, writable=True) as region:
            seq = ffi.new("uint64_t *")
            reader = reader_library()
            assert reader.npualloc_reader_post(region._file, constants.NPUALLOC_CMD_RESUME, -1, 0.0, seq) == \
                constants.NPUALLOC_POST_OK
            assert reader.npualloc_reader_withdraw(region._file, seq[0]) == 1
        os.kill(trainer.proc.pid, signal.SIGCONT)
        # Nothing shows that the paused thread (polling at most 50 ms apart) has
        # looked: the wait only gives it the chance to go wrong; a correct build passes however short it is.
        time.sleep(0.5)
        assert _state(trainer.proc.pid)["state"] == "paused"
        assert "resumed" in _cli("resume", str(trainer.proc.pid)).stdout
        assert trainer.finish() == expected
    finally:
        trainer.kill()


def test_a_resume_without_memory_keeps_the_process_paused_and_can_be_retried():
    expected = _uninterrupted()
    trainer = Trainer()
    taker = None
    try:
        assert trainer.pause_at_next_allocation().returncode == 0
        taker = subprocess.Popen([sys.executable, "-c", "import acl,sys\nassert acl.init()==0 and "
                                  "acl.rt.set_device(0)==0\nprint(acl.rt.malloc(240<<20,0)[1],flush=True)\n"
                                  "sys.stdin.readline()"], env=sim_env(NPUSIM_HBM_MB=HBM_MB), text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert taker.stdout.readline() == "0\n"
        refused = _cli("resume", str(trainer.proc.pid), check=False)
        assert refused.returncode == 9 and "stays paused with its backup" in refused.stderr, refused.stderr
        assert _state(trainer.proc.pid)["state"] == "paused"
        taker.stdin.close()
        assert taker.wait() == 0
        assert _cli("resume", str(trainer.proc.pid)).returncode == 0
        assert trainer.finish() == expected
    finally:
        trainer.kill()
        if taker and taker.poll() is None:
            taker.kill()


SAVER_AND_CACHE = PRELUDE + """\
import sys, threading
from npualloc import memory_saver as ms
with ms.region("engine"):
    engine = malloc(8 * MiB)
cache = malloc(40 * MiB)
def churn():                       # applies the pause, then waits in the allocator
    ok(acl.rt.set_device(0))
    while True:
        ok(acl.rt.free(malloc(4096)))
threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def test_a_resume_that_maps_back_only_memory_savers_memory_says_what_stays_released():
    """memory_saver's memory goes back first: a resume that then finds no
    room for the cache's leaves the process paused with memory_saver's
    mapped, and the header said its 8 MiB were released still (and backed
    up) until the next resume."""
    proc = subprocess.Popen([sys.executable, "-c", SAVER_AND_CACHE], env=_env(), text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    taker = None
    try:
        assert proc.stdout.readline() == "ready\n"
        _cli("pause", str(proc.pid), "--timeout", "60")
        paused = _state(proc.pid)
        assert paused["state"] == "paused" and paused["devices"]["0"]["npualloc.saver_paused_bytes"] == 8 * MiB
        taker = subprocess.Popen([sys.executable, "-c", "import acl,sys\nassert acl.init()==0 and "
                                  "acl.rt.set_device(0)==0\nprint(acl.rt.malloc(220<<20,0)[1],flush=True)\n"
                                  "sys.stdin.readline()"], env=sim_env(NPUSIM_HBM_MB=HBM_MB), text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert taker.stdout.readline() == "0\n"  # room left for memory_saver's 8 MiB, not for the cache's
        assert _cli("resume", str(proc.pid), check=False).returncode == 9
        still = _state(proc.pid)
        assert still["state"] == "paused" and still["devices"]["0"]["npualloc.saver_paused_bytes"] == 0
        assert (still["paused_bytes"], still["backup_bytes"]) == (paused["paused_bytes"] - 8 * MiB,
                                                                  paused["backup_bytes"] - 8 * MiB)
        taker.stdin.close()
        assert taker.wait() == 0
        assert "resumed" in _cli("resume", str(proc.pid)).stdout
        after = _state(proc.pid)
        assert (after["state"], after["paused_bytes"], after["backup_bytes"]) == ("running", 0, 0)
        _, err = proc.communicate("", timeout=120)
        assert proc.returncode == 0, err
    finally:
        for started in (proc, taker):
            if started and started.poll() is None:
                started.kill()
                started.wait()


def test_a_pause_of_a_paused_process_is_refused_as_such():
    # Refused because the process is paused already (EPAUSED), it was told as a
    # pause that failed half way and could not get its memory back: the CLI
    # took any refusal that left the process paused for that one.
    trainer = Trainer()
    try:
        assert trainer.pause_at_next_allocation().returncode == 0
        again = _cli("pause", str(trainer.proc.pid), check=False)
        assert (again.returncode, again.stdout) == (9, "")
        assert again.stderr == f"npualloc: process {trainer.proc.pid}: the process is paused: resume it first\n"
        capped = _cli("set-memory-fraction", str(trainer.proc.pid), "0.5", check=False)
        assert (capped.returncode, capped.stdout, capped.stderr) == (9, "", again.stderr)
        assert _cli("resume", str(trainer.proc.pid)).returncode == 0
        trainer.finish()
    finally:
        trainer.kill()


def test_plain_segments_cannot_be_paused_and_the_process_runs_on():
    expected = _uninterrupted()
    trainer = Trainer(conf="")
    try:
        refused = trainer.pause_at_next_allocation()
        assert refused.returncode == 9 and "expandable_segments:True" in refused.stderr, refused.stderr
        assert trainer.finish() == expected
    finally:
        trainer.kill()


def test_no_host_memory_for_the_backup_fails_the_pause_before_anything_is_unmapped():
    expected = _uninterrupted()
    trainer = Trainer()
    try:
        pid = trainer.proc.pid
        size = int(open(f"/proc/{pid}/statm").read().split()[0]) * resource.getpagesize()
        # Room for a step's reads, not for the 12 MiB of weights' backup.
        old = resource.prlimit(pid, resource.RLIMIT_AS, (size + 6 * MiB, resource.RLIM_INFINITY))
        refused = trainer.pause_at_next_allocation()
        assert refused.returncode == 9 and "failed to apply" in refused.stderr, refused.stderr
        assert trainer._line().startswith("step 2") and trainer._line().startswith("step 3")
        assert trainer._line() == "waiting"  # ran on after the refusal: still under the limit
        resource.prlimit(pid, resource.RLIMIT_AS, old)
        assert trainer.finish()[2:] == expected[4:]
        assert "no host memory for the backup" in trainer.stderr and "nothing was paused" in trainer.stderr
    finally:
        trainer.kill()


def test_a_process_killed_while_paused_leaves_no_device_memory():
    trainer = Trainer()
    try:
        assert trainer.pause_at_next_allocation().returncode == 0
    finally:
        trainer.kill()
    assert _probe(int(HBM_MB) - 8) == f"{HBM_MB} 0"  # all of it free again


@pytest.mark.parametrize("api", ["aclrtUnmapMem", "aclrtFreePhysical"])
def test_a_release_refused_half_way_maps_everything_back_and_the_process_runs_on(api):
    expected = _uninterrupted()
    trainer = Trainer(EXPANDABLE, api)
    try:
        refused = trainer.pause_at_next_allocation()
        assert refused.returncode == 9 and "failed to apply" in refused.stderr, refused.stderr
        assert _state(trainer.proc.pid)["state"] == "running"
        assert trainer.finish() == expected  # same losses and checksum, and no access to unmapped memory
        assert "pause refused, the process runs on: unmapping" in trainer.stderr
        assert "failed (error 207002)" in trainer.stderr, trainer.stderr
    finally:
        trainer.kill()


def test_a_release_refused_half_way_that_cannot_map_back_stays_paused_and_resumes_intact():
    """The roll-back of a pause refused half way finds no memory for the page
    it unmapped: the process stays paused with its backup (not running on
    with live blocks unmapped and their backup freed), and a resume brings
    it back with the same losses and checksum."""
    expected = _uninterrupted()
    trainer = Trainer(EXPANDABLE, "aclrtUnmapMem", "--no-map-back")
    try:
        failed = trainer.pause_at_next_allocation()
        assert failed.returncode == 9, failed.stderr
        assert "it stays paused with its backup: run resume" in failed.stderr, failed.stderr
        assert _state(trainer.proc.pid)["state"] == "paused"
        assert "resumed" in _cli("resume", str(trainer.proc.pid)).stdout
        assert trainer.finish() == expected  # same losses and checksum, no access to unmapped memory
        assert "stays paused" in trainer.stderr, trainer.stderr
    finally:
        trainer.kill()


# Four threads in allocator calls (two on the cache, one on a second device,
# one making memory_saver allocations), each counting the calls it entered
# and those that returned; the main thread stays out of the allocator and
# reports, on the test's cue, what they did meanwhile.
THREADS = PRELUDE + textwrap.dedent("""\
    import json, os, sys, threading
    from npualloc import memory_saver as ms
    kept, kept_data = malloc(3 * MiB), os.urandom(3 * MiB)
    write(kept, kept_data)
    with ms.region("engine"):                # no backup asked: the command keeps the contents anyway
        engine = malloc(2 * MiB)
    engine_data = os.urandom(2 * MiB)
    write(engine, engine_data)
    N = 4
    entered, returned, errors, stop = [0] * N, [0] * N, [], threading.Event()
    def cache_call(i):
        ok(acl.rt.free(malloc((1 + returned[i] % 5) * (4096 if i == 0 else MiB))))
    def saver_call(i):
        with ms.region("churn"):
            p = malloc(MiB)
        ok(acl.rt.free(p))
    def worker(i, device, call):
        try:
            ok(acl.rt.set_device(device))
            while not stop.is_set():
                entered[i] += 1
                call(i)
                returned[i] += 1
        except BaseException as e:
            errors.append(repr(e))
            entered[i] = -1
    threads = [threading.Thread(target=worker, args=args) for args in
               ((0, 0, cache_call), (1, 0, cache_call), (2, 1, cache_call), (3, 0, saver_call))]
    for t in threads:
        t.start()
    def wait_for(condition):
        while not condition() and not errors:
            os.sched_yield()
        assert not errors, errors
    wait_for(lambda: min(returned) >= 1)
    print("ready", flush=True)
    sys.stdin.readline()                     # paused
    wait_for(lambda: all(e == r + 1 for e, r in zip(entered, returned)))   # every thread inside a call
    at_pause = list(returned)
    print("blocked", flush=True)
    sys.stdin.readline()                     # the device's memory has been used by another process
    print(json.dumps({"returned_since": [r - p for r, p in zip(returned, at_pause)],
                      "inside": [e - r for e, r in zip(entered, returned)]}), flush=True)
    sys.stdin.readline()                     # resumed
    wait_for(lambda: all(r >= p + 3 for r, p in zip(returned, at_pause)))  # every thread runs on
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors
    assert acl.util.ptr_to_bytes(kept, 3 * MiB) == kept_data
    assert acl.util.ptr_to_bytes(engine, 2 * MiB) == engine_data
    print("intact, invalid accesses", aclsim.invalid_accesses(), flush=True)
""")


def test_every_thread_entering_the_allocator_waits_for_the_resume():
    proc = subprocess.Popen([sys.executable, "-c", THREADS], env=_env(), text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def cue(line: str) -> str:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return proc.stdout.readline().rstrip("\n")

    try:
        assert proc.stdout.readline() == "ready\n"
        paused = _cli("pause", str(proc.pid), "--timeout", "60")
        assert "paused" in paused.stdout
        state = _state(proc.pid)
        assert state["state"] == "paused" and state["paused_bytes"] >= 22 * MiB  # a large page + the engine's
        assert state["devices"]["0"]["npualloc.saver_paused_bytes"] >= 2 * MiB  # the engine (+ a churned one)
        assert cue("paused") == "blocked"
        assert _probe(int(HBM_MB) - 8) == f"{HBM_MB} 0"  # device 0 all free meanwhile, for another process
        during = json.loads(cue("used"))
        assert during == {"returned_since": [0, 0, 0, 0], "inside": [1, 1, 1, 1]}, during
        assert "resumed" in _cli("resume", str(proc.pid)).stdout
        assert cue("resumed") == "intact, invalid accesses 0"
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0 and err == "", err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


EXIT_WHILE_PAUSED = PRELUDE + """\
import sys, threading
weights = malloc(3 * MiB)
def churn():                       # the thread that applies the pause, then waits in the allocator
    ok(acl.rt.set_device(0))
    while True:
        ok(acl.rt.free(malloc(MiB)))
threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
print("exiting", flush=True)       # main returns: the exit waits for the resume
"""


def _waiting_in_the_exit(pid: int) -> bool:
    """The main thread sleeps on a lock (futex) or between tries of one
    (nanosleep: the exit tries its locks every 10 ms)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        return False
    return "futex" in wchan or "nanosleep" in wchan


def _stopped(proc: subprocess.Popen) -> bool:
    """Stops proc (SIGSTOP); whether it is stopped, not ended first."""
    proc.send_signal(signal.SIGSTOP)
    while not process_stopped(proc.pid):
        if proc.poll() is not None:
            return False
        os.sched_yield()
    return True


def test_a_resume_that_lets_the_exit_through_is_acknowledged():
    """The program's main returns while it is paused, so its exit waits on the
    allocator; the resume gives the locks back and the exit runs on at once.
    The resume must still be answered before the process is gone, or the
    requester waits out its timeout and says the command was not answered.
    The exit waits NPA_EXIT_WAIT_MS at most, counted in naps: the process is
    stopped there until the resume is posted, so that the CLI's start-up,
    however long on a loaded machine, is not spent from that wait (a CLI
    past it found the process gone). An exit that ended before it could be
    stopped proves nothing, and the run is made again."""
    waited = 0
    for attempt in range(12):
        proc = subprocess.Popen([sys.executable, "-c", EXIT_WHILE_PAUSED], env=_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == "ready\n"
            assert "paused" in _cli("pause", str(proc.pid), "--timeout", "60").stdout
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "exiting\n"
            while not _waiting_in_the_exit(proc.pid) and proc.poll() is None:  # main is in the exit, on a device lock
                os.sched_yield()
            if not _stopped(proc):
                continue
            with Region(proc.pid) as region:
                posted = region.command_seq()
                resumer = subprocess.Popen([sys.executable, "-m", "npualloc", "resume", str(proc.pid), "--timeout",
                                            "60"], env=sim_env(), text=True, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE)
                while region.command_seq() == posted and resumer.poll() is None:
                    os.sched_yield()
            proc.send_signal(signal.SIGCONT)
            out, err = resumer.communicate(timeout=120)
            assert resumer.returncode == 0 and "resumed" in out, (attempt, err)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, (attempt, err)
            waited += 1
            if waited == 6:
                return
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    pytest.fail(f"the exit waited for the resume in {waited} runs of 12 (it ended before it could be stopped)")


# A loop whose SIGTERM handler is libc's exit, as C services install one: it
# runs on the thread the signal interrupts, here the one waiting, paused,
# inside npualloc with its locks held.
EXIT_ON_TERM = """
import acl, ctypes, signal
libc = ctypes.CDLL(None)
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal(signal.SIGTERM, ctypes.cast(libc.exit, ctypes.c_void_p))
assert acl.init() == 0 and acl.rt.set_device(0) == 0
kept, ret = acl.rt.malloc(8 << 20, 0); assert ret == 0
print("ready", flush=True)
while True:
    ptr, ret = acl.rt.malloc(4096, 0); assert ret == 0
    assert acl.rt.free(ptr) == 0
"""


def test_exit_from_a_signal_handler_while_paused_ends_the_process():
    """The handler's exit ran npualloc's exit handler on the paused thread,
    which waited for the device locks that thread itself held: the process
    never ended and the resume was never answered (only SIGKILL helped).
    The exit now waits for a lock at most NPA_EXIT_WAIT_MS and leaves what
    it could not take to the runtime's own teardown."""
    proc = subprocess.Popen([sys.executable, "-c", EXIT_ON_TERM], env=_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert "paused" in _cli("pause", str(proc.pid), "--timeout", "60").stdout
        proc.send_signal(15)
        proc.wait(timeout=60)
        assert proc.returncode == 15  # exit(SIGTERM's number), from the handler
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Another thread paused inside npualloc, an executor destroy deferred behind
# a queued op, then the main thread exits normally.
PAUSED_EXIT = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *rt;
#define FN(h, name) ((int (*)())dlsym(h, name))

static void *allocating(void *arg)
{
    (void)arg;
    FN(rt, "aclrtSetDevice")(0);
    for (;;) {
        void *p = NULL;
        FN(rt, "aclrtMalloc")(&p, (size_t)4096, 0);
        FN(rt, "aclrtFree")(p);
        usleep(1000);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    rt = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    void *ops = dlopen(argv[2], RTLD_NOW | RTLD_GLOBAL), *nn = dlopen(argv[3], RTLD_NOW | RTLD_GLOBAL);
    void (*duration)(uint64_t) = (void (*)(uint64_t))dlsym(rt, "aclsim_set_op_duration_us");
    if (FN(rt, "aclInit")(NULL) || FN(rt, "aclrtSetDevice")(0)) return 3;
    void *stream = NULL, *dst = NULL, *ws = NULL, *ex = NULL;
    uint64_t ws_size = 0;
    FN(rt, "aclrtCreateStream")(&stream);
    FN(rt, "aclrtMalloc")(&dst, (size_t)4096, 0);
    duration((uint64_t)3000000);
    FN(ops, "aclnnSimFillGetWorkspaceSize")(dst, (uint64_t)4096, 1, &ws_size, &ex);
    duration(0);
    FN(rt, "aclrtMalloc")(&ws, (size_t)(ws_size ? ws_size : 512), 0);
    if (FN(nn, "aclSetAclOpExecutorRepeatable")(ex)) return 4;
    FN(ops, "aclnnSimFill")(ws, ws_size, ex, stream);
    FN(nn, "aclDestroyAclOpExecutor")(ex); /* deferred: its op is queued */
    pthread_t t;
    pthread_create(&t, NULL, allocating, NULL);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 5;
    /* Under CLOCK_AHEAD_C only: the wall clock jumps as the exit begins. */
    void (*clock_jump)(long) = (void (*)(long))dlsym(RTLD_DEFAULT, "clock_ahead_jump");
    if (clock_jump)
        clock_jump(24L * 3600);
    exit(0);
}
"""


def _exit_while_paused(prog: Path, env: dict[str, str]) -> None:
    """Runs PAUSED_EXIT, pauses it, lets main exit: the exit must end by
    itself, within a bound far above its own waits (a second a lock)."""
    proc = subprocess.Popen([str(prog), str(SIM_LIB / "libacl_rt.so"), str(SIM_LIB / "libopapi.so"),
                             str(SIM_LIB / "libnnopbase.so")], env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert "paused" in _cli("pause", str(proc.pid), "--timeout", "60").stdout
        proc.stdin.write("go\n")
        proc.stdin.flush()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the exit still waited after 60 s")
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_normal_exit_while_another_thread_is_paused_ends(tmp_path_factory):
    """With an executor destroy deferred, the exit forwarded it and counted
    that into the device's stats under its lock, which the pausing thread
    holds until a resume: the exit waited for good, and the region being
    gone by then, no resume could reach it. The exit now leaves deferred
    destroys to the runtime and waits for a device lock at most a second."""
    _exit_while_paused(compile_c(tmp_path_factory, "paused_exit", PAUSED_EXIT), _env())


# A preloaded clock_gettime whose CLOCK_REALTIME runs ahead of the kernel's
# once clock_ahead_jump is called: to a reader of the clock that is the
# wall clock stepped back (NTP, `date -s`) right after its read, so an
# absolute realtime deadline it computes lies that far ahead in the
# kernel's time. The kernel's own clock is read by syscall, which no
# interposer sees.
CLOCK_AHEAD_C = r"""
#define _GNU_SOURCE
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static long ahead_s;

void clock_ahead_jump(long seconds)
{
    __atomic_store_n(&ahead_s, seconds, __ATOMIC_RELAXED);
}

int clock_gettime(clockid_t clock, struct timespec *ts)
{
    int err = (int)syscall(SYS_clock_gettime, clock, ts);
    if (err == 0 && clock == CLOCK_REALTIME)
        ts->tv_sec += __atomic_load_n(&ahead_s, __ATOMIC_RELAXED);
    return err;
}
"""


def test_a_wall_clock_step_back_at_exit_does_not_stretch_its_wait(tmp_path_factory):
    """The exit's bounded wait for the lock the paused thread holds (the
    command lock, until the resume) was a realtime deadline: with the wall
    clock stepped back a day as the exit began, it waited a day, not a
    second. The wait is made of relative sleeps now, which no step of the
    wall clock stretches."""
    prog = compile_c(tmp_path_factory, "paused_exit", PAUSED_EXIT)
    lib = compile_shim(prog.parent, "clock_ahead", CLOCK_AHEAD_C)
    env = _env()
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{lib}"
    _exit_while_paused(prog, env)


def test_the_library_needs_no_pthread_mutex_clocklock_to_load():
    """pthread_mutex_clocklock is glibc 2.30's, and Ascend hosts run 2.28:
    a library linked against it would not load there at all."""
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("needs readelf")
    symbols = subprocess.run([readelf, "--dyn-syms", "-W", str(NPUALLOC_LIB)], capture_output=True, text=True,
                             check=True).stdout
    assert " clock_gettime" in symbols  # the table is read: a symbol it does link
    assert "pthread_mutex_clocklock" not in symbols


# A plain run: an allocation and its free, then the exit, which takes
# npualloc's locks with its bounded waits (each device's stream lock, the
# region's command and create locks).
ALLOC_AND_EXIT = r"""
#include <dlfcn.h>
#include <stddef.h>

#define FN(name) ((int (*)())dlsym(RTLD_DEFAULT, name))

int main(int argc, char **argv)
{
    void *block = NULL;
    if (argc != 2 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL))
        return 2;
    if (FN("aclInit")(NULL) || FN("aclrtSetDevice")(0))
        return 3;
    if (((int (*)(void **, size_t, int))dlsym(RTLD_DEFAULT, "aclrtMalloc"))(&block, 4096, 0))
        return 4;
    return ((int (*)(void *))dlsym(RTLD_DEFAULT, "aclrtFree"))(block);
}
"""


def test_the_exit_takes_its_locks_where_helgrind_sees_them(tmp_path_factory):
    """The exit's bounded waits took npualloc's locks with glibc's
    pthread_mutex_clocklock, which valgrind's helgrind (3.19) does not wrap
    (it wraps pthread_mutex_timedlock and trylock): it reported every unlock
    that followed as one of an invalid lock, 17 at a plain exit. The exit
    tries the locks now."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        pytest.skip("needs valgrind")
    prog = compile_c(tmp_path_factory, "alloc_and_exit", ALLOC_AND_EXIT)
    proc = subprocess.run([valgrind, "--tool=helgrind", str(prog), str(SIM_LIB / "libacl_rt.so")],
                          env=preload_env(NPUSIM_HBM_MB="256"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR SUMMARY" in proc.stderr, proc.stderr  # helgrind ran it
    assert "unlocked an invalid lock" not in proc.stderr and "unlocked a not-locked lock" not in proc.stderr, \
        proc.stderr
