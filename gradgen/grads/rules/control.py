"""If, Loop and Scan: differentiated through the forms the passes before the gradient pass give
them.

``EvaluateConstantsPass`` replaces an If whose condition is a constant after folding by the branch
it takes, and ``UnrollLoopsPass`` (gradgen/passes/control_flow.py) rewrites a Loop or Scan with a
static number of iterations into copies of its body; the other families' rules differentiate what
they leave. An If chosen at run time, or a loop whose length only the run knows, reaches these
entries: a one-line error naming the node and saying what is supported, never a silent zero.
"""

from __future__ import annotations

from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule
from gradgen.passes.control_flow import unroll_reason


@grad_rule("If", nondiff_inputs=(0,))
def _if_at_run_time(g):
    node = g.node
    condition = node.inputs[0].name if node.inputs and node.inputs[0] is not None else "?"
    raise ModelError(
        f"node {node.name!r} (If): its condition ({condition!r}) is computed at run time; gradgen differentiates "
        "an If whose condition is a constant once the model's constants and shapes are folded (the branch it "
        "takes is inlined), not one that the data chooses"
    )


@grad_rule("Loop", nondiff_inputs=(0, 1))
@grad_rule("Scan")
def _loop_not_unrolled(g):
    node = g.node
    reason = unroll_reason(node, g.opset)
    if isinstance(reason, int):
        reason = (
            "it reached the gradient pass; run gradgen.passes.UnrollLoopsPass before GradientPass "
            "(build_backward's pipeline does)"
        )
    raise ModelError(
        f"node {node.name!r} ({node.op_type}): {reason}; gradgen differentiates Loop and Scan by unrolling them, "
        "which needs a number of iterations the model fixes (a constant trip count M and a body that passes its "
        "condition through, or a Scan's static sequence length)"
    )
