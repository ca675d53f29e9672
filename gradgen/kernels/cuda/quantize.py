"""CUDA launchers: QuantizeLinear and DequantizeLinear, composed of the elementwise launchers.

Per-tensor and per-axis scales and zero points run on the GPU for the 8-bit quantized types (and
DequantizeLinear's int32 input): the CPU kernels' steps in their float type (float32, float64 for
float64 data), 16-bit floats read as float32 as the CPU backend reads them, and the checks and
errors of the CPU kernels (gradgen/kernels/cpu/quantize.py). Block quantization and the 16-bit
integer types, which the cast kernels do not cover, run the numpy kernels.
"""

from __future__ import annotations

import numpy as np

from gradgen.kernels.cpu import quantize as cpu
from gradgen.kernels.cuda.elementwise import add, cast_to, clip, device_scalar, div, mul, sub, unary, widened
from gradgen.kernels.cuda.launch import cpu_fallback, dtype_suffix
from gradgen.kernels.cuda.shape import reshaped
from gradgen.kernels.numeric import float_compute_dtype
from gradgen.kernels.table import cuda_kernel

_EIGHT_BITS = (np.dtype(np.uint8), np.dtype(np.int8))


def _per_block(block_size, *values) -> bool:
    """Whether a scale or zero point is per block (block_size set and not a scalar)."""
    return bool(block_size) and any(v is not None and len(v.shape) > 0 for v in values)


def _spread(value, x_shape, axis, what: str, dtype):
    """A per-tensor or per-axis scale or zero point as ``dtype``, viewed to broadcast against x
    (the CPU kernels' ``spread``)."""
    shape = cpu.spread_shape(value.shape, tuple(x_shape), axis, what)
    if np.dtype(value.dtype) != np.dtype(dtype):
        value = cast_to(value, dtype)
    return value if tuple(value.shape) == shape else reshaped(value, shape)


@cuda_kernel("QuantizeLinear")
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    """y = clip(rint(x / y_scale) + y_zero_point) to the output type's range, then cast to it (uint8
    or int8): rint rounds half to even, as numpy's."""
    attrs = dict(axis=axis, saturate=saturate, block_size=block_size, output_dtype=output_dtype, precision=precision)
    xw, scale = widened(x), widened(y_scale)
    zp_dtype = None if y_zero_point is None else y_zero_point.dtype
    out = np.dtype(cpu.quantized_type(xw.dtype, scale.dtype, zp_dtype, output_dtype, precision))
    if out not in _EIGHT_BITS or _per_block(block_size, y_scale, y_zero_point):
        return cpu_fallback("QuantizeLinear", x, y_scale, y_zero_point, **attrs)
    compute = np.dtype(float_compute_dtype(xw.dtype))
    q = unary(f"round_{dtype_suffix(compute)}", div(xw, _spread(scale, xw.shape, axis, "y_scale", compute)))
    if y_zero_point is not None:
        q = add(q, _spread(y_zero_point, xw.shape, axis, "y_zero_point", compute))
    info = np.iinfo(out)
    return cast_to(clip(q, device_scalar(info.min, compute), device_scalar(info.max, compute)), out)


@cuda_kernel("DequantizeLinear")
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    """y = (x - x_zero_point) * x_scale, of x_scale's type: the difference in integers (int32 for
    8-bit x, int64 for int32 x: exact), converted to the float type, times the scale."""
    attrs = dict(axis=axis, block_size=block_size, output_dtype=output_dtype)
    scale = widened(x_scale)
    zp_dtype = None if x_zero_point is None else x_zero_point.dtype
    kind = np.dtype(cpu.dequantized_type(x.dtype, scale.dtype, zp_dtype, output_dtype))
    if kind not in (*_EIGHT_BITS, np.dtype(np.int32)) or _per_block(block_size, x_scale, x_zero_point):
        return cpu_fallback("DequantizeLinear", x, x_scale, x_zero_point, **attrs)
    wide = np.dtype(np.int64 if kind == np.int32 else np.int32)
    diff = cast_to(x, wide)
    if x_zero_point is not None:
        diff = sub(diff, _spread(x_zero_point, x.shape, axis, "x_zero_point", wide))
    compute = np.dtype(float_compute_dtype(scale.dtype))
    y = mul(cast_to(diff, compute), _spread(scale, x.shape, axis, "x_scale", compute))
    return y if np.dtype(x_scale.dtype) == compute else cast_to(y, x_scale.dtype)


# ---------------------------------------------------------------- QLinearMatMul / QLinearConv


def wide_operand(x, zero_point, zero_point_shape):
    """(x - zero_point) in float64 (exact for 8-bit values), the zero point viewed as
    ``zero_point_shape`` to broadcast against x."""
    wide = cast_to(x, np.float64)
    if zero_point is None:
        return wide
    return sub(wide, reshaped(cast_to(zero_point, np.float64), zero_point_shape))


def scale_ratio(x_scale, w_scale, y_scale, shapes):
    """x_scale * w_scale / y_scale in the scales' type (float32 for 16-bit scales, as the CPU
    backend reads them), each viewed as its entry of ``shapes`` (x, w, y)."""
    views = [reshaped(widened(scale), shape) for scale, shape in zip((x_scale, w_scale, y_scale), shapes)]
    return div(mul(views[0], views[1]), views[2])


def requantize(accumulated, ratio, y_zero_point, out_type):
    """saturate(rint(accumulated * ratio + y_zero_point)) in ``out_type`` (the CPU kernels'
    ``requantize``): ``accumulated`` float64, ``y_zero_point`` viewed to broadcast."""
    y = mul(accumulated, cast_to(ratio, np.float64))
    if y_zero_point is not None:
        y = add(y, cast_to(y_zero_point, np.float64))
    y = unary(f"round_{dtype_suffix(np.float64)}", y)
    info = np.iinfo(out_type)
    return cast_to(clip(y, device_scalar(info.min, np.float64), device_scalar(info.max, np.float64)), out_type)
