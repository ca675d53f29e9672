"""Gradient rules: QuantizeLinear and DequantizeLinear (the QDQ pairs of quantization-aware models)."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule

_HALF = {ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def _node(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


@grad_rule("DequantizeLinear", nondiff_inputs=(0, 2))
def dequantize_linear(g):
    """y = (x - zero_point) * scale. x and zero_point are integers: no gradient. The float scale gets
    dY * (x - zero_point) summed over what it scales: everything (per tensor), every axis but
    ``axis`` (per axis). Half-precision scales accumulate in float32. Block quantization (opset 21)
    is refused by name: its gradient (sums over blocks) is not written yet."""
    if int(g.attr("block_size", 0) or 0):
        raise ModelError(f"{_node(g)}: gradgen has no gradient for the scale of block quantization (block_size)")
    x, scale, zero = g.x(0), g.x(1), g.x(2)
    scale_rank = g.rank(scale)
    per_axis = scale_rank != 0
    rank = g.rank(x)
    if per_axis and (rank is None or scale_rank is None):
        raise ModelError(f"{_node(g)}: the gradient of a scale vector needs the ranks of x and of the scale, which are unknown")
    compute = ir.DataType.FLOAT if scale.dtype in _HALF else scale.dtype
    diff = g.op("Cast", x, to=compute)
    if zero is not None:
        z = g.op("Cast", zero, to=compute)
        if per_axis and rank:
            axis = int(g.attr("axis", 1)) % rank
            z = g.unsqueeze(z, [i for i in range(rank) if i != axis])
        diff = g.op("Sub", diff, z)
    dy = g.dy() if compute == scale.dtype else g.op("Cast", g.dy(), to=compute)
    product = g.op("Mul", dy, diff)
    if not per_axis:
        grad = g.reduce_sum(product, None, keepdims=0)
    else:
        grad = _per_axis_sum(g, product, rank, scale)
    grad = grad if compute == scale.dtype else g.op("Cast", grad, to=scale.dtype)
    return [None, grad, None][: len(g.node.inputs)]


def _per_axis_sum(g, product: ir.Value, rank: int, scale: ir.Value) -> ir.Value:
    """product summed to the scale vector's shape: (C,) along ``axis``, or (1,) (one scale for all)."""
    axis = int(g.attr("axis", 1)) % rank if rank else 0
    others = [i for i in range(rank) if i != axis]
    along = g.reduce_sum(product, others, keepdims=0) if others else product  # (C,), C = x's axis dim
    if rank == 0:
        return g.reshape(along, [1])
    size = scale.shape[0] if scale.shape is not None else None
    channels = product.shape[axis] if product.shape is not None and product.shape.rank() == rank else None
    if size == 1:
        return g.reduce_sum(along, None, keepdims=1)
    if isinstance(size, int) and size == channels:
        return along
    # the scale's length (1 or C) is known at run time only: (C,) viewed as (C / n, n), summed over rows
    return g.reduce_sum(g.reshape(along, g.cat(g.ints([-1]), g.shape_of(scale))), [0], keepdims=0)


@grad_rule("QuantizeLinear", unsupported_inputs=(0, 1), nondiff_inputs=(2,))
def quantize_linear(g):
    """QuantizeLinear(x, scale, zero_point) -> integer y: no gradient flows through it, by decision.

    y is an integer tensor, piecewise constant in x and in the scale (a staircase): its derivative
    is zero wherever it exists. A zero gradient through a QDQ pair (QuantizeLinear then
    DequantizeLinear) would be that true derivative, but it is almost never what a
    quantization-aware user wants (the straight-through estimator, dY passed to x where x is inside
    the quantized range, or LSQ's step-size gradient), and it would be silent. So x and the scale
    are declared unsupported inputs: when a tensor being differentiated reaches either and the loss
    depends on y, the gradient pass stops with a one-line error naming this node (the walker's
    check, before any rule runs); the zero point is an integer and gets none. A differentiated
    DequantizeLinear scale that also feeds this node (a QDQ pair sharing its scale) is refused the
    same way: --freeze it, or name the tensors wanted with --wrt. gradgen offers no
    straight-through estimator: it is a training recipe, not a gradient (a model wanting one writes
    its fake quantization with float ops, whose rules give it). This function runs only if a float
    gradient ever reaches y (it cannot: y is an integer), and refuses then too."""
    raise ModelError(
        f"{_node(g)}: its output is quantized (integer) and carries no gradient; gradgen does not differentiate QuantizeLinear"
    )
