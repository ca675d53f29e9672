"""GeluFusionPass: exported GELU formulas (tanh and erf, in several spellings) become one
com.microsoft FastGelu / Gelu node whose gradient is one FastGeluGrad / GeluGrad node; formulas
that are not a GELU, or whose inner values are read elsewhere, or are not float32, stay as they
are. Gradients agree with the unfused float64 twin (whose standard-op rules have finite-difference
cases), with PyTorch, with ONNX Runtime on the --portable graph, and on the GPU with the CPU."""

from __future__ import annotations

import collections
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper, numpy_helper

import gradgen
from gradgen.executor import Session
from gradgen.passes import GeluFusionPass, ShapeInferencePass

K = math.sqrt(2.0 / math.pi)
C = 0.044715


def _c(name: str, value: float, dtype):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, dtype=dtype)))


def _formula(spelling: str, dtype) -> list:
    """Nodes computing y from h in one spelling of GELU (or of something that is not one)."""
    c = lambda name, v: _c(name, v, dtype)  # noqa: E731
    n = helper.make_node
    if spelling in ("tanh_pow", "tanh_wrong_constant"):
        return [
            c("three", 3.0),
            n("Pow", ["h", "three"], ["p"]),
            c("cc", C if spelling == "tanh_pow" else 0.05),
            n("Mul", ["p", "cc"], ["a"]),
            n("Add", ["h", "a"], ["b"]),
            c("k", K),
            n("Mul", ["b", "k"], ["u"]),
            n("Tanh", ["u"], ["t"]),
            c("one", 1.0),
            n("Add", ["t", "one"], ["o"]),
            n("Mul", ["h", "o"], ["m"]),
            c("half", 0.5),
            n("Mul", ["m", "half"], ["y"]),
        ]
    if spelling == "tanh_torch":  # as torch.onnx exports F.gelu(x, approximate="tanh")
        return [
            n("Mul", ["h", "h"], ["sq"]),
            n("Mul", ["h", "sq"], ["cube"]),
            c("cc", C),
            n("Mul", ["cc", "cube"], ["a"]),
            n("Add", ["h", "a"], ["b"]),
            c("k", K),
            n("Mul", ["k", "b"], ["u"]),
            n("Tanh", ["u"], ["t"]),
            c("one", 1.0),
            n("Add", ["one", "t"], ["o"]),
            n("Mul", ["h", "o"], ["m"]),
            c("half", 0.5),
            n("Mul", ["half", "m"], ["y"]),
        ]
    if spelling == "tanh_half_first":  # 0.5 x computed apart, then times (1 + tanh(...))
        return [
            c("half", 0.5),
            n("Mul", ["h", "half"], ["hx"]),
            n("Mul", ["h", "h"], ["sq"]),
            c("cc", C),
            n("Mul", ["sq", "cc"], ["a"]),
            c("one", 1.0),
            n("Add", ["a", "one"], ["a1"]),
            n("Mul", ["h", "a1"], ["b"]),
            c("k", K),
            n("Mul", ["b", "k"], ["u"]),
            n("Tanh", ["u"], ["t"]),
            n("Add", ["t", "one"], ["o"]),
            n("Mul", ["hx", "o"], ["y"]),
        ]
    if spelling in ("erf_div", "erf_mul"):
        first = (
            [c("s2", math.sqrt(2.0)), n("Div", ["h", "s2"], ["d"])]
            if spelling == "erf_div"
            else [c("s2", 1.0 / math.sqrt(2.0)), n("Mul", ["h", "s2"], ["d"])]
        )
        return [
            *first,
            n("Erf", ["d"], ["e"]),
            c("one", 1.0),
            n("Add", ["e", "one"], ["o"]),
            n("Mul", ["h", "o"], ["m"]),
            c("half", 0.5),
            n("Mul", ["m", "half"], ["y"]),
        ]
    raise AssertionError(spelling)


def _model(spelling: str, dtype=np.float32, extra_outputs=()):
    """loss = sum((gelu(x @ W))^2) with W an initializer; the formula in the given spelling."""
    tensor_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1.5, (6, 5)).astype(dtype)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        *_formula(spelling, dtype),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
    ]
    outputs = [helper.make_tensor_value_info("loss", tensor_type, [])]
    outputs += [helper.make_tensor_value_info(name, tensor_type, None) for name in extra_outputs]
    graph = helper.make_graph(
        nodes, "gelu", [helper.make_tensor_value_info("x", tensor_type, [4, 6])], outputs, [numpy_helper.from_array(w, "W")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": rng.normal(0, 1.5, (4, 6)).astype(dtype)}
    return model, feeds


def _fused_ops(model) -> collections.Counter:
    ir_model = ir.from_proto(model)
    ShapeInferencePass()(ir_model)
    GeluFusionPass()(ir_model)
    return collections.Counter((n.domain, n.op_type) for n in ir_model.graph)


@pytest.mark.parametrize(
    "spelling,fused",
    [
        ("tanh_pow", "FastGelu"),
        ("tanh_torch", "FastGelu"),
        ("tanh_half_first", "FastGelu"),
        ("erf_div", "Gelu"),
        ("erf_mul", "Gelu"),
    ],
)
def test_each_spelling_becomes_one_node_with_the_formulas_gradient(spelling, fused):
    model, feeds = _model(spelling)
    ops = _fused_ops(model)
    assert ops[("com.microsoft", fused)] == 1
    assert not {op for _, op in ops} & {"Tanh", "Erf", "Pow", "Div"}
    assert ops[("", "Mul")] == 1 and ops[("", "Add")] == 0  # only y * y is left

    built = gradgen.build_backward(model, wrt=["W"])
    grad_ops = {n.op_type for n in built.model.graph}
    assert f"{fused}Grad" in grad_ops and "Tanh" not in grad_ops and "Erf" not in grad_ops
    got = Session(built.model).run(feeds)

    # the float64 twin keeps the formula (only float32 is fused): the standard-op rules' gradient
    twin, twin_feeds = _model(spelling, np.float64)
    assert _fused_ops(twin)[("com.microsoft", fused)] == 0
    twin_built = gradgen.build_backward(twin, wrt=["W"])
    want = Session(twin_built.model).run(twin_feeds)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=2e-6)
    np.testing.assert_allclose(got["W_grad"], want["W_grad"], rtol=2e-5, atol=2e-5 * np.abs(want["W_grad"]).max())


@pytest.mark.parametrize("spelling", ["tanh_pow", "erf_div"])
def test_the_portable_graph_is_standard_and_runs_on_onnxruntime(spelling):
    ort = pytest.importorskip("onnxruntime")
    model, feeds = _model(spelling)
    built = gradgen.build_backward(model, wrt=["W"], portable=True)
    assert all(n.domain in ("", "ai.onnx") for n in built.model.graph)
    want = Session(gradgen.build_backward(model, wrt=["W"]).model).run(feeds)
    session = ort.InferenceSession(ir.to_proto(built.model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_allclose(got["W_grad"], want["W_grad"], rtol=1e-5, atol=1e-6)


def test_a_formula_that_is_not_a_gelu_is_left_alone():
    model, _ = _model("tanh_wrong_constant")
    ops = _fused_ops(model)
    assert not [op for _, op in ops if "Gelu" in op] and ops[("", "Tanh")] == 1


@pytest.mark.parametrize("read_elsewhere", ["t", "m"])
def test_a_formula_whose_inner_value_is_read_elsewhere_is_left_alone(read_elsewhere):
    model, feeds = _model("tanh_pow", extra_outputs=[read_elsewhere])
    ops = _fused_ops(model)
    assert not [op for _, op in ops if "Gelu" in op] and ops[("", "Tanh")] == 1
    built = gradgen.build_backward(model, wrt=["W"])
    assert read_elsewhere in Session(built.model).run(feeds)


def test_pytorch_gelu_mlp_matches_pytorch_gradients():
    torch = pytest.importorskip("torch")
    import io

    torch.manual_seed(0)
    fc = torch.nn.Linear(8, 32)
    out = torch.nn.Linear(32, 8)

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = fc, out

        def forward(self, x):
            a = torch.nn.functional.gelu(self.fc(x), approximate="tanh")
            b = torch.nn.functional.gelu(self.out(a))  # the exact one
            return (b * b).sum()

    module = Mlp()
    x = torch.randn(4, 8) * 2
    buffer = io.BytesIO()
    torch.onnx.export(module, (x,), buffer, input_names=["x"], output_names=["loss"], dynamo=False, opset_version=17)
    built = gradgen.build_backward(onnx.load_from_string(buffer.getvalue()))
    ops = collections.Counter(n.op_type for n in built.model.graph)
    assert ops["FastGelu"] == 1 and ops["Gelu"] == 1 and ops["FastGeluGrad"] == 1 and ops["GeluGrad"] == 1
    got = Session(built.model).run({"x": x.numpy()})
    module(x).backward()
    for name, p in module.named_parameters():
        want = p.grad.numpy()
        np.testing.assert_allclose(got[f"{name}_grad"], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("spelling", ["tanh_torch", "erf_mul"])
def test_the_fused_ops_run_on_the_gpu_as_on_the_cpu(spelling):
    model, _ = _model(spelling)
    built = gradgen.build_backward(model, wrt=["W"])
    feeds = {"x": np.random.default_rng(1).normal(0, 2, (4, 6)).astype(np.float32)}
    want = Session(built.model).run(feeds)
    got = Session(built.model, device="cuda").run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-6, atol=1e-6 * max(1.0, np.abs(want[name]).max()), err_msg=name)
