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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_accumulation_on_the_device_is_the_host_runners(device, precision, monkeypatch):
    """Three micro-batches a step, the sums kept in the accumulation Session's device state and read
    by the training Session: the host runner's losses and state bit for bit, over steps that replay
    (on the GPU, each elementwise op its own kernel, as the host runner's Session runs them); fp16
    with loss scaling (the scale fixed over a step's micro-batches). A resume continues alike."""
    monkeypatch.setenv("GRADGEN_CUDA_FUSION", "0")
    program = _mlp(accumulation=3, precision=precision)
    batches = _mlp_batches(24)
    host = Trainer(program, lr=1e-2, runner=HostStepRunner(program, device))
    runner = DeviceStepRunner(program, device)
    assert runner.accumulate is not None
    on_device = Trainer(program, lr=1e-2, runner=runner)
    assert [r.loss for r in on_device.fit(batches[:15], 5)] == [r.loss for r in host.fit(batches[:15], 5)]
    _same_state(host.state, on_device.state, 0)
    resumed = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, device))
    resumed.load_state(host.state)
    assert [r.loss for r in resumed.fit(batches[15:], 3)] == [r.loss for r in host.fit(batches[15:], 3)]
    _same_state(host.state, resumed.state, 0)
    if device == "cuda":
        assert runner.train.updates_in_place and isinstance(Trainer(program, lr=1e-2, device=device).runner, DeviceStepRunner)


def test_a_non_finite_micro_batch_changes_nothing_on_the_device_runner():
    program = _mlp(accumulation=2)
    trainer = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, "cpu"))
    batches = _mlp_batches(8)
    trainer.fit(batches[:4], 2)
    before = {k: np.array(v) for k, v in trainer.params.items()}
    bad = {"x": np.full_like(batches[4]["x"], np.nan), "target": batches[4]["target"]}
    with pytest.raises(NonFiniteLossError, match="step 3"):
        trainer.train_step([bad, batches[5]])
    for name, value in before.items():
        np.testing.assert_array_equal(trainer.params[name], value)
    trainer.train_step(batches[6:8])  # the next step restarts the sums
    assert trainer.step == 3 and all(np.isfinite(v).all() for v in trainer.params.values())


def test_reading_state_from_another_session_is_checked():
    program = _mlp(accumulation=2)
    train = Session(program.train, state=program.state_bindings())
    accumulate = Session(program.accumulate, state=dict(program.accumulated.values()))
    with pytest.raises(UsageError, match="'nope' is not an input fed"):
        accumulate.read_state_from(train, {"nope": program.params[0]})
    with pytest.raises(UsageError, match="is not bound state of the other Session"):
        accumulate.read_state_from(train, {program.params[0]: "x"})
    accumulate.read_state_from(train, {p: p for p in program.params})
    accumulate.write_state({a: np.zeros_like(program.initial_params[p]) for p, (a, _) in program.accumulated.items()})
    feeds = {**_mlp_batches(1)[0], program.accumulate_restart: np.asarray(True)}
    with pytest.raises(UsageError, match="has no state"):
        accumulate.run(feeds)
