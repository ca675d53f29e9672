"""Models below opset 11 (ONNX's pytorch-converted and pytorch-operator test models are opset 6):
``gradgen run`` ran them as they are, and the kernels do not take their attribute forms (Add's and
Gemm's ``broadcast``, Pad-2's ``pads``): "TypeError: kernel() got an unexpected keyword argument
'broadcast'". They now run as ONNX's version converter makes them, as build-backward already did;
``gradgen check`` converts before its float64 copy (the converter writes Clip-6's bounds as float32
constants, which met float64 in the gradient graph)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from gradgen.check import check_gradients
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


def test_opset_6_prelu_slopes_are_per_channel():
    """PRelu-6 applies a slope of C values per channel (axis 1); the converter left it to opset 7's
    broadcasting, which aligns it with the last axis ("slope shape [3] does not broadcast to X shape
    [2, 3, 4]", and a wrong answer where the last axis happens to have C entries too)."""
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [_info("x", [2, 3, 3]), _info("slope", [3])],
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
