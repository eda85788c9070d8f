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
