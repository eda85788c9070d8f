"""libnpualloc.so preloaded under unmodified pyACL programs on the simulator:
the cache serves aclrtMalloc/aclrtFree, foreign and invalid frees are handled
as the runtime would, and the environment switches (disable, config) work.
Every scenario runs in its own process; each prints one JSON line of what it
saw (the simulator's counters are the ground truth of what reached the device)."""
from __future__ import annotations

import json
import os

import pytest

from conftest import NPUALLOC_LIB, preload_env, run_python, sim_env

PRELUDE = """
import json, os, ctypes
import acl
from aclsim import aclsim
assert acl.init() == 0 and acl.rt.set_device(0) == 0
def emit(**kw):
    print(json.dumps(kw))
"""


def run(code: str, env: dict[str, str], **kw):
    proc = run_python(PRELUDE + code, env, **kw)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), proc


TRAINING_LOOP = """
import random
rng = random.Random(7)
# A training step: persistent weights, then per step activations of mixed
# sizes (small, medium, large), a workspace, gradients; freed in another order.
weights = []
for size in (4 << 20, 1 << 20, 4096):
    p, ret = acl.rt.malloc(size, 0); assert ret == 0
    weights.append((p, size))
sizes = [512, 3000, 65536, 1 << 20, (1 << 20) + 7, 3 << 20, 12 << 20, 100, 2 << 20]
counts, bad = [], 0
for it in range(20):
    blocks = []
    for i, size in enumerate(sizes):
        alloc = (acl.rt.malloc, acl.rt.malloc_align32, acl.rt.malloc_cached)[i % 3]
        p, ret = alloc(size, 0); assert ret == 0, ret
        pattern = bytes([(it * 31 + i * 7 + k) % 251 for k in range(251)])
        data = (pattern * (size // 251 + 1))[:size]
        host = ctypes.create_string_buffer(data, size)
        assert acl.rt.memcpy(p, size, ctypes.addressof(host), size, 1) == 0
        blocks.append((p, size, data))
    for p, size, data in blocks:
        back = ctypes.create_string_buffer(size)
        assert acl.rt.memcpy(ctypes.addressof(back), size, p, size, 2) == 0
        bad += back.raw != data
    rng.shuffle(blocks)
    for p, _, _ in blocks:
        assert acl.rt.free(p) == 0
    counts.append(aclsim.device_malloc_count() + aclsim.call_count("aclrtMallocCached"))
for p, _ in weights:
    assert acl.rt.free(p) == 0
live_before_reset = aclsim.live_allocations(0)
assert acl.rt.reset_device(0) == 0
live_after_reset = aclsim.live_allocations(0)
assert acl.finalize() == 0
emit(counts=counts, bad=bad, live_before_reset=live_before_reset, live_after_reset=live_after_reset,
     frees=aclsim.call_count("aclrtFree"))
"""


def test_training_loop_makes_no_raw_malloc_after_the_first_iteration():
    out, proc = run(TRAINING_LOOP, preload_env())
    counts = out["counts"]
    assert counts[0] > 0
    assert counts[1:] == [counts[1]] * 19 and counts[1] == counts[0], counts  # zero raw mallocs after iteration 1
    assert out["bad"] == 0
    assert out["live_before_reset"] > 0  # the cache holds segments ...
    assert out["live_after_reset"] == 0  # ... and gives every one back at aclrtResetDevice
    assert out["frees"] == counts[-1]  # each raw malloc freed exactly once
    assert proc.stderr == ""


def test_training_loop_without_npualloc_mallocs_every_time():
    """The baseline the previous test is compared with: the counter counts."""
    out, _ = run(TRAINING_LOOP, sim_env())
    assert out["counts"][-1] == 20 * 9 + 3
    assert out["bad"] == 0


@pytest.mark.parametrize("switch", ["NPUALLOC_DISABLE", "PYTORCH_NO_CUDA_MEMORY_CACHING"])
def test_disable_passes_every_call_through(switch, tmp_path):
    out, proc = run(TRAINING_LOOP + """
lib = ctypes.CDLL(os.environ["LD_PRELOAD"])
emit(counts=counts, bad=bad, active=lib.npualloc_is_active(), files=os.listdir(os.environ["NPUALLOC_SHM_DIR"]))
""", preload_env(**{switch: "1", "NPUALLOC_SHM_DIR": str(tmp_path)}))
    assert out["counts"][-1] == 20 * 9 + 3
    assert out["active"] == 0
    assert out["files"] == []
    assert out["bad"] == 0


def test_foreign_frees_go_to_the_runtime():
    out, proc = run("""
sim = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libaclsim.so"))
sim.simrt_Malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
warm, ret = acl.rt.malloc(4096, 0); assert ret == 0  # the cache exists and owns a segment
# Memory the hook never saw: straight from the runtime's implementation, and
# a P2P policy the cache does not serve.
hidden = ctypes.c_void_p()
assert sim.simrt_Malloc(ctypes.byref(hidden), 1 << 20, 0) == 0
p2p, ret = acl.rt.malloc(1 << 20, 3); assert ret == 0
live = aclsim.live_allocations(0)
frees = aclsim.call_count("aclrtFree")
r1 = acl.rt.free(hidden.value)
r2 = acl.rt.free(p2p)
emit(r1=r1, r2=r2, freed=aclsim.call_count("aclrtFree") - frees, live_drop=live - aclsim.live_allocations(0))
""", preload_env())
    assert out == {"r1": 0, "r2": 0, "freed": 2, "live_drop": 2}
    assert proc.stderr == ""


def test_invalid_and_double_frees_are_refused_with_one_warning():
    out, proc = run("""
p, ret = acl.rt.malloc(8192, 0); assert ret == 0
q, ret = acl.rt.malloc(8192, 0); assert ret == 0
frees = aclsim.call_count("aclrtFree")
first = acl.rt.free(p)
double = [acl.rt.free(p) for _ in range(5)]
interior = acl.rt.free(q + 64)
null = acl.rt.free(0)
# q is still intact and freeable after the refused interior free
emit(first=first, double=double, interior=interior, null=null, q=acl.rt.free(q),
     forwarded=aclsim.call_count("aclrtFree") - frees)
""", preload_env())
    assert out["first"] == 0 and out["q"] == 0
    assert out["double"] == [207002] * 5
    assert out["interior"] == 207002
    assert out["null"] == 100000  # the runtime's own answer: NULL is forwarded
    assert out["forwarded"] == 1  # only the NULL reached the runtime; refused frees never do
    lines = [line for line in proc.stderr.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("npualloc: ") and "207002" in lines[0], proc.stderr


def test_null_and_zero_size_answer_like_the_runtime():
    code = """
from aclsim import aclsim
lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
lib.aclrtMalloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
p = ctypes.c_void_p()
emit(null=lib.aclrtMalloc(None, 64, 0), zero=lib.aclrtMalloc(ctypes.byref(p), 0, 0),
     align_zero=acl.rt.malloc_align32(0, 0)[1], free_null=acl.rt.free(0))
"""
    with_npa, _ = run(code, preload_env())
    without, _ = run(code, sim_env())
    assert with_npa == without
    assert with_npa["null"] != 0 and with_npa["zero"] != 0


def test_garbage_config_warns_once_per_problem_and_keeps_defaults():
    code = """
p, ret = acl.rt.malloc(4096, 0); assert ret == 0
assert acl.rt.free(p) == 0
import npualloc
s = npualloc.memory_stats(0)
emit(max_split=s["max_split_size"], reserved=s["reserved_bytes.all.current"])
"""
    garbage = "max_split_size_mb:abc,,bogus_key:1,garbage_collection_threshold:7,%%%"
    out, proc = run(code, preload_env(PYTORCH_NPU_ALLOC_CONF=garbage))
    assert out == {"max_split": -1, "reserved": 2 << 20}  # defaults: unlimited split, a 2 MiB small segment
    lines = [line for line in proc.stderr.splitlines() if line]
    assert lines and all(line.startswith("npualloc: PYTORCH_NPU_ALLOC_CONF") for line in lines), proc.stderr
    assert len(lines) == len(set(lines))
    assert any("bogus_key" in line for line in lines) and any("max_split_size_mb" in line for line in lines)


def test_a_refused_config_value_says_what_it_keeps():
    """Every warning about the config variable ended "(default kept)", yet a
    key given twice whose second value is refused keeps the first: the
    warning now says "(earlier value kept)" there, "(default kept)" where it
    is the default, and an unknown key is "ignored". At run time a refused
    value changes nothing: npualloc_set_config says "(not applied)" and the
    value in force stays."""
    out, proc = run("""
p, ret = acl.rt.malloc(4096, 0); assert ret == 0
import npualloc
at_start = npualloc.get_config()
try:
    npualloc.set_config("record_history:many")
    refused = None
except ValueError as e:
    refused = str(e)
emit(at_start=at_start, refused=refused, after=npualloc.get_config())
""", preload_env(PYTORCH_NPU_ALLOC_CONF="record_history:5,record_history:many,reuse_policy:sometimes,bogus:1"))
    assert out == {"at_start": "record_history:5", "after": "record_history:5",
                   "refused": "npualloc rejected 1 key(s) of 'record_history:many' (warned on stderr)"}
    var = "npualloc: PYTORCH_NPU_ALLOC_CONF: "
    limit = "(must be a number of entries up to 16777216)"
    assert proc.stderr.splitlines() == [
        f"{var}record_history: invalid value 'many' {limit} (earlier value kept)",
        f"{var}reuse_policy: invalid value 'sometimes' (must be eager, safe or auto) (default kept)",
        f"{var}unknown key 'bogus'; ignored",
        f"npualloc: npualloc_set_config: record_history: invalid value 'many' {limit} (not applied)"], proc.stderr


def test_config_numbers_are_read_and_written_with_a_point_in_any_locale(tmp_path):
    """strtod and printf follow LC_NUMERIC: a program that chose a comma-decimal
    locale before its first allocation had garbage_collection_threshold:0.8
    and per_process_memory_fraction:0.5 refused as not numbers, and its
    canonical config read 'garbage_collection_threshold:0,25', which does not
    parse back (the comma ends the entry)."""
    import shutil
    import subprocess
    source = tmp_path / "comma.def"
    source.write_text('LC_NUMERIC\ndecimal_point ","\nthousands_sep ""\ngrouping -1\nEND LC_NUMERIC\n')
    if shutil.which("localedef") is None:
        pytest.skip("needs localedef to make a comma-decimal locale")
    subprocess.run(["localedef", "-c", "-i", str(source), "-f", "UTF-8", str(tmp_path / "comma")],
                   capture_output=True)
    if not (tmp_path / "comma" / "LC_NUMERIC").is_file():
        pytest.skip("localedef could not make a comma-decimal locale here")
    proc = run_python("""
import json, locale
locale.setlocale(locale.LC_NUMERIC, "comma")
assert locale.localeconv()["decimal_point"] == ","
import acl, npualloc
assert acl.init() == 0 and acl.rt.set_device(0) == 0
p, ret = acl.rt.malloc(4096, 0); assert ret == 0
at_start = npualloc.get_config()
npualloc.set_gc_threshold(0.25)
after_command = npualloc.get_config()
npualloc.set_config("garbage_collection_threshold:0.6")
print(json.dumps([at_start, after_command, npualloc.get_config()]))
""", preload_env(LOCPATH=str(tmp_path),
                 PYTORCH_NPU_ALLOC_CONF="garbage_collection_threshold:0.8,per_process_memory_fraction:0.5"))
    assert json.loads(proc.stdout) == ["garbage_collection_threshold:0.8,per_process_memory_fraction:0.5",
                                       "garbage_collection_threshold:0.25,per_process_memory_fraction:0.5",
                                       "garbage_collection_threshold:0.6,per_process_memory_fraction:0.5"]
    assert proc.stderr == ""


def test_hundreds_of_bad_config_keys_leave_later_warnings_their_say():
    """Each distinct message took a slot of a 256-entry table; a config of 300
    bad keys filled it and every later warning of the process (this double
    free) was dropped. Now a config string warns about 8 entries and counts
    the rest, what the string means as a whole (a clash that turns expandable
    segments off) is still said, and so is the double free."""
    garbage = ",".join(f"bad_key_{i}:1" for i in range(300)) + ",expandable_segments:True,max_split_size_mb:64"
    out, proc = run("""
p, ret = acl.rt.malloc(4096, 0); assert ret == 0
emit(first=acl.rt.free(p), double=acl.rt.free(p))
""", preload_env(PYTORCH_NPU_ALLOC_CONF=garbage))
    assert out == {"first": 0, "double": 207002}
    lines = [line for line in proc.stderr.splitlines() if line]
    assert [f"unknown key 'bad_key_{i}'" in line for i, line in enumerate(lines[:8])] == [True] * 8, proc.stderr
    assert lines[8] == "npualloc: PYTORCH_NPU_ALLOC_CONF: 292 more warnings about entries are not shown"
    assert "expandable segments stay off" in lines[9]
    assert lines[10].startswith("npualloc: aclrtFree(") and "not a live allocation" in lines[10]
    assert len(lines) == 11, proc.stderr


def test_one_call_site_prints_eight_distinct_warnings_then_says_so():
    """A warning that carries what the program passed (record_stream's
    pointer) is one text per pointer: a loop over bad pointers printed one
    line each, and filled the table that later warnings needed. Now one
    place in the code prints 8, the last saying so; other places still warn."""
    out, proc = run("""
lib = ctypes.CDLL(None)
lib.npualloc_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
p, ret = acl.rt.malloc(4096, 0); assert ret == 0  # npualloc serves from here on
refused = [lib.npualloc_record_stream(0x1000 + 64 * i, None) for i in range(20)]
emit(refused=sorted(set(refused)), first=acl.rt.free(p), double=acl.rt.free(p))
""", preload_env())
    assert out == {"refused": [100000], "first": 0, "double": 207002}
    lines = [line for line in proc.stderr.splitlines() if line]
    assert [line.startswith(f"npualloc: npualloc_record_stream({hex(0x1000 + 64 * i)})") for i, line in
            enumerate(lines[:8])] == [True] * 8, proc.stderr
    assert [line.endswith("(later warnings like this one are not shown)") for line in lines[:8]] == [False] * 7 + [True]
    assert len(lines) == 9 and lines[8].startswith("npualloc: aclrtFree("), proc.stderr


def test_oom_reports_stop_after_eight_and_every_oom_is_counted():
    """The caller of aclrtMalloc gets only 207001, so an OOM says why on
    stderr; a program that catches OOMs (a batch-size search) printed one
    line per try for as long as it ran. Now the first eight distinct reports,
    the last saying so; num_ooms counts all of them."""
    out, proc = run("""
lib = ctypes.CDLL(None)
lib.npualloc_get_stats.argtypes = [ctypes.c_int, ctypes.c_void_p]
held, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
codes = [acl.rt.malloc((100 + i) << 20, 0)[1] for i in range(12)]
import npualloc
emit(codes=sorted(set(codes)), ooms=npualloc.memory_stats()["num_ooms"], freed=acl.rt.free(held))
""", preload_env(NPUSIM_HBM_MB="64"))
    assert out == {"codes": [207001], "ooms": 12, "freed": 0}
    lines = [line for line in proc.stderr.splitlines() if line]
    assert len(lines) == 8, proc.stderr
    assert [line.startswith(f"npualloc: out of memory on device 0: requested {(100 + i) << 20} bytes")
            for i, line in enumerate(lines)] == [True] * 8, proc.stderr
    assert [line.endswith("(later warnings like this one are not shown)") for line in lines] == [False] * 7 + [True]


@pytest.mark.parametrize("variable", ["MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", None])
def test_a_start_up_key_set_at_run_time_names_the_variable_to_set(variable):
    """max_split_size_mb cannot change at run time; the warning named
    PYTORCH_NPU_ALLOC_CONF whichever variable the process read, and
    MindTorch's wins over it (`npualloc run --conf` sets MindTorch's)."""
    env = preload_env(**({variable: "garbage_collection_threshold:0.5"} if variable else {}))
    out, proc = run("""
lib = ctypes.CDLL(None)
emit(rejected=lib.npualloc_set_config(b"max_split_size_mb:128"))
""", env)
    assert out == {"rejected": 1}
    assert proc.stderr.splitlines() == [
        "npualloc: npualloc_set_config: max_split_size_mb cannot change at run time; set it in "
        f"{variable or 'PYTORCH_NPU_ALLOC_CONF'} before the program starts"], proc.stderr


def test_a_run_time_key_among_blanks_is_taken_as_the_variable_takes_it():
    """The config parser trims every blank around keys and values (a
    newline between entries of a variable written over several lines);
    npualloc_set_config looked for the key trimming spaces and tabs only, so
    record_stacks after a newline was refused as a key that 'cannot change
    at run time', which it can, and an item of blanks alone was refused (its
    key's length went below zero) where an empty one is skipped."""
    out, proc = run("""
lib = ctypes.CDLL(None)
lib.npualloc_get_config.restype = ctypes.c_size_t
rejected = lib.npualloc_set_config(b"record_history:5,\\nrecord_stacks:python, \\t ,\\r\\vrecord_context\\f:\\tall\\n")
text = ctypes.create_string_buffer(1024)
lib.npualloc_get_config(text, 1024)
emit(rejected=rejected, config=text.value.decode())
""", preload_env())
    assert out == {"rejected": 0, "config": "record_history:5,record_stacks:python,record_context:all"}, proc.stderr
    assert proc.stderr == ""


def test_warnings_show_control_characters_as_question_marks():
    """A key the program passes to npualloc_set_config is printed in its
    warning: a newline in it forged a second "npualloc:" line and an escape
    reached the terminal. Every warning now shows such bytes as "?"; other
    non-ASCII text (a path in any script) stays as it is."""
    out, proc = run("""
lib = ctypes.CDLL(None)
emit(rejected=lib.npualloc_set_config("k\\x1b[2J\\nforged line\\x07\\u009b\\u00e9:1".encode()))
""", preload_env())
    assert out == {"rejected": 1}
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npualloc: npualloc_set_config: k?[2J?forged line???\u00e9 cannot"), \
        proc.stderr


def test_mindtorch_variable_wins_over_the_torch_ones():
    code = """
p, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
import npualloc
emit(max_split=npualloc.memory_stats(0)["max_split_size"])
"""
    out, proc = run(code, preload_env(MINDTORCH_NPU_ALLOC_CONF="max_split_size_mb:40",
                                      PYTORCH_NPU_ALLOC_CONF="bogus", PYTORCH_CUDA_ALLOC_CONF="bogus"))
    assert out["max_split"] == 40 << 20
    assert proc.stderr == ""
    out, proc = run(code, preload_env(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:60"))
    assert out["max_split"] == 60 << 20


def test_a_config_variable_set_empty_counts_as_unset():
    """MindTorch reads an empty MINDTORCH_NPU_ALLOC_CONF as unset (on to
    PYTORCH_CUDA_ALLOC_CONF); the library read it as set, so `VAR= prog` or a
    launcher's `export VAR=$UNSET` hid the config set further down, and kept
    MindTorch programs off the expandable segments they get when nothing is
    configured. Now the library, and npualloc's MindTorch default, skip it."""
    code = """
p, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
import npualloc
emit(max_split=npualloc.memory_stats(0)["max_split_size"])
"""
    out, proc = run(code, preload_env(MINDTORCH_NPU_ALLOC_CONF="", PYTORCH_NPU_ALLOC_CONF="max_split_size_mb:40"))
    assert out["max_split"] == 40 << 20 and proc.stderr == ""
    out, proc = run(code, preload_env(PYTORCH_NPU_ALLOC_CONF="", PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:60"))
    assert out["max_split"] == 60 << 20 and proc.stderr == ""
    out, proc = run("""
import npualloc, npualloc.mindtorch
npualloc.mindtorch._expandable_by_default()
emit(config=npualloc.get_config())
""", preload_env(MINDTORCH_NPU_ALLOC_CONF="", PYTORCH_NPU_ALLOC_CONF="", PYTORCH_CUDA_ALLOC_CONF=""))
    assert out["config"] == "expandable_segments:True" and proc.stderr == ""


def test_process_that_never_touches_the_npu_prints_nothing_and_leaves_no_file(tmp_path):
    env = preload_env(NPUALLOC_SHM_DIR=str(tmp_path))
    proc = run_python("import json, ctypes; print('hello'); ctypes.CDLL(None).strlen", env)
    assert proc.stdout == "hello\n"
    assert proc.stderr == ""
    assert os.listdir(tmp_path) == []
    assert NPUALLOC_LIB.exists()


def test_free_with_dev_sync_is_served_whole_by_one_side():
    """Ours: the device is synchronized and the block goes back to the cache
    (the runtime's FreeWithDevSync never sees it); foreign: the runtime's own
    call, whole."""
    out, proc = run("""
lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
lib.aclrtFreeWithDevSync.argtypes = [ctypes.c_void_p]
p, _ = acl.rt.malloc(4096, 0)
syncs, raw = aclsim.call_count("aclrtSynchronizeDevice"), aclsim.call_count("aclrtMalloc")
ours = lib.aclrtFreeWithDevSync(p)
synced = aclsim.call_count("aclrtSynchronizeDevice") - syncs
again, _ = acl.rt.malloc(4096, 0)
foreign, _ = acl.rt.malloc(4096, 3)  # a P2P policy: the runtime's
theirs = lib.aclrtFreeWithDevSync(foreign)
emit(ours=ours, theirs=theirs, synced=synced,
     reused=again == p, new_raw=aclsim.call_count("aclrtMalloc") - raw,
     forwarded=aclsim.call_count("aclrtFreeWithDevSync"), double=lib.aclrtFreeWithDevSync(p + 64))
""", preload_env())
    assert out == {"ours": 0, "theirs": 0, "synced": 1, "reused": True, "new_raw": 1, "forwarded": 1,
                   "double": 207002}


def test_contexts_move_the_thread_to_their_device():
    """aclrtCreateContext and aclrtSetCurrentContext change the thread's
    device without aclrtSetDevice: npualloc follows, so a block allocated
    after switching contexts is device 1's, in npualloc's stats and in the
    simulator's (which allocates on the runtime's current device)."""
    code = """
import npualloc
from npualloc._ffi import loaded_library
lib = loaded_library()
ctx1, ret = acl.rt.create_context(1); assert ret == 0
seen = [lib.npualloc_current_device()]
ctx0, ret = acl.rt.create_context(0); assert ret == 0
seen.append(lib.npualloc_current_device())
assert acl.rt.set_context(ctx1) == 0
seen.append(lib.npualloc_current_device())
p, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
emit(seen=seen, npualloc=[npualloc.memory_stats(d)["allocated_bytes.all.current"] > 0 for d in (0, 1)],
     runtime=[aclsim.bytes_outstanding(d) > 0 for d in (0, 1)])
"""
    out, proc = run(code, preload_env())
    assert proc.stderr == ""
    assert out["seen"] == [1, 0, 1]
    assert out["npualloc"] == [False, True]
    assert out["runtime"] == [False, True]


def test_destroying_a_devices_last_context_leaves_no_cached_block_behind():
    """Destroying the last context of a device resets it, freeing the
    runtime's memory of npualloc's cached segments there: npualloc gives its
    cache back first, so the next block on that device is new device memory
    (a cached block would be an address the runtime no longer owns: the
    simulator refuses a memset on it)."""
    code = """
ctx, ret = acl.rt.create_context(1); assert ret == 0
p, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
assert acl.rt.free(p) == 0
mallocs = aclsim.call_count("aclrtMallocAlign32")
assert acl.rt.destroy_context(ctx) == 0
ctx, ret = acl.rt.create_context(1); assert ret == 0
q, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0
emit(new_raw=aclsim.call_count("aclrtMallocAlign32") - mallocs, memset=acl.rt.memset(q, 1 << 20, 7, 1 << 20),
     outstanding=aclsim.bytes_outstanding(1))
"""
    out, proc = run(code, preload_env())
    assert proc.stderr == ""
    assert out["new_raw"] == 1
    assert out["memset"] == 0
    assert out["outstanding"] > 0


def test_segments_are_charged_their_size_only():
    """A segment is asked of the runtime with aclrtMallocAlign32, as torch_npu
    asks for one: no +32 bytes on top of its 2 MiB, so a 4 MiB device holds
    the two small segments of two streams (through aclrtMalloc the second did
    not fit: 2097120 bytes free for a 2097152-byte segment)."""
    out, proc = run("""
npa = ctypes.CDLL(os.environ["LD_PRELOAD"])
npa.npualloc_malloc_stream_addr.restype = ctypes.c_size_t
npa.npualloc_malloc_stream_addr.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
streams = [acl.rt.create_stream()[0] for _ in range(2)]
blocks = [npa.npualloc_malloc_stream_addr(512, s, 0) for s in streams]
emit(served=[b != 0 for b in blocks], charged=aclsim.bytes_outstanding(0),
     segments=aclsim.call_count("aclrtMallocAlign32"), plain=aclsim.call_count("aclrtMalloc"))
""", preload_env(NPUSIM_HBM_MB="4"))
    assert out == {"served": [True, True], "charged": 4 << 20, "segments": 2, "plain": 0}
    assert proc.stderr == ""
