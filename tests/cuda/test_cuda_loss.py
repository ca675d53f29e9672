"""CUDA loss launchers against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from tests.cuda.test_cuda_elementwise import check, dev, host, kernels, poison

pytestmark = pytest.mark.cuda


# -- losses ---------------------------------------------------------------------------------------


def _loss_inputs(rng, shape, label_dtype, ignore_index=None, dtype=np.float32):
    n, c = shape[:2]
    x = rng.standard_normal(shape).astype(dtype)
    labels = rng.integers(0, c, size=(n,) + tuple(shape[2:])).astype(label_dtype)
    if ignore_index is not None and labels.size > 2:
        labels.reshape(-1)[1] = ignore_index
    return x, labels


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("shape", [(12, 5), (16, 64), (3, 50257), (2, 3, 4, 5), (4, 7, 9), (1, 1), (0, 4)], ids=str)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [None, -100, 2])
def test_losses(op, shape, reduction, label_dtype, weighted, ignore_index):
    rng = np.random.default_rng(11)
    x, labels = _loss_inputs(rng, shape, label_dtype, ignore_index)
    weight = rng.uniform(0.5, 2, shape[1]).astype(np.float32) if weighted else None
    cpu, cuda = kernels(op)
    attrs = {"reduction": reduction, "ignore_index": ignore_index}
    with np.errstate(all="ignore"):
        want = cpu(x, labels, weight, **attrs)
    poison(np.asarray(want).nbytes)
    got = host(cuda(dev(x), dev(labels), None if weight is None else dev(weight), **attrs))
    check(got, np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_softmax_cross_entropy_dtypes_and_log_prob(dtype):
    rng = np.random.default_rng(12)
    for shape in [(8, 10), (2, 3, 4, 5)]:
        x, labels = _loss_inputs(rng, shape, np.int64, -1, dtype)
        cpu, cuda = kernels("SoftmaxCrossEntropyLoss")
        want = cpu(x, labels, ignore_index=-1, reduction="mean", _num_outputs=2)
        got = cuda(dev(x), dev(labels), ignore_index=-1, reduction="mean", _num_outputs=2)
        t = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 1e-12}[dtype]
        for g, w in zip(got, want):
            check(host(g), np.asarray(w), rtol=t, atol=t)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_label_out_of_range_matches_cpu_message(op, ignore_index):
    x = np.zeros((3, 4, 5), np.float32)
    labels = np.zeros((3, 5), np.int64)
    labels[1, 2] = 4
    labels[2, 0] = -1  # a later bad label: the first one is reported
    cpu, cuda = kernels(op)
    with pytest.raises(KernelError) as want:
        cpu(x, labels, ignore_index=ignore_index)
    with pytest.raises(KernelError) as got:
        cuda(dev(x), dev(labels), ignore_index=ignore_index)
    assert str(got.value) == str(want.value)
    assert "out of range" in str(got.value)


def test_all_labels_ignored_gives_nan_mean():
    x = np.zeros((3, 4), np.float32)
    labels = np.full((3,), -100, np.int64)
    _, cuda = kernels("SoftmaxCrossEntropyLoss")
    assert np.isnan(host(cuda(dev(x), dev(labels), ignore_index=-100, reduction="mean")))


def test_loss_shape_errors():
    _, cuda = kernels("SoftmaxCrossEntropyLoss")
    with pytest.raises(KernelError, match="does not match input shape"):
        cuda(dev(np.zeros((3, 4), np.float32)), dev(np.zeros((2,), np.int64)))
    with pytest.raises(KernelError, match="weight must have shape"):
        cuda(dev(np.zeros((3, 4), np.float32)), dev(np.zeros((3,), np.int64)), dev(np.ones(3, np.float32)))


def test_loss_is_deterministic():
    rng = np.random.default_rng(13)
    x, labels = _loss_inputs(rng, (4096, 100), np.int64)
    _, cuda = kernels("SoftmaxCrossEntropyLoss")
    xd, ld = dev(x), dev(labels)
    assert host(cuda(xd, ld)).tobytes() == host(cuda(xd, ld)).tobytes()


# -- SoftmaxCrossEntropyLossGrad (com.microsoft, the gradient gradgen emits) ------------------------


def _ms_kernels(op):
    from gradgen.kernels import registry

    registry.load_cuda_kernels()
    entry = registry.lookup("com.microsoft", op)
    assert entry is not None and entry.cuda is not None, f"no CUDA launcher for {op}"
    return entry.cpu, entry.cuda


@pytest.mark.parametrize("shape", [(12, 5), (3, 50257), (2, 3, 4, 5), (1, 1)], ids=str)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("label_dtype", [np.int64, np.int32])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_cross_entropy_loss_grad(shape, reduction, label_dtype, weighted, dtype):
    rng = np.random.default_rng(13)
    x, labels = _loss_inputs(rng, shape, label_dtype, -100, dtype)
    log_prob = x - np.log(np.exp(x - x.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True)) - x.max(axis=1, keepdims=True)
    weight = rng.uniform(0.5, 2, shape[1]).astype(dtype) if weighted else None
    dy = rng.uniform(0.5, 2, labels.shape if reduction == "none" else ()).astype(dtype)
    cpu, cuda = _ms_kernels("SoftmaxCrossEntropyLossGrad")
    attrs = {"reduction": reduction, "ignore_index": -100}
    want = cpu(dy, log_prob, labels, weight, **attrs)
    poison(np.asarray(want).nbytes)
    got = host(cuda(dev(dy), dev(log_prob), dev(labels), None if weight is None else dev(weight), **attrs))
    t = 2e-6 if dtype == np.float32 else 1e-12
    check(got, np.asarray(want), rtol=t, atol=t * max(1.0, float(np.abs(want).max())))


def test_softmax_cross_entropy_loss_grad_all_ignored_and_bad_label():
    cpu, cuda = _ms_kernels("SoftmaxCrossEntropyLossGrad")
    log_prob = np.log(np.full((3, 4), 0.25, np.float32))
    labels = np.full((3,), -100, np.int64)
    dy = np.array(1.0, np.float32)
    got = host(cuda(dev(dy), dev(log_prob), dev(labels)))
    check(got, np.asarray(cpu(dy, log_prob, labels)))
    assert not got.any()  # every label ignored: a zero gradient, not NaN
    labels[1] = 4
    with pytest.raises(KernelError, match="out of range"):
        cuda(dev(dy), dev(log_prob), dev(labels))


@pytest.mark.parametrize("op", ["GeluGrad", "FastGeluGrad"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_grads(op, dtype):
    rng = np.random.default_rng(14)
    dy, x = (rng.uniform(-5, 5, (64, 3072)).astype(dtype) for _ in range(2))
    cpu, cuda = _ms_kernels(op)
    want = cpu(dy, x)
    got = host(cuda(dev(dy), dev(x)))
    t = 2e-6 if dtype == np.float32 else 1e-13
    check(got, np.asarray(want), rtol=t, atol=t * float(np.abs(want).max()))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(4, 64, 56, 56), (3, 5), (7,), ()], ids=str)
def test_relu_grad(dtype, shape):
    """ReluGrad(dY, X): dY where X > 0, exactly (zeros, signed zeros and NaN in X give 0; NaN in dY
    passes where X > 0), as the CPU kernel."""
    rng = np.random.default_rng(15)
    dy = rng.standard_normal(shape).astype(dtype)
    x = rng.standard_normal(shape).astype(dtype)
    if x.size >= 4:
        flat_x, flat_dy = x.reshape(-1), dy.reshape(-1)
        flat_x[:4] = [0.0, -0.0, np.nan, 1.0]
        flat_dy[3] = np.nan
    cpu, cuda = _ms_kernels("ReluGrad")
    want = np.asarray(cpu(dy, x))
    got = host(cuda(dev(dy), dev(x)))
    check(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    with pytest.raises(KernelError, match="one shape"):
        cuda(dev(np.ones((2, 3), dtype)), dev(np.ones((3, 2), dtype)))


# -- the executor's row-statistics cross-entropy (gradgen/executor/fused_loss.py) ---------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("classes", [1100, 50257, 7])
def test_row_statistics_loss_and_gradient_give_the_log_probability_bits(dtype, reduction, weighted, classes):
    """sce_loss_with_stats + sce_grad(stats=...) against the loss with its log-probabilities and the
    gradient from them: the same bits above 1,024 classes (the same row kernel), close below."""
    from gradgen.kernels.cuda.loss import sce_grad, sce_loss_with_stats

    rng = np.random.default_rng(21)
    x, labels = _loss_inputs(rng, (24, classes), np.int64, ignore_index=5, dtype=dtype)
    weights = rng.uniform(0.5, 1.5, classes).astype(dtype) if weighted else None
    dy = (rng.standard_normal(24) if reduction == "none" else np.array(0.7)).astype(dtype)
    _, forward = kernels("SoftmaxCrossEntropyLoss")
    want_loss, log_prob = forward(
        dev(x), dev(labels), None if weights is None else dev(weights), ignore_index=5, reduction=reduction, _num_outputs=2
    )
    want_grad = sce_grad(
        dev(dy), log_prob, dev(labels), None if weights is None else dev(weights), ignore_index=5, reduction=reduction
    )
    got_loss, stats = sce_loss_with_stats(
        dev(x), dev(labels), None if weights is None else dev(weights), ignore_index=5, reduction=reduction
    )
    got_grad = sce_grad(
        dev(dy), dev(x), dev(labels), None if weights is None else dev(weights), ignore_index=5, reduction=reduction, stats=stats
    )
    if classes > 1024:
        np.testing.assert_array_equal(host(got_loss), host(want_loss))
        np.testing.assert_array_equal(host(got_grad), host(want_grad))
    else:  # the warp kernel's log-softmax sums in another order; the statistics form falls back below 3 classes
        t = 2e-3 if dtype == np.float16 else 1e-5
        check(host(got_loss), host(want_loss), rtol=t, atol=t)
        check(host(got_grad), host(want_grad), rtol=t, atol=t)


def test_row_statistics_loss_reports_a_bad_label_as_the_forward_does():
    from gradgen.kernels.cuda.loss import sce_loss_with_stats

    x = np.zeros((4, 1100), np.float32)
    labels = np.array([0, 1100, 2, 3], np.int64)
    with pytest.raises(KernelError, match=r"target value 1100 at position \[1\] is out of range"):
        sce_loss_with_stats(dev(x), dev(labels))


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none", "weights": True, "ignore_index": 3}, {"reduction": "sum"}], ids=str)
def test_fused_cross_entropy_on_and_off_gives_the_same_bits(kwargs, monkeypatch):
    """A wide-vocabulary head's backward graph with the executor's fusions off and on (eager,
    recorded, replayed): the fused plan has no log-probabilities and gives the unfused bits."""
    from gradgen.executor import Session
    from gradgen.executor.fused_loss import FORWARD, GRADIENT
    from tests.cross_entropy_models import cross_entropy_head
    from tests.cuda.test_cuda_fusion import assert_same_bits, runs_off_and_on

    model, feeds = cross_entropy_head(**kwargs)
    (off, off_ops), (on, on_ops) = runs_off_and_on(model, feeds, monkeypatch)
    assert FORWARD not in off_ops and FORWARD in on_ops and GRADIENT in on_ops
    assert_same_bits(on, off)
    with Session(model, device="cpu") as sess:
        want = sess.run(feeds)
    for name in want:
        np.testing.assert_allclose(on[name], want[name], rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want[name]).max())))
