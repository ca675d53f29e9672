"""Ops whose values are not tensors: ONNX sequences and optionals.

gradgen's passes, gradient rules and executors hold tensors only. SequencesAsTensorsPass
(gradgen/passes/sequences.py) turns the nodes whose lists the model fixes into the tensors they hold
(``gradgen ops`` lists these ops as ``rewritten``); a node of these ops that stays is refused (a
model error naming each such node and op) by the gradient pass when the loss depends on it and by a
Session when it plans the graph, rather than reported as an op without a rule or kernel.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradgen.errors import ModelError
from gradgen.names import node_name

SEQUENCE_OPS = frozenset(
    {
        "SequenceConstruct",
        "SequenceEmpty",
        "SequenceInsert",
        "SequenceAt",
        "SequenceErase",
        "SequenceLength",
        "SequenceMap",
        "SplitToSequence",
        "ConcatFromSequence",
    }
)
OPTIONAL_OPS = frozenset({"Optional", "OptionalGetElement", "OptionalHasElement"})
NON_TENSOR_OPS = SEQUENCE_OPS | OPTIONAL_OPS

REASON = "gradgen runs tensors only, not ONNX sequences or optionals"


def is_non_tensor_op(domain: str, op_type: str) -> bool:
    return domain in ("", "ai.onnx") and op_type in NON_TENSOR_OPS


def refuse_non_tensor_ops(nodes: Iterable) -> None:
    """A one-line ModelError naming every node (name, op) of ``nodes`` that holds a sequence or an
    optional; nothing when there is none. ``nodes`` are onnx_ir nodes."""
    found = [f"{node_name(node)!r} ({node.op_type})" for node in nodes if is_non_tensor_op(node.domain, node.op_type)]
    if found:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise ModelError(
            f"node{'s' if len(found) > 1 else ''} {shown}: {REASON} (an export that keeps such a list as "
            "separate tensors, e.g. a Concat of them, avoids these ops)"
        )
