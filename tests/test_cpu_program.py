"""The CPU run as a prepared program (gradgen/executor/cpu_program.py): plain steps call their
kernels directly, the others go through the backend's run_step; a Session with a step observer runs
every step through the general path. Both must give the same bits, on every bundled sample's
backward graph (default and portable), and a failing step must name its node either way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import KernelError
from gradgen.executor import Session

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
