"""AveragePool and LpPool with ceil_mode=1 on spatial sizes known at run time only (a sequence
pooled by Funnel Transformer, exported with dynamic axes): the last window's overhang depends on
the size, so the gradient finds the windows' tap counts and the transpose's extent at run time.
Build-backward refused these ("AveragePool with ceil_mode=1 needs static spatial dims")."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.check import check_gradients

D = TensorProto.DOUBLE

WINDOWS = [
    {"kernel_shape": [3], "strides": [2]},
    {"kernel_shape": [2], "strides": [3]},  # inputs between windows get no gradient
    {"kernel_shape": [3], "strides": [2], "pads": [1, 1]},
    {"kernel_shape": [2], "strides": [2], "dilations": [2], "pads": [0, 1]},
]


def _model(op: str, window: dict, extra: dict) -> object:
    node = helper.make_node(op, ["x"], ["y"], ceil_mode=1, **window, **extra)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", D, ["N", "C", "T"])], [helper.make_tensor_value_info("y", D, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: "-".join(f"{k}{v}" for k, v in w.items()))
@pytest.mark.parametrize(
    ("op", "extra"),
    [("AveragePool", {"count_include_pad": 0}), ("AveragePool", {"count_include_pad": 1}), ("LpPool", {"p": 2})],
    ids=["avg", "avg-include-pad", "lp2"],
)
def test_ceil_mode_windows_on_a_symbolic_length(op, extra, window):
    model = _model(op, window, extra)
    built = gradgen.build_backward(model, wrt_inputs=True, loss="y")
    assert "ConvTranspose" in {n.op_type for n in built.model.graph}
    rng = np.random.default_rng(0)
    for length in (7, 8, 10):  # the overhang of the last window differs with the length
        x = rng.uniform(0.5, 1.5, (2, 2, length)) * rng.choice([-1.0, 1.0], (2, 2, length))
        report = check_gradients(model, inputs={"x": x}, wrt=["x"], loss="y")
        assert report.passed, (length, report.format())


def test_two_spatial_axes():
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], ceil_mode=1)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", D, ["N", 2, "H", "W"])], [helper.make_tensor_value_info("y", D, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    x = np.random.default_rng(3).standard_normal((1, 2, 6, 5))
    report = check_gradients(model, inputs={"x": x}, wrt=["x"], loss="y")
    assert report.passed, report.format()
