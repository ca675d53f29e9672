"""Resize whose output size is known at run time only, as ``F.interpolate(x, size=skip.shape[-2:])``
exported with dynamic axes writes it (sizes from Shape of another tensor) or a scale on a symbolic
axis: the gradient's interpolation matrices are made at run time, by resizing an identity matrix
with the node's own attributes. Build-backward refused these ("Resize needs static sizes of axis
2 for its gradient")."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.check import check_gradients

D = TensorProto.DOUBLE

MODES = [
    {"mode": "linear", "coordinate_transformation_mode": "half_pixel"},
    {"mode": "linear", "coordinate_transformation_mode": "align_corners"},
    {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"},
    {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
    {"mode": "nearest", "coordinate_transformation_mode": "half_pixel", "nearest_mode": "round_prefer_floor"},
    {"mode": "cubic", "coordinate_transformation_mode": "half_pixel", "cubic_coeff_a": -0.75},
    {"mode": "linear", "coordinate_transformation_mode": "half_pixel", "antialias": 1},
]


def _sizes_from_a_skip_model(attrs: dict) -> tuple:
    """y = Resize(x, sizes = Shape(skip)) * skip; every dim symbolic."""
    nodes = [
        helper.make_node("Shape", ["skip"], ["skip_shape"]),
        helper.make_node("Resize", ["x", "", "", "skip_shape"], ["r"], name="resize", **attrs),
        helper.make_node("Mul", ["r", "skip"], ["y"]),
    ]
    inputs = [
        helper.make_tensor_value_info("x", D, ["N", "C", "h", "w"]),
        helper.make_tensor_value_info("skip", D, ["N", "C", "H", "W"]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", D, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


@pytest.mark.parametrize("attrs", MODES, ids=lambda a: "-".join(str(v) for v in a.values()))
@pytest.mark.parametrize(("small", "large"), [((3, 4), (7, 5)), ((6, 5), (4, 3))], ids=["up", "down"])
def test_sizes_from_another_tensors_shape(attrs, small, large):
    model = _sizes_from_a_skip_model(attrs)
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, *small)), "skip": rng.standard_normal((2, 3, *large))}
    report = check_gradients(model, inputs=feeds, wrt=["x"], loss="y")
    assert report.passed, report.format()


@pytest.mark.parametrize("mode", ["linear", "nearest", "cubic"])
def test_a_scale_on_a_symbolic_axis(mode):
    """A non-integer scale on a symbolic axis: the identity is resized by the same scale (the
    output size floor(n * 1.5), and the coordinates of the scale, not of the size ratio)."""
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode)]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", D, ["N", 2, "h", "w"])],
        [helper.make_tensor_value_info("y", D, None)],
        initializer=[helper.make_tensor("scales", TensorProto.FLOAT, [4], [1.0, 1.0, 1.5, 0.6])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    x = np.random.default_rng(1).standard_normal((2, 2, 5, 7))
    report = check_gradients(model, inputs={"x": x}, wrt=["x"], loss="y")
    assert report.passed, report.format()


def test_the_backward_graph_takes_other_sizes_than_it_was_checked_at():
    """One backward graph for every size: run at two sizes, each against its own finite differences."""
    model = _sizes_from_a_skip_model(MODES[0])
    built = gradgen.build_backward(model, wrt_inputs=True, loss="y")
    assert "Resize" in {n.op_type for n in built.model.graph}
    rng = np.random.default_rng(2)
    for small, large in (((2, 3), (5, 4)), ((4, 4), (3, 9))):
        feeds = {"x": rng.standard_normal((1, 2, *small)), "skip": rng.standard_normal((1, 2, *large))}
        report = check_gradients(model, inputs=feeds, wrt=["x"], loss="y")
        assert report.passed, report.format()
