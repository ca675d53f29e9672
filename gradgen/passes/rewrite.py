"""Replacing nodes of the main graph by standard-op forms: the one scaffold of the passes that
rewrite ops before the gradient pass (UnrollRecurrentPass, DecomposePass), so that the rules of
the ops they emit differentiate them and both executors run them with the kernels they have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, graph_names
from gradgen.model_io import default_opset

STANDARD_DOMAINS = ("", "ai.onnx")

# build(node, builder) -> the values that replace the node's outputs, in order (None: an output
# the form leaves unbuilt; it must have no use)
BuildForm = Callable[[ir.Node, GraphBuilder], Sequence[ir.Value | None]]


def rewrite_nodes(model: ir.Model, nodes: Sequence[ir.Node], build: BuildForm) -> bool:
    """Replace each of ``nodes`` (of the main graph) by the form ``build`` emits with a GraphBuilder
    of its own; the builders share one name set and one constant cache, so no two new names
    collide and equal constants are made once. Shape inference runs after. False when ``nodes``
    is empty (nothing changed)."""
    from gradgen.passes.standard import ShapeInferencePass

    if not nodes:
        return False
    graph = model.graph
    opset = default_opset(model, 14)
    names = graph_names(graph)
    constants: dict = {}
    for node in nodes:
        builder = GraphBuilder(graph, opset, names=names, constants=constants, prefix=node.name or node.op_type, append=False)
        outputs = build(node, builder)
        graph.insert_before(node, builder.nodes)
        replace_node_outputs(graph, node, outputs)
    ShapeInferencePass()(model)
    return True


def replace_node_outputs(graph: ir.Graph, node: ir.Node, outputs: Sequence[ir.Value | None]) -> None:
    """Give ``outputs`` the node's output values' names, types and uses, then drop the node."""
    renames = []
    for old, new in zip(node.outputs, outputs):
        if new is None:
            continue
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        new.type, new.shape = old.type, old.shape
        renames.append((new, old.name))
        old.name = None
    graph.remove(node, safe=True)
    for new, name in renames:
        new.name = name


def replace_uses(old: ir.Value, new: ir.Value) -> None:
    """``old.replace_all_uses_with(new, replace_graph_outputs=True)``, with old's places among the
    graph outputs found by ``list.index``: onnx-ir walks every graph output in Python for each
    replaced output value (one per parameter after the gradient pass, so transpose fusion and
    the lowering spent most of their time there)."""
    index = 0
    while old.is_graph_output():  # (an output listed twice stays one until its last place goes)
        outputs = old.graph.outputs  # type: ignore[union-attr]  # a graph output has its graph
        index = outputs.index(old, index)
        outputs[index] = new
    old.replace_all_uses_with(new)


class NodeRemoval:
    """Nodes a pass drops, taken out of their graphs together by ``flush``.

    onnx-ir's ``Graph.remove`` copies the graph's outputs on every call: after the gradient pass
    (one output per parameter) removing nodes one at a time cost more than the rest of a pass.
    ``remove`` detaches the node from its inputs at once, as ``Graph.remove(safe=True)`` does
    (so uses read afterwards are the same), and keeps it until ``flush``; ``node in removal``
    tells a node already dropped.
    """

    def __init__(self) -> None:
        self._pending: dict[ir.Graph, list[ir.Node]] = {}
        self._nodes: set[ir.Node] = set()

    def remove(self, node: ir.Node) -> None:
        if node.graph is None or node in self._nodes:
            raise ValueError(f"node {node.name!r} is in no graph or already removed")
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)
        self._pending.setdefault(node.graph, []).append(node)  # type: ignore[arg-type]
        self._nodes.add(node)

    def __contains__(self, node: ir.Node) -> bool:
        return node in self._nodes

    def __bool__(self) -> bool:
        return bool(self._nodes)

    def flush(self) -> None:
        """Take the removed nodes out of their graphs, checked as ``Graph.remove(safe=True)`` checks
        (no output of theirs is a graph output or read by a node that stays)."""
        for node in self._nodes:
            for output in node.outputs:
                if output.is_graph_output() or any(user not in self._nodes for user, _ in output.uses()):
                    raise ValueError(f"node {node.name!r} cannot be removed: its output {output.name!r} is still used")
        for graph, nodes in self._pending.items():
            graph.remove(nodes)  # already detached from their inputs
        self._pending.clear()
        self._nodes.clear()


def float_constant(b: GraphBuilder, array: np.ndarray, cache: dict) -> ir.Value:
    """A float constant of a rewritten forward graph, as a Constant node: an initializer would read
    as a parameter (build_backward differentiates every float initializer the loss depends on).
    One node per value in ``cache``."""
    key = (array.dtype.str, array.shape, array.tobytes())
    if key not in cache:
        cache[key] = b.op("Constant", value=ir.tensor(array))
    return cache[key]
