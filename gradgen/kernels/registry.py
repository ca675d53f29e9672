"""Kernel lookup by (domain, op_type), filled from explicit lists of families.

``CPU_FAMILIES`` and ``CUDA_FAMILIES`` name the kernel modules (gradgen/kernels/cpu/<family>.py,
gradgen/kernels/cuda/<family>.py, the same family names as grads/rules and passes/lowering). They
declare their kernels with the decorators of gradgen/kernels/table.py and never import this
module; the first lookup imports the CPU families, the first request for CUDA the CUDA ones.
"""

from __future__ import annotations

from gradgen.kernels.table import (
    KERNELS,
    MICROSOFT,
    ONNX_DOMAIN,
    RUNTIME,
    KernelEntry,
    cpu_kernel,
    cpu_prepare,
    cuda_kernel,
    normalize_domain,
    prepared_cpu_call,
)
from gradgen.ops.schemas import FUSED_FORWARD_OPS, LOWERED_FORWARD_OPS
from gradgen.registration import Families

CPU_FAMILIES = (
    "attention",
    "control",
    "conv",
    "elementwise",
    "indexing",
    "loss",
    "matmul",
    "norm",
    "optimizer",
    "pool",
    "quantize",
    "recurrent",
    "reduction",
    "shape",
)
# attention and recurrent ops run on the GPU as the standard ops their lowerings write (see
# CUDA_STANDARD_FORMS): no launchers of their own
CUDA_FAMILIES = tuple(family for family in CPU_FAMILIES if family not in ("attention", "recurrent"))

_KERNELS = KERNELS  # the table itself, under its former name

# Ops that the gradient rules' graphs hold (forward or emitted) and that have no CUDA launcher: on a
# GPU session the executor runs their numpy kernel on host copies (with a one-time warning). Each is
# declared here with the reason and run on the GPU by tests/cuda/test_cuda_fallbacks.py;
# tests/test_coverage.py fails for such an op that is not declared, and for a declared one that
# gained a launcher.
CUDA_FALLBACKS: dict[tuple[str, str], str] = {}

# Ops a GPU Session runs as their standard-op form: before it plans, the Session rewrites them with
# the passes build-backward runs (gradgen/executor/standard_forms.py), so that every node of the
# form has a launcher and no step copies to the host. Where the form does not apply (the condition
# given), the op stays and runs its numpy kernel on host copies, as a declared fallback does.
# tests/cuda/test_cuda_fallbacks.py runs each on the GPU.
CUDA_STANDARD_FORMS: dict[tuple[str, str], str] = {
    ("", "GridSample"): "DecomposePass, for a float X",
    ("", "RoiAlign"): "DecomposePass, for a fixed sampling_ratio (an adaptive one samples a run-time number of points)",
    ("", "STFT"): "DecomposePass, for frames the shapes fix",
    ("", "DeformConv"): "DecomposePass, for static shapes",
    ("", "LSTM"): "UnrollRecurrentPass, for a static sequence length",
    ("", "GRU"): "UnrollRecurrentPass, for a static sequence length",
    ("", "RNN"): "UnrollRecurrentPass, for a static sequence length",
    ("", "Loop"): "UnrollLoopsPass, for a trip count the model fixes (a data-dependent one runs its body step by step)",
    ("", "Scan"): "UnrollLoopsPass, for a static length (another runs its body step by step)",
    # ONNX Runtime's forward ops of models optimized for its inference (their lowerings)
    **{
        op: "DecomposePass (the op's lowering), for an input of known type and rank"
        for op in LOWERED_FORWARD_OPS - FUSED_FORWARD_OPS
    },
}

__all__ = [
    "CPU_FAMILIES",
    "CUDA_FALLBACKS",
    "CUDA_STANDARD_FORMS",
    "CUDA_FAMILIES",
    "MICROSOFT",
    "ONNX_DOMAIN",
    "RUNTIME",
    "KernelEntry",
    "all_kernels",
    "cpu_kernel",
    "cpu_prepare",
    "cuda_kernel",
    "load_cuda_kernels",
    "lookup",
    "normalize_domain",
    "prepared_cpu_call",
]


def lookup(domain: str, op_type: str) -> KernelEntry | None:
    _CPU.load()
    if _CUDA_REQUESTED:
        _CUDA.load()
    return KERNELS.get((normalize_domain(domain), op_type))


def all_kernels() -> dict[tuple[str, str], KernelEntry]:
    """Every registered kernel, CUDA launchers included (listing them needs no GPU)."""
    _CPU.load()
    load_cuda_kernels()
    return dict(KERNELS)


_CPU = Families("gradgen.kernels.cpu", CPU_FAMILIES)
_CUDA = Families("gradgen.kernels.cuda", CUDA_FAMILIES)
_CUDA_REQUESTED = False


def load_cuda_kernels() -> None:
    """Register the CUDA launchers (importing them needs no GPU; running them does)."""
    global _CUDA_REQUESTED
    _CUDA_REQUESTED = True
    _CUDA.load()
