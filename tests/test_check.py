"""``gradgen check`` and ``gradgen.check``: backward graphs against float64 finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.check import check_gradients, to_float64
from gradgen.executor import Session
from gradgen.grads import registry
from tests.model_dirs import SAMPLE_DIRS, dir_id
from tests.test_cli import run_cli, tiny_model


@pytest.mark.parametrize("sample", SAMPLE_DIRS, ids=dir_id)
def test_every_sample_passes(sample):
    report = check_gradients(sample / "model.onnx", inputs=sample / "inputs.npz", wrt_inputs=True, samples=2)
    assert report.passed, report.format()
    assert report.tensors and all(t.max_rel_err < 1e-6 for t in report.tensors), report.format()


def test_cli_passes_and_prints_a_table(capsys, monkeypatch):
    sample = SAMPLE_DIRS[0]
    code, out, err = run_cli(capsys, monkeypatch, "check", sample / "model.onnx", "--inputs", sample / "inputs.npz",
                             "--samples", "1")
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("tensor"))
    for column in ("shape", "max abs err", "max rel err", "tolerance", "verdict"):
        assert column in header
    assert sum(line.rstrip().endswith("PASS") for line in lines) >= 1 and "FAIL" not in out


def _mul_model(path) -> None:
    """loss = sum(tanh(x * w) * v): the gradients of w and v go through Mul."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"], name="mul1"),
             helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
             helper.make_node("Mul", ["t", "v"], ["b"], name="mul2"),
             helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0, name="sum")]
    graph = helper.make_graph(
        nodes, "mul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "w"),
                     numpy_helper.from_array(rng.standard_normal((3,)).astype(np.float32), "v")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture
def broken_mul(monkeypatch):
    """Replace the Mul rule by one that forgets the other operand for input 0 (dA = dY)."""
    rules = registry.all_rules()  # loads the table
    good = rules[("", "Mul")]

    def wrong(g):
        return [g.dy() if g.needs(0) else None, g.op("Mul", g.dy(), g.x(0)) if g.needs(1) else None]

    monkeypatch.setitem(registry._RULES, ("", "Mul"), registry.GradRule("", "Mul", wrong, good.broadcast,
                                                                        good.nondiff_inputs))


def test_a_broken_rule_fails_naming_the_tensor(tmp_path, capsys, monkeypatch, broken_mul):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt_inputs=True)
    assert not report.passed
    failed = set(report.failures)
    assert "w" in failed and "x" in failed  # dL/dw and dL/dx both go through mul1's input 0 or 1
    assert "v" not in failed  # v is input 1 of mul2: its rule is still right
    code, out, err = run_cli(capsys, monkeypatch, "check", path, "--random-inputs")
    assert code == 4
    assert [line for line in out.splitlines() if line.startswith("w ")][0].rstrip().endswith("FAIL")
    assert err.strip().splitlines()[-1].startswith("error: gradient check failed") and "w" in err


def test_the_same_model_passes_with_the_real_rule(tmp_path):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt_inputs=True, samples=4)
    assert report.passed, report.format()
    assert [t.name for t in report.tensors] == ["w", "v", "x"]
    assert all("direction" in t.method and "element" in t.method for t in report.tensors)


def test_large_tensors_are_checked_along_directions_only(tmp_path):
    tiny = tmp_path / "t.onnx"
    tiny_model(tiny)  # w is 3x4: elements too; make x large
    report = check_gradients(tiny, inputs={"x": np.random.default_rng(0).standard_normal((40, 3))}, wrt_inputs=True)
    assert report.passed, report.format()
    by_name = {t.name: t for t in report.tensors}
    assert "element" in by_name["w"].method and "element" not in by_name["x"].method


def test_vector_jacobian_product(tmp_path, capsys, monkeypatch):
    path = tmp_path / "m.onnx"
    tiny_model(path, scalar_loss=False)
    code, out, err = run_cli(capsys, monkeypatch, "check", path, "--loss", "r", "--random-inputs", "--dim", "N=3",
                             "--wrt-inputs", "--seed", "3")
    assert code == 0, err
    assert "PASS" in out and "FAIL" not in out


def test_wrt_and_freeze_select_the_tensors(tmp_path):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt=["v", "x"], freeze=["x"])
    assert [t.name for t in report.tensors] == ["v"]


def test_to_float64_converts_types_casts_and_constants():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])
    nodes = [
        helper.make_node("Constant", [], ["c"], value_float=2.5),
        helper.make_node("Constant", [], ["cs"], value_floats=[1.0, 2.0]),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([2], np.int64))),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xf", "c"], ["a"]),
        helper.make_node("Add", ["a", "cs"], ["b"]),
        helper.make_node("Add", ["b", "ones"], ["d"]),
        helper.make_node("Mul", ["d", "w"], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              initializer=[numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "w")],
                              value_info=[helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    double = to_float64(model)
    assert model.SerializeToString() == before  # the input is not modified
    onnx.checker.check_model(double, full_check=True)
    assert double.graph.input[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.value_info[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.initializer[0].data_type == TensorProto.DOUBLE
    got = Session(double).run({"x": np.array([1.0, 3.0])})["loss"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, 0.5 * (2.5 + 1 + 1.5) - 1.0 * (7.5 + 2 + 1.5))
    report = check_gradients(model, inputs={"x": np.array([1.0, 3.0], np.float16)}, wrt_inputs=True)
    assert report.passed, report.format()
