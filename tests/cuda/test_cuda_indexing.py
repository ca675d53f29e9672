"""CUDA indexing launchers (Gather*, Scatter* and the com.microsoft GatherGrad, GatherElementsGrad)
against their numpy CPU kernels, and the com.microsoft gradient ops in a graph on the GPU executor
(runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels import registry
from gradgen.kernels.registry import MICROSOFT
from tests.cuda.test_cuda_elementwise import FLOATS
from tests.cuda.test_cuda_shape import RNG, check, compare, entry, on_device, rand, run

pytestmark = pytest.mark.cuda

TOL = {np.float16: 2e-2, np.float32: 2e-5, np.float64: 1e-12}


# ---------------------------------------------------------------- Gather*, Scatter*


@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
@pytest.mark.parametrize(
    "shape,axis,ishape",
    [((5, 4), 0, (7,)), ((5, 4), 1, (2, 3)), ((3, 6, 8), -2, ()), ((3, 6, 8), 1, (0,)), ((10, 12), 0, (4,)), ((7,), 0, (3, 2))],
)
def test_gather(rt, itype, dtype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    check(rt, "Gather", [rand(shape, dtype), idx], axis=axis)


def test_gather_out_of_range_matches_cpu_message(rt):
    x = rand((5, 3))
    idx = np.array([0, 4, -6, 5], np.int64)
    entry = registry.lookup("", "Gather")
    with pytest.raises(KernelError) as cpu_error:
        entry.cpu(x, idx)
    with pytest.raises(KernelError) as gpu_error:
        entry.cuda(rt.to_device(x), rt.to_device(idx))
    assert str(gpu_error.value) == str(cpu_error.value)


@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(rt, itype, axis):
    x = rand((4, 5, 6))
    ishape = [3, 4, 6]
    ishape[axis] = 9
    idx = RNG.integers(-x.shape[axis], x.shape[axis], size=ishape).astype(itype)
    check(rt, "GatherElements", [x, idx], axis=axis)


@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_gather_nd(rt, itype):
    x = rand((4, 5, 6))
    idx = np.stack([RNG.integers(-4, 4, 7), RNG.integers(-5, 5, 7)], axis=-1).astype(itype)
    check(rt, "GatherND", [x, idx])
    check(rt, "GatherND", [x, idx[:, :1].reshape(7, 1)])
    bidx = RNG.integers(-5, 5, size=(4, 3, 1)).astype(itype)
    check(rt, "GatherND", [x, bidx], batch_dims=1)
    with pytest.raises(KernelError):
        registry.lookup("", "GatherND").cuda(rt.to_device(x), rt.to_device(np.array([[4, 0]], itype)))


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scatter_elements(rt, reduction, axis, dtype):
    data = rand((6, 5), dtype)
    ishape = [4, 5] if axis == 0 else [6, 9]
    idx = RNG.integers(-data.shape[axis], data.shape[axis], size=ishape).astype(np.int64)
    upd = rand(ishape, dtype)
    got, want = run(rt, "ScatterElements", [data, idx, upd], axis=axis, reduction=reduction)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "add", "mul"])
@pytest.mark.parametrize("k", [1, 2, 0])
def test_scatter_nd(rt, reduction, k):
    data = rand((5, 4, 3))
    count = 12
    idx = (
        np.stack([RNG.integers(-d, d, count) for d in data.shape[:k]], axis=-1).astype(np.int64)
        if k
        else np.zeros((count, 0), np.int64)
    )
    upd = rand((count,) + data.shape[k:])
    got, want = run(rt, "ScatterND", [data, idx, upd], reduction=reduction)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_scatter_nd_many_repeats_deterministic(rt):
    data = rand((3, 8))
    idx = RNG.integers(0, 3, size=(5000, 1)).astype(np.int64)
    upd = rand((5000, 8))
    entry = registry.lookup("", "ScatterND")
    first = entry.cuda(rt.to_device(data), rt.to_device(idx), rt.to_device(upd), reduction="add").get()
    second = entry.cuda(rt.to_device(data), rt.to_device(idx), rt.to_device(upd), reduction="add").get()
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, entry.cpu(data, idx, upd, reduction="add"), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- GatherGrad


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize(
    "shape,axis,ishape",
    [
        ((10, 4), 0, (7,)),
        ((5, 4), 1, (2, 3)),
        ((3, 6, 8), -2, ()),
        ((3, 6, 8), 1, (0,)),
        ((50, 12), 0, (300,)),
        ((9,), 0, (3, 5)),
        ((6, 40), 0, (5000,)),
        ((2, 3, 2), -1, (4,)),
    ],
)
def test_gather_grad(rt, dtype, itype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    dims = list(shape)
    ax = axis % len(dims)
    dy = RNG.standard_normal(dims[:ax] + list(ishape) + dims[ax + 1 :]).astype(dtype)
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
@pytest.mark.parametrize(
    "shape,axis,count,hot",
    [
        ((300, 768), 0, 16384, 20),
        ((300, 24), 0, 32769, 5),
        ((3, 200, 16), 1, 4000, 3),
        ((1000, 3), 0, 2000, 1),
        ((64, 8), -2, 32768, 64),
        ((5, 7), 1, 1, 1),
        ((20000, 8), 0, 9000, 2),
    ],
)
def test_gather_grad_segments(rt, dtype, itype, shape, axis, count, hot):
    # Hot ids give long segments; 32768 positions is the one-launch path's limit (its shared list holds
    # 4096, so 32768 also folds rows in rounds), 32769 takes the CSR path; inner 3 and 24 (float16)
    # take the scalar variant; 20000 rows spread over many blocks.
    size = shape[axis]
    hot_ids = RNG.integers(-size, size, hot)
    idx = np.where(RNG.random(count) < 0.5, RNG.choice(hot_ids, count), RNG.integers(-size, size, count)).astype(itype)
    dims = list(shape)
    ax = axis % len(dims)
    dy = RNG.standard_normal(dims[:ax] + [count] + dims[ax + 1 :]).astype(dtype)
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
@pytest.mark.parametrize(
    "shape,axis,ishape",
    [
        ((4, 5, 6), 0, (9, 5, 6)),
        ((4, 5, 6), 1, (3, 12, 2)),
        ((4, 5, 6), -1, (4, 5, 20)),
        ((7,), 0, (30,)),
        ((3, 9000), 1, (2, 3000)),
        ((2, 4), 0, (0, 4)),
        ((2, 3), 1, (2, 1)),
    ],
)
def test_gather_elements_grad(rt, deterministic, dtype, itype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    dy = RNG.standard_normal(ishape).astype(dtype)
    args = [dy, np.array(shape, np.int64), idx]
    got = compare(rt, "GatherElementsGrad", args, tol=TOL[dtype], cuda_attrs={"deterministic": deterministic}, axis=axis)
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


def test_executor_runs_gradient_ops_on_device(rt):
    from onnx import TensorProto, helper

    from gradgen.executor import Session

    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("SliceGrad", ["dy", "s", "st", "en", "ax"], ["dx"], domain=MICROSOFT),
        helper.make_node("GatherGrad", ["s", "idx", "dg"], ["gx"], domain=MICROSOFT, axis=0),
    ]
    inits = [
        helper.make_tensor("st", TensorProto.INT64, [1], [1]),
        helper.make_tensor("en", TensorProto.INT64, [1], [3]),
        helper.make_tensor("ax", TensorProto.INT64, [1], [0]),
        helper.make_tensor("idx", TensorProto.INT64, [3], [0, -1, 0]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (("x", [4, 3]), ("dy", [2, 3]), ("dg", [3, 3]))],
        [
            helper.make_tensor_value_info("dx", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("gx", TensorProto.FLOAT, [4, 3]),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MICROSOFT, 1)])
    feeds = {
        "x": np.zeros((4, 3), np.float32),
        "dy": RNG.standard_normal((2, 3)).astype(np.float32),
        "dg": RNG.standard_normal((3, 3)).astype(np.float32),
    }
    want = Session(model).run(feeds)
    got = Session(model, device="cuda").run(feeds)
    for name in ("dx", "gx"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
