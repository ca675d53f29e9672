"""CPU elementwise kernels registered from tables: each is its numpy ufunc, and ONNX's one-type ops
refuse operands of different dtypes instead of letting numpy promote them."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cpu import elementwise
from gradgen.kernels.registry import lookup

ONE_TYPE = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Equal": np.equal,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "BitwiseAnd": np.bitwise_and,
    "BitwiseOr": np.bitwise_or,
    "BitwiseXor": np.bitwise_xor,
}
LOGIC = {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}
UNARY = {
    "Neg": np.negative,
    "Abs": np.abs,
    "Sign": np.sign,
    "Floor": np.floor,
    "Ceil": np.ceil,
    "Round": np.round,
    "Sqrt": np.sqrt,
    "Exp": np.exp,
    "Log": np.log,
    "Reciprocal": np.reciprocal,
    "Not": np.logical_not,
    "IsNaN": np.isnan,
    "BitwiseNot": np.bitwise_not,
}


def kernel(op_type):
    return lookup("", op_type).cpu


@pytest.mark.parametrize("op_type", sorted(ONE_TYPE))
def test_one_type_binary_ops_are_their_ufunc_and_refuse_mixed_dtypes(op_type):
    a = np.array([[1, 6, 3]], dtype=np.int32)
    b = np.array([[3], [6]], dtype=np.int32)
    got = kernel(op_type)(a, b)
    np.testing.assert_array_equal(got, ONE_TYPE[op_type](a, b))
    assert got.dtype == ONE_TYPE[op_type](a, b).dtype
    with pytest.raises(KernelError, match="inputs have different dtypes"):
        kernel(op_type)(a, b.astype(np.int64))


@pytest.mark.parametrize("op_type", sorted(LOGIC))
def test_logic_ops_are_their_ufunc(op_type):
    a, b = np.array([True, False, True]), np.array([[True], [False]])
    np.testing.assert_array_equal(kernel(op_type)(a, b), LOGIC[op_type](a, b))


@pytest.mark.parametrize("op_type", sorted(UNARY))
def test_unary_ops_are_their_ufunc(op_type):
    special = {"Not": np.array([True, False]), "BitwiseNot": np.array([-2, 3], np.int64)}
    x = special.get(op_type, np.array([-1.5, 0.25, 2.5, np.nan], np.float32))
    with np.errstate(invalid="ignore", divide="ignore"):
        got, want = kernel(op_type)(x), UNARY[op_type](x)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype


def test_float32_erf_is_within_two_ulp_everywhere():
    """Erf's float32 path (a rational fit evaluated in float64) against math.erf on a dense sweep
    of [-6, 6] (the fit's clip at 4 included), tiny and subnormal values, signed zeros, infinities
    and NaN: within 2 ulp of float32's rounding, as CUDA's erff."""
    import math

    erf = lookup("", "Erf").cpu
    sweep = np.linspace(-6, 6, 240_001, dtype=np.float32)
    tiny = np.array([1e-40, -1e-40, 1e-30, -3e-8, 2e-4], dtype=np.float32)
    x = np.concatenate([sweep, tiny, np.nextafter(np.float32(4), np.float32(0), dtype=np.float32)[None]])
    exact = np.array([math.erf(v) for v in x.astype(np.float64)])
    got = erf(x)
    assert got.dtype == np.float32
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got - exact) / ulp) <= 2.0
    specials = erf(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32))
    assert specials.tolist()[:4] == [0.0, 0.0, 1.0, -1.0] and np.signbit(specials[1]) and np.isnan(specials[4])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_is_within_four_ulp_on_both_of_its_forms(dtype):
    """Sigmoid's numpy path: 1 / (1 + exp(-x)) in four passes where exp(-x) stays finite, the
    overflow-free eight-pass form where any input lies below that (or is NaN). Both against the
    float64 / long double truth on a dense sweep, in chunks below oneDNN's sizes; the extremes
    keep their subnormal and saturated values."""
    sigmoid = lookup("", "Sigmoid").cpu
    wide = np.longdouble
    low = float(elementwise._SIGMOID_DIRECT_FROM[np.dtype(dtype)])
    sweep = np.linspace(low, 40, 200_001).astype(dtype)
    with_extremes = np.concatenate([sweep, np.array([low - 5, -np.inf, np.inf, 0.0, -0.0], dtype)])
    for x in (sweep, with_extremes):  # the four-pass form, then the eight-pass one
        got = np.concatenate([sigmoid(part) for part in np.array_split(x, 20)])
        assert got.dtype == dtype
        truth = 1 / (1 + np.exp(-x.astype(wide)))
        ulp = np.spacing(truth.astype(dtype)).astype(wide)
        assert np.max(np.abs(got - truth) / ulp) <= 4.0
    assert sigmoid(np.array([np.nan, 1.0], dtype)).tolist()[1] == pytest.approx(1 / (1 + np.exp(-1.0)))
    assert np.isnan(sigmoid(np.array([np.nan, 1.0], dtype))[0])
    scalar = sigmoid(np.array(0.5, dtype))  # a 0-d input stays an array
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and scalar == pytest.approx(1 / (1 + np.exp(-0.5)))
    extremes = sigmoid(np.array([-np.inf, np.inf, low - 5], dtype))
    assert extremes[0] == 0.0 and extremes[1] == 1.0 and 0.0 < extremes[2] < np.finfo(dtype).tiny


def _tanh_gelu_truth(x64):
    k, c = np.sqrt(2 / np.pi), 0.044715
    t = np.tanh(k * (x64 + c * x64**3))
    return 0.5 * x64 * (1 + t), 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * k * (1 + 3 * c * x64**2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tanh_gelu_and_its_gradient_of_a_0d_input(dtype):
    """A 0-d X (a scalar loss's GELU): the kernels' in-place passes keep arrays (numpy's product of
    two 0-d arrays is a scalar, which cannot be written into)."""
    x, dy = np.array(-0.7, dtype), np.array(1.5, dtype)
    y_truth, slope_truth = _tanh_gelu_truth(np.float64(x))
    tolerance = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(lookup("com.microsoft", "FastGelu").cpu(x), y_truth, rtol=tolerance)
    np.testing.assert_allclose(lookup("", "Gelu").cpu(x, approximate="tanh"), y_truth, rtol=tolerance)
    grad = lookup("com.microsoft", "FastGeluGrad").cpu(dy, x)
    assert np.shape(grad) == () and np.asarray(grad).dtype == dtype
    np.testing.assert_allclose(grad, 1.5 * slope_truth, rtol=tolerance)


@pytest.mark.parametrize("size", [4096, 1 << 18])  # numpy's sigmoid, then oneDNN's where it is used
def test_tanh_gelu_and_its_gradient_in_float32_are_close_to_float64(size):
    """FastGelu, Gelu(approximate='tanh') and FastGeluGrad compute x sigmoid(2u) (no cancellation
    where tanh(u) nears -1): over [-12, 12], for the values over 1e-3 in magnitude, relative
    error within 2e-6 (forward) and 1e-4 (gradient: near its zero and where the sigmoid is tiny
    the terms cancel), where the tanh form lost 5.5e-5 and 5.1e-4; absolute within 4e-6 (forward)
    and 3e-7 of dY (gradient)."""
    x = np.linspace(-12, 12, size).astype(np.float32)
    dy = np.random.default_rng(9).uniform(0.5, 2, size).astype(np.float32)
    y_truth, slope_truth = _tanh_gelu_truth(x.astype(np.float64))
    for got in (lookup("com.microsoft", "FastGelu").cpu(x), lookup("", "Gelu").cpu(x, approximate="tanh")):
        assert got.dtype == np.float32
        assert np.max(np.abs(got - y_truth)) <= 4e-6
        visible = np.abs(y_truth) > 1e-3
        assert np.max(np.abs(got - y_truth)[visible] / np.abs(y_truth[visible])) <= 2e-6
    grad = lookup("com.microsoft", "FastGeluGrad").cpu(dy, x)
    want = dy * slope_truth
    assert grad.dtype == np.float32
    assert np.max(np.abs(grad - want) / dy) <= 3e-7  # the tanh form: 1.2e-6 (its 1 - t^2 near t = 1)
    visible = np.abs(want) > 1e-3
    assert np.max(np.abs(grad - want)[visible] / np.abs(want[visible])) <= 1e-4
    bias = np.full(size, 0.25, np.float32)
    np.testing.assert_allclose(
        lookup("com.microsoft", "FastGelu").cpu(x[None, :], bias)[0], _tanh_gelu_truth(x.astype(np.float64) + 0.25)[0], atol=4e-6
    )
