"""The CPU thread policy: how many threads numpy's BLAS (and the OpenMP pool it may bring) uses.

gradgen's CPU executor runs one step at a time and starts no threads of its own, so the BLAS pool
(with oneDNN, its OpenMP pool for the large products, numpy's BLAS held to one thread during a run)
is the only busy one: pools are never nested. By default it keeps what the BLAS chose (all available cores,
unless OMP_NUM_THREADS and co. say otherwise); ``cpu_threads(n)`` (``--threads N``) limits it for a
block, through threadpoolctl, which reaches OpenBLAS, MKL and BLIS alike, and the OpenMP pool of
oneDNN's GEMMs (``gradgen.kernels.cpu.blas``).
"""

from __future__ import annotations

import contextlib
import os

from gradgen.errors import UsageError


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def check_threads(threads: int | None) -> None:
    """UsageError for a thread count outside 1 .. the available cores (None: the default)."""
    cores = available_cores()
    if threads is not None and not 1 <= threads <= cores:
        raise UsageError(f"--threads {threads}: expected 1 to {cores} (the cores this process may use)")


@contextlib.contextmanager
def cpu_threads(threads: int | None):
    """Inside the block, numpy's BLAS and OpenMP pools use at most ``threads`` threads (None: as
    they are). More than the available cores is refused: it would only oversubscribe them."""
    if threads is None:
        yield
        return
    check_threads(threads)
    from threadpoolctl import threadpool_limits

    from gradgen.kernels.cpu import blas

    blas.loaded()  # oneDNN's OpenMP pool, if it is used, must be there for the limit to reach it

    with threadpool_limits(limits=threads):
        yield
