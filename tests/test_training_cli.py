"""gradgen train / gradgen export: a falling loss curve, a CSV log, checkpoints that resume
bit-identically, export for onnxruntime, and bad input as one-line errors that lose nothing."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "samples" / "mlp" / "model.onnx"
CNN = ROOT / "samples" / "cnn" / "model.onnx"


@pytest.fixture
def mlp_data(tmp_path):
    """A learnable regression task for the mlp sample (targets from a fixed sigmoid layer)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3)).astype(np.float32)

    def make(n):
        x = rng.standard_normal((n, 6)).astype(np.float32)
        return {"x": x, "target": (1 / (1 + np.exp(-x @ w))).astype(np.float32)}

    np.savez(tmp_path / "train.npz", **make(64))
    np.savez(tmp_path / "eval.npz", **make(18))
    return tmp_path / "train.npz", tmp_path / "eval.npz"


@pytest.fixture
def cnn_data(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "cnn.npz"
    np.savez(path, x=rng.standard_normal((30, 1, 14, 14)).astype(np.float32), labels=rng.integers(0, 10, 30))
    return path


def log_rows(path: Path) -> list[dict]:
    with open(path, newline="") as stream:
        return list(csv.DictReader(stream))


def checkpoint_arrays(path: Path) -> tuple[dict, dict]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files if k != "meta"}, json.loads(str(data["meta"]))


def test_train_gives_a_falling_loss_a_log_and_a_checkpoint(tmp_path, mlp_data, capsys, monkeypatch):
    train, evaluation = mlp_data
    ckpt = tmp_path / "run"
    before = MLP.read_bytes()
    code, out, err = run_cli(
        capsys,
        monkeypatch,
        "train",
        MLP,
        "--data",
        train,
        "--optimizer",
        "adamw",
        "--lr",
        "0.01",
        "--steps",
        "120",
        "--eval-data",
        evaluation,
        "--eval-every",
        "40",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "50",
        "--schedule",
        "cosine",
        "--warmup-steps",
        "10",
        "--clip-norm",
        "1.0",
        "--progress",
    )
    assert code == 0, err
    assert MLP.read_bytes() == before
    rows = log_rows(ckpt / "log.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 121))
    losses = np.array([float(r["loss"]) for r in rows])
    assert losses[-10:].mean() < 0.5 * losses[:10].mean()
    assert float(rows[0]["lr"]) == pytest.approx(0.001) and float(rows[9]["lr"]) == pytest.approx(0.01)
    assert all(float(r["grad_norm"]) > 0 for r in rows)
    evaluated = [int(r["step"]) for r in rows if r["eval_loss"]]
    assert evaluated == [40, 80, 120]
    assert "trained steps 1 to 120" in out and "evaluation loss at step 120" in out
    assert "step/s" in err and "note: evaluation uses 16 of the 18 samples" in err
    arrays, meta = checkpoint_arrays(ckpt / "checkpoint.npz")
    assert meta["step"] == 120 and meta["data"] == {"seed": 0, "batch_size": 4, "accumulation": 1, "samples": 64}
    assert "param/fc1.weight" in arrays and "state/exp_avg/fc1.weight" in arrays
    if _has_matplotlib():
        assert (ckpt / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no loss curve" in err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("optimizer, schedule", [("sgd", "constant"), ("adamw", "linear")])
def test_resume_is_bit_identical(tmp_path, cnn_data, capsys, monkeypatch, optimizer, schedule):
    """50 steps, then --resume to 100, write the same log and checkpoint as 100 steps at once.

    With a constant rate the first half is a plain --steps 50 run; a decaying schedule depends on
    --steps, so there the first half is a --steps 100 run stopped by Ctrl-C after step 50.
    """
    common = [
        "--data",
        cnn_data,
        "--optimizer",
        optimizer,
        "--lr",
        "0.01",
        "--seed",
        "7",
        "--accumulate",
        "2",
        "--schedule",
        schedule,
        "--clip-norm",
        "2.0",
        "--checkpoint-every",
        "30",
    ]
    if optimizer == "sgd":
        common += ["--momentum", "0.9", "--nesterov", "--weight-decay", "1e-3"]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert run_cli(capsys, monkeypatch, "train", CNN, *common, "--steps", "100", "--checkpoint-dir", whole)[0] == 0
    if schedule == "constant":
        code, _, err = run_cli(capsys, monkeypatch, "train", CNN, *common, "--steps", "50", "--checkpoint-dir", halves)
        assert code == 0, err
    else:
        _interrupted_after_50(capsys, monkeypatch, common, halves)
    code, out, err = run_cli(
        capsys, monkeypatch, "train", CNN, *common, "--steps", "100", "--checkpoint-dir", halves, "--resume", "--progress"
    )
    assert code == 0, err
    assert "resuming from" in err and "trained steps 51 to 100" in out
    assert "schedule differs" not in err
    assert (whole / "log.csv").read_bytes() == (halves / "log.csv").read_bytes()
    a, meta_a = checkpoint_arrays(whole / "checkpoint.npz")
    b, meta_b = checkpoint_arrays(halves / "checkpoint.npz")
    assert meta_a == meta_b and a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)


def _interrupted_after_50(capsys, monkeypatch, common, directory) -> None:
    """A --steps 100 run that a Ctrl-C stops after step 50 (raised where the 51st step would start)."""
    from gradgen.training.trainer import Trainer

    original = Trainer.train_step

    def stop_after_50(self, micro_batches):
        if self.step == 50:
            raise KeyboardInterrupt
        return original(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", stop_after_50)
    try:
        code, _, err = run_cli(capsys, monkeypatch, "train", CNN, *common, "--steps", "100", "--checkpoint-dir", directory)
    finally:
        monkeypatch.setattr(Trainer, "train_step", original)
    assert code == 130 and "interrupted after step 50; checkpoint saved" in err, err


def test_export_runs_in_onnxruntime(tmp_path, cnn_data, capsys, monkeypatch):
    ort = pytest.importorskip("onnxruntime")
    ckpt = tmp_path / "run"
    assert (
        run_cli(capsys, monkeypatch, "train", CNN, "--data", cnn_data, "--lr", "0.01", "--steps", "20", "--checkpoint-dir", ckpt)[
            0
        ]
        == 0
    )
    out = tmp_path / "cnn_trained.onnx"
    code, stdout, err = run_cli(capsys, monkeypatch, "export", CNN, "--checkpoint", ckpt, "-o", out)
    assert code == 0, err
    assert "inputs: x" in stdout and "outputs: logits" in stdout
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["x"] and [o.name for o in session.get_outputs()] == ["logits"]
    x = np.load(cnn_data)["x"][:3]
    logits = session.run(None, {"x": x})[0]
    # The same forward model with the checkpoint's parameters on gradgen's executor.
    from gradgen.executor import Session
    from gradgen.training import export_trained

    arrays, _ = checkpoint_arrays(ckpt / "checkpoint.npz")
    model = export_trained(CNN, ckpt, keep_loss=True)
    assert np.array_equal(model.graph.initializers["fc.weight"].const_value.numpy(), arrays["param/fc.weight"])
    ours = Session(model).run({"x": x, "labels": np.zeros(3, np.int64)})["logits"]
    np.testing.assert_allclose(logits, ours, rtol=1e-5, atol=1e-6)
    original = Session(str(CNN)).run({"x": x, "labels": np.zeros(3, np.int64)})["logits"]
    assert not np.allclose(original, ours)  # trained weights, not the original ones


def test_bad_data_is_a_one_line_error(tmp_path, cnn_data, capsys, monkeypatch):
    arrays = dict(np.load(cnn_data))
    cases = {
        "names": ({"x": arrays["x"], "label": arrays["labels"]}, [], "no array for input(s) 'labels'"),
        "shape": ({"x": arrays["x"][:, :, :12], "labels": arrays["labels"]}, [], "array 'x' has samples of shape"),
        "batch": (arrays, ["--batch-size", "5"], "use --batch-size 3"),
        "counts": ({"x": arrays["x"], "labels": arrays["labels"][:-1]}, [], "different numbers of samples"),
    }
    for name, (bad, extra, words) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **bad)
        code, out, err = run_cli(
            capsys,
            monkeypatch,
            "train",
            CNN,
            "--data",
            path,
            "--lr",
            "0.1",
            "--steps",
            "3",
            "--checkpoint-dir",
            tmp_path / name,
            *extra,
        )
        assert code in (2, 4) and words in err, (name, err)
        assert len(err.strip().splitlines()[-1:]) == 1 and err.strip().splitlines()[-1].startswith("error: ")
        assert not (tmp_path / name / "checkpoint.npz").exists()


def test_checkpoints_are_never_lost(tmp_path, mlp_data, cnn_data, capsys, monkeypatch):
    train, _ = mlp_data
    ckpt = tmp_path / "run"
    assert (
        run_cli(capsys, monkeypatch, "train", MLP, "--data", train, "--lr", "0.01", "--steps", "5", "--checkpoint-dir", ckpt)[0]
        == 0
    )
    before = (ckpt / "checkpoint.npz").read_bytes()
    # Training again into the same directory without --resume would overwrite it: refused.
    code, _, err = run_cli(
        capsys, monkeypatch, "train", MLP, "--data", train, "--lr", "0.01", "--steps", "5", "--checkpoint-dir", ckpt
    )
    assert code == 2 and "pass --resume" in err
    # Another model's checkpoint: refused on --resume and by export.
    code, _, err = run_cli(
        capsys,
        monkeypatch,
        "train",
        CNN,
        "--data",
        cnn_data,
        "--lr",
        "0.01",
        "--steps",
        "9",
        "--checkpoint-dir",
        ckpt,
        "--resume",
    )
    assert code == 2 and "from another model" in err
    code, _, err = run_cli(capsys, monkeypatch, "export", CNN, "--checkpoint", ckpt, "-o", tmp_path / "x.onnx")
    assert code == 2 and "from another model" in err and not (tmp_path / "x.onnx").exists()
    # Another optimizer or data order on --resume: refused.
    code, _, err = run_cli(
        capsys,
        monkeypatch,
        "train",
        MLP,
        "--data",
        train,
        "--lr",
        "0.01",
        "--steps",
        "9",
        "--checkpoint-dir",
        ckpt,
        "--resume",
        "--optimizer",
        "sgd",
    )
    assert code == 2 and "holds adamw state" in err
    code, _, err = run_cli(
        capsys,
        monkeypatch,
        "train",
        MLP,
        "--data",
        train,
        "--lr",
        "0.01",
        "--steps",
        "9",
        "--checkpoint-dir",
        ckpt,
        "--resume",
        "--seed",
        "1",
    )
    assert code == 2 and "--seed 0 -> 1" in err
    assert (ckpt / "checkpoint.npz").read_bytes() == before
    # An unwritable checkpoint directory (under a file): refused before any work, nothing created.
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out, err = run_cli(
        capsys, monkeypatch, "train", MLP, "--data", train, "--lr", "0.01", "--steps", "5", "--checkpoint-dir", blocker / "sub"
    )
    assert code == 2 and "cannot create it" in err and "building" not in err
    code, _, err = run_cli(capsys, monkeypatch, "train", MLP, "--data", train, "--lr", "0.01", "--steps", "5", "--resume")
    assert code == 2 and "--resume needs --checkpoint-dir" in err


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_state(tmp_path, cnn_data, capsys, monkeypatch):
    from itertools import islice

    from gradgen.training import ShuffledBatches

    arrays = dict(np.load(cnn_data))
    arrays["x"][17, 0, 3, 3] = np.nan
    data = tmp_path / "poisoned.npz"
    np.savez(data, **arrays)
    batches = islice(ShuffledBatches(arrays, 3, seed=0), 100)
    bad_step = next(i for i, b in enumerate(batches, start=1) if np.isnan(b["x"]).any())
    ckpt = tmp_path / "run"
    code, out, err = run_cli(
        capsys,
        monkeypatch,
        "train",
        CNN,
        "--data",
        data,
        "--lr",
        "0.01",
        "--steps",
        "100",
        "--optimizer",
        "sgd",
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "1000",
    )
    assert code == 4
    assert f"error: step {bad_step}: the loss is nan" in err and str(ckpt / "checkpoint.npz") in err
    params, meta = checkpoint_arrays(ckpt / "checkpoint.npz")
    assert meta["step"] == bad_step - 1
    assert all(np.isfinite(v).all() for v in params.values())
    assert len(log_rows(ckpt / "log.csv")) == bad_step - 1


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path, mlp_data):
    train, _ = mlp_data
    ckpt = tmp_path / "run"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradgen",
            "train",
            str(MLP),
            "--data",
            str(train),
            "--lr",
            "0.001",
            "--steps",
            "1000000",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "1000000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    log = ckpt / "log.csv"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (log.exists() and len(log.read_text().splitlines()) > 20):
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "interrupted after step" in err and "checkpoint saved" in err
    _, meta = checkpoint_arrays(ckpt / "checkpoint.npz")
    rows = log_rows(log)
    assert meta["step"] == len(rows) > 20
    assert not [p for p in ckpt.iterdir() if p.name.endswith(".tmp")]


def test_added_loss_frozen_scalars_and_export(tmp_path, capsys, monkeypatch):
    """--add-loss on a model ending in predictions; a single-value initializer is named, --freeze keeps it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["h"]), helper.make_node("Mul", ["h", "scale"], ["pred"])],
        "scaled",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("pred", TensorProto.FLOAT, ["N", 2])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
            numpy_helper.from_array(np.zeros(2, np.float32), "b"),
            numpy_helper.from_array(np.array(0.5, np.float32), "scale"),
        ],
    )
    model = tmp_path / "scaled.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(model))
    x = rng.standard_normal((32, 3)).astype(np.float32)
    data = tmp_path / "data.npz"
    np.savez(data, x=x, y=(x @ rng.standard_normal((3, 2))).astype(np.float32))
    common = [
        "--data",
        data,
        "--lr",
        "0.05",
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--add-loss",
        "mse",
        "--loss-output",
        "pred",
        "--target",
        "y",
    ]
    code, out, err = run_cli(capsys, monkeypatch, "train", model, *common, "--checkpoint-dir", tmp_path / "a")
    assert code == 0, err
    assert "note: training single-value initializer(s) 'scale'" in err
    code, out, err = run_cli(
        capsys, monkeypatch, "train", model, *common, "--freeze", "scale", "--checkpoint-dir", tmp_path / "b"
    )
    assert code == 0 and "single-value" not in err, err
    losses = [float(r["loss"]) for r in log_rows(tmp_path / "b" / "log.csv")]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    code, out, err = run_cli(
        capsys, monkeypatch, "export", model, "--checkpoint", tmp_path / "b", "-o", tmp_path / "trained.onnx"
    )
    assert code == 0 and "inputs: x" in out and "outputs: pred" in out, err
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "trained.onnx")).graph.initializer}
    assert trained["scale"] == np.float32(0.5)
    assert not np.allclose(trained["W"], numpy_helper.to_array(graph.initializer[0]))
    # Missing --loss-output, or --loss with --add-loss: usage errors.
    short = ["train", model, "--data", data, "--lr", "0.1", "--steps", "2", "--batch-size", "8", "--add-loss", "mse"]
    code, _, err = run_cli(capsys, monkeypatch, *short)
    assert code == 2 and "--loss-output" in err
    code, _, err = run_cli(capsys, monkeypatch, *short, "--loss-output", "pred", "--loss", "pred")
    assert code == 2 and "use one of them" in err


def test_fp16_loss_scale_and_skipped_steps(tmp_path, cnn_data, capsys, monkeypatch):
    """--precision fp16 --loss-scale: a scale that overflows float16 skips every step, and the run
    says so (summary, log); the state keeps the halved scale. --loss-scale is refused outside fp16
    and for scales that are not positive and finite, as one line."""
    base = ["train", CNN, "--data", cnn_data, "--lr", "0.01", "--batch-size", "3"]
    ckpt = tmp_path / "fp16"
    code, out, err = run_cli(
        capsys,
        monkeypatch,
        *base,
        "--steps",
        "3",
        "--precision",
        "fp16",
        "--loss-scale",
        "1e38",
        "--checkpoint-dir",
        ckpt,
        "--progress",
    )
    assert code == 0, err
    assert "3 of them skipped by loss scaling" in out
    assert "3 skipped (overflow)" in err and "invalid value" not in err  # expected overflows raise no numpy notes
    assert [row["skipped"] for row in log_rows(ckpt / "log.csv")] == ["1", "1", "1"]
    arrays, _ = checkpoint_arrays(ckpt / "checkpoint.npz")
    scales = [value for name, value in arrays.items() if "scale" in name and value.size == 1 and value.dtype.kind == "f"]
    assert scales and np.float32(1e38) * np.float32(0.125) in [np.float32(v) for v in scales]
    for extra, words in [
        (["--precision", "bf16", "--loss-scale", "1024"], "--loss-scale applies to --precision fp16"),
        (["--precision", "fp16", "--loss-scale", "-4"], "--loss-scale -4.0: expected a positive, finite number"),
        (["--precision", "fp16", "--loss-scale", "inf"], "expected a positive, finite number"),
    ]:
        code, out, err = run_cli(capsys, monkeypatch, *base, "--steps", "1", *extra, "--checkpoint-dir", tmp_path / "bad")
        assert code == 2 and words in err, (extra, err)
        assert err.strip().splitlines()[-1].startswith("error: ") and not (tmp_path / "bad" / "checkpoint.npz").exists()
