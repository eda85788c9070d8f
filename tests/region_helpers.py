"""Plumbing for the region, CLI and Python API tests: a preloaded workload
process driven over stdin, crafted region files, and running the CLI."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

from conftest import ROOT, preload_env, sim_env

sys.path.insert(0, str(ROOT))  # the package of this checkout, whatever the cwd

from npualloc._ffi import REGION_SIZE, constants, ffi
from npualloc.region import process_start_time

# Evaluates one Python expression per stdin line and answers with one JSON line,
# so a test can allocate, read its own stats, or churn in threads on demand.
WORKLOAD = textwrap.dedent("""
    import json, os, random, sys, threading, time, traceback
    import acl
    import npualloc

    assert acl.init() == 0
    assert acl.rt.set_device(0) == 0
    live = []
    churners = []
    churn_errors = []
    churn_counts = []
    stop = threading.Event()

    def malloc(size):
        ptr, ret = acl.rt.malloc(size, 0)
        assert ret == 0, ret
        live.append(ptr)
        return ptr

    def free():
        return acl.rt.free(live.pop())

    def _churn(seed):
        # A failure here must fail the test: it is kept for stop_churn.
        try:
            assert acl.rt.set_device(0) == 0
            rng = random.Random(seed)
            mine = []
            while not stop.is_set():
                if mine and (len(mine) > 16 or rng.random() < 0.5):
                    assert acl.rt.free(mine.pop(rng.randrange(len(mine)))) == 0
                else:
                    ptr, ret = acl.rt.malloc(rng.choice([512, 4096, 300000, 1 << 20, 3 << 20, 12 << 20]), 0)
                    assert ret == 0, ret
                    mine.append(ptr)
                churn_counts[seed] += 1
            for ptr in mine:
                assert acl.rt.free(ptr) == 0
        except BaseException:
            churn_errors.append(traceback.format_exc())
            stop.set()

    def _rewrite_config(seed, texts):
        # As _churn, but each call sets the config: texts by turns.
        try:
            while not stop.is_set():
                npualloc.set_config(texts[churn_counts[seed] % len(texts)])
                churn_counts[seed] += 1
        except BaseException:
            churn_errors.append(traceback.format_exc())
            stop.set()

    def start_churn(threads, config_texts=None):
        stop.clear()
        churn_errors.clear()
        churn_counts[:] = [0] * threads
        churners[:] = [threading.Thread(target=_churn, args=(i,)) if config_texts is None else
                       threading.Thread(target=_rewrite_config, args=(i, config_texts)) for i in range(threads)]
        for t in churners:
            t.start()

    def churn_progress():
        # Calls made by the churn threads so far; raises once one has failed.
        if churn_errors:
            raise AssertionError("a churn thread failed: " + churn_errors[0])
        return sum(churn_counts)

    def stop_churn():
        stop.set()
        for t in churners:
            t.join()
        if churn_errors:
            raise AssertionError("a churn thread failed: " + churn_errors[0])

    def fork_child_allocates(size):
        # The child allocates and reports whether it got a region of its own,
        # what it allocated and its config, then leaves without atexit (as a
        # crash would).
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                malloc(size)
                mine = os.path.exists(os.path.join(os.environ["NPUALLOC_SHM_DIR"], f"npualloc-{os.geteuid()}",
                                                   f"npualloc.{os.getpid()}"))
                os.write(write_end, json.dumps([mine, npualloc.memory_allocated(), npualloc.get_config()]).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        report = json.loads(os.read(read_end, 4096))
        os.close(read_end)
        os.waitpid(pid, 0)
        return [pid] + report

    def fork_child_after_reusing(number):
        # The program puts a file of its own at descriptor number (closing
        # what was there) and forks: whether the child still has that file.
        mine = os.open(os.devnull, os.O_RDONLY)
        os.dup2(mine, number)
        os.close(mine)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.write(write_end, b"1" if os.path.samestat(os.fstat(number), os.stat(os.devnull)) else b"0")
            except OSError:
                os.write(write_end, b"0")
            os._exit(0)
        os.close(write_end)
        kept = os.read(read_end, 1) == b"1"
        os.close(read_end)
        os.waitpid(pid, 0)
        os.close(number)
        return kept

    def fork_child_sleeps():
        # A child that allocates nothing and sleeps on, whatever becomes of
        # this process; the caller ends it.
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        return pid

    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            reply = {"value": eval(line)}
        except BaseException as e:
            reply = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()}
        print(json.dumps(reply), flush=True)
""")


# The start of a C program's main (dlfcn.h and stddef.h included before it):
# the runtime library argv[1] names is loaded, and 1 MiB allocated through
# the global lookup, which finds the preloaded npualloc first, as the
# program's own call would. Exit 2: no runtime; 3: the allocation failed.
MAIN_HOLDING_1_MIB = r"""
int main(int argc, char **argv)
{
    void *runtime = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!runtime)
        return 2;
    int (*init)(const char *) = (int (*)(const char *))dlsym(runtime, "aclInit");
    int (*set_device)(int) = (int (*)(int))dlsym(runtime, "aclrtSetDevice");
    int (*npu_malloc)(void **, size_t, int) = (int (*)(void **, size_t, int))dlsym(RTLD_DEFAULT, "aclrtMalloc");
    void *p = NULL;
    if (init(NULL) != 0 || set_device(0) != 0 || npu_malloc(&p, 1 << 20, 0) != 0)
        return 3;
"""


class Workload:
    """A pyACL program under the simulator, npualloc preloaded unless told
    otherwise; call() evaluates an expression in it. A workload that gives
    no line for ANSWER_LIMIT_S is killed, so a hung one fails its test (as
    one that died) instead of holding the whole suite: no answer here takes
    more than a second. It leads a process group of its own, which the kill
    ends whole: a child it forked holds its stdout too."""

    ANSWER_LIMIT_S = 120

    def __init__(self, shm_dir: Path, preload: bool = True, **env: str):
        make_env = preload_env if preload else sim_env
        self.proc = subprocess.Popen([sys.executable, "-c", WORKLOAD], env=make_env(NPUALLOC_SHM_DIR=str(shm_dir), **env),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.pid = self.proc.pid
        self.stderr_text = ""
        ready = self._line()
        if ready.strip() != '"ready"':
            self.close()
            raise AssertionError(f"workload did not start: {ready!r} {self.stderr()}")

    def call(self, expression: str) -> Any:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(expression + "\n")
        self.proc.stdin.flush()
        line = self._line()
        if not line:
            raise AssertionError(f"workload died on {expression!r}: {self.stderr()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"{expression!r} failed in the workload: {reply['error']}")
        return reply["value"]

    def _line(self) -> str:
        """The workload's next line; "" once it ended, or was killed for
        giving none in time."""
        assert self.proc.stdout
        watchdog = threading.Timer(self.ANSWER_LIMIT_S, self._kill_group)
        watchdog.start()
        try:
            return self.proc.stdout.readline()
        finally:
            watchdog.cancel()

    def _kill_group(self) -> None:
        """The workload and what it forked (the group outlives its leader
        while a member is left). Once the workload was reaped, its number
        may be another's: nothing is signalled then."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stderr(self) -> str:
        self.close()
        return self.stderr_text

    def close(self) -> int:
        """Ends the workload (EOF on stdin: a normal exit); its exit code. What it
        wrote on stderr is kept in stderr_text."""
        if self.proc.returncode is None:
            try:
                _, self.stderr_text = self.proc.communicate(timeout=30)
            finally:
                self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_pending_command(path: Path, poster_alive: Callable[[], bool]) -> None:
    """Returns once a command is posted (request_seq ahead of ack_seq). No
    deadline: a slow machine only waits longer; a poster that ended without
    posting fails the test."""
    while True:
        alive = poster_alive()  # before the read: a poster that posts and then ends is not missed
        data = path.read_bytes()
        region = ffi.from_buffer("npualloc_region *", bytearray(data[:REGION_SIZE]))
        if region.command.request_seq != region.command.ack_seq:
            return
        if not alive:
            raise AssertionError("the poster ended without posting a command")
        time.sleep(0.01)


def region_bytes(for_pid: int, **header: int) -> bytes:
    """A well-formed region of a live process, header fields overridden."""
    region = ffi.new("npualloc_region *")
    fields = {"magic": constants.NPUALLOC_SHM_MAGIC, "version": constants.NPUALLOC_SHM_VERSION, "size": REGION_SIZE,
              "pid": for_pid, "uid": os.geteuid(), "start_time": process_start_time(for_pid) or 0}
    fields.update(header)
    for name, value in fields.items():
        setattr(region.header, name, value)
    region.header.cmdline = b"crafted"
    return bytes(ffi.buffer(region))


def stuck_region_bytes(for_pid: int) -> bytes:
    """A well-formed region whose device 0 seqlock stays odd: a writer
    inside it, forever (died or stopped there, or a crafted file)."""
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(for_pid, device_count=1), REGION_SIZE)
    region.devices[0].in_use = 1
    region.devices[0].seq = 7
    return bytes(ffi.buffer(region))


def region_file(shm_dir: Path, pid: int) -> Path:
    """Where a process of ours publishes its region (its user's region directory)."""
    return shm_dir / f"npualloc-{os.geteuid()}" / f"npualloc.{pid}"


def write_region(shm_dir: Path, pid: int, data: bytes) -> Path:
    path = region_file(shm_dir, pid)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def cli_env(shm_dir: Path) -> dict[str, str]:
    return sim_env(NPUALLOC_SHM_DIR=str(shm_dir))


def run_cli(args: list[str], shm_dir: Path, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npualloc", *args], env=cli_env(shm_dir), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, **kwargs)


def assert_shows_command(shown: str, w: Workload) -> None:
    """The CLI shows the workload's own command line, its script's newlines
    collapsed, cut to one line ending in "…" when long: whatever the length
    of the interpreter's path, which moves where the cut falls."""
    whole = " ".join(" ".join(w.proc.args).split())
    assert shown == whole or (shown.endswith("…") and whole.startswith(shown[:-1]) and len(shown) >= 60), shown


def assert_one_line_error(proc: subprocess.CompletedProcess, exit_code: int, fragment: str) -> None:
    assert proc.returncode == exit_code, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npualloc: "), proc.stderr
    assert fragment in lines[0], proc.stderr


def cli_with_trigger(w: Workload, shm_dir: Path, args: list[str], trigger: str) -> subprocess.CompletedProcess:
    """Runs a CLI command that posts to w's region, then makes w call trigger
    (its next allocator call applies the command), and returns the CLI's result."""
    cli = subprocess.Popen([sys.executable, "-m", "npualloc", *args], env=cli_env(shm_dir),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pending_command(region_file(shm_dir, w.pid), lambda: cli.poll() is None)
    w.call(trigger)
    out, err = cli.communicate(timeout=30)
    return subprocess.CompletedProcess(cli.args, cli.returncode, out, err)


def drain_fifo(reader: int, received: bytearray, chunk: int = 1 << 16, pause_s: float = 0.0) -> None:
    """Reads the FIFO whose read end is reader (opened O_NONBLOCK before any
    writer) into received until its writer closes it, chunk bytes a read and
    pause_s between reads. Run in a thread; fails if no writer comes."""
    poller = select.poll()
    poller.register(reader, select.POLLIN)
    while True:
        assert poller.poll(120_000), "the writer never came or never finished"
        data = os.read(reader, chunk)
        if not data:
            return
        received.extend(data)
        time.sleep(pause_s)
