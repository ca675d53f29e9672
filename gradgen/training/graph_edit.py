"""Small graph edits the training passes share: parameters as inputs, gradient outputs, pruning."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import ModelError
from gradgen.names import value_names


class ParamsAsInputsPass(ir.passes.InPlacePass):
    """Turn the named initializers into graph inputs (same name, type and shape).

    Their values are kept in ``initial_values`` (name -> numpy array): a training graph takes the
    parameters as inputs and returns the updated ones, and its caller owns their values.
    """

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = list(names)
        self.initial_values: dict[str, np.ndarray] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        inputs = {v.name for v in graph.inputs}
        for name in self.names:
            value = graph.initializers.get(name)
            if value is None or value.const_value is None:
                raise ModelError(f"parameter {name!r} is not an initializer with a value")
            self.initial_values[name] = np.array(value.const_value.numpy())  # an owned copy
            if value.shape is None:
                value.shape = ir.Shape(value.const_value.shape.numpy())
            if value.type is None:
                value.type = ir.TensorType(value.const_value.dtype)
            graph.initializers.pop(name)
            value.const_value = None
            if name not in inputs:
                graph.inputs.append(value)
        return ir.passes.PassResult(model, modified=bool(self.names))


def gradient_outputs(graph: ir.Graph, params: list[str]) -> dict[str, ir.Value]:
    """The ``<p>_grad`` outputs GradientPass added, by parameter name."""
    outputs = {v.name: v for v in graph.outputs}
    missing = [p for p in params if f"{p}_grad" not in outputs]
    if missing:
        raise ModelError(
            f"the model has no gradient output for {', '.join(map(repr, missing))} "
            "(expected <name>_grad outputs, as build-backward writes them)"
        )
    return {p: outputs[f"{p}_grad"] for p in params}


def keep_outputs(graph: ir.Graph, keep: list[ir.Value]) -> None:
    """Make ``keep`` the graph's outputs, in that order."""
    graph.outputs.clear()
    graph.outputs.extend(keep)


def new_input(builder: GraphBuilder, name: str, like: ir.Value) -> ir.Value:
    """A new graph input with ``like``'s type and shape, under a free name close to ``name``."""
    value = ir.Value(name=builder.unique(name), type=like.type, shape=like.shape)
    builder.graph.inputs.append(value)
    return value


def scalar_input(builder: GraphBuilder, name: str, dtype: ir.DataType) -> ir.Value:
    value = ir.Value(name=builder.unique(name), type=ir.TensorType(dtype), shape=ir.Shape([]))
    builder.graph.inputs.append(value)
    return value


def as_output(builder: GraphBuilder, value: ir.Value, name: str, like: ir.Value | None = None) -> ir.Value:
    """Name ``value`` (an emitted node output) ``name`` or a free variant, type it, and make it an output.

    A value that is already a graph input or output goes through an Identity, so that every
    output is a distinct value with its own name.
    """
    if value.is_graph_input() or value.is_graph_output() or value.producer() not in builder.node_set:
        value = builder.op("Identity", value)
    builder.rename(value, name)
    if like is not None:
        value.type, value.shape = like.type, like.shape
    builder.graph.outputs.append(value)
    return value


def to_inference_mode(graph: ir.Graph, batch_norms: AbstractSet[ir.Node] | None = None) -> None:
    """Dropout without its training_mode input, and training-mode BatchNormalization (all of them, or
    those in ``batch_norms``) in inference mode: what an evaluation runs, as PyTorch's ``eval()``."""
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Dropout" and len(node.inputs) > 2:
            node.replace_input_with(2, None)  # training_mode absent: inference
        elif node.op_type == "BatchNormalization" and "training_mode" in node.attributes:
            if batch_norms is None or node in batch_norms:
                batch_norm_in_inference_mode(node)


def batch_norm_in_inference_mode(node: ir.Node) -> None:
    """training_mode 0, and the running-statistics outputs dropped: ONNX allows them in training mode
    only (ONNX Runtime refuses the model otherwise). Outputs the model still reads keep the node in
    training mode."""
    extra = node.outputs[1:]
    if any(v.uses() or v.is_graph_output() for v in extra):
        return
    node.resize_outputs(1)
    node.attributes["training_mode"] = ir.AttrInt64("training_mode", 0)


def remove_unused_inputs(graph: ir.Graph, keep: AbstractSet[str] = frozenset()) -> list[str]:
    """Drop graph inputs nothing reads (a target only the removed loss used, say); return their names."""
    unused = [v for v in graph.inputs if not v.uses() and not v.is_graph_output() and v.name not in keep]
    for value in unused:
        graph.inputs.remove(value)
    return value_names(unused)
