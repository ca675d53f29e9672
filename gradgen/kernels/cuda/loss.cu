// Classification losses: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.
// Inputs (N, C, D...) viewed as (N, C, D) with labels (N, D). A first kernel writes, per label
// position p, the loss (compute precision), its weight (for the "mean" denominator) and, for
// reduction "none", the loss in the output dtype; a label outside [0, C) that is not ignore_index
// writes total - p into `flag` with atomicMax (an integer max: the smallest bad position wins, the
// same every run). A second kernel (one block, fixed order) sums for "sum" and "mean".
#include "common.h"
#include <math_constants.h>

template <typename A> __device__ __forceinline__ A neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return -CUDART_INF_F; }
template <> __device__ __forceinline__ double neg_inf<double>() { return -CUDART_INF; }

template <typename A> struct Lse { A m; A s; };
template <typename A> __device__ __forceinline__ Lse<A> lse_comb(Lse<A> a, Lse<A> b) {
    if (a.m == neg_inf<A>()) return b;
    if (b.m == neg_inf<A>()) return a;
    if (a.m != a.m) return a;
    if (b.m != b.m) return b;
    A m = a.m < b.m ? b.m : a.m;
    return Lse<A>{m, a.s * exp(a.m - m) + b.s * exp(b.m - m)};
}

// Block-wide combine; the result is valid in every thread. blockDim.x: a multiple of 32.
template <typename A>
__device__ __forceinline__ Lse<A> block_lse(Lse<A> v) {
    __shared__ Lse<A> part[33];
    for (int m = 16; m > 0; m >>= 1)
        v = lse_comb(v, Lse<A>{__shfl_xor_sync(0xffffffffu, v.m, m), __shfl_xor_sync(0xffffffffu, v.s, m)});
    const int warps = blockDim.x >> 5;
    if (warps == 1) return v;
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < warps ? part[threadIdx.x] : Lse<A>{neg_inf<A>(), A(0)};
        for (int m = 16; m > 0; m >>= 1)
            v = lse_comb(v, Lse<A>{__shfl_xor_sync(0xffffffffu, v.m, m), __shfl_xor_sync(0xffffffffu, v.s, m)});
        if (threadIdx.x == 0) part[32] = v;
    }
    __syncthreads();
    return part[32];
}

// v rounded to T and read back, as a T buffer would store and give it.
template <typename T, typename A> __device__ __forceinline__ A rounded_to(A v) {
    T t;
    gg_store(&t, (typename Acc<T>::type)v);
    return (A)gg_load(&t);
}

struct LossArgs {
    int64_t n, c, d;          // scores viewed as (n, c, d); labels (n, d)
    int64_t ignore_index;
    int64_t has_ignore;
};

// The loss at label position p given the row's log-sum-exp (log_input: x already holds log-probs).
template <typename T, typename LT, typename A>
__device__ __forceinline__ void write_loss(int64_t p, const T* x_base, LT label_raw, Lse<A> st, bool log_input,
                                           const T* weight, const LossArgs& a, T* loss_none, A* lossbuf, A* wbuf,
                                           int64_t* flag) {
    const int64_t label = (int64_t)label_raw;
    const bool used = !(a.has_ignore && label == a.ignore_index);
    A loss = A(0), w = A(0);
    if (used && (label < 0 || label >= a.c)) {
        atomicMax(reinterpret_cast<unsigned long long*>(flag), (unsigned long long)(a.n * a.d - p));
    } else if (used) {
        const A xl = (A)gg_load(x_base + label * a.d);
        const A picked = log_input ? xl : (xl - st.m) - log(st.s);
        w = weight ? (A)gg_load(weight + label) : A(1);
        loss = -picked * w;
    }
    lossbuf[p] = loss;
    wbuf[p] = w;
    if (loss_none) gg_store(loss_none + p, (typename Acc<T>::type)loss);
}

// d == 1, softmax: one block per sample row.
template <typename T, typename LT, typename A>
__device__ void sce_rows(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* __restrict__ x,
                         const LT* __restrict__ labels, const T* weight, LossArgs a) {
    const int64_t n = blockIdx.x;
    const T* row = x + n * a.c;
    Lse<A> st{neg_inf<A>(), A(0)};
    for (int64_t j = threadIdx.x; j < a.c; j += blockDim.x) st = lse_comb(st, Lse<A>{(A)gg_load(row + j), A(1)});
    st = block_lse(st);
    if (threadIdx.x == 0) write_loss<T, LT, A>(n, row, labels[n], st, false, weight, a, loss_none, lossbuf, wbuf, flag);
}

// any d (and NLL): one thread per label position; neighbouring threads read neighbouring columns.
template <typename T, typename LT, typename A>
__device__ void loss_cols(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* __restrict__ x,
                          const LT* __restrict__ labels, const T* weight, LossArgs a, bool log_input) {
    GG_GRID_STRIDE(p, a.n * a.d) {
        const int64_t n = p / a.d;
        const T* base = x + n * a.c * a.d + (p - n * a.d);
        Lse<A> st{neg_inf<A>(), A(0)};
        if (!log_input)
            for (int64_t j = 0; j < a.c; ++j) st = lse_comb(st, Lse<A>{(A)gg_load(base + j * a.d), A(1)});
        write_loss<T, LT, A>(p, base, labels[p], st, log_input, weight, a, loss_none, lossbuf, wbuf, flag);
    }
}

// d == 1, from log_softmax's row statistics (reduction.cu, softmax_stats_rows): the picked
// log-probability (x[label] - max) - log_sum rounded to T, as log_prob would hold it.
template <typename T, typename LT, typename A>
__device__ void loss_stats(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* __restrict__ x,
                           const A* __restrict__ stats, const LT* __restrict__ labels, const T* weight, LossArgs a) {
    GG_GRID_STRIDE(p, a.n) {
        const int64_t label = (int64_t)labels[p];
        const bool used = !(a.has_ignore && label == a.ignore_index);
        A loss = A(0), w = A(0);
        if (used && (label < 0 || label >= a.c)) {
            atomicMax(reinterpret_cast<unsigned long long*>(flag), (unsigned long long)(a.n - p));
        } else if (used) {
            const A xl = (A)gg_load(x + p * a.c + label);
            const A picked = rounded_to<T, A>((xl - stats[2 * p]) - stats[2 * p + 1]);
            w = weight ? (A)gg_load(weight + label) : A(1);
            loss = -picked * w;
        }
        lossbuf[p] = loss;
        wbuf[p] = w;
        if (loss_none) gg_store(loss_none + p, (typename Acc<T>::type)loss);
    }
}

// sum / mean of the per-position losses: one block, fixed order.
template <typename T, typename A>
__device__ void loss_reduce(T* out, const A* lossbuf, const A* wbuf, int64_t count, int64_t mean) {
    __shared__ A scratch[33];
    A s = 0, w = 0;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) {
        s += lossbuf[i];
        w += wbuf[i];
    }
    s = block_sum(s, scratch);
    __syncthreads();
    w = block_sum(w, scratch);
    if (threadIdx.x == 0) gg_store(out, (typename Acc<T>::type)(mean ? s / w : s));
}

#define GG_LOSS(s, T, A, ls, LT)                                                                              \
    extern "C" __global__ void sce_rows_##s##_##ls(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* x, \
                                                   const LT* labels, const T* weight, LossArgs a) {            \
        sce_rows<T, LT, A>(loss_none, lossbuf, wbuf, flag, x, labels, weight, a);                              \
    }                                                                                                          \
    extern "C" __global__ void loss_cols_##s##_##ls(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* x, \
                                                    const LT* labels, const T* weight, LossArgs a,             \
                                                    int64_t log_input) {                                       \
        loss_cols<T, LT, A>(loss_none, lossbuf, wbuf, flag, x, labels, weight, a, log_input != 0);             \
    }                                                                                                               \
    extern "C" __global__ void loss_stats_##s##_##ls(T* loss_none, A* lossbuf, A* wbuf, int64_t* flag, const T* x, \
                                                     const A* stats, const LT* labels, const T* weight, LossArgs a) { \
        loss_stats<T, LT, A>(loss_none, lossbuf, wbuf, flag, x, stats, labels, weight, a);                     \
    }
#define GG_LOSS_T(s, T, A)                                                                                    \
    GG_LOSS(s, T, A, i32, int32_t) GG_LOSS(s, T, A, i64, int64_t)                                             \
    extern "C" __global__ void loss_reduce_##s(T* out, const A* lossbuf, const A* wbuf, int64_t count,         \
                                               int64_t mean) {                                                 \
        loss_reduce<T, A>(out, lossbuf, wbuf, count, mean);                                                    \
    }
GG_LOSS_T(f16, __half, float)
GG_LOSS_T(bf16, __nv_bfloat16, float)
GG_LOSS_T(f32, float, float)
GG_LOSS_T(f64, double, double)

// SoftmaxCrossEntropyLossGrad (ONNX Runtime training's contract): d_logits[n, c, d] =
// (exp(log_prob[n, c, d]) - [c == label[n, d]]) * w[n, d] * factor, w the label's weight (1 without
// weights, 0 for ignore_index), factor dY (sum), dY / sum(w) (mean; dY where that sum is 0) or
// dY[n, d] (none). Three kernels: the weights (and the label check, as the forward's), the factor
// (one block, fixed order), then one pass over log_prob: a block row per label position.
template <typename T, typename LT, typename A>
__device__ void sce_grad_weights(A* wbuf, int64_t* flag, const LT* __restrict__ labels, const T* weight, LossArgs a) {
    GG_GRID_STRIDE(p, a.n * a.d) {
        const int64_t label = (int64_t)labels[p];
        const bool used = !(a.has_ignore && label == a.ignore_index);
        A w = A(0);
        if (used && (label < 0 || label >= a.c))
            atomicMax(reinterpret_cast<unsigned long long*>(flag), (unsigned long long)(a.n * a.d - p));
        else if (used)
            w = weight ? (A)gg_load(weight + label) : A(1);
        wbuf[p] = w;
    }
}

template <typename T, typename A>
__device__ void sce_grad_factor(A* factor, const A* wbuf, const T* dy, int64_t count, int64_t mean) {
    __shared__ A scratch[33];
    A w = 0;
    if (mean)
        for (int64_t i = threadIdx.x; i < count; i += blockDim.x) w += wbuf[i];
    w = block_sum(w, scratch);
    if (threadIdx.x == 0) {
        const A g = (A)gg_load(dy);
        factor[0] = mean && w != A(0) ? g / w : g;
    }
}

// The log-probability at element i of label position p: read from log_prob, or (stats != nullptr,
// d == 1) made from the scores x and the row's statistics, rounded to T as log_prob would hold it.
template <typename T, typename A>
__device__ __forceinline__ A log_prob_at(const T* __restrict__ src, const A* __restrict__ stats, int64_t p, int64_t i) {
    const A v = (A)gg_load(src + i);
    if (!stats) return v;
    return rounded_to<T, A>((v - stats[2 * p]) - stats[2 * p + 1]);
}

template <typename T, typename LT, typename A>
__device__ void sce_grad(T* __restrict__ out, const T* __restrict__ log_prob, const LT* __restrict__ labels,
                         const A* __restrict__ wbuf, const A* factor, const T* dy_none, LossArgs a,
                         const A* __restrict__ stats) {
    for (int64_t p = blockIdx.y; p < a.n * a.d; p += gridDim.y) {
        const int64_t n = p / a.d, base = n * a.c * a.d + (p - n * a.d);
        const int64_t label = (int64_t)labels[p];
        const A scale = wbuf[p] * (dy_none ? (A)gg_load(dy_none + p) : factor[0]);
        constexpr int U = 4;  // loads in flight per thread
        const int64_t step = (int64_t)blockDim.x * gridDim.x;
        int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
        for (; c + (U - 1) * step < a.c; c += U * step) {
            A lp[U];
#pragma unroll
            for (int u = 0; u < U; ++u) lp[u] = log_prob_at<T, A>(log_prob, stats, p, base + (c + u * step) * a.d);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t cu = c + u * step;
                gg_store(out + base + cu * a.d, (typename Acc<T>::type)((exp(lp[u]) - (cu == label ? A(1) : A(0))) * scale));
            }
        }
        for (; c < a.c; c += step) {
            const int64_t i = base + c * a.d;
            const A prob = exp(log_prob_at<T, A>(log_prob, stats, p, i));
            gg_store(out + i, (typename Acc<T>::type)((prob - (c == label ? A(1) : A(0))) * scale));
        }
    }
}

#define GG_SCE_GRAD(s, T, A, ls, LT)                                                                           \
    extern "C" __global__ void sce_grad_weights_##s##_##ls(A* wbuf, int64_t* flag, const LT* labels,           \
                                                           const T* weight, LossArgs a) {                      \
        sce_grad_weights<T, LT, A>(wbuf, flag, labels, weight, a);                                             \
    }                                                                                                          \
    extern "C" __global__ void sce_grad_##s##_##ls(T* out, const T* log_prob, const LT* labels, const A* wbuf,   \
                                                   const A* factor, const T* dy_none, LossArgs a, const A* stats) { \
        sce_grad<T, LT, A>(out, log_prob, labels, wbuf, factor, dy_none, a, stats);                            \
    }
#define GG_SCE_GRAD_T(s, T, A)                                                                                 \
    GG_SCE_GRAD(s, T, A, i32, int32_t) GG_SCE_GRAD(s, T, A, i64, int64_t)                                      \
    extern "C" __global__ void sce_grad_factor_##s(A* factor, const A* wbuf, const T* dy, int64_t count,        \
                                                   int64_t mean) {                                             \
        sce_grad_factor<T, A>(factor, wbuf, dy, count, mean);                                                  \
    }
GG_SCE_GRAD_T(f16, __half, float)
GG_SCE_GRAD_T(bf16, __nv_bfloat16, float)
GG_SCE_GRAD_T(f32, float, float)
GG_SCE_GRAD_T(f64, double, double)
