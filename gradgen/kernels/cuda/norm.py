"""CUDA launchers: normalization (norm.cu).

LayerNormalization, InstanceNormalization and GroupNormalization run one block per normalized
row (two passes for mean and variance, as the CPU kernel computes them, then the affine write);
BatchNormalization is elementwise with the running statistics (inference) or with the batch's
(training mode: the per-channel mean, then the mean of squared deviations, each one pass of
per-chunk sums and one fixed-order finish); a 16-bit X with float32 parameters too, as AutocastPass
leaves it: computed in float32, rounded once. ONNX Runtime training's BatchNormInternal adds the
saved inverse deviation to that, and BatchNormalizationGrad reads X and dY once for its sums and
once for dX. Scale or bias shapes that need broadcasting run through the CPU kernel.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.norm import batch_norm_grad_layout
from gradgen.kernels.cuda.elementwise import binary, cast_to, device_scalar, equal, in_float32, unary, where
from gradgen.kernels.cuda.launch import (
    BLOCK,
    FLOATS,
    contiguous,
    cpu_fallback,
    dtype_suffix,
    generated_module,
    is_float,
    kernel_of,
    launch,
    runtime,
    stream,
)
from gradgen.kernels.cuda.reduction import reduce
from gradgen.kernels.cuda.shape import reshaped
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.axes import normalize_axis


def _threads(length: int) -> int:
    """Threads per row: about 4 elements each, 32..512."""
    want = max(1, math.ceil(length / 4))
    return min(512, max(32, 1 << (want - 1).bit_length()))


def _stash(dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def norm_rows(
    x,
    scale,
    bias,
    rows: int,
    length: int,
    mode: int = 0,
    channels: int = 1,
    groups: int = 1,
    spatial: int = 1,
    epsilon: float = 1e-5,
):
    """(y, mean[rows], inv_std[rows]) of ``x`` normalized over rows of ``length``."""
    from gradgen.cuda import runtime as rt

    x, scale, bias = (None if t is None else contiguous(t) for t in (x, scale, bias))
    st = _stash(x.dtype)
    y = rt.empty(x.shape, x.dtype)
    mean = rt.empty((rows,), st)
    inv = rt.empty((rows,), st)
    operands = (y, mean, inv, x, scale, bias if bias is not None else np.intp(0))  # both kernels' first arguments
    if rows and length == 0:  # empty rows: mean 0/0 and its inverse deviation are NaN, as on the CPU
        mean, inv = rt.to_device(np.full((rows,), np.nan, st)), rt.to_device(np.full((rows,), np.nan, st))
    elif rows and mode == 0 and length <= 1024:
        lanes = max(1, 1 << (-(-length // 32) - 1).bit_length())  # elements per lane: 1, 2, 4, ..., 32
        kernel = kernel_of("norm", f"norm_warp{lanes}_{dtype_suffix(x.dtype)}")
        kernel(
            *operands,
            np.int64(rows),
            np.int64(length),
            np.float64(epsilon),
            block=(128, 1, 1),
            grid=(-(-rows // 4), 1),
        )
    elif rows:
        kernel = kernel_of("norm", f"norm_rows_{dtype_suffix(x.dtype)}")
        kernel(
            *operands,
            np.int64(length),
            np.int64(mode),
            np.int64(channels),
            np.int64(groups),
            np.int64(spatial),
            np.float64(epsilon),
            block=(_threads(length), 1, 1),
            grid=(rows, 1),
        )
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
        t is None
        or (
            t.dtype == x.dtype
            and tuple(int(d) for d in t.shape) == norm_shape[len(norm_shape) - len(t.shape) :]
            and t.size == length
        )
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
        return cpu_fallback("GroupNormalization", x, scale, bias, epsilon=epsilon, num_groups=num_groups, stash_type=stash_type)
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
        return cpu_fallback("GroupNormalization", x, scale, bias, epsilon=epsilon, num_groups=num_groups, stash_type=stash_type)
    spatial = int(np.prod(x.shape[2:], dtype=np.int64))
    return norm_rows(
        x, scale, bias, n * g, (c // g) * spatial, mode=mode, channels=c, groups=g, spatial=spatial, epsilon=epsilon
    )[0]


def _bn_param_type(x, channels, params):
    """The dtype suffix of BatchNormalization's kernel for x and its four per-channel parameters: x's
    own (all of x's type), ``<x>_f32`` (a 16-bit x with float32 parameters), None (no kernel)."""
    if not is_float(x.dtype) or not all(p is not None and p.size == channels for p in params):
        return None
    s = dtype_suffix(x.dtype)
    if all(p.dtype == x.dtype for p in params):
        return s
    if s in ("f16", "bf16") and all(np.dtype(p.dtype) == np.float32 for p in params):
        return f"{s}_f32"
    return None


@cuda_kernel("BatchNormalization")
def batch_normalization(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0, _num_outputs=1):
    """On the device where x has the parameters' type (float32, float64) or is 16-bit with float32
    parameters, in inference and training mode; other configurations run the numpy kernel."""
    training = int(training_mode) == 1 or _num_outputs > 1
    channels = int(x.shape[1]) if len(x.shape) >= 2 else 1
    params = (scale, bias, input_mean, input_var)
    suffix = _bn_param_type(x, channels, params) if len(x.shape) >= 2 else None
    attrs = dict(epsilon=epsilon, momentum=momentum, training_mode=training_mode, _num_outputs=_num_outputs)
    if training and _trains_on_device(x, suffix):
        return _batch_norm_training(x, params, suffix, epsilon, momentum, legacy_outputs=_num_outputs > 3)
    if training and suffix is not None and suffix.endswith("_f32"):
        # a 16-bit x with float32 parameters the device path does not take (an empty batch, C >
        # 65,535): the fallback in float32, which would round every float result to 16 bits
        results = cpu_fallback("BatchNormalization", cast_to(x, np.float32), *params, **attrs)
        return (cast_to(results[0], x.dtype), *results[1:])
    if training or suffix is None:
        return cpu_fallback("BatchNormalization", x, *params, **attrs)
    return _batch_norm_apply(x, scale, bias, input_mean, input_var, suffix, epsilon)


def _batch_norm_training(x, params, suffix: str, epsilon, momentum, legacy_outputs: bool):
    """Training mode on the device, the CPU kernel's formulas: per-channel batch mean, the biased
    variance as the mean of squared deviations, Y normalised with them (the inference kernel), and
    running = input * momentum + batch * (1 - momentum). A 16-bit x (with float32 parameters, the
    only 16-bit form that comes here) has float32 statistics; only Y is rounded to x's type.
    ``legacy_outputs``: opset < 14's five outputs, the batch mean and variance last."""
    scale, bias, input_mean, input_var = params
    x = contiguous(x)
    batch_mean = _channel_mean(x, None, mode=0)
    batch_var = _channel_mean(x, batch_mean, mode=1)
    y = _batch_norm_apply(x, scale, bias, batch_mean, batch_var, suffix, epsilon)
    mom = np.dtype(batch_mean.dtype).type(momentum)
    keep, blend = device_scalar(mom, batch_mean.dtype), device_scalar(1 - mom, batch_mean.dtype)
    running = [
        _op("add", _op("mul", stat, keep), _op("mul", batch, blend))
        for stat, batch in ((input_mean, batch_mean), (input_var, batch_var))
    ]
    if legacy_outputs:
        return y, *running, batch_mean, batch_var
    return y, *running


# BatchNormalization's per-channel sums (norm.cu, bn_partial): a grid of (chunks, C) blocks, about
# BN_TARGET_BLOCKS in all (a constant, not the device's SM count: the chunking, and with it the
# bits, depend on the shape only), each summing at least BN_MIN_CHUNK elements of its channel.
BN_TARGET_BLOCKS = 528
BN_MIN_CHUNK = 2048
BN_THREADS = 256
MAX_GRID_Y = 65535


def _bn_chunks(channels: int, per_channel: int) -> tuple[int, int]:
    """(chunks, elements per chunk) of each channel's ``per_channel`` elements."""
    chunks = max(1, min(-(-BN_TARGET_BLOCKS // channels), -(-per_channel // BN_MIN_CHUNK)))
    chunk = -(-per_channel // chunks)
    return -(-per_channel // chunk), chunk


def _bn_fits(x) -> bool:
    """Whether the per-channel kernels take x: (N, C, ...), not empty, C within a grid's y extent."""
    return len(x.shape) >= 2 and x.size > 0 and int(x.shape[1]) <= MAX_GRID_Y


def _trains_on_device(x, suffix: str | None) -> bool:
    """Whether training-mode BatchNormalization of x, whose parameters give ``suffix``
    (``_bn_param_type``), runs on the device: float32 or float64 throughout, or a 16-bit x with
    float32 parameters, and a tensor the per-channel kernels take."""
    return suffix is not None and (suffix in ("f32", "f64") or suffix.endswith("_f32")) and _bn_fits(x)


def _bn_partial_sums(a, b, center, mode: int):
    """The per-chunk sums of mode ``mode`` (norm.cu, bn_partial) over each channel of the contiguous
    (N, C, ...) tensor ``a``: a (C, chunks, 2) array in the accumulation type, and chunks."""
    from gradgen.cuda import runtime as rt

    channels = int(a.shape[1])
    inner = int(np.prod(a.shape[2:], dtype=np.int64))
    per_channel = int(a.shape[0]) * inner
    chunks, chunk = _bn_chunks(channels, per_channel)
    s = dtype_suffix(a.dtype)
    partial = rt.empty((channels, chunks, 2), np.float64 if s == "f64" else np.float32)
    entry = f"bn_partial_32_{s}" if a.size < 2**31 else f"bn_partial_{s}"
    null = np.intp(0)
    kernel_of("norm", entry)(
        partial,
        a,
        null if b is None else b,
        null if center is None else center,
        np.int64(channels),
        np.int64(inner),
        np.int64(per_channel),
        np.int64(chunk),
        np.int32(mode),
        block=(BN_THREADS, 1, 1),
        grid=(chunks, channels),
        stream=stream(),
    )
    return partial, chunks


def _channel_mean(x, center, mode: int):
    """Per-channel mean of x (mode 0) or of (x - center)^2 (mode 1) over every axis but 1, a (C,)
    array in the accumulation type (float32 for 16-bit x)."""
    from gradgen.cuda import runtime as rt

    partial, chunks = _bn_partial_sums(x, None, center, mode)
    channels = int(x.shape[1])
    out = rt.empty((channels,), partial.dtype)
    count = np.float64(x.size // channels)
    finish = kernel_of("norm", f"bn_mean_finish_{dtype_suffix(partial.dtype)}")
    launch(finish, channels, out, partial, np.int64(channels), np.int64(chunks), count)
    return out


@cuda_kernel("BatchNormInternal", domain=MICROSOFT)
def batch_norm_internal(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=1, _num_outputs=5):
    """BatchNormalization's training form on the device (``_batch_norm_training``) plus saved_inv_std =
    1 / sqrt(batch variance + epsilon); inference mode and the configurations it does not take run
    as BatchNormalization does."""
    from gradgen.cuda import runtime as rt

    params = (scale, bias, input_mean, input_var)
    if int(training_mode) == 0:
        return batch_normalization(x, *params, epsilon=epsilon)
    suffix = _bn_param_type(x, int(x.shape[1]), params) if len(x.shape) >= 2 else None
    if not _trains_on_device(x, suffix):
        attrs = dict(epsilon=epsilon, momentum=momentum, training_mode=training_mode)
        return cpu_fallback("BatchNormInternal", x, *params, domain=MICROSOFT, **attrs)
    assert suffix is not None  # _trains_on_device says so
    y, running_mean, running_var, batch_mean, batch_var = _batch_norm_training(x, params, suffix, epsilon, momentum, True)
    inv_std = rt.empty(batch_var.shape, batch_var.dtype)
    kernel = kernel_of("norm", f"bn_inv_std_{dtype_suffix(batch_var.dtype)}")
    launch(kernel, inv_std.size, inv_std, batch_var, np.float64(epsilon), np.int64(inv_std.size))
    return y, running_mean, running_var, batch_mean, inv_std


@cuda_kernel("BatchNormalizationGrad", domain=MICROSOFT)
def batch_normalization_grad(dY, X, scale, mean, variance, *, epsilon=1e-5):
    """(dX, dScale, dBias) from the saved batch mean and inverse deviation (``variance``), float32 or
    float64 throughout: one pass for the per-channel sums of dY and dY * (X - mean), one for dX
    (norm.cu, bn_partial mode 2, bn_grad_finish, bn_grad_dx); other types run the CPU kernel."""
    from gradgen.cuda import runtime as rt

    batch, channels, inner = batch_norm_grad_layout(dY, X, scale, mean, variance)
    s = dtype_suffix(X.dtype)
    if s not in ("f32", "f64") or any(t.dtype != X.dtype for t in (dY, scale, mean, variance)) or not _bn_fits(X):
        return cpu_fallback("BatchNormalizationGrad", dY, X, scale, mean, variance, domain=MICROSOFT, epsilon=epsilon)
    dY, X, scale, mean, variance = (contiguous(t) for t in (dY, X, scale, mean, variance))
    partial, chunks = _bn_partial_sums(X, dY, mean, mode=2)
    dscale, dbias = rt.empty(tuple(scale.shape), X.dtype), rt.empty(tuple(scale.shape), X.dtype)
    coef = rt.empty((channels, 3), X.dtype)
    count = np.float64(batch * inner)
    finish = kernel_of("norm", f"bn_grad_finish_{s}")
    launch(finish, channels, dscale, dbias, coef, partial, scale, variance, np.int64(channels), np.int64(chunks), count)
    dx = rt.empty(tuple(X.shape), X.dtype)
    entry = f"bn_grad_dx_32_{s}" if X.size < 2**31 else f"bn_grad_dx_{s}"
    launch(kernel_of("norm", entry), X.size, dx, dY, X, mean, coef, np.int64(channels), np.int64(inner), np.int64(X.size))
    return dx, dscale, dbias


def _batch_norm_apply(x, scale, bias, mean, var, suffix: str, epsilon):
    """(x - mean) / sqrt(var + epsilon) * scale + bias per channel, one elementwise launch."""
    from gradgen.cuda import runtime as rt

    channels = int(x.shape[1]) if len(x.shape) >= 2 else 1
    x, scale, bias, mean, var = (contiguous(t) for t in (x, scale, bias, mean, var))
    inner = int(np.prod(x.shape[2:], dtype=np.int64))
    y = rt.empty(x.shape, x.dtype)
    launch(
        kernel_of("norm", f"batch_norm_{suffix}"),
        y.size,
        y,
        x,
        scale,
        bias,
        mean,
        var,
        np.int64(channels),
        np.int64(inner),
        np.float64(epsilon),
        np.int64(y.size),
    )
    return y


# ---------------------------------------------------------------------------------------------
# LayerNormalizationGrad (com.microsoft): its device code is declared here, generated per float type
# and compiled at first use like the .cu files (launch.generated_module). Deterministic: one block per
# row for dX (fixed block-sum tree; one warp per row, tried, ran 1.8x slower on GPT-2's 2,048 x 768
# rows: too few warps to hide the loads), and the column sums of dScale / dBias in two fixed-order steps:
# per-chunk partial sums over a fixed number of row chunks (a function of the row count only), then
# one thread per column adding the chunks in order (in the last chunk block of each column tile to
# finish, told by a counter, or in a launch of its own where no counters are at hand). Accumulation in float (double for float64).

GRAD_MODULE = "norm_grad"
_GRAD_TYPES = (("f16", "__half"), ("bf16", "__nv_bfloat16"), ("f32", "float"), ("f64", "double"))
_ROWS_PER_CHUNK = 32
_MAX_CHUNKS = 256

_GRAD_TEMPLATE = r"""
// dX of one row per block: with xhat = (x - mean) * inv, b = dy * scale * inv,
// dX = b - mean(b) - xhat * mean(b * xhat) over the row (ONNX Runtime training's formula).
template <typename T>
__device__ void ln_grad_rows(T* dx, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ scale,
                             const float* __restrict__ mean, const float* __restrict__ inv, const T* __restrict__ res,
                             int64_t cols) {
    using A = typename Acc<T>::type;
    __shared__ A scratch[33];
    const int64_t row = blockIdx.x;
    const int64_t base = row * cols;
    const A m = (A)mean[row], r = (A)inv[row];
    A sb = 0, sc = 0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const A xh = ((A)gg_load(x + base + j) - m) * r;
        const A b = (A)gg_load(dy + base + j) * (A)gg_load(scale + j) * r;
        sb += b;
        sc += b * xh;
    }
    const A mb = block_sum(sb, scratch) / A(cols);
    const A mc = block_sum(sc, scratch) / A(cols);
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        const A xh = ((A)gg_load(x + base + j) - m) * r;
        const A b = (A)gg_load(dy + base + j) * (A)gg_load(scale + j) * r;
        A v = b - mb - xh * mc;
        if (res) v = (A)(typename Acc<T>::type)v + (A)gg_load(res + base + j);
        gg_store(dx + base + j, (typename Acc<T>::type)v);
    }
}

// dScale[j] and dBias[j]: the chunks' partial sums added in chunk order (read from L2: another
// block may have written them).
template <typename T>
__device__ __forceinline__ void ln_grad_column(int64_t j, T* dscale, T* dbias, const typename Acc<T>::type* part_scale,
                                               const typename Acc<T>::type* part_bias, int64_t chunks, int64_t cols) {
    using A = typename Acc<T>::type;
    constexpr int U = 8;  // loads in flight; the additions stay in chunk order
    A ss = 0, sb = 0;
    int64_t c = 0;
    for (; c + U <= chunks; c += U) {
        A ps[U], pb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            ps[u] = __ldcg(part_scale + (c + u) * cols + j);
            pb[u] = __ldcg(part_bias + (c + u) * cols + j);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            ss += ps[u];
            sb += pb[u];
        }
    }
    for (; c < chunks; ++c) {
        ss += __ldcg(part_scale + c * cols + j);
        sb += __ldcg(part_bias + c * cols + j);
    }
    gg_store(dscale + j, ss);
    gg_store(dbias + j, sb);
}

// Partial column sums of dy * xhat and dy over the rows of chunk blockIdx.y, in row order. With
// counters (one zeroed counter per column tile, left at zero), the last chunk of a tile to finish
// adds the tile's columns up (ln_grad_column), so no ln_grad_finish launch is needed.
template <typename T>
__device__ void ln_grad_partials(typename Acc<T>::type* part_scale, typename Acc<T>::type* part_bias,
                                 const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                                 const float* __restrict__ inv, int64_t rows, int64_t cols, int64_t rows_per_chunk,
                                 unsigned int* counters, T* dscale, T* dbias) {
    using A = typename Acc<T>::type;
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j < cols) {
        const int64_t first = (int64_t)blockIdx.y * rows_per_chunk;
        const int64_t last = min(rows, first + rows_per_chunk);
        constexpr int U = 4;  // rows' loads in flight; the sums stay in row order
        A ss = 0, sb = 0;
        int64_t row = first;
        for (; row + U <= last; row += U) {
            A g[U], d[U], r[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                g[u] = (A)gg_load(dy + (row + u) * cols + j);
                d[u] = (A)gg_load(x + (row + u) * cols + j) - (A)mean[row + u];
                r[u] = (A)inv[row + u];
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                ss += g[u] * d[u] * r[u];
                sb += g[u];
            }
        }
        for (; row < last; ++row) {
            const A g = (A)gg_load(dy + row * cols + j);
            ss += g * ((A)gg_load(x + row * cols + j) - (A)mean[row]) * (A)inv[row];
            sb += g;
        }
        part_scale[blockIdx.y * cols + j] = ss;
        part_bias[blockIdx.y * cols + j] = sb;
    }
    if (counters == nullptr) return;
    __shared__ bool finishing;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) finishing = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!finishing) return;
    if (j < cols) ln_grad_column<T>(j, dscale, dbias, part_scale, part_bias, gridDim.y, cols);
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
}

// dScale and dBias in a launch of their own (where no counters are at hand), one thread per column.
template <typename T>
__device__ void ln_grad_finish(T* dscale, T* dbias, const typename Acc<T>::type* part_scale,
                               const typename Acc<T>::type* part_bias, int64_t chunks, int64_t cols) {
    GG_GRID_STRIDE(j, cols) { ln_grad_column<T>(j, dscale, dbias, part_scale, part_bias, chunks, cols); }
}
"""

_GRAD_ENTRIES = r"""
extern "C" __global__ void ln_grad_rows_{s}({T}* dx, const {T}* dy, const {T}* x, const {T}* scale, const float* mean,
                                         const float* inv, const {T}* res, int64_t cols) {{
    ln_grad_rows<{T}>(dx, dy, x, scale, mean, inv, res, cols);
}}
extern "C" __global__ void ln_grad_partials_{s}(Acc<{T}>::type* ps, Acc<{T}>::type* pb, const {T}* dy, const {T}* x,
                                             const float* mean, const float* inv, int64_t rows, int64_t cols,
                                             int64_t rows_per_chunk, unsigned int* counters, {T}* dscale,
                                             {T}* dbias) {{
    ln_grad_partials<{T}>(ps, pb, dy, x, mean, inv, rows, cols, rows_per_chunk, counters, dscale, dbias);
}}
extern "C" __global__ void ln_grad_finish_{s}({T}* dscale, {T}* dbias, const Acc<{T}>::type* ps,
                                           const Acc<{T}>::type* pb, int64_t chunks, int64_t cols) {{
    ln_grad_finish<{T}>(dscale, dbias, ps, pb, chunks, cols);
}}
"""


@functools.lru_cache(maxsize=1)
def grad_source() -> str:
    """The CUDA source of LayerNormalizationGrad: the templates above and their entry points for
    float16, bfloat16, float32 and float64."""
    return '#include "common.h"\n' + _GRAD_TEMPLATE + "".join(_GRAD_ENTRIES.format(s=s, T=T) for s, T in _GRAD_TYPES)


def generated_sources() -> dict[str, str]:
    """The CUDA sources this family generates at run time (module name -> text), for the compile test."""
    return {GRAD_MODULE: grad_source()}


@functools.lru_cache(maxsize=None)
def _grad_kernel(entry: str):
    return generated_module(GRAD_MODULE, grad_source()).get_function(entry)


def grad_chunks(rows: int) -> tuple[int, int]:
    """(chunks, rows per chunk) of the column sums: a function of the row count only, so the order
    of additions (and the result) never depends on the device."""
    per_chunk = max(_ROWS_PER_CHUNK, -(-rows // _MAX_CHUNKS))
    return max(1, -(-rows // per_chunk)), per_chunk


@cuda_kernel("LayerNormalizationGrad", domain=MICROSOFT)
def layer_normalization_grad(dY, X, scale, mean, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale, dBias); configurations the kernels do not cover (a non-float type, mixed types,
    statistics not in float32, shapes that do not fit: the CPU kernel raises the error) run the
    numpy kernel."""
    return layer_normalization_grad_add(dY, X, scale, mean, inv_std_var, None, axis=axis, epsilon=epsilon, stash_type=stash_type)


def layer_normalization_grad_add(dY, X, scale, mean, inv_std_var, residual, *, axis=-1, epsilon=1e-5, stash_type=1):
    """LayerNormalizationGrad with ``residual`` (None: nothing) added to dX as it is written: the
    executor's fused form of ``Sum(dX, residual)`` (gradgen/executor/fused_norm_grad.py). dX + residual
    is rounded as the Sum kernel rounds it (dX to its type first), so the bits are the unfused ones."""
    from gradgen.kernels.cuda.elementwise import sum_

    rt = runtime()
    rank = len(X.shape)
    ax = axis + rank if -rank <= axis < 0 else axis
    rows = int(np.prod(X.shape[:ax], dtype=np.int64)) if 0 <= ax < rank else -1
    cols = int(np.prod(X.shape[ax:], dtype=np.int64)) if 0 <= ax < rank else -1
    fits = (
        is_float(X.dtype)
        and dY.dtype == X.dtype == scale.dtype
        and tuple(dY.shape) == tuple(X.shape)
        and mean.dtype == inv_std_var.dtype == np.float32
        and rows >= 1
        and cols > 1
        and scale.size == cols
        and mean.size == rows
        and inv_std_var.size == rows
    )
    if not fits:
        results = cpu_fallback(
            "LayerNormalizationGrad",
            dY,
            X,
            scale,
            mean,
            inv_std_var,
            domain=MICROSOFT,
            axis=axis,
            epsilon=epsilon,
            stash_type=stash_type,
        )
        return results if residual is None else (sum_(results[0], residual), *results[1:])
    if residual is not None and (residual.dtype != X.dtype or tuple(residual.shape) != tuple(X.shape)):
        dx, dscale, dbias = layer_normalization_grad_add(dY, X, scale, mean, inv_std_var, None, axis=axis, epsilon=epsilon)
        return sum_(dx, residual), dscale, dbias
    dY, X, scale, mean, inv_std_var = (contiguous(t) for t in (dY, X, scale, mean, inv_std_var))
    res = np.intp(0) if residual is None else contiguous(residual)
    s = dtype_suffix(X.dtype)
    dx = rt.empty(X.shape, X.dtype)
    dscale, dbias = rt.empty(scale.shape, scale.dtype), rt.empty(scale.shape, scale.dtype)
    _grad_kernel(f"ln_grad_rows_{s}")(
        dx,
        dY,
        X,
        scale,
        mean,
        inv_std_var,
        res,
        np.int64(cols),
        block=(_threads(cols), 1, 1),
        grid=(rows, 1),
        stream=stream(),
    )
    from gradgen.kernels.cuda.reduction import tile_counters

    chunks, per_chunk = grad_chunks(rows)
    acc = np.float64 if s == "f64" else np.float32
    part_scale, part_bias = rt.empty((chunks, cols), acc), rt.empty((chunks, cols), acc)
    tiles = -(-cols // BLOCK)
    counters = tile_counters(tiles)
    _grad_kernel(f"ln_grad_partials_{s}")(
        part_scale,
        part_bias,
        dY,
        X,
        mean,
        inv_std_var,
        np.int64(rows),
        np.int64(cols),
        np.int64(per_chunk),
        counters if counters is not None else np.intp(0),
        dscale,
        dbias,
        block=(BLOCK, 1, 1),
        grid=(tiles, chunks),
        stream=stream(),
    )
    if counters is None:
        launch(_grad_kernel(f"ln_grad_finish_{s}"), cols, dscale, dbias, part_scale, part_bias, np.int64(chunks), np.int64(cols))
    return dx, dscale, dbias


# ---------------------------------------------------------------------------------------------
# Normalizations composed of the elementwise and reduction launchers, in the order of the CPU
# kernels' numpy expressions (a 16-bit input computed in float32 and rounded once, as there).


def _composed(op_type: str, fn, *xs, **attrs):
    """``fn`` on the float inputs ``xs`` (computed in float32 for 16-bit types); the CPU kernel for others."""
    if any(dtype_suffix(x.dtype) not in FLOATS for x in xs):
        return cpu_fallback(op_type, *xs, **attrs)
    return in_float32(fn, *xs)


def _op(name: str, a, b):
    return binary(f"{name}_{dtype_suffix(a.dtype)}", a, b, a.dtype)


@cuda_kernel("LpNormalization")
def lp_normalization(x, *, axis=-1, p=2):
    """x / ||x||_p along ``axis`` (p 1 or 2); a line of zeros stays zeros."""
    p = int(p)
    if p not in (1, 2):
        raise KernelError(f"p must be 1 or 2, got {p}")
    ax = normalize_axis(axis, len(x.shape))

    def run(xc):
        norm = reduce("l1" if p == 1 else "l2", xc, (ax,), True, "ReduceL1" if p == 1 else "ReduceL2")
        zero = device_scalar(0, xc.dtype)
        # where(norm == 0, 0, x / norm), as the CPU kernel: a line of zeros, or of values whose
        # squares underflow, stays 0
        return where(equal(norm, zero), zero, _op("div", xc, norm))

    return _composed("LpNormalization", run, x, axis=axis, p=p)


@cuda_kernel("MeanVarianceNormalization")
def mean_variance_normalization(x, *, axes=(0, 2, 3)):
    """(X - E[X]) / (sqrt(Var[X]) + 1e-9), the variance as the mean of the squared deviations (the
    CPU kernel's form: ONNX's E[X^2] - E[X]^2 cancels)."""
    rank = len(x.shape)
    axes_tuple = tuple(sorted({normalize_axis(int(a), rank) for a in axes}))

    def run(xc):
        centered = _op("sub", xc, reduce("mean", xc, axes_tuple, True, "ReduceMean"))
        variance = reduce("mean", _op("mul", centered, centered), axes_tuple, True, "ReduceMean")
        spread = _op("add", unary(f"sqrt_{dtype_suffix(xc.dtype)}", variance), device_scalar(1e-9, xc.dtype))
        return _op("div", centered, spread)

    return _composed("MeanVarianceNormalization", run, x, axes=axes)


@cuda_kernel("RMSNormalization")
def rms_normalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """X / sqrt(mean(X^2 over the axes from ``axis``) + epsilon) * scale (ONNX opset 23)."""
    if int(stash_type) != 1:
        raise KernelError(f"stash_type={stash_type} is not supported (only 1, float32)")
    rank = len(x.shape)
    axes_tuple = tuple(range(normalize_axis(axis, rank), rank))

    def run(xc, sc):
        mean_square = reduce("mean", _op("mul", xc, xc), axes_tuple, True, "ReduceMean")
        rms = unary(f"sqrt_{dtype_suffix(xc.dtype)}", _op("add", mean_square, device_scalar(epsilon, xc.dtype)))
        return _op("mul", _op("div", xc, rms), sc)

    if dtype_suffix(x.dtype) not in FLOATS or dtype_suffix(scale.dtype) not in FLOATS:
        return cpu_fallback("RMSNormalization", x, scale, axis=axis, epsilon=epsilon, stash_type=stash_type)
    compute = np.dtype(np.float32) if np.dtype(x.dtype).itemsize == 2 else np.dtype(x.dtype)
    xc = x if np.dtype(x.dtype) == compute else cast_to(x, compute)
    y = run(xc, scale if np.dtype(scale.dtype) == compute else cast_to(scale, compute))
    return y if np.dtype(y.dtype) == np.dtype(x.dtype) else cast_to(y, x.dtype)


@cuda_kernel("LRN")
def lrn(x, *, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    """x / (bias + alpha * mean of x^2 over the ``size`` channels around each one)^beta, zeros
    past the channel ends (the CPU kernel's alpha / size * sum): the mean is AveragePool's kernel
    (pool.window_mean, every tap counted) over a (N, 1, C, rest) view with a (size, 1) window;
    float32 for 16-bit x, rounded once. size < 1 and rank < 2 run the CPU kernel."""
    from gradgen.kernels.cuda.pool import window_mean

    if size is None:
        raise KernelError("LRN needs the size attribute")
    window = int(size)
    if window < 1 or x.ndim < 2 or dtype_suffix(x.dtype) not in FLOATS:
        return cpu_fallback("LRN", x, alpha=alpha, beta=beta, bias=bias, size=size)
    if x.size == 0:  # nothing to normalise (PyCUDA cannot reshape an empty array's null pointer)
        return runtime().empty(tuple(x.shape), x.dtype)
    n, channels, rest = int(x.shape[0]), int(x.shape[1]), math.prod(int(d) for d in x.shape[2:])

    def run(xc):
        s = dtype_suffix(xc.dtype)
        square = _op("mul", xc, xc).reshape((n, 1, channels, rest))
        mean = window_mean(square, (window, 1), (1, 1), (1, 1), ((window - 1) // 2, 0), (channels, rest))
        base = _op("add", device_scalar(bias, xc.dtype), _op("mul", device_scalar(alpha, xc.dtype), mean))
        scale = binary(f"pow_{s}_{s}", base, device_scalar(beta, xc.dtype), xc.dtype)
        return _op("div", xc, scale.reshape(tuple(xc.shape)))

    return in_float32(run, x)


@cuda_kernel("SimplifiedLayerNormalizationGrad", domain=MICROSOFT)
def simplified_layer_normalization_grad(dY, X, scale, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale) of SimplifiedLayerNormalization (RMS norm) from its saved InvStdDev, in the CPU
    kernel's steps on X viewed as (rows, cols): with xhat = x * inv and b = dy * scale * inv,
    dX = b - xhat * mean(b * xhat) along each row and dScale = the column sums of dy * xhat
    (computed in float32 for a 16-bit X, each result rounded once to its type)."""
    from gradgen.kernels.cpu.norm import layer_norm_grad_rows

    rows, cols = layer_norm_grad_rows(dY, X, scale, None, inv_std_var, axis)
    if any(dtype_suffix(t.dtype) not in FLOATS for t in (dY, X, scale, inv_std_var)):
        attrs = dict(axis=axis, epsilon=epsilon, stash_type=stash_type)
        return cpu_fallback("SimplifiedLayerNormalizationGrad", dY, X, scale, inv_std_var, domain=MICROSOFT, **attrs)
    compute = _stash(X.dtype)

    def as_compute(t, shape):
        return reshaped(t if np.dtype(t.dtype) == compute else cast_to(t, compute), shape)

    x, dy = as_compute(X, (rows, cols)), as_compute(dY, (rows, cols))
    s, inv = as_compute(scale, (1, cols)), as_compute(inv_std_var, (rows, 1))
    normalized = _op("mul", x, inv)
    b = _op("mul", _op("mul", dy, s), inv)
    dx = _op("sub", b, _op("mul", normalized, reduce("mean", _op("mul", b, normalized), (1,), True, "ReduceMean")))
    dscale = reduce("sum", _op("mul", dy, normalized), (0,), False, "ReduceSum")
    return _rounded(reshaped(dx, X.shape), X.dtype), _rounded(reshaped(dscale, scale.shape), scale.dtype)


def _rounded(y, dtype):
    """``y`` as ``dtype`` (a cast where it is not already)."""
    return y if np.dtype(y.dtype) == np.dtype(dtype) else cast_to(y, dtype)
