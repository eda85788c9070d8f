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

import os
import sys
from types import ModuleType
from typing import Any

from . import memory
from ._ffi import ffi, loaded_library
from .conf_env import configured
from .errors import NotUnderNpuallocError

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
    stream ordering in one place, through npualloc's stream-aware entry
    (npualloc.h: npualloc_malloc_stream_addr and npualloc_free_stream_addr,
    the integer forms, which spare cffi a pointer object per argument, and
    npualloc_record_stream), as in torch: a tensor freed on the stream it was
    allocated on is reusable at once for that stream (whatever that stream
    runs next runs after the work that used it), never for another; a tensor
    MindTorch records on other streams (Tensor.record_stream) waits, once
    freed, for one event on each of them. Streams are MindTorch's pyACL
    handles (ints).

    One difference from torch's contract: MindTorch fills new tensors with
    synchronous acl.rt.memcpy (host to device, device to device), which runs
    at once, ahead of anything still queued on the stream. A block handed out
    again while work queued before its free still reads it would be
    overwritten under that work (tests/test_mindtorch_train.py saw the losses
    drift). So its blocks are allocated NPUALLOC_STREAM_HOST_WRITES: a free
    waits for one event on its own stream too, batched per stream, never a
    synchronize and never a raw device call."""

    def __init__(self, device_id: int) -> None:
        from mindtorch_v2._backends.npu import runtime as npu_runtime
        from mindtorch_v2._backends.npu import state as npu_state
        self._npu_runtime = npu_runtime
        self._npu_state = npu_state
        self._device_id = device_id
        lib = loaded_library()
        if lib is None:
            raise NotUnderNpuallocError("npualloc is not loaded in this process")
        self._lib = lib

    def current_stream(self) -> int:
        """The stream MindTorch's own allocator orders a call on when it is given none."""
        return int(self._npu_state.current_stream(self._device_id).stream)

    def malloc(self, size: int, stream: int) -> int:
        # npualloc allocates on the calling thread's current device. MindTorch
        # makes its device current with runtime.activate() (SetDevice and
        # SetCurrentContext, both seen by npualloc); npualloc's record of the
        # thread's device says whether that is needed, and asking it costs a
        # sixth of activate(), which this would otherwise pay on every tensor.
        if self._lib.npualloc_current_device() != self._device_id:
            self._npu_runtime.get_runtime(self._device_id)   # activates it
        ptr = self._lib.npualloc_malloc_stream_addr(size, stream, self._lib.NPUALLOC_STREAM_HOST_WRITES)
        if ptr == 0:
            raise RuntimeError(f"npualloc_malloc_stream({size}) failed: {self._lib.npualloc_malloc_stream_error()}")
        return ptr

    def free(self, ptr: int, stream: int) -> None:
        ret = self._lib.npualloc_free_stream_addr(ptr, stream)
        # After aclFinalize (interpreter exit) the runtime refuses: nothing is left to give back to.
        if ret != 0 and not sys.is_finalizing():
            raise RuntimeError(f"npualloc_free_stream({ptr:#x}) failed: {ret}")

    def record_stream(self, ptr: int, stream: int) -> None:
        ret = self._lib.npualloc_record_stream(ffi.cast("void *", ptr), ffi.cast("void *", stream))
        if ret != 0:
            raise RuntimeError(f"npualloc_record_stream({ptr:#x}) failed: {ret}")

    def synchronize(self) -> None:
        self._npu_runtime.get_runtime(self._device_id).activate()
        ret = self._npu_runtime.acl.rt.synchronize_device()
        if ret != 0:
            raise RuntimeError(f"acl.rt.synchronize_device failed: {ret}")


class PassThroughAllocator:
    """MindTorch's NpuAllocator interface over npualloc."""

    def __init__(self, device_id: int) -> None:
        self.device_id = int(device_id)
        self._runtime = _Runtime(self.device_id)
        self._live: dict[int, int] = {}   # pointer -> the stream it was allocated on

    def malloc(self, size: int, stream: int | None = None) -> int:
        on = self._runtime.current_stream() if stream is None else int(stream)
        ptr = self._runtime.malloc(int(size), on)
        self._live[ptr] = on
        return ptr

    def free(self, ptr: int, stream: int | None = None) -> None:
        ptr = int(ptr)
        own = self._live.pop(ptr, None)
        if own is None:  # as NpuAllocator: a pointer it does not own is ignored
            return
        # As NpuAllocator: no stream means the one it was allocated on.
        self._runtime.free(ptr, own if stream is None else int(stream))

    def record_stream(self, ptr: int, stream: int) -> None:
        if int(ptr) in self._live:
            self._runtime.record_stream(int(ptr), int(stream))

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


def _expandable_by_default() -> None:
    """Expandable segments for a MindTorch program whose user configured no
    allocator: its tensors' sizes vary from step to step, and with plain
    segments the resnet trace peaks at 1.48x the bytes it requests, 1.20x
    with expandable segments (README, MindTorch bench), which also make the
    program pausable. npualloc's own default stays torch's (False); any
    config variable set, even to npualloc's defaults, is the user's choice
    and is left alone (one set empty is unset, to MindTorch and the library
    alike). A runtime without the virtual memory API refuses the key (the
    library warns once) and the program runs on plain segments."""
    if configured(os.environ):
        return
    try:
        memory.set_config("expandable_segments:True")
    except ValueError:
        pass


def install(module: ModuleType) -> bool:
    """Replaces get_allocator in MindTorch's allocator module (just executed)
    with one handing out PassThroughAllocators, after switching expandable
    segments on when the user configured no allocator; returns whether it
    did. An interface other than the one expected, or npualloc not serving
    this process's calls, leaves MindTorch alone (the former with one warning)."""
    if not memory.is_active():
        return False
    problem = _interface_problem(module)
    if problem is not None:
        _warn_once(f"MindTorch's allocator ({ALLOCATOR_MODULE}) is not the one expected ({problem}); "
                   "leaving it in place, so its tensors are cached by MindTorch, not npualloc")
        return False
    _expandable_by_default()
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
