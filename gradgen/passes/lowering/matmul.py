"""Lowering of FusedMatMul (the matmul family) to standard ONNX ops: Transpose of each flagged
operand, MatMul, and Mul by alpha when alpha is not 1."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import KernelError, ModelError
from gradgen.ops.attributes import get_attr
from gradgen.ops.matmul import check_fused_ranks, fused_operand_perm
from gradgen.passes.lowering.table import BASE_OPSET, CASTLIKE_OPSET, node_input, node_where, register_lowering


def _needs_opset(node: ir.Node) -> int:
    """CastLike (opset 15) only for an alpha whose element type is unknown."""
    a = node_input(node, 0)
    if float(get_attr(node, "alpha", 1.0)) != 1.0 and (a is None or a.dtype is None):
        return CASTLIKE_OPSET
    return BASE_OPSET


@register_lowering("FusedMatMul", min_opset=_needs_opset)
def lower_fused_matmul(e: GraphBuilder, node: ir.Node):
    """alpha * MatMul(op(A), op(B)), op as in ``gradgen.ops.matmul``."""
    a, b = node_input(node, 0), node_input(node, 1)
    flags = {k: int(get_attr(node, k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")}
    ranks = [None if v.shape is None else len(v.shape) for v in (a, b)]
    if None in ranks:
        raise ModelError(f"{node_where(node)}: the ranks of its inputs are unknown; lowering it needs them")
    try:
        check_fused_ranks(ranks[0], ranks[1], bool(flags["transBatchA"]), bool(flags["transBatchB"]))
    except KernelError as exc:
        raise ModelError(f"{node_where(node)}: {exc}") from None
    operands = []
    for x, rank, trans, batch in (
        (a, ranks[0], flags["transA"], flags["transBatchA"]),
        (b, ranks[1], flags["transB"], flags["transBatchB"]),
    ):
        perm = fused_operand_perm(rank, bool(trans), bool(batch))
        operands.append(x if perm is None else e.transpose(x, perm))
    y = e.op("MatMul", *operands)
    alpha = float(get_attr(node, "alpha", 1.0))
    if alpha != 1.0:
        if a.dtype is not None:
            scale = e.const(np.array(alpha, dtype=a.dtype.numpy()))
        else:
            scale = e.op("CastLike", e.const(np.array(alpha, dtype=np.float32)), y)
        y = e.op("Mul", y, scale)
    return [y]
