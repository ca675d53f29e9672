"""Indices of Gather-like and Scatter-like ops (and their gradients): negatives count from the end
of the indexed axis; anything outside [-size, size-1] is an error naming the index and its position."""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError


def normalize_indices(indices, size: int, axis: int, what: str = "index", suffix: tuple = ()) -> np.ndarray:
    """An int64 copy of ``indices`` with negatives wrapped; KernelError for an integer outside
    [-size, size-1] (``suffix`` extends the reported position, for GatherND's trailing components)."""
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise KernelError(f"{what} tensor must be integer, got {idx.dtype}")
    idx = idx.astype(np.int64, copy=True)
    bad = (idx < -size) | (idx >= size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        value = int(idx[where])
        raise KernelError(
            f"{what} {value} (at position {list(where + suffix)} of the indices) is out of range for axis {axis} "
            f"of size {size} (valid range [{-size}, {size - 1}])"
        )
    np.add(idx, size, out=idx, where=idx < 0)
    return idx


def check_gather_elements_grad(dy_shape, dims, indices_shape, axis: int) -> None:
    """GatherElementsGrad's shape contract: dY shaped like the indices, of the data's rank, no
    longer than the data on any axis but ``axis`` (normalised)."""
    dy_shape, indices_shape = list(dy_shape), list(indices_shape)
    if dy_shape != indices_shape:
        raise KernelError(f"dY has shape {dy_shape}, but indices have shape {indices_shape}; they must match")
    if len(indices_shape) != len(dims):
        raise KernelError(
            f"indices have rank {len(indices_shape)} (shape {indices_shape}), but the data shape {dims} has rank {len(dims)}"
        )
    for d, (n, m) in enumerate(zip(indices_shape, dims)):
        if d != axis and n > m:
            raise KernelError(
                f"indices shape {indices_shape} exceeds the data shape {dims} on axis {d} (only axis {axis} may be longer)"
            )
