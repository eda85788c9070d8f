"""Streams and events of the simulated runtime: async execution on stream
workers, ordering, event status polarity, cross-stream waits, and memory
checks made when queued work actually executes."""
from __future__ import annotations

import textwrap

from conftest import run_python, sim_env
from sim_programs import DEVICE_BUFFERS, WHILE_QUEUED

PRELUDE = DEVICE_BUFFERS + WHILE_QUEUED + """\
def fill(dst, size, value, stream=0, ws=None):
    ws = ws or dev(ops.WORKSPACE_BYTES)
    n, ex, st = ops.fill_get_workspace_size(dst, size, value); ok(st)
    ok(ops.fill(ws, n, ex, stream))
"""


def sim(code: str, check: bool = True, **env: str):
    return run_python(PRELUDE + textwrap.dedent(code), sim_env(**env), check=check)


def test_fill_then_copy_run_in_order_and_asynchronously():
    sim("""
        a, b = dev(4096), dev(4096)
        stream, ret = acl.rt.create_stream(); ok(ret)
        after_fill, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            ok(acl.rt.memset(b, 4096, 0, 4096))
            aclsim.set_op_duration_us(duration_us)
            fill(a, 4096, 0x5A, stream)
            ok(acl.rt.record_event(after_fill, stream))
            ok(acl.rt.memcpy_async(b, 4096, a, 4096, D2D, stream))
            early = read(b, 4096)
            queued = still_queued(after_fill)                          # enqueueing did not wait for the fill
            ok(acl.rt.synchronize_stream(stream))
            assert acl.rt.query_event_status(after_fill) == COMPLETE     # the synchronize waited for it
            assert read(b, 4096) == b"\\x5a" * 4096                      # the copy waited for the fill
            if queued:
                assert early == bytes(4096)                              # nothing had run when b was read
            return queued
        while_queued(attempt)
        ok(acl.rt.destroy_stream(stream))
    """)


def test_event_status_polarity():
    sim("""
        ev, ret = acl.rt.create_event(); ok(ret)
        assert acl.rt.query_event_status(ev) == COMPLETE        # never recorded: COMPLETE (=1)
        assert acl.rt.query_event(ev) == (0, 0)                 # old enum: COMPLETE is 0
        def attempt(duration_us):
            aclsim.set_op_duration_us(duration_us)
            fill(dev(64), 64, 1)
            ok(acl.rt.record_event(ev, 0))
            status, old_enum = acl.rt.query_event_status(ev), acl.rt.query_event(ev)
            queued = still_queued(ev)                            # so both queries above saw it not ready
            if queued:
                assert status == NOT_READY                       # NOT_READY (=0)
                assert old_enum == (1, 0)                        # old enum: NOT_READY is 1
            ok(acl.rt.synchronize_event(ev))
            assert acl.rt.query_event_status(ev) == COMPLETE
            assert acl.rt.query_event(ev) == (0, 0)
            return queued
        while_queued(attempt)
        ok(acl.rt.destroy_event(ev))
        assert acl.rt.query_event_status(ev)[1] == 107000       # destroyed handle
    """)


def test_a_record_on_an_idle_stream_completes_at_once():
    """As a device reaches it within microseconds: on a stream with nothing
    queued or running (a created one and the default one) an event is
    complete at the first query after its record, every time, not once the
    stream's worker thread got a CPU; recorded behind queued work it waits
    for that work."""
    sim("""
        stream, ret = acl.rt.create_stream(); ok(ret)
        ev, ret = acl.rt.create_event(); ok(ret)
        for s in (stream, 0):
            ok(acl.rt.synchronize_stream(s))
            late = sum(acl.rt.record_event(ev, s) != 0 or acl.rt.query_event_status(ev) != COMPLETE
                       for _ in range(500))
            assert late == 0, late
        def attempt(duration_us):
            aclsim.set_op_duration_us(duration_us)
            fill(dev(64), 64, 1, stream)
            ok(acl.rt.record_event(ev, stream))
            queued = still_queued(ev)
            ok(acl.rt.synchronize_event(ev))
            assert acl.rt.query_event_status(ev) == COMPLETE
            return queued
        while_queued(attempt)
        ok(acl.rt.destroy_event(ev)); ok(acl.rt.destroy_stream(stream))
    """)


def test_stream_wait_event_orders_across_streams():
    sim("""
        a, b = dev(1024), dev(1024)
        s1, _ = acl.rt.create_stream(); s2, _ = acl.rt.create_stream()
        ev, _ = acl.rt.create_event()
        aclsim.set_op_duration_us(80_000)
        fill(a, 1024, 0x33, s1)
        ok(acl.rt.record_event(ev, s1))
        ok(acl.rt.stream_wait_event(s2, ev))
        ok(acl.rt.memcpy_async(b, 1024, a, 1024, D2D, s2))
        ok(acl.rt.synchronize_stream(s2))
        assert read(b, 1024) == b"\\x33" * 1024                  # s2's copy waited for s1's fill
    """)


def test_synchronize_device_and_free_with_dev_sync_wait_for_all_streams():
    sim("""
        a, b = dev(256), dev(256)
        s1, _ = acl.rt.create_stream()
        aclsim.set_op_duration_us(80_000)
        fill(a, 256, 7, s1)
        fill(b, 256, 8)                                          # default stream
        ok(acl.rt.synchronize_device())
        assert read(a, 256) == b"\\x07" * 256 and read(b, 256) == b"\\x08" * 256
        fill(a, 256, 9, s1)
        rt = aclsim.runtime()
        ok(rt.aclrtFreeWithDevSync(a))                           # waits for the fill, then frees
        assert aclsim.invalid_accesses() == 0
    """)


def test_async_copy_checks_memory_when_it_executes():
    proc = sim("""
        busy, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            a, b = dev(512, 0x11), dev(512)
            aclsim.set_op_duration_us(duration_us)
            before = aclsim.invalid_accesses()
            fill(dev(64), 64, 0)                                 # keeps the stream busy
            ok(acl.rt.record_event(busy, 0))
            ok(acl.rt.memcpy_async(b, 512, a, 512, D2D, 0))     # a is live when queued...
            ok(acl.rt.free(a))                                  # ...and freed before the copy runs
            early = aclsim.invalid_accesses() - before
            queued = still_queued(busy)
            if queued:
                assert early == 0                                # not checked at enqueue time
            ok(acl.rt.synchronize_stream(0))
            assert aclsim.invalid_accesses() - before == 1      # but when it ran
            assert read(b, 512) == b"\\xdb" * 512                # the copy read poisoned memory
            return queued
        while_queued(attempt)
    """)
    assert "aclsim: invalid device access by aclrtMemcpyAsync" in proc.stderr


def test_a_device_synchronize_during_a_destroy_waits_for_that_streams_work():
    """aclrtDestroyStream waits for the stream's work; a synchronize of the
    device from another thread meanwhile waits for that work too (the
    stream is the device's until its work is done), so memory the work
    writes may be freed after it; the handle is no caller's any more (a
    second destroy is refused)."""
    sim("""
        import threading
        busy, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            a = dev(256)
            s, ret = acl.rt.create_stream(); ok(ret)
            aclsim.set_op_duration_us(duration_us)
            fill(a, 256, 7, s)
            ok(acl.rt.record_event(busy, s))
            entered = aclsim.call_count("aclrtDestroyStream")
            results = []
            def destroy():
                results.append(acl.rt.set_device(0))                 # the thread's own current device
                results.append(acl.rt.destroy_stream(s))
            destroyer = threading.Thread(target=destroy)
            destroyer.start()
            while aclsim.call_count("aclrtDestroyStream") == entered and destroyer.is_alive():
                pass                                             # until the destroy has begun
            queued = still_queued(busy)
            assert acl.rt.destroy_stream(s) == 107000            # being destroyed: no second destroy
            ok(acl.rt.synchronize_device())
            assert read(a, 256) == b"\x07" * 256                # the fill ran before the synchronize returned
            destroyer.join()
            assert results == [0, 0]
            ok(acl.rt.free(a))
            return queued
        while_queued(attempt)
        assert aclsim.invalid_accesses() == 0
    """)


def test_stream_handle_errors():
    sim("""
        assert acl.rt.destroy_stream(0) == 100000               # the default stream stays
        s, _ = acl.rt.create_stream()
        ok(acl.rt.destroy_stream(s))
        assert acl.rt.synchronize_stream(s) == 107000           # destroyed stream
    """)


def test_a_forced_destroy_drops_what_has_not_run():
    """aclrtDestroyStreamForce does not wait: the op its worker has taken
    ends, what is queued behind it never runs, and an event record dropped
    so never completes, even after a synchronize."""
    sim("""
        def attempt(duration_us):
            a, b = dev(256), dev(256)
            s, ret = acl.rt.create_stream(); ok(ret)
            after_a, ret = acl.rt.create_event(); ok(ret)
            after_b, ret = acl.rt.create_event(); ok(ret)
            aclsim.set_op_duration_us(duration_us)
            fill(a, 256, 7, s)
            aclsim.set_op_duration_us(0)
            ok(acl.rt.record_event(after_a, s))
            fill(b, 256, 9, s)
            ok(acl.rt.record_event(after_b, s))
            ok(acl.rt.destroy_stream_force(s))
            dropped = still_queued(after_a)                      # so the fill of a was still running
            if dropped:
                assert read(a, 256) == b"\\x07" * 256            # it ended before the destroy returned
                assert read(b, 256) == bytes(256)                # the fill of b never ran
                ok(acl.rt.synchronize_device())
                assert still_queued(after_b)
            assert acl.rt.synchronize_stream(s) == 107000
            return dropped
        while_queued(attempt)
        assert aclsim.invalid_accesses() == 0
    """)


def test_a_forced_reset_releases_the_device_whatever_its_count():
    sim("""
        ok(acl.rt.set_device(0))                                 # a second reference
        ok(acl.rt.reset_device_force(0))
        assert acl.rt.get_device()[1] == 107002                  # released: no current device
        assert acl.rt.reset_device_force(0) == 107000            # already released
        ok(acl.rt.set_device(0))
        ok(acl.rt.reset_device(0))                               # counted afresh: one reference, one reset
        assert acl.rt.get_device()[1] == 107002
    """)


def test_the_streams_a_reset_has_yet_to_destroy_are_no_callers():
    """A reset destroys the device's streams one at a time, each once its
    work drained. An aclrtSetDevice meanwhile, in another thread, starts the
    device again; the streams the reset has still to destroy are of the
    ended device, refused (107000) as once destroyed: they took work, and
    a destroy, from the new context."""
    sim("""
        import threading
        busy, other = acl.rt.create_event(), acl.rt.create_event()
        busy, other = busy[0], other[0]
        def attempt(duration_us):
            a = dev(256)
            later, ret = acl.rt.create_stream(); ok(ret)         # destroyed after the busy one (newest first)
            s, ret = acl.rt.create_stream(); ok(ret)
            aclsim.set_op_duration_us(duration_us)
            fill(a, 256, 7, s)
            ok(acl.rt.record_event(busy, s))
            results = []
            resetter = threading.Thread(target=lambda: results.append(acl.rt.reset_device_force(0)))
            resetter.start()
            while acl.rt.get_device()[1] == 0:
                pass                                             # until the reset has ended this context
            ok(acl.rt.set_device(0))                             # the device started again
            refused = [acl.rt.record_event(other, later), acl.rt.destroy_stream(later)]
            queued = still_queued(busy)                          # the reset was still draining s: later was listed
            resetter.join()
            assert results == [0]
            assert refused == [107000, 107000], refused
            assert acl.rt.query_event_status(other) == COMPLETE   # never recorded
            ok(acl.rt.free(a))
            return queued
        while_queued(attempt)
        assert aclsim.invalid_accesses() == 0
    """)


def test_a_contexts_destroy_ends_the_streams_made_in_it():
    """CANN's aclrtDestroyContext "cleans up the associated resources": its
    context teardown takes down every stream made in the context, each once
    its queued work is done. The sim kept them, worker threads and all, until
    the device's last reset: a program making a context and a stream each
    step and destroying the context grew by a thread a step. A stream of a
    destroyed context answers as a destroyed stream does (107000)."""
    sim("""
        import os
        def threads():
            return len(os.listdir("/proc/self/task"))
        a = dev(256)
        ws = dev(ops.WORKSPACE_BYTES)
        done, ret = acl.rt.create_event(); ok(ret)
        before = threads()
        for step in range(300):
            ctx, ret = acl.rt.create_context(0); ok(ret)     # the device keeps set_device's reference
            s, ret = acl.rt.create_stream(); ok(ret)
            if step == 0:
                aclsim.set_op_duration_us(20_000)
                fill(a, 256, 7, s, ws)
                ok(acl.rt.record_event(done, s))
                aclsim.set_op_duration_us(0)
            ok(acl.rt.destroy_context(ctx))
            if step == 0:
                assert acl.rt.query_event_status(done) == COMPLETE   # the destroy waited for its work
                assert read(a, 256) == b"\\x07" * 256
                used = [acl.rt.synchronize_stream(s), acl.rt.record_event(done, s), acl.rt.destroy_stream(s)]
                assert used == [107000] * 3, used
        grown = threads() - before
        assert grown < 10, grown
        assert aclsim.invalid_accesses() == 0
    """)


def test_a_context_destroyed_by_another_thread_is_refused_where_it_was_current():
    """CANN detaches a destroyed context from every thread it was current on
    and refuses that thread's call (107002: no context). The sim let such a
    thread go on in the dead context: a stream it made there afterwards was
    no context's to destroy and kept its worker until the device's last
    reset. Its next call runs in its device's default context, as on the
    thread that destroyed it."""
    sim("""
        import threading
        ctx, ret = acl.rt.create_context(0); ok(ret)
        bound, destroyed = threading.Event(), threading.Event()
        results = []
        def other():
            results.append(acl.rt.set_context(ctx))
            bound.set()
            destroyed.wait()
            s, ret = acl.rt.create_stream()
            results.append(ret)
            s, ret = acl.rt.create_stream()
            results.append(ret)
            results.append(acl.rt.destroy_stream(s))
        thread = threading.Thread(target=other, daemon=True)
        thread.start()
        bound.wait()
        ok(acl.rt.destroy_context(ctx))
        destroyed.set()
        thread.join()
        assert results == [0, 107002, 0, 0], results
    """)
