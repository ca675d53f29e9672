// Elementwise kernels: broadcasting binary ops, Where, variadic Sum/Max/Min, unary ops, Cast, Clip.
// Entry points: extern "C" <op>_<dtype suffix>, e.g. add_f32, equal_f32 (bool out), pow_f32_i64,
// cast_f32_i64. The launchers (elementwise.py) drop size-1 dims and merge dims that are contiguous
// for every operand first, so the common same-shape case is rank 1 and needs no index arithmetic.
#define GG_PARTS 12  // compiled as 12 parts at once (common.h: GG_PART)
#include "common.h"
#include "pointwise.h"


// Offsets of flat C-order index i of `shape` through several operand views (one division per dim).
template <typename I, int K>
__device__ __forceinline__ void gg_offsets(I i, const TensorDesc& shape, const TensorDesc* const* views, int64_t* offs) {
#pragma unroll
    for (int k = 0; k < K; ++k) offs[k] = 0;
    for (int d = (int)shape.rank - 1; d > 0; --d) {
        I size = (I)shape.shape[d];
        I q = i / size;
        int64_t coord = (int64_t)(i - q * size);
        i = q;
#pragma unroll
        for (int k = 0; k < K; ++k) offs[k] += coord * views[k]->strides[d];
    }
    if (shape.rank > 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) offs[k] += (int64_t)i * views[k]->strides[0];
    }
}

// Runs body(i, offs) for every output index with the operands' offsets. Rank <= 1 needs no
// division; otherwise 32-bit index math when the element count allows.
template <int K, typename Body>
__device__ __forceinline__ void gg_for_each(const TensorDesc& shape, const TensorDesc* const* views, int64_t n, Body body) {
    int64_t offs[K];
    if (shape.rank <= 1) {
        GG_GRID_STRIDE(i, n) {
#pragma unroll
            for (int k = 0; k < K; ++k) offs[k] = shape.rank ? i * views[k]->strides[0] : 0;
            body(i, offs);
        }
    } else if (n <= 0xFFFFFFFFll) {
        for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (uint32_t)n; i += blockDim.x * gridDim.x) {
            gg_offsets<uint32_t, K>(i, shape, views, offs);
            body((int64_t)i, offs);
            if (i > 0xFFFFFFFFu - blockDim.x * gridDim.x) break;
        }
    } else {
        GG_GRID_STRIDE(i, n) {
            gg_offsets<int64_t, K>(i, shape, views, offs);
            body(i, offs);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// binary: out[i] = op(a[offset_a(i)], b[offset_b(i)]); `flag` (may be null) reports errors.
// vec != 0 (4-byte types only): the launcher passes the shape with its innermost dim divided by 4
// and inner strides times 4 (operands contiguous or broadcast there, 16-byte aligned), n / 4
// quads; each thread then moves 16 bytes per operand.

template <typename T> struct alignas(4 * sizeof(T)) Quad { T v[4]; };

template <typename TA, typename TB, typename TO, typename Op>
__device__ __forceinline__ void binary(TO* out, const TA* a, const TB* b, int64_t* flag, const TensorDesc& shape,
                                       const TensorDesc& av, const TensorDesc& bv, int64_t n, int64_t vec, Op op) {
    const TensorDesc* views[2] = {&av, &bv};
    if constexpr (sizeof(TA) == 4 && sizeof(TB) == 4 && sizeof(TO) == 4) {
        if (vec) {
            const int inner = (int)shape.rank - 1;
            const bool a_full = av.strides[inner] != 0, b_full = bv.strides[inner] != 0;
            gg_for_each<2>(shape, views, n, [&](int64_t q, const int64_t* offs) {
                Quad<TA> qa;
                Quad<TB> qb;
                Quad<TO> qo;
                if (a_full) qa = *reinterpret_cast<const Quad<TA>*>(a + offs[0]);
                else { const TA s = a[offs[0]]; qa.v[0] = qa.v[1] = qa.v[2] = qa.v[3] = s; }
                if (b_full) qb = *reinterpret_cast<const Quad<TB>*>(b + offs[1]);
                else { const TB s = b[offs[1]]; qb.v[0] = qb.v[1] = qb.v[2] = qb.v[3] = s; }
#pragma unroll
                for (int k = 0; k < 4; ++k) qo.v[k] = op(qa.v[k], qb.v[k], flag);
                *reinterpret_cast<Quad<TO>*>(out + 4 * q) = qo;
            });
            return;
        }
    }
    gg_for_each<2>(shape, views, n, [&](int64_t i, const int64_t* offs) {
        gg_store(out + i, op(gg_load(a + offs[0]), gg_load(b + offs[1]), flag));
    });
}

#define GG_BIN(name, TA, TB, TO, expr)                                                               \
    extern "C" __global__ void name(TO* out, const TA* a, const TB* b, int64_t* flag, TensorDesc shape, \
                                    TensorDesc av, TensorDesc bv, int64_t n, int64_t vec) {          \
        binary(out, a, b, flag, shape, av, bv, n, vec,                                               \
               [](typename Acc<TA>::type x, typename Acc<TB>::type y,                               \
                             int64_t* flag) -> typename Acc<TO>::type { return (expr); });            \
    }

#define GG_BIN_FLOATS(op, expr)                                                                          \
    GG_BIN(op##_f16, __half, __half, __half, expr) GG_BIN(op##_bf16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, expr) \
    GG_BIN(op##_f32, float, float, float, expr) GG_BIN(op##_f64, double, double, double, expr)
#define GG_BIN_INTS(op, expr) GG_BIN(op##_i32, int32_t, int32_t, int32_t, expr) GG_BIN(op##_i64, int64_t, int64_t, int64_t, expr)
#define GG_CMP(op, expr)                                                                          \
    GG_BIN(op##_f16, __half, __half, bool, expr) GG_BIN(op##_f32, float, float, bool, expr)        \
    GG_BIN(op##_bf16, __nv_bfloat16, __nv_bfloat16, bool, expr)                                    \
    GG_BIN(op##_f64, double, double, bool, expr) GG_BIN(op##_i32, int32_t, int32_t, bool, expr)    \
    GG_BIN(op##_i64, int64_t, int64_t, bool, expr) GG_BIN(op##_b8, bool, bool, bool, expr)

#if GG_PART(0)
GG_BIN_FLOATS(add, x + y)
GG_BIN_FLOATS(sub, x - y)
GG_BIN_FLOATS(mul, x * y)
GG_BIN_FLOATS(div, x / y)
#endif
#if GG_PART(1)
GG_BIN_FLOATS(max, gg_max(x, y))
GG_BIN_FLOATS(min, gg_min(x, y))
GG_BIN_INTS(add, (decltype(x))((unsigned long long)x + (unsigned long long)y))
GG_BIN_INTS(sub, (decltype(x))((unsigned long long)x - (unsigned long long)y))
#endif
#if GG_PART(2)
GG_BIN_INTS(mul, (decltype(x))((unsigned long long)x * (unsigned long long)y))
GG_BIN_INTS(max, x < y ? y : x)
GG_BIN_INTS(min, y < x ? y : x)
#endif
// Integer division truncates toward zero (C semantics, like the CPU kernel); y == 0 sets the flag.
#if GG_PART(3)
GG_BIN_INTS(div, y == 0 ? (*flag = 1, decltype(x)(0)) : (y == -1 ? (decltype(x))(0ull - (unsigned long long)x) : x / y))
#endif

// Mod: fmod=1 takes the dividend's sign (C fmod); fmod=0 the divisor's (numpy/Python %).
__device__ __forceinline__ float gg_pymod(float x, float y) {
    float r = fmodf(x, y);
    if (r != 0.0f) { if ((r < 0.0f) != (y < 0.0f)) r += y; } else r = copysignf(0.0f, y);
    return r;
}
__device__ __forceinline__ double gg_pymod(double x, double y) {
    double r = fmod(x, y);
    if (r != 0.0) { if ((r < 0.0) != (y < 0.0)) r += y; } else r = copysign(0.0, y);
    return r;
}
template <typename T> __device__ __forceinline__ T gg_int_pymod(T x, T y, int64_t* flag) {
    if (y == 0) { *flag = 1; return 0; }
    if (y == -1) return 0;
    T r = x % y;
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    return r;
}
template <typename T> __device__ __forceinline__ T gg_int_fmod(T x, T y, int64_t* flag) {
    if (y == 0) { *flag = 1; return 0; }
    if (y == -1) return 0;
    return x % y;
}
#if GG_PART(4)
GG_BIN(mod_f16, __half, __half, __half, gg_pymod(x, y))
GG_BIN(mod_f32, float, float, float, gg_pymod(x, y))
GG_BIN(mod_f64, double, double, double, gg_pymod(x, y))
GG_BIN(fmod_f16, __half, __half, __half, fmodf(x, y))
GG_BIN(mod_bf16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, gg_pymod(x, y))
GG_BIN(fmod_bf16, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, fmodf(x, y))
#endif
#if GG_PART(5)
GG_BIN(fmod_f32, float, float, float, fmodf(x, y))
GG_BIN(fmod_f64, double, double, double, fmod(x, y))
GG_BIN_INTS(mod, gg_int_pymod(x, y, flag))
GG_BIN_INTS(fmod, gg_int_fmod(x, y, flag))
#endif

// Pow: the output has the base's type; computed in double when either side is double.
template <typename T> __device__ __forceinline__ T gg_ipow(T x, long long y) {
    if (y < 0) return (T)pow((double)x, (double)y);
    unsigned long long result = 1, base = (unsigned long long)x;
    while (y) { if (y & 1) result *= base; base *= base; y >>= 1; }
    return (T)result;
}
#define GG_POW_F(sa, TA, sb, TB, C) GG_BIN(pow_##sa##_##sb, TA, TB, TA, (decltype(x))gg_pow((C)x, (C)y))
#if GG_PART(6)
GG_POW_F(f16, __half, f16, __half, float) GG_POW_F(f16, __half, f32, float, float) GG_POW_F(f16, __half, f64, double, double)
GG_POW_F(f16, __half, i32, int32_t, float) GG_POW_F(f16, __half, i64, int64_t, float)
GG_POW_F(f32, float, f16, __half, float) GG_POW_F(f32, float, f32, float, float) GG_POW_F(f32, float, f64, double, double)
GG_POW_F(f32, float, i32, int32_t, float) GG_POW_F(f32, float, i64, int64_t, float)
#endif
#if GG_PART(7)
GG_POW_F(f64, double, f16, __half, double) GG_POW_F(f64, double, f32, float, double) GG_POW_F(f64, double, f64, double, double)
GG_POW_F(f64, double, i32, int32_t, double) GG_POW_F(f64, double, i64, int64_t, double)
GG_BIN(pow_i32_i32, int32_t, int32_t, int32_t, gg_ipow<int32_t>(x, y))
GG_BIN(pow_i32_i64, int32_t, int64_t, int32_t, gg_ipow<int32_t>(x, y))
#endif
#if GG_PART(8)
GG_POW_F(bf16, __nv_bfloat16, f16, __half, float) GG_POW_F(bf16, __nv_bfloat16, bf16, __nv_bfloat16, float)
GG_POW_F(bf16, __nv_bfloat16, f32, float, float) GG_POW_F(bf16, __nv_bfloat16, f64, double, double)
GG_POW_F(bf16, __nv_bfloat16, i32, int32_t, float) GG_POW_F(bf16, __nv_bfloat16, i64, int64_t, float)
GG_POW_F(f16, __half, bf16, __nv_bfloat16, float) GG_POW_F(f32, float, bf16, __nv_bfloat16, float)
GG_POW_F(f64, double, bf16, __nv_bfloat16, double)
GG_BIN(pow_i64_i32, int64_t, int32_t, int64_t, gg_ipow<int64_t>(x, y))
GG_BIN(pow_i64_i64, int64_t, int64_t, int64_t, gg_ipow<int64_t>(x, y))
#endif

// Comparisons (bool out) and logic.
#if GG_PART(9)
GG_CMP(equal, x == y)
GG_CMP(less, x < y)
GG_CMP(less_equal, x <= y)
GG_CMP(greater, x > y)
#endif
#if GG_PART(10)
GG_CMP(greater_equal, x >= y)
GG_BIN(and_b8, bool, bool, bool, x && y)
GG_BIN(or_b8, bool, bool, bool, x || y)
GG_BIN(xor_b8, bool, bool, bool, x != y)
#endif

// ---------------------------------------------------------------------------------------------
// Where: out[i] = cond ? x : y with 3-way broadcasting; the value type only matters by its size.

template <typename T>
__device__ __forceinline__ void where(T* out, const bool* c, const T* x, const T* y, const TensorDesc& shape,
                                      const TensorDesc& cv, const TensorDesc& xv, const TensorDesc& yv, int64_t n) {
    const TensorDesc* views[3] = {&cv, &xv, &yv};
    gg_for_each<3>(shape, views, n, [&](int64_t i, const int64_t* offs) {
        out[i] = c[offs[0]] ? x[offs[1]] : y[offs[2]];
    });
}
#define GG_WHERE(name, T)                                                                              \
    extern "C" __global__ void name(T* out, const bool* c, const T* x, const T* y, TensorDesc shape,   \
                                    TensorDesc cv, TensorDesc xv, TensorDesc yv, int64_t n) {          \
        where(out, c, x, y, shape, cv, xv, yv, n);                                                     \
    }
#if GG_PART(11)
GG_WHERE(where_1, uint8_t)
GG_WHERE(where_2, uint16_t)
GG_WHERE(where_4, uint32_t)
GG_WHERE(where_8, uint64_t)
#endif

// ---------------------------------------------------------------------------------------------
// Variadic Sum/Max/Min over up to 8 same-shape inputs, folded left to right like the CPU kernel.

// The pointer table is indexed by unrolled constants only, so it stays in registers (a run-time
// index would put it in local memory). V: elements per thread, 4 in the 16-byte (Quad) variants the
// launcher picks where every pointer is 16-byte aligned and n % 4 == 0.
template <typename T, int V, typename Op>
__device__ __forceinline__ void variadic(T* out, const T* const (&ps)[8], int64_t k, int64_t n, Op op) {
    GG_GRID_STRIDE(i, n / V) {
        typename Acc<T>::type x[V], y[V];
        if constexpr (V == 4) {
            const Quad<T> q = reinterpret_cast<const Quad<T>*>(ps[0])[i];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = q.v[e];
        } else {
            x[0] = gg_load(ps[0] + i);
        }
#pragma unroll
        for (int j = 1; j < 8; ++j) {
            if (j < k) {
                if constexpr (V == 4) {
                    const Quad<T> q = reinterpret_cast<const Quad<T>*>(ps[j])[i];
#pragma unroll
                    for (int e = 0; e < 4; ++e) y[e] = q.v[e];
                } else {
                    y[0] = gg_load(ps[j] + i);
                }
#pragma unroll
                for (int e = 0; e < V; ++e) x[e] = op(x[e], y[e]);
            }
        }
        if constexpr (V == 4) {
            Quad<T> q;
#pragma unroll
            for (int e = 0; e < 4; ++e) q.v[e] = x[e];
            reinterpret_cast<Quad<T>*>(out)[i] = q;
        } else {
            gg_store(out + i, x[0]);
        }
    }
}

#define GG_VARIADIC_V(name, T, V, expr)                                                                \
    extern "C" __global__ void name(T* out, const T* p0, const T* p1, const T* p2, const T* p3,        \
                                    const T* p4, const T* p5, const T* p6, const T* p7, int64_t k,     \
                                    int64_t n) {                                                       \
        const T* const ps[8] = {p0, p1, p2, p3, p4, p5, p6, p7};                                       \
        variadic<T, V>(out, ps, k, n,                                                                  \
                       [](typename Acc<T>::type x, typename Acc<T>::type y) -> typename Acc<T>::type { \
                           return (expr);                                                              \
                       });                                                                             \
    }
#define GG_VARIADIC(name, T, expr) GG_VARIADIC_V(name, T, 1, expr)
#define GG_VARIADIC_ALL(op, expr)                                                                      \
    GG_VARIADIC(op##_n_f16, __half, expr) GG_VARIADIC(op##_n_bf16, __nv_bfloat16, expr)                \
    GG_VARIADIC(op##_n_f32, float, expr)                                                               \
    GG_VARIADIC(op##_n_f64, double, expr) GG_VARIADIC(op##_n_i32, int32_t, expr)                       \
    GG_VARIADIC(op##_n_i64, int64_t, expr) GG_VARIADIC_V(op##_n_f32_q, float, 4, expr)                 \
    GG_VARIADIC_V(op##_n_i32_q, int32_t, 4, expr)
#if GG_PART(12)
GG_VARIADIC_ALL(sum, x + y)
GG_VARIADIC_ALL(max, gg_max(x, y))
GG_VARIADIC_ALL(min, gg_min(x, y))
#endif

// ---------------------------------------------------------------------------------------------
// unary: out[i] = op(x[i]) with up to two float attributes (alpha, beta).

template <typename TI, typename TO, typename Op>
__device__ __forceinline__ void unary(TO* out, const TI* in, int64_t n, Op op) {
    GG_GRID_STRIDE(i, n) { gg_store(out + i, op(gg_load(in + i))); }
}

#define GG_UN(name, TI, TO, expr)                                                                      \
    extern "C" __global__ void name(TO* out, const TI* in, double alpha, double beta, int64_t n) {     \
        unary(out, in, n, [alpha, beta](typename Acc<TI>::type x) -> typename Acc<TO>::type {            \
            using C = decltype(x);                                                                     \
            (void)alpha; (void)beta;                                                                   \
            return (expr);                                                                             \
        });                                                                                            \
    }
#define GG_UN_FLOATS(op, expr)                                                                         \
    GG_UN(op##_f16, __half, __half, expr) GG_UN(op##_bf16, __nv_bfloat16, __nv_bfloat16, expr)       \
    GG_UN(op##_f32, float, float, expr) GG_UN(op##_f64, double, double, expr)
#define GG_UN_INTS(op, expr) GG_UN(op##_i32, int32_t, int32_t, expr) GG_UN(op##_i64, int64_t, int64_t, expr)

template <typename C> __device__ __forceinline__ C gg_sign(C x) {
    return x > C(0) ? C(1) : (x < C(0) ? C(-1) : x);  // NaN and +-0 pass through
}

#if GG_PART(13)
GG_UN_FLOATS(neg, -x)
GG_UN_FLOATS(abs, fabs(x))
GG_UN_FLOATS(sqrt, sqrt(x))
GG_UN_FLOATS(reciprocal, C(1) / x)
#endif
#if GG_PART(14)
GG_UN_FLOATS(exp, exp(x))
GG_UN_FLOATS(log, log(x))
GG_UN_FLOATS(tanh, tanh(x))
GG_UN_FLOATS(sigmoid, gg_sigmoid(x))
#endif
#if GG_PART(15)
GG_UN_FLOATS(relu, x < C(0) ? C(0) : x)
GG_UN_FLOATS(leaky_relu, x < C(0) ? x * C(alpha) : x)
GG_UN_FLOATS(softplus, gg_softplus(x))
GG_UN_FLOATS(erf, erf(x))
#endif
#if GG_PART(16)
GG_UN_FLOATS(gelu, gg_gelu(x))
GG_UN_FLOATS(gelu_tanh, gg_gelu_tanh(x))
GG_BIN_FLOATS(gelu_grad, x * gg_gelu_slope(y))  // (dY, X)
GG_BIN_FLOATS(gelu_tanh_grad, x * gg_gelu_tanh_slope(y))
GG_BIN_FLOATS(relu_grad, y > decltype(y)(0) ? x : decltype(x)(0))  // (dY, X): 0 where X <= 0 or NaN
GG_UN_FLOATS(sign, gg_sign(x))
GG_UN_FLOATS(floor, floor(x))
#endif
#if GG_PART(17)
GG_UN_FLOATS(ceil, ceil(x))
GG_UN_FLOATS(round, rint(x))
GG_UN_FLOATS(sin, sin(x))
GG_UN_FLOATS(cos, cos(x))
#endif
#if GG_PART(18)
GG_UN_FLOATS(tan, tan(x))
GG_UN_FLOATS(asin, asin(x))
GG_UN_FLOATS(acos, acos(x))
GG_UN_FLOATS(atan, atan(x))
#endif
#if GG_PART(19)
GG_UN_FLOATS(sinh, sinh(x))
GG_UN_FLOATS(cosh, cosh(x))
GG_UN_FLOATS(asinh, asinh(x))
GG_UN_FLOATS(acosh, acosh(x))
#endif
#if GG_PART(20)
GG_UN_FLOATS(atanh, atanh(x))
GG_UN_FLOATS(elu, x < C(0) ? C(alpha) * expm1(x) : x)
GG_UN_FLOATS(selu, C(beta) * (x > C(0) ? x : C(alpha) * expm1(x < C(0) ? x : C(0))))
GG_UN_FLOATS(celu, (x > C(0) ? x : C(0)) + fmin(C(0), C(alpha) * expm1((x < C(0) ? x : C(0)) / C(alpha))))
#endif
#if GG_PART(21)
GG_UN_FLOATS(softsign, x / (C(1) + fabs(x)))
GG_UN_FLOATS(hard_sigmoid, fmin(fmax(C(alpha) * x + C(beta), C(0)), C(1)))
GG_UN_FLOATS(hard_swish, x * fmin(fmax(x / C(6) + C(0.5), C(0)), C(1)))
GG_UN_FLOATS(mish, x * tanh(gg_softplus(x)))
#endif
#if GG_PART(22)
GG_UN_FLOATS(thresholded_relu, x > C(alpha) ? x : C(0))
GG_UN(isnan_f16, __half, bool, x != x)
GG_UN(isnan_bf16, __nv_bfloat16, bool, x != x)
GG_UN(isnan_f32, float, bool, x != x)
GG_UN(isnan_f64, double, bool, x != x)
#endif
#if GG_PART(23)
GG_UN_INTS(neg, (C)(0ull - (unsigned long long)x))
GG_UN_INTS(abs, x < 0 ? (C)(0ull - (unsigned long long)x) : x)
GG_UN_INTS(sign, x > 0 ? C(1) : (x < 0 ? C(-1) : C(0)))
GG_UN_INTS(relu, x < 0 ? C(0) : x)
#endif
#if GG_PART(24)
GG_UN(not_b8, bool, bool, !x)
#endif

// Clip with optional device scalars lo/hi (null: no bound); NaN in x stays NaN.
#define GG_CLIP(name, T)                                                                               \
    extern "C" __global__ void name(T* out, const T* in, const T* lo, const T* hi, int64_t n) {        \
        using C = typename Acc<T>::type;                                                               \
        const bool has_lo = lo != nullptr, has_hi = hi != nullptr;                                     \
        const C l = has_lo ? gg_load(lo) : C(0), h = has_hi ? gg_load(hi) : C(0);                      \
        GG_GRID_STRIDE(i, n) {                                                                         \
            C v = gg_load(in + i);                                                                     \
            if (has_lo && v < l) v = l;                                                                \
            if (has_hi && h < v) v = h;                                                                \
            gg_store(out + i, v);                                                                      \
        }                                                                                              \
    }
#if GG_PART(25)
GG_CLIP(clip_f16, __half)
GG_CLIP(clip_bf16, __nv_bfloat16)
GG_CLIP(clip_f32, float)
GG_CLIP(clip_f64, double)
GG_CLIP(clip_i32, int32_t)
#endif
#if GG_PART(26)
GG_CLIP(clip_i64, int64_t)
#endif

// ---------------------------------------------------------------------------------------------
// Cast between f16/bf16/f32/f64/i8/u8/i32/i64/bool (float -> bool is x != 0, so NaN -> true; see
// pointwise.h's Conv).

#define GG_CAST(sa, TA, sb, TB)                                                                        \
    extern "C" __global__ void cast_##sa##_##sb(TB* out, const TA* in, int64_t n) {                   \
        GG_GRID_STRIDE(i, n) { out[i] = Conv<TB, TA>::go(in[i]); }                                     \
    }
#define GG_CAST_FROM(sa, TA)                                                                           \
    GG_CAST(sa, TA, f16, __half) GG_CAST(sa, TA, bf16, __nv_bfloat16)                                  \
    GG_CAST(sa, TA, f32, float) GG_CAST(sa, TA, f64, double)                                           \
    GG_CAST(sa, TA, i8, int8_t) GG_CAST(sa, TA, u8, uint8_t) GG_CAST(sa, TA, i32, int32_t)             \
    GG_CAST(sa, TA, i64, int64_t) GG_CAST(sa, TA, b8, bool)
#if GG_PART(27)
GG_CAST_FROM(f16, __half)
GG_CAST_FROM(f32, float)
GG_CAST_FROM(f64, double)
GG_CAST_FROM(i8, int8_t)
#endif
#if GG_PART(28)
GG_CAST_FROM(bf16, __nv_bfloat16)
#endif
#if GG_PART(29)
GG_CAST_FROM(u8, uint8_t)
GG_CAST_FROM(i32, int32_t)
GG_CAST_FROM(i64, int64_t)
GG_CAST_FROM(b8, bool)
#endif
