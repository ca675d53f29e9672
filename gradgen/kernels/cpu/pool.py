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

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.numeric import (
    accumulation_dtype,
    attr_ints,
    float_compute_dtype,
    pad_spatial,
    same_shape,
    sliding_windows,
    spatial_attrs,
)
from gradgen.kernels.registry import cpu_kernel


def pool_geometry(x_shape, attrs):
    """``spatial_attrs`` from a pool node's attributes (a mapping of plain values): the one pooled-shape
    rule that the CPU and CUDA kernels, the pooling gradients and shape inference share.

    With ``ceil_mode=1`` a last window that would start past the input and its begin padding is
    dropped (as PyTorch and ONNX Runtime do; ONNX's shape inference before opset 22 keeps it).
    """
    get = attrs.get
    return spatial_attrs(x_shape, get("kernel_shape"), get("strides"), get("dilations"), get("pads"),
                          get("auto_pad", "NOTSET"), get("ceil_mode", 0))


def declared_pads(auto_pad, pads, begin, end) -> list[int]:
    """The padding a pool declares (what count_include_pad counts): the pads attribute, SAME's
    computed pads, nothing for VALID; never the extra end that ceil_mode windows reach into."""
    ns = len(begin)
    auto = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto == "NOTSET":
        return attr_ints(pads, 2 * ns, 0, "pads")
    if auto == "VALID":
        return [0] * (2 * ns)
    return list(begin) + list(end)


def pool_output_shape(x_shape, attrs) -> list[int]:
    """The output shape of MaxPool / AveragePool / LpPool on an input of static shape ``x_shape``."""
    *_, out = pool_geometry(x_shape, attrs)
    return [int(x_shape[0]), int(x_shape[1]), *out]


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
    if kernel_shape is None:
        raise KernelError("MaxPool needs the kernel_shape attribute")
    kernel, s, d, begin, end, out = spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    xp = pad_spatial(x, begin, end, _lowest(x.dtype))
    win = sliding_windows(xp, kernel, s, d, out)
    k_axes = tuple(range(2 + ns, 2 + 2 * ns))
    y = np.ascontiguousarray(win.max(axis=k_axes), dtype=x.dtype)
    if _num_outputs < 2:
        return y
    # Indices: position of the (first) maximum in the flattened unpadded input tensor.
    if y.size == 0:
        return y, np.zeros(y.shape, dtype=np.int64)
    flat = win.reshape(win.shape[: 2 + ns] + (int(np.prod(kernel)),))
    tap = np.argmax(flat, axis=-1)
    taps = np.unravel_index(tap, kernel)
    spatial = x.shape[2:]
    coords = []
    for axis in range(ns):
        o = np.arange(out[axis]).reshape((-1,) + (1,) * (ns - 1 - axis)) * s[axis]
        coords.append(o + taps[axis] * d[axis] - begin[axis])
    coords = np.broadcast_arrays(*coords)
    order = "F" if int(storage_order) == 1 else "C"
    pos = np.ravel_multi_index(tuple(np.clip(c, 0, n - 1) for c, n in zip(coords, spatial)), spatial, order=order)
    nc = np.arange(x.shape[0] * x.shape[1]).reshape(x.shape[0], x.shape[1], *([1] * ns))
    indices = nc * int(np.prod(spatial)) + pos
    return y, indices.astype(np.int64)


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
    if kernel_shape is None:
        raise KernelError("AveragePool needs the kernel_shape attribute")
    kernel, s, d, begin, end, out = spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = float_compute_dtype(x.dtype)
    xp = pad_spatial(x.astype(ct, copy=False), begin, end, 0)
    total = sliding_windows(xp, kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
    # Divisor: taps inside the input, or (count_include_pad) inside the declared padding too;
    # taps in the extra region that ceil_mode adds past the end padding never count.
    declared = declared_pads(auto_pad, pads, begin, end)
    count = np.ones((), dtype=np.int64)
    for axis in range(ns):
        size = x.shape[2 + axis]
        if int(count_include_pad):
            lo, hi = -begin[axis], size + declared[ns + axis]
        else:
            lo, hi = 0, size
        c = _window_counts(size, kernel[axis], s[axis], d[axis], begin[axis], out[axis], lo, hi)
        count = np.multiply.outer(count, c)
    with np.errstate(invalid="ignore", divide="ignore"):
        y = total / count.astype(ct)
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
    if kernel_shape is None:
        raise KernelError("LpPool needs the kernel_shape attribute")
    kernel, s, d, begin, end, out = spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = float_compute_dtype(x.dtype)
    powered = np.abs(x.astype(ct, copy=False)) ** ct.type(p)
    total = sliding_windows(pad_spatial(powered, begin, end, 0), kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
    return np.ascontiguousarray(total ** ct.type(1.0 / p), dtype=x.dtype)


@cpu_kernel("MaxUnpool")
def max_unpool(x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    """Scatter X into zeros at MaxPool's flattened indices. The indices address the inferred
    shape ((in - 1) * stride - pads + kernel per axis); output_shape, when given, only adds zero
    room after it (what ONNX's reference and test_maxunpool_export_with_output_shape expect)."""
    if kernel_shape is None:
        raise KernelError("MaxUnpool needs the kernel_shape attribute")
    ns = x.ndim - 2
    k = attr_ints(kernel_shape, ns, 1, "kernel_shape")
    s = attr_ints(strides, ns, 1, "strides")
    p = attr_ints(pads, 2 * ns, 0, "pads")
    inferred = [(x.shape[2 + i] - 1) * s[i] - (p[i] + p[ns + i]) + k[i] for i in range(ns)]
    inferred = list(x.shape[:2]) + inferred
    shape = inferred if output_shape is None else [int(v) for v in np.asarray(output_shape).reshape(-1)]
    if len(shape) != x.ndim or any(a < b for a, b in zip(shape, inferred)):
        raise KernelError(f"output_shape {shape} is smaller than the inferred shape {inferred}")
    if indices.shape != x.shape:
        raise KernelError(f"indices shape {list(indices.shape)} differs from X's {list(x.shape)}")
    size = int(np.prod(inferred))
    idx = indices.astype(np.int64).reshape(-1)
    bad = (idx < 0) | (idx >= size)
    if bad.any():
        raise KernelError(f"index {int(idx[bad][0])} is out of range for the flattened output of {size} elements; "
                          f"valid range is [0, {size - 1}]")
    flat = np.zeros(size, dtype=x.dtype)
    flat[idx] = x.reshape(-1)
    result = np.zeros(shape, dtype=x.dtype)
    result[tuple(slice(0, n) for n in inferred)] = flat.reshape(inferred)
    return result


# ---------------------------------------------------------------------------------------------
# resize
#
# Resize (nearest, linear, cubic) is separable: along each axis the output is a fixed matrix
# M (out x in) times the input, so the kernel applies one matrix per resized axis and the gradient
# rule applies their transposes (both from ``resize_axis_matrix``).


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


def resize_geometry(x_shape, scales=None, sizes=None, *, axes=None, keep_aspect_ratio_policy="stretch"):
    """(output shape, per-axis scale) of a Resize; ``scales``/``sizes`` cover ``axes`` (all by default)."""
    rank = len(x_shape)
    axes = list(range(rank)) if axes is None else [int(a) % rank for a in np.asarray(axes).reshape(-1)]
    out = [int(n) for n in x_shape]
    factor = [1.0] * rank
    if sizes is not None and np.asarray(sizes).size:
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(sizes) != len(axes):
            raise KernelError(f"sizes has {len(sizes)} value(s) for {len(axes)} axes")
        policy = _text(keep_aspect_ratio_policy, "stretch")
        if policy == "stretch":
            for a, n in zip(axes, sizes):
                out[a], factor[a] = n, n / x_shape[a]
        elif policy in ("not_larger", "not_smaller"):
            ratios = [n / x_shape[a] for a, n in zip(axes, sizes)]
            s = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                out[a], factor[a] = int(np.floor(s * x_shape[a] + 0.5)), s
        else:
            raise KernelError(f"unknown keep_aspect_ratio_policy {policy!r}")
    elif scales is not None and np.asarray(scales).size:
        scales = [float(v) for v in np.asarray(scales, dtype=np.float64).reshape(-1)]
        if len(scales) != len(axes):
            raise KernelError(f"scales has {len(scales)} value(s) for {len(axes)} axes")
        for a, s in zip(axes, scales):
            if s <= 0:
                raise KernelError(f"scale {s} of axis {a} is not positive")
            out[a], factor[a] = int(np.floor(x_shape[a] * s)), s
    else:
        raise KernelError("Resize needs either scales or sizes")
    return out, factor


def _resize_coeffs(ratios: np.ndarray, scale: float, mode: str, nearest_mode: str, a: float,
                   antialias: bool) -> np.ndarray:
    """(n_out, taps) interpolation coefficients for ratios in (0, 1] (1 when the source coordinate is
    an integer), as ONNX's reference computes them."""
    r = ratios[:, None]
    if mode == "nearest":
        integer = r == 1.0
        if nearest_mode == "round_prefer_floor":
            left = r <= 0.5
        elif nearest_mode == "round_prefer_ceil":
            left = r < 0.5
        elif nearest_mode == "floor":
            left = np.ones_like(r, dtype=bool)
        elif nearest_mode == "ceil":
            left = np.zeros_like(r, dtype=bool)
        else:
            raise KernelError(f"unknown nearest_mode {nearest_mode!r}")
        left = left & ~integer
        return np.concatenate([left, ~left], axis=1).astype(np.float64)
    if mode == "linear":
        if not antialias:
            return np.concatenate([1.0 - r, r], axis=1)
        s = min(scale, 1.0)
        start = int(np.floor(-1 / s) + 1)
        taps = np.arange(start, start + 2 - 2 * start)[None, :]
        coeffs = np.clip(1 - np.abs((taps - r) * s), 0, 1)
        return coeffs / coeffs.sum(axis=1, keepdims=True)
    if mode == "cubic":
        def kernel(x):
            x = np.abs(x)
            return np.where(x <= 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                            np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))
        if not antialias:
            return kernel(np.concatenate([r + 1, r, 1 - r, 2 - r], axis=1))
        s = min(scale, 1.0)
        start = int(np.floor(-2 / s) + 1)
        taps = np.arange(start, 2 - start)[None, :]
        coeffs = kernel(s * (taps - r))
        return coeffs / coeffs.sum(axis=1, keepdims=True)
    raise KernelError(f"unknown Resize mode {mode!r}")


def resize_axis_matrix(n_in: int, n_out: int, scale: float, *, mode="nearest",
                       coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_floor",
                       cubic_coeff_a=-0.75, exclude_outside=0, antialias=0, roi=None):
    """One axis of ONNX Resize as ``(M, outside)``: the (n_out, n_in) float64 matrix with
    y = M x along the axis, and for tf_crop_and_resize the output positions that take
    extrapolation_value instead (their rows of M are zero; None otherwise). A vectorised port of
    ONNX's reference implementation (edge padding = clamped indices, ties to the left). align_corners
    and tf_crop_and_resize space the samples by the fractional width ``scale * n_in`` as the
    reference and ONNX's conformance tests do (ONNX Runtime and PyTorch use the output length).
    A single output on an axis (``length_resized`` = 1, the spec's condition) samples coordinate 0
    with pytorch_half_pixel and the roi's centre with tf_crop_and_resize, as the spec and ONNX
    Runtime do; the reference tests the fractional width instead and samples -0.5, which cubic
    weights differently."""
    mode = _text(mode, "nearest")
    ctm = _text(coordinate_transformation_mode, "half_pixel")
    nearest_mode = _text(nearest_mode, "round_prefer_floor")
    width = scale * n_in  # the output width before truncation
    y = np.arange(n_out, dtype=np.float64)
    outside = None
    if ctm == "align_corners":
        xo = np.zeros(n_out) if n_out == 1 else y * (n_in - 1) / (width - 1)
    elif ctm == "asymmetric":
        xo = y / scale
    elif ctm == "tf_crop_and_resize":
        if roi is None:
            raise KernelError("Resize with tf_crop_and_resize needs roi")
        lo, hi = float(roi[0]), float(roi[1])
        xo = (np.full(n_out, (hi - lo) * (n_in - 1) / 2) if n_out == 1
              else y * (hi - lo) * (n_in - 1) / (width - 1)) + lo * (n_in - 1)
        outside = (xo < 0) | (xo > n_in - 1)
    elif ctm == "pytorch_half_pixel":
        xo = np.zeros(n_out) if n_out == 1 else (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel":
        xo = (y + 0.5) / scale - 0.5
    elif ctm == "half_pixel_symmetric":
        xo = (n_in / 2) * (1 - n_out / width) + (y + 0.5) / scale - 0.5
    else:
        raise KernelError(f"unknown coordinate_transformation_mode {ctm!r}")
    m = np.zeros((n_out, n_in), dtype=np.float64)
    if n_out == 0:
        return m, outside
    floor = np.floor(xo)
    ratios = np.where(xo == floor, 1.0, xo - floor)
    coeffs = _resize_coeffs(ratios, scale, mode, nearest_mode, float(cubic_coeff_a),
                            bool(int(antialias)) and mode != "nearest")
    taps = coeffs.shape[1]
    pad = int(np.ceil(taps / 2))
    padded = xo + pad
    p = np.floor(padded)
    frac = padded - p
    if taps % 2 == 0:
        offset = np.where(frac == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        base = -((taps - 1) // 2)
        offset = np.where(frac <= 0.5, base, base + 1)
    index = (p + offset)[:, None].astype(np.int64) + np.arange(taps)[None, :] - pad
    if int(exclude_outside):
        coeffs = np.where((index < 0) | (index >= n_in), 0.0, coeffs)
        total = coeffs.sum(axis=1, keepdims=True)
        coeffs = coeffs / np.where(total == 0, 1.0, total)
    rows = np.repeat(np.arange(n_out), taps)
    np.add.at(m, (rows, np.clip(index, 0, n_in - 1).reshape(-1)), coeffs.reshape(-1))
    if outside is not None:
        m[outside] = 0.0
        if not outside.any():
            outside = None
    return m, outside


def resize_matrices(x_shape, out_shape, factors, attrs: dict, roi=None, axes=None) -> dict:
    """Axis -> (M, outside) for every axis Resize changes (identity axes are left out). ``roi``
    is the Resize roi input (starts then ends, over ``axes`` or all axes)."""
    keys = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside",
            "antialias")
    kwargs = {k: attrs[k] for k in keys if attrs.get(k) is not None}
    rank = len(x_shape)
    roi_axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    per_axis = {}
    if roi is not None and np.asarray(roi).size:
        roi = np.asarray(roi, dtype=np.float64).reshape(-1)
        k = len(roi_axes)
        if roi.size != 2 * k:
            raise KernelError(f"roi has {roi.size} value(s), expected {2 * k}")
        per_axis = {a: (roi[i], roi[k + i]) for i, a in enumerate(roi_axes)}
    mats = {}
    for axis, (n_in, n_out, s) in enumerate(zip(x_shape, out_shape, factors)):
        m, outside = resize_axis_matrix(int(n_in), int(n_out), s, roi=per_axis.get(axis, (0.0, 1.0)), **kwargs)
        if outside is None and n_in == n_out and np.array_equal(m, np.eye(n_in)):
            continue
        mats[axis] = (m, outside)
    return mats


@cpu_kernel("Resize")
def resize(x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
           extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
           nearest_mode="round_prefer_floor", _opset=13):
    if _opset < 11:  # Resize-10: (X, scales), asymmetric coordinates
        scales, roi, coordinate_transformation_mode, nearest_mode = roi, None, "asymmetric", "floor"
    out, factors = resize_geometry(x.shape, scales, sizes, axes=axes,
                                   keep_aspect_ratio_policy=keep_aspect_ratio_policy)
    attrs = dict(mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                 nearest_mode=nearest_mode, cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                 antialias=antialias)
    y = x.astype(np.float64)
    for axis, (m, outside) in resize_matrices(x.shape, out, factors, attrs, roi, axes).items():
        y = np.moveaxis(np.tensordot(m, y, axes=([1], [axis])), 0, axis)
        if outside is not None:
            index = [slice(None)] * y.ndim
            index[axis] = outside
            y[tuple(index)] = extrapolation_value
    return np.ascontiguousarray(y, dtype=x.dtype)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's pooling gradients


def _pool_input_shape(dy_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """The smallest input shape whose pooling gives ``dy_shape``, and the begin pads."""
    if kernel_shape is None:
        raise KernelError("kernel_shape is required")
    if len(dy_shape) < 3:
        raise KernelError(f"dY must have rank >= 3 (N, C, spatial...), got shape {list(dy_shape)}")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    ns = len(dy_shape) - 2
    kernel = attr_ints(kernel_shape, ns, 1, "kernel_shape")
    s = attr_ints(strides, ns, 1, "strides")
    d = attr_ints(dilations, ns, 1, "dilations")
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
        p = attr_ints(pads, 2 * ns, 0, "pads")
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
def max_pool_grad(dY, Indices, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
                  storage_order=0, strides=None):
    """dX: dY added at MaxPool's Indices (flat positions in X, batch and channel included)."""
    same_shape(dY, Indices, "dY", "Indices")
    shape, _, _, _, _ = _pool_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    plane = math.prod(shape[2:])
    idx = Indices.astype(np.int64).reshape(shape[0] * shape[1], -1)
    owner = np.arange(shape[0] * shape[1], dtype=np.int64)[:, None]
    if idx.size and ((idx < owner * plane) | (idx >= (owner + 1) * plane)).any():
        raise KernelError(f"MaxPool indices fall outside the input shape {shape} that the pooling windows cover: "
                          f"X was larger (windows leave its end uncovered), which dY alone does not tell")
    ct = accumulation_dtype(dY.dtype)
    flat = np.bincount(idx.reshape(-1), weights=dY.astype(np.float64).reshape(-1), minlength=math.prod(shape))
    return flat.reshape(shape).astype(ct).astype(dY.dtype)


@cpu_kernel("AveragePoolGrad")
def average_pool_grad(dY, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                      pads=None, strides=None):
    """dX: each dY spread evenly over its window (clipped to X), divided by the kernel size
    (count_include_pad) or by the clipped window's size. ORT supports 1-3 spatial axes."""
    shape, begin, kernel, s, d = _pool_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    if ns > 3:
        raise KernelError(f"AveragePoolGrad supports 1 to 3 spatial axes, got {ns}")
    if any(v != 1 for v in d):
        raise KernelError(f"AveragePoolGrad does not support dilations {d}")
    ct = accumulation_dtype(dY.dtype)
    dx = np.zeros(shape, dtype=ct)
    dy = dY.astype(ct, copy=False)
    spatial = shape[2:]
    # Per axis and output position: the clipped window [lo, hi).
    bounds = []
    for axis in range(ns):
        start = np.arange(dY.shape[2 + axis]) * s[axis] - begin[axis]
        bounds.append((np.maximum(start, 0), np.minimum(start + kernel[axis], spatial[axis])))
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
