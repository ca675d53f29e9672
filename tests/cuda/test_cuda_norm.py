"""CUDA normalization launchers against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_elementwise import FLOATS, check, dev, host, kernels, poison

pytestmark = pytest.mark.cuda


# -- normalization --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,axis", [((2, 5, 16), -1), ((2, 8, 768), -1), ((3, 4, 6), 1), ((4, 3), 0), ((5, 3000), 1), ((1, 1, 1), -1)], ids=str
)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm(shape, axis, dtype, with_bias):
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    norm_shape = shape[axis:]
    scale = rng.standard_normal(norm_shape).astype(dtype)
    bias = rng.standard_normal(norm_shape).astype(dtype) if with_bias else None
    cpu, cuda = kernels("LayerNormalization")
    want = cpu(x, scale, bias, axis=axis, epsilon=1e-5)
    poison(*[w.nbytes for w in want])
    got = cuda(dev(x), dev(scale), None if bias is None else dev(bias), axis=axis, epsilon=1e-5)
    t = {np.dtype(np.float16): 4e-3, np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-12}[np.dtype(dtype)]
    for g, w in zip(got, want):
        check(host(g), w, rtol=t, atol=t)


@pytest.mark.parametrize("shape", [(2, 4, 6, 6), (3, 5), (2, 3, 4), (0, 3, 2, 2)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
def test_batch_norm_inference(shape, dtype):
    rng = np.random.default_rng(9)
    c = shape[1]
    x = rng.standard_normal(shape).astype(dtype)
    params = [
        rng.standard_normal(c).astype(dtype),
        rng.standard_normal(c).astype(dtype),
        rng.standard_normal(c).astype(dtype),
        rng.uniform(0.5, 2, c).astype(dtype),
    ]
    cpu, cuda = kernels("BatchNormalization")
    want = cpu(x, *params, epsilon=1e-5)
    poison(want.nbytes)
    got = host(cuda(dev(x), *[dev(p) for p in params], epsilon=1e-5))
    t = {np.dtype(np.float16): 4e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}[np.dtype(dtype)]
    check(got, want, rtol=t, atol=t)


@pytest.mark.parametrize("shape", [(2, 4, 6, 6), (3, 5), (2, 3, 4), (8, 16, 28, 28), (0, 3, 2, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("outputs", [3, 5], ids=["running", "legacy-saved"])
def test_batch_norm_training(shape, dtype, outputs):
    """Training mode on the device (batch statistics, running statistics; opset < 14's five
    outputs with the batch mean and biased variance): the CPU kernel's values."""
    rng = np.random.default_rng(12)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.7).astype(dtype)
    params = [rng.standard_normal(c).astype(dtype) for _ in range(3)] + [rng.uniform(0.5, 2, c).astype(dtype)]
    attrs = dict(epsilon=1e-5, momentum=0.9, training_mode=int(outputs == 3), _num_outputs=outputs)
    cpu, cuda = kernels("BatchNormalization")
    want = cpu(x, *params, **attrs)
    got = cuda(dev(x), *[dev(p) for p in params], **attrs)
    assert len(got) == len(want) == outputs
    t = 2e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        g = host(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        check(g, w, rtol=t, atol=t)


def test_instance_and_group_norm():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    for op, args, attrs in [
        ("InstanceNormalization", (rng.standard_normal(6), rng.standard_normal(6)), {}),
        ("GroupNormalization", (rng.standard_normal(6), rng.standard_normal(6)), {"num_groups": 3}),
        ("GroupNormalization", (rng.standard_normal(3), rng.standard_normal(3)), {"num_groups": 3}),
        ("GroupNormalization", (rng.standard_normal(6), rng.standard_normal(6)), {"num_groups": 6}),
    ]:
        args = tuple(a.astype(np.float32) for a in args)
        cpu, cuda = kernels(op)
        want = cpu(x, *args, epsilon=1e-5, **attrs)
        got = host(cuda(dev(x), *[dev(a) for a in args], epsilon=1e-5, **attrs))
        check(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("shape", [(2, 4, 6, 6), (3, 5), (0, 3, 2, 2), (32, 64, 56, 56)], ids=str)
@pytest.mark.parametrize("low", ["float16", "bfloat16"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_batch_norm_16_bit_x_float32_parameters(shape, low, training):
    """AutocastPass's BatchNormalization (a 16-bit X, float32 scale, bias and statistics): in
    inference the device gives the CPU kernel's bits (float32 arithmetic in its order, one rounding
    of Y); training mode keeps float32 statistics, summed in the device's order, so Y is within one
    16-bit rounding of the CPU's."""
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if low == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(11)
    c = shape[1]
    x = (rng.standard_normal(shape) * 3 + 0.5).astype(dtype)
    params = [
        rng.standard_normal(c).astype(np.float32),
        rng.standard_normal(c).astype(np.float32),
        rng.standard_normal(c).astype(np.float32),
        rng.uniform(0.5, 2, c).astype(np.float32),
    ]
    attrs = dict(epsilon=1e-5, training_mode=int(training), _num_outputs=3 if training else 1)
    cpu, cuda = kernels("BatchNormalization")
    want = cpu(x, *params, **attrs)
    got = cuda(dev(x), *[dev(p) for p in params], **attrs)
    want, got = (want, got) if training else ((want,), (got,))
    assert host(got[0]).dtype == dtype
    if training and x.size:
        ulp = 2.0**-7 if low == "bfloat16" else 2.0**-10
        y, y_cpu = host(got[0]).astype(np.float32), want[0].astype(np.float32)
        np.testing.assert_allclose(y, y_cpu, rtol=ulp, atol=1e-3)
        assert np.mean(y != y_cpu) < 0.01  # most elements: the same bits
    else:
        np.testing.assert_array_equal(host(got[0]).view(np.uint16), want[0].view(np.uint16))
    for g, w in zip(got[1:], want[1:]):
        assert host(g).dtype == np.float32
        np.testing.assert_allclose(host(g), w, rtol=1e-6, atol=1e-6)


# -- LayerNormalizationGrad and its residual form -----------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 8, 768), (5, 3000), (4, 3), (7, 40)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_grad(shape, dtype, with_residual):
    """The kernels against the numpy kernel; with a residual, dX + residual as the Sum kernel gives it."""
    from gradgen.kernels import registry
    from gradgen.kernels.cuda.norm import layer_normalization_grad_add
    from gradgen.kernels.table import MICROSOFT

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    scale = rng.standard_normal(shape[-1]).astype(dtype)
    lead = shape[:-1] + (1,)
    mean = x.astype(np.float32).mean(axis=-1).reshape(lead)
    inv = (1 / np.sqrt(x.astype(np.float32).var(axis=-1) + 1e-5)).reshape(lead)
    residual = rng.standard_normal(shape).astype(dtype) if with_residual else None
    cpu = registry.lookup(MICROSOFT, "LayerNormalizationGrad").cpu
    want = list(cpu(dy, x, scale, mean, inv, axis=-1, epsilon=1e-5))
    if residual is not None:
        _, sum_cuda = kernels("Sum")
        want[0] = host(sum_cuda(dev(want[0]), dev(residual)))
    poison(*[w.nbytes for w in want])
    got = layer_normalization_grad_add(
        dev(dy), dev(x), dev(scale), dev(mean), dev(inv), None if residual is None else dev(residual), axis=-1, epsilon=1e-5
    )
    t = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 5e-5, np.dtype(np.float64): 1e-11}[np.dtype(dtype)]
    for g, w in zip(got, want):
        check(host(g), w, rtol=t, atol=t * max(1.0, float(np.abs(w).max())))


def test_residual_sum_fused_into_layer_norm_grad_gives_the_same_bits(monkeypatch):
    """A pre-norm block's backward graph with the executor's fusions off and on: the plan writes each
    residual Sum from its LayerNormalizationGrad, with the unfused bits, eager and replayed."""
    from gradgen.executor import Session
    from gradgen.executor.fused_norm_grad import OP_TYPE
    from tests.cuda.test_cuda_fusion import assert_same_bits, runs_off_and_on
    from tests.residual_norm_models import pre_norm_block

    model, feeds = pre_norm_block(rows=64, cols=768, layers=3)
    (off, off_ops), (on, on_ops) = runs_off_and_on(model, feeds, monkeypatch)
    assert off_ops.count(OP_TYPE) == 0 and on_ops.count(OP_TYPE) == 3
    assert_same_bits(on, off)
    with Session(model, device="cpu") as sess:
        want = sess.run(feeds)
    for name in want:
        np.testing.assert_allclose(on[name], want[name], rtol=1e-4, atol=1e-4 * float(np.abs(want[name]).max()))


@pytest.mark.parametrize("shape", [(2048, 768), (100, 3000), (7, 40)], ids=str)
def test_layer_norm_grad_column_sums_finish_in_the_last_chunk(shape, monkeypatch):
    """dScale / dBias added up by the last chunk block of each column tile (a counter per tile, left
    at zero) give the bits of the separate finishing launch, launch after launch."""
    from gradgen.kernels.cuda import reduction
    from gradgen.kernels.cuda.norm import layer_normalization_grad_add

    rng = np.random.default_rng(12)
    x, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    scale = rng.standard_normal(shape[-1]).astype(np.float32)
    mean = x.mean(axis=-1, keepdims=True)
    inv = 1 / np.sqrt(x.var(axis=-1, keepdims=True) + 1e-5)
    args = [dev(a) for a in (dy, x, scale, mean, inv)]
    in_block = [[host(r) for r in layer_normalization_grad_add(*args, None)] for _ in range(3)]
    monkeypatch.setattr(reduction, "MAX_TILE_COUNTERS", 0)
    separate = [host(r) for r in layer_normalization_grad_add(*args, None)]
    for got in in_block:
        for g, w in zip(got, separate):
            np.testing.assert_array_equal(g, w)
    assert not host(reduction._COUNTERS["counters"]).any()


# -- ONNX Runtime training's BatchNormInternal and BatchNormalizationGrad -----------------------------

BN_SHAPES = [(2, 4, 6, 6), (3, 5), (2, 3, 4), (8, 16, 28, 28), (4, 2, 3000), (1, 700, 3), (3, 2, 2, 3, 4)]


def microsoft_kernels(op):
    from gradgen.kernels import registry

    registry.load_cuda_kernels()
    entry = registry.lookup("com.microsoft", op)
    assert entry is not None and entry.cuda is not None, f"no CUDA launcher for {op}"
    return entry.cpu, entry.cuda


@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_norm_internal(shape, dtype, monkeypatch):
    """The five outputs (Y, running statistics, batch mean, inverse deviation) on the device, one
    chunk or several per channel: the CPU kernel's values."""
    from gradgen.kernels.cuda import norm

    monkeypatch.setattr(norm, "cpu_fallback", None)  # the device path, or a TypeError
    rng = np.random.default_rng(13)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 0.7).astype(dtype)
    params = [rng.standard_normal(c).astype(dtype) for _ in range(3)] + [rng.uniform(0.5, 2, c).astype(dtype)]
    cpu, cuda = microsoft_kernels("BatchNormInternal")
    want = cpu(x, *params, epsilon=1e-5, momentum=0.8)
    poison(*[w.nbytes for w in want])
    got = cuda(dev(x), *[dev(p) for p in params], epsilon=1e-5, momentum=0.8)
    assert len(got) == len(want) == 5
    t = 2e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        check(host(g), w, rtol=t, atol=t)


@pytest.mark.parametrize("shape", BN_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batch_normalization_grad(shape, dtype, monkeypatch):
    """dX, dScale and dBias from the saved statistics: the CPU kernel's values, and the same bits
    launch after launch (fixed chunks, summed in order)."""
    from gradgen.kernels.cuda import norm

    monkeypatch.setattr(norm, "cpu_fallback", None)
    rng = np.random.default_rng(14)
    axes = (0, *range(2, len(shape)))
    x, dy = ((rng.standard_normal(shape) * 2 + 0.3).astype(dtype) for _ in range(2))
    scale = rng.uniform(0.5, 1.5, shape[1]).astype(dtype)
    mean = x.mean(axis=axes).astype(dtype)
    inv = (1 / np.sqrt(x.var(axis=axes) + 1e-5)).astype(dtype)
    cpu, cuda = microsoft_kernels("BatchNormalizationGrad")
    want = cpu(dy, x, scale, mean, inv, epsilon=1e-5)
    poison(*[w.nbytes for w in want])
    args = [dev(a) for a in (dy, x, scale, mean, inv)]
    got = [host(g) for g in cuda(*args, epsilon=1e-5)]
    for g, w in zip(got, want):
        t = (1e-4 if dtype == np.float32 else 1e-11) * max(1.0, float(np.abs(w).max()))
        check(g, w, rtol=t, atol=t)
    again = [host(g) for g in cuda(*args, epsilon=1e-5)]
    for g, a in zip(got, again):
        np.testing.assert_array_equal(g, a)


def test_batch_normalization_grad_of_other_types_runs_the_cpu_kernel():
    """float16 throughout (which a default build never writes, but a model may hold): the CPU
    kernel's result, computed in float32 and rounded once."""
    rng = np.random.default_rng(15)
    x, dy = (rng.standard_normal((2, 3, 4, 4)).astype(np.float16) for _ in range(2))
    scale, mean = np.ones(3, np.float16), x.astype(np.float32).mean(axis=(0, 2, 3)).astype(np.float16)
    inv = np.ones(3, np.float16)
    cpu, cuda = microsoft_kernels("BatchNormalizationGrad")
    want = cpu(dy, x, scale, mean, inv)
    got = cuda(*[dev(a) for a in (dy, x, scale, mean, inv)])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(host(g).view(np.uint16), w.view(np.uint16))


def test_a_training_mode_cnn_on_the_device_matches_the_cpu(monkeypatch):
    """A train-mode export built by default (the BatchNormInternal / BatchNormalizationGrad pair):
    every gradient of the CUDA session is the CPU session's, and no BatchNorm step leaves the device."""
    torch = pytest.importorskip("torch")
    import gradgen
    from gradgen.bench.models import legacy_export
    from gradgen.executor import Session
    from gradgen.kernels.cuda import norm

    monkeypatch.setattr(norm, "cpu_fallback", None)
    torch.manual_seed(3)
    body = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
    )

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body

        def forward(self, x):
            return (self.body(x) ** 2).mean()

    x = torch.randn(4, 3, 16, 16)
    built = gradgen.build_backward(legacy_export(WithLoss().train(), (x,), ["x"]), wrt_inputs=True)
    assert {n.op_type for n in built.model.graph} >= {"BatchNormInternal", "BatchNormalizationGrad"}
    feeds = {"x": x.numpy()}
    want = Session(built.model).run(feeds)
    got = Session(built.model, device="cuda").run(feeds)
    for name in built.gradient_names:
        scale = max(1e-6, float(np.abs(want[name]).max()))
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=1e-4, atol=1e-4 * scale, err_msg=name)
