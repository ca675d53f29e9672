"""DequantizeLinear: the gradient of its float scale (x and the zero point are integers), per tensor
(a scalar or a 1-element vector) and per axis, with and without a zero point, 8-bit, 16-bit and
int32 x. The scale is float64 here, which the spec does not list (ONNX's shape inference rejects
it: full_check off); the kernel computes in it. QuantizeLinear's rule always refuses: tests/test_quantize.py."""

import numpy as np

from tests.gradcheck import GradCase

_rng = np.random.default_rng(15)


def _ints(dtype, shape):
    info = np.iinfo(dtype)
    return _rng.integers(max(int(info.min), -300), min(int(info.max), 300), shape, endpoint=True).astype(dtype)


def _scale(shape):
    return _rng.uniform(0.05, 0.5, shape)


def _case(x, scale, zero=None, opset=19, name="", **attrs):
    inputs = [x, scale] if zero is None else [x, scale, zero]
    return GradCase("DequantizeLinear", inputs, attrs=attrs, opset=opset, name=f"DequantizeLinear_{name}", full_check=False)


CASES = [
    _case(_ints(np.uint8, (2, 3, 4)), _scale(()), _ints(np.uint8, ()), name="tensor_uint8"),
    _case(_ints(np.int8, (3, 4)), _scale((1,)), name="tensor_vector1_int8_no_zero"),
    _case(_ints(np.int8, (2, 3, 4)), _scale((3,)), _ints(np.int8, (3,)), name="axis1_int8"),
    _case(_ints(np.int16, (2, 3, 4)), _scale((4,)), _ints(np.int16, (4,)), opset=21, axis=-1, name="axis_last_int16"),
    _case(_ints(np.uint16, (5, 2)), _scale((5,)), _ints(np.uint16, (5,)), opset=21, axis=0, name="axis0_uint16"),
    _case(_ints(np.int32, (4,)), _scale((4,)), opset=13, axis=0, name="axis0_int32_rank1"),
    _case(_ints(np.uint8, (3, 2)), _scale((1,)), _ints(np.uint8, (1,)), axis=0, name="tensor_vector1_uint8"),
]
