"""Malformed graphs as a user meets them on the command line: a value with two sources, an
initializer declared twice, a cycle, a missing initializer. Each is one line on stderr (exit 3)
naming the file and the value or nodes at fault, for every command that reads the model; and an
output path equal to a file the command reads is refused naming that file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.test_cli import run_cli, tiny_model


def save_loss_model(path: Path, nodes, initializers=(), inputs=None, opset: int = 17) -> Path:
    """``nodes`` computing a float32 ``loss`` from ``inputs`` (default x, float32 (2, 3)), saved."""
    graph = helper.make_graph(
        nodes,
        "g",
        inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=list(initializers),
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


def _w(value: float = 1.0) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full((3, 3), value, np.float32), "w")


def _twice_computed(tmp: Path) -> Path:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
        helper.make_node("Relu", ["x"], ["y"], name="relu"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    return save_loss_model(tmp / "m.onnx", nodes, [_w()])


def _input_recomputed(tmp: Path) -> Path:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["x"]),
        helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0),
    ]
    return save_loss_model(tmp / "m.onnx", nodes, [_w()])


def _initializer_twice(tmp: Path) -> Path:
    # ONNX Runtime silently takes the last one (here 2), the checker refuses the model
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    return save_loss_model(tmp / "m.onnx", nodes, [_w(1.0), _w(2.0)])


def _cycle(tmp: Path) -> Path:
    nodes = [
        helper.make_node("Add", ["x", "z"], ["y"], name="add"),
        helper.make_node("Relu", ["y"], ["z"], name="relu"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    return save_loss_model(tmp / "m.onnx", nodes)


def _unnamed_cycle(tmp: Path) -> Path:
    nodes = [
        helper.make_node("Add", ["x", "z"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    return save_loss_model(tmp / "m.onnx", nodes)


def _missing_initializer(tmp: Path) -> Path:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    return save_loss_model(tmp / "m.onnx", nodes)


def _commands(model: Path, tmp: Path) -> list[list]:
    return [
        ["build-backward", model, "-o", tmp / "out.onnx"],
        ["run", model, "--random-inputs", "-o", tmp / "out.npz"],
        ["check", model, "--random-inputs"],
    ]


@pytest.mark.parametrize(
    "make, texts",
    [
        (_twice_computed, ("m.onnx", "'y'", "node 'relu' (Relu)", "node 'mm' (MatMul)")),
        (_input_recomputed, ("m.onnx", "'x'", "MatMul", "graph input")),
        (_initializer_twice, ("m.onnx", "initializer 'w'", "more than once")),
        (_cycle, ("m.onnx", "cycle", "'add' (Add)", "'relu' (Relu)")),
        (_unnamed_cycle, ("m.onnx", "cycle", "'Add_0' (Add)", "'Relu_1' (Relu)")),
        (_missing_initializer, ("m.onnx", "'w'", "no node, graph input or initializer")),
    ],
    ids=["value_computed_twice", "input_recomputed", "initializer_twice", "cycle", "unnamed_cycle", "missing_initializer"],
)
def test_malformed_graphs_are_one_line_model_errors(tmp_path, capsys, monkeypatch, make, texts):
    model = make(tmp_path)
    before = model.read_bytes()
    for args in _commands(model, tmp_path):
        code, out, err = run_cli(capsys, monkeypatch, *args)
        assert code == 3, (args[0], err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), (args[0], err)
        for text in texts:
            assert text in err, (args[0], text, err)
        assert "SerdeError" not in err and "gradgen failed on it" not in err
    assert model.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_an_acyclic_graph_out_of_order_still_builds(tmp_path, capsys, monkeypatch):
    nodes = [
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
        helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
    ]
    model = save_loss_model(tmp_path / "m.onnx", nodes, [_w()])
    code, out, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", tmp_path / "out.onnx")
    assert code == 0, err
    assert "w_grad" in out


def test_an_output_equal_to_a_read_file_names_that_file(tmp_path, capsys, monkeypatch):
    model = tmp_path / "tiny.onnx"
    tiny_model(model)
    inputs = tmp_path / "in.npz"
    np.savez(inputs, x=np.ones((2, 3), np.float32))
    before = inputs.read_bytes()
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", inputs, "-o", inputs)
    assert code == 2
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert f"the input file {inputs}" in err and "input model" not in err
    assert inputs.read_bytes() == before
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", inputs, "-o", model)
    assert code == 2 and "the input model" in err


def test_a_missing_inputs_file_is_said_before_the_model_is_read(tmp_path, capsys, monkeypatch):
    model = tmp_path / "cut.onnx"
    model.write_bytes(b"\x08")  # not a model: reading it first would report it instead
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", tmp_path / "nope.npz")
    assert code == 2
    assert err.strip() == f"error: {tmp_path / 'nope.npz'}: no such file"


def test_a_missing_initializer_is_one_line_from_a_shell(tmp_path):
    """onnx-ir logs a warning for the input that nothing provides; in a real process (no pytest log
    capture) that would be a second line before the error."""
    model = _missing_initializer(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "gradgen", "build-backward", str(model), "-o", str(tmp_path / "out.onnx")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {model}: node 'MatMul_0' (MatMul) reads 'w', which no node, graph input or initializer provides"
    ]
