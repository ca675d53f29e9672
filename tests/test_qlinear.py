"""QLinearMatMul and QLinearConv on the CPU: against ONNX's reference evaluator (per tensor, and
QLinearConv per output channel), against the integer arithmetic written out (QLinearMatMul per row
of A and per column of B, which the reference evaluator does not broadcast), and their errors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

from gradgen.errors import KernelError
from gradgen.executor import Session
from tests.cuda.test_cuda_more_launchers import single_node
from tests.qlinear_cases import SCALE_TYPES, conv_case, matmul_case

CONV_ATTRS = {
    "plain": {},
    "strided, padded, grouped": dict(strides=[2, 1], pads=[1, 0, 1, 2], group=2),
    "dilated, same upper": dict(dilations=[2, 1], auto_pad="SAME_UPPER"),
}


def _both(op, inputs, **attrs):
    model, feeds = single_node(op, inputs, **attrs)
    got = Session(model).run(feeds)["out0"]
    return got, model, feeds


def _reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)[0]


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
@pytest.mark.parametrize("shapes", [((3, 5), (5, 4)), ((2, 3, 5), (5, 4)), ((2, 1, 3, 5), (4, 5, 2)), ((5,), (5, 3))], ids=str)
def test_qlinear_matmul_matches_the_reference(dtype, shapes):
    got, model, feeds = _both("QLinearMatMul", matmul_case(dtype, *shapes))
    want = _reference(model, feeds)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def _integer_matmul(a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp):
    """The op written out in integers: per-row values as a column, per-column ones as a row."""
    rows = lambda v: np.asarray(v).reshape(-1, 1) if np.ndim(v) else v  # noqa: E731
    acc = (a.astype(np.int64) - rows(a_zp).astype(np.int64)) @ (b.astype(np.int64) - np.asarray(b_zp).astype(np.int64))
    ratio = (rows(a_scale) * np.asarray(b_scale) / rows(y_scale)).astype(np.float64)
    info = np.iinfo(a.dtype)
    return np.clip(np.rint(acc * ratio + float(y_zp)), info.min, info.max).astype(a.dtype)


@pytest.mark.parametrize("per_row, per_column", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
def test_qlinear_matmul_per_row_and_per_column(dtype, per_row, per_column):
    inputs = matmul_case(dtype, (4, 6), (6, 3), per_row=per_row, per_column=per_column)
    got, _, _ = _both("QLinearMatMul", inputs)
    np.testing.assert_array_equal(got, _integer_matmul(*inputs))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
def test_qlinear_matmul_per_row_with_a_vector_b(dtype):
    """A 1-D B leaves the product no column axis: per-row values scale its last axis."""
    inputs = matmul_case(dtype, (4, 6), (6,), per_row=True)
    got, _, _ = _both("QLinearMatMul", inputs)
    assert got.shape == (4,)
    as_matrix = inputs[:3] + [inputs[3].reshape(6, 1)] + inputs[4:]
    np.testing.assert_array_equal(got, _integer_matmul(*as_matrix)[:, 0])


@pytest.mark.parametrize("scale_type", sorted(SCALE_TYPES))
def test_qlinear_matmul_16_bit_scales_read_as_float32(scale_type):
    """The CPU backend hands 16-bit floats to a kernel as float32: the ratio is one float32 product
    and quotient of the scales."""
    inputs = matmul_case(np.int8, (3, 4), (4, 5), scale_type=SCALE_TYPES[scale_type])
    got, _, _ = _both("QLinearMatMul", inputs)
    as_float32 = [v.astype(np.float32) if i in (1, 4, 6) else v for i, v in enumerate(inputs)]
    np.testing.assert_array_equal(got, _integer_matmul(*as_float32))


@pytest.mark.parametrize("attrs", list(CONV_ATTRS.values()), ids=list(CONV_ATTRS))
@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
def test_qlinear_conv_matches_the_reference(dtype, bias, per_channel, attrs):
    inputs = conv_case(dtype, per_channel=per_channel, bias=bias)
    attrs = {"group": 2, **attrs}
    got, model, feeds = _both("QLinearConv", inputs, **attrs)
    want = _reference(model, feeds)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_qlinear_conv_saturates():
    """Large positive and negative sums clip to the output type's range."""
    inputs = conv_case(np.int8, bias=False)
    inputs[6] = np.array(1e-4, np.float32)  # a tiny y_scale: every output saturates
    got, model, feeds = _both("QLinearConv", inputs, group=2)
    assert set(np.unique(got)) <= {-128, 127} and len(np.unique(got)) == 2
    np.testing.assert_array_equal(got, _reference(model, feeds))


@pytest.mark.parametrize(
    "op, change, match",
    [
        ("QLinearMatMul", lambda v: v.__setitem__(0, v[0].astype(np.int32)), "8-bit|uint8, int8"),
        ("QLinearMatMul", lambda v: v.__setitem__(2, v[2].astype(np.int8)), "zero point"),
        ("QLinearMatMul", lambda v: v.__setitem__(1, np.full(7, 0.1, np.float32)), "one value per row"),
        ("QLinearMatMul", lambda v: v.__setitem__(3, v[3][:4]), "inner dimensions"),
        ("QLinearConv", lambda v: v.__setitem__(4, np.full(5, 0.1, np.float32)), "one value per output channel"),
        ("QLinearConv", lambda v: v.__setitem__(8, v[8].astype(np.int64)), "B must be int32"),
        ("QLinearConv", lambda v: v.__setitem__(1, np.full(2, 0.1, np.float32)), "must be a scalar"),
    ],
    ids=["int32 A", "zero point type", "per-row count", "inner dims", "per-channel count", "bias type", "x_scale shape"],
)
def test_bad_inputs_are_one_line_errors(op, change, match):
    inputs = matmul_case(np.uint8) if op == "QLinearMatMul" else conv_case(np.uint8)
    change(inputs)
    attrs = {} if op == "QLinearMatMul" else {"group": 2}
    model, feeds = single_node(op, inputs, **attrs)
    with pytest.raises(KernelError, match=match):
        Session(model).run(feeds)
