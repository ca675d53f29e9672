"""Pointwise fusion on the GPU: models run with GRADGEN_CUDA_FUSION on and off give the same bits."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session, fusion
from tests.test_fusion import make_model, node

pytestmark = pytest.mark.cuda

F, H, I64, B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL


def run_both(model, feeds, monkeypatch, runs: int = 3):
    """Outputs with fusion off and on (the last of ``runs`` runs: eager, recorded, replayed), and
    the fused Session's number of fused steps."""
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(fusion.ENV, switch)
        with Session(model, device="cuda") as sess:
            count = sum(s.op_type == fusion.OP_TYPE for s in sess.steps)
            outs = [sess.run(feeds) for _ in range(runs)]
        for later in outs[1:]:
            assert_same_bits(later, outs[0])
        results.append((outs[-1], count))
    (off, none), (on, count) = results
    assert none == 0
    return off, on, count


def assert_same_bits(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), f"{name} differs in its bits"


def test_broadcasting_chain(monkeypatch):
    model = make_model(
        [
            node("Mul", ["x", "s"], ["a"], "mul"),
            node("Add", ["a", "b"], ["c"], "add"),
            node("Tanh", ["c"], ["t"], "tanh"),
            node("Mul", ["t", "x"], ["m"], "mul2"),
            node("Sub", ["m", "k"], ["y"], "sub"),
        ],
        [("x", F, [8, 64, 96]), ("s", F, [96]), ("b", F, [64, 1]), ("k", F, [])],
        [("y", F, [8, 64, 96])],
    )
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((8, 64, 96)).astype(np.float32),
        "s": rng.standard_normal(96).astype(np.float32),
        "b": rng.standard_normal((64, 1)).astype(np.float32),
        "k": np.float32(0.3),
    }
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1
    assert_same_bits(on, off)


def test_where_and_int_bool_comparisons(monkeypatch):
    model = make_model(
        [
            node("Greater", ["x", "zero"], ["g"], "gt"),
            node("Where", ["g", "dy", "zero"], ["r"], "where"),
            node("Cast", ["x"], ["xi"], "cast", to=I64),
            node("Equal", ["xi", "lab"], ["eq"], "eq"),
            node("Not", ["eq"], ["ne"], "not"),
            node("And", ["ne", "g"], ["both"], "and"),
            node("Where", ["both", "r", "dy"], ["y"], "where2"),
        ],
        [("x", F, [4, 1000]), ("dy", F, [4, 1000]), ("zero", F, []), ("lab", I64, [1000])],
        [("y", F, [4, 1000]), ("both", B, [4, 1000])],
    )
    rng = np.random.default_rng(2)
    feeds = {
        "x": (rng.standard_normal((4, 1000)) * 3).astype(np.float32),
        "dy": rng.standard_normal((4, 1000)).astype(np.float32),
        "zero": np.float32(0),
        "lab": rng.integers(-3, 4, 1000),
    }
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1
    assert_same_bits(on, off)


def gelu_tanh_model():
    """A tanh-GELU spelled in elementwise nodes (as exporters write it), summed into a loss."""
    c = helper.make_tensor
    consts = [
        helper.make_node("Constant", [], [n], name=f"c_{n}", value=c(n, F, [], [v]))
        for n, v in (("half", 0.5), ("one", 1.0), ("k0", 0.7978845608), ("k1", 0.044715), ("three", 3.0))
    ]
    nodes = consts + [
        node("MatMul", ["x", "w"], ["h"], "mm"),
        node("Pow", ["h", "three"], ["h3"], "pow"),
        node("Mul", ["h3", "k1"], ["a"], "m1"),
        node("Add", ["h", "a"], ["b"], "add1"),
        node("Mul", ["b", "k0"], ["c"], "m2"),
        node("Tanh", ["c"], ["t"], "tanh"),
        node("Add", ["t", "one"], ["u"], "add2"),
        node("Mul", ["h", "half"], ["v"], "m3"),
        node("Mul", ["v", "u"], ["g"], "m4"),
        node("ReduceSum", ["g"], ["loss"], "sum", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", F, [64, 128])],
        [helper.make_tensor_value_info("loss", F, [])],
        [helper.make_tensor("w", F, [128, 256], np.random.default_rng(3).standard_normal(128 * 256).astype(np.float32) * 0.1)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_gelu_gradient_chain(monkeypatch):
    built = gradgen.build_backward(gelu_tanh_model(), portable=True)  # the gradient in standard ops
    feeds = {"x": np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)}
    off, on, count = run_both(built.model, feeds, monkeypatch)
    assert count >= 1
    assert_same_bits(on, off)


def test_gelu_op_and_float16(monkeypatch):
    model = make_model(
        [
            node("Gelu", ["x"], ["g"], "gelu", approximate="tanh"),
            node("Cast", ["g"], ["gh"], "cast", to=H),
            node("Mul", ["gh", "s"], ["m"], "mul"),
            node("Sigmoid", ["m"], ["y"], "sig"),
            node("Gelu", ["x"], ["e"], "gelu_erf"),
            node("Exp", ["e"], ["z"], "exp"),
        ],
        [("x", F, [3, 777]), ("s", H, [777])],
        [("y", H, [3, 777]), ("z", F, [3, 777])],
        opset=20,
    )
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 777)).astype(np.float32), "s": rng.standard_normal(777).astype(np.float16)}
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 2
    assert_same_bits(on, off)


def test_gpt2_tiny_backward(monkeypatch):
    pytest.importorskip("torch")
    from gradgen.bench import models

    spec = models.preset("gpt2-tiny")
    module = models.build_module(spec)
    inputs = models.make_inputs(spec)
    built = gradgen.build_backward(models.export(module, inputs), wrt=models.parameter_names(module))
    off, on, count = run_both(built.model, inputs, monkeypatch)
    assert count >= 4  # the GELU itself is one FastGelu node (GeluFusionPass)
    assert_same_bits(on, off)
