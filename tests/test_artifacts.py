"""gradgen artifacts: ONNX Runtime training's artifacts (training, eval and optimizer models and the
flatbuffer checkpoint) without ONNX Runtime training. Here, on gradgen alone: the checkpoint round-trips
through gradgen's reader, the graphs pass the ONNX checker and hold ONNX Runtime's contracts, the
training model computes the loss and the gradients gradgen's own builder does, and bad input is a
one-line error that writes nothing. tests/test_artifacts_ort.py trains on them in ONNX Runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError, UsageError
from gradgen.training.artifacts import generate_artifacts, optimizer_for, save_artifacts
from gradgen.training.losses import LossSpec
from gradgen.training.optimizers import SGD, AdamW
from gradgen.training.ort_checkpoint import encode_checkpoint, read_checkpoint
from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
CNN = ROOT / "samples" / "cnn" / "model.onnx"
MLP_WITH_LOSS = ROOT / "samples" / "mlp" / "model.onnx"
ADAMW_INPUTS = ["learning_rate", "step", "params", "gradients", "first_order_moments", "second_order_moments"]


def logits_model(path: Path, *, batch: int = 4) -> Path:
    """A two-layer MLP that ends in predictions (no loss): x (batch, 5) -> y (batch, 3).

    ``scale`` is a float initializer that is neither trained nor frozen in the tests: it stays a
    constant of the graphs.
    """
    rng = np.random.default_rng(0)
    inits = {
        "w1": rng.standard_normal((5, 8)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(8).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((8, 3)).astype(np.float32) * 0.5,
        "b2": rng.standard_normal(3).astype(np.float32) * 0.1,
        "scale": np.array(0.5, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
        helper.make_node("Tanh", ["h1"], ["h"], name="tanh"),
        helper.make_node("MatMul", ["h", "w2"], ["y0"], name="mm2"),
        helper.make_node("Add", ["y0", "b2"], ["y1"], name="add2"),
        helper.make_node("Mul", ["y1", "scale"], ["y"], name="scale"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


@pytest.fixture
def model(tmp_path) -> Path:
    return logits_model(tmp_path / "mlp.onnx")


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


# ---------------------------------------------------------------- the checkpoint


def test_checkpoint_round_trips_every_numeric_type(tmp_path):
    rng = np.random.default_rng(1)
    trainable = {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "s": np.array(2.5, np.float32),
        "d": rng.standard_normal(5),
        "h": rng.standard_normal((2, 2)).astype(np.float16),
        "empty": np.zeros((0, 3), np.float32),
    }
    frozen = {"steps": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False, True])}
    data = encode_checkpoint(trainable, frozen)
    assert data[4:8] == b"ODTC"  # ORT's file identifier
    path = tmp_path / "checkpoint"
    path.write_bytes(data)
    back = read_checkpoint(path)
    assert back.version == 2 and not back.nominal and back.optimizer_groups == [] and back.properties == {}
    for mine, theirs in ((trainable, back.requires_grad), (frozen, back.frozen)):
        assert list(theirs) == list(mine)  # the order written is kept
        for name, value in mine.items():
            assert theirs[name].dtype == value.dtype and theirs[name].shape == value.shape
            np.testing.assert_array_equal(theirs[name], value)


def test_checkpoint_reader_refuses_what_is_not_a_checkpoint(tmp_path):
    (tmp_path / "a").write_bytes(b"not a checkpoint at all")
    with pytest.raises(UsageError, match="not an ONNX Runtime training checkpoint"):
        read_checkpoint(tmp_path / "a")
    data = encode_checkpoint({"w": np.ones((64, 64), np.float32)})
    (tmp_path / "b").write_bytes(data[: len(data) // 3])  # truncated
    with pytest.raises(UsageError, match="malformed ONNX Runtime training checkpoint"):
        read_checkpoint(tmp_path / "b")
    with pytest.raises(UsageError, match="no such checkpoint"):
        read_checkpoint(tmp_path / "missing")
    with pytest.raises(UsageError, match="both trainable and frozen"):
        encode_checkpoint({"w": np.ones(2, np.float32)}, {"w": np.ones(2, np.float32)})


# ---------------------------------------------------------------- the models


def test_artifacts_hold_ort_contracts_and_pass_the_checker(model, tmp_path):
    made = generate_artifacts(
        model,
        requires_grad=["w1", "b1", "w2"],
        frozen=["b2"],
        loss=LossSpec("mse", "y"),
        optimizer=AdamW(betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05),
        clip_norm=1.5,
    )
    paths = save_artifacts(made, tmp_path / "out", model)
    assert [p.name for p in paths] == ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"]
    protos = {p.name: onnx.load(str(p)) for p in paths if p.suffix == ".onnx"}
    for proto in protos.values():
        onnx.checker.check_model(proto, full_check=True)

    training = protos["training_model.onnx"].graph
    params = ["w1", "b1", "w2", "b2"]  # initializer order; "scale" is neither: it stays a constant
    buffers = [f"{p}_grad.accumulation.buffer" for p in ["w1", "b1", "w2"]]
    assert [v.name for v in training.input] == ["x", "target", *params, *buffers, "lazy_reset_grad"]
    assert [v.name for v in training.output] == [made.loss] + [f"{p}_grad.accumulation.out" for p in ["w1", "b1", "w2"]]
    assert "scale" in {t.name for t in training.initializer}
    accumulators = [n for n in training.node if n.op_type == "InPlaceAccumulatorV2"]
    assert [(n.domain, n.input[0], n.input[1], n.input[2]) for n in accumulators] == [
        ("com.microsoft", f"{p}_grad.accumulation.buffer", f"{p}_grad", "lazy_reset_grad") for p in ["w1", "b1", "w2"]
    ]
    bool_1 = helper.make_tensor_type_proto(TensorProto.BOOL, [1])
    assert training.input[-1].type == bool_1 and all(v.type == bool_1 for v in training.output[1:])

    evaluation = protos["eval_model.onnx"].graph
    assert [v.name for v in evaluation.input] == ["x", "target", *params]
    assert [v.name for v in evaluation.output] == [made.loss]

    optimizer = protos["optimizer_model.onnx"].graph
    assert [v.name for v in optimizer.input] == ADAMW_INPUTS
    clip, adamw = optimizer.node
    assert (clip.op_type, clip.domain, helper.get_attribute_value(clip.attribute[0])) == (
        "InplaceClipGradNorm",
        "com.microsoft",
        1.5,
    )
    assert adamw.op_type == "AdamWOptimizer" and list(adamw.input)[3] == clip.output[0]
    attrs = {a.name: helper.get_attribute_value(a) for a in adamw.attribute}
    assert attrs["adam_mode"] == 0 and attrs["correct_bias"] == 1
    np.testing.assert_allclose(
        [attrs["alpha"], attrs["beta"], attrs["epsilon"], attrs["weight_decay"]], [0.8, 0.99, 1e-7, 0.05], rtol=1e-6
    )
    assert [v.name for v in optimizer.output] == [adamw.output[0]]

    checkpoint = read_checkpoint(tmp_path / "out" / "checkpoint")
    values = initializers(model)
    assert list(checkpoint.requires_grad) == ["w1", "b1", "w2"] and list(checkpoint.frozen) == ["b2"]
    for name, value in {**checkpoint.requires_grad, **checkpoint.frozen}.items():
        np.testing.assert_array_equal(value, values[name])


def test_training_model_computes_gradgens_loss_and_gradients(model):
    """On gradgen's executor the training model accumulates the gradients build-backward computes
    into the buffers fed for them, and its loss is the eval model's (in onnxruntime too)."""
    ort = pytest.importorskip("onnxruntime")
    made = generate_artifacts(model, frozen=["scale"], loss=LossSpec("mse", "y"), optimizer=SGD())
    assert list(made.requires_grad) == ["w1", "b1", "w2", "b2"]
    rng = np.random.default_rng(2)
    batch = {"x": rng.standard_normal((4, 5)).astype(np.float32), "target": rng.standard_normal((4, 3)).astype(np.float32)}
    params = initializers(model)
    buffers = {f"{p}_grad.accumulation.buffer": np.full_like(params[p], 0.25) for p in made.requires_grad}
    feeds = {
        **batch,
        **{p: params[p] for p in [*made.requires_grad, *made.frozen]},
        **buffers,
        "lazy_reset_grad": np.array([False]),
    }
    outputs = gradgen.Session(made.training).run(feeds)

    reference = gradgen.build_backward(model, add_loss=LossSpec("mse", "y"), freeze=["scale"])
    expected = gradgen.Session(reference.model).run(batch)
    np.testing.assert_allclose(outputs[made.loss], expected[reference.loss], rtol=1e-6)
    for p in made.requires_grad:
        assert outputs[f"{p}_grad.accumulation.out"].tolist() == [True]
        np.testing.assert_allclose(buffers[f"{p}_grad.accumulation.buffer"], 0.25 + expected[f"{p}_grad"], rtol=1e-5, atol=1e-6)

    eval_feeds = {**batch, **{p: params[p] for p in [*made.requires_grad, *made.frozen]}}
    session = ort.InferenceSession(ir.to_proto(made.eval).SerializeToString(), providers=["CPUExecutionProvider"])
    (eval_loss,) = session.run(None, eval_feeds)
    np.testing.assert_allclose(eval_loss, outputs[made.loss], rtol=1e-6)


def test_model_ending_in_its_loss_and_cross_entropy_on_logits(tmp_path):
    plain = generate_artifacts(MLP_WITH_LOSS, optimizer=AdamW())  # ends in its loss: no loss block
    assert plain.loss == "loss" and plain.user_inputs == ["x", "target"]
    assert list(plain.requires_grad) == list(initializers(MLP_WITH_LOSS)) and not plain.frozen

    made = generate_artifacts(CNN, loss=LossSpec("cross_entropy", "logits"), optimizer=None)
    assert made.optimizer is None
    paths = save_artifacts(made, tmp_path / "cnn", CNN)
    assert [p.name for p in paths] == ["training_model.onnx", "eval_model.onnx", "checkpoint"]
    training = onnx.load(str(paths[0]))
    onnx.checker.check_model(training, full_check=True)
    # The sample's own loss (and its labels) made way for the loss block's: int64 labels (batch,).
    assert made.loss == "loss" and made.user_inputs == ["x", "labels"]
    assert len(training.graph.output) == 1 + len(made.requires_grad)
    (labels,) = [v for v in training.graph.input if v.name == "labels"]
    assert labels.type == helper.make_tensor_type_proto(TensorProto.INT64, [3])
    assert not any(n.op_type == "SoftmaxCrossEntropyLoss" and "gradgen_loss" not in n.name for n in training.graph.node)


@pytest.mark.parametrize("loss", [LossSpec("bce_with_logits", "y"), LossSpec("cross_entropy", "y", label_smoothing=0.1)])
def test_a_loss_blocks_constants_are_not_parameters(model, loss):
    """bce_with_logits' 1 and 0, label smoothing's weights: constants of the loss, never trained (they
    were float initializers, and training the 1 of log(1 + exp(-|x|)) drove the loss below 0)."""
    made = generate_artifacts(model, frozen=["scale"], loss=loss, optimizer=AdamW())
    assert list(made.requires_grad) == ["w1", "b1", "w2", "b2"]
    assert not [v.name for v in made.training.graph.inputs if v.name.startswith("gradgen")]
    assert gradgen.build_backward(model, add_loss=loss, freeze=["scale"]).wrt == ["w1", "b1", "w2", "b2"]


def test_sgd_optimizer_model_is_plain_sgd(model):
    made = generate_artifacts(model, requires_grad=["w1"], loss=LossSpec("l1", "y"), optimizer=SGD())
    graph = made.optimizer.graph
    assert [v.name for v in graph.input] == ADAMW_INPUTS[:5]  # ORT's SGD block keeps first_order_moments
    (node,) = graph.node
    assert (node.op_type, node.domain, list(node.input)) == (
        "SGDOptimizerV2",
        "com.microsoft",
        ["learning_rate", "params", "gradients"],
    )
    with pytest.raises(UsageError, match="plain SGD"):
        generate_artifacts(model, loss=LossSpec("l1", "y"), optimizer=SGD(momentum=0.9))


def test_bad_parameters_are_one_line_errors(model, tmp_path):
    spec = LossSpec("mse", "y")
    with pytest.raises(UsageError, match=r"--requires-grad names no float initializer of the model: 'nope'"):
        generate_artifacts(model, requires_grad=["w1", "nope"], loss=spec)
    with pytest.raises(UsageError, match=r"--frozen names no float initializer of the model: 'h'"):
        generate_artifacts(model, frozen=["h"], loss=spec)
    with pytest.raises(UsageError, match="either trainable"):
        generate_artifacts(model, requires_grad=["w1"], frozen=["w1"], loss=spec)
    with pytest.raises(ModelError, match="no scalar float output to use as the loss.*--loss KIND"):
        generate_artifacts(model)
    with pytest.raises(UsageError, match=r"the model has 2 outputs \(loss, logits\): name the one the loss reads"):
        generate_artifacts(CNN, loss=LossSpec("cross_entropy", None))
    extra = onnx.load(str(model))
    extra.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    onnx.save(extra, str(tmp_path / "extra.onnx"))
    with pytest.raises(UsageError, match="--requires-grad 'unused': the loss does not depend on it"):
        generate_artifacts(tmp_path / "extra.onnx", requires_grad=["w1", "unused"], loss=spec)
    # Frozen, it is held by the checkpoint, and no graph reads it.
    made = generate_artifacts(tmp_path / "extra.onnx", requires_grad=["w1"], frozen=["unused"], loss=spec)
    assert list(made.frozen) == ["unused"] and "unused" not in {v.name for v in made.training.graph.inputs}
    no_floats = tmp_path / "int.onnx"
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "k"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
        initializer=[numpy_helper.from_array(np.array([1, 2], np.int64), "k")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(no_floats))
    with pytest.raises(ModelError, match="no float initializer"):
        generate_artifacts(no_floats, loss=spec)


# ---------------------------------------------------------------- the command


def test_cli_writes_the_artifacts(model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "new" / "artifacts"
    code, stdout, stderr = run_cli(
        capsys,
        monkeypatch,
        "artifacts",
        model,
        "--loss",
        "mse",
        "--requires-grad",
        "w1",
        "--requires-grad",
        "w2",
        "--frozen",
        "b1",
        "--optimizer",
        "sgd",
        "-o",
        out,
    )
    assert code == 0, stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoint",
        "eval_model.onnx",
        "optimizer_model.onnx",
        "training_model.onnx",
    ]
    assert "trainable: 2 parameter(s), 64 values: w1, w2" in stdout and "frozen: 1 parameter(s), 8 values: b1" in stdout
    checkpoint = read_checkpoint(out / "checkpoint")
    assert list(checkpoint.requires_grad) == ["w1", "w2"] and list(checkpoint.frozen) == ["b1"]
    assert onnx.load(str(out / "optimizer_model.onnx")).graph.node[0].op_type == "SGDOptimizerV2"


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--loss", "mse", "--requires-grad", "nope"], 2, "--requires-grad names no float initializer of the model: 'nope'"),
        (["--loss", "mse", "--requires-grad", "w1", "--frozen", "w1"], 2, "either trainable (--requires-grad) or frozen"),
        (["--loss", "mse", "--output", "h"], 2, "--output 'h' is not a graph output"),
        (["--loss", "mse", "--optimizer", "sgd", "--weight-decay", "0.1"], 2, "plain SGD"),
        (["--loss", "mse", "--optimizer", "sgd", "--beta1", "0.5"], 2, "AdamW options"),
        (["--loss", "hinge"], 2, "unknown loss 'hinge'"),
        (["--optimizer", "adam"], 2, "unknown optimizer 'adam'"),
        ([], 3, "no scalar float output to use as the loss"),
    ],
)
def test_cli_bad_input_writes_nothing(model, tmp_path, capsys, monkeypatch, args, code, message):
    out = tmp_path / "out"
    got, stdout, stderr = run_cli(capsys, monkeypatch, "artifacts", model, *args, "-o", out)
    assert got == code, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not out.exists()  # the directory it would have created is not left behind


def test_cli_without_flatbuffers_says_how_to_install_it(model, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "flatbuffers", None)  # import flatbuffers raises ImportError
    code, _, stderr = run_cli(capsys, monkeypatch, "artifacts", model, "--loss", "mse", "-o", tmp_path / "out")
    assert code == 2 and "pip install 'gradgen[artifacts]'" in stderr and not (tmp_path / "out").exists()


def test_cli_refuses_unwritable_directories_and_the_input_model(model, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    code, _, stderr = run_cli(capsys, monkeypatch, "artifacts", model, "--loss", "mse", "-o", tmp_path / "file" / "sub")
    assert code == 2 and "cannot create the output directory" in stderr
    code, _, stderr = run_cli(capsys, monkeypatch, "artifacts", model, "--loss", "mse", "-o", tmp_path / "file")
    assert code == 2 and "not a directory" in stderr
    inside = logits_model(tmp_path / "training_model.onnx")
    before = inside.read_bytes()
    code, _, stderr = run_cli(capsys, monkeypatch, "artifacts", inside, "--loss", "mse", "-o", tmp_path)
    assert code == 2 and "must not be the input model" in stderr
    assert inside.read_bytes() == before and not (tmp_path / "checkpoint").exists()


def test_optimizer_for_takes_two_betas_as_a_tuple():
    assert optimizer_for("adamw", betas=[0.8, 0.99]).betas == (0.8, 0.99)  # a list from a caller works too
    with pytest.raises(UsageError, match=r"betas \(0.8, 0.9, 0.99\): expected two values"):
        optimizer_for("adamw", betas=(0.8, 0.9, 0.99))  # type: ignore[arg-type]


def test_the_eval_model_of_a_training_mode_batch_norm_is_valid_onnx(tmp_path):
    """A BatchNormalization exported in training mode has three outputs; in the eval model it runs
    in inference mode, where ONNX allows one: the running-statistics outputs go (ONNX Runtime refused
    the model before), and the model runs with the running statistics."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)).train()
    path = tmp_path / "bn.onnx"
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        net[1].running_mean.uniform_(-0.5, 0.5)
        net[1].running_var.uniform_(0.5, 2.0)
    torch.onnx.export(
        net, (x,), str(path), dynamo=False, opset_version=17, training=torch.onnx.TrainingMode.TRAINING,
        do_constant_folding=False, input_names=["x"], output_names=["logits"],
    )  # fmt: skip
    made = generate_artifacts(path, loss=LossSpec("cross_entropy", "logits"), optimizer=SGD())
    eval_path = save_artifacts(made, tmp_path / "artifacts", path)[1]
    evaluation = onnx.load(str(eval_path))
    (bn,) = [n for n in evaluation.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn.output) == 1 and helper.get_node_attr_value(bn, "training_mode") == 0
    onnx.checker.check_model(evaluation, full_check=True)
    session = ort.InferenceSession(evaluation.SerializeToString(), providers=["CPUExecutionProvider"])
    labels = np.array([0, 2], np.int64)
    params = {name: np.asarray(value.numpy()) for name, value in made.requires_grad.items()}
    (loss,) = session.run(None, {"x": x.numpy(), "labels": labels, **params})
    net.eval()
    want = torch.nn.functional.cross_entropy(net(x), torch.from_numpy(labels)).item()
    assert float(loss) == pytest.approx(want, rel=1e-5)
