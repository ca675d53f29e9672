"""CUDA launchers: classification losses (loss.cu).

Same semantics and messages as the CPU kernels (gradgen/kernels/cpu/loss.py): inputs (N, C) or
(N, C, d1, ..., dk), labels (N) or (N, d1, ..., dk); a label equal to ``ignore_index`` contributes
0 and is left out of the "mean" denominator; any other label outside [0, C) is found on the GPU (a
flag written by the kernel) and raised as ``KernelError``. Computed in float32 for float16 and bfloat16 input.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import FLOATS, contiguous, cpu_fallback, dtype_suffix, kernel_of, launch
from gradgen.kernels.table import MICROSOFT, cuda_kernel

_ARGS = np.dtype([("n", np.int64), ("c", np.int64), ("d", np.int64), ("ignore_index", np.int64), ("has_ignore", np.int64)])


def _check(x, target, weight, reduction, what: str):
    if len(x.shape) < 2:
        raise KernelError(f"{what} must have shape (N, C, ...), got {list(x.shape)}")
    n, c = (int(v) for v in x.shape[:2])
    expected = (n,) + tuple(int(v) for v in x.shape[2:])
    if tuple(int(v) for v in target.shape) != expected:
        raise KernelError(
            f"target shape {list(target.shape)} does not match input shape {list(x.shape)} (expected {list(expected)})"
        )
    if np.dtype(target.dtype).kind not in "iu":
        raise KernelError(f"target must be an integer tensor, got {target.dtype}")
    if reduction not in ("none", "sum", "mean"):
        raise KernelError(f"unknown reduction {reduction!r}; expected none, sum or mean")
    if weight is not None and tuple(weight.shape) != (c,):
        raise KernelError(f"weight must have shape [{c}], got {list(weight.shape)}")


def _loss(x, target, weight, ignore_index, reduction, log_input: bool):
    """The loss output (shape of target for "none", else a scalar) of dtype x.dtype."""
    from gradgen.cuda import runtime as rt

    x, target, weight = (None if t is None else contiguous(t) for t in (x, target, weight))
    s, ls = dtype_suffix(x.dtype), dtype_suffix(target.dtype)
    n, c = (int(v) for v in x.shape[:2])
    d = int(np.prod(x.shape[2:], dtype=np.int64))
    total = n * d
    ct = np.float64 if s == "f64" else np.float32
    out = rt.empty(tuple(target.shape) if reduction == "none" else (), x.dtype)
    lossbuf = rt.empty((max(total, 1),), ct)
    wbuf = rt.empty((max(total, 1),), ct)
    flag = rt.zeros((1,), np.int64)
    args = np.zeros((), _ARGS)
    args["n"], args["c"], args["d"] = n, c, d
    args["ignore_index"] = 0 if ignore_index is None else int(ignore_index)
    args["has_ignore"] = 0 if ignore_index is None else 1
    args = args[()]
    none_ptr = out if reduction == "none" else np.intp(0)
    weight_ptr = weight if weight is not None else np.intp(0)
    if total:
        if d == 1 and not log_input:
            threads = min(1024, max(32, 1 << (max(1, math.ceil(c / 8)) - 1).bit_length()))
            kernel_of("loss", f"sce_rows_{s}_{ls}")(
                none_ptr, lossbuf, wbuf, flag, x, target, weight_ptr, args, block=(threads, 1, 1), grid=(n, 1)
            )
        else:
            launch(
                kernel_of("loss", f"loss_cols_{s}_{ls}"),
                total,
                none_ptr,
                lossbuf,
                wbuf,
                flag,
                x,
                target,
                weight_ptr,
                args,
                np.int64(1 if log_input else 0),
            )

        rt.check_flag(flag, lambda value: _target_message(target, total - value, c, ignore_index))
    if reduction != "none":
        kernel_of("loss", f"loss_reduce_{s}")(
            out, lossbuf, wbuf, np.int64(total), np.int64(1 if reduction == "mean" else 0), block=(1024, 1, 1), grid=(1, 1)
        )
    return out


def _target_message(target, pos: int, c: int, ignore_index) -> str:
    """The forward losses' error for the first label out of range (flat position ``pos``)."""
    label, where = _bad_label(target, pos)
    extra = f" and is not ignore_index ({int(ignore_index)})" if ignore_index is not None else ""
    return (
        f"target value {label} at position {where} is out of range for the class axis "
        f"(axis 1) of size {c}; valid range is [0, {c - 1}]{extra}"
    )


def _supported(x, target, weight) -> bool:
    return (
        dtype_suffix(x.dtype) in FLOATS
        and dtype_suffix(target.dtype) in ("i32", "i64")
        and (weight is None or weight.dtype == x.dtype)
    )


@cuda_kernel("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss(input, target, weight=None, *, ignore_index=None, reduction="mean"):
    _check(input, target, weight, reduction, "input")
    if not _supported(input, target, weight) or (input.size == 0 and target.size):
        return cpu_fallback("NegativeLogLikelihoodLoss", input, target, weight, ignore_index=ignore_index, reduction=reduction)
    return _loss(input, target, weight, ignore_index, reduction, log_input=True)


@cuda_kernel("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None, reduction="mean", _num_outputs=1):
    """Returns loss, and log_prob (log-softmax of scores over axis 1) when the node asks for it."""
    _check(scores, labels, weights, reduction, "scores")
    if not _supported(scores, labels, weights) or (scores.size == 0 and labels.size):
        return cpu_fallback(
            "SoftmaxCrossEntropyLoss",
            scores,
            labels,
            weights,
            ignore_index=ignore_index,
            reduction=reduction,
            _num_outputs=_num_outputs,
        )
    if _num_outputs > 1:  # the loss picks from log_prob (as the CPU kernel does): one pass over the scores fewer
        from gradgen.kernels.cuda.reduction import softmax_3d

        n, c = (int(v) for v in scores.shape[:2])
        d = int(np.prod(scores.shape[2:], dtype=np.int64))
        log_prob = softmax_3d(scores, n, c, d, log=True)
        return _loss(log_prob, labels, weights, ignore_index, reduction, log_input=True), log_prob
    return _loss(scores, labels, weights, ignore_index, reduction, log_input=False)


def sce_loss_with_stats(scores, labels, weights=None, *, ignore_index=None, reduction="mean"):
    """(loss, stats): SoftmaxCrossEntropyLoss of 2-D float ``scores`` with, instead of the (N, C)
    log-probabilities, their row statistics (N, 2) (max, log of the sum of exp), from which
    ``sce_grad`` makes them again, bit for bit: the executor's fused form of the loss and its
    gradient (gradgen/executor/fused_loss.py), one write and one read of an (N, C) tensor fewer."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.reduction import _next_pow2

    _check(scores, labels, weights, reduction, "scores")
    if len(scores.shape) != 2 or int(scores.shape[1]) <= 2 or not _supported(scores, labels, weights):
        # no statistics form: the loss and its log-probabilities, which ``sce_grad`` tells apart by shape
        return softmax_cross_entropy_loss(scores, labels, weights, ignore_index=ignore_index, reduction=reduction, _num_outputs=2)
    scores, labels, weights = (None if t is None else contiguous(t) for t in (scores, labels, weights))
    s, ls = dtype_suffix(scores.dtype), dtype_suffix(labels.dtype)
    n, c = (int(v) for v in scores.shape)
    ct = np.float64 if s == "f64" else np.float32
    stats = rt.empty((n, 2), ct)
    out = rt.empty(tuple(labels.shape) if reduction == "none" else (), scores.dtype)
    if n == 0 or c == 0:
        return cpu_fallback(
            "SoftmaxCrossEntropyLoss", scores, labels, weights, ignore_index=ignore_index, reduction=reduction
        ), stats
    threads = min(1024, max(32, _next_pow2(math.ceil(c / 8))))  # as softmax_3d runs its rows kernel
    kernel_of("reduction", f"softmax_stats_rows_{s}")(stats, scores, np.int64(c), block=(threads, 1, 1), grid=(n, 1))
    lossbuf, wbuf = rt.empty((n,), ct), rt.empty((n,), ct)
    flag = rt.zeros((1,), np.int64)
    args = np.zeros((), _ARGS)
    args["n"], args["c"], args["d"] = n, c, 1
    args["ignore_index"] = 0 if ignore_index is None else int(ignore_index)
    args["has_ignore"] = 0 if ignore_index is None else 1
    launch(
        kernel_of("loss", f"loss_stats_{s}_{ls}"),
        n,
        out if reduction == "none" else np.intp(0),
        lossbuf,
        wbuf,
        flag,
        scores,
        stats,
        labels,
        weights if weights is not None else np.intp(0),
        args[()],
    )
    rt.check_flag(flag, lambda value: _target_message(labels, n - value, c, ignore_index))
    if reduction != "none":
        kernel_of("loss", f"loss_reduce_{s}")(
            out, lossbuf, wbuf, np.int64(n), np.int64(1 if reduction == "mean" else 0), block=(1024, 1, 1), grid=(1, 1)
        )
    return out, stats


@cuda_kernel("SoftmaxCrossEntropyLossGrad", domain=MICROSOFT)
def softmax_cross_entropy_loss_grad(
    dY, log_prob, label, weight=None, ignore_index_input=None, *, ignore_index=-100, reduction="mean"
):
    """d_logits = (exp(log_prob) - onehot(label)) * w * (dY, dY / sum w, or dY per position), as the
    CPU kernel (ONNX Runtime training's contract)."""
    return sce_grad(dY, log_prob, label, weight, ignore_index_input, ignore_index=ignore_index, reduction=reduction)


def sce_grad(dY, log_prob, label, weight=None, ignore_index_input=None, *, ignore_index=-100, reduction="mean", stats=None):
    """SoftmaxCrossEntropyLossGrad; with ``stats`` (N, 2) from ``sce_loss_with_stats``, ``log_prob``
    holds the (N, C) scores and the log-probabilities are made from them as they are read."""
    from gradgen.cuda import runtime as rt

    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    _check(log_prob, label, weight, reduction, "log_prob")
    if stats is not None and len(stats.shape) == 2 and int(stats.shape[1]) != 2:  # the forward gave log-probabilities
        log_prob, stats = stats, None
    args = (dY, log_prob, label, weight, ignore_index_input)
    if not _supported(log_prob, label, weight) or dY.dtype != log_prob.dtype or ignore_index_input is not None:
        if stats is not None:  # log_prob holds the scores: make the log-probabilities for the fallback
            from gradgen.kernels.cuda.reduction import softmax_3d

            n, c = (int(v) for v in log_prob.shape)
            return sce_grad(
                dY,
                softmax_3d(log_prob, n, c, 1, log=True),
                label,
                weight,
                ignore_index_input,
                ignore_index=ignore_index,
                reduction=reduction,
            )
        return cpu_fallback(
            "SoftmaxCrossEntropyLossGrad", *args, domain=MICROSOFT, ignore_index=ignore_index, reduction=reduction
        )
    expected_dy = tuple(int(v) for v in label.shape) if reduction == "none" else None
    if (expected_dy is not None and tuple(int(v) for v in dY.shape) != expected_dy) or (expected_dy is None and dY.size != 1):
        want = f"the label shape {list(label.shape)}" if expected_dy is not None else "a scalar"
        raise KernelError(f"dY has shape {list(dY.shape)}, but reduction {reduction!r} needs {want}")
    dY, log_prob, label, weight = (None if t is None else contiguous(t) for t in (dY, log_prob, label, weight))
    if stats is not None and (len(log_prob.shape) != 2 or tuple(stats.shape) != (int(log_prob.shape[0]), 2)):
        raise KernelError(f"row statistics of shape {list(stats.shape)} do not fit scores of shape {list(log_prob.shape)}")
    s, ls = dtype_suffix(log_prob.dtype), dtype_suffix(label.dtype)
    n, c = (int(v) for v in log_prob.shape[:2])
    d = int(np.prod(log_prob.shape[2:], dtype=np.int64))
    total = n * d
    out = rt.empty(tuple(log_prob.shape), log_prob.dtype)
    if out.size == 0:
        return out
    ct = np.float64 if s == "f64" else np.float32
    wbuf = rt.empty((total,), ct)
    factor = rt.empty((1,), ct)
    flag = rt.zeros((1,), np.int64)
    packed = np.zeros((), _ARGS)
    packed["n"], packed["c"], packed["d"] = n, c, d
    packed["ignore_index"], packed["has_ignore"] = int(ignore_index), 1
    packed = packed[()]
    launch(
        kernel_of("loss", f"sce_grad_weights_{s}_{ls}"),
        total,
        wbuf,
        flag,
        label,
        weight if weight is not None else np.intp(0),
        packed,
    )
    rt.check_flag(flag, lambda value: _label_message(label, total - value, c, ignore_index))
    if reduction != "none":
        kernel_of("loss", f"sce_grad_factor_{s}")(
            factor, wbuf, dY, np.int64(total), np.int64(reduction == "mean"), block=(1024, 1, 1), grid=(1, 1)
        )
    blocks_x = min(-(-c // (256 * 4)), 64)  # about four classes per thread (the kernel's loads in flight)
    kernel_of("loss", f"sce_grad_{s}_{ls}")(
        out,
        log_prob,
        label,
        wbuf,
        factor,
        dY if reduction == "none" else np.intp(0),
        packed,
        np.intp(0) if stats is None else stats,
        block=(256, 1, 1),
        grid=(blocks_x, min(total, 65535)),
    )
    return out


def _bad_label(labels, pos: int) -> tuple[int, list[int]]:
    """The label at flat position ``pos`` (a kernel's error flag names it) and its coordinates."""
    from gradgen.cuda import runtime as rt

    value = int(rt.to_host(labels).reshape(-1)[pos])
    return value, [int(i) for i in np.unravel_index(pos, tuple(labels.shape))]


def _label_message(label, pos: int, c: int, ignore_index) -> str:
    value, where = _bad_label(label, pos)
    return (
        f"label {value} at position {where} is out of range for {c} classes (valid range [0, {c - 1}]) "
        f"and is not ignore_index ({int(ignore_index)})"
    )
