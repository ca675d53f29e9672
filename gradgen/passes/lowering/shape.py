"""Lowering of SliceGrad (the shape family) to standard ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.ops.shape import slice_window_pads
from gradgen.passes.lowering.table import node_input, node_where, register_lowering, zeros_opset


def _slice_pads(e: GraphBuilder, node: ir.Node) -> list[int] | None:
    """Pad's pads for a SliceGrad whose slice is a plain window (all steps 1, everything known)."""
    dy, shape, starts, ends = (node_input(node, i) for i in range(4))
    axes_in, steps_in = node_input(node, 4), node_input(node, 5)
    if dy is None or shape is None or starts is None or ends is None:  # lower_slice_grad reports it
        return None
    entries = e.shape_entries(shape)
    starts_v, ends_v = e.value_of(starts), e.value_of(ends)
    axes_v = e.value_of(axes_in) if axes_in is not None else None
    steps_v = e.value_of(steps_in) if steps_in is not None else None
    dy_dims = dims_of(dy)
    if entries is None or starts_v is None or ends_v is None or dy_dims is None or len(dy_dims) != len(entries):
        return None
    if (axes_in is not None and axes_v is None) or (steps_in is not None and (steps_v is None or np.any(steps_v != 1))):
        return None
    axes = None if axes_v is None else axes_v.reshape(-1).tolist()
    return slice_window_pads(entries, starts_v.reshape(-1).tolist(), ends_v.reshape(-1).tolist(), axes)


@register_lowering("SliceGrad", min_opset=zeros_opset(0))
def lower_slice_grad(e: GraphBuilder, node: ir.Node):
    """dX = zeros(shape) with dY written where Slice(starts, ends, axes, steps) reads."""
    dy, shape, starts, ends = (node_input(node, i) for i in range(4))
    axes, steps = node_input(node, 4), node_input(node, 5)
    if dy is None or shape is None or starts is None or ends is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, shape, starts, ends")
    pads = _slice_pads(e, node)
    if pads is not None:
        if not any(pads):
            return [e.op("Identity", dy)]
        return [e.op("Pad", dy, e.ints(pads))]
    # A flat index map: iota shaped like the data, sliced like the data was; dY goes to those
    # positions of a zero vector. Works for any steps, negative ones included.
    shape64 = e.to_int64(shape)
    known = e.value_of(shape64)
    if known is not None:
        numel = e.scalar(int(np.prod(known, dtype=np.int64)))
        numel_vec = e.ints([int(np.prod(known, dtype=np.int64))])
    else:
        numel_vec = e.op("ReduceProd", shape64, keepdims=1)
        numel = e.op("Reshape", numel_vec, e.ints([]))
    iota = e.op("Range", e.scalar(0), numel, e.scalar(1))
    grid = e.op("Reshape", iota, shape64)
    slice_inputs: list[ir.Value | None] = [grid, starts, ends]  # None: an omitted optional input
    if axes is not None or steps is not None:
        slice_inputs.append(axes)
    if steps is not None:
        slice_inputs.append(steps)
    picked = e.op("Slice", *slice_inputs)
    flat = e.op("Reshape", picked, e.ints([-1]))
    updates = e.op("Reshape", dy, e.ints([-1]))
    scattered = e.op("ScatterElements", e.zeros(numel_vec, dy), flat, updates, axis=0)
    return [e.op("Reshape", scattered, shape64)]
