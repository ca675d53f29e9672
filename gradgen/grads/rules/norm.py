"""Gradient rules: BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization.

The statistics are recomputed from X in X's element type, except for LayerNormalization, whose
gradient is ONNX Runtime training's LayerNormalizationGrad reading the forward node's saved
Mean/InvStdDev (gradients flowing into those outputs are honoured too), and training-mode
BatchNormalization of one float32 or float64 type, which becomes ONNX Runtime training's
BatchNormInternal (the batch mean and inverse deviation saved) with one BatchNormalizationGrad. For a
normalisation xhat = (x - mean) * rstd over some axes, with dxhat the gradient reaching xhat:

    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))

BatchNormalization in inference mode (training_mode=0, one output) treats input_mean and
input_var as ordinary inputs, so all five inputs get gradients. In training mode the batch
statistics are used and Y's gradient reaches X, scale and B; the running statistics outputs carry
their (linear) gradients back to input_mean/input_var and X.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from gradgen.builder import INT64_MAX, MICROSOFT, dims_of, numpy_dtype_of
from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule


def _rank(g, x) -> int:
    rank = g.rank(x)
    if rank is None:
        raise ModelError(
            f"{g.node.op_type} node {g.node.name!r}: the rank of its input {x.name!r} is unknown; "
            "its gradient needs it (run shape inference or give the input a shape)"
        )
    return rank


def per_channel(g, v, rank):
    """A (C,) vector as (C, 1, ..., 1), broadcastable along axis 1 of a rank-``rank`` tensor."""
    return g.unsqueeze(v, list(range(1, rank - 1))) if rank > 2 else v


def _stats(g, x, axes, eps, like=None):
    """(xhat, rstd, centered) of x normalised over ``axes`` (keepdims layout); ``like`` gives the
    element type when x is an emitted value."""
    mean = g.reduce("ReduceMean", x, axes, keepdims=1)
    centered = g.op("Sub", x, mean)
    var = g.reduce("ReduceMean", g.op("Mul", centered, centered), axes, keepdims=1)
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const_like(like if like is not None else x, eps))))
    return g.op("Mul", centered, rstd), rstd, centered


def normalize_backward(g, dxhat, xhat, rstd, axes):
    """dx of xhat = (x - mean) * rstd over ``axes`` (keepdims layout), from dxhat, the gradient
    reaching xhat: the rules' spelling, and LayerNormalizationGrad's lowering."""
    mean_d = g.reduce("ReduceMean", dxhat, axes, keepdims=1)
    mean_dx = g.reduce("ReduceMean", g.op("Mul", dxhat, xhat), axes, keepdims=1)
    inner = g.op("Sub", g.op("Sub", dxhat, mean_d), g.op("Mul", xhat, mean_dx))
    return g.op("Mul", rstd, inner)


def batch_norm_in_training(node: ir.Node) -> bool:
    """Whether a BatchNormalization (or BatchNormInternal, training mode by default) normalises with
    the batch's statistics: training_mode 1, or (below opset 14) more than one output."""
    default = 1 if node.op_type == "BatchNormInternal" else 0
    attr = node.attributes.get("training_mode")
    return int(attr.value if attr is not None else default) == 1 or len(node.outputs) > 1


# The running statistics read X and the old running statistic, the saved batch statistics X only.
@grad_rule("BatchNormalization", output_inputs={1: (0, 3), 2: (0, 4)})
@grad_rule("BatchNormInternal", domain=MICROSOFT, output_inputs={1: (0, 3), 2: (0, 4), 3: (0,), 4: (0,)})
def batch_normalization(g):
    """BatchNormalization, and ONNX Runtime training's BatchNormInternal (training mode by default;
    its saved batch mean and inverse deviation carry gradients too)."""
    x, scale, bias, mean, var = (g.x(i) for i in range(5))
    rank = _rank(g, x)
    eps = float(g.attr("epsilon", 1e-5))
    training = batch_norm_in_training(g.node)
    axes = [0] + list(range(2, rank))
    dy = g.dy(0)
    if training:
        return _batch_norm_training(g, rank, axes, eps)
    # y = (x - mean) * inv * scale + bias, inv = (var + eps)^-1/2, all per channel; statistics of
    # another type than scale (ONNX's T2 against T1: a float64 export's float32 default scale) are
    # computed in scale's type, their gradients cast back
    mean, var = (_like(g, v, scale, v) for v in (mean, var))
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", var, g.const_like(scale, eps))))
    mixed = _mixed_types(x, scale)
    grads = [None] * 5
    if g.needs(0):
        factor = g.op("Mul", scale, inv)
        grads[0] = _scale_channels(g, dy, factor, scale) if mixed else g.op("Mul", dy, per_channel(g, factor, rank))
    # the parameters' gradients in their own type: for a 16-bit X with float32 parameters, the
    # reductions read dY and X cast to float32, so they accumulate and end in float32
    dy_p = g.cast_like(dy, scale) if mixed else dy
    if g.needs(2) or g.needs(3):
        dbias = g.reduce_sum(dy_p, axes, keepdims=0)
        if g.needs(2):
            grads[2] = dbias
        if g.needs(3):
            grads[3] = _like(g, g.op("Neg", g.op("Mul", dbias, g.op("Mul", scale, inv))), g.x(3), scale)
    if g.needs(1) or g.needs(4):
        x_p = g.cast_like(x, scale) if mixed else x
        xhat = g.op("Mul", g.op("Sub", x_p, per_channel(g, mean, rank)), per_channel(g, inv, rank))
        dscale = g.reduce_sum(g.op("Mul", dy_p, xhat), axes, keepdims=0)
        if g.needs(1):
            grads[1] = dscale
        if g.needs(4):
            # d y / d var = -1/2 * scale * (x - mean) * inv^3 = -1/2 * scale * xhat * inv^2
            factor = g.op("Mul", g.op("Mul", scale, g.op("Mul", inv, inv)), g.const_like(scale, -0.5))
            grads[4] = _like(g, g.op("Mul", dscale, factor), g.x(4), scale)
    return grads


def _like(g, v, other, v_typed_as):
    """v (of ``v_typed_as``'s type: v itself may be an emitted, untyped value) cast to other's type
    where both types are known and differ; v otherwise."""
    return g.cast_like(v, other) if _mixed_types(v_typed_as, other) else v


def _mixed_types(x, scale) -> bool:
    """X in another float type than its parameters: AutocastPass's BatchNormalization, a 16-bit X
    with float32 scale, bias and statistics (opset 15 and later)."""
    return x.dtype is not None and scale.dtype is not None and x.dtype != scale.dtype


def _scale_channels(g, v, factor, scale):
    """v * factor[c] along axis 1, in v's type, for a float32 ``factor`` and a 16-bit ``v``: computed
    in float32 and rounded once. ONNX has no Mul of two types, and rounding the factor to 16 bits
    first would scale a whole channel by the same wrong amount, so it is a BatchNormalization with
    mean 0, variance 1, epsilon 0 and bias 0 (scale v by factor exactly, then round)."""
    zeros, ones = (_filled_like(g, scale, fill) for fill in (0.0, 1.0))
    return g.op("BatchNormalization", v, factor, zeros, zeros, ones, epsilon=0.0)


def _filled_like(g, v, fill: float):
    """A tensor of v's (the forward scale's) shape and type holding ``fill``: a constant when the
    shape is static."""
    dims = dims_of(v)
    dtype = numpy_dtype_of(v)
    if dims is not None and all(isinstance(d, int) for d in dims):
        return g.const(np.full(tuple(dims), fill, dtype))
    return g.op("ConstantOfShape", g.shape_of(v), value=ir.tensor(np.full((1,), fill, dtype)))


def _batch_norm_training(g, rank, axes, eps):
    """Training mode. A 16-bit X with float32 parameters (``_mixed_types``) is differentiated in
    float32, as the forward computes its batch statistics: X and dY cast up, dX rounded once at the
    end (statistics of 16-bit tensors recomputed in 16 bits would lose the variance)."""
    x, scale, mean_in, var_in = g.x(0), g.x(1), g.x(3), g.x(4)
    momentum = float(g.attr("momentum", 0.9))
    dy, drm, drv = g.dy(0), g.dy(1), g.dy(2)
    internal = g.node.op_type == "BatchNormInternal"
    if not internal and len(g.node.outputs) > 3 and any(g.dy(i) is not None for i in (3, 4)):
        raise ModelError(f"{g.node.op_type} node {g.node.name!r}: gradients through the saved mean/var outputs are not supported")
    like = x  # a typed value of the type the gradient is computed in
    if _mixed_types(x, scale):
        like, x = scale, g.cast_like(x, scale)
        dy = g.cast_like(dy, scale) if dy is not None else None
    grads = [None] * 5
    parts = []
    stats = None  # (xhat, rstd, centered), recomputed from X where needed
    if dy is not None and _saved_batch_stats_fit(g, x):
        dx, dscale, dbias = _batch_norm_grad_op(g, eps)
        if g.needs(0):
            parts.append(dx)
        grads[1], grads[2] = dscale, dbias
    elif dy is not None:
        stats = _stats(g, x, axes, eps, like=like)
        xhat, rstd, _ = stats
        if g.needs(0):
            dxhat = g.op("Mul", dy, per_channel(g, scale, rank))
            parts.append(normalize_backward(g, dxhat, xhat, rstd, axes))
        if g.needs(1):
            grads[1] = g.reduce_sum(g.op("Mul", dy, xhat), axes, keepdims=0)
        if g.needs(2):
            grads[2] = g.reduce_sum(dy, axes, keepdims=0)
    # running_mean = m * input_mean + (1 - m) * batch_mean; running_var likewise with the
    # biased batch variance.
    rest = g.const_like(like, 1.0 - momentum)
    for i, d, stat_in in ((3, drm, mean_in), (4, drv, var_in)):
        if d is None:
            continue
        if g.needs(i):
            grads[i] = g.op("Mul", d, g.const_like(stat_in, momentum))
        if g.needs(0):
            share = g.op("Mul", per_channel(g, _like(g, d, like, stat_in), rank), rest)
            count = _count_like(g, x, scale, like)
            if i == 3:  # the batch mean: share / count for every element
                parts.append(g.expand_like(g.op("Div", share, count), x))
            else:  # the biased batch variance: share * 2 / count * (x - mean)
                if stats is None:
                    stats = _stats(g, x, axes, eps, like=like)
                centered = stats[2]
                two = g.const_like(like, 2.0)
                parts.append(g.op("Mul", g.op("Div", g.op("Mul", share, two), count), centered))
    if internal and g.needs(0) and (g.dy(3) is not None or g.dy(4) is not None):
        # BatchNormInternal's saved batch mean and inverse deviation (a second-order gradient
        # reaches them through BatchNormalizationGrad)
        _, rstd, centered = stats if stats is not None else _stats(g, x, axes, eps, like=like)
        parts.extend(_saved_statistics_backward(g, x, scale, like, rstd, centered, rank))
    if g.needs(0) and parts:
        grads[0] = g.sum(parts) if like is g.x(0) else g.cast_like(g.sum(parts), g.x(0))
    # Y normalises with the batch statistics: without a running-stat output in the loss, the input
    # mean and variance get no gradient, which is a true zero (not a missing rule)
    for i, d in ((3, drm), (4, drv)):
        if d is None and g.needs(i):
            grads[i] = g.zeros_like(g.x(i))
    return grads


def _saved_statistics_backward(g, x, scale, like, rstd, centered, rank) -> list:
    """X's gradient parts from BatchNormInternal's saved_mean (mean(X): d / m for every element) and
    saved_inv_std (rstd = (var + eps)^-1/2: d rstd / d X = -rstd^3 (X - mean) / m), m the elements
    per channel; rstd and centered as ``_stats`` gives them."""
    count = _count_like(g, x, scale, like)
    parts = []
    d_mean, d_rstd = (None if g.dy(i) is None else per_channel(g, _like(g, g.dy(i), like, g.x(i)), rank) for i in (3, 4))
    if d_mean is not None:
        parts.append(g.expand_like(g.op("Div", d_mean, count), x))
    if d_rstd is not None:
        cube = g.op("Mul", g.op("Mul", rstd, rstd), rstd)
        parts.append(g.op("Mul", g.op("Neg", g.op("Div", g.op("Mul", d_rstd, cube), count)), centered))
    return parts


def _saved_batch_stats_fit(g, x) -> bool:
    """Whether the forward node can become BatchNormInternal, whose saved batch mean and inverse
    deviation BatchNormalizationGrad reads: opset 14's three outputs (at most) and attributes, and X,
    scale, B and the running statistics all float32 or all float64 (the pair's contract has one
    type for all of them; the saved statistics of a 16-bit X would be rounded to 16 bits)."""
    node = g.node
    if node.op_type == "BatchNormalization" and len(node.outputs) > 3:
        return False
    if not set(node.attributes) <= {"epsilon", "momentum", "training_mode"}:
        return False
    types = {v.dtype if v is not None else None for v in node.inputs[:5]}
    return len(node.inputs) == 5 and len(types) == 1 and x.dtype in (ir.DataType.FLOAT, ir.DataType.DOUBLE)


def _batch_norm_grad_op(g, eps):
    """(dX, dScale or None, dBias or None): the forward node made ONNX Runtime training's
    BatchNormInternal (its saved_mean and saved_inv_std outputs added) and one BatchNormalizationGrad
    node reading them, as ONNX Runtime training's gradient builder writes the pair."""
    x, scale = g.x(0), g.x(1)
    saved_mean, saved_inv_std = _saved_batch_statistics(g)
    y = g.y(0).name
    names = [f"{y}_dX", f"{y}_dscale" if g.needs(1) else "", f"{y}_dbias" if g.needs(2) else ""]
    inputs = [g.dy(0), x, scale, saved_mean, saved_inv_std]
    dx, dscale, dbias = g.op_multi("BatchNormalizationGrad", inputs, 3, domain=MICROSOFT, output_names=names, epsilon=eps)
    g.set_type_like(dx, x)
    for out in (dscale, dbias):
        if out.name:
            g.set_type_like(out, scale)
    return dx, (dscale if dscale.name else None), (dbias if dbias.name else None)


def _saved_batch_statistics(g):
    """The forward node as BatchNormInternal in training mode, with its five outputs named and typed;
    returns its saved_mean and saved_inv_std (C,) outputs."""
    node, scale = g.node, g.x(1)
    node.op_type, node.domain = "BatchNormInternal", MICROSOFT
    node.attributes["training_mode"] = ir.AttrInt64("training_mode", 1)
    node.resize_outputs(5)
    for i, suffix in ((1, "running_mean"), (2, "running_var"), (3, "saved_mean"), (4, "saved_inv_std")):
        value = node.outputs[i]
        if not value.name:
            g.rename(value, f"{node.name or g.y(0).name}_{suffix}")
        if value.type is None:
            g.set_type_like(value, scale)
    return node.outputs[3], node.outputs[4]


def _count_like(g, x, reduced, like=None):
    """Number of elements of x per element of ``reduced``, as a scalar of x's type (``like``'s
    when given: x may be an emitted, untyped value)."""
    like = x if like is None else like
    return g.op("Div", g.cast_like(g.op("Size", x), like), g.cast_like(g.op("Size", reduced), like))


@grad_rule("LayerNormalization", output_inputs={1: (0,), 2: (0,)})  # Mean and InvStdDev read X only
def layer_normalization(g):
    """ONNX Runtime training's LayerNormalizationGrad from the forward node's saved Mean and
    InvStdDev (added to the node when it lacks them), when scale and bias have the normalized
    shape; the standard-op spelling (the lowering's, gradgen/passes/lowering/norm.py) otherwise:
    a broadcast scale or bias, a stash type other than float32, float64 data (the saved float32
    statistics would cost it its precision), or no gradient reaching Y."""
    x, scale, bias = g.x(0), g.x(1), g.x(2)
    rank = _rank(g, x)
    axis = int(g.attr("axis", -1)) % rank
    axes = list(range(axis, rank))
    eps = float(g.attr("epsilon", 1e-5))
    dy = g.dy(0)
    grads = [None] * len(g.node.inputs)
    parts = []
    stats = None  # (xhat, rstd, centered), recomputed in x's type where needed
    if dy is not None and _saved_stats_fit(g, x, scale, bias, axis):
        dx, dscale, dbias = _layer_norm_grad_op(g, axis, rank, bias is not None and g.needs(2))
        if g.needs(0):
            parts.append(dx)
        grads[1] = dscale if g.needs(1) else None
        if bias is not None:
            grads[2] = dbias
    elif dy is not None:
        stats = _stats(g, x, axes, eps)
        xhat, rstd, _ = stats
        if g.needs(0):
            parts.append(normalize_backward(g, g.op("Mul", dy, scale), xhat, rstd, axes))
        if g.needs(1):
            grads[1] = g.unbroadcast(g.op("Mul", dy, xhat), scale, g.y(0), None)
        if bias is not None and g.needs(2):
            grads[2] = g.unbroadcast(dy, bias, g.y(0), None)
    if g.needs(0):
        # Mean/InvStdDev may come in the stash type: bring their gradients to x's type.
        dmean, drstd = (None if g.dy(i) is None else g.cast_like(g.dy(i), x) for i in (1, 2))
        if dmean is not None or drstd is not None:
            _, rstd, centered = stats if stats is not None else _stats(g, x, axes, eps)
            count = _count_like(g, x, rstd)
        if dmean is not None:  # Mean = mean(x): each x gets dMean / n
            parts.append(g.expand_like(g.op("Div", dmean, count), x))
        if drstd is not None:  # d rstd / d x = -rstd^3 * (x - mean) / n
            cube = g.op("Mul", g.op("Mul", rstd, rstd), rstd)
            coef = g.op("Neg", g.op("Div", g.op("Mul", drstd, cube), count))
            parts.append(g.op("Mul", coef, centered))
        if parts:
            grads[0] = g.sum(parts)
    return grads


def _saved_stats_fit(g, x, scale, bias, axis) -> bool:
    """Whether LayerNormalizationGrad fits: float32 statistics (stash_type 1) at least as precise as
    X (float32, float16, bfloat16) and a scale (and bias) of exactly the normalized shape X.shape[axis:],
    of more than one element."""
    if int(g.attr("stash_type", 1)) != 1 or x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
        return False
    x_dims, s_dims = dims_of(x), dims_of(scale)
    if x_dims is None or s_dims is None or list(s_dims) != list(x_dims[axis:]) or None in s_dims:
        return False
    if math.prod(s_dims) == 1:  # the op's contract refuses a one-element normalized part (ORT's too)
        return False
    return bias is None or dims_of(bias) == s_dims


def _layer_norm_grad_op(g, axis, rank, with_bias):
    """(dX, dScale, dBias or None): one LayerNormalizationGrad node reading the forward node's
    Mean and InvStdDev outputs (float32, shape X.shape[:axis] + (1,) * (rank - axis))."""
    x, scale = g.x(0), g.x(1)
    mean, inv_std = _saved_statistics(g, axis, rank)
    y = g.y(0).name
    names = [f"{y}_dX", f"{y}_dscale" if g.needs(1) else "", f"{y}_dbias" if with_bias else ""]
    dx, dscale, dbias = g.op_multi(
        "LayerNormalizationGrad", [g.dy(0), x, scale, mean, inv_std], 3, domain=MICROSOFT, output_names=names, axis=axis
    )
    g.set_type_like(dx, x)
    for out in (dscale, dbias):
        if out.name:
            g.set_type_like(out, scale)
    return dx, (dscale if dscale.name else None), (dbias if dbias.name else None)


def _saved_statistics(g, axis, rank):
    """The forward node's Mean and InvStdDev outputs, named and typed (added when it lacks them)."""
    node, x = g.node, g.x(0)
    if len(node.outputs) < 3:
        node.resize_outputs(3)
    stat_shape = ir.Shape([*dims_of(x)[:axis], *([1] * (rank - axis))])
    for i, suffix in ((1, "Mean"), (2, "InvStdDev")):
        value = node.outputs[i]
        if not value.name:
            g.rename(value, f"{node.name or g.y(0).name}_{suffix}")
        if value.type is None:
            value.type = ir.TensorType(ir.DataType.FLOAT)
        if value.shape is None:
            value.shape = stat_shape
    return node.outputs[1], node.outputs[2]


@grad_rule("InstanceNormalization")
def instance_normalization(g):
    x, scale = g.x(0), g.x(1)
    if g.rank(x) is None:
        return _instance_normalization_any_rank(g)
    rank = _rank(g, x)
    eps = float(g.attr("epsilon", 1e-5))
    dy = g.dy()
    xhat, rstd, _ = _stats(g, x, list(range(2, rank)), eps)
    grads = [None] * 3
    if g.needs(0):
        dxhat = g.op("Mul", dy, per_channel(g, scale, rank))
        grads[0] = normalize_backward(g, dxhat, xhat, rstd, list(range(2, rank)))
    channel_axes = [0] + list(range(2, rank))
    if g.needs(1):
        grads[1] = g.reduce_sum(g.op("Mul", dy, xhat), channel_axes, keepdims=0)
    if g.needs(2):
        grads[2] = g.reduce_sum(dy, channel_axes, keepdims=0)
    return grads


def _instance_normalization_any_rank(g):
    """InstanceNormalization when shape inference left X's rank unknown (e.g. downstream of an
    Unsqueeze whose axes come from a Range): X and dY are viewed as (N, C, -1)."""
    x, scale = g.x(0), g.x(1)
    eps = float(g.attr("epsilon", 1e-5))
    flat = g.ints([0, 0, -1])
    x3, dy3 = g.reshape(x, flat), g.reshape(g.dy(), flat)
    xhat, rstd, _ = _stats(g, x3, [2], eps, like=x)
    return _rows_affine_grads(g, x, dy3, scale, [1], xhat, rstd)


def _rows_affine_grads(g, x, dy3, scale, scale_axes, xhat, rstd):
    """[dX, dScale, dBias] of Y = xhat * scale + bias with X viewed as (N, K, L), normalised over
    L (xhat, rstd), scale and bias per K (``g.unsqueeze(scale, scale_axes)`` broadcasts it); dY is
    ``dy3`` in that view, dX comes back in X's shape."""
    grads = [None] * 3
    if g.needs(0):
        dxhat = g.op("Mul", dy3, g.unsqueeze(scale, scale_axes))
        grads[0] = g.reshape_like(normalize_backward(g, dxhat, xhat, rstd, [2]), x)
    if g.needs(1):
        grads[1] = g.reduce_sum(g.op("Mul", dy3, xhat), [0, 2], keepdims=0)
    if g.needs(2):
        grads[2] = g.reduce_sum(dy3, [0, 2], keepdims=0)
    return grads


@grad_rule("GroupNormalization")
def group_normalization(g):
    """Scale/bias per group (opset 18 form) or per channel (opset 21 form).

    The form is read from the static length of scale when known (as the kernel does), else from
    the opset (21 and later: per channel).
    """
    x, scale = g.x(0), g.x(1)
    rank = _rank(g, x)
    groups = int(g.attr("num_groups"))
    eps = float(g.attr("epsilon", 1e-5))
    dy = g.dy()
    per_group = _per_group_form(g, x, scale, groups)
    grouped_shape = g.ints([0, groups, -1])
    xg = g.reshape(x, grouped_shape)
    xhat, rstd, _ = _stats(g, xg, [2], eps, like=x)
    if per_group:
        return _rows_affine_grads(g, x, g.reshape(dy, grouped_shape), scale, [0, 2], xhat, rstd)
    grads = [None] * 3
    channel_axes = [0] + list(range(2, rank))
    if g.needs(0):
        dxhat = g.reshape(g.op("Mul", dy, per_channel(g, scale, rank)), grouped_shape)
        grads[0] = g.reshape_like(normalize_backward(g, dxhat, xhat, rstd, [2]), x)
    if g.needs(1):
        grads[1] = g.reduce_sum(g.op("Mul", dy, g.reshape_like(xhat, x)), channel_axes, keepdims=0)
    if g.needs(2):
        grads[2] = g.reduce_sum(dy, channel_axes, keepdims=0)
    return grads


def _per_group_form(g, x, scale, groups) -> bool:
    x_dims, s_dims = dims_of(x), dims_of(scale)
    channels = x_dims[1] if x_dims and len(x_dims) > 1 else None
    length = s_dims[0] if s_dims and len(s_dims) == 1 else None
    if isinstance(length, int) and isinstance(channels, int):
        return length == groups and groups != channels
    if isinstance(length, int) and length != groups:
        return False
    return g.opset < 21


def _trailing_axes(g, x, axis: int) -> list[int]:
    """The axes from ``axis`` to the last: negative ones when ``axis`` is negative (no rank needed)."""
    if axis < 0:
        return list(range(axis, 0))
    return list(range(axis, _rank(g, x)))


@grad_rule("RMSNormalization")
def rms_normalization(g):
    """y = x * rstd * scale, rstd = (mean(x^2) + eps)^-1/2 over the axes from ``axis``:
    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)) with dxhat = dy * scale (statistics recomputed
    in x's type)."""
    x, scale = g.x(0), g.x(1)
    axes = _trailing_axes(g, x, int(g.attr("axis", -1)))
    eps = float(g.attr("epsilon", 1e-5))
    dy = g.dy()
    mean_square = g.reduce("ReduceMean", g.op("Mul", x, x), axes, keepdims=1)
    rstd = g.op("Reciprocal", g.op("Sqrt", g.op("Add", mean_square, g.const_like(x, eps))))
    xhat = g.op("Mul", x, rstd)
    grads = [None, None]
    if g.needs(0):
        dxhat = g.op("Mul", dy, scale)
        mean_dx = g.reduce("ReduceMean", g.op("Mul", dxhat, xhat), axes, keepdims=1)
        grads[0] = g.op("Mul", rstd, g.op("Sub", dxhat, g.op("Mul", xhat, mean_dx)))
    if g.needs(1):
        grads[1] = g.unbroadcast(g.op("Mul", dy, xhat), scale, g.y(0), None)
    return grads


@grad_rule("LpNormalization")
def lp_normalization(g):
    """y = x / n along ``axis``, n = sum|x| (p=1) or sqrt(sum x^2) (p=2); y = 0 where n = 0:
    dx = (dy - d|x|^p/dx-direction * sum(dy * y)) / n with that direction sign(x) (p=1) or y (p=2),
    and 0 where n = 0 (as y is)."""
    x, y, dy = g.x(0), g.y(0), g.dy()
    axis, p = int(g.attr("axis", -1)), int(g.attr("p", 2))
    if p not in (1, 2):
        raise ModelError(f"LpNormalization node {g.node.name!r}: p must be 1 or 2, got {p}")
    if p == 1:
        norm, direction = g.reduce_sum(g.op("Abs", x), [axis], keepdims=1), g.op("Sign", x)
    else:
        norm, direction = g.op("Sqrt", g.reduce_sum(g.op("Mul", x, x), [axis], keepdims=1)), y
    zero = g.op("Equal", norm, g.const_like(x, 0.0))
    inv = g.op("Where", zero, g.const_like(x, 0.0), g.op("Reciprocal", g.op("Where", zero, g.const_like(x, 1.0), norm)))
    along = g.reduce_sum(g.op("Mul", dy, y), [axis], keepdims=1)
    return [g.op("Mul", g.op("Sub", dy, g.op("Mul", direction, along)), inv)]


@grad_rule("MeanVarianceNormalization")
def mean_variance_normalization(g):
    """y = c / d, c = x - mean, d = s + 1e-9, s = sqrt(mean(c^2)) (ONNX's function body, with the
    variance as the kernels take it: the body's mean(x^2) - mean^2 cancels) over ``axes``:
    dx = (dy - mean(dy)) / d - c * mean(dy * c) / (d^2 s). Where s is 0 (a constant line: c is 0
    too) the second term is 0, its limit, not 0 / 0."""
    x, dy = g.x(0), g.dy()
    axes = [int(a) for a in g.attr("axes", [0, 2, 3])]
    centered = g.op("Sub", x, g.reduce("ReduceMean", x, axes, keepdims=1))
    std = g.op("Sqrt", g.reduce("ReduceMean", g.op("Mul", centered, centered), axes, keepdims=1))
    denom = g.op("Add", std, g.const_like(x, 1e-9))
    first = g.op("Div", g.op("Sub", dy, g.reduce("ReduceMean", dy, axes, keepdims=1)), denom)
    spread = g.reduce("ReduceMean", g.op("Mul", dy, centered), axes, keepdims=1)
    flat = g.op("Equal", std, g.const_like(x, 0.0))
    scale = g.op("Where", flat, g.const_like(x, 1.0), g.op("Mul", g.op("Mul", denom, denom), std))
    second = g.op("Div", g.op("Mul", centered, spread), scale)
    return [g.op("Sub", first, second)]


def _channel_window_sum(g, v, rank: int, front: int, back: int, size: int):
    """sum_{t < size} v_pad[:, c + t] along axis 1, v_pad = v padded with ``front`` / ``back`` zero
    channels: LRN's window sum (front = (size-1)//2) and its transpose (front and back swapped)."""
    pads = [0] * (2 * rank)
    pads[1], pads[rank + 1] = front, back
    padded = g.op("Pad", v, g.ints(pads)) if front or back else v
    parts = []
    for t in range(size):
        end = -(size - 1 - t) if t < size - 1 else INT64_MAX
        parts.append(g.op("Slice", padded, g.ints([t]), g.ints([end]), g.ints([1])))
    return g.sum(parts)


@grad_rule("LRN")
def lrn(g):
    """y = x * D^-beta, D = bias + alpha / size * S, S_c the sum of x^2 over the channels
    [c - (size-1)//2, c + ceil((size-1)/2)]: dx = dy * D^-beta - 2 alpha beta / size * x * T, T the
    sum of u = dy * y / D over the transposed window."""
    x, y, dy = g.x(0), g.y(0), g.dy()
    rank = _rank(g, x)
    size = int(g.attr("size"))
    alpha, beta, bias = float(g.attr("alpha", 1e-4)), float(g.attr("beta", 0.75)), float(g.attr("bias", 1.0))
    before, after = (size - 1) // 2, size // 2
    square_sum = _channel_window_sum(g, g.op("Mul", x, x), rank, before, after, size)
    denom = g.op("Add", g.const_like(x, bias), g.op("Mul", g.const_like(x, alpha / size), square_sum))
    direct = g.op("Mul", dy, g.op("Pow", denom, g.const_like(x, -beta)))
    u = g.op("Div", g.op("Mul", dy, y), denom)
    spread = _channel_window_sum(g, u, rank, after, before, size)
    return [g.op("Sub", direct, g.op("Mul", g.const_like(x, 2 * alpha * beta / size), g.op("Mul", x, spread)))]


@grad_rule("LayerNormalizationGrad", domain=MICROSOFT)
def layer_normalization_grad(g):
    """LayerNormalizationGrad(dY, X, scale, mean, inv_std) -> (dX, dScale, dBias), differentiated
    again (a backward graph's gradient). With s = inv_std, xhat = (X - mean) s, h = dY scale over the
    normalized axes R and the leading axes L:

        dX = s (h - mean_R(h) - xhat mean_R(h xhat)),  dScale = sum_L(dY xhat),  dBias = sum_L(dY)

    It is linear in dY but not in X, mean or s: this is its vector-Jacobian product written out,
    for incoming gradients P, Q, B of dX, dScale, dBias. mean and inv_std are inputs in their own
    right (LayerNormalization's rule carries their gradients on to X)."""
    return _layer_norm_grad_vjp(g, simplified=False)


@grad_rule("SimplifiedLayerNormalizationGrad", domain=MICROSOFT)
def simplified_layer_normalization_grad(g):
    """SimplifiedLayerNormalizationGrad(dY, X, scale, inv_std) -> (dX, dScale) of the RMS norm,
    differentiated again: LayerNormalizationGrad's product with mean 0 and no mean_R(h) term,
    dX = s (h - xhat mean_R(h xhat)), xhat = X s."""
    return _layer_norm_grad_vjp(g, simplified=True)


@grad_rule("BatchNormalizationGrad", domain=MICROSOFT)
def batch_normalization_grad(g):
    """BatchNormalizationGrad(dY, X, scale, mean, inv_std) -> (dX, dScale, dBias), differentiated
    again: LayerNormalizationGrad's product with the normalized axes R = every axis but 1 (the
    channel), dScale and dBias summed over R too, and scale, mean and inv_std per channel."""
    return _layer_norm_grad_vjp(g, simplified=False, by_channel=True)


def _layer_norm_grad_vjp(g, simplified: bool, by_channel: bool = False) -> list:
    """The vector-Jacobian product of (Simplified)LayerNormalizationGrad (see layer_normalization_grad)
    and, ``by_channel``, of BatchNormalizationGrad."""
    if simplified:
        dy, x, scale, inv_std = (g.x(i) for i in range(4))
        mean, b = None, None
    else:
        dy, x, scale, mean, inv_std = (g.x(i) for i in range(5))
        b = g.dy(2)
    p, q = g.dy(0), g.dy(1)
    rank = _rank(g, x)
    if by_channel:  # (C,) vectors along axis 1; their gradients summed to (C,)
        norm_axes = lead_axes = [0, *range(2, rank)]
        keep = 0

        def wide(v):
            return None if v is None else per_channel(g, v, rank)
    else:  # mean and inv_std keep the normalized axes as 1s; scale and B broadcast as they are
        axis = int(g.attr("axis", -1)) % rank
        norm_axes, lead_axes = list(range(axis, rank)), list(range(axis))
        keep = 1

        def wide(v):
            return v

    q, b = wide(q), wide(b)
    s = g.cast_like(wide(inv_std), x)
    centered = x if mean is None else g.op("Sub", x, g.cast_like(wide(mean), x))
    xhat = g.op("Mul", centered, s)
    h = g.op("Mul", dy, wide(scale))
    d_dy, d_h, d_xhat, d_s = [], [], [], []
    if b is not None:
        d_dy.append(b)
    if q is not None:
        d_dy.append(g.op("Mul", q, xhat))
        d_xhat.append(g.op("Mul", q, dy))
    if p is not None:
        mean_hx = g.reduce("ReduceMean", g.op("Mul", h, xhat), norm_axes, keepdims=1)
        ps = g.op("Mul", p, s)
        mean_psx = g.reduce("ReduceMean", g.op("Mul", ps, xhat), norm_axes, keepdims=1)
        if simplified:
            d_h.append(g.op("Sub", ps, g.op("Mul", xhat, mean_psx)))
            inner = g.op("Sub", h, g.op("Mul", xhat, mean_hx))
        else:
            d_h.append(normalize_backward(g, p, xhat, s, norm_axes))
            mean_h = g.reduce("ReduceMean", h, norm_axes, keepdims=1)
            inner = g.op("Sub", g.op("Sub", h, mean_h), g.op("Mul", xhat, mean_hx))
        d_xhat.append(g.op("Neg", g.op("Add", g.op("Mul", ps, mean_hx), g.op("Mul", mean_psx, h))))
        d_s.append(g.reduce_sum(g.op("Mul", p, inner), norm_axes, keepdims=keep))
    grads: list = [None] * len(g.node.inputs)
    if d_h:  # h = dY scale
        grad_h = d_h[0]
        d_dy.append(g.op("Mul", grad_h, wide(scale)))
        if g.needs(2):
            summed = g.op("Mul", grad_h, dy)
            summed = g.reduce_sum(summed, lead_axes, keepdims=0) if lead_axes else summed
            grads[2] = g.reshape_like(summed, scale)
    elif g.needs(2):
        grads[2] = g.zeros_like(scale)
    if g.needs(0):
        grads[0] = g.sum(d_dy) if len(d_dy) > 1 or b is None else g.expand_like(b, dy)  # B alone: scale's shape
    grad_xhat = g.sum(d_xhat) if d_xhat else None
    grad_x = g.op("Mul", grad_xhat, s) if grad_xhat is not None else None  # xhat = (X - mean) s
    if g.needs(1):
        grads[1] = grad_x if grad_x is not None else g.zeros_like(x)
    if mean is not None and g.needs(3):
        grads[3] = (
            g.cast_like(g.op("Neg", g.reduce_sum(grad_x, norm_axes, keepdims=keep)), mean)
            if grad_x is not None
            else g.zeros_like(mean)
        )
    s_index = 3 if simplified else 4
    if g.needs(s_index):
        if grad_xhat is not None:
            d_s.append(g.reduce_sum(g.op("Mul", grad_xhat, centered), norm_axes, keepdims=keep))
        grads[s_index] = g.cast_like(g.sum(d_s), inv_std) if d_s else g.zeros_like(inv_std)
    return grads


@grad_rule("SkipLayerNormalization", "SkipSimplifiedLayerNormalization", domain=MICROSOFT)
@grad_rule("SimplifiedLayerNormalization")
def fused_layer_normalization(g):
    """ONNX Runtime's fused normalizations: differentiated in their standard-op form
    (gradgen.grads.rules.elementwise.left_in_place)."""
    from gradgen.grads.rules.elementwise import left_in_place

    raise left_in_place(g)
