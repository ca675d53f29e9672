"""Op-level differential fuzzing: one random node of every op with a gradient rule.

``op_cases(op)`` draws an ``OpCase`` for one op: random shapes (empty and size-1 dims where the op
allows them), attributes (pads, strides, dilations, ceil_mode, auto_pad, negative axes, keepdims,
every mode and reduction), broadcasting partners, the float dtype of the model (float32 or float64)
and, for every input, whether it is a graph input or an initializer. Values stay away from kinks
(ties of Max / ReduceMax / MaxPool / TopK, zeros of Relu / Abs / Sign, integers of Floor / Ceil,
bounds of Clip, ...) by construction, so finite differences see a smooth function.

``check_case`` then compares, for one case:

- the forward outputs with ONNX Runtime (in the case's dtype), unless the case says why not;
- the gradients of every differentiated float input (float64 copy of the model) with central
  finite differences (every element of small tensors, random directions of larger ones);
- those gradients with PyTorch's autograd on the same loss, where ``TORCH`` has the op;
- in float32 cases, the float32 backward graph's gradients (dtype, shape) with the float64 ones.

``check_case_on_cuda`` runs the same forward and backward graphs on gradgen's CUDA executor and
compares every output with the CPU executor.

The loss is ``sum_k sum(w_k * out_k)`` over the node's float outputs with fixed random weights.
A failure message holds ``OpCase.describe()``; a failure found here becomes a named regression
case in tests/test_fuzz.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import onnx
from hypothesis import assume
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session
from tests import fuzz_graphs as fg
from tests.grad_cases.elementwise import UNARY_SPECS

MARGIN = 0.02  # distance kept from every kink (finite differences step 1e-6)
INT64_MAX, INT64_MIN = fg.INT64_MAX, fg.INT64_MIN


@dataclasses.dataclass
class OpCase:
    op_type: str
    inputs: list[Any]  # numpy arrays (floats in float64, cast to ``dtype`` unless in ``keep``) or None
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    opset: int = 18
    dtype: Any = np.float64  # the float type of the model
    graph_inputs: frozenset[int] = frozenset()  # fed at run time; the other present inputs are initializers
    diff: tuple[int, ...] | None = None  # float inputs differentiated (None: every float input not in keep)
    keep: frozenset[int] = frozenset()  # float inputs kept in their own dtype and never differentiated
    num_outputs: int = 1
    symbolic: bool = False  # graph inputs get symbolic dims
    ort: str = ""  # why the forward is not compared with onnxruntime ("" compares it)
    ort_tolerance: float | None = None  # relative tolerance of the comparison, when not the dtype's
    torch: bool = True  # compare with PyTorch when TORCH has the op
    fd_rtol: float = 1e-5

    def __post_init__(self):
        self.inputs = [None if a is None else np.asarray(a) for a in self.inputs]

    # -- the models ---------------------------------------------------------------------------

    def differentiated(self) -> list[int]:
        if self.diff is not None:
            return list(self.diff)
        return [i for i, a in enumerate(self.inputs) if _is_float(a) and i not in self.keep]

    def arrays(self, dtype) -> list[Any]:
        return [
            None if a is None else (a.astype(dtype) if _is_float(a) and i not in self.keep else a)
            for i, a in enumerate(self.inputs)
        ]

    def feeds(self, dtype) -> dict[str, np.ndarray]:
        return {f"in{i}": a for i, a in enumerate(self.arrays(dtype)) if a is not None and i in self.graph_inputs}

    def _graph_parts(self, dtype):
        names, graph_inputs, inits = fg.single_node_inputs(self.arrays(dtype), set(self.graph_inputs), self.symbolic)
        while names and names[-1] == "":
            names.pop()
        outputs = [f"out{k}" for k in range(self.num_outputs)]
        node = helper.make_node(self.op_type, names, outputs, name="node", **self.attrs_for(dtype))
        return node, graph_inputs, inits, outputs

    def attrs_for(self, dtype) -> dict:
        """The attributes in a model of ``dtype``: a float64 model is a float64 copy, as `gradgen check`
        makes one (a Cast to a float type casts to double)."""
        attrs = dict(self.attrs)
        if np.dtype(dtype) == np.float64 and self.op_type == "Cast" and attrs["to"] in _FLOAT_TYPES:
            attrs["to"] = TensorProto.DOUBLE
        return attrs

    def _model(self, graph) -> onnx.ModelProto:
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)], ir_version=8)

    def forward_model(self, dtype=None) -> onnx.ModelProto:
        """The node alone, its outputs as graph outputs."""
        node, graph_inputs, inits, outputs = self._graph_parts(dtype or self.dtype)
        graph = helper.make_graph(
            [node], self.op_type, graph_inputs, [helper.make_value_info(o, onnx.TypeProto()) for o in outputs], initializer=inits
        )
        return self._model(graph)

    def loss_model(self, dtype, float_outputs: list[int]) -> onnx.ModelProto:
        """loss = sum_k sum(w_k * cast(out_k, dtype)) over the float outputs."""
        node, graph_inputs, inits, outputs = self._graph_parts(dtype)
        nodes, terms = [node], []
        for k in float_outputs:
            out = outputs[k]
            nodes.append(helper.make_node("Cast", [out], [f"c{k}"], to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype))))
            nodes.append(helper.make_node("Mul", [f"c{k}", f"w{k}"], [f"t{k}"]))
            nodes.append(helper.make_node("ReduceSum", [f"t{k}"], [f"s{k}"], keepdims=0))
            terms.append(f"s{k}")
        nodes.append(helper.make_node("Sum", terms, ["loss"]))
        weights = self.loss_weights(float_outputs)
        inits = inits + [numpy_helper.from_array(weights[k].astype(dtype), f"w{k}") for k in float_outputs]
        graph = helper.make_graph(
            nodes,
            self.op_type,
            graph_inputs,
            [helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [])],
            initializer=inits,
        )
        return self._model(graph)

    def loss_weights(self, float_outputs: list[int]) -> dict[int, np.ndarray]:
        if not hasattr(self, "_weights"):
            outs = Session(self.forward_model(np.float64)).run(self.feeds(np.float64))
            rng = np.random.default_rng(len(self.inputs) * 7919 + self.num_outputs)
            self._weights = {k: rng.uniform(0.5, 1.5, np.shape(outs[f"out{k}"])) for k in float_outputs}
        return self._weights

    def describe(self) -> str:
        parts = []
        for i, a in enumerate(self.inputs):
            if a is None:
                parts.append("None")
                continue
            kind = "input" if i in self.graph_inputs else "init"
            text = f"{kind} {a.dtype}{list(a.shape)}"
            if a.size <= 8:
                text += f"={np.asarray(a).tolist()}"
            parts.append(text)
        return (
            f"{self.op_type}({', '.join(parts)}) {self.attrs} opset {self.opset} dtype {np.dtype(self.dtype).name}"
            f"{' symbolic' if self.symbolic else ''} outputs {self.num_outputs} diff {self.differentiated()}"
        )


_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)


def _is_float(a) -> bool:
    return a is not None and np.asarray(a).dtype.kind == "f"


# -- value helpers ---------------------------------------------------------------------------


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def away(rng, shape, lo=-2.0, hi=2.0, kinks=(), margin=MARGIN) -> np.ndarray:
    """Uniform values in [lo, hi] at least ``margin`` from every kink point."""
    x = rng.uniform(lo, hi, shape)
    for k in kinks:
        near = np.abs(x - k) < margin
        x = np.where(near, k + np.where(x >= k, margin, -margin) * 2, x)
    return x


def distinct(rng, shape, spacing=0.05) -> np.ndarray:
    """Values at least ``spacing`` apart (no ties anywhere in the tensor)."""
    n = int(np.prod(shape))
    return ((rng.permutation(n) - n / 2) * spacing + rng.uniform(-0.01, 0.01)).reshape(shape)


def dims(draw, rank, low=1, high=3) -> tuple[int, ...]:
    return fg._dims(draw, rank, low, high)


def shape(draw, rank_min=0, rank_max=3, low=1, high=3, empty=False) -> tuple[int, ...]:
    """A shape; with ``empty`` one dim may be 0 (about one draw in six)."""
    s = list(dims(draw, draw(st.integers(rank_min, rank_max)), low, high))
    if empty and s and draw(st.integers(0, 5)) == 0:
        s[draw(st.integers(0, len(s) - 1))] = 0
    return tuple(s)


def placement(draw, present: list[int], always_init=()) -> frozenset[int]:
    """Which of the present inputs are graph inputs (the rest are initializers)."""
    return frozenset(i for i in present if i not in always_init and draw(st.booleans()))


def finish(draw, case: OpCase, symbolic_ok=True) -> OpCase:
    """Random dtype, symbolic dims where allowed, and at least something to differentiate."""
    case.dtype = draw(st.sampled_from([np.float32, np.float64]))
    case.symbolic = symbolic_ok and bool(case.graph_inputs) and draw(st.integers(0, 3)) == 0
    assume(case.differentiated())
    return case


def float_positions(inputs, keep=()) -> list[int]:
    return [i for i, a in enumerate(inputs) if _is_float(a) and i not in keep]


# -- elementwise ------------------------------------------------------------------------------


# op -> (low, high, kinks, attrs drawn by the function, opset)
def _no_attrs(draw):
    return {}


UNARY: dict[str, tuple] = {
    "Neg": (-2, 2, ()),
    "Exp": (-2, 2, ()),
    "Tanh": (-2, 2, ()),
    "Sigmoid": (-3, 3, ()),
    "Softplus": (-3, 3, ()),
    "Softsign": (-3, 3, ()),
    "Erf": (-2, 2, ()),
    "Sin": (-3, 3, ()),
    "Cos": (-3, 3, ()),
    "Atan": (-3, 3, ()),
    "Asinh": (-3, 3, ()),
    "Sinh": (-2, 2, ()),
    "Cosh": (-2, 2, ()),
    "Tan": (-1.2, 1.2, ()),
    "Identity": (-2, 2, ()),
    "Abs": (-2, 2, (0,)),
    "Relu": (-2, 2, (0,)),
    "Sign": (-2, 2, (0,)),
    "Log": (0.1, 3, ()),
    "Sqrt": (0.1, 3, ()),
    "Reciprocal": (0.2, 2, ()),
    "Acos": (-0.9, 0.9, ()),
    "Asin": (-0.9, 0.9, ()),
    "Atanh": (-0.9, 0.9, ()),
    "Acosh": (1.1, 3, ()),
    "Mish": (-3, 3, ()),
    "Floor": (-3, 3, tuple(range(-3, 4))),
    "Ceil": (-3, 3, tuple(range(-3, 4))),
    "Round": (-3, 3, tuple(k + 0.5 for k in range(-4, 4))),
    "HardSwish": (-4, 4, (-3, 3)),
}


@st.composite
def unary_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, empty=True)
    attrs, opset = {}, 18
    if op in UNARY:
        lo, hi, kinks = UNARY[op]
    elif op == "LeakyRelu":
        lo, hi, kinks = -2, 2, (0,)
        attrs = {"alpha": draw(st.sampled_from([0.01, 0.2, 1.5, -0.3]))}
    elif op in ("Elu", "Celu"):
        lo, hi, kinks = -2, 2, (0,)
        attrs = {"alpha": draw(st.sampled_from([0.5, 1.0, 2.0]))}
    elif op == "Selu":
        lo, hi, kinks = -2, 2, (0,)
        attrs = {"alpha": draw(st.sampled_from([1.67326, 0.5])), "gamma": draw(st.sampled_from([1.0507, 2.0]))}
    elif op == "ThresholdedRelu":
        alpha = draw(st.sampled_from([1.0, 0.3, -0.5]))
        lo, hi, kinks, attrs = -2, 2, (alpha,), {"alpha": alpha}
    elif op == "HardSigmoid":
        alpha, beta = draw(st.sampled_from([0.2, 0.5, 1.0])), draw(st.sampled_from([0.5, 0.3]))
        lo, hi, kinks, attrs = -4, 4, (-beta / alpha, (1 - beta) / alpha), {"alpha": alpha, "beta": beta}
    elif op == "Gelu":
        lo, hi, kinks, opset = -3, 3, (), 20
        attrs = {"approximate": draw(st.sampled_from(["none", "tanh"]))}
    elif op in UNARY_SPECS:
        spec = UNARY_SPECS[op]
        attrs = dict(draw(st.sampled_from(spec.attrs)))
        lo, hi, kinks, opset = spec.low, spec.high, spec.kinks(attrs), max(opset, spec.opset)
    else:
        raise KeyError(op)
    x = away(rng, s, lo, hi, kinks)
    if op == "Reciprocal":
        x = x * rng.choice([-1.0, 1.0], s)
    graph = placement(draw, [0])
    case = OpCase(op, [x], attrs, opset=opset, graph_inputs=graph)
    if op == "Erf":
        case.ort = ""  # onnxruntime has float Erf only; double cases are skipped by the comparison
    return finish(draw, case)


@st.composite
def cast_cases(draw, op):
    rng = _rng(draw)
    x = rng.uniform(-2, 2, shape(draw, empty=True))
    target = draw(st.sampled_from([np.float32, np.float64]))
    if op == "Cast":
        case = OpCase(op, [x], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))}, graph_inputs=placement(draw, [0]))
    else:
        case = OpCase(op, [x, np.zeros((), target)], diff=(0,), graph_inputs=placement(draw, [0]))
    return finish(draw, case)


@st.composite
def dropout_cases(draw, op):
    """Inference Dropout (no training_mode, or training_mode False): the identity, and its mask."""
    rng = _rng(draw)
    x = rng.uniform(-2, 2, shape(draw, empty=True))
    inputs = [x]
    if draw(st.booleans()):
        inputs.append(np.array(draw(st.sampled_from([0.0, 0.3, 0.5]))))
        if draw(st.booleans()):
            inputs.append(np.array(False))
    case = OpCase(op, inputs, num_outputs=draw(st.sampled_from([1, 2])), diff=(0,), graph_inputs=placement(draw, [0]))
    return finish(draw, case)


@st.composite
def clip_cases(draw, op):
    """x with optional min / max (initializers or inputs); values kept away from both bounds."""
    rng = _rng(draw)
    s = shape(draw, empty=True)
    lo = draw(st.sampled_from([None, -1.0, -0.3, 0.5]))
    hi = draw(st.sampled_from([None, 1.0, 0.2, 1.7]))
    if lo is not None and hi is not None and lo >= hi:
        lo, hi = hi - 1.0, lo + 0.5
    x = away(rng, s, -2.5, 2.5, [b for b in (lo, hi) if b is not None])
    inputs = [x, None if lo is None else np.array(lo), None if hi is None else np.array(hi)]
    while inputs[-1] is None:
        inputs.pop()
    present = [i for i, a in enumerate(inputs) if a is not None]
    return finish(draw, OpCase(op, inputs, graph_inputs=placement(draw, present)))


def _smaller_partner(draw, s) -> tuple[int, ...]:
    """A shape that broadcasts to s (leading dims dropped, some set to 1)."""
    drop = draw(st.integers(0, len(s)))
    return tuple(1 if draw(st.booleans()) else d for d in s[drop:])


def _partner(draw, s):
    """A shape broadcastable with s, and the broadcast shape (either may be the larger)."""
    if 0 in s:
        return s, s
    return fg._broadcast_partner(draw, s)


@st.composite
def binary_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, empty=True)
    other, out = _partner(draw, s)
    shapes = [s, other] if draw(st.booleans()) else [other, s]
    attrs, diff, opset = {}, None, 18
    if op in ("Add", "Sub", "Mul"):
        inputs = [rng.uniform(-2, 2, sh) for sh in shapes]
    elif op == "Div":
        inputs = [rng.uniform(-2, 2, shapes[0]), away(rng, shapes[1], 0.3, 2) * rng.choice([-1.0, 1.0], shapes[1])]
    elif op == "Pow":
        if draw(st.integers(0, 4)) == 0:  # negative bases, an integer exponent held constant
            inputs = [away(rng, shapes[0], -2, 2, (0,), 0.2), np.full(shapes[1], float(draw(st.sampled_from([2, 3]))))]
            diff = (0,)
        else:
            inputs = [rng.uniform(0.3, 2, shapes[0]), rng.uniform(-2, 2, shapes[1])]
    elif op == "Mod":  # fmod, a / b kept away from integers (where fmod jumps)
        attrs = {"fmod": 1}
        s = tuple(out)
        other = _smaller_partner(draw, s) if draw(st.booleans()) else s
        b = away(rng, other, 0.5, 2) * rng.choice([-1.0, 1.0], other)
        q = rng.integers(-3, 4, s) + rng.uniform(0.1, 0.9, s)
        inputs = [np.broadcast_to(b, s) * q, b]
        inputs[0] = np.array(inputs[0])
    elif op == "PRelu":  # the slope broadcasts to x (unidirectionally)
        x_shape = tuple(out)
        slope_shape = _smaller_partner(draw, x_shape) if draw(st.booleans()) else x_shape
        inputs = [away(rng, x_shape, -2, 2, (0,)), rng.uniform(-1, 1, slope_shape)]
    elif op in ("Max", "Min", "Sum", "Mean"):
        count = draw(st.integers(1, 3))
        extra = [_partner(draw, tuple(out))[0] for _ in range(count - 2)]
        shapes = (shapes + extra)[:count]
        # Max / Min: grids offset by a third of their step, so no two inputs tie
        inputs = [np.round(rng.uniform(-2, 2, sh), 1) + 0.033 * k for k, sh in enumerate(shapes)]
    else:
        raise KeyError(op)
    present = list(range(len(inputs)))
    return finish(draw, OpCase(op, inputs, attrs, opset=opset, diff=diff, graph_inputs=placement(draw, present)))


@st.composite
def where_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, empty=True)
    a, out = _partner(draw, s)
    c, _ = _partner(draw, tuple(out)) if 0 not in out else (out, out)
    c = tuple(c) if np.broadcast_shapes(tuple(c), tuple(out)) == tuple(out) else tuple(out)
    inputs = [rng.random(c) < 0.5, rng.uniform(-2, 2, s), rng.uniform(-2, 2, a)]
    return finish(draw, OpCase(op, inputs, graph_inputs=placement(draw, [0, 1, 2])))


# -- softmax, cumsum, trilu, topk, einsum ---------------------------------------------------------


@st.composite
def softmax_cases(draw, op):
    rng = _rng(draw)
    opset = draw(st.sampled_from([11, 13, 18]))
    s = shape(draw, rank_min=1, empty=True)
    attrs = {}
    if draw(st.integers(0, 3)) or (opset < 13 and len(s) < 2):  # opset 11's default axis is 1
        attrs["axis"] = draw(st.integers(-len(s), len(s) - 1))
    case = OpCase(op, [rng.uniform(-3, 3, s)], attrs, opset=opset, graph_inputs=placement(draw, [0]))
    return finish(draw, case)


@st.composite
def cumsum_cases(draw, op):
    """CumSum, and CumProd (opset 26) with exact zeros (none, one or several in a line)."""
    rng = _rng(draw)
    s = shape(draw, rank_min=1, empty=True)
    axis = np.array(draw(st.integers(-len(s), len(s) - 1)), draw(st.sampled_from([np.int32, np.int64])))
    attrs = {"exclusive": draw(st.sampled_from([0, 1])), "reverse": draw(st.sampled_from([0, 1]))}
    x = rng.uniform(-2, 2, s)
    if op == "CumProd":
        x = np.where(rng.random(s) < draw(st.sampled_from([0.0, 0.2, 0.5])), 0.0, x)
    opset = 26 if op == "CumProd" else 18
    return finish(draw, OpCase(op, [x, axis], attrs, opset=opset, graph_inputs=placement(draw, [0])))


@st.composite
def trilu_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=2, rank_max=4, high=4, empty=True)
    inputs = [rng.uniform(-2, 2, s)]
    if draw(st.booleans()):
        inputs.append(np.array(draw(st.integers(-4, 4)), np.int64))
    case = OpCase(op, inputs, {"upper": draw(st.sampled_from([0, 1]))}, graph_inputs=placement(draw, [0]))
    return finish(draw, case)


@st.composite
def topk_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=1, high=4, empty=True)
    axis = draw(st.integers(-len(s), len(s) - 1))
    k = draw(st.integers(0, s[axis]))
    attrs = {"axis": axis, "largest": draw(st.sampled_from([0, 1])), "sorted": draw(st.sampled_from([0, 1]))}
    case = OpCase(op, [distinct(rng, s), np.array([k], np.int64)], attrs, num_outputs=2, graph_inputs=placement(draw, [0, 1]))
    return finish(draw, case)


EINSUM = [  # (equation, operand shapes as letters)
    "ij,jk->ik",
    "bij,bjk->bik",
    "ij->ji",
    "ij->",
    "i,i->",
    "ij,j->i",
    "bhqd,bhkd->bhqk",
    "ij,ij->ij",
    "i,j->ij",
    "...ij,...jk->...ik",
    "ijk->kj",
    "ij,kj->ik",
    "abc,cd->abd",
    "ii->i",  # diagonals
    "ii",
    "bii->b",
    "iij,jk->ik",
    "...ii->...i",
]


@st.composite
def einsum_cases(draw, op):
    rng = _rng(draw)
    equation = draw(st.sampled_from(EINSUM))
    lhs = equation.split("->")[0].split(",")
    sizes = {c: draw(st.integers(1, 3)) for c in set("".join(lhs)) - {"."}}
    batch = dims(draw, draw(st.integers(0, 2)))
    shapes = []
    for term in lhs:
        dims_ = [sizes[c] for c in term.replace("...", "")]
        if "..." in term:  # the same ellipsis rank in every term (onnxruntime wants it), 1s broadcast
            dims_ = [1 if draw(st.integers(0, 3)) == 0 else d for d in batch] + dims_
        shapes.append(tuple(dims_))
    inputs = [rng.uniform(-2, 2, sh) for sh in shapes]
    case = OpCase(op, inputs, {"equation": equation}, graph_inputs=placement(draw, list(range(len(inputs)))))
    return finish(draw, case)


# -- reductions ----------------------------------------------------------------------------------

REDUCE_EMPTY_OK = {"ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceProd"}


@st.composite
def reduce_cases(draw, op):
    rng = _rng(draw)
    opset = draw(st.sampled_from([13, 18]))
    s = shape(draw, high=4, empty=True)
    rank = len(s)
    attrs = {"keepdims": draw(st.sampled_from([0, 1]))}
    axes_input = opset >= 18 or op == "ReduceSum"
    mode = draw(st.sampled_from(["all", "axes", "axes", "empty"])) if rank else "all"
    axes = None
    if mode == "axes":
        chosen = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        axes = [a - rank if draw(st.booleans()) else a for a in chosen]
    if mode == "empty" and axes_input:
        axes = []
        attrs["noop_with_empty_axes"] = draw(st.sampled_from([0, 1]))
    reduced = set(range(rank)) if not axes else {a % rank for a in axes}
    if axes == [] and attrs.get("noop_with_empty_axes"):
        reduced = set()
    if op not in REDUCE_EMPTY_OK and any(s[a] == 0 for a in reduced):
        s = tuple(1 if i in reduced and d == 0 else d for i, d in enumerate(s))
    if op in ("ReduceMax", "ReduceMin"):
        x = distinct(rng, s)
    elif op == "ReduceL1":
        x = away(rng, s, -2, 2, (0,), 0.1)
    elif op in ("ReduceLogSum", "ReduceProd"):
        x = rng.uniform(0.3, 1.5, s) * (1 if op == "ReduceLogSum" else rng.choice([-1.0, 1.0], s))
    else:
        x = rng.uniform(-2, 2, s)
    inputs = [x]
    if axes is not None:
        if axes_input:
            inputs.append(np.array(axes, np.int64))
        elif axes:
            attrs["axes"] = axes
    case = OpCase(op, inputs, attrs, opset=opset, graph_inputs=placement(draw, [0]))
    if op == "ReduceMean" and any(s[a] == 0 for a in reduced):
        case.ort = "the mean over an empty axis is NaN"
    return finish(draw, case)


# -- shape ops -----------------------------------------------------------------------------------


def _factor(total: int, draw) -> list[int]:
    factors = [p for p in (2, 3, 5, 7) for k in range(20) if total % p ** (k + 1) == 0]
    target, rest = [], list(factors)
    for _ in range(draw(st.integers(0, 3))):
        take = draw(st.integers(0, len(rest)))
        target.append(int(np.prod(rest[:take])))
        rest = rest[take:]
    target.append(int(np.prod(rest)))
    return target


@st.composite
def shape_op_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_max=4, empty=True)
    rank = len(s)
    x = rng.uniform(-2, 2, s)
    inputs, attrs, opset, graph, num_outputs = [x], {}, 18, [0], 1
    if op == "Reshape":
        total = int(np.prod(s))
        if total == 0:
            target = list(s[::-1]) or [0]
            attrs["allowzero"] = 1
        else:
            target = _factor(total, draw)
            spec = list(target)
            if draw(st.booleans()):
                spec[draw(st.integers(0, len(spec) - 1))] = -1
            copies = [i for i, d in enumerate(spec) if i < rank and s[i] == d and d != -1]
            if copies and draw(st.booleans()):
                spec[draw(st.sampled_from(copies))] = 0
            target = spec
        inputs.append(np.array(target, np.int64))
        graph.append(1) if draw(st.integers(0, 3)) == 0 else None
    elif op == "Flatten":
        if rank:
            attrs["axis"] = draw(st.integers(-rank, rank))
        else:
            inputs[0] = x.reshape(1)
    elif op == "Transpose":
        if rank > 1 and draw(st.booleans()):
            attrs["perm"] = list(draw(st.permutations(range(rank))))
    elif op == "Squeeze":
        ones = [i for i, d in enumerate(s) if d == 1]
        if ones and draw(st.booleans()):
            axes = draw(st.lists(st.sampled_from(ones), min_size=1, unique=True))
            inputs.append(np.array([a - rank if draw(st.booleans()) else a for a in axes], np.int64))
    elif op == "Unsqueeze":
        count = draw(st.integers(1, 2))
        out_rank = rank + count
        axes = draw(st.lists(st.integers(0, out_rank - 1), min_size=count, max_size=count, unique=True))
        inputs.append(np.array([a - out_rank if draw(st.booleans()) else a for a in axes], np.int64))
    elif op == "Concat":
        if not rank:
            x = x.reshape(1)
            s, rank, inputs = (1,), 1, [x.reshape(1)]
        axis = draw(st.integers(-rank, rank - 1))
        for _ in range(draw(st.integers(0, 2))):
            other = list(s)
            other[axis] = draw(st.integers(0, 3))
            inputs.insert(draw(st.integers(0, len(inputs))), rng.uniform(-2, 2, other))
        attrs["axis"] = axis
        graph = list(range(len(inputs)))
    elif op == "Split":
        if not rank:
            x = rng.uniform(-2, 2, draw(st.integers(1, 3)))
            s, rank, inputs = x.shape, 1, [x]
        axis = draw(st.integers(-rank, rank - 1))
        n = s[axis]
        attrs["axis"] = axis
        style = draw(st.sampled_from(["sizes", "equal", "num_outputs"]))
        if style == "sizes" or (style == "num_outputs" and n == 0):
            parts = draw(st.integers(1, 3))
            cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
            sizes = np.diff([0, *cuts, n]).astype(np.int64)
            inputs.append(sizes)
            num_outputs = len(sizes)
        elif style == "equal":
            divisors = [d for d in (1, 2, 3) if n % d == 0] if n else [1]
            num_outputs = draw(st.sampled_from(divisors))
            opset = 13
        else:
            num_outputs = draw(st.integers(1, max(1, n)))
            if -(-n // num_outputs) * (num_outputs - 1) >= n:  # the last chunk would be empty or negative
                num_outputs = 1
            attrs["num_outputs"] = num_outputs
    elif op == "Expand":
        if 0 in s:
            target = list(s)
        else:
            target = [draw(st.integers(1, 3)) if d == 1 else (1 if draw(st.integers(0, 3)) == 0 else d) for d in s]
        lead = dims(draw, draw(st.integers(0, 1)))
        inputs.append(np.array(list(lead) + target, np.int64))
    elif op == "Tile":
        inputs.append(np.array(dims(draw, rank, 0 if draw(st.integers(0, 4)) == 0 else 1, 3), np.int64))
    elif op in ("DepthToSpace", "SpaceToDepth"):
        b = draw(st.integers(1, 3))
        n, c, h, w = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        x = rng.uniform(-2, 2, (n, c * b * b, h, w) if op == "DepthToSpace" else (n, c, h * b, w * b))
        inputs = [x]
        attrs["blocksize"] = b
        if op == "DepthToSpace":
            attrs["mode"] = draw(st.sampled_from(["DCR", "CRD"]))
    else:
        raise KeyError(op)
    case = OpCase(
        op,
        inputs,
        attrs,
        opset=opset,
        num_outputs=num_outputs,
        graph_inputs=frozenset(graph) & frozenset(i for i in range(len(inputs)) if draw(st.booleans()) or i > 0),
    )
    return finish(draw, case)


@st.composite
def slice_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=1, rank_max=3, high=4, empty=True)
    rank = len(s)
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    starts, ends, steps = [], [], []
    for axis in axes:
        n = s[axis]
        bound = st.one_of(st.integers(-n - 2, n + 2), st.sampled_from([INT64_MAX, INT64_MIN]))
        starts.append(draw(bound))
        ends.append(draw(bound))
        steps.append(draw(st.sampled_from([1, 1, 2, 3, -1, -2])))
    inputs = [rng.uniform(-2, 2, s), np.array(starts, np.int64), np.array(ends, np.int64)]
    style = draw(st.integers(0, 2))  # 0: starts/ends only, 1: + axes, 2: + axes + steps
    if style or steps != [1] * len(steps):
        inputs.append(np.array([a - rank if draw(st.booleans()) else a for a in axes], np.int64))
        inputs.append(np.array(steps, np.int64))
    elif len(axes) != rank or axes != list(range(len(axes))):
        inputs.append(np.array(axes, np.int64))
    graph = [0] + [i for i in range(1, len(inputs)) if draw(st.integers(0, 4)) == 0]
    case = OpCase(op, inputs, graph_inputs=placement(draw, graph))
    if any(e == INT64_MAX and st_ < 0 for e, st_ in zip(ends, steps)):
        case.ort = "onnxruntime slices end = INT64_MAX with a negative step to the front (the spec clamps it)"
    return finish(draw, case)


@st.composite
def pad_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=1, rank_max=3, high=4, empty=True)
    rank = len(s)
    mode = draw(st.sampled_from(["constant", "constant", "reflect", "edge", "wrap"]))
    opset = 19 if mode == "wrap" else draw(st.sampled_from([13, 18, 19]))
    axes = list(range(rank))
    if opset >= 18 and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
    begins, ends = [], []
    for a in axes:
        n = s[a]
        if mode == "constant":  # negative pads crop, never past an empty axis
            begins.append(draw(st.integers(-n, 2)))
            ends.append(draw(st.integers(-(n + begins[-1]), 2)))
        elif mode == "reflect":
            begins.append(draw(st.integers(0, max(0, n - 1))))
            ends.append(draw(st.integers(0, max(0, n - 1))))
        else:
            begins.append(draw(st.integers(0, 2 if n else 0)))
            ends.append(draw(st.integers(0, 2 if n else 0)))
    pads = begins + ends
    if mode != "constant" and 0 in [s[a] for a in axes]:
        mode = "constant"
    inputs = [rng.uniform(-2, 2, s), np.array(pads, np.int64)]
    if mode == "constant" and draw(st.booleans()):
        inputs.append(np.array(rng.uniform(-1, 1)))
    if axes != list(range(rank)):
        while len(inputs) < 3:
            inputs.append(None)
        inputs.append(np.array([a - rank if draw(st.booleans()) else a for a in axes], np.int64))
    present = [i for i, a in enumerate(inputs) if a is not None and i in (0, 2)]
    case = OpCase(op, inputs, {"mode": mode}, opset=opset, graph_inputs=placement(draw, present))
    return finish(draw, case)


# -- indexing ------------------------------------------------------------------------------------


@st.composite
def gather_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=1, rank_max=3, high=4)
    rank = len(s)
    axis = draw(st.integers(-rank, rank - 1))
    n = s[axis]
    itype = draw(st.sampled_from([np.int64, np.int32]))
    attrs = {}
    if op == "Gather":
        idx_shape = shape(draw, rank_max=2, low=0 if draw(st.integers(0, 4)) == 0 else 1)
        idx = rng.integers(-n, n, idx_shape).astype(itype)
        attrs["axis"] = axis
    elif op == "GatherElements":
        idx_shape = tuple(
            draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, d)) if i != axis % rank else draw(st.integers(1, 4))
            for i, d in enumerate(s)
        )
        idx = rng.integers(-n, n, idx_shape).astype(itype)
        attrs["axis"] = axis
    else:  # GatherND
        batch = draw(st.integers(0, rank - 1))
        k = draw(st.integers(1, rank - batch))
        count = shape(draw, rank_max=2, low=0 if draw(st.integers(0, 4)) == 0 else 1)
        cols = [rng.integers(-s[batch + j], s[batch + j], s[:batch] + count) for j in range(k)]
        idx = np.stack(cols, axis=-1).astype(np.int64).reshape(s[:batch] + count + (k,))
        attrs["batch_dims"] = batch
    case = OpCase(op, [rng.uniform(-2, 2, s), idx], attrs, graph_inputs=placement(draw, [0, 1]))
    return finish(draw, case)


@st.composite
def scatter_cases(draw, op):
    rng = _rng(draw)
    s = shape(draw, rank_min=1, rank_max=3, high=4)
    rank = len(s)
    reduction = "none" if op == "Scatter" else draw(st.sampled_from(["none", "none", "add", "mul", "max", "min"]))
    opset = 10 if op == "Scatter" else 18  # Scatter: ScatterElements' deprecated name (opset 9-10), no reduction
    attrs = {} if reduction == "none" and (op == "Scatter" or draw(st.booleans())) else {"reduction": reduction}
    data = distinct(rng, s) if reduction in ("max", "min") else rng.uniform(-2, 2, s)
    if op in ("ScatterElements", "Scatter"):
        axis = draw(st.integers(-rank, rank - 1))
        a = axis % rank
        n = s[a]
        idx_shape = tuple(
            draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, d)) if i != a else draw(st.integers(1, n))
            for i, d in enumerate(s)
        )
        base = np.moveaxis(np.zeros(idx_shape, np.int64), a, -1)
        for pos in np.ndindex(base.shape[:-1]):  # distinct positions along the axis (no write order)
            base[pos] = rng.permutation(n)[: base.shape[-1]]
        idx = np.moveaxis(base, -1, a)
        idx = np.where(rng.random(idx.shape) < 0.3, idx - n, idx)
        attrs["axis"] = axis
    else:
        k = draw(st.integers(1, rank))
        count = draw(st.integers(0, min(3, int(np.prod(s[:k])))))
        flat = rng.permutation(int(np.prod(s[:k])))[:count]
        idx = np.stack(np.unravel_index(flat, s[:k]), axis=-1).astype(np.int64).reshape(count, k)
        idx = np.where(rng.random(idx.shape) < 0.3, idx - np.array(s[:k]), idx)
    upd_shape = idx.shape if op in ("ScatterElements", "Scatter") else idx.shape[:-1] + s[idx.shape[-1] :]
    updates = distinct(rng, upd_shape) + 0.013 if reduction in ("max", "min") else rng.uniform(-2, 2, upd_shape)
    case = OpCase(op, [data, idx, updates], attrs, opset=opset, graph_inputs=placement(draw, [0, 1, 2]))
    return finish(draw, case)


@st.composite
def tensor_scatter_cases(draw, op):
    """TensorScatter (opset 24): a cache of rank 2-4, an update of 1 to all of its positions along the
    sequence axis, no write_indices (prefill) or per-row ones where the update fits (linear) or
    anywhere up to twice around (circular)."""
    rng = _rng(draw)
    rank = draw(st.integers(2, 4))
    s = dims(draw, rank, 1, 4)
    axis = draw(st.integers(1, rank - 1))
    room = s[axis]
    length = draw(st.integers(1, room))
    mode = draw(st.sampled_from(["linear", "circular"]))
    update_shape = list(s)
    update_shape[axis] = length
    inputs = [rng.uniform(-2, 2, s), rng.uniform(-2, 2, update_shape)]
    if draw(st.booleans()):
        high = 2 * room if mode == "circular" else room - length + 1
        inputs.append(rng.integers(0, high, s[0]).astype(np.int64))
    attrs: dict[str, Any] = {"axis": axis if draw(st.booleans()) else axis - rank}
    if mode == "circular" or draw(st.booleans()):
        attrs["mode"] = mode
    case = OpCase(op, inputs, attrs, opset=24, graph_inputs=placement(draw, list(range(len(inputs)))))
    return finish(draw, case)


@st.composite
def selection_cases(draw, op):
    """Range (float), ReverseSequence, OneHot (its values), Compress and Unique (distinct values, so
    no perturbation merges or splits two of them)."""
    rng = _rng(draw)
    attrs: dict[str, Any] = {}
    num_outputs = 1
    if op == "Range":
        delta = rng.uniform(0.2, 1.0) * draw(st.sampled_from([1, -1]))
        count = draw(st.integers(0, 6))
        start = rng.uniform(-2, 2)
        limit = start + (count - rng.uniform(0.2, 0.8)) * delta  # away from a whole number of steps
        inputs = [np.array(start), np.array(limit), np.array(delta)]
        case = OpCase(op, inputs, graph_inputs=placement(draw, [0, 1, 2]))
        return finish(draw, case, symbolic_ok=False)
    if op == "ReverseSequence":
        time_axis = draw(st.sampled_from([0, 1]))
        steps, batch = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        s = (steps, batch) if time_axis == 0 else (batch, steps)
        s += dims(draw, draw(st.integers(0, 2)))
        lengths = np.array([draw(st.integers(1, steps)) for _ in range(batch)], np.int64)
        attrs = {"time_axis": time_axis, "batch_axis": 1 - time_axis}
        inputs = [rng.uniform(-2, 2, s), lengths]
    elif op == "OneHot":
        depth = draw(st.integers(1, 4))
        idx = rng.integers(-depth, depth + 2, dims(draw, draw(st.integers(1, 2)))).astype(np.int64)  # out of range: all off
        axis = draw(st.integers(-(idx.ndim + 1), idx.ndim))
        attrs = {"axis": axis}
        inputs = [idx, np.array(depth, np.int64), rng.uniform(-2, 2, 2)]
        case = OpCase(op, inputs, attrs, opset=11, graph_inputs=placement(draw, [0, 2]))
        return finish(draw, case, symbolic_ok=False)
    elif op == "Compress":
        x = rng.uniform(-2, 2, shape(draw, rank_min=1, high=4))
        axis = draw(st.sampled_from([None, *range(-x.ndim, x.ndim)]))
        size = x.size if axis is None else x.shape[axis]
        condition = rng.random(draw(st.integers(0, size))) < 0.6
        if axis is not None:
            attrs = {"axis": axis}
        inputs = [x, condition]
    else:  # Unique
        s = shape(draw, rank_min=1, high=4)
        axis = draw(st.sampled_from([None, *range(-len(s), len(s))]))
        x = distinct(rng, s)
        if axis is not None:
            attrs["axis"] = axis
        attrs["sorted"] = draw(st.sampled_from([0, 1]))
        num_outputs = draw(st.integers(1, 4))
        inputs = [x]
    case = OpCase(op, inputs, attrs, num_outputs=num_outputs, graph_inputs=placement(draw, list(range(len(inputs)))))
    return finish(draw, case)


# -- matmul / gemm ---------------------------------------------------------------------------------


@st.composite
def matmul_cases(draw, op):
    rng = _rng(draw)
    m, k, n = (draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, 3)) for _ in range(3))
    if op == "MatMul":
        batch = dims(draw, draw(st.integers(0, 2)))
        other = tuple(1 if draw(st.booleans()) else d for d in batch[draw(st.integers(0, len(batch))) :])
        a_shape = batch + (m, k) if draw(st.integers(0, 4)) else (k,)
        b_shape = other + (k, n) if draw(st.integers(0, 4)) else (k,)
        if draw(st.booleans()):
            a_shape, b_shape = (
                (b_shape[:-2] + (m, k)) if len(b_shape) > 1 else (k,),
                a_shape[:-2] + (k, n) if len(a_shape) > 1 else (k,),
            )
        inputs, attrs = [rng.uniform(-2, 2, a_shape), rng.uniform(-2, 2, b_shape)], {}
    else:
        ta, tb = draw(st.sampled_from([0, 1])), draw(st.sampled_from([0, 1]))
        inputs = [rng.uniform(-2, 2, (k, m) if ta else (m, k)), rng.uniform(-2, 2, (n, k) if tb else (k, n))]
        if draw(st.booleans()):
            inputs.append(rng.uniform(-2, 2, draw(st.sampled_from([(m, n), (n,), (1, n), (m, 1), (), (1, 1)]))))
        attrs = {
            "transA": ta,
            "transB": tb,
            "alpha": draw(st.sampled_from([1.0, 0.5, -2.0])),
            "beta": draw(st.sampled_from([1.0, 0.0, 3.0])),
        }
    case = OpCase(op, inputs, attrs, graph_inputs=placement(draw, list(range(len(inputs)))))
    return finish(draw, case)


# -- convolution and pooling -------------------------------------------------------------------


def _window(draw, spatial, kernel_max=3, dilations=True):
    kernel = dims(draw, spatial, 1, kernel_max)
    strides = dims(draw, spatial, 1, 3)
    dil = dims(draw, spatial, 1, 2) if dilations and draw(st.booleans()) else (1,) * spatial
    return kernel, strides, dil


def _pads_attrs(draw, kernel, attrs, allow_same=True):
    """pads (each below the kernel), auto_pad, or nothing; returns which."""
    style = draw(
        st.sampled_from(["pads", "pads", "none", "VALID", "SAME_UPPER", "SAME_LOWER"] if allow_same else ["pads", "none"])
    )
    if style == "pads":
        attrs["pads"] = [draw(st.integers(0, k - 1)) for k in kernel] + [draw(st.integers(0, k - 1)) for k in kernel]
    elif style != "none":
        attrs["auto_pad"] = style
    return style


@st.composite
def conv_cases(draw, op):
    rng = _rng(draw)
    spatial = draw(st.integers(1, 3 if op == "Conv" else 2))
    n = draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, 2))  # an empty batch now and then
    group = draw(st.sampled_from([1, 1, 2]))
    c_in = group * draw(st.integers(1, 2))
    m = group * draw(st.integers(1, 2))
    kernel, strides, dil = _window(draw, spatial)
    attrs = {"strides": list(strides), "dilations": list(dil), "group": group}
    if draw(st.booleans()):
        attrs["kernel_shape"] = list(kernel)
    ort = ""
    if op == "Conv":
        style = _pads_attrs(draw, kernel, attrs)
        effective = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
        size = tuple(e + draw(st.integers(0, 3)) for e in effective)
        x = rng.uniform(-1, 1, (n, c_in) + size)
        w = rng.uniform(-1, 1, (m, c_in // group) + kernel)  # (SAME with dilations: onnxruntime refuses it)
    else:  # ConvTranspose: W is (C, M / group, k...)
        x = rng.uniform(-1, 1, (n, c_in) + dims(draw, spatial, 1, 3))
        w = rng.uniform(-1, 1, (c_in, m // group) + kernel)
        style = draw(st.sampled_from(["pads", "none", "output_shape", "SAME_UPPER", "SAME_LOWER"]))
        full = [s_ * (i - 1) + (k - 1) * d + 1 for s_, i, k, d in zip(strides, x.shape[2:], kernel, dil)]
        if style == "pads":  # leaving at least one output
            begin = [draw(st.integers(0, min(k - 1, (f - 1) // 2))) for k, f in zip(kernel, full)]
            attrs["pads"] = begin + [draw(st.integers(0, min(k - 1, f - 1 - b))) for k, f, b in zip(kernel, full, begin)]
        if style in ("pads", "none") and draw(st.booleans()):
            attrs["output_padding"] = [draw(st.integers(0, s_ - 1)) for s_ in strides]  # < stride (onnxruntime)
        if style == "output_shape":  # smaller than the full result, or larger (outputs holding the bias)
            attrs["output_shape"] = [max(1, f + draw(st.integers(-2, 2))) for f in full]
            if any(o > f for o, f in zip(attrs["output_shape"], full)):
                ort = (
                    "onnxruntime refuses an output_shape larger than the full result, or starts it at the full "
                    "result's start; the spec's pads (and gradgen) put the extra before and after it"
                )
        elif style.startswith("SAME"):
            attrs["auto_pad"] = style
            ort = "onnxruntime's ConvTranspose SAME padding is not the spec's (pads at the other end)"
    inputs = [x, w]
    if draw(st.booleans()):
        inputs.append(rng.uniform(-1, 1, (m,)))
    case = OpCase(op, inputs, attrs, graph_inputs=placement(draw, list(range(len(inputs)))), ort=ort)
    static = op == "Conv" or not ("output_shape" in attrs or "auto_pad" in attrs)
    return finish(draw, case, symbolic_ok=static)


@st.composite
def pool_cases(draw, op):
    rng = _rng(draw)
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        s = (draw(st.integers(1, 2)), draw(st.integers(1, 3))) + dims(draw, draw(st.integers(1, 3)), 1, 4)
        x = distinct(rng, s) if op == "GlobalMaxPool" else rng.uniform(-2, 2, s)
        return finish(draw, OpCase(op, [x], graph_inputs=placement(draw, [0])))
    spatial = draw(st.integers(1, 3))
    opset = draw(st.sampled_from([17, 19, 22]))
    kernel, strides, dil = _window(draw, spatial, dilations=op == "MaxPool" or opset >= 19)
    attrs = {"kernel_shape": list(kernel)}
    if draw(st.booleans()) or any(s_ > 1 for s_ in strides):
        attrs["strides"] = list(strides)
    if any(d > 1 for d in dil):
        attrs["dilations"] = list(dil)
    style = _pads_attrs(draw, kernel, attrs)
    ceil = draw(st.sampled_from([0, 1]))
    if ceil:
        attrs["ceil_mode"] = 1
    if op == "AveragePool":
        attrs["count_include_pad"] = draw(st.sampled_from([0, 1]))
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dil)]
    size = tuple(e + draw(st.integers(0, 4)) for e in effective)
    s = (draw(st.integers(0 if draw(st.integers(0, 5)) == 0 else 1, 2)), draw(st.integers(1, 2))) + size
    x = distinct(rng, s) if op == "MaxPool" else rng.uniform(-2, 2, s)
    num_outputs = 1
    if op == "MaxPool" and draw(st.booleans()):
        num_outputs = 2
        attrs["storage_order"] = draw(st.sampled_from([0, 1])) if spatial == 2 else 0
    case = OpCase(op, [x], attrs, opset=opset, num_outputs=num_outputs, graph_inputs=placement(draw, [0]))
    if style.startswith("SAME") and (ceil or any(d > 1 for d in dil) or any(k < s_ for k, s_ in zip(kernel, strides))):
        case.ort = "onnxruntime's SAME pooling with ceil_mode, dilations or kernel < stride differs from the spec"
    symbolic_ok = not (op == "AveragePool" and ceil and style in ("pads", "none", "VALID"))
    return finish(draw, case, symbolic_ok=symbolic_ok)


@st.composite
def pool_grad_cases(draw, op):
    """ONNX Runtime training's MaxPoolGrad(dY, Indices) / AveragePoolGrad(dY) (ONNX domain ops that
    stock onnxruntime lacks). X is as long as the windows reach (what the kernels infer dX's shape
    from), MaxPoolGrad's Indices come from MaxPool on distinct values; AveragePoolGrad gets pads
    and count_include_pad."""
    from gradgen.kernels.cpu.pool import max_pool

    rng = _rng(draw)
    spatial = draw(st.integers(1, 2))
    kernel = [draw(st.integers(1, 3)) for _ in range(spatial)]
    strides = [draw(st.integers(1, 2)) for _ in range(spatial)]
    pads = [0] * (2 * spatial)
    attrs: dict[str, Any] = {"kernel_shape": kernel, "strides": strides}
    if op == "AveragePoolGrad" and draw(st.booleans()):
        pads = [draw(st.integers(0, k - 1)) for k in kernel * 2]
        attrs["pads"] = pads
        attrs["count_include_pad"] = draw(st.sampled_from([0, 1]))
    out = [draw(st.integers(1, 3)) for _ in range(spatial)]
    size = [(o - 1) * s_ + k - pads[i] - pads[spatial + i] for i, (o, s_, k) in enumerate(zip(out, strides, kernel))]
    assume(all(v >= 1 for v in size))
    lead = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    dy = rng.uniform(-2, 2, lead + tuple(out))
    if op == "MaxPoolGrad":
        _, indices = max_pool(distinct(rng, lead + tuple(size)), kernel_shape=kernel, strides=strides, _num_outputs=2)
        assume(indices.shape == dy.shape)
        inputs = [dy, indices.astype(np.int64)]
    else:
        inputs = [dy]
    case = OpCase(op, inputs, attrs, opset=17, graph_inputs=placement(draw, list(range(len(inputs)))))
    case.ort = "stock onnxruntime has no MaxPoolGrad / AveragePoolGrad (ONNX Runtime training's ops)"
    return finish(draw, case, symbolic_ok=False)


# -- normalization -----------------------------------------------------------------------------


@st.composite
def norm_cases(draw, op):
    rng = _rng(draw)
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    spatial = dims(draw, draw(st.integers(0 if op != "InstanceNormalization" else 1, 2)), 1, 3)
    x = rng.uniform(-2, 2, (n, c) + spatial)
    attrs, opset, num_outputs, ort = {"epsilon": draw(st.sampled_from([1e-5, 0.1]))}, 18, 1, ""
    if op == "BatchNormalization":
        opset = draw(st.sampled_from([14, 15]))
        inputs = [x, rng.uniform(0.5, 1.5, c), rng.uniform(-1, 1, c), rng.uniform(-1, 1, c), rng.uniform(0.5, 2, c)]
        if draw(st.booleans()) and n * int(np.prod(spatial)) > 1:
            attrs["training_mode"] = 1
            attrs["momentum"] = draw(st.sampled_from([0.9, 0.5]))
            num_outputs = draw(st.sampled_from([1, 3]))
            if num_outputs == 1:
                ort = "onnxruntime wants the three outputs of a training-mode BatchNormalization"
    elif op == "LayerNormalization":
        x = rng.uniform(-2, 2, shape(draw, rank_min=1, rank_max=4))
        axis = draw(st.integers(-x.ndim, x.ndim - 1))
        norm_shape = x.shape[axis % x.ndim :]
        inputs = [x, rng.uniform(0.5, 1.5, norm_shape)]
        if draw(st.booleans()):
            inputs.append(rng.uniform(-1, 1, norm_shape))
        attrs["axis"] = axis
        num_outputs = draw(st.sampled_from([1, 3]))
        opset = 17
    elif op == "InstanceNormalization":
        inputs = [x, rng.uniform(0.5, 1.5, c), rng.uniform(-1, 1, c)]
    else:  # GroupNormalization: opset 18 (scale per group) or 21 (per channel)
        groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
        opset = draw(st.sampled_from([18, 21]))
        per = c if opset >= 21 else groups
        inputs = [x, rng.uniform(0.5, 1.5, per), rng.uniform(-1, 1, per)]
        attrs["num_groups"] = groups
    case = OpCase(op, inputs, attrs, opset=opset, num_outputs=num_outputs, graph_inputs=placement(draw, list(range(len(inputs)))))
    case.ort = ort
    case = finish(draw, case)
    # float32 Instance / GroupNormalization: onnxruntime's variance loses digits when it is small
    # next to the mean (about 1 case in 150 differs by more than 1e-4; gradgen is the closer to float64).
    # double Layer / GroupNormalization: stash_type 1 makes the spec (and onnxruntime) compute the
    # statistics in float; gradgen computes them in double, so float64 gradient checks stay precise.
    if op == "GroupNormalization" or (case.dtype == np.float32 and op == "InstanceNormalization"):
        case.ort_tolerance = 1e-3
        groups = attrs.get("num_groups", c)  # InstanceNormalization: a group per channel
        if case.dtype == np.float32 and _smallest_relative_variance(x, groups, attrs["epsilon"]) < 1e-3:
            # a group of close values: onnxruntime's cancellation passes 1e-3 too (values 0.005 apart
            # near -1.58: 3e-3 off float64, where gradgen is within 1e-7)
            case.ort = case.ort or "onnxruntime's float32 variance E[x^2] - E[x]^2 cancels on a group of close values"
    elif op == "LayerNormalization" and case.dtype == np.float64:
        case.ort_tolerance = 1e-4
    return case


def _smallest_relative_variance(x: np.ndarray, groups: int, epsilon: float) -> float:
    """The smallest (variance + epsilon) / mean(x^2) over the normalized groups of ``x`` (N, C, ...):
    the digits a float32 E[x^2] - E[x]^2 keeps."""
    lines = x.reshape(x.shape[0], groups, -1)
    variance = lines.var(axis=-1) + epsilon
    return float((variance / np.maximum((lines * lines).mean(axis=-1), 1e-30)).min())


# -- resize ----------------------------------------------------------------------------------------


@st.composite
def resize_cases(draw, op):
    from gradgen.ops.pool import resize_geometry

    rng = _rng(draw)
    rank = draw(st.integers(1, 4))
    s = dims(draw, rank, 1, 5)
    opset = draw(st.sampled_from([13, 18, 19]))
    mode = draw(st.sampled_from(["nearest", "linear", "cubic"]))
    ctms = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"]
    if opset >= 19:
        ctms.append("half_pixel_symmetric")
    ctm = draw(st.sampled_from(ctms))
    attrs = {"mode": mode, "coordinate_transformation_mode": ctm}
    if mode == "nearest":
        attrs["nearest_mode"] = draw(st.sampled_from(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]))
    if mode == "cubic":
        attrs["cubic_coeff_a"] = draw(st.sampled_from([-0.75, -0.5]))
        attrs["exclude_outside"] = draw(st.sampled_from([0, 1]))
    axes = list(range(rank))
    if opset >= 18 and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        attrs["axes"] = [a - rank if draw(st.booleans()) else a for a in axes]
    if opset >= 18 and mode != "nearest" and draw(st.integers(0, 3)) == 0:
        attrs["antialias"] = 1
    roi = np.zeros(0, np.float32)
    if ctm == "tf_crop_and_resize":
        starts = rng.uniform(-0.2, 0.4, len(axes))
        roi = np.concatenate([starts, starts + rng.uniform(0.3, 1.0, len(axes))]).astype(np.float32)
        attrs["extrapolation_value"] = float(draw(st.sampled_from([0.0, 0.5])))
    ort = ""
    if draw(st.booleans()):
        scales = np.array([draw(st.sampled_from([0.5, 0.6, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0])) for _ in axes], np.float32)
        inputs = [rng.uniform(-2, 2, s), roi, scales]
        out = resize_geometry(s, scales, None, axes=axes)[0]
    else:
        sizes = [draw(st.integers(1, 7)) for _ in axes]
        if opset >= 18 and draw(st.integers(0, 3)) == 0:
            attrs["keep_aspect_ratio_policy"] = draw(st.sampled_from(["not_larger", "not_smaller"]))
            if any(a < 0 for a in attrs.get("axes", [])):
                ort = "onnxruntime ignores negative axes with a keep_aspect_ratio_policy"
        inputs = [rng.uniform(-2, 2, s), roi, None, np.array(sizes, np.int64)]
        out = resize_geometry(
            s, None, sizes, axes=axes, keep_aspect_ratio_policy=attrs.get("keep_aspect_ratio_policy", "stretch")
        )[0]
    if ctm == "tf_crop_and_resize" and any(out[a] == s[a] for a in axes):
        ort = "onnxruntime ignores the roi of an axis whose length does not change"
    if ctm in ("align_corners", "tf_crop_and_resize") and "keep_aspect_ratio_policy" in attrs:
        ort = (
            "onnxruntime's align_corners / tf_crop_and_resize with a keep_aspect_ratio_policy disagree with "
            "ONNX's reference evaluator, which gradgen agrees with ((2, 3) to sizes (1, 1), not_smaller, "
            "cubic tf_crop_and_resize: 1.0274 where onnxruntime gives 1.0649; (1, 7), nearest align_corners: "
            "another row; half_pixel and asymmetric agree)"
        )
    if (
        ctm in ("align_corners", "tf_crop_and_resize")
        and inputs[2] is not None
        and any(float(np.float32(f)) * s[a] != out[a] for f, a in zip(inputs[2], axes))
    ):
        ort = (
            "onnxruntime spaces align_corners / tf_crop_and_resize samples by the output length; ONNX's "
            "conformance tests (and gradgen) by the fractional width scale * n"
        )
    case = OpCase(op, inputs, attrs, opset=opset, keep=frozenset({1, 2}), graph_inputs=placement(draw, [0]))
    case.ort = ort
    return finish(draw, case, symbolic_ok=False)


# -- losses --------------------------------------------------------------------------------------


@st.composite
def loss_cases(draw, op):
    rng = _rng(draw)
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    extra = dims(draw, draw(st.integers(0, 2)), 1, 3)
    x = rng.uniform(-2, 2, (n, c) + extra)
    if op == "NegativeLogLikelihoodLoss" and draw(st.booleans()):
        x = x - np.log(np.exp(x).sum(axis=1, keepdims=True))  # log-probabilities, as usual
    labels = rng.integers(0, c, (n,) + extra).astype(draw(st.sampled_from([np.int64, np.int32])))
    attrs = {"reduction": draw(st.sampled_from(["mean", "sum", "none"]))}
    if draw(st.booleans()):
        ignore = int(draw(st.sampled_from([0, -1, c - 1, -100])))
        attrs["ignore_index"] = ignore
        labels.reshape(-1)[rng.random(labels.size) < 0.3] = ignore
        kept = [k for k in range(c) if k != ignore]
        if kept:  # one label counts: "mean" over nothing is NaN (tests/test_loss_zero_denominator.py)
            labels.reshape(-1)[0] = draw(st.sampled_from(kept))
        elif attrs["reduction"] == "mean":
            attrs["reduction"] = "sum"
    inputs = [x, labels]
    if draw(st.booleans()):
        inputs.append(rng.uniform(0.2, 2, c))
    num_outputs = 2 if op == "SoftmaxCrossEntropyLoss" and draw(st.booleans()) else 1
    case = OpCase(
        op,
        inputs,
        attrs,
        opset=draw(st.sampled_from([13, 18])),
        num_outputs=num_outputs,
        graph_inputs=placement(draw, list(range(len(inputs)))),
    )
    return finish(draw, case)


# -- the table ----------------------------------------------------------------------------------

# -- recurrent -----------------------------------------------------------------------------------

# activations without a kink (clip and the piecewise ones are in tests/grad_cases/recurrent.py)
SMOOTH_ACTIVATIONS = {"Sigmoid": 0, "Tanh": 0, "Softsign": 0, "Softplus": 0, "Affine": 2, "ScaledTanh": 2}


@st.composite
def recurrent_cases(draw, op):
    """LSTM / GRU / RNN: direction, layout, sequence_lens, optional B / initial states / peepholes,
    input_forget, linear_before_reset, activations; a static sequence length (it is unrolled)."""
    rng = _rng(draw)
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    steps, batch, size, hidden = (draw(st.integers(1, n)) for n in (3, 2, 3, 2))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    d = 2 if direction == "bidirectional" else 1
    layout = draw(st.integers(0, 1))
    attrs = {"hidden_size": hidden, "direction": direction, "layout": layout}
    state = (batch, d, hidden) if layout else (d, batch, hidden)

    def maybe(shape):
        return rng.uniform(-0.8, 0.8, shape) if draw(st.booleans()) else None

    lens = rng.integers(0, steps + 1, batch).astype(np.int32) if draw(st.booleans()) else None
    inputs = [
        rng.uniform(-1.5, 1.5, (batch, steps, size) if layout else (steps, batch, size)),
        rng.uniform(-0.8, 0.8, (d, gates * hidden, size)),
        rng.uniform(-0.8, 0.8, (d, gates * hidden, hidden)),
        maybe((d, 2 * gates * hidden)),
        lens,
        maybe(state),
    ]
    if op == "LSTM":
        inputs += [maybe(state), maybe((d, 3 * hidden))]
        attrs["input_forget"] = draw(st.integers(0, 1))
    if op == "GRU":
        attrs["linear_before_reset"] = draw(st.integers(0, 1))
    if draw(st.booleans()):
        names = [draw(st.sampled_from(sorted(SMOOTH_ACTIVATIONS))) for _ in range(d * {"LSTM": 3, "GRU": 2, "RNN": 1}[op])]
        values = [float(v) for n in names for v in rng.uniform(0.5, 1.5, SMOOTH_ACTIVATIONS[n] // 2)]
        attrs.update(activations=names, activation_alpha=values or None, activation_beta=values or None)
        attrs = {k: v for k, v in attrs.items() if v is not None}
    while inputs[-1] is None:
        inputs.pop()
    present = [i for i, a in enumerate(inputs) if a is not None]
    case = OpCase(
        op,
        inputs,
        attrs,
        opset=14,
        graph_inputs=placement(draw, present),
        num_outputs=3 if op == "LSTM" else 2,
        ort="ONNX Runtime has no layout 1" if layout else "",
    )
    case = finish(draw, case, symbolic_ok=False)
    if case.dtype == np.float64:
        case.ort = case.ort or f"ONNX Runtime's {op} has no double kernel"
    return case


# -- normalizations, pooling, sampling and the rest without their own family above ----------------

_F32 = (0.25, 0.5, 0.75, 1.25)  # attribute values exact in float32, the attributes' type


@st.composite
def normalization_cases(draw, op):
    """RMSNormalization, SimplifiedLayerNormalization (ONNX Runtime's, with its inv_std_var output),
    LpNormalization, MeanVarianceNormalization, LRN."""
    rng = _rng(draw)
    attrs: dict[str, Any] = {}
    opset, ort, num_outputs = 18, "", 1
    if op in ("RMSNormalization", "SimplifiedLayerNormalization"):
        x = rng.uniform(-2, 2, shape(draw, rank_min=1, rank_max=3))
        axis = draw(st.integers(-x.ndim, x.ndim - 1))
        inputs = [x, rng.uniform(0.5, 1.5, x.shape[axis % x.ndim :])]
        attrs = {"axis": axis, "epsilon": draw(st.sampled_from([1e-5, 0.1]))}
        if op == "RMSNormalization":
            opset = 23
        else:
            num_outputs = draw(st.integers(1, 2))
    elif op == "LpNormalization":
        x = away(rng, shape(draw, rank_min=1, rank_max=3), kinks=(0,))
        attrs = {"axis": draw(st.integers(-x.ndim, x.ndim - 1)), "p": draw(st.sampled_from([1, 2]))}
        inputs = [x]
    elif op == "MeanVarianceNormalization":
        x = rng.uniform(-2, 2, dims(draw, draw(st.integers(2, 4)), 1, 3))
        axes = sorted(draw(st.sets(st.integers(0, x.ndim - 1), min_size=1, max_size=x.ndim)))
        assume(int(np.prod([x.shape[a] for a in axes])) >= 2)  # one element has no spread
        # a line whose spread is small against its values has a float32 gradient only as good as
        # x's rounding over the spread (two values 0.008 apart near 1.37: errors of 5e-3 where the
        # gradient is 2e-5), in any implementation: the float32 check needs a spread of 5 % or more
        over = tuple(axes)
        spread = np.sqrt(((x - x.mean(axis=over, keepdims=True)) ** 2).mean(axis=over, keepdims=True))
        assume(bool(np.all(spread >= 0.05 * np.abs(x).max(axis=over, keepdims=True))))
        attrs, opset = {"axes": axes}, 13
        inputs = [x]
    else:  # LRN
        x = rng.uniform(-2, 2, (draw(st.integers(1, 2)), draw(st.integers(1, 5))) + dims(draw, draw(st.integers(0, 2)), 1, 3))
        attrs = {"size": draw(st.integers(1, 5)), "alpha": draw(st.sampled_from(_F32)), "beta": draw(st.sampled_from(_F32))}
        attrs["bias"] = draw(st.sampled_from([1.0, 2.0]))
        opset = 13
        inputs = [x]
    present = list(range(len(inputs)))
    case = finish(draw, OpCase(op, inputs, attrs, opset=opset, num_outputs=num_outputs, graph_inputs=placement(draw, present)))
    if op == "MeanVarianceNormalization" and case.dtype == np.float64:
        ort = "ONNX's function body adds a float epsilon to double data"
    elif op == "LRN" and (inputs[0].ndim != 4 or attrs["size"] % 2 == 0):
        ort = "ONNX Runtime's LRN takes 4-D inputs and odd sizes only"
    case.ort = ort
    return case


@st.composite
def lp_pool_cases(draw, op):
    """LpPool, GlobalLpPool and MaxUnpool."""
    rng = _rng(draw)
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    spatial = dims(draw, draw(st.integers(1, 2)), 2, 4)
    if op == "MaxUnpool":
        kernel = [draw(st.integers(1, min(2, s))) for s in spatial]
        strides = [draw(st.integers(1, 2)) for _ in spatial]
        pooled = [(s - k) // st_ + 1 for s, k, st_ in zip(spatial, kernel, strides)]
        inferred = [(p - 1) * st_ + k for p, st_, k in zip(pooled, strides, kernel)]
        count = n * c * int(np.prod(pooled))
        indices = rng.permutation(n * c * int(np.prod(inferred)))[:count].reshape(n, c, *pooled).astype(np.int64)
        inputs = [rng.uniform(-2, 2, (n, c, *pooled)), indices]
        attrs = {"kernel_shape": kernel, "strides": strides}
        case = OpCase(op, inputs, attrs, graph_inputs=placement(draw, [0, 1]))
        return finish(draw, case)
    attrs: dict[str, Any] = {"p": draw(st.sampled_from([1, 2, 3]))}
    if op == "LpPool":
        kernel, strides, dilations = _window(draw, len(spatial))
        attrs.update(kernel_shape=list(kernel), strides=list(strides), dilations=list(dilations))
        _pads_attrs(draw, kernel, attrs, allow_same=False)
        spatial = tuple((k - 1) * d + 1 + draw(st.integers(0, 3)) for k, d in zip(kernel, dilations))
    x = away(rng, (n, c, *spatial), kinks=(0,), margin=0.1)
    case = finish(draw, OpCase(op, [x], attrs, graph_inputs=placement(draw, [0])))
    if case.dtype == np.float64:
        case.ort = f"ONNX Runtime's {op} has no double kernel"
    return case


@st.composite
def sampling_cases(draw, op):
    """GridSample, AffineGrid, RoiAlign (fixed sampling_ratio: the form gradgen differentiates) and MaxRoiPool."""
    rng = _rng(draw)
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    if op == "AffineGrid":
        nd = draw(st.sampled_from([2, 3]))
        size = [n, c, *dims(draw, nd, 1, 4)]
        attrs = {"align_corners": draw(st.integers(0, 1))}
        inputs = [rng.uniform(-1, 1, (n, nd, nd + 1)), np.array(size, dtype=np.int64)]
        case = finish(draw, OpCase(op, inputs, attrs, opset=20, graph_inputs=placement(draw, [0])))
        if attrs["align_corners"] and 1 in size[2:]:
            case.ort = "an axis of one pixel: gradgen puts it at 0 as PyTorch does, ONNX Runtime elsewhere"
        return case
    if op == "GridSample":
        nd = draw(st.sampled_from([1, 2, 2, 3]))
        mode = draw(st.sampled_from(["nearest", "linear", "cubic"] if nd < 3 else ["nearest", "linear"]))
        attrs = {
            "mode": mode,
            "padding_mode": draw(st.sampled_from(["zeros", "border", "reflection"])),
            "align_corners": draw(st.integers(0, 1)),
        }
        x = rng.uniform(-2, 2, (n, c, *dims(draw, nd, 1, 4)))
        grid = rng.uniform(-1.6, 1.6, (n, *dims(draw, nd, 1, 3), nd))
        case = finish(draw, OpCase(op, [x, grid], attrs, opset=20, graph_inputs=placement(draw, [0, 1])))
        if nd == 1:
            case.ort = "ONNX Runtime's GridSample takes 2-D and 3-D inputs only"
        return case
    if op == "MaxRoiPool":  # X only: the rois get no gradient (piecewise constant)
        height, width, rois_count = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
        scale = draw(st.sampled_from([1.0, 0.5]))
        corner = rng.uniform(-2, [width / scale, height / scale], (rois_count, 2))
        boxes = np.concatenate([corner, corner + rng.uniform(0, 6 / scale, (rois_count, 2))], axis=1)
        rois = np.concatenate([rng.integers(0, n, (rois_count, 1)), boxes], axis=1)
        attrs = {"pooled_shape": [draw(st.integers(1, 3)), draw(st.integers(1, 3))], "spatial_scale": scale}
        inputs = [rng.uniform(-2, 2, (n, c, height, width)), rois]
        case = finish(draw, OpCase(op, inputs, attrs, opset=16, diff=(0,), graph_inputs=placement(draw, [0, 1])))
        if case.dtype == np.float64:
            case.ort = "ONNX Runtime's MaxRoiPool has no double kernel"
        return case
    height, width = draw(st.integers(2, 5)), draw(st.integers(2, 5))
    rois_count = draw(st.integers(1, 3))
    corner = rng.uniform(-1, [width - 1, height - 1], (rois_count, 2))
    rois = np.concatenate([corner, corner + rng.uniform(0.5, 3, (rois_count, 2))], axis=1)
    attrs = {
        "sampling_ratio": draw(st.integers(1, 2)),
        "output_height": draw(st.integers(1, 2)),
        "output_width": draw(st.integers(1, 2)),
        "mode": draw(st.sampled_from(["avg", "max"])),
        "coordinate_transformation_mode": draw(st.sampled_from(["half_pixel", "output_half_pixel"])),
    }
    inputs = [rng.uniform(-2, 2, (n, c, height, width)), rois, rng.integers(0, n, rois_count).astype(np.int64)]
    case = finish(draw, OpCase(op, inputs, attrs, opset=16, graph_inputs=placement(draw, [0, 1, 2])))
    if attrs["mode"] == "max":
        case.ort = "ONNX Runtime warns that its max mode will change (gradgen follows today's)"
    return case


@st.composite
def linear_map_cases(draw, op):
    """Det, CenterCropPad, Col2Im, RotaryEmbedding, DFT."""
    rng = _rng(draw)
    opset, ort = 18, ""
    attrs: dict[str, Any] = {}
    if op == "DFT":
        return draw(dft_cases(op))
    if op == "Det":
        size = draw(st.integers(1, 4))
        inputs = [rng.uniform(-1, 1, (*dims(draw, draw(st.integers(0, 2)), 1, 2), size, size))]
        opset = 17
        case = finish(draw, OpCase(op, inputs, opset=opset, graph_inputs=placement(draw, [0])), symbolic_ok=False)
        case.ort = "ONNX Runtime's Det has no double kernel" if case.dtype == np.float64 else ""
        return case
    if op == "CenterCropPad":
        x = rng.uniform(-2, 2, dims(draw, draw(st.integers(1, 3)), 1, 4))
        axes = sorted(draw(st.sets(st.integers(0, x.ndim - 1), min_size=1, max_size=x.ndim)))
        if draw(st.booleans()):
            attrs["axes"] = [a - x.ndim if draw(st.booleans()) else a for a in axes]
        else:
            axes = list(range(x.ndim))
        sizes = np.array([draw(st.integers(1, 5)) for _ in axes], dtype=np.int64)
        inputs = [x, sizes]
    elif op == "Col2Im":
        nd = draw(st.integers(1, 2))
        block = list(dims(draw, nd, 1, 2))
        strides = [draw(st.integers(1, 2)) for _ in range(nd)]
        dilations = [draw(st.integers(1, 2)) for _ in range(nd)]
        pads = [draw(st.integers(0, 1)) for _ in range(2 * nd)]
        image = [
            draw(st.integers(max(1, d * (b - 1) + 1 - pads[i] - pads[nd + i]), 5))
            for i, (b, d) in enumerate(zip(block, dilations))
        ]
        count = int(
            np.prod(
                [(image[i] + pads[i] + pads[nd + i] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
            )
        )
        channels = draw(st.integers(1, 2))
        attrs = {"strides": strides, "dilations": dilations, "pads": pads}
        if nd == 1:  # seen: image 3, block 2, dilation 2 (the reference and torch's fold agree with gradgen)
            ort = "ONNX Runtime's 1-D Col2Im puts the blocks of the second channel on the first"
        inputs = [
            rng.uniform(-2, 2, (draw(st.integers(1, 2)), channels * int(np.prod(block)), count)),
            np.array(image, dtype=np.int64),
            np.array(block, dtype=np.int64),
        ]
    else:  # RotaryEmbedding
        batch, seq, heads, half = (
            draw(st.integers(1, 2)),
            draw(st.integers(1, 3)),
            draw(st.integers(1, 2)),
            draw(st.integers(1, 2)),
        )
        head = 2 * half + draw(st.sampled_from([0, 2]))
        attrs = {"interleaved": draw(st.integers(0, 1))}
        if head != 2 * half:
            attrs["rotary_embedding_dim"] = 2 * half
        with_ids = draw(st.booleans())
        if draw(st.booleans()):
            x = rng.uniform(-2, 2, (batch, heads, seq, head))
        else:
            x = rng.uniform(-2, 2, (batch, seq, heads * head))
            attrs["num_heads"] = heads
        cache = (5, half) if with_ids else (batch, seq, half)
        inputs = [x, rng.uniform(-1, 1, cache), rng.uniform(-1, 1, cache)]
        if with_ids:
            inputs.append(rng.integers(0, 5, (batch, seq)).astype(np.int64))
        opset = 23
    fed = [0] if op == "Col2Im" else list(range(len(inputs)))  # Col2Im's gradient needs its sizes constant
    case = finish(draw, OpCase(op, inputs, attrs, opset=opset, graph_inputs=placement(draw, fed)))
    if op == "RotaryEmbedding" and case.dtype == np.float64:
        ort = "ONNX types RotaryEmbedding for float32, float16 and bfloat16 only"
    case.ort = ort
    return case


@st.composite
def attention_cases(draw, op):
    """ONNX Attention (opset 23), 4-D: grouped key/value heads, causal or not, a scale, a float or
    bool mask over (S, T); differentiated through its standard-op form (DecomposePass)."""
    rng = _rng(draw)
    batch, kv_heads, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_len, kv_len, head, v_head = (draw(st.integers(1, 3)) for _ in range(4))
    inputs = [
        rng.uniform(-1, 1, (batch, kv_heads * groups, q_len, head)),
        rng.uniform(-1, 1, (batch, kv_heads, kv_len, head)),
        rng.uniform(-1, 1, (batch, kv_heads, kv_len, v_head)),
    ]
    attrs: dict[str, Any] = {}
    if draw(st.booleans()):
        attrs["is_causal"] = 1
    if draw(st.booleans()):
        attrs["scale"] = draw(st.sampled_from([0.5, 0.125, 2.0]))
    mask = draw(st.sampled_from(["none", "float", "bool"]))
    if mask == "float":
        inputs.append(rng.uniform(-1, 1, (q_len, kv_len)))
    elif mask == "bool":
        keep = rng.random((q_len, kv_len)) < 0.7
        keep[:, 0] = True  # no fully masked row
        inputs.append(keep)
    case = finish(draw, OpCase(op, inputs, attrs, opset=23, graph_inputs=placement(draw, list(range(len(inputs))))))
    if case.dtype == np.float64:
        case.ort = "ONNX Runtime's Attention has no double kernel"
    return case


@st.composite
def dft_cases(draw, op):
    """Forward, inverse, one-sided (forward of real X, inverse of complex X), dft_length padding or
    truncating; static lengths and a constant dft_length and axis, which the rule needs."""
    rng = _rng(draw)
    inverse, onesided = draw(st.booleans()), draw(st.booleans())
    parts = 2 if inverse and onesided else 1 if onesided else draw(st.sampled_from([1, 2]))
    x = rng.uniform(-1, 1, (*dims(draw, draw(st.integers(1, 2)), 1, 2), draw(st.integers(1, 5)), parts))
    axis = x.ndim - 2
    inputs = [x, None, np.array(axis - x.ndim if draw(st.booleans()) else axis, dtype=np.int64)]
    if draw(st.booleans()):
        inputs[1] = np.array(draw(st.integers(1, 6)), dtype=np.int64)
    assume(not (inverse and onesided and inputs[1] is None and x.shape[axis] == 1))  # n = 2 * (1 - 1) = 0
    attrs = {"inverse": int(inverse), "onesided": int(onesided)}
    case = finish(draw, OpCase(op, inputs, attrs, opset=20, graph_inputs=placement(draw, [0])), symbolic_ok=False)
    if inverse and onesided:
        case.ort = "ONNX Runtime's one-sided inverse DFT differs from numpy's irfft (the reference) on some lengths"
    return case


@st.composite
def stft_cases(draw, op):
    """A real or complex signal, frames every frame_step samples, with or without a window."""
    rng = _rng(draw)
    width, step = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    onesided = draw(st.integers(0, 1))
    signal = rng.uniform(
        -1, 1, (draw(st.integers(1, 2)), width + draw(st.integers(0, 5)), 1 if onesided else draw(st.integers(1, 2)))
    )
    inputs = [signal, np.array(step, dtype=np.int64)]
    inputs += [rng.uniform(0.2, 1, width)] if draw(st.booleans()) else [None, np.array(width, dtype=np.int64)]
    fed = [0, 2] if inputs[2] is not None else [0]
    case = OpCase(op, inputs, {"onesided": onesided}, opset=17, graph_inputs=placement(draw, fed))
    return finish(draw, case, symbolic_ok=False)


@st.composite
def deform_conv_cases(draw, op):
    """2-D, static shapes (the form gradgen differentiates): groups, offset groups, strides, pads,
    dilations, optional B and mask."""
    rng = _rng(draw)
    group, offset_group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    channels = group * offset_group * draw(st.integers(1, 2)) // (2 if group == offset_group == 2 else 1)
    kernel = dims(draw, 2, 1, 2)
    strides, dilations = dims(draw, 2, 1, 2), dims(draw, 2, 1, 2)
    size = [(k - 1) * d + 1 + draw(st.integers(0, 2)) for k, d in zip(kernel, dilations)]
    out = [(s - ((k - 1) * d + 1)) // st_ + 1 for s, k, d, st_ in zip(size, kernel, dilations, strides)]
    n, taps = draw(st.integers(1, 2)), kernel[0] * kernel[1]
    inputs = [
        rng.uniform(-2, 2, (n, channels, *size)),
        rng.uniform(-1, 1, (group * draw(st.integers(1, 2)), channels // group, *kernel)),
        rng.uniform(-0.8, 0.8, (n, 2 * offset_group * taps, *out)),
        None,
    ]
    if draw(st.booleans()):
        inputs[3] = rng.uniform(-1, 1, inputs[1].shape[0])
    if draw(st.booleans()):
        inputs.append(rng.uniform(0.2, 1, (n, offset_group * taps, *out)))
    attrs = {"group": group, "offset_group": offset_group, "strides": list(strides), "dilations": list(dilations)}
    present = [i for i, a in enumerate(inputs) if a is not None]
    case = OpCase(op, inputs, attrs, opset=19, graph_inputs=placement(draw, present))
    return finish(draw, case, symbolic_ok=False)


@st.composite
def dequantize_cases(draw, op):
    """DequantizeLinear: the float scale (per tensor or per axis); x and the zero point are integers."""
    rng = _rng(draw)
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    axis = draw(st.integers(-rank, rank - 1))
    dtype = draw(st.sampled_from([np.uint8, np.int8, np.int16, np.int32]))
    per_axis = draw(st.booleans())
    param_shape = (shape[axis],) if per_axis else draw(st.sampled_from([(), (1,)]))
    low, high = (-100, 100) if dtype != np.uint8 else (0, 200)
    x = rng.integers(low, high, shape).astype(dtype)
    zero = None if dtype == np.int32 or draw(st.booleans()) else rng.integers(low, high, param_shape).astype(dtype)
    attrs = {"axis": axis} if per_axis else {}
    case = OpCase(op, [x, rng.uniform(0.05, 0.5, param_shape), zero], attrs, opset=21 if dtype == np.int16 else 19, diff=(1,))
    case = finish(draw, case)
    case.graph_inputs = frozenset([1]) if draw(st.booleans()) else frozenset()
    if case.dtype == np.float64:
        case.ort = "the spec and ONNX Runtime take float32 / float16 / bfloat16 scales only"
    return case


GENERATORS: dict[str, Callable] = {}
for _op in [*UNARY, *UNARY_SPECS, "LeakyRelu", "Elu", "Celu", "Selu", "ThresholdedRelu", "HardSigmoid", "Gelu"]:
    GENERATORS[_op] = unary_cases
GENERATORS.update(
    {
        "Cast": cast_cases,
        "CastLike": cast_cases,
        "Dropout": dropout_cases,
        "Clip": clip_cases,
        "Where": where_cases,
        "Softmax": softmax_cases,
        "LogSoftmax": softmax_cases,
        "CumSum": cumsum_cases,
        "CumProd": cumsum_cases,
        "Trilu": trilu_cases,
        "TopK": topk_cases,
        "Einsum": einsum_cases,
        "Slice": slice_cases,
        "Pad": pad_cases,
        "Resize": resize_cases,
        "STFT": stft_cases,
        "DeformConv": deform_conv_cases,
    }
)
for _op in ["Add", "Sub", "Mul", "Div", "Pow", "Mod", "PRelu", "Max", "Min", "Sum", "Mean"]:
    GENERATORS[_op] = binary_cases
for _op in fg.REDUCTIONS + ["ReduceLogSum"]:
    GENERATORS[_op] = reduce_cases
for _op in [
    "Reshape",
    "Flatten",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Concat",
    "Split",
    "Expand",
    "Tile",
    "DepthToSpace",
    "SpaceToDepth",
]:
    GENERATORS[_op] = shape_op_cases
for _op in ["Gather", "GatherElements", "GatherND"]:
    GENERATORS[_op] = gather_cases
for _op in ["ScatterElements", "ScatterND", "Scatter"]:
    GENERATORS[_op] = scatter_cases
for _op in ["Range", "ReverseSequence", "OneHot", "Compress", "Unique"]:
    GENERATORS[_op] = selection_cases
GENERATORS["TensorScatter"] = tensor_scatter_cases
for _op in ["MatMul", "Gemm"]:
    GENERATORS[_op] = matmul_cases
for _op in ["Conv", "ConvTranspose"]:
    GENERATORS[_op] = conv_cases
for _op in ["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"]:
    GENERATORS[_op] = pool_cases
for _op in ["MaxPoolGrad", "AveragePoolGrad"]:
    GENERATORS[_op] = pool_grad_cases
for _op in ["BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization"]:
    GENERATORS[_op] = norm_cases
for _op in ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"]:
    GENERATORS[_op] = loss_cases
for _op in ["LSTM", "GRU", "RNN"]:
    GENERATORS[_op] = recurrent_cases
for _op in ["RMSNormalization", "SimplifiedLayerNormalization", "LpNormalization", "MeanVarianceNormalization", "LRN"]:
    GENERATORS[_op] = normalization_cases
for _op in ["LpPool", "GlobalLpPool", "MaxUnpool"]:
    GENERATORS[_op] = lp_pool_cases
for _op in ["GridSample", "AffineGrid", "RoiAlign", "MaxRoiPool"]:
    GENERATORS[_op] = sampling_cases
for _op in ["Det", "CenterCropPad", "Col2Im", "RotaryEmbedding", "DFT"]:
    GENERATORS[_op] = linear_map_cases
GENERATORS["Attention"] = attention_cases
GENERATORS["DequantizeLinear"] = dequantize_cases

OPS = sorted(GENERATORS)


def op_cases(op: str):
    """The strategy drawing OpCases of ``op``."""
    return GENERATORS[op](op)


def any_op_case():
    """An op (uniformly), then one of its cases."""
    return st.sampled_from(OPS).flatmap(op_cases)


# -- the comparisons ----------------------------------------------------------------------------

ELEMENTWISE_LIMIT = 24  # finite differences element by element up to this size, else by directions
DIRECTIONS = 3


def float_outputs(case: OpCase) -> tuple[list[int], dict[str, np.ndarray]]:
    """The outputs in the loss: those that are float64 in the float64 model (not integers, and not
    the float32 statistics LayerNormalization's schema fixes whatever X's type), and the outputs."""
    outs = Session(case.forward_model(np.float64)).run(case.feeds(np.float64))
    return [k for k in range(case.num_outputs) if outs[f"out{k}"].dtype == np.float64], outs


def gradients(case: OpCase, dtype, outputs: list[int], device: str = "cpu") -> dict[str, np.ndarray]:
    """gradgen's backward graph of the loss model in ``dtype``, run: forward outputs and gradients."""
    model = case.loss_model(dtype, outputs)
    wrt = [f"in{i}" for i in case.differentiated()]
    built = gradgen.build_backward(model, loss="loss", wrt=wrt)
    return Session(built.model, device=device).run(case.feeds(dtype))


def finite_differences(case: OpCase, outputs: list[int], name: str, grad: np.ndarray, eps=1e-6):
    """(numeric, analytic) pairs: every element of small tensors, random directions of larger ones."""
    static = dataclasses.replace(
        case, symbolic=False, graph_inputs=frozenset(i for i, a in enumerate(case.inputs) if a is not None)
    )
    static._weights = case.loss_weights(outputs)
    session = Session(static.loss_model(np.float64, outputs))
    feeds = static.feeds(np.float64)
    base = feeds[name]

    def loss(value):
        return float(session.run({**feeds, name: value})["loss"])

    if base.size <= ELEMENTWISE_LIMIT:
        numeric = np.zeros(base.size)
        for j in range(base.size):
            step = np.zeros(base.size)
            step[j] = eps
            numeric[j] = (loss(base + step.reshape(base.shape)) - loss(base - step.reshape(base.shape))) / (2 * eps)
        return numeric, grad.reshape(-1)
    rng = np.random.default_rng(base.size)
    numeric, analytic = [], []
    for _ in range(DIRECTIONS):
        v = rng.standard_normal(base.shape)
        v /= np.linalg.norm(v)
        numeric.append((loss(base + eps * v) - loss(base - eps * v)) / (2 * eps))
        analytic.append(float(np.sum(grad * v)))
    return np.array(numeric), np.array(analytic)


def _canonical(case: OpCase, outs: list[np.ndarray]) -> list[np.ndarray]:
    """Outputs whose order the spec leaves open, in one order: TopK with sorted=0 sorted by value."""
    if case.op_type == "TopK" and not case.attrs.get("sorted", 1) and outs[0].size:
        axis = case.attrs.get("axis", -1)
        order = np.argsort(outs[0], axis=axis, kind="stable")
        return [np.take_along_axis(o, order, axis=axis) for o in outs]
    return outs


# onnxruntime errors on valid models: its limitations, not gradgen's
ORT_RUN_LIMITS = [
    "'Linear' mode only supports",
    "'Cubic' mode only supports",
    "Dilation not supported for AutoPadType",
    "Explicit output_shape is inconsistent",
    "Unexpected mode of 3",
]  # (the last: wrap Pad of an empty tensor)


def compare_forward_with_ort(case: OpCase, ort) -> str:
    """The node's outputs in the case's dtype against onnxruntime; returns what was done."""
    if case.ort:
        return "ort skipped: " + case.ort
    model = case.forward_model()
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:
        if "NOT_IMPLEMENTED" in str(exc) or "Type Error: Type 'tensor(double)'" in str(exc):
            return "ort has no kernel for the type"
        limits = [text for text in ORT_RUN_LIMITS if text in str(exc)]
        if limits:
            return "ort limitation: " + limits[0]
        raise AssertionError(f"onnxruntime refused the model: {exc}\n{case.describe()}") from None
    feeds = case.feeds(case.dtype)
    try:
        want = _canonical(case, session.run(None, feeds))
    except Exception as exc:
        limits = [text for text in ORT_RUN_LIMITS if text in str(exc)]
        if limits:
            return "ort limitation: " + limits[0]
        raise AssertionError(f"onnxruntime failed: {exc}\n{case.describe()}") from None
    got = dict(enumerate(_canonical(case, [Session(model).run(feeds)[f"out{k}"] for k in range(len(want))])))
    got = {f"out{k}": v for k, v in got.items()}
    # float64: onnxruntime computes some double kernels with float constants (Gelu, HardSwish)
    tol = dict(rtol=1e-4, atol=1e-5) if case.dtype == np.float32 else dict(rtol=1e-6, atol=1e-7)
    if case.ort_tolerance:
        tol = dict(rtol=case.ort_tolerance, atol=case.ort_tolerance)
    for k, w in enumerate(want):
        g = got[f"out{k}"]
        assert g.shape == w.shape, f"out{k}: shape {g.shape} vs onnxruntime {w.shape}\n{case.describe()}"
        assert g.dtype == w.dtype, f"out{k}: dtype {g.dtype} vs onnxruntime {w.dtype}\n{case.describe()}"
        if _ort_softplus_overflows(case):
            w = np.where(np.isinf(w) & np.isfinite(g), g, w)
        scale = max(1.0, float(np.abs(w[np.isfinite(w)]).max(initial=0.0))) if w.dtype.kind == "f" else 1.0
        np.testing.assert_allclose(
            g, w, rtol=tol["rtol"], atol=tol["atol"] * scale, equal_nan=True, err_msg=f"out{k} vs onnxruntime\n{case.describe()}"
        )
    return "ort compared"


def _ort_softplus_overflows(case: OpCase) -> bool:
    """A recurrent op with a Softplus activation: ONNX Runtime computes it as log(1 + exp(x)), inf
    from x = 89 on in float32 (an LSTM whose Affine gates grew its cell to 115 gave an inf output
    where log-add-exp gives 115), so its infinities there are not compared."""
    return case.op_type in ("LSTM", "GRU", "RNN") and "Softplus" in case.attrs.get("activations", ())


def check_gradients_fd(case: OpCase, outputs: list[int]) -> dict[str, np.ndarray]:
    """float64 gradients against finite differences; returns them."""
    got = gradients(case, np.float64, outputs)
    for i in case.differentiated():
        name = f"in{i}"
        grad = got[f"{name}_grad"]
        value = case.inputs[i]
        assert grad.shape == value.shape and grad.dtype == np.float64, (
            f"{name}_grad: {grad.dtype}{list(grad.shape)} for {list(value.shape)}\n{case.describe()}"
        )
        assert np.all(np.isfinite(grad)), f"{name}_grad is not finite\n{case.describe()}"
        if not value.size:
            continue
        numeric, analytic = finite_differences(case, outputs, name, grad)
        scale = max(1.0, float(np.abs(numeric).max(initial=0.0)))
        np.testing.assert_allclose(
            analytic,
            numeric,
            rtol=case.fd_rtol,
            atol=1e-6 * scale,
            err_msg=f"gradient of {name} vs finite differences\n{case.describe()}",
        )
    return got


def check_low_precision(case: OpCase, outputs: list[int], reference: dict[str, np.ndarray]) -> None:
    """The backward graph in the case's own dtype: gradients of that dtype, close to the float64 ones."""
    got = gradients(case, case.dtype, outputs)
    for i in case.differentiated():
        name = f"in{i}_grad"
        want = reference[name]
        assert got[name].dtype == np.dtype(case.dtype) and got[name].shape == want.shape, (
            f"{name}: {got[name].dtype}{list(got[name].shape)}\n{case.describe()}"
        )
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(
            got[name],
            want,
            rtol=2e-3,
            atol=2e-4 * scale,
            err_msg=f"{name} in {np.dtype(case.dtype).name} vs float64\n{case.describe()}",
        )


def check_against_torch(case: OpCase, outputs: list[int], reference: dict[str, np.ndarray]) -> bool:
    """The float64 gradients (and forward) against torch.autograd on the same loss, where TORCH has the op."""
    fn = TORCH.get(case.op_type)
    if fn is None or not case.torch:
        return False
    import torch

    diff = case.differentiated()
    tensors = [
        None if a is None else torch.tensor(np.asarray(a), requires_grad=i in diff) for i, a in enumerate(case.arrays(np.float64))
    ]
    # attributes as the model holds them: floats in float32
    attrs = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in case.attrs.items()}
    outs = fn(case, tensors, attrs)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    if outs and outs[0] is NotImplemented:
        return False
    outs = [outs[k] for k in outputs]
    weights = {k: np.asarray(w) for k, w in case.loss_weights(outputs).items()}
    assert len(outs) == len(outputs), f"torch gave {len(outs)} float outputs for {len(outputs)}\n{case.describe()}"
    loss = sum((o.double() * torch.tensor(weights[k])).sum() for o, k in zip(outs, outputs))
    np.testing.assert_allclose(
        float(loss.detach()), float(reference["loss"]), rtol=1e-9, atol=1e-9, err_msg=f"loss vs torch\n{case.describe()}"
    )
    wanted = [tensors[i] for i in diff]
    grads = torch.autograd.grad(loss, wanted, allow_unused=True) if loss.requires_grad else [None] * len(wanted)
    for i, g in zip(diff, grads):
        want = np.zeros(case.inputs[i].shape) if g is None else g.numpy()
        got = reference[f"in{i}_grad"]
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(
            got, want, rtol=1e-7, atol=1e-9 * scale, err_msg=f"gradient of in{i} vs torch\n{case.describe()}"
        )
    return True


def check_case(case: OpCase, ort=None) -> list[str]:
    """Every comparison for one case on the CPU; returns what was compared (for statistics)."""
    outputs, _ = float_outputs(case)
    if not outputs:  # nothing differentiable comes out (e.g. every output an integer)
        return ["no float output"]
    done = [compare_forward_with_ort(case, ort) if ort is not None else "ort not installed"]
    reference = check_gradients_fd(case, outputs)
    done.append("finite differences")
    if check_against_torch(case, outputs, reference):
        done.append("torch")
    if case.dtype != np.float64:
        check_low_precision(case, outputs, reference)
        done.append("float32 backward")
    return done


def check_case_on_cuda(case: OpCase) -> None:
    """The forward node and the backward graph in the case's dtype: CUDA executor against the CPU."""
    outputs, _ = float_outputs(case)
    if not outputs:
        return
    forward, feeds = case.forward_model(), case.feeds(case.dtype)
    pairs = [(Session(forward).run(feeds), Session(forward, device="cuda").run(feeds))]
    pairs.append((gradients(case, case.dtype, outputs), gradients(case, case.dtype, outputs, device="cuda")))
    tol = dict(rtol=1e-4, atol=1e-5) if case.dtype == np.float32 else dict(rtol=1e-9, atol=1e-11)
    for want_all, got_all in pairs:
        for name, want in want_all.items():
            got = got_all[name]
            assert got.shape == want.shape and got.dtype == want.dtype, (
                f"{name}: cuda {got.dtype}{list(got.shape)} vs cpu {want.dtype}{list(want.shape)}\n{case.describe()}"
            )
            scale = max(1.0, float(np.abs(want[np.isfinite(want)]).max(initial=0.0))) if want.dtype.kind == "f" else 1
            np.testing.assert_allclose(
                got,
                want,
                rtol=tol["rtol"],
                atol=tol["atol"] * scale,
                equal_nan=True,
                err_msg=f"{name}: cuda vs cpu\n{case.describe()}",
            )


# -- PyTorch references (float64) -----------------------------------------------------------------


def _torch_unary(name):
    def fn(case, t, attrs):
        import torch

        return getattr(torch, name)(t[0])

    return fn


def _reduce_axes(case, attrs, rank):
    axes = attrs.get("axes")
    if len(case.inputs) > 1 and case.inputs[1] is not None:
        axes = [int(a) for a in case.inputs[1]]
    if not axes:
        if axes == [] and attrs.get("noop_with_empty_axes"):
            return None
        return list(range(rank))
    return [a % rank for a in axes]


def _torch_reduce(kind):
    def fn(case, t, attrs):
        import torch

        x = t[0]
        axes = _reduce_axes(case, attrs, x.ndim)
        keep = bool(attrs.get("keepdims", 1))
        if not axes:  # noop_with_empty_axes: the reduction over no axis, element by element
            return {"sumsquare": x * x, "l1": x.abs(), "l2": x.abs(), "logsum": torch.log(x)}.get(kind, x)
        if kind == "max":
            return torch.amax(x, dim=axes, keepdim=keep)
        if kind == "min":
            return torch.amin(x, dim=axes, keepdim=keep)
        if kind == "prod":
            y = x
            for a in sorted(axes, reverse=True):
                y = torch.prod(y, dim=a, keepdim=True)
            return y if keep else y.reshape([d for i, d in enumerate(x.shape) if i not in axes])
        ops = {
            "sum": lambda: x.sum(dim=axes, keepdim=keep),
            "mean": lambda: x.mean(dim=axes, keepdim=keep),
            "sumsquare": lambda: (x * x).sum(dim=axes, keepdim=keep),
            "l1": lambda: x.abs().sum(dim=axes, keepdim=keep),
            "l2": lambda: torch.sqrt((x * x).sum(dim=axes, keepdim=keep)),
            "logsum": lambda: torch.log(x.sum(dim=axes, keepdim=keep)),
            "logsumexp": lambda: torch.logsumexp(x, dim=axes, keepdim=keep),
        }
        return ops[kind]()

    return fn


def _torch_variadic(kind):
    def fn(case, t, attrs):
        import torch

        out = t[0]
        for other in t[1:]:
            out = {"max": torch.maximum, "min": torch.minimum}.get(kind, torch.add)(out, other)
        return out / len(t) if kind == "mean" else out

    return fn


def _torch_softmax(log):
    def fn(case, t, attrs):
        import torch

        x = t[0]
        axis = attrs.get("axis", -1 if case.opset >= 13 else 1)
        if case.opset < 13:  # coerced to 2-D at axis
            a = axis % x.ndim
            flat = x.reshape(int(np.prod(x.shape[:a], dtype=np.int64)), int(np.prod(x.shape[a:], dtype=np.int64)))
            f = torch.log_softmax if log else torch.softmax
            return f(flat, dim=1).reshape(x.shape)
        return (torch.log_softmax if log else torch.softmax)(x, dim=axis)

    return fn


def _torch_matmul(case, t, attrs):
    import torch

    return torch.matmul(t[0], t[1])


def _torch_gemm(case, t, attrs):
    a = t[0].T if attrs.get("transA") else t[0]
    b = t[1].T if attrs.get("transB") else t[1]
    y = attrs.get("alpha", 1.0) * (a @ b)
    if len(t) > 2 and t[2] is not None:
        y = y + attrs.get("beta", 1.0) * t[2]
    return y


def _torch_conv(case, t, attrs):
    import torch.nn.functional as F

    if "auto_pad" in attrs:
        return NotImplemented
    x, w = t[0], t[1]
    b = t[2] if len(t) > 2 else None
    nd = x.ndim - 2
    pads = attrs.get("pads", [0] * (2 * nd))
    widths = []
    for i in reversed(range(nd)):
        widths += [pads[i], pads[nd + i]]
    x = F.pad(x, widths)
    fn = [F.conv1d, F.conv2d, F.conv3d][nd - 1]
    return fn(x, w, b, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1), groups=attrs.get("group", 1))


def _torch_pool(case, t, attrs):
    import torch.nn.functional as F

    x = t[0]
    nd = x.ndim - 2
    pads = attrs.get("pads", [0] * (2 * nd))
    kernel, strides = attrs["kernel_shape"], attrs.get("strides", [1] * nd)
    dil = attrs.get("dilations", [1] * nd)
    if "auto_pad" in attrs or pads[:nd] != pads[nd:] or any(2 * p > k for p, k in zip(pads[:nd], kernel)):
        return NotImplemented
    ceil = bool(attrs.get("ceil_mode", 0))
    if case.op_type == "MaxPool":
        if case.num_outputs > 1:
            return NotImplemented
        fn = [F.max_pool1d, F.max_pool2d, F.max_pool3d][nd - 1]
        return fn(x, kernel, strides, pads[:nd], dil, ceil_mode=ceil)
    if any(d > 1 for d in dil):
        return NotImplemented
    fn = [F.avg_pool1d, F.avg_pool2d, F.avg_pool3d][nd - 1]
    return fn(x, kernel, strides, pads[:nd], ceil_mode=ceil, count_include_pad=bool(attrs.get("count_include_pad", 0)))


def _torch_global(kind):
    def fn(case, t, attrs):
        x = t[0]
        axes = list(range(2, x.ndim))
        return x.mean(dim=axes, keepdim=True) if kind == "avg" else x.amax(dim=axes, keepdim=True)

    return fn


def _torch_loss(case, t, attrs):
    """Written out (F.cross_entropy refuses a gradient for its class weights)."""
    import torch

    x, labels = t[0], t[1].long()
    weight = t[2] if len(t) > 2 else None
    reduction = attrs.get("reduction", "mean")
    ignore = attrs.get("ignore_index")
    logp = torch.log_softmax(x, dim=1) if case.op_type == "SoftmaxCrossEntropyLoss" else x
    used = torch.ones_like(labels, dtype=torch.bool) if ignore is None else labels != ignore
    safe = torch.where(used, labels, torch.zeros_like(labels))
    picked = torch.gather(logp, 1, safe.unsqueeze(1)).squeeze(1)
    w = used.double() if weight is None else torch.where(used, weight[safe], torch.zeros_like(picked))
    loss = -picked * w
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / w.sum()
    return (loss, logp) if case.num_outputs > 1 else loss


def _torch_layer_norm(case, t, attrs):
    import torch

    x = t[0]
    axis = attrs.get("axis", -1) % x.ndim
    dims_ = list(range(axis, x.ndim))
    mean = x.mean(dim=dims_, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=dims_, keepdim=True)
    inv = 1 / torch.sqrt(var + attrs.get("epsilon", 1e-5))
    y = (x - mean) * inv * t[1]
    if len(t) > 2 and t[2] is not None:
        y = y + t[2]
    return (y, mean, inv)[: case.num_outputs]


def _torch_batch_norm(case, t, attrs):
    import torch

    x, scale, bias, mean, var = t
    shape_ = (1, -1) + (1,) * (x.ndim - 2)
    eps = attrs.get("epsilon", 1e-5)
    if not attrs.get("training_mode"):
        return (x - mean.reshape(shape_)) / torch.sqrt(var.reshape(shape_) + eps) * scale.reshape(shape_) + bias.reshape(shape_)
    axes = [0] + list(range(2, x.ndim))
    bm = x.mean(dim=axes)
    bv = ((x - bm.reshape(shape_)) ** 2).mean(dim=axes)
    y = (x - bm.reshape(shape_)) / torch.sqrt(bv.reshape(shape_) + eps) * scale.reshape(shape_) + bias.reshape(shape_)
    m = attrs.get("momentum", 0.9)
    return (y, mean * m + bm * (1 - m), var * m + bv * (1 - m))[: case.num_outputs]


def _torch_instance_norm(case, t, attrs):
    import torch

    x = t[0]
    axes = list(range(2, x.ndim))
    shape_ = (1, -1) + (1,) * (x.ndim - 2)
    mean = x.mean(dim=axes, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=axes, keepdim=True)
    return (x - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5)) * t[1].reshape(shape_) + t[2].reshape(shape_)


def _torch_group_norm(case, t, attrs):
    import torch

    x = t[0]
    g = attrs["num_groups"]
    n, c = x.shape[:2]
    xg = x.reshape(n, g, -1)
    mean = xg.mean(dim=2, keepdim=True)
    var = ((xg - mean) ** 2).mean(dim=2, keepdim=True)
    norm = ((xg - mean) / torch.sqrt(var + attrs.get("epsilon", 1e-5))).reshape(x.shape)
    scale, bias = t[1], t[2]
    if scale.numel() != c:
        scale, bias = scale.repeat_interleave(c // g), bias.repeat_interleave(c // g)
    shape_ = (1, -1) + (1,) * (x.ndim - 2)
    return norm * scale.reshape(shape_) + bias.reshape(shape_)


def _torch_gather(case, t, attrs):
    import torch

    x, idx = t[0], t[1].long()
    if case.op_type == "Gather":
        axis = attrs.get("axis", 0) % x.ndim
        idx = torch.where(idx < 0, idx + x.shape[axis], idx)
        flat = torch.index_select(x, axis, idx.reshape(-1))
        return flat.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1 :])
    if case.op_type == "GatherElements":
        axis = attrs.get("axis", 0) % x.ndim
        idx = torch.where(idx < 0, idx + x.shape[axis], idx)
        return torch.gather(x, axis, idx)
    return NotImplemented


def _torch_clip(case, t, attrs):
    import torch

    lo = t[1] if len(t) > 1 else None
    hi = t[2] if len(t) > 2 else None
    y = t[0]
    if lo is not None:
        y = torch.maximum(y, lo)
    if hi is not None:
        y = torch.minimum(y, hi)
    return y


def _torch_where(case, t, attrs):
    import torch

    return torch.where(t[0], t[1], t[2])


def _torch_pow(case, t, attrs):
    return t[0] ** t[1]


def _torch_prelu(case, t, attrs):
    import torch

    return torch.where(t[0] >= 0, t[0], t[0] * t[1])


def _torch_cumsum(case, t, attrs):
    import torch

    x = t[0]
    axis = int(case.inputs[1]) % x.ndim
    if attrs.get("reverse"):
        x = torch.flip(x, [axis])
    y = torch.cumsum(x, dim=axis)
    if attrs.get("exclusive"):
        y = y - x
    return torch.flip(y, [axis]) if attrs.get("reverse") else y


def _torch_trilu(case, t, attrs):
    import torch

    k = int(case.inputs[1]) if len(case.inputs) > 1 and case.inputs[1] is not None else 0
    return torch.triu(t[0], k) if attrs.get("upper", 1) else torch.tril(t[0], k)


def _torch_topk(case, t, attrs):
    import torch

    x = t[0]
    k = int(case.inputs[1][0])
    values, _ = torch.topk(x, k, dim=attrs.get("axis", -1), largest=bool(attrs.get("largest", 1)), sorted=True)
    if not attrs.get("sorted", 1):
        return NotImplemented
    return values


def _torch_einsum(case, t, attrs):
    import torch

    return torch.einsum(attrs["equation"], *t)


def _torch_transpose(case, t, attrs):
    x = t[0]
    return x.permute(list(attrs.get("perm", list(range(x.ndim))[::-1])))


def _torch_tile(case, t, attrs):
    return t[0].repeat(*[int(r) for r in case.inputs[1]]) if t[0].ndim else NotImplemented


def _torch_expand(case, t, attrs):
    import torch

    target = tuple(int(v) for v in case.inputs[1])
    out = np.broadcast_shapes(tuple(t[0].shape), target)
    return torch.broadcast_to(t[0], out)


def _torch_concat(case, t, attrs):
    import torch

    return torch.cat(t, dim=attrs["axis"])


def _torch_d2s(case, t, attrs):
    import torch.nn.functional as F

    x, b = t[0], attrs["blocksize"]
    if case.op_type == "SpaceToDepth":  # blocks outermost in the channels (not pixel_unshuffle's order)
        n, c, h, w = x.shape
        y = x.reshape(n, c, h // b, b, w // b, b).permute(0, 3, 5, 1, 2, 4)
        return y.reshape(n, c * b * b, h // b, w // b)
    if attrs.get("mode", "DCR") == "CRD":
        return F.pixel_shuffle(x, b)
    n, c, h, w = x.shape
    y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


def _torch_mod(case, t, attrs):
    import torch

    return torch.fmod(t[0], t[1])


def _torch_gelu(case, t, attrs):
    import torch.nn.functional as F

    return F.gelu(t[0], approximate=attrs.get("approximate", "none"))


def _torch_act(fn_name, **fixed):
    def fn(case, t, attrs):
        import torch.nn.functional as F

        kwargs = {k: attrs.get(k, v) for k, v in fixed.items()}
        if fn_name == "leaky_relu":
            return F.leaky_relu(t[0], kwargs["alpha"])
        if fn_name == "elu":
            return F.elu(t[0], kwargs["alpha"])
        if fn_name == "celu":
            return F.celu(t[0], kwargs["alpha"])
        if fn_name == "selu":
            import torch

            return kwargs["gamma"] * torch.where(t[0] > 0, t[0], kwargs["alpha"] * (torch.exp(t[0]) - 1))
        if fn_name == "hardsigmoid":
            import torch

            return torch.clamp(kwargs["alpha"] * t[0] + kwargs["beta"], 0, 1)
        if fn_name == "thresholded_relu":
            import torch

            return torch.where(t[0] > kwargs["alpha"], t[0], torch.zeros_like(t[0]))
        return getattr(F, fn_name)(t[0])

    return fn


TORCH: dict[str, Callable] = {
    **{
        op: _torch_unary(name)
        for op, name in [
            ("Neg", "neg"),
            ("Exp", "exp"),
            ("Tanh", "tanh"),
            ("Sigmoid", "sigmoid"),
            ("Erf", "erf"),
            ("Sin", "sin"),
            ("Cos", "cos"),
            ("Atan", "atan"),
            ("Asinh", "asinh"),
            ("Sinh", "sinh"),
            ("Cosh", "cosh"),
            ("Tan", "tan"),
            ("Abs", "abs"),
            ("Relu", "relu"),
            ("Sign", "sign"),
            ("Log", "log"),
            ("Sqrt", "sqrt"),
            ("Reciprocal", "reciprocal"),
            ("Acos", "acos"),
            ("Asin", "asin"),
            ("Atanh", "atanh"),
            ("Acosh", "acosh"),
            ("Floor", "floor"),
            ("Ceil", "ceil"),
            ("Round", "round"),
            ("Identity", "clone"),
        ]
    },
    "Softplus": _torch_act("softplus"),
    "Softsign": _torch_act("softsign"),
    "Mish": _torch_act("mish"),
    "HardSwish": _torch_act("hardswish"),
    "LeakyRelu": _torch_act("leaky_relu", alpha=0.01),
    "Elu": _torch_act("elu", alpha=1.0),
    "Celu": _torch_act("celu", alpha=1.0),
    "Selu": _torch_act("selu", alpha=1.67326319217681884765625, gamma=1.05070102214813232421875),
    "HardSigmoid": _torch_act("hardsigmoid", alpha=0.2, beta=0.5),
    "ThresholdedRelu": _torch_act("thresholded_relu", alpha=1.0),
    "Gelu": _torch_gelu,
    **{
        op: (lambda spec: lambda case, t, attrs: spec.torch(t[0], **attrs))(spec)
        for op, spec in UNARY_SPECS.items()
        if spec.torch is not None
    },
    "Add": lambda c, t, a: t[0] + t[1],
    "Sub": lambda c, t, a: t[0] - t[1],
    "Mul": lambda c, t, a: t[0] * t[1],
    "Div": lambda c, t, a: t[0] / t[1],
    "Pow": _torch_pow,
    "Mod": _torch_mod,
    "PRelu": _torch_prelu,
    "Max": _torch_variadic("max"),
    "Min": _torch_variadic("min"),
    "Sum": _torch_variadic("sum"),
    "Mean": _torch_variadic("mean"),
    "Where": _torch_where,
    "Clip": _torch_clip,
    "Softmax": _torch_softmax(False),
    "LogSoftmax": _torch_softmax(True),
    "CumSum": _torch_cumsum,
    "Trilu": _torch_trilu,
    "TopK": _torch_topk,
    "Einsum": _torch_einsum,
    "ReduceSum": _torch_reduce("sum"),
    "ReduceMean": _torch_reduce("mean"),
    "ReduceMax": _torch_reduce("max"),
    "ReduceMin": _torch_reduce("min"),
    "ReduceProd": _torch_reduce("prod"),
    "ReduceL1": _torch_reduce("l1"),
    "ReduceL2": _torch_reduce("l2"),
    "ReduceLogSum": _torch_reduce("logsum"),
    "ReduceLogSumExp": _torch_reduce("logsumexp"),
    "ReduceSumSquare": _torch_reduce("sumsquare"),
    "Transpose": _torch_transpose,
    "Tile": _torch_tile,
    "Expand": _torch_expand,
    "Concat": _torch_concat,
    "DepthToSpace": _torch_d2s,
    "SpaceToDepth": _torch_d2s,
    "Gather": _torch_gather,
    "GatherElements": _torch_gather,
    "MatMul": _torch_matmul,
    "Gemm": _torch_gemm,
    "Conv": _torch_conv,
    "MaxPool": _torch_pool,
    "AveragePool": _torch_pool,
    "GlobalAveragePool": _torch_global("avg"),
    "GlobalMaxPool": _torch_global("max"),
    "SoftmaxCrossEntropyLoss": _torch_loss,
    "NegativeLogLikelihoodLoss": _torch_loss,
    "LayerNormalization": _torch_layer_norm,
    "BatchNormalization": _torch_batch_norm,
    "InstanceNormalization": _torch_instance_norm,
    "GroupNormalization": _torch_group_norm,
}
