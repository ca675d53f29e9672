"""Fixtures shared by the GPU tests of every family."""

from __future__ import annotations

import warnings

import pytest

from gradgen.kernels import registry


@pytest.fixture(scope="module")
def rt():
    """gradgen.cuda.runtime, with the CUDA launchers registered."""
    from gradgen.cuda import runtime

    registry.load_cuda_kernels()
    return runtime


@pytest.fixture
def quiet_warnings():
    """Silence warnings (the fallbacks' one-time notes, cuDNN's) for the test that uses it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
