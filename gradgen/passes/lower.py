"""LowerToStandardPass: rewrite the com.microsoft gradient ops into standard ONNX ops.

A backward graph built by gradgen (or by ONNX Runtime training) holds a few ops of the
``com.microsoft`` domain that stock ONNX runtimes do not have. This pass replaces each of them by
standard ONNX ops with the same meaning, so the graph runs anywhere ONNX runs:

- SliceGrad          -> Pad (constant starts/ends/axes, steps 1, known sliced dims), else
                        ScatterElements of dY into zeros at the flat positions a Slice of an
                        index grid picks (any steps, negative ones included).
- GatherGrad         -> ScatterND(reduction="add") of dY's rows into zeros, the indexed axis moved
                        first; negative indices normalised first, repeated ones accumulate.
- GatherElementsGrad -> ScatterElements(reduction="add") into zeros, indices normalised first.
- ConvGrad           -> dX: ConvTranspose; dW: Conv of X by dY with batch and channels swapped
                        (strides and dilations swapped, groups through a reshape), cropped to the
                        kernel; dB: ReduceSum over every axis but 1. auto_pad becomes explicit pads.
- BroadcastGradientArgs -> constant axes when both shapes are known, else shape arithmetic
                        (Concat, Equal, Less, Compress), axes in descending order.

Lowerings live in a table keyed by (domain, op_type) (``register_lowering``). The scatters with
reduction="add" need opset 16: a model below the opset its lowerings need is converted with ONNX's
version converter to exactly that opset (the smallest that works) before lowering; a model at or
above it keeps its opset, so no existing node changes meaning. The pass keeps the graph's inputs
and outputs (names and types).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from gradgen.errors import KernelError, ModelError, UnsupportedOpsError
from gradgen.grads.builder import dims_of, is_static

MICROSOFT = "com.microsoft"
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)

# Every lowering writes opset-13 forms (ReduceSum/Squeeze axes as inputs, ...).
BASE_OPSET = 13
# ScatterElements / ScatterND with reduction="add".
SCATTER_ADD_OPSET = 16
# CastLike, used for zeros when an operand's element type is unknown.
CASTLIKE_OPSET = 15

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


# ================================================================================ the table


@dataclasses.dataclass
class Lowering:
    """How to lower one op: ``fn(emitter, node)`` returns one value per node output (None for an
    output that is omitted or unused); ``min_opset(node)`` is the default-domain opset it needs."""

    domain: str
    op_type: str
    fn: Callable[[Emitter, ir.Node], Sequence[ir.Value | None]]
    min_opset: Callable[[ir.Node], int]


_LOWERINGS: dict[tuple[str, str], Lowering] = {}


def register_lowering(op_type: str, domain: str = MICROSOFT, min_opset: int | Callable[[ir.Node], int] = BASE_OPSET):
    """Decorator: register ``fn(emitter, node) -> outputs`` as the lowering of (domain, op_type)."""
    needs = min_opset if callable(min_opset) else (lambda node, _v=min_opset: _v)

    def wrap(fn):
        _LOWERINGS[(domain, op_type)] = Lowering(domain, op_type, fn, needs)
        return fn

    return wrap


def lookup_lowering(domain: str, op_type: str) -> Lowering | None:
    return _LOWERINGS.get((_domain(domain), op_type))


def lowerable_ops() -> list[tuple[str, str]]:
    """(domain, op_type) of every op this pass can lower."""
    return sorted(_LOWERINGS)


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


# ================================================================================ the pass


class LowerToStandardPass(ir.passes.InPlacePass):
    """Replace every com.microsoft gradient op by standard ONNX ops (in place).

    Works on any backward graph (gradgen's or ONNX Runtime training's), subgraphs included.
    Raises ``UnsupportedOpsError`` (a ``ModelError``) listing every non-standard op it cannot lower.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        functions = {(_domain(f.domain), f.name, f.overload) for f in model.functions.values()}
        targets = self._targets(model, functions)
        if not targets:
            modified = _drop_unused_microsoft(model)
            return ir.passes.PassResult(model, modified=modified)

        need = max(lookup_lowering(n.domain, n.op_type).min_opset(n) for n in targets)
        if _opset(model) < need:
            _convert_opset(model, need)
            targets = self._targets(model, functions)

        names = _all_names(model.graph)
        constants: dict[int, dict[tuple, ir.Value]] = {}
        for node in targets:
            graph = node.graph
            emitter = Emitter(graph, node, names, constants.setdefault(id(graph), {}), _opset(model))
            lowering = lookup_lowering(node.domain, node.op_type)
            outputs = list(lowering.fn(emitter, node))
            emitter.replace(outputs)
        _drop_unused_microsoft(model)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _targets(model: ir.Model, functions: set) -> list[ir.Node]:
        targets, missing = [], []
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.domain in STANDARD_DOMAINS or (_domain(node.domain), node.op_type, node.overload) in functions:
                continue
            if lookup_lowering(node.domain, node.op_type) is None:
                missing.append((_domain(node.domain), node.op_type, node.name or "<unnamed>"))
            else:
                targets.append(node)
        if missing:
            raise UnsupportedOpsError("a lowering to standard ONNX (portable mode)", missing)
        return targets


def _opset(model: ir.Model) -> int:
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx", 1))


def _convert_opset(model: ir.Model, target: int) -> None:
    """Convert the model to default-domain opset ``target`` with ONNX's version converter."""
    current = _opset(model)
    try:
        converted = onnx.version_converter.convert_version(ir.to_proto(model), target)
    except Exception as exc:  # noqa: BLE001 (the converter raises many kinds)
        raise ModelError(f"portable mode needs opset {target} (the model has {current}) and ONNX's version converter "
                         f"could not convert the model: {exc}") from None
    converted.ir_version = max(converted.ir_version, _ir_version_for(target))
    fresh = ir.from_proto(converted)
    model.graph = fresh.graph
    model.ir_version = fresh.ir_version


def _ir_version_for(opset: int) -> int:
    for entry in onnx.helper.VERSION_TABLE:
        if entry[2] == opset:
            return entry[1]
    return 8


def _drop_unused_microsoft(model: ir.Model) -> bool:
    if MICROSOFT not in model.opset_imports:
        return False
    used = any(n.domain == MICROSOFT for n in ir.traversal.RecursiveGraphIterator(model.graph))
    used = used or any(n.domain == MICROSOFT for f in model.functions.values() for n in f)
    if used:
        return False
    model.opset_imports.pop(MICROSOFT)
    return True


def _all_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | set(graph.initializers)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.name:
            names.add(node.name)
        names.update(v.name for v in node.outputs if v.name)
        names.update(v.name for v in node.inputs if v is not None and v.name)
    return names


# ================================================================================ emitting


class Emitter:
    """Builds the standard nodes that replace one node, then splices them in its place."""

    def __init__(self, graph: ir.Graph, node: ir.Node, names: set[str], constants: dict, opset: int):
        self.graph = graph
        self.node = node
        self.names = names
        self.constants = constants
        self.opset = opset
        self.nodes: list[ir.Node] = []
        self.known: dict[int, np.ndarray] = {}  # id(value) -> its constant value
        self.prefix = f"{node.name or node.op_type}/lowered"
        self._shapes: dict[int, ir.Value] = {}

    # -- naming and nodes -------------------------------------------------------------------
    def unique(self, name: str) -> str:
        candidate, n = name, 0
        while candidate in self.names:
            n += 1
            candidate = f"{name}_{n}"
        self.names.add(candidate)
        return candidate

    def op(self, op_type: str, *inputs: ir.Value | None, **attributes) -> ir.Value:
        return self.op_multi(op_type, list(inputs), 1, **attributes)[0]

    def op_multi(self, op_type: str, inputs: Sequence[ir.Value | None], num_outputs: int, **attributes) -> list[ir.Value]:
        attrs = {k: v for k, v in attributes.items() if v is not None}
        name = self.unique(f"{self.prefix}/{op_type}")
        outputs = [ir.Value(name=self.unique(f"{name}_out{i}" if num_outputs > 1 else f"{name}_out"))
                   for i in range(num_outputs)]
        node = ir.node(op_type, list(inputs), attrs, outputs=outputs, name=name)
        self.nodes.append(node)
        return list(node.outputs)

    def const(self, array, dtype=None) -> ir.Value:
        """A constant initializer, shared within the graph."""
        arr = np.asarray(array, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.constants:
            name = self.unique("gradgen/lower_const")
            value = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                             const_value=ir.tensor(arr, name=name))
            self.graph.register_initializer(value)
            self.constants[key] = value
        value = self.constants[key]
        self.known[id(value)] = arr
        return value

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def scalar(self, value: int) -> ir.Value:
        return self.const(np.asarray(value, dtype=np.int64))

    # -- what is known statically ----------------------------------------------------------
    def value_of(self, value: ir.Value | None) -> np.ndarray | None:
        """A value's content when it is constant (an initializer, a Constant, a Shape of a static
        shape, or a constant this emitter made), else None."""
        if value is None:
            return None
        if id(value) in self.known:
            return self.known[id(value)]
        if value.const_value is not None and not value.is_graph_input():
            return value.const_value.numpy()
        producer = value.producer()
        if producer is None or producer.domain not in ("", "ai.onnx"):
            return None
        if producer.op_type == "Constant":
            attr = producer.attributes.get("value")
            if attr is not None:
                return attr.value.numpy()
            for key in ("value_int", "value_ints"):
                if key in producer.attributes:
                    return np.asarray(producer.attributes[key].value, dtype=np.int64)
            return None
        if producer.op_type == "Shape":
            entries = self.shape_entries(value)
            if entries is not None and all(isinstance(d, int) for d in entries):
                return np.asarray(entries, dtype=np.int64)
        return None

    def shape_entries(self, shape: ir.Value) -> list | None:
        """The entries of a 1-D shape tensor as ints (known) or None (unknown); None if its length
        is unknown."""
        if id(shape) in self.known or (shape.const_value is not None and not shape.is_graph_input()):
            return [int(v) for v in self.value_of(shape).reshape(-1)]
        producer = shape.producer()
        if producer is not None and producer.domain in ("", "ai.onnx") and producer.op_type == "Shape":
            dims = dims_of(producer.inputs[0])
            if dims is not None:
                rank = len(dims)
                start = _attr(producer, "start", 0)
                end = _attr(producer, "end", rank)
                start = min(max(start + rank if start < 0 else start, 0), rank)
                end = min(max(end + rank if end < 0 else end, 0), rank)
                return [d if isinstance(d, int) else None for d in dims[start:end]]
        constant = self.value_of(shape) if producer is not None and producer.op_type == "Constant" else None
        if constant is not None:
            return [int(v) for v in constant.reshape(-1)]
        dims = dims_of(shape)
        if dims is not None and len(dims) == 1 and isinstance(dims[0], int):
            return [None] * dims[0]
        return None

    # -- helpers on int64 shape vectors ----------------------------------------------------
    def shape_of(self, x: ir.Value) -> ir.Value:
        """Shape(x) as an int64 vector: a constant when x's shape is static."""
        dims = dims_of(x)
        if is_static(dims):
            return self.ints(dims)
        if id(x) not in self._shapes:
            self._shapes[id(x)] = self.op("Shape", x)
        return self._shapes[id(x)]

    def part(self, shape: ir.Value, start: int, end: int | None = None) -> ir.Value:
        """shape[start:end] of a 1-D int64 shape tensor (Python slice bounds; end None: to the end)."""
        known = self.value_of(shape)
        if known is not None:
            return self.ints(known.reshape(-1)[start:end])
        entries = self.shape_entries(shape)
        if entries is not None:
            picked = entries[start:end]
            if all(isinstance(d, int) for d in picked):
                return self.ints(picked)
            start, end = range(len(entries))[start:end].start, range(len(entries))[start:end].stop
            if end <= start:
                return self.ints([])
        stop = INT64_MAX if end is None else end
        return self.op("Slice", shape, self.ints([start]), self.ints([stop]), self.ints([0]))

    def prod(self, shape: ir.Value, start: int, end: int | None = None) -> ir.Value:
        """[prod(shape[start:end])] as a 1-element int64 vector."""
        piece = shape if start == 0 and end is None else self.part(shape, start, end)
        known = self.value_of(piece)
        if known is not None:
            return self.ints([int(np.prod(known, dtype=np.int64))])
        return self.op("ReduceProd", piece, keepdims=1)

    def cat(self, *pieces: ir.Value) -> ir.Value:
        """Concat of 1-D int64 vectors; a constant when every piece is."""
        known = [self.value_of(p) for p in pieces]
        if all(k is not None for k in known):
            return self.ints(np.concatenate([k.reshape(-1) for k in known]).tolist())
        return self.op("Concat", *pieces, axis=0)

    def to_int64(self, x: ir.Value) -> ir.Value:
        if x.dtype == ir.DataType.INT64:
            return x
        return self.op("Cast", x, to=ir.DataType.INT64)

    def normalize_indices(self, indices: ir.Value, size: ir.Value) -> ir.Value:
        """Where(idx < 0, idx + size, idx) in int64 (size: a 1-element int64 vector)."""
        idx = self.to_int64(indices)
        negative = self.op("Less", idx, self.scalar(0))
        return self.op("Where", negative, self.op("Add", idx, size), idx)

    def zeros(self, shape: ir.Value, like: ir.Value) -> ir.Value:
        """Zeros of the given shape with like's element type."""
        if like.dtype is not None:
            zero = ir.tensor(np.zeros((1,), dtype=like.dtype.numpy()))
            return self.op("ConstantOfShape", shape, value=zero)
        return self.op("CastLike", self.op("ConstantOfShape", shape), like)

    # -- splicing ----------------------------------------------------------------------------
    def replace(self, outputs: Sequence[ir.Value | None]) -> None:
        """Put the new nodes where the old node was; its outputs' users read the new values,
        which take the old names and types (graph outputs keep their names)."""
        node = self.node
        olds, news = [], []
        for i, old in enumerate(node.outputs):
            new = outputs[i] if i < len(outputs) else None
            if not _needed(old):
                continue
            if new is None:
                raise ModelError(f"lowering {node.op_type} node {node.name!r}: output {old.name!r} is used "
                                 "but the lowering produced nothing for it")
            if new.producer() is None or new.producer() not in self.nodes:
                new = self.op("Identity", new)
            olds.append(old)
            news.append(new)
        for old, new in zip(olds, news):
            name = old.name
            self.names.add(name)
            old.name = self.unique(f"{name}/replaced")
            new.name = name
            if old.type is not None:
                new.type = old.type
            if old.shape is not None:
                new.shape = old.shape
        ir.convenience.replace_all_uses_with(olds, news, replace_graph_outputs=True)
        if self.nodes:
            self.graph.insert_before(node, self.nodes)
        self.graph.remove(node, safe=True)


def _needed(value: ir.Value | None) -> bool:
    return value is not None and bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def _attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    if attr is None:
        return default
    value = attr.value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, tuple):
        return list(value)
    return value


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def _where(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name or '<unnamed>'!r}"


def _zeros_opset(like_position: int) -> Callable[[ir.Node], int]:
    """The opset for a lowering that only needs zeros like input ``like_position``."""
    def need(node: ir.Node) -> int:
        like = _input(node, like_position)
        return CASTLIKE_OPSET if like is None or like.dtype is None else BASE_OPSET
    return need


def _scatter_add_opset(like_position: int) -> Callable[[ir.Node], int]:
    def need(node: ir.Node) -> int:
        return max(SCATTER_ADD_OPSET, _zeros_opset(like_position)(node))
    return need


# ================================================================================ SliceGrad


def _slice_pads(e: Emitter, node: ir.Node) -> list[int] | None:
    """Pad's pads for a SliceGrad whose slice is a plain window (all steps 1, everything known)."""
    dy, shape, starts, ends = (_input(node, i) for i in range(4))
    axes_in, steps_in = _input(node, 4), _input(node, 5)
    entries = e.shape_entries(shape)
    starts_v, ends_v = e.value_of(starts), e.value_of(ends)
    axes_v = e.value_of(axes_in) if axes_in is not None else None
    steps_v = e.value_of(steps_in) if steps_in is not None else None
    dy_dims = dims_of(dy)
    if entries is None or starts_v is None or ends_v is None or dy_dims is None or len(dy_dims) != len(entries):
        return None
    if (axes_in is not None and axes_v is None) or (steps_in is not None and (steps_v is None or np.any(steps_v != 1))):
        return None
    rank = len(entries)
    starts_l, ends_l = [int(v) for v in starts_v.reshape(-1)], [int(v) for v in ends_v.reshape(-1)]
    axes = list(range(len(starts_l))) if axes_v is None else [int(a) for a in axes_v.reshape(-1)]
    if not len(starts_l) == len(ends_l) == len(axes):
        return None
    axes = [a + rank if a < 0 else a for a in axes]
    if any(not 0 <= a < rank for a in axes) or len(set(axes)) != len(axes):
        return None
    begin, end = [0] * rank, [0] * rank
    for axis, start, stop in zip(axes, starts_l, ends_l):
        size = entries[axis]
        if size is None:
            return None
        start = start + size if start < 0 else start
        stop = stop + size if stop < 0 else stop
        start, stop = min(max(start, 0), size), min(max(stop, 0), size)
        stop = max(stop, start)
        begin[axis], end[axis] = start, size - stop
    return begin + end


@register_lowering("SliceGrad", min_opset=_zeros_opset(0))
def lower_slice_grad(e: Emitter, node: ir.Node):
    """dX = zeros(shape) with dY written where Slice(starts, ends, axes, steps) reads."""
    dy, shape, starts, ends = (_input(node, i) for i in range(4))
    axes, steps = _input(node, 4), _input(node, 5)
    if dy is None or shape is None or starts is None or ends is None:
        raise ModelError(f"{_where(node)} lacks one of its inputs dY, shape, starts, ends")
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
    slice_inputs = [grid, starts, ends]
    if axes is not None or steps is not None:
        slice_inputs.append(axes)
    if steps is not None:
        slice_inputs.append(steps)
    picked = e.op("Slice", *slice_inputs)
    flat = e.op("Reshape", picked, e.ints([-1]))
    updates = e.op("Reshape", dy, e.ints([-1]))
    scattered = e.op("ScatterElements", e.zeros(numel_vec, dy), flat, updates, axis=0)
    return [e.op("Reshape", scattered, shape64)]


# ================================================================================ GatherGrad


def _shape_rank(e: Emitter, shape: ir.Value) -> int | None:
    entries = e.shape_entries(shape)
    return None if entries is None else len(entries)


@register_lowering("GatherGrad", min_opset=_scatter_add_opset(2))
def lower_gather_grad(e: Emitter, node: ir.Node):
    """dX = zeros(shape); dX[..., idx[j], ...] += dY[..., j, ...] along ``axis``."""
    shape, indices, dy = (_input(node, i) for i in range(3))
    axis = int(_attr(node, "axis", 0))
    rank = _shape_rank(e, shape)
    if rank is None:
        dy_dims, idx_dims = dims_of(dy), dims_of(indices)
        if dy_dims is not None and idx_dims is not None:
            rank = len(dy_dims) - len(idx_dims) + 1
    if rank is not None:
        if not -rank <= axis < rank:
            raise ModelError(f"{_where(node)}: axis {axis} is out of range for rank {rank}")
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


@register_lowering("GatherElementsGrad", min_opset=_scatter_add_opset(0))
def lower_gather_elements_grad(e: Emitter, node: ir.Node):
    """dX = zeros(shape); dX[idx[i] along axis, other coordinates of i] += dY[i]."""
    dy, shape, indices = (_input(node, i) for i in range(3))
    axis = int(_attr(node, "axis", 0))
    shape64 = e.to_int64(shape)
    rank = _shape_rank(e, shape)
    if rank is None:
        for v in (dy, indices):
            if dims_of(v) is not None:
                rank = len(dims_of(v))
    if rank is not None:
        if not -rank <= axis < rank:
            raise ModelError(f"{_where(node)}: axis {axis} is out of range for rank {rank}")
        axis = axis + rank if axis < 0 else axis
        size = e.part(shape64, axis, axis + 1)
    else:  # Gather takes the negative axis as it is
        size = e.op("Gather", shape64, e.ints([axis]), axis=0)
    normalized = e.normalize_indices(indices, size)
    return [e.op("ScatterElements", e.zeros(shape64, dy), normalized, dy, axis=axis, reduction="add")]


# ================================================================================ ConvGrad


def _conv_pads(e: Emitter, node: ir.Node, x: ir.Value, kernel, kernel_value, strides, dilations, nd):
    """(begin, end) pads of the forward Conv: lists of ints when static, else int64 vectors
    computed from X's shape (auto_pad SAME_* with X's spatial dims unknown)."""
    auto_pad = _attr(node, "auto_pad", "NOTSET") or "NOTSET"
    if auto_pad == "NOTSET":
        pads = _attr(node, "pads", [0] * (2 * nd))
        if len(pads) != 2 * nd:
            raise ModelError(f"{_where(node)}: pads {pads} must have {2 * nd} values")
        return list(pads[:nd]), list(pads[nd:])
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{_where(node)}: unknown auto_pad {auto_pad!r}")
    x_dims = dims_of(x)
    spatial = None if x_dims is None else x_dims[2:]
    if kernel is not None and spatial is not None and all(isinstance(d, int) for d in spatial):
        span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max(0, (o - 1) * s + sp - n) for o, s, sp, n in zip(out, strides, span, spatial)]
        small, big = [t // 2 for t in total], [t - t // 2 for t in total]
        return (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    # The same arithmetic on X's runtime shape.
    n = e.part(e.shape_of(x), 2, 2 + nd)
    s_vec = e.ints(strides)
    if kernel is not None:
        span_vec = e.ints([(k - 1) * d + 1 for k, d in zip(kernel, dilations)])
    else:
        span_vec = e.op("Add", e.op("Mul", e.op("Sub", kernel_value, e.ints([1] * nd)), e.ints(dilations)),
                        e.ints([1] * nd))
    out = e.op("Div", e.op("Add", n, e.ints([s - 1 for s in strides])), s_vec)
    reach = e.op("Add", e.op("Mul", e.op("Sub", out, e.ints([1] * nd)), s_vec), span_vec)
    total = e.op("Max", e.op("Sub", reach, n), e.ints([0] * nd))
    small = e.op("Div", total, e.ints([2] * nd))
    big = e.op("Sub", total, small)
    return (small, big) if auto_pad == "SAME_UPPER" else (big, small)


def _pads_vector(e: Emitter, begin, end, lead: int = 2) -> ir.Value:
    """Pad's pads for a tensor with ``lead`` unpadded leading axes."""
    zeros = e.ints([0] * lead)
    as_value = lambda v: v if isinstance(v, ir.Value) else e.ints(v)
    return e.cat(zeros, as_value(begin), zeros, as_value(end))


@register_lowering("ConvGrad")
def lower_conv_grad(e: Emitter, node: ir.Node):
    """dX by ConvTranspose, dW by a Conv of X with dY (batch and channels swapped), dB by ReduceSum."""
    dy, x, w = (_input(node, i) for i in range(3))
    x_dims, w_dims, dy_dims = dims_of(x), dims_of(w), dims_of(dy)
    kernel = _attr(node, "kernel_shape")
    if w_dims is not None and all(isinstance(d, int) for d in w_dims[2:]):
        kernel = list(w_dims[2:])
    nd = len(kernel) if kernel is not None else _conv_spatial_rank(node, x_dims, w_dims, dy_dims)
    kernel_value = e.ints(kernel) if kernel is not None else e.part(e.shape_of(w), 2, 2 + nd)
    group = int(_attr(node, "group", 1))
    strides = list(_attr(node, "strides", [1] * nd))
    dilations = list(_attr(node, "dilations", [1] * nd))
    begin, end = _conv_pads(e, node, x, kernel, kernel_value, strides, dilations, nd)
    static_pads = not isinstance(begin, ir.Value)
    spatial = None if x_dims is None else x_dims[2:]
    static_spatial = spatial is not None and all(isinstance(d, int) for d in spatial)
    spatial_axes = list(range(2, 2 + nd))
    outs = list(node.outputs) + [None] * (3 - len(node.outputs))
    results: list[ir.Value | None] = [None, None, None]

    if _needed(outs[0]):
        if static_pads and ((static_spatial and kernel is not None) or all(s == 1 for s in strides)):
            output_padding = [0] * nd
            if static_spatial and kernel is not None:
                span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
                output_padding = [(n + b + f - sp) % s for n, b, f, sp, s in zip(spatial, begin, end, span, strides)]
            results[0] = e.op("ConvTranspose", dy, w, strides=strides, dilations=dilations, group=group,
                              pads=begin + end, kernel_shape=kernel,
                              output_padding=output_padding if any(output_padding) else None)
        else:
            # Unpadded ConvTranspose covers padded-X positions [0, L); dX is positions
            # [begin, begin + X) of the padded X, zero past L.
            full = e.op("ConvTranspose", dy, w, strides=strides, dilations=dilations, group=group, kernel_shape=kernel)
            n = e.part(e.shape_of(x), 2, 2 + nd)
            starts = begin if isinstance(begin, ir.Value) else e.ints(begin)
            window = e.op("Slice", full, starts, e.op("Add", starts, n), e.ints(spatial_axes))
            short = e.op("Sub", n, e.part(e.op("Shape", window), 2, 2 + nd))
            results[0] = e.op("Pad", window, e.cat(e.ints([0] * (2 + nd)), e.ints([0, 0]), short))

    if _needed(outs[1]):
        lead = [1, 0] + spatial_axes
        xs = x
        conv_pads = begin + end if static_pads else None
        if not static_pads:
            xs = e.op("Pad", x, _pads_vector(e, begin, end))
        if group == 1:
            xt = e.op("Transpose", xs, perm=lead)      # (C, N, *spatial)
            dyt = e.op("Transpose", dy, perm=lead)     # (M, N, *out)
        else:
            x_shape, dy_shape, w_shape = e.shape_of(xs), e.shape_of(dy), e.shape_of(w)
            cg, filters = e.part(w_shape, 1, 2), e.part(w_shape, 0, 1)
            per_group = e.ints([w_dims[0] // group]) if w_dims is not None and isinstance(w_dims[0], int) \
                else e.op("Div", filters, e.ints([group]))
            rest = list(range(3, 3 + nd))
            # X (N, G*Cg, *sp) -> (Cg, G*N, *sp): batch Cg, G groups of N channels.
            xg = e.op("Reshape", xs, e.cat(e.part(x_shape, 0, 1), e.ints([group]), cg, e.part(x_shape, 2, 2 + nd)))
            xt = e.op("Reshape", e.op("Transpose", xg, perm=[2, 1, 0] + rest),
                      e.cat(cg, e.ints([-1]), e.part(x_shape, 2, 2 + nd)))
            # dY (N, G*Mg, *out) -> (G*Mg, N, *out): G groups of Mg filters over N channels.
            dyg = e.op("Reshape", dy, e.cat(e.part(dy_shape, 0, 1), e.ints([group]), per_group,
                                             e.part(dy_shape, 2, 2 + nd)))
            dyt = e.op("Reshape", e.op("Transpose", dyg, perm=[1, 2, 0] + rest),
                       e.cat(filters, e.ints([-1]), e.part(dy_shape, 2, 2 + nd)))
        full = e.op("Conv", xt, dyt, strides=dilations, dilations=strides, pads=conv_pads, group=group)
        dw = e.op("Transpose", full, perm=lead)       # (M, Cg, *k')
        if not (static_pads and kernel is not None
                and _crop_is_noop(x_dims, dy_dims, kernel, begin, end, strides, dilations)):
            dw = e.op("Slice", dw, e.ints([0] * nd), kernel_value, e.ints(spatial_axes))
        results[1] = dw

    if _needed(outs[2]):
        results[2] = e.op("ReduceSum", dy, e.ints([0] + spatial_axes), keepdims=0)
    return results


def _conv_spatial_rank(node: ir.Node, *dims) -> int:
    for name in ("strides", "dilations"):
        if name in node.attributes:
            return len(_attr(node, name))
    if "pads" in node.attributes:
        return len(_attr(node, "pads")) // 2
    for d in dims:
        if d is not None:
            return len(d) - 2
    raise ModelError(f"{_where(node)}: the number of spatial axes is unknown (no kernel_shape, strides, dilations "
                     "or pads attribute, and X, W and dY have unknown ranks)")


def _crop_is_noop(x_dims, dy_dims, kernel, begin, end, strides, dilations) -> bool:
    """True when the dW Conv's output is already kernel-sized (statically known)."""
    if x_dims is None or dy_dims is None:
        return False
    for i, k in enumerate(kernel):
        n, o = x_dims[2 + i], dy_dims[2 + i]
        if not isinstance(n, int) or not isinstance(o, int):
            return False
        size = (n + begin[i] + end[i] - ((o - 1) * strides[i] + 1)) // dilations[i] + 1
        if size != k:
            return False
    return True


# ================================================================================ BroadcastGradientArgs


@register_lowering("BroadcastGradientArgs")
def lower_broadcast_gradient_args(e: Emitter, node: ir.Node):
    """The axes each operand of a broadcasting op is reduced over, in descending order."""
    from gradgen.kernels.cpu.microsoft import broadcast_gradient_axes

    a, b = _input(node, 0), _input(node, 1)
    a_known, b_known = e.value_of(a), e.value_of(b)
    if a_known is not None and b_known is not None:
        try:
            a_axes, b_axes = broadcast_gradient_axes(a_known.reshape(-1).tolist(), b_known.reshape(-1).tolist())
        except KernelError as exc:
            raise ModelError(f"{_where(node)}: {exc}") from None
        return [e.ints(a_axes), e.ints(b_axes)]
    a64, b64 = e.to_int64(a), e.to_int64(b)
    ra, rb = e.op("Shape", a64), e.op("Shape", b64)
    n = e.op("Max", ra, rb)
    one = ir.tensor(np.ones((1,), dtype=np.int64))
    lead_a, lead_b = e.op("Sub", n, ra), e.op("Sub", n, rb)
    a_full = e.op("Concat", e.op("ConstantOfShape", lead_a, value=one), a64, axis=0)
    b_full = e.op("Concat", e.op("ConstantOfShape", lead_b, value=one), b64, axis=0)
    # Output axes from the last to the first.
    k = e.op("Range", e.op("Sub", e.op("Reshape", n, e.ints([])), e.scalar(1)), e.scalar(-1), e.scalar(-1))
    a_dims, b_dims = e.op("Gather", a_full, k, axis=0), e.op("Gather", b_full, k, axis=0)
    a_one, b_one = e.op("Equal", a_dims, e.scalar(1)), e.op("Equal", b_dims, e.scalar(1))
    results = [None, None]
    if _needed(node.outputs[0] if node.outputs else None):
        take = e.op("Or", e.op("Less", k, lead_a), e.op("And", a_one, e.op("Not", b_one)))
        results[0] = e.op("Compress", k, take, axis=0)
    if len(node.outputs) > 1 and _needed(node.outputs[1]):
        take = e.op("Or", e.op("Less", k, lead_b), e.op("And", b_one, e.op("Not", a_one)))
        results[1] = e.op("Compress", k, take, axis=0)
    return results


__all__ = ["Emitter", "LowerToStandardPass", "Lowering", "lookup_lowering", "lowerable_ops", "register_lowering"]
