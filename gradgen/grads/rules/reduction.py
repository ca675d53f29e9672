"""Gradient rules: reductions (Reduce*), Softmax/LogSoftmax, CumSum, CumProd and TopK.

Every Reduce* rule first brings the output gradient (and, where needed, the output) back to the
"keepdims" layout, where each reduced axis has size 1, so that it broadcasts against the input.
The reduction's axes come from the ``axes`` attribute (ReduceSum < 13, the others < 18) or from the
optional second input; no axes reduce everything, unless ``noop_with_empty_axes`` is set, in
which case the op is the elementwise part alone (abs, square, log...) and every formula below
holds with "reduce over nothing" = identity. Axes given by a non-constant input are used as they
come (Unsqueeze/ReduceSum take them as inputs); such an input must not be empty at run time when
keepdims=0.

Choices at kinks: ReduceMax/ReduceMin split the gradient evenly among tied extrema (as PyTorch's
amax/amin do); ReduceProd gives the exact product of the other elements, zeros included;
ReduceL2 gives 0 where the whole slice is 0; ReduceL1 gives sign(x) (0 at 0).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import INT64_MAX, MICROSOFT, dims_of, is_static
from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule, non_differentiable

_ALL = "all"
_NOOP = "noop"


class _Axes:
    """The reduced axes of one Reduce* node: ``_ALL``, ``_NOOP``, a static list, or an ir.Value."""

    def __init__(self, g):
        self.g = g
        self.keepdims = int(g.attr("keepdims", 1))
        as_input = g.opset >= (13 if g.node.op_type == "ReduceSum" else 18)
        if not as_input:
            axes = g.attr("axes")
            self.axes = _ALL if not axes else [int(a) for a in axes]
            return
        noop = int(g.attr("noop_with_empty_axes", 0))
        if g.x(1) is None:
            self.axes = _NOOP if noop else _ALL
            return
        const = g.input_const(1)
        if const is None:
            self.axes = g.x(1)  # dynamic: known at run time only
        elif const.size == 0:
            self.axes = _NOOP if noop else _ALL
        else:
            self.axes = [int(a) for a in np.asarray(const).reshape(-1)]

    def keep(self, v: ir.Value) -> ir.Value:
        """v (shaped like the node's output) in keepdims layout, broadcastable against the input."""
        if self.keepdims or self.axes in (_ALL, _NOOP):
            return v  # a reduce-all without keepdims is a scalar, which broadcasts as it is
        g = self.g
        if isinstance(self.axes, ir.Value):
            return g.op("Unsqueeze", v, self.axes)
        rank = g.rank(g.x(0))
        axes = sorted(a % rank for a in self.axes) if rank is not None else self.axes
        return g.unsqueeze(v, axes)

    def reduce(self, op_type: str, v: ir.Value) -> ir.Value:
        """op_type over the node's axes, keepdims=1 (identity for a no-op reduction)."""
        if self.axes == _NOOP:
            return v
        return self.g.reduce(op_type, v, None if self.axes == _ALL else self.axes, keepdims=1)


def _expand(g, v, x):
    return g.expand_like(v, x)


@grad_rule("ReduceSum", nondiff_inputs=(1,))
def reduce_sum(g):
    ax = _Axes(g)
    return [_expand(g, ax.keep(g.dy()), g.x(0))]


@grad_rule("ReduceMean", nondiff_inputs=(1,))
def reduce_mean(g):
    ax = _Axes(g)
    x, y = g.x(0), g.y()
    dx = _expand(g, ax.keep(g.dy()), x)
    xd, yd = dims_of(x), dims_of(y)
    if ax.axes == _NOOP:
        return [dx]
    if is_static(xd) and is_static(yd):
        count = max(1, int(np.prod(xd, dtype=np.int64)) // max(1, int(np.prod(yd, dtype=np.int64))))
        scale = g.const_like(x, 1.0 / count)
    else:
        scale = g.op("Div", g.cast_like(g.op("Size", y), x), g.cast_like(g.op("Size", x), x))
    return [g.op("Mul", dx, scale)]


@grad_rule("ReduceMax", "ReduceMin", nondiff_inputs=(1,))
def reduce_max_min(g):
    ax = _Axes(g)
    x = g.x(0)
    mask = g.cast_like(g.op("Equal", x, ax.keep(g.y())), x)
    count = ax.reduce("ReduceSum", mask)  # ties share the gradient evenly
    share = g.op("Div", ax.keep(g.dy()), count)
    return [g.op("Mul", mask, share)]


@grad_rule("ReduceProd", nondiff_inputs=(1,))
def reduce_prod(g):
    # d prod / d x_i = product of the other elements, computed without dividing by a zero:
    # no zero in the slice: P / x_i; one zero: P_nonzero at the zero, 0 elsewhere; more: 0.
    ax = _Axes(g)
    x = g.x(0)
    zero, one = g.const_like(x, 0.0), g.const_like(x, 1.0)
    is_zero = g.op("Equal", x, zero)
    x_safe = g.op("Where", is_zero, one, x)
    prod_nonzero = ax.reduce("ReduceProd", x_safe)
    zeros = ax.reduce("ReduceSum", g.cast_like(is_zero, x))
    at_zero = g.op("Where", g.op("Equal", zeros, one), prod_nonzero, zero)
    elsewhere = g.op("Where", g.op("Equal", zeros, zero), g.op("Div", prod_nonzero, x_safe), zero)
    others = g.op("Where", is_zero, at_zero, elsewhere)
    return [g.op("Mul", ax.keep(g.dy()), others)]


@grad_rule("ReduceL1", nondiff_inputs=(1,))
def reduce_l1(g):
    ax = _Axes(g)
    return [g.op("Mul", ax.keep(g.dy()), g.op("Sign", g.x(0)))]


@grad_rule("ReduceL2", nondiff_inputs=(1,))
def reduce_l2(g):
    ax = _Axes(g)
    x = g.x(0)
    norm = ax.keep(g.y())
    safe = g.op("Where", g.op("Equal", norm, g.const_like(x, 0.0)), g.const_like(x, 1.0), norm)
    return [g.op("Mul", g.op("Div", ax.keep(g.dy()), safe), x)]


@grad_rule("ReduceSumSquare", nondiff_inputs=(1,))
def reduce_sum_square(g):
    ax = _Axes(g)
    x = g.x(0)
    return [g.op("Mul", ax.keep(g.dy()), g.op("Mul", x, g.const_like(x, 2.0)))]


@grad_rule("ReduceLogSum", nondiff_inputs=(1,))
def reduce_log_sum(g):
    ax = _Axes(g)
    x = g.x(0)
    total = ax.reduce("ReduceSum", x)
    return [_expand(g, g.op("Div", ax.keep(g.dy()), total), x)]


@grad_rule("ReduceLogSumExp", nondiff_inputs=(1,))
def reduce_log_sum_exp(g):
    ax = _Axes(g)
    x = g.x(0)
    softmax = g.op("Exp", g.op("Sub", x, ax.keep(g.y())))
    return [g.op("Mul", ax.keep(g.dy()), softmax)]


def _softmax_axes(g) -> list[int]:
    """The axis Softmax/LogSoftmax normalise over (opset 13 form; older models are upgraded)."""
    return [int(g.attr("axis", -1))]


_FUSED_SOFTMAX_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE)


def _fused_softmax_grad(g, op_type: str) -> ir.Value | None:
    """dX as one ONNX Runtime training SoftmaxGrad_13 / LogSoftmaxGrad_13 node (--portable lowers
    it), for the float types its kernels take; None for others."""
    y = g.y()
    if y.dtype not in _FUSED_SOFTMAX_TYPES:
        return None
    dx = g.op(op_type, g.dy(), y, domain=MICROSOFT, axis=_softmax_axes(g)[0])
    return g.set_type_like(dx, y)


@grad_rule("Softmax")
def softmax(g):
    fused = _fused_softmax_grad(g, "SoftmaxGrad_13")
    if fused is not None:
        return [fused]
    y, dy = g.y(), g.dy()
    inner = g.reduce_sum(g.op("Mul", dy, y), _softmax_axes(g), keepdims=1)
    return [g.op("Mul", y, g.op("Sub", dy, inner))]


@grad_rule("LogSoftmax")
def log_softmax(g):
    fused = _fused_softmax_grad(g, "LogSoftmaxGrad_13")
    if fused is not None:
        return [fused]
    y, dy = g.y(), g.dy()
    total = g.reduce_sum(dy, _softmax_axes(g), keepdims=1)
    return [g.op("Sub", dy, g.op("Mul", g.op("Exp", y), total))]


@grad_rule("CumSum", nondiff_inputs=(1,))
def cum_sum(g):
    # The adjoint of a (reverse) cumulative sum is the cumulative sum the other way round,
    # with the same exclusive flag.
    exclusive, reverse = int(g.attr("exclusive", 0)), int(g.attr("reverse", 0))
    return [g.op("CumSum", g.dy(), g.x(1), exclusive=exclusive, reverse=1 - reverse)]


@grad_rule("CumProd", nondiff_inputs=(1,))
def cum_prod(g):
    """dX_i = sum_{j >= i} dY_j prod_{k <= j, k != i} X_k (j, k in the scan's order), without dividing
    by a zero: before the first zero of a line it is the reverse cumulative sum of dY * Y over X_i;
    at the first zero, the reverse cumulative sum of dY times the product with that zero taken as 1;
    after it, 0 (every product holds the zero). An exclusive product is the inclusive one shifted by
    one step, so its dY shifts back first."""
    x, axis, dy = g.x(0), g.x(1), g.dy()
    reverse = int(g.attr("reverse", 0))
    axes = g.reshape(g.op("Cast", axis, to=ir.DataType.INT64), [1])
    if int(g.attr("exclusive", 0)):
        # dY of the inclusive product: step m gets the exclusive dY of the step after it (in scan order)
        pads, start, end = ([0, 1], 1, INT64_MAX) if not reverse else ([1, 0], 0, -1)
        padded = g.op("Pad", dy, g.ints(pads), None, axes)
        dy = g.op("Slice", padded, g.ints([start]), g.ints([end]), axes)
    zero, one = g.const_like(x, 0.0), g.const_like(x, 1.0)
    zeros_so_far = g.op("CumSum", g.cast_like(g.op("Equal", x, zero), x), axis, reverse=reverse)
    before = g.op("Equal", zeros_so_far, zero)  # no zero at or before this step
    first = g.op("And", g.op("Equal", x, zero), g.op("Equal", zeros_so_far, one))

    def sum_from_here(v):  # sum over this step and the ones after it, in scan order
        return g.op("CumSum", v, axis, reverse=1 - reverse)

    product = g.op("CumProd", x, axis, reverse=reverse)
    ahead = g.op("Div", sum_from_here(g.op("Mul", dy, product)), g.op("Where", before, x, one))
    without_zero = g.op("CumProd", g.op("Where", first, one, x), axis, reverse=reverse)
    at_zero = sum_from_here(g.op("Mul", dy, without_zero))
    return [g.op("Where", before, ahead, g.op("Where", first, at_zero, g.zeros_like(x)))]


@grad_rule("TopK", nondiff_inputs=(1,))
def top_k(g):
    # Scatter the values' gradient back to where the values came from (indices are distinct).
    x, dy = g.x(0), g.dy(0)
    axis = int(g.attr("axis", -1))
    reduction = "add" if g.opset >= 16 else None
    dx = g.op("ScatterElements", g.zeros_like(x), g.y(1), dy, axis=axis, reduction=reduction)
    return [dx, None]


# Ops whose outputs never carry a gradient: indices, and Hardmax's one-hot of the arg-max, piecewise
# constant in its input (its gradient is zero wherever it exists). TfIdfVectorizer's output counts
# n-grams of integer ids (weighted by an attribute): it has no float input.
non_differentiable("ArgMax", "ArgMin", "Hardmax", "TfIdfVectorizer")


@grad_rule("SoftmaxGrad_13", domain=MICROSOFT)
def softmax_grad_13(g):
    """dX = Y (dY - s), s = sum(dY Y) over the axis (ONNX Runtime training's, differentiated again).
    With P the incoming gradient and t = sum(P Y): d dY = Y (P - t), self-adjoint in dY;
    d Y = P (dY - s) - dY t."""
    return _softmax_grad_vjp(g, _softmax_axes(g))


@grad_rule("SoftmaxGrad", domain=MICROSOFT)
def softmax_grad(g):
    """SoftmaxGrad (Softmax before opset 13: the input coerced to 2-D at ``axis``, so the sums run
    over every axis from it): SoftmaxGrad_13's product over those axes."""
    return _softmax_grad_vjp(g, _coerced_axes(g))


def _softmax_grad_vjp(g, axes: list[int]) -> list:
    dy, y, p = g.x(0), g.x(1), g.dy()
    t = g.reduce_sum(g.op("Mul", p, y), axes, keepdims=1)
    d_dy = g.op("Mul", y, g.op("Sub", p, t)) if g.needs(0) else None
    d_y = None
    if g.needs(1):
        s = g.reduce_sum(g.op("Mul", dy, y), axes, keepdims=1)
        d_y = g.op("Sub", g.op("Mul", p, g.op("Sub", dy, s)), g.op("Mul", dy, t))
    return [d_dy, d_y]


@grad_rule("LogSoftmaxGrad_13", domain=MICROSOFT)
def log_softmax_grad_13(g):
    """dX = dY - exp(Y) sum(dY) over the axis, Y LogSoftmax's output (ONNX Runtime training's,
    differentiated again). With P the incoming gradient: d dY = P - sum(P exp(Y)); d Y = -P exp(Y) sum(dY)."""
    return _log_softmax_grad_vjp(g, _softmax_axes(g))


@grad_rule("LogSoftmaxGrad", domain=MICROSOFT)
def log_softmax_grad(g):
    """LogSoftmaxGrad (LogSoftmax before opset 13): LogSoftmaxGrad_13's product over the axes from ``axis``."""
    return _log_softmax_grad_vjp(g, _coerced_axes(g))


def _log_softmax_grad_vjp(g, axes: list[int]) -> list:
    dy, y, p = g.x(0), g.x(1), g.dy()
    e = g.op("Exp", y)
    d_dy = g.op("Sub", p, g.reduce_sum(g.op("Mul", p, e), axes, keepdims=1)) if g.needs(0) else None
    d_y = g.op("Neg", g.op("Mul", g.op("Mul", p, e), g.reduce_sum(dy, axes, keepdims=1))) if g.needs(1) else None
    return [d_dy, d_y]


def _coerced_axes(g) -> list[int]:
    """The axes a Softmax below opset 13 normalises over: every axis from ``axis`` (default 1)."""
    rank = g.rank(g.x(1))
    if rank is None:
        raise ModelError(f"{g.node.op_type} node {g.node.name!r}: the rank of Y is unknown; its gradient needs it")
    return list(range(int(g.attr("axis", 1)) % max(rank, 1), rank))
