"""The graph builder the gradient rules write through.

``Builder`` appends nodes to the backward part of a graph: unique names, shared constants, one
Shape node per tensor, opset-aware helpers for ops whose signature changed across opsets, and
the broadcast undoing used by the walker. ``GradContext`` is what one rule sees: the forward
node, its output gradients, and the builder's methods.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError

MICROSOFT = "com.microsoft"

Dim = "int | str | None"  # a static size, a symbol name, or unknown


def dims_of(value: ir.Value) -> list | None:
    """The value's shape as a list of int (static), str (named symbol) or None (unknown)."""
    if value.shape is None:
        return None
    out = []
    for d in value.shape:
        if isinstance(d, int):
            out.append(d)
        else:
            out.append(d.value if d.value else None)
    return out


def is_static(dims: list | None) -> bool:
    return dims is not None and all(isinstance(d, int) for d in dims)


def same_dim(a, b) -> bool:
    """True only when two dims are provably equal (unknown dims are never equal)."""
    return a is not None and b is not None and a == b


class Builder:
    """Emits backward nodes into ``graph`` in order; every emitted value gets a unique name."""

    def __init__(self, graph: ir.Graph, opset: int):
        self.graph = graph
        self.opset = opset
        self.nodes: list[ir.Node] = []
        self.node_set: set[ir.Node] = set()  # the same nodes, for membership tests
        self._taken = _all_names(graph)
        self._constants: dict[tuple, ir.Value] = {}
        self._shapes: dict[int, ir.Value] = {}
        self._bga: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}
        self.prefix = "Grad"

    # -- naming ----------------------------------------------------------------------------
    def unique(self, name: str) -> str:
        candidate, n = name, 0
        while candidate in self._taken:
            n += 1
            candidate = f"{name}_{n}"
        self._taken.add(candidate)
        return candidate

    def rename(self, value: ir.Value, name: str) -> None:
        self._taken.discard(value.name)
        value.name = self.unique(name)

    def name_is_free(self, name: str) -> bool:
        return name not in self._taken

    def reserve(self, name: str) -> None:
        """Mark ``name`` as used (for values created outside ``op``, such as the loss seed)."""
        self._taken.add(name)

    # -- emitting ---------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", **attributes: Any) -> ir.Value:
        """Emit one node with one output and return that output."""
        return self.op_multi(op_type, list(inputs), 1, domain=domain, **attributes)[0]

    def op_multi(self, op_type: str, inputs: Sequence[ir.Value | None], num_outputs: int,
                 domain: str = "", output_names: Sequence[str] | None = None, **attributes: Any) -> list[ir.Value]:
        """Emit one node with ``num_outputs`` outputs; an output named "" is an omitted optional one."""
        attrs = [_attribute(k, v) for k, v in attributes.items() if v is not None]
        node_name = self.unique(f"{self.prefix}/{op_type}")
        if output_names is None:
            output_names = [f"{node_name}_out{i}" if num_outputs > 1 else f"{node_name}_out" for i in range(num_outputs)]
        outputs = [ir.Value(name=self.unique(n) if n else "") for n in output_names]
        node = ir.Node(domain, op_type, list(inputs), attrs, outputs=outputs, name=node_name)
        self.graph.append(node)
        self.nodes.append(node)
        self.node_set.add(node)
        return list(node.outputs)

    def const(self, array, dtype=None) -> ir.Value:
        """A shared constant initializer (one per distinct dtype, shape and bytes)."""
        arr = np.asarray(array, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._constants:
            name = self.unique("gradgen/const")
            value = ir.Value(name=name, shape=ir.Shape(arr.shape),
                             type=ir.TensorType(ir.DataType.from_numpy(arr.dtype)),
                             const_value=ir.Tensor(arr, name=name))
            self.graph.register_initializer(value)
            self._constants[key] = value
        return self._constants[key]

    def const_like(self, x: ir.Value, scalar: float) -> ir.Value:
        """A rank-0 constant of x's element type (x must be typed: pass a forward value)."""
        return self.const(np.array(scalar, dtype=numpy_dtype_of(x)))

    def ints(self, values: Sequence[int]) -> ir.Value:
        return self.const(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def shape_of(self, x: ir.Value) -> ir.Value:
        """Shape(x), emitted once per tensor; a static shape becomes a constant instead."""
        dims = dims_of(x)
        if is_static(dims):
            return self.ints(dims)
        key = id(x)
        if key not in self._shapes:
            self._shapes[key] = self.op("Shape", x)
        return self._shapes[key]

    # -- opset-aware helpers ---------------------------------------------------------------
    def reduce(self, op_type: str, x: ir.Value, axes: Sequence[int] | ir.Value | None,
               keepdims: int = 1, noop_with_empty_axes: int | None = None) -> ir.Value:
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
        return self.op("Unsqueeze", x, self.ints(axes))

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

    def zeros_like(self, x: ir.Value) -> ir.Value:
        zero = ir.Tensor(np.zeros((1,), dtype=numpy_dtype_of(x)))
        return self.op("ConstantOfShape", self.shape_of(x), value=zero)

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
        axes = _static_broadcast_axes(x_dims, out_dims)
        if axes is not None:
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


def _static_broadcast_axes(x_dims: list | None, out_dims: list | None) -> list[int] | None:
    """Axes of ``out`` that broadcasting added to x, or None when the shapes cannot tell."""
    if x_dims is None or out_dims is None or len(x_dims) > len(out_dims):
        return None
    lead = len(out_dims) - len(x_dims)
    axes = list(range(lead))
    for i, d in enumerate(x_dims):
        o = out_dims[lead + i]
        if same_dim(d, o):
            continue
        if d == 1:
            axes.append(lead + i)  # reducing a size-1 axis is harmless if o turns out to be 1
        else:
            return None
    return axes


def _attribute(name: str, value: Any) -> ir.Attr:
    """An ir.Attr for the value types rules use, without onnx-ir's general (slower) type inference."""
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


def numpy_dtype_of(x: ir.Value) -> np.dtype:
    """x's element type; a model error naming x and its producer when no one could tell it."""
    if x.dtype is None:
        producer = x.producer()
        made_by = f" (output of {producer.op_type} node {producer.name!r})" if producer is not None else ""
        raise ModelError(f"the element type of {x.name!r}{made_by} is unknown: ONNX shape inference could not "
                         "tell it; declare it in the model's value_info")
    return np.dtype(x.dtype.numpy())


def _all_names(graph: ir.Graph) -> set[str]:
    names = {v.name for v in graph.inputs} | {v.name for v in graph.outputs} | set(graph.initializers)
    for node in graph:
        if node.name:
            names.add(node.name)
        names.update(v.name for v in node.outputs if v.name)
    return names


class GradContext:
    """What a gradient rule sees: the forward node, output gradients, and the builder.

    ``g.x(i)`` is forward input i, ``g.y(i)`` forward output i, ``g.dy(i)`` the gradient of output
    i (None when that output gets none), ``g.needs(i)`` whether input i wants a gradient.
    All ``Builder`` methods are available directly (``g.op``, ``g.const_like``, ``g.reduce_sum``...).
    """

    def __init__(self, builder: Builder, node: ir.Node, output_grads: list[ir.Value | None], wanted: list[bool]):
        self.b = builder
        self.node = node
        self.output_grads = output_grads
        self.wanted = wanted

    def __getattr__(self, name: str):
        return getattr(self.b, name)

    @property
    def opset(self) -> int:
        return self.b.opset

    def x(self, i: int) -> ir.Value | None:
        return self.node.inputs[i] if i < len(self.node.inputs) else None

    def y(self, i: int = 0) -> ir.Value:
        return self.node.outputs[i]

    def dy(self, i: int = 0) -> ir.Value | None:
        return self.output_grads[i] if i < len(self.output_grads) else None

    def needs(self, i: int) -> bool:
        return i < len(self.wanted) and self.wanted[i]

    def attr(self, name: str, default: Any = None) -> Any:
        attr = self.node.attributes.get(name)
        if attr is None:
            return default
        value = attr.value
        if isinstance(value, tuple):
            return list(value)
        return value

    def input_const(self, i: int):
        """Forward input i as a numpy array when it is constant (initializer or Constant), else None."""
        value = self.x(i)
        if value is None:
            return None
        if value.const_value is not None:
            return value.const_value.numpy()
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and not producer.domain:
            attr = producer.attributes.get("value")
            if attr is not None:
                return attr.value.numpy()
            for key in ("value_int", "value_ints", "value_float", "value_floats"):
                if key in producer.attributes:
                    return np.asarray(producer.attributes[key].value)
        return None

    def rank(self, value: ir.Value) -> int | None:
        dims = dims_of(value)
        return None if dims is None else len(dims)

    def set_type_like(self, value: ir.Value, like: ir.Value) -> ir.Value:
        """Give an emitted value (e.g. a com.microsoft output) like's type and shape."""
        value.type = like.type
        value.shape = like.shape
        return value
