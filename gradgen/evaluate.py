"""Build-time evaluation: the values a graph computes from constants, by gradgen's own CPU kernels.

The pass that folds them into a model is ``gradgen.passes.EvaluateConstantsPass``; this module is
the evaluator itself, which the gradient rules also use to read an input on demand.

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
from gradgen.ops.shape import shape_bounds

MAX_ELEMENTS = 4096
# ops that draw random numbers: never folded, never merged (two Dropouts of one input in training
# mode draw two masks; Dropout in inference mode is an Identity, which nothing loses by keeping)
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial", "Dropout"}
)
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
        shape = node.inputs[0].shape
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return shape_constant(node, [int(d) for d in shape])  # type: ignore[arg-type]  # ints, checked above
    return None


def shape_constant(node: ir.Node, dims: list[int]) -> np.ndarray:
    """What a Shape or Size ``node`` gives for an input of shape ``dims``."""
    if node.op_type == "Size":
        return np.array(int(np.prod(dims, dtype=np.int64)), dtype=np.int64)
    attrs = node_attributes(node)
    start, end = shape_bounds(len(dims), attrs.get("start", 0), attrs.get("end"))
    return np.array(dims[start:end], dtype=np.int64)


def _constant_attribute(key: str, value) -> np.ndarray:
    if key == "value":
        return np.asarray(value)
    return np.asarray(value, dtype=np.int64 if key.startswith("value_int") else np.float32)


def is_float_parameter(value: ir.Value) -> bool:
    """A float initializer: a model parameter (float results computed from it are not folded)."""
    return value.const_value is not None and value.producer() is None and np.dtype(value.const_value.dtype.numpy()).kind == "f"


def foldable_op(node: ir.Node) -> bool:
    return (
        node.domain in STANDARD_DOMAINS
        and node.op_type not in RANDOM_OPS
        and not any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
    )


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
        if node is None or not foldable_op(node):
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
            with np.errstate(all="ignore"):  # log(0) = -inf is ONNX's answer, as at run time: no note
                result = entry.cpu(*args, **attrs)
        except Exception:  # noqa: BLE001 - a kernel refusing the inputs means "not foldable here"
            return None
        results = [np.asarray(r) for r in (result if isinstance(result, (tuple, list)) else (result,))]
        if len(results) < len([o for o in node.outputs if o.name]):
            return None
        results = results[: len(node.outputs)]
        if any(r.size > self.max_elements for r in results):
            return None
        if (
            not self.parameters
            and any(r.dtype.kind in "fc" for r in results)
            and any(v is not None and is_float_parameter(v) for v in node.inputs)
        ):
            return None
        return results
