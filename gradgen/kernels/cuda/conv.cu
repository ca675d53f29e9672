// Direct convolution kernels (conv.py), used where cuDNN declines a configuration (and for float64
// when it does), and the conv launchers' device helpers: the padding window copy, the deterministic
// per-channel sums (dB) and the bias add. Entry points: conv_fwd/conv_dgrad/conv_wgrad_<dtype suffix>, e.g. conv_fwd_f32.
// Up to 3 spatial axes; the launcher pads lower ranks with unit axes. Every kernel writes each output
// element from one thread (or one block, for dW) in a fixed order: deterministic, no float atomics.
#include "common.h"

#define GG_SP 3

// Geometry of a convolution (NC* layout, W is (M, C/G, *k)).
struct ConvGeom {
    int64_t n, c, m, g;
    int64_t in[GG_SP], out[GG_SP], k[GG_SP], s[GG_SP], d[GG_SP], pb[GG_SP];
};

// What the direct kernels derive from a geometry: channels and filters per group, the input and
// output plane sizes, the taps of a filter.
struct ConvSizes {
    int64_t cg, mg, plane_in, plane_out, taps;
};
__device__ __forceinline__ ConvSizes conv_sizes(const ConvGeom& g) {
    return {g.c / g.g, g.m / g.g, gg_volume3(g.in), gg_volume3(g.out), gg_volume3(g.k)};
}

// ------------------------------------------------------------------------------ direct convolution
// Used where cuDNN declines a configuration (and for float64 when it does). y: one thread per output.
template <typename T>
__device__ void conv_fwd(T* y, const T* x, const T* w, const ConvGeom& g, int64_t n) {
    using A = typename Acc<T>::type;
    const auto [cg, mg, plane_in, plane_out, taps] = conv_sizes(g);
    GG_GRID_STRIDE(i, n) {
        int64_t r = i % plane_out;
        int64_t m = (i / plane_out) % g.m;
        int64_t b = i / (plane_out * g.m);
        int64_t o0, o1, o2;
        gg_unravel3(r, g.out, o0, o1, o2);
        int64_t group = m / mg;
        A acc = 0;
        for (int64_t cc = 0; cc < cg; ++cc) {
            const T* xp = x + (b * g.c + group * cg + cc) * plane_in;
            const T* wp = w + (m * cg + cc) * taps;
            for (int64_t a = 0; a < g.k[0]; ++a) {
                int64_t p0 = o0 * g.s[0] - g.pb[0] + a * g.d[0];
                if (p0 < 0 || p0 >= g.in[0]) continue;
                for (int64_t bb = 0; bb < g.k[1]; ++bb) {
                    int64_t p1 = o1 * g.s[1] - g.pb[1] + bb * g.d[1];
                    if (p1 < 0 || p1 >= g.in[1]) continue;
                    for (int64_t c = 0; c < g.k[2]; ++c) {
                        int64_t p2 = o2 * g.s[2] - g.pb[2] + c * g.d[2];
                        if (p2 < 0 || p2 >= g.in[2]) continue;
                        acc += gg_load(xp + gg_ravel3(p0, p1, p2, g.in)) * gg_load(wp + gg_ravel3(a, bb, c, g.k));
                    }
                }
            }
        }
        gg_store(y + i, acc);
    }
}

// dx: one thread per input element, gathering every (filter, tap) whose window covers it.
template <typename T>
__device__ void conv_dgrad(T* dx, const T* dy, const T* w, const ConvGeom& g, int64_t n) {
    using A = typename Acc<T>::type;
    const auto [cg, mg, plane_in, plane_out, taps] = conv_sizes(g);
    GG_GRID_STRIDE(i, n) {
        int64_t r = i % plane_in;
        int64_t ch = (i / plane_in) % g.c;
        int64_t b = i / (plane_in * g.c);
        int64_t i0, i1, i2;
        gg_unravel3(r, g.in, i0, i1, i2);
        int64_t group = ch / cg, cc = ch % cg;
        A acc = 0;
        for (int64_t mm = 0; mm < mg; ++mm) {
            int64_t m = group * mg + mm;
            const T* dyp = dy + (b * g.m + m) * plane_out;
            const T* wp = w + (m * cg + cc) * taps;
            for (int64_t a = 0; a < g.k[0]; ++a) {
                int64_t q0 = i0 + g.pb[0] - a * g.d[0];
                if (q0 < 0 || q0 % g.s[0]) continue;
                q0 /= g.s[0];
                if (q0 >= g.out[0]) continue;
                for (int64_t bb = 0; bb < g.k[1]; ++bb) {
                    int64_t q1 = i1 + g.pb[1] - bb * g.d[1];
                    if (q1 < 0 || q1 % g.s[1]) continue;
                    q1 /= g.s[1];
                    if (q1 >= g.out[1]) continue;
                    for (int64_t c = 0; c < g.k[2]; ++c) {
                        int64_t q2 = i2 + g.pb[2] - c * g.d[2];
                        if (q2 < 0 || q2 % g.s[2]) continue;
                        q2 /= g.s[2];
                        if (q2 >= g.out[2]) continue;
                        acc += gg_load(dyp + gg_ravel3(q0, q1, q2, g.out)) * gg_load(wp + gg_ravel3(a, bb, c, g.k));
                    }
                }
            }
        }
        gg_store(dx + i, acc);
    }
}

// dw: one block per weight element, reducing over batch and output positions in a fixed order.
template <typename T>
__device__ void conv_wgrad(T* dw, const T* x, const T* dy, const ConvGeom& g, int64_t n) {
    using A = typename Acc<T>::type;
    __shared__ A shared[256];
    const auto [cg, mg, plane_in, plane_out, taps] = conv_sizes(g);
    const int64_t total = g.n * plane_out;
    for (int64_t e = blockIdx.x; e < n; e += gridDim.x) {
        int64_t tap = e % taps;
        int64_t cc = (e / taps) % cg;
        int64_t m = e / (taps * cg);
        int64_t group = m / mg;
        int64_t ka, kb, kc;
        gg_unravel3(tap, g.k, ka, kb, kc);
        A acc = 0;
        for (int64_t j = threadIdx.x; j < total; j += blockDim.x) {
            int64_t b = j / plane_out, r = j % plane_out;
            int64_t o0, o1, o2;
            gg_unravel3(r, g.out, o0, o1, o2);
            int64_t p0 = o0 * g.s[0] - g.pb[0] + ka * g.d[0];
            int64_t p1 = o1 * g.s[1] - g.pb[1] + kb * g.d[1];
            int64_t p2 = o2 * g.s[2] - g.pb[2] + kc * g.d[2];
            if (p0 < 0 || p0 >= g.in[0] || p1 < 0 || p1 >= g.in[1] || p2 < 0 || p2 >= g.in[2]) continue;
            acc += gg_load(dy + (b * g.m + m) * plane_out + r) *
                   gg_load(x + (b * g.c + group * cg + cc) * plane_in + gg_ravel3(p0, p1, p2, g.in));
        }
        shared[threadIdx.x] = acc;
        __syncthreads();
        for (int width = blockDim.x / 2; width > 0; width /= 2) {
            if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
            __syncthreads();
        }
        if (threadIdx.x == 0) gg_store(dw + e, shared[0]);
        __syncthreads();
    }
}

// ------------------------------------------------------------------------------ helpers
// Sum over every axis but 1 of an (outer, c, inner) tensor, in two deterministic passes: block
// (ch, s) sums rows [s*outer/splits, (s+1)*outer/splits) of channel ch into partial[ch*splits+s];
// then one thread per channel adds its `splits` partials in order.
template <typename T>
__device__ void channel_partial(typename Acc<T>::type* partial, const T* x, int64_t outer, int64_t c, int64_t inner,
                                int64_t splits) {
    using A = typename Acc<T>::type;
    __shared__ A shared[256];
    for (int64_t blk = blockIdx.x; blk < c * splits; blk += gridDim.x) {
        int64_t ch = blk / splits, s = blk % splits;
        int64_t lo = s * outer / splits, hi = (s + 1) * outer / splits;
        int64_t total = (hi - lo) * inner;
        A acc = 0;
        if (inner >= (int64_t)blockDim.x || inner * outer > (int64_t)0x7fffffff) {
            for (int64_t o = lo; o < hi; ++o) {
                const T* row = x + (o * c + ch) * inner;
                for (int64_t r = threadIdx.x; r < inner; r += blockDim.x) acc += gg_load(row + r);
            }
        } else {
            const int in32 = (int)inner;
            for (int j = threadIdx.x; j < (int)total; j += blockDim.x) {
                int o = j / in32, r = j - o * in32;
                acc += gg_load(x + ((lo + o) * c + ch) * inner + r);
            }
        }
        shared[threadIdx.x] = acc;
        __syncthreads();
        for (int width = blockDim.x / 2; width > 0; width /= 2) {
            if (threadIdx.x < width) shared[threadIdx.x] += shared[threadIdx.x + width];
            __syncthreads();
        }
        if (threadIdx.x == 0) partial[blk] = shared[0];
        __syncthreads();
    }
}

template <typename T>
__device__ void channel_finish(T* y, const typename Acc<T>::type* partial, int64_t c, int64_t splits) {
    using A = typename Acc<T>::type;
    GG_GRID_STRIDE(ch, c) {
        A acc = 0;
        for (int64_t s = 0; s < splits; ++s) acc += partial[ch * splits + s];
        gg_store(y + ch, acc);
    }
}

// y[i] += b[(i / inner) % c] (in place; the conv bias).
template <typename T>
__device__ void add_channel_bias(T* y, const T* b, int64_t c, int64_t inner, int64_t n) {
    GG_GRID_STRIDE(i, n) { gg_store(y + i, gg_load(y + i) + gg_load(b + (i / inner) % c)); }
}

// out (C-contiguous, shape out_shape) [o] = in[o + shift] read through in_view's strides where every
// coordinate lies inside in_view's shape, else 0. shift == 0 and zero strides: a broadcast copy.
template <typename T>
__device__ void window_copy(T* out, const T* in, const TensorDesc& out_shape, const TensorDesc& in_view,
                            const TensorDesc& shift, int64_t n) {
    GG_GRID_STRIDE(i, n) {
        int64_t rest = i, offset = 0;
        bool inside = true;
        for (int dim = (int)out_shape.rank - 1; dim >= 0; --dim) {
            int64_t coord = rest % out_shape.shape[dim] + shift.shape[dim];
            rest /= out_shape.shape[dim];
            if (coord < 0 || coord >= in_view.shape[dim]) inside = false;
            offset += coord * in_view.strides[dim];
        }
        out[i] = inside ? in[offset] : T(0);
    }
}

// ------------------------------------------------------------------------------ entry points
#define GG_CONV_ENTRIES(sfx, T)                                                                            \
    extern "C" __global__ void conv_fwd_##sfx(T* y, const T* x, const T* w, ConvGeom g, int64_t n) {       \
        conv_fwd(y, x, w, g, n);                                                                           \
    }                                                                                                      \
    extern "C" __global__ void conv_dgrad_##sfx(T* dx, const T* dy, const T* w, ConvGeom g, int64_t n) {   \
        conv_dgrad(dx, dy, w, g, n);                                                                       \
    }                                                                                                      \
    extern "C" __global__ void conv_wgrad_##sfx(T* dw, const T* x, const T* dy, ConvGeom g, int64_t n) {   \
        conv_wgrad(dw, x, dy, g, n);                                                                       \
    }

GG_CONV_ENTRIES(f16, __half)
GG_CONV_ENTRIES(bf16, __nv_bfloat16)
GG_CONV_ENTRIES(f32, float)
GG_CONV_ENTRIES(f64, double)

#define GG_CHANNEL_ENTRIES(sfx, T)                                                                          \
    extern "C" __global__ void channel_partial_##sfx(typename Acc<T>::type* partial, const T* x, int64_t outer, \
                                                     int64_t c, int64_t inner, int64_t splits) {           \
        channel_partial(partial, x, outer, c, inner, splits);                                              \
    }                                                                                                      \
    extern "C" __global__ void channel_finish_##sfx(T* y, const typename Acc<T>::type* partial, int64_t c,  \
                                                    int64_t splits) {                                      \
        channel_finish(y, partial, c, splits);                                                             \
    }                                                                                                      \
    extern "C" __global__ void add_channel_bias_##sfx(T* y, const T* b, int64_t c, int64_t inner, int64_t n) { \
        add_channel_bias(y, b, c, inner, n);                                                               \
    }

GG_CHANNEL_ENTRIES(f16, __half)
GG_CHANNEL_ENTRIES(bf16, __nv_bfloat16)
GG_CHANNEL_ENTRIES(f32, float)
GG_CHANNEL_ENTRIES(f64, double)

// An empty kernel: launched on the default stream, it orders later work after the side streams.
extern "C" __global__ void noop(int64_t unused) {}

#define GG_COPY_ENTRY(sfx, T)                                                                               \
    extern "C" __global__ void window_copy_##sfx(T* out, const T* in, TensorDesc out_shape, TensorDesc in_view, \
                                                  TensorDesc shift, int64_t n) {                            \
        window_copy(out, in, out_shape, in_view, shift, n);                                                 \
    }

GG_COPY_ENTRY(f16, __half)
GG_COPY_ENTRY(bf16, __nv_bfloat16)
GG_COPY_ENTRY(f32, float)
GG_COPY_ENTRY(f64, double)
GG_COPY_ENTRY(i32, int32_t)
GG_COPY_ENTRY(i64, int64_t)
