"""GradientPass: append the backward graph of a scalar loss (or a vector-Jacobian product).

The walker visits, in reverse topological order, the nodes that lie between the wrt tensors and
the loss. For each it sums the gradient contributions of the node's outputs, asks the op's rule
for the inputs' gradients, undoes broadcasting for broadcasting ops, and records contributions.
Every wrt tensor ``x`` gets a graph output ``x_grad`` with x's shape and dtype; where the model
already holds that name (a backward graph differentiated again), ``x_grad2``, ``x_grad3``, ...
(``gradgen.names.gradient_name``), and the loss seed likewise.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, graph_names, numpy_dtype_of
from gradgen.errors import ModelError, UnsupportedOpsError, UsageError
from gradgen.grads.builder import GradContext
from gradgen.grads.registry import GradRule, lookup_rule
from gradgen.grads.torch_records import fx_name, is_detach, read_fx_names, removed_detaches, trained_as_inference
from gradgen.kernels.registry import normalize_domain
from gradgen.model_io import default_opset
from gradgen.names import gradient_name, node_name
from gradgen.ops.control_flow import outer_scope_values, subgraphs
from gradgen.ops.non_tensor import refuse_non_tensor_ops

# The model metadata that lists the float initializers gradient passes added (a scalar loss's seed 1,
# the backward graph's constants), a JSON list of names: no parameters, so a later pass (a backward
# graph differentiated again) leaves them out of its default --wrt.
ADDED_KEY = "gradgen.added_constants"

FLOAT_TYPES = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


def is_float(value: ir.Value) -> bool:
    return value.dtype in FLOAT_TYPES


@dataclasses.dataclass
class GradientSpec:
    """What to differentiate: the loss output and the tensors to differentiate with respect to."""

    loss: str | None = None
    wrt: list[str] | None = None
    freeze: list[str] = dataclasses.field(default_factory=list)
    wrt_inputs: bool = False


def choose_loss(graph: ir.Graph, loss: str | None) -> ir.Value:
    """The named output, else the only scalar float output; a clear error otherwise."""
    outputs = {v.name: v for v in graph.outputs}
    if loss is not None:
        if loss not in outputs:
            raise UsageError(f"--loss {loss!r} is not a graph output; outputs are: {', '.join(outputs)}")
        value = outputs[loss]
        if not is_float(value):
            raise ModelError(f"loss {loss!r} has element type {value.dtype}, not a float type")
        return value
    scalars = [v for v in graph.outputs if is_float(v) and v.shape is not None and v.shape.rank() == 0]
    if len(scalars) == 1:
        return scalars[0]
    described = ", ".join(f"{v.name} {v.dtype} {list(v.shape) if v.shape is not None else '?'}" for v in graph.outputs)
    if not scalars:
        raise ModelError(
            f"the model has no scalar float output to use as the loss (outputs: {described}); "
            "name one with --loss (a non-scalar output gives a vector-Jacobian product)"
        )
    raise ModelError(
        f"the model has several scalar float outputs ({', '.join(v.name for v in scalars)}); choose the loss with --loss"
    )


def choose_wrt(graph: ir.Graph, spec: GradientSpec, depends: set[str], added: set[str] | None = None) -> list[ir.Value]:
    """The tensors to differentiate with respect to, in graph order, per the spec; by default none
    of the constants an earlier gradient pass ``added``."""
    initializers = [v for v in graph.initializers.values() if is_float(v)]
    float_inputs = [v for v in graph.inputs if is_float(v) and v.name not in graph.initializers]
    by_name = {v.name: v for v in initializers + float_inputs}
    if spec.wrt:
        unknown = [n for n in spec.wrt if n not in by_name]
        if unknown:
            everything = {v.name: v for v in graph.inputs} | dict(graph.initializers)
            reasons = [f"{n!r} ({'not a float tensor' if n in everything else 'no such initializer or input'})" for n in unknown]
            raise UsageError(f"--wrt names nothing differentiable: {', '.join(reasons)}")
        chosen = [by_name[n] for n in dict.fromkeys(spec.wrt)]
    else:
        chosen = [v for v in initializers if v.name in depends and v.name not in (added or set())]
    if spec.wrt_inputs:
        chosen += [v for v in float_inputs if v not in chosen]
    frozen = set(spec.freeze)
    unknown_frozen = frozen - set(by_name)
    if unknown_frozen:
        raise UsageError(f"--freeze names no float initializer or input: {', '.join(sorted(unknown_frozen))}")
    left_out = [v.name for v in chosen if v.name in frozen]
    chosen = [v for v in chosen if v.name not in frozen]
    if not chosen and left_out:
        raise UsageError(
            f"nothing to differentiate with respect to: every tensor feeding the loss is frozen by --freeze "
            f"({', '.join(map(repr, left_out))}); unfreeze one, or use --wrt NAME or --wrt-inputs"
        )
    if not chosen:
        raise UsageError(
            "nothing to differentiate with respect to: no float initializer feeds the loss (use --wrt NAME or --wrt-inputs)"
        )
    return chosen


class GradientPass(ir.passes.InPlacePass):
    """Appends the backward graph; adds ``<x>_grad`` outputs for the wrt tensors (``gradient_names``)."""

    def __init__(self, spec: GradientSpec | None = None):
        super().__init__()
        self.spec = spec or GradientSpec()
        self.wrt_names: list[str] = []
        self.gradient_names: list[str] = []  # the output of each wrt tensor's gradient, in order
        self.loss_name: str | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = default_opset(model, 17)
        loss = choose_loss(graph, self.spec.loss)
        nodes = list(graph)
        ancestors = _ancestor_values(loss, nodes)
        added = _recorded_constants(model)
        before = set(graph.initializers)
        wrt = choose_wrt(graph, self.spec, _ancestor_values(loss, nodes, differentiable_only=True), added)
        self.loss_name, self.wrt_names = loss.name, [v.name for v in wrt]

        requires = _values_requiring_grad(wrt, nodes)
        active = [n for n in nodes if any(o.name in ancestors and o.name in requires for o in n.outputs)]
        _say_torch_records(nodes, active, requires)
        rules = _rules_for(active)
        _refuse_unsupported_inputs(nodes, ancestors, requires)

        taken = graph_names(graph)
        seed_name = gradient_name(loss.name, taken)
        self.gradient_names = [gradient_name(name, taken) for name in self.wrt_names]
        builder = GraphBuilder(graph, opset, names=taken)
        if "com.microsoft" not in model.opset_imports:
            model.opset_imports["com.microsoft"] = 1
        grads = _Contributions(builder, taken, dict(zip(self.wrt_names, self.gradient_names)))
        grads.add(loss, _seed(graph, loss, seed_name))

        for node in reversed(active):
            output_grads = [grads.total(o) if o.name in requires else None for o in node.outputs]
            if all(g is None for g in output_grads):
                continue
            rule = rules[node]
            wanted = [
                v is not None
                and v.name in requires
                and i not in _no_gradient_positions(rule)
                and any(d is not None and rule.reaches(k, i) for k, d in enumerate(output_grads))
                for i, v in enumerate(node.inputs)
            ]
            builder.prefix = f"{node.name or node.op_type}_Grad"
            captured = outer_scope_values(node) if subgraphs(node) else []
            captured_wanted = [v.name in requires and is_float(v) for v in captured]
            input_grads = rule.fn(GradContext(builder, node, output_grads, wanted, captured, captured_wanted))
            _record(builder, grads, node, rule, input_grads, wanted + captured_wanted, captured)

        for x, name in zip(wrt, self.gradient_names):
            graph.outputs.append(_gradient_output(builder, grads, x, name))
        added |= {name for name, v in graph.initializers.items() if name not in before and is_float(v)}
        model.metadata_props[ADDED_KEY] = json.dumps(sorted(added))
        _drop_unused_opset(model)
        return ir.passes.PassResult(model, modified=True)


class _Contributions:
    """Gradient parts per forward value; summed (and named ``x_grad``) when first read.

    ``outputs`` maps each wrt tensor to its gradient output's name, chosen (and so held in ``taken``,
    the builder's names) before any node is emitted; ``claim`` gives a value that name."""

    def __init__(self, builder: GraphBuilder, taken: set[str], outputs: dict[str, str]):
        self.b = builder
        self.taken = taken
        self.outputs = outputs
        self._output_names = set(outputs.values())
        self.parts: dict[str, list[ir.Value]] = {}
        self.totals: dict[str, ir.Value] = {}
        self._final: set[ir.Value] = set()  # values already named as some tensor's total gradient

    def add(self, x: ir.Value, grad: ir.Value) -> None:
        if x.name in self.totals:
            raise RuntimeError(f"gradient of {x.name!r} received a contribution after it was used")
        self.parts.setdefault(x.name, []).append(grad)

    def total(self, x: ir.Value) -> ir.Value | None:
        if x.name in self.totals:
            return self.totals[x.name]
        parts = self.parts.get(x.name)
        if not parts:
            return None
        name = self.outputs.get(x.name, f"{x.name}_grad")
        if len(parts) == 1:
            total = parts[0]
            if self._is_fresh(total):
                self.claim(total, name)
        else:
            for i, part in enumerate(parts):
                if self._is_fresh(part):
                    self.b.rename(part, f"{name}_{i}")
            total = self.b.op("Sum", *parts)
            self.claim(total, name)
        _copy_type(total, x)
        self.totals[x.name] = total
        self._final.add(total)
        return total

    def claim(self, value: ir.Value, name: str) -> None:
        """Name ``value`` ``name``; a gradient output's reserved name is released to it."""
        if name in self._output_names and value.name != name:
            self.taken.discard(name)
        self.b.rename(value, name)

    def _is_fresh(self, value: ir.Value) -> bool:
        """Emitted by a rule and not yet given a final name (so renaming it is safe)."""
        producer = value.producer()
        return producer is not None and producer in self.b.node_set and value not in self._final and not value.is_graph_output()


def _copy_type(value: ir.Value, like: ir.Value) -> None:
    if value.type is None:
        value.type = like.type
    if value.shape is None and like.shape is not None:
        value.shape = like.shape


def _seed(graph: ir.Graph, loss: ir.Value, name: str) -> ir.Value:
    """d loss / d loss: 1 for a scalar loss, else a graph input ``<loss>_grad`` (a VJP); ``name``
    is the fresh name chosen for it."""
    if loss.shape is not None and loss.shape.rank() == 0:
        array = np.ones((), dtype=numpy_dtype_of(loss))
        seed = ir.Value(name=name, shape=ir.Shape([]), type=loss.type, const_value=ir.Tensor(array, name=name))
        graph.register_initializer(seed)
        return seed
    seed = ir.Value(name=name, shape=loss.shape, type=loss.type)
    graph.inputs.append(seed)
    return seed


def _recorded_constants(model: ir.Model) -> set[str]:
    """The float initializers earlier gradient passes added (ADDED_KEY); none where the entry is not
    a JSON list of names."""
    try:
        names = json.loads(model.metadata_props.get(ADDED_KEY, "[]"))
    except ValueError:
        return frozenset()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _record(builder, grads, node, rule: GradRule, input_grads, wanted, captured=()) -> None:
    """Record the rule's gradients: one per input, then one per outer-scope value the node's
    subgraphs read (``captured``), for every entry of ``wanted`` that is true."""
    sources = [*node.inputs, *captured]
    if not isinstance(input_grads, (list, tuple)) or len(input_grads) > len(sources):
        raise RuntimeError(
            f"gradient rule of {node.op_type} returned {input_grads!r}; expected a list of at most {len(sources)} entries"
        )
    differentiable = [i for i, w in enumerate(wanted) if w]
    for i in differentiable:
        grad = input_grads[i] if i < len(input_grads) else None
        x = sources[i]
        if grad is None:  # a zero here would be a silent wrong gradient: the rule must say why instead
            raise ModelError(
                f"node {node_name(node)!r} ({node.op_type}): its gradient rule gives no "
                f"gradient for input {i} ({x.name!r}), which the loss depends on; "
                "this is a gradgen bug, please report it"
            )
        if rule.broadcast and i < len(node.inputs):
            partner = None
            if len(node.inputs) == 2:
                partner = (node.inputs[1 - i], i)
            grad = builder.unbroadcast(grad, x, node.outputs[0], partner)
        grads.add(x, grad)


def _gradient_output(builder: GraphBuilder, grads: _Contributions, x: ir.Value, name: str) -> ir.Value:
    """The graph output ``name`` (``x_grad``): the summed gradient, zeros if the loss ignores x."""
    builder.prefix = f"{x.name}_Grad"
    total = grads.total(x)
    if total is None:
        total = builder.zeros_like(x)
    if total.name != name or total.is_graph_output() or total.is_graph_input() or total.is_initializer():
        if total.name == name:
            builder.rename(total, f"{name}_part")
        total = builder.op("Identity", total)
        grads.claim(total, name)
    if total.name != name:
        raise ModelError(f"cannot name the gradient output {name!r}: the model already has a tensor of that name")
    total.type = x.type
    total.shape = x.shape
    return total


# an Identity PyTorch's exporter recorded as ``detach``: a constant to the gradient, as in PyTorch
# (a rule without a function is a non-differentiable op's)
_DETACHED = GradRule("", "Identity", None, module=__name__)


def _rule_of(node: ir.Node) -> GradRule | None:
    """The gradient rule of ``node``'s op; none for a recorded ``detach`` (``torch_records``)."""
    if is_detach(node):
        return _DETACHED
    return lookup_rule(node.domain, node.op_type)


def _say_torch_records(nodes: list[ir.Node], active: list[ir.Node], requires: set[str]) -> None:
    """Notes on what PyTorch's records change or cannot: the recorded detaches a gradient would
    have crossed, and the active readers of a detach the exporter's optimizer removed."""
    stopped = [n for n in nodes if is_detach(n) and any(v is not None and v.name in requires for v in n.inputs)]
    if stopped:
        named = ", ".join(repr(node_name(n)) for n in stopped[:4]) + (", ..." if len(stopped) > 4 else "")
        warnings.warn(
            f"{len(stopped)} Identity node(s) ({named}) are PyTorch's detach (the exporter's record): no gradient "
            "flows through them, as in PyTorch",
            stacklevel=3,
        )
    inference = [n for n in active if trained_as_inference(n)]
    if inference:
        warnings.warn(
            f"{len(inference)} BatchNormalization node(s) ({', '.join(repr(node_name(n)) for n in inference[:3])}"
            f"{', ...' if len(inference) > 3 else ''}) are PyTorch's train-mode batch norm (the exporter's record), "
            "written in inference mode: they normalise with the running statistics, not the batch's, and update "
            "none (torch.onnx.export(dynamo=True) does this); export with dynamo=False, or from a module in eval mode",
            stacklevel=3,
        )
    on_path = set(active)
    removed = [(n, value) for n, value in removed_detaches(nodes) if n in on_path and _reads_an_unrecorded_value(n, requires)]
    if removed:
        named = ", ".join(f"{node_name(n)!r} (reads %{value})" for n, value in removed[:3]) + (
            ", ..." if len(removed) > 3 else ""
        )
        warnings.warn(
            f"PyTorch's program detaches values that node(s) {named} read, but the exporter's optimizer removed "
            "the detach: the graph lets a gradient through where PyTorch's autograd does not; export with "
            "optimize=False to keep it",
            stacklevel=3,
        )


def _reads_an_unrecorded_value(reader: ir.Node, requires: set[str]) -> bool:
    """Whether ``reader`` takes a gradient-carrying value from a node its own record does not name:
    the value that took the removed detach's place (a detached buffer or index is no such value)."""
    read = read_fx_names(reader)
    for value in reader.inputs:
        if value is None or value.name not in requires or value.producer() is None:
            continue
        name = fx_name(value.producer())
        if name is None or name not in read:
            return True
    return False


def _no_gradient_positions(rule: GradRule | None) -> frozenset[int]:
    """Input positions through which no gradient flows back (see GradRule)."""
    if rule is None:
        return frozenset()
    return rule.nondiff_inputs | rule.unsupported_inputs


def _ancestor_values(loss: ir.Value, nodes: list[ir.Node], differentiable_only: bool = False) -> set[str]:
    """Names of every value the loss depends on (the loss included).

    With ``differentiable_only``, only through inputs that carry a gradient: a path through a
    non-differentiable op or input (shapes, indices, Resize's scales) does not count, so the
    default ``--wrt`` picks parameters, not configuration tensors.
    """
    seen = {loss.name}
    stack = [loss]
    while stack:
        value = stack.pop()
        producer = value.producer()
        if producer is None:
            continue
        skipped: frozenset[int] = frozenset()
        rule = None
        if differentiable_only:
            rule = _rule_of(producer)
            if rule is not None and not rule.differentiable:
                continue
            skipped = _no_gradient_positions(rule)
        for i, inp in enumerate(producer.inputs):
            if i in skipped or (rule is not None and not rule.reaches(value.index(), i)):
                continue
            if inp is not None and inp.name not in seen:
                seen.add(inp.name)
                stack.append(inp)
        for sub in _subgraph_inputs(producer):
            if sub.name not in seen:
                seen.add(sub.name)
                stack.append(sub)
    return seen


def _subgraph_inputs(node: ir.Node) -> list[ir.Value]:
    """Outer values captured by a node's subgraphs (If/Loop/Scan bodies)."""
    captured = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            graphs = [attr.value]
        elif attr.type == ir.AttributeType.GRAPHS:
            graphs = list(attr.value)
        else:
            continue
        for sub in graphs:
            inner = {v.name for v in sub.inputs} | set(sub.initializers)
            for sub_node in ir.traversal.RecursiveGraphIterator(sub):
                inner.update(o.name for o in sub_node.outputs)
                captured.extend(v for v in sub_node.inputs if v is not None and v.name not in inner)
    return captured


def _values_requiring_grad(wrt: list[ir.Value], nodes: list[ir.Node]) -> set[str]:
    """Float values reachable from the wrt tensors through differentiable inputs."""
    requires = {v.name for v in wrt}
    for node in nodes:
        rule = _rule_of(node)
        if rule is not None and not rule.differentiable:
            continue
        nondiff = _no_gradient_positions(rule)
        reached = any(v is not None and v.name in requires and i not in nondiff for i, v in enumerate(node.inputs))
        reached = reached or any(v.name in requires for v in _subgraph_inputs(node))
        if reached:
            requires.update(o.name for o in node.outputs if o.name and (o.dtype is None or is_float(o)))
    return requires


def _refuse_unsupported_inputs(nodes: list[ir.Node], ancestors: set[str], requires: set[str]) -> None:
    """A differentiated tensor that reaches an input gradgen cannot differentiate is an error."""
    offenders = []
    for node in nodes:
        rule = _rule_of(node)
        if rule is None or not rule.unsupported_inputs or not any(o.name in ancestors for o in node.outputs):
            continue
        for i in sorted(rule.unsupported_inputs):
            value = node.inputs[i] if i < len(node.inputs) else None
            if value is not None and value.name in requires:
                offenders.append(f"input {i} ({value.name!r}) of {node.op_type} node {node_name(node)!r}")
    if offenders:
        raise ModelError(
            f"gradgen has no gradient for {'; '.join(offenders)}, and it depends on a tensor being "
            "differentiated; leave that tensor out of --wrt or --freeze it"
        )


def _rules_for(active: list[ir.Node]) -> dict[ir.Node, GradRule]:
    """The rule of every active node; every missing one reported at once."""
    refuse_non_tensor_ops(active)
    rules, missing = {}, []
    for node in active:
        rule = _rule_of(node)
        if rule is None or not rule.differentiable:
            missing.append((normalize_domain(node.domain), node.op_type, node_name(node)))
        else:
            rules[node] = rule
    if missing:
        raise UnsupportedOpsError("a gradient rule", missing)
    return rules


def _drop_unused_opset(model: ir.Model) -> None:
    uses_ms = any(normalize_domain(n.domain) == "com.microsoft" for n in ir.traversal.RecursiveGraphIterator(model.graph))
    if not uses_ms:
        model.opset_imports.pop("com.microsoft", None)
