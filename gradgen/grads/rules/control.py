"""If, Loop and Scan: gradients through control flow the data decides.

The passes before the gradient pass handle what the model fixes: ``EvaluateConstantsPass``
inlines an If whose condition is a constant after folding, and ``UnrollLoopsPass``
(gradgen/passes/control_flow.py) rewrites a Loop or Scan of a static length into copies of its
body (the fast path). What reaches these rules is chosen at run time:

- If: the gradient is an If on the same condition. Each backward branch recomputes its forward
  branch's nodes (rematerialisation: nothing of the forward branch is saved) and runs their
  gradient graph, seeded by the If's output gradients read from the outer scope; it outputs the
  gradient of every outer float value either branch reads (zeros where its branch does not read
  it), so both branches agree in number, type and shape.
- Loop (a run-time trip count, a condition the body computes, or more iterations than gradgen
  unrolls): the forward Loop gains scan outputs saving each iteration's number and loop-carried
  inputs; the backward is a Loop of as many iterations (the saved stack's Size) that visits them
  in reverse: iteration j takes the state saved by iteration n-1-j, recomputes the body on it and
  applies the body's vector-Jacobian product, carrying the gradient of the loop-carried float state
  and summing the gradients of the outer values the body reads in loop-carried accumulators; scan
  outputs seed it with their gradients' slice n-1-j. Zero iterations pass the final state's
  gradient through to the initial state and give the outer values zeros.
- Scan: ``UnrollLoopsPass`` writes one of a run-time length as a Loop; one it could not write so
  (a scan output of unknown rank stacked along a later axis) is refused here, naming the node.

A subgraph's vector-Jacobian product (``subgraph_vjp``) is built by gradgen's own pipeline on a
standalone copy of the subgraph, so nested control flow (an If in a branch, a Loop in a body),
fused ops and unrollable inner loops work as they do at top level, and an op without a rule is the
same one-line error naming the node.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir._cloner import Cloner

from gradgen.builder import GraphBuilder
from gradgen.errors import ModelError
from gradgen.evaluate import direct_constant
from gradgen.grads.builder import GradContext
from gradgen.grads.table import grad_rule
from gradgen.model_io import default_opset
from gradgen.ops.attributes import get_attr
from gradgen.ops.control_flow import graph_outer_values
from gradgen.passes.control_flow import FLOAT_TYPES, rename_copied_node, scan_as_loop_refusal

BOOL = ir.TensorType(ir.DataType.BOOL)
INT64 = ir.TensorType(ir.DataType.INT64)


@grad_rule("If", nondiff_inputs=(0,))
def if_(g: GradContext) -> list[ir.Value | None]:
    """An If on the same condition; each branch gives the gradients of the outer values (see the
    module's docstring)."""
    node = g.node
    targets = [v for k, v in enumerate(g.captured) if g.needs_captured(k)]
    seeds = [g.dy(k) for k in range(len(node.outputs))]
    branches = {}
    for key in ("then_branch", "else_branch"):
        b = g.collector(f"{node.name or 'If'}_Grad/{key}")
        nodes, grads = subgraph_vjp(b, get_attr(node, key), {}, seeds, [], targets, f"{_where(node)}, its {key}")
        outputs = _outputs(b, nodes, grads, targets)
        branches[key] = ir.Graph([], outputs, nodes=[*nodes, *b.nodes], name=b.unique(f"{node.name or 'If'}_Grad_{key}"))
    results = g.op_multi("If", [node.inputs[0]], len(targets), **branches)
    _type_like(results, targets)
    by_target = dict(zip(targets, results))
    input_grads: list[ir.Value | None] = [None] * len(node.inputs)
    return input_grads + [by_target.get(v) for v in g.captured]


@grad_rule("Loop", nondiff_inputs=(0, 1))
def loop(g: GradContext) -> list[ir.Value | None]:
    """A Loop over the saved iterations in reverse (see the module's docstring)."""
    node = g.node
    body: ir.Graph = get_attr(node, "body")
    states = list(node.inputs[2:])
    untyped = [v.name for v in states if v is not None and v.dtype is None]
    if untyped:
        raise ModelError(
            f"{_where(node)}: the element type of its loop-carried value(s) {', '.join(map(repr, untyped))} is unknown "
            "(shape inference could not tell it); its gradient needs it"
        )
    floats = [k for k, v in enumerate(states) if v is not None and v.dtype in FLOAT_TYPES]
    for formal, state in zip(body.inputs[2:], states):
        if formal.type is None and state is not None:  # untyped: its initial value's type and rank
            formal.type = state.type
            formal.shape = ir.Shape([None] * len(state.shape)) if state.shape is not None else None
    targets = [v for k, v in enumerate(g.captured) if g.needs_captured(k)]
    num_outputs = len(node.outputs)
    iterations, saved = _save_iterations(g, node, body)
    count = g.op("Size", iterations)
    scan_seeds = [g.dy(k) for k in range(len(states), num_outputs)]
    backward = _reverse_body(g, node, body, g.op("Sub", count, g.scalar(1)), [iterations, *saved], scan_seeds, floats, targets)
    initial = [g.dy(k) if g.dy(k) is not None else g.zeros_like(g.y(k)) for k in floats]
    initial += [g.zeros_like(v) for v in targets]
    results = g.op_multi("Loop", [count, None, *initial], len(initial), body=backward)
    _type_like(results, [*(states[k] for k in floats), *targets])
    input_grads: list[ir.Value | None] = [None] * len(node.inputs)
    for position, k in enumerate(floats):
        input_grads[2 + k] = results[position]
    by_target = dict(zip(targets, results[len(floats) :]))
    return input_grads + [by_target.get(v) for v in g.captured]


def _reverse_body(
    g: GradContext,
    node: ir.Node,
    body: ir.Graph,
    last: ir.Value,
    stacks: list[ir.Value],
    scan_seeds: list[ir.Value | None],
    floats: list[int],
    targets: list[ir.Value],
) -> ir.Graph:
    """The body of the backward Loop: iteration j reads element ``last - j`` of the saved
    ``stacks`` (the iteration numbers, then every loop-carried input) and of the scan outputs'
    gradients, recomputes ``body`` on it and applies its VJP to the carried gradients of the float
    states at ``floats``; it carries those, and sums the gradients of ``targets``."""
    prefix = f"{node.name or 'Loop'}_Grad/body"
    head = g.collector(prefix)
    j = ir.Value(name=head.unique(f"{prefix}/j"), type=INT64, shape=ir.Shape([]))
    go_on = ir.Value(name=head.unique(f"{prefix}/cond"), type=BOOL, shape=ir.Shape([]))
    carried = []
    for k in floats:
        state = node.inputs[2 + k]
        assert state is not None  # a float state
        carried.append(_like(head, state, f"{prefix}/d_state{k}"))
    sums = [_like(head, v, f"{prefix}/d_{v.name}") for v in targets]
    index = head.op("Sub", last, j)
    index.type, index.shape = INT64, ir.Shape([])
    bind = {body.inputs[1]: g.const(np.array(True))}  # an iteration that ran was entered with true
    for position, stack in zip([0, *range(2, len(body.inputs))], stacks):
        bind[body.inputs[position]] = _element(head, stack, index, body.inputs[position])
    seeds: list[ir.Value | None] = [None] * len(body.outputs)
    for position, k in enumerate(floats):
        seeds[1 + k] = carried[position]
    num_states = len(body.inputs) - 2
    for s, dy in enumerate(scan_seeds):
        if dy is not None:
            seeds[1 + num_states + s] = _element(head, dy, index, body.outputs[1 + num_states + s])

    tail = g.collector(prefix)
    nodes, grads = subgraph_vjp(tail, body, bind, seeds, [2 + k for k in floats], targets, f"{_where(node)}, its body")
    state_grads, target_grads = grads[: len(floats)], grads[len(floats) :]
    outputs = [tail.op("Identity", go_on)]
    outputs += _outputs(tail, nodes, state_grads, carried)
    outputs += [tail.op("Add", total, part) for total, part in zip(sums, target_grads)]
    _type_like(outputs, [go_on, *carried, *sums])
    inputs = [j, go_on, *carried, *sums]
    return ir.Graph(inputs, outputs, nodes=[*head.nodes, *nodes, *tail.nodes], name=g.unique(f"{prefix}_graph"))


@grad_rule("Scan")
def _scan_not_rewritten(g: GradContext) -> list[ir.Value | None]:
    """UnrollLoopsPass unrolls a Scan of a static length and writes any other as a Loop; one that
    reaches this rule is refused with the reason."""
    node = g.node
    reason = scan_as_loop_refusal(node) or (
        "it reached the gradient pass; run gradgen.passes.UnrollLoopsPass before GradientPass (build_backward's pipeline does)"
    )
    raise ModelError(
        f"{_where(node)}: {reason}; gradgen differentiates a Scan as copies of its body (a static length) or as a Loop"
    )


def subgraph_vjp(
    b: GraphBuilder,
    graph: ir.Graph,
    bind: dict[ir.Value, ir.Value],
    seeds: list[ir.Value | None],
    wrt_inputs: list[int],
    wrt_outer: list[ir.Value],
    where: str,
) -> tuple[list[ir.Node], list[ir.Value]]:
    """Nodes computing the vector-Jacobian product of ``graph``: sum_k seeds[k] . d outputs[k] / d w
    for each of ``graph``'s own inputs at ``wrt_inputs`` and each outer value in ``wrt_outer``, in
    that order (zeros for one the outputs do not depend on).

    The nodes recompute ``graph``'s nodes (its own inputs read ``bind[input]``) and then their
    gradient graph, which reads ``seeds`` (values of the graph the nodes will be placed in, or of
    an enclosing one; None: an output that gets no gradient). They are new nodes, named through
    ``b``, for the caller to place in a subgraph; the gradients are among their outputs, or values
    they read (wrap those in an Identity to output them). A model error in ``graph`` is raised as
    one line starting with ``where`` (the node and the subgraph).
    """
    from gradgen.api import backward_pipeline, run_pipeline
    from gradgen.passes import CleanupPass, GradientSpec, ShapeInferencePass

    model, feeds, wrt, seed_inputs = _vjp_model(graph, b.graph.opset_imports, bind, seeds, wrt_inputs, wrt_outer)
    pipeline, gradient = backward_pipeline(GradientSpec(loss=model.graph.outputs[0].name, wrt=[str(v.name) for v in wrt]))
    try:
        ShapeInferencePass()(model)  # the main graph's inference leaves a subgraph's values untyped
        run_pipeline(pipeline, model)
    except ModelError as exc:
        raise ModelError(f"{where}: " + " ".join(line.strip() for line in str(exc).splitlines())) from None
    _drop_unit_products(model, seed_inputs)
    by_name = {v.name: v for v in model.graph.outputs}
    grads = [by_name[name] for name in gradient.gradient_names]
    model.graph.outputs.clear()
    model.graph.outputs.extend(dict.fromkeys(grads))
    CleanupPass()(model)
    return _place(b, model, feeds, grads)


def _vjp_model(
    graph: ir.Graph,
    opset_imports: dict[str, int],
    bind: dict[ir.Value, ir.Value],
    seeds: list[ir.Value | None],
    wrt_inputs: list[int],
    wrt_outer: list[ir.Value],
) -> tuple[ir.Model, list[tuple[ir.Value, ir.Value]], list[ir.Value], list[ir.Value]]:
    """A standalone copy of ``graph`` whose loss is sum_k sum(outputs[k] * seed_k): its inputs are
    the graph's own, the outer values it reads (and those of ``wrt_outer`` it does not) and one per
    seed. Also each input paired with the value it stands for, the inputs to differentiate and the
    seeds' inputs."""
    by_name: dict[str | None, ir.Value] = {v.name: v for v in wrt_outer}  # the outer value each input stands for
    outer = graph_outer_values(graph)  # a name may come as two values (see there): one input for both
    for v in outer:
        by_name.setdefault(v.name, v)
    inputs = {name: ir.Value(name=name, type=v.type, shape=v.shape) for name, v in by_name.items()}
    value_map: dict[ir.Value, ir.Value | None] = {v: inputs[v.name] for v in outer}
    cloner = Cloner(attr_map={}, value_map=value_map, metadata_props={}, allow_outer_scope_values=True)
    copy = cloner.clone_graph(graph)
    feeds = [(mine, bind[theirs]) for mine, theirs in zip(copy.inputs, graph.inputs)]
    feeds += [(inputs[name], v) for name, v in by_name.items()]
    wrt_names = {v.name for v in wrt_outer}
    for name, v in by_name.items():  # constants the body reads stay constants (shape inference reads them)
        known = direct_constant(v) if name not in wrt_names and not v.is_graph_input() else None
        if known is not None:
            inputs[name].const_value = ir.tensor(known)
            copy.register_initializer(inputs[name])
    copy.inputs.extend(v for v in inputs.values() if v.const_value is None)
    copy.opset_imports.update(opset_imports)
    if any(output.type is None or output.shape is None for output in copy.outputs):
        _infer_outputs(copy)
    b = GraphBuilder(copy, default_opset(copy, 17), prefix="vjp")
    terms, seed_inputs = [], []
    for output, seed in zip(copy.outputs, seeds):
        if seed is None:
            continue
        output.type = output.type or seed.type  # a subgraph output may be untyped
        seed_input = ir.Value(name=b.unique(f"{output.name}_seed"), type=output.type, shape=output.shape)
        feeds.append((seed_input, seed))
        seed_inputs.append(seed_input)
        product = b.op("Mul", output, seed_input)
        product.type, product.shape = output.type, output.shape
        term = b.reduce_sum(product, None, keepdims=0)
        term.type, term.shape = output.type, ir.Shape([])
        terms.append(term)
    loss_type = terms[0].type
    assert loss_type is not None  # typed above
    terms = [t if t.type == loss_type else b.op("Cast", t, to=loss_type.dtype) for t in terms]
    loss = b.op("Sum", *terms)
    loss.type, loss.shape = loss_type, ir.Shape([])
    copy.outputs.clear()
    copy.outputs.append(loss)
    copy.inputs.extend(seed_inputs)
    copy.opset_imports.setdefault("com.microsoft", 1)
    wrt = [copy.inputs[k] for k in wrt_inputs] + [inputs[v.name] for v in wrt_outer]
    return ir.Model(copy, ir_version=10), feeds, wrt, seed_inputs


def _infer_outputs(graph: ir.Graph) -> None:
    """Types and shapes for ``graph``'s values from its inputs' (a subgraph's own values are
    untyped until inferred here, e.g. a Scan body whose inputs ONNX types from the Scan's)."""
    from gradgen.passes import ShapeInferencePass

    try:
        ShapeInferencePass()(ir.Model(graph, ir_version=10))
    except ModelError:  # the pipeline's own inference reports it with the node's name
        pass


def _drop_unit_products(model: ir.Model, seeds: list[ir.Value]) -> None:
    """Read each seed where its loss term's gradient multiplies it by ones: Mul(Expand(1, shape of
    the output), seed) is the seed itself (the seed has the output's shape), so the gradient of
    the output is the seed, with no Expand and Mul recomputed at each run."""
    for seed in seeds:
        for use in list(seed.uses()):
            node = use.node
            other = node.inputs[1 - use.idx] if node.op_type == "Mul" and len(node.inputs) == 2 else None
            expand = other.producer() if other is not None else None
            if expand is None or expand.op_type != "Expand" or not _is_one(expand.inputs[0]):
                continue
            ir.convenience.replace_all_uses_with(node.outputs[0], seed, replace_graph_outputs=True)


def _is_one(value: ir.Value | None) -> bool:
    known = None if value is None else value.const_value
    return known is not None and known.size == 1 and float(known.numpy().reshape(-1)[0]) == 1.0


def _place(
    b: GraphBuilder, model: ir.Model, feeds: list[tuple[ir.Value, ir.Value]], grads: list[ir.Value]
) -> tuple[list[ir.Node], list[ir.Value]]:
    """``model``'s nodes copied to read the values its inputs stand for, its initializers made
    Constant nodes, every name made unique through ``b``; and the copies of ``grads``."""
    value_map: dict[ir.Value, ir.Value | None] = dict(feeds)
    nodes = []
    for init in model.graph.initializers.values():
        if init in value_map:
            continue
        assert init.const_value is not None  # an initializer
        constant = ir.Node("", "Constant", [], [ir.AttrTensor("value", init.const_value)], name=b.unique(f"{b.prefix}/Constant"))
        value = constant.outputs[0]
        value.name, value.type, value.shape = b.unique(f"{b.prefix}/{init.name}"), init.type, init.shape
        value_map[init] = value
        nodes.append(constant)
    cloner = Cloner(attr_map={}, value_map=value_map, metadata_props={}, allow_outer_scope_values=True)
    for node in model.graph:
        copy = cloner.clone_node(node)
        rename_copied_node(copy, b.prefix, b.unique)
        nodes.append(copy)
    return nodes, [value_map.get(v) or v for v in grads]


def _outputs(b: GraphBuilder, nodes: list[ir.Node], grads: list[ir.Value], like: list[ir.Value]) -> list[ir.Value]:
    """``grads`` as a subgraph's outputs: each made by one of ``nodes`` and output once (an Identity
    otherwise), typed as the value of ``like`` it is the gradient of."""
    made = {v for n in nodes for v in n.outputs}
    outputs: list[ir.Value] = []
    for grad in grads:
        if grad not in made or grad in outputs:
            grad = b.op("Identity", grad)
        outputs.append(grad)
    _type_like(outputs, like)
    return outputs


def _type_like(values: list[ir.Value], like) -> None:
    for value, other in zip(values, like):
        value.type = other.type
        value.shape = ir.Shape(other.shape) if other.shape is not None else None


def _where(node: ir.Node) -> str:
    return f"node {node.name or '<unnamed>'!r} ({node.op_type})"


def _element(b: GraphBuilder, stack: ir.Value, index: ir.Value, like: ir.Value) -> ir.Value:
    """stack[index], typed as ``like`` (a body's input or output)."""
    element = b.op("Gather", stack, index, axis=0)
    _type_like([element], [like])
    return element


def _like(b: GraphBuilder, value: ir.Value, name: str) -> ir.Value:
    """A new subgraph input of ``value``'s type and shape."""
    return ir.Value(name=b.unique(name), type=value.type, shape=ir.Shape(value.shape) if value.shape is not None else None)


def _save_iterations(g: GradContext, node: ir.Node, body: ir.Graph) -> tuple[ir.Value, list[ir.Value]]:
    """The forward Loop made to output each iteration's number (int64 [n]) and loop-carried inputs
    ([n, ...] each) as scan outputs: its body outputs an Identity of each."""
    name = node.name or "Loop"
    saved_inputs = [*body.inputs[:1], *body.inputs[2:]]
    count = len(node.outputs)
    node.resize_outputs(count + len(saved_inputs))
    stacks = list(node.outputs[count:])
    for value, stack in zip(saved_inputs, stacks):
        saved = ir.Node("", "Identity", [value], name=g.unique(f"{name}/save"))
        element = saved.outputs[0]
        element.name, element.type = g.unique(f"{name}/saved_{value.name}"), value.type
        element.shape = ir.Shape(value.shape) if value.shape is not None else None
        body.append(saved)
        body.outputs.append(element)
        stack.name, stack.type = g.unique(f"{name}_saved_{value.name}"), value.type
        stack.shape = ir.Shape([None, *value.shape]) if value.shape is not None else None
    return stacks[0], stacks[1:]
