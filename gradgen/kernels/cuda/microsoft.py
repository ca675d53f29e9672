"""CUDA launchers: the com.microsoft gradient ops (microsoft.cu; SliceGrad uses copy.cu's lattice kernel).

Contracts are ONNX Runtime training's (see the CPU kernels in gradgen/kernels/cpu/microsoft.py):
GatherGrad is (shape, indices, dY), GatherElementsGrad is (dY, shape, indices); shapes live on the
host. Results are deterministic (bit-identical across runs): negative indices are normalised first,
positions are grouped by a stable counting sort (integer atomics only) and every output element is
summed in position order. GatherElementsGrad also has an atomicAdd path (``deterministic=False``,
or GRADGEN_DETERMINISTIC=0 for the executor's default). ConvGrad lives in conv.py.

``row_scatter`` and ``line_scatter`` are shared with ScatterND / ScatterElements (indexing.py).
"""

from __future__ import annotations

import math
import os

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import microsoft as cpu
from gradgen.kernels.cuda import copy as cp
from gradgen.kernels.registry import MICROSOFT, cuda_kernel

_FLOATS = ("float16", "float32", "float64")
_VEC = {"float16": 8, "float32": 4, "float64": 2}
_ACC = {"float16": 4, "float32": 4, "float64": 8}
CHUNK = 256  # positions per chunk of a long row (rows with more are summed in two levels)
_TILE = 2048  # positions per tile of csr_tile_sort (TS_TILE in microsoft.cu)
_SCAN_THREADS = 1024
_LINE_SMEM = 24 * 1024  # bytes of shared memory a line scatter may use for its line


def _rt():
    from gradgen.cuda import runtime as rt

    return rt


def default_deterministic() -> bool:
    return os.environ.get("GRADGEN_DETERMINISTIC", "1").strip().lower() not in ("0", "false", "no", "off")


def _float_dtype(x, what="dY") -> str:
    name = np.dtype(x.dtype).name
    if name not in _FLOATS:
        raise KernelError(f"{what} has dtype {x.dtype}; the CUDA kernel supports float16, float32 and float64")
    return name


def _index_suffix(indices) -> str:
    if indices.dtype == np.int32:
        return "i32"
    if indices.dtype == np.int64:
        return "i64"
    raise KernelError(f"indices must be int32 or int64, got {indices.dtype}")


def _dev(x):
    rt = _rt()
    return x if rt.is_device(x) else rt.to_device(np.asarray(x))


def _addr(x) -> np.uintp:
    return np.uintp(0) if x is None or x.size == 0 else np.uintp(int(x.gpudata))


def raise_index_error(indices, size: int, axis: int, normalise=None) -> None:
    """The CPU kernel's exact message for the first out-of-range index (after a device flag was set)."""
    host = _rt().to_host(indices)
    (normalise or cpu._normalize_indices)(host, size, axis)
    raise KernelError(f"an index is out of range for axis {axis} of size {size} (valid range [{-size}, {size - 1}])")


# ---------------------------------------------------------------- SliceGrad


@cuda_kernel("SliceGrad", domain=MICROSOFT, host_inputs=(1, 2, 3, 4, 5))
def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    rt = _rt()
    dims = cpu._shape_arg(shape)
    rank = len(dims)
    starts, ends = cpu._ints(starts, "starts"), cpu._ints(ends, "ends")
    if len(starts) != len(ends):
        raise KernelError(f"starts has {len(starts)} values but ends has {len(ends)}")
    axes = list(range(len(starts))) if axes is None else [cpu._axis(a, rank, "axes value") for a in cpu._ints(axes, "axes")]
    steps = [1] * len(starts) if steps is None else cpu._ints(steps, "steps")
    if not len(axes) == len(steps) == len(starts):
        raise KernelError(f"starts, ends, axes and steps must have one value per sliced axis; "
                          f"got {len(starts)}, {len(ends)}, {len(axes)}, {len(steps)}")
    if len(set(axes)) != len(axes):
        raise KernelError(f"axes {axes} repeats an axis")
    lat_start, lat_step, counts = [0] * rank, [1] * rank, list(dims)
    for axis, start, end, step in zip(axes, starts, ends, steps):
        size = dims[axis]
        if step == 0:
            raise KernelError(f"steps value for axis {axis} is 0")
        start = start + size if start < 0 else start
        end = end + size if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), size), min(max(end, 0), size)
        else:
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
        lat_start[axis], lat_step[axis], counts[axis] = start, step, len(range(start, end, step))
    if math.prod(counts) != dY.size:
        raise KernelError(f"dY has shape {list(dY.shape)}, but the slice of shape {dims} has shape {counts}")
    dX = rt.empty(dims, dY.dtype)
    if dX.size:
        src = cp.contiguous(dY) if dY.size else None
        cp.lattice(dX, src, 0, lat_start, lat_step, counts, rt.contiguous_strides(counts), np.int64(0))
    return dX


# ---------------------------------------------------------------- row scatter (GatherGrad, ScatterND)


def row_scatter(dy, indices, outer: int, rows: int, inner: int, count: int, sizes, multipliers, *, init=None,
                mode: int = 0):
    """dX (outer, rows, inner): dX[o, key(p)] = init (+)= dY[o, p] over positions p (mode 0 add, 1 last wins).

    key(p) = sum_t normalise(indices[p, t], sizes[t]) * multipliers[t]. Returns (dX, flag) with flag a
    device int64 that is non-zero when an index was out of range (read it after the call)."""
    rt = _rt()
    dtype = np.dtype(dy.dtype)
    name = _float_dtype(dy)
    if rows >= 2**31 - 1 or count >= 2**32 - 1:
        raise KernelError(f"{rows} rows or {count} positions exceed the CUDA kernel's 32-bit limits")
    dX = rt.empty((outer, rows, inner), dtype)
    chunk = CHUNK if mode == 0 else 2**31 - 1
    long_bound = count // (chunk + 1) + 1 if count > chunk else 0
    xbound = count // chunk if count > chunk else 0
    maxslots = 2 * count // chunk + 1 if long_bound else 0
    # One workspace: a zeroed prefix (flag, sync counters, meta, per-row counts), then scratch arrays.
    sizes_u32 = [2, 2, 4, rows, count, count, count, count, rows + 1, rows, 2 * xbound + 2, long_bound + 1]
    ws = rt.empty((sum(sizes_u32),), np.uint32)
    rt.driver.memset_d32(ws.gpudata, 0, 8 + rows)
    flag = ws[:2].view(np.int64)
    if dX.size == 0:
        return dX, flag
    base, offsets = int(ws.gpudata), []
    for n in sizes_u32:
        offsets.append(np.uintp(base))
        base += 4 * n
    flag_addr, sync, meta, counts, keys, pos, rank, spos, rowptr, row_slot, chunk_map, long_rows = offsets
    sentinel = rows
    end_bit = max(1, int(sentinel).bit_length())
    if count:
        idx = _dev(indices)
        tiles = -(-count // _TILE)
        rt.function("microsoft", f"csr_tile_sort_{_index_suffix(idx)}")(
            _addr(idx), keys, pos, rank, counts, flag_addr, sync, cp.desc(sizes, multipliers), np.int64(count),
            np.int64(sentinel), np.int64(end_bit), block=(256, 1, 1), grid=(tiles, 1))
    rt.function("microsoft", "csr_scan")(counts, rowptr, row_slot, chunk_map, long_rows, meta, np.int64(rows),
                                         np.int64(chunk), block=(_SCAN_THREADS, 1, 1), grid=(1, 1))
    rt.launch(rt.function("microsoft", "csr_place"), count, keys, pos, rank, rowptr, spos, np.int64(count),
              np.int64(sentinel))
    v = _VEC[name]
    arrays = [dX, dy] + ([init] if init is not None else [])
    if inner % v or any(int(a.gpudata) % 16 for a in arrays if a.size):
        v = 1
    inner_v = inner // v
    if inner_v >= 256:
        col_lanes, lanes = 256, 1
    elif inner_v >= 32:
        col_lanes = -(-inner_v // 32) * 32
        lanes = 1 << ((256 // col_lanes).bit_length() - 1)
    else:
        col_lanes = 1 << max(0, (inner_v - 1).bit_length())
        lanes = 256 // col_lanes
    block = col_lanes * lanes
    acc = _ACC[name]
    partial = rt.empty((outer * maxslots * inner * acc // 4,), np.uint32) if maxslots else None
    suffix = f"{rt.suffix(dtype)}_v{v}"
    grid = min(outer * (rows + xbound), 2**31 - 1)
    rt.function("microsoft", f"csr_rows_{suffix}")(
        dX, _addr(dy), _addr(init), spos, rowptr, row_slot, chunk_map, meta, _addr(partial), np.int64(outer),
        np.int64(rows), np.int64(count), np.int64(inner_v), np.int64(chunk), np.int64(xbound), np.int64(maxslots),
        np.int64(col_lanes), np.int64(mode), block=(block, 1, 1), grid=(grid, 1),
        shared=block * v * acc if lanes > 1 else 0)
    if long_bound:
        rt.function("microsoft", f"csr_long_{suffix}")(
            dX, _addr(init), _addr(partial), rowptr, long_rows, row_slot, meta, np.int64(outer), np.int64(rows),
            np.int64(inner_v), np.int64(chunk), np.int64(maxslots), block=(256, 1, 1),
            grid=(min(outer * long_bound, 2**31 - 1), 1))
    return dX, flag


@cuda_kernel("GatherGrad", domain=MICROSOFT, host_inputs=(0,))
def gather_grad(shape, indices, dY, *, axis=0):
    rt = _rt()
    dims = cpu._shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: Gather's data must have rank >= 1")
    axis = cpu._axis(axis, len(dims))
    size = dims[axis]
    _index_suffix(indices)
    _float_dtype(dY)
    want = tuple(dims[:axis]) + tuple(indices.shape) + tuple(dims[axis + 1:])
    if tuple(dY.shape) != want:
        raise KernelError(f"dY has shape {list(dY.shape)}, but data shape {dims} gathered with indices of shape "
                          f"{list(indices.shape)} along axis {axis} gives {list(want)}")
    outer, inner, count = math.prod(dims[:axis]), math.prod(dims[axis + 1:]), math.prod(indices.shape)
    dy = cp.contiguous(dY) if dY.size else dY
    dX, flag = row_scatter(dy, indices, outer, size, inner, count, [size], [1])
    if count and rt.to_host(flag)[0]:
        raise_index_error(indices, size, axis)
    return dX.reshape(tuple(dims)) if dX.size else rt.empty(dims, dY.dtype)


# ---------------------------------------------------------------- line scatter (GatherElementsGrad, ScatterElements)


def line_scatter(dy, indices, out_shape, axis: int, *, init=None, mode: int = 0):
    """out[..., idx[i], ...] (op)= dy[i] along ``axis``, folded in position order per target; out starts as
    ``init`` (same shape as out, contiguous) or zeros. Returns (out, flag)."""
    rt = _rt()
    dtype = np.dtype(dy.dtype)
    name = _float_dtype(dy)
    out = rt.empty(out_shape, dtype)
    flag = rt.zeros((1,), np.int64)
    if out.size == 0:
        return out, flag
    rank = len(out_shape)
    ostrides = rt.contiguous_strides(out_shape)
    istrides = rt.contiguous_strides(indices.shape)
    others = [d for d in range(rank) if d != axis]
    s, n = int(out_shape[axis]), int(indices.shape[axis])
    if s >= 2**32 - 1 or n >= 2**32:
        raise KernelError(f"axis {axis} of size {s} exceeds the CUDA kernel's 32-bit limit")
    lines = cp.desc([out_shape[d] for d in others], [ostrides[d] for d in others])
    ilines = cp.desc([indices.shape[d] for d in others], [istrides[d] for d in others])
    nlines = math.prod(out_shape[d] for d in others)
    shared_line = s * _ACC[name] <= _LINE_SMEM
    idx = _dev(indices) if indices.size else None
    kernel = rt.function("microsoft", f"line_scatter_{rt.suffix(dtype)}_{_index_suffix(indices)}")
    kernel(out, _addr(dy), _addr(idx), _addr(init), flag, lines, ilines, np.int64(s), np.int64(ostrides[axis]),
           np.int64(n), np.int64(istrides[axis]), np.int64(nlines), np.int64(max(1, s.bit_length())), np.int64(mode),
           np.int64(1 if shared_line else 0), block=(256, 1, 1), grid=(min(nlines, 2**20), 1),
           shared=s * _ACC[name] if shared_line else 0)
    return out, flag


def _check_gather_elements_grad(dY, dims, indices, axis):
    if tuple(dY.shape) != tuple(indices.shape):
        raise KernelError(f"dY has shape {list(dY.shape)}, but indices have shape {list(indices.shape)}; they must match")
    if len(indices.shape) != len(dims):
        raise KernelError(f"indices have rank {len(indices.shape)} (shape {list(indices.shape)}), but the data shape "
                          f"{dims} has rank {len(dims)}")
    for d, (n, m) in enumerate(zip(indices.shape, dims)):
        if d != axis and n > m:
            raise KernelError(f"indices shape {list(indices.shape)} exceeds the data shape {dims} on axis {d} "
                              f"(only axis {axis} may be longer)")


@cuda_kernel("GatherElementsGrad", domain=MICROSOFT, host_inputs=(1,))
def gather_elements_grad(dY, shape, indices, *, axis=0, deterministic=None):
    """``deterministic=False`` (or GRADGEN_DETERMINISTIC=0) takes the atomicAdd path."""
    rt = _rt()
    dims = cpu._shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: GatherElements' data must have rank >= 1")
    axis = cpu._axis(axis, len(dims))
    _check_gather_elements_grad(dY, dims, indices, axis)
    _index_suffix(indices)
    _float_dtype(dY)
    if deterministic is None:
        deterministic = default_deterministic()
    dy = cp.contiguous(dY) if dY.size else dY
    if deterministic:
        dX, flag = line_scatter(dy, indices, dims, axis)
    else:
        dX = rt.zeros(dims, dY.dtype)
        flag = rt.zeros((1,), np.int64)
        if dy.size and dX.size:
            idx = _dev(indices)
            small = dX.size < 2**31 and dy.size < 2**31
            kernel = rt.function("microsoft", f"ge_atomic{'32' if small else ''}_{rt.suffix(dY.dtype)}_"
                                              f"{_index_suffix(indices)}")
            rt.launch(kernel, dy.size, dX, dy, idx, flag, cp.desc(indices.shape, rt.contiguous_strides(dims)),
                      np.int64(axis), np.int64(dims[axis]), np.int64(dy.size))
    if indices.size and dX.size and rt.to_host(flag)[0]:
        raise_index_error(indices, dims[axis], axis)
    return dX


# ---------------------------------------------------------------- BroadcastGradientArgs


@cuda_kernel("BroadcastGradientArgs", domain=MICROSOFT, host_inputs=(0, 1))
def broadcast_gradient_args(a_shape, b_shape):
    return cpu.broadcast_gradient_args(a_shape, b_shape)
