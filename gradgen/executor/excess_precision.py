"""Excess precision: two plan rewrites that keep a 16-bit value's float32 accumulator where
nothing can observe the rounded value.

- a 16-bit Conv whose only reader is a Cast to float32 runs as one
  convolution with a float32 output. AutocastPass hands a BatchNormalization that follows a lowered
  Conv the Conv's output cast to float32 (gradgen/passes/autocast.py); node by node, the Conv would
  round its accumulator to bf16 / fp16 and the Cast widen that exactly. On ResNet-18 in bf16 this
  takes the gradients' worst per-tensor error below torch.autocast's.
- a 16-bit MatMul (or FusedMatMul) whose only reader is an Add of a 1-D bias
  of its type runs as one product whose bias is added before the single rounding: ``nn.Linear`` as
  torch.autocast computes it (``addmm``; cuBLAS adds the bias in its float32 epilogue), where the
  graph spells a rounded product and a rounded sum. On the GPT-2 small layout in bf16 (trained
  weights, CPU) the second rounding made gradgen's gradient error about 1.7x autocast's on every
  tensor; with one rounding it is at or below autocast's (docs/BENCHMARKS.md).

That is the freedom XLA takes by default (``xla_allow_excess_precision``): a value may be kept in
more precision than its type says when nothing else can observe the narrow one. Here nothing else
can: the narrow value has that one reader, and neither it nor the result is a graph output (a graph
output keeps the graph's value).

Both backends apply the rewrites, so the CPU and the GPU keep computing the same values. CUDA:
cuDNN's convolution with 16-bit operands and a float32 output (``conv.conv_float32_output``; where
cuDNN has no engine for a shape, with a one-time note, the float32 convolution of the operands cast
up: the same values, slower), and cuBLAS with beta = 1 over a float32 output that starts as the
bias, cast once to the 16-bit type (``matmul.matmul_bias``). CPU: the Conv / MatMul kernel on
float32 copies of the operands, the float32 result kept or the bias added before the rounding. A
float32 model has no 16-bit Conv or MatMul: its plan is unchanged. ``GRADGEN_EXCESS_PRECISION=0``
turns both rewrites off (every value rounded to its declared type, as any ONNX runtime computes
the graph).
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from gradgen.executor.fusion import executor_step, graph_values, plan_dtypes, value_readers
from gradgen.executor.low_precision import is_low_precision

ENV = "GRADGEN_EXCESS_PRECISION"
OP_TYPE = "ConvFloat32Output"
LINEAR_OP_TYPE = "MatMulBias"
_PRODUCTS = {("", "MatMul"), ("com.microsoft", "FusedMatMul")}
_FLOAT = int(ir.DataType.FLOAT)
_16_BIT_FLOATS = frozenset({ir.DataType.BFLOAT16, ir.DataType.FLOAT16})
_16_BIT_CODES = frozenset(int(t) for t in _16_BIT_FLOATS)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def fuse_all(steps: list, graph: ir.Graph, keep: set[str]) -> list:
    """``steps`` with both rewrites applied, in one walk of the plan: each 16-bit Conv whose output
    only a Cast to float32 reads runs with that Cast as one ``ConvFloat32Output`` step in the Conv's
    place; each 16-bit MatMul / FusedMatMul whose output only an Add of a 1-D bias of the same type
    reads runs with that Add as one ``MatMulBias`` step in the Add's place (the Add's output keeps
    its name and type). Neither applies where a value of the pair is kept (a graph output)."""
    has_conv = any(step.op_type == "Conv" and not step.domain for step in steps)
    has_product = any((step.domain, step.op_type) in _PRODUCTS for step in steps)
    if not (has_conv or has_product) or not _may_hold_16_bit_floats(steps, graph):
        return steps  # nothing to rewrite: spare the whole-graph scans below (every float32 model)
    readers = value_readers(steps)
    dtypes = plan_dtypes(steps, graph)
    ranks = _declared_ranks(graph) if has_product else {}
    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for i, step in enumerate(steps):
        cast_at = _widening_cast(step, steps, readers, dtypes, keep)
        if cast_at is not None:
            replaced[i] = _fused_step(step, steps[cast_at])
            dropped.add(cast_at)
            continue
        found = _bias_add(step, steps, readers, dtypes, ranks, keep)
        if found is not None:
            add_at, bias = found
            replaced[add_at] = _linear_step(step, steps[add_at], bias)
            dropped.add(i)
    if not replaced:
        return steps
    return [replaced.get(i, s) for i, s in enumerate(steps) if i not in dropped]


def _may_hold_16_bit_floats(steps: list, graph: ir.Graph) -> bool:
    """Whether ``plan_dtypes`` could find a bf16 / fp16 value: one the graph declares, or an
    undeclared Cast output (the one type it infers from an attribute; other rules follow inputs)."""
    if any(value.dtype in _16_BIT_FLOATS for value in graph_values(graph)):
        return True
    casts = (s for s in steps if s.op_type == "Cast" and not s.domain)
    return any(int(step.attributes.get("to", 0)) in _16_BIT_CODES for step in casts)


def _declared_ranks(graph: ir.Graph) -> dict[str, int]:
    ranks: dict[str, int] = {}
    for value in graph_values(graph):
        if value.name and value.shape is not None:
            ranks.setdefault(value.name, len(value.shape))
    return ranks


def _bias_add(step, steps: list, readers: dict, dtypes: dict, ranks: dict, keep: set[str]) -> tuple[int, str] | None:
    """(position of the Add, name of the bias) when ``step`` is a 16-bit product whose output only
    an Add with a 1-D operand of the same type reads; else None."""
    if (step.domain, step.op_type) not in _PRODUCTS or len(step.outputs) != 1 or not step.outputs[0]:
        return None
    y = step.outputs[0]
    if not is_low_precision(dtypes.get(y)) or y in keep or len(readers.get(y, [])) != 1:
        return None
    add = steps[readers[y][0]]
    if add.domain or add.op_type != "Add" or len(add.inputs) != 2 or not add.outputs[0] or add.outputs[0] in keep:
        return None
    bias = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
    if bias == y or ranks.get(bias) != 1 or dtypes.get(bias) != dtypes.get(y):
        return None
    return readers[y][0], bias


def _linear_step(product, add, bias: str):
    kernel = product.kernel

    def on_host(a, b, c, **attributes):  # 16-bit operands arrive as float32 copies; the sum is rounded once
        return np.add(kernel(a, b, **attributes), c)

    return executor_step(
        f"{product.node_name} (+ {add.node_name})",
        LINEAR_OP_TYPE,
        _linear_on_device,
        [*product.inputs, bias],
        [add.outputs[0]],
        add.output_dtypes,
        attributes=product.attributes,
        host=on_host,
    )


def _linear_on_device(a, b, bias, **attributes):
    from gradgen.kernels.cuda.matmul import matmul_bias

    return matmul_bias(a, b, bias, **attributes)


def _widening_cast(step, steps: list, readers: dict[str, list[int]], dtypes: dict, keep: set[str]) -> int | None:
    """The position of the Cast to float32 that alone reads ``step``'s output, when ``step`` is a
    Conv that makes a 16-bit float (declared, or followed from its input's type); else None."""
    if step.domain or step.op_type != "Conv" or len(step.outputs) != 1 or not step.outputs[0]:
        return None
    y = step.outputs[0]
    if not is_low_precision(dtypes.get(y)):
        return None
    if y in keep or len(readers.get(y, [])) != 1:
        return None
    cast = steps[readers[y][0]]
    if cast.domain or cast.op_type != "Cast" or int(cast.attributes.get("to", 0)) != _FLOAT or not cast.outputs[0]:
        return None
    if cast.outputs[0] in keep:  # a graph output is the graph's value: the Conv rounded, then widened
        return None
    return readers[y][0]


def _fused_step(conv, cast):
    return executor_step(
        f"{conv.node_name} (+ {cast.node_name})",
        OP_TYPE,
        _on_device,
        list(conv.inputs),
        [cast.outputs[0]],
        [np.dtype(np.float32)],
        attributes=conv.attributes,
        host=conv.kernel,  # run on float32 copies of 16-bit operands, its result kept as float32
    )


def _on_device(*args, **attributes):
    from gradgen.kernels.cuda.conv import conv_float32_output

    return conv_float32_output(*args, **attributes)
