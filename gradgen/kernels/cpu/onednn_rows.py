"""Softmax, LayerNormalization and its gradient of float32 rows through oneDNN's primitives.

numpy runs each of these as five to twelve passes, each a separate call. On a 2-core AVX2 EPYC, one
thread, the kernels' numpy paths against these functions: LayerNormalization of (128, 768) 169
against 64 us, of (520, 64) 102 against 51 us; Softmax of (128, 768) 225 against 106 us, of
(12, 128, 128) 516 against 155 us; LayerNormalizationGrad of (128, 768) 379 against 114 us, of
(1024, 768) 3.4 against 0.5 ms. The primitives normalise the last axis of a C-ordered float32
array viewed as (rows, columns); anything else (other dtypes or layouts, fewer than
``MIN_ELEMENTS`` elements, processes where oneDNN is not used) stays with numpy: the functions
return None. Below ``onednn.POOL_FROM_ELEMENTS`` elements a call runs on the caller's thread.

Values (float32 rounding apart, equal to numpy's forms):
- LayerNormalization: oneDNN gives the rows' mean and variance; InvStdDev is 1 / sqrt(var + eps)
  in numpy, as the numpy kernel computes it. Its gradient: oneDNN's backward primitive from the
  saved Mean and InvStdDev (as the variance 1 / InvStdDev^2 with epsilon 0); dX was as close to
  float64 as numpy's form (5.3e-7 against 5.9e-7 at (128, 768)).
- Softmax: oneDNN's exp of x - max flushes to 0 from about -87 (numpy's gives down to 1e-45), and
  a log after a Softmax would then give -inf. So a Softmax goes to oneDNN only where no row can
  reach that: the whole array's max less its smallest element other than -inf below
  ``SOFTMAX_SPREAD`` (two reductions and a mask). -inf entries (a causal attention mask) give 0
  and a row of -inf gives NaNs, as in numpy; arrays with NaN or +inf stay with numpy.

LogSoftmax stays with numpy: oneDNN's (``dnnl_softmax_log``) was 15 ulp from the float64 truth on
(64, 1000) standard normal rows (4.4e-6 absolute), numpy's form 1.4 ulp.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from gradgen.kernels.cpu import onednn

# below, a call (about 20 us with its arguments) costs what numpy's passes take: a prepared
# LayerNormalization of (130, 64) took 40 us in numpy and 38 in oneDNN, of (260, 64) 59 and 44
MIN_ELEMENTS = 1 << 14
SOFTMAX_SPREAD = 80.0  # x - max above -80: oneDNN's exp is accurate there (within 5 ulp)
# oneDNN's row sums lose accuracy with the width: measured against float64 on rows of 4 x standard
# normals, its Softmax was 25 ulp off at 768 columns (numpy's form 21), 37 at 2048 (20), 136 at
# 50,257 (32); so only rows up to this width (an attention's, up to 1,024 positions) go to it
SOFTMAX_MAX_COLUMNS = 1024
_SOFTMAX = 0x30000  # dnnl_softmax_accurate
_ARG_MEAN, _ARG_VARIANCE, _ARG_SCALE, _ARG_SHIFT = 49, 50, 51, 52
_ARG_DIFF_SCALE, _ARG_DIFF_SHIFT = 255, 256
_BACKWARD = 128  # dnnl_backward: the data and the scale and shift gradients
_USE_SCALE, _USE_SHIFT = 0x2, 0x4
_FLOAT32 = np.dtype(np.float32)
_plans = onednn.PlanCache()


def _rows_api(x: np.ndarray):
    """The Api where ``x`` suits the primitives (C-ordered float32, at least 2-D in effect, at
    least MIN_ELEMENTS elements), else None."""
    if x.dtype != _FLOAT32 or x.ndim == 0 or x.size < MIN_ELEMENTS or not x.flags.c_contiguous or x.shape[-1] < 2:
        return None
    return onednn.loaded_api()


def _softmax_plan(api, rows: int, cols: int) -> onednn.Primitive:
    def describe(owned: list):
        desc = onednn.strided_desc(api, (rows, cols))
        owned.append(("memory_desc_destroy", desc))
        primitive_desc = onednn.Handle()
        onednn.check(
            api.softmax_forward_primitive_desc_create(
                ctypes.byref(primitive_desc), api.engine, onednn.FORWARD_INFERENCE, _SOFTMAX, desc, desc, 1, None
            )
        )
        owned.append(("primitive_desc_destroy", primitive_desc))
        return primitive_desc, [(onednn.ARG_SRC, desc), (onednn.ARG_DST, desc)]

    return onednn.Primitive(api, describe)


def softmax(x: np.ndarray) -> np.ndarray | None:
    """Softmax over the last axis of ``x``, or None (numpy's case)."""
    api = _rows_api(x)
    if api is None or api.softmax_forward_primitive_desc_create is None or x.shape[-1] > SOFTMAX_MAX_COLUMNS:
        return None
    highest = np.maximum.reduce(x, axis=None)
    lowest = np.minimum.reduce(x, axis=None)
    if lowest == -np.inf:  # masked entries (0 either way) are left out: the masked reduction costs 6x
        lowest = np.minimum.reduce(x, axis=None, initial=np.inf, where=x != -np.inf)
    if not highest - lowest < SOFTMAX_SPREAD:  # a NaN or +inf included (numpy's NaN rows)
        return None
    cols = x.shape[-1]
    rows = x.size // cols
    plan = _plans.get(("softmax", rows, cols), lambda: _softmax_plan(api, rows, cols))
    if plan is None:
        return None
    y = np.empty_like(x)
    plan(x, y)
    return y


def _layer_norm_descs(api, rows: int, cols: int, owned: list) -> tuple:
    """The (rows, cols) data, (rows,) statistics and (cols,) parameter descriptors, owned."""
    descs = tuple(onednn.strided_desc(api, shape) for shape in ((rows, cols), (rows,), (cols,)))
    owned.extend(("memory_desc_destroy", d) for d in descs)
    return descs


def _layer_norm_forward(api, data, stats, epsilon: float, flags: int, owned: list):
    """The forward (training) primitive descriptor over those descriptors, owned."""
    primitive_desc = onednn.Handle()
    onednn.check(
        api.layer_normalization_forward_primitive_desc_create(
            ctypes.byref(primitive_desc), api.engine, onednn.FORWARD_TRAINING, data, data, stats, epsilon, flags, None
        )
    )
    owned.append(("primitive_desc_destroy", primitive_desc))
    return primitive_desc


def _layer_norm_plan(api, rows: int, cols: int, epsilon: float, shift: bool) -> onednn.Primitive:
    def describe(owned: list):
        data, stats, params = _layer_norm_descs(api, rows, cols, owned)
        primitive_desc = _layer_norm_forward(api, data, stats, epsilon, _USE_SCALE | (_USE_SHIFT if shift else 0), owned)
        arguments = [(onednn.ARG_SRC, data), (onednn.ARG_DST, data), (_ARG_MEAN, stats), (_ARG_VARIANCE, stats)]
        arguments.append((_ARG_SCALE, params))
        if shift:
            arguments.append((_ARG_SHIFT, params))
        return primitive_desc, arguments

    return onednn.Primitive(api, describe)


def layer_normalization(x: np.ndarray, axis: int, scale: np.ndarray, bias: np.ndarray | None, epsilon: float):
    """(Y, Mean, InvStdDev) of LayerNormalization over the axes from ``axis`` (normalised, >= 0)
    with float32 statistics, the statistics shaped x.shape[:axis] + (1, ...); or None (numpy's
    case: also where scale or bias is not one float32 value per normalised element)."""
    api = _rows_api(x)
    if api is None or api.layer_normalization_forward_primitive_desc_create is None or axis >= x.ndim:
        return None
    rows = math.prod(x.shape[:axis])
    cols = x.size // rows if rows else 0
    if cols < 2 or not all(_params_fit(p, cols) for p in (scale, bias) if p is not None):
        return None
    key = ("layer_norm", rows, cols, float(epsilon), bias is not None)
    plan = _plans.get(key, lambda: _layer_norm_plan(api, rows, cols, float(epsilon), bias is not None))
    if plan is None:
        return None
    y = np.empty_like(x)
    stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    mean, inv_std = np.empty(stats_shape, _FLOAT32), np.empty(stats_shape, _FLOAT32)
    arrays = [x, y, mean, inv_std, np.ascontiguousarray(scale)] + ([np.ascontiguousarray(bias)] if bias is not None else [])
    plan(*arrays)
    np.add(inv_std, _FLOAT32.type(epsilon), out=inv_std)  # the variance oneDNN wrote, made InvStdDev
    np.sqrt(inv_std, out=inv_std)
    np.true_divide(1, inv_std, out=inv_std)
    return y, mean, inv_std


def _params_fit(p: np.ndarray, cols: int) -> bool:
    return p.dtype == _FLOAT32 and p.size == cols


def _layer_norm_grad_plan(api, rows: int, cols: int) -> onednn.Primitive:
    def describe(owned: list):
        data, stats, params = _layer_norm_descs(api, rows, cols, owned)
        flags = _USE_SCALE | _USE_SHIFT
        forward = _layer_norm_forward(api, data, stats, 0.0, flags, owned)  # the backward's hint
        backward = onednn.Handle()
        onednn.check(
            api.layer_normalization_backward_primitive_desc_create(
                ctypes.byref(backward), api.engine, _BACKWARD, data, data, data, stats, 0.0, flags, forward, None
            )
        )
        owned.append(("primitive_desc_destroy", backward))
        arguments = [
            (onednn.ARG_SRC, data),
            (_ARG_MEAN, stats),
            (_ARG_VARIANCE, stats),
            (onednn.ARG_DIFF_DST, data),
            (_ARG_SCALE, params),
            (_ARG_SHIFT, params),  # asked for, not read: the gradients do not depend on it
            (onednn.ARG_DIFF_SRC, data),
            (_ARG_DIFF_SCALE, params),
            (_ARG_DIFF_SHIFT, params),
        ]
        return backward, arguments

    return onednn.Primitive(api, describe)


def layer_normalization_grad(dY: np.ndarray, X: np.ndarray, scale: np.ndarray, mean: np.ndarray, inv_std: np.ndarray, rows: int):
    """(dX, dScale, dBias) of LayerNormalization from its saved Mean and InvStdDev, X viewed as
    ``rows`` rows; or None (numpy's case). oneDNN takes the variance: 1 / InvStdDev^2 with epsilon 0,
    from which it makes InvStdDev again (within an ulp or two)."""
    api = _rows_api(X)
    if api is None or api.layer_normalization_backward_primitive_desc_create is None or not rows:
        return None
    cols = X.size // rows
    if dY.dtype != _FLOAT32 or not dY.flags.c_contiguous or dY.shape != X.shape or not _params_fit(scale, cols):
        return None
    if not all(s.dtype == _FLOAT32 and s.size == rows for s in (mean, inv_std)):
        return None
    plan = _plans.get(("layer_norm_grad", rows, cols), lambda: _layer_norm_grad_plan(api, rows, cols))
    if plan is None:
        return None
    variance = np.square(inv_std, dtype=_FLOAT32).reshape(rows)
    np.true_divide(1, variance, out=variance)
    dX = np.empty_like(X)
    d_scale, d_bias = np.empty(cols, _FLOAT32), np.empty(cols, _FLOAT32)
    shift = np.zeros(cols, _FLOAT32)
    arrays = (X, np.ascontiguousarray(mean).reshape(rows), variance, dY, np.ascontiguousarray(scale), shift, dX, d_scale, d_bias)
    plan(*arrays)
    return dX, d_scale.reshape(scale.shape), d_bias.reshape(scale.shape)
