"""The fused multi-tensor optimizer update on the GPU (gradgen/executor/fused_optimizer.py): bit for
bit the unfused standard-op update (GRADGEN_CUDA_FUSED_OPTIMIZER=0) over several steps, for AdamW
and SGD with their options; PyTorch's AdamW on a model of more parameters than one launch takes;
a step whose loss is not finite changes nothing."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import UsageError
from gradgen.executor import fused_optimizer as fo
from gradgen.training import SGD, AdamW, DeviceStepRunner, NonFiniteLossError, ShuffledBatches, Trainer, build_training

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]
OPTIMIZERS = [
    (AdamW(), 1.0),
    (AdamW(weight_decay=0.0, bias_correction=False, betas=(0.8, 0.99), eps=1e-6), None),
    (SGD(momentum=0.9, nesterov=True, weight_decay=0.1), 1.0),
    (SGD(momentum=0.5), None),
    (SGD(weight_decay=0.01), 0.5),
]


def _mlp_batches(steps: int):
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal((29, 6)).astype(np.float32), "target": rng.random((29, 3)).astype(np.float32)}
    return list(itertools.islice(ShuffledBatches(arrays, 4, seed=3), steps))


def _train(program, batches, fused: bool, monkeypatch, lr=1e-2):
    """Train on the GPU with the fused update or the standard-op one, each elementwise op its own
    kernel (pointwise fusion, bit-exact with those kernels, is tested on its own)."""
    monkeypatch.setenv(fo.ENV, "1" if fused else "0")
    monkeypatch.setenv("GRADGEN_CUDA_FUSION", "0")
    trainer = Trainer(program, lr=lr, runner=DeviceStepRunner(program, "cuda"))
    assert trainer.runner.train.updates_in_place == fused
    losses = [r.loss for r in trainer.fit(batches, len(batches))]
    return trainer, losses


def _assert_same_state(a, b) -> None:
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value, err_msg=name)
    for key, value in a.states.items():
        np.testing.assert_array_equal(b.states[key], value, err_msg=str(key))


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_fused_update_is_the_unfused_one_bit_for_bit(optimizer, clip, monkeypatch):
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=optimizer, clip_norm=clip)
    batches = _mlp_batches(8)  # an eager run, a recording, then replays
    fused, fused_losses = _train(program, batches, True, monkeypatch)
    plain, plain_losses = _train(program, batches, False, monkeypatch)
    assert fused_losses == plain_losses
    _assert_same_state(plain.state, fused.state)
    assert fused.step == plain.step == 8


SIZES = [3 * fo.CHUNK + 5, fo.CHUNK + 1, 1, *([37] * 67)]  # 70 parameters: two launches


def _many_params_model():
    """loss = sum_i sum((w_i - x_i)^2): one parameter per entry of SIZES, chunks across blocks."""
    rng = np.random.default_rng(0)
    nodes, inputs, inits, terms = [], [], [], []
    for i, n in enumerate(SIZES):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [n]))
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("Sub", [f"w{i}", f"x{i}"], [f"d{i}"]))
        nodes.append(helper.make_node("ReduceSumSquare", [f"d{i}"], [f"s{i}"], keepdims=0))
        terms.append(f"s{i}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(nodes, "many", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _many_batches(steps: int):
    rng = np.random.default_rng(5)
    return [{f"x{i}": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(SIZES)} for _ in range(steps)]


def test_many_parameters_match_the_unfused_update_and_pytorch(monkeypatch):
    torch = pytest.importorskip("torch")
    model = _many_params_model()
    program = build_training(model, optimizer=AdamW(), clip_norm=1.0)
    batches = _many_batches(6)
    fused, fused_losses = _train(program, batches, True, monkeypatch, lr=1e-3)
    plain, plain_losses = _train(program, batches, False, monkeypatch, lr=1e-3)
    assert fused_losses == plain_losses
    _assert_same_state(plain.state, fused.state)

    weights = {init.name: torch.tensor(numpy_helper.to_array(init)) for init in model.graph.initializer}
    params = [torch.nn.Parameter(weights[f"w{i}"].clone()) for i in range(len(SIZES))]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    torch_losses = []
    for batch in batches:
        opt.zero_grad()
        loss = sum(((p - torch.tensor(batch[f"x{i}"])) ** 2).sum() for i, p in enumerate(params))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        torch_losses.append(float(loss))
    np.testing.assert_allclose(fused_losses, torch_losses, rtol=1e-5)
    for i, p in enumerate(params):
        np.testing.assert_allclose(fused.state.params[f"w{i}"], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"w{i}")


def test_a_non_finite_step_changes_nothing_in_place(monkeypatch):
    monkeypatch.setenv(fo.ENV, "1")
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=AdamW(), clip_norm=1.0)
    batches = _mlp_batches(5)
    trainer = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, "cuda"))
    assert trainer.runner.train.updates_in_place
    trainer.fit(batches[:3], 3)  # eager, recorded, replayed: the next steps replay the CUDA graph
    before = trainer.state
    params = {k: np.array(v) for k, v in before.params.items()}
    states = {k: np.array(v) for k, v in before.states.items()}
    for bad_value in (np.nan, np.inf):
        bad = {"x": np.full_like(batches[3]["x"], bad_value), "target": batches[3]["target"]}
        with pytest.raises(NonFiniteLossError, match="step 4"):
            trainer.train_step([bad])
        assert trainer.step == 3
        for name, value in params.items():
            np.testing.assert_array_equal(trainer.params[name], value)
        for key, value in states.items():
            np.testing.assert_array_equal(trainer.state.states[key], value)
    trainer.train_step([batches[3]])
    assert trainer.step == 4
    assert not np.array_equal(trainer.params[program.params[0]], params[program.params[0]])
    with pytest.raises(UsageError, match="no commit callback"):
        trainer.runner.train.run(
            {**batches[4], program.layout.lr: np.float32(0.1), program.layout.step: np.int64(5)}, commit=lambda r: True
        )
