"""CUDA Conv/ConvGrad (cuDNN and the direct kernels) against the numpy kernels, on fresh random
inputs, and whole convolutional models against the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cpu import conv as cpu_conv
from tests.test_conv_transpose_as_conv import CASES as CONV_TRANSPOSE_CASES

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_warnings")]

DTYPES = [np.float32, np.float64, np.float16]


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
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol * 10, atol=tol * max(scale, 1.0) * 10)


# ---------------------------------------------------------------------------------------------
# Conv / ConvGrad

# (x shape, w shape, attributes, with bias)
CONV_CASES = [
    ((2, 4, 17), (6, 4, 3), dict(strides=[2], dilations=[2]), True),  # 1-D strided dilated
    ((2, 6, 10), (6, 1, 3), dict(group=6), True),  # 1-D depthwise
    ((2, 6, 9), (4, 3, 4), dict(group=2, auto_pad="SAME_UPPER"), True),  # 1-D SAME_UPPER, groups
    ((2, 6, 9), (4, 3, 4), dict(group=2, auto_pad="SAME_LOWER"), False),
    ((2, 4, 9, 9), (8, 4, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2]), True),  # 2-D strided
    ((2, 8, 5, 5), (8, 1, 3, 3), dict(group=8, pads=[2, 1, 1, 0], dilations=[2, 2]), False),  # depthwise, asym pads
    ((2, 8, 4, 2), (4, 4, 3, 2), dict(group=2, pads=[1, 0, 1, 1]), True),  # groups, asym pads
    ((2, 4, 4, 2), (2, 4, 2, 3), dict(pads=[0, 1, 0, 1], strides=[2, 1]), True),
    ((2, 3, 7, 6), (4, 3, 3, 3), dict(auto_pad="SAME_UPPER", strides=[2, 2]), True),
    ((2, 3, 7, 6), (4, 3, 3, 3), dict(auto_pad="VALID", strides=[1, 2]), False),
    ((1, 1, 1, 1), (1, 1, 1, 1), dict(), True),  # size-1 everything
    ((2, 2, 5, 7, 7), (4, 2, 3, 3, 3), dict(pads=[1, 0, 1, 1, 0, 1], strides=[1, 2, 2]), True),  # 3-D
    ((2, 4, 5, 3, 4), (4, 1, 3, 3, 3), dict(group=4, pads=[1, 2, 0, 1, 0, 1], dilations=[1, 2, 1]), False),
    ((2, 4, 5, 1, 3), (2, 4, 3, 3, 3), dict(pads=[1, 1, 1, 1, 1, 1]), True),
    ((4, 16, 12, 12), (32, 16, 3, 3), dict(pads=[1, 1, 1, 1]), True),
]


# (x shape, w shape, attributes) of ConvTranspose: those of tests/test_conv_transpose_as_conv.py, a
# U-Net decoder's upsampling, then two that the dgrad form cannot express (an output past the full result)
TRANSPOSE_CASES = [
    *CONV_TRANSPOSE_CASES,
    ((8, 64, 14, 14), (64, 32, 2, 2), {"strides": [2, 2]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"output_shape": [6, 6]}),
    ((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_shape": [9, 9]}),
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


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=[str(i) for i in range(len(TRANSPOSE_CASES))])
def test_conv_transpose(rt, path, dtype, case, with_bias):
    """ConvTranspose as the Conv input gradient (cuDNN's dgrad or the direct kernel), against the numpy
    kernel; the last cases need negative padding and run the numpy kernel on the GPU session."""
    from gradgen.kernels.cuda import conv

    x_shape, w_shape, attrs = case
    rng = np.random.default_rng(6)
    x, w = rand(rng, x_shape, dtype), rand(rng, w_shape, dtype)
    b = rand(rng, (w_shape[1] * attrs.get("group", 1),), dtype) if with_bias else None
    want = cpu_conv.conv_transpose(x, w, b, **attrs)
    got = conv.conv_transpose(rt.to_device(x), rt.to_device(w), None if b is None else rt.to_device(b), **attrs)
    check(rt.to_host(got), want, scale=np.sqrt(np.prod(w_shape)) * 4)


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
# whole models


@pytest.mark.parametrize(
    "name",
    [
        "samples/cnn",
        "tests/fixtures/models/resnet_block_legacy",
        "tests/fixtures/models/conv2d_dynamo",
        "tests/fixtures/models/conv1d_legacy",
        "tests/fixtures/models/conv3d_dynamo",
    ],
)
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
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(value).max())), err_msg=key)


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
    combos = ((True, True, True), (False, True, True), (False, True, False), (False, False, False), (True, False, False))
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
