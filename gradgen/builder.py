"""GraphBuilder: the one way gradgen writes nodes into an onnx-ir graph.

The gradient rules (through ``grads.builder.GradContext``) and the lowering to standard ONNX both
emit through it: unique names, shared constants, one Shape node per tensor (a constant when the
shape is static), what is known of int64 shape vectors, opset-aware helpers for ops whose
signature changed across opsets, and the undoing of broadcasting. Emitted com.microsoft nodes are
checked against their schemas (``gradgen.ops.schemas``).

A builder either appends each node to the graph as it is made (the gradient pass) or only
collects them in ``nodes`` for the caller to place (the lowering splices them where the node it
replaces was).
"""

from __future__ import annotations

from typing import Any, Sequence, TypeGuard, overload

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError
from gradgen.names import unique_name
from gradgen.ops import schemas
from gradgen.ops.elementwise import same_dim, static_broadcast_axes
from gradgen.ops.shape import shape_bounds

MICROSOFT = schemas.MICROSOFT_DOMAIN
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
STANDARD_DOMAINS = ("", "ai.onnx")

__all__ = ["GraphBuilder", "MICROSOFT", "dims_of", "graph_names", "is_static", "numpy_dtype_of", "same_dim"]


def dims_of(value: ir.Value) -> list | None:
    """The value's shape as a list of int (static), str (named symbol) or None (unknown)."""
    if value.shape is None:
        return None
    out: list[int | str | None] = []
    for d in value.shape:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(d.value if d.value else None)
    return out


def is_static(dims: list | None) -> TypeGuard[list[int]]:
    return dims is not None and all(isinstance(d, int) for d in dims)


def numpy_dtype_of(x: ir.Value) -> np.dtype:
    """x's element type; a model error naming x and its producer when no one could tell it."""
    if x.dtype is None:
        producer = x.producer()
        made_by = f" (output of {producer.op_type} node {producer.name!r})" if producer is not None else ""
        raise ModelError(
            f"the element type of {x.name!r}{made_by} is unknown: ONNX shape inference could not "
            "tell it; declare it in the model's value_info"
        )
    return np.dtype(x.dtype.numpy())


def graph_names(graph: ir.Graph) -> set[str]:
    """Every name used in ``graph`` and its subgraphs (values, initializers, nodes)."""
    names = {v.name for v in [*graph.inputs, *graph.outputs] if v.name is not None} | set(graph.initializers)
    _add_node_names(graph, names)
    names.discard(None)  # type: ignore[arg-type]
    names.discard("")
    return names


def _add_node_names(graph: ir.Graph, names: set[str]) -> None:
    """The names of the nodes of ``graph`` and its subgraphs and of the values they read and make
    (one plain loop: a graph of thousands of nodes is scanned by several passes)."""
    add = names.add
    graph_type, graphs_type = ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS
    for node in graph:
        add(node.name)  # type: ignore[arg-type]  # None and "" are dropped by the caller
        for output in node.outputs:
            add(output.name)  # type: ignore[arg-type]
        for value in node.inputs:
            if value is not None:
                add(value.name)  # type: ignore[arg-type]
        # the attributes' plain dict (a UserDict's ``data``): its views iterate in Python, a
        # quarter of the scan
        for attr in node.attributes.data.values():
            if attr.type == graph_type and isinstance(attr, ir.Attr):
                _add_node_names(attr.value, names)
            elif attr.type == graphs_type and isinstance(attr, ir.Attr):
                for sub in attr.value:
                    _add_node_names(sub, names)


class GraphBuilder:
    """Emits nodes into ``graph``; every emitted value and node gets a unique name.

    ``names`` (a set shared by several builders of one model) and ``constants`` (a cache of
    constant initializers of ``graph``) may be passed in; ``append=False`` collects the nodes in
    ``nodes`` without adding them to the graph.
    """

    def __init__(
        self,
        graph: ir.Graph,
        opset: int,
        *,
        names: set[str] | None = None,
        constants: dict | None = None,
        prefix: str = "Grad",
        const_prefix: str = "gradgen/const",
        append: bool = True,
    ):
        self.graph = graph
        self.opset = opset
        self.prefix = prefix
        self.const_prefix = const_prefix
        self.append = append
        self.nodes: list[ir.Node] = []
        self.node_set: set[ir.Node] = set()  # the same nodes, for membership tests
        self.known: dict[int, np.ndarray] = {}  # id(value) -> the value of a constant made here
        self._taken = graph_names(graph) if names is None else names
        self._constants: dict[tuple, ir.Value] = {} if constants is None else constants
        self._shapes: dict[int, ir.Value] = {}
        self._bga: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}

    # -- naming ----------------------------------------------------------------------------
    def unique(self, name: str) -> str:
        return unique_name(name, self._taken)

    def rename(self, value: ir.Value, name: str) -> None:
        self._taken.discard(value.name)
        value.name = self.unique(name)

    def name_is_free(self, name: str) -> bool:
        return name not in self._taken

    def reserve(self, name: str) -> None:
        """Mark ``name`` as used (for values created outside ``op``, such as the loss seed)."""
        self._taken.add(name)

    def collector(self, prefix: str) -> GraphBuilder:
        """A builder sharing this one's names and constants that collects its nodes in ``nodes``
        instead of appending them (nodes for a subgraph, such as a backward loop's body)."""
        return GraphBuilder(self.graph, self.opset, names=self._taken, constants=self._constants, prefix=prefix, append=False)

    # -- emitting ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", **attributes: Any) -> ir.Value:
        """Emit one node with one output and return that output."""
        return self.op_multi(op_type, list(inputs), 1, domain=domain, **attributes)[0]

    def op_multi(
        self,
        op_type: str,
        inputs: Sequence[ir.Value | None],
        num_outputs: int,
        domain: str = "",
        output_names: Sequence[str] | None = None,
        **attributes: Any,
    ) -> list[ir.Value]:
        """Emit one node with ``num_outputs`` outputs; an output named "" is an omitted optional one."""
        attributes = {k: v for k, v in attributes.items() if v is not None}
        if domain == MICROSOFT:
            schemas.check_node(op_type, len(inputs), num_outputs, attributes, where="(emitted by gradgen)")
        attrs = [_attribute(k, v) for k, v in attributes.items()]
        node_name = self.unique(f"{self.prefix}/{op_type}")
        if output_names is None:
            output_names = [f"{node_name}_out{i}" if num_outputs > 1 else f"{node_name}_out" for i in range(num_outputs)]
        outputs = [ir.Value(name=self.unique(n) if n else "") for n in output_names]
        node = ir.Node(domain, op_type, list(inputs), attrs, outputs=outputs, name=node_name)
        if self.append:
            self.graph.append(node)
        self.nodes.append(node)
        self.node_set.add(node)
        return list(node.outputs)

    def const(self, array, dtype=None) -> ir.Value:
        """A shared constant initializer (one per distinct dtype, shape and bytes)."""
        arr = np.asarray(array, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._constants:
            name = self.unique(self.const_prefix)
            value = ir.Value(
                name=name,
                shape=ir.Shape(arr.shape),
                type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                const_value=ir.Tensor(arr, name=name),
            )
            self.graph.register_initializer(value)
            self._constants[key] = value
        value = self._constants[key]
        self.known[id(value)] = arr
        return value

    def const_like(self, x: ir.Value, scalar: float) -> ir.Value:
        """A rank-0 constant of x's element type (x must be typed: pass a forward value)."""
        return self.const(np.array(scalar, dtype=numpy_dtype_of(x)))

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def scalar(self, value: int) -> ir.Value:
        """A rank-0 int64 constant."""
        return self.const(np.asarray(value, dtype=np.int64))

    # -- what is known statically ----------------------------------------------------------
    def value_of(self, value: ir.Value | None) -> np.ndarray | None:
        """A value's content when it is constant (an initializer that is not a graph input, a
        Constant, a Shape of a static shape, or a constant this builder made), else None."""
        if value is None:
            return None
        if id(value) in self.known:
            return self.known[id(value)]
        if value.const_value is not None and not value.is_graph_input():
            return value.const_value.numpy()
        producer = value.producer()
        if producer is None or producer.domain not in STANDARD_DOMAINS:
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
            known = self.value_of(shape)
            assert known is not None  # a constant or a value this builder knows
            return [int(v) for v in known.reshape(-1)]
        producer = shape.producer()
        if producer is not None and producer.domain in STANDARD_DOMAINS and producer.op_type == "Shape":
            data = producer.inputs[0]
            dims = dims_of(data) if data is not None else None
            if dims is not None:
                start, end = shape_bounds(len(dims), _int_attr(producer, "start", 0), _int_attr(producer, "end", None))
                return [d if isinstance(d, int) else None for d in dims[start:end]]
        constant = self.value_of(shape) if producer is not None and producer.op_type == "Constant" else None
        if constant is not None:
            return [int(v) for v in constant.reshape(-1)]
        dims = dims_of(shape)
        if dims is not None and len(dims) == 1 and isinstance(dims[0], int):
            return [None] * dims[0]
        return None

    # -- int64 shape vectors ---------------------------------------------------------------
    def shape_of(self, x: ir.Value) -> ir.Value:
        """Shape(x), emitted once per tensor; a static shape becomes a constant instead."""
        dims = dims_of(x)
        if is_static(dims):
            return self.ints(dims)
        key = id(x)
        if key not in self._shapes:
            self._shapes[key] = self.op("Shape", x)
        return self._shapes[key]

    def part(self, shape: ir.Value, start: int, end: int | None = None) -> ir.Value:
        """shape[start:end] of a 1-D int64 shape tensor (Python slice bounds; end None: to the end)."""
        known = self.value_of(shape)
        if known is not None:
            return self.ints(known.reshape(-1)[start:end].tolist())
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
        known = [k for k in (self.value_of(p) for p in pieces) if k is not None]
        if len(known) == len(pieces):
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

    # -- opset-aware helpers ---------------------------------------------------------------
    def reduce(
        self,
        op_type: str,
        x: ir.Value,
        axes: Sequence[int] | ir.Value | None,
        keepdims: int = 1,
        noop_with_empty_axes: int | None = None,
    ) -> ir.Value:
        """ReduceSum/Mean/Max/...: axes as an input from opset 13 (Sum) or 18 (others)."""
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes is None:
            return self.op(op_type, x, keepdims=keepdims, noop_with_empty_axes=noop_with_empty_axes)
        if axes_as_input:
            axes_value = axes if isinstance(axes, ir.Value) else self.ints(axes)
            return self.op(op_type, x, axes_value, keepdims=keepdims, noop_with_empty_axes=noop_with_empty_axes)
        if isinstance(axes, ir.Value):
            raise NotImplementedError(f"{op_type} with dynamic axes needs opset 18")
        return self.op(op_type, x, axes=list(axes), keepdims=keepdims)

    def reduce_sum(self, x: ir.Value, axes, keepdims: int = 1, noop_with_empty_axes: int | None = None) -> ir.Value:
        return self.reduce("ReduceSum", x, axes, keepdims, noop_with_empty_axes)

    def unsqueeze(self, x: ir.Value, axes: Sequence[int]) -> ir.Value:
        """Unsqueeze; where x's shape is known the result's is set (the build runs no shape inference
        after the gradient pass, and a lowering may need the rank: a transposed operand's perm)."""
        out = self.op("Unsqueeze", x, self.ints(axes))
        if x.shape is not None:
            rank = len(x.shape) + len(axes)
            inserted = {a % rank for a in axes if -rank <= a < rank}
            if len(inserted) == len(axes):
                dims = iter(x.shape)
                out.shape = ir.Shape([1 if axis in inserted else next(dims) for axis in range(rank)])
                if out.type is None and x.type is not None:
                    out.type = x.type
        return out

    def squeeze(self, x: ir.Value, axes: Sequence[int]) -> ir.Value:
        return self.op("Squeeze", x, self.ints(axes))

    def reshape(self, x: ir.Value, shape: Sequence[int] | ir.Value, exact: bool = False) -> ir.Value:
        """Reshape; ``exact`` says ``shape`` holds true sizes (no -1, 0 meaning an empty axis,
        not "copy"): then it is emitted with allowzero=1 where the opset has it (14+)."""
        allowzero = 1 if exact and self.opset >= 14 else None
        return self.op("Reshape", x, shape if isinstance(shape, ir.Value) else self.ints(shape), allowzero=allowzero)

    def reshape_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        return self.reshape(x, self.shape_of(like), exact=True)

    def expand_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        return self.op("Expand", x, self.shape_of(like))

    def zeros(self, shape: ir.Value, like: ir.Value) -> ir.Value:
        """Zeros of the given shape with like's element type (CastLike when that is unknown)."""
        if like.dtype is not None:
            zero = ir.tensor(np.zeros((1,), dtype=like.dtype.numpy()))
            return self.op("ConstantOfShape", shape, value=zero)
        return self.op("CastLike", self.op("ConstantOfShape", shape), like)

    def zeros_like(self, x: ir.Value) -> ir.Value:
        return self.filled_like(x, 0)

    def ones_like(self, x: ir.Value) -> ir.Value:
        return self.filled_like(x, 1)

    def filled_like(self, x: ir.Value, value) -> ir.Value:
        """A tensor of x's shape and element type holding ``value`` everywhere."""
        fill = ir.Tensor(np.full((1,), value, dtype=numpy_dtype_of(x)))
        return self.op("ConstantOfShape", self.shape_of(x), value=fill)

    def cast_like(self, x: ir.Value, like: ir.Value) -> ir.Value:
        return self.op("Cast", x, to=ir.DataType.from_numpy(numpy_dtype_of(like)))

    def transpose(self, x: ir.Value, perm: Sequence[int]) -> ir.Value:
        return self.op("Transpose", x, perm=list(perm))

    def sum(self, parts: Sequence[ir.Value]) -> ir.Value:
        return parts[0] if len(parts) == 1 else self.op("Sum", *parts)

    # -- broadcasting --------------------------------------------------------------------
    def unbroadcast(self, grad: ir.Value, x: ir.Value, out: ir.Value, partner: tuple[ir.Value, int] | None) -> ir.Value:
        """Sum ``grad`` (shaped like ``out``, the broadcast result) down to x's shape.

        Static when the shapes decide which axes were broadcast (a ReduceSum, plus a Reshape when
        ranks differ); otherwise Shape -> BroadcastGradientArgs -> ReduceSum -> Reshape. For a
        binary op, ``partner`` is (the other operand, x's position 0 or 1), so that one
        BroadcastGradientArgs node serves both operands.
        """
        x_dims, out_dims = dims_of(x), dims_of(out)
        axes = static_broadcast_axes(x_dims, out_dims)
        if axes is not None:
            assert x_dims is not None and out_dims is not None  # static_broadcast_axes needs both
            if not axes:
                return grad
            reduced = self.reduce_sum(grad, axes, keepdims=1)
            lead = len(out_dims) - len(x_dims)
            if lead:  # drop the leading axes x did not have
                reduced = self.reshape(reduced, x_dims, exact=True) if is_static(x_dims) else self.squeeze(reduced, range(lead))
            return reduced
        axes_value = self._dynamic_broadcast_axes(x, out, partner)
        reduced = self.reduce_sum(grad, axes_value, keepdims=1, noop_with_empty_axes=1)
        return self.reshape_like(reduced, x)

    def _dynamic_broadcast_axes(self, x: ir.Value, out: ir.Value, partner) -> ir.Value:
        if partner is not None:
            other, position = partner
            a, b = (x, other) if position == 0 else (other, x)
        else:
            a, b, position = x, out, 0
        key = (id(a), id(b))
        if key not in self._bga:
            a_axes, b_axes = self.op_multi("BroadcastGradientArgs", [self.shape_of(a), self.shape_of(b)], 2, domain=MICROSOFT)
            for v in (a_axes, b_axes):
                v.type = ir.TensorType(ir.DataType.INT64)
                v.shape = ir.Shape([None])
            self._bga[key] = (a_axes, b_axes)
        return self._bga[key][position]


@overload
def _int_attr(node: ir.Node, name: str, default: int) -> int: ...
@overload
def _int_attr(node: ir.Node, name: str, default: None) -> int | None: ...
def _int_attr(node: ir.Node, name: str, default: int | None) -> int | None:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _attribute(name: str, value: Any) -> ir.Attr:
    """An ir.Attr for the value types builders use, without onnx-ir's general (slower) type inference."""
    if isinstance(value, (bool, int, np.integer)):  # ir.DataType is an int too
        return ir.AttrInt64(name, int(value))
    if isinstance(value, (float, np.floating)):
        return ir.AttrFloat32(name, float(value))
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, ir.Tensor):
        return ir.AttrTensor(name, value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, np.integer)) for v in value):
        return ir.AttrInt64s(name, [int(v) for v in value])
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (float, int)) for v in value):
        return ir.AttrFloat32s(name, [float(v) for v in value])
    return ir.convenience.convert_attribute(name, value)
