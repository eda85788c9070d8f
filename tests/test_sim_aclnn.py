"""The simulated aclnn ops and the aclOpExecutor lifecycle: auto-destroy by
phase 2, the double-destroy abort, repeatable executors, and buffers freed
while an op still uses them."""
from __future__ import annotations

import signal
import textwrap

from conftest import run_python, sim_env
from sim_programs import DEVICE_BUFFERS, WHILE_QUEUED

PRELUDE = "import time\n" + DEVICE_BUFFERS + WHILE_QUEUED + """\
WS = ops.WORKSPACE_BYTES
def queued_copy(duration_us, after):
    # A 2 KiB copy of 0x11 bytes lasting duration_us on the default stream,
    # with `after` recorded behind it: (src, dst).
    src, dst, ws = dev(2048, 0x11), dev(2048), dev(WS)
    aclsim.set_op_duration_us(duration_us)
    n, ex, st = ops.copy_get_workspace_size(dst, src, 2048); ok(st)
    ok(ops.copy(ws, n, ex, 0))
    ok(acl.rt.record_event(after, 0))
    return src, dst
"""


def sim(code: str, check: bool = True, **env: str):
    return run_python(PRELUDE + textwrap.dedent(code), sim_env(**env), check=check)


def test_phase2_destroys_a_plain_executor():
    sim("""
        dst, ws = dev(256), dev(WS)
        n, ex, st = ops.fill_get_workspace_size(dst, 256, 0x42); ok(st)
        assert n == WS and ex != 0
        assert aclsim.executors_live() == 1
        ok(ops.fill(ws, n, ex, 0))
        assert aclsim.executors_live() == 0 and aclsim.executors_destroyed() == 1
        ok(acl.rt.synchronize_stream(0))
        assert read(dst, 256) == b"\\x42" * 256
        n, ex, st = ops.fill_get_workspace_size(dst, 256, 0); ok(st)
        ok(ops.destroy_executor(ex))                            # never launched: may be destroyed
        assert aclsim.executors_live() == 0 and aclsim.executors_destroyed() == 2
    """)


def test_destroying_an_auto_destroyed_executor_aborts():
    proc = sim("""
        dst, ws = dev(256), dev(WS)
        n, ex, st = ops.fill_get_workspace_size(dst, 256, 1); ok(st)
        ok(ops.fill(ws, n, ex, 0))
        print(hex(ex), flush=True)
        ops.destroy_executor(ex)                                # the real double free
        print("survived", flush=True)
    """, check=False)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    assert "survived" not in proc.stdout
    handle = proc.stdout.split()[0]
    assert f"aclsim: double free of aclOpExecutor {handle}" in proc.stderr


def test_repeatable_executor_lifecycle():
    proc = sim("""
        dst, ws = dev(128), dev(WS)
        n, ex, st = ops.copy_get_workspace_size(dst, dev(128, 0x77), 128); ok(st)
        ok(ops.set_repeatable(ex))
        for _ in range(3):
            ok(ops.copy(ws, n, ex, 0))
        ok(acl.rt.synchronize_stream(0))
        assert read(dst, 128) == b"\\x77" * 128
        assert aclsim.executors_live() == 1                     # still alive after three launches
        ok(ops.destroy_executor(ex))
        assert aclsim.executors_live() == 0 and aclsim.executor_violations() == 0
        print("lifecycle ok", flush=True)
        ops.destroy_executor(ex)                                # destroyed twice: aborts
    """, check=False)
    assert "lifecycle ok" in proc.stdout, proc.stderr
    assert proc.returncode == -signal.SIGABRT
    assert "aclsim: double free of aclOpExecutor" in proc.stderr


def test_a_refused_destroy_leaves_the_executor_live():
    """aclDestroyAclOpExecutor failed on request: the code asked for, after
    the parameter check, and nothing destroyed: the executor still launches,
    and the next destroy is the one that destroys it."""
    sim("""
        dst, ws = dev(64), dev(WS)
        n, ex, st = ops.fill_get_workspace_size(dst, 64, 9); ok(st)
        ok(ops.set_repeatable(ex))
        aclsim.fail_next_calls("aclDestroyAclOpExecutor", 1, 561103)
        assert ops.destroy_executor(0) == 161001                # the NULL check comes first, and takes no failure
        assert ops.destroy_executor(ex) == 561103
        assert aclsim.executors_live() == 1 and aclsim.executors_destroyed() == 0
        ok(ops.fill(ws, n, ex, 0)); ok(acl.rt.synchronize_stream(0))
        assert read(dst, 64) == b"\\x09" * 64
        ok(ops.destroy_executor(ex))
        assert aclsim.executors_live() == 0 and aclsim.executors_destroyed() == 1
        assert aclsim.injected_failures() == 1 and aclsim.call_count("aclDestroyAclOpExecutor") == 3
    """)


def test_destroying_a_repeatable_executor_with_queued_work_is_a_violation():
    proc = sim("""
        after, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            dst, ws = dev(64), dev(WS)
            aclsim.set_op_duration_us(duration_us)
            n, ex, st = ops.fill_get_workspace_size(dst, 64, 5); ok(st)
            ok(ops.set_repeatable(ex))
            ok(ops.fill(ws, n, ex, 0))
            ok(acl.rt.record_event(after, 0))
            before = aclsim.executor_violations()
            ok(ops.destroy_executor(ex))                        # the launch is still queued...
            queued = still_queued(after)                        # ...if this holds
            if queued:
                assert aclsim.executor_violations() == before + 1
            ok(acl.rt.synchronize_stream(0))
            assert read(dst, 64) == b"\\x05" * 64              # the queued launch still ran
            return queued
        while_queued(attempt)
    """)
    assert "aclsim: aclDestroyAclOpExecutor(" in proc.stderr


def test_launch_errors():
    sim("""
        dst, ws = dev(64), dev(WS)
        assert ops.fill(ws, WS, 0, 0) == 561103                 # NULL executor
        assert ops.fill_get_workspace_size(0, 64, 1)[2] == 161001
        n, ex, st = ops.fill_get_workspace_size(dst, 64, 1); ok(st)
        assert ops.fill(ws, n - 1, ex, 0) == 161002             # workspace too small
        assert ops.fill(0, n, ex, 0) == 161002                  # no workspace
        assert aclsim.executors_live() == 1                     # a failed launch does not consume it
        ok(ops.fill(ws, n, ex, 0))
    """)


def test_op_reading_a_freed_source_is_detected():
    proc = sim("""
        after, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            src, dst = queued_copy(duration_us, after)
            before = aclsim.invalid_accesses()
            ok(acl.rt.free(src))                                # the op still needs it...
            queued = still_queued(after)                        # ...if this holds
            ok(acl.rt.synchronize_stream(0))
            if queued:
                assert aclsim.invalid_accesses() == before + 1
                assert read(dst, 2048) == b"\\xdb" * 2048      # poison, not the data
            return queued
        while_queued(attempt)
    """)
    assert "aclsim: invalid device access by aclnnSimCopy" in proc.stderr


def test_source_freed_and_reused_during_an_op_corrupts_its_output():
    sim("""
        after, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            src, dst = queued_copy(duration_us, after)
            before = aclsim.invalid_accesses()
            ok(acl.rt.free(src))
            again = dev(2048, 0x22)                             # the runtime hands the address out again
            assert again == src
            queued = still_queued(after)
            ok(acl.rt.synchronize_stream(0))
            if queued:
                assert read(dst, 2048) == b"\\x22" * 2048      # someone else's data
            assert aclsim.invalid_accesses() == before          # invisible to checks, as on hardware
            return queued
        while_queued(attempt)
    """)


def test_workspace_reused_during_an_op_is_detected():
    proc = sim("""
        after, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            dst, ws = dev(64), dev(WS)
            aclsim.set_op_duration_us(duration_us)
            n, ex, st = ops.fill_get_workspace_size(dst, 64, 3); ok(st)
            ok(ops.fill(ws, n, ex, 0))
            ok(acl.rt.record_event(after, 0))
            while read(ws, 8) == bytes(8):
                time.sleep(0.001)                               # until the op has stamped it
            before = aclsim.workspace_clobbers()
            ok(acl.rt.free(ws))
            assert dev(WS, 0) == ws                             # reused and overwritten...
            queued = still_queued(after)                        # ...while the op ran, if this holds
            ok(acl.rt.synchronize_stream(0))
            if queued:
                assert aclsim.workspace_clobbers() == before + 1
            return queued
        while_queued(attempt)
    """)
    assert "aclnnSimFill: workspace" in proc.stderr


def test_op_duration_is_taken_at_phase_one():
    sim("""
        dst, ws = dev(64), dev(WS)
        aclsim.set_op_duration_us(20_000)
        n, ex, st = ops.fill_get_workspace_size(dst, 64, 1); ok(st)
        aclsim.set_op_duration_us(0)
        before = aclsim.op_time_us()
        ok(ops.fill(ws, n, ex, 0)); ok(acl.rt.synchronize_stream(0))
        assert aclsim.op_time_us() - before == 20_000                  # phase 1's duration, not phase 2's
        assert aclsim.op_duration_us() == 0
    """)
