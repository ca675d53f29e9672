"""CUDA launchers: indexing (indexing.cu; the scatters use microsoft.cu's deterministic kernels).

Indices arrive on the device (int32 or int64). Negative ones are normalised in the kernels; an
out-of-range index sets a device flag and writes nothing, and the launcher then raises the CPU
kernel's exact error (it re-checks the indices on the host, which only happens on that error path).
Scatter reductions are deterministic, with no float atomics: ScatterElements folds each target's
updates in position order (none: the last wins, like the CPU kernel); ScatterND groups positions per
target row with a stable counting sort. ScatterND with mul/max/min, and scatters of integer data,
run the CPU kernel.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import indexing as cpu
from gradgen.kernels.cuda import copy as cp
from gradgen.kernels.cuda import microsoft as ms
from gradgen.kernels.registry import cuda_kernel

_MODES = {"add": 0, "none": 1, "mul": 2, "max": 3, "min": 4}


def _rt():
    from gradgen.cuda import runtime as rt

    return rt


def _index_suffix(indices) -> str:
    if indices.dtype == np.int32:
        return "i32"
    if indices.dtype == np.int64:
        return "i64"
    raise KernelError(f"index tensor must be int32 or int64, got {indices.dtype}")


def _word(esize: int, inner: int, arrays) -> tuple[int, int]:
    """(word width in bytes, elements per word) for moving runs of ``inner`` contiguous elements."""
    for w in (16, 8, 4):
        r = w // esize
        if w > esize and w % esize == 0 and inner % r == 0 and all(int(a.gpudata) % w == 0 for a in arrays):
            return w, r
    return esize, 1


def _check(flag, indices, size, axis, normalise=None):
    normalise = normalise or (lambda h, s, a: cpu._normalize_indices(h, s, a))
    _rt().check_flag(flag, lambda _value: ms.raise_index_error(indices, size, axis, normalise))


@cuda_kernel("Gather")
def gather(data, indices, *, axis=0):
    rt = _rt()
    rank = len(data.shape)
    axis = cpu._axis(axis, rank)
    suffix = _index_suffix(indices)
    size = data.shape[axis]
    out_shape = tuple(data.shape[:axis]) + tuple(indices.shape) + tuple(data.shape[axis + 1:])
    out = rt.empty(out_shape, data.dtype)
    if out.size == 0:
        if indices.size and size == 0:  # every index is out of range
            cpu._normalize_indices(rt.to_host(indices), size, axis)
        return out
    x = cp.contiguous(data)
    idx = ms._dev(indices)
    inner, count = math.prod(data.shape[axis + 1:]), indices.size
    w, r = _word(data.dtype.itemsize, inner, [x, out])
    n = out.size // r
    flag = rt.zeros((1,), np.int64)
    rt.launch(rt.function("indexing", f"gather_w{w}_{suffix}"), n, out, x, idx, flag, np.int64(count),
              np.int64(size), np.int64(inner // r), np.int64(n))
    _check(flag, indices, size, axis)
    return out


@cuda_kernel("GatherElements")
def gather_elements(data, indices, *, axis=0):
    rt = _rt()
    rank = len(data.shape)
    axis = cpu._axis(axis, rank)
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
        cpu._normalize_indices(rt.to_host(indices), size, axis)
    x = cp.contiguous(data)
    idx = ms._dev(indices)
    flag = rt.zeros((1,), np.int64)
    kernel = rt.function("indexing", f"gather_elements_w{data.dtype.itemsize}_{suffix}")
    rt.launch(kernel, out.size, out, x, idx, flag, cp.desc(indices.shape, rt.contiguous_strides(data.shape)),
              np.int64(axis), np.int64(size), np.int64(out.size))
    _check(flag, indices, size, axis)
    return out


def _nd_check(data_shape, indices_shape, b):
    if len(indices_shape) < 1:
        raise KernelError("indices must have rank >= 1")
    k = indices_shape[-1]
    if b + k > len(data_shape):
        raise KernelError(f"indices.shape[-1] ({k}) + batch_dims ({b}) exceeds data rank {len(data_shape)}")
    if tuple(data_shape[:b]) != tuple(indices_shape[:b]):
        raise KernelError(f"the first {b} (batch) dimensions of data {list(data_shape)} and indices "
                          f"{list(indices_shape)} differ")
    return k


def _nd_error(indices, data_shape, first_axis):
    host = _rt().to_host(indices)
    cpu._nd_tuple(tuple(data_shape), host, first_axis)
    raise KernelError("an index of indices is out of range")


@cuda_kernel("GatherND")
def gather_nd(data, indices, *, batch_dims=0):
    rt = _rt()
    b = int(batch_dims)
    suffix = _index_suffix(indices)
    k = _nd_check(data.shape, indices.shape, b)
    out_shape = tuple(indices.shape[:-1]) + tuple(data.shape[b + k:])
    out = rt.empty(out_shape, data.dtype)
    if out.size == 0:
        if indices.size and 0 in data.shape[b:b + k]:
            _nd_error(indices, data.shape, b)
        return out
    x = cp.contiguous(data)
    idx = ms._dev(indices)
    inner = math.prod(data.shape[b + k:])
    w, r = _word(data.dtype.itemsize, inner, [x, out])
    strides = rt.contiguous_strides(data.shape)
    batch = math.prod(data.shape[:b])
    M = math.prod(indices.shape[b:-1])
    kd = cp.desc(data.shape[b:b + k], [s // r for s in strides[b:b + k]])
    batch_stride = (strides[b - 1] if b else x.size) // r
    n = out.size // r
    flag = rt.zeros((1,), np.int64)
    rt.launch(rt.function("indexing", f"gather_nd_w{w}_{suffix}"), n, out, x, idx if k else np.uintp(0), flag, kd,
              np.int64(M), np.int64(inner // r), np.int64(batch_stride), np.int64(n))
    if batch == 0:
        return out
    rt.check_flag(flag, lambda _value: _nd_error(indices, data.shape, b))
    return out


@cuda_kernel("ScatterElements", "Scatter")
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    rt = _rt()
    reduction = cpu._check_reduction(reduction)
    rank = len(data.shape)
    axis = cpu._axis(axis, rank)
    if tuple(indices.shape) != tuple(updates.shape) or len(indices.shape) != rank:
        raise KernelError(f"indices {list(indices.shape)} and updates {list(updates.shape)} must have the same shape "
                          f"and data's rank {rank}")
    for d, (n, m) in enumerate(zip(indices.shape, data.shape)):
        if d != axis and n > m:
            raise KernelError(f"indices dimension {d} is {n}, larger than data's {m}")
    _index_suffix(indices)
    if np.dtype(data.dtype).name not in ("float16", "float32", "float64") or updates.dtype != data.dtype:
        return _rt().run_on_host(cpu.scatter_elements, data, indices, updates, axis=axis, reduction=reduction)
    if data.size == 0:
        if indices.size:
            cpu._normalize_indices(rt.to_host(indices), data.shape[axis], axis)
        return rt.empty(data.shape, data.dtype)
    x = cp.contiguous(data)
    upd = cp.contiguous(updates) if updates.size else updates
    out, flag = ms.line_scatter(upd, indices, tuple(data.shape), axis, init=x, mode=_MODES[reduction])
    if indices.size:
        _check(flag, indices, data.shape[axis], axis)
    return out


@cuda_kernel("ScatterND")
def scatter_nd(data, indices, updates, *, reduction="none"):
    rt = _rt()
    reduction = cpu._check_reduction(reduction)
    _index_suffix(indices)
    k = _nd_check(data.shape, indices.shape, 0)
    want = tuple(indices.shape[:-1]) + tuple(data.shape[k:])
    if tuple(updates.shape) != want:
        raise KernelError(f"updates shape {list(updates.shape)} should be {list(want)}")
    if (reduction not in ("none", "add") or np.dtype(data.dtype).name not in ("float16", "float32", "float64")
            or updates.dtype != data.dtype):
        return _rt().run_on_host(cpu.scatter_nd, data, indices, updates, reduction=reduction)
    if data.size == 0:
        if indices.size and 0 in data.shape[:k]:
            _nd_error(indices, data.shape, 0)
        return rt.empty(data.shape, data.dtype)
    x = cp.contiguous(data)
    upd = cp.contiguous(updates) if updates.size else updates
    rows, inner = math.prod(data.shape[:k]), math.prod(data.shape[k:])
    count = math.prod(indices.shape[:-1])
    idx = ms._dev(indices) if indices.size else indices
    out, flag = ms.row_scatter(upd, idx, 1, rows, inner, count, list(data.shape[:k]),
                               rt.contiguous_strides(data.shape[:k]), init=x, mode=0 if reduction == "add" else 1)
    if count:
        rt.check_flag(flag, lambda _value: _nd_error(indices, data.shape, 0))
    return out.reshape(tuple(data.shape))
