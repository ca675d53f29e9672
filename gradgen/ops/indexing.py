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
            f"of size {size} (valid range [{-size}, {size - 1}])")
    np.add(idx, size, out=idx, where=idx < 0)
    return idx
