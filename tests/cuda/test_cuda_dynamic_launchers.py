"""CUDA launchers of ArgMax/ArgMin, DFT, Det, NonZero and Compress (formerly CUDA_FALLBACKS, or
never launched on the GPU): each runs on a GPU session and is compared with the CPU session on the
same one-node model, for every dtype and attribute branch the launcher handles, edge cases (empty
tensors, negative axes, ties, NaN) and a configuration it hands back to the CPU kernel. Every test
checks that the launcher itself ran."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import FLOATS, check, check_raises, launches, rand

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module

INTS = [np.int32, np.int64]


# ---------------------------------------------------------------- ArgMax / ArgMin


def _with_ties(rng, shape, dtype):
    """Values drawn from a handful, so that most lines hold ties (select_last_index matters)."""
    return rng.integers(-2, 3, shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize(
    "shape,axis",
    [((3, 40), -1), ((5, 300), 1), ((3, 5), 1), ((2, 3, 4), 1), ((2, 3, 4), 0), ((4, 70), 0), ((7,), 0), ((2, 1, 33), -1)],
    ids=str,
)
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_extremes(launches, dtype, op_type, shape, axis, keepdims, select_last_index):
    rng = np.random.default_rng(60)
    for x in (
        rand(rng, shape, dtype) if np.dtype(dtype).kind == "f" else _with_ties(rng, shape, dtype),
        _with_ties(rng, shape, dtype),
    ):
        check(launches, op_type, [x], axis=axis, keepdims=keepdims, select_last_index=select_last_index)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("select_last_index", [0, 1])
@pytest.mark.parametrize("length", [5, 40])  # one thread per line, one warp per line
def test_arg_extremes_of_nans_and_signed_zeros(launches, op_type, select_last_index, length):
    """numpy's rule: the first (or last) NaN wins over any number; -0 ties with +0."""
    x = np.zeros((5, length), np.float32)
    x[0, 1], x[0, 3] = np.nan, np.nan
    x[1, 0], x[1, 2] = -0.0, 0.0
    x[1, 1:] = -0.0
    x[2, :] = [np.inf if k % 2 else -np.inf for k in range(length)]
    x[3, -1] = np.nan
    x[4, :] = 1.0
    got = check(launches, op_type, [x], axis=1, keepdims=0, select_last_index=select_last_index)["out0"]
    assert got[0] == (3 if select_last_index else 1) and got[3] == length - 1
    check(launches, op_type, [x.T.copy()], axis=0, keepdims=0, select_last_index=select_last_index)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
def test_arg_extremes_of_empty_lines_raise_and_no_lines_are_empty(launches, op_type):
    check_raises(launches, op_type, [np.zeros((3, 0), np.float32)], "empty axis", axis=1)
    check(launches, op_type, [np.zeros((0, 4), np.float32)], axis=1, keepdims=1)
    check(launches, op_type, [np.zeros((0, 4), np.float32)], axis=1, keepdims=0)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
def test_arg_extremes_of_int8_run_the_cpu_kernel(launches, op_type):
    rng = np.random.default_rng(61)
    check(launches, op_type, [rng.integers(-100, 100, (3, 6)).astype(np.int8)], axis=-1, select_last_index=1)
