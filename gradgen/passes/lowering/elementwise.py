"""Lowering of BroadcastGradientArgs (the elementwise family: the reduction axes of a broadcasting
op's gradients) to standard ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import KernelError, ModelError
from gradgen.grads.rules.elementwise import gelu_slopes
from gradgen.passes.lowering.table import is_needed, node_input, node_where, register_lowering, zeros_opset


@register_lowering("BroadcastGradientArgs")
def lower_broadcast_gradient_args(e: GraphBuilder, node: ir.Node):
    """The axes each operand of a broadcasting op is reduced over, in descending order."""
    from gradgen.ops.elementwise import broadcast_gradient_axes

    a, b = node_input(node, 0), node_input(node, 1)
    if a is None or b is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs A, B")
    a_known, b_known = e.value_of(a), e.value_of(b)
    if a_known is not None and b_known is not None:
        try:
            a_axes, b_axes = broadcast_gradient_axes(a_known.reshape(-1).tolist(), b_known.reshape(-1).tolist())
        except KernelError as exc:
            raise ModelError(f"{node_where(node)}: {exc}") from None
        return [e.ints(a_axes), e.ints(b_axes)]
    a64, b64 = e.to_int64(a), e.to_int64(b)
    ra, rb = e.op("Shape", a64), e.op("Shape", b64)
    n = e.op("Max", ra, rb)
    one = ir.tensor(np.ones((1,), dtype=np.int64))
    lead_a, lead_b = e.op("Sub", n, ra), e.op("Sub", n, rb)
    a_full = e.op("Concat", e.op("ConstantOfShape", lead_a, value=one), a64, axis=0)
    b_full = e.op("Concat", e.op("ConstantOfShape", lead_b, value=one), b64, axis=0)
    # Output axes from the last to the first.
    k = e.op("Range", e.op("Sub", e.op("Reshape", n, e.ints([])), e.scalar(1)), e.scalar(-1), e.scalar(-1))
    a_dims, b_dims = e.op("Gather", a_full, k, axis=0), e.op("Gather", b_full, k, axis=0)
    a_one, b_one = e.op("Equal", a_dims, e.scalar(1)), e.op("Equal", b_dims, e.scalar(1))
    results: list[ir.Value | None] = [None, None]
    if is_needed(node.outputs[0] if node.outputs else None):
        take = e.op("Or", e.op("Less", k, lead_a), e.op("And", a_one, e.op("Not", b_one)))
        results[0] = e.op("Compress", k, take, axis=0)
    if len(node.outputs) > 1 and is_needed(node.outputs[1]):
        take = e.op("Or", e.op("Less", k, lead_b), e.op("And", b_one, e.op("Not", a_one)))
        results[1] = e.op("Compress", k, take, axis=0)
    return results


@register_lowering("ReluGrad", min_opset=lambda node: max(zeros_opset(0)(node), zeros_opset(1)(node)))
def lower_relu_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY where X > 0, else 0."""
    dy, x = node_input(node, 0), node_input(node, 1)
    if dy is None or x is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, X")
    return [e.op("Where", e.op("Greater", x, e.zeros(e.ints([]), x)), dy, e.zeros(e.ints([]), dy))]


def _dy_and_y(node: ir.Node) -> tuple[ir.Value, ir.Value]:
    dy, y = node_input(node, 0), node_input(node, 1)
    if dy is None or y is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, Y")
    return dy, y


def _one_like(e: GraphBuilder, y: ir.Value) -> ir.Value:
    """1 in Y's type (CastLike where that type is unknown: the lowerings' min_opset, zeros_opset(1))."""
    return e.const_like(y, 1.0) if y.dtype is not None else e.op("CastLike", e.const(np.array(1.0, np.float32)), y)


@register_lowering("SigmoidGrad", min_opset=zeros_opset(1))
def lower_sigmoid_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY * Y * (1 - Y), Y Sigmoid's output."""
    dy, y = _dy_and_y(node)
    return [e.op("Mul", e.op("Mul", dy, y), e.op("Sub", _one_like(e, y), y))]


@register_lowering("TanhGrad", min_opset=zeros_opset(1))
def lower_tanh_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY * (1 - Y * Y), Y Tanh's output."""
    dy, y = _dy_and_y(node)
    return [e.op("Mul", dy, e.op("Sub", _one_like(e, y), e.op("Mul", y, y)))]


def _lower_gelu_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY Gelu'(X [+ B]): the derivative the Gelu rule spells (gradgen.grads.rules.elementwise)."""
    biased = node.op_type.startswith("Bias")
    dy, x = node_input(node, 0), node_input(node, 1)
    bias = node_input(node, 2) if biased else None
    if dy is None or x is None or (biased and bias is None):
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, X{', B' if biased else ''}")
    z = e.op("Add", x, bias) if bias is not None else x
    return [e.op("Mul", dy, gelu_slopes(e, z, "Fast" in node.op_type, x)[0])]


for _op_type in ("GeluGrad", "FastGeluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX"):
    register_lowering(_op_type)(_lower_gelu_grad)
