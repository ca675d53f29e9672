"""MaxRoiPool: the CPU kernel against ONNX Runtime, and the gradient of X against torchvision's
roi_pool where torchvision is installed (finite differences: tests/grad_cases/conv.py, fuzz_ops)."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from gradgen.kernels.cpu.pool import max_roi_pool


def _draw(seed):
    rng = np.random.default_rng(seed)
    n, c, h, w = (int(v) for v in rng.integers(1, 4, 4) * 2)
    count, scale = int(rng.integers(1, 5)), float(rng.choice([1.0, 0.5]))
    corner = rng.uniform(-3, [w / scale, h / scale], (count, 2))
    rois = np.concatenate([rng.integers(0, n, (count, 1)), corner, corner + rng.uniform(0, 8 / scale, (count, 2))], axis=1)
    pooled = [int(v) for v in rng.integers(1, 4, 2)]
    return rng.normal(size=(n, c, h, w)).astype(np.float32), rois.astype(np.float32), pooled, scale


def _model(pooled, scale, dtype=TensorProto.FLOAT):
    nodes = [helper.make_node("MaxRoiPool", ["x", "rois"], ["y"], pooled_shape=pooled, spatial_scale=scale, name="pool")]
    inputs = [helper.make_tensor_value_info("x", dtype, None), helper.make_tensor_value_info("rois", dtype, None)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", dtype, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("seed", range(40))
def test_kernel_matches_onnxruntime(seed):
    x, rois, pooled, scale = _draw(seed)
    session = onnxruntime.InferenceSession(_model(pooled, scale).SerializeToString(), providers=["CPUExecutionProvider"])
    want = session.run(None, {"x": x, "rois": rois})[0]
    np.testing.assert_array_equal(max_roi_pool(x, rois, pooled_shape=pooled, spatial_scale=scale), want)


@pytest.mark.parametrize("seed", range(6))
def test_gradient_matches_torchvision(seed):
    torch = pytest.importorskip("torch")
    ops = pytest.importorskip("torchvision.ops")
    x, rois, pooled, scale = _draw(seed)
    x, rois = x.astype(np.float64), rois.astype(np.float64)
    weights = np.random.default_rng(seed).normal(size=(rois.shape[0], x.shape[1], *pooled))
    model = _model(pooled, scale, TensorProto.DOUBLE)
    graph = model.graph
    graph.initializer.append(gradgen.api.ir.to_proto(gradgen.api.ir.tensor(weights, name="weights")))
    graph.node.extend(
        [helper.make_node("Mul", ["y", "weights"], ["p"]), helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    )
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    built = gradgen.build_backward(model, loss="loss", wrt_inputs=True, wrt=["x"])
    got = Session(built.model).run({"x": x, "rois": rois})["x_grad"]
    xt = torch.tensor(x, requires_grad=True)
    y = ops.roi_pool(xt, torch.tensor(rois), output_size=pooled, spatial_scale=scale)
    (y * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(got, xt.grad.numpy(), rtol=1e-12, atol=1e-12)
