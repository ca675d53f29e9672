"""TransposeFusionPass: a Linear layer's Transpose(W) and its gradient's transpose become GEMM flags;
the gradients stay those of the unfused graph (and PyTorch's), the portable form runs in stock
onnxruntime, and the forms the pass must leave alone are left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session
from gradgen.passes import GradientSpec, Pipeline, TransposeFusionPass

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

F32 = TensorProto.FLOAT


def linear_model(x_shape=(2, 5, 4), out=3, vector_weight_product=False):
    """loss = sum((x @ W^T + b)^2) [+ sum(W^T @ v) for the vector case], W (out, in) as PyTorch stores it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((out, x_shape[-1])).astype(np.float32)
    b = rng.standard_normal(out).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0], name="t"),
        helper.make_node("MatMul", ["x", "Wt"], ["xw"], name="mm"),
        helper.make_node("Add", ["xw", "b"], ["y"], name="add"),
        helper.make_node("Mul", ["y", "y"], ["y2"], name="sq"),
        helper.make_node("ReduceSum", ["y2"], ["loss0"], keepdims=0, name="sum"),
    ]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")]
    loss = "loss0"
    if vector_weight_product:
        inits.append(numpy_helper.from_array(rng.standard_normal(out).astype(np.float32), "v"))
        nodes += [
            helper.make_node("MatMul", ["Wt", "v"], ["wv"], name="mv"),
            helper.make_node("ReduceSum", ["wv"], ["loss1"], keepdims=0, name="sum1"),
            helper.make_node("Add", ["loss0", "loss1"], ["loss"], name="total"),
        ]
        loss = "loss"
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", F32, list(x_shape))],
        [helper.make_tensor_value_info(loss, F32, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w, b


def unfused(model):
    """The default pipeline without TransposeFusionPass."""
    pipeline, _ = gradgen.api.backward_pipeline(GradientSpec(wrt_inputs=True))
    built = ir.from_proto(model)
    Pipeline(*[p for p in pipeline.passes if not isinstance(p, TransposeFusionPass)])(built)
    assert any(n.op_type == "Transpose" for n in built.graph)
    return built


def test_linear_layer_loses_both_transposes():
    model, w, b = linear_model()
    built = gradgen.build_backward(model, wrt_inputs=True)
    ops = [(n.domain, n.op_type) for n in built.model.graph]
    assert ("", "Transpose") not in ops, ops
    assert ("com.microsoft", "FusedMatMul") in ops  # the forward product reads W with transB
    x = np.random.default_rng(1).standard_normal((2, 5, 4)).astype(np.float32)
    ours = Session(built.model).run({"x": x})
    plain = Session(unfused(model)).run({"x": x})
    for name in ("W_grad", "b_grad", "x_grad", "loss0"):
        np.testing.assert_allclose(ours[name], plain[name], rtol=1e-6, atol=1e-6, err_msg=name)
    tw, tb, tx = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (w, b, x))
    (torch.nn.functional.linear(tx, tw, tb) ** 2).sum().backward()
    for name, t in (("W_grad", tw), ("b_grad", tb), ("x_grad", tx)):
        np.testing.assert_allclose(ours[name], t.grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=name)
    # stock onnxruntime runs the default graph (float32 FusedMatMul) and the portable one
    for graph_model in (built.model, gradgen.build_backward(model, wrt_inputs=True, portable=True).model):
        proto = ir.to_proto(graph_model)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        for out, value in zip(session.get_outputs(), session.run(None, {"x": x})):
            np.testing.assert_allclose(value, ours[out.name], rtol=1e-5, atol=1e-5, err_msg=out.name)


def test_a_transposed_matrix_times_a_vector_keeps_its_transpose():
    """W^T as A against a vector: the FusedMatMul form ONNX Runtime's CPU kernel gets wrong is not made."""
    model, _, _ = linear_model(vector_weight_product=True)
    built = gradgen.build_backward(model, wrt_inputs=True)
    forward = [n for n in built.model.graph if n.name == "mv"]
    assert len(forward) == 1 and forward[0].op_type == "MatMul" and forward[0].inputs[0].name == "Wt"
    x = np.random.default_rng(2).standard_normal((2, 5, 4)).astype(np.float32)
    ours = Session(built.model).run({"x": x})
    plain = Session(unfused(model)).run({"x": x})
    for name in ("W_grad", "b_grad", "x_grad", "loss"):
        np.testing.assert_allclose(ours[name], plain[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_gemm_with_c_and_graph_outputs_are_left_alone():
    nodes = [
        helper.make_node("Gemm", ["a", "b", "c"], ["g"], name="g"),
        helper.make_node("Transpose", ["g"], ["gt"], perm=[1, 0], name="t1"),
        helper.make_node("Transpose", ["a"], ["at"], perm=[1, 0], name="t2"),
        helper.make_node("Gemm", ["at", "b"], ["h"], name="h"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in (("a", [3, 4]), ("b", [4, 5]), ("c", [5]))],
        [
            helper.make_tensor_value_info("gt", F32, [5, 3]),
            helper.make_tensor_value_info("at", F32, [4, 3]),
            helper.make_tensor_value_info("h", F32, None),
        ],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    TransposeFusionPass()(model)
    assert [n.op_type for n in model.graph] == ["Gemm", "Transpose", "Transpose", "Gemm"]
