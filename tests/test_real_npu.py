"""The same promises on real hardware: run only where an Ascend NPU and CANN
are installed (marker `npu`); skipped on the simulator-only machines of CI."""
import pytest

from conftest import real_npu_env, run_python

pytestmark = pytest.mark.npu

TRAINING_LOOP = """
import acl, npualloc
assert acl.init() == 0 and acl.rt.set_device(0) == 0
sizes = [4096, 1 << 20, 3 << 20, 12 << 20, 40 << 20, 512]
raw_after_warmup = None
for step in range(20):
    ptrs = []
    for i, size in enumerate(sizes):
        ptr, ret = acl.rt.malloc(size, 0)
        assert ret == 0, ret
        assert acl.rt.memset(ptr, size, (step + i) % 256, size) == 0
        ptrs.append((ptr, size, (step + i) % 256))
    for ptr, size, value in ptrs:
        host, ret = acl.rt.malloc_host(size)
        assert ret == 0
        assert acl.rt.memcpy(host, size, ptr, size, 2) == 0
        data = acl.util.ptr_to_bytes(host, size)
        assert data == bytes([value]) * size, "device data changed under the cache"
        acl.rt.free_host(host)
        assert acl.rt.free(ptr) == 0
    if step == 0:
        raw_after_warmup = npualloc.memory_stats()["num_device_alloc"]
assert npualloc.is_active()
assert npualloc.memory_stats()["num_device_alloc"] == raw_after_warmup, "raw mallocs after warm-up"
free, total = npualloc.mem_get_info(0)
assert 0 < free <= total
acl.rt.reset_device(0)
acl.finalize()
"""


def test_training_loop_on_real_npu_makes_no_raw_mallocs_after_warmup():
    proc = run_python(TRAINING_LOOP, real_npu_env(), timeout=300)
    assert "npualloc:" not in proc.stderr
