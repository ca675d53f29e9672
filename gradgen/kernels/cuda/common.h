// Shared definitions of gradgen's CUDA kernels.
#pragma once
#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define GG_MAX_RANK 8

// A large source compiles in parts, side by side (gradgen/cuda/compile.py, Source.parts): it defines
// GG_PARTS n before including this header and guards its kernel instantiations with #if GG_PART(k),
// k = 0, 1, 2, ... in order. Part p (GG_PART_INDEX = p) keeps the blocks with k % n == p, so every
// kernel lands in exactly one part; a whole build (no GG_PART_INDEX) keeps them all.
#ifndef GG_PART_INDEX
#define GG_PART_INDEX -1
#endif
#define GG_PART(k) (GG_PART_INDEX < 0 || (k) % GG_PARTS == GG_PART_INDEX)

// A tensor's shape and element strides, passed by value (mirrors runtime.DESC_DTYPE).
struct TensorDesc {
    int64_t rank;
    int64_t shape[GG_MAX_RANK];
    int64_t strides[GG_MAX_RANK];
};

// Offset (in elements) of flat C-order index `i` of `shape` read through `strides`.
__device__ __forceinline__ int64_t gg_offset(int64_t i, const TensorDesc& shape, const TensorDesc& view) {
    int64_t offset = 0;
    for (int d = (int)shape.rank - 1; d >= 0; --d) {
        int64_t size = shape.shape[d];
        int64_t coord = i % size;
        i /= size;
        offset += coord * view.strides[d];
    }
    return offset;
}

#define GG_GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)blockDim.x * gridDim.x)

// C-order 3-D grids of extent e[0..2] (the spatial axes of conv.cu and pool.cu): the number of
// points, the flat index of point (c0, c1, c2), and the point of flat index r.
__device__ __forceinline__ int64_t gg_volume3(const int64_t* e) { return e[0] * e[1] * e[2]; }
__device__ __forceinline__ int64_t gg_ravel3(int64_t c0, int64_t c1, int64_t c2, const int64_t* e) {
    return (c0 * e[1] + c1) * e[2] + c2;
}
__device__ __forceinline__ void gg_unravel3(int64_t r, const int64_t* e, int64_t& c0, int64_t& c1, int64_t& c2) {
    c2 = r % e[2];
    c1 = (r / e[2]) % e[1];
    c0 = r / (e[2] * e[1]);
}

// The unsigned type of a W-byte element (W = 1, 2, 4, 8, 16), for kernels that move bits, not numbers.
template <int W> struct Word;
template <> struct Word<1> { using type = uint8_t; };
template <> struct Word<2> { using type = uint16_t; };
template <> struct Word<4> { using type = uint32_t; };
template <> struct Word<8> { using type = unsigned long long; };
template <> struct Word<16> { using type = uint4; };

// Load/store helpers so one template serves float16 and bfloat16 (computed in float32, stored
// rounded to nearest even), float and double.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <typename T> __device__ __forceinline__ typename Acc<T>::type gg_load(const T* p) { return *p; }
template <> __device__ __forceinline__ float gg_load<__half>(const __half* p) { return __half2float(*p); }
template <> __device__ __forceinline__ float gg_load<__nv_bfloat16>(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <typename T> __device__ __forceinline__ void gg_store(T* p, typename Acc<T>::type v) { *p = v; }
template <> __device__ __forceinline__ void gg_store<__half>(__half* p, float v) { *p = __float2half(v); }
template <> __device__ __forceinline__ void gg_store<__nv_bfloat16>(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// Sum over the block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
template <typename A>
__device__ __forceinline__ A block_sum(A v, A* scratch) {
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    const int warps = blockDim.x >> 5;
    if (warps == 1) return v;
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < warps ? scratch[threadIdx.x] : A(0);
        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
        if (threadIdx.x == 0) scratch[32] = v;
    }
    __syncthreads();
    v = scratch[32];
    __syncthreads();  // scratch may be reused right away
    return v;
}
