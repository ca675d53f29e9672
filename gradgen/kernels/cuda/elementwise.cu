// Elementwise kernels: binary ops with ONNX (numpy) broadcasting, unary ops.
// Entry points: extern "C" <op>_<dtype suffix>, e.g. add_f32.
#include "common.cuh"

// out[i] = op(a[offset_a(i)], b[offset_b(i)]) over the C-order output index i.
template <typename T, typename Op>
__device__ void binary(T* out, const T* a, const T* b, TensorDesc out_shape, TensorDesc a_view,
                       TensorDesc b_view, int64_t n, Op op) {
    GG_GRID_STRIDE(i, n) {
        auto x = gg_load(a + gg_offset(i, out_shape, a_view));
        auto y = gg_load(b + gg_offset(i, out_shape, b_view));
        gg_store(out + i, op(x, y));
    }
}

#define GG_BINARY(name, T, expr)                                                                \
    extern "C" __global__ void name(T* out, const T* a, const T* b, TensorDesc out_shape,       \
                                    TensorDesc a_view, TensorDesc b_view, int64_t n) {          \
        binary(out, a, b, out_shape, a_view, b_view, n,                                         \
               [] __device__(typename Acc<T>::type x, typename Acc<T>::type y) { return expr; }); \
    }

#define GG_BINARY_FLOATS(op, expr) \
    GG_BINARY(op##_f16, __half, expr) GG_BINARY(op##_f32, float, expr) GG_BINARY(op##_f64, double, expr)

GG_BINARY_FLOATS(add, x + y)
GG_BINARY_FLOATS(sub, x - y)
GG_BINARY_FLOATS(mul, x * y)
GG_BINARY_FLOATS(div, x / y)

template <typename T, typename Op>
__device__ void unary(T* out, const T* a, int64_t n, Op op) {
    GG_GRID_STRIDE(i, n) { gg_store(out + i, op(gg_load(a + i))); }
}

#define GG_UNARY(name, T, expr)                                                               \
    extern "C" __global__ void name(T* out, const T* a, int64_t n) {                          \
        unary(out, a, n, [] __device__(typename Acc<T>::type x) { return expr; });             \
    }

#define GG_UNARY_FLOATS(op, expr) \
    GG_UNARY(op##_f16, __half, expr) GG_UNARY(op##_f32, float, expr) GG_UNARY(op##_f64, double, expr)

GG_UNARY_FLOATS(relu, x > 0 ? x : decltype(x)(0))
