"""Memory snapshots and history of a preloaded pyACL process on the simulator:
in-process and from another shell, blocks against what the process allocated,
torch's own memory_viz reading them, the PNG plot, the OOM snapshot, history
switched on from outside, and a replay of a snapshot taken here."""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import stat
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import BUILD, sim_env
from region_helpers import (Workload, assert_one_line_error, cli_with_trigger, drain_fifo, region_file, run_cli,
                            wait_for_pending_command)

import npualloc
from npualloc.plot import timeline
from npualloc._ffi import constants, ffi
from npualloc.region import Region, reader_library
from npualloc.snapshot import loads

MiB = 1 << 20
# (request, block size): aclrtMalloc pads to 32 and adds 32, then torch rounds to
# 512; the last one's 26 MiB segment is not split (the rest would be under 1 MiB).
REQUESTS = [(3 * MiB, 3 * MiB + 512), (512, 1024), (1000, 1536), (25 * MiB + 7, 26 * MiB)]


def _blocks(snapshot: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {b["address"]: b for seg in snapshot["segments"] for b in seg["blocks"]}


def _check_against_allocations(snapshot: dict[str, Any], live: dict[int, int], freed: dict[int, int]) -> None:
    blocks = _blocks(snapshot)
    sizes = dict((request, size) for request, size in REQUESTS)
    for address, request in live.items():
        block = blocks[address]
        assert block["state"] == "active_allocated"
        assert block["requested_size"] == request and block["size"] == sizes[request]
    for address in freed:
        assert blocks[address]["state"] in ("active_pending_free", "inactive")
    for seg in snapshot["segments"]:
        assert seg["device"] == 0 and seg["stream"] == 0 and seg["is_expandable"] is False
        assert seg["segment_pool_id"] == (0, 0) and seg["frames"] == []
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        assert seg["segment_type"] == ("small" if seg["total_size"] == 2 * MiB else "large")
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        offset = seg["address"]
        for b in seg["blocks"]:  # contiguous, in address order
            assert b["address"] == offset and b["frames"] == []
            offset += b["size"]


def _allocate(w: Workload) -> tuple[dict[int, int], dict[int, int]]:
    """Allocates REQUESTS in order and frees the third: (live, freed), address -> request."""
    live = {w.call(f"malloc({request})"): request for request, _ in REQUESTS}
    freed_address = w.call("live[-2]")
    w.call("acl.rt.free(live.pop(-2))")
    freed = {freed_address: live.pop(freed_address)}
    return live, freed


def _in_order(live: dict[int, int], freed: dict[int, int]) -> list[tuple[int, int]]:
    """(address, request) of REQUESTS in allocation order."""
    by_request = {request: address for address, request in {**live, **freed}.items()}
    return [(by_request[request], request) for request, _ in REQUESTS]


def test_in_process_snapshot_matches_the_allocations(tmp_path: Path) -> None:
    with Workload(tmp_path, PYTORCH_NPU_ALLOC_CONF="record_history:1000") as w:
        live, freed = _allocate(w)
        snapshot = w.call("npualloc._snapshot()")  # JSON turns the (0, 0) tuples into lists
        # torch's memory_snapshot() is the list of _snapshot()'s segments, not the dict
        assert w.call("npualloc.memory_snapshot()") == snapshot["segments"]
        # torch 2.13's memory_snapshot(mempool_id=None, include_traces=True), whose
        # default pool is (0, 0): these were a TypeError and a ValueError
        assert w.call("npualloc.memory_snapshot(None, False)") == snapshot["segments"]
        assert w.call("npualloc.memory_snapshot((0, 0), include_traces=False)") == snapshot["segments"]
        with pytest.raises(AssertionError, match="no memory pools"):
            w.call("npualloc.memory_snapshot((0, 1))")
    for seg in snapshot["segments"]:
        seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
    _check_against_allocations(snapshot, live, freed)
    assert len(snapshot["segments"]) == 3  # 20 MiB and 2 MiB for the first three, 26 MiB for the last
    assert snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "record_history:1000"
    assert snapshot["allocator_settings"]["max_split_size"] == -1

    [trace] = snapshot["device_traces"]
    assert [(e["addr"], e["size"]) for e in trace if e["action"] == "alloc"] == _in_order(live, freed)
    assert [e["action"] for e in trace].count("segment_alloc") == 3
    [request] = [e for e in trace if e["action"] == "free_requested"]
    assert (request["addr"], request["size"]) == next(iter(freed.items()))
    times = [e["time_us"] for e in trace]
    assert times == sorted(times) and all(e["stream"] == 0 and e["frames"] == [] for e in trace)


def test_history_is_off_by_default_and_switches_on_in_process(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        assert w.call("npualloc._snapshot()")["device_traces"] == [[]]
        w.call("npualloc.record_memory_history(max_entries=3)")
        for _ in range(5):
            w.call("malloc(4096)")
        trace = w.call("npualloc._snapshot()")["device_traces"][0]
        assert [e["action"] for e in trace] == ["alloc"] * 3  # the newest three
        w.call("npualloc._record_memory_history(enabled=None)")
        w.call("malloc(4096)")
        assert w.call("npualloc._snapshot()")["device_traces"] == [[]]



def test_torch_named_aliases_take_torchs_arguments(tmp_path: Path) -> None:
    """npualloc._record_memory_history, _snapshot and _dump_snapshot are there
    so code written for torch.cuda.memory runs unchanged: they take torch's
    arguments. _record_memory_history(False) (torch's legacy form) once turned
    history on, and _snapshot(0) / _dump_snapshot(path, False) read the device
    or augment_with_fx_traces as a pid and raised."""
    out = tmp_path / "dump.pickle"
    with Workload(tmp_path) as w:
        w.call("npualloc._record_memory_history(True)")  # legacy form: on
        w.call("malloc(4096)")
        assert [e["action"] for e in w.call("npualloc._snapshot(0)")["device_traces"][0]] == ["segment_alloc", "alloc"]
        w.call("npualloc._record_memory_history(False)")  # legacy form: off
        assert "record_history" not in w.call("npualloc.get_config()")
        w.call("malloc(4096)")
        assert w.call("npualloc._snapshot(device=0, augment_with_fx_traces=False)")["device_traces"] == [[]]
        # torch's (enabled, context, stacks, max_entries, device): context None records no stacks
        w.call("npualloc._record_memory_history('all', None, 'all', 10, 0)")
        w.call("malloc(4096)")
        w.call(f"npualloc._dump_snapshot({str(out)!r}, False)")
        w.call("npualloc._record_memory_history(enabled=None)")
    [trace] = loads(out.read_bytes())["device_traces"]
    assert [e["action"] for e in trace] == ["alloc"] and trace[0]["frames"] == []



@pytest.mark.parametrize("call, message", [
    ("record_memory_history('on')", "RuntimeError: enabled must be 'state', 'all' or None, not 'on'"),
    ("record_memory_history(1)", "TypeError: enabled must be 'state', 'all' or None, not 1"),
    ("record_memory_history('all', context='allocs')",
     "RuntimeError: context must be 'state', 'alloc', 'all' or None, not 'allocs'"),
    ("_record_memory_history('all', 'frames')",
     "RuntimeError: context must be 'state', 'alloc', 'all' or None, not 'frames'"),
    ("record_memory_history('all', stacks='cpp')", "RuntimeError: stacks must be 'python', 'all' or None, not 'cpp'"),
    ("_record_memory_history('all', 'all', 'cpp')", "RuntimeError: stacks must be 'python', 'all' or None, not 'cpp'"),
    ("record_memory_history('all', max_entries=-1)", "TypeError: max_entries must be a non-negative int, not -1"),
])
def test_record_memory_history_refuses_what_torch_refuses(tmp_path: Path, call: str, message: str) -> None:
    """torch checks enabled against 'state' and 'all', context against
    'state', 'alloc' and 'all' (None for either) and stacks against 'python'
    and 'all': any other value turned history on, a typo passing for 'all'.
    Refused before anything changes, with torch's exception: its check's
    RuntimeError for a string it does not know (ValueError until 2026-11-27),
    its binding's TypeError for another type or a max_entries no size_t holds."""
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        with pytest.raises(AssertionError, match=re.escape(message)):
            w.call(f"npualloc.{call}")
        assert "record_history" not in w.call("npualloc.get_config()")
        w.call("npualloc.record_memory_history('state', context='alloc')")
        assert "record_history:" in w.call("npualloc.get_config()")


@pytest.fixture(scope="module")
def remote_snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, int], dict[int, int]]:
    """A snapshot taken from another shell with `npualloc snapshot`, history
    switched on from outside too, and what the process had allocated."""
    tmp_path = tmp_path_factory.mktemp("remote")
    output = tmp_path / "snap.pickle"
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        done = cli_with_trigger(w, tmp_path, ["record-history", str(w.pid), "500"], "free()")
        assert done.returncode == 0 and "recording the last 500 events" in done.stdout, done.stderr
        live, freed = _allocate(w)
        # The command is applied at the start of the trigger's malloc: the snapshot comes before it.
        done = cli_with_trigger(w, tmp_path, ["snapshot", str(w.pid), "-o", str(output)], "malloc(512)")
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"process {w.pid}: snapshot written to {output} (3 segments, 10 trace events)\n"
        assert not list(tmp_path.glob("npualloc.*.snapshot.*"))  # the hand-over file was removed
        with pytest.MonkeyPatch.context() as env:
            env.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
            assert "record_history:500" in npualloc.get_config(pid=w.pid)
    return output, live, freed


def test_snapshot_command_works_when_the_region_base_is_a_link(tmp_path: Path) -> None:
    """The region's base may be a link (/dev/shm -> /run/shm on some systems):
    the process writes the snapshot hand-over file through the region
    directory it opened, not through a path, which would refuse the link."""
    (tmp_path / "run-shm").mkdir()
    base = tmp_path / "shm"
    base.symlink_to(tmp_path / "run-shm")
    output = tmp_path / "snap.pickle"
    with Workload(base) as w:
        w.call("malloc(4096)")
        done = cli_with_trigger(w, base, ["snapshot", str(w.pid), "-o", str(output)], "malloc(512)")
        assert done.returncode == 0, done.stderr
        assert isinstance(loads(output.read_bytes())["segments"], list)
        assert "npualloc:" not in w.stderr()


def test_snapshot_command_never_writes_through_a_descriptor_the_program_reused(tmp_path: Path) -> None:
    """The process keeps its region directory open for the hand-over files; a
    program that closes descriptors it did not open may get that number back
    for another directory. The command then fails and writes nothing there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        region_dir = str(tmp_path / f"npualloc-{os.geteuid()}")
        fds = w.call(f"[int(f) for f in os.listdir('/proc/self/fd') if os.path.realpath('/proc/self/fd/' + f) == "
                     f"{region_dir!r}]")
        assert len(fds) == 1
        assert w.call(f"os.dup2(os.open({str(elsewhere)!r}, os.O_RDONLY | os.O_DIRECTORY), {fds[0]})") == fds[0]
        done = cli_with_trigger(w, tmp_path, ["snapshot", str(w.pid), "-o", str(tmp_path / "snap.pickle")],
                                "malloc(512)")
        assert done.returncode != 0
        assert "the program closed the region directory's descriptor" in w.stderr()
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "snap.pickle").exists()


def test_hand_over_files_nobody_took_are_bounded_and_go_at_exit(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot whose requester stopped waiting after the process took it
    (a timeout while it was being written, a requester killed) leaves its
    file, which nobody removes: a week of them filled /dev/shm (a soak run,
    when a timed-out command was still applied later). The process keeps
    the last two and removes the rest, and those two at exit."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    region_dir = tmp_path / f"npualloc-{os.geteuid()}"
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        left = []
        seq = ffi.new("uint64_t *")
        for _ in range(4):
            with Region(w.pid, writable=True) as region:  # posted by a requester that never reads its file
                assert reader_library().npualloc_reader_post(region._file, constants.NPUALLOC_CMD_SNAPSHOT, -1,
                                                             0.0, seq) == constants.NPUALLOC_POST_OK
            w.call("malloc(512)")  # the process takes it and writes the file
            left.append(sorted(p.name for p in region_dir.glob(f"npualloc.{w.pid}.snapshot.*")))
        assert [len(names) for names in left] == [1, 2, 2, 2]
        assert left[3] == sorted(set(left[3]) - set(left[1]))  # the oldest went, not the newest
        assert w.close() == 0
    assert list(region_dir.glob("npualloc.*")) == []


def test_a_process_that_exits_before_its_snapshot_is_read_is_said_to_have_ended(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit removes the hand-over files nobody took: a requester that reads
    its file only after the process exited is told so, not that the region
    is corrupt."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    post = Region.post_command
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")

        def post_then_exit(self: Region, *args, **kwargs) -> int:
            seq = post(self, *args, **kwargs)
            applier.join()  # the malloc that applied the command has returned
            assert w.close() == 0  # and the process exits before the file is read
            return seq

        monkeypatch.setattr(Region, "post_command", post_then_exit)
        applier = threading.Timer(0.3, lambda: w.call("malloc(512)"))
        applier.start()
        try:
            with pytest.raises(npualloc.NoSuchProcessError, match="ended before its snapshot was read"):
                npualloc._snapshot(pid=w.pid)
        finally:
            applier.join()


def test_a_snapshot_too_large_to_read_is_removed_all_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand-over file the requester refuses (past MAX_SNAPSHOT_BYTES: a
    full history of record_history's 16,777,216 entries is some 2 GB, 120
    bytes an entry) stayed in the region directory, /dev/shm's memory, until
    later snapshots pushed it out or the process exited. It is removed as a
    file that was read is. Nothing is corrupt: the error says what to do,
    where it read as a corrupt region (CorruptRegionError, the CLI's exit 7)."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(npualloc._snapshot_check, "MAX_SNAPSHOT_BYTES", 64)
    with Workload(tmp_path) as w, ThreadPoolExecutor(1) as pool:
        w.call("malloc(4096)")
        taking = pool.submit(npualloc._snapshot, pid=w.pid)
        wait_for_pending_command(region_file(tmp_path, w.pid), lambda: not taking.done())
        w.call("malloc(512)")
        inode = region_file(tmp_path, w.pid).stat().st_ino  # names its snapshot files
        with pytest.raises(npualloc.NpuallocError, match=rf"cannot read .*snapshot\.{inode}\.1: larger than 0 MiB: "
                           rf"process {w.pid}'s snapshot is past what npualloc reads; record fewer history") as e:
            taking.result()
        assert not isinstance(e.value, npualloc.errors.CorruptRegionError)
        assert list(region_file(tmp_path, w.pid).parent.glob("npualloc.*.snapshot.*")) == []


def test_snapshot_from_another_shell_matches_the_allocations(remote_snapshot) -> None:
    output, live, freed = remote_snapshot
    with open(output, "rb") as f:
        snapshot = pickle.load(f)
    _check_against_allocations(snapshot, live, freed)
    [trace] = snapshot["device_traces"]
    # Recording began at the free of the 4096 B block (whose call applied the
    # command). The process has no stream of its own, so (reuse_policy auto)
    # each free completes at once.
    assert [e["action"] for e in trace] == ["free_requested", "free_completed", "segment_alloc", "alloc", "alloc",
                                            "alloc", "segment_alloc", "alloc", "free_requested", "free_completed"]
    assert [(e["addr"], e["size"]) for e in trace if e["action"] == "alloc"] == _in_order(live, freed)
    [(freed_address, freed_request)] = freed.items()
    assert trace[-2] == {"action": "free_requested", "addr": freed_address, "size": freed_request, "stream": 0,
                         "time_us": trace[-2]["time_us"], "frames": []}
    assert (trace[-1]["action"], trace[-1]["addr"]) == ("free_completed", freed_address)
    assert _blocks(snapshot)[freed_address]["state"] == "inactive"


def test_torch_memory_viz_reads_our_snapshots(remote_snapshot) -> None:
    pytest.importorskip("torch")
    from torch.cuda import _memory_viz

    output, live, _ = remote_snapshot
    with open(output, "rb") as f:
        snapshot = pickle.load(f)

    summary = _memory_viz.segsum(snapshot)  # asserts its own accounting of every segment
    assert "segments: 3" in summary
    total_requested = sum(live.values())
    assert f"total_allocated: {_memory_viz.Bytes(total_requested)}" in summary

    lines = _memory_viz.segments(snapshot, format_flamegraph=lambda text: text).splitlines()
    for address, request in live.items():
        segment = next(s for s in snapshot["segments"] if s["address"] <= address < s["address"] + s["total_size"])
        assert f"stream_0;seg_{segment['address']};active_allocated;<non-python> {request}" in lines
    by_state = _memory_viz.memory(snapshot, format_flamegraph=lambda text: text)
    assert "stream_0;inactive;<non-python>" in by_state

    text = _memory_viz.trace(snapshot)
    assert "Device 0 ----" in text and "10 entries" in text
    assert text.count("= cudaMalloc(") == 2 and text.count("del ") == 2

    html = _memory_viz.trace_plot(snapshot)
    assert "Active Memory Timeline" in html and "snapshot.pickle" in html
    assert "Allocator State History" in _memory_viz.segment_plot(snapshot)
    flame = _memory_viz.compare(snapshot["segments"], [], format_flamegraph=lambda text: text)
    blocks = [line for line in flame.splitlines() if line.startswith("only_before;stream_0;seg_")
              and ";<non-python> " in line]  # one per block, besides the <gaps> of rounding and free space
    assert len(blocks) == sum(len(s["blocks"]) for s in snapshot["segments"])


def test_plot_writes_a_png(remote_snapshot, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    output, _, _ = remote_snapshot
    png = tmp_path / "snap.png"
    done = run_cli(["plot", str(output), "-o", str(png)], tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == f"{output}: plot written to {png}\n"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width == 1200 and 600 <= height <= 2000
    assert 20_000 < len(data) < 2_000_000


def test_timeline_levels_come_from_the_end_state(remote_snapshot) -> None:
    output, live, _ = remote_snapshot
    snapshot = npualloc.snapshot.load(output)
    line = timeline(snapshot, 0)
    assert line.timed and line.times[0] == 0.0 and line.times == sorted(line.times)
    assert line.allocated[-1] == sum(live.values())
    assert line.reserved[-1] == sum(s["total_size"] for s in snapshot["segments"])
    # Before recording began the process already held a 2 MiB segment and, at
    # the first event (the free of 4096 B), nothing allocated.
    assert line.reserved[0] == 2 * MiB and line.allocated[0] == 0


def test_replay_accepts_our_snapshots(remote_snapshot) -> None:
    output, live, freed = remote_snapshot
    proc = subprocess.run([sys.executable, "-m", "npualloc", "replay", str(output), "--build", str(BUILD), "--json",
                           "--no-search", "--conf", "max_split_size_mb:20"], env=sim_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["allocs"] == len(live) + len(freed)
    # The 4096 B block was allocated before recording began: its free (requested
    # and completed) cannot be replayed and is skipped.
    assert report["frees"] == 1 and report["skipped_frees"] == 2 and report["fits"] is True


def test_oom_writes_a_snapshot_before_returning(tmp_path: Path) -> None:
    path = tmp_path / "oom.pickle"
    with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"record_history:100,oom_snapshot:{path}") as w:
        w.call(f"malloc({30 * MiB})")
        assert w.call(f"acl.rt.malloc({40 * MiB}, 0)[1]") == 207001
        assert path.exists()  # before the program saw the error
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        stderr = w.stderr()
    assert f"npualloc: out of memory: snapshot written to {path}" in stderr
    snapshot = npualloc.snapshot.load(path)
    [segment] = snapshot["segments"]
    assert segment["total_size"] == 30 * MiB + 2 * MiB and segment["allocated_size"] == 30 * MiB + 512
    trace = snapshot["device_traces"][0]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "oom"]
    oom = trace[-1]
    assert oom["size"] == 40 * MiB + 512 and oom["device_free"] == oom["addr"] < 64 * MiB - 30 * MiB


def test_oom_snapshot_path_that_cannot_be_written_warns_once(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "oom.pickle"
    with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{path}") as w:
        for _ in range(3):
            assert w.call(f"acl.rt.malloc({100 * MiB}, 0)[1]") == 207001
        stderr = w.stderr()
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {path}: No such file or directory") == 1


def test_each_snapshot_leaves_torchs_snapshot_event_in_later_traces(tmp_path: Path) -> None:
    """torch's snapshot() records {"action": "snapshot", "addr": 0, "size":
    the active bytes it listed} once it has listed the segments, so later
    traces show where each snapshot fell; npualloc replay ends an iteration
    at each."""
    with Workload(tmp_path, PYTORCH_NPU_ALLOC_CONF="record_history:100") as w:
        w.call(f"malloc({3 * MiB})")
        first = w.call("npualloc._snapshot()")
        w.call("malloc(4096)")
        second = w.call("npualloc._snapshot()")
    assert "snapshot" not in [e["action"] for e in first["device_traces"][0]]
    active = sum(segment["active_size"] for segment in first["segments"])
    events = [e for e in second["device_traces"][0] if e["action"] == "snapshot"]
    assert [(e["addr"], e["size"], e["stream"], e["frames"]) for e in events] == [(0, active, 0, [])]
    actions = [e["action"] for e in second["device_traces"][0]]
    assert actions.index("snapshot") == len(first["device_traces"][0])  # right after what the first listed


def test_a_config_path_that_is_not_utf8_leaves_the_snapshot_and_get_config_readable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Linux path is bytes: an oom_snapshot path in another encoding (Latin-1
    here) went as it was into allocator_settings' config text, and pickle,
    which reads every string as UTF-8, refused the whole snapshot over it
    (UnicodeDecodeError), the OOM snapshot too. get_config() in the process
    decoded the same text strictly and raised, where get_config(pid=) read
    the region's copy with U+FFFD. Such bytes read as U+FFFD in all three."""
    path = os.fsdecode(os.fsencode(tmp_path) + b"/r\xe9sum\xe9.pickle")
    expected = "oom_snapshot:" + path.replace("\udce9", "\ufffd")
    out = tmp_path / "snap.pickle"
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    with Workload(tmp_path, PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{path}") as w:
        w.call(f"malloc({MiB})")
        w.call(f"npualloc.dump_snapshot({str(out)!r})")
        inside = w.call("npualloc.get_config()")
        outside = npualloc.get_config(pid=w.pid)
    settings = pickle.loads(out.read_bytes())["allocator_settings"]
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == expected
    assert expected in inside.split(",")
    assert inside == outside


def test_a_long_config_goes_whole_into_the_snapshot(tmp_path: Path) -> None:
    """allocator_settings' config text was formatted into the region's 512
    bytes: a config of many keys and a long oom_snapshot path (it comes last)
    was cut inside the path, where get_config() gives it whole."""
    path = tmp_path / ("d" * 150) / "oom.pickle"
    path.parent.mkdir()
    divisions = ",".join(f"{1 << i}:{1 << (i % 5)}" for i in range(15))
    config = (f"max_split_size_mb:123456789,max_non_split_rounding_mb:123456789,"
              f"garbage_collection_threshold:0.123456789012345,roundup_power2_divisions:[{divisions},>:1],"
              f"per_process_memory_fraction:0.123456789012345,reuse_policy:eager,record_history:1000,"
              f"record_stacks:python,recent_blocks:3,oom_snapshot:{path}")
    out = tmp_path / "snap.pickle"
    with Workload(tmp_path, PYTORCH_NPU_ALLOC_CONF=config) as w:
        w.call(f"malloc({MiB})")
        w.call(f"npualloc.dump_snapshot({str(out)!r})")
        inside = w.call("npualloc.get_config()")
    assert len(inside) > 512 and inside.endswith(f"oom_snapshot:{path}")
    assert pickle.loads(out.read_bytes())["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == inside


def test_snapshot_before_the_first_allocation_is_empty(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        snapshot = w.call("npualloc._snapshot()")
    assert snapshot["segments"] == [] and snapshot["device_traces"] == [[]]


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert_one_line_error(run_cli(["snapshot", str(dead.pid), "-o", str(tmp_path / "x")], tmp_path), 3,
                          "no such process")
    assert_one_line_error(run_cli(["snapshot", str(os.getpid()), "-o", str(tmp_path / "x")], tmp_path), 4,
                          "not running under npualloc")
    with Workload(tmp_path) as w:
        w.call("malloc(512)")
        assert_one_line_error(run_cli(["snapshot", str(w.pid), "-o", str(tmp_path / "x"), "--timeout", "0.2"],
                                      tmp_path), 8, "did not take the command within 0.2s")
        assert_one_line_error(run_cli(["record-history", str(w.pid), "-1"], tmp_path), 2,
                              "entries: needs a whole number, 0 or more")
    assert not (tmp_path / "x").exists()
    bogus = tmp_path / "bogus.pickle"
    bogus.write_bytes(pickle.dumps({"segments": [], "x": os.system}))
    assert_one_line_error(run_cli(["plot", str(bogus), "-o", str(tmp_path / "p.png")], tmp_path), 1,
                          "holds no objects, but this one names")


def test_loads_refuses_objects() -> None:
    with pytest.raises(npualloc.NpuallocError, match="holds no objects"):
        loads(pickle.dumps({"segments": [], "f": Path("/")}))
    assert loads(pickle.dumps({"segments": [], "device_traces": []}))["segments"] == []


def _oom_with_snapshot_to(tmp_path: Path, path: Path) -> str:
    """Makes a process OOM with oom_snapshot:path; its stderr."""
    with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{path}") as w:
        assert w.call(f"acl.rt.malloc({100 * MiB}, 0)[1]") == 207001
        return w.stderr()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: mknod and files of another user")


@needs_root
def test_oom_snapshot_to_a_character_device_writes_into_it(tmp_path: Path) -> None:
    """oom_snapshot:/dev/null as torch means it (written to, not replaced),
    on a null device of our own (never the machine's /dev/null)."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    stderr = _oom_with_snapshot_to(tmp_path, null)
    assert f"npualloc: out of memory: snapshot written to {null}" in stderr
    info = os.lstat(null)
    assert stat.S_ISCHR(info.st_mode) and info.st_rdev == os.makedev(1, 3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("null")) == ["null"]


@needs_root
def test_oom_snapshot_to_a_device_with_no_driver_says_so(tmp_path: Path) -> None:
    """Any user may make a whiteout (a character device 0:0, Linux 5.8) in
    /tmp: written to as a device, whose open has nothing behind it (ENXIO),
    it was reported as 'a FIFO with no reader'."""
    whiteout = tmp_path / "oom.pickle"
    os.mknod(whiteout, 0o666 | stat.S_IFCHR, os.makedev(0, 0))
    os.chown(whiteout, 65534, 65534)
    stderr = _oom_with_snapshot_to(tmp_path, whiteout)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {whiteout}: {os.strerror(errno.ENODEV)}\n") == 1
    assert "FIFO" not in stderr
    assert os.lstat(whiteout).st_rdev == os.makedev(0, 0)


def test_oom_snapshot_never_follows_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "oom.pickle"
    link.symlink_to(victim)
    stderr = _oom_with_snapshot_to(tmp_path, link)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {link}: it is a symbolic link") == 1
    assert link.is_symlink() and os.readlink(link) == str(victim) and victim.read_text() == "precious\n"


def test_oom_snapshot_never_follows_a_link_on_the_way(tmp_path: Path) -> None:
    """oom_snapshot:DIR/jobs/oom.pickle where another user made jobs a link
    to a directory only root may write: refused, what is behind it kept."""
    behind = tmp_path / "root-only"
    behind.mkdir(mode=0o700)
    (behind / "oom.pickle").write_text("precious\n")
    (tmp_path / "jobs").symlink_to(behind)
    path = tmp_path / "jobs" / "oom.pickle"
    stderr = _oom_with_snapshot_to(tmp_path, path)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {path}: a directory on its path is a symbolic "
                        "link") == 1
    assert sorted(p.name for p in behind.iterdir()) == ["oom.pickle"]
    assert (behind / "oom.pickle").read_text() == "precious\n"


def test_oom_snapshot_to_a_fifo_without_reader_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "oom.fifo"
    os.mkfifo(fifo, 0o666)
    stderr = _oom_with_snapshot_to(tmp_path, fifo)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {fifo}: a FIFO with no reader") == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_oom_snapshot_to_a_fifo_with_a_reader_is_streamed_to_it(tmp_path: Path) -> None:
    fifo = tmp_path / "oom.fifo"
    os.mkfifo(fifo, 0o600)
    # A reader of our own, opened before any writer: poll() reports neither
    # data nor hang-up until the writer has come (and gone).
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    received = bytearray()
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(drain_fifo, reader, received)
        try:
            _oom_with_snapshot_to(tmp_path, fifo)
            reading.result(timeout=120)  # re-raises a failure of the reader thread
        finally:
            os.close(reader)
    assert isinstance(loads(bytes(received))["segments"], list)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@needs_root
def test_oom_snapshot_never_feeds_another_users_fifo(tmp_path: Path) -> None:
    """Anyone may plant a FIFO at a name in /tmp to read the snapshot: one
    that is not the process's user's is left alone, though a reader waits."""
    fifo = tmp_path / "oom.fifo"
    os.mkfifo(fifo, 0o666)
    os.chown(fifo, 65534, 65534)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        stderr = _oom_with_snapshot_to(tmp_path, fifo)
        try:
            received = os.read(reader, 1 << 16)
        except BlockingIOError:
            received = b""
    finally:
        os.close(reader)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {fifo}: it belongs to another user") == 1
    assert received == b""
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.lstat(fifo).st_uid == 65534


def test_oom_snapshot_gives_up_a_fifo_read_a_page_at_a_time(tmp_path: Path) -> None:
    """A reader that takes 4 KiB twice a second keeps making progress, but the
    OOM'ing call waits 5 s in all, not 5 s without progress: the snapshot
    (thousands of blocks, far more than the pipe holds plus 40 KiB) is cut
    short and the warning says so."""
    fifo = tmp_path / "oom.fifo"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    received = bytearray()
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(drain_fifo, reader, received, 4096, 0.5)
        try:
            with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{fifo}") as w:
                assert w.call("len([acl.rt.malloc(512, 0)[1] for _ in range(4000)])") == 4000
                assert w.call(f"acl.rt.malloc({100 * MiB}, 0)[1]") == 207001
                stderr = w.stderr()
            reading.result(timeout=120)
        finally:
            os.close(reader)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {fifo}: the FIFO's reader did not take it "
                        "within 5 s (snapshot incomplete)") == 1
    assert 0 < len(received) < 200 << 10


@needs_root
def test_oom_snapshot_never_replaces_another_users_file(tmp_path: Path) -> None:
    theirs = tmp_path / "oom.pickle"
    theirs.write_text("theirs\n")
    os.chown(theirs, 65534, 65534)
    stderr = _oom_with_snapshot_to(tmp_path, theirs)
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {theirs}: it belongs to another user") == 1
    assert theirs.read_text() == "theirs\n" and theirs.stat().st_uid == 65534


def test_oom_snapshot_is_written_past_things_planted_at_its_temporary_names(tmp_path: Path) -> None:
    """Anyone sees the pid: a directory planted at "<path>.tmp.<pid>", the
    temporary's name until the name got random characters, kept every
    snapshot from being written (it could not be removed, so O_EXCL failed).
    Written now, and nothing planted is touched."""
    path = tmp_path / "oom.pickle"
    with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{path}") as w:
        planted = tmp_path / f"oom.pickle.tmp.{w.pid}"
        planted.mkdir()
        assert w.call(f"acl.rt.malloc({100 * MiB}, 0)[1]") == 207001
        stderr = w.stderr()
    assert f"npualloc: out of memory: snapshot written to {path}" in stderr
    assert isinstance(npualloc.snapshot.load(path)["segments"], list)
    assert planted.is_dir() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("oom")) == [
        "oom.pickle", planted.name]


@needs_root
def test_oom_snapshot_never_removes_another_users_file_at_a_temporary_name(tmp_path: Path) -> None:
    """Root could unlink another user's file at the old temporary name (taken
    for a leftover of an earlier process with the same pid): now any file
    there is left as it is and the snapshot is written beside it."""
    path = tmp_path / "oom.pickle"
    with Workload(tmp_path, NPUSIM_HBM_MB="64", PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:{path}") as w:
        theirs = tmp_path / f"oom.pickle.tmp.{w.pid}"
        theirs.write_text("theirs\n")
        os.chown(theirs, 65534, 65534)
        assert w.call(f"acl.rt.malloc({100 * MiB}, 0)[1]") == 207001
        stderr = w.stderr()
    assert f"npualloc: out of memory: snapshot written to {path}" in stderr
    assert theirs.read_text() == "theirs\n" and theirs.stat().st_uid == 65534


def test_oom_snapshot_to_a_name_with_no_room_for_the_temporary_says_so(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A 250-byte name is valid, but ".tmp.<pid>.<8 hex>" takes it past 255
    whatever the pid: the warning says that, not the bare "File name too
    long". Relative to the process's directory (here tmp_path), as
    oom_snapshot's whole path is at most 255 bytes."""
    name = "x" * 250
    monkeypatch.chdir(tmp_path)  # the workload starts here
    stderr = _oom_with_snapshot_to(tmp_path, Path(name))
    assert stderr.count(f"npualloc: oom_snapshot: cannot write {name}: its name leaves no room for the "
                        "temporary's suffix .tmp.<pid>.<8 hex digits> (nothing written)") == 1, stderr
    assert not (tmp_path / name).exists() and not any(p.name.startswith(name) for p in tmp_path.iterdir())


def test_oom_snapshot_replaces_our_own_file(tmp_path: Path) -> None:
    ours = tmp_path / "oom.pickle"
    ours.write_text("an older snapshot\n")
    _oom_with_snapshot_to(tmp_path, ours)
    assert isinstance(npualloc.snapshot.load(ours)["segments"], list)
