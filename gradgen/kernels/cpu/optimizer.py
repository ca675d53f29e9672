"""CPU kernels: the gradient-accumulation ops of ONNX Runtime training's training graphs.

InPlaceAccumulatorV2 writes into its buffer input (ORT aliases output 1 to input 0). Here the
buffer array is updated in place when it is writable, so a caller that feeds its own buffer sees
the accumulated gradient there, and the optional output 1 carries it too.

The other ops ``onnxruntime.training.artifacts.generate_artifacts`` (ORT 1.19) puts into a training
model live with their families (activation gradients and Scale in elementwise.py, softmax
gradients in reduction.py, SoftmaxCrossEntropyLossGrad in loss.py, LayerNormalization gradients in
norm.py, FusedMatMul in matmul.py, the pooling gradients in pool.py). Each follows ORT's CPU
kernel, including its input order and its treatment of the optional inputs;
tests/test_ort_artifacts.py checks them against what ORT training itself computed.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.table import MICROSOFT, cpu_kernel


@cpu_kernel("InPlaceAccumulatorV2", domain=MICROSOFT)
def in_place_accumulator_v2(buffer, value, overwrite_flag=None, *, _num_outputs=2):
    """buffer = value (overwrite_flag true) or buffer + value (broadcast); returns (updated_flag, buffer).

    ORT updates the buffer in place (output 1 aliases input 0); so does this kernel when the
    buffer array is writable. updated_flag is a bool tensor of shape (1,), always true.
    """
    overwrite = bool(np.asarray(overwrite_flag).reshape(-1)[0]) if overwrite_flag is not None else False
    if overwrite:
        if value.size != buffer.size:
            raise KernelError(f"value has shape {list(value.shape)} but the buffer has shape {list(buffer.shape)}")
        result = value.reshape(buffer.shape).astype(buffer.dtype, copy=True)
    else:
        try:
            result = np.add(buffer, value, dtype=buffer.dtype)
        except ValueError:
            raise KernelError(
                f"value of shape {list(value.shape)} does not broadcast to the buffer's shape {list(buffer.shape)}"
            ) from None
        if result.shape != buffer.shape:
            raise KernelError(f"value of shape {list(value.shape)} does not broadcast to the buffer's shape {list(buffer.shape)}")
    if buffer.flags.writeable:
        buffer[...] = result
        result = buffer
    flag = np.array([True])
    return (flag, result) if _num_outputs > 1 else flag


@cpu_kernel("ZeroGradient", domain=MICROSOFT)
def zero_gradient(old_gradient, reset_signal=None):
    """Zeros of old_gradient's shape (ORT writes them in place; reset_signal only orders the node)."""
    return np.zeros_like(old_gradient)
