"""Smoke checks of `make bench` and `make demo` at small scale: the hot-path
harness measures through npualloc (and glibc) and reports sane figures, the
demo's program runs raw and under `npualloc run`, and `npualloc stats` can be
taken from a second process while it waits. Timings are not asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BUILD, ROOT

sys.path[:0] = [str(ROOT / "tools" / "demo"), str(ROOT / "tools" / "bench")]
import launch  # noqa: E402
import run as bench  # noqa: E402

HOTPATH = BUILD / "bench" / "npualloc-bench-hotpath"


@pytest.fixture(scope="module", autouse=True)
def _harness_built():
    if not HOTPATH.exists():
        pytest.fail(f"{HOTPATH} is missing: `make all` builds it (tools/bench.mk)")


def trace_sizes() -> list[int]:
    """The sizes the harness walks (bench.SIZES, comment lines left out)."""
    return [int(line) for line in bench.SIZES.read_text().splitlines() if not line.startswith("#")]


def test_size_list_is_the_traces_distribution():
    sizes = trace_sizes()
    assert len(sizes) == 4096 and min(sizes) > 0
    assert sum(s <= 1 << 20 for s in sizes) > len(sizes) // 2      # mostly small-pool tensors ...
    assert max(sizes) > 32 << 20                                    # ... with a tail of large ones


@pytest.mark.parametrize("reuse, group", [("eager", 1), ("safe", 4)])
def test_hotpath_goes_through_npualloc_and_hits_the_cache(reuse, group):
    r = bench.run_hotpath(BUILD, "npualloc", threads=2, reuse=reuse, group=group, batches=20, pairs=100)
    assert r["npualloc_loaded"] and not r["failed"]
    assert len(r["per_thread"]) == 2 and r["group"] == group
    timed_pairs = 2 * 20 * 100
    assert r["cache_hits_while_timed"] + r["cache_misses_while_timed"] == timed_pairs
    assert r["raw_mallocs_while_timed"] == r["cache_misses_while_timed"]
    assert r["cache_misses_while_timed"] < timed_pairs // 100       # the warm-up pass filled the cache
    assert 0 < r["p10_ns"] <= r["median_ns"] <= r["p90_ns"]
    # Timings are reported, never judged: a loaded machine stretches them.
    assert all({"pairs_per_s", "wall_s", "cpu_s", "sleeps"} <= set(t) and t["sleeps"] >= 0 for t in r["per_thread"])


def test_hotpath_stream_entry_makes_no_runtime_call_once_warm():
    """The stream-aware entry on each thread's own stream: every timed pair a
    cache hit, and not one raw malloc, event, query or synchronize. With the
    pass-through's host-writes flag each batch of frees costs one event."""
    r = bench.run_hotpath(BUILD, "stream", threads=2, reuse="safe", batches=20, pairs=100)
    assert r["allocator"] == "stream" and r["npualloc_loaded"] and not r["failed"]
    assert r["cache_hits_while_timed"] == 2 * 20 * 100 and r["cache_misses_while_timed"] == 0
    assert r["runtime_calls_while_timed"] == {api: 0 for api in r["runtime_calls_while_timed"]}
    assert set(r["runtime_calls_while_timed"]) >= {"aclrtMalloc", "aclrtMallocAlign32", "aclrtRecordEvent", "aclrtQueryEventStatus"}
    fenced = bench.run_hotpath(BUILD, "stream-host-writes", threads=1, reuse="safe", group=16, batches=10, pairs=160)
    calls = fenced["runtime_calls_while_timed"]
    assert calls["aclrtRecordEvent"] == 10 * 160 // 16        # one event per batch of 16 frees, on the one stream
    assert calls["aclrtSynchronizeDevice"] == 0


def test_hotpath_glibc_baseline_runs_without_npualloc():
    r = bench.run_hotpath(BUILD, "glibc", threads=1, batches=10, pairs=100)
    assert not r["npualloc_loaded"] and not r["failed"] and r["median_ns"] > 0
    assert "cache_hits_while_timed" not in r


def test_hotpath_max_size_leaves_out_the_larger_sizes():
    sizes = trace_sizes()
    r = bench.run_hotpath(BUILD, "glibc", threads=2, batches=5, pairs=100, max_size=1 << 20)
    assert r["max_size"] == 1 << 20 and r["sizes"] == sum(s <= 1 << 20 for s in sizes) < len(sizes)
    whole = bench.run_hotpath(BUILD, "glibc", threads=1, batches=5, pairs=100)
    assert whole["max_size"] == 0 and whole["sizes"] == len(sizes)


def test_hotpath_shared_counter_counts_what_the_threads_hold_together():
    """--shared-counter: every malloc adds its size to one count shared by
    the threads and every free takes it back, so it ends at zero; alone, a
    thread's peak is the largest size it walked (it frees each block before
    the next malloc); two threads together hold up to two blocks at once."""
    arena = [s for s in trace_sizes() if s <= bench.GLIBC_ARENA_SIZES]
    alone = bench.run_hotpath(BUILD, "glibc-counted", threads=1, batches=5, pairs=100, max_size=bench.GLIBC_ARENA_SIZES)
    assert not alone["failed"] and alone["shared_counter"] == {"current": 0, "peak": max(arena)}
    two = bench.run_hotpath(BUILD, "glibc-counted", threads=2, batches=20, pairs=100, max_size=bench.GLIBC_ARENA_SIZES)
    assert not two["failed"] and two["shared_counter"]["current"] == 0
    assert max(arena) <= two["shared_counter"]["peak"] <= 2 * max(arena)
    plain = bench.run_hotpath(BUILD, "glibc", threads=1, batches=5, pairs=100, max_size=bench.GLIBC_ARENA_SIZES)
    assert "shared_counter" not in plain


def test_hotpath_core_alone_walks_the_same_sizes_without_acl():
    r = bench.run_hotpath(BUILD, "core", threads=2, batches=10, pairs=100)
    assert r["allocator"] == "core" and not r["npualloc_loaded"] and not r["failed"]
    timed_pairs = 2 * 10 * 100
    assert r["cache_hits_while_timed"] + r["cache_misses_while_timed"] == timed_pairs
    assert r["cache_misses_while_timed"] < timed_pairs // 100
    assert r["raw_mallocs_while_timed"] == 0          # the simulator is not involved


def test_hot_path_rounds_give_ratios_and_goals(monkeypatch):
    monkeypatch.setattr(bench, "HOTPATH_ROUNDS", 2)
    monkeypatch.setattr(bench, "HOTPATH_BATCHES", 5)
    monkeypatch.setattr(bench, "HOTPATH_PAIRS", 32)
    started: list[dict] = []
    run_hotpath = bench.run_hotpath

    def recorded(*args, **kwargs):
        result = run_hotpath(*args, **kwargs)
        started.append({"threads": result["threads"], "cpu": kwargs.get("cpu"), "cpus_allowed": result["cpus_allowed"]})
        return result

    monkeypatch.setattr(bench, "run_hotpath", recorded)
    h = bench.hot_path(BUILD)
    assert h["rounds"] == 2 and {r["key"] for r in h["rows"]} == {key for key, *_ in bench.HOTPATH_CASES}
    # A round's one-thread runs all ran pinned to one CPU, the rounds taking
    # the CPUs in turn; the several-thread runs were not pinned.
    cpus = sorted(os.sched_getaffinity(0))
    per_round = len(bench.HOTPATH_CASES)
    for index, run in enumerate(started):
        if run["threads"] == 1:
            assert run["cpu"] == cpus[index // per_round % len(cpus)] and run["cpus_allowed"] == 1, run
        else:
            assert run["cpu"] is None and run["cpus_allowed"] == len(cpus), run
    assert set(h["by_cpu"]) == {cpus[i % len(cpus)] for i in range(2)}
    for value in h["ratios"].values():
        assert 0 < value["min"] <= value["median"] <= value["max"]
    single = next(r for r in h["rows"] if r["key"] == "eager1")
    assert single["loss_vs_1_thread"] == {"median": 0.0, "min": 0.0, "max": 0.0}
    # Each several-thread case's loss is against the one-thread case on the same sizes.
    assert {c.key: bench.single_thread_case(c) for c in bench.HOTPATH_CASES if c.threads > 1} == {
        "eager2": "eager1", "eager4": "eager1", "glibc2": "glibc1", "glibc4": "glibc1",
        "glibc2arena": "glibc1arena", "glibc4arena": "glibc1arena", "glibc2counted": "glibc1counted"}
    arena = next(r for r in h["rows"] if r["key"] == "glibc2arena")
    assert arena["max_size"] == bench.GLIBC_ARENA_SIZES
    goals = bench.hot_path_goals(h)
    assert any("1.3x of glibc" in text for text, _met, _detail in goals)
    assert sum("on the sizes up to 1 MiB only" in detail for _text, _met, detail in goals) == 2
    two_threads = next(detail for text, _met, detail in goals if text.startswith("2 threads"))
    counted, arena = (next(r for r in h["rows"] if r["key"] == key) for key in ("glibc2counted", "glibc2arena"))
    assert bench.shared_count_loss(counted, arena) in two_threads
    added_ns = 1e9 / counted["per_thread_pairs_per_s"] - 1e9 / arena["per_thread_pairs_per_s"]
    assert f"{added_ns:.0f} ns a pair more per thread" in two_threads
    assert all(met in (True, False, None) and detail for _text, met, detail in goals)
    text = "\n".join(bench.hot_path_markdown(h))
    assert "exported pair / glibc" in text and "core alone / exported pair" in text
    four = next(r for r in h["rows"] if r["key"] == "eager4")
    assert len(four["thread_shares"]) == 4 and all(0 < share <= 1.01 for share in four["thread_shares"])


def test_per_thread_rate_gives_an_unfair_lock_nothing():
    """Two threads of 1000 pairs each: served one after the other (the
    first done in 1 s, the second in 2 s) they did 1000 pairs per second
    together, 500 each, however the mean of their own rates reads (750)."""
    def run(walls: list[float]) -> dict:
        return {"batches": 10, "pairs_per_batch": 100,
                "per_thread": [{"wall_s": wall, "pairs_per_s": 1000 / wall} for wall in walls]}

    assert bench.per_thread_rate(run([1.0, 2.0])) == pytest.approx(500)
    assert bench.per_thread_rate(run([2.0, 2.0])) == pytest.approx(500)
    assert bench.per_thread_rate(run([0.5])) == pytest.approx(2000)


def test_thread_goals_are_unjudgeable_on_a_loaded_machine(monkeypatch):
    """A thread-scaling figure counts only when each thread had nearly the
    CPU share an idle machine gives it: else UNJUDGEABLE, never MET."""
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)

    def row(threads: int, share: float) -> dict:
        return {"threads": threads, "cpu_share": {"median": share, "min": share, "max": share},
                "loss_by_round": [0.5] * 6}

    every = list(range(6))
    assert bench.judged(row(2, 0.34), every, True) is None
    assert bench.judged(row(2, 0.34), every, False) is None
    assert bench.judged(row(2, 0.95), every, True) is True
    assert bench.judged(row(2, 0.95), every, False) is False
    assert bench.judged(row(4, 0.47), every, False) is False   # half a core each is all 4 threads get on 2 cores
    assert bench.judged(row(4, 0.22), every, True) is None
    assert "loaded" in bench.unjudgeable_note(row(2, 0.34), every) and bench.unjudgeable_note(row(2, 0.95), every) == ""


def test_thread_goals_leave_out_rounds_whose_one_thread_runs_were_slowed():
    """A round's thread loss is taken against its own one-thread runs: a
    round where the host slowed those is left out of the goal, and a run
    with most rounds slowed is UNJUDGEABLE."""
    def single(*ns: float) -> dict:
        return {"ns_by_round": list(ns)}

    eager1 = single(45.1, 81.4, 46.0, 45.5, 45.9, 46.3)
    glibc1 = single(34.6, 35.0, 34.4, 52.0, 34.9, 35.1)
    assert bench.steady_rounds(eager1) == [0, 2, 3, 4, 5]
    assert bench.steady_rounds(eager1, glibc1) == [0, 2, 4, 5]          # either one slowed leaves a round out
    losses = [0.56, 0.20, 0.55, 0.57, 0.54, 0.58]
    eager2 = {"threads": 2, "cpu_share": {"median": 1.0}, "loss_by_round": losses,
              "loss_vs_1_thread": {"median": 0.555, "min": min(losses), "max": max(losses)}}
    steady = bench.steady_rounds(eager1)
    assert bench.loss_over(eager2, steady) == pytest.approx(0.56)       # the slowed round's 20% is not counted
    assert bench.judged(eager2, steady, False) is False
    assert bench.thread_loss(eager2, steady).startswith("56% over the 5 steady rounds of 6, 56% [20%-58%] over all")
    slowed = bench.steady_rounds(single(45.1, 81.4, 80.0, 79.0, 45.5, 46.0))
    assert slowed == [0, 4, 5] and bench.judged(eager2, slowed, True) is None
    assert "3 of 6 rounds" in bench.unjudgeable_note(eager2, slowed)


def test_ratio_goals_leave_out_rounds_where_either_side_was_slowed():
    """A one-thread ratio is judged over the rounds in which both its cases
    ran steady: a round whose one side ran on a CPU the host slowed is left
    out, whichever side it was, and a run with half its rounds slowed is
    UNJUDGEABLE, as the thread goals are."""
    def hot(top: list[float], bottom: list[float]) -> dict:
        by_round = [t / b for t, b in zip(top, bottom)]
        return {"rows": [{"key": "eager1", "ns_by_round": top}, {"key": "glibc1", "ns_by_round": bottom}],
                "ratios_by_round": {"eager1/glibc1": by_round}, "ratios": {"eager1/glibc1": bench.spread(by_round)}}

    within = lambda r: r["median"] <= 1.3                                # noqa: E731
    glibc = [35.1, 35.3, 35.2, 35.0, 35.4, 35.1]
    # One round of npualloc's case slowed (80.7 ns): left out.
    met, text = bench.ratio_verdict(hot([44.3, 80.7, 44.5, 44.1, 45.0, 44.6], glibc), "eager1/glibc1", within)
    assert met is True
    assert text == "1.26 [1.26-1.27] over the 5 steady rounds of 6, 1.27 [1.26-2.29] over all"
    # A round of glibc's case slowed flatters npualloc (0.83x there): left out as well.
    flattered = hot([46.4, 46.0, 46.2, 46.1, 46.5, 46.3], [35.1, 55.8, 35.2, 35.0, 35.4, 35.1])
    met, text = bench.ratio_verdict(flattered, "eager1/glibc1", within)
    assert met is False and text.startswith("1.32 [1.31-1.32] over the 5 steady rounds of 6, 1.32 [0.82-1.32]")
    # Half the rounds slowed (one CPU's, as at 16:12 UTC): UNJUDGEABLE, never MET or NOT MET.
    met, text = bench.ratio_verdict(hot([44.3, 80.7, 44.5, 80.9, 44.1, 80.2], glibc), "eager1/glibc1", within)
    assert met is None and "3 of 6 rounds: the machine was disturbed" in text
    # The saver goal's "spans 1" over the steady rounds only: the round whose
    # glibc case was slowed (0.51x) would have made it span 1.
    spans_one = lambda r: r["min"] <= 1.0 <= r["max"]                    # noqa: E731
    slowed_bottom = hot([35.5, 35.6, 35.4, 35.7, 35.5, 35.6], [35.1, 35.3, 35.2, 35.0, 35.4, 70.0])
    assert spans_one(slowed_bottom["ratios"]["eager1/glibc1"])
    met, text = bench.ratio_verdict(slowed_bottom, "eager1/glibc1", spans_one, ".3f")
    assert met is False and text.startswith("1.008 [1.003-1.020] over the 5 steady rounds of 6")


def test_spreads_print_no_negative_zero():
    """A loss of -0.2% rounds to 0%, not "-0%"; real negatives keep their sign."""
    assert bench.fmt_spread({"median": -0.002, "min": -0.02, "max": 0.03}, ".0%") == "0% [-2%-3%]"
    assert bench.fmt_spread({"median": -0.0004, "min": -0.5, "max": 1.0}) == "0.00 [-0.50-1.00]"


def test_hotpath_harness_rejects_bad_usage():
    proc = subprocess.run([str(HOTPATH), "--group", "3", "--pairs", "10", str(bench.SIZES)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr
    assert "--pairs (10) must be a multiple of --group (3)" in proc.stderr      # says which rule
    proc = subprocess.run([str(HOTPATH), "--allocator", "glibc", "--fence-after", "4", str(bench.SIZES)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr   # fences are the core's
    proc = subprocess.run([str(HOTPATH), "--allocator", "core", "--shared-counter", str(bench.SIZES)],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr   # the shared count goes with glibc only
    for bad in ("0", "-1", "12k", ""):
        proc = subprocess.run([str(HOTPATH), "--max-size", bad, str(bench.SIZES)], capture_output=True, text=True)
        assert proc.returncode == 2 and "usage" in proc.stderr, bad


def test_hotpath_core_with_fences_walks_the_fence_path():
    """--fence-after: the core alone under safe reuse, its fences done a set
    number of mallocs after their record (what callgrind counts for the
    fence path without the simulator's stream thread); the JSON counts its
    fence records and queries as event records and queries."""
    proc = subprocess.run([str(HOTPATH), "--allocator", "core", "--group", "16", "--batches", "10", "--pairs", "160",
                           "--fence-after", "16", str(bench.SIZES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    calls = r["runtime_calls_while_timed"]
    assert not r["failed"] and calls["aclrtRecordEvent"] > 0 and calls["aclrtQueryEventStatus"] > 0
    assert r["cache_hits_while_timed"] + r["cache_misses_while_timed"] == 10 * 160


def test_demo_program_raw_and_under_npualloc_with_live_stats():
    raw = launch.run_train_step(False, steps=4, layers=2, build=BUILD)
    seen = []

    def stats(pid: int) -> None:
        proc = subprocess.run([sys.executable, "-m", "npualloc", "stats", str(pid)], cwd=ROOT,
                              env=launch.sim_environment(BUILD), capture_output=True, text=True, timeout=30)
        seen.append((pid, proc.returncode, proc.stdout))

    npa = launch.run_train_step(True, steps=4, layers=2, build=BUILD, while_paused=stats)
    (pid, code, text), = seen
    assert code == 0 and f"pid {pid}" in text and "reserved" in text and "cache hit rate" in text
    # one definition: the runtime's count since start at the pause is what stats shows
    device_calls = next(line for line in text.splitlines() if "device calls" in line).split()
    assert int(device_calls[2]) == npa["raw_mallocs_since_start_mid"] > 0
    for r in (raw, npa):
        assert r["invalid_accesses"] == 0 and r["workspace_clobbers"] == 0
        assert r["steps"] == 4 and r["step_ms_median"] > 0 and r["peak_device_bytes"] > 0
    # every op's workspace is a raw call on the runtime alone; npualloc serves them from its cache
    assert raw["raw_mallocs"] == raw["raw_frees"] >= 4 * 2 * 9
    assert npa["raw_mallocs"] < raw["raw_mallocs"] // 4 and npa["raw_frees"] == 0


def test_demo_table_and_bench_trace_row_render():
    sys.path.insert(0, str(ROOT / "tools"))
    import demo

    result = {"steps": 2, "step_ms_median": 2.0, "step_ms_first": 3.0, "steps_seconds": 0.01, "raw_mallocs": 5,
              "raw_frees": 5, "raw_calls_after_first_step": 4, "raw_mallocs_since_start_mid": 7,
              "peak_device_bytes": 1 << 20,
              "invalid_accesses": 0, "workspace_clobbers": 0}
    table = demo.comparison_table(result, dict(result, step_ms_median=1.0))
    assert len({len(line) for line in table}) == 1 and "2.0x faster" in "".join(table)

    tiny = str(ROOT / "tools" / "traces" / "tiny.pickle.gz")
    npa = bench.replay_trace(BUILD, tiny, latency=True)
    raw = bench.replay_trace(BUILD, tiny, raw=True, latency=True)
    expandable = bench.replay_trace(BUILD, tiny, latency=True, conf=bench.EXPANDABLE)
    row = {"trace": "tiny", "events": npa["replay"]["events"], "iterations": npa["iterations"], "raw": raw["replay"],
           "npualloc": npa["replay"], "expandable": expandable["replay"],
           "reserved_over_requested": npa["reserved_over_requested"],
           "expandable_reserved_over_requested": expandable["reserved_over_requested"],
           "replay_events_per_second": 1e6}
    assert raw["replay"]["raw_mallocs"] == npa["allocs"] and npa["replay"]["raw_mallocs"] < raw["replay"]["raw_mallocs"]
    rendered = bench.traces_markdown([row])[-1]
    assert rendered.startswith("| tiny | ")
    assert f"{npa['reserved_over_requested']:.3f} / {expandable['reserved_over_requested']:.3f}" in rendered


def test_pause_bench_section_measures_both_paths_and_renders(monkeypatch):
    import pause as pause_bench
    monkeypatch.setattr(pause_bench, "SIZE_MIB", 8)
    monkeypatch.setattr(pause_bench, "REPEATS", 2)
    result = pause_bench.measure(BUILD)
    assert result["bytes"] == 8 << 20 and len(result["saver"]) == 2 and len(result["command"]) == 2
    table = "\n".join(pause_bench.markdown(result))
    assert "memory_saver.pause/resume" in table and "region command" in table


def test_stacks_bench_section_measures_four_modes_and_renders():
    import stacks as stacks_bench
    r = stacks_bench.measure(BUILD, pairs=200, repeats=1, rounds=2)
    assert r["pairs"] == 200 and r["rounds"] == 2
    assert all(len(r[mode]) == 2 and min(r[mode]) > 0 for mode in ("off", "history", "stacks", "freeing"))
    text = "\n".join(stacks_bench.markdown(r))
    assert "| record_history |" in text and "record_stacks:python (12 frames)" in text and "for the stack" in text
    assert "record_context:all" in text and "for the free's stack" in text
    # What a mode adds is the difference within each round, not between the
    # modes' medians: rounds made up so that the two disagree (history adds
    # 100, 50, 150 in its rounds; its median minus off's is 150).
    made_up = {"pairs": 1, "repeats": 1, "rounds": 3, "off": [400.0, 1200.0, 800.0],
               "history": [500.0, 1250.0, 950.0], "stacks": [520.0, 1270.0, 970.0],
               "freeing": [530.0, 1290.0, 970.0]}
    rows = {line.split(" | ")[0].strip("| "): line for line in stacks_bench.markdown(made_up) if line.startswith("|")}
    assert rows["record_history"].endswith("| +100 [+50-+150] |"), rows
    assert "+20 [+20-+20] for the stack" in rows["+ record_stacks:python (12 frames)"], rows
    assert "+10 [+0-+20] for the free's stack" in rows["+ record_context:all (the free's stack too)"], rows
