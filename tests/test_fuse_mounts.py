"""Another user mounts a FUSE file system whose server never answers at a name
we are about to open or stat (an audit on 2026-11-26). fusermount lets any
user mount on a file or directory they own, so they can squat root's region
directory name in /dev/shm with a directory of theirs, or an oom_snapshot or
`snapshot -o` path in /tmp with a file of theirs, and mount there. Every open
or stat that crossed into it waited for ever (killable only): a root program's
first allocation, its OOM, root's CLI. Now such a name is refused (openat2's
RESOLVE_NO_XDEV, interpose/src/nomount.h and files.open_no_mount) before the
mounted file system is asked anything. A mount on a directory of a path
written (oom_snapshot, `snapshot -o`) or read (`replay`, `plot`), one they
made in /tmp or on a directory of root's they may write, held the lookup of
the name in it the same way: wherever it is, a FUSE mount whose user_id is
neither ours nor root's is refused; any other mount (only root makes those)
is crossed.

The mount is made here as fusermount would make it for uid 65534, by root
opening /dev/fuse and never reading it (not even FUSE_INIT is answered), or
with a server that answers (answering_mount), to tell a mount crossed from one
refused.
Everything that could wait runs in a child with a timeout, so a regression
fails the test instead of hanging it."""
from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import pytest
from conftest import ROOT, preload_env

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse to mount a FUSE file system as fusermount would")

ATTACKER = 65534
MS_NOSUID, MS_NODEV, MS_BIND, MNT_DETACH = 2, 4, 4096, 2
WAIT_S = 30  # a hang is a failure after this long


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount_fuse(path: Path, fd: int, user_id: int, subtype: str = "") -> None:
    """A FUSE file system served through fd on path, as fusermount mounts one
    for user_id (its user_id= names who made it), of type fuse.<subtype> and
    named subtype when one is given."""
    root_mode = "40000" if path.is_dir() else "100000"
    options = f"fd={fd},rootmode={root_mode},user_id={user_id},group_id={user_id},allow_other"
    fs_type = f"fuse.{subtype}" if subtype else "fuse"
    if _libc().mount((subtype or "npualloc-test").encode(), str(path).encode(), fs_type.encode(),
                     ctypes.c_ulong(MS_NOSUID | MS_NODEV), options.encode()) != 0:
        os.close(fd)
        pytest.skip(f"cannot mount a FUSE file system here: {os.strerror(ctypes.get_errno())}")


@pytest.fixture
def stalled_mount() -> Iterator[callable]:
    """mount(path): the attacker's name at path (a directory or file they
    own) gets a FUSE file system that never answers."""
    mounted: list[tuple[Path, int]] = []

    def mount(path: Path) -> None:
        fd = os.open("/dev/fuse", os.O_RDWR)
        _mount_fuse(path, fd, ATTACKER)
        mounted.append((path, fd))

    yield mount
    for path, fd in mounted:
        _libc().umount2(str(path).encode(), MNT_DETACH)
        os.close(fd)  # aborts the connection: anything still waiting gets ENOTCONN


FUSE_INIT, FUSE_FORGET, FUSE_INTERRUPT, FUSE_BATCH_FORGET = 26, 2, 36, 42
IN_HEADER = struct.Struct("=IIQQIII4x")  # fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid
OUT_HEADER = struct.Struct("=IiQ")  # fuse_out_header: len, error, unique
# fuse_init_out (protocol 7.31): major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, then unused words.
INIT_OUT = struct.Struct("=IIIIHHIIHH32x")


@pytest.fixture
def answering_mount() -> Iterator[callable]:
    """mount(path, user_id, subtype) -> the opcodes it was asked: a FUSE file
    system mounted as fusermount mounts one for user_id, whose server answers INIT
    and every request after it with EROFS, an answer only a file system that
    was entered gives. A failure in its server thread fails the test."""
    mounted: list[tuple[Path, int, threading.Thread]] = []
    stop = threading.Event()
    failures: list[BaseException] = []

    def serve(fd: int, asked: list[int]) -> None:
        try:
            while not stop.is_set():
                if not select.select([fd], [], [], 0.05)[0]:
                    continue
                request = os.read(fd, 1 << 20)
                _, opcode, unique, *_ = IN_HEADER.unpack_from(request)
                asked.append(opcode)
                if opcode == FUSE_INIT:
                    _, _, max_readahead = struct.unpack_from("=III", request, IN_HEADER.size)
                    body = INIT_OUT.pack(7, 31, max_readahead, 0, 0, 0, 4096, 1, 0, 0)
                    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)
                elif opcode not in (FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT):  # these take no answer
                    os.write(fd, OUT_HEADER.pack(OUT_HEADER.size, -errno.EROFS, unique))
        except OSError as e:
            if e.errno != errno.ENODEV:  # ENODEV: unmounted
                failures.append(e)
        except BaseException as e:
            failures.append(e)

    def mount(path: Path, user_id: int, subtype: str = "") -> list[int]:
        fd = os.open("/dev/fuse", os.O_RDWR)
        _mount_fuse(path, fd, user_id, subtype)
        asked: list[int] = []
        server = threading.Thread(target=serve, args=(fd, asked), daemon=True)
        server.start()
        mounted.append((path, fd, server))
        return asked

    yield mount
    for path, _, _ in mounted:
        _libc().umount2(str(path).encode(), MNT_DETACH)
    stop.set()
    for _, fd, server in mounted:
        server.join(timeout=WAIT_S)
        os.close(fd)
    assert not any(server.is_alive() for _, _, server in mounted), "a FUSE server thread did not stop"
    if failures:
        raise failures[0]


@pytest.fixture
def root_mount(tmp_path: Path) -> Iterator[callable]:
    """mount(path, kind): a file system that only root could have mounted on
    the directory path: a tmpfs, or a bind mount of a directory of root's (as
    `docker run -v host:/tmp/out` makes one)."""
    mounted: list[Path] = []

    def mount(path: Path, kind: str) -> None:
        source, fs_type, flags = ((b"npualloc-test", b"tmpfs", MS_NOSUID | MS_NODEV) if kind == "tmpfs"
                                  else (str(tmp_path).encode(), None, MS_BIND))
        if _libc().mount(source, str(path).encode(), fs_type, ctypes.c_ulong(flags), b"mode=0755") != 0:
            pytest.skip(f"cannot mount a {kind} here: {os.strerror(ctypes.get_errno())}")
        mounted.append(path)

    yield mount
    for path in mounted:
        _libc().umount2(str(path).encode(), MNT_DETACH)


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


REFUSED = "a directory on its path has a file system mounted on it that may be another user's (never entered; nothing {})"

USER_FILES = """
    import sys
    from npualloc.files import FileRefusedError, read_regular_file, write_user_file
    for path in sys.argv[1:]:
        for attempt in (lambda: write_user_file(path, b"x"), lambda: read_regular_file(path, 1 << 20).data):
            try:
                print("done", attempt())
            except FileRefusedError as e:
                print(e)
"""


def oom_with_snapshot_at(base: Path, target: Path) -> subprocess.CompletedProcess:
    proc = run(ALLOCATE, preload_env(NPUALLOC_SHM_DIR=str(base), NPUSIM_HBM_MB="64",
                                     PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{target}"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["first 0", "oom 207001"]
    return proc


def test_an_oom_snapshot_path_through_a_mount_others_could_make_is_left_alone(base: Path, stalled_mount) -> None:
    """The mount on a directory of the path, not on the name: another user
    made the directory in a sticky one everybody writes (here: the base) and
    mounted on it; the name's lookup in it waited for ever, holding the
    OOM'ing call."""
    directory = theirs(base / "snapshots", directory=True)
    stalled_mount(directory)
    target = directory / "oom.pickle"
    proc = oom_with_snapshot_at(base, target)
    assert f"oom_snapshot: cannot write {target}: {REFUSED.format('written')}" in proc.stderr


def test_a_mount_others_could_make_in_a_root_only_directory_is_left_alone(base: Path, stalled_mount) -> None:
    """fusermount asks write access to the mount point alone, not to the
    directory holding it: another user mounts on a 0777 directory of root's
    inside root's 0755 one. Judged only where others may write the holding
    directory, the mount was crossed and the name's lookup in it waited for
    ever, by oom_snapshot and the CLI's files alike."""
    holder = base / "root-only"
    holder.mkdir(mode=0o755)
    directory = holder / "drop"
    directory.mkdir()
    directory.chmod(0o777)
    stalled_mount(directory)
    target = directory / "oom.pickle"
    assert f"oom_snapshot: cannot write {target}: {REFUSED.format('written')}" in oom_with_snapshot_at(base,
                                                                                                     target).stderr
    proc = run(USER_FILES, args=[str(directory / "snap.pickle")])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"cannot write {directory}/snap.pickle: {REFUSED.format('written')}",
                                        f"cannot read {directory}/snap.pickle: {REFUSED.format('read')}"]


@pytest.mark.parametrize("holder_mode, kind", [(0o755, "tmpfs"), (0o1777, "tmpfs"), (0o1777, "bind")])
def test_a_mount_only_root_could_make_is_crossed(base: Path, root_mount, holder_mode: int, kind: str) -> None:
    """A mount that is no FUSE one is root's (in our mount namespace only root
    mounts, but for the FUSE mounts fusermount makes): crossed wherever it is,
    by oom_snapshot and the CLI's files alike, in a directory only root
    writes (as /mnt) and in a sticky one everybody writes (`docker run -v
    host:/tmp/out`), where it was refused as one another user could have
    made."""
    holder = base / "holder"
    holder.mkdir()
    holder.chmod(holder_mode)
    mounted = holder / "out"
    mounted.mkdir()
    root_mount(mounted, kind)
    target = mounted / "oom.pickle"
    assert f"out of memory: snapshot written to {target}" in oom_with_snapshot_at(base, target).stderr
    assert target.read_bytes()[:2] == b"\x80\x02"  # a pickle, protocol 2
    proc = run(USER_FILES, args=[str(mounted / "snap.pickle")])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["done None", "done b'x'"]


@pytest.mark.parametrize("subtype", ["", "a b," + "x" * 3000])
@pytest.mark.parametrize("user_id", [0, ATTACKER])
def test_a_fuse_mount_others_could_make_is_crossed_only_when_ours_or_roots(base: Path, answering_mount,
                                                                           user_id: int, subtype: str) -> None:
    """A FUSE mount names who made it (user_id=): ours or root's (we are
    root here) is crossed where everybody writes the directory holding it,
    and the lookup in it gets its server's answer (EROFS); another user's is
    refused though its server answers, as one that never answers is, and is
    asked nothing past INIT. Its maker chooses its subtype and name, which
    /proc/self/mountinfo shows before its options: a blank, a comma and
    3000 bytes of them change nothing."""
    directory = theirs(base / "fuse", directory=True) if user_id == ATTACKER else base / "fuse"
    directory.mkdir(exist_ok=True)
    asked = answering_mount(directory, user_id, subtype)
    target = directory / "oom.pickle"
    oom = oom_with_snapshot_at(base, target)
    files = run(USER_FILES, args=[str(directory / "snap.pickle")])
    assert files.returncode == 0, files.stderr
    if user_id == 0:
        assert f"oom_snapshot: cannot write {target}: {os.strerror(errno.EROFS)}" in oom.stderr
        assert files.stdout.splitlines() == [f"cannot write {directory}/snap.pickle: {os.strerror(errno.EROFS)}",
                                             f"cannot read {directory}/snap.pickle: {os.strerror(errno.EROFS)}"]
    else:
        assert f"oom_snapshot: cannot write {target}: {REFUSED.format('written')}" in oom.stderr
        assert files.stdout.splitlines() == [f"cannot write {directory}/snap.pickle: {REFUSED.format('written')}",
                                             f"cannot read {directory}/snap.pickle: {REFUSED.format('read')}"]
        assert set(asked) <= {FUSE_INIT}


def test_a_users_own_fuse_mount_in_a_directory_their_group_writes_is_theirs_to_cross(base: Path,
                                                                                    answering_mount) -> None:
    """A user's own sshfs mount in a directory of theirs that their group
    may write (RHEL's umask 002) is crossed by their CLI: its user_id is
    theirs (refused before, as any mount there). To root the same mount is
    another user's (above)."""
    user = 4242
    holder = base / "home"
    holder.mkdir()
    holder.chmod(0o775)
    mounted = holder / "sshfs"
    mounted.mkdir()
    for path in (holder, mounted):
        os.chown(path, user, user)
    answering_mount(mounted, user)
    # Their CLI: the interpreter and npualloc.files loaded as root (this
    # interpreter lies in root's home), then every uid and gid theirs.
    as_user = f"""
    import os
    import npualloc.files
    os.setgroups([])
    os.setresgid({user}, {user}, {user})
    os.setresuid({user}, {user}, {user})
"""
    proc = run(as_user + USER_FILES, args=[str(mounted / "snap.pickle")])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"cannot write {mounted}/snap.pickle: {os.strerror(errno.EROFS)}",
                                        f"cannot read {mounted}/snap.pickle: {os.strerror(errno.EROFS)}"]


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


def test_user_file_paths_through_a_mount_others_could_make_are_refused(base: Path, stalled_mount, root_mount) -> None:
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
    root_mount(holder / "data", "tmpfs")
    proc = run(USER_FILES, args=[str(directory / "snap.pickle"), str(holder / "data" / "snap.pickle"),
                                 str(base / "latest" / "snap.pickle"), str(base / "their-link" / "snap.pickle")])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"cannot write {directory}/snap.pickle: {REFUSED.format('written')}",
        f"cannot read {directory}/snap.pickle: {REFUSED.format('read')}",
        "done None", "done b'x'",
        f"cannot write {base}/latest/snap.pickle: a directory on its path is a symbolic link (never followed; "
        "nothing written)",
        "done b'x'",
        f"cannot write {base}/their-link/snap.pickle: a directory on its path is a symbolic link (never "
        "followed; nothing written)",
        f"cannot read {base}/their-link/snap.pickle: another user's link on its path leads to another file "
        "system, in a directory other users may write (never entered; nothing read)"]


def test_a_mount_point_swapped_for_a_link_after_its_check_is_not_followed(base: Path, stalled_mount,
                                                                         root_mount) -> None:
    """Reading follows links, but a mount point (no link when looked at) is
    opened without following one: another user may unmount their directory
    and put a link there between the look and the open, and the kernel
    followed it through their stalled mount and waited in it for ever. The
    swap is made here right after the look."""
    stalled = theirs(base / "stalled", directory=True)
    stalled_mount(stalled)
    swapped = base / "swapped"
    swapped.mkdir()
    root_mount(swapped, "tmpfs")
    try:
        proc = run(f"""
            import ctypes, os
            import npualloc.files as files
            looked = files._link_owner
            def look_then_swap(name, directory):
                owner = looked(name, directory)
                if name == "swapped":
                    assert ctypes.CDLL(None).umount2({str(swapped).encode()!r}, {MNT_DETACH}) == 0
                    os.rmdir({str(swapped)!r})
                    os.symlink({str(stalled / "sub")!r}, {str(swapped)!r})
                return owner
            files._link_owner = look_then_swap
            try:
                files.read_regular_file({str(swapped / "snap.pickle")!r}, 1 << 20)
            except files.FileRefusedError as e:
                print(e)
        """)
    finally:  # root_mount's unmount of the name would follow the link into the stalled mount
        if swapped.is_symlink():
            swapped.unlink()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"cannot read {swapped}/snap.pickle: {os.strerror(errno.ENOTDIR)}\n"


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
    refused = REFUSED.format("read")
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
