"""The CUDA executor's cross-entropy without its log-probabilities in memory.

SoftmaxCrossEntropyLoss hands its gradient, SoftmaxCrossEntropyLossGrad (ONNX Runtime training's
contract), the log-softmax of the scores: for a language model's head an (N, C) tensor as large as
the logits (2,048 x 50,257 floats for GPT-2 at B=8, T=256), written once and read once. Where the
log-probabilities are read by nothing but such gradients, ``fuse_loss_stats`` has the forward step
keep the scores and two numbers per row instead (the max and the log of the sum of exp, from which
log_softmax_rows computes each value), and the gradient steps make each log-probability again from
a score and its row's numbers, rounded to the scores' type as the tensor would hold it: the same
bits, one (N, C) write and one read fewer (kernels/cuda/loss.py, ``sce_loss_with_stats`` and
``sce_grad``).

Only 2-D scores whose class count the graph declares above 1,024 are rewritten: those are the
shapes where the unfused log-softmax runs the same row kernel (so the bits agree), and the ones
where the tensor is worth not writing. ``GRADGEN_CUDA_FUSION=0`` turns this off with the other fusions.
"""

from __future__ import annotations

from gradgen.executor.fusion import executor_step, value_readers
from gradgen.kernels.table import MICROSOFT

FORWARD = "SoftmaxCrossEntropyLossStats"
GRADIENT = "SoftmaxCrossEntropyLossGradStats"
MIN_CLASSES = 1025  # softmax_3d runs the rows kernel above 1,024 classes


def fuse_loss_stats(steps: list, keep: set[str], shapes: dict[str, tuple[int, ...]]) -> list:
    """``steps`` with each SoftmaxCrossEntropyLoss whose log-probabilities only gradients read, and
    those gradients, in their row-statistics form. ``shapes``: the values' static shapes."""
    readers = value_readers(steps)
    replaced: dict[int, object] = {}
    for i, step in enumerate(steps):
        if step.domain or step.op_type != "SoftmaxCrossEntropyLoss" or len(step.outputs) < 2 or not step.outputs[1]:
            continue
        scores, log_prob = step.inputs[0], step.outputs[1]
        shape = shapes.get(scores) if scores else None
        if log_prob in keep or shape is None or len(shape) != 2 or shape[1] < MIN_CLASSES:
            continue
        grads = readers.get(log_prob, [])
        if not grads or not all(_reads_as_log_prob(steps[j], log_prob) for j in grads):
            continue
        stats = f"{log_prob}::row_stats"
        replaced[i] = _forward_step(step, stats)
        for j in grads:
            replaced[j] = _gradient_step(steps[j], scores, stats)
    return [replaced.get(i, s) for i, s in enumerate(steps)]


def _reads_as_log_prob(step, log_prob: str) -> bool:
    """``step`` is a SoftmaxCrossEntropyLossGrad reading ``log_prob`` as its log_prob input only."""
    return (
        step.domain == MICROSOFT
        and step.op_type == "SoftmaxCrossEntropyLossGrad"
        and step.inputs[1] == log_prob
        and log_prob not in (step.inputs[:1] + step.inputs[2:])
        and (len(step.inputs) < 5 or not step.inputs[4])  # no ignore_index input
    )


def _forward_step(loss_step, stats: str):
    def run_on_device(scores, labels, weights=None, **attributes):
        from gradgen.kernels.cuda.loss import sce_loss_with_stats

        attributes.pop("_num_outputs", None)
        return sce_loss_with_stats(scores, labels, weights, **attributes)

    return executor_step(
        f"{loss_step.node_name} (row statistics)",
        FORWARD,
        run_on_device,
        loss_step.inputs,
        [loss_step.outputs[0], stats],
        [(loss_step.output_dtypes or [None])[0], None],
        attributes=loss_step.attributes,
    )


def _gradient_step(grad_step, scores: str, stats: str):
    def run_on_device(dY, scores_value, stats_value, label, weight=None, **attributes):
        from gradgen.kernels.cuda.loss import sce_grad

        if isinstance(attributes.get("reduction"), bytes):
            attributes["reduction"] = attributes["reduction"].decode()
        return sce_grad(dY, scores_value, label, weight, None, stats=stats_value, **attributes)

    dy, _log_prob, label, *rest = grad_step.inputs
    weight = rest[0] if rest else None
    return executor_step(
        f"{grad_step.node_name} (from the scores)",
        GRADIENT,
        run_on_device,
        [dy, scores, stats, label, weight],
        grad_step.outputs,
        grad_step.output_dtypes,
        attributes=grad_step.attributes,
    )
