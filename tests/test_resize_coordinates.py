"""Resize: coordinate modes against ONNX Runtime and PyTorch, and the gradient of X against finite
differences for nearest / cubic with pytorch_half_pixel.

What the issue's "pytorch_half_pixel fails gradgen check" was: the failing tensor was the float
``scales`` initializer, which `check` used to differentiate by default and which got a zero
gradient. Resize is linear in X (Y = M X along each axis, M fixed by the geometry), so X's gradient
M^T has no kink; as a function of ``scales`` the output is piecewise constant (nearest) or smooth
with jumps wherever floor(n * scale) changes the output length, which finite differences see as
huge slopes. ``scales`` has no gradient: asking for one is now an error naming the node.

Investigating it found a kernel bug: with a single output on an axis, the kernel (after ONNX's
reference evaluator) sampled -0.5 with pytorch_half_pixel, where the spec says 0 (``length_resized
> 1 ? ... : 0``, as ONNX Runtime does); cubic weights -0.5 differently, so even ``sizes`` gave other
values, and scales leaving one output sampled a third coordinate. Where the reference and the
spec's text part ways on align_corners / tf_crop_and_resize spacing with a fractional ``scale * n``,
gradgen keeps the reference, which ONNX's conformance tests check; ONNX Runtime and PyTorch use the
output length there (pinned below).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import ModelError
from gradgen.executor import Session

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")


def _resize_model(x_shape, attrs, scales=None, sizes=None, roi=None, dtype=TensorProto.FLOAT, opset=19, loss=False):
    inits, inputs = [], [helper.make_tensor_value_info("x", dtype, list(x_shape))]
    names = ["x", "", "", ""]
    if roi is not None:
        inits.append(numpy_helper.from_array(np.array(roi, np.float32), "roi"))
        names[1] = "roi"
    if scales is not None:
        names[2] = "scales"
        inits.append(numpy_helper.from_array(np.array(scales, np.float32), "scales"))
    if sizes is not None:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        names[3] = "sizes"
    while names[-1] == "":
        names.pop()
    nodes = [helper.make_node("Resize", names, ["y"], name="resize", **attrs)]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if loss:
        nodes += [helper.make_node("Mul", ["y", "y"], ["y2"]), helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
        outputs = [helper.make_tensor_value_info("loss", dtype, [])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _ort(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("scale", [0.34, 0.5, 0.6])
def test_regression_single_output_pytorch_half_pixel_samples_coordinate_zero(mode, scale):
    """Scales that leave one output on an axis: the spec's ``length_resized > 1 ? ... : 0``."""
    x = np.arange(1, 4, dtype=np.float32).reshape(1, 1, 1, 3) ** 2
    model = _resize_model(x.shape, dict(mode=mode, coordinate_transformation_mode="pytorch_half_pixel"), scales=[1, 1, 1, scale])
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_array_equal(got, x[..., :1])
    np.testing.assert_allclose(got, _ort(model, {"x": x}), rtol=1e-6)


def test_regression_single_output_cubic_with_sizes():
    """sizes = 1: the reference evaluator samples -0.5, and cubic gives 0.72 x0 + ... instead of x0."""
    x = np.arange(1, 6, dtype=np.float32).reshape(1, 1, 1, 5) ** 2
    model = _resize_model(x.shape, dict(mode="cubic", coordinate_transformation_mode="pytorch_half_pixel"), sizes=[1, 1, 1, 1])
    np.testing.assert_array_equal(Session(model).run({"x": x})["y"], x[..., :1])
    np.testing.assert_array_equal(_ort(model, {"x": x}), x[..., :1])


def test_align_corners_with_fractional_width_follows_onnx_conformance():
    """ONNX's conformance test (test_resize_downsample_scales_linear_align_corners): 2 x 4 scaled by
    0.6 samples x = 3 / (2.4 - 1) on the width, the fractional width; ONNX Runtime and PyTorch use the
    output length (x = 3 / (2 - 1) = 3), which is why the fuzzer does not compare these cases."""
    x = np.arange(1, 9, dtype=np.float32).reshape(1, 1, 2, 4)
    model = _resize_model(
        x.shape, dict(mode="linear", coordinate_transformation_mode="align_corners"), scales=[1, 1, 0.6, 0.6], opset=13
    )
    np.testing.assert_allclose(Session(model).run({"x": x})["y"].ravel(), [1.0, 1 + 3 / 1.4], rtol=1e-6)
    np.testing.assert_allclose(_ort(model, {"x": x}).ravel(), [1.0, 4.0], rtol=1e-6)
    want = torch.nn.functional.interpolate(torch.tensor(x), scale_factor=(0.6, 0.6), mode="bilinear", align_corners=True)
    np.testing.assert_allclose(want.numpy().ravel(), [1.0, 4.0], rtol=1e-6)


@pytest.mark.parametrize(
    ("ctm", "scales", "sizes", "warns"),
    [
        ("align_corners", [1, 1, 0.7, 0.7], None, True),  # 6 * 0.7 = 4.2: F.interpolate(scale_factor=0.7, align_corners=True)
        ("tf_crop_and_resize", [1, 1, 1, 1.5], None, True),  # 7 * 1.5 = 10.5
        ("align_corners", [1, 1, 2, 0.5], None, False),  # 12 and 3: integer widths
        ("align_corners", None, [2, 3, 4, 5], False),
        ("pytorch_half_pixel", [1, 1, 0.7, 0.7], None, False),
    ],
)
def test_fractional_width_spacing_warns_at_build(ctm, scales, sizes, warns):
    """A model exported from PyTorch's F.interpolate(scale_factor=0.7, mode="bilinear",
    align_corners=True) (both exporters write Resize with those scales) computed, in the sweep of
    exported models, a loss 19 % off PyTorch's and ONNX Runtime's and weight gradients 50 % off, with
    no message: gradgen keeps the reference's fractional-width spacing (the test above). The build
    now warns where that spacing differs from the output-length one."""
    import warnings

    shape = (2, 3, 6, 7) if ctm == "tf_crop_and_resize" else (2, 3, 6, 6)
    roi = [0, 0, 0.1, 0.2, 1, 1, 0.9, 0.8] if ctm == "tf_crop_and_resize" else None
    attrs = dict(mode="linear", coordinate_transformation_mode=ctm)
    model = _resize_model(shape, attrs, scales=scales, sizes=sizes, roi=roi, loss=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradgen.build_backward(model, wrt_inputs=True)
    messages = [str(w.message) for w in caught if "fractional width" in str(w.message)]
    assert bool(messages) == warns, messages
    if warns:
        assert "resize" in messages[0] and "output length" in messages[0]


@pytest.mark.parametrize("size", [(1, 1), (2, 7), (5, 3), (1, 6), (8, 8)])
def test_cubic_pytorch_half_pixel_matches_torch_bicubic(size):
    """Resize(cubic, pytorch_half_pixel, a=-0.75) is torch's bicubic with align_corners=False for
    outputs longer than 1 (for a single output PyTorch samples the centre, the spec coordinate 0)."""
    x = np.random.default_rng(1).standard_normal((2, 1, 4, 5))
    attrs = dict(mode="cubic", coordinate_transformation_mode="pytorch_half_pixel", cubic_coeff_a=-0.75)
    model = _resize_model(x.shape, attrs, sizes=[2, 1, *size], dtype=TensorProto.DOUBLE, opset=13, loss=True)
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x})
    xt = torch.tensor(x, requires_grad=True)
    # PyTorch samples the centre of an axis resized to length 1; the spec samples coordinate 0, i.e.
    # PyTorch on the first element alone
    first = xt[:, :, : 1 if size[0] == 1 else None, : 1 if size[1] == 1 else None]
    y = torch.nn.functional.interpolate(first, size=size, mode="bicubic", align_corners=False)
    loss = (y * y).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-10)
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-9, atol=1e-12)


def _fd_cases():
    """Small deterministic draws of nearest / cubic with pytorch_half_pixel (the issue's family)."""
    rng = np.random.default_rng(17)
    for k in range(24):
        mode = ["nearest", "cubic"][k % 2]
        attrs = dict(mode=mode, coordinate_transformation_mode="pytorch_half_pixel")
        if mode == "nearest":
            attrs["nearest_mode"] = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"][k // 2 % 4]
        elif k % 3 == 0:
            attrs["exclude_outside"] = 1
        shape = (1, 2, *(int(v) for v in rng.integers(1, 5, 2)))
        if k % 4 < 2:
            yield attrs, shape, dict(scales=[1, 1, *(float(v) for v in np.round(rng.uniform(0.3, 3.0, 2), 2))])
        else:
            yield attrs, shape, dict(sizes=[1, 2, *(int(v) for v in rng.integers(1, 7, 2))])


@pytest.mark.parametrize("attrs,shape,geometry", list(_fd_cases()))
def test_pytorch_half_pixel_gradient_of_x_matches_finite_differences(attrs, shape, geometry):
    model = _resize_model(shape, attrs, **geometry, loss=True, opset=13)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    report = check_gradients(model, inputs={"x": x}, wrt_inputs=True)
    assert report.passed and report.tensors[0].name == "x", report.format()


def test_regression_scales_are_not_differentiated():
    """The tensor that failed the check: a float scales input. Asking for its gradient is an error
    naming the node (no silent zero)."""
    model = _resize_model(
        (1, 1, 3, 4),
        dict(mode="cubic", coordinate_transformation_mode="pytorch_half_pixel"),
        scales=[1, 1, 1.5, 0.7],
        loss=True,
        opset=13,
    )
    with pytest.raises(ModelError, match="'scales'.*'resize'"):
        gradgen.build_backward(model, wrt=["x", "scales"])
    assert gradgen.build_backward(model, wrt_inputs=True).wrt == ["x"]


def test_coordinate_modes_match_onnxruntime():
    """Every mode x coordinate mode x small size x scale (or size) against ONNX Runtime, except
    tf_crop_and_resize with all scales 1, where ONNX Runtime returns X unchanged (ignoring roi),
    and align_corners / tf_crop_and_resize with a fractional scale * n (see the test above)."""
    rng = np.random.default_rng(0)
    modes = ["nearest", "linear", "cubic"]
    ctms = ["pytorch_half_pixel", "half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize", "half_pixel_symmetric"]
    for mode, ctm, n, scale, use_sizes in itertools.product(modes, ctms, [1, 2, 5], [0.34, 0.6, 1.0, 1.7, 2.5], [False, True]):
        if ctm == "tf_crop_and_resize" and scale == 1.0:
            continue
        if ctm in ("align_corners", "tf_crop_and_resize") and not use_sizes and scale * n != int(scale * n):
            continue
        x = rng.standard_normal((1, 1, 2, n)).astype(np.float32)
        roi = [0, 0, 0, 0.1, 1, 1, 1, 0.8] if ctm == "tf_crop_and_resize" else None
        geometry = dict(sizes=[1, 1, 2, max(1, int(scale * n))]) if use_sizes else dict(scales=[1, 1, 1, scale])
        model = _resize_model(x.shape, dict(mode=mode, coordinate_transformation_mode=ctm), roi=roi, **geometry)
        np.testing.assert_allclose(
            Session(model).run({"x": x})["y"],
            _ort(model, {"x": x}),
            rtol=1e-4,
            atol=1e-5,
            err_msg=f"{mode} {ctm} n={n} {geometry}",
        )


def _old_resize_model(op_type: str, opset: int, mode: str, scales):
    """loss = sum(Resize-10 / Upsample(x) * w), w fixed, for a (1, 1, 5, 7) float64 x."""
    x_shape = (1, 1, 5, 7)
    out_shape = tuple(int(np.floor(n * s)) for n, s in zip(x_shape, scales))
    w = np.random.default_rng(5).standard_normal(out_shape)
    nodes = [
        helper.make_node(op_type, ["x", "scales"], ["y"], mode=mode),
        helper.make_node("Mul", ["y", "w"], ["wy"]),
        helper.make_node("ReduceSum", ["wy"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x_shape)],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [numpy_helper.from_array(np.asarray(scales, np.float32), "scales"), numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=6)


@pytest.mark.parametrize("op_type,opset", [("Resize", 10), ("Upsample", 9)])
@pytest.mark.parametrize(
    "mode,scales", [("linear", (1, 1, 1.7, 0.6)), ("linear", (1, 1, 2.0, 1.5)), ("nearest", (1, 1, 2.3, 0.8))]
)
def test_resize_10_and_upsample_keep_asymmetric_coordinates_when_upgraded(op_type, opset, mode, scales):
    """A model below opset 11 is converted to 17 before the gradient pass; ONNX's converter writes
    Resize-10 / Upsample as a Resize with the later half_pixel default (another function: a built
    model's loss differed from the model's own). The converted nodes keep asymmetric coordinates."""
    model = _old_resize_model(op_type, opset, mode, scales)
    x = np.random.default_rng(6).standard_normal((1, 1, 5, 7))
    own = Session(model).run({"x": x})["loss"]  # the op's own kernel (asymmetric)
    built = gradgen.build_backward(model, wrt_inputs=True, wrt=[])
    np.testing.assert_allclose(Session(built.model).run({"x": x})["loss"], own, rtol=1e-12)
    # onnxruntime (float32 only) agrees; its nearest at fractional ratios is its own, and its Upsample
    # takes no scale below 1
    if mode == "linear" and (op_type == "Resize" or min(scales) >= 1):
        ort = pytest.importorskip("onnxruntime")
        single = _old_resize_model(op_type, opset, mode, scales)
        single.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
        for out in single.graph.output:
            out.type.tensor_type.elem_type = TensorProto.FLOAT
        single.graph.initializer[1].CopyFrom(
            numpy_helper.from_array(numpy_helper.to_array(single.graph.initializer[1]).astype(np.float32), "w")
        )
        session = ort.InferenceSession(single.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(["loss"], {"x": x.astype(np.float32)})[0], own, rtol=1e-5)
    report = check_gradients(model, wrt_inputs=True, wrt=[], inputs={"x": x})
    assert report.passed, report.format()


@pytest.mark.parametrize("policy", ["not_smaller", "not_larger"])
def test_aspect_ratio_policy_gradient_with_constant_sizes(policy):
    model = _resize_model(
        (1, 1, 2, 4), dict(mode="nearest", axes=[2, 3], keep_aspect_ratio_policy=policy), sizes=[1, 3], loss=True
    )
    x = np.random.default_rng(1).standard_normal((1, 1, 2, 4)).astype(np.float32)
    report = check_gradients(model, inputs={"x": x}, wrt_inputs=True)
    assert report.passed and report.tensors[0].shape == (1, 1, 2, 4), report.format()


def test_regression_aspect_ratio_policy_with_sizes_fed_at_run_time():
    """ONNX's test_resize_downsample_sizes_nearest_not_smaller: sizes a graph input, so the rule took
    the inferred output shape (1, 1, 2, 3) as the sizes and applied the policy to it again, giving
    an X gradient of the output's shape. It needs constant sizes; asking is an error naming the node."""
    model = _resize_model((1, 1, 2, 4), dict(mode="nearest", axes=[2, 3], keep_aspect_ratio_policy="not_smaller"), loss=True)
    model.graph.node[0].input.extend(["", "", "sizes"])
    model.graph.input.append(helper.make_tensor_value_info("sizes", TensorProto.INT64, [2]))
    model.graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 2, 3]))
    with pytest.raises(ModelError, match="'resize'.*not_smaller.*constant sizes"):
        gradgen.build_backward(model, wrt_inputs=True)
