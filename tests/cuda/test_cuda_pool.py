"""CUDA pooling launchers against the numpy kernels, on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.kernels.cpu import pool as cpu_pool
from tests.cuda.test_cuda_conv import DTYPES, check, rand

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_warnings")]


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
