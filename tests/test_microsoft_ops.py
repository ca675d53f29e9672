"""The com.microsoft gradient ops: CPU kernels against CASES.md, torch autograd and numpy references.

Covers SliceGrad, GatherGrad, GatherElementsGrad, ConvGrad and BroadcastGradientArgs: the fixed
cases and expected values of the design notes, random cases against independent references
(torch float64 autograd, the ONNX reference Slice, numpy broadcasting), the must-fail cases,
determinism with repeated indices, index and float dtypes, and one-node models through the executor.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import KernelError, ModelError
from gradgen.executor import Session
from gradgen.kernels import registry
from gradgen.ops import schemas

torch = pytest.importorskip("torch")
F = torch.nn.functional

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min
MS = "com.microsoft"


def kernel(op_type):
    entry = registry.lookup(MS, op_type)
    assert entry is not None and entry.cpu is not None, op_type
    return entry.cpu


def i64(values):
    return np.array(values, dtype=np.int64)


def torch_grad(fn, inputs, dy):
    """Gradients of fn(*inputs) w.r.t. every input, for output gradient dy (float64 torch autograd)."""
    ts = [torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True) for x in inputs]
    y = fn(*ts)
    assert tuple(y.shape) == tuple(dy.shape), (tuple(y.shape), dy.shape)
    y.backward(torch.tensor(np.asarray(dy, dtype=np.float64)))
    return [t.grad.numpy() for t in ts]


def assert_close(got, want, dtype):
    tol = {np.float16: (5e-3, 1e-3), np.float32: (1e-5, 1e-5), np.float64: (1e-12, 1e-12)}[np.dtype(dtype).type]
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want, atol=tol[0] * max(1.0, np.abs(want).max(initial=0)), rtol=tol[1])


# ====================================================================== BroadcastGradientArgs

BGA_CASES = [
    ([2, 16, 1024, 1024], [1, 1, 1024, 1024], [], [1, 0]),
    ([2, 16, 1, 1024], [1, 1, 1024, 1024], [2], [1, 0]),
    ([2, 3, 4, 5], [2, 3, 4, 5], [], []),
    ([2, 3, 4, 5], [], [], [3, 2, 1, 0]),
    ([2, 3, 4, 5], [5], [], [2, 1, 0]),
    ([4, 5], [2, 3, 4, 5], [1, 0], []),
    ([1, 4, 5], [2, 3, 1, 1], [1, 0], [3, 2]),
    ([3, 4, 5], [2, 1, 1, 1], [0], [3, 2, 1]),
]


@pytest.mark.parametrize("a,b,a_axes,b_axes", BGA_CASES)
def test_broadcast_gradient_args_cases(a, b, a_axes, b_axes):
    got_a, got_b = kernel("BroadcastGradientArgs")(i64(a), i64(b))
    assert got_a.dtype == np.int64 and got_b.dtype == np.int64
    assert got_a.shape == (len(a_axes),) and got_b.shape == (len(b_axes),)
    assert got_a.tolist() == a_axes and got_b.tolist() == b_axes


def test_broadcast_gradient_args_not_possible():
    with pytest.raises(KernelError, match=r"broadcast is not possible.*\[3, 4, 5\].*\[2, 1, 6, 1\]"):
        kernel("BroadcastGradientArgs")(i64([3, 4, 5]), i64([2, 1, 6, 1]))


def _reference_axes(a, b):
    """Independent reference: numpy's broadcast shape; an operand is reduced over an output axis it
    lacks, or where its dim is 1 and the result's is not (axes in descending order)."""
    out = np.broadcast_shapes(tuple(a), tuple(b))

    def axes(s):
        lead = len(out) - len(s)
        return [k for k in reversed(range(len(out))) if k < lead or (s[k - lead] == 1 and out[k] != 1)]

    return axes(a), axes(b)


def test_broadcast_gradient_args_random_against_numpy():
    rng = np.random.default_rng(7)
    fn = kernel("BroadcastGradientArgs")
    for _ in range(300):
        out = rng.integers(0, 4, size=rng.integers(0, 6)).tolist()

        def operand():
            s = out[len(out) - rng.integers(0, len(out) + 1) :]
            return [1 if rng.random() < 0.4 else d for d in s]

        a, b = operand(), operand()
        if rng.random() < 0.2 and a:  # sometimes break broadcasting
            a[rng.integers(0, len(a))] = 7
        try:
            want = _reference_axes(a, b)
        except ValueError:
            with pytest.raises(KernelError, match="broadcast is not possible"):
                fn(i64(a), i64(b))
            continue
        got = fn(i64(a), i64(b))
        assert (got[0].tolist(), got[1].tolist()) == want, (a, b)
        # the axes undo the broadcast: summing over them and reshaping gives each operand's shape
        dy = np.ones(np.broadcast_shapes(tuple(a), tuple(b)))
        for shape, ax in zip((a, b), got):
            assert dy.sum(axis=tuple(ax.tolist()), keepdims=True).reshape(shape).shape == tuple(shape)


# ====================================================================== SliceGrad

SLICE_CASES = [  # dY, shape, starts, ends, axes, steps, flattened dX
    ([5, 7], [2, 4], [1, 0], [2, 3], [0, 1], [1, 2], [0, 0, 0, 0, 5, 0, 7, 0]),
    (np.arange(1, 9).reshape(2, 4), [2, 4], [0, 0], [2, 4], [0, 1], [1, 1], list(range(1, 9))),
    (np.arange(1, 5).reshape(1, 1, 2, 2), [2, 2, 2, 2], [1, 1], [0, 2], [0, 1], [-1, 1], [0] * 12 + [1, 2, 3, 4]),
    (
        np.arange(1, 9).reshape(1, 2, 1, 2, 2),
        [1, 2, 2, 2, 2],
        [1],
        [INT64_MAX],
        [2],
        [1],
        [0, 0, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 5, 6, 7, 8],
    ),
    (
        np.arange(1, 5).reshape(1, 1, 2, 1, 2),
        [1, 2, 2, 2, 2],
        [1, 1],
        [INT64_MAX, 2],
        [1, 3],
        [1, 1],
        [0] * 10 + [1, 2, 0, 0, 3, 4],
    ),
    ([[[1]]], [1, 1, 1], [0], [INT64_MAX], [1], [1], [1]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", SLICE_CASES, ids=[f"case{i}" for i in range(len(SLICE_CASES))])
def test_slice_grad_cases(case, dtype):
    dy, shape, starts, ends, axes, steps, want = case
    dx = kernel("SliceGrad")(np.asarray(dy, dtype), i64(shape), i64(starts), i64(ends), i64(axes), i64(steps))
    assert dx.dtype == np.dtype(dtype) and dx.shape == tuple(shape)
    assert dx.reshape(-1).tolist() == want


def test_slice_grad_optional_inputs_and_int32():
    fn = kernel("SliceGrad")
    dy = np.arange(1.0, 4.0).reshape(1, 3)
    a = fn(dy, i64([2, 3]), np.array([1], np.int32), np.array([2], np.int32))  # axes, steps omitted
    b = fn(dy, i64([2, 3]), i64([1, 0]), i64([2, 3]), None, None)
    assert a.tolist() == b.tolist() == [[0, 0, 0], [1, 2, 3]]


def _onnx_slice_index_map(shape, starts, ends, axes, steps):
    """Which flat element of the data each output element of ONNX Slice reads (reference evaluator)."""
    from onnx.reference import ReferenceEvaluator

    names = ["data", "starts", "ends", "axes", "steps"]
    node = helper.make_node("Slice", names, ["y"])
    graph = helper.make_graph(
        [node],
        "s",
        [helper.make_tensor_value_info("data", TensorProto.INT64, None)],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in zip(names[1:], (starts, ends, axes, steps))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ReferenceEvaluator(model).run(None, {"data": np.arange(math.prod(shape), dtype=np.int64).reshape(shape)})[0]


def _random_slice(rng):
    rank = int(rng.integers(1, 5))
    shape = [int(d) for d in rng.integers(1, 7, size=rank)]
    axes = [int(a) for a in rng.permutation(rank)[: rng.integers(1, rank + 1)]]
    starts, ends, steps = [], [], []
    for a in axes:
        d = shape[a]
        step = int(rng.choice([-3, -2, -1, 1, 2, 3]))
        # (onnx.reference's Slice leaves a start below -d empty for a negative step, where the spec
        # clamps it to 0; that corner is covered by test_slice_grad_clamping instead)
        starts.append(int(rng.integers(-d - 2 if step > 0 else -d, d + 3)))
        r = rng.random()
        ends.append(INT64_MAX if r < 0.15 else INT64_MIN if r < 0.3 else int(rng.integers(-d - 2, d + 3)))
        steps.append(step)
    axes = [a - rank if rng.random() < 0.3 else a for a in axes]  # negative axes too
    return shape, i64(starts), i64(ends), i64(axes), i64(steps)


def test_slice_grad_random_against_torch_and_onnx_reference():
    rng = np.random.default_rng(1)
    fn = kernel("SliceGrad")
    for _ in range(60):
        shape, starts, ends, axes, steps = _random_slice(rng)
        index_map = _onnx_slice_index_map(shape, starts, ends, axes, steps)
        dy = rng.standard_normal(index_map.shape)
        picks = torch.tensor(index_map.reshape(-1).copy()).reshape(index_map.shape)
        (want,) = torch_grad(lambda x: x.reshape(-1)[picks], [np.zeros(shape)], dy)
        got = fn(dy, i64(shape), starts, ends, axes, steps)
        np.testing.assert_array_equal(got, want)
        bounds = np.concatenate([starts, ends])
        if np.all((bounds >= np.iinfo(np.int32).min) & (bounds <= np.iinfo(np.int32).max)):
            got32 = fn(dy, i64(shape), *(v.astype(np.int32) for v in (starts, ends, axes, steps)))
            np.testing.assert_array_equal(got32, want)


@pytest.mark.parametrize(
    "shape,start,end,step,want",
    [
        ([5], -9, INT64_MIN, -2, [1, 0, 0, 0, 0]),  # start < -d clamps to 0 for a negative step
        ([5], 9, INT64_MIN, -2, [3, 0, 2, 0, 1]),  # start >= d clamps to d-1
        ([5], -9, INT64_MAX, 2, [1, 0, 2, 0, 3]),
        ([5], 3, -7, -1, [4, 3, 2, 1, 0]),  # end < -d: down to index 0 included
        ([5], -2, 1, -1, [0, 0, 2, 1, 0]),
        ([5], 9, -9, 1, [0, 0, 0, 0, 0]),  # empty slice
    ],
)
def test_slice_grad_clamping(shape, start, end, step, want):
    count = sum(1 for v in want if v)
    dy = np.arange(1.0, count + 1)
    dx = kernel("SliceGrad")(dy, i64(shape), i64([start]), i64([end]), i64([0]), i64([step]))
    assert dx.tolist() == want


@pytest.mark.parametrize(
    "args,match",
    [
        ((np.ones((2,)), i64([2, 4]), i64([0]), i64([2]), i64([1])), r"dY has shape \[2\].*\[2, 4\].*\[2, 2\]"),
        ((np.ones((1,)), i64([4]), i64([0]), i64([2]), None, i64([0])), "steps value for axis 0 is 0"),
        ((np.ones((1,)), i64([4]), i64([0]), i64([2]), i64([1])), r"axes value 1 is out of range for rank 1"),
        ((np.ones((1, 1)), i64([4, 4]), i64([0, 0]), i64([1, 1]), i64([0, -2])), "repeats an axis"),
    ],
)
def test_slice_grad_must_fail(args, match):
    with pytest.raises(KernelError, match=match):
        kernel("SliceGrad")(*args)


# ====================================================================== GatherGrad

GATHER_CASES = [  # shape, indices, dY, axis, dX
    ([3, 3], [[0, 1], [0, 1]], np.tile(np.arange(6.0), 2).reshape(2, 2, 3), 0, [[0, 2, 4], [6, 8, 10], [0, 0, 0]]),
    ([3, 3], [[0, -1], [0, -2]], np.tile(np.arange(6.0), 2).reshape(2, 2, 3), 0, [[0, 2, 4], [3, 4, 5], [3, 4, 5]]),
    ([3, 2], [2, -1, 0], np.ones((3, 2)), 0, [[1, 1], [0, 0], [2, 2]]),  # -1 and 2 alias the same row
    ([2, 3], 1, np.array([4.0, 5.0]), -1, [[0, 4, 0], [0, 5, 0]]),  # scalar index, negative axis
]


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("case", GATHER_CASES, ids=[f"case{i}" for i in range(len(GATHER_CASES))])
def test_gather_grad_cases(case, dtype, index_dtype):
    shape, indices, dy, axis, want = case
    dx = kernel("GatherGrad")(i64(shape), np.array(indices, index_dtype), np.asarray(dy, dtype), axis=axis)
    assert dx.dtype == np.dtype(dtype)
    assert dx.tolist() == want


def _gather_reference(shape, indices, axis, dy):
    idx = np.where(indices < 0, indices + shape[axis], indices).astype(np.int64)

    def gather(x):
        return x.index_select(axis, torch.tensor(idx.reshape(-1))).reshape(dy.shape)

    return torch_grad(gather, [np.zeros(shape)], dy)[0]


GATHER_RANDOM = [  # shape, indices shape, axis
    ((3, 4), (6, 128), 1),
    ((3, 4), (6, 128), 0),
    ((2, 32), (6, 128), 0),
    ((4, 5, 6), (3, 2), -2),
    ((4, 5, 6), (7,), 2),
    ((5,), (2, 3, 4), 0),
    ((3, 0, 2), (4,), 0),
    ((3, 4), (0, 2), 1),
]


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape,ishape,axis", GATHER_RANDOM)
def test_gather_grad_random_against_torch(shape, ishape, axis, index_dtype):
    rng = np.random.default_rng(abs(hash((shape, ishape, axis))) % 2**32)
    s = shape[axis]
    indices = rng.integers(-s, s, size=ishape).astype(index_dtype)
    a = axis % len(shape)
    dy = rng.standard_normal(shape[:a] + ishape + shape[a + 1 :])
    want = _gather_reference(shape, indices, a, dy)
    got = kernel("GatherGrad")(i64(shape), indices, dy, axis=axis)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    for dtype in (np.float32, np.float16):
        assert_close(
            kernel("GatherGrad")(i64(shape), indices, dy.astype(dtype), axis=axis),
            _gather_reference(shape, indices, a, dy.astype(dtype).astype(np.float64)),
            dtype,
        )


def test_gather_grad_negative_indices_alias_bit_exactly():
    rng = np.random.default_rng(3)
    indices = rng.integers(-5, 5, size=(1000,))
    dy = rng.standard_normal((3, 1000, 2)).astype(np.float32)
    fn = kernel("GatherGrad")
    a = fn(i64([3, 5, 2]), indices, dy, axis=1)
    b = fn(i64([3, 5, 2]), np.where(indices < 0, indices + 5, indices), dy, axis=1)
    assert a.tobytes() == b.tobytes()


def test_gather_grad_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dy = np.ones((4, 3), ml_dtypes.bfloat16)
    dx = kernel("GatherGrad")(i64([2, 3]), i64([0, 1, -1, 1]), dy)
    assert dx.dtype == ml_dtypes.bfloat16 and dx.astype(np.float32).tolist() == [[1, 1, 1], [3, 3, 3]]


@pytest.mark.parametrize("index", [3, -4, 100])
def test_gather_grad_out_of_range(index):
    with pytest.raises(KernelError, match=rf"index {index} .*axis 0 of size 3 \(valid range \[-3, 2\]\)"):
        kernel("GatherGrad")(i64([3, 2]), i64([0, index]), np.ones((2, 2)))


def test_gather_grad_dy_shape_mismatch():
    with pytest.raises(KernelError, match=r"dY has shape \[2, 3\].*gives \[2, 2\]"):
        kernel("GatherGrad")(i64([3, 2]), i64([0, 1]), np.ones((2, 3)))


DETERMINISM = [  # shape, indices size, axis, distinct index values (None: all)
    ((262144,), 1048576, 0, None),
    ((2,), 1048576, 0, None),
    ((8, 32, 49, 48), 4, 0, 2),  # few indices, wide rows (CASES: (8,256,196,192), scaled down)
    ((100, 64), 50000, 0, 7),  # many repeats of a few hot rows
]


@pytest.mark.parametrize("shape,count,axis,distinct", DETERMINISM)
def test_gather_grad_deterministic(shape, count, axis, distinct):
    rng = np.random.default_rng(11)
    s = shape[axis]
    pool = np.arange(-s, s) if distinct is None else rng.integers(-s, s, size=distinct)
    indices = rng.choice(pool, size=count)
    dy = rng.standard_normal(shape[:axis] + (count,) + shape[axis + 1 :]).astype(np.float32)
    fn = kernel("GatherGrad")
    first = fn(i64(shape), indices, dy, axis=axis)
    second = fn(i64(shape), indices.copy(), dy.copy(), axis=axis)
    assert first.tobytes() == second.tobytes()
    if count * math.prod(shape[1:]) <= 10**6:  # check the sums too, where a float64 reference is cheap
        want = np.zeros(shape)
        np.add.at(want, np.where(indices < 0, indices + s, indices), dy.astype(np.float64))
        np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-3)


# ====================================================================== GatherElementsGrad

GATHER_ELEMENTS_RANDOM = [  # data shape, indices shape, axis, index dtype
    ((2, 3), (1, 2), None, np.int32),
    ((2, 2), (2, 2), 1, np.int32),
    ((2, 2), (2, 2), -1, np.int64),
    ((2, 2, 2), (1, 2, 1), 1, np.int32),
    ((2, 2, 2), (1, 2, 1), 2, np.int64),
    ((3, 3), (3, 2), 1, np.int32),
    ((3,), (2,), 0, np.int32),
    ((2, 2, 2), (3, 2, 2), 0, np.int64),
    ((2, 2, 2, 3), (3, 2, 2, 2), 0, np.int32),
    ((2, 2, 3, 3, 2), (2, 2, 3, 2, 2), 0, np.int64),
    ((2, 3, 2), (2, 3, 2), -2, np.int64),
    ((2, 2, 2), (2, 2, 3), 2, np.int64),
    ((2, 1, 2, 3, 1, 2), (2, 1, 2, 2, 1, 2), 5, np.int64),
    ((2, 1, 2, 2, 3, 2, 2), (2, 1, 2, 3, 2, 2, 2), 3, np.int32),
    ((2, 1, 1, 2, 3, 2, 3), (2, 1, 1, 2, 3, 2, 2), -5, np.int64),
]


def _gather_elements_reference(shape, indices, axis, dy):
    idx = np.where(indices < 0, indices + shape[axis], indices).astype(np.int64)
    return torch_grad(lambda x: torch.gather(x, axis, torch.tensor(idx)), [np.zeros(shape)], dy)[0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape,ishape,axis,index_dtype", GATHER_ELEMENTS_RANDOM)
def test_gather_elements_grad_cases_against_torch(shape, ishape, axis, index_dtype, dtype):
    rng = np.random.default_rng(abs(hash((shape, ishape, axis))) % 2**32)
    a = (axis or 0) % len(shape)
    indices = rng.integers(-shape[a], shape[a], size=ishape).astype(index_dtype)
    fn = kernel("GatherElementsGrad")
    kwargs = {} if axis is None else {"axis": axis}
    for dy in (np.ones(ishape), rng.standard_normal(ishape)):  # CASES uses ones; random too
        dy = dy.astype(dtype)
        got = fn(dy, i64(shape), indices, **kwargs)
        assert_close(got, _gather_elements_reference(shape, indices, a, dy.astype(np.float64)), dtype)


@pytest.mark.parametrize(
    "shape,indices,axis,want",
    [
        ([3, 3], [[1, 2, 0], [2, 0, 0]], 0, [[0, 1, 2], [1, 0, 0], [1, 1, 0]]),
        ([2, 3], [[1, 1, 1], [1, 1, 1]], 1, [[0, 3, 0], [0, 3, 0]]),
        ([2, 2], [[0, 1, 1, 0], [1, 1, -1, 0]], 1, [[2, 2], [1, 3]]),  # indices longer than data on the axis
    ],
)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_gather_elements_grad_fixed_values(shape, indices, axis, want, index_dtype):
    indices = np.array(indices, index_dtype)
    dx = kernel("GatherElementsGrad")(np.ones(indices.shape, np.float32), i64(shape), indices, axis=axis)
    assert dx.dtype == np.float32 and dx.tolist() == want


def test_gather_elements_grad_dy_shape_must_match_indices():
    with pytest.raises(KernelError, match=r"dY has shape \[1, 2\], but indices have shape \[1, 3\]"):
        kernel("GatherElementsGrad")(np.ones((1, 2)), i64([2, 3]), i64([[0, 1, 1]]))


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((np.ones((1, 2)), i64([2, 3]), i64([[0, 2]])), {}, r"index 2 .*axis 0 of size 2 \(valid range \[-2, 1\]\)"),
        ((np.ones((1, 2)), i64([2, 3]), i64([[0, -4]])), {"axis": -1}, r"index -4 .*axis 1 of size 3 \(valid range \[-3, 2\]\)"),
        ((np.ones((3, 1)), i64([2, 3]), i64([[0], [0], [0]])), {"axis": 1}, r"exceeds the data shape \[2, 3\] on axis 0"),
        ((np.ones((2,)), i64([2, 3]), i64([0, 1])), {}, "rank 1"),
        ((np.ones((1, 2)), i64([2, 3]), i64([[0, 1]])), {"axis": 2}, r"axis 2 is out of range for rank 2"),
    ],
)
def test_gather_elements_grad_must_fail(args, kwargs, match):
    with pytest.raises(KernelError, match=match):
        kernel("GatherElementsGrad")(*args, **kwargs)


def test_gather_elements_grad_deterministic():
    rng = np.random.default_rng(5)
    indices = rng.integers(-3, 3, size=(400, 512))  # 6 rows receive 400 contributions per column
    dy = rng.standard_normal((400, 512)).astype(np.float32)
    fn = kernel("GatherElementsGrad")
    first = fn(dy, i64([6, 512]), indices, axis=0)
    assert first.tobytes() == fn(dy.copy(), i64([6, 512]), indices.copy(), axis=0).tobytes()
    want = np.zeros((6, 512))
    np.add.at(want, (np.where(indices < 0, indices + 6, indices), np.arange(512)), dy.astype(np.float64))
    np.testing.assert_allclose(first, want, rtol=1e-6, atol=1e-5)


def test_gather_elements_grad_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dx = kernel("GatherElementsGrad")(np.ones((2, 2), ml_dtypes.bfloat16), i64([2, 2]), i64([[1, 1], [1, -1]]), axis=1)
    assert dx.dtype == ml_dtypes.bfloat16 and dx.astype(np.float32).tolist() == [[0, 2], [0, 2]]


# ====================================================================== ConvGrad

CONV_CASES = [  # X, W, dY, attributes, bias
    ((2, 2, 5), (2, 2, 3), (2, 2, 5), dict(kernel_shape=[3], pads=[1, 1]), False),
    ((2, 1, 7), (1, 1, 3), (2, 1, 4), dict(kernel_shape=[3], pads=[1, 1], strides=[2]), False),
    ((2, 1, 5), (1, 1, 1), (2, 1, 7), dict(kernel_shape=[1], pads=[1, 1]), False),
    ((3, 1, 8), (2, 1, 2), (3, 2, 5), dict(kernel_shape=[2], pads=[2, 2], strides=[2], dilations=[2]), False),
    ((2, 2, 9), (1, 2, 1), (2, 1, 4), dict(kernel_shape=[1], pads=[1, 1], strides=[3], dilations=[2]), True),
    ((1, 3, 4, 4), (3, 3, 1, 1), (1, 3, 4, 4), dict(kernel_shape=[1, 1]), False),
    ((2, 1, 7, 5), (1, 1, 3, 3), (2, 1, 4, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), False),
    ((2, 1, 5, 5), (1, 1, 3, 3), (2, 1, 1, 1), dict(pads=[0, 0, 0, 0], dilations=[2, 2]), False),
    ((2, 1, 7, 5), (1, 1, 3, 3), (2, 1, 5, 3), dict(pads=[1, 1, 1, 1], dilations=[2, 2]), False),
    ((2, 1, 5, 5, 5), (1, 1, 3, 3, 3), (2, 1, 5, 5, 5), dict(pads=[1] * 6), False),
    ((2, 1, 7, 5, 5), (1, 1, 3, 3, 3), (2, 1, 4, 3, 3), dict(pads=[1] * 6, strides=[2, 2, 2]), False),
    ((2, 1, 4, 4, 4), (2, 1, 2, 2, 2), (2, 2, 3, 3, 3), dict(pads=[2] * 6, strides=[2] * 3, dilations=[2] * 3), True),
    # beyond CASES: groups, depthwise, 1x1 with stride, asymmetric pads
    ((2, 4, 6, 5), (6, 2, 3, 3), (2, 6, 6, 5), dict(group=2, pads=[1, 1, 1, 1]), True),
    ((2, 6, 7, 7), (6, 1, 3, 3), (2, 6, 4, 4), dict(group=6, pads=[1, 1, 1, 1], strides=[2, 2]), True),  # depthwise
    ((2, 3, 8), (6, 1, 5), (2, 6, 3), dict(group=3, pads=[2, 1], dilations=[2]), False),  # depthwise multiplier 2
    ((2, 4, 4, 5, 3), (4, 2, 2, 3, 1), (2, 4, 4, 2, 4), dict(group=2, pads=[0, 1, 1, 1, 0, 0], strides=[1, 2, 1]), True),
    ((2, 3, 7, 6), (4, 3, 1, 1), (2, 4, 4, 3), dict(strides=[2, 2]), True),  # 1x1 with stride
    ((1, 2, 6, 7), (3, 2, 2, 3), (1, 3, 3, 2), dict(pads=[0, 2, 1, 0], strides=[2, 3], dilations=[1, 2]), False),
]


def _torch_conv(x, w, attrs, pads_begin_end):
    nd = x.dim() - 2
    begin, end = pads_begin_end
    torch_pad = []
    for i in reversed(range(nd)):
        torch_pad += [begin[i], end[i]]
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return conv(
        F.pad(x, torch_pad), w, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1)
    )


def _onnx_pads(x_shape, w_shape, attrs):
    """Explicit (begin, end) pads per the ONNX Conv spec, auto_pad included."""
    nd = len(x_shape) - 2
    strides = attrs.get("strides", [1] * nd)
    dilations = attrs.get("dilations", [1] * nd)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = attrs.get("pads", [0] * 2 * nd)
        return pads[:nd], pads[nd:]
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    begin, end = [], []
    for n, k, s, d in zip(x_shape[2:], w_shape[2:], strides, dilations):
        out = math.ceil(n / s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin, end


def _conv_reference(x, w, dy, attrs):
    pads = _onnx_pads(x.shape, w.shape, attrs)
    dx, dw = torch_grad(lambda xt, wt: _torch_conv(xt, wt, attrs, pads), [x, w], dy)
    return dx, dw, dy.astype(np.float64).sum(axis=(0, *range(2, dy.ndim)))


@pytest.mark.parametrize("x_shape,w_shape,dy_shape,attrs,bias", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_conv_grad_cases_against_torch(x_shape, w_shape, dy_shape, attrs, bias):
    rng = np.random.default_rng(len(x_shape) * 100 + sum(x_shape))
    x, w, dy = rng.standard_normal(x_shape), rng.standard_normal(w_shape), rng.standard_normal(dy_shape)
    want = _conv_reference(x, w, dy, attrs)
    fn = kernel("ConvGrad")
    got = fn(dy, x, w, **attrs, _num_outputs=3 if bias else 2)
    assert len(got) == (3 if bias else 2)
    for g, wnt in zip(got, want):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, wnt, rtol=1e-12, atol=1e-12)
    got32 = fn(dy.astype(np.float32), x.astype(np.float32), w.astype(np.float32), **attrs)
    for g, wnt in zip(got32, want):
        assert_close(g, wnt, np.float32)
    if bias:  # dY all ones: dB is the number of output positions per batch times the batch
        db = fn(np.ones(dy_shape), x, w, **attrs)[2]
        assert db.tolist() == [float(math.prod(dy_shape) // dy_shape[1])] * dy_shape[1]


def test_conv_grad_3d_bias_known_value():
    dx, dw, db = kernel("ConvGrad")(
        np.ones((2, 2, 3, 3, 3)),
        np.ones((2, 1, 4, 4, 4)),
        np.ones((2, 1, 2, 2, 2)),
        pads=[2] * 6,
        strides=[2] * 3,
        dilations=[2] * 3,
    )
    assert db.tolist() == [54.0, 54.0]


def test_conv_grad_conv1d_known_values():
    x = np.array([2.0349, -1.8088, -0.1171, 1.1849, -0.6590, -2.0404, -1.2810], np.float32).reshape(1, 1, 7)
    w = np.array([[[0.5081]]], np.float32)
    dx, dw = kernel("ConvGrad")(np.ones((1, 1, 7), np.float32), x, w, kernel_shape=[1], _num_outputs=2)
    np.testing.assert_allclose(dx, np.full((1, 1, 7), 0.5081), rtol=1e-6)
    np.testing.assert_allclose(dw, [[[-2.6865]]], rtol=0, atol=1e-4)


@pytest.mark.parametrize("attrs", [dict(pads=[1, 1, 1, 1]), dict(auto_pad="SAME_UPPER"), dict(auto_pad=b"SAME_LOWER")])
def test_conv_grad_auto_pad_known_values(attrs):
    dx, dw, db = kernel("ConvGrad")(np.ones((1, 1, 4, 4)), np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3)), **attrs)
    assert dw.reshape(-1).tolist() == [9, 12, 9, 12, 16, 12, 9, 12, 9]


AUTO_PAD_CASES = [  # X, W, attrs (dY shape comes from torch)
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(auto_pad="SAME_UPPER")),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(auto_pad="SAME_LOWER")),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(auto_pad="SAME_UPPER", strides=[2, 3])),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(auto_pad="SAME_LOWER", strides=[2, 3])),
    ((2, 4, 9), (4, 2, 4), dict(auto_pad="SAME_UPPER", strides=[2], dilations=[2], group=2)),
    ((2, 4, 9), (4, 2, 4), dict(auto_pad="SAME_LOWER", strides=[2], dilations=[2], group=2)),
    ((1, 2, 5, 6, 4), (2, 1, 2, 3, 2), dict(auto_pad="SAME_LOWER", strides=[2, 1, 3], group=2)),
    ((2, 3, 7, 6), (4, 3, 3, 2), dict(auto_pad="VALID", strides=[2, 1], pads=[5, 5, 5, 5])),
    ((2, 3, 7), (2, 3, 3), dict(auto_pad="NOTSET")),
]


@pytest.mark.parametrize("x_shape,w_shape,attrs", AUTO_PAD_CASES)
def test_conv_grad_auto_pad_against_torch(x_shape, w_shape, attrs):
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    with torch.no_grad():
        y_shape = _torch_conv(torch.tensor(x), torch.tensor(w), attrs, _onnx_pads(x_shape, w_shape, attrs)).shape
    if attrs.get("auto_pad", "").startswith("SAME"):
        assert list(y_shape[2:]) == [math.ceil(n / s) for n, s in zip(x_shape[2:], attrs.get("strides", [1] * 9))]
    dy = rng.standard_normal(tuple(y_shape))
    got = kernel("ConvGrad")(dy, x, w, **attrs)
    for g, wnt in zip(got, _conv_reference(x, w, dy, attrs)):
        np.testing.assert_allclose(g, wnt, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("num_outputs", [1, 2, 3])
def test_conv_grad_num_outputs(num_outputs):
    rng = np.random.default_rng(0)
    x, w, dy = rng.standard_normal((1, 2, 5)), rng.standard_normal((3, 2, 3)), rng.standard_normal((1, 3, 3))
    got = kernel("ConvGrad")(dy, x, w, _num_outputs=num_outputs)
    want = _conv_reference(x, w, dy, {})
    assert len(got) == num_outputs
    for g, wnt in zip(got, want):
        np.testing.assert_allclose(g, wnt, rtol=1e-12, atol=1e-12)


def test_conv_grad_float16_accumulates_in_float32():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8, 9, 9)).astype(np.float16)
    w = (rng.standard_normal((8, 4, 3, 3)) * 0.2).astype(np.float16)
    dy = (rng.standard_normal((4, 8, 9, 9)) * 0.2).astype(np.float16)
    attrs = dict(group=2, pads=[1, 1, 1, 1])
    got = kernel("ConvGrad")(dy, x, w, **attrs)
    want = _conv_reference(x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64), attrs)
    for g, wnt in zip(got, want):
        assert_close(g, wnt, np.float16)


@pytest.mark.parametrize(
    "dy_shape,attrs,match",
    [
        ((2, 4, 16, 16), dict(pads=[1, 1, 1, 1]), r"dY has shape \[2, 4, 16, 16\], but Conv's output shape is \[2, 4, 14, 14\]"),
        ((2, 4, 16, 16), dict(), r"dY has shape \[2, 4, 16, 16\], but Conv's output shape is \[2, 4, 14, 14\]"),
        ((2, 4, 16, 16), dict(auto_pad="SAME_UPPER", strides=[2, 2]), r"output shape is \[2, 4, 8, 8\]"),
        ((2, 4, 16, 16), dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2]), r"kernel_shape \[5, 5\] does not match"),
        ((2, 4, 16, 16), dict(group=3), "group 3 does not fit"),
        ((2, 4, 16, 16), dict(auto_pad="SAME"), "unknown auto_pad"),
    ],
)
def test_conv_grad_must_fail(dy_shape, attrs, match):
    x, w = np.ones((2, 6, 16, 16)), np.ones((4, 6, 3, 3))
    if "pads" in attrs and attrs["pads"] == [1, 1, 1, 1]:
        dy_shape = (2, 4, 14, 14)  # wrong: with pads 1 the output is 16x16
        match = r"dY has shape \[2, 4, 14, 14\], but Conv's output shape is \[2, 4, 16, 16\]"
    with pytest.raises(KernelError, match=match):
        kernel("ConvGrad")(np.ones(dy_shape), x, w, **attrs)


# ====================================================================== schemas


def test_schemas_table_and_opset():
    assert schemas.microsoft_opset_import() == ("com.microsoft", 1)
    assert {
        "SliceGrad",
        "GatherGrad",
        "GatherElementsGrad",
        "ConvGrad",
        "BroadcastGradientArgs",
        "LayerNormalizationGrad",
    } <= set(schemas.SCHEMAS)
    assert [f.name for f in schemas.SCHEMAS["GatherGrad"].inputs] == ["shape", "indices", "dY"]
    assert [f.name for f in schemas.SCHEMAS["GatherElementsGrad"].inputs] == ["dY", "shape", "indices"]
    for op in schemas.SCHEMAS:
        assert registry.lookup(MS, op).cpu is not None


def test_output_types():
    F32, I64 = TensorProto.FLOAT, TensorProto.INT64
    ot = schemas.output_types
    assert ot("SliceGrad", [(F32, (1, 2)), (I64, (2,), i64([3, 4])), (I64, (1,)), (I64, (1,))]) == [(F32, (3, 4))]
    assert ot("SliceGrad", [(F32, (1, 2)), (I64, (2,)), (I64, (1,)), (I64, (1,)), None, None]) == [(F32, (None, None))]
    assert ot("GatherGrad", [(I64, ("r",)), (TensorProto.INT32, (5,)), (TensorProto.FLOAT16, (5, 3))], {"axis": 0}) == [
        (TensorProto.FLOAT16, None)
    ]
    assert ot("GatherElementsGrad", [(F32, (2, 2)), (I64, (2,), i64([2, 5])), (I64, (2, 2))]) == [(F32, (2, 5))]
    assert ot("ConvGrad", [(F32, (1, 4, 5, 5)), (F32, (1, 2, 7, 7)), (F32, (4, 2, 3, 3))]) == [
        (F32, (1, 2, 7, 7)),
        (F32, (4, 2, 3, 3)),
        (F32, (4,)),
    ]
    assert ot("BroadcastGradientArgs", [(I64, (3,)), (I64, (None,))]) == [(I64, (None,)), (I64, (None,))]
    with pytest.raises(ModelError, match="takes 4 to 6 inputs"):
        ot("SliceGrad", [(F32, (1,)), (I64, (1,))])
    with pytest.raises(ModelError, match="input 'indices' has type FLOAT"):
        ot("GatherGrad", [(I64, (1,)), (F32, (1,)), (F32, (1,))])
    with pytest.raises(ModelError, match="not one of the ops"):
        ot("Foo", [])


# ====================================================================== through the executor


def _one_node_model(op_type, inputs, outputs, attrs=None, initializers=()):
    """inputs: (name, array) fed at run time, or (name, array, True) stored as an initializer."""
    infos = []
    graph_inputs, inits, feeds = [], [], {}
    for name, value, *const in inputs:
        if not name:
            infos.append(None)
            continue
        value = np.asarray(value)
        dtype = helper.np_dtype_to_tensor_dtype(value.dtype)
        infos.append((dtype, value.shape, value if const else None))
        if const:
            inits.append(numpy_helper.from_array(value, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, dtype, value.shape))
            feeds[name] = value
    types = schemas.output_types(op_type, infos, attrs)
    graph_outputs = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in zip(outputs, types) if name]
    node = helper.make_node(op_type, [i[0] for i in inputs], outputs, name=f"{op_type}_0", domain=MS, **(attrs or {}))
    graph = helper.make_graph([node], "one_node", graph_inputs, graph_outputs, inits)
    domain, version = schemas.microsoft_opset_import()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, version)])
    return model, feeds


def _executor_cases():
    rng = np.random.default_rng(4)
    dy_conv = rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    x_conv = rng.standard_normal((2, 2, 5, 5)).astype(np.float32)
    w_conv = rng.standard_normal((4, 1, 3, 3)).astype(np.float32)
    conv_inputs = [("dY", dy_conv), ("X", x_conv), ("W", w_conv)]
    dx, dw, db = kernel("ConvGrad")(dy_conv, x_conv, w_conv, group=2, pads=[1, 1, 1, 1], strides=[2, 2])
    return {  # op[-variant]: inputs, output names, attributes, expected outputs
        "SliceGrad": (
            [
                ("dY", np.float32([5, 7])),
                ("shape", i64([2, 4]), True),
                ("starts", i64([1, 0]), True),
                ("ends", i64([2, 3]), True),
                ("axes", i64([0, 1]), True),
                ("steps", i64([1, 2]), True),
            ],
            ["dX"],
            {},
            {"dX": np.float32([[0, 0, 0, 0], [5, 0, 7, 0]])},
        ),
        "SliceGrad-no-axes": (
            [
                ("dY", np.ones((1, 2), np.float64)),
                ("shape", i64([2, 2]), True),
                ("starts", np.int32([1]), True),
                ("ends", np.int32([2]), True),
                ("", None),
                ("", None),
            ],
            ["dX"],
            {},
            {"dX": np.float64([[0, 0], [1, 1]])},
        ),
        "GatherGrad": (
            [
                ("shape", i64([3, 3]), True),
                ("indices", i64([[0, -1], [0, -2]])),
                ("dY", np.tile(np.arange(6, dtype=np.float32), 2).reshape(2, 2, 3)),
            ],
            ["dX"],
            {"axis": 0},
            {"dX": np.float32([[0, 2, 4], [3, 4, 5], [3, 4, 5]])},
        ),
        "GatherElementsGrad": (
            [("dY", np.ones((2, 3), np.float16)), ("shape", i64([3, 3]), True), ("indices", np.int32([[1, 2, 0], [2, 0, 0]]))],
            ["dX"],
            {"axis": 0},
            {"dX": np.float16([[0, 1, 2], [1, 0, 0], [1, 1, 0]])},
        ),
        "ConvGrad": (
            conv_inputs,
            ["dX", "dW", "dB"],
            {"group": 2, "kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2], "auto_pad": "NOTSET"},
            {"dX": dx, "dW": dw, "dB": db},
        ),
        "ConvGrad-no-dX": (  # X not trainable: the first output is unnamed; SAME_UPPER gives pads 1 here
            conv_inputs,
            ["", "dW", "dB"],
            {"group": 2, "kernel_shape": [3, 3], "auto_pad": "SAME_UPPER", "strides": [2, 2]},
            {"dW": dw, "dB": db},
        ),
        "ConvGrad-no-bias": (
            conv_inputs,
            ["dX", "dW"],
            {"group": 2, "pads": [1, 1, 1, 1], "strides": [2, 2]},
            {"dX": dx, "dW": dw},
        ),
        "BroadcastGradientArgs": (
            [("a_shape", i64([1, 4, 5])), ("b_shape", i64([2, 3, 1, 1]))],
            ["a_axes", "b_axes"],
            {},
            {"a_axes": i64([1, 0]), "b_axes": i64([3, 2])},
        ),
    }


EXECUTOR_CASES = _executor_cases()


@pytest.mark.parametrize("name", list(EXECUTOR_CASES))
def test_one_node_model_through_executor_and_checker(name):
    inputs, outputs, attrs, want = EXECUTOR_CASES[name]
    model, feeds = _one_node_model(name.split("-")[0], inputs, outputs, attrs)
    # The checker knows no com.microsoft schema: it accepts the node without checking it, and full
    # (strict) shape inference infers nothing for it, so the declared output types stand.
    onnx.checker.check_model(model, full_check=True)
    got = Session(model).run(feeds)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape
        np.testing.assert_array_equal(got[key], value)
    declared = {v.name: v.type.tensor_type for v in model.graph.output}
    for key, value in got.items():
        assert declared[key].elem_type == helper.np_dtype_to_tensor_dtype(value.dtype)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in declared[key].shape.dim]
        assert all(d is None or d == s for d, s in zip(dims, value.shape)) and len(dims) == value.ndim


def test_executor_names_the_node_on_kernel_errors():
    model, feeds = _one_node_model(
        "GatherGrad", [("shape", i64([3, 3]), True), ("indices", i64([0, 3])), ("dY", np.ones((2, 3), np.float32))], ["dX"]
    )
    with pytest.raises(KernelError, match=r"node 'GatherGrad_0' \(com.microsoft::GatherGrad\): index 3 .*axis 0"):
        Session(model).run(feeds)


def test_checker_needs_the_microsoft_opset_import():
    model, _ = _one_node_model("BroadcastGradientArgs", [("a", i64([2, 3])), ("b", i64([3]))], ["a_axes", "b_axes"])
    del model.opset_import[1]
    with pytest.raises(onnx.checker.ValidationError, match="No opset import for domain 'com.microsoft'"):
        onnx.checker.check_model(model, full_check=True)


# ====================================================================== LayerNormalizationGrad


def _layer_norm_model(shape, axis, dtype=TensorProto.FLOAT, norm_shape=None, bias=True, seed=0):
    """x -> LayerNormalization(axis) -> sum(y * w): the rule's LayerNormalization model."""
    rng = np.random.default_rng(seed)
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    norm_shape = tuple(shape[axis % len(shape) :]) if norm_shape is None else norm_shape
    inits = {"scale": rng.standard_normal(norm_shape), "w": rng.uniform(0.5, 1.5, shape)}
    if bias:
        inits["bias"] = rng.standard_normal(norm_shape)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "bias" if bias else ""], ["y"], axis=axis),
        helper.make_node("Mul", ["y", "w"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "ln",
        [helper.make_tensor_value_info("x", dtype, shape)],
        [helper.make_tensor_value_info("loss", dtype, [])],
        [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, {k: v.astype(np_dtype) for k, v in inits.items()}, rng.standard_normal(shape).astype(np_dtype)


def _layer_norm_stats(x, axis):
    axes = tuple(range(axis % x.ndim, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    return mean, 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)


@pytest.mark.parametrize("shape,axis", [((4, 6), -1), ((2, 3, 5), 1), ((3, 2, 4), -1)])
def test_layer_norm_grad_kernel_matches_finite_differences(shape, axis):
    """The CPU kernel in float64 (statistics in float64 too) against central differences of
    L = sum(dy * LayerNorm(x; scale, bias)) in every element of X, scale and bias."""
    rng = np.random.default_rng(7)
    norm_shape = shape[axis % len(shape) :]
    x, scale, bias, dy = (rng.standard_normal(s) for s in (shape, norm_shape, norm_shape, shape))

    def loss(x, scale, bias):
        mean, inv = _layer_norm_stats(x, axis)
        return float(np.sum(dy * ((x - mean) * inv * scale + bias)))

    mean, inv = _layer_norm_stats(x, axis)
    got = kernel("LayerNormalizationGrad")(dy, x, scale, mean, inv, axis=axis)
    args, eps = [x, scale, bias], 1e-6
    for k, arg in enumerate(args):
        fd = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[k][idx] += eps
            minus[k][idx] -= eps
            fd[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(got[k], fd, rtol=1e-6, atol=1e-7 * max(1.0, np.abs(fd).max()))


@pytest.mark.parametrize("shape,axis", [((4, 6), -1), ((2, 3, 5), 1), ((2, 3, 5), -2)])
def test_layer_norm_rule_emits_layer_norm_grad_and_matches_torch(shape, axis):
    """float32: the rule emits one LayerNormalizationGrad reading the forward node's Mean and
    InvStdDev (added to the node), and its gradients match PyTorch's layer_norm."""
    import gradgen

    model, inits, x = _layer_norm_model(shape, axis)
    built = onnx_ir_to_proto(gradgen.build_backward(model, wrt_inputs=True).model)
    ops = [n for n in built.graph.node if n.domain == MS]
    assert [n.op_type for n in ops] == ["LayerNormalizationGrad"]
    forward = next(n for n in built.graph.node if n.op_type == "LayerNormalization")
    assert len(forward.output) == 3 and list(ops[0].input[3:]) == list(forward.output[1:])
    got = Session(built).run({"x": x})
    norm_shape = shape[axis % len(shape) :]
    want = torch_grad(lambda x, s, b: F.layer_norm(x, norm_shape, s, b, 1e-5), [x, inits["scale"], inits["bias"]], inits["w"])
    for name, value in zip(("x_grad", "scale_grad", "bias_grad"), want):
        assert_close(got[name], value, np.float32)


@pytest.mark.parametrize("case", ["broadcast-scale", "float64"])
def test_layer_norm_rule_keeps_the_standard_spelling_where_the_op_does_not_fit(case):
    """A scale broadcast over the normalized shape (not LayerNormalizationGrad's contract) and
    float64 data (float32 statistics would cost it precision) keep the standard-op gradient."""
    import gradgen

    if case == "float64":
        model, _, x = _layer_norm_model((3, 4), -1, dtype=TensorProto.DOUBLE)
    else:
        model, _, x = _layer_norm_model((2, 3, 4), 1, norm_shape=(4,), bias=False)
    built = onnx_ir_to_proto(gradgen.build_backward(model, wrt_inputs=True).model)
    assert not [n for n in built.graph.node if n.domain == MS]
    assert np.isfinite(Session(built).run({"x": x})["x_grad"]).all()


@pytest.mark.parametrize("shape,axis,bias", [((4, 6), -1, True), ((2, 3, 5), 1, True), ((3, 5), 1, False)])
def test_layer_norm_grad_portable_form_matches_the_kernel_and_onnxruntime(shape, axis, bias):
    """--portable lowers LayerNormalizationGrad to standard ops: gradgen's executor and stock
    onnxruntime (which has no LayerNormalizationGrad) run it to the op's values."""
    import onnxruntime as ort

    import gradgen

    model, _, x = _layer_norm_model(shape, axis, bias=bias)
    plain = onnx_ir_to_proto(gradgen.build_backward(model, wrt_inputs=True).model)
    portable = onnx_ir_to_proto(gradgen.build_backward(model, wrt_inputs=True, portable=True).model)
    assert all(n.domain in ("", "ai.onnx") for n in portable.graph.node)
    want = Session(plain).run({"x": x})
    names = [o.name for o in portable.graph.output]
    ours = Session(portable).run({"x": x})
    theirs = dict(
        zip(names, ort.InferenceSession(portable.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, {"x": x}))
    )
    for name in ("x_grad", "scale_grad") + (("bias_grad",) if bias else ()):
        np.testing.assert_allclose(ours[name], want[name], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(theirs[name], want[name], rtol=1e-5, atol=1e-5)


def test_layer_norm_grad_schema_and_errors():
    assert [f.name for f in schemas.SCHEMAS["LayerNormalizationGrad"].inputs] == ["Y_grad", "X", "scale", "mean", "inv_std_var"]
    F32 = TensorProto.FLOAT
    assert schemas.output_types(
        "LayerNormalizationGrad", [(F32, (2, 3)), (F32, (2, 3)), (F32, (3,)), (F32, (2, 1)), (F32, (2, 1))]
    ) == [(F32, (2, 3)), (F32, (3,)), (F32, (3,))]
    with pytest.raises(ModelError, match="input 'mean' has type DOUBLE"):
        schemas.output_types("LayerNormalizationGrad", [(F32, (2, 3))] * 3 + [(TensorProto.DOUBLE, (2, 1))] * 2)
    x = np.ones((2, 3), np.float32)
    with pytest.raises(KernelError, match="scale has 2 elements"):
        kernel("LayerNormalizationGrad")(x, x, np.ones(2, np.float32), np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("shape,axis", [((4, 6), -1), ((2, 3, 5), 1), ((1000, 768), -1), ((3, 1500), -1)])
def test_layer_norm_grad_cuda_matches_the_cpu_kernel_bit_identically_across_runs(dtype, shape, axis):
    """The CUDA kernel (rows per block, column sums in fixed-order chunks) against the CPU kernel,
    and two runs bit-identical."""
    from gradgen.cuda import runtime as rt

    registry.load_cuda_kernels()
    entry = registry.lookup(MS, "LayerNormalizationGrad")
    rng = np.random.default_rng(3)
    norm_shape = shape[axis % len(shape) :]
    x, dy = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    scale = rng.standard_normal(norm_shape).astype(dtype)
    mean, inv = (s.astype(np.float32) for s in _layer_norm_stats(x.astype(np.float64), axis))
    want = entry.cpu(dy, x, scale, mean, inv, axis=axis)
    args = [rt.to_device(a) for a in (dy, x, scale, mean, inv)]
    first = [o.get() for o in entry.cuda(*args, axis=axis)]
    again = [o.get() for o in entry.cuda(*args, axis=axis)]
    for got, ref, rerun in zip(first, want, again):
        np.testing.assert_array_equal(got, rerun)
        tol = {np.float16: 2e-2, np.float32: 1e-4, np.float64: 1e-10}[np.dtype(dtype).type]
        np.testing.assert_allclose(
            got.astype(np.float64),
            ref.astype(np.float64),
            rtol=tol,
            atol=tol * max(1.0, float(np.abs(ref.astype(np.float64)).max())),
        )


def onnx_ir_to_proto(model):
    import onnx_ir as ir

    return ir.to_proto(model)
