"""The CUDA executor's residual fusion pass (gradgen/executor/fused_norm_grad.py) on plan steps;
its kernels run in tests/cuda/test_cuda_norm.py."""

from __future__ import annotations

import numpy as np

from gradgen.executor import Session
from gradgen.executor.fused_norm_grad import OP_TYPE, fuse_residual_sum
from gradgen.kernels import registry
from gradgen.kernels.table import MICROSOFT
from tests.residual_norm_models import pre_norm_block


def _steps(layers: int = 2):
    model, _ = pre_norm_block(layers=layers)
    with Session(model, device="cpu") as sess:
        return list(sess.steps), set(sess.output_names)


def test_each_residual_sum_joins_its_layer_norm_gradient():
    steps, keep = _steps(layers=3)
    norm_grads = [s for s in steps if s.op_type == "LayerNormalizationGrad"]
    fused = fuse_residual_sum(steps, keep)
    made = [s for s in fused if s.op_type == OP_TYPE]
    assert len(norm_grads) == 3 and len(made) == 3
    assert len(fused) == len(steps) - 3
    sums = {s.outputs[0]: s for s in steps if s.op_type == "Sum"}
    for step in made:
        assert step.outputs[0] in sums  # the fused step writes the Sum's value ...
        assert sums[step.outputs[0]].outputs[0] not in {s.outputs[0] for s in fused if s.op_type == "Sum"}
        assert step.inputs[-1] in sums[step.outputs[0]].inputs  # ... adding the Sum's other input
    # every value a step reads is made by an earlier step (or is a constant / input)
    made_before: set[str] = set()
    produced = {n for s in fused for n in s.outputs}
    for step in fused:
        assert all(n in made_before for n in step.inputs if n and n in produced), step.node_name
        made_before.update(step.outputs)


def test_a_kept_dx_or_a_three_input_sum_stays():
    steps, keep = _steps(layers=1)
    dx = next(s for s in steps if s.op_type == "LayerNormalizationGrad").outputs[0]
    assert not [s for s in fuse_residual_sum(steps, keep | {dx}) if s.op_type == OP_TYPE]
    for s in steps:
        if s.op_type == "Sum" and dx in s.inputs:
            s.inputs = [*s.inputs, s.inputs[0]]
    assert not [s for s in fuse_residual_sum(steps, keep) if s.op_type == OP_TYPE]


def test_host_form_is_layer_norm_grad_plus_residual():
    steps, keep = _steps(layers=1)
    step = next(s for s in fuse_residual_sum(steps, keep) if s.op_type == OP_TYPE)
    rng = np.random.default_rng(3)
    rows, cols = 6, 40
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    dy, res = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2))
    scale = rng.standard_normal(cols).astype(np.float32)
    mean = x.mean(axis=1, keepdims=True).astype(np.float32)
    inv = (1 / np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)).astype(np.float32)
    want = registry.lookup(MICROSOFT, "LayerNormalizationGrad").cpu(dy, x, scale, mean, inv, **step.attributes)
    got = step.entry.cpu(dy, x, scale, mean, inv, res, **step.attributes)
    np.testing.assert_array_equal(got[0], want[0] + res)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(g, w)
