"""npualloc: the Python side of the caching allocator for Ascend NPUs.

Mirrors torch.cuda.memory. Inside a process started with npualloc preloaded the
calls go to the loaded library; with pid=... they read (or command) another
process through its shared-memory stats region.
"""
from .errors import (CommandInterruptedError, CommandRejectedError, CommandTimeoutError, CorruptRegionError,
                     IncompatibleRegionError, InvalidDeviceError, NoSuchProcessError, NotUnderNpuallocError,
                     NpuallocError, OtherUserError, ProcessStoppedError)
from .memory import (caching_allocator_alloc, caching_allocator_delete, empty_cache, get_config,
                     get_per_process_memory_fraction, is_active,
                     library_path, list_gpu_processes, max_memory_allocated, max_memory_cached, max_memory_reserved,
                     mem_get_info, memory_allocated, memory_cached, memory_reserved, memory_stats,
                     memory_stats_as_nested_dict, memory_summary, reset_accumulated_memory_stats,
                     reset_max_memory_allocated, reset_max_memory_cached, reset_peak_memory_stats, set_config,
                     set_gc_threshold, set_per_process_memory_fraction)
from .snapshot import dump_snapshot, memory_snapshot, record_memory_history
from .snapshot import torch_dump_snapshot as _dump_snapshot
from .snapshot import torch_record_memory_history as _record_memory_history
from .snapshot import torch_snapshot as _snapshot

# _snapshot, _dump_snapshot, _record_memory_history: torch.cuda.memory's own
# (private) names with torch's arguments, so code written for torch runs unchanged.

__all__ = [
    "CommandInterruptedError", "CommandRejectedError", "CommandTimeoutError", "CorruptRegionError", "IncompatibleRegionError",
    "InvalidDeviceError", "NoSuchProcessError", "NotUnderNpuallocError", "NpuallocError", "OtherUserError",
    "ProcessStoppedError",
    "caching_allocator_alloc", "caching_allocator_delete", "dump_snapshot", "empty_cache", "get_config",
    "get_per_process_memory_fraction", "is_active", "library_path", "list_gpu_processes",
    "max_memory_allocated", "max_memory_cached", "max_memory_reserved", "mem_get_info", "memory_allocated",
    "memory_cached", "memory_reserved", "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict",
    "memory_summary", "record_memory_history", "reset_accumulated_memory_stats", "reset_max_memory_allocated",
    "reset_max_memory_cached", "reset_peak_memory_stats", "set_config", "set_gc_threshold",
    "set_per_process_memory_fraction",
]
