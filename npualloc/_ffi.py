"""cffi (ABI mode) view of npualloc's C headers, read from the headers themselves.

The declarations between the `cffi:begin` / `cffi:end` markers of
npualloc_shm.h (the region layout), npualloc_reader.h (reading other processes'
regions) and npualloc.h (the in-process C API) are the one source of truth:
nothing here restates a struct. Headers are looked up in
npualloc/include/ (where `make lib` puts them, shipped as package data) and then
in interpose/include/ of a source checkout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import cffi

from .errors import NpuallocError

PACKAGE_DIR = Path(__file__).resolve().parent
_HEADER_DIRS = (PACKAGE_DIR / "include", PACKAGE_DIR.parent / "interpose" / "include")
_CFFI_SECTION = re.compile(r"/\*\s*cffi:begin\s*\*/(.*?)/\*\s*cffi:end\s*\*/", re.S)

# The runtime calls mem_get_info needs when npualloc is not loaded (acl_rt.h).
_RUNTIME_CDEF = """
int aclInit(const char *configPath);
int aclrtSetDevice(int32_t deviceId);
int aclrtResetDevice(int32_t deviceId);
int aclrtGetDevice(int32_t *deviceId);
int aclrtGetDeviceCount(uint32_t *count);
int aclrtGetMemInfo(int attr, size_t *free, size_t *total);
"""
ACL_HBM_MEM = 1
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_MEMORY_FREE = 207002


def _cffi_section(name: str, required: bool) -> str:
    for directory in _HEADER_DIRS:
        path = directory / name
        if path.is_file():
            match = _CFFI_SECTION.search(path.read_text())
            if match is None:
                raise NpuallocError(f"{path} has no cffi:begin/cffi:end section")
            return match.group(1)
    if required:
        raise NpuallocError(f"{name} not found in {' or '.join(map(str, _HEADER_DIRS))}: run `make lib`")
    return ""


ffi = cffi.FFI()
ffi.cdef(_cffi_section("npualloc_shm.h", required=True))
# How other processes' regions are read and commanded (libnpualloc_reader.so).
ffi.cdef(_cffi_section("npualloc_reader.h", required=True))
# npualloc.h only declares functions; without it the in-process API is missing
# but reading regions of other processes still works.
_API_CDEF = _cffi_section("npualloc.h", required=False)
if _API_CDEF:
    ffi.cdef(_API_CDEF)
ffi.cdef(_RUNTIME_CDEF)

# #define'd integers of the headers (NPUALLOC_SHM_MAGIC, NPUALLOC_CMD_*, ...):
# ABI mode exposes them on any library handle.
constants: Any = ffi.dlopen(None)

REGION_SIZE: int = ffi.sizeof("npualloc_region")


def c_string(text: str, what: str) -> bytes:
    """text as the bytes a C call reads up to their NUL. A str holding a NUL
    would be cut short there, the rest dropped unseen (a config string's
    later keys, the end that tells two memory_saver tags apart): refused, as
    os functions refuse an embedded null byte."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a str, not {type(text).__name__}")
    if "\0" in text:
        raise ValueError(f"{what} {text!r} holds a NUL character")
    return text.encode()

_reader: list[Any] = []


def reader_library() -> Any:
    """This package's libnpualloc_reader.so: reads and commands the regions of
    other processes with the memory ordering their writers expect (C11
    atomics; Python has no load fence for aarch64)."""
    if not _reader:
        path = PACKAGE_DIR / "lib" / "libnpualloc_reader.so"
        try:
            _reader.append(ffi.dlopen(str(path)))
        except OSError as e:
            raise NpuallocError(f"cannot load {path} ({e}): build it with `make lib` (or reinstall npualloc)") from None
    return _reader[0]


def _mapped_library() -> str | None:
    """Path of the libnpualloc.so mapped into this process, if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and os.path.basename(path) == "libnpualloc.so":
                    return path
    except OSError:
        return None
    return None


_loaded: dict[int, Any] = {}


def loaded_library() -> Any | None:
    """The npualloc library already loaded in this process (preloaded), or None.
    RTLD_NOLOAD: finding it must never load it."""
    pid = os.getpid()
    if pid not in _loaded:
        path = _mapped_library()
        lib = None
        if path is not None and _API_CDEF:
            try:
                lib = ffi.dlopen(path, ffi.RTLD_NOW | ffi.RTLD_NOLOAD)
            except OSError:
                lib = None
        _loaded[pid] = lib
    return _loaded[pid]


_runtime: list[Any] = []


def runtime_library() -> Any:
    """The Ascend runtime (libascendcl.so), initialised, for calls made without
    npualloc: $NPUALLOC_ACL_LIB, then $ASCEND_HOME_PATH/lib64, then the soname."""
    if _runtime:
        return _runtime[0]
    candidates = [os.environ.get("NPUALLOC_ACL_LIB", "")]
    if os.environ.get("ASCEND_HOME_PATH"):
        candidates.append(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libascendcl.so"))
    candidates.append("libascendcl.so")
    tried = []
    for candidate in filter(None, candidates):
        try:
            lib = ffi.dlopen(candidate)
        except OSError:
            tried.append(candidate)
            continue
        ret = lib.aclInit(ffi.NULL)
        if ret not in (0, ACL_ERROR_REPEAT_INITIALIZE):
            raise NpuallocError(f"aclInit failed in {candidate}: error {ret}")
        _runtime.append(lib)
        return lib
    raise NpuallocError(f"no Ascend runtime found (tried {', '.join(tried)}): "
                        "set NPUALLOC_ACL_LIB or ASCEND_HOME_PATH")
