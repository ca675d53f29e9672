"""Gradient rules: indexing (Gather*, Scatter*). Indices never carry a gradient.

Gather and GatherElements emit ONNX Runtime training's com.microsoft GatherGrad and
GatherElementsGrad (note their different input orders); the others use standard ops.
"""

from __future__ import annotations

from gradgen.errors import ModelError
from gradgen.grads.builder import MICROSOFT
from gradgen.grads.registry import grad_rule


def _where(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


@grad_rule("Gather", nondiff_inputs=(1,))
def gather(g):
    """Shape(X) (a constant when static) -> GatherGrad(shape, indices, dY)."""
    x = g.x(0)
    dx = g.op("GatherGrad", g.shape_of(x), g.x(1), g.dy(), domain=MICROSOFT, axis=g.attr("axis", 0))
    return [g.set_type_like(dx, x)]


@grad_rule("GatherElements", nondiff_inputs=(1,))
def gather_elements(g):
    """Shape(X) (a constant when static) -> GatherElementsGrad(dY, shape, indices)."""
    x = g.x(0)
    dx = g.op("GatherElementsGrad", g.dy(), g.shape_of(x), g.x(1), domain=MICROSOFT, axis=g.attr("axis", 0))
    return [g.set_type_like(dx, x)]


@grad_rule("GatherND", nondiff_inputs=(1,))
def gather_nd(g):
    """ScatterND(zeros like X, indices, dY, reduction="add")."""
    if g.attr("batch_dims", 0) != 0:
        raise ModelError(f"{_where(g)}: GatherND with batch_dims={g.attr('batch_dims')} has no gradient rule "
                         "(batch_dims 0 only)")
    _need_scatter_reduction(g)
    x = g.x(0)
    return [g.op("ScatterND", g.zeros_like(x), g.x(1), g.dy(), reduction="add")]


def _need_scatter_reduction(g) -> None:
    if g.opset < 16:
        raise ModelError(f"{_where(g)}: its gradient needs Scatter reduction='add' (opset >= 16); "
                         f"the model has opset {g.opset}")


def _reduction(g) -> str:
    reduction = g.attr("reduction", "none")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in ("none", "add"):
        raise ModelError(f"{_where(g)}: reduction={reduction!r} has no gradient rule (none and add only)")
    return reduction


@grad_rule("ScatterElements", nondiff_inputs=(1,))
def scatter_elements(g):
    """data: dY with the scattered positions zeroed (none) or dY (add); updates: gathered dY."""
    reduction, axis = _reduction(g), g.attr("axis", 0)
    data, indices, updates = g.x(0), g.x(1), g.x(2)
    d_data = d_updates = None
    if g.needs(0):
        d_data = g.dy() if reduction == "add" else \
            g.op("ScatterElements", g.dy(), indices, g.zeros_like(updates), axis=axis)
    if g.needs(2):
        d_updates = g.op("GatherElements", g.dy(), indices, axis=axis)
    return [d_data, None, d_updates]


@grad_rule("ScatterND", nondiff_inputs=(1,))
def scatter_nd(g):
    """data: dY with the scattered slices zeroed (none) or dY (add); updates: GatherND of dY."""
    reduction = _reduction(g)
    data, indices, updates = g.x(0), g.x(1), g.x(2)
    d_data = d_updates = None
    if g.needs(0):
        d_data = g.dy() if reduction == "add" else g.op("ScatterND", g.dy(), indices, g.zeros_like(updates))
    if g.needs(2):
        d_updates = g.op("GatherND", g.dy(), indices)
    return [d_data, None, d_updates]
