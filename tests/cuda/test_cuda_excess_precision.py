"""The CUDA steps of gradgen/executor/excess_precision.py: a 16-bit Conv and its Cast to float32
(cuDNN's float32 output against the convolution of the same 16-bit values in float64, and against
the CPU backend's step), a 16-bit product and its bias Add rounded once; and a 16-bit Gemm with a C,
which rounds once as the CPU's does."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.executor import Session
from gradgen.executor.excess_precision import OP_TYPE
from gradgen.kernels.cpu import conv as cpu_conv

pytestmark = [pytest.mark.cuda]

BF16 = np.dtype(ml_dtypes.bfloat16)
LOW = {BF16: TensorProto.BFLOAT16, np.dtype(np.float16): TensorProto.FLOAT16}

# ResNet-18's convolutions at batch 2 (stem, 3x3, 3x3 strided, 1x1 strided downsample), a grouped
# one with asymmetric pads, and a 1-D one: (x shape, w shape, attributes)
CASES = [
    ((2, 3, 64, 64), (16, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    ((2, 64, 28, 28), (64, 64, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 64, 28, 28), (128, 64, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    ((2, 64, 28, 28), (128, 64, 1, 1), dict(strides=[2, 2])),
    ((2, 8, 9, 7), (8, 4, 3, 3), dict(pads=[0, 1, 2, 0], group=2)),
    ((2, 8, 33), (4, 8, 5), dict(pads=[2, 2])),
]


def _model(x_shape, w_shape, attrs, low, bias):
    inputs = ["x", "w", "b"] if bias else ["x", "w"]
    nodes = [
        helper.make_node("Conv", inputs, ["y"], **attrs),
        helper.make_node("Cast", ["y"], ["y32"], to=TensorProto.FLOAT),
        helper.make_node("Neg", ["y32"], ["out"]),
    ]
    shapes = {"x": x_shape, "w": w_shape, "b": (w_shape[0],)}
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info(n, low, shapes[n]) for n in inputs],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", list(LOW), ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_float32_output_of_16_bit_operands(case, dtype, bias):
    from gradgen.kernels.cuda import conv as conv_cuda

    x_shape, w_shape, attrs = case
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal(x_shape).astype(dtype), "w": (rng.standard_normal(w_shape) * 0.2).astype(dtype)}
    if bias:
        feeds["b"] = rng.standard_normal(w_shape[0]).astype(dtype)
    exact = cpu_conv.conv(*(feeds[k].astype(np.float64) for k in ("x", "w", "b") if k in feeds), **attrs)
    with Session(_model(x_shape, w_shape, attrs, LOW[dtype], bias), device="cuda") as session:
        assert [s.op_type for s in session.steps] == [OP_TYPE, "Neg"]
        got = -session.run(feeds)["out"]
    lifted_w = tuple(conv_cuda._geometry(x_shape, w_shape, attrs).lifted(w_shape))  # 1-D runs as 2-D
    plans = [plan for key, plan in conv_cuda._GRAPHS.items() if key[0] == "fprop" and "->" in key[1] and key[3] == lifted_w]
    assert plans, "no float32-output cuDNN plan was asked for"
    if x_shape[1] != 3:  # cuDNN 9 (H100) has no engine for the 3-channel stem: cast up, the same values
        assert all(plans), "cuDNN had no float32-output engine"
    assert got.dtype == np.float32 and got.shape == exact.shape
    # float32 sums of exact 16-bit products: far below one 16-bit rounding (2^-9 for bf16, 2^-12 for fp16)
    assert np.abs(got - exact).max() <= 2e-5 * np.abs(exact).max()
    cpu = -Session(_model(x_shape, w_shape, attrs, LOW[dtype], bias)).run(feeds)["out"]
    assert np.abs(got - cpu).max() <= 2e-5 * np.abs(exact).max()


def test_without_cudnn_the_operands_are_cast_up(monkeypatch):
    """gradgen's direct kernels have no 16-bit-in, float32-out form: the float32 convolution of the
    operands cast up gives the same values (exact products, float32 sums), not the bf16 result."""
    from gradgen.kernels.cuda import conv

    monkeypatch.setattr(conv, "FORCE_DIRECT", True)
    x_shape, w_shape, attrs = CASES[1]
    rng = np.random.default_rng(12)
    feeds = {"x": rng.standard_normal(x_shape).astype(BF16), "w": (rng.standard_normal(w_shape) * 0.2).astype(BF16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Session(_model(x_shape, w_shape, attrs, TensorProto.BFLOAT16, False), device="cuda") as session:
            got = -session.run(feeds)["out"]
    exact = cpu_conv.conv(feeds["x"].astype(np.float64), feeds["w"].astype(np.float64), **attrs)
    assert np.abs(got - exact).max() <= 2e-5 * np.abs(exact).max()


# ---------------------------------------------------------------- MatMul + bias, rounded once

LINEAR_CASES = [  # (a shape, b shape, FusedMatMul attributes or None for MatMul)
    ((8, 256, 768), (768, 2304), None),  # GPT-2's qkv Linear at batch 8
    ((3, 5, 64), (64, 7), None),
    ((2, 5, 64), (2, 64, 7), None),  # a batched product: one bias over every batch
    ((4, 64), (7, 64), dict(transB=1, alpha=0.5)),
    ((2, 64, 5), (2, 7, 64), dict(transA=1, transB=1)),
]


def _linear_model(a_shape, b_shape, attrs, low):
    if attrs is None:
        product = helper.make_node("MatMul", ["a", "b"], ["y"])
    else:
        product = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", **attrs)
    nodes = [product, helper.make_node("Add", ["y", "c"], ["s"]), helper.make_node("Neg", ["s"], ["out"])]
    n = b_shape[-2] if attrs and attrs.get("transB") else b_shape[-1]
    shapes = {"a": a_shape, "b": b_shape, "c": (n,)}
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info(k, low, shapes[k]) for k in "abc"],
        [helper.make_tensor_value_info("out", low, None)],
    )
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets), shapes


@pytest.mark.parametrize("dtype", list(LOW), ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[str(i) for i in range(len(LINEAR_CASES))])
def test_matmul_bias_is_rounded_once(case, dtype):
    """The bias is added to cuBLAS's float32 accumulator (a float32 C) and the sum rounded once, as
    the CPU step computes; the graph's two roundings reach a whole unit in the last place."""
    a_shape, b_shape, attrs = case
    model, shapes = _linear_model(a_shape, b_shape, attrs, LOW[dtype])
    rng = np.random.default_rng(3)
    feeds = {k: (rng.standard_normal(shapes[k]) * (0.2 if k == "b" else 1.0)).astype(dtype) for k in "abc"}
    with Session(model, device="cuda") as session:
        assert [s.op_type for s in session.steps] == ["MatMulBias", "Neg"]
        got = (-session.run(feeds)["out"]).astype(np.float64)
    a, b, c = (feeds[k].astype(np.float64) for k in "abc")
    attrs = attrs or {}
    if attrs.get("transA"):
        a = np.swapaxes(a, -1, -2)
    if attrs.get("transB"):
        b = np.swapaxes(b, -1, -2)
    alpha = attrs.get("alpha", 1.0)
    _assert_rounded_once(got, alpha * (a @ b) + c, abs(alpha) * (np.abs(a) @ np.abs(b)) + np.abs(c), a.shape[-1], dtype)
    cpu = (-Session(model).run(feeds)["out"]).astype(np.float64)
    assert np.mean(got == cpu) > 0.99


def _assert_rounded_once(got, exact, magnitudes, k: int, dtype) -> None:
    """``got`` is ``exact`` (float64) summed in float32 and rounded once to ``dtype``: within half a
    unit in its last place plus float32 accumulation's error, (k + 1) u sum|terms| (``magnitudes``),
    and equal to the once-rounded value on almost every element (a rare one near a tie rounds the
    other way; two roundings, product then sum, differ on a sizeable share)."""
    accumulated = (k + 1) * 2.0**-24 * magnitudes
    mantissa_bits = 7 if dtype == BF16 else 10
    reach = np.maximum(np.abs(exact) + accumulated, 1e-30)
    half_ulp = 2.0 ** (np.floor(np.log2(reach)) - mantissa_bits - 1)
    assert np.all(np.abs(got - exact) <= half_ulp + accumulated)
    once = exact.astype(np.float32).astype(dtype).astype(np.float64)
    assert np.mean(got == once) > 0.99


# nn.Linear as the legacy exporter writes it (Gemm, transB=1) at GPT-2's qkv size, where cuBLAS
# rounded the product before adding a 16-bit C; a 2-D C; alpha and beta
GEMM_CASES = [
    ((2048, 768), (2304, 768), (2304,), dict(transB=1)),
    ((64, 96), (96, 80), (64, 80), dict(alpha=0.5, beta=0.25)),
    ((96, 64), (80, 96), (1, 80), dict(transA=1, transB=1)),
]


@pytest.mark.parametrize("dtype", list(LOW), ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=[str(i) for i in range(len(GEMM_CASES))])
def test_gemm_with_c_is_rounded_once(case, dtype):
    a_shape, b_shape, c_shape, attrs = case
    node = helper.make_node("Gemm", ["a", "b", "c"], ["y"], **attrs)
    shapes = {"a": a_shape, "b": b_shape, "c": c_shape}
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info(k, LOW[dtype], shapes[k]) for k in "abc"],
        [helper.make_tensor_value_info("y", LOW[dtype], None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    rng = np.random.default_rng(5)
    feeds = {k: (rng.standard_normal(shapes[k]) * (0.2 if k == "b" else 1.0)).astype(dtype) for k in "abc"}
    with Session(model, device="cuda") as session:
        got = session.run(feeds)["y"].astype(np.float64)
    a, b, c = (feeds[k].astype(np.float64) for k in "abc")
    a = a.T if attrs.get("transA") else a
    b = b.T if attrs.get("transB") else b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    magnitudes = abs(alpha) * (np.abs(a) @ np.abs(b)) + abs(beta) * np.abs(c)
    _assert_rounded_once(got, alpha * (a @ b) + beta * c, magnitudes, a.shape[1], dtype)
    cpu = Session(model).run(feeds)["y"].astype(np.float64)
    assert np.mean(got == cpu) > 0.99


@pytest.mark.parametrize("dtype", list(LOW), ids=["bf16", "fp16"])
def test_a_linear_takes_cublaslt_bias_epilogue_and_the_float32_c_gives_the_same_rounding(dtype, monkeypatch):
    """GPT-2's qkv Linear runs as one cuBLASLt call whose BIAS epilogue adds the bias to the float32
    accumulator; with that off (GRADGEN_CUBLASLT_BIAS=0) the float32 C path computes the same
    once-rounded sums (equal but for a rare element near a tie: the two may sum in other orders)."""
    from gradgen.kernels.cuda import matmul as cuda_matmul

    model, shapes = _linear_model((8, 256, 768), (768, 2304), None, LOW[dtype])
    rng = np.random.default_rng(11)
    feeds = {k: (rng.standard_normal(shapes[k]) * (0.2 if k == "b" else 1.0)).astype(dtype) for k in "abc"}
    with Session(model, device="cuda") as session:
        epilogue = session.run(feeds)["out"].astype(np.float64)
    assert cuda_matmul._STATE.get("lt") is not None, cuda_matmul._STATE.get("lt_error")
    assert any(isinstance(key, tuple) and key[:4] == ("lt", 2048, 2304, 768) for key in cuda_matmul._STATE)
    monkeypatch.setenv(cuda_matmul.LT_ENV, "0")
    monkeypatch.delitem(cuda_matmul._STATE, "lt")
    with Session(model, device="cuda") as session:
        float32_c = session.run(feeds)["out"].astype(np.float64)
    assert cuda_matmul._STATE.get("lt") is None
    assert np.mean(epilogue == float32_c) > 0.99


def test_an_operand_off_cublaslt_alignment_takes_the_float32_c_path_with_the_same_values():
    """cuBLASLt's algorithms assume 256-byte aligned operands: a view two bytes into its buffer
    must not reach them, and its sums are the once-rounded ones all the same."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda import matmul as cuda_matmul

    m, k, n = 64, 96, 80
    rng = np.random.default_rng(13)
    a = rng.standard_normal((m, k)).astype(BF16)
    b = (rng.standard_normal((k, n)) * 0.2).astype(BF16)
    c = rng.standard_normal(n).astype(BF16)
    shifted = rt.to_device(np.concatenate([np.zeros(1, BF16), a.reshape(-1)]))[1:].reshape(m, k)
    assert int(shifted.gpudata) % cuda_matmul.LT_ALIGNMENT
    aligned = rt.to_device(a)
    b_d, c_d = rt.to_device(b), rt.to_device(c)
    got = rt.to_host(cuda_matmul.matmul_bias(shifted, b_d, c_d)).astype(np.float64)
    through_lt = rt.to_host(cuda_matmul.matmul_bias(aligned, b_d, c_d)).astype(np.float64)
    assert np.mean(through_lt == got) > 0.99  # equal but for a rare element near a tie
    a64, b64, c64 = (x.astype(np.float64) for x in (a, b, c))
    _assert_rounded_once(got, a64 @ b64 + c64, np.abs(a64) @ np.abs(b64) + np.abs(c64), k, BF16)
