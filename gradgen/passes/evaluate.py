"""Build-time evaluation: the values a graph computes from constants, by gradgen's own CPU kernels.

Exporters compute axes, pads, shapes and Resize scales at run time from constants
(``Constant -> Shape -> Gather -> Sub -> ... -> Cast``; the legacy exporter's bilinear Resize
builds its float scales from a Constant chain). The gradient rules need those values as
constants, and ONNX shape inference cannot see through most of them. One evaluator serves both:

- ``ConstantEvaluator.value(v)``: v's content when it is computed from constants only (memoised,
  a bounded number of nodes), for a rule reading an input on demand;
- ``EvaluateConstantsPass``: folds every such node of a model into an initializer, inlines an If
  whose condition became constant, and runs shape inference between rounds (a folded shape makes
  more Shape nodes static) until nothing changes.

What is never folded: nodes with subgraphs or random outputs, graph outputs, results larger than
``MAX_ELEMENTS`` (large tensors are never read, folded or copied: only initializers up to that size
feed a fold), and float results computed from a float initializer: such initializers are the
model's parameters, and folding ``Transpose(W)`` would take W out of the graph and its gradient
with it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.ops.attributes import node_attributes

MAX_ELEMENTS = 4096
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                        "Multinomial"})
STANDARD_DOMAINS = ("", "ai.onnx")


def direct_constant(value: ir.Value, max_elements: int | None = MAX_ELEMENTS) -> np.ndarray | None:
    """A value's content without running anything: an initializer (at most ``max_elements``
    elements unless None), a Constant node's value, or Shape / Size of a tensor whose shape is
    static."""
    if value.const_value is not None:
        if max_elements is not None and value.const_value.size > max_elements:
            return None
        return value.const_value.numpy()
    node = value.producer()
    if node is None or node.domain not in STANDARD_DOMAINS:
        return None
    if node.op_type == "Constant":
        attrs = node_attributes(node)
        for key in ("value", "value_int", "value_ints", "value_float", "value_floats"):
            if key in attrs:
                return _constant_attribute(key, attrs[key])
        return None
    if node.op_type in ("Shape", "Size") and node.inputs and node.inputs[0] is not None:
        dims = node.inputs[0].shape
        if dims is None or not all(isinstance(d, int) for d in dims):
            return None
        dims = [int(d) for d in dims]
        if node.op_type == "Size":
            return np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
        attrs = node_attributes(node)
        return _shape_slice(dims, attrs.get("start", 0), attrs.get("end"))
    return None


def _constant_attribute(key: str, value) -> np.ndarray:
    if key == "value":
        return np.asarray(value)
    return np.asarray(value, dtype=np.int64 if key.startswith("value_int") else np.float32)


def _shape_slice(dims: list[int], start: int, end: int | None) -> np.ndarray:
    rank = len(dims)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else min(max(end + rank if end < 0 else end, 0), rank)
    return np.array(dims[start:end], dtype=np.int64)


def _is_float_parameter(value: ir.Value) -> bool:
    """A float initializer: a model parameter (float results computed from it are not folded)."""
    return (value.const_value is not None and value.producer() is None
            and np.dtype(value.const_value.dtype.numpy()).kind == "f")


def _foldable_op(node: ir.Node) -> bool:
    return (node.domain in STANDARD_DOMAINS and node.op_type not in RANDOM_OPS
            and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()))


class ConstantEvaluator:
    """Runs gradgen's CPU kernels on constant inputs.

    ``opset`` is the default-domain opset (passed to kernels whose meaning depends on it). With
    ``parameters=False`` a float result computed from a float initializer is not a constant (the
    pass's rule); a rule reading a value for its own use may take them (``parameters=True``).
    """

    def __init__(self, opset: int, *, parameters: bool = True, max_elements: int = MAX_ELEMENTS):
        self.opset = opset
        self.parameters = parameters
        self.max_elements = max_elements
        self._memo: dict[int, list[np.ndarray] | None] = {}

    def value(self, value: ir.Value | None, max_nodes: int = 64) -> np.ndarray | None:
        """``value``'s content when it is computed from constants by at most ``max_nodes`` nodes."""
        if value is None:
            return None
        budget = [max_nodes]
        try:
            return self._value(value, budget)
        except RecursionError:
            return None

    def _value(self, value: ir.Value, budget: list[int]) -> np.ndarray | None:
        direct = direct_constant(value, self.max_elements)
        if direct is not None:
            return direct
        node = value.producer()
        if node is None or not _foldable_op(node):
            return None
        if id(node) not in self._memo:
            budget[0] -= 1
            if budget[0] < 0:
                return None
            args = []
            for inp in node.inputs:
                arg = None if inp is None else self._value(inp, budget)
                if inp is not None and arg is None:
                    return None
                args.append(arg)
            self._memo[id(node)] = self.run(node, args)
        results = self._memo[id(node)]
        return None if results is None else results[list(node.outputs).index(value)]

    def run(self, node: ir.Node, args: list) -> list[np.ndarray] | None:
        """The node's outputs computed by its CPU kernel from ``args``, or None when it has no
        kernel, refuses the inputs (the run-time error will name the node), or makes a large or
        forbidden result."""
        from gradgen.kernels import registry

        entry = registry.lookup(node.domain, node.op_type)
        if entry is None or entry.cpu is None:
            return None
        attrs = node_attributes(node)
        if entry.wants_num_outputs:
            attrs["_num_outputs"] = len(node.outputs)
        if entry.wants_opset:
            attrs["_opset"] = self.opset
        try:
            result = entry.cpu(*args, **attrs)
        except Exception:  # noqa: BLE001 - a kernel refusing the inputs means "not foldable here"
            return None
        results = [np.asarray(r) for r in (result if isinstance(result, (tuple, list)) else (result,))]
        if len(results) < len([o for o in node.outputs if o.name]):
            return None
        results = results[: len(node.outputs)]
        if any(r.size > self.max_elements for r in results):
            return None
        if not self.parameters and any(r.dtype.kind in "fc" for r in results) and any(
                v is not None and _is_float_parameter(v) for v in node.inputs):
            return None
        return results


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

        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 1))
        modified = False
        for round_ in range(self.max_rounds):
            changed = fold_graph(model.graph, ConstantEvaluator(opset, parameters=False))
            changed = inline_constant_ifs(model.graph) or changed
            modified = modified or changed
            if self.shape_inference and (changed or round_ == 0):
                ShapeInferencePass()(model)
            if not changed and round_ > 0:
                break
        return ir.passes.PassResult(model, modified=modified)


def fold_graph(graph: ir.Graph, evaluator: ConstantEvaluator) -> bool:
    """Replace every foldable node of ``graph`` (top level) by initializers; True if any was."""
    outputs = {v.name for v in graph.outputs}
    modified = False
    for node in list(graph):
        if not _foldable_op(node) or any(o.name in outputs for o in node.outputs):
            continue
        if node.op_type == "Constant" and _is_float(node.outputs[0]):
            continue  # already what a folded float becomes
        if node.op_type in ("Shape", "Size", "Constant"):
            results = [direct_constant(node.outputs[0], evaluator.max_elements)]
            if results[0] is None:
                continue
        else:
            args = [None if v is None else direct_constant(v, evaluator.max_elements) for v in node.inputs]
            if any(v is not None and a is None for v, a in zip(node.inputs, args)):
                continue
            results = evaluator.run(node, args)
            if results is None:
                continue
        for value, result in zip(node.outputs, results):
            if result.dtype.kind in "iub":
                _replace_with_initializer(graph, value, result)
            else:
                _replace_with_constant_node(graph, node, value, result)
        graph.remove(node, safe=True)
        modified = True
    return modified


def _replace_with_initializer(graph: ir.Graph, value: ir.Value, array: np.ndarray) -> None:
    constant = ir.Value(name=value.name, shape=ir.Shape(array.shape),
                        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
                        const_value=ir.Tensor(array, name=value.name))
    value.replace_all_uses_with(constant)
    value.name = None
    graph.register_initializer(constant)


def _is_float(value: ir.Value) -> bool:
    return value.dtype is not None and value.dtype.is_floating_point()


def _replace_with_constant_node(graph: ir.Graph, node: ir.Node, value: ir.Value, array: np.ndarray) -> None:
    name, was_output = value.name, value.is_graph_output()
    constant = ir.node("Constant", [], {"value": ir.tensor(array, name=name)}, name=f"{node.name or node.op_type}/folded")
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
        taken = bool(np.asarray(known).reshape(-1)[0])
        _inline_branch(graph, node, node.attributes["then_branch" if taken else "else_branch"].value)
        modified = True
    return modified


def _inline_branch(graph: ir.Graph, node: ir.Node, branch: ir.Graph) -> None:
    taken_names = {v.name for v in graph.inputs} | set(graph.initializers) | {
        o.name for n in graph for o in n.outputs if o.name}
    for name in list(branch.initializers):
        value = branch.initializers.pop(name)
        while value.name in taken_names:
            value.name = f"{value.name}_{node.name or 'If'}"
        taken_names.add(value.name)
        graph.register_initializer(value)
    inner_nodes = list(branch)
    branch.remove(inner_nodes)
    graph.insert_before(node, inner_nodes)
    renames = []
    for out, branch_out in zip(node.outputs, list(branch.outputs)):
        if branch_out.type is None:
            branch_out.type = out.type
        if out.is_graph_output():  # keep the graph output's name: route it through an Identity
            identity = ir.node("Identity", [branch_out])
            graph.insert_before(node, identity)
            out.replace_all_uses_with(identity.outputs[0], replace_graph_outputs=True)
            renames.append((identity.outputs[0], out.name, out))
        else:
            out.replace_all_uses_with(branch_out)
    graph.remove(node, safe=True)
    for value, name, old in renames:
        old.name = None
        value.name = name
        value.type, value.shape = old.type, old.shape
