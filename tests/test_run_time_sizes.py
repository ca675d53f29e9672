"""Gradients of ops whose sizes are known at run time only, as exports with dynamic axes write
them; build-backward refused each of these with "... needs static sizes / spatial dims".

- Resize whose output size comes from another tensor's Shape (``F.interpolate(x,
  size=skip.shape[-2:])``) or a scale on a symbolic axis: the interpolation matrix is made at run
  time, by resizing an identity matrix with the node's own attributes.
- AveragePool / LpPool with ceil_mode=1 on a symbolic length (Funnel Transformer's pooling): the
  last window's overhang depends on the length, so the tap counts and the transpose's extent are
  found at run time.
- ConvTranspose with auto_pad SAME_*: its pads depend on W alone.
- AffineGrid of a size known at run time (``F.affine_grid(theta, x.size())``): the base grid is
  made at run time by AffineGrid itself, which is linear in theta.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.check import check_gradients

D = TensorProto.DOUBLE


# -- Resize --------------------------------------------------------------------------------------

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


# -- pools with ceil_mode -------------------------------------------------------------------------

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


# -- ConvTranspose with SAME padding -----------------------------------------------------------


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize(("strides", "output_padding"), [([2, 2], [0, 0]), ([3, 2], [1, 0])])
def test_conv_transpose_same_padding_on_symbolic_spatial_dims(auto_pad, strides, output_padding):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2, 3, 3, 2))
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], auto_pad=auto_pad, strides=strides, output_padding=output_padding)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", D, ["N", 2, "H", "W"])],
        [helper.make_tensor_value_info("y", D, None)],
        initializer=[helper.make_tensor("w", D, w.shape, w.reshape(-1).tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    for size in ((3, 4), (5, 2)):
        x = rng.standard_normal((1, 2, *size))
        report = check_gradients(model, inputs={"x": x}, wrt_inputs=True, wrt=["w"], loss="y")
        assert report.passed and {t.name for t in report.tensors} == {"x", "w"}, report.format()


# -- AffineGrid ----------------------------------------------------------------------------------


@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("nd", [2, 3])
def test_affine_grid_of_another_tensors_size(nd, align_corners):
    """``F.affine_grid(theta, x.size())`` with dynamic axes: the base grid is made at run time by
    AffineGrid itself, which is linear in theta."""
    spatial = ["H", "W"] if nd == 2 else ["D", "H", "W"]
    nodes = [
        helper.make_node("Shape", ["x"], ["size"]),
        helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align_corners),
    ]
    inputs = [
        helper.make_tensor_value_info("theta", D, ["N", nd, nd + 1]),
        helper.make_tensor_value_info("x", D, ["N", 1, *spatial]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("grid", D, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    rng = np.random.default_rng(nd)
    for sizes in ((3, 4, 5)[:nd], (2, 6, 3)[:nd]):
        feeds = {"theta": rng.standard_normal((2, nd, nd + 1)), "x": np.zeros((2, 1, *sizes))}
        report = check_gradients(model, inputs=feeds, wrt=["theta"], loss="grid")
        assert report.passed, (sizes, report.format())
