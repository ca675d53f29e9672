"""Training-mode BatchNormalization's gradient as ONNX Runtime training writes it: the forward node
becomes com.microsoft BatchNormInternal (which also returns the batch mean and inverse deviation) and
one BatchNormalizationGrad reads them; ``portable=True`` lowers both to standard ops. Checked against
finite differences and PyTorch in float64, and the portable graph against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import GradgenError
from gradgen.executor import Session
from tests.gradcheck import GradCase, check_case

torch = pytest.importorskip("torch")
nn = torch.nn

PAIR = {("com.microsoft", "BatchNormInternal"), ("com.microsoft", "BatchNormalizationGrad")}


def _ops(model: ir.Model) -> set[tuple[str, str]]:
    return {(node.domain, node.op_type) for node in model.graph}


def _bn_inputs(shape, rng):
    c = shape[1]
    return [
        rng.standard_normal(shape) * 2 + 0.5,
        rng.uniform(0.5, 1.5, c),
        rng.standard_normal(c),
        rng.standard_normal(c),
        rng.uniform(0.5, 2, c),
    ]


@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (5, 3), (2, 3, 5), (1, 2, 2, 2, 3)], ids=str)
@pytest.mark.parametrize("outputs", [1, 3], ids=["y", "y-and-running"])
@pytest.mark.parametrize("symbolic", [False, True])
def test_training_batch_norm_gradients_match_finite_differences(shape, outputs, symbolic):
    """Every input's gradient, the running statistics in the loss too (their gradients reach X
    through the batch mean and variance), with and without static shapes."""
    rng = np.random.default_rng(7)
    case = GradCase(
        "BatchNormalization",
        _bn_inputs(shape, rng),
        attrs={"epsilon": 1e-3, "momentum": 0.8, "training_mode": 1},
        num_outputs=outputs,
        opset=15,
        name=f"bn-training-{shape}",
        rtol=1e-6,
        atol=1e-7,
    )
    check_case(case, symbolic=symbolic)


class _ConvBatchNorm(nn.Module):
    """No bias before a BatchNorm (its gradient is a true zero) and an epsilon a float32 attribute
    holds exactly, so that float64 gradients can be compared tightly."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4, eps=2**-10)
        self.head = nn.Linear(4, 3, bias=False)
        self.bn1d = nn.BatchNorm1d(3, eps=2**-10, momentum=0.3)

    def forward(self, x, target):
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return ((self.bn1d(self.head(h)) - target) ** 2).mean()


def _export(model, args):
    from gradgen.bench.models import legacy_export

    return legacy_export(model, args, ["x", "target"])


def test_default_build_uses_the_pair_and_matches_pytorch_like_the_portable_one():
    torch.manual_seed(0)
    model = _ConvBatchNorm().double().train()
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randn(3, 3, dtype=torch.float64)
    proto = _export(model, (x, target))
    model(x, target).backward()
    want = {name: p.grad.numpy() for name, p in model.named_parameters()} | {"x": x.grad.numpy()}
    feeds = {"x": x.detach().numpy(), "target": target.numpy()}
    for portable in (False, True):
        built = gradgen.build_backward(proto, wrt_inputs=True, portable=portable)
        ops = _ops(built.model)
        assert (PAIR & ops) == (set() if portable else PAIR), ops
        assert sum(op == ("com.microsoft", "BatchNormalizationGrad") for op in ops) == (0 if portable else 1)
        got = Session(built.model).run(feeds)
        for name, grad in zip(built.wrt, built.gradient_names):
            if name in want:
                np.testing.assert_allclose(got[grad], want[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} portable={portable}")


def test_portable_float32_graph_runs_on_onnx_runtime_as_the_default_graph_on_gradgen():
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(1)
    model = _ConvBatchNorm().train()
    x, target = torch.randn(4, 3, 5, 5), torch.randn(4, 3)
    proto = _export(model, (x, target))
    feeds = {"x": x.numpy(), "target": target.numpy()}
    default = gradgen.build_backward(proto, wrt_inputs=True)
    portable = gradgen.build_backward(proto, wrt_inputs=True, portable=True)
    got = Session(default.model).run(feeds)
    session = ort.InferenceSession(ir.to_proto(portable.model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(None, feeds)))
    for grad in default.gradient_names:
        scale = max(1e-3, float(np.abs(expected[grad]).max()))
        np.testing.assert_allclose(got[grad], expected[grad], rtol=1e-4, atol=1e-5 * scale, err_msg=grad)


def _bn_graph(op_type: str, domain: str, outputs: list[str], dtype=TensorProto.DOUBLE, extra_outputs=()):
    """X -> op -> sum(Y * w) as the loss; the other outputs named ``outputs`` (graph outputs when listed
    in ``extra_outputs``)."""
    rng = np.random.default_rng(5)
    values = dict(zip(("x", "scale", "bias", "mean", "var"), _bn_inputs((2, 3, 4, 4), rng)))
    np_type = np.float64 if dtype == TensorProto.DOUBLE else np.float16
    weight = helper.make_tensor("w", dtype, [2, 3, 4, 4], rng.uniform(0.5, 1.5, 96).astype(np_type).tolist())
    nodes = [
        helper.make_node(op_type, list(values), ["y", *outputs], domain=domain, epsilon=2**-12, momentum=0.7, training_mode=1),
        helper.make_node("Mul", ["y", "w"], ["yw"]),
        helper.make_node("ReduceSum", ["yw"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info(n, dtype, list(v.shape)) for n, v in values.items()]
    graph_outputs = [helper.make_tensor_value_info("loss", dtype, [])]
    graph_outputs += [helper.make_tensor_value_info(n, dtype, None) for n in extra_outputs]
    graph = helper.make_graph(nodes, "bn", inputs, graph_outputs, [weight])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    feeds = {n: v.astype(np_type) for n, v in values.items()}
    return helper.make_model(graph, opset_imports=opsets), feeds


def test_a_model_holding_batch_norm_internal_gets_the_gradients_of_batch_normalization():
    """A forward graph with ONNX Runtime training's BatchNormInternal (five outputs, the saved ones
    unread) differentiates as the same graph with BatchNormalization does."""
    internal, feeds = _bn_graph("BatchNormInternal", "com.microsoft", ["rm", "rv", "saved_mean", "saved_inv_std"])
    standard, _ = _bn_graph("BatchNormalization", "", ["rm", "rv"])
    got = Session(gradgen.build_backward(internal, wrt=list(feeds)).model).run(feeds)
    want = Session(gradgen.build_backward(standard, wrt=list(feeds)).model).run(feeds)
    for name in feeds:
        np.testing.assert_allclose(got[f"{name}_grad"], want[f"{name}_grad"], rtol=1e-12, atol=1e-14, err_msg=name)


def test_the_lowered_saved_statistics_are_the_kernels():
    """BatchNormInternal's saved_mean and saved_inv_std as graph outputs: the portable build's
    standard-op form computes what the kernel returns."""
    model, feeds = _bn_graph(
        "BatchNormInternal",
        "com.microsoft",
        ["rm", "rv", "saved_mean", "saved_inv_std"],
        extra_outputs=["saved_mean", "saved_inv_std"],
    )
    default = Session(gradgen.build_backward(model, wrt=["x"]).model).run(feeds)
    portable_model = gradgen.build_backward(model, wrt=["x"], portable=True).model
    assert not any(node.domain == "com.microsoft" for node in portable_model.graph)
    portable = Session(portable_model).run(feeds)
    x = feeds["x"]
    np.testing.assert_allclose(default["saved_mean"], x.mean(axis=(0, 2, 3)), rtol=1e-13)
    np.testing.assert_allclose(default["saved_inv_std"], 1 / np.sqrt(x.var(axis=(0, 2, 3)) + 2**-12), rtol=1e-13)
    for name in ("saved_mean", "saved_inv_std", "x_grad"):
        np.testing.assert_allclose(portable[name], default[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_a_16_bit_batch_norm_keeps_the_composed_gradient():
    """The pair's contract has one type for X and the statistics: a float16 model's saved statistics
    would be rounded to 16 bits, so its gradient stays the composed one (statistics in float32)."""
    model, _ = _bn_graph("BatchNormalization", "", ["rm", "rv"], dtype=TensorProto.FLOAT16)
    assert not PAIR & _ops(gradgen.build_backward(model, wrt=["x", "scale"]).model)


def test_batch_normalization_grad_of_mismatched_shapes_is_a_one_line_error():
    """A hand-made BatchNormalizationGrad whose scale does not have X's channel count: the run's error
    names the node and the sizes."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    feeds = {"dy": x, "x": x, "scale": np.ones(4, np.float32), "mean": np.zeros(3, np.float32), "inv": np.ones(3, np.float32)}
    node = helper.make_node(
        "BatchNormalizationGrad", list(feeds), ["dx", "ds", "db"], domain="com.microsoft", name="bng", epsilon=1e-5
    )
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in feeds.items()]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(
        GradgenError, match=r"'bng'.*BatchNormalizationGrad.*scale has 4 elements, X \[2, 3, 4\] has 3 channels"
    ) as caught:
        Session(model).run(feeds)
    assert "\n" not in str(caught.value).strip()


def test_batch_normalization_grad_kernel_matches_the_composed_formula():
    """The CPU kernel against the rules' composed form (normalize_backward's algebra) in float64, at
    shapes of rank 2 to 5, and its float32 result against that in float64."""
    from gradgen.kernels.cpu.norm import batch_normalization_grad

    rng = np.random.default_rng(4)
    for shape in [(5, 3), (2, 3, 7), (2, 4, 3, 3), (2, 2, 2, 3, 2)]:
        x, dy = (rng.standard_normal(shape) for _ in range(2))
        scale = rng.uniform(0.5, 1.5, shape[1])
        axes = (0, *range(2, len(shape)))
        per_channel = (1, -1) + (1,) * (len(shape) - 2)
        mean, var = x.mean(axis=axes), x.var(axis=axes)
        inv = 1 / np.sqrt(var + 1e-5)
        xhat = (x - mean.reshape(per_channel)) * inv.reshape(per_channel)
        dxhat = dy * scale.reshape(per_channel)
        want_dx = inv.reshape(per_channel) * (
            dxhat - dxhat.mean(axis=axes, keepdims=True) - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
        )
        want = (want_dx, (dy * xhat).sum(axis=axes), dy.sum(axis=axes))
        got = batch_normalization_grad(dy, x, scale, mean, inv)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-13)
        single = batch_normalization_grad(*(a.astype(np.float32) for a in (dy, x, scale, mean, inv)))
        for g, w in zip(single, want):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(w).max()))
