"""CUDA NonMaxSuppression: every (batch, class) pair sorted and selected in one block on the device
(indexing.cu's nms_corners / nms_select / nms_pack), the count of rows read back to the host. Each
test runs a one-node model on the CPU and on the GPU session, checks that the launcher ran and
compares the selected indices exactly: every float dtype (16-bit ones computed in float32), both
box formats, score and IoU thresholds, box limits, tied scores, NaN / -0 / infinite scores, NaN and
zero-area boxes, box counts across the sort's powers of two, many pairs, scalars fed or constant,
0-d or omitted, empty inputs and the errors."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import FLOATS, check, check_raises, launches

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module

OP = "NonMaxSuppression"
SCALARS = (2, 3, 4)  # max_output_boxes_per_class, iou_threshold, score_threshold


def _boxes(rng, shape, center_point_box, dtype=np.float32, spread=4.0):
    """Boxes of ``shape`` (batches, boxes): corners in either order per axis, or centres and sizes."""
    start = rng.uniform(0, spread, shape + (2,))
    size = rng.uniform(0.2, 2.0, shape + (2,))
    if center_point_box:
        boxes = np.concatenate([start, size], axis=-1)
    else:
        boxes = np.concatenate([start, start + size * rng.choice([-1, 1], shape + (2,))], axis=-1)
    return boxes.astype(np.float32).astype(dtype)


def _tied_scores(rng, shape, dtype=np.float32, levels=6):
    return (rng.integers(0, levels, shape) / levels).astype(np.float32).astype(dtype)


def _scalars(limit, iou, score):
    return [
        None if limit is None else np.array([limit], np.int64),
        None if iou is None else np.array([iou], np.float32),
        None if score is None else np.array([score], np.float32),
    ]


def _nms(launches, boxes, scores, limit=10, iou=0.5, score=None, *, const=SCALARS, **attrs):
    return check(launches, OP, [boxes, scores, *_scalars(limit, iou, score)], exact=True, const=const, **attrs)["out0"]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("score", [None, 0.3])
@pytest.mark.parametrize("iou", [0.0, 0.5])
@pytest.mark.parametrize("limit", [1, 5, 1000])
def test_nms(launches, dtype, center_point_box, score, iou, limit):
    rng = np.random.default_rng(200)
    boxes = _boxes(rng, (2, 50), center_point_box, dtype)
    scores = _tied_scores(rng, (2, 3, 50), dtype)
    _nms(launches, boxes, scores, limit, iou, score, center_point_box=center_point_box)


@pytest.mark.parametrize("count", [1, 2, 3, 255, 256, 257, 1000, 2049, 5000])
def test_box_counts_across_the_sort(launches, count):
    rng = np.random.default_rng(201)
    boxes = _boxes(rng, (1, count), 0, spread=np.sqrt(count) * 2)
    scores = rng.uniform(0, 1, (1, 2, count)).astype(np.float32)
    got = _nms(launches, boxes, scores, count, 0.4, 0.05)
    assert len(got) > 0


def test_many_pairs(launches):
    """150 (batch, class) pairs, limits reached in some, many rows."""
    rng = np.random.default_rng(202)
    boxes = _boxes(rng, (3, 64), 1, spread=8.0)
    scores = _tied_scores(rng, (3, 50, 64), levels=20)
    _nms(launches, boxes, scores, 7, 0.3, 0.2, center_point_box=1)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_scores(launches, dtype):
    """NaN scores come last (and never pass a threshold); -0 ties +0; infinities sort at the ends."""
    rng = np.random.default_rng(203)
    pool = np.array([np.nan, -np.nan, 0.0, -0.0, 0.5, -0.5, np.inf, -np.inf], np.float32)
    boxes = _boxes(rng, (2, 300), 0, dtype, spread=20.0)
    scores = rng.choice(pool, (2, 2, 300)).astype(dtype)
    for score in (None, -1.0, 0.0, -0.0):
        _nms(launches, boxes, scores, 300, 0.5, score)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("center_point_box", [0, 1])
def test_degenerate_boxes(launches, dtype, center_point_box):
    """Zero-area boxes, identical boxes (kept only at threshold 1), touching and nested boxes, NaN
    and infinite coordinates (a NaN box suppresses nothing and is never suppressed)."""
    if center_point_box:
        rows = [
            [1, 1, 0, 0],
            [1, 1, 2, 0],
            [1, 1, 2, 2],
            [3, 1, 2, 2],
            [1, 1, 2, 2],
            [1, 1, 1, 1],
            [np.nan, 1, 2, 2],
            [1, 1, np.inf, 2],
        ]
    else:
        rows = [
            [1, 1, 1, 1],
            [0, 1, 2, 1],
            [0, 0, 2, 2],
            [0, 2, 2, 4],
            [2, 2, 0, 0],
            [0.5, 0.5, 1.5, 1.5],
            [0, np.nan, 2, 2],
            [0, 0, 2, np.inf],
        ]
    boxes = np.array([rows], np.float32).astype(dtype)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]]], np.float32).astype(
        dtype
    )
    for iou in (0.0, 0.2, 0.5, 1.0):
        _nms(launches, boxes, scores, 8, iou, center_point_box=center_point_box)


def test_fed_zero_d_and_omitted_scalars(launches):
    """Scalars fed as graph inputs (read back to the host), 0-d, empty, or omitted: no
    max_output_boxes_per_class gives no rows, no iou_threshold is 0, no score_threshold keeps all."""
    rng = np.random.default_rng(204)
    boxes, scores = _boxes(rng, (2, 40), 0), _tied_scores(rng, (2, 3, 40))
    _nms(launches, boxes, scores, 6, 0.4, 0.2, const=())
    zero_d = [np.array(6, np.int64), np.array(0.4, np.float32), np.array(0.2, np.float32)]
    check(launches, OP, [boxes, scores, *zero_d], exact=True, const=SCALARS)
    empty = np.zeros((0,), np.float32)
    check(launches, OP, [boxes, scores, np.array([6], np.int64), empty, empty], exact=True, const=SCALARS)
    assert check(launches, OP, [boxes, scores], exact=True)["out0"].shape == (0, 3)
    check(launches, OP, [boxes, scores, np.array([6], np.int64)], exact=True, const=SCALARS)
    check(launches, OP, [boxes, scores, None, None, np.array([0.5], np.float32)], exact=True, const=SCALARS)


@pytest.mark.parametrize("limit", [0, -3, 2**63 - 1])
def test_limits(launches, limit):
    rng = np.random.default_rng(205)
    got = _nms(launches, _boxes(rng, (1, 30), 1), _tied_scores(rng, (1, 2, 30)), limit, 0.5)
    assert (len(got) == 0) == (limit <= 0)


@pytest.mark.parametrize("shape,classes", [((1, 0), 2), ((0, 5), 2), ((2, 5), 0)])
def test_empty(launches, shape, classes):
    boxes = np.zeros(shape + (4,), np.float32)
    scores = np.zeros((shape[0], classes, shape[1]), np.float32)
    assert _nms(launches, boxes, scores).shape == (0, 3)


@pytest.mark.parametrize(
    "boxes_shape,scores_shape,attrs,match",
    [
        ((1, 3, 5), (1, 1, 3), {}, "boxes must have shape"),
        ((1, 3, 4), (1, 1, 4), {}, "scores must have shape"),
        ((2, 3, 4), (1, 1, 3), {}, "scores must have shape"),
        ((1, 3, 4), (1, 1, 3), {"center_point_box": 2}, "center_point_box must be 0 or 1"),
    ],
)
def test_errors(launches, boxes_shape, scores_shape, attrs, match):
    inputs = [np.zeros(boxes_shape, np.float32), np.zeros(scores_shape, np.float32), *_scalars(2, 0.5, None)]
    check_raises(launches, OP, inputs, match, const=SCALARS, **attrs)


def test_two_valued_limit_raises(launches):
    inputs = [np.zeros((1, 3, 4), np.float32), np.zeros((1, 1, 3), np.float32), np.array([1, 2], np.int64)]
    check_raises(launches, OP, inputs, "max_output_boxes_per_class must hold one value", const=SCALARS)
