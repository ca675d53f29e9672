// Data movement kernels. They move bits, not numbers, so entry points are suffixed by the element
// WIDTH in bytes (w1, w2, w4, w8, w16) and by the index type (i32 when every offset fits, else i64);
// the launchers reinterpret float16/32/64 and integer tensors as the unsigned type of their width, and
// reinterpret runs of contiguous elements as 16-byte (or 8-, 4-byte) words where alignment allows.
//
//   strided_copy: dst[dst_off + sum c_k * dst.strides[k]] = src[src_off + sum c_k * src.strides[k]]
//                 over the coordinates c of src.shape (== dst.shape); strides may be 0 or negative.
//   lattice:      one pass over an output; element c is src[q] where c lies on the lattice
//                 c_k = start_k + q_k * step_k (0 <= q_k < count_k, step_k != 0) on every axis, and
//                 `fill` elsewhere. SliceGrad (fill 0) and constant Pad use it; every output element
//                 is written exactly once, so no memset comes first. The v-variants handle V
//                 consecutive elements of the innermost axis per thread and store them as one word.
//   fill, trilu:  the obvious.
//   reverse_sequence: out[t, b, k] = x[s, b, k] (time axis first; or [b, t, k] with the batch first),
//                 s = lens[b] - 1 - t for t < lens[b], else t; a length outside [0, steps] sets *flag.
//   range:        out[i] = start + i * delta, the product and the sum each rounded in the work type
//                 (float for float16/bfloat16/float32, double for float64; never fused into an FMA,
//                 as numpy computes them); integers wrap in int64, then truncate to the output type.
#include "common.h"

template <typename E, typename I>
__device__ __forceinline__ void strided_copy(E* __restrict__ dst, const E* __restrict__ src, const TensorDesc& s,
                                             const TensorDesc& d, int64_t src_off, int64_t dst_off, int64_t n) {
    const int rank = (int)s.rank;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (I)n; i += (I)blockDim.x * gridDim.x) {
        I rest = i, so = 0, dof = 0;
        for (int k = rank - 1; k >= 0; --k) {
            I size = (I)s.shape[k];
            I c = rest % size;
            rest /= size;
            so += c * (I)s.strides[k];
            dof += c * (I)d.strides[k];
        }
        dst[(int64_t)dst_off + (int64_t)dof] = src[(int64_t)src_off + (int64_t)so];
    }
}

// Is coordinate c of an axis on the lattice start + q * step (0 <= q < count)? Sets q.
template <typename I>
__device__ __forceinline__ bool on_lattice(I c, I start, I step, I count, I& q) {
    I t = step > 0 ? c - start : start - c;
    I a = step > 0 ? step : -step;
    if (t < 0) return false;
    q = a == 1 ? t : t / a;
    return q < count && q * a == t;
}

// n / d: by a magic multiplier (fast.shape[k]) and shift (fast.strides[k]) in the 32-bit variant
// (valid for n < 2^31), by plain division in the 64-bit one.
template <typename I>
__device__ __forceinline__ I fast_div(I n, I d, const TensorDesc& fast, int k) {
    if constexpr (sizeof(I) == 4) {
        const uint32_t t = __umulhi((uint32_t)n, (uint32_t)fast.shape[k]);
        return (I)((t + (uint32_t)n) >> (uint32_t)fast.strides[k]);
    } else {
        return n / d;
    }
}

// out: shape `out` (strides unused); lat.shape = count per axis, lat.strides = src strides;
// pos.shape = start per axis, pos.strides = step per axis; fast: division magic for out.shape[k]
// (k < rank-1) and, at rank-1, for the number of V-groups of the last axis. V elements of the last
// axis per item; only one division decides which of them lie on the last axis' lattice.
template <typename E, typename I, int V>
__device__ __forceinline__ void lattice(E* __restrict__ dst, const E* __restrict__ src, const TensorDesc& out,
                                        const TensorDesc& lat, const TensorDesc& pos, const TensorDesc& fast,
                                        E fill, int64_t n) {
    struct alignas(sizeof(E) * V) Vec { E v[V]; };
    const int rank = (int)out.rank;
    const I inner = (I)out.shape[rank - 1] / V;
    const I st = (I)pos.shape[rank - 1], sp = (I)pos.strides[rank - 1], cnt = (I)lat.shape[rank - 1];
    const I ls = (I)lat.strides[rank - 1];
    const I a = sp > 0 ? sp : -sp;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < (I)n; i += (I)blockDim.x * gridDim.x) {
        I rest = fast_div<I>(i, inner, fast, rank - 1);
        const I c_last = (i - rest * inner) * V;
        I so = 0;
        bool ok = true;
        for (int k = rank - 2; k >= 0; --k) {
            const I size = (I)out.shape[k];
            const I next = fast_div<I>(rest, size, fast, k);
            const I c = rest - next * size;
            rest = next;
            I q = 0;
            ok = ok && on_lattice<I>(c, (I)pos.shape[k], (I)pos.strides[k], (I)lat.shape[k], q);
            so += q * (I)lat.strides[k];
        }
        Vec r;
        if (!ok) {
#pragma unroll
            for (int j = 0; j < V; ++j) r.v[j] = fill;
        } else {
            const I t0 = sp > 0 ? c_last - st : st - c_last;
            I q, m;  // t0 = q * a + m with 0 <= m < a (floor division)
            if (a == 1) {
                q = t0;
                m = 0;
            } else {
                q = t0 >= 0 ? t0 / a : -((a - 1 - t0) / a);
                m = t0 - q * a;
            }
#pragma unroll
            for (int j = 0; j < V; ++j) {
                r.v[j] = (m == 0 && q >= 0 && q < cnt) ? src[(int64_t)so + (int64_t)(q * ls)] : fill;
                if (sp > 0) {
                    if (++m == a) { m = 0; ++q; }
                } else {
                    if (--m < 0) { m = a - 1; --q; }
                }
            }
        }
        reinterpret_cast<Vec*>(dst)[i] = r;
    }
}

template <typename E>
__device__ __forceinline__ void trilu(E* __restrict__ dst, const E* __restrict__ src, int64_t rows, int64_t cols,
                                      int64_t k, int64_t upper, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        int64_t col = i % cols, row = (i / cols) % rows;
        bool keep = upper ? (col - row >= k) : (col - row <= k);
        dst[i] = keep ? src[i] : E(0);
    }
}

#define GG_COPY_W(W)                                                                                        \
    extern "C" __global__ void strided_copy_w##W##_i32(Word<W>::type* dst, const Word<W>::type* src,       \
                                                       TensorDesc s, TensorDesc d, int64_t so, int64_t dof, \
                                                       int64_t n) {                                         \
        strided_copy<Word<W>::type, int32_t>(dst, src, s, d, so, dof, n);                                  \
    }                                                                                                       \
    extern "C" __global__ void strided_copy_w##W##_i64(Word<W>::type* dst, const Word<W>::type* src,       \
                                                       TensorDesc s, TensorDesc d, int64_t so, int64_t dof, \
                                                       int64_t n) {                                         \
        strided_copy<Word<W>::type, int64_t>(dst, src, s, d, so, dof, n);                                  \
    }

GG_COPY_W(1)
GG_COPY_W(2)
GG_COPY_W(4)
GG_COPY_W(8)
GG_COPY_W(16)

#define GG_LATTICE(W, V, I)                                                                                 \
    extern "C" __global__ void lattice_w##W##_v##V##_##I(Word<W>::type* dst, const Word<W>::type* src,     \
                                                         TensorDesc out, TensorDesc lat, TensorDesc pos,    \
                                                         TensorDesc fast, int64_t fill, int64_t n) {        \
        Word<W>::type f;                                                                                    \
        memcpy(&f, &fill, W);                                                                               \
        lattice<Word<W>::type, I##_t, V>(dst, src, out, lat, pos, fast, f, n);                             \
    }

#define GG_LATTICE_W(W, V) GG_LATTICE(W, 1, int32) GG_LATTICE(W, 1, int64) GG_LATTICE(W, V, int32) GG_LATTICE(W, V, int64)
GG_LATTICE(1, 1, int32)
GG_LATTICE(1, 1, int64)
GG_LATTICE_W(2, 8)
GG_LATTICE_W(4, 4)
GG_LATTICE_W(8, 2)

#define GG_FILL_TRILU(W)                                                                                    \
    extern "C" __global__ void fill_w##W(Word<W>::type* dst, int64_t bits, int64_t n) {                    \
        Word<W>::type f;                                                                                    \
        memcpy(&f, &bits, W);                                                                               \
        GG_GRID_STRIDE(i, n) { dst[i] = f; }                                                                \
    }                                                                                                       \
    extern "C" __global__ void trilu_w##W(Word<W>::type* dst, const Word<W>::type* src, int64_t rows,      \
                                          int64_t cols, int64_t k, int64_t upper, int64_t n) {              \
        trilu<Word<W>::type>(dst, src, rows, cols, k, upper, n);                                            \
    }

GG_FILL_TRILU(1)
GG_FILL_TRILU(2)
GG_FILL_TRILU(4)
GG_FILL_TRILU(8)

template <typename E, typename L>
__device__ __forceinline__ void reverse_sequence(E* __restrict__ dst, const E* __restrict__ src, const L* __restrict__ lens,
                                                 long long* flag, int64_t steps, int64_t batch, int64_t inner,
                                                 int64_t time_first, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t k = i % inner, r = i / inner;
        const int64_t t = time_first ? r / batch : r % steps;
        const int64_t b = time_first ? r % batch : r / steps;
        const int64_t len = (int64_t)lens[b];
        if (len < 0 || len > steps) {
            *flag = 1;
            continue;
        }
        const int64_t s = t < len ? len - 1 - t : t;
        dst[i] = src[((time_first ? s * batch + b : b * steps + s)) * inner + k];
    }
}

#define GG_REVERSE_SEQUENCE(W)                                                                              \
    extern "C" __global__ void reverse_sequence_w##W##_i32(Word<W>::type* dst, const Word<W>::type* src,   \
                                                           const int32_t* lens, long long* flag,            \
                                                           int64_t steps, int64_t batch, int64_t inner,     \
                                                           int64_t time_first, int64_t n) {                 \
        reverse_sequence<Word<W>::type, int32_t>(dst, src, lens, flag, steps, batch, inner, time_first, n); \
    }                                                                                                       \
    extern "C" __global__ void reverse_sequence_w##W##_i64(Word<W>::type* dst, const Word<W>::type* src,   \
                                                           const int64_t* lens, long long* flag,            \
                                                           int64_t steps, int64_t batch, int64_t inner,     \
                                                           int64_t time_first, int64_t n) {                 \
        reverse_sequence<Word<W>::type, int64_t>(dst, src, lens, flag, steps, batch, inner, time_first, n); \
    }

GG_REVERSE_SEQUENCE(1)
GG_REVERSE_SEQUENCE(2)
GG_REVERSE_SEQUENCE(4)
GG_REVERSE_SEQUENCE(8)
GG_REVERSE_SEQUENCE(16)

__device__ __forceinline__ float gg_range_value(float start, float delta, int64_t i) {
    return __fadd_rn(start, __fmul_rn((float)i, delta));
}
__device__ __forceinline__ double gg_range_value(double start, double delta, int64_t i) {
    return __dadd_rn(start, __dmul_rn((double)i, delta));
}

#define GG_RANGE_FLOAT(suffix, T)                                                                           \
    extern "C" __global__ void range_##suffix(T* out, double start, double delta, int64_t n) {             \
        using C = typename Acc<T>::type;                                                                    \
        GG_GRID_STRIDE(i, n) { gg_store(out + i, gg_range_value((C)start, (C)delta, i)); }                  \
    }
#define GG_RANGE_INT(suffix, T)                                                                             \
    extern "C" __global__ void range_##suffix(T* out, int64_t start, int64_t delta, int64_t n) {           \
        GG_GRID_STRIDE(i, n) {                                                                              \
            out[i] = (T)(int64_t)((unsigned long long)start + (unsigned long long)i * (unsigned long long)delta); \
        }                                                                                                   \
    }

GG_RANGE_FLOAT(f16, __half)
GG_RANGE_FLOAT(bf16, __nv_bfloat16)
GG_RANGE_FLOAT(f32, float)
GG_RANGE_FLOAT(f64, double)
GG_RANGE_INT(i32, int32_t)
GG_RANGE_INT(i64, int64_t)
