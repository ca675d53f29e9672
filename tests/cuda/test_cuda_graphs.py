"""CUDA-graph replay: the third run of a shape replays a recorded graph, with the same results."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import KernelError
from gradgen.executor import Session
from tests.model_dirs import SAMPLE_DIRS, dir_id, load

pytestmark = pytest.mark.cuda


def _replays(session) -> bool:
    from gradgen.executor.cuda_backend import _Replay

    return any(isinstance(state, _Replay) for state in session.backend._graphs.values())


@pytest.mark.parametrize("path", SAMPLE_DIRS, ids=dir_id)
def test_replay_matches_eager(path, monkeypatch):
    model, inputs, _, _ = load(path)
    built = gradgen.build_backward(model).model
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "0")
    eager = Session(built, device="cuda").run(inputs)
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    session = Session(built, device="cuda")
    runs = [session.run(inputs) for _ in range(3)]
    print(f"{dir_id(path)}: replayed={_replays(session)}")
    for result in runs:
        for name, want in eager.items():
            assert np.array_equal(result[name], want), name


def gather_square_model(table: np.ndarray):
    """y = table[ids] ** 2 for 5 int64 ids: a model whose runs can hit an out-of-range index."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0, name="gather"),
        helper.make_node("Mul", ["rows", "rows"], ["y"], name="square"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3])],
        initializer=[numpy_helper.from_array(table, "table")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_replay_sees_new_inputs_and_reports_bad_indices(monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    model = gather_square_model(table)
    session = Session(model, device="cuda")
    for seed in range(4):
        ids = np.random.default_rng(seed).integers(-4, 4, 5).astype(np.int64)
        np.testing.assert_array_equal(session.run({"ids": ids})["y"], table[ids] ** 2)
    assert _replays(session)
    with pytest.raises(KernelError, match="out of range"):
        session.run({"ids": np.array([0, 1, 7, 2, 3], np.int64)})


def test_a_run_that_cannot_be_recorded_stays_eager(monkeypatch):
    """Unique reads its count of values back to the host (its output's size), which a graph cannot hold."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),
        helper.make_node("Unique", ["sq"], ["values"], name="unique"),
        helper.make_node("ReduceSum", ["values"], ["total"], keepdims=0, name="total"),
        helper.make_node("Add", ["total", "x"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session, cpu = Session(model, device="cuda"), Session(model)
    for seed in range(4):
        x = np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)
        np.testing.assert_allclose(session.run({"x": x})["y"], cpu.run({"x": x})["y"], rtol=1e-5)
    assert not _replays(session)
    # The GPU still works after the failed recording.
    np.testing.assert_allclose(Session(model, device="cuda").run({"x": x})["y"], cpu.run({"x": x})["y"], rtol=1e-5)


def test_replay_of_gathergrad_over_many_positions_rezeroes_its_workspace(monkeypatch):
    """Above 32768 positions GatherGrad sorts rows in a zeroed workspace: a replay must zero it too."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    rng = np.random.default_rng(0)
    table = rng.standard_normal((97, 8)).astype(np.float32)
    weights = rng.standard_normal((40000, 8)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0, name="gather"),
        helper.make_node("Mul", ["rows", "w"], ["prod"], name="weigh"),
        helper.make_node("ReduceSum", ["prod"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [40000])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(table, "table"), numpy_helper.from_array(weights, "w")],
    )
    built = gradgen.build_backward(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), wrt=["table"]).model
    session = Session(built, device="cuda")
    for seed in range(4):
        ids = np.random.default_rng(seed).integers(-97, 97, 40000).astype(np.int64)
        want = np.zeros_like(table)
        np.add.at(want, ids, weights)
        np.testing.assert_allclose(session.run({"ids": ids})["table_grad"], want, rtol=1e-5, atol=1e-4)
    assert _replays(session)
