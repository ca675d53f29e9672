"""CPU kernels: the com.microsoft gradient ops, with ONNX Runtime training's contracts.

Input orders differ between ops on purpose (they are ORT's): GatherGrad is (shape, indices, dY),
GatherElementsGrad is (dY, shape, indices). Negative indices are normalised before anything else;
repeated indices accumulate deterministically (sorted segment sums or bincount, never
``dx[idx] += dy``); float16 (and bfloat16) accumulate in float32.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.errors import KernelError
from gradgen.kernels.cpu.shape import slice_geometry, slice_index
from gradgen.kernels.registry import MICROSOFT, cpu_kernel


def _acc_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype to accumulate in: float32 for the 16-bit floats, the dtype itself otherwise."""
    dtype = np.dtype(dtype)
    if dtype == np.float16 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def _ints(values, what: str) -> list[int]:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise KernelError(f"{what} must be int32 or int64, got {array.dtype}")
    if array.ndim > 1:
        raise KernelError(f"{what} must be 1-D, got shape {list(array.shape)}")
    return [int(v) for v in array.reshape(-1)]


def _shape_arg(shape) -> list[int]:
    dims = _ints(shape, "shape")
    if any(d < 0 for d in dims):
        raise KernelError(f"shape {dims} has a negative dimension")
    return dims


def _axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise KernelError(f"{what} {axis} is out of range for rank {rank} (valid range [{-rank}, {rank - 1}])")
    return axis + rank if axis < 0 else axis


def _normalize_indices(indices, size: int, axis: int) -> np.ndarray:
    """int64 copy of ``indices`` with negatives wrapped; out-of-range values raise KernelError."""
    indices = np.asarray(indices)
    if indices.dtype.kind not in "iu":
        raise KernelError(f"indices must be int32 or int64, got {indices.dtype}")
    idx = indices.astype(np.int64)
    bad = (idx < -size) | (idx >= size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise KernelError(
            f"index {int(idx[where])} (at position {list(where)} of indices) is out of range for axis {axis} "
            f"of size {size} (valid range [{-size}, {size - 1}])")
    np.add(idx, size, out=idx, where=idx < 0)
    return idx


# ---------------------------------------------------------------- SliceGrad


@cpu_kernel("SliceGrad", domain=MICROSOFT)
def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    """dX: zeros of ``shape`` with dY written where Slice(starts, ends, axes, steps) read from.

    dY must have as many elements as the slice; like ORT, its shape may differ (it is read in order).
    """
    dims = _shape_arg(shape)
    slices = slice_index(slice_geometry(dims, starts, ends, axes, steps))
    dY = np.asarray(dY)
    dX = np.zeros(dims, dtype=dY.dtype)
    window = dX[tuple(slices)]
    if window.size != dY.size:
        raise KernelError(f"dY has shape {list(dY.shape)}, but the slice of shape {dims} has shape {list(window.shape)}")
    # ORT checks only the element count (its tests feed dY of shape (2,) for a (1, 2) slice).
    dX[tuple(slices)] = dY.reshape(window.shape)
    return dX


# ---------------------------------------------------------------- GatherGrad


@cpu_kernel("GatherGrad", domain=MICROSOFT)
def gather_grad(shape, indices, dY, *, axis=0):
    """dX of ``shape``: the slices of dY added at the gathered positions along ``axis``."""
    dims = _shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: Gather's data must have rank >= 1")
    axis = _axis(axis, len(dims))
    size = dims[axis]
    idx = _normalize_indices(indices, size, axis)
    dY = np.asarray(dY)
    want = tuple(dims[:axis]) + idx.shape + tuple(dims[axis + 1:])
    if dY.shape != want:
        raise KernelError(f"dY has shape {list(dY.shape)}, but data shape {dims} gathered with indices of shape "
                          f"{list(idx.shape)} along axis {axis} gives {list(want)}")
    outer, inner, count = math.prod(dims[:axis]), math.prod(dims[axis + 1:]), idx.size
    acc = _acc_dtype(dY.dtype)
    dX = np.zeros((outer, size, inner), dtype=acc)
    if count and outer and inner:
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        parts = dY.reshape(outer, count, inner)[:, order, :].astype(acc, copy=False)
        dX[:, ordered[first], :] = np.add.reduceat(parts, first, axis=1)
    return dX.reshape(dims).astype(dY.dtype, copy=False)


# ---------------------------------------------------------------- GatherElementsGrad


@cpu_kernel("GatherElementsGrad", domain=MICROSOFT)
def gather_elements_grad(dY, shape, indices, *, axis=0):
    """dX of ``shape``: dY[i] added at indices[i] along ``axis`` (the other coordinates kept)."""
    dims = _shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: GatherElements' data must have rank >= 1")
    axis = _axis(axis, len(dims))
    dY, indices = np.asarray(dY), np.asarray(indices)
    if dY.shape != indices.shape:
        raise KernelError(f"dY has shape {list(dY.shape)}, but indices have shape {list(indices.shape)}; they must match")
    if indices.ndim != len(dims):
        raise KernelError(f"indices have rank {indices.ndim} (shape {list(indices.shape)}), but the data shape "
                          f"{dims} has rank {len(dims)}")
    for d, (n, m) in enumerate(zip(indices.shape, dims)):
        if d != axis and n > m:
            raise KernelError(f"indices shape {list(indices.shape)} exceeds the data shape {dims} on axis {d} "
                              f"(only axis {axis} may be longer)")
    idx = _normalize_indices(indices, dims[axis], axis)
    strides = [math.prod(dims[d + 1:]) for d in range(len(dims))]
    target = idx * strides[axis]
    for d, n in enumerate(indices.shape):
        if d != axis:
            view = [1] * len(dims)
            view[d] = n
            target = target + (np.arange(n, dtype=np.int64) * strides[d]).reshape(view)
    # bincount adds in float64, sequentially in element order: deterministic, and exact for double.
    sums = np.bincount(target.reshape(-1), weights=dY.reshape(-1).astype(np.float64), minlength=math.prod(dims))
    return sums.reshape(dims).astype(dY.dtype)


# ---------------------------------------------------------------- ConvGrad


def conv_geometry(x_shape, w_shape, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                  pads=None, strides=None):
    """Check a Conv's shapes and attributes; return (pads_begin, pads_end, strides, dilations, out_shape)."""
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) < 3 or len(w_shape) != len(x_shape):
        raise KernelError(f"Conv needs X of rank >= 3 and W of the same rank; got X {list(x_shape)}, W {list(w_shape)}")
    nd = len(x_shape) - 2
    kernel = list(w_shape[2:])
    if kernel_shape is not None and list(kernel_shape) != kernel:
        raise KernelError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {kernel} (W {list(w_shape)})")
    strides = [1] * nd if strides is None else list(strides)
    dilations = [1] * nd if dilations is None else list(dilations)
    if len(strides) != nd or len(dilations) != nd:
        raise KernelError(f"strides {strides} and dilations {dilations} must have {nd} values")
    if min(strides + dilations, default=1) < 1:
        raise KernelError(f"strides {strides} and dilations {dilations} must be >= 1")
    channels, filters = x_shape[1], w_shape[0]
    if group < 1 or channels != w_shape[1] * group or filters % group:
        raise KernelError(f"group {group} does not fit X {list(x_shape)} and W {list(w_shape)}: X's channels must be "
                          f"W.shape[1] * group and W.shape[0] a multiple of group")
    spatial = x_shape[2:]
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max(0, (o - 1) * s + e - n) for o, s, e, n in zip(out, strides, span, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    elif auto_pad == "NOTSET":
        pads = [0] * (2 * nd) if pads is None else list(pads)
        if len(pads) != 2 * nd or min(pads, default=0) < 0:
            raise KernelError(f"pads {pads} must be {2 * nd} non-negative values")
        begin, end = pads[:nd], pads[nd:]
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r} (NOTSET, SAME_UPPER, SAME_LOWER or VALID)")
    out = [(n + b + e - sp) // s + 1 for n, b, e, sp, s in zip(spatial, begin, end, span, strides)]
    if min(out) < 1:
        raise KernelError(f"Conv output would be empty: X {list(x_shape)}, W {list(w_shape)}, pads {begin + end}, "
                          f"strides {strides}, dilations {dilations}")
    return begin, end, strides, dilations, (x_shape[0], filters, *out)


@cpu_kernel("ConvGrad", domain=MICROSOFT)
def conv_grad(dY, X, W, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
              strides=None, _num_outputs=3, _wanted=None):
    """(dX, dW, dB) of Conv(X, W[, B]) by im2col and batched matmuls, one per group.

    Outputs the node leaves unnamed (``_wanted`` False) are not computed (None in their place).
    """
    wanted = _wanted or (True,) * _num_outputs
    dY, X, W = np.asarray(dY), np.asarray(X), np.asarray(W)
    if not dY.dtype == X.dtype == W.dtype:
        raise KernelError(f"dY, X and W must have one dtype; got {dY.dtype}, {X.dtype}, {W.dtype}")
    begin, end, strides, dilations, y_shape = conv_geometry(
        X.shape, W.shape, auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape,
        pads=pads, strides=strides)
    if dY.shape != y_shape:
        raise KernelError(f"dY has shape {list(dY.shape)}, but Conv's output shape is {list(y_shape)}")
    acc = _acc_dtype(X.dtype)
    n, c = X.shape[:2]
    m, cg = W.shape[:2]
    g, mg, nd = group, m // group, X.ndim - 2
    kernel, out = W.shape[2:], y_shape[2:]
    p, k = math.prod(out), math.prod(kernel)
    spatial_axes = tuple(range(2, 2 + nd))
    dy = dY.astype(acc, copy=False)
    # dY as (G, Mg, N*P): one matrix per group.
    dy_g = dy.reshape(n, g, mg, p).transpose(1, 2, 0, 3).reshape(g, mg, n * p)
    results = []
    if _num_outputs >= 1 and not wanted[0]:
        results.append(None)
    elif _num_outputs >= 1:
        w_t = W.astype(acc, copy=False).reshape(g, mg, cg * k).transpose(0, 2, 1)
        cols = np.matmul(w_t, dy_g)  # (G, Cg*K, N*P)
        cols = cols.reshape(g, cg, k, n, *out).transpose(2, 3, 0, 1, *range(4, 4 + nd)).reshape(k, n, c, *out)
        padded = [s + b + e for s, b, e in zip(X.shape[2:], begin, end)]
        dxp = np.zeros((n, c, *padded), dtype=acc)
        for position, offset in enumerate(np.ndindex(*kernel)):
            window = tuple(slice(o * d, o * d + (q - 1) * s + 1, s) for o, d, q, s in zip(offset, dilations, out, strides))
            dxp[(slice(None), slice(None)) + window] += cols[position]
        crop = tuple(slice(b, b + s) for b, s in zip(begin, X.shape[2:]))
        results.append(dxp[(slice(None), slice(None)) + crop].astype(X.dtype))
    if _num_outputs >= 2 and not wanted[1]:
        results.append(None)
    elif _num_outputs >= 2:
        xp = np.pad(X.astype(acc, copy=False), [(0, 0), (0, 0)] + list(zip(begin, end)))
        span = [(kk - 1) * d + 1 for kk, d in zip(kernel, dilations)]
        view = sliding_window_view(xp, span, axis=spatial_axes)
        view = view[(slice(None), slice(None))
                    + tuple(slice(0, (q - 1) * s + 1, s) for q, s in zip(out, strides))
                    + tuple(slice(None, None, d) for d in dilations)]
        # im2col: (N, G, Cg, *out, *kernel) -> (G, Cg*K, N*P), one copy with the output positions
        # innermost (they run along X's rows, which keeps the copy fast).
        view = view.reshape(n, g, cg, *view.shape[2:])
        order = (1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd))
        im2col = view.transpose(order).reshape(g, cg * k, n * p)
        results.append(np.matmul(dy_g, im2col.transpose(0, 2, 1)).reshape(W.shape).astype(W.dtype))
    if _num_outputs >= 3:
        results.append(dy.sum(axis=(0, *spatial_axes)).astype(dY.dtype))
    return tuple(results)


# ---------------------------------------------------------------- BroadcastGradientArgs


def broadcast_gradient_axes(a_shape, b_shape) -> tuple[list[int], list[int]]:
    """The axes of the broadcast result that each operand must be reduced over, in descending order."""
    a, b = list(a_shape), list(b_shape)
    a_axes, b_axes = [], []
    i, j, k = len(a) - 1, len(b) - 1, max(len(a), len(b)) - 1
    while i >= 0 and j >= 0:
        if a[i] != b[j]:
            if a[i] == 1:
                a_axes.append(k)
            elif b[j] == 1:
                b_axes.append(k)
            else:
                raise KernelError(f"broadcast is not possible between shapes {a} and {b} "
                                  f"(dimension {a[i]} against {b[j]} at output axis {k})")
        i, j, k = i - 1, j - 1, k - 1
    (a_axes if i < 0 else b_axes).extend(range(k, -1, -1))
    return a_axes, b_axes


@cpu_kernel("BroadcastGradientArgs", domain=MICROSOFT)
def broadcast_gradient_args(a_shape, b_shape):
    a_axes, b_axes = broadcast_gradient_axes(_ints(a_shape, "a_shape"), _ints(b_shape, "b_shape"))
    return np.array(a_axes, dtype=np.int64), np.array(b_axes, dtype=np.int64)
