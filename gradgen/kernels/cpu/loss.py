"""CPU kernels: classification losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss).

Inputs are (N, C) or (N, C, d1, ..., dk) with labels (N) or (N, d1, ..., dk). A label equal to
``ignore_index`` contributes 0 and is left out of the "mean" denominator; any other label outside
[0, C) raises ``KernelError``. With weights, "mean" divides by the sum of the weights of the
labels used. If every label is ignored, "mean" gives NaN (0 / 0), as the reference does.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.registry import cpu_kernel


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    return dtype if dtype.kind == "f" and dtype.itemsize >= 4 else np.dtype(np.float32)


def _nll(log_prob, target, weight, ignore_index, reduction, out_dtype):
    """The NLL of already log-softmaxed scores, in log_prob's (compute) precision."""
    if log_prob.ndim < 2:
        raise KernelError(f"input must have shape (N, C, ...), got {list(log_prob.shape)}")
    n, c = log_prob.shape[:2]
    if target.shape != (n,) + log_prob.shape[2:]:
        raise KernelError(
            f"target shape {list(target.shape)} does not match input shape {list(log_prob.shape)} "
            f"(expected {[n] + list(log_prob.shape[2:])})"
        )
    if target.dtype.kind not in "iu":
        raise KernelError(f"target must be an integer tensor, got {target.dtype}")
    if reduction not in ("none", "sum", "mean"):
        raise KernelError(f"unknown reduction {reduction!r}; expected none, sum or mean")
    labels = target.astype(np.int64)
    used = np.ones(labels.shape, dtype=bool) if ignore_index is None else labels != int(ignore_index)
    bad = used & ((labels < 0) | (labels >= c))
    if bad.any():
        where = [int(i) for i in np.argwhere(bad)[0]]
        extra = f" and is not ignore_index ({int(ignore_index)})" if ignore_index is not None else ""
        raise KernelError(
            f"target value {int(labels[bad].flat[0])} at position {where} is out of range for the "
            f"class axis (axis 1) of size {c}; valid range is [0, {c - 1}]{extra}"
        )
    safe = np.where(used, labels, 0)
    picked = np.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    ct = log_prob.dtype
    if weight is not None:
        if weight.shape != (c,):
            raise KernelError(f"weight must have shape [{c}], got {list(weight.shape)}")
        w = np.where(used, weight.astype(ct)[safe], ct.type(0))
    else:
        w = used.astype(ct)
    loss = -picked * w
    if reduction == "none":
        return loss.astype(out_dtype, copy=False)
    if reduction == "sum":
        return np.asarray(loss.sum(), dtype=out_dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.asarray(loss.sum() / w.sum(), dtype=out_dtype)


@cpu_kernel("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(input, target, weight=None, *, ignore_index=None, reduction="mean"):
    ct = _compute_dtype(input.dtype)
    return _nll(input.astype(ct, copy=False), target, weight, ignore_index, reduction, input.dtype)


@cpu_kernel("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None, reduction="mean", _num_outputs=1):
    """Returns loss, and log_prob (log-softmax of scores over axis 1) when the node asks for it."""
    if scores.ndim < 2:
        raise KernelError(f"scores must have shape (N, C, ...), got {list(scores.shape)}")
    ct = _compute_dtype(scores.dtype)
    s = scores.astype(ct, copy=False)
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = _nll(log_prob, labels, weights, ignore_index, reduction, scores.dtype)
    if _num_outputs > 1:
        return loss, log_prob.astype(scores.dtype, copy=False)
    return loss
