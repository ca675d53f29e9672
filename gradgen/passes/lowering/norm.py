"""Lowering of LayerNormalizationGrad (the norm family) to standard ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.grads.rules.norm import normalize_backward, per_channel
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


def _grad_axes(node: ir.Node, x: ir.Value, dy: ir.Value) -> tuple[list[int], list[int]]:
    """The normalized axes (from ``axis``) and the leading ones of a (Simplified)LayerNormalizationGrad."""
    dims = dims_of(x) or dims_of(dy)
    if dims is None:
        raise ModelError(f"{node_where(node)}: the rank of X ({x.name!r}) is unknown; the lowering needs it")
    rank = len(dims)
    axis_attr = node.attributes.get("axis")
    axis = -1 if axis_attr is None else int(axis_attr.value)
    if not -rank <= axis < rank:
        raise ModelError(f"{node_where(node)}: axis {axis} is out of range for X of rank {rank}")
    axis %= rank
    return list(range(axis, rank)), list(range(axis))


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
    norm_axes, lead_axes = _grad_axes(node, x, dy)
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


@register_lowering(
    "SimplifiedLayerNormalizationGrad",
    min_opset=lambda node: CASTLIKE_OPSET if node_input(node, 1) is None or node.inputs[1].dtype is None else BASE_OPSET,
)
def lower_simplified_layer_normalization_grad(e: GraphBuilder, node: ir.Node):
    """The RMS norm's: xhat = X * inv_std_var in X's type; dX = inv_std_var * (dxhat - xhat *
    mean(dxhat * xhat)) over the normalized axes with dxhat = Y_grad * scale; scale_grad sums
    Y_grad * xhat over the leading axes."""
    dy, x, scale, inv_std = (node_input(node, i) for i in range(4))
    if any(v is None for v in (dy, x, scale, inv_std)):
        raise ModelError(f"{node_where(node)} lacks one of its inputs Y_grad, X, scale, inv_std_var")
    norm_axes, lead_axes = _grad_axes(node, x, dy)
    rstd = _to_type_of(e, inv_std, x)
    xhat = e.op("Mul", x, rstd)
    outputs = [None, None]
    if is_needed(node.outputs[0]):
        dxhat = e.op("Mul", dy, scale)
        mean_dx = e.reduce("ReduceMean", e.op("Mul", dxhat, xhat), norm_axes, keepdims=1)
        outputs[0] = e.op("Mul", rstd, e.op("Sub", dxhat, e.op("Mul", xhat, mean_dx)))
    if len(node.outputs) > 1 and is_needed(node.outputs[1]):
        term = e.op("Mul", dy, xhat)
        summed = e.reduce_sum(term, lead_axes, keepdims=0) if lead_axes else term
        outputs[1] = e.reshape_like(summed, scale)
    return outputs


# ---------------------------------------------------------------------------------------------
# ONNX Runtime's fused normalizations (forward ops): their standard-op forms, which are also what
# DecomposePass differentiates (gradgen/kernels/cpu/norm.py has their kernels and schemas)


def _normalize(e: GraphBuilder, node: ir.Node, x: ir.Value, scale: ir.Value, bias, simplified: bool, axis: int = -1):
    """(Y, mean or zeros, inv_std_var) of a layer norm (RMS norm when ``simplified``) over the
    axes from ``axis``, as the kernels compute them: statistics in float32 for 16-bit X."""
    first = node.inputs[0]
    dims = dims_of(first)
    if dims is None or not dims or first.dtype is None:
        raise ModelError(f"{node_where(node)}: its standard-op form needs the type and rank of its input; they are not known")
    rank = len(dims)
    axes = list(range(axis % rank, rank))
    eps = (
        node.attributes["epsilon"].value if "epsilon" in node.attributes else (1e-5 if node.domain in ("", "ai.onnx") else 1e-12)
    )
    wide = first.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    stats = np.dtype(np.float32) if wide else np.dtype(first.dtype.numpy())
    xs = e.op("Cast", x, to=ir.DataType.FLOAT) if wide else x
    if simplified:
        mean, centered = None, xs
    else:
        mean = e.reduce("ReduceMean", xs, axes, keepdims=1)
        centered = e.op("Sub", xs, mean)
    var = e.reduce("ReduceMean", e.op("Mul", centered, centered), axes, keepdims=1)
    inv_std = e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, e.const(np.array(eps, dtype=stats)))))
    y = e.op("Mul", e.op("Mul", centered, inv_std), e.op("Cast", scale, to=ir.DataType.FLOAT) if wide else scale)
    if bias is not None:
        y = e.op("Add", y, e.op("Cast", bias, to=ir.DataType.FLOAT) if wide else bias)
    if wide:
        y = e.op("Cast", y, to=first.dtype)
    if mean is None and len(node.outputs) > 1 and is_needed(node.outputs[1]) and node.op_type.startswith("Skip"):
        mean = e.op("Mul", inv_std, e.const(np.array(0.0, dtype=stats)))  # ONNX Runtime writes zeros
    return y, mean, inv_std


def _skip_inputs(node: ir.Node, names: tuple[str, ...]) -> dict:
    values = {name: node_input(node, i) for i, name in enumerate(names)}
    for name in ("input", "skip", "gamma"):
        if values[name] is None:
            raise ModelError(f"{node_where(node)} lacks its input {name!r}")
    return values


@register_lowering("SkipLayerNormalization", min_opset=BASE_OPSET)
@register_lowering("SkipSimplifiedLayerNormalization", min_opset=BASE_OPSET)
def lower_skip_layer_normalization(e: GraphBuilder, node: ir.Node):
    """(output, mean, inv_std_var, input_skip_bias_sum): the (RMS) layer norm of input + skip [+ bias]."""
    simplified = node.op_type == "SkipSimplifiedLayerNormalization"
    names = ("input", "skip", "gamma", "bias") if simplified else ("input", "skip", "gamma", "beta", "bias")
    v = _skip_inputs(node, names)
    total = e.op("Add", v["input"], v["skip"])
    if v["bias"] is not None:
        total = e.op("Add", total, v["bias"])
    y, mean, inv_std = _normalize(e, node, total, v["gamma"], v.get("beta"), simplified)
    return [y, mean, inv_std, total]


@register_lowering("SimplifiedLayerNormalization", domain="", min_opset=BASE_OPSET)
def lower_simplified_layer_normalization(e: GraphBuilder, node: ir.Node):
    """(Y, inv_std_var): RMS normalization over the axes from ``axis``, times scale."""
    x, scale = node_input(node, 0), node_input(node, 1)
    if x is None or scale is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs X, scale")
    if "stash_type" in node.attributes and int(node.attributes["stash_type"].value) != 1:
        raise ModelError(f"{node_where(node)}: stash_type {node.attributes['stash_type'].value} is not supported (only 1)")
    axis = int(node.attributes["axis"].value) if "axis" in node.attributes else -1
    y, _, inv_std = _normalize(e, node, x, scale, None, simplified=True, axis=axis)
    if x.dtype == ir.DataType.DOUBLE:
        inv_std = e.op("Cast", inv_std, to=ir.DataType.FLOAT)  # float32, as the kernel and ONNX Runtime give it
    return [y, inv_std]


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's BatchNormalization pair: BatchNormInternal (the training forward with the
# saved batch mean and inverse deviation) and BatchNormalizationGrad (reading them)


def _channel_layout(node: ir.Node, x: ir.Value) -> tuple[list[int], int]:
    """(the reduced axes [0, 2, ...], the rank) of X, an (N, C, ...) tensor of known rank."""
    dims = dims_of(x)
    if dims is None or len(dims) < 2:
        raise ModelError(f"{node_where(node)}: the rank of X ({x.name!r}) is unknown or below 2; the lowering needs it")
    return [0, *range(2, len(dims))], len(dims)


def _per_channel_count(e: GraphBuilder, x: ir.Value, channel_vector: ir.Value) -> ir.Value:
    """The number of elements of X per channel, a scalar of X's type."""
    sizes = [_to_type_of(e, e.op("Size", v), x) for v in (x, channel_vector)]
    return e.op("Div", *sizes)


@register_lowering("BatchNormInternal", min_opset=15)
def lower_batch_norm_internal(e: GraphBuilder, node: ir.Node):
    """BatchNormalization (opset 15: statistics of another type than X) for Y and the running
    statistics; the saved batch mean and 1 / sqrt(biased batch variance + epsilon) recomputed from X
    in X's type, in the running statistics' type."""
    inputs = [node_input(node, i) for i in range(5)]
    if any(v is None for v in inputs):
        raise ModelError(f"{node_where(node)} lacks one of its inputs X, scale, B, input_mean, input_var")
    x = inputs[0]
    attrs = {name: attr.value for name, attr in node.attributes.items() if name in ("epsilon", "momentum", "training_mode")}
    training = int(attrs.get("training_mode", 1)) == 1
    if not training:
        return [e.op("BatchNormalization", *inputs, epsilon=attrs.get("epsilon"))]
    y, running_mean, running_var = e.op_multi("BatchNormalization", inputs, 3, **{**attrs, "training_mode": 1})
    outputs: list[ir.Value | None] = [y, running_mean, running_var, None, None]
    if any(i < len(node.outputs) and is_needed(node.outputs[i]) for i in (3, 4)):
        if x.dtype is None:
            raise ModelError(f"{node_where(node)}: the element type of X ({x.name!r}) is unknown; the lowering needs it")
        axes, _ = _channel_layout(node, x)
        mean = e.reduce("ReduceMean", x, axes, keepdims=1)
        centered = e.op("Sub", x, mean)
        var = e.reduce("ReduceMean", e.op("Mul", centered, centered), axes, keepdims=0)
        eps = e.const(np.array(attrs.get("epsilon", 1e-5), dtype=x.dtype.numpy()))
        inv_std = e.op("Reciprocal", e.op("Sqrt", e.op("Add", var, eps)))
        outputs[3] = _to_type_of(e, e.reshape_like(mean, inputs[3]), inputs[3])
        outputs[4] = _to_type_of(e, inv_std, inputs[4])
    return outputs


@register_lowering("BatchNormalizationGrad")
def lower_batch_normalization_grad(e: GraphBuilder, node: ir.Node):
    """xhat = (X - mean) * inv_std per channel; bias_grad = sum(dY), scale_grad = sum(dY * xhat) over
    every axis but the channel's; X_grad = scale * inv_std * (dY - bias_grad / m - xhat * scale_grad
    / m), m the elements per channel."""
    dy, x, scale, mean, inv_std = (node_input(node, i) for i in range(5))
    if any(v is None for v in (dy, x, scale, mean, inv_std)):
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, X, scale, mean, variance")
    axes, rank = _channel_layout(node, x)
    inv = per_channel(e, inv_std, rank)
    xhat = e.op("Mul", e.op("Sub", x, per_channel(e, mean, rank)), inv)
    dbias = e.reduce_sum(dy, axes, keepdims=0)
    dscale = e.reduce_sum(e.op("Mul", dy, xhat), axes, keepdims=0)
    outputs: list[ir.Value | None] = [None, None, None]
    if is_needed(node.outputs[0]):
        count = _per_channel_count(e, x, scale)
        shifted = e.op("Sub", dy, per_channel(e, e.op("Div", dbias, count), rank))
        inner = e.op("Sub", shifted, e.op("Mul", xhat, per_channel(e, e.op("Div", dscale, count), rank)))
        outputs[0] = e.op("Mul", inner, per_channel(e, e.op("Mul", scale, inv_std), rank))
    for i, value in ((1, dscale), (2, dbias)):
        if i < len(node.outputs) and is_needed(node.outputs[i]):
            outputs[i] = value
    return outputs
