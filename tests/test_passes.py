"""The preparation passes: folding shape arithmetic and inlining Ifs whose condition is constant."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session
from tests.gradcheck import numeric_gradient


def _if_model(x_dims):
    """loss = sum(If(shape(x)[0] == 2, then: x * w, else: x + w)): the condition is shape logic."""
    then_graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.DOUBLE, None)]
    )
    else_graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.DOUBLE, None)]
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Equal", ["n", "two"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph, name="branch"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(2, np.int64), "two"),
        numpy_helper.from_array(np.linspace(0.5, 2.0, 3), "w"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x_dims)],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("batch", [2, 3])
def test_if_with_a_static_condition_is_inlined_and_differentiated(batch):
    model = _if_model([batch, 3])
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert "If" not in {node.op_type for node in built.model.graph}
    x = np.random.default_rng(batch).standard_normal((batch, 3))
    session = Session(built.model)  # its forward part is the inlined branch: differences of its loss
    got = session.run({"x": x})
    np.testing.assert_allclose(got["x_grad"], numeric_gradient(session, {"x": x}, "x", 1e-6), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["w_grad"], x.sum(axis=0) if batch == 2 else np.full(3, batch), rtol=1e-12)
    onnx.checker.check_model(gradgen.api.ir.to_proto(built.model), full_check=True)


@pytest.mark.parametrize("batch", [2, 3])
def test_if_with_a_runtime_condition_stays_an_if_and_is_differentiated(batch):
    model = _if_model(["batch", 3])
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert [n.op_type for n in built.model.graph].count("If") == 2  # the forward If and its gradient's
    x = np.random.default_rng(batch).standard_normal((batch, 3))
    got, forward = Session(built.model).run({"x": x}), Session(model)
    np.testing.assert_allclose(got["x_grad"], numeric_gradient(forward, {"x": x}, "x", 1e-6), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(got["w_grad"], x.sum(axis=0) if batch == 2 else np.full(3, batch), rtol=1e-12)


def test_shape_of_a_static_tensor_folds_to_a_constant():
    model = _if_model([2, 3])
    built = gradgen.build_backward(model)
    assert not any(node.op_type == "Shape" and node.inputs[0].name == "x" for node in built.model.graph)


def test_shape_inference_sees_weights_shapes_without_their_data(monkeypatch):
    """Large initializers reach ONNX shape inference as typed inputs: no copy of the weights per pass."""
    import onnx_ir as ir

    from gradgen import passes

    w = numpy_helper.from_array(np.ones((256, 64), np.float32), "w")
    shape = numpy_helper.from_array(np.array([-1, 32], np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Reshape", ["h", "shape"], ["r"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 256])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
        initializer=[w, shape],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    seen = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(
        onnx.shape_inference, "infer_shapes", lambda proto, **kw: seen.append(proto.ByteSize()) or real(proto, **kw)
    )
    before = [v.name for v in model.graph.initializers.values()], [v.name for v in model.graph.inputs]
    passes.ShapeInferencePass()(model)
    assert seen and max(seen) < 4096  # the 64 KB weight did not travel
    assert ([v.name for v in model.graph.initializers.values()], [v.name for v in model.graph.inputs]) == before
    assert model.graph.initializers["w"].const_value is not None
    values = {n.outputs[0].name: n.outputs[0] for n in model.graph}
    assert list(values["h"].shape)[1] == 64 and list(values["r"].shape)[1] == 32  # data propagation kept


def test_build_backward_leaves_a_callers_ir_model_alone_and_shares_its_weights():
    import onnx_ir as ir

    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[w],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    before = onnx.printer.to_text(ir.to_proto(model))
    built = gradgen.build_backward(model)
    assert onnx.printer.to_text(ir.to_proto(model)) == before
    assert built.model.graph.initializers["w"].const_value is model.graph.initializers["w"].const_value
