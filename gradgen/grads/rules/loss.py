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

from gradgen.grads.table import grad_rule


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
    dinput, dweights = _loss_backward(g, g.x(0), g.x(0))
    return [dinput if g.needs(0) else None, None, dweights][: len(g.node.inputs)]


@grad_rule("SoftmaxCrossEntropyLoss", nondiff_inputs=(1,))
def softmax_cross_entropy_loss(g):
    scores = g.x(0)
    has_log_prob = len(g.node.outputs) > 1 and g.node.outputs[1].name != ""
    logp = g.y(1) if has_log_prob else g.op("LogSoftmax", scores, axis=1)
    dlogp, dweights = _loss_backward(g, logp, scores)
    parts = [d for d in (dlogp, g.dy(1) if has_log_prob else None) if d is not None]
    dscores = None
    if g.needs(0) and parts:
        total = g.sum(parts)
        # LogSoftmax over axis 1: dx = dlogp - softmax * sum_c dlogp
        dscores = g.op("Sub", total, g.op("Mul", g.op("Exp", logp), g.reduce_sum(total, [1], keepdims=1)))
    return [dscores, None, dweights][: len(g.node.inputs)]
