"""Python stacks in history (record_stacks:python): each recorded alloc event
carries the frames of the Python code that allocated, in torch's format, so
torch's own _memory_viz names the lines that hold the memory; none when off;
the tables stay bounded."""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import preload_env, run_python

# A pyACL program: acl.rt.malloc releases the GIL around the runtime call, as
# the real pyACL does, so the capture has to take it.
PROGRAM = """
    import acl, json, sys, npualloc
    MiB = 1 << 20
    def make_weight():
        ptr, ret = acl.rt.malloc(4 * MiB, 0)
        assert ret == 0
        return ptr
    def forward(n):
        return [make_weight() for _ in range(n)]
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    {setup}
    held = forward(2)
    {after}
"""


def _alloc_frames(snapshot: dict) -> list[list[dict]]:
    return [e["frames"] for e in snapshot["device_traces"][0] if e["action"] == "alloc"]


def test_in_process_stacks_name_the_allocating_lines(tmp_path: Path) -> None:
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, stacks='python')",
                          after=f"npualloc.dump_snapshot({str(out)!r})")
    run_python(code, preload_env())
    snapshot = pickle.loads(out.read_bytes())
    stacks = _alloc_frames(snapshot)
    assert len(stacks) == 2 and stacks[0] == stacks[1]
    blocks = [b for seg in snapshot["segments"] for b in seg["blocks"]]
    assert [b["frames"] for b in blocks if b["state"] == "active_allocated"] == stacks  # blocks carry them too
    assert all(b["frames"] == [] for b in blocks if b["state"] == "inactive")
    # innermost first, as torch: make_weight's malloc line, forward (through
    # its comprehension's frame before Python 3.12), the module
    names = [(f["name"], f["line"]) for f in stacks[0] if f["name"] != "<listcomp>"]
    assert names == [("make_weight", 5), ("forward", 9), ("<module>", 12)], names
    assert all(f["filename"] == "<string>" for f in stacks[0])
    # the segment the first malloc made carries its frames, as torch's (context_when_segment_allocated)
    [segment_event] = [e for e in snapshot["device_traces"][0] if e["action"].startswith("segment_")]
    assert segment_event["action"] == "segment_alloc" and segment_event["frames"] == stacks[0]
    [segment] = snapshot["segments"]
    assert segment["address"] == segment_event["addr"] and segment["frames"] == stacks[0]


def test_context_state_keeps_frames_for_live_blocks_and_segments_only(tmp_path: Path) -> None:
    """torch's context="state": stacks are kept for what the snapshot's
    segments hold (a live block's alloc, a segment's malloc) and no trace
    entry carries frames (torch's record_trace keeps a context from "alloc"
    up). It was recorded as "alloc": every alloc and free entry had frames."""
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, context='state')", after=f"""
    assert acl.rt.free(held[0]) == 0
    print(npualloc.get_config())
    npualloc.dump_snapshot({str(out)!r})
    """)
    proc = run_python(code, preload_env())
    assert "record_context:state" in proc.stdout, proc.stdout
    snapshot = pickle.loads(out.read_bytes())
    trace = snapshot["device_traces"][0]
    assert [e["action"] for e in trace] == ["segment_alloc", "alloc", "alloc", "free_requested", "free_completed"]
    assert all(e["frames"] == [] for e in trace), trace
    made = ["make_weight", "forward", "<module>"]
    [segment] = snapshot["segments"]
    assert _names(segment["frames"]) == made
    assert [(b["state"], _names(b["frames"])) for b in segment["blocks"]] == \
        [("inactive", []), ("active_allocated", made), ("inactive", [])]


def test_free_events_carry_the_frames_of_the_alloc_they_free(tmp_path: Path) -> None:
    """As torch's under context="alloc" (a block's context_when_allocated): a
    free event repeats the frames of the latest alloc at its address before
    it, also when another line allocated that address since."""
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, context='alloc', stacks='python')",
                          after=f"""
    def other():
        ptr, ret = acl.rt.malloc(4 * MiB, 0)
        return ptr
    acl.rt.free(held[0])
    again = other()
    acl.rt.free(again)
    print(json.dumps(again == held[0]))
    npualloc.dump_snapshot({str(out)!r})
    """)
    assert json.loads(run_python(code, preload_env()).stdout) is True  # the address was reused
    latest: dict[int, list[dict]] = {}
    freed_by = []
    for e in pickle.loads(out.read_bytes())["device_traces"][0]:
        if e["action"] == "alloc":
            latest[e["addr"]] = e["frames"]
        elif e["action"] in ("free_requested", "free_completed"):
            assert e["frames"] == latest[e["addr"]]
            freed_by.append(e["frames"][0]["name"])
    assert "make_weight" in freed_by and "other" in freed_by, freed_by


def _names(frames: list[dict]) -> list[str]:
    return [f["name"] for f in frames if f["name"] != "<listcomp>"]


FREEING = """
    def release(ptr):
        assert acl.rt.free(ptr) == 0
    def tidy():
        npualloc.empty_cache()
    def miss():
        return acl.rt.malloc(8 * MiB, 0)[0]
    release(held[0])
    release(held[1])
    tidy()
    again = forward(1)
    release(again[0])  # waits for its fence under reuse_policy:safe
    kept = miss()  # a size the cache lacks: fences the open frees and looks again
    npualloc.dump_snapshot({out!r})
"""


def _free_side(out: Path) -> list[tuple[str, list[str]]]:
    trace = pickle.loads(out.read_bytes())["device_traces"][0]
    return [(e["action"], _names(e["frames"])) for e in trace
            if e["action"] in ("free_requested", "free_completed", "segment_free")]


def test_free_events_carry_the_freeing_frames_under_context_all(tmp_path: Path) -> None:
    """torch's default context="all" gathers the frames of each free and of
    empty_cache, which the free's events and empty_cache's segment releases
    carry. A free that waited for its fence completes in a later call, whose
    frames it carries: empty_cache's synchronize (torch's
    synchronize_and_free_events) or a malloc's look (process_events)."""
    out = tmp_path / "snap.pickle"
    freed = ["release", "<module>"]
    tidied = ["empty_cache", "tidy", "<module>"]
    at_once = [("free_requested", freed), ("free_completed", freed), ("free_requested", freed),
               ("free_completed", freed), ("segment_free", tidied), ("free_requested", freed),
               ("free_completed", freed)]
    fenced = [("free_requested", freed), ("free_requested", freed), ("free_completed", tidied),
              ("free_completed", tidied), ("segment_free", tidied), ("free_requested", freed),
              ("free_completed", ["miss", "<module>"])]
    for conf, expected in (("", at_once), ("reuse_policy:safe", fenced)):
        code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100)",
                              after=FREEING.format(out=str(out)))
        run_python(code, preload_env(PYTORCH_NPU_ALLOC_CONF=conf))
        assert _free_side(out) == expected, conf
    # context="alloc": the free's events fall back on the alloc's frames, empty_cache's on the segment's malloc
    made = ["make_weight", "forward", "<module>"]
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, context='alloc')",
                          after=FREEING.format(out=str(out)))
    run_python(code, preload_env())
    assert _free_side(out) == [("free_requested", made), ("free_completed", made), ("free_requested", made),
                               ("free_completed", made), ("segment_free", made), ("free_requested", made),
                               ("free_completed", made)]


def test_every_free_entry_takes_the_freeing_frames(tmp_path: Path) -> None:
    """Under context="all" the freeing frames come from every free entry:
    aclrtFreeWithDevSync and torch's caching_allocator_delete as aclrtFree."""
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100)", after=f"""
    import ctypes
    lib = ctypes.CDLL(None)  # the preloaded entry, as the program's own call finds it
    lib.aclrtFreeWithDevSync.argtypes = [ctypes.c_void_p]
    def sync_free(ptr):
        assert lib.aclrtFreeWithDevSync(ptr) == 0
    def torch_delete(ptr):
        npualloc.caching_allocator_delete(ptr)
    sync_free(held[0])
    torch_delete(npualloc.caching_allocator_alloc(4 * MiB))
    npualloc.dump_snapshot({str(out)!r})
    """)
    run_python(code, preload_env())
    requested = [frames for action, frames in _free_side(out) if action == "free_requested"]
    assert requested == [["sync_free", "<module>"], ["caching_allocator_delete", "torch_delete", "<module>"]]


def test_record_context_key_and_the_legacy_form(tmp_path: Path) -> None:
    """record_context:all is the config form of context="all" (in the
    variable, or switched at run time, and shown by get_config); torch's
    legacy _record_memory_history(True) is context "state" (no frames in
    the trace: it gave the frees their alloc's), "alloc" with
    trace_alloc_record_context; a value npualloc does not offer is refused
    with one warning naming the key."""
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="", after=f"""
    def release(ptr):
        acl.rt.free(ptr)
    config = npualloc.get_config()
    release(held[0])
    npualloc.set_config("record_context:alloc")
    release(held[1])
    print(json.dumps([config, npualloc.get_config()]))
    npualloc.dump_snapshot({str(out)!r})
    """)
    proc = run_python(code, preload_env(PYTORCH_NPU_ALLOC_CONF="record_history:100,record_stacks:python,"
                                                              "record_context:all"))
    config, switched = json.loads(proc.stdout)
    assert "record_context:all" in config and "record_context" not in switched, (config, switched)
    made, freed = ["make_weight", "forward", "<module>"], ["release", "<module>"]
    assert _free_side(out) == [("free_requested", freed), ("free_completed", freed), ("free_requested", made),
                               ("free_completed", made)]

    for legacy, frames in (("True", []), ("True, trace_alloc_record_context=True", made)):
        code = PROGRAM.format(setup=f"npualloc._record_memory_history({legacy})", after=f"""
    for ptr in held:
        acl.rt.free(ptr)
    npualloc.dump_snapshot({str(out)!r})
    """)
        run_python(code, preload_env())
        assert _free_side(out) == [("free_requested", frames), ("free_completed", frames)] * 2, legacy

    proc = run_python(PROGRAM.format(setup="", after=""), preload_env(PYTORCH_NPU_ALLOC_CONF="record_context:never"))
    [warning] = proc.stderr.splitlines()
    assert warning.startswith("npualloc: ") and "record_context" in warning and "must be state, alloc or all" in warning


def test_segment_events_carry_the_frames_of_the_call_they_happened_in(tmp_path: Path) -> None:
    """As torch's: a segment's release carries the frames of the malloc that
    made it when no call of the program's caused it (empty_cache asks none
    under context="alloc"), those of the malloc whose OOM retry gave it back
    otherwise, and that malloc's OOM event its own (never those of an
    earlier call); a segment made later at the same address names its own
    malloc."""
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, context='alloc', stacks='python')",
                          after=f"""
    for ptr in held:
        acl.rt.free(ptr)
    def small():
        return acl.rt.malloc(512, 0)[0]
    kept = small()  # the last malloc before empty_cache: its stack is its own only
    npualloc.empty_cache()
    def other():
        ptr, ret = acl.rt.malloc(4 * MiB, 0)
        return ptr
    again = other()
    acl.rt.free(again)
    def too_big():
        return acl.rt.malloc(70 * MiB, 0)[1]
    print(json.dumps([again == held[0], too_big()]))
    npualloc.dump_snapshot({str(out)!r})
    """)
    assert json.loads(run_python(code, preload_env(NPUSIM_HBM_MB="64")).stdout) == [True, 207001]
    trace = pickle.loads(out.read_bytes())["device_traces"][0]
    names = [(e["action"], [f["name"] for f in e["frames"] if f["name"] != "<listcomp>"]) for e in trace
             if e["action"] not in ("alloc", "free_requested", "free_completed")]
    made_by_forward = ["make_weight", "forward", "<module>"]
    assert names == [("segment_alloc", made_by_forward), ("segment_alloc", ["small", "<module>"]),
                     ("segment_free", made_by_forward),
                     ("segment_alloc", ["other", "<module>"]), ("segment_free", ["too_big", "<module>"]),
                     ("oom", ["too_big", "<module>"])], names


def test_config_form_puts_stacks_in_the_oom_snapshot_memory_viz_shows_them(tmp_path: Path) -> None:
    path = tmp_path / "oom.pickle"
    code = PROGRAM.format(setup="", after="""
    ptr, ret = acl.rt.malloc(1 << 40, 0)
    print(ret)
    """)
    proc = run_python(code, preload_env(NPUSIM_HBM_MB="64",
                                        PYTORCH_NPU_ALLOC_CONF=f"record_history:100,record_stacks:python,"
                                                               f"oom_snapshot:{path}"))
    assert proc.stdout.strip() == "207001"
    lines = proc.stderr.splitlines()  # the OOM this test provokes: its report and where its snapshot went
    assert len(lines) == 2 and lines[0].startswith("npualloc: out of memory on device 0")
    assert lines[1].startswith(f"npualloc: out of memory: snapshot written to {path}"), proc.stderr
    snapshot = pickle.loads(path.read_bytes())
    assert "record_stacks:python" in snapshot["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"]
    assert [f["name"] for f in _alloc_frames(snapshot)[0] if f["name"] != "<listcomp>"] == \
        ["make_weight", "forward", "<module>"]

    pytest.importorskip("torch")
    from torch.cuda import _memory_viz
    # memory_viz's flame graph of live memory names the lines that hold it: the two weights
    lines = _memory_viz.memory(snapshot, format_flamegraph=lambda text: text).splitlines()
    held = [line for line in lines if line.startswith("stream_0;active_allocated;") and "make_weight" in line]
    assert len(held) == 2, lines
    assert all(line.endswith(":5:make_weight 4194304") and "<string>:9:forward;" in line for line in held), held
    assert any(line.startswith("stream_0;inactive;<non-python>") for line in lines)


def test_a_name_cut_inside_a_character_leaves_the_snapshot_readable(tmp_path: Path) -> None:
    """Names are kept to 256 bytes: a longer one in a script under a directory
    named in Chinese (3 bytes a character) was cut inside a character, and
    pickle refused the whole snapshot over it (UnicodeDecodeError). The
    snapshot loads; the bytes of the cut character read as one U+FFFD, as
    Python's decoder reads them (a character's bytes cut short are one
    maximal subpart, not one replacement a byte)."""
    out = tmp_path / "snap.pickle"
    filename = "/数据/" + "训练脚本目录" * 15 + "/train.py"
    code = f"""
    import acl, npualloc
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    npualloc.record_memory_history(max_entries=100, stacks='python')
    ns = {{"acl": acl}}
    exec(compile("def alloc():\\n    return acl.rt.malloc(4 << 20, 0)[0]\\n", {filename!r}, "exec"), ns)
    held = ns["alloc"]()
    npualloc.dump_snapshot({str(out)!r})
    """
    run_python(code, preload_env())
    [frames] = _alloc_frames(pickle.loads(out.read_bytes()))
    name = frames[0]["filename"]
    cut = filename.encode()[:256]
    assert len(cut.decode(errors="ignore").encode()) == 254  # two bytes of a three-byte character left
    assert frames[0]["name"] == "alloc" and name == cut.decode(errors="replace")


def test_no_stacks_unless_asked(tmp_path: Path) -> None:
    out = tmp_path / "snap.pickle"
    code = PROGRAM.format(setup="npualloc.record_memory_history(max_entries=100, stacks=None)",
                          after=f"npualloc.dump_snapshot({str(out)!r})")
    run_python(code, preload_env())
    stacks = _alloc_frames(pickle.loads(out.read_bytes()))
    assert len(stacks) == 2 and stacks == [[], []]
    # and with history from the config but no record_stacks key
    code = PROGRAM.format(setup="", after=f"npualloc.dump_snapshot({str(out)!r})")
    run_python(code, preload_env(PYTORCH_NPU_ALLOC_CONF="record_history:100"))
    assert _alloc_frames(pickle.loads(out.read_bytes())) == [[], []]


def test_stack_table_is_bounded(tmp_path: Path) -> None:
    """More distinct stacks than the table holds (16384): one warning, later
    new stacks recorded without frames, known ones still named."""
    lines = "\n".join(f"    p, _ = acl.rt.malloc(512, 0); acl.rt.free(p)  # {i}" for i in range(16500))
    code = f"""
import acl, json, npualloc
acl.init(); acl.rt.set_device(0)
npualloc.record_memory_history(max_entries=60000, stacks='python')
def churn():
{lines}
churn()
trace = npualloc._snapshot()["device_traces"][0]
allocs = [e["frames"] for e in trace if e["action"] == "alloc"]
print(json.dumps([len(allocs), sum(1 for f in allocs if f), sum(1 for f in allocs if not f)]))
"""
    script = tmp_path / "churn.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env=preload_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    total, with_frames, without = json.loads(proc.stdout)
    assert total == 16500 and with_frames == 16384 and without == total - with_frames
    warnings = [line for line in proc.stderr.splitlines() if "stack table is full" in line]
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: record_stacks:"), proc.stderr


def test_code_table_full_records_no_stack_rather_than_one_without_the_allocating_frame(tmp_path: Path) -> None:
    """A long run that keeps making code objects (exec, recompiled graphs)
    fills the code table (4096) long before the stack table: a stack then
    ends at its first frame of new code, with one warning, so one whose
    allocating function is new code is recorded without frames, never as a
    stack that leaves the allocating function out and names its caller."""
    code = """
import acl, json, npualloc
acl.init(); acl.rt.set_device(0)
npualloc.record_memory_history(max_entries=20000, stacks='python')
def caller(fn):
    return fn()
def known():
    p, _ = acl.rt.malloc(512, 0)
    acl.rt.free(p)
known()  # its code in the table
for i in range(4200):
    ns = {"acl": acl}
    exec(f"def gen_{i}():\\n    p, _ = acl.rt.malloc(512, 0)\\n    acl.rt.free(p)\\n", ns)
    caller(ns[f"gen_{i}"])
ns = {"known": known}
exec("def new_wrapper():\\n    known()\\n", ns)
ns["new_wrapper"]()  # known code under new code: the stack ends at the new frame
trace = npualloc._snapshot()["device_traces"][0]
allocs = [[f["name"] for f in e["frames"]] for e in trace if e["action"] == "alloc"]
print(json.dumps(allocs))
"""
    script = tmp_path / "codes.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env=preload_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    allocs = json.loads(proc.stdout)
    assert len(allocs) == 4202
    assert all(stack == [] or stack[0].startswith("gen_") for stack in allocs[1:-1]), \
        [stack for stack in allocs if stack and not stack[0].startswith("gen_")][:3]
    assert allocs[1] == ["gen_0", "caller", "<module>"] and allocs[-2] == []
    assert allocs[-1] == ["known"]  # the frames inside the first one the full table cannot hold
    warnings = [line for line in proc.stderr.splitlines() if "code table is full" in line]
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: record_stacks:"), proc.stderr


def test_frame_table_full_warns_once(tmp_path: Path) -> None:
    """The frame table (2^18 frames) fills before the stack table when stacks
    are deep; a shorter new stack still fits after that, so the warning once
    named counts that moved and printed again at each later refusal (up to
    8 times), where the docs say one warning per table."""
    code = """
import acl, json, npualloc
acl.init(); acl.rt.set_device(0)
npualloc.record_memory_history(max_entries=100, stacks='python')
def alloc():
    p, _ = acl.rt.malloc(512, 0); acl.rt.free(p)
def rec(depth, bits):
    if depth == 0:
        return alloc()
    if bits & 1:
        return rec(depth - 1, bits >> 1)
    else:
        return rec(depth - 1, bits >> 1)
for i in range(7000):  # distinct stacks of 43 frames: more than 2^18 frames in all
    rec(40, i)
for j in range(12):
    exec(f"def s{j}():\\n    alloc()\\n", globals())  # new code: a short new stack, which fits
    globals()[f"s{j}"]()
    rec(40, 10**6 + j)  # a deep new stack, which does not
"""
    script = tmp_path / "deep.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], env=preload_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "stack table is full" in line]
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: record_stacks:"), proc.stderr
