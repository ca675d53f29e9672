"""Gradients of gradients: a backward graph gradgen writes is differentiated again.

For each model, the first backward graph gives the parameter gradients; a second loss
``loss2 = sum_p sum(p_grad ** 2)`` (a gradient penalty) is appended to it with onnx.helper and
differentiated with respect to the same parameters. The second-order gradients are checked against
float64 central differences of loss2 (computed from the first-order graph) and against
torch.autograd.grad(create_graph=True). The parameters are graph inputs, so the finite differences
feed perturbed values. The second gradient outputs cannot be named ``<p>_grad`` (the first ones
hold that name): they are ``<p>_grad2``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session
from gradgen.names import gradient_name

torch = pytest.importorskip("torch")
F = torch.nn.functional

DT = {np.dtype(np.float64): TensorProto.DOUBLE, np.dtype(np.float32): TensorProto.FLOAT}


def _model(nodes, params: dict, consts: dict, opset: int = 18) -> onnx.ModelProto:
    """Parameters as graph inputs (fed, so finite differences can perturb them), constants as
    initializers, one scalar output ``loss``."""
    inputs = [helper.make_tensor_value_info(n, DT[a.dtype], list(a.shape)) for n, a in params.items()]
    dtype = DT[next(iter(params.values())).dtype]
    graph = helper.make_graph(
        nodes,
        "model",
        inputs,
        [helper.make_tensor_value_info("loss", dtype, [])],
        initializer=[numpy_helper.from_array(a, n) for n, a in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _with_gradient_penalty(built: gradgen.BackwardModel, name: str = "loss2") -> onnx.ModelProto:
    """The backward model plus ``name = sum_p sum(p_grad ** 2)`` (its gradient outputs) as an output."""
    proto = gradgen.api.ir.to_proto(built.model)
    terms = []
    for k, grad in enumerate(built.gradient_names):
        proto.graph.node.extend(
            [
                helper.make_node("Mul", [grad, grad], [f"{name}_sq{k}"]),
                helper.make_node("ReduceSum", [f"{name}_sq{k}"], [f"{name}_term{k}"], keepdims=0),
            ]
        )
        terms.append(f"{name}_term{k}")
    proto.graph.node.append(helper.make_node("Sum", terms, [name]))
    loss_type = next(o.type.tensor_type.elem_type for o in proto.graph.output if o.name == "loss")
    proto.graph.output.append(helper.make_tensor_value_info(name, loss_type, []))
    return proto


def _second_order(model: onnx.ModelProto, params: dict, through: set[str]) -> tuple[dict, onnx.ModelProto, list[str]]:
    """The second-order gradients d loss2 / d p (by name of p), the model computing loss2, and the
    names of the second gradient outputs. ``through``: the com.microsoft gradient ops the first
    backward graph must hold (so their rules are what the second one exercises)."""
    first = gradgen.build_backward(model, wrt=list(params))
    assert first.gradient_names == [f"{p}_grad" for p in params]
    assert through <= {n.op_type for n in first.model.graph if n.domain == "com.microsoft"}
    penalised = _with_gradient_penalty(first)
    second = gradgen.build_backward(penalised, loss="loss2", wrt=list(params))
    got = Session(second.model).run(params)
    return {p: got[name] for p, name in zip(params, second.gradient_names)}, penalised, second.gradient_names


def _finite_differences(model: onnx.ModelProto, params: dict, eps: float = 1e-6) -> dict:
    session = Session(model)
    grads = {}
    for name, base in params.items():
        grad = np.zeros_like(base)
        for j in range(base.size):
            values = []
            for step in (eps, -eps):
                shifted = base.copy().reshape(-1)
                shifted[j] += step
                feeds = {**params, name: shifted.reshape(base.shape)}
                values.append(float(session.run(feeds, outputs=["loss2"])["loss2"]))
            grad.reshape(-1)[j] = (values[0] - values[1]) / (2 * eps)
        grads[name] = grad
    return grads


def _torch_second_order(loss_fn, params: dict) -> dict:
    tensors = {n: torch.tensor(a.astype(np.float64), requires_grad=True) for n, a in params.items()}
    loss = loss_fn(**tensors)
    firsts = torch.autograd.grad(loss, list(tensors.values()), create_graph=True)
    loss2 = sum((g * g).sum() for g in firsts)
    seconds = torch.autograd.grad(loss2, list(tensors.values()))
    return {n: s.detach().numpy() for n, s in zip(tensors, seconds)}


def _check(model, params, loss_fn, through: set[str], *, fd=True, rtol=1e-6, atol=1e-8):
    got, penalised, names = _second_order(model, params, through)
    assert names == [f"{p}_grad2" for p in params]
    want = _torch_second_order(loss_fn, params)
    for p in params:
        scale = max(1.0, float(np.abs(want[p]).max()))
        np.testing.assert_allclose(got[p], want[p], rtol=rtol, atol=atol * scale, err_msg=f"{p}: against torch")
    if fd:
        numeric = _finite_differences(penalised, params)
        for p in params:
            scale = max(1.0, float(np.abs(numeric[p]).max()))
            np.testing.assert_allclose(got[p], numeric[p], rtol=1e-5, atol=1e-6 * scale, err_msg=f"{p}: finite differences")


def _rand(rng, *shape, dtype=np.float64):
    return rng.uniform(-1.0, 1.0, shape).astype(dtype)


def test_mlp_relu_softmax_cross_entropy():
    rng = np.random.default_rng(0)
    x, labels = _rand(rng, 4, 3), np.array([0, 2, 1, 2], np.int64)
    params = {"W1": _rand(rng, 3, 5), "b1": _rand(rng, 5), "W2": _rand(rng, 5, 3), "b2": _rand(rng, 3)}
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["z0"]),
        helper.make_node("Add", ["z0", "b2"], ["z"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["z", "labels"], ["loss"]),
    ]
    model = _model(nodes, params, {"x": x, "labels": labels})
    xt, lt = torch.tensor(x), torch.tensor(labels)
    _check(model, params, lambda W1, b1, W2, b2: F.cross_entropy(torch.relu(xt @ W1 + b1) @ W2 + b2, lt), {"FusedMatMul"})


def test_cnn_conv_maxpool():
    rng = np.random.default_rng(1)
    x, labels = _rand(rng, 2, 1, 7, 7), np.array([1, 0], np.int64)
    params = {"Wc": _rand(rng, 2, 1, 3, 3), "bc": _rand(rng, 2), "Wf": _rand(rng, 8, 3)}
    nodes = [
        helper.make_node("Conv", ["x", "Wc", "bc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Tanh", ["c"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "Wf"], ["z"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["z", "labels"], ["loss"]),
    ]
    model = _model(nodes, params, {"x": x, "labels": labels})
    xt, lt = torch.tensor(x), torch.tensor(labels)

    def loss_fn(Wc, bc, Wf):
        pooled = F.max_pool2d(torch.tanh(F.conv2d(xt, Wc, bc, stride=2, padding=1)), 2)
        return F.cross_entropy(pooled.flatten(1) @ Wf, lt)

    _check(model, params, loss_fn, {"ConvGrad", "FusedMatMul"})


def _layer_norm_block(dtype):
    rng = np.random.default_rng(2)
    x = _rand(rng, 3, 4, dtype=dtype)
    params = {"gamma": 1.0 + _rand(rng, 4, dtype=dtype), "beta": _rand(rng, 4, dtype=dtype), "W": _rand(rng, 4, 2, dtype=dtype)}
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["n"], epsilon=1e-5),
        helper.make_node("MatMul", ["n", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["loss"], keepdims=0),
    ]
    xt = torch.tensor(x.astype(np.float64))

    def loss_fn(gamma, beta, W):
        return (torch.tanh(F.layer_norm(xt, (4,), gamma, beta, eps=1e-5) @ W) ** 2).sum()

    return _model(nodes, params, {"x": x}), params, loss_fn


def test_layer_norm_block_float64():
    """float64: LayerNormalization's gradient in standard ops (the saved float32 statistics would
    cost it its precision), so the finite differences are exact to 1e-6."""
    _check(*_layer_norm_block(np.float64), {"FusedMatMul"})


def test_layer_norm_block_float32_through_layer_normalization_grad():
    """float32: the first backward graph holds com.microsoft LayerNormalizationGrad, whose rule the
    second one differentiates (float32 results against torch in float64)."""
    _check(*_layer_norm_block(np.float32), {"LayerNormalizationGrad"}, fd=False, rtol=2e-4, atol=2e-5)


def test_training_batch_norm_block_through_batch_normalization_grad():
    """A training-mode BatchNormalization (float64: the pair's statistics keep their precision): the
    first backward graph holds BatchNormInternal and BatchNormalizationGrad, whose rule the second
    one differentiates."""
    rng = np.random.default_rng(4)
    x = _rand(rng, 3, 2, 2, 2)
    params = {"gamma": 1.0 + _rand(rng, 2), "beta": _rand(rng, 2), "W": _rand(rng, 2, 2)}
    nodes = [
        helper.make_node(
            "BatchNormalization", ["x", "gamma", "beta", "rm", "rv"], ["n", "rm2", "rv2"], epsilon=2**-10, training_mode=1
        ),
        helper.make_node("MatMul", ["n", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["loss"], keepdims=0),
    ]
    consts = {"x": x, "rm": np.zeros(2), "rv": np.ones(2)}
    xt = torch.tensor(x)

    def loss_fn(gamma, beta, W):
        normed = F.batch_norm(xt, None, None, gamma, beta, training=True, eps=2**-10)
        return (torch.tanh(normed @ W) ** 2).sum()

    _check(_model(nodes, params, consts), params, loss_fn, {"BatchNormInternal", "BatchNormalizationGrad"})


def test_gather_slice_model():
    rng = np.random.default_rng(3)
    idx = np.array([[0, 3], [5, 3]], np.int64)
    params = {"emb": _rand(rng, 6, 4), "W": _rand(rng, 3, 2)}
    consts = {"idx": idx, "starts": np.array([1], np.int64), "ends": np.array([4], np.int64), "axes": np.array([2], np.int64)}
    nodes = [
        helper.make_node("Gather", ["emb", "idx"], ["e"]),
        helper.make_node("Slice", ["e", "starts", "ends", "axes"], ["s"]),
        helper.make_node("MatMul", ["s", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, params, consts)
    it = torch.tensor(idx)
    _check(model, params, lambda emb, W: (torch.tanh(emb[it][..., 1:4] @ W) ** 2).sum(), {"GatherGrad", "SliceGrad"})


def test_second_gradients_are_listed_by_the_cli(tmp_path):
    from typer.testing import CliRunner

    from gradgen.cli import app

    rng = np.random.default_rng(4)
    params = {"W": _rand(rng, 3, 2)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    model = _model(nodes, params, {"x": _rand(rng, 4, 3)})
    first = tmp_path / "first.onnx"
    onnx.save(_with_gradient_penalty(gradgen.build_backward(model, wrt=["W"])), first)
    out = tmp_path / "second.onnx"
    result = CliRunner().invoke(app, ["build-backward", str(first), "-o", str(out), "--loss", "loss2", "--wrt", "W"])
    assert result.exit_code == 0, result.output
    assert "gradients (1): W_grad2" in result.output
    assert [o.name for o in onnx.load(out).graph.output] == ["loss", "W_grad", "loss2", "W_grad2"]


def _tanh_model(rng):
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    x = _rand(rng, 4, 3)
    return _model(nodes, {"W": _rand(rng, 3, 2)}, {"x": x}), x


def test_third_order_gradients_are_named_grad3():
    rng = np.random.default_rng(5)
    model, x = _tanh_model(rng)
    params = {"W": _rand(rng, 3, 2)}
    first = gradgen.build_backward(model, wrt=["W"])
    second = gradgen.build_backward(_with_gradient_penalty(first, "loss2"), loss="loss2", wrt=["W"])
    third = gradgen.build_backward(_with_gradient_penalty(second, "loss3"), loss="loss3", wrt=["W"])
    assert (first.gradient_names, second.gradient_names, third.gradient_names) == (["W_grad"], ["W_grad2"], ["W_grad3"])
    got = Session(third.model).run(params)

    w = torch.tensor(params["W"], requires_grad=True)
    (g1,) = torch.autograd.grad(torch.tanh(torch.tensor(x) @ w).sum(), [w], create_graph=True)
    (g2,) = torch.autograd.grad((g1 * g1).sum(), [w], create_graph=True)
    (g3,) = torch.autograd.grad((g2 * g2).sum(), [w])
    for name, want in (("W_grad", g1), ("W_grad2", g2), ("W_grad3", g3)):
        np.testing.assert_allclose(got[name], want.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def test_hessian_vector_product():
    """Differentiating the gradient output itself (a non-scalar loss) is a vector-Jacobian product
    of the gradient: the seed input ``W_grad_grad`` takes v, the output ``W_grad2`` is H v."""
    rng = np.random.default_rng(7)
    model, x = _tanh_model(rng)
    w, v = _rand(rng, 3, 2), _rand(rng, 3, 2)
    hvp = gradgen.build_backward(gradgen.build_backward(model, wrt=["W"]).model, loss="W_grad", wrt=["W"])
    assert hvp.gradient_names == ["W_grad2"] and [i.name for i in hvp.model.graph.inputs] == ["W", "W_grad_grad"]
    got = Session(hvp.model).run({"W": w, "W_grad_grad": v})["W_grad2"]

    wt = torch.tensor(w, requires_grad=True)
    (g1,) = torch.autograd.grad(torch.tanh(torch.tensor(x) @ wt).sum(), [wt], create_graph=True)
    (want,) = torch.autograd.grad(g1, [wt], grad_outputs=torch.tensor(v))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-9, atol=1e-12)


def test_gradgen_check_verifies_second_order_gradients():
    """``gradgen check`` on a backward model with a gradient penalty: it reads the second gradient
    outputs by their names (``W_grad2``), not ``W_grad``, which holds the first-order gradient."""
    from gradgen.check import check_gradients

    rng = np.random.default_rng(6)
    model, _ = _tanh_model(rng)
    penalised = _with_gradient_penalty(gradgen.build_backward(model, wrt=["W"]))
    report = check_gradients(penalised, loss="loss2", wrt=["W"], inputs={"W": _rand(rng, 3, 2)})
    assert [c.name for c in report.tensors] == ["W"] and all(c.passed for c in report.tensors), report


def test_gradient_name_takes_the_first_free_order():
    taken = {"w_grad", "w_grad2", "w_grad_1"}
    assert gradient_name("w", taken) == "w_grad3" and "w_grad3" in taken
    assert gradient_name("v", taken) == "v_grad"


@pytest.mark.parametrize(
    "op_type",
    [
        "ReluGrad",
        "SigmoidGrad",
        "TanhGrad",
        "GeluGrad",
        "FastGeluGrad",
        "BiasGeluGrad_dX",
        "BiasFastGeluGrad_dX",
        "SoftmaxGrad_13",
        "LogSoftmaxGrad_13",
        "SoftmaxGrad",
        "LogSoftmaxGrad",
        "SimplifiedLayerNormalizationGrad",
        "Scale",
    ],
)
def test_onnx_runtime_gradient_ops_lower_to_what_their_kernels_compute(op_type):
    """The lowerings of the ORT training gradient ops gradgen now differentiates (``--portable``, and
    what a backward graph of them holds in standard ops) agree with their CPU kernels."""
    from gradgen.passes import LowerToStandardPass
    from tests.gradcheck import case_model
    from tests.test_grad_rules import CASES

    for case in [c for c in CASES if c.op_type == op_type and c.domain == "com.microsoft"]:
        model, feeds, _ = case_model(case)
        want = Session(model).run(feeds)["loss"]
        lowered = LowerToStandardPass()(gradgen.api.ir.from_proto(model)).model
        assert all(n.domain in ("", "ai.onnx") for n in lowered.graph), case.id
        np.testing.assert_allclose(Session(lowered).run(feeds)["loss"], want, rtol=1e-12, err_msg=case.id)


def test_default_wrt_of_a_second_pass_skips_the_first_loss_seed():
    """The first pass's seed ``loss_grad`` (the constant 1) is a float initializer that loss2 depends
    on, but no parameter: the model's metadata lists it, and the default --wrt leaves it out."""
    rng = np.random.default_rng(8)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "model",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[numpy_helper.from_array(_rand(rng, 3, 2), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    first = gradgen.build_backward(model)
    assert first.wrt == ["W"] and "loss_grad" in first.model.graph.initializers
    second = gradgen.build_backward(_with_gradient_penalty(first), loss="loss2")
    assert second.wrt == ["W"] and second.gradient_names == ["W_grad2"]
    named = gradgen.build_backward(_with_gradient_penalty(first), loss="loss2", wrt=["W", "loss_grad"])
    assert named.gradient_names == ["W_grad2", "loss_grad_grad"]  # still a tensor one may name


def test_conv_transpose_average_pool_grouped_conv():
    """The other ConvGrad emitters: ConvTranspose (ConvGrad with X and dY exchanged), AveragePool (a
    ones kernel) and a grouped, dilated Conv with SAME padding."""
    rng = np.random.default_rng(9)
    x = _rand(rng, 2, 2, 5, 5)
    params = {"Wt": _rand(rng, 2, 3, 2, 2), "Wg": _rand(rng, 4, 1, 3, 3), "bg": _rand(rng, 4)}
    nodes = [
        helper.make_node("ConvTranspose", ["x", "Wt"], ["u"], strides=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("Tanh", ["u"], ["a"]),
        helper.make_node("AveragePool", ["a"], ["p"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Slice", ["p", "c0", "c4", "c1"], ["p4"]),
        helper.make_node("Concat", ["p", "p4"], ["q"], axis=1),
        helper.make_node("Conv", ["q", "Wg", "bg"], ["c"], group=4, dilations=[2, 2], auto_pad="SAME_UPPER"),
        helper.make_node("Tanh", ["c"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["loss"], keepdims=0),
    ]
    consts = {"x": x, "c0": np.array([0], np.int64), "c4": np.array([1], np.int64), "c1": np.array([1], np.int64)}
    model = _model(nodes, params, consts)
    xt = torch.tensor(x)

    def loss_fn(Wt, Wg, bg):
        u = F.conv_transpose2d(xt, Wt, stride=2)[:, :, :-1, :-1]
        p = F.avg_pool2d(torch.tanh(u), 3, stride=2, padding=1, count_include_pad=False)
        q = torch.cat([p, p[:, :1]], dim=1)
        return (torch.tanh(F.conv2d(q, Wg, bg, dilation=2, groups=4, padding=2)) ** 2).sum()

    _check(model, params, loss_fn, {"ConvGrad"})


def test_symbolic_batch_through_broadcast_gradient_args():
    """Symbolic batch dims: the first backward graph sums the broadcast batch through
    BroadcastGradientArgs (non-differentiable: int64 axes), which the second pass walks past."""
    rng = np.random.default_rng(3)
    w, x = _rand(rng, 1, 3, 2), _rand(rng, 4, 5, 3)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Tanh", ["m"], ["t"]),
        helper.make_node("Mul", ["t", "t"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["loss"], keepdims=0),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["B", "T", 3]),
        helper.make_tensor_value_info("W", TensorProto.DOUBLE, ["one", 3, 2]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    first = gradgen.build_backward(model, wrt=["W"])
    assert "BroadcastGradientArgs" in {n.op_type for n in first.model.graph}
    second = gradgen.build_backward(_with_gradient_penalty(first), loss="loss2", wrt=["W"])
    got = Session(second.model).run({"x": x, "W": w})["W_grad2"]
    want = _torch_second_order(lambda W: (torch.tanh(torch.tensor(x) @ W) ** 2).sum(), {"W": w})["W"]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
