"""CUDA launchers: MatMul and Gemm through cuBLAS (nvmath-python's bindings); Einsum, and DFT
as a GEMM with a DFT matrix, on the same planner; Det through matmul.cu.

cuBLAS is column-major; a row-major C = op(A) @ op(B) is computed as C^T = op(B)^T @ op(A)^T,
which is the same memory read column-major: the operands swap places and keep their own
transposition flags. MatMul and com.microsoft FusedMatMul run through one planner (``plan_gemm``)
over operand views (shape, element strides): a transposed or batch-permuted operand is a transpose
flag and a leading dimension, not a copy. The batch axes are coalesced; the last one becomes a
strided-batched call (stride 0 where an operand is broadcast), any outer ones a few such calls; a
batch whose B is shared and whose A rows stack evenly folds into one large GEMM. Only a matrix
without a unit stride, or a broadcast pattern needing more than ``MAX_GEMM_CALLS`` calls, is
materialised first.

float32 runs full FP32 math (no TF32) unless GRADGEN_ALLOW_TF32=1; float16 and bfloat16 accumulate
in float32 (tensor cores); float64 in float64. Other dtypes (integer MatMul) run the numpy kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import (
    broadcast_to,
    coalesce,
    contiguous,
    copy,
    copy_into,
    cpu_fallback,
    dtype_suffix,
    element_strides,
    fill,
    is_float,
    kernel_of,
    launch,
    plan_cache,
    tf32_allowed,
)
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.matmul import check_fused_ranks, fused_operand_dims, fused_operand_perm, matmul_output_dims

_STATE: dict = {}
CUBLAS_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends on Hopper

# cudaDataType_t values
_CUDA_R_16F, _CUDA_R_16BF, _CUDA_R_32F, _CUDA_R_64F = 2, 14, 0, 1


def _drop_cublas() -> None:
    """At exit: the handle and its workspace go while the context is current."""
    handle = _STATE.pop("handle", None)
    if handle is not None:
        _STATE["cublas"].destroy(handle)
    lt = _STATE.pop("lt", None)
    if lt is not None:
        lt[0].destroy(lt[1])
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


def _set_reduction_precision(cublas, handle, data_type: int) -> None:
    """16-bit GEMMs reduce in float32 all the way: cuBLAS's default lets split-K GEMMs add their partial
    sums in the output type. On the LM head's input gradient (K = the 50,257-word vocabulary) that
    cost 1.28e-2 against one bf16 rounding's 3.9e-3, and through the backward it tripled a GPT-2
    layout's worst bf16 gradient error (5e-2 against 1.4e-2), for 3 % of the step's time. PyTorch
    keeps that default (``allow_bf16_reduced_precision_reduction``); other types keep cuBLAS's
    default mode, so their results do not change."""
    half = data_type in (_CUDA_R_16F, _CUDA_R_16BF)
    mode = int(cublas.Math.DISALLOW_REDUCED_PRECISION_REDUCTION if half else cublas.Math.DEFAULT_MATH)
    if _STATE.get("math_mode") != mode:
        cublas.set_math_mode(handle, mode)
        _STATE["math_mode"] = mode


def _types(dtype):
    """(cuda data type, compute type, scalar numpy dtype) for an operand dtype."""
    cublas, _ = _cublas()
    ct = cublas.ComputeType
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return _CUDA_R_32F, int(ct.COMPUTE_32F_FAST_TF32 if tf32_allowed() else ct.COMPUTE_32F), np.float32
    if dtype == np.float64:
        return _CUDA_R_64F, int(ct.COMPUTE_64F), np.float64
    if dtype == np.float16:
        return _CUDA_R_16F, int(ct.COMPUTE_32F), np.float32
    if dtype_suffix(dtype) == "bf16":
        return _CUDA_R_16BF, int(ct.COMPUTE_32F), np.float32
    raise KernelError(f"dtype {dtype} is not supported by the cuBLAS launchers")


def gemm_rowmajor(
    c,
    a,
    b,
    m,
    n,
    k,
    *,
    trans_a=False,
    trans_b=False,
    a_cols=None,
    b_cols=None,
    alpha=1.0,
    beta=0.0,
    batch=1,
    stride_a=0,
    stride_b=0,
    stride_c=0,
    dtype=None,
    c_float32=False,
) -> None:
    """C (m, n) = alpha * op(A) @ op(B) + beta * C on row-major device buffers (addresses or GPUArrays).

    ``a_cols``/``b_cols`` are the row lengths of A and B as stored; strides are in elements.
    ``c_float32``: C is float32 while A and B are ``dtype`` (16-bit operands, float32 output).
    """
    cublas, handle = _cublas()
    data_type, compute, scalar = _types(dtype)
    c_type = _CUDA_R_32F if c_float32 else data_type
    _set_reduction_precision(cublas, handle, data_type)
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
    # Row-major C = A @ B is column-major C^T = B^T @ A^T: B goes first.
    head = (handle, op_b, op_a, int(n), int(m), int(k), alpha_h.ctypes.data)
    b_, a_, c_ = (b_ptr, data_type, lda), (a_ptr, data_type, ldb), (c_ptr, c_type, ldc)
    if batch == 1:
        cublas.gemm_ex(*head, *b_, *a_, beta_h.ctypes.data, *c_, compute, algo)
    else:
        strided = (*b_, int(stride_b), *a_, int(stride_a), beta_h.ctypes.data, *c_, int(stride_c), int(batch))
        cublas.gemm_strided_batched_ex(*head, *strided, compute, algo)


# -- batched products of strided views ----------------------------------------------------------

# A broadcast pattern that needs more strided-batched calls than this is materialised instead.
MAX_GEMM_CALLS = 16


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One (strided batched) GEMM of a plan, in ``gemm_rowmajor``'s terms; offsets and strides in elements."""

    a_off: int
    b_off: int
    c_off: int
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    batch: int = 1
    stride_a: int = 0
    stride_b: int = 0
    stride_c: int = 0


def _as_matrix(rows: int, cols: int, row_stride: int, col_stride: int) -> tuple[bool, int] | None:
    """How cuBLAS reads a (rows, cols) view with these element strides: (False, ld) for row-major
    rows ld apart, (True, ld) for the transpose of a row-major (cols, rows) matrix; None when neither
    stride is 1 (the view needs a copy)."""
    if col_stride == 1 or cols == 1:
        ld = row_stride if rows > 1 else cols
        if ld >= cols:
            return False, max(int(ld), 1)
    if row_stride == 1 or rows == 1:
        ld = col_stride if cols > 1 else rows
        if ld >= rows:
            return True, max(int(ld), 1)
    return None


def plan_gemm(a_shape, a_strides, b_shape, b_strides) -> tuple[list[GemmCall], tuple] | None:
    """The GEMM calls computing C = A @ B (numpy's batched matmul) for operand views of rank >= 2 given
    by shape and element strides (a broadcast axis may have stride 0), into a C-contiguous C of shape
    ``batch + (m, n)``: one strided-batched call per outer batch index once the batch axes are
    coalesced, or one plain GEMM when B is shared by every batch entry and A's rows stack evenly.
    Returns (calls, C's shape), or None when a matrix has no unit stride or the calls would exceed
    ``MAX_GEMM_CALLS``. Pure host code."""
    m, k = int(a_shape[-2]), int(a_shape[-1])
    n = int(b_shape[-1])
    mat_a = _as_matrix(m, k, a_strides[-2], a_strides[-1])
    mat_b = _as_matrix(k, n, b_strides[-2], b_strides[-1])
    if mat_a is None or mat_b is None:
        return None
    (ta, lda), (tb, ldb) = mat_a, mat_b
    batch = tuple(int(d) for d in np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))
    c_shape = batch + (m, n)

    def batch_strides(shape, strides):
        lead = len(batch) - (len(shape) - 2)
        dims, st = [1] * lead + list(shape[:-2]), [0] * lead + list(strides[:-2])
        return [0 if d == 1 else int(s) for d, s in zip(dims, st)]

    c_strides, step = [], m * n
    for d in reversed(batch):
        c_strides.insert(0, step)
        step *= d
    dims, (sa, sb, sc) = coalesce(batch, batch_strides(a_shape, a_strides), batch_strides(b_shape, b_strides), c_strides)
    base = dict(m=m, n=n, k=k, trans_a=ta, trans_b=tb, lda=lda, ldb=ldb)
    if not dims:
        return [GemmCall(0, 0, 0, **base)], c_shape
    if len(dims) == 1 and sb[0] == 0 and not ta and sa[0] == m * lda:
        # B shared by every batch entry and A's rows evenly spaced: one (batch*m, k) @ (k, n) GEMM.
        return [GemmCall(0, 0, 0, **{**base, "m": dims[0] * m})], c_shape
    outer = dims[:-1]
    if math.prod(outer) > MAX_GEMM_CALLS:
        return None
    calls = []
    for index in itertools.product(*(range(d) for d in outer)):
        offsets = [sum(i * s for i, s in zip(index, st[:-1])) for st in (sa, sb, sc)]
        calls.append(GemmCall(*offsets, **base, batch=dims[-1], stride_a=sa[-1], stride_b=sb[-1], stride_c=sc[-1]))
    return calls, c_shape


def _promoted(shape, strides, is_b: bool):
    """A 1-D operand as MatMul reads it: (1, K) for A, (K, 1) for B."""
    if len(shape) != 1:
        return list(shape), list(strides)
    return ([int(shape[0]), 1], [int(strides[0]), 0]) if is_b else ([1, int(shape[0])], [0, int(strides[0])])


def _materialised(x, shape, strides, batch):
    """A C-contiguous copy of the view (shape, strides) of ``x``, broadcast to ``batch`` + its matrix dims."""
    from gradgen.cuda import runtime as rt

    lead = len(batch) - (len(shape) - 2)
    full = tuple(batch) + tuple(shape[-2:])
    src = [0] * lead + [0 if d == 1 else s for d, s in zip(shape[:-2], strides[:-2])] + list(strides[-2:])
    out = rt.empty(full, x.dtype)
    copy_into(out, x, full, src)
    return out, list(full), list(rt.contiguous_strides(full))


def matmul_views(a, a_view, b, b_view, *, alpha: float = 1.0, bias=None):
    """alpha * A @ B (numpy's matmul, 1-D operands included) on cuBLAS, where A and B are the views
    ``(shape, element strides)`` of the device arrays ``a`` and ``b`` (transposed or batch-permuted
    operands are views, never copies); ``a`` and ``b`` share a float dtype. ``bias`` (of that dtype,
    broadcast to the output): added to the float32 accumulator (beta = 1 over a float32 output that
    starts as the bias), then the sum rounded once to the operands' type, as ``torch.addmm``
    computes it. A 16-bit output C would not do: on the H100, cuBLAS rounded a (2048 x 768) @
    (768 x 2304) bf16 product to bf16 before adding C (its default algorithm at that size; the smaller
    products in the tests added it in float32): the graph's two roundings again."""
    from gradgen.cuda import runtime as rt

    (a_shape, a_strides), (b_shape, b_strides) = a_view, b_view
    final = tuple(matmul_output_dims(a_shape, b_shape))
    a2_shape, a2_strides = _promoted(a_shape, a_strides, False)
    b2_shape, b2_strides = _promoted(b_shape, b_strides, True)
    k = int(a2_shape[-1])
    out_size = math.prod(final)
    if out_size == 0:
        return rt.empty(final, a.dtype)
    if k == 0:
        if bias is not None:
            return broadcast_to(bias, final)
        out = rt.empty(final, a.dtype)
        rt.memset_zero(out)
        return out
    planned = plan_gemm(a2_shape, a2_strides, b2_shape, b2_strides)
    if planned is None:
        batch = tuple(np.broadcast_shapes(tuple(a2_shape[:-2]), tuple(b2_shape[:-2])))
        a, a2_shape, a2_strides = _materialised(a, a2_shape, a2_strides, batch)
        b, b2_shape, b2_strides = _materialised(b, b2_shape, b2_strides, batch)
        planned = plan_gemm(a2_shape, a2_strides, b2_shape, b2_strides)
    calls, c_shape = planned
    if bias is not None and np.dtype(a.dtype).itemsize == 2:
        fused = _bias_epilogue_product(a, b, bias, calls, c_shape, alpha)
        if fused is not None:
            return fused.reshape(final)
    out = rt.empty(c_shape, a.dtype) if bias is None else _accumulator_from(bias, final, a.dtype).reshape(c_shape)
    float32_sum = out.dtype != a.dtype
    size, c_size = np.dtype(a.dtype).itemsize, np.dtype(out.dtype).itemsize
    a_ptr, b_ptr, c_ptr = int(a.gpudata), int(b.gpudata), int(out.gpudata)
    for c in calls:
        gemm_rowmajor(
            c_ptr + c.c_off * c_size,
            a_ptr + c.a_off * size,
            b_ptr + c.b_off * size,
            c.m,
            c.n,
            c.k,
            trans_a=c.trans_a,
            trans_b=c.trans_b,
            a_cols=c.lda,
            b_cols=c.ldb,
            alpha=alpha,
            beta=0.0 if bias is None else 1.0,
            batch=c.batch,
            stride_a=c.stride_a,
            stride_b=c.stride_b,
            stride_c=c.stride_c,
            dtype=a.dtype,
            c_float32=float32_sum,
        )
    return _rounded_once(out, a.dtype).reshape(final)


# -- cuBLASLt's bias epilogue ---------------------------------------------------------------------

LT_ENV = "GRADGEN_CUBLASLT_BIAS"  # "0": 16-bit products with a bias sum in a float32 C instead
# cuBLASLt's heuristics assume operands aligned to 256 bytes unless told otherwise (an algorithm may
# then read them with wide loads): an operand view at another offset takes the float32 C path
LT_ALIGNMENT = 256


def _lt():
    """(module, handle) of cuBLASLt, or None where it cannot be used (then the float32 C path runs)."""
    if "lt" not in _STATE:
        _STATE["lt"] = None
        if os.environ.get(LT_ENV, "1") != "0":
            try:
                from nvmath.bindings import cublasLt

                _cublas()  # the workspace the cuBLAS handle uses serves cuBLASLt too: one stream, in order
                _STATE["lt"] = (cublasLt, cublasLt.create())
            except Exception:  # noqa: BLE001 -- no cuBLASLt: the float32 C path is exact too
                _STATE["lt"] = None
    return _STATE["lt"]


def _lt_attribute(lt, desc, attribute, value) -> None:
    buffer = np.array(value, dtype=lt.get_matmul_desc_attribute_dtype(int(attribute)))
    lt.matmul_desc_set_attribute(desc, int(attribute), buffer.ctypes.data, buffer.nbytes)


def _lt_plan(call: GemmCall, dtype):
    """(matmul descriptor, four layouts, algorithm) for ``call`` with a bias epilogue, made once
    per GEMM geometry; None where cuBLASLt's heuristics offer no algorithm."""
    key = ("lt", call.m, call.n, call.k, call.trans_a, call.trans_b, call.lda, call.ldb, np.dtype(dtype).str)
    if key in _STATE:
        return _STATE[key]
    lt, handle = _lt()
    cublas, _ = _cublas()
    data_type, compute, _scalar = _types(dtype)
    attr, op = lt.MatmulDescAttribute, cublas.Operation
    desc = lt.matmul_desc_create(compute, _CUDA_R_32F)
    # Row-major C = A @ B as column-major C^T = B^T @ A^T, as gemm_rowmajor: B goes first.
    _lt_attribute(lt, desc, attr.TRANSA, int(op.T if call.trans_b else op.N))
    _lt_attribute(lt, desc, attr.TRANSB, int(op.T if call.trans_a else op.N))
    _lt_attribute(lt, desc, attr.EPILOGUE, int(lt.Epilogue.BIAS))
    _lt_attribute(lt, desc, attr.BIAS_DATA_TYPE, data_type)
    first = (call.k, call.n) if call.trans_b else (call.n, call.k)
    second = (call.m, call.k) if call.trans_a else (call.k, call.m)
    layouts = (
        lt.matrix_layout_create(data_type, *first, max(1, call.ldb)),
        lt.matrix_layout_create(data_type, *second, max(1, call.lda)),
        lt.matrix_layout_create(data_type, call.n, call.m, max(1, call.n)),
    )
    preference, most = lt.matmul_preference_create(), int(lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES)
    size = np.array(CUBLAS_WORKSPACE_BYTES, dtype=lt.get_matmul_preference_attribute_dtype(most))
    lt.matmul_preference_set_attribute(preference, most, size.ctypes.data, size.nbytes)
    results, found = lt.MatmulHeuristicResult(1), np.zeros(1, np.int32)
    lt.matmul_algo_get_heuristic(handle, desc, *layouts, layouts[2], preference, 1, results.ptr, found.ctypes.data)
    lt.matmul_preference_destroy(preference)
    plan = (desc, layouts, results) if found[0] > 0 else None
    _STATE[key] = plan
    return plan


def _bias_epilogue_product(a, b, bias, calls: list[GemmCall], c_shape, alpha: float):
    """A 16-bit product plus a bias along its last axis in one cuBLASLt call: its BIAS epilogue adds
    the bias to the float32 accumulator and rounds the sum once (what the float32 C computes,
    without the float32 buffer, the broadcast and the cast). None where it does not apply (a
    batched call, a bias that is not one row of the output) or cuBLASLt is not there."""
    if len(calls) != 1 or calls[0].batch != 1 or calls[0].c_off or bias.ndim != 1 or bias.shape[0] != calls[0].n:
        return None
    if not (calls[0].m and calls[0].n and calls[0].k):  # an empty product: cuBLASLt refuses the layouts
        return None
    size, call, bias = np.dtype(a.dtype).itemsize, calls[0], contiguous(bias)
    pointers = (int(a.gpudata) + call.a_off * size, int(b.gpudata) + call.b_off * size, int(bias.gpudata))
    if any(pointer % LT_ALIGNMENT for pointer in pointers) or _lt() is None:
        return None
    try:
        return _lt_bias_gemm(a, b, bias, call, c_shape, alpha)
    except Exception as exc:  # noqa: BLE001 -- a cuBLASLt that refuses: the float32 C path for the rest of the process
        _STATE["lt"], _STATE["lt_error"] = None, f"{type(exc).__name__}: {exc}"
        return None


def _lt_bias_gemm(a, b, bias, call: GemmCall, c_shape, alpha: float):
    from gradgen.cuda import runtime as rt

    plan = _lt_plan(call, a.dtype)
    if plan is None:
        return None
    lt, handle = _lt()
    desc, layouts, results = plan
    _lt_attribute(lt, desc, lt.MatmulDescAttribute.BIAS_POINTER, int(bias.gpudata))
    out = rt.empty(c_shape, a.dtype)
    if int(out.gpudata) % LT_ALIGNMENT:  # the arena and the pool give 256-byte blocks; never assumed
        return None
    size = np.dtype(a.dtype).itemsize
    alpha_h, beta_h = np.array([alpha], np.float32), np.zeros(1, np.float32)
    workspace = _STATE["workspace"]
    lt.matmul(
        handle,
        desc,
        alpha_h.ctypes.data,
        int(b.gpudata) + call.b_off * size,
        layouts[0],
        int(a.gpudata) + call.a_off * size,
        layouts[1],
        beta_h.ctypes.data,
        int(out.gpudata),
        layouts[2],
        int(out.gpudata),
        layouts[2],
        int(results.ptr) + lt.matmul_heuristic_result_dtype.fields["algo"][1],  # the chosen algorithm
        int(workspace.gpudata),
        CUBLAS_WORKSPACE_BYTES,
        int(rt.stream().handle),
    )
    return out


def _accumulator_from(c, shape, operand_dtype):
    """The GEMM's output buffer, starting as ``c`` broadcast to ``shape``: float32 for 16-bit
    operands, so that cuBLAS adds C to its float32 accumulator and the sum is rounded once (a
    16-bit C is rounded before the add at real sizes: see ``matmul_views``); ``c``'s type otherwise."""
    from gradgen.kernels.cuda.elementwise import cast_to

    if np.dtype(operand_dtype).itemsize == 2:
        c = cast_to(c, np.float32)
    return broadcast_to(c, shape)


def _rounded_once(out, operand_dtype):
    """A GEMM's output in the operands' type: a float32 accumulator (``_accumulator_from``) cast once."""
    from gradgen.kernels.cuda.elementwise import cast_to

    return out if out.dtype == operand_dtype else cast_to(out, operand_dtype)


def _view(x, perm=None):
    shape, strides = [int(d) for d in x.shape], element_strides(x)
    if perm is None:
        return shape, strides
    return [shape[p] for p in perm], [strides[p] for p in perm]


@cuda_kernel("QLinearMatMul")
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point=None):
    """The CPU kernel's steps on the device: (a - a_zero_point) @ (b - b_zero_point) as a float64
    GEMM (exact for 8-bit operands), requantized (gradgen/kernels/cuda/quantize.py)."""
    from gradgen.kernels.cpu import matmul as cpu
    from gradgen.kernels.cpu.quantize import check_linear_quantized, requantized_type
    from gradgen.kernels.cuda.quantize import requantize, scale_ratio, wide_operand
    from gradgen.kernels.cuda.shape import reshaped

    check_linear_quantized("QLinearMatMul", a, a_zero_point, b, b_zero_point, y_zero_point, (a_scale, b_scale, y_scale))
    shapes = cpu.qlinear_matmul_shapes(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)
    accumulated = matmul(
        wide_operand(a, a_zero_point, shapes.get("a_zero_point")), wide_operand(b, b_zero_point, shapes.get("b_zero_point"))
    )
    ratio = scale_ratio(a_scale, b_scale, y_scale, (shapes["a_scale"], shapes["b_scale"], shapes["y_scale"]))
    y_zp = None if y_zero_point is None else reshaped(y_zero_point, shapes["y_zero_point"])
    return requantize(accumulated, ratio, y_zp, requantized_type(y_zero_point, a.dtype))


@cuda_kernel("MatMul")
def matmul(a, b):
    from gradgen.kernels.cpu import matmul as cpu

    cpu.check_matmul_shapes(a.shape, b.shape)
    if a.dtype != b.dtype or not is_float(a.dtype):
        return cpu_fallback("MatMul", a, b)
    return matmul_views(a, _view(a), b, _view(b))


@cuda_kernel("FusedMatMul", domain=MICROSOFT)
def fused_matmul(A, B, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * MatMul(op(A), op(B)) (``gradgen.ops.matmul``): the transpositions are cuBLAS's
    transpose flags and leading dimensions over the operands as stored, never copies."""
    flags = dict(transA=transA, transB=transB, transBatchA=transBatchA, transBatchB=transBatchB)
    check_fused_ranks(len(A.shape), len(B.shape), bool(transBatchA), bool(transBatchB))
    if A.dtype != B.dtype or not is_float(A.dtype):
        return cpu_fallback("FusedMatMul", A, B, domain=MICROSOFT, alpha=alpha, **flags)
    try:
        matmul_output_dims(
            fused_operand_dims(list(A.shape), bool(transA), bool(transBatchA)),
            fused_operand_dims(list(B.shape), bool(transB), bool(transBatchB)),
        )
    except KernelError as exc:
        raise KernelError(f"FusedMatMul of shapes {list(A.shape)} and {list(B.shape)} ({flags}): {exc}") from None
    a_view, b_view = _fused_views(A, B, **flags)
    return matmul_views(A, a_view, B, b_view, alpha=float(alpha))


def _fused_views(a, b, *, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """FusedMatMul's operands as ``matmul_views`` takes them: its transpositions as views."""
    a_view = _view(a, fused_operand_perm(len(a.shape), bool(transA), bool(transBatchA)))
    b_view = _view(b, fused_operand_perm(len(b.shape), bool(transB), bool(transBatchB)))
    return a_view, b_view


def matmul_bias(a, b, bias, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """MatMul (or FusedMatMul, with its attributes) of 16-bit A and B plus a 1-D ``bias`` along the
    last axis, rounded once (gradgen/executor/excess_precision.py). Other operands: the product,
    then the Add, as the graph spells them."""
    from gradgen.kernels.cuda.elementwise import add

    flags = dict(transA=transA, transB=transB, transBatchA=transBatchA, transBatchB=transBatchB)
    fused = alpha != 1.0 or any(flags.values())
    product = (lambda: fused_matmul(a, b, alpha=alpha, **flags)) if fused else (lambda: matmul(a, b))
    if a.dtype != b.dtype or bias.dtype != a.dtype or not is_float(a.dtype) or bias.ndim != 1:
        return add(product(), bias)
    check_fused_ranks(len(a.shape), len(b.shape), bool(transBatchA), bool(transBatchB))
    a_view, b_view = _fused_views(a, b, **flags)
    try:
        final = matmul_output_dims(a_view[0], b_view[0])
    except KernelError:
        return product()  # its own error, as the graph's MatMul reports it
    if not final or bias.shape[0] != final[-1]:
        return add(product(), bias)
    return matmul_views(a, a_view, b, b_view, alpha=float(alpha), bias=bias)


@cuda_kernel("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    """alpha * op(A) @ op(B) + beta * C; 16-bit operands with a C sum it in float32 and round once,
    as the CPU and ``torch.addmm`` do (see ``matmul_views``)."""
    from gradgen.cuda import runtime as rt

    if a.ndim != 2 or b.ndim != 2:
        raise KernelError(f"Gemm needs 2-D A and B, got shapes {list(a.shape)} and {list(b.shape)}")
    m, k = (a.shape[1], a.shape[0]) if transA else a.shape
    k_b, n = (b.shape[1], b.shape[0]) if transB else b.shape
    if k != k_b:
        raise KernelError(f"inner dimensions differ: op(A) is {[m, k]}, op(B) is {[k_b, n]} (transA={transA}, transB={transB})")
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
    if use_c and beta == 1.0 and k and np.dtype(a.dtype).itemsize == 2 and c.size == n and c.shape[-1] == n:
        call = GemmCall(0, 0, 0, int(m), int(n), int(k), bool(transA), bool(transB), int(a.shape[1]), int(b.shape[1]))
        fused = _bias_epilogue_product(a, b, contiguous(c).reshape(int(n)), [call], (int(m), int(n)), float(alpha))
        if fused is not None:
            return fused
    out = _accumulator_from(c, (m, n), a.dtype) if use_c else rt.empty((m, n), a.dtype)
    float32_sum = out.dtype != a.dtype
    if out.size == 0:
        return rt.empty((m, n), a.dtype)
    if k == 0 and not use_c:
        rt.memset_zero(out)
        return out
    gemm_rowmajor(
        out,
        a if k else out,
        b if k else out,
        int(m),
        int(n),
        int(k),
        trans_a=bool(transA),
        trans_b=bool(transB),
        a_cols=int(a.shape[1]),
        b_cols=int(b.shape[1]),
        alpha=float(alpha),
        beta=float(beta) if use_c else 0.0,
        dtype=a.dtype,
        c_float32=float32_sum,
    )
    return _rounded_once(out, a.dtype)


# ---------------------------------------------------------------- Einsum


def _group_view(shape, strides, groups) -> tuple[list[int], list[int]] | None:
    """The view (shape, element strides) with each group of consecutive dims merged into one dim, or
    None when a group's dims (size-1 dims aside) are not laid out as one strided dim."""
    out_shape, out_strides = [], []
    for group in groups:
        dims = [d for d in group if shape[d] != 1]
        if any(strides[a] != strides[b] * shape[b] for a, b in zip(dims, dims[1:])):
            return None
        out_shape.append(math.prod(shape[d] for d in group))
        out_strides.append(strides[dims[-1]] if dims else 0)
    return out_shape, out_strides


def _einsum_operand(x, term, order, groups):
    """(array, view) of ``x`` (labelled ``term``) with its dims in the label ``order`` and merged into
    ``groups``: a view of x where its strides allow, else of a transposed copy."""
    from gradgen.kernels.cuda.shape import transpose

    perm = [term.index(lab) for lab in order]
    shape, strides = _view(x, perm)
    view = _group_view(shape, strides, groups)
    if view is None:
        x = transpose(x, perm=perm)
        view = _group_view([int(d) for d in x.shape], element_strides(x), groups)
        assert view is not None  # a C-contiguous array merges any consecutive dims
    return x, view


def _einsum_sum_out(x, term, keep):
    """``x`` summed over the dims whose labels are not in ``keep`` (ReduceSum's launcher), and the
    labels left."""
    from gradgen.kernels.cuda.reduction import reduce

    axes = tuple(d for d, lab in enumerate(term) if lab not in keep)
    if not axes:
        return x, term
    return reduce("sum", x, axes, False, "ReduceSum"), tuple(lab for lab in term if lab in keep)


def _einsum_to_output(y, labels, output, fresh: bool):
    """``y`` (labelled ``labels``) with its dims in the output's order, in memory of its own (a copy
    where ``y`` is not ``fresh`` and already in that order)."""
    from gradgen.kernels.cuda.shape import transpose

    perm = [labels.index(lab) for lab in output]
    if perm != sorted(perm):
        return transpose(y, perm=perm)
    return y if fresh else copy(y)


@cuda_kernel("Einsum")
def einsum(*inputs, equation):
    """One operand: a sum over the labels left out (ReduceSum's launcher) and a transpose. Two: the
    labels each holds alone and leaves out summed first, then one batched matmul over views (the
    labels in both operands and the output are its batch, those in both but not the output its
    contraction, the others its rows and columns; a transposed copy only where an operand's dims do
    not merge), then a transpose into the output's order. Float operands of one dtype; a label
    repeated within an operand (a diagonal), contracted or kept dims of different sizes, three or
    more operands and other dtypes run the CPU kernel."""
    from gradgen.cuda import runtime as rt
    from gradgen.ops.einsum import explicit_equation, parse_equation

    parsed = explicit_equation(parse_equation(equation, len(inputs)), [len(x.shape) for x in inputs])
    terms, output = parsed.inputs, parsed.output
    sizes: dict[str, set[int]] = {}
    for term, x in zip(terms, inputs):
        for lab, d in zip(term, x.shape):
            sizes.setdefault(lab, set()).add(int(d))
    dtype = np.dtype(inputs[0].dtype)
    usable = (
        len(inputs) in (1, 2)
        and all(len(set(t)) == len(t) for t in terms)
        and all(np.dtype(x.dtype) == dtype for x in inputs)
        and is_float(dtype)
    )
    batch = [lab for lab in output if all(lab in t for t in terms)] if len(terms) == 2 else []
    # only a batch label may broadcast (size 1 against n), as a batched matmul's batch dims do
    if not usable or any(len(s - {1}) > 1 or (len(s) > 1 and lab not in batch) for lab, s in sizes.items()):
        return cpu_fallback("Einsum", *inputs, equation=equation)
    out_shape = tuple(next(iter(sizes[lab] - {1}), 1) if lab in batch else next(iter(sizes[lab])) for lab in output)
    if math.prod(out_shape) == 0:
        return rt.empty(out_shape, dtype)
    if len(inputs) == 1:
        (x,), (term,) = inputs, terms
        y, labels = _einsum_sum_out(x, term, set(output))
        return _einsum_to_output(y, labels, output, fresh=y is not x)
    (a, b), (ta, tb) = inputs, terms
    a, ta = _einsum_sum_out(a, ta, set(output) | set(tb))
    b, tb = _einsum_sum_out(b, tb, set(output) | set(ta))
    rows = [lab for lab in output if lab in ta and lab not in tb]
    cols = [lab for lab in output if lab in tb and lab not in ta]
    inner = [lab for lab in ta if lab in tb and lab not in output]
    nb = len(batch)
    groups = [[d] for d in range(nb)]
    a_groups = [*groups, list(range(nb, nb + len(rows))), list(range(nb + len(rows), nb + len(rows) + len(inner)))]
    b_groups = [*groups, list(range(nb, nb + len(inner))), list(range(nb + len(inner), nb + len(inner) + len(cols)))]
    a, a_view = _einsum_operand(a, ta, [*batch, *rows, *inner], a_groups)
    b, b_view = _einsum_operand(b, tb, [*batch, *inner, *cols], b_groups)
    y = matmul_views(a, a_view, b, b_view)
    labels = [*batch, *rows, *cols]
    y = y.reshape(tuple(out_shape[output.index(lab)] for lab in labels))
    return _einsum_to_output(y, labels, output, fresh=True)


# ---------------------------------------------------------------- DFT

DFT_MATRIX_BYTES = 64 << 20  # a larger DFT matrix (a long transform) runs the CPU kernel's FFT instead


def _unit_circle(r, n: int):
    """(cos, sin) of 2 pi r / n for integers 0 <= r < n, exact at the quarter turns (so that the
    terms numpy's FFT leaves out, e.g. the imaginary part of a one-sided inverse's Nyquist bin,
    weigh exactly 0)."""
    angle = 2 * np.pi * r / n
    cos, sin = np.cos(angle), np.sin(angle)
    quarter = (4 * r) % n == 0
    turn = (4 * r) // n % 4
    cos = np.where(quarter, np.array([1.0, 0.0, -1.0, 0.0])[turn], cos)
    sin = np.where(quarter, np.array([0.0, 1.0, 0.0, -1.0])[turn], sin)
    return cos, sin


def dft_matrix(size: int, parts: int, n: int, inverse: bool, onesided: bool) -> np.ndarray:
    """The real float64 matrix M with which a line of ``size`` samples of ``parts`` (1: real, 2: real
    and imaginary) values, flattened, gives the CPU kernel's DFT of length ``n`` as ``line @ M``,
    flattened (frequency or time, 1 or 2 parts): samples past what the transform reads (the first n;
    n // 2 + 1 bins for a one-sided inverse) have zero rows, which is numpy's truncation, and zero
    padding needs no rows. A one-sided forward transform keeps the first n // 2 + 1 frequencies; a
    one-sided inverse is numpy's irfft: x_t = (1/n) sum_j w_j Re(X_j e^{2 pi i j t / n}), w_j = 2
    but for the DC and Nyquist bins (whose imaginary parts weigh 0)."""
    irfft = inverse and onesided
    read = min(size, n // 2 + 1 if irfft else n)
    outputs = n if irfft or not onesided else n // 2 + 1
    j = np.arange(read, dtype=np.int64)[:, None]
    cos, sin = _unit_circle((j * np.arange(outputs, dtype=np.int64)[None, :]) % n, n)
    if irfft:
        weight = np.where((j == 0) | (2 * j == n), 1.0, 2.0) / n
        m = np.zeros((size, parts, outputs, 1))
        m[:read, 0, :, 0] = weight * cos
        if parts == 2:
            m[:read, 1, :, 0] = -weight * sin
        return m.reshape(size * parts, outputs)
    sign, scale = (1.0, 1.0 / n) if inverse else (-1.0, 1.0)
    m = np.zeros((size, parts, outputs, 2))
    m[:read, 0, :, 0] = scale * cos
    m[:read, 0, :, 1] = sign * scale * sin
    if parts == 2:
        m[:read, 1, :, 0] = -sign * scale * sin
        m[:read, 1, :, 1] = scale * cos
    return m.reshape(size * parts, outputs * 2)


_DFT_MATRICES: dict = {}


def _dft_matrix_on_device(size: int, parts: int, n: int, inverse: bool, onesided: bool, dtype):
    """``dft_matrix`` in ``dtype`` on the device, uploaded once per transform (kept for the
    process, released at exit while the context is current)."""
    from gradgen.cuda import runtime as rt

    def upload():
        if not _DFT_MATRICES:
            rt.drop_at_exit(_DFT_MATRICES.clear)
        with rt.persistent():
            return rt.to_device(dft_matrix(size, parts, n, inverse, onesided).astype(dtype))

    return plan_cache(_DFT_MATRICES, (size, parts, n, inverse, onesided, np.dtype(dtype).str), upload)


@cuda_kernel("DFT", host_inputs=(1, 2))
def dft(x, dft_length=None, axis_value=None, *, axis=None, inverse=0, onesided=0):
    """The CPU kernel's DFT (numpy's fft, ifft or irfft; zero padding or truncation to the length)
    as one GEMM: X's lines along the axis, moved next to the last (real / imaginary) axis by a
    transpose where they are not already, times ``dft_matrix`` (uploaded once per transform), then
    moved back. float32 and float64 in their own type, 16-bit floats in float32 rounded once (as
    the CPU backend computes them); a transform whose matrix would exceed ``DFT_MATRIX_BYTES`` and
    other dtypes run the CPU kernel."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu.matmul import dft_axis_and_length
    from gradgen.kernels.cuda.elementwise import in_float32
    from gradgen.kernels.cuda.shape import transpose

    attrs = dict(axis=axis, inverse=inverse, onesided=onesided)
    shape = tuple(int(d) for d in x.shape)
    ax, n = dft_axis_and_length(shape, dft_length, axis_value, axis, inverse, onesided)
    size, parts = shape[ax], shape[-1]
    irfft = bool(inverse) and bool(onesided)
    outputs = n if irfft or not onesided else n // 2 + 1
    out_parts = 1 if irfft else 2
    compute = np.dtype(np.float64 if np.dtype(x.dtype) == np.float64 else np.float32)
    if not is_float(x.dtype) or size * parts * outputs * out_parts * compute.itemsize > DFT_MATRIX_BYTES:
        return cpu_fallback("DFT", x, dft_length, axis_value, **attrs)
    rank = len(shape)
    out_shape = (*shape[:ax], outputs, *shape[ax + 1 : -1], out_parts)
    if math.prod(out_shape) == 0:
        return rt.empty(out_shape, x.dtype)
    perm = [d for d in range(rank - 1) if d != ax] + [ax, rank - 1]  # the axis next to the parts' axis

    def run(xc):
        lines = xc if ax == rank - 2 else transpose(xc, perm=perm)
        lines = contiguous(lines)
        rows = math.prod(lines.shape[:-2])
        m = _dft_matrix_on_device(size, parts, n, bool(inverse), bool(onesided), compute)
        width, out_width = size * parts, outputs * out_parts
        y = matmul_views(lines, ((rows, width), [width, 1]), m, ((width, out_width), [out_width, 1]))
        y = y.reshape((*lines.shape[:-2], outputs, out_parts))
        return y if ax == rank - 2 else transpose(y, perm=[int(p) for p in np.argsort(perm)])

    return in_float32(run, x)


# ---------------------------------------------------------------- Det

DET_MAX_ORDER = 32  # larger matrices run the CPU kernel (LAPACK): one thread per matrix is n^3 / 3 work


@cuda_kernel("Det")
def det(x):
    """Determinants of the trailing square matrices of X: matmul.cu's det_lu, one thread per matrix
    factorising a copy (LU with partial pivoting; the product of the pivots, negated per row swap),
    float32 and float64 in their own type, 16-bit floats in float32 rounded once (the CPU kernel's
    accumulation type); an empty matrix's determinant is 1. Matrices larger than DET_MAX_ORDER and
    other dtypes run the CPU kernel."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.elementwise import in_float32

    shape = tuple(int(d) for d in x.shape)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise KernelError(f"X must end in square matrices, got shape {list(shape)}")
    n = shape[-1]
    if not is_float(x.dtype) or n > DET_MAX_ORDER:
        return cpu_fallback("Det", x)

    def run(xc):
        out = rt.empty(shape[:-2], xc.dtype)
        if out.size and n == 0:
            fill(out, 1)
        elif out.size:
            work = copy(xc)  # factorised in place
            kernel = kernel_of("matmul", f"det_lu_{dtype_suffix(xc.dtype)}")
            launch(kernel, out.size, out, work, np.int64(out.size), np.int64(n))
        return out

    return in_float32(run, x)
