"""Hypothesis strategies for the fuzz tests: random small differentiable graphs, and random one-node
kernel cases to compare with onnxruntime.

``graphs()`` draws a ``FuzzGraph``: 2-6 steps, each one op from the supported differentiable ops
(elementwise unary / binary with random broadcastable shapes, reductions with random axes and
keepdims, Softmax / LogSoftmax, Transpose / Reshape / Concat / Slice / Gather / Squeeze / Unsqueeze,
MatMul), in float64 with random attributes, ending in ``loss = sum_k sum(w_k * y_k)``. Inputs stay
away from domains and kinks: Log / Sqrt / Reciprocal / Div's denominator / Pow's base see
``x * x + 1``, Exp sees ``tanh(x)``; kinks (Relu, Abs, LeakyRelu, ReduceL1 at 0; Max / Min /
ReduceMax / ReduceMin ties) are recorded, and ``FuzzGraph.margins_ok`` rejects draws whose values
lie within ``MARGIN`` of one.

Array values come from a drawn seed (numpy), shapes and attributes from hypothesis, so a failure
shrinks to a small graph and ``FuzzGraph.describe()`` prints it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from gradgen.executor import Session

MARGIN = 1e-3
# Graphs whose tensors become empty (a Slice to nothing) are kept: they once exposed a builder bug
# (Reshape to a shape holding 0 without allowzero=1), now fixed and pinned by regression tests.
ALLOW_EMPTY = True
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min

SMOOTH_UNARY = ["Neg", "Tanh", "Sigmoid", "Softplus", "Erf", "Sin", "Cos", "Atan", "Softsign", "Identity"]
KINK_UNARY = ["Relu", "Abs", "LeakyRelu"]
POSITIVE_UNARY = ["Log", "Sqrt", "Reciprocal"]
BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"]
REDUCTIONS = [
    "ReduceSum",
    "ReduceMean",
    "ReduceMax",
    "ReduceMin",
    "ReduceProd",
    "ReduceL2",
    "ReduceL1",
    "ReduceLogSumExp",
    "ReduceSumSquare",
]
STEPS = [
    "unary",
    "unary",
    "binary",
    "binary",
    "reduce",
    "softmax",
    "transpose",
    "reshape",
    "concat",
    "slice",
    "gather",
    "matmul",
    "unsqueeze",
    "squeeze",
]


@dataclasses.dataclass
class FuzzGraph:
    nodes: list[onnx.NodeProto]
    inputs: dict[str, np.ndarray]  # float64 graph inputs, all differentiated
    consts: dict[str, np.ndarray]  # initializers: weights, indices, shapes, axes
    intermediates: list[str]
    kinks: list[tuple]  # ("zero", name) | ("tie", a, b) | ("reduce_tie", name, axes or None)
    opset: int
    symbolic: bool

    def model(self, outputs: list[str] | None = None, dtype: Any = np.float64) -> onnx.ModelProto:
        """The graph in float64, or with every float input and constant in ``dtype``."""
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        graph_inputs = []
        for name, array in self.inputs.items():
            dims = [f"{name}_{i}" for i in range(array.ndim)] if self.symbolic else list(array.shape)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, dims))
        if outputs is None:
            graph_outputs = [helper.make_tensor_value_info("loss", elem, [])]
        else:
            graph_outputs = [helper.make_value_info(name, onnx.TypeProto()) for name in outputs]
        consts = {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in self.consts.items()}
        graph = helper.make_graph(
            self.nodes,
            "fuzz",
            graph_inputs,
            graph_outputs,
            initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)

    def margins_ok(self) -> bool:
        """Every intermediate finite and moderate, and no kink input within MARGIN of its kink."""
        values = Session(self.model(self.intermediates + ["loss"])).run(self.inputs)
        values.update(self.inputs)
        if not all(np.all(np.isfinite(v)) and np.all(np.abs(v) < 1e6) for v in values.values()):
            return False
        if not ALLOW_EMPTY and any(v.size == 0 for v in values.values()):
            return False
        for kink in self.kinks:
            if kink[0] == "zero" and np.any(np.abs(values[kink[1]]) < MARGIN):
                return False
            if kink[0] == "tie":
                a, b = np.broadcast_arrays(values[kink[1]], values[kink[2]])
                if np.any(np.abs(a - b) < MARGIN):
                    return False
            if kink[0] == "reduce_tie":
                x, axes = values[kink[1]], kink[2]
                axes = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)
                rest = [a for a in range(x.ndim) if a not in axes]
                # explicit sizes: reshape(0, -1) of an empty tensor cannot infer the -1
                kept, reduced = (int(np.prod([x.shape[a] for a in group])) for group in (rest, axes))
                flat = np.transpose(x, rest + list(axes)).reshape(kept, reduced)
                if flat.shape[1] > 1:
                    top = np.sort(flat, axis=1)
                    if np.any(top[:, -1] - top[:, -2] < MARGIN) or np.any(top[:, 1] - top[:, 0] < MARGIN):
                        return False
        return True

    def __repr__(self) -> str:
        return "FuzzGraph:\n" + self.describe()

    def describe(self) -> str:
        lines = [f"opset {self.opset}, symbolic {self.symbolic}"]
        lines += [f"input {k}: {list(v.shape)}" for k, v in self.inputs.items()]
        lines += [
            f"const {k}: {list(v.shape)} {v.dtype}" + (f" = {v.tolist()}" if v.size <= 8 else "") for k, v in self.consts.items()
        ]
        for node in self.nodes:
            attrs = ", ".join(f"{a.name}={helper.get_attribute_value(a)}" for a in node.attribute)
            lines.append(f"{', '.join(node.output)} = {node.op_type}({', '.join(node.input)}){' ' + attrs if attrs else ''}")
        return "\n".join(lines)


class _Builder:
    def __init__(self, draw, rng: np.random.Generator, opset: int, symbolic: bool):
        self.draw, self.rng, self.opset, self.symbolic = draw, rng, opset, symbolic
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: dict[str, np.ndarray] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.pool: list[tuple[str, tuple[int, ...]]] = []
        self.intermediates: list[str] = []
        self.kinks: list[tuple] = []
        self.count = itertools.count()

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self.count)}"

    def new_input(self, shape) -> str:
        name = self.name("x")
        self.inputs[name] = self.rng.standard_normal(tuple(shape))
        return name

    def const(self, value, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.consts[name] = np.asarray(value)
        return name

    def op(self, op_type: str, inputs: list[str], shape, **attrs) -> str:
        out = self.name("t")
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=f"n_{out}", **attrs))
        self.intermediates.append(out)
        self.pool.append((out, tuple(shape)))
        return out

    def positive(self, x: str, shape) -> str:
        """x * x + 1: positive and smooth."""
        sq = self.op("Mul", [x, x], shape)
        return self.op("Add", [sq, self.const(np.array(1.0))], shape)

    def pick(self) -> tuple[str, tuple[int, ...]]:
        if self.draw(st.booleans()):
            return self.pool[-1]
        return self.pool[self.draw(st.integers(0, len(self.pool) - 1))]


def _dims(draw, rank: int, low: int = 1, high: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(low, high), min_size=rank, max_size=rank)))


def _broadcast_partner(draw, shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A shape broadcastable with ``shape``, and the broadcast result."""
    if draw(st.booleans()):  # the partner is smaller: drop leading dims, set some to 1
        drop = draw(st.integers(0, len(shape)))
        other = tuple(1 if draw(st.booleans()) else d for d in shape[drop:])
        return other, tuple(shape)
    extra = _dims(draw, draw(st.integers(0, 1)))
    other = extra + tuple(draw(st.integers(1, 3)) if d == 1 else d for d in shape)
    return other, tuple(np.broadcast_shapes(other, tuple(shape)))


def _unary(draw, b: _Builder, x, shape):
    kind = draw(st.sampled_from(["smooth", "smooth", "kink", "positive", "exp"]))
    if kind == "smooth":
        return b.op(draw(st.sampled_from(SMOOTH_UNARY)), [x], shape)
    if kind == "kink":
        op = draw(st.sampled_from(KINK_UNARY))
        b.kinks.append(("zero", x))
        attrs = {"alpha": draw(st.sampled_from([0.01, 0.2, 1.5]))} if op == "LeakyRelu" else {}
        return b.op(op, [x], shape, **attrs)
    if kind == "positive":
        return b.op(draw(st.sampled_from(POSITIVE_UNARY)), [b.positive(x, shape)], shape)
    return b.op("Exp", [b.op("Tanh", [x], shape)], shape)


def _binary(draw, b: _Builder, x, shape):
    op = draw(st.sampled_from(BINARY))
    other_shape, out_shape = _broadcast_partner(draw, shape)
    other = b.new_input(other_shape)
    a, c, a_shape, c_shape = (x, other, shape, other_shape) if draw(st.booleans()) else (other, x, other_shape, shape)
    if op == "Div":
        c = b.positive(c, c_shape)
    elif op == "Pow":
        a = b.positive(a, a_shape)
    elif op in ("Max", "Min"):
        b.kinks.append(("tie", a, c))
    return b.op(op, [a, c], out_shape)


def _reduce(draw, b: _Builder, x, shape):
    op = draw(st.sampled_from(REDUCTIONS))
    rank = len(shape)
    keepdims = draw(st.sampled_from([0, 1]))
    if rank == 0 or draw(st.integers(0, 4)) == 0:
        axes = None
    else:
        chosen = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        axes = [a - rank if draw(st.booleans()) else a for a in chosen]
    reduced = set(range(rank)) if axes is None else {a % rank for a in axes}
    out_shape = (
        tuple(1 if i in reduced else d for i, d in enumerate(shape))
        if keepdims
        else tuple(d for i, d in enumerate(shape) if i not in reduced)
    )
    if op in ("ReduceMax", "ReduceMin"):
        b.kinks.append(("reduce_tie", x, axes))
    if op == "ReduceL1":
        b.kinks.append(("zero", x))
    if axes is None:
        return b.op(op, [x], out_shape, keepdims=keepdims)
    if op == "ReduceSum" or b.opset >= 18:
        return b.op(op, [x, b.const(np.array(axes, np.int64), "axes")], out_shape, keepdims=keepdims)
    return b.op(op, [x], out_shape, keepdims=keepdims, axes=axes)


def _softmax(draw, b: _Builder, x, shape):
    if not shape:
        return _unary(draw, b, x, shape)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return b.op(draw(st.sampled_from(["Softmax", "LogSoftmax"])), [x], shape, axis=axis)


def _transpose(draw, b: _Builder, x, shape):
    if len(shape) < 2 or draw(st.integers(0, 3)) == 0:
        return b.op("Transpose", [x], shape[::-1])
    perm = draw(st.permutations(range(len(shape))))
    return b.op("Transpose", [x], tuple(shape[p] for p in perm), perm=list(perm))


def _reshape(draw, b: _Builder, x, shape):
    total = int(np.prod(shape))
    if total == 0:  # 0 in a Reshape target copies a dim (allowzero=0): keep empty tensors away from Reshape
        return _unary(draw, b, x, shape)
    factors = [p for p in (2, 3, 5, 7) for _ in range(20) if total % p ** (_ + 1) == 0]
    if total // math.prod(factors) > 1:  # a prime factor above 7 (11 elements: the target was [1])
        factors.append(total // math.prod(factors))
    target, rest = [], list(factors)
    for _ in range(draw(st.integers(0, 3))):
        if not rest:
            target.append(1)
            continue
        k = draw(st.integers(1, len(rest)))
        target.append(int(np.prod(rest[:k])))
        rest = rest[k:]
    target.append(int(np.prod(rest)) if rest else 1)
    spec = list(target)
    if draw(st.booleans()):
        spec[draw(st.integers(0, len(spec) - 1))] = -1
    zeros = [i for i, d in enumerate(spec) if i < len(shape) and shape[i] == d]
    if zeros and draw(st.booleans()):
        spec[draw(st.sampled_from(zeros))] = 0
    return b.op("Reshape", [x, b.const(np.array(spec, np.int64), "shape")], tuple(target))


def _concat(draw, b: _Builder, x, shape):
    if not shape:
        return _binary(draw, b, x, shape)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    parts, total = [x], shape[axis]
    for _ in range(draw(st.integers(1, 2))):
        size = draw(st.integers(1, 3))
        other_shape = list(shape)
        other_shape[axis] = size
        parts.insert(draw(st.integers(0, len(parts))), b.new_input(other_shape))
        total += size
    out = list(shape)
    out[axis] = total
    return b.op("Concat", parts, out, axis=axis)


def _slice(draw, b: _Builder, x, shape):
    if not shape:
        return _unary(draw, b, x, shape)
    axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    starts, ends, steps, out = [], [], [], list(shape)
    for axis in axes:
        n = shape[axis]
        step = draw(st.sampled_from([1, 1, 2, -1, -2]))
        bound = st.one_of(st.integers(-n - 2, n + 2), st.sampled_from([INT64_MAX, INT64_MIN]))
        start, end = draw(bound), draw(bound)
        starts.append(start)
        ends.append(end)
        steps.append(step)
        out[axis] = slice_length(start, end, step, n)
    use_neg = draw(st.booleans())
    inputs = [
        x,
        b.const(np.array(starts, np.int64), "starts"),
        b.const(np.array(ends, np.int64), "ends"),
        b.const(np.array([a - len(shape) if use_neg else a for a in axes], np.int64), "axes"),
        b.const(np.array(steps, np.int64), "steps"),
    ]
    return b.op("Slice", inputs, out)


def slice_length(start: int, end: int, step: int, n: int) -> int:
    """The length of ONNX Slice's output along an axis of size n (the spec's clamping rules)."""
    start, end = start + n if start < 0 else start, end + n if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), n), min(max(end, 0), n)
    else:
        start, end = min(max(start, 0), n - 1), min(max(end, -1), n - 1)
    return len(range(start, end, step))


def _gather(draw, b: _Builder, x, shape):
    if not shape:
        return _unary(draw, b, x, shape)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    n = shape[axis]
    if n == 0:
        return _unary(draw, b, x, shape)
    idx_shape = _dims(draw, draw(st.integers(0, 2)), 1, 3)
    indices = np.array(
        draw(st.lists(st.integers(-n, n - 1), min_size=int(np.prod(idx_shape)), max_size=int(np.prod(idx_shape)))), np.int64
    ).reshape(idx_shape)
    a = axis % len(shape)
    out = tuple(shape[:a]) + idx_shape + tuple(shape[a + 1 :])
    return b.op("Gather", [x, b.const(indices, "idx")], out, axis=axis)


def _matmul(draw, b: _Builder, x, shape):
    if not shape:
        return _binary(draw, b, x, shape)
    n = draw(st.integers(1, 3))
    if len(shape) >= 2 and draw(st.booleans()):  # x on the right: (m, k) @ x with k = shape[-2]
        m = draw(st.integers(1, 3))
        other = b.new_input((m, shape[-2]))
        return b.op("MatMul", [other, x], tuple(shape[:-2]) + (m, shape[-1]))
    k = shape[-1]
    batch = tuple(shape[:-2])
    other_batch = batch[len(batch) - draw(st.integers(0, len(batch))) :] if batch else ()
    other_batch = tuple(1 if draw(st.booleans()) else d for d in other_batch)
    other = b.new_input(other_batch + (k, n))
    out = (tuple(np.broadcast_shapes(batch, other_batch)) + tuple(shape[-2:-1]) + (n,)) if len(shape) >= 2 else other_batch + (n,)
    return b.op("MatMul", [x, other], out)


def _unsqueeze(draw, b: _Builder, x, shape):
    rank = len(shape) + 1
    axis = draw(st.integers(-rank, rank - 1))
    out = list(shape)
    out.insert(axis % rank, 1)
    return b.op("Unsqueeze", [x, b.const(np.array([axis], np.int64), "axes")], out)


def _squeeze(draw, b: _Builder, x, shape):
    ones = [i for i, d in enumerate(shape) if d == 1]
    if not ones:
        return _unsqueeze(draw, b, x, shape)
    if not b.symbolic and draw(st.booleans()):  # without axes and with symbolic dims, the rank is unknown
        return b.op("Squeeze", [x], [d for d in shape if d != 1])
    axis = draw(st.sampled_from(ones))
    return b.op(
        "Squeeze", [x, b.const(np.array([axis - len(shape)], np.int64), "axes")], [d for i, d in enumerate(shape) if i != axis]
    )


_STEP = {
    "unary": _unary,
    "binary": _binary,
    "reduce": _reduce,
    "softmax": _softmax,
    "transpose": _transpose,
    "reshape": _reshape,
    "concat": _concat,
    "slice": _slice,
    "gather": _gather,
    "matmul": _matmul,
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
}


@st.composite
def graphs(draw, min_steps: int = 2, max_steps: int = 6, steps: list[str] | None = None) -> FuzzGraph:
    opset = draw(st.sampled_from([13, 17, 18]))
    b = _Builder(draw, np.random.default_rng(draw(st.integers(0, 2**32 - 1))), opset, draw(st.booleans()))
    first = b.new_input(_dims(draw, draw(st.integers(0, 3))))
    b.pool.append((first, tuple(b.inputs[first].shape)))
    for _ in range(draw(st.integers(min_steps, max_steps))):
        x, shape = b.pick()
        _STEP[draw(st.sampled_from(steps or STEPS))](draw, b, x, shape)
    # loss = sum_k sum(w_k * y_k) over the last tensor and maybe one more
    outs = [b.pool[-1]]
    if len(b.pool) > 2 and draw(st.booleans()):
        outs.append(b.pool[draw(st.integers(0, len(b.pool) - 2))])
    terms = []
    for name, shape in outs:
        w = b.const(b.rng.uniform(0.5, 1.5, shape), "w")
        prod = b.op("Mul", [name, w], shape)
        terms.append(b.op("ReduceSum", [prod], (), keepdims=0))
    b.nodes.append(helper.make_node("Sum", terms, ["loss"], name="loss_sum"))
    return FuzzGraph(b.nodes, b.inputs, b.consts, b.intermediates, b.kinks, opset, b.symbolic)


# -- one-node kernel cases, for comparisons with onnxruntime ----------------------------------


def single_node_inputs(arrays, fed: set[int], symbolic: bool = False):
    """The inputs of a one-node model: input i is named ``in{i}`` ("" where ``arrays[i]`` is None),
    a graph input when i is in ``fed`` (each dim a symbol ``in{i}_d{k}`` when ``symbolic``), else an
    initializer. Returns (node input names, graph inputs, initializers)."""
    names, graph_inputs, inits = [], [], []
    for i, array in enumerate(arrays):
        if array is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        array = np.asarray(array)
        if i in fed:
            dims = [f"{name}_d{k}" for k in range(array.ndim)] if symbolic else list(array.shape)
            graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims))
        else:
            inits.append(numpy_helper.from_array(array, name))
    return names, graph_inputs, inits


@dataclasses.dataclass
class KernelCase:
    op_type: str
    inputs: list[Any]  # numpy arrays (None: omitted optional input)
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    opset: int = 18
    num_outputs: int = 1
    const: tuple[int, ...] = ()  # inputs given as initializers (ORT wants some of them constant)

    def model(self) -> onnx.ModelProto:
        fed = {i for i in range(len(self.inputs)) if i not in self.const}
        names, graph_inputs, inits = single_node_inputs(self.inputs, fed)
        outputs = [f"out{k}" for k in range(self.num_outputs)]
        node = helper.make_node(self.op_type, names, outputs, name="node", **self.attrs)
        graph = helper.make_graph(
            [node], self.op_type, graph_inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outputs], initializer=inits
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)

    def feeds(self) -> dict[str, np.ndarray]:
        return {f"in{i}": np.asarray(a) for i, a in enumerate(self.inputs) if a is not None and i not in self.const}

    def describe(self) -> str:
        shapes = ", ".join(
            "None"
            if a is None
            else f"{np.asarray(a).dtype}{list(np.shape(a))}"
            + (f"={np.asarray(a).tolist()}" if np.size(a) <= 6 and np.asarray(a).dtype.kind in "iu" else "")
            for a in self.inputs
        )
        return f"{self.op_type}({shapes}) {self.attrs} opset {self.opset}"


def shapes(draw, rank_max: int = 3, low: int = 0, high: int = 3) -> tuple[int, ...]:
    """A shape whose dims may be 0 (empty) or 1."""
    return _dims(draw, draw(st.integers(0, rank_max)), low, high)


def float_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)
