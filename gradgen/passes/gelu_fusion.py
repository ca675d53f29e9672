"""GeluFusionPass: an exported GELU formula becomes one com.microsoft Gelu / FastGelu node.

Exporters spell GELU out in elementwise ops: ``F.gelu(x, approximate="tanh")`` becomes about eight
nodes (``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``) and the exact one five
(``0.5 * x * (1 + erf(x / sqrt 2))``); their gradient, rule by rule, is some fifteen more, each a
pass over the MLP's widest tensor (GPT-2 small: 4 x 768 wide). ONNX Runtime's graph optimizer
fuses them into its Gelu / FastGelu (GeluFusion, FastGeluFusion); this pass does the same before
the gradient pass, whose rules then emit one GeluGrad / FastGeluGrad node (ONNX Runtime training's
contract) for the gradient. ``--portable`` lowers all four back to standard ops.

A formula is found from its Tanh or Erf node: the nodes before it back to the one non-constant
input x, then the chain of elementwise nodes after it, as long as they read only x, scalar
constants and the chain itself. Which chain is a GELU is decided by value, not by spelling: the
candidate is evaluated on sample points in float64 and must equal the GELU (tanh or erf) there, so
any order of operands, ``Pow(x, 3)`` or ``x * x * x``, ``Div`` by sqrt 2 or ``Mul`` by its inverse,
is recognised, and nothing else is. Every value inside the formula must be read only inside it
(a value also read elsewhere, or a graph output, keeps the formula as it is). Only float32 formulas
are fused (the type ONNX Runtime's CPU kernels of those ops take).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from gradgen.ops.elementwise import TANH_GELU_CUBIC, TANH_GELU_SCALE
from gradgen.ops.schemas import MICROSOFT_DOMAIN, MICROSOFT_OPSET
from gradgen.passes.rewrite import STANDARD_DOMAINS

__all__ = ["GeluFusionPass"]

_ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Neg"})
_MAX_NODES = 14  # a GELU formula has 5-10 nodes; a larger candidate is something else
_SAMPLES = np.concatenate([np.linspace(-8.0, 8.0, 161), [-0.37, 1e-3, 0.61, 2.9]])
_TOLERANCE = 1e-6  # float32 constants (0.044715, sqrt(2/pi)) move the formula by about 1e-8


def _gelu_reference(x: np.ndarray, tanh: bool) -> np.ndarray:
    if tanh:
        return 0.5 * x * (1.0 + np.tanh(TANH_GELU_SCALE * (x + TANH_GELU_CUBIC * x**3)))
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _constant(value: ir.Value) -> np.ndarray | None:
    """The value of a one-element Constant node's output, else None."""
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in STANDARD_DOMAINS:
        return None
    attr = node.attributes.get("value")
    if attr is None:
        return None
    array = attr.value.numpy()
    return array.astype(np.float64) if array.size == 1 else None


class _Formula:
    """A candidate GELU: its input ``x``, its nodes (in order) and the value they compute last."""

    def __init__(self, x: ir.Value, nodes: list[ir.Node]):
        self.x = x
        self.nodes = nodes

    @property
    def output(self) -> ir.Value:
        return self.nodes[-1].outputs[0]

    def evaluate(self, samples: np.ndarray) -> np.ndarray | None:
        """The formula's value at ``samples`` (float64), None where a node cannot be evaluated."""
        values: dict[int, np.ndarray] = {id(self.x): samples}

        def read(v: ir.Value) -> np.ndarray | None:
            if id(v) in values:
                return values[id(v)]
            return _constant(v)

        for node in self.nodes:
            args = [read(v) for v in node.inputs if v is not None]
            present = [a for a in args if a is not None]
            if len(present) != len(args):
                return None
            values[id(node.outputs[0])] = _apply(node.op_type, present)
        return values[id(self.output)]

    def is_private(self, graph: ir.Graph) -> bool:
        """Whether every value the formula makes, but its output, is read only inside it."""
        inside = {id(n) for n in self.nodes}
        outputs = {id(v) for v in graph.outputs}
        for node in self.nodes[:-1]:
            for value in node.outputs:
                if id(value) in outputs or any(id(user) not in inside for user, _ in value.uses()):
                    return False
        return True


def _apply(op_type: str, args: list[np.ndarray]) -> np.ndarray:
    with np.errstate(all="ignore"):
        if op_type == "Add":
            return args[0] + args[1]
        if op_type == "Sub":
            return args[0] - args[1]
        if op_type == "Mul":
            return args[0] * args[1]
        if op_type == "Div":
            return args[0] / args[1]
        if op_type == "Pow":
            return np.power(args[0], args[1])
        if op_type == "Sqrt":
            return np.sqrt(args[0])
        if op_type == "Neg":
            return -args[0]
        if op_type == "Tanh":
            return np.tanh(args[0])
        if op_type == "Erf":
            return np.vectorize(math.erf)(args[0])
    raise AssertionError(op_type)


def _is_elementwise(node: ir.Node, ops=_ARITHMETIC) -> bool:
    return node.domain in STANDARD_DOMAINS and node.op_type in ops and len(node.outputs) == 1


def _backward_closure(value: ir.Value, x: ir.Value, nodes: list[ir.Node]) -> bool:
    """Collect (in ``nodes``, in order) the arithmetic nodes computing ``value`` from ``x`` and
    constants; False where it reads anything else or grows too large."""
    if value is x or _constant(value) is not None:
        return True
    node = value.producer()
    if node is None or not _is_elementwise(node):
        return False
    if node in nodes:
        return True
    if not all(v is not None and _backward_closure(v, x, nodes) for v in node.inputs):
        return False
    nodes.append(node)
    return len(nodes) <= _MAX_NODES


def _candidate_inputs(value: ir.Value) -> list[ir.Value]:
    """The non-constant values ``value`` is computed from through arithmetic nodes, nearest first
    (at most _MAX_NODES nodes back): where the formula's input x may be."""
    found: list[ir.Value] = []
    queue, seen = [value], 0
    while queue and seen <= _MAX_NODES:
        v = queue.pop(0)
        if _constant(v) is not None or any(v is f for f in found):
            continue
        found.append(v)
        node = v.producer()
        if node is not None and _is_elementwise(node):
            seen += 1
            queue.extend(i for i in node.inputs if i is not None)
    return found


def _reads_only(value: ir.Value, x: ir.Value, nodes: list[ir.Node]) -> bool:
    """Whether ``value`` is computed from x and constants alone (its nodes added to ``nodes``)."""
    added = list(nodes)
    if not _backward_closure(value, x, added):
        return False
    nodes[:] = added
    return True


def _find(graph: ir.Graph, core: ir.Node) -> tuple[_Formula, bool] | None:
    """A formula through the Tanh / Erf node ``core`` that is a GELU, and whether it is the tanh
    one; None when there is none. Candidates for x are tried farthest first, and for each the
    longest chain after ``core`` that matches."""
    tanh = core.op_type == "Tanh"
    reference = _gelu_reference(_SAMPLES, tanh)
    argument = core.inputs[0]
    if argument is None:
        return None
    for x in reversed(_candidate_inputs(argument)):
        if x.dtype != ir.DataType.FLOAT:
            continue
        nodes: list[ir.Node] = []
        if not _backward_closure(argument, x, nodes):
            continue
        found = _longest_match(x, [*nodes, core], reference)
        if found is not None and found.is_private(graph):
            return found, tanh
    return None


def _longest_match(x: ir.Value, nodes: list[ir.Node], reference: np.ndarray) -> _Formula | None:
    """The longest chain of single-reader elementwise nodes after ``nodes`` (up to 4), reading only
    x, constants and the chain, whose formula equals ``reference`` at the sample points."""
    found = None
    current = nodes[-1].outputs[0]
    for _ in range(4):
        users = [user for user, _ in current.uses()]
        if len(users) != 1 or not _is_elementwise(users[0]) or len(nodes) >= _MAX_NODES:
            break
        step = users[0]
        extended = list(nodes)
        if not all(v is not None and (v is current or _reads_only(v, x, extended)) for v in step.inputs):
            break
        nodes = [*extended, step]
        current = step.outputs[0]
        formula = _Formula(x, nodes)
        values = formula.evaluate(_SAMPLES)
        if values is not None and np.all(np.abs(values - reference) <= _TOLERANCE * (1.0 + np.abs(reference))):
            found = formula
    return found


def _replace(graph: ir.Graph, formula: _Formula, tanh: bool) -> None:
    """One Gelu / FastGelu node in place of the formula; its output keeps the formula's value
    (name, type, shape, readers)."""
    last = formula.nodes[-1]
    fused = ir.Node(
        MICROSOFT_DOMAIN,
        "FastGelu" if tanh else "Gelu",
        [formula.x],
        num_outputs=1,
        name=f"{last.name or 'Gelu'}_fused",
    )
    graph.insert_before(last, fused)
    out, new = last.outputs[0], fused.outputs[0]
    ir.convenience.replace_all_uses_with(out, new, replace_graph_outputs=True)
    new.type, new.shape = out.type, out.shape
    name = out.name
    out.name = None
    for node in reversed(formula.nodes):
        graph.remove(node, safe=True)
    new.name = name


class GeluFusionPass(ir.passes.InPlacePass):
    """Replace every float32 GELU formula (tanh or erf) of the main graph by one com.microsoft
    FastGelu / Gelu node (in place)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for core in [n for n in graph if n.domain in STANDARD_DOMAINS and n.op_type in ("Tanh", "Erf")]:
            if core.graph is not graph:  # removed as part of an earlier formula
                continue
            match = _find(graph, core)
            if match is None:
                continue
            _replace(graph, *match)
            modified = True
        if modified and MICROSOFT_DOMAIN not in model.opset_imports:
            model.opset_imports[MICROSOFT_DOMAIN] = MICROSOFT_OPSET
        return ir.passes.PassResult(model, modified=modified)
