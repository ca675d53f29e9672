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


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_softmax_cross_entropy_dtypes_and_log_prob(dtype):
    rng = np.random.default_rng(12)
    for shape in [(8, 10), (2, 3, 4, 5)]:
        x, labels = _loss_inputs(rng, shape, np.int64, -1, dtype)
        cpu, cuda = kernels("SoftmaxCrossEntropyLoss")
        want = cpu(x, labels, ignore_index=-1, reduction="mean", _num_outputs=2)
        got = cuda(dev(x), dev(labels), ignore_index=-1, reduction="mean", _num_outputs=2)
        t = 4e-3 if dtype == np.float16 else 1e-12
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
