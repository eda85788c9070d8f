"""expandable_segments:True on the simulator: an unmodified pyACL program
with libnpualloc.so preloaded gets its memory from pages mapped into
reserved ranges (the simulator's VMM calls, never a plain aclrtMalloc), its
data reads back intact, empty_cache unmaps every free page; and replays of
real traces end with less memory reserved per byte requested than with plain
segments.

Sizes as npualloc sees them (tests/test_replay.py): a request is padded to
32 + 32 bytes, then rounded to 512. Pages are 2 MiB in the small pool
(requests up to 1 MiB) and 20 MiB in the large pool.
"""
from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
from pathlib import Path

from conftest import BUILD, ROOT, preload_env, run_python, sim_env

MIB = 1 << 20
TRACES = ROOT / "tools" / "traces"
EXPANDABLE = "expandable_segments:True"

PROGRAM = """
import ctypes, json
import acl
import npualloc
from aclsim import aclsim

MIB = 1 << 20
assert acl.init() == 0 and acl.rt.set_device(0) == 0
VMM = ("aclrtReserveMemAddress", "aclrtMallocPhysical", "aclrtMapMem", "aclrtUnmapMem", "aclrtFreePhysical",
       "aclrtReleaseMemAddress")
PLAIN = ("aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached")

def calls(names):
    return {name: aclsim.call_count(name) for name in names}

def write(p, size, seed):
    data = bytes((seed + k) % 251 for k in range(251)) * (size // 251 + 1)
    host = ctypes.create_string_buffer(data[:size], size)
    assert acl.rt.memcpy(p, size, ctypes.addressof(host), size, 1) == 0
    return data[:size]

def intact(p, size, data):
    back = ctypes.create_string_buffer(size)
    assert acl.rt.memcpy(ctypes.addressof(back), size, p, size, 2) == 0
    return back.raw == data

# Two steps of mixed sizes: the second is served from the cache.
sizes = [1000, 300_000, 1 * MIB, 3 * MIB, 12 * MIB, 25 * MIB, 5 * MIB]
bad = 0
for step in range(2):
    blocks = []
    for i, size in enumerate(sizes):
        p, ret = acl.rt.malloc(size, 0)
        assert ret == 0, ret
        blocks.append((p, size, write(p, size, step * 17 + i)))
    bad += sum(not intact(p, size, data) for p, size, data in blocks)
    for p, _, _ in reversed(blocks):
        assert acl.rt.free(p) == 0
    if step == 0:
        after_first = calls(VMM + PLAIN)
after_second = calls(VMM + PLAIN)
stats = npualloc.memory_stats(0)
reserved, physical = stats["reserved_bytes.all.current"], aclsim.physical_bytes_outstanding(0)
npualloc.empty_cache()
print(json.dumps(dict(bad=bad, after_first=after_first, after_second=after_second, reserved=reserved,
                      physical=physical, stats=stats, after_empty=calls(VMM),
                      physical_after_empty=aclsim.physical_bytes_outstanding(0),
                      reserved_after_empty=npualloc.memory_stats(0)["reserved_bytes.all.current"])))
assert acl.rt.reset_device(0) == 0 and acl.finalize() == 0
"""


def run_program(**env: str) -> tuple[dict, str]:
    proc = run_python(PROGRAM, preload_env(**env))
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def test_pyacl_program_runs_on_mapped_pages():
    out, stderr = run_program(PYTORCH_NPU_ALLOC_CONF=EXPANDABLE)
    assert stderr == ""
    assert out["bad"] == 0
    first, second = out["after_first"], out["after_second"]
    # No plain device allocation at all; one range per pool.
    assert all(first[name] == 0 for name in ("aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached"))
    assert first["aclrtReserveMemAddress"] == 2
    # One physical allocation per page, each mapped once; the second step maps nothing.
    assert first["aclrtMallocPhysical"] == first["aclrtMapMem"] > 0
    assert second == first
    stats = out["stats"]
    assert stats["num_device_alloc"] == first["aclrtMallocPhysical"]
    assert out["reserved"] == out["physical"]
    # The small pool holds 1000 B and 300 000 B: one 2 MiB page. The large
    # pool (1 MiB is over the small pool's limit once padded) grows from its
    # free tail: 1 + 3 + 12 + 25 + 5 MiB, plus pads, fit in 3 pages of 20 MiB.
    assert stats["reserved_bytes.small_pool.peak"] == 2 * MIB
    assert stats["reserved_bytes.large_pool.peak"] == 3 * 20 * MIB
    assert stats["segment.all.peak"] == 0  # torch counts no segments for expandable ones
    # Everything was free: empty_cache unmaps every page and gives the ranges back.
    empty = out["after_empty"]
    assert empty["aclrtUnmapMem"] == empty["aclrtFreePhysical"] == empty["aclrtMallocPhysical"]
    assert empty["aclrtReleaseMemAddress"] == 2
    assert out["physical_after_empty"] == 0 and out["reserved_after_empty"] == 0


def test_clash_with_max_split_size_warns_and_keeps_plain_segments():
    out, stderr = run_program(PYTORCH_NPU_ALLOC_CONF=EXPANDABLE + ",max_split_size_mb:64")
    lines = [line for line in stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("npualloc: PYTORCH_NPU_ALLOC_CONF"), stderr
    assert "expandable_segments" in lines[0]
    assert out["bad"] == 0
    assert out["after_first"]["aclrtReserveMemAddress"] == 0
    assert out["after_first"]["aclrtMallocAlign32"] > 0


def replay(trace: Path, conf: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "npualloc.replay", str(trace), "--build", str(BUILD), "--json",
                           "--no-search", "--conf", conf], env=sim_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fits"]
    return report


def test_replay_of_tiny_trace_by_hand():
    """tools/traces/make_tiny.py: 1000 B, 500 000 B, 4 MiB and 16 MiB live at
    once. Plain segments: a 2 MiB small segment, a 20 MiB one for 4 MiB and an
    18 MiB one for 16 MiB: 40 MiB. Expandable: the same 2 MiB small page, and
    16 MiB does not fit the 16 MiB - 512 B left beside 4 MiB in the first
    20 MiB page, so a second page is mapped: 42 MiB. With 20 MiB pages (as
    torch) a trace this small reserves more, not less."""
    plain, expandable = replay(TRACES / "tiny.pickle.gz", ""), replay(TRACES / "tiny.pickle.gz", EXPANDABLE)
    assert plain["replay"]["peak_reserved_bytes"] == 40 * MIB
    assert expandable["replay"]["peak_reserved_bytes"] == 42 * MIB
    assert plain["replay"]["peak_requested_bytes"] == expandable["replay"]["peak_requested_bytes"]


def test_replay_of_a_gpt2_training_step_reserves_less(tmp_path):
    """The first iteration of gpt2_train (model load, forward, backward, the
    optimizer step): blocks of 20 MiB segments that stay split are what
    expandable segments avoid."""
    snapshot = pickle.load(gzip.open(TRACES / "gpt2_train.pickle.gz"))
    traces = snapshot["device_traces"]
    device = max(range(len(traces)), key=lambda i: len(traces[i]))
    end = next(i for i, e in enumerate(traces[device]) if e["action"] == "snapshot") + 1
    snapshot["device_traces"] = [t[:end] if i == device else t for i, t in enumerate(traces)]
    step = tmp_path / "gpt2_step.pickle.gz"
    with gzip.open(step, "wb") as f:
        pickle.dump(snapshot, f)
    plain, expandable = replay(step, ""), replay(step, EXPANDABLE)
    assert plain["replay"]["peak_requested_bytes"] == expandable["replay"]["peak_requested_bytes"]
    assert expandable["reserved_over_requested"] < plain["reserved_over_requested"]
    assert expandable["reserved_over_requested"] < 1.05


SWITCHED = """
import json, os, pickle, sys
import acl
import npualloc
from aclsim import aclsim
from npualloc.region import Region
from npualloc.snapshot import snapshot_bytes

MIB = 1 << 20
assert acl.init() == 0 and acl.rt.set_device(0) == 0
NAMES = ("aclrtMallocAlign32", "aclrtReserveMemAddress", "aclrtMapMem")
out = {}

def step(name, size):
    p, ret = acl.rt.malloc(size, 0)
    assert ret == 0, ret
    with Region(os.getpid()) as region:
        region_config = region.header().config
    settings = pickle.loads(snapshot_bytes())["allocator_settings"]
    out[name] = dict(calls={n: aclsim.call_count(n) for n in NAMES}, config=npualloc.get_config(),
                     region_config=region_config, settings=settings["expandable_segments"],
                     kinds=sorted(s["is_expandable"] for s in pickle.loads(snapshot_bytes())["segments"]))
    return p

blocks = [step("plain", 5 * MIB)]
npualloc.set_config("expandable_segments:True")
blocks.append(step("switched_on", 30 * MIB))
npualloc.set_config("expandable_segments:False")
blocks.append(step("switched_off", 30 * MIB))
npualloc.set_config("garbage_collection_threshold:0.5")
try:
    npualloc.set_config("expandable_segments:True")
    out["refused"] = False
except ValueError:
    out["refused"] = True
out["config_after_refusal"] = npualloc.get_config()
for p in blocks:
    assert acl.rt.free(p) == 0
npualloc.empty_cache()
out["reserved_after_empty"] = npualloc.memory_stats(0)["reserved_bytes.all.current"]
out["physical_after_empty"] = aclsim.physical_bytes_outstanding(0)
print(json.dumps(out))
sys.stdout.flush()
assert acl.rt.reset_device(0) == 0 and acl.finalize() == 0
"""


def test_switched_at_run_time_through_set_config():
    """torch's _set_allocator_settings("expandable_segments:True") in a
    preloaded program with no config: the 5 MiB block before the switch
    took a plain segment, the 30 MiB one after it pages of a reserved range,
    and the one after switching back a plain segment again; the config, the
    region's copy of it and the snapshot's allocator_settings say what is in
    force at each step. A GC threshold then makes the switch refused."""
    proc = run_python(SWITCHED, preload_env())
    out = json.loads(proc.stdout.splitlines()[-1])
    plain, on, off = out["plain"], out["switched_on"], out["switched_off"]
    assert plain["calls"] == {"aclrtMallocAlign32": 1, "aclrtReserveMemAddress": 0, "aclrtMapMem": 0}
    assert on["calls"]["aclrtMallocAlign32"] == 1 and on["calls"]["aclrtReserveMemAddress"] == 1
    assert on["calls"]["aclrtMapMem"] == 2  # 30 MiB: two 20 MiB pages
    assert off["calls"] == {"aclrtMallocAlign32": 2, "aclrtReserveMemAddress": 1, "aclrtMapMem": 2}
    for step, expandable in ((plain, False), (on, True), (off, False)):
        assert ("expandable_segments:True" in step["config"]) is expandable
        assert step["region_config"] == step["config"]
        assert step["settings"] is expandable
    assert plain["kinds"] == [False] and on["kinds"] == [False, True] and off["kinds"] == [False, False, True]
    assert out["refused"] is True
    assert out["config_after_refusal"] == "garbage_collection_threshold:0.5"
    warnings = [line for line in proc.stderr.splitlines() if line]
    assert len(warnings) == 1 and warnings[0].startswith("npualloc: "), proc.stderr
    assert "torch_npu's rule" in warnings[0]
    assert out["reserved_after_empty"] == 0 and out["physical_after_empty"] == 0


BEFORE_FIRST_MALLOC = """
import json
import acl
import npualloc
from aclsim import aclsim

assert acl.init() == 0 and acl.rt.set_device(0) == 0
try:
    npualloc.set_config("expandable_segments:True")
    refused = False
except ValueError:
    refused = True
p, ret = acl.rt.malloc(5 << 20, 0)
assert ret == 0 and acl.rt.free(p) == 0
print(json.dumps(dict(refused=refused, config=npualloc.get_config(),
                      reserves=aclsim.call_count("aclrtReserveMemAddress"), mallocs=aclsim.call_count("aclrtMallocAlign32"))))
assert acl.rt.reset_device(0) == 0 and acl.finalize() == 0
"""


def test_switched_before_the_first_malloc():
    """Set before the allocator exists, the key goes into the config it is
    created with; beside a GC threshold from the environment it is refused
    there too."""
    proc = run_python(BEFORE_FIRST_MALLOC, preload_env())
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == dict(refused=False, config=EXPANDABLE, reserves=1, mallocs=0)
    assert proc.stderr == ""
    proc = run_python(BEFORE_FIRST_MALLOC, preload_env(PYTORCH_NPU_ALLOC_CONF="garbage_collection_threshold:0.5"))
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out == dict(refused=True, config="garbage_collection_threshold:0.5", reserves=0, mallocs=1)
    assert "torch_npu's rule" in proc.stderr and proc.stderr.startswith("npualloc: ")


FORKED = """
import json, os
import acl
import npualloc
from aclsim import aclsim

assert acl.init() == 0 and acl.rt.set_device(0) == 0
p, ret = acl.rt.malloc(5 << 20, 0)
assert ret == 0
npualloc.set_config("expandable_segments:True")
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        reserves, mallocs = aclsim.call_count("aclrtReserveMemAddress"), aclsim.call_count("aclrtMallocAlign32")
        q, ret = acl.rt.malloc(5 << 20, 0)
        os.write(w, json.dumps(dict(ret=ret, config=npualloc.get_config(),
                                    reserves=aclsim.call_count("aclrtReserveMemAddress") - reserves,
                                    mallocs=aclsim.call_count("aclrtMallocAlign32") - mallocs)).encode())
    finally:
        os._exit(0)
os.close(w)
child = json.loads(os.read(r, 4096))
_, status = os.waitpid(pid, 0)
print(json.dumps(dict(child=child, status=status, config=npualloc.get_config())))
"""


def test_a_forked_child_keeps_the_setting():
    """A child starts with an empty allocator of its own: it is created with
    the settings in force at the fork, the run-time switch included."""
    proc = run_python(FORKED, preload_env())
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["status"] == 0 and out["config"] == EXPANDABLE
    assert out["child"] == dict(ret=0, config=EXPANDABLE, reserves=1, mallocs=0)
    assert proc.stderr == ""
