// Scalar functions of the elementwise ops, shared by elementwise.cu's kernels and the fused
// pointwise kernels generated at run time (gradgen/kernels/cuda/fused.py pastes this header into
// each generated source), so that a fused chain computes every op exactly as its own kernel does.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// numpy bool is one byte holding 0 or 1, as C++ bool does: bool tensors are `bool` here.
template <typename T> __device__ __forceinline__ bool gg_isnan(T x) { return x != x; }
template <> __device__ __forceinline__ bool gg_isnan<int32_t>(int32_t) { return false; }
template <> __device__ __forceinline__ bool gg_isnan<int64_t>(int64_t) { return false; }
template <> __device__ __forceinline__ bool gg_isnan<bool>(bool) { return false; }

// numpy's maximum/minimum: NaN in either operand gives NaN.
template <typename T> __device__ __forceinline__ T gg_max(T x, T y) {
    return gg_isnan(x) ? x : (gg_isnan(y) ? y : (x < y ? y : x));
}
template <typename T> __device__ __forceinline__ T gg_min(T x, T y) {
    return gg_isnan(x) ? x : (gg_isnan(y) ? y : (y < x ? y : x));
}

// Pow: computed in double when either side is double.
__device__ __forceinline__ float gg_pow(float x, float y) { return y == 2.0f ? x * x : powf(x, y); }
__device__ __forceinline__ double gg_pow(double x, double y) { return y == 2.0 ? x * x : pow(x, y); }

template <typename C> __device__ __forceinline__ C gg_sigmoid(C x) {
    C e = exp(-fabs(x));
    return x >= C(0) ? C(1) / (C(1) + e) : e / (C(1) + e);
}
template <typename C> __device__ __forceinline__ C gg_softplus(C x) {
    // log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), as numpy's logaddexp(0, x).
    return (x > C(0) ? x : C(0)) + log1p(exp(-fabs(x)));
}
template <typename C> __device__ __forceinline__ C gg_gelu(C x) {
    return C(0.5) * x * (C(1) + erf(x * C(0.70710678118654752440)));
}
template <typename C> __device__ __forceinline__ C gg_gelu_tanh(C x) {
    return C(0.5) * x * (C(1) + tanh(C(0.79788456080286535588) * (x + C(0.044715) * x * x * x)));
}
// Gelu'(x), as ONNX Runtime training's GeluGrad / FastGeluGrad compute it (and the CPU kernels).
template <typename C> __device__ __forceinline__ C gg_gelu_slope(C x) {
    return C(0.5) * (erf(x * C(0.70710678118654752440)) + C(1)) + x * C(0.39894228040143267794) * exp(C(-0.5) * x * x);
}
template <typename C> __device__ __forceinline__ C gg_gelu_tanh_slope(C x) {
    const C alpha = C(0.79788456080286535588), beta = C(0.044715 * 0.79788456080286535588 * 3.0);
    const C cube = x * x * x;
    const C t = tanh(alpha * x + alpha * C(0.044715) * cube);
    return C(0.5) * (t + (C(1) - t * t) * (alpha * x + beta * cube) + C(1));
}

// Cast between f16/bf16/f32/f64/i8/u8/i32/i64/bool (float -> bool is x != 0, so NaN -> true).
// To bfloat16 goes through float32 (round to nearest even from there), as ml_dtypes' casts and
// the CPU backend (which computes in float32 and rounds its result) do.
template <typename To, typename From> struct Conv {
    static __device__ __forceinline__ To go(From x) { return static_cast<To>(x); }
};
template <typename From> struct Conv<__half, From> {
    static __device__ __forceinline__ __half go(From x) { return __float2half(static_cast<float>(x)); }
};
template <> struct Conv<__half, double> {
    static __device__ __forceinline__ __half go(double x) { return __double2half(x); }
};
template <> struct Conv<__half, __half> {
    static __device__ __forceinline__ __half go(__half x) { return x; }
};
template <typename To> struct Conv<To, __half> {
    static __device__ __forceinline__ To go(__half x) { return Conv<To, float>::go(__half2float(x)); }
};
template <typename From> struct Conv<bool, From> {
    static __device__ __forceinline__ bool go(From x) { return x != From(0); }
};
template <> struct Conv<bool, __half> {
    static __device__ __forceinline__ bool go(__half x) { return __half2float(x) != 0.0f; }
};
template <typename From> struct Conv<__nv_bfloat16, From> {
    static __device__ __forceinline__ __nv_bfloat16 go(From x) { return __float2bfloat16(static_cast<float>(x)); }
};
template <> struct Conv<__nv_bfloat16, __nv_bfloat16> {
    static __device__ __forceinline__ __nv_bfloat16 go(__nv_bfloat16 x) { return x; }
};
template <> struct Conv<__nv_bfloat16, __half> {
    static __device__ __forceinline__ __nv_bfloat16 go(__half x) { return __float2bfloat16(__half2float(x)); }
};
template <typename To> struct Conv<To, __nv_bfloat16> {
    static __device__ __forceinline__ To go(__nv_bfloat16 x) { return Conv<To, float>::go(__bfloat162float(x)); }
};
template <> struct Conv<__half, __nv_bfloat16> {
    static __device__ __forceinline__ __half go(__nv_bfloat16 x) { return __float2half(__bfloat162float(x)); }
};
template <> struct Conv<bool, __nv_bfloat16> {
    static __device__ __forceinline__ bool go(__nv_bfloat16 x) { return __bfloat162float(x) != 0.0f; }
};
