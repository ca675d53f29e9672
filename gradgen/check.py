"""Gradient checking: compare gradgen's backward graph with finite differences of the forward model.

``check_gradients`` makes a float64 copy of the model (``to_float64``), builds the backward graph of
that copy, runs it, and compares every gradient ``g`` of a tensor ``x`` with central differences of
the forward model, also in float64:

- along ``samples`` random unit directions ``v`` (for every tensor):
  ``(L(x + eps v) - L(x - eps v)) / (2 eps)`` against ``<g, v>``;
- element by element for tensors of at most ``ELEMENTWISE_LIMIT`` elements.

``L`` is the loss; for a non-scalar loss output (a vector-Jacobian product) it is ``sum(u * y)`` with
a fixed random cotangent ``u``, the same ``u`` fed to the backward graph as ``<loss>_grad``.

A tensor passes when every error is at most ``atol + rtol * scale``, where ``scale`` is the size of
what is compared: ``max(|g|_2, max |directional difference|)`` for directions, and the largest
|finite difference| for elements.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import RunError, UsageError
from gradgen.executor.low_precision import is_float_dtype
from gradgen.model_io import ModelLike, external_tensors_inline, load_model, proto_subgraphs
from gradgen.names import unique_name, value_names
from gradgen.text_table import format_table

ELEMENTWISE_LIMIT = 64
_FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
_LOW_FLOAT_TYPES = _FLOAT_TYPES - {TensorProto.DOUBLE}


def _graph_gradient_of_records(proto: onnx.ModelProto) -> None:
    """Set aside PyTorch's records that change a node's gradient from the graph's (an embedding's
    ``padding_idx`` / ``scale_grad_by_freq``, a ``detach``; gradgen/grads/torch_records.py) in
    ``proto`` (the copy being checked), in every graph and function, with a note: gradgen's gradient
    follows them, as PyTorch's autograd does, and the graph's finite differences cannot see them, so
    the check compares the graph's own gradient of those nodes. A record keeps its FX name (so its
    readers' records still find it) and loses its call."""
    from gradgen.grads.torch_records import FX_CALL_KEY, changes_the_gradient

    set_aside = []

    def visit(nodes) -> None:
        for index, node in enumerate(nodes):
            for graph in proto_subgraphs(node):
                visit(graph.node)
            if node.domain not in ("", "ai.onnx"):
                continue
            for entry in node.metadata_props:
                if entry.key == FX_CALL_KEY and changes_the_gradient(node.op_type, entry.value):
                    entry.value = entry.value.partition(" = ")[0] + " = (set aside by gradgen check)"
                    set_aside.append(f"{node.name or f'{node.op_type}_{index}'!r} ({node.op_type})")

    visit(proto.graph.node)
    for function in proto.functions:
        visit(function.node)
    if set_aside:
        warnings.warn(
            f"{len(set_aside)} node(s) ({', '.join(set_aside[:3])}{', ...' if len(set_aside) > 3 else ''}) carry PyTorch's "
            "record of an embedding's padding_idx / scale_grad_by_freq (Gather) or of a detach (Identity), which "
            "gradgen's gradient follows and finite differences of the graph cannot see: the check compares the "
            "graph's own gradient of those nodes",
            stacklevel=3,
        )


# -- a float64 copy of a model -------------------------------------------------------------------


def to_float64(model: ModelLike) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64: every float tensor, type and cast becomes double.

    Converts initializers, graph input / output / value_info element types, Cast ``to`` and other
    ``dtype`` attributes naming a float type, and float tensors held in attributes (Constant,
    ConstantOfShape, ...); Constant's ``value_float(s)`` become double tensors. Subgraphs are
    converted too. Inputs that the ONNX schema keeps float32 and that only parametrise their op
    (Resize's and Upsample's ``scales``, NonMaxSuppression's thresholds, ...) get a Cast back to
    float32, so the copy stays a valid model. The input model is not modified.
    """
    if isinstance(model, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(model)
    else:
        loaded = load_model(model)
        with external_tensors_inline(loaded):  # their data, not a reference to the input's data file
            proto = ir.to_proto(loaded)
    _graph_to_float64(proto.graph)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is not None:
        _keep_float32_inputs(proto.graph, opset)
    for function in proto.functions:
        for node in function.node:
            _node_to_float64(node)
        for value in function.value_info:
            _type_to_float64(value.type)
    return proto


def _tensor_to_float64(tensor: TensorProto) -> None:
    if tensor.data_type not in _LOW_FLOAT_TYPES:
        return
    array = numpy_helper.to_array(tensor).astype(np.float64)
    converted = numpy_helper.from_array(array, tensor.name)
    converted.doc_string = tensor.doc_string
    tensor.CopyFrom(converted)


def _type_to_float64(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        inner = getattr(type_proto, kind)
        if inner.elem_type in _LOW_FLOAT_TYPES:
            inner.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type_to_float64(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _type_to_float64(type_proto.optional_type.elem_type)
    elif kind == "map_type":
        _type_to_float64(type_proto.map_type.value_type)


def _graph_to_float64(graph: onnx.GraphProto) -> None:
    for tensor in graph.initializer:
        _tensor_to_float64(tensor)
    for sparse in graph.sparse_initializer:
        _tensor_to_float64(sparse.values)
    for value in [*graph.input, *graph.output, *graph.value_info]:
        _type_to_float64(value.type)
    for node in graph.node:
        _node_to_float64(node)


# Attributes that name an element type the node computes in: Cast's target, a generator's dtype,
# Attention's softmax_precision (a float32 softmax inside a float64 check would round away the
# finite differences).
_TYPE_ATTRIBUTES = ("to", "dtype", "softmax_precision")


def _node_to_float64(node: onnx.NodeProto) -> None:
    attrs = list(node.attribute)
    for attr in attrs:
        if attr.type == onnx.AttributeProto.INT and attr.name in _TYPE_ATTRIBUTES and attr.i in _LOW_FLOAT_TYPES:
            attr.i = TensorProto.DOUBLE
        elif attr.type == onnx.AttributeProto.TENSOR:
            _tensor_to_float64(attr.t)
        elif attr.type == onnx.AttributeProto.TENSORS:
            for tensor in attr.tensors:
                _tensor_to_float64(tensor)
        elif attr.type == onnx.AttributeProto.GRAPH:
            _graph_to_float64(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            for sub in attr.graphs:
                _graph_to_float64(sub)
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx") and not any(a.name == "value" for a in attrs):
        # without a value it makes float32 zeros
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float64))))
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        for attr in attrs:
            if attr.name in ("value_float", "value_floats"):
                data = np.asarray(attr.f if attr.name == "value_float" else list(attr.floats), dtype=np.float64)
                node.attribute.remove(attr)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(data)))


def _keep_float32_inputs(graph: onnx.GraphProto, opset: int) -> None:
    """Give float32 back to the inputs whose schema forbids double (see ``_float32_only_inputs``).

    An initializer or Constant used only there is stored as float32 again (it keeps its name, so
    messages about it still make sense); any other value gets a Cast to float32 in front of the use.
    """
    for node in graph.node:
        for sub in proto_subgraphs(node):
            _keep_float32_inputs(sub, opset)
    uses: dict[str, list[bool]] = {}
    for node in graph.node:
        keep = _float32_only_inputs(node.op_type, node.domain, opset)
        for position, name in enumerate(node.input):
            uses.setdefault(name, []).append(position in keep)
    outputs = {v.name for v in graph.output}
    restored = {name for name, kept in uses.items() if all(kept) and name not in outputs}
    for tensor in graph.initializer:
        if tensor.name in restored and tensor.data_type == TensorProto.DOUBLE:
            _tensor_to_float32(tensor)
    for value in [*graph.input, *graph.value_info]:
        if value.name in restored and value.type.tensor_type.elem_type == TensorProto.DOUBLE:
            value.type.tensor_type.elem_type = TensorProto.FLOAT
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output[0] in restored:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.DOUBLE:
                    _tensor_to_float32(attr.t)
    sources = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    taken = {name for node in graph.node for name in (*node.input, *node.output)}
    taken |= {v.name for v in graph.input} | {t.name for t in graph.initializer}
    casts: dict[str, str] = {}
    nodes = []
    for node in graph.node:
        for position in _float32_only_inputs(node.op_type, node.domain, opset):
            source = node.input[position] if position < len(node.input) else ""
            if not source or (source in restored and source in sources):
                continue
            if source not in casts:
                casts[source] = unique_name(f"{source}_float32", taken)
                nodes.append(
                    helper.make_node(
                        "Cast", [source], [casts[source]], to=TensorProto.FLOAT, name=unique_name(f"{source}_to_float32", taken)
                    )
                )
            node.input[position] = casts[source]
        nodes.append(node)
    if casts:
        del graph.node[:]
        graph.node.extend(nodes)


def _tensor_to_float32(tensor: TensorProto) -> None:
    converted = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
    converted.doc_string = tensor.doc_string
    tensor.CopyFrom(converted)


@functools.lru_cache(maxsize=None)
def _float32_only_inputs(op_type: str, domain: str, opset: int) -> tuple[int, ...]:
    """Input positions of a standard op that must be float32 (or narrower) and set no output's type."""
    if domain not in ("", "ai.onnx"):
        return ()
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return ()
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    output_types = {formal.type_str for formal in schema.outputs}
    positions = []
    for position, formal in enumerate(schema.inputs):
        types = allowed.get(formal.type_str, {formal.type_str})
        if (
            "tensor(float)" in types
            and "tensor(double)" not in types
            and formal.type_str not in output_types
            and all(t in _NARROW_FLOAT_TYPE_STRS for t in types)
        ):
            positions.append(position)
    return tuple(positions)


_NARROW_FLOAT_TYPE_STRS = {"tensor(float)", "tensor(float16)", "tensor(bfloat16)"}


# -- the check ----------------------------------------------------------------------------------


@dataclasses.dataclass
class TensorCheck:
    """The comparison for one differentiated tensor."""

    name: str
    shape: tuple[int, ...]
    method: str  # e.g. "3 directions + 12 elements"
    max_abs_err: float
    max_rel_err: float
    tolerance: float
    passed: bool
    note: str = ""
    kink: bool = False  # a failure where the loss is not differentiable (one-sided differences disagree)


@dataclasses.dataclass
class CheckReport:
    """The result of ``check_gradients``: one ``TensorCheck`` per differentiated tensor."""

    loss: str
    tensors: list[TensorCheck]
    samples: int
    eps: float
    rtol: float
    atol: float

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.tensors)

    @property
    def failures(self) -> list[str]:
        return [t.name for t in self.tensors if not t.passed]

    def format(self) -> str:
        header = ("tensor", "shape", "compared", "max abs err", "max rel err", "tolerance", "verdict")
        rows = [
            (
                t.name,
                str(list(t.shape)),
                t.method,
                f"{t.max_abs_err:.3g}",
                f"{t.max_rel_err:.3g}",
                f"{t.tolerance:.3g}",
                ("PASS" if t.passed else "FAIL") + (f" ({t.note})" if t.note else ""),
            )
            for t in self.tensors
        ]
        return format_table(header, rows)


def check_gradients(
    model: ModelLike,
    *,
    loss: str | None = None,
    wrt: Sequence[str] | None = None,
    freeze: Sequence[str] = (),
    wrt_inputs: bool = False,
    inputs: Mapping[str, np.ndarray] | str | os.PathLike | None = None,
    random_inputs: bool = False,
    seed: int = 0,
    dims: Mapping[str, int] | None = None,
    samples: int = 3,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    eps: float = 1e-6,
    device: str = "cpu",
    elementwise_limit: int = ELEMENTWISE_LIMIT,
) -> CheckReport:
    """Build the backward graph of ``model`` in float64 and compare it with finite differences.

    Each tensor is compared along ``samples`` random directions, and element by element where it
    has at most ``elementwise_limit`` elements (0: directions only, which a sweep over many small
    models may prefer: a wrong gradient shows along almost every direction).

    ``inputs`` is a mapping or an .npz path (float arrays are converted to float64);
    ``random_inputs`` draws the inputs not given (as ``gradgen run --random-inputs`` does).
    Raises the usual ``GradgenError``s for bad models or inputs; a failed comparison is reported in
    the returned ``CheckReport`` (``report.passed`` is False), not raised.
    """
    from gradgen.api import build_backward
    from gradgen.executor import Session
    from gradgen.inputs import load_npz, random_feeds, tell_drawn

    if samples < 0:
        raise UsageError(f"--samples {samples}: expected a non-negative number of directions")
    if not eps > 0:
        raise UsageError(f"eps {eps}: expected a positive step")
    if not isinstance(model, onnx.ModelProto):
        model = load_model(model)  # once: the float64 copy and the check of given inputs read it
    proto = to_float64(_in_gradient_opset(model))
    _graph_gradient_of_records(proto)
    forward = ir.from_proto(proto)
    graph_inputs = [name for name in value_names(forward.graph.inputs) if name not in forward.graph.initializers]
    if not random_inputs and inputs is None and graph_inputs:
        raise UsageError(f"the model has inputs ({', '.join(graph_inputs)}); pass --inputs FILE.npz or --random-inputs")
    built = build_backward(proto, loss=loss, wrt=wrt, freeze=freeze, wrt_inputs=wrt_inputs)
    loss_name, wrt_names = built.loss, list(built.wrt)

    feeds: dict[str, np.ndarray] = {}
    given = {}
    if inputs is not None:
        given = load_npz(inputs) if isinstance(inputs, (str, os.PathLike)) else dict(inputs)
        _check_given_inputs(model, given, complete=not random_inputs)
    if random_inputs:
        feeds.update(random_feeds(forward, seed=seed, dims=dims, given=given))
        if inputs is not None:
            tell_drawn(feeds, str(inputs) if isinstance(inputs, (str, os.PathLike)) else "the given inputs")
    declared = {v.name: v.dtype for v in forward.graph.inputs if v.dtype is not None}
    feeds.update({k: _as_declared_float(np.asarray(v), declared.get(k)) for k, v in given.items()})

    # The forward model for finite differences: the differentiated initializers become inputs.
    initial = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer if t.name in wrt_names}
    fd_proto = _initializers_as_inputs(proto, set(initial))
    fd_session = Session(fd_proto, device=device)
    grad_session = Session(built.model, device=device)

    rng = np.random.default_rng(seed + 1)
    base = {**initial, **feeds}  # a fed value overrides an initializer that is also a graph input
    probe = fd_session.run(base, outputs=[loss_name])[loss_name]
    if not np.all(np.isfinite(probe)):
        raise RunError(
            f"the loss {loss_name!r} is not finite at these inputs ({_summary(probe)}; inputs: "
            f"{_describe(feeds) or 'none'}), so its gradient cannot be checked there; "
            "choose other inputs (--inputs, or another --seed or --dim)"
        )
    _check_declared_shape(forward, loss_name, probe.shape)
    cotangent = None
    grad_feeds = dict(feeds)
    seed_name = f"{loss_name}_grad"
    if seed_name in grad_session.input_names:  # a vector-Jacobian product: L = sum(u * y)
        cotangent = rng.uniform(0.5, 1.5, probe.shape) * rng.choice([-1.0, 1.0], probe.shape)
        grad_feeds[seed_name] = cotangent.astype(_declared_dtype(built.model, seed_name, probe.dtype))
    results = grad_session.run(grad_feeds)

    def objective(overrides: dict[str, np.ndarray]) -> float:
        y = fd_session.run({**base, **overrides}, outputs=[loss_name])[loss_name].astype(np.float64)
        if y.shape != probe.shape:  # OneHot's depth, Range's limits, Unique's values given as floats
            raise RunError(
                f"the shape of {loss_name!r} changes from {list(probe.shape)} to {list(y.shape)} when "
                f"{', '.join(map(repr, overrides))} moves by {eps:g}: its gradient is not defined at these inputs"
            )
        return float(np.sum(y * cotangent)) if cotangent is not None else float(np.sum(y))

    checks = []
    for name, grad_name in zip(wrt_names, built.gradient_names):
        x = np.asarray(base[name], dtype=np.float64)
        got = np.asarray(results[grad_name])
        if got.shape != x.shape:
            checks.append(
                TensorCheck(name, x.shape, "-", float("inf"), float("inf"), 0.0, False, f"gradient shape {list(got.shape)}")
            )
            continue
        checks.append(_check_tensor(name, x, got.astype(np.float64), objective, rng, samples, eps, rtol, atol, elementwise_limit))
    return CheckReport(loss_name, checks, samples, eps, rtol, atol)


def _check_declared_shape(model: ir.Model, name: str, shape: tuple[int, ...]) -> None:
    """A loss whose shape at these inputs differs from the static one the model declares (a
    Compress's condition, Range's limits, drawn at random) is a RunError saying so: its backward
    graph takes a seed of the declared shape."""
    value = next((v for v in model.graph.outputs if v.name == name), None)
    declared = None if value is None or value.shape is None else list(value.shape)
    if declared is None or len(declared) != len(shape):
        return
    if any(isinstance(want, int) and want != have for want, have in zip(declared, shape)):
        raise RunError(
            f"the loss {name!r} has shape {list(shape)} at these inputs, but the model declares "
            f"{[d if isinstance(d, int) else str(d) for d in declared]}: its shape follows the inputs' values; "
            "pass inputs that give the declared shape (--inputs)"
        )


def _in_gradient_opset(model: ModelLike) -> ModelLike:
    """``model`` as build-backward converts it where its opset is older than the gradient rules'
    (before the float64 copy: the converter writes Clip-6's bounds as float32 constants)."""
    from gradgen.passes.standard import MIN_OPSET, converted_below

    if isinstance(model, onnx.ModelProto):  # a current one is passed on without deserialising its graph
        if next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), MIN_OPSET) >= MIN_OPSET:
            return model
    return converted_below(load_model(model), MIN_OPSET)


def _declared_dtype(model: ir.Model, name: str, default: np.dtype) -> np.dtype:
    """The element type the backward graph declares for its input ``name`` (the seed keeps the
    float64 copy's type where a kernel computes the output in float32: LayerNormalization's Mean)."""
    for value in model.graph.inputs:
        if value.name == name and value.dtype is not None:
            return value.dtype.numpy()
    return default


def _summary(value: np.ndarray) -> str:
    if value.size == 1:
        return f"it is {float(value.reshape(-1)[0])}"
    return f"{int(np.count_nonzero(~np.isfinite(value)))} of its {value.size} elements are not finite"


def _describe(feeds: Mapping[str, np.ndarray]) -> str:
    return ", ".join(f"{name} {value.dtype}{list(value.shape)}" for name, value in feeds.items())


@dataclasses.dataclass
class _Comparison:
    """One finite-difference comparison (a direction or an element): central and one-sided differences."""

    analytic: float
    central: float
    forward: float  # (L(x + eps v) - L(x)) / eps
    backward: float  # (L(x) - L(x - eps v)) / eps

    def error(self) -> float:
        return abs(self.central - self.analytic)

    def at_kink(self, tol: float) -> bool:
        """The loss has a kink within eps: the one-sided differences disagree and the gradient is one
        side's or between them.

        Smooth functions make the two sides differ by about eps * |L''|; the gradient of a
        non-smooth op is the derivative from one side (Relu at 0, Max at a tie) or a share of it
        (ReduceMin's gradient split among tied elements).
        """
        gap = abs(self.forward - self.backward)
        slack = max(tol, 0.01 * gap)
        nearest = min(abs(self.analytic - self.forward), abs(self.analytic - self.backward))
        between = min(self.forward, self.backward) - slack <= self.analytic <= max(self.forward, self.backward) + slack
        return bool(gap > tol and (nearest <= slack or between))


def _check_tensor(name, x, grad, objective, rng, samples, eps, rtol, atol, elementwise_limit=ELEMENTWISE_LIMIT) -> TensorCheck:
    center = objective({})
    groups, parts = [], []  # (comparisons, scale) per kind

    def compare(shifted_plus, shifted_minus, analytic) -> _Comparison:
        plus, minus = objective({name: shifted_plus}), objective({name: shifted_minus})
        return _Comparison(analytic, (plus - minus) / (2 * eps), (plus - center) / eps, (center - minus) / eps)

    if x.size and samples:
        directions = []
        for _ in range(samples):
            v = rng.standard_normal(x.shape)
            v /= np.linalg.norm(v)
            directions.append(compare(x + eps * v, x - eps * v, float(np.sum(grad * v))))
        scale = max(float(np.linalg.norm(grad)), max(abs(c.central) for c in directions))
        groups.append((directions, scale))
        parts.append(f"{samples} direction{'s' if samples != 1 else ''}")
    if 0 < x.size <= elementwise_limit:
        elements = []
        flat, analytic = x.reshape(-1), grad.reshape(-1)
        for j in range(x.size):
            plus, minus = flat.copy(), flat.copy()
            plus[j] += eps
            minus[j] -= eps
            elements.append(compare(plus.reshape(x.shape), minus.reshape(x.shape), float(analytic[j])))
        groups.append((elements, max(abs(c.central) for c in elements)))
        parts.append(f"{x.size} element{'s' if x.size != 1 else ''}")
    abs_err, rel_err, tolerance, passed, kinks, non_finite = 0.0, 0.0, atol, True, 0, False
    for comparisons, scale in groups:
        tol = atol + rtol * scale
        for c in comparisons:
            err = c.error()
            non_finite = non_finite or not np.isfinite(err)
            abs_err = max(abs_err, err)
            rel_err = max(rel_err, err / scale if scale > 0 else (0.0 if err == 0 else float("inf")))
            if not err <= tol:
                passed = False
                kinks += c.at_kink(tol)
        tolerance = max(tolerance, tol)
    notes = []
    if not np.all(np.isfinite(grad)):
        passed = False
        notes.append("non-finite gradient")
    elif non_finite:
        notes.append("the loss is not finite near these inputs")
    if kinks:
        notes.append(
            f"at a kink: {kinks} failed comparison(s) where the one-sided differences disagree "
            "and the gradient is one side or between them"
        )
    return TensorCheck(
        name,
        x.shape,
        " + ".join(parts) or "nothing (empty)",
        abs_err,
        rel_err,
        tolerance,
        passed,
        "; ".join(notes),
        kink=bool(kinks),
    )


def _check_given_inputs(model: ModelLike, given: Mapping[str, np.ndarray], complete: bool) -> None:
    """The given inputs against the user's model, as ``gradgen run`` checks them (its names, types
    and shapes: not the float64 copy's, whose differentiated initializers are inputs too; any
    float type for a float input); with ``complete`` False (random inputs fill the rest) only the
    given ones."""
    from gradgen.executor.session import check_feeds, feed_specs

    graph = load_model(model).graph
    specs = feed_specs([v for v in graph.inputs if v.name not in graph.initializers])
    if not complete:
        unknown = sorted(set(given) - {spec.name for spec in specs})
        if unknown:
            names = ", ".join(repr(spec.name) for spec in specs) or "none"
            raise RunError(f"unknown input(s) {', '.join(map(repr, unknown))}; the model's inputs are {names}")
        specs = [spec for spec in specs if spec.name in given]
    declared = {spec.name: spec.dtype for spec in specs}

    def as_checked(name: str, array) -> np.ndarray:  # any float type is taken (the check converts it)
        array, want = np.asarray(array), declared.get(name)
        return array.astype(want) if want is not None and is_float_dtype(want) and is_float_dtype(array.dtype) else array

    check_feeds(specs, {name: as_checked(name, array) for name, array in given.items()})


def _as_declared_float(array: np.ndarray, dtype: ir.DataType | None) -> np.ndarray:
    """A float input (bfloat16 too) in the float type the float64 copy declares (float64, or float32
    for e.g. scales)."""
    if not is_float_dtype(array.dtype):
        return array
    want = np.dtype(dtype.numpy()) if dtype is not None and dtype.is_floating_point() else np.dtype(np.float64)
    return array.astype(want)


def _initializers_as_inputs(proto: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    """A copy of ``proto`` where the named initializers are graph inputs instead."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    graph = copy.graph
    kept = [t for t in graph.initializer if t.name not in names]
    moved = [t for t in graph.initializer if t.name in names]
    declared = {v.name for v in graph.input}
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for tensor in moved:
        if tensor.name not in declared:
            graph.input.append(helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims)))
    return copy


__all__ = ["CheckReport", "TensorCheck", "check_gradients", "to_float64"]
