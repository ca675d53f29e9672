"""DeformConv (2-D): the CPU kernel against ONNX Runtime and ONNX's reference evaluator; its
standard-op form (gradgen.passes.DecomposePass) against the kernel; the one-line error for shapes
that are not static (finite differences of every input's gradient: tests/grad_cases/conv.py;
torchvision, which has deform_conv2d, is not a test dependency)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.executor import Session
from gradgen.passes import DecomposePass

rng = np.random.default_rng(19)
CASES = [
    ((1, 2, 5, 5), (3, 2, 2, 2), {}, True, False),
    ((2, 4, 6, 5), (4, 2, 3, 3), {"group": 2, "offset_group": 2, "pads": [1, 1, 1, 1]}, False, True),
    ((1, 2, 7, 6), (2, 2, 2, 3), {"strides": [2, 1], "dilations": [1, 2]}, True, True),
]


def _model_and_feeds(x_shape, w_shape, attrs, bias, mask, dtype=np.float64, dims=None):
    kernel, og = w_shape[2:], attrs.get("offset_group", 1)
    s, d, p = attrs.get("strides", [1, 1]), attrs.get("dilations", [1, 1]), attrs.get("pads", [0, 0, 0, 0])
    out = [(x_shape[2 + i] + p[i] + p[2 + i] - d[i] * (kernel[i] - 1) - 1) // s[i] + 1 for i in range(2)]
    feeds = {
        "x": rng.normal(size=x_shape),
        "w": rng.normal(size=w_shape),
        "offset": rng.normal(scale=1.2, size=(x_shape[0], 2 * og * kernel[0] * kernel[1], *out)),
    }
    names = ["x", "w", "offset"]
    if bias:
        feeds["b"] = rng.normal(size=w_shape[0])
    if bias or mask:
        names.append("b" if bias else "")
    if mask:
        feeds["mask"] = rng.uniform(0, 1, (x_shape[0], og * kernel[0] * kernel[1], *out))
        names.append("mask")
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    elem = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    graph = helper.make_graph(
        [helper.make_node("DeformConv", names, ["y"], name="deform", **attrs)],
        "deform_conv",
        [helper.make_tensor_value_info(k, elem, (dims or {}).get(k, v.shape)) for k, v in feeds.items()],
        [helper.make_tensor_value_info("y", elem, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), feeds


@pytest.mark.parametrize("x_shape,w_shape,attrs,bias,mask", CASES)
def test_kernel_matches_onnxruntime_and_the_reference(x_shape, w_shape, attrs, bias, mask):
    ort = pytest.importorskip("onnxruntime")
    model, feeds = _model_and_feeds(x_shape, w_shape, attrs, bias, mask, np.float32)
    got = Session(model).run(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape,w_shape,attrs,bias,mask", CASES)
def test_standard_op_form_equals_the_kernel(x_shape, w_shape, attrs, bias, mask):
    model, feeds = _model_and_feeds(x_shape, w_shape, attrs, bias, mask)
    want = Session(model).run(feeds)["y"]
    decomposed = ir.from_proto(model)
    DecomposePass()(decomposed)
    assert not [n for n in decomposed.graph if n.op_type in ("DeformConv", "GridSample")]
    np.testing.assert_allclose(Session(decomposed).run(feeds)["y"], want, rtol=1e-12, atol=1e-12)


def test_shapes_known_only_at_run_time_leave_it_in_place_and_its_gradient_is_refused():
    model, _ = _model_and_feeds(*CASES[0], dims={"x": ["n", 2, "h", "w"]})
    graph = model.graph
    graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    with pytest.raises(gradgen.ModelError, match="node 'deform'.*DeformConv in its standard-op form.*static shapes"):
        gradgen.build_backward(model, wrt_inputs=True)
