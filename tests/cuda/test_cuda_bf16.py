"""bfloat16 on the CUDA backend: every kernel family against the CPU backend on the same bf16 graph.

The CPU backend computes a bf16 step in float32 and rounds each output once
(gradgen/executor/low_precision.py); a CUDA kernel loads bf16, computes and accumulates in float32
and rounds once when it stores. So a correctly rounded op (Add, Mul, Div, Sqrt, Cast, a max, a
copy, ...) gives the same bits on both; an op whose float32 math differs in the last bits (Exp,
Tanh, ...) or whose sums run in another order (GEMMs, convolutions, reductions) is within a bf16
rounding or two of it. End to end: a small CNN and a GPT block built with ``precision="bf16"``
give the CPU backend's loss and gradients within bf16 tolerance.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]
BF, F, H, D, I64, B = (
    TensorProto.BFLOAT16,
    TensorProto.FLOAT,
    TensorProto.FLOAT16,
    TensorProto.DOUBLE,
    TensorProto.INT64,
    TensorProto.BOOL,
)
BF16 = np.dtype(ml_dtypes.bfloat16)
ULP = 2.0**-7  # the spacing of bf16 values in [1, 2): one rounding is at most half of it


def model(nodes, inputs, outputs, opset=22):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def bf16(rng, shape, low=None, high=None):
    """Standard normal (or uniform in [low, high)) values, rounded to bf16."""
    x = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return np.asarray(x, np.float32).astype(BF16)


def run(m, feeds, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallbacks' one-time notes
        with Session(m, device=device) as sess:
            return sess.run(feeds)


def cpu_and_cuda(m, feeds):
    """The outputs of the CPU and CUDA backends (the CUDA run three times: eager, recorded,
    replayed, which must agree bit for bit)."""
    want = run(m, feeds, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Session(m, device="cuda") as sess:
            runs = [sess.run(feeds) for _ in range(3)]
    for later in runs[1:]:
        for name in want:
            assert later[name].tobytes() == runs[0][name].tobytes(), f"{name}: CUDA runs differ"
    got = runs[0]
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype, (name, got[name].dtype, want[name].dtype)
        assert got[name].shape == want[name].shape, (name, got[name].shape, want[name].shape)
    return got, want


def assert_bits(got, want):
    for name in want:
        g, w = np.asarray(got[name]), np.asarray(want[name])
        same = g.tobytes() == w.tobytes()
        if not same and g.dtype == BF16:  # NaNs may carry other payloads
            gf, wf = g.astype(np.float32), w.astype(np.float32)
            same = bool(np.all((gf == wf) | (np.isnan(gf) & np.isnan(wf))))
        assert same, f"{name}: not the CPU backend's bits ({_worst(g, w)})"


def assert_close(got, want, rounds=2.0, scaled=False, floor=1e-30):
    """Within ``rounds`` bf16 roundings of each element (of the tensor's largest |value| where
    ``scaled``: sums whose order differs, where a small element is the difference of large ones;
    of ``floor`` at least: float32 math that cancels near zero)."""
    for name in want:
        g, w = np.asarray(got[name]).astype(np.float64), np.asarray(want[name]).astype(np.float64)
        if w.dtype == bool or np.asarray(want[name]).dtype.kind in "iub":
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
            continue
        scale = np.max(np.abs(w)) if scaled and w.size else np.abs(w)
        bound = rounds * ULP * np.maximum(scale, floor)
        bad = np.abs(g - w) > bound
        assert not np.any(bad), f"{name}: {int(bad.sum())} of {bad.size} elements off ({_worst(got[name], want[name])})"


def _worst(g, w) -> str:
    g, w = np.asarray(g).astype(np.float64), np.asarray(w).astype(np.float64)
    if g.size == 0:
        return "empty"
    diff = np.abs(g - w)
    i = int(np.nanargmax(diff)) if np.any(np.isfinite(diff)) else 0
    return f"largest difference {diff.flat[i]:.3g} at {i}: {g.flat[i]!r} vs {w.flat[i]!r}"


def one_op(op, ins, outs, *, domain="", opset=22, **attrs):
    """A one-node model: ``ins`` / ``outs`` are (name, elem type, shape)."""
    node = helper.make_node(op, [n for n, _, _ in ins], [n for n, _, _ in outs], domain=domain, **attrs)
    return model([node], ins, outs, opset)


# -- elementwise: exact ops give the CPU's bits ------------------------------------------------------


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"])
def test_binary_ops_give_the_cpu_bits(op):
    rng = np.random.default_rng(1)
    x, y = bf16(rng, (6, 33)), bf16(rng, (33,))
    if op == "Pow":
        x, y = np.abs(x), np.full((33,), 2, BF16)  # y == 2: x * x, exact in float32
    m = one_op(op, [("x", BF, [6, 33]), ("y", BF, [33])], [("z", BF, [6, 33])])
    assert_bits(*cpu_and_cuda(m, {"x": x, "y": y}))


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_comparisons_give_the_cpu_bits(op):
    rng = np.random.default_rng(2)
    x = bf16(rng, (5, 40))
    y = x.copy()
    y[::2] = bf16(rng, (3, 40))
    m = one_op(op, [("x", BF, [5, 40]), ("y", BF, [5, 40])], [("z", B, [5, 40])])
    assert_bits(*cpu_and_cuda(m, {"x": x, "y": y}))


@pytest.mark.parametrize("op", ["Neg", "Abs", "Relu", "Sqrt", "Reciprocal", "Floor", "Sign", "IsNaN"])
def test_exact_unary_ops_give_the_cpu_bits(op):
    rng = np.random.default_rng(3)
    x = bf16(rng, (7, 129)) * BF16.type(3)
    if op == "Sqrt":
        x = np.abs(x)
    x.flat[5] = np.nan
    out = B if op == "IsNaN" else BF
    m = one_op(op, [("x", BF, [7, 129])], [("y", out, [7, 129])])
    assert_bits(*cpu_and_cuda(m, {"x": x}))


@pytest.mark.parametrize("op", ["Exp", "Log", "Tanh", "Sigmoid", "Erf", "Softplus", "Sin", "Gelu"])
def test_transcendental_unary_ops_within_a_rounding(op):
    rng = np.random.default_rng(4)
    x = bf16(rng, (4, 257))
    if op == "Log":
        x = np.abs(x) + BF16.type(0.01)
    m = one_op(op, [("x", BF, [4, 257])], [("y", BF, [4, 257])], opset=22 if op != "Gelu" else 20)
    assert_close(*cpu_and_cuda(m, {"x": x}), rounds=1.0, floor=1e-2)


def test_variadic_sum_where_and_clip_give_the_cpu_bits():
    rng = np.random.default_rng(5)
    a, b, c = (bf16(rng, (8, 50)) for _ in range(3))
    nodes = [
        helper.make_node("Sum", ["a", "b", "c"], ["s"]),
        helper.make_node("Max", ["a", "b", "c"], ["mx"]),
        helper.make_node("Greater", ["a", "b"], ["g"]),
        helper.make_node("Where", ["g", "a", "c"], ["w"]),
        helper.make_node("Clip", ["w", "lo", "hi"], ["cl"]),
    ]
    m = model(
        nodes,
        [("a", BF, [8, 50]), ("b", BF, [8, 50]), ("c", BF, [8, 50]), ("lo", BF, []), ("hi", BF, [])],
        [("s", BF, [8, 50]), ("mx", BF, [8, 50]), ("w", BF, [8, 50]), ("cl", BF, [8, 50])],
    )
    feeds = {"a": a, "b": b, "c": c, "lo": np.array(-0.5, BF16), "hi": np.array(0.75, BF16)}
    assert_bits(*cpu_and_cuda(m, feeds))


@pytest.mark.parametrize("other", [F, H, D, I64, TensorProto.INT32, TensorProto.INT8, TensorProto.UINT8, B])
def test_casts_to_and_from_bf16_give_the_cpu_bits(other):
    """Round to nearest even into bf16 (through float32, as ml_dtypes and the CPU backend do),
    exact out of it; NaN, infinities, overflow and ties included."""
    rng = np.random.default_rng(6)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(other)
    wide = np.concatenate(
        [
            rng.standard_normal(200) * 100,
            [np.nan, np.inf, -np.inf, 3.5e38, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-30, 0.0, -0.0, 1e-40],
        ]
    )
    if np_type.kind == "f":
        with np.errstate(over="ignore"):
            src = wide.astype(np_type)
    elif np_type.kind == "b":
        src = (rng.standard_normal(210) > 0).astype(np_type)
    else:
        info = np.iinfo(np_type)
        src = rng.integers(max(info.min, -(2**20)), min(info.max, 2**20), 210, endpoint=True).astype(np_type)
        src[:3] = [info.min if info.min > -(2**31) else -(2**24) - 1, 0, min(info.max, 2**24 + 1)]
    back = bf16(rng, (210,)) * BF16.type(50)
    if np_type.kind in "iu":  # integral values the type holds: a defined cast
        back = np.clip(np.round(back.astype(np.float32)), 0 if np_type.kind == "u" else -100, 100).astype(BF16)
    nodes = [helper.make_node("Cast", ["src"], ["to_bf"], to=BF), helper.make_node("Cast", ["back"], ["from_bf"], to=other)]
    m = model(nodes, [("src", other, [210]), ("back", BF, [210])], [("to_bf", BF, [210]), ("from_bf", other, [210])])
    assert_bits(*cpu_and_cuda(m, {"src": src, "back": back}))


# -- GEMMs and convolutions: float32 accumulation ----------------------------------------------------


def test_matmul_gemm_and_fused_matmul():
    rng = np.random.default_rng(7)
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["mm"]),
        helper.make_node("Gemm", ["x", "w", "c"], ["gm"], transB=1, alpha=0.5, beta=1.0),
        helper.make_node("FusedMatMul", ["a", "b2"], ["fm"], domain="com.microsoft", transB=1, alpha=2.0),
    ]
    m = model(
        nodes,
        [
            ("a", BF, [3, 17, 64]),
            ("b", BF, [64, 24]),
            ("x", BF, [32, 48]),
            ("w", BF, [40, 48]),
            ("c", BF, [40]),
            ("b2", BF, [3, 24, 64]),
        ],
        [("mm", BF, [3, 17, 24]), ("gm", BF, [32, 40]), ("fm", BF, [3, 17, 24])],
    )
    feeds = {
        "a": bf16(rng, (3, 17, 64)),
        "b": bf16(rng, (64, 24)),
        "x": bf16(rng, (32, 48)),
        "w": bf16(rng, (40, 48)),
        "c": bf16(rng, (40,)),
        "b2": bf16(rng, (3, 24, 64)),
    }
    assert_close(*cpu_and_cuda(m, feeds), scaled=True)


def test_long_bf16_gemm_rounds_once():
    """A long bf16 sum accumulates in float32 to the end: within one bf16 rounding of the exact
    product, element by element. The shape is a GPT-2 LM head's input gradient (K = the vocabulary),
    where cuBLAS's default split-K adds partial sums in bf16 (1.28e-2 here, over three roundings).
    All-positive terms, so no element is a small difference of large ones."""
    m, k, n = 2048, 50257, 768
    rng = np.random.default_rng(11)
    a, b = bf16(rng, (m, k), 0.5, 1.5), bf16(rng, (k, n), 0.5, 1.5)
    m_ = model([helper.make_node("MatMul", ["a", "b"], ["c"])], [("a", BF, [m, k]), ("b", BF, [k, n])], [("c", BF, [m, n])])
    got = run(m_, {"a": a, "b": b}, "cuda")["c"].astype(np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    relative = np.abs(got - exact) / exact
    assert relative.max() <= ULP / 2 * 1.01, f"worst relative error {relative.max():.3g}, one rounding is {ULP / 2:.3g}"


@pytest.mark.parametrize("pads", [[1, 1, 1, 1], [0, 1, 2, 0]], ids=["symmetric", "asymmetric"])
def test_conv_and_conv_grad(pads):
    """cuDNN's bf16 convolutions (forward, dX, dW) and the bias gradient, against the CPU's."""
    rng = np.random.default_rng(8)
    attrs = dict(pads=pads, strides=[1, 2], kernel_shape=[3, 3])
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs),
        helper.make_node("ConvGrad", ["dy", "x", "w"], ["dx", "dw", "db"], domain="com.microsoft", **attrs),
    ]
    y_shape = [2, 8, 10 + pads[0] + pads[2] - 2, (11 + pads[1] + pads[3] - 3) // 2 + 1]
    m = model(
        nodes,
        [("x", BF, [2, 4, 10, 11]), ("w", BF, [8, 4, 3, 3]), ("b", BF, [8]), ("dy", BF, y_shape)],
        [("y", BF, y_shape), ("dx", BF, [2, 4, 10, 11]), ("dw", BF, [8, 4, 3, 3]), ("db", BF, [8])],
    )
    feeds = {"x": bf16(rng, (2, 4, 10, 11)), "w": bf16(rng, (8, 4, 3, 3)), "b": bf16(rng, (8,)), "dy": bf16(rng, y_shape)}
    assert_close(*cpu_and_cuda(m, feeds), scaled=True)


def test_conv_direct_kernels(monkeypatch):
    """Where cuDNN declines, conv.cu's direct kernels serve bf16 too."""
    from gradgen.kernels.cuda import conv

    monkeypatch.setattr(conv, "FORCE_DIRECT", True)
    test_conv_and_conv_grad([1, 1, 1, 1])


# -- reductions, softmax, norms, pooling, losses ------------------------------------------------------


def test_reductions_softmax_and_cumsum():
    rng = np.random.default_rng(9)
    nodes = [
        helper.make_node("Constant", [], ["ax0"], value=helper.make_tensor("a0", I64, [1], [0])),
        helper.make_node("Constant", [], ["ax2"], value=helper.make_tensor("a2", I64, [1], [2])),
        helper.make_node("ReduceSum", ["x", "ax0"], ["rs"]),
        helper.make_node("ReduceMean", ["x", "ax2"], ["rm"]),
        helper.make_node("ReduceMax", ["x"], ["rx"]),
        helper.make_node("Softmax", ["x"], ["sm"], axis=-1),
        helper.make_node("LogSoftmax", ["x"], ["ls"], axis=1),
        helper.make_node("SoftmaxGrad_13", ["dy", "sm"], ["sg"], domain="com.microsoft", axis=-1),
        helper.make_node("CumSum", ["x", "cax"], ["cs"]),
    ]
    m = model(
        nodes,
        [("x", BF, [6, 5, 70]), ("dy", BF, [6, 5, 70]), ("cax", I64, [])],
        [
            ("rs", BF, [1, 5, 70]),
            ("rm", BF, [6, 5, 1]),
            ("rx", BF, [1, 1, 1]),
            ("sm", BF, [6, 5, 70]),
            ("ls", BF, [6, 5, 70]),
            ("sg", BF, [6, 5, 70]),
            ("cs", BF, [6, 5, 70]),
        ],
    )
    feeds = {"x": bf16(rng, (6, 5, 70)), "dy": bf16(rng, (6, 5, 70)), "cax": np.array(2, np.int64)}
    got, want = cpu_and_cuda(m, feeds)
    assert_bits({"rx": got["rx"]}, {"rx": want["rx"]})
    assert_close(got, want, scaled=True)


def test_layer_norm_batch_norm_and_layer_norm_grad():
    rng = np.random.default_rng(10)
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1, epsilon=1e-5),
        helper.make_node(
            "LayerNormalizationGrad",
            ["dy", "x", "s", "mean", "inv"],
            ["dx", "ds", "db"],
            domain="com.microsoft",
            axis=-1,
            epsilon=1e-5,
        ),
        helper.make_node("BatchNormalization", ["img", "c1", "c2", "c3", "c4"], ["bn"], epsilon=1e-5),
    ]
    m = model(
        nodes,
        [
            ("x", BF, [12, 96]),
            ("s", BF, [96]),
            ("b", BF, [96]),
            ("dy", BF, [12, 96]),
            ("img", BF, [2, 3, 5, 5]),
            ("c1", BF, [3]),
            ("c2", BF, [3]),
            ("c3", BF, [3]),
            ("c4", BF, [3]),
        ],
        [
            ("y", BF, [12, 96]),
            ("mean", F, [12, 1]),
            ("inv", F, [12, 1]),
            ("dx", BF, [12, 96]),
            ("ds", BF, [96]),
            ("db", BF, [96]),
            ("bn", BF, [2, 3, 5, 5]),
        ],
    )
    feeds = {
        "x": bf16(rng, (12, 96)),
        "s": bf16(rng, (96,)),
        "b": bf16(rng, (96,)),
        "dy": bf16(rng, (12, 96)),
        "img": bf16(rng, (2, 3, 5, 5)),
        "c1": bf16(rng, (3,)),
        "c2": bf16(rng, (3,)),
        "c3": bf16(rng, (3,)),
        "c4": bf16(rng, (3,), 0.5, 2.0),
    }
    assert_close(*cpu_and_cuda(m, feeds), rounds=4.0, scaled=True)


def test_pooling():
    rng = np.random.default_rng(11)
    nodes = [
        helper.make_node("MaxPool", ["x"], ["mp", "idx"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["x"], ["ap"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["x"], ["gap"]),
        helper.make_node("GlobalMaxPool", ["x"], ["gmp"]),
    ]
    m = model(
        nodes,
        [("x", BF, [2, 3, 9, 9])],
        [
            ("mp", BF, [2, 3, 5, 5]),
            ("idx", I64, [2, 3, 5, 5]),
            ("ap", BF, [2, 3, 4, 4]),
            ("gap", BF, [2, 3, 1, 1]),
            ("gmp", BF, [2, 3, 1, 1]),
        ],
    )
    got, want = cpu_and_cuda(m, {"x": bf16(rng, (2, 3, 9, 9))})
    exact = ("mp", "idx", "gmp")
    assert_bits({k: got[k] for k in exact}, {k: want[k] for k in exact})
    assert_close(got, want, scaled=True)


def test_softmax_cross_entropy_loss_and_grad():
    rng = np.random.default_rng(12)
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss", "logp"], reduction="mean", ignore_index=2),
        helper.make_node(
            "SoftmaxCrossEntropyLossGrad", ["dl", "logp", "t"], ["dx"], domain="com.microsoft", reduction="mean", ignore_index=2
        ),
    ]
    m = model(
        nodes,
        [("x", BF, [16, 10]), ("t", I64, [16]), ("dl", BF, [])],
        [("loss", BF, []), ("logp", BF, [16, 10]), ("dx", BF, [16, 10])],
    )
    feeds = {"x": bf16(rng, (16, 10)), "t": rng.integers(0, 10, 16), "dl": np.array(1.0, BF16)}
    assert_close(*cpu_and_cuda(m, feeds), rounds=4.0, scaled=True)


# -- indexing and data movement: exact ----------------------------------------------------------------


def test_gathers_scatters_and_their_gradients():
    rng = np.random.default_rng(13)
    idx = rng.integers(0, 20, (6, 5))
    nodes = [
        helper.make_node("Gather", ["data", "rows"], ["g"], axis=0),
        helper.make_node("GatherElements", ["data", "ge_idx"], ["ge"], axis=1),
        helper.make_node("ScatterElements", ["data", "ge_idx", "upd"], ["se"], axis=1, reduction="add"),
        helper.make_node("GatherGrad", ["shape", "rows", "dg"], ["gg"], domain="com.microsoft", axis=0),
    ]
    m = model(
        nodes,
        [
            ("data", BF, [20, 16]),
            ("rows", I64, [6, 5]),
            ("ge_idx", I64, [20, 4]),
            ("upd", BF, [20, 4]),
            ("shape", I64, [2]),
            ("dg", BF, [6, 5, 16]),
        ],
        [("g", BF, [6, 5, 16]), ("ge", BF, [20, 4]), ("se", BF, [20, 16]), ("gg", BF, [20, 16])],
    )
    feeds = {
        "data": bf16(rng, (20, 16)),
        "rows": idx,
        "ge_idx": rng.integers(0, 16, (20, 4)),
        "upd": bf16(rng, (20, 4)),
        "shape": np.array([20, 16], np.int64),
        "dg": bf16(rng, (6, 5, 16)),
    }
    got, want = cpu_and_cuda(m, feeds)
    assert_bits({k: got[k] for k in ("g", "ge")}, {k: want[k] for k in ("g", "ge")})
    assert_close(got, want, rounds=2.0, scaled=True)  # sums of repeated indices: order may differ


def test_data_movement_gives_the_cpu_bits():
    rng = np.random.default_rng(14)
    shape = helper.make_tensor("shp", I64, [2], [4, 6])
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1]),
        helper.make_node("Concat", ["x", "x"], ["c"], axis=1),
        helper.make_node("Slice", ["x", "st", "en"], ["s"]),
        helper.make_node("Pad", ["x", "pads"], ["p"]),
        helper.make_node("Constant", [], ["shape"], value=shape),
        helper.make_node("ConstantOfShape", ["shape"], ["k"], value=helper.make_tensor("v", BF, [1], [1.5])),
        helper.make_node("Identity", ["x"], ["i"]),
    ]
    m = model(
        nodes,
        [("x", BF, [3, 4, 5]), ("st", I64, [1]), ("en", I64, [1]), ("pads", I64, [6])],
        [
            ("t", BF, [5, 3, 4]),
            ("c", BF, [3, 8, 5]),
            ("s", BF, [3, 4, 3]),
            ("p", BF, [3, 5, 7]),
            ("k", BF, [4, 6]),
            ("i", BF, [3, 4, 5]),
        ],
    )
    feeds = {
        "x": bf16(rng, (3, 4, 5)),
        "st": np.array([1]),
        "en": np.array([4]),
        "pads": np.array([0, 1, 1, 0, 0, 1]),
    }
    assert_bits(*cpu_and_cuda(m, feeds))


# -- fusion: a bf16 chain as one kernel gives the unfused kernels' bits, and the CPU's ------------


def test_fused_bf16_chain(monkeypatch):
    from gradgen.executor import fusion

    rng = np.random.default_rng(15)
    nodes = [
        helper.make_node("Mul", ["x", "s"], ["a"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Tanh", ["c"], ["t"]),
        helper.make_node("Greater", ["x", "b"], ["g"]),
        helper.make_node("Where", ["g", "t", "x"], ["w"]),
        helper.make_node("Div", ["w", "s"], ["y"]),
        helper.make_node("Cast", ["y"], ["yf"], to=F),
        helper.make_node("Cast", ["yf"], ["yh"], to=H),
        helper.make_node("Sum", ["x", "y", "c"], ["z"]),
    ]
    m = model(
        nodes,
        [("x", BF, [64, 96]), ("s", BF, [96]), ("b", BF, [64, 1])],
        [("y", BF, [64, 96]), ("yh", H, [64, 96]), ("z", BF, [64, 96])],
    )
    feeds = {"x": bf16(rng, (64, 96)), "s": bf16(rng, (96,), 0.5, 2.0), "b": bf16(rng, (64, 1))}
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(fusion.ENV, switch)
        with Session(m, device="cuda") as sess:
            fused_steps = sum(s.op_type == fusion.OP_TYPE for s in sess.steps)
            results[switch] = (sess.run(feeds), fused_steps)
    (off, none), (on, count) = results["0"], results["1"]
    assert none == 0 and count >= 1
    assert_bits(on, off)
    want = run(m, feeds, "cpu")
    assert_close(on, want, scaled=True)  # Tanh's float32 may differ in its last bits


# -- errors -------------------------------------------------------------------------------------------


def test_a_type_no_kernel_has_is_a_one_line_error_naming_the_node():
    m = one_op("Cast", [("x", BF, [4])], [("y", TensorProto.FLOAT8E4M3FN, [4])], to=TensorProto.FLOAT8E4M3FN)
    m.graph.node[0].name = "to_fp8"
    from gradgen.errors import GradgenError

    with pytest.raises(GradgenError) as info:
        run(m, {"x": np.ones(4, BF16)}, "cuda")
    message = str(info.value)
    assert "\n" not in message and "'to_fp8'" in message and "Cast" in message and "FLOAT8E4M3FN" in message


# -- end to end: models built with precision="bf16" ----------------------------------------------------


@pytest.mark.parametrize("directory", ["cnn_legacy", "gpt2_hand_legacy", "resnet_block_legacy"])
def test_bf16_models_match_the_cpu_backend(directory):
    """A small CNN, a GPT block and a ResNet block (Conv into BatchNormalization: the convolutions
    with float32 outputs on both backends), built with precision="bf16": the CUDA step's loss and gradients
    against the CPU backend's, within bf16 tolerance (``gradgen run --compare``'s bf16 defaults:
    rtol 1e-2, atol 5e-2 of each tensor's scale)."""
    from gradgen.compare import compare_outputs, resolve_tolerance

    path = ROOT / "tests/fixtures/models" / directory
    built = gradgen.build_backward(path / "model.onnx", precision="bf16")
    feeds = dict(np.load(path / "inputs.npz"))
    got, want = cpu_and_cuda(built.model, feeds)
    grads = [n for n in want if n.endswith("_grad")]
    assert grads and all(want[n].dtype == np.float32 for n in grads)
    tolerance = resolve_tolerance(built.model, None, None)
    assert tolerance.precision == "bf16"
    comparison = compare_outputs(got, want, rtol=tolerance.rtol, atol=tolerance.atol, floor=0.1)
    assert not comparison.failures and not comparison.unmatched, comparison.format()
    loss = next(n for n in want if not n.endswith("_grad") and want[n].size == 1)
    assert abs(float(got[loss]) - float(want[loss])) <= 1e-2 * abs(float(want[loss]))
