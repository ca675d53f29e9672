// Normalization: LayerNormalization (+ Mean/InvStdDev), InstanceNormalization and
// GroupNormalization (one block per normalized row, two-pass mean/variance like the CPU kernel),
// BatchNormalization in inference form (elementwise with per-channel statistics).
#include "common.h"

// mode 0 (LayerNorm): scale/bias index j; mode 1 (InstanceNorm): channel row % C;
// mode 2 (GroupNorm, per-channel scale): channel (row % G) * (C / G) + j / spatial;
// mode 3 (GroupNorm, per-group scale): group row % G.
template <typename T, typename A>
__device__ void norm_rows(T* y, A* mean_out, A* inv_out, const T* __restrict__ x, const T* __restrict__ scale,
                          const T* __restrict__ bias, int64_t L, int64_t mode, int64_t channels, int64_t groups,
                          int64_t spatial, double eps) {
    __shared__ A scratch[33];
    const int64_t row = blockIdx.x;
    const T* xr = x + row * L;
    T* yr = y + row * L;
    A s = 0;
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) s += (A)gg_load(xr + j);
    const A mean = block_sum(s, scratch) / A(L);
    A q = 0;
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) {
        A d = (A)gg_load(xr + j) - mean;
        q += d * d;
    }
    const A var = block_sum(q, scratch) / A(L);
    const A inv = A(1) / sqrt(var + A(eps));
    if (threadIdx.x == 0) {
        if (mean_out) mean_out[row] = mean;
        if (inv_out) inv_out[row] = inv;
    }
    const int64_t per_group = groups > 0 ? channels / groups : 1;
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) {
        int64_t k;
        if (mode == 0) k = j;
        else if (mode == 1) k = row % channels;
        else if (mode == 2) k = (row % groups) * per_group + j / spatial;
        else k = row % groups;
        A v = ((A)gg_load(xr + j) - mean) * inv * (A)gg_load(scale + k);
        if (bias) v += (A)gg_load(bias + k);
        gg_store(yr + j, (typename Acc<T>::type)v);
    }
}

#define GG_NORM(s, T, A)                                                                                      \
    extern "C" __global__ void norm_rows_##s(T* y, A* mean_out, A* inv_out, const T* x, const T* scale,       \
                                             const T* bias, int64_t L, int64_t mode, int64_t channels,         \
                                             int64_t groups, int64_t spatial, double eps) {                    \
        norm_rows<T, A>(y, mean_out, inv_out, x, scale, bias, L, mode, channels, groups, spatial, eps);       \
    }
GG_NORM(f16, __half, float)
GG_NORM(bf16, __nv_bfloat16, float)
GG_NORM(f32, float, float)
GG_NORM(f64, double, double)

// LayerNorm rows of L <= 32 * N elements: one warp per row, the row held in registers (one read
// of x), shuffle reductions only. Deterministic (fixed shuffle tree).
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

template <typename T, typename A, int N>
__device__ void norm_warp(T* y, A* mean_out, A* inv_out, const T* __restrict__ x, const T* __restrict__ scale,
                          const T* __restrict__ bias, int64_t rows, int64_t L, double eps) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;  // the whole warp leaves together
    const T* xr = x + row * L;
    A v[N];
    A s = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        v[k] = j < L ? (A)gg_load(xr + j) : A(0);
        s += v[k];
    }
    const A mean = warp_sum(s) / A(L);
    A q = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        const A d = v[k] - mean;
        if (j < L) q += d * d;
    }
    const A inv = A(1) / sqrt(warp_sum(q) / A(L) + A(eps));
    if (lane == 0) {
        mean_out[row] = mean;
        inv_out[row] = inv;
    }
    T* yr = y + row * L;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        if (j < L) {
            A o = (v[k] - mean) * inv * (A)gg_load(scale + j);
            if (bias) o += (A)gg_load(bias + j);
            gg_store(yr + j, (typename Acc<T>::type)o);
        }
    }
}

#define GG_NORM_WARP(n, s, T, A)                                                                              \
    extern "C" __global__ void norm_warp##n##_##s(T* y, A* mean_out, A* inv_out, const T* x, const T* scale,   \
                                                  const T* bias, int64_t rows, int64_t L, double eps) {       \
        norm_warp<T, A, n>(y, mean_out, inv_out, x, scale, bias, rows, L, eps);                              \
    }
#define GG_NORM_WARPS(s, T, A) GG_NORM_WARP(1, s, T, A) GG_NORM_WARP(2, s, T, A) GG_NORM_WARP(4, s, T, A) \
    GG_NORM_WARP(8, s, T, A) GG_NORM_WARP(16, s, T, A) GG_NORM_WARP(32, s, T, A)
GG_NORM_WARPS(f16, __half, float)
GG_NORM_WARPS(bf16, __nv_bfloat16, float)
GG_NORM_WARPS(f32, float, float)
GG_NORM_WARPS(f64, double, double)

// BatchNormalization, inference: y = (x - mean[c]) / sqrt(var[c] + eps) * scale[c] + bias[c].
// P is the parameters' type: T, or float for a 16-bit x (AutocastPass's BatchNormalization, as
// cuDNN's batch norm takes it). EXACT (that mixed form): the CPU kernel's float32 operations in
// its order, none contracted into an FMA, then one rounding to T: the bits the CPU backend gives.
template <typename A, bool EXACT>
__device__ __forceinline__ A bn_value(A x, A mean, A var, A scale, A bias, double eps) {
    if (EXACT) {
        const float v = __fdiv_rn(__fsub_rn((float)x, (float)mean), __fsqrt_rn(__fadd_rn((float)var, (float)eps)));
        return (A)__fadd_rn(__fmul_rn(v, (float)scale), (float)bias);
    }
    const A v = (x - mean) / sqrt(var + A(eps));
    return v * scale + bias;
}

template <typename T, typename P, typename A, bool EXACT>
__device__ void batch_norm(T* y, const T* __restrict__ x, const P* __restrict__ scale, const P* __restrict__ bias,
                           const P* __restrict__ mean, const P* __restrict__ var, int64_t channels, int64_t inner,
                           double eps, int64_t n) {
    if (n <= 0xFFFFFFFFll && channels * inner <= 0xFFFFFFFFll) {
        const uint32_t in32 = (uint32_t)inner, ch32 = (uint32_t)channels;
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (uint32_t)n; i += blockDim.x * gridDim.x) {
            const uint32_t c = (i / in32) % ch32;
            const A v = bn_value<A, EXACT>((A)gg_load(x + i), (A)gg_load(mean + c), (A)gg_load(var + c),
                                           (A)gg_load(scale + c), (A)gg_load(bias + c), eps);
            gg_store(y + i, (typename Acc<T>::type)v);
            if (i > 0xFFFFFFFFu - blockDim.x * gridDim.x) break;
        }
    } else {
        GG_GRID_STRIDE(i, n) {
            const int64_t c = (i / inner) % channels;
            const A v = bn_value<A, EXACT>((A)gg_load(x + i), (A)gg_load(mean + c), (A)gg_load(var + c),
                                           (A)gg_load(scale + c), (A)gg_load(bias + c), eps);
            gg_store(y + i, (typename Acc<T>::type)v);
        }
    }
}

#define GG_BN(s, T, P, A, EXACT)                                                                              \
    extern "C" __global__ void batch_norm_##s(T* y, const T* x, const P* scale, const P* bias, const P* mean,  \
                                              const P* var, int64_t channels, int64_t inner, double eps,       \
                                              int64_t n) {                                                     \
        batch_norm<T, P, A, EXACT>(y, x, scale, bias, mean, var, channels, inner, eps, n);                     \
    }
GG_BN(f16, __half, __half, float, false)
GG_BN(bf16, __nv_bfloat16, __nv_bfloat16, float, false)
GG_BN(f32, float, float, float, false)
GG_BN(f64, double, double, double, false)
GG_BN(f16_f32, __half, float, float, true)
GG_BN(bf16_f32, __nv_bfloat16, float, float, true)

// BatchNormalization's per-channel sums over the batch and spatial axes of an (N, C, inner) tensor,
// deterministic in two steps: bn_partial, a grid of (chunks, C) blocks, each block summing one
// fixed chunk of a channel's N * inner elements into partial[c][chunk]; then one thread per channel
// adding its chunks in order (bn_mean_finish, bn_grad_finish). The chunk count is a function of
// the shape only (kernels/cuda/norm.py). Modes: 0 sums a; 1 sums (a - center[c])^2 (the variance
// about the mean); 2 sums b and b * (a - center[c]) (BatchNormalizationGrad: a = X, b = dY).
template <typename T, typename A, typename I>
__device__ void bn_partial(A* partial, const T* __restrict__ a, const T* __restrict__ b, const A* __restrict__ center,
                           I channels, I inner, I per_channel, I chunk, int mode) {
    __shared__ A scratch[33];
    const I c = blockIdx.y;
    const I start = (I)blockIdx.x * chunk;
    const I stop = start + chunk < per_channel ? start + chunk : per_channel;
    const A mid = center ? center[c] : A(0);
    A s1 = 0, s2 = 0;
    for (I j = start + threadIdx.x; j < stop; j += blockDim.x) {
        const I n = j / inner;
        const I i = (n * channels + c) * inner + (j - n * inner);
        const A v = (A)gg_load(a + i);
        if (mode == 0) {
            s1 += v;
        } else if (mode == 1) {
            const A d = v - mid;
            s1 += d * d;
        } else {
            const A g = (A)gg_load(b + i);
            s1 += g;
            s2 += g * (v - mid);
        }
    }
    s1 = block_sum(s1, scratch);
    if (mode == 2) s2 = block_sum(s2, scratch);
    if (threadIdx.x == 0) {
        A* out = partial + ((int64_t)c * gridDim.x + blockIdx.x) * 2;
        out[0] = s1;
        out[1] = s2;
    }
}

// out[c] = (the chunks' first sums of channel c, in order) / count.
template <typename A>
__device__ void bn_mean_finish(A* out, const A* __restrict__ partial, int64_t channels, int64_t chunks, double count) {
    GG_GRID_STRIDE(c, channels) {
        A s = 0;
        for (int64_t k = 0; k < chunks; ++k) s += partial[(c * chunks + k) * 2];
        out[c] = s / A(count);
    }
}

// BatchNormalizationGrad's per-channel results from mode 2's sums S1 = sum(dY) and S2 = sum(dY * (X -
// mean)): dBias = S1, dScale = S2 * inv_std (either may be null), and dX's coefficients
// coef[c] = (scale * inv_std, S1 / m, S2 * inv_std^2 / m).
template <typename T, typename A>
__device__ void bn_grad_finish(T* dscale, T* dbias, A* coef, const A* __restrict__ partial, const T* __restrict__ scale,
                               const T* __restrict__ inv_std, int64_t channels, int64_t chunks, double count) {
    GG_GRID_STRIDE(c, channels) {
        A s1 = 0, s2 = 0;
        for (int64_t k = 0; k < chunks; ++k) {
            s1 += partial[(c * chunks + k) * 2];
            s2 += partial[(c * chunks + k) * 2 + 1];
        }
        const A inv = (A)gg_load(inv_std + c);
        const A ds = s2 * inv;
        if (dscale) gg_store(dscale + c, (typename Acc<T>::type)ds);
        if (dbias) gg_store(dbias + c, (typename Acc<T>::type)s1);
        coef[c * 3] = (A)gg_load(scale + c) * inv;
        coef[c * 3 + 1] = s1 / A(count);
        coef[c * 3 + 2] = ds * inv / A(count);
    }
}

// dX = coef0 * (dY - coef1 - (X - mean) * coef2), per channel.
template <typename T, typename A, typename I>
__device__ void bn_grad_dx(T* dx, const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ mean,
                           const A* __restrict__ coef, I channels, I inner, I n) {
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)blockDim.x * gridDim.x) {
        const I c = (i / inner) % channels;
        const A v = coef[c * 3] * ((A)gg_load(dy + i) - coef[c * 3 + 1] -
                                   ((A)gg_load(x + i) - (A)gg_load(mean + c)) * coef[c * 3 + 2]);
        gg_store(dx + i, (typename Acc<T>::type)v);
    }
}

// out = 1 / sqrt(var + eps): BatchNormInternal's saved_inv_std.
template <typename A>
__device__ void bn_inv_std(A* out, const A* __restrict__ var, double eps, int64_t n) {
    GG_GRID_STRIDE(i, n) out[i] = A(1) / sqrt(var[i] + A(eps));
}

// Entry points: the index arithmetic in 32 bits (``_32``) for tensors below 2^31 elements, where
// no index plus the grid's stride passes 2^32; else in 64 bits.
#define GG_BN_PARTIAL(s, T, A)                                                                                \
    extern "C" __global__ void bn_partial_##s(A* partial, const T* a, const T* b, const A* center,             \
                                              int64_t channels, int64_t inner, int64_t per_channel,            \
                                              int64_t chunk, int mode) {                                       \
        bn_partial<T, A, int64_t>(partial, a, b, center, channels, inner, per_channel, chunk, mode);           \
    }                                                                                                          \
    extern "C" __global__ void bn_partial_32_##s(A* partial, const T* a, const T* b, const A* center,          \
                                                 int64_t channels, int64_t inner, int64_t per_channel,         \
                                                 int64_t chunk, int mode) {                                    \
        bn_partial<T, A, uint32_t>(partial, a, b, center, (uint32_t)channels, (uint32_t)inner,                 \
                                   (uint32_t)per_channel, (uint32_t)chunk, mode);                              \
    }
GG_BN_PARTIAL(f16, __half, float)
GG_BN_PARTIAL(bf16, __nv_bfloat16, float)
GG_BN_PARTIAL(f32, float, float)
GG_BN_PARTIAL(f64, double, double)

#define GG_BN_STATS(s, A)                                                                                     \
    extern "C" __global__ void bn_mean_finish_##s(A* out, const A* partial, int64_t channels, int64_t chunks,  \
                                                  double count) {                                              \
        bn_mean_finish<A>(out, partial, channels, chunks, count);                                              \
    }                                                                                                          \
    extern "C" __global__ void bn_inv_std_##s(A* out, const A* var, double eps, int64_t n) {                   \
        bn_inv_std<A>(out, var, eps, n);                                                                       \
    }
GG_BN_STATS(f32, float)
GG_BN_STATS(f64, double)

#define GG_BN_GRAD(s, T, A)                                                                                   \
    extern "C" __global__ void bn_grad_finish_##s(T* dscale, T* dbias, A* coef, const A* partial,              \
                                                  const T* scale, const T* inv_std, int64_t channels,          \
                                                  int64_t chunks, double count) {                              \
        bn_grad_finish<T, A>(dscale, dbias, coef, partial, scale, inv_std, channels, chunks, count);           \
    }                                                                                                          \
    extern "C" __global__ void bn_grad_dx_##s(T* dx, const T* dy, const T* x, const T* mean, const A* coef,    \
                                              int64_t channels, int64_t inner, int64_t n) {                    \
        bn_grad_dx<T, A, int64_t>(dx, dy, x, mean, coef, channels, inner, n);                                  \
    }                                                                                                          \
    extern "C" __global__ void bn_grad_dx_32_##s(T* dx, const T* dy, const T* x, const T* mean,                \
                                                 const A* coef, int64_t channels, int64_t inner, int64_t n) {  \
        bn_grad_dx<T, A, uint32_t>(dx, dy, x, mean, coef, (uint32_t)channels, (uint32_t)inner, (uint32_t)n);   \
    }
GG_BN_GRAD(f32, float, float)
GG_BN_GRAD(f64, double, double)
