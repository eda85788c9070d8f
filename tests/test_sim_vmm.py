"""The simulated virtual memory API (what expandable segments use): reserved
addresses, physical handles charged against capacity, and mappings that are
real, usable memory."""
from __future__ import annotations

import textwrap

from conftest import run_python, sim_env

PRELUDE = """\
import ctypes
import acl, aclsim
def ok(ret):
    assert ret == 0, ret
MiB = 1 << 20
rt = aclsim.runtime()
ok(acl.init()); ok(acl.rt.set_device(0))
prop = aclsim.PhysicalMemProp.device(0)
def physical(size):
    h = ctypes.c_void_p()
    ret = rt.aclrtMallocPhysical(ctypes.byref(h), size, ctypes.byref(prop), 0)
    return h.value, ret
"""


def sim(code: str, check: bool = True, **env: str):
    return run_python(PRELUDE + textwrap.dedent(code), sim_env(**env), check=check)


def test_map_unmap_gives_usable_memory():
    proc = sim("""
        gran = ctypes.c_size_t()
        ok(rt.aclrtMemGetAllocationGranularity(ctypes.byref(prop), 0, ctypes.byref(gran)))
        assert gran.value == 2 * MiB
        va = ctypes.c_void_p()
        ok(rt.aclrtReserveMemAddress(ctypes.byref(va), 8 * MiB, 0, None, 0))
        base = va.value
        assert base % (2 * MiB) == 0
        free0 = acl.rt.get_mem_info(1)[0]
        h1, ret = physical(4 * MiB); ok(ret)
        h2, ret = physical(4 * MiB); ok(ret)
        assert aclsim.physical_bytes_outstanding(0) == 8 * MiB
        assert free0 - acl.rt.get_mem_info(1)[0] == 8 * MiB
        ok(rt.aclrtMapMem(base, 4 * MiB, 0, h1, 0))
        ok(rt.aclrtMapMem(base + 4 * MiB, 4 * MiB, 0, h2, 0))
        assert rt.aclrtMapMem(base, 2 * MiB, 0, h2, 0) == 100000    # already mapped there
        # One copy across both mappings, and back: the memory is real.
        data = bytes(range(256)) * (8 * MiB // 256)
        ok(acl.rt.memcpy(base, 8 * MiB, acl.util.bytes_to_ptr(data), 8 * MiB, 1))
        ok(acl.rt.memset(base + MiB, MiB, 0xEE, 16))
        assert acl.util.ptr_to_bytes(base + 4 * MiB - 4, 8) == data[4 * MiB - 4:4 * MiB + 4]
        assert acl.util.ptr_to_bytes(base + MiB, 17) == b"\\xee" * 16 + data[MiB + 16:MiB + 17]
        assert rt.aclrtFreePhysical(h2) == 207002                  # still mapped
        assert rt.aclrtReleaseMemAddress(base) == 207002           # still has mappings
        ok(rt.aclrtUnmapMem(base + 4 * MiB))
        assert acl.rt.memset(base + 4 * MiB, 16, 0, 16) == 107000  # unmapped now: refused, not a crash
        assert aclsim.invalid_accesses() == 1
        ok(rt.aclrtFreePhysical(h2))
        ok(rt.aclrtUnmapMem(base)); ok(rt.aclrtFreePhysical(h1))
        ok(rt.aclrtReleaseMemAddress(base))
        assert aclsim.physical_bytes_outstanding(0) == 0
        assert acl.rt.get_mem_info(1)[0] == free0
    """)
    assert "is not fully mapped (VMM)" in proc.stderr


def test_vmm_parameter_rules_and_capacity():
    sim("""
        va = ctypes.c_void_p()
        assert rt.aclrtReserveMemAddress(ctypes.byref(va), 2 * MiB, 0, ctypes.c_void_p(1 << 40), 0) == 100000
        assert rt.aclrtReserveMemAddress(ctypes.byref(va), MiB, 0, None, 0) == 100000  # not granular
        assert physical(MiB)[1] == 100000
        h, ret = physical(8 * MiB); ok(ret)
        assert physical(2 * MiB)[1] == 207001                   # the device is full
        assert acl.rt.malloc(64, 0)[1] == 207001                # for aclrtMalloc too
        ok(rt.aclrtFreePhysical(h))
        aclsim.fail_next_mallocs(1)
        assert physical(2 * MiB)[1] == 207001                   # fault injection covers physical memory
    """, NPUSIM_HBM_MB="8")


def test_map_mem_needs_a_granular_address():
    # The device maps whole 2 MiB pages: a mapping that starts inside one (an
    # expandable segment's page computed at a wrong offset) is refused, not
    # quietly made at a 4 KiB host page.
    sim("""
        va = ctypes.c_void_p()
        ok(rt.aclrtReserveMemAddress(ctypes.byref(va), 4 * MiB, 0, None, 0))
        h, ret = physical(2 * MiB); ok(ret)
        assert rt.aclrtMapMem(va.value + 4096, 2 * MiB, 0, h, 0) == 100000
        assert rt.aclrtMapMem(va.value + MiB, 2 * MiB, 0, h, 0) == 100000
        ok(rt.aclrtMapMem(va.value + 2 * MiB, 2 * MiB, 0, h, 0))
        ok(rt.aclrtUnmapMem(va.value + 2 * MiB)); ok(rt.aclrtFreePhysical(h))
        ok(rt.aclrtReleaseMemAddress(va.value))
    """)
