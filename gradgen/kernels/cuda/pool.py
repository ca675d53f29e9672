"""CUDA launchers: pooling (pool.cu).

MaxPool (optional Indices output, the CPU kernel's flat-index semantics), AveragePool
(count_include_pad, pads, strides, dilations, ceil_mode), GlobalAveragePool and GlobalMaxPool
run on the GPU for up to 3 spatial axes and float16/bfloat16/float/double; other ranks and dtypes
run the numpy kernel and upload its result. The geometry (output shape, padding, the divisor bounds) is
resolved on the host by the CPU kernel's own helpers, so both devices agree on every corner case.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.kernels.cuda.launch import contiguous, cpu_fallback, is_float, kernel_of, launch, left_pad, require_suffix
from gradgen.kernels.table import cuda_kernel
from gradgen.ops.pool import declared_pads, pool_geometry

SPATIAL = 3  # spatial axes the kernels handle (pool.cu's GG_SP)

POOL_GEOM = np.dtype(
    [("nc", np.int64)]
    + [(f, np.int64, SPATIAL) for f in ("inp", "out", "k", "s", "d", "pb", "lo", "hi")]
    + [("storage_order", np.int64)]
)


# ---------------------------------------------------------------------------------------------
# pooling


def _pool_geom(x_shape, kernel, strides, dilations, begin, out, lo, hi, storage_order=0):
    spatial = list(x_shape[2:])
    g = np.zeros((), dtype=POOL_GEOM)
    g["nc"] = int(x_shape[0]) * int(x_shape[1])
    g["inp"] = left_pad(spatial, SPATIAL, 1)
    g["out"] = left_pad(out, SPATIAL, 1)
    g["k"] = left_pad(kernel, SPATIAL, 1)
    g["s"] = left_pad(strides, SPATIAL, 1)
    g["d"] = left_pad(dilations, SPATIAL, 1)
    g["pb"] = left_pad(begin, SPATIAL, 0)
    g["lo"] = left_pad(lo, SPATIAL, 0)
    g["hi"] = left_pad(hi, SPATIAL, 1)
    g["storage_order"] = int(storage_order)
    return g[()]


def _gpu_poolable(x) -> bool:
    return is_float(x.dtype) and 1 <= x.ndim - 2 <= SPATIAL


@cuda_kernel("MaxPool")
def max_pool(x, *, _num_outputs=1, **attrs):
    """``attrs``: the node's attributes, read with their ONNX defaults by gradgen.ops.pool (as the
    CPU kernel and the CPU fallback read them)."""
    from gradgen.cuda import runtime as rt

    kernel, s, d, begin, _end, out = pool_geometry(x.shape, attrs, "MaxPool")
    if not _gpu_poolable(x):
        return cpu_fallback("MaxPool", x, _num_outputs=_num_outputs, **attrs)
    x = contiguous(x)
    y_shape = tuple(x.shape[:2]) + tuple(out)
    y = rt.empty(y_shape, x.dtype)
    idx = rt.empty(y_shape, np.int64) if _num_outputs >= 2 else None
    geom = _pool_geom(x.shape, kernel, s, d, begin, out, [0] * len(out), x.shape[2:], int(attrs.get("storage_order", 0)))
    fn = kernel_of("pool", f"max_pool_{require_suffix(x.dtype)}")
    if y.size and x.size:
        launch(fn, y.size, y, idx if idx is not None else np.uint64(0), x, geom, np.int64(y.size))
    return (y, idx) if _num_outputs >= 2 else y


@cuda_kernel("AveragePool")
def average_pool(x, **attrs):
    """``attrs``: the node's attributes, read with their ONNX defaults (gradgen.ops.pool)."""
    from gradgen.cuda import runtime as rt

    kernel, s, d, begin, end, out = pool_geometry(x.shape, attrs, "AveragePool")
    if not _gpu_poolable(x):
        return cpu_fallback("AveragePool", x, **attrs)
    ns = len(kernel)
    declared = declared_pads(attrs.get("auto_pad", "NOTSET"), attrs.get("pads"), begin, end)
    spatial = list(x.shape[2:])
    if int(attrs.get("count_include_pad", 0)):
        lo = [-b for b in begin]
        hi = [size + declared[ns + a] for a, size in enumerate(spatial)]
    else:
        lo, hi = [0] * ns, spatial
    x = contiguous(x)
    y = rt.empty(tuple(x.shape[:2]) + tuple(out), x.dtype)
    geom = _pool_geom(x.shape, kernel, s, d, begin, out, lo, hi)
    fn = kernel_of("pool", f"avg_pool_{require_suffix(x.dtype)}")
    if y.size:
        launch(fn, y.size, y, x, geom, np.int64(y.size))
    return y


def _global_pool(x, mode: int):
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    rows = int(x.shape[0]) * int(x.shape[1]) if x.ndim >= 2 else 1
    cols = math.prod(int(d) for d in x.shape[2:])
    y = rt.empty(tuple(x.shape[:2]) + (1,) * (x.ndim - 2), x.dtype)
    if rows == 0:
        return y
    fn = kernel_of("pool", f"row_reduce_{require_suffix(x.dtype)}")
    fn(y, x, np.int64(rows), np.int64(cols), np.int64(mode), block=(256, 1, 1), grid=(min(rows, 1 << 20), 1))
    return y


@cuda_kernel("GlobalAveragePool")
def global_average_pool(x):
    if not is_float(x.dtype) or x.ndim < 2:
        return cpu_fallback("GlobalAveragePool", x)
    return _global_pool(x, 0)


@cuda_kernel("GlobalMaxPool")
def global_max_pool(x):
    if not is_float(x.dtype) or x.ndim < 3 or any(int(d) == 0 for d in x.shape[2:]):
        return cpu_fallback("GlobalMaxPool", x)
    return _global_pool(x, 1)
