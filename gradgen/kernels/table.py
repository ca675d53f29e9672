"""The declarations kernels are made of: ``KernelEntry`` and the decorators that record them.

Kernel modules (gradgen/kernels/cpu/<family>.py, gradgen/kernels/cuda/<family>.py) import this
module only; the registry (gradgen/kernels/registry.py) imports the family modules it lists and
reads the table. Nothing here imports a kernel module, so no import runs in a circle.

A CPU kernel is a plain numpy function in the style of the ONNX reference evaluator: the node's
inputs are positional arguments (None for an omitted optional input) and its attributes are
keyword arguments, with the ONNX defaults written as Python defaults. It returns one array, or a
tuple of arrays for several outputs. Kernels raise ``KernelError`` for bad data (e.g. an index out
of range); the executor adds the node's name and op type to the message.

A kernel that needs to know how many outputs the node has (Split, optional outputs) declares a
keyword-only parameter ``_num_outputs``; one that can skip outputs the node leaves unnamed
declares ``_wanted`` (a tuple of bools, one per output); one that needs the opset of its domain
declares ``_opset``. The registry passes them only to kernels that declare them.

A CPU kernel may also have a *preparer* (``cpu_prepare``): called once when a Session plans the
node, with the node's attributes and the values of the inputs that are constant at plan time
(initializers, folded Constant nodes), it returns a callable that takes the kernel's positional
arguments and gives the kernel's result, with the attribute parsing, axis normalisation and
shape arithmetic done once (per input shape, where that is what they depend on), or None where
it has nothing better than the kernel. A prepared call gives the kernel's result bit for bit; for
inputs it was not prepared for it calls the kernel, so errors read the same.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

from gradgen.ops.schemas import MICROSOFT_DOMAIN as MICROSOFT
from gradgen.ops.schemas import normalize_domain

ONNX_DOMAIN = ""

Kernel = Callable[..., object]

__all__ = [
    "KERNELS",
    "MICROSOFT",
    "ONNX_DOMAIN",
    "RUNTIME",
    "Kernel",
    "KernelEntry",
    "cpu_into",
    "cpu_kernel",
    "cpu_prepare",
    "cuda_kernel",
    "normalize_domain",
    "prepared_cpu_call",
]


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
    # The CUDA launcher takes its inputs where the executor holds them (device or host arrays) and
    # places them itself: the control-flow ops, whose bodies read host shape values as they are.
    cuda_inputs_as_placed: bool = False
    # (constants, attributes) -> a callable of the kernel's positional arguments, or None; see the module docstring
    cpu_prepare: Callable[[tuple, dict], Kernel | None] | None = None
    # (position, *args) -> the kernel's result written into args[position], or None; see ``cpu_into``
    cpu_into: Callable[..., object] | None = None
    cpu_into_attributes: bool = False  # cpu_into takes the node's attributes as keywords

    @property
    def cpu_family(self) -> str | None:
        """The family module that holds the CPU kernel (gradgen/kernels/cpu/<family>.py)."""
        return None if self.cpu is None else self.cpu.__module__.rsplit(".", 1)[-1]


KERNELS: dict[tuple[str, str], KernelEntry] = {}


def _entry(domain: str, op_type: str) -> KernelEntry:
    key = (normalize_domain(domain), op_type)
    if key not in KERNELS:
        KERNELS[key] = KernelEntry(key[0], op_type)
    return KERNELS[key]


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


def cpu_prepare(*op_types: str, domain: str = ONNX_DOMAIN):
    """Register the preparer of the CPU kernel of one or more op types (see the module docstring):
    ``fn(constants, attributes)`` where ``constants`` holds, per node input, its plan-time value,
    ``RUNTIME`` for an input computed at run time, None for an absent one."""

    def register(fn):
        for op_type in op_types:
            entry = _entry(domain, op_type)
            if entry.cpu_prepare is not None:
                raise RuntimeError(f"duplicate CPU preparer for {domain}::{op_type}")
            entry.cpu_prepare = fn
        return fn

    return register


def cpu_into(*op_types: str, domain: str = ONNX_DOMAIN):
    """Register the in-place form of the CPU kernel of one or more op types: ``fn(position, *args)``
    writes the kernel's result, bit for bit, into ``args[position]`` (an input that dies at this
    step and that nothing else holds: the executor checks) and returns it, or returns None, having
    written nothing, where it cannot (another shape or dtype); the executor then calls the kernel.
    A form with keyword-only parameters gets the node's attributes, as the kernel does."""

    def register(fn):
        for op_type in op_types:
            entry = _entry(domain, op_type)
            if entry.cpu_into is not None:
                raise RuntimeError(f"duplicate in-place CPU kernel for {domain}::{op_type}")
            entry.cpu_into = fn
            entry.cpu_into_attributes = any(p.kind is p.KEYWORD_ONLY for p in inspect.signature(fn).parameters.values())
        return fn

    return register


class _Runtime:
    """The placeholder ``cpu_prepare`` preparers see for an input computed at run time."""

    def __repr__(self) -> str:
        return "RUNTIME"


RUNTIME = _Runtime()


def prepared_cpu_call(entry: KernelEntry, attributes: dict, constants: tuple) -> Kernel | None:
    """The callable a CPU step runs: its preparer's, or the kernel with the attributes bound. A
    preparer that fails leaves the kernel in place (it raises, with the node's context, at run time)."""
    if entry.cpu_prepare is not None:
        try:
            call = entry.cpu_prepare(constants, attributes)
        except Exception:  # noqa: BLE001 -- the kernel reports the problem when the step runs
            call = None
        if call is not None:
            return call
    kernel = entry.cpu
    if kernel is None or not attributes:
        return kernel  # None for a CUDA-only op, which a CPU step never runs
    return functools.partial(kernel, **attributes)


def cuda_kernel(*op_types: str, domain: str = ONNX_DOMAIN, host_inputs=(), inputs_as_placed: bool = False):
    """Register a CUDA launcher: the CPU kernel's calling convention, GPUArrays in and out.

    Inputs at the positions in ``host_inputs`` arrive as numpy arrays (small shape-like tensors:
    shapes, axes, starts, ...); the others as ``pycuda.gpuarray.GPUArray``. The launcher may
    return a numpy array for a shape-like output (Shape, for instance). ``inputs_as_placed``: every
    input arrives as the executor holds it, a GPUArray or a host numpy array.
    """

    def register(fn: Kernel) -> Kernel:
        for op_type in op_types:
            entry = _entry(domain, op_type)
            if entry.cuda is not None:
                raise RuntimeError(f"duplicate CUDA kernel for {domain}::{op_type}")
            entry.cuda = fn
            entry.cuda_host_inputs = frozenset(host_inputs)
            entry.cuda_inputs_as_placed = inputs_as_placed
        return fn

    return register
