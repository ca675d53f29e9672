"""Patterns found by exporting unseen model variants (tests/variants/make_variants.py) that the
one-node finite-difference cases cannot express: the Resize kernel against ONNX's reference, inputs
of unknown rank, and constant-derived pads/sizes that only fold through a subgraph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session

RESIZE_CONFIGS = [
    ((1, 2, 3, 4), dict(scales=[1, 1, 2, 2]), dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    ((1, 1, 5, 7), dict(scales=[1, 1, 0.6, 0.5]), {}),
    ((2, 1, 4, 3), dict(sizes=[2, 1, 7, 5]), dict(nearest_mode="round_prefer_ceil")),
    ((1, 2, 3, 4), dict(sizes=[1, 2, 6, 5]), dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel")),
    ((1, 1, 4, 3), dict(scales=[1, 1, 1.5, 2.0]), dict(mode="linear", coordinate_transformation_mode="align_corners")),
    ((1, 1, 6, 5), dict(sizes=[1, 1, 4, 2]), dict(mode="linear")),
    ((1, 1, 4, 4), dict(scales=[1, 1, 2, 1.5]), dict(mode="cubic")),
    ((1, 1, 5, 3), dict(sizes=[1, 1, 7, 4]), dict(mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5)),
    ((1, 1, 3, 5), dict(scales=[1, 1, 1.7, 0.6]), dict(mode="linear", coordinate_transformation_mode="half_pixel_symmetric")),
    ((1, 1, 4, 6), dict(sizes=[3, 5]), dict(axes=[2, 3], keep_aspect_ratio_policy="not_larger")),
]


def _model(nodes, inputs, outputs, initializers=(), opset=19):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


@pytest.mark.parametrize("shape,given,attrs", RESIZE_CONFIGS)
def test_resize_kernel_matches_onnx_reference(shape, given, attrs):
    from onnx.reference import ReferenceEvaluator

    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(given["scales"], np.float32), "scales")] if "scales" in given else []
    if "sizes" in given:
        inits.append(numpy_helper.from_array(np.array(given["sizes"], np.int64), "sizes"))
    names = ["x", "", "scales" if "scales" in given else ""] + (["sizes"] if "sizes" in given else [])
    node = helper.make_node("Resize", names, ["y"], **attrs)
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _loss_tail(out: str):
    """loss = ReduceSum(out * out)."""
    return [helper.make_node("Mul", [out, out], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]


def _grads(model, feeds, **kwargs):
    built = gradgen.build_backward(model, **kwargs)
    return Session(built.model).run(feeds)


def test_instance_norm_gradient_without_input_rank():
    """The dynamo exporter's GroupNorm (optimize=False) unsqueezes its weight with axes from a
    Range, so shape inference loses the rank of everything downstream."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    inits = [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias")]
    nodes = [
        helper.make_node("Identity", ["x"], ["x_any"]),
        helper.make_node("InstanceNormalization", ["x_any", "scale", "bias"], ["y"], epsilon=1e-5),
        *_loss_tail("y"),
    ]
    loss = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    ranked = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)], loss, inits)
    unranked = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], loss, inits)
    want = _grads(ranked, {"x": x}, wrt_inputs=True)
    got = _grads(unranked, {"x": x}, wrt_inputs=True)
    for name in ("x_grad", "scale_grad", "bias_grad"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_reflect_pad_with_pads_computed_from_constants():
    """The legacy exporter (do_constant_folding=False) computes F.pad's reflect pads with
    Constant -> Shape -> Gather -> Sub -> ConstantOfShape -> Concat -> Reshape -> Slice -> Transpose."""
    x = np.random.default_rng(2).standard_normal((1, 2, 4, 5)).astype(np.float32)
    pads = np.array([0, 0, 1, 2, 0, 0, 2, 1], np.int64)
    const = helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(pads[:4].copy()))
    computed = [
        const,
        helper.make_node("Constant", [], ["rest"], value=numpy_helper.from_array(pads[4:].copy())),
        helper.make_node("Concat", ["half", "rest"], ["joined"], axis=0),
        helper.make_node("Shape", ["joined"], ["n"]),
        helper.make_node("Slice", ["joined", "zero", "n"], ["pads_raw"]),
        helper.make_node("Cast", ["pads_raw"], ["pads"], to=TensorProto.INT64),
    ]
    pad = helper.make_node("Pad", ["x", "pads"], ["y"], mode="reflect")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2, 4, 5])]
    loss = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    zero = [numpy_helper.from_array(np.array([0], np.int64), "zero")]
    got = _grads(_model(computed + [pad, *_loss_tail("y")], inputs, loss, zero), {"x": x}, wrt_inputs=True)
    plain = _model([pad, *_loss_tail("y")], inputs, loss, [numpy_helper.from_array(pads, "pads")])
    want = _grads(plain, {"x": x}, wrt_inputs=True)
    np.testing.assert_allclose(got["x_grad"], want["x_grad"], rtol=1e-6)


def test_resize_sizes_from_shape_with_symbolic_batch():
    """Legacy F.interpolate(size=...) writes sizes = Concat(Slice(Shape(X), 0, 2), [h, w])."""
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "two"], ["nc"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node(
            "Resize", ["x", "", "", "sizes"], ["y"], mode="linear", coordinate_transformation_mode="pytorch_half_pixel"
        ),
        *_loss_tail("y"),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array([6, 5], np.int64), "hw"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 4, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    got = _grads(model, {"x": x}, wrt_inputs=True)["x_grad"]
    # d/dx sum(y^2) = 2 M^T y: compare with central differences on a few elements.
    session, eps = Session(model), 1e-2
    for index in [(0, 0, 0, 0), (1, 2, 3, 1), (0, 1, 2, 3)]:
        hi, lo = x.copy(), x.copy()
        hi[index] += eps
        lo[index] -= eps
        fd = (session.run({"x": hi})["loss"] - session.run({"x": lo})["loss"]) / (2 * eps)
        np.testing.assert_allclose(got[index], fd, rtol=2e-3, atol=2e-3)
