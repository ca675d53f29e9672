"""CPU kernels: the ops of ONNX Runtime training's training graphs, with ORT's CPU semantics.

These are the ops ``onnxruntime.training.artifacts.generate_artifacts`` (ORT 1.19) puts into a
training model besides the standard ones and the five gradient ops of ``microsoft.py``: activation
and softmax gradients, the loss and LayerNormalization gradients, FusedMatMul, Scale, the pooling
gradients and the gradient accumulator. Each kernel follows ORT's CPU kernel
(orttraining/training_ops/cpu/..., onnxruntime/contrib_ops/cpu/...), including its input order
and its treatment of the optional inputs; tests/test_ort_artifacts.py checks them against what
ORT training itself computed.

Two ORT kernels read something a numpy kernel is not given:

* MaxPoolGrad and AveragePoolGrad take dX's shape from the graph (the inferred shape of their
  output), not from an input. Here dX gets the smallest input shape the pooling windows cover:
  ``(out - 1) * stride + (kernel - 1) * dilation + 1 - pads`` per spatial axis (for ceil_mode, the
  smallest size whose ceil gives ``out``). That is X's shape whenever the windows reach X's end,
  which is the case in every pooling where floor division drops nothing. MaxPoolGrad checks that
  every index falls in its own (n, c) plane of that shape and raises KernelError otherwise.
* InPlaceAccumulatorV2 writes into its buffer input (ORT aliases output 1 to input 0). Here the
  buffer array is updated in place when it is writable, so a caller that feeds its own buffer
  sees the accumulated gradient there, and the optional output 1 carries it too.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.registry import MICROSOFT, ONNX_DOMAIN, cpu_kernel


def _axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise KernelError(f"{what} {axis} is out of range for rank {rank} (valid range [{-rank}, {rank - 1}])")
    return axis + rank if axis < 0 else axis


def _same_shape(a: np.ndarray, b: np.ndarray, a_name: str, b_name: str) -> None:
    if a.shape != b.shape:
        raise KernelError(f"{a_name} has shape {list(a.shape)} but {b_name} has shape {list(b.shape)}; they must match")


def _compute_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype == np.float16 or dtype.name == "bfloat16":
        return np.dtype(np.float32)
    return dtype


def _ints(values, n: int, default: int, what: str) -> list[int]:
    if values is None:
        return [default] * n
    values = [int(v) for v in values]
    if len(values) != n:
        raise KernelError(f"{what} {values} must have {n} values")
    return values


# ---------------------------------------------------------------- activation gradients


@cpu_kernel("ReluGrad", domain=MICROSOFT)
def relu_grad(dY, X):
    """dX = dY where X > 0, else 0."""
    _same_shape(dY, X, "dY", "X")
    return np.where(X > 0, dY, np.zeros((), dtype=dY.dtype)).astype(dY.dtype, copy=False)


@cpu_kernel("SigmoidGrad", domain=MICROSOFT)
def sigmoid_grad(dY, Y):
    """dX = dY * Y * (1 - Y), from Sigmoid's output Y."""
    _same_shape(dY, Y, "dY", "Y")
    one = Y.dtype.type(1)
    return (dY * Y * (one - Y)).astype(dY.dtype, copy=False)


@cpu_kernel("TanhGrad", domain=MICROSOFT)
def tanh_grad(dY, Y):
    """dX = dY * (1 - Y * Y), from Tanh's output Y."""
    _same_shape(dY, Y, "dY", "Y")
    one = Y.dtype.type(1)
    return (dY * (one - Y * Y)).astype(dY.dtype, copy=False)


def _gelu_grad(dY, X, approximate: bool):
    ct = _compute_dtype(X.dtype)
    x = X.astype(ct, copy=False)
    if approximate:
        alpha = ct.type(math.sqrt(2.0 / math.pi))
        gamma = ct.type(0.044715)
        beta = ct.type(gamma * alpha * 3.0)
        cube = x * x * x
        t = np.tanh(alpha * x + alpha * gamma * cube)
        d = ct.type(0.5) * (t + (ct.type(1) - t * t) * (alpha * x + beta * cube) + ct.type(1))
    else:
        from math import erf

        k_alpha = ct.type(2.0 / math.sqrt(math.pi) * math.sqrt(0.5) * 0.5)
        erf_values = np.vectorize(erf, otypes=[np.float64])(x.astype(np.float64) * math.sqrt(0.5)).astype(ct)
        d = ct.type(0.5) * (erf_values + ct.type(1)) + x * k_alpha * np.exp(ct.type(-0.5) * x * x)
    return (dY.astype(ct, copy=False) * d).astype(dY.dtype)


@cpu_kernel("GeluGrad", domain=MICROSOFT)
def gelu_grad(dY, X):
    """Gradient of the exact (erf) Gelu."""
    _same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, X, approximate=False)


@cpu_kernel("FastGeluGrad", domain=MICROSOFT)
def fast_gelu_grad(dY, X):
    """Gradient of the tanh approximation of Gelu."""
    _same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, X, approximate=True)


def _biased(X, B):
    if B.ndim != 1 or X.ndim < 1 or X.shape[-1] != B.shape[0]:
        raise KernelError(f"B (shape {list(B.shape)}) must be 1-D and match the last dimension of X {list(X.shape)}")
    return X + B


@cpu_kernel("BiasGeluGrad_dX", domain=MICROSOFT)
def bias_gelu_grad_dx(dY, X, B):
    _same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, _biased(X, B), approximate=False)


@cpu_kernel("BiasFastGeluGrad_dX", domain=MICROSOFT)
def bias_fast_gelu_grad_dx(dY, X, B):
    _same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, _biased(X, B), approximate=True)


# ---------------------------------------------------------------- softmax gradients


def _softmax_axes(Y, axis: int, opset13: bool):
    """The reduction axes: the one axis (opset 13 semantics) or every axis from ``axis`` on."""
    axis = _axis(axis, Y.ndim)
    return (axis,) if opset13 else tuple(range(axis, Y.ndim))


def _softmax_grad(dY, Y, axis, opset13):
    _same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = _compute_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    dot = (y * dy).sum(axis=axes, keepdims=True)
    return ((dy - dot) * y).astype(Y.dtype)


def _log_softmax_grad(dY, Y, axis, opset13):
    _same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = _compute_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    return (dy - np.exp(y) * dy.sum(axis=axes, keepdims=True)).astype(Y.dtype)


@cpu_kernel("SoftmaxGrad", domain=MICROSOFT)
def softmax_grad(dY, Y, *, axis=1):
    """Softmax (opset < 13) gradient: the input is coerced to 2-D at ``axis``."""
    return _softmax_grad(dY, Y, axis, opset13=False)


@cpu_kernel("SoftmaxGrad_13", domain=MICROSOFT)
def softmax_grad_13(dY, Y, *, axis=-1):
    """dX = Y * (dY - sum(dY * Y, axis)) along the single ``axis`` (Softmax-13)."""
    return _softmax_grad(dY, Y, axis, opset13=True)


@cpu_kernel("LogSoftmaxGrad", domain=MICROSOFT)
def log_softmax_grad(dY, Y, *, axis=1):
    return _log_softmax_grad(dY, Y, axis, opset13=False)


@cpu_kernel("LogSoftmaxGrad_13", domain=MICROSOFT)
def log_softmax_grad_13(dY, Y, *, axis=-1):
    """dX = dY - exp(Y) * sum(dY, axis), Y being LogSoftmax's output."""
    return _log_softmax_grad(dY, Y, axis, opset13=True)


# ---------------------------------------------------------------- SoftmaxCrossEntropyLossGrad


@cpu_kernel("SoftmaxCrossEntropyLossGrad", domain=MICROSOFT)
def softmax_cross_entropy_loss_grad(dY, log_prob, label, weight=None, ignore_index_input=None, *,
                                    ignore_index=-100, reduction="mean"):
    """d_logits = (exp(log_prob) - onehot(label)) * w, with ORT's reductions.

    ``log_prob`` is (N, C, D1, ...) and ``label`` (N, D1, ...). ``dY`` is the loss gradient: a
    scalar for 'mean'/'sum', label-shaped for 'none'. Samples whose label is ``ignore_index`` (the
    optional 5th input overrides the attribute) get zero gradient; 'mean' divides by the number of
    the other samples, or by the sum of their weights, and by nothing when that is 0.
    """
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    if reduction not in ("mean", "sum", "none"):
        raise KernelError(f"unknown reduction {reduction!r} (mean, sum or none)")
    if ignore_index_input is not None:
        if np.asarray(ignore_index_input).ndim != 0:
            raise KernelError("ignore_index should be a scalar")
        ignore_index = int(ignore_index_input)
    if log_prob.ndim != label.ndim + 1 or log_prob.shape[0] != label.shape[0] or log_prob.shape[2:] != label.shape[1:]:
        raise KernelError(f"log_prob shape {list(log_prob.shape)} must be (N, C, D1, ...) for label shape {list(label.shape)}")
    if label.dtype.kind not in "iu":
        raise KernelError(f"label must be int32 or int64, got {label.dtype}")
    if weight is not None and weight.ndim != 1:
        raise KernelError(f"weight must be 1-D, got shape {list(weight.shape)}")
    classes = log_prob.shape[1]
    ct = _compute_dtype(log_prob.dtype)
    labels = label.astype(np.int64)
    kept = labels != int(ignore_index)
    if ((labels[kept] < 0) | (labels[kept] >= classes)).any():
        bad = int(labels[kept][(labels[kept] < 0) | (labels[kept] >= classes)][0])
        raise KernelError(f"label {bad} is out of range for {classes} classes (valid range [0, {classes - 1}])")
    safe = np.where(kept, labels, 0)
    # (N, D..., C) layout, as ORT transposes to.
    prob = np.moveaxis(np.exp(log_prob.astype(ct, copy=False)), 1, -1)
    onehot = np.arange(classes) == safe[..., None]
    grad = prob - onehot.astype(ct)
    if weight is not None:
        w = np.where(kept, weight.astype(ct, copy=False)[safe], ct.type(0))
    else:
        w = kept.astype(ct)
    dy = np.asarray(dY).astype(ct, copy=False)
    if reduction == "none":
        if dy.shape != label.shape:
            raise KernelError(f"dY has shape {list(dy.shape)}, but reduction 'none' needs the label shape {list(label.shape)}")
        scale = w * dy
    else:
        if dy.size != 1:
            raise KernelError(f"dY must be a scalar for reduction {reduction!r}, got shape {list(dy.shape)}")
        scale_value = dy.reshape(())
        if reduction == "mean":
            total = w.sum(dtype=ct)
            if total != 0:
                scale_value = scale_value / total
        scale = w * scale_value
    result = grad * scale[..., None]
    return np.ascontiguousarray(np.moveaxis(result, -1, 1)).astype(log_prob.dtype, copy=False)


# ---------------------------------------------------------------- LayerNormalization gradients


def _layer_norm_grad(dY, X, scale, mean, inv_std_var, axis, simplified):
    _same_shape(dY, X, "dY", "X")
    axis = _axis(axis, X.ndim)
    rows, cols = math.prod(X.shape[:axis]), math.prod(X.shape[axis:])
    if cols == 1:
        raise KernelError(f"the normalized part of X {list(X.shape)} from axis {axis} has one element")
    if scale.size != cols:
        raise KernelError(f"scale has {scale.size} elements, but X {list(X.shape)} normalizes {cols} per row from axis {axis}")
    if inv_std_var.size != rows or (mean is not None and mean.size != rows):
        raise KernelError(f"mean and inv_std_var must have {rows} elements (one per row of X {list(X.shape)})")
    ct = _compute_dtype(X.dtype)
    x = X.astype(ct, copy=False).reshape(rows, cols)
    dy = dY.astype(ct, copy=False).reshape(rows, cols)
    s = scale.astype(ct, copy=False).reshape(1, cols)
    inv = inv_std_var.astype(ct, copy=False).reshape(rows, 1)
    normalized = (x if simplified else x - mean.astype(ct, copy=False).reshape(rows, 1)) * inv
    a = dy * normalized
    b = dy * s * inv
    c = b * normalized
    dx = b - normalized * c.mean(axis=1, keepdims=True)
    if not simplified:
        dx = dx - b.mean(axis=1, keepdims=True)
    outputs = [dx.reshape(X.shape).astype(X.dtype), a.sum(axis=0).reshape(scale.shape).astype(scale.dtype)]
    if not simplified:
        outputs.append(dy.sum(axis=0).reshape(scale.shape).astype(scale.dtype))
    return tuple(outputs)


@cpu_kernel("LayerNormalizationGrad", domain=MICROSOFT)
def layer_normalization_grad(dY, X, scale, mean, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale, dBias) of LayerNormalization from its saved Mean and InvStdDev."""
    return _layer_norm_grad(dY, X, scale, mean, inv_std_var, axis, simplified=False)


@cpu_kernel("SimplifiedLayerNormalizationGrad", domain=MICROSOFT)
def simplified_layer_normalization_grad(dY, X, scale, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale) of SimplifiedLayerNormalization (RMS norm) from its saved InvStdDev."""
    return _layer_norm_grad(dY, X, scale, None, inv_std_var, axis, simplified=True)



# ---------------------------------------------------------------- FusedMatMul, Scale


def _matmul_operand(A, trans: int, trans_batch: int):
    """A as MatMul sees it: transBatch moves dim 0 in front of the last one, trans swaps the last two."""
    if A.ndim == 0:
        raise KernelError("FusedMatMul inputs must have rank >= 1")
    if A.ndim == 1:
        return A
    if trans_batch:
        A = np.moveaxis(A, 0, -2)
    if trans:
        A = np.swapaxes(A, -1, -2)
    return A


@cpu_kernel("FusedMatMul", domain=MICROSOFT)
def fused_matmul(A, B, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * MatMul(op(A), op(B)); op transposes the last two axes (trans) and moves axis 0 to
    the second-to-last position first (transBatch). Rank-1 inputs ignore both flags."""
    a = _matmul_operand(A, transA, transBatchA)
    b = _matmul_operand(B, transB, transBatchB)
    ct = _compute_dtype(A.dtype)
    try:
        y = np.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False))
    except ValueError as exc:
        raise KernelError(f"FusedMatMul of shapes {list(A.shape)} and {list(B.shape)} (transA={transA}, transB={transB}, "
                          f"transBatchA={transBatchA}, transBatchB={transBatchB}) is not possible: {exc}") from None
    if float(alpha) != 1.0:
        y = y * ct.type(alpha)
    return np.asarray(y, dtype=A.dtype)


@cpu_kernel("Scale", domain=MICROSOFT)
def scale(input, scale_value, *, scale_down=0):
    """input * scale, or input / scale with scale_down=1; scale is a one-element tensor."""
    value = np.asarray(scale_value)
    if value.size != 1:
        raise KernelError(f"scale must have a single value, got shape {list(value.shape)}")
    factor = float(value.reshape(-1)[0])
    if factor == 0.0:
        raise KernelError("scale must not be 0")
    if int(scale_down):
        factor = np.float32(1.0) / np.float32(factor)
    return (input * input.dtype.type(factor)).astype(input.dtype, copy=False)


# ---------------------------------------------------------------- pooling gradients


def _pool_input_shape(dy_shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """The smallest input shape whose pooling gives ``dy_shape``, and the begin pads."""
    if kernel_shape is None:
        raise KernelError("kernel_shape is required")
    if len(dy_shape) < 3:
        raise KernelError(f"dY must have rank >= 3 (N, C, spatial...), got shape {list(dy_shape)}")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    ns = len(dy_shape) - 2
    kernel = _ints(kernel_shape, ns, 1, "kernel_shape")
    s = _ints(strides, ns, 1, "strides")
    d = _ints(dilations, ns, 1, "dilations")
    out = list(dy_shape[2:])
    span = [(k - 1) * dd + 1 for k, dd in zip(kernel, d)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        # out = ceil(in / stride): the smallest such input, then its SAME padding.
        spatial = [(o - 1) * st + 1 for o, st in zip(out, s)]
        total = [max(0, (o - 1) * st + sp - n) for o, st, sp, n in zip(out, s, span, spatial)]
        small = [t // 2 for t in total]
        big = [t - t // 2 for t in total]
        begin = small if auto_pad == "SAME_UPPER" else big
        return list(dy_shape[:2]) + spatial, begin, kernel, s, d
    if auto_pad == "VALID":
        p = [0] * (2 * ns)
    elif auto_pad in ("NOTSET", "", None):
        p = _ints(pads, 2 * ns, 0, "pads")
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    spatial = []
    for axis in range(ns):
        size = (out[axis] - 1) * s[axis] + span[axis] - p[axis] - p[ns + axis]
        if int(ceil_mode):
            # ceil((in + pads - span) / stride) + 1 = out: the smallest such in.
            size = (out[axis] - 2) * s[axis] + span[axis] - p[axis] - p[ns + axis] + 1
        if size < 1:
            raise KernelError(f"dY shape {list(dy_shape)} does not come from a pooling with these attributes")
        spatial.append(size)
    return list(dy_shape[:2]) + spatial, p[:ns], kernel, s, d


@cpu_kernel("MaxPoolGrad", domain=ONNX_DOMAIN)
def max_pool_grad(dY, Indices, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
                  storage_order=0, strides=None):
    """dX: dY added at MaxPool's Indices (flat positions in X, batch and channel included)."""
    _same_shape(dY, Indices, "dY", "Indices")
    shape, _, _, _, _ = _pool_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    plane = math.prod(shape[2:])
    idx = Indices.astype(np.int64).reshape(shape[0] * shape[1], -1)
    owner = np.arange(shape[0] * shape[1], dtype=np.int64)[:, None]
    if idx.size and ((idx < owner * plane) | (idx >= (owner + 1) * plane)).any():
        raise KernelError(f"MaxPool indices fall outside the input shape {shape} that the pooling windows cover: "
                          f"X was larger (windows leave its end uncovered), which dY alone does not tell")
    ct = _compute_dtype(dY.dtype)
    flat = np.bincount(idx.reshape(-1), weights=dY.astype(np.float64).reshape(-1), minlength=math.prod(shape))
    return flat.reshape(shape).astype(ct).astype(dY.dtype)


@cpu_kernel("AveragePoolGrad", domain=ONNX_DOMAIN)
def average_pool_grad(dY, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                      pads=None, strides=None):
    """dX: each dY spread evenly over its window (clipped to X), divided by the kernel size
    (count_include_pad) or by the clipped window's size. ORT supports 1-3 spatial axes."""
    shape, begin, kernel, s, d = _pool_input_shape(dY.shape, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    ns = len(kernel)
    if ns > 3:
        raise KernelError(f"AveragePoolGrad supports 1 to 3 spatial axes, got {ns}")
    if any(v != 1 for v in d):
        raise KernelError(f"AveragePoolGrad does not support dilations {d}")
    ct = _compute_dtype(dY.dtype)
    dx = np.zeros(shape, dtype=ct)
    dy = dY.astype(ct, copy=False)
    spatial = shape[2:]
    # Per axis and output position: the clipped window [lo, hi).
    bounds = []
    for axis in range(ns):
        start = np.arange(dY.shape[2 + axis]) * s[axis] - begin[axis]
        bounds.append((np.maximum(start, 0), np.minimum(start + kernel[axis], spatial[axis])))
    for position in np.ndindex(*dY.shape[2:]):
        lo = [int(bounds[a][0][i]) for a, i in enumerate(position)]
        hi = [int(bounds[a][1][i]) for a, i in enumerate(position)]
        if any(h <= l for l, h in zip(lo, hi)):
            continue
        count = math.prod(kernel) if int(count_include_pad) else math.prod(h - l for l, h in zip(lo, hi))
        window = (slice(None), slice(None)) + tuple(slice(l, h) for l, h in zip(lo, hi))
        value = dy[(slice(None), slice(None)) + position] / ct.type(count)
        dx[window] += value.reshape(value.shape + (1,) * ns)
    return dx.astype(dY.dtype)


# ---------------------------------------------------------------- gradient accumulation


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
            raise KernelError(f"value of shape {list(value.shape)} does not broadcast to the buffer's shape "
                              f"{list(buffer.shape)}") from None
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
