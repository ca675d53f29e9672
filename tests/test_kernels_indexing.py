"""CPU indexing kernels (Gather*, Scatter*, OneHot, NonZero, Compress) against torch/onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from gradgen.errors import KernelError
from gradgen.executor.session import Session
from gradgen.kernels.cpu import indexing as K

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(4321)


def rand(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def one_node_model(op, inputs, attrs=None, n_outputs=1, opset=18):
    names = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outs, name="the_node", **(attrs or {}))
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, inputs)
    ]
    graph_outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    model = helper.make_model(
        helper.make_graph([node], "g", graph_inputs, graph_outputs),
        opset_imports=[helper.make_opsetid("", opset)],
    )
    model.ir_version = 10
    return model, dict(zip(names, inputs))


def ort(op, inputs, attrs=None, n_outputs=1, opset=18):
    ort_mod = pytest.importorskip("onnxruntime")
    model, feeds = one_node_model(op, inputs, attrs, n_outputs, opset)
    sess = ort_mod.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def gradgen_run(op, inputs, attrs=None, n_outputs=1, opset=18):
    model, feeds = one_node_model(op, inputs, attrs, n_outputs, opset)
    res = Session(model).run(feeds)
    return [res[f"out{i}"] for i in range(n_outputs)]


# ---------------------------------------------------------------------------------------------
# Gather family


@pytest.mark.parametrize("axis", [0, 1, -1, -3])
@pytest.mark.parametrize("idx_dtype", [np.int64, np.int32])
def test_gather_negative_and_repeated(axis, idx_dtype):
    data = rand(4, 5, 6, dtype=np.float32)
    dim = data.shape[axis]
    idx = np.array([[0, -1, 2], [-dim, 1, 1]], dtype=idx_dtype)
    got = K.gather(data, idx, axis=axis)
    want = torch.index_select(t(data), axis % 3, t((idx % dim).astype(np.int64).reshape(-1)))
    want = want.reshape(data.shape[: axis % 3] + idx.shape + data.shape[axis % 3 + 1 :]).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    (ort_y,) = ort("Gather", [data, idx], dict(axis=axis), opset=13)
    np.testing.assert_array_equal(got, ort_y)


def test_gather_scalar_index():
    data = rand(3, 4)
    np.testing.assert_array_equal(K.gather(data, np.array(-1), axis=1), data[:, 3])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements_matches_torch(axis):
    data = rand(3, 4, 5)
    shape = list(data.shape)
    shape[axis] = 7
    idx = RNG.integers(-data.shape[axis], data.shape[axis], size=shape)
    got = K.gather_elements(data, idx, axis=axis)
    want = torch.gather(t(data), axis % 3, t(idx % data.shape[axis]))
    np.testing.assert_array_equal(got, want.numpy())


def test_gather_elements_smaller_indices():
    data = rand(4, 5)
    idx = np.array([[1, -1], [0, 3]])
    want = ort("GatherElements", [data, idx], dict(axis=1), opset=13)[0]
    np.testing.assert_array_equal(K.gather_elements(data, idx, axis=1), want)


@pytest.mark.parametrize(
    "data_shape,idx_shape,batch_dims",
    [
        ((4, 5), (3, 2), 0),
        ((4, 5, 6), (2, 3, 1), 0),
        ((2, 4, 5), (2, 3, 1), 1),
        ((2, 3, 4, 5), (2, 3, 2), 2),
        ((2, 3, 4, 5), (2, 3, 6, 2), 2),
        ((3, 4, 5), (3, 2, 2), 1),
    ],
)
def test_gather_nd_matches_onnxruntime(data_shape, idx_shape, batch_dims):
    data = rand(*data_shape, dtype=np.float32)
    k = idx_shape[-1]
    dims = data_shape[batch_dims : batch_dims + k]
    idx = np.stack([RNG.integers(-d, d, size=idx_shape[:-1]) for d in dims], axis=-1).astype(np.int64)
    got = K.gather_nd(data, idx, batch_dims=batch_dims)
    (want,) = ort("GatherND", [data, idx], dict(batch_dims=batch_dims), opset=13)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# ScatterElements


TORCH_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements_reductions_with_repeats(reduction, axis):
    data = rand(4, 5, 3)
    shape = list(data.shape)
    shape[axis] = 6  # more updates than slots: repeats are certain
    dim = data.shape[axis]
    idx = RNG.integers(-dim, dim, size=shape)
    updates = rand(*shape)
    got = K.scatter_elements(data, idx, updates, axis=axis, reduction=reduction)
    want = t(data).scatter_reduce(axis % 3, t(idx % dim), t(updates), reduce=TORCH_REDUCE[reduction], include_self=True)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_scatter_elements_add_accumulates_float32():
    data = np.zeros((1, 3), dtype=np.float32)
    idx = np.array([[1, 1, -2, 0]])
    upd = np.array([[1.0, 2.0, 4.0, 8.0]], dtype=np.float32)
    got = K.scatter_elements(data, idx, upd, axis=1, reduction="add")
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, [[8.0, 7.0, 0.0]])
    (want,) = ort("ScatterElements", [data, idx, upd], dict(axis=1, reduction="add"))
    np.testing.assert_array_equal(got, want)


def test_scatter_elements_none_last_write_wins():
    data = np.zeros((2, 4))
    idx = np.array([[3, -1, 0, 3], [2, 2, 2, 1]])
    upd = np.arange(8.0).reshape(2, 4)
    got = K.scatter_elements(data, idx, upd, axis=1)
    want = data.copy()
    for i in range(2):
        for j in range(4):  # in index order: the later write overwrites
            want[i, idx[i, j] % 4] = upd[i, j]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [[2.0, 0.0, 0.0, 3.0], [0.0, 7.0, 6.0, 0.0]])


def test_scatter_elements_unique_matches_torch():
    data = rand(5, 4)
    idx = np.stack([RNG.permutation(5)[:3] for _ in range(4)], axis=1) - 5  # negative, unique per column
    upd = rand(3, 4)
    got = K.scatter_elements(data, idx, upd, axis=0)
    want = t(data).scatter(0, t(idx + 5), t(upd))
    np.testing.assert_array_equal(got, want.numpy())
    assert not np.shares_memory(got, data)


# ---------------------------------------------------------------------------------------------
# ScatterND


def scatter_nd_loop(data, indices, updates, reduction):
    out = data.copy()
    k = indices.shape[-1]
    ops = {"none": lambda a, b: b, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}
    for pos in np.ndindex(indices.shape[:-1]):
        target = tuple(int(i) % n for i, n in zip(indices[pos], data.shape[:k]))
        out[target] = ops[reduction](out[target], updates[pos])
    return out


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("data_shape,idx_shape", [((6,), (5, 1)), ((4, 5, 3), (3, 2, 2)), ((3, 4), (7, 2)), ((3, 4, 2), (2, 1))])
def test_scatter_nd_reductions_with_repeats(reduction, data_shape, idx_shape):
    data = rand(*data_shape)
    k = idx_shape[-1]
    idx = np.stack([RNG.integers(-d, d, size=idx_shape[:-1]) for d in data_shape[:k]], axis=-1)
    updates = rand(*(idx_shape[:-1] + data_shape[k:]))
    got = K.scatter_nd(data, idx, updates, reduction=reduction)
    np.testing.assert_allclose(got, scatter_nd_loop(data, idx, updates, reduction), rtol=1e-12, atol=0)


def test_scatter_nd_matches_onnxruntime():
    data = rand(4, 4, 4, dtype=np.float32)
    idx = np.array([[0], [2]], dtype=np.int64)
    upd = rand(2, 4, 4, dtype=np.float32)
    for reduction in ["none", "add", "mul", "max", "min"]:
        got = K.scatter_nd(data, idx, upd, reduction=reduction)
        (want,) = ort("ScatterND", [data, idx, upd], dict(reduction=reduction))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "call,value,axis,lo,hi",
    [
        (lambda: K.gather(np.zeros((3, 4)), np.array([0, 4]), axis=1), 4, 1, -4, 3),
        (lambda: K.gather(np.zeros((3, 4)), np.array([[-4, 1]]), axis=0), -4, 0, -3, 2),
        (lambda: K.gather_elements(np.zeros((3, 4)), np.array([[0, 5]]), axis=-1), 5, 1, -4, 3),
        (lambda: K.gather_nd(np.zeros((3, 4)), np.array([[1, 9]])), 9, 1, -4, 3),
        (lambda: K.gather_nd(np.zeros((2, 3, 4)), np.array([[7], [0]]), batch_dims=1), 7, 1, -3, 2),
        (lambda: K.scatter_elements(np.zeros((3, 4)), np.array([[3]]), np.ones((1, 1)), axis=0), 3, 0, -3, 2),
        (lambda: K.scatter_elements(np.zeros((3, 4)), np.array([[-5]]), np.ones((1, 1)), axis=1, reduction="add"), -5, 1, -4, 3),
        (lambda: K.scatter_nd(np.zeros((3, 4)), np.array([[0, 4]]), np.ones(1)), 4, 1, -4, 3),
        (lambda: K.scatter_nd(np.zeros((3, 4)), np.array([[-4]]), np.ones((1, 4)), reduction="mul"), -4, 0, -3, 2),
    ],
)
def test_out_of_range_index_message(call, value, axis, lo, hi):
    with pytest.raises(KernelError) as info:
        call()
    msg = str(info.value)
    assert f"index {value} " in msg
    assert f"axis {axis} " in msg
    assert f"[{lo}, {hi}]" in msg


def test_executor_prefixes_node_and_op():
    data = rand(3, 4, dtype=np.float32)
    idx = np.array([1, 7], dtype=np.int64)
    with pytest.raises(KernelError, match=r"node 'the_node' \(Gather\): index 7 .*axis 0 .*\[-3, 2\]"):
        gradgen_run("Gather", [data, idx], opset=13)


def test_unknown_reduction():
    with pytest.raises(KernelError, match="reduction"):
        K.scatter_elements(np.zeros(3), np.array([0]), np.ones(1), reduction="avg")


# ---------------------------------------------------------------------------------------------
# OneHot, NonZero, Compress


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_matches_onnxruntime(axis):
    idx = np.array([[0, -1, 3], [5, -7, 2]], dtype=np.int64)  # 5 and -7 are out of [-4, 3]: all off
    depth = np.array(4, dtype=np.int64)
    values = np.array([-2.0, 3.5], dtype=np.float32)
    got = K.one_hot(idx, depth, values, axis=axis)
    (want,) = ort("OneHot", [idx, depth, values], dict(axis=axis), opset=11)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_one_hot_float_depth_and_int_values():
    got = K.one_hot(np.array([1.0, 0.0]), np.array([3.0], dtype=np.float32), np.array([0, 1], dtype=np.int32))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [[0, 1, 0], [1, 0, 0]])


def test_non_zero():
    x = np.array([[0, 1.5, 0], [2, 0, -1]], dtype=np.float32)
    got = K.non_zero(x)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, [[0, 1, 1], [1, 0, 2]])
    assert K.non_zero(np.zeros((2, 3))).shape == (2, 0)
    assert K.non_zero(np.array(3.0)).shape == (0, 1)
    (want,) = ort("NonZero", [x], opset=13)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_compress(axis):
    data = rand(3, 4, dtype=np.float32)
    cond = np.array([True, False, True])
    got = K.compress(data, cond, axis=axis)
    want = np.compress(cond, data if axis is not None else data.ravel(), axis=axis)
    np.testing.assert_array_equal(got, want)
    attrs = {} if axis is None else dict(axis=axis)
    (ort_y,) = ort("Compress", [data, cond], attrs, opset=11)
    np.testing.assert_array_equal(got, ort_y)


def test_deprecated_scatter_runs_as_scatter_elements():
    data = np.zeros((3, 3), dtype=np.float32)
    idx = np.array([[1, 0, 2], [0, 2, 1]], dtype=np.int64)
    upd = np.arange(6, dtype=np.float32).reshape(2, 3)
    (got,) = gradgen_run("Scatter", [data, idx, upd], dict(axis=0), opset=10)
    np.testing.assert_array_equal(got, K.scatter_elements(data, idx, upd, axis=0))
