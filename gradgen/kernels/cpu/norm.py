"""CPU kernels: normalization (BatchNormalization, LayerNormalization, GroupNormalization, ... and
ONNX Runtime training's LayerNormalization gradients)."""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import onednn_rows
from gradgen.kernels.cpu.prepared import constant_inputs, per_shape
from gradgen.kernels.cpu.reduction import count_divisor
from gradgen.kernels.numeric import accumulation_dtype, channel_shape, float_compute_dtype, same_shape
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.axes import normalize_axis
from gradgen.ops.schemas import DT, FLOATS, Attribute, Formal, Schema


@cpu_kernel("BatchNormalization")
def batch_normalization(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0, _num_outputs=1):
    """Inference form; training_mode=1 (opset 14+) also returns running_mean and running_var.

    Older models (opset < 14) ask for training statistics by having more than one output:
    (Y, mean, var, saved_mean, saved_var); saved_* are the batch mean and (biased) variance.
    """
    ct = float_compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    shape = channel_shape(x)
    sc, bc = scale.astype(ct, copy=False).reshape(shape), bias.astype(ct, copy=False).reshape(shape)
    training = int(training_mode) == 1 or _num_outputs > 1
    if not training:
        mean = input_mean.astype(ct, copy=False).reshape(shape)
        var = input_var.astype(ct, copy=False).reshape(shape)
        y = (xc - mean) / np.sqrt(var + ct.type(epsilon)) * sc + bc
        return y.astype(x.dtype, copy=False)
    axes = (0,) + tuple(range(2, x.ndim))
    batch_mean = xc.mean(axis=axes)
    batch_var = xc.var(axis=axes)
    y = (xc - batch_mean.reshape(shape)) / np.sqrt(batch_var.reshape(shape) + ct.type(epsilon)) * sc + bc
    mom = ct.type(momentum)
    running_mean = input_mean.astype(ct) * mom + batch_mean * (1 - mom)
    running_var = input_var.astype(ct) * mom + batch_var * (1 - mom)
    y = y.astype(x.dtype, copy=False)
    if int(training_mode) == 1:
        return y, running_mean.astype(input_mean.dtype), running_var.astype(input_var.dtype)
    return (
        y,
        running_mean.astype(input_mean.dtype),
        running_var.astype(input_var.dtype),
        batch_mean.astype(input_mean.dtype),
        batch_var.astype(input_var.dtype),
    )


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's BatchNormalization pair (com.microsoft): BatchNormInternal, the training
# forward that also returns the batch mean and inverse deviation, and BatchNormalizationGrad, which
# reads them instead of recomputing the statistics (the gradient rule's form in a default build).


def _batch_norm_internal_outputs(i: list, a: dict) -> list:
    stat = [(i[3].dtype, i[1].shape), (i[4].dtype, i[1].shape)]
    return [(i[0].dtype, i[0].shape), *stat, *stat]


schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc): five outputs in training mode, one
        # otherwise; saved_mean and saved_inv_std have input_mean's and input_var's type
        "BatchNormInternal",
        inputs=(
            Formal("X", FLOATS),
            Formal("scale", FLOATS),
            Formal("B", FLOATS),
            Formal("input_mean", FLOATS),
            Formal("input_var", FLOATS),
        ),
        outputs=(
            Formal("Y", FLOATS),
            Formal("running_mean", FLOATS, optional=True),
            Formal("running_var", FLOATS, optional=True),
            Formal("saved_mean", FLOATS, optional=True),
            Formal("saved_inv_std", FLOATS, optional=True),
        ),
        attributes=(
            Attribute("epsilon", "float", 1e-5),
            Attribute("momentum", "float", 0.9),
            Attribute("training_mode", "int", 1),
        ),
        infer=_batch_norm_internal_outputs,
    )
)


@cpu_kernel("BatchNormInternal", domain=MICROSOFT)
def batch_norm_internal(x, scale, bias, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=1, _num_outputs=5):
    """BatchNormalization's training form plus the batch mean and 1 / sqrt(batch variance + epsilon)
    (the biased variance, as Y uses it); training_mode=0 is the inference form (Y only)."""
    if int(training_mode) == 0:
        return batch_normalization(x, scale, bias, input_mean, input_var, epsilon=epsilon)
    y, running_mean, running_var, batch_mean, batch_var = batch_normalization(
        x, scale, bias, input_mean, input_var, epsilon=epsilon, momentum=momentum, _num_outputs=5
    )
    inv_std = 1 / np.sqrt(batch_var + batch_var.dtype.type(epsilon))
    return y, running_mean, running_var, batch_mean, inv_std.astype(input_var.dtype, copy=False)


schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc): every input and output of one type;
        # ``mean`` and ``variance`` are BatchNormInternal's saved_mean and saved_inv_std (its gradient
        # builder passes them so, and its kernels read input 4 as the inverse deviation)
        "BatchNormalizationGrad",
        inputs=(
            Formal("dY", FLOATS),
            Formal("X", FLOATS),
            Formal("scale", FLOATS),
            Formal("mean", FLOATS),
            Formal("variance", FLOATS),
        ),
        outputs=(
            Formal("X_grad", FLOATS),
            Formal("scale_grad", FLOATS, optional=True),
            Formal("bias_grad", FLOATS, optional=True),
        ),
        attributes=(Attribute("epsilon", "float", 1e-5),),
        infer=lambda i, a: [(i[1].dtype, i[1].shape), (i[2].dtype, i[2].shape), (i[2].dtype, i[2].shape)],
    )
)


def batch_norm_grad_layout(dY, X, scale, mean, inv_std) -> tuple[int, int, int]:
    """(batch, channels, inner) of X (N, C, ...) after the checks of BatchNormalizationGrad's input
    shapes (arrays or device arrays: shapes and sizes only). Shared by the CPU and CUDA kernels."""
    same_shape(dY, X, "dY", "X")
    shape = tuple(int(d) for d in X.shape)
    if len(shape) < 2:
        raise KernelError(f"X must be (N, C, ...), got shape {list(shape)}")
    channels = shape[1]
    for name, value in (("scale", scale), ("mean", mean), ("variance (the inverse deviation)", inv_std)):
        if value.size != channels:
            raise KernelError(f"{name} has {value.size} elements, X {list(shape)} has {channels} channels")
    return shape[0], channels, math.prod(shape[2:])


@cpu_kernel("BatchNormalizationGrad", domain=MICROSOFT)
def batch_normalization_grad(dY, X, scale, mean, variance, *, epsilon=1e-5):
    """(dX, dScale, dBias) of training-mode BatchNormalization from the batch mean and inverse
    deviation (``variance``, as ONNX Runtime passes it): with xhat = (X - mean) * inv_std and m the
    elements per channel, dBias = sum(dY), dScale = sum(dY * xhat), dX = scale * inv_std * (dY -
    dBias / m - xhat * dScale / m). 16-bit inputs are computed in float32."""
    batch, channels, inner = batch_norm_grad_layout(dY, X, scale, mean, variance)
    ct = accumulation_dtype(X.dtype)
    x = X.astype(ct, copy=False).reshape(batch, channels, inner)
    dy = dY.astype(ct, copy=False).reshape(batch, channels, inner)
    inv = variance.astype(ct, copy=False).reshape(channels, 1)
    xhat = np.subtract(x, mean.astype(ct, copy=False).reshape(channels, 1))
    np.multiply(xhat, inv, out=xhat)
    dbias = np.add.reduce(np.add.reduce(dy, axis=2), axis=0)
    dscale = np.add.reduce(np.add.reduce(dy * xhat, axis=2), axis=0)
    count = ct.type(batch * inner)
    per_channel = (scale.astype(ct, copy=False).reshape(channels) * inv.reshape(channels)).reshape(channels, 1)
    dx = np.subtract(dy, (dbias / count).reshape(channels, 1))
    dx -= xhat * (dscale / count).reshape(channels, 1)
    dx *= per_channel
    return (
        dx.reshape(X.shape).astype(X.dtype, copy=False),
        dscale.reshape(scale.shape).astype(scale.dtype, copy=False),
        dbias.reshape(scale.shape).astype(scale.dtype, copy=False),
    )


def _stash_dtype(x_dtype, stash_type: int) -> np.dtype:
    if int(stash_type) != 1:
        raise KernelError(f"stash_type={stash_type} is not supported (only 1, float32)")
    return float_compute_dtype(x_dtype)


@cpu_kernel("LayerNormalization")
def layer_normalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    """Returns (Y, Mean, InvStdDev); Mean/InvStdDev have shape x.shape[:axis] + (1,)*... and the
    stash type, float32 (stash_type 1, the only one the spec allows besides bfloat16). Double inputs
    are computed in double (so float64 gradient checks stay precise) and their statistics stored
    in float32, the type the schema gives them."""
    rank = x.ndim
    axis = normalize_axis(axis, rank)
    fast = onednn_rows.layer_normalization(x, axis, scale, bias, epsilon) if stash_type == 1 else None
    if fast is not None:
        return fast
    st = _stash_dtype(x.dtype, stash_type)
    xc = x.astype(st, copy=False)
    axes = tuple(range(axis, rank))
    mean = xc.mean(axis=axes, keepdims=True)
    centered = xc - mean
    var = (centered * centered).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + st.type(epsilon))
    y = centered * inv_std * scale.astype(st, copy=False)
    if bias is not None:
        y = y + bias.astype(st, copy=False)
    return y.astype(x.dtype, copy=False), mean.astype(np.float32, copy=False), inv_std.astype(np.float32, copy=False)


@cpu_kernel("InstanceNormalization")
def instance_normalization(x, scale, bias, *, epsilon=1e-5):
    ct = float_compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    axes = tuple(range(2, x.ndim))
    mean = xc.mean(axis=axes, keepdims=True)
    var = xc.var(axis=axes, keepdims=True)
    shape = channel_shape(x)
    y = (xc - mean) / np.sqrt(var + ct.type(epsilon)) * scale.astype(ct).reshape(shape) + bias.astype(ct).reshape(shape)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("GroupNormalization")
def group_normalization(x, scale, bias, *, epsilon=1e-5, num_groups=None, stash_type=1):
    """Opset 18 form: scale/bias have num_groups entries; opset 21 form: C entries (told apart
    by their length; when num_groups == C both forms agree)."""
    if num_groups is None:
        raise KernelError("GroupNormalization needs the num_groups attribute")
    g = int(num_groups)
    n, c = x.shape[:2]
    if g < 1 or c % g:
        raise KernelError(f"num_groups={g} does not divide the {c} channels")
    st = _stash_dtype(x.dtype, stash_type)
    xg = x.astype(st, copy=False).reshape(n, g, -1)
    mean = xg.mean(axis=2, keepdims=True)
    var = xg.var(axis=2, keepdims=True)
    norm = ((xg - mean) / np.sqrt(var + st.type(epsilon))).reshape(x.shape)
    sc, bc = scale.reshape(-1).astype(st), bias.reshape(-1).astype(st)
    if sc.size == g and g != c:
        sc, bc = np.repeat(sc, c // g), np.repeat(bc, c // g)
    elif sc.size != c:
        raise KernelError(f"scale has {sc.size} entries; expected {c} (channels) or {g} (groups)")
    shape = channel_shape(x)
    return (norm * sc.reshape(shape) + bc.reshape(shape)).astype(x.dtype, copy=False)


@cpu_kernel("LpNormalization")
def lp_normalization(x, *, axis=-1, p=2):
    p = int(p)
    if p not in (1, 2):
        raise KernelError(f"p must be 1 or 2, got {p}")
    ct = float_compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    if p == 1:
        norm = np.abs(xc).sum(axis=axis, keepdims=True)
    else:
        norm = np.sqrt((xc * xc).sum(axis=axis, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(norm == 0, ct.type(0), xc / norm)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("LRN")
def lrn(x, *, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    if size is None:
        raise KernelError("LRN needs the size attribute")
    size = int(size)
    ct = float_compute_dtype(x.dtype)
    sq = x.astype(ct, copy=False) ** 2
    channels = x.shape[1]
    before, after = (size - 1) // 2, math.ceil((size - 1) / 2)
    cum = np.concatenate([np.zeros_like(sq[:, :1]), np.cumsum(sq, axis=1)], axis=1)
    hi = np.minimum(np.arange(channels) + after + 1, channels)
    lo = np.maximum(np.arange(channels) - before, 0)
    square_sum = cum[:, hi] - cum[:, lo]
    y = x.astype(ct, copy=False) / (ct.type(bias) + ct.type(alpha / size) * square_sum) ** ct.type(beta)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("RMSNormalization")
def rms_normalization(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    rank = x.ndim
    axis = normalize_axis(axis, rank)
    st = _stash_dtype(x.dtype, stash_type)
    xc = x.astype(st, copy=False)
    mean_square = (xc * xc).mean(axis=tuple(range(axis, rank)), keepdims=True)
    y = xc / np.sqrt(mean_square + st.type(epsilon)) * scale.astype(st, copy=False)
    return y.astype(x.dtype, copy=False)


@cpu_kernel("MeanVarianceNormalization")
def mean_variance_normalization(x, *, axes=(0, 2, 3)):
    """(X - E[X]) / (sqrt(Var[X]) + 1e-9), ONNX's function body, with the variance taken as the
    mean of the squared deviations: the body's E[X^2] - E[X]^2 cancels (float32 inputs 0.004 apart
    near -1.75 came out 2.5 % off, and one constant line in seven NaN, where the variance came out
    negative). ONNX Runtime's kernel computes it this way too."""
    ct = float_compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    axes = tuple(int(a) for a in axes)
    centered = xc - xc.mean(axis=axes, keepdims=True)
    variance = (centered * centered).mean(axis=axes, keepdims=True)
    y = centered / (np.sqrt(variance) + ct.type(1e-9))
    return y.astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's LayerNormalization gradients (com.microsoft)


def layer_norm_grad_rows(dY, X, scale, mean, inv_std_var, axis) -> tuple[int, int]:
    """(rows, cols) of X viewed as the rows LayerNormalizationGrad (or its simplified form, no
    ``mean``) normalizes, after the checks of its inputs' shapes (arrays or device arrays: shapes
    and sizes only). Shared by the CPU and CUDA kernels."""
    same_shape(dY, X, "dY", "X")
    shape = tuple(int(d) for d in X.shape)
    axis = normalize_axis(axis, len(shape))
    rows, cols = math.prod(shape[:axis]), math.prod(shape[axis:])
    if cols == 1:
        raise KernelError(f"the normalized part of X {list(shape)} from axis {axis} has one element")
    if scale.size != cols:
        raise KernelError(f"scale has {scale.size} elements, but X {list(shape)} normalizes {cols} per row from axis {axis}")
    if inv_std_var.size != rows or (mean is not None and mean.size != rows):
        raise KernelError(f"mean and inv_std_var must have {rows} elements (one per row of X {list(shape)})")
    return rows, cols


def _layer_norm_grad(dY, X, scale, mean, inv_std_var, axis, simplified):
    rows, cols = layer_norm_grad_rows(dY, X, scale, mean, inv_std_var, axis)
    fast = None if simplified else onednn_rows.layer_normalization_grad(dY, X, scale, mean, inv_std_var, rows)
    if fast is not None:
        return fast
    ct = accumulation_dtype(X.dtype)
    x = X.astype(ct, copy=False).reshape(rows, cols)
    dy = dY.astype(ct, copy=False).reshape(rows, cols)
    s = scale.astype(ct, copy=False).reshape(1, cols)
    inv = inv_std_var.astype(ct, copy=False).reshape(rows, 1)
    normalized = (x if simplified else x - mean.astype(ct, copy=False).reshape(rows, 1)) * inv
    a = dy * normalized
    b = dy * s * inv
    c = b * normalized
    dx = b - normalized * _float_mean(c, (1,), cols)
    if not simplified:
        dx = dx - _float_mean(b, (1,), cols)
    outputs = [dx.reshape(X.shape).astype(X.dtype), np.add.reduce(a, axis=0).reshape(scale.shape).astype(scale.dtype)]
    if not simplified:
        outputs.append(np.add.reduce(dy, axis=0).reshape(scale.shape).astype(scale.dtype))
    return tuple(outputs)


def _float_mean(x: np.ndarray, axes: tuple, count) -> np.ndarray:
    """``x.mean(axis=axes, keepdims=True)`` of a non-empty float32 / float64 array whose ``axes``
    hold ``count`` elements, by np.mean's own steps (a sum, then a division by the count) without
    its Python layers: the same bits."""
    total = np.add.reduce(x, axis=axes, dtype=x.dtype, keepdims=True)
    return np.true_divide(total, count_divisor(total.dtype, count), out=total, casting="unsafe")


LAYER_NORMALIZATION_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc); its gradient builder copies the forward
        # node's attributes, so epsilon and stash_type come along undeclared.
        "LayerNormalizationGrad",
        inputs=(
            Formal("Y_grad", FLOATS),
            Formal("X", FLOATS),
            Formal("scale", FLOATS),
            Formal("mean", frozenset({schemas.DT.FLOAT, schemas.DT.BFLOAT16})),
            Formal("inv_std_var", frozenset({schemas.DT.FLOAT, schemas.DT.BFLOAT16})),
        ),
        outputs=(
            Formal("X_grad", FLOATS),
            Formal("scale_grad", FLOATS, optional=True),
            Formal("bias_grad", FLOATS, optional=True),
        ),
        attributes=(
            Attribute("axis", "int", -1),
            Attribute("epsilon", "float", declared=False),
            Attribute("stash_type", "int", declared=False),
        ),
        infer=lambda i, a: [(i[1].dtype, i[1].shape), (i[2].dtype, i[2].shape), (i[2].dtype, i[2].shape)],
    )
)


@cpu_kernel("LayerNormalizationGrad", domain=MICROSOFT)
def layer_normalization_grad(dY, X, scale, mean, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale, dBias) of LayerNormalization from its saved Mean and InvStdDev."""
    return _layer_norm_grad(dY, X, scale, mean, inv_std_var, axis, simplified=False)


schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc): LayerNormalizationGrad without mean
        # and bias_grad (the RMS norm's gradient)
        "SimplifiedLayerNormalizationGrad",
        inputs=(
            Formal("Y_grad", FLOATS),
            Formal("X", FLOATS),
            Formal("scale", FLOATS),
            Formal("inv_std_var", frozenset({schemas.DT.FLOAT, schemas.DT.BFLOAT16})),
        ),
        outputs=(Formal("X_grad", FLOATS), Formal("scale_grad", FLOATS, optional=True)),
        attributes=(
            Attribute("axis", "int", -1),
            Attribute("epsilon", "float", declared=False),
            Attribute("stash_type", "int", declared=False),
        ),
        infer=lambda i, a: [(i[1].dtype, i[1].shape), (i[2].dtype, i[2].shape)],
    )
)


@cpu_kernel("SimplifiedLayerNormalizationGrad", domain=MICROSOFT)
def simplified_layer_normalization_grad(dY, X, scale, inv_std_var, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(dX, dScale) of SimplifiedLayerNormalization (RMS norm) from its saved InvStdDev."""
    return _layer_norm_grad(dY, X, scale, None, inv_std_var, axis, simplified=True)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime's fused normalizations (bert_defs.cc; SimplifiedLayerNormalization is registered
# in the ONNX domain): forward ops of models optimized for ORT inference. build_backward rewrites
# them into standard ops first (gradgen.passes.DecomposePass, with their lowerings as the form).
# Statistics are computed and returned in float32 for 16-bit inputs, in X's type otherwise.


def normalize_last(x, scale, bias, epsilon, simplified: bool, axis: int = -1):
    """(Y, mean or zeros, inv_std_var) of a layer norm (RMS norm when ``simplified``) of x over
    the axes from ``axis``, statistics kept with size-1 normalized axes."""
    st = float_compute_dtype(x.dtype)
    xc = x.astype(st, copy=False)
    axes = tuple(range(normalize_axis(axis, x.ndim), x.ndim))
    mean = np.zeros(xc.mean(axis=axes, keepdims=True).shape, dtype=st) if simplified else xc.mean(axis=axes, keepdims=True)
    centered = xc - mean
    inv_std = 1 / np.sqrt((centered * centered).mean(axis=axes, keepdims=True) + st.type(epsilon))
    y = centered * inv_std * scale.astype(st, copy=False)
    if bias is not None:
        y = y + bias.astype(st, copy=False)
    return y.astype(x.dtype, copy=False), mean, inv_std


def _skip_sum(op_type, input, skip, bias):
    """input + skip [+ bias]: skip broadcasts over input's leading axes (ORT takes (B, S, H),
    (1, S, H) or (S, H)), bias is 1-D over the hidden axis."""
    if (
        input.ndim != 3
        or skip.ndim not in (2, 3)
        or skip.shape[-2:] != input.shape[-2:]
        or skip.ndim == 3
        and skip.shape[0] not in (1, input.shape[0])
    ):
        raise KernelError(
            f"{op_type}: input must be (batch, sequence, hidden) and skip broadcast to it; "
            f"got {list(input.shape)} and {list(skip.shape)}"
        )
    total = input + skip
    if bias is not None:
        if bias.shape != input.shape[-1:]:
            raise KernelError(f"{op_type}: bias (shape {list(bias.shape)}) must be 1-D of the hidden size {input.shape[-1]}")
        total = total + bias
    return total.astype(input.dtype, copy=False)


def _check_hidden(op_type, name, value, hidden):
    if value is not None and value.shape != (hidden,):
        raise KernelError(f"{op_type}: {name} (shape {list(value.shape)}) must be 1-D of the hidden size {hidden}")


@cpu_kernel("SkipLayerNormalization", domain=MICROSOFT)
def skip_layer_normalization(input, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    """(output, mean, inv_std_var, input_skip_bias_sum): LayerNormalization over the hidden axis
    of input + skip [+ bias], times gamma [plus beta]."""
    total = _skip_sum("SkipLayerNormalization", input, skip, bias)
    for name, value in (("gamma", gamma), ("beta", beta)):
        _check_hidden("SkipLayerNormalization", name, value, input.shape[-1])
    y, mean, inv_std = normalize_last(total, gamma, beta, epsilon, simplified=False)
    return y, mean, inv_std, total


@cpu_kernel("SkipSimplifiedLayerNormalization", domain=MICROSOFT)
def skip_simplified_layer_normalization(input, skip, gamma, bias=None, *, epsilon=1e-12):
    """(output, mean (zeros, as ONNX Runtime writes it), inv_std_var, input_skip_bias_sum): RMS
    normalization over the hidden axis of input + skip [+ bias], times gamma."""
    total = _skip_sum("SkipSimplifiedLayerNormalization", input, skip, bias)
    _check_hidden("SkipSimplifiedLayerNormalization", "gamma", gamma, input.shape[-1])
    y, mean, inv_std = normalize_last(total, gamma, None, epsilon, simplified=True)
    return y, mean, inv_std, total


@cpu_kernel("SimplifiedLayerNormalization")
def simplified_layer_normalization(X, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """(Y, inv_std_var): RMS normalization over the axes from ``axis``, times scale (ONNX
    Runtime's contrib op of the ONNX domain, the RMSNormalization of opset 23). inv_std_var is
    float32 (stash_type 1) as ONNX Runtime gives it, also for double X (computed in double)."""
    _stash_dtype(X.dtype, stash_type)
    y, _, inv_std = normalize_last(X, scale, None, epsilon, simplified=True, axis=axis)
    return y, inv_std.astype(np.float32, copy=False)


def _skip_norm_types(infos, attrs):
    x = infos[0]
    stats = DT.FLOAT if x.dtype in (DT.FLOAT16, DT.BFLOAT16) else x.dtype
    stat_shape = None if x.shape is None else (*x.shape[:-1], 1)
    return [(x.dtype, x.shape), (stats, stat_shape), (stats, stat_shape), (x.dtype, x.shape)]


def _skip_norm_schema(op_type: str, *inputs: str) -> Schema:
    return schemas.declare(
        Schema(
            op_type,
            inputs=tuple(Formal(name, FLOATS, optional=k >= 3) for k, name in enumerate(inputs)),
            outputs=(
                Formal("output", FLOATS),
                Formal("mean", FLOATS, optional=True),
                Formal("inv_std_var", FLOATS, optional=True),
                Formal("input_skip_bias_sum", FLOATS, optional=True),
            ),
            attributes=(Attribute("epsilon", "float", 1e-12),),
            infer=_skip_norm_types,
        )
    )


SKIP_LAYER_NORMALIZATION = _skip_norm_schema("SkipLayerNormalization", "input", "skip", "gamma", "beta", "bias")
SKIP_SIMPLIFIED_LAYER_NORMALIZATION = _skip_norm_schema("SkipSimplifiedLayerNormalization", "input", "skip", "gamma", "bias")


# ---------------------------------------------------------------------------------------------
# Prepared calls (kernels/table.py, ``cpu_prepare``): the kernels' ufuncs in the kernels' order,
# with the axes resolved once, numpy's reductions called directly and the temporaries reused.


@cpu_prepare("LayerNormalization")
def prepare_layer_normalization(constants: tuple, attrs: dict):
    """For float32 / float64 inputs (their own stash type) with stash_type 1."""
    axis, epsilon = attrs.get("axis", -1), attrs.get("epsilon", 1e-5)
    if int(attrs.get("stash_type", 1)) != 1:
        return None

    def geometry(shape: tuple) -> tuple:
        """The normalized axes and their element count."""
        axes = tuple(range(normalize_axis(axis, len(shape)), len(shape)))
        return axes, math.prod(shape[a] for a in axes)

    per_input = per_shape(geometry)

    def run(x, scale, bias=None):
        if x.dtype.kind != "f" or x.dtype.itemsize < 4 or x.ndim == 0 or not -x.ndim <= axis < x.ndim:
            return layer_normalization(x, scale, bias, **attrs)
        axes, count = per_input(x.shape)
        if not count:
            return layer_normalization(x, scale, bias, **attrs)
        fast = onednn_rows.layer_normalization(x, axes[0], scale, bias, epsilon)
        if fast is not None:
            return fast
        st = x.dtype
        mean = _float_mean(x, axes, count)
        centered = np.subtract(x, mean)
        y = np.multiply(centered, centered)
        inv_std = _float_mean(y, axes, count)
        np.add(inv_std, st.type(epsilon), out=inv_std)
        np.sqrt(inv_std, out=inv_std)
        np.true_divide(1, inv_std, out=inv_std)
        np.multiply(centered, inv_std, out=y)
        np.multiply(y, scale.astype(st, copy=False), out=y)
        if bias is not None:
            np.add(y, bias.astype(st, copy=False), out=y)
        return y, mean.astype(np.float32, copy=False), inv_std.astype(np.float32, copy=False)

    return run


@cpu_prepare("BatchNormalization")
def prepare_batch_normalization(constants: tuple, attrs: dict):
    """The inference form for float32 / float64 inputs: ``(x - mean) / sqrt(var + epsilon) * scale
    + bias`` in place in one output array; with the four per-channel inputs constant, they are
    reshaped (and the divisor worked out) once per rank."""
    if int(attrs.get("training_mode", 0)) == 1 or attrs.get("_num_outputs", 1) > 1:
        return None
    epsilon = attrs.get("epsilon", 1e-5)
    given = constant_inputs(constants, 1, 2, 3, 4)

    def channels(key: tuple) -> tuple | None:
        """(mean, divisor, scale, bias) shaped for the rank, from the constant inputs."""
        rank, dtype = key
        if given is None or any(v is None or v.ndim != 1 for v in given):
            return None
        shape = (-1,) + (1,) * (rank - 2)
        sc, bc, mean, var = (np.asarray(v).astype(dtype, copy=False).reshape(shape) for v in given)
        return mean, np.sqrt(var + dtype.type(epsilon)), sc, bc

    kept = per_shape(channels)

    def run(x, scale, bias, input_mean, input_var):
        if x.dtype.kind != "f" or x.dtype.itemsize < 4 or x.ndim < 2:
            return batch_normalization(x, scale, bias, input_mean, input_var, **attrs)
        per_channel = kept((x.ndim, x.dtype))
        if per_channel is None:
            shape = channel_shape(x)
            sc, bc, mean, var = (v.astype(x.dtype, copy=False).reshape(shape) for v in (scale, bias, input_mean, input_var))
            per_channel = mean, np.sqrt(var + x.dtype.type(epsilon)), sc, bc
        mean, divisor, sc, bc = per_channel
        y = np.subtract(x, mean)
        np.true_divide(y, divisor, out=y)
        np.multiply(y, sc, out=y)
        np.add(y, bc, out=y)
        return y

    return run
