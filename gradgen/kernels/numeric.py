"""Numeric helpers shared by the CPU kernels and the CUDA launchers: compute dtypes, shape
checks and spatial windows.

They are public because both kernel trees use them. What an op means (axes, integer arguments,
conv and pool geometry) lives in gradgen/ops.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.errors import KernelError
from gradgen.ops.axes import int_list


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


def broadcasts_to(shape: tuple, target: tuple) -> bool:
    """numpy's broadcasting of ``shape`` against ``target`` gives ``target`` (a per-axis loop:
    ``np.broadcast_shapes`` costs microseconds, more than a small step's arithmetic)."""
    if len(shape) > len(target):
        return False
    offset = len(target) - len(shape)
    return all(d == 1 or d == target[offset + i] for i, d in enumerate(shape))


def shape_arg(shape) -> list[int]:
    """A shape input as a list of non-negative ints."""
    dims = int_list(shape, "shape")
    if any(d < 0 for d in dims):
        raise KernelError(f"shape {dims} has a negative dimension")
    return dims


def same_shape(a: np.ndarray, b: np.ndarray, a_name: str, b_name: str) -> None:
    if a.shape != b.shape:
        raise KernelError(f"{a_name} has shape {list(a.shape)} but {b_name} has shape {list(b.shape)}; they must match")


def channel_shape(x, n_axes_before=1):
    """Shape that broadcasts a per-channel vector against an (N, C, ...) tensor."""
    return (-1,) + (1,) * (x.ndim - 1 - n_axes_before)


def sliding_windows(xp, kernel, strides, dilations, out):
    """(N, C, *out, *kernel) read-only view of the windows of an already padded input."""
    n = len(kernel)
    if xp.flags.c_contiguous and xp.size:
        # the same view built directly (sliding_window_view takes about 20 us of Python)
        spatial = xp.strides[2:]
        steps = tuple(s * st for s, st in zip(strides, spatial)) + tuple(d * st for d, st in zip(dilations, spatial))
        view = np.ndarray((*xp.shape[:2], *out, *kernel), xp.dtype, xp, 0, xp.strides[:2] + steps)
        view.flags.writeable = False
        return view
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    view = sliding_window_view(xp, effective, axis=tuple(range(2, 2 + n)))
    index = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))
    index += tuple(slice(None, None, d) for d in dilations)
    return view[index]


def pad_spatial(x, begin, end, value):
    """``x`` with ``begin`` / ``end`` elements of ``value`` around each spatial axis (a fresh
    array filled, then the input copied in: np.pad costs tens of microseconds of Python)."""
    if not any(begin) and not any(end):
        return x
    if min(begin) < 0 or min(end) < 0:
        widths = [(0, 0), (0, 0)] + list(zip(begin, end))
        return np.pad(x, widths, mode="constant", constant_values=value)
    spatial = x.shape[2:]
    padded = np.full(x.shape[:2] + tuple(b + n + e for b, n, e in zip(begin, spatial, end)), value, dtype=x.dtype)
    inside = (slice(None), slice(None)) + tuple(slice(b, b + n) for b, n in zip(begin, spatial))
    padded[inside] = x
    return padded
