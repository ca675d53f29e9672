"""CUDA launchers of the com.microsoft gradient ops against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels import registry
from gradgen.kernels.registry import MICROSOFT

pytestmark = pytest.mark.cuda

RNG = np.random.default_rng(11)
FLOATS = [np.float16, np.float32, np.float64]
TOL = {np.float16: 2e-2, np.float32: 2e-5, np.float64: 1e-12}


@pytest.fixture(scope="module")
def rt():
    from gradgen.cuda import runtime

    registry.load_cuda_kernels()
    return runtime


def poison(rt, nbytes: int, copies: int = 4) -> None:
    if nbytes > 0:
        blocks = [rt.to_device(np.full(max(1, nbytes // 4), np.nan, np.float32)) for _ in range(copies)]
        del blocks


def entry(op):
    e = registry.lookup(MICROSOFT, op)
    assert e is not None and e.cuda is not None, op
    return e


def upload(rt, a):
    a = np.asarray(a)
    d = rt.to_device(a)
    return d.reshape(a.shape) if d.shape != a.shape else d  # keep 0-d tensors 0-d


def on_device(rt, e, inputs):
    return [None if a is None else (a if i in e.cuda_host_inputs else upload(rt, a)) for i, a in enumerate(inputs)]


def compare(rt, op, inputs, tol=0.0, cuda_attrs=None, **attrs):
    e = entry(op)
    want = np.asarray(e.cpu(*inputs, **attrs))
    poison(rt, want.nbytes)
    got = e.cuda(*on_device(rt, e, inputs), **attrs, **(cuda_attrs or {})).get()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not np.isnan(got).any()
    if tol:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)
    return got


# ---------------------------------------------------------------- SliceGrad

SLICES = [
    ((5, 6), [1, 0], [4, 6], None, None),
    ((5, 6), [-1], [-6], [0], [-1]),
    ((5, 6), [10, -100], [-100, 100], [0, 1], [-2, 3]),
    ((5, 8), [0], [100], [-1], [2]),
    ((5, 6, 7), [4, 2], [1, 5], [2, 0], [-1, 1]),
    ((4, 3), [3], [3], [0], [1]),
    ((0, 3), [0], [5], [0], [-1]),
    ((8, 16), [0, 4], [8, 16], [0, 1], [1, 1]),
    ((4, 64, 32), [16, 0], [48, 32], [1, 2], [1, 2]),
    ((3, 1, 40), [0, 8], [1, 40], [1, 2], [1, 3]),
    ((7,), [6], [-100], [0], [-3]),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", SLICES)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_slice_grad(rt, dtype, case, itype):
    shape, starts, ends, axes, steps = case
    fwd = registry.lookup("", "Slice").cpu
    sl = [np.array(starts, itype), np.array(ends, itype), None if axes is None else np.array(axes, itype),
          None if steps is None else np.array(steps, itype)]
    while sl[-1] is None:
        sl.pop()
    dy = RNG.standard_normal(fwd(np.zeros(shape, dtype), *sl).shape).astype(dtype)
    compare(rt, "SliceGrad", [dy, np.array(shape, np.int64)] + sl)


def test_slice_grad_shape_mismatch(rt):
    with pytest.raises(KernelError):
        entry("SliceGrad").cuda(rt.to_device(np.zeros((3,), np.float32)), np.array([5], np.int64),
                                np.array([0]), np.array([2]))


# ---------------------------------------------------------------- GatherGrad


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("shape,axis,ishape", [((10, 4), 0, (7,)), ((5, 4), 1, (2, 3)), ((3, 6, 8), -2, ()),
                                               ((3, 6, 8), 1, (0,)), ((50, 12), 0, (300,)), ((9,), 0, (3, 5)),
                                               ((6, 40), 0, (5000,)), ((2, 3, 2), -1, (4,))])
def test_gather_grad(rt, dtype, itype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    dims = list(shape)
    ax = axis % len(dims)
    dy = RNG.standard_normal(dims[:ax] + list(ishape) + dims[ax + 1:]).astype(dtype)
    e = entry("GatherGrad")
    args = [np.array(shape, np.int64), idx, dy]
    got = compare(rt, "GatherGrad", args, tol=TOL[dtype] * (10 if ishape == (5000,) else 1), axis=axis)
    again = e.cuda(*on_device(rt, e, args), axis=axis).get()
    np.testing.assert_array_equal(got, again)  # bit-identical


def test_gather_grad_negative_and_positive_alias_same_row(rt):
    # -1 and size-1 are the same row: they must land in one segment.
    idx = np.array([-1, 3, -1, 3, 0], np.int64)
    dy = np.arange(10, dtype=np.float32).reshape(5, 2)
    compare(rt, "GatherGrad", [np.array([4, 2], np.int64), idx, dy], tol=0)


def test_gather_grad_huge_segments_deterministic(rt):
    idx = RNG.integers(-2, 2, size=1 << 20).astype(np.int64)
    dy = RNG.standard_normal(1 << 20).astype(np.float32)
    e = entry("GatherGrad")
    args = [np.array([2], np.int64), idx, dy]
    got = compare(rt, "GatherGrad", args, tol=1e-3)
    for _ in range(2):
        np.testing.assert_array_equal(e.cuda(*on_device(rt, e, args)).get(), got)
    want = np.array([dy[(idx % 2) == k].astype(np.float64).sum() for k in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("shape,axis,count,hot", [((300, 768), 0, 16384, 20), ((300, 24), 0, 32769, 5),
                                                  ((3, 200, 16), 1, 4000, 3), ((1000, 3), 0, 2000, 1),
                                                  ((64, 8), -2, 32768, 64), ((5, 7), 1, 1, 1),
                                                  ((20000, 8), 0, 9000, 2)])
def test_gather_grad_segments(rt, dtype, itype, shape, axis, count, hot):
    # Hot ids give long segments; 32768 positions is the one-launch path's limit (its shared list holds
    # 4096, so 32768 also folds rows in rounds), 32769 takes the CSR path; inner 3 and 24 (float16)
    # take the scalar variant; 20000 rows spread over many blocks.
    size = shape[axis]
    hot_ids = RNG.integers(-size, size, hot)
    idx = np.where(RNG.random(count) < 0.5, RNG.choice(hot_ids, count), RNG.integers(-size, size, count)).astype(itype)
    dims = list(shape)
    ax = axis % len(dims)
    dy = RNG.standard_normal(dims[:ax] + [count] + dims[ax + 1:]).astype(dtype)
    e = entry("GatherGrad")
    args = [np.array(shape, np.int64), idx, dy]
    got = compare(rt, "GatherGrad", args, tol=TOL[dtype] * (20 if dtype != np.float64 else 1), axis=axis)
    for _ in range(2):
        np.testing.assert_array_equal(e.cuda(*on_device(rt, e, args), axis=axis).get(), got)  # bit-identical


@pytest.mark.parametrize("count", [5, 20000, 40000])
def test_gather_grad_out_of_range_both_paths(rt, count):
    e = entry("GatherGrad")
    idx = RNG.integers(-4, 4, count).astype(np.int64)
    idx[count // 2] = 7
    args = [np.array([4, 3], np.int64), idx, np.ones((count, 3), np.float32)]
    with pytest.raises(KernelError) as cpu_error:
        e.cpu(*args)
    with pytest.raises(KernelError) as gpu_error:
        e.cuda(*on_device(rt, e, args))
    assert str(gpu_error.value) == str(cpu_error.value)
    idx[count // 2] = -4  # the next call with good indices must not see a stale flag
    compare(rt, "GatherGrad", [np.array([4, 3], np.int64), idx, np.ones((count, 3), np.float32)], tol=1e-4)


def test_gather_grad_out_of_range_message(rt):
    e = entry("GatherGrad")
    args = [np.array([4, 2], np.int64), np.array([1, -5, 2], np.int64), np.ones((3, 2), np.float32)]
    with pytest.raises(KernelError) as cpu_error:
        e.cpu(*args)
    with pytest.raises(KernelError) as gpu_error:
        e.cuda(*on_device(rt, e, args))
    assert str(gpu_error.value) == str(cpu_error.value)


# ---------------------------------------------------------------- GatherElementsGrad


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("shape,axis,ishape", [((4, 5, 6), 0, (9, 5, 6)), ((4, 5, 6), 1, (3, 12, 2)),
                                               ((4, 5, 6), -1, (4, 5, 20)), ((7,), 0, (30,)),
                                               ((3, 9000), 1, (2, 3000)), ((2, 4), 0, (0, 4)),
                                               ((2, 3), 1, (2, 1))])
def test_gather_elements_grad(rt, deterministic, dtype, itype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    dy = RNG.standard_normal(ishape).astype(dtype)
    args = [dy, np.array(shape, np.int64), idx]
    got = compare(rt, "GatherElementsGrad", args, tol=TOL[dtype], cuda_attrs={"deterministic": deterministic},
                  axis=axis)
    if deterministic:
        e = entry("GatherElementsGrad")
        again = e.cuda(*on_device(rt, e, args), axis=axis, deterministic=True).get()
        np.testing.assert_array_equal(got, again)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape,ishape", [((8, 4096), (8, 1024)), ((2, 3, 64), (2, 3, 200)), ((4, 40), (4, 7))])
def test_gather_elements_grad_last_axis_vectorised(rt, dtype, shape, ishape):
    # axis = last with rows a multiple of 16 bytes: the line is filled and stored with 16-byte words.
    size = shape[-1]
    idx = RNG.integers(-size, size, size=ishape).astype(np.int64)
    dy = RNG.standard_normal(ishape).astype(dtype)
    e = entry("GatherElementsGrad")
    args = [dy, np.array(shape, np.int64), idx]
    got = compare(rt, "GatherElementsGrad", args, tol=TOL[dtype], axis=-1)
    np.testing.assert_array_equal(e.cuda(*on_device(rt, e, args), axis=-1, deterministic=True).get(), got)


def test_gather_elements_grad_error_leaves_no_stale_flag(rt):
    e = entry("GatherElementsGrad")
    good = [np.ones((2, 2), np.float32), np.array([2, 3], np.int64), np.array([[0, 2], [1, 0]], np.int64)]
    bad = [good[0], good[1], np.array([[0, 3], [1, 0]], np.int64)]
    for deterministic in (True, False):
        with pytest.raises(KernelError):
            e.cuda(*on_device(rt, e, bad), axis=1, deterministic=deterministic)
        compare(rt, "GatherElementsGrad", good, tol=1e-6, cuda_attrs={"deterministic": deterministic}, axis=1)


def test_gather_elements_grad_few_targets_deterministic(rt):
    idx = RNG.integers(0, 3, size=(4, 5000)).astype(np.int64)
    dy = RNG.standard_normal((4, 5000)).astype(np.float32)
    e = entry("GatherElementsGrad")
    args = [dy, np.array([4, 3], np.int64), idx]
    first = compare(rt, "GatherElementsGrad", args, tol=1e-4, axis=1)
    np.testing.assert_array_equal(e.cuda(*on_device(rt, e, args), axis=1).get(), first)


def test_gather_elements_grad_out_of_range_message(rt):
    e = entry("GatherElementsGrad")
    args = [np.ones((2, 2), np.float32), np.array([2, 3], np.int64), np.array([[0, 3], [1, 0]], np.int64)]
    with pytest.raises(KernelError) as cpu_error:
        e.cpu(*args, axis=1)
    for deterministic in (True, False):
        with pytest.raises(KernelError) as gpu_error:
            e.cuda(*on_device(rt, e, args), axis=1, deterministic=deterministic)
        assert str(gpu_error.value) == str(cpu_error.value)


# ---------------------------------------------------------------- BroadcastGradientArgs


@pytest.mark.parametrize("a,b", [([2, 16, 1, 1024], [1, 1, 1024, 1024]), ([2, 3, 4, 5], []), ([1, 4, 5], [2, 3, 1, 1])])
def test_broadcast_gradient_args(rt, a, b):
    e = entry("BroadcastGradientArgs")
    assert e.cuda_host_inputs == frozenset({0, 1})
    got = e.cuda(np.array(a, np.int64), np.array(b, np.int64))
    want = e.cpu(np.array(a, np.int64), np.array(b, np.int64))
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, w)
    with pytest.raises(KernelError):
        e.cuda(np.array([3, 4, 5], np.int64), np.array([2, 1, 6, 1], np.int64))


def test_executor_runs_gradient_ops_on_device(rt):
    from onnx import TensorProto, helper

    from gradgen.executor import Session

    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("SliceGrad", ["dy", "s", "st", "en", "ax"], ["dx"], domain=MICROSOFT),
        helper.make_node("GatherGrad", ["s", "idx", "dg"], ["gx"], domain=MICROSOFT, axis=0),
    ]
    inits = [helper.make_tensor("st", TensorProto.INT64, [1], [1]), helper.make_tensor("en", TensorProto.INT64, [1], [3]),
             helper.make_tensor("ax", TensorProto.INT64, [1], [0]),
             helper.make_tensor("idx", TensorProto.INT64, [3], [0, -1, 0])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("x", [4, 3]), ("dy", [2, 3]), ("dg", [3, 3]))],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("gx", TensorProto.FLOAT, [4, 3])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MICROSOFT, 1)])
    feeds = {"x": np.zeros((4, 3), np.float32), "dy": RNG.standard_normal((2, 3)).astype(np.float32),
             "dg": RNG.standard_normal((3, 3)).astype(np.float32)}
    want = Session(model).run(feeds)
    got = Session(model, device="cuda").run(feeds)
    for name in ("dx", "gx"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
