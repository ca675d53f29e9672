"""CPU kernels: classification losses (NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss).

Inputs are (N, C) or (N, C, d1, ..., dk) with labels (N) or (N, d1, ..., dk). A label equal to
``ignore_index`` contributes 0 and is left out of the "mean" denominator; any other label outside
[0, C) raises ``KernelError``. With weights, "mean" divides by the sum of the weights of the
labels used. If every label is ignored, "mean" gives NaN (0 / 0), as the reference does.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import onednn_eltwise
from gradgen.kernels.cpu.prepared import per_shape
from gradgen.kernels.numeric import accumulation_dtype, float_compute_dtype
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.schemas import FLOATS, INDICES, INT64, Attribute, Formal, Schema


def _nll(log_prob, target, weight, ignore_index, reduction, out_dtype):
    """The NLL of already log-softmaxed scores, in log_prob's (compute) precision."""
    if log_prob.ndim < 2:
        raise KernelError(f"input must have shape (N, C, ...), got {list(log_prob.shape)}")
    n, c = log_prob.shape[:2]
    if target.dtype.kind not in "iu":  # before the shape: class probabilities have the input's shape
        raise KernelError(
            f"target must hold integer class indices (int32 / int64), got {target.dtype} of shape "
            f"{list(target.shape)} (class probabilities are not part of the op's contract)"
        )
    if target.shape != (n,) + log_prob.shape[2:]:
        raise KernelError(
            f"target shape {list(target.shape)} does not match input shape {list(log_prob.shape)} "
            f"(expected {[n] + list(log_prob.shape[2:])})"
        )
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
    ct = float_compute_dtype(input.dtype)
    return _nll(input.astype(ct, copy=False), target, weight, ignore_index, reduction, input.dtype)


@cpu_kernel("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None, reduction="mean", _num_outputs=1):
    """Returns loss, and log_prob (log-softmax of scores over axis 1) when the node asks for it."""
    if scores.ndim < 2:
        raise KernelError(f"scores must have shape (N, C, ...), got {list(scores.shape)}")
    ct = float_compute_dtype(scores.dtype)
    s = scores.astype(ct, copy=False)
    shifted = s - s.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(onednn_eltwise.exp(shifted).sum(axis=1, keepdims=True))
    loss = _nll(log_prob, labels, weights, ignore_index, reduction, scores.dtype)
    if _num_outputs > 1:
        return loss, log_prob.astype(scores.dtype, copy=False)
    return loss


# ---------------------------------------------------------------------------------------------
# SoftmaxCrossEntropyLossGrad (com.microsoft, ONNX Runtime training)


SOFTMAX_CROSS_ENTROPY_LOSS_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc).
        "SoftmaxCrossEntropyLossGrad",
        inputs=(
            Formal("dY", FLOATS),
            Formal("log_prob", FLOATS),
            Formal("label", INDICES),
            Formal("weight", FLOATS, optional=True),
            Formal("ignore_index", INT64, optional=True),
        ),
        outputs=(Formal("d_logits", FLOATS),),
        attributes=(Attribute("reduction", "string", "mean"), Attribute("ignore_index", "int")),
        infer=lambda i, a: [(i[1].dtype, i[1].shape)],
    )
)


@cpu_kernel("SoftmaxCrossEntropyLossGrad", domain=MICROSOFT)
def softmax_cross_entropy_loss_grad(
    dY, log_prob, label, weight=None, ignore_index_input=None, *, ignore_index=-100, reduction="mean"
):
    """d_logits = (exp(log_prob) - onehot(label)) * w, with ORT's reductions.

    ``log_prob`` is (N, C, D1, ...) and ``label`` (N, D1, ...). ``dY`` is the loss gradient: a
    scalar for 'mean'/'sum', label-shaped for 'none'. Samples whose label is ``ignore_index`` (the
    optional 5th input overrides the attribute) get zero gradient; 'mean' divides by the number of
    the other samples, or by the sum of their weights, and by nothing when that is 0.
    """
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in ("mean", "sum", "none"):
        raise KernelError(f"unknown reduction {reduction!r} (mean, sum or none)")
    if ignore_index_input is not None:
        if np.asarray(ignore_index_input).ndim != 0:
            raise KernelError("ignore_index should be a scalar")
        ignore_index = int(ignore_index_input)
    if log_prob.ndim != label.ndim + 1 or log_prob.shape[0] != label.shape[0] or log_prob.shape[2:] != label.shape[1:]:
        raise KernelError(f"log_prob shape {list(log_prob.shape)} must be (N, C, D1, ...) for label shape {list(label.shape)}")
    if label.dtype.kind not in "iu":
        raise KernelError(f"label must be int32 or int64, got {label.dtype}")
    if weight is not None and weight.ndim != 1:
        raise KernelError(f"weight must be 1-D, got shape {list(weight.shape)}")
    classes = log_prob.shape[1]
    ct = accumulation_dtype(log_prob.dtype)
    labels = label.astype(np.int64)
    kept = labels != int(ignore_index)
    if ((labels[kept] < 0) | (labels[kept] >= classes)).any():
        bad = int(labels[kept][(labels[kept] < 0) | (labels[kept] >= classes)][0])
        raise KernelError(f"label {bad} is out of range for {classes} classes (valid range [0, {classes - 1}])")
    safe = np.where(kept, labels, 0)
    # (N, D..., C) layout, as ORT transposes to.
    prob = np.moveaxis(onednn_eltwise.exp(log_prob.astype(ct, copy=False)), 1, -1)  # a new array
    if prob.ndim == 2:
        # (N, C): 1 taken off at each row's label in place, the bits of prob - onehot (x - 0 is x)
        # without the (N, C) one-hot and its float copy (an LM head's 50,257 classes per token)
        grad = prob
        grad[np.arange(grad.shape[0]), safe] -= ct.type(1)
    else:
        onehot = np.arange(classes) == safe[..., None]
        grad = prob - onehot.astype(ct)
    if weight is not None:
        w = np.where(kept, weight.astype(ct, copy=False)[safe], ct.type(0))
    else:
        w = kept.astype(ct)
    dy = np.asarray(dY).astype(ct, copy=False)
    if reduction == "none":
        if dy.shape != label.shape:
            raise KernelError(f"dY has shape {list(dy.shape)}, but reduction 'none' needs the label shape {list(label.shape)}")
        scale = w * dy
    else:
        if dy.size != 1:
            raise KernelError(f"dY must be a scalar for reduction {reduction!r}, got shape {list(dy.shape)}")
        scale_value = dy.reshape(())
        if reduction == "mean":
            total = w.sum(dtype=ct)
            if total != 0:
                scale_value = scale_value / total
        scale = w * scale_value
    result = np.multiply(grad, scale[..., None], out=grad)  # grad is this call's own array
    return np.ascontiguousarray(np.moveaxis(result, -1, 1)).astype(log_prob.dtype, copy=False)


@cpu_prepare("SoftmaxCrossEntropyLoss")
def prepare_softmax_cross_entropy_loss(constants: tuple, attrs: dict):
    """The kernel's arithmetic, ufunc by ufunc, for (N, C) float32 / float64 scores without
    weights whose labels are in [0, C) or ignore_index (a masked language model's -100): the label
    checks are one or two reductions, the row numbers are kept per N and the temporaries are
    reused. Other calls (and labels out of range, for the kernel's error) run the kernel."""
    ignore_index, reduction, outputs = attrs.get("ignore_index"), attrs.get("reduction", "mean"), attrs.get("_num_outputs", 1)
    if reduction not in ("none", "sum", "mean"):
        return None
    rows = per_shape(np.arange)
    ignored_class = ignore_index is not None and int(ignore_index) >= 0  # a label in [0, C) may be ignored

    def run(scores, labels, weights=None):
        n, classes = scores.shape if scores.ndim == 2 else (0, 0)
        fast = (
            weights is None
            and classes > 0
            and scores.dtype.kind == "f"
            and scores.dtype.itemsize >= 4
            and labels.shape == (n,)
            and labels.dtype.kind in "iu"
        )
        if not fast:
            return softmax_cross_entropy_loss(scores, labels, weights, **attrs)
        in_range = int(labels.view(f"u{labels.dtype.itemsize}").max(initial=0)) < classes
        used = None  # every label counts
        if not in_range or (ignored_class and bool((labels == ignore_index).any())):
            used = None if ignore_index is None else labels != ignore_index
            if used is None or not _labels_in_range(labels, used, classes):
                return softmax_cross_entropy_loss(scores, labels, weights, **attrs)  # its error names the label
        shifted = np.subtract(scores, np.maximum.reduce(scores, axis=1, keepdims=True))
        total = np.add.reduce(onednn_eltwise.exp(shifted), axis=1, keepdims=True)
        log_prob = np.subtract(shifted, np.log(total, out=total), out=shifted)
        if used is None:
            loss = np.negative(log_prob[rows(n), labels])  # -picked * 1 for every used label
            count = scores.dtype.type(n)
        else:  # the kernel's -picked * w, w 0 at the ignored labels, and its sum of w
            weight = used.astype(scores.dtype)
            loss = np.multiply(np.negative(log_prob[rows(n), np.where(used, labels, 0)]), weight)
            count = weight.sum()
        if reduction == "none":
            result = loss
        elif reduction == "sum":
            result = np.asarray(loss.sum(), dtype=scores.dtype)
        else:
            with np.errstate(invalid="ignore", divide="ignore"):
                result = np.asarray(loss.sum() / count, dtype=scores.dtype)
        return (result, log_prob) if outputs > 1 else result

    return run


def _labels_in_range(labels: np.ndarray, used: np.ndarray, classes: int) -> bool:
    kept = labels[used]
    return not kept.size or (int(kept.min()) >= 0 and int(kept.max()) < classes)
