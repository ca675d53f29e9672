"""CPU kernels: QuantizeLinear and DequantizeLinear (opsets 10-21), as ONNX Runtime and the ONNX
reference evaluator compute them.

The scale and zero point are per tensor (a scalar or a 1-element vector), per axis (a vector along
``axis``) or, from opset 21, per block (x's shape with the ``axis`` dim divided into blocks of
``block_size``). Quantized types: uint8, int8, uint16, int16 (and int32 for DequantizeLinear's
input); the float8 and 4-bit types, which numpy cannot hold, are refused. Rounding is half to even,
and the result saturates to the type's range.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.numeric import float_compute_dtype
from gradgen.kernels.table import cpu_kernel

# TensorProto data type numbers of the integer types gradgen quantizes to (output_dtype's values)
_OUTPUT_DTYPES = {2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16}
_QUANTIZED = (np.uint8, np.int8, np.uint16, np.int16)


def spread(value: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int, what: str) -> np.ndarray:
    """A scale or zero point broadcastable to x's ``shape``: per tensor as it is, per axis reshaped
    along ``axis``, per block repeated ``block_size`` times along it (the last block may be short)."""
    if value.ndim == 0 or not block_size:
        return value.reshape(spread_shape(value.shape, shape, axis, what))
    axis = _axis(axis, len(shape))
    if block_size < 0:
        raise KernelError(f"block_size must be positive, got {block_size}")
    blocks = -(-shape[axis] // block_size)
    want = tuple(blocks if i == axis else d for i, d in enumerate(shape))
    if value.shape != want:
        raise KernelError(
            f"{what} of shape {list(value.shape)} does not block x {list(shape)} along axis {axis} "
            f"in blocks of {block_size} (expected {list(want)})"
        )
    return np.repeat(value, block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)


def spread_shape(value_shape, shape: tuple[int, ...], axis: int, what: str) -> tuple[int, ...]:
    """The shape a per-tensor or per-axis scale or zero point of ``value_shape`` takes to broadcast
    against x's ``shape``: () per tensor (a scalar or a 1-element vector), else a vector along
    ``axis``. Shared by the CPU and CUDA kernels."""
    value_shape = tuple(int(d) for d in value_shape)
    if value_shape in ((), (1,)):
        return ()
    axis = _axis(axis, len(shape))
    if len(value_shape) != 1 or value_shape[0] != shape[axis]:
        raise KernelError(
            f"{what} of shape {list(value_shape)} is neither a scalar nor a vector of the {shape[axis]} "
            f"elements of x's axis {axis} (x is {list(shape)})"
        )
    return tuple(int(d) if i == axis else 1 for i, d in enumerate(shape))


def _axis(axis: int, rank: int) -> int:
    if rank == 0:
        return 0
    if not -rank <= axis < rank:
        raise KernelError(f"axis {axis} is out of range for x of rank {rank}")
    return axis % rank


def _integer_type(dtype: np.dtype, what: str, allowed=_QUANTIZED) -> type:
    for t in allowed:
        if dtype == t:
            return t
    names = ", ".join(np.dtype(t).name for t in allowed)
    raise KernelError(f"{what} has type {dtype}; gradgen quantizes to {names} only (no float8 or 4-bit types)")


def quantized_type(x_dtype, scale_dtype, zero_point_dtype, output_dtype: int, precision: int) -> type:
    """QuantizeLinear's output type (uint8 when the zero point is absent, or ``output_dtype``'s,
    opset 21), after the checks of its inputs' types (``zero_point_dtype`` None when absent). Shared
    by the CPU and CUDA kernels."""
    if precision:
        raise KernelError("QuantizeLinear's precision attribute (opset 23) is not supported")
    if np.dtype(x_dtype).kind != "f" or np.dtype(scale_dtype).kind != "f":
        raise KernelError(f"QuantizeLinear takes a float x and y_scale, got {x_dtype} and {scale_dtype}")
    if zero_point_dtype is not None:
        out = _integer_type(np.dtype(zero_point_dtype), "y_zero_point")
        if output_dtype and _OUTPUT_DTYPES.get(output_dtype) is not out:
            raise KernelError(f"output_dtype {output_dtype} differs from y_zero_point's type {zero_point_dtype}")
        return out
    if output_dtype:
        if output_dtype not in _OUTPUT_DTYPES:
            raise KernelError(f"output_dtype {output_dtype} is not a type gradgen quantizes to (uint8, int8, uint16, int16)")
        return _OUTPUT_DTYPES[output_dtype]
    return np.uint8


@cpu_kernel("QuantizeLinear")
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1, saturate=1, block_size=0, output_dtype=0, precision=0):
    """y = saturate(round_half_even(x / y_scale) + y_zero_point), uint8 when the zero point is absent
    (or of ``output_dtype``, opset 21)."""
    out = quantized_type(x.dtype, y_scale.dtype, None if y_zero_point is None else y_zero_point.dtype, output_dtype, precision)
    compute = float_compute_dtype(x.dtype)
    scale = spread(y_scale, x.shape, axis, block_size, "y_scale").astype(compute, copy=False)
    q = np.rint(x.astype(compute, copy=False) / scale)
    if y_zero_point is not None:
        q = q + spread(y_zero_point, x.shape, axis, block_size, "y_zero_point").astype(compute)
    info = np.iinfo(out)
    return np.clip(q, info.min, info.max).astype(out)


def dequantized_type(x_dtype, scale_dtype, zero_point_dtype, output_dtype: int) -> type:
    """DequantizeLinear's integer input type, after the checks of its inputs' types
    (``zero_point_dtype`` None when absent). Shared by the CPU and CUDA kernels."""
    if output_dtype:
        raise KernelError("DequantizeLinear's output_dtype attribute (opset 23) is not supported")
    kind = _integer_type(np.dtype(x_dtype), "x", (*_QUANTIZED, np.int32))
    if np.dtype(scale_dtype).kind != "f":
        raise KernelError(f"DequantizeLinear takes a float x_scale, got {scale_dtype}")
    if zero_point_dtype is not None and np.dtype(zero_point_dtype) != kind:
        raise KernelError(f"x_zero_point has type {zero_point_dtype}, x has {x_dtype}: they must be one type")
    return kind


@cpu_kernel("DequantizeLinear")
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    """y = (x - x_zero_point) * x_scale, of x_scale's type (the difference taken in integers)."""
    dequantized_type(x.dtype, x_scale.dtype, None if x_zero_point is None else x_zero_point.dtype, output_dtype)
    diff = x.astype(np.int64)
    if x_zero_point is not None:
        diff = diff - spread(x_zero_point, x.shape, axis, block_size, "x_zero_point").astype(np.int64)
    compute = float_compute_dtype(x_scale.dtype)
    scale = spread(x_scale, x.shape, axis, block_size, "x_scale").astype(compute, copy=False)
    return (diff.astype(compute) * scale).astype(x_scale.dtype, copy=False)


# ---------------------------------------------------------------- QLinearMatMul / QLinearConv
#
# Both accumulate (x - x_zero_point) (w - w_zero_point) products in integers and requantize the sum:
# y = saturate(rint(acc * (x_scale * w_scale / y_scale) + y_zero_point)), as ONNX's reference does
# (the accumulator times the scale ratio in float64; the ratio in the scales' own type). The
# accumulation runs in float64, which holds every 8-bit product sum exactly (below 2^53), so the
# float GEMM and convolution kernels compute it.

_EIGHT_BIT = (np.uint8, np.int8)


def eight_bit_type(dtype, what: str) -> type:
    """The quantized 8-bit type of an input of QLinearMatMul / QLinearConv."""
    return _integer_type(np.dtype(dtype), what, allowed=_EIGHT_BIT)


def check_linear_quantized(op: str, x, x_zero_point, w, w_zero_point, y_zero_point, scales) -> None:
    """The type rules of QLinearMatMul and QLinearConv: 8-bit x and w with zero points of their
    types, float scales of one type."""
    for value, what in ((x, "the first input"), (w, "the weight input"), (y_zero_point, "y_zero_point")):
        if value is not None:
            eight_bit_type(value.dtype, f"{op}'s {what}")
    for zero_point, data, what in ((x_zero_point, x, "first input"), (w_zero_point, w, "weight input")):
        if zero_point is not None and np.dtype(zero_point.dtype) != np.dtype(data.dtype):
            raise KernelError(f"{op}: the {what}'s zero point is {zero_point.dtype}, the input {data.dtype}")
    kinds = {np.dtype(scale.dtype) for scale in scales}
    if len(kinds) != 1 or next(iter(kinds)).kind not in "fV":
        raise KernelError(f"{op}'s scales must be floats of one type, got {', '.join(sorted(k.name for k in kinds))}")


def requantized_type(y_zero_point, x_dtype) -> type:
    """The output type: y_zero_point's, else the first input's."""
    return eight_bit_type(y_zero_point.dtype if y_zero_point is not None else x_dtype, "the output")


def requantize(accumulated: np.ndarray, ratio: np.ndarray, y_zero_point, out_type) -> np.ndarray:
    """saturate(rint(accumulated * ratio + y_zero_point)) in ``out_type``; ``accumulated`` float64."""
    y = accumulated * np.asarray(ratio).astype(np.float64)
    if y_zero_point is not None:
        y += np.asarray(y_zero_point).astype(np.float64)
    info = np.iinfo(out_type)
    return np.clip(np.rint(y), info.min, info.max).astype(out_type)
