"""The kernel registry: one implementation per (domain, op_type) and device.

A CPU kernel is a plain numpy function in the style of the ONNX reference evaluator: the node's
inputs are positional arguments (None for an omitted optional input) and its attributes are
keyword arguments, with the ONNX defaults written as Python defaults. It returns one array, or a
tuple of arrays for several outputs. Kernels raise ``KernelError`` for bad data (e.g. an index out
of range); the executor adds the node's name and op type to the message.

A kernel that needs to know how many outputs the node wants (Split, optional outputs) declares a
keyword-only parameter ``_num_outputs``; one that needs the opset of its domain declares
``_opset``. The registry passes them only to kernels that declare them.
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
        return fn

    return register


def cuda_kernel(*op_types: str, domain: str = ONNX_DOMAIN):
    """Register a CUDA launcher (same calling convention, device arrays in and out)."""

    def register(fn: Kernel) -> Kernel:
        for op_type in op_types:
            _entry(domain, op_type).cuda = fn
        return fn

    return register


def lookup(domain: str, op_type: str) -> KernelEntry | None:
    _ensure_loaded()
    return _KERNELS.get((normalize_domain(domain), op_type))


def all_kernels() -> dict[tuple[str, str], KernelEntry]:
    _ensure_loaded()
    return dict(_KERNELS)


_LOADED = False


def _ensure_loaded() -> None:
    """Import the kernel modules once; their decorators fill the registry."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    from gradgen.kernels import cpu  # noqa: F401
