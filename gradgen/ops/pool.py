"""Pooling and resampling geometry: the pooled shape (ceil_mode, auto_pad, declared pads) and
Resize's output shape and interpolation coefficients.

The one definition the CPU kernels, the CUDA launchers, the pooling and Resize gradients and
shape inference's corrections share.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.ops.attributes import text
from gradgen.ops.axes import per_axis
from gradgen.ops.conv import effective_kernel, same_pads


def spatial_geometry(x_shape, kernel, strides, dilations, pads, auto_pad, ceil_mode=0):
    """Resolve kernel/strides/dilations/pads and the output spatial shape of a conv or pool.

    Returns (kernel, strides, dilations, pads_begin, pads_end, out_shape) where pads_end may be
    larger than the declared padding (ceil_mode windows that run past the end).
    """
    spatial = list(x_shape[2:])
    n = len(spatial)
    if n == 0:
        raise KernelError(f"input of shape {list(x_shape)} has no spatial dimensions")
    kernel = per_axis(kernel, n, 1, "kernel_shape")
    strides = per_axis(strides, n, 1, "strides")
    dilations = per_axis(dilations, n, 1, "dilations")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise KernelError("kernel_shape, strides and dilations must be positive")
    effective = effective_kernel(kernel, dilations)
    auto_pad = text(auto_pad, "NOTSET") or "NOTSET"
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end, out = same_pads(spatial, kernel, strides, dilations, auto_pad)
        return kernel, strides, dilations, begin, end, out
    if auto_pad == "VALID":
        begin = [0] * n
        end = [0] * n
    elif auto_pad == "NOTSET":
        p = per_axis(pads, 2 * n, 0, "pads")
        begin, end = p[:n], p[n:]
        if min(p) < 0:
            raise KernelError(f"pads {p} must be non-negative")
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    out = []
    for size, s, e, b, en in zip(spatial, strides, effective, begin, end):
        span = size + b + en - e
        if ceil_mode:  # a window may run past the end, even when the kernel is larger than the input
            o = -(-span // s) + 1
            if (o - 1) * s >= size + b:  # the last window must start inside the input or left pad
                o -= 1
        else:
            o = span // s + 1
        if span < 0 and o < 1:
            raise KernelError(f"the kernel (effective size {e}) is larger than the padded input ({size + b + en})")
        out.append(o)
    end = [max(en, (o - 1) * s + e - size - b) for o, s, e, size, b, en in zip(out, strides, effective, spatial, begin, end)]
    return kernel, strides, dilations, begin, end, out


def pool_window(op_type: str, x_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode=0):
    """``spatial_geometry`` of a pooling kernel's arguments; KernelError when the required
    kernel_shape attribute is missing."""
    if kernel_shape is None:
        raise KernelError(f"{op_type} needs the kernel_shape attribute")
    return spatial_geometry(x_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)


def pool_geometry(x_shape, attrs, op_type: str = "pooling"):
    """``pool_window`` from a pool node's attributes (a mapping of plain values, the ONNX defaults
    for the absent ones): the one pooled-shape rule that the CPU and CUDA kernels, the pooling
    gradients and shape inference share.

    With ``ceil_mode=1`` a last window that would start past the input and its begin padding is
    dropped (as PyTorch and ONNX Runtime do; ONNX's shape inference before opset 22 keeps it).
    """
    get = attrs.get
    return pool_window(
        op_type,
        x_shape,
        get("kernel_shape"),
        get("strides"),
        get("dilations"),
        get("pads"),
        get("auto_pad", "NOTSET"),
        get("ceil_mode", 0),
    )


def declared_pads(auto_pad, pads, begin, end) -> list[int]:
    """The padding a pool declares (what count_include_pad counts): the pads attribute, SAME's
    computed pads, nothing for VALID; never the extra end that ceil_mode windows reach into."""
    ns = len(begin)
    auto = text(auto_pad, "NOTSET") or "NOTSET"
    if auto == "NOTSET":
        return per_axis(pads, 2 * ns, 0, "pads")
    if auto == "VALID":
        return [0] * (2 * ns)
    return list(begin) + list(end)


def pool_output_shape(x_shape, attrs) -> list[int]:
    """The output shape of MaxPool / AveragePool / LpPool on an input of static shape ``x_shape``."""
    *_, out = pool_geometry(x_shape, attrs)
    return [int(x_shape[0]), int(x_shape[1]), *out]


# ---------------------------------------------------------------------------------------------
# Resize


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
        policy = text(keep_aspect_ratio_policy, "stretch")
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


def _resize_coeffs(ratios: np.ndarray, scale: float, mode: str, nearest_mode: str, a: float, antialias: bool) -> np.ndarray:
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
            return np.where(
                x <= 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0)
            )

        if not antialias:
            return kernel(np.concatenate([r + 1, r, 1 - r, 2 - r], axis=1))
        s = min(scale, 1.0)
        start = int(np.floor(-2 / s) + 1)
        taps = np.arange(start, 2 - start)[None, :]
        coeffs = kernel(s * (taps - r))
        return coeffs / coeffs.sum(axis=1, keepdims=True)
    raise KernelError(f"unknown Resize mode {mode!r}")


def resize_axis_matrix(
    n_in: int,
    n_out: int,
    scale: float,
    *,
    mode="nearest",
    coordinate_transformation_mode="half_pixel",
    nearest_mode="round_prefer_floor",
    cubic_coeff_a=-0.75,
    exclude_outside=0,
    antialias=0,
    roi=None,
):
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
    mode = text(mode, "nearest")
    ctm = text(coordinate_transformation_mode, "half_pixel")
    nearest_mode = text(nearest_mode, "round_prefer_floor")
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
        xo = (np.full(n_out, (hi - lo) * (n_in - 1) / 2) if n_out == 1 else y * (hi - lo) * (n_in - 1) / (width - 1)) + lo * (
            n_in - 1
        )
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
    coeffs = _resize_coeffs(ratios, scale, mode, nearest_mode, float(cubic_coeff_a), bool(int(antialias)) and mode != "nearest")
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
    keys = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside", "antialias")
    kwargs = {k: attrs[k] for k in keys if attrs.get(k) is not None}
    rank = len(x_shape)
    roi_axes = list(range(rank)) if axes is None else [int(a) % rank for a in axes]
    roi_bounds = {}
    if roi is not None and np.asarray(roi).size:
        roi = np.asarray(roi, dtype=np.float64).reshape(-1)
        k = len(roi_axes)
        if roi.size != 2 * k:
            raise KernelError(f"roi has {roi.size} value(s), expected {2 * k}")
        roi_bounds = {a: (roi[i], roi[k + i]) for i, a in enumerate(roi_axes)}
    mats = {}
    for axis, (n_in, n_out, s) in enumerate(zip(x_shape, out_shape, factors)):
        m, outside = resize_axis_matrix(int(n_in), int(n_out), s, roi=roi_bounds.get(axis, (0.0, 1.0)), **kwargs)
        if outside is None and n_in == n_out and np.array_equal(m, np.eye(n_in)):
            continue
        mats[axis] = (m, outside)
    return mats


def roi_align_spec(
    coordinate_transformation_mode=None, mode=None, output_height=1, output_width=1, sampling_ratio=0, spatial_scale=1.0
):
    """RoiAlign's attributes as plain values: (half_pixel, mode, output (h, w), sampling_ratio,
    spatial_scale); the opset 16 default half_pixel for the coordinate mode."""
    coordinates = text(coordinate_transformation_mode, "half_pixel") or "half_pixel"
    pooling = (text(mode, "avg") or "avg").lower()
    if coordinates not in ("half_pixel", "output_half_pixel"):
        raise KernelError(f"coordinate_transformation_mode {coordinates!r} is not half_pixel or output_half_pixel")
    if pooling not in ("avg", "max"):
        raise KernelError(f"mode {pooling!r} is not avg or max")
    height, width = int(output_height), int(output_width)
    if height < 1 or width < 1 or int(sampling_ratio) < 0:
        raise KernelError("output_height and output_width must be positive and sampling_ratio not negative")
    return coordinates == "half_pixel", pooling, (height, width), int(sampling_ratio), float(spatial_scale)
