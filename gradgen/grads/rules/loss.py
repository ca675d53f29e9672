"""Gradient rules: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Both pick, per sample i = (n, d1, ..., dk), the log-probability of its label l_i; with
w_i = weights[l_i] (1 without weights) and 0 for a label equal to ignore_index:

    loss_i = -w_i * logp[n, l_i, d...]    reduction none: loss_i; sum: sum_i; mean: sum_i / sum_i w_i

so the gradient reaching logp is -c_i * w_i at the label's class, 0 elsewhere, with c_i = dY_i
(none), dY (sum) or dY / sum_i w_i (mean); it is scattered along axis 1 with ScatterElements.
SoftmaxCrossEntropyLoss adds the gradient of its optional log_prob output and goes through
LogSoftmax over axis 1. The class weights get a gradient too (they are an ordinary float input):
for class c, the sum over samples labelled c of -c_i * logp[i, c], with, under "mean", the
loss value subtracted (the denominator depends on the weights). Labels never get a gradient.

"mean" over a zero denominator (every label ignored, or zero total weight) gives a NaN loss, as
the spec does, and zero gradients, as PyTorch and ONNX Runtime training do.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError
from gradgen.grads.rules.conv import node_where
from gradgen.grads.table import grad_rule

_LABEL_TYPES = (ir.DataType.INT32, ir.DataType.INT64)


def _check_labels(g, labels: ir.Value) -> None:
    """ModelError unless the labels are int32 / int64 class indices (the ops' schemas): PyTorch's
    dynamo exporter writes cross_entropy with probability targets as this op with float labels,
    which is not valid ONNX; said here, at build time, rather than when the model first runs."""
    if labels.dtype is not None and labels.dtype not in _LABEL_TYPES:
        raise ModelError(
            f"{node_where(g)}: the labels ({labels.name!r}) are {labels.dtype.name}, but this op takes int32 or int64 "
            "class indices (probability targets are not valid ONNX here; export the loss with class-index targets, "
            "or write it as -sum(target * LogSoftmax(scores)))"
        )


def _loss_backward(g, logp: ir.Value, like: ir.Value):
    """(gradient reaching logp or None, gradient of the weights or None) of the NLL part."""
    labels, weights, dy = g.x(1), g.x(2), g.dy(0)
    if dy is None:
        return None, None
    reduction = g.attr("reduction", "mean")
    ignore_index = g.attr("ignore_index")
    zero = g.const_like(like, 0.0)
    if ignore_index is not None:
        ignore = g.op("Equal", labels, g.const(np.array(ignore_index, dtype=_int_dtype(labels))))
        safe = g.op("Where", ignore, g.const(np.array(0, dtype=_int_dtype(labels))), labels)
    else:
        ignore, safe = None, labels
    if weights is not None:
        w = g.op("Gather", weights, safe, axis=0)
        if ignore is not None:
            w = g.op("Where", ignore, zero, w)
    elif ignore is not None:
        w = g.cast_like(g.op("Not", ignore), like)
    else:
        w = None  # every w_i is 1
    loss = g.y(0) if reduction == "mean" and weights is not None and g.needs(2) else None
    if reduction == "mean":
        denom = g.op("ReduceSum", w, keepdims=0) if w is not None else g.cast_like(g.op("Size", labels), like)
        # No sample counts (every label ignored, zero total weight, an empty batch): the loss is
        # 0 / 0 = NaN, as the spec, ONNX Runtime and PyTorch compute it, but no gradient is NaN:
        # every one is 0, as in PyTorch and ONNX Runtime training (docs/RELIABILITY.md).
        empty = g.op("Equal", denom, zero)
        c = g.op("Where", empty, zero, g.op("Div", dy, g.op("Where", empty, g.const_like(like, 1.0), denom)))
        if loss is not None:
            loss = g.op("Where", empty, zero, loss)
    else:
        c = dy  # a scalar (sum) or per sample (none)
    index = g.unsqueeze(safe, [1])
    dlogp = None
    if g.needs(0):
        coef = g.op("Neg", c if w is None else g.op("Mul", c, w))
        if w is None and reduction != "none":
            coef = g.expand_like(coef, labels)
        dlogp = g.op("ScatterElements", g.zeros_like(g.x(0)), index, g.unsqueeze(coef, [1]), axis=1)
    dweights = None
    if weights is not None and g.needs(2):
        picked = g.squeeze(g.op("GatherElements", logp, index, axis=1), [1])
        per_sample = g.op("Neg", picked)  # loss_i / w_i
        if reduction == "mean":
            per_sample = g.op("Sub", per_sample, loss)
        contrib = g.op("Mul", per_sample, c)
        if ignore is not None:
            contrib = g.op("Where", ignore, zero, contrib)
        dweights = _scatter_add_1d(g, weights, safe, contrib)
    return dlogp, dweights


def _scatter_add_1d(g, data: ir.Value, indices: ir.Value, updates: ir.Value) -> ir.Value:
    """Zeros like the 1-D ``data`` with ``updates`` added at ``indices`` (any shape, repeated ok)."""
    if g.opset >= 16:
        flat = g.ints([-1])
        return g.op(
            "ScatterElements", g.zeros_like(data), g.reshape(indices, flat), g.reshape(updates, flat), axis=0, reduction="add"
        )
    out = g.op("GatherGrad", g.shape_of(data), indices, updates, domain="com.microsoft", axis=0)
    return g.set_type_like(out, data)


def _int_dtype(v: ir.Value):
    return np.int32 if v.dtype == ir.DataType.INT32 else np.int64


@grad_rule("NegativeLogLikelihoodLoss", nondiff_inputs=(1,))
def negative_log_likelihood_loss(g):
    _check_labels(g, g.x(1))
    dinput, dweights = _loss_backward(g, g.x(0), g.x(0))
    return [dinput if g.needs(0) else None, None, dweights][: len(g.node.inputs)]


@grad_rule("SoftmaxCrossEntropyLoss", nondiff_inputs=(1,), output_inputs={1: (0,)})  # log_prob reads the scores only
def softmax_cross_entropy_loss(g):
    _check_labels(g, g.x(1))
    scores = g.x(0)
    has_log_prob = len(g.node.outputs) > 1 and g.node.outputs[1].name != ""
    if _fused_grad_fits(g, has_log_prob):
        return [_fused_grad(g), None, None][: len(g.node.inputs)]
    logp = g.y(1) if has_log_prob else g.op("LogSoftmax", scores, axis=1)
    dlogp, dweights = _loss_backward(g, logp, scores)
    parts = [d for d in (dlogp, g.dy(1) if has_log_prob else None) if d is not None]
    dscores = None
    if g.needs(0) and parts:
        total = g.sum(parts)
        # LogSoftmax over axis 1: dx = dlogp - softmax * sum_c dlogp
        dscores = g.op("Sub", total, g.op("Mul", g.op("Exp", logp), g.reduce_sum(total, [1], keepdims=1)))
    return [dscores, None, dweights][: len(g.node.inputs)]


_FUSED_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE)


def _fused_grad_fits(g, has_log_prob: bool) -> bool:
    """Whether the scores' gradient is one SoftmaxCrossEntropyLossGrad node (ONNX Runtime training's
    op; --portable lowers it): nothing flows into log_prob, the class weights want no gradient."""
    weights = g.x(2)
    return (
        g.needs(0)
        and g.dy(0) is not None
        and not (has_log_prob and g.dy(1) is not None)
        and (weights is None or not g.needs(2))
        and g.x(0).dtype in _FUSED_TYPES
    )


def _fused_grad(g) -> ir.Value:
    """d scores = (exp(log_prob) - onehot(label)) * w * c in one node, reading the forward node's
    log_prob output (added when the node lacks it)."""
    node, scores = g.node, g.x(0)
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    log_prob = node.outputs[1]
    if not log_prob.name:
        g.rename(log_prob, f"{node.name or g.y(0).name}_log_prob")
    if log_prob.type is None:
        log_prob.type, log_prob.shape = scores.type, scores.shape
    ignore_index = g.attr("ignore_index")
    inputs = [g.dy(0), log_prob, g.x(1)] + ([g.x(2)] if g.x(2) is not None else [])
    dscores = g.op(
        "SoftmaxCrossEntropyLossGrad",
        *inputs,
        domain="com.microsoft",
        reduction=g.attr("reduction", "mean"),
        ignore_index=-100 if ignore_index is None else int(ignore_index),  # a negative label is refused anyway
    )
    return g.set_type_like(dscores, scores)


@grad_rule("SoftmaxCrossEntropyLossGrad", domain="com.microsoft", nondiff_inputs=(2, 4), unsupported_inputs=(3,))
def softmax_cross_entropy_loss_grad(g):
    """SoftmaxCrossEntropyLossGrad differentiated again. Its output is O = (E - onehot) * s with
    E = exp(log_prob) and s = w * c per label position (c = dY, dY / sum w, or dY there); with P
    the incoming gradient: d log_prob = P E s, d dY = sum over classes of P (E - onehot) * w, summed
    over every position for "sum" and divided by sum w (where not 0) for "mean"."""
    dy, log_prob, labels, weights, p = g.x(0), g.x(1), g.x(2), g.x(3), g.dy()
    reduction = g.attr("reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    ignore_index = g.attr("ignore_index", -100)
    labels64 = g.to_int64(labels)
    ignore = g.op("Equal", labels64, g.const(np.array(int(ignore_index), dtype=np.int64)))
    safe = g.op("Where", ignore, g.const(np.array(0, dtype=np.int64)), labels64)
    zero = g.const_like(log_prob, 0.0)
    w = (
        g.op("Where", ignore, zero, g.op("Gather", weights, safe, axis=0))
        if weights is not None
        else g.cast_like(g.op("Not", ignore), log_prob)
    )
    total = g.op("ReduceSum", w, keepdims=0) if reduction == "mean" else None
    empty = g.op("Equal", total, zero) if total is not None else None
    grads: list = [None] * len(g.node.inputs)
    e = g.op("Exp", log_prob)
    if g.needs(1):
        c = dy
        if total is not None:
            c = g.op("Where", empty, dy, g.op("Div", dy, g.op("Where", empty, g.const_like(log_prob, 1.0), total)))
        grads[1] = g.op("Mul", g.op("Mul", p, e), g.unsqueeze(g.op("Mul", w, c), [1]))
    if g.needs(0):
        index = g.unsqueeze(safe, [1])
        # sum over classes of P (E - onehot) = sum_c P E - P[label]
        per_position = g.op(
            "Sub", g.reduce_sum(g.op("Mul", p, e), [1], keepdims=0), g.squeeze(g.op("GatherElements", p, index, axis=1), [1])
        )
        d_dy = g.op("Mul", per_position, w)
        if reduction != "none":
            d_dy = g.reshape_like(g.op("ReduceSum", d_dy, keepdims=0), dy)
        if total is not None:
            d_dy = g.op("Where", empty, d_dy, g.op("Div", d_dy, g.op("Where", empty, g.const_like(log_prob, 1.0), total)))
        grads[0] = d_dy
    return grads
