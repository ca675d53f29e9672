"""CUDA launchers: conv."""

from __future__ import annotations

from gradgen.kernels.registry import cuda_kernel  # noqa: F401
