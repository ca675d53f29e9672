"""EvaluateConstantsPass: fold what a model computes from constants (see gradgen/evaluate.py)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError
from gradgen.evaluate import STANDARD_DOMAINS, ConstantEvaluator, direct_constant, foldable_op, shape_constant
from gradgen.model_io import default_opset
from gradgen.passes.rewrite import NodeRemoval

__all__ = ["EvaluateConstantsPass", "fold_graph", "inline_constant_ifs"]


class EvaluateConstantsPass(ir.passes.InPlacePass):
    """Fold what a model computes from constants, inline constant Ifs, to a fixed point (in place).

    Folded integer and bool values become initializers with the names of the values they replace;
    folded float values become one Constant node each (an initializer would read as a parameter). Shape inference
    (``ShapeInferencePass``) runs after each round that changed something, unless
    ``shape_inference=False``.
    """

    def __init__(self, shape_inference: bool = True, max_rounds: int = 8):
        super().__init__()
        self.shape_inference = shape_inference
        self.max_rounds = max_rounds

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from gradgen.passes.standard import ShapeInferencePass

        opset = default_opset(model, 1)
        modified = False
        for round_ in range(self.max_rounds):
            changed = fold_graph(model.graph, ConstantEvaluator(opset, parameters=False))
            inlined = inline_constant_ifs(model.graph)
            changed = changed or inlined
            modified = modified or changed
            if self.shape_inference and (changed or round_ == 0):
                # the first inference also checks the model's own declarations against its nodes
                ShapeInferencePass(check_declared=round_ == 0)(model)
            if (not changed and round_ > 0) or not (inlined or _has_shape_reads(model.graph)):
                break
        return ir.passes.PassResult(model, modified=modified)


def _has_shape_reads(graph: ir.Graph) -> bool:
    """Whether another round could fold more: one sweep folds every chain of constants of a graph in
    topological order (ONNX's order), so only a Shape or Size whose input shape inference has since
    made static (or the nodes of an inlined If) can start a new one."""
    return any(node.op_type in ("Shape", "Size") and node.domain in STANDARD_DOMAINS for node in graph)


def fold_graph(graph: ir.Graph, evaluator: ConstantEvaluator) -> bool:
    """Replace every foldable node of ``graph`` (top level) by constants; True if any was.

    One sweep in topological order computes each foldable node from the values before it and keeps
    the results in memory; only the results a remaining node (or a subgraph) reads become
    initializers or Constant nodes. An exported transformer's shape chains (Constant -> Unsqueeze
    -> Concat -> Reshape) fold a few thousand nodes into one initializer per Reshape."""
    outputs = {v.name for v in graph.outputs}
    known: dict[ir.Value, np.ndarray] = {}
    folded: list[ir.Node] = []
    for node in graph:
        if not foldable_op(node) or any(o.name in outputs for o in node.outputs):
            continue
        if node.op_type == "Constant" and _is_float(node.outputs[0]):
            continue  # already what a folded float becomes
        results = _fold(node, evaluator, known)
        if results is None:
            continue
        known.update(zip(node.outputs, results))
        folded.append(node)
    if not folded:
        return False
    removal = NodeRemoval()
    for node in folded:
        removal.remove(node)  # first: a read by a folded node is not a read that needs the value
    for node in folded:
        for value in node.outputs:
            if value.uses():
                _materialize(graph, node, value, known[value])
    removal.flush()
    return True


def _fold(node: ir.Node, evaluator: ConstantEvaluator, known: dict[ir.Value, np.ndarray]) -> list[np.ndarray] | None:
    """``node``'s outputs computed from constants and the values folded before it, or None."""
    if node.op_type in ("Shape", "Size") and node.inputs and node.inputs[0] in known:
        return [shape_constant(node, list(known[node.inputs[0]].shape))]
    if node.op_type in ("Shape", "Size", "Constant"):
        direct = direct_constant(node.outputs[0], evaluator.max_elements)
        return None if direct is None else [direct]
    args = _constant_args(node, evaluator.max_elements, known)
    return None if args is None else evaluator.run(node, args)


def _materialize(graph: ir.Graph, node: ir.Node, value: ir.Value, array: np.ndarray) -> None:
    if array.dtype.kind in "iub":
        _replace_with_initializer(graph, value, array)
    else:
        _replace_with_constant_node(graph, node, value, array)


def _constant_args(node: ir.Node, max_elements: int, known: dict[ir.Value, np.ndarray]) -> list[np.ndarray | None] | None:
    """The node's inputs as arrays (None for an omitted input), or None at the first input that is
    neither a constant nor folded (most nodes: the inputs after it are not read)."""
    args: list[np.ndarray | None] = []
    for value in node.inputs:
        if value is None:
            args.append(None)
            continue
        array = known.get(value)
        if array is None:
            array = direct_constant(value, max_elements)
        if array is None:
            return None
        args.append(array)
    return args


def _replace_with_initializer(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    # the value takes the tensor's (frozen) shape and element type: built once, not twice (one
    # initializer per folded value, thousands in an exported transformer)
    tensor = ir.Tensor(array, name=value.name)
    constant = ir.Value(name=value.name, shape=tensor.shape, type=ir.TensorType(tensor.dtype), const_value=tensor)
    value.replace_all_uses_with(constant)
    value.name = None
    graph.register_initializer(constant)


def _is_float(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_floating_point()


def _replace_with_constant_node(graph: ir.Graph, node: ir.Node, value: ir.Value, array: np.ndarray) -> None:
    name, was_output = value.name, value.is_graph_output()
    # the constructors themselves: ir.node / ir.tensor test their arguments against runtime
    # protocols, which cost more than the fold (one such node per folded float value)
    tensor = ir.Tensor(np.asarray(array), name=name)
    constant = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], name=f"{node.name or node.op_type}/folded")
    out = constant.outputs[0]
    graph.insert_before(node, constant)
    value.replace_all_uses_with(out, replace_graph_outputs=was_output)
    value.name = None
    out.name = name
    out.type = ir.TensorType(ir.DataType.from_numpy(array.dtype))
    out.shape = ir.Shape(array.shape)


def inline_constant_ifs(graph: ir.Graph) -> bool:
    """Replace every If whose condition is a constant by the nodes of the branch it takes.

    Exporters emit such Ifs for shape-dependent Python logic (PyTorch's legacy exporter does for
    torch.diagonal); once shapes are folded the condition is known and the branch's nodes can be
    differentiated like any others.
    """
    modified = False
    for node in list(graph):
        if node.op_type != "If" or node.domain not in STANDARD_DOMAINS:
            continue
        condition = node.inputs[0]
        known = None if condition is None else direct_constant(condition)
        if known is None:
            continue
        if np.size(known) != 1:
            shape = list(np.shape(known))
            raise ModelError(f"If node {node.name!r}: its condition must hold exactly one element; it has shape {shape}")
        taken = bool(np.asarray(known).reshape(-1)[0])
        _inline_branch(graph, node, node.attributes["then_branch" if taken else "else_branch"].value)
        modified = True
    return modified


def _inline_branch(graph: ir.Graph, node: ir.Node, branch: ir.Graph) -> None:
    taken_names = {v.name for v in graph.inputs} | set(graph.initializers) | {o.name for n in graph for o in n.outputs if o.name}
    # the branch lets go of its outputs first: onnx-ir ties a graph's outputs to it, and these values
    # (its nodes' outputs, or its initializers) move into the main graph
    branch_outputs = list(branch.outputs)
    branch.outputs.clear()
    for name in list(branch.initializers):
        value = branch.initializers.pop(name)
        while value.name in taken_names:
            value.name = f"{value.name}_{node.name or 'If'}"  # type: ignore[assignment]
        taken_names.add(value.name)
        graph.register_initializer(value)
    inner_nodes = list(branch)
    branch.remove(inner_nodes)
    graph.insert_before(node, inner_nodes)
    renames = []
    for out, branch_out in zip(node.outputs, branch_outputs):
        if branch_out.type is None:
            branch_out.type = out.type
        if branch_out.producer() is not None:
            # computed by the branch's nodes: shape inference gives its shape from them. An exporter's
            # declared shape is not trusted (PyTorch's legacy exporter declares one branch's shape
            # on both: a flattened [15] for a [3, 5] tensor)
            branch_out.shape = None
        if out.is_graph_output():  # keep the graph output's name: route it through an Identity
            identity = ir.node("Identity", [branch_out])
            graph.insert_before(node, identity)
            out.replace_all_uses_with(identity.outputs[0], replace_graph_outputs=True)
            renames.append((identity.outputs[0], out.name, out))
        else:
            out.replace_all_uses_with(branch_out)
    graph.remove(node, safe=True)
    for value, out_name, old in renames:
        old.name = None
        value.name = out_name
        value.type, value.shape = old.type, old.shape
