"""A loss that reaches a node only through outputs that read some of its inputs (LayerNormalization's
Mean, SoftmaxCrossEntropyLoss's log_prob, BatchNormalization's running statistics) asks no gradient
of the others: the build used to stop with "its gradient rule gives no gradient for input 1 ...
this is a gradgen bug"."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import UsageError
from gradgen.executor import Session


def _model(nodes, inputs, initializers, opset=17):
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], initializer=initializers
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _sum_of(name: str) -> list:
    return [helper.make_node("ReduceSum", [name], ["loss"], keepdims=0, name="sum")]


def test_layer_norm_mean_alone():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y", "mean", "inv_std"], name="ln")]
    nodes += [helper.make_node("Cast", ["mean"], ["mean64"], to=TensorProto.DOUBLE)] + _sum_of("mean64")
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [numpy_helper.from_array(np.ones(4, np.float32), "w"), numpy_helper.from_array(np.zeros(4, np.float32), "b")],
    )
    built = gradgen.build_backward(model, wrt=["w", "b"], wrt_inputs=True)
    got = Session(built.model).run({"x": x})
    names = dict(zip(built.wrt, built.gradient_names))
    np.testing.assert_array_equal(got[names["w"]], 0.0)  # the mean does not read the scale or the bias
    np.testing.assert_array_equal(got[names["b"]], 0.0)
    np.testing.assert_allclose(got[names["x"]], np.full((3, 4), 0.25), rtol=1e-6)  # d mean / dx = 1/4


def test_cross_entropy_log_prob_alone_with_class_weights():
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels", "weights"], ["ce", "log_prob"], name="sce"),
        helper.make_node("Mul", ["log_prob", "log_prob"], ["sq"], name="square"),
        *_sum_of("sq"),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("scores", TensorProto.DOUBLE, [4, 5]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [4]),
        ],
        [numpy_helper.from_array(rng.uniform(0.5, 2, 5), "weights")],
    )
    with pytest.raises(UsageError, match="no float initializer feeds the loss"):
        gradgen.build_backward(model)  # the default --wrt: log_prob does not read the class weights
    built = gradgen.build_backward(model, wrt=["weights"])
    feeds = {"scores": rng.standard_normal((4, 5)), "labels": np.array([0, 3, 1, 4], np.int64)}
    np.testing.assert_array_equal(Session(built.model).run(feeds)[built.gradient_names[0]], 0.0)
    report = check_gradients(model, inputs=feeds, wrt_inputs=True)
    assert report.passed and [t.name for t in report.tensors] == ["scores"], report.format()


def test_batch_norm_running_mean_alone():
    rng = np.random.default_rng(2)
    c = 3
    nodes = [
        helper.make_node(
            "BatchNormalization",
            ["x", "scale", "bias", "mean", "var"],
            ["y", "running_mean", "running_var"],
            training_mode=1,
            momentum=0.8,
            name="bn",
        ),
        helper.make_node("Mul", ["running_mean", "running_var"], ["both"], name="both"),
        *_sum_of("both"),
    ]
    stats = [rng.uniform(0.5, 1.5, c) for _ in range(4)]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, c, 4])],
        [numpy_helper.from_array(v, n) for v, n in zip(stats, ["scale", "bias", "mean", "var"])],
        opset=15,
    )
    report = check_gradients(model, inputs={"x": rng.standard_normal((2, c, 4))}, wrt_inputs=True)
    by_name = {t.name: t for t in report.tensors}
    assert report.passed and set(by_name) == {"x", "mean", "var"}, report.format()
