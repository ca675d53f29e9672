"""Plan-time rewrites of the CPU backend's steps (the graph itself is not changed).

A tied embedding's gradient is the sum of two parts: the LM head's weight gradient (a GEMM) and the
lookup's gradient, which the portable graph writes as a ScatterND(add) of the rows' gradients into
a ConstantOfShape of zeros. At GPT-2's size (50,257 x 768) the zeros and the Sum are two passes
over 154 MB each (8 and 11 ms a step on the CPU). ``scatter_into_sums`` scatters into the other
addend instead, when nothing else reads it: Sum(A, ScatterND(0, i, u, add)) = ScatterND(A, i, u,
add) (the additions into a row come in another order: equal in exact arithmetic, not bit for bit
where an index repeats; a -0 of A in a row no index names stays -0, where A + 0 gave +0). The
scatter then runs where the Sum ran and may write over A (``_plan_reuse``).

The default graph writes the lookup's gradient as ONNX Runtime's GatherGrad(shape, indices, dY),
which also starts from zeros of the table's size: Sum(A, GatherGrad(shape of A, i, dY)) becomes one
step that adds dY's rows into A (``gather_grad_added``; in place where A dies), with the same
caveat on the order of the additions; the shapes and types are checked when it runs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from gradgen.kernels.cpu.indexing import gather_grad_added, gather_grad_added_into
from gradgen.kernels.table import MICROSOFT, KernelEntry

# the rewritten step's kernel: not in the registry (no graph names it), attributes as keywords
_GATHER_GRAD_ADDED = KernelEntry(
    MICROSOFT, "GatherGrad", cpu=gather_grad_added, cpu_into=gather_grad_added_into, cpu_into_attributes=True
)


def scatter_into_sums(steps: list, graph: ir.Graph, constants: dict[str, np.ndarray], keep: set[str]) -> list:
    """``steps`` with each Sum(A, ScatterND(ConstantOfShape(0), indices, updates, reduction=add))
    written as ScatterND(A, indices, updates, add) where the zeros and the scatter feed nothing
    else, A is an intermediate read only there, and A's static shape and type are the zeros'; and
    each Sum(A, GatherGrad(shape, indices, dY)) whose GatherGrad feeds nothing else as one
    ``gather_grad_added`` step."""
    values = {v.name: v for node in graph for v in node.outputs if v.name}
    producer = {name: step for step in steps for name in step.outputs if name}
    readers: dict[str, int] = {}
    for step in steps:
        for name in step.inputs:
            if name:
                readers[name] = readers.get(name, 0) + 1
    dropped: set[int] = set()
    replaced: dict[int, object] = {}
    for step in steps:
        match = _match(step, producer, readers, values, constants, keep)
        if match is not None:
            addend, scatter, zeros = match
            dropped.update((id(scatter), id(zeros)))
            replaced[id(step)] = _in_place_of(step, scatter, [addend, *scatter.inputs[1:]])
            continue
        gathered = _match_gather_grad(step, producer, readers, constants, keep)
        if gathered is not None:
            addend, gather = gathered
            dropped.add(id(gather))
            replaced[id(step)] = _in_place_of(
                step, gather, [addend, *gather.inputs], kernel=_GATHER_GRAD_ADDED.cpu, entry=_GATHER_GRAD_ADDED
            )
    if not replaced:
        return steps
    return [replaced.get(id(step), step) for step in steps if id(step) not in dropped]


def _in_place_of(sum_step, producer, inputs: list, **changes):
    """``producer`` made to read ``inputs`` and to run where ``sum_step`` ran, writing its outputs."""
    return dataclasses.replace(
        producer,
        inputs=inputs,
        outputs=list(sum_step.outputs),
        node_name=f"{sum_step.node_name} (into {producer.node_name})",
        free_after=[],
        **changes,
    )


def _match(step, producer: dict, readers: dict, values: dict, constants: dict, keep: set[str]):
    """(the other addend, the scatter step, the zeros step) when ``step`` is such a Sum, else None."""
    if step.domain or step.op_type != "Sum" or len(step.inputs) != 2 or not all(step.inputs):
        return None
    for position in (0, 1):
        scattered, addend = step.inputs[position], step.inputs[1 - position]
        scatter = producer.get(scattered)
        if scatter is None or scatter.domain or scatter.op_type != "ScatterND" or scatter.attributes.get("reduction") != "add":
            continue
        zeros_name = scatter.inputs[0]
        zeros = producer.get(zeros_name)
        if zeros is None or zeros.domain or zeros.op_type != "ConstantOfShape" or not _zero_fill(zeros):
            continue
        if readers.get(scattered) != 1 or readers.get(zeros_name) != 1 or readers.get(addend) != 1:
            continue
        if {scattered, zeros_name, addend} & keep or addend not in values or addend in constants:
            continue
        dims = constants.get(zeros.inputs[0]) if zeros.inputs else None
        if dims is None or not _same_static_tensor(values[addend], values.get(zeros_name), dims):
            continue
        return addend, scatter, zeros
    return None


def _match_gather_grad(step, producer: dict, readers: dict, constants: dict, keep: set[str]):
    """(the other addend, the GatherGrad step) when ``step`` is Sum(A, GatherGrad(shape, i, dY))
    with shape a constant and the GatherGrad read only there, else None. Shapes and types need not
    be known: ``gather_grad_added`` checks them when it runs (and sums as before where they differ)."""
    if step.domain or step.op_type != "Sum" or len(step.inputs) != 2 or not all(step.inputs):
        return None
    for position in (0, 1):
        gathered, addend = step.inputs[position], step.inputs[1 - position]
        gather = producer.get(gathered)
        if gather is None or gather.domain != MICROSOFT or gather.op_type != "GatherGrad" or len(gather.inputs) != 3:
            continue
        if readers.get(gathered) == 1 and gathered not in keep and gather.inputs[0] in constants and addend != gathered:
            return addend, gather
    return None


def _zero_fill(step) -> bool:
    value = step.attributes.get("value")
    return (
        value is not None
        and np.asarray(value).size == 1
        and not np.asarray(value).any()
        and not np.signbit(np.asarray(value)).any()
    )


def _same_static_tensor(addend: ir.Value, zeros: ir.Value | None, dims: np.ndarray) -> bool:
    """The addend's declared shape is static and the zeros' shape, and both have one float type."""
    if zeros is None or addend.shape is None or not addend.shape.is_static() or addend.dtype is None:
        return False
    same_shape = tuple(int(d) for d in addend.shape.numpy()) == tuple(int(d) for d in np.asarray(dims).reshape(-1))
    return same_shape and addend.dtype == zeros.dtype and addend.dtype.is_floating_point()
