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
CUDA_FAMILIES = ("conv", "elementwise", "indexing", "loss", "matmul", "norm", "pool", "reduction", "shape")

_KERNELS = KERNELS  # the table itself, under its former name

# Ops that the gradient rules' graphs hold (forward or emitted) and that have no CUDA launcher: on a
# GPU session the executor runs their numpy kernel on host copies (with a one-time warning). Each is
# declared here with the reason and run on the GPU by tests/cuda/test_cuda_fallbacks.py;
# tests/test_coverage.py fails for such an op that is not declared, and for a declared one that
# gained a launcher.
CUDA_FALLBACKS: dict[tuple[str, str], str] = {
    ("", "Unique"): "no CUDA launcher yet: it needs a stable device sort of any length (TopK's: lines <= 4096)",
    ("", "DynamicQuantizeLinear"): "no CUDA launcher: its gradient rule refuses, so only forward models hold it",
    ("", "QuantizeLinear"): "no CUDA launcher yet (its gradient rule refuses: only forward models hold it)",
    ("", "DequantizeLinear"): "no CUDA launcher yet",
    # differentiated by rules of standard ops; the forward op itself has no launcher
    ("", "AffineGrid"): "no CUDA launcher yet",
    ("", "CenterCropPad"): "no CUDA launcher yet",
    ("", "Col2Im"): "no CUDA launcher yet",
    ("", "DeformConv"): "no CUDA launcher: backward graphs hold its standard-op form (passes/decompose.py)",
    ("", "GridSample"): "no CUDA launcher: backward graphs hold its standard-op form (passes/decompose.py)",
    ("", "MaxRoiPool"): "no CUDA launcher yet",
    ("", "RoiAlign"): "no CUDA launcher: backward graphs hold its standard-op form (passes/decompose.py)",
    ("", "STFT"): "no CUDA launcher: backward graphs hold its standard-op form (passes/decompose.py)",
    ("", "LRN"): "no CUDA launcher yet",
    ("", "LpPool"): "no CUDA launcher yet",
    ("", "MaxUnpool"): "no CUDA launcher yet",
    ("", "RotaryEmbedding"): "no CUDA launcher yet",
    ("", "TensorScatter"): "no CUDA launcher yet (opset 24)",
    # build_backward unrolls the recurrent ops into standard ops (passes/recurrent.py), which have
    # launchers; only a forward model run as it is holds them
    ("", "GRU"): "no CUDA launcher: backward graphs hold their unrolled form",
    ("", "LSTM"): "no CUDA launcher: backward graphs hold their unrolled form",
    ("", "RNN"): "no CUDA launcher: backward graphs hold their unrolled form",
    # control flow: a body runs as a CPU Session of its own; build_backward unrolls the loops it
    # differentiates (passes/control_flow.py), so backward graphs hold their bodies' ops
    ("", "If"): "no CUDA launcher: its branch runs as a CPU Session",
    ("", "Loop"): "no CUDA launcher: its body runs as a CPU Session; backward graphs hold the unrolled form",
    ("", "Scan"): "no CUDA launcher: its body runs as a CPU Session; backward graphs hold the unrolled form",
    # ONNX Runtime's forward ops of models optimized for its inference: build_backward rewrites them
    # into standard ops (passes/decompose.py); only a forward model run as it is holds them
    **{
        op: "no CUDA launcher: backward graphs hold its standard-op form (passes/decompose.py)"
        for op in LOWERED_FORWARD_OPS - FUSED_FORWARD_OPS
    },
    # ONNX Runtime training's gradient ops, which gradgen runs (ORT training artifacts) and differentiates
    ("com.microsoft", "SimplifiedLayerNormalizationGrad"): "no CUDA launcher yet",
    ("", "MaxPoolGrad"): "no CUDA launcher yet (ORT training graphs; gradgen differentiates MaxPool with a scatter)",
    ("", "AveragePoolGrad"): "no CUDA launcher yet (ORT training graphs; gradgen differentiates AveragePool with ConvGrad)",
}

__all__ = [
    "CPU_FAMILIES",
    "CUDA_FALLBACKS",
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
