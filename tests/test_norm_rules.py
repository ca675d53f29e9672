"""RMSNormalization, LpNormalization, MeanVarianceNormalization and LRN: gradgen's gradients against
torch.autograd (float64), and LpNormalization at a zero norm."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

torch = pytest.importorskip("torch")
F = torch.nn.functional

rng = np.random.default_rng(515)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axis", [((2, 3, 8), -1), ((2, 3, 4), 1), ((4, 6), 0)])
def test_rms_norm_vs_torch(shape, axis, symbolic):
    norm_shape = shape[axis % len(shape) :]
    inputs = {"x": rng.normal(size=shape), "scale": rng.normal(size=norm_shape)}
    eps = 1e-4
    got, w = run_gradgen("RMSNormalization", inputs, {}, {"axis": axis, "epsilon": eps}, [shape], opset=23, symbolic=symbolic)
    want = torch_grads(lambda x, scale: F.rms_norm(x, norm_shape, scale, eps), inputs, w)
    assert_close(got, want)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape,axis", [((3, 5), -1), ((2, 4, 3), 1)])
def test_lp_normalization_vs_torch(shape, axis, p, symbolic):
    inputs = {"x": rng.normal(size=shape)}
    got, w = run_gradgen("LpNormalization", inputs, {}, {"axis": axis, "p": p}, [shape], symbolic=symbolic)
    assert_close(got, torch_grads(lambda x: F.normalize(x, p=p, dim=axis, eps=0.0), inputs, w))


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization_zero_norm_gets_a_zero_gradient(p):
    """y is 0 on a zero row (the kernel's and ONNX Runtime's choice); its gradient there is 0, not NaN."""
    x = rng.normal(size=(3, 4))
    x[1] = 0.0
    got, _ = run_gradgen("LpNormalization", {"x": x}, {}, {"axis": 1, "p": p}, [x.shape])
    assert np.isfinite(got["x"]).all()
    np.testing.assert_array_equal(got["x"][1], 0.0)
    assert np.abs(got["x"][[0, 2]]).min() > 0


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axes", [((2, 3, 4, 2), None), ((2, 3, 5), [1]), ((2, 3, 4), [0, 2])])
def test_mean_variance_normalization_vs_torch(shape, axes, symbolic):
    inputs = {"x": rng.normal(size=shape)}
    attrs = {} if axes is None else {"axes": axes}
    dims = tuple(axes or (0, 2, 3))
    got, w = run_gradgen("MeanVarianceNormalization", inputs, {}, attrs, [shape], opset=13, symbolic=symbolic)

    def mvn(x):  # ONNX's function body, the variance as the mean of squared deviations
        centered = x - x.mean(dim=dims, keepdim=True)
        return centered / (torch.sqrt((centered * centered).mean(dim=dims, keepdim=True)) + 1e-9)

    assert_close(got, torch_grads(mvn, inputs, w))


def test_mean_variance_normalization_gradient_of_close_and_constant_lines():
    """Lines of close values (a spread 1e-3 of their size) get PyTorch's gradient, where the
    body's mean(x^2) - mean^2 would cancel; a constant line gets a finite gradient (the second
    term's 0 / 0 is its limit, 0)."""
    x = 1.75 + 1e-3 * rng.normal(size=(4, 3))
    x[:, 2] = 0.5  # a constant line along axis 0
    got, w = run_gradgen("MeanVarianceNormalization", {"x": x}, {}, {"axes": [0]}, [x.shape], opset=13)
    assert np.isfinite(got["x"]).all()

    def mvn(x):
        centered = x - x.mean(dim=0, keepdim=True)
        return centered / (torch.sqrt((centered * centered).mean(dim=0, keepdim=True)) + 1e-9)

    want = torch_grads(mvn, {"x": x}, w)["x"]
    np.testing.assert_allclose(got["x"][:, :2], want[:, :2], rtol=1e-6, atol=1e-9 * np.abs(want[:, :2]).max())


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,size", [((2, 7, 3, 3), 5), ((2, 4, 5), 3), ((1, 3, 2, 2), 7)])
def test_lrn_vs_torch(shape, size, symbolic):
    """Odd sizes only: for an even size torch puts the longer half of the window before the channel,
    ONNX after it (the finite-difference cases check even sizes)."""
    inputs = {"x": rng.normal(size=shape)}
    alpha, beta, bias = 0.375, 0.625, 1.25  # exact in float32, the attributes' type
    attrs = {"size": size, "alpha": alpha, "beta": beta, "bias": bias}
    got, w = run_gradgen("LRN", inputs, {}, attrs, [shape], opset=13, symbolic=symbolic)
    want = torch_grads(lambda x: F.local_response_norm(x, size, alpha=alpha, beta=beta, k=bias), inputs, w)
    assert_close(got, want)


def test_lrn_kernel_vs_torch_forward():
    x = rng.normal(size=(2, 6, 3, 3))
    node = helper.make_node("LRN", ["x"], ["y"], size=5, alpha=0.375, beta=0.625, bias=1.25)
    graph = helper.make_graph(
        [node],
        "lrn",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, x.shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    got = Session(model).run({"x": x})["y"]
    want = F.local_response_norm(torch.tensor(x), 5, alpha=0.375, beta=0.625, k=1.25).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_lp_normalization_bad_p_is_a_model_error():
    node = helper.make_node("LpNormalization", ["x"], ["y"], p=3)
    graph = helper.make_graph(
        [node, helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        "lp",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(gradgen.ModelError, match="LpNormalization node .*p must be 1 or 2, got 3"):
        gradgen.build_backward(model, wrt_inputs=True)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_batch_norm_statistics_of_another_type_than_scale(training):
    """ONNX lets BatchNormalization's statistics (T2) differ from its scale and bias (T1): PyTorch's
    dynamo exporter writes a float64 model's BatchNorm2d(affine=False) with float32 ones and zeros
    for scale and bias. The gradients (each in its input's type) are those of the all-float64 model
    to float32's accuracy; the rule built Muls of float32 and float64 before."""
    rng = np.random.default_rng(3)
    values = {
        "x": rng.standard_normal((2, 3, 4, 4)),
        "scale": rng.uniform(0.5, 1.5, 3),
        "bias": rng.standard_normal(3),
        "mean": rng.standard_normal(3) * 0.1,
        "var": rng.uniform(0.5, 2.0, 3),
    }
    weight = helper.make_tensor("w", TensorProto.DOUBLE, [2, 3, 4, 4], rng.uniform(0.5, 1.5, 96))
    outputs = ["y", "running_mean", "running_var"] if training else ["y"]
    nodes = [
        helper.make_node("BatchNormalization", list(values), outputs, epsilon=1e-5, training_mode=int(training)),
        helper.make_node("Mul", ["y", "w"], ["yw"]),
        helper.make_node("ReduceSum", ["yw"], ["loss_y"], keepdims=0),
    ]
    if training:  # the running mean in the loss too: its gradient reaches x through the batch mean
        nodes += [helper.make_node("ReduceSum", ["running_mean"], ["loss_m"], keepdims=0)]
        nodes += [helper.make_node("Add", ["loss_y", "loss_m"], ["loss"])]
    else:
        nodes += [helper.make_node("Identity", ["loss_y"], ["loss"])]

    def model(param_type):
        types = {
            "x": TensorProto.DOUBLE,
            "scale": param_type,
            "bias": param_type,
            "mean": TensorProto.DOUBLE,
            "var": TensorProto.DOUBLE,
        }
        inputs = [helper.make_tensor_value_info(n, types[n], list(v.shape)) for n, v in values.items()]
        graph = helper.make_graph(nodes, "bn", inputs, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], [weight])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    def grads(param_type, dtype):
        feeds = {n: v.astype(dtype) if n in ("scale", "bias") else v for n, v in values.items()}
        built = gradgen.build_backward(model(param_type), wrt=list(values))
        return Session(built.model).run(feeds)

    want = grads(TensorProto.DOUBLE, np.float64)
    got = grads(TensorProto.FLOAT, np.float32)
    for name in values:
        g = got[f"{name}_grad"]
        assert g.dtype == (np.float32 if name in ("scale", "bias") else np.float64), name
        w = want[f"{name}_grad"]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(w).max()), err_msg=name)
