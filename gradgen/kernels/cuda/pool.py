"""CUDA launchers: pooling (pool.cu).

MaxPool (optional Indices output, the CPU kernel's flat-index semantics), AveragePool
(count_include_pad, pads, strides, dilations, ceil_mode), GlobalAveragePool and GlobalMaxPool run
on the GPU for up to 3 spatial axes and float16/bfloat16/float/double; other ranks and dtypes run
the numpy kernel and upload its result. GlobalLpPool of p 1 and 2 runs through the reduction
launchers, LpPool through AveragePool's kernel (``window_mean``). The geometry (output shape,
padding, the divisor bounds) is resolved on the host by the CPU kernel's own helpers, so both
devices agree on every corner case.

MaxUnpool and ONNX Runtime training's MaxPoolGrad are indexing's row scatter (an out-of-range
index raises the CPU kernel's error through the scatter's range flag); AveragePoolGrad is the
transpose of a window sum, ConvTranspose with a ones kernel, as gradgen's AveragePool gradient.

AffineGrid is a batched GEMM of a host-built base grid (uploaded once per size) with theta;
MaxRoiPool runs pool.cu's max_roi_pool (the rois are data: each thread finds its bin).
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.pool import (
    affine_grid_size,
    average_pool_grad_geometry,
    check_max_roi_pool_shapes,
    check_roi_batches,
    check_unpool_indices,
    clipped_windows,
    pool_grad_input_shape,
    unpool_shapes,
)
from gradgen.kernels.cpu.pool import max_pool_grad as cpu_max_pool_grad
from gradgen.kernels.cuda.conv import conv_transpose
from gradgen.kernels.cuda.elementwise import and_, binary, device_scalar, greater_or_equal, in_float32, less, unary, where
from gradgen.kernels.cuda.indexing import row_scatter
from gradgen.kernels.cuda.launch import (
    FLOATS,
    INT32_LIMIT,
    contiguous,
    cpu_fallback,
    dtype_suffix,
    is_float,
    kernel_of,
    launch,
    left_pad,
    plan_cache,
    require_suffix,
    runtime,
    strided_copy,
)
from gradgen.kernels.cuda.matmul import matmul_views
from gradgen.kernels.numeric import same_shape
from gradgen.kernels.table import cuda_kernel
from gradgen.ops.grid_sample import affine_base_grid
from gradgen.ops.pool import declared_pads, pool_geometry, pool_window

SPATIAL = 3  # spatial axes the kernels handle (pool.cu's GG_SP)
EVERY_TAP = 1 << 62  # divisor bounds [-EVERY_TAP, EVERY_TAP): every window tap counts

POOL_GEOM = np.dtype(
    [("nc", np.int64)]
    + [(f, np.int64, SPATIAL) for f in ("inp", "out", "k", "s", "d", "pb", "lo", "hi")]
    + [("storage_order", np.int64)]
)


# ---------------------------------------------------------------------------------------------
# pooling


def _pool_geom(x_shape, kernel, strides, dilations, begin, out, lo, hi, storage_order=0):
    spatial = list(x_shape[2:])
    g = np.zeros((), dtype=POOL_GEOM)
    g["nc"] = int(x_shape[0]) * int(x_shape[1])
    g["inp"] = left_pad(spatial, SPATIAL, 1)
    g["out"] = left_pad(out, SPATIAL, 1)
    g["k"] = left_pad(kernel, SPATIAL, 1)
    g["s"] = left_pad(strides, SPATIAL, 1)
    g["d"] = left_pad(dilations, SPATIAL, 1)
    g["pb"] = left_pad(begin, SPATIAL, 0)
    g["lo"] = left_pad(lo, SPATIAL, 0)
    g["hi"] = left_pad(hi, SPATIAL, 1)
    g["storage_order"] = int(storage_order)
    return g[()]


def _gpu_poolable(x) -> bool:
    return is_float(x.dtype) and 1 <= x.ndim - 2 <= SPATIAL


@cuda_kernel("MaxPool")
def max_pool(x, *, _num_outputs=1, **attrs):
    """``attrs``: the node's attributes, read with their ONNX defaults by gradgen.ops.pool (as the
    CPU kernel and the CPU fallback read them)."""
    from gradgen.cuda import runtime as rt

    kernel, s, d, begin, _end, out = pool_geometry(x.shape, attrs, "MaxPool")
    if not _gpu_poolable(x):
        return cpu_fallback("MaxPool", x, _num_outputs=_num_outputs, **attrs)
    x = contiguous(x)
    y_shape = tuple(x.shape[:2]) + tuple(out)
    y = rt.empty(y_shape, x.dtype)
    idx = rt.empty(y_shape, np.int64) if _num_outputs >= 2 else None
    geom = _pool_geom(x.shape, kernel, s, d, begin, out, [0] * len(out), x.shape[2:], int(attrs.get("storage_order", 0)))
    fn = kernel_of("pool", f"max_pool_{require_suffix(x.dtype)}")
    if y.size and x.size:
        launch(fn, y.size, y, idx if idx is not None else np.uint64(0), x, geom, np.int64(y.size))
    return (y, idx) if _num_outputs >= 2 else y


def window_mean(x, kernel, strides, dilations, begin, out, counted=None):
    """AveragePool's kernel (pool.cu's avg_pool) on the float x (N, C, *spatial), 1 to 3 spatial
    axes: y[n, c, o] = the sum of window o's taps that fall inside x (padding adds 0), divided by
    how many of its taps lie in [lo, hi) on every axis, ``counted`` = (lo, hi) per axis; None
    counts every tap (the divisor is the window's size)."""
    rt = runtime()
    ns = len(kernel)
    lo, hi = counted if counted is not None else ([-EVERY_TAP] * ns, [EVERY_TAP] * ns)
    x = contiguous(x)
    y = rt.empty(tuple(x.shape[:2]) + tuple(out), x.dtype)
    if y.size:
        geom = _pool_geom(x.shape, kernel, strides, dilations, begin, out, lo, hi)
        launch(kernel_of("pool", f"avg_pool_{require_suffix(x.dtype)}"), y.size, y, x, geom, np.int64(y.size))
    return y


@cuda_kernel("AveragePool")
def average_pool(x, **attrs):
    """``attrs``: the node's attributes, read with their ONNX defaults (gradgen.ops.pool)."""
    kernel, s, d, begin, end, out = pool_geometry(x.shape, attrs, "AveragePool")
    if not _gpu_poolable(x):
        return cpu_fallback("AveragePool", x, **attrs)
    ns = len(kernel)
    declared = declared_pads(attrs.get("auto_pad", "NOTSET"), attrs.get("pads"), begin, end)
    spatial = list(x.shape[2:])
    if int(attrs.get("count_include_pad", 0)):
        lo = [-b for b in begin]
        hi = [size + declared[ns + a] for a, size in enumerate(spatial)]
    else:
        lo, hi = [0] * ns, spatial
    return window_mean(x, kernel, s, d, begin, out, (lo, hi))


def _global_pool(x, mode: int):
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    rows = int(x.shape[0]) * int(x.shape[1]) if x.ndim >= 2 else 1
    cols = math.prod(int(d) for d in x.shape[2:])
    y = rt.empty(tuple(x.shape[:2]) + (1,) * (x.ndim - 2), x.dtype)
    if rows == 0:
        return y
    fn = kernel_of("pool", f"row_reduce_{require_suffix(x.dtype)}")
    fn(y, x, np.int64(rows), np.int64(cols), np.int64(mode), block=(256, 1, 1), grid=(min(rows, 1 << 20), 1))
    return y


@cuda_kernel("GlobalAveragePool")
def global_average_pool(x):
    if not is_float(x.dtype) or x.ndim < 2:
        return cpu_fallback("GlobalAveragePool", x)
    return _global_pool(x, 0)


@cuda_kernel("GlobalMaxPool")
def global_max_pool(x):
    if not is_float(x.dtype) or x.ndim < 3 or any(int(d) == 0 for d in x.shape[2:]):
        return cpu_fallback("GlobalMaxPool", x)
    return _global_pool(x, 1)


@cuda_kernel("GlobalLpPool")
def global_lp_pool(x, *, p=2):
    """(sum over the spatial axes of |x|^p)^(1/p) for p 1 and 2: ReduceL1 / ReduceL2 over them
    (float32 sums for 16-bit data, rounded once, as on the CPU); other p run the CPU kernel."""
    from gradgen.kernels.cuda.reduction import reduce

    if float(p) not in (1.0, 2.0) or dtype_suffix(x.dtype) not in FLOATS or x.ndim < 3:
        return cpu_fallback("GlobalLpPool", x, p=p)
    op = "l1" if float(p) == 1.0 else "l2"
    return reduce(op, x, tuple(range(2, x.ndim)), True, "ReduceL1" if op == "l1" else "ReduceL2")


# ---------------------------------------------------------------------------------------------
# LpPool


def _abs_power(x, p: int):
    """|x|^p: |x| for p 1, x * x for 2 (as numpy's power computes them), Pow otherwise."""
    s = dtype_suffix(x.dtype)
    if p == 2:
        return binary(f"mul_{s}", x, x, x.dtype)
    magnitude = unary(f"abs_{s}", x)
    return magnitude if p == 1 else binary(f"pow_{s}_{s}", magnitude, device_scalar(p, x.dtype), x.dtype)


def _root(total, p: int):
    """total^(1/p): itself for p 1, Sqrt for 2 (as numpy's power computes them), Pow otherwise."""
    s = dtype_suffix(total.dtype)
    if p == 1:
        return total
    if p == 2:
        return unary(f"sqrt_{s}", total)
    return binary(f"pow_{s}_{s}", total, device_scalar(1.0 / p, total.dtype), total.dtype)


@cuda_kernel("LpPool")
def lp_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None, strides=None):
    """(sum over each window of |x|^p)^(1/p), padding adding 0: the window mean of |x|^p with every
    tap counted (``window_mean``) times the window's size, then the 1/p power (float32 for 16-bit
    x, rounded once). p < 1, and ranks or dtypes the pool kernels do not cover, run the CPU kernel."""
    attrs = dict(
        auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernel_shape, p=p, pads=pads, strides=strides
    )
    kernel, s, d, begin, _end, out = pool_window("LpPool", x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    order = int(p)
    if order < 1 or not _gpu_poolable(x):
        return cpu_fallback("LpPool", x, **attrs)

    def run(xc):
        mean = window_mean(_abs_power(xc, order), kernel, s, d, begin, out)
        size = device_scalar(math.prod(kernel), xc.dtype)
        return _root(binary(f"mul_{dtype_suffix(xc.dtype)}", mean, size, xc.dtype), order)

    return in_float32(run, x)


# ---------------------------------------------------------------------------------------------
# MaxUnpool and ONNX Runtime training's pooling gradients


def _keys_within(indices, lo, hi, outside: int):
    """``indices`` where lo <= index < hi (device int64 arrays that broadcast against them), else
    ``outside``: past the end of the row scatter's rows, so that its range flag reports the index
    (the scatter would otherwise count a negative index from the end)."""
    inside = and_(greater_or_equal(indices, lo), less(indices, hi))
    return where(inside, indices, device_scalar(outside, np.int64))


def _zero_padded(block, shape):
    """``block`` in the leading corner of zeros of ``shape`` (``block`` itself where they agree)."""
    rt = runtime()
    if tuple(block.shape) == tuple(shape):
        return block
    out = rt.zeros(tuple(shape), block.dtype)
    strided_copy(out, rt.contiguous_strides(shape), 0, block, rt.contiguous_strides(block.shape), 0, block.shape)
    return out


@cuda_kernel("MaxUnpool", host_inputs=(2,))
def max_unpool(x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    """Zeros with X written at MaxPool's flat indices into the inferred shape: indexing's row
    scatter, the last of equal indices winning as in numpy's assignment; a larger output_shape
    holds that block in the leading corner of its zeros. An index outside [0, size) raises the CPU
    kernel's error. Non-float X and int32 indices run the CPU kernel."""
    rt = runtime()
    inferred, shape = unpool_shapes(x.shape, indices.shape, output_shape, kernel_shape, pads, strides)
    size = math.prod(inferred)
    if not is_float(x.dtype) or indices.dtype != np.int64 or size >= INT32_LIMIT:
        return cpu_fallback("MaxUnpool", x, indices, output_shape, kernel_shape=kernel_shape, pads=pads, strides=strides)

    def on_error(_value):
        check_unpool_indices(rt.to_host(indices).reshape(-1), size)  # raises the CPU kernel's error
        return f"an index is out of range for the flattened output of {size} elements"

    if size == 0 or x.size == 0:
        if indices.size:  # size 0: every index is out of range
            check_unpool_indices(rt.to_host(indices).reshape(-1), size)
        return rt.zeros(tuple(shape), x.dtype)
    keys = _keys_within(indices, device_scalar(0, np.int64), device_scalar(size, np.int64), size)
    flat, flag = row_scatter(contiguous(x), keys, 1, size, 1, x.size, [size], [1], mode=1)
    rt.check_flag(flag, on_error)
    return _zero_padded(flat.reshape(tuple(inferred)), shape)


_PLANE_BOUNDS: dict = {}


def _plane_bounds(lines: tuple, plane: int, ns: int):
    """Device int64 arrays of shape (N, C, 1, ...): each (n, c) plane's first flat position in X
    and one past its last (uploaded once per shape)."""
    rt = runtime()

    def make():
        if not _PLANE_BOUNDS:
            rt.drop_at_exit(_PLANE_BOUNDS.clear)  # device arrays go while the context is current
        first = (np.arange(math.prod(lines), dtype=np.int64) * plane).reshape(*lines, *(1,) * ns)
        with rt.persistent():
            return rt.to_device(first), rt.to_device(first + plane)

    return plan_cache(_PLANE_BOUNDS, (lines, plane, ns), make)


@cuda_kernel("MaxPoolGrad")
def max_pool_grad(
    dY, Indices, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None, storage_order=0, strides=None
):
    """dX: dY added at MaxPool's Indices (flat positions in X, batch and channel included), each
    element's terms summed in position order (indexing's row scatter; float32 sums for 16-bit dY).
    An index outside its own (n, c) plane of dX raises the CPU kernel's error: it is mapped past
    dX's end, where the scatter's range flag reports it. Non-float dY and int32 indices run the
    CPU kernel."""
    rt = runtime()
    attrs = dict(
        auto_pad=auto_pad,
        ceil_mode=ceil_mode,
        dilations=dilations,
        kernel_shape=kernel_shape,
        pads=pads,
        storage_order=storage_order,
        strides=strides,
    )
    same_shape(dY, Indices, "dY", "Indices")
    shape, *_ = pool_grad_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    total = math.prod(shape)
    if not is_float(dY.dtype) or Indices.dtype != np.int64 or total >= INT32_LIMIT:
        return cpu_fallback("MaxPoolGrad", dY, Indices, **attrs)
    if dY.size == 0:
        return rt.zeros(tuple(shape), dY.dtype)

    def on_error(_value):
        cpu_max_pool_grad(rt.to_host(dY), rt.to_host(Indices), **attrs)  # raises the CPU kernel's error
        return "MaxPool indices fall outside the input shape that the pooling windows cover"

    first, end = _plane_bounds(tuple(shape[:2]), math.prod(shape[2:]), len(shape) - 2)
    keys = _keys_within(Indices, first, end, total)
    dx, flag = row_scatter(contiguous(dY), keys, 1, total, 1, dY.size, [total], [1])
    rt.check_flag(flag, on_error)
    return dx.reshape(tuple(shape))


_AVERAGE_POOL_GRAD_PLANS: dict = {}


def _average_pool_grad_plan(out: tuple, spatial: tuple, kernel: tuple, strides: tuple, begin: tuple, include_pad: bool, dtype):
    """(the divisor of each output position, shape ``out``; a ones kernel (1, 1, *kernel)) on the
    device in ``dtype``: the kernel's size (count_include_pad) or the window's taps inside dX, 1 for
    a window entirely in the padding (its share reaches no element of dX)."""
    rt = runtime()
    if not _AVERAGE_POOL_GRAD_PLANS:
        rt.drop_at_exit(_AVERAGE_POOL_GRAD_PLANS.clear)  # device arrays go while the context is current
    if include_pad:
        divisor = np.full(out, math.prod(kernel), np.int64)
    else:
        divisor = np.ones((), np.int64)
        for lo, hi in clipped_windows(out, strides, begin, kernel, spatial):
            divisor = np.multiply.outer(divisor, np.maximum(hi - lo, 0))
    divisor = np.where(divisor > 0, divisor, 1).astype(dtype)
    with rt.persistent():
        return rt.to_device(divisor), rt.to_device(np.ones((1, 1, *kernel), dtype))


@cuda_kernel("AveragePoolGrad")
def average_pool_grad(
    dY, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None, pads=None, strides=None
):
    """dX: each dY divided by its window's count, then spread over the window's taps inside dX: the
    transpose of a window sum, ConvTranspose with a ones kernel over (N*C, 1, *spatial), as
    gradgen's AveragePool gradient computes it; the divisors are a table per output position,
    uploaded once per shape (float32 for 16-bit dY, rounded once). Non-float dY runs the CPU kernel."""
    rt = runtime()
    attrs = dict(
        auto_pad=auto_pad,
        ceil_mode=ceil_mode,
        count_include_pad=count_include_pad,
        dilations=dilations,
        kernel_shape=kernel_shape,
        pads=pads,
        strides=strides,
    )
    shape, begin, kernel, s = average_pool_grad_geometry(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    if not is_float(dY.dtype):
        return cpu_fallback("AveragePoolGrad", dY, **attrs)
    if dY.size == 0:
        return rt.zeros(tuple(shape), dY.dtype)
    out, spatial = tuple(int(v) for v in dY.shape[2:]), tuple(shape[2:])
    # end pads of the Conv whose output is dY's: (out - 1) * stride + kernel covers the padded dX
    end = [(o - 1) * st + k - n - b for o, st, k, n, b in zip(out, s, kernel, spatial, begin)]
    include_pad = bool(int(count_include_pad))

    def run(dy):
        key = (out, spatial, tuple(kernel), tuple(s), tuple(begin), include_pad, np.dtype(dy.dtype).str)
        divisor, ones = plan_cache(
            _AVERAGE_POOL_GRAD_PLANS,
            key,
            lambda: _average_pool_grad_plan(out, spatial, tuple(kernel), tuple(s), tuple(begin), include_pad, dy.dtype),
        )
        scaled = binary(f"div_{dtype_suffix(dy.dtype)}", dy, divisor, dy.dtype)
        lines = scaled.reshape((int(shape[0]) * int(shape[1]), 1, *out))
        return conv_transpose(lines, ones, strides=list(s), pads=list(begin) + end).reshape(tuple(shape))

    return in_float32(run, dY)


# ---------------------------------------------------------------------------------------------
# Resize
#
# The geometry comes from the CPU kernel's own per-axis matrices (gradgen/ops/pool.py,
# resize_matrices: every mode, coordinate transformation and rounding rule), read as taps: for each
# output coordinate of an axis, the input coordinates and weights of its row's non-zero entries.
# Nearest (a single weight 1 per row) is one gather pass over all axes, moving bits, for any dtype;
# linear and cubic run one pass per resized axis in double, like the CPU kernel's matrix products,
# for the float types. Integer data with linear or cubic modes and ranks above the kernels'
# maximum run the CPU kernel. The tables are uploaded once per geometry (plan cache).

_RESIZE_PLANS: dict = {}


def _resize_plan(shape, dtype, roi, scales, sizes, attrs: dict, opset: int):
    """("copy", None) | ("nearest", (table, offsets, out shape)) | ("taps", (out shape, passes)) |
    ("cpu", None); each pass is (axis, n_in, n_out, taps, idx, weights)."""
    from gradgen.ops.attributes import text
    from gradgen.ops.pool import resize_geometry, resize_matrices

    rt = runtime()
    ctm = attrs["coordinate_transformation_mode"]
    nearest_mode = attrs["nearest_mode"]
    if opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        scales, roi, ctm, nearest_mode = roi, None, "asymmetric", "floor"
    out, factors = resize_geometry(
        shape, scales, sizes, axes=attrs["axes"], keep_aspect_ratio_policy=attrs["keep_aspect_ratio_policy"]
    )
    mode = text(attrs["mode"], "nearest")
    matrix_attrs = dict(
        mode=mode,
        coordinate_transformation_mode=ctm,
        nearest_mode=nearest_mode,
        cubic_coeff_a=attrs["cubic_coeff_a"],
        exclude_outside=attrs["exclude_outside"],
        antialias=attrs["antialias"],
    )
    mats = resize_matrices(shape, out, factors, matrix_attrs, roi, attrs["axes"])
    if len(shape) > rt.MAX_RANK or np.dtype(dtype).itemsize not in (1, 2, 4, 8):
        return "cpu", None
    if any(m.shape[0] and not m.shape[1] for m, _ in mats.values()):
        return "cpu", None  # an empty axis resized to a non-empty one (rows of zeros)
    if not mats:
        return "copy", None
    if mode == "nearest":
        columns, offsets, start = [], [], 0
        for axis, n in enumerate(shape):
            if axis not in mats:
                column = np.arange(int(n), dtype=np.int64)
            else:
                m, outside = mats[axis]
                column = np.argmax(m, axis=1).astype(np.int64) if m.size else np.zeros(0, np.int64)
                ones = m[np.arange(m.shape[0]), column] == 1.0
                if outside is not None:
                    column[outside] = -1
                    ones |= outside
                if not ones.all() or np.count_nonzero(m) != int(np.count_nonzero(column >= 0)):
                    return "cpu", None  # not a single 1 per row: not a gather
            columns.append(column)
            offsets.append(start)
            start += column.size
        table = np.concatenate(columns) if columns else np.zeros(1, np.int64)
        with rt.persistent():
            device_table = rt.to_device(table if table.size else np.zeros(1, np.int64))
        return "nearest", (device_table, offsets, [int(d) for d in out])
    if dtype_suffix(dtype) not in FLOATS:
        return "cpu", None
    passes, current = [], [int(d) for d in shape]
    for axis, (m, outside) in mats.items():
        n_out, n_in = m.shape
        taps = max(1, int(np.count_nonzero(m, axis=1).max())) if n_out else 1
        idx = np.zeros((n_out, taps), np.int64)
        w = np.zeros((n_out, taps), np.float64)
        for j in range(n_out):
            (cols,) = np.nonzero(m[j])
            idx[j, : cols.size] = cols
            w[j, : cols.size] = m[j, cols]
        if outside is not None:
            idx[outside, 0] = -1
        with rt.persistent():
            tables = (
                rt.to_device(idx.reshape(-1) if idx.size else np.zeros(1, np.int64)),
                rt.to_device(w.reshape(-1) if w.size else np.zeros(1)),
            )
        passes.append((axis, n_in, n_out, taps, *tables))
        current[axis] = n_out
    return "taps", ([int(d) for d in out], passes)


def _resize_plan_kept(*args):
    """``_resize_plan``, its device tables released at exit while the context is current (a device
    array freed after the context is gone aborts the process)."""
    from gradgen.cuda import runtime as rt

    if not _RESIZE_PLANS:
        rt.drop_at_exit(_RESIZE_PLANS.clear)
    return _resize_plan(*args)


@cuda_kernel("Upsample", host_inputs=(1,))
def upsample(x, scales=None, *, mode="nearest"):
    """Upsample (opsets 7 to 9; ``scales`` an input from 9, an attribute before): Resize-10's
    function, as the CPU kernel computes it, through the Resize launcher."""
    if scales is None:
        raise KernelError("Upsample needs scales")
    return resize(x, None, np.asarray(scales, dtype=np.float32), mode=mode, _opset=10)


@cuda_kernel("Resize", host_inputs=(1, 2, 3))
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
    from gradgen.kernels.cuda.launch import copy, desc, fill_bits, host_key, plan_cache

    rt = runtime()
    attrs = dict(
        antialias=antialias,
        axes=axes,
        coordinate_transformation_mode=coordinate_transformation_mode,
        cubic_coeff_a=cubic_coeff_a,
        exclude_outside=exclude_outside,
        keep_aspect_ratio_policy=keep_aspect_ratio_policy,
        mode=mode,
        nearest_mode=nearest_mode,
    )
    key = (
        tuple(x.shape),
        np.dtype(x.dtype).str,
        host_key(roi),
        host_key(scales),
        host_key(sizes),
        repr(sorted(attrs.items())),
        int(_opset),
    )
    kind, plan = plan_cache(
        _RESIZE_PLANS, key, lambda: _resize_plan_kept(tuple(x.shape), x.dtype, roi, scales, sizes, attrs, int(_opset))
    )
    if kind == "cpu":
        return cpu_fallback("Resize", x, roi, scales, sizes, extrapolation_value=extrapolation_value, _opset=_opset, **attrs)
    if kind == "copy":
        return copy(x)
    x = contiguous(x)
    # the extrapolation value as the CPU kernel writes it: float64, rounded to the output type (the
    # 16-bit types through float32, which the CPU backend computes them in)
    low = np.dtype(x.dtype).itemsize == 2 and is_float(x.dtype)
    fill_value = np.float32(extrapolation_value) if low else np.float64(extrapolation_value)
    if kind == "nearest":
        table, offsets, out_shape = plan
        out = rt.empty(out_shape, x.dtype)
        if out.size == 0:
            return out
        strides = rt.contiguous_strides(x.shape)
        launch(
            kernel_of("pool", f"resize_nearest_w{x.dtype.itemsize}"),
            out.size,
            out,
            x,
            table,
            desc(out_shape, strides),
            desc(offsets),
            fill_bits(fill_value, x.dtype),
            np.int64(out.size),
        )
        return out
    out_shape, passes = plan
    s = dtype_suffix(x.dtype)
    current, shape = x, [int(d) for d in x.shape]
    for k, (axis, n_in, n_out, taps, idx, w) in enumerate(passes):
        last = k == len(passes) - 1
        shape = shape[:axis] + [n_out] + shape[axis + 1 :]
        out = rt.empty(shape, x.dtype if last else np.float64)
        if out.size:
            entry = f"resize_taps_{dtype_suffix(current.dtype)}_{s if last else 'f64'}"
            launch(
                kernel_of("pool", entry),
                out.size,
                out,
                current,
                idx,
                w,
                np.int64(taps),
                np.int64(n_in),
                np.int64(n_out),
                np.int64(math.prod(shape[axis + 1 :])),
                np.float64(fill_value),
                np.int64(out.size),
            )
        current = out
    return current


# ---------------------------------------------------------------------------------------------
# AffineGrid

_AFFINE_BASE_GRIDS: dict = {}


def _affine_base_grid_on_device(spatial: tuple, align_corners: bool, dtype):
    """``affine_base_grid`` (prod(spatial), nd + 1) in ``dtype`` on the device, uploaded once per
    (spatial size, align_corners, dtype) and released at exit while the context is current."""
    rt = runtime()

    def upload():
        if not _AFFINE_BASE_GRIDS:
            rt.drop_at_exit(_AFFINE_BASE_GRIDS.clear)
        with rt.persistent():
            return rt.to_device(affine_base_grid(list(spatial), align_corners, dtype))

    return plan_cache(_AFFINE_BASE_GRIDS, (spatial, align_corners, np.dtype(dtype).str), upload)


@cuda_kernel("AffineGrid", host_inputs=(1,))
def affine_grid(theta, size, *, align_corners=0):
    """grid[n] = base @ theta[n]^T, base the (points, nd + 1) homogeneous coordinates of the output
    positions (the CPU kernel's ``affine_base_grid``, uploaded once per size): one strided-batched
    GEMM (matmul_views, theta read transposed in place, base shared by the batch). float32 and
    float64 in their own type, 16-bit theta in float32 rounded once (as on the CPU); other dtypes
    run the CPU kernel."""
    rt = runtime()
    dims = affine_grid_size(theta.shape, size)
    if not is_float(theta.dtype):
        return cpu_fallback("AffineGrid", theta, size, align_corners=align_corners)
    n, spatial, nd = dims[0], tuple(dims[2:]), len(dims) - 2
    out_shape = (n, *spatial, nd)
    if n == 0:  # nothing to transform (PyCUDA cannot reshape an empty array's null pointer)
        return rt.empty(out_shape, theta.dtype)
    corners = bool(int(align_corners or 0))

    def run(t):
        t = contiguous(t)
        base = _affine_base_grid_on_device(spatial, corners, t.dtype)
        points, k = (int(d) for d in base.shape)
        # theta (n, nd, k) read as its transpose (n, k, nd): strides (nd * k, 1, k)
        grid = matmul_views(base, ((points, k), [k, 1]), t, ((n, k, nd), [nd * k, 1, k]))
        return grid.reshape(out_shape)

    return in_float32(run, theta)


# ---------------------------------------------------------------------------------------------
# MaxRoiPool


@cuda_kernel("MaxRoiPool")
def max_roi_pool(x, rois, *, pooled_shape, spatial_scale=1.0):
    """Y[r, c, ph, pw] = max of X[b_r, c] over roi r's bin (ph, pw), 0 for an empty bin: pool.cu's
    max_roi_pool, one thread per output element finding its bin from the roi with the CPU kernel's
    float32 rounding and looping over it (16-bit X compared in float32: the max is exact). A batch
    index out of range sets a flag, and the CPU kernel's check then raises its error. Other dtypes,
    and rois of another dtype than X's, run the CPU kernel."""
    rt = runtime()
    check_max_roi_pool_shapes(x.shape, rois.shape)
    pooled_h, pooled_w = (int(v) for v in pooled_shape)
    if not is_float(x.dtype) or rois.dtype != x.dtype:
        return cpu_fallback("MaxRoiPool", x, rois, pooled_shape=pooled_shape, spatial_scale=spatial_scale)
    images, channels, height, width = (int(d) for d in x.shape)
    y_shape = (int(rois.shape[0]), channels, pooled_h, pooled_w)
    if math.prod(y_shape) == 0 or x.size == 0:  # no bins, or only empty ones: nothing to read from X
        if rois.shape[0]:
            check_roi_batches(rt.to_host(rois), images)
        return rt.zeros(y_shape, x.dtype)
    rois = contiguous(rois)
    y = rt.empty(y_shape, x.dtype)
    flag = rt.zeros((1,), np.int64)
    launch(
        kernel_of("pool", f"max_roi_pool_{require_suffix(x.dtype)}"),
        y.size,
        y,
        flag,
        contiguous(x),
        rois,
        np.int64(images),
        np.int64(channels),
        np.int64(height),
        np.int64(width),
        np.int64(pooled_h),
        np.int64(pooled_w),
        np.float64(np.float32(spatial_scale)),
        np.int64(y.size),
    )

    def on_error(_value):
        check_roi_batches(rt.to_host(rois), images)  # raises the CPU kernel's error
        return "MaxRoiPool: a roi's batch index is out of range"

    rt.check_flag(flag, on_error)
    return y
