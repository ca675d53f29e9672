"""Lowering of SoftmaxGrad_13 and LogSoftmaxGrad_13 (the reduction family: ONNX Runtime training's
gradients of Softmax and LogSoftmax from opset 13, which gradgen runs), and of SoftmaxGrad and
LogSoftmaxGrad (before opset 13: the sums over every axis from ``axis``), to standard ONNX ops."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.passes.lowering.table import node_input, node_where, register_lowering


def _inputs(node: ir.Node, default_axis: int = -1) -> tuple[ir.Value, ir.Value, int]:
    dy, y = node_input(node, 0), node_input(node, 1)
    if dy is None or y is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, Y")
    axis = node.attributes.get("axis")
    return dy, y, default_axis if axis is None else int(axis.value)


def _coerced_inputs(node: ir.Node) -> tuple[ir.Value, ir.Value, list[int]]:
    """dY, Y and the axes of SoftmaxGrad / LogSoftmaxGrad: every axis from ``axis`` (default 1)."""
    dy, y, axis = _inputs(node, default_axis=1)
    dims = dims_of(y) or dims_of(dy)
    if dims is None:
        raise ModelError(f"{node_where(node)}: the rank of Y is unknown; the lowering needs it")
    return dy, y, list(range(axis % max(len(dims), 1), len(dims)))


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


@register_lowering("SoftmaxGrad")
def lower_softmax_grad(e: GraphBuilder, node: ir.Node):
    """dX = Y * (dY - sum(dY * Y)) over the axes from ``axis``."""
    dy, y, axes = _coerced_inputs(node)
    return [e.op("Mul", y, e.op("Sub", dy, e.reduce_sum(e.op("Mul", dy, y), axes, keepdims=1)))]


@register_lowering("LogSoftmaxGrad")
def lower_log_softmax_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY - exp(Y) * sum(dY) over the axes from ``axis``."""
    dy, y, axes = _coerced_inputs(node)
    return [e.op("Sub", dy, e.op("Mul", e.op("Exp", y), e.reduce_sum(dy, axes, keepdims=1)))]
