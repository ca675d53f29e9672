"""The training program, the Trainer API, the data order, schedules and checkpoints (Python API)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from gradgen.errors import RunError, UsageError
from gradgen.training import (
    SGD,
    AdamW,
    Callback,
    NonFiniteLossError,
    Schedule,
    ShuffledBatches,
    Trainer,
    build_training,
    check_arrays,
    load_checkpoint,
    save_checkpoint,
)
from gradgen.training.checkpoint import check_checkpoint

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "samples" / "mlp" / "model.onnx"
CNN = ROOT / "samples" / "cnn" / "model.onnx"


def mlp_arrays(n=20, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32), "target": rng.random((n, 3)).astype(np.float32)}


@pytest.fixture(scope="module")
def mlp_adamw():
    return build_training(MLP, optimizer=AdamW(), clip_norm=1.0)


def test_training_graph_is_standard_onnx_that_onnxruntime_runs(mlp_adamw):
    """With portable=True the whole step (forward, backward, clipping, AdamW) is in standard ops:
    stock onnxruntime runs it and computes what gradgen's executor computes. (The default graph
    holds ONNX Runtime training's gradient ops, ReluGrad and SoftmaxCrossEntropyLossGrad here.)"""
    ort = pytest.importorskip("onnxruntime")
    assert {n.domain for n in mlp_adamw.train.graph} > {""}
    mlp_adamw = build_training(MLP, optimizer=AdamW(), clip_norm=1.0, portable=True)
    proto = ir.to_proto(mlp_adamw.train)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    feeds = {k: v[:4] for k, v in mlp_arrays().items()}
    feeds.update(mlp_adamw.initial_params)
    feeds.update({s.input: np.full_like(mlp_adamw.initial_params[s.param], 0.01) for s in mlp_adamw.layout.states})
    feeds.update({mlp_adamw.layout.lr: np.array(1e-2, np.float32), mlp_adamw.layout.step: np.array(3, np.int64)})
    from gradgen.executor import Session

    ours = Session(mlp_adamw.train).run(feeds)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert set(theirs) == set(ours)
    for name, value in ours.items():
        np.testing.assert_allclose(value, theirs[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_layout_names_every_state_once(mlp_adamw):
    program = mlp_adamw
    bindings = program.state_bindings()
    assert set(program.params) <= set(bindings)
    assert len(bindings) == len(program.params) * 3  # parameter, exp_avg, exp_avg_sq
    graph_inputs = {v.name for v in program.train.graph.inputs}
    graph_outputs = {v.name for v in program.train.graph.outputs}
    assert set(bindings) <= graph_inputs and set(bindings.values()) <= graph_outputs
    assert program.data_names == ["x", "target"]
    assert program.layout.params["fc1.weight"] == "fc1.weight.next"


def test_next_names_never_collide(tmp_path):
    """A model that already has a tensor called like an update output gets a suffixed name."""
    model = ir.load(str(MLP))
    node = next(n for n in model.graph if n.op_type == "Relu")
    node.outputs[0].name = "fc1.weight.next"
    program = build_training(model, optimizer=SGD(momentum=0.5))
    assert program.layout.params["fc1.weight"] != "fc1.weight.next"
    trainer = Trainer(program, lr=0.1)
    trainer.fit(ShuffledBatches(mlp_arrays(), 4, seed=0), 2)
    assert trainer.step == 2


def test_trainer_takes_a_torch_dataloader_and_calls_back():
    torch = pytest.importorskip("torch")
    arrays = mlp_arrays(16)

    class Dicts(torch.utils.data.Dataset):
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return {k: torch.from_numpy(v[i]) for k, v in arrays.items()}

    loader = torch.utils.data.DataLoader(Dicts(), batch_size=4, shuffle=False)

    class Count(Callback):
        def __init__(self):
            self.calls = []

        def on_train_begin(self, trainer):
            self.calls.append("begin")

        def on_step_end(self, trainer, result):
            self.calls.append(result.step)

        def on_evaluate(self, trainer, step, loss):
            self.calls.append(("eval", step))

        def on_train_end(self, trainer):
            self.calls.append("end")

    count = Count()
    program = build_training(MLP, optimizer=SGD(momentum=0.9))
    trainer = Trainer(program, lr=0.1, callbacks=[count])
    eval_batches = [{k: v[:4] for k, v in arrays.items()}]
    from_torch = trainer.fit(loader, steps=10, eval_batches=eval_batches, eval_every=2)
    assert count.calls == ["begin", 1, 2, ("eval", 2), 3, 4, ("eval", 4), "end"]  # the loader ran out at 4
    numpy_batches = [{k: v[i : i + 4] for k, v in arrays.items()} for i in range(0, 16, 4)]
    again = Trainer(program, lr=0.1).fit(numpy_batches, steps=4)
    assert [r.loss for r in from_torch] == [r.loss for r in again]


def test_bad_batches_and_non_finite_losses_keep_the_last_good_state(mlp_adamw):
    trainer = Trainer(mlp_adamw, lr=1e-2)
    batch = {k: v[:4] for k, v in mlp_arrays().items()}
    with pytest.raises(RunError, match=r"missing 'target'; unknown 'y'"):
        trainer.train_step([{"x": batch["x"], "y": batch["target"]}])
    with pytest.raises(RunError, match="input 'x'"):
        trainer.train_step([{"x": batch["x"][:3], "target": batch["target"]}])
    trainer.train_step([batch])
    good = trainer.state
    poisoned = dict(batch, x=np.where(np.arange(6) == 2, np.nan, batch["x"]).astype(np.float32))
    with pytest.raises(NonFiniteLossError, match="step 2: the loss is nan"):
        trainer.train_step([poisoned])
    assert trainer.state is good and trainer.step == 1
    assert all(np.isfinite(v).all() for v in trainer.params.values())


def test_shuffled_batches_resume_anywhere_and_cover_each_epoch():
    arrays = {"a": np.arange(10)[:, None], "b": np.arange(10) * 2}
    fresh = list(itertools.islice(ShuffledBatches(arrays, 3, seed=4), 9))
    resumed = list(itertools.islice(ShuffledBatches(arrays, 3, seed=4, start=5), 4))
    for x, y in zip(fresh[5:], resumed):
        assert np.array_equal(x["a"], y["a"]) and np.array_equal(x["b"], y["b"])
    for epoch in range(3):  # 3 full batches an epoch, no repeated sample within one
        rows = np.concatenate([b["a"][:, 0] for b in fresh[epoch * 3 : (epoch + 1) * 3]])
        assert len(set(rows)) == 9
        assert all(np.array_equal(b["b"], b["a"][:, 0] * 2) for b in fresh)
    other = list(itertools.islice(ShuffledBatches(arrays, 3, seed=5), 3))
    assert not all(np.array_equal(x["a"], y["a"]) for x, y in zip(fresh, other))


def test_check_arrays_errors_name_the_input():
    program = build_training(CNN, optimizer=SGD())
    arrays = {"x": np.zeros((6, 1, 14, 14), np.float32), "labels": np.zeros(6, np.int64)}
    check_arrays(arrays, program.data_inputs, 3)
    cases = [
        ({"x": arrays["x"]}, 3, "no array for input(s) 'labels'"),
        (dict(arrays, extra=arrays["labels"]), 3, "'extra' name no data input"),
        (dict(arrays, x=np.zeros((6, 1, 12, 14), np.float32)), 3, "array 'x' has samples of shape [1, 12, 14]"),
        (dict(arrays, labels=np.zeros(6, np.int32)), 3, "array 'labels' is int32"),
        (arrays, 4, "use --batch-size 3"),
    ]
    for bad, batch_size, words in cases:
        with pytest.raises(RunError) as info:
            check_arrays(bad, program.data_inputs, batch_size)
        assert words in str(info.value), str(info.value)


def test_schedules():
    constant = Schedule("constant", lr=0.1, warmup_steps=4)
    assert [constant(s) for s in (1, 2, 4, 5, 100)] == pytest.approx([0.025, 0.05, 0.1, 0.1, 0.1])
    linear = Schedule("linear", lr=1.0, warmup_steps=10, total_steps=110, min_lr=0.1)
    assert linear(10) == 1.0 and linear(60) == pytest.approx(0.55) and linear(110) == pytest.approx(0.1)
    assert linear(500) == pytest.approx(0.1)
    cosine = Schedule("cosine", lr=1.0, total_steps=100)
    assert cosine(50) == pytest.approx(0.5) and cosine(100) == pytest.approx(0.0, abs=1e-12)
    values = [cosine(s) for s in range(1, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert cosine(25) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    for kwargs, words in [
        ({"kind": "step"}, "unknown schedule"),
        ({"lr": 0.0}, "learning rate"),
        ({"kind": "cosine", "warmup_steps": 5, "total_steps": 5}, "greater than the warm-up"),
        ({"min_lr": 2.0, "lr": 1.0}, "minimum learning rate"),
    ]:
        with pytest.raises(UsageError, match=words):
            Schedule(**kwargs)


def test_optimizer_options_are_checked():
    with pytest.raises(UsageError, match="momentum 1.5"):
        SGD(momentum=1.5)
    with pytest.raises(UsageError, match="Nesterov"):
        SGD(nesterov=True)
    with pytest.raises(UsageError, match="betas"):
        AdamW(betas=(0.9, 1.0))
    with pytest.raises(UsageError, match="accumulation"):
        build_training(MLP, optimizer=SGD(), accumulation=0)
    with pytest.raises(UsageError, match="clip norm"):
        build_training(MLP, optimizer=SGD(), clip_norm=0.0)


def test_checkpoint_round_trip_and_fingerprint(tmp_path, mlp_adamw):
    trainer = Trainer(mlp_adamw, lr=1e-2)
    trainer.fit(ShuffledBatches(mlp_arrays(), 4, seed=0), 3)
    path = save_checkpoint(tmp_path / "c.npz", mlp_adamw, trainer.state, {"data": {"seed": 0}})
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left
    state, meta = load_checkpoint(path)
    assert state.step == 3 and meta["data"] == {"seed": 0} and meta["optimizer"] == "adamw"
    for name, value in trainer.params.items():
        assert np.array_equal(state.params[name], value)
    for key, value in trainer.state.states.items():
        assert np.array_equal(state.states[key], value)
    check_checkpoint(path, meta, state, mlp_adamw)
    other = build_training(CNN, optimizer=AdamW())
    with pytest.raises(UsageError, match="from another model"):
        check_checkpoint(path, meta, state, other)
    sgd = build_training(MLP, optimizer=SGD(momentum=0.9))
    with pytest.raises(UsageError, match="holds adamw state; this run uses sgd"):
        check_checkpoint(path, meta, state, sgd)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="not a gradgen checkpoint"):
        load_checkpoint(tmp_path / "junk.npz")


def test_batch_norm_running_statistics_are_not_trained():
    fixture = ROOT / "tests" / "fixtures" / "models" / "resnet_block_legacy" / "model.onnx"
    model = ir.load(str(fixture))
    stats = [v.name for n in model.graph if n.op_type == "BatchNormalization" for v in n.inputs[3:5]]
    assert stats
    program = build_training(fixture, optimizer=SGD())
    assert not set(stats) & set(program.params)
    assert set(stats) <= set(program.frozen)


def test_resuming_a_log_written_before_the_skipped_column(tmp_path):
    """A CSV log from before the ``skipped`` column resumes into the current columns: its kept rows
    read as not skipped, the later ones are dropped."""
    from gradgen.training.callbacks import CSV_COLUMNS, CsvLog, read_log
    from gradgen.training.trainer import StepResult

    path = tmp_path / "log.csv"
    path.write_text("step,loss,lr,grad_norm,eval_loss\n1,2.5,0.01,1.0,\n2,2.25,0.01,0.5,2.0\n3,2.0,0.01,0.5,\n")
    log = CsvLog(path, start_step=2)
    log.on_step_end(None, StepResult(3, 1.5, 0.01, float("inf"), 0.1, skipped=True))
    log.close()
    rows = read_log(path)
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [(r["step"], r["eval_loss"], r["skipped"]) for r in rows] == [("1", "", "0"), ("2", "2.0", "0"), ("3", "", "1")]


def test_training_mode_batch_norm_running_statistics_are_step_state_unless_shared():
    """A training-mode BatchNormalization's running statistics become step state (updated, not
    trained). Two nodes sharing them leave no single next value: those stay as exported, and
    build_training says so (a warning, which the CLI prints as a note). Eval mode updates nothing."""
    import warnings

    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), name) for name in ("scale", "bias", "mean")] + [
        numpy_helper.from_array(np.ones(3, np.float32), "var")
    ]

    def model(training: int, shared: bool = False):
        outputs = ["y", "rm", "rv"] if training else ["y"]
        nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], outputs, training_mode=training)]
        if shared:
            nodes.append(helper.make_node("BatchNormalization", ["y", "scale", "bias", "mean", "var"], ["y2"], training_mode=1))
        nodes.append(helper.make_node("ReduceSumSquare", ["y2" if shared else "y"], ["loss"], keepdims=0))
        graph = helper.make_graph(
            nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 2, 2])],
            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
        )  # fmt: skip
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = build_training(model(1), optimizer=SGD())
        assert program.running_statistics_updated == ["mean", "var"]
        assert not {"mean", "var"} & set(program.params)
        assert program.layout.params["mean"] in [v.name for v in program.train.graph.outputs]
        eval_mode = build_training(model(0), optimizer=SGD())
        assert eval_mode.running_statistics_updated == []
    with pytest.warns(UserWarning, match=r"2 BatchNormalization node\(s\) run in training mode .* does not update"):
        shared = build_training(model(1, shared=True), optimizer=SGD())
    assert shared.running_statistics_updated == []
    assert {"mean", "var"} <= set(shared.frozen)


def test_evaluation_runs_dropout_in_inference_mode():
    """A model exported in training mode drops activations in its steps; Trainer.evaluate, as
    PyTorch's eval(), does not: its loss is the loss without dropout, the same at every call."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.full(4, 0.5, np.float32), "w"),
        numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
        numpy_helper.from_array(np.array(True), "training"),
    ]
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Dropout", ["h", "ratio", "training"], ["d"]),
        helper.make_node("ReduceSumSquare", ["d"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )  # fmt: skip
    program = build_training(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), optimizer=SGD())
    trainer = Trainer(program, lr=1e-3)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    losses = {trainer.evaluate([{"x": x}]) for _ in range(3)}
    assert len(losses) == 1
    np.testing.assert_allclose(losses.pop(), float(np.sum((x * 0.5) ** 2)), rtol=1e-6)
    step_loss = trainer.train_step([{"x": x}]).loss  # the step drops (and rescales) half the values
    assert abs(step_loss - float(np.sum((x * 0.5) ** 2))) > 1e-3
