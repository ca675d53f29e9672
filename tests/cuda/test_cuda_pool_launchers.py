"""CUDA launchers of pooling ops that used to run their numpy kernel on host copies: LpPool and LRN
(AveragePool's kernel with every tap counted). Each runs on a GPU session and is compared with the
CPU session on the same one-node model, for every dtype and attribute branch the launcher handles,
edge cases and the configurations it hands back to the CPU kernel; every test checks that the
launcher itself ran."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda import test_cuda_more_launchers
from tests.cuda.test_cuda_more_launchers import (
    FLOATS,
    _tol,
    backward_matches,
    check,
    check_raises,
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


def test_lp_pool_without_kernel_shape_raises(launches):
    check_raises(launches, "LpPool", [np.ones((1, 2, 4, 4), np.float32)], "kernel_shape")


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


def test_lrn_without_size_raises(launches):
    check_raises(launches, "LRN", [np.ones((1, 3, 2, 2), np.float32)], "size attribute")


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
