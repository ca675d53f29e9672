"""The CUDA executor's row-statistics cross-entropy pass (gradgen/executor/fused_loss.py) on plan
steps; its kernels run in tests/cuda/test_cuda_loss.py."""

from __future__ import annotations

import pytest

from gradgen.executor import Session, fusion
from gradgen.executor.fused_loss import FORWARD, GRADIENT, fuse_loss_stats
from tests.cross_entropy_models import cross_entropy_head


def _plan(**kwargs):
    model, _ = cross_entropy_head(**kwargs)
    with Session(model, device="cpu") as sess:
        steps = list(sess.steps)
        return steps, set(sess.output_names), fusion.static_shapes(steps, sess.graph)


@pytest.mark.parametrize("kwargs", [{}, {"reduction": "none", "weights": True, "ignore_index": 3}, {"reduction": "sum"}], ids=str)
def test_loss_and_gradient_take_row_statistics(kwargs):
    steps, keep, shapes = _plan(**kwargs)
    fused = fuse_loss_stats(steps, keep, shapes)
    forward = next(s for s in fused if s.op_type == FORWARD)
    gradient = next(s for s in fused if s.op_type == GRADIENT)
    original = next(s for s in steps if s.op_type == "SoftmaxCrossEntropyLoss")
    assert forward.inputs == original.inputs and forward.outputs[0] == original.outputs[0]
    assert gradient.inputs[1] == original.inputs[0]  # the gradient reads the scores ...
    assert gradient.inputs[2] == forward.outputs[1]  # ... and the forward's row statistics
    assert original.outputs[1] not in {n for s in fused for n in [*s.inputs, *s.outputs]}  # no log-probabilities
    assert len(fused) == len(steps)


def test_small_vocabularies_and_kept_log_probabilities_stay():
    steps, keep, shapes = _plan(classes=1024)
    assert fuse_loss_stats(steps, keep, shapes) == steps
    steps, keep, shapes = _plan()
    log_prob = next(s for s in steps if s.op_type == "SoftmaxCrossEntropyLoss").outputs[1]
    assert fuse_loss_stats(steps, keep | {log_prob}, shapes) == steps
    assert fuse_loss_stats(steps, keep, {}) == steps  # shapes the graph does not declare
