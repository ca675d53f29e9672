"""Session.profile / `gradgen run --profile`: every CPU step timed, summed by op type; a GPU Session
or a bad run count is a one-line usage error."""

from __future__ import annotations

import gc
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import UsageError
from gradgen.executor import Session
from gradgen.executor.profile import format_profile
from tests.test_cli import run_cli

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "transformer"


def _sample():
    session = Session(gradgen.build_backward(str(SAMPLE / "model.onnx")).model)
    feeds = {k: v for k, v in np.load(SAMPLE / "inputs.npz").items() if k in session.input_names}
    return session, feeds


def test_every_step_is_timed_once_and_summed_by_op():
    session, feeds = _sample()
    want = session.run(feeds)
    profile = session.profile(feeds, runs=2)
    assert [(s.node_name, s.op_type) for s in profile.steps] == [(s.node_name, s.op_type) for s in session.steps]
    assert all(s.seconds >= 0 for s in profile.steps) and profile.run_seconds > 0
    by_op = profile.by_op()
    assert Counter({op: n for op, n, _ in by_op}) == Counter(s.op_type for s in session.steps)
    assert [seconds for *_, seconds in by_op] == sorted((seconds for *_, seconds in by_op), reverse=True)
    assert session.step_observer is None  # the observer is taken off again
    got = session.run(feeds)
    assert all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_a_slow_step_is_where_the_time_goes(monkeypatch):
    """A kernel made to sleep 100 ms is the slowest step and its op takes most of the time (long
    enough that a busy machine descheduling another step cannot outweigh it)."""
    session, feeds = _sample()
    target = next(s for s in session.steps if s.op_type == "LayerNormalizationGrad")
    call = target.call

    def slow(*args):
        time.sleep(0.1)
        return call(*args)

    monkeypatch.setattr(target, "call", slow)
    session._observed_program = None
    # the cycle collector off: once, in a full test run, a Transpose step came out slower than the
    # 100 ms sleep; a full collection in a long test worker is the likely cause
    gc.disable()
    try:
        profile = session.profile(feeds, runs=1)
    finally:
        gc.enable()
    assert profile.slowest(1)[0].node_name == target.node_name and profile.slowest(1)[0].seconds >= 0.1
    assert profile.by_op()[0][0] == "LayerNormalizationGrad"
    lines = format_profile(profile, top=3).splitlines()
    assert "LayerNormalizationGrad" in lines[2]
    slowest = lines[lines.index("slowest 3 step(s):") + 1 :]
    assert len(slowest) == 3 and target.node_name in slowest[0]


def test_profiling_needs_a_cpu_session_and_a_run(monkeypatch):
    session, feeds = _sample()
    with pytest.raises(UsageError, match="runs must be at least 1"):
        session.profile(feeds, runs=0)
    monkeypatch.setattr(session, "updates_in_place", True)  # a fused optimizer update: each run is a step
    with pytest.raises(UsageError, match="updates its state in place"):
        session.profile(feeds)
    monkeypatch.setattr(session, "updates_in_place", False)
    monkeypatch.setattr(session, "device", "cuda")
    with pytest.raises(UsageError, match="CPU executor.*--device cpu"):
        session.profile(feeds)


def test_cli_run_profile(capsys, monkeypatch, tmp_path):
    built = tmp_path / "grad.onnx"
    assert run_cli(capsys, monkeypatch, "build-backward", SAMPLE / "model.onnx", "-o", built)[0] == 0
    code, out, err = run_cli(capsys, monkeypatch, "run", built, "--inputs", SAMPLE / "inputs.npz", "--profile", "--device", "cpu")
    assert code == 0, err
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("time by op"))
    shares = [float(line.split()[-1].rstrip("%")) for line in lines[start + 2 :] if line.endswith("%")]
    assert shares and abs(sum(shares) - 100) < 1.0
    assert any(line.startswith("slowest 10 step(s):") for line in lines)


def test_cli_profile_on_a_gpu_is_a_usage_error(capsys, monkeypatch, tmp_path):
    """Without a GPU the device check comes first; with one, the profile refuses before running."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    path = tmp_path / "relu.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())
    original = Session.__init__

    def on_cuda(self, *args, **kwargs):
        kwargs["device"] = "cpu"
        original(self, *args, **kwargs)
        self.device = "cuda"

    monkeypatch.setattr(Session, "__init__", on_cuda)
    code, out, err = run_cli(capsys, monkeypatch, "run", path, "--random-inputs", "--profile")
    assert code == 2 and err.startswith("error: ") and "CPU executor" in err and "Traceback" not in err
    assert "time by op" not in out and "ran on" not in out


def test_bound_state_is_left_as_it_was():
    """A Session whose output feeds its input back (a training step's state): profiling runs it
    several times but commits none of them."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["count", "one"], ["next"])],
        "counter",
        [helper.make_tensor_value_info("count", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("next", TensorProto.FLOAT, [1])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])],
    )
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), state={"count": "next"})
    session.write_state({"count": np.zeros(1, np.float32)})
    profile = session.profile({}, runs=2)
    assert [s.op_type for s in profile.steps] == ["Add"]
    assert session.run({})["next"][0] == 1.0  # the first committed step
