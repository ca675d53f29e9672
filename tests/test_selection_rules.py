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


def _scatter_model(node, data_shape, index_shape, updates_shape, weights):
    graph = helper.make_graph(
        [node, helper.make_node("Mul", ["y", "w"], ["wy"]), helper.make_node("ReduceSum", ["wy"], ["loss"], keepdims=0)],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, data_shape),
            helper.make_tensor_value_info("i", TensorProto.INT64, index_shape),
            helper.make_tensor_value_info("u", TensorProto.DOUBLE, updates_shape),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [onnx.numpy_helper.from_array(weights, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _finite_differences(session, feeds, name, eps=1e-6):
    grad = np.zeros_like(feeds[name])
    for k in range(grad.size):
        up, down = dict(feeds), dict(feeds)
        up[name], down[name] = feeds[name].copy(), feeds[name].copy()
        up[name].flat[k] += eps
        down[name].flat[k] -= eps
        grad.flat[k] = (session.run(up)["loss"] - session.run(down)["loss"]) / (2 * eps)
    return grad


def test_scatter_mul_gradients_with_repeated_positions_and_zero_updates():
    """ScatterElements and ScatterND with reduction='mul': positions hit by two and three updates,
    one of them holding a zero update and one two zeros (the others' product is then zero for every
    update there), against finite differences and torch.scatter_reduce(prod, include_self=True)."""
    import pytest

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    data = rng.uniform(0.5, 1.5, (2, 4))
    index = np.array([[0, 0, 1, 3, 3, 3], [2, 2, 2, 1, 0, 0]])
    updates = rng.uniform(0.5, 1.5, (2, 6))
    updates[0, 4] = 0.0  # one zero among three at (0, 3)
    updates[1, 4] = updates[1, 5] = 0.0  # two zeros at (1, 0)
    weights = rng.standard_normal((2, 4))
    node = helper.make_node("ScatterElements", ["x", "i", "u"], ["y"], axis=1, reduction="mul")
    built = gradgen.build_backward(_scatter_model(node, [2, 4], [2, 6], [2, 6], weights), wrt_inputs=True)
    session = Session(built.model)
    feeds = {"x": data, "i": index, "u": updates}
    out = session.run(feeds)
    forward = Session(_scatter_model(node, [2, 4], [2, 6], [2, 6], weights))
    for name in ("x", "u"):
        np.testing.assert_allclose(out[f"{name}_grad"], _finite_differences(forward, feeds, name), rtol=1e-6, atol=1e-8)
    x, u = torch.tensor(data, requires_grad=True), torch.tensor(updates, requires_grad=True)
    y = x.scatter_reduce(1, torch.tensor(index), u, reduce="prod", include_self=True)
    (y * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(out["x_grad"], x.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(out["u_grad"], u.grad.numpy(), rtol=1e-12, atol=1e-15)

    # ScatterND: rows of a (4, 3) tensor, row 1 hit twice (once by a row holding a zero)
    rows = np.array([[1], [3], [1]])
    row_updates = rng.uniform(0.5, 1.5, (3, 3))
    row_updates[2, 1] = 0.0
    node = helper.make_node("ScatterND", ["x", "i", "u"], ["y"], reduction="mul")
    nd_weights = rng.standard_normal((4, 3))
    model = _scatter_model(node, [4, 3], [3, 1], [3, 3], nd_weights)
    nd_feeds = {"x": rng.uniform(0.5, 1.5, (4, 3)), "i": rows, "u": row_updates}
    nd_out = Session(gradgen.build_backward(model, wrt_inputs=True).model).run(nd_feeds)
    nd_forward = Session(_scatter_model(node, [4, 3], [3, 1], [3, 3], nd_weights))
    for name in ("x", "u"):
        np.testing.assert_allclose(nd_out[f"{name}_grad"], _finite_differences(nd_forward, nd_feeds, name), rtol=1e-6, atol=1e-8)
