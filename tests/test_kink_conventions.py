"""Subgradients at x == 0 follow PyTorch's backward kernels (found by scripts/torch_sweep.py):
leaky_relu, prelu and elu test ``x > 0``, so at 0 they take the negative branch's slope
(negative_slope, the PRelu weight, alpha); PRelu's weight gets no gradient there (x * dY = 0)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session

X = np.array([-1.0, 0.0, 2.0], dtype=np.float32)
DY = np.array([0.5, -0.75, 1.25], dtype=np.float32)


def _grad(op: str, attrs: dict, extra: list | None = None) -> dict[str, np.ndarray]:
    inits = [numpy_helper.from_array(DY, "w")]
    inputs = ["x"]
    if extra is not None:
        inits.append(numpy_helper.from_array(extra, "slope"))
        inputs.append("slope")
    nodes = [
        helper.make_node(op, inputs, ["y"], **attrs),
        helper.make_node("Mul", ["y", "w"], ["yw"]),
        helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = gradgen.build_backward(model, wrt=["x", "slope"] if extra is not None else ["x"])
    out = Session(built.model).run({"x": X})
    return {w: out[g] for w, g in zip(built.wrt, built.gradient_names)}


@pytest.mark.parametrize(
    "op, attrs, slope_at_zero",
    [("LeakyRelu", {"alpha": 0.2}, 0.2), ("Elu", {"alpha": 0.7}, 0.7), ("Selu", {}, 1.0507010221481323 * 1.6732631921768188)],
)
def test_negative_slope_at_zero(op, attrs, slope_at_zero):
    dx = _grad(op, attrs)["x"]
    assert dx[1] == pytest.approx(DY[1] * slope_at_zero, rel=1e-6)
    assert dx[2] == pytest.approx(DY[2] * (1.0507010221481323 if op == "Selu" else 1.0), rel=1e-6)


def test_prelu_at_zero():
    grads = _grad("PRelu", {}, np.array([0.3], dtype=np.float32))
    np.testing.assert_allclose(grads["x"], [DY[0] * 0.3, DY[1] * 0.3, DY[2]], rtol=1e-6)
    np.testing.assert_allclose(grads["slope"], [DY[0] * X[0]], rtol=1e-6)  # x = 0 adds 0
