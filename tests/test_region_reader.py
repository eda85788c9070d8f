"""The region reader against crafted files: nothing is trusted before it is
validated, and no file, however damaged, makes it read out of bounds."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from region_helpers import region_bytes, region_file, stuck_region_bytes, write_region

import npualloc
from npualloc import region as region_module
from npualloc._ffi import REGION_SIZE, constants, ffi
from npualloc.errors import (CorruptRegionError, IncompatibleRegionError, NoSuchProcessError, NotUnderNpuallocError,
                             NpuallocError, OtherUserError, ProcessStoppedError)
from npualloc.region import Region


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    return tmp_path




@pytest.mark.parametrize("runtime_devices", [0, 2, 8])
def test_a_device_is_refused_only_past_a_runtime_count_the_process_recorded(shm: Path, sleeper: int,
                                                                          runtime_devices: int) -> None:
    """0: the process did not say how many devices its runtime sees (it could
    not ask), so every device is read as one it never used."""
    write_region(shm, sleeper, region_bytes(sleeper, device_count=1, runtime_device_count=runtime_devices))
    if runtime_devices == 2:
        with pytest.raises(RuntimeError, match=r"invalid device 7: the runtime sees 2 device\(s\)"):
            npualloc.memory_stats(7, pid=sleeper)
        with pytest.raises(RuntimeError, match=r"invalid device 7: the runtime sees 2 device\(s\)"):
            npualloc.mem_get_info(7, pid=sleeper)
    else:
        assert npualloc.memory_allocated(7, pid=sleeper) == 0
    assert npualloc.memory_allocated(1, pid=sleeper) == 0


def test_well_formed_region_is_read(shm: Path, sleeper: int) -> None:
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper, device_count=2), REGION_SIZE)
    device = region.devices[1]
    device.in_use = 1
    device.allocated_bytes[constants.NPUALLOC_POOL_ALL].current = 1234
    device.allocated_bytes[constants.NPUALLOC_POOL_ALL].peak = 5678
    device.reserved_bytes[constants.NPUALLOC_POOL_LARGE].current = 20 << 20
    device.max_split_size = -1
    write_region(shm, sleeper, bytes(ffi.buffer(region)))

    stats = npualloc.memory_stats(pid=sleeper)  # device None: the first device in use
    assert stats["allocated_bytes.all.current"] == 1234
    assert stats["allocated_bytes.all.peak"] == 5678
    assert stats["reserved_bytes.large_pool.current"] == 20 << 20
    assert stats["max_split_size"] == -1
    assert npualloc.memory_allocated("npu:1", pid=sleeper) == 1234
    assert npualloc.memory_allocated(0, pid=sleeper) == 0
    with Region(sleeper) as opened:
        assert opened.header().cmdline == "crafted"
        assert opened.devices_in_use() == [1]


@pytest.mark.parametrize("free, total, error, fragment", [
    (3 << 30, 32 << 30, None, ""),
    (0, 0, NpuallocError, "has no figure of device 1's memory"),  # in use, but its runtime could not tell
    (-1, 32 << 30, CorruptRegionError, "memory figures are negative"),
    (0, -1, CorruptRegionError, "memory figures are negative"),
])
def test_mem_get_info_reads_the_sampled_pair(shm: Path, sleeper: int, free: int, total: int, error: type | None,
                                             fragment: str) -> None:
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper, device_count=2), REGION_SIZE)
    region.devices[1].in_use = 1
    region.devices[1].device_free_bytes = free
    region.devices[1].device_total_bytes = total
    write_region(shm, sleeper, bytes(ffi.buffer(region)))
    if error is None:
        assert npualloc.mem_get_info(pid=sleeper) == npualloc.mem_get_info("npu:1", pid=sleeper) == (free, total)
    else:
        with pytest.raises(error, match=fragment):
            npualloc.mem_get_info(pid=sleeper)
    with pytest.raises(NpuallocError, match="has no figure of device 0's memory"):
        npualloc.mem_get_info(0, pid=sleeper)  # a device it has not used


@pytest.mark.parametrize("config, limit, fractions", [
    (b"", 0, (1.0, 1.0)), (b"", 250, (1.0, 0.25)),
    (b"per_process_memory_fraction:0.25", 0, (0.25, 1.0)),  # device 1 runs uncapped (set to 1.0, or refused)
    (b"per_process_memory_fraction:0.25", 500, (0.25, 0.5)),
    # the key's look-alike inside oom_snapshot's path (the last key: any text) is no key
    (b"reuse_policy:safe,oom_snapshot:/tmp/x,per_process_memory_fraction:0.1", 0, (1.0, 1.0)),
    (b"per_process_memory_fraction:abc", 0, (CorruptRegionError, 1.0)),
    (b"per_process_memory_fraction:1.5", 0, (CorruptRegionError, 1.0)),
    (b"", -1, (1.0, CorruptRegionError)),
])
def test_get_per_process_memory_fraction_of_a_region(shm: Path, sleeper: int, config: bytes, limit: int,
                                                     fractions: tuple[float | type, float | type]) -> None:
    """Device 0 is not set up: the config's fraction; device 1 is (1000
    bytes, capped at limit, 0: none): its own cap, 1.0 without one."""
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper, device_count=2), REGION_SIZE)
    region.header.config = config
    region.devices[1].in_use = 1
    region.devices[1].device_total_bytes = 1000
    region.devices[1].reserved_limit_bytes = limit
    write_region(shm, sleeper, bytes(ffi.buffer(region)))
    for device, fraction in enumerate(fractions):
        if isinstance(fraction, type):
            with pytest.raises(fraction, match="per_process_memory_fraction .* is no number in"):
                npualloc.get_per_process_memory_fraction(device, pid=sleeper)
        else:
            assert npualloc.get_per_process_memory_fraction(f"npu:{device}", pid=sleeper) == fraction
    if not isinstance(fractions[1], type):  # None: the first device in use
        assert npualloc.get_per_process_memory_fraction(pid=sleeper) == fractions[1]


def test_a_larger_file_is_read_up_to_the_layout_size(shm: Path, sleeper: int) -> None:
    write_region(shm, sleeper, region_bytes(sleeper) + b"\xff" * 4096)
    assert npualloc.memory_reserved(pid=sleeper) == 0


@pytest.mark.parametrize("data, error, fragment", [
    (b"", CorruptRegionError, "truncated"),
    (b"\x00" * 64, CorruptRegionError, "bad magic"),   # magic and version are read before the size is judged
    ("older and shorter", IncompatibleRegionError, f"layout version {constants.NPUALLOC_SHM_VERSION - 1}; "),
    ("older and longer", IncompatibleRegionError, f"layout version {constants.NPUALLOC_SHM_VERSION - 1}; "),
    ("one byte short", CorruptRegionError, "truncated"),
    ("garbage", CorruptRegionError, "bad magic"),
    ({"magic": 0x1234}, CorruptRegionError, "bad magic"),
    ({"version": constants.NPUALLOC_SHM_VERSION + 1}, IncompatibleRegionError, "version"),
    ({"size": REGION_SIZE + 8}, CorruptRegionError, "declares"),
    ({"size": 16}, CorruptRegionError, "declares"),
    ({"pid": 1}, CorruptRegionError, "inconsistent header"),
    ({"device_count": 1000}, CorruptRegionError, "inconsistent header"),
    ({"start_time": 1}, NotUnderNpuallocError, "stale"),
    ({"uid": os.geteuid() + 1}, OtherUserError, "another user"),
])
def test_damaged_regions_are_refused(shm: Path, sleeper: int, data: object, error: type, fragment: str) -> None:
    if data == "one byte short":
        data = region_bytes(sleeper)[:-1]
    elif data == "older and shorter":  # an earlier npualloc's region, whose layout was smaller
        data = region_bytes(sleeper, version=constants.NPUALLOC_SHM_VERSION - 1)[:REGION_SIZE // 2]
    elif data == "older and longer":
        data = region_bytes(sleeper, version=constants.NPUALLOC_SHM_VERSION - 1) + bytes(4096)
    elif data == "garbage":
        data = os.urandom(REGION_SIZE)
    elif isinstance(data, dict):
        data = region_bytes(sleeper, **data)
    assert isinstance(data, bytes)
    write_region(shm, sleeper, data)
    with pytest.raises(error, match=fragment):
        npualloc.memory_stats(pid=sleeper)
    with pytest.raises(error, match=fragment):
        npualloc.mem_get_info(pid=sleeper)


def test_symlink_is_refused(shm: Path, sleeper: int) -> None:
    target = write_region(shm, 999999999, region_bytes(sleeper))
    region_file(shm, sleeper).symlink_to(target)
    with pytest.raises(CorruptRegionError, match="cannot open"):
        npualloc.memory_stats(pid=sleeper)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_file_of_another_user_is_refused(shm: Path, sleeper: int) -> None:
    os.chown(write_region(shm, sleeper, region_bytes(sleeper)), 65534, 65534)
    with pytest.raises(OtherUserError):
        npualloc.memory_stats(pid=sleeper)


def test_missing_region_and_dead_process(shm: Path, sleeper: int) -> None:
    with pytest.raises(NotUnderNpuallocError, match="not running under npualloc"):
        npualloc.memory_stats(pid=sleeper)
    dead = subprocess.Popen(["true"])
    dead.wait()
    write_region(shm, dead.pid, region_bytes(sleeper, pid=dead.pid))
    with pytest.raises(NoSuchProcessError):
        npualloc.memory_stats(pid=dead.pid)
    with pytest.raises(NoSuchProcessError):
        npualloc.mem_get_info(pid=dead.pid)


def test_writer_stuck_in_its_seqlock_is_reported(shm: Path, sleeper: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_region(shm, sleeper, stuck_region_bytes(sleeper))
    monkeypatch.setattr(region_module, "SEQLOCK_TIMEOUT_S", 0.05)
    with pytest.raises(CorruptRegionError, match="mid-update"):
        npualloc.memory_stats(pid=sleeper)


def test_the_pause_state_is_read_whole_under_its_seqlock(shm: Path, sleeper: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The state and its byte counts are one copy (layout version 7): read
    while the process is inside an update of them, they are waited for and
    then an error, never one state paired with another's counts."""
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper), REGION_SIZE)
    region.header.pause.seq = 4
    region.header.pause.state = constants.NPUALLOC_PAUSED
    region.header.pause.paused_bytes = 12 << 20
    region.header.pause.backup_bytes = 5 << 20
    path = write_region(shm, sleeper, bytes(ffi.buffer(region)))
    with Region(sleeper) as opened:
        header = opened.header()
    assert (header.state, header.paused_bytes, header.backup_bytes) == ("paused", 12 << 20, 5 << 20)
    region.header.pause.seq = 5
    path.write_bytes(bytes(ffi.buffer(region)))
    monkeypatch.setattr(region_module, "SEQLOCK_TIMEOUT_S", 0.05)
    with Region(sleeper) as opened, pytest.raises(CorruptRegionError, match="pause state stayed mid-update"):
        opened.header()


def test_a_stopped_writer_inside_its_seqlock_is_reported_as_stopped(shm: Path, sleeper: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGSTOP may land inside a stats update of a busy process (a soak run
    read 3-4 of 100 stops so): said as such, not as a corrupt region."""
    write_region(shm, sleeper, stuck_region_bytes(sleeper))
    monkeypatch.setattr(region_module, "SEQLOCK_TIMEOUT_S", 0.05)
    os.kill(sleeper, signal.SIGSTOP)
    try:
        # Stopped once it has run, which a loaded machine may put off past the reader's wait; a
        # sleeper that ended first fails the test (the wait reaps nothing, for the fixture's).
        stop = os.waitid(os.P_PID, sleeper, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
        assert stop.si_code == os.CLD_STOPPED, f"the sleeper ended before it stopped: {stop}"
        with pytest.raises(ProcessStoppedError, match=f"process {sleeper} is stopped .* once it continues"):
            npualloc.memory_stats(pid=sleeper)
    finally:
        os.kill(sleeper, signal.SIGCONT)


def test_a_region_is_listed_once_whatever_aliases_are_planted(shm: Path, sleeper: int) -> None:
    """A user's process was listed once per alias of its region, each costing
    root's `ls` and the exporter a full seqlock wait: names that int() reads
    as the pid (leading zeros, other scripts' digits) and copies in region
    directories of their own beside the first. One entry now, its file."""
    path = write_region(shm, sleeper, stuck_region_bytes(sleeper))
    for alias in (f"npualloc.0{sleeper}", f"npualloc.00{sleeper}", "npualloc." + str(sleeper).translate(
            str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669"))):
        (path.parent / alias).write_bytes(path.read_bytes())
    for suffix in ("aaaaaa", "bbbbbb", "cccccc"):
        beside = shm / f"npualloc-{os.geteuid()}.{suffix}"
        beside.mkdir(mode=0o700)
        (beside / path.name).write_bytes(path.read_bytes())
    listed = list(region_module.live_regions())
    assert [(entry.pid, entry.path) for entry, _ in listed] == [(sleeper, path)]
    for _, opened in listed:
        if isinstance(opened, Region):
            opened.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: processes and files of two other users")
def test_a_file_planted_for_another_users_pid_hides_nothing(shm: Path) -> None:
    """User 1000's directory is listed before user 65534's: a file it holds
    under the name of 65534's process is refused, and the real region is
    still listed after it (a pid is listed once only once it opened)."""
    victim = subprocess.Popen(["sleep", "60"], user=65534)
    try:
        genuine = shm / "npualloc-65534" / f"npualloc.{victim.pid}"
        planted = shm / "npualloc-1000" / genuine.name
        for path, uid in ((genuine, 65534), (planted, 1000)):
            path.parent.mkdir(mode=0o700)
            path.write_bytes(region_bytes(victim.pid, uid=65534))
            path.chmod(0o600)
            os.chown(path.parent, uid, uid)
            os.chown(path, uid, uid)
        listed = list(region_module.live_regions())
        assert [(entry.path, type(opened)) for entry, opened in listed] == [
            (planted, OtherUserError), (genuine, Region)]
        listed[1][1].close()
    finally:
        victim.kill()
        victim.wait()


MOUNTED_LISTING = """
import json, os, subprocess, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from region_helpers import region_bytes
from npualloc import region
shm, healthy, mounted_dir, mounted_file = Path(sys.argv[2]), *map(int, sys.argv[3:6])
def plant(directory, pid, mount):
    directory.mkdir(mode=0o700)
    if mount:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "npualloc-test", str(directory)], check=True)
    path = directory / f"npualloc.{pid}"
    path.write_bytes(region_bytes(pid))
    path.chmod(0o600)
    return path
uid = os.geteuid()
plant(shm / f"npualloc-{uid}", healthy, False)
plant(shm / f"npualloc-{uid}.aaaaaa", mounted_dir, True)
bound = plant(shm / f"npualloc-{uid}.bbbbbb", mounted_file, False)
subprocess.run(["mount", "--bind", str(bound), str(bound)], check=True)
listed = [entry.pid for entry, opened in region.live_regions()]
refused = []
for pid in (mounted_dir, mounted_file):
    try:
        region.Region(pid).close()
    except region.NotUnderNpuallocError:
        refused.append(pid)
print(json.dumps({"listed": listed, "refused": refused}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare(1) to mount in a private mount namespace")
def test_region_directories_with_a_mount_on_or_in_them_are_never_entered(shm: Path) -> None:
    """A user may mount a FUSE file system of their own on their region
    directory, or on a file in it, and never answer: root's `ls`, `stats`
    and the exporter would wait for ever in open() or stat(). Such a
    directory is passed over, found from /proc/self/mountinfo, which asks no
    file system. Here tmpfs and a bind mount stand in for FUSE, in a private
    mount namespace: the regions beneath them are readable, and not read."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                               MOUNTED_LISTING, str(Path(__file__).parent), str(shm),
                               *(str(p.pid) for p in sleepers)],
                              capture_output=True, text=True, timeout=120, env={**os.environ, "NPUALLOC_SHM_DIR": str(shm)})
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"listed": [sleepers[0].pid], "refused": [p.pid for p in sleepers[1:]]}
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()


def test_regions_stuck_mid_update_share_one_wait_in_a_listing(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each region whose seqlock stays odd cost a listing SEQLOCK_TIMEOUT_S,
    so a user with many such processes could stall root's `ls` and every
    exporter scrape for as long as they liked. A listing now waits that long
    in all: the first stuck region takes the wait, each later one one read."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    reads: dict[int, int] = {}
    real = region_module.reader_library()

    class CountingReader:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        @staticmethod
        def npualloc_reader_stats(region: object, device: int, attempts: int, out: object) -> int:
            pid = ffi.cast("npualloc_region *", region).header.pid
            reads[pid] = reads.get(pid, 0) + 1
            return real.npualloc_reader_stats(region, device, attempts, out)

    try:
        for proc in sleepers:
            write_region(shm, proc.pid, stuck_region_bytes(proc.pid))
        monkeypatch.setattr(region_module, "SEQLOCK_TIMEOUT_S", 0.05)
        monkeypatch.setattr(region_module, "reader_library", CountingReader)
        # A clock of counted reads, 1 ms each: on a loaded machine one real
        # read could take the whole wait, and the first region would read once.
        ticks = itertools.count()
        monkeypatch.setattr(region_module, "time", SimpleNamespace(monotonic=lambda: next(ticks) / 1000,
                                                                   sleep=time.sleep))
        failures = []
        for entry, opened in region_module.live_regions():
            assert isinstance(opened, Region), opened
            with opened:
                with pytest.raises(CorruptRegionError, match="mid-update") as failure:
                    opened.read_device_stats(0)
                failures.append(str(failure.value))
        first, *later = sorted(sleepers, key=lambda proc: f"npualloc.{proc.pid}")
        assert len(failures) == 4 and reads[first.pid] > 1 and [reads[proc.pid] for proc in later] == [1, 1, 1]
        reads.clear()
        with Region(later[-1].pid) as alone:  # a region opened on its own waits its own time
            with pytest.raises(CorruptRegionError, match="mid-update"):
                alone.read_device_stats(0)
        assert reads[later[-1].pid] > 1
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()


def test_region_is_closed_after_use(shm: Path, sleeper: int) -> None:
    write_region(shm, sleeper, region_bytes(sleeper))
    opened = Region(sleeper)
    opened.close()
    opened.close()  # idempotent
    with pytest.raises(AttributeError):
        opened.read_device_stats(0)
