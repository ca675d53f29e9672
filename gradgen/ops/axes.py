"""Axis arguments: normalisation, validation and integer lists.

One rule for every layer: an axis of a rank-r tensor lies in [-r, r-1] and counts from the end
when negative. Some ops accept axis 0 on a scalar (Reduce*, Gather-like ops read a rank-0 tensor
as having one position); they pass ``allow_scalar=True``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gradgen.errors import KernelError


def normalize_axis(axis: Any, rank: int, what: str = "axis", *, allow_scalar: bool = False) -> int:
    """``axis`` in [0, rank); KernelError naming ``what`` when it is outside [-rank, rank-1]."""
    axis = int(axis)
    top = max(rank, 1) if allow_scalar else rank
    if not -rank <= axis < top:
        raise KernelError(f"{what} {axis} is out of range for rank {rank} (valid range [{-rank}, {top - 1}])")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes: Sequence[Any], rank: int, what: str = "axes", *, allow_scalar: bool = False) -> list[int]:
    """Every entry of ``axes`` normalised; a repeated axis is an error."""
    values = [int(a) for a in axes]
    normalised = [normalize_axis(a, rank, f"{what} entry", allow_scalar=allow_scalar) for a in values]
    if len(set(normalised)) != len(normalised):
        raise KernelError(f"repeated {what} {values}")
    return normalised


def int_list(values: Any, what: str) -> list[int]:
    """A 1-D integer input or attribute (shape, starts, axes, ...) as a list of Python ints."""
    array = np.asarray(values)
    if array.size and array.dtype.kind not in "iu":
        raise KernelError(f"{what} must be integers, got {array.dtype}")
    if array.ndim > 1:
        raise KernelError(f"{what} must be 1-D, got shape {list(array.shape)}")
    return array.reshape(-1).tolist() if array.dtype.kind in "iu" else [int(v) for v in array.reshape(-1)]


def per_axis(value: Any, n: int, default: int, what: str) -> list[int]:
    """An attribute with one int per spatial axis (strides, dilations, ...), ``default`` when absent."""
    if value is None:
        return [default] * n
    out = [int(v) for v in np.asarray(value).reshape(-1)]
    if len(out) != n:
        raise KernelError(f"{what} has {len(out)} value(s), expected {n}")
    return out
