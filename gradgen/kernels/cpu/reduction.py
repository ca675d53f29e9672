"""CPU kernels: reductions, arg-reductions, CumSum/CumProd, Softmax/LogSoftmax/Hardmax and TopK.

The Reduce* ops take ``axes`` as an attribute in older opsets (ReduceSum < 13, the others < 18)
and as an optional second input later; both forms bind to the kernel's ``axes`` parameter.
Every reduction keeps the input's dtype, as the spec says.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.prepared import constant_inputs, per_shape
from gradgen.kernels.numeric import accumulation_dtype, same_shape
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.axes import normalize_axis
from gradgen.ops.schemas import FLOATS, Attribute, Formal, Schema


def reduce_axes(data: np.ndarray, axes, noop_with_empty_axes: int) -> tuple[int, ...] | None:
    """The normalised axes to reduce; () reduces nothing (noop_with_empty_axes)."""
    axes = None if axes is None else np.asarray(axes)
    if axes is None or axes.size == 0:
        return () if noop_with_empty_axes else tuple(range(data.ndim))
    return _normalised_axes(data.ndim, tuple(axes.reshape(-1).tolist()))


@functools.lru_cache(maxsize=1024)
def _normalised_axes(rank: int, axes: tuple) -> tuple[int, ...]:
    """Sorted, in-range, distinct reduction axes; worked out once per (rank, axes), errors not cached."""
    values = [int(a) for a in axes]
    normalised = tuple(normalize_axis(a, rank, "reduction axis") for a in values)
    if len(set(normalised)) != len(normalised):
        raise KernelError(f"repeated reduction axes {values}")
    return tuple(sorted(normalised))


def _reducer(name: str, fn, pre=None, post=None):
    """A Reduce* kernel: out = post(fn(pre(data), axes)), cast back to data's dtype."""

    def kernel(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        # No axes with noop_with_empty_axes=1 reduces nothing: the elementwise part (square,
        # abs, log...) still applies, as in the ONNX reference implementation.
        reduce_over = reduce_axes(data, axes, noop_with_empty_axes)
        x = pre(data) if pre is not None else data
        out = fn(x, reduce_over, bool(keepdims))
        if post is not None:
            out = post(out)
        return np.asarray(out).astype(data.dtype, copy=False)

    kernel.__name__ = name
    return kernel


def _reducer_preparer(fn, pre=None, post=None):
    """The preparer of a ``_reducer`` kernel: its axes (constant input or attribute) normalised once
    per input rank; then the same calls as the kernel."""

    def prepare(constants: tuple, attrs: dict):
        given = constant_inputs(constants, 1)
        if given is None:
            return None
        axes = given[0] if given[0] is not None else attrs.get("axes")
        keepdims, noop = bool(attrs.get("keepdims", 1)), attrs.get("noop_with_empty_axes", 0)

        def axes_for(shape: tuple) -> tuple | None:
            return reduce_axes(np.empty((0,) * len(shape)), axes, noop)

        over = per_shape(axes_for)

        def run(data, axes=None):
            x = pre(data) if pre is not None else data
            out = fn(x, over(data.shape), keepdims)
            if post is not None:
                out = post(out)
            return np.asarray(out).astype(data.dtype, copy=False)

        return run

    return prepare


def _identity_for(dtype: np.dtype, largest: bool):
    if dtype.kind == "f":
        return -np.inf if largest else np.inf
    if dtype.kind == "b":
        return False if largest else True
    info = np.iinfo(dtype)
    return info.min if largest else info.max


def _max(x, axes, keepdims):
    return np.max(x, axis=axes, keepdims=keepdims, initial=_identity_for(x.dtype, True))


def _min(x, axes, keepdims):
    return np.min(x, axis=axes, keepdims=keepdims, initial=_identity_for(x.dtype, False))


def _sum(x, axes, keepdims):
    return np.add.reduce(x, axis=axes, keepdims=keepdims, dtype=x.dtype)  # np.sum without its Python wrapper


def mean_over(x, axes, keepdims):
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        return np.full(np.sum(x, axis=axes, keepdims=keepdims).shape, np.nan)
    if x.dtype.kind in "iu":
        # Integer means truncate toward zero (the reference computes in float and casts back).
        return np.mean(x, axis=axes, keepdims=keepdims, dtype=np.float64)
    # np.mean's own steps (numpy/_core/_methods.py, _mean, with dtype given) without its Python layers
    # (a third of a small ReduceMean's time); the result is the same to the bit.
    total = np.add.reduce(x, axis=axes, dtype=x.dtype, keepdims=keepdims)
    if isinstance(total, np.ndarray):
        return np.true_divide(total, np.intp(count), out=total, casting="unsafe")
    return total.dtype.type(total / np.intp(count))


def _prod(x, axes, keepdims):
    return np.prod(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _log_sum_exp(x, axes, keepdims):
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):  # an empty or all -inf slice gives -inf
        out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axes)


def _square(x):
    return x * x


def _reduction(op_type: str, name: str, fn, pre=None, post=None):
    """Register a Reduce* op's kernel and its preparer."""
    cpu_prepare(op_type)(_reducer_preparer(fn, pre, post))
    return cpu_kernel(op_type)(_reducer(name, fn, pre, post))


reduce_sum = _reduction("ReduceSum", "reduce_sum", _sum)
reduce_mean = _reduction("ReduceMean", "reduce_mean", mean_over)
reduce_max = _reduction("ReduceMax", "reduce_max", _max)
reduce_min = _reduction("ReduceMin", "reduce_min", _min)
reduce_prod = _reduction("ReduceProd", "reduce_prod", _prod)
reduce_l1 = _reduction("ReduceL1", "reduce_l1", _sum, pre=np.abs)
reduce_l2 = _reduction("ReduceL2", "reduce_l2", _sum, pre=_square, post=np.sqrt)
reduce_sum_square = _reduction("ReduceSumSquare", "reduce_sum_square", _sum, pre=_square)
reduce_log_sum = _reduction("ReduceLogSum", "reduce_log_sum", _sum, post=np.log)
reduce_log_sum_exp = _reduction("ReduceLogSumExp", "reduce_log_sum_exp", _log_sum_exp)


def _arg(fn, data, axis, keepdims, select_last_index):
    axis = normalize_axis(axis, data.ndim)
    if data.shape[axis] == 0:
        raise KernelError(f"cannot take the arg-reduction of an empty axis {axis}")
    if select_last_index:
        flipped = np.flip(data, axis=axis)
        out = data.shape[axis] - 1 - fn(flipped, axis=axis)
    else:
        out = fn(data, axis=axis)
    out = out.astype(np.int64)
    return np.expand_dims(out, axis) if keepdims else out


@cpu_kernel("ArgMax")
def arg_max(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(np.argmax, data, axis, keepdims, select_last_index)


@cpu_kernel("ArgMin")
def arg_min(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(np.argmin, data, axis, keepdims, select_last_index)


def _cumulative(fn, identity, x, axis, exclusive, reverse):
    if np.size(axis) != 1:
        raise KernelError(f"axis must be a scalar, got shape {list(np.shape(axis))}")
    ax = normalize_axis(int(np.asarray(axis).reshape(-1)[0]), x.ndim)
    data = np.flip(x, axis=ax) if reverse else x
    out = fn(data, axis=ax, dtype=x.dtype)
    if exclusive and out.shape[ax]:
        first = np.full_like(np.take(out, [0], axis=ax), identity)
        out = np.concatenate([first, np.take(out, np.arange(out.shape[ax] - 1), axis=ax)], axis=ax)
    return np.flip(out, axis=ax) if reverse else out


@cpu_kernel("CumSum")
def cum_sum(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(np.cumsum, 0, x, axis, exclusive, reverse)


@cpu_kernel("CumProd")
def cum_prod(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(np.cumprod, 1, x, axis, exclusive, reverse)


def _softmax_frame(x: np.ndarray, axis, opset: int):
    """(array to normalise over its last axis, function to restore x's layout)."""
    if opset >= 13:
        ax = normalize_axis(-1 if axis is None else axis, x.ndim)
        if ax == x.ndim - 1:  # already last: skip np.moveaxis' Python work (the arrays are the same)
            return x, _unchanged
        moved = np.moveaxis(x, ax, -1)
        return moved, lambda y: np.moveaxis(y, -1, ax)
    # opset < 13: coerce to 2-D [prod(shape[:axis]), prod(shape[axis:])].
    ax = normalize_axis(1 if axis is None else axis, x.ndim) if x.ndim else 0
    flat = x.reshape(math.prod(x.shape[:ax]), math.prod(x.shape[ax:]))
    return flat, lambda y: y.reshape(x.shape)


def _unchanged(y):
    return y


@cpu_kernel("Softmax")
def softmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    e = np.exp(z - np.maximum.reduce(z, axis=-1, keepdims=True, initial=-np.inf))
    return restore(e / np.add.reduce(e, axis=-1, keepdims=True)).astype(x.dtype, copy=False)


@cpu_kernel("LogSoftmax")
def log_softmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    shifted = z - np.maximum.reduce(z, axis=-1, keepdims=True, initial=-np.inf)
    out = shifted - np.log(np.add.reduce(np.exp(shifted), axis=-1, keepdims=True))
    return restore(out).astype(x.dtype, copy=False)


@cpu_kernel("Hardmax")
def hardmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    out = np.zeros_like(z)
    if z.shape[-1]:
        np.put_along_axis(out, np.argmax(z, axis=-1)[..., None], 1, axis=-1)
    return restore(out)


def top_k_count(k, attrs: dict) -> int:
    """TopK's K: the input (since opset 10) or the attribute (opset 1), one value."""
    if k is None:
        k = attrs.get("k")  # opset 1: k is an attribute
        if k is None:
            raise KernelError("TopK needs K (an input since opset 10)")
    if np.size(k) != 1:
        raise KernelError(f"K must hold one value, got shape {list(np.shape(k))}")
    return int(np.asarray(k).reshape(-1)[0])


@cpu_kernel("TopK")
def top_k(x, k=None, *, axis=-1, largest=1, sorted=1, **attrs):
    k = top_k_count(k, attrs)
    ax = normalize_axis(axis, x.ndim)
    n = x.shape[ax]
    if not 0 <= k <= n:
        raise KernelError(f"K={k} is out of range for axis {ax} of size {n}")
    if largest:
        # Descending order, ties keep the lower index first: stable-sort the reversed axis
        # ascending, then read it backwards.
        order = np.argsort(np.flip(x, axis=ax), axis=ax, kind="stable")
        order = n - 1 - np.flip(order, axis=ax)
    else:
        order = np.argsort(x, axis=ax, kind="stable")
    indices = np.take(order, np.arange(k), axis=ax).astype(np.int64)
    values = np.take_along_axis(x, indices, axis=ax)
    return values, indices


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's softmax gradients (com.microsoft)


def _softmax_axes(Y, axis: int, opset13: bool):
    """The reduction axes: the one axis (opset 13 semantics) or every axis from ``axis`` on."""
    axis = normalize_axis(axis, Y.ndim)
    return (axis,) if opset13 else tuple(range(axis, Y.ndim))


def _softmax_grad(dY, Y, axis, opset13):
    same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = accumulation_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    dot = (y * dy).sum(axis=axes, keepdims=True)
    return ((dy - dot) * y).astype(Y.dtype)


def _log_softmax_grad(dY, Y, axis, opset13):
    same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = accumulation_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    return (dy - np.exp(y) * dy.sum(axis=axes, keepdims=True)).astype(Y.dtype)


@cpu_kernel("SoftmaxGrad", domain=MICROSOFT)
def softmax_grad(dY, Y, *, axis=1):
    """Softmax (opset < 13) gradient: the input is coerced to 2-D at ``axis``."""
    return _softmax_grad(dY, Y, axis, opset13=False)


def _softmax_grad_13_schema(op_type: str, default_axis: int = -1) -> Schema:
    """ONNX Runtime training's contract (training_op_defs.cc) of SoftmaxGrad_13 / LogSoftmaxGrad_13:
    dY and the forward output Y, one axis (SoftmaxGrad / LogSoftmaxGrad: the same, axis 1 by
    default, the sums running over every axis from it)."""
    return schemas.declare(
        Schema(
            op_type,
            inputs=(Formal("dY", FLOATS), Formal("Y", FLOATS)),
            outputs=(Formal("dX", FLOATS),),
            attributes=(Attribute("axis", "int", default_axis),),
            infer=lambda i, a: [(i[0].dtype, i[0].shape)],
        )
    )


SOFTMAX_GRAD_13 = _softmax_grad_13_schema("SoftmaxGrad_13")
LOG_SOFTMAX_GRAD_13 = _softmax_grad_13_schema("LogSoftmaxGrad_13")
SOFTMAX_GRAD = _softmax_grad_13_schema("SoftmaxGrad", default_axis=1)
LOG_SOFTMAX_GRAD = _softmax_grad_13_schema("LogSoftmaxGrad", default_axis=1)


@cpu_kernel("SoftmaxGrad_13", domain=MICROSOFT)
def softmax_grad_13(dY, Y, *, axis=-1):
    """dX = Y * (dY - sum(dY * Y, axis)) along the single ``axis`` (Softmax-13)."""
    return _softmax_grad(dY, Y, axis, opset13=True)


@cpu_kernel("LogSoftmaxGrad", domain=MICROSOFT)
def log_softmax_grad(dY, Y, *, axis=1):
    return _log_softmax_grad(dY, Y, axis, opset13=False)


@cpu_kernel("LogSoftmaxGrad_13", domain=MICROSOFT)
def log_softmax_grad_13(dY, Y, *, axis=-1):
    """dX = dY - exp(Y) * sum(dY, axis), Y being LogSoftmax's output."""
    return _log_softmax_grad(dY, Y, axis, opset13=True)
