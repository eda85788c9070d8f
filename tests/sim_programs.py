"""Opening lines shared by the simulator tests' programs (each runs in its
own interpreter, so helpers travel as source text)."""

# An initialised runtime on device 0, with device buffers filled and read back
# through the runtime's own calls.
DEVICE_BUFFERS = """\
import acl, aclsim
def ok(ret):
    assert ret == 0, ret
D2H, H2D, D2D = 2, 1, 3
ok(acl.init()); ok(acl.rt.set_device(0))
ops = aclsim.Ops()
def dev(size, value=0):
    p, ret = acl.rt.malloc(size, 0); ok(ret)
    ok(acl.rt.memset(p, size, value, size))
    return p
def read(p, size):
    out = bytearray(size)
    ok(acl.rt.memcpy(acl.util.bytes_to_ptr(out), size, p, size, D2H))
    return bytes(out)
"""

# For programs that must observe work while it is still queued: attempt(us)
# queues an op lasting that long, observes, and returns whether an event
# recorded after the op was still NOT_READY once it had observed (only then
# were its observations made while the op was queued). A machine too slow for
# that costs a retry with a longer op, never a failure: tests assert on
# events, never on time.
WHILE_QUEUED = """\
NOT_READY, COMPLETE = (0, 0), (1, 0)        # query_event_status results
def while_queued(attempt):
    for retry in range(8):
        if attempt(50_000 << retry):
            return
    raise AssertionError("the queued op always ended before it was observed")
def still_queued(event):
    return acl.rt.query_event_status(event) == NOT_READY
"""
