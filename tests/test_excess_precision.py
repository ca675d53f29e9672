"""Excess precision (gradgen/executor/excess_precision.py): a 16-bit Conv read only by a Cast to
float32 runs as one step that keeps the convolution's float32 result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from numpy.lib.stride_tricks import sliding_window_view
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from gradgen.executor.excess_precision import ENV, OP_TYPE

BF16 = np.dtype(ml_dtypes.bfloat16)
X_SHAPE, W_SHAPE = (2, 8, 9, 9), (6, 8, 3, 3)


def _conv_model(low: int = TensorProto.BFLOAT16, to: int = TensorProto.FLOAT, *, bias=False, also=None, stride=1):
    """out = -Cast(Conv(x, w[, b]), to); ``also``: another reader of the Conv's output ("Relu"),
    "output" to make the Conv's output a graph output, "cast-output" the Cast's."""
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    nodes = [
        helper.make_node("Conv", inputs, ["y"], pads=[1, 1, 1, 1], strides=[stride, stride]),
        helper.make_node("Cast", ["y"], ["y32"], to=to),
        helper.make_node("Neg", ["y32"], ["out"]),
    ]
    outputs = [helper.make_tensor_value_info("out", to, None)]
    if also == "cast-output":
        outputs.append(helper.make_tensor_value_info("y32", to, None))
    if also == "Relu":
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", low, None))
    elif also == "output":
        outputs.append(helper.make_tensor_value_info("y", low, None))
    shapes = {"x": X_SHAPE, "w": W_SHAPE, "b": (W_SHAPE[0],)}
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info(n, low, shapes[n]) for n in inputs], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def _feeds(dtype, bias=False):
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal(X_SHAPE), "w": rng.standard_normal(W_SHAPE) * 0.3}
    if bias:
        feeds["b"] = rng.standard_normal(W_SHAPE[0])
    return {k: v.astype(dtype) for k, v in feeds.items()}


def _exact_conv(feeds, stride=1):
    """The convolution of the (16-bit) feeds in float64: pads 1, the given stride."""
    x = np.pad(feeds["x"].astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    w = feeds["w"].astype(np.float64)
    windows = sliding_window_view(x, w.shape[2:], axis=(2, 3))[:, :, ::stride, ::stride]
    y = np.einsum("nchwij,kcij->nkhw", windows, w)
    if "b" in feeds:
        y += feeds["b"].astype(np.float64)[None, :, None, None]
    return y


def _op_types(session) -> list[str]:
    return [step.op_type for step in session.steps]


@pytest.mark.parametrize("dtype,low", [(BF16, TensorProto.BFLOAT16), (np.dtype(np.float16), TensorProto.FLOAT16)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_the_pair_keeps_the_float32_convolution(dtype, low, bias, stride):
    feeds = _feeds(dtype, bias)
    session = Session(_conv_model(low, bias=bias, stride=stride))
    assert _op_types(session) == [OP_TYPE, "Neg"]
    got = -session.run(feeds)["out"]
    exact = _exact_conv(feeds, stride)
    assert got.dtype == np.float32 and got.shape == exact.shape
    # the float32 sum of exact 16-bit products: far below one 16-bit rounding (2^-9 for bf16)
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_off_the_conv_rounds_to_its_type(monkeypatch):
    """GRADGEN_EXCESS_PRECISION=0: Conv and Cast run as the graph says, the output rounded to bf16."""
    monkeypatch.setenv(ENV, "0")
    feeds = _feeds(BF16)
    session = Session(_conv_model())
    assert _op_types(session) == ["Conv", "Cast", "Neg"]
    got = -session.run(feeds)["out"]
    exact = _exact_conv(feeds)
    error = np.abs(got - exact).max() / np.abs(exact).max()
    assert 2**-12 < error <= 2**-8  # bf16's rounding: the values are bf16 ones
    np.testing.assert_array_equal(got, got.astype(BF16).astype(np.float32))


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(_conv_model(also="Relu"), id="another-reader"),
        pytest.param(_conv_model(also="output"), id="graph-output"),
        pytest.param(_conv_model(also="cast-output"), id="cast-is-a-graph-output"),
        pytest.param(_conv_model(to=TensorProto.FLOAT16), id="cast-to-fp16"),
        pytest.param(_conv_model(TensorProto.FLOAT, TensorProto.DOUBLE), id="float32-conv"),
        pytest.param(_conv_model(TensorProto.FLOAT16, TensorProto.DOUBLE), id="cast-to-double"),
    ],
)
def test_only_a_narrow_value_nothing_else_sees_is_widened(model):
    assert OP_TYPE not in _op_types(Session(model))


def _worst_error(model, reference, feeds) -> float:
    got, want = Session(model).run(feeds), Session(reference).run(feeds)
    names = [n for n in want if n.endswith("_grad") and "running" not in n]
    return max(np.abs(got[n] - want[n]).max() / np.abs(want[n]).max() for n in names)


def test_bf16_gradients_closer_to_float32_with_the_wide_convolutions(monkeypatch, tmp_path):
    """A tiny ResNet-18 layout in bf16: each Conv feeds a BatchNormalization, so each runs wide; the
    parameters' gradients come closer to the float32 model's than with every Conv rounded
    (worst tensor 1.6e-2 against 9.6e-2 when written)."""
    pytest.importorskip("torch")
    from gradgen.bench import models

    spec = models.preset("resnet18-tiny")
    feeds = models.make_inputs(spec)
    onnx.save(models.export(models.build_module(spec), feeds), tmp_path / "resnet.onnx")
    bf16 = gradgen.build_backward(tmp_path / "resnet.onnx", precision="bf16").model
    fp32 = gradgen.build_backward(tmp_path / "resnet.onnx").model
    assert _op_types(Session(bf16)).count(OP_TYPE) == 20
    wide = _worst_error(bf16, fp32, feeds)
    monkeypatch.setenv(ENV, "0")
    rounded = _worst_error(bf16, fp32, feeds)
    assert wide < rounded / 2, (wide, rounded)
    monkeypatch.delenv(ENV)
    assert OP_TYPE not in _op_types(Session(fp32))


# ---------------------------------------------------------------- MatMul + bias: one rounding

A_SHAPE, B_SHAPE = (2, 5, 64), (64, 7)


def _linear_model(low: int = TensorProto.BFLOAT16, *, fused=False, bias_first=False, also=None):
    """out = Neg(Add(MatMul(a, b), c)) (FusedMatMul with transB over b stored transposed where
    ``fused``); ``also``: "Relu" another reader of the product, "output" the product a graph
    output, "sum-output" the Add's output a graph output, "matrix-bias" a 2-D c."""
    c_shape = (5, 7) if also == "matrix-bias" else (7,)
    if fused:
        product = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", transB=1, alpha=0.5)
    else:
        product = helper.make_node("MatMul", ["a", "b"], ["y"])
    add = helper.make_node("Add", ["c", "y"] if bias_first else ["y", "c"], ["s"])
    nodes = [product, add, helper.make_node("Neg", ["s"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", low, None)]
    if also == "Relu":
        nodes.append(helper.make_node("Relu", ["y"], ["r"]))
        outputs.append(helper.make_tensor_value_info("r", low, None))
    elif also == "output":
        outputs.append(helper.make_tensor_value_info("y", low, None))
    elif also == "sum-output":
        outputs.append(helper.make_tensor_value_info("s", low, None))
    b_shape = B_SHAPE[::-1] if fused else B_SHAPE
    shapes = {"a": A_SHAPE, "b": b_shape, "c": c_shape}
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info(n, low, shapes[n]) for n in "abc"], outputs)
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _linear_feeds(dtype, *, fused=False, c_shape=(7,)):
    rng = np.random.default_rng(9)
    b = rng.standard_normal(B_SHAPE) * 0.2
    feeds = {"a": rng.standard_normal(A_SHAPE), "b": b.T.copy() if fused else b, "c": rng.standard_normal(c_shape) * 3}
    return {k: v.astype(dtype) for k, v in feeds.items()}


def _exact_linear(feeds, *, fused=False):
    a, b, c = (feeds[k].astype(np.float64) for k in "abc")
    return (0.5 * a @ b.T if fused else a @ b) + c


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["MatMul", "FusedMatMul"])
@pytest.mark.parametrize("bias_first", [False, True], ids=["bias-second", "bias-first"])
def test_the_bias_is_added_before_the_one_rounding(dtype, fused, bias_first):
    feeds = _linear_feeds(dtype, fused=fused)
    low = TensorProto.BFLOAT16 if dtype == BF16 else TensorProto.FLOAT16
    session = Session(_linear_model(low, fused=fused, bias_first=bias_first))
    assert [s.op_type for s in session.steps] == ["MatMulBias", "Neg"]
    got = -session.run(feeds)["out"]
    exact = _exact_linear(feeds, fused=fused)
    once = exact.astype(np.float32).astype(dtype)  # float32 sums of exact products: the float64 value to ~1e-7
    assert got.dtype == dtype
    assert np.array_equal(got.astype(np.float64), once.astype(np.float64))
    twice = (exact - feeds["c"].astype(np.float64)).astype(dtype).astype(np.float64) + feeds["c"].astype(np.float64)
    assert not np.array_equal(twice.astype(dtype).astype(np.float64), got.astype(np.float64))  # the rounding it saves


def test_off_the_product_and_the_sum_round_apart(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    feeds = _linear_feeds(BF16)
    session = Session(_linear_model())
    assert [s.op_type for s in session.steps] == ["MatMul", "Add", "Neg"]
    product = (feeds["a"].astype(np.float64) @ feeds["b"].astype(np.float64)).astype(BF16)
    expected = (product.astype(np.float32) + feeds["c"].astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(-session.run(feeds)["out"], expected)


@pytest.mark.parametrize("also", ["Relu", "output", "sum-output", "matrix-bias"])
def test_only_a_product_nothing_else_sees_takes_the_bias(also):
    """Another reader or a graph output sees the rounded product (or the graph's sum); a 2-D addend
    is not a bias: each keeps MatMul and Add apart."""
    session = Session(_linear_model(also=also))
    assert [s.op_type for s in session.steps][:2] == ["MatMul", "Add"]
    c_shape = (5, 7) if also == "matrix-bias" else (7,)
    result = session.run(_linear_feeds(BF16, c_shape=c_shape))
    assert result["out"].dtype == BF16


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=["bf16", "fp16"])
def test_a_16_bit_gemm_adds_c_before_its_one_rounding(dtype):
    """Gemm states the bias in the op: C joins the float32 sum and the result is rounded once, as
    ``torch.addmm`` computes ``nn.Linear`` (the CUDA kernel the same, tests/cuda)."""
    low = TensorProto.BFLOAT16 if dtype == BF16 else TensorProto.FLOAT16
    shapes = {"a": (5, 64), "b": (7, 64), "c": (7,)}
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], transB=1, alpha=0.5)
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info(n, low, shapes[n]) for n in "abc"],
        [helper.make_tensor_value_info("y", low, None)],
    )
    rng = np.random.default_rng(4)
    feeds = {k: (rng.standard_normal(shape) * (0.2 if k == "b" else 3.0)).astype(dtype) for k, shape in shapes.items()}
    got = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])).run(feeds)["y"]
    a, b, c = (feeds[k].astype(np.float64) for k in "abc")
    exact = 0.5 * a @ b.T + c
    assert got.dtype == dtype
    assert np.array_equal(got.astype(np.float64), exact.astype(np.float32).astype(dtype).astype(np.float64))
    twice = ((0.5 * a @ b.T).astype(dtype).astype(np.float64) + c).astype(dtype).astype(np.float64)
    assert not np.array_equal(twice, got.astype(np.float64))  # the rounding it saves


def test_float32_linears_are_left_alone():
    session = Session(_linear_model(TensorProto.FLOAT))
    assert [s.op_type for s in session.steps] == ["MatMul", "Add", "Neg"]


def test_a_bf16_training_step_runs_every_linear_with_one_rounding(tmp_path):
    """The training step's plan (``DeviceStepRunner``) of a tiny GPT-2 layout in bf16: each block's
    four nn.Linear products take their bias in one step; the attention products, which have none,
    stay MatMuls."""
    pytest.importorskip("torch")
    from gradgen.bench import models
    from gradgen.model_io import save_model
    from gradgen.training import AdamW, DeviceStepRunner, build_training

    spec = models.preset("gpt2-tiny")
    module = models.build_module(spec)
    path = tmp_path / "gpt2.onnx"
    save_model(models.export(module, models.make_inputs(spec)), path)
    program = build_training(str(path), optimizer=AdamW(weight_decay=0.01), precision="bf16")
    ops = [step.op_type for step in DeviceStepRunner(program, "cpu").train.steps]
    assert ops.count("MatMulBias") == 4 * spec.arch["layers"]
    assert ops.count("MatMul") == 2 * spec.arch["layers"] + 1  # q @ k, att @ v per block; the LM head
