"""The launcher toolkit's dtype dispatch (gradgen/kernels/cuda/launch.py), which needs no GPU."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import dtype_suffix, grid_for, require_suffix

COVERED = {
    np.float16: "f16",
    np.float32: "f32",
    np.float64: "f64",
    np.int32: "i32",
    np.int64: "i64",
    np.bool_: "b8",
    np.int8: "i8",
    np.uint8: "u8",
}


@pytest.mark.parametrize("dtype", list(COVERED), ids=lambda d: np.dtype(d).name)
def test_suffix_of_a_covered_dtype(dtype):
    assert dtype_suffix(dtype) == require_suffix(dtype) == COVERED[dtype]


@pytest.mark.parametrize("dtype", [np.complex64, np.uint16, np.int16, np.uint64])
def test_suffix_of_an_uncovered_dtype(dtype):
    assert dtype_suffix(dtype) is None
    with pytest.raises(KernelError, match=f"dtype {np.dtype(dtype).name} is not supported by the CUDA kernels"):
        require_suffix(dtype)


def test_grid_for_caps_and_rounds_up():
    assert grid_for(1) == 1
    assert grid_for(256) == 1
    assert grid_for(257) == 2
    assert grid_for(10**12) == 65535 * 8
