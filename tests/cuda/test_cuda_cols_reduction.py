"""The column reductions (innermost axis kept: bias gradients' sums over [rows, C]) with 16-byte
loads (``colsv``) and without (``cols``) against the numpy kernels, bit-identical from run to run."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_elementwise import check, dev, host, kernels
from tests.cuda.test_cuda_reduce_norm_loss import REDUCE_OPS, sum_tol

pytestmark = pytest.mark.cuda

CASES = [
    ((2048, 768), [0]),            # GPT-2 small's bias gradients: colsv, split over rows
    ((8, 256, 3072), [0, 1]),      # the same as the rule emits it (leading axes merged)
    ((8, 768 * 64), [0]),          # few rows, many columns: no split
    ((6, 40, 3, 64), [0, 2]),      # two reduced groups (strided offsets), an outer kept axis
    ((3, 500, 12), [1]),           # outer kept axis, C = 12
    ((1000, 6), [0]),              # C not a multiple of 4: cols (float32), colsv (float64)
    ((999, 7), [0]),               # odd C: cols
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axes", CASES, ids=str)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_column_reductions(op, shape, axes, dtype):
    rng = np.random.default_rng(7)
    lo, hi = {"ReduceLogSum": (0.5, 2.0), "ReduceProd": (0.99, 1.01)}.get(op, (-2.0, 2.0))
    x = rng.uniform(lo, hi, size=shape).astype(dtype)
    cpu, cuda = kernels(op)
    want = cpu(x.astype(np.float64), np.asarray(axes), keepdims=1).astype(dtype)
    xd = dev(x)
    first = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    second = host(cuda(xd, np.asarray(axes, np.int64), keepdims=1))
    assert first.tobytes() == second.tobytes()
    count = int(np.prod([shape[a] for a in axes]))
    rtol, atol = sum_tol(op, dtype, count)
    check(first, want, rtol=rtol, atol=atol)


def test_misaligned_input_takes_the_scalar_kernel():
    """A view starting 4 bytes into its buffer cannot use 16-byte loads: same sums all the same."""
    rng = np.random.default_rng(8)
    x = rng.uniform(-1, 1, size=(257 * 512 + 1,)).astype(np.float32)
    cpu, cuda = kernels("ReduceSum")
    view = dev(x)[1:].reshape(257, 512)
    want = cpu(x[1:].reshape(257, 512).astype(np.float64), np.asarray([0]), keepdims=0).astype(np.float32)
    got = host(cuda(view, np.asarray([0], np.int64), keepdims=0))
    rtol, atol = sum_tol("ReduceSum", np.float32, 257)
    check(got, want, rtol=rtol, atol=atol)
