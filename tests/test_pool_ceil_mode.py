"""Pooling with ceil_mode=1 where the last window would start past the input (issue: the backward
graph was built for ONNX shape inference's pooled shape, which keeps that window before opset 22,
and `run` failed). Forward and gradients against PyTorch's max_pool / avg_pool with ceil_mode, and
against finite differences."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen import passes
from gradgen.api import ir
from gradgen.check import check_gradients
from gradgen.executor import Session
from gradgen.ops.pool import pool_output_shape
from tests.gradcheck import GradCase, case_model

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _distinct(shape, seed=0):
    """Values at least 0.05 apart: no ties in a max window, finite differences stay on one side."""
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n) * 0.05 - 1.0).reshape(shape)


def _model(op, x_shape, attrs, opset=17, extra_nodes=(), last="y"):
    nodes = [
        helper.make_node(op, ["x"], ["y"], name="pool", **attrs),
        *extra_nodes,
        helper.make_node("ReduceSum", [last], ["s"], keepdims=0, name="sum"),
        helper.make_node("Mul", ["s", "s"], ["loss"], name="square"),
    ]  # a gradient that is not all ones
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, list(x_shape))],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _torch_pool(op, x, kernel, strides, pads, count_include_pad):
    fn = {
        ("MaxPool", 1): F.max_pool1d,
        ("MaxPool", 2): F.max_pool2d,
        ("AveragePool", 1): F.avg_pool1d,
        ("AveragePool", 2): F.avg_pool2d,
    }[op, len(kernel)]
    kwargs = dict(kernel_size=kernel, stride=strides, padding=pads, ceil_mode=True)
    if op == "AveragePool":
        kwargs["count_include_pad"] = bool(count_include_pad)
    return fn(x, **kwargs)


# (x spatial shape, kernel, strides, symmetric pads): kernels smaller than strides, so that a
# ceil_mode window may start past the input, and some ordinary ones. PyTorch wants pad <= kernel / 2.
GEOMETRIES = [
    ((5, 2), (3, 1), (2, 2), (0, 0)),  # the case
    ((5, 2), (3, 1), (2, 2), (1, 0)),
    ((7,), (1,), (3,), (0,)),
    ((8,), (2,), (3,), (1,)),
    ((6, 4), (1, 2), (2, 3), (0, 1)),
    ((4, 5), (2, 2), (3, 3), (1, 1)),
    ((5, 5), (3, 3), (2, 2), (1, 1)),
    ((3, 6), (2, 1), (2, 4), (0, 0)),
    # kernels larger than the input: ceil_mode's one window starts inside it (PyTorch's
    # MaxPool2d(2, ceil_mode=True) on a 1 x 1 map; gradgen refused these)
    ((1,), (2,), (2,), (0,)),
    ((2, 1), (3, 2), (2, 2), (0, 0)),
]
CASES = [
    pytest.param(
        op, *geom, cip, id=f"{op}-{'x'.join(map(str, geom[0]))}-k{geom[1]}-s{geom[2]}-p{geom[3]}{'-include' if cip else ''}"
    )
    for geom in GEOMETRIES
    for op, cip in [("MaxPool", 0), ("AveragePool", 0), ("AveragePool", 1)]
]


def _attrs(op, kernel, strides, pads, cip):
    attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": list(pads) * 2, "ceil_mode": 1}
    if op == "AveragePool":
        attrs["count_include_pad"] = cip
    return attrs


@pytest.mark.parametrize("op,spatial,kernel,strides,pads,cip", CASES)
def test_ceil_mode_forward_and_gradient_match_torch(op, spatial, kernel, strides, pads, cip):
    x_shape = (2, 2, *spatial)
    x = _distinct(x_shape)
    attrs = _attrs(op, kernel, strides, pads, cip)
    model = _model(op, x_shape, attrs)
    built = gradgen.build_backward(model, wrt_inputs=True)
    got = Session(built.model).run({"x": x})

    xt = torch.tensor(x, requires_grad=True)
    yt = _torch_pool(op, xt, kernel, strides, pads, cip)
    loss = yt.sum() ** 2
    loss.backward()
    assert list(yt.shape) == pool_output_shape(x_shape, attrs)
    forward = model.__deepcopy__()
    forward.graph.output.append(helper.make_value_info("y", onnx.TypeProto()))
    np.testing.assert_allclose(Session(forward).run({"x": x})["y"], yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op,spatial,kernel,strides,pads,cip", CASES)
def test_ceil_mode_gradient_matches_finite_differences(op, spatial, kernel, strides, pads, cip):
    """gradgen check (float64 central differences, every element) on the case's model. Not
    tests.gradcheck.check_case: its onnx.checker full_check runs ONNX's shape inference, which
    before opset 22 contradicts the pooled shape every runtime computes (see the test below)."""
    x = _distinct((1, 2, *spatial), seed=1)
    model, feeds, _ = case_model(GradCase(op, [x], attrs=_attrs(op, kernel, strides, pads, cip)))
    report = check_gradients(model, inputs=feeds, wrt_inputs=True)
    assert report.passed, report.format()
    assert "elements" in report.tensors[0].method


def test_onnx_checker_disagrees_before_opset_22():
    """Why the built model keeps the runtimes' shape although onnx.checker's full check then fails:
    ONNX's own inference gives the window that starts past the input before opset 22, so even the
    forward model fails the full check once it declares the shape PyTorch and ONNX Runtime compute."""
    attrs = {"kernel_shape": [3, 1], "strides": [2, 2], "ceil_mode": 1}
    for opset, ok in [(17, False), (22, True)]:
        model = _model("MaxPool", (1, 1, 5, 2), attrs, opset=opset)
        model.graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 1, 2, 1]))
        if ok:
            onnx.checker.check_model(model, full_check=True)
        else:
            with pytest.raises(onnx.shape_inference.InferenceError, match="differ"):
                onnx.checker.check_model(model, full_check=True)


@pytest.mark.parametrize("opset", [17, 19, 22])
def test_shape_inference_uses_the_kernels_pooled_shape(opset):
    """Two pools in a row, then Flatten: every inferred shape is the one the kernels produce (the
    second pool's input shape is only right after the first pool's output is corrected)."""
    attrs = {"kernel_shape": [3, 1], "strides": [2, 2], "ceil_mode": 1}
    nodes = [
        helper.make_node("MaxPool", ["y"], ["y2", "idx"], name="pool2", **attrs),
        helper.make_node("Flatten", ["y2"], ["f"], name="flat"),
    ]
    proto = _model("AveragePool", (1, 3, 9, 4), attrs, opset=opset, extra_nodes=nodes, last="f")
    model = ir.from_proto(proto)
    passes.ShapeInferencePass()(model)
    shapes = {v.name: list(v.shape) for node in model.graph for v in node.outputs if v.shape is not None}
    proto.graph.output.extend(helper.make_value_info(name, onnx.TypeProto()) for name in ("y", "y2", "idx", "f"))
    run = Session(proto).run({"x": np.random.default_rng(0).standard_normal((1, 3, 9, 4))})
    del run["loss"]
    for name, value in run.items():
        assert shapes[name] == list(value.shape), name
    # ONNX alone gives y [1, 3, 4, 3] and y2 [1, 3, 2, 2] (y2 stays wrong after the first correction)
    assert shapes["y"] == [1, 3, 4, 2] and shapes["y2"] == [1, 3, 2, 1] and shapes["f"] == [1, 6]


def test_ceil_mode_pool_chain_gradient():
    """The chain above, differentiated: the gradient runs and matches torch."""
    attrs = {"kernel_shape": [3, 1], "strides": [2, 2], "ceil_mode": 1}
    nodes = [helper.make_node("MaxPool", ["y"], ["y2"], name="pool2", **attrs)]
    model = _model("AveragePool", (1, 3, 9, 4), attrs, extra_nodes=nodes, last="y2")
    x = _distinct((1, 3, 9, 4))
    got = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x})
    xt = torch.tensor(x, requires_grad=True)
    y2 = F.max_pool2d(F.avg_pool2d(xt, (3, 1), (2, 2), ceil_mode=True), (3, 1), (2, 2), ceil_mode=True)
    (y2.sum() ** 2).backward()
    np.testing.assert_allclose(got["x_grad"], xt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_pooled_shape_rule_agrees_with_torch_and_onnxruntime():
    """The shared rule against PyTorch and ONNX Runtime on every small 1-D geometry PyTorch accepts."""
    ort = pytest.importorskip("onnxruntime")
    for n, k, s, p in itertools.product(range(1, 8), range(1, 4), range(1, 4), range(0, 2)):
        if 2 * p > k or n + 2 * p < k:
            continue
        attrs = {"kernel_shape": [k], "strides": [s], "pads": [p, p], "ceil_mode": 1}
        want = list(F.max_pool1d(torch.zeros(1, 1, n), k, s, p, ceil_mode=True).shape)
        assert pool_output_shape((1, 1, n), attrs) == want, (n, k, s, p)
        node = helper.make_node("MaxPool", ["x"], ["y"], **attrs)
        graph = helper.make_graph(
            [node],
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, n])],
            [helper.make_value_info("y", onnx.TypeProto())],
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
        got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.zeros((1, 1, n), np.float32)}
        )[0]
        assert list(got.shape) == want, (n, k, s, p)
