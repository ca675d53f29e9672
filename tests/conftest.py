"""Shared test configuration: tests marked `cuda` skip where no GPU answers."""

from __future__ import annotations

import os

import pytest

# The suite runs one worker per core (-n 2): BLAS and torch thread pools inside each worker only
# oversubscribe the cores (torch comparisons ran 5-10x slower). Set before numpy or torch load.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


def _cuda_reason() -> str | None:
    from gradgen.executor.cuda_probe import cuda_unavailable_reason

    return cuda_unavailable_reason()


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items:
        return
    reason = _cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no usable GPU: {reason}")
    for item in cuda_items:
        item.add_marker(skip)
