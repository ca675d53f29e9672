"""gradgen.kernels.cpu.onednn_eltwise: exp and the sigmoid of large float32 arrays through oneDNN,
and the kernels that use it (Exp, Sigmoid, Softmax, LogSoftmax, the cross-entropy and its gradient)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.executor import Session
from gradgen.kernels.cpu import blas, onednn, onednn_eltwise, reduction

pytestmark = pytest.mark.skipif(not blas.available(), reason="oneDNN is not installed or this CPU lacks AVX2")

_SPECIAL = [np.inf, -np.inf, np.nan, 0.0, -0.0, 88.7, 89.0, -87.0, -104.0, 1e-40, -1e-40, 20.0, -20.0, 1e-8, -1e-8]
_TRUTH = {
    "exp": np.exp,
    "logistic": lambda x: np.exp(-np.logaddexp(0.0, -x)),
}


def _sweep() -> np.ndarray:
    dense = np.linspace(-30, 30, 600_001)
    tiny = 10.0 ** np.linspace(-30, 1.5, 20_001)
    return np.concatenate([dense, tiny, -tiny, _SPECIAL]).astype(np.float32)


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got.view(np.int32).astype(np.int64) - want.astype(np.float32).view(np.int32).astype(np.int64))


@pytest.mark.parametrize("kind", ["exp", "logistic"])
def test_values_against_float64(kind):
    x = _sweep()
    got = onednn_eltwise.apply(kind, x)
    assert got is not None and got.dtype == np.float32 and got.shape == x.shape
    with np.errstate(all="ignore"):
        want = _TRUTH[kind](x.astype(np.float64))
        want32 = want.astype(np.float32)
    assert np.array_equal(np.isnan(got), np.isnan(x))  # NaN in, NaN out (oneDNN's exp gave +inf)
    tiny = np.finfo(np.float32).tiny
    normal = np.isfinite(want32) & (np.abs(want) >= tiny)
    assert _ulps(got[normal], want[normal]).max() <= 4
    # what is left: infinities, zeros and subnormal results (numpy's, from inputs below -80)
    rest = ~normal & ~np.isnan(x)
    np.testing.assert_allclose(got[rest], want32[rest], rtol=0, atol=4 * float(np.finfo(np.float32).smallest_subnormal))


def test_inputs_below_the_underflow_bound_are_numpys(monkeypatch):
    """oneDNN flushes exp(-87) to 0; a log after a Softmax or Sigmoid would then give -inf."""
    x = np.zeros((2, onednn_eltwise.MIN_ELEMENTS), np.float32)
    x[:, 0] = 95.0
    x[1, 1] = np.nan
    probabilities = reduction.softmax(x, axis=-1)
    assert probabilities[0, 1] > 0 and np.isfinite(np.log(probabilities[0, 1]))
    assert np.isnan(probabilities[1]).all()  # a NaN in a row: the whole row
    low = np.full(onednn_eltwise.MIN_ELEMENTS, -95.0, np.float32)
    low[::7] = np.linspace(-90, -60, low[::7].size, dtype=np.float32)
    low[5] = np.nan
    for kind, numpy_result in (("exp", np.exp(low)), ("logistic", np.exp(low) / (1 + np.exp(low)))):
        got = onednn_eltwise.apply(kind, low.copy())
        slow = low < onednn_eltwise.UNDERFLOW_BELOW
        assert np.array_equal(got[slow], numpy_result[slow]) and (got[slow] > 0).all()
        in_place = low.copy()
        assert onednn_eltwise.apply(kind, in_place, out=in_place) is in_place
        assert np.array_equal(in_place, got, equal_nan=True)
        assert np.isnan(got[5])


def test_what_stays_with_numpy():
    small = np.ones(onednn_eltwise.MIN_ELEMENTS - 1, np.float32)
    large = np.ones((onednn_eltwise.MIN_ELEMENTS, 2), np.float32)
    assert onednn_eltwise.apply("exp", small) is None
    assert onednn_eltwise.apply("exp", large.astype(np.float64)) is None
    assert onednn_eltwise.apply("exp", large.T) is None  # strided
    assert onednn_eltwise.apply("exp", large, out=np.empty((2, large.shape[0]), np.float32).T) is None
    assert onednn_eltwise.apply("exp", large) is not None


def test_off_where_onednn_is_not_used(monkeypatch):
    monkeypatch.setattr(onednn, "_api", False)
    x = np.linspace(-5, 5, 1 << 19, dtype=np.float32)
    assert onednn_eltwise.apply("logistic", x) is None
    np.testing.assert_array_equal(onednn_eltwise.exp(x), np.exp(x))


def test_in_place_and_the_same_bits_from_several_threads():
    x = np.random.default_rng(0).normal(size=(512, 1024)).astype(np.float32) * 4
    first = onednn_eltwise.exp(x)
    results = [None] * 4

    def work(i):
        results[i] = onednn_eltwise.exp(x)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(r, first) for r in results)
    y = x.copy()
    assert onednn_eltwise.exp(y, out=y) is y and np.array_equal(y, first)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _one_node(op: str, shape, **attrs):
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], **attrs)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "op, attrs, reference",
    [
        ("Exp", {}, np.exp),
        ("Sigmoid", {}, lambda x: 1 / (1 + np.exp(-x))),
        (
            "Softmax",
            {"axis": -1},
            lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True),
        ),
        (
            "LogSoftmax",
            {"axis": -1},
            lambda x: x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
        ),
    ],
)
def test_kernels_at_a_size_that_uses_onednn(op, attrs, reference, monkeypatch):
    calls = []
    real = onednn_eltwise._plan
    monkeypatch.setattr(onednn_eltwise, "_plan", lambda *a: calls.append(a[1:]) or real(*a))
    x = np.random.default_rng(1).normal(size=(128, 4096)).astype(np.float32) * 3
    x[0, 0] = np.nan
    y = Session(_one_node(op, x.shape, **attrs)).run({"x": x})["y"]
    assert calls, f"{op} did not go through oneDNN"
    want = reference(x.astype(np.float64))
    assert y.dtype == np.float32
    assert np.array_equal(np.isnan(y), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(y[ok], want[ok], rtol=4e-6, atol=1e-6 if op == "LogSoftmax" else 1e-30)


def test_cross_entropy_at_a_size_that_uses_onednn():
    """The prepared SoftmaxCrossEntropyLoss (mean over rows) on a language model's logits."""
    rows, classes = 64, 5000
    graph = helper.make_graph(
        [helper.make_node("SoftmaxCrossEntropyLoss", ["x", "labels"], ["loss"])],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, classes]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [rows]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(2)
    x = rng.normal(size=(rows, classes)).astype(np.float32) * 5
    labels = rng.integers(0, classes, rows)
    for _ in range(2):  # the first run is the kernel's, the next the prepared call's
        loss = float(session.run({"x": x, "labels": labels})["loss"])
        x64 = x.astype(np.float64)
        log_prob = x64 - x64.max(1, keepdims=True)
        log_prob -= np.log(np.exp(log_prob).sum(1, keepdims=True))
        assert math.isclose(loss, -log_prob[np.arange(rows), labels].mean(), rel_tol=2e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_cross_entropy_gradient_at_a_size_that_uses_onednn(monkeypatch, reduction):
    """SoftmaxCrossEntropyLossGrad's exp of a language model's log-probabilities goes to oneDNN; an
    ignored label's row is zero; the result matches float64."""
    from gradgen.kernels.cpu.loss import softmax_cross_entropy_loss_grad

    rows, classes = 64, 5000
    rng = np.random.default_rng(3)
    x = rng.normal(size=(rows, classes)) * 5
    log_prob = (x - x.max(1, keepdims=True)) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True))
    labels = rng.integers(0, classes, rows)
    labels[7] = -100  # ignored
    dy = rng.uniform(0.5, 2.0, rows) if reduction == "none" else np.array(1.5)
    kinds = []
    real = onednn_eltwise.apply
    monkeypatch.setattr(onednn_eltwise, "apply", lambda kind, *a: kinds.append(kind) or real(kind, *a))
    got = softmax_cross_entropy_loss_grad(dy.astype(np.float32), log_prob.astype(np.float32), labels, reduction=reduction)
    assert kinds == ["exp"] and got.dtype == np.float32 and got.shape == (rows, classes)
    kept = labels != -100
    want = np.exp(log_prob)
    want[np.arange(rows)[kept], labels[kept]] -= 1
    weights = kept.astype(np.float64) * (dy if reduction == "none" else float(dy))
    want *= (weights / (kept.sum() if reduction == "mean" else 1))[:, None]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)
    assert not got[7].any()


def test_many_sizes_from_two_threads():
    """More sizes than the plans kept, from two threads at once: plans are made, kept and dropped
    under one lock (reading the cache outside it raised KeyError once the cache was full)."""
    sizes = [onednn_eltwise.MIN_ELEMENTS + 64 * i for i in range(onednn_eltwise._PLANS_KEPT + 6)]
    arrays = [np.linspace(-3, 3, n, dtype=np.float32) for n in sizes]
    errors = []

    def work(order):
        try:
            for a in order:
                np.testing.assert_allclose(onednn_eltwise.exp(a), np.exp(a), rtol=1e-6)
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(order,)) for order in (arrays, arrays[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(onednn_eltwise._plans) <= onednn_eltwise._PLANS_KEPT


def test_a_library_without_eltwise_keeps_the_rest():
    library = blas.library()

    class WithoutEltwise:
        def __getattr__(self, name):
            if name == "dnnl_eltwise_forward_primitive_desc_create":
                raise AttributeError(name)
            return getattr(library, name)

    api = onednn.Api(WithoutEltwise())
    assert api.eltwise_forward_primitive_desc_create is None and api.convolution_forward_primitive_desc_create is not None
    onednn_eltwise._plans.clear()
    assert onednn_eltwise._plan(api, "exp", onednn_eltwise.MIN_ELEMENTS) is None
    onednn_eltwise._plans.clear()
