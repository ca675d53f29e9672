"""CUDA MatMul/Gemm (cuBLAS), Conv/ConvGrad (cuDNN and the direct kernels) and pooling against the
numpy kernels, on fresh random inputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cpu import conv as cpu_conv
from gradgen.kernels.cpu import matmul as cpu_matmul
from gradgen.kernels.cpu import pool as cpu_pool

pytestmark = pytest.mark.cuda

DTYPES = [np.float32, np.float64, np.float16]


@pytest.fixture(scope="module")
def rt():
    from gradgen.cuda import runtime

    return runtime


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def rand(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def check(got, want, dtype=None, scale=None):
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    dtype = np.dtype(dtype or want.dtype)
    tol = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 2e-5, np.dtype(np.float16): 1e-2}[dtype]
    ref = np.abs(want.astype(np.float64))
    scale = float(ref.max()) if scale is None and ref.size else (scale or 1.0)
    assert not np.isnan(got).any() or np.isnan(want).any()
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol * 10,
                               atol=tol * max(scale, 1.0) * 10)


# ---------------------------------------------------------------------------------------------
# MatMul / Gemm

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),          # B shared: folded into one GEMM
    ((4, 5), (2, 5, 6)),          # A broadcast over B's batch (stride 0)
    ((2, 3, 4), (2, 4, 5)),       # both full
    ((2, 1, 3, 4), (3, 4, 5)),    # batch broadcast on both sides: materialised
    ((1, 3, 4), (2, 1, 4, 6)),
    ((5,), (2, 5, 3)),
    ((2, 3, 5), (5,)),
    ((0, 4), (4, 5)),             # empty
    ((3, 0), (0, 5)),             # K = 0: zeros
    ((2, 0, 3, 4), (4, 2)),
    ((1, 1), (1, 1)),
    ((65, 130), (130, 33)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(rt, dtype, shapes):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(0)
    a, b = rand(rng, shapes[0], dtype), rand(rng, shapes[1], dtype)
    want = cpu_matmul.matmul(a, b)
    got = rt.to_host(matmul.matmul(rt.to_device(a), rt.to_device(b)))
    check(got, want, scale=np.sqrt(shapes[0][-1]) * 3 if want.size else None)


def test_matmul_non_contiguous_and_deterministic(rt):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(1)
    a = rand(rng, (6, 40))
    b = rand(rng, (20, 7))
    da = rt.to_device(a)[:, ::2]  # a strided view
    got1 = rt.to_host(matmul.matmul(da, rt.to_device(b)))
    got2 = rt.to_host(matmul.matmul(da, rt.to_device(b)))
    check(got1, cpu_matmul.matmul(np.ascontiguousarray(a[:, ::2]), b))
    assert np.array_equal(got1, got2)


def test_matmul_errors(rt):
    from gradgen.kernels.cuda import matmul

    a = rt.to_device(np.zeros((3, 4), np.float32))
    with pytest.raises(KernelError, match="inner dimensions differ"):
        matmul.matmul(a, rt.to_device(np.zeros((5, 2), np.float32)))
    with pytest.raises(KernelError, match="not broadcastable"):
        matmul.matmul(rt.to_device(np.zeros((2, 3, 4), np.float32)), rt.to_device(np.zeros((3, 4, 2), np.float32)))


GEMM_CASES = [
    dict(m=4, n=5, k=3, transA=0, transB=0, c=(5,), alpha=1.0, beta=1.0),
    dict(m=4, n=5, k=3, transA=1, transB=0, c=(4, 1), alpha=0.5, beta=2.0),
    dict(m=4, n=5, k=3, transA=0, transB=1, c=(4, 5), alpha=1.5, beta=-1.0),
    dict(m=4, n=5, k=3, transA=1, transB=1, c=(), alpha=1.0, beta=0.5),
    dict(m=4, n=5, k=3, transA=0, transB=1, c=None, alpha=2.0, beta=1.0),
    dict(m=4, n=5, k=3, transA=0, transB=0, c=(1, 5), alpha=1.0, beta=0.0),
    dict(m=4, n=5, k=0, transA=0, transB=0, c=(5,), alpha=1.0, beta=3.0),
    dict(m=4, n=5, k=0, transA=1, transB=1, c=None, alpha=1.0, beta=1.0),
    dict(m=0, n=5, k=3, transA=0, transB=0, c=(5,), alpha=1.0, beta=1.0),
    dict(m=70, n=129, k=33, transA=1, transB=1, c=(129,), alpha=1.0, beta=1.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=str)
def test_gemm(rt, dtype, case):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(2)
    m, n, k = case["m"], case["n"], case["k"]
    a = rand(rng, (k, m) if case["transA"] else (m, k), dtype)
    b = rand(rng, (n, k) if case["transB"] else (k, n), dtype)
    c = None if case["c"] is None else rand(rng, case["c"], dtype)
    attrs = dict(alpha=case["alpha"], beta=case["beta"], transA=case["transA"], transB=case["transB"])
    want = cpu_matmul.gemm(a, b, c, **attrs)
    got = rt.to_host(matmul.gemm(rt.to_device(a), rt.to_device(b), None if c is None else rt.to_device(c), **attrs))
    check(got, want, scale=np.sqrt(max(k, 1)) * 6)


def test_gemm_bad_c(rt):
    from gradgen.kernels.cuda import matmul

    a = rt.to_device(np.zeros((3, 4), np.float32))
    b = rt.to_device(np.zeros((4, 5), np.float32))
    with pytest.raises(KernelError, match="does not broadcast"):
        matmul.gemm(a, b, rt.to_device(np.zeros((3, 2), np.float32)))


# ---------------------------------------------------------------------------------------------
# Conv / ConvGrad

# (x shape, w shape, attributes, with bias)
CONV_CASES = [
    ((2, 4, 17), (6, 4, 3), dict(strides=[2], dilations=[2]), True),                     # 1-D strided dilated
    ((2, 6, 10), (6, 1, 3), dict(group=6), True),                                         # 1-D depthwise
    ((2, 6, 9), (4, 3, 4), dict(group=2, auto_pad="SAME_UPPER"), True),                    # 1-D SAME_UPPER, groups
    ((2, 6, 9), (4, 3, 4), dict(group=2, auto_pad="SAME_LOWER"), False),
    ((2, 4, 9, 9), (8, 4, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), True),           # 2-D strided
    ((2, 8, 5, 5), (8, 1, 3, 3), dict(group=8, pads=[2, 1, 1, 0], dilations=[2, 2]), False),  # depthwise, asym pads
    ((2, 8, 4, 2), (4, 4, 3, 2), dict(group=2, pads=[1, 0, 1, 1]), True),                  # groups, asym pads
    ((2, 4, 4, 2), (2, 4, 2, 3), dict(pads=[0, 1, 0, 1], strides=[2, 1]), True),
    ((2, 3, 7, 6), (4, 3, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2]), True),
    ((2, 3, 7, 6), (4, 3, 3, 3), dict(auto_pad="VALID", strides=[1, 2]), False),
    ((1, 1, 1, 1), (1, 1, 1, 1), dict(), True),                                           # size-1 everything
    ((2, 2, 5, 7, 7), (4, 2, 3, 3, 3), dict(pads=[1, 0, 1, 1, 0, 1], strides=[1, 2, 2]), True),  # 3-D
    ((2, 4, 5, 3, 4), (4, 1, 3, 3, 3), dict(group=4, pads=[1, 2, 0, 1, 0, 1], dilations=[1, 2, 1]), False),
    ((2, 4, 5, 1, 3), (2, 4, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1]), True),
    ((4, 16, 12, 12), (32, 16, 3, 3), dict(pads=[1, 1, 1, 1]), True),
]


def _conv_ids(case):
    return f"x{list(case[0])}-w{list(case[1])}-{case[2]}-bias{int(case[3])}"


@pytest.fixture(params=["cudnn", "direct"])
def path(request):
    from gradgen.kernels.cuda import conv

    conv.FORCE_DIRECT = request.param == "direct"
    yield request.param
    conv.FORCE_DIRECT = False


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES, ids=_conv_ids)
def test_conv(rt, path, dtype, case):
    from gradgen.kernels.cuda import conv

    x_shape, w_shape, attrs, with_bias = case
    rng = np.random.default_rng(3)
    x, w = rand(rng, x_shape, dtype), rand(rng, w_shape, dtype)
    b = rand(rng, (w_shape[0],), dtype) if with_bias else None
    want = cpu_conv.conv(x, w, b, **attrs)
    got = rt.to_host(conv.conv(rt.to_device(x), rt.to_device(w), None if b is None else rt.to_device(b), **attrs))
    check(got, want, scale=np.sqrt(np.prod(w_shape[1:])) * 4)


@pytest.mark.parametrize("num_outputs", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CONV_CASES, ids=_conv_ids)
def test_conv_grad(rt, path, dtype, case, num_outputs):
    from gradgen.kernels.cuda import conv

    x_shape, w_shape, attrs, _ = case
    rng = np.random.default_rng(4)
    x, w = rand(rng, x_shape, dtype), rand(rng, w_shape, dtype)
    y_shape = cpu_conv.conv(x, w, **attrs).shape
    dy = rand(rng, y_shape, dtype)
    want = cpu_conv.conv_grad(dy, x, w, _num_outputs=num_outputs, **attrs)
    got = conv.conv_grad(rt.to_device(dy), rt.to_device(x), rt.to_device(w), _num_outputs=num_outputs, **attrs)
    assert len(got) == num_outputs
    for g, wv in zip(got, want):
        check(rt.to_host(g), wv, scale=np.sqrt(max(np.prod(y_shape) // max(w_shape[0], 1), np.prod(w_shape[1:]))) * 4)


def test_conv_grad_average_pool_pattern(rt, path):
    """AveragePool's gradient: ConvGrad of a depthwise-as-batch ones kernel, dX only, no kernel_shape."""
    from gradgen.kernels.cuda import conv

    rng = np.random.default_rng(5)
    dy = rand(rng, (18, 1, 2, 2))
    x = rand(rng, (18, 1, 4, 4))
    w = np.full((1, 1, 2, 2), 0.25, np.float32)
    attrs = dict(strides=[2, 2], dilations=[1, 1], pads=[0, 0, 0, 0])
    want = cpu_conv.conv_grad(dy, x, w, _num_outputs=1, **attrs)
    got = conv.conv_grad(rt.to_device(dy), rt.to_device(x), rt.to_device(w), _num_outputs=1, **attrs)
    assert len(got) == 1
    check(rt.to_host(got[0]), want[0])


def test_conv_grad_checks_dy_shape(rt):
    from gradgen.kernels.cuda import conv

    x = rt.to_device(np.zeros((2, 3, 8, 8), np.float32))
    w = rt.to_device(np.zeros((4, 3, 3, 3), np.float32))
    dy = rt.to_device(np.zeros((2, 4, 8, 8), np.float32))  # SAME output, but the conv is VALID
    with pytest.raises(KernelError, match=r"dY has shape \[2, 4, 8, 8\], but Conv's output shape is \[2, 4, 6, 6\]"):
        conv.conv_grad(dy, x, w)
    # With SAME_UPPER the same dY is right (auto_pad is honoured).
    out = conv.conv_grad(dy, x, w, auto_pad="SAME_UPPER")
    assert [tuple(o.shape) for o in out] == [(2, 3, 8, 8), (4, 3, 3, 3), (4,)]


def test_conv_grad_deterministic(rt):
    from gradgen.kernels.cuda import conv

    rng = np.random.default_rng(6)
    x, w = rand(rng, (8, 32, 14, 14)), rand(rng, (32, 32, 3, 3))
    dy = rand(rng, (8, 32, 14, 14))
    args = [rt.to_device(a) for a in (dy, x, w)]
    first = [rt.to_host(o) for o in conv.conv_grad(*args, pads=[1, 1, 1, 1])]
    second = [rt.to_host(o) for o in conv.conv_grad(*args, pads=[1, 1, 1, 1])]
    for a, b in zip(first, second):
        assert np.array_equal(a, b)


def test_conv_no_nan_in_fresh_outputs(rt):
    """Outputs are written in full: poison the pool with NaN buffers first, then check for NaN."""
    from gradgen.kernels.cuda import conv

    poison = [rt.to_device(np.full((4096,), np.nan, np.float32)) for _ in range(8)]
    del poison
    rng = np.random.default_rng(7)
    x, w = rand(rng, (2, 4, 9, 9)), rand(rng, (8, 2, 3, 3))
    attrs = dict(group=2, pads=[2, 1, 0, 1], strides=[2, 1])
    y = rt.to_host(conv.conv(rt.to_device(x), rt.to_device(w), **attrs))
    assert not np.isnan(y).any()
    dy = rand(rng, y.shape)
    for out in conv.conv_grad(rt.to_device(dy), rt.to_device(x), rt.to_device(w), **attrs):
        assert not np.isnan(rt.to_host(out)).any()


# ---------------------------------------------------------------------------------------------
# pooling

POOL_CASES = [
    ((2, 3, 12, 12), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ((2, 3, 7, 9), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    ((2, 3, 7, 9), dict(kernel_shape=[3, 2], strides=[2, 3], pads=[1, 0, 0, 1], ceil_mode=1)),
    ((2, 3, 8, 8), dict(kernel_shape=[3, 3], strides=[1, 1], dilations=[2, 2])),
    ((2, 3, 7, 6), dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER")),
    ((2, 3, 7, 6), dict(kernel_shape=[2, 3], strides=[2, 2], auto_pad="SAME_LOWER")),
    ((2, 3, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
    ((1, 2, 5, 6, 7), dict(kernel_shape=[2, 2, 3], strides=[2, 1, 2], pads=[0, 1, 1, 1, 0, 1])),
    ((1, 1, 1, 1), dict(kernel_shape=[1, 1])),
    ((0, 3, 4, 4), dict(kernel_shape=[2, 2])),
]


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("num_outputs", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_max_pool(rt, dtype, case, num_outputs, storage_order):
    from gradgen.kernels.cuda import pool

    shape, attrs = case
    x = rand(np.random.default_rng(8), shape, dtype)
    if x.size == 0 and num_outputs == 2:  # (the numpy kernel's Indices path wants a non-empty batch)
        y = cpu_pool.max_pool(x, storage_order=storage_order, **attrs)
        want = (y, np.zeros(y.shape, np.int64))
    else:
        want = cpu_pool.max_pool(x, storage_order=storage_order, _num_outputs=num_outputs, **attrs)
    got = pool.max_pool(rt.to_device(x), storage_order=storage_order, _num_outputs=num_outputs, **attrs)
    if num_outputs == 1:
        want, got = (want,), (got,)
    check(rt.to_host(got[0]), want[0])
    if num_outputs == 2:
        assert np.array_equal(rt.to_host(got[1]), want[1])


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_average_pool(rt, dtype, case, count_include_pad):
    from gradgen.kernels.cuda import pool

    shape, attrs = case
    x = rand(np.random.default_rng(9), shape, dtype)
    want = cpu_pool.average_pool(x, count_include_pad=count_include_pad, **attrs)
    got = rt.to_host(pool.average_pool(rt.to_device(x), count_include_pad=count_include_pad, **attrs))
    check(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 3, 300), (1, 1, 1, 1), (2, 4, 2, 3, 4), (0, 3, 4, 4)], ids=str)
def test_global_pools(rt, dtype, shape):
    from gradgen.kernels.cuda import pool

    x = rand(np.random.default_rng(10), shape, dtype)
    check(rt.to_host(pool.global_average_pool(rt.to_device(x))), cpu_pool.global_average_pool(x))
    check(rt.to_host(pool.global_max_pool(rt.to_device(x))), cpu_pool.global_max_pool(x))


def test_max_pool_indices_drive_scatter_gradient(rt):
    """gradgen's MaxPool gradient: MaxPool-with-Indices, then a ScatterElements add over the flat X."""
    from gradgen.kernels.cuda import pool

    rng = np.random.default_rng(11)
    x = rand(rng, (3, 4, 12, 12))
    _, idx = pool.max_pool(rt.to_device(x), kernel_shape=[2, 2], strides=[2, 2], _num_outputs=2)
    _, want = cpu_pool.max_pool(x, kernel_shape=[2, 2], strides=[2, 2], _num_outputs=2)
    assert rt.to_host(idx).dtype == np.int64
    assert np.array_equal(rt.to_host(idx), want)


# ---------------------------------------------------------------------------------------------
# whole models


@pytest.mark.parametrize("name", ["samples/cnn", "tests/fixtures/models/resnet_block_legacy",
                                  "tests/fixtures/models/conv2d_dynamo", "tests/fixtures/models/conv1d_legacy",
                                  "tests/fixtures/models/conv3d_dynamo"])
def test_backward_model_matches_cpu(name):
    from pathlib import Path

    import gradgen
    from gradgen.executor import Session

    root = Path(__file__).resolve().parents[2] / name
    built = gradgen.build_backward(str(root / "model.onnx"))
    inputs = dict(np.load(root / "inputs.npz"))
    want = Session(built.model, device="cpu").run(inputs)
    got = Session(built.model, device="cuda").run(inputs)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(value).max())),
                                   err_msg=key)


@pytest.mark.parametrize("case", [CONV_CASES[4], CONV_CASES[6], CONV_CASES[2]], ids=_conv_ids)
def test_conv_grad_streams_and_execute_forms_agree(rt, case):
    """ConvGrad on two side streams and on the default stream, through both cuDNN execute forms:
    bit-identical results."""
    from gradgen.kernels.cuda import conv

    x_shape, w_shape, attrs, _ = case
    rng = np.random.default_rng(12)
    x, w = rand(rng, x_shape), rand(rng, w_shape)
    dy = rand(rng, cpu_conv.conv(x, w, **attrs).shape)
    args = [rt.to_device(a) for a in (dy, x, w)]
    outs = []
    combos = ((True, True, True), (False, True, True), (False, True, False), (False, False, False),
              (True, False, False))
    try:
        for concurrent, fast, native in combos:
            conv.CONCURRENT, conv.FAST_EXECUTE, conv.NATIVE_EXECUTE = concurrent, fast, native
            conv._GRAPHS.clear()
            first = [rt.to_host(o) for o in conv.conv_grad(*args, **attrs)]
            second = [rt.to_host(o) for o in conv.conv_grad(*args, **attrs)]  # the native call runs from the 2nd on
            for a, b in zip(first, second):
                assert np.array_equal(a, b)
            outs.append(second)
    finally:
        conv.CONCURRENT, conv.FAST_EXECUTE, conv.NATIVE_EXECUTE = False, True, True
        conv._GRAPHS.clear()
    want = cpu_conv.conv_grad(dy, x, w, **attrs)
    for got in outs:
        for g, wv, first in zip(got, want, outs[0]):
            check(g, wv, scale=10.0)
            assert np.array_equal(g, first)
