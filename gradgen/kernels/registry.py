"""Kernel lookup by (domain, op_type), filled from explicit lists of families.

``CPU_FAMILIES`` and ``CUDA_FAMILIES`` name the kernel modules (gradgen/kernels/cpu/<family>.py,
gradgen/kernels/cuda/<family>.py, the same family names as grads/rules and passes/lowering). They
declare their kernels with the decorators of gradgen/kernels/table.py and never import this
module; the first lookup imports the CPU families, the first request for CUDA the CUDA ones.
"""

from __future__ import annotations

import importlib

from gradgen.kernels.table import KERNELS, MICROSOFT, ONNX_DOMAIN, KernelEntry, cpu_kernel, cuda_kernel, normalize_domain

CPU_FAMILIES = ("conv", "elementwise", "indexing", "loss", "matmul", "norm", "optimizer", "pool", "reduction", "shape")
CUDA_FAMILIES = ("conv", "elementwise", "indexing", "loss", "matmul", "norm", "pool", "reduction", "shape")

_KERNELS = KERNELS  # the table itself, under its former name

# Ops that the gradient rules' graphs hold (forward or emitted) and that have no CUDA launcher: on a
# GPU session the executor runs their numpy kernel on host copies (with a one-time warning). Each is
# declared here with the reason and run on the GPU by tests/cuda/test_cuda_fallbacks.py;
# tests/test_coverage.py fails for such an op that is not declared, and for a declared one that
# gained a launcher.
CUDA_FALLBACKS: dict[tuple[str, str], str] = {
    ("", "ConvTranspose"): "no CUDA launcher yet",
    ("", "Einsum"): "no CUDA launcher yet",
    ("", "Mean"): "no CUDA launcher yet",
    ("", "Range"): "no CUDA launcher: the rules emit it for small index vectors (shape arithmetic)",
    ("", "Resize"): "no CUDA launcher yet",
    ("", "TopK"): "no CUDA launcher yet",
}

__all__ = ["CPU_FAMILIES", "CUDA_FALLBACKS", "CUDA_FAMILIES", "MICROSOFT", "ONNX_DOMAIN", "KernelEntry", "all_kernels",
           "cpu_kernel", "cuda_kernel", "load_cuda_kernels", "lookup", "normalize_domain"]


def lookup(domain: str, op_type: str) -> KernelEntry | None:
    _ensure_loaded()
    if _CUDA_REQUESTED:
        _ensure_cuda_loaded()
    return KERNELS.get((normalize_domain(domain), op_type))


def all_kernels() -> dict[tuple[str, str], KernelEntry]:
    """Every registered kernel, CUDA launchers included (listing them needs no GPU)."""
    _ensure_loaded()
    load_cuda_kernels()
    return dict(KERNELS)


_LOADED = False
_LOAD_ERRORS: list = []  # an import error of the modules that fill the registry
_CUDA_REQUESTED = False
_CUDA_LOADED = False


def _import_families(package: str, families: tuple[str, ...]) -> None:
    try:
        for family in families:
            importlib.import_module(f"{package}.{family}")
    except Exception as exc:  # later calls must not report every op as unsupported
        _LOAD_ERRORS.append(exc)
        raise


def _ensure_loaded() -> None:
    """Import the CPU kernel modules once; their decorators fill the table."""
    global _LOADED
    if _LOAD_ERRORS:
        raise RuntimeError(f"gradgen's registry failed to load: {_LOAD_ERRORS[0]}") from _LOAD_ERRORS[0]
    if _LOADED:
        return
    _LOADED = True
    _import_families("gradgen.kernels.cpu", CPU_FAMILIES)


def load_cuda_kernels() -> None:
    """Register the CUDA launchers (importing them needs no GPU; running them does)."""
    global _CUDA_REQUESTED
    _CUDA_REQUESTED = True
    _ensure_cuda_loaded()


def _ensure_cuda_loaded() -> None:
    global _CUDA_LOADED
    if _LOAD_ERRORS:
        raise RuntimeError(f"gradgen's registry failed to load: {_LOAD_ERRORS[0]}") from _LOAD_ERRORS[0]
    if _CUDA_LOADED:
        return
    _CUDA_LOADED = True
    _import_families("gradgen.kernels.cuda", CUDA_FAMILIES)
