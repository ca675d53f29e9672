"""Lowering of SoftmaxGrad_13 and LogSoftmaxGrad_13 (the reduction family: ONNX Runtime training's
gradients of Softmax and LogSoftmax from opset 13, which gradgen runs) to standard ONNX ops."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import ModelError
from gradgen.passes.lowering.table import node_input, node_where, register_lowering


def _inputs(node: ir.Node) -> tuple[ir.Value, ir.Value, int]:
    dy, y = node_input(node, 0), node_input(node, 1)
    if dy is None or y is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, Y")
    axis = node.attributes.get("axis")
    return dy, y, -1 if axis is None else int(axis.value)


@register_lowering("SoftmaxGrad_13")
def lower_softmax_grad_13(e: GraphBuilder, node: ir.Node):
    """dX = Y * (dY - sum(dY * Y, axis))."""
    dy, y, axis = _inputs(node)
    return [e.op("Mul", y, e.op("Sub", dy, e.reduce_sum(e.op("Mul", dy, y), [axis], keepdims=1)))]


@register_lowering("LogSoftmaxGrad_13")
def lower_log_softmax_grad_13(e: GraphBuilder, node: ir.Node):
    """dX = dY - exp(Y) * sum(dY, axis)."""
    dy, y, axis = _inputs(node)
    return [e.op("Sub", dy, e.op("Mul", e.op("Exp", y), e.reduce_sum(dy, [axis], keepdims=1)))]
