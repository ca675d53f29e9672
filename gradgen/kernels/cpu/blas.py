"""Large float32 matrix products through oneDNN's ``dnnl_sgemm`` where it is installed.

numpy's matmul runs on the BLAS its wheel was built with (OpenBLAS on PyPI). On the x86-64 CPUs
gradgen's CPU path was measured on, oneDNN's sgemm takes 10-20 % less time than OpenBLAS at one
thread on the shapes that dominate a transformer step: a layer's 128 x 768 x 3072 products and a
language model's 50,257-row head (docs/BENCHMARKS.md has the numbers). oneDNN comes from the
``onednn-cpu-gomp`` wheel (a dependency on Linux x86-64: the library alone, on GNU OpenMP), loaded
on the first large product. Everything else stays with numpy: other dtypes, products below
``MIN_MULTIPLY_ADDS`` per matrix (a call through ctypes and oneDNN's dispatch costs about 10 us),
operands that would need a copy, CPUs without AVX2, a forked process (GNU OpenMP's threads do not survive fork: the
child of a process that had run a parallel product hung), and any process where
``GRADGEN_CPU_GEMM=numpy`` is set.

Threads: oneDNN's sgemm uses the OpenMP pool, which OMP_NUM_THREADS and threadpoolctl's limits
(``gradgen.executor.threads``) set, as they set numpy's BLAS. Two pools on the same cores fight:
OpenBLAS's idle workers spin for a while after each call and take the cores oneDNN's threads need
(a GPT-2 step at two threads took twice as long). So while oneDNN is loaded, a CPU run gives numpy's
BLAS one thread (``numpy_blas_single_threaded``): what is left to it are products below
``MIN_MULTIPLY_ADDS``, where a second thread buys little.

Orientation: every product runs in its own orientation. Until 2026-12-07 a few-row ``x @ W.T``
on several threads ran as its transpose ``(W @ x.T).T`` plus a copy, which had measured faster; on
the same machine later it was 3-4 % slower over a whole GPT-2 step (docs/BENCHMARKS.md), and the
direct product gives the same bits at one thread and at two for every row count tried.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import threading
from typing import Any

import numpy as np

MIN_MULTIPLY_ADDS = 1 << 21  # from here a product runs through oneDNN (one thread: as fast as numpy at 2^21)
DISABLE_VARIABLE = "GRADGEN_CPU_GEMM"  # "numpy": every product through numpy's matmul
LIBRARY_VARIABLE = "GRADGEN_ONEDNN_LIBRARY"  # a libdnnl.so to load instead of the installed wheel's
DISTRIBUTION = "onednn-cpu-gomp"

_FLOAT32 = np.dtype(np.float32)
_ITEM = _FLOAT32.itemsize
_sgemm: Any = None  # the loaded dnnl_sgemm, False where there is none; None until first asked
_omp_threads: Any = None  # the OpenMP runtime's omp_get_max_threads (the pool oneDNN uses), once loaded
_omp_set_threads: Any = None  # ... and its omp_set_num_threads
_library: Any = None  # the loaded libdnnl (ctypes.CDLL), once loaded
_numpy_blas: list | None = None  # threadpoolctl's controllers of numpy's BLAS, found once


def _forget_after_fork() -> None:
    """In a forked child, numpy does the products: GNU OpenMP does not survive fork, and a child
    whose parent had used oneDNN's thread pool hangs on its first parallel product. Every forked
    child does (the parent may have used the same libgomp through another library)."""
    global _sgemm
    _sgemm = False


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_after_fork)


def library_path() -> str | None:
    """The libdnnl shared library to load: $GRADGEN_ONEDNN_LIBRARY, else the onednn-cpu-gomp
    wheel's (its files are installed under the environment's lib/), else None."""
    given = os.environ.get(LIBRARY_VARIABLE)
    if given:
        return given
    from importlib import metadata

    try:
        files = metadata.distribution(DISTRIBUTION).files or []
    except metadata.PackageNotFoundError:
        return None
    # the wheel holds libdnnl.so, .so.3 and .so.3.x as three copies: load one, always the same
    names = sorted((f for f in files if f.name.startswith("libdnnl.so")), key=lambda f: len(f.name))
    return os.path.realpath(names[-1].locate()) if names else None


def _cpu_has_avx2() -> bool:
    """oneDNN's sgemm has JIT kernels from AVX2 on; below that its reference GEMM is slower than
    any BLAS. Linux reports the flags in /proc/cpuinfo (the wheel is Linux-only)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return "avx2" in line.split()
    except OSError:
        pass
    return False


def _load():
    """dnnl_sgemm with its C signature, or False where oneDNN is off, missing or unusable."""
    if os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("numpy", "off", "0", "no"):
        return False
    path = library_path()
    if path is None or not _cpu_has_avx2():
        return False
    global _omp_threads, _omp_set_threads, _library
    try:
        library = ctypes.CDLL(path)
        sgemm = library.dnnl_sgemm
    except (OSError, AttributeError):
        return False
    _library = library
    try:  # found among the library's dependencies (its OpenMP runtime)
        _omp_threads, _omp_set_threads = library.omp_get_max_threads, library.omp_set_num_threads
        _omp_threads.argtypes, _omp_threads.restype = [], ctypes.c_int
        _omp_set_threads.argtypes, _omp_set_threads.restype = [ctypes.c_int], None
    except AttributeError:
        _omp_threads = _omp_set_threads = None
    dim, pointer = ctypes.c_int64, ctypes.c_void_p
    # dnnl_sgemm(transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), row-major
    flag, scalar = ctypes.c_char, ctypes.c_float
    sgemm.argtypes = [flag, flag, dim, dim, dim, scalar, pointer, dim, pointer, dim, scalar, pointer, dim]
    sgemm.restype = ctypes.c_int
    return sgemm


def loaded():
    """dnnl_sgemm (loaded on the first call), or False."""
    global _sgemm
    if _sgemm is None:
        _sgemm = _load()
    return _sgemm


def library() -> ctypes.CDLL:
    """The loaded oneDNN library, for its other primitives (``onednn_conv``); only where
    ``loaded()`` is true."""
    assert loaded() and _library is not None
    return _library


@contextlib.contextmanager
def caller_thread_only():
    """Inside the block, oneDNN's primitives started from this thread run on it alone (OpenMP's
    thread count is a per-thread setting, restored on leaving). A small primitive gains little from
    a second thread and, where another process keeps a core busy, may wait milliseconds for it."""
    if _omp_set_threads is None or _omp_threads is None:
        yield
        return
    threads = _omp_threads()
    _omp_set_threads(1)
    try:
        yield
    finally:
        _omp_set_threads(threads)


def available() -> bool:
    """Whether large float32 products run through oneDNN in this process."""
    return bool(loaded())


def describe() -> str:
    """Which library runs the large float32 products, for benchmark headers and profiles."""
    if not available():
        return "numpy's BLAS" + (f" ({DISABLE_VARIABLE} is set)" if os.environ.get(DISABLE_VARIABLE) else "")
    from importlib import metadata

    try:
        version = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a library named by $GRADGEN_ONEDNN_LIBRARY
        return f"oneDNN ({library_path()})"
    return f"oneDNN ({DISTRIBUTION} {version}) from {MIN_MULTIPLY_ADDS} multiply-adds, numpy's BLAS below"


def _layout(x: np.ndarray) -> tuple[bytes, int] | None:
    """(b"N", row stride) for a matrix with unit column stride, (b"T", column stride) for the
    transpose of one (a ``.T`` view), in elements; None for any other strides."""
    rows, cols = x.shape
    row_stride, col_stride = x.strides
    if col_stride == _ITEM and row_stride % _ITEM == 0 and row_stride >= cols * _ITEM:
        return b"N", row_stride // _ITEM
    if row_stride == _ITEM and col_stride % _ITEM == 0 and col_stride >= rows * _ITEM:
        return b"T", col_stride // _ITEM
    return None


def below_onednn(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether every matrix of ``a @ b`` has fewer than ``MIN_MULTIPLY_ADDS`` multiply-adds (a small
    model's all): ``matmul`` then passes the product to numpy's matmul, which a caller that keeps a
    plan (the prepared Gemm) may call directly."""
    return bool(b.ndim) and a.size * b.shape[-1] < MIN_MULTIPLY_ADDS


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b, out=out)``: through oneDNN for float32 (..., M, K) @ (..., K, N) whose
    matrices have at least ``MIN_MULTIPLY_ADDS`` multiply-adds each, else numpy's own. A 2-D right
    operand takes every row of the left one in one call (see ``_as_rows``); batched ones run matrix
    by matrix."""
    if b.ndim == 2 and a.ndim > 2 and a.shape[-1] == b.shape[0]:
        return _as_rows(a, b, out)
    if below_onednn(a, b):
        return np.matmul(a, b, out=out)
    if a.dtype != _FLOAT32 or b.dtype != _FLOAT32 or a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        return np.matmul(a, b, out=out)  # numpy computes, or says what does not fit
    k, n = b.shape[-2:]
    if b.ndim == 2:  # a is 2-D too: a stack times a matrix went to _as_rows
        m = a.shape[0]
        batch: tuple = ()
        shape = (m, n)
    else:
        m = a.shape[-2]
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:
            return np.matmul(a, b, out=out)
        shape = batch + (m, n)
    if m * n * k < MIN_MULTIPLY_ADDS or 0 in batch:
        return np.matmul(a, b, out=out)
    sgemm = loaded()
    if not sgemm:
        return np.matmul(a, b, out=out)
    if out is not None and not _writable_target(out, shape, a, b):
        return np.matmul(a, b, out=out)  # numpy copies for an out that overlaps, refuses a read-only one
    result = np.empty(shape, dtype=_FLOAT32) if out is None else out
    if not batch:
        pairs = [(a, b, result)]
    else:
        left, right = np.broadcast_to(a, batch + (m, k)), np.broadcast_to(b, batch + (k, n))
        pairs = [(left[index], right[index], result[index]) for index in np.ndindex(*batch)]
    for left_matrix, right_matrix, out_matrix in pairs:
        if not _product(sgemm, left_matrix, right_matrix, out_matrix):
            return np.matmul(a, b, out=out)
    return result


def _as_rows(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """``a @ b`` for a (..., M, K) left operand and a 2-D right one as one (rows, K) @ (K, N) product.

    numpy's matmul runs such a product as one BLAS call per (M, K) matrix. A sequence-first
    transformer's projections are (T, B, K) views of a (B, T, K) array: at 65 x 2 x 64 @ 64 x 192
    that was 65 calls of two rows each, 245 us, where one 130-row product of a copy takes 40 us.
    So the rows are gathered (a free reshape for a C-ordered ``a``, else one copy, which costs
    less than the product it feeds) and multiplied at once."""
    rows = math.prod(a.shape[:-1])
    shape = a.shape[:-1] + (b.shape[1],)
    flat_out = out.reshape(rows, b.shape[1]) if out is not None and out.shape == shape and out.flags.c_contiguous else None
    if out is not None and flat_out is None:
        return np.matmul(a, b, out=out)  # an out= of another shape or layout: numpy's own checks and loop
    product = matmul(a.reshape(rows, a.shape[-1]), b, out=flat_out)
    return out if out is not None else product.reshape(shape)


def _writable_target(out: np.ndarray, shape: tuple, a: np.ndarray, b: np.ndarray) -> bool:
    """Whether sgemm may write the product straight into ``out``: C-ordered float32 of the result's
    shape, writable, and sharing no memory with an operand."""
    return (
        out.shape == shape
        and out.dtype == _FLOAT32
        and out.flags.c_contiguous
        and out.flags.writeable
        and not np.may_share_memory(out, a)
        and not np.may_share_memory(out, b)
    )


def _product(sgemm, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> bool:
    """out = a @ b for 2-D float32 matrices (out C-ordered); False where a layout does not suit
    sgemm or it refuses (the caller then uses numpy)."""
    layout_a, layout_b = _layout(a), _layout(b)
    if layout_a is None or layout_b is None:
        return False
    m, k = a.shape
    n = b.shape[1]
    (trans_a, lda), (trans_b, ldb) = layout_a, layout_b
    return sgemm(trans_a, trans_b, m, n, k, 1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, out.ctypes.data, n) == 0


def _numpy_blas_controllers() -> list:
    global _numpy_blas
    if _numpy_blas is None:
        from threadpoolctl import ThreadpoolController

        _numpy_blas = list(ThreadpoolController().select(user_api="blas").lib_controllers)
    return _numpy_blas


class _NumpyBlasHold:
    """numpy's BLAS on one thread while any run holds it. Overlapping runs (several Python threads)
    share the hold: the first to enter sets it, the last to leave restores the counts. The counts
    are process-wide, as threadpoolctl's limits are: ``cpu_threads`` blocks of several threads at
    once may leave one another's limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0  # runs inside the hold now
        self._restore: list = []  # (controller, its thread count before the first of them)

    def __enter__(self) -> None:
        with self._lock:
            if self._holders == 0:
                for controller in _numpy_blas_controllers():
                    threads = controller.get_num_threads()
                    if threads is not None and threads > 1:
                        controller.set_num_threads(1)
                        self._restore.append((controller, threads))
            self._holders += 1

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                for controller, threads in self._restore:
                    controller.set_num_threads(threads)
                self._restore = []


_HOLD = _NumpyBlasHold()
_NO_HOLD = contextlib.nullcontext()


def numpy_blas_single_threaded():
    """A context in which numpy's BLAS runs on one thread, where oneDNN is loaded; else one that
    changes nothing (and costs next to nothing: every CPU run enters it)."""
    return _HOLD if _sgemm else _NO_HOLD
