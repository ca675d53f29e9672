"""CUDA launchers of ops that used to run their numpy kernel on host copies: AffineGrid (a batched
GEMM with a host-built base grid), Col2Im (ConvTranspose with one-hot kernels) and MaxRoiPool
(pool.cu's max_roi_pool kernel). Each runs on a GPU session and is compared with the CPU session on
the same one-node model, for every dtype and attribute branch the launcher handles, edge cases and
the configurations it hands back to the CPU kernel; every test checks that the launcher itself ran."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.cuda import test_cuda_more_launchers
from tests.cuda.test_cuda_more_launchers import FLOATS, _tol, backward_matches, check, check_raises, loss_model, rand

pytestmark = pytest.mark.cuda

launches = test_cuda_more_launchers.launches  # the fixture: launches(op) lists the launcher's calls


def _summed_tol(dtype):
    """A few products or taps summed in another order than numpy's: float32 within a few ulps,
    the 16-bit types within a rounding or two (computed in float32, rounded once)."""
    return dict(rtol=1e-5, atol=1e-5) if np.dtype(dtype) == np.float32 else _tol(dtype)


# ---------------------------------------------------------------- AffineGrid

AFFINE_SIZES = [(2, 3, 4, 5), (3, 1, 1, 6), (1, 2, 7, 1), (2, 3, 3, 4, 5), (1, 1, 1, 2, 3)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("align_corners", [0, 1])
@pytest.mark.parametrize("size", AFFINE_SIZES, ids=str)
def test_affine_grid(launches, dtype, align_corners, size):
    rng = np.random.default_rng(80)
    nd = len(size) - 2
    theta = rand(rng, (size[0], nd, nd + 1), dtype)
    got = check(
        launches,
        "AffineGrid",
        [theta, np.array(size, np.int64)],
        const=(1,),
        align_corners=align_corners,
        **_summed_tol(dtype),
    )
    assert got["out0"].shape == (size[0], *size[2:], nd)


def test_affine_grid_of_a_fed_size(launches):
    rng = np.random.default_rng(81)
    check(launches, "AffineGrid", [rand(rng, (2, 2, 3)), np.array([2, 3, 5, 4], np.int64)], **_summed_tol(np.float32))


def test_affine_grid_twice_reuses_the_base_grid(launches):
    """Two nodes of one size (the base grid uploaded once) and another size in one process."""
    rng = np.random.default_rng(82)
    for size in [(2, 1, 3, 4), (2, 1, 3, 4), (1, 1, 4, 3)]:
        theta = rand(rng, (size[0], 2, 3))
        check(launches, "AffineGrid", [theta, np.array(size, np.int64)], const=(1,), **_summed_tol(np.float32))


def test_affine_grid_of_an_empty_batch(launches):
    got = check(launches, "AffineGrid", [np.zeros((0, 2, 3), np.float32), np.array([0, 3, 4, 5], np.int64)], const=(1,))
    assert got["out0"].shape == (0, 4, 5, 2)


@pytest.mark.parametrize(
    "theta_shape,size,match",
    [
        ((2, 2, 3), [3, 1, 4, 4], "does not fit"),
        ((2, 3, 4), [2, 1, 4, 4], "does not fit"),
        ((2, 2, 3), [2, 1, 4], "does not fit"),
        ((2, 2, 3), [2, 1, 0, 4], "empty spatial"),
    ],
    ids=str,
)
def test_affine_grid_bad_shapes_raise(launches, theta_shape, size, match):
    check_raises(launches, "AffineGrid", [np.ones(theta_shape, np.float32), np.array(size, np.int64)], match, const=(1,))


# ---------------------------------------------------------------- Col2Im

COL2IMS = [
    ((5,), (2,), {}),
    ((7,), (3,), {"strides": [2], "pads": [1, 2], "dilations": [2]}),
    ((5, 6), (2, 3), {}),
    ((7, 8), (3, 2), {"strides": [2, 3], "pads": [1, 0, 2, 1], "dilations": [1, 2]}),
    ((6, 5), (2, 2), {"strides": [3, 2]}),
    ((4, 4), (1, 1), {}),
    ((4, 5, 6), (2, 2, 3), {"strides": [1, 2, 2], "pads": [0, 1, 1, 1, 0, 2], "dilations": [2, 1, 1]}),
]


def _blocks_per_axis(image, block, attrs) -> list[int]:
    nd = len(image)
    strides, dilations = attrs.get("strides", [1] * nd), attrs.get("dilations", [1] * nd)
    pads = attrs.get("pads", [0] * (2 * nd))
    return [(image[i] + pads[i] + pads[nd + i] - (block[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(nd)]


def _columns(rng, n, c, image, block, attrs, dtype=np.float32):
    return rand(rng, (n, c * math.prod(block), math.prod(_blocks_per_axis(image, block, attrs))), dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("image,block,attrs", COL2IMS, ids=str)
def test_col2im(launches, dtype, image, block, attrs):
    rng = np.random.default_rng(83)
    x = _columns(rng, 2, 3, image, block, attrs, dtype)
    inputs = [x, np.array(image, np.int64), np.array(block, np.int64)]
    got = check(launches, "Col2Im", inputs, const=(1, 2), **attrs, **_summed_tol(dtype))
    assert got["out0"].shape == (2, 3, *image)


def test_col2im_of_fed_shapes(launches):
    rng = np.random.default_rng(84)
    image, block, attrs = (7, 8), (3, 2), {"strides": [2, 3], "pads": [1, 0, 2, 1]}
    x = _columns(rng, 1, 2, image, block, attrs)
    check(launches, "Col2Im", [x, np.array(image, np.int64), np.array(block, np.int64)], **attrs, **_summed_tol(np.float32))


@pytest.mark.parametrize("n,c", [(0, 2), (2, 0)], ids=str)
def test_col2im_of_empty_inputs(launches, n, c):
    rng = np.random.default_rng(85)
    x = _columns(rng, n, c, (4, 5), (2, 2), {})
    got = check(launches, "Col2Im", [x, np.array([4, 5], np.int64), np.array([2, 2], np.int64)], const=(1, 2))
    assert got["out0"].shape == (n, c, 4, 5)


def test_col2im_of_four_spatial_axes_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(86)
    image, block = (3, 3, 2, 2), (2, 1, 2, 1)
    x = _columns(rng, 1, 2, image, block, {})
    check(launches, "Col2Im", [x, np.array(image, np.int64), np.array(block, np.int64)], const=(1, 2))


def test_col2im_of_integers_runs_the_cpu_kernel(launches):
    x = np.arange(2 * 12 * 6, dtype=np.int32).reshape(2, 12, 6)
    check(launches, "Col2Im", [x, np.array([3, 4], np.int64), np.array([2, 2], np.int64)], const=(1, 2), exact=True)


@pytest.mark.parametrize(
    "x_shape,image,block,match",
    [
        ((1, 6, 6), [3, 4], [2, 2], "does not fit"),  # 6 channels: not a multiple of 4 taps
        ((1, 4, 5), [3, 4], [2, 2], "does not fit"),  # 5 columns, 6 block positions
        ((1, 4, 6), [3, 4], [4, 2], "does not fit the padded image"),
    ],
    ids=str,
)
def test_col2im_bad_shapes_raise(launches, x_shape, image, block, match):
    inputs = [np.ones(x_shape, np.float32), np.array(image, np.int64), np.array(block, np.int64)]
    check_raises(launches, "Col2Im", inputs, match, const=(1, 2))


# ---------------------------------------------------------------- MaxRoiPool


def _rois(rng, count, images, low=-3.0, high=14.0, dtype=np.float32):
    """(count, 5) rois: batch indices, then x1, y1, x2, y2 (some reversed, some beyond the image)."""
    boxes = rng.uniform(low, high, (count, 4))
    return np.concatenate([rng.integers(0, images, (count, 1)), boxes], axis=1).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("pooled_shape", [(1, 1), (2, 2), (3, 4)], ids=str)
@pytest.mark.parametrize("spatial_scale", [1.0, 0.5, 0.3])
def test_max_roi_pool(launches, dtype, pooled_shape, spatial_scale):
    rng = np.random.default_rng(87)
    x = rand(rng, (2, 3, 12, 10), dtype)
    rois = _rois(rng, 7, 2, high=14.0 / spatial_scale, dtype=dtype)
    check(launches, "MaxRoiPool", [x, rois], exact=True, pooled_shape=list(pooled_shape), spatial_scale=spatial_scale)


def test_max_roi_pool_of_half_pixel_rois(launches):
    """Coordinates at .5 after scaling round away from zero; boxes outside the image give empty bins (0)."""
    x = np.arange(2 * 2 * 6 * 7, dtype=np.float32).reshape(2, 2, 6, 7) - 40.0
    rois = np.array(
        [
            [0, 0.5, 1.5, 4.5, 3.5],
            [1, -1.5, -0.5, 2.5, 5.5],
            [1, 2.5, 2.5, 2.5, 2.5],
            [0, 20.0, 20.0, 30.0, 30.0],
            [1, -9.0, -9.0, -5.0, -5.0],
            [0, 5.0, 4.0, 1.0, 0.0],
        ],
        np.float32,
    )
    for pooled in ([2, 3], [4, 4]):
        check(launches, "MaxRoiPool", [x, rois], exact=True, pooled_shape=pooled)


def test_max_roi_pool_nan_wins(launches):
    rng = np.random.default_rng(88)
    x = rand(rng, (1, 2, 5, 5))
    x[0, 1, 2, 3] = np.nan
    rois = np.array([[0, 0, 0, 4, 4], [0, 3, 2, 4, 4], [0, 0, 0, 1, 1]], np.float32)
    got = check(launches, "MaxRoiPool", [x, rois], exact=True, pooled_shape=[2, 2])
    assert np.isnan(got["out0"]).any()


def test_max_roi_pool_truncates_batch_indices(launches):
    rng = np.random.default_rng(89)
    x = rand(rng, (2, 2, 6, 6))
    rois = np.array([[1.7, 0, 0, 5, 5], [-0.5, 1, 1, 4, 3], [0.99, 2, 0, 5, 5]], np.float32)
    check(launches, "MaxRoiPool", [x, rois], exact=True, pooled_shape=[2, 2])


@pytest.mark.parametrize("x_shape,count", [((2, 3, 6, 6), 0), ((2, 0, 6, 6), 3), ((2, 3, 0, 6), 3), ((2, 3, 6, 6), 3)], ids=str)
def test_max_roi_pool_of_empty_shapes(launches, x_shape, count):
    rng = np.random.default_rng(90)
    pooled = [0, 2] if count == 3 and x_shape == (2, 3, 6, 6) else [2, 2]
    got = check(launches, "MaxRoiPool", [rand(rng, x_shape), _rois(rng, count, 2)], exact=True, pooled_shape=pooled)
    assert got["out0"].shape == (count, x_shape[1], *pooled)


@pytest.mark.parametrize("batch", [2.0, -1.0, 5.5])
def test_max_roi_pool_batch_out_of_range_raises(launches, batch):
    rng = np.random.default_rng(91)
    rois = _rois(rng, 4, 2)
    rois[2, 0] = batch
    check_raises(launches, "MaxRoiPool", [rand(rng, (2, 3, 6, 6)), rois], "roi 2 has batch index", pooled_shape=[2, 2])


def test_max_roi_pool_batch_out_of_range_in_an_empty_output_raises(launches):
    rng = np.random.default_rng(92)
    rois = _rois(rng, 3, 2)
    rois[1, 0] = 3.0
    check_raises(launches, "MaxRoiPool", [rand(rng, (2, 0, 6, 6)), rois], "roi 1 has batch index", pooled_shape=[2, 2])


def test_max_roi_pool_bad_rois_shape_raises(launches):
    check_raises(
        launches, "MaxRoiPool", [np.ones((1, 2, 4, 4), np.float32), np.ones((3, 4), np.float32)], "rois", pooled_shape=[2, 2]
    )


def test_max_roi_pool_of_rois_in_another_dtype_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(93)
    check(launches, "MaxRoiPool", [rand(rng, (2, 3, 8, 8)), _rois(rng, 5, 2, dtype=np.float64)], exact=True, pooled_shape=[2, 2])


def test_max_roi_pool_in_a_backward_graph(launches):
    rng = np.random.default_rng(94)
    x = rand(rng, (2, 3, 8, 7), np.float64)
    model, feeds = loss_model("MaxRoiPool", [x, _rois(rng, 5, 2, high=9.0, dtype=np.float64)], const=(1,), pooled_shape=[2, 3])
    calls = launches("MaxRoiPool")
    backward_matches(model, feeds, rtol=1e-10, atol=1e-12)
    assert calls, "the MaxRoiPool launcher did not run in the backward graph"
