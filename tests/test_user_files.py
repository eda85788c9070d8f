"""Paths a user names, attacked (issue 11 item 1, Python side): `snapshot -o`,
`dump_snapshot` and `plot -o` write through npualloc.files.write_user_file,
which never follows a link and never replaces what is not our regular file;
`replay`, `plot` and snapshot.load read through read_regular_file, which never
blocks on a FIFO. run_cli's timeout bounds every command: a hang fails the test."""
from __future__ import annotations

import errno
import gzip
import os
import pickle
import re
import stat
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from region_helpers import Workload, assert_one_line_error, cli_with_trigger, drain_fifo, run_cli

import npualloc
from npualloc.files import FileRefusedError, read_regular_file, write_user_file
from npualloc.snapshot import loads

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mknod and files of another user")
SNAPSHOT = pickle.dumps({"segments": [], "device_traces": [[]]})


def test_a_new_file_is_ours_and_private(tmp_path: Path) -> None:
    target = tmp_path / "new.pickle"
    write_user_file(target, b"data")
    assert target.read_bytes() == b"data" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["new.pickle"]  # no temporary left behind


@pytest.mark.parametrize("replace", [False, True])
def test_things_planted_at_the_old_temporary_name_neither_block_nor_suffer(tmp_path: Path, replace: bool) -> None:
    """"<name>.tmp.<pid>" was the temporary's whole name, and anyone sees the
    pid: a file planted there made every write fail (O_EXCL). The name now
    ends in random characters; what was planted stays as it was."""
    target = tmp_path / "out.pickle"
    if replace:
        target.write_bytes(b"an older snapshot")
    planted = tmp_path / f"out.pickle.tmp.{os.getpid()}"
    planted.mkdir()
    write_user_file(target, b"data")
    assert target.read_bytes() == b"data" and planted.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, planted.name])


def test_a_temporary_name_taken_is_tried_again_never_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each taken random name costs a try; only when all are taken does the
    write fail, and nothing at them is removed."""
    target, planted = tmp_path / "out.pickle", tmp_path / f"out.pickle.tmp.{os.getpid()}.0badf00d"
    planted.mkdir()
    names = iter(["0badf00d", "0badf00d", "5eed5eed"])
    monkeypatch.setattr("npualloc.files.secrets.token_hex", lambda _: next(names))
    write_user_file(target, b"data")
    assert target.read_bytes() == b"data" and sorted(p.name for p in tmp_path.iterdir()) == [target.name, planted.name]
    monkeypatch.setattr("npualloc.files.secrets.token_hex", lambda _: "0badf00d")
    with pytest.raises(FileRefusedError, match="every temporary name tried beside it was taken"):
        write_user_file(target, b"new")
    assert target.read_bytes() == b"data" and planted.is_dir()


def test_a_name_with_no_room_for_the_temporary_says_so(tmp_path: Path) -> None:
    name = "x" * 250  # a valid name; with ".tmp.<pid>.<8 hex>" past 255 bytes, whatever the pid
    with pytest.raises(FileRefusedError, match="its name leaves no room for the temporary's suffix"):
        write_user_file(tmp_path / name, b"data")
    assert list(tmp_path.iterdir()) == []


def test_our_own_regular_file_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "old.pickle"
    target.write_bytes(b"an older snapshot, longer than the new one")
    write_user_file(target, b"new")
    assert target.read_bytes() == b"new"


def test_a_link_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "out.pickle"
    link.symlink_to(victim)
    with pytest.raises(FileRefusedError, match="symbolic link"):
        write_user_file(link, b"data")
    assert link.is_symlink() and os.readlink(link) == str(victim) and victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pickle", "victim"]


def test_a_link_on_the_way_is_never_followed(tmp_path: Path) -> None:
    """A directory on the path that another user replaced by a link (to a
    directory only root may write, say) is refused, not written into: what
    is behind the link stays as it was."""
    behind = tmp_path / "root-only"
    behind.mkdir(mode=0o700)
    (behind / "out.pickle").write_text("precious\n")
    (tmp_path / "jobs").symlink_to(behind)
    with pytest.raises(FileRefusedError, match="a directory on its path is a symbolic link"):
        write_user_file(tmp_path / "jobs" / "out.pickle", b"data")
    assert sorted(p.name for p in behind.iterdir()) == ["out.pickle"]
    assert (behind / "out.pickle").read_text() == "precious\n"


def test_a_relative_path_through_real_directories_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    write_user_file("a//b/./out.pickle", b"data")
    assert (tmp_path / "a" / "b" / "out.pickle").read_bytes() == b"data"


def test_a_directory_is_left_alone(tmp_path: Path) -> None:
    with pytest.raises(FileRefusedError, match="Is a directory"):
        write_user_file(tmp_path, b"data")
    assert tmp_path.is_dir()


def test_a_fifo_without_a_reader_gets_nothing_and_no_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo, 0o666)
    with pytest.raises(FileRefusedError, match="a FIFO with no reader"):
        write_user_file(fifo, b"data")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@needs_root
def test_another_users_fifo_is_left_alone(tmp_path: Path) -> None:
    """Anyone may plant a FIFO in /tmp to read what is written to it."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo, 0o666)
    os.chown(fifo, 65534, 65534)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(FileRefusedError, match="it belongs to another user"):
            write_user_file(fifo, b"secret")
        try:
            received = os.read(reader, 64)  # no writer ever came: end of file
        except BlockingIOError:
            received = b""
        assert received == b""
    finally:
        os.close(reader)


def test_a_fifo_read_a_page_at_a_time_is_given_up(tmp_path: Path) -> None:
    """A reader taking 4 KiB twice a second keeps making progress, but the
    writer gives up after 5 s in all, not 5 s without progress."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    received = bytearray()
    with ThreadPoolExecutor(1) as pool:
        try:
            reading = pool.submit(drain_fifo, reader, received, 4096, 0.5)
            with pytest.raises(FileRefusedError, match="did not take it within 5 s"):
                write_user_file(fifo, bytes(1 << 20))
            reading.result(timeout=120)
        finally:
            os.close(reader)
    assert 0 < len(received) < 1 << 20


def test_a_fifo_with_a_reader_is_written_to(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    data = os.urandom(3 << 20)  # more than a pipe holds: the writer waits for the reader
    received = bytearray()
    with ThreadPoolExecutor(1) as pool:
        try:
            reading = pool.submit(drain_fifo, reader, received)
            write_user_file(fifo, data)
            reading.result(timeout=120)  # re-raises a failure of the reader thread
        finally:
            os.close(reader)
    assert bytes(received) == data
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@needs_root
def test_a_character_device_is_written_to_not_replaced(tmp_path: Path) -> None:
    """/dev/null as torch means it, on a null device of our own (never the machine's)."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    write_user_file(null, b"data")
    info = os.lstat(null)
    assert stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(1, 3)
    assert [p.name for p in tmp_path.iterdir()] == ["null"]


@needs_root
def test_a_device_with_no_driver_is_not_called_a_fifo(tmp_path: Path) -> None:
    """A whiteout (character device 0:0), which any user may make: its open
    finds nothing behind it (ENXIO), once reported as a FIFO with no reader."""
    whiteout = tmp_path / "out.pickle"
    os.mknod(whiteout, 0o666 | stat.S_IFCHR, os.makedev(0, 0))
    with pytest.raises(FileRefusedError, match=f"^cannot write {whiteout}: {os.strerror(errno.ENODEV)}$"):
        write_user_file(whiteout, b"data")
    assert os.lstat(whiteout).st_rdev == os.makedev(0, 0)


@needs_root
def test_another_users_file_is_left_alone(tmp_path: Path) -> None:
    theirs = tmp_path / "out.pickle"
    theirs.write_text("theirs\n")
    os.chown(theirs, 65534, 65534)
    with pytest.raises(FileRefusedError, match="belongs to another user"):
        write_user_file(theirs, b"data")
    assert theirs.read_text() == "theirs\n" and theirs.stat().st_uid == 65534


@needs_root
def test_a_block_device_is_left_alone(tmp_path: Path) -> None:
    device = tmp_path / "disk"
    os.mknod(device, 0o600 | stat.S_IFBLK, os.makedev(7, 200))
    with pytest.raises(FileRefusedError, match="not a regular file, FIFO or character device"):
        write_user_file(device, b"data")
    assert stat.S_ISBLK(os.lstat(device).st_mode)


# ---------------------------------------------------------------- every writer uses it

def test_snapshot_command_refuses_a_link_and_writes_a_fifo(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "snap.pickle"
    link.symlink_to(victim)
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        done = cli_with_trigger(w, tmp_path, ["snapshot", str(w.pid), "-o", str(link)], "malloc(512)")
        assert_one_line_error(done, 1, f"cannot write {link}: it is a symbolic link")
        assert victim.read_text() == "precious\n" and link.is_symlink()
        fifo = tmp_path / "snap.fifo"
        os.mkfifo(fifo, 0o600)
        done = cli_with_trigger(w, tmp_path, ["snapshot", str(w.pid), "-o", str(fifo)], "malloc(512)")
        assert_one_line_error(done, 1, f"cannot write {fifo}: a FIFO with no reader")


def test_dump_snapshot_refuses_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "snap.pickle"
    link.symlink_to(victim)
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        with pytest.raises(AssertionError, match="FileRefusedError: cannot write .*symbolic link"):
            w.call(f"npualloc.dump_snapshot({str(link)!r})")
        w.call(f"npualloc.dump_snapshot({str(tmp_path / 'ours.pickle')!r})")
    assert victim.read_text() == "precious\n" and link.is_symlink()
    assert len(npualloc.snapshot.load(tmp_path / "ours.pickle")["segments"]) == 1


def test_plot_output_refuses_a_link(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(SNAPSHOT)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "plot.png"
    link.symlink_to(victim)
    assert_one_line_error(run_cli(["plot", str(snap), "-o", str(link)], tmp_path), 1,
                          f"cannot write {link}: it is a symbolic link")
    assert victim.read_text() == "precious\n"


# ---------------------------------------------------------------- every reader uses the safe open

@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_a_fifo_nobody_writes_to_is_refused_not_waited_on(tmp_path: Path, command: list[str]) -> None:
    fifo = tmp_path / "trace.pickle"
    os.mkfifo(fifo, 0o666)
    args = [a.format(path=fifo, out=tmp_path / "p.png") for a in command]
    assert_one_line_error(run_cli(args, tmp_path, timeout=60), 1, f"cannot read {fifo}: not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and not (tmp_path / "p.png").exists()


def test_the_loader_refuses_a_fifo_and_a_link(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo, 0o666)
    with pytest.raises(FileRefusedError, match="not a regular file"):
        npualloc.snapshot.load(fifo)
    real = tmp_path / "snap.pickle"
    real.write_bytes(SNAPSHOT)
    link = tmp_path / "link.pickle"
    link.symlink_to(real)
    with pytest.raises(FileRefusedError, match="symbolic link"):
        npualloc.snapshot.load(link)
    assert loads(read_regular_file(real, npualloc._snapshot_check.MAX_SNAPSHOT_BYTES).data) == npualloc.snapshot.load(real)


def test_the_loader_refuses_a_gzip_bomb_and_a_corrupt_gzip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzip file that inflates past MAX_SNAPSHOT_BYTES is refused before it
    takes that memory (here a 1 MiB limit and 2 MiB of zeros), and a corrupt
    one is an error naming the file, never a traceback."""
    monkeypatch.setattr(npualloc._snapshot_check, "MAX_SNAPSHOT_BYTES", 1 << 20)
    bomb = tmp_path / "bomb.pickle.gz"
    bomb.write_bytes(gzip.compress(bytes(2 << 20)))
    with pytest.raises(npualloc.NpuallocError, match="inflates to more than 1 MiB"):
        npualloc.snapshot.load(bomb)
    fits = tmp_path / "fits.pickle.gz"
    fits.write_bytes(gzip.compress(SNAPSHOT))
    assert npualloc.snapshot.load(fits)["segments"] == []
    corrupt = tmp_path / "corrupt.pickle.gz"
    corrupt.write_bytes(gzip.compress(SNAPSHOT)[:10] + b"\xff" * 8)  # the header, then an invalid block
    with pytest.raises(npualloc.NpuallocError, match=f"{corrupt}: not a gzip file"):
        npualloc.snapshot.load(corrupt)


def test_a_file_past_the_limit_is_refused_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse file costs its maker nothing however large: the loader refuses
    anything past MAX_SNAPSHOT_BYTES from its size, before reading it."""
    monkeypatch.setattr(npualloc._snapshot_check, "MAX_SNAPSHOT_BYTES", 1 << 20)
    sparse = tmp_path / "huge.pickle"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    with pytest.raises(FileRefusedError, match=f"cannot read {sparse}: larger than 1 MiB"):
        npualloc.snapshot.load(sparse)


def assert_refused(tmp_path: Path, path: Path, command: list[str], load_match: str, cli_says: str,
                   timeout: float = 60) -> None:
    """snapshot.load refuses path, its message matching load_match, and the
    command (replay or plot, {path} and {out} filled in) says cli_says in one
    line, exit 1."""
    with pytest.raises(npualloc.NpuallocError, match=load_match):
        npualloc.snapshot.load(path)
    args = [a.format(path=path, out=tmp_path / "p.png") for a in command]
    assert_one_line_error(run_cli(args, tmp_path, timeout=timeout), 1, cli_says)


@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_a_snapshot_naming_one_trace_many_times_is_refused(tmp_path: Path, command: list[str]) -> None:
    """The pickle's memo lets one list be named any number of times: 200 KB
    that unpickle into a trace of 10^8 entries, which plot and replay walked
    until memory ran out. Counted as reached, they are refused at once."""
    trace = [{"action": "alloc", "addr": 4096 * i, "size": 512, "stream": 0, "frames": []} for i in range(10_000)]
    bomb = tmp_path / "bomb.pickle"
    bomb.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace] * 10_000}))
    assert bomb.stat().st_size < 1 << 20
    assert_refused(tmp_path, bomb, command, re.escape("device_traces[1] is a list named twice"),
                   "is a list named twice", timeout=120)


def test_a_snapshot_holds_as_many_entries_as_its_bytes_allow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MIN_SNAPSHOT_ENTRIES (1000 here), a snapshot may hold one entry per
    SNAPSHOT_BYTES_PER_ENTRY bytes: 2000 entries of their own load (a long
    recorded history is a large file), 2000 names of one entry are refused
    (2 bytes each in the pickle)."""
    monkeypatch.setattr(npualloc._snapshot_check, "MIN_SNAPSHOT_ENTRIES", 1000)
    own = tmp_path / "own.pickle"
    own.write_bytes(pickle.dumps({"segments": [], "device_traces": [
        [{"action": "alloc", "addr": 512 * i, "size": 512, "stream": 0, "frames": []} for i in range(2000)]]}))
    assert len(npualloc.snapshot.load(own)["device_traces"][0]) == 2000
    entry = {"action": "alloc", "addr": 0, "size": 512, "stream": 0, "frames": []}
    named = tmp_path / "named.pickle"
    named.write_bytes(pickle.dumps({"segments": [], "device_traces": [[entry] * 2000]}))
    with pytest.raises(npualloc.NpuallocError, match="more than 1,000 segments, blocks and trace entries for its size"):
        npualloc.snapshot.load(named)


@pytest.mark.parametrize("snapshot, where", [
    ({"segments": [1]}, "segments[0] is int"),
    ({"segments": {}}, "segments is dict"),
    ({"segments": [{"address": 0, "total_size": "zz", "blocks": []}]}, "segments[0]['total_size'] is str"),
    ({"segments": [{"address": 0, "total_size": 1, "blocks": [{"size": 1}]}]}, "segments[0]['blocks'][0]['state'] is NoneType"),
    ({"device_traces": [[1]]}, "device_traces[0][0] is int"),
    ({"device_traces": [[{"action": "alloc", "addr": 0, "size": "zz"}]]}, "device_traces[0][0]['size'] is str"),
    ({"device_traces": [[{"action": "alloc", "addr": 0, "size": 1, "frames": 3}]]},
     "device_traces[0][0]['frames'] is int"),
])
def test_a_snapshot_of_the_wrong_shape_is_refused_with_where(tmp_path: Path, snapshot: dict, where: str) -> None:
    """Fields plot, replay and memory_viz read, of another kind than torch's:
    one line naming the field, exit 1, never a traceback or a usage error."""
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    with pytest.raises(npualloc.NpuallocError, match=re.escape(f"not a memory snapshot: {where}")):
        npualloc.snapshot.load(path)
    assert_one_line_error(run_cli(["plot", str(path), "-o", str(tmp_path / "p.png")], tmp_path), 1, where)


def _alloc(**fields: int) -> dict:
    return {"action": "alloc", "addr": 0, "size": 512, **fields}


@pytest.mark.parametrize("snapshot, where", [
    ({"device_traces": [[{"action": "alloc", "addr": 0}]]}, "device_traces[0][0]['size'] is NoneType"),
    ({"device_traces": [[_alloc(size=-1)]]}, "device_traces[0][0]['size'] is negative"),
    ({"device_traces": [[_alloc(size=1 << 64)]]}, "device_traces[0][0]['size'] is past 2**64 - 1"),
    ({"device_traces": [[_alloc(time_us=0), _alloc(addr=512, time_us=1 << 1100)]]},
     "device_traces[0][1]['time_us'] is past 2**64 - 1"),
    ({"segments": [{"address": 0, "total_size": 1 << 1100, "blocks": []}], "device_traces": [[_alloc()]]},
     "segments[0]['total_size'] is past 2**64 - 1"),
])
@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_a_snapshot_field_outside_torchs_range_is_refused(tmp_path: Path, snapshot: dict, where: str,
                                                         command: list[str]) -> None:
    """Sizes, addresses and times are unsigned 64-bit in torch's snapshots
    (and memory_viz reads every trace entry's addr and size): a field missing
    or outside that range was a traceback, replay's struct.pack refusing it
    (or a KeyError for the size) and plot's float division overflowing. One
    line naming the field, exit 1."""
    path = tmp_path / "bad.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    assert_refused(tmp_path, path, command, re.escape(f"not a memory snapshot: {where}"), where)


@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_torchs_oom_entry_has_device_free_in_place_of_addr(tmp_path: Path, command: list[str]) -> None:
    """torch writes an OOM trace entry's address field as device_free, with
    no addr (its snapshot code, both the dict and the pickled one): requiring addr in every entry
    refused every torch snapshot that saw an OOM. An OOM entry needs
    device_free instead, in torch's unsigned 64 bits like the rest."""
    oom = {"action": "oom", "device_free": 1 << 20, "size": 1 << 30, "stream": 0, "time_us": 2}
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_alloc(time_us=1), oom]]}))
    assert npualloc.snapshot.load(path)["device_traces"][0][1] == oom
    args = [a.format(path=path, out=tmp_path / "p.png") for a in command]
    proc = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    path.write_bytes(pickle.dumps({"device_traces": [[{**oom, "device_free": -1}]]}))
    with pytest.raises(npualloc.NpuallocError, match=re.escape("device_traces[0][0]['device_free'] is negative")):
        npualloc.snapshot.load(path)


@pytest.mark.parametrize("data, why", [
    (b"\x80\x02}Na.", "'dict' object has no attribute 'append'"),  # APPEND to a dict
    (b"\x80\x04\x95" + (1 << 63).to_bytes(8, "little"), "FRAME length exceeds"),
])
@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_a_pickle_the_unpickler_breaks_on_is_one_line(tmp_path: Path, data: bytes, why: str,
                                                     command: list[str]) -> None:
    """The unpickler raises AttributeError for an opcode applied to the
    wrong kind of object, and OverflowError for a length past the machine's:
    both came out of the loader as tracebacks (found by mutating snapshot
    pickles byte by byte)."""
    path = tmp_path / "broken.pickle"
    path.write_bytes(data)
    assert_refused(tmp_path, path, command, re.escape(f"{path}: not a memory snapshot pickle ({why}"), why)


@pytest.mark.parametrize("command", [["replay", "{path}", "--no-search"], ["plot", "{path}", "-o", "{out}"]])
def test_a_pickle_asking_for_more_memory_than_there_is_is_one_line(tmp_path: Path, command: list[str]) -> None:
    """A few bytes of pickle may ask the unpickler for any amount of memory:
    this one's BINBYTES8 says 2**62 bytes follow, which no malloc gives, and
    the MemoryError came out of the loader as a traceback."""
    path = tmp_path / "greedy.pickle"
    path.write_bytes(b"\x80\x04\x8e" + (1 << 62).to_bytes(8, "little") + b"x.")
    assert_refused(tmp_path, path, command, f"{path}: out of memory while unpickling it",
                   "out of memory while unpickling it")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
def test_another_users_snapshot_is_loaded_on_trial_with_bounded_memory(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty list per byte unpickles into 64 times the bytes: a file of
    another user's is loaded first in a child whose memory is capped (here
    256 MiB against 16 million lists, about 1 GB), and refused when that
    fails; a real one loads as it would from our own file."""
    monkeypatch.setattr(npualloc.snapshot, "FOREIGN_SNAPSHOT_MEMORY", 256 << 20)
    lists = 16 << 20
    bomb = tmp_path / "bomb.pickle.gz"
    bomb.write_bytes(gzip.compress(b"\x80\x02}(X\x08\x00\x00\x00segments](" + b"]" * lists + b"eu."))
    fine = tmp_path / "fine.pickle"
    fine.write_bytes(SNAPSHOT)
    for path in (bomb, fine):
        os.chown(path, 65534, 65534)
    with pytest.raises(npualloc.NpuallocError, match=f"{bomb}: it unpickles into more than 256 MiB"):
        npualloc.snapshot.load(bomb)
    assert npualloc.snapshot.load(fine) == loads(SNAPSHOT)


def _colliding_keys_pickle(count: int) -> bytes:
    """A snapshot-shaped pickle with one dict of count int keys that all hash
    to 0 (multiples of 2**61 - 1), written opcode by opcode: building it as a
    dict here would take the quadratic time it makes the loader take."""
    def text(s: str) -> bytes:
        return b"\x8c" + bytes([len(s)]) + s.encode()  # SHORT_BINUNICODE

    def long1(value: int) -> bytes:
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw  # LONG1

    step = (1 << 61) - 1
    keys = b"".join(long1(k * step) + b"K\x00" for k in range(1, count + 1))  # key, BININT1 0
    return b"\x80\x04}(" + text("segments") + b"]" + text("x") + b"}(" + keys + b"uu."


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
def test_the_trial_load_is_bounded_in_time_and_imports_nothing_from_here(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Colliding dict keys unpickle in quadratic time: the trial child's CPU is
    capped (1 s here; 40 000 keys take far longer), and neither it nor this
    process loads the file. A pickle.py in the current directory (such files
    lie in /tmp, where anyone may put one) is not imported by the child."""
    monkeypatch.setattr(npualloc.snapshot, "FOREIGN_SNAPSHOT_CPU_S", 1)
    slow = tmp_path / "slow.pickle"
    slow.write_bytes(_colliding_keys_pickle(40_000))
    planted = tmp_path / "pickle.py"
    planted.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    fine = tmp_path / "fine.pickle"
    fine.write_bytes(SNAPSHOT)
    for path in (slow, fine):
        os.chown(path, 65534, 65534)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(npualloc.NpuallocError, match=f"{slow}: it takes more than 1 s of CPU to unpickle"):
        npualloc.snapshot.load(slow)
    assert npualloc.snapshot.load(fine) == loads(SNAPSHOT)
    assert not (tmp_path / "ran").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file another user owns")
def test_the_trial_load_works_under_a_lower_hard_memory_limit(tmp_path: Path) -> None:
    """A process whose hard data limit is below FOREIGN_SNAPSHOT_MEMORY may not
    raise it for the child: the child gets that lower limit, and loads."""
    fine = tmp_path / "fine.pickle"
    fine.write_bytes(SNAPSHOT)
    os.chown(fine, 65534, 65534)
    script = f"import npualloc.snapshot as s; print(sorted(s.load({str(fine)!r})))"
    done = subprocess.run(["sh", "-c", 'ulimit -d 3000000 && exec "$0" -c "$1"', sys.executable, script],
                          capture_output=True, text=True, timeout=120, cwd=str(Path(npualloc.__file__).parents[1]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(sorted(loads(SNAPSHOT)))
