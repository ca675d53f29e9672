"""CUDA launchers: indexing (indexing.cu): Gather, GatherElements, GatherND, ScatterElements,
ScatterND, OneHot, NonZero, Compress and Unique (whose output sizes are read back to the host), and
the com.microsoft GatherGrad and GatherElementsGrad.

Indices arrive on the device (int32 or int64). Negative ones are normalised in the kernels; an
out-of-range index sets a device flag and writes nothing, and the launcher then raises the CPU
kernel's exact error (it re-checks the indices on the host, which only happens on that error path).

Scatters are deterministic (bit-identical across runs), with no float atomics: positions are
grouped by a stable sort (integer atomics only) and every output element is summed in position
order (long segments: in fixed chunks, added in chunk order). ``row_scatter`` serves GatherGrad and
ScatterND, ``line_scatter`` GatherElementsGrad and ScatterElements (none: the last update wins,
like the CPU kernel). GatherElementsGrad also has an atomicAdd path (``deterministic=False``, or
GRADGEN_DETERMINISTIC=0 for the executor's default). ScatterND with mul/max/min, and scatters of
integer data, run the CPU kernel.

GatherGrad and GatherElementsGrad follow ONNX Runtime training's contracts (see the CPU kernels):
GatherGrad is (shape, indices, dY), GatherElementsGrad is (dY, shape, indices); shapes live on the
host. Host time counts as much as kernel time at these sizes, so each launcher caches what a shape
needs (kernels, grids, packed descriptors) and launches with one pre-packed argument buffer;
GatherGrad (up to 16384 positions) is two launches with no memset, and each op reads its error
flag once, through pinned memory (deferred to after the replay while a CUDA graph is being
captured).
"""

from __future__ import annotations

import math
import os
import struct

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import indexing as cpu
from gradgen.kernels.cuda.launch import (
    CASTABLE,
    MAX_BLOCKS,
    contiguous,
    copy,
    cpu_fallback,
    desc,
    dtype_suffix,
    host_key,
    kernel_of,
    launch,
    launch_packed,
    on_device,
    plan_cache,
    raw,
    require_suffix,
    runtime,
    same_type,
    stream,
)
from gradgen.kernels.numeric import shape_arg
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.axes import normalize_axis
from gradgen.ops.indexing import check_gather_elements_grad, normalize_indices, tensor_scatter_positions

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_VEC = {"float16": 8, "bfloat16": 8, "float32": 4, "float64": 2}
_ACC = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}
CHUNK = 256  # positions per chunk of a long row (rows with more are summed in two levels)
_TILE = 2048  # positions per tile of csr_tile_sort (TS_TILE in indexing.cu)
_SCAN_THREADS = 1024
_LINE_SMEM = 24 * 1024  # bytes of shared memory a line scatter may use for its line


def default_deterministic() -> bool:
    return os.environ.get("GRADGEN_DETERMINISTIC", "1").strip().lower() not in ("0", "false", "no", "off")


def _float_dtype(x, what="dY") -> str:
    name = np.dtype(x.dtype).name
    if name not in _FLOATS:
        raise KernelError(f"{what} has dtype {x.dtype}; the CUDA kernel supports float16, bfloat16, float32 and float64")
    return name


def _index_suffix(indices) -> str:
    if indices.dtype == np.int32:
        return "i32"
    if indices.dtype == np.int64:
        return "i64"
    raise KernelError(f"indices must be int32 or int64, got {indices.dtype}")


def _addr(x) -> np.uintp:
    return np.uintp(0) if x is None or x.size == 0 else np.uintp(int(x.gpudata))


def raise_index_error(indices, size: int, axis: int, normalise=None) -> None:
    """The CPU kernel's exact message for the first out-of-range index (after a device flag was set)."""
    host = runtime().to_host(indices)
    (normalise or normalize_indices)(host, size, axis)
    raise KernelError(f"an index is out of range for axis {axis} of size {size} (valid range [{-size}, {size - 1}])")


_PINNED: list = []


def _read_int64(addr: int) -> int:
    """The int64 at device address ``addr`` once the work queued before it is done (one sync)."""
    rt = runtime()
    if not _PINNED:
        _PINNED.append(rt.driver.pagelocked_empty((1,), np.int64))
    buf = _PINNED[0]
    queue = stream()
    if queue is None:
        rt.driver.memcpy_dtoh(buf, addr)
    else:
        rt.driver.memcpy_dtoh_async(buf, addr, queue)
        queue.synchronize()
    return int(buf[0])


def _check_flag(flag_addr: int, view, on_error) -> None:
    """Raise through ``on_error(value)`` when the int64 flag at ``flag_addr`` is set. While a CUDA graph
    is captured, the runtime defers the check to each replay (``view()``: the flag as a device array)."""
    rt = runtime()
    capture = getattr(rt, "CAPTURE", None)
    if capture is not None and capture.active:
        rt.check_flag(view(), on_error)
        return
    value = _read_int64(flag_addr)
    if value:
        on_error(value)


_FLAG: list = []


def _sticky_flag():
    """A device int64 that stays 0 between ops: kernels set it only on an error, and the error path
    clears it again, so no op needs a memset for its flag."""
    if not _FLAG:
        rt = runtime()
        capture = getattr(rt, "CAPTURE", None)
        if capture is not None and capture.active:
            return rt.zeros((1,), np.int64)  # the graph zeroes it on each replay: no sync while capturing
        with rt.persistent():
            _FLAG.append(rt.to_device(np.zeros((1,), np.int64)))
        rt.drop_at_exit(_FLAG.clear)
    return _FLAG[0]


def _clear_sticky(flag) -> None:
    rt = runtime()
    rt.synchronize()
    rt.driver.memset_d8(flag.gpudata, 0, 8)
    rt.synchronize()


# ---------------------------------------------------------------- row scatter (GatherGrad, ScatterND)


def row_scatter(dy, indices, outer: int, rows: int, inner: int, count: int, sizes, multipliers, *, init=None, mode: int = 0):
    """dX (outer, rows, inner): dX[o, key(p)] = init (+)= dY[o, p] over positions p (mode 0 add, 1 last wins).

    key(p) = sum_t normalise(indices[p, t], sizes[t]) * multipliers[t]. Returns (dX, flag) with flag a
    device int64 that is non-zero when an index was out of range (read it after the call)."""
    rt = runtime()
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
    # On gradgen's stream, so that a recorded CUDA graph zeroes it on every replay (a synchronous
    # memset runs once, at record time, under relaxed capture).
    rt.driver.memset_d32_async(ws.gpudata, 0, 8 + rows, rt.stream())
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
        idx = on_device(indices)
        tiles = -(-count // _TILE)
        kernel_of("indexing", f"csr_tile_sort_{_index_suffix(idx)}")(
            _addr(idx),
            keys,
            pos,
            rank,
            counts,
            flag_addr,
            sync,
            desc(sizes, multipliers),
            np.int64(count),
            np.int64(sentinel),
            np.int64(end_bit),
            block=(256, 1, 1),
            grid=(tiles, 1),
        )
    kernel_of("indexing", "csr_scan")(
        counts,
        rowptr,
        row_slot,
        chunk_map,
        long_rows,
        meta,
        np.int64(rows),
        np.int64(chunk),
        block=(_SCAN_THREADS, 1, 1),
        grid=(1, 1),
    )
    launch(kernel_of("indexing", "csr_place"), count, keys, pos, rank, rowptr, spos, np.int64(count), np.int64(sentinel))
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
    suffix = f"{require_suffix(dtype)}_v{v}"
    grid = min(outer * (rows + xbound), 2**31 - 1)
    kernel_of("indexing", f"csr_rows_{suffix}")(
        dX,
        _addr(dy),
        _addr(init),
        spos,
        rowptr,
        row_slot,
        chunk_map,
        meta,
        _addr(partial),
        np.int64(outer),
        np.int64(rows),
        np.int64(count),
        np.int64(inner_v),
        np.int64(chunk),
        np.int64(xbound),
        np.int64(maxslots),
        np.int64(col_lanes),
        np.int64(mode),
        block=(block, 1, 1),
        grid=(grid, 1),
        shared=block * v * acc if lanes > 1 else 0,
    )
    if long_bound:
        kernel_of("indexing", f"csr_long_{suffix}")(
            dX,
            _addr(init),
            _addr(partial),
            rowptr,
            long_rows,
            row_slot,
            meta,
            np.int64(outer),
            np.int64(rows),
            np.int64(inner_v),
            np.int64(chunk),
            np.int64(maxslots),
            block=(256, 1, 1),
            grid=(min(outer * long_bound, 2**31 - 1), 1),
        )
    return dX, flag


GO_MAX = 32768  # most positions GatherGrad sums with gg_own (every block reads all of them)
GO_BLOCKS_PER_SM = 3  # gg_own's grid: about this many row blocks per SM
GO_ROTATE = 1  # blocks start reading the indices at different tiles
_GO_PLANS: dict = {}
_GG_CHECKS: dict = {}
_PTRS4 = struct.Struct("=4Q")


def _gather_grad_own_plan(outer, rows, inner, count, dtype, itype, aligned):
    rt = runtime()
    name = np.dtype(dtype).name
    v = _VEC[name] if inner % _VEC[name] == 0 and aligned else 1
    sms = rt.driver.Context.get_device().get_attribute(rt.driver.device_attribute.MULTIPROCESSOR_COUNT)
    rb = min(1024, max(8, -(-rows // (GO_BLOCKS_PER_SM * sms))))  # at most GO_MAXRB (1024) rows a block
    rb = -(-rb // 8) * 8
    grid = outer * -(-rows // rb)
    kernel = raw(kernel_of("indexing", f"gg_own_{require_suffix(dtype)}_v{v}_{itype}"))
    return kernel, grid, struct.pack("=6q", outer, rows, count, inner // v, rb, GO_ROTATE)


@cuda_kernel("GatherGrad", domain=MICROSOFT, host_inputs=(0,))
def gather_grad(shape, indices, dY, *, axis=0):
    rt = runtime()
    key = (host_key(shape), indices.shape, indices.dtype, dY.shape, dY.dtype, axis)
    dims, axis, outer, inner, count = plan_cache(_GG_CHECKS, key, lambda: _gather_grad_check(shape, indices, dY, axis))
    size = dims[axis]
    dy = dY if dY.flags.c_contiguous or not dY.size else contiguous(dY)
    if outer * size * inner == 0:
        if count:  # every index must still be in range
            normalize_indices(rt.to_host(indices), size, axis)
        return rt.empty(dims, dY.dtype)
    if 0 < count <= GO_MAX and size < 2**31 - 1 and outer * size < 2**31:
        idx = on_device(indices)
        dX = rt.empty((outer, size, inner), dY.dtype)
        aligned = int(dX.gpudata) % 16 == 0 and int(dy.gpudata) % 16 == 0
        kernel, grid, tail = plan_cache(
            _GO_PLANS,
            key + (aligned,),
            lambda: _gather_grad_own_plan(outer, size, inner, count, dY.dtype, _index_suffix(indices), aligned),
        )
        flag = _sticky_flag()
        launch_packed(
            kernel, grid, 256, _PTRS4.pack(int(dX.gpudata), int(dy.gpudata), int(idx.gpudata), int(flag.gpudata)) + tail
        )

        def on_error(_value):
            _clear_sticky(flag)
            raise_index_error(indices, size, axis)

        _check_flag(int(flag.gpudata), lambda: flag, on_error)
        return dX.reshape(tuple(dims))
    dX, flag = row_scatter(dy, indices, outer, size, inner, count, [size], [1])
    if count:
        _check_flag(int(flag.gpudata), lambda: flag, lambda _value: raise_index_error(indices, size, axis))
    return dX.reshape(tuple(dims))


def _gather_grad_check(shape, indices, dY, axis):
    dims = shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: Gather's data must have rank >= 1")
    axis = normalize_axis(axis, len(dims))
    _index_suffix(indices)
    _float_dtype(dY)
    want = tuple(dims[:axis]) + tuple(indices.shape) + tuple(dims[axis + 1 :])
    if tuple(dY.shape) != want:
        raise KernelError(
            f"dY has shape {list(dY.shape)}, but data shape {dims} gathered with indices of shape "
            f"{list(indices.shape)} along axis {axis} gives {list(want)}"
        )
    return (tuple(dims), axis, math.prod(dims[:axis]), math.prod(dims[axis + 1 :]), math.prod(indices.shape))


# ---------------------------------------------------------------- line scatter (GatherElementsGrad, ScatterElements)


_LS_PLANS: dict = {}
_PTRS5 = struct.Struct("=5Q")


def _line_scatter_plan(out_shape, ishape, axis, dtype, itype, mode, vec_ok, plain):
    rt = runtime()
    name = _float_dtype(np.empty(0, dtype), "dY")
    rank = len(out_shape)
    ostrides = rt.contiguous_strides(out_shape)
    istrides = rt.contiguous_strides(ishape)
    others = [d for d in range(rank) if d != axis]
    s, n = int(out_shape[axis]), int(ishape[axis])
    if s >= 2**32 - 1 or n >= 2**32:
        raise KernelError(f"axis {axis} of size {s} exceeds the CUDA kernel's 32-bit limit")
    nlines = math.prod(out_shape[d] for d in others)
    shared_line = s * _ACC[name] <= _LINE_SMEM
    vec = shared_line and vec_ok and axis == rank - 1 and s % _VEC[name] == 0
    kernel = raw(kernel_of("indexing", f"line_scatter_{require_suffix(dtype)}_{itype}"))
    tail = bytes(memoryview(desc([out_shape[d] for d in others], [ostrides[d] for d in others])))
    tail += bytes(memoryview(desc([ishape[d] for d in others], [istrides[d] for d in others])))
    pad = mode == 0 and plain  # a sum from zeros: padding may sort as +0 at the last target (no sentinel bit)
    end_bit = max(1, (s - 1 if pad else s).bit_length())
    tail += struct.pack(
        "=10q",
        s,
        ostrides[axis],
        n,
        istrides[axis],
        nlines,
        end_bit,
        mode,
        1 if shared_line else 0,
        1 if vec else 0,
        s - 1 if pad else -1,
    )
    return kernel, max(1, min(nlines, 2**20)), s * _ACC[name] if shared_line else 0, tail


def line_scatter(dy, indices, out_shape, axis: int, *, init=None, mode: int = 0, flag=None):
    """out[..., idx[i], ...] (op)= dy[i] along ``axis``, folded in position order per target; out starts as
    ``init`` (same shape as out, contiguous) or zeros. Returns (out, flag): ``flag`` (a zeroed device
    int64, allocated here when not given) is set when an index is out of range."""
    rt = runtime()
    out = rt.empty(out_shape, dy.dtype)
    if flag is None:
        flag = rt.zeros((1,), np.int64)
    if out.size == 0:
        return out, flag
    if type(out_shape) is not tuple:
        out_shape = tuple(int(d) for d in out_shape)
    vec_ok = int(out.gpudata) % 16 == 0 and (init is None or int(init.gpudata) % 16 == 0)
    itype = _index_suffix(indices)
    plain = init is None
    key = (out_shape, tuple(indices.shape), axis, dy.dtype, itype, mode, vec_ok, plain)
    kernel, grid, shared, tail = plan_cache(
        _LS_PLANS, key, lambda: _line_scatter_plan(out_shape, tuple(indices.shape), axis, dy.dtype, itype, mode, vec_ok, plain)
    )
    idx = on_device(indices) if indices.size else None
    launch_packed(
        kernel,
        grid,
        256,
        _PTRS5.pack(int(out.gpudata), int(_addr(dy)), int(_addr(idx)), int(_addr(init)), int(flag.gpudata)) + tail,
        shared,
    )
    return out, flag


_GE_CHECKS: dict = {}


def _gather_elements_grad_check(dY, shape, indices, axis):
    dims = shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: GatherElements' data must have rank >= 1")
    axis = normalize_axis(axis, len(dims))
    check_gather_elements_grad(dY.shape, dims, indices.shape, axis)
    _index_suffix(indices)
    _float_dtype(dY)
    return tuple(dims), axis


@cuda_kernel("GatherElementsGrad", domain=MICROSOFT, host_inputs=(1,))
def gather_elements_grad(dY, shape, indices, *, axis=0, deterministic=None):
    """``deterministic=False`` (or GRADGEN_DETERMINISTIC=0) takes the atomicAdd path."""
    rt = runtime()
    key = (dY.shape, dY.dtype, host_key(shape), indices.shape, indices.dtype, axis)
    dims, axis = plan_cache(_GE_CHECKS, key, lambda: _gather_elements_grad_check(dY, shape, indices, axis))
    if deterministic is None:
        deterministic = default_deterministic()
    dy = dY if dY.flags.c_contiguous or not dY.size else contiguous(dY)
    flag = _sticky_flag()
    if deterministic:
        dX, _ = line_scatter(dy, indices, dims, axis, flag=flag)
    else:
        dX = rt.zeros(dims, dY.dtype)
        if dy.size and dX.size:
            idx = on_device(indices)
            small = dX.size < 2**31 and dy.size < 2**31
            kernel = kernel_of(
                "indexing", f"ge_atomic{'32' if small else ''}_{require_suffix(dY.dtype)}_{_index_suffix(indices)}"
            )
            launch(
                kernel,
                dy.size,
                dX,
                dy,
                idx,
                flag,
                desc(indices.shape, rt.contiguous_strides(dims)),
                np.int64(axis),
                np.int64(dims[axis]),
                np.int64(dy.size),
            )
    if indices.size and dX.size:

        def on_error(_value):
            _clear_sticky(flag)
            raise_index_error(indices, dims[axis], axis)

        _check_flag(int(flag.gpudata), lambda: flag, on_error)
    elif indices.size and dims[axis] == 0:
        normalize_indices(rt.to_host(indices), 0, axis)
    return dX


# ---------------------------------------------------------------- Gather, GatherElements, GatherND, Scatter*

_MODES = {"add": 0, "none": 1, "mul": 2, "max": 3, "min": 4}


def _word(esize: int, inner: int, arrays) -> tuple[int, int]:
    """(word width in bytes, elements per word) for moving runs of ``inner`` contiguous elements."""
    for w in (16, 8, 4):
        r = w // esize
        if w > esize and w % esize == 0 and inner % r == 0 and all(int(a.gpudata) % w == 0 for a in arrays):
            return w, r
    return esize, 1


def _check(flag, indices, size, axis, normalise=None):
    normalise = normalise or (lambda h, s, a: normalize_indices(h, s, a))
    runtime().check_flag(flag, lambda _value: raise_index_error(indices, size, axis, normalise))


@cuda_kernel("Gather")
def gather(data, indices, *, axis=0):
    rt = runtime()
    rank = len(data.shape)
    axis = normalize_axis(axis, rank, allow_scalar=True)
    suffix = _index_suffix(indices)
    size = data.shape[axis]
    out_shape = tuple(data.shape[:axis]) + tuple(indices.shape) + tuple(data.shape[axis + 1 :])
    out = rt.empty(out_shape, data.dtype)
    if out.size == 0:
        if indices.size and size == 0:  # every index is out of range
            normalize_indices(rt.to_host(indices), size, axis)
        return out
    x = contiguous(data)
    idx = on_device(indices)
    inner, count = math.prod(data.shape[axis + 1 :]), indices.size
    w, r = _word(data.dtype.itemsize, inner, [x, out])
    n = out.size // r
    flag = rt.zeros((1,), np.int64)
    launch(
        kernel_of("indexing", f"gather_w{w}_{suffix}"),
        n,
        out,
        x,
        idx,
        flag,
        np.int64(count),
        np.int64(size),
        np.int64(inner // r),
        np.int64(n),
    )
    _check(flag, indices, size, axis)
    return out


@cuda_kernel("GatherElements")
def gather_elements(data, indices, *, axis=0):
    rt = runtime()
    rank = len(data.shape)
    axis = normalize_axis(axis, rank, allow_scalar=True)
    suffix = _index_suffix(indices)
    if len(indices.shape) != rank:
        raise KernelError(f"indices rank {len(indices.shape)} differs from data rank {rank}")
    for d, (n, m) in enumerate(zip(indices.shape, data.shape)):
        if d != axis and n > m:
            raise KernelError(f"indices dimension {d} is {n}, larger than data's {m}")
    out = rt.empty(indices.shape, data.dtype)
    size = data.shape[axis]
    if out.size == 0:
        return out
    if size == 0:
        normalize_indices(rt.to_host(indices), size, axis)
    x = contiguous(data)
    idx = on_device(indices)
    flag = rt.zeros((1,), np.int64)
    kernel = kernel_of("indexing", f"gather_elements_w{data.dtype.itemsize}_{suffix}")
    launch(
        kernel,
        out.size,
        out,
        x,
        idx,
        flag,
        desc(indices.shape, rt.contiguous_strides(data.shape)),
        np.int64(axis),
        np.int64(size),
        np.int64(out.size),
    )
    _check(flag, indices, size, axis)
    return out


def _nd_check(data_shape, indices_shape, b):
    if len(indices_shape) < 1:
        raise KernelError("indices must have rank >= 1")
    k = indices_shape[-1]
    if b + k > len(data_shape):
        raise KernelError(f"indices.shape[-1] ({k}) + batch_dims ({b}) exceeds data rank {len(data_shape)}")
    if tuple(data_shape[:b]) != tuple(indices_shape[:b]):
        raise KernelError(f"the first {b} (batch) dimensions of data {list(data_shape)} and indices {list(indices_shape)} differ")
    return k


def _nd_error(indices, data_shape, first_axis):
    host = runtime().to_host(indices)
    cpu.nd_tuple(tuple(data_shape), host, first_axis)
    raise KernelError("an index of indices is out of range")


@cuda_kernel("GatherND")
def gather_nd(data, indices, *, batch_dims=0):
    rt = runtime()
    b = int(batch_dims)
    suffix = _index_suffix(indices)
    k = _nd_check(data.shape, indices.shape, b)
    out_shape = tuple(indices.shape[:-1]) + tuple(data.shape[b + k :])
    out = rt.empty(out_shape, data.dtype)
    if out.size == 0:
        if indices.size and 0 in data.shape[b : b + k]:
            _nd_error(indices, data.shape, b)
        return out
    x = contiguous(data)
    idx = on_device(indices)
    inner = math.prod(data.shape[b + k :])
    w, r = _word(data.dtype.itemsize, inner, [x, out])
    strides = rt.contiguous_strides(data.shape)
    batch = math.prod(data.shape[:b])
    M = math.prod(indices.shape[b:-1])
    kd = desc(data.shape[b : b + k], [s // r for s in strides[b : b + k]])
    batch_stride = (strides[b - 1] if b else x.size) // r
    n = out.size // r
    flag = rt.zeros((1,), np.int64)
    launch(
        kernel_of("indexing", f"gather_nd_w{w}_{suffix}"),
        n,
        out,
        x,
        idx if k else np.uintp(0),
        flag,
        kd,
        np.int64(M),
        np.int64(inner // r),
        np.int64(batch_stride),
        np.int64(n),
    )
    if batch == 0:
        return out
    rt.check_flag(flag, lambda _value: _nd_error(indices, data.shape, b))
    return out


@cuda_kernel("ScatterElements", "Scatter")
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    rt = runtime()
    reduction = cpu.check_reduction(reduction)
    rank = len(data.shape)
    axis = normalize_axis(axis, rank, allow_scalar=True)
    if tuple(indices.shape) != tuple(updates.shape) or len(indices.shape) != rank:
        raise KernelError(
            f"indices {list(indices.shape)} and updates {list(updates.shape)} must have the same shape and data's rank {rank}"
        )
    for d, (n, m) in enumerate(zip(indices.shape, data.shape)):
        if d != axis and n > m:
            raise KernelError(f"indices dimension {d} is {n}, larger than data's {m}")
    _index_suffix(indices)
    if np.dtype(data.dtype).name not in _FLOATS or updates.dtype != data.dtype:
        return cpu_fallback("ScatterElements", data, indices, updates, axis=axis, reduction=reduction)
    if data.size == 0:
        if indices.size:
            normalize_indices(rt.to_host(indices), data.shape[axis], axis)
        return rt.empty(data.shape, data.dtype)
    x = contiguous(data)
    upd = contiguous(updates) if updates.size else updates
    out, flag = line_scatter(upd, indices, tuple(data.shape), axis, init=x, mode=_MODES[reduction])
    if indices.size:
        _check(flag, indices, data.shape[axis], axis)
    return out


@cuda_kernel("ScatterND")
def scatter_nd(data, indices, updates, *, reduction="none"):
    rt = runtime()
    reduction = cpu.check_reduction(reduction)
    _index_suffix(indices)
    k = _nd_check(data.shape, indices.shape, 0)
    want = tuple(indices.shape[:-1]) + tuple(data.shape[k:])
    if tuple(updates.shape) != want:
        raise KernelError(f"updates shape {list(updates.shape)} should be {list(want)}")
    if reduction not in ("none", "add") or np.dtype(data.dtype).name not in _FLOATS or updates.dtype != data.dtype:
        return cpu_fallback("ScatterND", data, indices, updates, reduction=reduction)
    if data.size == 0:
        if indices.size and 0 in data.shape[:k]:
            _nd_error(indices, data.shape, 0)
        return rt.empty(data.shape, data.dtype)
    x = contiguous(data)
    upd = contiguous(updates) if updates.size else updates
    rows, inner = math.prod(data.shape[:k]), math.prod(data.shape[k:])
    count = math.prod(indices.shape[:-1])
    idx = on_device(indices) if indices.size else indices
    out, flag = row_scatter(
        upd,
        idx,
        1,
        rows,
        inner,
        count,
        list(data.shape[:k]),
        rt.contiguous_strides(data.shape[:k]),
        init=x,
        mode=0 if reduction == "add" else 1,
    )
    if count:
        rt.check_flag(flag, lambda _value: _nd_error(indices, data.shape, 0))
    return out.reshape(tuple(data.shape))


# ---------------------------------------------------------------- TensorScatter


_TS_AXES: dict = {}


def _tensor_scatter_axis(cache_shape, update_shape, write_indices, mode, axis) -> int:
    """TensorScatter's normalised axis, after the CPU kernel's checks of everything but the write
    indices' values (zeros stand in for them), cached per shapes and attributes."""
    indices = None if write_indices is None else (np.dtype(write_indices.dtype), tuple(write_indices.shape))
    key = (tuple(cache_shape), tuple(update_shape), indices, mode, int(axis))

    def make():
        stand_in = None if indices is None else np.zeros(indices[1], indices[0])
        return tensor_scatter_positions(cache_shape, update_shape, stand_in, mode, axis)[1]

    return plan_cache(_TS_AXES, key, make)


@cuda_kernel("TensorScatter")
def tensor_scatter(past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    """``past_cache`` with ``update`` written along ``axis`` from ``write_indices[b]`` on in batch row
    b (opset 24's KV-cache update): a device copy of the cache, then one pass over the update that
    moves its runs along the trailing axes as wide words (indexing.cu's tensor_scatter). The write
    indices stay on the device: one the CPU kernel refuses (negative, or past the axis in linear
    mode) sets a flag, and the CPU kernel's checks on the host then raise its error."""
    rt = runtime()
    ax = _tensor_scatter_axis(past_cache.shape, update.shape, write_indices, mode, axis)
    if write_indices is not None and dtype_suffix(write_indices.dtype) not in ("i32", "i64"):
        return cpu_fallback("TensorScatter", past_cache, update, write_indices, mode=mode, axis=axis)

    def raise_cpu_error(_value=None):
        tensor_scatter_positions(past_cache.shape, update.shape, rt.to_host(write_indices), mode, axis)
        return "a write index is out of range"

    present = copy(past_cache)
    if update.size == 0:
        if write_indices is not None and write_indices.size:
            raise_cpu_error()  # nothing to write, but the indices are checked all the same
        return present
    shape = tuple(int(d) for d in past_cache.shape)
    room, length, inner = shape[ax], int(update.shape[ax]), math.prod(shape[ax + 1 :])
    upd = contiguous(update)
    w, r = _word(present.dtype.itemsize, inner, [present, upd])
    n = upd.size // r
    flag = rt.zeros((1,), np.int64)
    starts = None if write_indices is None else contiguous(write_indices)
    launch(
        kernel_of("indexing", f"tensor_scatter_w{w}_{'i32' if starts is not None and starts.dtype == np.int32 else 'i64'}"),
        n,
        present,
        upd,
        _addr(starts),
        flag,
        np.int64(math.prod(shape[1:ax])),
        np.int64(length),
        np.int64(room),
        np.int64(inner // r),
        np.int64(1 if mode == "circular" else 0),
        np.int64(n),
    )
    if starts is not None:
        rt.check_flag(flag, raise_cpu_error)
    return present


# ---------------------------------------------------------------- OneHot


@cuda_kernel("OneHot", host_inputs=(1,))
def one_hot(indices, depth, values, *, axis=-1):
    """values[1] where the index (plus depth when negative) equals the position along ``axis``, else
    values[0]; indices outside [-depth, depth) give all-off lines (the spec's rule, not an error).
    The depth is read on the host (it sets the output's shape); values stay on the device."""
    from gradgen.kernels.cuda.elementwise import cast_to

    rt = runtime()
    n = cpu.one_hot_depth(depth, math.prod(values.shape))
    rank = len(indices.shape) + 1
    ax = normalize_axis(axis, rank, allow_scalar=True)
    esize = values.dtype.itemsize
    if esize not in (1, 2, 4, 8) or indices.dtype.kind not in "iu":
        return cpu_fallback("OneHot", indices, depth, values, axis=axis)
    if indices.dtype not in (np.int32, np.int64):  # int8, uint8: widened on the device; others on the host
        widened = cast_to(indices, np.int64)
        if widened is None:
            return cpu_fallback("OneHot", indices, depth, values, axis=axis)
        indices = widened
    out_shape = [*indices.shape[:ax], n, *indices.shape[ax:]]
    out = rt.empty(out_shape, values.dtype)
    if out.size == 0:
        return out
    inner = math.prod(indices.shape[ax:])
    suffix = "i32" if indices.dtype == np.int32 else "i64"
    launch(
        kernel_of("indexing", f"one_hot_w{esize}_{suffix}"),
        out.size,
        out,
        contiguous(indices),
        contiguous(values),
        np.int64(n),
        np.int64(inner),
        np.int64(out.size),
    )
    return out


# ---------------------------------------------------------------- NonZero, Compress
#
# Their output sizes depend on the data: each reads one count back to the host (a device-to-host
# copy, which waits for the work before it; a run that holds one of them cannot be recorded as a
# CUDA graph, so the executor runs it eagerly).


def _running_count(x):
    """(slots, count): slots (int64, x.size, C order) holds the running count of x's non-zero
    elements (x != 0: NaN counts, -0 does not), count its last value, read back to the host.
    Composed: x cast to bool then int64, laid out as (rows, width) lines of about sqrt(x.size)
    (zero padded), CumSum along each line, plus the exclusive CumSum of the line totals
    (reduction.py's one-thread-per-line scans and ReduceSum, elementwise Add)."""
    from gradgen.kernels.cuda.elementwise import binary, cast_to
    from gradgen.kernels.cuda.reduction import cum_sum, reduce

    rt = runtime()
    n = int(x.size)
    flags = cast_to(x if x.dtype == np.bool_ else cast_to(x, np.bool_), np.int64)
    width = max(1, math.isqrt(n - 1) + 1)
    rows = -(-n // width)
    lines = rt.zeros((rows, width), np.int64)
    rt.copy_device(lines, flags, n * 8)
    totals = reduce("sum", lines, (1,), True, "ReduceSum")
    starts = cum_sum(totals, 0, exclusive=1)
    slots = binary("add_i64", cum_sum(lines, 1), starts, np.int64).reshape(-1)
    count = int(rt.to_host(slots[n - 1 : n])[0])
    return slots, count


def nonzero_coordinates(x):
    """The (rank, count) int64 coordinates of x's non-zero elements in C order: ``_running_count``
    gives each its column, indexing.cu's nonzero_coords writes its coordinates there."""
    rt = runtime()
    rank = len(x.shape)
    if x.size == 0:
        return rt.empty((rank, 0), np.int64)
    slots, count = _running_count(contiguous(x))
    out = rt.empty((rank, count), np.int64)
    if rank and count:
        launch(kernel_of("indexing", "nonzero_coords"), x.size, out, slots, desc(x.shape), np.int64(count), np.int64(x.size))
    return out


@cuda_kernel("NonZero")
def non_zero(x):
    """The coordinates of X's non-zero elements, (rank, count) in C order (``nonzero_coordinates``;
    a scalar gives (0, count)). The count is read back to the host. dtypes the casts do not cover and
    ranks above the kernels' maximum run the CPU kernel."""
    if dtype_suffix(x.dtype) not in CASTABLE or len(x.shape) > runtime().MAX_RANK:
        return cpu_fallback("NonZero", x)
    return nonzero_coordinates(x)


@cuda_kernel("Compress")
def compress(data, condition, *, axis=None):
    """np.compress: the slices of data along ``axis`` (data flattened when None) whose entry of
    the condition is true, the condition shorter than the axis leaving the rest out. The kept
    positions are the condition's ``nonzero_coordinates`` (their count read back to the host),
    which the Gather launcher takes. Condition dtypes the casts do not cover, and 0-d data with an
    axis, run the CPU kernel."""
    rt = runtime()
    size = math.prod(data.shape) if axis is None else None
    if axis is not None:
        ax = normalize_axis(axis, len(data.shape), allow_scalar=True)
        size = data.shape[ax] if data.shape else None
    if size is not None and condition.size > size:
        where = "the flattened input only" if axis is None else f"axis {ax} has size"
        raise KernelError(f"condition has {condition.size} entries but {where} {size}")
    if dtype_suffix(condition.dtype) not in CASTABLE or size is None:
        return cpu_fallback("Compress", data, condition, axis=axis)
    if axis is None:
        if data.size == 0:
            return rt.empty((0,), data.dtype)
        data, ax = contiguous(data).reshape(-1), 0
    positions = rt.empty((0,), np.int64)
    if condition.size:
        kept = nonzero_coordinates(contiguous(condition).reshape(-1))
        if kept.size:
            positions = kept.reshape(-1)
    return gather(data, positions, axis=ax)


# ---------------------------------------------------------------- Unique

_UNIQUE_TYPES = ("f16", "bf16", "f32", "f64", "i32", "i64")


@cuda_kernel("Unique")
def unique(x, *, axis=None, sorted=1, _num_outputs=4):  # noqa: A002 - the ONNX attribute's name
    """np.unique, the CPU kernel's outputs: Y ascending (sorted=0: in order of first occurrence),
    each value's first index, each element's (or slice's) index into Y and the counts.

    Flattened X: every NaN one value and -0 equal to +0 (Y keeps its first occurrence's bits);
    reduction.py's ``sorted_pairs`` sorts X's (key, position) pairs and each run of equal keys is a
    value. With an axis: X's slices along it, as rows, in lexicographic order (``_sorted_rows``),
    a run of rows equal element by element (NaN unequal to NaN, -0 equal to +0: numpy's rule for
    slices) is a value, gathered whole from X. Either way the runs are numbered by
    ``_numbered_runs``, whose count of values is read back to the host: a run that holds Unique
    records no CUDA graph and runs eagerly. Other dtypes, and empty slices, run the CPU kernel."""
    from gradgen.kernels.cuda.reduction import sorted_pairs

    rt = runtime()
    if dtype_suffix(x.dtype) not in _UNIQUE_TYPES or (axis is not None and 0 in tuple(x.shape)):
        return cpu_fallback("Unique", x, axis=axis, sorted=sorted, _num_outputs=_num_outputs)
    if axis is not None:
        results = _unique_slices(x, normalize_axis(axis, len(x.shape)), int(sorted))
    elif x.size == 0:  # nothing to sort (and PyCUDA cannot reshape an empty array's null pointer)
        results = (rt.empty((0,), x.dtype), *(rt.empty((0,), np.int64) for _ in range(3)))
    else:
        flat = contiguous(x).reshape(-1)
        n = int(flat.size)
        keys, positions = sorted_pairs(flat)
        starts = rt.empty((n,), np.bool_)
        launch(kernel_of("indexing", "unique_starts"), n, starts, keys, np.int64(n))
        results = _numbered_runs(starts, positions, flat, int(sorted))
    wanted = int(_num_outputs)
    return results[:wanted] if wanted > 1 else results[0]


def _numbered_runs(starts, positions, values_from, sorted_: int):
    """(values, first, inverse, counts) of runs of sorted items: ``starts`` marks each run's first
    item (non-zero), ``positions`` the items' original positions in sorted order. ``values`` are
    ``values_from`` at each run's first position. sorted=0 orders the runs by first position
    (``sorted_pairs`` of those) and renumbers the inverse indices."""
    from gradgen.kernels.cuda.reduction import sorted_pairs

    rt = runtime()
    n = int(starts.size)
    slots, runs = _running_count(starts)
    inverse, first, begin = rt.empty((n,), np.int64), rt.empty((runs,), np.int64), rt.empty((runs,), np.int64)
    launch(kernel_of("indexing", "unique_runs"), n, inverse, first, begin, positions, slots, np.int64(n))
    order = rank = None
    if not sorted_:
        order = sorted_pairs(first)[1]  # the runs by first position
        rank = rt.empty((runs,), np.int64)
    values, first_out, counts = rt.empty((runs,), values_from.dtype), rt.empty((runs,), np.int64), rt.empty((runs,), np.int64)
    launch(
        kernel_of("indexing", f"unique_outputs_w{values_from.dtype.itemsize}"),
        runs,
        values,
        first_out,
        counts,
        _addr(rank),
        values_from,
        first,
        begin,
        _addr(order),
        np.int64(runs),
        np.int64(n),
    )
    if rank is not None:
        launch(kernel_of("indexing", "unique_remap"), n, inverse, rank, np.int64(n))
    return values, first_out, inverse, counts


def _sorted_rows(rows):
    """The row indices of ``rows`` (n, m) in lexicographic order, equal rows by index: a least
    significant digit sort, one stable ``sorted_pairs`` per column from the last (each column read
    in the order the later columns gave), so m sorts of n keys."""
    from gradgen.kernels.cuda.reduction import sorted_pairs
    from gradgen.kernels.cuda.shape import transpose

    rt = runtime()
    n, m = rows.shape
    columns = transpose(rows, perm=[1, 0])
    order = rt.to_device(np.arange(n, dtype=np.int64))
    for j in reversed(range(m)):
        moved = sorted_pairs(gather(columns[j], order))[1][:n]
        order = gather(order, moved)
    return order


def _unique_slices(x, axis: int, sorted_: int):
    """Unique of X's slices along ``axis`` (see ``unique``)."""
    from gradgen.kernels.cuda.elementwise import binary, cast_to, equal
    from gradgen.kernels.cuda.reduction import reduce
    from gradgen.kernels.cuda.shape import concat, reshaped, transpose

    rt = runtime()
    rank = len(x.shape)
    n, m = x.shape[axis], math.prod(x.shape) // x.shape[axis]
    moved = x if axis == 0 else transpose(x, perm=[axis] + [a for a in range(rank) if a != axis])
    rows = reshaped(moved, (n, m))
    order = _sorted_rows(rows)
    starts = rt.to_device(np.ones(1, np.int64))
    if n > 1:  # a row starts a run where any of its columns differs from the row before
        in_order = gather(rows, order)
        same = reduce("sum", cast_to(equal(in_order[1:], in_order[:-1]), np.int64), (1,), False, "ReduceSum")
        starts = concat(starts, binary("sub_i64", rt.to_device(np.array(m, np.int64)), same, np.int64), axis=0)
    # the kernel's value output reads the positions themselves; the slices are gathered whole below
    _, first, inverse, counts = _numbered_runs(starts, order, order, sorted_)
    return gather(x, first, axis=axis), first, inverse, counts


# ---------------------------------------------------------------- NonMaxSuppression

_NMS_THREADS = 256  # threads of a (batch, class) pair's block


@cuda_kernel("NonMaxSuppression", host_inputs=(2, 3, 4))
def non_max_suppression(
    boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None, *, center_point_box=0
):
    """The CPU kernel's selection (ONNX's reference's arithmetic and comparisons; equal scores by box
    index, NaN scores last), the scalar inputs read on the host: indexing.cu's nms_corners computes
    every box's corners and area once, nms_select sorts and selects each (batch, class) pair's boxes
    in one block, the pairs' counts are summed (CumSum) and their total read back to the host (a run
    that holds NonMaxSuppression records no CUDA graph and runs eagerly), and nms_pack writes the
    rows. float16 / bfloat16 compute in float32, as on the CPU backend."""
    from gradgen.kernels.cuda.reduction import cum_sum

    rt = runtime()
    settings = cpu.nms_settings(
        boxes.shape, scores.shape, max_output_boxes_per_class, iou_threshold, score_threshold, center_point_box
    )
    same_type(boxes, scores)
    _float_dtype(boxes, "boxes")
    suffix = require_suffix(boxes.dtype)
    batches, classes, n = (int(d) for d in scores.shape)
    pairs, capacity = batches * classes, min(n, settings.limit)
    if pairs * capacity == 0:
        return rt.empty((0, 3), np.int64)
    if n >= 2**31:
        raise KernelError(f"{n} boxes exceed the CUDA kernel's 32-bit limit")
    wide = np.float64 if suffix == "f64" else np.float32
    corners = rt.empty((batches, n, 5), wide)  # y_min, x_min, y_max, x_max, area
    launch(
        kernel_of("indexing", f"nms_corners_{suffix}"),
        batches * n,
        corners,
        contiguous(boxes),
        np.int64(settings.center_point_box),
        np.int64(batches * n),
    )
    span = max(2, 1 << (n - 1).bit_length())  # the sort's length: a power of two
    keys, order = rt.empty((pairs, span), np.uint64), rt.empty((pairs, span), np.int64)
    gone = rt.empty((pairs, n), np.uint8)
    kept, counts = rt.empty((pairs, capacity), np.int64), rt.empty((pairs,), np.int64)
    threshold = settings.score_threshold
    kernel_of("indexing", f"nms_select_{suffix}")(
        kept,
        counts,
        keys,
        order,
        gone,
        corners,
        contiguous(scores),
        np.int64(pairs),
        np.int64(classes),
        np.int64(n),
        np.int64(span),
        np.int64(capacity),
        np.int64(threshold is not None),
        np.float64(0.0 if threshold is None else threshold),
        np.float64(settings.iou_threshold),
        block=(_NMS_THREADS, 1, 1),
        grid=(min(pairs, MAX_BLOCKS), 1),
    )
    ends = cum_sum(counts, 0)
    total = int(rt.to_host(ends[pairs - 1 : pairs])[0])
    out = rt.empty((total, 3), np.int64)
    if total:
        launch(
            kernel_of("indexing", "nms_pack"),
            pairs * capacity,
            out,
            kept,
            counts,
            ends,
            np.int64(classes),
            np.int64(capacity),
            np.int64(pairs * capacity),
        )
    return out
