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
