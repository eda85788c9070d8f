"""Reading (and posting commands to) another process's shared-memory region.

Nothing in a region file is trusted before it is validated: magic and
version first (an older npualloc's region is an incompatible version, not a
truncated one), then the file size, then the header's size field, all
through a mapping of exactly sizeof(npualloc_region) bytes, so a truncated or
crafted file can never make the reader touch memory outside it. Opening, the seqlocked copies
and the command slot are libnpualloc_reader.so's (interpose/src/reader): C11
atomics give the orderings the writer's seqlock and command protocol need on
aarch64 as on x86-64; this module decides what each outcome means to a user.
"""
from __future__ import annotations

import errno
import fcntl
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from ._ffi import REGION_SIZE, constants, ffi, reader_library
from .errors import (CommandInterruptedError, CommandRejectedError, CommandTimeoutError, CorruptRegionError, IncompatibleRegionError,
                     NoSuchProcessError, NotUnderNpuallocError, NpuallocError, OtherUserError, ProcessStoppedError)
from .files import lstat_no_mount, open_no_mount

# Only the name a process gives its region: a pid as the kernel writes it, in
# ASCII digits without leading zeros (int() reads "npualloc.0123" and other
# scripts' digits as the same pid: one planted alias each cost a listing a read).
REGION_NAME = re.compile(r"npualloc\.([1-9][0-9]*)")
# The largest pid: a pid_t is 32 bits (the kernel's pid_max is far below). A
# name with a larger one, like one with a leading zero, is none that npualloc
# writes: neither `ls` nor the reaper (reap.c's pid_at) takes it for a leftover.
PID_MAX = 2**31 - 1
# The directories regions live in, one per user in the base directory
# (/dev/shm): npualloc-<uid>, and npualloc-<uid>.XXXXXX, which a process makes
# when another user took the first name (interpose/src/region/region_dir.c).
REGION_DIR_NAME = re.compile(r"npualloc-(0|[1-9][0-9]*)(?:\.[A-Za-z0-9]{6})?")
# What else a process leaves beside its region: snapshot files posted for a
# requester that gave up waiting (npualloc.<pid>.snapshot.<region inode>.<seq>,
# or without the inode as an npualloc of region layout version 7 and older
# named them), and temporaries of a process that died while
# writing (the region's own, .npualloc.<pid>.tmp.<8 hex>, and a snapshot's:
# .tmp.<pid>.<8 hex>; each without the hex as an npualloc before 2026-11-25,
# or for the region's before 2026-11-27, named it), and a gone process's region
# that a process killed while removing it had moved aside (.npualloc.<pid>.reap.<8
# hex>, or .npualloc.<pid>.reap as an npualloc before 2026-11-27 named it:
# interpose/src/unlink_checked.h; a live region there goes back instead).
# Each process's reaper removes the region's temporaries and aside names of
# gone processes too, by these names (interpose/src/region/reap.c's left_by):
# the two must stay alike.
LEFTOVER_NAME = re.compile(r"\.npualloc\.([1-9][0-9]*)\.(?:tmp|(reap))(?:\.[0-9a-f]{8})?|"
                           r"npualloc\.([1-9][0-9]*)\.snapshot(?:\.[0-9]+){1,2}(?:\.tmp\.[0-9]+(?:\.[0-9a-f]{8})?)?")
# A writer stays inside its seqlock for a handful of stores; a seq that stays
# odd this long belongs to a writer that died or stopped mid-update. The C copy
# tries SEQLOCK_ATTEMPTS times (yielding between two) per call; calls repeat
# until then. A region waits this long in all, whatever its devices, and a
# listing (live_regions) in all, whatever its regions: the first stuck one takes
# the wait, each later one a single call.
SEQLOCK_TIMEOUT_S = 1.0
SEQLOCK_ATTEMPTS = 100
COMMAND_TIMEOUT_S = 5.0

_ACK_ERRORS = {
    constants.NPUALLOC_CMD_EUNKNOWN: "the process does not support this command",
    constants.NPUALLOC_CMD_EINVAL: "the process rejected the argument",
    constants.NPUALLOC_CMD_EFAILED: "the process failed to apply it (its stderr says why)",
    constants.NPUALLOC_CMD_ENOTPAUSABLE: "the process cannot be paused: it holds memory outside expandable segments "
                                         "(give it expandable_segments:True, with --conf or set_config, before that "
                                         "memory is allocated); it runs on untouched",
    constants.NPUALLOC_CMD_ENOTPAUSED: "the process is not paused",
    constants.NPUALLOC_CMD_EPAUSED: "the process is paused: resume it first",
}
# What npualloc_reader_open's other verdicts mean to a user: the error and its
# message, formatted with what the reader saw (Region._refusal).
_OPEN_REFUSALS: dict[int, tuple[type[NpuallocError], str]] = {
    constants.NPUALLOC_OPEN_NOT_REGULAR: (CorruptRegionError, "{path} is not a regular file"),
    constants.NPUALLOC_OPEN_OTHER_OWNER: (OtherUserError,
                                          "{path} belongs to another user (uid {uid}, the process's is {owner})"),
    constants.NPUALLOC_OPEN_TRUNCATED: (CorruptRegionError, "{path} is truncated: {size} bytes, a region has {region_size}"),
    constants.NPUALLOC_OPEN_MAP_FAILED: (CorruptRegionError, "cannot map {path}: {strerror}"),
    constants.NPUALLOC_OPEN_BAD_MAGIC: (CorruptRegionError, "{path} is not an npualloc region (bad magic)"),
    constants.NPUALLOC_OPEN_BAD_VERSION: (IncompatibleRegionError,
                                          "{path} has region layout version {version}; this npualloc reads version "
                                          "{our_version} (use the npualloc the process was started with)"),
    constants.NPUALLOC_OPEN_BAD_SIZE: (CorruptRegionError, "{path} declares a {declared_size}-byte region, expected "
                                                           "{region_size}"),
    constants.NPUALLOC_OPEN_BAD_DEVICES: (CorruptRegionError, "{path} has an inconsistent header"),
    constants.NPUALLOC_OPEN_SHRANK: (CorruptRegionError, "{path} was truncated while being opened"),
    constants.NPUALLOC_OPEN_TOO_MANY: (NpuallocError, "cannot open {path}: this process has "
                                                      f"{constants.NPUALLOC_READER_OPEN_MAX} regions open already"),
}
PAUSE_STATES = {constants.NPUALLOC_RUNNING: "running", constants.NPUALLOC_PAUSING: "pausing",
                constants.NPUALLOC_PAUSED: "paused", constants.NPUALLOC_RESUMING: "resuming"}


def region_base() -> Path:
    """Where the users' region directories are."""
    return Path(os.environ.get("NPUALLOC_SHM_DIR") or "/dev/shm")


def _mounted_names(directory_fd: int) -> set[str]:
    """Names in the directory with a mount on or beneath them, from
    /proc/self/mountinfo, whose reading asks no file system. A user may mount
    a FUSE file system of their own on their region directory or on a file in
    it, and its server may never answer: whoever opens or stats what is there
    waits for ever. (A mount made between this read and the open is not seen;
    it is at the next listing.)"""
    try:
        directory = os.readlink(f"/proc/self/fd/{directory_fd}").rstrip("/") + "/"
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            points = [line.split(" ")[4] for line in f if line.count(" ") >= 4]
    except OSError:
        return set()
    # The kernel writes space, tab, newline and backslash in a path as \ooo.
    points = [re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), point) for point in points]
    return {point[len(directory):].split("/")[0] for point in points if point.startswith(directory)}


def _region_dirs(uid: int | None) -> Iterator[tuple[Path, int]]:
    """(path, descriptor) of each region directory of uid (of every user when
    None) that is what the library makes: a directory, never reached through
    a link, owned by the uid its name gives, closed to group and others, with
    no mount on or in it. Any user may plant something at such a name in
    /dev/shm; it is passed over. Each descriptor is closed when the iteration
    moves on."""
    base = region_base()
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        mounted = _mounted_names(base_fd)
        for name in sorted(os.listdir(base_fd)):
            match = REGION_DIR_NAME.fullmatch(name)
            if match is None or (uid is not None and int(match.group(1)) != uid) or name in mounted:
                continue
            try:
                # Never into a mount made after mountinfo was read (EXDEV).
                fd = open_no_mount(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                                    base_fd)
            except OSError:
                continue  # not a directory, a link, a mount point, or not ours to enter
            try:
                info = os.fstat(fd)
                if info.st_uid == int(match.group(1)) and info.st_mode & 0o077 == 0:
                    yield base / name, fd
            finally:
                os.close(fd)
    finally:
        os.close(base_fd)


class HiddenProcessError(OtherUserError):
    """/proc/<pid> exists but may not be read: another user's process, with
    /proc mounted hidepid=1 (hidepid=2 hides it altogether: no such process)."""

    def __init__(self, pid: int):
        super().__init__(f"process {pid} belongs to another user (/proc hides its details)")


def _proc_file(pid: int, name: str) -> bytes | None:
    """/proc/<pid>/<name>, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError:
        raise HiddenProcessError(pid) from None


def _stat_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat's fields from the third on (split after the last ')':
    the command name may hold spaces), or None when there is no such process."""
    text = _proc_file(pid, "stat")
    return None if text is None else text[text.rindex(b")") + 2:].split()


def _exited(fields: list[bytes]) -> bool:
    """Whether the process whose /proc/<pid>/stat fields these are has
    exited: a zombie with no other thread left. Z (or X) is its main
    thread's state alone: one that called pthread_exit reads Z while the
    other threads run on, holding the process's descriptors (and so its
    locks); field 20, the thread count, still counts that main thread."""
    return fields[0] in (b"Z", b"X") and int(fields[20 - 3]) <= 1


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat, or None when there is no such process.
    HiddenProcessError for another user's that /proc hides."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[22 - 3])


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (field 3: T by a signal, t by a
    debugger); False when it is gone or /proc hides it."""
    try:
        fields = _stat_fields(pid)
    except HiddenProcessError:
        return False
    return fields is not None and fields[0] in (b"T", b"t")


def _live_fields(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat's fields (_stat_fields) of the process with pid when
    one lives here, whenever it started; None when none does: no such pid,
    one /proc hides from us (another user's: ours are readable), or a zombie
    (_exited: its descriptors, and so its locks, are gone; only its parent's
    wait is left)."""
    try:
        fields = _stat_fields(pid)
    except HiddenProcessError:
        return None
    return None if fields is None or _exited(fields) else fields


def process_ended(pid: int, start_time: int) -> bool:
    """Whether the process that started at start_time is gone: gone as
    process_gone tells (a pid /proc hides from us included: the process we
    read before was not hidden), or the pid reused by a later process."""
    fields = _live_fields(pid)
    return fields is None or int(fields[22 - 3]) != start_time


def process_gone(pid: int) -> bool:
    """Whether no process with pid lives here, whenever it started
    (_live_fields). The reaper's rule (interpose/src/region/reap.c's ended)."""
    return _live_fields(pid) is None


def process_uid(pid: int) -> int | None:
    """The effective uid of a process (its region directory is named by it),
    or None when there is no such process. HiddenProcessError for another
    user's that /proc hides."""
    text = _proc_file(pid, "status")
    for line in (text or b"").splitlines():
        if line.startswith(b"Uid:"):
            return int(line.split()[2])
    return None


def _may_read(uid: int) -> bool:
    """A user reads the stats of their own processes; root reads everyone's
    (as nvidia-smi shows root every process on the device)."""
    return uid == os.geteuid() or os.geteuid() == 0


def _may_command(uid: int) -> bool:
    """Commands (and the snapshot files they leave) are for one's own processes, root's included."""
    return uid == os.geteuid()


@dataclass(frozen=True)
class RegionHeader:
    pid: int
    uid: int
    start_time: int
    created_unix_ns: int
    cmdline: str
    config: str
    device_count: int
    runtime_device_count: int  # the devices its runtime sees, 0: not known
    state: str          # running, pausing, paused, resuming (npualloc pause/resume)
    paused_bytes: int   # device memory the pause released
    backup_bytes: int   # host memory holding the paused blocks


class SeqlockWait:
    """Seconds left to wait for seqlocks that stay odd (SEQLOCK_TIMEOUT_S)."""

    def __init__(self) -> None:
        self.left = SEQLOCK_TIMEOUT_S


class Region:
    """The mapped region of one live process. Use as a context manager."""

    def __init__(self, pid: int, writable: bool = False, _directory: tuple[Path, int] | None = None,
                 _seqlock_wait: SeqlockWait | None = None):
        """_directory: (path, descriptor) of the region directory to look in
        (live_regions); by default every region directory of the process's user.
        _seqlock_wait: the wait shared by a listing's regions; by default its own."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise NoSuchProcessError(f"invalid pid {pid!r}")
        self.pid = pid
        self._writable = writable
        self._seqlock_wait = _seqlock_wait or SeqlockWait()
        fields = _stat_fields(pid)
        uid = process_uid(pid)
        if fields is None or uid is None:
            raise NoSuchProcessError(f"no such process: {pid}")
        if _exited(fields):  # its region is stale: live_regions removes it, as the reaper does
            raise NoSuchProcessError(f"process {pid} has exited (a zombie its parent has not waited for)")
        start_time = int(fields[22 - 3])
        if not (_may_command(uid) if writable else _may_read(uid)):
            raise OtherUserError(f"process {pid} belongs to another user")
        self._uid = uid
        self._start_time = start_time
        self.path = region_base() / f"npualloc-{uid}" / f"npualloc.{pid}"
        # A region directory made beside a taken name may hold a stale file
        # of an earlier process with this pid: the first valid region wins.
        first_error: NpuallocError | None = None
        for directory in [_directory] if _directory else _region_dirs(uid):
            try:
                self._open_validated(directory, start_time)
                return
            except NotUnderNpuallocError as e:
                first_error = first_error or e
        raise first_error or NotUnderNpuallocError(
            f"process {pid} is not running under npualloc (no region {self.path}: not preloaded, "
            "NPUALLOC_STATS=0, or nothing allocated yet)")

    def _open_validated(self, directory: tuple[Path, int], start_time: int) -> None:
        self.path = directory[0] / f"npualloc.{self.pid}"
        file = ffi.new("npualloc_region_file *")
        verdict = reader_library().npualloc_reader_open(directory[1], self.path.name.encode(), self._uid,
                                                         int(self._writable), file)
        if verdict != constants.NPUALLOC_OPEN_OK:
            raise self._refusal(verdict, file)
        self._file = file
        self._region: Any = file.region
        try:
            # The checked directory itself, for the files the process leaves
            # beside its region (snapshots): its name may be given to another
            # directory meanwhile where the base is not sticky.
            self.directory_fd = os.dup(directory[1])
            # The file's inode names those files, as a process with this pid
            # in another pid namespace sharing the directory has the same
            # region name: no other file has it while we hold this one open.
            self.inode = os.fstat(file.fd).st_ino
            self._check_header(start_time)
        except BaseException:
            self.close()
            raise

    def _refusal(self, verdict: int, file: Any) -> NpuallocError:
        """The error for what npualloc_reader_open found (file: what it saw)."""
        if verdict == constants.NPUALLOC_OPEN_ERRNO:
            if file.error == errno.ENOENT:
                return NotUnderNpuallocError(
                    f"process {self.pid} is not running under npualloc (no region {self.path}: not preloaded, "
                    "NPUALLOC_STATS=0, or nothing allocated yet)")
            if file.error in (errno.EACCES, errno.EPERM):
                return OtherUserError(f"process {self.pid} belongs to another user ({self.path} is not readable)")
            # ELOOP: a symlink planted where the region should be
            return CorruptRegionError(f"cannot open {self.path}: {os.strerror(file.error)}")
        error, message = _OPEN_REFUSALS[verdict]
        return error(message.format(path=self.path, uid=file.uid, owner=self._uid, size=file.size,
                                    region_size=REGION_SIZE, strerror=os.strerror(file.error), version=file.version,
                                    our_version=constants.NPUALLOC_SHM_VERSION, declared_size=file.declared_size))

    def _check_header(self, start_time: int) -> None:
        """What the file alone cannot tell: whether it is this process's."""
        header = self._region.header
        if header.pid != self.pid:
            raise CorruptRegionError(f"{self.path} has an inconsistent header")
        if header.uid != self._uid:
            raise OtherUserError(f"{self.path} names another user (uid {header.uid}, the process's is {self._uid})")
        if header.start_time and header.start_time != start_time:
            raise NotUnderNpuallocError(
                f"process {self.pid} is not running under npualloc ({self.path} is stale: it was left by an "
                "earlier process with the same pid)")
        self._check_not_lost()

    def _check_not_lost(self) -> None:
        """A file its owner shrank under our mapping reads as zeros from then on
        (the reader library's guard, instead of ending us with SIGBUS): whatever
        was read from the mapping is then an error, never a figure."""
        if reader_library().npualloc_reader_lost(self._region):
            raise CorruptRegionError(f"{self.path} was truncated while being read (its owner shrank it, or a "
                                     "sparse file found its file system full)")

    def close(self) -> None:
        self.__dict__.pop("_region", None)
        directory_fd = self.__dict__.pop("directory_fd", None)
        if directory_fd is not None:
            os.close(directory_fd)
        file = self.__dict__.pop("_file", None)
        if file is not None:
            reader_library().npualloc_reader_close(file)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def header(self) -> RegionHeader:
        h = self._region.header
        pause = ffi.new("npualloc_pause_state *")
        self._read_seqlocked(lambda: reader_library().npualloc_reader_pause_state(self._region, SEQLOCK_ATTEMPTS, pause),
                             "pause state")
        config = ffi.new("char[]", constants.NPUALLOC_CONFIG_LEN)
        self._read_seqlocked(lambda: reader_library().npualloc_reader_config(self._region, SEQLOCK_ATTEMPTS, config),
                             "the config text")
        header = RegionHeader(pid=h.pid, uid=h.uid, start_time=h.start_time, created_unix_ns=h.created_unix_ns,
                              cmdline=ffi.string(h.cmdline, len(h.cmdline)).decode(errors="replace"),
                              config=ffi.string(config).decode(errors="replace"),
                              device_count=h.device_count, runtime_device_count=h.runtime_device_count,
                              state=PAUSE_STATES.get(pause.state, f"state {pause.state}"),
                              paused_bytes=int(pause.paused_bytes), backup_bytes=int(pause.backup_bytes))
        self._check_not_lost()
        return header

    def runtime_device_count(self) -> int:
        """The devices the process's runtime sees; 0 when it did not say."""
        count = int(self._region.header.runtime_device_count)
        self._check_not_lost()
        return count

    def devices_in_use(self) -> list[int]:
        """Devices that allocated through npualloc: from its cache or with memory_saver."""
        count = min(self._region.header.device_count, constants.NPUALLOC_MAX_DEVICES)
        devices = [d for d in range(count) if self._region.devices[d].in_use or self._region.saver[d].in_use]
        self._check_not_lost()
        return devices

    def read_device_stats(self, device: int) -> Any:
        """A consistent copy of one device's stats (npualloc_device_stats *)."""
        return self._read_device(reader_library().npualloc_reader_stats, "npualloc_device_stats *", device, "stats")

    def read_saver_stats(self, device: int) -> Any:
        """A consistent copy of one device's memory_saver figures (npualloc_saver_stats *)."""
        return self._read_device(reader_library().npualloc_reader_saver_stats, "npualloc_saver_stats *", device,
                                 "memory_saver figures")

    def _read_device(self, read: Any, ctype: str, device: int, what: str) -> Any:
        if not 0 <= device < constants.NPUALLOC_MAX_DEVICES:
            raise ValueError(f"device {device} out of range 0..{constants.NPUALLOC_MAX_DEVICES - 1}")
        copy = ffi.new(ctype)
        self._read_seqlocked(lambda: read(self._region, device, SEQLOCK_ATTEMPTS, copy), f"device {device} {what}")
        return copy

    def _read_seqlocked(self, attempt: Callable[[], int], what: str) -> None:
        """Runs attempt (a reader library copy under a seqlock) until it returns
        NPUALLOC_READ_OK, within what is left of this region's seqlock wait."""
        started = time.monotonic()
        status = attempt()
        if status == constants.NPUALLOC_READ_OK:
            return
        deadline = started + max(self._seqlock_wait.left, 0.0)
        try:
            while status != constants.NPUALLOC_READ_OK:
                if status == constants.NPUALLOC_READ_LOST:
                    self._check_not_lost()
                if time.monotonic() >= deadline:
                    if process_stopped(self.pid):  # a SIGSTOP may land inside an update: not a corrupt file
                        raise ProcessStoppedError(f"process {self.pid} is stopped in the middle of updating its "
                                                  f"{what}: they can be read once it continues")
                    raise CorruptRegionError(f"{self.path}: {what} stayed mid-update "
                                             "(a writer died or stopped inside its seqlock?)")
                status = attempt()
        finally:
            self._seqlock_wait.left -= time.monotonic() - started

    def process_ended(self) -> bool:
        """Whether the process this region was opened for is gone."""
        return process_ended(self.pid, self._start_time)

    def command_seq(self) -> int:
        """The sequence number of the last command posted to the process."""
        return int(reader_library().npualloc_reader_request_seq(self._region))

    def post_command(self, code: int, device: int = -1, arg: float = 0.0,
                     timeout: float = COMMAND_TIMEOUT_S) -> int:
        """Posts a command and waits for the process to acknowledge it; returns
        the command's sequence number (a snapshot's file is named by it). The
        process applies it at its next allocator call, so an idle process times
        out; a command given up on (timeout, Ctrl-C) is withdrawn unless the
        process took it already, and the error says which."""
        if not self._writable:
            raise NpuallocError("region opened read-only")
        if not 0 < timeout < math.inf:  # a NaN or infinite deadline is never passed
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        reader = reader_library()
        seq = ffi.new("uint64_t *")
        status = ffi.new("int32_t *")
        deadline = time.monotonic() + timeout
        self._lock_requesters(deadline)
        try:
            # An earlier command still unanswered (BUSY): its requester is gone
            # (we hold the requesters' lock), so nobody waits for its answer:
            # withdrawn. Unless the process took it: then it may be reading
            # its fields, and new ones may not be stored over them until it answers.
            while (posted := reader.npualloc_reader_post(self._file, code, device, arg, seq)) == \
                    constants.NPUALLOC_POST_BUSY:
                if reader.npualloc_reader_withdraw(self._file, reader.npualloc_reader_request_seq(self._region)):
                    continue
                self._check_not_lost()
                if self.process_ended():
                    raise NoSuchProcessError(f"process {self.pid} ended before answering an earlier command")
                if time.monotonic() > deadline:
                    raise CommandTimeoutError(
                        f"process {self.pid} is still applying an earlier command (taken before its requester "
                        f"ended); nothing was posted")
                time.sleep(0.005)
            if posted == constants.NPUALLOC_POST_SEQ_EXHAUSTED:
                # A process counts one command at a time from 0: no real
                # process gets here, a damaged or crafted region does.
                raise CorruptRegionError(f"{self.path}: command sequence number is at its maximum "
                                         f"({self.command_seq()}): not a region a process wrote")
            try:
                while not reader.npualloc_reader_acked(self._region, seq[0], status):
                    self._check_not_lost()  # posted into zero pages: no process will ever answer
                    if self.process_ended() and not reader.npualloc_reader_acked(
                            self._region, seq[0], status):  # an answer written just before it ended counts
                        raise NoSuchProcessError(f"process {self.pid} ended before acknowledging the command "
                                                 "(it may or may not have been applied)")
                    if time.monotonic() > deadline:
                        outcome = self._give_up(seq[0], status)
                        if outcome == "withdrawn":
                            raise CommandTimeoutError(
                                f"process {self.pid} did not take the command within {timeout:g}s (commands are "
                                "applied at its next allocator call: is the process idle?); withdrawn, nothing "
                                "was applied")
                        if outcome == "taken":
                            raise CommandTimeoutError(
                                f"process {self.pid} took the command but did not answer within {timeout:g}s: it "
                                "is being applied")
                        break  # answered just as it was given up on
                    time.sleep(0.005)
            except KeyboardInterrupt:
                outcome = self._give_up(seq[0], status)
                raise CommandInterruptedError(f"interrupted before process {self.pid} answered the command: " + {
                    "withdrawn": "withdrawn, nothing was applied",
                    "taken": "the process took it and is applying it",
                    "answered": "it had just answered it",
                }[outcome]) from None
        finally:
            fcntl.flock(self._file.fd, fcntl.LOCK_UN)
        if status[0] != constants.NPUALLOC_CMD_OK:
            raise CommandRejectedError(f"process {self.pid}: {_ACK_ERRORS.get(status[0], f'status {status[0]}')}",
                                       status[0])
        return int(seq[0])

    def _give_up(self, seq: int, status: Any) -> str:
        """Withdraws command seq: "withdrawn" (it will never be applied), or,
        when the process had taken it, "answered" (its answer came meanwhile,
        in *status) or "taken" (it is being applied)."""
        reader = reader_library()
        if reader.npualloc_reader_withdraw(self._file, seq):
            return "withdrawn"
        return "answered" if reader.npualloc_reader_acked(self._region, seq, status) else "taken"

    def _lock_requesters(self, deadline: float) -> None:
        """Serialises requesters (two CLIs at once); the process never takes
        it. Bounded: a requester that hangs holding it cannot hang us."""
        while True:
            try:
                fcntl.flock(self._file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CommandTimeoutError(f"another requester holds {self.path}'s command lock") from None
                time.sleep(0.005)


@dataclass(frozen=True)
class RegionEntry:
    pid: int
    path: Path


def live_regions() -> Iterator[tuple[RegionEntry, Region | NpuallocError]]:
    """Every region file of the region directories of this user (of every
    user, for root) with its opened Region, or the error that kept it from
    opening. Files of dead pids and stale files of reused pids are removed
    (only our own, once their process dropped its lock: region_lock.h) and not
    yielded. An opened region is yielded once per pid: a user
    may make region directories beside the first (region_dir.c) and copy a
    region into each. A refusal does not count, or a file planted for another
    user's pid in a directory listed first would hide that process's region.
    The regions share one SeqlockWait."""
    listed: set[int] = set()
    seqlock_wait = SeqlockWait()
    for directory, dir_fd in _region_dirs(None if os.geteuid() == 0 else os.geteuid()):
        names = sorted(os.listdir(dir_fd))  # aside names (.npualloc.*) first: a region put back is listed too
        for name in names:
            match = REGION_NAME.fullmatch(name)
            if match is None:
                put_back = _remove_leftover_of_dead(dir_fd, name)
                if put_back is not None and put_back not in names:
                    names.append(put_back)
                continue
            entry = RegionEntry(int(match.group(1)), directory / name)
            if entry.pid > PID_MAX:
                continue  # no name a process gives: the reaper keeps it too
            if entry.pid in listed:
                continue  # a copy; a stale one goes once the pid has died
            try:
                # Never into a mount made after mountinfo was read (EXDEV).
                inode = lstat_no_mount(name, dir_fd).st_ino
            except OSError:
                continue  # removed at exit meanwhile, or a mount point
            try:
                region = Region(entry.pid, _directory=(directory, dir_fd), _seqlock_wait=seqlock_wait)
            except FileNotFoundError:
                continue  # its process removed it at exit meanwhile
            except (NoSuchProcessError, NotUnderNpuallocError):
                # No process of ours has that pid, or another one has: the
                # region's is gone, unless it still holds the file's lock. It
                # then lives in another pid namespace sharing the directory
                # (its pid names another process here, or none): neither
                # removed nor listed under a pid that is not its own here.
                if reader_library().npualloc_reader_locked(dir_fd, name.encode(), inode) == 0:
                    _remove_stale(dir_fd, name, inode)
                continue
            except NpuallocError as e:
                yield entry, e
                continue
            listed.add(entry.pid)
            yield entry, region


T = TypeVar("T")


def read_live_regions(read: Callable[[int, Region], T],
                      skipped: Callable[[int, NpuallocError], None]) -> Iterator[tuple[int, T]]:
    """(pid, read(pid, region)) for each region live_regions opens, the region
    closed after. Another user's process (a refusal to a reader that is not
    root) is left out, as theirs to read; a region that could not be opened,
    or failed while read (torn, its process gone meanwhile), goes to
    skipped(pid, error), so that one damaged region never hides the healthy
    ones beside it (ls, the exporter, list_gpu_processes)."""
    for entry, opened in live_regions():
        if isinstance(opened, OtherUserError):
            continue
        try:
            if isinstance(opened, NpuallocError):
                raise opened
            with opened as region:
                value = read(entry.pid, region)
        except NpuallocError as e:
            skipped(entry.pid, e)
            continue
        yield entry.pid, value


def _remove_leftover_of_dead(dir_fd: int, name: str) -> str | None:
    """Removes name when it is what a gone process left; the name a live
    region found there went back under (_put_back), if any. Whether a live
    process still uses it is asked of its lock, whatever pid namespace that
    process is in: where the name's pid names another process here, or none,
    a pid cannot tell. A region's temporary is locked from its creation, and
    a reaper's aside name holds what it moved: a live region keeps its lock
    (region_lock.h). A snapshot file and its temporary go by their region's
    lock (_region_held)."""
    match = LEFTOVER_NAME.fullmatch(name)
    if match is None:
        return None
    pid = int(match.group(1) or match.group(3))
    if pid > PID_MAX:
        return None  # no name a process gives: the reaper keeps it too
    aside = match.group(2) is not None
    try:
        # Before the tests: a file a live process puts at the name after them is never the one removed.
        info = lstat_no_mount(name, dir_fd)
    except OSError:
        return None  # gone already
    if aside and info.st_uid != os.geteuid():
        return None  # another user's, in a directory root lists: theirs, never opened nor removed
    if reader_library().npualloc_reader_locked(dir_fd, name.encode(), info.st_ino) == 1:
        return _put_back(dir_fd, name, info) if aside else None  # held: never removed
    if match.group(3) is not None and _region_held(dir_fd, pid):
        return None
    if process_gone(pid):
        _remove_stale(dir_fd, name, info.st_ino)
    return None


def _region_held(dir_fd: int, pid: int) -> bool:
    """Whether region npualloc.<pid>'s lock is held: a snapshot file and its
    temporary are their process's while it holds it, as its requester reads
    the file after the answer, and the process removes it later or at exit."""
    region = f"npualloc.{pid}"
    try:
        region_inode = lstat_no_mount(region, dir_fd).st_ino
    except OSError:
        return False  # no region: its process removed it at exit, or it was removed as a gone process's
    return bool(reader_library().npualloc_reader_locked(dir_fd, region.encode(), region_inode) == 1)


def _put_back(dir_fd: int, name: str, info: os.stat_result) -> str | None:
    """The name that name, a reaper's aside name (info: its lstat) holding a
    region whose process lives (its lock is held), went back under, if it
    did; held, it is never removed: a reaper moves a name aside before it
    looks at what it moved, and a live region renamed over a leftover at that
    moment stays there when the reaper is killed before it puts it back, or
    finds its name taken. Ours goes back under its own name, npualloc.<pid>,
    unless another file took that: a process with that pid in another pid
    namespace published there, and putting ours back over it would hide
    that live one instead. It goes back once that name is free."""
    try:
        fd = open_no_mount(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd)
    except OSError:
        return None
    try:
        same = os.fstat(fd).st_ino == info.st_ino
        data = bytearray(os.pread(fd, ffi.sizeof("npualloc_region_header"), 0))
    finally:
        os.close(fd)
    if not same or len(data) != ffi.sizeof("npualloc_region_header"):
        return None
    header = ffi.from_buffer("npualloc_region_header *", data)
    if header.magic != constants.NPUALLOC_SHM_MAGIC or header.version != constants.NPUALLOC_SHM_VERSION or header.pid <= 0:
        return None  # held, yet not a region of this layout: where it goes is not ours to tell
    own = f"npualloc.{header.pid}"
    try:
        os.link(name, own, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None  # the name is taken (or the link refused): left aside, never removed
    reader_library().npualloc_reader_unlink_checked(dir_fd, name.encode(), info.st_dev, info.st_ino)
    return own


def _remove_stale(dir_fd: int, name: str, inode: int) -> None:
    try:
        info = lstat_no_mount(name, dir_fd)
    except OSError:
        return  # gone already
    # Same inode: not a fresh region a new process with this pid just renamed
    # into place, neither now nor later, as it was unlinked by name
    # (interpose/src/unlink_checked.h).
    if info.st_ino == inode and info.st_uid == os.geteuid():
        reader_library().npualloc_reader_unlink_checked(dir_fd, name.encode(), info.st_dev, inode)
