"""`npualloc replay`: a hand-made trace whose figures are worked out below on
paper, a shipped trace of a real model, and the command's errors.

Sizes as npualloc sees them: aclrtMalloc rounds a request up to 32 and adds
32 (the runtime's own contract), then torch's rounding takes it up to a
multiple of 512. Segments follow torch: requests up to 1 MiB share 2 MiB
small-pool segments; larger ones under 10 MiB get a 20 MiB segment; from
10 MiB on a segment is the request rounded up to 2 MiB.
"""
from __future__ import annotations

import gzip
import json
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import BUILD, ROOT, sim_env
from region_helpers import assert_one_line_error
from npualloc import replay

MIB = 1 << 20
TRACES = ROOT / "tools" / "traces"
TINY = TRACES / "tiny.pickle.gz"


def run_replay(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "npualloc.replay", *args], env=sim_env(),
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return proc


def replay_json(trace: Path, *args: str) -> dict:
    """The report; a replay that does not fit (exit EXIT_DID_NOT_FIT with --no-search) still gives one."""
    proc = run_replay(str(trace), "--build", str(BUILD), "--json", *args, check=False)
    if proc.returncode not in (0, replay.EXIT_DID_NOT_FIT):
        pytest.fail(f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    return json.loads(proc.stdout)


def block(request: int) -> int:
    """What one aclrtMalloc(request) occupies in npualloc's cache."""
    padded = (request + 31) // 32 * 32 + 32
    return (padded + 511) // 512 * 512


# tools/traces/make_tiny.py: a, b, c, d as first allocated.
A, B, C, D = 1000, 500_000, 4 * MIB, 16 * MIB


def test_tiny_trace_figures_match_hand_computation():
    report = replay_json(TINY)
    r = report["replay"]
    assert (report["allocs"], report["frees"], report["iterations"]) == (8, 4, 2)
    assert report["skipped_frees"] == 1 and report["skipped_allocs"] == 0
    assert r["completed"] and not r["oom"]

    # Live requested bytes peak at the very end: all four of iteration 2
    # (in iteration 1, a is freed before d arrives).
    assert r["peak_requested_bytes"] == A + B + C + D == 21_472_520
    # The same four blocks, rounded: 1536 + 500224 + 4194816 + 16777728.
    assert [block(x) for x in (A, B, C, D)] == [1536, 500_224, 4_194_816, 16_777_728]
    assert r["peak_allocated_bytes"] == block(A) + block(B) + block(C) + block(D) == 21_474_304

    # Segments: a and b share one 2 MiB small segment; c gets a 20 MiB one;
    # d (16 MiB + 512) no longer fits the 20 MiB segment's remaining
    # 20 MiB - block(c) = 16 MiB - 1024, so it gets its own, rounded up to
    # 18 MiB. Iteration 2 reuses all three: 40 MiB, from 3 raw mallocs, all
    # in iteration 1.
    assert r["peak_reserved_bytes"] == (2 + 20 + 18) * MIB
    assert r["raw_mallocs"] == r["num_device_alloc"] == 3
    assert r["raw_frees"] == 0
    assert r["raw_mallocs_per_iteration"] == [3, 0]
    assert r["raw_mallocs_after_first_iteration"] == 0
    assert r["num_ooms"] == 0 and r["num_alloc_retries"] == 0
    assert report["reserved_over_requested"] == pytest.approx(40 * MIB / 21_472_520)

    # Iteration 2 places c best-fit in the smallest free block that holds it,
    # the 18 MiB segment, leaving 18 MiB - block(c); d then fills the 20 MiB
    # segment but for 20 MiB - block(d). Free cached bytes = reserved -
    # allocated, the largest of them the 18 MiB segment's remainder.
    largest = 18 * MIB - block(C)
    cached_free = 40 * MIB - r["peak_allocated_bytes"]
    assert cached_free == (2 * MIB - block(A) - block(B)) + largest + (20 * MIB - block(D))
    assert r["largest_free_block"] == largest
    assert r["fragmentation"] == pytest.approx(1 - largest / cached_free, abs=1e-6)

    # npualloc asks for segments with aclrtMallocAlign32, which the simulator
    # charges their size: 40 MiB of segments cost 40 MiB, so the smallest HBM
    # (in whole MiB) is 40 MiB, and the search resolves to 1 MiB at this size.
    assert report["fits"]
    assert report["smallest_hbm_bytes"] == 40 * MIB
    assert report["smallest_hbm_resolution_bytes"] == MIB


def test_tiny_trace_on_the_raw_runtime():
    r = replay_json(TINY, "--raw")["replay"]
    assert not r["npualloc_loaded"] and r["peak_reserved_bytes"] is None
    # Every call reaches the runtime: 4 allocs per iteration, 4 frees in between.
    assert (r["raw_mallocs"], r["raw_frees"]) == (8, 4)
    assert r["raw_mallocs_per_iteration"] == [4, 4]
    assert r["peak_requested_bytes"] == A + B + C + D


def test_raw_runtime_smallest_hbm_is_the_accounted_peak():
    # Raw, the device holds exactly the live requests, each charged
    # round_up(size, 32) + 32: 21472672 B at the end, just over 20 MiB.
    report = replay_json(TINY, "--raw")
    accounted = sum((x + 31) // 32 * 32 + 32 for x in (A, B, C, D))
    assert 20 * MIB < accounted <= 21 * MIB
    assert report["smallest_hbm_bytes"] == 21 * MIB


def test_oom_stops_the_replay_and_is_reported():
    # 39 MiB of HBM: a, b, c fit (2 + 20 MiB segments); d's 18 MiB segment
    # does not, nothing cached can be released (both segments hold live
    # blocks), so event 4 (alloc d, after a, b, c, free a) is an OOM.
    report = replay_json(TINY, "--hbm", "39M", "--no-search")
    r = report["replay"]
    assert not report["fits"] and r["oom"] and not r["completed"]
    assert r["failed_event"] == 4 and r["failed_size"] == D
    assert report["failed_trace_entry"] == 5   # entry 4 is a's free_completed, not replayed
    assert r["num_ooms"] == 1
    assert "smallest_hbm_bytes" not in report


def test_text_report():
    out = run_replay(str(TINY), "--build", str(BUILD), "--no-search").stdout
    assert "peak reserved      40.00 MiB  (reserved/requested 1.953)" in out
    assert "raw device calls   3 mallocs, 0 frees, 0 mallocs after iteration 1" in out
    assert "fits in 64.00 GiB  yes" in out


def first_iterations(trace: Path, iterations: int, out: Path) -> Path:
    """The trace cut after its n-th iteration mark, as a snapshot file."""
    snapshot = replay.load_snapshot(trace)
    events = snapshot["device_traces"][0]
    marks = [i for i, e in enumerate(events) if e["action"] == "snapshot"]
    snapshot["device_traces"] = [events[:marks[iterations - 1] + 1]]
    with open(out, "wb") as f:
        pickle.dump(snapshot, f)
    return out


def test_shipped_decode_trace_makes_no_raw_malloc_after_its_first_iteration(tmp_path):
    # GPT-2 decoding, the same request shape repeated: iteration 2 must be
    # served entirely from what iteration 1 left cached.
    sliced = first_iterations(TRACES / "gpt2_decode.pickle.gz", 2, tmp_path / "decode2.pickle")
    r = replay_json(sliced, "--no-search")["replay"]
    assert r["completed"] and r["iterations"] == 2
    assert r["raw_mallocs_per_iteration"][0] > 0
    assert r["raw_mallocs_after_first_iteration"] == 0


def test_shipped_traces_are_well_formed():
    for path in sorted(TRACES.glob("*.pickle.gz")):
        with gzip.open(path, "rb") as f:
            snapshot = pickle.load(f)
        assert snapshot["segments"] == [] and snapshot["allocator_settings"] == {}
        live: dict[int, int] = {}
        for e in snapshot["device_traces"][0]:
            assert set(e) == {"action", "addr", "size", "stream", "time_us", "frames"}, path
            if e["action"] == "alloc":
                assert e["addr"] not in live, path
                live[e["addr"]] = e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                assert live.pop(e["addr"]) == e["size"], path


def test_event_file_skips_what_cannot_be_replayed(tmp_path):
    snapshot = {"device_traces": [[
        {"action": "alloc", "addr": 16, "size": 100},
        {"action": "alloc", "addr": 16, "size": 200},           # still live: skipped
        {"action": "free", "addr": 16, "size": 100},             # the old format's free
        {"action": "free_requested", "addr": 48, "size": 64},    # never allocated: skipped
        {"action": "alloc", "addr": 32, "size": 300},
        {"action": "free_completed", "addr": 32, "size": 300},   # no request came first: it is the free
        {"action": "segment_alloc", "addr": 0, "size": 2 * MIB},  # the allocator's own: ignored
        {"action": "snapshot", "addr": 0, "size": 0},
    ]]}
    written = replay.write_event_file(snapshot, tmp_path / "events.bin")
    assert (written.allocs, written.frees, written.iterations) == (2, 2, 1)
    assert (written.skipped_allocs, written.skipped_frees) == (1, 1)
    assert written.slot_count == 1   # the freed slot is reused
    data = (tmp_path / "events.bin").read_bytes()
    assert data[:8] == replay.EVENT_FILE_MAGIC
    assert len(data) == replay.EVENT_FILE_HEADER.size + 5 * replay.EVENT.size


def test_an_alloc_of_0_bytes_takes_no_memory_as_in_torch(tmp_path):
    """torch's allocator serves a 0-byte request with a null pointer, no block
    and no trace entry; the runtime refuses aclrtMalloc(0). A trace holding
    one (another recorder's, one made by hand) stopped the replay with "the
    replayer stopped at event 1: aclError 100000". Such allocs and their
    frees are counted and not replayed, however many share an address."""
    trace = tmp_path / "zero.pickle"
    trace.write_bytes(pickle.dumps({"device_traces": [[
        {"action": "alloc", "addr": 16, "size": 100},
        {"action": "alloc", "addr": 0, "size": 0},
        {"action": "alloc", "addr": 0, "size": 0},
        {"action": "free_requested", "addr": 0, "size": 0},
        {"action": "free_completed", "addr": 0, "size": 0},
        {"action": "free_requested", "addr": 0, "size": 0},
        {"action": "free_completed", "addr": 0, "size": 0},
        {"action": "free_requested", "addr": 16, "size": 100},
        {"action": "free_completed", "addr": 16, "size": 100},
    ]]}))
    report = replay_json(trace, "--no-search")
    assert (report["allocs"], report["frees"], report["zero_size_allocs"]) == (1, 1, 2)
    assert (report["skipped_allocs"], report["skipped_frees"]) == (0, 0)
    assert report["fits"] and report["replay"]["events"] == 2 and report["replay"]["peak_requested_bytes"] == 100
    text = run_replay(str(trace), "--build", str(BUILD), "--no-search").stdout
    assert "not replayed       2 allocs of 0 bytes (torch's allocator gives them no memory)\n" in text


def test_a_replayer_error_names_the_trace_entry(tmp_path):
    """The replayer numbers the events it was given, which leave out the
    entries not replayed: "stopped at event 1" named the second replayed
    event, entry 3 of this trace, where a reader of the trace looks at entry 1."""
    written = replay.write_event_file({"device_traces": [[
        {"action": "alloc", "addr": 16, "size": 100},
        {"action": "segment_alloc", "addr": 0, "size": 2 * MIB},
        {"action": "free_requested", "addr": 48, "size": 64},    # never allocated: skipped
        {"action": "alloc", "addr": 32, "size": 300},
    ]]}, tmp_path / "events.bin")
    assert list(written.trace_entries) == [0, 3]
    replayer = tmp_path / "replayer"
    replayer.write_text("""#!/bin/sh\necho '{"acl_error": 100000, "failed_event": 1, "failed_size": 300}'\n""")
    replayer.chmod(0o755)
    tools = replay.Toolchain(replayer, tmp_path / "libnpualloc.so", tmp_path)
    with pytest.raises(replay.ReplayError, match=re.escape(
            "the replayer stopped at entry 3 of device 0's trace (300 B): aclError 100000")):
        replay.run_replayer(tools, written, {})


@pytest.mark.parametrize("text,value", [("64G", 64 << 30), ("16GiB", 16 << 30), ("512M", 512 * MIB),
                                        ("1.5T", 3 << 39), ("4096", 4096), ("2mb", 2 * MIB)])
def test_parse_size(text, value):
    assert replay.parse_size(text) == value


def test_missing_runtime_is_one_line_error(tmp_path):
    proc = run_replay(str(TINY), "--build", str(BUILD), "--runtime", str(tmp_path), check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.startswith("npualloc: no simulated runtime found") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("option", ["--build", "--runtime"])
def test_an_empty_directory_option_is_one_line_error(option):
    """--build "" or --runtime "" (a script's unset variable) read as not
    given: the replay ran with the package's tools or another runtime, exit 0."""
    proc = run_replay(str(TINY), option, "", "--no-search", check=False)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"npualloc: {option}: an empty path names no directory\n"


def test_not_a_snapshot_is_one_line_error(tmp_path):
    bogus = tmp_path / "x.pickle"
    bogus.write_bytes(b"not a pickle")
    proc = run_replay(str(bogus), "--build", str(BUILD), check=False)
    assert proc.returncode != 0 and proc.stderr.startswith("npualloc: ") and proc.stderr.count("\n") == 1


class _CreatesAFile:
    """Unpickling this object would run os.system and create the victim file."""

    def __init__(self, victim: Path) -> None:
        self.victim = victim

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.victim}",))


@pytest.mark.parametrize("compress", [False, True])
def test_crafted_pickle_runs_no_code(tmp_path, compress):
    victim = tmp_path / "created-by-the-pickle"
    data = pickle.dumps({"segments": [], "device_traces": [[_CreatesAFile(victim)]]})
    crafted = tmp_path / "crafted.pickle"
    crafted.write_bytes(gzip.compress(data) if compress else data)
    proc = run_replay(str(crafted), "--build", str(BUILD), check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.startswith("npualloc: ") and proc.stderr.count("\n") == 1
    assert "posix.system" in proc.stderr or "os.system" in proc.stderr
    with pytest.raises(replay.ReplayError):
        replay.load_snapshot(crafted)
    assert not victim.exists()


@pytest.mark.parametrize("conf", ["foo:1", "expandable_segments:True,max_split_size_mb:128",
                                  "max_split_size_mb:banana"])
def test_replay_conf_warns_as_run_conf_does(tmp_path, conf):
    """One parser (the library's), the same warnings: replay --conf and run
    --conf print the same lines, each naming its own command."""
    allocate = "import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)"
    ran = subprocess.run([sys.executable, "-m", "npualloc", "run", "--conf", conf, "--", sys.executable, "-c",
                          allocate], env=sim_env(NPUALLOC_SHM_DIR=str(tmp_path)), capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr
    warnings = ran.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: npualloc run --conf: "), ran.stderr
    for json_flag in ([], ["--json"]):
        replayed = run_replay(str(TINY), "--build", str(BUILD), "--no-search", "--conf", conf, *json_flag)
        assert replayed.stderr.splitlines() == [w.replace("npualloc run --conf", "npualloc replay --conf")
                                                for w in warnings]
    assert json.loads(replayed.stdout)["warnings"] == replayed.stderr.splitlines()


def test_replay_conf_that_is_valid_warns_nothing():
    replayed = run_replay(str(TINY), "--build", str(BUILD), "--no-search", "--conf", "expandable_segments:True")
    assert replayed.stderr == ""


def test_an_oom_nobody_searched_for_exits_non_zero():
    """--no-search: the replay answers "does it fit in --hbm?", no is exit 10
    (the report is still printed). With the search the OOMs are the search's
    own and the report answers what fits: exit 0."""
    proc = run_replay(str(TINY), "--build", str(BUILD), "--hbm", "39M", "--no-search", check=False)
    assert proc.returncode == replay.EXIT_DID_NOT_FIT, proc.stderr
    assert "fits in 39.00 MiB  no: OOM at trace entry 5 (16.00 MiB)" in proc.stdout
    proc = run_replay(str(TINY), "--build", str(BUILD), "--hbm", "39M", "--no-search", "--json", check=False)
    assert proc.returncode == replay.EXIT_DID_NOT_FIT and not json.loads(proc.stdout)["fits"]
    searched = run_replay(str(TINY), "--build", str(BUILD), "--hbm", "39M", "--json")
    report = json.loads(searched.stdout)
    assert not report["fits"] and report["smallest_hbm_bytes"] == 40 * MIB
    assert run_replay(str(TINY), "--build", str(BUILD), "--no-search").returncode == 0


def test_hbm_past_what_the_simulator_models_is_one_line_error(tmp_path):
    """The simulator reserves an arena of twice its HBM (and 1 GiB), which
    x86-64's 128 TiB of user address space refuses from 48 TiB on: the
    search's 64 TiB ceiling was never reached, a trace asking for 1 PiB ended
    in "runtime start-up failed: aclError 207001", and --hbm 16777216T (2**64
    bytes, 0 once the simulator shifted its MiB into bytes) said the tiny
    trace does not fit. The ceiling is 16 TiB, and --hbm past it refused."""
    huge = tmp_path / "huge.pickle"
    huge.write_bytes(pickle.dumps({"device_traces": [[{"action": "alloc", "addr": 0, "size": 1 << 50}]]}))
    proc = run_replay(str(huge), "--build", str(BUILD), check=False)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert proc.stderr == "npualloc: does not fit even in 16.00 TiB\n"
    for hbm in ("17T", "16777216T"):
        proc = run_replay(str(TINY), "--build", str(BUILD), "--hbm", hbm, "--no-search", check=False)
        assert proc.returncode == 1 and proc.stdout == "", proc.stderr
        assert proc.stderr == f"npualloc: --hbm: {hbm} is past the 16.00 TiB the simulator models\n"


def _stopped(child: psutil.Process) -> bool:
    """Stops child (SIGSTOP); whether it is stopped, not ended first."""
    try:
        child.suspend()
        while (status := child.status()) not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
            time.sleep(0.001)
    except psutil.NoSuchProcess:
        return False
    return status == psutil.STATUS_STOPPED


def test_ctrl_c_in_python_m_npualloc_replay_is_the_clis_one_line() -> None:
    """`python -m npualloc.replay` had its own main, which caught only
    ReplayError: Ctrl-C during a replay was a KeyboardInterrupt traceback
    where `npualloc replay` says "interrupted" and exits 130. It is the CLI's
    command now. The signal comes while the replayer child runs: the child is
    stopped first, so it cannot finish before the signal lands (a replay
    without the latency model took 1 ms, and the command then exited 0 once in
    a loaded run); the CLI kills it on the interrupt. A child that ended
    before it could be stopped proves nothing, and the run is made again."""
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-m", "npualloc.replay", str(TRACES / "resnet_train.pickle.gz"),
                                 "--build", str(BUILD), "--raw", "--sim-latency"], env=sim_env(), cwd=ROOT,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        watched = psutil.Process(proc.pid)
        children: list[psutil.Process] = []
        while proc.poll() is None and not (children := watched.children()):
            time.sleep(0.01)
        stopped = bool(children) and _stopped(children[0])
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if stopped:
            break
    else:
        pytest.fail("the replayer child ended each time before it could be stopped")
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 130, "interrupted")
