"""BatchNormalization's running statistics during training: a model exported in training mode
normalises each step with the batch's statistics, and each step updates the running statistics as
ONNX defines it (``momentum * running + (1 - momentum) * batch``, the batch variance biased). Checked
step by step against the same PyTorch loop, on both step runners (host and device-state), through
evaluation (inference mode), checkpoints, export, gradient accumulation and ONNX Runtime."""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_ir as ir
import pytest

from gradgen.grads.rules.norm import batch_norm_in_training
from gradgen.training import SGD, DeviceStepRunner, HostStepRunner, Trainer, build_training
from gradgen.training.checkpoint import load_checkpoint, save_checkpoint
from gradgen.training.export import export_trained
from gradgen.training.trainer import TrainState

torch = pytest.importorskip("torch")

STEPS = 4
LR = 0.1
MOMENTUM = 0.1  # PyTorch's convention; the export writes ONNX's 1 - 0.1
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class ConvBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4, momentum=MOMENTUM)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, labels):
        features = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        return torch.nn.functional.cross_entropy(self.fc(features), labels)


def _module():
    torch.manual_seed(0)
    module = ConvBatchNorm().train()
    with torch.no_grad():  # statistics far from the defaults, so that an update that did not happen shows
        module.bn.running_mean.uniform_(-1, 1)
        module.bn.running_var.uniform_(0.5, 2)
    return module


def _export(module) -> onnx.ModelProto:
    x, labels = torch.zeros(2, 3, 6, 6), torch.zeros(2, dtype=torch.int64)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            copy.deepcopy(module),
            (x, labels),
            buffer,
            dynamo=False,
            opset_version=17,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["x", "labels"],
            output_names=["loss"],
            dynamic_axes={"x": {0: "batch"}, "labels": {0: "batch"}},
        )
    proto = onnx.load_from_string(buffer.getvalue())
    # the exporter ran a training-mode forward on the sample while tracing, which moved the running
    # statistics it then wrote: the PyTorch side starts from those
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    with torch.no_grad():
        for name in ("running_mean", "running_var"):
            getattr(module.bn, name).copy_(torch.from_numpy(initializers[f"bn.{name}"].copy()))
    return proto


def _batches(count: int, size: int = 6):
    rng = np.random.default_rng(1)
    return [
        {"x": (rng.standard_normal((size, 3, 6, 6)) * 2 + 0.5).astype(np.float32), "labels": rng.integers(0, 3, size)}
        for _ in range(count)
    ]


def _train_torch(module, batches, accumulation: int = 1):
    """PyTorch's SGD loop; also the running statistics as ONNX's update gives them, from the
    BatchNorm input of each step's last micro-batch (gradgen's accumulation updates once a step)."""
    inputs = []
    hook = module.bn.register_forward_pre_hook(lambda _module, args: inputs.append(args[0].detach().double()))
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    onnx_mean = module.bn.running_mean.detach().double().clone()
    onnx_var = module.bn.running_var.detach().double().clone()
    torch_var = onnx_var.clone()  # PyTorch's own update, from the same micro-batches
    for step in range(len(batches) // accumulation):
        optimizer.zero_grad()
        for batch in batches[step * accumulation : (step + 1) * accumulation]:
            loss = module(torch.from_numpy(batch["x"]), torch.from_numpy(batch["labels"]))
            (loss / accumulation).backward()
        optimizer.step()
        last = inputs[-1]
        count = last.numel() // last.shape[1]
        mean, var = last.mean((0, 2, 3)), last.var((0, 2, 3), unbiased=False)
        onnx_mean = (1 - MOMENTUM) * onnx_mean + MOMENTUM * mean
        onnx_var = (1 - MOMENTUM) * onnx_var + MOMENTUM * var
        torch_var = (1 - MOMENTUM) * torch_var + MOMENTUM * var * count / (count - 1)
    hook.remove()
    return onnx_mean.numpy(), onnx_var.numpy(), torch_var.numpy()


def _assert_close(got, want, what, rtol=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.abs(got - want).max() <= rtol * np.abs(want).max(), f"{what}: {got} against {want}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("runner", [HostStepRunner, DeviceStepRunner])
def test_steps_update_the_running_statistics_as_onnx_defines_them(device, runner):
    module = _module()
    program = build_training(_export(module), optimizer=SGD())
    assert program.running_statistics_updated == ["bn.running_mean", "bn.running_var"]
    batches = _batches(STEPS)
    trainer = Trainer(program, lr=LR, runner=runner(program, device))
    trainer.fit(batches, STEPS)
    onnx_mean, onnx_var, torch_var = _train_torch(module, batches)
    params = trainer.params
    # the mean is PyTorch's; the variance follows ONNX's rule (biased batch variance), which parts
    # from PyTorch's (unbiased) by the factor n / (n - 1) on each step's share
    _assert_close(params["bn.running_mean"], module.bn.running_mean.detach().numpy(), "running mean against PyTorch")
    _assert_close(params["bn.running_mean"], onnx_mean, "running mean")
    _assert_close(params["bn.running_var"], onnx_var, "running variance")
    _assert_close(module.bn.running_var.detach().numpy(), torch_var, "PyTorch's own running variance")
    assert not np.allclose(params["bn.running_var"], program.initial_params["bn.running_var"])
    for name, value in module.named_parameters():  # the batch statistics normalised the steps
        _assert_close(params[name], value.detach().numpy(), name, rtol=1e-4)


def test_evaluation_normalises_with_the_running_statistics():
    """Trainer.evaluate runs in inference mode, as PyTorch's eval(): the loss is PyTorch's eval-mode
    loss with gradgen's running statistics, not the batch-statistics loss of a step."""
    module = _module()
    program = build_training(_export(module), optimizer=SGD())
    batches = _batches(STEPS + 1)
    trainer = Trainer(program, lr=LR)
    trainer.fit(batches[:STEPS], STEPS)
    _train_torch(module, batches[:STEPS])
    with torch.no_grad():
        module.bn.running_var.copy_(torch.from_numpy(trainer.params["bn.running_var"]))
        held_out = {k: torch.from_numpy(v) for k, v in batches[STEPS].items()}
        eval_loss = module.eval()(**held_out).item()
        train_loss = module.train()(**held_out).item()
    got = trainer.evaluate([batches[STEPS]])
    assert abs(got - eval_loss) <= 1e-5 * abs(eval_loss)
    assert abs(got - train_loss) > 1e-3  # the two modes differ on this data
    bn = [n for n in program.evaluate.graph if n.op_type == "BatchNormalization"]
    assert [batch_norm_in_training(n) for n in bn] == [False]


def test_checkpoints_and_export_carry_the_running_statistics(tmp_path):
    module = _module()
    proto = _export(module)
    program = build_training(proto, optimizer=SGD())
    trainer = Trainer(program, lr=LR)
    trainer.fit(_batches(2), 2)
    path = save_checkpoint(tmp_path / "ckpt.npz", program, trainer.state)
    state, _ = load_checkpoint(path)
    np.testing.assert_array_equal(state.params["bn.running_var"], trainer.params["bn.running_var"])
    resumed = Trainer(program, lr=LR)
    resumed.load_state(state)
    np.testing.assert_array_equal(resumed.params["bn.running_mean"], trainer.params["bn.running_mean"])
    exported = export_trained(ir.from_proto(proto), path, keep_loss=True)
    for name in program.running_statistics_updated:
        np.testing.assert_array_equal(exported.graph.initializers[name].const_value.numpy(), trainer.params[name])


def test_a_checkpoint_without_running_statistics_starts_them_from_the_model():
    """A checkpoint written before the running statistics were step state still loads."""
    program = build_training(_export(_module()), optimizer=SGD())
    trainer = Trainer(program, lr=LR)
    trainer.fit(_batches(1), 1)
    state = trainer.state
    old = TrainState({k: v for k, v in state.params.items() if "running" not in k}, state.states, state.step)
    resumed = Trainer(program, lr=LR)
    with pytest.warns(UserWarning, match="no value for 2 BatchNormalization running statistic"):
        resumed.load_state(old)
    np.testing.assert_array_equal(resumed.params["bn.running_var"], program.initial_params["bn.running_var"])


@pytest.mark.parametrize("runner", [HostStepRunner, DeviceStepRunner])
def test_with_accumulation_the_last_micro_batch_updates_them(runner):
    module = _module()
    program = build_training(_export(module), optimizer=SGD(), accumulation=2)
    batches = _batches(2 * STEPS)
    trainer = Trainer(program, lr=LR, runner=runner(program, "cpu"))
    trainer.fit(batches, STEPS)  # two micro-batches a step
    onnx_mean, onnx_var, _ = _train_torch(module, batches, accumulation=2)
    _assert_close(trainer.params["bn.running_mean"], onnx_mean, "running mean")
    _assert_close(trainer.params["bn.running_var"], onnx_var, "running variance")
    for name, value in module.named_parameters():
        _assert_close(trainer.params[name], value.detach().numpy(), name, rtol=1e-4)


def test_the_portable_step_updates_them_on_onnxruntime_too():
    ort = pytest.importorskip("onnxruntime")
    from gradgen.executor import Session

    program = build_training(_export(_module()), optimizer=SGD(), portable=True)
    proto = ir.to_proto(program.train)
    feeds = {**_batches(1)[0], **program.initial_params, program.layout.lr: np.array(LR, np.float32)}
    ours = Session(program.train).run(feeds)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    for name in program.running_statistics_updated:
        output = program.layout.params[name]
        np.testing.assert_allclose(ours[output], theirs[output], rtol=1e-5, err_msg=name)
        assert not np.allclose(ours[output], program.initial_params[name])


def test_gradgen_train_and_export_carry_them(tmp_path, capsys, monkeypatch):
    """The command line as a user meets it: no note that the statistics stay (they do not), and the
    exported model holds the checkpoint's running statistics."""
    from tests.test_cli import run_cli

    module = _module()
    model = tmp_path / "bn.onnx"
    onnx.save(_export(module), model)
    batches = _batches(4)
    data = tmp_path / "data.npz"
    np.savez(data, **{key: np.concatenate([b[key] for b in batches]) for key in ("x", "labels")})
    ckpt = tmp_path / "run"
    code, _, err = run_cli(
        capsys, monkeypatch, "train", model, "--data", data, "--lr", "0.1", "--optimizer", "sgd", "--steps", "3",
        "--batch-size", "6", "--eval-data", data, "--checkpoint-dir", ckpt, "--progress",
    )  # fmt: skip
    assert code == 0, err
    assert "updating the running statistics of 1 BatchNormalization node(s)" in err
    assert "not update" not in err  # no note that they stay as exported
    out = tmp_path / "trained.onnx"
    code, _, err = run_cli(capsys, monkeypatch, "export", model, "--checkpoint", ckpt, "-o", out, "--keep-loss")
    assert code == 0, err
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    with np.load(ckpt / "checkpoint.npz") as checkpoint:
        for name in ("bn.running_mean", "bn.running_var"):
            np.testing.assert_array_equal(exported[name], checkpoint[f"param/{name}"])
            assert not np.allclose(exported[name], getattr(module.bn, name.split(".")[1]).numpy())


def test_resuming_a_checkpoint_written_before_running_statistics_were_state(tmp_path, capsys, monkeypatch):
    """`gradgen train --resume` on a checkpoint without them: a note, then they start from the model."""
    import json

    from tests.test_cli import run_cli

    model = tmp_path / "bn.onnx"
    onnx.save(_export(_module()), model)
    batches = _batches(4)
    data = tmp_path / "data.npz"
    np.savez(data, **{key: np.concatenate([b[key] for b in batches]) for key in ("x", "labels")})
    ckpt = tmp_path / "run"
    args = ["train", model, "--data", data, "--lr", "0.1", "--optimizer", "sgd", "--batch-size", "6", "--checkpoint-dir", ckpt]
    code, _, err = run_cli(capsys, monkeypatch, *args, "--steps", "2")
    assert code == 0, err
    with np.load(ckpt / "checkpoint.npz") as checkpoint:
        arrays = {key: checkpoint[key] for key in checkpoint.files if "running" not in key}
    meta = json.loads(str(arrays["meta"]))
    meta["params"] = [name for name in meta["params"] if "running" not in name]
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(ckpt / "checkpoint.npz", **arrays)
    code, _, err = run_cli(capsys, monkeypatch, *args, "--steps", "3", "--resume")
    assert code == 0, err
    assert "no value for 2 BatchNormalization running statistic(s)" in err
    with np.load(ckpt / "checkpoint.npz") as checkpoint:
        assert int(json.loads(str(checkpoint["meta"]))["step"]) == 3
        assert "param/bn.running_mean" in checkpoint.files
