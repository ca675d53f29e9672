"""CUDA launchers of pooling ops that used to run their numpy kernel on host copies: LpPool and LRN
(AveragePool's kernel with every tap counted), MaxUnpool and ONNX Runtime training's MaxPoolGrad
(indexing's row scatter), AveragePoolGrad (ConvTranspose with a ones kernel). Each runs on a GPU
session and is compared with the CPU session on the same one-node model, for every dtype and
attribute branch the launcher handles, edge cases and the configurations it hands back to the CPU
kernel; every test checks that the launcher itself ran."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.kernels.cpu.pool import max_pool as cpu_max_pool
from tests.cuda import test_cuda_more_launchers
from tests.cuda.test_cuda_more_launchers import (
    FLOATS,
    _tol,
    backward_matches,
    check,
    check_raises,
    check_refused_at_load,
    loss_model,
    rand,
)

pytestmark = pytest.mark.cuda

launches = test_cuda_more_launchers.launches  # the fixture: launches(op) lists the launcher's calls


def _composed_tol(dtype):
    """A window sum in another order than numpy's, then a power or a division: float32 within a
    few ulps, the 16-bit types within a rounding or two (computed in float32, rounded once)."""
    return dict(rtol=1e-5, atol=1e-5) if np.dtype(dtype) == np.float32 else _tol(dtype)


# ---------------------------------------------------------------- LpPool

POOLS = [
    ((2, 3, 7), {"kernel_shape": [3]}),
    ((2, 3, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}),
    ((1, 2, 7, 6), {"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 8, 6), {"kernel_shape": [2, 2], "dilations": [2, 1], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "pads": [1, 0, 1, 0, 1, 1]}),
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("shape,attrs", POOLS, ids=str)
def test_lp_pool(launches, dtype, p, shape, attrs):
    rng = np.random.default_rng(60)
    check(launches, "LpPool", [rand(rng, shape, dtype)], p=p, **attrs, **_composed_tol(dtype))


def test_lp_pool_of_an_empty_batch(launches):
    check(launches, "LpPool", [np.zeros((0, 2, 4, 4), np.float32)], kernel_shape=[2, 2])


def test_lp_pool_of_four_spatial_axes_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(61)
    check(launches, "LpPool", [rand(rng, (1, 2, 3, 3, 3, 3))], kernel_shape=[2, 2, 2, 2], p=2, rtol=1e-6, atol=1e-6)


def test_lp_pool_without_kernel_shape_is_refused():
    check_refused_at_load("LpPool", [np.ones((1, 2, 4, 4), np.float32)], "lacks the attribute 'kernel_shape'")


# ---------------------------------------------------------------- LRN


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (2, 3), (1, 6, 7), (2, 4, 3, 2, 2)], ids=str)
def test_lrn(launches, dtype, size, shape):
    rng = np.random.default_rng(62)
    check(launches, "LRN", [rand(rng, shape, dtype)], size=size, alpha=0.3, beta=0.6, bias=1.5, **_composed_tol(dtype))


def test_lrn_defaults(launches):
    rng = np.random.default_rng(63)
    check(launches, "LRN", [rand(rng, (2, 8, 5, 5), np.float32, -20, 20)], size=5, **_composed_tol(np.float32))


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 0, 3), (2, 3, 0)], ids=str)
def test_lrn_of_empty_tensors(launches, shape):
    check(launches, "LRN", [np.zeros(shape, np.float32)], size=3)


def test_lrn_without_size_is_refused():
    check_refused_at_load("LRN", [np.ones((1, 3, 2, 2), np.float32)], "lacks the attribute 'size'")


# ---------------------------------------------------------------- MaxUnpool


def _inferred_size(shape, attrs) -> int:
    ns = len(shape) - 2
    strides, pads = attrs.get("strides", [1] * ns), attrs.get("pads", [0] * (2 * ns))
    spatial = [(shape[2 + i] - 1) * strides[i] - pads[i] - pads[ns + i] + attrs["kernel_shape"][i] for i in range(ns)]
    return int(np.prod(list(shape[:2]) + spatial))


UNPOOLS = [
    ((2, 3, 3, 3), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((1, 2, 3), {"kernel_shape": [3], "strides": [2], "pads": [1, 0]}),
    ((1, 2, 2, 2, 3), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}),
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape,attrs", UNPOOLS, ids=str)
def test_max_unpool(launches, dtype, shape, attrs):
    rng = np.random.default_rng(64)
    x = rand(rng, shape, dtype)
    indices = rng.choice(_inferred_size(shape, attrs), size=x.size, replace=False).reshape(shape).astype(np.int64)
    check(launches, "MaxUnpool", [x, indices], exact=True, **attrs)


@pytest.mark.parametrize("const", [(2,), ()], ids=["initializer", "fed"])
def test_max_unpool_into_a_larger_output_shape(launches, const):
    rng = np.random.default_rng(65)
    x = rand(rng, (2, 3, 3, 3))
    indices = rng.choice(2 * 3 * 6 * 6, size=x.size, replace=False).reshape(x.shape).astype(np.int64)
    output_shape = np.array([2, 3, 7, 8], np.int64)
    got = check(launches, "MaxUnpool", [x, indices, output_shape], const=const, exact=True, kernel_shape=[2, 2], strides=[2, 2])
    assert got["out0"].shape == (2, 3, 7, 8)


def test_max_unpool_of_max_pool_with_overlapping_windows(launches):
    """Overlapping windows repeat an index, with the same value each time (MaxPool's output)."""
    rng = np.random.default_rng(66)
    x = rand(rng, (2, 2, 5, 5))
    y, indices = cpu_max_pool(x, kernel_shape=[2, 2], strides=[1, 1], _num_outputs=2)
    assert len(np.unique(indices)) < indices.size
    check(launches, "MaxUnpool", [y, indices], exact=True, kernel_shape=[2, 2], strides=[1, 1])


def test_max_unpool_of_an_empty_batch(launches):
    check(launches, "MaxUnpool", [np.zeros((0, 2, 2, 2), np.float32), np.zeros((0, 2, 2, 2), np.int64)], kernel_shape=[2, 2])


@pytest.mark.parametrize("bad", [-1, -100, 2 * 3 * 6 * 6])
def test_max_unpool_index_out_of_range_raises(launches, bad):
    rng = np.random.default_rng(67)
    x = rand(rng, (2, 3, 3, 3))
    indices = rng.choice(2 * 3 * 6 * 6, size=x.size, replace=False).reshape(x.shape).astype(np.int64)
    indices[1, 2, 0, 1] = bad
    check_raises(launches, "MaxUnpool", [x, indices], "out of range", kernel_shape=[2, 2], strides=[2, 2])


def test_max_unpool_output_shape_smaller_than_inferred_raises(launches):
    x, indices = np.ones((1, 1, 2, 2), np.float32), np.arange(4, dtype=np.int64).reshape(1, 1, 2, 2)
    check_raises(
        launches,
        "MaxUnpool",
        [x, indices, np.array([1, 1, 3, 3], np.int64)],
        "smaller",
        const=(2,),
        kernel_shape=[2, 2],
        strides=[2, 2],
    )


# ---------------------------------------------------------------- MaxPoolGrad

MAX_POOLS = [
    ((2, 3, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 3, 7, 6), {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}),
    ((1, 2, 6), {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}),
    ((1, 2, 5, 5), {"kernel_shape": [3, 2], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 4, 4, 4), {"kernel_shape": [2, 2, 2], "strides": [2, 1, 2]}),
]


def _max_pool_indices(rng, shape, attrs):
    """MaxPool's Indices over distinct values (the argmax unambiguous); X's shape is the one dY
    alone tells (the windows reach its end)."""
    x = rng.permutation(int(np.prod(shape))).reshape(shape).astype(np.float32)
    _, indices = cpu_max_pool(x, _num_outputs=2, **attrs)
    return indices


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape,attrs", MAX_POOLS, ids=str)
def test_max_pool_grad(launches, dtype, shape, attrs):
    rng = np.random.default_rng(68)
    indices = _max_pool_indices(rng, shape, attrs)
    check(launches, "MaxPoolGrad", [rand(rng, indices.shape, dtype), indices], **attrs, **_composed_tol(dtype))


def test_max_pool_grad_of_an_empty_batch(launches):
    dy, indices = np.zeros((0, 2, 2, 2), np.float32), np.zeros((0, 2, 2, 2), np.int64)
    check(launches, "MaxPoolGrad", [dy, indices], kernel_shape=[2, 2], strides=[2, 2])


@pytest.mark.parametrize("position,bad", [((0, 0, 0, 0), -1), ((0, 0, 0, 0), 36), ((1, 2, 1, 1), 0), ((1, 2, 1, 1), 216)])
def test_max_pool_grad_index_outside_its_plane_raises(launches, position, bad):
    rng = np.random.default_rng(69)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2]}
    indices = _max_pool_indices(rng, (2, 3, 6, 6), attrs)
    indices[position] = bad
    check_raises(launches, "MaxPoolGrad", [rand(rng, indices.shape), indices], "indices fall outside", **attrs)


def test_max_pool_grad_of_a_larger_input_raises(launches):
    """X of 7 under ceil_mode windows of 3 by 2: dY alone says 6, and an index may reach 6."""
    rng = np.random.default_rng(70)
    attrs = {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}
    x = np.array([[[0, 1, 2, 3, 4, 5, 9]]], np.float32)
    _, indices = cpu_max_pool(x, _num_outputs=2, **attrs)
    assert indices.max() == 6
    check_raises(launches, "MaxPoolGrad", [rand(rng, indices.shape), indices], "indices fall outside", **attrs)


# ---------------------------------------------------------------- AveragePoolGrad

AVERAGE_POOLS = [
    ((2, 3, 3, 3), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    ((2, 3, 4, 4), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    ((2, 3, 4, 3), {"kernel_shape": [3, 2], "pads": [1, 0, 2, 1], "strides": [2, 1]}),
    ((1, 2, 3), {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}),
    ((1, 2, 3, 4), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 3, 4), {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 2, 3, 2), {"kernel_shape": [2, 2, 2], "pads": [1, 0, 1, 1, 1, 0]}),
    ((1, 1, 3, 3), {"kernel_shape": [2, 2], "pads": [3, 3, 0, 0]}),  # windows entirely in the padding
]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("shape,attrs", AVERAGE_POOLS, ids=str)
def test_average_pool_grad(launches, dtype, include_pad, shape, attrs):
    rng = np.random.default_rng(71)
    dy = rand(rng, shape, dtype)
    check(launches, "AveragePoolGrad", [dy], count_include_pad=include_pad, **attrs, **_composed_tol(dtype))


def test_average_pool_grad_of_an_empty_batch(launches):
    check(launches, "AveragePoolGrad", [np.zeros((0, 2, 3, 3), np.float32)], kernel_shape=[2, 2])


@pytest.mark.parametrize(
    "shape,attrs,match",
    [
        ((1, 1, 3, 3), {"kernel_shape": [2, 2], "dilations": [2, 1]}, "dilations"),
        ((1, 1, 2, 2, 2, 2), {"kernel_shape": [1, 1, 1, 1]}, "1 to 3 spatial axes"),
        ((1, 1, 3, 3), {}, "kernel_shape"),
    ],
    ids=["dilations", "four_axes", "no_kernel_shape"],
)
def test_average_pool_grad_refusals(launches, shape, attrs, match):
    check_raises(launches, "AveragePoolGrad", [np.ones(shape, np.float32)], match, **attrs)


# ---------------------------------------------------------------- in backward graphs


@pytest.mark.parametrize(
    "op_type,shape,attrs",
    [
        ("LpPool", (2, 3, 6, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "p": 2}),
        ("LpPool", (2, 3, 7), {"kernel_shape": [2], "p": 3}),
        ("LRN", (2, 5, 3, 3), {"size": 3, "alpha": 0.3, "beta": 0.6, "bias": 1.5}),
    ],
)
def test_pool_launchers_in_backward_graphs(launches, op_type, shape, attrs):
    rng = np.random.default_rng(72)
    model, feeds = loss_model(op_type, [rand(rng, shape, np.float64, 0.5, 1.5)], **attrs)
    calls = launches(op_type)
    backward_matches(model, feeds, rtol=1e-10, atol=1e-12)
    assert calls, f"the {op_type} launcher did not run in the backward graph"
