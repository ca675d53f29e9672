"""Gradient rules: reduction."""

from __future__ import annotations

from gradgen.grads.registry import grad_rule


@grad_rule("ReduceSum", nondiff_inputs=(1,))
def reduce_sum(g):
    x = g.x(0)
    axes = g.input_const(1) if g.x(1) is not None else None
    if g.opset < 13:
        axes = g.attr("axes")
    rank = g.rank(x)
    dy = g.dy()
    if axes is None or len(axes) == 0:
        if g.attr("noop_with_empty_axes", 0) and g.x(1) is not None:
            return [dy]
        return [g.expand_like(dy, x)]
    if not g.attr("keepdims", 1):
        dy = g.unsqueeze(dy, sorted(int(a) % rank for a in axes))
    return [g.expand_like(dy, x)]
