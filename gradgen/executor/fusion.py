"""Pointwise fusion for the CUDA executor: chains of elementwise steps run as one generated kernel.

A backward graph spells much of its work as small elementwise nodes (a GELU's gradient is a dozen
Mul / Add / Tanh nodes), and each runs as its own kernel that reads its inputs from memory and
writes its result back. ``fuse_pointwise`` groups the plan's steps into maximal connected sets of
elementwise steps (gradgen/kernels/cuda/fused.py lists the ops) and replaces each set by one step
whose kernel reads the set's external inputs once and writes only the values that something
outside the set reads (or that are graph outputs): the intermediates never exist in memory, so
the memory plan never sees them.

Rules:
- a step joins only if it is an op with a fused form (the default domain's elementwise ops, and
  com.microsoft Gelu, FastGelu, GeluGrad and FastGeluGrad), with one named output, that reads a
  float value or the result of a step that joins (integer and bool arithmetic of their own are
  shape work, which runs on the host);
- a set stays schedulable as one step: no path leaves it and comes back (checked on merge; where
  two sets would feed each other through outside steps, the smaller stays unfused);
- at most ``fused.MAX_INPUTS`` external inputs and ``fused.MAX_OUTPUTS`` outputs.

At run time the fused step computes the dtypes and shapes of its values; where no fused kernel
covers them (a dtype without a fused form, an output smaller than the set's shape) it runs its
steps one by one with their own kernels, so its results are those of the unfused plan either way.
In place: as a single elementwise step may, a fused step's output may take the buffer of an input
that dies at that step (``note_in_place`` tells the traced run, whose memory plan decides), when
the input has the group's whole shape (a broadcast input is read at many elements) and the
output's element size, and only where the fused kernel ran.

``GRADGEN_CUDA_FUSION=0`` turns the pass off.
"""

from __future__ import annotations

import heapq
import os
from typing import Any, Callable

import numpy as np
import onnx_ir as ir

from gradgen.kernels.cuda import fused
from gradgen.kernels.cuda.launch import FLOATS, dtype_suffix
from gradgen.kernels.table import MICROSOFT, KernelEntry

ENV = "GRADGEN_CUDA_FUSION"
DOMAIN = "gradgen"
OP_TYPE = "FusedPointwise"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def graph_values(graph: ir.Graph) -> list[ir.Value]:
    """Every value the graph names: its inputs, initializers, and its nodes' inputs and outputs
    (the same value may come more than once)."""
    values = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        values.extend(v for v in node.inputs if v is not None)
        values.extend(node.outputs)
    return values


def declared_dtypes(graph: ir.Graph) -> dict[str, np.dtype]:
    """The element type the graph declares for each named value (where it declares one)."""
    found: dict[str, np.dtype] = {}
    for value in graph_values(graph):
        if value.name and value.dtype is not None and value.name not in found:
            try:
                found[value.name] = np.dtype(value.dtype.numpy())
            except (TypeError, ValueError):  # a type numpy does not have (float8, ...)
                pass
    return found


# ops whose output 0 has input 0's element type (to follow dtypes the graph leaves undeclared)
KEEPS_DTYPE = frozenset(
    "Reshape Transpose Unsqueeze Squeeze Flatten Expand Slice Concat Gather Tile Pad ReduceSum ReduceMean ReduceMax "
    "ReduceMin Softmax LogSoftmax MatMul Gemm Conv ConvGrad FusedMatMul LayerNormalization BatchNormalization Split "
    "BatchNormInternal BatchNormalizationGrad".split()
)


def plan_dtypes(steps: list, graph: ir.Graph) -> dict[str, np.dtype]:
    """Element types of the plan's values: the declared ones, and those of undeclared outputs
    followed through the fused ops' rules and the ops in KEEPS_DTYPE. Only a guide to grouping and
    to compiling ahead: the fused step checks the dtypes it is given."""
    dtypes = declared_dtypes(graph)
    for step in steps:
        if not step.outputs or not step.outputs[0] or step.outputs[0] in dtypes:
            continue
        known = [dtype_suffix(dtypes[n]) if n in dtypes else None for n in step.inputs if n]
        out = None
        rule = fused.rule_name(step.domain, step.op_type)
        if rule is not None and known and None not in known:
            out = fused.RULES[rule].out_dtype([k for k in known if k is not None], step.attributes)
        elif step.domain in ("", MICROSOFT) and step.op_type in KEEPS_DTYPE and known and known[0] is not None:
            out = known[0]
        if out is not None:
            dtypes[step.outputs[0]] = np.dtype(fused.NUMPY[out])
    return dtypes


def value_readers(steps: list) -> dict[str, list[int]]:
    """For each value name, the positions of the steps that read it, in plan order (a step that
    reads a value twice is listed twice)."""
    readers: dict[str, list[int]] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                readers.setdefault(name, []).append(i)
    return readers


def executor_step(
    node_name: str,
    op_type: str,
    cuda,
    inputs: list,
    outputs: list,
    output_dtypes: list | None = None,
    *,
    attributes: dict | None = None,
    host=None,
    cuda_host_inputs: frozenset = frozenset(),
):
    """A step of the executor's own (domain ``gradgen``), which a plan rewrite puts in place of graph
    nodes: ``cuda`` its launcher (called with the inputs and ``attributes`` as keywords), ``host``
    its numpy form (None: it has none; the CPU backend never plans these steps),
    ``cuda_host_inputs`` the input positions the launcher reads on the host."""
    from gradgen.executor.session import Step

    return Step(
        node_name=node_name,
        domain=DOMAIN,
        op_type=op_type,
        kernel=host,
        entry=KernelEntry(DOMAIN, op_type, cpu=host, cuda=cuda, cuda_host_inputs=cuda_host_inputs),
        inputs=list(inputs),
        outputs=list(outputs),
        attributes=dict(attributes or {}),
        free_after=[],
        output_dtypes=output_dtypes,
    )


def fusable(step, dtypes: dict[str, np.dtype], fused_values: frozenset | set = frozenset()) -> bool:
    """Whether ``step`` may join a fused set (see the module docstring): it reads a float value,
    or a value a fusable step makes (``fused_values``)."""
    if not fused.fusable_op(step.op_type, step.attributes, len(step.inputs), step.domain):
        return False
    if len(step.outputs) != 1 or not step.outputs[0] or not all(step.inputs):
        return False
    return any(n in fused_values or (n in dtypes and dtype_suffix(dtypes[n]) in FLOATS) for n in step.inputs)


def static_shapes(steps: list, graph: ir.Graph) -> dict[str, tuple[int, ...]]:
    """The shapes of the plan's values where every dimension is a number: those the graph
    declares, and those of undeclared outputs of ops with a fused form whose inputs' shapes are
    known (broadcasting, or the op's rule). Only a guide to grouping."""
    found: dict[str, tuple[int, ...]] = {}
    values = [*graph.inputs, *graph.initializers.values()]
    for node in graph:
        values.extend(node.outputs)
    for value in values:
        dims = value.shape
        if value.name and dims is not None and all(isinstance(d, int) for d in dims):
            found.setdefault(value.name, tuple(d for d in dims if isinstance(d, int)))
    for step in steps:
        rule = fused.rule_name(step.domain, step.op_type)
        if rule is None or not step.outputs or step.outputs[0] in found or not all(n in found for n in step.inputs if n):
            continue
        operands = [found[n] for n in step.inputs if n]
        try:
            shape_of = fused.RULES[rule].shape
            found[step.outputs[0]] = shape_of(operands) if shape_of else tuple(int(d) for d in np.broadcast_shapes(*operands))
        except ValueError:
            pass
    return found


def find_groups(
    steps: list, dtypes: dict[str, np.dtype], keep: set[str], shapes: dict[str, tuple[int, ...]] | None = None
) -> list[list[int]]:
    """The sets of step positions to fuse (two steps or more each), in plan order. ``shapes``: the
    values' static shapes where known (``static_shapes``), which keep apart sets that one kernel
    could not compute (see ``_one_shape``)."""
    producer = {name: i for i, step in enumerate(steps) for name in step.outputs if name}
    consumers: dict[str, set[int]] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                consumers.setdefault(name, set()).add(i)
    ancestors: list[int] = []  # bit p of ancestors[i]: step i depends on step p
    for step in steps:
        bits = 0
        for name in step.inputs:
            p = producer.get(name) if name else None
            if p is not None:
                bits |= ancestors[p] | (1 << p)
        ancestors.append(bits)
    group_of: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    fused_values: set[str] = set()
    for i, step in enumerate(steps):
        if not fusable(step, dtypes, fused_values):
            continue
        fused_values.add(step.outputs[0])
        group_of[i], members[i] = i, [i]
        for name in step.inputs:
            p = producer.get(name)
            if p is None or p not in group_of or group_of[p] == group_of[i]:
                continue
            union = sorted(members[group_of[p]] + members[group_of[i]])
            if (
                _schedulable(union, ancestors)
                and _within_limits(union, steps, producer, consumers, keep)
                and _one_shape(union, steps, consumers, keep, shapes or {})
            ):
                kept, gone = group_of[p], group_of[i]
                for m in members.pop(gone):
                    group_of[m] = kept
                members[kept] = union
    return sorted((sorted(g) for g in members.values() if len(g) > 1), key=lambda g: g[0])


def _schedulable(union: list[int], ancestors: list[int]) -> bool:
    """No step outside ``union`` both depends on a member and feeds one (which would make a cycle)."""
    mask = 0
    feeds = 0
    for m in union:
        mask |= 1 << m
        feeds |= ancestors[m]
    for x in range(union[0] + 1, union[-1]):
        if not (mask >> x) & 1 and (feeds >> x) & 1 and ancestors[x] & mask:
            return False
    return True


def _one_shape(union: list[int], steps: list, consumers: dict, keep: set[str], shapes: dict) -> bool:
    """Whether, as far as the static shapes tell, one kernel can compute the set: each of its
    outputs has the shape of all its values (a smaller output, such as the scalar arithmetic of an
    optimizer's step read by other parameters' updates, makes the whole set run step by step)."""
    inside = set(union)
    made = [n for m in union for n in steps[m].outputs if n in shapes]
    outputs = {shapes[n] for n in made if n in keep or consumers.get(n, set()) - inside}
    if not outputs:
        return True
    try:
        full = tuple(int(d) for d in np.broadcast_shapes(*[shapes[n] for n in made]))
    except ValueError:
        return False
    return outputs == {full}


def _within_limits(union: list[int], steps: list, producer: dict, consumers: dict, keep: set[str]) -> bool:
    inside = set(union)
    inputs = {n for m in union for n in steps[m].inputs if producer.get(n) not in inside}
    outputs = [n for m in union for n in steps[m].outputs if n in keep or consumers.get(n, set()) - inside]
    return len(inputs) <= fused.MAX_INPUTS and len(outputs) <= fused.MAX_OUTPUTS


class FusedGroup:
    """The kernel of a fused step: its steps as one Signature per input dtypes, launched with
    ``fused.launch_fused``; or its steps one by one where no fused kernel covers the run."""

    def __init__(self, members: list, inputs: list[str], outputs: list[str]):
        self.members = members
        self.inputs = inputs
        self.outputs = outputs
        ids = {name: k for k, name in enumerate(inputs)}
        ops = []
        for member in members:
            rule = fused.rule_name(member.domain, member.op_type)
            assert rule is not None, member.op_type  # fusable() let it in
            ops.append(fused.FusedOp(rule, tuple(ids[n] for n in member.inputs), fused.code_attrs(rule, member.attributes)))
            ids[member.outputs[0]] = len(inputs) + len(ops) - 1
        self.ops = tuple(ops)
        self.output_ids = tuple(ids[n] for n in outputs)
        self._signatures: dict[tuple, fused.Signature | None] = {}

    def signature(self, suffixes: tuple) -> fused.Signature | None:
        """The kernel for inputs of these dtype suffixes, or None where one is not covered."""
        if suffixes not in self._signatures:
            sig = None
            if all(s is not None for s in suffixes):
                sig = fused.Signature(suffixes, self.ops, self.output_ids)
                try:
                    sig.dtypes  # noqa: B018 - raises Unsupported
                except fused.Unsupported:
                    sig = None
            self._signatures[suffixes] = sig
        return self._signatures[suffixes]

    def __call__(self, *args):
        sig = self.signature(tuple(dtype_suffix(a.dtype) for a in args))
        results = fused.launch_fused(sig, list(args)) if sig is not None else None
        if results is None:
            results = self.run_members(args, lambda member: member.entry.cuda)
        return results[0] if len(results) == 1 else tuple(results)

    def in_place(self, args: list, result) -> list[tuple[Any, list]]:
        """The in-place candidates of the launch that gave ``result`` (fused.in_place_candidates):
        (output array, the input arrays it may be written over), whole C-contiguous device arrays
        only, which the kernel read where they are; none where the steps ran one by one."""
        from gradgen.cuda import runtime as rt
        from gradgen.kernels.cuda.launch import is_contiguous

        sig = self.signature(tuple(dtype_suffix(a.dtype) for a in args))
        shapes = tuple(tuple(int(d) for d in a.shape) for a in args)
        if sig is None or fused.layout(sig, shapes) is None:
            return []
        results = result if isinstance(result, tuple) else (result,)
        pairs = []
        for j, positions in fused.in_place_candidates(sig, list(shapes)):
            inputs = [args[k] for k in positions if rt.is_device(args[k]) and is_contiguous(args[k])]
            if inputs:
                pairs.append((results[j], inputs))
        return pairs

    def run_on_host(self, *args):
        """The steps' numpy kernels, one by one (the backend's path for host integer inputs)."""
        results = self.run_members(args, lambda member: member.entry.cpu)
        return results[0] if len(results) == 1 else tuple(results)

    def run_members(self, args, kernel_of: Callable) -> list:
        env: dict[str, Any] = dict(zip(self.inputs, args))
        for member in self.members:
            env[member.outputs[0]] = kernel_of(member)(*[env[n] for n in member.inputs], **member.attributes)
        return [env[n] for n in self.outputs]


def note_in_place(memory, kernel: FusedGroup, args: list, result) -> None:
    """Tell a traced run (device_memory.RunMemory) which outputs of a fused step may be
    written over which of its inputs (``FusedGroup.in_place``); its plan keeps the pairs whose
    input dies at this step."""
    for output, inputs in kernel.in_place(args, result):
        memory.note_in_place([(int(output.gpudata), output.nbytes)], [(int(a.gpudata), a.nbytes) for a in inputs])


def fuse_pointwise(steps: list, graph: ir.Graph, keep: set[str]) -> list:
    """``steps`` with each fusable set replaced by one fused step, in an order that still respects
    every dependency (each fused step where its last member was)."""
    dtypes = plan_dtypes(steps, graph)
    groups = find_groups(steps, dtypes, keep, static_shapes(steps, graph))
    consumers: dict[str, set[int]] = {}
    for i, step in enumerate(steps):
        for name in step.inputs:
            if name:
                consumers.setdefault(name, set()).add(i)
    while True:
        fused_steps = {group[-1]: _fused_step([steps[i] for i in group], set(group), consumers, keep) for group in groups}
        absorbed = {i for group in groups for i in group}
        order = sorted([*fused_steps.items(), *((i, s) for i, s in enumerate(steps) if i not in absorbed)], key=lambda p: p[0])
        placed, stuck = _stable_topological([s for _, s in order])
        if not stuck:
            break
        # Each set alone is schedulable, but two sets can feed each other through outside steps
        # (A -> x -> B and B -> y -> A): leave the smallest set caught in the cycle unfused.
        caught = [g for g in groups if any(fused_steps[g[-1]] is x for x in stuck)]
        groups.remove(min(caught, key=len))
    predicted = []
    for step in fused_steps.values():
        kernel = step.entry.cuda
        sig = kernel.signature(tuple(dtype_suffix(dtypes[n]) if n in dtypes else None for n in kernel.inputs))
        if sig is not None:
            predicted.append(sig)
    fused.prepare(predicted)
    return placed


def _fused_step(members: list, inside: set[int], consumers: dict[str, set[int]], keep: set[str]):
    """The step that runs ``members`` (plan positions ``inside``) as one kernel."""
    made = {n for m in members for n in m.outputs}
    inputs = list(dict.fromkeys(n for m in members for n in m.inputs if n not in made))
    outputs = [n for m in members for n in m.outputs if n in keep or consumers.get(n, set()) - inside]
    kernel = FusedGroup(members, inputs, outputs)
    declared = {n: d for m in members for n, d in zip(m.outputs, m.output_dtypes or [None] * len(m.outputs))}
    return executor_step(
        f"{members[0].node_name} (+{len(members) - 1} fused)",
        OP_TYPE,
        kernel,
        inputs,
        outputs,
        [declared.get(n) for n in outputs],
        host=kernel.run_on_host,
    )


def _stable_topological(steps: list) -> tuple[list, list]:
    """``steps`` in dependency order, each as early in the given order as its inputs allow; and
    the steps a cycle keeps from being placed (empty when there is none)."""
    producer = {name: i for i, step in enumerate(steps) for name in step.outputs if name}
    waiting = [{producer[n] for n in step.inputs if n and n in producer and producer[n] != i} for i, step in enumerate(steps)]
    readers: dict[int, list[int]] = {}
    for i, needs in enumerate(waiting):
        for p in needs:
            readers.setdefault(p, []).append(i)
    ready = [i for i, needs in enumerate(waiting) if not needs]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(steps[i])
        for r in readers.get(i, ()):
            waiting[r].discard(i)
            if not waiting[r]:
                heapq.heappush(ready, r)
    return order, [steps[i] for i, needs in enumerate(waiting) if needs]
