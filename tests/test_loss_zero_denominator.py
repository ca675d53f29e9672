"""SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss with reduction="mean" and nothing to average
(every label equal to ignore_index, zero total weight, an empty batch).

The loss is sum(w_i * l_i) / sum(w_i) = 0 / 0. What each party gives:

| | loss | gradient of the scores |
|---|---|---|
| ONNX spec (function body) and reference evaluator | NaN | - |
| ONNX Runtime (inference wheel) | NaN | - |
| ONNX Runtime training (SoftmaxCrossEntropyLoss / ...Grad) | 0 | 0 |
| PyTorch (cross_entropy, nll_loss) | NaN | 0 (all ignored); NaN in rows whose label is used (zero total weight) |
| gradgen | NaN | 0 |

gradgen keeps the forward of the spec (the forward fuzzer compares it with ONNX Runtime) and gives
zero gradients: no input changes a loss with no sample in it, and a NaN gradient would poison every
weight of a training step whose batch is all padding. It used to give NaN gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.executor import Session

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
F = torch.nn.functional

OPS = ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"]


def _model(op, x_shape, weights=None, ignore_index=1, log_prob=False):
    names = ["x", "labels"] + (["w"] if weights is not None else [])
    outputs = ["loss"] + (["log_prob"] if log_prob else [])
    node = helper.make_node(op, names, outputs, name="loss_node", reduction="mean", ignore_index=ignore_index)
    nodes = [node]
    if log_prob:  # the log_prob output feeds the loss too, so its gradient path is exercised
        nodes += [
            helper.make_node("ReduceSum", ["log_prob"], ["lp"], keepdims=0),
            helper.make_node("Mul", ["lp", "tiny"], ["lp_small"]),
            helper.make_node("Add", ["loss", "lp_small"], ["total"]),
        ]
    inits = [numpy_helper.from_array(weights, "w")] if weights is not None else []
    inits.append(numpy_helper.from_array(np.array(0.0, np.float64), "tiny"))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x_shape)),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [x_shape[0], *x_shape[2:]]),
        ],
        [helper.make_tensor_value_info("total" if log_prob else "loss", TensorProto.DOUBLE, [])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _torch(op, x, labels, weights, ignore_index):
    xt = torch.tensor(x, requires_grad=True)
    fn = F.cross_entropy if op == "SoftmaxCrossEntropyLoss" else F.nll_loss
    loss = fn(
        xt,
        torch.tensor(labels),
        weight=None if weights is None else torch.tensor(weights),
        ignore_index=ignore_index,
        reduction="mean",
    )
    loss.backward()
    return loss.item(), xt.grad.numpy()


CASES = [
    pytest.param(op, shape, weighted, id=f"{op}-{'x'.join(map(str, shape))}{'-weights' if weighted else ''}")
    for op in OPS
    for shape in [(3, 4), (2, 3, 5)]
    for weighted in (False, True)
]


@pytest.mark.parametrize("op,shape,weighted", CASES)
def test_all_labels_ignored_loss_nan_gradient_zero(op, shape, weighted):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    labels = np.full((shape[0], *shape[2:]), 1, np.int64)
    weights = rng.uniform(0.5, 2.0, shape[1]) if weighted else None
    model = _model(op, shape, weights)
    feeds = {"x": x, "labels": labels}

    assert np.isnan(Session(model).run(feeds)["loss"])
    assert np.isnan(ReferenceEvaluator(model).run(None, feeds)[0])
    assert np.isnan(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0])
    torch_loss, torch_grad = _torch(op, x, labels, weights, 1)
    assert np.isnan(torch_loss)

    wrt = ["x"] + (["w"] if weighted else [])
    got = Session(gradgen.build_backward(model, wrt_inputs=True, wrt=wrt).model).run(feeds)
    assert np.isnan(got["loss"])
    np.testing.assert_array_equal(got["x_grad"], np.zeros(shape))
    np.testing.assert_array_equal(got["x_grad"], torch_grad)
    if weighted:
        np.testing.assert_array_equal(got["w_grad"], np.zeros(shape[1]))


@pytest.mark.parametrize("op", OPS)
def test_zero_total_weight_gradients_are_zero(op):
    """Labels used, but all of classes whose weight is 0: 0 / 0 again. gradgen gives zero gradients
    as ONNX Runtime training does; PyTorch gives NaN here (and 0 when every label is ignored)."""
    x = np.random.default_rng(1).standard_normal((4, 3))
    labels = np.array([0, 2, 0, 1], np.int64)  # 1 is ignored; classes 0 and 2 weigh 0
    weights = np.array([0.0, 1.5, 0.0])
    model = _model(op, x.shape, weights)
    got = Session(gradgen.build_backward(model, wrt_inputs=True, wrt=["x", "w"]).model).run({"x": x, "labels": labels})
    assert np.isnan(got["loss"])
    np.testing.assert_array_equal(got["x_grad"], np.zeros(x.shape))
    np.testing.assert_array_equal(got["w_grad"], np.zeros(3))
    assert np.isnan(_torch(op, x, labels, weights, 1)[1]).any()  # PyTorch: NaN in used rows (see the table)


def test_all_ignored_with_log_prob_output():
    """The log_prob output's own gradient still flows; only the loss's part is zero."""
    x = np.random.default_rng(2).standard_normal((2, 3))
    labels = np.array([1, 1], np.int64)
    model = _model("SoftmaxCrossEntropyLoss", x.shape, log_prob=True)
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x, "labels": labels})
    assert np.all(np.isfinite(got["x_grad"]))
    np.testing.assert_allclose(got["x_grad"], np.zeros(x.shape), atol=1e-15)  # tiny = 0


@pytest.mark.parametrize("op", OPS)
def test_some_labels_ignored_still_matches_torch(op):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4))
    labels = np.array([1, 3, 1, 0, 2], np.int64)
    weights = rng.uniform(0.5, 2.0, 4)
    model = _model(op, x.shape, weights)
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x, "labels": labels})
    torch_loss, torch_grad = _torch(op, x, labels, weights, 1)
    np.testing.assert_allclose(got["loss"], torch_loss, rtol=1e-12)
    np.testing.assert_allclose(got["x_grad"], torch_grad, rtol=1e-10, atol=1e-14)
