"""Undoing broadcasting with named symbolic dims: the static path where the symbols decide which
axes were broadcast, the dynamic path (Shape -> BroadcastGradientArgs) where they cannot.

Also a few checks the one-node finite-difference cases cannot express: float32 Cast round trips,
Celu (float32 only), Dropout with a run-time training_mode, Pow's exponent gradient at non-positive bases, and the
elementwise chains PyTorch's exporters emit (GELU, BCE-with-logits, LayerNorm).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError
from gradgen.executor import Session
from tests.gradcheck import numeric_gradient

D = TensorProto.DOUBLE


def _model(nodes, inputs, initializers=(), opset=17):
    """A model whose output "loss" is a scalar built by ``nodes``; inputs: (name, dims[, type])."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, spec[1] if len(spec) > 1 else D, spec[0]) for name, *spec in inputs],
        [helper.make_tensor_value_info("loss", D, [])],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _binary_model(op, a_dims, b_dims):
    """loss = sum(sin(op(a, b))): a non-uniform output gradient, and no other broadcasting op."""
    nodes = [
        helper.make_node(op, ["a", "b"], ["y"], name="binop"),
        helper.make_node("Sin", ["y"], ["s"], name="sin"),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0, name="total"),
    ]
    return _model(nodes, [("a", a_dims), ("b", b_dims)])


def _check_fd(model, feeds, wrt, rtol=1e-6, atol=1e-7, eps=1e-6):
    built = gradgen.build_backward(model, wrt=wrt)
    onnx.checker.check_model(gradgen.api.ir.to_proto(built.model), full_check=True)
    got = Session(built.model).run(feeds)
    forward = Session(model)
    for name in wrt:
        want = numeric_gradient(forward, feeds, name, eps)
        assert got[f"{name}_grad"].shape == feeds[name].shape
        np.testing.assert_allclose(
            got[f"{name}_grad"], want, rtol=rtol, atol=atol * max(1.0, np.abs(want).max()), err_msg=f"gradient of {name}"
        )
    return built


def _backward_ops(built, node_name="binop"):
    """Op types emitted for one forward node (its rule plus the broadcast undoing), in order."""
    return [n.op_type for n in built.model.graph if n.name.startswith(f"{node_name}_Grad/")]


def _count(built, op_type):
    return sum(1 for n in built.model.graph if n.op_type == op_type)


rng = np.random.default_rng(7)


# -- static path decided by the symbols ----------------------------------------------------------

SYMBOLIC = [
    # (a dims, b dims, runtime shapes of a and b)
    (([3, 2, 1, "seq"], [3, 2, 1, 1]), [((3, 2, 1, 4), (3, 2, 1, 1)), ((3, 2, 1, 1), (3, 2, 1, 1))]),
    ((["batch", 2, "seq", "seq"], ["batch", 1, 1, "seq"]), [((2, 2, 3, 3), (2, 1, 1, 3)), ((1, 2, 1, 1), (1, 1, 1, 1))]),
    ((["n", 3], [3]), [((4, 3), (3,))]),
    (([2, "n", 3], ["n", 1]), [((2, 4, 3), (4, 1))]),
]


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
@pytest.mark.parametrize("dims,runs", SYMBOLIC, ids=[str(d) for d, _ in SYMBOLIC])
def test_symbols_decide_static_path(op, dims, runs):
    model = _binary_model(op, *dims)
    for a_shape, b_shape in runs:
        a = rng.uniform(0.5, 2.0, a_shape)
        b = rng.uniform(0.5, 2.0, b_shape) * (1 if op != "Pow" else 0.7)
        built = _check_fd(model, {"a": a, "b": b}, ["a", "b"])
        assert _count(built, "BroadcastGradientArgs") == 0, "the symbols decide the broadcast axes"
        if len(dims[0]) == len(dims[1]):
            assert "Shape" not in _backward_ops(built)


# -- dynamic path ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
def test_unrelated_symbols_use_one_shared_broadcast_gradient_args(op):
    model = _binary_model(op, ["p"], ["q"])
    for a_shape, b_shape in [((3,), (1,)), ((1,), (3,)), ((3,), (3,)), ((1,), (1,))]:
        a, b = rng.uniform(0.5, 2.0, a_shape), rng.uniform(0.5, 2.0, b_shape)
        built = _check_fd(model, {"a": a, "b": b}, ["a", "b"])
        assert _count(built, "BroadcastGradientArgs") == 1, "one BroadcastGradientArgs serves both operands"
        ops = _backward_ops(built)
        assert ops.count("BroadcastGradientArgs") == 1
        assert ops.count("ReduceSum") == 2 and ops.count("Reshape") == 2


def test_dynamic_path_with_rank_difference():
    model = _binary_model("Mul", ["p", "q"], ["r"])
    for a_shape, b_shape in [((2, 3), (3,)), ((2, 1), (3,)), ((2, 3), (1,))]:
        built = _check_fd(model, {"a": rng.uniform(-2, 2, a_shape), "b": rng.uniform(-2, 2, b_shape)}, ["a", "b"])
        assert _count(built, "BroadcastGradientArgs") == 1


# -- fully static ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a_dims,b_dims,b_ops",
    [
        ([2, 3], [3], ["ReduceSum", "Reshape"]),  # rank differs: ReduceSum then Reshape
        ([2, 3], [1, 3], ["ReduceSum"]),  # same rank: ReduceSum (keepdims) only
        ([2, 3], [2, 3], []),  # nothing broadcast: nothing emitted
        ([2, 3], [], ["ReduceSum", "Reshape"]),
    ],
)
def test_fully_static(a_dims, b_dims, b_ops):
    model = _binary_model("Add", a_dims, b_dims)
    feeds = {"a": rng.uniform(-2, 2, a_dims), "b": rng.uniform(-2, 2, b_dims)}
    built = _check_fd(model, feeds, ["a", "b"])
    assert _count(built, "BroadcastGradientArgs") == 0 and _count(built, "Shape") == 0
    assert _backward_ops(built) == b_ops  # Add's rule emits nothing; a needs no reduction


def test_where_three_way_symbolic():
    nodes = [
        helper.make_node("Where", ["c", "x", "y"], ["w"], name="sel"),
        helper.make_node("Sin", ["w"], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("c", ["i", 1, "k"], TensorProto.BOOL), ("x", [1, "j", 1]), ("y", ["k"])])
    feeds = {"c": rng.random((2, 1, 3)) > 0.5, "x": rng.uniform(-2, 2, (1, 4, 1)), "y": rng.uniform(-2, 2, (3,))}
    _check_fd(model, feeds, ["x", "y"])


# -- checks the one-node cases cannot express ------------------------------------------------------


def test_cast_float32_round_trip():
    """x (double) -> Cast float -> Tanh -> Cast double: the gradient is cast back at each Cast."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=f),
        helper.make_node("Tanh", ["xf"], ["tf"]),
        helper.make_node("CastLike", ["tf", "x"], ["t"]),
        helper.make_node("Mul", ["t", "x"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("x", [2, 3])])
    x = rng.uniform(-2, 2, (2, 3))
    _check_fd(model, {"x": x}, ["x"], rtol=1e-4, atol=1e-4, eps=1e-3)


def test_cast_to_int_carries_nothing():
    nodes = [
        helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
        helper.make_node("Cast", ["xi"], ["xd"], to=D),
        helper.make_node("Mul", ["xd", "x"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("x", [4])])
    x = np.array([0.3, 1.4, -2.2, 2.6])
    got = Session(gradgen.build_backward(model, wrt=["x"]).model).run({"x": x})
    np.testing.assert_array_equal(got["x_grad"], np.trunc(x))


def test_celu_float32():
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Celu", ["xf"], ["yf"], alpha=0.7),
        helper.make_node("Cast", ["yf"], ["y"], to=D),
        helper.make_node("Mul", ["y", "w"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("x", [2, 4])], [("w", rng.uniform(0.5, 1.5, (2, 4)))])
    x = rng.uniform(0.5, 2.0, (2, 4)) * np.array([1, -1, 1, -1])
    _check_fd(model, {"x": x}, ["x"], rtol=1e-3, atol=1e-3, eps=1e-3)


@pytest.mark.parametrize("opset", [13, 17])
def test_dropout_training_mode_fed_at_run_time_is_refused(opset):
    """A constant training_mode is differentiated (tests/test_control_flow.py); one fed at run time is not."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "train"], ["y"], name="drop1"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("x", [2, 3]), ("train", [], TensorProto.BOOL)], [("ratio", np.array(0.1))], opset=opset)
    with pytest.raises(ModelError, match="Dropout node 'drop1': training_mode is not a constant"):
        gradgen.build_backward(model, wrt=["x"])


def test_pow_exponent_gradient_at_non_positive_base():
    """dB = dY * Y * ln(A) where A > 0; 0 where A <= 0 (no real derivative in the exponent)."""
    nodes = [helper.make_node("Pow", ["a", "b"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = _model(nodes, [("a", [4]), ("b", [1])])
    a, b = np.array([2.0, 0.0, -1.5, 0.5]), np.array([2.0])
    got = Session(gradgen.build_backward(model, wrt=["a", "b"]).model).run({"a": a, "b": b})
    np.testing.assert_allclose(got["b_grad"], [4 * np.log(2.0) + 0.25 * np.log(0.5)])
    np.testing.assert_allclose(got["a_grad"], 2 * a)


# -- exporter patterns ------------------------------------------------------------------------------


def _const(name, value):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value, dtype=np.float64)))


def _weighted_loss(out):
    return [helper.make_node("Mul", [out, "w"], ["wm"]), helper.make_node("ReduceSum", ["wm"], ["loss"], keepdims=0)]


def test_gelu_tanh_chain():
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as the exporters write it."""
    nodes = [
        _const("three", 3.0),
        _const("c1", 0.044715),
        _const("k", np.sqrt(2 / np.pi)),
        _const("one", 1.0),
        _const("half", 0.5),
        helper.make_node("Pow", ["x", "three"], ["x3"]),
        helper.make_node("Mul", ["x3", "c1"], ["t1"]),
        helper.make_node("Add", ["x", "t1"], ["t2"]),
        helper.make_node("Mul", ["t2", "k"], ["t3"]),
        helper.make_node("Tanh", ["t3"], ["t4"]),
        helper.make_node("Add", ["t4", "one"], ["t5"]),
        helper.make_node("Mul", ["x", "half"], ["t6"]),
        helper.make_node("Mul", ["t6", "t5"], ["g"]),
        *_weighted_loss("g"),
    ]
    model = _model(nodes, [("x", ["b", 4])], [("w", rng.uniform(0.5, 1.5, (1, 4)))])
    _check_fd(model, {"x": rng.uniform(-3, 3, (3, 4))}, ["x"])


def test_gelu_erf_chain():
    """x * 0.5 * (1 + erf(x / sqrt(2)))."""
    nodes = [
        _const("s2", np.sqrt(2.0)),
        _const("one", 1.0),
        _const("half", 0.5),
        helper.make_node("Div", ["x", "s2"], ["t1"]),
        helper.make_node("Erf", ["t1"], ["t2"]),
        helper.make_node("Add", ["t2", "one"], ["t3"]),
        helper.make_node("Mul", ["x", "t3"], ["t4"]),
        helper.make_node("Mul", ["t4", "half"], ["g"]),
        *_weighted_loss("g"),
    ]
    model = _model(nodes, [("x", ["b", 4])], [("w", rng.uniform(0.5, 1.5, (1, 4)))])
    _check_fd(model, {"x": rng.uniform(-3, 3, (3, 4))}, ["x"])


def test_bce_with_logits_chains():
    """max(z, 0) - z * t + log(1 + exp(-|z|)), and -(t * log(sigmoid(z)) + (1 - t) * log(1 - sigmoid(z)))."""
    nodes = [
        _const("zero", 0.0),
        _const("one", 1.0),
        helper.make_node("Relu", ["z"], ["r"]),
        helper.make_node("Mul", ["z", "t"], ["zt"]),
        helper.make_node("Sub", ["r", "zt"], ["a1"]),
        helper.make_node("Abs", ["z"], ["az"]),
        helper.make_node("Neg", ["az"], ["naz"]),
        helper.make_node("Exp", ["naz"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Log", ["e1"], ["l1"]),
        helper.make_node("Add", ["a1", "l1"], ["form1"]),
        helper.make_node("Sigmoid", ["z"], ["sg"]),
        helper.make_node("Log", ["sg"], ["lsg"]),
        helper.make_node("Sub", ["one", "sg"], ["osg"]),
        helper.make_node("Log", ["osg"], ["losg"]),
        helper.make_node("Mul", ["t", "lsg"], ["p1"]),
        helper.make_node("Sub", ["one", "t"], ["ot"]),
        helper.make_node("Mul", ["ot", "losg"], ["p2"]),
        helper.make_node("Add", ["p1", "p2"], ["p3"]),
        helper.make_node("Neg", ["p3"], ["form2"]),
        helper.make_node("Softplus", ["z"], ["sp"]),
        helper.make_node("Sub", ["sp", "zt"], ["form3"]),
        helper.make_node("Sum", ["form1", "form2", "form3"], ["all"]),
        helper.make_node("ReduceMean", ["all"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, [("z", ["n", 3]), ("t", ["n", 3])])
    z = rng.uniform(0.3, 3, (4, 3)) * rng.choice([-1, 1], (4, 3))
    _check_fd(model, {"z": z, "t": rng.uniform(0, 1, (4, 3))}, ["z", "t"])


@pytest.mark.parametrize("opset", [17, 18])
def test_layer_norm_chain(opset):
    """(x - mean) / sqrt(var + eps) * gamma + beta, with ReduceMean/Sub/Pow/Sqrt/Div."""

    def mean(i, o):
        if opset >= 18:
            return helper.make_node("ReduceMean", [i, "axes"], [o], keepdims=1)
        return helper.make_node("ReduceMean", [i], [o], axes=[-1], keepdims=1)

    nodes = [
        _const("two", 2.0),
        _const("eps", 1e-5),
        helper.make_node("Constant", [], ["axes"], value=numpy_helper.from_array(np.array([-1], dtype=np.int64))),
        mean("x", "mu"),
        helper.make_node("Sub", ["x", "mu"], ["xc"]),
        helper.make_node("Pow", ["xc", "two"], ["sq"]),
        mean("sq", "var"),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["xc", "sd"], ["xn"]),
        helper.make_node("Mul", ["xn", "gamma"], ["xs"]),
        helper.make_node("Add", ["xs", "beta"], ["ln"]),
        *_weighted_loss("ln"),
    ]
    model = _model(
        nodes, [("x", ["b", "s", 5]), ("gamma", [5]), ("beta", [5])], [("w", rng.uniform(0.5, 1.5, (2, 3, 5)))], opset=opset
    )
    feeds = {"x": rng.uniform(-2, 2, (2, 3, 5)), "gamma": rng.uniform(0.5, 1.5, (5,)), "beta": rng.uniform(-1, 1, (5,))}
    _check_fd(model, feeds, ["x", "gamma", "beta"])
