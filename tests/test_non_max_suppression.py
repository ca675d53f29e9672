"""NonMaxSuppression: the CPU kernel against ONNX's reference evaluator on one-node models, over
both box formats (corners in either order, centre and size), score thresholds (strictly greater),
IoU thresholds, box limits, tied scores (by box index), zero-area, touching and identical boxes,
several batches and classes, empty inputs; the omitted inputs' defaults, NaN scores and the errors
(which the reference does not cover) against expectations written out."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.errors import KernelError
from gradgen.executor import Session
from tests.fuzz_graphs import single_node_inputs

rng = np.random.default_rng(31)
NAMES = ("boxes", "scores", "max_output_boxes_per_class", "iou_threshold", "score_threshold")


def _model(inputs, opset=11, **attrs):
    """(model, feeds): one NonMaxSuppression node; boxes and scores fed, the scalars initializers
    (None: omitted)."""
    fed = {0, 1}
    names, graph_inputs, initializers = single_node_inputs(inputs, fed)
    node = helper.make_node("NonMaxSuppression", names, ["selected"], **attrs)
    graph = helper.make_graph(
        [node],
        "nms",
        graph_inputs,
        [helper.make_tensor_value_info("selected", TensorProto.INT64, None)],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model, {f"in{i}": np.asarray(inputs[i]) for i in fed}


def _run(inputs, **attrs) -> np.ndarray:
    model, feeds = _model(inputs, **attrs)
    return Session(model).run(feeds)["selected"]


def _scalars(limit, iou, score, dtype=np.float32):
    return [
        None if limit is None else np.array([limit], np.int64),
        None if iou is None else np.array([iou], dtype),
        None if score is None else np.array([score], dtype),
    ]


def matches_reference(boxes, scores, limit, iou, score=None, **attrs) -> np.ndarray:
    inputs = [boxes, scores, *_scalars(limit, iou, score, boxes.dtype)]
    model, feeds = _model(inputs, **attrs)
    got = Session(model).run(feeds)["selected"]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == np.int64 and got.shape == (len(want), 3)
    np.testing.assert_array_equal(got, want)
    return got


def random_boxes(shape, center_point_box, dtype=np.float32, spread=4.0):
    """Boxes of ``shape`` (batches, boxes): corners in either order, or centres and sizes."""
    start = rng.uniform(0, spread, shape + (2,))
    size = rng.uniform(0.2, 2.0, shape + (2,))
    if center_point_box:
        boxes = np.concatenate([start, size], axis=-1)
    else:
        end = start + size * rng.choice([-1, 1], shape + (2,))  # either corner first, per axis
        boxes = np.concatenate([start, end], axis=-1)
    return boxes.astype(dtype)


def tied_scores(shape, levels=6, dtype=np.float32):
    """Scores from a few levels: many ties (broken by box index)."""
    return (rng.integers(0, levels, shape) / levels).astype(dtype)


@pytest.mark.parametrize("center_point_box", [0, 1])
@pytest.mark.parametrize("iou", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("score", [None, 0.4])
@pytest.mark.parametrize("limit", [0, 1, 3, 1000])
def test_random_boxes_match_the_reference(center_point_box, iou, score, limit):
    boxes = random_boxes((2, 40), center_point_box)
    scores = tied_scores((2, 3, 40))
    matches_reference(boxes, scores, limit, iou, score, center_point_box=center_point_box)


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_many_boxes_and_distinct_scores_match_the_reference(center_point_box):
    boxes = random_boxes((3, 300), center_point_box, spread=10.0)
    scores = rng.uniform(0, 1, (3, 4, 300)).astype(np.float32)
    got = matches_reference(boxes, scores, 50, 0.4, 0.1, center_point_box=center_point_box)
    assert len(got) > 100


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_float64_matches_the_reference(center_point_box):
    boxes = random_boxes((2, 60), center_point_box, np.float64)
    scores = tied_scores((2, 2, 60), dtype=np.float64)
    matches_reference(boxes, scores, 20, 0.25, 0.2, center_point_box=center_point_box)


def test_rows_are_ordered_by_batch_class_and_score():
    boxes = np.array([[[0, 0, 1, 1], [0, 5, 1, 6], [0, 10, 1, 11]]] * 2, np.float32)
    scores = np.array([[[0.1, 0.9, 0.5], [0.7, 0.2, 0.8]], [[0.3, 0.3, 0.3], [0.0, 1.0, 0.5]]], np.float32)
    got = matches_reference(boxes, scores, 10, 0.5)
    want = [[0, 0, 1], [0, 0, 2], [0, 0, 0], [0, 1, 2], [0, 1, 0], [0, 1, 1]]
    want += [[1, 0, 0], [1, 0, 1], [1, 0, 2], [1, 1, 1], [1, 1, 2], [1, 1, 0]]
    np.testing.assert_array_equal(got, want)


def test_equal_scores_go_by_box_index():
    """Identical boxes of equal scores: the lowest index is kept, the others suppressed."""
    boxes = np.tile(np.array([2, 2, 4, 4], np.float32), (1, 5, 1))
    scores = np.array([[[0.5, 0.9, 0.9, 0.2, 0.9]]], np.float32)
    np.testing.assert_array_equal(matches_reference(boxes, scores, 5, 0.5), [[0, 0, 1]])


def test_score_threshold_is_strict():
    boxes = np.array([[[0, 0, 1, 1], [0, 2, 1, 3], [0, 4, 1, 5]]], np.float32)
    scores = np.array([[[0.5, 0.25, 0.75]]], np.float32)
    np.testing.assert_array_equal(matches_reference(boxes, scores, 3, 0.5, 0.5), [[0, 0, 2]])


@pytest.mark.parametrize("center_point_box", [0, 1])
def test_degenerate_boxes_match_the_reference(center_point_box):
    """Zero-area boxes (a point, a segment) never suppress nor are suppressed; boxes that only touch
    have no intersection; identical boxes have IoU 1 (kept only at threshold 1); nested boxes."""
    if center_point_box:
        rows = [[1, 1, 0, 0], [1, 1, 2, 0], [1, 1, 2, 2], [3, 1, 2, 2], [1, 1, 2, 2], [1, 1, 1, 1], [1, 1, 0, 2]]
    else:
        rows = [[1, 1, 1, 1], [0, 1, 2, 1], [0, 0, 2, 2], [0, 2, 2, 4], [2, 2, 0, 0], [0.5, 0.5, 1.5, 1.5], [1, 0, 1, 2]]
    boxes = np.array([rows], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]]], np.float32)
    for iou in (0.0, 0.2, 0.5, 1.0):
        matches_reference(boxes, scores, 7, iou, center_point_box=center_point_box)


def test_touching_and_disjoint_boxes_are_all_kept_at_threshold_zero():
    boxes = np.array([[[0, 0, 1, 1], [0, 1, 1, 2], [1, 0, 2, 1], [5, 5, 6, 6]]], np.float32)
    scores = np.array([[[0.4, 0.3, 0.2, 0.1]]], np.float32)
    assert len(matches_reference(boxes, scores, 4, 0.0)) == 4


@pytest.mark.parametrize("shape", [(1, 0), (0, 3)])
@pytest.mark.parametrize("classes", [0, 2])
def test_empty_inputs(shape, classes):
    boxes = np.zeros(shape + (4,), np.float32)
    scores = np.zeros((shape[0], classes, shape[1]), np.float32)
    matches_reference(boxes, scores, 3, 0.5)
    assert _run([boxes, scores, *_scalars(3, 0.5, 0.1)]).shape == (0, 3)


def _example():
    boxes = random_boxes((2, 30), 0)
    scores = rng.uniform(0, 1, (2, 3, 30)).astype(np.float32)
    return boxes, scores


def test_omitted_inputs_take_the_defaults():
    """No max_output_boxes_per_class (or 0, or a negative one): no boxes; no iou_threshold: 0; no
    score_threshold: every box is a candidate. The reference cannot run without the first two."""
    boxes, scores = _example()
    assert _run([boxes, scores]).shape == (0, 3)
    assert _run([boxes, scores, None, np.array([0.5], np.float32)]).shape == (0, 3)
    assert _run([boxes, scores, *_scalars(-2, 0.5, None)]).shape == (0, 3)
    want = matches_reference(boxes, scores, 10, 0.0)
    np.testing.assert_array_equal(_run([boxes, scores, np.array([10], np.int64)]), want)
    np.testing.assert_array_equal(_run([boxes, scores, *_scalars(10, None, None)]), want)
    np.testing.assert_array_equal(_run([boxes, scores, *_scalars(10, 0.0, None)[:2]]), want)


def test_zero_d_and_empty_scalars():
    """Scalars given 0-d (as the spec writes them) act as one-element ones; empty ones as omitted."""
    boxes, scores = _example()
    want = matches_reference(boxes, scores, 5, 0.3, 0.2)
    got = _run([boxes, scores, np.array(5, np.int64), np.array(0.3, np.float32), np.array(0.2, np.float32)])
    np.testing.assert_array_equal(got, want)
    empty = np.zeros((0,), np.float32)
    np.testing.assert_array_equal(
        _run([boxes, scores, np.array([5], np.int64), empty, empty]), matches_reference(boxes, scores, 5, 0.0)
    )


def test_nan_scores_come_last_and_never_pass_a_score_threshold():
    boxes = np.array([[[0, 0, 1, 1], [0, 2, 1, 3], [0, 4, 1, 5], [0, 6, 1, 7]]], np.float32)
    scores = np.array([[[np.nan, 0.5, np.nan, -np.inf]]], np.float32)
    np.testing.assert_array_equal(_run([boxes, scores, *_scalars(4, 0.5, None)]), [[0, 0, 1], [0, 0, 3], [0, 0, 0], [0, 0, 2]])
    np.testing.assert_array_equal(_run([boxes, scores, *_scalars(4, 0.5, -1.0)]), [[0, 0, 1]])


def test_nan_boxes_suppress_nothing():
    boxes = np.array([[[np.nan, 0, 1, 1], [0, 0, 1, 1], [0, 0, 1, np.nan]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    assert len(matches_reference(boxes, scores, 3, 0.0)) == 3


@pytest.mark.parametrize(
    "boxes_shape,scores_shape,match",
    [
        ((1, 3, 5), (1, 1, 3), "boxes must have shape"),
        ((3, 4), (1, 1, 3), "boxes must have shape"),
        ((1, 3, 4), (1, 1, 4), "scores must have shape"),
        ((2, 3, 4), (1, 1, 3), "scores must have shape"),
        ((1, 3, 4), (1, 3), "scores must have shape"),
    ],
)
def test_bad_shapes_raise(boxes_shape, scores_shape, match):
    inputs = [np.zeros(boxes_shape, np.float32), np.zeros(scores_shape, np.float32), *_scalars(2, 0.5, None)]
    with pytest.raises(KernelError, match=match):
        _run(inputs)


def test_bad_scalars_and_attribute_raise():
    boxes, scores = _example()
    with pytest.raises(KernelError, match="max_output_boxes_per_class must hold one value"):
        _run([boxes, scores, np.array([1, 2], np.int64)])
    with pytest.raises(KernelError, match="iou_threshold must hold one value"):
        _run([boxes, scores, np.array([1], np.int64), np.array([0.1, 0.2], np.float32)])
    with pytest.raises(KernelError, match="center_point_box must be 0 or 1"):
        _run([boxes, scores, *_scalars(2, 0.5, None)], center_point_box=2)


def test_opset_10_matches_the_reference():
    boxes, scores = _example()
    inputs = [boxes, scores, *_scalars(4, 0.5, 0.3)]
    model, feeds = _model(inputs, opset=10)
    np.testing.assert_array_equal(Session(model).run(feeds)["selected"], ReferenceEvaluator(model).run(None, feeds)[0])
