"""The torch.cuda.memory mirror: device normalisation, memory_summary's
layout, mem_get_info inside and outside a preloaded process, the in-process API."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import preload_env, run_python, sim_env
from region_helpers import Workload

import npualloc
from npualloc.errors import InvalidDeviceError, NotUnderNpuallocError
from npualloc._ffi import ffi
from npualloc.memory import device_index, stats_to_dict
from npualloc.summary import format_count, format_size, format_summary, human_bytes

MiB = 1 << 20


@pytest.mark.parametrize("device, index", [
    (None, 0), (0, 0), (3, 3), ("npu", 0), ("npu:0", 0), ("npu:1", 1), ("npu:15", 15),
    (SimpleNamespace(type="npu", index=2), 2), (SimpleNamespace(index=4), 4), (SimpleNamespace(type="npu", index=None), 0),
    (SimpleNamespace(idx=5, prev_idx=-1), 5),  # torch.npu.device(5), a device guard: torch takes torch.cuda.device's .idx
])
def test_device_normalisation(device: object, index: int) -> None:
    assert device_index(device) == index  # None: no npualloc here, so device 0


@pytest.mark.parametrize("device", [
    "cuda", "cuda:0", "npu:x", "npu:-1", "npu:16", "npu:٣", "npu:+1", "npu:1_0", "", -1, 16, True, 1.5, object(),
    # torch.device's grammar, ([a-zA-Z_]+)(?::([1-9]\d*|0))?: no empty index (it named the current
    # device), no leading zero, no blank around it (these named device 1 and 15)
    "npu:", "npu:01", "npu:00", " npu:15 ", "npu: 1", "npu\n",
    pytest.param("npu:" + "1" * 5000, id="npu:<5000 digits>"),  # past int()'s digit limit, its own ValueError
    SimpleNamespace(type="cuda", index=0), SimpleNamespace(type="npu", index="1"), SimpleNamespace(idx="1"),
])
def test_bad_devices_are_rejected(device: object) -> None:
    with pytest.raises(ValueError, match="invalid device"):
        device_index(device)


@pytest.mark.parametrize("device", [-1, 16, 1000, "npu:16", "npu:-1", SimpleNamespace(type="npu", index=16),
                                    SimpleNamespace(index=-1), SimpleNamespace(idx=16)])
def test_an_index_no_device_has_is_torchs_runtime_error(device: object) -> None:
    """torch raises RuntimeError ("Invalid device argument") for any index
    past its devices and for a negative one; npualloc's InvalidDeviceError
    is both that and a ValueError, yet an index past npualloc's 16 devices
    or below 0 raised a plain ValueError, which `except RuntimeError` missed,
    while 8 on an 8-device node raised InvalidDeviceError."""
    with pytest.raises(InvalidDeviceError, match="invalid device .*: index out of range 0..15"):
        device_index(device)


def test_size_and_count_scaling_like_torch() -> None:
    assert format_size(100, 100) == "   100 B  "
    assert format_size(1536 * 1024, 1536 * 1024) == "  1536 KiB"
    assert format_size(2 << 30, 2 << 30) == "  2048 MiB"
    assert format_size(5 * MiB, 0) == "5242880 B  "  # scaled by the row's "all" value, not its own
    assert format_count(7, 7) == "      7   "
    assert format_count(800_000, 800_000) == "    800 K "


def test_human_bytes_never_prints_1024_of_a_unit() -> None:
    """The CLI's sizes: a value that rounds to 1024.00 of a unit is 1.00 of the next."""
    assert [human_bytes(v) for v in (1023, 1024, MiB - 1, MiB, (1 << 30) - 1, (1 << 30) - 6000, (1 << 40) - 1)] == [
        "1023 B", "1.00 KiB", "1.00 MiB", "1.00 MiB", "1.00 GiB", "1023.99 MiB", "1.00 TiB"]


def test_memory_summary_header_has_torchs_columns() -> None:
    """The title and the OOMs line sit in torch's fixed columns (torch/cuda/memory.py
    memory_summary: " {_:16} PyTorch CUDA memory summary, device ID {device:<17d} ",
    "  {_:9} CUDA OOMs: {num_ooms:<12d} | {_:6} cudaMalloc retries: ..."); they were
    centred, so the "|" moved with the counts and the title with the device's digits."""
    stats = stats_to_dict(ffi.new("npualloc_device_stats *"))  # every key memory_stats() has, all 0
    for device, ooms, retries in ((0, 1, 1), (15, 123456, 98765432)):
        lines = format_summary({**stats, "num_ooms": ooms, "num_alloc_retries": retries}, device).splitlines()
        assert lines[1] == f"|{'':18}npualloc NPU memory summary, device ID {device:<17d} |"
        assert lines[3] == f"|{'':12}NPU OOMs: {ooms:<13d} |{'':7}aclrtMalloc retries: {retries:<8d}  |"
        assert lines[3].index("|", 1) == 37 and all(len(line) == 77 for line in lines)


def test_memory_summary_has_torchs_rows_and_columns(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call(f"malloc({3 * MiB})")
        w.call("malloc(512)")
        full = w.call("npualloc.memory_summary()").splitlines()
        short = w.call("npualloc.memory_summary(abbreviated=True)").splitlines()
        stats = w.call("npualloc.memory_stats()")
        # torch's positional form, memory_summary(device, abbreviated): pid was
        # the second parameter, and True went there ("invalid pid True").
        assert w.call("npualloc.memory_summary(0, True)").splitlines() == short
    assert all(len(line) == 77 and line[0] == line[-1] == "|" for line in full + short)
    assert "npualloc NPU memory summary, device ID 0" in full[1]
    assert full[5] == "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |"
    labels = [line[1:24].strip() for line in full if line[2:3] not in ("-", "=") and "|" in line[1:-1]]
    assert labels[:2] == ["NPU OOMs: 0", "Metric"]
    assert labels[2:] == [
        label for row in ("Allocated memory", "Active memory", "Requested memory", "NPU reserved memory",
                          "Non-releasable memory", "Allocations", "Active allocs", "NPU reserved segments",
                          "Non-releasable allocs")
        for label in (row, "from large pool", "from small pool")
    ] + ["Oversize allocations", "Oversize NPU segments"]
    assert not any("from large pool" in line for line in short) and len(short) == len(full) - 18
    allocations = next(line for line in full if "Allocations" in line).split("|")[2:6]
    assert [int(cell) for cell in allocations] == [stats[f"allocation.all.{c}"] for c in
                                                   ("current", "peak", "allocated", "freed")]


def test_in_process_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    with Workload(tmp_path) as w:
        assert w.call("npualloc.is_active()") is True
        w.call(f"malloc({3 * MiB})")
        assert w.call("npualloc.memory_allocated()") >= 3 * MiB
        assert w.call("npualloc.memory_allocated('npu:0')") == w.call("npualloc.memory_allocated(0)")
        w.call("free()")
        assert w.call("npualloc.memory_allocated()") == 0
        assert w.call("npualloc.max_memory_allocated()") >= 3 * MiB
        w.call("npualloc.reset_peak_memory_stats()")
        assert w.call("npualloc.max_memory_allocated()") == 0
        assert w.call("npualloc.memory_reserved()") >= 20 * MiB
        w.call("npualloc.empty_cache()")
        assert w.call("npualloc.memory_reserved()") == 0
        assert w.call("npualloc.max_memory_reserved()") >= 20 * MiB
        w.call("npualloc.reset_accumulated_memory_stats()")
        assert w.call("npualloc.memory_stats()['num_device_alloc']") == 0

        w.call("npualloc.set_config('garbage_collection_threshold:0.7')")
        assert "garbage_collection_threshold:0.7" in w.call("npualloc.get_config()")
        assert w.call("npualloc.get_config()") == npualloc.get_config(pid=w.pid)
        with pytest.raises(AssertionError, match="ValueError"):
            w.call("npualloc.set_config('no_such_key:1')")
        assert w.call("npualloc.library_path()").endswith("/npualloc/lib/libnpualloc.so")


def test_set_config_refuses_a_string_c_would_cut_at_a_nul(tmp_path: Path) -> None:
    # The library reads the text up to its first NUL: the keys after it were
    # dropped unseen (neither applied nor warned about) and the call succeeded.
    with Workload(tmp_path) as w:
        w.call(f"malloc({MiB})")
        with pytest.raises(AssertionError, match="ValueError: .*NUL"):
            w.call("npualloc.set_config('record_history:7\\x00,record_stacks:bogus')")
        with pytest.raises(AssertionError, match="TypeError: .*bytes"):
            w.call("npualloc.set_config(b'record_history:7')")
        assert "record_history" not in w.call("npualloc.get_config()")


def _flatten_like_torch(nested: dict[str, object], prefix: str = "") -> dict[str, object]:
    """torch.cuda.memory_stats()'s _recurse_add_to_result: dict keys joined by "."."""
    flat: dict[str, object] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(_flatten_like_torch(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_memory_stats_as_nested_dict_is_what_torch_flattens(tmp_path: Path) -> None:
    # torch.cuda.memory_stats_as_nested_dict had no counterpart (AttributeError).
    with Workload(tmp_path) as w:
        w.call(f"malloc({3 * MiB})")
        nested = w.call("npualloc.memory_stats_as_nested_dict()")
        flat = w.call("npualloc.memory_stats()")
        assert w.call("npualloc.memory_stats_as_nested_dict('npu:0')") == nested
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] >= 3 * MiB
    assert nested["oversize_allocations"]["peak"] == flat["oversize_allocations.peak"]
    assert nested["num_device_alloc"] == flat["num_device_alloc"] and "cache_hits" in nested["npualloc"]
    assert _flatten_like_torch(nested) == flat


def test_torchs_deprecated_names_warn_and_do_the_new_ones() -> None:
    # torch.cuda.memory keeps memory_cached, max_memory_cached and the two
    # reset_max_memory_* with a FutureWarning; npualloc had none of them.
    proc = run_python("""
        import json, warnings
        import acl, npualloc
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        ptr, ret = acl.rt.malloc(3 << 20, 0)
        assert ret == 0 and acl.rt.free(ptr) == 0
        out = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["cached"] = [npualloc.memory_cached(), npualloc.memory_reserved()]
            out["max_cached"] = [npualloc.max_memory_cached(0), npualloc.max_memory_reserved(0)]
            npualloc.reset_max_memory_allocated()
            out["peak_after_reset"] = npualloc.max_memory_allocated()
            npualloc.empty_cache()
            npualloc.reset_max_memory_cached("npu:0")
            out["max_reserved_after_reset"] = npualloc.max_memory_reserved()
        out["warnings"] = [(w.category.__name__, str(w.message), w.filename) for w in caught]
        print(json.dumps(out))
    """, preload_env())
    out = json.loads(proc.stdout)
    assert out["cached"][0] == out["cached"][1] >= 20 * MiB
    assert out["max_cached"][0] == out["max_cached"][1] >= 20 * MiB
    assert out["peak_after_reset"] == 0 and out["max_reserved_after_reset"] == 0
    assert [(category, message.split(" ")[0]) for category, message, _ in out["warnings"]] == [
        ("FutureWarning", "npualloc.memory_cached"), ("FutureWarning", "npualloc.max_memory_cached"),
        ("FutureWarning", "npualloc.reset_max_memory_allocated"), ("FutureWarning", "npualloc.reset_max_memory_cached")]
    assert all(filename == "<string>" for _, _, filename in out["warnings"])  # the caller's line, as torch's


def test_set_gc_threshold_zero_turns_gc_off_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A config string cannot say 0 (torch's parser refuses it), so this once
    # raised ValueError and the threshold stayed on.
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    with Workload(tmp_path) as w:
        w.call("npualloc.set_gc_threshold(0.7)")  # before the first malloc: the config it starts with
        assert "garbage_collection_threshold:0.7" in w.call("npualloc.get_config()")
        w.call("npualloc.set_gc_threshold(0)")
        assert "garbage_collection_threshold" not in w.call("npualloc.get_config()")
        w.call("npualloc.set_gc_threshold(0.6)")
        w.call(f"malloc({3 * MiB})")
        assert "garbage_collection_threshold:0.6" in npualloc.get_config(pid=w.pid)
        w.call("npualloc.set_gc_threshold(0)")
        assert "garbage_collection_threshold" not in w.call("npualloc.get_config()")
        assert "garbage_collection_threshold" not in npualloc.get_config(pid=w.pid)
        # torch_npu's rule refuses expandable segments beside a threshold: taken
        # now, so the allocator's threshold really is off.
        w.call("npualloc.set_config('expandable_segments:True')")
        assert "expandable_segments:True" in w.call("npualloc.get_config()")
        with pytest.raises(AssertionError, match="ValueError"):
            w.call("npualloc.set_gc_threshold(0.5)")  # now refused beside expandable segments
        with pytest.raises(AssertionError, match="ValueError"):
            w.call("npualloc.set_gc_threshold(1.0)")


def test_set_per_process_memory_fraction_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's set_per_process_memory_fraction on a 100 MiB device: set before
    the first allocation, lowered under what is reserved (the cache still
    serves, growth fails with the allocator's OOM), raised; bad values raise
    as torch's do and change nothing."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    b20, b30, b40 = (n * MiB - 64 for n in (20, 30, 40))  # aclrtMalloc's 32 bytes on top still fit n MiB
    limit = "npualloc.memory_stats()['npualloc.reserved_limit_bytes']"
    with Workload(tmp_path, NPUSIM_HBM_MB="100") as w:
        w.call("npualloc.set_per_process_memory_fraction(0.5)")  # before the first malloc
        assert w.call(limit) == 50 * MiB
        w.call(f"malloc({b40})")
        assert w.call(f"acl.rt.malloc({b20}, 0)[1]") == 207001
        w.call("npualloc.set_per_process_memory_fraction(1, 'npu:0')")  # torch takes a float only; npualloc, any real
        assert w.call(limit) == 0
        w.call(f"malloc({b20})")
        w.call("free()")  # cached: 60 MiB reserved
        w.call("npualloc.set_per_process_memory_fraction(0.3, device=0)")
        assert w.call(limit) == int(0.3 * 100 * MiB)
        alloc_before = w.call("npualloc.memory_stats()['num_device_alloc']")
        w.call(f"malloc({b20})")  # the cache serves past the cap
        assert w.call("npualloc.memory_stats()['num_device_alloc']") == alloc_before
        assert w.call(f"acl.rt.malloc({b30}, 0)[1]") == 207001
        assert w.call("npualloc.memory_stats()['num_ooms']") == 2

        for bad, error in (("'0.5'", "TypeError"), ("True", "TypeError"), ("None", "TypeError"),
                           ("-0.1", "ValueError: invalid fraction"), ("1.5", "ValueError: invalid fraction"),
                           ("10 ** 400", "ValueError: invalid fraction"),  # float() of it: OverflowError
                           ("float('nan')", "ValueError: invalid fraction"),
                           ("1e-9", "ValueError: fraction 1e-09 caps device 0 at 0 bytes, below the smallest"),
                           ("0.5, 'npu:12'", "InvalidDeviceError: invalid device")):  # the simulator has 8
            with pytest.raises(AssertionError, match=error):
                w.call(f"npualloc.set_per_process_memory_fraction({bad})")
        assert w.call(limit) == int(0.3 * 100 * MiB)
        # The library refuses what the Python checks stop first, warning once.
        assert w.call("npualloc.memory._library().npualloc_set_memory_fraction(1e-9, 0)") == -1
        assert w.call(limit) == int(0.3 * 100 * MiB)
        stderr = w.stderr()
    assert ("npualloc: npualloc_set_memory_fraction: 1e-09 on device 0: its cap is below the smallest segment "
            "(2 MiB), which would refuse every allocation (not applied)\n") in stderr, stderr
    assert stderr.count("the per-process cap was hit") == 2, stderr


def test_get_per_process_memory_fraction_reads_the_cap_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's get_per_process_memory_fraction was missing (AttributeError):
    the cap over the device's memory as torch computes it, 1.0 without one;
    a device not set up yet reads the config's fraction, which it takes then
    (torch's devices take it at start). In the process and from outside alike."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    get = "npualloc.get_per_process_memory_fraction"
    with Workload(tmp_path, NPUSIM_HBM_MB="100", PYTORCH_NPU_ALLOC_CONF="per_process_memory_fraction:0.25") as w:
        assert w.call(f"{get}()") == 0.25  # nothing allocated yet
        w.call("malloc(4096)")
        assert w.call(f"{get}(0)") == npualloc.get_per_process_memory_fraction(pid=w.pid) == 0.25
        assert w.call(f"{get}('npu:1')") == npualloc.get_per_process_memory_fraction(1, pid=w.pid) == 0.25
        w.call("npualloc.set_per_process_memory_fraction(0.3, 1)")
        truncated = int(0.3 * 100 * MiB) / (100 * MiB)
        assert w.call(f"{get}(1)") == npualloc.get_per_process_memory_fraction("npu:1", pid=w.pid) == truncated
        w.call("npualloc.set_per_process_memory_fraction(1.0)")  # the cap off, whatever the config said
        assert w.call(f"{get}()") == npualloc.get_per_process_memory_fraction(0, pid=w.pid) == 1.0
        with pytest.raises(AssertionError, match="InvalidDeviceError: invalid device 12"):
            w.call(f"{get}(12)")
        with pytest.raises(InvalidDeviceError, match="invalid device 12"):
            npualloc.get_per_process_memory_fraction(12, pid=w.pid)
    with Workload(tmp_path) as w:  # no config: no cap anywhere
        w.call("malloc(4096)")
        assert [w.call(f"{get}({d})") for d in (0, 1)] == [1.0, 1.0]


def test_a_memory_fraction_refused_before_acl_init_sets_nothing_up(tmp_path: Path) -> None:
    """The library's call before aclInit: the runtime cannot tell the device's
    memory, so it is refused, warned once, before the allocator (and its
    region) is made for it; after aclInit the same call caps the device."""
    proc = run_python("""
        import os, acl
        from npualloc import memory
        lib = memory._library()
        print(lib.npualloc_set_memory_fraction(0.5, 0), os.listdir(os.environ["NPUALLOC_SHM_DIR"]))
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        print(lib.npualloc_set_memory_fraction(0.5, 0), memory.memory_stats()["npualloc.reserved_limit_bytes"])
    """, preload_env(NPUALLOC_SHM_DIR=str(tmp_path), NPUSIM_HBM_MB="100"))
    assert proc.stdout.splitlines() == ["-1 []", f"0 {50 * MiB}"], proc.stdout
    assert proc.stderr == ("npualloc: npualloc_set_memory_fraction: 0.5 on device 0: the runtime cannot tell the "
                           "device's memory (not applied)\n"), proc.stderr


def test_max_split_size_is_the_setting_before_the_first_allocation() -> None:
    """torch reports the configured max_split_size as soon as its allocator
    exists; npualloc reported -1 ("unset") until the first allocation."""
    code = "import npualloc; print(npualloc.memory_stats()['max_split_size'], npualloc.memory_allocated())"
    proc = run_python(code, preload_env(PYTORCH_NPU_ALLOC_CONF="max_split_size_mb:25"))
    assert proc.stdout.split() == [str(25 * MiB), "0"]
    assert run_python(code, preload_env()).stdout.split() == ["-1", "0"]


def test_a_device_past_the_runtimes_count_is_refused_in_process() -> None:
    """torch raises for a device index past the devices it sees; npualloc read
    that device's stats as zeros (and reset nothing, silently). The error is
    torch's RuntimeError ("Invalid device argument") and the ValueError that
    npualloc raised before it was one."""
    calls = ["memory_stats(2)", "memory_allocated('npu:2')", "reset_peak_memory_stats(2)",
             "reset_accumulated_memory_stats(2)", "mem_get_info(2)"]
    proc = run_python(f"""
import npualloc
for call in {calls!r}:
    try:
        eval("npualloc." + call)
        print(call, "accepted")
    except RuntimeError as e:
        assert isinstance(e, ValueError)
        print(call, "refused:", e)
print(npualloc.memory_stats(1)["allocated_bytes.all.current"])
""", preload_env(NPUSIM_DEVICE_COUNT="2"))
    lines = proc.stdout.splitlines()
    assert lines == [f"{call} refused: invalid device {call[call.index('(') + 1:-1]}: the runtime sees 2 device(s)"
                     for call in calls] + ["0"], proc.stdout + proc.stderr


def test_mem_get_info_inside_follows_the_runtime(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        free, total = w.call("npualloc.mem_get_info()")
        assert 0 < free <= total
        assert [free, total] == w.call("acl.rt.get_mem_info(1)")[:2]
        w.call(f"malloc({64 * MiB})")  # a new segment: device memory really taken
        free_after, total_after = w.call("npualloc.mem_get_info('npu:0')")
        assert total_after == total and free_after <= free - 64 * MiB


def test_mem_get_info_outside_loads_the_runtime() -> None:
    proc = run_python("""
        import json, npualloc
        assert not npualloc.is_active()
        print(json.dumps([npualloc.mem_get_info(), npualloc.mem_get_info("npu:0")]))
    """, sim_env())
    (free, total), again = json.loads(proc.stdout)
    assert 0 < free <= total and again == [free, total]


def test_mem_get_info_outside_refuses_a_device_past_the_runtimes_count() -> None:
    """Without npualloc loaded, such a device raised NpuallocError
    (aclrtSetDevice's invalid device id), not the InvalidDeviceError, torch's
    RuntimeError, that the process's own calls and pid= raise."""
    proc = run_python("""
        import npualloc
        for device in (2, "npu:3"):
            try:
                npualloc.mem_get_info(device)
            except RuntimeError as e:
                print(type(e).__name__, e)
        print(npualloc.mem_get_info(1)[1] > 0)
    """, sim_env(NPUSIM_DEVICE_COUNT="2"))
    assert proc.stdout.splitlines() == ["InvalidDeviceError invalid device 2: the runtime sees 2 device(s)",
                                        "InvalidDeviceError invalid device 'npu:3': the runtime sees 2 device(s)",
                                        "True"], proc.stdout + proc.stderr


def test_mem_get_info_outside_leaves_the_current_device() -> None:
    # It called aclrtSetDevice and never undid it: mem_get_info(1) left device 1
    # current, and a thread with no device had one. torch's runs under a guard.
    proc = run_python("""
        import json, acl, npualloc
        assert acl.init() == 0
        seen = [acl.rt.get_device()[1] != 0]
        npualloc.mem_get_info()
        seen.append(acl.rt.get_device()[1] != 0)
        assert acl.rt.set_device(0) == 0
        npualloc.mem_get_info(1)
        seen.append(acl.rt.get_device())
        print(json.dumps(seen))
    """, sim_env())
    assert json.loads(proc.stdout) == [True, True, [0, 0]]


def test_mem_get_info_without_a_runtime_says_so() -> None:
    env = sim_env(NPUALLOC_ACL_LIB="/nonexistent/libascendcl.so")
    env.pop("ASCEND_HOME_PATH")
    env["LD_LIBRARY_PATH"] = ""
    proc = run_python("""
        import npualloc
        try:
            npualloc.mem_get_info()
        except npualloc.NpuallocError as e:
            print(e)
    """, env)
    assert "no Ascend runtime found" in proc.stdout and "/nonexistent/libascendcl.so" in proc.stdout


def test_in_process_stats_without_a_runtime_are_silent() -> None:
    """A preloaded process that no CANN runtime reaches (a CPU-only run):
    the stats of its current device are torch's zeros, read without a word
    on stderr. npualloc_current_device's question to the runtime warned
    that ACL calls fail, though the program made none."""
    env = preload_env()
    env.pop("ASCEND_HOME_PATH")
    env["LD_LIBRARY_PATH"] = ""
    proc = run_python("""
        import json, npualloc
        from npualloc._ffi import loaded_library
        print(json.dumps([loaded_library().npualloc_current_device(), npualloc.memory_allocated(),
                          npualloc.memory_stats()["num_ooms"]]))
    """, env)
    assert json.loads(proc.stdout) == [-1, 0, 0]
    assert proc.stderr == ""


def test_in_process_calls_without_npualloc_loaded() -> None:
    assert not npualloc.is_active()
    with pytest.raises(NotUnderNpuallocError, match="not loaded in this process"):
        npualloc.memory_stats()
    with pytest.raises(NotUnderNpuallocError):
        npualloc.memory_allocated(pid=os.getpid())
    with pytest.raises(NotUnderNpuallocError):
        npualloc.caching_allocator_alloc(4096)
    with pytest.raises(NotUnderNpuallocError):
        npualloc.caching_allocator_delete(4096)
    assert npualloc.library_path().endswith("libnpualloc.so")


def test_caching_allocator_alloc_and_delete_on_the_current_device(tmp_path: Path) -> None:
    """torch's caching_allocator_alloc/_delete: the address of a block of the
    cache on the thread's device and its default stream; the delete gives it
    back to the cache (allocated bytes back, reserved kept). Size 0 is torch's
    null pointer, and deleting it does nothing."""
    with Workload(tmp_path) as w:
        ptr = w.call(f"npualloc.caching_allocator_alloc({3 * MiB})")
        assert ptr != 0 and ptr % 64 == 0
        assert w.call("npualloc.memory_allocated()") >= 3 * MiB
        reserved = w.call("npualloc.memory_reserved()")
        assert reserved >= 3 * MiB
        segments = w.call("[(s['device'], s['stream'], s['allocated_size']) for s in npualloc._snapshot()['segments']]")
        assert segments == [[0, 0, w.call("npualloc.memory_allocated()")]]  # the default stream: handle 0
        assert w.call(f"npualloc.caching_allocator_delete({ptr})") is None
        assert w.call("npualloc.memory_allocated()") == 0
        assert w.call("npualloc.memory_reserved()") == reserved
        stats = w.call("npualloc.memory_stats()")
        assert w.call("npualloc.caching_allocator_alloc(0, 'npu:0', 0)") == 0
        assert w.call("npualloc.caching_allocator_delete(0)") is None
        assert w.call("npualloc.memory_stats()") == stats


def test_caching_allocator_alloc_on_another_device_and_a_created_stream(tmp_path: Path) -> None:
    """Device in every form device_index() takes, the stream as an int or a
    cffi pointer: that device's stats move, the thread's current device is the
    same afterwards (for the runtime and for npualloc), and the block's
    segment is the stream's (its pools). The delete names neither and works
    from the thread's own device."""
    with Workload(tmp_path) as w:
        stream = w.call("acl.rt.create_stream()")[0]
        guard = "type('Guard', (), {'idx': 2})()"  # torch.npu.device(2)
        ptrs = [w.call(f"npualloc.caching_allocator_alloc({MiB}, {device}, {form})")
                for device, form in (("1", stream), ("'npu:2'", f"npualloc.memory.ffi.cast('void *', {stream})"),
                                     (guard, "None"))]
        assert w.call("acl.rt.get_device()") == [0, 0]
        assert w.call("npualloc.memory.loaded_library().npualloc_current_device()") == 0
        assert w.call("npualloc.memory_allocated(0)") == 0
        assert w.call("npualloc.memory_allocated(1)") >= MiB and w.call("npualloc.memory_allocated(2)") >= 2 * MiB
        segments = w.call("sorted((s['device'], s['stream']) for s in npualloc._snapshot()['segments'])")
        assert segments == [[1, stream], [2, 0], [2, stream]]
        reserved = [w.call(f"npualloc.memory_reserved({d})") for d in (1, 2)]
        for ptr in ptrs:
            w.call(f"npualloc.caching_allocator_delete({ptr})")
        assert [w.call(f"npualloc.memory_allocated({d})") for d in (1, 2)] == [0, 0]
        assert [w.call(f"npualloc.memory_reserved({d})") for d in (1, 2)] == reserved
        assert w.call("acl.rt.get_device()") == [0, 0]


def test_caching_allocator_refuses_bad_input_and_changes_nothing(tmp_path: Path) -> None:
    """A bad size, device or stream raises what torch raises (TypeError for a
    type, ValueError for a value) before anything is allocated; a delete of
    a pointer that is no live block (twice, inside a block, never ours)
    raises torch's RuntimeError and frees nothing; one too big for the
    device raises RuntimeError as an out of memory."""
    with Workload(tmp_path) as w:
        kept = w.call(f"npualloc.caching_allocator_alloc({MiB})")
        gone = w.call(f"npualloc.caching_allocator_alloc({MiB})")
        w.call(f"npualloc.caching_allocator_delete({gone})")
        stats = w.call("npualloc.memory_stats()")
        for call, error in ((f"alloc({MiB}.0)", "TypeError: invalid type for size"), ("alloc('4096')", "TypeError"),
                            ("alloc(True)", "TypeError"), ("alloc(-1)", "ValueError: invalid size -1"),
                            ("alloc(2 ** 63)", "ValueError: invalid size"),
                            ("alloc(512, 'npu:12')", "InvalidDeviceError: invalid device 'npu:12': the runtime sees 8"),
                            ("alloc(512, 'cuda:0')", "ValueError: invalid device"),
                            ("alloc(512, -1)", "InvalidDeviceError: invalid device -1: index out of range"),
                            ("alloc(512, 1.0)", "ValueError: invalid device"),
                            ("alloc(512, 0, 'stream')", "TypeError: Invalid type for stream"),
                            ("alloc(512, 0, -1)", "ValueError: invalid stream -1"),
                            ("delete(float(%d))" % kept, "TypeError"),
                            (f"delete({gone})", f"RuntimeError: invalid device pointer: {gone:#x}"),
                            (f"delete({kept} + 64)", "RuntimeError: invalid device pointer"),
                            ("delete(0x1000)", "RuntimeError: invalid device pointer: 0x1000"),
                            ("delete(-1)", "RuntimeError: invalid device pointer")):
            with pytest.raises(AssertionError, match=error):
                w.call(f"npualloc.caching_allocator_{call}")
        after = w.call("npualloc.memory_stats()")
        assert after.pop("npualloc.invalid_frees") == stats.pop("npualloc.invalid_frees") + 2  # inside our memory
        assert after == stats
        with pytest.raises(AssertionError, match="RuntimeError: .* failed: out of memory"):
            w.call(f"npualloc.caching_allocator_alloc({1 << 62})")
        assert w.call("npualloc.memory_stats()['num_ooms']") == 1
        w.call(f"npualloc.caching_allocator_delete({kept})")
        assert w.call("npualloc.memory_allocated()") == 0


def test_caching_allocator_alloc_and_delete_from_threads(tmp_path: Path) -> None:
    """Threads on devices 0 and 1 allocate on devices 0 to 2 and on their own
    streams and delete each other's blocks: every thread's device is the
    same throughout, nothing fails, and every device's allocated bytes end at 0."""
    proc = run_python("""
        import json, random, threading, acl, npualloc
        assert acl.init() == 0
        blocks, errors, lock = [], [], threading.Lock()
        def work(seed):
            try:
                rng = random.Random(seed)
                own = seed % 2
                assert acl.rt.set_device(own) == 0
                stream, ret = acl.rt.create_stream()
                assert ret == 0
                for _ in range(300):
                    if rng.random() < 0.5:
                        size = rng.choice([512, 4096, 300000, 3 << 20])
                        ptr = npualloc.caching_allocator_alloc(size, rng.randrange(3), rng.choice([None, stream]))
                        with lock:
                            blocks.append(ptr)
                    else:
                        with lock:
                            ptr = blocks.pop(rng.randrange(len(blocks))) if blocks else 0
                        npualloc.caching_allocator_delete(ptr)
                    assert acl.rt.get_device() == (own, 0)
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert acl.rt.set_device(0) == 0
        for ptr in blocks:
            npualloc.caching_allocator_delete(ptr)
        print(json.dumps([npualloc.memory_allocated(d) for d in range(3)]))
    """, preload_env(NPUALLOC_SHM_DIR=str(tmp_path)))
    assert json.loads(proc.stdout) == [0, 0, 0], proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_caching_allocator_delete_waits_for_the_streams_queued_work(tmp_path: Path) -> None:
    """The caller holds a bare address, which pyACL programs write with
    aclrtMemcpy (at once, ahead of the stream's queued work): a deleted block
    waits for an event on its own stream before the next allocation there
    takes it, as MindTorch's pass-through asks of the stream entry."""
    with Workload(tmp_path) as w:
        stream = w.call("acl.rt.create_stream()")[0]
        ptr = w.call(f"npualloc.caching_allocator_alloc(4096, 0, {stream})")
        w.call(f"npualloc.caching_allocator_delete({ptr})")
        assert w.call("npualloc.memory_stats()['npualloc.pending_frees']") == 1
        assert w.call(f"npualloc.caching_allocator_alloc(4096, 0, {stream})") == ptr  # its stream idle: the event done
        assert w.call("npualloc.memory_stats()['npualloc.pending_frees']") == 0


def test_caching_allocator_alloc_inside_a_memory_saver_region() -> None:
    """Inside memory_saver.region() the calling thread's allocations are
    pausable, this one too (on the device named), and its delete frees it."""
    proc = run_python("""
        import json, acl, npualloc
        from npualloc import memory_saver
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        with memory_saver.region():
            ptr = npualloc.caching_allocator_alloc(1 << 20, 1)
        seen = [npualloc.memory_stats(1)["npualloc.saver_allocations"], npualloc.memory_allocated(1)]
        npualloc.caching_allocator_delete(ptr)
        seen.append(npualloc.memory_stats(1)["npualloc.saver_allocations"])
        print(json.dumps(seen))
    """, preload_env())
    assert json.loads(proc.stdout) == [1, 0, 0], proc.stdout + proc.stderr


def test_the_current_device_survives_a_reset_that_leaves_it_current() -> None:
    """aclrtResetDevice drops one reference: a device set twice and reset once
    stays current, and aclrtMalloc allocates there. npualloc forgot its
    record at the reset and the Python API read "no device" as device 0:
    memory_stats() showed device 0's and caching_allocator_alloc() allocated
    on device 0."""
    proc = run_python("""
        import json, acl, npualloc
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        assert acl.rt.set_device(1) == 0 and acl.rt.set_device(1) == 0 and acl.rt.reset_device(1) == 0
        ptr = npualloc.caching_allocator_alloc(4096)
        print(json.dumps([acl.rt.get_device(), npualloc.memory_allocated(), npualloc.memory_allocated(0)]))
    """, preload_env())
    assert json.loads(proc.stdout) == [[1, 0], 4608, 0], proc.stdout + proc.stderr
