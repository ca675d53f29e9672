"""Bad input found by review, each as a user types it: one line on stderr, the documented exit code,
nothing lost; options that would be ignored refused; nodes named as build-backward names them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_cli import run_cli
from tests.test_cli_malformed import save_loss_model

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "samples" / "mlp" / "model.onnx"
CNN = ROOT / "samples" / "cnn" / "model.onnx"


def one_error_line(err: str) -> str:
    """The one ``error: `` line, last on stderr, with no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0] and "Traceback" not in err, err
    return errors[0]


@pytest.fixture
def mlp_data(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "train.npz"
    np.savez(path, x=rng.standard_normal((8, 6)).astype(np.float32), target=rng.random((8, 3)).astype(np.float32))
    return path


@pytest.fixture
def cnn_data(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "cnn.npz"
    np.savez(path, x=rng.standard_normal((6, 1, 14, 14)).astype(np.float32), labels=rng.integers(0, 10, 6))
    return path


def _gather_model(tmp: Path) -> Path:
    """loss = sum(E[ids]): E the only parameter; its nodes unnamed."""
    table = numpy_helper.from_array(np.arange(15, dtype=np.float32).reshape(5, 3), "E")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"]), helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    return save_loss_model(tmp / "gather.onnx", nodes, [table], [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])])


# 1. a truncated checkpoint


def test_a_truncated_checkpoint_is_one_line_in_train_and_export(tmp_path, mlp_data, capsys, monkeypatch):
    ckpt = tmp_path / "ck"
    common = ["--data", mlp_data, "--lr", "0.01", "--checkpoint-dir", ckpt]
    assert run_cli(capsys, monkeypatch, "train", MLP, *common, "--steps", "2")[0] == 0
    path = ckpt / "checkpoint.npz"
    path.write_bytes(path.read_bytes()[:500])
    code, _, err = run_cli(capsys, monkeypatch, "train", MLP, *common, "--steps", "4", "--resume")
    assert code == 2 and "not a complete gradgen checkpoint" in one_error_line(err) and "building" not in err
    assert len(path.read_bytes()) == 500  # kept as it was
    code, _, err = run_cli(capsys, monkeypatch, "export", MLP, "--checkpoint", ckpt, "-o", tmp_path / "out.onnx")
    assert code == 2 and "not a complete gradgen checkpoint" in one_error_line(err)
    assert not (tmp_path / "out.onnx").exists()


# 2. and 3. gradgen bench: --json and numeric options, refused before any work


@pytest.fixture
def no_bench_work(monkeypatch):
    from gradgen.bench import cpu

    def fail(options):
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(cpu, "run", fail)


def test_bench_json_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch, no_bench_work):
    directory = tmp_path / "existing_dir"
    directory.mkdir()
    code, _, err = run_cli(capsys, monkeypatch, "bench", "--only", "cpu", "--json", directory)
    assert code == 2 and "--json" in one_error_line(err) and "is a directory" in err
    code, _, err = run_cli(capsys, monkeypatch, "bench", "--only", "cpu", "--json", tmp_path / "no" / "r.json")
    assert code == 2 and "does not exist" in one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing_dir"]


def test_bench_json_write_failure_leaves_no_temporary_file(tmp_path):
    from gradgen.bench.measure import write_json_atomic

    target = tmp_path / "results"
    target.mkdir()
    (target / "x").write_text("kept")
    with pytest.raises(OSError):
        write_json_atomic(target, {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"] and (target / "x").read_text() == "kept"


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("--child-timeout", "-5", "> 0"),
        ("--child-timeout", "0", "> 0"),
        ("--child-timeout", "nan", "> 0"),
        ("--warmup", "-1", "at least 0"),
        ("--build-layers", "-1", "at least 0"),
        ("--steps", "0", "at least 1"),
        ("--threads", "0", "at least 1"),
        ("--passes", "0", "at least 1"),
        ("--batch", "-2", "at least 1"),
    ],
)
def test_bench_numbers_that_mean_nothing_are_usage_errors(capsys, monkeypatch, no_bench_work, option, value, words):
    code, _, err = run_cli(capsys, monkeypatch, "bench", "--only", "cpu", f"{option}={value}")
    assert code == 2 and option in one_error_line(err) and words in err


# 4. the option that named the loss's output


def test_loss_output_errors_name_the_option_typed(tmp_path, mlp_data, capsys, monkeypatch):
    want = "error: --loss-output 'nope' is not a graph output"
    code, _, err = run_cli(
        capsys, monkeypatch, "build-backward", MLP, "-o", tmp_path / "g.onnx", "--add-loss", "mse", "--loss-output", "nope"
    )
    assert code == 2 and one_error_line(err).startswith(want)
    code, _, err = run_cli(
        capsys, monkeypatch, "train", MLP, "--data", mlp_data, "--lr", "0.1", "--steps", "1", "--add-loss", "mse",
        "--loss-output", "nope",
    )  # fmt: skip
    assert code == 2 and one_error_line(err).startswith(want)


# 5. and 6. cross-entropy options without that loss; numbers out of range


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--class-axis", "1"], "--class-axis applies to an added cross_entropy loss"),
        (["--label-smoothing", "0.1"], "--label-smoothing applies to an added cross_entropy loss"),
        (["--label-smoothing", "2"], "--label-smoothing applies to an added cross_entropy loss"),
        (["--ignore-index", "3"], "--ignore-index applies to an added cross_entropy loss"),
        (["--add-loss", "mse", "--loss-output", "logits", "--ignore-index", "3"], "cross_entropy loss only"),
        (["--add-loss", "cross_entropy", "--loss-output", "logits", "--label-smoothing", "2"], "not in [0, 1)"),
        (["--add-loss", "cross_entropy", "--loss-output", "logits", "--label-smoothing", "1"], "not in [0, 1)"),
        (["--weight-decay", "nan"], "must be a finite number >= 0"),
        (["--weight-decay", "inf"], "must be a finite number >= 0"),
        (["--eps", "inf"], "must be a finite number >= 0"),
        (["--clip-norm", "nan"], "must be a finite number > 0"),
    ],
)
def test_train_refuses_ignored_or_meaningless_loss_and_optimizer_options(tmp_path, cnn_data, capsys, monkeypatch, extra, words):
    code, _, err = run_cli(
        capsys, monkeypatch, "train", CNN, "--data", cnn_data, "--lr", "0.1", "--steps", "1", "--batch-size", "3",
        "--checkpoint-dir", tmp_path / "ck", *extra,
    )  # fmt: skip
    assert code == 2 and words in one_error_line(err)
    assert not (tmp_path / "ck" / "checkpoint.npz").exists()


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--label-smoothing", "5"], "--label-smoothing applies to an added cross_entropy loss"),
        (["--ignore-index", "3"], "--ignore-index applies to an added cross_entropy loss"),
        (["--loss", "mse", "--output", "logits", "--ignore-index", "3"], "cross_entropy loss only"),
        (["--loss", "cross_entropy", "--output", "logits", "--label-smoothing", "5"], "not in [0, 1)"),
        (["--weight-decay", "nan"], "must be a finite number >= 0"),
        (["--clip-norm", "inf"], "must be a finite number > 0"),
    ],
)
def test_artifacts_refuses_ignored_or_meaningless_options(tmp_path, capsys, monkeypatch, extra, words):
    out = tmp_path / "art"
    code, _, err = run_cli(capsys, monkeypatch, "artifacts", CNN, "-o", out, *extra)
    assert code == 2 and words in one_error_line(err)
    assert not out.exists()


# 7. and 8. --plot without a log; progress only on a terminal or with --progress; data checked first


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_plot_without_a_log_draws_the_runs_own_losses(tmp_path, mlp_data, capsys, monkeypatch):
    plot = tmp_path / "p.png"
    code, out, err = run_cli(
        capsys, monkeypatch, "train", MLP, "--data", mlp_data, "--lr", "0.01", "--steps", "2", "--plot", plot
    )
    if _has_matplotlib():
        assert code == 0, err
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"loss curve: {plot}" in out
    else:  # the plot would not be drawn: said before any work
        assert code == 2 and "--plot needs matplotlib" in one_error_line(err) and "trained" not in out
        assert not plot.exists()


def test_train_progress_follows_the_terminal_convention(tmp_path, mlp_data, capsys, monkeypatch):
    base = ["train", MLP, "--data", mlp_data, "--lr", "0.01", "--steps", "2"]
    code, out, err = run_cli(capsys, monkeypatch, *base)
    assert code == 0 and "trained steps 1 to 2" in out
    assert "building" not in err and "step 2/2" not in err  # stderr is not a terminal here
    code, _, err = run_cli(capsys, monkeypatch, *base, "--progress")
    assert code == 0 and "building the training graphs" in err and "step 2/2" in err
    code, _, err = run_cli(capsys, monkeypatch, *base, "--no-progress")
    assert code == 0 and "building" not in err


def test_train_data_files_are_checked_before_the_graphs_are_built(tmp_path, mlp_data, capsys, monkeypatch):
    base = ["train", MLP, "--lr", "0.01", "--steps", "2", "--progress"]
    code, _, err = run_cli(capsys, monkeypatch, *base, "--data", tmp_path / "nope.npz", "--checkpoint-dir", tmp_path / "ck")
    assert code == 2 and "nope.npz" in one_error_line(err) and "building" not in err
    assert not (tmp_path / "ck").exists()
    bad = tmp_path / "bad.npz"
    bad.write_text("not an npz")
    code, _, err = run_cli(capsys, monkeypatch, *base, "--data", mlp_data, "--eval-data", bad)
    assert code == 2 and "bad.npz" in one_error_line(err) and "building" not in err


# 9. to 11. build-backward and run on small hand-made models


def test_freezing_every_parameter_says_so(tmp_path, capsys, monkeypatch):
    model = _gather_model(tmp_path)
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", tmp_path / "g.onnx", "--freeze", "E")
    line = one_error_line(err)
    assert code == 2 and "frozen" in line and "'E'" in line and "no float initializer feeds the loss" not in line


def test_run_time_errors_name_unnamed_nodes_as_build_backward_does(tmp_path, capsys, monkeypatch):
    model = _gather_model(tmp_path)
    np.savez(tmp_path / "ids.npz", ids=np.array([1, 7]))
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", tmp_path / "ids.npz", "--device", "cpu")
    assert code == 4 and "node 'Gather_0' (Gather): index 7" in one_error_line(err)

    w = numpy_helper.from_array(np.ones(2, np.float32), "w")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["z"]),
        helper.make_node("FooBar", ["z"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    unknown = save_loss_model(
        tmp_path / "unknown_op.onnx", nodes, [w], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])]
    )
    code, _, built = run_cli(capsys, monkeypatch, "build-backward", unknown, "-o", tmp_path / "u.onnx")
    assert code == 3 and "'FooBar_1'" in built
    code, _, ran = run_cli(capsys, monkeypatch, "run", unknown, "--random-inputs", "--device", "cpu")
    assert code == 3 and "'FooBar_1'" in ran and "<unnamed>" not in ran


def test_an_opset_beyond_onnx_is_a_model_error(tmp_path, capsys, monkeypatch):
    nodes = [helper.make_node("Relu", ["x"], ["loss"])]
    model = save_loss_model(
        tmp_path / "opset99.onnx", nodes, inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [])], opset=99
    )
    newest = str(onnx.defs.onnx_opset_version())
    for args in (["build-backward", model, "-o", tmp_path / "g.onnx", "--wrt-inputs"], ["run", model, "--random-inputs"]):
        code, _, err = run_cli(capsys, monkeypatch, *args)
        line = one_error_line(err)
        assert code == 3 and "opset 99" in line and newest in line
    assert not (tmp_path / "g.onnx").exists()


def test_an_empty_output_path_is_said_as_such(tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", MLP, "-o", "")
    assert code == 2 and "empty output path" in one_error_line(err)
