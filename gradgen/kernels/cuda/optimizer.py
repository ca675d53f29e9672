"""CUDA launchers: ONNX Runtime training's gradient-accumulation ops (the CPU kernels'
gradgen/kernels/cpu/optimizer.py), composed of the elementwise launchers. The accumulated buffer
is a new device array, not the input written over: on the device the input may be a constant or
a value another step still reads (a Session binds state through its outputs instead)."""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import fill, runtime
from gradgen.kernels.table import MICROSOFT, cuda_kernel


@cuda_kernel("InPlaceAccumulatorV2", domain=MICROSOFT, host_inputs=(2,))
def in_place_accumulator_v2(buffer, value, overwrite_flag=None, *, _num_outputs=2):
    """(updated_flag, buffer') with buffer' = value (overwrite_flag true) or buffer + value
    (value broadcast to the buffer's shape), in the buffer's type; updated_flag a true bool (1,)."""
    from gradgen.kernels.cuda.elementwise import add, cast_to
    from gradgen.kernels.cuda.shape import reshaped

    overwrite = overwrite_flag is not None and bool(np.asarray(overwrite_flag).reshape(-1)[0])
    if overwrite:
        if value.size != buffer.size:
            raise KernelError(f"value has shape {list(value.shape)} but the buffer has shape {list(buffer.shape)}")
        result = cast_to(reshaped(value, buffer.shape), buffer.dtype)
    else:
        try:
            shape = np.broadcast_shapes(tuple(buffer.shape), tuple(value.shape))
        except ValueError:
            shape = None
        if shape != tuple(buffer.shape):
            raise KernelError(f"value of shape {list(value.shape)} does not broadcast to the buffer's shape {list(buffer.shape)}")
        result = add(buffer, value if value.dtype == buffer.dtype else cast_to(value, buffer.dtype))
    flag = runtime().empty((1,), np.bool_)
    fill(flag, True)
    return (flag, result) if _num_outputs > 1 else flag


@cuda_kernel("ZeroGradient", domain=MICROSOFT)
def zero_gradient(old_gradient, reset_signal=None):
    """Zeros of old_gradient's shape and type (reset_signal only orders the node)."""
    return runtime().zeros(old_gradient.shape, old_gradient.dtype)
