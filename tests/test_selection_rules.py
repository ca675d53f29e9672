"""Rules of ops that pick elements (Unique, Compress, OneHot) at the points finite differences
cannot see: ties and omitted outputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session


def _model(nodes, x_shape):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_unique_gives_each_value_s_gradient_to_its_first_occurrence():
    """Y = X[indices] with indices the first occurrences: equal values after the first get none
    (moving one of them alone would split the value, so the gradient there is one-sided)."""
    x = np.array([1.5, -0.3, 1.5, 2.0, -0.3, 1.5])
    weights = np.array([10.0, 20.0, 30.0])  # per unique value, in sorted order: -0.3, 1.5, 2.0
    nodes = [
        helper.make_node("Unique", ["x"], ["y"], sorted=1),  # indices omitted: the rule adds the output
        helper.make_node("Mul", ["y", "w"], ["wy"]),
        helper.make_node("ReduceSum", ["wy"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [6])
    model.graph.initializer.append(onnx.numpy_helper.from_array(weights, "w"))
    built = gradgen.build_backward(model, wrt_inputs=True)
    out = Session(built.model).run({"x": x})
    np.testing.assert_array_equal(out["x_grad"], [20.0, 10.0, 0.0, 30.0, 0.0, 0.0])
    np.testing.assert_array_equal(out["w_grad"], [-0.3, 1.5, 2.0])


def test_unique_along_an_axis_in_first_occurrence_order():
    x = np.array([[1.0, 2.0], [0.5, 0.5], [1.0, 2.0], [-1.0, 3.0]])
    nodes = [
        helper.make_node("Unique", ["x"], ["y", "first", "inverse", "counts"], axis=0, sorted=0),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
    ]
    out = Session(gradgen.build_backward(_model(nodes, [4, 2]), wrt_inputs=True).model).run({"x": x})
    np.testing.assert_array_equal(out["x_grad"], 2 * x * np.array([[1], [1], [0], [1]]))


def test_scatter_max_splits_the_gradient_among_ties_as_pytorch_does():
    """ScatterElements reduction='max' against torch.scatter_reduce(amax, include_self=True), with
    a tie between data and an update and between two updates."""
    import pytest

    torch = pytest.importorskip("torch")
    data = np.array([[1.0, 0.5, -2.0], [0.3, 0.3, 0.0]])
    index = np.array([[0, 0, 2], [1, 2, 2]])
    updates = np.array([[1.0, 0.2, 3.0], [-1.0, 4.0, 4.0]])
    weights = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    nodes = [
        helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=1, reduction="max"),
        helper.make_node("Mul", ["y", "w"], ["wy"]),
        helper.make_node("ReduceSum", ["wy"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 3]),
            helper.make_tensor_value_info("u", TensorProto.DOUBLE, [2, 3]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    out = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": data, "i": index, "u": updates})
    x, u = torch.tensor(data, requires_grad=True), torch.tensor(updates, requires_grad=True)
    y = x.scatter_reduce(1, torch.tensor(index), u, reduce="amax", include_self=True)
    (y * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(out["x_grad"], x.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["u_grad"], u.grad.numpy(), rtol=1e-12)
