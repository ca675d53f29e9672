"""The fused multi-tensor optimizer update and gradient norm on the GPU (gradgen/executor/fused_optimizer.py):
the update bit for bit the unfused standard-op update (GRADGEN_CUDA_FUSED_OPTIMIZER=0) over several
steps, for AdamW and SGD with their options, and the same float32 arithmetic in numpy on aligned and
unaligned tensors; the norm the float64 norm rounded to float32, the same bits every run; a whole
step with both fused within rounding of the unfused one; PyTorch's AdamW on a model of more
parameters than one launch takes; a step whose loss is not finite changes nothing."""

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
OPTIMIZERS = [  # a clip norm of 0.05 acts on every step of _mlp_batches (gradient norms 0.06 to 0.14)
    (AdamW(), 0.05),
    (AdamW(weight_decay=0.0, bias_correction=False, betas=(0.8, 0.99), eps=1e-6), None),
    (SGD(momentum=0.9, nesterov=True, weight_decay=0.1), 0.05),
    (SGD(momentum=0.5), None),
    (SGD(weight_decay=0.01), 1.0),
]


def _mlp_batches(steps: int):
    rng = np.random.default_rng(1)
    arrays = {"x": rng.standard_normal((29, 6)).astype(np.float32), "target": rng.random((29, 3)).astype(np.float32)}
    return list(itertools.islice(ShuffledBatches(arrays, 4, seed=3), steps))


def _train(program, batches, fused: bool, monkeypatch, lr=1e-2, norm: bool = True):
    """Train on the GPU with the fused update (and, with ``norm``, the fused gradient norm) or the
    standard-op ones, each elementwise op its own kernel (pointwise fusion, bit-exact with those
    kernels, is tested on its own)."""
    trainer, records = _fit(program, batches, fused, monkeypatch, lr, norm)
    return trainer, [r.loss for r in records]


def _fit(program, batches, fused: bool, monkeypatch, lr=1e-2, norm: bool = True):
    """_train's trainer and its step records."""
    monkeypatch.setenv(fo.ENV, "1" if fused else "0")
    monkeypatch.setenv(fo.NORM_ENV, "1" if norm else "0")
    monkeypatch.setenv("GRADGEN_CUDA_FUSION", "0")
    trainer = Trainer(program, lr=lr, runner=DeviceStepRunner(program, "cuda"))
    assert trainer.runner.train.updates_in_place == fused
    return trainer, list(trainer.fit(batches, len(batches)))


def _assert_same_state(a, b) -> None:
    for name, value in a.params.items():
        np.testing.assert_array_equal(b.params[name], value, err_msg=name)
    for key, value in a.states.items():
        np.testing.assert_array_equal(b.states[key], value, err_msg=str(key))


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_fused_update_is_the_unfused_one_bit_for_bit(optimizer, clip, monkeypatch):
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=optimizer, clip_norm=clip)
    batches = _mlp_batches(8)  # an eager run, a recording, then replays
    fused, fused_losses = _train(program, batches, True, monkeypatch, norm=False)  # the norm's own nodes
    plain, plain_losses = _train(program, batches, False, monkeypatch)
    assert fused_losses == plain_losses
    _assert_same_state(plain.state, fused.state)
    assert fused.step == plain.step == 8


@pytest.mark.parametrize("optimizer", [OPTIMIZERS[0][0], OPTIMIZERS[2][0]])
def test_fused_norm_and_update_are_the_unfused_step_within_rounding(optimizer, monkeypatch):
    clip = 0.05
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=optimizer, clip_norm=clip)
    batches = _mlp_batches(8)
    fused, fused_records = _fit(program, batches, True, monkeypatch)
    kinds = {s.op_type for s in fused.runner.train.steps}
    assert {fo.OP_TYPE, fo.NORM_OP_TYPE} <= kinds and "ReduceSumSquare" not in kinds
    plain, plain_records = _fit(program, batches, False, monkeypatch)
    assert not {fo.OP_TYPE, fo.NORM_OP_TYPE} & {s.op_type for s in plain.runner.train.steps}
    assert all(r.grad_norm > clip for r in plain_records)
    assert fused_records[0].loss == plain_records[0].loss  # the first loss does not depend on the norm
    np.testing.assert_allclose([r.grad_norm for r in fused_records], [r.grad_norm for r in plain_records], rtol=1e-5)
    np.testing.assert_allclose([r.loss for r in fused_records], [r.loss for r in plain_records], rtol=1e-5)
    for name, value in plain.state.params.items():
        np.testing.assert_allclose(fused.state.params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _upload(rt, host: np.ndarray, offset: int):
    """``host`` on the device, ``offset`` elements into a buffer of its own (1: not 16-byte aligned)."""
    buffer = rt.to_device(np.concatenate([np.zeros(offset, np.float32), host]))
    return buffer[offset:] if offset else buffer


def _views(rt, sizes, offset: int, rng):
    """Device float32 tensors of ``sizes`` at ``offset`` (see _upload), of mixed scales, and their host values."""
    host = [rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.integers(-3, 3)) for n in sizes]
    return [_upload(rt, h, offset) for h in host], host


NORM_SIZES = [3 * fo.CHUNK + 5, 1, 0, fo.CHUNK, 1000, *([77] * 66)]  # 71 tensors: two launches


@pytest.mark.parametrize("offset", [0, 1])
def test_fused_norm_is_the_float64_norm_the_same_every_run(rt, offset):
    views, host = _views(rt, NORM_SIZES, offset, np.random.default_rng(offset))
    assert all(v.flags.c_contiguous for v in views) and (int(views[0].gpudata) % 16 != 0) == bool(offset)
    want = np.sqrt(sum(np.sum(h.astype(np.float64) ** 2) for h in host))
    norm = fo.MultiTensorNorm()
    runs = [rt.to_host(norm(*views)) for _ in range(3)]
    assert runs[0].shape == () and runs[0].dtype == np.float32
    assert abs(float(runs[0]) - want) <= np.spacing(np.float32(want)) / 2 * 1.0001  # rounded once from float64
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    assert float(rt.to_host(norm())) == 0.0 and float(rt.to_host(norm(views[2]))) == 0.0  # nothing, an empty tensor
    big = rt.to_device(np.full(4, 3e20, np.float32))  # squares past float32's range: still finite
    assert float(rt.to_host(norm(big))) == pytest.approx(6e20, rel=1e-7)


def _adamw_reference(kind, p, g, m, v, decay, step_size, bc2_sqrt, clip):
    """optimizer.cu's AdamW element in numpy float32: the same operations, each rounded to nearest."""
    c1, b2, c2, eps = (np.float32(c) for c in kind.consts)
    g = g * clip
    p = p * decay
    m = m + (g - m) * c1
    v = v * b2 + (g * g) * c2
    denom = np.sqrt(v) / bc2_sqrt + eps
    return p - step_size * (m / denom), m, v


@pytest.mark.parametrize("offset", [0, 1])
def test_fused_update_kernel_is_the_float32_arithmetic_aligned_or_not(rt, offset):
    import json

    from gradgen.training.optimizers import optimizer_config

    kind = fo.kind_of(json.loads(optimizer_config(AdamW(weight_decay=0.1), 1.0)))
    rng = np.random.default_rng(7 + offset)
    sizes = [2 * fo.CHUNK + 3, 5, 4097, 1]
    host = []
    for n in sizes:
        p, g, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(4))
        host.append((p, g, m, np.abs(v)))  # exp_avg_sq >= 0
    tensors = [[_upload(rt, h, offset) for h in group] for group in host]
    scalars = [np.float32(x) for x in (0.999, 1e-2 / 0.1, 0.0447, 0.5)]  # decay, step_size, bc2_sqrt, clip
    guard = [rt.to_device(np.array(1.0, np.float32)), rt.to_device(np.array(2.0, np.float32))]
    update = fo.MultiTensorUpdate(kind, 2, len(sizes), [True] * 4)
    update(*guard, *(rt.to_device(np.array(s)) for s in scalars), *(a for group in tensors for a in group))
    for group, (p, g, m, v) in zip(tensors, host):
        want = _adamw_reference(kind, p, g, m, v, *scalars)
        got = [rt.to_host(group[k]) for k in (0, 2, 3)]
        for w, x in zip(want, got):
            np.testing.assert_array_equal(x, w)
        np.testing.assert_array_equal(rt.to_host(group[1]), g)  # the gradient is only read


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
    update_only, update_losses = _train(program, batches, True, monkeypatch, lr=1e-3, norm=False)
    plain, plain_losses = _train(program, batches, False, monkeypatch, lr=1e-3)
    assert update_losses == plain_losses
    _assert_same_state(plain.state, update_only.state)
    fused, fused_losses = _train(program, batches, True, monkeypatch, lr=1e-3)  # the norm fused too

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


# -- mixed precision: the loss-scaled (fp16) and bf16 steps -------------------------------------------


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("optimizer, clip", [OPTIMIZERS[0], OPTIMIZERS[2]])
def test_mixed_precision_fused_update_is_the_unfused_one_bit_for_bit(precision, optimizer, clip, monkeypatch):
    """fp16 with loss scaling (the kernel reads the overflow flag) and bf16: the fused update writes
    what the standard ops (the Where nodes of the overflow included) write, the scaler's state too."""
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=optimizer, clip_norm=clip, precision=precision)
    batches = _mlp_batches(8)
    fused, fused_losses = _train(program, batches, True, monkeypatch, norm=False)
    kinds = [s for s in fused.runner.train.steps if s.op_type == fo.OP_TYPE]
    assert len(kinds) == 1 and kinds[0].entry.cuda.kind.skip == (precision == "fp16")
    assert kinds[0].entry.cuda.n_params == len(program.params)
    plain, plain_losses = _train(program, batches, False, monkeypatch)
    assert fused_losses == plain_losses
    _assert_same_state(plain.state, fused.state)
    assert fused.step == plain.step == 8


def test_an_overflowing_fused_step_changes_no_parameter_and_halves_the_scale(monkeypatch):
    from gradgen.training.loss_scaling import LOSS_SCALING

    monkeypatch.setenv(fo.ENV, "1")
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=AdamW(), clip_norm=1.0, precision="fp16")
    batches = _mlp_batches(6)
    trainer = Trainer(program, lr=1e-2, runner=DeviceStepRunner(program, "cuda"))
    assert trainer.runner.train.updates_in_place and trainer.runner.train.state_guard == [program.loss]
    trainer.fit(batches[:3], 3)  # eager, recorded, replayed: the overflow step replays the CUDA graph
    before = trainer.state
    params = {k: np.array(v) for k, v in before.params.items()}
    states = {k: np.array(v) for k, v in before.states.items()}
    assert states[(LOSS_SCALING, "updates")] == 3
    huge = dict(states)
    huge[(LOSS_SCALING, "scale")] = np.array(3e38, np.float32)  # float16 gradients overflow
    trainer.load_state(type(before)(params, huge, before.step))
    result = trainer.train_step([batches[3]])
    assert not np.isfinite(result.grad_norm) and np.isfinite(result.loss) and trainer.step == 4
    after = trainer.state
    for name, value in params.items():
        np.testing.assert_array_equal(after.params[name], value, err_msg=name)
    for key, value in states.items():
        if key[0] != LOSS_SCALING:
            np.testing.assert_array_equal(after.states[key], value, err_msg=str(key))
    assert after.states[(LOSS_SCALING, "scale")] == np.float32(3e38) * np.float32(0.5)
    assert after.states[(LOSS_SCALING, "good_steps")] == 0 and after.states[(LOSS_SCALING, "updates")] == 3
    reset = dict(after.states)
    reset[(LOSS_SCALING, "scale")] = np.array(2.0**10, np.float32)
    trainer.load_state(type(after)(after.params, reset, after.step))
    trainer.train_step([batches[4]])  # and the next good step updates again
    assert trainer.state.states[(LOSS_SCALING, "updates")] == 4
    assert not np.array_equal(trainer.params[program.params[0]], params[program.params[0]])
