"""GridSample and AffineGrid: the CPU kernels against ONNX Runtime, PyTorch and ONNX's reference
evaluator; GridSample's standard-op form (gradgen.passes.DecomposePass) against its kernel;
gradients against torch.autograd (finite differences: tests/grad_cases/conv.py)."""

from __future__ import annotations

import itertools

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.executor import Session
from gradgen.passes import DecomposePass, GradientPass, GradientSpec, Pipeline
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

rng = np.random.default_rng(16)
MODES = ("nearest", "linear", "cubic")
PADDINGS = ("zeros", "border", "reflection")
TORCH_MODES = {"nearest": "nearest", "linear": "bilinear", "cubic": "bicubic"}


def _model(x_shape, grid_shape, attrs, dtype=TensorProto.FLOAT, opset=20):
    node = helper.make_node("GridSample", ["x", "grid"], ["y"], name="sample", **attrs)
    graph = helper.make_graph(
        [node],
        "grid_sample",
        [helper.make_tensor_value_info("x", dtype, x_shape), helper.make_tensor_value_info("grid", dtype, grid_shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _inputs(nd, dtype=np.float32, reach=1.8):
    x_shape = [2, 3, *[5, 4, 3][:nd]]
    grid_shape = [2, *[4, 3, 2][:nd], nd]
    return {"x": rng.normal(size=x_shape).astype(dtype), "grid": rng.uniform(-reach, reach, grid_shape).astype(dtype)}


@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("mode,padding,align", list(itertools.product(MODES, PADDINGS, (0, 1))))
def test_kernel_matches_onnxruntime(mode, padding, align, nd):
    if nd == 3 and mode == "cubic":
        pytest.skip("cubic is 2-D only in ONNX Runtime and PyTorch")
    ort = pytest.importorskip("onnxruntime")
    feeds = _inputs(nd)
    model = _model(
        list(feeds["x"].shape), list(feeds["grid"].shape), {"mode": mode, "padding_mode": padding, "align_corners": align}
    )
    got = Session(model).run(feeds)["y"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode,padding", [(m, p) for m in MODES for p in PADDINGS if (m, p) != ("cubic", "border")])
def test_kernel_matches_the_reference_evaluator_in_1d(mode, padding):
    """1-D (ONNX Runtime takes 2-D and 3-D only). Cubic with border padding is left out: the
    reference clamps the coordinate before taking the taps, ONNX Runtime and PyTorch clamp each
    tap, and gradgen follows them."""
    feeds = _inputs(1)
    model = _model(list(feeds["x"].shape), list(feeds["grid"].shape), {"mode": mode, "padding_mode": padding})
    got = Session(model).run(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,padding,align", list(itertools.product(MODES, PADDINGS, (0, 1))))
def test_kernel_matches_torch_in_float64(mode, padding, align):
    torch = pytest.importorskip("torch")
    feeds = _inputs(2, np.float64, reach=2.6)
    model = _model(
        list(feeds["x"].shape),
        list(feeds["grid"].shape),
        {"mode": mode, "padding_mode": padding, "align_corners": align},
        TensorProto.DOUBLE,
    )
    got = Session(model).run(feeds)["y"]
    want = torch.nn.functional.grid_sample(
        torch.tensor(feeds["x"]), torch.tensor(feeds["grid"]), TORCH_MODES[mode], padding, bool(align)
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("mode,padding,align", list(itertools.product(MODES, PADDINGS, (0, 1))))
def test_standard_op_form_equals_the_kernel(mode, padding, align, nd, symbolic):
    if nd == 3 and mode == "cubic":
        pytest.skip("64 taps: covered in 1-D and 2-D")
    feeds = _inputs(nd, np.float64, reach=2.6)  # beyond one reflection
    x_dims = [f"x{i}" for i in range(nd + 2)] if symbolic else list(feeds["x"].shape)
    grid_dims = [f"g{i}" for i in range(nd + 1)] + [nd] if symbolic else list(feeds["grid"].shape)
    model = _model(x_dims, grid_dims, {"mode": mode, "padding_mode": padding, "align_corners": align}, TensorProto.DOUBLE)
    want = Session(model).run(feeds)["y"]
    decomposed = ir.from_proto(model)
    DecomposePass()(decomposed)
    assert not [n for n in decomposed.graph if n.op_type == "GridSample"]
    np.testing.assert_array_equal(Session(decomposed).run(feeds)["y"], want)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("mode,padding,align", list(itertools.product(MODES, PADDINGS, (0, 1))))
def test_gradients_match_torch(mode, padding, align, symbolic):
    torch = pytest.importorskip("torch")
    feeds = _inputs(2, np.float64, reach=2.2)
    inputs = {"x": feeds["x"], "grid": feeds["grid"]}
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    out_shape = (2, 3, 4, 3)
    got, w = run_gradgen("GridSample", inputs, {}, attrs, [out_shape], opset=20, symbolic=symbolic)

    def sample(x, grid):
        return torch.nn.functional.grid_sample(x, grid, TORCH_MODES[mode], padding, bool(align))

    assert_close(got, torch_grads(sample, inputs, w), rtol=1e-9, atol=1e-10)


def test_gradients_match_torch_in_3d():
    torch = pytest.importorskip("torch")
    feeds = _inputs(3, np.float64, reach=1.5)
    got, w = run_gradgen("GridSample", feeds, {}, {"padding_mode": "border"}, [(2, 3, 4, 3, 2)], opset=20)

    def sample(x, grid):
        return torch.nn.functional.grid_sample(x, grid, "bilinear", "border", False)

    assert_close(got, torch_grads(sample, feeds, w), rtol=1e-9, atol=1e-10)


def test_gradient_pass_without_the_decomposition_names_the_pass():
    feeds = _inputs(2, np.float64)
    model = _model(list(feeds["x"].shape), list(feeds["grid"].shape), {}, TensorProto.DOUBLE)
    graph = model.graph
    graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    with pytest.raises(gradgen.ModelError, match="node 'sample' .*run gradgen.passes.DecomposePass before GradientPass"):
        gradgen.api.run_pipeline(Pipeline(GradientPass(GradientSpec(wrt_inputs=True))), ir.from_proto(model))


def test_bad_mode_is_a_model_error_naming_the_node():
    feeds = _inputs(2, np.float64)
    model = _model(list(feeds["x"].shape), list(feeds["grid"].shape), {"mode": "quartic"}, TensorProto.DOUBLE)
    with pytest.raises(gradgen.ModelError, match="node 'sample' \\(GridSample\\): mode 'quartic' is not one of"):
        DecomposePass()(ir.from_proto(model))


# -- AffineGrid ------------------------------------------------------------------------------------


def _affine_model(size, align, symbolic=False, dtype=TensorProto.DOUBLE):
    nd = len(size) - 2
    theta_dims = ["n", nd, nd + 1] if symbolic else [size[0], nd, nd + 1]
    node = helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=align)
    graph = helper.make_graph(
        [node],
        "affine_grid",
        [helper.make_tensor_value_info("theta", dtype, theta_dims)],
        [helper.make_tensor_value_info("grid", dtype, None)],
        initializer=[helper.make_tensor("size", TensorProto.INT64, [len(size)], list(size))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2)])
def test_affine_grid_kernel_matches_onnxruntime_and_torch(size, align):
    ort = pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    nd = len(size) - 2
    theta = rng.normal(size=(size[0], nd, nd + 1)).astype(np.float32)
    model = _affine_model(size, align, dtype=TensorProto.FLOAT)
    got = Session(model).run({"theta": theta})["grid"]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"theta": theta})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    torch_grid = torch.nn.functional.affine_grid(torch.tensor(theta), list(size), align_corners=bool(align)).numpy()
    np.testing.assert_allclose(got, torch_grid, rtol=1e-6, atol=1e-6)


def test_affine_grid_axis_of_one_pixel_is_at_zero_as_in_torch():
    """ONNX's reference puts it at -1 (dividing by zero), ONNX Runtime elsewhere again."""
    torch = pytest.importorskip("torch")
    theta = rng.normal(size=(1, 2, 3))
    got = Session(_affine_model((1, 1, 1, 3), 1)).run({"theta": theta})["grid"]
    with pytest.warns(UserWarning):  # torch warns that unit-size grids changed in 1.3
        want = torch.nn.functional.affine_grid(torch.tensor(theta), [1, 1, 1, 3], align_corners=True).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("align", [0, 1])
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 4, 2)])
def test_affine_grid_gradient_matches_torch(size, align, symbolic):
    torch = pytest.importorskip("torch")
    nd = len(size) - 2
    theta = rng.normal(size=(size[0], nd, nd + 1))
    model = _affine_model(size, align, symbolic)
    w = rng.uniform(0.5, 1.5, (size[0], *size[2:], nd))
    graph = model.graph
    graph.initializer.append(helper.make_tensor("w", TensorProto.DOUBLE, w.shape, w.reshape(-1)))
    graph.node.extend([helper.make_node("Mul", ["grid", "w"], ["t"]), helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)])
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"theta": theta})["theta_grad"]
    want = torch_grads(
        lambda theta: torch.nn.functional.affine_grid(theta, list(size), align_corners=bool(align)), {"theta": theta}, [w]
    )
    assert_close({"theta": got}, want)


def test_spatial_transformer_gradients_match_torch():
    """AffineGrid feeding GridSample (a spatial transformer): gradients of X and theta."""
    torch = pytest.importorskip("torch")
    x, theta = rng.normal(size=(2, 3, 5, 6)), rng.normal(scale=0.6, size=(2, 2, 3))
    w = rng.uniform(0.5, 1.5, (2, 3, 4, 4))
    graph = helper.make_graph(
        [
            helper.make_node("AffineGrid", ["theta", "size"], ["grid"], align_corners=0),
            helper.make_node("GridSample", ["x", "grid"], ["y"], mode="linear", padding_mode="zeros"),
            helper.make_node("Mul", ["y", "w"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ],
        "stn",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, x.shape),
            helper.make_tensor_value_info("theta", TensorProto.DOUBLE, theta.shape),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[
            helper.make_tensor("size", TensorProto.INT64, [4], [2, 3, 4, 4]),
            helper.make_tensor("w", TensorProto.DOUBLE, w.shape, w.reshape(-1)),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x, "theta": theta})

    def stn(x, theta):
        grid = torch.nn.functional.affine_grid(theta, [2, 3, 4, 4], align_corners=False)
        return torch.nn.functional.grid_sample(x, grid, "bilinear", "zeros", False)

    assert_close({n: got[f"{n}_grad"] for n in ("x", "theta")}, torch_grads(stn, {"x": x, "theta": theta}, [w]))


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_one_pixel_axis_with_reflection_and_corners_aligned(mode, symbolic):
    """Reflection into [0, 0] (found by the op fuzzer): the standard-op form must not divide by the
    zero span, and gradients stay finite."""
    feeds = {"x": rng.normal(size=(1, 2, 1, 3)), "grid": rng.uniform(-1.6, 1.6, (1, 2, 2, 2))}
    attrs = {"mode": mode, "padding_mode": "reflection", "align_corners": 1}
    x_dims = ["n", "c", "h", "w"] if symbolic else [1, 2, 1, 3]
    model = _model(x_dims, [1, 2, 2, 2], attrs, TensorProto.DOUBLE)
    decomposed = ir.from_proto(model)
    DecomposePass()(decomposed)
    np.testing.assert_array_equal(Session(decomposed).run(feeds)["y"], Session(model).run(feeds)["y"])
    got, _ = run_gradgen("GridSample", feeds, {}, attrs, [(1, 2, 2, 2)], opset=20, symbolic=symbolic)
    assert all(np.isfinite(g).all() for g in got.values())


def test_default_parameters_are_the_models_not_the_standard_op_forms_constants():
    """The rewritten forms' float constants are Constant nodes: an initializer would read as a
    parameter, and build_backward differentiates every float initializer the loss depends on."""
    from onnx import numpy_helper

    rois = np.array([[0.5, 0.5, 3.5, 2.5]], dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "gain"], ["scaled"]),
            helper.make_node("GridSample", ["scaled", "grid"], ["sampled"], mode="cubic", padding_mode="reflection"),
            helper.make_node("RoiAlign", ["sampled", "rois", "batch"], ["pooled"], sampling_ratio=2),
            helper.make_node("ReduceSum", ["pooled"], ["loss"], keepdims=0),
        ],
        "forms",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 5]),
            helper.make_tensor_value_info("grid", TensorProto.FLOAT, [1, 4, 4, 2]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[
            numpy_helper.from_array(np.array([1.5], dtype=np.float32), "gain"),
            numpy_helper.from_array(rois, "rois"),
            numpy_helper.from_array(np.array([0], dtype=np.int64), "batch"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    built = gradgen.build_backward(model)
    assert built.gradient_names == ["gain_grad", "rois_grad"]
