"""What gradgen reads from control-flow nodes (If, Loop, Scan): their subgraphs, the outer-scope
values those read, and whether the number of iterations is known when the model is built.

One home for the executor (which feeds a subgraph the outer values it reads), the pass that
unrolls loops of a static length (passes/control_flow.py) and the gradient rules that refuse
the others with the reason.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.ops.attributes import get_attr

CONTROL_FLOW_OPS = ("If", "Loop", "Scan")

__all__ = [
    "CONTROL_FLOW_OPS",
    "constant_of",
    "graph_outer_values",
    "loop_trip_count",
    "outer_scope_values",
    "scan_length",
    "subgraphs",
]


def subgraphs(node: ir.Node) -> list[ir.Graph]:
    """The graphs held by the node's attributes (then/else branches, a loop's body)."""
    found: list[ir.Graph] = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            found.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            found.extend(attr.value)
    return found


def outer_scope_values(node: ir.Node) -> list[ir.Value]:
    """The values of enclosing graphs that the node's subgraphs (and theirs, recursively) read, in
    order of first use, each name once (see ``graph_outer_values``)."""
    found: dict[ir.Value, None] = {}
    for graph in subgraphs(node):
        _collect_outer(graph, set(), found)
    by_name: dict[str | None, ir.Value] = {}
    for value in found:
        by_name.setdefault(value.name, value)
    return list(by_name.values())


def graph_outer_values(graph: ir.Graph) -> list[ir.Value]:
    """The values of enclosing graphs that ``graph`` (and its subgraphs) read. A name may come as
    two values: onnx-ir reads a subgraph output that names an outer value as a value of its own,
    apart from the outer value its nodes read (a copy of the graph maps both to one input)."""
    found: dict[ir.Value, None] = {}
    _collect_outer(graph, set(), found)
    return list(found)


def _collect_outer(graph: ir.Graph, enclosing_defined: set[ir.Value], found: dict[ir.Value, None]) -> None:
    defined = set(enclosing_defined) | set(graph.inputs) | set(graph.initializers.values())
    for inner in graph:
        for value in inner.inputs:
            if value is not None and value not in defined:
                found.setdefault(value, None)
        for sub in subgraphs(inner):
            _collect_outer(sub, defined, found)
        defined.update(inner.outputs)
    for value in graph.outputs:
        if value not in defined:
            found.setdefault(value, None)


def constant_of(value: ir.Value | None) -> np.ndarray | None:
    """The value's content when the model fixes it (an initializer that is no graph input, or a
    Constant node's output), else None."""
    if value is None:
        return None
    if value.const_value is not None and not value.is_graph_input():
        return value.const_value.numpy()
    producer = value.producer()
    if producer is not None and producer.op_type == "Constant" and producer.domain in ("", "ai.onnx"):
        attr = producer.attributes.get("value")
        return None if attr is None else attr.value.numpy()
    return None


def _passes_condition_through(body: ir.Graph) -> bool:
    """Whether the body's condition output is its condition input (directly or through Identity)
    or a constant true: then the loop never stops early."""
    cond_in, cond_out = body.inputs[1], body.outputs[0]
    while cond_out is not cond_in:
        known = constant_of(cond_out)
        if known is not None:
            return bool(np.asarray(known).reshape(-1)[0])
        producer = cond_out.producer()
        if producer is None or producer.op_type != "Identity" or producer.graph is not body or producer.inputs[0] is None:
            return False
        cond_out = producer.inputs[0]
    return True


def loop_trip_count(node: ir.Node) -> int | str:
    """A Loop's number of iterations when the model fixes it, else why it does not (a phrase)."""
    m = node.inputs[0] if node.inputs else None
    cond = node.inputs[1] if len(node.inputs) > 1 else None
    if m is None or not m.name:
        return "it has no trip count M (a while loop)"
    count = constant_of(m)
    if count is None:
        return f"its trip count M ({m.name!r}) is computed at run time"
    if np.size(count) != 1:
        return f"its trip count M ({m.name!r}) has {np.size(count)} elements, where ONNX wants one"
    if cond is not None and cond.name:
        start = constant_of(cond)
        if start is None:
            return f"its initial condition ({cond.name!r}) is computed at run time"
        if np.size(start) != 1:
            return f"its initial condition ({cond.name!r}) has {np.size(start)} elements, where ONNX wants one"
        if not bool(np.asarray(start).reshape(-1)[0]):
            return 0
    body = get_attr(node, "body")
    if not _passes_condition_through(body):
        return "its body computes the condition to go on at run time (it may stop early)"
    return int(np.asarray(count).reshape(-1)[0])


def scan_length(node: ir.Node) -> int | str:
    """A Scan's number of iterations (its scan inputs' length) when static, else why not."""
    body = get_attr(node, "body")
    num_scan = int(get_attr(node, "num_scan_inputs"))
    states = len(body.inputs) - num_scan
    axes = get_attr(node, "scan_input_axes") or [0] * num_scan
    for k in range(num_scan):
        x = node.inputs[states + k]
        if x is None or x.shape is None:
            return f"the shape of its scan input {k} is not known"
        axis = axes[k] + x.shape.rank() if axes[k] < 0 else axes[k]
        length = x.shape[axis]
        if isinstance(length, int):
            return length
        return f"its sequence length (dimension {axes[k]} of {x.name!r}, {length}) is not static"
    return "it has no scan inputs"
