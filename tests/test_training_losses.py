"""Loss blocks (AddLossPass): values and gradients against PyTorch's functional losses and finite
differences; errors naming the output, the target and the option at fault."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.api import run_pipeline
from gradgen.check import check_gradients
from gradgen.errors import ModelError, UsageError
from gradgen.passes import Pipeline
from gradgen.training.losses import AddLossPass, LossSpec

torch = pytest.importorskip("torch")
F = torch.nn.functional


def identity_model(shape, dtype=TensorProto.DOUBLE, opset=17) -> ir.Model:
    """z -> Identity -> logits, so that the gradient reaching z is the loss's gradient."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["z"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("z", dtype, shape)],
        [helper.make_tensor_value_info("logits", dtype, shape)],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def linear_model(n=4, d=5, c=3) -> onnx.ModelProto:
    """x @ W + b -> logits (float32), for finite-difference checks of a loss through a layer."""
    rng = np.random.default_rng(7)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["logits"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, d])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [n, c])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((d, c)).astype(np.float32), "W"),
            numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def add_loss(model: ir.Model, spec: LossSpec) -> AddLossPass:
    adder = AddLossPass(spec)
    run_pipeline(Pipeline(adder), model)  # a gradgen error inside a pass surfaces as itself
    return adder


def run_loss_and_grad(shape, spec: LossSpec, z: np.ndarray, target: np.ndarray):
    model = identity_model(shape)
    adder = add_loss(model, spec)
    built = gradgen.build_backward(model, loss=adder.loss_name, wrt=["z"])
    out = gradgen.Session(built.model).run({"z": z, adder.target_name: target})
    return float(out[adder.loss_name]), out["z_grad"]


CROSS_ENTROPY_CASES = [
    ([6, 5], {}),
    ([6, 5], {"label_smoothing": 0.1}),
    ([2, 4, 7], {}),  # (batch, time, vocab): classes last, the default
    ([2, 4, 7], {"label_smoothing": 0.25}),
    ([2, 5, 3], {"class_axis": 1}),
    ([2, 5, 3, 2], {"class_axis": 1, "label_smoothing": 0.2}),
    ([6, 5], {"ignore_index": None}),
    ([6, 5], {"ignore_index": 2, "label_smoothing": 0.1}),
]


@pytest.mark.parametrize("shape, options", CROSS_ENTROPY_CASES)
def test_cross_entropy_matches_torch(shape, options):
    rng = np.random.default_rng(len(shape) + len(options))
    spec = LossSpec("cross_entropy", "logits", **options)
    axis = options.get("class_axis", -1) % len(shape)
    classes = shape[axis]
    label_shape = [d for i, d in enumerate(shape) if i != axis]
    z = rng.standard_normal(shape)
    labels = rng.integers(0, classes, label_shape)
    ignore = options.get("ignore_index", -100)
    if ignore is not None:
        labels.flat[1] = ignore  # an ignored sample: out of the mean and of the smoothing term
    loss, grad = run_loss_and_grad(shape, spec, z, labels)

    zt = torch.tensor(z, requires_grad=True)
    logits = zt if axis == 1 else zt.movedim(axis, 1)
    ref = F.cross_entropy(
        logits,
        torch.tensor(labels),
        ignore_index=-100 if ignore is None else ignore,
        label_smoothing=options.get("label_smoothing", 0.0),
    )
    ref.backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, zt.grad.numpy(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "kind, torch_loss", [("mse", F.mse_loss), ("l1", F.l1_loss), ("bce_with_logits", F.binary_cross_entropy_with_logits)]
)
def test_regression_losses_match_torch(kind, torch_loss):
    rng = np.random.default_rng(3)
    shape = [4, 3]
    z = rng.standard_normal(shape) * 3
    target = rng.random(shape) if kind == "bce_with_logits" else rng.standard_normal(shape)
    z[0, 0] = 0.0  # BCE: the kink of max(x, 0) and |x|; the gradient is still sigmoid(0) - t
    z[1, 1] = 40.0  # BCE: large logits, no overflow
    z[2, 2] = -40.0
    loss, grad = run_loss_and_grad(shape, LossSpec(kind, "logits"), z, target)
    zt = torch.tensor(z, requires_grad=True)
    ref = torch_loss(zt, torch.tensor(target))
    ref.backward()
    np.testing.assert_allclose(loss, ref.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, zt.grad.numpy(), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize(
    "kind, options",
    [("cross_entropy", {"label_smoothing": 0.1, "ignore_index": 1}), ("mse", {}), ("l1", {}), ("bce_with_logits", {})],
)
def test_losses_through_a_layer_match_finite_differences(kind, options):
    model = ir.from_proto(linear_model())
    adder = add_loss(model, LossSpec(kind, "logits", **options))
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((4, 5)).astype(np.float32)}
    if kind == "cross_entropy":
        feeds[adder.target_name] = np.array([0, 1, 2, 2])  # one label ignored
    else:
        feeds[adder.target_name] = rng.random((4, 3)).astype(np.float32)
    report = check_gradients(model, loss=adder.loss_name, inputs=feeds, wrt_inputs=True)
    assert report.passed, report.format()
    assert {"W", "b", "x"} <= {t.name for t in report.tensors}


def test_target_names_and_types():
    model = identity_model([3, 4], TensorProto.FLOAT)
    adder = add_loss(model, LossSpec("cross_entropy", "logits"))
    target = next(v for v in model.graph.inputs if v.name == adder.target_name)
    assert (adder.target_name, adder.loss_name) == ("labels", "loss")
    assert target.dtype == ir.DataType.INT64 and list(target.shape) == [3]
    loss = next(v for v in model.graph.outputs if v.name == "loss")
    assert loss.dtype == ir.DataType.FLOAT and list(loss.shape) == []
    # A second loss on the same model gets free names; the first output keeps its own.
    second = add_loss(model, LossSpec("mse", "logits"))
    assert (second.target_name, second.loss_name) == ("target", "loss_1")
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


@pytest.mark.parametrize(
    "spec, error, words",
    [
        (LossSpec("mse", "nope"), UsageError, ["'nope'", "logits"]),
        (LossSpec("mse", "logits", target="z"), UsageError, ["'z'", "already"]),
        (LossSpec("cross_entropy", "logits", class_axis=0), UsageError, ["class axis 0"]),
        (LossSpec("mse", None), UsageError, ["mse loss names no output"]),
    ],
)
def test_bad_specs_name_what_is_wrong(spec, error, words):
    with pytest.raises(error) as info:
        add_loss(identity_model([3, 4]), spec)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_options_and_models():
    with pytest.raises(UsageError, match="unknown loss 'hinge'"):
        LossSpec("hinge", "logits")
    with pytest.raises(UsageError, match="cross_entropy loss only"):
        LossSpec("mse", "logits", label_smoothing=0.1)
    with pytest.raises(ModelError, match="opset 13"):
        add_loss(identity_model([3, 4], opset=11), LossSpec("mse", "logits"))
    with pytest.raises(ModelError, match="rank 2"):
        add_loss(identity_model([4]), LossSpec("cross_entropy", "logits"))


def test_build_backward_add_loss_on_the_command_line(tmp_path, capsys, monkeypatch):
    import sys

    from gradgen.cli import main

    source = tmp_path / "linear.onnx"
    onnx.save(linear_model(), str(source))
    out = tmp_path / "linear_grad.onnx"
    monkeypatch.setattr(
        sys,
        "argv",
        ["gradgen", "build-backward", str(source), "-o", str(out), "--add-loss", "cross-entropy", "--loss-output", "logits"],
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    stdout, _ = capsys.readouterr()
    assert exit_info.value.code == 0 and "loss: loss" in stdout and "W_grad" in stdout
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x", "labels"]
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((4, 5)).astype(np.float32), np.array([0, 2, 1, 2])
    got = gradgen.Session(str(out)).run({"x": x, "labels": labels})
    W = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]).copy(), requires_grad=True)
    b = torch.tensor(numpy_helper.to_array(model.graph.initializer[1]).copy())
    F.cross_entropy(torch.tensor(x) @ W + b, torch.tensor(labels)).backward()
    np.testing.assert_allclose(got["W_grad"], W.grad.numpy(), rtol=1e-5, atol=1e-6)

    monkeypatch.setattr(sys, "argv", ["gradgen", "build-backward", str(source), "-o", str(out), "--add-loss", "mse"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "--loss-output" in capsys.readouterr()[1]
