"""UnrollLoopsPass: rewrite Loop and Scan nodes whose number of iterations the model fixes into
their bodies' nodes, one copy per iteration, in the main graph, so that the ordinary gradient
rules differentiate them (loop-carried state, scan outputs and the outer values the body reads
alike) and both executors run them with the kernels they have.

A Loop with a constant trip count M whose body passes its condition through (or sets it to a
constant true) runs M times; a Scan runs over its scan inputs' static length. Each copy gets its
iteration number (Loop) or its slices of the scan inputs (Scan) and the previous copy's state;
scan outputs are stacked (Unsqueeze + Concat) along their axis, in their direction. After a round
that unrolled something, ``EvaluateConstantsPass`` folds what the iteration numbers now fix (an If
on the iteration number is inlined), and loops nested in the bodies, now in the main graph, unroll
in the next round. Loops of a length known only at run time (and loops over more than
``MAX_ITERATIONS``) stay in place, and a Scan of such a length is written as a Loop (each
iteration gathers its slices of the scan inputs): the executors run them, and Loop's gradient rule
differentiates them with a Loop over the saved iterations in reverse (gradgen/grads/rules/control.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir._cloner import Cloner

from gradgen.builder import INT64_MIN, GraphBuilder
from gradgen.model_io import default_opset
from gradgen.ops.attributes import get_attr
from gradgen.ops.control_flow import loop_trip_count, scan_length, subgraphs
from gradgen.passes.rewrite import STANDARD_DOMAINS, float_constant, rewrite_nodes

__all__ = ["FLOAT_TYPES", "MAX_ITERATIONS", "UnrollLoopsPass", "rename_copied_node", "scan_as_loop_refusal", "unroll_reason"]

MAX_ITERATIONS = 4096  # longer loops would make graphs too large to be worth unrolling
FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def unroll_reason(node: ir.Node, opset: int) -> int | str:
    """The number of iterations UnrollLoopsPass unrolls ``node`` into, or why it does not."""
    if node.op_type == "Scan" and opset < 9:
        return "Scan below opset 9 (with a batch axis) is not unrolled"
    count = loop_trip_count(node) if node.op_type == "Loop" else scan_length(node)
    if isinstance(count, str):
        return count
    if count > MAX_ITERATIONS:
        return f"it runs {count} iterations, more than the {MAX_ITERATIONS} gradgen unrolls"
    body = get_attr(node, "body")
    first_scan = len(body.outputs) - (len(node.outputs) - _num_states(node))
    if count == 0 and first_scan < len(body.outputs):
        return "it runs zero iterations and has scan outputs (of a shape the model does not fix)"
    return count


class UnrollLoopsPass(ir.passes.InPlacePass):
    """Unroll every Loop / Scan of the main graph that carries float values and has a static
    number of iterations (in place, to a fixed point); shape inference and constant folding run
    after each round that changed something."""

    def __init__(self, max_rounds: int = 8):
        super().__init__()
        self.max_rounds = max_rounds

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from gradgen.passes.evaluate import EvaluateConstantsPass

        opset = default_opset(model, 14)
        modified = False
        for _ in range(self.max_rounds):
            counts = {}
            for node in model.graph:
                if node.domain in STANDARD_DOMAINS and node.op_type in ("Loop", "Scan") and _carries_floats(node):
                    count = unroll_reason(node, opset)
                    if isinstance(count, int):
                        counts[node] = count
            if not rewrite_nodes(model, list(counts), functools.partial(_unroll, counts=counts)):
                break
            EvaluateConstantsPass()(model)
            modified = True
        scans = [
            node
            for node in model.graph
            if node.domain in STANDARD_DOMAINS and node.op_type == "Scan" and _carries_floats(node) and _loop_form(node, opset)
        ]
        modified = rewrite_nodes(model, scans, _scan_as_loop) or modified
        return ir.passes.PassResult(model, modified=modified)


def _carries_floats(node: ir.Node) -> bool:
    """Whether the loop computes floats (tensors, or sequences of them), by its outputs' types or,
    where the export left those untyped, its body's (the legacy exporter's torch.tensor_split: a
    list of slices built in a Loop of one iteration)."""
    if any(v.dtype in FLOAT_TYPES for v in node.outputs):
        return True
    body = get_attr(node, "body")
    return body is not None and any(v.type is not None and v.type.dtype in FLOAT_TYPES for v in body.outputs)


def _num_states(node: ir.Node) -> int:
    """How many loop-carried values the node has (its first outputs; the rest are scan outputs)."""
    if node.op_type == "Loop":
        return max(len(node.inputs) - 2, 0)
    return len(node.inputs) - int(get_attr(node, "num_scan_inputs"))


def rename_copied_node(node: ir.Node, prefix: str, unique: Callable[[str], str]) -> None:
    """Fresh names (``unique(prefix/name)``) for a copied node, its outputs and everything in its
    subgraphs (a model's names are unique across all of its graphs)."""
    node.name = unique(f"{prefix}/{node.name or node.op_type}")
    for value in node.outputs:
        if value.name:
            value.name = unique(f"{prefix}/{value.name}")
    for graph in subgraphs(node):
        for value in graph.inputs:
            value.name = unique(f"{prefix}/{value.name}")
        for inner in graph:
            rename_copied_node(inner, prefix, unique)


class BodyCopier:
    """Copies a body into the main graph once per iteration, through one GraphBuilder (unique
    names, shared constants); the body's initializers are placed once."""

    def __init__(self, node: ir.Node, builder: GraphBuilder):
        self.node, self.b = node, builder
        self.body: ir.Graph = get_attr(node, "body")
        self._constants: dict = {}
        self.initializers = {value: self._place(value) for value in self.body.initializers.values()}
        self._results: set[ir.Value] = set()

    def _place(self, value: ir.Value) -> ir.Value:
        assert value.const_value is not None  # an initializer
        array = value.const_value.numpy()
        if array.dtype.kind == "f":  # as a Constant node: an initializer would read as a parameter
            return float_constant(self.b, array, self._constants)
        return self.b.const(array)

    def iteration(self, index: int, inputs: list[ir.Value]) -> list[ir.Value]:
        """The body's outputs for one iteration whose body inputs are ``inputs``."""
        value_map: dict[ir.Value, ir.Value | None] = dict(self.initializers)
        value_map.update(zip(self.body.inputs, inputs))
        cloner = Cloner(attr_map={}, value_map=value_map, metadata_props={}, allow_outer_scope_values=True)
        prefix = f"{self.node.name or self.node.op_type}/iter{index}"
        for body_node in self.body:
            copy = cloner.clone_node(body_node)
            rename_copied_node(copy, prefix, self.b.unique)
            self.b.nodes.append(copy)
            self.b.node_set.add(copy)
        return [value_map.get(v, v) or v for v in self.body.outputs]

    def result(self, value: ir.Value) -> ir.Value:
        """``value`` as a node output's replacement: made here, or passed through an Identity (an
        outer value or an initial state, which must keep its own name)."""
        producer = value.producer()
        if value not in self._results and producer is not None and producer in self.b.node_set:
            self._results.add(value)
            return value
        return self.b.op("Identity", value)

    def stack(self, elements: list[ir.Value], axis: int) -> ir.Value:
        """The per-iteration values stacked along a new ``axis`` (negative: from the end)."""
        parts = [self.b.unsqueeze(e, [axis]) for e in elements]
        return parts[0] if len(parts) == 1 else self.b.op("Concat", *parts, axis=axis)


def _unroll(node: ir.Node, b: GraphBuilder, counts: dict[ir.Node, int]) -> list[ir.Value | None]:
    count = counts[node]
    return _unroll_loop(node, b, count) if node.op_type == "Loop" else _unroll_scan(node, b, count)


def _unroll_loop(node: ir.Node, b: GraphBuilder, count: int) -> list[ir.Value | None]:
    copier = BodyCopier(node, b)
    states: list[ir.Value] = [v for v in node.inputs[2:] if v is not None]
    scans: list[list[ir.Value]] = []
    go_on = b.const(np.array(True))
    for i in range(count):
        outputs = copier.iteration(i, [b.scalar(i), go_on, *states])
        states = outputs[1 : 1 + len(states)]
        scans.append(outputs[1 + len(states) :])
    finals: list[ir.Value | None] = [copier.result(s) for s in states]
    stacked = [copier.stack([scan[k] for scan in scans], 0) for k in range(len(scans[0]))] if scans else []
    return finals + stacked


def _unroll_scan(node: ir.Node, b: GraphBuilder, count: int) -> list[ir.Value | None]:
    copier = BodyCopier(node, b)
    num_scan = int(get_attr(node, "num_scan_inputs"))
    num_states = len(node.inputs) - num_scan
    in_axes = get_attr(node, "scan_input_axes") or [0] * num_scan
    in_reverse = get_attr(node, "scan_input_directions") or [0] * num_scan
    slices = []
    for k in range(num_scan):
        x, axis = node.inputs[num_states + k], in_axes[k]
        assert x is not None  # scan_length read its shape
        parts = [x] if count == 1 else b.op_multi("Split", [x, b.ints([1] * count)], count, axis=axis)
        per_step = [b.squeeze(p, [axis]) for p in parts]
        slices.append(per_step[::-1] if in_reverse[k] else per_step)
    states: list[ir.Value] = [v for v in node.inputs[:num_states] if v is not None]
    elements: list[list[ir.Value]] = []
    for i in range(count):
        outputs = copier.iteration(i, [*states, *(s[i] for s in slices)])
        states = outputs[:num_states]
        elements.append(outputs[num_states:])
    num_outputs = len(node.outputs) - num_states
    out_axes = get_attr(node, "scan_output_axes") or [0] * num_outputs
    out_reverse = get_attr(node, "scan_output_directions") or [0] * num_outputs
    stacked = []
    for k in range(num_outputs):
        series = [e[k] for e in elements]
        stacked.append(copier.stack(series[::-1] if out_reverse[k] else series, out_axes[k]))
    finals: list[ir.Value | None] = [copier.result(s) for s in states]
    return finals + stacked


def _loop_form(node: ir.Node, opset: int) -> bool:
    """Whether a Scan that is not unrolled (a run-time length, or too long) becomes a Loop."""
    return opset >= 9 and not isinstance(unroll_reason(node, opset), int) and scan_as_loop_refusal(node) is None


def scan_as_loop_refusal(node: ir.Node) -> str | None:
    """Why a Scan cannot be written as a Loop, else None: the rank of a scan output stacked along
    an axis other than the first must be known (to move the Loop's first axis there)."""
    body = get_attr(node, "body")
    num_states = _num_states(node)
    for k, axis in enumerate(get_attr(node, "scan_output_axes") or []):
        if axis != 0 and body.outputs[num_states + k].shape is None:
            return f"the rank of its scan output {k}, stacked along axis {axis}, is unknown"
    return None


def _body_input(b: GraphBuilder, name: str, declared: ir.Value, outer: ir.Value | None) -> ir.Value:
    """A Loop body input standing for the Scan body's state input ``declared``, typed as it is or,
    where the body leaves it untyped, as ``outer``, the state's initial value (as ONNX's inference
    of Scan does): the gradient of the Loop needs its type and rank."""
    if declared.type is not None or outer is None:
        return ir.Value(name=b.unique(name), type=declared.type, shape=declared.shape)
    return ir.Value(name=b.unique(name), type=outer.type, shape=ir.Shape(outer.shape) if outer.shape is not None else None)


def _slice_shape(declared: ir.Value, sequence: ir.Value, axis: int) -> ir.Shape | None:
    """The shape of one slice of a scan input: as the body declares it, else the sequence's
    without the scan axis."""
    if declared.shape is not None or sequence.shape is None:
        return declared.shape
    dims = list(sequence.shape)
    del dims[axis]
    return ir.Shape(dims)


def _scan_as_loop(node: ir.Node, b: GraphBuilder) -> list[ir.Value | None]:
    """A Scan as a Loop of as many iterations as its first scan input is long: iteration i gathers
    slice i (n-1-i in reverse) of each scan input and runs the Scan's body; the Loop's scan
    outputs are reversed and moved to their axes as the Scan's attributes say. The gradient rule
    of Loop then differentiates it (gradgen/grads/rules/control.py)."""
    body: ir.Graph = get_attr(node, "body")
    num_scan = int(get_attr(node, "num_scan_inputs"))
    num_states = len(node.inputs) - num_scan
    in_axes = get_attr(node, "scan_input_axes") or [0] * num_scan
    in_reverse = get_attr(node, "scan_input_directions") or [0] * num_scan
    sequences = node.inputs[num_states:]
    assert sequences[0] is not None  # Scan's inputs are not optional
    count = b.op("Gather", b.shape_of(sequences[0]), b.scalar(in_axes[0]), axis=0)
    prefix = f"{node.name or 'Scan'}/loop"
    inner = b.collector(prefix)
    i = ir.Value(name=inner.unique(f"{prefix}/i"), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
    go_on = ir.Value(name=inner.unique(f"{prefix}/cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
    states = [_body_input(inner, f"{prefix}/{v.name}", v, outer) for v, outer in zip(body.inputs[:num_states], node.inputs)]
    backwards = inner.op("Sub", b.op("Sub", count, b.scalar(1)), i) if any(in_reverse) else i
    slices = []
    for k, (x, axis, reverse) in enumerate(zip(sequences, in_axes, in_reverse)):
        element = inner.op("Gather", x, backwards if reverse else i, axis=axis)
        declared = body.inputs[num_states + k]
        assert x is not None  # Scan's inputs are not optional
        element.type, element.shape = declared.type or x.type, _slice_shape(declared, x, axis)
        slices.append(element)
    copier = BodyCopier(node, inner)
    outputs = [inner.op("Identity", go_on)] + [copier.result(v) for v in copier.iteration(0, [*states, *slices])]
    for value, declared in zip(outputs[1:], body.outputs):
        value.type, value.shape = value.type or declared.type, value.shape or declared.shape
    loop_body = ir.Graph([i, go_on, *states], outputs, nodes=inner.nodes, name=inner.unique(f"{prefix}_body"))
    results = b.op_multi("Loop", [count, None, *node.inputs[:num_states]], len(node.outputs), body=loop_body)
    out_axes = get_attr(node, "scan_output_axes") or [0] * (len(node.outputs) - num_states)
    out_reverse = get_attr(node, "scan_output_directions") or [0] * len(out_axes)
    stacked = []
    for k, (y, axis, reverse) in enumerate(zip(results[num_states:], out_axes, out_reverse)):
        if reverse:
            y = b.op("Slice", y, b.ints([-1]), b.ints([INT64_MIN]), b.ints([0]), b.ints([-1]))
        if axis != 0:
            dims = body.outputs[num_states + k].shape
            assert dims is not None  # _loop_form checked it
            rank = len(dims) + 1
            axis = axis + rank if axis < 0 else axis
            y = b.transpose(y, [*range(1, axis + 1), 0, *range(axis + 1, rank)]) if axis else y
        stacked.append(y)
    return [*results[:num_states], *stacked]
