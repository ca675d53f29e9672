"""HannWindow, HammingWindow, BlackmanWindow and MelWeightMatrix on the CPU: against ONNX's reference
implementation, for both window kinds, several sizes and output types, and the refusals."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.errors import RunError
from gradgen.executor import Session

WINDOWS = ["HannWindow", "HammingWindow", "BlackmanWindow"]


def _window_model(op_type: str, **attrs):
    node = helper.make_node(op_type, ["size"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        op_type,
        [helper.make_tensor_value_info("size", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", attrs.get("output_datatype", TensorProto.FLOAT), None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op_type", WINDOWS)
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16])
@pytest.mark.parametrize("size", [0, 1, 2, 7, 64])
def test_window_matches_onnx_reference(op_type, periodic, dtype, size):
    model = _window_model(op_type, periodic=periodic, output_datatype=dtype)
    feeds = {"size": np.array(size, np.int64)}
    got = Session(model).run(feeds)["y"]
    if size == 1 and not periodic:  # the reference divides 0 by 0; one point of a symmetric window is 1
        np.testing.assert_array_equal(got, np.ones(1, got.dtype))
        return
    # the reference computes a float16 window in float16; gradgen computes in float64 and rounds once
    reference = model
    if dtype == TensorProto.FLOAT16:
        reference = _window_model(op_type, periodic=periodic, output_datatype=TensorProto.DOUBLE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = ReferenceEvaluator(reference).run(None, feeds)[0].astype(got.dtype)
    assert got.dtype == helper.tensor_dtype_to_np_dtype(dtype) and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_negative_window_size_is_refused():
    with pytest.raises(RunError, match="size must not be negative"):
        Session(_window_model("HannWindow")).run({"size": np.array(-1, np.int64)})


def _mel_model(dtype=TensorProto.FLOAT):
    node = helper.make_node("MelWeightMatrix", ["bins", "length", "rate", "low", "high"], ["y"], output_datatype=dtype)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, []) for n in ("bins", "length", "rate")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in ("low", "high")]
    graph = helper.make_graph([node], "mel", inputs, [helper.make_tensor_value_info("y", dtype, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def mel_feeds(bins, length, rate, low, high):
    return {
        "bins": np.array(bins, np.int64),
        "length": np.array(length, np.int64),
        "rate": np.array(rate, np.int64),
        "low": np.array(low, np.float32),
        "high": np.array(high, np.float32),
    }


@pytest.mark.parametrize("args", [(8, 64, 16000, 0.0, 8000.0), (5, 32, 8000, 100.0, 3000.0), (40, 512, 22050, 20.0, 11000.0)])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_mel_weight_matrix_matches_onnx_reference(args, dtype):
    model = _mel_model(dtype)
    feeds = mel_feeds(*args)
    got = Session(model).run(feeds)["y"]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == want.dtype and got.shape == want.shape == (args[1] // 2 + 1, args[0])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 64, 16000, 0.0, 8000.0), "num_mel_bins >= 1"),
        ((8, 64, 16000, 500.0, 100.0), "lower <= upper"),
        ((8, 64, 8000, 0.0, 8000.0), "reaches past"),
    ],
)
def test_mel_weight_matrix_refuses_impossible_edges(args, match):
    with pytest.raises(RunError, match=match):
        Session(_mel_model()).run(mel_feeds(*args))
