"""Models below opset 11 (ONNX's pytorch-converted and pytorch-operator test models are opset 6):
``gradgen run`` ran them as they are, and the kernels do not take their attribute forms (Add's and
Gemm's ``broadcast``, Pad-2's ``pads``): "TypeError: kernel() got an unexpected keyword argument
'broadcast'". They now run as ONNX's version converter makes them, as build-backward already did;
``gradgen check`` converts before its float64 copy (the converter writes Clip-6's bounds as float32
constants, which met float64 in the gradient graph)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.check import check_gradients
from gradgen.errors import ModelError
from gradgen.executor import Session


def _model(nodes, inputs, outputs, opset=6):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=3)


def _info(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_opset_6_broadcast_add_gemm_and_pad_run():
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"], broadcast=1, axis=1),
        helper.make_node("Gemm", ["s", "w", "c"], ["g"], broadcast=1, transB=1),
        helper.make_node("Pad", ["g"], ["y"], pads=[0, 1, 0, 2], value=0.5),
    ]
    model = _model(nodes, [_info("x", [2, 3]), _info("b", [3]), _info("w", [4, 3]), _info("c", [4])], [_info("y", [2, 7])])
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in (("x", (2, 3)), ("b", (3,)), ("w", (4, 3)), ("c", (4,)))}
    got = Session(model).run(feeds)["y"]
    want = np.pad((feeds["x"] + feeds["b"]) @ feeds["w"].T + feeds["c"], [(0, 0), (1, 2)], constant_values=0.5)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_opset_6_clip_is_checked_in_float64():
    nodes = [
        helper.make_node("Clip", ["x"], ["c"], min=-0.5, max=0.75),
        helper.make_node("Mul", ["c", "x"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [_info("x", [5])], [_info("loss", [])])
    x = np.array([-1.0, -0.3, 0.2, 0.6, 2.0], np.float32)  # away from the bounds
    report = check_gradients(model, inputs={"x": x}, wrt_inputs=True)
    assert report.passed, report.format()


@pytest.mark.parametrize("x_dims", [[2, 3, 3], ["N", "C", 3]], ids=["static", "symbolic"])
def test_opset_6_prelu_slopes_are_per_channel(x_dims):
    """PRelu-6 applies a slope of C values per channel (axis 1); the converter left it to opset 7's
    broadcasting, which aligns it with the last axis ("slope shape [3] does not broadcast to X shape
    [2, 3, 4]", and a wrong answer where the last axis happens to have C entries too); a channel
    count the model leaves symbolic is taken to be the slope's."""
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [_info("x", x_dims), _info("slope", [3])],
        [_info("y", [2, 3, 3])],
        initializer=[helper.make_tensor("slope", TensorProto.FLOAT, [3], [0.1, 0.2, 0.3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    x = -np.ones((2, 3, 3), np.float32)
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_allclose(got, -np.array([0.1, 0.2, 0.3], np.float32)[None, :, None] * np.ones((2, 3, 3)))
    moved = x + 0.5 * np.arange(18, dtype=np.float32).reshape(2, 3, 3) / 18  # off the kink at 0
    report = check_gradients(model, inputs={"x": moved}, loss="y")
    assert report.passed and report.tensors[0].name == "slope", report.format()


@pytest.mark.parametrize(
    ("x_dims", "b_dims", "axis"),
    [
        ([2, 3, 2], [3], 1),
        (["N", 3, 2], [3], 1),
        (["N", 3, 2, 2], [3], 1),
        ([2, 3, 4], [2, 3], 0),
        ([2, 3, 4], [3, 4], 1),
        (["N", 3, 4], [4], -1),
    ],
    ids=["per-channel", "per-channel, symbolic batch", "conv bias, symbolic batch", "leading", "trailing", "last axis"],
)
def test_opset_6_broadcast_along_an_axis_converts_and_differentiates(x_dims, b_dims, axis):
    """Add-6 with broadcast=1 places B at ``axis`` of A. ONNX's converter asserted on a B that ends
    before A's last axis (a per-channel bias: "Dimension 0 of input 2 does not match dimension 0
    of input 1") and on any symbolic dim ("N Dimension is a param instead of an int"); B is now
    unsqueezed onto A's trailing axes first, and the converter sees each symbol as a placeholder
    number, put back after, so the model keeps taking any batch."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["s"], broadcast=1, axis=axis),
        helper.make_node("Mul", ["s", "s"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    b = rng.standard_normal(b_dims).astype(np.float32)
    graph = helper.make_graph(
        nodes,
        "g",
        [_info("x", x_dims), _info("b", b_dims)],
        [_info("y", x_dims)],
        initializer=[helper.make_tensor("b", TensorProto.FLOAT, b_dims, b.reshape(-1).tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 6)], ir_version=3)
    start = axis % len(x_dims)
    b_aligned = b.reshape(b_dims + [1] * (len(x_dims) - start - len(b_dims)))
    for batch in (1, 3) if isinstance(x_dims[0], str) else (x_dims[0],):
        x = rng.standard_normal([batch, *x_dims[1:]]).astype(np.float32)
        got = Session(model).run({"x": x})["y"]
        np.testing.assert_allclose(got, (x + b_aligned) ** 2, rtol=1e-5)
    report = check_gradients(model, inputs={"x": x}, loss="y", wrt_inputs=True)
    assert report.passed and {t.name for t in report.tensors} >= {"x", "b"}, report.format()


def test_an_old_model_the_converter_refuses_is_a_one_line_model_error_when_run():
    """Not a kernel's TypeError about Add's ``axis`` attribute from running it unconverted."""
    nodes = [helper.make_node("Add", ["x", "b"], ["y"], broadcast=1, axis=1)]
    model = _model(nodes, [_info("x", [2, 3]), _info("b", [3, 4])], [_info("y", [2, 3])])
    with pytest.raises(ModelError, match=r"^the model's opset 6 is below 14 and could not be converted to 17: ") as caught:
        Session(model)
    assert "\n" not in str(caught.value)
