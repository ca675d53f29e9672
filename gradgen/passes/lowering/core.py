"""LowerToStandardPass, the lookup of lowerings and the splicing of the nodes a lowering builds.

``FAMILIES`` names the family modules of this package (the family names of grads/rules and
kernels/). They register their lowerings with the decorator of table.py and never import this
module; the first lookup imports them, once.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
import onnx_ir as ir

from gradgen.builder import GraphBuilder, graph_names
from gradgen.errors import ModelError, UnsupportedOpsError
from gradgen.model_io import default_opset
from gradgen.names import node_name
from gradgen.ops import schemas
from gradgen.ops.schemas import normalize_domain
from gradgen.passes.lowering.table import (
    LOWERINGS,
    MICROSOFT,
    STANDARD_DOMAINS,
    Lowering,
    is_needed,
    node_where,
)
from gradgen.passes.rewrite import NodeRemoval, replace_uses
from gradgen.registration import Families


def lookup_lowering(domain: str, op_type: str) -> Lowering | None:
    _FAMILIES.load()
    return LOWERINGS.get((normalize_domain(domain), op_type))


def lowerable_ops() -> list[tuple[str, str]]:
    """(domain, op_type) of every op this pass can lower."""
    _FAMILIES.load()
    return sorted(LOWERINGS)


FAMILIES = ("attention", "conv", "elementwise", "indexing", "loss", "matmul", "norm", "reduction", "shape")


_FAMILIES = Families("gradgen.passes.lowering", FAMILIES)


# ================================================================================ the pass


class LowerToStandardPass(ir.passes.InPlacePass):
    """Replace every com.microsoft gradient op by standard ONNX ops (in place).

    Works on any backward graph (gradgen's or ONNX Runtime training's), subgraphs included.
    Raises ``UnsupportedOpsError`` (a ``ModelError``) listing every non-standard op it cannot lower.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        functions = {(normalize_domain(f.domain), f.name, f.overload) for f in model.functions.values()}
        targets = self._targets(model, functions)
        if not targets:
            modified = _drop_unused_microsoft(model)
            return ir.passes.PassResult(model, modified=modified)

        need = max(lookup_lowering(n.domain, n.op_type).min_opset(n) for n in targets)
        if default_opset(model, 1) < need:
            _convert_opset(model, need)
            targets = self._targets(model, functions)

        names = graph_names(model.graph)
        constants: dict[int, dict[tuple, ir.Value]] = {}
        removal = NodeRemoval()  # one Graph.remove per graph: each call copies the graph outputs
        for node in targets:
            if node.op_type in schemas.SCHEMAS and normalize_domain(node.domain) == MICROSOFT:
                schemas.check_node(node.op_type, len(node.inputs), len(node.outputs), node.attributes, node_where(node))
            builder = GraphBuilder(
                node.graph,
                default_opset(model, 1),
                names=names,
                constants=constants.setdefault(id(node.graph), {}),
                prefix=f"{node.name or node.op_type}/lowered",
                const_prefix="gradgen/lower_const",
                append=False,
            )
            lowering = lookup_lowering(node.domain, node.op_type)
            splice(builder, node, list(lowering.fn(builder, node)), removal)
        removal.flush()
        _drop_unused_microsoft(model)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _targets(model: ir.Model, functions: set) -> list[ir.Node]:
        targets, missing = [], []
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.domain in STANDARD_DOMAINS or (normalize_domain(node.domain), node.op_type, node.overload) in functions:
                continue
            if lookup_lowering(node.domain, node.op_type) is None:
                missing.append((normalize_domain(node.domain), node.op_type, node_name(node)))
            else:
                targets.append(node)
        if missing:
            raise UnsupportedOpsError("a lowering to standard ONNX (portable mode)", missing)
        return targets


def _convert_opset(model: ir.Model, target: int) -> None:
    """Convert the model to default-domain opset ``target`` with ONNX's version converter."""
    current = default_opset(model, 1)
    try:
        converted = onnx.version_converter.convert_version(ir.to_proto(model), target)
    except Exception as exc:  # noqa: BLE001 (the converter raises many kinds)
        raise ModelError(
            f"portable mode needs opset {target} (the model has {current}) and ONNX's version converter "
            f"could not convert the model: {exc}"
        ) from None
    converted.ir_version = max(converted.ir_version, _ir_version_for(target))
    fresh = ir.from_proto(converted)
    model.graph = fresh.graph
    model.ir_version = fresh.ir_version


def _ir_version_for(opset: int) -> int:
    for entry in onnx.helper.VERSION_TABLE:
        if entry[2] == opset:
            return entry[1]
    return 8


def _drop_unused_microsoft(model: ir.Model) -> bool:
    if MICROSOFT not in model.opset_imports:
        return False
    used = any(n.domain == MICROSOFT for n in ir.traversal.RecursiveGraphIterator(model.graph))
    used = used or any(n.domain == MICROSOFT for f in model.functions.values() for n in f)
    if used:
        return False
    model.opset_imports.pop(MICROSOFT)
    return True


# ================================================================================ splicing


def splice(builder: GraphBuilder, node: ir.Node, outputs: Sequence[ir.Value | None], removal: NodeRemoval | None = None) -> None:
    """Put the builder's nodes where ``node`` was; its outputs' users read the new values, which take
    the old names and types (graph outputs keep their names). ``node`` goes into ``removal`` where
    one is given (the caller flushes it), else out of its graph at once."""
    olds, news = [], []
    for i, old in enumerate(node.outputs):
        new = outputs[i] if i < len(outputs) else None
        if not is_needed(old):
            continue
        if new is None:
            raise ModelError(
                f"lowering {node.op_type} node {node.name!r}: output {old.name!r} is used "
                "but the lowering produced nothing for it"
            )
        if new.producer() is None or new.producer() not in builder.node_set:
            new = builder.op("Identity", new)
        olds.append(old)
        news.append(new)
    for old, new in zip(olds, news):
        name = old.name
        builder.reserve(name)
        old.name = builder.unique(f"{name}/replaced")
        new.name = name
        if old.type is not None:
            new.type = old.type
        if old.shape is not None:
            new.shape = old.shape
    for old, new in zip(olds, news):
        replace_uses(old, new)
    if builder.nodes:
        node.graph.insert_before(node, builder.nodes)
    if removal is not None:
        removal.remove(node)
    else:
        node.graph.remove(node, safe=True)
