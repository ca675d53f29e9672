"""CPU kernels: pooling and resampling (MaxPool, AveragePool, LpPool, the global pools, MaxUnpool,
Resize) and ONNX Runtime training's pooling gradients, NC* layout, 1-D/2-D/3-D and beyond.

Windows are strided views (``sliding_window_view``); float16 inputs are computed in float32 and
cast back; every output has its input's dtype. Padding follows ONNX: ``pads`` is ``[x1_begin,
x2_begin, ..., x1_end, x2_end, ...]``; ``auto_pad`` SAME_UPPER/SAME_LOWER gives ``ceil(in /
stride)`` outputs and puts the odd padding element at the end/beginning; VALID means no padding.

MaxPoolGrad and AveragePoolGrad (ORT training) take dX's shape from the graph (the inferred shape
of their output), not from an input. Here dX gets the smallest input shape the pooling windows
cover: ``(out - 1) * stride + (kernel - 1) * dilation + 1 - pads`` per spatial axis (for
ceil_mode, the smallest size whose ceil gives ``out``). That is X's shape whenever the windows
reach X's end, which is the case in every pooling where floor division drops nothing.
MaxPoolGrad checks that every index falls in its own (n, c) plane of that shape and raises
KernelError otherwise.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.prepared import per_shape
from gradgen.kernels.numeric import accumulation_dtype, float_compute_dtype, pad_spatial, same_shape, sliding_windows
from gradgen.kernels.table import cpu_kernel, cpu_prepare
from gradgen.ops.axes import per_axis
from gradgen.ops.grid_sample import TAP_OFFSETS, affine_base_grid, cubic_weights, grid_sample_spec
from gradgen.ops.pool import declared_pads, pool_window, resize_geometry, resize_matrices, roi_align_spec

# ---------------------------------------------------------------------------------------------
# pooling


def _lowest(dtype):
    dtype = np.dtype(dtype)
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


@cpu_kernel("MaxPool")
def max_pool(
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    storage_order=0,
    strides=None,
    _num_outputs=1,
):
    kernel, s, d, begin, end, out = pool_window("MaxPool", x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    xp = pad_spatial(x, begin, end, _lowest(x.dtype))
    win = sliding_windows(xp, kernel, s, d, out)
    if _num_outputs < 2:
        return _window_max(win, kernel)[0]
    # Indices: position of the (first) maximum in the flattened unpadded input tensor.
    nan_aware = x.dtype.kind == "f" and bool(np.isnan(x).any())
    y, tap = _window_max(win, kernel, want_tap=True, nan_aware=nan_aware)
    if y.size == 0:
        return y, np.zeros(y.shape, dtype=np.int64)
    spatial = x.shape[2:]
    order = "F" if int(storage_order) == 1 else "C"
    table = _tap_positions(tuple(spatial), tuple(kernel), tuple(s), tuple(d), tuple(begin), tuple(out), order)
    p = math.prod(out)
    flat = tap.reshape(-1, p).astype(np.intp)
    flat *= p
    flat += np.arange(p)
    pos = np.take(table, flat).reshape(y.shape)
    nc = np.arange(x.shape[0] * x.shape[1], dtype=np.int64).reshape(x.shape[0], x.shape[1], *([1] * ns))
    pos += nc * math.prod(spatial)
    return y, pos


@functools.lru_cache(maxsize=64)
def _tap_positions(spatial, kernel, strides, dilations, begin, out, order) -> np.ndarray:
    """The flat position in an (unpadded) input plane that each kernel tap (in ``np.ndindex``
    order) reads at each output position: int64 of shape (taps * prod(out),), positions in the
    padding clipped to the nearest input element."""
    ns = len(kernel)
    coords = []
    for axis in range(ns):
        o = np.arange(out[axis]) * strides[axis] - begin[axis]
        t = np.arange(kernel[axis]) * dilations[axis]
        # tap axes first, then output axes: (*kernel, *out)
        grid = t.reshape(_axis_shape(2 * ns, axis, kernel[axis])) + o.reshape(_axis_shape(2 * ns, ns + axis, out[axis]))
        coords.append(np.clip(grid, 0, spatial[axis] - 1))
    table = np.ravel_multi_index(tuple(np.broadcast_arrays(*coords)), spatial, order=order).astype(np.int64).reshape(-1)
    table.flags.writeable = False  # cached and shared between calls
    return table


def _axis_shape(rank: int, axis: int, size: int) -> list[int]:
    shape = [1] * rank
    shape[axis] = size
    return shape


def _window_max(win, kernel, want_tap: bool = False, nan_aware: bool = False):
    """The max over each window of ``win`` (N, C, *out, *kernel), and with ``want_tap`` the flat
    kernel tap (``np.ndindex`` order) of its first occurrence, else None; with ``nan_aware`` NaN
    counts as the largest, as in ``np.argmax``.

    One pass of ``np.maximum`` per kernel tap over (N, C, *out) strided views: numpy's reduction
    over the small trailing window axes of a strided view is several times slower. Taps come in
    increasing order, so the tap of the first maximum is ``max(tap, better * index)``."""
    lead = (slice(None),) * (win.ndim - len(kernel))
    tap_dtype = np.uint8 if math.prod(kernel) <= 256 else np.int64
    taps = list(np.ndindex(*kernel))
    best = np.array(win[lead + taps[0]])  # a C-ordered copy
    tap = np.zeros(best.shape, dtype=tap_dtype) if want_tap else None
    better = np.empty(best.shape, dtype=bool)
    scaled = np.empty(best.shape, dtype=tap_dtype)
    for index in range(1, len(taps)):
        value = win[lead + taps[index]]
        if tap is not None:
            np.greater(value, best, out=better)
            if nan_aware:
                better |= np.isnan(value) & ~np.isnan(best)
            np.maximum(tap, np.multiply(better, index, out=scaled, dtype=tap_dtype), out=tap)
        np.maximum(best, value, out=best)
    return best, tap


def _window_counts(size, kernel, stride, dilation, begin, n_out, lo, hi):
    """Per output position of one axis: how many window taps land in [lo, hi) of input coords."""
    starts = np.arange(n_out) * stride - begin
    taps = starts[:, None] + np.arange(kernel)[None, :] * dilation
    return ((taps >= lo) & (taps < hi)).sum(axis=1)


@cpu_kernel("AveragePool")
def average_pool(
    x,
    *,
    auto_pad="NOTSET",
    ceil_mode=0,
    count_include_pad=0,
    dilations=None,
    kernel_shape=None,
    pads=None,
    strides=None,
):
    attrs = {
        "auto_pad": auto_pad,
        "ceil_mode": ceil_mode,
        "count_include_pad": count_include_pad,
        "dilations": dilations,
        "kernel_shape": kernel_shape,
        "pads": pads,
        "strides": strides,
    }
    return _average_pool(x, _average_pool_plan((x.shape, x.dtype), attrs))


@cpu_prepare("AveragePool")
def prepare_average_pool(constants: tuple, attrs: dict):
    """The kernel with its window geometry and divisor worked out once per input shape."""
    plans = per_shape(functools.partial(_average_pool_plan, attrs=attrs))

    def run(x):
        return _average_pool(x, plans((x.shape, x.dtype)))

    return run


def _average_pool_plan(key: tuple, attrs: dict) -> tuple:
    """(kernel, strides, dilations, begin pads, end pads, output dims, the divisor per output
    position in the compute type, whether a window has no tap to count) for (shape, dtype)."""
    shape, dtype = key
    kernel, s, d, begin, end, out = pool_window(
        "AveragePool",
        shape,
        attrs.get("kernel_shape"),
        attrs.get("strides"),
        attrs.get("dilations"),
        attrs.get("pads"),
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("ceil_mode", 0),
    )
    ns = len(kernel)
    # Divisor: taps inside the input, or (count_include_pad) inside the declared padding too;
    # taps in the extra region that ceil_mode adds past the end padding never count.
    declared = declared_pads(attrs.get("auto_pad", "NOTSET"), attrs.get("pads"), begin, end)
    count = np.ones((), dtype=np.int64)
    for axis in range(ns):
        size = shape[2 + axis]
        if int(attrs.get("count_include_pad", 0)):
            lo, hi = -begin[axis], size + declared[ns + axis]
        else:
            lo, hi = 0, size
        c = _window_counts(size, kernel[axis], s[axis], d[axis], begin[axis], out[axis], lo, hi)
        count = np.multiply.outer(count, c)
    divisor = count.astype(float_compute_dtype(dtype))
    return kernel, s, d, begin, end, out, divisor, not divisor.all()


def _average_pool(x: np.ndarray, plan: tuple) -> np.ndarray:
    kernel, s, d, begin, end, out, divisor, empty_windows = plan
    ns = len(kernel)
    xp = pad_spatial(x.astype(divisor.dtype, copy=False), begin, end, 0)
    total = sliding_windows(xp, kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
    if empty_windows:
        with np.errstate(invalid="ignore", divide="ignore"):
            y = total / divisor
    else:
        y = total / divisor
    return np.ascontiguousarray(y, dtype=x.dtype)


@cpu_kernel("GlobalAveragePool")
def global_average_pool(x):
    axes = tuple(range(2, x.ndim))
    return x.mean(axis=axes, keepdims=True, dtype=float_compute_dtype(x.dtype)).astype(x.dtype)


@cpu_kernel("GlobalMaxPool")
def global_max_pool(x):
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


# ---------------------------------------------------------------------------------------------
# normalization


@cpu_kernel("LpPool")
def lp_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None, strides=None):
    """(sum over the window of |x|^p)^(1/p); padding contributes zeros."""
    kernel, s, d, begin, end, out = pool_window("LpPool", x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = float_compute_dtype(x.dtype)
    powered = np.abs(x.astype(ct, copy=False)) ** ct.type(p)
    total = sliding_windows(pad_spatial(powered, begin, end, 0), kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
    return np.ascontiguousarray(total ** ct.type(1.0 / p), dtype=x.dtype)


@cpu_kernel("GlobalLpPool")
def global_lp_pool(x, *, p=2):
    """(sum over the spatial axes of |x|^p)^(1/p), keeping them as 1s."""
    ct = float_compute_dtype(x.dtype)
    powered = np.abs(x.astype(ct, copy=False)) ** ct.type(p)
    total = powered.sum(axis=tuple(range(2, x.ndim)), keepdims=True)
    return np.ascontiguousarray(total ** ct.type(1.0 / p), dtype=x.dtype)


@cpu_kernel("MaxUnpool")
def max_unpool(x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    """Scatter X into zeros at MaxPool's flattened indices. The indices address the inferred
    shape ((in - 1) * stride - pads + kernel per axis); output_shape, when given, only adds zero
    room after it (what ONNX's reference and test_maxunpool_export_with_output_shape expect)."""
    inferred, shape = unpool_shapes(x.shape, indices.shape, output_shape, kernel_shape, pads, strides)
    size = int(np.prod(inferred))
    idx = indices.astype(np.int64).reshape(-1)
    check_unpool_indices(idx, size)
    flat = np.zeros(size, dtype=x.dtype)
    flat[idx] = x.reshape(-1)
    result = np.zeros(shape, dtype=x.dtype)
    result[tuple(slice(0, n) for n in inferred)] = flat.reshape(inferred)
    return result


def unpool_shapes(x_shape, indices_shape, output_shape, kernel_shape, pads, strides) -> tuple[list[int], list[int]]:
    """MaxUnpool's (inferred shape, output shape), checked: output_shape (a host array or None)
    may only be larger than the inferred shape, and the indices must have X's shape."""
    if kernel_shape is None:
        raise KernelError("MaxUnpool needs the kernel_shape attribute")
    ns = len(x_shape) - 2
    k = per_axis(kernel_shape, ns, 1, "kernel_shape")
    s = per_axis(strides, ns, 1, "strides")
    p = per_axis(pads, 2 * ns, 0, "pads")
    inferred = [int(d) for d in x_shape[:2]] + [(x_shape[2 + i] - 1) * s[i] - (p[i] + p[ns + i]) + k[i] for i in range(ns)]
    shape = inferred if output_shape is None else [int(v) for v in np.asarray(output_shape).reshape(-1)]
    if len(shape) != len(x_shape) or any(a < b for a, b in zip(shape, inferred)):
        raise KernelError(f"output_shape {shape} is smaller than the inferred shape {inferred}")
    if tuple(indices_shape) != tuple(x_shape):
        raise KernelError(f"indices shape {list(indices_shape)} differs from X's {list(x_shape)}")
    return inferred, shape


def check_unpool_indices(idx: np.ndarray, size: int) -> None:
    """KernelError for the first of the flat int64 indices outside [0, size)."""
    bad = (idx < 0) | (idx >= size)
    if bad.any():
        raise KernelError(
            f"index {int(idx[bad][0])} is out of range for the flattened output of {size} elements; "
            f"valid range is [0, {size - 1}]"
        )


# ---------------------------------------------------------------------------------------------
# resize
#
# Resize (nearest, linear, cubic) is separable: along each axis the output is a fixed matrix
# M (out x in) times the input, so the kernel applies one matrix per resized axis and the gradient
# rule applies their transposes (both from ``resize_axis_matrix``).


@cpu_kernel("Resize")
def resize(
    x,
    roi=None,
    scales=None,
    sizes=None,
    *,
    antialias=0,
    axes=None,
    coordinate_transformation_mode="half_pixel",
    cubic_coeff_a=-0.75,
    exclude_outside=0,
    extrapolation_value=0.0,
    keep_aspect_ratio_policy="stretch",
    mode="nearest",
    nearest_mode="round_prefer_floor",
    _opset=13,
):
    if _opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        scales, roi, coordinate_transformation_mode, nearest_mode = roi, None, "asymmetric", "floor"
    out, factors = resize_geometry(x.shape, scales, sizes, axes=axes, keep_aspect_ratio_policy=keep_aspect_ratio_policy)
    attrs = dict(
        mode=mode,
        coordinate_transformation_mode=coordinate_transformation_mode,
        nearest_mode=nearest_mode,
        cubic_coeff_a=cubic_coeff_a,
        exclude_outside=exclude_outside,
        antialias=antialias,
    )
    key = (
        tuple(x.shape),
        tuple(out),
        tuple(factors),
        tuple(sorted(attrs.items())),
        None if roi is None else tuple(np.asarray(roi, np.float64).reshape(-1).tolist()),
        None if axes is None else tuple(axes),
    )
    y = x.astype(np.float64)
    for axis, (columns, weights, outside) in _resize_taps(key).items():
        y = _taps_along(y, columns, weights, axis)
        if outside is not None:
            index = [slice(None)] * y.ndim
            index[axis] = outside
            y[tuple(index)] = extrapolation_value
    return np.ascontiguousarray(y, dtype=x.dtype)


def _taps_of(key: tuple) -> dict:
    """Axis -> (columns, weights, outside): each resized axis's matrix (``resize_matrices``) as the
    input positions and weights of its non-zero taps per output position (out x taps, padded with
    zero weights): a linear resize reads 2 inputs per output, not the whole axis. ``key``: (x's
    shape, the output shape, the factors, the attributes, roi, axes)."""
    x_shape, out, factors, attrs, roi, axes = key
    taps_by_axis = {}
    for axis, (m, outside) in resize_matrices(x_shape, out, factors, dict(attrs), roi, axes).items():
        taps = max(1, int((m != 0).sum(axis=1).max(initial=0)))
        columns = np.argsort(m == 0, axis=1, kind="stable")[:, :taps]  # the non-zero columns first, in order
        taps_by_axis[axis] = (columns, np.take_along_axis(m, columns, axis=1), outside)
    return taps_by_axis


_resize_taps = per_shape(_taps_of)  # computed once per shapes and attributes


def _taps_along(y: np.ndarray, columns: np.ndarray, weights: np.ndarray, axis: int) -> np.ndarray:
    """sum_t weights[:, t] * y[columns[:, t]] along ``axis`` (float64). A padding tap (weight 0)
    adds nothing, not 0 * its column: an inf or NaN there stays out of that output."""
    view = [1] * y.ndim
    view[axis] = columns.shape[0]
    total = None
    for t in range(columns.shape[1]):
        part = np.take(y, columns[:, t], axis=axis)
        padding = weights[:, t] == 0
        if padding.any():
            with np.errstate(invalid="ignore"):  # 0 * inf, set to 0 below
                part *= weights[:, t].reshape(view)
            np.copyto(part, 0.0, where=padding.reshape(view))
        else:
            part *= weights[:, t].reshape(view)
        total = part if total is None else np.add(total, part, out=total)
    if total is None:  # an empty input axis: no taps
        shape = list(y.shape)
        shape[axis] = columns.shape[0]
        return np.zeros(shape)
    return total


@cpu_kernel("Upsample")
def upsample(x, scales=None, *, mode="nearest"):
    """Upsample (opsets 7 to 9, deprecated; ``scales`` an input from 9, an attribute before):
    Resize-10's function, asymmetric coordinates and nearest taking the floor."""
    if scales is None:
        raise KernelError("Upsample needs scales")
    return resize(x, np.asarray(scales, dtype=np.float32), mode=mode, _opset=10)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's pooling gradients


def pool_grad_input_shape(dy_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """The smallest input shape whose pooling gives ``dy_shape``, and the begin pads."""
    if kernel_shape is None:
        raise KernelError("kernel_shape is required")
    if len(dy_shape) < 3:
        raise KernelError(f"dY must have rank >= 3 (N, C, spatial...), got shape {list(dy_shape)}")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    ns = len(dy_shape) - 2
    kernel = per_axis(kernel_shape, ns, 1, "kernel_shape")
    s = per_axis(strides, ns, 1, "strides")
    d = per_axis(dilations, ns, 1, "dilations")
    out = list(dy_shape[2:])
    span = [(k - 1) * dd + 1 for k, dd in zip(kernel, d)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # out = ceil(in / stride): the smallest such input, then its SAME padding.
        spatial = [(o - 1) * st + 1 for o, st in zip(out, s)]
        total = [max(0, (o - 1) * st + sp - n) for o, st, sp, n in zip(out, s, span, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin = small if auto_pad == "SAME_UPPER" else big
        return list(dy_shape[:2]) + spatial, begin, kernel, s, d
    if auto_pad == "VALID":
        p = [0] * (2 * ns)
    elif auto_pad in ("NOTSET", "", None):
        p = per_axis(pads, 2 * ns, 0, "pads")
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    spatial = []
    for axis in range(ns):
        size = (out[axis] - 1) * s[axis] + span[axis] - p[axis] - p[ns + axis]
        if int(ceil_mode):
            # ceil((in + pads - span) / stride) + 1 = out: the smallest such in.
            size = (out[axis] - 2) * s[axis] + span[axis] - p[axis] - p[ns + axis] + 1
        if size < 1:
            raise KernelError(f"dY shape {list(dy_shape)} does not come from a pooling with these attributes")
        spatial.append(size)
    return list(dy_shape[:2]) + spatial, p[:ns], kernel, s, d


@cpu_kernel("MaxPoolGrad")
def max_pool_grad(
    dY, Indices, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None, storage_order=0, strides=None
):
    """dX: dY added at MaxPool's Indices (flat positions in X, batch and channel included)."""
    same_shape(dY, Indices, "dY", "Indices")
    shape, _, _, _, _ = pool_grad_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    plane = math.prod(shape[2:])
    idx = Indices.astype(np.int64).reshape(shape[0] * shape[1], math.prod(dY.shape[2:]))  # no -1: N * C may be 0
    owner = np.arange(shape[0] * shape[1], dtype=np.int64)[:, None]
    if idx.size and ((idx < owner * plane) | (idx >= (owner + 1) * plane)).any():
        raise KernelError(
            f"MaxPool indices fall outside the input shape {shape} that the pooling windows cover: "
            f"X was larger (windows leave its end uncovered), which dY alone does not tell"
        )
    ct = accumulation_dtype(dY.dtype)
    flat = np.bincount(idx.reshape(-1), weights=dY.astype(np.float64).reshape(-1), minlength=math.prod(shape))
    return flat.reshape(shape).astype(ct).astype(dY.dtype)


@cpu_kernel("AveragePoolGrad")
def average_pool_grad(
    dY, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None, pads=None, strides=None
):
    """dX: each dY spread evenly over its window (clipped to X), divided by the kernel size
    (count_include_pad) or by the clipped window's size. ORT supports 1-3 spatial axes."""
    shape, begin, kernel, s = average_pool_grad_geometry(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = accumulation_dtype(dY.dtype)
    dx = np.zeros(shape, dtype=ct)
    dy = dY.astype(ct, copy=False)
    bounds = clipped_windows(dY.shape[2:], s, begin, kernel, shape[2:])
    for position in np.ndindex(*dY.shape[2:]):
        lo = [int(bounds[a][0][i]) for a, i in enumerate(position)]
        hi = [int(bounds[a][1][i]) for a, i in enumerate(position)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        count = math.prod(kernel) if int(count_include_pad) else math.prod(h - l for l, h in zip(lo, hi))
        window = (slice(None), slice(None)) + tuple(slice(l, h) for l, h in zip(lo, hi))
        value = dy[(slice(None), slice(None)) + position] / ct.type(count)
        dx[window] += value.reshape(value.shape + (1,) * ns)
    return dx.astype(dY.dtype)


def average_pool_grad_geometry(dy_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """AveragePoolGrad's (dX shape, begin pads, kernel, strides), checked as ORT does: 1 to 3
    spatial axes, no dilations."""
    shape, begin, kernel, s, d = pool_grad_input_shape(dy_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    if ns > 3:
        raise KernelError(f"AveragePoolGrad supports 1 to 3 spatial axes, got {ns}")
    if any(v != 1 for v in d):
        raise KernelError(f"AveragePoolGrad does not support dilations {d}")
    return shape, begin, kernel, s


def clipped_windows(out, strides, begin, kernel, spatial) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per spatial axis, each output position's window clipped to the input: (lo, hi) arrays,
    the window [lo, hi) (empty where hi <= lo: a window entirely in the padding)."""
    bounds = []
    for axis, n_out in enumerate(out):
        start = np.arange(n_out) * strides[axis] - begin[axis]
        bounds.append((np.maximum(start, 0), np.minimum(start + kernel[axis], spatial[axis])))
    return bounds


# ---------------------------------------------------------------------------------------------
# GridSample


def _reflect(x, lo: float, hi: float):
    """x reflected at lo and hi, as often as it takes, into [lo, hi]."""
    span = hi - lo
    if span <= 0:
        return np.full_like(x, lo)
    below, above = lo - x, x - hi
    out = x.copy()
    for distance, outside, near, far in ((below, below > 0, lo, hi), (above, above > 0, hi, lo)):
        d = distance[outside]
        turns = np.floor(d / span)
        rest = d - turns * span
        out[outside] = np.where(turns % 2 == 0, near + np.sign(far - near) * rest, far - np.sign(far - near) * rest)
    return out


@cpu_kernel("GridSample")
def grid_sample(x, grid, *, align_corners=0, mode=None, padding_mode=None):
    """Y[n, c, *o] = X[n, c] sampled at grid[n, *o] (gradgen.ops.grid_sample has the rule): the taps
    of every output position gathered at once, per tap offset combination."""
    spec = grid_sample_spec(mode, padding_mode, align_corners)
    nd = x.ndim - 2
    if nd < 1 or grid.ndim != nd + 2 or grid.shape[0] != x.shape[0] or grid.shape[-1] != nd:
        raise KernelError(
            f"grid of shape {list(grid.shape)} does not fit X of shape {list(x.shape)}: "
            f"expected (N, *out, {nd}) with N = {x.shape[0]}"
        )
    n, c, dims = x.shape[0], x.shape[1], x.shape[2:]
    out_dims = grid.shape[1:-1]
    ct = float_compute_dtype(x.dtype)
    g = grid.astype(ct, copy=False).reshape(n, -1, nd)
    coords, bases, weights = [], [], []
    for axis, size in enumerate(dims):
        normalized = g[:, :, nd - 1 - axis]
        pixel = (normalized + 1) / 2 * (size - 1) if spec.align_corners else ((normalized + 1) * size - 1) / 2
        if spec.mode == "nearest":
            pixel = np.rint(pixel)
        lo, hi = spec.bounds(size)
        outside = (pixel < lo) | (pixel > hi)
        if spec.padding_mode == "border" and spec.mode != "cubic":
            pixel = np.where(outside, np.clip(pixel, 0, size - 1), pixel)
        elif spec.padding_mode == "reflection":
            pixel = np.where(outside, _reflect(pixel, lo, hi), pixel)
        base = np.trunc(pixel) if spec.mode == "nearest" else np.floor(pixel)
        t = pixel - base
        coords.append(pixel)
        bases.append(base)
        weights.append({"nearest": (np.ones_like(t),), "linear": (1 - t, t), "cubic": cubic_weights(t)}[spec.mode])
    flat_x = x.astype(ct, copy=False).reshape(n, c, -1)
    total = np.zeros((n, c, g.shape[1]), dtype=ct)
    offsets = TAP_OFFSETS[spec.mode]
    for taps in itertools.product(range(len(offsets)), repeat=nd):
        flat = np.zeros(bases[0].shape, dtype=np.int64)
        weight = np.ones_like(bases[0])
        for axis, (size, k) in enumerate(zip(dims, taps)):
            position = bases[axis] + offsets[k]
            weight = weight * weights[axis][k]
            if spec.padding_mode == "zeros":
                weight = np.where((position >= 0) & (position < size), weight, 0)
                position = np.clip(position, 0, size - 1)
            elif spec.padding_mode == "border":
                position = np.clip(position, 0, size - 1)
            else:
                position = np.clip(np.trunc(_reflect(position, *spec.bounds(size))), 0, size - 1)
            flat = flat * size + position.astype(np.int64)
        total += weight[:, None, :] * np.take_along_axis(flat_x, np.broadcast_to(flat[:, None, :], total.shape), axis=2)
    return total.reshape(n, c, *out_dims).astype(x.dtype, copy=False)


@cpu_kernel("AffineGrid")
def affine_grid(theta, size, *, align_corners=0):
    """grid[n, *o, :] = theta[n] @ (x, y, [z,] 1) at output position o: theta (N, 2, 3) with size
    (N, C, H, W), or (N, 3, 4) with (N, C, D, H, W)."""
    dims = affine_grid_size(theta.shape, size)
    nd = len(dims) - 2
    ct = float_compute_dtype(theta.dtype)
    base = affine_base_grid(dims[2:], align_corners, ct)
    grid = np.einsum("pk,njk->npj", base, theta.astype(ct, copy=False))
    return grid.reshape(dims[0], *dims[2:], nd).astype(theta.dtype, copy=False)


def affine_grid_size(theta_shape, size) -> list[int]:
    """AffineGrid's size input as ints (N, C, H, W) or (N, C, D, H, W), checked against theta's
    shape (N, 2, 3) or (N, 3, 4) and for empty spatial dimensions."""
    dims = [int(v) for v in np.asarray(size).reshape(-1)]
    nd = len(dims) - 2
    if nd not in (2, 3) or tuple(theta_shape) != (dims[0], nd, nd + 1):
        raise KernelError(
            f"theta of shape {list(theta_shape)} does not fit size {dims}: expected (N, 2, 3) with 4 sizes "
            "or (N, 3, 4) with 5, N the first size"
        )
    if min(dims[2:]) < 1:
        raise KernelError(f"size {dims} has an empty spatial dimension")
    return dims


def _roi_axis_taps(start, size, bins: int, grid: int, extent: int):
    """One roi's sample taps along one axis: (low, high, weight of high, in range) per bin and
    sample, (bins, grid), with RoiAlign's edge rule (ONNX's reference, ONNX Runtime)."""
    bin_size = size / bins
    points = start + np.arange(bins)[:, None] * bin_size + (np.arange(grid)[None, :] + 0.5) * bin_size / grid
    inside = (points >= -1.0) & (points <= extent)
    points = np.maximum(points, 0.0)
    low = np.floor(points)
    top = low >= extent - 1
    low = np.where(top, extent - 1, low)
    high = np.where(top, extent - 1, low + 1)
    frac = np.where(top, 0.0, points - low)
    return low.astype(np.int64), high.astype(np.int64), frac, inside


@cpu_kernel("RoiAlign")
def roi_align(x, rois, batch_indices, **attrs):
    """Y[r, c] pools each of output_height x output_width bins of roi r (x1, y1, x2, y2, scaled by
    spatial_scale) of X[batch_indices[r], c]: the mean (avg) or max of bilinear samples on a
    sampling_ratio^2 grid per bin (adaptive: ceil(roi size / bins) per axis when 0). Max takes the
    largest weighted corner of each sample, as ONNX Runtime does."""
    half_pixel, mode, (out_h, out_w), ratio, scale = roi_align_spec(**attrs)
    if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or batch_indices.shape != (rois.shape[0],):
        raise KernelError(
            f"expected X (N, C, H, W), rois (R, 4) and batch_indices (R,), got {list(x.shape)}, "
            f"{list(rois.shape)} and {list(batch_indices.shape)}"
        )
    n, c, height, width = x.shape
    bad = (batch_indices < 0) | (batch_indices >= n)
    if bad.any():
        raise KernelError(f"batch index {int(batch_indices[bad][0])} is out of range for {n} images")
    ct = float_compute_dtype(x.dtype)
    y = np.zeros((rois.shape[0], c, out_h, out_w), dtype=ct)
    offset = 0.5 if half_pixel else 0.0
    for r, (box, b) in enumerate(zip(rois.astype(ct, copy=False), batch_indices)):
        x1, y1, x2, y2 = (v * ct.type(scale) - ct.type(offset) for v in box)
        roi_w, roi_h = x2 - x1, y2 - y1
        if not half_pixel:
            roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
        grid_h = ratio or int(np.ceil(roi_h / out_h))
        grid_w = ratio or int(np.ceil(roi_w / out_w))
        if grid_h <= 0 or grid_w <= 0:
            continue  # an empty roi (half_pixel): no samples, 0
        yl, yh, ly, y_in = _roi_axis_taps(y1, roi_h, out_h, grid_h, height)
        xl, xh, lx, x_in = _roi_axis_taps(x1, roi_w, out_w, grid_w, width)
        # (out_h, grid_h, 1, 1) against (1, 1, out_w, grid_w)
        yl, yh, ly, y_in = (v[:, :, None, None] for v in (yl, yh, ly, y_in))
        valid = (y_in & x_in[None, None]).astype(ct)
        plane = x[b].astype(ct, copy=False)
        corners = [
            (1 - ly) * (1 - lx) * valid * plane[:, yl, xl],
            (1 - ly) * lx * valid * plane[:, yl, xh],
            ly * (1 - lx) * valid * plane[:, yh, xl],
            ly * lx * valid * plane[:, yh, xh],
        ]  # each (C, out_h, grid_h, out_w, grid_w)
        if mode == "avg":
            y[r] = sum(corners).sum(axis=(2, 4)) / (grid_h * grid_w)
        else:
            y[r] = np.maximum.reduce(corners).max(axis=(2, 4))
    return y.astype(x.dtype, copy=False)


SMALL_POOL_TAPS = 1 << 18  # window elements (taps x outputs) up to which MaxPool gathers by a kept index (2 MiB of it)


@cpu_prepare("MaxPool")
def prepare_max_pool(constants: tuple, attrs: dict):
    """MaxPool of small float32 / float64 images as one gather by a kept index (each tap's value
    at each output, -inf for a tap in the padding) and ``np.maximum.reduce`` over the taps, which
    applies np.maximum tap after tap as the kernel does (the same bits); the indices output is the
    first maximum's tap (``argmax``, NaN first as the kernel counts it) looked up in the kernel's
    position table. Other inputs, and large ones, run the kernel."""
    outputs = attrs.get("_num_outputs", 1)
    plans = per_shape(functools.partial(_max_pool_plan, attrs=attrs))

    def run(x):
        try:
            # (the kernel's output keeps another input layout's axis order)
            plan = plans(x.shape) if x.dtype.kind == "f" and x.dtype.itemsize >= 4 and x.flags.c_contiguous else None
        except KernelError:
            plan = None  # the kernel says why
        if plan is None:
            return max_pool(x, **attrs)
        gather, sentinel, y_shape, positions = plan
        flat = x.reshape(-1)
        if sentinel:
            flat = np.concatenate((flat, np.full(1, -np.inf, dtype=x.dtype)))
        taps = flat[gather]
        y = np.maximum.reduce(taps, axis=0).reshape(y_shape)
        if outputs < 2:
            return y
        tap = np.argmax(taps, axis=0)
        tap *= taps.shape[1]
        tap += np.arange(taps.shape[1])
        return y, positions[tap].reshape(y_shape)

    return run


def _max_pool_plan(shape: tuple, attrs: dict):
    """(gather index (taps, outputs), whether it reads the -inf after the input, output shape, the
    indices output's value per (tap, output)) for this input shape, or None for the kernel."""
    window = {k: attrs.get(k) for k in ("kernel_shape", "strides", "dilations", "pads")}
    kernel, s, d, begin, end, out = pool_window(
        "MaxPool",
        shape,
        window["kernel_shape"],
        window["strides"],
        window["dilations"],
        window["pads"],
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("ceil_mode", 0),
    )
    ns, spatial = len(kernel), tuple(shape[2:])
    planes, plane, p, k = shape[0] * shape[1], math.prod(spatial), math.prod(out), math.prod(kernel)
    if not planes or not p or k * planes * p > SMALL_POOL_TAPS:
        return None
    inside = np.ones((1,) * (2 * ns), dtype=bool)
    for axis in range(ns):
        o = np.arange(out[axis]) * s[axis] - begin[axis]
        t = np.arange(kernel[axis]) * d[axis]
        coord = t.reshape(_axis_shape(2 * ns, axis, kernel[axis])) + o.reshape(_axis_shape(2 * ns, ns + axis, out[axis]))
        inside = inside & (coord >= 0) & (coord < spatial[axis])
    inside = inside.reshape(k, 1, p)
    nc = (np.arange(planes, dtype=np.int64) * plane).reshape(1, planes, 1)
    clipped = _tap_positions(spatial, tuple(kernel), tuple(s), tuple(d), tuple(begin), tuple(out), "C").reshape(k, 1, p)
    gather = np.where(inside, clipped + nc, planes * plane).reshape(k, planes * p)
    order = "F" if int(attrs.get("storage_order", 0)) == 1 else "C"
    table = _tap_positions(spatial, tuple(kernel), tuple(s), tuple(d), tuple(begin), tuple(out), order).reshape(k, 1, p)
    positions = (table + nc).reshape(-1)
    return gather, not inside.all(), (shape[0], shape[1], *out), positions


@cpu_kernel("MaxRoiPool")
def max_roi_pool(x, rois, *, pooled_shape, spatial_scale=1.0):
    """Y[r, c, ph, pw] = max of X[b_r, c] over roi r's bin (ph, pw), 0 for an empty bin; the rois
    (batch index, x1, y1, x2, y2) are scaled and rounded half away from zero, each with one pixel
    more than end - start, as ONNX Runtime, Caffe and torchvision's roi_pool compute it."""
    check_max_roi_pool_shapes(x.shape, rois.shape)
    pooled_h, pooled_w = (int(v) for v in pooled_shape)
    n, c, height, width = x.shape
    check_roi_batches(rois, n)
    y = np.zeros((rois.shape[0], c, pooled_h, pooled_w), dtype=x.dtype)
    for r, (bins_h, bins_w, batch) in enumerate(max_roi_pool_bins(rois, pooled_h, pooled_w, spatial_scale, height, width)):
        for ph, (h0, h1) in enumerate(bins_h):
            for pw, (w0, w1) in enumerate(bins_w):
                if h1 > h0 and w1 > w0:
                    y[r, :, ph, pw] = x[batch, :, h0:h1, w0:w1].max(axis=(1, 2))
    return y


def check_max_roi_pool_shapes(x_shape, rois_shape) -> None:
    """KernelError unless X is (N, C, H, W) and the rois (num_rois, 5)."""
    if len(x_shape) != 4 or len(rois_shape) != 2 or rois_shape[1] != 5:
        raise KernelError(f"MaxRoiPool takes X (N, C, H, W) and rois (num_rois, 5), got {tuple(x_shape)} and {tuple(rois_shape)}")


def check_roi_batches(rois, n: int) -> None:
    """KernelError naming the first roi whose batch index (its first value, truncated toward zero)
    is not one of the n images."""
    for r, value in enumerate(np.asarray(rois, dtype=np.float64)[:, 0]):
        batch = int(value)
        if not 0 <= batch < n:
            raise KernelError(f"MaxRoiPool: roi {r} has batch index {batch}, out of range for {n} images")


def max_roi_pool_bins(rois, pooled_h: int, pooled_w: int, spatial_scale: float, height: int, width: int):
    """Per roi: its row bins [(start, end)] * pooled_h, column bins * pooled_w, and batch index."""

    def round_away(v):
        return np.sign(v) * np.floor(np.abs(v) + 0.5)

    for roi in np.asarray(rois, dtype=np.float64):
        x1, y1, x2, y2 = (round_away(np.float32(v) * np.float32(spatial_scale)) for v in roi[1:])
        bins = []
        for start, end, pooled, size in ((y1, y2, pooled_h, height), (x1, x2, pooled_w, width)):
            step = np.float32(max(end - start + 1, 1)) / np.float32(pooled)
            bins.append(
                [
                    (
                        int(min(max(np.floor(np.float32(p * step)) + start, 0), size)),
                        int(min(max(np.ceil(np.float32((p + 1) * step)) + start, 0), size)),
                    )
                    for p in range(pooled)
                ]
            )
        yield bins[0], bins[1], int(roi[0])
