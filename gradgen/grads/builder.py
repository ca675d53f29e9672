"""What a gradient rule sees: ``GradContext``, the forward node and its output gradients, with the
graph builder's helpers (``gradgen.builder.GraphBuilder``) available directly on it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of


class GradContext:
    """What a gradient rule sees: the forward node, output gradients, and the builder.

    ``g.x(i)`` is forward input i, ``g.y(i)`` forward output i, ``g.dy(i)`` the gradient of output
    i (None when that output gets none), ``g.needs(i)`` whether input i wants a gradient.
    All ``GraphBuilder`` methods are available directly (``g.op``, ``g.const_like``, ``g.reduce_sum``...).

    A node with subgraphs (If, Loop, Scan) also sees ``g.captured``, the outer-scope values its
    subgraphs read, and ``g.needs_captured(k)``; its rule returns their gradients after the inputs'
    (a list of ``len(node.inputs) + len(g.captured)`` entries).
    """

    def __init__(
        self,
        builder: GraphBuilder,
        node: ir.Node,
        output_grads: list[ir.Value | None],
        wanted: list[bool],
        captured: list[ir.Value] | None = None,
        captured_wanted: list[bool] | None = None,
    ):
        self.b = builder
        self.node = node
        self.output_grads = output_grads
        self.wanted = wanted
        self.captured = captured or []
        self.captured_wanted = captured_wanted or []

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

    def needs_captured(self, k: int) -> bool:
        return k < len(self.captured_wanted) and self.captured_wanted[k]

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
