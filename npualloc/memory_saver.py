"""torch_memory_saver's API on Ascend: pause and resume device memory.

Allocations made inside ``region(tag)`` get device addresses of their own;
``pause(tag)`` gives their physical memory back to the device (any process can
use it, the addresses stay reserved) and ``resume(tag)`` maps new memory at the
same addresses, with the contents restored when the region asked for a CPU
backup. Needs npualloc preloaded (``npualloc run -- ...``).

    from npualloc import memory_saver
    with memory_saver.region("kv_cache", enable_cpu_backup=True):
        kv = allocate()                 # any aclrtMalloc on this thread
    memory_saver.pause("kv_cache")      # its device memory is free now
    memory_saver.resume("kv_cache")     # same addresses, same contents
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ._ffi import c_string, ffi
from .errors import NpuallocError
from .memory import _library

_WHY_LEN = 512
# The regions this thread is inside, innermost last: (tag or None, backup).
_state = threading.local()


def _stack() -> list[tuple[str | None, bool]]:
    if not hasattr(_state, "regions"):
        _state.regions = []
    return _state.regions


def _c_tag(tag: str | None) -> Any:
    return ffi.NULL if tag is None else c_string(tag, "memory_saver: tag")


def _enter(tag: str | None, enable_cpu_backup: bool) -> None:
    name = _c_tag(tag)
    if _library().npualloc_saver_region(name, int(enable_cpu_backup)) != 0:
        raise NpuallocError(f"memory_saver: tag {tag!r} refused (a tag is at most 63 bytes)")
    _stack().append((tag, enable_cpu_backup))


def _leave() -> None:
    stack = _stack()
    stack.pop()
    tag, backup = stack[-1] if stack else (None, False)
    _library().npualloc_saver_region(_c_tag(tag), int(backup))


@contextmanager
def region(tag: str = "default", enable_cpu_backup: bool = False) -> Iterator[None]:
    """Allocations this thread makes inside are pausable and carry tag."""
    _enter(tag, enable_cpu_backup)
    try:
        yield
    finally:
        _leave()


@contextmanager
def disable() -> Iterator[None]:
    """Allocations this thread makes inside are ordinary (cached, never paused)."""
    _enter(None, False)
    try:
        yield
    finally:
        _leave()


def _call(fn: Any, action: str, tag: str | None) -> None:
    why = ffi.new("char[]", _WHY_LEN)
    ret = fn(_c_tag(tag), why, _WHY_LEN)
    if ret != 0:
        what = "every tag" if tag is None else f"tag {tag!r}"
        raise NpuallocError(f"memory_saver: {action} of {what} failed (error {ret}): {ffi.string(why).decode()}")


def pause(tag: str | None = None) -> None:
    """Synchronizes, backs up (where asked) and releases the device memory of
    tag's allocations (None: every tag); their addresses stay reserved. A
    failure leaves everything mapped, contents intact."""
    _call(_library().npualloc_saver_pause, "pause", tag)


def resume(tag: str | None = None) -> None:
    """Maps new device memory at the paused addresses and restores the
    backups. When the device has no room (another process holds it) this
    raises and what is still paused keeps its backup: call it again later."""
    _call(_library().npualloc_saver_resume, "resume", tag)


def bytes_of(tag: str | None = None) -> dict[str, int]:
    """{"allocated", "paused", "backup"}: bytes of tag's pausable allocations
    (None: every tag), of those paused, and of host backups held."""
    out = ffi.new("size_t[3]")
    _library().npualloc_saver_bytes(_c_tag(tag), out, out + 1, out + 2)
    return {"allocated": out[0], "paused": out[1], "backup": out[2]}
