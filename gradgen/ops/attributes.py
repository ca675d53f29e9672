"""Attributes of onnx-ir nodes as plain Python values.

One conversion for every layer: the executor passes these values to kernels as keyword
arguments, the build-time evaluator does the same, and rules and lowerings read single
attributes with ``get_attr``.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir


def attribute_value(attr: ir.Attr) -> Any:
    """An ir attribute as a plain Python/numpy value (tensors become numpy arrays, tuples lists)."""
    value = attr.value
    if attr.type == ir.AttributeType.TENSOR:
        return value.numpy()
    if attr.type == ir.AttributeType.TENSORS:
        return [t.numpy() for t in value]
    if isinstance(value, tuple):
        return list(value)
    return value


def node_attributes(node: ir.Node) -> dict[str, Any]:
    """Every attribute of ``node`` as a plain value (the keyword arguments of its kernel)."""
    return {name: attribute_value(attr) for name, attr in node.attributes.items()}


def get_attr(node: ir.Node, name: str, default: Any = None) -> Any:
    """One attribute as a plain value (strings decoded from bytes), or ``default`` when absent."""
    attr = node.attributes.get(name)
    if attr is None:
        return default
    value = attribute_value(attr)
    return value.decode() if isinstance(value, bytes) else value


def text(value: Any, default: str) -> str:
    """A string attribute that may arrive as bytes or be absent (None)."""
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)
