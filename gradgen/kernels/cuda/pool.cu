// Pooling: MaxPool, AveragePool, the global pools (row reductions), MaxRoiPool and Resize.
// Entry points: extern "C" <op>_<dtype suffix>, e.g. max_pool_f32.
//
// Spatial ops work on up to 3 spatial axes; launchers pad lower ranks with unit axes (kernel 1,
// stride 1, dilation 1, no padding). Every kernel writes each output element from one thread (or
// one block, for the reductions) in a fixed order: results are deterministic, no float atomics.
#include "common.h"

#define GG_SP 3

// Geometry of a pooling: (N*C) planes of `in` -> planes of `out`.
struct PoolGeom {
    int64_t nc;
    int64_t in[GG_SP], out[GG_SP], k[GG_SP], s[GG_SP], d[GG_SP], pb[GG_SP];
    int64_t lo[GG_SP], hi[GG_SP];  // AveragePool: taps counted in the divisor lie in [lo, hi)
    int64_t storage_order;          // MaxPool Indices: 0 row-major, 1 column-major per plane
};

template <typename T> __device__ __forceinline__ typename Acc<T>::type gg_lowest();
template <> __device__ __forceinline__ float gg_lowest<__half>() { return -INFINITY; }
template <> __device__ __forceinline__ float gg_lowest<__nv_bfloat16>() { return -INFINITY; }
template <> __device__ __forceinline__ float gg_lowest<float>() { return -INFINITY; }
template <> __device__ __forceinline__ double gg_lowest<double>() { return -INFINITY; }

template <typename A> __device__ __forceinline__ bool gg_isnan(A v) { return v != v; }

// Output element i of a pooling: its (N*C) plane nc, its coordinates (o0, o1, o2) in the output
// plane, and (returned) where its input plane starts in x.
template <typename T>
__device__ __forceinline__ const T* pool_position(const T* x, int64_t i, const PoolGeom& g, int64_t plane_in,
                                                  int64_t plane_out, int64_t& nc, int64_t& o0, int64_t& o1, int64_t& o2) {
    nc = i / plane_out;
    gg_unravel3(i % plane_out, g.out, o0, o1, o2);
    return x + nc * plane_in;
}

// ------------------------------------------------------------------------------ MaxPool
// y[nc, o] = max over the window; idx (when not null) = flat position of the first maximum in X
// (batch and channel included), taps in the padding counting as -inf at their clipped position.
template <typename T>
__device__ void max_pool(T* y, int64_t* idx, const T* x, const PoolGeom& g, int64_t n) {
    using A = typename Acc<T>::type;
    const int64_t plane_in = gg_volume3(g.in), plane_out = gg_volume3(g.out);
    GG_GRID_STRIDE(i, n) {
        int64_t nc, o0, o1, o2;
        const T* xp = pool_position(x, i, g, plane_in, plane_out, nc, o0, o1, o2);
        A best = 0;
        int64_t best_pos = 0;
        bool first = true;
        for (int64_t a = 0; a < g.k[0]; ++a) {
            int64_t p0 = o0 * g.s[0] - g.pb[0] + a * g.d[0];
            bool in0 = p0 >= 0 && p0 < g.in[0];
            int64_t c0 = p0 < 0 ? 0 : (p0 >= g.in[0] ? g.in[0] - 1 : p0);
            for (int64_t b = 0; b < g.k[1]; ++b) {
                int64_t p1 = o1 * g.s[1] - g.pb[1] + b * g.d[1];
                bool in1 = p1 >= 0 && p1 < g.in[1];
                int64_t c1 = p1 < 0 ? 0 : (p1 >= g.in[1] ? g.in[1] - 1 : p1);
                for (int64_t c = 0; c < g.k[2]; ++c) {
                    int64_t p2 = o2 * g.s[2] - g.pb[2] + c * g.d[2];
                    bool in2 = p2 >= 0 && p2 < g.in[2];
                    int64_t c2 = p2 < 0 ? 0 : (p2 >= g.in[2] ? g.in[2] - 1 : p2);
                    A v = (in0 && in1 && in2) ? gg_load(xp + gg_ravel3(p0, p1, p2, g.in)) : gg_lowest<T>();
                    bool take = first || (!gg_isnan(best) && (gg_isnan(v) || v > best));
                    if (take) {
                        best = v;
                        best_pos = g.storage_order ? (c2 * g.in[1] + c1) * g.in[0] + c0 : gg_ravel3(c0, c1, c2, g.in);
                        first = false;
                    }
                }
            }
        }
        gg_store(y + i, best);
        if (idx) idx[i] = nc * plane_in + best_pos;
    }
}

// ------------------------------------------------------------------------------ AveragePool
template <typename T>
__device__ void avg_pool(T* y, const T* x, const PoolGeom& g, int64_t n) {
    using A = typename Acc<T>::type;
    const int64_t plane_in = gg_volume3(g.in), plane_out = gg_volume3(g.out);
    GG_GRID_STRIDE(i, n) {
        int64_t nc, o0, o1, o2;
        const T* xp = pool_position(x, i, g, plane_in, plane_out, nc, o0, o1, o2);
        A total = 0;
        int64_t count = 0;
        for (int64_t a = 0; a < g.k[0]; ++a) {
            int64_t p0 = o0 * g.s[0] - g.pb[0] + a * g.d[0];
            bool in0 = p0 >= 0 && p0 < g.in[0];
            bool n0 = p0 >= g.lo[0] && p0 < g.hi[0];
            for (int64_t b = 0; b < g.k[1]; ++b) {
                int64_t p1 = o1 * g.s[1] - g.pb[1] + b * g.d[1];
                bool in1 = p1 >= 0 && p1 < g.in[1];
                bool n1 = p1 >= g.lo[1] && p1 < g.hi[1];
                for (int64_t c = 0; c < g.k[2]; ++c) {
                    int64_t p2 = o2 * g.s[2] - g.pb[2] + c * g.d[2];
                    bool in2 = p2 >= 0 && p2 < g.in[2];
                    bool n2 = p2 >= g.lo[2] && p2 < g.hi[2];
                    if (in0 && in1 && in2) total += gg_load(xp + gg_ravel3(p0, p1, p2, g.in));
                    if (n0 && n1 && n2) ++count;
                }
            }
        }
        gg_store(y + i, total / (A)count);
    }
}

// ------------------------------------------------------------------------------ row reductions
// One block per row of `cols` contiguous elements: mean (mode 0), max (mode 1), sum (mode 2).
template <typename T>
__device__ void row_reduce(T* y, const T* x, int64_t rows, int64_t cols, int mode) {
    using A = typename Acc<T>::type;
    __shared__ A shared[256];
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xp = x + row * cols;
        A acc = mode == 1 ? gg_lowest<T>() : (A)0;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            A v = gg_load(xp + j);
            if (mode == 1) acc = (gg_isnan(acc) || v > acc || gg_isnan(v)) ? (gg_isnan(acc) ? acc : v) : acc;
            else acc += v;
        }
        shared[threadIdx.x] = acc;
        __syncthreads();
        for (int width = blockDim.x / 2; width > 0; width /= 2) {
            if (threadIdx.x < width) {
                A a = shared[threadIdx.x], b = shared[threadIdx.x + width];
                if (mode == 1) shared[threadIdx.x] = (gg_isnan(a) || gg_isnan(b)) ? (gg_isnan(a) ? a : b) : (b > a ? b : a);
                else shared[threadIdx.x] = a + b;
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) gg_store(y + row, mode == 0 ? shared[0] / (A)cols : shared[0]);
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------ entry points
#define GG_POOL_ENTRIES(sfx, T)                                                                            \
    extern "C" __global__ void max_pool_##sfx(T* y, int64_t* idx, const T* x, PoolGeom g, int64_t n) {     \
        max_pool(y, idx, x, g, n);                                                                         \
    }                                                                                                      \
    extern "C" __global__ void avg_pool_##sfx(T* y, const T* x, PoolGeom g, int64_t n) {                   \
        avg_pool(y, x, g, n);                                                                              \
    }                                                                                                      \
    extern "C" __global__ void row_reduce_##sfx(T* y, const T* x, int64_t rows, int64_t cols, int64_t mode) { \
        row_reduce(y, x, rows, cols, (int)mode);                                                           \
    }

GG_POOL_ENTRIES(f16, __half)
GG_POOL_ENTRIES(bf16, __nv_bfloat16)
GG_POOL_ENTRIES(f32, float)
GG_POOL_ENTRIES(f64, double)

// ------------------------------------------------------------------------------ MaxRoiPool
// y[r, c, ph, pw] = max of x[b, c] over roi r's bin (ph, pw), 0 for an empty bin, a NaN winning
// (numpy's max), as the CPU kernel computes it: the roi (b, x1, y1, x2, y2), in x's type, has its
// coordinates scaled and rounded half away from zero in float32, and its bins' bounds computed in
// float32 with explicitly rounded operations (no FMA contraction), then clamped to the image. A
// batch index b (truncated toward zero) outside [0, images) sets *flag and gives 0.

// float32(v) * scale rounded half away from zero (the CPU kernel's round_away).
__device__ __forceinline__ float roi_coordinate(float v, float scale) {
    const float c = __fmul_rn(v, scale);
    return copysignf(floorf(__fadd_rn(fabsf(c), 0.5f)), c);
}

__device__ __forceinline__ int64_t roi_clamp(float v, int64_t size) { return (int64_t)fminf(fmaxf(v, 0.0f), (float)size); }

// Bin p of `pooled` over the roi axis [start, end] (inclusive): pixels [lo, hi) of an axis of `size`.
__device__ __forceinline__ void roi_bin(float start, float end, int64_t pooled, int64_t p, int64_t size, int64_t& lo,
                                        int64_t& hi) {
    const float step = __fdiv_rn(fmaxf(__fadd_rn(__fsub_rn(end, start), 1.0f), 1.0f), (float)pooled);
    lo = roi_clamp(__fadd_rn(floorf(__fmul_rn((float)p, step)), start), size);
    hi = roi_clamp(__fadd_rn(ceilf(__fmul_rn((float)(p + 1), step)), start), size);
}

template <typename T>
__device__ void max_roi_pool(T* y, int64_t* flag, const T* x, const T* rois, int64_t images, int64_t channels,
                             int64_t height, int64_t width, int64_t pooled_h, int64_t pooled_w, float scale, int64_t n) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(i, n) {
        const int64_t pw = i % pooled_w, ph = (i / pooled_w) % pooled_h;
        const int64_t c = (i / (pooled_w * pooled_h)) % channels, r = i / (pooled_w * pooled_h * channels);
        const T* roi = rois + r * 5;
        const double b = (double)gg_load(roi);
        if (!(b > -1.0 && b < (double)images)) {  // NaN included
            *flag = 1;
            gg_store(y + i, (A)0);
            continue;
        }
        int64_t h0, h1, w0, w1;
        roi_bin(roi_coordinate((float)gg_load(roi + 2), scale), roi_coordinate((float)gg_load(roi + 4), scale), pooled_h, ph,
                height, h0, h1);
        roi_bin(roi_coordinate((float)gg_load(roi + 1), scale), roi_coordinate((float)gg_load(roi + 3), scale), pooled_w, pw,
                width, w0, w1);
        const T* plane = x + ((int64_t)b * channels + c) * height * width;
        A best = 0;
        bool first = true;
        for (int64_t h = h0; h < h1; ++h) {
            for (int64_t w = w0; w < w1; ++w) {
                const A v = gg_load(plane + h * width + w);
                if (first || (!gg_isnan(best) && (gg_isnan(v) || v > best))) {
                    best = v;
                    first = false;
                }
            }
        }
        gg_store(y + i, best);
    }
}

#define GG_MAX_ROI_POOL(sfx, T)                                                                                      \
    extern "C" __global__ void max_roi_pool_##sfx(T* y, int64_t* flag, const T* x, const T* rois, int64_t images,     \
                                                  int64_t channels, int64_t height, int64_t width, int64_t pooled_h,  \
                                                  int64_t pooled_w, double scale, int64_t n) {                        \
        max_roi_pool(y, flag, x, rois, images, channels, height, width, pooled_h, pooled_w, (float)scale, n);         \
    }
GG_MAX_ROI_POOL(f16, __half)
GG_MAX_ROI_POOL(bf16, __nv_bfloat16)
GG_MAX_ROI_POOL(f32, float)
GG_MAX_ROI_POOL(f64, double)

// ------------------------------------------------------------------------------ Resize
// Nearest: one gather pass. out.shape = output dims, out.strides = the input's (C-order) strides;
// table holds, per axis d (from offs.shape[d]), the input coordinate of each output coordinate, or
// -1 outside a tf_crop_and_resize crop, where the output takes `fill` (the extrapolation value's
// bits). Moves bits: W-byte elements.
template <int W>
__device__ __forceinline__ void resize_nearest(typename Word<W>::type* __restrict__ dst,
                                               const typename Word<W>::type* __restrict__ src,
                                               const int64_t* __restrict__ table, const TensorDesc& out,
                                               const TensorDesc& offs, int64_t fill, int64_t n) {
    using E = typename Word<W>::type;
    E f;
    memcpy(&f, &fill, W);
    GG_GRID_STRIDE(i, n) {
        int64_t rest = i, so = 0;
        bool inside = true;
        for (int d = (int)out.rank - 1; d >= 0; --d) {
            const int64_t c = rest % out.shape[d];
            rest /= out.shape[d];
            const int64_t q = table[offs.shape[d] + c];
            inside = inside && q >= 0;
            so += q * out.strides[d];
        }
        dst[i] = inside ? src[so] : f;
    }
}

#define GG_RESIZE_NEAREST(W)                                                                                 \
    extern "C" __global__ void resize_nearest_w##W(Word<W>::type* dst, const Word<W>::type* src,            \
                                                   const int64_t* table, TensorDesc out, TensorDesc offs,   \
                                                   int64_t fill, int64_t n) {                               \
        resize_nearest<W>(dst, src, table, out, offs, fill, n);                                              \
    }
GG_RESIZE_NEAREST(1)
GG_RESIZE_NEAREST(2)
GG_RESIZE_NEAREST(4)
GG_RESIZE_NEAREST(8)

// Linear and cubic (any coordinate mode, antialias): one axis per pass, as the CPU kernel applies
// one matrix per axis. x viewed as (outer, n_in, inner) -> y (outer, n_out, inner); output row j
// is sum_t w[j * taps + t] * x[idx[j * taps + t]] in double, taps of weight 0 skipped, in tap order;
// idx[j * taps] = -1 marks a row outside a tf_crop_and_resize crop (it takes `fill`). Intermediate
// passes write double; the last rounds to the output type (16-bit types through float32, as the CPU
// backend computes them in float32).
template <typename TI, typename TO>
__device__ __forceinline__ void resize_taps(TO* __restrict__ dst, const TI* __restrict__ src, const int64_t* __restrict__ idx,
                                            const double* __restrict__ w, int64_t taps, int64_t n_in, int64_t n_out,
                                            int64_t inner, double fill, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        const int64_t k = i % inner, r = i / inner;
        const int64_t j = r % n_out, o = r / n_out;
        const int64_t* ix = idx + j * taps;
        const double* wx = w + j * taps;
        double acc = 0.0;
        if (ix[0] < 0) {
            acc = fill;
        } else {
            const TI* line = src + o * n_in * inner + k;
            for (int64_t t = 0; t < taps; ++t) {
                if (wx[t] != 0.0) acc += wx[t] * (double)gg_load(line + ix[t] * inner);
            }
        }
        if constexpr (sizeof(TO) == 2) gg_store(dst + i, (float)acc);
        else dst[i] = (TO)acc;
    }
}

#define GG_RESIZE_TAPS(SI, TI, SO, TO)                                                                         \
    extern "C" __global__ void resize_taps_##SI##_##SO(TO* dst, const TI* src, const int64_t* idx, const double* w, \
                                                      int64_t taps, int64_t n_in, int64_t n_out, int64_t inner,   \
                                                      double fill, int64_t n) {                                   \
        resize_taps<TI, TO>(dst, src, idx, w, taps, n_in, n_out, inner, fill, n);                                \
    }
GG_RESIZE_TAPS(f16, __half, f16, __half)
GG_RESIZE_TAPS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)
GG_RESIZE_TAPS(f32, float, f32, float)
GG_RESIZE_TAPS(f64, double, f64, double)
GG_RESIZE_TAPS(f16, __half, f64, double)
GG_RESIZE_TAPS(bf16, __nv_bfloat16, f64, double)
GG_RESIZE_TAPS(f32, float, f64, double)
GG_RESIZE_TAPS(f64, double, f16, __half)
GG_RESIZE_TAPS(f64, double, bf16, __nv_bfloat16)
GG_RESIZE_TAPS(f64, double, f32, float)
