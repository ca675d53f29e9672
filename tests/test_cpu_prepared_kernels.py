"""Kernels prepared at plan time (kernels/table.py, ``cpu_prepare``): with their constant inputs
resolved once and their shape arithmetic kept per input shape, a step must give what the kernel
gives, bit for bit and with the same memory layout (a later GEMM rounds by it), for every input
shape that comes, and fail as the kernel fails."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import RunError
from gradgen.executor import Session
from gradgen.kernels import registry
from gradgen.kernels.cpu import norm, onednn, reduction


def _session(op: str, x_shape, constants: dict, attrs: dict | None = None, opset: int = 18, outputs: int = 1) -> Session:
    """One ``op`` node on x (dynamic dims: None) and the named constant inputs (None: absent)."""
    names = ["x"] + [name if value is not None else "" for name, value in constants.items()]
    out_names = [f"y{i}" for i in range(outputs)]
    node = helper.make_node(op, names, out_names, name="node", **(attrs or {}))
    graph = helper.make_graph(
        [node],
        "prepared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in out_names],
        initializer=[numpy_helper.from_array(np.asarray(v), name) for name, v in constants.items() if v is not None],
    )
    return Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _kernel_result(session: Session, x: np.ndarray):
    step = session.steps[0]
    args = [x] + [session.initializers.get(n) if n else None for n in step.inputs[1:]]
    return step.kernel(*args, **step.attributes)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    """Equal bits in the same layout (the stride of a length-1 axis says nothing of it)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert [st for st, n in zip(a.strides, a.shape) if n > 1] == [st for st, n in zip(b.strides, b.shape) if n > 1]
    assert a.tobytes() == b.tobytes()


I64 = np.int64
CASES = [
    ("Reshape", {"shape": np.array([0, -1], I64)}, {}),
    ("Reshape", {"shape": np.array([-1, 2], I64)}, {}),
    ("Unsqueeze", {"axes": np.array([0, -1], I64)}, {}),
    ("Squeeze", {"axes": np.array([1], I64)}, {}),
    ("Transpose", {}, {"perm": [2, 0, 1]}),
    ("Expand", {"shape": np.array([3, 1, 1, 1], I64)}, {}),
    ("Expand", {"shape": np.array([1, 1, 4], I64)}, {}),
    (
        "Slice",
        {
            "starts": np.array([1, -1], I64),
            "ends": np.array([100, -5], I64),
            "axes": np.array([0, 2], I64),
            "steps": np.array([1, -1], I64),
        },
        {},
    ),
    ("Slice", {"starts": np.array([0], I64), "ends": np.array([2], I64), "axes": None, "steps": None}, {}),
    ("ReduceSum", {"axes": np.array([0, -1], I64)}, {"keepdims": 0}),
    ("ReduceSum", {"axes": np.array([], I64)}, {"keepdims": 1}),
    ("ReduceMean", {"axes": np.array([2], I64)}, {"keepdims": 1}),
    ("ReduceMean", {"axes": None}, {"keepdims": 0}),  # a loss's mean: a 0-d result
    ("ReduceMean", {"axes": np.array([-1, 0], I64)}, {"keepdims": 0}),
    ("ReduceMax", {"axes": np.array([1], I64)}, {"keepdims": 0}),
    ("ReduceL2", {"axes": None}, {"keepdims": 0}),
]


@pytest.mark.parametrize(("op", "constants", "attrs"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_prepared_step_is_the_kernel_for_every_shape(op, constants, attrs):
    session = _session(op, [None, 1, None], constants, attrs)
    entry = registry.lookup("", op)
    assert entry.cpu_prepare is not None and session.steps[0].call is not entry.cpu  # the prepared call runs
    rng = np.random.default_rng(0)
    for shape in [(2, 1, 4), (6, 1, 4), (2, 1, 4), (4, 1, 8)]:  # a shape seen before comes from the cache
        x = rng.standard_normal(shape).astype(np.float32)
        for source in (x, x.transpose(2, 1, 0).copy().transpose(2, 1, 0)):  # C and F layouts
            try:
                want = _kernel_result(session, source)
            except Exception as exc:  # noqa: BLE001 -- then the step must fail with the same words
                with pytest.raises(RunError) as info:
                    session.run({"x": source})
                assert str(exc) in str(info.value)
                continue
            _same(session.run({"x": source})["y0"], np.asarray(want))


def test_prepared_split_gives_the_kernels_parts():
    session = _session("Split", [None, 6], {"split": np.array([1, 2, 3], I64)}, {"axis": -1}, outputs=3)
    for rows in (2, 5, 2):
        x = np.arange(rows * 6, dtype=np.float32).reshape(rows, 6)
        got = session.run({"x": x})
        for index, want in enumerate(_kernel_result(session, x)):
            _same(got[f"y{index}"], want)


def test_prepared_steps_fail_as_the_kernel_fails():
    reshape = _session("Reshape", [None, 3], {"shape": np.array([4, -1], I64)})
    _same(reshape.run({"x": np.ones((4, 3), np.float32)})["y0"], np.ones((4, 3), np.float32))
    with pytest.raises(Exception) as kernel_error:
        _kernel_result(reshape, np.ones((5, 3), np.float32))  # 15 elements do not make rows of 4
    with pytest.raises(RunError) as step_error:
        reshape.run({"x": np.ones((5, 3), np.float32)})
    assert str(step_error.value) == f"node 'node' (Reshape): {kernel_error.value}"
    squeeze = _session("Squeeze", [None, None], {"axes": np.array([1], I64)})
    with pytest.raises(RunError, match="cannot squeeze axis 1 of size 3"):
        squeeze.run({"x": np.ones((2, 3), np.float32)})
    _same(squeeze.run({"x": np.ones((2, 1), np.float32)})["y0"], np.ones(2, np.float32))
    expand = _session("Expand", [None], {"shape": np.array([2, 3], I64)})
    with pytest.raises(RunError, match="not broadcastable"):
        expand.run({"x": np.ones(2, np.float32)})


def test_a_run_time_input_leaves_the_kernel_in_place():
    """A shape computed at run time (here a graph input) is not prepared: the kernel runs."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"], name="node")],
        "runtime",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    kernel = registry.lookup("", "Reshape").cpu
    assert getattr(session.steps[0].call, "func", session.steps[0].call) is kernel
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for shape in ([3, 2], [6, 1]):
        _same(session.run({"x": x, "shape": np.array(shape, I64)})["y"], x.reshape(shape))


def test_an_expand_to_a_run_time_shape_gives_the_kernels_bits_and_layout_for_every_target():
    """A backward graph's Shape -> Expand: the target arrives at run time and joins the kept key."""
    graph = helper.make_graph(
        [helper.make_node("Expand", ["x", "shape"], ["y"], name="node")],
        "runtime",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    kernel = registry.lookup("", "Expand").cpu
    column = np.arange(3, dtype=np.float32).reshape(3, 1)
    fortran = np.asfortranarray(np.ones((2, 3), np.float32))
    cases = [(column, [3, 4]), (column, [2, 3, 5]), (column, [3, 4]), (column.T, [3, 3]), (fortran, [2, 2, 3])]
    for _ in range(2):  # the second round reuses the layouts the first kept
        for x, shape in cases:
            _same(session.run({"x": x, "shape": np.array(shape, I64)})["y"], kernel(x, np.array(shape, I64)))
    with pytest.raises(RunError, match="not broadcastable"):
        session.run({"x": column, "shape": np.array([2, 4], I64)})
    with pytest.raises(RunError, match="not broadcastable"):  # a target once refused is judged again, not kept
        session.run({"x": column, "shape": np.array([2, 4], I64)})


CONV_CASES = [
    ("Conv", (2, 4, 9, 7), (6, 2, 3, 3), {"group": 2, "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ("Conv", (1, 3, 8, 8), (4, 3, 2, 2), {"dilations": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("Conv", (2, 2, 5, 5), (3, 2, 5, 5), {}),  # a kernel as large as the image (a weight gradient)
    ("Conv", (2, 3, 11), (4, 3, 3), {"pads": [1, 1]}),
    ("ConvTranspose", (2, 4, 5, 6), (4, 3, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 0, 0, 1]}),
    ("ConvTranspose", (1, 3, 4, 4), (3, 2, 3, 2), {"strides": [2, 1], "output_padding": [1, 0], "dilations": [1, 2]}),
    ("ConvTranspose", (2, 2, 7), (2, 3, 4), {"strides": [3], "pads": [2, 1]}),
]


@pytest.mark.parametrize(("op", "x_shape", "w_shape", "attrs"), CONV_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CONV_CASES)])
@pytest.mark.parametrize("bias", [False, True])
def test_prepared_convolutions_are_the_kernel(op, x_shape, w_shape, attrs, bias, monkeypatch):
    """gradgen's own plans (grouped ones take oneDNN's primitives where it is loaded: see
    test_cpu_onednn_conv.py)."""
    monkeypatch.setattr(onednn, "_api", False)
    rng = np.random.default_rng(1)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b_len = w_shape[0] if op == "Conv" else w_shape[1] * attrs.get("group", 1)
    constants = {"w": w, "b": rng.standard_normal(b_len).astype(np.float32) if bias else None}
    session = _session(op, [None] * len(x_shape), constants, attrs)
    assert session.steps[0].call is not registry.lookup("", op).cpu
    for batch in (x_shape[0], x_shape[0] + 1, x_shape[0]):  # first call per shape, then the kept plan
        x = rng.standard_normal((batch, *x_shape[1:])).astype(np.float32)
        for _ in range(2):
            _same(session.run({"x": x})["y0"], _kernel_result(session, x))


def _prepared_and_kernel(op: str, attrs: dict, constants: tuple = (), domain: str = ""):
    """(the prepared call, the kernel with the attributes bound) of one op; ``constants`` holds the
    plan-time values of the inputs (registry.RUNTIME for the computed ones)."""
    entry = registry.lookup(domain, op)
    call = entry.cpu_prepare(constants, dict(attrs))
    assert call is not None, f"{op} was not prepared for {attrs}"
    return call, lambda *args: entry.cpu(*args, **attrs)


def _same_results(got, want) -> None:
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same(np.asarray(a), np.asarray(b))


def _agree(call, kernel, *args) -> None:
    """The prepared call gives the kernel's result on these arguments, on its first call and later,
    and leaves them as they were; or fails as the kernel fails."""
    before = [None if a is None else np.array(a, copy=True) for a in args]
    try:
        want = kernel(*args)
    except Exception as error:  # noqa: BLE001 -- the prepared call must fail the same way
        for _ in range(2):
            with pytest.raises(type(error)) as raised:
                call(*args)
            assert str(raised.value) == str(error)
        return
    for _ in range(3):
        _same_results(call(*args), want)
    for a, b in zip(args, before):
        if a is not None:
            assert a.tobytes() == b.tobytes()


RNG = np.random.default_rng(7)


def _normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _ints(low, high, *shape, dtype=I64):
    return RNG.integers(low, high, shape).astype(dtype)


INDEXING_CASES = [
    ("Gather", {}, lambda: (_normal(12, 8), _ints(0, 12, 2, 6))),
    ("Gather", {"axis": 1}, lambda: (_normal(3, 5, 2), _ints(-5, 5, 4, dtype=np.int32))),
    ("Gather", {"axis": 0}, lambda: (_normal(3, 5, 2)[:, 1], np.array(2, I64))),  # a view, a scalar index
    ("Gather", {}, lambda: (_normal(4, 2), np.array([1, 4], I64))),  # out of range
    ("GatherElements", {"axis": 1}, lambda: (_normal(3, 4, 5), _ints(0, 4, 3, 6, 5))),
    ("GatherElements", {"axis": -1}, lambda: (_normal(3, 4, 5).transpose(2, 0, 1), _ints(0, 4, 2, 3, 7))),
    ("GatherElements", {"axis": 0}, lambda: (_normal(3, 4), np.array([[0, 3]], I64))),  # out of range
    ("GatherElements", {"axis": 1}, lambda: (_normal(3, 4), np.array([[0, -3]], I64))),  # negative: the kernel wraps
    ("ScatterElements", {"axis": 1}, lambda: (_normal(32, 97), _ints(0, 97, 32, 1), _normal(32, 1))),
    ("ScatterElements", {"axis": 0}, lambda: (_normal(96), _ints(0, 96, 48), _normal(48))),  # repeats: last wins
    ("ScatterElements", {"axis": 2, "reduction": "add"}, lambda: (_normal(3, 4, 5), _ints(0, 5, 3, 4, 7), _normal(3, 4, 7))),
    ("ScatterElements", {"axis": 1, "reduction": "max"}, lambda: (_normal(4, 6).T, _ints(0, 4, 5, 3), _normal(5, 3))),
    ("ScatterElements", {"axis": 0, "reduction": "mul"}, lambda: (_normal(3, 2), np.array([[0, 3]], I64), _normal(1, 2))),
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(97, 32), _ints(0, 97, 32, 1), _normal(32, 32))),
    (
        "ScatterND",
        {"reduction": "add"},
        lambda: (_normal(3, 5, 2, 4), _ints(-3, 3, 2, 1), _normal(2, 5, 2, 4).transpose(0, 1, 3, 2).copy().transpose(0, 1, 3, 2)),
    ),
    ("ScatterND", {"reduction": "min"}, lambda: (_normal(6), _ints(0, 6, 9, 1), _normal(9))),
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(4, 2), np.array([[1], [-5]], I64), _normal(2, 2))),  # out of range
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(4, 2).T, _ints(0, 2, 3, 1), _normal(3, 4))),  # a transposed data
    # distinct rows: one update of the rows (a ViT's q/k/v slab; a negative row; max over rows)
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(3, 65, 2, 4), np.array([[1]], I64), _normal(1, 65, 2, 4))),
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(5, 3), np.array([[-1], [0], [2]], I64), _normal(3, 3))),
    ("ScatterND", {"reduction": "max"}, lambda: (_normal(5, 3), np.array([[[3], [1]]], I64), _normal(1, 2, 3))),
    ("ScatterND", {"reduction": "mul"}, lambda: (_normal(20, 3), RNG.permutation(20)[:12].reshape(12, 1) - 10, _normal(12, 3))),
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(3, 2), np.array([[-1], [2]], I64), _normal(2, 2))),  # one row twice
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(3, 2), np.zeros((0, 1), I64), _normal(0, 2))),  # no rows
    ("ScatterND", {"reduction": "add"}, lambda: (_normal(3, 2), np.array([[0], [3]], I64), _normal(2, 2))),  # out of range
]


@pytest.mark.parametrize(("op", "attrs", "make"), INDEXING_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(INDEXING_CASES)])
def test_prepared_indexing_is_the_kernel(op, attrs, make):
    call, kernel = _prepared_and_kernel(op, attrs)
    for _ in range(2):  # fresh values, the kept plan
        _agree(call, kernel, *make())


SCE = "SoftmaxCrossEntropyLoss"
BN_PARAMS = (_normal(6), _normal(6), _normal(6), np.abs(_normal(6)))  # scale, bias, mean, var
ARITHMETIC_CASES = [
    (SCE, {"ignore_index": -100, "_num_outputs": 2}, (), lambda: (_normal(32, 97), _ints(0, 97, 32))),
    (SCE, {"reduction": "sum"}, (), lambda: (_normal(5, 4, dtype=np.float64), _ints(0, 4, 5, dtype=np.int32))),
    (SCE, {"reduction": "none", "_num_outputs": 2}, (), lambda: (_normal(6, 3).T, _ints(0, 6, 3))),
    (SCE, {"ignore_index": 1}, (), lambda: (_normal(4, 3), np.array([0, 1, 2, 1], I64))),  # ignored labels
    (SCE, {"ignore_index": -1}, (), lambda: (_normal(4, 3), np.array([0, -1, 2, 1], I64))),
    (SCE, {}, (), lambda: (_normal(4, 3), np.array([0, 3, 2, 1], I64))),  # out of range
    # a masked language model's labels: -100 where no token is predicted
    (SCE, {"ignore_index": -100, "_num_outputs": 2}, (), lambda: (_normal(8, 5), np.array([0, -100, 4, -100, 1, 2, 3, 0], I64))),
    (SCE, {"ignore_index": -100, "reduction": "sum"}, (), lambda: (_normal(4, 5), np.array([-100, 1, -100, 4], np.int32))),
    (SCE, {"ignore_index": -100, "reduction": "none"}, (), lambda: (_normal(4, 5), np.array([-100, 1, -100, 4], I64))),
    (SCE, {"ignore_index": -100}, (), lambda: (_normal(3, 5), np.full(3, -100, I64))),  # all ignored: 0 / 0
    (SCE, {"ignore_index": -100}, (), lambda: (_normal(3, 5), np.array([-100, 5, 1], I64))),  # out of range
    (SCE, {"ignore_index": 2}, (), lambda: (_normal(4, 3), np.array([0, 2, -1, 1], I64))),  # negative, not ignored
    (SCE, {}, (), lambda: (_normal(2, 3, 4), _ints(0, 3, 2, 4))),  # (N, C, D)
    (SCE, {"_num_outputs": 2}, (), lambda: (_normal(4, 3), _ints(0, 3, 4), _normal(3))),  # weights
    ("LayerNormalization", {"epsilon": 1e-5}, (), lambda: (_normal(2, 16, 32), _normal(32), _normal(32))),
    ("LayerNormalization", {"axis": 1}, (), lambda: (_normal(3, 4, 5, dtype=np.float64), _normal(4, 5, dtype=np.float64))),
    ("LayerNormalization", {"axis": -2}, (), lambda: (_normal(5, 3, 4).transpose(1, 0, 2), _normal(5, 4), None)),
    ("LayerNormalization", {}, (), lambda: (_normal(3, 8, dtype=np.float16), _normal(8, dtype=np.float16))),
    ("BatchNormalization", {"epsilon": 1e-3}, (registry.RUNTIME, *BN_PARAMS), lambda: (_normal(2, 6, 5, 5), *BN_PARAMS)),
    ("BatchNormalization", {}, (), lambda: (_normal(3, 6), *BN_PARAMS)),  # per-channel inputs at run time
    ("BatchNormalization", {}, (registry.RUNTIME, *BN_PARAMS), lambda: (_normal(2, 6, 3, 4, 2, dtype=np.float64), *BN_PARAMS)),
]


@pytest.mark.parametrize(
    ("op", "attrs", "constants", "make"), ARITHMETIC_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(ARITHMETIC_CASES)]
)
def test_prepared_arithmetic_is_the_kernel(op, attrs, constants, make):
    """Losses and normalizations: the kernel's ufuncs in its order, so its bits."""
    args = make()
    known = constants or tuple(registry.RUNTIME for _ in args)
    call, kernel = _prepared_and_kernel(op, attrs, known)
    for _ in range(2):
        _agree(call, kernel, *args)
        args = (args[0] * 3, *args[1:])


def _with_ties(*shape):
    """Values with repeated maxima, signed zeros and a NaN, which MaxPool must resolve as the kernel does."""
    x = RNG.integers(-2, 3, shape).astype(np.float32)
    x[x == 0] = np.where(RNG.random(int((x == 0).sum())) < 0.5, -0.0, 0.0)
    x.reshape(-1)[RNG.integers(0, x.size)] = np.nan
    return x


POOL_CASES = [
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}, (2, 4, 16, 16)),
    ({"kernel_shape": [2, 2], "strides": [2, 2]}, (3, 4, 12, 12)),
    ({"kernel_shape": [3, 2], "dilations": [2, 1], "pads": [2, 0, 1, 1], "ceil_mode": 1, "strides": [2, 3]}, (1, 2, 9, 8)),
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "storage_order": 1}, (2, 3, 5, 4)),
    ({"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, (2, 3, 10)),
    ({"kernel_shape": [2, 2, 2]}, (1, 2, 3, 4, 5)),
    ({"kernel_shape": [5, 5]}, (1, 1, 3, 3)),  # larger than the image: the kernel's error
]


@pytest.mark.parametrize(("attrs", "shape"), POOL_CASES, ids=[str(i) for i in range(len(POOL_CASES))])
@pytest.mark.parametrize("outputs", [1, 2])
def test_prepared_max_pool_is_the_kernel(attrs, shape, outputs):
    call, kernel = _prepared_and_kernel("MaxPool", {**attrs, "_num_outputs": outputs})
    for x in (_normal(*shape), _with_ties(*shape), _normal(*shape, dtype=np.float64), _with_ties(*shape).transpose()):
        _agree(call, kernel, x)


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_scatter_kernels_write_into_f_ordered_data(op):
    """The kernels once wrote through a flat view of a copy that keeps the data's layout: an
    F-ordered data input (a transposed value) came back without its updates."""
    data = _normal(2, 2, 3)
    if op == "ScatterND":
        indices, updates = np.array([[1, 0], [0, 1]], I64), _normal(2, 3)
    else:
        indices, updates = _ints(0, 2, 2, 2, 3), _normal(2, 2, 3)
    kernel = registry.lookup("", op).cpu
    _same(kernel(np.asfortranarray(data), indices, updates), kernel(data, indices, updates))
    assert not np.array_equal(kernel(data, indices, updates), data)


AVERAGE_POOL_CASES = [
    *POOL_CASES[:3],
    ({"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER", "count_include_pad": 1}, (2, 3, 5, 4)),
    ({"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1, "ceil_mode": 1, "strides": [2, 2]}, (1, 2, 6, 6)),
    *POOL_CASES[4:],
]


@pytest.mark.parametrize(("attrs", "shape"), AVERAGE_POOL_CASES, ids=[str(i) for i in range(len(AVERAGE_POOL_CASES))])
def test_prepared_average_pool_is_the_kernel(attrs, shape):
    call, kernel = _prepared_and_kernel("AveragePool", attrs)
    for x in (_normal(*shape), _normal(*shape, dtype=np.float64), _normal(*shape).transpose(), _normal(*shape, dtype=np.float16)):
        _agree(call, kernel, x)


@pytest.mark.parametrize(
    ("pads", "value", "axes"),
    [
        ([1, 0, 2, 0, 3, 1], 0.5, None),
        ([0, -1, 1, 2, 1, -2], None, None),  # negative pads crop
        ([2, 1], -1.0, [-1]),
    ],
)
def test_prepared_constant_pad_is_the_kernel_for_every_shape_and_pads(pads, value, axes):
    constants = (
        registry.RUNTIME,
        registry.RUNTIME,
        None if value is None else np.array(value, np.float32),
        None if axes is None else np.array(axes, I64),
    )
    call, kernel = _prepared_and_kernel("Pad", {"mode": "constant"}, constants)
    for shape in [(2, 3, 4), (1, 5, 6), (2, 3, 4)]:
        for given in (np.array(pads, I64), np.array(pads, I64) // 2):
            x = _normal(*shape)
            _agree(call, kernel, x, given, constants[2], constants[3])
            _agree(call, kernel, x.transpose(1, 0, 2), given, constants[2], constants[3])


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [(x, w, a) for op, x, w, a in CONV_CASES if op == "Conv"]
    + [((2, 3, 6, 6), (4, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]})],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("wanted", [(True, True, True), (True, False, False), (False, True, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_prepared_conv_grad_is_the_kernel(x_shape, w_shape, attrs, wanted, dtype, monkeypatch):
    """gradgen's own plans (grouped float32 ones take oneDNN's where it is loaded: see
    test_cpu_onednn_conv.py)."""
    from gradgen.kernels.cpu.conv import conv as conv_kernel

    monkeypatch.setattr(onednn, "_api", False)

    call, kernel = _prepared_and_kernel("ConvGrad", {**attrs, "_num_outputs": 3, "_wanted": wanted}, domain="com.microsoft")
    rng = np.random.default_rng(2)
    w = rng.standard_normal(w_shape).astype(dtype)
    for batch in (x_shape[0], x_shape[0] + 1):
        x = rng.standard_normal((batch, *x_shape[1:])).astype(dtype)
        dy = rng.standard_normal(conv_kernel(x, w, **attrs).shape).astype(dtype)
        _agree(call, kernel, dy, x, w)
        _agree(
            call, kernel, dy.transpose(0, 1, *range(dy.ndim - 1, 1, -1)).copy().transpose(0, 1, *range(dy.ndim - 1, 1, -1)), x, w
        )


def test_prepared_conv_grad_fails_as_the_kernel_on_a_wrong_dy():
    call, kernel = _prepared_and_kernel("ConvGrad", {"_num_outputs": 3}, domain="com.microsoft")
    x, w = _normal(1, 2, 5, 5), _normal(3, 2, 3, 3)
    _agree(call, kernel, _normal(1, 3, 3, 3), x, w)  # plans this shape
    _agree(call, kernel, _normal(1, 3, 4, 3), x, w)  # a dY of another shape: the kernel's error


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "attrs"),
    [
        ((4, 3), (4, 5), {"transA": 1}),
        ((2, 3, 4), (2, 5, 4), {"transB": 1, "alpha": 0.5}),
        ((3, 2, 4), (3, 4, 5), {"transBatchA": 1}),
        ((2, 3, 4), (2, 3, 5), {"transA": 1, "transBatchB": 0}),
        ((6,), (6, 2), {}),
        ((2, 3, 4), (2, 6, 4), {"transB": 1}),  # inner dimensions differ: the kernel's error
    ],
)
def test_prepared_fused_matmul_is_the_kernel(a_shape, b_shape, attrs):
    call, kernel = _prepared_and_kernel("FusedMatMul", attrs, domain="com.microsoft")
    for dtype in (np.float32, np.float64):
        _agree(call, kernel, _normal(*a_shape, dtype=dtype), _normal(*b_shape, dtype=dtype))


@pytest.mark.parametrize(
    ("attrs", "make"),
    [
        ({"axis": 0}, lambda: (_normal(96), _ints(0, 96, 48), _normal(48))),  # repeats: the last update wins
        ({"axis": 0}, lambda: (_normal(96), RNG.permutation(96)[:40].astype(I64), _normal(40))),  # distinct
        ({"axis": 1}, lambda: (_normal(4, 7), _ints(-7, 7, 4, 9), _normal(4, 9))),  # negative, repeated
        ({"axis": 1}, lambda: (_normal(3, 5), np.array([[0, 5]] * 3, I64), _normal(3, 2))),  # out of range
        ({"axis": 0, "reduction": "add"}, lambda: (_normal(10), _ints(0, 10, 30), _normal(30))),
    ],
)
def test_scatter_elements_with_plan_time_indices_is_the_kernel(attrs, make):
    """Indices known at plan time (a lowered SliceGrad's) have their targets worked out once; the
    result must be the kernel's, for other data and updates too, and for indices given at run time."""
    data, indices, updates = make()
    call, kernel = _prepared_and_kernel("ScatterElements", attrs, (registry.RUNTIME, indices, registry.RUNTIME))
    for _ in range(2):
        _agree(call, kernel, data, indices, updates)
        _agree(call, kernel, data, indices.copy(), updates)  # not the plan-time array: the general path
        data, updates = data * 3, updates - 1


@pytest.mark.parametrize(
    ("attrs", "make"),
    [
        ({}, lambda: (_normal(3, 4), _normal(4, 5), _normal(5))),
        ({"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0}, lambda: (_normal(4, 3), _normal(5, 4), _normal(3, 1))),
        ({"beta": 0.0}, lambda: (_normal(2, 3), _normal(3, 2), _normal(2, 2))),
        ({}, lambda: (_normal(2, 3), _normal(3, 4))),  # no C
        ({}, lambda: (_normal(2, 3, dtype=np.float64), _normal(3, 4, dtype=np.float64), _normal(2, 4, dtype=np.float64))),
        ({}, lambda: (_normal(2, 3), _normal(4, 4), _normal(4))),  # inner dimensions differ: the kernel's error
        ({}, lambda: (_normal(2, 3), _normal(3, 4), _normal(3))),  # C does not broadcast
    ],
)
def test_prepared_gemm_is_the_kernel(attrs, make):
    args = make()
    call, kernel = _prepared_and_kernel("Gemm", attrs, tuple(registry.RUNTIME for _ in args))
    for _ in range(2):
        _agree(call, kernel, *args)
        args = (args[0] * 3, *args[1:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_means_divide_to_numpys_bits(dtype):
    """ReduceMean and LayerNormalization's statistics divide by the count as a float of the sum's
    type (cheaper than numpy's intp): the quotients must be np.mean's, at every count and scale,
    subnormal sums included."""
    rng = np.random.default_rng(3)
    for count in (3, 5, 7, 10, 13, 48, 65, 768, 12_345):
        scales = rng.choice([1e-42 if dtype == np.float32 else 1e-310, 1e-3, 1.0, 1e30], size=(200, 1))
        x = (rng.standard_normal((200, count)) * scales).astype(dtype)
        session = _session("ReduceMean", [None, None], {"axes": np.array([1], I64)}, {"keepdims": 1})
        got = session.run({"x": x.astype(np.float32)})["y0"] if dtype == np.float32 else None
        if got is not None:
            _same(got, x.mean(axis=1, keepdims=True))
        _same(reduction.mean_over(x, (1,), True), x.mean(axis=1, keepdims=True))
        _same(norm._float_mean(x, (1,), count), x.mean(axis=1, keepdims=True))


def test_a_masked_language_models_labels_take_the_prepared_path(monkeypatch):
    """Labels of -100 (ignored) used to send every call to the kernel's general path."""
    from gradgen.kernels.cpu import loss

    call, kernel = _prepared_and_kernel(SCE, {"ignore_index": -100})
    scores, labels = _normal(6, 7), np.array([1, -100, 6, 0, -100, 3], I64)
    want = kernel(scores, labels)

    def general_path(*args, **kwargs):
        raise AssertionError("the prepared call fell back to the kernel")

    monkeypatch.setattr(loss, "softmax_cross_entropy_loss", general_path)
    _same(call(scores, labels), want)


GATHER_ND_CASES = [
    # transformers' attention masks: a (batch, kv) mask read at index tuples built from shapes
    ({}, lambda: RNG.random((2, 8)) < 0.7, np.stack(np.meshgrid(np.arange(2), np.arange(8), indexing="ij"), -1)[:, None, None]),
    ({}, lambda: _normal(4, 3, 5), np.array([[0, 2], [-1, 0], [3, -3]], I64)),  # negative indices wrap
    ({"batch_dims": 1}, lambda: _normal(2, 4, 3), np.array([[[1], [3]], [[0], [0]]], I64)),
    ({}, lambda: _normal(3, 2), np.zeros((4, 0), I64)),  # empty tuples: the whole data per tuple
    ({}, lambda: _normal(3, 2), np.array([[3, 0]], I64)),  # out of range: the kernel's error
]


@pytest.mark.parametrize(("attrs", "make_data", "indices"), GATHER_ND_CASES, ids=[str(i) for i in range(len(GATHER_ND_CASES))])
def test_prepared_gather_nd_with_constant_indices_is_the_kernel(attrs, make_data, indices):
    call, kernel = _prepared_and_kernel("GatherND", attrs, (registry.RUNTIME, indices))
    for _ in range(2):  # fresh values, the kept positions
        _agree(call, kernel, make_data(), indices)
    _agree(call, kernel, make_data()[:1], indices)  # another data shape


MATMUL_CASES = [
    lambda: (_normal(2, 8, 32), _normal(32, 32)),  # a stack times a matrix: one product of its rows
    lambda: (_normal(8, 2, 32).transpose(1, 0, 2), _normal(32, 16)),  # ... of a view, as blas.matmul copies it
    lambda: (_normal(2, 4, 8, 8), _normal(2, 4, 8, 8)),  # attention's batched products
    lambda: (_normal(3, 1, 5, 4), _normal(2, 4, 6)),  # broadcast batch dimensions
    lambda: (_normal(5), _normal(5, 3)),  # 1-D operands
    lambda: (_normal(4, 5), _normal(5)),
    lambda: (_normal(3, 5, dtype=np.float64), _normal(5, 2, dtype=np.float64)),
    lambda: (_normal(256, 128), _normal(128, 160)),  # above oneDNN's size where it is installed
    lambda: (_normal(2, 3, 4), _normal(5, 6)),  # inner dimensions differ: the kernel's error
]


@pytest.mark.parametrize("make", MATMUL_CASES, ids=[str(i) for i in range(len(MATMUL_CASES))])
def test_prepared_matmul_is_the_kernel(make):
    call, kernel = _prepared_and_kernel("MatMul", {})
    args = make()
    for _ in range(3):  # the first call runs the kernel, the next ones the kept plan
        _agree(call, kernel, *args)
        args = (args[0] * 3, args[1])
