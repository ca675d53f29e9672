"""CUDA launchers: normalization (norm.cu).

LayerNormalization, InstanceNormalization and GroupNormalization run one block per normalized
row (two passes for mean and variance, as the CPU kernel computes them, then the affine write);
BatchNormalization in inference form is elementwise. Training-mode BatchNormalization and scale or
bias shapes that need broadcasting run through the CPU kernel.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.elementwise import cast_to
from gradgen.kernels.cuda.launch import contiguous, cpu_fallback, dtype_suffix, is_float, kernel_of, launch, same_type
from gradgen.kernels.table import cuda_kernel
from gradgen.ops.axes import normalize_axis


def _threads(length: int) -> int:
    """Threads per row: about 4 elements each, 32..512."""
    want = max(1, math.ceil(length / 4))
    return min(512, max(32, 1 << (want - 1).bit_length()))


def _stash(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def norm_rows(x, scale, bias, rows: int, length: int, mode: int = 0, channels: int = 1, groups: int = 1,
              spatial: int = 1, epsilon: float = 1e-5):
    """(y, mean[rows], inv_std[rows]) of ``x`` normalized over rows of ``length``."""
    from gradgen.cuda import runtime as rt

    for t in (x, scale, bias):
        if t is not None:
            contiguous(t)
    st = _stash(x.dtype)
    y = rt.empty(x.shape, x.dtype)
    mean = rt.empty((rows,), st)
    inv = rt.empty((rows,), st)
    if rows and length == 0:  # empty rows: mean 0/0 and its inverse deviation are NaN, as on the CPU
        mean, inv = rt.to_device(np.full((rows,), np.nan, st)), rt.to_device(np.full((rows,), np.nan, st))
    elif rows and mode == 0 and length <= 1024:
        lanes = max(1, 1 << (-(-length // 32) - 1).bit_length())  # elements per lane: 1, 2, 4, ..., 32
        kernel = kernel_of("norm", f"norm_warp{lanes}_{dtype_suffix(x.dtype)}")
        kernel(y, mean, inv, x, scale, bias if bias is not None else np.intp(0), np.int64(rows), np.int64(length),
               np.float64(epsilon), block=(128, 1, 1), grid=(-(-rows // 4), 1))
    elif rows:
        kernel = kernel_of("norm", f"norm_rows_{dtype_suffix(x.dtype)}")
        kernel(y, mean, inv, x, scale, bias if bias is not None else np.intp(0), np.int64(length), np.int64(mode),
               np.int64(channels), np.int64(groups), np.int64(spatial), np.float64(epsilon),
               block=(_threads(length), 1, 1), grid=(rows, 1))
    return y, mean, inv


@cuda_kernel("LayerNormalization")
def layer_normalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    rank = len(x.shape)
    axis = normalize_axis(axis, rank)
    if int(stash_type) != 1:
        raise KernelError(f"stash_type={stash_type} is not supported (only 1, float32)")
    norm_shape = tuple(int(d) for d in x.shape[axis:])
    length = int(np.prod(norm_shape, dtype=np.int64))
    exact = all(
        t is None or (t.dtype == x.dtype and tuple(int(d) for d in t.shape) == norm_shape[len(norm_shape) - len(t.shape):]
                      and t.size == length)
        for t in (scale, bias)
    )
    if not is_float(x.dtype) or not exact:
        return cpu_fallback("LayerNormalization", x, scale, bias, axis=axis, epsilon=epsilon, stash_type=stash_type)
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    y, mean, inv = norm_rows(x, scale, bias, rows, length, epsilon=epsilon)
    stat_shape = tuple(int(d) for d in x.shape[:axis]) + (1,) * (rank - axis)
    # Mean / InvStdDev are float32 (stash_type 1), double inputs too: computed in double, stored in float
    mean, inv = (v.reshape(stat_shape) for v in (mean, inv))
    if mean.dtype != np.float32:
        mean, inv = cast_to(mean, np.float32), cast_to(inv, np.float32)
    return y, mean, inv


def _channel_params_ok(x, channels, *params) -> bool:
    return all(p is not None and p.dtype == x.dtype and p.size == channels for p in params)


@cuda_kernel("InstanceNormalization")
def instance_normalization(x, scale, bias, *, epsilon=1e-5):
    if len(x.shape) < 2 or not is_float(x.dtype) or not _channel_params_ok(x, int(x.shape[1]), scale, bias):
        return cpu_fallback("InstanceNormalization", x, scale, bias, epsilon=epsilon)
    n, c = (int(d) for d in x.shape[:2])
    spatial = int(np.prod(x.shape[2:], dtype=np.int64))
    return norm_rows(x, scale, bias, n * c, spatial, mode=1, channels=c, epsilon=epsilon)[0]


@cuda_kernel("GroupNormalization")
def group_normalization(x, scale, bias, *, epsilon=1e-5, num_groups=None, stash_type=1):
    if num_groups is None:
        raise KernelError("GroupNormalization needs the num_groups attribute")
    g = int(num_groups)
    if len(x.shape) < 2:
        return cpu_fallback("GroupNormalization", x, scale, bias, epsilon=epsilon, num_groups=num_groups,
                            stash_type=stash_type)
    n, c = (int(d) for d in x.shape[:2])
    if g < 1 or c % g:
        raise KernelError(f"num_groups={g} does not divide the {c} channels")
    if int(stash_type) != 1:
        raise KernelError(f"stash_type={stash_type} is not supported (only 1, float32)")
    if scale.size == c:
        mode = 2
    elif scale.size == g:
        mode = 3
    else:
        raise KernelError(f"scale has {scale.size} entries; expected {c} (channels) or {g} (groups)")
    if not is_float(x.dtype) or not _channel_params_ok(x, scale.size, scale, bias):
        return cpu_fallback("GroupNormalization", x, scale, bias, epsilon=epsilon, num_groups=num_groups,
                            stash_type=stash_type)
    spatial = int(np.prod(x.shape[2:], dtype=np.int64))
    return norm_rows(x, scale, bias, n * g, (c // g) * spatial, mode=mode, channels=c, groups=g, spatial=spatial,
                     epsilon=epsilon)[0]


@cuda_kernel("BatchNormalization")
def batch_normalization(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0,
                        _num_outputs=1):
    from gradgen.cuda import runtime as rt

    training = int(training_mode) == 1 or _num_outputs > 1
    channels = int(x.shape[1]) if len(x.shape) >= 2 else 1
    if (training or len(x.shape) < 2 or not is_float(x.dtype)
            or not _channel_params_ok(x, channels, scale, bias, input_mean, input_var)):
        return cpu_fallback("BatchNormalization", x, scale, bias, input_mean, input_var, epsilon=epsilon,
                            momentum=momentum, training_mode=training_mode, _num_outputs=_num_outputs)
    for t in (x, scale, bias, input_mean, input_var):
        contiguous(t)
    same_type(x, scale, bias, input_mean, input_var)
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    y = rt.empty(x.shape, x.dtype)
    launch(kernel_of("norm", f"batch_norm_{dtype_suffix(x.dtype)}"), y.size, y, x, scale, bias, input_mean, input_var,
              np.int64(channels), np.int64(inner), np.float64(epsilon), np.int64(y.size))
    return y
