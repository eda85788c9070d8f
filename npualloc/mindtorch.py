"""MindTorch v2 under npualloc: its per-device caching allocator replaced by a
thin pass-through, so every tensor of an unmodified MindTorch program is
allocated and freed by npualloc, and `mindtorch_v2.npu.memory_stats()` and
friends report npualloc's figures.

MindTorch keeps its own Python caching allocator (NpuAllocator in
mindtorch_v2/_backends/npu/allocator.py), one per device through
get_allocator(device_id); every call site goes through that module attribute.
Under LD_PRELOAD npualloc would only see that allocator's segment mallocs,
never a tensor free. The startup hook (_npualloc_startup, run from the
npualloc-mindtorch.pth file) calls install() right after the allocator module
is executed and before anything can use it.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from . import memory

ALLOCATOR_MODULE = "mindtorch_v2._backends.npu.allocator"

# What MindTorch calls on an allocator (read from every call site of
# get_allocator in the pinned copy), and what the module must offer.
_METHODS = ("malloc", "free", "synchronize", "record_stream", "empty_cache", "memory_stats",
            "reset_peak_memory_stats", "reset_accumulated_memory_stats")
_MODULE_NAMES = ("get_allocator", "NpuAllocator", "_ALLOCATORS")

# MindTorch's names for counts are torch's older ones ("allocated.*" for
# "allocation.*"); both are given so its readers find theirs.
_STAT_ALIASES = (("allocation.", "allocated."),)

_warned: list[str] = []


def _warn_once(message: str) -> None:
    if not _warned:
        _warned.append(message)
        sys.stderr.write(f"npualloc: {message}\n")


class _Runtime:
    """The seam between the pass-through and the device: allocation, free and
    stream ordering in one place. Today through pyACL, so through the
    preloaded aclrtMalloc/aclrtFree; record_stream relies on npualloc's
    reuse_policy (`safe`, what `auto` becomes once MindTorch creates its
    streams: a freed block is reused only after events recorded on every live
    stream after the free have completed, which covers any stream the block
    was used on). A stream-aware npualloc entry point replaces these three
    methods and nothing else."""

    def __init__(self, device_id: int) -> None:
        from mindtorch_v2._backends.npu import runtime as npu_runtime
        self._npu_runtime = npu_runtime
        self._device_id = device_id

    def _activate(self) -> Any:
        runtime = self._npu_runtime.get_runtime(self._device_id)
        runtime.activate()
        return self._npu_runtime.acl

    def malloc(self, size: int, stream: object) -> int:
        del stream  # npualloc's pools are per device; ordering is reuse_policy's
        acl = self._activate()
        ptr, ret = acl.rt.malloc(size, self._npu_runtime.ACL_MEM_MALLOC_HUGE_FIRST)
        if ret != 0:
            raise RuntimeError(f"acl.rt.malloc({size}) failed: {ret}")
        return int(ptr)

    def free(self, ptr: int, stream: object) -> None:
        del stream
        acl = self._npu_runtime.acl
        if acl is None:  # the runtime is gone (interpreter exit): nothing to give back to
            return
        ret = acl.rt.free(ptr)
        if ret != 0 and not sys.is_finalizing():
            raise RuntimeError(f"acl.rt.free({ptr:#x}) failed: {ret}")

    def record_stream(self, ptr: int, stream: object) -> None:
        del ptr, stream  # covered by the safe reuse policy's fences (see the class comment)

    def synchronize(self) -> None:
        acl = self._activate()
        ret = acl.rt.synchronize_device()
        if ret != 0:
            raise RuntimeError(f"acl.rt.synchronize_device failed: {ret}")


class PassThroughAllocator:
    """MindTorch's NpuAllocator interface over npualloc."""

    def __init__(self, device_id: int) -> None:
        self.device_id = int(device_id)
        self._runtime = _Runtime(self.device_id)
        self._live: set[int] = set()

    def malloc(self, size: int, stream: object = None) -> int:
        ptr = self._runtime.malloc(int(size), stream)
        self._live.add(ptr)
        return ptr

    def free(self, ptr: int, stream: object = None) -> None:
        ptr = int(ptr)
        if ptr not in self._live:  # as NpuAllocator: a pointer it does not own is ignored
            return
        self._live.discard(ptr)
        self._runtime.free(ptr, stream)

    def record_stream(self, ptr: int, stream: object) -> None:
        if int(ptr) in self._live:
            self._runtime.record_stream(int(ptr), stream)

    def synchronize(self) -> None:
        self._runtime.synchronize()

    def empty_cache(self) -> None:
        memory.empty_cache()

    def memory_stats(self) -> dict[str, Any]:
        stats = memory.memory_stats(self.device_id)
        for ours, theirs in _STAT_ALIASES:
            stats.update({theirs + key[len(ours):]: value for key, value in list(stats.items())
                          if key.startswith(ours)})
        return stats

    def reset_peak_memory_stats(self) -> None:
        memory.reset_peak_memory_stats(self.device_id)

    def reset_accumulated_memory_stats(self) -> None:
        memory.reset_accumulated_memory_stats(self.device_id)


def _interface_problem(module: ModuleType) -> str | None:
    missing = [name for name in _MODULE_NAMES if not hasattr(module, name)]
    if missing:
        return f"no {', '.join(missing)}"
    missing = [name for name in _METHODS if not callable(getattr(module.NpuAllocator, name, None))]
    if missing:
        return f"NpuAllocator has no {', '.join(missing)}"
    if not isinstance(module._ALLOCATORS, dict):
        return "_ALLOCATORS is not a dict"
    if module._ALLOCATORS:
        return "its allocators are already in use"
    return None


def install(module: ModuleType) -> bool:
    """Replaces get_allocator in MindTorch's allocator module (just executed)
    with one handing out PassThroughAllocators; returns whether it did. An
    interface other than the one expected, or npualloc not serving this
    process's calls, leaves MindTorch alone (the former with one warning)."""
    if not memory.is_active():
        return False
    problem = _interface_problem(module)
    if problem is not None:
        _warn_once(f"MindTorch's allocator ({ALLOCATOR_MODULE}) is not the one expected ({problem}); "
                   "leaving it in place, so its tensors are cached by MindTorch, not npualloc")
        return False
    allocators: dict[int, PassThroughAllocator] = {}

    def get_allocator(device_id: int = 0) -> PassThroughAllocator:
        device_id = int(device_id)
        alloc = allocators.get(device_id)
        if alloc is None:
            alloc = allocators[device_id] = PassThroughAllocator(device_id)
        return alloc

    module.get_allocator = get_allocator
    module._ALLOCATORS = allocators
    return True
