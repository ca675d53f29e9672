"""CUDA Unique (formerly CUDA_FALLBACKS): the flattened case sorts X's (key, position) pairs on the
device (reduction.py's sorted_pairs) and numbers the runs of equal keys; each test runs a one-node
model on the CPU and on the GPU session, checks that the launcher ran and compares every output
exactly: every dtype the launcher handles, sorted 0 and 1, one to four outputs, ties, NaN, -0,
empty and single-element inputs, lengths across the sort's tile (2,048 pairs) and 100,000 elements;
slices along an axis (a sort per column); other dtypes and empty slices run the CPU kernel."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import BF16, FLOATS, backward_matches, check, launches, loss_model, rand

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module

INTS = [np.int32, np.int64]
OUTPUTS = ("out0", "out1", "out2", "out3")


def _ties(rng, shape, dtype, distinct=5):
    """Values drawn from ``distinct`` small integers (negative ones included): most elements tie."""
    return rng.integers(-(distinct // 2), distinct - distinct // 2, shape).astype(np.float32).astype(dtype)


def _unique(launches, x, *, outputs=4, **attrs):
    return check(launches, "Unique", [x], outputs=outputs, exact=True, **attrs)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("shape", [(), (1,), (2,), (7,), (3, 4), (2, 3, 5), (300, 7), (4097,)], ids=str)
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique(launches, dtype, shape, sorted_):
    rng = np.random.default_rng(100)
    _unique(launches, _ties(rng, shape, dtype), sorted=sorted_)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_of_distinct_values(launches, dtype, sorted_):
    """No ties (a permutation): one run per element; and every element equal: one run."""
    rng = np.random.default_rng(101)
    _unique(launches, rng.permutation(600).astype(np.float32).astype(dtype).reshape(20, 30), sorted=sorted_)
    _unique(launches, np.full((3, 700), 3, dtype), sorted=sorted_)


@pytest.mark.parametrize("outputs", [1, 2, 3, 4])
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_output_counts(launches, outputs, sorted_):
    rng = np.random.default_rng(102)
    got = _unique(launches, _ties(rng, (5, 9), np.float32), outputs=outputs, sorted=sorted_)
    assert sorted(got) == list(OUTPUTS[:outputs])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_nan_and_signed_zero(launches, dtype, sorted_):
    """Every NaN is one value (after +inf), -0 equals +0 and Y keeps the first zero's sign."""
    rng = np.random.default_rng(103)
    pool = np.array([np.nan, -np.nan, 0.0, -0.0, 1.5, -2.0, np.inf, -np.inf], np.float32)
    for first_zero in (-0.0, 0.0):
        x = np.concatenate([[first_zero], rng.choice(pool, 3000)]).astype(dtype)
        got = _unique(launches, x, sorted=sorted_)
        want = np.unique(x.astype(np.float32))  # the CPU kernel's values (16-bit floats run in float32)
        assert got["out0"].shape == want.shape
        y = got["out0"].astype(np.float32)
        zero = np.flatnonzero(y == 0)
        assert zero.size == 1 and np.signbit(y[zero[0]]) == np.signbit(first_zero)


@pytest.mark.parametrize("dtype", INTS, ids=str)
def test_unique_of_integer_extremes(launches, dtype):
    """The largest integer sorts next to the sort's padding (key ~0); the smallest first."""
    info = np.iinfo(dtype)
    x = np.array([info.max, 0, info.min, info.max, -1, info.min, info.max], dtype)
    for sorted_ in (0, 1):
        _unique(launches, x, sorted=sorted_)


@pytest.mark.parametrize("shape", [(0,), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int64], ids=str)
def test_unique_of_an_empty_tensor(launches, shape, dtype):
    for sorted_ in (0, 1):
        _unique(launches, np.zeros(shape, dtype), sorted=sorted_)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_of_100k_elements(launches, dtype, sorted_):
    """Across many sort stages: 1,000 values tied about 100 times each, then 100,000 distinct-ish
    draws (16-bit floats: many ties by rounding)."""
    rng = np.random.default_rng(104)
    _unique(launches, _ties(rng, (100_000,), dtype, distinct=1000), sorted=sorted_)
    x = rng.standard_normal(100_000) * 1e4
    _unique(launches, x.astype(np.float32).astype(dtype) if dtype != np.float64 else x, sorted=sorted_)


@pytest.fixture
def on_the_device(monkeypatch):
    """Unique's launcher may not hand the case to its CPU kernel."""
    from gradgen.kernels.cuda import indexing

    def refuse(op_type, *args, **kwargs):
        raise AssertionError(f"{op_type} ran its CPU kernel")

    monkeypatch.setattr(indexing, "cpu_fallback", refuse)


def _slices(rng, shape, axis, dtype):
    """Slices along ``axis`` drawn from three patterns: most of them repeat."""
    patterns = _ties(rng, (3, *np.delete(shape, axis)), dtype, distinct=3)
    picks = rng.integers(0, 3, shape[axis])
    return np.moveaxis(patterns[picks], 0, axis)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize(
    "shape, axis", [((6, 4), 0), ((6, 4), 1), ((6, 4), -1), ((5, 3, 4), 1), ((5, 3, 4), 2), ((1, 7), 0), ((3000, 3), 0)], ids=str
)
@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_along_an_axis(launches, on_the_device, dtype, shape, axis, sorted_):
    rng = np.random.default_rng(107)
    _unique(launches, _slices(rng, shape, axis, dtype), axis=axis, sorted=sorted_)


@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique_slices_with_nan_and_signed_zeros(launches, on_the_device, sorted_):
    """numpy's rule for slices: -0 equals +0 (the first occurrence's bits kept), a NaN slice is
    unequal to every other, NaN ones sorted last."""
    nan = np.nan
    x = np.array([[nan, 1], [0.0, 2], [nan, 1], [-0.0, 2], [1, nan], [0.0, 1], [-0.0, 2]], np.float32)
    _unique(launches, x, axis=0, sorted=sorted_)


def test_unique_along_an_axis_with_an_empty_slice_runs_the_cpu_kernel(launches):
    _unique(launches, np.zeros((4, 0), np.float32), axis=0)


def test_unique_of_uint8_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(105)
    _unique(launches, rng.integers(0, 4, (6, 5)).astype(np.uint8), sorted=0)


def test_unique_backward(launches):
    """dX is GatherGrad of dY at the first occurrences (the forward Unique's second output)."""
    rng = np.random.default_rng(106)
    x = rand(rng, (4, 5), np.float64)
    x[1] = x[0]  # ties: the gradient goes to the first of equal ones
    model, feeds = loss_model("Unique", [x])
    calls = launches("Unique")
    backward_matches(model, feeds, wrt=["in0"], rtol=1e-12, atol=1e-12)
    assert calls
