"""The pyACL-compatible `acl` module: pyACL's calling conventions, and that
its calls reach the runtime through the dynamic linker, so an LD_PRELOADed
aclrtMalloc wins exactly as with the real pyACL."""
from __future__ import annotations

import pytest

from conftest import compile_shim, run_python, sim_env

CONVENTIONS = """
import acl, acl.rt, acl.util
assert acl.init() == 0
count, ret = acl.rt.get_device_count(); assert (count, ret) == (8, 0)
assert acl.rt.set_device(0) == 0
assert acl.rt.get_device() == (0, 0)
for fn in (acl.rt.malloc, acl.rt.malloc_cached, acl.rt.malloc_align32):
    ptr, ret = fn(1000, 0)
    assert type(ptr) is int and ptr > 0 and ret == 0
    assert acl.rt.free(ptr) == 0
free, total, ret = acl.rt.get_mem_info(1)
assert (type(free), type(total), ret) == (int, int, 0) and free == total == 64 << 30
stream, ret = acl.rt.create_stream(); assert type(stream) is int and stream and ret == 0
event, ret = acl.rt.create_event(); assert type(event) is int and event and ret == 0
ptr, _ = acl.rt.malloc(16, 0)
data = b"0123456789abcdef"
assert acl.rt.memcpy_async(ptr, 16, acl.util.bytes_to_ptr(data), 16, 1, stream) == 0
assert acl.rt.memset_async(ptr, 16, ord("z"), 4, stream) == 0
assert acl.rt.record_event(event, stream) == 0
assert acl.rt.synchronize_event(event) == 0
assert acl.rt.query_event_status(event) == (1, 0)
out = bytearray(16)
assert acl.rt.memcpy(acl.util.bytes_to_ptr(out), 16, ptr, 16, 2) == 0
assert bytes(out) == b"zzzz456789abcdef"
assert acl.util.ptr_to_bytes(ptr, 16) == b"zzzz456789abcdef"   # device memory is host-readable
assert acl.rt.free(ptr) == 0
for call in (lambda: acl.rt.destroy_event(event), lambda: acl.rt.destroy_stream(stream),
             acl.rt.synchronize_device, lambda: acl.rt.reset_device(0), acl.finalize):
    assert call() == 0
"""


def test_pyacl_calling_conventions():
    run_python(CONVENTIONS, sim_env())


# A minimal interposer. Python imports `acl` with RTLD_LOCAL, so the runtime
# it pulls in is not in the global scope and RTLD_NEXT cannot see it; the probe
# then asks the already-loaded libascendcl.so directly.
PROBE_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
int probe_mallocs;
int aclrtMalloc(void **p, size_t size, int policy)
{
    void *next = dlsym(RTLD_NEXT, "aclrtMalloc");
    if (next == NULL)
        next = dlsym(dlopen("libascendcl.so", RTLD_LAZY | RTLD_NOLOAD), "aclrtMalloc");
    probe_mallocs++;
    return ((int (*)(void **, size_t, int))next)(p, size, policy);
}
"""


def test_preloaded_aclrtmalloc_wins_over_pyacl(tmp_path):
    lib = compile_shim(tmp_path, "probe", PROBE_C)
    env = sim_env()
    env["LD_PRELOAD"] = str(lib)
    run_python(f"""
        import ctypes, acl, aclsim
        probe = ctypes.CDLL({str(lib)!r})
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        ptr, ret = acl.rt.malloc(64, 0)
        assert ret == 0 and acl.rt.free(ptr) == 0
        assert ctypes.c_int.in_dll(probe, "probe_mallocs").value == 1   # the interposer saw it
        assert aclsim.call_count("aclrtMalloc") == 1                    # and forwarded once, no recursion
    """, env)


def test_numpy_helpers_share_memory_and_round_trip_through_the_device():
    pytest.importorskip("numpy")
    run_python("""
        import acl, numpy as np
        assert acl.init() == 0 and acl.rt.set_device(0) == 0
        host_in = np.arange(12, dtype=np.float32).reshape(3, 4)
        dev, ret = acl.rt.malloc(host_in.nbytes, 0); assert ret == 0
        assert acl.rt.memcpy(dev, host_in.nbytes, acl.util.numpy_to_ptr(host_in), host_in.nbytes, 1) == 0
        out = bytearray(host_in.nbytes)
        out_ptr = acl.util.bytes_to_ptr(out)
        assert acl.rt.memcpy(out_ptr, host_in.nbytes, dev, host_in.nbytes, 2) == 0
        view = acl.util.ptr_to_numpy(out_ptr, (3, 4), 11)     # 11: NPY_FLOAT32
        assert view.dtype == np.float32 and view.shape == (3, 4)
        assert (view == host_in).all()
        view[0, 0] = 42.0                                      # a view, not a copy: the buffer changes
        assert np.frombuffer(bytes(out), dtype=np.float32)[0] == 42.0
        for bad in ((0, (1,), 11), (out_ptr, (1,), 99)):
            try:
                acl.util.ptr_to_numpy(*bad)
            except ValueError:
                pass
            else:
                raise AssertionError(f"accepted {bad}")
        assert acl.rt.free(dev) == 0
    """, sim_env())


# What MindTorch v2's NPU runtime calls beyond the basics: contexts, pinned
# host memory, the SoC name, the op model dir, flagged events and configured
# streams, with pyACL's shapes, and errors where the real runtime errors.
MINDTORCH_CALLS = """
import os, acl, aclsim
assert acl.get_soc_name() is None                           # no name before aclInit
assert acl.rt.malloc_host(64)[1] == 100001
assert acl.init() == 0
assert acl.get_soc_name() == "Ascend910B3"
ctx, ret = acl.rt.create_context(0); assert type(ctx) is int and ctx and ret == 0
assert acl.rt.get_device() == (0, 0)                         # creating a context makes it current
assert acl.rt.create_context(99)[1] == 107001
ptr, ret = acl.rt.malloc(256, 0); assert ret == 0            # device calls work in the context
assert acl.rt.free(ptr) == 0
host, ret = acl.rt.malloc_host(4096); assert type(host) is int and host and ret == 0
acl.util.ptr_to_bytes(host, 16)                              # host memory, readable
assert acl.rt.free_host(host) == 0
assert acl.rt.free_host(0) == 100000
assert acl.rt.malloc_host(0)[1] == 100000
stream, ret = acl.rt.create_stream_with_config(5, 0); assert stream and ret == 0
e1, ret = acl.rt.create_event_with_flag(1); assert e1 and ret == 0
e2, ret = acl.rt.create_event_ex_with_flag(1); assert e2 and ret == 0
assert acl.rt.event_elapsed_time(e1, e2)[1] == 107000        # never recorded
assert acl.rt.record_event(e1, stream) == 0
assert acl.rt.record_event(e2, stream) == 0
assert acl.rt.synchronize_stream(stream) == 0
ms, ret = acl.rt.event_elapsed_time(e1, e2)
assert type(ms) is float and ms >= 0.0 and ret == 0
assert acl.op.set_model_dir("/nonexistent/opp") == 100000
assert acl.op.set_model_dir(os.getcwd()) == 0
assert acl.op.set_model_dir(os.getcwd()) == 100002           # once per process
# a second context on another device, then back: set_context switches devices
ctx1, ret = acl.rt.create_context(1); assert ret == 0 and acl.rt.get_device() == (1, 0)
assert acl.rt.set_context(ctx) == 0 and acl.rt.get_device() == (0, 0)
assert acl.rt.destroy_context(ctx1) == 0
assert acl.rt.set_context(ctx1) == 107000                    # destroyed handle
assert acl.rt.destroy_context(ctx1) == 107000
for call in (lambda: acl.rt.destroy_event(e1), lambda: acl.rt.destroy_event(e2),
             lambda: acl.rt.destroy_stream(stream), lambda: acl.rt.destroy_context(ctx)):
    assert call() == 0
assert acl.rt.get_device()[1] == 107002                      # the last reference went with the context
for api in ("aclrtCreateContext", "aclrtMallocHost", "aclrtEventElapsedTime", "aclopSetModelDir"):
    assert aclsim.call_count(api) > 0, api
assert acl.finalize() == 0
"""


def test_pyacl_calls_mindtorch_makes():
    run_python(MINDTORCH_CALLS, sim_env())


DEFAULT_CONTEXT = """
import threading, acl, aclsim
assert acl.init() == 0
assert acl.rt.get_context()[1] == 107002                     # no device on the thread: no context
assert acl.rt.set_device(0) == 0
default, ret = acl.rt.get_context(); assert default and ret == 0
assert acl.rt.destroy_context(default) == 107000             # CANN destroys only a context it created
assert acl.rt.get_device() == (0, 0)                         # and the device stays the thread's
ctx, ret = acl.rt.create_context(1); assert ret == 0
assert acl.rt.get_context() == (ctx, 0)                      # a created context is current
assert acl.rt.set_context(default) == 0 and acl.rt.get_device() == (0, 0)
assert acl.rt.get_context() == (default, 0)                  # the default set again
other = []
def on_device_0():
    assert acl.rt.set_device(0) == 0
    other.append(acl.rt.get_context())
thread = threading.Thread(target=on_device_0); thread.start(); thread.join()
assert other == [(default, 0)]                               # one default context per device
assert acl.rt.destroy_context(ctx) == 0
assert acl.rt.reset_device(0) == 0 and acl.rt.reset_device(0) == 0
assert acl.rt.set_context(default) == 107002                 # its device was reset under it
assert aclsim.call_count("aclrtGetCurrentContext") == 5
assert acl.finalize() == 0
"""


def test_a_devices_default_context_is_handed_out_and_never_destroyed():
    """aclrtGetCurrentContext answers the thread's current context: one it
    created or set, else its device's default context, which
    aclrtDestroyContext refuses (CANN's aclrtDestroyContext and
    aclrtSetCurrentContext docs: only a context aclrtCreateContext made can
    be destroyed; the default one is not)."""
    run_python(DEFAULT_CONTEXT, sim_env())
