"""QLinearMatMul and QLinearConv cases (inputs as the ops take them) for the CPU tests
(tests/test_qlinear.py) and the GPU ones (tests/cuda/test_cuda_qlinear.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

SCALE_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _ints(rng, shape, dtype):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max + 1, shape).astype(dtype)


def _scale(rng, shape=(), scale_type=np.float32):
    return np.asarray(rng.uniform(0.01, 0.1, shape)).astype(scale_type)


def matmul_case(dtype=np.uint8, a_shape=(3, 5), b_shape=(5, 4), per_row=False, per_column=False, scale_type=np.float32, seed=0):
    """[a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point]."""
    rng = np.random.default_rng(seed)
    rows = a_shape[-2] if per_row else ()
    columns = b_shape[-1] if per_column else ()
    return [
        _ints(rng, a_shape, dtype),
        _scale(rng, rows, scale_type),
        _ints(rng, rows, dtype) // 4,
        _ints(rng, b_shape, dtype),
        _scale(rng, columns, scale_type),
        _ints(rng, columns, dtype) // 4,
        np.asarray(rng.uniform(0.5, 2.0, rows)).astype(scale_type),
        _ints(rng, (), dtype) // 2,
    ]


def conv_case(dtype=np.uint8, x_shape=(2, 4, 7, 6), w_shape=(6, 2, 3, 3), per_channel=False, bias=True, seed=0):
    """[x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, B] (B None
    without bias); the node needs group = x channels / w's second dimension."""
    rng = np.random.default_rng(seed)
    channels = (w_shape[0],) if per_channel else ()
    return [
        _ints(rng, x_shape, dtype),
        _scale(rng),
        _ints(rng, (), dtype) // 4,
        _ints(rng, w_shape, dtype),
        _scale(rng, channels),
        np.zeros(channels, dtype) if per_channel else _ints(rng, (), dtype) // 4,
        np.asarray(rng.uniform(0.5, 2.0)).astype(np.float32),
        _ints(rng, (), dtype) // 2,
        rng.integers(-2000, 2000, w_shape[0]).astype(np.int32) if bias else None,
    ]
