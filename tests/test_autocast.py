"""Mixed precision: AutocastPass's op placement, gradients against PyTorch's CPU autocast, the CPU
backend's 16-bit floats, fp16 dynamic loss scaling in the training step, training curves."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import UsageError
from gradgen.executor import Session
from gradgen.passes.autocast import METADATA_KEY, AutocastPass
from gradgen.training import SGD, AdamW, ShuffledBatches, Trainer, build_training, load_arrays
from gradgen.training.loss_scaling import LOSS_SCALING, LossScaling
from tests.model_dirs import make_samples

ROOT = Path(__file__).resolve().parent.parent
GPT = ROOT / "tests/fixtures/models/gpt2_hand_legacy"
CNN = ROOT / "tests/fixtures/models/cnn_legacy"
BF16, FP16, FP32 = ir.DataType.BFLOAT16, ir.DataType.FLOAT16, ir.DataType.FLOAT


def forward_nodes(model: ir.Model, loss: str = "loss") -> list[ir.Node]:
    """The nodes before the backward graph: those the loss depends on, and the outputs' casts."""
    nodes = list(model.graph)
    needed, seen = set(), [v for v in model.graph.outputs if not v.name.endswith("_grad")]
    while seen:
        value = seen.pop()
        node = value.producer()
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            seen.extend(v for v in node.inputs if v is not None)
    return [n for n in nodes if id(n) in needed]


def types_of(nodes, op_type: str) -> set:
    return {n.outputs[0].dtype for n in nodes if n.op_type == op_type}


@pytest.mark.parametrize("precision,low", [("bf16", BF16), ("fp16", FP16)])
def test_gpt_block_placement(precision, low):
    built = gradgen.build_backward(GPT / "model.onnx", precision=precision)
    model = built.model
    nodes = forward_nodes(model)
    # compute-bound ops in the lower precision: the Linear layers and attention's MatMuls
    assert types_of(nodes, "MatMul") == {low} and sum(n.op_type == "MatMul" for n in nodes) == 13  # 6 a block, the LM head
    # precision-sensitive ops in float32
    for op in ("Softmax", "LayerNormalization", "SoftmaxCrossEntropyLoss"):
        assert types_of(nodes, op) == {FP32}, op
    # the embedding Gather and the residual stream stay float32 (bf16 + float32 promotes)
    assert types_of(nodes, "Gather") == {FP32}
    # every lowered parameter has one Cast after it and no other consumer
    params = set(built.wrt)
    lowered = [
        v for v in model.graph.initializers.values() if v.name in params and any(u.node.op_type == "Cast" for u in v.uses())
    ]
    assert lowered
    for value in lowered:
        casts = [u.node for u in value.uses() if u.node.op_type == "Cast" and u.node.outputs[0].dtype == low]
        assert len(casts) == 1
    # interface and gradients: float32
    assert {v.name: v.dtype for v in model.graph.outputs if v.name in ("loss", "logits")} == {"loss": FP32, "logits": FP32}
    assert all(v.dtype == FP32 for v in model.graph.outputs if v.name.endswith("_grad"))
    assert model.metadata_props[METADATA_KEY] == precision
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_cnn_placement_bf16_upgrades_opset():
    built = gradgen.build_backward(CNN / "model.onnx", precision="bf16")
    model = built.model
    nodes = forward_nodes(model)
    assert model.opset_imports[""] == 22  # Conv and MaxPool take bfloat16 from opset 22
    assert types_of(nodes, "Conv") == {BF16} and types_of(nodes, "Gemm") == {BF16}
    assert types_of(nodes, "Relu") == {BF16} and types_of(nodes, "MaxPool") == {BF16}  # follow their input
    assert types_of(nodes, "SoftmaxCrossEntropyLoss") == {FP32}
    out = Session(model).run(dict(np.load(CNN / "inputs.npz")))
    assert all(out[f"{p}_grad"].dtype == np.float32 for p in built.wrt)
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def test_cnn_placement_fp16_keeps_opset():
    model = gradgen.build_backward(CNN / "model.onnx", precision="fp16").model
    assert model.opset_imports[""] == 17
    assert types_of(forward_nodes(model), "Conv") == {FP16}


def test_tf32_and_fp32_leave_the_graph():
    plain = gradgen.build_backward(GPT / "model.onnx").model
    tf32 = gradgen.build_backward(GPT / "model.onnx", precision="tf32").model
    assert [n.op_type for n in plain.graph] == [n.op_type for n in tf32.graph]
    assert tf32.metadata_props[METADATA_KEY] == "tf32" and METADATA_KEY not in plain.metadata_props
    with pytest.raises(UsageError, match="unknown precision"):
        gradgen.build_backward(GPT / "model.onnx", precision="fp8")


def _promotion_model():
    """x @ W + b (an exported Linear), times a rank-0 constant, plus a float32 residual, then Exp."""
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W"),
        onnx.numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Mul", ["hb", "half"], ["hs"]),
        helper.make_node("Add", ["hs", "x"], ["r"]),
        helper.make_node("Exp", ["r"], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_promotion_rules():
    model = gradgen.build_backward(_promotion_model(), precision="bf16").model
    by_output = {n.outputs[0].name: n for n in model.graph}
    assert by_output["h"].outputs[0].dtype == BF16
    assert by_output["hb"].outputs[0].dtype == BF16  # the Linear's bias follows the MatMul
    assert by_output["hs"].outputs[0].dtype == BF16  # a rank-0 operand follows
    assert by_output["r"].outputs[0].dtype == FP32  # bf16 + float32 residual promotes
    assert by_output["e"].outputs[0].dtype == FP32
    out = Session(model).run({"x": np.ones((2, 3, 4), np.float32)})
    assert out["W_grad"].dtype == np.float32 and out["b_grad"].dtype == np.float32


def test_cpu_backend_computes_in_float32_and_rounds():
    rng = np.random.default_rng(1)
    a, w = rng.standard_normal((8, 64)).astype(np.float32), rng.standard_normal((64, 5)).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["a"], ["ab"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
        helper.make_node("MatMul", ["ab", "wb"], ["y"]),
        helper.make_node("Exp", ["y"], ["z"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s.shape) for n, s in (("a", a), ("w", w))],
        [
            helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [8, 5]),
            helper.make_tensor_value_info("z", TensorProto.BFLOAT16, [8, 5]),
        ],
    )
    out = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).run({"a": a, "w": w})
    bf = ml_dtypes.bfloat16
    a16, w16 = a.astype(bf).astype(np.float32), w.astype(bf).astype(np.float32)
    want = (a16.astype(np.float64) @ w16.astype(np.float64)).astype(np.float32).astype(bf)
    assert out["y"].dtype == np.dtype(bf)
    # float32 accumulation of exact bf16 products, one rounding: at most one bf16 ulp from the exact sum
    assert (
        np.max(np.abs(out["y"].astype(np.float32) - want.astype(np.float32)) / np.maximum(np.abs(want.astype(np.float32)), 1e-3))
        <= 2**-7
    )
    np.testing.assert_array_equal(out["z"], np.exp(out["y"].astype(np.float32)).astype(bf))


# -- against PyTorch's autocast on the CPU ---------------------------------------------------


def _torch_module(directory: Path, cls: str):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = getattr(make_samples(), cls)()
    mapping = json.loads((directory / "meta.json").read_text())["initializer_to_torch"]
    initializers = ir.load(str(directory / "model.onnx")).graph.initializers
    params = dict(module.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for onnx_name, torch_name in mapping.items():
            params[torch_name].copy_(torch.from_numpy(initializers[onnx_name].const_value.numpy().copy()))
    return module, mapping


def _torch_grads(module, inputs, dtype):
    import torch

    module.zero_grad()
    feeds = {k: torch.from_numpy(v) for k, v in inputs.items()}
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = module(**feeds)[0]
    loss.backward()
    return {n: p.grad.double().numpy().copy() for n, p in module.named_parameters()}


@pytest.mark.parametrize("directory,cls", [(GPT, "HandGpt2"), (CNN, "LeNet")])
def test_bf16_gradients_as_accurate_as_pytorch_autocast(directory, cls):
    """Largest-element relative error of each parameter gradient against PyTorch's float32 one:
    gradgen's bf16 graph against PyTorch's own bf16 autocast, on the same inputs. Measured: LeNet
    equal to PyTorch's for every tensor; the GPT block's ratios 0.19 to 2.2 (median 1.07, sum of
    errors 1.1x PyTorch's): the two round different intermediate values."""
    import torch

    torch.set_num_threads(1)
    module, mapping = _torch_module(directory, cls)
    inputs = dict(np.load(directory / "inputs.npz"))
    reference = _torch_grads(module, inputs, None)
    theirs = _torch_grads(module, inputs, torch.bfloat16)
    ours = Session(gradgen.build_backward(directory / "model.onnx", precision="bf16").model).run(inputs)
    ours_err, theirs_err = [], []
    for onnx_name, torch_name in mapping.items():
        ref = reference[torch_name]
        scale = np.abs(ref).max()
        ours_err.append(np.abs(ours[f"{onnx_name}_grad"] - ref).max() / scale)
        theirs_err.append(np.abs(theirs[torch_name] - ref).max() / scale)
    ours_err, theirs_err = np.array(ours_err), np.array(theirs_err)
    assert np.all(ours_err < 5e-2) and np.all(ours_err > 0)  # bf16, not float32
    assert np.all(ours_err <= 3 * theirs_err)
    assert ours_err.sum() <= 1.3 * theirs_err.sum()


# -- fp16 loss scaling ------------------------------------------------------------------------


def _cnn_batches(n=40):
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal((n * 3, 1, 14, 14)).astype(np.float32), "labels": rng.integers(0, 10, n * 3)}
    return list(itertools.islice(ShuffledBatches(arrays, 3, seed=3), n))


def test_loss_scaling_skips_an_overflowing_step_and_halves_the_scale():
    program = build_training(
        ROOT / "samples/cnn/model.onnx",
        optimizer=AdamW(),
        precision="fp16",
        loss_scaling=LossScaling(init_scale=2.0**10, growth_interval=3),
    )
    trainer = Trainer(program, lr=1e-2)
    batches = _cnn_batches(8)
    trainer.fit(batches[:2], 2)
    before = trainer.state
    assert before.states[(LOSS_SCALING, "good_steps")] == 2 and before.states[(LOSS_SCALING, "updates")] == 2
    # an overflow: a scale this large makes the float16 gradients infinite
    states = dict(before.states)
    states[(LOSS_SCALING, "scale")] = np.array(3e38, np.float32)
    trainer.load_state(type(before)(before.params, states, before.step))
    result = trainer.train_step([batches[2]])
    after = trainer.state
    assert not np.isfinite(result.grad_norm) and result.skipped
    for name, value in before.params.items():
        np.testing.assert_array_equal(after.params[name], value)  # the step was skipped
    for key, value in before.states.items():
        if key[0] != LOSS_SCALING:
            np.testing.assert_array_equal(after.states[key], value)
    assert after.states[(LOSS_SCALING, "scale")] == np.float32(3e38) * np.float32(0.5)
    assert after.states[(LOSS_SCALING, "good_steps")] == 0
    assert after.states[(LOSS_SCALING, "updates")] == 2  # AdamW's step count: no update taken
    # three good steps in a row double the scale and restart the count
    states = dict(after.states)
    states[(LOSS_SCALING, "scale")] = np.array(2.0**10, np.float32)
    trainer.load_state(type(after)(after.params, states, after.step))
    for k, batch in enumerate(batches[3:6]):
        assert not trainer.train_step([batch]).skipped
        assert trainer.state.states[(LOSS_SCALING, "scale")] == (2.0**11 if k == 2 else 2.0**10)
    assert trainer.state.states[(LOSS_SCALING, "good_steps")] == 0
    assert trainer.state.states[(LOSS_SCALING, "updates")] == 5


@pytest.mark.parametrize("runner", ["host", "device"])
def test_skipped_steps_are_reported_in_progress_log_and_summary(tmp_path, runner):
    """A user training in fp16 sees the updates loss scaling skipped: in each step's result, the
    progress line, the CSV log and the run's summary."""
    import io

    from gradgen.training import DeviceStepRunner
    from gradgen.training.callbacks import CsvLog, History, Progress, read_log
    from gradgen.training.command import _summary

    program = build_training(
        ROOT / "samples/cnn/model.onnx", optimizer=AdamW(), precision="fp16", loss_scaling=LossScaling(init_scale=2.0**127)
    )
    stream, history = io.StringIO(), History()
    callbacks = [Progress(3, stream=stream, every_seconds=0.0), CsvLog(tmp_path / "log.csv"), history]
    chosen = DeviceStepRunner(program, "cpu") if runner == "device" else None
    trainer = Trainer(program, lr=1e-2, runner=chosen, callbacks=callbacks)
    results = trainer.fit(_cnn_batches(3), 3)  # 2^127 overflows float16 at every one of them
    assert [r.skipped for r in results] == [True, True, True]
    assert "3 skipped (overflow)" in stream.getvalue().splitlines()[-1]
    assert [row["skipped"] for row in read_log(tmp_path / "log.csv")] == ["1", "1", "1"]
    lines = _summary(None, history, 0, 1.0, "cpu", None, None, None)
    assert any(line.startswith("3 of them skipped by loss scaling") for line in lines)
    fine = History()
    Trainer(build_training(ROOT / "samples/cnn/model.onnx", optimizer=AdamW()), lr=1e-2, callbacks=[fine]).fit(_cnn_batches(2), 2)
    assert not any(r.skipped for r in fine.steps) and not any(
        "skipped" in line for line in _summary(None, fine, 0, 1.0, "cpu", None, None, None)
    )


def test_loss_scaling_with_accumulation_is_the_unscaled_step():
    """A power-of-two scale is exact in float32: float32 steps accumulated over 2 micro-batches with
    loss scaling equal those without, bit for bit (each micro-batch's gradients unscaled by the
    step's scale, summed, the overflow checked once at the step)."""
    cnn = ROOT / "samples/cnn/model.onnx"
    batches = _cnn_batches(8)
    plain = Trainer(build_training(cnn, optimizer=AdamW(), clip_norm=1.0, accumulation=2), lr=1e-2)
    scaled_program = build_training(cnn, optimizer=AdamW(), clip_norm=1.0, accumulation=2, loss_scaling=LossScaling())
    assert scaled_program.accumulate is not None
    assert f"{LOSS_SCALING}.scale" in [v.name for v in scaled_program.accumulate.graph.inputs]
    scaled = Trainer(scaled_program, lr=1e-2)
    assert [r.loss for r in plain.fit(batches, 4)] == [r.loss for r in scaled.fit(batches, 4)]
    for name, value in plain.params.items():
        np.testing.assert_array_equal(scaled.params[name], value)
    assert scaled.state.states[(LOSS_SCALING, "updates")] == 4


def test_an_overflow_in_the_micro_batches_skips_the_whole_step():
    program = build_training(ROOT / "samples/cnn/model.onnx", optimizer=SGD(momentum=0.9), precision="fp16", accumulation=2)
    trainer = Trainer(program, lr=1e-2)
    batches = _cnn_batches(6)
    trainer.fit(batches[:2], 1)
    before = trainer.state
    states = dict(before.states)
    states[(LOSS_SCALING, "scale")] = np.array(3e38, np.float32)  # float16 gradients overflow in both micro-batches
    trainer.load_state(type(before)(before.params, states, before.step))
    result = trainer.train_step(batches[2:4])
    after = trainer.state
    assert not np.isfinite(result.grad_norm) and np.isfinite(result.loss)
    for name, value in before.params.items():
        np.testing.assert_array_equal(after.params[name], value)
    for key, value in before.states.items():
        if key[0] != LOSS_SCALING:
            np.testing.assert_array_equal(after.states[key], value)
    assert after.states[(LOSS_SCALING, "scale")] == np.float32(3e38) * np.float32(0.5)
    assert after.states[(LOSS_SCALING, "good_steps")] == 0
    trainer.train_step(batches[4:6])  # the next step runs at the halved scale
    assert trainer.step == 3 and trainer.state.states[(LOSS_SCALING, "scale")] <= after.states[(LOSS_SCALING, "scale")]


def _curve(precision, steps, **options):
    """AdamW on the cnn sample's one batch of 3 images (the README's example: the loss falls to near 0)."""
    program = build_training(ROOT / "samples/cnn/model.onnx", optimizer=AdamW(), precision=precision, **options)
    batches = ShuffledBatches(load_arrays(ROOT / "samples/cnn/inputs.npz"), 3, seed=0)
    return np.array([r.loss for r in Trainer(program, lr=1e-2).fit(batches, steps)])


def test_bf16_and_fp16_training_track_fp32():
    """50 CPU steps of AdamW on the cnn sample: the bf16 and fp16 (loss-scaled) loss curves follow
    the float32 one step by step (measured: at most 0.013 apart for bf16, 0.0016 for fp16, while
    the loss falls from 2.75 to 0.012)."""
    fp32 = _curve("fp32", 50)
    for precision in ("bf16", "fp16"):
        curve = _curve(precision, 50)
        assert np.all(np.abs(curve - fp32) <= 0.1 * np.abs(fp32) + 0.02), precision
    assert fp32[-10:].mean() < 0.8 * fp32[:5].mean()  # it learns


def test_cli_build_backward_precision(tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    out = tmp_path / "cnn_bf16.onnx"
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", CNN / "model.onnx", "-o", out, "--precision", "bf16")
    assert code == 0, err
    assert ir.load(str(out)).metadata_props[METADATA_KEY] == "bf16"
    code, _, err = run_cli(
        capsys, monkeypatch, "build-backward", CNN / "model.onnx", "-o", tmp_path / "x.onnx", "--precision", "int8"
    )
    assert code == 2 and "unknown precision 'int8'" in err and not (tmp_path / "x.onnx").exists()


# -- BatchNormalization: a 16-bit X with float32 parameters ---------------------------------------

RESNET = ROOT / "tests/fixtures/models/resnet_block_legacy"


def test_batch_norm_after_a_conv_reads_its_output_in_float32():
    """A BatchNormalization reading a lowered Conv runs in float32 on the Conv's output cast up (the
    Cast is the Conv's only reader), with float32 parameters, and its output is cast back to bf16
    for its readers (the first Relu stays bf16)."""
    built = gradgen.build_backward(RESNET / "model.onnx", precision="bf16")
    model = built.model
    nodes = forward_nodes(model)
    norms = [n for n in nodes if n.op_type == "BatchNormalization"]
    assert len(norms) == 2
    for node in norms:
        x = node.inputs[0]
        assert x.dtype == FP32 and node.outputs[0].dtype == FP32
        assert [v.dtype for v in node.inputs[1:]] == [FP32] * 4
        cast = x.producer()
        assert cast.op_type == "Cast" and cast.inputs[0].producer().op_type == "Conv"
        assert [u.node for u in cast.inputs[0].uses()] == [cast]  # what the executors fuse
        readers = [u.node for u in node.outputs[0].uses()]
        assert [(r.op_type, r.outputs[0].dtype) for r in readers] == [("Cast", BF16)]
    first_relu = next(n for n in nodes if n.op_type == "Relu")
    assert first_relu.inputs[0].dtype == BF16 and first_relu.inputs[0].producer().op_type == "Cast"
    out = Session(model).run(dict(np.load(RESNET / "inputs.npz")))
    reference = Session(gradgen.build_backward(RESNET / "model.onnx").model).run(dict(np.load(RESNET / "inputs.npz")))
    for name in built.wrt:
        got, want = out[f"{name}_grad"], reference[f"{name}_grad"]
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 5e-2 * np.abs(want).max(), name
    onnx.checker.check_model(ir.to_proto(model), full_check=True)


def _bn_model(elem: int, training: bool, shape=(4, 3, 5, 6)):
    """loss = sum(BatchNormalization(x) * r) with x and r of type ``elem`` and float32 parameters,
    so that dY = r exactly: the gradients can be compared with the float32 graph's on the same values."""
    c = shape[1]
    rng = np.random.default_rng(7)
    params = {
        "scale": rng.uniform(0.5, 1.5, c),
        "bias": rng.standard_normal(c),
        "mean": rng.standard_normal(c) * 0.3,
        "var": rng.uniform(0.5, 2.0, c),
    }
    inits = [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in params.items()]
    outputs = ["y", "running_mean", "running_var"] if training else ["y"]
    nodes = [
        helper.make_node(
            "BatchNormalization", ["x", "scale", "bias", "mean", "var"], outputs, epsilon=1e-3, training_mode=int(training)
        ),
        helper.make_node("Mul", ["y", "r"], ["yr"]),
        helper.make_node("Cast", ["yr"], ["yr32"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["yr32"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "bn",
        [helper.make_tensor_value_info(n, elem, shape) for n in ("x", "r")],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("elem,np_type", [(TensorProto.BFLOAT16, ml_dtypes.bfloat16), (TensorProto.FLOAT16, np.float16)])
def test_mixed_batch_norm_gradients_are_the_float32_ones_rounded(training, elem, np_type):
    """The parameters' gradients of a 16-bit X with float32 parameters are computed in float32
    (the float32 graph's to float32 rounding, not 16-bit sums) and dX is the float32 dX rounded once."""
    rng = np.random.default_rng(3)
    shape = (4, 3, 5, 6)
    x, r = (rng.standard_normal(shape).astype(np_type) for _ in range(2))
    wrt = ["scale", "bias"] + ([] if training else ["mean", "var"])
    mixed = gradgen.build_backward(_bn_model(elem, training), wrt=wrt, wrt_inputs=True).model
    plain = gradgen.build_backward(_bn_model(TensorProto.FLOAT, training), wrt=wrt, wrt_inputs=True).model
    got = Session(mixed).run({"x": x, "r": r})
    want = Session(plain).run({"x": x.astype(np.float32), "r": r.astype(np.float32)})
    for name in wrt:
        assert got[f"{name}_grad"].dtype == np.float32
        ours, theirs = got[f"{name}_grad"], want[f"{name}_grad"]
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.abs(theirs).max())
    dx = got["x_grad"]
    assert dx.dtype == np.dtype(np_type)
    # one rounding of the float32 value: at most half an ulp of the 16-bit type (relative 2^-8 / 2^-11)
    half_ulp = 2.0**-8 if np_type is ml_dtypes.bfloat16 else 2.0**-11
    ref = want["x_grad"].astype(np.float64)
    tol = half_ulp * np.abs(ref) + 1e-6 * np.abs(ref).max()
    assert np.all(np.abs(dx.astype(np.float64) - ref) <= tol)


def test_bfloat16_constant_nodes_run():
    """PyTorch's CPU autocast exports hold Constant nodes of bfloat16 scalars; the Session folds them
    like any other constant (it refused them: 'constant tensors of type bfloat16 are not supported')."""
    half = onnx.numpy_helper.from_array(np.array(0.5, ml_dtypes.bfloat16), "half")
    nodes = [
        helper.make_node("Constant", [], ["c"], value=half),
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("Mul", ["xb", "c"], ["yb"]),
        helper.make_node("Cast", ["yb"], ["y"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([1.0, 2.0, -4.0], np.float32)
    assert Session(model).run({"x": x})["loss"] == np.float32(-0.5)
    out = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x})
    np.testing.assert_array_equal(out["x_grad"], np.full(3, 0.5, np.float32))


def _conv_bn_model(opset: int):
    """loss = mean(Relu(BatchNormalization(Conv(x, w)))), eval-mode BatchNormalization."""
    rng = np.random.default_rng(2)
    inits = {
        "w": rng.standard_normal((4, 3, 3, 3)) * 0.3,
        "s": rng.uniform(0.5, 1.5, 4),
        "bb": rng.standard_normal(4),
        "m": rng.standard_normal(4) * 0.1,
        "v": rng.uniform(0.5, 2.0, 4),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["y"]),
        helper.make_node("Relu", ["y"], ["r"]),
        helper.make_node("ReduceMean", ["r"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 3, 5, 5))],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def test_batch_norm_after_a_conv_below_opset_15_stays_a_float32_op():
    """Below opset 15 X and the parameters share one type: the normalization is a float32 op and
    its output stays float32 for its readers (no cast back to 16 bits)."""
    model = gradgen.build_backward(_conv_bn_model(14), precision="fp16").model
    norm = next(n for n in forward_nodes(model) if n.op_type == "BatchNormalization")
    assert norm.inputs[0].dtype == FP32 and norm.outputs[0].dtype == FP32
    assert [(u.node.op_type, u.node.outputs[0].dtype) for u in norm.outputs[0].uses()] == [("Relu", FP32)]


def test_an_untyped_output_is_cast_back_without_failing():
    """An Identity of a custom op's untyped output, a graph output declared float: autocast casts it
    back to its declared type (it used to fail on the unknown type)."""
    nodes = [helper.make_node("Foo", ["x"], ["f"], domain="com.example"), helper.make_node("Identity", ["f"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2,))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2,))],
    )
    model = ir.from_proto(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("com.example", 1)])
    )
    AutocastPass("bf16")(model)
    last = list(model.graph)[-1]
    assert last.op_type == "Cast" and model.graph.outputs[0] is last.outputs[0] and model.graph.outputs[0].name == "y"
