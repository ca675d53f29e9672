// Reductions (ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp) and Softmax/LogSoftmax.
//
// The launcher (reduce.py) merges adjacent dims that are all reduced or all kept and drops size-1
// dims. Then:
// - rows_*: the innermost group is reduced (contiguous runs of L elements): one block per output
//   (gridDim.y > 1 splits the reduction into fixed chunks, combined by fin_* in a fixed order:
//   the partial states stored split-major, so that fin_* reads them coalesced);
// - cols_*: the innermost group is kept (C contiguous outputs): 32 columns per block, BY threads
//   down the reduced rows, combined in shared memory in a fixed order (split likewise);
//   colsv_* (float32/float64, C a multiple of the vector width, x 16-byte aligned): each thread owns
//   16 bytes of neighbouring columns and keeps four rows' loads in flight;
// - map_*: nothing of size > 1 is reduced (R == 1): an elementwise pass.
// No float atomics: every result is bit-identical from run to run.
#define GG_PARTS 19  // compiled as 19 parts at once (common.h: GG_PART)
#include "common.h"
#include <math_constants.h>

template <typename A> struct Lim;
template <> struct Lim<float> {
    static __device__ __forceinline__ float lowest() { return -CUDART_INF_F; }
    static __device__ __forceinline__ float highest() { return CUDART_INF_F; }
};
template <> struct Lim<double> {
    static __device__ __forceinline__ double lowest() { return -CUDART_INF; }
    static __device__ __forceinline__ double highest() { return CUDART_INF; }
};
template <> struct Lim<int32_t> {
    static __device__ __forceinline__ int32_t lowest() { return INT32_MIN; }
    static __device__ __forceinline__ int32_t highest() { return INT32_MAX; }
};
template <> struct Lim<int64_t> {
    static __device__ __forceinline__ int64_t lowest() { return INT64_MIN; }
    static __device__ __forceinline__ int64_t highest() { return INT64_MAX; }
};

template <typename T> __device__ __forceinline__ bool gg_isnan(T x) { return x != x; }
template <typename T> __device__ __forceinline__ T gg_max(T x, T y) {
    return gg_isnan(x) ? x : (gg_isnan(y) ? y : (x < y ? y : x));
}
template <typename T> __device__ __forceinline__ T gg_min(T x, T y) {
    return gg_isnan(x) ? x : (gg_isnan(y) ? y : (y < x ? y : x));
}

// A running (max, sum of exp(x - max)) pair: log-sum-exp and softmax in one pass.
template <typename A> struct Lse { A m; A s; };
template <typename A> __device__ __forceinline__ Lse<A> lse_comb(Lse<A> a, Lse<A> b) {
    if (a.m == Lim<A>::lowest()) return b;
    if (b.m == Lim<A>::lowest()) return a;
    A m = gg_max(a.m, b.m);
    return Lse<A>{m, a.s * exp(a.m - m) + b.s * exp(b.m - m)};
}

// Warp shuffles for the reduction states.
template <typename S> __device__ __forceinline__ S shfl_xor(S v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
template <> __device__ __forceinline__ Lse<float> shfl_xor(Lse<float> v, int mask) {
    return Lse<float>{__shfl_xor_sync(0xffffffffu, v.m, mask), __shfl_xor_sync(0xffffffffu, v.s, mask)};
}
template <> __device__ __forceinline__ Lse<double> shfl_xor(Lse<double> v, int mask) {
    return Lse<double>{__shfl_xor_sync(0xffffffffu, v.m, mask), __shfl_xor_sync(0xffffffffu, v.s, mask)};
}

// Reducers: state S; init(); pre(x) -> S; comb(S, S); fin(S, count) -> accumulator type.
#define GG_REDUCER(Name, StateT, INIT, PRE, COMB, FIN)                                              \
    template <typename A> struct Name {                                                             \
        using S = StateT;                                                                           \
        static __device__ __forceinline__ S init() { return INIT; }                                 \
        static __device__ __forceinline__ S pre(A x) { return PRE; }                                \
        static __device__ __forceinline__ S comb(S a, S b) { return COMB; }                         \
        static __device__ __forceinline__ A fin(S s, int64_t count) { (void)count; return FIN; }    \
    };
GG_REDUCER(RSum, A, A(0), x, a + b, s)
GG_REDUCER(RMean, A, A(0), x, a + b, s / A(count))
GG_REDUCER(RSumSquare, A, A(0), x * x, a + b, s)
GG_REDUCER(RL1, A, A(0), fabs(x), a + b, s)
GG_REDUCER(RL2, A, A(0), x * x, a + b, sqrt(s))
GG_REDUCER(RLogSum, A, A(0), x, a + b, log(s))
GG_REDUCER(RMax, A, Lim<A>::lowest(), x, gg_max(a, b), s)
GG_REDUCER(RMin, A, Lim<A>::highest(), x, gg_min(a, b), s)
GG_REDUCER(RProd, A, A(1), x, a * b, s)
GG_REDUCER(RLogSumExp, Lse<A>, (Lse<A>{Lim<A>::lowest(), A(0)}), (Lse<A>{x, A(1)}), lse_comb(a, b),
           s.m == Lim<A>::lowest() ? s.m : log(s.s) + s.m)

// Block-wide combine (blockDim.x * blockDim.y threads, a multiple of 32, at most 1024); the
// result is valid in thread 0. Fixed tree: deterministic.
template <typename R>
__device__ __forceinline__ typename R::S block_combine(typename R::S v) {
    __shared__ typename R::S warp_part[32];
    const int tid = threadIdx.y * blockDim.x + threadIdx.x;
    const int nthreads = blockDim.x * blockDim.y;
    for (int m = 16; m > 0; m >>= 1) v = R::comb(v, shfl_xor(v, m));
    if (nthreads <= 32) return v;
    if ((tid & 31) == 0) warp_part[tid >> 5] = v;
    __syncthreads();
    if (tid < 32) {
        v = tid < (nthreads >> 5) ? warp_part[tid] : R::init();
        for (int m = 16; m > 0; m >>= 1) v = R::comb(v, shfl_xor(v, m));
    }
    return v;
}

// Offset of flat index i over `d`'s shape read through its strides (rank 1: no division).
__device__ __forceinline__ int64_t desc_offset(int64_t i, const TensorDesc& d) {
    if (d.rank == 0) return 0;
    if (d.rank == 1) return i * d.strides[0];
    return gg_offset(i, d, d);
}

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// V consecutive elements (one 16-byte load when V * sizeof(T) == 16; p must be aligned to it).
template <typename T, int V>
__device__ __forceinline__ void vload(const T* p, typename Acc<T>::type* v) {
    Pack<T, V> q = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = gg_load(&q.v[k]);
}

// state = fold(state, V consecutive elements at x[base + off(r)]) for r = first, first + step, ...
// < end, in increasing r, with four loads in flight per thread (the fold order is a plain loop's).
template <typename T, int V, typename Off, typename State, typename Fold>
__device__ __forceinline__ State packs_loop(const T* __restrict__ base, int64_t r, int64_t step, int64_t end, Off off,
                                            State state, Fold fold) {
    using A = typename Acc<T>::type;
    A v[4][V];
    for (; r + 3 * step < end; r += 4 * step) {
#pragma unroll
        for (int u = 0; u < 4; ++u) vload<T, V>(base + off(r + u * step), v[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) state = fold(state, v[u]);
    }
    for (; r < end; r += step) {
        vload<T, V>(base + off(r), v[0]);
        state = fold(state, v[0]);
    }
    return state;
}

// Folds x[base + off(r)] for r = start + tid*V, stepping blockDim.x*V, into acc in increasing r.
template <typename T, typename R, int V, typename Off>
__device__ __forceinline__ typename R::S rows_loop(const T* __restrict__ base, int64_t start, int64_t end, Off off,
                                                   typename R::S acc) {
    using S = typename R::S;
    return packs_loop<T, V>(base, start + (int64_t)threadIdx.x * V, (int64_t)blockDim.x * V, end, off, acc,
                            [](S a, const typename Acc<T>::type* v) {
#pragma unroll
                                for (int k = 0; k < V; ++k) a = R::comb(a, R::pre(v[k]));
                                return a;
                            });
}

// rows: output o = blockIdx.x reduces x[base(o) + roff(r / L) + r % L] for r in its chunk.
template <typename T, typename R, int V>
__device__ void reduce_rows(T* out, typename R::S* partial, const T* __restrict__ x, const TensorDesc& kd,
                            const TensorDesc& rd, int64_t L, int64_t total, int64_t chunk) {
    const int64_t o = blockIdx.x;
    const int64_t split = blockIdx.y;
    const T* base = x + desc_offset(o, kd);
    const int64_t start = split * chunk;
    const int64_t end = min(total, start + chunk);
    typename R::S acc = R::init();
    if (rd.rank == 0) {
        acc = rows_loop<T, R, V>(base, start, end, [](int64_t r) { return r; }, acc);
    } else if (rd.rank == 1 && total <= 0xFFFFFFFFll) {
        const uint32_t l32 = (uint32_t)L;
        const int64_t stride = rd.strides[0];
        acc = rows_loop<T, R, V>(base, start, end, [=](int64_t r) {
            uint32_t ro = (uint32_t)r / l32;
            return (int64_t)ro * stride + (int64_t)((uint32_t)r - ro * l32);
        }, acc);
    } else {
        acc = rows_loop<T, R, V>(base, start, end, [&](int64_t r) {
            int64_t ro = r / L;
            return desc_offset(ro, rd) + (r - ro * L);
        }, acc);
    }
    acc = block_combine<R>(acc);
    if (threadIdx.x == 0) {
        if (gridDim.y == 1) gg_store(out + o, R::fin(acc, total));
        else partial[split * gridDim.x + o] = acc;
    }
}

// cols: block (32, BY); output column c of outer kept index mo reduces x[base + roff(r)].
template <typename T, typename R>
__device__ void reduce_cols(T* out, typename R::S* partial, const T* __restrict__ x, const TensorDesc& kd,
                            const TensorDesc& rd, int64_t C, int64_t tiles, int64_t total, int64_t chunk) {
    __shared__ typename R::S part[32][33];
    const int64_t mo = blockIdx.x / tiles;
    const int64_t c = (blockIdx.x - mo * tiles) * 32 + threadIdx.x;
    const int64_t split = blockIdx.y;
    const int64_t start = split * chunk;
    const int64_t end = min(total, start + chunk);
    typename R::S acc = R::init();
    if (c < C) {
        const T* base = x + desc_offset(mo, kd) + c;
        if (rd.rank == 1) {
            const int64_t stride = rd.strides[0];
            for (int64_t r = start + threadIdx.y; r < end; r += blockDim.y) acc = R::comb(acc, R::pre(gg_load(base + r * stride)));
        } else {
            for (int64_t r = start + threadIdx.y; r < end; r += blockDim.y) acc = R::comb(acc, R::pre(gg_load(base + gg_offset(r, rd, rd))));
        }
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        for (int k = 1; k < (int)blockDim.y; ++k) acc = R::comb(acc, part[k][threadIdx.x]);
        const int64_t o = mo * C + c;
        if (gridDim.y == 1) gg_store(out + o, R::fin(acc, total));
        else partial[split * (gridDim.x / tiles) * C + o] = acc;
    }
}

// Folds x[base + off(r)] for rows r = start + threadIdx.y, stepping blockDim.y, into acc[0..V) (V
// neighbouring columns, one 16-byte load per row when V > 1); each column folds its rows in
// increasing order, as a plain loop would.
template <typename T, typename R, int V, typename Off>
__device__ __forceinline__ void cols_loop(const T* __restrict__ base, int64_t start, int64_t end, Off off,
                                          typename R::S* acc) {
    using S = typename R::S;
    packs_loop<T, V>(base, start + threadIdx.y, blockDim.y, end, off, acc, [](S* a, const typename Acc<T>::type* v) {
#pragma unroll
        for (int k = 0; k < V; ++k) a[k] = R::comb(a[k], R::pre(v[k]));
        return a;
    });
}

// colsv: as cols, each thread owning V neighbouring columns (C % V == 0, x 16-byte aligned), so a
// warp reads 32 * V contiguous elements of a row; block (32, BY <= 8).
template <typename T, typename R, int V>
__device__ void reduce_cols_v(T* out, typename R::S* partial, const T* __restrict__ x, const TensorDesc& kd,
                              const TensorDesc& rd, int64_t C, int64_t tiles, int64_t total, int64_t chunk) {
    using S = typename R::S;
    __shared__ S part[8][32 * V + 1];
    const int64_t mo = blockIdx.x / tiles;
    const int64_t c = ((blockIdx.x - mo * tiles) * 32 + threadIdx.x) * V;
    const int64_t start = blockIdx.y * chunk;
    const int64_t end = min(total, start + chunk);
    S acc[V];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = R::init();
    if (c < C) {
        const T* base = x + desc_offset(mo, kd) + c;
        if (rd.rank == 1) {
            const int64_t stride = rd.strides[0];
            cols_loop<T, R, V>(base, start, end, [=](int64_t r) { return r * stride; }, acc);
        } else {
            cols_loop<T, R, V>(base, start, end, [&](int64_t r) { return gg_offset(r, rd, rd); }, acc);
        }
    }
#pragma unroll
    for (int k = 0; k < V; ++k) part[threadIdx.y][threadIdx.x * V + k] = acc[k];
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
            S a = acc[k];
            for (int j = 1; j < (int)blockDim.y; ++j) a = R::comb(a, part[j][threadIdx.x * V + k]);
            const int64_t o = mo * C + c + k;
            if (gridDim.y == 1) gg_store(out + o, R::fin(a, total));
            else partial[blockIdx.y * (gridDim.x / tiles) * C + o] = a;
        }
    }
}

template <typename T, typename R>
__device__ void reduce_finalize(T* out, const typename R::S* partial, int64_t m, int64_t splits, int64_t total) {
    using S = typename R::S;
    constexpr int U = 8;  // loads in flight; combined in split order
    GG_GRID_STRIDE(o, m) {
        S acc = partial[o];
        int64_t s = 1;
        for (; s + U <= splits; s += U) {
            S v[U];
#pragma unroll
            for (int u = 0; u < U; ++u) v[u] = partial[(s + u) * m + o];
#pragma unroll
            for (int u = 0; u < U; ++u) acc = R::comb(acc, v[u]);
        }
        for (; s < splits; ++s) acc = R::comb(acc, partial[s * m + o]);
        gg_store(out + o, R::fin(acc, total));
    }
}

template <typename T, typename R>
__device__ void reduce_map(T* out, const T* x, int64_t n) {
    GG_GRID_STRIDE(i, n) { gg_store(out + i, R::fin(R::comb(R::init(), R::pre(gg_load(x + i))), 1)); }
}

#define GG_REDUCE(op, Red, s, T)                                                                             \
    extern "C" __global__ void rows_##op##_##s(T* out, Red<Acc<T>::type>::S* partial, const T* x, TensorDesc kd, \
                                               TensorDesc rd, int64_t L, int64_t total, int64_t chunk) {      \
        reduce_rows<T, Red<Acc<T>::type>, 1>(out, partial, x, kd, rd, L, total, chunk);                       \
    }                                                                                                        \
    extern "C" __global__ void cols_##op##_##s(T* out, Red<Acc<T>::type>::S* partial, const T* x, TensorDesc kd, \
                                               TensorDesc rd, int64_t C, int64_t tiles, int64_t total,        \
                                               int64_t chunk) {                                              \
        reduce_cols<T, Red<Acc<T>::type>>(out, partial, x, kd, rd, C, tiles, total, chunk);                  \
    }                                                                                                        \
    extern "C" __global__ void fin_##op##_##s(T* out, const Red<Acc<T>::type>::S* partial, int64_t m,       \
                                              int64_t splits, int64_t total) {                               \
        reduce_finalize<T, Red<Acc<T>::type>>(out, partial, m, splits, total);                               \
    }                                                                                                        \
    extern "C" __global__ void map_##op##_##s(T* out, const T* x, int64_t n) {                              \
        reduce_map<T, Red<Acc<T>::type>>(out, x, n);                                                         \
    }

#define GG_REDUCE_V(op, Red, s, T)                                                                           \
    extern "C" __global__ void rowsv_##op##_##s(T* out, Red<Acc<T>::type>::S* partial, const T* x, TensorDesc kd, \
                                                TensorDesc rd, int64_t L, int64_t total, int64_t chunk) {     \
        reduce_rows<T, Red<Acc<T>::type>, (16 / sizeof(T))>(out, partial, x, kd, rd, L, total, chunk); \
    }                                                                                                        \
    extern "C" __global__ void colsv_##op##_##s(T* out, Red<Acc<T>::type>::S* partial, const T* x, TensorDesc kd, \
                                                TensorDesc rd, int64_t C, int64_t tiles, int64_t total,       \
                                                int64_t chunk) {                                             \
        reduce_cols_v<T, Red<Acc<T>::type>, (16 / sizeof(T))>(out, partial, x, kd, rd, C, tiles, total, chunk); \
    }

#define GG_REDUCE_FLOATS(op, Red) GG_REDUCE(op, Red, f16, __half) GG_REDUCE(op, Red, bf16, __nv_bfloat16) \
    GG_REDUCE(op, Red, f32, float) GG_REDUCE(op, Red, f64, double) \
    GG_REDUCE_V(op, Red, f32, float) GG_REDUCE_V(op, Red, f64, double)
#define GG_REDUCE_INTS(op, Red) GG_REDUCE(op, Red, i32, int32_t) GG_REDUCE(op, Red, i64, int64_t) \
    GG_REDUCE_V(op, Red, i32, int32_t) GG_REDUCE_V(op, Red, i64, int64_t)

#if GG_PART(0)
GG_REDUCE_FLOATS(sum, RSum)
#endif
#if GG_PART(1)
GG_REDUCE_FLOATS(mean, RMean)
#endif
#if GG_PART(2)
GG_REDUCE_FLOATS(sum_square, RSumSquare)
#endif
#if GG_PART(3)
GG_REDUCE_FLOATS(l1, RL1)
#endif
#if GG_PART(4)
GG_REDUCE_FLOATS(l2, RL2)
#endif
#if GG_PART(5)
GG_REDUCE_FLOATS(log_sum, RLogSum)
#endif
#if GG_PART(6)
GG_REDUCE_FLOATS(max, RMax)
#endif
#if GG_PART(7)
GG_REDUCE_FLOATS(min, RMin)
#endif
#if GG_PART(8)
GG_REDUCE_FLOATS(prod, RProd)
#endif
#if GG_PART(9)
GG_REDUCE_FLOATS(log_sum_exp, RLogSumExp)
#endif
#if GG_PART(10)
GG_REDUCE_INTS(sum, RSum)
#endif
#if GG_PART(11)
GG_REDUCE_INTS(max, RMax)
#endif
#if GG_PART(12)
GG_REDUCE_INTS(min, RMin)
#endif
#if GG_PART(13)
GG_REDUCE_INTS(prod, RProd)
#endif

// ---------------------------------------------------------------------------------------------
// Softmax / LogSoftmax over an axis of length L: x viewed as (outer, L, inner).

template <bool LOG, typename A> __device__ __forceinline__ A softmax_value(A x, Lse<A> st) {
    if constexpr (LOG) return x - st.m - log(st.s);
    else return exp(x - st.m) / st.s;
}

// inner == 1: one block per row (blockDim.x a multiple of 32), U loads in flight per thread.
// The row's (max, sum of exp) state, valid in every thread; each thread folds its elements in
// order, then a fixed block tree.
constexpr int SOFTMAX_U = 4;
template <typename T>
__device__ Lse<typename Acc<T>::type> row_lse(const T* __restrict__ row, int64_t L) {
    using A = typename Acc<T>::type;
    using R = RLogSumExp<A>;
    const int64_t step = blockDim.x;
    typename R::S st = R::init();
    int64_t j = threadIdx.x;
    for (; j + (SOFTMAX_U - 1) * step < L; j += SOFTMAX_U * step) {
        A v[SOFTMAX_U];
#pragma unroll
        for (int u = 0; u < SOFTMAX_U; ++u) v[u] = gg_load(row + j + u * step);
#pragma unroll
        for (int u = 0; u < SOFTMAX_U; ++u) st = R::comb(st, R::pre(v[u]));
    }
    for (; j < L; j += step) st = R::comb(st, R::pre(gg_load(row + j)));
    st = block_combine<R>(st);
    __shared__ Lse<A> shared_state;
    if (threadIdx.x == 0) shared_state = st;
    __syncthreads();
    return shared_state;
}

template <typename T, bool LOG>
__device__ void softmax_rows(T* out, const T* __restrict__ x, int64_t L) {
    using A = typename Acc<T>::type;
    const T* row = x + (int64_t)blockIdx.x * L;
    T* orow = out + (int64_t)blockIdx.x * L;
    const Lse<A> st = row_lse<T>(row, L);
    const int64_t step = blockDim.x;
    int64_t j = threadIdx.x;
    for (; j + (SOFTMAX_U - 1) * step < L; j += SOFTMAX_U * step) {
        A v[SOFTMAX_U];
#pragma unroll
        for (int u = 0; u < SOFTMAX_U; ++u) v[u] = gg_load(row + j + u * step);
#pragma unroll
        for (int u = 0; u < SOFTMAX_U; ++u) gg_store(orow + j + u * step, softmax_value<LOG>(v[u], st));
    }
    for (; j < L; j += step) gg_store(orow + j, softmax_value<LOG>(gg_load(row + j), st));
}

// The statistics log-softmax needs, per row: stats[2 r] = max, stats[2 r + 1] = log(sum exp(x - max)),
// so that (x - stats[2 r]) - stats[2 r + 1] is log_softmax_rows' value, bit for bit (the executor's
// SoftmaxCrossEntropyLoss that keeps these instead of the log-probabilities: kernels/cuda/loss.py).
template <typename T>
__device__ void softmax_stats_rows(typename Acc<T>::type* stats, const T* __restrict__ x, int64_t L) {
    const Lse<typename Acc<T>::type> st = row_lse<T>(x + (int64_t)blockIdx.x * L, L);
    if (threadIdx.x == 0) {
        stats[2 * (int64_t)blockIdx.x] = st.m;
        stats[2 * (int64_t)blockIdx.x + 1] = log(st.s);
    }
}

// inner > 1: one thread per (outer, inner) column; neighbouring threads read neighbouring columns.
template <typename T, bool LOG>
__device__ void softmax_cols(T* out, const T* __restrict__ x, int64_t outer, int64_t L, int64_t inner) {
    using A = typename Acc<T>::type;
    using R = RLogSumExp<A>;
    GG_GRID_STRIDE(col, outer * inner) {
        const int64_t o = col / inner;
        const int64_t base = o * L * inner + (col - o * inner);
        typename R::S st = R::init();
        for (int64_t j = 0; j < L; ++j) st = R::comb(st, R::pre(gg_load(x + base + j * inner)));
        for (int64_t j = 0; j < L; ++j) gg_store(out + base + j * inner, softmax_value<LOG>(gg_load(x + base + j * inner), st));
    }
}

// inner == 1, L <= 32 * N: one warp per row held in registers (one read of x).
template <typename T, bool LOG, int N>
__device__ void softmax_warp(T* out, const T* __restrict__ x, int64_t rows, int64_t L) {
    using A = typename Acc<T>::type;
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const T* xr = x + row * L;
    A v[N];
    A m = Lim<A>::lowest();
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        v[k] = j < L ? (A)gg_load(xr + j) : Lim<A>::lowest();
        m = gg_max(m, v[k]);
    }
    for (int s = 16; s > 0; s >>= 1) m = gg_max(m, __shfl_xor_sync(0xffffffffu, m, s));
    A sum = 0;
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (k * 32 + lane < L) sum += exp(v[k] - m);
    for (int s = 16; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
    T* orow = out + row * L;
    const A log_sum = log(sum);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        if (j < L) {
            if constexpr (LOG) gg_store(orow + j, (v[k] - m) - log_sum);
            else gg_store(orow + j, exp(v[k] - m) / sum);
        }
    }
}

#define GG_SOFTMAX_WARP(n, s, T)                                                                             \
    extern "C" __global__ void softmax_warp##n##_##s(T* out, const T* x, int64_t rows, int64_t L) {           \
        softmax_warp<T, false, n>(out, x, rows, L);                                                          \
    }                                                                                                        \
    extern "C" __global__ void log_softmax_warp##n##_##s(T* out, const T* x, int64_t rows, int64_t L) {       \
        softmax_warp<T, true, n>(out, x, rows, L);                                                           \
    }
#define GG_SOFTMAX_WARPS(s, T) GG_SOFTMAX_WARP(1, s, T) GG_SOFTMAX_WARP(2, s, T) GG_SOFTMAX_WARP(4, s, T) \
    GG_SOFTMAX_WARP(8, s, T) GG_SOFTMAX_WARP(16, s, T) GG_SOFTMAX_WARP(32, s, T)
#if GG_PART(14)
GG_SOFTMAX_WARPS(f16, __half)
GG_SOFTMAX_WARPS(bf16, __nv_bfloat16)
GG_SOFTMAX_WARPS(f32, float)
GG_SOFTMAX_WARPS(f64, double)
#endif

#define GG_SOFTMAX(s, T)                                                                                    \
    extern "C" __global__ void softmax_rows_##s(T* out, const T* x, int64_t L) { softmax_rows<T, false>(out, x, L); } \
    extern "C" __global__ void log_softmax_rows_##s(T* out, const T* x, int64_t L) { softmax_rows<T, true>(out, x, L); } \
    extern "C" __global__ void softmax_stats_rows_##s(Acc<T>::type* stats, const T* x, int64_t L) {        \
        softmax_stats_rows<T>(stats, x, L);                                                                \
    }                                                                                                       \
    extern "C" __global__ void softmax_cols_##s(T* out, const T* x, int64_t outer, int64_t L, int64_t inner) { \
        softmax_cols<T, false>(out, x, outer, L, inner);                                                   \
    }                                                                                                       \
    extern "C" __global__ void log_softmax_cols_##s(T* out, const T* x, int64_t outer, int64_t L, int64_t inner) { \
        softmax_cols<T, true>(out, x, outer, L, inner);                                                    \
    }
#if GG_PART(15)
GG_SOFTMAX(f16, __half)
GG_SOFTMAX(bf16, __nv_bfloat16)
GG_SOFTMAX(f32, float)
GG_SOFTMAX(f64, double)
#endif

// ---------------------------------------------------------------------------------------------
// SoftmaxGrad_13 / LogSoftmaxGrad_13 (ONNX Runtime training's): with s = sum over the axis of
// dY * Y (softmax) or of dY (log-softmax), dX = Y * (dY - s) or dY - exp(Y) * s; (outer, L, inner)
// views as the forward's, the sums in a fixed order.

template <bool LOG, typename A> __device__ __forceinline__ A softmax_grad_term(A g, A y) {
    if constexpr (LOG) return g;
    else return g * y;
}
template <bool LOG, typename A> __device__ __forceinline__ A softmax_grad_value(A g, A y, A s) {
    if constexpr (LOG) return g - exp(y) * s;
    else return y * (g - s);
}

// inner == 1, L <= 32 * N: one warp per row, dY and Y held in registers (one read of each).
template <typename T, bool LOG, int N>
__device__ void softmax_grad_warp(T* dx, const T* __restrict__ dy, const T* __restrict__ y, int64_t rows, int64_t L) {
    using A = typename Acc<T>::type;
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    A g[N], v[N];
    A s = 0;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        g[k] = j < L ? (A)gg_load(dy + row * L + j) : A(0);
        v[k] = j < L ? (A)gg_load(y + row * L + j) : A(0);
        s += softmax_grad_term<LOG>(g[k], v[k]);
    }
    for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int64_t j = k * 32 + lane;
        if (j < L) gg_store(dx + row * L + j, softmax_grad_value<LOG>(g[k], v[k], s));
    }
}

// inner == 1: one block per row (blockDim.x a multiple of 32), U loads in flight per thread.
template <typename T, bool LOG>
__device__ void softmax_grad_rows(T* dx, const T* __restrict__ dy, const T* __restrict__ y, int64_t L) {
    using A = typename Acc<T>::type;
    __shared__ A scratch[33];
    const int64_t base = (int64_t)blockIdx.x * L;
    A s = 0;
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x) s += softmax_grad_term<LOG>((A)gg_load(dy + base + j), (A)gg_load(y + base + j));
    s = block_sum(s, scratch);
    for (int64_t j = threadIdx.x; j < L; j += blockDim.x)
        gg_store(dx + base + j, softmax_grad_value<LOG>((A)gg_load(dy + base + j), (A)gg_load(y + base + j), s));
}

// inner > 1: one thread per (outer, inner) column.
template <typename T, bool LOG>
__device__ void softmax_grad_cols(T* dx, const T* __restrict__ dy, const T* __restrict__ y, int64_t outer, int64_t L, int64_t inner) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(col, outer * inner) {
        const int64_t o = col / inner;
        const int64_t base = o * L * inner + (col - o * inner);
        A s = 0;
        for (int64_t j = 0; j < L; ++j) s += softmax_grad_term<LOG>((A)gg_load(dy + base + j * inner), (A)gg_load(y + base + j * inner));
        for (int64_t j = 0; j < L; ++j)
            gg_store(dx + base + j * inner, softmax_grad_value<LOG>((A)gg_load(dy + base + j * inner), (A)gg_load(y + base + j * inner), s));
    }
}

#define GG_SOFTMAX_GRAD_WARP(n, s, T)                                                                          \
    extern "C" __global__ void softmax_grad_warp##n##_##s(T* dx, const T* dy, const T* y, int64_t rows, int64_t L) { \
        softmax_grad_warp<T, false, n>(dx, dy, y, rows, L);                                                    \
    }                                                                                                          \
    extern "C" __global__ void log_softmax_grad_warp##n##_##s(T* dx, const T* dy, const T* y, int64_t rows,     \
                                                               int64_t L) {                                     \
        softmax_grad_warp<T, true, n>(dx, dy, y, rows, L);                                                     \
    }
#define GG_SOFTMAX_GRAD(s, T)                                                                                  \
    GG_SOFTMAX_GRAD_WARP(1, s, T) GG_SOFTMAX_GRAD_WARP(2, s, T) GG_SOFTMAX_GRAD_WARP(4, s, T)                  \
    GG_SOFTMAX_GRAD_WARP(8, s, T) GG_SOFTMAX_GRAD_WARP(16, s, T) GG_SOFTMAX_GRAD_WARP(32, s, T)                \
    extern "C" __global__ void softmax_grad_rows_##s(T* dx, const T* dy, const T* y, int64_t L) {              \
        softmax_grad_rows<T, false>(dx, dy, y, L);                                                             \
    }                                                                                                          \
    extern "C" __global__ void log_softmax_grad_rows_##s(T* dx, const T* dy, const T* y, int64_t L) {          \
        softmax_grad_rows<T, true>(dx, dy, y, L);                                                              \
    }                                                                                                          \
    extern "C" __global__ void softmax_grad_cols_##s(T* dx, const T* dy, const T* y, int64_t outer, int64_t L, \
                                                     int64_t inner) {                                          \
        softmax_grad_cols<T, false>(dx, dy, y, outer, L, inner);                                               \
    }                                                                                                          \
    extern "C" __global__ void log_softmax_grad_cols_##s(T* dx, const T* dy, const T* y, int64_t outer,        \
                                                         int64_t L, int64_t inner) {                           \
        softmax_grad_cols<T, true>(dx, dy, y, outer, L, inner);                                                \
    }
#if GG_PART(16)
GG_SOFTMAX_GRAD(f32, float)
#endif
#if GG_PART(17)
GG_SOFTMAX_GRAD(f16, __half)
GG_SOFTMAX_GRAD(bf16, __nv_bfloat16)
GG_SOFTMAX_GRAD(f64, double)
#endif

// ---------------------------------------------------------------------------------------------
// Running sums and products (CumSum, CumProd) along one axis: one thread per line of the (outer, L,
// inner) view, combining in order (reverse: from the end; exclusive: each element gets the value
// before it, the identity first), the running value kept in Acc<T> (float for float16/bfloat16,
// rounded only when stored). Deterministic.

template <typename T, typename Op>
__device__ void scan_lines(T* out, const T* x, int64_t outer, int64_t L, int64_t inner, int64_t exclusive,
                           int64_t reverse) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(line, outer * inner) {
        const int64_t base = (line / inner) * L * inner + line % inner;
        A acc = Op::template identity<A>();
        for (int64_t k = 0; k < L; ++k) {
            const int64_t at = base + (reverse ? L - 1 - k : k) * inner;
            const A v = gg_load(x + at);
            if (exclusive) {
                gg_store(out + at, acc);
                acc = Op::apply(acc, v);
            } else {
                acc = Op::apply(acc, v);
                gg_store(out + at, acc);
            }
        }
    }
}

struct ScanSum {
    template <typename A> static __device__ __forceinline__ A identity() { return A(0); }
    template <typename A> static __device__ __forceinline__ A apply(A a, A v) { return a + v; }
};

#define GG_CUMSUM(s, T)                                                                                     \
    extern "C" __global__ void cumsum_##s(T* out, const T* x, int64_t outer, int64_t L, int64_t inner,     \
                                          int64_t exclusive, int64_t reverse) {                            \
        scan_lines<T, ScanSum>(out, x, outer, L, inner, exclusive, reverse);                                       \
    }
#if GG_PART(18)
GG_CUMSUM(f16, __half)
GG_CUMSUM(bf16, __nv_bfloat16)
GG_CUMSUM(f32, float)
GG_CUMSUM(f64, double)
GG_CUMSUM(i32, int32_t)
GG_CUMSUM(i64, int64_t)
#endif

// ---------------------------------------------------------------------------------------------
// TopK along one axis of the (outer, L, inner) view, L <= 4096 (the launcher's limit): one block per
// line (grid-stride over lines). Each element gets a 64-bit unsigned key in the CPU kernel's order
// (numpy's stable sort): floats through double with -0 equal to +0 and every NaN above +inf, signed
// integers offset by 2^63; complemented for largest. A bitonic sort of the (key, index) pairs in
// shared memory (P = L rounded up to a power of two, padding keys ~0 with index 0xFFFF) orders them
// ascending, equal keys by index (the lower first): the CPU kernel's order, sorted or not. The first
// K are written: values copied from x as they are, indices as int64. Deterministic, no atomics.

__device__ __forceinline__ unsigned long long topk_float_key(double v) {
    if (v != v) return ~0ULL;
    if (v == 0.0) v = 0.0;  // -0 ties with +0
    const unsigned long long b = (unsigned long long)__double_as_longlong(v);
    return (b >> 63) ? ~b : (b | 0x8000000000000000ULL);
}
__device__ __forceinline__ unsigned long long topk_key(__half v) { return topk_float_key((double)__half2float(v)); }
__device__ __forceinline__ unsigned long long topk_key(__nv_bfloat16 v) {
    return topk_float_key((double)__bfloat162float(v));
}
__device__ __forceinline__ unsigned long long topk_key(float v) { return topk_float_key((double)v); }
__device__ __forceinline__ unsigned long long topk_key(double v) { return topk_float_key(v); }
__device__ __forceinline__ unsigned long long topk_key(int8_t v) {
    return (unsigned long long)(long long)v ^ 0x8000000000000000ULL;
}
__device__ __forceinline__ unsigned long long topk_key(uint8_t v) { return (unsigned long long)v; }
__device__ __forceinline__ unsigned long long topk_key(int32_t v) {
    return (unsigned long long)(long long)v ^ 0x8000000000000000ULL;
}
__device__ __forceinline__ unsigned long long topk_key(int64_t v) {
    return (unsigned long long)v ^ 0x8000000000000000ULL;
}

// shared memory: P keys (8 bytes) then P indices (2 bytes); blockDim.x threads, each owning pairs
template <typename T>
__device__ void topk_lines(T* __restrict__ values, int64_t* __restrict__ indices, const T* __restrict__ x,
                           int64_t outer, int64_t L, int64_t inner, int64_t K, int64_t P, int64_t largest) {
    extern __shared__ unsigned long long topk_shared[];
    unsigned long long* key = topk_shared;
    unsigned short* idx = (unsigned short*)(topk_shared + P);
    const unsigned long long flip = largest ? ~0ULL : 0ULL;
    const int half = (int)(P >> 1);
    for (int64_t line = blockIdx.x; line < outer * inner; line += gridDim.x) {
        const int64_t o = line / inner, i = line - o * inner;
        const T* src = x + o * L * inner + i;
        for (int j = threadIdx.x; j < P; j += blockDim.x) {
            if (j < L) {
                key[j] = topk_key(src[(int64_t)j * inner]) ^ flip;
                idx[j] = (unsigned short)j;
            } else {
                key[j] = ~0ULL;
                idx[j] = 0xFFFF;
            }
        }
        __syncthreads();
        for (int size = 2; size <= P; size <<= 1) {
            for (int stride = size >> 1; stride > 0; stride >>= 1) {
                for (int t = threadIdx.x; t < half; t += blockDim.x) {
                    const int lo = ((t & ~(stride - 1)) << 1) | (t & (stride - 1));
                    const int hi = lo + stride;
                    const bool up = (lo & size) == 0;
                    const unsigned long long a = key[lo], b = key[hi];
                    const unsigned short ia = idx[lo], ib = idx[hi];
                    const bool greater = a > b || (a == b && ia > ib);
                    if (greater == up) {
                        key[lo] = b;
                        key[hi] = a;
                        idx[lo] = ib;
                        idx[hi] = ia;
                    }
                }
                __syncthreads();
            }
        }
        T* vdst = values + o * K * inner + i;
        int64_t* idst = indices + o * K * inner + i;
        for (int64_t j = threadIdx.x; j < K; j += blockDim.x) {
            const int64_t s = (int64_t)idx[j];
            vdst[j * inner] = src[s * inner];
            idst[j * inner] = s;
        }
        __syncthreads();  // the next line reuses the shared arrays
    }
}

#define GG_TOPK(s, T)                                                                                        \
    extern "C" __global__ void topk_##s(T* values, int64_t* indices, const T* x, int64_t outer, int64_t L,  \
                                        int64_t inner, int64_t K, int64_t P, int64_t largest) {              \
        topk_lines<T>(values, indices, x, outer, L, inner, K, P, largest);                                   \
    }
#if GG_PART(19)
GG_TOPK(f16, __half)
GG_TOPK(bf16, __nv_bfloat16)
GG_TOPK(f32, float)
GG_TOPK(f64, double)
GG_TOPK(i8, int8_t)
GG_TOPK(u8, uint8_t)
GG_TOPK(i32, int32_t)
GG_TOPK(i64, int64_t)
#endif

// ---------------------------------------------------------------------------------------------
// CumProd (scan_lines above): integers wrap, as numpy's products do.

template <typename A> __device__ __forceinline__ A cumprod_mul(A a, A b) { return a * b; }
template <> __device__ __forceinline__ int32_t cumprod_mul<int32_t>(int32_t a, int32_t b) {
    return (int32_t)((uint32_t)a * (uint32_t)b);
}
template <> __device__ __forceinline__ int64_t cumprod_mul<int64_t>(int64_t a, int64_t b) {
    return (int64_t)((unsigned long long)a * (unsigned long long)b);
}

struct ScanProd {
    template <typename A> static __device__ __forceinline__ A identity() { return A(1); }
    template <typename A> static __device__ __forceinline__ A apply(A a, A v) { return cumprod_mul<A>(a, v); }
};

#define GG_CUMPROD(s, T)                                                                                    \
    extern "C" __global__ void cumprod_##s(T* out, const T* x, int64_t outer, int64_t L, int64_t inner,    \
                                           int64_t exclusive, int64_t reverse) {                           \
        scan_lines<T, ScanProd>(out, x, outer, L, inner, exclusive, reverse);                                      \
    }
#if GG_PART(20)
GG_CUMPROD(f16, __half)
GG_CUMPROD(bf16, __nv_bfloat16)
GG_CUMPROD(f32, float)
GG_CUMPROD(f64, double)
GG_CUMPROD(i32, int32_t)
GG_CUMPROD(i64, int64_t)
#endif

// ---------------------------------------------------------------------------------------------
// ArgMax / ArgMin along one axis of the (outer, L, inner) view, L >= 1, as numpy's argmax/argmin
// (the CPU kernel): the first extreme element (select_last_index: the last), every NaN more extreme
// than any number (so the first, or last, NaN), -0 tied with +0; 16-bit floats compared in float32
// (exact). A candidate is (value, index), index -1 for none; combining two keeps the more extreme
// value, on a tie the lower index (last: the higher), a total order: any combining order gives the
// same index.
//   argext_rows_*: inner == 1, one warp per line (lanes stride the line, then a shuffle tree);
//   argext_cols_*: one thread per (outer, inner) line, in order (neighbouring threads read
//                  neighbouring columns).

template <bool MAX, typename A>
__device__ __forceinline__ void arg_take(A& best, int64_t& at, A v, int64_t i, int64_t last) {
    if (i < 0) return;
    bool take = at < 0;
    if (!take) {
        const bool v_nan = gg_isnan(v), best_nan = gg_isnan(best);
        int order;  // +1: v more extreme than best, -1: less, 0: tied
        if (v_nan || best_nan) order = v_nan == best_nan ? 0 : (v_nan ? 1 : -1);
        else if (MAX) order = best < v ? 1 : (v < best ? -1 : 0);
        else order = v < best ? 1 : (best < v ? -1 : 0);
        take = order > 0 || (order == 0 && (last ? i > at : i < at));
    }
    if (take) {
        best = v;
        at = i;
    }
}

template <typename T, bool MAX>
__device__ void argext_rows(int64_t* __restrict__ out, const T* __restrict__ x, int64_t rows, int64_t L, int64_t last) {
    using A = typename Acc<T>::type;
    const int lane = threadIdx.x & 31;
    const int64_t step = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows; row += step) {
        const T* xr = x + row * L;
        A best = A(0);
        int64_t at = -1;
        for (int64_t j = lane; j < L; j += 32) arg_take<MAX>(best, at, (A)gg_load(xr + j), j, last);
        for (int m = 16; m > 0; m >>= 1) {
            const A other = __shfl_xor_sync(0xffffffffu, best, m);
            const long long other_at = __shfl_xor_sync(0xffffffffu, (long long)at, m);
            arg_take<MAX>(best, at, other, (int64_t)other_at, last);
        }
        if (lane == 0) out[row] = at;
    }
}

template <typename T, bool MAX>
__device__ void argext_cols(int64_t* __restrict__ out, const T* __restrict__ x, int64_t outer, int64_t L, int64_t inner,
                            int64_t last) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(line, outer * inner) {
        const int64_t o = line / inner;
        const T* base = x + o * L * inner + (line - o * inner);
        A best = gg_load(base);
        int64_t at = 0;
        for (int64_t j = 1; j < L; ++j) arg_take<MAX>(best, at, (A)gg_load(base + j * inner), j, last);
        out[line] = at;
    }
}

#define GG_ARGEXT(name, MAX, s, T)                                                                          \
    extern "C" __global__ void name##_rows_##s(int64_t* out, const T* x, int64_t rows, int64_t L, int64_t last) { \
        argext_rows<T, MAX>(out, x, rows, L, last);                                                         \
    }                                                                                                       \
    extern "C" __global__ void name##_cols_##s(int64_t* out, const T* x, int64_t outer, int64_t L, int64_t inner, \
                                               int64_t last) {                                              \
        argext_cols<T, MAX>(out, x, outer, L, inner, last);                                                 \
    }
#define GG_ARGEXTS(s, T) GG_ARGEXT(argmax, true, s, T) GG_ARGEXT(argmin, false, s, T)
#if GG_PART(21)
GG_ARGEXTS(f16, __half)
GG_ARGEXTS(bf16, __nv_bfloat16)
GG_ARGEXTS(f32, float)
GG_ARGEXTS(f64, double)
GG_ARGEXTS(i32, int32_t)
GG_ARGEXTS(i64, int64_t)
#endif

// ---------------------------------------------------------------------------------------------
// A sort of any length (Unique's): x's n elements as (key, position) pairs, keys topk_key's (numpy's
// order: -0 tied with +0, every NaN above +inf and tied with the others), sorted ascending by key,
// equal keys by position (numpy's stable order). A bitonic sort of P pairs (P: n rounded up to a
// power of two, at least 2), the padding keys ~0 with positions n, n + 1, ... (after every element,
// NaN and INT64_MAX included):
//   sort_keys_*  the pairs;
//   sort_tile    one block of T / 2 threads per tile of T = min(P, SORT_TILE) pairs, in shared memory:
//                size 0 sorts each tile (the stages 2 .. T), size > T finishes that merge stage
//                (strides T / 2 .. 1);
//   sort_step    one compare-exchange step of a stage over all P pairs (strides T and more).
// The launcher runs sort_tile(0), then for each stage size = 2T .. P: sort_step per stride down to
// T, then sort_tile(size). Positions are distinct, so the order is total: the result does not
// depend on the schedule (deterministic, no atomics).
#define SORT_TILE 2048

__device__ __forceinline__ void sort_exchange(unsigned long long* key, int64_t* pos, int64_t lo, int64_t hi, bool up) {
    const unsigned long long a = key[lo], b = key[hi];
    const int64_t pa = pos[lo], pb = pos[hi];
    const bool greater = a > b || (a == b && pa > pb);
    if (greater == up) {
        key[lo] = b;
        key[hi] = a;
        pos[lo] = pb;
        pos[hi] = pa;
    }
}

template <typename T>
__device__ void sort_keys(unsigned long long* __restrict__ key, int64_t* __restrict__ pos, const T* __restrict__ x,
                          int64_t n, int64_t P) {
    GG_GRID_STRIDE(i, P) {
        key[i] = i < n ? topk_key(x[i]) : ~0ULL;
        pos[i] = i;
    }
}

#define GG_SORT_KEYS(s, T)                                                                                   \
    extern "C" __global__ void sort_keys_##s(unsigned long long* key, int64_t* pos, const T* x, int64_t n, \
                                             int64_t P) {                                                  \
        sort_keys<T>(key, pos, x, n, P);                                                                   \
    }
#if GG_PART(22)
GG_SORT_KEYS(f16, __half)
GG_SORT_KEYS(bf16, __nv_bfloat16)
GG_SORT_KEYS(f32, float)
GG_SORT_KEYS(f64, double)
GG_SORT_KEYS(i32, int32_t)
GG_SORT_KEYS(i64, int64_t)

extern "C" __global__ void sort_tile(unsigned long long* key, int64_t* pos, int64_t T, int64_t size) {
    __shared__ unsigned long long tile_key[SORT_TILE];
    __shared__ int64_t tile_pos[SORT_TILE];
    const int64_t base = (int64_t)blockIdx.x * T, half = T >> 1;
    const int64_t t = threadIdx.x;
    tile_key[t] = key[base + t];
    tile_key[t + half] = key[base + t + half];
    tile_pos[t] = pos[base + t];
    tile_pos[t + half] = pos[base + t + half];
    __syncthreads();
    const int64_t first = size ? size : 2, last = size ? size : T;
    for (int64_t stage = first; stage <= last; stage <<= 1) {
        for (int64_t stride = (size ? T : stage) >> 1; stride > 0; stride >>= 1) {
            const int64_t lo = ((t & ~(stride - 1)) << 1) | (t & (stride - 1));
            sort_exchange(tile_key, tile_pos, lo, lo + stride, ((base + lo) & stage) == 0);
            __syncthreads();
        }
    }
    key[base + t] = tile_key[t];
    key[base + t + half] = tile_key[t + half];
    pos[base + t] = tile_pos[t];
    pos[base + t + half] = tile_pos[t + half];
}

extern "C" __global__ void sort_step(unsigned long long* key, int64_t* pos, int64_t P, int64_t size, int64_t stride) {
    GG_GRID_STRIDE(t, P >> 1) {
        const int64_t lo = ((t & ~(stride - 1)) << 1) | (t & (stride - 1));
        sort_exchange(key, pos, lo, lo + stride, (lo & size) == 0);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// TfIdfVectorizer (the tables: kernels/cpu/reduction.py, NgramPool). The pool's n-grams form a
// trie in sorted arrays, node 0 the root: the edge from node p by the value at position i of
// `vocab` (V sorted int64 values) has key p * V + i among the E sorted `edge_key`s and leads to
// `edge_child`; `node_output` is the output column of the n-gram that ends at a node (-1: none).
//   tfidf_count_*  one thread per (row, start, skip distance d = 1 .. distances) walks the trie
//                  along x[row, start], x[row, start + d], ... (at most max_gram items) and adds 1 to
//                  counts[row, column] for each n-gram of the pool it spells that has at least
//                  `shortest` items: first_shortest at d = 1, later_shortest beyond (unigrams count
//                  once, not once per distance). Integer atomics: the counts are exact.
//   tfidf_weigh    the float32 output of the counts by mode (TFIDF_MODES): 1 TF the count; 2 IDF the
//                  column's weight where the count is positive, else 0; 3 TFIDF count * weight,
//                  multiplied in double and rounded once (the CPU kernel's float64 product).

// The position of v among the n sorted values of a, or -1.
__device__ __forceinline__ int64_t tfidf_find(const int64_t* __restrict__ a, int64_t n, int64_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = lo + ((hi - lo) >> 1);
        if (a[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && a[lo] == v ? lo : -1;
}

template <typename T>
__device__ void tfidf_count(unsigned int* __restrict__ counts, const T* __restrict__ x, const int64_t* __restrict__ vocab,
                            int64_t V, const int64_t* __restrict__ edge_key, const int64_t* __restrict__ edge_child,
                            int64_t E, const int64_t* __restrict__ node_output, int64_t rows, int64_t C,
                            int64_t columns, int64_t distances, int64_t max_gram, int64_t first_shortest,
                            int64_t later_shortest) {
    GG_GRID_STRIDE(t, rows * C * distances) {
        const int64_t start = t % C;
        const int64_t d = (t / C) % distances + 1;
        const int64_t row = t / (C * distances);
        const int64_t shortest = d == 1 ? first_shortest : later_shortest;
        const T* xr = x + row * C;
        int64_t node = 0;
        for (int64_t items = 1, at = start; items <= max_gram && at < C; ++items, at += d) {
            const int64_t value = tfidf_find(vocab, V, (int64_t)xr[at]);
            if (value < 0) break;
            const int64_t edge = tfidf_find(edge_key, E, node * V + value);
            if (edge < 0) break;
            node = edge_child[edge];
            const int64_t column = node_output[node];
            if (items >= shortest && column >= 0) atomicAdd(counts + row * columns + column, 1u);
        }
    }
}

#define GG_TFIDF_COUNT(s, T)                                                                                  \
    extern "C" __global__ void tfidf_count_##s(unsigned int* counts, const T* x, const int64_t* vocab, int64_t V, \
                                               const int64_t* edge_key, const int64_t* edge_child, int64_t E,      \
                                               const int64_t* node_output, int64_t rows, int64_t C,               \
                                               int64_t columns, int64_t distances, int64_t max_gram,              \
                                               int64_t first_shortest, int64_t later_shortest) {                 \
        tfidf_count<T>(counts, x, vocab, V, edge_key, edge_child, E, node_output, rows, C, columns, distances,   \
                       max_gram, first_shortest, later_shortest);                                                 \
    }
#if GG_PART(23)
GG_TFIDF_COUNT(i32, int32_t)
GG_TFIDF_COUNT(i64, int64_t)

extern "C" __global__ void tfidf_weigh(float* y, const unsigned int* counts, const float* weights, int64_t n,
                                       int64_t columns, int64_t mode) {
    GG_GRID_STRIDE(i, n) {
        const unsigned int count = counts[i];
        const double weight = weights[i % columns];
        y[i] = mode == 1 ? (float)count : mode == 2 ? (count > 0 ? (float)weight : 0.0f) : (float)(weight * (double)count);
    }
}
#endif
