"""The CUDA backend of Session: data stays on the GPU from node to node.

Placement rules:
- float initializers are uploaded once; integer and bool ones stay on the host (they are mostly
  shapes, axes and indices) and are uploaded, once, the first time a CUDA kernel wants them;
- a step whose inputs are all host integer/bool arrays is shape arithmetic: it runs on the host
  with its numpy kernel, silently;
- a step with a CUDA launcher gets device arrays, except at the launcher's ``host_inputs``
  positions, which get numpy arrays;
- a step without a CUDA launcher falls back to its numpy kernel (a one-time warning per op type):
  its inputs are downloaded and its outputs stay on the host until a CUDA step needs them.
Final outputs are downloaded.
"""

from __future__ import annotations

import warnings

import numpy as np

from gradgen.cuda import runtime as rt
from gradgen.kernels import registry

_WARNED: set[tuple[str, str]] = set()


class CudaBackend:
    name = "cuda"

    def __init__(self):
        registry.load_cuda_kernels()
        self._uploaded: dict[int, rt.GPUArray] = {}  # device copies of host constants, by id
        self._host_constants: dict[int, np.ndarray] = {}

    def place_constants(self, initializers: dict[str, np.ndarray]) -> dict:
        placed = {name: rt.to_device(a) if a.dtype.kind == "f" else a for name, a in initializers.items()}
        self._host_constants = {id(a): a for a in placed.values() if isinstance(a, np.ndarray)}
        return placed

    def place_feeds(self, feeds: dict[str, np.ndarray]) -> dict:
        return {name: rt.to_device(a) if a.dtype.kind == "f" else a for name, a in feeds.items()}

    def run_step(self, step, args: list):
        entry = step.entry
        if entry.cuda is not None and not _is_shape_arithmetic(args):
            call_args = [
                None if a is None else (rt.to_host(a) if i in entry.cuda_host_inputs else self._on_device(a))
                for i, a in enumerate(args)
            ]
            return entry.cuda(*call_args, **step.attributes)
        if entry.cpu is None:
            raise RuntimeError(f"{step.op_type} has no CPU kernel to fall back on")
        if entry.cuda is None and not _is_shape_arithmetic(args):
            _warn_fallback(step)
        return entry.cpu(*[None if a is None else rt.to_host(a) for a in args], **step.attributes)

    def _on_device(self, value):
        if rt.is_device(value):
            return value
        key = id(value)
        if self._host_constants.get(key) is not value:
            return rt.to_device(value)
        if key not in self._uploaded:
            self._uploaded[key] = rt.to_device(value)
        return self._uploaded[key]

    def wrap(self, value):
        return value if rt.is_device(value) else np.asarray(value)

    def to_host(self, value) -> np.ndarray:
        return rt.to_host(value)


def _is_shape_arithmetic(args: list) -> bool:
    present = [a for a in args if a is not None]
    return all(isinstance(a, np.ndarray) and a.dtype.kind in "iub" for a in present)


def _warn_fallback(step) -> None:
    key = (step.domain, step.op_type)
    if key not in _WARNED:
        _WARNED.add(key)
        op = f"{step.domain}::{step.op_type}" if step.domain else step.op_type
        warnings.warn(f"no CUDA kernel for {op} (first at node {step.node_name!r}); running it on the CPU", stacklevel=4)
