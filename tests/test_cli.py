"""The command line: build-backward, run, ops, and their errors (one line, documented exit codes)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.cli import main


def run_cli(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["gradgen", *map(str, args)])
    code = 0
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def tiny_model(path, scalar_loss: bool = True) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("Relu", ["h"], ["r"], name="relu")]
    if scalar_loss:
        nodes.append(helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0, name="sum"))
        out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    else:
        out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 4])
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [out],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.onnx"
    tiny_model(path)
    return path


def test_build_backward_and_run(tmp_path, tiny, capsys, monkeypatch):
    out = tmp_path / "tiny_grad.onnx"
    before = tiny.read_bytes()
    code, stdout, _ = run_cli(capsys, monkeypatch, "build-backward", tiny, "-o", out)
    assert code == 0 and "w_grad" in stdout
    assert tiny.read_bytes() == before
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    x = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    code, stdout, _ = run_cli(capsys, monkeypatch, "run", out, "--inputs", tmp_path / "in.npz", "-o", tmp_path / "o.npz")
    assert code == 0
    assert "w_grad" in stdout and "L2 norm" in stdout
    saved = np.load(tmp_path / "o.npz")
    w = numpy_helper.to_array(onnx.load(str(tiny)).graph.initializer[0])
    want = x.T @ (x @ w > 0).astype(np.float32)
    np.testing.assert_allclose(saved["w_grad"], want, rtol=1e-5)


def test_run_random_inputs_with_dims(tiny, capsys, monkeypatch):
    code, stdout, _ = run_cli(capsys, monkeypatch, "run", tiny, "--random-inputs", "--dim", "N=7", "--device", "cpu")
    assert code == 0 and "loss" in stdout


def test_run_symbolic_dim_without_value_is_a_usage_error(tiny, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "run", tiny, "--random-inputs")
    assert code == 2 and "'N'" in err and "--dim" in err


def test_wrt_and_freeze(tmp_path, tiny, capsys, monkeypatch):
    out = tmp_path / "g.onnx"
    code, stdout, _ = run_cli(capsys, monkeypatch, "build-backward", tiny, "-o", out, "--wrt-inputs", "--freeze", "w")
    assert code == 0
    names = [o.name for o in onnx.load(str(out)).graph.output]
    assert names == ["loss", "x_grad"]


def test_vector_jacobian_product(tmp_path, capsys, monkeypatch):
    model = tmp_path / "m.onnx"
    tiny_model(model, scalar_loss=False)
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", tmp_path / "g.onnx")
    assert code == 3 and "no scalar float output" in err and "--loss" in err
    code, _, _ = run_cli(capsys, monkeypatch, "build-backward", model, "-o", tmp_path / "g.onnx", "--loss", "r")
    assert code == 0
    built = onnx.load(str(tmp_path / "g.onnx"))
    assert "r_grad" in [i.name for i in built.graph.input]


@pytest.mark.parametrize("case", ["missing", "not_onnx", "truncated", "same_output", "missing_dir", "bad_wrt", "bad_loss"])
def test_build_backward_errors(tmp_path, tiny, capsys, monkeypatch, case):
    target = tmp_path / "out.onnx"
    model = tiny
    extra = []
    expected_code, expected_text = 3, ""
    if case == "missing":
        model, expected_code, expected_text = tmp_path / "nope.onnx", 2, "no such file"
    elif case == "not_onnx":
        model = tmp_path / "text.onnx"
        model.write_text("hello, this is not a model")
        expected_text = "not"
    elif case == "truncated":
        model = tmp_path / "cut.onnx"
        model.write_bytes(tiny.read_bytes()[:40])
    elif case == "same_output":
        target, expected_code, expected_text = tiny, 2, "must not be the input"
    elif case == "missing_dir":
        target, expected_code, expected_text = tmp_path / "no" / "out.onnx", 2, "does not exist"
    elif case == "bad_wrt":
        extra, expected_code, expected_text = ["--wrt", "nothing"], 2, "'nothing'"
    elif case == "bad_loss":
        extra, expected_code, expected_text = ["--loss", "nothing"], 2, "'nothing'"
    before = model.read_bytes() if model.exists() else None
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", target, *extra)
    assert code == expected_code, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0] and "Traceback" not in err
    assert expected_text in err
    if before is not None:
        assert model.read_bytes() == before
    if case != "same_output":
        assert not target.exists()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("case", ["missing_input", "wrong_dtype", "wrong_rank", "missing_npz", "cuda"])
def test_run_errors(tmp_path, tiny, capsys, monkeypatch, case):
    npz = tmp_path / "in.npz"
    args = ["run", tiny, "--inputs", npz]
    expected_code, expected_text = 4, ""
    if case == "missing_input":
        np.savez(npz, y=np.zeros((2, 3), np.float32))
        expected_text = "missing input"
    elif case == "wrong_dtype":
        np.savez(npz, x=np.zeros((2, 3), np.float64))
        expected_text = "float64"
    elif case == "wrong_rank":
        np.savez(npz, x=np.zeros((2, 3, 1), np.float32))
        expected_text = "rank 3"
    elif case == "missing_npz":
        expected_code, expected_text = 2, "no such file"
    elif case == "cuda":
        from gradgen.executor.cuda_probe import cuda_unavailable_reason

        if cuda_unavailable_reason() is None:
            pytest.skip("a GPU answers here")
        np.savez(npz, x=np.zeros((2, 3), np.float32))
        args += ["--device", "cuda"]
        expected_code, expected_text = 2, "no usable GPU"
    code, _, err = run_cli(capsys, monkeypatch, *args)
    assert code == expected_code, err
    assert expected_text in err and "Traceback" not in err


def test_ops_json(capsys, monkeypatch):
    code, stdout, _ = run_cli(capsys, monkeypatch, "ops", "--json")
    assert code == 0
    rows = json.loads(stdout)
    assert all(
        set(r) == {"domain", "op_type", "gradient", "rewritten_to", "cpu", "cuda", "cuda_form", "session_form"} for r in rows
    )
    by_name = {(r["domain"], r["op_type"]): r for r in rows}
    assert by_name[("com.microsoft", "GatherGrad")]["cpu"] is True
    assert by_name[("ai.onnx", "Add")]["gradient"] == "yes"
    assert by_name[("ai.onnx", "Shape")]["gradient"] == "non-differentiable"
    assert by_name[("ai.onnx", "Constant")]["gradient"] == "non-differentiable"
    assert by_name[("ai.onnx", "Upsample")]["gradient"] == "rewritten"
    assert by_name[("ai.onnx", "Upsample")]["rewritten_to"].startswith("Resize")
    assert all(r["gradient"] in ("yes", "no", "non-differentiable", "rewritten") for r in rows)
    assert all((r["rewritten_to"] is not None) == (r["gradient"] == "rewritten") for r in rows)
    assert by_name[("ai.onnx", "LSTM")]["cuda_form"].startswith("UnrollRecurrentPass")
    assert not by_name[("ai.onnx", "LSTM")]["cuda"] and by_name[("ai.onnx", "Add")]["cuda_form"] is None
    assert by_name[("ai.onnx", "SequenceAt")]["session_form"].startswith("the tensors it holds")
    assert by_name[("ai.onnx", "Add")]["session_form"] is None


def test_ops_table_explains_rewritten_and_form(capsys, monkeypatch):
    code, stdout, _ = run_cli(capsys, monkeypatch, "ops")
    assert code == 0
    upsample = next(line for line in stdout.splitlines() if " Upsample " in line)
    assert upsample.split()[2] == "rewritten"
    assert stdout.rstrip().splitlines()[-2].startswith("rewritten: build-backward turns the op into others")
    lstm = next(line for line in stdout.splitlines() if " LSTM " in line)
    assert lstm.split()[-1] == "form"
    assert stdout.rstrip().splitlines()[-1].startswith("form: a session runs the op as other ops")
    sequence_at = next(line for line in stdout.splitlines() if " SequenceAt " in line)
    assert sequence_at.split()[-2:] == ["form", "form"]


def test_python_dash_m_is_the_same_program(tiny):
    result = subprocess.run([sys.executable, "-m", "gradgen", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "build-backward" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "gradgen", "run", str(tiny), "--random-inputs"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_random_inputs_are_valid_for_every_sample(tmp_path, capsys, monkeypatch):
    """Integer inputs feeding Gather-like ops and loss labels are drawn within their valid ranges."""
    from tests.model_dirs import SAMPLE_DIRS

    for path in SAMPLE_DIRS:
        built = tmp_path / f"{path.name}_grad.onnx"
        code, _, err = run_cli(capsys, monkeypatch, "build-backward", path / "model.onnx", "-o", built)
        assert code == 0, err
        for model in (path / "model.onnx", built):
            code, stdout, err = run_cli(capsys, monkeypatch, "run", model, "--random-inputs", "--seed", "3", "--device", "cpu")
            assert code == 0, f"{model}: {err}"


USAGE_ERRORS = [
    (["run", "--bogus"], "No such option: --bogus"),
    (["build-backward", "MODEL"], "Missing option"),
    (["nosuchcmd"], "No such command"),
    (["run"], "Missing argument"),
    (["run", "MODEL", "--seed", "abc"], "--seed"),
    (["ops", "extra"], "unexpected extra argument"),
    (["--debug", "run", "--bogus"], "No such option: --bogus"),
]


@pytest.mark.parametrize("args,expected", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_in_a_fresh_process(tiny, args, expected):
    """As a user meets them: a real process, whatever click typer brings (typer >= 0.29 vendors its own)."""
    argv = [str(tiny) if a == "MODEL" else a for a in args]
    result = subprocess.run([sys.executable, "-m", "gradgen", *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_bare_gradgen_prints_the_help(capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch)
    assert code == 0
    assert "build-backward" in out and "Traceback" not in err


def test_ctrl_c_exits_130_and_says_so(tiny, capsys, monkeypatch):
    import gradgen.api

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gradgen.api, "build_backward", interrupted)
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", tiny, "-o", tiny.parent / "out.onnx")
    assert code == 130
    assert err.strip().splitlines()[-1] == "error: interrupted"
    assert not (tiny.parent / "out.onnx").exists()


def test_run_threads_limits_the_blas_during_the_run(tiny, capsys, monkeypatch):
    """--threads N: numpy's BLAS pool has N threads while the model runs, and its own count after."""
    from threadpoolctl import threadpool_info

    from gradgen.executor import Session

    def blas_threads():
        return sorted({info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"})

    outside = blas_threads()
    seen = []
    real_run = Session.run

    def recording_run(self, feeds):
        seen.append(blas_threads())
        return real_run(self, feeds)

    monkeypatch.setattr(Session, "run", recording_run)
    code, out, err = run_cli(
        capsys, monkeypatch, "run", tiny, "--random-inputs", "--dim", "N=2", "--device", "cpu", "--threads", "1"
    )
    assert code == 0, err
    assert seen == [[1]] or (seen == [[]] and outside == []), seen  # [] only where numpy has no BLAS pool
    assert blas_threads() == outside


@pytest.mark.parametrize("threads", ["0", "100000"])
def test_run_threads_out_of_range_is_a_usage_error(tiny, capsys, monkeypatch, threads):
    code, out, err = run_cli(
        capsys, monkeypatch, "run", tiny, "--random-inputs", "--dim", "N=2", "--device", "cpu", "--threads", threads
    )
    assert code == 2 and "--threads" in err and "Traceback" not in err, (code, err)
