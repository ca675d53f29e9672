"""Command-line options as a user meets them: --version, shell completion, number and --dim checks,
progress lines and one-time notes, random inputs of impossible sizes."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gradgen.cli as cli
from gradgen.inputs import random_feeds
from gradgen.model_io import load_model
from tests.test_cli import run_cli, tiny_model


def _gradgen(*args, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gradgen", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.onnx"
    tiny_model(path)
    return path


def test_version(capsys, monkeypatch):
    import gradgen

    code, out, _ = run_cli(capsys, monkeypatch, "--version")
    assert code == 0 and out.strip() == f"gradgen {gradgen.__version__}"
    try:  # installed (not just on the path): the package's metadata says the same
        assert importlib.metadata.version("gradgen") == gradgen.__version__
    except importlib.metadata.PackageNotFoundError:
        pass
    result = _gradgen("--version")
    assert result.returncode == 0 and result.stdout.strip() == out.strip()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_shell_completion():
    """typer's completion: the script for the shell it is asked from (found among the process's
    ancestors, so run from a bash that stays the parent, as a user's shell does; a process without
    a shell above it, such as one started by a daemon, gets no script), and the completions that
    script asks the program for."""
    script = subprocess.run(
        ["bash", "-c", '"$@"; exit $?', "bash", sys.executable, "-m", "gradgen", "--show-completion"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert script.returncode == 0 and "_GRADGEN_COMPLETE=complete_bash" in script.stdout
    commands = _gradgen(env={"_GRADGEN_COMPLETE": "complete_bash", "COMP_WORDS": "gradgen ru", "COMP_CWORD": "1"})
    assert commands.returncode == 0 and commands.stdout.split() == ["run"]
    options = _gradgen(env={"_GRADGEN_COMPLETE": "complete_bash", "COMP_WORDS": "gradgen run --ra", "COMP_CWORD": "2"})
    assert options.stdout.split() == ["--random-inputs"]
    zsh = _gradgen(env={"_GRADGEN_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "gradgen build"})
    assert "build-backward" in zsh.stdout


BAD_NUMBERS = [
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--rtol", "-1"], "--rtol"),
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--rtol", "nan"], "--rtol"),
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--atol", "nan"], "--atol"),
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--atol", "inf"], "--atol"),
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--floor", "-0.5"], "--floor"),
    (["run", "MODEL", "--random-inputs", "--dim", "N=2", "--seed", "-1"], "--seed"),
    (["check", "MODEL", "--random-inputs", "--dim", "N=2", "--samples", "0"], "--samples"),
    (["check", "MODEL", "--random-inputs", "--dim", "N=2", "--seed", "-1"], "--seed"),
    (["check", "MODEL", "--random-inputs", "--dim", "N=2", "--rtol", "nan"], "--rtol"),
    (["check", "MODEL", "--random-inputs", "--dim", "N=2", "--atol", "-1e-9"], "--atol"),
]


@pytest.mark.parametrize("args,option", BAD_NUMBERS, ids=[" ".join(a[2:]) + f" ({a[0]})" for a, _ in BAD_NUMBERS])
def test_nonsensical_numbers_are_usage_errors(tiny, capsys, monkeypatch, args, option):
    code, out, err = run_cli(capsys, monkeypatch, *[tiny if a == "MODEL" else a for a in args])
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: ") and option in line and "Traceback" not in err
    assert "ran on" not in out  # refused before running


def test_nonsensical_number_in_a_fresh_process(tiny):
    result = _gradgen("run", tiny, "--random-inputs", "--dim", "N=2", "--rtol", "nan")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        line for line in result.stderr.strip().splitlines() if line.startswith("error: ")
    ]
    assert "--rtol" in result.stderr and "nan" in result.stderr


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_dim_naming_no_symbol_names_the_models_symbols(tiny, capsys, monkeypatch, command):
    code, _, err = run_cli(capsys, monkeypatch, command, tiny, "--random-inputs", "--dim", "nosuch=3")
    assert code == 2
    [line] = [x for x in err.splitlines() if x.startswith("error: ")]
    assert "nosuch" in line and "its symbolic dimensions are N" in line
    assert err.strip().splitlines()[-1] == line


def test_a_dim_without_random_inputs_is_refused(tiny, tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3), np.float32))
    code, _, err = run_cli(capsys, monkeypatch, "run", tiny, "--inputs", tmp_path / "in.npz", "--dim", "N=2")
    assert code == 2 and "--dim" in err and "--random-inputs" in err


def test_an_impossible_size_is_a_usage_error(tiny, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "run", tiny, "--random-inputs", "--dim", "N=1000000000000", "--device", "cpu")
    assert code == 2, err
    [line] = err.strip().splitlines()
    assert line.startswith("error: the random inputs would take") and "'x'" in line and "--dim" in line


def test_random_float32_inputs_are_drawn_in_float32(tmp_path):
    """No float64 copy on the way: the peak allocation stays near the input's own size."""
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 4096])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    model = load_model(tmp_path / "m.onnx")
    tracemalloc.start()
    try:
        feeds = random_feeds(model, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (4096, 4096)
    assert peak < 1.25 * feeds["x"].nbytes, peak
    assert 0.9 < feeds["x"].std() < 1.1


# -- progress and notes --------------------------------------------------------------------------


def test_no_progress_lines_when_stderr_is_not_a_terminal(tiny, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(capsys, monkeypatch, "build-backward", tiny, "-o", tmp_path / "g.onnx")
    assert code == 0 and err == ""
    assert "wrote" in out


def test_progress_when_asked(tiny, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", tiny, "-o", tmp_path / "g.onnx", "--progress")
    assert code == 0
    assert err.splitlines() == [f"building the backward graph of {tiny}", f"writing {tmp_path / 'g.onnx'}"]


def test_the_error_is_the_last_line_even_with_progress(tiny, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(
        capsys, monkeypatch, "build-backward", tiny, "-o", tmp_path / "g.onnx", "--progress", "--wrt", "nothing"
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "'nothing'" in lines[-1]
    assert sum(line.startswith("error: ") for line in lines) == 1


def test_progress_on_a_terminal(tiny, tmp_path):
    """A real terminal on stderr: progress lines by default, none with --no-progress."""
    pty = pytest.importorskip("pty")
    for flag, expected in ((None, True), ("--no-progress", False)):
        leader, follower = pty.openpty()
        try:
            args = [sys.executable, "-m", "gradgen", "build-backward", str(tiny), "-o", str(tmp_path / "g.onnx")]
            result = subprocess.run(args + ([flag] if flag else []), stdout=subprocess.PIPE, stderr=follower, timeout=120)
            os.close(follower)
            seen = b""
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                seen += chunk
        finally:
            os.close(leader)
        assert result.returncode == 0
        assert (b"building the backward graph of" in seen) is expected, seen


def test_a_one_time_note_is_said_once_per_process(tiny, capsys, monkeypatch):
    from gradgen.executor import cuda_probe

    monkeypatch.setattr(cli, "_notes_said", set())
    monkeypatch.setattr(cuda_probe, "cuda_unavailable_reason", lambda: "no GPU in this test")
    notes = []
    for _ in range(2):
        code, _, err = run_cli(capsys, monkeypatch, "run", tiny, "--random-inputs", "--dim", "N=2")
        assert code == 0, err
        notes.append([line for line in err.splitlines() if line.startswith("note: ")])
    assert notes == [["note: no usable GPU (no GPU in this test); running on the CPU"], []]


# -- given and random inputs together ------------------------------------------------------------


def _two_input_model(path) -> None:
    """loss = sum((x @ w - t)^2) with x [N, 3] and t [N, 4]; d = x @ w - t is an output too."""
    w = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Sub", ["h", "t"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["sq"]),
            helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
        ],
        "two",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("t", TensorProto.FLOAT, ["N", 4]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("d", TensorProto.FLOAT, ["N", 4]),
        ],
        initializer=[onnx.numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_random_inputs_fill_in_what_inputs_do_not_give_and_say_so(tmp_path, capsys, monkeypatch):
    _two_input_model(tmp_path / "m.onnx")
    x = np.arange(15, dtype=np.float32).reshape(5, 3)
    np.savez(tmp_path / "x.npz", x=x)
    code, _, err = run_cli(
        capsys,
        monkeypatch,
        "run",
        tmp_path / "m.onnx",
        "--inputs",
        tmp_path / "x.npz",
        "--random-inputs",
        "-o",
        tmp_path / "out.npz",
    )
    assert code == 0, err
    assert f"random values were drawn for t, which {tmp_path / 'x.npz'} does not give" in err
    model = load_model(tmp_path / "m.onnx")
    t = random_feeds(model, seed=0, given={"x": x})["t"]
    assert t.shape == (5, 4)  # N from the given x
    w = onnx.numpy_helper.to_array(onnx.load(str(tmp_path / "m.onnx")).graph.initializer[0])
    with np.load(tmp_path / "out.npz") as out:
        np.testing.assert_allclose(out["d"], x @ w - t, rtol=1e-5, atol=1e-5)


def test_random_inputs_that_draw_nothing_say_so(tmp_path, capsys, monkeypatch):
    _two_input_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.ones((2, 3), np.float32), t=np.ones((2, 4), np.float32))
    code, _, err = run_cli(capsys, monkeypatch, "run", tmp_path / "m.onnx", "--inputs", tmp_path / "in.npz", "--random-inputs")
    assert code == 0, err
    assert "gives every input: no random values were drawn" in err


def test_a_dim_that_contradicts_a_given_input_is_refused(tmp_path, capsys, monkeypatch):
    _two_input_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=np.ones((5, 3), np.float32))
    for command in ("run", "check"):
        code, _, err = run_cli(
            capsys, monkeypatch, command, tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz", "--random-inputs", "--dim", "N=2"
        )
        assert code == 2, err
        [line] = err.strip().splitlines()
        assert line.startswith("error: --dim N=2, but the given input 'x' has 5 there"), line


def test_check_with_given_and_random_inputs(tmp_path, capsys, monkeypatch):
    _two_input_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=np.random.default_rng(1).standard_normal((3, 3)).astype(np.float32))
    code, out, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz", "--random-inputs")
    assert code == 0, err
    assert "random values were drawn for t" in err and "all 1 gradient(s) match" in out
