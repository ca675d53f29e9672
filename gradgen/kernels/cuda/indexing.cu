// Indexing kernels: Gather, GatherElements, GatherND. They move bits: entry points are suffixed by
// the element WIDTH in bytes (w1..w16; the launchers move contiguous runs as wider words) and the
// index type (i32, i64). Negative indices are normalised; an out-of-range index writes nothing and
// sets *flag to its position + 1 (the launcher then raises the CPU kernel's error).
// (ScatterElements and ScatterND use the deterministic scatters of microsoft.cu.)
#include "common.h"

template <int W> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = unsigned long long; };
template <> struct Word<16> { using type = uint4; };

template <typename IDX>
__device__ __forceinline__ bool ix_norm(IDX v, int64_t size, int64_t& out) {
    int64_t x = (int64_t)v;
    if (x < 0) x += size;
    out = x;
    return x >= 0 && x < size;
}

__device__ __forceinline__ void ix_flag(long long* flag, int64_t position) {
    atomicCAS(reinterpret_cast<unsigned long long*>(flag), 0ull, (unsigned long long)(position + 1));
}

// out (outer, count, inner) = data (outer, size, inner) at idx along the middle axis.
template <typename E, typename IDX>
__device__ void gather(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx, long long* flag,
                       int64_t count, int64_t size, int64_t inner, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t c = i % inner, rest = i / inner;
        const int64_t j = rest % count, o = rest / count;
        int64_t x;
        if (ix_norm(idx[j], size, x)) out[i] = data[(o * size + x) * inner + c];
        else ix_flag(flag, j);
    }
}

// out has the indices' shape d.shape; d.strides are data's strides.
template <typename E, typename IDX>
__device__ void gather_elements(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx,
                                long long* flag, TensorDesc d, int64_t axis, int64_t size, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        int64_t rest = i, off = 0;
        bool ok = true;
        for (int k = (int)d.rank - 1; k >= 0; --k) {
            int64_t c = rest % d.shape[k];
            rest /= d.shape[k];
            if (k == axis) ok = ix_norm(idx[i], size, c);
            off += c * d.strides[k];
        }
        if (ok) out[i] = data[off];
        else ix_flag(flag, i);
    }
}

// out (B, M, inner) = data[b, idx[b, m, 0..k-1], :]; kd.shape = sizes of the indexed axes,
// kd.strides = their strides in data (in words); batch_stride = data words per batch.
template <typename E, typename IDX>
__device__ void gather_nd(E* __restrict__ out, const E* __restrict__ data, const IDX* __restrict__ idx,
                          long long* flag, TensorDesc kd, int64_t M, int64_t inner, int64_t batch_stride, int64_t n) {
    const int k = (int)kd.rank;
    GG_GRID_STRIDE(i, n) {
        const int64_t c = i % inner, bm = i / inner, b = bm / M;
        int64_t off = b * batch_stride + c;
        bool ok = true;
        for (int t = 0; t < k; ++t) {
            int64_t x;
            ok = ix_norm(idx[bm * k + t], kd.shape[t], x) && ok;
            off += x * kd.strides[t];
        }
        if (ok) out[i] = data[off];
        else ix_flag(flag, bm * k);
    }
}

#define GG_INDEXING(W, isfx, IDX)                                                                              \
    extern "C" __global__ void gather_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,             \
                                                    const IDX* idx, long long* flag, int64_t count,            \
                                                    int64_t size, int64_t inner, int64_t n) {                  \
        gather(out, data, idx, flag, count, size, inner, n);                                                   \
    }                                                                                                          \
    extern "C" __global__ void gather_elements_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,    \
                                                             const IDX* idx, long long* flag, TensorDesc d,    \
                                                             int64_t axis, int64_t size, int64_t n) {          \
        gather_elements(out, data, idx, flag, d, axis, size, n);                                               \
    }                                                                                                          \
    extern "C" __global__ void gather_nd_w##W##_##isfx(Word<W>::type* out, const Word<W>::type* data,          \
                                                       const IDX* idx, long long* flag, TensorDesc kd,         \
                                                       int64_t M, int64_t inner, int64_t batch_stride, int64_t n) { \
        gather_nd(out, data, idx, flag, kd, M, inner, batch_stride, n);                                        \
    }

#define GG_INDEXING_W(W) GG_INDEXING(W, i32, int32_t) GG_INDEXING(W, i64, int64_t)
GG_INDEXING_W(1)
GG_INDEXING_W(2)
GG_INDEXING_W(4)
GG_INDEXING_W(8)
GG_INDEXING_W(16)
