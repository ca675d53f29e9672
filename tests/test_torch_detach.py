"""PyTorch's ``detach``, which the dynamo exporter writes as an Identity recorded as
``aten.detach.default`` (gradgen/grads/torch_records.py): no gradient flows through it, as in
PyTorch (a straight-through estimator ``y + (q - y).detach()``, a detached target); where the
exporter's optimizer removed the Identity, the gradient is the graph's and a note says so."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.check import check_gradients
from gradgen.executor import Session

X = np.array([0.3, -1.7, 2.2, 0.9])
W = np.array([1.4, 0.6, -0.8, 2.1])


def _call(name: str, target: str, args: str) -> str:
    return f"%{name} : [num_users=1] = call_function[target=torch.ops.aten.{target}](args = ({args}), kwargs = {{}})"


def _node(op: str, inputs: list[str], output: str, record: str | None = None) -> onnx.NodeProto:
    attributes = {"keepdims": 0} if op == "ReduceSum" else {}
    node = helper.make_node(op, inputs, [output], name=f"node_{output}", **attributes)
    if record is not None:
        node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=record)
    return node


def _loss_model(nodes, initializers: dict[str, np.ndarray], inputs=None) -> onnx.ModelProto:
    """``nodes`` computing a float64 ``loss``, from ``inputs`` (default x, 4 float64 values)."""
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[numpy_helper.from_array(value, name) for name, value in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _ste_model(with_identity: bool = True, recorded: bool = True) -> onnx.ModelProto:
    """loss = sum(z * z) + sum(detach(y) * w), z = y + detach(round(y) - y), y = x * w: PyTorch's
    gradient of w is 2 z x + y (the detached parts carry none)."""
    detach = _call("detach", "detach.default", "%sub,")
    detach_1 = _call("detach_1", "detach.default", "%y,")
    nodes = [
        _node("Mul", ["x", "w"], "y", _call("y", "mul.Tensor", "%x, %p_w")),
        _node("Round", ["y"], "q", _call("q", "round.default", "%y,")),
        _node("Sub", ["q", "y"], "sub", _call("sub", "sub.Tensor", "%q, %y")),
    ]
    if with_identity:
        nodes += [_node("Identity", ["sub"], "detach", detach), _node("Identity", ["y"], "detach_1", detach_1)]
    nodes += [
        _node("Add", ["y", "detach" if with_identity else "sub"], "z", _call("z", "add.Tensor", "%y, %detach")),
        _node("Mul", ["z", "z"], "zz", _call("zz", "mul.Tensor", "%z, %z")),
        _node("ReduceSum", ["zz"], "s1", None),
        _node("Mul", ["detach_1" if with_identity else "y", "w"], "dw", _call("dw", "mul.Tensor", "%detach_1, %p_w")),
        _node("ReduceSum", ["dw"], "s2", None),
        _node("Add", ["s1", "s2"], "loss", None),
    ]
    model = _loss_model(nodes, {"w": W})
    if not recorded:  # a legacy export: no node says what PyTorch called
        for node in model.graph.node:
            del node.metadata_props[:]
    return model


def _pytorch_gradient() -> np.ndarray:
    y = X * W
    z = np.round(y)  # the straight-through forward value: y + (round(y) - y)
    return 2 * z * X + y


def _graph_gradient() -> np.ndarray:
    """Every path open: z = y + (round(y) - y) has no gradient (round's is zero, the y's cancel),
    and sum(y w) = sum(x w^2) gives 2 x w."""
    return 2 * X * W


def _build(model, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = gradgen.build_backward(model, **options)
    return Session(built.model).run({"x": X})["w_grad"], [str(w.message) for w in caught]


def test_a_recorded_detach_stops_the_gradient_as_in_pytorch():
    got, notes = _build(_ste_model())
    np.testing.assert_allclose(got, _pytorch_gradient(), rtol=1e-12)
    assert any("PyTorch's detach" in n and "'node_detach'" in n for n in notes), notes


def test_without_the_record_the_identity_passes_the_gradient():
    got, notes = _build(_ste_model(recorded=False))
    np.testing.assert_allclose(got, _graph_gradient(), rtol=1e-12)
    assert not notes


def test_the_portable_graph_stops_it_too():
    got, _ = _build(_ste_model(), portable=True)
    np.testing.assert_allclose(got, _pytorch_gradient(), rtol=1e-12)


def test_a_detach_the_optimizer_removed_is_said():
    """The readers' records still name %detach, which no node computes: the graph's gradient,
    and a note naming the readers and optimize=False."""
    got, notes = _build(_ste_model(with_identity=False))
    np.testing.assert_allclose(got, _graph_gradient(), rtol=1e-12)
    assert any("removed the detach" in n and "'node_z' (reads %detach)" in n and "optimize=False" in n for n in notes), notes


def test_a_parameter_reached_only_through_a_detach_is_no_default_parameter():
    """PyTorch gives it no gradient: the default wrt leaves it out."""
    nodes = [
        _node("Mul", ["x", "v"], "t", _call("t", "mul.Tensor", "%x, %p_v")),
        _node("Identity", ["t"], "detach", _call("detach", "detach.default", "%t,")),
        _node("Mul", ["detach", "w"], "u", _call("u", "mul.Tensor", "%detach, %p_w")),
        _node("ReduceSum", ["u"], "loss"),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = gradgen.build_backward(_loss_model(nodes, {"w": W, "v": W[::-1].copy()}))
    assert built.wrt == ["w"]


def test_gradgen_check_compares_the_graphs_own_gradient():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_gradients(_ste_model(), inputs={"x": X})
    assert report.passed, report.format()
    assert any("finite differences of the graph cannot see" in str(w.message) for w in caught)


def test_a_dynamo_export_of_a_straight_through_estimator_gets_pytorchs_gradient():
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")  # the dynamo exporter's dependency

    class StraightThrough(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(W))

        def forward(self, x):
            y = x * self.w
            z = y + (torch.round(y) - y).detach()
            return (z * z).sum() + (y.detach() * self.w).sum()

    module = StraightThrough()
    x = torch.tensor(X)
    module(x).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(module, (x,), dynamo=True, optimize=False, verbose=False).model_proto
        built = gradgen.build_backward(proto)
    got = Session(built.model).run({"x": X})["w_grad"]
    np.testing.assert_allclose(got, module.w.grad.numpy(), rtol=1e-12)


def test_a_removed_detach_of_a_value_without_gradient_is_no_note():
    """The optimizer removed detach(buffer): the reader reads the buffer (no node computes it), so
    nothing that carries a gradient took the detach's place."""
    nodes = [
        _node("Mul", ["x", "w"], "y", _call("y", "mul.Tensor", "%x, %p_w")),
        _node("Mul", ["y", "b"], "yb", _call("yb", "mul.Tensor", "%y, %detach")),
        _node("ReduceSum", ["yb"], "loss"),
    ]
    _, notes = _build(_loss_model(nodes, {"w": W, "b": X}), wrt=["w"])
    assert not notes


@pytest.mark.parametrize("training", [True, False])
def test_a_train_mode_batch_norm_written_in_inference_mode_is_said(training):
    """torch 2.13's dynamo exporter writes a train-mode BatchNorm as an inference one; its record
    still says training=True."""
    rng = np.random.default_rng(0)
    bn = helper.make_node("BatchNormalization", ["x4", "s", "b", "m", "v"], ["y"], name="node_bn")
    bn.metadata_props.add(
        key="pkg.torch.onnx.fx_node",
        value=_call(
            "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_functional.default",
            f"%x4, %p_s, %p_b, %b_m, %b_v, {training}, 0.1, 1e-05",
        ),
    )
    parameters = {n: rng.standard_normal(3) for n in ("s", "b", "m")} | {"v": rng.random(3) + 0.5}
    model = _loss_model(
        [bn, helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        parameters,
        [helper.make_tensor_value_info("x4", TensorProto.DOUBLE, [2, 3, 4])],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradgen.build_backward(model, wrt=["s"])
    said = [str(w.message) for w in caught if "train-mode batch norm" in str(w.message)]
    assert bool(said) == training and (not said or "'node_bn'" in said[0]), said


def _if_model() -> onnx.ModelProto:
    """loss = sum(z * y), z = If(c, then: detach(y), else: y + y), y = x * w: through the then
    branch PyTorch's gradient of w is z x (the detach stops the rest)."""
    detach = _node("Identity", ["y"], "d", _call("detach", "detach.default", "%y,"))
    then_branch = helper.make_graph([detach], "then", [], [helper.make_tensor_value_info("d", TensorProto.DOUBLE, [4])])
    else_branch = helper.make_graph(
        [helper.make_node("Add", ["y", "y"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.DOUBLE, [4])]
    )
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["y"]),
        helper.make_node("If", ["c"], ["z"], then_branch=then_branch, else_branch=else_branch, name="node_if"),
        helper.make_node("Mul", ["z", "y"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4]),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]
    return _loss_model(nodes, {"w": W}, inputs)


def test_a_detach_in_a_branch_and_gradgen_check_of_it():
    feeds = {"x": X, "c": np.array(True)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = gradgen.build_backward(_if_model())
        np.testing.assert_allclose(Session(built.model).run(feeds)["w_grad"], (X * W) * X, rtol=1e-12)
        report = check_gradients(_if_model(), inputs=feeds)
    assert report.passed, report.format()
