"""The simulated runtime's memory API against the documented CANN behaviour
(tools/aclsim/README.md): error codes, rounding, capacity, mem info, devices,
fault injection, latency. Each scenario runs in its own process."""
from __future__ import annotations

import textwrap

from conftest import run_python, sim_env

PRELUDE = """\
import ctypes, os, threading
import acl, aclsim
def ok(ret):
    assert ret == 0, ret
"""


def sim(code: str, check: bool = True, **env: str):
    return run_python(PRELUDE + textwrap.dedent(code), sim_env(**env), check=check)


def test_parameter_and_free_errors():
    proc = sim("""
        rt = aclsim.runtime()
        ok(acl.init()); ok(acl.rt.set_device(0))
        assert rt.aclrtMalloc(None, 16, 0) == 100000            # NULL devPtr
        assert acl.rt.malloc(0, 0)[1] == 100000                 # size 0
        assert acl.rt.malloc_align32(0, 0)[1] == 100000
        assert acl.rt.free(0) == 100000                         # aclrtFree(NULL)
        p, ret = acl.rt.malloc(256, 0); ok(ret)
        host = bytearray(64)
        assert acl.rt.free(acl.util.bytes_to_ptr(host)) == 207002   # not device memory
        assert acl.rt.free(p + 64) == 207002                    # interior pointer
        ok(acl.rt.free(p))
        assert acl.rt.free(p) == 207002                         # double free
        assert aclsim.live_allocations(0) == 0
    """)
    assert proc.stderr.count("aclsim: aclrtFree(") == 3


def test_init_and_finalize_order():
    sim("""
        assert acl.rt.malloc(64, 0)[1] == 100001                # before aclInit
        assert acl.rt.set_device(0) == 100001
        assert acl.rt.get_device_count() == (8, 0)              # a machine property, answered anyway
        ok(acl.init())
        assert acl.init() == 100002                             # second aclInit
        ok(acl.rt.set_device(0))
        p, ret = acl.rt.malloc(64, 0); ok(ret)
        ok(acl.finalize())
        assert acl.finalize() == 100037                         # second aclFinalize
        assert acl.rt.malloc(64, 0)[1] == 100001                # after aclFinalize
        assert acl.rt.free(p) == 100001
        assert acl.init() == 100002                             # once per process
    """)


def test_current_device_is_per_thread():
    sim("""
        ok(acl.init())
        assert acl.rt.malloc(64, 0)[1] == 107002                # no device set yet
        assert acl.rt.get_device()[1] == 107002
        ok(acl.rt.set_device(0))
        assert acl.rt.get_device() == (0, 0)
        seen = {}
        def worker():
            seen["malloc"] = acl.rt.malloc(64, 0)[1]
            seen["get_device"] = acl.rt.get_device()[1]
            seen["mem_info"] = acl.rt.get_mem_info(1)[2]
            ok(acl.rt.set_device(0))
            p, seen["after_set"] = acl.rt.malloc(64, 0)
            ok(acl.rt.free(p))
        t = threading.Thread(target=worker); t.start(); t.join()
        assert seen == {"malloc": 107002, "get_device": 107002, "mem_info": 107002, "after_set": 0}, seen
    """)


def test_set_device_is_reference_counted():
    sim("""
        ok(acl.init())
        assert acl.rt.set_device(2) == 107001                   # only 2 devices
        ok(acl.rt.set_device(1)); ok(acl.rt.set_device(1))
        ok(acl.rt.reset_device(1))
        p, ret = acl.rt.malloc(1000, 0); ok(ret)                # one reference left
        assert aclsim.bytes_outstanding(1) == 1056 and aclsim.bytes_outstanding(0) == 0
        ok(acl.rt.reset_device(1))
        assert acl.rt.malloc(64, 0)[1] == 107002                # context gone with the last reference
    """, NPUSIM_DEVICE_COUNT="2")


def test_rounding_alignment_and_accounting():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        up32 = lambda n: (n + 31) // 32 * 32
        free0, total, ret = acl.rt.get_mem_info(1); ok(ret)
        expected = 0
        for size in (1, 31, 32, 33, 100, 4096, 1 << 20, (1 << 20) + 1, 3 << 20):
            for fn, pad in ((acl.rt.malloc, 32), (acl.rt.malloc_cached, 32), (acl.rt.malloc_align32, 0)):
                p, ret = fn(size, 0); ok(ret)
                assert p % 64 == 0, (size, hex(p))
                if size > (1 << 20):
                    assert p % (2 << 20) == 0, (size, hex(p))   # huge pages
                assert aclsim.allocation_info(p) == (size, up32(size) + pad), (size, aclsim.allocation_info(p))
                expected += up32(size) + pad
        free1, _, _ = acl.rt.get_mem_info(1)
        assert free0 - free1 == expected == aclsim.bytes_outstanding(0)
        assert aclsim.live_allocations(0) == 27
    """)


def test_capacity_exhaustion_returns_207001():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        half = 32 << 20
        a, ret = acl.rt.malloc(half, 0); ok(ret)                # charges 32 MiB + 32
        assert acl.rt.malloc(half, 0)[1] == 207001              # 2 * (32 MiB + 32) > 64 MiB
        assert acl.rt.get_mem_info(1)[0] == half - 32
        c, ret = acl.rt.malloc_align32(half - 32, 0); ok(ret)   # exactly the rest: no pad for Align32
        assert acl.rt.get_mem_info(1)[0] == 0
        assert acl.rt.malloc_align32(32, 0)[1] == 207001        # nothing left
        ok(acl.rt.free(a))
        a, ret = acl.rt.malloc(half, 0); ok(ret)                # freed capacity comes back, exactly
        assert acl.rt.malloc(1 << 40, 0)[1] == 207001           # beyond the device
    """, NPUSIM_HBM_MB="64")


def test_get_mem_info_attributes():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        p, ret = acl.rt.malloc(4000, 0); ok(ret)
        hbm = acl.rt.get_mem_info(1)                            # ACL_HBM_MEM
        assert hbm == ((1 << 30) - 4032, 1 << 30, 0), hbm
        assert acl.rt.get_mem_info(0) == hbm                    # ACL_DDR_MEM: same single pool
        assert acl.rt.get_mem_info(4) == hbm                    # ACL_HBM_MEM_HUGE
        assert acl.rt.get_mem_info(8) == (0, 0, 0)              # P2P huge: unsupported, 0/0
        assert acl.rt.get_mem_info(10) == (0, 0, 0)             # HUGE1G
        assert acl.rt.get_mem_info(99)[2] == 100000
        rt = aclsim.runtime()
        free = ctypes.c_size_t()
        assert rt.aclrtGetMemInfo(1, ctypes.byref(free), None) == 100000
    """, NPUSIM_HBM_MB="1024")


def test_fail_nth_malloc():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        rets = [acl.rt.malloc(64, 0)[1] for _ in range(5)]
        assert rets == [0, 0, 207001, 0, 0], rets
        assert aclsim.injected_failures() == 1
    """, NPUSIM_FAIL_NTH_MALLOC="3")


FAILURE_PATTERN = """
    ok(acl.init()); ok(acl.rt.set_device(0))
    print("".join("x" if acl.rt.malloc(64, 0)[1] == 207001 else "." for _ in range(64)))
"""


def test_fail_probability_is_reproducible_per_seed():
    runs = [sim(FAILURE_PATTERN, NPUSIM_FAIL_PROB="0.3", NPUSIM_FAIL_SEED=seed).stdout.strip()
            for seed in ("7", "7", "8")]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert 5 <= runs[0].count("x") <= 40, runs[0]


def test_fail_next_mallocs_on_request():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        aclsim.fail_next_mallocs(2)
        assert [acl.rt.malloc(64, 0)[1] for _ in range(3)] == [207001, 207001, 0]
        assert aclsim.injected_failures() == 2
    """)


def test_fail_next_calls_on_request():
    """A device that cannot be entered, work that cannot be waited for or
    fenced: the call fails with the code asked for and has no effect."""
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        stream, ret = acl.rt.create_stream(); ok(ret)
        event, ret = acl.rt.create_event(); ok(ret)
        aclsim.fail_next_calls("aclrtSetDevice", 1, 207004)
        assert acl.rt.set_device(1) == 207004
        assert acl.rt.get_device() == (0, 0)                    # still on device 0
        assert acl.rt.set_device(99) == 107001                  # parameter checks come first, and take no failure
        ok(acl.rt.set_device(1)); ok(acl.rt.set_device(0))      # one failure asked for, one given
        aclsim.fail_next_calls("aclrtRecordEvent", 2, 500000)
        aclsim.set_op_duration_us(60_000_000)                   # a copy that never ends within the test
        p, ret = acl.rt.malloc(64, 0); ok(ret)
        ops = aclsim.Ops()
        ws, ret = acl.rt.malloc(ops.WORKSPACE_BYTES, 0); ok(ret)
        n, ex, st = ops.fill_get_workspace_size(p, 64, 1); ok(st)
        ok(ops.fill(ws, n, ex, stream))
        assert acl.rt.record_event(event, stream) == 500000
        assert acl.rt.query_event_status(event) == (1, 0)      # not recorded: complete, as a never-recorded event
        assert acl.rt.record_event(event, 0) == 500000
        aclsim.fail_next_calls("aclrtSynchronizeStream", 1, 500000)
        aclsim.fail_next_calls("aclrtSynchronizeDevice", 1, 500000)
        assert acl.rt.synchronize_stream(stream) == 500000      # returns at once: the fill still runs
        assert acl.rt.synchronize_device() == 500000
        ok(acl.rt.record_event(event, stream))
        assert acl.rt.query_event_status(event) == (0, 0)      # behind the fill: the failures waited for nothing
        assert aclsim.injected_failures() == 5
        assert aclsim.call_count("aclrtRecordEvent") == 3 and aclsim.call_count("aclrtSetDevice") == 5
        aclsim.fail_next_calls("aclrtSetDevice", 1 << 20, 207004)
        aclsim.fail_next_calls("aclrtSetDevice", 0, 0)          # cleared
        ok(acl.rt.set_device(0))
        for bad in [("aclrtMalloc", 1, 207001), ("aclrtNoSuchThing", 1, 1), ("aclrtSetDevice", 1, 0)]:
            try:
                aclsim.fail_next_calls(*bad)
                raise AssertionError(f"{bad} accepted")
            except KeyError:
                pass
        os._exit(0)                                             # the fill never ends: leave without waiting for it
    """)


def test_latency_is_spent_on_the_caller():
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        seen = {}
        def other_thread():
            ok(acl.rt.set_device(0))
            seen["start"] = aclsim.thread_latency_us()
            p, ret = acl.rt.malloc(64, 0); ok(ret); ok(acl.rt.free(p))
            seen["end"] = aclsim.thread_latency_us()
        p, ret = acl.rt.malloc(64, 0); ok(ret)
        assert aclsim.thread_latency_us() == 2000
        worker = threading.Thread(target=other_thread); worker.start(); worker.join()
        assert seen == {"start": 0, "end": 3000}                # its own calls, charged to it alone
        assert aclsim.thread_latency_us() == 2000
        ok(acl.rt.free(p))
        assert aclsim.thread_latency_us() == 3000
        assert aclsim.op_time_us() == 0                         # no op ran: none of it is a stream's
    """, NPUSIM_MALLOC_US="2000", NPUSIM_FREE_US="1000")


def test_call_counters_and_both_runtime_libraries():
    sim("""
        ascendcl, acl_rt = aclsim.runtime("libascendcl.so"), aclsim.runtime("libacl_rt.so")
        ok(acl.init()); ok(acl.rt.set_device(0))
        aclsim.reset_counters()
        p = ctypes.c_void_p()
        ok(ascendcl.aclrtMalloc(ctypes.byref(p), 128, 0))
        ok(acl_rt.aclrtFree(p))                                  # one state behind both libraries
        acl.rt.malloc(0, 0)                                     # failed calls count too
        assert aclsim.call_count("aclrtMalloc") == 2
        assert aclsim.call_count("aclrtFree") == 1
        assert aclsim.call_count("aclrtMallocAlign32") == 0
        try:
            aclsim.call_count("aclrtNoSuchThing")
            raise AssertionError("unknown API name accepted")
        except KeyError:
            pass
        aclsim.reset_counters()
        assert aclsim.call_count("aclrtMalloc") == 0
    """)


def test_copy_kind_host_side_must_not_be_device_memory():
    # A kind that calls a device pointer host memory (swapped arguments, a
    # wrong kind) is refused, as the device path is: otherwise the sim copied
    # it like host memory, unchecked, so reading a freed block through it
    # went unseen.
    proc = sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        H2H, H2D, D2H, D2D = 0, 1, 2, 3
        a, ret = acl.rt.malloc(64, 0); ok(ret)
        b, ret = acl.rt.malloc(64, 0); ok(ret)
        ok(acl.rt.memset(a, 64, 0x11, 64)); ok(acl.rt.memset(b, 64, 0x22, 64))
        host = bytearray(64); h = acl.util.bytes_to_ptr(host)
        assert acl.rt.memcpy(b, 64, a, 64, H2D) == 107000   # src is device memory
        assert acl.rt.memcpy(b, 64, a, 64, D2H) == 107000   # dst is device memory
        assert acl.rt.memcpy(b, 64, a, 64, H2H) == 107000   # both (two invalid accesses)
        assert acl.util.ptr_to_bytes(b, 64) == b"\\x22" * 64  # nothing copied
        ok(acl.rt.free(a))
        assert acl.rt.memcpy(h, 64, a, 64, H2H) == 107000   # a freed block, read as host memory
        ok(acl.rt.memcpy(b, 64, h, 64, H2D)); ok(acl.rt.memcpy(h, 64, b, 64, D2H))
        ok(acl.rt.memcpy(b, 64, h, 64, 4)); ok(acl.rt.memcpy(h, 64, h, 32, H2H))
        ok(acl.rt.memcpy_async(b, 64, b, 64, H2D, 0)); ok(acl.rt.synchronize_stream(0))
        assert aclsim.invalid_accesses() == 6
    """)
    assert "is device memory where the copy kind says host memory" in proc.stderr


def test_policy_picks_the_pages():
    # HUGE_FIRST (and HUGE_ONLY): huge pages over 1 MiB; NORMAL_ONLY: never
    # (only the 64-byte guarantee, so no allocator may count on more); HUGE1G:
    # 1 GiB granularity. Flag bits and P2P variants pick the same pages.
    sim("""
        ok(acl.init()); ok(acl.rt.set_device(0))
        MiB, GiB = 1 << 20, 1 << 30
        keep = []
        def block(size, policy):
            p, ret = acl.rt.malloc(size, policy); ok(ret)
            keep.append(p)
            return p
        for _ in range(3):
            block(64, 2)                        # leaves the arena's next free byte unaligned
            p = block(3 * MiB, 2)               # NORMAL_ONLY
            assert p % (2 * MiB) != 0, hex(p)
        assert block(3 * MiB, 1) % (2 * MiB) == 0   # HUGE_ONLY
        assert block(3 * MiB, 1 | 0x1000) % (2 * MiB) == 0
        block(64, 0)
        assert block(3 * MiB, 0) % (2 * MiB) == 0   # HUGE_FIRST, over 1 MiB
        free0 = acl.rt.get_mem_info(1)[0]
        p = block(64, 6)                        # HUGE1G_ONLY
        assert p % GiB == 0 and aclsim.allocation_info(p) == (64, GiB)
        assert free0 - acl.rt.get_mem_info(1)[0] == GiB
        for p in keep:
            ok(acl.rt.free(p))
        assert aclsim.bytes_outstanding(0) == 0
    """)


def test_finalize_before_init_leaves_init_possible():
    sim("""
        assert acl.finalize() == 100001                         # nothing to finalize yet
        ok(acl.init()); ok(acl.rt.set_device(0))
        p, ret = acl.rt.malloc(64, 0); ok(ret)                  # the runtime works
        ok(acl.rt.free(p))
        ok(acl.finalize())
    """)
