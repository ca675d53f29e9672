"""Numeric helpers shared by the CPU kernels and the CUDA launchers: compute dtypes, integer
arguments, axes, and the spatial window geometry of convolutions and pools.

They are public because both kernel trees use them (a CUDA launcher validates and falls back with
the same rules as the numpy kernel it mirrors).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.errors import KernelError


def accumulation_dtype(dtype) -> np.dtype:
    """The dtype to accumulate in: float32 for the 16-bit floats, the dtype itself otherwise."""
    dtype = np.dtype(dtype)
    if dtype == np.float16 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def float_compute_dtype(dtype) -> np.dtype:
    """The float to compute in: float32 and float64 as they are, anything else (16-bit floats,
    integers) float32."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f" and dtype.itemsize >= 4:
        return dtype
    return np.dtype(np.float32)


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` in [0, rank); a KernelError naming ``what`` when it is outside [-rank, rank)."""
    if not -rank <= axis < rank:
        raise KernelError(f"{what} {axis} is out of range for rank {rank} (valid range [{-rank}, {rank - 1}])")
    return axis + rank if axis < 0 else axis


def int_list(values, what: str) -> list[int]:
    """A 1-D int32/int64 tensor input (shape, axes, starts, ...) as a list of Python ints."""
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise KernelError(f"{what} must be int32 or int64, got {array.dtype}")
    if array.ndim > 1:
        raise KernelError(f"{what} must be 1-D, got shape {list(array.shape)}")
    return [int(v) for v in array.reshape(-1)]


def shape_arg(shape) -> list[int]:
    """A shape input as a list of non-negative ints."""
    dims = int_list(shape, "shape")
    if any(d < 0 for d in dims):
        raise KernelError(f"shape {dims} has a negative dimension")
    return dims


def attr_ints(value, n: int, default: int, name: str) -> list[int]:
    """An ints attribute that must have ``n`` values (``default`` repeated when it is absent)."""
    if value is None:
        return [default] * n
    out = [int(v) for v in np.asarray(value).reshape(-1)]
    if len(out) != n:
        raise KernelError(f"{name} has {len(out)} value(s), expected {n}")
    return out


def same_shape(a: np.ndarray, b: np.ndarray, a_name: str, b_name: str) -> None:
    if a.shape != b.shape:
        raise KernelError(f"{a_name} has shape {list(a.shape)} but {b_name} has shape {list(b.shape)}; they must match")


def channel_shape(x, n_axes_before=1):
    """Shape that broadcasts a per-channel vector against an (N, C, ...) tensor."""
    return (-1,) + (1,) * (x.ndim - 1 - n_axes_before)


def spatial_attrs(x_shape, kernel, strides, dilations, pads, auto_pad, ceil_mode=0):
    """Resolve kernel/strides/dilations/pads and the output spatial shape of a conv or pool.

    Returns (kernel, strides, dilations, pads_begin, pads_end, out_shape) where pads_end may be
    larger than the declared padding (ceil_mode windows that run past the end).
    """
    spatial = list(x_shape[2:])
    n = len(spatial)
    if n == 0:
        raise KernelError(f"input of shape {list(x_shape)} has no spatial dimensions")
    kernel = attr_ints(kernel, n, 1, "kernel_shape")
    strides = attr_ints(strides, n, 1, "strides")
    dilations = attr_ints(dilations, n, 1, "dilations")
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
        p = attr_ints(pads, 2 * n, 0, "pads")
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


def sliding_windows(xp, kernel, strides, dilations, out):
    """(N, C, *out, *kernel) view of the windows of an already padded input."""
    n = len(kernel)
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    view = sliding_window_view(xp, effective, axis=tuple(range(2, 2 + n)))
    index = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))
    index += tuple(slice(None, None, d) for d in dilations)
    return view[index]


def pad_spatial(x, begin, end, value):
    widths = [(0, 0), (0, 0)] + list(zip(begin, end))
    if not any(begin) and not any(end):
        return x
    return np.pad(x, widths, mode="constant", constant_values=value)
