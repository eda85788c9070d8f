"""ctypes wrapper of the simulated CANN runtime's sim-only API (libaclsim.so)
and of its simulated aclnn ops (libopapi.so, libnnopbase.so), for tests.

The libraries are found in $ASCEND_HOME_PATH/lib64 when that is set (as
conftest.sim_env() does), else through the normal library search path. Loading
them here shares the one runtime state of the process with `import acl` and
anything else that loaded the simulated libascendcl.so.
"""
from __future__ import annotations

import ctypes
import os

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


def _load(name: str) -> ctypes.CDLL:
    home = os.environ.get("ASCEND_HOME_PATH")
    path = os.path.join(home, "lib64", name) if home else name
    return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def _bind(lib: ctypes.CDLL, name: str, restype, *argtypes):
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_sim = _load("libaclsim.so")
_call_count = _bind(_sim, "aclsim_call_count", _u64, ctypes.c_char_p)
reset_counters = _bind(_sim, "aclsim_reset_counters", None)
_bytes_outstanding = _bind(_sim, "aclsim_bytes_outstanding", _u64, ctypes.c_int32)
_live_allocations = _bind(_sim, "aclsim_live_allocations", _u64, ctypes.c_int32)
_physical_bytes = _bind(_sim, "aclsim_physical_bytes_outstanding", _u64, ctypes.c_int32)
_allocation_info = _bind(_sim, "aclsim_allocation_info", ctypes.c_int, _vp, ctypes.POINTER(_u64),
                         ctypes.POINTER(_u64))
invalid_accesses = _bind(_sim, "aclsim_invalid_accesses", _u64)
workspace_clobbers = _bind(_sim, "aclsim_workspace_clobbers", _u64)
executors_live = _bind(_sim, "aclsim_executors_live", _u64)
executors_destroyed = _bind(_sim, "aclsim_executors_destroyed", _u64)
executor_violations = _bind(_sim, "aclsim_executor_violations", _u64)
set_op_duration_us = _bind(_sim, "aclsim_set_op_duration_us", None, _u64)
op_duration_us = _bind(_sim, "aclsim_op_duration_us", _u64)
thread_latency_us = _bind(_sim, "aclsim_thread_latency_us", _u64)
op_time_us = _bind(_sim, "aclsim_op_time_us", _u64)
fail_next_mallocs = _bind(_sim, "aclsim_fail_next_mallocs", None, ctypes.c_uint32)
injected_failures = _bind(_sim, "aclsim_injected_failures", _u64)
_fail_release = _bind(_sim, "aclsim_fail_release", ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32)
_fail_next_calls = _bind(_sim, "aclsim_fail_next_calls", ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int32)


def fail_next_calls(api: str, n: int, error: int) -> None:
    """The next n calls of api fail with error (n=0: none); see aclsim.h."""
    if _fail_next_calls(api.encode(), n, error) != 0:
        raise KeyError(f"aclsim cannot fail {api!r} with {error}")

_NO_SUCH = 2**64 - 1


def fail_release(api: str, n: int = 1, skip: int = 0) -> None:
    """After skip successful calls of api ("aclrtUnmapMem" or
    "aclrtFreePhysical"), the next n fail with 207002, changing nothing."""
    if _fail_release(api.encode(), skip, n) != 0:
        raise KeyError(f"the sim injects no release failure into {api!r}")


def call_count(api: str) -> int:
    """Calls of a public API (e.g. "aclrtMalloc") that reached the sim."""
    n = _call_count(api.encode())
    if n == _NO_SUCH:
        raise KeyError(f"the sim does not count {api!r}")
    return n


def device_malloc_count() -> int:
    """Plain device allocations that reached the sim: aclrtMalloc (a program's
    own) and aclrtMallocAlign32 (torch_npu's, and npualloc's segments)."""
    return call_count("aclrtMalloc") + call_count("aclrtMallocAlign32")


def _per_device(fn, device: int) -> int:
    n = fn(device)
    if n == _NO_SUCH:
        raise ValueError(f"no device {device}")
    return n


def bytes_outstanding(device: int = 0) -> int:
    """Accounted bytes of live aclrtMalloc-family allocations on a device."""
    return _per_device(_bytes_outstanding, device)


def live_allocations(device: int = 0) -> int:
    return _per_device(_live_allocations, device)


def physical_bytes_outstanding(device: int = 0) -> int:
    return _per_device(_physical_bytes, device)


def allocation_info(ptr: int) -> tuple[int, int] | None:
    """(requested, accounted) bytes of the live allocation starting at ptr, else None."""
    requested, accounted = _u64(), _u64()
    if not _allocation_info(ptr, ctypes.byref(requested), ctypes.byref(accounted)):
        return None
    return requested.value, accounted.value


class Ops:
    """The simulated two-phase aclnn ops and the nnopbase executor calls.
    Executors and pointers are ints; every call returns the aclnnStatus last."""

    WORKSPACE_BYTES = 1024  # ACLSIM_OP_WORKSPACE_BYTES

    def __init__(self) -> None:
        opapi, nnopbase = _load("libopapi.so"), _load("libnnopbase.so")
        out = [ctypes.POINTER(_u64), ctypes.POINTER(_vp)]
        self._fill_ws = _bind(opapi, "aclnnSimFillGetWorkspaceSize", ctypes.c_int32, _vp, _u64, ctypes.c_int32, *out)
        self._copy_ws = _bind(opapi, "aclnnSimCopyGetWorkspaceSize", ctypes.c_int32, _vp, _vp, _u64, *out)
        launch = (ctypes.c_int32, _vp, _u64, _vp, _vp)
        self._fill = _bind(opapi, "aclnnSimFill", *launch)
        self._copy = _bind(opapi, "aclnnSimCopy", *launch)
        self._repeatable = _bind(nnopbase, "aclSetAclOpExecutorRepeatable", ctypes.c_int32, _vp)
        self._destroy = _bind(nnopbase, "aclDestroyAclOpExecutor", ctypes.c_int32, _vp)

    @staticmethod
    def _phase1(fn, *args) -> tuple[int, int, int]:
        ws, executor = _u64(), _vp()
        status = fn(*args, ctypes.byref(ws), ctypes.byref(executor))
        return ws.value, executor.value or 0, status

    def fill_get_workspace_size(self, dst: int, nbytes: int, value: int) -> tuple[int, int, int]:
        """(workspace_size, executor, status)"""
        return self._phase1(self._fill_ws, dst, nbytes, value)

    def copy_get_workspace_size(self, dst: int, src: int, nbytes: int) -> tuple[int, int, int]:
        """(workspace_size, executor, status)"""
        return self._phase1(self._copy_ws, dst, src, nbytes)

    def fill(self, workspace: int, workspace_size: int, executor: int, stream: int = 0) -> int:
        return self._fill(workspace, workspace_size, executor, stream)

    def copy(self, workspace: int, workspace_size: int, executor: int, stream: int = 0) -> int:
        return self._copy(workspace, workspace_size, executor, stream)

    def set_repeatable(self, executor: int) -> int:
        return self._repeatable(executor)

    def destroy_executor(self, executor: int) -> int:
        return self._destroy(executor)


# Signatures of the runtime's C API, for calls pyACL cannot express (NULL
# out-pointers, the VMM API). Every function returns aclError (int).
_P = ctypes.POINTER
_RUNTIME_ARGTYPES = {
    "aclInit": [ctypes.c_char_p],
    "aclFinalize": [],
    "aclrtSetDevice": [ctypes.c_int32],
    "aclrtGetDevice": [_P(ctypes.c_int32)],
    "aclrtResetDevice": [ctypes.c_int32],
    "aclrtGetDeviceCount": [_P(ctypes.c_uint32)],
    "aclrtSynchronizeDevice": [],
    "aclrtMalloc": [_P(_vp), ctypes.c_size_t, ctypes.c_int],
    "aclrtMallocAlign32": [_P(_vp), ctypes.c_size_t, ctypes.c_int],
    "aclrtMallocCached": [_P(_vp), ctypes.c_size_t, ctypes.c_int],
    "aclrtFree": [_vp],
    "aclrtFreeWithDevSync": [_vp],
    "aclrtMemset": [_vp, ctypes.c_size_t, ctypes.c_int32, ctypes.c_size_t],
    "aclrtMemcpy": [_vp, ctypes.c_size_t, _vp, ctypes.c_size_t, ctypes.c_int],
    "aclrtGetMemInfo": [ctypes.c_int, _P(ctypes.c_size_t), _P(ctypes.c_size_t)],
    "aclrtReserveMemAddress": [_P(_vp), ctypes.c_size_t, ctypes.c_size_t, _vp, _u64],
    "aclrtReleaseMemAddress": [_vp],
    "aclrtMallocPhysical": [_P(_vp), ctypes.c_size_t, _vp, _u64],
    "aclrtFreePhysical": [_vp],
    "aclrtMapMem": [_vp, ctypes.c_size_t, ctypes.c_size_t, _vp, _u64],
    "aclrtUnmapMem": [_vp],
    "aclrtMemGetAllocationGranularity": [_vp, ctypes.c_int, _P(ctypes.c_size_t)],
}


class PhysicalMemProp(ctypes.Structure):
    """aclrtPhysicalMemProp"""
    _fields_ = [("handleType", ctypes.c_int), ("allocationType", ctypes.c_int), ("memAttr", ctypes.c_int),
                ("location_id", ctypes.c_uint32), ("location_type", ctypes.c_int), ("reserve", _u64)]

    @classmethod
    def device(cls, device_id: int = 0) -> "PhysicalMemProp":
        return cls(0, 0, 1, device_id, 1, 0)  # pinned HBM on ACL_MEM_LOCATION_TYPE_DEVICE


def runtime(library: str = "libascendcl.so") -> ctypes.CDLL:
    """The simulated runtime library (libascendcl.so or libacl_rt.so) with the
    argument types of its C API set. Functions are looked up on the library
    handle (dlsym), so an LD_PRELOADed interposer does not intercept them:
    use the `acl` module to go through the dynamic linker."""
    lib = _load(library)
    for name, argtypes in _RUNTIME_ARGTYPES.items():
        _bind(lib, name, ctypes.c_int, *argtypes)
    return lib
