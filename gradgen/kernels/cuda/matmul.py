"""CUDA launchers: MatMul and Gemm through cuBLAS (nvmath-python's bindings).

cuBLAS is column-major; a row-major C = op(A) @ op(B) is computed as C^T = op(B)^T @ op(A)^T,
which is the same memory read column-major: the operands swap places and keep their own
transposition flags. Batched MatMul uses one strided-batched call when each operand's batch is
either complete or fully broadcast (stride 0); a batch whose rows are shared (B broadcast over
A's batch) folds into one large GEMM; other broadcast patterns are materialised first.

float32 runs full FP32 math (no TF32) unless GRADGEN_ALLOW_TF32=1; float16 accumulates in
float32; float64 in float64. Other dtypes (integer MatMul) run the numpy kernel.
"""

from __future__ import annotations

import math
import os

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import broadcast_to, contiguous, cpu_fallback, is_float
from gradgen.kernels.table import cuda_kernel

_STATE: dict = {}
CUBLAS_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends on Hopper

# cudaDataType_t values
_CUDA_R_16F, _CUDA_R_32F, _CUDA_R_64F = 2, 0, 1


def allow_tf32() -> bool:
    return os.environ.get("GRADGEN_ALLOW_TF32", "") == "1"


def _drop_cublas() -> None:
    """At exit: the handle and its workspace go while the context is current."""
    handle = _STATE.pop("handle", None)
    if handle is not None:
        _STATE["cublas"].destroy(handle)
    _STATE.clear()


def _cublas():
    """(module, handle): one cuBLAS handle per process, created on first use, on gradgen's stream."""
    if "handle" not in _STATE:
        from nvmath.bindings import cublas

        from gradgen.cuda import runtime as rt  # noqa: F401  (the primary context is current)

        handle = cublas.create()
        cublas.set_stream(handle, int(rt.stream().handle))
        cublas.set_pointer_mode(handle, int(cublas.PointerMode.HOST))
        # A workspace of our own, set once: cuBLAS then allocates nothing while a CUDA graph is
        # recorded (its default would be a stream-ordered allocation the graph keeps).
        with rt.persistent():
            workspace = rt.empty((CUBLAS_WORKSPACE_BYTES,), np.uint8)
        cublas.set_workspace(handle, int(workspace.gpudata), CUBLAS_WORKSPACE_BYTES)
        _STATE["workspace"] = workspace
        _STATE["cublas"] = cublas
        _STATE["handle"] = handle
        rt.drop_at_exit(_drop_cublas)
    return _STATE["cublas"], _STATE["handle"]


def _types(dtype):
    """(cuda data type, compute type, scalar numpy dtype) for an operand dtype."""
    cublas, _ = _cublas()
    ct = cublas.ComputeType
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return _CUDA_R_32F, int(ct.COMPUTE_32F_FAST_TF32 if allow_tf32() else ct.COMPUTE_32F), np.float32
    if dtype == np.float64:
        return _CUDA_R_64F, int(ct.COMPUTE_64F), np.float64
    if dtype == np.float16:
        return _CUDA_R_16F, int(ct.COMPUTE_32F), np.float32
    raise KernelError(f"dtype {dtype} is not supported by the cuBLAS launchers")


def gemm_rowmajor(c, a, b, m, n, k, *, trans_a=False, trans_b=False, a_cols=None, b_cols=None, alpha=1.0, beta=0.0,
                  batch=1, stride_a=0, stride_b=0, stride_c=0, dtype=None) -> None:
    """C (m, n) = alpha * op(A) @ op(B) + beta * C on row-major device buffers (addresses or GPUArrays).

    ``a_cols``/``b_cols`` are the row lengths of A and B as stored; strides are in elements.
    """
    cublas, handle = _cublas()
    data_type, compute, scalar = _types(dtype)
    if a_cols is None:
        a_cols = m if trans_a else k
    if b_cols is None:
        b_cols = k if trans_b else n
    for value, what in ((m, "m"), (n, "n"), (k, "k"), (batch, "batch")):
        if value > 2**31 - 1:
            raise KernelError(f"GEMM dimension {what}={value} exceeds cuBLAS's 32-bit limit")
    alpha_h = np.array([alpha], dtype=scalar)
    beta_h = np.array([beta], dtype=scalar)
    op = cublas.Operation
    op_b = int(op.T if trans_b else op.N)
    op_a = int(op.T if trans_a else op.N)
    a_ptr, b_ptr, c_ptr = (int(x) if isinstance(x, (int, np.integer)) else int(x.gpudata) for x in (a, b, c))
    lda, ldb, ldc = max(1, int(b_cols)), max(1, int(a_cols)), max(1, int(n))
    algo = -1  # CUBLAS_GEMM_DEFAULT
    if batch == 1:
        cublas.gemm_ex(handle, op_b, op_a, int(n), int(m), int(k), alpha_h.ctypes.data, b_ptr, data_type, lda,
                       a_ptr, data_type, ldb, beta_h.ctypes.data, c_ptr, data_type, ldc, compute, algo)
    else:
        cublas.gemm_strided_batched_ex(handle, op_b, op_a, int(n), int(m), int(k), alpha_h.ctypes.data, b_ptr,
                                       data_type, lda, int(stride_b), a_ptr, data_type, ldb, int(stride_a),
                                       beta_h.ctypes.data, c_ptr, data_type, ldc, int(stride_c), int(batch),
                                       compute, algo)




@cuda_kernel("MatMul")
def matmul(a, b):
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu import matmul as cpu

    cpu.check_matmul_shapes(a.shape, b.shape)
    k_a = a.shape[-1]
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    if a.dtype != b.dtype or not is_float(a.dtype):
        return cpu_fallback("MatMul", a, b)
    m = int(a.shape[-2]) if a.ndim > 1 else 1
    k = int(k_a)
    n = int(b.shape[-1]) if b.ndim > 1 else 1
    final = batch + ((m,) if a.ndim > 1 else ()) + ((n,) if b.ndim > 1 else ())
    out = rt.empty(batch + (m, n), a.dtype)
    if out.size == 0:
        return rt.empty(final, a.dtype)
    if k == 0:
        rt.memset_zero(out)
        return out.reshape(final)
    a2 = contiguous(a).reshape(1, k) if a.ndim == 1 else contiguous(a)
    b2 = contiguous(b).reshape(k, 1) if b.ndim == 1 else contiguous(b)
    total = math.prod(batch)
    pa = math.prod(a2.shape[:-2])
    pb = math.prod(b2.shape[:-2])
    if pb == 1 and pa == total:
        # B is shared by every batch entry: one (total*m, k) @ (k, n) GEMM.
        gemm_rowmajor(out, a2, b2, total * m, n, k, dtype=a.dtype)
        return out.reshape(final)
    if pa not in (1, total):
        a2 = broadcast_to(a2, batch + (m, k))
        pa = total
    if pb not in (1, total):
        b2 = broadcast_to(b2, batch + (k, n))
        pb = total
    gemm_rowmajor(out, a2, b2, m, n, k, batch=total, stride_a=m * k if pa == total else 0,
                  stride_b=k * n if pb == total else 0, stride_c=m * n, dtype=a.dtype)
    return out.reshape(final)


@cuda_kernel("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    from gradgen.cuda import runtime as rt

    if a.ndim != 2 or b.ndim != 2:
        raise KernelError(f"Gemm needs 2-D A and B, got shapes {list(a.shape)} and {list(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if transA else a.shape
    k_b, n = (b.shape[1], b.shape[0]) if transB else b.shape
    if k != k_b:
        raise KernelError(
            f"inner dimensions differ: op(A) is {[m, k]}, op(B) is {[k_b, n]} (transA={transA}, transB={transB})")
    use_c = c is not None and beta != 0
    if use_c:
        try:
            shape = np.broadcast_shapes(tuple(c.shape), (m, n))
        except ValueError:
            shape = None
        if shape != (m, n):
            raise KernelError(f"C of shape {list(c.shape)} does not broadcast to the output shape [{m}, {n}]")
    if a.dtype != b.dtype or not is_float(a.dtype) or (use_c and c.dtype != a.dtype):
        return cpu_fallback("Gemm", a, b, c, alpha=alpha, beta=beta, transA=transA, transB=transB)
    a, b = contiguous(a), contiguous(b)
    if use_c:
        out = broadcast_to(c, (m, n))
    else:
        out = rt.empty((m, n), a.dtype)
    if out.size == 0:
        return out
    if k == 0 and not use_c:
        rt.memset_zero(out)
        return out
    gemm_rowmajor(out, a if k else out, b if k else out, int(m), int(n), int(k), trans_a=bool(transA), trans_b=bool(transB),
                  a_cols=int(a.shape[1]), b_cols=int(b.shape[1]), alpha=float(alpha), beta=float(beta) if use_c else 0.0,
                  dtype=a.dtype)
    return out
