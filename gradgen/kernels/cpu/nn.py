"""CPU kernels: convolution, pooling and normalization (NC* layout, 1-D/2-D/3-D and beyond).

Convolution gathers the receptive fields with ``sliding_window_view`` (a strided view; the
contraction with the weights copies it once, im2col style) and contracts with ``tensordot``/
``einsum``, so the heavy work runs in BLAS. float16 inputs are computed in float32 and cast back;
every output has its input's dtype.

Padding follows ONNX: ``pads`` is ``[x1_begin, x2_begin, ..., x1_end, x2_end, ...]``;
``auto_pad`` SAME_UPPER/SAME_LOWER gives ``ceil(in / stride)`` outputs and puts the odd padding
element at the end/beginning; VALID means no padding.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.errors import KernelError
from gradgen.kernels.registry import cpu_kernel

# ---------------------------------------------------------------------------------------------
# shared helpers


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Precision to compute in: float16 (and other narrow floats) go up to float32."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize >= 4:
        return dtype
    return np.dtype(np.float32)


def _ints(value, n: int, default: int, name: str) -> list[int]:
    if value is None:
        return [default] * n
    out = [int(v) for v in np.asarray(value).reshape(-1)]
    if len(out) != n:
        raise KernelError(f"{name} has {len(out)} value(s), expected {n}")
    return out


def _spatial_attrs(x_shape, kernel, strides, dilations, pads, auto_pad, ceil_mode=0):
    """Resolve kernel/strides/dilations/pads and the output spatial shape of a conv or pool.

    Returns (kernel, strides, dilations, pads_begin, pads_end, out_shape) where pads_end may be
    larger than the declared padding (ceil_mode windows that run past the end).
    """
    spatial = list(x_shape[2:])
    n = len(spatial)
    if n == 0:
        raise KernelError(f"input of shape {list(x_shape)} has no spatial dimensions")
    kernel = _ints(kernel, n, 1, "kernel_shape")
    strides = _ints(strides, n, 1, "strides")
    dilations = _ints(dilations, n, 1, "dilations")
    if min(strides) < 1 or min(dilations) < 1 or min(kernel) < 1:
        raise KernelError("kernel_shape, strides and dilations must be positive")
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-size // s) for size, s in zip(spatial, strides)]
        total = [max(0, (o - 1) * s + e - size) for o, s, e, size in zip(out, strides, effective, spatial)]
        if auto_pad == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
        end = [t - b for t, b in zip(total, begin)]
        return kernel, strides, dilations, begin, end, out
    if auto_pad == "VALID":
        begin = [0] * n
        end = [0] * n
    elif auto_pad == "NOTSET":
        p = _ints(pads, 2 * n, 0, "pads")
        begin, end = p[:n], p[n:]
        if min(p) < 0:
            raise KernelError(f"pads {p} must be non-negative")
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    out = []
    for size, s, e, b, en in zip(spatial, strides, effective, begin, end):
        span = size + b + en - e
        if span < 0:
            raise KernelError(
                f"the kernel (effective size {e}) is larger than the padded input ({size + b + en})"
            )
        o = span // s + 1
        if ceil_mode:
            o = -(-span // s) + 1
            if (o - 1) * s >= size + b:  # the last window must start inside the input or left pad
                o -= 1
        out.append(o)
    end = [max(en, (o - 1) * s + e - size - b) for o, s, e, size, b, en in zip(out, strides, effective, spatial, begin, end)]
    return kernel, strides, dilations, begin, end, out


def pool_geometry(x_shape, attrs):
    """``_spatial_attrs`` from a pool node's attributes (a mapping of plain values): the one pooled-shape
    rule that the CPU and CUDA kernels, the pooling gradients and shape inference share.

    With ``ceil_mode=1`` a last window that would start past the input and its begin padding is
    dropped (as PyTorch and ONNX Runtime do; ONNX's shape inference before opset 22 keeps it).
    """
    get = attrs.get
    return _spatial_attrs(x_shape, get("kernel_shape"), get("strides"), get("dilations"), get("pads"),
                          get("auto_pad", "NOTSET"), get("ceil_mode", 0))


def declared_pads(auto_pad, pads, begin, end) -> list[int]:
    """The padding a pool declares (what count_include_pad counts): the pads attribute, SAME's
    computed pads, nothing for VALID; never the extra end that ceil_mode windows reach into."""
    ns = len(begin)
    auto = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto == "NOTSET":
        return _ints(pads, 2 * ns, 0, "pads")
    if auto == "VALID":
        return [0] * (2 * ns)
    return list(begin) + list(end)


def pool_output_shape(x_shape, attrs) -> list[int]:
    """The output shape of MaxPool / AveragePool / LpPool on an input of static shape ``x_shape``."""
    *_, out = pool_geometry(x_shape, attrs)
    return [int(x_shape[0]), int(x_shape[1]), *out]


def _windows(xp, kernel, strides, dilations, out):
    """(N, C, *out, *kernel) view of the windows of an already padded input."""
    n = len(kernel)
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    view = sliding_window_view(xp, effective, axis=tuple(range(2, 2 + n)))
    index = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))
    index += tuple(slice(None, None, d) for d in dilations)
    return view[index]


def _pad(x, begin, end, value):
    widths = [(0, 0), (0, 0)] + list(zip(begin, end))
    if not any(begin) and not any(end):
        return x
    return np.pad(x, widths, mode="constant", constant_values=value)


def _channel_shape(x, n_axes_before=1):
    """Shape that broadcasts a per-channel vector against an (N, C, ...) tensor."""
    return (-1,) + (1,) * (x.ndim - 1 - n_axes_before)


# ---------------------------------------------------------------------------------------------
# convolution


@cpu_kernel("Conv")
def conv(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"X {list(x.shape)} and W {list(w.shape)} must have the same rank >= 3")
    group = int(group)
    n_batch, channels = x.shape[:2]
    m, c_per_group = w.shape[:2]
    if group < 1 or channels % group or m % group or c_per_group * group != channels:
        raise KernelError(
            f"group={group} does not fit X with {channels} channels and W of shape {list(w.shape)} "
            f"(W.shape[1] * group must equal the channel count; group must divide W.shape[0])"
        )
    if kernel_shape is not None and list(kernel_shape) != list(w.shape[2:]):
        raise KernelError(f"kernel_shape {list(kernel_shape)} differs from W's spatial shape {list(w.shape[2:])}")
    kernel, s, d, begin, end, out = _spatial_attrs(x.shape, w.shape[2:], strides, dilations, pads, auto_pad)
    ct = _compute_dtype(x.dtype)
    xp = _pad(x.astype(ct, copy=False), begin, end, 0)
    win = _windows(xp, kernel, s, d, out)  # (N, C, *out, *k)
    ns = len(kernel)
    wc = w.astype(ct, copy=False)
    k_axes = list(range(2 + ns, 2 + 2 * ns))
    if group == 1:
        y = np.tensordot(win, wc, axes=([1] + k_axes, [1] + list(range(2, 2 + ns))))  # (N, *out, M)
        y = np.moveaxis(y, -1, 1)
    else:
        win_g = win.reshape((n_batch, group, c_per_group) + win.shape[2:])
        w_g = wc.reshape((group, m // group, c_per_group) + tuple(kernel))
        letters = "abcdefghijklmnopqrstuvw"
        o_l, k_l = letters[:ns], letters[ns : 2 * ns]
        y = np.einsum(f"NGC{o_l}{k_l},GMC{k_l}->NGM{o_l}", win_g, w_g, optimize=True)
        y = y.reshape((n_batch, m) + tuple(out))
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape((-1,) + (1,) * ns)
    return np.ascontiguousarray(y, dtype=x.dtype)


def conv_transpose_geometry(x_shape, w_shape, attrs):
    """(full, begin, out) per spatial axis of ConvTranspose: the length of the full (uncropped)
    result, where the output starts in it (negative: before it) and the output length. The one
    rule the kernel and shape inference share (ONNX's inference drops output_shape values of 1)."""
    get = attrs.get
    ns = len(x_shape) - 2
    spatial, kernel = list(x_shape[2:]), list(w_shape[2:])
    s = _ints(get("strides"), ns, 1, "strides")
    d = _ints(get("dilations"), ns, 1, "dilations")
    op = _ints(get("output_padding"), ns, 0, "output_padding")
    effective = [(k - 1) * di + 1 for k, di in zip(kernel, d)]
    full = [si * (size - 1) + op_i + e for si, size, op_i, e in zip(s, spatial, op, effective)]
    auto_pad = get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else (auto_pad or "NOTSET")
    if auto_pad not in ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"):
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    if get("output_shape") is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if get("output_shape") is not None:
            out = [int(v) for v in get("output_shape")][-ns:]
            if len(out) != ns:
                raise KernelError(f"output_shape {list(get('output_shape'))} does not have {ns} spatial dimensions")
        else:
            out = [size * si for size, si in zip(spatial, s)]
        total = [f - o for f, o in zip(full, out)]
        if auto_pad == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
    else:
        p = [0] * (2 * ns) if auto_pad == "VALID" else _ints(get("pads"), 2 * ns, 0, "pads")
        begin = p[:ns]
        out = [f - p[i] - p[ns + i] for i, f in enumerate(full)]
    if min(out) < 1:
        raise KernelError(f"the output spatial shape {out} is empty")
    return full, begin, out


@cpu_kernel("ConvTranspose")
def conv_transpose(
    x,
    w,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"X {list(x.shape)} and W {list(w.shape)} must have the same rank >= 3")
    group = int(group)
    n_batch, channels = x.shape[:2]
    if group < 1 or channels % group or w.shape[0] != channels:
        raise KernelError(f"group={group} does not fit X with {channels} channels and W of shape {list(w.shape)}")
    m = w.shape[1] * group
    ns = x.ndim - 2
    spatial = list(x.shape[2:])
    kernel = list(w.shape[2:])
    if kernel_shape is not None and list(kernel_shape) != kernel:
        raise KernelError(f"kernel_shape {list(kernel_shape)} differs from W's spatial shape {kernel}")
    s = _ints(strides, ns, 1, "strides")
    d = _ints(dilations, ns, 1, "dilations")
    full, begin, out = conv_transpose_geometry(x.shape, w.shape, dict(
        auto_pad=auto_pad, dilations=dilations, output_padding=output_padding, output_shape=output_shape, pads=pads,
        strides=strides))
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    wc = w.astype(ct, copy=False)
    cg, _mg = channels // group, m // group
    # cols: (N, M, *kernel, *in) -- every input pixel times every kernel tap
    parts = []
    for g in range(group):
        part = np.tensordot(xc[:, g * cg : (g + 1) * cg], wc[g * cg : (g + 1) * cg], axes=([1], [0]))
        parts.append(part)  # (N, *in, M/G, *k)
    cols = np.concatenate(parts, axis=1 + ns) if group > 1 else parts[0]
    cols = np.moveaxis(cols, list(range(1, 1 + ns)), list(range(2 + ns, 2 + 2 * ns)))
    # The buffer covers both the full (uncropped) result and the requested window onto it.
    lo = [max(0, -bg) for bg in begin]
    size = [max(f, bg + o) + lw for f, bg, o, lw in zip(full, begin, out, lo)]
    buf = np.zeros((n_batch, m) + tuple(size), dtype=ct)
    for taps in np.ndindex(*kernel):
        target = (slice(None), slice(None)) + tuple(
            slice(lw + t * di, lw + t * di + (n_in - 1) * si + 1, si)
            for lw, t, di, n_in, si in zip(lo, taps, d, spatial, s)
        )
        buf[target] += cols[(slice(None), slice(None)) + taps]
    crop = (slice(None), slice(None)) + tuple(slice(lw + bg, lw + bg + o) for lw, bg, o in zip(lo, begin, out))
    y = buf[crop]
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape((-1,) + (1,) * ns)
    return np.ascontiguousarray(y, dtype=x.dtype)


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
    kernel, s, d, begin, end, out = _spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    xp = _pad(x, begin, end, _lowest(x.dtype))
    win = _windows(xp, kernel, s, d, out)
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
    kernel, s, d, begin, end, out = _spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = _compute_dtype(x.dtype)
    xp = _pad(x.astype(ct, copy=False), begin, end, 0)
    total = _windows(xp, kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
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
    return x.mean(axis=axes, keepdims=True, dtype=_compute_dtype(x.dtype)).astype(x.dtype)


@cpu_kernel("GlobalMaxPool")
def global_max_pool(x):
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


# ---------------------------------------------------------------------------------------------
# normalization


@cpu_kernel("BatchNormalization")
def batch_normalization(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0, _num_outputs=1):
    """Inference form; training_mode=1 (opset 14+) also returns running_mean and running_var.

    Older models (opset < 14) ask for training statistics by having more than one output:
    (Y, mean, var, saved_mean, saved_var); saved_* are the batch mean and (biased) variance.
    """
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    shape = _channel_shape(x)
    sc, bc = scale.astype(ct, copy=False).reshape(shape), bias.astype(ct, copy=False).reshape(shape)
    training = int(training_mode) == 1 or _num_outputs > 1
    if not training:
        mean = input_mean.astype(ct, copy=False).reshape(shape)
        var = input_var.astype(ct, copy=False).reshape(shape)
        y = (xc - mean) / np.sqrt(var + ct.type(epsilon)) * sc + bc
        return y.astype(x.dtype, copy=False)
    axes = (0,) + tuple(range(2, x.ndim))
    batch_mean = xc.mean(axis=axes)
    batch_var = xc.var(axis=axes)
    y = (xc - batch_mean.reshape(shape)) / np.sqrt(batch_var.reshape(shape) + ct.type(epsilon)) * sc + bc
    mom = ct.type(momentum)
    running_mean = input_mean.astype(ct) * mom + batch_mean * (1 - mom)
    running_var = input_var.astype(ct) * mom + batch_var * (1 - mom)
    y = y.astype(x.dtype, copy=False)
    if int(training_mode) == 1:
        return y, running_mean.astype(input_mean.dtype), running_var.astype(input_var.dtype)
    return (y, running_mean.astype(input_mean.dtype), running_var.astype(input_var.dtype),
            batch_mean.astype(input_mean.dtype), batch_var.astype(input_var.dtype))


def _stash_dtype(x_dtype, stash_type: int) -> np.dtype:
    if int(stash_type) != 1:
        raise KernelError(f"stash_type={stash_type} is not supported (only 1, float32)")
    return _compute_dtype(x_dtype)


@cpu_kernel("LayerNormalization")
def layer_normalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    """Returns (Y, Mean, InvStdDev); Mean/InvStdDev have shape x.shape[:axis] + (1,)*... and the
    stash type, float32 (stash_type 1, the only one the spec allows besides bfloat16). Double inputs
    are computed in double (so float64 gradient checks stay precise) and their statistics stored
    in float32, the type the schema gives them."""
    rank = x.ndim
    if not -rank <= axis < rank:
        raise KernelError(f"axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    st = _stash_dtype(x.dtype, stash_type)
    xc = x.astype(st, copy=False)
    axes = tuple(range(axis, rank))
    mean = xc.mean(axis=axes, keepdims=True)
    centered = xc - mean
    var = (centered * centered).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + st.type(epsilon))
    y = centered * inv_std * scale.astype(st, copy=False)
    if bias is not None:
        y = y + bias.astype(st, copy=False)
    return y.astype(x.dtype, copy=False), mean.astype(np.float32, copy=False), inv_std.astype(np.float32, copy=False)


@cpu_kernel("InstanceNormalization")
def instance_normalization(x, scale, bias, *, epsilon=1e-5):
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    axes = tuple(range(2, x.ndim))
    mean = xc.mean(axis=axes, keepdims=True)
    var = xc.var(axis=axes, keepdims=True)
    shape = _channel_shape(x)
    y = (xc - mean) / np.sqrt(var + ct.type(epsilon)) * scale.astype(ct).reshape(shape) + bias.astype(ct).reshape(shape)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("GroupNormalization")
def group_normalization(x, scale, bias, *, epsilon=1e-5, num_groups=None, stash_type=1):
    """Opset 18 form: scale/bias have num_groups entries; opset 21 form: C entries (told apart
    by their length; when num_groups == C both forms agree)."""
    if num_groups is None:
        raise KernelError("GroupNormalization needs the num_groups attribute")
    g = int(num_groups)
    n, c = x.shape[:2]
    if g < 1 or c % g:
        raise KernelError(f"num_groups={g} does not divide the {c} channels")
    st = _stash_dtype(x.dtype, stash_type)
    xg = x.astype(st, copy=False).reshape(n, g, -1)
    mean = xg.mean(axis=2, keepdims=True)
    var = xg.var(axis=2, keepdims=True)
    norm = ((xg - mean) / np.sqrt(var + st.type(epsilon))).reshape(x.shape)
    sc, bc = scale.reshape(-1).astype(st), bias.reshape(-1).astype(st)
    if sc.size == g and g != c:
        sc, bc = np.repeat(sc, c // g), np.repeat(bc, c // g)
    elif sc.size != c:
        raise KernelError(f"scale has {sc.size} entries; expected {c} (channels) or {g} (groups)")
    shape = _channel_shape(x)
    return (norm * sc.reshape(shape) + bc.reshape(shape)).astype(x.dtype, copy=False)


@cpu_kernel("LpNormalization")
def lp_normalization(x, *, axis=-1, p=2):
    p = int(p)
    if p not in (1, 2):
        raise KernelError(f"p must be 1 or 2, got {p}")
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    if p == 1:
        norm = np.abs(xc).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt((xc * xc).sum(axis=axis, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, ct.type(0), xc / norm)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("LRN")
def lrn(x, *, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    if size is None:
        raise KernelError("LRN needs the size attribute")
    size = int(size)
    ct = _compute_dtype(x.dtype)
    sq = x.astype(ct, copy=False) ** 2
    channels = x.shape[1]
    before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
    cum = np.concatenate([np.zeros_like(sq[:, :1]), np.cumsum(sq, axis=1)], axis=1)
    hi = np.minimum(np.arange(channels) + after + 1, channels)
    lo = np.maximum(np.arange(channels) - before, 0)
    square_sum = cum[:, hi] - cum[:, lo]
    y = x.astype(ct, copy=False) / (ct.type(bias) + ct.type(alpha / size) * square_sum) ** ct.type(beta)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("RMSNormalization")
def rms_normalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    rank = x.ndim
    if not -rank <= axis < rank:
        raise KernelError(f"axis {axis} is out of range for rank {rank}")
    axis = axis + rank if axis < 0 else axis
    st = _stash_dtype(x.dtype, stash_type)
    xc = x.astype(st, copy=False)
    mean_square = (xc * xc).mean(axis=tuple(range(axis, rank)), keepdims=True)
    y = xc / np.sqrt(mean_square + st.type(epsilon)) * scale.astype(st, copy=False)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("MeanVarianceNormalization")
def mean_variance_normalization(x, *, axes=(0, 2, 3)):
    """(X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9), as ONNX's function body defines it."""
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    axes = tuple(int(a) for a in axes)
    mean = xc.mean(axis=axes, keepdims=True)
    var = (xc * xc).mean(axis=axes, keepdims=True) - mean * mean
    y = (xc - mean) / (np.sqrt(var) + ct.type(1e-9))
    return y.astype(x.dtype, copy=False)


@cpu_kernel("LpPool")
def lp_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None, strides=None):
    """(sum over the window of |x|^p)^(1/p); padding contributes zeros."""
    if kernel_shape is None:
        raise KernelError("LpPool needs the kernel_shape attribute")
    kernel, s, d, begin, end, out = _spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    ct = _compute_dtype(x.dtype)
    powered = np.abs(x.astype(ct, copy=False)) ** ct.type(p)
    total = _windows(_pad(powered, begin, end, 0), kernel, s, d, out).sum(axis=tuple(range(2 + ns, 2 + 2 * ns)))
    return np.ascontiguousarray(total ** ct.type(1.0 / p), dtype=x.dtype)


@cpu_kernel("MaxUnpool")
def max_unpool(x, indices, output_shape=None, *, kernel_shape=None, pads=None, strides=None):
    """Scatter X into zeros at MaxPool's flattened indices. The indices address the inferred
    shape ((in - 1) * stride - pads + kernel per axis); output_shape, when given, only adds zero
    room after it (what ONNX's reference and test_maxunpool_export_with_output_shape expect)."""
    if kernel_shape is None:
        raise KernelError("MaxUnpool needs the kernel_shape attribute")
    ns = x.ndim - 2
    k = _ints(kernel_shape, ns, 1, "kernel_shape")
    s = _ints(strides, ns, 1, "strides")
    p = _ints(pads, 2 * ns, 0, "pads")
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
