"""QuantizeLinear / DequantizeLinear: the CPU kernels against ONNX Runtime and ONNX's reference
evaluator on random cases (per tensor, per axis, per block; uint8 / int8 / uint16 / int16; ties
rounded half to even; saturation), and their gradients: DequantizeLinear's float scale (finite
differences: tests/grad_cases/quantize.py), QuantizeLinear refused by name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.errors import GradgenError
from gradgen.executor import Session

_TYPES = {np.uint8: TensorProto.UINT8, np.int8: TensorProto.INT8, np.uint16: TensorProto.UINT16, np.int16: TensorProto.INT16}


def _model(op: str, feeds: dict, out_type: int, opset: int, **attrs) -> onnx.ModelProto:
    names = [n if feeds.get(n) is not None else "" for n in feeds]
    while names and not names[-1]:
        names.pop()
    inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in feeds.items()
        if a is not None
    ]
    graph = helper.make_graph(
        [helper.make_node(op, names, ["y"], name="q", **attrs)], "q", inputs, [helper.make_tensor_value_info("y", out_type, None)]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _random_case(rng, dtype, mode: str):
    """x, scale, zero point and attributes for one quantization mode (per tensor, axis or block)."""
    rank = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(1, 6, rank))
    axis = int(rng.integers(-rank, rank))
    info = np.iinfo(dtype)
    attrs: dict = {}
    if mode == "tensor":
        param_shape: tuple = () if rng.random() < 0.5 else (1,)
    elif mode == "axis":
        param_shape, attrs["axis"] = (shape[axis],), axis
    else:
        block = int(rng.integers(1, shape[axis] + 2))
        attrs.update(axis=axis, block_size=block)
        param_shape = tuple(-(-d // block) if i == axis % rank else d for i, d in enumerate(shape))
    scale = rng.uniform(0.01, 0.5, param_shape).astype(np.float32)
    span = min(int(info.max) - int(info.min), 300)
    zero = rng.integers(int(info.min), int(info.min) + span, param_shape, endpoint=True).astype(dtype)
    # x reaches past the type's range (saturation) and holds exact ties (k + 0.5) * scale
    x = (rng.uniform(-1.2, 1.2, shape) * span * scale.max()).astype(np.float32)
    ties = rng.random(shape) < 0.2
    x = np.where(ties, (np.round(x / scale.max()) + 0.5) * scale.max(), x).astype(np.float32)
    return x, scale, zero, attrs


def _cases():
    rng = np.random.default_rng(7)
    cases = []
    for dtype in _TYPES:
        for mode in ("tensor", "axis", "block"):
            for _ in range(6):
                cases.append((dtype, mode, _random_case(rng, dtype, mode)))
    return cases


def _ort(model: onnx.ModelProto, feeds: dict):
    ort = pytest.importorskip("onnxruntime")
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {k: v for k, v in feeds.items() if v is not None})[0]
    except Exception as exc:  # no kernel for this type / mode in this build, or a mode it refuses
        return str(exc).splitlines()[0]


@pytest.mark.parametrize("dtype,mode,case", [pytest.param(*c, id=f"{c[0].__name__}-{c[1]}-{i}") for i, c in enumerate(_cases())])
def test_quantize_and_dequantize_match_onnx_runtime_and_the_reference(dtype, mode, case):
    x, scale, zero, attrs = case
    opset = 21 if mode == "block" or dtype in (np.uint16, np.int16) else 19  # 13's semantics; ONNX Runtime runs 13 too
    feeds = {"x": x, "s": scale, "z": zero}
    model = _model("QuantizeLinear", feeds, _TYPES[dtype], opset, **attrs)
    got = Session(model).run(feeds)["y"]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)
    for version in {opset, 13} if opset == 19 else {opset}:
        ort_y = _ort(_model("QuantizeLinear", feeds, _TYPES[dtype], version, **attrs), feeds)
        if not isinstance(ort_y, str):
            np.testing.assert_array_equal(got, ort_y)

    dfeeds = {"x": got, "s": scale, "z": zero}
    dmodel = _model("DequantizeLinear", dfeeds, TensorProto.FLOAT, opset, **attrs)
    y = Session(dmodel).run(dfeeds)["y"]
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, ReferenceEvaluator(dmodel).run(None, dfeeds)[0])
    ort_y = _ort(dmodel, dfeeds)
    if not isinstance(ort_y, str):
        np.testing.assert_array_equal(y, ort_y)


def test_onnx_runtime_runs_most_cases():
    """The ONNX Runtime comparison above is not skipped wholesale: it runs the per-tensor and
    per-axis 8-bit cases (all 24, both ops) at opset 13."""
    ran = 0
    for dtype, mode, (x, scale, zero, attrs) in _cases():
        if mode == "block" or dtype not in (np.uint8, np.int8):
            continue
        feeds = {"x": x, "s": scale, "z": zero}
        for op, f in (("QuantizeLinear", feeds), ("DequantizeLinear", {**feeds, "x": np.zeros(x.shape, dtype)})):
            ran += not isinstance(_ort(_model(op, f, _TYPES[dtype] if op == "QuantizeLinear" else 1, 13, **attrs), f), str)
    assert ran == 48  # every one of them


def test_quantize_without_zero_point_is_uint8_and_output_dtype_picks_the_type():
    x = np.array([-3.0, -0.5, 0.5, 1.5, 2.5, 300.0], np.float32)
    s = np.array(1.0, np.float32)
    y = Session(_model("QuantizeLinear", {"x": x, "s": s}, TensorProto.UINT8, 13)).run({"x": x, "s": s})["y"]
    np.testing.assert_array_equal(y, np.array([0, 0, 0, 2, 2, 255], np.uint8))  # ties to even, saturated
    model = _model("QuantizeLinear", {"x": x, "s": s}, TensorProto.INT16, 21, output_dtype=TensorProto.INT16)
    y = Session(model).run({"x": x, "s": s})["y"]
    assert y.dtype == np.int16
    np.testing.assert_array_equal(y, ReferenceEvaluator(model).run(None, {"x": x, "s": s})[0])


def test_dequantize_int32_and_float16_scale():
    x = np.array([[-(2**20), 7, 0], [5, -9, 2**21]], np.int32)
    s = np.array([0.25, 0.5], np.float16)
    feeds = {"x": x, "s": s}
    model = _model("DequantizeLinear", feeds, TensorProto.FLOAT16, 19, axis=0)
    y = Session(model).run(feeds)["y"]
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, _ort(model, feeds))


@pytest.mark.parametrize(
    "op,feeds,out,opset,attrs,message",
    [
        ("QuantizeLinear", {"x": np.ones((2, 3), np.float32), "s": np.ones(2, np.float32)}, 2, 13, {}, "axis 1"),
        (
            "QuantizeLinear",
            {"x": np.ones(3, np.float32), "s": np.ones((), np.float32)},
            17,
            21,
            {"output_dtype": 17},
            "output_dtype 17",
        ),
        (
            "DequantizeLinear",
            {"x": np.ones((4, 3), np.uint8), "s": np.ones((3, 3), np.float32)},
            1,
            21,
            {"axis": 0, "block_size": 2},
            "block",
        ),
        ("DequantizeLinear", {"x": np.ones(3, np.int64), "s": np.ones((), np.float32)}, 1, 13, {}, "int64"),
    ],
)
def test_bad_input_is_one_line_naming_the_node(op, feeds, out, opset, attrs, message):
    with pytest.raises(GradgenError) as info:
        Session(_model(op, feeds, out, opset, **attrs)).run(feeds)
    text = str(info.value)
    assert "\n" not in text and "'q'" in text and message in text, text
