"""exp and the logistic sigmoid of large float32 arrays through oneDNN's eltwise primitive.

numpy computes float32 exp at about 1.3 ns an element on a CPU without AVX-512 (its fast version
needs AVX-512), and gradgen's Sigmoid takes four numpy passes (eight for inputs below -87.7). oneDNN's JIT kernels
(``jit:avx2`` and up) run them on every core of its OpenMP pool: on a 2-core AVX2 machine, exp of
(128, 50257) took 5.1 ms on one thread against numpy's 11.7, and a Sigmoid of (8, 96, 56, 56) 2.0
against 24.1 ms. (Its tanh was no faster than numpy's: 1.36 against 1.00 ms at (128, 3072), so
Tanh stays with numpy.) A call costs about 10 us, and where another process keeps a core busy an
OpenMP call now and then waits for it (a 16,384-element exp: a median of 0.02 ms but up to 9 ms),
so only arrays of at least ``MIN_ELEMENTS`` elements (about 0.3 ms of numpy's exp) go to oneDNN.
Smaller ones, other dtypes, strided arrays, and processes where oneDNN is not used (see
``onednn``) stay with numpy (``apply`` returns None).

Values: within 4 ulp of the float64 truth on a dense sweep (numpy's exp: 2). NaN in gives NaN out
(oneDNN's exp gives +inf for NaN), and inputs below ``UNDERFLOW_BELOW``, where oneDNN's results
lose accuracy and flush to 0 near -87, are computed by numpy: one reduction over the input finds
both, and only arrays that hold such elements pay for the masks. Each element is computed alone,
so the bits do not depend on the thread count.
"""

from __future__ import annotations

import ctypes

import numpy as np

from gradgen.kernels.cpu import onednn

ALGORITHMS = {"logistic": 0x29, "exp": 0x2A}  # dnnl_alg_kind_t (oneDNN 3.x)
MIN_ELEMENTS = 1 << 18
# below this input oneDNN's results lose accuracy (5 ulp from -80, up to a flush to 0 near -87):
# such elements are computed again by numpy
UNDERFLOW_BELOW = -80.0
_PLANS_KEPT = 64

_plans = onednn.PlanCache(_PLANS_KEPT)


def _eltwise(api, algorithm: int, size: int) -> onednn.Primitive:
    """One eltwise primitive over ``size`` contiguous float32 elements: ``plan(x, out)``."""

    def describe(owned: list):
        desc = onednn.strided_desc(api, (size,))
        owned.append(("memory_desc_destroy", desc))
        primitive_desc = onednn.Handle()
        onednn.check(
            api.eltwise_forward_primitive_desc_create(
                ctypes.byref(primitive_desc), api.engine, onednn.FORWARD_INFERENCE, algorithm, desc, desc, 0.0, 0.0, None
            )
        )
        owned.append(("primitive_desc_destroy", primitive_desc))
        return primitive_desc, [(onednn.ARG_SRC, desc), (onednn.ARG_DST, desc)]

    return onednn.Primitive(api, describe)


def _plan(api, kind: str, size: int) -> onednn.Primitive | None:
    """The plan for ``kind`` over ``size`` elements (None where oneDNN refused it), made once and
    kept for the ``_PLANS_KEPT`` sizes used last."""
    if api.eltwise_forward_primitive_desc_create is None:
        return None
    return _plans.get((kind, size), lambda: _eltwise(api, ALGORITHMS[kind], size))


def apply(kind: str, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray | None:
    """oneDNN's ``kind`` ("exp" or "logistic") of ``x`` into ``out`` (a new array if None),
    or None where numpy should compute it (see the module's docstring). ``out`` may be ``x``."""
    if x.dtype != np.float32 or x.size < MIN_ELEMENTS or not x.flags.c_contiguous:
        return None
    if out is not None and (out.dtype != np.float32 or out.shape != x.shape or not out.flags.c_contiguous):
        return None
    api = onednn.loaded_api()
    plan = None if api is None else _plan(api, kind, x.size)
    if plan is None:
        return None
    lowest = np.minimum.reduce(x, axis=None)  # one pass: a NaN propagates, and the smallest input
    redo = None
    if np.isnan(lowest) or lowest < UNDERFLOW_BELOW:  # rare: the masks, before ``out`` may overwrite x
        low = x < UNDERFLOW_BELOW
        redo = (np.isnan(x) if kind == "exp" else None, low, _numpy(kind, x[low]))
    result = np.empty_like(x) if out is None else out
    plan(x, result)
    if redo is not None:
        nan, low, again = redo
        if nan is not None:  # oneDNN's exp gives +inf for NaN
            result[nan] = np.nan
        result[low] = again
    return result


def _numpy(kind: str, x: np.ndarray) -> np.ndarray:
    """``kind`` of inputs below ``UNDERFLOW_BELOW`` (negative), by numpy."""
    e = np.exp(x)
    return e if kind == "exp" else e / (1 + e)


def exp(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.exp(x, out=out)``, through oneDNN where ``apply`` takes it."""
    fast = apply("exp", x, out)
    return fast if fast is not None else np.exp(x, out=out)
