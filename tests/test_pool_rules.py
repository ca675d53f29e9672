"""LpPool, GlobalLpPool and MaxUnpool: gradgen's gradients against torch.autograd (float64)
(finite differences: tests/grad_cases/conv.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

torch = pytest.importorskip("torch")
F = torch.nn.functional

rng = np.random.default_rng(77)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("kernel,stride", [((2, 2), (2, 2)), ((3, 2), (1, 2)), ((2, 3), (2, 1))])
def test_lp_pool_p2_vs_torch(kernel, stride, symbolic):
    """p = 2 (torch raises x to the power p without |.|, the same function for even p)."""
    inputs = {"x": rng.normal(size=(2, 3, 6, 5))}
    want_shape = F.lp_pool2d(torch.tensor(inputs["x"]), 2, kernel, stride).shape
    attrs = {"kernel_shape": list(kernel), "strides": list(stride), "p": 2}
    got, w = run_gradgen("LpPool", inputs, {}, attrs, [tuple(want_shape)], symbolic=symbolic)
    assert_close(got, torch_grads(lambda x: F.lp_pool2d(x, 2, kernel, stride), inputs, w))


@pytest.mark.parametrize("p", [1, 3])
def test_lp_pool_odd_p_vs_torch_on_positive_inputs(p):
    inputs = {"x": rng.uniform(0.2, 2.0, size=(1, 2, 4, 6))}
    got, w = run_gradgen("LpPool", inputs, {}, {"kernel_shape": [2, 3], "strides": [2, 3], "p": p}, [(1, 2, 2, 2)])
    assert_close(got, torch_grads(lambda x: F.lp_pool2d(x, p, (2, 3), (2, 3)), inputs, w))


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("p", [1, 2, 3])
def test_global_lp_pool_vs_torch(p, symbolic):
    inputs = {"x": rng.normal(size=(2, 3, 4, 5))}
    got, w = run_gradgen("GlobalLpPool", inputs, {}, {"p": p}, [(2, 3, 1, 1)], symbolic=symbolic)
    assert_close(got, torch_grads(lambda x: torch.linalg.vector_norm(x, p, dim=(2, 3), keepdim=True), inputs, w))


def test_global_lp_pool_all_zero_plane_gets_a_zero_gradient():
    x = rng.normal(size=(1, 2, 3, 3))
    x[0, 1] = 0.0
    got, _ = run_gradgen("GlobalLpPool", {"x": x}, {}, {"p": 2}, [(1, 2, 1, 1)])
    assert np.isfinite(got["x"]).all()
    np.testing.assert_array_equal(got["x"][0, 1], 0.0)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("output_size", [None, (7, 9)])
def test_max_unpool_vs_torch(output_size, symbolic):
    """torch's indices count within each (n, c) plane, ONNX's over the whole tensor."""
    n, c, h, w_ = 2, 3, 6, 8
    pooled, plane_indices = F.max_pool2d(torch.tensor(rng.normal(size=(n, c, h, w_))), 2, 2, return_indices=True)
    planes = (np.arange(n * c).reshape(n, c, 1, 1) * h * w_).astype(np.int64)
    consts = {"indices": plane_indices.numpy() + planes}
    out_shape = (n, c, h, w_) if output_size is None else (n, c, *output_size)
    if output_size is not None:
        consts["output_shape"] = np.array(out_shape, dtype=np.int64)
    inputs = {"x": pooled.numpy()}
    got, w = run_gradgen("MaxUnpool", inputs, consts, {"kernel_shape": [2, 2], "strides": [2, 2]}, [out_shape], symbolic=symbolic)

    def unpool(x):
        y = F.max_unpool2d(x, plane_indices, 2, 2)  # the inferred shape; ONNX pads output_shape after it
        return F.pad(y, (0, out_shape[3] - w_, 0, out_shape[2] - h))

    assert_close(got, torch_grads(unpool, inputs, w))
