"""Lowerings of GatherGrad and GatherElementsGrad (the indexing family) to standard ONNX ops."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.ops.attributes import get_attr
from gradgen.passes.lowering.table import node_input, node_where, register_lowering, scatter_add_opset


def _shape_rank(e: GraphBuilder, shape: ir.Value) -> int | None:
    entries = e.shape_entries(shape)
    return None if entries is None else len(entries)


@register_lowering("GatherGrad", min_opset=scatter_add_opset(2))
def lower_gather_grad(e: GraphBuilder, node: ir.Node):
    """dX = zeros(shape); dX[..., idx[j], ...] += dY[..., j, ...] along ``axis``."""
    shape, indices, dy = (node_input(node, i) for i in range(3))
    axis = int(get_attr(node, "axis", 0))
    rank = _shape_rank(e, shape)
    if rank is None:
        dy_dims, idx_dims = dims_of(dy), dims_of(indices)
        if dy_dims is not None and idx_dims is not None:
            rank = len(dy_dims) - len(idx_dims) + 1
    if rank is not None:
        if not -rank <= axis < rank:
            raise ModelError(f"{node_where(node)}: axis {axis} is out of range for rank {rank}")
        axis = axis + rank if axis < 0 else axis
    shape64 = e.to_int64(shape)
    # With the rank unknown, a negative axis is used as it is (Slice and Gather take it).
    size = e.part(shape64, axis, axis + 1) if axis >= 0 else e.op("Gather", shape64, e.ints([axis]), axis=0)
    after = None if axis == -1 else e.part(shape64, axis + 1)
    rows = e.op("Reshape", e.normalize_indices(indices, size), e.ints([-1, 1]))
    if axis == 0:
        updates = e.op("Reshape", dy, e.cat(e.ints([-1]), after))
        return [e.op("ScatterND", e.zeros(shape64, dy), rows, updates, reduction="add")]
    # (outer, count, inner) -> indexed axis first -> scatter rows -> back.
    outer = e.prod(shape64, 0, axis)
    inner = e.ints([1]) if after is None else e.prod(after, 0)
    updates = e.op("Transpose", e.op("Reshape", dy, e.cat(outer, e.ints([-1]), inner)), perm=[1, 0, 2])
    zeros = e.zeros(e.cat(size, outer, inner), dy)
    scattered = e.op("ScatterND", zeros, rows, updates, reduction="add")
    return [e.op("Reshape", e.op("Transpose", scattered, perm=[1, 0, 2]), shape64)]


# ================================================================================ GatherElementsGrad


@register_lowering("GatherElementsGrad", min_opset=scatter_add_opset(0))
def lower_gather_elements_grad(e: GraphBuilder, node: ir.Node):
    """dX = zeros(shape); dX[idx[i] along axis, other coordinates of i] += dY[i]."""
    dy, shape, indices = (node_input(node, i) for i in range(3))
    axis = int(get_attr(node, "axis", 0))
    shape64 = e.to_int64(shape)
    rank = _shape_rank(e, shape)
    if rank is None:
        for v in (dy, indices):
            if dims_of(v) is not None:
                rank = len(dims_of(v))
    if rank is not None:
        if not -rank <= axis < rank:
            raise ModelError(f"{node_where(node)}: axis {axis} is out of range for rank {rank}")
        axis = axis + rank if axis < 0 else axis
        size = e.part(shape64, axis, axis + 1)
    else:  # Gather takes the negative axis as it is
        size = e.op("Gather", shape64, e.ints([axis]), axis=0)
    normalized = e.normalize_indices(indices, size)
    return [e.op("ScatterElements", e.zeros(shape64, dy), normalized, dy, axis=axis, reduction="add")]
