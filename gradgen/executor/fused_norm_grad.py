"""The CUDA executor's residual fusion: ``Sum(dX, r)`` written by LayerNormalizationGrad itself.

In a pre-norm transformer every block's input feeds a LayerNormalization and the residual Add, so
its gradient is the Sum of the residual path's gradient and LayerNormalizationGrad's dX: a kernel
that reads both and writes the Sum, after LayerNormalizationGrad wrote dX. When dX is read by
nothing but a two-input Sum (and is not a graph output), ``fuse_residual_sum`` replaces the pair by
one step whose kernel adds the other Sum input as it writes dX (kernels/cuda/norm.py,
``layer_normalization_grad_add``): one pass over the tensor and one launch fewer per LayerNorm, and
the same bits (dX is rounded to its type before the addition, as the Sum kernel sees it).

The fused step takes the LayerNormalizationGrad step's place in the plan, so the Sum's other input
must be made before it; where it is not, the pair stays as it is. ``GRADGEN_CUDA_FUSION=0`` turns
this off along with the pointwise fusion.
"""

from __future__ import annotations

from gradgen.executor.fusion import executor_step, value_readers
from gradgen.kernels.table import MICROSOFT

OP_TYPE = "LayerNormalizationGradAdd"


def fuse_residual_sum(steps: list, keep: set[str]) -> list:
    """``steps`` with each LayerNormalizationGrad whose dX only a two-input Sum reads fused with it."""
    producer = {name: i for i, step in enumerate(steps) for name in step.outputs if name}
    readers = value_readers(steps)
    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for i, step in enumerate(steps):
        if step.domain != MICROSOFT or step.op_type != "LayerNormalizationGrad" or not step.outputs or not step.outputs[0]:
            continue
        if len(step.inputs) != 5 or not all(step.inputs):
            continue
        dx = step.outputs[0]
        sums = readers.get(dx, [])
        if dx in keep or len(sums) != 1:
            continue
        j = sums[0]
        total = steps[j]
        if total.domain or total.op_type != "Sum" or len(total.inputs) != 2 or total.inputs[0] == total.inputs[1] or j in dropped:
            continue
        residual = total.inputs[1] if total.inputs[0] == dx else total.inputs[0]
        if not residual or producer.get(residual, -1) >= i:
            continue
        replaced[i] = _fused_step(step, total, residual)
        dropped.add(j)
    return [replaced.get(i, s) for i, s in enumerate(steps) if i not in dropped]


def _fused_step(norm_grad, total, residual: str):
    def run_on_host(*args, **attributes):
        from gradgen.kernels import registry

        *norm_args, res = args
        results = registry.lookup(MICROSOFT, "LayerNormalizationGrad").cpu(*norm_args, **attributes)
        return (results[0] + res, *results[1:])

    def run_on_device(*args, **attributes):
        from gradgen.kernels.cuda.norm import layer_normalization_grad_add

        *norm_args, res = args
        return layer_normalization_grad_add(*norm_args, res, **attributes)

    declared = norm_grad.output_dtypes or [None] * len(norm_grad.outputs)
    return executor_step(
        f"{norm_grad.node_name} (+ {total.node_name})",
        OP_TYPE,
        run_on_device,
        [*norm_grad.inputs, residual],
        [total.outputs[0], *norm_grad.outputs[1:]],
        [(total.output_dtypes or [None])[0], *declared[1:]],
        attributes=norm_grad.attributes,
        host=run_on_host,
    )
