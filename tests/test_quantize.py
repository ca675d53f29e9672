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

import gradgen
from gradgen.errors import GradgenError, ModelError
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


# -- gradients --------------------------------------------------------------------------------------


def _qdq_model(share_scale: bool = True) -> onnx.ModelProto:
    """loss = sum(MatMul(DQ(Q(a)), DQ(W_int8)) * r): an activation QDQ pair (its scale shared by Q
    and DQ unless ``share_scale`` is off) feeding a layer with int8 weights and a float weight scale."""
    rng = np.random.default_rng(3)
    inits = [
        onnx.numpy_helper.from_array(np.array(0.05, np.float32), "a_scale"),
        onnx.numpy_helper.from_array(np.array(0.05, np.float32), "a_scale_dq"),
        onnx.numpy_helper.from_array(np.array(3, np.int8), "a_zero"),
        onnx.numpy_helper.from_array(rng.integers(-100, 100, (4, 3)).astype(np.int8), "w_q"),
        onnx.numpy_helper.from_array(rng.uniform(0.01, 0.1, 3).astype(np.float32), "w_scale"),
        onnx.numpy_helper.from_array(rng.uniform(0.5, 1.5, (2, 3)).astype(np.float32), "r"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["a", "a_scale", "a_zero"], ["a_q"], name="quant_a"),
        helper.make_node(
            "DequantizeLinear", ["a_q", "a_scale" if share_scale else "a_scale_dq", "a_zero"], ["a_dq"], name="deq_a"
        ),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=1, name="deq_w"),
        helper.make_node("MatMul", ["a_dq", "w"], ["h"], name="mm"),
        helper.make_node("Mul", ["h", "r"], ["p"], name="mul"),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=9)


def _one_line_error(**kwargs) -> str:
    with pytest.raises(ModelError) as info:
        gradgen.build_backward(_qdq_model(kwargs.pop("share_scale", True)), **kwargs)
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_a_gradient_through_quantize_linear_is_refused_naming_the_node():
    text = _one_line_error(wrt_inputs=True, wrt=["w_scale"])  # a reaches Q's x
    assert "input 0 ('a') of QuantizeLinear node 'quant_a'" in text, text
    # by default the shared activation scale is a parameter (DequantizeLinear's), and it reaches Q too
    text = _one_line_error()
    assert "input 1 ('a_scale') of QuantizeLinear node 'quant_a'" in text, text


def test_the_weight_scale_gradient_is_dy_times_the_centred_integers():
    a = np.random.default_rng(4).normal(size=(2, 4)).astype(np.float32)
    for built in (
        gradgen.build_backward(_qdq_model(), freeze=["a_scale"]),
        gradgen.build_backward(_qdq_model(share_scale=False), wrt=["w_scale", "a_scale_dq"]),
    ):
        got = Session(built.model).run({"a": a})
        feeds = {name: onnx.numpy_helper.to_array(t) for name, t in [(t.name, t) for t in _qdq_model().graph.initializer]}
        a_q = np.clip(np.rint(a / np.float32(0.05)) + 3, -128, 127)
        a_dq = ((a_q - 3) * np.float32(0.05)).astype(np.float32)
        dw = a_dq.T.astype(np.float64) @ feeds["r"].astype(np.float64)  # dloss/dw, w = w_q * w_scale
        np.testing.assert_allclose(got["w_scale_grad"], (dw * feeds["w_q"]).sum(axis=0), rtol=1e-5)
        if "a_scale_dq_grad" in got:  # dloss/da_dq . (a_q - zero)
            da = feeds["r"].astype(np.float64) @ (feeds["w_q"] * feeds["w_scale"]).T.astype(np.float64)
            np.testing.assert_allclose(got["a_scale_dq_grad"], (da * (a_q - 3)).sum(), rtol=1e-5)
    assert "a_scale_dq_grad" in got


def test_block_quantization_gradient_is_refused_naming_the_node():
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["x", "s"], ["y"], axis=1, block_size=2, name="deq_blocks"),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ],
        "blocks",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[onnx.numpy_helper.from_array(np.ones((2, 4), np.int8), "x")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    with pytest.raises(ModelError, match="DequantizeLinear node 'deq_blocks': .*block"):
        gradgen.build_backward(model, wrt_inputs=True)
