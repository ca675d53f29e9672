"""InPlaceAccumulatorV2 and ZeroGradient (ONNX Runtime training's gradient-accumulation ops, which
gradgen's training artifacts hold) on the GPU: the same values as the CPU kernels, the buffer
overwritten or accumulated (a broadcast value too), the flag true, the input buffer unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.table import MICROSOFT
from tests.cuda.test_cuda_more_launchers import _run, assert_same, launches, single_node

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module


def _accumulate(buffer, value, overwrite):
    inputs = [buffer, value] + ([] if overwrite is None else [np.array([overwrite])])
    model, feeds = single_node("InPlaceAccumulatorV2", inputs, domain=MICROSOFT, outputs=2)
    want = _run(model, {k: v.copy() for k, v in feeds.items()}, "cpu")
    return model, feeds, want


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64], ids=str)
@pytest.mark.parametrize("overwrite", [None, False, True])
@pytest.mark.parametrize("value_shape", [(3, 4), (4,), (1, 1)], ids=str)
def test_in_place_accumulator_v2(launches, dtype, overwrite, value_shape):
    if overwrite and value_shape != (3, 4):
        pytest.skip("overwriting takes a value of the buffer's size")
    rng = np.random.default_rng(0)
    buffer = rng.standard_normal((3, 4)).astype(dtype)
    model, feeds, want = _accumulate(buffer, rng.standard_normal(value_shape).astype(dtype), overwrite)
    calls = launches("InPlaceAccumulatorV2", MICROSOFT)
    before = {k: v.copy() for k, v in feeds.items()}
    got = _run(model, feeds, "cuda")
    assert calls
    assert_same(got, want, exact=True)
    assert got["out0"].tolist() == [True]
    for name, value in before.items():
        np.testing.assert_array_equal(feeds[name], value)


def test_in_place_accumulator_v2_refuses_a_value_that_does_not_broadcast(launches):
    model, feeds = single_node(
        "InPlaceAccumulatorV2", [np.zeros((3, 4), np.float32), np.ones((5,), np.float32)], domain=MICROSOFT, outputs=2
    )
    launches("InPlaceAccumulatorV2", MICROSOFT)
    with pytest.raises(KernelError, match="does not broadcast"):
        _run(model, feeds, "cuda")


def test_zero_gradient(launches):
    model, feeds = single_node("ZeroGradient", [np.full((2, 5), 3.0, np.float32), np.array([True])], domain=MICROSOFT)
    calls = launches("ZeroGradient", MICROSOFT)
    got = _run(model, feeds, "cuda")
    assert calls
    np.testing.assert_array_equal(got["out0"], np.zeros((2, 5), np.float32))
