"""ONNX Runtime training trains on gradgen's artifacts as gradgen's Trainer does (slow, opt-in).

ONNX Runtime training's last release (1.19.2) runs on Python <= 3.11 only, so it lives in its own
environment: point GRADGEN_ORT_TRAINING_PYTHON at that environment's python, e.g.

    python3.11 -m venv ../ort311 && ../ort311/bin/pip install onnxruntime-training==1.19.2 "numpy<2" onnx torch
    GRADGEN_ORT_TRAINING_PYTHON=../ort311/bin/python python -m pytest -m slow tests/test_artifacts_ort.py

(its ``onnxruntime.training`` package imports torch). For each case, gradgen writes the artifacts;
a script in that environment loads them with ORT's CheckpointState / Module / Optimizer, takes 20
steps on the same batches with the same learning rate, evaluates, and saves its checkpoint. Its
losses must match those of gradgen's Trainer on the same model, loss and optimizer step by step
(relative difference at most 1e-4; measured below 1e-6), and so must the final parameters, the
evaluation loss and, read back from ORT's checkpoint with gradgen's reader, AdamW's moments.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest

from gradgen.training import Trainer, build_training
from gradgen.training.artifacts import generate_artifacts, save_artifacts
from gradgen.training.losses import LossSpec
from gradgen.training.optimizers import SGD, AdamW
from gradgen.training.ort_checkpoint import read_checkpoint
from tests.test_artifacts import logits_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20

# Runs in the ONNX Runtime training environment: argv = artifact dir, data .npz, result prefix.
RUNNER = r"""
import json, sys
import numpy as np
from onnxruntime.training import api

directory, data_path, out = sys.argv[1:4]
data = np.load(data_path)
meta = json.loads(str(data["meta"]))
state = api.CheckpointState.load_checkpoint(f"{directory}/checkpoint")
module = api.Module(f"{directory}/training_model.onnx", state, f"{directory}/eval_model.onnx", device="cpu")
optimizer = api.Optimizer(f"{directory}/optimizer_model.onnx", module)
optimizer.set_learning_rate(meta["lr"])
names = module.input_names()
losses = []
module.train()
for step in range(meta["steps"]):
    loss = module(*[data[f"{step}/{name}"] for name in names])
    optimizer.step()
    module.lazy_reset_grad()
    losses.append(float(np.asarray(loss)))
module.eval()
eval_loss = float(np.asarray(module(*[data[f"0/{name}"] for name in names])))
api.CheckpointState.save_checkpoint(state, f"{out}.checkpoint", include_optimizer_state=True)
np.savez(f"{out}.npz", **{name: np.array(p.data) for name, p in state.parameters})
with open(f"{out}.json", "w") as stream:
    json.dump({"losses": losses, "eval_loss": eval_loss, "inputs": names, "outputs": module.output_names()}, stream)
"""


@pytest.fixture(scope="module")
def ort_python() -> str:
    python = os.environ.get("GRADGEN_ORT_TRAINING_PYTHON")
    if not python:
        pytest.skip("set GRADGEN_ORT_TRAINING_PYTHON to a python with onnxruntime-training 1.19.2")
    probe = subprocess.run([python, "-c", "import onnxruntime.training.api"], capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{python} cannot import onnxruntime.training ({last})")
    return python


def _mlp(tmp_path: Path) -> Path:
    return logits_model(tmp_path / "mlp.onnx")


def _cnn_batch_norm_training(tmp_path: Path) -> Path:
    """A small CNN with BatchNorm2d exported in training mode (batch statistics): gradgen's training
    model holds ONNX Runtime training's BatchNormInternal and BatchNormalizationGrad."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 5),
    ).train()
    path = tmp_path / "cnn_bn.onnx"
    torch.onnx.export(
        net,
        (torch.randn(6, 3, 8, 8),),
        str(path),
        dynamo=False,
        opset_version=17,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        input_names=["x"],
        output_names=["logits"],
    )
    return path


CASES = {
    "mlp_mse_adamw": dict(model=_mlp, loss=LossSpec("mse", "y"), optimizer=AdamW(), frozen=["scale"], lr=1e-2),
    "mlp_l1_adamw_clipped_frozen": dict(
        model=_mlp,
        loss=LossSpec("l1", "y"),
        optimizer=AdamW(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        requires_grad=["w1", "b1", "w2"],
        frozen=["b2", "scale"],
        clip_norm=0.05,
        lr=2e-2,
    ),
    "mlp_bce_with_logits_sgd": dict(model=_mlp, loss=LossSpec("bce_with_logits", "y"), optimizer=SGD(), frozen=["scale"], lr=0.1),
    "cnn_cross_entropy_sgd": dict(
        model=lambda _: ROOT / "samples" / "cnn" / "model.onnx",
        loss=LossSpec("cross_entropy", "logits"),
        optimizer=SGD(),
        lr=0.05,
    ),
    # The evaluation losses differ here: both run BatchNormalization in inference mode, but gradgen's
    # steps update its running statistics and ONNX Runtime training's Module cannot (its state holds
    # parameters and optimizer states only), so the artifacts keep them as exported
    "cnn_batch_norm_training_sgd": dict(
        model=_cnn_batch_norm_training, loss=LossSpec("cross_entropy", "logits"), optimizer=SGD(), lr=0.1, same_eval=False
    ),
    # The attention's key bias (in in_proj_bias) has a zero gradient (softmax ignores a constant
    # shift): AdamW would turn its float noise into full-size steps, different in each runtime.
    "transformer_cross_entropy_smoothed_adamw": dict(
        model=lambda _: ROOT / "samples" / "transformer" / "model.onnx",
        loss=LossSpec("cross_entropy", "logits", label_smoothing=0.1),
        optimizer=AdamW(weight_decay=0.01),
        frozen=["layer.self_attn.in_proj_bias"],
        lr=1e-3,
    ),
}


def _batches(program, rng) -> list[dict[str, np.ndarray]]:
    """STEPS batches for the program's data inputs (static shapes): the model's inputs standard
    normal, labels within the class count, BCE targets in [0, 1], other targets standard normal."""
    spec = program.added_loss
    outputs = {v.name: v for v in program.source.graph.outputs}
    model_inputs = {v.name for v in program.source.graph.inputs}
    batches = []
    for _ in range(STEPS):
        batch = {}
        for value in program.data_inputs:
            shape = [int(d) for d in value.shape]
            if value.dtype.numpy() == np.int64:
                classes = int(outputs[spec.output].shape[-1])
                batch[value.name] = rng.integers(0, classes, size=shape).astype(np.int64)
            elif value.name not in model_inputs and spec.kind == "bce_with_logits":
                batch[value.name] = rng.uniform(size=shape).astype(np.float32)
            else:
                batch[value.name] = rng.standard_normal(shape).astype(np.float32)
        batches.append(batch)
    return batches


@pytest.mark.parametrize("case", list(CASES))
def test_ort_training_trains_on_gradgen_artifacts_as_the_trainer_does(case, ort_python, tmp_path):
    spec = CASES[case]
    model = spec["model"](tmp_path)
    frozen, requires_grad = spec.get("frozen", []), spec.get("requires_grad")
    made = generate_artifacts(
        model,
        requires_grad=requires_grad,
        frozen=frozen,
        loss=spec["loss"],
        optimizer=spec["optimizer"],
        clip_norm=spec.get("clip_norm"),
    )
    save_artifacts(made, tmp_path / "artifacts", model)

    # gradgen's Trainer on the same parameters: every other float initializer stays fixed.
    floats = [t.name for t in onnx.load(str(model)).graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    program = build_training(
        model,
        optimizer=spec["optimizer"],
        add_loss=spec["loss"],
        freeze=[name for name in floats if name not in made.requires_grad],
        clip_norm=spec.get("clip_norm"),
    )
    assert program.params == list(made.requires_grad)
    # Same order (the model's inputs, then the target); the artifacts drop the samples' own loss
    # first, so that their target is ``labels`` where the Trainer's is ``labels_1``.
    ort_name = dict(zip(program.data_names, made.user_inputs, strict=True))
    batches = _batches(program, np.random.default_rng(0))
    trainer = Trainer(program, lr=spec["lr"])
    ours = [result.loss for result in trainer.fit(batches, steps=STEPS)]
    our_eval = trainer.evaluate(batches[:1])

    data = {f"{step}/{ort_name[name]}": value for step, batch in enumerate(batches) for name, value in batch.items()}
    data["meta"] = np.array(json.dumps({"lr": spec["lr"], "steps": STEPS}))
    np.savez(tmp_path / "data.npz", **data)
    (tmp_path / "runner.py").write_text(RUNNER)
    run = subprocess.run(
        [ort_python, str(tmp_path / "runner.py"), str(tmp_path / "artifacts"), str(tmp_path / "data.npz"), str(tmp_path / "ort")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "ort.json").read_text())
    assert result["inputs"] == made.user_inputs and result["outputs"] == [made.loss]

    np.testing.assert_allclose(result["losses"], ours, rtol=1e-4)
    if spec.get("same_eval", True):
        np.testing.assert_allclose(result["eval_loss"], our_eval, rtol=1e-4)
    with np.load(tmp_path / "ort.npz") as ort_params:
        for name in program.params:  # not the running statistics, which ONNX Runtime's steps leave alone
            value = trainer.params[name]
            np.testing.assert_allclose(ort_params[name], value, rtol=1e-4, atol=1e-4 * float(np.abs(value).max()))
        # ORT's own checkpoint, read with gradgen's reader: its parameters, step and moments.
        saved = read_checkpoint(tmp_path / "ort.checkpoint")
        assert sorted(saved.requires_grad) == sorted(made.requires_grad) and sorted(saved.frozen) == sorted(made.frozen)
        for name, value in {**saved.requires_grad, **saved.frozen}.items():
            np.testing.assert_array_equal(value, ort_params[name])
    (group,) = saved.optimizer_groups
    assert group.step == STEPS and sorted(group.states) == sorted(made.requires_grad)
    if isinstance(spec["optimizer"], AdamW):
        for name in made.requires_grad:
            for ort_state, ours_state in (("momentum0", "exp_avg"), ("momentum1", "exp_avg_sq")):
                value = trainer.state.states[(name, ours_state)]
                np.testing.assert_allclose(
                    group.states[name][ort_state], value, rtol=1e-4, atol=1e-4 * float(np.abs(value).max())
                )
