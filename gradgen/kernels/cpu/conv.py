"""CPU kernels: convolution (Conv, ConvTranspose) and ONNX Runtime training's ConvGrad.

Convolution gathers the receptive fields with ``sliding_window_view`` (a strided view; the
contraction with the weights copies it once, im2col style) and contracts with ``tensordot``/
``einsum``, so the heavy work runs in BLAS. float16 inputs are computed in float32 and cast back;
every output has its input's dtype. Padding follows ONNX (see pool.py).

ConvGrad follows ONNX Runtime training's contract: (dY, X, W) in, (dX, dW, dB) out, each output
optional; float16 (and bfloat16) accumulate in float32.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.errors import KernelError
from gradgen.kernels.numeric import (
    accumulation_dtype,
    attr_ints,
    float_compute_dtype,
    pad_spatial,
    sliding_windows,
    spatial_attrs,
)
from gradgen.kernels.registry import MICROSOFT, cpu_kernel

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
    acc = accumulation_dtype(X.dtype)
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


# ---------------------------------------------------------------- Conv, ConvTranspose


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
    kernel, s, d, begin, end, out = spatial_attrs(x.shape, w.shape[2:], strides, dilations, pads, auto_pad)
    ct = float_compute_dtype(x.dtype)
    xp = pad_spatial(x.astype(ct, copy=False), begin, end, 0)
    win = sliding_windows(xp, kernel, s, d, out)  # (N, C, *out, *k)
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
    s = attr_ints(get("strides"), ns, 1, "strides")
    d = attr_ints(get("dilations"), ns, 1, "dilations")
    op = attr_ints(get("output_padding"), ns, 0, "output_padding")
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
        p = [0] * (2 * ns) if auto_pad == "VALID" else attr_ints(get("pads"), 2 * ns, 0, "pads")
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
    s = attr_ints(strides, ns, 1, "strides")
    d = attr_ints(dilations, ns, 1, "dilations")
    full, begin, out = conv_transpose_geometry(x.shape, w.shape, dict(
        auto_pad=auto_pad, dilations=dilations, output_padding=output_padding, output_shape=output_shape, pads=pads,
        strides=strides))
    ct = float_compute_dtype(x.dtype)
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
