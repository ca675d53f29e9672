"""CUDA launchers of Hardmax, IsInf and EyeLike, composed of ArgMax's and OneHot's kernels and the
elementwise comparisons: each runs a one-node model on the CPU and on the GPU (where the launcher
must run) and compares, exactly (they select, compare or place ones)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from tests.cuda.test_cuda_more_launchers import FLOATS, check, launches, rand

__all__ = ["launches"]  # the fixture, used by name

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("opset, axis", [(13, None), (13, 0), (13, 1), (13, -2), (11, None), (11, 0), (11, 2)], ids=str)
def test_hardmax(launches, dtype, opset, axis):
    rng = np.random.default_rng(0)
    x = rand(rng, (3, 4, 5), dtype)
    x[0, 0, :2] = x[0, 0].max()  # a tie: the first largest wins
    x[1, 2, 3] = np.nan  # NaN counts as the largest, as np.argmax
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "Hardmax", [x], opset=opset, exact=True, **attrs)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 0, 3)], ids=str)
def test_hardmax_of_empty_tensors(launches, shape):
    check(launches, "Hardmax", [np.zeros(shape, np.float32)], exact=True)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("negative, positive", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_is_inf(launches, dtype, negative, positive):
    x = np.array([[np.inf, -np.inf, np.nan, 0.0], [1.0, -2.0, np.inf, -0.0]]).astype(dtype)
    check(launches, "IsInf", [x], opset=20, exact=True, detect_negative=negative, detect_positive=positive)


def test_is_inf_of_integers_runs_the_cpu_kernel(launches):
    check(launches, "IsInf", [np.arange(6, dtype=np.int32).reshape(2, 3)], opset=20, exact=True)


@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (1, 1), (0, 3), (3, 0)], ids=str)
@pytest.mark.parametrize("k", [-5, -1, 0, 2, 7])
def test_eye_like(launches, shape, k):
    check(launches, "EyeLike", [np.zeros(shape, np.float32)], exact=True, k=k)


@pytest.mark.parametrize(
    "to", [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL], ids=str
)
def test_eye_like_output_types(launches, to):
    check(launches, "EyeLike", [np.zeros((3, 5), np.int64)], exact=True, k=1, dtype=to)
