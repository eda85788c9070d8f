"""torch.cuda.memory's API over npualloc.

With pid=None (or this process's pid) the calls go to the libnpualloc.so loaded
in this process (LD_PRELOAD); with another pid they read that process's
shared-memory region, and the mutating calls post a command to it.
"""
from __future__ import annotations

import numbers
import operator
import os
import re
import warnings
from typing import Any

from ._ffi import (ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_MEMORY_FREE, ACL_HBM_MEM, PACKAGE_DIR, c_string,
                   constants, ffi, loaded_library, runtime_library)
from .errors import CorruptRegionError, InvalidDeviceError, NotUnderNpuallocError, NpuallocError
from .region import COMMAND_TIMEOUT_S, Region, read_live_regions
from .summary import format_summary

# Pool order of every per-pool stat array (NPUALLOC_POOL_ALL, _SMALL, _LARGE).
_POOLS = ("all", "small_pool", "large_pool")
_POOLED_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_FIELDS = ("current", "peak", "allocated", "freed")
_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
             "max_split_size")
# npualloc's own counters, reported as "npualloc.<key>".
_OWN_COUNTERS = {
    "cache_hits": "num_cache_hits",
    "cache_misses": "num_cache_misses",
    "largest_free_block": "largest_free_block",
    "foreign_frees": "num_foreign_frees",
    "invalid_frees": "num_invalid_frees",
    "pending_frees": "num_pending_frees",
    "executor_destroys_forwarded": "num_executor_destroys_forwarded",
    "executor_destroys_skipped": "num_executor_destroys_skipped",
    "device_free_bytes": "device_free_bytes",
    "device_total_bytes": "device_total_bytes",
    "reserved_limit_bytes": "reserved_limit_bytes",
}

# memory_saver's allocations (npualloc_saver_stats), reported as "npualloc.saver_<field>":
# they never enter the cache, so torch's keys above do not count them.
_SAVER_FIELDS = ("allocations", "allocated_bytes", "paused_bytes", "backup_bytes")

Stats = dict[str, Any]


def stats_to_dict(s: Any, saver: Any = None) -> Stats:
    """torch's flat memory_stats() dict (same keys, sorted like torch) from an
    npualloc_device_stats, plus npualloc's own keys under "npualloc.", and
    memory_saver's from an npualloc_saver_stats (zero without one)."""
    out: Stats = {}
    for field in _SAVER_FIELDS:
        out[f"npualloc.saver_{field}"] = getattr(saver, field) if saver is not None else 0
    for name in _POOLED_STATS:
        for pool_index, pool in enumerate(_POOLS):
            stat = getattr(s, name)[pool_index]
            for field in _STAT_FIELDS:
                out[f"{name}.{pool}.{field}"] = getattr(stat, field)
    for name in ("oversize_allocations", "oversize_segments"):
        for field in _STAT_FIELDS:
            out[f"{name}.{field}"] = getattr(getattr(s, name), field)
    for name in _COUNTERS:
        out[name] = getattr(s, name)
    for key, field in _OWN_COUNTERS.items():
        out[f"npualloc.{key}"] = getattr(s, field)
    lookups = s.num_cache_hits + s.num_cache_misses
    out["npualloc.cache_hit_rate"] = s.num_cache_hits / lookups if lookups else 0.0
    # Free cached bytes are reserved minus active (pending frees are not free yet);
    # 0 when everything free sits in one block.
    free_cached = s.reserved_bytes[0].current - s.active_bytes[0].current
    fragmentation = 1.0 - s.largest_free_block / free_cached if free_cached > 0 else 0.0
    out["npualloc.fragmentation"] = min(max(fragmentation, 0.0), 1.0)
    return dict(sorted(out.items()))


def _in_process(pid: int | None) -> bool:
    return pid is None or pid == os.getpid()


def _library() -> Any:
    lib = loaded_library()
    if lib is None:
        raise NotUnderNpuallocError("npualloc is not loaded in this process "
                                    "(start it with `npualloc run -- ...` or LD_PRELOAD=libnpualloc.so)")
    return lib


def _current_device() -> int:
    lib = loaded_library()
    device = lib.npualloc_current_device() if lib is not None else -1
    return device if device >= 0 else 0


def _own_device(lib: Any, device: object) -> int:
    """device_index() of a device of this process, refused past the devices
    the runtime sees, as torch refuses them: their stats read all zeros."""
    index = device_index(device)
    _check_device_count(device, index, lib.npualloc_device_count())
    return index


def _check_device_count(device: object, index: int, count: int) -> None:
    if 0 <= count <= index:
        raise InvalidDeviceError(f"invalid device {device!r}: the runtime sees {count} device(s)")


def parse_decimal(text: str) -> int | None:
    """The value of text written as ASCII digits with an optional leading '-',
    else None. int() also takes '٣' (Arabic-Indic 3), '1_000', '+7' and ' 7 ',
    which would let 'npu:٣' or a pid of '٣٤' name device 3 or process 34.
    Values of more than 18 digits are None too: no pid, port, device or count
    reaches them, and past 4300 digits int() raises its own ValueError."""
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()) or len(digits.lstrip("0")) > 18:
        return None
    return int(text)


def device_index(device: object, current: int | None = None) -> int:
    """Normalises a device like torch: None or "npu" -> the current device, an
    int, "npu:N" (N written as torch.device reads it), an object with .index
    (and .type "npu" when it has one), or a device guard with .idx
    (torch.npu.device(N), as torch takes torch.cuda.device)."""
    index: object
    if device is None:
        index = None
    elif isinstance(device, bool):
        raise ValueError(f"invalid device {device!r}")
    elif isinstance(device, int):
        index = device
    elif isinstance(device, str):
        # torch.device's grammar: "npu:" and "npu:01" are errors there, not the current device and device 1.
        kind, colon, number = device.partition(":")
        index = parse_decimal(number) if colon else None
        if kind != "npu" or (colon and (index is None or number != str(index))):
            raise ValueError(f"invalid device {device!r}: expected 'npu' or 'npu:N'")
    elif hasattr(device, "index") or hasattr(device, "idx"):
        kind = getattr(device, "type", "npu")
        if kind != "npu":
            raise ValueError(f"invalid device {device!r}: not an NPU device")
        index = device.index if hasattr(device, "index") else getattr(device, "idx")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise ValueError(f"invalid device {device!r}")
    else:
        raise ValueError(f"invalid device {device!r}")
    if index is None:
        return _current_device() if current is None else current
    assert isinstance(index, int)
    if not 0 <= index < constants.NPUALLOC_MAX_DEVICES:  # past every runtime's devices, as torch checks them
        raise InvalidDeviceError(f"invalid device {device!r}: index out of range "
                                 f"0..{constants.NPUALLOC_MAX_DEVICES - 1}")
    return index


def region_device(region: Region, device: object) -> int:
    """device_index() of a device of the region's process, refused past the
    devices its runtime sees, as _own_device refuses them in the process
    (not checked where the process did not record the count). Outside the
    process its current device is unknown: default to the first device it
    allocated on."""
    in_use = region.devices_in_use()
    index = device_index(device, current=in_use[0] if in_use else 0)
    count = region.runtime_device_count()
    if count:
        _check_device_count(device, index, count)
    return index


def _raw_stats(device: object, pid: int | None, saver: bool = False) -> tuple[Any, Any, int]:
    """(npualloc_device_stats, npualloc_saver_stats or None unless saver, index)."""
    if _in_process(pid):
        lib = _library()
        index = _own_device(lib, device)
        out = ffi.new("npualloc_device_stats *")
        if lib.npualloc_get_stats(index, out) != 0:
            raise ValueError(f"npualloc has no stats for device {index}")
        saved = ffi.new("npualloc_saver_stats *") if saver else None
        if saved is not None:
            lib.npualloc_get_saver_stats(index, saved)
        return out, saved, index
    assert pid is not None
    with Region(pid) as region:
        index = region_device(region, device)
        return region.read_device_stats(index), region.read_saver_stats(index) if saver else None, index


def region_stats(region: Region, device: int) -> Stats:
    """memory_stats() of one device of another process's region."""
    return stats_to_dict(region.read_device_stats(device), region.read_saver_stats(device))


def memory_stats(device: object = None, pid: int | None = None) -> Stats:
    raw, saver, _ = _raw_stats(device, pid, saver=True)
    return stats_to_dict(raw, saver)


def memory_stats_as_nested_dict(device: object = None, pid: int | None = None) -> Stats:
    """torch's memory_stats_as_nested_dict(): memory_stats() with each dotted
    key a path of nested dicts ("allocated_bytes.all.current" ->
    ["allocated_bytes"]["all"]["current"], "npualloc.cache_hits" ->
    ["npualloc"]["cache_hits"]), which torch's memory_stats() flattens."""
    nested: Stats = {}
    for key, value in memory_stats(device, pid).items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_allocated(device: object = None, pid: int | None = None) -> int:
    return int(_raw_stats(device, pid)[0].allocated_bytes[0].current)


def max_memory_allocated(device: object = None, pid: int | None = None) -> int:
    return int(_raw_stats(device, pid)[0].allocated_bytes[0].peak)


def memory_reserved(device: object = None, pid: int | None = None) -> int:
    return int(_raw_stats(device, pid)[0].reserved_bytes[0].current)


def max_memory_reserved(device: object = None, pid: int | None = None) -> int:
    return int(_raw_stats(device, pid)[0].reserved_bytes[0].peak)


# torch's deprecated names, kept by torch.cuda.memory (and torch_npu) with a
# FutureWarning each: "cached" is torch's old word for reserved.

def memory_cached(device: object = None, pid: int | None = None) -> int:
    warnings.warn("npualloc.memory_cached has been renamed to npualloc.memory_reserved", FutureWarning, stacklevel=2)
    return memory_reserved(device, pid)


def max_memory_cached(device: object = None, pid: int | None = None) -> int:
    warnings.warn("npualloc.max_memory_cached has been renamed to npualloc.max_memory_reserved", FutureWarning,
                  stacklevel=2)
    return max_memory_reserved(device, pid)


def memory_summary(device: object = None, abbreviated: bool = False, *, pid: int | None = None) -> str:
    """torch's memory_summary(device=None, abbreviated=False): its positional
    arguments stay torch's, so pid= is keyword only."""
    raw, saver, index = _raw_stats(device, pid, saver=True)
    return format_summary(stats_to_dict(raw, saver), index, abbreviated)


def _post(code: int, device: int, arg: float, pid: int, timeout: float) -> None:
    with Region(pid, writable=True) as region:
        region.post_command(code, device, arg, timeout)


def empty_cache(pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> None:
    """Releases every cached unused segment of every device (torch semantics)."""
    if _in_process(pid):
        _library().npualloc_empty_cache(-1)
    else:
        assert pid is not None
        _post(constants.NPUALLOC_CMD_EMPTY_CACHE, -1, 0.0, pid, timeout)


def _reset(code: int, c_function: str, device: object, pid: int | None, timeout: float) -> None:
    if _in_process(pid):
        lib = _library()
        getattr(lib, c_function)(_own_device(lib, device))
        return
    assert pid is not None
    with Region(pid) as region:
        index = region_device(region, device)
    _post(code, index, 0.0, pid, timeout)


def reset_peak_memory_stats(device: object = None, pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> None:
    _reset(constants.NPUALLOC_CMD_RESET_PEAK, "npualloc_reset_peak_stats", device, pid, timeout)


def reset_max_memory_allocated(device: object = None, pid: int | None = None,
                               timeout: float = COMMAND_TIMEOUT_S) -> None:
    warnings.warn("npualloc.reset_max_memory_allocated now calls npualloc.reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device, pid, timeout)


def reset_max_memory_cached(device: object = None, pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> None:
    warnings.warn("npualloc.reset_max_memory_cached now calls npualloc.reset_peak_memory_stats, which resets "
                  "/all/ peak memory stats.", FutureWarning, stacklevel=2)
    reset_peak_memory_stats(device, pid, timeout)


def reset_accumulated_memory_stats(device: object = None, pid: int | None = None,
                                   timeout: float = COMMAND_TIMEOUT_S) -> None:
    _reset(constants.NPUALLOC_CMD_RESET_ACCUMULATED, "npualloc_reset_accumulated_stats", device, pid, timeout)


def set_gc_threshold(threshold: float, pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> None:
    """garbage_collection_threshold at run time; 0 turns GC off."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"garbage_collection_threshold must be in [0, 1): {threshold}")
    if _in_process(pid):
        # Not set_config: torch's config parser refuses a threshold of 0.
        if _library().npualloc_set_gc_threshold(threshold) != 0:
            raise ValueError(f"npualloc refused garbage_collection_threshold {threshold} (warned on stderr)")
    else:
        assert pid is not None
        _post(constants.NPUALLOC_CMD_SET_GC_THRESHOLD, -1, threshold, pid, timeout)


# Every allocation takes a segment (or an expandable page) of at least this
# size, so a cap below it would refuse everything: the library refuses it.
_SMALLEST_SEGMENT = 2 << 20


def _check_fraction_cap(fraction: float, total_bytes: int, index: int) -> None:
    cap = int(fraction * total_bytes)  # as the library rounds it: the double product, truncated
    if fraction < 1.0 and cap < _SMALLEST_SEGMENT:
        raise ValueError(f"fraction {fraction:g} caps device {index} at {cap} bytes, below the smallest segment "
                         f"({_SMALLEST_SEGMENT} bytes): nothing could be allocated")


def _set_memory_fraction(fraction: object, device: object, pid: int | None, timeout: float) -> int:
    """set_per_process_memory_fraction, returning the device index it set."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise TypeError(f"invalid type for fraction: {type(fraction).__name__}, must be a float")
    if not 0 <= fraction <= 1:  # also NaN; compared before float(), which raises OverflowError for 10**400
        raise ValueError(f"invalid fraction value: {fraction}. Allowed range: 0~1")
    value = float(fraction)
    if _in_process(pid):
        lib = _library()
        index = _own_device(lib, device)
        _check_fraction_cap(value, mem_get_info(index)[1], index)
        if lib.npualloc_set_memory_fraction(value, index) != 0:
            raise ValueError(f"npualloc refused memory fraction {value:g} on device {index} (warned on stderr)")
        return index
    assert pid is not None
    with Region(pid) as region:
        index = region_device(region, device)
        # Checked here only against a size the process knows: a device it has
        # not used yet, or one whose size its runtime could not tell (0), is
        # the process's to check, as it asks its runtime again.
        total_bytes = int(region.read_device_stats(index).device_total_bytes) if index in region.devices_in_use() else 0
        if total_bytes:
            _check_fraction_cap(value, total_bytes, index)
    _post(constants.NPUALLOC_CMD_SET_MEMORY_FRACTION, index, value, pid, timeout)
    return index


def set_per_process_memory_fraction(fraction: float, device: object = None, pid: int | None = None,
                                    timeout: float = COMMAND_TIMEOUT_S) -> None:
    """torch's set_per_process_memory_fraction: from now on the device's
    reserved memory grows only up to fraction of its memory (an allocation
    that would grow past it fails as an out of memory); what is reserved
    already stays, above the cap too; 1.0 takes the cap off. Per device, so
    it is not in get_config(): memory_stats()'s npualloc.reserved_limit_bytes
    shows it."""
    _set_memory_fraction(fraction, device, pid, timeout)


def get_per_process_memory_fraction(device: object = None, pid: int | None = None) -> float:
    """torch's get_per_process_memory_fraction: the device's cap on reserved
    memory over its memory, as torch computes it (the cap in bytes, the
    fraction times the device's bytes truncated, over the device's bytes),
    1.0 without a cap. A device npualloc has not set up yet (or whose size
    its runtime could not tell yet) reads the config's
    per_process_memory_fraction, which it takes when it is, as torch's
    devices take it at start."""
    if _in_process(pid):
        raw, _, _ = _raw_stats(device, pid)
        return _memory_fraction(raw, get_config())
    assert pid is not None
    with Region(pid) as region:
        raw = region.read_device_stats(region_device(region, device))
        try:
            return _memory_fraction(raw, region.header().config)
        except ValueError:
            raise CorruptRegionError(f"{region.path}: its per_process_memory_fraction (the device's cap, or the "
                                     "config's) is no number in [0, 1]") from None


# The config's per_process_memory_fraction, in the library's canonical text
# (npa_config_format): keys in a fixed order, only oom_snapshot's value (a
# path: any text) after it, so the key is looked for before that one.
_CONFIG_FRACTION = re.compile(r"(?:^|,)per_process_memory_fraction:([^,]*)")


def _memory_fraction(stats: Any, config: str) -> float:
    """get_per_process_memory_fraction of a device's npualloc_device_stats
    and the canonical config text; ValueError where either gives no number
    in [0, 1] (no library writes one: the cap is at most the device's bytes)."""
    total_bytes = int(stats.device_total_bytes)
    if stats.in_use and total_bytes > 0:
        limit_bytes = int(stats.reserved_limit_bytes)
        fraction = limit_bytes / total_bytes if limit_bytes else 1.0
    else:
        match = _CONFIG_FRACTION.search(re.split(r"(?:^|,)oom_snapshot:", config, maxsplit=1)[0])
        fraction = float(match.group(1)) if match else 1.0
    if not 0 <= fraction <= 1:
        raise ValueError(f"per_process_memory_fraction {fraction} is out of [0, 1]")
    return fraction


def _allocation_size(size: object) -> int:
    """size as torch's raw_alloc takes it: an int (anything with __index__,
    not a bool), in 0..2**63-1 (torch's ssize_t; a negative one wraps there
    to an out-of-memory error)."""
    if isinstance(size, bool) or not hasattr(type(size), "__index__"):
        raise TypeError(f"invalid type for size: {type(size).__name__}, must be an int")
    nbytes = operator.index(size)  # type: ignore[arg-type]
    if not 0 <= nbytes < 1 << 63:
        raise ValueError(f"invalid size {nbytes}: must be in 0..2**63-1")
    return nbytes


def _stream_handle(stream: object) -> int:
    """The aclrtStream handle as an int: None is the device's default
    stream (0), an int is the handle, a cffi pointer is converted."""
    if stream is None:
        return 0
    if isinstance(stream, ffi.CData) and ffi.typeof(stream).kind == "pointer":
        return int(ffi.cast("uintptr_t", stream))
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError("Invalid type for stream argument, must be an `int` or a cffi pointer holding an "
                        f"aclrtStream handle, not {type(stream).__name__}")
    if not 0 <= stream < 1 << 64:
        raise ValueError(f"invalid stream {stream}: not an aclrtStream handle")
    return stream


def caching_allocator_alloc(size: int, device: object = None, stream: object = None) -> int:
    """torch's caching_allocator_alloc: size bytes from npualloc's cache on
    device (None: this thread's current one), ordered on stream (None: the
    device's default stream; an aclrtStream as an int or a cffi pointer);
    returns the device address, 0 for size 0. Freed by
    caching_allocator_delete, on that stream. The thread's current device
    is the same afterwards."""
    nbytes = _allocation_size(size)
    handle = _stream_handle(stream)
    lib = _library()
    index = _own_device(lib, device)
    out = ffi.new("void **")
    ret = lib.npualloc_caching_allocator_alloc(out, nbytes, index, ffi.cast("void *", handle))
    if ret != 0:
        what = "out of memory" if ret == ACL_ERROR_RT_MEMORY_ALLOCATION else f"error {ret}"
        raise RuntimeError(f"caching_allocator_alloc({nbytes}) on device {index}, stream {handle:#x} failed: "
                           f"{what}")
    return int(ffi.cast("uintptr_t", out[0]))


def caching_allocator_delete(mem_ptr: int) -> None:
    """torch's caching_allocator_delete: frees a block caching_allocator_alloc
    returned (any live block of npualloc's), on the stream it was allocated
    on; 0 does nothing. A pointer that is no live block raises RuntimeError
    and frees nothing."""
    if isinstance(mem_ptr, bool) or not isinstance(mem_ptr, int):
        raise TypeError(f"invalid type for mem_ptr: {type(mem_ptr).__name__}, must be an int")
    lib = _library()
    ret = lib.npualloc_caching_allocator_delete(ffi.cast("void *", mem_ptr)) if 0 <= mem_ptr < 1 << 64 \
        else ACL_ERROR_RT_MEMORY_FREE
    if ret == ACL_ERROR_RT_MEMORY_FREE:
        raise RuntimeError(f"invalid device pointer: {mem_ptr:#x}")
    if ret != 0:
        raise RuntimeError(f"caching_allocator_delete({mem_ptr:#x}) failed: error {ret}")


def _runtime_mem_get_info(runtime: Any, device: object, free_bytes: Any, total_bytes: Any) -> tuple[int, int]:
    """(aclError, device index) of aclrtGetMemInfo on that device, the calling
    thread's current device left as it was (torch's device guard): as the
    library's npa_device_enter/leave, each aclrtSetDevice is paired with an
    aclrtResetDevice, so no device's reference count is left raised. A
    device past the runtime's count is refused first, as _own_device
    refuses it in a process under npualloc."""
    current = ffi.new("int32_t *")
    previous = current[0] if runtime.aclrtGetDevice(current) == 0 else -1
    index = device_index(device, current=max(previous, 0))
    count = ffi.new("uint32_t *")
    if runtime.aclrtGetDeviceCount(count) == 0:  # else aclrtSetDevice says what is wrong
        _check_device_count(device, index, int(count[0]))
    if index == previous:
        return runtime.aclrtGetMemInfo(ACL_HBM_MEM, free_bytes, total_bytes), index
    ret = runtime.aclrtSetDevice(index)
    if ret != 0:
        raise NpuallocError(f"aclrtSetDevice({index}) failed: error {ret}")
    try:
        return runtime.aclrtGetMemInfo(ACL_HBM_MEM, free_bytes, total_bytes), index
    finally:
        runtime.aclrtResetDevice(index)
        if previous >= 0 and runtime.aclrtSetDevice(previous) == 0:
            runtime.aclrtResetDevice(previous)


def list_gpu_processes(device: object = None) -> str:
    """torch's list_gpu_processes() in its format ("NPU" for "GPU"): each
    process under npualloc holding memory of the device (None: this thread's
    current one under npualloc, device 0 in a process without it, as every
    call here takes None), with its reserved bytes as its region reports them. Only
    npualloc's processes are seen, of this user (of every user for root), as
    `npualloc ls` lists them; one whose region cannot be read (stuck
    mid-update, another npualloc version's, damaged) is left out with a
    RuntimeWarning naming it, as ls skips it on stderr: it may hold memory
    of the device, and the printout alone would say no process is running."""
    index = device_index(device)

    def reserved(pid: int, region: Region) -> int | None:
        in_use = index in region.devices_in_use()
        return int(region.read_device_stats(index).reserved_bytes[0].current) if in_use else None

    def skipped(pid: int, error: NpuallocError) -> None:
        warnings.warn(f"npualloc: list_gpu_processes skips process {pid}: {error}", RuntimeWarning, stacklevel=4)

    lines = [f"NPU:{index}"]
    for pid, held in read_live_regions(reserved, skipped):
        if held is not None:
            lines.append(f"process {pid:>10d} uses {held / (1024 * 1024):>12.3f} MB NPU memory")
    if len(lines) == 1:
        lines.append("no processes are running")
    return "\n".join(lines)


def mem_get_info(device: object = None, pid: int | None = None) -> tuple[int, int]:
    """torch's mem_get_info: (free_bytes, total_bytes) of the device from
    aclrtGetMemInfo(ACL_HBM_MEM), through npualloc when it is loaded, else
    through the runtime directly; either way the current device stays what
    it was. With another pid, the pair that process last sampled, read from
    its region: it samples where device memory changes hands through it (a
    cache miss that grew its pool, an empty_cache, an OOM, memory_saver's
    allocations, frees and pauses), not at this call (only the process can
    ask its runtime), so memory other processes took since shows at its
    next sample. A device it has no sample of (never allocated on through
    its cache, or its runtime could not tell the size) raises NpuallocError."""
    if not _in_process(pid):
        assert pid is not None
        return _region_mem_get_info(pid, device)
    free_bytes = ffi.new("size_t *")
    total_bytes = ffi.new("size_t *")
    lib = loaded_library()
    if lib is not None:
        index = _own_device(lib, device)
        ret = lib.npualloc_mem_get_info(index, free_bytes, total_bytes)
    else:
        ret, index = _runtime_mem_get_info(runtime_library(), device, free_bytes, total_bytes)
    if ret != 0:
        raise NpuallocError(f"aclrtGetMemInfo(ACL_HBM_MEM) on device {index} failed: error {ret}")
    return int(free_bytes[0]), int(total_bytes[0])


def _region_mem_get_info(pid: int, device: object) -> tuple[int, int]:
    """mem_get_info(device, pid): device_free_bytes and device_total_bytes
    of the process's region."""
    with Region(pid) as region:
        index = region_device(region, device)
        stats = region.read_device_stats(index)
        free_bytes, total_bytes = int(stats.device_free_bytes), int(stats.device_total_bytes)
        if free_bytes < 0 or total_bytes < 0:  # size_t figures the process stored as int64
            raise CorruptRegionError(f"{region.path}: device {index}'s memory figures are negative "
                                     f"({free_bytes} free of {total_bytes})")
    if total_bytes == 0:
        raise NpuallocError(f"process {pid} has no figure of device {index}'s memory: it has not allocated on "
                            "it through npualloc's cache, or its runtime could not tell the device's size")
    return free_bytes, total_bytes


def is_active() -> bool:
    """True when this process's runtime calls are served by npualloc."""
    lib = loaded_library()
    return lib is not None and lib.npualloc_is_active() == 1


def library_path() -> str:
    """The libnpualloc.so shipped in this package (what LD_PRELOAD should name)."""
    path = PACKAGE_DIR / "lib" / "libnpualloc.so"
    if not path.is_file():
        raise NpuallocError(f"{path} is missing: build it with `make lib` (or reinstall npualloc)")
    return str(path)


def get_config(pid: int | None = None) -> str:
    """The config in force, canonical "key:value,..." text."""
    if not _in_process(pid):
        assert pid is not None
        with Region(pid) as region:
            return region.header().config
    lib = _library()
    size = 1024
    while True:
        buf = ffi.new("char[]", size)
        length = lib.npualloc_get_config(buf, size)
        if length < size:
            return str(ffi.string(buf).decode(errors="replace"))  # as the region reader: a path may be any bytes
        size = length + 1


def set_config(config: str) -> None:
    """Applies the run-time keys of an npualloc/torch config string in this
    process (garbage_collection_threshold, record_history, record_stacks,
    record_context, expandable_segments: how pools grow from now on, as torch's
    _set_allocator_settings); for another process use set_gc_threshold(..., pid=...)."""
    rejected = _library().npualloc_set_config(c_string(config, "the config string"))
    if rejected:
        raise ValueError(f"npualloc rejected {rejected} key(s) of {config!r} (warned on stderr)")
