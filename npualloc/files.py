"""Files at paths a user names (`snapshot -o`, `dump_snapshot`, `plot -o`,
the snapshots `replay` and `plot` read), which may be in shared places where
another user planted something. The rules are the library's for
oom_snapshot:PATH (interpose/src/hook/snapshot.c):

- writing: nothing at the name, or a regular file of ours: a new file (0600)
  written under a temporary name and moved into place; a FIFO or character
  device (/dev/null): written to, as torch would, non-blocking; a symbolic
  link (never followed), another user's file, a directory, a block device or
  socket: refused and left as it is.
- reading: the file itself opened non-blocking and never through a link,
  then fstat'ed; only a regular file is read, so a FIFO nobody writes to
  never blocks. Links on the directories of its path are followed, but for
  another user's into another mount from a directory others may write
  (_open_component).
- either way, a name with a file system mounted on it is refused before that
  file system is asked anything (open_no_mount): anyone may mount a FUSE file
  system on a file of theirs in /tmp whose server never answers, and a stat or
  open of the name then waited for ever (an audit on 2026-11-26). A mount on
  a directory of the path is refused too where it may be another user's FUSE
  one, wherever it is (_open_component).
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import select
import stat
import time
from pathlib import Path
from typing import NamedTuple

from ._ffi import reader_library
from .errors import NpuallocError

# A FIFO whose reader has not taken all the data after this long in all is given up (as
# snapshot.c's WRITE_LIMIT_MS): a reader that takes a page now and then must not hold us for minutes.
WRITE_LIMIT_S = 5.0
_CHUNK = 1 << 20
# Random names a temporary tries before giving up (as snapshot.c's TEMPORARY_TRIES).
TEMPORARY_TRIES = 16


# openat2(2): one number on every architecture (the common table of new system calls).
_SYS_OPENAT2 = 437
_RESOLVE_NO_XDEV = 0x01


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def open_no_mount(name: str, flags: int, dir_fd: int, mode: int = 0) -> int:
    """os.open(name, flags, mode, dir_fd=dir_fd), refusing with EXDEV a name
    that has a file system mounted on it (openat2's RESOLVE_NO_XDEV) before
    that file system is asked anything. Where openat2 is missing (Linux
    before 5.6) or filtered (a container's seccomp profile), plain os.open.
    The interposer does the same (interpose/src/nomount.h)."""
    how = _OpenHow(flags & 0xFFFFFFFF, mode if flags & os.O_CREAT else 0, _RESOLVE_NO_XDEV)
    fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), os.fsencode(name), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):
        return os.open(name, flags, mode, dir_fd=dir_fd)
    raise OSError(err, os.strerror(err), name)


def lstat_no_mount(name: str, dir_fd: int) -> os.stat_result:
    """os.stat(name, dir_fd=dir_fd, follow_symlinks=False) that never asks a
    file system mounted on name: OSError EXDEV for such a name."""
    fd = open_no_mount(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd)
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)


class FileRefusedError(NpuallocError):
    """What is at a path named by the user is not ours to read or write; it is left as it is."""


class FileTooLargeError(FileRefusedError):
    """A file past the size its reader takes (read_regular_file's max_bytes)."""


class RegularFile(NamedTuple):
    data: bytes
    uid: int  # its owner, as the descriptor read showed it


def _reason(err: int) -> str:
    return {errno.ELOOP: "it is a symbolic link (never followed; left as it is)",
            errno.ENXIO: "a FIFO with no reader (nothing written)",
            errno.ETIMEDOUT: f"the FIFO's reader did not take it within {WRITE_LIMIT_S:g} s (incomplete)",
            errno.EEXIST: "another file appeared at the name meanwhile (left as it is)",
            errno.EXDEV: "a file system is mounted on it (never entered; left as it is)"}.get(err, os.strerror(err))


def read_regular_file(path: str | Path, max_bytes: int, owner: int | None = None,
                      dir_fd: int | None = None) -> RegularFile:
    """The bytes of the regular file at path (of owner's, when given), at most
    max_bytes: a larger file (a sparse one of terabytes costs its maker nothing)
    is refused, not read. With dir_fd, path's last component is opened in
    that directory, whatever its path names now."""
    head, name = os.path.split(os.fspath(path))
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    try:
        if dir_fd is not None:
            fd = open_no_mount(name, flags, dir_fd)
        elif not name:  # "dir/": walked as any path is, and refused below as no regular file
            fd = _open_directory(head, path, "read", follow_links=True)
        else:
            directory = _open_directory(head, path, "read", follow_links=True)
            try:
                fd = open_no_mount(name, flags, directory)
            finally:
                os.close(directory)
    except OSError as e:
        raise FileRefusedError(f"cannot read {path}: {_reason(e.errno)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefusedError(f"cannot read {path}: not a regular file (file type "
                                   f"{stat.filemode(info.st_mode)[0]!r}; a FIFO or device is never read)")
        if owner is not None and info.st_uid != owner:
            raise FileRefusedError(f"cannot read {path}: it belongs to another user (uid {info.st_uid})")
        chunks, read = [], 0
        while info.st_size <= max_bytes and read <= max_bytes and (chunk := os.read(fd, _CHUNK)):
            chunks.append(chunk)
            read += len(chunk)  # the file may grow while it is read
        if info.st_size > max_bytes or read > max_bytes:
            raise FileTooLargeError(f"cannot read {path}: larger than {max_bytes >> 20} MiB")
        return RegularFile(b"".join(chunks), info.st_uid)
    except OSError as e:
        raise FileRefusedError(f"cannot read {path}: {_reason(e.errno)}") from None
    finally:
        os.close(fd)


def write_user_file(path: str | Path, data: bytes) -> None:
    """Writes data to path without ever destroying or following what is there (the rules above)."""
    try:
        _write(os.fspath(path), data)
    except OSError as e:
        raise FileRefusedError(f"cannot write {path}: {_reason(e.errno)}") from None


def _write(path: str, data: bytes) -> None:
    directory, name = _open_parent(path)
    try:
        _write_in(directory, name, path, data)
    finally:
        os.close(directory)


def _open_parent(path: str) -> tuple[int, str]:
    """The directory holding path's last component, opened without following
    a link anywhere on the way (a directory another user replaced by a link,
    to one only root may write, say, is refused), and that component."""
    head, name = os.path.split(path)
    if not name:
        raise OSError(errno.EISDIR, "")
    return _open_directory(head, path, "write", follow_links=False), name


def _open_directory(head: str, path: str, action: str, follow_links: bool) -> int:
    """The directory head names (path's, to read or write: action), opened a
    component at a time (_open_component); without follow_links, a link on
    the way is refused."""
    directory = os.open("/" if head.startswith("/") else ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for component in filter(None, head.split("/")):
            try:
                inner = _open_component(component, directory, path, action, follow_links)
            except NotADirectoryError:
                if not follow_links and stat.S_ISLNK(lstat_no_mount(component, directory).st_mode):
                    raise FileRefusedError(f"cannot write {path}: a directory on its path is a symbolic link "
                                           "(never followed; nothing written)") from None
                raise
            os.close(directory)
            directory = inner
    except BaseException:
        os.close(directory)
        raise
    return directory


def _others_may_write(directory: int) -> bool:
    """Whether a user other than us and root may make a link in it."""
    info = os.fstat(directory)
    return info.st_uid not in (os.geteuid(), 0) or bool(info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _link_owner(name: str, directory: int) -> int | None:
    """The owner of the link at name, None when no link is there."""
    try:
        info = lstat_no_mount(name, directory)
    except OSError:  # a mount point (EXDEV), or gone
        return None
    return info.st_uid if stat.S_ISLNK(info.st_mode) else None


def _another_users_mount(mount_root: int) -> bool:
    """Whether the mount whose root mount_root is (an O_PATH descriptor) may be
    another user's: a FUSE one whose user_id is neither ours nor root's, or
    one that cannot be told. The reader library judges it by the rule and the
    /proc/self reads the interposer judges an oom_snapshot path by
    (interpose/src/mount_maker.h), never asking the mounted file system."""
    return bool(reader_library().npualloc_reader_mount_is_another_users(mount_root) != 0)


def _open_component(component: str, directory: int, path: str, action: str, follow_links: bool) -> int:
    """The directory component in directory, through a link only with
    follow_links; a mount on it is entered only when it is not another
    user's (_another_users_mount), wherever it is, as snapshot.c's
    open_component: fusermount asks write access to the mount point alone,
    not to the directory holding it, and another user's FUSE mount whose
    server never answers held the lookup of the name inside it for ever.
    The O_PATH open lands on the mount's root without asking its file system
    anything, and the mount judged is the very one landed on. ".." climbs
    out of a mount and is never refused (as in snapshot.c, it lands on
    another user's mount only where one was stacked above the working
    directory or the walk: not guarded), nor is a link of ours or root's
    that leads to another mount, nor any in a directory only we and root
    write; another user's in a directory others may write is (with
    fs.protected_symlinks off, the kernel follows it). A link followed is
    followed by the kernel: the mounts on its target's way are not judged,
    so one of ours into another user's directory with their stalled mount on
    it waits there."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow_links else os.O_NOFOLLOW)
    try:
        return open_no_mount(component, flags, directory)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
    if component == "..":
        return os.open(component, flags, dir_fd=directory)
    done = "written" if action == "write" else "read"
    link_owner = _link_owner(component, directory) if follow_links else None
    if link_owner is not None:
        if link_owner in (os.geteuid(), 0) or not _others_may_write(directory):
            return os.open(component, flags, dir_fd=directory)
        raise FileRefusedError(f"cannot {action} {path}: another user's link on its path leads to another file "
                               f"system, in a directory other users may write (never entered; nothing {done})")
    # No link was there when looked at: none is followed now, should another
    # user have unmounted their directory and put one there since.
    inner = os.open(component, flags | os.O_NOFOLLOW, dir_fd=directory)
    if not _another_users_mount(inner):
        return inner
    os.close(inner)
    raise FileRefusedError(f"cannot {action} {path}: a directory on its path has a file system mounted on it that "
                           f"may be another user's (never entered; nothing {done})")


def _write_in(directory: int, name: str, path: str, data: bytes) -> None:
    try:
        seen = lstat_no_mount(name, directory)
    except FileNotFoundError:
        _write_new(directory, name, path, data, replace=False)
        return
    if stat.S_ISLNK(seen.st_mode):
        raise OSError(errno.ELOOP, "")
    if (stat.S_ISFIFO(seen.st_mode) or stat.S_ISREG(seen.st_mode)) and seen.st_uid != os.geteuid():
        # Never another user's file, nor their FIFO: anyone may plant one in /tmp to read what we write.
        raise FileRefusedError(f"cannot write {path}: it belongs to another user (left as it is)")
    if stat.S_ISFIFO(seen.st_mode) or stat.S_ISCHR(seen.st_mode):
        _write_into(directory, name, seen, data)
    elif stat.S_ISDIR(seen.st_mode):
        raise OSError(errno.EISDIR, "")
    elif not stat.S_ISREG(seen.st_mode):
        raise FileRefusedError(f"cannot write {path}: not a regular file, FIFO or character device "
                               "(left as it is)")
    else:
        _write_new(directory, name, path, data, replace=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    deadline = time.monotonic() + WRITE_LIMIT_S
    while view:
        try:
            view = view[os.write(fd, view[:_CHUNK]):]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise OSError(errno.ETIMEDOUT, "") from None


def _write_new(directory: int, name: str, path: str, data: bytes, replace: bool) -> None:
    """A new file under a temporary name, moved into place so a reader sees a
    whole file or none; only a file of ours (checked by the caller) is replaced."""
    tmp, fd = _create_temporary(directory, name, path)
    try:
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, name, src_dir_fd=directory, dst_dir_fd=directory)
        else:  # never replaces: EEXIST when something appeared meanwhile
            os.link(tmp, name, src_dir_fd=directory, dst_dir_fd=directory, follow_symlinks=False)
    finally:
        try:
            os.unlink(tmp, dir_fd=directory)
        except FileNotFoundError:
            pass


def _create_temporary(directory: int, name: str, path: str) -> tuple[str, int]:
    """Creates "<name>.tmp.<pid>.<random>" (O_EXCL, 0600), as snapshot.c does:
    random because anyone sees our pid, and something planted at a predictable
    name made every write fail. A name taken is never removed: another is tried."""
    for _ in range(TEMPORARY_TRIES):
        tmp = f"{name}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                dir_fd=directory)
        except FileExistsError:
            continue
        except OSError as e:
            if e.errno == errno.ENAMETOOLONG:
                raise FileRefusedError(f"cannot write {path}: its name leaves no room for the temporary's suffix "
                                       ".tmp.<pid>.<8 hex digits> (nothing written)") from None
            raise
    raise FileRefusedError(f"cannot write {path}: every temporary name tried beside it was taken (left as they are; "
                           "nothing written)")


def _write_into(directory: int, name: str, seen: os.stat_result, data: bytes) -> None:
    """What torch does with such a path: open it and write. Non-blocking, so a
    FIFO without a reader is ENXIO rather than a hang, and the descriptor must
    be the very file the caller saw. A device's ENXIO is no reader's: nothing
    is behind it (ENODEV), as behind the whiteout (0:0) anyone may make."""
    try:
        fd = open_no_mount(name, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC, directory)
    except OSError as e:
        if e.errno == errno.ENXIO and stat.S_ISCHR(seen.st_mode):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV)) from None
        raise
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (seen.st_dev, seen.st_ino):
            raise OSError(errno.EEXIST, "")
        _write_all(fd, data)
    finally:
        os.close(fd)
