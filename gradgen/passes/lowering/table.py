"""The lowering table and what lowerings are made of: ``register_lowering``, the opsets they need,
and small node helpers.

Family modules (gradgen/passes/lowering/<family>.py) import this module only; core.py imports the
families it lists and reads the table. Nothing here imports a family, so no import runs in a circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.names import node_name
from gradgen.ops.schemas import normalize_domain

MICROSOFT = "com.microsoft"
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)

# Every lowering writes opset-13 forms (ReduceSum/Squeeze axes as inputs, ...).
BASE_OPSET = 13
# ScatterElements / ScatterND with reduction="add".
SCATTER_ADD_OPSET = 16
# CastLike, used for zeros when an operand's element type is unknown.
CASTLIKE_OPSET = 15

STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


# ================================================================================ the table


@dataclasses.dataclass
class Lowering:
    """How to lower one op: ``fn(emitter, node)`` returns one value per node output (None for an
    output that is omitted or unused); ``min_opset(node)`` is the default-domain opset it needs."""

    domain: str
    op_type: str
    fn: Callable[[GraphBuilder, ir.Node], Sequence[ir.Value | None]]
    min_opset: Callable[[ir.Node], int]


LOWERINGS: dict[tuple[str, str], Lowering] = {}


def register_lowering(op_type: str, domain: str = MICROSOFT, min_opset: int | Callable[[ir.Node], int] = BASE_OPSET):
    """Decorator: register ``fn(emitter, node) -> outputs`` as the lowering of (domain, op_type)."""
    needs = min_opset if callable(min_opset) else (lambda node, _v=min_opset: _v)

    def wrap(fn):
        LOWERINGS[(normalize_domain(domain), op_type)] = Lowering(domain, op_type, fn, needs)
        return fn

    return wrap


def is_needed(value: ir.Value | None) -> bool:
    return value is not None and bool(value.name) and (bool(value.uses()) or value.is_graph_output())


def node_input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if i < len(node.inputs) else None


def node_where(node: ir.Node) -> str:
    return f"{node.op_type} node {node_name(node)!r}"


def zeros_opset(like_position: int) -> Callable[[ir.Node], int]:
    """The opset for a lowering that only needs zeros like input ``like_position``."""

    def need(node: ir.Node) -> int:
        like = node_input(node, like_position)
        return CASTLIKE_OPSET if like is None or like.dtype is None else BASE_OPSET

    return need


def scatter_add_opset(like_position: int) -> Callable[[ir.Node], int]:
    def need(node: ir.Node) -> int:
        return max(SCATTER_ADD_OPSET, zeros_opset(like_position)(node))

    return need
