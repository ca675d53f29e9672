"""CUDA launchers of ArgMax/ArgMin, DFT, Det, NonZero and Compress (formerly CUDA_FALLBACKS, or
never launched on the GPU): each runs on a GPU session and is compared with the CPU session on the
same one-node model, for every dtype and attribute branch the launcher handles, edge cases (empty
tensors, negative axes, ties, NaN) and a configuration it hands back to the CPU kernel. Every test
checks that the launcher itself ran."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import FLOATS, _tol, backward_matches, check, check_raises, launches, loss_model, rand

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


# ---------------------------------------------------------------- DFT


def _dft_inputs(x, length=None, axis=None):
    """DFT's inputs of opset 20: X, then dft_length and axis where given (initializers)."""
    return [x, None if length is None else np.array(length, np.int64), None if axis is None else np.array(axis, np.int64)]


def _dft_tol(dtype):
    """A sum over the signal in another order than numpy's FFT (16-bit: float32, rounded once)."""
    return _tol(dtype, f32=2e-5, f64=1e-11)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "shape,axis,length,inverse,onesided",
    [
        ((2, 8, 2), 1, None, 0, 0),  # complex forward
        ((2, 8, 1), 1, None, 0, 1),  # real, one-sided
        ((3, 7, 1), None, 10, 0, 0),  # the default axis (-2), zero padding
        ((3, 9, 2), 1, 5, 1, 0),  # inverse, truncated
        ((2, 5, 2), 1, None, 1, 1),  # one-sided inverse (irfft), n = 8
        ((2, 4, 2), -2, 7, 1, 1),  # irfft of odd length
        ((2, 4, 1), 1, 6, 1, 1),  # irfft of a real input
        ((4, 3, 6, 2), 0, None, 0, 0),  # the axis moved next to the last and back
        ((2, 6, 3, 1), 1, 8, 0, 1),
        ((2, 3, 5, 2), -3, None, 1, 0),
    ],
    ids=str,
)
def test_dft(launches, dtype, shape, axis, length, inverse, onesided):
    rng = np.random.default_rng(70)
    inputs = _dft_inputs(rand(rng, shape, dtype), length, axis)
    check(launches, "DFT", inputs, const=(1, 2), opset=20, inverse=inverse, onesided=onesided, **_dft_tol(dtype))


@pytest.mark.parametrize("axis,onesided", [(1, 0), (0, 1), (-2, 0)])
def test_dft_axis_as_the_opset_17_attribute(launches, axis, onesided):
    rng = np.random.default_rng(71)
    x = rand(rng, (3, 6, 2), np.float64)
    check(launches, "DFT", [x], opset=17, axis=axis, onesided=onesided, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize(
    "shape,length,inverse,onesided",
    [((0, 8, 2), None, 0, 0), ((2, 0, 2), 4, 0, 0), ((2, 0, 1), 4, 1, 0), ((0, 5, 2), None, 1, 1)],
    ids=str,
)
def test_dft_of_empty_inputs(launches, shape, length, inverse, onesided):
    check(
        launches,
        "DFT",
        _dft_inputs(np.zeros(shape, np.float32), length, 1),
        const=(1, 2),
        opset=20,
        inverse=inverse,
        onesided=onesided,
    )


def test_dft_too_long_for_its_matrix_runs_the_cpu_kernel(launches):
    """A 3000-point complex transform: its DFT matrix (6000 x 6000 doubles) exceeds DFT_MATRIX_BYTES."""
    rng = np.random.default_rng(72)
    check(
        launches, "DFT", _dft_inputs(rand(rng, (1, 3000, 2), np.float64), None, 1), const=(1, 2), opset=20, rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize(
    "shape,length,axis,match",
    [
        ((2, 4, 2), None, 2, "last axis"),
        ((2, 4, 2), None, 3, "out of range"),
        ((2, 4, 2), 0, 1, "positive"),
        ((2, 4, 3), None, 1, "end in"),
    ],
    ids=str,
)
def test_dft_bad_inputs_raise(launches, shape, length, axis, match):
    inputs = _dft_inputs(np.ones(shape, np.float32), length, axis)
    check_raises(launches, "DFT", inputs, match, const=(1, 2), opset=20)


@pytest.mark.parametrize(
    "shape,length,attrs",
    [
        ((2, 6, 2), None, {}),
        ((2, 6, 1), None, {"onesided": 1}),
        ((2, 5, 2), 3, {"inverse": 1}),
        ((2, 4, 2), None, {"inverse": 1, "onesided": 1}),
    ],
    ids=str,
)
def test_dft_backward(launches, shape, length, attrs):
    """The gradient rule's graph holds DFTs of other forms (the transposes of these)."""
    rng = np.random.default_rng(73)
    model, feeds = loss_model("DFT", _dft_inputs(rand(rng, shape, np.float64), length, 1), const=(1, 2), opset=20, **attrs)
    calls = launches("DFT")
    backward_matches(model, feeds, wrt=list(feeds), rtol=1e-10, atol=1e-11)
    assert len(calls) >= 2, "the DFT launcher did not run for the backward graph's transposed DFT"


# ---------------------------------------------------------------- NonZero, Compress


def _sparse(rng, shape, dtype, density):
    """Values of ``dtype`` that are non-zero with probability ``density``."""
    x = (rng.random(shape) < density) * rng.integers(1, 4, shape)
    return np.asarray(x).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.uint8, *INTS, *FLOATS], ids=str)
@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (0, 3), (300, 257), (1, 2, 1, 3, 1)], ids=str)
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_non_zero(launches, dtype, shape, density):
    rng = np.random.default_rng(80)
    check(launches, "NonZero", [_sparse(rng, shape, dtype, density)])


def test_non_zero_counts_nan_and_not_negative_zero(launches):
    x = np.array([[0.0, -0.0, np.nan], [np.inf, 0.0, -1e-30]], np.float32)
    got = check(launches, "NonZero", [x])["out0"]
    np.testing.assert_array_equal(got, [[0, 1, 1], [2, 0, 2]])


def test_non_zero_of_uint16_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(81)
    check(launches, "NonZero", [_sparse(rng, (4, 5), np.uint16, 0.5)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_], ids=str)
@pytest.mark.parametrize(
    "shape,axis,length",
    [((3, 4), 0, 3), ((3, 4), 1, 2), ((3, 4), -1, 4), ((2, 3, 4), 1, 3), ((3, 4), None, 7), ((3, 4), None, 12), ((5,), 0, 5)],
    ids=str,
)
@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_compress(launches, dtype, shape, axis, length, density):
    rng = np.random.default_rng(82)
    data, condition = _sparse(rng, shape, dtype, 0.7), rng.random(length) < density
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "Compress", [data, condition], **attrs)


@pytest.mark.parametrize("shape,axis,length", [((0, 4), None, 0), ((3, 0), 0, 3), ((3, 4), 1, 0), ((0, 4), 1, 4)], ids=str)
def test_compress_of_empty_inputs(launches, shape, axis, length):
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "Compress", [np.ones(shape, np.float32), np.ones(length, np.bool_)], **attrs)


@pytest.mark.parametrize("shape,axis,length", [((3, 4), 0, 4), ((3, 4), None, 13)], ids=str)
def test_compress_of_a_condition_too_long_raises(launches, shape, axis, length):
    attrs = {} if axis is None else {"axis": axis}
    check_raises(launches, "Compress", [np.ones(shape, np.float32), np.ones(length, np.bool_)], "condition has", **attrs)


def test_compress_backward(launches):
    """Compress's gradient scatters into the kept positions, which NonZero finds."""
    rng = np.random.default_rng(83)
    condition = np.array([True, False, True, True, False])
    model, feeds = loss_model("Compress", [rand(rng, (3, 5), np.float64), condition], axis=1)
    compress_calls, non_zero_calls = launches("Compress"), launches("NonZero")
    backward_matches(model, feeds, wrt=["in0"], rtol=1e-12, atol=1e-12)
    assert compress_calls and non_zero_calls


# ---------------------------------------------------------------- Det


def _well_conditioned(rng, shape, dtype):
    """Matrices near 2 I (determinants near 2^n, far from singular)."""
    n = shape[-1]
    m = rng.uniform(-0.5, 0.5, shape) + 2 * np.eye(n)
    return m.astype(np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else m


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (3, 3), (4, 4), (2, 3, 5, 5), (7, 8, 8), (2, 32, 32)], ids=str)
def test_det(launches, dtype, shape):
    rng = np.random.default_rng(90)
    check(launches, "Det", [_well_conditioned(rng, shape, dtype)], **_tol(dtype, f32=1e-5, f64=1e-11))


def test_det_of_general_matrices_needs_row_swaps(launches):
    """Standard normal matrices: the pivots come from other rows (determinants of either sign)."""
    rng = np.random.default_rng(91)
    check(launches, "Det", [rng.standard_normal((50, 6, 6))], rtol=1e-10, atol=1e-12)


def test_det_of_singular_and_empty_matrices(launches):
    x = np.array([[[1.0, 2.0], [2.0, 4.0]], [[0.0, 1.0], [0.0, 3.0]], [[0.0, 1.0], [1.0, 0.0]]])
    got = check(launches, "Det", [x], rtol=1e-12, atol=1e-12)["out0"]
    assert got[1] == 0 and got[2] == -1
    check(launches, "Det", [np.zeros((3, 0, 0))])  # the empty product: 1
    check(launches, "Det", [np.zeros((0, 4, 4), np.float32)])


def test_det_of_large_matrices_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(92)
    check(launches, "Det", [_well_conditioned(rng, (2, 40, 40), np.float64)], rtol=1e-10, atol=1e-10)


def test_det_of_non_square_matrices_raises(launches):
    check_raises(launches, "Det", [np.ones((2, 3, 4), np.float32)], "square")


def test_det_backward(launches):
    rng = np.random.default_rng(93)
    model, feeds = loss_model("Det", [_well_conditioned(rng, (3, 4, 4), np.float64)])
    calls = launches("Det")
    backward_matches(model, feeds, wrt=list(feeds), rtol=1e-10, atol=1e-12)
    assert calls, "the Det launcher did not run"
