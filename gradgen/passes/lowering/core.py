"""The lowering table, LowerToStandardPass and the Emitter the lowerings build with.

Each family module of this package (shape, indexing, conv, elementwise: the family names of
grads/rules and kernels/) registers the lowerings of its com.microsoft ops with
``register_lowering``; the table loads them the first time it is looked up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from gradgen.errors import ModelError, UnsupportedOpsError
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
    _load_families()
    return _LOWERINGS.get((_domain(domain), op_type))


def lowerable_ops() -> list[tuple[str, str]]:
    """(domain, op_type) of every op this pass can lower."""
    _load_families()
    return sorted(_LOWERINGS)


def _load_families() -> None:
    """Import the family modules once; their ``register_lowering`` decorators fill the table."""
    from gradgen.passes.lowering import conv, elementwise, indexing, shape  # noqa: F401


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
                start = node_attr(producer, "start", 0)
                end = node_attr(producer, "end", rank)
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
            if not is_needed(old):
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


def is_needed(value: ir.Value | None) -> bool:
    return value is not None and bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def node_attr(node: ir.Node, name: str, default=None):
    attr = node.attributes.get(name)
    if attr is None:
        return default
    value = attr.value
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, tuple):
        return list(value)
    return value


def node_input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def node_where(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name or '<unnamed>'!r}"


def zeros_opset(like_position: int) -> Callable[[ir.Node], int]:
    """The opset for a lowering that only needs zeros like input ``like_position``."""
    def need(node: ir.Node) -> int:
        like = node_input(node, like_position)
        return CASTLIKE_OPSET if like is None or like.dtype is None else BASE_OPSET
    return need


def scatter_add_opset(like_position: int) -> Callable[[ir.Node], int]:
    def need(node: ir.Node) -> int:
        return max(SCATTER_ADD_OPSET, zeros_opset(like_position)(node))
    return need
