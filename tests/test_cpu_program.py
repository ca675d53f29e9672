"""The CPU run as a prepared program (gradgen/executor/cpu_program.py): plain steps call their
kernels directly, the others go through the backend's run_step; a Session with a step observer runs
every step through the general path. Both must give the same bits, on every bundled sample's
backward graph (default and portable), and a failing step must name its node either way."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import GradgenError, KernelError
from gradgen.executor import Session, cpu_program

SAMPLES = sorted(Path(__file__).resolve().parent.parent.joinpath("samples").glob("*/model.onnx"))


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.parent.name)
@pytest.mark.parametrize("portable", [False, True], ids=["default", "portable"])
def test_the_program_and_the_observed_run_give_the_same_bits(path, portable):
    session = Session(gradgen.build_backward(str(path), portable=portable).model)
    feeds = {k: v for k, v in np.load(path.parent / "inputs.npz").items() if k in session.input_names}
    plain = session.run(feeds)
    seen = []
    session.step_observer = lambda step, args, result: seen.append(step.op_type)
    observed = session.run(feeds)
    assert len(seen) == len(session.steps)
    assert plain.keys() == observed.keys()
    for name in plain:
        assert plain[name].dtype == observed[name].dtype and plain[name].tobytes() == observed[name].tobytes(), name


def test_a_failing_step_names_its_node_in_both_runs():
    nodes = [helper.make_node("Gather", ["table", "i"], ["row"], name="lookup"), helper.make_node("Relu", ["row"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("table", TensorProto.FLOAT, [3, 2]),
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    feeds = {"table": np.ones((3, 2), np.float32), "i": np.array(7, np.int64)}
    with pytest.raises(KernelError, match="lookup"):
        session.run(feeds)
    session.step_observer = lambda *_: None
    with pytest.raises(KernelError, match="lookup"):
        session.run(feeds)


def _one_op_model(nodes, inputs, outputs):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.fixture
def straight_at_once(monkeypatch):
    """Programs compiled into their straight-line function at their first run."""
    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_AFTER_RUNS", 0)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.parent.name)
def test_the_straight_line_program_and_the_runners_give_the_same_bits(path, monkeypatch, straight_at_once):
    model = gradgen.build_backward(str(path), portable=True).model
    straight = Session(model)
    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_MAX_STEPS", 0)
    runners = Session(model)
    feeds = {k: v for k, v in np.load(path.parent / "inputs.npz").items() if k in straight.input_names}
    for _ in range(2):  # the second run reuses what the first prepared
        a, b = straight.run(feeds), runners.run(feeds)
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    assert straight._program._straight is not None  # small programs run as one generated function
    assert runners._program._straight is None


def test_a_program_runs_as_closures_until_its_straight_line_run(monkeypatch):
    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_AFTER_RUNS", 2)
    path = SAMPLES[0]
    session = Session(gradgen.build_backward(str(path), portable=True).model)
    feeds = {k: v for k, v in np.load(path.parent / "inputs.npz").items() if k in session.input_names}
    results = []
    for run in range(4):
        results.append(session.run(feeds))
        assert (session._program._straight is not None) == (run >= 2), run  # compiled at the third run
    for later in results[1:]:
        assert all(later[name].tobytes() == results[0][name].tobytes() for name in results[0])


def test_the_straight_line_program_fills_several_outputs_and_drops_unread_ones(straight_at_once):
    nodes = [
        helper.make_node("TopK", ["x", "k"], ["top", ""], axis=-1),  # indices not asked for
        helper.make_node("Split", ["x"], ["left", "right"], axis=1, num_outputs=2),
        helper.make_node("Add", ["top", "left"], ["y"]),
        helper.make_node("Identity", ["right"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "z")],
        initializer=[helper.make_tensor("k", TensorProto.INT64, [1], [2])],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    x = np.array([[4, 1, 3, 2], [0, 7, 5, 6]], np.float32)
    out = session.run({"x": x})
    assert session._program._straight is not None
    np.testing.assert_array_equal(out["y"], np.sort(x, axis=1)[:, ::-1][:, :2] + x[:, :2])
    np.testing.assert_array_equal(out["z"], x[:, 2:])


def test_the_straight_line_program_reports_a_failure_with_the_node_and_its_inputs(straight_at_once):
    nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "b"], ["y"], name="product")]
    session = Session(_one_op_model(nodes, [("a", None), ("b", None)], ["y"]))
    with pytest.raises(GradgenError, match=r"node 'product' \(MatMul\): inner dimensions differ"):
        session.run({"a": np.ones((2, 3), np.float32), "b": np.ones((4, 5), np.float32)})
    assert session._program._straight is not None
    out = session.run({"a": -np.ones((2, 3), np.float32), "b": np.ones((3, 5), np.float32)})  # and runs on after
    np.testing.assert_array_equal(out["y"], np.zeros((2, 5), np.float32))

    def broken(*args):
        raise ValueError("a kernel's own bug")

    session.steps[1].call = broken  # an unexpected exception: the message lists the inputs alive at the step
    session._program = session._cpu_program()
    with pytest.raises(GradgenError, match=r"node 'product' \(MatMul\) failed on inputs \(float32\[2, 3\], float32\[3, 5\]\)"):
        session.run({"a": np.ones((2, 3), np.float32), "b": np.ones((3, 5), np.float32)})


@pytest.fixture
def no_cyclic_collection():
    """What dies here dies by reference counting, as it does between a training loop's collections."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("straight_after_runs", [0, 1000], ids=["straight-line", "closures"])
def test_a_dropped_session_frees_its_weights_at_once(monkeypatch, no_cyclic_collection, straight_after_runs):
    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_AFTER_RUNS", straight_after_runs)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.ones((64, 64), np.float32), "w")],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    session.run({"x": np.ones((2, 64), np.float32)})
    assert (session._program._straight is not None) == (straight_after_runs == 0)
    weight = weakref.ref(session.constants["w"])
    del session
    assert weight() is None


@pytest.mark.parametrize("straight_after_runs", [0, 1000], ids=["straight-line", "closures"])
def test_a_failed_run_frees_its_arrays_with_the_error(monkeypatch, no_cyclic_collection, straight_after_runs):
    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_AFTER_RUNS", straight_after_runs)
    nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "b"], ["y"], name="product")]
    session = Session(_one_op_model(nodes, [("a", None), ("b", None)], ["y"]))
    seen = []

    def broken(a, b):
        seen.append(weakref.ref(a))
        raise ValueError("a kernel's own bug")

    session.steps[1].call = broken
    session._program = session._cpu_program()
    with pytest.raises(GradgenError, match="product"):
        session.run({"a": np.ones((20, 30), np.float32), "b": np.ones((30, 5), np.float32)})
    assert seen[0]() is None  # the Relu's result, alive at the failing step


def test_a_model_without_value_info_runs_its_steps_as_plain_calls():
    """Untyped intermediates made every step check its arguments for 16-bit floats on every run
    (the general path, 1.2 against 0.5 us a step on small tensors); the Session reads their types
    from ONNX's inference, leaving the model as it is."""
    import onnx_ir as ir

    nodes = [helper.make_node("Mul", ["x", "w"], ["m0"]), helper.make_node("Mul", ["m0", "w"], ["m1"])]
    nodes.append(helper.make_node("Add", ["m1", "x"], ["y"]))
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [2, 3]) for n in ("x", "w")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", f, [2, 3])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    session = Session(model)
    assert not any(step.may_read_low_precision for step in session.steps)
    assert all(v.type is None for node in model.graph for v in node.outputs if v.name != "y"), "the caller's model changed"
    x, w = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 1.5, np.float32)
    np.testing.assert_array_equal(session.run({"x": x, "w": w})["y"], x * w * w + x)
