"""Gradient rules: shape ops (reshaping, transposing, slicing, joining, padding, tiling).

Most of these move elements without changing them, so the gradient moves dY back. Shapes come from
constants when they are static and from Shape nodes otherwise, so the rules work with symbolic dims.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import MICROSOFT, dims_of, is_static, numpy_dtype_of
from gradgen.errors import ModelError
from gradgen.evaluate import ConstantEvaluator
from gradgen.grads.table import grad_rule, non_differentiable

INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min


def _where(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


def _need_rank(g, x) -> int:
    rank = g.rank(x)
    if rank is None:
        raise ModelError(f"{_where(g)}: the rank of {x.name!r} is unknown; its gradient needs it")
    return rank


_FOLD_MAX_NODES = 64


def folded_const(g, i: int):
    """Forward input i as a numpy array when it is constant or computed from constants only (and
    static shapes) by at most 64 nodes (the build-time evaluator, gradgen/evaluate.py); else None."""
    value = g.x(i)
    if value is None:
        return None
    direct = g.input_const(i)
    if direct is not None:
        return direct
    return ConstantEvaluator(g.opset).value(value, max_nodes=_FOLD_MAX_NODES)


def folded_dims(g, value, depth: int = 16) -> list | None:
    """A 1-D int64 value as a list of dims (ints, or the symbolic dims of some tensor's shape) when
    it is built from constants and Shape by Slice/Concat/Cast/Identity, e.g. the legacy exporter's
    Resize sizes Concat(Slice(Shape(X), 0, 2), [h, w]); else None."""
    if value is None or depth < 0:
        return None
    if value.const_value is not None:
        return [int(v) for v in value.const_value.numpy().reshape(-1)]
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op == "Constant":
        attr = node.attributes.get("value")
        if attr is not None:
            return [int(v) for v in attr.value.numpy().reshape(-1)]
        if "value_ints" in node.attributes:
            return [int(v) for v in node.attributes["value_ints"].value]
        return None
    if op == "Shape":
        dims = dims_of(node.inputs[0])
        if dims is None:
            return None
        start = int(node.attributes["start"].value) if "start" in node.attributes else 0
        end = int(node.attributes["end"].value) if "end" in node.attributes else None
        return list(dims)[start:end]
    if op in ("Cast", "Identity"):
        return folded_dims(g, node.inputs[0], depth - 1)
    if op == "Concat":
        parts = [folded_dims(g, v, depth - 1) for v in node.inputs]
        known = [p for p in parts if p is not None]
        return None if len(known) < len(parts) else [d for p in known for d in p]
    if op == "Slice" and len(node.inputs) >= 3:
        data = folded_dims(g, node.inputs[0], depth - 1)
        bounds = [folded_dims(g, v, depth - 1) if v is not None else None for v in node.inputs[1:5]]
        if data is None or bounds[0] is None or bounds[1] is None:
            return None
        if len(bounds) > 2 and bounds[2] is not None and [int(a) for a in bounds[2]] != [0]:
            return None
        step = int(bounds[3][0]) if len(bounds) > 3 and bounds[3] is not None else 1
        start, end = int(bounds[0][0]), int(bounds[1][0])
        return data[slice(start, end if end < INT64_MAX // 2 else None, step)]
    return None


def dims_value(g, x, start: int, end: int | None = None):
    """x's dims [start:end] as a 1-D int64 value: a constant when static, else a Slice of Shape(x)."""
    dims = dims_of(x)
    if dims is not None:
        part = dims[start:end]
        if is_static(part):
            return g.ints(part)
    return g.op("Slice", g.shape_of(x), g.ints([start]), g.ints([INT64_MAX if end is None else end]))


def concat_ints(g, parts):
    """Concatenate 1-D int64 values and python int lists into one 1-D int64 value."""
    merged, values = [], []
    for part in parts:
        if isinstance(part, (list, tuple)):
            merged.extend(int(v) for v in part)
            continue
        if part.const_value is not None:
            merged.extend(int(v) for v in part.const_value.numpy().reshape(-1))
            continue
        if merged:
            values.append(g.ints(merged))
            merged = []
        values.append(part)
    if merged:
        values.append(g.ints(merged))
    return values[0] if len(values) == 1 else g.op("Concat", *values, axis=0)


def slice_axis(g, x, start: int, end: int, axis: int, step: int = 1):
    return g.op("Slice", x, g.ints([start]), g.ints([end]), g.ints([axis]), g.ints([step]))


@grad_rule("Reshape", "Squeeze", "Unsqueeze", nondiff_inputs=(1,))
def reshape(g):
    return [g.reshape_like(g.dy(), g.x(0))]


@grad_rule("Flatten")
def flatten(g):
    return [g.reshape_like(g.dy(), g.x(0))]


@grad_rule("Transpose")
def transpose(g):
    perm = g.attr("perm")
    if perm is None:
        perm = list(reversed(range(_need_rank(g, g.x(0)))))
    inverse = [0] * len(perm)
    for i, p in enumerate(perm):
        inverse[p] = i
    return [g.transpose(g.dy(), inverse)]


@grad_rule("Concat")
def concat(g):
    """Split dY by the inputs' sizes along the axis (sizes from Shape when symbolic)."""
    inputs = list(g.node.inputs)
    axis = g.attr("axis")
    sizes = []
    for x in inputs:
        dims = dims_of(x)
        if dims is not None and isinstance(dims[axis], int):
            sizes.append([dims[axis]])
        else:
            sizes.append(g.op("Gather", g.shape_of(x), g.ints([axis])))
    if len(inputs) == 1:
        return [g.dy()]
    parts = g.op_multi("Split", [g.dy(), concat_ints(g, sizes)], len(inputs), axis=axis)
    return [parts[i] if g.needs(i) else None for i in range(len(inputs))]


@grad_rule("Split", nondiff_inputs=(1,))
def split(g):
    """Concat of the output gradients; zeros for outputs that get none."""
    parts = [g.dy(k) if g.dy(k) is not None else g.zeros_like(g.y(k)) for k in range(len(g.node.outputs))]
    if len(parts) == 1:
        return [parts[0]]
    return [g.op("Concat", *parts, axis=g.attr("axis", 0))]


@grad_rule("Slice", nondiff_inputs=(1, 2, 3, 4))
def slice_(g):
    """com.microsoft SliceGrad(dY, shape, starts, ends[, axes[, steps]]), forward inputs in position."""
    x = g.x(0)
    rest = list(g.node.inputs[1:])
    while rest and rest[-1] is None:
        rest.pop()
    dx = g.op("SliceGrad", g.dy(), g.shape_of(x), *rest, domain=MICROSOFT)
    return [g.set_type_like(dx, x)]


@grad_rule("Expand", nondiff_inputs=(1,))
def expand(g):
    return [g.unbroadcast(g.dy(), g.x(0), g.y(), None)]


@grad_rule("Tile", nondiff_inputs=(1,))
def tile(g):
    """Reshape dY to (r0, d0, r1, d1, ...) and sum over the repeat axes."""
    x = g.x(0)
    rank = _need_rank(g, x)
    repeats = g.input_const(1)
    dims = dims_of(x)
    if repeats is not None and is_static(dims):
        pairs = [v for r, d in zip(repeats.tolist(), dims) for v in (int(r), d)]
        interleaved = g.ints(pairs)
    else:
        stacked = g.op("Concat", g.unsqueeze(g.x(1), [1]), g.unsqueeze(g.shape_of(x), [1]), axis=1)
        interleaved = g.reshape(stacked, [-1])
    spread = g.reshape(g.dy(), interleaved, exact=True)  # a repeat of 0 is an empty axis, not "copy"
    return [g.reduce_sum(spread, [2 * i for i in range(rank)], keepdims=0)]


@grad_rule("Pad", nondiff_inputs=(1, 3))
def pad(g):
    """constant: Pad(dY, -pads) (crops what was padded, zero-fills what negative pads cut off);
    edge/reflect/wrap: fold the padded border back onto the input, axis by axis."""
    x, dy = g.x(0), g.dy()
    mode = g.attr("mode", "constant")
    if isinstance(mode, bytes):
        mode = mode.decode()
    value = g.x(2) if len(g.node.inputs) > 2 else None
    axes_in = g.x(3) if len(g.node.inputs) > 3 else None
    if mode == "constant":
        pads = g.input_const(1)
        neg = g.ints([-int(p) for p in pads]) if pads is not None else g.op("Neg", g.x(1))
        dx = g.op("Pad", dy, neg, None, axes_in) if axes_in is not None else g.op("Pad", dy, neg)
        result = [dx if g.needs(0) else None, None]
        if value is not None and g.needs(2):
            # The padding value reaches every output element that is not a copy of an input one.
            total = g.op("Sub", g.reduce_sum(dy, None, keepdims=0), g.reduce_sum(dx, None, keepdims=0))
            result.append(g.reshape_like(total, value))
        return result
    if not g.needs(0):
        return [None]
    pads, axes = folded_const(g, 1), None
    if pads is None:
        raise ModelError(f"{_where(g)}: mode {mode!r} needs constant pads for its gradient")
    rank = _need_rank(g, x)
    pads = [int(p) for p in pads.reshape(-1)]
    if axes_in is not None:
        axes = folded_const(g, 3)
        if axes is None:
            raise ModelError(f"{_where(g)}: mode {mode!r} needs constant axes for its gradient")
        axes = [int(a) % rank for a in axes.reshape(-1)]
    else:
        axes = list(range(rank))
    n = len(axes)
    if any(p < 0 for p in pads):
        raise ModelError(f"{_where(g)}: negative pads {pads} with mode {mode!r} have no gradient rule")
    grad = dy
    for axis, begin, end in zip(axes, pads[:n], pads[n:]):
        if begin or end:
            grad = _fold_wrap(g, grad, x, axis, begin, rank) if mode == "wrap" else _fold_border(g, grad, axis, begin, end, mode)
    return [grad]


def _fold_wrap(g, dy, x, axis: int, b: int, rank: int):
    """Gradient of a one-axis wrap pad, pads of any size (wider than the axis too): output o copies
    input (o - b) mod n, so dY is scatter-added there (wrap exists from opset 19, past reduction="add")."""
    n = dims_value(g, x, axis, axis + 1)
    length = g.squeeze(dims_value(g, dy, axis, axis + 1), [0])
    positions = g.op("Range", g.const(np.array(0, np.int64)), length, g.const(np.array(1, np.int64)))
    index = g.op("Mod", g.op("Sub", positions, g.const(np.array(b, np.int64))), n)
    along = [1] * rank
    along[axis] = -1
    index = g.op("Expand", g.reshape(index, along), g.shape_of(dy))
    target = concat_ints(g, [dims_value(g, dy, 0, axis), n, dims_value(g, dy, axis + 1)])
    zeros = g.op("ConstantOfShape", target, value=ir.tensor(np.zeros((1,), dtype=numpy_dtype_of(x))))
    return g.op("ScatterElements", zeros, index, dy, axis=axis, reduction="add")


def _fold_border(g, dy, axis: int, b: int, e: int, mode: str):
    """Gradient of a one-axis edge/reflect/wrap pad of (b, e): center plus the folded borders."""
    center = slice_axis(g, dy, b, -e if e else INT64_MAX, axis)
    if mode == "edge":
        if b:
            left = g.reduce_sum(slice_axis(g, dy, 0, b, axis), [axis], keepdims=1)
            first = g.op("Add", slice_axis(g, center, 0, 1, axis), left)
            center = g.op("Concat", first, slice_axis(g, center, 1, INT64_MAX, axis), axis=axis)
        if e:
            right = g.reduce_sum(slice_axis(g, dy, -e, INT64_MAX, axis), [axis], keepdims=1)
            last = g.op("Add", slice_axis(g, center, -1, INT64_MAX, axis), right)
            center = g.op("Concat", slice_axis(g, center, 0, -1, axis), last, axis=axis)
        return center
    if mode == "reflect":
        # output i < b copies input b - i; output n + b + j copies input n - 2 - j.
        if b:
            left = slice_axis(g, dy, b - 1, INT64_MIN, axis, -1)
            middle = g.op("Add", slice_axis(g, center, 1, b + 1, axis), left)
            center = g.op(
                "Concat", slice_axis(g, center, 0, 1, axis), middle, slice_axis(g, center, b + 1, INT64_MAX, axis), axis=axis
            )
        if e:
            right = slice_axis(g, dy, -1, -(e + 1), axis, -1)
            middle = g.op("Add", slice_axis(g, center, -(e + 1), -1, axis), right)
            center = g.op(
                "Concat", slice_axis(g, center, 0, -(e + 1), axis), middle, slice_axis(g, center, -1, INT64_MAX, axis), axis=axis
            )
        return center
    if mode == "wrap":
        # output i < b copies input n - b + i; output n + b + j copies input j.
        if b:
            left = slice_axis(g, dy, 0, b, axis)
            tail = g.op("Add", slice_axis(g, center, -b, INT64_MAX, axis), left)
            center = g.op("Concat", slice_axis(g, center, 0, -b, axis), tail, axis=axis)
        if e:
            right = slice_axis(g, dy, -e, INT64_MAX, axis)
            head = g.op("Add", slice_axis(g, center, 0, e, axis), right)
            center = g.op("Concat", head, slice_axis(g, center, e, INT64_MAX, axis), axis=axis)
        return center
    raise ModelError(f"Pad mode {mode!r} has no gradient rule")


@grad_rule("SpaceToDepth")
def space_to_depth(g):
    """A permutation, undone by DepthToSpace of the same mode (SpaceToDepth's mode: opset 28)."""
    return [g.op("DepthToSpace", g.dy(), blocksize=g.attr("blocksize"), mode=_block_mode(g))]


def _block_mode(g) -> str:
    mode = g.attr("mode", "DCR")
    return mode.decode() if isinstance(mode, bytes) else mode


@grad_rule("DepthToSpace")
def depth_to_space(g):
    b = g.attr("blocksize")
    mode = _block_mode(g)
    if mode == "DCR":
        return [g.op("SpaceToDepth", g.dy(), blocksize=b)]
    # CRD: x (N, C, H, W) -> (N, C/b^2, b, b, H, W) -> perm (0, 1, 4, 2, 5, 3) -> (N, C/b^2, H*b, W*b).
    x = g.x(0)
    h, w = dims_value(g, x, 2, 3), dims_value(g, x, 3, 4)
    six = concat_ints(g, [[0, 0], h, [b], w, [b]])
    unfolded = g.reshape(g.dy(), six)
    return [g.reshape_like(g.transpose(unfolded, [0, 1, 3, 5, 2, 4]), x)]


@grad_rule("Trilu", nondiff_inputs=(1,))
def trilu(g):
    k = g.x(1) if len(g.node.inputs) > 1 else None
    inputs = [g.dy()] + ([k] if k is not None else [])
    return [g.op("Trilu", *inputs, upper=g.attr("upper", 1))]


# Ops whose outputs never carry a gradient: shapes and sizes, and values that depend only on a
# shape. Range is not among them: with float start/delta its output is differentiable in them.
non_differentiable("Shape", "Size", "ConstantOfShape", "EyeLike")
# Constant has no inputs: its value is part of the model, as an initializer's is.
non_differentiable("Constant")
# Signal-processing tables: the windows depend on an integer size only; MelWeightMatrix's float
# edge frequencies only move its integer bin boundaries, so it is piecewise constant in them.
non_differentiable("BlackmanWindow", "HammingWindow", "HannWindow", "MelWeightMatrix")


@grad_rule("SliceGrad", domain=MICROSOFT, nondiff_inputs=(1, 2, 3, 4, 5))
def slice_grad(g):
    """SliceGrad writes dY where Slice reads: linear in dY, so dY's gradient is that Slice of the
    incoming gradient (a backward graph differentiated again)."""
    rest = list(g.node.inputs[2:])
    while rest and rest[-1] is None:
        rest.pop()
    return [g.set_type_like(g.op("Slice", g.dy(), *rest), g.x(0))]


@grad_rule("CenterCropPad", nondiff_inputs=(1,))
def center_crop_pad(g):
    """A centred crop and the centred pad back put the same floor(|difference| / 2) elements
    before, so each is the other's transpose: dX = CenterCropPad(dY, X's sizes on the same axes)."""
    x = g.x(0)
    axes = g.attr("axes")
    dims = dims_of(x)
    if axes is None:
        sizes = g.shape_of(x)
    elif dims is not None and all(isinstance(dims[a], int) for a in axes):
        sizes = g.ints([dims[a] for a in axes])
    else:
        sizes = g.op("Gather", g.shape_of(x), g.ints(axes), axis=0)
    return [g.op("CenterCropPad", g.dy(), sizes, axes=axes), None]


@grad_rule("Range", nondiff_inputs=(1,))
def range_(g):
    """y_i = start + i * delta for i < n: start's gradient is sum(dY), delta's sum(i * dY). The limit
    only sets the integer length n, so Y is piecewise constant in it: a zero gradient by definition."""
    dy = g.dy()
    grads = [None, None, None]
    if g.needs(0):
        grads[0] = g.reduce_sum(dy, [0], keepdims=0)
    if g.needs(2):
        count = g.op("Squeeze", g.op("Shape", dy), g.ints([0]))
        steps = g.cast_like(g.op("Range", g.scalar(0), count, g.scalar(1)), dy)
        grads[2] = g.reduce_sum(g.op("Mul", dy, steps), [0], keepdims=0)
    return grads


@grad_rule("ReverseSequence", nondiff_inputs=(1,))
def reverse_sequence(g):
    """A permutation that is its own inverse: dX is dY reversed the same way."""
    attrs = {"batch_axis": g.attr("batch_axis", 1), "time_axis": g.attr("time_axis", 0)}
    return [g.op("ReverseSequence", g.dy(), g.x(1), **attrs)]
