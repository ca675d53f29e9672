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
    """ONNX shape inference (with data propagation) written back onto the model's values.

    Only types and shapes travel back (by value name): cheaper than rebuilding the whole model
    from the inferred protobuf, and types already set (e.g. on com.microsoft outputs) are kept
    where inference knows nothing.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        proto = ir.to_proto(model)
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
        except Exception as exc:
            raise ModelError(f"ONNX shape inference failed on the model: {exc}") from None
        values = _values_by_name(model.graph)
        modified = False
        for info in list(inferred.graph.value_info) + list(inferred.graph.output):
            value = values.get(info.name)
            if value is None or not info.type.HasField("tensor_type"):
                continue
            shape = ir.serde.deserialize_type_proto_for_shape(info.type)
            elem_type = info.type.tensor_type.elem_type
            if value.type is None and elem_type:
                value.type = ir.TensorType(ir.DataType(elem_type))
                modified = True
            if shape is not None and (value.shape is None or _more_specific(shape, value.shape)):
                value.shape = shape
                modified = True
        return ir.passes.PassResult(model, modified=modified)


def _values_by_name(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs}
    for node in graph:
        for out in node.outputs:
            if out.name:
                values[out.name] = out
    return values


def _more_specific(new: ir.Shape, old: ir.Shape) -> bool:
    """True when ``new`` knows a dimension ``old`` does not (same rank), or ``old`` has a different rank."""
    if len(new) != len(old):
        return False
    return any(isinstance(n, int) and not isinstance(o, int) for n, o in zip(new, old)) or any(
        not isinstance(n, int) and n.value and not isinstance(o, int) and not o.value for n, o in zip(new, old))


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
