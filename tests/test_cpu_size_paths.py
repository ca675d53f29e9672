"""CPU kernels that pick their algorithm by size: large convolutions of group 1 run image by image
(Conv) or as a Conv of the flipped kernel (ConvTranspose of stride 1); a large Where selects by
bit masks; erf evaluates its formula in cache-sized chunks; a small K of a long axis is selected by
partition. Each large-size path must compute what the general form computes (Where, erf and TopK:
the same bits), for every geometry, broadcast and dtype; the size thresholds are lowered (or
raised) here so that small cases take them (or not)."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cpu import conv as cpu_conv
from gradgen.kernels.cpu import elementwise as cpu_elementwise


def _with_threshold(monkeypatch, value: int):
    monkeypatch.setattr(cpu_conv, "SMALL_CONV_COLUMNS", value)
    monkeypatch.setattr(cpu_conv, "TRANSPOSE_AS_CONV_POSITIONS", 1)


def _random_geometry(rng, ns: int, mode: int) -> tuple[list[int], list[int], dict]:
    spatial = [int(v) for v in rng.integers(1, 7, ns)]
    kernel = [int(v) for v in rng.integers(1, 4, ns)]
    attrs: dict = {"dilations": [int(v) for v in rng.integers(1, 3, ns)]}
    if mode == 1:
        attrs["pads"] = [int(v) for v in rng.integers(0, 3, 2 * ns)]
    elif mode == 2:
        attrs["output_shape"] = [int(v) for v in rng.integers(1, 9, ns)]
    elif mode == 3:
        attrs["auto_pad"] = "SAME_UPPER" if rng.random() < 0.5 else "SAME_LOWER"
    return spatial, kernel, attrs


@pytest.mark.parametrize("ns", [1, 2, 3])
def test_stride_one_conv_transpose_as_conv_matches_the_general_form(monkeypatch, ns):
    rng = np.random.default_rng(ns)
    compared = 0
    for trial in range(40):
        spatial, kernel, attrs = _random_geometry(rng, ns, trial % 4)
        x = rng.standard_normal([2, 3, *spatial])
        w = rng.standard_normal([3, 4, *kernel])
        b = rng.standard_normal(4)
        _with_threshold(monkeypatch, 1 << 62)
        try:
            want = cpu_conv.conv_transpose(x, w, b, **attrs)
        except KernelError:  # a geometry the op refuses (an empty output): refused by both paths
            _with_threshold(monkeypatch, 0)
            with pytest.raises(KernelError):
                cpu_conv.conv_transpose(x, w, b, **attrs)
            continue
        _with_threshold(monkeypatch, 0)
        got = cpu_conv.conv_transpose(x, w, b, **attrs)
        assert got.shape == want.shape and got.dtype == want.dtype, attrs
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(attrs))
        compared += 1
    assert compared >= 20


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conv_transpose_as_conv_keeps_the_input_type(monkeypatch, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 5)).astype(dtype)
    w = rng.standard_normal((3, 4, 3, 3)).astype(dtype)
    _with_threshold(monkeypatch, 1 << 62)
    want = cpu_conv.conv_transpose(x, w, pads=[1, 1, 1, 1])
    _with_threshold(monkeypatch, 0)
    got = cpu_conv.conv_transpose(x, w, pads=[1, 1, 1, 1])
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("ns", [1, 2, 3])
def test_conv_image_by_image_matches_the_batched_form(monkeypatch, ns):
    rng = np.random.default_rng(10 + ns)
    monkeypatch.setattr(cpu_conv, "PER_IMAGE_POSITIONS", 1)
    for _ in range(20):
        spatial = [int(v) for v in rng.integers(3, 8, ns)]
        kernel = [int(v) for v in rng.integers(1, 4, ns)]
        attrs = {
            "strides": [int(v) for v in rng.integers(1, 3, ns)],
            "dilations": [int(v) for v in rng.integers(1, 3, ns)],
            "pads": [int(v) for v in rng.integers(0, 2, 2 * ns)],
        }
        x = rng.standard_normal([3, 2, *spatial])
        w = rng.standard_normal([5, 2, *kernel])
        b = rng.standard_normal(5)
        _with_threshold(monkeypatch, 1 << 62)
        try:
            want = cpu_conv.conv(x, w, b, **attrs)
        except KernelError:  # an empty output
            continue
        _with_threshold(monkeypatch, 0)
        got = cpu_conv.conv(x, w, b, **attrs)
        assert got.shape == want.shape and got.flags.c_contiguous
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(attrs))


WHERE_SHAPES = [(), (1,), (3,), (2, 3), (1, 3), (2, 1), (4, 2, 3), (1, 1, 1), (2, 1, 3)]
WHERE_DTYPES = [np.float32, np.float64, np.float16, np.dtype(ml_dtypes.bfloat16), np.int64, np.int32, np.int8, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", WHERE_DTYPES, ids=str)
def test_where_by_bit_masks_gives_np_where_bits(monkeypatch, dtype):
    monkeypatch.setattr(cpu_elementwise, "BIT_SELECT_ELEMENTS", 1)
    rng = np.random.default_rng(0)
    for cs, xs, ys in itertools.product(WHERE_SHAPES, repeat=3):
        try:
            np.broadcast_shapes(cs, xs, ys)
        except ValueError:
            continue
        condition = rng.random(cs) < 0.5
        x = (rng.standard_normal(xs) * 5).astype(dtype)
        if np.dtype(dtype).kind == "f" and x.size:
            x.reshape(-1)[0] = np.nan
        negative_zero = np.array(-0.0 if np.dtype(dtype).kind == "f" else 0).astype(dtype)
        for y in ((rng.standard_normal(ys) * 5).astype(dtype), np.zeros(ys, dtype), negative_zero):
            want = np.array(np.where(condition, x, y))  # a C-ordered copy (0-d stays 0-d)
            got = cpu_elementwise.where(condition, x, y)
            assert isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype, (cs, xs, ys)
            assert np.array_equal(np.array(got).reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)), (cs, xs, ys)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 5, 11), (1000,), (0, 4)], ids=str)
def test_erf_in_chunks_is_the_same_bits_as_in_one_pass(monkeypatch, dtype, shape):
    """erf evaluates its float64 formula chunk by chunk: chunks of 4 elements (boundaries inside
    every axis) give the bits of one chunk, and both stay within float32's rounding of math.erf."""
    import math

    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 2).astype(dtype)
    if x.size:
        x.flat[: min(x.size, 6)] = [0.0, -0.0, 0.5, -0.5, 6.0, -1e-3][: min(x.size, 6)]
    monkeypatch.setattr(cpu_elementwise, "ERF_CHUNK", 10**9)
    whole = cpu_elementwise.erf_array(x)
    monkeypatch.setattr(cpu_elementwise, "ERF_CHUNK", 4)
    chunked = cpu_elementwise.erf_array(x)
    assert chunked.shape == x.shape and chunked.dtype == x.dtype
    np.testing.assert_array_equal(chunked.view(np.uint8), whole.view(np.uint8))
    exact = np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64))
    tolerance = 2e-7 if dtype == np.float32 else 1e-3
    np.testing.assert_allclose(chunked.astype(np.float64), exact, rtol=tolerance, atol=1e-30)


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("values", ["normal", "few integers", "uint8", "zeros and infinities"])
def test_top_k_by_partition_is_the_full_sort(monkeypatch, values, largest):
    """A small K of a long axis is selected by partition; rows with more copies of the K-th value
    than it takes are sorted whole. Positions and values (signed zeros too) equal the stable sort's."""
    from gradgen.kernels.cpu import reduction as cpu_reduction

    rng = np.random.default_rng(12)
    draws = {
        "normal": lambda shape: rng.standard_normal(shape).astype(np.float32),
        "few integers": lambda shape: rng.integers(-3, 4, shape).astype(np.int64),
        "uint8": lambda shape: rng.integers(0, 5, shape).astype(np.uint8),
        "zeros and infinities": lambda shape: rng.choice(np.array([-0.0, 0.0, 1.0, -np.inf, np.inf]), shape),
    }
    for shape, axis in [((3, 80), 1), ((70, 2, 3), 0), ((2, 5, 90), -1), ((2, 65, 3), 1)]:
        x = draws[values](shape)
        k = max(1, shape[axis] // 5)
        monkeypatch.setattr(cpu_reduction, "TOPK_PARTITION_AXIS", 10**9)
        want_values, want_indices = cpu_reduction.top_k(x, np.array([k]), axis=axis, largest=largest)
        monkeypatch.setattr(cpu_reduction, "TOPK_PARTITION_AXIS", 64)
        got_values, got_indices = cpu_reduction.top_k(x, np.array([k]), axis=axis, largest=largest)
        np.testing.assert_array_equal(got_indices, want_indices)
        np.testing.assert_array_equal(got_values, want_values)
        if x.dtype.kind == "f":
            np.testing.assert_array_equal(np.signbit(got_values), np.signbit(want_values))
