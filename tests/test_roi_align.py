"""RoiAlign: the CPU kernel against ONNX Runtime and ONNX's reference evaluator; its standard-op
form (gradgen.passes.DecomposePass, fixed sampling_ratio) against the kernel; the one-line error for
an adaptive sampling_ratio (finite differences of X's and the rois' gradients:
tests/grad_cases/conv.py; torchvision, which has roi_align, is not a test dependency)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.executor import Session
from gradgen.passes import DecomposePass

rng = np.random.default_rng(10)
ROIS = np.array([[0, 0, 7, 6], [1.5, 2.2, 5.1, 6.3], [-2, -1, 3, 2], [4, 5, 12, 11], [2, 2, 2.5, 2.4], [3, 1, 1, 3]])
BATCH = np.array([0, 1, 1, 0, 1, 0], dtype=np.int64)
ATTRS = [
    {},
    {"mode": "max"},
    {"sampling_ratio": 2, "output_height": 3, "output_width": 2},
    {"coordinate_transformation_mode": "output_half_pixel", "spatial_scale": 0.5, "output_height": 2, "output_width": 2},
    {"mode": "max", "sampling_ratio": 3, "output_height": 2, "output_width": 3, "spatial_scale": 1.5},
]


def _model(attrs, dtype=TensorProto.DOUBLE, symbolic=False, loss=False):
    node = helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], name="align", **attrs)
    nodes = [node] + ([helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)] if loss else [])
    graph = helper.make_graph(
        nodes,
        "roi_align",
        [
            helper.make_tensor_value_info("x", dtype, ["n", "c", "h", "w"] if symbolic else [2, 3, 7, 8]),
            helper.make_tensor_value_info("rois", dtype, ["r", 4] if symbolic else [6, 4]),
            helper.make_tensor_value_info("batch", TensorProto.INT64, ["r"] if symbolic else [6]),
        ],
        [helper.make_tensor_value_info("loss", dtype, []) if loss else helper.make_tensor_value_info("y", dtype, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def _feeds(dtype):
    return {"x": rng.normal(size=(2, 3, 7, 8)).astype(dtype), "rois": ROIS.astype(dtype), "batch": BATCH}


@pytest.mark.parametrize("attrs", ATTRS)
def test_kernel_matches_onnxruntime_and_the_reference(attrs):
    ort = pytest.importorskip("onnxruntime")
    feeds = _feeds(np.float32)
    model = _model(attrs, TensorProto.FLOAT, symbolic=True)
    got = Session(model).run(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-6)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ORT warns about its max mode, which this kernel follows
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    # the last roi has a negative size, on which ONNX Runtime's adaptive sampling overflows
    kept = {"x": feeds["x"], "rois": feeds["rois"][:-1], "batch": feeds["batch"][:-1]}
    np.testing.assert_allclose(got[:-1], session.run(None, kept)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("attrs", [a for a in ATTRS if a.get("sampling_ratio")] + [{"sampling_ratio": 1}])
def test_standard_op_form_equals_the_kernel(attrs, symbolic):
    feeds = _feeds(np.float64)
    model = _model(attrs, symbolic=symbolic)
    want = Session(model).run(feeds)["y"]
    decomposed = ir.from_proto(model)
    DecomposePass()(decomposed)
    assert not [n for n in decomposed.graph if n.op_type == "RoiAlign"]
    np.testing.assert_allclose(Session(decomposed).run(feeds)["y"], want, rtol=1e-13, atol=1e-13)


def test_adaptive_sampling_is_left_in_place_and_its_gradient_is_refused_by_name():
    model = _model({"output_height": 2, "output_width": 2}, loss=True)
    decomposed = ir.from_proto(model)
    DecomposePass()(decomposed)
    assert [n.op_type for n in decomposed.graph][0] == "RoiAlign"
    with pytest.raises(gradgen.ModelError, match="node 'align'.*fixed sampling_ratio .*adaptively"):
        gradgen.build_backward(model, wrt_inputs=True)


def test_out_of_range_batch_index_is_a_run_error():
    feeds = _feeds(np.float64)
    feeds["batch"] = BATCH.copy()
    feeds["batch"][2] = 2
    with pytest.raises(gradgen.RunError, match="RoiAlign.*batch index 2 is out of range for 2 images"):
        Session(_model({})).run(feeds)
