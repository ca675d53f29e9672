"""Session: plan a model once (order, kernel per node, buffer lifetimes), then run it many times."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import heapq
import math
import operator
import os
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.errors import GradgenError, KernelError, ModelError, RunError, UnsupportedOpsError, UsageError
from gradgen.evaluate import foldable_op
from gradgen.executor import excess_precision, low_precision
from gradgen.executor.cpu_program import CpuProgram, call_in_place
from gradgen.executor.cpu_rewrites import scatter_into_sums
from gradgen.executor.standard_forms import with_standard_forms
from gradgen.kernels import registry
from gradgen.model_io import ModelLike, copy_model, inline_functions, load_model
from gradgen.names import name_mismatch, node_name, node_names, quoted
from gradgen.ops import schemas
from gradgen.ops.attributes import node_attributes
from gradgen.ops.control_flow import outer_scope_values
from gradgen.ops.non_tensor import refuse_non_tensor_ops
from gradgen.passes.autocast import METADATA_KEY


@dataclasses.dataclass
class Step:
    """One node of the plan: its kernel, its inputs/outputs by name, and what dies after it."""

    node_name: str
    domain: str
    op_type: str
    kernel: Any
    inputs: list[str | None]
    outputs: list[str]
    attributes: dict[str, Any]
    free_after: list[str]
    entry: Any = None  # the registry entry (CPU kernel, CUDA launcher)
    index: int = 0  # position in the plan (the CUDA backend's memory plan counts steps by it)
    output_dtypes: list | None = None  # the element types the graph declares for the outputs (None: unknown)
    # Prepared once the plan is final (``_prepare_steps``), so that the run loop does no per-step setup:
    gather: Any = None  # env -> the tuple of this step's arguments (None for an absent optional input)
    first_output: str | None = None  # the name of output 0 ('' / None: not wanted)
    low_precision: bool = False  # a Cast to, or a declared output of, a 16-bit float: always run in float32
    # an input the graph declares 16-bit or does not type: the run checks its arguments for 16-bit floats
    may_read_low_precision: bool = True
    # CPU: run once at plan time when every input is a constant (``plan_time_constant``)
    foldable: bool = False
    call: Any = None  # the CPU kernel prepared for this node (kernels/table.py, prepared_cpu_call): args -> result
    metadata: dict[str, str] | None = None  # the node's metadata (the optimizer's tags: gradgen/training/optimizers.py)
    reuse: tuple[int, ...] = ()  # CPU: input positions the step may write its result over (``_plan_reuse``)
    into: Any = None  # CPU: the in-place form, (position, *args) -> its result or None (``_plan_reuse``)


class CpuBackend:
    """Runs every step with its numpy kernel; values are numpy arrays."""

    name = "cpu"

    def __init__(self) -> None:
        keep_freed_memory()

    def place_constants(self, initializers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(initializers)

    def place_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return feeds

    def execute(self, run_steps, feeds: dict[str, np.ndarray]) -> dict:
        return run_steps(self.place_feeds(feeds))

    def finish_run(self, failed: bool = False) -> None:
        pass

    def place_state(self, state: dict, values: dict[str, np.ndarray]) -> dict:
        return {name: np.array(value) for name, value in values.items()}  # copies: the caller's arrays stay theirs

    def commit_state(self, state: dict, new: dict) -> dict:
        """The outputs are fresh arrays of this run: they become the state as they are."""
        return {name: np.asarray(new[name]) for name in state}

    def lock(self):
        return contextlib.nullcontext()  # numpy kernels share no state: CPU runs may overlap

    def memory_stats(self) -> None:
        return None

    def close(self) -> None:
        pass

    def run_step(self, step: "Step", args):
        if step.low_precision or (step.may_read_low_precision and low_precision.reads_low_precision(args)):
            return low_precision.run_in_fp32(step.kernel, step.op_type, args, step.attributes, step.output_dtypes)
        return call_in_place(step, args)

    wrap = staticmethod(np.asarray)  # a kernel's result as an array (the run loop calls it per output)

    def to_host(self, value) -> np.ndarray:
        return value


_MEMORY_KEPT = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for later arrays instead of giving it back (once per
    process; ``GRADGEN_CPU_KEEP_MEMORY=0`` leaves malloc as it is; no-op off glibc).

    glibc maps each block above its mmap threshold (at most 32 MiB) afresh and unmaps it when
    freed, so every step pays the page faults and the kernel's zeroing of its large arrays again
    (GPT-2 small at B=1, T=128: 43,000 faults a step, the logits' and the tied embedding's
    gradients). ONNX Runtime keeps such buffers in its arena. With a 1 GiB mmap threshold and no
    trimming, blocks are reused from the heap; the process keeps its peak memory after a run
    (which it reaches again at the next step anyway)."""
    global _MEMORY_KEPT
    if _MEMORY_KEPT or os.environ.get("GRADGEN_CPU_KEEP_MEMORY", "1") == "0" or not sys.platform.startswith("linux"):
        return
    _MEMORY_KEPT = True
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc (and some others): the running C library's
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    mallopt(_M_MMAP_THRESHOLD, 2**30)


def node_label(node: ir.Node, name: str | None = None) -> str:
    """``node 'mm' (MatMul)``; an unnamed node by the name build-backward gives it (``node_names``:
    ``'Gather_3'``, op type and position), or ``name`` where the caller has it."""
    domain = registry.normalize_domain(node.domain)
    op = f"{domain}::{node.op_type}" if domain else node.op_type
    return f"node {name or node_name(node)!r} ({op})"


def resolve_device(device: str) -> str:
    """Map 'auto' to 'cuda' when a GPU answers, else 'cpu' (saying so); validate the name."""
    if device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"unknown device {device!r}: choose auto, cpu or cuda")
    if device == "cpu":
        return "cpu"
    from gradgen.executor.cuda_probe import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        return "cuda"
    if device == "cuda":
        raise UsageError(f"--device cuda: no usable GPU ({reason})")
    warnings.warn(f"no usable GPU ({reason}); running on the CPU", stacklevel=3)
    return "cpu"


class Session:
    """Runs an ONNX model (forward or built backward graph) on gradgen's executor.

    >>> sess = Session("model_grad.onnx")
    >>> outputs = sess.run({"x": x})           # dict name -> numpy array

    A Session may be shared by threads. On the GPU, all of gradgen's work goes to one stream, so the
    runs of every Session in the process take turns under one lock; on the CPU they run side by
    side. ``close()`` (or leaving a ``with Session(...) as sess:`` block, or dropping the last
    reference) releases the Session's device memory and recorded CUDA graphs.

    State: ``Session(model, device, state={input: output})`` binds graph inputs that carry a value
    from run to run (a training step's parameters and optimizer states). They are set once with
    ``write_state`` and are not fed to ``run``; after each run the bound output becomes the input's
    next value, on the device, with no host copy (copied into the input's own buffer, so a recorded
    CUDA graph keeps reading the same address). ``run(..., commit=f)`` commits only when
    ``f(results)`` is true (a step whose loss is not finite leaves the state as it was);
    ``read_state`` downloads the values.

    ``state_guard=[names]`` (outputs, float32 scalars such as a training step's loss and gradient
    norm): the state changes only in a run where all of them are finite. It lets the GPU update a
    training step's parameters and optimizer states in place, in one fused multi-tensor step that
    checks the guard on the device (gradgen/executor/fused_optimizer.py); such a Session takes no
    ``commit`` callback (the guard decides), and ``updates_in_place`` says so.
    """

    def __init__(
        self,
        model: ModelLike,
        device: str = "cpu",
        state: Mapping[str, str] | None = None,
        state_guard: Sequence[str] = (),
    ):
        self.model = _runnable(load_model(model))
        self.device = resolve_device(device)
        if self.device == "cuda":
            self.model = with_standard_forms(self.model)  # ops with no launcher of their own, as standard ops
        self.graph = self.model.graph
        if self.device == "cuda":
            from gradgen.cuda import runtime
            from gradgen.executor.cuda_backend import CudaBackend

            # a model built with --precision tf32 asks for TF32 GEMMs and convolutions (AutocastPass's metadata)
            self.backend = CudaBackend(tf32=self.model.metadata_props.get(METADATA_KEY) == "tf32")
            runtime.close_at_exit(self)  # its device constants and arena go before the context does
        else:
            self.backend = CpuBackend()
        self.opsets = {registry.normalize_domain(d): v for d, v in self.model.opset_imports.items()}
        self.initializers = {
            name: _canonical_dtype(value.const_value.numpy())
            for name, value in self.graph.initializers.items()
            if value.const_value is not None
        }
        self.input_values = [v for v in self.graph.inputs if v.name not in self.initializers]
        self.output_names = [v.name for v in self.graph.outputs]
        self.state_bindings = _checked_bindings(dict(state or {}), self.input_names, self.output_names)
        self.state_guard = _checked_guard(list(state_guard), self.state_bindings, self.output_names)
        # called as observer(step, args, result) after every step (per-op timing, tests)
        self.step_observer: Callable[[Step, tuple, Any], None] | None = None
        self._program: CpuProgram | None = None
        self._observed_program: tuple[Callable, CpuProgram] | None = None  # (step_observer, its program)
        self.steps = self._plan()
        self.updates_in_place = any(step.domain == "gradgen" and step.op_type == "FusedOptimizerUpdate" for step in self.steps)
        self.backend.num_steps = len(self.steps)
        self.constants = self.backend.place_constants(self.initializers)
        if self.device == "cpu":
            self._program = self._cpu_program()
        self._known_outputs = frozenset(self.output_names) | frozenset(self.constants) | frozenset(self.input_names)
        self._state: dict[str, Any] = {}  # bound input -> its current value, placed by the backend
        self._state_specs = feed_specs([v for v in self.input_values if v.name in self.state_bindings])
        self._feed_specs = feed_specs([v for v in self.input_values if v.name not in self.state_bindings])
        self._borrowed: tuple[Session, dict[str, str]] | None = None  # see read_state_from
        self.closed = False

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.input_values]

    def _plan(self) -> list[Step]:
        nodes = list(self.graph)
        refuse_non_tensor_ops(nodes)
        names = node_names(nodes)  # an unnamed node's as build-backward names it: 'Gather_3'
        missing = []
        for node in nodes:
            entry = registry.lookup(node.domain, node.op_type)
            usable = entry is not None and (entry.cpu is not None or (self.device == "cuda" and entry.cuda is not None))
            if not usable:
                missing.append((registry.normalize_domain(node.domain), node.op_type, names[node]))
        if missing:
            raise UnsupportedOpsError("a CPU kernel" if self.device == "cpu" else "a CPU or CUDA kernel", missing)
        steps = []
        # the CPU only until the CUDA suite has run with it (the GPU backend's 16-bit handling)
        inferred = low_precision.untyped_value_types(self.model) if self.device == "cpu" else {}
        for node in _topological_order(nodes, self.graph):
            entry = registry.lookup(node.domain, node.op_type)
            if registry.normalize_domain(node.domain) == schemas.MICROSOFT_DOMAIN and node.op_type in schemas.SCHEMAS:
                schemas.check_node(
                    node.op_type, len(node.inputs), len(node.outputs), node.attributes, node_label(node, names[node])
                )
            attrs = node_attributes(node)
            captured = [v.name for v in outer_scope_values(node)]  # what an If / Loop / Scan body reads
            if captured:
                attrs["_captured"] = tuple(captured)
            if entry.wants_num_outputs:
                attrs["_num_outputs"] = len(node.outputs)
            if entry.wants_opset:
                attrs["_opset"] = self.opsets.get(registry.normalize_domain(node.domain), 1)
            if entry.wants_wanted:
                attrs["_wanted"] = tuple(bool(v.name) for v in node.outputs)
            steps.append(
                Step(
                    node_name=names[node],
                    domain=registry.normalize_domain(node.domain),
                    op_type=node.op_type,
                    kernel=entry.cpu,
                    entry=entry,
                    inputs=_own_inputs(node) + captured,
                    outputs=[v.name for v in node.outputs],
                    attributes=attrs,
                    free_after=[],
                    output_dtypes=low_precision.declared_dtypes(node),
                    may_read_low_precision=bool(captured) or low_precision.may_read_low_precision(node, inferred),
                    foldable=self.device == "cpu" and not captured and plan_time_constant(node),
                    metadata=dict(node.metadata_props) or None,
                )
            )
        steps = _hoist_shape_reads(self._fold_constant_nodes(steps))
        if excess_precision.enabled():
            steps = excess_precision.fuse_all(steps, self.graph, set(self.output_names))
        if self.device == "cpu":
            steps = scatter_into_sums(steps, self.graph, self.initializers, set(self.output_names))
        if self.device == "cuda":
            steps = self.backend.fuse(steps, self.graph, set(self.output_names), self.state_bindings, self.state_guard)
        for index, step in enumerate(steps):
            step.index = index
        _assign_lifetimes(steps, keep=set(self.output_names) | set(self.initializers))
        _prepare_steps(steps, self.initializers)
        if self.device == "cpu":
            _plan_reuse(steps, protected=set(self.input_names) | set(self.initializers) | set(self.output_names))
        return steps

    def _fold_constant_nodes(self, steps: list[Step]) -> list[Step]:
        """Evaluate Constant nodes once, at plan time, and on the CPU every ``foldable`` step whose
        inputs are all constants (what a backward graph computes from constants alone: a Pow
        gradient's log of a constant base, a mean's scale); their outputs join the initializers.
        A step whose kernel fails stays, to report the failure with its node when the model runs."""
        kept = []
        for step in steps:
            if step.op_type == "Constant" and not step.domain and not step.inputs:
                self.initializers[step.outputs[0]] = _canonical_dtype(np.asarray(step.kernel(**step.attributes)))
                continue
            if step.foldable and all(name in self.initializers for name in step.inputs if name):
                folded = self._evaluate(step)
                if folded is not None:
                    for name, value in zip(step.outputs, folded):
                        if name:
                            self.initializers[name] = _canonical_dtype(value)
                    continue
            kept.append(step)
        return kept

    def _evaluate(self, step: Step) -> list[np.ndarray] | None:
        args = [self.initializers[name] if name else None for name in step.inputs]
        try:
            with np.errstate(all="ignore"):  # as at run time, where numpy's warnings are not errors
                result = step.kernel(*args, **step.attributes)
        except Exception:  # noqa: BLE001 -- the run reports it, naming the node
            return None
        results = list(result) if isinstance(result, tuple) else [result]
        if len(results) < len(step.outputs) or any(r is None for r in results[: len(step.outputs)]):
            return None
        return [np.asarray(r) for r in results[: len(step.outputs)]]

    def run(self, feeds: Mapping[str, np.ndarray], outputs: list[str] | None = None, *, commit=None) -> dict[str, np.ndarray]:
        """Run the model on ``feeds``; return the graph outputs (or those named) as numpy arrays.
        With bound state, its next values are committed unless ``commit(results)`` is false."""
        wanted = outputs if outputs is not None else self.output_names
        known = self._known_outputs
        unknown = [n for n in wanted if n not in known] if outputs is not None else None
        if unknown:
            raise UsageError(
                f"unknown output name(s): {', '.join(unknown)}; the model's outputs are {', '.join(self.output_names)}"
            )
        if self.closed:
            raise UsageError("this Session is closed")
        if commit is not None and self.updates_in_place:
            raise UsageError("this Session updates its state in place, guarded by state_guard: it takes no commit callback")
        checked = check_feeds(self._feed_specs, feeds)
        if self._borrowed is not None:
            source, names = self._borrowed
            if not source._state:
                raise UsageError("the Session this one reads state from has no state: call its write_state() first")
            checked.update({name: source._state[theirs] for name, theirs in names.items()})
        if self.state_bindings:
            if not self._state:
                raise UsageError("this Session's state is not set: call write_state() before the first run")
            checked.update(self._state)
        with self.backend.lock():
            try:
                # NaN and inf are values a model may compute (0 / 0 over an empty slice, log(0)),
                # not warnings about gradgen's source lines: ONNX Runtime and PyTorch are silent too
                with np.errstate(all="ignore"):
                    values = self.backend.execute(self._run_steps, checked)
                results = {name: self.backend.to_host(values[name]) for name in wanted}
                if self.state_bindings and (commit is None or commit(results)) and self._guard_passed(values):
                    self._state = self.backend.commit_state(self._state, self._next_state(values))
            except BaseException:
                values = None
                self.backend.finish_run(failed=True)
                raise
            values = None  # the run's device buffers die here, before the backend checks its plan
            self.backend.finish_run()
        return results

    def run_within(self, feeds: Mapping[str, Any]) -> list:
        """The outputs (in order) of a run made inside a step of another Session's run on the same
        device: an If branch or a loop body on the GPU (gradgen/kernels/cuda/control.py). ``feeds``
        are placed already (device arrays, or host arrays where the outer run keeps them); the outer
        run holds the lock, and the caller decides where the allocations come from (no plan of this
        Session's own); the outputs stay where they are, nothing is downloaded."""
        env = self._run_steps(dict(feeds))
        return [env[name] for name in self.output_names]

    def _guard_passed(self, values: dict) -> bool:
        """Every ``state_guard`` output of the run is finite (a fused in-place update checked the
        same on the device, and wrote nothing when it failed)."""
        return all(bool(np.all(np.isfinite(self.backend.to_host(values[name])))) for name in self.state_guard)

    def _next_state(self, values: dict) -> dict:
        """The bound outputs of a run, which must keep their inputs' shapes and element types."""
        new = {}
        for name, out in self.state_bindings.items():
            value, current = values[out], self._state[name]
            if value.shape != current.shape or value.dtype != current.dtype:
                raise RunError(
                    f"state output {out!r} is {value.dtype}{list(value.shape)}, but its input {name!r} "
                    f"is {current.dtype}{list(current.shape)}"
                )
            new[name] = value
        return new

    def write_state(self, values: Mapping[str, np.ndarray]) -> None:
        """Set every bound input's value (at the start, or to resume): one upload, into the buffers
        the state already has where the shapes agree."""
        if not self.state_bindings:
            raise UsageError("this Session binds no state (Session(..., state={input: output}))")
        if self.closed:
            raise UsageError("this Session is closed")
        checked = check_feeds(self._state_specs, values)
        with self.backend.lock():
            self._state = self.backend.place_state(self._state, checked)

    def read_state_from(self, source: "Session", names: Mapping[str, str]) -> None:
        """Take the inputs of ``names`` (input here -> bound input of ``source``) from ``source``'s
        current state at each run, not from the feeds: the same device buffers, no copy. Two graphs
        of one training step (gradient accumulation and update) read what each other keeps."""
        specs = {spec.name: spec for spec in self._feed_specs}
        theirs = {spec.name: spec for spec in source._state_specs}
        bad = [f"{n!r} is not an input fed to this Session" for n in names if n not in specs]
        bad += [f"{t!r} is not bound state of the other Session" for t in names.values() if t not in theirs]
        bad += [
            f"{n!r} is {specs[n].dtype}, {t!r} {theirs[t].dtype}"
            for n, t in names.items()
            if n in specs and t in theirs and specs[n].dtype != theirs[t].dtype
        ]
        if bad or source.device != self.device:
            raise UsageError(f"read_state_from: {'; '.join(bad[:4]) or 'the Sessions are on different devices'}")
        self._borrowed = (source, dict(names))
        self._feed_specs = [spec for spec in self._feed_specs if spec.name not in names]

    def read_state(self) -> dict[str, np.ndarray]:
        """The bound inputs' current values, as host copies."""
        if self.closed:
            raise UsageError("this Session is closed")
        with self.backend.lock():
            return {name: np.array(self.backend.to_host(value)) for name, value in self._state.items()}

    def memory_stats(self) -> dict | None:
        """On the GPU: the planned arena size and the peak device memory held (bytes); see
        ``CudaBackend.memory_stats``. None on the CPU."""
        return self.backend.memory_stats()

    def close(self) -> None:
        """Release the device memory and recorded CUDA graphs; later runs are an error."""
        if not self.closed:
            self.closed = True
            self.backend.close()
            self.constants = {}
            self._program = self._observed_program = None
            self._state = {}
            self._known_outputs = frozenset(self.output_names) | frozenset(self.input_names)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def profile(self, feeds: dict[str, np.ndarray], runs: int = 3):
        """Time every step (CPU): a ``gradgen.executor.profile.Profile``, each step's median over
        ``runs`` runs after a warm-up, with ``by_op()`` and ``slowest(n)``."""
        from gradgen.executor.profile import profile_run

        return profile_run(self, feeds, runs)

    def _execute(self, placed_feeds: dict) -> dict:
        """Run every step on feeds already placed by the backend; return the surviving values.
        The CPU backend runs the same steps as a prepared program (``_plan``: CpuProgram)."""
        env: dict[str, Any] = dict(self.constants)
        env.update(placed_feeds)
        run_step = self.backend.run_step
        wrap = self.backend.wrap
        observer = self.step_observer
        for step in self.steps:
            args = step.gather(env)
            try:
                result = run_step(step, args)
            except Exception as exc:
                _raise_step_failure(step, exc, args, self.device)
                raise
            if observer is not None:
                observer(step, args, result)
            if isinstance(result, tuple):
                for name, value in zip(step.outputs, result):
                    if name:
                        env[name] = wrap(value)
            elif step.first_output:
                env[step.first_output] = wrap(result)
            args = result = value = None  # so that what free_after drops dies at this step
            for name in step.free_after:
                env.pop(name, None)
        return env

    def _run_steps(self, placed_feeds: dict) -> dict:
        if self.device != "cpu":
            return self._execute(placed_feeds)
        if self.step_observer is None and self._program is not None:
            return self._program(placed_feeds)
        if self._observed_program is None or self._observed_program[0] is not self.step_observer:
            # built once per observer, so that a profile's runs do not time the program's preparation
            self._observed_program = (self.step_observer, self._cpu_program(self.step_observer))
        return self._observed_program[1](placed_feeds)

    def _cpu_program(self, observer=None) -> CpuProgram:
        return CpuProgram(self.steps, self.constants, self.output_names, self.backend.run_step, _cpu_step_failure, observer)


def _raise_step_failure(step: Step, exc: Exception, args: tuple, device: str) -> None:
    """Raise the error a failed step reports: the node's name and op with the kernel's message, or
    with the inputs' types and shapes for an unexpected exception. Returns (the caller re-raises
    ``exc`` as it is) for gradgen's own errors, which already say what went wrong."""
    if isinstance(exc, KernelError):
        raise KernelError(f"node {step.node_name!r} ({_qualified(step)}): {exc}") from None
    if isinstance(exc, GradgenError):
        return
    shapes = ", ".join("None" if a is None else f"{a.dtype}{list(a.shape)}" for a in args)
    if device == "cuda":
        shapes += " on cuda"
    message = f"node {step.node_name!r} ({_qualified(step)}) failed on inputs ({shapes}): {type(exc).__name__}: {exc}"
    raise RunError(message) from exc


# control-flow ops' inputs before their variadic ones: a serialised Loop without loop-carried
# values may have dropped its optional trailing condition, and the outer values its body reads
# follow the node's own inputs
_LEADING_INPUTS = {"Loop": 2, "If": 1}


def _own_inputs(node: ir.Node) -> list[str | None]:
    """The names of a node's inputs (None for an omitted one), its leading optional ones padded."""
    names = [v.name if v is not None else None for v in node.inputs]
    if node.domain in ("", "ai.onnx"):
        names += [None] * (_LEADING_INPUTS.get(node.op_type, 0) - len(names))
    return names


# Below opset 11 ops carry attribute forms the kernels do not take (Add's and Gemm's broadcast and
# axis of opset 6, Pad-2's pads, PRelu-6's channel slopes): such a model runs as ONNX's version
# converter makes it, the same conversion build-backward makes (passes.standard.UpgradeOpsetPass).
LEGACY_OPSET = 11


def _upgraded_legacy_opset(model: ir.Model) -> ir.Model:
    """A converted copy of a model below LEGACY_OPSET, or ``model`` itself where the conversion of
    a model with a Scan is refused (a Scan-8 with sequence lengths, which the kernels run as it
    is); any other refusal is the model's error."""
    from gradgen.passes.standard import converted_below

    try:
        return converted_below(model, LEGACY_OPSET)
    except ModelError:
        if any(node.op_type == "Scan" for node in ir.traversal.RecursiveGraphIterator(model.graph)):
            return model
        raise


def _runnable(model: ir.Model) -> ir.Model:
    """``model``, or where it calls local functions or holds sequences or optionals, one copy with
    the functions inlined and the sequences whose structure the graph fixes as the tensors they
    hold (SequencesAsTensorsPass; what remains is refused when the Session plans). The caller's
    model is not changed."""
    from gradgen.ops.non_tensor import is_non_tensor_op

    runnable = _upgraded_legacy_opset(model)
    if runnable.functions:
        runnable = copy_model(runnable) if runnable is model else runnable
        inline_functions(runnable)
    if any(is_non_tensor_op(n.domain, n.op_type) for n in ir.traversal.RecursiveGraphIterator(runnable.graph)):
        from gradgen.passes import EvaluateConstantsPass, SequencesAsTensorsPass

        runnable = copy_model(runnable) if runnable is model else runnable
        EvaluateConstantsPass()(runnable)  # positions and split sizes computed from shapes
        SequencesAsTensorsPass()(runnable)
    return runnable


def _checked_bindings(bindings: dict[str, str], inputs: list[str], outputs: list[str]) -> dict[str, str]:
    """State bindings pair a graph input (not an initializer) with a graph output, one to one."""
    bad = [f"{name!r} is not a graph input" for name in bindings if name not in inputs]
    bad += [f"{out!r} (for {name!r}) is not a graph output" for name, out in bindings.items() if out not in outputs]
    if len(set(bindings.values())) != len(bindings):
        bad.append("two inputs are bound to the same output")
    if bad:
        raise UsageError(f"state bindings: {'; '.join(bad[:4])}")
    return bindings


def _checked_guard(guard: list[str], bindings: dict[str, str], outputs: list[str]) -> list[str]:
    """A state guard names graph outputs, and needs bound state to guard."""
    if guard and not bindings:
        raise UsageError("state_guard without state bindings: there is no state to guard")
    unknown = [name for name in guard if name not in outputs]
    if unknown:
        raise UsageError(f"state_guard: {quoted(unknown)} are not graph outputs")
    return guard


def _canonical_dtype(array: np.ndarray) -> np.ndarray:
    """``array`` as a view with numpy's own instance of its dtype. Tensors from ONNX come with
    equal but distinct dtype objects ('<f4'); kernels compare dtypes by identity first, so a
    constant with numpy's instance skips the slower equality test on every step."""
    canonical = np.dtype(array.dtype.type)
    if canonical is array.dtype or canonical != array.dtype:
        return array
    return array.view(canonical)


def _cpu_step_failure(step: Step, exc: Exception, args: tuple) -> None:
    _raise_step_failure(step, exc, args, "cpu")


def _qualified(step: Step) -> str:
    return f"{step.domain}::{step.op_type}" if step.domain else step.op_type


def _topological_order(nodes: list[ir.Node], graph: ir.Graph) -> list[ir.Node]:
    """Kahn's algorithm, stable in graph order; a cycle or a dangling input is a ModelError."""
    available = {v.name for v in graph.inputs} | set(graph.initializers)
    producers: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for out in node.outputs:
            if out.name:
                producers[out.name] = index
    waiting_on: list[set[str]] = []
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        needs = set()
        for value in [*node.inputs, *outer_scope_values(node)]:
            if value is None or not value.name or value.name in available:
                continue
            if value.name not in producers:
                raise ModelError(
                    f"{node_label(node)}: input {value.name!r} is produced by no node and is not a graph input or initializer"
                )
            needs.add(value.name)
        waiting_on.append(needs)
        for name in needs:
            consumers.setdefault(name, []).append(index)
    ready = [i for i, needs in enumerate(waiting_on) if not needs]
    order: list[ir.Node] = []
    heapq.heapify(ready)
    while ready:
        index = heapq.heappop(ready)
        order.append(nodes[index])
        for out in nodes[index].outputs:
            for consumer in consumers.get(out.name, []):
                waiting_on[consumer].discard(out.name)
                if not waiting_on[consumer]:
                    heapq.heappush(ready, consumer)
    if len(order) != len(nodes):
        stuck = [node_label(nodes[i]) for i, needs in enumerate(waiting_on) if needs][:5]
        raise ModelError(f"the graph has a cycle; stuck at {', '.join(stuck)}")
    return order


FOLDED_ELEMENTS = 4096  # the largest output a plan-time step may fold into a constant


def plan_time_constant(node: ir.Node) -> bool:
    """``node`` may run once at plan time when its inputs are constants: an op the build-time
    evaluator folds (standard, deterministic, without subgraphs) whose outputs are small, of static
    declared shape, not 16-bit floats (run in float32 at run time), and not graph outputs (which a
    run must produce)."""
    if not foldable_op(node):
        return False
    for value in node.outputs:
        if value.is_graph_output() or value.shape is None or not value.shape.is_static():
            return False
        if math.prod(value.shape.numpy()) > FOLDED_ELEMENTS or value.dtype is None:
            return False
    return not low_precision.may_read_low_precision(node) and not any(
        low_precision.is_low_precision(d) for d in low_precision.declared_dtypes(node)
    )


SHAPE_READS = ("Shape", "Size")  # ops that read only their input's shape, never its values


def _hoist_shape_reads(steps: list[Step]) -> list[Step]:
    """Move each Shape / Size step right after the step that makes its input.

    A backward graph asks for the shapes of forward values late (un-broadcasting a gradient needs
    ``Shape(x)``); in step order that read would keep ``x`` alive through the whole backward (on
    GPT-2 with a dynamic length, the attention scores: 48 MiB a layer). Read early, ``x`` dies at
    its last real use. The order stays topological: the step depends on its input alone."""
    produced = {name for step in steps for name in step.outputs if name}
    moved: dict[str, list[Step]] = {}
    kept = []
    for step in steps:
        if not step.domain and step.op_type in SHAPE_READS and step.inputs and step.inputs[0] in produced:
            moved.setdefault(step.inputs[0], []).append(step)
        else:
            kept.append(step)
    order: list[Step] = []

    def place(step: Step) -> None:
        order.append(step)
        for name in step.outputs:
            for reader in moved.pop(name, ()):
                place(reader)

    for step in kept:
        place(step)
    return order


def _prepare_steps(steps: list[Step], constants: dict[str, np.ndarray]) -> None:
    """Resolve per step what does not depend on the values: how to fetch its arguments, where its
    single output goes, whether it always runs in float32, its prepared CPU call."""
    for step in steps:
        known = tuple(constants.get(name, registry.RUNTIME) if name else None for name in step.inputs)
        step.call = registry.prepared_cpu_call(step.entry, step.attributes, known)
        step.gather = _gatherer(step.inputs)
        step.first_output = step.outputs[0] if step.outputs else None
        step.low_precision = low_precision.always_fp32(step.op_type, step.attributes, step.output_dtypes)


def _plan_reuse(steps: list[Step], protected: set[str]) -> None:
    """Per CPU step with an in-place form (``KernelEntry.cpu_into``), the inputs it may write its
    result over: those that die at the step, are read once by it, and are not graph inputs (the
    caller's arrays), constants or outputs. The run checks the rest (``overwritable``), so the
    step's result takes a dying input's memory instead of new memory, with the same bits."""
    for step in steps:
        if step.entry is None or step.entry.cpu_into is None:
            continue
        dying = set(step.free_after) - protected
        step.reuse = tuple(i for i, name in enumerate(step.inputs) if name in dying and step.inputs.count(name) == 1)
        into = step.entry.cpu_into
        step.into = functools.partial(into, **step.attributes) if step.entry.cpu_into_attributes else into


def _gatherer(names: list[str | None]):
    """env -> the tuple of the values named (None for an empty name), as cheap as Python allows."""
    if not names:
        return lambda env: ()
    if all(names):
        if len(names) == 1:
            only = names[0]
            return lambda env: (env[only],)
        return operator.itemgetter(*names)
    names = tuple(names)
    return lambda env: tuple([env[name] if name else None for name in names])


def _assign_lifetimes(steps: list[Step], keep: set[str]) -> None:
    last_use: dict[str, int] = {}
    for index, step in enumerate(steps):
        for name in step.inputs:
            if name:
                last_use[name] = index
        for name in step.outputs:
            if name:
                last_use.setdefault(name, index)
    for name, index in last_use.items():
        if name not in keep:
            steps[index].free_after.append(name)


def numpy_dtype(dtype: ir.DataType) -> np.dtype:
    return np.dtype(dtype.numpy())


def validate_feeds(input_values: list[ir.Value], feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Check every graph input is fed with the declared dtype and a shape that fits; bind symbols."""
    return check_feeds(feed_specs(input_values), feeds)


@dataclasses.dataclass(frozen=True)
class FeedSpec:
    """A graph input as ``check_feeds`` needs it, resolved once per Session."""

    name: str
    dtype: np.dtype | None  # None: not declared
    dims: tuple | None  # per axis an int, a symbol name or '?'; None: shape not declared


def feed_specs(input_values: list[ir.Value]) -> list[FeedSpec]:
    return [
        FeedSpec(
            v.name,
            numpy_dtype(v.dtype) if v.dtype is not None else None,
            tuple(d if isinstance(d, int) else (d.value or "?") for d in v.shape) if v.shape is not None else None,
        )
        for v in input_values
    ]


def check_feeds(specs: list[FeedSpec], feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Check every graph input is fed with the declared dtype and a shape that fits; bind symbols."""
    if len(feeds) != len(specs) or any(spec.name not in feeds for spec in specs):
        _refuse_names(specs, feeds)
    symbols: dict[str, tuple[int, str]] = {}
    checked = {}
    for spec in specs:
        array = np.asarray(feeds[spec.name])
        if not array.dtype.isnative and array.dtype.newbyteorder("=") == spec.dtype:
            array = array.astype(spec.dtype)  # big-endian data (from another machine's file): the same values
        if spec.dtype is not None and array.dtype != spec.dtype:
            raise RunError(f"input {spec.name!r}: dtype {array.dtype}, but the model declares {spec.dtype}")
        if spec.dims is not None and array.shape != spec.dims:  # equal: every axis a matching int
            _check_shape(spec.name, array.shape, spec.dims, symbols)
        checked[spec.name] = array
    return checked


def _refuse_names(specs: list[FeedSpec], feeds: Mapping[str, np.ndarray]) -> None:
    declared = [spec.name for spec in specs]
    problems = name_mismatch(declared, feeds, "missing input(s) {}", "unknown input name(s) {}")
    raise RunError(f"{problems}; the model's inputs are {quoted(declared)}")


def _check_shape(name: str, got: tuple[int, ...], dims: tuple, symbols: dict[str, tuple[int, str]]) -> None:
    want = list(dims)
    if len(got) != len(want):
        raise RunError(f"input {name!r}: rank {len(got)} (shape {list(got)}), but the model declares shape {want}")
    for axis, (size, dim) in enumerate(zip(got, want)):
        if isinstance(dim, int):
            if size != dim:
                raise RunError(f"input {name!r}: dimension {axis} is {size}, but the model declares {dim} (shape {want})")
        elif dim != "?":
            if dim in symbols and symbols[dim][0] != size:
                bound, where = symbols[dim]
                raise RunError(f"input {name!r}: dimension {axis} ({dim!r}) is {size}, but {where} set {dim!r} to {bound}")
            symbols.setdefault(dim, (size, f"input {name!r}"))
