"""QLinearMatMul and QLinearConv on the GPU (composed: float64 GEMM / cuDNN convolution of the
zero-point-shifted operands, exact for 8-bit values, then the requantization's elementwise steps):
the same integers as the CPU kernels, per tensor, per row / column / output channel, 16-bit scales."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import check, launches
from tests.qlinear_cases import SCALE_TYPES, conv_case, matmul_case
from tests.test_qlinear import CONV_ATTRS

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module


@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
@pytest.mark.parametrize(
    "shapes", [((3, 5), (5, 4)), ((2, 3, 5), (5, 4)), ((2, 1, 3, 5), (4, 5, 2)), ((64, 300), (300, 96))], ids=str
)
@pytest.mark.parametrize("per", ["tensor", "row", "column", "both"])
def test_qlinear_matmul(launches, dtype, shapes, per):
    inputs = matmul_case(dtype, *shapes, per_row=per in ("row", "both"), per_column=per in ("column", "both"))
    check(launches, "QLinearMatMul", inputs, exact=True)


def test_qlinear_matmul_per_row_with_a_vector_b(launches):
    check(launches, "QLinearMatMul", matmul_case(np.int8, (4, 6), (6,), per_row=True), exact=True)


@pytest.mark.parametrize("scale_type", sorted(SCALE_TYPES))
def test_qlinear_matmul_16_bit_scales(launches, scale_type):
    check(launches, "QLinearMatMul", matmul_case(np.int8, (3, 4), (4, 5), scale_type=SCALE_TYPES[scale_type]), exact=True)


@pytest.mark.parametrize("attrs", list(CONV_ATTRS.values()), ids=list(CONV_ATTRS))
@pytest.mark.parametrize("per_channel", [False, True], ids=["per tensor", "per channel"])
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8], ids=str)
def test_qlinear_conv(launches, dtype, bias, per_channel, attrs):
    check(launches, "QLinearConv", conv_case(dtype, per_channel=per_channel, bias=bias), exact=True, **{"group": 2, **attrs})


def test_qlinear_conv_at_a_real_size(launches):
    inputs = conv_case(np.uint8, x_shape=(8, 64, 28, 28), w_shape=(128, 64, 3, 3), per_channel=True)
    check(launches, "QLinearConv", inputs, exact=True, pads=[1, 1, 1, 1])
