"""CUDA reduction launchers (Reduce*, the column reductions, Softmax, LogSoftmax) against their numpy
CPU kernels, and a graph of reductions, norms and a loss (runs only where a GPU answers)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import KernelError
from gradgen.executor import Session
from tests.cuda.test_cuda_elementwise import check, dev, host, kernels, one_node, poison, same_on_both

pytestmark = pytest.mark.cuda

FLOATS = [np.float16, np.float32, np.float64]
REDUCE_OPS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceL1",
    "ReduceLogSumExp",
    "ReduceProd",
    "ReduceLogSum",
]


def sum_tol(op, dtype, count):
    """Tolerances for reductions of ``count`` elements of O(1) values."""
    eps = {np.dtype(np.float16): 1e-3, np.dtype(np.float32): 1.2e-7, np.dtype(np.float64): 2.3e-16}[np.dtype(dtype)]
    if op in ("ReduceMax", "ReduceMin"):
        return 0.0, 0.0
    if op == "ReduceProd":
        return 8 * eps * max(count, 1), 0.0
    return 8 * eps * max(1.0, np.sqrt(count)) if dtype != np.float16 else 2e-2, 8 * eps * max(count, 1)


def run_reduce(op, x, axes, keepdims=1, noop=0, as_input=True):
    cpu, cuda = kernels(op)
    want = cpu(x, axes, keepdims=keepdims, noop_with_empty_axes=noop)
    poison(np.asarray(want).nbytes)
    axes_arg = None if axes is None else np.asarray(axes, np.int64)
    if as_input:
        got = cuda(dev(x), axes_arg, keepdims=keepdims, noop_with_empty_axes=noop)
    else:
        got = cuda(dev(x), axes=axes, keepdims=keepdims, noop_with_empty_axes=noop)
    return host(got), want


AXES_CASES = [
    ((4, 6, 5, 7), None),
    ((4, 6, 5, 7), [0]),
    ((4, 6, 5, 7), [-1]),
    ((4, 6, 5, 7), [1, 2]),
    ((4, 6, 5, 7), [0, 2]),
    ((4, 6, 5, 7), [1, 3]),
    ((4, 6, 5, 7), [0, 2, 3]),
    ((4, 6, 5, 7), [-4, -2]),
    ((4, 1, 5, 1), [1, 3]),
    ((4, 1, 5, 1), [1]),
    ((1, 1), [0]),
    ((3, 1, 4), [0, 1]),
    ((), None),
    ((5,), [0]),
    ((2, 0, 3), [1]),
    ((2, 0, 3), [0]),
    ((0, 4), [1]),
    ((2, 3, 4, 5, 6), [0, 2, 4]),
]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes", AXES_CASES, ids=str)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_against_cpu(op, shape, axes, keepdims):
    rng = np.random.default_rng(zlib.crc32(repr((op, shape, axes)).encode()))
    lo, hi = {"ReduceLogSum": (0.5, 2.0), "ReduceProd": (0.8, 1.25)}.get(op, (-2.0, 2.0))
    x = rng.uniform(lo, hi, size=shape).astype(np.float32)
    with np.errstate(all="ignore"):
        got, want = run_reduce(op, x, axes, keepdims)
    count = int(np.prod([shape[a] for a in (axes if axes is not None else range(len(shape)))], dtype=np.int64))
    rtol, atol = sum_tol(op, np.float32, count)
    check(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceL2", "ReduceLogSumExp"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_reduce_dtypes(op, dtype):
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, size=(3, 40, 50)).astype(dtype)
    for axes in ([1], [0, 2], [2], None):
        got, want = run_reduce(op, x, axes, 1)
        count = int(np.prod([x.shape[a] for a in (axes or range(3))]))
        rtol, atol = sum_tol(op, dtype, count)
        if dtype == np.float16:
            want = np.asarray(kernels(op)[0](x.astype(np.float64), axes, keepdims=1)).astype(dtype)
            rtol, atol = 2e-3, 2e-3 * np.sqrt(count)
        check(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_reduce_integers(op, dtype):
    rng = np.random.default_rng(2)
    x = rng.integers(-3, 4, size=(6, 5, 40)).astype(dtype)
    for axes in ([1], [0, 2], [2], None, [0]):
        got, want = run_reduce(op, x, axes, 0)
        check(got, want)


def test_reduce_axes_forms_and_noop():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    got, want = run_reduce("ReduceSum", x, [1, -1], 1, as_input=False)  # opset < 13 attribute
    check(got, want, rtol=1e-6, atol=1e-6)
    got, want = run_reduce("ReduceSum", x, [], 1, noop=1)  # nothing reduced: a copy
    check(got, want)
    got, want = run_reduce("ReduceSumSquare", x, None, 0, noop=1)  # elementwise part still applies
    check(got, want, rtol=1e-6)
    got, want = run_reduce("ReduceMean", x, [], 0, noop=0)  # empty axes, noop=0: everything
    check(got, want, rtol=1e-5, atol=1e-6)
    _, cuda = kernels("ReduceSum")
    with pytest.raises(KernelError, match="out of range"):
        cuda(dev(x), np.array([3], np.int64))
    with pytest.raises(KernelError, match="repeated"):
        cuda(dev(x), np.array([1, -2], np.int64))


@pytest.mark.parametrize(
    "shape,axes",
    [
        ((3, 100003), [1]),  # rows, split, odd length (no vector loads)
        ((5, 65536), [1]),  # rows, split, vector loads
        ((100003, 3), [0]),  # cols, split, 3 columns
        ((8192, 768), [0]),  # bias gradient
        ((16, 64, 28, 28), [0, 2, 3]),  # broadcast reduction to (1, C, 1, 1)
        ((7, 300, 40), [0, 2]),
        ((2, 40000, 2, 3), [1, 3]),
    ],
    ids=str,
)
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceLogSumExp"])
def test_large_reductions_split_and_are_deterministic(shape, axes, op):
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, size=shape).astype(np.float32)
    cpu, cuda = kernels(op)
    want = cpu(x.astype(np.float64), np.asarray(axes), keepdims=1).astype(np.float32)
    xd = dev(x)
    first = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    second = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    assert first.tobytes() == second.tobytes()
    count = int(np.prod([shape[a] for a in axes]))
    rtol, atol = sum_tol(op, np.float32, count)
    check(first, want, rtol=rtol, atol=atol)


def test_benchmark_shape_reduction():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 256, 56, 56), dtype=np.float32)
    _, cuda = kernels("ReduceSum")
    got = host(cuda(dev(x), np.array([0, 2, 3], np.int64), keepdims=1))
    want = x.sum(axis=(0, 2, 3), keepdims=True, dtype=np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-3)


def test_reduce_nan_propagates():
    x = np.ones((4, 300), np.float32)
    x[2, 17] = np.nan
    for op in ("ReduceMax", "ReduceMin", "ReduceSum"):
        got, want = run_reduce(op, x, [1], 0)
        check(got, want)


# -- Softmax / LogSoftmax -------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize(
    "shape,axis",
    [
        ((2, 3, 4, 5), -1),
        ((2, 3, 4, 5), 1),
        ((2, 3, 4, 5), 0),
        ((12, 5), 1),
        ((4, 50257), -1),
        ((3, 1024), 1),
        ((7,), 0),
        ((2, 0, 3), 1),
        ((6, 1), -1),
        ((2, 2, 8, 8), -1),
        ((3, 40), -2),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax(op, shape, axis, dtype):
    rng = np.random.default_rng(6)
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    if x.size > 4:
        x.reshape(-1)[3] = -np.inf  # a masked entry
    cpu, cuda = kernels(op)
    want = cpu(x, axis=axis, _opset=13)
    poison(want.nbytes)
    got = host(cuda(dev(x), axis=axis, _opset=13))
    t = {np.dtype(np.float16): 4e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}[np.dtype(dtype)]
    check(got, want, rtol=t, atol=t)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_opset11_coerces_to_2d(op):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    cpu, cuda = kernels(op)
    for axis in (None, 0, 1, 2, -1):
        want = cpu(x, axis=axis, _opset=11)
        got = host(cuda(dev(x), axis=axis, _opset=11))
        check(got, want, rtol=2e-6, atol=2e-6)


# -- through the executor -------------------------------------------------------------------------


def test_graph_with_reductions_norms_and_loss():
    rng = np.random.default_rng(14)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["h"], axis=-1),
        helper.make_node("ReduceSum", ["h", "axes"], ["s"], keepdims=1),
        helper.make_node("Sub", ["h", "s"], ["d"]),
        helper.make_node("ReduceMean", ["d"], ["m"], axes=[2], keepdims=0),
        helper.make_node("Softmax", ["m"], ["p"], axis=-1),
        helper.make_node("Reshape", ["x", "shape2d"], ["x2"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["x2", "labels"], ["loss"], reduction="mean"),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "g"),
        numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "axes"),
        numpy_helper.from_array(np.array([-1, 6], np.int64), "shape2d"),
        numpy_helper.from_array(rng.integers(0, 6, 12).astype(np.int64), "labels"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 6])],
        [
            helper.make_tensor_value_info("p", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, None),
        ],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 4, 6)).astype(np.float32)
    want = Session(model).run({"x": x})
    got = Session(model, device="cuda").run({"x": x})
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# column reductions (innermost axis kept: bias gradients' sums over [rows, C]) with 16-byte loads
# (``colsv``) and without (``cols``), bit-identical from run to run

COLUMN_CASES = [
    ((2048, 768), [0]),  # GPT-2 small's bias gradients: colsv, split over rows
    ((8, 256, 3072), [0, 1]),  # the same as the rule emits it (leading axes merged)
    ((8, 768 * 64), [0]),  # few rows, many columns: no split
    ((6, 40, 3, 64), [0, 2]),  # two reduced groups (strided offsets), an outer kept axis
    ((3, 500, 12), [1]),  # outer kept axis, C = 12
    ((1000, 6), [0]),  # C not a multiple of 4: cols (float32), colsv (float64)
    ((999, 7), [0]),  # odd C: cols
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axes", COLUMN_CASES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_column_reductions(op, shape, axes, dtype):
    rng = np.random.default_rng(7)
    lo, hi = {"ReduceLogSum": (0.5, 2.0), "ReduceProd": (0.99, 1.01)}.get(op, (-2.0, 2.0))
    x = rng.uniform(lo, hi, size=shape).astype(dtype)
    cpu, cuda = kernels(op)
    want = cpu(x.astype(np.float64), np.asarray(axes), keepdims=1).astype(dtype)
    xd = dev(x)
    first = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    second = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    assert first.tobytes() == second.tobytes()
    count = int(np.prod([shape[a] for a in axes]))
    rtol, atol = sum_tol(op, dtype, count)
    check(first, want, rtol=rtol, atol=atol)


def test_misaligned_input_takes_the_scalar_kernel():
    """A view starting 4 bytes into its buffer cannot use 16-byte loads: same sums all the same."""
    rng = np.random.default_rng(8)
    x = rng.uniform(-1, 1, size=(257 * 512 + 1,)).astype(np.float32)
    cpu, cuda = kernels("ReduceSum")
    view = dev(x)[1:].reshape(257, 512)
    want = cpu(x[1:].reshape(257, 512).astype(np.float64), np.asarray([0]), keepdims=0).astype(np.float32)
    got = host(cuda(view, np.asarray([0], np.int64), keepdims=0))
    rtol, atol = sum_tol("ReduceSum", np.float32, 257)
    check(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
@pytest.mark.parametrize("shape,axis", [((5, 7, 3), 1), ((5, 7, 3), -1), ((4,), 0), ((0, 3), 1), ((3, 1, 2), 1)])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(dtype, shape, axis, exclusive, reverse):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    model = one_node("CumSum", {"x": x}, {"axis": np.array(axis, np.int64)}, {"exclusive": exclusive, "reverse": reverse})
    same_on_both(model, {"x": x}, rtol=1e-5)


# -- SoftmaxGrad_13 / LogSoftmaxGrad_13 (com.microsoft, the gradients gradgen emits) ---------------


@pytest.mark.parametrize("op", ["SoftmaxGrad_13", "LogSoftmaxGrad_13"])
@pytest.mark.parametrize("shape,axis", [((64, 256), -1), ((6, 1000), 1), ((3, 50257), -1), ((2, 5, 3), 1), ((4, 7), 0)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_softmax_grads(op, shape, axis, dtype):
    from gradgen.kernels import registry

    registry.load_cuda_kernels()
    entry = registry.lookup("com.microsoft", op)
    rng = np.random.default_rng(21)
    x = rng.standard_normal(shape)
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    y = (np.log(y) if op.startswith("Log") else y).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    want = np.asarray(entry.cpu(dy, y, axis=axis))
    got = host(entry.cuda(dev(dy), dev(y), axis=axis))
    t = {np.float16: 2e-2, np.float32: 2e-5, np.float64: 1e-12}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=t, atol=t * max(1.0, float(np.abs(want).max()))
    )


@pytest.mark.parametrize(
    "shape,axes",
    [((4096, 768), (0,)), ((3, 2048, 256), (1,)), ((8, 256, 3072), (0, 1)), ((4, 1 << 20), (1,)), ((64, 8), (0,))],
    ids=str,
)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "log_sum_exp"])
def test_split_reductions_combine_their_partial_states_in_order(shape, axes, op):
    """Reductions split over the rows (column sums) or along the row (long rows): the partial states
    stored split-major and combined in split order by fin_, the same bits launch after launch."""
    from gradgen.kernels.cuda import reduction

    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    xd = dev(x)
    runs = [host(reduction.reduce(op, xd, axes, False)) for _ in range(3)]
    for later in runs[1:]:
        np.testing.assert_array_equal(later, runs[0])
    x64 = x.astype(np.float64)
    want = {
        "sum": lambda: x64.sum(axis=axes),
        "mean": lambda: x64.mean(axis=axes),
        "max": lambda: x64.max(axis=axes),
        "log_sum_exp": lambda: np.log(np.exp(x64).sum(axis=axes)),
    }[op]()
    np.testing.assert_allclose(runs[0], want, rtol=1e-4, atol=2e-3)
