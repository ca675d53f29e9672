"""CUDA launchers: pooling (pool.cu), and the small device helpers the matmul and conv launchers share.

MaxPool (optional Indices output, the CPU kernel's flat-index semantics), AveragePool
(count_include_pad, pads, strides, dilations, ceil_mode), GlobalAveragePool and GlobalMaxPool
run on the GPU for up to 3 spatial axes and float16/float/double; other ranks and dtypes run the
numpy kernel and upload its result. The geometry (output shape, padding, the divisor bounds) is
resolved on the host by the CPU kernel's own helpers, so both devices agree on every corner case.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.numeric import spatial_attrs
from gradgen.kernels.registry import cuda_kernel

SPATIAL = 3  # spatial axes the kernels handle (pool.cu's GG_SP)
FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))

POOL_GEOM = np.dtype([("nc", np.int64)] + [(f, np.int64, SPATIAL) for f in ("inp", "out", "k", "s", "d", "pb", "lo", "hi")]
                     + [("storage_order", np.int64)])
CONV_GEOM = np.dtype([(f, np.int64) for f in ("n", "c", "m", "g")]
                     + [(f, np.int64, SPATIAL) for f in ("inp", "out", "k", "s", "d", "pb")])

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# shared device helpers


def ptr(array) -> int:
    """The raw device address of a GPUArray (0 for an empty one)."""
    return 0 if array is None or array.gpudata is None else int(array.gpudata)


def element_strides(array) -> list[int]:
    return [s // array.dtype.itemsize for s in array.strides]


def is_contiguous(array) -> bool:
    from gradgen.cuda import runtime as rt

    if array.size <= 1:
        return True
    return all(st == c for st, c, d in zip(element_strides(array), rt.contiguous_strides(array.shape), array.shape) if d != 1)


def launch(kernel, n: int, *args, stream=None, block: int = 256) -> None:
    """A grid-stride launch over ``n`` items on ``stream`` (None: the default stream)."""
    if n <= 0:
        return
    kernel(*args, block=(block, 1, 1), grid=(max(1, min(-(-n // block), 65535 * 8)), 1), stream=stream)


def barrier() -> None:
    """An empty launch on the default stream: it waits for every blocking side stream's earlier work."""
    from gradgen.cuda import runtime as rt

    rt.function("pool", "noop")(np.int64(0), block=(1, 1, 1), grid=(1, 1))


def window_copy(src, out_shape, shift=None, view_strides=None, view_shape=None, stream=None):
    """A new C-contiguous array of ``out_shape``: out[o] = src[o + shift] inside src, 0 outside.

    ``view_strides``/``view_shape`` read ``src`` through other strides (0 for a broadcast axis).
    """
    from gradgen.cuda import runtime as rt

    out_shape = tuple(int(d) for d in out_shape)
    out = rt.empty(out_shape, src.dtype)
    if out.size == 0:
        return out
    rank = len(out_shape)
    view_shape = list(src.shape) if view_shape is None else list(view_shape)
    view_strides = element_strides(src) if view_strides is None else list(view_strides)
    if rank == 0:
        out_shape_desc, view_shape, view_strides = (1,), [1], [0]
        rank = 1
    else:
        out_shape_desc = out_shape
    shift = [0] * rank if shift is None else [int(s) for s in shift]
    kernel = rt.function("pool", f"window_copy_{rt.suffix(src.dtype)}")
    launch(kernel, out.size, out, src, rt.desc(out_shape_desc), rt.desc(view_shape, view_strides),
           rt.desc(shift), np.int64(out.size), stream=stream)
    return out


def contiguous(array):
    """``array`` itself when C-contiguous, else a contiguous copy."""
    if array.size == 0 or is_contiguous(array):
        return array
    return window_copy(array, array.shape)


def broadcast_to(array, shape):
    """A contiguous copy of ``array`` broadcast (numpy rules) to ``shape``."""
    shape = tuple(int(d) for d in shape)
    lead = len(shape) - array.ndim
    strides = [0] * lead + [0 if d == 1 and t != 1 else s
                            for d, t, s in zip(array.shape, shape[lead:], element_strides(array))]
    return window_copy(array, shape, view_strides=strides, view_shape=list(shape))


def channel_sum(x, out=None, stream=None, keep=None):
    """Sum of an (N, C, ...) array over every axis but 1: per-(channel, row range) block partial sums,
    then one ordered sum per channel (deterministic; the partition depends on the shape only)."""
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    c = int(x.shape[1])
    outer, inner = int(x.shape[0]), math.prod(int(d) for d in x.shape[2:])
    if out is None:
        out = rt.empty((c,), x.dtype)
    if c == 0:
        return out
    if outer * inner == 0:
        rt.memset_zero(out)
        return out
    # Enough blocks to fill the GPU (about 1024 of them), each at least a few thousand elements.
    splits = max(1, min(outer, -(-1024 // c), max(1, (outer * inner) // 2048)))
    acc = np.float64 if x.dtype == np.float64 else np.float32
    partial = rt.empty((c * splits,), acc)
    if keep is not None:
        keep.append(partial)
    sfx = rt.suffix(x.dtype)
    rt.function("pool", f"channel_partial_{sfx}")(partial, x, np.int64(outer), np.int64(c), np.int64(inner),
                                                  np.int64(splits), block=(256, 1, 1),
                                                  grid=(min(c * splits, 1 << 20), 1), stream=stream)
    launch(rt.function("pool", f"channel_finish_{sfx}"), c, out, partial, np.int64(c), np.int64(splits), stream=stream)
    return out


def add_channel_bias(y, b) -> None:
    """y += b broadcast along axis 1, in place."""
    from gradgen.cuda import runtime as rt

    if y.size == 0:
        return
    inner = math.prod(int(d) for d in y.shape[2:])
    kernel = rt.function("pool", f"add_channel_bias_{rt.suffix(y.dtype)}")
    rt.launch(kernel, y.size, y, contiguous(b), np.int64(y.shape[1]), np.int64(inner), np.int64(y.size))


def cpu_fallback(op: str, fn, *args, **kwargs):
    """Run the numpy kernel on host copies and upload its result(s) (one warning per op)."""
    from gradgen.cuda import runtime as rt

    warn_once(op, f"{op}: this configuration has no CUDA kernel; running the numpy kernel")
    return rt.run_on_host(fn, *args, **kwargs)


# ---------------------------------------------------------------------------------------------
# pooling


def _pad3(values, fill):
    values = [int(v) for v in values]
    return [fill] * (SPATIAL - len(values)) + values


def _pool_geom(x_shape, kernel, strides, dilations, begin, out, lo, hi, storage_order=0):
    spatial = list(x_shape[2:])
    g = np.zeros((), dtype=POOL_GEOM)
    g["nc"] = int(x_shape[0]) * int(x_shape[1])
    g["inp"] = _pad3(spatial, 1)
    g["out"] = _pad3(out, 1)
    g["k"] = _pad3(kernel, 1)
    g["s"] = _pad3(strides, 1)
    g["d"] = _pad3(dilations, 1)
    g["pb"] = _pad3(begin, 0)
    g["lo"] = _pad3(lo, 0)
    g["hi"] = _pad3(hi, 1)
    g["storage_order"] = int(storage_order)
    return g[()]


def _gpu_poolable(x) -> bool:
    return x.dtype in FLOATS and 1 <= x.ndim - 2 <= SPATIAL


@cuda_kernel("MaxPool")
def max_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None, storage_order=0,
             strides=None, _num_outputs=1):
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu import pool as nn

    attrs = dict(auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations, kernel_shape=kernel_shape, pads=pads,
                 storage_order=storage_order, strides=strides)
    if kernel_shape is None:
        raise KernelError("MaxPool needs the kernel_shape attribute")
    if not _gpu_poolable(x):
        return cpu_fallback("MaxPool", nn.max_pool, x, _num_outputs=_num_outputs, **attrs)
    kernel, s, d, begin, _end, out = spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    x = contiguous(x)
    y_shape = tuple(x.shape[:2]) + tuple(out)
    y = rt.empty(y_shape, x.dtype)
    idx = rt.empty(y_shape, np.int64) if _num_outputs >= 2 else None
    geom = _pool_geom(x.shape, kernel, s, d, begin, out, [0] * len(out), x.shape[2:], storage_order)
    fn = rt.function("pool", f"max_pool_{rt.suffix(x.dtype)}")
    if y.size and x.size:
        rt.launch(fn, y.size, y, idx if idx is not None else np.uint64(0), x, geom, np.int64(y.size))
    return (y, idx) if _num_outputs >= 2 else y


@cuda_kernel("AveragePool")
def average_pool(x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                 pads=None, strides=None):
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu import pool as nn

    attrs = dict(auto_pad=auto_pad, ceil_mode=ceil_mode, count_include_pad=count_include_pad, dilations=dilations,
                 kernel_shape=kernel_shape, pads=pads, strides=strides)
    if kernel_shape is None:
        raise KernelError("AveragePool needs the kernel_shape attribute")
    if not _gpu_poolable(x):
        return cpu_fallback("AveragePool", nn.average_pool, x, **attrs)
    kernel, s, d, begin, end, out = spatial_attrs(x.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    declared = nn.declared_pads(auto_pad, pads, begin, end)
    spatial = list(x.shape[2:])
    if int(count_include_pad):
        lo = [-b for b in begin]
        hi = [size + declared[ns + a] for a, size in enumerate(spatial)]
    else:
        lo, hi = [0] * ns, spatial
    x = contiguous(x)
    y = rt.empty(tuple(x.shape[:2]) + tuple(out), x.dtype)
    geom = _pool_geom(x.shape, kernel, s, d, begin, out, lo, hi)
    fn = rt.function("pool", f"avg_pool_{rt.suffix(x.dtype)}")
    if y.size:
        rt.launch(fn, y.size, y, x, geom, np.int64(y.size))
    return y


def _global_pool(x, mode: int):
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    rows = int(x.shape[0]) * int(x.shape[1]) if x.ndim >= 2 else 1
    cols = math.prod(int(d) for d in x.shape[2:])
    y = rt.empty(tuple(x.shape[:2]) + (1,) * (x.ndim - 2), x.dtype)
    if rows == 0:
        return y
    fn = rt.function("pool", f"row_reduce_{rt.suffix(x.dtype)}")
    fn(y, x, np.int64(rows), np.int64(cols), np.int64(mode), block=(256, 1, 1), grid=(min(rows, 1 << 20), 1))
    return y


@cuda_kernel("GlobalAveragePool")
def global_average_pool(x):
    from gradgen.kernels.cpu import pool as nn

    if x.dtype not in FLOATS or x.ndim < 2:
        return cpu_fallback("GlobalAveragePool", nn.global_average_pool, x)
    return _global_pool(x, 0)


@cuda_kernel("GlobalMaxPool")
def global_max_pool(x):
    from gradgen.kernels.cpu import pool as nn

    if x.dtype not in FLOATS or x.ndim < 3 or any(int(d) == 0 for d in x.shape[2:]):
        return cpu_fallback("GlobalMaxPool", nn.global_max_pool, x)
    return _global_pool(x, 1)
