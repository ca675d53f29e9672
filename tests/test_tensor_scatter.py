"""TensorScatter (opset 24, attention's KV-cache update): the CPU kernel against ONNX's reference
and onnxruntime, its gradient graph (default and portable) on onnxruntime, and one-line errors
naming the node for what the op's contract excludes. Finite differences: tests/grad_cases/indexing.py."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.errors import KernelError
from gradgen.executor import Session

CASES = [
    # cache shape, update length, axis, mode, write_indices
    ((2, 3, 6, 4), 2, -2, "linear", None),
    ((2, 3, 6, 4), 1, -2, "linear", [5, 0]),
    ((2, 3, 6, 4), 4, 2, "circular", [4, 9]),
    ((3, 5), 5, 1, "circular", [1, 0, 7]),
    ((2, 4, 3), 0, 1, "linear", [4, 1]),
]


def _model(cache_shape, update_shape, axis, mode, with_indices, loss=False):
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, list(cache_shape)),
        helper.make_tensor_value_info("update", TensorProto.FLOAT, list(update_shape)),
    ]
    names = ["past", "update"]
    if with_indices:
        inputs.append(helper.make_tensor_value_info("write_indices", TensorProto.INT64, [cache_shape[0]]))
        names.append("write_indices")
    nodes = [helper.make_node("TensorScatter", names, ["present"], name="kv_update", axis=axis, mode=mode)]
    outputs = [helper.make_tensor_value_info("present", TensorProto.FLOAT, list(cache_shape))]
    if loss:  # loss = sum(present * w): a gradient that differs per position
        weights = np.random.default_rng(9).uniform(0.5, 1.5, cache_shape).astype(np.float32)
        tensor = helper.make_tensor("w", TensorProto.FLOAT, cache_shape, weights.ravel())
        nodes += [
            helper.make_node("Constant", [], ["w"], value=tensor),
            helper.make_node("Mul", ["present", "w"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
        ]
        outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes, "kv", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])


def _feeds(cache_shape, length, axis, indices):
    rng = np.random.default_rng(len(cache_shape) + length)
    update_shape = list(cache_shape)
    update_shape[axis] = length
    feeds = {
        "past": rng.standard_normal(cache_shape).astype(np.float32),
        "update": rng.standard_normal(update_shape).astype(np.float32),
    }
    if indices is not None:
        feeds["write_indices"] = np.array(indices, np.int64)
    return feeds, update_shape


@pytest.mark.parametrize("cache_shape,length,axis,mode,indices", CASES, ids=str)
def test_forward_matches_onnx_reference_and_onnxruntime(cache_shape, length, axis, mode, indices):
    feeds, update_shape = _feeds(cache_shape, length, axis, indices)
    model = _model(cache_shape, update_shape, axis, mode, indices is not None)
    got = Session(model).run(feeds)["present"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])
    ort = pytest.importorskip("onnxruntime")
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
@pytest.mark.parametrize("cache_shape,length,axis,mode,indices", CASES[1:4], ids=str)
def test_gradients_run_on_onnxruntime_too(cache_shape, length, axis, mode, indices, portable):
    """The backward graph's gradients: each cache position the update overwrote gets none, each
    update element the weight of the position it went to; the same on onnxruntime."""
    feeds, update_shape = _feeds(cache_shape, length, axis, indices)
    model = _model(cache_shape, update_shape, axis, mode, indices is not None, loss=True)
    built = gradgen.build_backward(model, wrt_inputs=True, portable=portable).model
    got = Session(built).run(feeds)
    weights = next(n for n in model.graph.node if n.output[0] == "w").attribute[0].t
    w = np.asarray(weights.float_data, np.float32).reshape(cache_shape)
    written = np.zeros(cache_shape, bool)
    probe = Session(_model(cache_shape, update_shape, axis, mode, indices is not None))
    marked = probe.run({**feeds, "past": np.zeros(cache_shape, np.float32), "update": np.ones(update_shape, np.float32)})
    written[marked["present"] == 1] = True
    np.testing.assert_array_equal(got["past_grad"], np.where(written, 0, w))
    assert got["update_grad"].shape == tuple(update_shape) and set(np.unique(got["update_grad"])) <= set(np.unique(w))
    np.testing.assert_allclose(got["update_grad"].sum(), w[written].sum(), rtol=1e-5)
    if portable:
        ort = pytest.importorskip("onnxruntime")
        session = ort.InferenceSession(ir.to_proto(built).SerializeToString(), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        for name, value in zip(names, session.run(None, feeds)):
            np.testing.assert_allclose(value, got[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize(
    "cache_shape,update_shape,attrs,indices,match",
    [
        ((2, 6, 4), (2, 2, 4), {"axis": 1}, [5, 0], r"write index 5 of batch row 0 .* 0 <= index <= 4"),
        ((2, 6, 4), (2, 2, 4), {"axis": 1}, [-1, 0], r"write index -1 of batch row 0 is negative"),
        ((2, 6, 4), (2, 2, 4), {"axis": 1, "mode": "circular"}, [0, -3], r"write index -3 of batch row 1 is negative"),
        ((2, 6, 4), (2, 2, 4), {"axis": 0}, None, r"not the batch axis"),
        ((2, 6, 4), (2, 2, 5), {"axis": 1}, None, r"must match past_cache"),
        ((2, 6, 4), (2, 7, 4), {"axis": 1}, None, r"no longer"),
        ((2, 6, 4), (2, 2, 4), {"axis": 1, "mode": "ring"}, None, r"mode must be 'linear' or 'circular'"),
    ],
    ids=["past-the-end", "negative", "negative-circular", "batch-axis", "other-axis", "too-long", "mode"],
)
def test_contract_violations_are_one_line_errors_naming_the_node(cache_shape, update_shape, attrs, indices, match):
    rng = np.random.default_rng(3)
    feeds = {
        "past": rng.standard_normal(cache_shape).astype(np.float32),
        "update": rng.standard_normal(update_shape).astype(np.float32),
    }
    if indices is not None:
        feeds["write_indices"] = np.array(indices, np.int64)
    inputs = [
        helper.make_tensor_value_info("past", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("update", TensorProto.FLOAT, None),
    ] + ([helper.make_tensor_value_info("write_indices", TensorProto.INT64, None)] if indices is not None else [])
    node = helper.make_node("TensorScatter", [i.name for i in inputs], ["present"], name="kv_update", **attrs)
    graph = helper.make_graph([node], "kv", inputs, [helper.make_tensor_value_info("present", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    with pytest.raises(KernelError, match=match) as info:
        Session(model).run(feeds)
    message = str(info.value)
    assert "kv_update" in message and "TensorScatter" in message and "\n" not in message


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_random_write_indices_keep_the_update_inside_the_cache(mode):
    from gradgen.inputs import random_feeds

    model = ir.from_proto(_model((64, 2, 9, 3), (64, 2, 4, 3), -2, mode, True))
    starts = random_feeds(model, seed=1)["write_indices"]
    high = 9 if mode == "circular" else 6
    assert starts.min() >= 0 and starts.max() < high and len(set(starts.tolist())) > 1
    Session(model).run(random_feeds(model, seed=1))
