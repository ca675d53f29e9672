"""The declared CUDA fallbacks (gradgen.kernels.registry.CUDA_FALLBACKS) run on a GPU session: the
op's numpy kernel on host copies, with the same results as the CPU session (the one-time warning is
said once per process, so it is not asserted here). tests/test_coverage.py checks that every declared op has a model here."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.executor import Session
from gradgen.kernels import registry
from gradgen.ops.schemas import LOWERED_FORWARD_OPS
from tests.control_flow_models import if_model, loop_feeds, loop_model, scan_feeds, scan_model
from tests.gradcheck import case_model
from tests.test_grad_rules import CASES

pytestmark = pytest.mark.cuda


def _range_model():
    node = helper.make_node("Range", ["start", "limit", "delta"], ["y"])
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in ("start", "limit", "delta")]
    graph = helper.make_graph([node], "range", inputs, [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    feeds = {"start": np.array(2, np.int64), "limit": np.array(11, np.int64), "delta": np.array(3, np.int64)}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds


def _case_model(op_type: str):
    case = next(c for c in CASES if c.op_type == op_type and not c.domain)
    model, feeds, _ = case_model(case)
    return model, feeds


def _microsoft_case_model(op_type: str):
    case = next(c for c in CASES if c.op_type == op_type and c.domain == "com.microsoft")
    model, feeds, _ = case_model(case)
    return model, feeds


def _dynamic_quantize_model():
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])
    outputs = [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8)]
    graph = helper.make_graph(
        [node],
        "dql",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(n, t, None) for n, t in outputs],
    )
    feeds = {"x": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds


def _argmax_model():
    node = helper.make_node("ArgMax", ["x"], ["y"], axis=-1, keepdims=0)
    graph = helper.make_graph(
        [node],
        "argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    feeds = {"x": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds


def _quantize_model():
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=0)
    graph = helper.make_graph(
        [node],
        "quantize",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 4] if n == "x" else [3]) for n in ("x", "s")]
        + [helper.make_tensor_value_info("z", TensorProto.INT8, [3])],
        [helper.make_tensor_value_info("y", TensorProto.INT8, None)],
    )
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(3, 4)).astype(np.float32), "s": np.array([0.01, 0.02, 0.05], np.float32)}
    feeds["z"] = np.array([-3, 0, 7], np.int8)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), feeds


def _non_zero_model():
    node = helper.make_node("NonZero", ["x"], ["y"])
    graph = helper.make_graph(
        [node],
        "nonzero",
        [helper.make_tensor_value_info("x", TensorProto.BOOL, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
    )
    feeds = {"x": np.random.default_rng(0).random((3, 4)) < 0.5}
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), feeds


# op -> a forward model holding it, and its feeds
MODELS = {
    "Einsum": lambda: _case_model("Einsum"),
    "GRU": lambda: _case_model("GRU"),
    "LSTM": lambda: _case_model("LSTM"),
    "AffineGrid": lambda: _case_model("AffineGrid"),
    "CenterCropPad": lambda: _case_model("CenterCropPad"),
    "Col2Im": lambda: _case_model("Col2Im"),
    "DeformConv": lambda: _case_model("DeformConv"),
    "Det": lambda: _case_model("Det"),
    "DFT": lambda: _case_model("DFT"),
    "GridSample": lambda: _case_model("GridSample"),
    "LRN": lambda: _case_model("LRN"),
    "LpPool": lambda: _case_model("LpPool"),
    "MaxUnpool": lambda: _case_model("MaxUnpool"),
    "RotaryEmbedding": lambda: _case_model("RotaryEmbedding"),
    "Mean": lambda: _case_model("Mean"),
    "Range": _range_model,
    "DynamicQuantizeLinear": _dynamic_quantize_model,
    "QuantizeLinear": _quantize_model,
    "DequantizeLinear": lambda: _case_model("DequantizeLinear"),
    "Resize": lambda: _case_model("Resize"),
    "RoiAlign": lambda: _case_model("RoiAlign"),
    "MaxRoiPool": lambda: _case_model("MaxRoiPool"),
    "ArgMax": _argmax_model,
    "STFT": lambda: _case_model("STFT"),
    "RNN": lambda: _case_model("RNN"),
    "TopK": lambda: _case_model("TopK"),
    "Compress": lambda: _case_model("Compress"),
    "CumProd": lambda: _case_model("CumProd"),
    "NonZero": _non_zero_model,
    "OneHot": lambda: _case_model("OneHot"),
    "ReverseSequence": lambda: _case_model("ReverseSequence"),
    "Unique": lambda: _case_model("Unique"),
    **{
        op: (lambda op=op: _microsoft_case_model(op)) if domain else (lambda op=op: _case_model(op))
        for domain, op in LOWERED_FORWARD_OPS
    },
    "If": lambda: (if_model("data"), {"x": np.random.default_rng(0).normal(size=(2, 4))}),
    "Loop": lambda: (loop_model(), loop_feeds()),
    "Scan": lambda: (scan_model(), scan_feeds(scan_model())),
    "ReluGrad": lambda: _microsoft_case_model("ReluGrad"),
    "SigmoidGrad": lambda: _microsoft_case_model("SigmoidGrad"),
    "TanhGrad": lambda: _microsoft_case_model("TanhGrad"),
    "GeluGrad": lambda: _microsoft_case_model("GeluGrad"),
    "FastGeluGrad": lambda: _microsoft_case_model("FastGeluGrad"),
    "BiasGeluGrad_dX": lambda: _microsoft_case_model("BiasGeluGrad_dX"),
    "BiasFastGeluGrad_dX": lambda: _microsoft_case_model("BiasFastGeluGrad_dX"),
    "SoftmaxGrad_13": lambda: _microsoft_case_model("SoftmaxGrad_13"),
    "SimplifiedLayerNormalizationGrad": lambda: _microsoft_case_model("SimplifiedLayerNormalizationGrad"),
    "Scale": lambda: _microsoft_case_model("Scale"),
    "MaxPoolGrad": lambda: _case_model("MaxPoolGrad"),
    "AveragePoolGrad": lambda: _case_model("AveragePoolGrad"),
    "LogSoftmaxGrad_13": lambda: _microsoft_case_model("LogSoftmaxGrad_13"),
    "TensorScatter": lambda: _case_model("TensorScatter"),
}


@pytest.mark.parametrize("op_type", sorted(MODELS))
def test_declared_fallback_runs_on_a_gpu_session(op_type):
    model, feeds = MODELS[op_type]()
    want = Session(model).run(feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = Session(model, device="cuda").run(feeds)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("op_type", sorted(op for _, op in registry.CUDA_STANDARD_FORMS))
def test_standard_form_op_runs_as_its_form_on_a_gpu_session(op_type):
    """The ops of CUDA_STANDARD_FORMS become standard ops before a GPU Session plans: no step is the
    op itself, every step without a launcher is a declared fallback, and the results match the CPU's."""
    model, feeds = MODELS[op_type]()
    want = Session(model).run(feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = Session(model, device="cuda")
        got = session.run(feeds)
    ops = {(step.domain, step.op_type) for step in session.steps}
    assert not ops & set(registry.CUDA_STANDARD_FORMS), op_type
    hosted = {op for op in ops if (entry := registry.lookup(*op)) is not None and entry.cuda is None}
    assert hosted <= set(registry.CUDA_FALLBACKS), hosted
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
