"""LSTM, GRU and RNN: differentiated through their unrolled form.

build_backward's pipeline runs ``gradgen.passes.UnrollRecurrentPass`` before the gradient pass: it
rewrites each recurrent node into standard ops over its static sequence length (MatMul, Gemm,
Split, the activations, Where for ``sequence_lens``), which the other families' rules
differentiate. The entries below make these ops known as differentiable (``gradgen ops``) and
turn a pipeline that left them in place into a one-line error rather than a missing-rule list.
"""

from __future__ import annotations

from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule


@grad_rule("LSTM", "GRU", "RNN", nondiff_inputs=(4,))
def _unrolled_first(g):
    node = g.node
    raise ModelError(
        f"node {node.name!r} ({node.op_type}) reached the gradient pass: recurrent ops are differentiated "
        "in their unrolled form; run gradgen.passes.UnrollRecurrentPass before GradientPass "
        "(build_backward's pipeline does)"
    )
