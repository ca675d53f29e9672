"""Lowering of SoftmaxCrossEntropyLossGrad (ONNX Runtime training's gradient of
SoftmaxCrossEntropyLoss, which gradgen emits) to standard ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import ModelError
from gradgen.passes.lowering.table import node_input, node_where, register_lowering


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


@register_lowering("SoftmaxCrossEntropyLossGrad")
def lower_softmax_cross_entropy_loss_grad(e: GraphBuilder, node: ir.Node):
    """d_logits = exp(log_prob) * s - onehot(label) * s along axis 1, s = w * c per label position:
    w the label's weight (1 without weights, 0 for ignore_index), c = dY (sum), dY / sum w (mean;
    dY where that sum is 0) or dY itself (none)."""
    dy, log_prob, label = (node_input(node, i) for i in range(3))
    if dy is None or log_prob is None or label is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, log_prob, label")
    if node_input(node, 4) is not None:
        raise ModelError(f"{node_where(node)}: an ignore_index input has no standard-op form here; give it as the attribute")
    weight = node_input(node, 3)
    reduction = _attr(node, "reduction", "mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    labels = e.to_int64(label)
    ignore = e.op("Equal", labels, e.const(np.array(int(_attr(node, "ignore_index", -100)), dtype=np.int64)))
    safe = e.op("Where", ignore, e.const(np.array(0, dtype=np.int64)), labels)
    zero = e.const_like(log_prob, 0.0)
    if weight is not None:
        w = e.op("Where", ignore, zero, e.op("Gather", weight, safe, axis=0))
    else:
        w = e.cast_like(e.op("Not", ignore), log_prob)
    if reduction == "mean":
        total = e.op("ReduceSum", w, keepdims=0)
        empty = e.op("Equal", total, zero)
        dy = e.op("Where", empty, dy, e.op("Div", dy, e.op("Where", empty, e.const_like(log_prob, 1.0), total)))
    scale = e.unsqueeze(e.op("Mul", w, dy), [1])
    picked = e.op(
        "ScatterElements", e.zeros_like(log_prob), e.unsqueeze(safe, [1]), e.expand_like(scale, e.unsqueeze(safe, [1])), axis=1
    )
    return [e.op("Sub", e.op("Mul", e.op("Exp", log_prob), scale), picked)]
