"""gradgen.kernels.cpu.blas: large float32 products through oneDNN's sgemm, numpy's matmul otherwise.

The threshold is lowered so that small operands take the oneDNN path; every result is checked
against a float64 product, and the numpy fallbacks against numpy itself.
"""

from __future__ import annotations

import os
import platform
import sys

import numpy as np
import pytest

from gradgen.kernels.cpu import blas

ONEDNN_EXPECTED = sys.platform == "linux" and platform.machine() == "x86_64" and blas._cpu_has_avx2()
needs_onednn = pytest.mark.skipif(not blas.available(), reason="oneDNN is not installed or this CPU lacks AVX2")


@pytest.fixture
def every_size(monkeypatch):
    monkeypatch.setattr(blas, "MIN_MULTIPLY_ADDS", 1)


def _check(result, a, b):
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert result.dtype == np.float32 and result.shape == expected.shape
    np.testing.assert_allclose(result, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(expected).max())))


@pytest.mark.skipif(not ONEDNN_EXPECTED, reason="the dependency is declared for Linux x86-64 only")
def test_onednn_is_used_where_the_dependency_is_declared():
    """On Linux x86-64 with AVX2 the wheel is a dependency: the products must not fall back silently."""
    assert blas.library_path() is not None
    assert blas.available()


@needs_onednn
@pytest.mark.parametrize(
    "a_shape, b_shape, transpose_a, transpose_b",
    [
        ((7, 5), (5, 3), False, False),
        ((5, 7), (5, 3), True, False),  # a .T view
        ((7, 5), (3, 5), False, True),  # b .T view, as a Linear layer's weight
        ((5, 7), (3, 5), True, True),
        ((2, 4, 6), (6, 3), False, False),  # a C-ordered batch: one call over all rows
        ((3, 4, 6), (3, 6, 2), False, False),  # batched right operand: matrix by matrix
        ((2, 1, 4, 6), (3, 6, 2), False, False),  # broadcast batch dimensions
        ((4, 6), (3, 6, 2), False, False),
        ((1, 6), (6, 1), False, False),
    ],
)
def test_products_match_float64(every_size, a_shape, b_shape, transpose_a, transpose_b):
    rng = np.random.default_rng(len(a_shape) * 10 + len(b_shape))
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32)
    a = a.T if transpose_a else a
    b = b.T if transpose_b else b
    _check(blas.matmul(a, b), a, b)


@needs_onednn
def test_strided_and_permuted_operands(every_size):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 12), dtype=np.float32)[::2, 1::3]  # no unit stride: numpy's path
    b = rng.standard_normal((4, 5), dtype=np.float32)
    _check(blas.matmul(a, b), a, b)
    left = rng.standard_normal((4, 6, 5), dtype=np.float32).transpose(1, 0, 2)  # not C-ordered
    right = rng.standard_normal((5, 3), dtype=np.float32)
    _check(blas.matmul(left, right), left, right)
    rows = rng.standard_normal((6, 5), dtype=np.float32)[:, None, :].repeat(2, axis=1)[:, 0, :]  # row stride 10
    _check(blas.matmul(rows, right), rows, right)


@needs_onednn
def test_out_receives_the_product(every_size):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((3, 5, 7), dtype=np.float32)
    b = rng.standard_normal((3, 7, 4), dtype=np.float32)
    out = np.full((3, 5, 4), np.nan, dtype=np.float32)
    assert blas.matmul(a, b, out=out) is out
    _check(out, a, b)
    view = np.full((2, 5, 4), np.nan, dtype=np.float32)[1]  # a C-ordered view: written in place
    blas.matmul(a[0], b[0], out=view)
    _check(view, a[0], b[0])


@needs_onednn
def test_an_out_that_overlaps_an_operand_or_is_read_only_is_numpys_case(every_size):
    """numpy copies when out shares memory with an operand and refuses a read-only out; writing
    straight into either would give another product or change a constant."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((16, 16), dtype=np.float32)
    b = rng.standard_normal((16, 16), dtype=np.float32)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    for alias in ("a", "b"):
        left, right = a.copy(), b.copy()
        out = left if alias == "a" else right
        blas.matmul(left, right, out=out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
    frozen = np.zeros((16, 16), dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        blas.matmul(a, b, out=frozen)
    assert not frozen.any()


def test_a_stack_times_a_matrix_is_one_product_of_its_rows(monkeypatch):
    """(..., M, K) @ (K, N) runs as one (rows, K) product (a strided stack copied first), not as
    numpy's one call per matrix: a sequence-first layout's 65 x 2 x 64 @ 64 x 192 was 65 calls."""
    calls = []
    real = np.matmul
    monkeypatch.setattr(blas.np, "matmul", lambda a, b, **kw: calls.append((a.shape, b.shape)) or real(a, b, **kw))
    rng = np.random.default_rng(8)
    seq_first = rng.standard_normal((2, 65, 64), dtype=np.float32).transpose(1, 0, 2)
    weight = rng.standard_normal((64, 12), dtype=np.float32)
    result = blas.matmul(seq_first, weight)  # below MIN_MULTIPLY_ADDS: numpy, in one call
    assert calls == [((130, 64), (64, 12))]
    assert result.shape == (65, 2, 12)
    _check(result, seq_first, weight)
    for dtype in (np.float64, np.int64):  # any dtype numpy multiplies
        left, right = seq_first.astype(dtype), weight.astype(dtype)
        np.testing.assert_allclose(blas.matmul(left, right), real(left, right), rtol=1e-12)
    out = np.full((65, 2, 12), np.nan, dtype=np.float32)
    assert blas.matmul(seq_first, weight, out=out) is out
    _check(out, seq_first, weight)
    strided_out = np.full((2, 65, 12), np.nan, dtype=np.float32).transpose(1, 0, 2)  # numpy's own loop
    assert blas.matmul(seq_first, weight, out=strided_out) is strided_out
    _check(strided_out, seq_first, weight)
    assert blas.matmul(np.ones((0, 3, 4), np.float32), np.ones((4, 5), np.float32)).shape == (0, 3, 5)


def test_other_dtypes_and_small_products_are_numpys_own():
    rng = np.random.default_rng(3)
    for dtype in (np.float64, np.float16, np.int64):
        a = rng.integers(-3, 3, (6, 4)).astype(dtype)
        b = rng.integers(-3, 3, (4, 5)).astype(dtype)
        result = blas.matmul(a, b)
        assert result.dtype == np.matmul(a, b).dtype
        np.testing.assert_array_equal(result, np.matmul(a, b))
    a = rng.standard_normal((3, 4), dtype=np.float32)
    b = rng.standard_normal((4, 2), dtype=np.float32)
    np.testing.assert_array_equal(blas.matmul(a, b), np.matmul(a, b))  # below the threshold: numpy, bit for bit


@pytest.mark.parametrize("threshold", [1, blas.MIN_MULTIPLY_ADDS])
def test_mismatched_shapes_raise_numpys_error(monkeypatch, threshold):
    monkeypatch.setattr(blas, "MIN_MULTIPLY_ADDS", threshold)
    a = np.ones((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match="matmul"):
        blas.matmul(a, np.ones((5, 2), dtype=np.float32))
    with pytest.raises(ValueError):
        blas.matmul(np.ones((2, 3, 4), dtype=np.float32), np.ones((3, 4, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="dimensions"):  # a 0-d operand: numpy's message, not an IndexError
        blas.matmul(a, np.array(2.0, dtype=np.float32))
    assert blas.matmul(a, np.ones(4, dtype=np.float32)).shape == (3,)  # 1-D operands as numpy treats them


def test_empty_operands(every_size):
    a = np.ones((0, 4), dtype=np.float32)
    assert blas.matmul(a, np.ones((4, 3), dtype=np.float32)).shape == (0, 3)
    assert blas.matmul(np.ones((2, 3, 0), dtype=np.float32), np.ones((0, 5), dtype=np.float32)).tolist() == [[[0.0] * 5] * 3] * 2


@pytest.mark.parametrize("value", ["numpy", "off", "0"])
def test_the_environment_switch_turns_onednn_off(monkeypatch, value):
    monkeypatch.setenv(blas.DISABLE_VARIABLE, value)
    assert blas._load() is False


def test_a_library_that_does_not_load_means_numpy(monkeypatch, tmp_path):
    broken = tmp_path / "libdnnl.so"
    broken.write_bytes(b"not a shared library")
    monkeypatch.setenv(blas.LIBRARY_VARIABLE, str(broken))
    assert blas._load() is False


@needs_onednn
def test_numpy_blas_runs_on_one_thread_inside_a_run_and_gets_its_threads_back():
    from threadpoolctl import threadpool_limits

    controllers = blas._numpy_blas_controllers()
    if not controllers:
        pytest.skip("threadpoolctl finds no BLAS under numpy")
    with threadpool_limits(2, user_api="blas"):
        before = [c.get_num_threads() for c in controllers]
        with blas.numpy_blas_single_threaded():
            assert all(c.get_num_threads() == 1 for c in controllers)
        assert [c.get_num_threads() for c in controllers] == before


@needs_onednn
def test_overlapping_runs_share_the_hold_and_the_last_restores_it():
    """Runs of two Python threads that overlap: the first to leave must not give the BLAS its
    threads back under the other, and the last to leave must (an interleaving once left it at 1)."""
    from threadpoolctl import threadpool_limits

    controllers = blas._numpy_blas_controllers()
    if not controllers:
        pytest.skip("threadpoolctl finds no BLAS under numpy")
    with threadpool_limits(2, user_api="blas"):
        first, second = blas.numpy_blas_single_threaded(), blas.numpy_blas_single_threaded()  # two runs: one shared hold
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        assert all(c.get_num_threads() == 1 for c in controllers)
        second.__exit__(None, None, None)
        assert all(c.get_num_threads() == 2 for c in controllers)


@needs_onednn
def test_thread_limit_reaches_onednns_openmp_pool():
    from threadpoolctl import threadpool_info

    from gradgen.executor.threads import cpu_threads

    with cpu_threads(1):
        openmp = [info for info in threadpool_info() if info["user_api"] == "openmp"]
        assert openmp and all(info["num_threads"] == 1 for info in openmp)


@needs_onednn
def test_the_kernels_compute_what_numpy_computes(monkeypatch):
    """MatMul, Gemm, FusedMatMul, Conv, ConvTranspose and ConvGrad with every product through
    oneDNN, against the same kernels with every product through numpy."""
    from gradgen.kernels.cpu import conv, matmul

    rng = np.random.default_rng(4)

    def f32(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    x, w, dy = f32(2, 3, 9, 8), f32(4, 3, 3, 2), f32(2, 4, 9, 7)
    cases = [
        lambda: matmul.matmul(f32(2, 5, 6), f32(6, 3)),
        lambda: matmul.gemm(f32(6, 5), f32(3, 6), f32(3), alpha=0.5, beta=2.0, transA=1, transB=1),
        lambda: matmul.fused_matmul(f32(2, 6, 5), f32(2, 3, 6), alpha=2.0, transA=1, transB=1),
        lambda: conv.conv(x, w, f32(4), pads=[1, 0, 1, 0]),
        lambda: conv.conv(f32(2, 4, 6, 6), f32(4, 2, 3, 3), group=2, strides=[2, 2]),
        lambda: conv.conv_transpose(f32(2, 3, 5, 4), f32(3, 2, 3, 3), strides=[2, 1]),
        lambda: conv.conv_grad(dy, x, w, pads=[1, 0, 1, 0]),
    ]
    for case in cases:
        state = rng.bit_generator.state
        monkeypatch.setattr(blas, "MIN_MULTIPLY_ADDS", 1)
        through_onednn = case()
        rng.bit_generator.state = state  # the same operands again
        monkeypatch.setattr(blas, "MIN_MULTIPLY_ADDS", 1 << 62)
        through_numpy = case()
        for got, want in zip(*(r if isinstance(r, tuple) else (r,) for r in (through_onednn, through_numpy))):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def _product_sum_in_child(a, queue) -> None:
    queue.put(float(blas.matmul(a, a).sum(dtype=np.float64)))


@needs_onednn
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_computes_after_the_parent_used_onednns_threads():
    """GNU OpenMP's thread pool does not survive fork: a child whose parent had run a parallel
    product through oneDNN hung on its own first one. A forked child uses numpy instead."""
    import multiprocessing

    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(5).standard_normal((256, 256), dtype=np.float32)
    with threadpool_limits(2, user_api="openmp"):
        want = float(blas.matmul(a, a).sum(dtype=np.float64))  # the parent's pool now exists
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_product_sum_in_child, args=(a, queue))
        child.start()
        child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0
    assert queue.get(timeout=5) == pytest.approx(want, rel=1e-4)


@needs_onednn
@pytest.mark.parametrize("rows", [4, 16, 128, 512])
@pytest.mark.parametrize("transposed", [True, False])
def test_a_linears_product_gives_the_same_bits_on_one_thread_and_on_two(rows, transposed):
    """``--threads`` leaves a product's bits alone, whatever its rows and the right operand's layout
    (``x @ W.T`` a transposed view, or a row-major matrix)."""
    from gradgen.executor.threads import available_cores, cpu_threads

    if available_cores() < 2:
        pytest.skip("needs two cores")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((rows, 768), dtype=np.float32)
    w = rng.standard_normal((3072, 768), dtype=np.float32)
    right = w.T if transposed else np.ascontiguousarray(w.T)
    with cpu_threads(1):
        one = blas.matmul(x, right)
    with cpu_threads(2):
        two = blas.matmul(x, right)
    np.testing.assert_array_equal(one, two)
    _check(two, x, right)
