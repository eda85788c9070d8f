"""The simulator's real aclnn operators (libopapi.so over libnnopbase.so's
descriptors), called through ctypes with CANN's signatures and checked against
numpy: values, broadcasting, strided views, dtypes, workspaces, descriptor
lifetime, executor lifetime and device-memory checking."""
from __future__ import annotations

import signal
import textwrap

import pytest

from conftest import run_python, sim_env
from sim_programs import DEVICE_BUFFERS, WHILE_QUEUED

PRELUDE = DEVICE_BUFFERS + WHILE_QUEUED + """\
import ctypes
import numpy as np
from ctypes import c_void_p as P, c_bool, c_int32, c_int8, c_int64, c_uint64
nn = ctypes.CDLL("libnnopbase.so")
opapi = ctypes.CDLL("libopapi.so")
nn.aclCreateTensor.restype = P
nn.aclCreateTensor.argtypes = [ctypes.POINTER(c_int64), c_uint64, c_int32, ctypes.POINTER(c_int64), c_int64,
                               c_int32, ctypes.POINTER(c_int64), c_uint64, P]
nn.aclCreateScalar.restype = P
nn.aclCreateScalar.argtypes = [P, c_int32]
nn.aclCreateIntArray.restype = P
nn.aclCreateIntArray.argtypes = [ctypes.POINTER(c_int64), c_uint64]
nn.aclCreateTensorList.restype = P
nn.aclCreateTensorList.argtypes = [ctypes.POINTER(P), c_uint64]
for name in ("aclDestroyTensor", "aclDestroyScalar", "aclDestroyIntArray", "aclDestroyAclOpExecutor",
             "aclDestroyTensorList"):
    getattr(nn, name).argtypes = [P]
ACL = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int8): 2, np.dtype(np.int32): 3,
       np.dtype(np.uint8): 4, np.dtype(np.int64): 9, np.dtype(np.float64): 11, np.dtype(np.bool_): 12}
def i64s(values):
    return (c_int64 * max(len(values), 1))(*values)
class T:
    "A device tensor: a view (shape, element strides, offset) of a device buffer, and its descriptor."
    def __init__(self, ptr, shape, strides, dtype, offset=0):
        self.ptr, self.shape, self.strides, self.dtype, self.offset = ptr, tuple(shape), tuple(strides), np.dtype(dtype), offset
        self.desc = nn.aclCreateTensor(i64s(shape), len(shape), ACL[self.dtype], i64s(strides), offset, 2,
                                       i64s(shape), len(shape), ptr)
        assert self.desc
    def numpy(self):
        ok(acl.rt.synchronize_stream(0))
        span = 1 + self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.strides) if d > 0)
        raw = np.frombuffer(read(self.ptr, span * self.dtype.itemsize), dtype=self.dtype)
        return np.lib.stride_tricks.as_strided(raw[self.offset:], self.shape,
                                               [s * self.dtype.itemsize for s in self.strides]).copy()
def dev_array(a):
    a = np.ascontiguousarray(a)
    p = dev(max(a.nbytes, 1))
    if a.nbytes:
        ok(acl.rt.memcpy(p, a.nbytes, a.ctypes.data, a.nbytes, H2D))
    return p
def tensor(a):
    a = np.ascontiguousarray(a)
    return T(dev_array(a), a.shape, [s // a.itemsize for s in a.strides], a.dtype)
def empty(shape, dtype):
    n = int(np.prod(shape, dtype=np.int64))
    strides = [int(np.prod(shape[k + 1:], dtype=np.int64)) for k in range(len(shape))]
    return T(dev(max(n * np.dtype(dtype).itemsize, 1)), shape, strides, dtype)
def scalar(value, dtype=np.float32):
    buf = np.array([value], dtype=dtype)
    return nn.aclCreateScalar(buf.ctypes.data, ACL[np.dtype(dtype)])
def int_array(values):
    return nn.aclCreateIntArray(i64s(values), len(values))
def tensor_list(ts):
    return nn.aclCreateTensorList((P * len(ts))(*[t.desc for t in ts]), len(ts))
def arg(a):
    return a.desc if isinstance(a, T) else a
def call(name, *args, destroy=(), stream=0):
    "Both phases of aclnn<name>; destroys `destroy` descriptors between them. Returns the workspace size."
    ws, ex = c_uint64(), P()
    st = getattr(opapi, "aclnn" + name + "GetWorkspaceSize")(*[P(arg(a)) if isinstance(a, (T, int)) else a for a in args],
                                                            ctypes.byref(ws), ctypes.byref(ex))
    assert st == 0, (name, st)
    for d in destroy:
        ok(nn.aclDestroyTensor(d.desc))
    wsp = dev(ws.value) if ws.value else 0
    assert getattr(opapi, "aclnn" + name)(P(wsp), c_uint64(ws.value), ex, P(stream)) == 0
    return ws.value
def phase1_status(name, *args):
    ws, ex = c_uint64(), P()
    return getattr(opapi, "aclnn" + name + "GetWorkspaceSize")(*[P(arg(a)) if isinstance(a, (T, int)) else a for a in args],
                                                              ctypes.byref(ws), ctypes.byref(ex))
rng = np.random.default_rng(7)
def close(got, want, dtype):
    tol = 2e-3 if np.dtype(dtype) == np.float16 else 1e-5
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
"""


def sim(code: str, check: bool = True, **env: str):
    return run_python(PRELUDE + textwrap.dedent(code), sim_env(**env), check=check)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_binary_ops_broadcast_against_numpy(dtype):
    sim(f"""
        dt = np.{dtype}
        a = rng.standard_normal((3, 1, 5)).astype(dt)
        b = (rng.random((4, 1)) + 0.5).astype(dt)
        A, B = tensor(a), tensor(b)
        cases = {{
            "Mul": (lambda x, y: x * y, ()), "Div": (lambda x, y: x / y, ()),
            "Maximum": (np.maximum, ()), "Minimum": (np.minimum, ()),
            "Add": (lambda x, y: x + 2 * y, (scalar(2.0),)), "Sub": (lambda x, y: x - 2 * y, (scalar(2.0),)),
        }}
        for name, (fn, extra) in cases.items():
            out = empty((3, 4, 5), dt)
            assert call(name, A, B, *extra, out) == 0           # elementwise: no workspace
            close(out.numpy(), fn(a.astype(np.float64), b.astype(np.float64)), dt)
        for name, fn in {{"Eq": np.equal, "Ne": np.not_equal, "Gt": np.greater, "Ge": np.greater_equal,
                          "Lt": np.less, "Le": np.less_equal}}.items():
            out = empty((3, 4, 5), np.bool_)
            call(name + "Tensor", A, tensor(a[:, :, :1]), out)
            assert (out.numpy() == fn(a, a[:, :, :1])).all(), name
            out = empty((3, 1, 5), np.bool_)
            call(name + "Scalar", A, scalar(0.25), out)
            assert (out.numpy() == fn(a, dt(0.25))).all(), name
        out = empty((3, 1, 5), dt)
        call("PowTensorScalar", tensor(np.abs(a)), scalar(3.0), out)
        close(out.numpy(), np.abs(a).astype(np.float64) ** 3, dt)
        out = empty((3, 1, 5), dt)
        call("Adds", A, scalar(1.5), scalar(2.0), out)
        close(out.numpy(), a.astype(np.float64) + 3.0, dt)
    """)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_unary_ops_on_a_strided_view(dtype):
    sim(f"""
        dt = np.{dtype}
        base = (rng.random((4, 6)) * 3 - 1.5).astype(dt)
        base[0, 0] = 0
        # the transpose of columns 1..4: a non-contiguous view with an offset
        view = base[:, 1:5].T
        src = T(dev_array(base), view.shape, (1, 6), dt, offset=1)
        pos = np.abs(view.astype(np.float64)) + 0.1
        P_ = T(dev_array(np.abs(base) + dt(0.1)), view.shape, (1, 6), dt, offset=1)
        x = view.astype(np.float64)
        sig = 1 / (1 + np.exp(-x))
        cases = {{"Neg": (src, -x), "Abs": (src, np.abs(x)), "Sign": (src, np.sign(x)),
                  "Relu": (src, np.maximum(x, 0)), "Exp": (src, np.exp(x)), "Tanh": (src, np.tanh(x)),
                  "Sigmoid": (src, sig), "Silu": (src, x * sig), "Floor": (src, np.floor(x)),
                  "Log": (P_, np.log(np.abs(base[:, 1:5].T).astype(np.float64) + 0.1)),
                  "Sqrt": (P_, np.sqrt(np.abs(view).astype(np.float64) + 0.1)),
                  "Rsqrt": (P_, 1 / np.sqrt(np.abs(view).astype(np.float64) + 0.1))}}
        for name, (inp, want) in cases.items():
            out = empty(view.shape, dt)
            call(name, inp, out)
            close(out.numpy(), want, dt)
        assert aclsim.invalid_accesses() == 0
    """)


def test_integer_and_bool_dtypes():
    sim("""
        a = np.array([[-3, 0, 7], [2, -8, 5]], dtype=np.int32)
        b = np.array([2, -3, 4], dtype=np.int32)
        out = empty((2, 3), np.int32)
        call("Add", tensor(a), tensor(b), scalar(1, np.int32), out)
        assert (out.numpy() == a + b).all()
        out = empty((2, 3), np.int64)
        call("Cast", tensor(a), c_int32(9), out)
        assert (out.numpy() == a.astype(np.int64)).all()
        out = empty((2, 3), np.bool_)
        call("Cast", tensor(a), c_int32(12), out)
        assert (out.numpy() == (a != 0)).all()
        f = np.array([1.7, -1.7, 300.0], dtype=np.float32)
        out = empty((3,), np.int8)
        call("Cast", tensor(f), c_int32(2), out)
        assert out.numpy().tolist() == [1, -1, 127]           # truncates, saturates
        cond = np.array([True, False, True])
        out = empty((2, 3), np.int32)
        call("SWhere", tensor(cond), tensor(a), tensor(b), out)
        assert (out.numpy() == np.where(cond, a, b)).all()
        out = empty((2, 3), np.bool_)
        call("LogicalAnd", tensor(a > 0), tensor(b > 0), out)
        assert (out.numpy() == ((a > 0) & (b > 0))).all()
    """)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reductions(dtype):
    sim(f"""
        dt = np.{dtype}
        a = rng.standard_normal((2, 3, 4)).astype(dt)
        A = tensor(a)
        x = a.astype(np.float64)
        acl_dt = c_int32(ACL[np.dtype(dt)])
        for name, fn in (("ReduceSum", np.sum), ("Mean", np.mean)):
            out = empty((2, 4), dt)
            ws = call(name, A, int_array([1]), c_bool(False), acl_dt, out)
            assert ws > 0, ws                                  # reductions ask for a workspace
            close(out.numpy(), fn(x, axis=1), dt)
            out = empty((1, 3, 1), dt)
            call(name, A, int_array([0, -1]), c_bool(True), acl_dt, out)
            close(out.numpy(), fn(x, axis=(0, 2), keepdims=True), dt)
            out = empty((), dt)
            call(name, A, int_array([]), c_bool(False), acl_dt, out)  # no dims: all of them
            close(out.numpy(), fn(x), dt)
        # a transposed input
        t = T(A.ptr, (4, 3, 2), (1, 4, 12), dt)
        out = empty((4,), dt)
        call("ReduceSum", t, int_array([1, 2]), c_bool(False), acl_dt, out)
        close(out.numpy(), x.transpose(2, 1, 0).sum(axis=(1, 2)), dt)
        assert phase1_status("ReduceSum", A, int_array([1]), c_bool(False), acl_dt, empty((2, 3), dt)) == 161002
        assert phase1_status("ReduceSum", A, int_array([3]), c_bool(False), acl_dt, empty((2, 3), dt)) == 161002
    """)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_matmul_family(dtype):
    sim(f"""
        dt = np.{dtype}
        a = rng.standard_normal((2, 3, 4)).astype(dt)
        b = rng.standard_normal((4, 5)).astype(dt)
        x, y = a.astype(np.float64), b.astype(np.float64)
        out = empty((2, 3, 5), dt)
        assert call("Matmul", tensor(a), tensor(b), out, c_int8(0)) > 0
        close(out.numpy(), x @ y, dt)
        # a weight used transposed, as Linear does: a (5, 4) buffer read as (4, 5)
        w = np.ascontiguousarray(b.T)
        wt = T(dev_array(w), (4, 5), (1, 4), dt)
        out = empty((3, 5), dt)
        call("Mm", tensor(a[0]), wt, out, c_int8(0))
        close(out.numpy(), x[0] @ y, dt)
        out = empty((2, 3, 5), dt)
        call("BatchMatMul", tensor(a), tensor(np.stack([b, 2 * b])), out, c_int8(0))
        close(out.numpy(), x @ np.stack([y, 2 * y]), dt)
        bias = rng.standard_normal((5,)).astype(dt)
        out = empty((3, 5), dt)
        call("Addmm", tensor(bias), tensor(a[0]), tensor(b), scalar(0.5), scalar(2.0), out, c_int8(0))
        close(out.numpy(), 0.5 * bias.astype(np.float64) + 2 * (x[0] @ y), dt)
        assert phase1_status("Matmul", tensor(a), tensor(b[:3]), out, c_int8(0)) == 161002
    """)


def test_copy_and_fills_touch_only_the_view():
    sim("""
        base = np.arange(24, dtype=np.float32).reshape(4, 6)
        B = tensor(base)
        col = T(B.ptr, (4,), (6,), np.float32, offset=2)      # column 2
        call("InplaceFillScalar", col, scalar(-1.0))
        want = base.copy(); want[:, 2] = -1
        assert (B.numpy() == want).all()
        call("InplaceZero", T(B.ptr, (2, 2), (6, 1), np.float32, offset=7))
        want[1:3, 1:3] = 0
        assert (B.numpy() == want).all()
        call("InplaceOne", T(B.ptr, (6,), (1,), np.float32, offset=18))
        want[3] = 1
        assert (B.numpy() == want).all()
        # copy with broadcast and a dtype conversion into a strided destination
        src = np.array([1.5, 2.5, 3.5, 4.5], dtype=np.float16)
        call("InplaceCopy", T(B.ptr, (2, 4), (12, 1), np.float32, offset=1), tensor(src))
        want[0, 1:5] = src; want[2, 1:5] = src
        assert (B.numpy() == want).all()
        out = empty((4, 6), np.float32)
        call("InplaceCopy", out, B)
        assert (out.numpy() == want).all()
        assert aclsim.invalid_accesses() == 0
    """)


def test_descriptors_destroyed_after_phase1_and_executor_double_destroy_aborts():
    proc = sim("""
        aclsim.set_op_duration_us(20000)                      # the op runs well after its descriptors die
        a = np.ones((8, 8), np.float32)
        A, B, out = tensor(a), tensor(2 * a), empty((8, 8), np.float32)
        ws, ex = c_uint64(), P()
        alpha = scalar(1.0)
        assert opapi.aclnnAddGetWorkspaceSize(P(A.desc), P(B.desc), P(alpha), P(out.desc),
                                              ctypes.byref(ws), ctypes.byref(ex)) == 0
        for d in (A.desc, B.desc, out.desc):
            ok(nn.aclDestroyTensor(d))
        ok(nn.aclDestroyScalar(alpha))
        # fresh descriptors reuse the freed heap memory: the executor must not look at it
        C = tensor(np.full((8, 8), 100, np.float32))
        assert opapi.aclnnAdd(P(0), c_uint64(0), ex, P(0)) == 0
        ok(acl.rt.synchronize_stream(0))
        assert (np.frombuffer(read(out.ptr, 256), np.float32) == 3).all()
        assert aclsim.executors_live() == 0                  # phase 2 destroyed it
        print("computed", flush=True)
        nn.aclDestroyAclOpExecutor(ex)                        # MindTorch's deferred destroy: the double free
        print("survived", flush=True)
    """, check=False)
    assert proc.returncode == -signal.SIGABRT, (proc.returncode, proc.stderr)
    assert "computed" in proc.stdout and "survived" not in proc.stdout
    assert "aclsim: double free of aclOpExecutor" in proc.stderr


def test_reduction_workspace_is_required_and_checked():
    sim("""
        A, out = tensor(np.ones((4, 4), np.float32)), empty((4,), np.float32)
        ws, ex = c_uint64(), P()
        assert opapi.aclnnReduceSumGetWorkspaceSize(P(A.desc), P(int_array([0])), c_bool(False), c_int32(0),
                                                    P(out.desc), ctypes.byref(ws), ctypes.byref(ex)) == 0
        assert ws.value > 0
        assert opapi.aclnnReduceSum(P(0), c_uint64(0), ex, P(0)) == 161002   # no workspace: refused
        assert opapi.aclnnReduceSum(P(dev(ws.value)), ws, ex, P(0)) == 0     # not consumed by the failure
        assert (out.numpy() == 4).all()
    """)


def test_input_freed_before_the_op_runs_is_detected():
    """The op reads its input when it ends: a free while it is queued is an
    invalid access. A host stalled past the op's end frees it too late to
    show anything, which `after` tells, and costs a retry with a longer op."""
    sim("""
        after, ret = acl.rt.create_event(); ok(ret)
        def attempt(duration_us):
            aclsim.set_op_duration_us(duration_us)
            A, out = tensor(np.ones(64, np.float32)), empty((64,), np.float32)
            call("Neg", A, out)
            ok(acl.rt.record_event(after, 0))
            before = aclsim.invalid_accesses()
            ok(acl.rt.free(A.ptr))                           # freed while the op is still queued...
            queued = still_queued(after)                     # ...if this holds
            ok(acl.rt.synchronize_stream(0))
            if queued:
                assert aclsim.invalid_accesses() >= before + 1
            return queued
        while_queued(attempt)
    """)


def test_bad_arguments_and_absent_ops():
    sim("""
        A = tensor(np.ones((2, 3), np.float32))
        assert phase1_status("Mul", A, tensor(np.ones((4,), np.float32)), empty((2, 3), np.float32)) == 161002
        assert phase1_status("Mul", A, 0, empty((2, 3), np.float32)) == 161001
        assert phase1_status("Cast", A, c_int32(1), empty((2, 3), np.float32)) == 161002  # dtype vs out
        assert not hasattr(opapi, "aclnnGroupNormGetWorkspaceSize")  # not simulated: absent, not a stub
        for lib in ("libaclnn_ops_infer.so", "libaclnn_math.so"):
            assert hasattr(ctypes.CDLL(lib), "aclnnAddGetWorkspaceSize")   # resolves to libopapi.so's
    """)


def test_softmax_along_a_dim_of_a_strided_view():
    sim("""
        a = rng.standard_normal((3, 5)).astype(np.float32)
        A = T(dev_array(np.ascontiguousarray(a.T)), (3, 5), (1, 3), np.float32)   # a, read transposed
        x = a.astype(np.float64)
        sm = np.exp(x - x.max(axis=1, keepdims=True)); sm /= sm.sum(axis=1, keepdims=True)
        out = empty((3, 5), np.float32)
        assert call("Softmax", A, c_int64(-1), out) > 0
        close(out.numpy(), sm, np.float32)
        out = empty((3, 5), np.float32)
        call("LogSoftmax", A, c_int64(1), out)
        close(out.numpy(), np.log(sm), np.float32)
        sm0 = np.exp(x) / np.exp(x).sum(axis=0, keepdims=True)
        out = empty((3, 5), np.float32)
        call("Softmax", A, c_int64(0), out)
        close(out.numpy(), sm0, np.float32)
        assert phase1_status("Softmax", A, c_int64(2), out) == 161002
    """)


def test_gather_and_embedding():
    proc = sim("""
        table = rng.standard_normal((6, 4)).astype(np.float32)
        idx = np.array([[5, 0], [2, 2], [1, 3]], dtype=np.int64)
        out = empty((3, 2, 4), np.float32)
        call("Embedding", tensor(table), tensor(idx), out)
        assert (out.numpy() == table[idx]).all()
        g = np.array([[3, 0, 1, 1], [0, 5, 2, -1]], dtype=np.int32)
        out = empty((2, 4), np.float32)
        call("Gather", tensor(table), c_int64(0), tensor(g), out)
        assert (out.numpy() == np.take_along_axis(table, g % 6, axis=0)).all()
        g1 = np.array([[3, 0], [1, 1]], dtype=np.int64)
        out = empty((2, 2), np.float32)
        call("Gather", tensor(table[:2]), c_int64(1), tensor(g1), out)
        assert (out.numpy() == np.take_along_axis(table[:2], g1, axis=1)).all()
        bad = np.array([[7, 0]], dtype=np.int64)
        out = empty((1, 2), np.float32)
        call("Gather", tensor(table), c_int64(0), tensor(bad), out)
        assert out.numpy().tolist() == [[0.0, table[0, 1]]]
        assert phase1_status("Gather", tensor(table), c_int64(0), tensor(table), out) == 161002  # float index
    """)
    assert "aclnnGather: 1 index value(s) out of range" in proc.stderr


def test_parameterised_activations_and_backward_ops():
    sim("""
        a = np.array([-3.0, -0.5, 0.0, 0.5, 3.0], dtype=np.float32)
        x = a.astype(np.float64)
        A = tensor(a)
        out = empty((5,), np.float32)
        call("Clamp", A, scalar(-1.0), None, out)               # an optional bound left out
        close(out.numpy(), np.maximum(x, -1), np.float32)
        out = empty((5,), np.float32)
        call("Clamp", A, scalar(-1.0), scalar(1.0), out)
        close(out.numpy(), np.clip(x, -1, 1), np.float32)
        out = empty((5,), np.float32)
        call("Elu", A, scalar(0.5), scalar(2.0), scalar(1.0), out)
        close(out.numpy(), np.where(x > 0, 2 * x, 2 * 0.5 * np.expm1(x)), np.float32)
        out = empty((5,), np.float32)
        call("LeakyRelu", A, scalar(0.1), out)
        close(out.numpy(), np.where(x > 0, x, 0.1 * x), np.float32)
        g = np.linspace(1, 2, 5).astype(np.float32)
        out = empty((5,), np.float32)
        call("ThresholdBackward", tensor(g), A, scalar(0.0), out)
        close(out.numpy(), np.where(x > 0, g, 0), np.float32)
        y = np.tanh(x).astype(np.float32)
        out = empty((5,), np.float32)
        call("TanhBackward", tensor(g), tensor(y), out)
        close(out.numpy(), g * (1 - y.astype(np.float64) ** 2), np.float32)
    """)


def test_index_driven_ops():
    sim("""
        out = empty((5,), np.float32)
        call("Arange", scalar(1.0), scalar(3.5), scalar(0.5), out)
        assert out.numpy().tolist() == [1.0, 1.5, 2.0, 2.5, 3.0]
        out = empty((4,), np.int64)
        call("Range", scalar(2, np.int64), scalar(8, np.int64), scalar(2, np.int64), out)
        assert out.numpy().tolist() == [2, 4, 6, 8]
        out = empty((5,), np.float32)
        call("Linspace", scalar(-1.0), scalar(1.0), c_int64(5), out)
        close(out.numpy(), np.linspace(-1, 1, 5), np.float32)
        out = empty((3, 4), np.float16)
        call("Eye", c_int64(3), c_int64(4), out)
        assert (out.numpy() == np.eye(3, 4)).all()
        a = rng.standard_normal((2, 3, 4)).astype(np.float32)
        for name, fn in (("Tril", np.tril), ("Triu", np.triu)):
            for k in (-1, 0, 2):
                out = empty((2, 3, 4), np.float32)
                call(name, tensor(a), c_int64(k), out)
                assert (out.numpy() == fn(a, k)).all(), (name, k)
        out = empty((2, 3, 4), np.float32)
        call("Flip", tensor(a), int_array([0, -1]), out)
        assert (out.numpy() == a[::-1, :, ::-1]).all()
        assert phase1_status("Eye", c_int64(4), c_int64(4), out) == 161002
    """)


def test_ternary_ops_and_tensor_bounds():
    sim("""
        a, b, c = (rng.standard_normal((2, 3)).astype(np.float32) for _ in range(3))
        x, y, z = (v.astype(np.float64) for v in (a, b, c))
        out = empty((2, 3), np.float32)
        call("Addcmul", tensor(a), tensor(b), tensor(c), scalar(0.5), out)
        close(out.numpy(), x + 0.5 * y * z, np.float32)
        out = empty((2, 3), np.float32)
        call("Addcdiv", tensor(a), tensor(b), tensor(np.abs(c) + 1), scalar(2.0), out)
        close(out.numpy(), x + 2 * y / (np.abs(z) + 1), np.float32)
        lo = np.full((1, 3), -0.5, np.float32)
        out = empty((2, 3), np.float32)
        call("ClampTensor", tensor(a), tensor(lo), None, out)
        close(out.numpy(), np.maximum(x, -0.5), np.float32)
    """)


def test_cat_and_stack_from_a_tensor_list():
    sim("""
        a = rng.standard_normal((2, 3)).astype(np.float32)
        b = rng.standard_normal((2, 1)).astype(np.float32)
        lst = tensor_list([tensor(a), tensor(b), tensor(a[:, :2])])
        out = empty((2, 6), np.float32)
        call("Cat", lst, c_int64(-1), out)
        ok(nn.aclDestroyTensorList(lst))                    # destroys its tensors too
        assert (out.numpy() == np.concatenate([a, b, a[:, :2]], axis=1)).all()
        out = empty((2, 2, 3), np.float32)
        call("Stack", tensor_list([tensor(a), tensor(2 * a)]), c_int64(1), out)
        assert (out.numpy() == np.stack([a, 2 * a], axis=1)).all()
        assert phase1_status("Cat", tensor_list([tensor(a), tensor(b)]), c_int64(0), out) == 161002
    """)


def test_scans_lerp_and_prelu():
    sim("""
        a = (rng.random((3, 4)) + 0.5).astype(np.float32)
        x = a.astype(np.float64)
        At = T(dev_array(np.ascontiguousarray(a.T)), (3, 4), (1, 3), np.float32)   # strided
        out = empty((3, 4), np.float32)
        assert call("Cumsum", At, c_int64(1), c_int32(0), out) > 0
        close(out.numpy(), np.cumsum(x, axis=1), np.float32)
        out = empty((3, 4), np.float32)
        call("Cumprod", At, scalar(0, np.int64), c_int32(0), out)
        close(out.numpy(), np.cumprod(x, axis=0), np.float32)
        b = rng.standard_normal((3, 4)).astype(np.float32)
        out = empty((3, 4), np.float32)
        call("Lerps", tensor(a), tensor(b), scalar(0.25), out)
        close(out.numpy(), x + 0.25 * (b - x), np.float32)
        img = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)
        w = np.array([0.1, 0.2, 0.3], np.float32)
        out = empty((2, 3, 2, 2), np.float32)
        call("Prelu", tensor(img), tensor(w), out)
        close(out.numpy(), np.where(img > 0, img, w[None, :, None, None] * img), np.float32)
    """)


def test_layer_norm_with_and_without_affine():
    sim("""
        a = rng.standard_normal((2, 3, 4)).astype(np.float32)
        x = a.astype(np.float64)
        w = rng.standard_normal((3, 4)).astype(np.float32)
        b = rng.standard_normal((3, 4)).astype(np.float32)
        mean = x.mean(axis=(1, 2), keepdims=True)
        rstd = 1 / np.sqrt(x.var(axis=(1, 2), keepdims=True) + 1e-5)
        out, m, r = empty((2, 3, 4), np.float32), empty((2, 1, 1), np.float32), empty((2, 1, 1), np.float32)
        assert call("LayerNorm", tensor(a), int_array([3, 4]), tensor(w), tensor(b), ctypes.c_double(1e-5),
                    out, m, r) > 0
        close(out.numpy(), (x - mean) * rstd * w + b, np.float32)
        close(m.numpy(), mean, np.float32)
        close(r.numpy(), rstd, np.float32)
        out = empty((2, 3, 4), np.float32)
        call("LayerNorm", tensor(a), int_array([4]), None, None, ctypes.c_double(1e-5), out, None, None)
        want = (x - x.mean(axis=2, keepdims=True)) / np.sqrt(x.var(axis=2, keepdims=True) + 1e-5)
        close(out.numpy(), want, np.float32)
        assert phase1_status("LayerNorm", tensor(a), int_array([3]), None, None, ctypes.c_double(1e-5),
                             out, None, None) == 161002
    """)


def test_topk_maxdim_mindim_cummax_against_numpy():
    sim("""
        a = rng.integers(-3, 4, (4, 6)).astype(np.float32)      # small integers: ties in every row
        A = T(dev_array(np.ascontiguousarray(a.T)), (4, 6), (1, 4), np.float32)   # a, read transposed
        for k, largest in ((3, True), (2, False), (6, True)):
            values, indices = empty((4, k), np.float32), empty((4, k), np.int64)
            call("Topk", A, c_int64(k), c_int64(-1), c_bool(largest), c_bool(True), values, indices)
            order = np.argsort(-a if largest else a, axis=1, kind="stable")[:, :k]   # ties: lower index first
            assert (indices.numpy() == order).all(), (k, largest)
            assert (values.numpy() == np.take_along_axis(a, order, axis=1)).all()
        for name, pick in (("MaxDim", np.argmax), ("MinDim", np.argmin)):   # the first of equal values
            for keepdim in (False, True):
                shape = (1, 6) if keepdim else (6,)
                out, idx = empty(shape, np.float32), empty(shape, np.int64)
                call(name, A, c_int64(0), c_bool(keepdim), out, idx)
                assert (idx.numpy().reshape(-1) == pick(a, axis=0)).all(), (name, keepdim)
                assert (out.numpy().reshape(-1) == np.take_along_axis(a, pick(a, axis=0)[None], 0)[0]).all()
        values, indices = empty((4, 6), np.float32), empty((4, 6), np.int64)
        call("Cummax", A, c_int64(1), values, indices)
        assert (values.numpy() == np.maximum.accumulate(a, axis=1)).all()
        want = np.array([[max(j for j in range(i + 1) if row[j] == row[:i + 1].max()) for i in range(6)] for row in a])
        assert (indices.numpy() == want).all()                  # ties: the latest index, as torch
        assert phase1_status("Topk", A, c_int64(7), c_int64(1), c_bool(True), c_bool(True),
                             empty((4, 7), np.float32), empty((4, 7), np.int64)) == 161002   # k > the dim
        assert phase1_status("MaxDim", A, c_int64(0), c_bool(False), empty((6,), np.float32), 0) == 161001
    """)


def test_roll_repeat_pad_diag_interleave_isclose_against_numpy():
    sim("""
        a = rng.standard_normal((3, 4)).astype(np.float32)
        A = T(dev_array(np.ascontiguousarray(a.T)), (3, 4), (1, 3), np.float32)   # a, read transposed
        def run(name, shape, *args, dtype=np.float32):
            out = empty(shape, dtype)
            call(name, A, *args, out)
            return out.numpy()
        assert (run("Roll", (3, 4), int_array([1, -3]), int_array([0, 1])) == np.roll(a, (1, -3), (0, 1))).all()
        assert (run("Roll", (3, 4), int_array([5]), int_array([])) == np.roll(a, 5)).all()       # flattened
        assert (run("Repeat", (2, 6, 8), int_array([2, 2, 2])) == np.tile(a, (2, 2, 2))).all()
        # pads from the last dim: (left 1, right 2) on dim 1, (crop 1, right 1) on dim 0
        assert (run("ConstantPadNd", (3, 7), int_array([1, 2, -1, 1]), scalar(0.5))
                == np.pad(a[1:], ((0, 1), (1, 2)), constant_values=0.5)).all()
        for d in (0, 2, -1):
            assert (run("Diag", (np.diag(a, d).size,), c_int64(d)) == np.diag(a, d)).all(), d
        v = a[0]
        V = tensor(v)
        for d in (1, -2):
            out = empty((4 + abs(d),) * 2, np.float32)
            call("Diag", V, c_int64(d), out)
            assert (out.numpy() == np.diag(v, d)).all(), d
        assert (run("RepeatInterleaveIntWithDim", (3, 8), c_int64(2), c_int64(1), c_int64(8))
                == np.repeat(a, 2, axis=1)).all()
        assert (run("RepeatInterleaveInt", (36,), c_int64(3), c_int64(36)) == np.repeat(a, 3)).all()
        assert phase1_status("RepeatInterleaveInt", A, c_int64(3), c_int64(35), empty((36,), np.float32)) == 161002
        assert phase1_status("Repeat", A, int_array([2]), empty((6, 4), np.float32)) == 161002   # fewer than dims
        assert phase1_status("ConstantPadNd", A, int_array([1, 1]), 0, empty((3, 6), np.float32)) == 161001
        x = np.array([1.0, np.nan, np.inf, -np.inf, 2e-3, 5e-4, 5.0], np.float32)
        y = np.array([1.0 + 1e-7, np.nan, np.inf, np.inf, 0.0, 0.0, 5.1], np.float32)
        for equal_nan in (False, True):
            out = empty((7,), np.bool_)
            call("IsClose", tensor(x), tensor(y), ctypes.c_double(1e-5), ctypes.c_double(1e-3), c_bool(equal_nan), out)
            assert (out.numpy() == np.isclose(x, y, rtol=1e-5, atol=1e-3, equal_nan=equal_nan)).all(), equal_nan
    """)


def test_batch_norm_training_and_eval_against_numpy():
    sim("""
        x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
        X = tensor(x)
        w, b = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
        rm0, rv0 = rng.standard_normal(3).astype(np.float32), (rng.random(3) + 0.5).astype(np.float32)
        RM, RV = tensor(rm0), tensor(rv0)
        out, save_mean, save_invstd = empty(x.shape, np.float32), empty((3,), np.float32), empty((3,), np.float32)
        assert call("BatchNorm", X, tensor(w), tensor(b), RM, RV, c_bool(True), ctypes.c_double(0.1),
                    ctypes.c_double(1e-5), out, save_mean, save_invstd) > 0
        xd = x.astype(np.float64)
        mean, var = xd.mean(axis=(0, 2, 3)), xd.var(axis=(0, 2, 3))
        c = lambda v: v[None, :, None, None]   # noqa: E731
        close(out.numpy(), (xd - c(mean)) / np.sqrt(c(var) + 1e-5) * c(w) + c(b), np.float32)
        close(save_mean.numpy(), mean, np.float32)
        close(save_invstd.numpy(), 1 / np.sqrt(var + 1e-5), np.float32)
        close(RM.numpy(), 0.9 * rm0 + 0.1 * mean, np.float32)                  # running stats updated,
        close(RV.numpy(), 0.9 * rv0 + 0.1 * xd.var(axis=(0, 2, 3), ddof=1), np.float32)   # variance unbiased
        rm, rv = RM.numpy().astype(np.float64), RV.numpy().astype(np.float64)
        out = empty(x.shape, np.float32)
        call("BatchNorm", X, 0, 0, RM, RV, c_bool(False), ctypes.c_double(0.1), ctypes.c_double(1e-5), out, 0, 0)
        close(out.numpy(), (xd - c(rm)) / np.sqrt(c(rv) + 1e-5), np.float32)    # eval: the running stats
        assert (RM.numpy() == rm.astype(np.float32)).all()                      # and they stay
        assert phase1_status("BatchNorm", X, 0, 0, 0, 0, c_bool(False), ctypes.c_double(0.1), ctypes.c_double(1e-5),
                             empty(x.shape, np.float32), 0, 0) == 161001          # eval needs running stats
        assert phase1_status("BatchNorm", X, tensor(w[:2]), 0, 0, 0, c_bool(True), ctypes.c_double(0.1),
                             ctypes.c_double(1e-5), empty(x.shape, np.float32), 0, 0) == 161002   # not C long
    """)


def test_random_fills_repeat_per_seed_and_offset_and_have_their_distribution():
    sim("""
        def fill(name, a, b, seed, offset, n=20000):
            t = empty((n,), np.float32)
            arg_type = ctypes.c_float if name == "InplaceNormal" else ctypes.c_double
            call(name, t, arg_type(a), arg_type(b), c_int64(seed), c_int64(offset))
            return t.numpy().astype(np.float64)
        normal = fill("InplaceNormal", 2.0, 3.0, 42, 0)
        assert abs(normal.mean() - 2.0) < 0.1 and abs(normal.std() - 3.0) < 0.1
        assert (fill("InplaceNormal", 2.0, 3.0, 42, 0) == normal).all()        # same seed and offset: same values
        assert (fill("InplaceNormal", 2.0, 3.0, 42, 1) != normal).mean() > 0.99   # a new offset: new values
        assert (fill("InplaceNormal", 2.0, 3.0, 7, 0) != normal).mean() > 0.99
        uniform = fill("InplaceUniform", -1.0, 3.0, 42, 0)
        assert uniform.min() >= -1.0 and uniform.max() < 3.0
        assert abs(uniform.mean() - 1.0) < 0.05
        assert np.histogram(uniform, bins=8, range=(-1, 3))[0].min() > 2000     # flat: 2500 a bin expected
        t = empty((4,), np.float32)
        assert phase1_status("InplaceUniform", t, ctypes.c_double(1.0), ctypes.c_double(0.0), c_int64(0), c_int64(0)) == 161002
    """)


def test_nonzero_masked_select_scatter_against_numpy():
    proc = sim("""
        a = rng.integers(-1, 2, (3, 4)).astype(np.float32)     # about a third zeros
        A = T(dev_array(np.ascontiguousarray(a.T)), (3, 4), (1, 3), np.float32)   # a, read transposed
        out = empty((12, 2), np.int64)
        assert call("Nonzero", A, out) > 0
        want = np.argwhere(a)
        assert (out.numpy()[:len(want)] == want).all()         # the first rows, row-major
        mask = rng.random((1, 4)) > 0.5                        # broadcast over the rows
        out = empty((12,), np.float32)
        call("MaskedSelect", A, tensor(mask), out)
        want = a[np.broadcast_to(mask, a.shape)]
        assert (out.numpy()[:len(want)] == want).all()
        assert phase1_status("Nonzero", A, empty((11, 2), np.int64)) == 161002   # no room for every element
        index = np.array([[0, 2, 1, 2], [1, 0, 0, 2]], np.int64)   # rows of index may repeat a target
        src = rng.standard_normal((2, 4)).astype(np.float32)
        for reduce, op in ((0, None), (1, np.add), (2, np.multiply)):
            out = empty((3, 4), np.float32)
            call("Scatter", A, c_int64(0), tensor(index), tensor(src), c_int64(reduce), out)
            want = a.astype(np.float64).copy()
            for i in range(2):
                for j in range(4):
                    t = index[i, j]
                    want[t, j] = src[i, j] if op is None else op(want[t, j], src[i, j])
            close(out.numpy(), want, np.float32)
        bad = index.copy(); bad[0, 0] = 3
        out = empty((3, 4), np.float32)
        call("Scatter", A, c_int64(0), tensor(bad), tensor(src), c_int64(0), out)
        ok(acl.rt.synchronize_stream(0))
        assert phase1_status("Scatter", A, c_int64(0), tensor(index), tensor(src), c_int64(3), empty((3, 4), np.float32)) == 161002
    """)
    assert "aclnnScatter: 1 index value(s) out of range" in proc.stderr   # written nowhere, reported
