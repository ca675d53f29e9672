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


def tensor_scatter_positions(cache_shape, update_shape, write_indices, mode: str, axis: int) -> tuple[np.ndarray, int]:
    """(positions, axis) of TensorScatter (opset 24): the int64 index along ``axis`` of the cache
    that each element of ``update`` goes to, shaped like ``update``: ``write_indices[b] + i`` for
    batch row b and update position i (modulo the axis length in ``circular`` mode); ``axis``
    normalised. KernelError for a shape, mode or index outside the op's contract (a negative write
    index too, in either mode)."""
    cache_shape, update_shape = tuple(int(d) for d in cache_shape), tuple(int(d) for d in update_shape)
    rank = len(cache_shape)
    if mode not in ("linear", "circular"):
        raise KernelError(f"mode must be 'linear' or 'circular', got {mode!r}")
    if rank < 2 or len(update_shape) != rank:
        raise KernelError(f"past_cache {list(cache_shape)} and update {list(update_shape)} must have one rank, at least 2")
    if not -rank <= int(axis) < rank or int(axis) % rank == 0:
        raise KernelError(f"axis {axis} must name a sequence axis of a rank-{rank} cache, not the batch axis 0")
    axis = int(axis) % rank
    others_differ = any(c != u for d, (c, u) in enumerate(zip(cache_shape, update_shape)) if d != axis)
    if others_differ or update_shape[axis] > cache_shape[axis]:
        raise KernelError(
            f"update {list(update_shape)} must match past_cache {list(cache_shape)} on every axis but {axis}, "
            f"and be no longer on it"
        )
    batch, length, room = cache_shape[0], update_shape[axis], cache_shape[axis]
    if write_indices is None:
        starts = np.zeros(batch, np.int64)
    else:
        starts = np.asarray(write_indices)
        if starts.dtype.kind not in "iu" or starts.shape != (batch,):
            raise KernelError(f"write_indices must be integers of shape [{batch}], got {starts.dtype}{list(starts.shape)}")
        starts = starts.astype(np.int64)
        if (starts < 0).any():  # ONNX's reference would wrap it; onnxruntime refuses it, as here
            b = int(np.argmax(starts < 0))
            raise KernelError(f"write index {int(starts[b])} of batch row {b} is negative")
    positions = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    if mode == "circular":
        positions %= max(room, 1)
    elif positions.size and positions.max() >= room:
        b = int(np.argwhere(positions >= room)[0][0])
        raise KernelError(
            f"write index {int(starts[b])} of batch row {b} puts {length} update position(s) outside axis {axis} "
            f"of size {room} (linear mode: 0 <= index <= {room - length})"
        )
    expanded = positions.reshape((batch,) + (1,) * (axis - 1) + (length,) + (1,) * (rank - axis - 1))
    return np.broadcast_to(expanded, update_shape), axis
