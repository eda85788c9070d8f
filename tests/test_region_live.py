"""The region of real preloaded processes under the simulator: its life
(created at the first allocation, 0600, removed at exit, fork, NPUALLOC_STATS=0,
problems), what it publishes, and commands posted to it."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import NPUALLOC_LIB, SIM_LIB, compile_c, compile_shim, preload_env, run_python, sim_env
from region_helpers import MAIN_HOLDING_1_MIB, Workload, cli_env, region_bytes, region_file, run_cli, wait_for_pending_command, write_region

import npualloc
from npualloc._ffi import constants, ffi
from npualloc.errors import CommandRejectedError, CommandTimeoutError, NoSuchProcessError, NpuallocError
from npualloc.region import LEFTOVER_NAME, Region, process_start_time, reader_library

MiB = 1 << 20


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    return tmp_path


def test_created_at_first_allocation_private_and_removed_at_exit(shm: Path) -> None:
    with Workload(shm) as w:
        path = region_file(shm, w.pid)
        assert not path.exists()  # aclInit and aclrtSetDevice allocate nothing
        before_ns = time.time_ns()
        w.call("malloc(4096)")
        after_ns = time.time_ns()
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
        with Region(w.pid) as region:
            header = region.header()
            assert header.pid == w.pid and header.uid == os.geteuid()
            assert header.start_time == process_start_time(w.pid)
            assert before_ns <= header.created_unix_ns <= after_ns  # stamped at that first allocation
            assert "import acl" in header.cmdline and "\n" not in header.cmdline
            assert header.device_count == 1 and region.devices_in_use() == [0]
        assert w.close() == 0
    assert not path.exists()
    assert os.listdir(path.parent) == []  # the user's region directory stays, empty, for the next process
    info = path.parent.lstat()
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.geteuid()



def test_a_long_config_reads_whole_from_another_process(shm: Path) -> None:
    """The region's config text was 512 bytes: get_config(pid=) gave a
    config of many keys with a long oom_snapshot path (it comes last) cut at
    511 bytes, inside the path, where get_config() in the process gives it
    whole (613 bytes here; 836 at most: test_config.c)."""
    path = shm / ("d" * 150) / "oom.pickle"
    divisions = ",".join(f"{1 << i}:{1 << (i % 5)}" for i in range(15))
    config = (f"max_split_size_mb:123456789,max_non_split_rounding_mb:123456789,"
              f"garbage_collection_threshold:0.123456789012345,roundup_power2_divisions:[{divisions},>:1],"
              f"per_process_memory_fraction:0.123456789012345,reuse_policy:eager,record_history:1000,"
              f"record_stacks:python,recent_blocks:3,oom_snapshot:{path}")
    with Workload(shm, PYTORCH_NPU_ALLOC_CONF=config) as w:
        w.call(f"malloc({MiB})")
        inside = w.call("npualloc.get_config()")
        assert len(inside) > 512 and inside.endswith(f"oom_snapshot:{path}")
        assert npualloc.get_config(pid=w.pid) == inside


def test_a_device_past_the_runtime_devices_is_refused_from_outside_too(shm: Path) -> None:
    """The header's device_count is the highest device in use + 1, so a reader
    could not tell an unused device from one that does not exist: device 7
    of a process whose runtime sees 2 read all zeros from outside, where the
    process's own calls refuse it. The header now holds the runtime's count."""
    with Workload(shm, NPUSIM_DEVICE_COUNT="2") as w:
        w.call(f"malloc({MiB})")
        with Region(w.pid) as region:
            assert region.header().runtime_device_count == 2
        refusal = r"invalid device (7|'npu:2'|2): the runtime sees 2 device\(s\)"
        for call in (lambda: npualloc.memory_stats(7, pid=w.pid), lambda: npualloc.memory_allocated("npu:2", pid=w.pid),
                     lambda: npualloc.memory_summary(7, pid=w.pid), lambda: npualloc.reset_peak_memory_stats(7, pid=w.pid),
                     lambda: npualloc.set_per_process_memory_fraction(0.5, 2, pid=w.pid),
                     lambda: npualloc.mem_get_info(7, pid=w.pid)):
            with pytest.raises(ValueError, match=refusal):
                call()
        assert npualloc.memory_allocated(0, pid=w.pid) >= MiB
        assert npualloc.memory_allocated(1, pid=w.pid) == 0  # a device that exists, unused


def test_mem_get_info_of_another_process_is_the_pair_it_last_sampled(shm: Path) -> None:
    """mem_get_info had no pid=, as every other reading call has: another
    process's (free, total) is its region's last sample, taken at a cache
    miss that grew its pool (or an empty_cache, an OOM), not a fresh query."""
    with Workload(shm) as w:
        w.call(f"malloc({MiB})")
        w.call(f"malloc({200 * MiB})")  # a miss: the process samples the device
        sampled = w.call("npualloc.mem_get_info(0)")  # the runtime's figure now, in the process
        assert list(npualloc.mem_get_info(pid=w.pid)) == sampled and sampled[0] < sampled[1]
        for device in (0, "npu:0", SimpleNamespace(type="npu", index=0)):
            assert npualloc.mem_get_info(device, pid=w.pid) == tuple(sampled)
        with Workload(shm) as other:  # another process on the same device, which w does not see
            other.call(f"malloc({64 * MiB})")
            assert w.call("npualloc.mem_get_info(0)")[0] <= sampled[0] - 64 * MiB
            assert list(npualloc.mem_get_info(0, pid=w.pid)) == sampled
            w.call(f"malloc({100 * MiB})")  # w's next miss: its next sample
            assert list(npualloc.mem_get_info(0, pid=w.pid)) == w.call("npualloc.mem_get_info(0)")
        with pytest.raises(NpuallocError, match="process [0-9]+ has no figure of device 1's memory"):
            npualloc.mem_get_info(1, pid=w.pid)  # a device it has not used
    with pytest.raises(NoSuchProcessError):
        npualloc.mem_get_info(pid=w.pid)


def test_outside_view_matches_the_process_own_view(shm: Path) -> None:
    with Workload(shm) as w:
        for size in (512, 300_000, MiB, 12 * MiB, 40 * MiB):
            w.call(f"malloc({size})")
        w.call("free()")
        inside = w.call("npualloc.memory_stats()")
        outside = npualloc.memory_stats(pid=w.pid)
        assert outside == inside
        assert outside["allocated_bytes.all.current"] > 12 * MiB
        assert outside["num_device_alloc"] >= 2
        assert npualloc.memory_allocated(pid=w.pid) == inside["allocated_bytes.all.current"]
        assert npualloc.max_memory_reserved(pid=w.pid) == inside["reserved_bytes.all.peak"]
        assert npualloc.memory_summary(pid=w.pid) == w.call("npualloc.memory_summary()")


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:64"])
def test_a_device_the_cache_never_used_reads_the_same_outside(shm: Path, conf: str) -> None:
    """torch's figures of a device nothing was allocated on: all 0 but
    max_split_size, the setting (-1 unset). The region's slot read 0 there: on
    a device never used, and on one only memory_saver allocated on, which
    `npualloc stats` lists."""
    with Workload(shm, PYTORCH_NPU_ALLOC_CONF=conf) as w:
        w.call("malloc(4096)")
        w.call("acl.rt.set_device(1)")
        w.call("exec('from npualloc import memory_saver\\nwith memory_saver.region(\\'kv\\'): malloc(4096)')")
        for device in (1, 2):
            inside = w.call(f"npualloc.memory_stats({device})")
            assert npualloc.memory_stats(device, pid=w.pid) == inside
            assert inside["max_split_size"] == (64 * MiB if conf else -1)


def test_exit_leaves_a_region_another_process_put_at_our_name(shm: Path) -> None:
    """Processes in two pid namespaces that share the region directory may
    have the same pid: the later one renames its region over the earlier's.
    The earlier one's exit then removes only its own file, not the other's
    live region."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        path = region_file(shm, w.pid)
        theirs = path.with_name("theirs.tmp")
        theirs.write_bytes(path.read_bytes())
        os.rename(theirs, path)
        replaced = path.stat().st_ino
        assert w.close() == 0
    assert path.exists() and path.stat().st_ino == replaced


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def test_ls_leaves_the_region_of_a_live_process_whose_pid_names_none_here(shm: Path) -> None:
    """A process in another pid namespace sharing the directory publishes
    under a pid that names another process here, or none: its region was
    removed by `ls` as a dead process's while it ran on. Its lock says it
    lives: left alone (not listed, its pid meaning nothing here) until it
    ends. The process's own file linked under a dead pid's name stands in
    for it (the same file, held by the same lock)."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        elsewhere = region_file(shm, _dead_pid())
        os.link(region_file(shm, w.pid), elsewhere)
        listed = run_cli(["ls", "--json"], shm)
        assert listed.returncode == 0 and [row["pid"] for row in json.loads(listed.stdout)] == [w.pid]
        assert elsewhere.exists()
        assert w.close() == 0
    assert run_cli(["ls"], shm).stdout == "no process is running under npualloc\n"
    assert not elsewhere.exists()  # its process gone, its lock with it


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1): a process in a pid namespace of its own")
def test_ls_leaves_the_region_of_a_process_in_another_pid_namespace(shm: Path) -> None:
    """The case itself: a process that is pid 1 of its own namespace
    publishes npualloc.1, which `ls` here read as init's stale region."""
    program = "import acl, sys; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0); print(flush=True); sys.stdin.read()"
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", program],
                             env=preload_env(NPUALLOC_SHM_DIR=str(shm)), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert inner.stdout is not None and inner.stdout.readline() == b"\n"
        published = region_file(shm, 1)
        assert published.exists()
        assert run_cli(["ls"], shm).returncode == 0
        assert published.exists()
    finally:
        inner.communicate(timeout=30)
    assert inner.returncode == 0 and not published.exists()  # removed by its own exit


def test_ls_leaves_the_files_a_live_process_whose_pid_names_none_here_still_uses(shm: Path) -> None:
    """`ls` judged a snapshot hand-over file (and its temporary) and a region
    temporary by the pid in its name alone: those of a live process in
    another pid namespace sharing the directory (its pid naming none here)
    went as a dead process's, the snapshot before its requester read it. A
    snapshot file is its process's while that process holds its region's
    lock; a region temporary is locked from its creation. Stand-ins: the
    workload's region linked under a dead pid's name, a temporary whose lock
    the test holds."""
    dead = _dead_pid(), _dead_pid()
    with Workload(shm) as w:
        w.call("malloc(4096)")
        region = region_file(shm, dead[0])
        os.link(region_file(shm, w.pid), region)
        inode = region.stat().st_ino
        used = [region.with_name(f"{region.name}.snapshot.{inode}.1"),
                region.with_name(f"{region.name}.snapshot.{inode}.2.tmp.{dead[0]}.0badf00d"),
                region.with_name(f"{region.name}.snapshot.3")]  # as named before region layout version 8
        temporary = region.with_name(f".npualloc.{dead[1]}.tmp.0badf00d")
        for path in used + [temporary]:
            path.write_bytes(b"x")
        with open(temporary, "rb") as holder:
            fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives, making its region
            assert run_cli(["ls"], shm).returncode == 0
            assert all(path.exists() for path in used + [temporary, region])
        assert run_cli(["ls"], shm).returncode == 0
        assert not temporary.exists()
        assert all(path.exists() for path in used + [region])
        assert w.close() == 0
    assert run_cli(["ls"], shm).returncode == 0
    assert os.listdir(region.parent) == []


# Says on stderr whether the region's temporary is locked when it is sized,
# as a reader opening it then would see it (F_OFD_GETLK on a description of
# its own): between its creation and its publishing rename.
# The start of a shim of posix_fallocate, which the region's temporary is
# sized with: region_temporary names the file fd is open on (its path in
# target) when it is one of npualloc's, else NULL.
SIZED_TEMPORARY_PRELUDE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const char *region_temporary(int fd, char target[4096])
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, 4095);
    const char *base = n > 0 ? (target[n] = '\0', strrchr(target, '/')) : NULL;
    return base && strncmp(base + 1, ".npualloc.", 10) == 0 ? base + 1 : NULL;
}
"""

LOCKED_WHEN_SIZED_SHIM = SIZED_TEMPORARY_PRELUDE + r"""
int posix_fallocate(int fd, off_t offset, off_t len)
{
    char target[4096];
    const char *name = region_temporary(fd, target);
    if (name) {
        int other = open(target, O_RDONLY | O_CLOEXEC);
        struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
        if (other >= 0 && fcntl(other, F_OFD_GETLK, &lock) == 0)
            fprintf(stderr, "shim: %s %s\n", name, lock.l_type == F_UNLCK ? "unlocked" : "locked");
        if (other >= 0)
            close(other);
    }
    return ((int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate"))(fd, offset, len);
}
"""


def test_a_region_temporary_is_locked_from_its_creation(shm: Path, tmp_path: Path) -> None:
    """The region file was locked only just before its publishing rename:
    while it was sized and mapped, a process in another pid namespace (its
    pid naming none here) had its temporary unlocked, and `ls` removed it as
    a dead process's, so its rename failed and it ran without a region."""
    env = preload_env(NPUALLOC_SHM_DIR=str(shm))
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{compile_shim(tmp_path, 'sized', LOCKED_WHEN_SIZED_SHIM)}"
    done = run_python("import acl, os; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0); print(os.getpid())", env)
    assert re.fullmatch(rf"shim: \.npualloc\.{done.stdout.strip()}\.tmp\.[0-9a-f]{{8}} locked\n", done.stderr), done.stderr


# Says on stderr whether the region's temporary is locked the moment its name
# appears (created there, or a nameless file linked there), as a reader
# opening it then would see it. REFUSE_TMPFILE: O_TMPFILE fails, as on a file
# system without it.
LOCKED_WHEN_NAMED_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void report(int dir_fd, const char *name)
{
    if (strncmp(name, ".npualloc.", 10) != 0 || strstr(name, ".tmp.") == NULL)
        return;
    int other = openat(dir_fd, name, O_RDONLY | O_CLOEXEC);
    struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET};
    if (other >= 0 && fcntl(other, F_OFD_GETLK, &lock) == 0)
        fprintf(stderr, "shim: %s %s\n", name, lock.l_type == F_UNLCK ? "unlocked" : "locked");
    if (other >= 0)
        close(other);
}

int openat(int dir_fd, const char *name, int flags, ...)
{
    va_list args;
    va_start(args, flags);
    mode_t mode = (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(args, mode_t) : 0;
    va_end(args);
    if ((flags & O_TMPFILE) == O_TMPFILE && getenv("REFUSE_TMPFILE")) {
        errno = EOPNOTSUPP;
        return -1;
    }
    int fd = ((int (*)(int, const char *, int, mode_t))dlsym(RTLD_NEXT, "openat"))(dir_fd, name, flags, mode);
    if (fd >= 0 && (flags & O_CREAT))
        report(dir_fd, name);
    return fd;
}

int linkat(int from_fd, const char *from, int to_fd, const char *to, int flags)
{
    int linked = ((int (*)(int, const char *, int, const char *, int))dlsym(RTLD_NEXT, "linkat"))(from_fd, from, to_fd,
                                                                                                   to, flags);
    if (linked == 0)
        report(to_fd, to);
    return linked;
}
"""


@pytest.mark.parametrize("o_tmpfile", ["supported", "refused"])
def test_a_region_temporary_is_locked_before_it_has_a_name(shm: Path, tmp_path: Path, o_tmpfile: str) -> None:
    """It was created at its name and locked by the next call: in between, a
    process in another pid namespace (its pid naming none here) had its
    temporary unlocked there, for `ls` to remove as a dead process's. It is
    made nameless (O_TMPFILE), locked, linked at its name, and opened again
    there, so that /proc/<pid>/fd (lsof) shows the region, not a deleted
    file. Where the file system refuses O_TMPFILE it is created at its name,
    as before, and published."""
    env = preload_env(NPUALLOC_SHM_DIR=str(shm))
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{compile_shim(tmp_path, 'named', LOCKED_WHEN_NAMED_SHIM)}"
    if o_tmpfile == "refused":
        env["REFUSE_TMPFILE"] = "1"
    program = ("import acl, os; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n"
               "fds = os.listdir('/proc/self/fd')  # with the listing's own, closed by the time it is read\n"
               "print(os.getpid(), [os.readlink(f'/proc/self/fd/{fd}') for fd in fds if os.path.lexists(f'/proc/self/fd/{fd}')])")
    done = run_python(program, env)
    pid, opened = done.stdout.split(" ", 1)
    state = "locked" if o_tmpfile == "supported" else "unlocked"
    assert re.fullmatch(rf"shim: \.npualloc\.{pid}\.tmp\.[0-9a-f]{{8}} {state}\n", done.stderr), done.stderr
    assert repr(str(region_file(shm, int(pid)))) in opened


# A process whose pid, $PID_HERE, names no process where the test runs, as
# one in another pid namespace sharing the directory: O_TMPFILE fails (a file
# system without it), and once its region's temporary is created at its name
# it says "created" on stdout and waits for a line on stdin.
CREATED_ELSEWHERE_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

pid_t getpid(void)
{
    return (pid_t)atoi(getenv("PID_HERE"));
}

int openat(int dir_fd, const char *name, int flags, ...)
{
    static int waited;
    va_list args;
    va_start(args, flags);
    mode_t mode = (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(args, mode_t) : 0;
    va_end(args);
    if ((flags & O_TMPFILE) == O_TMPFILE) {
        errno = EOPNOTSUPP;
        return -1;
    }
    int fd = ((int (*)(int, const char *, int, mode_t))dlsym(RTLD_NEXT, "openat"))(dir_fd, name, flags, mode);
    if (fd >= 0 && (flags & O_CREAT) && strstr(name, ".tmp.") && !waited++) {
        char c;
        (void)!write(1, "created\n", 8);
        while (read(0, &c, 1) == 1 && c != '\n')
            ;
    }
    return fd;
}
"""


def test_a_region_temporary_another_namespaces_reaper_removed_before_its_lock_is_made_again(
        shm: Path, tmp_path: Path) -> None:
    """Made at its name where O_TMPFILE is missing, the temporary is
    unlocked there until the next call: a process in another pid namespace
    (its pid naming none here) had it removed meanwhile by the reaper of any
    process here creating its region or exiting, as a gone process's, and
    its publishing rename failed: it ran without a region. A temporary gone
    at the rename is made again."""
    dead = _dead_pid()
    env = preload_env(NPUALLOC_SHM_DIR=str(shm), PID_HERE=str(dead))
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{compile_shim(tmp_path, 'elsewhere', CREATED_ELSEWHERE_SHIM)}"
    program = ("import acl, os, sys; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n"
               "print(os.path.exists(sys.argv[1]), flush=True); sys.stdin.readline()")
    published = region_file(shm, dead)
    elsewhere = subprocess.Popen([sys.executable, "-c", program, str(published)], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert elsewhere.stdout is not None and elsewhere.stdout.readline() == "created\n"
        assert [name for name in os.listdir(published.parent) if name.startswith(f".npualloc.{dead}.tmp.")]
        with Workload(shm) as w:
            w.call("malloc(4096)")  # its reaper looks
            assert not any(name.startswith(f".npualloc.{dead}.") for name in os.listdir(published.parent))
            assert w.close() == 0
        assert elsewhere.stdin is not None
        elsewhere.stdin.write("go on\n")
        elsewhere.stdin.flush()
        assert elsewhere.stdout.readline() == "True\n"
    finally:
        _, err = elsewhere.communicate("\n", timeout=30)
    assert elsewhere.returncode == 0 and err == "", err
    assert os.listdir(published.parent) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1): a mount namespace with a /proc of its own")
def test_a_region_temporary_is_linked_only_as_itself_where_proc_is_no_procfs(shm: Path) -> None:
    """The nameless temporary is linked at its name through /proc/self/fd/N,
    which, where /proc is no procfs (a chroot's plain directory, a file
    system mounted over it), may be a link to any file: that file was
    linked at the temporary's name and published as the region, which the
    process then filled unseen, and its link stayed after exit. Only the
    file itself is linked, else the temporary is created at its name."""
    target = shm / "target"
    target.write_bytes(b"not a region")
    program = ("import acl, os, sys; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n"
               "print(os.path.getsize(f'{sys.argv[1]}/npualloc.{os.getpid()}'))")
    fake_proc = ("mount -t tmpfs none /proc && mkdir -p /proc/self/fd && "
                 f"for fd in $(seq 0 255); do ln -s {target} /proc/self/fd/$fd; done && exec \"$0\" -c \"$1\" \"$2\"")
    directory = region_file(shm, 1).parent
    done = subprocess.run(["unshare", "--mount", "sh", "-c", fake_proc, sys.executable, program, str(directory)],
                          env=preload_env(NPUALLOC_SHM_DIR=str(shm)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert int(done.stdout) == ffi.sizeof("npualloc_region")  # its own region, not the file linked
    assert target.read_bytes() == b"not a region" and target.stat().st_nlink == 1
    assert os.listdir(directory) == []  # its region removed at exit


# Inside a pid namespace of its own (unshare's fork, pid 1 there): a worker
# given the pid argv[1] there (ns_last_pid), which names no process outside,
# holds 4096 bytes (and argv[3] MiB more, a segment of their own, when not
# 0) and allocates until told to stop; this process asks it for a snapshot
# and reads the file once a line comes on stdin, then prints its segments.
SNAPSHOT_IN_A_PID_NAMESPACE = r"""
import os, subprocess, sys
import npualloc.snapshot
from npualloc._ffi import constants
from npualloc.region import Region

WORKER = ("import acl, select, sys\n"
          "acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n"
          f"if {int(sys.argv[3])}: acl.rt.malloc({int(sys.argv[3])} << 20, 0)\n"
          "print(flush=True)\n"
          "while not select.select([sys.stdin], [], [], 0.005)[0]:\n"
          "    acl.rt.free(acl.rt.malloc(4096, 0)[0])\n")
with open("/proc/sys/kernel/ns_last_pid", "w") as last:
    last.write(str(int(sys.argv[1]) - 1))
worker = subprocess.Popen([sys.executable, "-c", WORKER], env=dict(os.environ, LD_PRELOAD=sys.argv[2]),
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
try:
    assert worker.pid == int(sys.argv[1]) and worker.stdout.readline() == b"\n", worker.pid
    with Region(worker.pid, writable=True) as region:
        seq = region.post_command(constants.NPUALLOC_CMD_SNAPSHOT, timeout=20)
        print("answered", flush=True)
        sys.stdin.readline()
        data = npualloc.snapshot._read_snapshot_file(region, seq)
    print(len(npualloc.snapshot.loads(data)["segments"]), flush=True)
finally:
    worker.communicate(b"stop", timeout=30)
"""


def _snapshot_in_a_pid_namespace(shm: Path, pid: int, extra_mib: int) -> subprocess.Popen:
    """SNAPSHOT_IN_A_PID_NAMESPACE run in a pid namespace of its own."""
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                             SNAPSHOT_IN_A_PID_NAMESPACE, str(pid), preload_env()["LD_PRELOAD"], str(extra_mib)],
                            env=sim_env(NPUALLOC_SHM_DIR=str(shm)), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1): a process in a pid namespace of its own")
def test_ls_leaves_the_snapshot_of_a_process_in_another_pid_namespace_for_its_requester(shm: Path) -> None:
    """The case itself: the process answered a snapshot command of a
    requester in its namespace, and `ls` outside removed the file before the
    requester read it, its pid naming no process there."""
    pid = _dead_pid()
    inner = _snapshot_in_a_pid_namespace(shm, pid, 0)
    try:
        assert inner.stdout is not None and inner.stdout.readline() == "answered\n"
        assert run_cli(["ls"], shm).returncode == 0
    finally:
        out, err = inner.communicate("read it\n", timeout=60)
    assert inner.returncode == 0 and out == "1\n", err


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1): processes in pid namespaces of their own")
def test_a_snapshot_requester_reads_its_own_process_s_file_beside_a_same_pid_one(shm: Path) -> None:
    """Two processes with the same pid in two pid namespaces sharing the
    directory, each asked for its first snapshot by a requester in its own:
    both answered at npualloc.<pid>.snapshot.1, the second over the first's
    file before its requester read it, which then read (1 segment expected,
    2 read) and removed the other's, whose requester found none."""
    pid = _dead_pid()
    requesters = [_snapshot_in_a_pid_namespace(shm, pid, 0)]
    try:
        assert requesters[0].stdout is not None and requesters[0].stdout.readline() == "answered\n"
        requesters.append(_snapshot_in_a_pid_namespace(shm, pid, 12))
        assert requesters[1].stdout is not None and requesters[1].stdout.readline() == "answered\n"
    finally:
        read = [requester.communicate("read it\n", timeout=60) for requester in requesters]
    assert [(requester.returncode, out) for requester, (out, _) in zip(requesters, read)] == \
        [(0, "1\n"), (0, "2\n")], [err for _, err in read]
    assert os.listdir(region_file(shm, pid).parent) == []


def test_a_forked_child_does_not_keep_the_parents_region_alive(shm: Path) -> None:
    """The child inherits the descriptor that holds the parent's lock: kept,
    it would make the region of a parent killed before it look alive for as
    long as the child lives. The child lets it go."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        child = w.call("fork_child_sleeps()")
        try:
            w.proc.kill()
            w.proc.wait()
            path = region_file(shm, w.pid)
            assert path.exists()  # killed: no atexit
            assert process_start_time(child) is not None  # still there, sleeping
            assert run_cli(["ls"], shm).stdout == "no process is running under npualloc\n"
            assert not path.exists()
        finally:
            os.kill(child, signal.SIGKILL)


def test_leftover_region_with_our_pid_is_replaced(shm: Path) -> None:
    with Workload(shm) as w:
        path = write_region(shm, w.pid, b"garbage from a process long gone")
        w.call("malloc(4096)")
        assert npualloc.memory_allocated(pid=w.pid) >= 4096
        assert path.stat().st_size > 100


def test_a_region_temporary_another_process_with_our_pid_is_making_is_left_alone(shm: Path) -> None:
    """The region was made under .npualloc.<pid>.tmp, and one found there was
    unlinked by name as an earlier process's leftover: a process with the
    same pid in another pid namespace sharing the directory, making its
    region at that moment, lost its temporary, and its publishing rename
    moved ours into place half made, or failed. Each temporary has a name of
    its own; a leftover goes with the next process or `ls` (its lock free,
    its pid gone)."""
    with Workload(shm) as w:
        directory = region_file(shm, w.pid).parent
        directory.mkdir(mode=0o700)
        theirs = directory / f".npualloc.{w.pid}.tmp"
        theirs.write_bytes(b"being made")
        with open(theirs, "rb") as holder:
            fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives
            w.call("malloc(4096)")
            assert theirs.read_bytes() == b"being made"
            assert os.fstat(holder.fileno()).st_ino == theirs.stat().st_ino
        assert npualloc.memory_allocated(pid=w.pid) >= 4096
        assert sorted(os.listdir(directory)) == sorted([theirs.name, f"npualloc.{w.pid}"])


def test_stats_off_leaves_nothing_and_keeps_serving(shm: Path) -> None:
    with Workload(shm, NPUALLOC_STATS="0") as w:
        w.call(f"malloc({MiB})")
        assert os.listdir(shm) == []
        assert w.call("npualloc.memory_allocated()") >= MiB  # the in-process API does not need the region
        w.close()
        assert w.proc.returncode == 0


def test_unusable_directory_warns_once_and_carries_on(tmp_path: Path) -> None:
    with Workload(tmp_path / "missing") as w:
        for _ in range(3):
            w.call(f"malloc({MiB})")
        assert w.call("npualloc.memory_allocated()") >= 3 * MiB
        assert w.close() == 0
    warnings = [line for line in w.stderr_text.splitlines() if "live stats disabled" in line]
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: "), w.stderr_text


def test_forked_child_gets_its_own_region(shm: Path) -> None:
    with Workload(shm) as w:
        w.call(f"malloc({3 * MiB})")
        before = npualloc.memory_stats(pid=w.pid)
        child, child_had_region, child_allocated, _config = w.call(f"fork_child_allocates({12 * MiB})")
        assert child_had_region
        assert 12 * MiB <= child_allocated < 13 * MiB  # a fresh allocator: none of the parent's blocks
        assert npualloc.memory_stats(pid=w.pid) == before  # the child wrote nothing here
        # The child left through _exit (no atexit): its file stays until
        # the next process of the user (or this one at its exit) or `ls` removes it.
        assert region_file(shm, child).exists()
        assert region_file(shm, w.pid).exists()


@pytest.mark.parametrize("descriptor", ["directory", "file"])
def test_a_forked_child_closes_only_descriptors_that_still_are_npualloc_s(shm: Path, descriptor: str) -> None:
    """The program closed the region directory's (or file's) descriptor,
    which it did not open, and put a file of its own at the number: the
    child's fork handler closed the program's file."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        path = region_file(shm, w.pid)
        ours = str(path.parent if descriptor == "directory" else path)
        numbers = [int(fd) for fd in os.listdir(f"/proc/{w.pid}/fd") if os.readlink(f"/proc/{w.pid}/fd/{fd}") == ours]
        assert len(numbers) == 1
        assert w.call(f"fork_child_after_reusing({numbers[0]})")


def test_regions_of_children_that_left_through_exit_go_with_the_next_one_and_the_parent(shm: Path) -> None:
    """Forked workers that allocate and end with os._exit (multiprocessing's
    way) skip atexit: each left its region until someone ran `npualloc ls`.
    Each child that creates its region removes those of the children gone
    before it, and the parent what is left at its exit."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        children = [w.call(f"fork_child_allocates({MiB})")[0] for _ in range(3)]
        assert [child for child in children if region_file(shm, child).exists()] == children[-1:]
        assert w.close() == 0
    assert os.listdir(region_file(shm, w.pid).parent) == []


def test_the_next_process_removes_the_region_a_killed_one_left(shm: Path) -> None:
    with Workload(shm) as killed:
        killed.call("malloc(4096)")
        killed.proc.kill()
    left = region_file(shm, killed.pid)
    assert left.exists()
    with Workload(shm) as w:
        w.call("malloc(4096)")
        assert not left.exists()


def test_the_next_process_removes_only_the_regions_of_gone_processes_of_its_user(shm: Path, sleeper: int) -> None:
    """Beside the region of a gone process, what it must leave: a region
    whose process holds its lock (one alive in another pid namespace), a
    link (never followed, its target neither), a FIFO (never waited on), a
    region of another layout, one of a live pid, and (root) another user's
    file. A region its lock kept goes once the lock is let go."""
    dead = [_dead_pid() for _ in range(6)]
    gone = write_region(shm, dead[0], region_bytes(dead[0]))
    held = write_region(shm, dead[1], region_bytes(dead[1]))
    directory = gone.parent
    target = shm / "target"
    target.write_bytes(region_bytes(dead[2]))
    link = directory / f"npualloc.{dead[2]}"
    link.symlink_to(target)
    fifo = directory / f"npualloc.{dead[3]}"
    os.mkfifo(fifo, 0o600)
    older = write_region(shm, dead[4], region_bytes(dead[4], version=constants.NPUALLOC_SHM_VERSION - 1))
    live = write_region(shm, sleeper, region_bytes(sleeper))
    left = [held, link, target, fifo, older, live]
    if os.geteuid() == 0:
        theirs = write_region(shm, dead[5], region_bytes(dead[5]))
        os.chown(theirs, 65534, 65534)
        left.append(theirs)
    with open(held, "rb") as holder:
        fcntl.lockf(holder, fcntl.LOCK_SH)
        with Workload(shm) as w:
            w.call("malloc(4096)")
            assert not gone.exists()
            assert all(os.path.lexists(path) for path in left)
            assert w.close() == 0
        assert all(os.path.lexists(path) for path in left) and link.is_symlink()
    with Workload(shm) as w:
        w.call("malloc(4096)")
        assert not held.exists()
        assert all(os.path.lexists(path) for path in left[1:])


# Kills the process the moment its region's temporary is sized: between its
# creation, which gave it a name, and its publishing rename.
KILLED_WHEN_SIZED_SHIM = SIZED_TEMPORARY_PRELUDE + r"""
int posix_fallocate(int fd, off_t offset, off_t len)
{
    char target[4096];
    if (region_temporary(fd, target))
        raise(SIGKILL);
    return ((int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate"))(fd, offset, len);
}
"""


@pytest.mark.parametrize("o_tmpfile", ["supported", "refused"])
def test_the_next_process_removes_the_temporaries_of_processes_killed_making_their_region(
        shm: Path, tmp_path: Path, o_tmpfile: str) -> None:
    """Each temporary has a random name of its own, and only `ls` removed one
    a killed process left: every process killed before its region was
    published left one more file in /dev/shm, and the next processes of the
    user, which remove killed processes' regions, removed none of them. The
    lock of a killed process's temporary is gone with it, its pid names no
    process: the next process removes it as it creates its region."""
    env = preload_env(NPUALLOC_SHM_DIR=str(shm))
    killed_env = dict(env, LD_PRELOAD=f"{env['LD_PRELOAD']}:{compile_shim(tmp_path, 'killed', KILLED_WHEN_SIZED_SHIM)}")
    if o_tmpfile == "refused":  # created at its name, locked by the next call
        killed_env["LD_PRELOAD"] += f":{compile_shim(tmp_path, 'named', LOCKED_WHEN_NAMED_SHIM)}"
        killed_env["REFUSE_TMPFILE"] = "1"
    program = "import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)"
    killed = [subprocess.run([sys.executable, "-c", program], env=killed_env, capture_output=True, timeout=60)
              for _ in range(3)]
    assert [run.returncode for run in killed] == [-signal.SIGKILL] * 3, killed[0].stderr
    directory = region_file(shm, 1).parent
    left = sorted(os.listdir(directory))
    assert len(left) == 3 and all(re.fullmatch(r"\.npualloc\.[0-9]+\.tmp\.[0-9a-f]{8}", name) for name in left), left
    with Workload(shm) as w:
        w.call("malloc(4096)")
        assert os.listdir(directory) == [f"npualloc.{w.pid}"]
        assert w.close() == 0
    assert os.listdir(directory) == []


def test_the_next_process_removes_only_the_temporaries_and_aside_names_gone_processes_left(
        shm: Path, sleeper: int) -> None:
    """Beside a temporary and an aside name of gone processes, under every
    name the reaper and `ls` both take for theirs, what it must leave: a
    temporary or aside name whose lock is held (a live process making its
    region; a live region a killed reaper left aside, for `ls` to put back),
    one of a live pid (a temporary made without O_TMPFILE is unlocked until
    the call after its creation), a link (never followed, its target
    neither), a FIFO (never waited on), a directory, names that only look
    alike, and (root) another user's file."""
    dead = _dead_pid()
    directory = region_file(shm, dead).parent
    directory.mkdir(mode=0o700)
    gone = [directory / name for name in (f".npualloc.{dead}.tmp.0badf00d", f".npualloc.{dead}.reap.0badf00d",
                                          f".npualloc.{dead}.tmp", f".npualloc.{dead}.reap")]
    held = [directory / f".npualloc.{dead}.tmp.00000001", directory / f".npualloc.{dead}.reap.00000001"]
    live = [directory / f".npualloc.{sleeper}.tmp.00000002", directory / f".npualloc.{sleeper}.reap.00000002"]
    alike = [directory / name for name in (f".npualloc.{dead}.tmp.0BADF00D", f".npualloc.{dead}.tmp.0badf00",
                                           f".npualloc.{dead}.tmp.0badf00d.x", f".npualloc.{dead}.tmpx",
                                           f".npualloc.0{dead}.tmp.0badf00d", f".npualloc.{dead}.reap.",
                                           f"npualloc.{dead}.tmp.0badf00d", f".npualloc..tmp.0badf00d")]
    for path in gone + held + live + alike:
        path.write_bytes(b"x")
    target = shm / "target"
    target.write_bytes(b"x")
    link = directory / f".npualloc.{dead}.tmp.00000003"
    link.symlink_to(target)
    fifo = directory / f".npualloc.{dead}.reap.00000003"
    os.mkfifo(fifo, 0o600)
    made = directory / f".npualloc.{dead}.tmp.00000004"
    made.mkdir()
    left = held + live + alike + [link, target, fifo, made]
    if os.geteuid() == 0:
        theirs = directory / f".npualloc.{dead}.tmp.00000005"
        theirs.write_bytes(b"x")
        os.chown(theirs, 65534, 65534)
        left.append(theirs)
    assert all(LEFTOVER_NAME.fullmatch(path.name) for path in gone)  # `ls` removes them too
    assert not any(LEFTOVER_NAME.fullmatch(path.name) for path in alike)
    holders = [open(path, "rb") for path in held]
    try:
        for holder in holders:
            fcntl.lockf(holder, fcntl.LOCK_SH)
        with Workload(shm) as w:
            w.call("malloc(4096)")
            assert not any(os.path.lexists(path) for path in gone)
            assert all(os.path.lexists(path) for path in left) and link.is_symlink()
            assert w.close() == 0
        assert all(os.path.lexists(path) for path in left)
    finally:
        for holder in holders:
            holder.close()
    with Workload(shm) as w:
        w.call("malloc(4096)")
        assert not any(os.path.lexists(path) for path in held)
        assert all(os.path.lexists(path) for path in left[len(held):])


def _zombie() -> subprocess.Popen:
    """A child that has exited and that nobody has waited for yet."""
    child = subprocess.Popen(["true"])
    stat_path = Path(f"/proc/{child.pid}/stat")
    while stat_path.read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        os.sched_yield()
    return child


def test_ls_and_the_reaper_remove_the_same_leftovers(tmp_path: Path) -> None:
    """One rule for both: a zombie holds nothing (its descriptors, hence its
    locks, are gone), so its temporaries, aside names and region go; a name
    nothing writes (pid 0, past a pid_t, overlong, a leading zero) stays.
    `ls` kept a zombie's temporaries, aside names and region (listing the
    region as a live process's), and removed those names the reaper kept."""
    zombie = _zombie()
    try:
        names = {f".npualloc.{zombie.pid}.tmp.0badf00d": False, f".npualloc.{zombie.pid}.reap.0badf00d": False,
                 f".npualloc.{zombie.pid}.tmp": False, f"npualloc.{zombie.pid}": False,
                 ".npualloc.0.tmp": True, ".npualloc.0.reap.0badf00d": True,
                 f".npualloc.{2**31}.tmp.0badf00d": True, f".npualloc.{2**64}.reap": True,
                 f".npualloc.{'9' * 40}.tmp": True, f".npualloc.0{zombie.pid}.tmp.0badf00d": True,
                 f"npualloc.0{zombie.pid}.snapshot.1": True, f"npualloc.{2**31}": True}
        left = {}
        for by in ("reaper", "ls"):
            shm = tmp_path / by
            shm.mkdir()
            for name in names:
                write_region(shm, zombie.pid, region_bytes(zombie.pid)).rename(region_file(shm, 1).parent / name)
            if by == "reaper":
                with Workload(shm) as w:
                    w.call("malloc(4096)")
                    assert w.close() == 0
            else:
                listed = run_cli(["ls", "--json"], shm)
                assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
            left[by] = {name: os.path.lexists(region_file(shm, 1).parent / name) for name in names}
        assert left["reaper"] == names
        assert left["ls"] == names
    finally:
        zombie.wait()


def _main_thread_exited(program: str, env: dict[str, str]) -> subprocess.Popen:
    """A Python process running program, then a thread that serves lines on
    stdin (one: an allocation, answered with a blank line; the next: os._exit),
    its main thread gone through pthread_exit: /proc/<pid>/stat reads Z
    while that thread runs on, holding the process's descriptors."""
    serve = textwrap.dedent("""
        import ctypes, os, sys, threading
        def serve():
            sys.stdin.readline()
            acl.rt.set_device(0)  # the device is each thread's
            acl.rt.malloc(8192, 0)
            print(flush=True)
            sys.stdin.readline()
            os._exit(0)
        threading.Thread(target=serve).start()
        ctypes.CDLL(None).pthread_exit(None)
    """)
    proc = subprocess.Popen([sys.executable, "-c", program + serve], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    while Path(f"/proc/{proc.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z":
        os.sched_yield()
    return proc


def test_a_process_whose_main_thread_exited_is_not_taken_for_a_zombie(shm: Path) -> None:
    """Region refused it as an exited process (so `stats <pid>` and every
    pid= reader did), and `ls` left it out, while it ran on."""
    proc = _main_thread_exited("import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n",
                               preload_env(NPUALLOC_SHM_DIR=str(shm)))
    try:
        assert region_file(shm, proc.pid).exists()
        with Region(proc.pid) as region:
            assert region.header().pid == proc.pid
        listed = run_cli(["ls", "--json"], shm)
        assert listed.returncode == 0 and [row["pid"] for row in json.loads(listed.stdout)] == [proc.pid], listed.stderr
        assert run_cli(["stats", str(proc.pid)], shm).returncode == 0
        posted: list[int | BaseException] = []

        def post() -> None:
            try:
                with Region(proc.pid, writable=True) as region:
                    posted.append(region.post_command(constants.NPUALLOC_CMD_EMPTY_CACHE, timeout=20))
            except BaseException as e:
                posted.append(e)

        poster = threading.Thread(target=post)
        poster.start()
        wait_for_pending_command(region_file(shm, proc.pid), poster.is_alive)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")  # its allocation takes the command
        proc.stdin.flush()
        assert proc.stdout.readline() == "\n"
        poster.join()
        assert len(posted) == 1 and isinstance(posted[0], int), posted  # answered, not "ended before acknowledging"
        proc.stdin.write("\n")
        proc.stdin.flush()
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_ls_and_the_reaper_leave_the_unlocked_names_of_a_process_whose_main_thread_exited(tmp_path: Path) -> None:
    """Both judge a temporary or an aside name by its pid, and took that
    pid's zombie main thread for an exited process: an unlocked temporary
    (made where O_TMPFILE is missing, unlocked at its name until the call
    after its creation) of a process running on went. A planted file stands
    for it."""
    proc = _main_thread_exited("import acl; acl.init(); acl.rt.set_device(0)\n", sim_env())
    try:
        names = [f".npualloc.{proc.pid}.tmp.0badf00d", f".npualloc.{proc.pid}.reap.0badf00d"]
        for by in ("reaper", "ls"):
            shm = tmp_path / by
            shm.mkdir()
            for name in names:
                write_region(shm, 1, b"").rename(region_file(shm, 1).parent / name)
            if by == "reaper":
                with Workload(shm) as w:
                    w.call("malloc(4096)")
                    assert w.close() == 0
            else:
                assert run_cli(["ls"], shm).returncode == 0
            assert all(os.path.lexists(region_file(shm, 1).parent / name) for name in names), by
        assert proc.stdin is not None
        proc.stdin.write("\n\n")
    finally:
        proc.communicate(timeout=30)
    assert proc.returncode == 0


STAT_READS_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Counts the opens of /proc/<COUNT_STAT_OF>/stat, written to COUNT_TO at exit. */
static atomic_long reads;

int open(const char *path, int flags, ...)
{
    mode_t mode = 0;
    if (flags & (O_CREAT | O_TMPFILE)) {
        va_list ap;
        va_start(ap, flags);
        mode = va_arg(ap, mode_t);
        va_end(ap);
    }
    char counted[64];
    snprintf(counted, sizeof counted, "/proc/%s/stat", getenv("COUNT_STAT_OF"));
    if (strcmp(path, counted) == 0)
        atomic_fetch_add(&reads, 1);
    return ((int (*)(const char *, int, ...))dlsym(RTLD_NEXT, "open"))(path, flags, mode);
}

__attribute__((destructor)) static void report(void)
{
    FILE *f = fopen(getenv("COUNT_TO"), "w");
    if (f) {
        fprintf(f, "%ld\n", atomic_load(&reads));
        fclose(f);
    }
}
"""


def test_the_reaper_reads_a_live_pids_process_once_for_its_many_temporaries(
        shm: Path, tmp_path: Path, sleeper: int) -> None:
    """Many temporaries of one live pid (a long run beside a job's
    leftovers) stay, and each cost the reaper a read of /proc/<pid>/stat:
    100,000 of them made a first allocation take a second. One read a
    walk (at the region's creation and at exit) tells it for them all."""
    directory = region_file(shm, sleeper).parent
    directory.mkdir(mode=0o700)
    names = [directory / f".npualloc.{sleeper}.tmp.{i:08x}" for i in range(500)]
    for path in names:
        path.write_bytes(b"")
    shim = compile_shim(tmp_path, "stat_reads", STAT_READS_SHIM)
    counted = tmp_path / "reads"
    with Workload(shm, preload=False, LD_PRELOAD=f"{NPUALLOC_LIB}:{shim}", COUNT_STAT_OF=str(sleeper),
                  COUNT_TO=str(counted)) as w:
        w.call("malloc(4096)")
        assert w.close() == 0
    assert all(path.exists() for path in names)
    assert counted.read_text() == "2\n"


def test_an_aside_name_a_killed_reaper_left_blocks_no_later_process_with_its_pid(shm: Path) -> None:
    """A reaper moved a name aside to .npualloc.<its pid>.reap, never
    replacing one: a reaper killed there left that name, and every later
    process with the pid (reused) found it taken, so its reaper removed no
    gone region for its whole life, nor `ls` with that pid. The aside name
    is unique to each move; the leftover, of a live pid, is left here."""
    dead = _dead_pid()
    with Workload(shm) as w:
        gone = write_region(shm, dead, region_bytes(dead))
        leftover = gone.parent / f".npualloc.{w.pid}.reap"
        leftover.write_bytes(b"what a killed reaper moved aside")
        w.call("malloc(4096)")
        assert not gone.exists()
        assert leftover.read_bytes() == b"what a killed reaper moved aside"
        assert w.close() == 0
    gone = write_region(shm, dead, region_bytes(dead))
    ours = gone.parent / f".npualloc.{os.getpid()}.reap"  # as `ls` running with our pid finds it
    ours.write_bytes(b"x")
    info = gone.stat()
    dir_fd = os.open(gone.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert reader_library().npualloc_reader_unlink_checked(dir_fd, gone.name.encode(), info.st_dev, info.st_ino) == 0
    finally:
        os.close(dir_fd)
    assert not gone.exists() and ours.exists()
    assert sorted(os.listdir(gone.parent)) == sorted([leftover.name, ours.name])


# Stands for a process with the same pid number (reused, or in another pid
# namespace sharing the directory) renaming its fresh region over a leftover
# at the one moment that matters: after the reaper's last look at the name,
# before what it does to it. The first unlinkat or rename of $SWAP_NAME first
# renames $SWAP_FROM over it. With $NO_RENAME_NOREPLACE, renameat2 refuses
# RENAME_NOREPLACE, as NFS does.
SWAP_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void swap_once(int dir_fd, const char *name)
{
    static int done;
    const char *swap_name = getenv("SWAP_NAME"), *swap_from = getenv("SWAP_FROM");
    if (done || !swap_name || !swap_from || strcmp(name, swap_name) != 0)
        return;
    done = 1;
    syscall(SYS_renameat2, dir_fd, swap_from, dir_fd, name, 0);
}

int unlinkat(int dir_fd, const char *name, int flags)
{
    swap_once(dir_fd, name);
    return syscall(SYS_unlinkat, dir_fd, name, flags);
}

int renameat(int from_fd, const char *from, int to_fd, const char *to)
{
    swap_once(from_fd, from);
    return syscall(SYS_renameat2, from_fd, from, to_fd, to, 0);
}

int renameat2(int from_fd, const char *from, int to_fd, const char *to, unsigned flags)
{
    if ((flags & RENAME_NOREPLACE) && getenv("NO_RENAME_NOREPLACE")) { /* a file system without it */
        errno = EINVAL;
        return -1;
    }
    swap_once(from_fd, from);
    return syscall(SYS_renameat2, from_fd, from, to_fd, to, flags);
}
"""


def _with_shim(env: dict[str, str], tmp_path: Path, **settings: str) -> dict[str, str]:
    """env with SWAP_SHIM preloaded last, set as settings say."""
    shim = compile_shim(tmp_path, "swap", SWAP_SHIM)
    preloaded = env.get("LD_PRELOAD")
    return dict(env, LD_PRELOAD=f"{preloaded}:{shim}" if preloaded else str(shim), **settings)


def _swapping(env: dict[str, str], tmp_path: Path, name: Path, fresh: Path) -> dict[str, str]:
    """env with SWAP_SHIM preloaded last, to rename fresh over name."""
    return _with_shim(env, tmp_path, SWAP_NAME=name.name, SWAP_FROM=fresh.name)


def test_the_reaper_removes_the_leftover_it_checked_not_a_region_renamed_over_it(shm: Path, tmp_path: Path) -> None:
    """The name of a gone process's region is taken over by a live one (a
    process with that pid number publishing) between the reaper's checks and
    its removal: the live region was unlinked, its process running on
    unseen. The reaper removes the inode it checked or nothing."""
    dead = _dead_pid()
    left = write_region(shm, dead, region_bytes(dead))
    fresh = left.parent / ".fresh"
    fresh.write_bytes(region_bytes(dead))
    env = _swapping(preload_env(NPUALLOC_SHM_DIR=str(shm)), tmp_path, left, fresh)
    with open(fresh, "rb") as holder:
        fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives
        live = os.fstat(holder.fileno()).st_ino
        run_python("import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)", env)
        assert not fresh.exists()  # it was renamed into place
        assert left.exists() and left.stat().st_ino == live
        assert [name for name in os.listdir(left.parent) if name.startswith(".")] == []


def test_exit_removes_its_own_region_not_one_renamed_over_its_name_after_its_check(shm: Path, tmp_path: Path) -> None:
    """A process's exit looked at its name (its own inode) and then unlinked
    by name: a process with the same pid in another pid namespace sharing the
    directory, publishing in between, lost its live region, and ran on
    unseen by ls, stats and pause. The exit removes the inode it checked
    (unlink_checked.h), as the reaper does."""
    with Workload(shm) as w:  # makes the user's region directory
        w.call("malloc(4096)")
    fresh = region_file(shm, w.pid).parent / ".fresh"
    fresh.write_bytes(region_bytes(w.pid))
    env = _with_shim(preload_env(NPUALLOC_SHM_DIR=str(shm)), tmp_path, SWAP_FROM=fresh.name)
    program = ("import acl, os; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)\n"
               "os.environ['SWAP_NAME'] = f'npualloc.{os.getpid()}'  # the shim's moment: the exit's removal\n"
               "print(os.getpid())")
    with open(fresh, "rb") as holder:
        fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives
        live = os.fstat(holder.fileno()).st_ino
        pid = int(run_python(program, env).stdout)
        assert not fresh.exists()  # it was renamed over the exiting process's name
        assert region_file(shm, pid).stat().st_ino == live
        assert [name for name in os.listdir(fresh.parent) if name.startswith(".")] == []


def test_exit_removes_its_own_snapshot_file_not_one_renamed_over_its_name(shm: Path, tmp_path: Path) -> None:
    """The snapshot files a process keeps for requesters that gave up went
    as its region went: a look at the name (its inode), then an unlink by
    name, so a process with the same pid in another pid namespace placing
    its own snapshot there in between lost it before its requester read it.
    The inode that was looked at is what goes (unlink_checked.h)."""
    shim = compile_shim(tmp_path, "swap", SWAP_SHIM)
    with Workload(shm, preload=False, LD_PRELOAD=f"{NPUALLOC_LIB}:{shim}", SWAP_FROM=".fresh") as w:
        w.call("malloc(4096)")
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_SNAPSHOT, "malloc(4096)")  # a requester that never reads it
        [snapshot] = region_file(shm, w.pid).parent.glob(f"npualloc.{w.pid}.snapshot.*")
        fresh = snapshot.with_name(".fresh")
        fresh.write_bytes(b"another process's snapshot")
        w.call(f"__import__('os').environ.__setitem__('SWAP_NAME', {snapshot.name!r})")  # the shim's moment: the exit's
        assert w.close() == 0
    assert snapshot.read_bytes() == b"another process's snapshot"
    assert os.listdir(snapshot.parent) == [snapshot.name]


def test_stale_regions_go_where_the_file_system_cannot_rename_without_replacing(shm: Path, tmp_path: Path) -> None:
    """Where renameat2 refuses RENAME_NOREPLACE (NFS), the reaper and `ls`
    remove a gone process's region by name, as before, rather than never."""
    dead = _dead_pid()
    left = write_region(shm, dead, region_bytes(dead))
    env = _with_shim(preload_env(NPUALLOC_SHM_DIR=str(shm)), tmp_path, NO_RENAME_NOREPLACE="1")
    run_python("import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)", env)
    assert not left.exists()
    write_region(shm, dead, region_bytes(dead))
    listed = subprocess.run([sys.executable, "-m", "npualloc", "ls"], capture_output=True, text=True, timeout=60,
                            env=_with_shim(cli_env(shm), tmp_path, NO_RENAME_NOREPLACE="1"))
    assert listed.returncode == 0, listed.stderr
    assert not left.exists()


def test_ls_removes_the_stale_region_it_checked_not_a_region_renamed_over_it(shm: Path, tmp_path: Path) -> None:
    """The same moment for `ls`: its check of a dead pid's region (the
    inode, the lock) and its removal by name."""
    dead = _dead_pid()
    left = write_region(shm, dead, region_bytes(dead))
    fresh = left.parent / ".fresh"
    fresh.write_bytes(region_bytes(dead))
    with open(fresh, "rb") as holder:
        fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives
        live = os.fstat(holder.fileno()).st_ino
        listed = subprocess.run([sys.executable, "-m", "npualloc", "ls"], capture_output=True, text=True, timeout=60,
                                env=_swapping(cli_env(shm), tmp_path, left, fresh))
        assert listed.returncode == 0, listed.stderr
        assert not fresh.exists()  # it was renamed into place
        assert left.exists() and left.stat().st_ino == live
        assert [name for name in os.listdir(left.parent) if name.startswith(".")] == []



@pytest.mark.parametrize("aside_of", ["gone", "live"])
def test_ls_puts_back_a_live_region_left_under_a_reapers_aside_name(shm: Path, aside_of: str) -> None:
    """A reaper moves a name aside (.npualloc.<pid>.reap) before it looks at
    what it moved, so a live region renamed over a leftover at that moment
    sits there until it is put back; a reaper killed in between (gone), or
    whose put-back found the name taken (live), leaves it there. `ls` then
    removed it as the dead reaper's leftover (the process ran on unseen, its
    file gone) or left it hidden from every listing. A region whose lock is
    held goes back under its own name instead, listed by the `ls` that put
    it back (it was not, its name missing from the directory that ls read)."""
    reaper = _dead_pid() if aside_of == "gone" else os.getpid()
    with Workload(shm) as w:
        w.call("malloc(4096)")
        path = region_file(shm, w.pid)
        inode = path.stat().st_ino
        path.rename(path.parent / f".npualloc.{reaper}.reap.0123abcd")
        listed = run_cli(["ls", "--json"], shm)
        assert listed.returncode == 0 and [row["pid"] for row in json.loads(listed.stdout)] == [w.pid]
        assert path.exists() and path.stat().st_ino == inode
        assert [name for name in os.listdir(path.parent) if name.startswith(".")] == []
        assert w.close() == 0
    assert os.listdir(path.parent) == []


def test_ls_puts_a_live_region_back_only_once_its_name_is_free(shm: Path) -> None:
    """A region left aside whose name a live process with the same pid (in
    another pid namespace sharing the directory) has taken since stays
    aside: put back, it would hide that live one instead, as two such
    processes share one name. Once that one is gone, it goes back."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        path = region_file(shm, w.pid)
        inode = path.stat().st_ino
        aside = path.parent / f".npualloc.{os.getpid()}.reap.0123abcd"
        theirs = path.parent / "theirs.tmp"
        theirs.write_bytes(path.read_bytes())
        path.rename(aside)
        with open(theirs, "rb") as holder:
            fcntl.lockf(holder, fcntl.LOCK_SH)  # its process lives
            theirs.rename(path)
            assert run_cli(["ls"], shm).returncode == 0
            assert aside.stat().st_ino == inode and path.stat().st_ino == os.fstat(holder.fileno()).st_ino
            path.unlink()  # its exit
        listed = run_cli(["ls", "--json"], shm)
        assert listed.returncode == 0 and [row["pid"] for row in json.loads(listed.stdout)] == [w.pid]
        assert path.stat().st_ino == inode and not aside.exists()
        assert w.close() == 0
    assert os.listdir(path.parent) == []

# A C service whose SIGTERM handler is libc's exit, the signal landing while
# the thread is inside malloc: exit then runs the atexit handlers on that
# thread with malloc's lock held. Its own malloc stands for glibc's, whose
# arena lock a large request (above the thread cache's sizes) takes.
EXIT_IN_MALLOC = r"""
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

extern void *__libc_malloc(size_t);
static pthread_mutex_t malloc_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int interrupt_next;

void *malloc(size_t size)
{
    pthread_mutex_lock(&malloc_lock);
    if (interrupt_next) {
        interrupt_next = 0;
        raise(SIGTERM);
    }
    void *p = __libc_malloc(size);
    pthread_mutex_unlock(&malloc_lock);
    return p;
}

""" + MAIN_HOLDING_1_MIB + r"""
    signal(SIGTERM, (void (*)(int))exit);
    interrupt_next = 1;
    static void *volatile kept; /* a call the compiler cannot leave out */
    kept = malloc(64 << 10);
    return 4;
}
"""


def test_exit_from_a_signal_handler_that_interrupted_malloc_ends_the_process(
        shm: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The reaper at exit read the directory through opendir, whose buffer
    is malloc'ed: on a thread interrupted inside malloc it waited for
    malloc's lock, held by that same thread, for ever."""
    program = compile_c(tmp_path_factory, "exit_in_malloc", EXIT_IN_MALLOC)
    proc = subprocess.Popen([str(program), str(SIM_LIB / "libascendcl.so")],
                            env=preload_env(NPUALLOC_SHM_DIR=str(shm)), stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the process never ended: {err}")
    assert proc.returncode == 15, err  # exit(SIGTERM's number), from the handler
    assert os.listdir(region_file(shm, proc.pid).parent) == []


def _post_and_trigger(w: Workload, shm: Path, code: int, trigger: str, device: int = -1, arg: float = 0.0) -> None:
    """Posts a command from a thread, makes the process reach its allocator
    once the command is pending, and re-raises what the poster got."""
    errors: list[BaseException] = []

    def post() -> None:
        try:
            with Region(w.pid, writable=True) as region:
                region.post_command(code, device, arg, timeout=20)
        except BaseException as e:
            errors.append(e)

    poster = threading.Thread(target=post)
    poster.start()
    wait_for_pending_command(region_file(shm, w.pid), poster.is_alive)
    w.call(trigger)
    poster.join()
    if errors:
        raise errors[0]


def test_empty_cache_command_releases_reserved(shm: Path) -> None:
    with Workload(shm) as w:
        w.call(f"malloc({3 * MiB})")  # a 20 MiB segment of the large pool
        w.call("malloc(4096)")
        live = w.call("live")
        w.call(f"acl.rt.free({live[0]})")
        before = npualloc.memory_stats(pid=w.pid)
        assert before["reserved_bytes.large_pool.current"] >= 20 * MiB
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_EMPTY_CACHE, "free()")
        after = npualloc.memory_stats(pid=w.pid)
        assert after["reserved_bytes.large_pool.current"] == 0
        assert after["num_device_free"] == before["num_device_free"] + 1
        assert after == w.call("npualloc.memory_stats()")


def test_empty_cache_command_on_a_device_that_cannot_synchronize_keeps_the_cache_and_says_why(shm: Path) -> None:
    with Workload(shm) as w:
        w.call(f"malloc({3 * MiB})")
        w.call("free()")  # cached: an empty cache would synchronize, then release it
        w.call("__import__('aclsim').aclsim.fail_next_calls('aclrtSynchronizeDevice', 1 << 20, 507899)")
        with pytest.raises(CommandRejectedError, match="failed to apply"):
            _post_and_trigger(w, shm, constants.NPUALLOC_CMD_EMPTY_CACHE, "malloc(4096)")
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] >= 20 * MiB
        w.call("__import__('aclsim').aclsim.fail_next_calls('aclrtSynchronizeDevice', 0, 0)")
        stderr = w.stderr()
    assert "npualloc: empty_cache from another process: device 0 could not be synchronized (error 507899)" in stderr, \
        stderr


def test_reset_peak_and_accumulated_commands(shm: Path) -> None:
    with Workload(shm) as w:
        w.call(f"malloc({40 * MiB})")
        w.call("free()")
        assert npualloc.max_memory_allocated(pid=w.pid) >= 40 * MiB
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_RESET_PEAK, "malloc(4096)", device=0)
        stats = npualloc.memory_stats(pid=w.pid)
        assert stats["allocated_bytes.all.peak"] == stats["allocated_bytes.all.current"] < MiB
        assert stats["allocated_bytes.all.allocated"] >= 40 * MiB  # accumulated ones untouched
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_RESET_ACCUMULATED, "malloc(4096)")
        stats = npualloc.memory_stats(pid=w.pid)
        assert stats["allocated_bytes.all.allocated"] < MiB


def test_memory_fraction_command_caps_growth_and_keeps_the_cache(shm: Path) -> None:
    """torch's set_per_process_memory_fraction from another process, on a
    100 MiB device: a cap under what is reserved refuses the next growth with
    the allocator's OOM while the cached blocks keep serving; raised to 1.0,
    the process grows again."""
    cap = int(0.3 * 100 * MiB)
    b20, b30, b40 = (n * MiB - 64 for n in (20, 30, 40))  # aclrtMalloc's 32 bytes on top still fit n MiB
    with Workload(shm, NPUSIM_HBM_MB="100") as w:
        w.call(f"malloc({b40})")
        w.call("malloc(4096)")  # a small segment, freed by the trigger below
        w.call(f"malloc({b20})")
        w.call("free()")  # its 20 MiB segment stays cached
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_SET_MEMORY_FRACTION, "free()", device=0, arg=0.3)
        stats = npualloc.memory_stats(pid=w.pid)
        assert stats["npualloc.reserved_limit_bytes"] == cap
        assert stats["reserved_bytes.all.current"] == 62 * MiB  # above the cap, and kept
        assert "per_process_memory_fraction" not in npualloc.get_config(pid=w.pid)  # per device, as torch's

        w.call(f"malloc({b20})")  # served by the cache past the cap
        w.call("malloc(4096)")
        assert npualloc.memory_stats(pid=w.pid)["num_device_alloc"] == stats["num_device_alloc"]
        assert w.call(f"acl.rt.malloc({b30}, 0)[1]") == 207001
        assert npualloc.memory_stats(pid=w.pid)["num_ooms"] == 1

        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_SET_MEMORY_FRACTION, "free()", device=0, arg=1.0)
        assert npualloc.memory_stats(pid=w.pid)["npualloc.reserved_limit_bytes"] == 0
        w.call(f"malloc({b30})")
        stderr = w.stderr()
    assert f"npualloc: out of memory on device 0: requested {b30} bytes" in stderr, stderr
    assert f"per-process cap {cap} bytes" in stderr, stderr


@pytest.mark.parametrize("device, arg", [
    (0, 1.5), (0, -0.5), (0, float("nan")),
    (0, 1e-9),  # a cap of 0 bytes: below the smallest segment
    (1, 1e-9),  # the same on a device the process has not used: not set up for it either
    (-1, 0.5),  # per device, as torch's: not every device at once
    (12, 0.5),  # past the simulator's 8 devices: nothing set up for it
])
def test_bad_memory_fractions_are_rejected_and_change_nothing(shm: Path, device: int, arg: float) -> None:
    with Workload(shm) as w:
        w.call("malloc(4096)")
        with pytest.raises(CommandRejectedError, match="rejected the argument"):
            _post_and_trigger(w, shm, constants.NPUALLOC_CMD_SET_MEMORY_FRACTION, "malloc(4096)", device=device,
                              arg=arg)
        assert npualloc.memory_stats(pid=w.pid)["npualloc.reserved_limit_bytes"] == 0
        with Region(w.pid) as region:
            assert region.devices_in_use() == [0]


def test_config_commands_change_the_config_and_a_forked_child_keeps_it(shm: Path) -> None:
    """The GC threshold and record_history set from another process change
    the process's config as npualloc.set_config does there: a child it forks
    afterwards starts its own allocator with them, not with the environment's."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_SET_GC_THRESHOLD, "malloc(4096)", arg=0.5)
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_RECORD_HISTORY, "malloc(4096)", arg=1000)
        config = npualloc.get_config(pid=w.pid)
        assert "garbage_collection_threshold:0.5" in config and "record_history:1000" in config, config
        assert config == w.call("npualloc.get_config()")
        assert w.call("fork_child_allocates(4096)")[3] == config


def test_the_config_text_is_read_whole_while_the_process_rewrites_it(shm: Path) -> None:
    """Another process reads the header's config text while a thread of the
    process changes the config over and over: every read is one of the two
    texts, never one's start over the other's tail (the text has a seqlock)."""
    settings = ["garbage_collection_threshold:0.5", "garbage_collection_threshold:0.25"]
    with Workload(shm) as w:
        w.call("malloc(4096)")
        texts = [w.call(f"npualloc.set_config({s!r}) or npualloc.get_config()") for s in settings]
        assert texts[0] != texts[1] and all(s in t for s, t in zip(settings, texts)), texts
        w.call(f"start_churn(1, {settings!r})")
        seen: dict[str, int] = {}
        reads = rewrites = 0
        with Region(w.pid) as region:
            # Until the reads met 200 rewrites, however the two processes
            # were scheduled: seeing each text 100 times takes only one.
            while min(seen.get(t, 0) for t in texts) < 100 or reads < 2000 or rewrites <= 200:
                text = region.header().config
                seen[text] = seen.get(text, 0) + 1
                reads += 1
                if reads % 1000 == 0:
                    rewrites = w.call("churn_progress()")  # raises once the rewriting thread failed
        w.call("stop_churn()")
    assert set(seen) == set(texts), {t: n for t, n in seen.items() if t not in texts}


@pytest.mark.parametrize("code, arg, fragment", [
    (constants.NPUALLOC_CMD_SET_GC_THRESHOLD, 1.5, "rejected the argument"),
    (constants.NPUALLOC_CMD_SET_GC_THRESHOLD, float("nan"), "rejected the argument"),
    (constants.NPUALLOC_CMD_RECORD_HISTORY, -1.0, "rejected the argument"),
    (constants.NPUALLOC_CMD_RECORD_HISTORY, 2.5, "rejected the argument"),
    (77, 0.0, "does not support"),
])
def test_bad_commands_are_acknowledged_as_rejected(shm: Path, code: int, arg: float, fragment: str) -> None:
    with Workload(shm) as w:
        w.call("malloc(4096)")
        config = npualloc.get_config(pid=w.pid)
        with pytest.raises(CommandRejectedError, match=fragment):
            _post_and_trigger(w, shm, code, "malloc(4096)", arg=arg)
        assert npualloc.get_config(pid=w.pid) == config


def test_a_command_an_idle_process_did_not_take_in_time_is_withdrawn(shm: Path) -> None:
    """A command that timed out stayed posted and was applied at the next
    allocator call, whenever that came: a pause given up on froze the
    program later. Now it is withdrawn, never applied, and the next one is
    posted at once."""
    with Workload(shm) as w:
        w.call(f"malloc({3 * MiB})")  # a 20 MiB segment of the large pool
        w.call("malloc(4096)")
        w.call(f"acl.rt.free({w.call('live')[0]})")
        peak = npualloc.max_memory_allocated(pid=w.pid)
        with pytest.raises(CommandTimeoutError, match="withdrawn, nothing was applied"):
            npualloc.empty_cache(pid=w.pid, timeout=0.2)
        with pytest.raises(CommandTimeoutError, match="withdrawn, nothing was applied"):
            npualloc.reset_peak_memory_stats(pid=w.pid, timeout=0.2)
        w.call("free()")  # an allocator call: nothing posted is left to apply
        stats = npualloc.memory_stats(pid=w.pid)
        assert stats["reserved_bytes.large_pool.current"] == 20 * MiB
        assert stats["allocated_bytes.all.peak"] == peak
        with Region(w.pid) as region:
            assert region.command_seq() == 2  # both were posted, neither applied
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_EMPTY_CACHE, "malloc(4096)")
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] == 0


def test_a_damaged_command_slot_is_answered_unapplied_and_mended(shm: Path) -> None:
    """closed_seq rewritten by someone (neither the request before nor this
    one): the process applies nothing, answers it as rejected, and the slot
    works again for the next command, instead of staying pending for good."""
    with Workload(shm) as w:
        w.call(f"malloc({3 * MiB})")
        w.call(f"acl.rt.free({w.call('live')[0]})")
        with Region(w.pid, writable=True) as region:
            region._region.command.closed_seq = 12345
        with pytest.raises(CommandRejectedError, match="rejected"):
            _post_and_trigger(w, shm, constants.NPUALLOC_CMD_EMPTY_CACHE, "malloc(4096)")
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] == 20 * MiB
        _post_and_trigger(w, shm, constants.NPUALLOC_CMD_EMPTY_CACHE, "malloc(4096)")
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] == 0


def test_a_command_the_process_took_is_not_withdrawn(shm: Path) -> None:
    """The requester's withdrawal and the process's taking race on one word:
    once the process took a command, giving up reports it as being applied
    and the process's answer stands."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        with Region(w.pid, writable=True) as region:
            seq = ffi.new("uint64_t *")
            status = ffi.new("int32_t *")
            reader = reader_library()
            assert reader.npualloc_reader_post(region._file, constants.NPUALLOC_CMD_RESET_PEAK, -1, 0.0, seq) == \
                constants.NPUALLOC_POST_OK
            w.call("malloc(4096)")  # the process takes and answers it
            assert reader.npualloc_reader_withdraw(region._file, seq[0]) == 0
            assert reader.npualloc_reader_acked(region._region, seq[0], status) == 1
            assert status[0] == constants.NPUALLOC_CMD_OK
            assert region._give_up(seq[0], status) == "answered"
            # Posted and withdrawn before the process comes: it never applies it.
            assert reader.npualloc_reader_post(region._file, constants.NPUALLOC_CMD_RESET_PEAK, -1, 0.0, seq) == \
                constants.NPUALLOC_POST_OK
            assert region._give_up(seq[0], status) == "withdrawn"
            assert reader.npualloc_reader_acked(region._region, seq[0], status) == 1
            assert status[0] == constants.NPUALLOC_CMD_WITHDRAWN
            assert reader.npualloc_reader_withdraw(region._file, seq[0]) == 0  # once only
            w.call("malloc(4096)")  # had the process applied it, it would have answered it
            assert reader.npualloc_reader_acked(region._region, seq[0], status) == 1
            assert status[0] == constants.NPUALLOC_CMD_WITHDRAWN


def _assert_consistent(s: dict) -> None:
    pools = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
             "active_bytes", "inactive_split_bytes", "requested_bytes")
    for name in pools:
        for pool in ("all", "small_pool", "large_pool"):
            key = f"{name}.{pool}"
            assert s[f"{key}.current"] == s[f"{key}.allocated"] - s[f"{key}.freed"], key
            assert 0 <= s[f"{key}.current"] <= s[f"{key}.peak"], key
        assert s[f"{name}.all.current"] == s[f"{name}.small_pool.current"] + s[f"{name}.large_pool.current"], name
    # torch's order: a free lowers allocated at once, active and requested once
    # the block is really free (pending frees sit in between).
    allocated, requested, active, reserved = (s[f"{name}.all.current"] for name in
                                              ("allocated_bytes", "requested_bytes", "active_bytes", "reserved_bytes"))
    assert allocated <= active <= reserved and requested <= active, (allocated, requested, active, reserved, s)
    assert s["allocation.all.current"] <= s["active.all.current"], s
    assert s["segment.all.current"] == s["num_device_alloc"] - s["num_device_free"], s


def test_reader_hammering_a_process_allocating_in_4_threads(shm: Path) -> None:
    """Every read is consistent while 4 threads allocate; the reader goes on
    until it has seen the stats change 50 times and the threads have made
    2000 calls, however slowly the machine runs them."""
    with Workload(shm) as w:
        w.call("malloc(4096)")
        w.call("start_churn(4)")
        reads, changes, last, progress = 0, 0, None, 0
        try:
            with Region(w.pid) as region:
                while changes < 50 or progress < 2000:
                    stats = npualloc.memory.stats_to_dict(region.read_device_stats(0))
                    _assert_consistent(stats)
                    changes += stats != last
                    last = stats
                    reads += 1
                    if reads % 100 == 0:
                        progress = w.call("churn_progress()")  # raises once a churn thread failed
        finally:
            w.call("stop_churn()")
        assert changes >= 50 and progress >= 2000, (reads, changes, progress)
        _assert_consistent(npualloc.memory_stats(pid=w.pid))
        assert npualloc.memory_stats(pid=w.pid) == w.call("npualloc.memory_stats()")


# A fork by another thread while the first allocation makes the region: the
# shim holds the region's publishing rename (renameat of .npualloc.<pid>.tmp.<8 hex>)
# until the forking thread has either forked or is waiting inside fork, for a
# lock (a futex wait, read in /proc/self/task/<tid>/syscall).
FORK_WINDOW_SHIM = r"""
#define _GNU_SOURCE
#include <semaphore.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static sem_t window;
static _Atomic pid_t forker;
static atomic_int woke, forked, held;

__attribute__((constructor)) static void setup(void) { sem_init(&window, 0, 0); }

/* The forking thread: waits for the window, then forks. */
void shim_forker_waits(void)
{
    atomic_store(&forker, (pid_t)syscall(SYS_gettid));
    sem_wait(&window);
    atomic_store(&woke, 1);
}

void shim_forked(void) { atomic_store(&forked, 1); }

static int waiting_in_futex(pid_t tid)
{
    char path[64], text[64] = "";
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "shim: cannot read %s\n", path);
        _exit(77);
    }
    if (!fgets(text, sizeof text, f))
        text[0] = '\0';
    fclose(f);
    return atoi(text) == SYS_futex && text[0] != 'r';
}

int renameat(int from_fd, const char *from, int to_fd, const char *to)
{
    size_t n = strlen(from);
    if (strncmp(from, ".npualloc.", 10) == 0 && n > 13 && strncmp(from + n - 13, ".tmp.", 5) == 0 &&
        atomic_exchange(&held, 1) == 0) {
        struct timespec tick = {0, 1000000};
        while (atomic_load(&forker) == 0)
            nanosleep(&tick, NULL);
        sem_post(&window);
        while (!atomic_load(&woke))
            nanosleep(&tick, NULL);
        while (!atomic_load(&forked) && !waiting_in_futex(atomic_load(&forker)))
            nanosleep(&tick, NULL);
    }
    return syscall(SYS_renameat2, from_fd, from, to_fd, to, 0);
}
"""

FORK_WHILE_CREATING = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*malloc_fn)(void **, size_t, int);
static int (*set_device)(int);
static malloc_fn npu_malloc;

/* The child: whether it holds a descriptor of the parent's region (its
 * directory or its file), then whether it can allocate. */
static void child(void)
{
    alarm(20); /* a child that hangs fails the test (before its parent's alarm) */
    int leaked = 0;
    DIR *fds = opendir("/proc/self/fd");
    struct dirent *e;
    while (fds && (e = readdir(fds)) != NULL) {
        char link[64], target[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n > 0) {
            target[n] = '\0';
            if (strstr(target, "/npualloc-") != NULL) {
                printf("child holds %s\n", target);
                leaked = 1;
            }
        }
    }
    if (fds)
        closedir(fds);
    fflush(stdout);
    void *p = NULL;
    int err = npu_malloc(&p, 1 << 20, 0);
    printf("child malloc %d\n", err);
    fflush(stdout);
    _exit(leaked || err != 0);
}

static void *forker(void *arg)
{
    (void)arg;
    set_device(0);
    ((void (*)(void))dlsym(RTLD_DEFAULT, "shim_forker_waits"))();
    pid_t pid = fork();
    if (pid == 0)
        child();
    ((void (*)(void))dlsym(RTLD_DEFAULT, "shim_forked"))();
    int status = -1;
    waitpid(pid, &status, 0);
    return (void *)(long)status;
}

int main(int argc, char **argv)
{
    alarm(30); /* a parent that hangs fails the test */
    void *runtime = dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL);
    if (!runtime)
        return 2;
    int (*init)(const char *) = (int (*)(const char *))dlsym(runtime, "aclInit");
    set_device = (int (*)(int))dlsym(RTLD_DEFAULT, "aclrtSetDevice");
    npu_malloc = (malloc_fn)dlsym(RTLD_DEFAULT, "aclrtMalloc");
    if (init(NULL) != 0 || set_device(0) != 0)
        return 3;
    if (strcmp(argv[2], "stream") == 0) { /* the program's first stream comes before its first allocation */
        void *stream = NULL;
        if (((int (*)(void **))dlsym(RTLD_DEFAULT, "aclrtCreateStream"))(&stream) != 0)
            return 4;
    }
    pthread_t thread;
    pthread_create(&thread, NULL, forker, NULL);
    void *p = NULL;
    if (npu_malloc(&p, 1 << 20, 0) != 0)
        return 5;
    void *status;
    pthread_join(thread, &status);
    printf("child status %ld\n", (long)status);
    return 0;
}
"""


@pytest.mark.parametrize("first", ["malloc", "stream"])
def test_a_fork_while_the_region_is_made_leaves_the_child_nothing_of_it(
        shm: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, first: str) -> None:
    """A thread forking while another made the region at the process's first
    allocation: with no stream made before, npualloc's fork handlers were
    registered only after that first allocation, so the child kept the
    parent's region directory and its locked file (the parent looked alive
    while the child lived) and the init lock the making thread held (its
    first allocation waited for good). With a stream made before (the
    handlers registered), the fork waits for that lock; the making thread
    registered the region's own fork handler under it, which on glibc 2.28
    to 2.35 (their atfork lock held across prepare handlers) waited for the
    fork: this case passes on a glibc that lets that lock go (2.36 here)."""
    shim = compile_shim(tmp_path, "forkwindow", FORK_WINDOW_SHIM)
    program = compile_c(tmp_path_factory, "fork_while_creating", FORK_WHILE_CREATING)
    env = preload_env(NPUALLOC_SHM_DIR=str(shm))
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{shim}"
    proc = subprocess.run([str(program), str(SIM_LIB / "libascendcl.so"), first], env=env, capture_output=True,
                          text=True, timeout=120)
    if proc.returncode == 77:
        pytest.skip(f"no /proc/<pid>/task/<tid>/syscall here: {proc.stderr}")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout.splitlines() == ["child malloc 0", "child status 0"], proc.stdout
