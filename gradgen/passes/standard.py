"""Passes around the gradient pass: opset upgrade, topological sort, shape inference, clean-up."""

from __future__ import annotations

import onnx
import onnx_ir as ir
from onnx_ir.passes import common as ir_common

from gradgen.errors import ModelError

# The gradient rules emit ops in their opset-13+ forms (axes as inputs, ...).
MIN_OPSET = 13
UPGRADE_TO = 17


class UpgradeOpsetPass(ir.passes.InPlacePass):
    """Convert models below opset 13 to opset 17 with ONNX's version converter (in place)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
        if opset >= MIN_OPSET:
            return ir.passes.PassResult(model, modified=False)
        try:
            converted = onnx.version_converter.convert_version(ir.to_proto(model), UPGRADE_TO)
        except Exception as exc:
            raise ModelError(f"the model's opset {opset} is below {MIN_OPSET} and could not be converted to "
                             f"{UPGRADE_TO}: {exc}") from None
        model.graph = ir.from_proto(converted).graph
        return ir.passes.PassResult(model, modified=True)


class ShapeInferencePass(ir.passes.InPlacePass):
    """ONNX shape inference (with data propagation); keeps the types gradgen set on its own ops."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir_common.ShapeInferencePass(check_type=False, strict_mode=False, data_prop=True)(model)


class NameNodesPass(ir.passes.InPlacePass):
    """Give every unnamed node a name (``<op_type>_<index>``) so errors can point at it."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        taken = {node.name for node in model.graph if node.name}
        modified = False
        for index, node in enumerate(model.graph):
            if not node.name:
                name = f"{node.op_type}_{index}"
                while name in taken:
                    name += "_"
                node.name = name
                taken.add(name)
                modified = True
        return ir.passes.PassResult(model, modified=modified)


TopologicalSortPass = ir_common.TopologicalSortPass
RemoveUnusedNodesPass = ir_common.RemoveUnusedNodesPass
CommonSubexpressionEliminationPass = ir_common.CommonSubexpressionEliminationPass


class CleanupPass(ir.passes.Sequential):
    """Drop dead nodes and merge duplicated subexpressions."""

    def __init__(self):
        super().__init__(CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass())
