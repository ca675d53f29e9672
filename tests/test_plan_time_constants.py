"""A CPU Session runs, once at plan time, the steps whose inputs are all constants (a backward
graph computes some values from constants alone: a Pow gradient's log of a constant base, a
mean's scale): the run then has fewer steps and gives the same bits. Random ops, graph outputs,
large results and failing kernels stay steps of the run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import KernelError
from gradgen.executor import Session


def _model(nodes, outputs, initializers, output_shapes=None):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, (output_shapes or {}).get(name)) for name in outputs],
        [numpy_helper.from_array(np.asarray(v), name) for name, v in initializers.items()],
    )
    # shapes declared, as a built backward graph has them
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _ops(session: Session) -> list[str]:
    return [step.op_type for step in session.steps]


def test_constant_only_steps_run_at_plan_time_with_the_same_result():
    base = np.array(1.7, np.float32)
    nodes = [
        helper.make_node("Log", ["base"], ["log_base"]),
        helper.make_node("Greater", ["base", "zero"], ["positive"]),
        helper.make_node("Where", ["positive", "log_base", "zero"], ["safe_log"]),
        helper.make_node("Mul", ["x", "safe_log"], ["y"]),
    ]
    model = _model(nodes, ["y"], {"base": base, "zero": np.array(0.0, np.float32)})
    session = Session(model)
    assert _ops(session) == ["Mul"]
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    assert session.run({"x": x})["y"].tobytes() == (x * np.log(base)).tobytes()
    assert Session(model, device="cpu").run({"x": x})["y"].tobytes() == session.run({"x": x})["y"].tobytes()


def test_graph_outputs_random_ops_and_large_results_stay_steps():
    nodes = [
        helper.make_node("Exp", ["c"], ["exp_c"]),  # a graph output: produced by the run
        helper.make_node("Dropout", ["ones", "ratio", "training"], ["noise"]),  # a fresh mask every run
        helper.make_node("ConstantOfShape", ["big_shape"], ["big"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=0),
        helper.make_node("Mul", ["x", "noise"], ["y0"]),
        helper.make_node("Mul", ["y0", "total"], ["y"]),
    ]
    constants = {
        "c": np.array(0.5, np.float32),
        "big_shape": np.array([100, 100], np.int64),
        "ones": np.ones((2, 3), np.float32),
        "ratio": np.array(0.5, np.float32),
        "training": np.array(True),
    }
    session = Session(_model(nodes, ["y", "exp_c"], constants))
    assert _ops(session) == ["Exp", "Dropout", "ConstantOfShape", "ReduceSum", "Mul", "Mul"]
    x = np.ones((2, 3), np.float32)
    out = session.run({"x": x})
    assert out["exp_c"] == np.float32(np.exp(np.float32(0.5)))
    assert set(np.unique(out["y"])) <= {0.0, 20000.0}
    masks = {session.run({"x": x})["y"].tobytes() for _ in range(12)}
    assert len(masks) > 1  # drawn again on each run


def test_a_constant_step_that_fails_reports_at_run_time_naming_its_node():
    nodes = [
        helper.make_node("Gather", ["table", "bad_index"], ["row"], name="lookup"),
        helper.make_node("Mul", ["x", "row"], ["y"]),
    ]
    model = _model(nodes, ["y"], {"table": np.ones((4, 3), np.float32), "bad_index": np.array(9, np.int64)})
    session = Session(model)
    assert _ops(session) == ["Gather", "Mul"]
    with pytest.raises(KernelError, match="lookup"):
        session.run({"x": np.ones((2, 3), np.float32)})
