"""The kernel registry: one implementation per (domain, op_type) and device.

A CPU kernel is a plain numpy function in the style of the ONNX reference evaluator: the node's
inputs are positional arguments (None for an omitted optional input) and its attributes are
keyword arguments, with the ONNX defaults written as Python defaults. It returns one array, or a
tuple of arrays for several outputs. Kernels raise ``KernelError`` for bad data (e.g. an index out
of range); the executor adds the node's name and op type to the message.

A kernel that needs to know how many outputs the node has (Split, optional outputs) declares a
keyword-only parameter ``_num_outputs``; one that can skip outputs the node leaves unnamed
declares ``_wanted`` (a tuple of bools, one per output); one that needs the opset of its domain
declares ``_opset``. The registry passes them only to kernels that declare them.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

MICROSOFT = "com.microsoft"
ONNX_DOMAIN = ""

Kernel = Callable[..., object]


def normalize_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


@dataclasses.dataclass
class KernelEntry:
    domain: str
    op_type: str
    cpu: Kernel | None = None
    cuda: Kernel | None = None
    wants_num_outputs: bool = False
    wants_opset: bool = False
    wants_wanted: bool = False
    # Input positions the CUDA launcher wants as host numpy arrays (shapes, axes, starts, ...).
    cuda_host_inputs: frozenset[int] = frozenset()


_KERNELS: dict[tuple[str, str], KernelEntry] = {}


def _entry(domain: str, op_type: str) -> KernelEntry:
    key = (normalize_domain(domain), op_type)
    if key not in _KERNELS:
        _KERNELS[key] = KernelEntry(key[0], op_type)
    return _KERNELS[key]


def cpu_kernel(*op_types: str, domain: str = ONNX_DOMAIN):
    """Register a numpy function as the CPU kernel of one or more op types."""

    def register(fn: Kernel) -> Kernel:
        params = inspect.signature(fn).parameters
        for op_type in op_types:
            entry = _entry(domain, op_type)
            if entry.cpu is not None:
                raise RuntimeError(f"duplicate CPU kernel for {domain}::{op_type}")
            entry.cpu = fn
            entry.wants_num_outputs = "_num_outputs" in params
            entry.wants_opset = "_opset" in params
            entry.wants_wanted = "_wanted" in params
        return fn

    return register


def cuda_kernel(*op_types: str, domain: str = ONNX_DOMAIN, host_inputs=()):
    """Register a CUDA launcher: the CPU kernel's calling convention, GPUArrays in and out.

    Inputs at the positions in ``host_inputs`` arrive as numpy arrays (small shape-like tensors:
    shapes, axes, starts, ...); the others as ``pycuda.gpuarray.GPUArray``. The launcher may
    return a numpy array for a shape-like output (Shape, for instance).
    """

    def register(fn: Kernel) -> Kernel:
        for op_type in op_types:
            entry = _entry(domain, op_type)
            if entry.cuda is not None:
                raise RuntimeError(f"duplicate CUDA kernel for {domain}::{op_type}")
            entry.cuda = fn
            entry.cuda_host_inputs = frozenset(host_inputs)
        return fn

    return register


def lookup(domain: str, op_type: str) -> KernelEntry | None:
    _ensure_loaded()
    if _CUDA_REQUESTED:
        _ensure_cuda_loaded()
    return _KERNELS.get((normalize_domain(domain), op_type))


def all_kernels() -> dict[tuple[str, str], KernelEntry]:
    """Every registered kernel, CUDA launchers included (listing them needs no GPU)."""
    _ensure_loaded()
    load_cuda_kernels()
    return dict(_KERNELS)


_LOADED = False
_LOAD_ERRORS: list = []  # an import error of the modules that fill the registry
_CUDA_REQUESTED = False
_CUDA_LOADED = False


def _ensure_loaded() -> None:
    """Import the CPU kernel modules once; their decorators fill the registry."""
    global _LOADED
    if _LOAD_ERRORS:
        raise RuntimeError(f"gradgen's registry failed to load: {_LOAD_ERRORS[0]}") from _LOAD_ERRORS[0]
    if _LOADED:
        return
    _LOADED = True
    try:
        from gradgen.kernels import cpu  # noqa: F401
    except Exception as exc:  # later calls must not report every op as unsupported
        _LOAD_ERRORS.append(exc)
        raise


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
    try:
        from gradgen.kernels import cuda  # noqa: F401
    except Exception as exc:  # later calls must not report every op as unsupported
        _LOAD_ERRORS.append(exc)
        raise
