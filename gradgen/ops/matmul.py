"""MatMul-family semantics: how FusedMatMul (com.microsoft, ONNX Runtime's contract) reads its operands.

``FusedMatMul(A, B) = alpha * MatMul(op(A), op(B))``. For an operand of rank >= 2, ``op`` first moves
axis 0 in front of the last axis when ``transBatch`` is set (``[d0, b1..bn, X]`` is read as
``[b1..bn, d0, X]``), then swaps the last two axes when ``trans`` is set. A rank-1 operand ignores
both flags (numpy's transpose of a vector changes nothing). ``transBatch`` on either operand needs
both operands of one rank >= 3 (ONNX Runtime's kernels refuse anything else). What remains is
MatMul: numpy's rules for 1-D operands and batch broadcasting.

Shapes here are lists of dims: ints, symbolic names (str) or None (unknown).
"""

from __future__ import annotations

from collections.abc import Sequence

from gradgen.errors import KernelError


def fused_operand_perm(rank: int, trans: bool, trans_batch: bool) -> list[int] | None:
    """The Transpose permutation that gives ``op(X)`` of a rank-``rank`` operand; None when op is the identity."""
    if rank < 2:
        return None
    perm = list(range(rank))
    if trans_batch and rank >= 3:
        perm = perm[1:-1] + [0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return None if perm == list(range(rank)) else perm


def fused_operand_dims(dims: Sequence, trans: bool, trans_batch: bool) -> list:
    """The dims of ``op(X)`` for an operand of dims ``dims``."""
    perm = fused_operand_perm(len(dims), trans, trans_batch)
    return list(dims) if perm is None else [dims[p] for p in perm]


def check_fused_ranks(rank_a: int, rank_b: int, trans_batch_a: bool, trans_batch_b: bool) -> None:
    """KernelError unless the ranks fit: both >= 1, and one rank >= 3 when a transBatch flag is set."""
    if rank_a < 1 or rank_b < 1:
        raise KernelError(f"FusedMatMul inputs must have rank >= 1, got ranks {rank_a} and {rank_b}")
    if (trans_batch_a or trans_batch_b) and not (rank_a == rank_b and rank_a >= 3):
        raise KernelError(
            f"FusedMatMul with transBatchA or transBatchB needs inputs of one rank >= 3, got ranks {rank_a} and {rank_b}"
        )


def _broadcast_dim(a, b):
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    if isinstance(a, int) and isinstance(b, int):
        raise KernelError(f"batch dimensions {a} and {b} are not broadcastable")
    return None


def matmul_output_dims(a_dims: Sequence, b_dims: Sequence) -> list:
    """MatMul's output dims (numpy's rules) from its operands' dims; KernelError when known dims
    contradict (inner sizes, batch broadcasting)."""
    a2 = [1, *a_dims] if len(a_dims) == 1 else list(a_dims)
    b2 = [*b_dims, 1] if len(b_dims) == 1 else list(b_dims)
    k_a, k_b = a2[-1], b2[-2]
    if isinstance(k_a, int) and isinstance(k_b, int) and k_a != k_b:
        raise KernelError(f"inner dimensions differ: {list(a_dims)} has {k_a} columns, {list(b_dims)} has {k_b} rows")
    batch_a, batch_b = a2[:-2], b2[:-2]
    n = max(len(batch_a), len(batch_b))
    batch_a = [1] * (n - len(batch_a)) + batch_a
    batch_b = [1] * (n - len(batch_b)) + batch_b
    out = [_broadcast_dim(x, y) for x, y in zip(batch_a, batch_b)]
    if len(a_dims) > 1:
        out.append(a2[-2])
    if len(b_dims) > 1:
        out.append(b2[-1])
    return out


def fused_matmul_output_dims(a_dims: Sequence, b_dims: Sequence, *, transA=0, transB=0, transBatchA=0, transBatchB=0) -> list:
    """FusedMatMul's output dims (alpha does not change them); KernelError when they cannot fit."""
    check_fused_ranks(len(a_dims), len(b_dims), bool(transBatchA), bool(transBatchB))
    return matmul_output_dims(
        fused_operand_dims(a_dims, bool(transA), bool(transBatchA)), fused_operand_dims(b_dims, bool(transB), bool(transBatchB))
    )
