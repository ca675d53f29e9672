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

CUDA graphs: the first run with given input shapes runs eagerly (it compiles kernels, builds cuDNN
plans and uploads constants); the second records the run into a CUDA graph; later runs with the
same shapes copy the inputs into the recorded input buffers and replay the graph, which removes
the per-node launch cost of Python. A run that cannot be recorded (a CPU fallback, a device-to-host
copy in a launcher, ...) keeps those shapes on the eager path, with a one-time note.
GRADGEN_CUDA_GRAPHS=0 turns recording off. Recorded runs keep every intermediate buffer alive.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from gradgen.cuda import runtime as rt
from gradgen.kernels import registry

_WARNED: set[tuple[str, str]] = set()


class CudaBackend:
    name = "cuda"

    def __init__(self):
        registry.load_cuda_kernels()
        self.use_graphs = os.environ.get("GRADGEN_CUDA_GRAPHS", "1") != "0"
        self._graphs: dict[tuple, object] = {}  # input signature -> _Replay, or "eager"
        self._small_uploads: dict[tuple, rt.GPUArray] = {}
        self._uploaded: dict[int, rt.GPUArray] = {}  # device copies of host constants, by id
        self._host_constants: dict[int, np.ndarray] = {}

    def place_constants(self, initializers: dict[str, np.ndarray]) -> dict:
        placed = {name: rt.to_device(a) if a.dtype.kind == "f" else a for name, a in initializers.items()}
        self._host_constants = {id(a): a for a in placed.values() if isinstance(a, np.ndarray)}
        return placed

    def place_feeds(self, feeds: dict[str, np.ndarray]) -> dict:
        if self.use_graphs:  # a graph can only replay inputs that live in device buffers
            return {name: rt.to_device(a) for name, a in feeds.items()}
        return {name: rt.to_device(a) if a.dtype.kind == "f" else a for name, a in feeds.items()}

    def execute(self, run_steps, feeds: dict[str, np.ndarray]) -> dict:
        """Run eagerly, or record a CUDA graph on the second run of a shape and replay it after."""
        key = tuple((name, a.shape, a.dtype.str) for name, a in sorted(feeds.items()))
        state = self._graphs.get(key) if self.use_graphs else "eager"
        if isinstance(state, _Replay):
            return state.run(feeds)
        if state is None:  # first run of these shapes: warm up eagerly
            self._graphs[key] = "warm"
        elif state == "warm":
            replay = self._record(run_steps, feeds, key)
            if replay is not None:
                return replay.run(feeds)
        return run_steps(self.place_feeds(feeds))

    def _record(self, run_steps, feeds, key):
        placed = self.place_feeds(feeds)
        recorded = {}
        try:
            graph = rt.capture(lambda: recorded.update(run_steps(dict(placed))))
        except rt.CaptureError as exc:
            self._graphs[key] = "eager"
            _note_once(("capture",), f"running without CUDA graphs for these input shapes: {exc}")
            return None
        replay = _Replay(graph, placed, recorded)
        self._graphs[key] = replay
        return replay

    def run_step(self, step, args: list):
        entry = step.entry
        if entry.cuda is not None and not _is_shape_arithmetic(step, args):
            call_args = [
                None if a is None else (rt.to_host(a) if i in entry.cuda_host_inputs else self._on_device(a))
                for i, a in enumerate(args)
            ]
            return entry.cuda(*call_args, **step.attributes)
        if entry.cpu is None:
            raise RuntimeError(f"{step.op_type} has no CPU kernel to fall back on")
        if entry.cuda is None and not _is_shape_arithmetic(step, args):
            _warn_fallback(step)
        return entry.cpu(*[None if a is None else rt.to_host(a) for a in args], **step.attributes)

    def _on_device(self, value):
        if rt.is_device(value):
            return value
        key = id(value)
        if self._host_constants.get(key) is value:
            if key not in self._uploaded:
                self._uploaded[key] = rt.to_device(value)
            return self._uploaded[key]
        if value.size <= 4096:  # small host results (shape arithmetic): one upload per distinct value
            by_value = (value.dtype.str, value.shape, value.tobytes())
            if by_value not in self._small_uploads:
                if len(self._small_uploads) > 4096:
                    self._small_uploads.clear()
                self._small_uploads[by_value] = rt.to_device(value)
            return self._small_uploads[by_value]
        return rt.to_device(value)

    def wrap(self, value):
        return value if rt.is_device(value) else np.asarray(value)

    def to_host(self, value) -> np.ndarray:
        return rt.to_host(value)


class _Replay:
    """A recorded run: its input buffers, its surviving values (outputs), and the CUDA graph."""

    def __init__(self, graph, inputs: dict, values: dict):
        self.graph = graph
        self.inputs = inputs
        self.values = values

    def run(self, feeds: dict[str, np.ndarray]) -> dict:
        for name, array in feeds.items():
            target = self.inputs[name]
            if target.nbytes:
                rt.driver.memcpy_htod_async(target.gpudata, np.ascontiguousarray(array), rt.stream())
        self.graph.replay()
        return self.values


def _note_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def _is_shape_arithmetic(step, args: list) -> bool:
    """Integer/bool host inputs only, and no float data made from them (ConstantOfShape's zeros
    are data: they belong on the device)."""
    present = [a for a in args if a is not None]
    if not all(isinstance(a, np.ndarray) and a.dtype.kind in "iub" for a in present):
        return False
    if step.op_type == "ConstantOfShape":
        value = step.attributes.get("value")
        return value is not None and np.asarray(value).dtype.kind in "iub"
    return True


def _warn_fallback(step) -> None:
    key = (step.domain, step.op_type)
    if key not in _WARNED:
        _WARNED.add(key)
        op = f"{step.domain}::{step.op_type}" if step.domain else step.op_type
        warnings.warn(f"no CUDA kernel for {op} (first at node {step.node_name!r}); running it on the CPU", stacklevel=4)
