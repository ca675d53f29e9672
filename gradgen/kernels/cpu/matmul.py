"""CPU kernels: MatMul, Gemm and Einsum.

Shapes are checked up front so that a mismatch names both operands' shapes rather than
surfacing as numpy's generic error.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.numeric import accumulation_dtype
from gradgen.kernels.table import MICROSOFT, cpu_kernel


def check_matmul_shapes(a_shape, b_shape) -> None:
    """MatMul's shape rules (numpy matmul's, 1-D operands included); KernelError when broken."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if not a_shape or not b_shape:
        raise KernelError(f"MatMul inputs must have rank >= 1, got shapes {list(a_shape)} and {list(b_shape)}")
    k_a = a_shape[-1]
    k_b = b_shape[0] if len(b_shape) == 1 else b_shape[-2]
    if k_a != k_b:
        raise KernelError(
            f"inner dimensions differ: A {list(a_shape)} has {k_a} columns, B {list(b_shape)} has {k_b} rows"
        )
    try:
        np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise KernelError(
            f"batch dimensions of A {list(a_shape)} and B {list(b_shape)} are not broadcastable"
        ) from None


@cpu_kernel("MatMul")
def matmul(a, b):
    check_matmul_shapes(a.shape, b.shape)
    return np.matmul(a, b).astype(np.result_type(a, b), copy=False)


@cpu_kernel("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    if a.ndim != 2 or b.ndim != 2:
        raise KernelError(f"Gemm needs 2-D A and B, got shapes {list(a.shape)} and {list(b.shape)}")
    a2 = a.T if transA else a
    b2 = b.T if transB else b
    if a2.shape[1] != b2.shape[0]:
        raise KernelError(
            f"inner dimensions differ: op(A) is {list(a2.shape)}, op(B) is {list(b2.shape)} "
            f"(transA={transA}, transB={transB})"
        )
    dtype = a.dtype
    out = a2 @ b2
    if alpha != 1.0:
        out = alpha * out
    if c is not None and beta != 0:
        m, n = out.shape
        try:
            cb = np.broadcast_to(c, (m, n))
        except ValueError:
            raise KernelError(f"C of shape {list(c.shape)} does not broadcast to the output shape [{m}, {n}]") from None
        out = out + (beta * cb if beta != 1.0 else cb)
    return np.asarray(out).astype(dtype, copy=False)


@cpu_kernel("Einsum")
def einsum(*inputs, equation):
    equation = equation.replace(" ", "")
    lhs = equation.split("->")[0]
    terms = lhs.split(",")
    if len(terms) != len(inputs):
        raise KernelError(f"equation {equation!r} has {len(terms)} operand(s), the node has {len(inputs)} input(s)")
    for i, (term, x) in enumerate(zip(terms, inputs)):
        letters = len(term.replace("...", ""))
        if ("..." in term and letters > x.ndim) or ("..." not in term and letters != x.ndim):
            raise KernelError(f"operand {i} of equation {equation!r} ({term!r}) does not fit its shape {list(x.shape)}")
    try:
        out = np.einsum(equation, *inputs)
    except ValueError as exc:
        raise KernelError(f"equation {equation!r} with shapes {[list(x.shape) for x in inputs]}: {exc}") from None
    return np.asarray(out).astype(np.result_type(*inputs), copy=False)


# ---------------------------------------------------------------------------------------------
# FusedMatMul (com.microsoft)


@cpu_kernel("FusedMatMul", domain=MICROSOFT)
def fused_matmul(A, B, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * MatMul(op(A), op(B)); op transposes the last two axes (trans) and moves axis 0 to
    the second-to-last position first (transBatch). Rank-1 inputs ignore both flags."""
    a = _matmul_operand(A, transA, transBatchA)
    b = _matmul_operand(B, transB, transBatchB)
    ct = accumulation_dtype(A.dtype)
    try:
        y = np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False))
    except ValueError as exc:
        raise KernelError(f"FusedMatMul of shapes {list(A.shape)} and {list(B.shape)} (transA={transA}, transB={transB}, "
                          f"transBatchA={transBatchA}, transBatchB={transBatchB}) is not possible: {exc}") from None
    if float(alpha) != 1.0:
        y = y * ct.type(alpha)
    return np.asarray(y, dtype=A.dtype)


def _matmul_operand(A, trans: int, trans_batch: int):
    """A as MatMul sees it: transBatch moves dim 0 in front of the last one, trans swaps the last two."""
    if A.ndim == 0:
        raise KernelError("FusedMatMul inputs must have rank >= 1")
    if A.ndim == 1:
        return A
    if trans_batch:
        A = np.moveaxis(A, 0, -2)
    if trans:
        A = np.swapaxes(A, -1, -2)
    return A
