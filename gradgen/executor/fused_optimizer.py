"""The fused optimizer update on the GPU: every parameter's update in one multi-tensor step, in place.

``OptimizerPass`` (gradgen/training/optimizers.py) writes each parameter's update as about 15
standard elementwise nodes and tags them: the graph's metadata holds the optimizer's settings, and
each update node names its parameter, the roles of the inputs it reads from outside the update
(``param``, ``grad``, ``state:<kind>``, ``scalar:<name>``) and, on the node making a new value,
which value it makes. ``fuse_update`` replaces the tagged nodes of every parameter by one step whose
kernel (gradgen/kernels/cuda/optimizer.cu) updates all parameters and optimizer states with a few
launches of at most ``MAX_TENSORS`` tensors each (the tensors' addresses and sizes are kernel
arguments, so a recorded CUDA graph replays it with no upload), writing the new values into the
input buffers: with the parameters and states bound to the Session as persistent state, the commit
then copies nothing. It computes each element as the nodes do, in the same order and rounding,
so the results are bit for bit those of the standard-op form.

The step is planned only where it is exact and safe:
- the Session binds each fused parameter and state to the output of its new value and names a
  guard (``Session(..., state_guard=[loss, grad_norm])``): outputs that must be finite for the
  state to change. The kernel reads them on the device and writes nothing when one is not finite,
  which is what the Session does on the host for a step without the fused update. With fp16 loss
  scaling the guard is the loss and the graph keeps the old values on an overflow with ``Where``
  nodes tagged as part of the update (role ``skip``): the kernel reads that bool flag too and
  writes nothing when it is set, while the scaler's new state is committed by the Session;
- every value an update makes is read only by that update (or is the new value, read by nothing
  else), the roles its settings need are all there, every tensor is declared float32, and the
  shared scalars are the same values for every parameter. A parameter that fails these keeps its
  standard nodes; the others are fused.

The global gradient norm (``grad_norm``: one ReduceSumSquare per gradient, a Sum, a Sqrt, tagged by
the pass) becomes one step too (``fuse_norm``): one launch per ``MAX_TENSORS`` gradients writes a
float64 partial sum of squares per block of ``CHUNK`` elements (each thread sums its elements in
order, then the block's threads are summed in a fixed tree), and one single-block launch sums the
partials in a fixed order and rounds the square root once to float32. It is deterministic (the same
bits every run) and at least as accurate as the nodes, but not bit for bit their result: they sum in
float32, each reduction in its own order, then the per-gradient sums in the Sum's order. It is
planned where every gradient is declared float32 and the squares and their Sum are read by nothing
else; a norm over a Cast (a gradient of another float type) keeps its nodes.

``GRADGEN_CUDA_FUSED_OPTIMIZER=0`` turns both off; ``GRADGEN_CUDA_FUSED_NORM=0`` the norm alone.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import onnx_ir as ir

from gradgen.errors import KernelError
from gradgen.training.optimizers import CONFIG_KEY, NORM_KEY, PARAM_KEY, READS_KEY, SKIP_CONFIG, SKIP_ROLE, WRITES_KEY

ENV = "GRADGEN_CUDA_FUSED_OPTIMIZER"
NORM_ENV = "GRADGEN_CUDA_FUSED_NORM"
OP_TYPE = "FusedOptimizerUpdate"
NORM_OP_TYPE = "FusedGradientNorm"
MAX_TENSORS = 64  # GG_MT_MAX of optimizer.cu: tensors per launch
CHUNK = 8192  # elements per block (a multiple of 4: a float4 chunk of an aligned tensor stays aligned)
BLOCK = 256
NORM_FINISH_BLOCK = 1024  # threads of the one block summing the norm's partials
CHUNKS = np.dtype(  # optimizer.cu's GgChunks: which block takes which elements of which tensor
    [
        ("n_tensors", np.int64),
        ("chunk", np.int64),
        ("first_chunk", np.int64, MAX_TENSORS + 1),
        ("numel", np.int64, MAX_TENSORS),
    ]
)
ARGS = np.dtype(  # optimizer.cu's MultiTensorArgs, field for field
    [
        ("guard", np.uint64, 2),
        ("skip", np.uint64),
        ("scalar", np.uint64, 4),
        ("consts", np.float32, 8),
        ("flags", np.int64),
        ("chunks", CHUNKS),
        ("ptr", np.uint64, (4, MAX_TENSORS)),
    ]
)
NORM_ARGS = np.dtype(  # optimizer.cu's SumSquaresArgs
    [("partial", np.uint64), ("chunks", CHUNKS), ("ptr", np.uint64, (1, MAX_TENSORS))]
)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def norm_enabled() -> bool:
    return enabled() and os.environ.get(NORM_ENV, "1") != "0"


@dataclasses.dataclass(frozen=True)
class Kind:
    """What one optimizer's fused kernel reads: per tensor (parameter, gradient, states, in the
    kernel's pointer order), the step's scalars (in the kernel's ``scalar`` slots) and, with loss
    scaling (``skip``), the overflow flag that makes it write nothing."""

    kernel: str
    tensors: tuple[str, ...]
    scalars: tuple[str, ...]
    writes: tuple[str, ...]
    consts: tuple[float, ...]
    flags: int
    skip: bool = False

    @property
    def shared(self) -> tuple[str, ...]:
        """The roles every fused update reads as one value: the overflow flag, then the scalars."""
        return ((SKIP_ROLE,) if self.skip else ()) + self.scalars


def kind_of(config: dict) -> Kind | None:
    """The fused form of the optimizer ``config`` (the graph's metadata), or None."""
    kind = _kind_of(config)
    return dataclasses.replace(kind, skip=True) if kind is not None and config.get(SKIP_CONFIG) else kind


def _kind_of(config: dict) -> Kind | None:
    clip = "scalar:clip" if config.get("clip_norm") is not None else ""
    scalars: tuple[str, ...]
    states: tuple[str, ...]
    if config.get("kind") == "adamw":
        b1, b2 = config["betas"]
        scalars = ("scalar:decay" if config["weight_decay"] else "", "scalar:step_size")
        scalars += ("scalar:bc2_sqrt" if config["bias_correction"] else "", clip)
        states = ("state:exp_avg", "state:exp_avg_sq")
        consts = (1.0 - b1, b2, 1.0 - b2, config["eps"])  # as OptimizerPass's const_like rounds them
        return Kind("adamw_mt_f32", ("param", "grad", *states), scalars, ("param", *states), consts, 0)
    if config.get("kind") == "sgd":
        momentum = float(config["momentum"])
        flags = (1 if config["weight_decay"] else 0) | (2 if momentum else 0) | (4 if config["nesterov"] else 0)
        states = ("state:momentum",) if momentum else ()
        scalars = ("scalar:lr", "", "", clip)
        return Kind(
            "sgd_mt_f32", ("param", "grad", *states), scalars, ("param", *states), (config["weight_decay"], momentum), flags
        )
    return None


@dataclasses.dataclass
class ParamUpdate:
    """One parameter's tagged update in the plan: the values it reads and makes, by role."""

    param: str
    members: list[int]  # positions of its steps in the plan
    reads: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> value name
    writes: dict[str, str] = dataclasses.field(default_factory=dict)


def tagged_updates(steps: list) -> tuple[dict[str, ParamUpdate], list[str]]:
    """Each parameter's update as its tags describe it, and why some cannot be read from them."""
    updates: dict[str, ParamUpdate] = {}
    problems = []
    for i, step in enumerate(steps):
        meta = step.metadata or {}
        if PARAM_KEY not in meta:
            continue
        update = updates.setdefault(meta[PARAM_KEY], ParamUpdate(meta[PARAM_KEY], []))
        update.members.append(i)
        roles = meta.get(READS_KEY, "").split(",")
        for position, name in enumerate(step.inputs):
            role = roles[position] if position < len(roles) else ""
            if role and name and update.reads.setdefault(role, name) != name:
                problems.append(f"{update.param}: two values read as {role}")
        if WRITES_KEY in meta:
            update.writes[meta[WRITES_KEY]] = step.outputs[0]
    return updates, problems


def check_update(update: ParamUpdate, kind: Kind, steps: list, context: "_Context") -> str | None:
    """Why ``update`` cannot be fused (None: it can)."""
    needed = {*kind.tensors, *(s for s in kind.shared if s)}
    if set(update.reads) != needed or set(update.writes) != set(kind.writes):
        return f"reads {sorted(update.reads)} and writes {sorted(update.writes)}, not what {kind.kernel} takes"
    inside = set(update.members)
    made = {name for i in update.members for name in steps[i].outputs if name}
    for i in update.members:
        step = steps[i]
        if len(step.outputs) != 1:
            return f"step {step.node_name!r} has {len(step.outputs)} outputs"
        for name in step.inputs:
            if name and name not in made and name not in update.reads.values() and name not in context.constants:
                return f"step {step.node_name!r} reads {name!r}, which is neither made by the update nor tagged"
    for name in made:
        if context.readers.get(name, set()) - inside or (name in context.keep and name not in update.writes.values()):
            return f"{name!r} is read outside the update"
    for role in kind.writes:
        source, target = update.reads[role], update.writes[role]
        if context.bindings.get(source) != target:
            return f"{source!r} is not bound to {target!r}"
    tensors = [update.reads[r] for r in kind.tensors] + [update.writes[r] for r in kind.writes]
    tensors += [update.reads[s] for s in kind.scalars if s]
    wrong = [n for n in tensors if context.dtypes.get(n) != np.float32]
    if wrong:
        return f"{wrong[0]!r} is not declared float32"
    if kind.skip and context.dtypes.get(update.reads[SKIP_ROLE]) != np.bool_:
        return f"the overflow flag {update.reads[SKIP_ROLE]!r} is not declared bool"
    return None


@dataclasses.dataclass
class _Context:
    readers: dict[str, set[int]]
    keep: set[str]
    constants: set[str]
    bindings: dict[str, str]
    dtypes: dict[str, np.dtype]


def fuse_update(steps: list, graph: ir.Graph, keep: set[str], bindings: dict[str, str], guard: list[str]) -> list:
    """``steps`` with the tagged updates that can be fused replaced by one ``MultiTensorUpdate``
    step, placed last (nothing reads what it writes but the Session's commit)."""
    from gradgen.executor.fusion import executor_step, plan_dtypes

    raw = graph.metadata_props.get(CONFIG_KEY)
    kind = kind_of(json.loads(raw)) if raw else None
    if kind is None or not guard:
        return steps
    updates, problems = tagged_updates(steps)
    if problems or not updates:
        return steps
    readers: dict[str, set[int]] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                readers.setdefault(name, set()).add(i)
    constants = {n for n, v in graph.initializers.items() if v.const_value is not None}
    context = _Context(readers, keep, constants, bindings, plan_dtypes(steps, graph))
    fused = [u for u in updates.values() if check_update(u, kind, steps, context) is None]
    shared = [fused[0].reads[s] if s else None for s in kind.shared] if fused else []
    fused = [u for u in fused if [u.reads[s] if s else None for s in kind.shared] == shared]
    if not fused or any(context.dtypes.get(g) != np.float32 for g in guard):
        return steps
    scalars = shared[1:] if kind.skip else shared
    kernel = MultiTensorUpdate(kind, len(guard), len(fused), [s is not None for s in scalars])
    inputs: list[str | None] = [*guard, *(s for s in shared if s is not None)]
    inputs += [u.reads[role] for u in fused for role in kind.tensors]
    outputs = [u.writes[role] for u in fused for role in kind.writes]
    step = executor_step(
        f"fused {kind.kernel.split('_')[0]} update of {len(fused)} parameters",
        OP_TYPE,
        kernel,
        inputs,
        outputs,
        [np.dtype(np.float32)] * len(outputs),
    )
    absorbed = {i for u in fused for i in u.members}
    return [s for i, s in enumerate(steps) if i not in absorbed] + [step]


class MultiTensorUpdate:
    """The fused step's launcher: arguments (guard values, the overflow flag with ``kind.skip``, the
    step's scalars, then per parameter its tensors in ``kind.tensors`` order) -> the updated
    tensors (the same device arrays)."""

    def __init__(self, kind: Kind, n_guard: int, n_params: int, scalar_slots: list[bool]):
        self.kind = kind
        self.n_guard = n_guard
        self.n_params = n_params
        self.scalar_slots = scalar_slots
        self._packed: dict[tuple, list[tuple[int, bytes]]] = {}

    def __call__(self, *args):
        from gradgen.kernels.cuda.launch import kernel_of, launch_packed

        guard = args[: self.n_guard]
        skip = args[self.n_guard] if self.kind.skip else None
        first = self.n_guard + (1 if self.kind.skip else 0)
        n_scalars = sum(self.scalar_slots)
        scalars = args[first : first + n_scalars]
        tensors = args[first + n_scalars :]
        per = len(self.kind.tensors)
        groups = [tensors[k * per : (k + 1) * per] for k in range(self.n_params)]
        _check(guard, skip, scalars, groups)
        key = tuple(int(a.gpudata) for a in args)
        if key not in self._packed:
            self._packed[key] = self.pack(guard, scalars, groups, skip)
            if len(self._packed) > 16:  # addresses change with the memory plan; a few are live at once
                self._packed.pop(next(iter(self._packed)))
        kernel = kernel_of("optimizer", self.kind.kernel)
        for grid, buffer in self._packed[key]:
            launch_packed(kernel, grid, BLOCK, buffer)
        outs = []
        for group in groups:  # written in place: the parameter, then its states
            outs.append(group[0])
            outs.extend(group[2:])
        return tuple(outs) if len(outs) > 1 else outs[0]

    def pack(self, guard, scalars, groups, skip=None) -> list[tuple[int, bytes]]:
        """One argument block per launch of at most MAX_TENSORS tensors: (blocks, bytes)."""
        present = iter(scalars)
        slots = [int(next(present).gpudata) if used else 0 for used in self.scalar_slots]
        launches = []
        for chunk, args, blocks in _launches([g for g in groups if g[0].size], ARGS):
            args["guard"][: len(guard)] = [int(g.gpudata) for g in guard]
            args["skip"] = int(skip.gpudata) if skip is not None else 0
            args["scalar"][:] = slots
            args["consts"][: len(self.kind.consts)] = np.asarray(self.kind.consts, np.float32)
            args["flags"] = self.kind.flags
            for t, group in enumerate(chunk):
                for slot, array in enumerate(group):
                    args["ptr"][slot, t] = int(array.gpudata)
            launches.append((blocks, args.tobytes()))
        return launches


def _launches(groups: list, layout: np.dtype):
    """Per launch of at most MAX_TENSORS tensor groups (each of one size, group[0]'s, non-empty):
    the groups, a zeroed argument record of ``layout`` with its chunk table filled, and its block count."""
    for start in range(0, len(groups), MAX_TENSORS):
        chunk = groups[start : start + MAX_TENSORS]
        args = np.zeros((), layout)
        sizes = np.array([g[0].size for g in chunk], np.int64)
        first = np.concatenate([[0], np.cumsum(-(-sizes // CHUNK))])
        table = args["chunks"]
        table["n_tensors"], table["chunk"] = len(chunk), CHUNK
        table["first_chunk"][: len(first)] = first
        table["numel"][: len(chunk)] = sizes
        yield chunk, args, int(first[-1])


def _norm_parts(steps: list, keep: set[str]) -> tuple[list[int], list[str], int] | None:
    """The tagged global norm of ``steps`` if it can run as one reduction: the positions of its
    ReduceSumSquare and Sum steps, the gradients in the Sum's order, the Sqrt's position."""
    roles: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        if step.metadata and NORM_KEY in step.metadata:
            roles.setdefault(step.metadata[NORM_KEY], []).append(i)
    squares, sums, roots = roles.get("square", []), roles.get("sum", []), roles.get("sqrt", [])
    if len(roots) != 1 or len(sums) > 1 or not squares or set(roles) - {"square", "sum", "sqrt"}:
        return None
    made = {steps[i].outputs[0]: i for i in squares if len(steps[i].outputs) == 1}
    for i in squares:
        step = steps[i]
        if step.op_type != "ReduceSumSquare" or step.domain or len(step.outputs) != 1 or len(step.inputs) != 1:
            return None
        if step.attributes.get("keepdims", 1) != 0 or step.attributes.get("noop_with_empty_axes", 0):
            return None  # not a full reduction to a scalar
    root = steps[roots[0]]
    if root.op_type != "Sqrt" or root.domain or len(root.inputs) != 1:
        return None
    if sums:
        total = steps[sums[0]]
        if total.op_type != "Sum" or total.domain or len(total.outputs) != 1 or root.inputs != total.outputs:
            return None
        order = total.inputs
    else:
        order = root.inputs
    if sorted(order, key=str) != sorted(made, key=str):  # every square summed once, nothing else
        return None
    inner = {*made, *(steps[i].outputs[0] for i in sums)}
    allowed = {*sums, *roots}
    for i, step in enumerate(steps):
        if i not in allowed and any(name in inner for name in step.inputs):
            return None  # a square or the sum is read outside the norm
    if inner & keep:
        return None
    return [*squares, *sums], [steps[made[name]].inputs[0] for name in order], roots[0]


def fuse_norm(steps: list, graph: ir.Graph, keep: set[str]) -> list:
    """``steps`` with the tagged global gradient norm as one ``MultiTensorNorm`` step in its Sqrt's
    place (see the module docstring), where every gradient is declared float32."""
    from gradgen.executor.fusion import executor_step, plan_dtypes

    parts = _norm_parts(steps, keep)
    if parts is None:
        return steps
    absorbed, grads, at = parts
    dtypes = plan_dtypes(steps, graph)
    if any(dtypes.get(g) != np.float32 for g in grads):
        return steps
    root = steps[at]
    step = executor_step(
        f"fused gradient norm of {len(grads)} tensors",
        NORM_OP_TYPE,
        MultiTensorNorm(),
        grads,
        root.outputs,
        [np.dtype(np.float32)],
    )
    gone = set(absorbed)
    return [step if i == at else s for i, s in enumerate(steps) if i not in gone]


class MultiTensorNorm:
    """The fused norm's launcher: float32 tensors -> sqrt(sum of their squares), a float32 scalar."""

    def __init__(self):
        self._packed: dict[tuple, list[tuple[int, np.ndarray]]] = {}

    def __call__(self, *grads):
        from gradgen.cuda import runtime as rt
        from gradgen.kernels.cuda.launch import kernel_of, launch_packed

        for g in grads:
            if g.dtype != np.float32 or not g.flags.c_contiguous:
                raise KernelError(f"the fused gradient norm takes contiguous float32 tensors, got {g.dtype}{list(g.shape)}")
        key = tuple(int(g.gpudata) for g in grads if g.size)
        if key not in self._packed:
            self._packed[key] = self.pack(grads)
            if len(self._packed) > 16:  # addresses change with the memory plan; a few are live at once
                self._packed.pop(next(iter(self._packed)))
        launches = self._packed[key]
        total = sum(blocks for blocks, _ in launches)
        partial = rt.empty((max(total, 1),), np.float64)
        out = rt.empty((), np.float32)
        kernel = kernel_of("optimizer", "sum_squares_mt_f32")
        offset = 0
        for blocks, args in launches:
            args["partial"] = int(partial.gpudata) + 8 * offset
            launch_packed(kernel, blocks, BLOCK, args.tobytes())
            offset += blocks
        finish = np.array([int(out.gpudata), int(partial.gpudata), total], np.uint64)
        launch_packed(kernel_of("optimizer", "sum_squares_sqrt"), 1, NORM_FINISH_BLOCK, finish.tobytes())
        return out

    @staticmethod
    def pack(grads) -> list[tuple[int, np.ndarray]]:
        """One argument record per launch of at most MAX_TENSORS tensors (``partial`` set per
        call): (blocks, record)."""
        launches = []
        for chunk, args, blocks in _launches([(g,) for g in grads if g.size], NORM_ARGS):
            args["ptr"][0, : len(chunk)] = [int(g.gpudata) for (g,) in chunk]
            launches.append((blocks, args))
        return launches


def _check(guard, skip, scalars, groups) -> None:
    """The kernel reads float32 scalars, a bool flag and float32 tensors of one size per parameter."""
    for value in [*guard, *scalars]:
        if value.dtype != np.float32 or value.size != 1:
            raise KernelError(f"the fused optimizer update reads float32 scalars, got {value.dtype}{list(value.shape)}")
    if skip is not None and (skip.dtype != np.bool_ or skip.size != 1):
        raise KernelError(f"the fused optimizer update reads a bool overflow flag, got {skip.dtype}{list(skip.shape)}")
    for group in groups:
        if any(a.dtype != np.float32 or a.size != group[0].size or not a.flags.c_contiguous for a in group):
            shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in group)
            raise KernelError(f"the fused optimizer update takes contiguous float32 tensors of one size, got {shapes}")
