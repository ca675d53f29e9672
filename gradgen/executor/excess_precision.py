"""Excess precision: a 16-bit Conv whose only reader is a Cast to float32 runs as one convolution
with a float32 output.

AutocastPass hands a BatchNormalization that follows a lowered Conv the Conv's output cast to
float32 (gradgen/passes/autocast.py). Computed node by node, the Conv rounds its float32
accumulator to bf16 / fp16 and the Cast widens that exactly; run as one step, the convolution
stores its accumulator as float32 and the rounding never happens. That is the freedom XLA takes
by default (``xla_allow_excess_precision``): a value may be kept in more precision than its type
says when nothing else can observe the narrow one. Here nothing else can: the narrow value is
read by the Cast alone, and neither it nor the Cast's output is a graph output (a graph output
keeps the graph's value). On ResNet-18 in bf16 it is what takes the
gradients' worst per-tensor error below torch.autocast's (docs/BENCHMARKS.md).

Both backends apply the rewrite, so the CPU and the GPU keep computing the same values: the CUDA
step runs cuDNN's convolution with 16-bit operands and a float32 output
(gradgen/kernels/cuda/conv.py, ``conv_float32_output``; where cuDNN has no engine for a shape,
with a one-time note, the float32 convolution of the operands cast up: the same values, slower),
the CPU step runs the Conv kernel on float32 copies of its operands and keeps its float32 result.
A float32 model has no 16-bit Conv: its plan is unchanged. ``GRADGEN_EXCESS_PRECISION=0`` turns the
rewrite off (every value rounded to its declared type, as any ONNX runtime computes the graph).
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from gradgen.executor.fusion import executor_step, plan_dtypes, value_readers
from gradgen.executor.low_precision import is_low_precision

ENV = "GRADGEN_EXCESS_PRECISION"
OP_TYPE = "ConvFloat32Output"
_FLOAT = int(ir.DataType.FLOAT)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def fuse_conv_casts(steps: list, graph: ir.Graph, keep: set[str]) -> list:
    """``steps`` with each 16-bit Conv whose output only a Cast to float32 reads run with that Cast
    as one ``ConvFloat32Output`` step in the Conv's place, where neither value is kept (a graph
    output)."""
    if not any(step.op_type == "Conv" and not step.domain for step in steps):
        return steps  # no Conv: spare the whole-graph scans below (most models)
    readers = value_readers(steps)
    dtypes = plan_dtypes(steps, graph)
    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for i, step in enumerate(steps):
        cast_at = _widening_cast(step, steps, readers, dtypes, keep)
        if cast_at is None:
            continue
        replaced[i] = _fused_step(step, steps[cast_at])
        dropped.add(cast_at)
    if not replaced:
        return steps
    return [replaced.get(i, s) for i, s in enumerate(steps) if i not in dropped]


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
