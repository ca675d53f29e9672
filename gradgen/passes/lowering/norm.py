"""Lowering of LayerNormalizationGrad (the norm family) to standard ONNX ops."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.grads.rules.norm import normalize_backward
from gradgen.passes.lowering.table import (
    BASE_OPSET,
    CASTLIKE_OPSET,
    is_needed,
    node_input,
    node_where,
    register_lowering,
)


def _to_type_of(e: GraphBuilder, value: ir.Value, like: ir.Value) -> ir.Value:
    """``value`` in like's element type (CastLike when that type is unknown)."""
    if like.dtype is None:
        return e.op("CastLike", value, like)
    return value if value.dtype == like.dtype else e.op("Cast", value, to=like.dtype)


@register_lowering(
    "LayerNormalizationGrad",
    min_opset=lambda node: CASTLIKE_OPSET if node_input(node, 1) is None or node.inputs[1].dtype is None else BASE_OPSET,
)
def lower_layer_normalization_grad(e: GraphBuilder, node: ir.Node):
    """xhat = (X - mean) * inv_std_var in X's type; dX = inv_std_var * (dxhat - mean(dxhat) -
    xhat * mean(dxhat * xhat)) over the normalized axes with dxhat = Y_grad * scale; scale_grad and
    bias_grad sum Y_grad * xhat and Y_grad over the leading axes."""
    dy, x, scale, mean, inv_std = (node_input(node, i) for i in range(5))
    if any(v is None for v in (dy, x, scale, mean, inv_std)):
        raise ModelError(f"{node_where(node)} lacks one of its inputs Y_grad, X, scale, mean, inv_std_var")
    dims = dims_of(x) or dims_of(dy)
    if dims is None:
        raise ModelError(f"{node_where(node)}: the rank of X ({x.name!r}) is unknown; the lowering needs it")
    rank = len(dims)
    axis_attr = node.attributes.get("axis")
    axis = -1 if axis_attr is None else int(axis_attr.value)
    if not -rank <= axis < rank:
        raise ModelError(f"{node_where(node)}: axis {axis} is out of range for X of rank {rank}")
    axis %= rank
    norm_axes, lead_axes = list(range(axis, rank)), list(range(axis))
    rstd = _to_type_of(e, inv_std, x)
    xhat = e.op("Mul", e.op("Sub", x, _to_type_of(e, mean, x)), rstd)
    outputs = [None, None, None]
    if is_needed(node.outputs[0]):
        outputs[0] = normalize_backward(e, e.op("Mul", dy, scale), xhat, rstd, norm_axes)
    for i, term in ((1, lambda: e.op("Mul", dy, xhat)), (2, lambda: dy)):
        if i < len(node.outputs) and is_needed(node.outputs[i]):
            summed = e.reduce_sum(term(), lead_axes, keepdims=0) if lead_axes else term()
            outputs[i] = e.reshape_like(summed, scale)
    return outputs
