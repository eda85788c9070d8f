"""Another user mounts a FUSE file system whose server never answers at a name
we are about to open or stat (an audit on 2026-11-26). fusermount lets any
user mount on a file or directory they own, so they can squat root's region
directory name in /dev/shm with a directory of theirs, or an oom_snapshot or
`snapshot -o` path in /tmp with a file of theirs, and mount there. Every open
or stat that crossed into it waited for ever (killable only): a root program's
first allocation, its OOM, root's CLI. Now such a name is refused (openat2's
RESOLVE_NO_XDEV, interpose/src/nomount.h and files.open_no_mount) before the
mounted file system is asked anything. A mount on a directory of an
oom_snapshot or `snapshot -o` path, one they made in /tmp, held the lookup of
the name in it the same way: it is refused where other users may write the
directory holding it, and crossed elsewhere.

The mount is made here as fusermount would make it for uid 65534, by root
opening /dev/fuse and never reading it (not even FUSE_INIT is answered).
Everything that could wait runs in a child with a timeout, so a regression
fails the test instead of hanging it."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
from conftest import ROOT, preload_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse to mount a FUSE file system as fusermount would")

ATTACKER = 65534
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
WAIT_S = 30  # a hang is a failure after this long


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@pytest.fixture
def stalled_mount() -> Iterator[callable]:
    """mount(path): the attacker's name at path (a directory or file they
    own) gets a FUSE file system that never answers."""
    mounted: list[tuple[Path, int]] = []

    def mount(path: Path) -> None:
        fd = os.open("/dev/fuse", os.O_RDWR)
        root_mode = "40000" if path.is_dir() else "100000"
        options = f"fd={fd},rootmode={root_mode},user_id={ATTACKER},group_id={ATTACKER},allow_other"
        if _libc().mount(b"stalled", str(path).encode(), b"fuse", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
                         options.encode()) != 0:
            os.close(fd)
            pytest.skip(f"cannot mount a FUSE file system here: {os.strerror(ctypes.get_errno())}")
        mounted.append((path, fd))

    yield mount
    for path, fd in mounted:
        _libc().umount2(str(path).encode(), MNT_DETACH)
        os.close(fd)  # aborts the connection: anything still waiting gets ENOTCONN


def theirs(path: Path, directory: bool) -> Path:
    if directory:
        path.mkdir(mode=0o700)
    else:
        path.write_bytes(b"")
    os.chown(path, ATTACKER, ATTACKER)
    return path


def run(code: str, env: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *(args or [])], env=env or dict(os.environ),
                          cwd=ROOT, capture_output=True, text=True, timeout=WAIT_S)


ALLOCATE = """
    import acl, sys
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    ptr, ret = acl.rt.malloc(1 << 20, 0)
    print("first", ret, flush=True)
    ptr, ret = acl.rt.malloc(1 << 30, 0)   # past NPUSIM_HBM_MB: an OOM
    print("oom", ret, flush=True)
"""


def test_a_mount_on_the_region_directory_name_is_never_entered(base: Path, stalled_mount) -> None:
    stalled_mount(theirs(base / "npualloc-0", directory=True))
    proc = run(ALLOCATE, preload_env(NPUALLOC_SHM_DIR=str(base), NPUSIM_HBM_MB="64"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first 0", "oom 207001"]
    assert "npualloc-0 has a file system mounted on it (never entered)" in proc.stderr
    # Its live stats went to a directory of its own beside the taken name.
    assert [p.name.startswith("npualloc-0.") for p in base.iterdir() if p.name != "npualloc-0"] == [True]


def test_an_oom_snapshot_path_with_a_mount_on_it_is_left_alone(base: Path, stalled_mount) -> None:
    target = theirs(base / "oom.pickle", directory=False)
    stalled_mount(target)
    proc = run(ALLOCATE, preload_env(NPUALLOC_SHM_DIR=str(base), NPUSIM_HBM_MB="64",
                                     PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{target}"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first 0", "oom 207001"]
    assert f"oom_snapshot: cannot write {target}: a file system is mounted on it (never entered" in proc.stderr


def test_an_oom_snapshot_path_through_a_mount_others_could_make_is_left_alone(base: Path, stalled_mount) -> None:
    """The mount on a directory of the path, not on the name: another user
    made the directory in a sticky one everybody writes (here: the base) and
    mounted on it; the name's lookup in it waited for ever, holding the
    OOM'ing call."""
    directory = theirs(base / "snapshots", directory=True)
    stalled_mount(directory)
    target = directory / "oom.pickle"
    proc = run(ALLOCATE, preload_env(NPUALLOC_SHM_DIR=str(base), NPUSIM_HBM_MB="64",
                                     PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{target}"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first 0", "oom 207001"]
    assert (f"oom_snapshot: cannot write {target}: a directory on its path has a file system mounted on it, in a "
            "directory other users may write (never entered; nothing written)") in proc.stderr


def test_an_oom_snapshot_path_through_a_mount_only_we_or_root_could_make_is_written(base: Path) -> None:
    """A mount on a directory in one that only root writes (as /, /mnt) is
    crossed, as any path may cross mounts: only where other users could have
    made it is it refused."""
    holder = base / "root-only"
    holder.mkdir(mode=0o755)
    mounted = holder / "data"
    mounted.mkdir()
    if _libc().mount(b"npualloc-test", str(mounted).encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
                     b"mode=0755") != 0:
        pytest.skip(f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())}")
    try:
        target = mounted / "oom.pickle"
        proc = run(ALLOCATE, preload_env(NPUALLOC_SHM_DIR=str(base), NPUSIM_HBM_MB="64",
                                         PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{target}"))
        assert proc.returncode == 0, proc.stderr
        assert f"out of memory: snapshot written to {target}" in proc.stderr
        assert target.read_bytes()[:2] == b"\x80\x02"  # a pickle, protocol 2
    finally:
        _libc().umount2(str(mounted).encode(), MNT_DETACH)


def test_user_files_with_a_mount_on_them_are_refused(base: Path, stalled_mount) -> None:
    target = theirs(base / "snap.pickle", directory=False)
    stalled_mount(target)
    proc = run("""
        import sys
        from npualloc.files import FileRefusedError, read_regular_file, write_user_file
        for attempt in (lambda: write_user_file(sys.argv[1], b"x"), lambda: read_regular_file(sys.argv[1], 1 << 20)):
            try:
                attempt()
            except FileRefusedError as e:
                print(e)
    """, args=[str(target)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"cannot write {target}: a file system is mounted on it (never entered; "
                                        "left as it is)",
                                        f"cannot read {target}: a file system is mounted on it (never entered; "
                                        "left as it is)"]


def test_user_file_paths_through_a_mount_others_could_make_are_refused(base: Path, stalled_mount) -> None:
    """`snapshot -o`, dump_snapshot and `plot -o` as oom_snapshot above, and
    the files `replay`, `plot` and snapshot.load read: the lookup of the name
    in another user's mount on a directory of the path held root's CLI for
    ever; a mount only root could have made is crossed. Reading still
    follows a link of ours on the way (in the sticky base) to another mount,
    but not another user's there: with fs.protected_symlinks off, it let
    them lead us into their mount all the same."""
    directory = theirs(base / "snapshots", directory=True)
    stalled_mount(directory)
    holder = base / "root-only"
    holder.mkdir(mode=0o755)
    (holder / "data").mkdir()
    (base / "latest").symlink_to(holder / "data")
    (base / "their-link").symlink_to(holder / "data")
    os.lchown(base / "their-link", ATTACKER, ATTACKER)
    if _libc().mount(b"npualloc-test", str(holder / "data").encode(), b"tmpfs",
                     ctypes.c_ulong(MS_NOSUID | MS_NODEV), b"mode=0755") != 0:
        pytest.skip(f"cannot mount a tmpfs here: {os.strerror(ctypes.get_errno())}")
    try:
        proc = run("""
            import sys
            from npualloc.files import FileRefusedError, read_regular_file, write_user_file
            for path in sys.argv[1:]:
                for attempt in (lambda: write_user_file(path, b"x"), lambda: read_regular_file(path, 1 << 20).data):
                    try:
                        print("done", attempt())
                    except FileRefusedError as e:
                        print(e)
        """, args=[str(directory / "snap.pickle"), str(holder / "data" / "snap.pickle"),
                   str(base / "latest" / "snap.pickle"), str(base / "their-link" / "snap.pickle")])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines() == [
            f"cannot write {directory}/snap.pickle: a directory on its path has a file system mounted on it, in a "
            "directory other users may write (never entered; nothing written)",
            f"cannot read {directory}/snap.pickle: a directory on its path has a file system mounted on it, in a "
            "directory other users may write (never entered; nothing read)",
            "done None", "done b'x'",
            f"cannot write {base}/latest/snap.pickle: a directory on its path is a symbolic link (never followed; "
            "nothing written)",
            "done b'x'",
            f"cannot write {base}/their-link/snap.pickle: a directory on its path is a symbolic link (never "
            "followed; nothing written)",
            f"cannot read {base}/their-link/snap.pickle: another user's link on its path leads to another file "
            "system, in a directory other users may write (never entered; nothing read)"]
    finally:
        _libc().umount2(str(holder / "data").encode(), MNT_DETACH)


def test_a_path_to_read_ending_in_a_slash_is_walked_as_any_other(base: Path, stalled_mount) -> None:
    """`plot DIR/` or `replay DIR/`: a path with no file name, refused as no
    regular file, was opened in one os.open: the open of another user's
    stalled FUSE mount itself, or the lookup of a name in it, held root's
    CLI for ever, where the same path with a file name is refused."""
    directory = theirs(base / "snapshots", directory=True)
    stalled_mount(directory)
    proc = run("""
        import sys
        from npualloc.files import FileRefusedError, read_regular_file
        for path in sys.argv[1:]:
            try:
                read_regular_file(path, 1 << 20)
            except FileRefusedError as e:
                print(e)
    """, args=[f"{directory}/", f"{directory}/inner/", f"{base}/"])
    assert proc.returncode == 0, proc.stderr
    refused = ("a directory on its path has a file system mounted on it, in a directory other users may write "
               "(never entered; nothing read)")
    assert proc.stdout.splitlines() == [
        f"cannot read {directory}/: {refused}",
        f"cannot read {directory}/inner/: {refused}",
        f"cannot read {base}/: not a regular file (file type 'd'; a FIFO or device is never read)"]


def test_the_reader_never_opens_a_region_name_with_a_mount_on_it(base: Path, stalled_mount, sleeper: int) -> None:
    """A mount made after the listing read /proc/self/mountinfo (here: the
    reader is handed the directory directly) is refused by the open itself."""
    directory = base / f"npualloc-{ATTACKER}"
    theirs(directory, directory=True)
    stalled_mount(theirs(directory / f"npualloc.{sleeper}", directory=False))
    proc = run("""
        import os, sys
        from npualloc._ffi import ffi, reader_library
        fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
        file = ffi.new("npualloc_region_file *")
        verdict = reader_library().npualloc_reader_open(fd, sys.argv[2].encode(), int(sys.argv[3]), 0, file)
        print(verdict, os.strerror(file.error))
    """, args=[str(directory), f"npualloc.{sleeper}", str(ATTACKER)])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(" ", 1) == ["1", os.strerror(18) + "\n"]  # NPUALLOC_OPEN_ERRNO, EXDEV


def test_a_listing_never_stats_a_region_name_mounted_after_it_read_mountinfo(base: Path, stalled_mount,
                                                                            sleeper: int) -> None:
    """The listing's own lstat of each name (for its inode) came before the
    reader's refusing open: a mount made just after /proc/self/mountinfo was
    read (simulated: the listing finds no mounts there) held root's `ls` and
    the exporter (a review of this change). It is refused like the open."""
    directory = base / f"npualloc-{ATTACKER}"
    theirs(directory, directory=True)
    stalled_mount(theirs(directory / f"npualloc.{sleeper}", directory=False))
    proc = run("""
        from npualloc import region
        region._mounted_names = lambda fd: set()
        print([entry.pid for entry, _ in region.live_regions()])
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[]\n"
