"""Custom ops registered from Python (gradgen.register_kernel / register_gradient): a model using one
builds, runs, and its gradients match finite differences and PyTorch."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import UnsupportedOpsError, UsageError
from gradgen.grads.registry import lookup_rule

DOMAIN = "test.custom"


@pytest.fixture
def soft_clip():
    """SoftClip(x) = limit * tanh(x / limit): a kernel with output types, and a rule of ONNX ops."""

    @gradgen.register_kernel("SoftClip", domain=DOMAIN, infer=lambda inputs, attrs: [inputs[0]])
    def soft_clip_kernel(x, *, limit=1.0):
        return (limit * np.tanh(x / limit)).astype(x.dtype)

    @gradgen.register_gradient("SoftClip", domain=DOMAIN)
    def soft_clip_grad(g):
        x, limit = g.x(0), g.attr("limit", 1.0)
        t = g.op("Tanh", g.op("Div", x, g.const_like(x, limit)))
        return [g.op("Mul", g.dy(), g.op("Sub", g.const_like(x, 1.0), g.op("Mul", t, t)))]

    yield
    gradgen.unregister("SoftClip", domain=DOMAIN)


def _model(dtype=TensorProto.DOUBLE, op="SoftClip"):
    w = numpy_helper.from_array(np.random.default_rng(0).normal(size=(3, 4)), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node(op, ["h"], ["c"], domain=DOMAIN, limit=0.5),
        helper.make_node("Mul", ["c", "c"], ["sq"]),  # typed only once c's type is known
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", dtype, [2, 3])],
        [helper.make_tensor_value_info("loss", dtype, [])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def test_registered_op_builds_and_matches_finite_differences_and_torch(soft_clip):
    torch = pytest.importorskip("torch")
    model = _model()
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert set(built.wrt) == {"x", "w"}
    x = np.random.default_rng(1).normal(size=(2, 3))
    got = gradgen.Session(built.model).run({"x": x})

    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]), requires_grad=True)
    loss = ((0.5 * torch.tanh((tx @ tw) / 0.5)) ** 2).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    np.testing.assert_allclose(got["x_grad"], tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got["w_grad"], tw.grad.numpy(), rtol=1e-10, atol=1e-12)

    report = check_gradients(model, wrt_inputs=True, random_inputs=True)
    assert report.passed, report.format()


def test_a_rule_may_emit_a_custom_gradient_op(soft_clip):
    """The backward of a second op is a custom op of its own (SoftClipGrad), with its own kernel."""

    @gradgen.register_kernel("SoftClip2", domain=DOMAIN, infer=lambda inputs, attrs: [inputs[0]])
    def forward(x, *, limit=1.0):
        return (limit * np.tanh(x / limit)).astype(x.dtype)

    @gradgen.register_kernel("SoftClipGrad", domain=DOMAIN, infer=lambda inputs, attrs: [inputs[1]])
    def backward(dy, x, *, limit=1.0):
        return (dy * (1.0 - np.tanh(x / limit) ** 2)).astype(x.dtype)

    @gradgen.register_gradient("SoftClip2", domain=DOMAIN)
    def rule(g):
        return [g.op("SoftClipGrad", g.dy(), g.x(0), domain=DOMAIN, limit=g.attr("limit", 1.0))]

    try:
        x = {"x": np.random.default_rng(2).normal(size=(2, 3))}
        want = gradgen.Session(gradgen.build_backward(_model(), wrt_inputs=True).model).run(x)
        built = gradgen.build_backward(_model(op="SoftClip2"), wrt_inputs=True)
        assert "SoftClipGrad" in {n.op_type for n in built.model.graph}
        got = gradgen.Session(built.model).run(x)
        for name in ("x_grad", "w_grad"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12)
        report = check_gradients(_model(op="SoftClip2"), wrt_inputs=True, random_inputs=True)
        assert report.passed, report.format()
    finally:
        gradgen.unregister("SoftClip2", domain=DOMAIN)
        gradgen.unregister("SoftClipGrad", domain=DOMAIN)


def test_registering_twice_needs_replace_and_unregister_restores_gradgen_s_rule(soft_clip):
    with pytest.raises(UsageError, match="test.custom::SoftClip already has a gradient rule.*replace=True"):
        gradgen.register_gradient("SoftClip", domain=DOMAIN)(lambda g: [g.dy()])
    with pytest.raises(UsageError, match="already has a CPU kernel"):
        gradgen.register_kernel("SoftClip", domain=DOMAIN)(lambda x: x)

    own = lookup_rule("", "Tanh")
    gradgen.register_gradient("Tanh", replace=True)(lambda g: [g.dy()])
    assert lookup_rule("", "Tanh") is not own
    gradgen.unregister("Tanh")
    assert lookup_rule("", "Tanh") is own
    with pytest.raises(UsageError, match="nothing is registered for ai.onnx::Tanh"):
        gradgen.unregister("Tanh")


def test_a_custom_op_without_a_rule_is_named_at_build():
    @gradgen.register_kernel("NoRule", domain=DOMAIN, infer=lambda inputs, attrs: [inputs[0]])
    def kernel(x, *, limit=1.0):
        return x

    try:
        with pytest.raises(UnsupportedOpsError, match="NoRule"):
            gradgen.build_backward(_model(op="NoRule"))
        assert gradgen.Session(ir.from_proto(_model(op="NoRule"))).run({"x": np.ones((2, 3))})["loss"].shape == ()
    finally:
        gradgen.unregister("NoRule", domain=DOMAIN)
