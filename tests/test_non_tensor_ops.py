"""Ops gradgen refuses or does not differentiate, as a user meets them through the CLI: ONNX
sequences and optionals (gradgen runs tensors only: those whose structure the model fixes become
tensors, the others are refused) and DynamicQuantizeLinear (no gradient: its rule's docstring says why)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from gradgen.kernels.cpu.elementwise import dynamic_quantize_linear
from gradgen.ops.non_tensor import NON_TENSOR_OPS
from tests.test_cli import run_cli


def _save(path, nodes, inits=(), opset=17):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        list(inits),
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), path)
    np.savez(path.with_suffix(".npz"), x=np.arange(-2, 4, dtype=np.float32).reshape(2, 3))
    return path


def _weight():
    return helper.make_tensor("w", TensorProto.FLOAT, [2, 3], np.linspace(-1, 2, 6, dtype=np.float32))


def _sequence_model(path, kind):
    """A loss that reads a float tensor through a sequence (or an optional) of the given kind."""
    mul = helper.make_node("Mul", ["x", "w"], ["h"], name="mul")
    total = helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0, name="sum")
    extra = []
    if kind == "construct":
        middle = [
            helper.make_node("SequenceConstruct", ["h", "h"], ["s"], name="seq"),
            helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0, name="cat"),
        ]
    elif kind == "split":
        middle = [
            helper.make_node("SplitToSequence", ["h"], ["s"], axis=1, name="split"),
            helper.make_node("SequenceAt", ["s", "one"], ["c"], name="at"),
        ]
    elif kind == "optional":
        middle = [
            helper.make_node("Optional", ["h"], ["o"], name="opt"),
            helper.make_node("OptionalGetElement", ["o"], ["c"], name="get"),
        ]
    else:  # a position the data decides: which of two elements depends on the sign of sum(x)
        middle = [
            helper.make_node("SequenceConstruct", ["h", "x"], ["s"], name="seq"),
            helper.make_node("ReduceSum", ["x"], ["xs"], keepdims=0, name="xsum"),
            helper.make_node("Greater", ["xs", "zero"], ["positive"], name="positive"),
            helper.make_node("Cast", ["positive"], ["k"], to=TensorProto.INT64, name="k"),
            helper.make_node("SequenceAt", ["s", "k"], ["c"], name="at"),
        ]
        extra = [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    return _save(path, [mul, *middle, total], [_weight(), one, *extra], opset=18)


@pytest.mark.parametrize("kind", ["construct", "split", "optional"])
def test_sequences_and_optionals_the_model_fixes_build_and_run(tmp_path, capsys, monkeypatch, kind):
    """Lists of fixed structure are the tensors they hold (SequencesAsTensorsPass): w's gradient
    is x's values wherever the loss reads h = x * w, whichever list carries h."""
    model = _sequence_model(tmp_path / "m.onnx", kind)
    out, grads = tmp_path / "g.onnx", tmp_path / "grads.npz"
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", out)
    assert code == 0, err
    assert not {n.op_type for n in onnx.load(out).graph.node} & NON_TENSOR_OPS
    code, _, err = run_cli(capsys, monkeypatch, "run", out, "--inputs", model.with_suffix(".npz"), "-o", grads)
    assert code == 0, err
    x = np.arange(-2, 4, dtype=np.float32).reshape(2, 3)
    want = {"construct": 2 * x, "split": x * [0, 1, 0], "optional": x}[kind]
    np.testing.assert_allclose(np.load(grads)["w_grad"], want)
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", model.with_suffix(".npz"))  # forward alone
    assert code == 0, err


def test_a_list_the_data_decides_is_a_one_line_model_error(tmp_path, capsys, monkeypatch):
    model = _sequence_model(tmp_path / "m.onnx", "dynamic")
    out = tmp_path / "g.onnx"
    named = ["'seq' (SequenceConstruct)", "'at' (SequenceAt)"]
    for args in (["build-backward", model, "-o", out], ["run", model, "--inputs", model.with_suffix(".npz")]):
        code, _, err = run_cli(capsys, monkeypatch, *args)
        last = err.strip().splitlines()[-1]
        assert code == 3, err
        assert last.startswith("error: ") and "Traceback" not in err
        assert all(n in last for n in named) and "tensors only" in last, last
        assert "without a gradient rule" not in err and "without a CPU kernel" not in err
    assert not out.exists()


def test_ops_lists_sequence_and_optional_ops_as_rewritten_to_tensors(capsys, monkeypatch):
    """No rule or kernel of their own: SequencesAsTensorsPass turns them into tensors where it can."""
    code, stdout, _ = run_cli(capsys, monkeypatch, "ops", "--json")
    assert code == 0
    rows = {r["op_type"]: r for r in json.loads(stdout) if r["domain"] == "ai.onnx"}
    for op in NON_TENSOR_OPS | {"SequenceConstruct", "ConcatFromSequence", "OptionalGetElement", "SequenceMap"}:
        assert not rows[op]["cpu"] and not rows[op]["cuda"], op
        assert rows[op]["gradient"] == "rewritten" and "passes/sequences.py" in rows[op]["rewritten_to"], op


# -- DynamicQuantizeLinear -------------------------------------------------------------------------


def _ort_dynamic_quantize(x):
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [
            helper.make_tensor_value_info(n, t, None)
            for n, t in [("y", TensorProto.UINT8), ("s", TensorProto.FLOAT), ("z", TensorProto.UINT8)]
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize(
    "x",
    [
        np.random.default_rng(0).normal(size=(4, 5)),
        np.abs(np.random.default_rng(1).normal(size=7)),  # all positive: zero point 0
        -np.abs(np.random.default_rng(2).normal(size=7)),  # all negative: zero point 255
        np.zeros(3),  # ONNX Runtime's scale 1
        np.array([0, 2.5, -1.5, 1.5]),  # exact halves: rounding to even
    ],
)
def test_dynamic_quantize_linear_kernel_matches_onnxruntime(x):
    x = x.astype(np.float32)
    for got, want in zip(dynamic_quantize_linear(x), _ort_dynamic_quantize(x)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def _quantize_model(path, reads):
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"], name="mul"),
        helper.make_node("DynamicQuantizeLinear", ["h"], ["q", "s", "z"], name="dq"),
    ]
    if reads == "scale":  # a dequantization: (q - z) * s
        nodes += [
            helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT, name="cast_q"),
            helper.make_node("Cast", ["z"], ["zf"], to=TensorProto.FLOAT, name="cast_z"),
            helper.make_node("Sub", ["qf", "zf"], ["d"], name="sub"),
            helper.make_node("Mul", ["d", "s"], ["deq"], name="deq"),
            helper.make_node("ReduceSum", ["deq"], ["loss"], keepdims=0, name="sum"),
        ]
    else:  # the integer output only, plus a float path from w
        nodes += [
            helper.make_node("Cast", ["q"], ["qf"], to=TensorProto.FLOAT, name="cast_q"),
            helper.make_node("Mul", ["qf", "h"], ["p"], name="prod"),
            helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0, name="sum"),
        ]
    return _save(path, nodes, [_weight()])


def test_a_gradient_into_y_scale_is_a_model_error_naming_the_node(tmp_path, capsys, monkeypatch):
    model = _quantize_model(tmp_path / "m.onnx", "scale")
    out = tmp_path / "g.onnx"
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", out)
    assert code == 3, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: DynamicQuantizeLinear node 'dq'") and "y_scale" in last, last
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    # the forward model runs as it is
    code, _, err = run_cli(capsys, monkeypatch, "run", model, "--inputs", model.with_suffix(".npz"))
    assert code == 0, err


def test_the_integer_outputs_carry_no_gradient(tmp_path, capsys, monkeypatch):
    """loss = sum(float(q) * h), h = x * w: q is treated as a constant, so dloss/dw = q * x."""
    model = _quantize_model(tmp_path / "m.onnx", "integer")
    out, grads = tmp_path / "g.onnx", tmp_path / "g.npz"
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", model, "-o", out)
    assert code == 0, err
    code, _, err = run_cli(capsys, monkeypatch, "run", out, "--inputs", model.with_suffix(".npz"), "-o", grads)
    assert code == 0, err
    x = np.load(model.with_suffix(".npz"))["x"]
    w = np.linspace(-1, 2, 6, dtype=np.float32).reshape(2, 3)
    q = dynamic_quantize_linear(x * w)[0].astype(np.float32)
    np.testing.assert_allclose(np.load(grads)["w_grad"], q * x, rtol=1e-6)
