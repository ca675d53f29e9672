// Multi-tensor optimizer updates: one launch updates up to GG_MT_MAX parameters (and their
// optimizer states) in place, as PyTorch's fused AdamW does (multi_tensor_apply's layout: the
// tensors' addresses and sizes travel in the kernel's argument block; each block takes one chunk
// of one tensor). gradgen/executor/fused_optimizer.py plans the launches.
//
// Each element is computed exactly as the standard-op form of the update computes it
// (gradgen/training/optimizers.py): the same operations in the same order, each rounded to
// nearest (the __f*_rn intrinsics, which the compiler never contracts into an FMA), so the fused
// update is bit for bit the unfused one.
//
// The guard: when guard[k] is set and the float32 scalar it points to is not finite (the step's
// loss or gradient norm), the launch writes nothing, so the state stays as it was.
#include "common.h"

#define GG_MT_MAX 64

struct MultiTensorArgs {
    const float* guard[2];                // nullptr: not checked
    const float* scalar[4];               // device scalars of the step (see the kernels), nullptr: absent
    float consts[8];                      // the optimizer's constants, rounded to float32 as the graph's
    long long flags;                      // per kernel (see the kernels)
    long long n_tensors;
    long long chunk;                      // elements per block
    long long reserved;
    long long first_chunk[GG_MT_MAX + 1]; // tensor t's chunks are first_chunk[t] .. first_chunk[t + 1] - 1
    long long numel[GG_MT_MAX];
    float* ptr[4][GG_MT_MAX];             // per tensor: parameter, gradient, state 0, state 1
};

__device__ __forceinline__ bool gg_mt_guarded(const MultiTensorArgs& a) {
    for (int k = 0; k < 2; ++k)
        if (a.guard[k] != nullptr && !isfinite(*a.guard[k])) return true;
    return false;
}

// The tensor whose chunks include this block's, and the element range of the chunk.
__device__ __forceinline__ int gg_mt_tensor(const MultiTensorArgs& a, long long& begin, long long& end) {
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

// AdamW (adam_mode 0, PyTorch's torch.optim.AdamW): scalar = {decay, step_size, bc2_sqrt, clip},
// consts = {1 - beta1, beta2, 1 - beta2, eps}; state 0 exp_avg, state 1 exp_avg_sq.
extern "C" __global__ void adamw_mt_f32(const MultiTensorArgs a) {
    if (gg_mt_guarded(a)) return;
    long long begin, end;
    const int t = gg_mt_tensor(a, begin, end);
    float* __restrict__ P = a.ptr[0][t];
    const float* __restrict__ G = a.ptr[1][t];
    float* __restrict__ M = a.ptr[2][t];
    float* __restrict__ V = a.ptr[3][t];
    const bool decays = a.scalar[0] != nullptr, corrects = a.scalar[2] != nullptr, clips = a.scalar[3] != nullptr;
    const float decay = decays ? *a.scalar[0] : 0.0f, step_size = *a.scalar[1];
    const float bc2_sqrt = corrects ? *a.scalar[2] : 1.0f, clip = clips ? *a.scalar[3] : 1.0f;
    const float c1 = a.consts[0], b2 = a.consts[1], c2 = a.consts[2], eps = a.consts[3];
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        float g = G[i];
        if (clips) g = __fmul_rn(g, clip);
        float p = P[i];
        if (decays) p = __fmul_rn(p, decay);
        float m = M[i];
        m = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), c1));  // torch's lerp
        float v = V[i];
        v = __fadd_rn(__fmul_rn(v, b2), __fmul_rn(__fmul_rn(g, g), c2));
        float root = __fsqrt_rn(v);
        if (corrects) root = __fdiv_rn(root, bc2_sqrt);
        const float denom = __fadd_rn(root, eps);
        P[i] = __fsub_rn(p, __fmul_rn(step_size, __fdiv_rn(m, denom)));
        M[i] = m;
        V[i] = v;
    }
}

// SGD (PyTorch's torch.optim.SGD, dampening 0): scalar = {lr, -, -, clip}, consts = {weight
// decay, momentum}; flags: 1 weight decay, 2 momentum (state 0 the buffer), 4 Nesterov.
extern "C" __global__ void sgd_mt_f32(const MultiTensorArgs a) {
    if (gg_mt_guarded(a)) return;
    long long begin, end;
    const int t = gg_mt_tensor(a, begin, end);
    float* __restrict__ P = a.ptr[0][t];
    const float* __restrict__ G = a.ptr[1][t];
    float* __restrict__ B = a.ptr[2][t];
    const bool clips = a.scalar[3] != nullptr;
    const bool decays = a.flags & 1, momentum = a.flags & 2, nesterov = a.flags & 4;
    const float lr = *a.scalar[0], clip = clips ? *a.scalar[3] : 1.0f;
    const float wd = a.consts[0], mu = a.consts[1];
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        float g = G[i];
        if (clips) g = __fmul_rn(g, clip);
        const float p = P[i];
        if (decays) g = __fadd_rn(g, __fmul_rn(p, wd));
        if (momentum) {
            const float buf = __fadd_rn(__fmul_rn(B[i], mu), g);
            B[i] = buf;
            g = nesterov ? __fadd_rn(g, __fmul_rn(buf, mu)) : buf;
        }
        P[i] = __fsub_rn(p, __fmul_rn(lr, g));
    }
}
