"""Gradient rules: indexing (Gather*, Scatter*). Indices never carry a gradient.

Gather and GatherElements emit ONNX Runtime training's com.microsoft GatherGrad and
GatherElementsGrad (note their different input orders); the others use standard ops.

A Gather that PyTorch's dynamo exporter wrote for ``nn.Embedding`` / ``F.embedding`` keeps the
call in its record (gradgen/grads/torch_records.py), with the options the graph itself lost: the
row ``padding_idx`` gets no gradient from the lookup, and ``scale_grad_by_freq`` divides each
position's gradient by how often its index occurs in the batch. The Gather rule applies both,
so such a model's gradients and training are PyTorch's (the legacy exporter keeps no such record).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir

from gradgen.builder import MICROSOFT, numpy_dtype_of
from gradgen.errors import ModelError
from gradgen.grads.rules.shape import INT64_MAX, dims_value
from gradgen.grads.table import grad_rule, non_differentiable
from gradgen.grads.torch_records import embedding_options, merged_lookup


def _where(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


@grad_rule("Gather", nondiff_inputs=(1,))
def gather(g):
    """Shape(X) (a constant when static) -> GatherGrad(shape, indices, dY); dY first as PyTorch's
    embedding backward takes it where the exporter recorded an embedding call (module docstring)."""
    x = g.x(0)
    dy = _as_torch_embedding_backward(g, g.dy())
    dx = g.op("GatherGrad", g.shape_of(x), g.x(1), dy, domain=MICROSOFT, axis=g.attr("axis", 0))
    return [g.set_type_like(dx, x)]


def _as_torch_embedding_backward(g, dy: ir.Value) -> ir.Value:
    """dY with the positions of ``padding_idx`` zeroed and, for ``scale_grad_by_freq``, each position
    divided by its index's count in the batch, as PyTorch's embedding backward does; dY itself for a
    Gather that is no recorded embedding lookup."""
    padding, by_frequency = embedding_options(g.node)
    if (padding is None and not by_frequency) or g.attr("axis", 0) != 0:
        return dy
    x, indices = g.x(0), g.x(1)
    weight = repr(x.name) if x.name else "the table"
    if merged_lookup(g.node, g.b.node_set):
        warnings.warn(
            f"{_where(g)}: PyTorch's exporter recorded an embedding lookup of {weight} with padding_idx / "
            "scale_grad_by_freq, but its optimizer seems to have merged other lookups into this node, so the "
            "gradient is the graph's (every row, unscaled), not PyTorch's; export with optimize=False to keep them apart",
            stacklevel=2,
        )
        return dy
    said = []
    if by_frequency:
        _need_scatter_reduction(g)
        flat = g.reshape(indices, [-1])
        ones = g.op("ConstantOfShape", g.shape_of(flat), value=ir.tensor(np.ones((1,), numpy_dtype_of(x))))
        counts = g.op("ScatterElements", g.zeros(dims_value(g, x, 0, 1), like=x), flat, ones, axis=0, reduction="add")
        dy = g.op("Div", dy, g.unsqueeze(g.op("Gather", counts, indices, axis=0), [-1]))
        said.append("each position's gradient is divided by its index's count in the batch (scale_grad_by_freq)")
    if padding is not None:
        # the pad row as Gather may name it: padding_idx, or padding_idx - rows counted from the end
        pad = g.const(np.array([padding], numpy_dtype_of(indices)))
        from_end = g.op("Sub", pad, g.cast_like(dims_value(g, x, 0, 1), indices))
        at_padding = g.op("Or", g.op("Equal", indices, pad), g.op("Equal", indices, from_end))
        dy = g.op("Where", g.unsqueeze(at_padding, [-1]), g.const_like(x, 0), dy)
        said.append(f"row {padding} of {weight} gets no gradient from this lookup (padding_idx={padding})")
    warnings.warn(
        f"{_where(g)}: {' and '.join(said)}, as in PyTorch (nn.Embedding options that PyTorch's exporter "
        "recorded with the node; the graph alone does not hold them)",
        stacklevel=2,
    )
    return dy


@grad_rule("GatherElements", nondiff_inputs=(1,))
def gather_elements(g):
    """Shape(X) (a constant when static) -> GatherElementsGrad(dY, shape, indices)."""
    x = g.x(0)
    dx = g.op("GatherElementsGrad", g.dy(), g.shape_of(x), g.x(1), domain=MICROSOFT, axis=g.attr("axis", 0))
    return [g.set_type_like(dx, x)]


@grad_rule("GatherND", nondiff_inputs=(1,))
def gather_nd(g):
    """ScatterND(zeros like X, indices, dY, reduction="add"); batch_dims > 0 folds the batch dims into
    one and prepends the batch coordinate to every index tuple."""
    _need_scatter_reduction(g)
    x, indices, dy = g.x(0), g.x(1), g.dy()
    b = g.attr("batch_dims", 0)
    if b == 0:
        return [g.op("ScatterND", g.zeros_like(x), indices, dy, reduction="add")]
    batch = g.reduce("ReduceProd", dims_value(g, x, 0, b), None, keepdims=0)  # scalar B1*...*Bb
    k = dims_value(g, indices, -1)
    # (B, count, k) with count the product of the index dims: explicit sizes (exact reshapes), as
    # -1 or a copied 0 cannot describe an empty index tensor
    count = g.reduce("ReduceProd", dims_value(g, indices, b, -1), None, keepdims=1)
    lead = g.op("Concat", g.reshape(batch, [1]), count, axis=0)
    tuples = g.reshape(indices, g.op("Concat", lead, k, axis=0), exact=True)
    coord = g.reshape(g.op("Range", g.const(np.array(0, np.int64)), batch, g.const(np.array(1, np.int64))), [-1, 1, 1])
    coord = g.op("Expand", coord, g.op("Concat", lead, g.ints([1]), axis=0))
    full = g.op("Concat", coord, tuples, axis=-1)
    rest = g.op("Slice", g.shape_of(x), g.op("Add", k, g.ints([b])), g.ints([INT64_MAX]))
    dy2 = g.reshape(dy, g.op("Concat", lead, rest, axis=0), exact=True)
    flat_x = g.op("Concat", g.reshape(batch, [1]), dims_value(g, x, b), axis=0)
    zeros = g.op("ConstantOfShape", flat_x, value=ir.tensor(np.zeros((1,), dtype=numpy_dtype_of(x))))
    return [g.reshape_like(g.op("ScatterND", zeros, full, dy2, reduction="add"), x)]


def _need_scatter_reduction(g) -> None:
    if g.opset < 16:
        raise ModelError(f"{_where(g)}: its gradient needs Scatter reduction='add' (opset >= 16); the model has opset {g.opset}")


def _reduction(g) -> str:
    reduction = g.attr("reduction", "none")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in ("none", "add", "mul", "max", "min"):
        raise ModelError(f"{_where(g)}: reduction={reduction!r} has no gradient rule (none, add, mul, max and min only)")
    return reduction


@grad_rule("ScatterElements", "Scatter", nondiff_inputs=(1,))  # Scatter: the deprecated (opset 9-10) name
def scatter_elements(g):
    """data: dY with the scattered positions zeroed (none) or dY (add); updates: gathered dY. max /
    min: the extremum's gradient goes to whichever of data and the updates scattered there equal it
    (split evenly among ties, as PyTorch's scatter_reduce amax / amin with include_self); mul:
    ``_scatter_product``."""
    reduction, axis = _reduction(g), g.attr("axis", 0)
    _data, indices, updates = g.x(0), g.x(1), g.x(2)
    gather = lambda v, i: g.op("GatherElements", v, i, axis=axis)  # noqa: E731
    scatter = lambda d, i, u, r: g.op("ScatterElements", d, i, u, axis=axis, reduction=r)  # noqa: E731
    if reduction in ("max", "min"):
        return _scatter_extremum(g, gather, scatter)
    if reduction == "mul":
        return _scatter_product(g, gather, scatter)
    d_data = d_updates = None
    if g.needs(0):
        d_data = g.dy() if reduction == "add" else g.op("ScatterElements", g.dy(), indices, g.zeros_like(updates), axis=axis)
    if g.needs(2):
        d_updates = g.op("GatherElements", g.dy(), indices, axis=axis)
    return [d_data, None, d_updates]


@grad_rule("TensorScatter", nondiff_inputs=(2,))
def tensor_scatter(g):
    """past_cache: dY with the written positions zeroed (TensorScatter of zeros); update: dY gathered
    at the positions it was written to (``write_indices[b] + i``, modulo the axis when circular)."""
    mode, axis = g.attr("mode", "linear"), g.attr("axis", -2)
    update, starts = g.x(1), g.x(2)
    d_cache = d_update = None
    if g.needs(0):
        written = [starts] if starts is not None else []
        d_cache = g.op("TensorScatter", g.dy(), g.zeros_like(update), *written, mode=mode, axis=axis)
    if g.needs(1):
        d_update = g.op("GatherElements", g.dy(), _tensor_scatter_positions(g, mode, axis), axis=axis)
    return [d_cache, d_update] + [None] * (len(g.node.inputs) - 2)


def _tensor_scatter_positions(g, mode: str, axis: int) -> ir.Value:
    """The int64 positions along ``axis`` that each element of the update was written to, shaped
    like the update (gradgen/ops/indexing.py's tensor_scatter_positions, as graph ops)."""
    update, starts = g.x(1), g.x(2)
    rank = g.rank(update)
    if rank is None:
        raise ModelError("TensorScatter's gradient needs the rank of its update input (run shape inference)")
    axis = axis % rank
    update_shape = g.shape_of(update)
    length = g.squeeze(g.part(update_shape, axis, axis + 1), [0])
    steps = g.unsqueeze(g.op("Range", g.scalar(0), length, g.scalar(1)), [0])  # (1, S)
    positions = steps if starts is None else g.op("Add", g.unsqueeze(g.to_int64(starts), [1]), steps)  # (B, S)
    if mode == "circular":
        room = g.part(g.shape_of(g.dy()), axis, axis + 1)
        positions = g.op("Mod", positions, room)
    spread = [d for d in range(1, rank) if d != axis]  # (B or 1, S) -> S on ``axis``, 1 elsewhere
    return g.op("Expand", g.unsqueeze(positions, spread) if spread else positions, update_shape)


@grad_rule("ScatterND", nondiff_inputs=(1,))
def scatter_nd(g):
    """data: dY with the scattered slices zeroed (none) or dY (add); updates: GatherND of dY; max /
    min and mul as ScatterElements'."""
    reduction = _reduction(g)
    _data, indices, updates = g.x(0), g.x(1), g.x(2)
    gather = lambda v, i: g.op("GatherND", v, i)  # noqa: E731
    scatter = lambda d, i, u, r: g.op("ScatterND", d, i, u, reduction=r)  # noqa: E731
    if reduction in ("max", "min"):
        return _scatter_extremum(g, gather, scatter)
    if reduction == "mul":
        return _scatter_product(g, gather, scatter)
    d_data = d_updates = None
    if g.needs(0):
        d_data = g.dy() if reduction == "add" else g.op("ScatterND", g.dy(), indices, g.zeros_like(updates))
    if g.needs(2):
        d_updates = g.op("GatherND", g.dy(), indices)
    return [d_data, None, d_updates]


def _scatter_extremum(g, gather, scatter) -> list:
    """Y = data with each update max-ed (min-ed) in at its position: every value equal to Y there
    (data's own and the updates') gets dY / (how many are equal). ``gather(v, indices)`` reads v at
    the updates' positions, ``scatter(data, indices, updates, reduction)`` writes there."""
    data, indices, updates, y, dy = g.x(0), g.x(1), g.x(2), g.y(), g.dy()
    data_wins = g.cast_like(g.op("Equal", data, y), data)
    updates_win = g.cast_like(g.op("Equal", updates, gather(y, indices)), updates)
    _need_scatter_reduction(g)
    count = scatter(data_wins, indices, updates_win, "add")
    share = g.op("Div", dy, count)
    d_data = g.op("Mul", share, data_wins) if g.needs(0) else None
    d_updates = g.op("Mul", gather(share, indices), updates_win) if g.needs(2) else None
    return [d_data, None, d_updates]


def _scatter_product(g, gather, scatter) -> list:
    """Y = data times the updates multiplied in at each position: data's gradient is dY times the
    product of its position's updates; an update's is dY * data there times the product of the
    other updates at its position. That product is taken without dividing by a zero: with Z the
    count of zero updates at the position and P the product of its non-zero ones, an update's
    others multiply to 0 where another update is zero (Z minus its own zero count > 0), else to P
    over itself (P where it is the one zero) -- what PyTorch's scatter_reduce prod computes."""
    data, indices, updates, dy = g.x(0), g.x(1), g.x(2), g.dy()
    _need_scatter_reduction(g)
    d_data = d_updates = None
    if g.needs(0):
        d_data = g.op("Mul", dy, scatter(g.ones_like(data), indices, updates, "mul"))
    if g.needs(2):
        zero = g.const(np.array(0, dtype=numpy_dtype_of(updates)))
        is_zero = g.op("Equal", updates, zero)
        own_zero = g.cast_like(is_zero, updates)
        non_zero = g.op("Where", is_zero, g.const(np.array(1, dtype=numpy_dtype_of(updates))), updates)
        zeros_there = gather(scatter(g.zeros_like(data), indices, own_zero, "add"), indices)
        product_there = gather(scatter(g.ones_like(data), indices, non_zero, "mul"), indices)
        others = g.op("Where", g.op("Equal", zeros_there, own_zero), g.op("Div", product_there, non_zero), zero)
        d_updates = g.op("Mul", gather(g.op("Mul", dy, data), indices), others)
    return [d_data, None, d_updates]


# Ops whose outputs never carry a gradient: indices. OneHot is not among them: its float
# ``values`` input (off/on) carries a gradient. NonMaxSuppression's output is box indices.
non_differentiable("NonZero", "NonMaxSuppression")


@grad_rule("GatherGrad", domain=MICROSOFT, nondiff_inputs=(0, 1))
def gather_grad(g):
    """GatherGrad(shape, indices, dY) scatter-adds dY at the indices: linear in dY, whose gradient is
    the Gather of the incoming gradient at the same indices."""
    dy = g.x(2)
    return [None, None, g.set_type_like(g.op("Gather", g.dy(), g.x(1), axis=g.attr("axis", 0)), dy)]


@grad_rule("GatherElementsGrad", domain=MICROSOFT, nondiff_inputs=(1, 2))
def gather_elements_grad(g):
    """GatherElementsGrad(dY, shape, indices) scatter-adds dY at the indices: linear in dY, whose
    gradient is the GatherElements of the incoming gradient at the same indices."""
    dy = g.x(0)
    return [g.set_type_like(g.op("GatherElements", g.dy(), g.x(2), axis=g.attr("axis", 0)), dy)]


@grad_rule("OneHot", nondiff_inputs=(0, 1))
def one_hot(g):
    """Y = where(hot, on_value, off_value): on_value's gradient is the sum of dY where hot, off_value's
    the sum of the rest; the indices and the depth carry none."""
    values, dy = g.x(2), g.dy()
    hot = g.op("OneHot", g.x(0), g.x(1), g.const(np.array([0, 1], dtype=numpy_dtype_of(values))), axis=g.attr("axis", -1))
    on = g.reduce_sum(g.op("Mul", dy, hot), None, keepdims=0)
    off = g.op("Sub", g.reduce_sum(dy, None, keepdims=0), on)
    return [None, None, g.op("Concat", g.reshape(off, [1]), g.reshape(on, [1]), axis=0)]


@grad_rule("Compress", nondiff_inputs=(1,))
def compress(g):
    """Compress is a Gather of the kept positions (NonZero of the condition) along the axis, or of
    the flattened input without one: dX is GatherGrad of dY at those positions."""
    kept = g.reshape(g.op("NonZero", g.x(1)), [-1])
    return [_gathered_back(g, g.x(0), kept, g.dy(), g.attr("axis", None))]


@grad_rule("Unique")
def unique(g):
    """Y holds X's elements (or slices along the axis) at ``indices``, their first occurrences: dX is
    GatherGrad of dY there (a tie moves no value: the gradient goes to the first of equal ones). The
    integer outputs carry none."""
    return [_gathered_back(g, g.x(0), _unique_indices(g), g.dy(0), g.attr("axis", None))]


def _gathered_back(g, x: ir.Value, positions: ir.Value, dy: ir.Value, axis) -> ir.Value:
    """The gradient of X for an output that gathered X at ``positions`` along ``axis`` (of X
    flattened when None): dY added back there by GatherGrad, zeros elsewhere."""
    if axis is not None:
        return g.set_type_like(g.op("GatherGrad", g.shape_of(x), positions, dy, domain=MICROSOFT, axis=axis), x)
    flat = g.op("GatherGrad", g.reshape(g.op("Size", x), [1]), positions, dy, domain=MICROSOFT, axis=0)
    return g.set_type_like(g.reshape(flat, g.shape_of(x)), x)


def _unique_indices(g) -> ir.Value:
    """The forward Unique's ``indices`` output (its second), added to the node when omitted."""
    node = g.node
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    indices = node.outputs[1]
    if not indices.name:
        g.rename(indices, f"{node.name or g.y(0).name}_indices")
    indices.type = ir.TensorType(ir.DataType.INT64)
    indices.shape = ir.Shape([None])
    return indices
