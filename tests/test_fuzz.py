"""Fuzzing: random small graphs against finite differences, random one-node cases against onnxruntime,
and every op with a gradient rule on its own (tests/fuzz_ops.py) against finite differences,
PyTorch and onnxruntime.

Profiles (environment variable GRADGEN_FUZZ_PROFILE): ``ci`` (default: few examples, derandomized,
well under a minute) and ``long`` (>= 1000 random graphs, and 1000 random op cases per seed with
``--hypothesis-seed``; see docs/FUZZ.md and docs/RELIABILITY.md).
"""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import GradgenError, RunError
from gradgen.executor import Session
from tests import fuzz_graphs as fg
from tests import fuzz_modules as fm
from tests import fuzz_ops as fo
from tests.gradcheck import numeric_gradient

ort = pytest.importorskip("onnxruntime")

_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, suppress_health_check=_HEALTH, print_blob=True)
settings.register_profile("long", max_examples=1200, deadline=None, suppress_health_check=_HEALTH, print_blob=True)
PROFILE = os.environ.get("GRADGEN_FUZZ_PROFILE", "ci")
GRAPHS = settings(settings.get_profile(PROFILE))
# kernel cases are cheaper and many: the ci profile takes fewer of each
KERNELS = settings(settings.get_profile(PROFILE), max_examples=25 if PROFILE == "ci" else 400)


# -- random graphs against finite differences ---------------------------------------------------


def _check_graph(graph: fg.FuzzGraph) -> None:
    assume(graph.margins_ok())
    model = graph.model()
    built = gradgen.build_backward(model, loss="loss", wrt=list(graph.inputs))
    got = _run_twice(Session(built.model), graph.inputs, graph.describe())
    forward = Session(model)
    for name, value in graph.inputs.items():
        want = numeric_gradient(forward, graph.inputs, name, 1e-6)
        grad = got[f"{name}_grad"]
        assert grad.shape == value.shape and grad.dtype == np.float64, f"{name}_grad\n{graph.describe()}"
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6 * scale, err_msg=f"gradient of {name}\n{graph.describe()}")


def _run_twice(session: Session, feeds: dict[str, np.ndarray], describe: str) -> dict[str, np.ndarray]:
    """Two runs of one session give the same bits and leave the feeds as they were: a step that
    writes into a constant, a feed or a buffer the next run still reads shows up here."""
    kept = {name: value.copy() for name, value in feeds.items()}
    first = session.run(feeds)
    first = {name: np.array(value, copy=True) for name, value in first.items()}
    second = session.run(feeds)
    for name, value in kept.items():
        np.testing.assert_array_equal(feeds[name], value, err_msg=f"feed {name} changed by a run\n{describe}")
    for name, value in first.items():
        np.testing.assert_array_equal(second[name], value, err_msg=f"{name}: the second run differs\n{describe}")
    return first


@GRAPHS
@given(fg.graphs())
def test_random_graph_gradients(graph):
    _check_graph(graph)


@GRAPHS
@given(fg.graphs(min_steps=1, max_steps=3, steps=["reduce", "slice", "gather", "matmul", "reshape", "concat"]))
def test_random_shape_and_index_graphs(graph):
    _check_graph(graph)


@GRAPHS
@given(fg.graphs())
def test_random_graphs_in_float32(graph):
    """The same graphs in float32 (the CPU's float32-only paths: oneDNN, the fused and in-place
    rewrites) give the float64 gradients to float32's accuracy, run after run."""
    assume(graph.margins_ok())
    wrt = list(graph.inputs)
    want = Session(gradgen.build_backward(graph.model(), loss="loss", wrt=wrt).model).run(graph.inputs)
    built = gradgen.build_backward(graph.model(dtype=np.float32), loss="loss", wrt=wrt).model
    feeds = {name: value.astype(np.float32) for name, value in graph.inputs.items()}
    got = _run_twice(Session(built), feeds, graph.describe())
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == np.float32, f"{name}: {g.dtype}{g.shape}\n{graph.describe()}"
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * scale, err_msg=f"{name}: float32 vs float64\n{graph.describe()}")


@pytest.mark.cuda
@GRAPHS
@given(fg.graphs(), st.sampled_from([np.float32, np.float64]))
def test_random_graphs_cuda_match_cpu(graph, dtype):
    """The backward graphs of random graphs, in float32 and float64, on the CUDA executor (pointwise
    fusion, the memory plan, in-place steps, recorded CUDA graphs) give the CPU's values, run after run."""
    assume(graph.margins_ok())
    model = graph.model(dtype=dtype)
    built = gradgen.build_backward(model, loss="loss", wrt=list(graph.inputs)).model
    feeds = {name: value.astype(dtype) for name, value in graph.inputs.items()}
    want = Session(built).run(feeds)
    got = _run_twice(Session(built, device="cuda"), feeds, graph.describe())
    rtol, atol = (1e-4, 1e-5) if dtype == np.float32 else (1e-9, 1e-11)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}\n{graph.describe()}"
        scale = max(1.0, float(np.abs(w).max(initial=0.0)))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale, err_msg=f"{name}: cuda vs cpu\n{graph.describe()}")


MODULE_CASES = int(os.environ.get("GRADGEN_FUZZ_MODULE_CASES", 8 if PROFILE == "ci" else 500))
MODULES = settings(settings.get_profile(PROFILE), max_examples=MODULE_CASES)
# the dynamo exporter (slower, and it needs onnxscript) only in the long profile
EXPORTERS = ("legacy", "dynamo") if PROFILE == "long" and importlib.util.find_spec("onnxscript") else ("legacy",)


@MODULES
@given(fm.module_cases(EXPORTERS))
def test_random_torch_models_match_torch(case):
    """Random stacks of real layers, exported by PyTorch: gradgen's loss and gradients in float64 and
    float32 against PyTorch autograd, the float32 portable graph's on ONNX Runtime, and the bf16
    build's, coarsely (tests/fuzz_modules.py)."""
    _check_model(case, portable=True, bf16=True)


@pytest.mark.cuda
@MODULES
@given(fm.module_cases(EXPORTERS))
def test_random_torch_models_match_torch_on_cuda(case):
    """The same models on the CUDA executor."""
    _check_model(case, device="cuda")


def _check_model(case: fm.ModuleCase, **options) -> None:
    """``fuzz_modules.check``; a model PyTorch or its exporter gets wrong is not a case."""
    pytest.importorskip("torch")
    try:
        fm.check(case, **options)
    except fm.InvalidCase:
        assume(False)


# -- kernels against onnxruntime --------------------------------------------------------------


def _compare(case: fg.KernelCase, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """gradgen's kernel agrees with onnxruntime: same values, or both refuse the input."""
    try:
        session = ort.InferenceSession(case.model().SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime lacks a kernel for this type (e.g. Erf on doubles): no reference
        assume("NOT_IMPLEMENTED" not in str(exc))
        session = None
    try:
        if session is None:
            raise RuntimeError("onnxruntime refused the model")
        want = session.run(None, case.feeds())
    except Exception:  # onnxruntime refuses: gradgen must refuse with a clear error
        with pytest.raises(GradgenError):
            Session(case.model()).run(case.feeds())
        return
    got = Session(case.model()).run(case.feeds())
    for k, w in enumerate(want):
        g = got[f"out{k}"]
        assert g.shape == w.shape, f"out{k}: shape {g.shape} vs onnxruntime {w.shape}: {case.describe()}"
        assert g.dtype == w.dtype, f"out{k}: dtype {g.dtype} vs onnxruntime {w.dtype}: {case.describe()}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=case.describe())


def _rng(draw) -> np.random.Generator:
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


UNARY_KERNELS = [
    "Neg",
    "Abs",
    "Exp",
    "Tanh",
    "Sigmoid",
    "Relu",
    "Softplus",
    "Erf",
    "Sin",
    "Cos",
    "Floor",
    "Ceil",
    "Sign",
    "Reciprocal",
    "Sqrt",
    "Log",
    "Softsign",
    "Round",
    "Atan",
    "Elu",
    "Selu",
    "HardSigmoid",
    "LeakyRelu",
    "Identity",
]
BINARY_KERNELS = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Equal", "Less", "Greater", "Where"]


@st.composite
def elementwise_cases(draw):
    rng = _rng(draw)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    if draw(st.booleans()):
        op = draw(st.sampled_from(UNARY_KERNELS))
        x = fg.float_array(rng, fg.shapes(draw), dtype)
        if op in ("Sqrt", "Log", "Reciprocal"):
            x = np.abs(x) + np.asarray(0.1, dtype)
        return fg.KernelCase(op, [x])
    op = draw(st.sampled_from(BINARY_KERNELS))
    shape = fg.shapes(draw)
    other, _ = fg._broadcast_partner(draw, shape) if 0 not in shape else (shape, shape)
    a, b = fg.float_array(rng, shape, dtype), fg.float_array(rng, other, dtype)
    if draw(st.booleans()):
        a, b = b, a
    if op == "Pow":
        a = np.abs(a) + np.asarray(0.5, dtype)
    if op == "Div":
        b = np.where(np.abs(b) < 0.1, np.asarray(1, dtype), b)
    if op == "Where":
        return fg.KernelCase(op, [rng.random(a.shape) < 0.5, a, b])
    return fg.KernelCase(op, [a, b])


@KERNELS
@given(elementwise_cases())
def test_elementwise_kernels(case):
    _compare(case)


@st.composite
def reduction_cases(draw):
    rng = _rng(draw)
    op = draw(st.sampled_from(fg.REDUCTIONS + ["Softmax", "LogSoftmax", "ArgMax", "ArgMin", "CumSum"]))
    empty_ok = op in ("ReduceSum", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceProd", "Softmax", "LogSoftmax", "CumSum")
    shape = fg.shapes(draw, low=0 if empty_ok else 1)
    rank = len(shape)
    x = fg.float_array(rng, shape, draw(st.sampled_from([np.float32, np.float64])))
    if op in ("Softmax", "LogSoftmax", "ArgMax", "ArgMin", "CumSum"):
        if rank == 0:
            shape, x, rank = (2,), x.reshape(1).repeat(2) + np.array([0, 1], x.dtype), 1
        axis = draw(st.integers(-rank, rank - 1))
        if op == "CumSum":
            return fg.KernelCase(
                op,
                [x, np.array(axis, np.int64)],
                {"exclusive": draw(st.sampled_from([0, 1])), "reverse": draw(st.sampled_from([0, 1]))},
                const=(1,),
            )
        attrs = {"axis": axis}
        if op.startswith("Arg"):
            attrs["keepdims"] = draw(st.sampled_from([0, 1]))
        return fg.KernelCase(op, [x], attrs)
    attrs = {"keepdims": draw(st.sampled_from([0, 1]))}
    if rank and draw(st.booleans()):
        axes = sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1)))
        axes = [a - rank if draw(st.booleans()) else a for a in axes]
        return fg.KernelCase(op, [x, np.array(axes, np.int64)], attrs, const=(1,))
    return fg.KernelCase(op, [x], attrs)


@KERNELS
@given(reduction_cases())
def test_reduction_kernels(case):
    _compare(case, rtol=1e-4, atol=1e-5)


@st.composite
def shape_cases(draw):
    rng = _rng(draw)
    op = draw(
        st.sampled_from(
            ["Transpose", "Reshape", "Concat", "Slice", "Squeeze", "Unsqueeze", "Expand", "Tile", "Pad", "Flatten", "Split"]
        )
    )
    shape = fg.shapes(draw, low=0)
    rank = len(shape)
    x = fg.float_array(rng, shape, np.float32)
    if op == "Transpose":
        return fg.KernelCase(op, [x], {"perm": list(draw(st.permutations(range(rank))))} if rank else {})
    if op == "Reshape":
        flat = [int(np.prod(shape))] if draw(st.booleans()) else [-1]
        if 0 in shape and flat == [-1]:
            flat = [0] if rank else [0]
            return fg.KernelCase(op, [x, np.array(list(shape), np.int64)], const=(1,))
        return fg.KernelCase(op, [x, np.array(flat, np.int64)], const=(1,))
    if op == "Flatten":
        return fg.KernelCase(op, [x], {"axis": draw(st.integers(-rank, rank))} if rank else {})
    if rank == 0:
        return fg.KernelCase("Unsqueeze", [x, np.array([0], np.int64)], const=(1,))
    axis = draw(st.integers(-rank, rank - 1))
    if op == "Concat":
        other = list(shape)
        other[axis] = draw(st.integers(0, 2))
        return fg.KernelCase(op, [x, fg.float_array(rng, other, np.float32)], {"axis": axis})
    if op == "Slice":
        n = shape[axis]
        bound = st.one_of(st.integers(-n - 2, n + 2), st.sampled_from([fg.INT64_MAX, fg.INT64_MIN]))
        step = draw(st.sampled_from([1, 2, -1, -3]))
        start, end = draw(bound), draw(bound)
        # onnxruntime reads end = INT64_MAX with a negative step as "to the front", the spec clamps it to
        # n - 1 (gradgen follows the spec): test_regression_slice_int64_max_end_negative_step pins it
        assume(not (end == fg.INT64_MAX and step < 0))
        return fg.KernelCase(op, [x, np.array([start]), np.array([end]), np.array([axis]), np.array([step])], const=(1, 2, 3, 4))
    if op == "Squeeze":
        ones = [i for i, d in enumerate(shape) if d == 1]
        if not ones:
            return fg.KernelCase(op, [x])
        return fg.KernelCase(op, [x, np.array([draw(st.sampled_from(ones))], np.int64)], const=(1,))
    if op == "Unsqueeze":
        return fg.KernelCase(op, [x, np.array([draw(st.integers(-rank - 1, rank))], np.int64)], const=(1,))
    if op == "Expand":
        target = tuple(draw(st.integers(1, 3)) if d == 1 else d for d in shape)
        return fg.KernelCase(op, [x, np.array(list(target), np.int64)], const=(1,))
    if op == "Tile":
        return fg.KernelCase(op, [x, np.array(fg._dims(draw, rank, 0, 2), np.int64)], const=(1,))
    if op == "Split":
        n = shape[axis]
        parts = draw(st.integers(1, 3))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=parts - 1, max_size=parts - 1)))
        sizes = np.diff([0, *cuts, n]).astype(np.int64)
        return fg.KernelCase(op, [x, sizes], {"axis": axis}, const=(1,), num_outputs=len(sizes))
    pads = fg._dims(draw, 2 * rank, 0, 2)
    mode = draw(st.sampled_from(["constant", "edge", "reflect"]))
    if mode != "constant" and 0 in shape:
        mode = "constant"
    if mode == "reflect":
        pads = tuple(min(p, shape[i % rank] - 1) for i, p in enumerate(pads))
    return fg.KernelCase(op, [x, np.array(pads, np.int64)], {"mode": mode}, const=(1,))


@KERNELS
@given(shape_cases())
def test_shape_kernels(case):
    _compare(case)


@st.composite
def index_cases(draw):
    """Gather-like ops with index values drawn from the extremes: -n, n - 1, and one past (n, -n - 1)."""
    rng = _rng(draw)
    op = draw(st.sampled_from(["Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND"]))
    shape = fg._dims(draw, draw(st.integers(1, 3)), 1, 3)
    rank = len(shape)
    x = fg.float_array(rng, shape, np.float32)
    axis = draw(st.integers(-rank, rank - 1))
    n = shape[axis]
    past = draw(st.integers(0, 5)) == 0
    values = st.sampled_from([-n, n - 1, 0]) | st.integers(-n, n - 1)
    if op in ("Gather", "GatherElements", "ScatterElements"):
        if op == "Gather":
            idx_shape = fg._dims(draw, draw(st.integers(0, 2)), 0, 3)
        else:
            idx_shape = tuple(
                draw(st.integers(0, d)) if i != axis % rank else draw(st.integers(0, 3)) for i, d in enumerate(shape)
            )
        size = int(np.prod(idx_shape))
        idx = np.array(draw(st.lists(values, min_size=size, max_size=size)), np.int64).reshape(idx_shape)
        if past and size:
            idx.reshape(-1)[draw(st.integers(0, size - 1))] = draw(st.sampled_from([n, -n - 1]))
        if op == "ScatterElements":
            # one index per target: unique positions keep the result deterministic
            if idx.size:
                idx = _unique_along(idx, axis % rank, n, past)
            return fg.KernelCase(op, [x, idx, fg.float_array(rng, idx.shape, np.float32)], {"axis": axis})
        return fg.KernelCase(op, [x, idx], {"axis": axis})
    k = draw(st.integers(1, rank))
    count = draw(st.integers(0, 3))
    idx = np.stack(
        [
            np.array(draw(st.lists(st.integers(-shape[j], shape[j] - 1), min_size=count, max_size=count)), np.int64)
            for j in range(k)
        ],
        axis=-1,
    ).reshape(count, k)
    if past and count:
        j = draw(st.integers(0, k - 1))
        idx[draw(st.integers(0, count - 1)), j] = draw(st.sampled_from([shape[j], -shape[j] - 1]))
    if op == "GatherND":
        return fg.KernelCase(op, [x, idx])
    keys = {tuple(np.mod(row, shape[:k])) for row in idx}
    if len(keys) != count:
        idx = idx[:0]
    updates = fg.float_array(rng, (idx.shape[0],) + shape[k:], np.float32)
    return fg.KernelCase(op, [x, idx, updates])


def _unique_along(idx: np.ndarray, axis: int, n: int, past: bool) -> np.ndarray:
    """Indices whose targets are distinct: along ``axis``, a permutation prefix (keeping one bad value)."""
    moved = np.moveaxis(idx.copy(), axis, -1)
    length = moved.shape[-1]
    if length > n:
        moved = moved[..., :n]
        length = n
    base = np.arange(length) - (n if length and idx.min() < 0 else 0)
    bad = [v for v in idx.reshape(-1) if not -n <= v < n]
    moved[...] = base
    if past and bad and moved.size:
        moved.reshape(-1)[0] = bad[0]
    return np.moveaxis(moved, -1, axis)


@KERNELS
@given(index_cases())
@example(fg.KernelCase("Gather", [np.arange(3, dtype=np.float32), np.array([-3, 2], np.int64)], {"axis": 0}))
@example(fg.KernelCase("Gather", [np.arange(3, dtype=np.float32), np.array([3], np.int64)], {"axis": 0}))
@example(fg.KernelCase("Gather", [np.arange(3, dtype=np.float32), np.array([-4], np.int64)], {"axis": 0}))
@example(fg.KernelCase("GatherElements", [np.ones((2, 2), np.float32), np.array([[1, -2]], np.int64)], {"axis": -1}))
def test_index_kernels(case):
    _compare(case)


def test_index_one_past_the_end_names_node_and_index():
    case = fg.KernelCase("Gather", [np.arange(6, dtype=np.float32).reshape(3, 2), np.array([0, 3], np.int64)], {"axis": 0})
    with pytest.raises(RunError, match=r"node 'node' \(Gather\).*index 3.*axis 0"):
        Session(case.model()).run(case.feeds())
    valid = fg.KernelCase("Gather", [case.inputs[0], np.array([-3, 2], np.int64)], {"axis": 0})
    _compare(valid)


@st.composite
def matmul_cases(draw):
    rng = _rng(draw)
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    m, k, n = (draw(st.integers(0, 3)) for _ in range(3))
    if draw(st.booleans()):
        batch = fg._dims(draw, draw(st.integers(0, 2)), 1, 3)
        other = tuple(1 if draw(st.booleans()) else d for d in batch[draw(st.integers(0, len(batch))) :])
        a_shape = batch + (m, k) if draw(st.integers(0, 4)) else (k,)
        b_shape = other + (k, n) if draw(st.integers(0, 4)) else (k,)
        return fg.KernelCase("MatMul", [fg.float_array(rng, a_shape, dtype), fg.float_array(rng, b_shape, dtype)])
    trans_a, trans_b = draw(st.sampled_from([0, 1])), draw(st.sampled_from([0, 1]))
    a = fg.float_array(rng, (k, m) if trans_a else (m, k), dtype)
    b = fg.float_array(rng, (n, k) if trans_b else (k, n), dtype)
    c_shape = draw(st.sampled_from([(m, n), (n,), (1, n), (m, 1), ()]))
    c = fg.float_array(rng, c_shape, dtype) if draw(st.booleans()) else None
    attrs = {
        "transA": trans_a,
        "transB": trans_b,
        "alpha": draw(st.sampled_from([1.0, 0.5, -2.0])),
        "beta": draw(st.sampled_from([1.0, 0.0, 3.0])),
    }
    return fg.KernelCase("Gemm", [a, b] + ([c] if c is not None else []), attrs)


@KERNELS
@given(matmul_cases())
def test_matmul_kernels(case):
    _compare(case, rtol=1e-4, atol=1e-5)


@st.composite
def nn_cases(draw):
    rng = _rng(draw)
    op = draw(
        st.sampled_from(
            [
                "Conv",
                "MaxPool",
                "AveragePool",
                "LayerNormalization",
                "BatchNormalization",
                "GlobalAveragePool",
                "InstanceNormalization",
            ]
        )
    )
    spatial = draw(st.integers(1, 2))
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 4))
    size = fg._dims(draw, spatial, 3, 6)
    x = fg.float_array(rng, (n, c) + size, np.float32)
    if op in ("Conv", "MaxPool", "AveragePool"):
        kernel = fg._dims(draw, spatial, 1, 3)
        strides = fg._dims(draw, spatial, 1, 2)
        pads = [draw(st.integers(0, k - 1)) for k in kernel] * 2
        attrs = {"kernel_shape": list(kernel), "strides": list(strides), "pads": pads}
        if op == "Conv":
            group = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
            m = group * draw(st.integers(1, 2))
            attrs["group"] = group
            attrs["dilations"] = list(fg._dims(draw, spatial, 1, 2))
            w = fg.float_array(rng, (m, c // group) + kernel, np.float32)
            bias = [fg.float_array(rng, (m,), np.float32)] if draw(st.booleans()) else []
            return fg.KernelCase(op, [x, w, *bias], attrs)
        if op == "AveragePool":
            attrs["count_include_pad"] = draw(st.sampled_from([0, 1]))
        attrs["ceil_mode"] = draw(st.sampled_from([0, 1]))
        if attrs["ceil_mode"]:
            attrs["pads"] = [0] * (2 * spatial)  # ORT and the spec differ on ceil_mode windows in the pads
        return fg.KernelCase(op, [x], attrs)
    if op == "GlobalAveragePool":
        return fg.KernelCase(op, [x])
    if op == "LayerNormalization":
        axis = draw(st.integers(-x.ndim + 1, x.ndim - 1))
        norm_shape = x.shape[axis % x.ndim :]
        return fg.KernelCase(
            op,
            [x, fg.float_array(rng, norm_shape, np.float32), fg.float_array(rng, norm_shape, np.float32)],
            {"axis": axis, "epsilon": 1e-5},
        )
    scale, bias = fg.float_array(rng, (c,), np.float32), fg.float_array(rng, (c,), np.float32)
    if op == "InstanceNormalization":
        return fg.KernelCase(op, [x, scale, bias])
    mean, var = fg.float_array(rng, (c,), np.float32), np.abs(fg.float_array(rng, (c,), np.float32)) + 0.5
    return fg.KernelCase(op, [x, scale, bias, mean, var])


@KERNELS
@given(nn_cases())
def test_nn_kernels(case):
    _compare(case, rtol=1e-4, atol=1e-4)


@st.composite
def loss_cases(draw):
    rng = _rng(draw)
    op = draw(st.sampled_from(["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"]))
    n, c = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    extra = fg._dims(draw, draw(st.integers(0, 1)), 1, 3)
    x = fg.float_array(rng, (n, c) + extra, draw(st.sampled_from([np.float32, np.float64])))
    labels = rng.integers(0, c, (n,) + extra).astype(np.int64)
    attrs = {"reduction": draw(st.sampled_from(["mean", "sum", "none"]))}
    if draw(st.booleans()):
        attrs["ignore_index"] = int(draw(st.sampled_from([0, -1, c - 1])))
    inputs = [x, labels]
    if draw(st.booleans()):
        inputs.append(np.abs(fg.float_array(rng, (c,), x.dtype)) + np.asarray(0.1, x.dtype))
    return fg.KernelCase(op, inputs, attrs, num_outputs=2 if op.startswith("Softmax") and draw(st.booleans()) else 1)


@KERNELS
@given(loss_cases())
def test_loss_kernels(case):
    _compare(case, rtol=1e-4, atol=1e-5)


# -- one op at a time: every op with a gradient rule (tests/fuzz_ops.py) --------------------------

# ci: two derandomized cases per op (the simplest draw and one more); long: see test_op_fuzz_long
OP_CASES = settings(settings.get_profile(PROFILE), max_examples=2 if PROFILE == "ci" else 20)
OP_FUZZ_LONG = settings(settings.get_profile(PROFILE), max_examples=2000)


def test_every_rule_is_fuzzed():
    """Every op with a gradient rule has a case generator (and a new rule needs one). If, Loop and
    Scan are no one-node cases (their bodies read the graph's values): tests/test_control_flow.py
    checks them."""
    rules = {op for (domain, op), rule in gradgen.grads.all_rules().items() if rule.differentiable and not domain}
    rules -= {"If", "Loop", "Scan"}
    rules -= {"DynamicQuantizeLinear"}  # its rule always refuses: tests/test_non_tensor_ops.py
    rules -= {"QuantizeLinear"}  # its rule always refuses: tests/test_quantize.py
    assert not rules - set(fo.OPS), f"ops with a gradient rule but no fuzz generator: {sorted(rules - set(fo.OPS))}"
    assert not set(fo.OPS) - rules, f"generators for ops without a rule: {sorted(set(fo.OPS) - rules)}"


@pytest.mark.parametrize("op", fo.OPS)
@OP_CASES
@given(data=st.data())
def test_op_gradients(op, data):
    """One random node of ``op``: forward vs onnxruntime, gradients vs finite differences (float64),
    vs PyTorch (where it has the op), and the float32 backward graph vs the float64 one."""
    fo.check_case(data.draw(fo.op_cases(op), label="case"), ort)


@pytest.mark.slow
@pytest.mark.skipif(PROFILE != "long", reason="the long op fuzz runs with GRADGEN_FUZZ_PROFILE=long")
@OP_FUZZ_LONG
@given(fo.any_op_case())
def test_op_fuzz_long(case):
    """2000 random op cases (any op), one seed per run: ``--hypothesis-seed=N``."""
    from hypothesis import event

    event(case.op_type)
    for done in fo.check_case(case, ort):
        event(done)


@pytest.mark.cuda
@settings(settings.get_profile(PROFILE), max_examples=300 if PROFILE == "ci" else 1000)
@given(fo.any_op_case())
def test_op_fuzz_cuda_matches_cpu(case):
    """The same random op cases on gradgen's CUDA executor: forward and backward graphs give the CPU's
    outputs (values, dtypes, shapes)."""
    fo.check_case_on_cuda(case)


# -- regressions the fuzzer found ---------------------------------------------------------------


def test_regression_matmul_of_an_empty_vector():
    """loss = sum(x @ w) with x: [0], w: [0, 2] (found as Slice-to-empty -> MatMul)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, [0]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [0, 2]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = gradgen.build_backward(model, wrt=["x", "w"])
    got = Session(built.model).run({"x": np.zeros(0), "w": np.zeros((0, 2))})
    assert got["x_grad"].shape == (0,) and got["w_grad"].shape == (0, 2)


def test_regression_erf_double_has_no_onnxruntime_kernel():
    """onnxruntime has no Erf kernel for doubles: the comparison skips such cases instead of failing."""
    case = fg.KernelCase("Erf", [np.array(0.125)])
    with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
        ort.InferenceSession(case.model().SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(Session(case.model()).run(case.feeds())["out0"], math.erf(0.125), rtol=1e-12)


def test_regression_unsqueeze_of_an_empty_tensor():
    """loss = sum(unsqueeze(x, 0) * w) with x: [0, 1] (found as Slice-to-empty -> Unsqueeze)."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes"], ["u"], name="unsq"),
        helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [0, 1])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    built = gradgen.build_backward(model, wrt=["x"])
    assert Session(built.model).run({"x": np.zeros((0, 1))})["x_grad"].shape == (0, 1)


@pytest.mark.parametrize("start", [0, -1, 2, fg.INT64_MAX, fg.INT64_MIN])
@pytest.mark.parametrize("step", [-1, -2])
def test_regression_slice_int64_max_end_negative_step(start, step):
    """Found by the kernel fuzzer: end = INT64_MAX with a negative step. The spec clamps end to n - 1
    (an empty or short result); onnxruntime 1.32 slices to the front instead. gradgen follows the spec."""
    x = np.arange(3, dtype=np.float32)
    case = fg.KernelCase(
        "Slice", [x, np.array([start]), np.array([fg.INT64_MAX]), np.array([0]), np.array([step])], const=(1, 2, 3, 4)
    )
    got = Session(case.model()).run(case.feeds())["out0"]
    assert got.shape == (fg.slice_length(start, fg.INT64_MAX, step, 3),)


@pytest.mark.parametrize("n", [1, 3])
def test_regression_slice_lengths_follow_the_spec(n):
    """The graph fuzzer's own shape bookkeeping once disagreed with Slice's clamping (start < -n with a
    negative step clamps to 0, not to 'before the front'); pin gradgen and the bookkeeping to the spec."""
    x = np.arange(n, dtype=np.float32)
    values = list(range(-n - 2, n + 3)) + [fg.INT64_MAX, fg.INT64_MIN]
    for start in values:
        for end in values:
            for step in (1, 2, -1, -2):
                case = fg.KernelCase(
                    "Slice", [x, np.array([start]), np.array([end]), np.array([0]), np.array([step])], const=(1, 2, 3, 4)
                )
                got = Session(case.model()).run(case.feeds())["out0"]
                assert got.shape == (fg.slice_length(start, end, step, n),), (start, end, step)


def test_regression_matmul_after_axisless_squeeze_with_symbolic_dims():
    """Found by the graph fuzzer: Squeeze without axes on symbolic dims has an unknown rank, and the
    MatMul rule needs ranks. Not a crash: a model error naming the node (the fuzzer no longer draws it)."""
    nodes = [
        helper.make_node("Squeeze", ["x"], ["s"], name="sq"),
        helper.make_node("MatMul", ["s", "w"], ["y"], name="mm"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["a", "b"]),
            helper.make_tensor_value_info("w", TensorProto.DOUBLE, [2, 1]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(gradgen.errors.ModelError, match="'mm'.*ranks"):
        gradgen.build_backward(model, wrt=["x", "w"])


# -- CUDA kernels against the CPU kernels (on a machine with a GPU) -------------------------------

_ALL_KERNEL_CASES = st.one_of(
    elementwise_cases(), reduction_cases(), shape_cases(), index_cases(), matmul_cases(), nn_cases(), loss_cases()
)


@pytest.mark.cuda
@KERNELS
@given(_ALL_KERNEL_CASES)
def test_cuda_kernels_match_cpu(case):
    """Every kernel family's random cases (empty and size-1 dims, extreme indices) on the GPU: the same
    values as the CPU kernels, or the same refusal."""
    model, feeds = case.model(), case.feeds()
    try:
        want = Session(model).run(feeds)
    except GradgenError:
        with pytest.raises(GradgenError):
            Session(model, device="cuda").run(feeds)
        return
    got = Session(model, device="cuda").run(feeds)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}: {case.describe()}"
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True, err_msg=case.describe())


# -- regressions the op fuzzer found (tests/fuzz_ops.py; docs/RELIABILITY.md) ----------------------


def test_regression_group_norm_feeding_a_cast():
    """ONNX infers no output type for GroupNormalization (no inference function); a Cast after it
    made the Cast rule fail with an internal error. Types now come from the schema (T in, T out)."""
    x = np.random.default_rng(0).uniform(-2, 2, (2, 4, 3))
    case = fo.OpCase(
        "GroupNormalization",
        [x, np.ones(2) * 1.3, np.zeros(2) + 0.2],
        {"num_groups": 2},
        opset=18,
        dtype=np.float32,
        graph_inputs=frozenset({0}),
    )
    assert fo.check_case(case, ort)[1:] == ["finite differences", "torch", "float32 backward"]


@pytest.mark.parametrize(
    "attrs",
    [
        {"strides": [2], "auto_pad": "SAME_UPPER"},
        {"strides": [3], "auto_pad": "SAME_LOWER"},
        {"strides": [1], "output_shape": [4]},
        {"strides": [2], "output_shape": [5]},
    ],
)
def test_regression_conv_transpose_output_past_its_full_result(attrs):
    """An output longer than the full result (SAME with kernel < stride, output_shape larger than it):
    the extra positions hold the bias. The rule refused it; it now crops dY for X and W."""
    rng = np.random.default_rng(1)
    case = fo.OpCase(
        "ConvTranspose",
        [rng.uniform(-1, 1, (1, 2, 2)), rng.uniform(-1, 1, (2, 1, 1)), rng.uniform(-1, 1, (1,))],
        attrs,
        graph_inputs=frozenset({0, 2}),
    )
    fo.check_case(case)  # onnxruntime refuses or differs here (docs/RELIABILITY.md)


def test_regression_conv_transpose_output_shape_of_one():
    """ONNX's shape inference drops output_shape values of 1 (a rank-2 output for a 1-D ConvTranspose),
    and the backward graph failed at run time; shape inference now uses the kernel's output shape."""
    rng = np.random.default_rng(2)
    case = fo.OpCase(
        "ConvTranspose",
        [rng.uniform(-1, 1, (2, 1, 2)), rng.uniform(-1, 1, (1, 3, 1))],
        {"output_shape": [1]},
        graph_inputs=frozenset({0}),
    )
    fo.check_case(case)


def test_regression_tile_with_a_zero_repeat():
    """A repeat of 0 (an empty output): the gradient's Reshape read the 0 as "copy this dim"."""
    case = fo.OpCase("Tile", [np.random.default_rng(3).uniform(-1, 1, (2, 3)), np.array([2, 0])], graph_inputs=frozenset({0}))
    fo.check_case(case, ort)
    assert fo.gradients(case, np.float64, [0])["in0_grad"].tolist() == np.zeros((2, 3)).tolist()


def test_regression_pad_to_a_negative_size_is_refused():
    """Negative pads that leave an axis with fewer than 0 elements: gradgen made the axis empty
    (onnxruntime refuses); now a run-time error naming the node."""
    case = fo.OpCase("Pad", [np.ones((1, 1, 4)), np.array([0, -1, 2, 1, -1, 0])], {"mode": "constant"})
    with pytest.raises(RunError, match="'node'.*negative size"):
        Session(case.forward_model()).run({})


def test_regression_pad_then_crop_past_an_empty_axis():
    """Pads (1, -1) on an empty axis: the output has 0 + 1 - 1 = 0 elements (pad, then crop), as in
    onnxruntime; gradgen cropped first and then padded one element."""
    case = fo.OpCase(
        "Pad",
        [np.ones((0, 4, 3)), np.array([1, 1, 1, -1, -3, 2]), np.array(0.5)],
        {"mode": "constant"},
        opset=13,
        graph_inputs=frozenset({0}),
    )
    assert Session(case.forward_model()).run(case.feeds(np.float64))["out0"].shape == (0, 2, 6)
    fo.check_case(case, ort)


@pytest.mark.parametrize("pads", [[2, 1], [4, 0], [1, 3]])
def test_regression_pad_wrap_wider_than_the_axis(pads):
    """wrap pads longer than the axis wrap around more than once (as in onnxruntime); the gradient
    folded a single wrap and gave a wrongly shaped (broadcast) gradient. It now scatter-adds."""
    case = fo.OpCase(
        "Pad",
        [np.random.default_rng(4).uniform(-1, 1, (2, 3)), np.array([0, pads[0], 0, pads[1]])],
        {"mode": "wrap"},
        opset=19,
        graph_inputs=frozenset({0}),
    )
    case.inputs[0] = case.inputs[0][:, :1] if pads == [2, 1] else case.inputs[0]
    fo.check_case(case, ort)


def test_regression_pad_reflect_wider_than_the_axis_is_refused():
    """reflect pads of n or more on an axis of n: onnxruntime refuses them (and the gradient folds one
    reflection); gradgen repeated the reflection. Now a run-time error."""
    case = fo.OpCase("Pad", [np.ones(3), np.array([3, 0])], {"mode": "reflect"})
    with pytest.raises(RunError, match="reflect pads"):
        Session(case.forward_model()).run({})


def test_regression_pad_reflect_of_zero_on_an_empty_axis_is_the_input():
    """reflect pads of 0 on an axis of size 0 reflect nothing: the input comes back (onnxruntime's
    answer too); gradgen refused them as wider than the axis (found by the long profile, seed 14)."""
    case = fo.OpCase("Pad", [np.zeros((1, 0)), np.array([0, 0]), None, np.array([0])], {"mode": "reflect"}, opset=18)
    assert Session(case.forward_model()).run({})["out0"].shape == (1, 0)
    fo.check_case(case, ort)


def test_regression_layer_norm_double_statistics_are_float32():
    """LayerNormalization's Mean / InvStdDev have the schema's stash type (float) for double X too;
    gradgen returned double ones while shape inference typed them float, so their gradients went
    through a float Cast. They are computed in double and stored in float."""
    x = np.random.default_rng(5).uniform(-2, 2, (3, 4))
    case = fo.OpCase(
        "LayerNormalization", [x, np.ones(4) * 0.7], {"axis": -1}, opset=17, num_outputs=3, graph_inputs=frozenset({0})
    )
    outs = Session(case.forward_model()).run(case.feeds(np.float64))
    assert outs["out0"].dtype == np.float64 and outs["out1"].dtype == outs["out2"].dtype == np.float32
    fo.check_case(case, ort)


def test_regression_batch_norm_training_running_stats_get_zero_gradients():
    """Training-mode BatchNormalization with Y as the only output: Y uses the batch statistics, so
    the input mean / variance have a true zero gradient; the rule gave none (an internal error)."""
    rng = np.random.default_rng(6)
    inputs = [rng.uniform(-2, 2, (3, 2, 2)), np.ones(2), np.zeros(2), rng.uniform(-1, 1, 2), rng.uniform(0.5, 2, 2)]
    case = fo.OpCase("BatchNormalization", inputs, {"training_mode": 1}, opset=15, graph_inputs=frozenset({0, 3, 4}))
    grads = fo.gradients(case, np.float64, [0])
    assert not grads["in3_grad"].any() and not grads["in4_grad"].any()
    fo.check_case(case)  # onnxruntime wants all three outputs in training mode


def test_regression_average_pool_valid_ceil_mode_counts_no_padding():
    """AveragePool, auto_pad VALID, ceil_mode, count_include_pad: the last (partial) window divided by
    the kernel size, counting the ceil extension as padding; VALID declares none (PyTorch and
    onnxruntime divide by the taps inside)."""
    x = np.arange(1, 8, dtype=np.float64).reshape(1, 1, 7)
    case = fo.OpCase(
        "AveragePool",
        [x],
        {"kernel_shape": [3], "strides": [3], "auto_pad": "VALID", "ceil_mode": 1, "count_include_pad": 1},
        opset=19,
        graph_inputs=frozenset({0}),
    )
    assert Session(case.forward_model()).run(case.feeds(np.float64))["out0"].ravel().tolist() == [2.0, 5.0, 7.0]
    fo.check_case(case, ort)


@pytest.mark.parametrize(
    "case,message",
    [
        (
            fo.OpCase("Dropout", [np.ones(3), np.array(0.5), np.array(False)], graph_inputs=frozenset({0, 2}), diff=(0,)),
            "training_mode is not a constant",
        ),
    ],
)
def test_regression_outside_the_rules_is_a_clean_error(case, message):
    """What the op fuzzer found without a rule, and no longer draws: an error naming the node."""
    with pytest.raises(gradgen.errors.ModelError, match=f"'node'.*{message}|{message}.*'node'"):
        fo.gradients(case, np.float64, [0])


@pytest.mark.parametrize(
    "case",
    [
        fo.OpCase(
            "ScatterElements", [np.array([0.7, -1.3, 2.1]), np.array([0]), np.array([1.5])], {"reduction": "mul"}, opset=18
        ),
        fo.OpCase("ScatterND", [np.array([0.7, -1.3, 2.1]), np.array([[1]]), np.array([-0.4])], {"reduction": "mul"}, opset=18),
    ],
)
def test_regression_scatter_mul_once_refused_now_checked(case):
    """reduction='mul' had no rule (the fuzzer found the refusal); it is now checked as every case is."""
    fo.check_case(case, ort)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_regression_opset_11_softmax_of_an_empty_tensor(op):
    """Models below opset 14 are converted by ONNX's version converter, which restores Softmax-11's
    shape with Reshape(y, Shape(x)); without allowzero=1 the 0 of an empty tensor read as "copy"."""
    case = fo.OpCase(op, [np.zeros((0, 1))], {"axis": 0}, opset=11, dtype=np.float32)
    fo.check_case(case, ort)


@pytest.mark.parametrize(
    "x_shape,idx_shape,batch_dims", [((1, 1, 1), (1, 1, 0, 1), 2), ((2, 3, 4), (2, 0, 1), 1), ((0, 3, 4), (0, 2, 1), 1)]
)
def test_regression_gather_nd_batch_dims_with_no_index(x_shape, idx_shape, batch_dims):
    """GatherND with batch_dims and an empty index tensor (or an empty batch): the gradient reshaped
    with -1 and copied 0s, which cannot describe empty tensors; it now reshapes to explicit sizes."""
    case = fo.OpCase(
        "GatherND",
        [np.random.default_rng(7).uniform(-1, 1, x_shape), np.zeros(idx_shape, np.int64)],
        {"batch_dims": batch_dims},
        dtype=np.float32,
    )
    fo.check_case(case, ort)
    assert not fo.gradients(case, np.float64, [0])["in0_grad"].any()


def test_a_run_that_divides_zero_by_zero_warns_nothing():
    """The mean over an axis of an empty slice: its gradient divides dY by the count of reduced
    elements, Size(x) / Size(y) = 0 / 0 when the input dims are symbolic. A run says nothing about
    that NaN, which fills an empty gradient (numpy warned from gradgen's source lines: found by the
    shape and index graph fuzzer, seed 3)."""
    import warnings

    nodes = [
        helper.make_node("Slice", ["x", "zeros", "zeros", "axes"], ["s"]),
        helper.make_node("ReduceMean", ["s"], ["m"], axes=[0], keepdims=0),
        helper.make_node("Mul", ["m", "w"], ["mw"]),
        helper.make_node("ReduceSum", ["mw"], ["loss"], keepdims=0),
    ]
    consts = [
        onnx.numpy_helper.from_array(np.zeros(3, np.int64), "zeros"),
        onnx.numpy_helper.from_array(np.arange(3, dtype=np.int64), "axes"),
        onnx.numpy_helper.from_array(np.zeros((0, 0)), "w"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["a", "b", "c"])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        consts,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    built = gradgen.build_backward(model, wrt=["x"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = Session(built.model).run({"x": np.ones((1, 1, 1))})
    assert out["loss"] == 0.0  # a sum over nothing
    np.testing.assert_array_equal(out["x_grad"], np.zeros((1, 1, 1)))


def test_an_inconsistent_model_is_refused_with_a_pointer_to_the_cause():
    """A model whose shapes disagree (PyTorch's legacy exporter dropped attention's key transpose
    after a TopK: (1, 4) @ (1, 4)): ONNX shape inference stops at the bad MatMul, so the next one has
    inputs of unknown rank. build-backward refuses it in one line that says where to look, and a run
    of the forward model names the failing node."""
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["s"], name="scores"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax"),
        helper.make_node("MatMul", ["p", "v"], ["y"], name="mix"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("q", "k", "v")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(gradgen.errors.ModelError, match=r"MatMul node 'mix': the ranks .* `gradgen run` on the forward model"):
        gradgen.build_backward(model, wrt=["q", "k", "v"])
    feeds = {n: np.ones((1, 4), np.float32) for n in ("q", "k", "v")}
    with pytest.raises(gradgen.errors.GradgenError, match="scores"):
        Session(model).run(feeds)
