"""State bound to a Session (``Session(model, device, state={input: output})``) and the training
runner built on it (``DeviceStepRunner``): the values after N runs, the read/write round trip, a
step whose loss is not finite leaving the state as it was; on the CPU and on the GPU."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.errors import RunError, UsageError
from gradgen.executor import Session
from gradgen.training import AdamW, DeviceStepRunner, HostStepRunner, NonFiniteLossError, ShuffledBatches, Trainer, build_training

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _accumulator():
    """total.next = total + x * scale; out = ReduceSum(total.next): one bound input, one plain output."""
    nodes = [
        helper.make_node("Mul", ["x", "scale"], ["scaled"]),
        helper.make_node("Add", ["total", "scaled"], ["total.next"]),
        helper.make_node("ReduceSum", ["total.next"], ["sum"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "accumulator",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, [2, 3]),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("total.next", TensorProto.FLOAT, [2, 3]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("device", DEVICES)
def test_bound_state_carries_over_runs_and_round_trips(device):
    rng = np.random.default_rng(0)
    start = rng.standard_normal((2, 3)).astype(np.float32)
    xs = [rng.standard_normal((2, 3)).astype(np.float32) for _ in range(6)]
    with Session(_accumulator(), device=device, state={"total": "total.next"}) as session:
        session.write_state({"total": start})
        start[0, 0] = 99.0  # the Session holds its own copy
        expected = session.read_state()["total"].astype(np.float64)
        for x in xs:  # on the GPU: an eager run, a recording, then replays
            out = session.run({"x": x, "scale": np.float32(0.5)}, outputs=["sum"])
            expected = expected + 0.5 * x
            assert out["sum"] == pytest.approx(expected.sum(), rel=1e-5)
        np.testing.assert_allclose(session.read_state()["total"], expected, rtol=1e-6)
        before = session.read_state()["total"]
        session.run({"x": xs[0], "scale": np.float32(1.0)}, outputs=["sum"], commit=lambda results: False)
        np.testing.assert_array_equal(session.read_state()["total"], before)  # not committed
        resumed = rng.standard_normal((2, 3)).astype(np.float32)
        session.write_state({"total": resumed})
        np.testing.assert_array_equal(session.read_state()["total"], resumed)
        out = session.run({"x": xs[1], "scale": np.float32(2.0)}, outputs=["sum"])
        assert out["sum"] == pytest.approx((resumed + 2 * xs[1]).sum(), rel=1e-5)  # the replay reads the new value


@pytest.mark.parametrize("device", DEVICES)
def test_bound_state_errors_are_one_line(device):
    with pytest.raises(UsageError, match="'nope' is not a graph input"):
        Session(_accumulator(), device=device, state={"nope": "total.next"})
    with pytest.raises(UsageError, match="'gone' .* is not a graph output"):
        Session(_accumulator(), device=device, state={"total": "gone"})
    session = Session(_accumulator(), device=device, state={"total": "total.next"})
    with pytest.raises(UsageError, match="write_state"):
        session.run({"x": np.zeros((2, 3), np.float32), "scale": np.float32(1)})
    with pytest.raises(RunError, match="input 'total': dimension 1 is 4"):
        session.write_state({"total": np.zeros((2, 4), np.float32)})
    with pytest.raises(RunError, match="missing input"):
        session.write_state({})
    session.write_state({"total": np.zeros((2, 3), np.float32)})
    with pytest.raises(RunError, match="unknown input name"):  # bound inputs are not fed
        session.run({"x": np.zeros((2, 3), np.float32), "scale": np.float32(1), "total": np.zeros((2, 3), np.float32)})
    session.close()


def _mlp(**options):
    return build_training(ROOT / "samples/mlp/model.onnx", optimizer=AdamW(), clip_norm=1.0, **options)


def _mlp_batches(steps: int, rng_seed: int = 1):
    rng = np.random.default_rng(rng_seed)
    arrays = {"x": rng.standard_normal((29, 6)).astype(np.float32), "target": rng.random((29, 3)).astype(np.float32)}
    return list(itertools.islice(ShuffledBatches(arrays, 4, seed=3), steps))


def _same_state(a, b, rtol: float) -> None:
    assert a.step == b.step
    for name, value in a.params.items():
        np.testing.assert_allclose(b.params[name], value, rtol=rtol, atol=rtol * np.abs(value).max(), err_msg=name)
    for key, value in a.states.items():
        np.testing.assert_allclose(b.states[key], value, rtol=rtol, atol=rtol * np.abs(value).max() + 1e-30, err_msg=str(key))


@pytest.mark.parametrize("device", DEVICES)
def test_device_runner_matches_the_host_runner(device):
    """Twenty AdamW steps with clipping: same losses and final state as the host runner on the CPU
    (bit for bit on the CPU, float32 rounding on the GPU); a resume from a snapshot continues alike."""
    program, batches = _mlp(), _mlp_batches(20)
    host = Trainer(program, lr=1e-2, runner=HostStepRunner(program))
    device_trainer = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, device))
    assert device_trainer.runner.device == device
    host_losses = [r.loss for r in host.fit(batches[:12], 12)]
    device_losses = [r.loss for r in device_trainer.fit(batches[:12], 12)]
    exact = device == "cpu"
    (np.testing.assert_array_equal if exact else lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5))(
        device_losses, host_losses
    )
    _same_state(host.state, device_trainer.state, 0 if exact else 1e-5)
    assert device_trainer.evaluate(batches[:2]) == pytest.approx(host.evaluate(batches[:2]), rel=1e-5)

    resumed = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, device))
    resumed.load_state(host.state)
    rest = [r.loss for r in resumed.fit(batches[12:], 8)]
    np.testing.assert_allclose(rest, [r.loss for r in host.fit(batches[12:], 8)], rtol=0 if exact else 1e-5)
    _same_state(host.state, resumed.state, 0 if exact else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_step_leaves_the_device_state_as_it_was(device):
    program, batches = _mlp(), _mlp_batches(4)
    trainer = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, device))
    trainer.fit(batches[:3], 3)
    before = trainer.state
    before_params = {k: np.array(v) for k, v in before.params.items()}
    before_states = {k: np.array(v) for k, v in before.states.items()}
    bad = {"x": np.full_like(batches[3]["x"], np.nan), "target": batches[3]["target"]}
    with pytest.raises(NonFiniteLossError, match="step 4: the loss is nan"):
        trainer.train_step([bad])
    assert trainer.step == 3
    for name, value in before_params.items():
        np.testing.assert_array_equal(trainer.params[name], value)
    for key, value in before_states.items():
        np.testing.assert_array_equal(trainer.state.states[key], value)
    trainer.train_step([batches[3]])  # and training goes on from there
    assert trainer.step == 4


def test_accumulation_stays_on_the_host_runner():
    program = _mlp(accumulation=2)
    with pytest.raises(UsageError, match="accumulation"):
        DeviceStepRunner(program, "cpu")
    assert isinstance(Trainer(program, lr=1e-2, device="cpu").runner, HostStepRunner)
