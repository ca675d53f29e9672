"""The bad-input matrix: every case is one line on stderr naming the culprit, a documented exit code,
no traceback (``--debug`` shows one), the input files untouched and no partial output left behind.

Exit codes (README, "Exit codes"): 2 usage, 3 model, 4 run-time.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen.model_io as model_io
from gradgen.api import build_backward
from gradgen.errors import ModelError, UsageError
from gradgen.executor import Session
from tests.test_cli import run_cli, tiny_model
from tests.test_cli_files import matmul_sum_model

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Case:
    """``setup(tmp_path)`` writes the files and returns the command line (after ``gradgen``)."""

    id: str
    setup: Callable[[Path], list]
    code: int
    texts: tuple[str, ...]  # every one must appear in the error line(s)
    multiline: bool = False  # the message lists several culprits, one per line


def _tiny(tmp: Path, name: str = "tiny.onnx") -> Path:
    path = tmp / name
    tiny_model(path)
    return path


def _npz(tmp: Path, **arrays) -> Path:
    path = tmp / "in.npz"
    np.savez(path, **arrays)
    return path


def _run(tmp: Path, **arrays) -> list:
    return ["run", _tiny(tmp), "--inputs", _npz(tmp, **arrays), "-o", tmp / "out.npz"]


def _write(tmp: Path, name: str, data: bytes) -> Path:
    path = tmp / name
    path.write_bytes(data)
    return path


def _unknown_ops(tmp: Path) -> list:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("Foo", ["h"], ["a"], name="foo1", domain="custom"),
        helper.make_node("Foo", ["a"], ["b"], name="foo2", domain="custom"),
        helper.make_node("Bar", ["b"], ["c"], name="bar", domain="custom"),
        helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.ones((3, 4), np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("custom", 1)])
    onnx.save(model, str(tmp / "m.onnx"))
    return ["build-backward", tmp / "m.onnx", "-o", tmp / "out.onnx"]


def _no_scalar(tmp: Path) -> list:
    tiny_model(tmp / "m.onnx", scalar_loss=False)
    return ["build-backward", tmp / "m.onnx", "-o", tmp / "out.onnx"]


def _gather_model(tmp: Path) -> Path:
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup", axis=0),
        helper.make_node("ReduceSum", ["rows"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.ones((5, 2), np.float32), "table")],
    )
    path = tmp / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _index_out_of_range(tmp: Path) -> list:
    return ["run", _gather_model(tmp), "--inputs", _npz(tmp, ids=np.array([0, 7, 1], np.int64)), "-o", tmp / "out.npz"]


def _symlinked_output(tmp: Path) -> list:
    model = _tiny(tmp)
    link = tmp / "link.onnx"
    link.symlink_to(model)
    return ["build-backward", model, "-o", link]


def _hardlinked_output(tmp: Path) -> list:
    model = _tiny(tmp)
    os.link(model, tmp / "hard.onnx")
    return ["build-backward", model, "-o", tmp / "hard.onnx"]


def _respelled_output(tmp: Path) -> list:
    model = _tiny(tmp)
    (tmp / "d").mkdir()
    return ["build-backward", model, "-o", tmp / "d" / ".." / "." / "tiny.onnx"]


def _relative_output(tmp: Path) -> list:
    model = _tiny(tmp)
    os.chdir(tmp)
    return ["build-backward", model, "-o", "./tiny.onnx"]


def _missing_external_data(tmp: Path) -> list:
    tiny_model(tmp / "m.onnx")
    model = onnx.load(str(tmp / "m.onnx"))
    onnx.save_model(model, str(tmp / "m.onnx"), save_as_external_data=True, size_threshold=0, location="m.bin")
    (tmp / "m.bin").unlink()
    return ["build-backward", tmp / "m.onnx", "-o", tmp / "out.onnx"]


def _short_external_data(tmp: Path) -> list:
    tiny_model(tmp / "m.onnx")
    model = onnx.load(str(tmp / "m.onnx"))
    onnx.save_model(model, str(tmp / "m.onnx"), save_as_external_data=True, size_threshold=0, location="m.bin")
    (tmp / "m.bin").write_bytes((tmp / "m.bin").read_bytes()[:10])
    return ["build-backward", tmp / "m.onnx", "-o", tmp / "out.onnx"]


def _external_data_outside(tmp: Path) -> list:
    (tmp / "m").mkdir()
    tiny_model(tmp / "m" / "m.onnx")
    model = onnx.load(str(tmp / "m" / "m.onnx"))
    onnx.save_model(model, str(tmp / "m" / "m.onnx"), save_as_external_data=True, size_threshold=0, location="m.bin")
    (tmp / "m" / "m.bin").rename(tmp / "w.bin")
    proto = onnx.load(str(tmp / "m" / "m.onnx"), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../w.bin"
    onnx.save(proto, str(tmp / "m" / "m.onnx"))
    return ["build-backward", tmp / "m" / "m.onnx", "-o", tmp / "out.onnx"]


TINY_BYTES = None


def _tiny_bytes() -> bytes:
    global TINY_BYTES
    if TINY_BYTES is None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            TINY_BYTES = _tiny(Path(tmp)).read_bytes()
    return TINY_BYTES


def _truncated(fraction: float) -> Callable[[Path], list]:
    def setup(tmp: Path) -> list:
        data = _tiny_bytes()
        model = _write(tmp, "cut.onnx", data[: int(len(data) * fraction)])
        return ["build-backward", model, "-o", tmp / "out.onnx"]

    return setup


CASES = [
    # reading the model
    Case("missing_model", lambda t: ["build-backward", t / "nope.onnx", "-o", t / "out.onnx"], 2, ("nope.onnx", "no such file")),
    Case("model_is_directory", lambda t: ["build-backward", t, "-o", t / "out.onnx"], 2, ("is a directory",)),
    Case(
        "text_not_onnx",
        lambda t: ["build-backward", _write(t, "text.onnx", b"hello, this is not a model\n"), "-o", t / "out.onnx"],
        3,
        ("text.onnx", "not"),
    ),
    Case(
        "empty_file",
        lambda t: ["build-backward", _write(t, "empty.onnx", b""), "-o", t / "out.onnx"],
        3,
        ("empty.onnx", "not an ONNX model"),
    ),
    Case("npz_as_model", lambda t: ["build-backward", _npz(t, x=np.zeros(3)), "-o", t / "out.onnx"], 3, ("in.npz", "not")),
    Case(
        "random_bytes",
        lambda t: ["build-backward", _write(t, "r.onnx", np.random.default_rng(0).bytes(300)), "-o", t / "out.onnx"],
        3,
        ("r.onnx",),
    ),
    *[
        Case(f"truncated_{int(f * 1000)}", _truncated(f), 3, ("cut.onnx",))
        for f in (0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999)
    ],
    Case("missing_external_data", _missing_external_data, 3, ("m.onnx", "'w'", "m.bin")),
    Case("short_external_data", _short_external_data, 3, ("m.onnx", "'w'", "m.bin")),
    # what to differentiate
    Case("unknown_ops", _unknown_ops, 3, ("custom::Foo", "'foo1'", "'foo2'", "custom::Bar", "'bar'"), multiline=True),
    Case("no_scalar_output", _no_scalar, 3, ("no scalar float output", "--loss")),
    Case(
        "wrt_names_nothing", lambda t: ["build-backward", _tiny(t), "-o", t / "out.onnx", "--wrt", "nothing"], 2, ("'nothing'",)
    ),
    Case(
        "wrt_integer",
        lambda t: ["build-backward", _gather_model(t), "-o", t / "out.onnx", "--wrt", "ids"],
        2,
        ("'ids'", "not a float"),
    ),
    Case(
        "loss_names_nothing", lambda t: ["build-backward", _tiny(t), "-o", t / "out.onnx", "--loss", "nothing"], 2, ("'nothing'",)
    ),
    Case("freeze_names_nothing", lambda t: ["build-backward", _tiny(t), "-o", t / "out.onnx", "--freeze", "zz"], 2, ("zz",)),
    Case(
        "everything_frozen",
        lambda t: ["build-backward", _tiny(t), "-o", t / "out.onnx", "--freeze", "w"],
        2,
        ("nothing to differentiate",),
    ),
    # where to write
    Case("output_is_input", lambda t: ["build-backward", _tiny(t), "-o", t / "tiny.onnx"], 2, ("must not be the input",)),
    Case("output_is_input_respelled", _respelled_output, 2, ("must not be the input",)),
    Case("output_is_input_relative", _relative_output, 2, ("must not be the input",)),
    Case("output_is_input_symlink", _symlinked_output, 2, ("link.onnx", "must not be the input")),
    Case("output_is_input_hardlink", _hardlinked_output, 2, ("hard.onnx", "must not be the input")),
    Case("output_dir_missing", lambda t: ["build-backward", _tiny(t), "-o", t / "no" / "out.onnx"], 2, ("does not exist",)),
    Case("output_is_directory", lambda t: ["build-backward", _tiny(t), "-o", t], 2, ("is a directory",)),
    # running
    Case("run_input_missing", lambda t: _run(t, y=np.zeros((2, 3), np.float32)), 4, ("missing input", "'x'")),
    Case("run_input_unknown", lambda t: _run(t, x=np.zeros((2, 3), np.float32), z=np.zeros(1)), 4, ("unknown input", "'z'")),
    Case("run_input_dtype", lambda t: _run(t, x=np.zeros((2, 3), np.float64)), 4, ("'x'", "float64", "float32")),
    Case("run_input_rank", lambda t: _run(t, x=np.zeros((2, 3, 1), np.float32)), 4, ("'x'", "rank 3")),
    Case("run_input_dimension", lambda t: _run(t, x=np.zeros((2, 5), np.float32)), 4, ("'x'", "dimension 1", "5")),
    Case("run_index_out_of_range", _index_out_of_range, 4, ("'lookup'", "Gather", "index 7", "axis 0")),
    Case("run_npz_missing", lambda t: ["run", _tiny(t), "--inputs", t / "nope.npz"], 2, ("nope.npz", "no such file")),
    Case(
        "run_npz_not_npz",
        lambda t: ["run", _tiny(t), "--inputs", _write(t, "bad.npz", b"not a zip file")],
        2,
        ("bad.npz", "not an .npz file (not a zip archive"),
    ),
    Case("run_npz_is_npy", lambda t: ["run", _tiny(t), "--inputs", _npy(t)], 2, ("x.npy", "not an .npz file")),
    Case("run_no_inputs", lambda t: ["run", _tiny(t)], 2, ("--inputs",)),
    Case("run_bad_dim", lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=x"], 2, ("--dim", "N=x")),
    Case("run_unbound_dim", lambda t: ["run", _tiny(t), "--random-inputs"], 2, ("'N'", "--dim")),
    Case(
        "run_output_is_model",
        lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=2", "-o", t / "tiny.onnx"],
        2,
        ("must not be the input",),
    ),
    Case(
        "run_output_is_inputs",
        lambda t: ["run", _tiny(t), "--inputs", _npz(t, x=np.zeros((2, 3), np.float32)), "-o", t / "in.npz"],
        2,
        ("must not be the input",),
    ),
    Case(
        "run_output_dir_missing",
        lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=2", "-o", t / "no" / "o.npz"],
        2,
        ("does not exist",),
    ),
    Case("run_bad_device", lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=2", "--device", "tpu"], 2, ("'tpu'",)),
    Case(
        "run_output_parent_is_a_file",
        lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=2", "-o", t / "tiny.onnx" / "o.npz"],
        2,
        ("is not a directory",),
    ),
    Case(
        "output_parent_is_a_file",
        lambda t: ["build-backward", _tiny(t), "-o", t / "tiny.onnx" / "o.onnx"],
        2,
        ("is not a directory",),
    ),
    Case(
        "run_dim_unknown",
        lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "M=2"],
        2,
        ("--dim M", "symbolic dimensions are N"),
    ),
    Case("run_dim_too_large", lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=1000000000000"], 2, ("'x'", "--dim")),
    Case("run_rtol_nan", lambda t: ["run", _tiny(t), "--random-inputs", "--dim", "N=2", "--rtol", "nan"], 2, ("--rtol",)),
    Case(
        "run_compare_unmatched",
        lambda t: [
            "run",
            _tiny(t),
            "--random-inputs",
            "--dim",
            "N=2",
            "--device",
            "cpu",
            "--compare",
            _npz(t, nothing=np.zeros(1)),
        ],
        4,
        ("nothing",),
    ),
    Case("external_data_outside", _external_data_outside, 3, ("'w'", "../w.bin", "not inside the model's directory")),
    # checking
    Case("check_no_inputs", lambda t: ["check", _tiny(t)], 2, ("--inputs",)),
    Case("check_missing_model", lambda t: ["check", t / "nope.onnx", "--random-inputs"], 2, ("nope.onnx", "no such file")),
    Case(
        "check_bad_samples",
        lambda t: ["check", _tiny(t), "--random-inputs", "--dim", "N=2", "--samples", "-1"],
        2,
        ("--samples",),
    ),
    Case(
        "check_nan_loss",
        lambda t: ["check", _tiny(t), "--inputs", _npz(t, x=np.full((2, 3), np.nan, np.float32))],
        4,
        ("not finite", "'loss'"),
    ),
]


def _npy(tmp: Path) -> Path:
    np.save(tmp / "x.npy", np.zeros((2, 3), np.float32))
    return tmp / "x.npy"


def _snapshot(tmp: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in tmp.rglob("*") if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(tmp_path, capsys, monkeypatch, case):
    cwd = os.getcwd()
    try:
        args = case.setup(tmp_path)
        before = _snapshot(tmp_path)
        code, _, err = run_cli(capsys, monkeypatch, *args)
    finally:
        os.chdir(cwd)
    assert code == case.code, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    message = err[err.index("error: ") :]
    if not case.multiline:
        assert message.strip() == errors[0], f"expected one line, got {message!r}"
    for text in case.texts:
        assert text in message, f"{text!r} not in {message!r}"
    # inputs untouched, nothing written, no temporary file left
    assert _snapshot(tmp_path) == before
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]


def test_debug_shows_a_traceback_and_keeps_the_exit_code(tmp_path, capsys, monkeypatch):
    model = _write(tmp_path, "text.onnx", b"not a model")
    for argv in (
        ["--debug", "build-backward", model, "-o", tmp_path / "o.onnx"],
        ["build-backward", model, "-o", tmp_path / "o.onnx", "--debug"],
    ):
        code, _, err = run_cli(capsys, monkeypatch, *argv)
        assert code == 3
        assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", tmp_path / "o.onnx")
    assert code == 3 and "Traceback" not in err  # --debug does not stick


def test_every_truncation_point_is_a_model_error(tmp_path):
    """Cut the tiny model after every byte: always a ModelError naming the file, never a crash."""
    data = _tiny_bytes()
    path = tmp_path / "cut.onnx"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelError, match="cut.onnx"):
            build_backward(path)


def test_failed_save_leaves_nothing_and_keeps_the_old_output(tmp_path, monkeypatch):
    model = build_backward(_tiny(tmp_path)).model
    out = tmp_path / "out.onnx"
    out.write_bytes(b"old")

    def broken(*args, **kwargs):
        Path(args[1]).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(model_io.ir, "save", broken)
    with pytest.raises(UsageError, match="out.onnx: cannot write the output: disk full"):
        model_io.save_model(model, out)
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "tiny.onnx"]


# -- external data ---------------------------------------------------------------------------


def _big_model(path: Path, external: bool) -> np.ndarray:
    """loss = sum(x @ w) with a 64x64 weight (16 KiB), optionally saved with external data."""
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    model = matmul_sum_model(numpy_helper.from_array(w, "w"))
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, size_threshold=0, location="weights.bin")
    else:
        onnx.save_model(model, str(path))
    return w


def test_load_follows_external_data_relative_to_the_model(tmp_path, capsys, monkeypatch):
    (tmp_path / "models").mkdir()
    _big_model(tmp_path / "models" / "m.onnx", external=True)
    assert (tmp_path / "models" / "weights.bin").exists()
    monkeypatch.chdir(tmp_path)  # a relative model path, resolved against the model's directory
    code, stdout, err = run_cli(capsys, monkeypatch, "build-backward", "models/m.onnx", "-o", "g.onnx")
    assert code == 0, err
    x = np.ones((2, 64), np.float32)
    got = Session(tmp_path / "g.onnx").run({"x": x})
    np.testing.assert_allclose(got["w_grad"], np.full((64, 64), 2.0, np.float32))


def test_large_models_are_saved_with_external_data(tmp_path, capsys, monkeypatch):
    w = _big_model(tmp_path / "m.onnx", external=False)
    monkeypatch.setattr(model_io, "_EXTERNAL_DATA_THRESHOLD", 1000)
    out = tmp_path / "g.onnx"
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", out)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx", "g.onnx.data", "m.onnx"]
    proto = onnx.load(str(out), load_external_data=False)
    external = {t.name for t in proto.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert "w" in external
    assert all(e.value == "g.onnx.data" for t in proto.graph.initializer for e in t.external_data if e.key == "location")
    assert out.stat().st_size < w.nbytes < (tmp_path / "g.onnx.data").stat().st_size + 1
    # it loads again (also from another working directory) and computes the same gradient
    monkeypatch.chdir(tmp_path.parent)
    got = Session(out).run({"x": np.ones((2, 64), np.float32)})
    np.testing.assert_allclose(got["w_grad"], np.full((64, 64), 2.0, np.float32))
    # writing again replaces the data file instead of appending to it
    size = (tmp_path / "g.onnx.data").stat().st_size
    assert run_cli(capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", out)[0] == 0
    assert (tmp_path / "g.onnx.data").stat().st_size == size
    onnx.checker.check_model(str(out), full_check=True)


def test_failed_external_save_leaves_nothing(tmp_path, monkeypatch):
    _big_model(tmp_path / "m.onnx", external=False)
    model = build_backward(tmp_path / "m.onnx").model
    monkeypatch.setattr(model_io, "_EXTERNAL_DATA_THRESHOLD", 0)
    real_replace = os.replace

    def failing_replace(src, dst):
        if str(dst).endswith("g.onnx"):
            raise OSError("rename failed")
        real_replace(src, dst)

    monkeypatch.setattr(model_io.os, "replace", failing_replace)
    with pytest.raises(UsageError, match="rename failed"):
        model_io.save_model(model, tmp_path / "g.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    # an earlier data file survives a failed write
    (tmp_path / "g.onnx.data").write_bytes(b"earlier")
    with pytest.raises(UsageError, match="rename failed"):
        model_io.save_model(model, tmp_path / "g.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.onnx.data", "m.onnx"]
    assert (tmp_path / "g.onnx.data").read_bytes() == b"earlier"
