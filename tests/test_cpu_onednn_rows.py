"""gradgen.kernels.cpu.onednn_rows: Softmax, LayerNormalization and its gradient of float32 rows
through oneDNN, and the kernels that use them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from gradgen.executor.threads import available_cores, cpu_threads
from gradgen.kernels.cpu import blas, norm, onednn_rows, reduction

pytestmark = pytest.mark.skipif(not blas.available(), reason="oneDNN is not installed or this CPU lacks AVX2")

ROWS_OF_768 = (2, 16, 768)  # 24,576 elements: above MIN_ELEMENTS


def _layer_norm_truth(x, scale, bias, axis, epsilon):
    x64 = x.astype(np.float64)
    axes = tuple(range(axis, x.ndim))
    mean = x64.mean(axis=axes, keepdims=True)
    var = ((x64 - mean) ** 2).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + epsilon)
    y = (x64 - mean) * inv_std * scale.astype(np.float64)
    return y + (0 if bias is None else bias.astype(np.float64)), mean, inv_std


@pytest.mark.parametrize("shape, axis", [(ROWS_OF_768, 2), ((4, 64, 8, 16), 2), ((520, 64), 1), ((3, 40, 200), 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization_matches_float64(shape, axis, with_bias):
    rng = np.random.default_rng(len(shape) + axis)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    normalized = shape[axis:]
    scale = rng.standard_normal(normalized).astype(np.float32)
    bias = rng.standard_normal(normalized).astype(np.float32) if with_bias else None
    got = onednn_rows.layer_normalization(x, axis, scale, bias, 1e-3)
    assert got is not None
    y, mean, inv_std = got
    want_y, want_mean, want_inv = _layer_norm_truth(x, scale, bias, axis, 1e-3)
    assert y.dtype == mean.dtype == inv_std.dtype == np.float32
    assert mean.shape == inv_std.shape == shape[:axis] + (1,) * len(normalized)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=2e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv_std, want_inv, rtol=1e-5)


def test_the_layer_normalization_kernels_use_it_and_agree_with_numpy(monkeypatch):
    """The kernel and its prepared call take oneDNN's results; with oneDNN's size threshold out of
    reach they compute numpy's, which agree within float32 rounding."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(ROWS_OF_768).astype(np.float32)
    scale, bias = rng.standard_normal(768).astype(np.float32), rng.standard_normal(768).astype(np.float32)
    prepared = norm.prepare_layer_normalization((), {"axis": -1, "epsilon": 1e-5})
    calls = []
    real = onednn_rows.layer_normalization
    monkeypatch.setattr(onednn_rows, "layer_normalization", lambda *a: calls.append(a[1]) or real(*a))
    fast = [norm.layer_normalization(x, scale, bias), prepared(x, scale, bias)]
    assert calls == [2, 2]
    monkeypatch.setattr(onednn_rows, "MIN_ELEMENTS", 10**12)
    slow = [norm.layer_normalization(x, scale, bias), prepared(x, scale, bias)]
    for got, want in zip(fast, slow):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_what_layer_normalization_leaves_to_numpy():
    rng = np.random.default_rng(4)
    x = rng.standard_normal(ROWS_OF_768).astype(np.float32)
    scale, bias = np.ones(768, np.float32), np.zeros(768, np.float32)
    assert onednn_rows.layer_normalization(x.astype(np.float64), 2, scale, bias, 1e-5) is None
    assert onednn_rows.layer_normalization(x[:, :, ::2], 2, scale[:384], bias[:384], 1e-5) is None  # strided
    assert onednn_rows.layer_normalization(x[:1, :4], 2, scale, bias, 1e-5) is None  # small
    assert onednn_rows.layer_normalization(x, 1, np.ones((1, 768), np.float32), None, 1e-5) is None  # broadcast scale
    assert onednn_rows.layer_normalization(x, 2, scale.astype(np.float64), bias, 1e-5) is None
    assert onednn_rows.layer_normalization(x, 2, scale, bias, 1e-5) is not None


@pytest.mark.parametrize("shape", [(128, 768), (520, 64), (2, 40, 8, 64)])
def test_layer_normalization_gradient_matches_float64(shape, monkeypatch):
    """LayerNormalizationGrad through oneDNN's backward primitive (from the saved Mean and
    InvStdDev): dX, dScale and dBias against float64, and the kernel takes its results."""
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    scale, bias = rng.standard_normal(shape[-1]).astype(np.float32), rng.standard_normal(shape[-1]).astype(np.float32)
    _, mean, inv_std = norm.layer_normalization(x, scale, bias)
    calls = []
    real = onednn_rows.layer_normalization_grad
    monkeypatch.setattr(onednn_rows, "layer_normalization_grad", lambda *a: calls.append(a[-1]) or real(*a))
    dx, d_scale, d_bias = norm.layer_normalization_grad(dy, x, scale, mean, inv_std)
    assert calls == [x.size // shape[-1]]
    x64, g = x.astype(np.float64), dy.astype(np.float64) * scale
    mu = x64.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    normalized = (x64 - mu) * inv
    want_dx = inv * (g - g.mean(-1, keepdims=True) - normalized * (g * normalized).mean(-1, keepdims=True))
    assert dx.dtype == d_scale.dtype == d_bias.dtype == np.float32 and dx.shape == shape and d_scale.shape == (shape[-1],)
    np.testing.assert_allclose(dx, want_dx, atol=1e-5 * np.abs(want_dx).max())
    rows = dy.reshape(-1, shape[-1]).astype(np.float64)
    np.testing.assert_allclose(d_scale, (rows * normalized.reshape(rows.shape)).sum(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d_bias, rows.sum(0), rtol=1e-4, atol=1e-4)


def test_what_the_layer_normalization_gradient_leaves_to_numpy():
    rng = np.random.default_rng(10)
    x = rng.standard_normal(ROWS_OF_768).astype(np.float32)
    dy, scale = rng.standard_normal(ROWS_OF_768).astype(np.float32), np.ones(768, np.float32)
    mean, inv = np.zeros((2, 16, 1), np.float32), np.ones((2, 16, 1), np.float32)
    assert onednn_rows.layer_normalization_grad(dy, x, scale, mean, inv, 32) is not None
    assert onednn_rows.layer_normalization_grad(dy.astype(np.float64), x, scale, mean, inv, 32) is None
    assert onednn_rows.layer_normalization_grad(dy[:, ::-1], x, scale, mean, inv, 32) is None  # strided dY
    assert onednn_rows.layer_normalization_grad(dy, x, scale, mean.astype(np.float64), inv, 32) is None
    small = x[:, :4]
    assert onednn_rows.layer_normalization_grad(dy[:, :4].copy(), small.copy(), scale, mean, inv, 8) is None


def _softmax_truth(x):
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("shape", [(12, 128, 128), (520, 64), (40, onednn_rows.SOFTMAX_MAX_COLUMNS)])
def test_softmax_is_as_close_to_float64_as_numpys(shape):
    """Rounding x - max to float32 costs numpy's form about 20 ulp of the result on these rows;
    oneDNN's may add a few more, up to its width limit; wider rows are numpy's."""
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    got = onednn_rows.softmax(x)
    assert got is not None and got.dtype == np.float32 and got.shape == shape
    want = _softmax_truth(x)
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - want) / ulp) <= 40
    wider = rng.standard_normal((20, onednn_rows.SOFTMAX_MAX_COLUMNS + 1)).astype(np.float32)
    assert onednn_rows.softmax(wider) is None


def test_a_causal_mask_gives_zeros_and_a_masked_row_nans_as_numpy():
    x = np.random.default_rng(5).standard_normal((4, 64, 64)).astype(np.float32)
    x[:, np.triu_indices(64, 1)[0], np.triu_indices(64, 1)[1]] = -np.inf
    x[1, 5] = -np.inf
    got = onednn_rows.softmax(x)
    assert got is not None
    assert np.isnan(got[1, 5]).all()
    got[1, 5] = 0
    want = _softmax_truth(np.where(np.isinf(x).all(axis=-1, keepdims=True), 0, x))
    want[1, 5] = 0
    want[np.isinf(x)] = 0
    np.testing.assert_allclose(got, want, rtol=40 * 2**-23, atol=1e-12)
    assert (got[np.isinf(x)] == 0).all()


def test_a_wide_spread_nan_or_inf_is_numpys_softmax():
    """Beyond a spread of 80 oneDNN's exp flushes probabilities numpy gives as 1e-36 and less to 0
    (a log after it would give -inf): the kernel keeps numpy's values there."""
    x = np.zeros((4, 8192), np.float32)
    x[:, 0] = -85.0
    assert onednn_rows.softmax(x) is None
    y = reduction.softmax(x)
    assert y[0, 0] > 0 and np.isfinite(np.log(y)).all()
    for special in (np.nan, np.inf):
        z = np.zeros((4, 8192), np.float32)
        z[2, 7] = special
        assert onednn_rows.softmax(z) is None
        assert np.isnan(reduction.softmax(z)[2]).all()


def test_the_softmax_kernel_uses_it_only_along_a_c_ordered_last_axis(monkeypatch):
    x = np.random.default_rng(6).standard_normal((16, 64, 32)).astype(np.float32)
    calls = []
    real = onednn_rows.softmax
    monkeypatch.setattr(onednn_rows, "softmax", lambda z: calls.append(z.shape) or real(z))
    last = reduction.softmax(x, axis=-1)
    middle = reduction.softmax(x, axis=1)  # a moved axis is a strided view: numpy
    assert calls == [(16, 64, 32), (16, 32, 64)]
    np.testing.assert_allclose(last, _softmax_truth(x), rtol=40 * 2**-23, atol=1e-12)
    np.testing.assert_allclose(middle, np.moveaxis(_softmax_truth(np.moveaxis(x, 1, -1)), -1, 1), rtol=40 * 2**-23, atol=1e-12)
    assert reduction.log_softmax(x).dtype == np.float32  # LogSoftmax stays numpy's


def test_small_calls_run_on_the_callers_thread_and_the_pool_is_restored():
    threads = min(2, available_cores())
    with cpu_threads(threads):
        with blas.caller_thread_only():
            assert blas._omp_threads() == 1
        assert blas._omp_threads() == threads


def test_the_same_bits_from_several_threads_and_runs():
    rng = np.random.default_rng(7)
    x = rng.standard_normal(ROWS_OF_768).astype(np.float32)
    scale, bias = rng.standard_normal(768).astype(np.float32), rng.standard_normal(768).astype(np.float32)
    first = onednn_rows.layer_normalization(x, 2, scale, bias, 1e-5)
    first_softmax = onednn_rows.softmax(x)
    failures = []

    def worker():
        for _ in range(20):
            y = onednn_rows.layer_normalization(x, 2, scale, bias, 1e-5)
            s = onednn_rows.softmax(x)
            if not all(np.array_equal(a, b) for a, b in zip(y, first)) or not np.array_equal(s, first_softmax):
                failures.append(1)

    pool = [threading.Thread(target=worker) for _ in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not failures


def test_a_layer_norm_softmax_models_gradients_agree_with_numpys(monkeypatch):
    """A model of LayerNormalization then Softmax, its backward built by gradgen: the gradients
    through oneDNN's forward agree with those through numpy's (whose float64 gradients the
    LayerNormalization and Softmax gradient tests check against finite differences)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 512])
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    rng = np.random.default_rng(8)
    inits = [
        helper.make_tensor("scale", TensorProto.FLOAT, [512], rng.standard_normal(512).astype(np.float32)),
        helper.make_tensor("bias", TensorProto.FLOAT, [512], rng.standard_normal(512).astype(np.float32)),
        helper.make_tensor("w", TensorProto.FLOAT, [4, 16, 512], rng.standard_normal((4, 16, 512)).astype(np.float32)),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["n"], axis=-1),
        helper.make_node("Softmax", ["n"], ["p"], axis=-1),
        helper.make_node("Mul", ["p", "w"], ["pw"]),
        helper.make_node("ReduceSum", ["pw"], ["loss"], keepdims=0),
    ]
    model = helper.make_model(
        helper.make_graph(nodes, "ln_softmax", [x], [loss], inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    built = gradgen.build_backward(model, wrt=["scale", "bias"]).model
    feeds = {"x": rng.standard_normal((4, 16, 512)).astype(np.float32)}
    fast = Session(built).run(feeds)
    monkeypatch.setattr(onednn_rows, "MIN_ELEMENTS", 10**12)
    slow = Session(built).run(feeds)
    assert set(fast) == set(slow)
    for name in fast:
        np.testing.assert_allclose(fast[name], slow[name], rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(slow[name]).max())))
