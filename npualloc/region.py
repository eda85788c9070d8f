"""Reading (and posting commands to) another process's shared-memory region.

Nothing in a region file is trusted before it is validated: the file size
first, then magic, version and the header's size field, all through a mapping
of exactly sizeof(npualloc_region) bytes, so a truncated or crafted file can
never make the reader touch memory outside it.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ._ffi import DEVICE_STATS_SIZE, REGION_SIZE, SAVER_STATS_SIZE, constants, ffi
from .errors import (CommandRejectedError, CommandTimeoutError, CorruptRegionError, IncompatibleRegionError,
                     NoSuchProcessError, NotUnderNpuallocError, NpuallocError, OtherUserError)

REGION_NAME = re.compile(r"npualloc\.(\d+)")
# The directories regions live in, one per user in the base directory
# (/dev/shm): npualloc-<uid>, and npualloc-<uid>.XXXXXX, which a process makes
# when another user took the first name (interpose/src/region/region_dir.c).
REGION_DIR_NAME = re.compile(r"npualloc-(\d+)(?:\.[A-Za-z0-9]{6})?")
# What else a process leaves beside its region: snapshot files posted for a
# requester that gave up waiting, and temporaries of a process that died while
# writing (the region's own, and a snapshot's).
LEFTOVER_NAME = re.compile(r"\.npualloc\.(\d+)\.tmp|npualloc\.(\d+)\.snapshot\.\d+(?:\.tmp\.\d+)?")
# A writer stays inside its seqlock for a handful of stores; a seq that stays
# odd this long belongs to a writer that died mid-update.
SEQLOCK_TIMEOUT_S = 1.0
SEQ_MAX = (1 << 64) - 1   # command.request_seq is a uint64_t
COMMAND_TIMEOUT_S = 5.0

_ACK_ERRORS = {
    constants.NPUALLOC_CMD_EUNKNOWN: "the process does not support this command",
    constants.NPUALLOC_CMD_EINVAL: "the process rejected the argument",
    constants.NPUALLOC_CMD_EFAILED: "the process failed to apply it (its stderr says why)",
    constants.NPUALLOC_CMD_ENOTPAUSABLE: "the process cannot be paused: it holds memory outside expandable segments "
                                         "(start it with --conf expandable_segments:True); it runs on untouched",
    constants.NPUALLOC_CMD_ENOTPAUSED: "the process is not paused",
    constants.NPUALLOC_CMD_EPAUSED: "the process is paused: resume it first",
}
PAUSE_STATES = {constants.NPUALLOC_RUNNING: "running", constants.NPUALLOC_PAUSING: "pausing",
                constants.NPUALLOC_PAUSED: "paused", constants.NPUALLOC_RESUMING: "resuming"}


def region_base() -> Path:
    """Where the users' region directories are."""
    return Path(os.environ.get("NPUALLOC_SHM_DIR") or "/dev/shm")


def _region_dirs(uid: int | None) -> Iterator[tuple[Path, int]]:
    """(path, descriptor) of each region directory of uid (of every user when
    None) that is what the library makes: a directory, never reached through
    a link, owned by the uid its name gives, closed to group and others. Any
    user may plant something at such a name in /dev/shm; it is passed over.
    Each descriptor is closed when the iteration moves on."""
    base = region_base()
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in sorted(os.listdir(base_fd)):
            match = REGION_DIR_NAME.fullmatch(name)
            if match is None or (uid is not None and int(match.group(1)) != uid):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=base_fd)
            except OSError:
                continue  # not a directory, a link, or not ours to enter
            try:
                info = os.fstat(fd)
                if info.st_uid == int(match.group(1)) and info.st_mode & 0o077 == 0:
                    yield base / name, fd
            finally:
                os.close(fd)
    finally:
        os.close(base_fd)


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (counted after the last ')': the command
    name may hold spaces), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(b")") + 2:].split()
    return int(fields[22 - 3])


def process_uid(pid: int) -> int | None:
    """The effective uid of a process (its region directory is named by it),
    or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (FileNotFoundError, ProcessLookupError):
        return None
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
    state: str          # running, pausing, paused, resuming (npualloc pause/resume)
    paused_bytes: int   # device memory the pause released
    backup_bytes: int   # host memory holding the paused blocks


class Region:
    """The mapped region of one live process. Use as a context manager."""

    def __init__(self, pid: int, writable: bool = False, _directory: tuple[Path, int] | None = None):
        """_directory: (path, descriptor) of the region directory to look in
        (live_regions); by default every region directory of the process's user."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise NoSuchProcessError(f"invalid pid {pid!r}")
        self.pid = pid
        self._writable = writable
        start_time = process_start_time(pid)
        uid = process_uid(pid)
        if start_time is None or uid is None:
            raise NoSuchProcessError(f"no such process: {pid}")
        if not (_may_command(uid) if writable else _may_read(uid)):
            raise OtherUserError(f"process {pid} belongs to another user")
        self._uid = uid
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
        self._fd = self._open(directory[1])
        try:
            self._map = self._map_validated()
            self._region: Any = ffi.from_buffer("npualloc_region *", self._map)
            self._check_header(start_time)
        except BaseException:
            self.close()
            raise

    def _open(self, dir_fd: int) -> int:
        # O_NONBLOCK: a FIFO planted at the region's name must not block the
        # open (it is refused after the fstat); O_NOFOLLOW: nor may a link lead elsewhere.
        flags = (os.O_RDWR if self._writable else os.O_RDONLY) | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self.path.name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            raise NotUnderNpuallocError(
                f"process {self.pid} is not running under npualloc (no region {self.path}: not preloaded, "
                "NPUALLOC_STATS=0, or nothing allocated yet)") from None
        except PermissionError:
            raise OtherUserError(f"process {self.pid} belongs to another user ({self.path} is not readable)") from None
        except OSError as e:  # ELOOP: a symlink planted where the region should be
            raise CorruptRegionError(f"cannot open {self.path}: {e.strerror}") from None

    def _map_validated(self) -> mmap.mmap:
        info = os.fstat(self._fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptRegionError(f"{self.path} is not a regular file (file type {stat.filemode(info.st_mode)[0]!r}, "
                                     f"owner uid {info.st_uid}): not a region, refused")
        if info.st_uid != self._uid:
            raise OtherUserError(f"{self.path} belongs to another user (uid {info.st_uid}, the process's is {self._uid})")
        if info.st_size < REGION_SIZE:
            raise CorruptRegionError(f"{self.path} is truncated: {info.st_size} bytes, a region has {REGION_SIZE}")
        access = mmap.ACCESS_WRITE if self._writable else mmap.ACCESS_READ
        return mmap.mmap(self._fd, REGION_SIZE, access=access)

    def _check_header(self, start_time: int) -> None:
        header = self._region.header
        if header.magic != constants.NPUALLOC_SHM_MAGIC:
            raise CorruptRegionError(f"{self.path} is not an npualloc region (bad magic)")
        if header.version != constants.NPUALLOC_SHM_VERSION:
            raise IncompatibleRegionError(
                f"{self.path} has region layout version {header.version}; this npualloc reads version "
                f"{constants.NPUALLOC_SHM_VERSION} (use the npualloc the process was started with)")
        if header.size != REGION_SIZE:
            raise CorruptRegionError(f"{self.path} declares a {header.size}-byte region, expected {REGION_SIZE}")
        if header.pid != self.pid or header.device_count > constants.NPUALLOC_MAX_DEVICES:
            raise CorruptRegionError(f"{self.path} has an inconsistent header")
        if header.uid != self._uid:
            raise OtherUserError(f"{self.path} names another user (uid {header.uid}, the process's is {self._uid})")
        if header.start_time and header.start_time != start_time:
            raise NotUnderNpuallocError(
                f"process {self.pid} is not running under npualloc ({self.path} is stale: it was left by an "
                "earlier process with the same pid)")

    def close(self) -> None:
        region = self.__dict__.pop("_region", None)
        if region is not None:
            ffi.release(region)
        mapping = self.__dict__.pop("_map", None)
        if mapping is not None:
            mapping.close()
        fd = self.__dict__.pop("_fd", None)
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def header(self) -> RegionHeader:
        h = self._region.header
        return RegionHeader(pid=h.pid, uid=h.uid, start_time=h.start_time, created_unix_ns=h.created_unix_ns,
                            cmdline=ffi.string(h.cmdline, len(h.cmdline)).decode(errors="replace"),
                            config=ffi.string(h.config, len(h.config)).decode(errors="replace"),
                            device_count=h.device_count,
                            state=PAUSE_STATES.get(h.pause_state, f"state {h.pause_state}"),
                            paused_bytes=h.paused_bytes, backup_bytes=h.backup_bytes)

    def devices_in_use(self) -> list[int]:
        """Devices that allocated through npualloc: from its cache or with memory_saver."""
        count = min(self._region.header.device_count, constants.NPUALLOC_MAX_DEVICES)
        return [d for d in range(count) if self._region.devices[d].in_use or self._region.saver[d].in_use]

    def read_device_stats(self, device: int) -> Any:
        """A consistent copy of one device's stats (npualloc_device_stats *)."""
        return self._read_seqlocked(self._region.devices, "npualloc_device_stats *", DEVICE_STATS_SIZE, device,
                                    "stats")

    def read_saver_stats(self, device: int) -> Any:
        """A consistent copy of one device's memory_saver figures (npualloc_saver_stats *)."""
        return self._read_seqlocked(self._region.saver, "npualloc_saver_stats *", SAVER_STATS_SIZE, device,
                                    "memory_saver figures")

    def _read_seqlocked(self, array: Any, ctype: str, size: int, device: int, what: str) -> Any:
        """Copy between two reads of an even, unchanged seq. The three reads
        stay in program order on x86-64 (loads are not reordered with loads);
        Python has no load fence for weaker CPUs such as aarch64."""
        if not 0 <= device < constants.NPUALLOC_MAX_DEVICES:
            raise ValueError(f"device {device} out of range 0..{constants.NPUALLOC_MAX_DEVICES - 1}")
        source = array + device
        copy = ffi.new(ctype)
        deadline = time.monotonic() + SEQLOCK_TIMEOUT_S
        while True:
            before = source.seq
            if before % 2 == 0:
                ffi.memmove(copy, source, size)
                if source.seq == before and copy.seq == before:
                    return copy
            if time.monotonic() > deadline:
                raise CorruptRegionError(f"{self.path}: device {device} {what} stayed mid-update for "
                                         f"{SEQLOCK_TIMEOUT_S:g}s (writer died inside its seqlock?)")
            os.sched_yield()

    def command_seq(self) -> int:
        """The sequence number of the last command posted to the process."""
        return int(self._region.command.request_seq)

    def post_command(self, code: int, device: int = -1, arg: float = 0.0,
                     timeout: float = COMMAND_TIMEOUT_S) -> int:
        """Posts a command and waits for the process to acknowledge it; returns
        the command's sequence number (a snapshot's file is named by it). The
        process applies it at its next allocator call, so an idle process times out."""
        if not self._writable:
            raise NpuallocError("region opened read-only")
        deadline = time.monotonic() + timeout
        self._lock_requesters(deadline)
        try:
            command = self._region.command
            if command.request_seq >= SEQ_MAX:
                # A process counts one command at a time from 0: no real
                # process gets here, a damaged or crafted region does.
                raise CorruptRegionError(f"{self.path}: command sequence number is at its maximum "
                                         f"({command.request_seq}): not a region a process wrote")
            command.code = code
            command.device = device
            command.arg = arg
            target = command.request_seq + 1
            command.request_seq = target  # publishes the fields above (stored after them)
            while command.ack_seq < target:
                if time.monotonic() > deadline:
                    raise CommandTimeoutError(
                        f"process {self.pid} did not acknowledge the command within {timeout:g}s: it is applied at "
                        "its next allocator call (it stays posted; is the process idle?)")
                time.sleep(0.005)
            status = command.ack_status
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        if status != constants.NPUALLOC_CMD_OK:
            raise CommandRejectedError(f"process {self.pid}: {_ACK_ERRORS.get(status, f'status {status}')}")
        return int(target)

    def _lock_requesters(self, deadline: float) -> None:
        """Serialises requesters (two CLIs at once); the process never takes
        it. Bounded: a requester that hangs holding it cannot hang us."""
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
    (only our own) and not yielded."""
    for directory, dir_fd in _region_dirs(None if os.geteuid() == 0 else os.geteuid()):
        for name in sorted(os.listdir(dir_fd)):
            match = REGION_NAME.fullmatch(name)
            if match is None:
                _remove_leftover_of_dead(dir_fd, name)
                continue
            entry = RegionEntry(int(match.group(1)), directory / name)
            try:
                inode = os.lstat(name, dir_fd=dir_fd).st_ino
                region = Region(entry.pid, _directory=(directory, dir_fd))
            except FileNotFoundError:
                continue  # its process removed it at exit meanwhile
            except (NoSuchProcessError, NotUnderNpuallocError):
                _remove_stale(dir_fd, name, inode)
                continue
            except NpuallocError as e:
                yield entry, e
                continue
            yield entry, region


def _remove_leftover_of_dead(dir_fd: int, name: str) -> None:
    match = LEFTOVER_NAME.fullmatch(name)
    if match is None:
        return
    pid = int(match.group(1) or match.group(2))
    if process_start_time(pid) is None:
        try:
            _remove_stale(dir_fd, name, os.lstat(name, dir_fd=dir_fd).st_ino)
        except OSError:
            pass  # gone already


def _remove_stale(dir_fd: int, name: str, inode: int) -> None:
    try:
        info = os.lstat(name, dir_fd=dir_fd)
        # Same inode: not a fresh region a new process with this pid just renamed into place.
        if info.st_ino == inode and info.st_uid == os.geteuid():
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass  # gone already, or not ours to remove
