"""A wide-vocabulary cross-entropy whose backward graph holds SoftmaxCrossEntropyLoss's log-probabilities."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import gradgen


def cross_entropy_head(
    rows: int = 16,
    classes: int = 1100,
    width: int = 24,
    *,
    reduction: str = "mean",
    weights: bool = False,
    ignore_index=None,
    seed: int = 0,
):
    """(backward model, feeds): logits = h @ W (h, W parameters), SoftmaxCrossEntropyLoss over
    ``classes``; the labels are a graph input."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((rows, width)).astype(np.float32), "h"),
        numpy_helper.from_array((rng.standard_normal((width, classes)) / np.sqrt(width)).astype(np.float32), "W"),
    ]
    loss_inputs = ["logits", "labels"]
    if weights:
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, classes).astype(np.float32), "class_weights"))
        loss_inputs.append("class_weights")
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    nodes = [
        helper.make_node("MatMul", ["h", "W"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", loss_inputs, ["loss"], **attrs),
    ]
    loss_shape = [rows] if reduction == "none" else []
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("labels", TensorProto.INT64, [rows])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, loss_shape)],
        inits,
        value_info=[helper.make_tensor_value_info("logits", TensorProto.FLOAT, [rows, classes])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    labels = rng.integers(0, classes, rows).astype(np.int64)
    if ignore_index is not None:
        labels[::5] = ignore_index
    built = gradgen.build_backward(model, loss="loss", wrt=["h", "W"])
    feeds = {"labels": labels}
    if reduction == "none":  # a vector loss: its seed is an input
        feeds["loss_grad"] = rng.standard_normal(rows).astype(np.float32)
    return built.model, feeds
