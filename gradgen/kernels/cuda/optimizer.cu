// Multi-tensor optimizer updates: one launch updates up to GG_MT_MAX parameters (and their
// optimizer states) in place, as PyTorch's fused AdamW does (multi_tensor_apply's layout: the
// tensors' addresses and sizes travel in the kernel's argument block; each block takes one chunk
// of one tensor). gradgen/executor/fused_optimizer.py plans the launches. The same layout serves
// the global gradient norm: one launch of sum_squares_mt_f32 per GG_MT_MAX gradients writes one
// partial sum of squares per block, then sum_squares_sqrt sums every partial and takes the root.
//
// Each element is computed exactly as the standard-op form of the update computes it
// (gradgen/training/optimizers.py): the same operations in the same order, each rounded to
// nearest (the __f*_rn intrinsics, which the compiler never contracts into an FMA), so the fused
// update is bit for bit the unfused one. A chunk whose tensors are all 16-byte aligned moves
// them with float4 loads and stores (the update is bound by memory bandwidth: 7 floats moved per
// AdamW element); the arithmetic per element is the same either way.
//
// The guard: when guard[k] is set and the float32 scalar it points to is not finite (the step's
// loss or gradient norm), the launch writes nothing, so the state stays as it was. The same when
// skip is set and the bool it points to is true (loss scaling's overflow flag: the step's graph
// keeps the old values with a Where on it, which this replaces).
#include "common.h"

#define GG_MT_MAX 64

// Which block takes which elements of which tensor (one home for every multi-tensor kernel).
struct GgChunks {
    long long n_tensors;
    long long chunk;                      // elements per block, a multiple of 4
    long long first_chunk[GG_MT_MAX + 1]; // tensor t's chunks are first_chunk[t] .. first_chunk[t + 1] - 1
    long long numel[GG_MT_MAX];
};

struct MultiTensorArgs {
    const float* guard[2];                // nullptr: not checked
    const bool* skip;                     // nullptr: not checked
    const float* scalar[4];               // device scalars of the step (see the kernels), nullptr: absent
    float consts[8];                      // the optimizer's constants, rounded to float32 as the graph's
    long long flags;                      // per kernel (see the kernels)
    GgChunks chunks;
    float* ptr[4][GG_MT_MAX];             // per tensor: parameter, gradient, state 0, state 1
};

struct SumSquaresArgs {
    double* partial;                      // this launch's partial sums, one per block
    GgChunks chunks;
    float* ptr[1][GG_MT_MAX];             // the gradients (read only)
};

__device__ __forceinline__ bool gg_mt_guarded(const MultiTensorArgs& a) {
    for (int k = 0; k < 2; ++k)
        if (a.guard[k] != nullptr && !isfinite(*a.guard[k])) return true;
    return a.skip != nullptr && *a.skip;
}

// The tensor whose chunks include this block's, and the element range of the chunk.
__device__ __forceinline__ int gg_mt_tensor(const GgChunks& a, long long& begin, long long& end) {
    const long long c = blockIdx.x;
    int lo = 0, hi = (int)a.n_tensors - 1;
    while (lo < hi) {  // the last t with first_chunk[t] <= c
        const int mid = (lo + hi + 1) / 2;
        if (a.first_chunk[mid] <= c) lo = mid; else hi = mid - 1;
    }
    begin = (c - a.first_chunk[lo]) * a.chunk;
    end = min(begin + a.chunk, a.numel[lo]);
    return lo;
}

__device__ __forceinline__ float& gg_lane(float4& v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// The pointer-table walk: op(x) on every element of this block's chunk, x[k] the element of
// tensor slot k (ptr[k][t]); the slots in WRITES (bit k: slot k) get x[k] back. Elements go in
// float4s where every slot's chunk is 16-byte aligned (four elements a thread per step, in lane
// order), else one at a time; each element sees the same op either way.
template <int N, unsigned WRITES, class Op>
__device__ __forceinline__ void gg_mt_apply(const GgChunks& chunks, float* const (*ptr)[GG_MT_MAX], Op op) {
    long long begin, end;
    const int t = gg_mt_tensor(chunks, begin, end);
    float* base[N];
    bool aligned = true;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        base[k] = ptr[k][t] + begin;
        aligned &= (reinterpret_cast<uintptr_t>(base[k]) & 15) == 0;
    }
    const long long n = end - begin;
    long long i = 0;
    if (aligned) {
        const long long n4 = n / 4;
        for (long long j = threadIdx.x; j < n4; j += blockDim.x) {
            float4 v[N];
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = reinterpret_cast<const float4*>(base[k])[j];
#pragma unroll
            for (int lane = 0; lane < 4; ++lane) {
                float x[N];
#pragma unroll
                for (int k = 0; k < N; ++k) x[k] = gg_lane(v[k], lane);
                op(x);
#pragma unroll
                for (int k = 0; k < N; ++k)
                    if (WRITES & (1u << k)) gg_lane(v[k], lane) = x[k];
            }
#pragma unroll
            for (int k = 0; k < N; ++k)
                if (WRITES & (1u << k)) reinterpret_cast<float4*>(base[k])[j] = v[k];
        }
        i = n4 * 4;
    }
    for (i += threadIdx.x; i < n; i += blockDim.x) {
        float x[N];
#pragma unroll
        for (int k = 0; k < N; ++k) x[k] = base[k][i];
        op(x);
#pragma unroll
        for (int k = 0; k < N; ++k)
            if (WRITES & (1u << k)) base[k][i] = x[k];
    }
}

// AdamW (adam_mode 0, PyTorch's torch.optim.AdamW): scalar = {decay, step_size, bc2_sqrt, clip},
// consts = {1 - beta1, beta2, 1 - beta2, eps}; state 0 exp_avg, state 1 exp_avg_sq.
extern "C" __global__ void adamw_mt_f32(const MultiTensorArgs a) {
    if (gg_mt_guarded(a)) return;
    const bool decays = a.scalar[0] != nullptr, corrects = a.scalar[2] != nullptr, clips = a.scalar[3] != nullptr;
    const float decay = decays ? *a.scalar[0] : 0.0f, step_size = *a.scalar[1];
    const float bc2_sqrt = corrects ? *a.scalar[2] : 1.0f, clip = clips ? *a.scalar[3] : 1.0f;
    const float c1 = a.consts[0], b2 = a.consts[1], c2 = a.consts[2], eps = a.consts[3];
    gg_mt_apply<4, 0b1101u>(a.chunks, a.ptr, [&](float (&x)[4]) {  // x = {param, grad, exp_avg, exp_avg_sq}
        float g = x[1];
        if (clips) g = __fmul_rn(g, clip);
        float p = x[0];
        if (decays) p = __fmul_rn(p, decay);
        float m = x[2];
        m = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), c1));  // torch's lerp
        float v = x[3];
        v = __fadd_rn(__fmul_rn(v, b2), __fmul_rn(__fmul_rn(g, g), c2));
        float root = __fsqrt_rn(v);
        if (corrects) root = __fdiv_rn(root, bc2_sqrt);
        const float denom = __fadd_rn(root, eps);
        x[0] = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
        x[2] = m;
        x[3] = v;
    });
}

// SGD (PyTorch's torch.optim.SGD, dampening 0): scalar = {lr, -, -, clip}, consts = {weight
// decay, momentum}; flags: 1 weight decay, 2 momentum (state 0 the buffer), 4 Nesterov.
struct GgSgd {
    bool clips, decays, nesterov;
    float lr, clip, wd, mu;
    // The new parameter; with a momentum buffer (buf != nullptr) *buf is updated too.
    __device__ __forceinline__ float operator()(float p, float g, float* buf) const {
        if (clips) g = __fmul_rn(g, clip);
        if (decays) g = __fadd_rn(g, __fmul_rn(p, wd));
        if (buf != nullptr) {
            *buf = __fadd_rn(__fmul_rn(*buf, mu), g);
            g = nesterov ? __fadd_rn(g, __fmul_rn(*buf, mu)) : *buf;
        }
        return __fsub_rn(p, __fmul_rn(lr, g));
    }
};

extern "C" __global__ void sgd_mt_f32(const MultiTensorArgs a) {
    if (gg_mt_guarded(a)) return;
    const bool clips = a.scalar[3] != nullptr;
    const GgSgd sgd{clips, (a.flags & 1) != 0, (a.flags & 4) != 0, *a.scalar[0], clips ? *a.scalar[3] : 1.0f,
                    a.consts[0], a.consts[1]};
    if (a.flags & 2)
        gg_mt_apply<3, 0b101u>(a.chunks, a.ptr, [&](float (&x)[3]) { x[0] = sgd(x[0], x[1], &x[2]); });
    else
        gg_mt_apply<2, 0b01u>(a.chunks, a.ptr, [&](float (&x)[2]) { x[0] = sgd(x[0], x[1], nullptr); });
}

// The sum of v over the block, in a fixed order (warp shuffles, then the warps in order): valid
// in thread 0. blockDim.x is a multiple of 32, at most 1024.
__device__ __forceinline__ double gg_block_sum(double v) {
    __shared__ double warps[32];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += warps[w];
    return total;
}

// Global gradient norm, pass 1: partial[block] = the sum of squares of the block's chunk, in
// float64 (each square is exact in float64; each thread sums its elements in order).
extern "C" __global__ void sum_squares_mt_f32(const SumSquaresArgs a) {
    double acc = 0.0;
    gg_mt_apply<1, 0u>(a.chunks, a.ptr, [&](float (&x)[1]) { acc += (double)x[0] * (double)x[0]; });
    acc = gg_block_sum(acc);
    if (threadIdx.x == 0) a.partial[blockIdx.x] = acc;
}

// Pass 2 (one block): *out = sqrt(sum of the n partials), summed in a fixed order in float64,
// rounded once to float32.
extern "C" __global__ void sum_squares_sqrt(float* out, const double* partial, long long n) {
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
    acc = gg_block_sum(acc);
    if (threadIdx.x == 0) *out = (float)sqrt(acc);
}
