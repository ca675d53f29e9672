"""Shape-op semantics: Slice geometry (shared by Slice and SliceGrad, CPU and CUDA, and the
lowering of SliceGrad)."""

from __future__ import annotations

import math
from typing import Sequence

from gradgen.errors import KernelError
from gradgen.ops.axes import int_list, normalize_axis


def shape_bounds(rank: int, start: int = 0, end: int | None = None) -> tuple[int, int]:
    """The [start, end) of the dims Shape(start=, end=) returns: negative bounds count from the
    end, both clamped to [0, rank]."""
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return start, end


def slice_geometry(dims: Sequence[int], starts, ends, axes=None, steps=None) -> list[tuple[int, int, int]]:
    """(start, step, count) per axis of a Slice of a tensor of shape ``dims``, clamped as the ONNX
    spec says (negative starts/ends counted from the end, INT64_MAX/INT64_MIN ends, negative steps).
    """
    rank = len(dims)
    starts, ends = int_list(starts, "starts"), int_list(ends, "ends")
    if len(starts) != len(ends):
        raise KernelError(f"starts has {len(starts)} values but ends has {len(ends)}")
    axes = list(range(len(starts))) if axes is None else int_list(axes, "axes")
    steps = [1] * len(starts) if steps is None else int_list(steps, "steps")
    if not len(axes) == len(steps) == len(starts):
        raise KernelError(
            f"starts, ends, axes and steps must have one value per sliced axis; "
            f"got {len(starts)}, {len(ends)}, {len(axes)}, {len(steps)}"
        )
    for a in axes:
        if not -rank <= a < rank:
            raise KernelError(f"axes value {a} is out of range for rank {rank} (valid range [{-rank}, {rank - 1}])")
    axes = [a + rank if a < 0 else a for a in axes]
    if len(set(axes)) != len(axes):
        raise KernelError(f"axes {axes} repeats an axis")
    geometry = [(0, 1, int(d)) for d in dims]
    for axis, start, end, step in zip(axes, starts, ends, steps):
        if step == 0:
            raise KernelError(f"steps value for axis {axis} is 0")
        size = int(dims[axis])
        start = start + size if start < 0 else start
        end = end + size if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), size), min(max(end, 0), size)
        elif size == 0:
            start, end = 0, 0
        else:
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
        geometry[axis] = (start, step, len(range(start, end, step)))
    return geometry


def slice_index(geometry: Sequence[tuple[int, int, int]]) -> tuple[slice, ...]:
    """numpy indices for a slice_geometry (a stop below 0 means "to the beginning")."""
    index = []
    for start, step, count in geometry:
        stop = start + step * count
        index.append(slice(start, None if stop < 0 else stop, step))
    return tuple(index)


def slice_window_pads(dims: Sequence[int | None], starts, ends, axes=None) -> list[int] | None:
    """Pad's pads (begins then ends) that undo a step-1 Slice of a tensor of shape ``dims``, or None
    when a sliced dim is unknown or the arguments do not describe a plain window."""
    rank = len(dims)
    starts, ends = [int(v) for v in starts], [int(v) for v in ends]
    axes = list(range(len(starts))) if axes is None else [int(a) for a in axes]
    if not len(starts) == len(ends) == len(axes):
        return None
    axes = [a + rank if a < 0 else a for a in axes]
    if any(not 0 <= a < rank for a in axes) or len(set(axes)) != len(axes):
        return None
    begin, end = [0] * rank, [0] * rank
    for axis, start, stop in zip(axes, starts, ends):
        size = dims[axis]
        if size is None:
            return None
        start = start + size if start < 0 else start
        stop = stop + size if stop < 0 else stop
        start, stop = min(max(start, 0), size), min(max(stop, 0), size)
        stop = max(stop, start)
        begin[axis], end[axis] = start, size - stop
    return begin + end


def reshape_dims(in_shape, dims, allowzero=0) -> list[int]:
    """Reshape's output shape (0 copies a dimension unless allowzero, one -1 is inferred)."""
    in_shape = list(in_shape)
    total = math.prod(in_shape)
    if allowzero and 0 in dims and -1 in dims:
        raise KernelError(f"shape {dims}: with allowzero=1 it may not contain both 0 and -1")
    out = []
    for i, d in enumerate(dims):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise KernelError(f"shape {dims}: 0 at position {i} copies a dimension the input (rank {len(in_shape)}) lacks")
            out.append(in_shape[i])
        elif d < -1:
            raise KernelError(f"shape {dims}: invalid dimension {d}")
        else:
            out.append(d)
    if out.count(-1) > 1:
        raise KernelError(f"shape {dims}: at most one dimension may be -1")
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or total % known:
            raise KernelError(f"cannot reshape input of shape {in_shape} ({total} elements) to {dims}")
        out[out.index(-1)] = total // known
    if math.prod(out) != total:
        raise KernelError(f"cannot reshape input of shape {in_shape} ({total} elements) to {dims}")
    return out


def concat_shape(shapes: Sequence[Sequence[int]], dtypes: Sequence[object], axis) -> tuple[int, list[int]]:
    """Concat's (normalised axis, output shape) for inputs of these shapes and dtypes (None inputs
    left out); KernelError unless they have one rank, one dtype and the same dims off the axis."""
    if not shapes:
        raise KernelError("Concat needs at least one input")
    first = list(shapes[0])
    rank = len(first)
    ax = normalize_axis(axis, rank)
    for i, (shape, dtype) in enumerate(zip(shapes[1:], dtypes[1:]), 1):
        if len(shape) != rank:
            raise KernelError(f"input {i} has rank {len(shape)}, input 0 has rank {rank}")
        if any(shape[d] != first[d] for d in range(rank) if d != ax):
            raise KernelError(f"input {i} has shape {list(shape)}, input 0 has {first}: they must agree on every axis but {ax}")
        if dtype != dtypes[0]:
            raise KernelError(f"input {i} has dtype {dtype}, input 0 has {dtypes[0]}; Concat needs one type")
    out = list(first)
    out[ax] = sum(int(shape[ax]) for shape in shapes)
    return ax, out


BlockRearrangement = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def depth_to_space_plan(shape: Sequence[int], blocksize, mode: str = "DCR") -> BlockRearrangement:
    """DepthToSpace of an NCHW ``shape`` as (blocked shape, permutation, output shape): reshape the
    input to the blocked shape, transpose it by the permutation, reshape to the output shape."""
    if len(shape) != 4:
        raise KernelError(f"DepthToSpace needs a 4-D NCHW input, got rank {len(shape)}")
    b, c, h, w = (int(d) for d in shape)
    bs = int(blocksize)
    if bs < 1 or c % (bs * bs):
        raise KernelError(f"channels ({c}) must be divisible by blocksize^2 ({bs * bs})")
    depth = c // (bs * bs)
    if mode == "DCR":
        blocked, perm = (b, bs, bs, depth, h, w), (0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        blocked, perm = (b, depth, bs, bs, h, w), (0, 1, 4, 2, 5, 3)
    else:
        raise KernelError(f"unknown mode {mode!r}; expected DCR or CRD")
    return blocked, perm, (b, depth, h * bs, w * bs)


def space_to_depth_plan(shape: Sequence[int], blocksize, mode: str = "DCR") -> BlockRearrangement:
    """SpaceToDepth of an NCHW ``shape`` as (blocked shape, permutation, output shape), as
    ``depth_to_space_plan`` (``mode``: the attribute of opset 28)."""
    if len(shape) != 4:
        raise KernelError(f"SpaceToDepth needs a 4-D NCHW input, got rank {len(shape)}")
    b, c, h, w = (int(d) for d in shape)
    bs = int(blocksize)
    if bs < 1 or h % bs or w % bs:
        raise KernelError(f"height ({h}) and width ({w}) must be divisible by blocksize ({bs})")
    perms = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}
    if mode not in perms:
        raise KernelError(f"unknown mode {mode!r}; expected DCR or CRD")
    return (b, c, h // bs, bs, w // bs, bs), perms[mode], (b, c * bs * bs, h // bs, w // bs)
