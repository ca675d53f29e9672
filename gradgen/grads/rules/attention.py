"""Gradient rules of the attention family: ONNX Attention and com.microsoft MultiHeadAttention are
differentiated in their standard-op forms (gradgen/passes/lowering/attention.py), which
DecomposePass makes before the gradient pass; these entries mark them differentiable and turn a
pipeline that left one in place into a one-line error."""

from __future__ import annotations

from gradgen.grads.rules.elementwise import left_in_place
from gradgen.grads.table import grad_rule
from gradgen.ops.schemas import MICROSOFT_DOMAIN


@grad_rule("Attention", nondiff_inputs=(6,))
@grad_rule("MultiHeadAttention", domain=MICROSOFT_DOMAIN, nondiff_inputs=(4, 8, 9))
def attention(g):
    """Differentiated in its standard-op form (left_in_place)."""
    raise left_in_place(g)
