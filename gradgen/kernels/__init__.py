"""Kernels: numpy CPU kernels (the reference semantics) and, where written, CUDA kernels."""

from gradgen.kernels.registry import all_kernels, cpu_kernel, cuda_kernel, lookup

__all__ = ["all_kernels", "cpu_kernel", "cuda_kernel", "lookup"]
