"""The CUDA backend of Session: data stays on the GPU from node to node.

Placement rules:
- float initializers are uploaded once; integer and bool ones stay on the host (they are mostly
  shapes, axes and indices) and are uploaded, once, the first time a CUDA kernel wants them;
- a step whose inputs are all host integer/bool arrays is shape arithmetic: it runs on the host
  with its numpy kernel, silently (a step with no inputs at all runs its launcher);
- a step with a CUDA launcher gets device arrays, except at the launcher's ``host_inputs``
  positions, which get numpy arrays (a control-flow launcher takes its inputs as they are held,
  and runs its body on the GPU inside the step: gradgen/kernels/cuda/control.py);
- a step without a CUDA launcher falls back to its numpy kernel (a one-time warning per op type):
  its inputs are downloaded and its outputs stay on the host until a CUDA step needs them.
Final outputs are downloaded.

Memory (gradgen/executor/device_memory.py): the first run with given input shapes runs eagerly and
is traced (it also compiles kernels, builds cuDNN plans and uploads constants); its allocations'
sizes and lifetimes give that signature's static plan, and every later run of it is served from
one arena shared by all Sessions of the process, sized for the largest plan.

CUDA graphs: the second run of a signature records the run (served from its plan) into a CUDA
graph; later runs with the same shapes copy the inputs into the recorded input buffers and replay
the graph, which removes the per-node launch cost of Python and allocates nothing. Once a Session
has run more than one signature (a variable-length loop), it records each new signature right
after its traced first run, and the earlier signatures not recorded yet (with zero inputs: a
capture does not read them), so the second time round every length replays instead of spending
its second run on recording. A run that
cannot be recorded (a CPU fallback, a device-to-host copy in a launcher, ...) keeps those shapes on
the eager path, with a one-time note. At most GRADGEN_CUDA_GRAPH_CACHE recorded graphs (default
8) are kept; the least recently used is dropped and records again when its shapes come back.
GRADGEN_CUDA_GRAPHS=0 turns recording off.
"""

from __future__ import annotations

import collections
import os
import warnings

import numpy as np

from gradgen.cuda import runtime as rt
from gradgen.errors import UsageError
from gradgen.executor import fusion, low_precision
from gradgen.executor.device_memory import MemoryManager, release_frames
from gradgen.kernels import registry
from gradgen.kernels.cuda.launch import math_mode

_WARNED: set[tuple[str, str]] = set()
_EAGER = "eager"  # a signature whose run could not be recorded

# Ops whose CUDA launcher computes output element i from element i of each same-shape input (the
# elementwise kernels of kernels/cuda/elementwise.cu; ScatterElements' line scatter reads each line
# of ``data`` before it writes that line of the output), so the memory plan may put a float output
# over an input that dies at that step. Value: the input positions that may be overwritten.
_ANY = None
IN_PLACE_OPS = {
    **{
        op: _ANY
        for op in (
            "Add",
            "Sub",
            "Mul",
            "Div",
            "Sum",
            "Neg",
            "Abs",
            "Relu",
            "Sqrt",
            "Reciprocal",
            "Exp",
            "Log",
            "Tanh",
            "Sigmoid",
            "Softplus",
            "Erf",
        )
    },
    "Where": (1, 2),
    "ScatterElements": (0,),
}


class CudaDevice:
    """The device memory the planned-memory manager draws on: PyCUDA's pool and plain allocations."""

    @staticmethod
    def reserve(nbytes: int):
        return rt.driver.mem_alloc(nbytes)

    @staticmethod
    def pool_allocate(nbytes: int):
        return rt.pool_allocate(nbytes)

    @staticmethod
    def release_held() -> None:
        rt.memory_pool().free_held()

    @staticmethod
    def pool_bytes() -> int:
        return int(getattr(rt.memory_pool(), "managed_bytes", 0))


class CudaBackend:
    name = "cuda"

    def __init__(self, tf32: bool = False):
        registry.load_cuda_kernels()
        self.tf32 = tf32  # float32 GEMMs and convolutions may use TF32 (launch.math_mode around every run)
        self.use_graphs = os.environ.get("GRADGEN_CUDA_GRAPHS", "1") != "0"
        self.max_graphs = _positive_int("GRADGEN_CUDA_GRAPH_CACHE", 8)
        self.num_steps = 0  # set by the Session once it has planned its steps
        self._graphs: collections.OrderedDict = collections.OrderedDict()  # signature -> _Replay or _EAGER
        self._small_uploads: dict[tuple, rt.GPUArray] = {}
        self._uploaded: dict[int, rt.GPUArray] = {}  # device copies of host constants, by id
        self._host_constants: dict[int, np.ndarray] = {}
        self._commits = _CommitCopies(self.use_graphs)
        self._memory = None  # the RunMemory of the run in progress (eager or being recorded)
        self._run = None  # (RunMemory, signature, run_steps) of the eager run to finish
        self._many_shapes = False  # more than one signature seen: record ahead (see the module docstring)
        self.closed = False
        with rt.gpu_lock():
            self.memory = MemoryManager(CudaDevice())
        self.memory.on_arena_retired(self._drop_graphs)

    def lock(self):
        return rt.gpu_lock()

    def fuse(self, steps: list, graph, keep: set[str], state: dict | None = None, guard: list | None = None) -> list:
        """The plan with a guarded training step's optimizer updates as one in-place multi-tensor
        step and its global gradient norm as one reduction (gradgen/executor/fused_optimizer.py;
        GRADGEN_CUDA_FUSED_OPTIMIZER=0 turns them off), and
        its chains of elementwise steps fused (gradgen/executor/fusion.py), each LayerNorm gradient
        whose dX only a residual Sum reads written as that Sum (gradgen/executor/fused_norm_grad.py)
        and a vocabulary-wide cross-entropy kept as row statistics instead of log-probabilities
        (gradgen/executor/fused_loss.py), and attention's head Split / Concat copies folded into
        their Transposes (gradgen/executor/fused_copies.py), unless GRADGEN_CUDA_FUSION=0."""
        from gradgen.executor import fused_copies, fused_loss, fused_norm_grad, fused_optimizer, fusion

        if state and guard and fused_optimizer.enabled():
            steps = fused_optimizer.fuse_update(steps, graph, keep, state, guard)
        if fused_optimizer.norm_enabled():
            steps = fused_optimizer.fuse_norm(steps, graph, keep)
        if not fusion.enabled():
            return steps
        steps = fused_loss.fuse_loss_stats(steps, keep, fusion.static_shapes(steps, graph))
        steps = fused_copies.fuse_head_copies(steps, keep)
        return fusion.fuse_pointwise(fused_norm_grad.fuse_residual_sum(steps, keep), graph, keep)

    def place_constants(self, initializers: dict[str, np.ndarray]) -> dict:
        with rt.gpu_lock():
            placed = {name: rt.to_device(a) if _is_float(a) else a for name, a in initializers.items()}
        self._host_constants = {id(a): a for a in placed.values() if isinstance(a, np.ndarray)}
        return placed

    def place_feeds(self, feeds: dict[str, np.ndarray]) -> dict:
        """Upload host feeds; device arrays (bound state) are used where they are."""
        if self.use_graphs:  # a graph can only replay inputs that live in device buffers
            return {name: a if rt.is_device(a) else rt.to_device(a) for name, a in feeds.items()}
        return {name: rt.to_device(a) if not rt.is_device(a) and _is_float(a) else a for name, a in feeds.items()}

    def place_state(self, state: dict, values: dict[str, np.ndarray]) -> dict:
        """Bound state on the device, outside any run's arena: uploaded into the buffers ``state``
        already has where shape and type agree (recorded graphs read those addresses)."""
        placed = {}
        for name, value in values.items():
            current = state.get(name)
            if rt.is_device(current) and current.shape == value.shape and current.dtype == value.dtype:
                if current.nbytes:
                    rt.driver.memcpy_htod(current.gpudata, rt.host_buffer(value))
                placed[name] = current
            else:
                with rt.persistent():
                    placed[name] = rt.to_device(value)
        return placed

    def commit_state(self, state: dict, new: dict) -> dict:
        """Copy each bound output into its input's buffer on the stream (no host copy, no sync);
        an output already in that buffer (an in-place update) needs nothing."""
        copies = []
        for name, dst in state.items():
            src = new[name]
            if not rt.is_device(src):
                if dst.nbytes:
                    rt.driver.memcpy_htod(dst.gpudata, rt.host_buffer(src))
            elif int(src.gpudata) != int(dst.gpudata) and dst.nbytes:
                copies.append((int(dst.gpudata), int(src.gpudata), dst.nbytes))
        if copies:
            self._commits.run(tuple(copies))
        return state

    def execute(self, run_steps, feeds: dict[str, np.ndarray]) -> dict:
        """Replay the signature's graph; or record one (its second run); or run eagerly, traced on
        the signature's first run and served from its plan after. Call ``finish_run`` once the
        returned values are no longer needed."""
        if self.closed:
            raise UsageError("this Session is closed")
        key = tuple((name, a.shape, np.dtype(a.dtype)) for name, a in sorted(feeds.items()))  # bfloat16.str is "<V2"
        state = self._graphs.get(key)
        if isinstance(state, _Replay):
            self._graphs.move_to_end(key)
            return state.run(feeds)
        if self.use_graphs and state is None and self.memory.plan_for(key) is not None:
            replay = self._record(run_steps, feeds, key)
            if replay is not None:
                return replay.run(feeds)
        memory = self.memory.begin(key, self.num_steps)
        if memory.tracing and self.memory.plans:
            self._many_shapes = True
        self._memory = memory
        try:
            with rt.allocation_hook(memory.allocate), math_mode(self.tf32):
                values = run_steps(self.place_feeds(feeds))
                memory.end_of_steps()
        except BaseException as exc:
            release_frames(exc)  # the failed run's arrays go now, not with the exception
            self.memory.abandon(memory)
            raise
        finally:
            self._memory = None
        self._run = (memory, key, run_steps)
        return values

    def finish_run(self, failed: bool = False) -> None:
        """The run's values are gone: check its blocks, and make the plan of a traced run."""
        run, self._run = self._run, None
        if run is not None:
            memory, key, run_steps = run
            if failed:
                self.memory.abandon(memory)
            else:
                self.memory.end(memory, key)
                if memory.tracing and self._many_shapes and self.use_graphs:
                    self._record_ahead(run_steps)

    def _record_ahead(self, run_steps) -> None:
        """Record every planned signature that has no graph yet (the newest last, so the LRU cache
        keeps it), with zero feeds of its shapes."""
        waiting = [key for key in self.memory.plans if key not in self._graphs][-self.max_graphs :]
        for key in waiting:
            feeds = {name: np.zeros(shape, np.dtype(dtype)) for name, shape, dtype in key}
            try:
                self._record(run_steps, feeds, key)
            except Exception as exc:  # noqa: BLE001 - the run itself succeeded: its next call runs eagerly
                self._graphs[key] = _EAGER
                _note_once(
                    ("record-ahead",),
                    f"could not record a CUDA graph ahead for these input shapes "
                    f"({type(exc).__name__}: {exc}); running them without one",
                )

    def _record(self, run_steps, feeds, key, attempt: int = 0):
        memory = self.memory.begin(key, self.num_steps)
        recorded = {}

        def steps():
            recorded.update(run_steps(dict(placed)))
            memory.end_of_steps()

        self._memory = memory
        try:
            with rt.allocation_hook(memory.allocate), math_mode(self.tf32):
                placed = self.place_feeds(feeds)
                graph = rt.capture(steps)
        except rt.CaptureError as exc:
            recorded.clear()
            placed = None
            release_frames(exc)
            self.memory.abandon(memory)
            self._graphs[key] = _EAGER
            _note_once(("capture",), f"running without CUDA graphs for these input shapes: {exc}")
            return None
        except BaseException as exc:
            release_frames(exc)
            self.memory.abandon(memory)
            raise
        finally:
            self._memory = None
        self.memory.end(memory, key, graph_owned=True)
        if attempt == 0 and self.memory.learn_from(memory, key):  # the plan changed: record on the new one
            graph.close()
            recorded.clear()
            placed = None
            CudaDevice.release_held()  # the pool blocks that graph fell back on
            return self._record(run_steps, feeds, key, attempt + 1)
        graph.keep.append(memory.arena)  # replays write to the arena: it lives as long as the graph
        replay = _Replay(graph, placed, recorded)
        self._graphs[key] = replay
        self._evict_graphs()
        return replay

    def _evict_graphs(self) -> None:
        replays = [k for k, state in self._graphs.items() if isinstance(state, _Replay)]
        for key in replays[: max(0, len(replays) - self.max_graphs)]:
            self._graphs.pop(key).close()

    def _drop_graphs(self) -> None:
        """The arena was replaced: graphs recorded on it record again on their next call."""
        for key in [k for k, state in self._graphs.items() if isinstance(state, _Replay)]:
            self._graphs.pop(key).close()

    def run_step(self, step, args: list):
        if self._memory is not None:
            self._memory.advance(step.index)
        entry = step.entry
        if entry.cuda is not None and not _is_shape_arithmetic(step, args):
            if entry.cuda_inputs_as_placed:
                call_args = list(args)
            else:
                call_args = [
                    None if a is None else (rt.to_host(a) if i in entry.cuda_host_inputs else self._on_device(a))
                    for i, a in enumerate(args)
                ]
            result = entry.cuda(*call_args, **step.attributes)
            if self._memory is not None and self._memory.tracing:
                if not step.domain and step.op_type in IN_PLACE_OPS:
                    _note_in_place(self._memory, step.op_type, call_args, result)
                elif step.domain == fusion.DOMAIN and step.op_type == fusion.OP_TYPE:
                    fusion.note_in_place(self._memory, entry.cuda, call_args, result)
            return result
        if entry.cpu is None:
            raise RuntimeError(f"{step.op_type} has no CPU kernel to fall back on")
        if entry.cuda is None and not _is_shape_arithmetic(step, args):
            _warn_fallback(step)
        host = [None if a is None else rt.to_host(a) for a in args]
        if step.low_precision or low_precision.reads_low_precision(host):  # as the CPU backend runs it
            return low_precision.run_in_fp32(entry.cpu, step.op_type, host, step.attributes, step.output_dtypes)
        return entry.cpu(*host, **step.attributes)

    def _on_device(self, value):
        if rt.is_device(value):
            return value
        key = id(value)
        if self._host_constants.get(key) is value:
            if key not in self._uploaded:
                with rt.persistent():
                    self._uploaded[key] = rt.to_device(value)
            return self._uploaded[key]
        if value.size <= 4096:  # small host results (shape arithmetic): one upload per distinct value
            by_value = (value.dtype.str, value.shape, value.tobytes())
            if by_value not in self._small_uploads:
                if len(self._small_uploads) > 4096:
                    self._small_uploads.clear()
                with rt.persistent():
                    self._small_uploads[by_value] = rt.to_device(value)
            return self._small_uploads[by_value]
        return rt.to_device(value)

    def wrap(self, value):
        return value if rt.is_device(value) else np.asarray(value)

    def to_host(self, value) -> np.ndarray:
        return rt.to_host(value)

    def memory_stats(self) -> dict:
        """Planned arena size (the largest plan), its lower bound, the shared arena's size, and the
        most device memory the pool and the arena held during a run (bytes); outputs planned over a
        dying input (``in_place``, the most in one plan)."""
        arena = self.memory.host.arena
        return {
            "planned_bytes": self.memory.planned_bytes,
            "peak_live_bytes": self.memory.peak_live_bytes,
            "arena_bytes": arena.nbytes if arena is not None else 0,
            "peak_held_bytes": self.memory.peak_held,
            "graphs": sum(isinstance(s, _Replay) for s in self._graphs.values()),
            "leaks": self.memory.leaks,
            "in_place": self.memory.in_place_outputs,
            "served": self.memory.served,
            "fallbacks": self.memory.fallbacks,
            "fallback_log": list(self.memory.fallback_log),
        }

    def close(self) -> None:
        """Drop the recorded graphs, the plans, the uploads and this Session's share of the arena."""
        if self.closed:
            return
        self.closed = True
        with rt.gpu_lock():
            self._drop_graphs()
            self._graphs.clear()
            self._small_uploads.clear()
            self._uploaded.clear()
            self._commits.close()
            self.memory.close()


class _Replay:
    """A recorded run: its input buffers, its surviving values (outputs), and the CUDA graph."""

    def __init__(self, graph, inputs: dict, values: dict):
        self.graph = graph
        self.inputs = inputs
        self.values = values

    def run(self, feeds: dict[str, np.ndarray]) -> dict:
        for name, array in feeds.items():
            target = self.inputs[name]
            if not target.nbytes:
                continue
            if not rt.is_device(array):
                rt.driver.memcpy_htod_async(target.gpudata, rt.host_buffer(array), rt.stream())
            elif int(array.gpudata) != int(target.gpudata):  # bound state whose buffer changed
                rt.copy_device(target, array)
        self.graph.replay()
        return self.values

    def close(self) -> None:
        self.graph.close()
        self.inputs, self.values = {}, {}


class _CommitCopies:
    """The device-to-device copies that commit bound state after a run. A set of copies seen
    twice (a replayed run's outputs sit at fixed addresses) is recorded as a CUDA graph: one
    launch instead of one per tensor. The few most recent sets are kept."""

    KEEP = 4

    def __init__(self, use_graphs: bool):
        self.use_graphs = use_graphs
        self.graphs: collections.OrderedDict = collections.OrderedDict()  # copies -> CapturedGraph or None (seen once)

    def run(self, copies: tuple) -> None:
        graph = self.graphs.get(copies)
        if graph is None and self.use_graphs and copies in self.graphs:
            try:
                graph = self.graphs[copies] = rt.capture(lambda: self._copy(copies))
            except rt.CaptureError:
                self.use_graphs = False
        if graph is not None:
            self.graphs.move_to_end(copies)
            graph.replay()
            return
        self.graphs[copies] = None
        while len(self.graphs) > self.KEEP:
            dropped = self.graphs.popitem(last=False)[1]
            if dropped is not None:
                dropped.close()
        self._copy(copies)

    @staticmethod
    def _copy(copies: tuple) -> None:
        stream = rt.stream()
        for dst, src, nbytes in copies:
            rt.driver.memcpy_dtod_async(dst, src, nbytes, stream)

    def close(self) -> None:
        for graph in self.graphs.values():
            if graph is not None:
                graph.close()
        self.graphs.clear()


def _note_in_place(memory, op_type: str, args: list, result) -> None:
    """Tell a traced run which of the step's float outputs may overwrite which inputs (whole,
    contiguous arrays of the output's element count and size: a broadcast input is read at many
    elements, so never one; the plan keeps the pairs whose input dies here)."""
    positions = IN_PLACE_OPS[op_type]
    for r in result if isinstance(result, tuple) else (result,):
        if not _whole_float(r):
            continue
        inputs = [
            (int(a.gpudata), a.nbytes)
            for i, a in enumerate(args)
            if (positions is None or i in positions) and _whole_float(a) and a.size == r.size and a.nbytes == r.nbytes
        ]
        if inputs:
            memory.note_in_place([(int(r.gpudata), r.nbytes)], inputs)


def _whole_float(array) -> bool:
    return rt.is_device(array) and _is_float(array) and array.size > 0 and array.flags.c_contiguous


def _is_float(array) -> bool:
    """A float array, bfloat16 (numpy kind 'V') included."""
    return low_precision.is_float_dtype(np.dtype(array.dtype))


def _positive_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"{name}={raw!r}: expected a positive integer")
    return value


def _note_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=4)


def _is_shape_arithmetic(step, args: list) -> bool:
    """Integer/bool host inputs only, and no float data made from them (ConstantOfShape's zeros
    are data: they belong on the device). A step without inputs (RandomNormal, an unfolded
    Constant) makes data: its launcher runs."""
    present = [a for a in args if a is not None]
    if not present:
        return False
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
