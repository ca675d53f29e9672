"""Models that say one thing and hold another, as a user meets them: declared types and shapes
that the nodes do not compute, tensors without their data, conditions of more than one element,
and an output path that is not a regular file. Each was a silently wrong result or a replaced
file; each is now one line and a non-zero exit."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError, RunError
from gradgen.executor import Session
from tests.test_cli import run_cli

X3 = np.array([1.0, 2.0, 3.0], np.float32)


def _mul_loss(initializer: onnx.TensorProto, value_info: list | None = None) -> onnx.ModelProto:
    """loss = sum(x * w), with ``w`` as given and ``y = x * w`` declared as ``value_info`` says."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"], name="mul"), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[initializer],
        value_info=value_info or [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        (helper.make_tensor_value_info("y", TensorProto.INT64, [3]), "elem type differs"),  # gave a zero w_grad
        (helper.make_tensor_value_info("y", TensorProto.FLOAT, [1]), "shape differ"),  # gave w_grad of x's shape
    ],
    ids=["type", "shape"],
)
def test_a_declaration_the_nodes_contradict_is_a_model_error(tmp_path, capsys, monkeypatch, declared, said):
    model = _mul_loss(numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w"), [declared])
    with pytest.raises(ModelError, match=said) as raised:
        gradgen.build_backward(model)
    assert "mul" in str(raised.value)  # the node at fault
    onnx.save(model, tmp_path / "m.onnx")
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", tmp_path / "b.onnx")
    assert code == 3 and said in _one_error_line(err)
    assert not (tmp_path / "b.onnx").exists()


def test_correct_declarations_still_build_and_give_the_gradient():
    model = _mul_loss(
        numpy_helper.from_array(np.array([4, 5, 6], np.float32), "w"),
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
    )
    built = gradgen.build_backward(model)
    with Session(built.model) as session:
        np.testing.assert_array_equal(session.run({"x": X3})["w_grad"], X3)


def _tensor(dims, **fields) -> onnx.TensorProto:
    return onnx.TensorProto(name="w", dims=dims, **{"data_type": TensorProto.FLOAT, **fields})


@pytest.mark.parametrize(
    ("tensor", "said"),
    [
        (_tensor([3]), "does not fill its dims"),  # read as zeros: loss 0
        (_tensor([3], raw_data=np.ones(2, np.float32).tobytes()), "holds 8 bytes of data where its dims need 12"),
        (_tensor([3], float_data=[1.0, 2.0]), "does not fill its dims"),
        (_tensor([-3], raw_data=np.ones(3, np.float32).tobytes()), "negative dimension"),
        (_tensor([3], data_type=0, raw_data=np.ones(3, np.float32).tobytes()), "no valid element type"),
        (_tensor([1 << 40, 1 << 20]), "does not fill its dims"),
    ],
    ids=["no-data", "short-raw", "short-field", "negative-dim", "no-type", "absurd-dims"],
)
def test_a_tensor_without_its_data_is_a_model_error_naming_it(tmp_path, capsys, monkeypatch, tensor, said):
    path = tmp_path / "m.onnx"
    onnx.save(_mul_loss(tensor), path)
    np.savez(tmp_path / "x.npz", x=X3)
    for args in (
        ["run", path, "--inputs", tmp_path / "x.npz", "--device", "cpu"],
        ["build-backward", path, "-o", tmp_path / "b.onnx"],
    ):
        code, out, err = run_cli(capsys, monkeypatch, *args)
        line = _one_error_line(err)
        assert code == 3 and "tensor 'w'" in line and said in line, line
        assert "loss" not in out


def test_a_constant_tensor_in_a_node_is_checked_too():
    constant = helper.make_node("Constant", [], ["w"], value=_tensor([3], float_data=[1.0]))
    graph = helper.make_graph(
        [constant, helper.make_node("Mul", ["x", "w"], ["loss"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [3])],
    )
    with pytest.raises(ModelError, match="tensor 'w'"):
        Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _if_model(cond_shape) -> onnx.ModelProto:
    out = helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["a"])], "then", [], [out("a", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Add", ["x", "x"], ["b"])], "else", [], [out("b", TensorProto.FLOAT, [3])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)],
        "g",
        [out("x", TensorProto.FLOAT, [3]), out("c", TensorProto.BOOL, cond_shape)],
        [out("y", TensorProto.FLOAT, [3])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cond", [np.array([False, True]), np.zeros(0, bool)], ids=["two", "none"])
def test_an_if_condition_of_other_than_one_element_is_refused(cond):
    """It took the first element silently (or failed with an IndexError on none)."""
    with Session(_if_model([None])) as session:
        with pytest.raises(RunError, match=r"'branch' \(If\).*exactly one element; it has shape"):
            session.run({"x": X3, "c": cond})
        np.testing.assert_array_equal(session.run({"x": X3, "c": np.array([True])})["y"], X3 * X3)


def test_a_constant_if_condition_of_two_elements_is_a_model_error_at_build():
    model = _if_model([2])
    model.graph.input.pop()  # c becomes a constant
    model.graph.initializer.append(numpy_helper.from_array(np.array([True, False]), "c"))
    with pytest.raises(ModelError, match="'branch'.*exactly one element"):
        gradgen.build_backward(model, loss="y", wrt_inputs=True)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
@pytest.mark.parametrize("command", ["build-backward", "run"])
def test_an_output_that_is_a_pipe_is_refused_and_left_as_it_is(tmp_path, capsys, monkeypatch, command):
    """The output is written beside its path and renamed over it: a pipe or a device there (as root,
    -o /dev/null) was replaced by a regular file."""
    from tests.test_cli import tiny_model

    tiny_model(tmp_path / "tiny.onnx")
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    args = ["build-backward", tmp_path / "tiny.onnx", "-o", pipe]
    if command == "run":
        args = ["run", tmp_path / "tiny.onnx", "--random-inputs", "--dim", "N=2", "--device", "cpu", "-o", pipe]
    code, out, err = run_cli(capsys, monkeypatch, *args)
    assert code == 2 and "is not a regular file" in _one_error_line(err)
    assert pipe.is_fifo()


def _graph_model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _vec(name: str, n: int = 3):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [n])


def _branching(**branches) -> onnx.ModelProto:
    """y = If(c) over x with the given ``then_branch`` / ``else_branch`` attributes."""
    return _graph_model(
        [helper.make_node("If", ["c"], ["y"], name="branch", **branches)],
        [_vec("x"), helper.make_tensor_value_info("c", TensorProto.BOOL, [1])],
        [_vec("y")],
    )


W3 = numpy_helper.from_array(np.ones(3, np.float32), "w")
INVALID = {
    "a node input nothing provides": (
        _graph_model([helper.make_node("Mul", ["x", "nope"], ["y"], name="m")], [_vec("x")], [_vec("y")]),
        "node 'm' (Mul) reads 'nope'",
    ),
    "a graph output nothing computes": (
        _graph_model([helper.make_node("Relu", ["x"], ["y"])], [_vec("x")], [_vec("y"), _vec("ghost")]),
        "graph output 'ghost' is computed by no node",
    ),
    "a duplicate graph input": (
        _graph_model([helper.make_node("Mul", ["x", "w"], ["y"])], [_vec("x"), _vec("x")], [_vec("y")], [W3]),
        "graph input 'x' is declared more than once",
    ),
    "an attribute the op does not have": (
        _graph_model([helper.make_node("Mul", ["x", "w"], ["y"], name="m", foo=1)], [_vec("x")], [_vec("y")], [W3]),
        "node 'm' (Mul) has an attribute 'foo'",
    ),
    "an attribute of the wrong type": (
        _graph_model(
            [helper.make_node("ReduceSum", ["x"], ["y"], name="r", keepdims="no")],
            [_vec("x")],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        ),
        "node 'r' (ReduceSum): attribute 'keepdims' is string, where ReduceSum takes int",
    ),
    "a required attribute missing": (
        _branching(then_branch=helper.make_graph([helper.make_node("Neg", ["x"], ["a"])], "t", [], [_vec("a")])),
        "node 'branch' (If) lacks the attribute 'else_branch'",
    ),
    "a negative input dimension": (
        _graph_model([helper.make_node("Neg", ["x"], ["y"])], [_vec("x", -3)], [_vec("y")]),
        "graph input 'x' declares a negative dimension",
    ),
    "a cycle": (
        _graph_model(
            [
                helper.make_node("Add", ["x", "b"], ["a"]),
                helper.make_node("Mul", ["a", "x"], ["b"]),
                helper.make_node("Neg", ["a"], ["y"]),
            ],
            [_vec("x")],
            [_vec("y")],
        ),
        "the graph has a cycle: node 'Mul_1' (Mul) -> 'Add_0' (Add) -> 'Mul_1' (Mul)",
    ),
    "a Concat axis out of range (ONNX's checker says so, where gradgen's gradient pass failed)": (
        _graph_model(
            [helper.make_node("Concat", ["x", "x"], ["c"], axis=3), helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0)],
            [_vec("x")],
            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        ),
        "not valid ONNX",
    ),
    "a node with more inputs than its op takes": (
        _graph_model([helper.make_node("Mul", ["x", "w", "w"], ["y"], name="m")], [_vec("x")], [_vec("y")], [W3]),
        "node 'm' (Mul) has 3 inputs, where Mul takes 2",
    ),
    "a subgraph reading a name nothing provides": (
        _branching(
            then_branch=helper.make_graph([helper.make_node("Neg", ["missing"], ["a"], name="n")], "t", [], [_vec("a")]),
            else_branch=helper.make_graph([helper.make_node("Neg", ["x"], ["b"])], "e", [], [_vec("b")]),
        ),
        "node 'n' (Neg) reads 'missing'",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_an_invalid_graph_is_a_model_error_naming_the_fault(tmp_path, capsys, monkeypatch, case):
    """build-backward wrote such models out (exit 0) as outputs ONNX's checker rejects, or failed
    with an internal error."""
    model, said = INVALID[case]
    onnx.save(model, tmp_path / "m.onnx")
    code, out, err = run_cli(
        capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", tmp_path / "b.onnx", "--wrt-inputs"
    )
    assert code == 3 and said in _one_error_line(err)
    assert not (tmp_path / "b.onnx").exists()


@pytest.mark.parametrize(
    "reference", [np.array([1 + 2j, 2, 3], np.complex64), np.array(["a", "b", "c"])], ids=["complex", "strings"]
)
def test_compare_refuses_a_reference_that_holds_no_real_numbers(tmp_path, capsys, monkeypatch, reference):
    """A complex reference passed as a match (its imaginary part dropped); strings crashed."""
    model = _mul_loss(numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w"))
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=X3)
    np.savez(tmp_path / "ref.npz", loss=reference)
    code, out, err = run_cli(
        capsys,
        monkeypatch,
        "run",
        tmp_path / "m.onnx",
        "--inputs",
        tmp_path / "x.npz",
        "--device",
        "cpu",
        "--compare",
        tmp_path / "ref.npz",
    )
    assert code == 2 and "reference key 'loss' holds" in _one_error_line(err) and "match" not in out


def test_big_endian_inputs_are_taken_as_their_values(tmp_path, capsys, monkeypatch):
    """An .npz written on a big-endian machine holds >f4 arrays: the same numbers, not another type."""
    model = _mul_loss(numpy_helper.from_array(np.array([4, 5, 6], np.float32), "w"))
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "x.npz", x=X3.astype(">f4"))
    out_path = tmp_path / "out.npz"
    code, out, err = run_cli(
        capsys, monkeypatch, "run", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz", "--device", "cpu", "-o", out_path
    )
    assert code == 0, err
    assert float(np.load(out_path)["loss"]) == 32.0  # 1*4 + 2*5 + 3*6


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--rtol", "0.1"], "--rtol only applies with --compare"),
        (["--torch-names"], "--torch-names only applies with --compare"),
        (["--floor", "0.5"], "--floor only applies with --compare"),
        (["--random-inputs", "--dim", "N=2", "--dim", "N=3"], "--dim N is given twice (2 and 3)"),
        (["--random-inputs", "--dim", "N=\u0663"], "expected NAME=VALUE with a non-negative integer VALUE"),
    ],
    ids=["rtol", "torch-names", "floor", "dim-twice", "dim-not-ascii"],
)
def test_options_that_would_be_ignored_or_are_ambiguous_are_refused(tmp_path, capsys, monkeypatch, extra, said):
    from tests.test_cli import tiny_model

    tiny_model(tmp_path / "tiny.onnx")
    extra = [e.encode().decode("unicode_escape") for e in extra]
    inputs = [] if "--random-inputs" in extra else ["--random-inputs", "--dim", "N=2"]
    code, out, err = run_cli(capsys, monkeypatch, "run", tmp_path / "tiny.onnx", "--device", "cpu", *inputs, *extra)
    assert code == 2 and said in _one_error_line(err)


def test_a_file_that_is_not_an_npz_is_called_so(tmp_path, capsys, monkeypatch):
    """numpy takes a file that is not a zip archive for a pickle, and said so."""
    model = _mul_loss(numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w"))
    onnx.save(model, tmp_path / "m.onnx")
    (tmp_path / "x.npz").write_text("x = 1, 2, 3\n")
    code, _, err = run_cli(capsys, monkeypatch, "run", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz", "--device", "cpu")
    line = _one_error_line(err)
    assert code == 2 and "not an .npz file (not a zip archive" in line and "pickled" not in line


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"x": X3.astype(np.int64)}, "input 'x': dtype int64, but the model declares float32"),
        ({}, "missing input(s) 'x'; the model's inputs are 'x'"),
    ],
    ids=["dtype", "missing"],
)
def test_check_judges_inputs_against_the_users_model(tmp_path, capsys, monkeypatch, given, said):
    """check works on a float64 copy whose differentiated initializers are inputs: its messages
    named that copy's types and listed the initializers among the model's inputs."""
    model = _mul_loss(numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w"))
    onnx.save(model, tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", **given)
    code, _, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--inputs", tmp_path / "in.npz")
    assert code == 4 and said in _one_error_line(err)


def _doubling_loop(m: int) -> onnx.ModelProto:
    """loss = sum of a Loop of ``m`` iterations whose body concatenates its state with itself."""
    body = helper.make_graph(
        [helper.make_node("Concat", ["s", "s"], ["s2"], axis=0), helper.make_node("Identity", ["cond"], ["cond2"])],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("cond2", TensorProto.BOOL, []),
            helper.make_tensor_value_info("s2", TensorProto.FLOAT, None),
        ],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["x", "w"], ["xw"]),
            helper.make_node("Loop", ["M", "", "xw"], ["y"], body=body),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ],
        "g",
        [_vec("x")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.ones(3, np.float32), "w"), numpy_helper.from_array(np.array(m, np.int64), "M")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_loop_that_doubles_its_state_builds_without_data_propagation():
    """Such a Loop unrolls into a chain of 1-D Concats. ONNX's data propagation went through every
    element of each, doubling its time per Concat: at 26 iterations the build took over 60 s and
    14.5 GB. The graph reads no shape, so it is skipped now; the gradient stays right."""
    assert gradgen.build_backward(_doubling_loop(26)).loss == "loss"  # 3 * 2^26 elements: built, not run
    with Session(gradgen.build_backward(_doubling_loop(4)).model) as session:
        grad = session.run({"x": X3})["w_grad"]
    np.testing.assert_array_equal(grad, X3 * 16.0)  # the loss sums 2^4 copies of x * w
