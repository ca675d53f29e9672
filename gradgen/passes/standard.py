"""Passes around the gradient pass: opset upgrade, topological sort, shape inference, clean-up."""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes import common as ir_common

from gradgen import custom_ops
from gradgen.errors import KernelError, ModelError
from gradgen.evaluate import RANDOM_OPS
from gradgen.model_io import copy_model, default_opset
from gradgen.names import node_names, unique_name
from gradgen.ops.einsum import parse_equation
from gradgen.ops.schemas import MICROSOFT_DOMAIN, normalize_domain
from gradgen.passes.rewrite import NodeRemoval

# The gradient rules emit ops in their opset-14+ forms (axes as inputs, Reshape's allowzero, ...).
MIN_OPSET = 14
UPGRADE_TO = 17
# Ops ONNX retired, and what the opset conversion writes in their place (``gradgen ops`` says so).
RETIRED_OPS = {"Upsample": "Resize"}


class UpgradeOpsetPass(ir.passes.InPlacePass):
    """Convert models below opset 14 to opset 17 with ONNX's version converter (in place)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        opset = default_opset(model)
        if opset >= MIN_OPSET:
            return ir.passes.PassResult(model, modified=False)
        proto = ir.to_proto(model)
        training_batch_norms = _training_batch_norms_with_three_outputs(proto.graph)
        if opset < 7:
            proto = _align_legacy_broadcasts(proto)
        try:
            converted = _convert_version(proto, UPGRADE_TO)
        except Exception as exc:
            raise ModelError(
                f"the model's opset {opset} is below {MIN_OPSET} and could not be converted to {UPGRADE_TO}: {exc}"
            ) from None
        if opset < 7:
            _channel_slopes(converted.graph)
        _refuse_changed_interface(proto.graph, converted.graph, opset)
        _exact_shape_reshapes(converted.graph)
        _in_training_mode(converted.graph, training_batch_norms)
        if opset < 11:  # every Resize now was an Upsample or a Resize-10
            _asymmetric_resizes(converted.graph)
        model.graph = ir.from_proto(converted).graph
        return ir.passes.PassResult(model, modified=True)


# Ops whose opset-1..6 forms broadcast B onto A from ``axis`` when broadcast=1
_LEGACY_BROADCAST_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less"})


def _align_legacy_broadcasts(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` where each broadcast=1 binary op with an ``axis`` has none left: where B,
    placed at ``axis``, ends before A's last axis, it reads B through an Unsqueeze of the trailing
    axes, and opset 7's broadcasting then lines them up. ONNX's converter asserts on such ops
    instead (a per-channel bias: A (N, C, H, W), B (C,), axis 1: "Dimension 0 of input 2 does not
    match dimension 0 of input 1"), and on a negative axis. Ops whose ranks inference cannot tell
    stay as they are."""
    legacy = [
        node
        for node in proto.graph.node
        if node.op_type in _LEGACY_BROADCAST_OPS
        and node.domain in ("", "ai.onnx")
        and len(node.input) == 2
        and any(a.name == "broadcast" and a.i == 1 for a in node.attribute)
        and any(a.name == "axis" for a in node.attribute)
    ]
    if not legacy:
        return proto
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception:  # noqa: BLE001 - the converter reports what is wrong with the model
        return proto
    ranks = {t.name: len(t.dims) for t in inferred.graph.initializer}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            ranks[value.name] = len(value.type.tensor_type.shape.dim)
    aligned = onnx.ModelProto()
    aligned.CopyFrom(proto)
    taken = {name for node in aligned.graph.node for name in [*node.input, *node.output]} | set(ranks)
    nodes = []
    for node in aligned.graph.node:
        trailing = _trailing_axes(node, ranks) if node.op_type in _LEGACY_BROADCAST_OPS else None
        if trailing is not None and trailing >= 0:
            if trailing:
                rank_b = ranks[node.input[1]]
                name = unique_name(f"{node.input[1]}_aligned", taken)
                axes = list(range(rank_b, rank_b + trailing))
                nodes.append(onnx.helper.make_node("Unsqueeze", [node.input[1]], [name], name=name, axes=axes))
                node.input[1] = name
            kept = [a for a in node.attribute if a.name != "axis"]
            del node.attribute[:]
            node.attribute.extend(kept)
        nodes.append(node)
    del aligned.graph.node[:]
    aligned.graph.node.extend(nodes)
    return aligned


def _trailing_axes(node: onnx.NodeProto, ranks: dict[str, int]) -> int | None:
    """How many of A's axes come after B's when B is placed at the node's ``axis`` (negative: B
    does not fit; None: not a legacy broadcast along an axis, or the ranks are unknown)."""
    attrs = {a.name: a.i for a in node.attribute}
    rank_a, rank_b = ranks.get(node.input[0]), ranks.get(node.input[1])
    if attrs.get("broadcast") != 1 or "axis" not in attrs or rank_a is None or rank_b is None:
        return None
    axis = attrs["axis"] + rank_a if attrs["axis"] < 0 else attrs["axis"]
    return rank_a - axis - rank_b


_PLACEHOLDER_DIM = 1_000_003  # far from any real size; the k-th symbol stands as this + 2k


def _convert_version(proto: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """ONNX's version converter, also for models with symbolic dims (a batch "N"): its broadcast
    adapters assert that every dim is a number, so where it refuses such a model, each symbol
    stands as a distinct placeholder number while it converts, and the symbols are put back after.
    Refused (the converter's own error) where the placeholders reached a constant of the graph."""
    try:
        return onnx.version_converter.convert_version(proto, target)
    except Exception as exc:
        symbols = _dim_symbols(proto.graph)
        if not symbols:
            raise
        refused = exc
    numbered = onnx.ModelProto()
    numbered.CopyFrom(proto)
    by_number = {_PLACEHOLDER_DIM + 2 * k: symbol for k, symbol in enumerate(symbols)}
    by_symbol = {symbol: number for number, symbol in by_number.items()}
    for dim in _declared_dim_protos(numbered.graph):
        if dim.HasField("dim_param") and dim.dim_param in by_symbol:
            dim.dim_value = by_symbol[dim.dim_param]
    try:
        converted = onnx.version_converter.convert_version(numbered, target)
    except Exception:
        raise refused from None
    if _constants_hold(converted.graph, set(by_number)):
        raise refused
    for dim in _declared_dim_protos(converted.graph):
        if dim.HasField("dim_value") and dim.dim_value in by_number:
            dim.dim_param = by_number[dim.dim_value]
    return converted


def _declared_dim_protos(graph: onnx.GraphProto) -> list:
    return [
        dim
        for value in [*graph.input, *graph.output, *graph.value_info]
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape")
        for dim in value.type.tensor_type.shape.dim
    ]


def _dim_symbols(graph: onnx.GraphProto) -> list[str]:
    return list(dict.fromkeys(d.dim_param for d in _declared_dim_protos(graph) if d.HasField("dim_param") and d.dim_param))


def _constants_hold(graph: onnx.GraphProto, numbers: set[int]) -> bool:
    """Whether an initializer or an attribute of ``graph`` (small integer tensors and int lists
    only: where a dim would go) holds one of ``numbers``."""
    tensors = list(graph.initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                tensors.append(attribute.t)
            if attribute.HasField("i") and attribute.i in numbers or numbers & set(attribute.ints):
                return True
    for tensor in tensors:
        if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and np.prod(tensor.dims) <= 64:
            if numbers & set(onnx.numpy_helper.to_array(tensor).reshape(-1).tolist()):
                return True
    return False


def converted_below(model: ir.Model, opset: int = MIN_OPSET) -> ir.Model:
    """``model`` itself where its default-domain opset is ``opset`` or later, else a copy converted
    by UpgradeOpsetPass (whose ModelError says why a conversion is refused)."""
    if default_opset(model, opset) >= opset:
        return model
    upgraded = copy_model(model)
    UpgradeOpsetPass()(upgraded)
    return upgraded


def _channel_slopes(graph: onnx.GraphProto) -> None:
    """PRelu below opset 7 applies a 1-D slope of C values per channel (axis 1); opset 7's
    broadcasting aligns it with the last axis, and the converter leaves it as it is. A slope
    initializer of X's channel count, for an X of known rank above 2, is reshaped to (C, 1, ...)
    by a Reshape in front of the PRelu (the initializer itself, maybe also a graph input, stays)."""
    declared = {v.name: _declared_dims(v) for v in [*graph.input, *graph.value_info]}
    initializers = {t.name: t for t in graph.initializer}
    taken = {name for node in graph.node for name in [*node.input, *node.output]} | set(initializers)
    nodes = []
    for node in graph.node:
        is_prelu = node.op_type == "PRelu" and node.domain in ("", "ai.onnx") and len(node.input) == 2
        x_dims = (declared.get(node.input[0]) or []) if is_prelu else []
        slope = initializers.get(node.input[1]) if is_prelu else None
        one_per_channel = slope is not None and len(slope.dims) == 1 and len(x_dims) > 2
        if one_per_channel and (not isinstance(x_dims[1], int) or x_dims[1] == slope.dims[0]):  # a symbol or None: unknown
            shape_name = unique_name(f"{slope.name}_channel_shape", taken)
            per_channel = unique_name(f"{slope.name}_per_channel", taken)
            shape = [slope.dims[0]] + [1] * (len(x_dims) - 2)
            graph.initializer.append(onnx.numpy_helper.from_array(np.array(shape, np.int64), shape_name))
            nodes.append(onnx.helper.make_node("Reshape", [slope.name, shape_name], [per_channel], name=per_channel))
            node.input[1] = per_channel
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)


def _declared_dims(value: onnx.ValueInfoProto) -> list | None:
    return _dims_or_none(value.type.tensor_type) if value.type.HasField("tensor_type") else None


def _same_dims(old: list, new: list) -> bool:
    """Same rank, and no fixed size changed (a renamed or dropped symbol is the same shape)."""
    return len(old) == len(new) and all(
        not (isinstance(a, int) and isinstance(b, int) and a and b and a != b) for a, b in zip(old, new)
    )


def _refuse_changed_interface(before: onnx.GraphProto, after: onnx.GraphProto, opset: int) -> None:
    """The converted graph must take and give what the user's model does: the converter turns a
    Scan of opset 8 (with a batch axis) into opset 9's, batch axis dropped from the graph's inputs
    and outputs, so the user's inputs would no longer fit."""
    converted = {v.name: _declared_dims(v) for v in [*after.input, *after.output]}
    for value in [*before.input, *before.output]:
        old, new = _declared_dims(value), converted.get(value.name)
        if old is not None and new is not None and not _same_dims(old, new):
            raise ModelError(
                f"the model's opset {opset} is below {MIN_OPSET}, and converting it to {UPGRADE_TO} changes the shape of "
                f"{value.name!r} from {old} to {new} (a Scan below opset 9 has a batch axis): export the model at "
                f"opset {MIN_OPSET} or later"
            )


def _training_batch_norms_with_three_outputs(graph: onnx.GraphProto) -> set[str]:
    """A training-mode BatchNormalization below opset 14 has five outputs (Y, the running mean and
    variance, the saved batch mean and inverse deviation); opset 14 has only the first three and a
    training_mode attribute, and the converter refuses the others. PyTorch's training-mode exports
    leave the last two unread: they are dropped (one that is read stays, and the converter says
    so). Returns the Y names of the nodes changed, which ``_in_training_mode`` marks after the
    conversion (the converter leaves training_mode out: inference mode, another function)."""
    read = _names_read(graph)
    changed = set()
    for node in _all_nodes(graph):
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and len(node.output) == 5:
            if not any(name and name in read for name in node.output[3:]):
                del node.output[3:]
                changed.add(node.output[0])
    return changed


def _in_training_mode(graph: onnx.GraphProto, outputs: set[str]) -> None:
    for node in _all_nodes(graph):
        if node.op_type == "BatchNormalization" and node.output and node.output[0] in outputs:
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("training_mode", 1)])


def _all_nodes(graph: onnx.GraphProto):
    """The nodes of ``graph`` and of every subgraph in it."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _all_nodes(sub)


def _names_read(graph: onnx.GraphProto) -> set[str]:
    """Every value name a node (in any subgraph too) reads, and the graph's outputs."""
    return {name for node in _all_nodes(graph) for name in node.input} | {v.name for v in graph.output}


def _asymmetric_resizes(graph: onnx.GraphProto) -> None:
    """Upsample (to opset 9) and Resize-10 map output positions to input ones asymmetrically
    (x_in = x_out / scale; nearest takes the floor, as gradgen's Resize-10 kernel and PyTorch's
    nearest do). The converter writes them as Resize with the later defaults (half_pixel,
    round_prefer_floor), another function: the nodes, in this graph and its subgraphs, get the
    earlier ones back."""
    for node in _all_nodes(graph):
        if node.op_type != "Resize":
            continue
        names = {a.name for a in node.attribute}
        if "coordinate_transformation_mode" not in names:
            node.attribute.append(onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
        if "nearest_mode" not in names:
            node.attribute.append(onnx.helper.make_attribute("nearest_mode", "floor"))


def _exact_shape_reshapes(graph: onnx.GraphProto) -> None:
    """The converter restores shapes with Reshape(y, Shape(x)) (Softmax-11 -> 13, for instance);
    without allowzero=1 a 0 in that shape (an empty tensor) reads as "copy this dimension"."""
    shapes = {out for node in graph.node if node.op_type == "Shape" for out in node.output}
    for node in graph.node:
        if (
            node.op_type == "Reshape"
            and len(node.input) > 1
            and node.input[1] in shapes
            and not any(a.name == "allowzero" for a in node.attribute)
        ):
            node.attribute.append(onnx.helper.make_attribute("allowzero", 1))


class ShapeInferencePass(ir.passes.InPlacePass):
    """ONNX shape inference (with data propagation) written back onto the model's values.

    Only types and shapes travel back (by value name): cheaper than rebuilding the whole model
    from the inferred protobuf, and types already set (e.g. on com.microsoft outputs) are kept
    where inference knows nothing.
    """

    def __init__(self, check_declared: bool = False) -> None:
        super().__init__()
        self.check_declared = check_declared  # a declared type or shape that inference contradicts is a ModelError

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        inferred, corrected = _infer_shapes(_proto_without_weights(model), self.check_declared)
        values = _values_by_name(model.graph)
        modified = False
        for info in list(inferred.graph.value_info) + list(inferred.graph.output):
            value = values.get(info.name)
            if value is None or not info.type.HasField("tensor_type"):
                continue
            elem_type = info.type.tensor_type.elem_type
            if value.type is None and elem_type:
                value.type = ir.TensorType(ir.DataType(elem_type))
                modified = True
            if value.shape is not None and value.shape.is_static() and info.name not in corrected:
                continue  # nothing is more specific than a static shape: skip deserialising it
            shape = _inferred_shape(info.type)
            if shape is not None and (value.shape is None or info.name in corrected or _more_specific(shape, value.shape)):
                value.shape = shape
                modified = True
        modified = _types_from_schemas(model) or modified
        if custom_ops.type_custom_outputs(model.graph):  # registered custom ops: infer once more past them
            return ir.passes.PassResult(self.call(model).model, modified=True)
        return ir.passes.PassResult(model, modified=modified)


# ONNX Runtime training registers these in the ONNX domain, where ONNX defines nothing of that
# name: output 0 takes the element type of the input at the given position (dY)
_ORT_ONNX_DOMAIN_OPS = {"MaxPoolGrad": 0, "AveragePoolGrad": 0}


def _types_from_schemas(model: ir.Model) -> bool:
    """Element types ONNX's inference leaves unknown (ops without an inference function, such as
    GroupNormalization-18) from the op's schema: an output typed like an input (the same type
    variable, e.g. T) takes that input's element type."""
    opset = default_opset(model)
    modified = False
    for node in model.graph:
        outputs = [o for o in node.outputs if o.name and o.type is None]
        if outputs and normalize_domain(node.domain) == MICROSOFT_DOMAIN:
            modified = _types_from_microsoft_schema(node, outputs) or modified
            continue
        if not outputs or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in _ORT_ONNX_DOMAIN_OPS:  # ONNX Runtime training's ops that ONNX does not define
            typed_like = node.inputs[_ORT_ONNX_DOMAIN_OPS[node.op_type]]
            if typed_like is not None and typed_like.type is not None and node.outputs[0] in outputs:
                node.outputs[0].type = typed_like.type
                modified = True
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset)
        except Exception:
            continue
        known = {}
        for formal, value in zip(schema.inputs, node.inputs):
            if value is not None and value.type is not None:
                known.setdefault(formal.type_str, value.type)
        for formal, value in zip(schema.outputs, node.outputs):
            if value in outputs and formal.type_str in known:
                value.type = known[formal.type_str]
                modified = True
    return modified


def _types_from_microsoft_schema(node: ir.Node, outputs: list[ir.Value]) -> bool:
    """Types (and shapes, where the schema tells them) of a com.microsoft node's untyped ``outputs``
    from gradgen's schema of the op (ONNX has none); nothing for an op gradgen does not know or
    inputs its schema refuses (the run says why)."""
    from gradgen.ops import schemas
    from gradgen.ops.attributes import node_attributes

    if node.op_type not in schemas.SCHEMAS:
        return False
    infos = [None if v is None else schemas.TensorInfo(v.dtype, _known_dims(v)) for v in node.inputs]
    try:
        inferred = schemas.output_types(node.op_type, infos, node_attributes(node))
    except Exception:  # noqa: BLE001 -- a node the schema refuses is reported when it runs
        return False
    modified = False
    for value, (dtype, shape) in zip(node.outputs, inferred):
        if value in outputs and dtype is not None:
            value.type = ir.TensorType(ir.DataType(int(dtype)))
            if value.shape is None and shape is not None and all(isinstance(d, int) for d in shape):
                value.shape = ir.Shape(list(shape))
            modified = True
    return modified


def _known_dims(value: ir.Value) -> tuple | None:
    """value's shape with a symbolic dimension as None; None where even the rank is unknown."""
    return None if value.shape is None else tuple(d if isinstance(d, int) else None for d in value.shape)


_POOL_OPS = ("MaxPool", "AveragePool", "LpPool")
# ops whose output shape gradgen's kernels decide where ONNX's inference disagrees: pooling with
# ceil_mode (before opset 22), ConvTranspose with output_shape values of 1 (inference drops them)
_SHAPE_RULE_OPS = (*_POOL_OPS, "ConvTranspose")


def _static_dims(tensor_type) -> list[int] | None:
    if (
        tensor_type is None
        or not tensor_type.HasField("shape")
        or not all(d.HasField("dim_value") for d in tensor_type.shape.dim)
    ):
        return None
    return [d.dim_value for d in tensor_type.shape.dim]


# Initializers above this size travel to ONNX shape inference as typed graph inputs, without data:
# it needs only their types and shapes (data propagation reads small integer tensors), and
# serialising the weights cost seconds and a copy of the model per inference.
_INFERENCE_DATA_LIMIT = 1024


def inferred_element_types(model: ir.Model) -> dict[str, int]:
    """The element types ONNX's inference gives the values of ``model``'s graph, by name (the
    model is not changed; a ModelError where inference fails)."""
    inferred, _ = _infer_shapes(_proto_without_weights(model))
    return {
        info.name: info.type.tensor_type.elem_type
        for info in inferred.graph.value_info
        if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type
    }


def _proto_without_weights(model: ir.Model) -> onnx.ModelProto:
    """``model`` as a ModelProto in which large initializers are typed inputs without data.

    The model is serialised through a view of its graph (nothing of it is changed, except that a
    large initializer without a type or shape gets the one of its tensor), and the small
    initializers are written as plain TensorProtos: onnx-ir's general tensor serialiser cost more
    than inference on graphs with thousands of folded shape constants. Initializers nothing reads
    are left out.
    """
    graph = model.graph
    small, large = [], []
    for value in graph.initializers.values():
        if not value.uses() and not value.is_graph_output() and not value.is_graph_input():
            continue  # read by nothing (a link of a folded chain): no shape depends on it
        tensor = value.const_value
        if tensor is not None and tensor.nbytes > _INFERENCE_DATA_LIMIT:
            if value.shape is None:
                value.shape = ir.Shape(tensor.shape)
            if value.type is None:
                value.type = ir.TensorType(tensor.dtype)
            large.append(value)
        else:
            small.append(value)
    inputs = list(graph.inputs)
    listed = set(inputs)
    view = ir.GraphView(
        [*inputs, *(v for v in large if v not in listed)],
        graph.outputs,
        nodes=graph,
        name=graph.name,
        opset_imports=graph.opset_imports,
    )
    proto = ir.to_proto(ir.Model(view, ir_version=model.ir_version, functions=list(model.functions.values())))  # type: ignore[arg-type]
    _add_small_initializers(proto.graph, small, listed)
    return proto


def _plain_bytes(tensor) -> bool:
    """An in-memory tensor whose numpy bytes are its ONNX raw_data (no strings, no sub-byte types)."""
    return (
        isinstance(tensor, (ir.Tensor, ir.serde.TensorProtoTensor))
        and tensor.dtype != ir.DataType.STRING
        and tensor.dtype.bitwidth % 8 == 0
    )


def _add_small_initializers(graph: onnx.GraphProto, values: list[ir.Value], inputs: set[ir.Value]) -> None:
    """Append ``values`` (initializers) to ``graph``: their data, and the value_info that onnx-ir
    writes for an initializer that is not a graph input."""
    for value in values:
        if value not in inputs and (value.type is not None or value.shape is not None):
            ir.serde.serialize_value_into(graph.value_info.add(), value)
        tensor = value.const_value
        if tensor is None:
            continue
        if _plain_bytes(tensor):
            array = tensor.numpy()
            graph.initializer.append(
                onnx.TensorProto(name=value.name, data_type=int(tensor.dtype), dims=array.shape, raw_data=array.tobytes())
            )
        else:  # strings, sub-byte types, external data: onnx-ir's serialiser
            tensor.name = value.name
            ir.serde.serialize_tensor_into(graph.initializer.add(), tensor)


_TYPE_CONFLICT = re.compile(r"Inferred elem type differs from existing elem type: \((\d+)\) vs \((\d+)\)")
# a declared shape that differs (not "Incompatible dimensions" of operands: ONNX's inference reports
# it on valid models too, downstream of shapes it gets wrong, e.g. after Attention-23)
_SHAPE_CONFLICTS = ("Inferred shape and existing shape differ",)
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _strict_inference(proto: onnx.ModelProto, data_prop: bool) -> tuple[onnx.ModelProto | None, list[str]]:
    """ONNX's strict inference of ``proto``: (its result, []) where it reports nothing (the
    non-strict run's result too), else (None, the conflicts it reports between the types and
    shapes the model declares and those its nodes compute, where gradgen would build wrong
    gradients from them). Those are: a float value declared as an integer (or the reverse: whether
    it is differentiable) and a static shape that differs (a [3] declared [1]). Float-to-float
    differences are left alone (gradgen's kernels follow their inputs, as some exporters declare),
    and so are outputs of the ops whose shapes gradgen's own rules decide (pooling, ConvTranspose)."""
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=True, data_prop=data_prop), []
    except Exception as exc:  # noqa: BLE001 -- InferenceError, or anything the non-strict run reports
        conflicts = []
        for line in (line.strip() for line in str(exc).splitlines()):
            if any(f"op_type:{op}" in line for op in _SHAPE_RULE_OPS):
                continue
            types = _TYPE_CONFLICT.search(line)
            if any(c in line for c in _SHAPE_CONFLICTS) or (
                types and (int(types[1]) in _FLOAT_TYPES) != (int(types[2]) in _FLOAT_TYPES)
            ):
                conflicts.append(line)
        return None, conflicts


def _reads_shapes(proto: onnx.ModelProto) -> bool:
    """Whether ONNX's data propagation has anything to start from: a Shape or Size node (folding has
    already turned constant shape arithmetic into initializers, which inference reads anyway).
    Without one it is skipped: on a chain of 1-D Concats it propagates every element, and its time
    doubled with each Concat (0.45 s for 20 Concats of floats, over 60 s and 14.5 GB for 25)."""
    return any(node.op_type in ("Shape", "Size") for node in _all_nodes(proto.graph))


def _refuse_conflicts(conflicts: list[str]) -> None:
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise ModelError(f"the model declares a type or shape its nodes do not compute: {conflicts[0]}{more}")


def _infer_shapes(proto: onnx.ModelProto, check_declared: bool = False) -> tuple[onnx.ModelProto, set[str]]:
    """ONNX shape inference, with pooling and ConvTranspose outputs set by gradgen's shape rules.

    Before opset 22, ONNX's inference keeps a ceil_mode window that starts past the input (e.g.
    kernel 1, stride 2 on 2 elements gives 2 outputs; the kernels, PyTorch and ONNX Runtime give 1),
    and it drops ConvTranspose output_shape values of 1 (a rank-2 output). Such outputs are declared
    with the right shape and inference runs again, so that everything downstream (and the gradients
    built from these shapes) sees the shape the kernels produce. ``check_declared``: the first run
    is strict, to refuse declarations the nodes contradict (``_strict_inference``); where shapes
    were corrected, what it found is judged again with the corrections declared.
    Returns the inferred model and the names of the corrected values.
    """
    _check_einsum_equations(proto.graph)
    data_prop = _reads_shapes(proto)
    strict, conflicts = _strict_inference(proto, data_prop) if check_declared else (None, [])
    corrected: dict[str, onnx.ValueInfoProto] = {}
    # Each round settles at least the first pool (in graph order) still wrong, so this ends.
    for _ in range(2 + sum(node.op_type in (*_SHAPE_RULE_OPS, "Attention") for node in proto.graph.node)):
        if strict is not None and not corrected:
            inferred = strict
        else:
            try:
                inferred = onnx.shape_inference.infer_shapes(
                    _declare(proto, corrected.values()), check_type=False, strict_mode=False, data_prop=data_prop
                )
            except Exception as exc:
                raise ModelError(f"ONNX shape inference failed on the model: {exc}") from None
        fixes = _pool_shape_fixes(inferred) + _attention_shape_fixes(inferred)
        if not fixes:
            break
        corrected.update((info.name, info) for info in fixes)
    if conflicts and corrected:  # perhaps only downstream of a shape ONNX's inference got wrong
        conflicts = _strict_inference(_declare(proto, corrected.values()), data_prop)[1]
    _refuse_conflicts(conflicts)
    return inferred, set(corrected)


def _check_einsum_equations(graph: onnx.GraphProto) -> None:
    """A malformed Einsum equation is a ModelError naming the node: ONNX's shape inference loops
    forever on some (a stray '.' or '-', as in 'i.j->i')."""
    for node in graph.node:
        if node.op_type == "Einsum" and node.domain in ("", "ai.onnx"):
            equation = next((a.s.decode(errors="replace") for a in node.attribute if a.name == "equation"), None)
            if equation is None:
                raise ModelError(f"Einsum node {node.name!r} has no equation attribute")
            try:
                parse_equation(equation, len(node.input))
            except KernelError as exc:
                raise ModelError(f"Einsum node {node.name!r}: {exc}") from None
        for attribute in node.attribute:
            for subgraph in [attribute.g] if attribute.HasField("g") else list(attribute.graphs):
                _check_einsum_equations(subgraph)


def _declare(proto: onnx.ModelProto, infos) -> onnx.ModelProto:
    """A copy of ``proto`` whose graph declares the types ``infos`` (replacing earlier declarations)."""
    infos = {info.name: info for info in infos}
    if not infos:
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    graph = copy.graph
    for output in graph.output:
        if output.name in infos:
            output.type.CopyFrom(infos[output.name].type)
    kept = [v for v in graph.value_info if v.name not in infos]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    outputs = {o.name for o in graph.output}
    graph.value_info.extend(info for name, info in infos.items() if name not in outputs)
    hidden = [n for n in graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx") and set(n.output) & set(infos)]
    for node in hidden:  # ONNX's inference would write its own shapes over the declared ones
        node.domain = _UNINFERRED_DOMAIN
    if hidden:
        copy.opset_import.append(onnx.helper.make_opsetid(_UNINFERRED_DOMAIN, 1))
    return copy


# A domain ONNX's inference knows nothing of: a node moved there keeps its outputs' declared shapes
_UNINFERRED_DOMAIN = "gradgen.uninferred"


def _attention_shape_fixes(inferred: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Outputs of Attention nodes (top-level graph) whose inferred shape has a size ONNX's
    inference read from a symbolic dim as 0: a 3-D V's hidden size (in Y's last dim) and the key
    length (in qk_matmul_output's last dim). Declared with that dim unknown (or the sum it is, where
    the sizes are numbers), they are kept by moving the node out of inference's sight (``_declare``)."""
    graph = inferred.graph
    nodes = [n for n in graph.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")]
    if not nodes:
        return []
    types = _tensor_types(graph)
    fixes = []
    for node in nodes:
        wanted = _attention_output_dims(node, [_dims_or_none(types.get(name)) for name in node.input])
        outputs = {k: name for k, name in enumerate(node.output) if name}
        if not any(_contradicts(_dims_or_none(types.get(outputs.get(k, ""))), dims) for k, dims in wanted.items()):
            continue
        elem = types[node.input[0]].elem_type
        for k, name in outputs.items():  # all of them: the node will be hidden from inference
            if k in wanted:
                fixes.append(onnx.helper.make_tensor_value_info(name, elem, wanted[k]))
            elif name in types:
                fixes.append(onnx.helper.make_value_info(name, onnx.TypeProto(tensor_type=types[name])))
    return fixes


def _contradicts(inferred: list | None, wanted: list) -> bool:
    """Whether an inferred shape holds a number where ``wanted`` has another (or none)."""
    return (
        inferred is not None
        and len(inferred) == len(wanted)
        and any(isinstance(have, int) and have != want for have, want in zip(inferred, wanted))
    )


def _dims_or_none(tensor_type) -> list | None:
    """A type's dims (a number, a symbol's name, or None where unknown); None without a shape."""
    if tensor_type is None or not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim]


def _attention_output_dims(node: onnx.NodeProto, dims: list) -> dict[int, list]:
    """What Attention's Y (0) and qk_matmul_output (3) are, by output index, from its inputs'
    dims (see ``_dims_or_none``), where the ranks of Q and V are known and alike."""
    q, v = dims[0], dims[2] if len(dims) > 2 else None
    if q is None or v is None or len(q) != len(v) or len(q) not in (3, 4):
        return {}
    attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
    past = dims[4] if len(dims) > 4 else None
    kv_length = v[1] if len(v) == 3 else v[2]
    past_length = 0 if len(node.input) < 5 or not node.input[4] else (past[2] if past is not None and len(past) == 4 else None)
    total = kv_length + past_length if isinstance(kv_length, int) and isinstance(past_length, int) else None
    if len(q) == 4:
        return {0: [q[0], q[1], q[2], v[3]], 3: [q[0], q[1], q[2], total]}
    q_heads, kv_heads = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
    if not q_heads or not kv_heads:
        return {}
    hidden = q_heads * (v[2] // kv_heads) if isinstance(v[2], int) else None
    return {0: [q[0], q[1], hidden], 3: [q[0], q_heads, q[1], total]}


def _tensor_types(graph: onnx.GraphProto, names: set[str] | None = None) -> dict:
    """The tensor types of ``graph``'s inputs, values, outputs and initializers by name (only those
    of ``names`` where given: a whole-graph table can cost more than inference)."""
    types = {
        v.name: v.type.tensor_type
        for v in [*graph.input, *graph.value_info, *graph.output]
        if (names is None or v.name in names) and v.type.HasField("tensor_type")
    }
    for t in graph.initializer:
        if names is None or t.name in names:
            types[t.name] = onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)).tensor_type
    return types


def _pool_shape_fixes(inferred: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Outputs of pools and ConvTransposes (top-level graph) whose inferred shape differs from the
    shape gradgen's kernels produce."""
    from gradgen.errors import KernelError
    from gradgen.ops.conv import conv_transpose_geometry
    from gradgen.ops.pool import pool_output_shape

    graph = inferred.graph
    rule_nodes = [n for n in graph.node if n.op_type in _SHAPE_RULE_OPS and n.domain in ("", "ai.onnx") and n.input]
    if not rule_nodes:
        return []
    # the types of these nodes' inputs and outputs only (a whole-graph table cost more than inference)
    wanted = {name for n in rule_nodes for name in [*n.input[:2], *n.output[:2]]}
    types = _tensor_types(graph, wanted)
    fixes = []
    for node in rule_nodes:
        static = [_static_dims(types.get(name)) for name in node.input[:2]]
        if static[0] is None or len(static[0]) < 3:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        try:
            if node.op_type == "ConvTranspose":
                if (
                    static[1] is None
                    or len(static[1]) != len(static[0])
                    or not ("output_shape" in attrs or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"))
                ):
                    continue
                group = int(attrs.get("group", 1))
                out = conv_transpose_geometry(static[0], static[1], attrs)[2]
                want = [static[0][0], static[1][1] * group, *out]
            else:
                want = pool_output_shape(static[0], attrs)
        except KernelError:  # an invalid geometry: the kernel reports it when the node runs
            continue
        for k, name in enumerate(node.output[:2]):
            have = types.get(name)
            dims = (
                [d.dim_value if d.HasField("dim_value") else None for d in have.shape.dim]
                if have is not None and have.HasField("shape")
                else None
            )
            if name and dims != want:
                elem = (
                    onnx.TensorProto.INT64
                    if k == 1
                    else (have.elem_type if have is not None and have.elem_type else types[node.input[0]].elem_type)
                )
                fixes.append(onnx.helper.make_tensor_value_info(name, elem, want))
    return fixes


def _inferred_shape(type_proto: onnx.TypeProto) -> ir.Shape | None:
    """``ir.serde.deserialize_type_proto_for_shape`` of a tensor type, the same Shape, built directly
    where every dimension is a plain number (most of them after folding): onnx-ir's general
    deserialiser was a third of the pass on thousands of values."""
    tensor_type = type_proto.tensor_type
    if tensor_type.HasField("shape"):
        dims = tensor_type.shape.dim
        if all(d.HasField("dim_value") and not d.denotation for d in dims):
            return ir.Shape([d.dim_value for d in dims], frozen=True)
    return ir.serde.deserialize_type_proto_for_shape(type_proto)


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
        not isinstance(n, int) and n.value and not isinstance(o, int) and not o.value for n, o in zip(new, old)
    )


class NameNodesPass(ir.passes.InPlacePass):
    """Give every unnamed node a name (``<op_type>_<index>``) so errors can point at it."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node, name in node_names(model.graph).items():  # the names a session's errors use too
            if node.name != name:
                node.name = name
                modified = True
        return ir.passes.PassResult(model, modified=modified)


class TopologicalSortPass(ir_common.TopologicalSortPass):
    """onnx-ir's stable topological sort, skipped for a graph already in order (what exporters
    write): the stable sort leaves such a graph as it is, and checking is a fraction of sorting."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not model.functions and _in_order(model.graph):
            return ir.passes.PassResult(model, modified=False)
        return super().call(model)


def _in_order(graph: ir.Graph) -> bool:
    """Whether every node of ``graph`` comes after the producers of its inputs (False for a graph
    with subgraphs, which the sort orders with their own rules)."""
    seen: set[ir.Node] = set()
    for node in graph:
        for attr in node.attributes.values():
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                return False
        for value in node.inputs:
            if value is not None:
                producer = value.producer()
                if producer is not None and producer not in seen:
                    return False
        seen.add(node)
    return True


RemoveUnusedNodesPass = ir_common.RemoveUnusedNodesPass


class CommonSubexpressionEliminationPass(ir_common.CommonSubexpressionEliminationPass):
    """onnx-ir's common-subexpression elimination (the same nodes merged, the same way) with the
    merged nodes removed in one ``Graph.remove`` (``NodeRemoval``): onnx-ir's removes them one
    call at a time, and each call copies the graph outputs (one per parameter after the gradient
    pass: a third of the pass on a 48-layer GPT-2)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        return ir.passes.PassResult(model, modified=self._eliminate(model.graph))

    def _eliminate(self, graph: ir.Graph) -> bool:
        removal = NodeRemoval()
        seen: dict[tuple, ir.Node] = {}
        for node in graph:
            key = self._node_key(node)
            if key is None:
                continue
            existing = seen.setdefault(key, node)
            if existing is not node:
                _merge_into(graph, node, existing, removal)
        modified = bool(removal)
        removal.flush()
        return modified

    def _node_key(self, node: ir.Node) -> tuple | None:
        """What makes two nodes the same computation (op, output count, input values,
        attributes); None for nodes never merged: subgraphs, large tensor attributes, random ops."""
        if node.op_type in RANDOM_OPS and node.domain == "":
            return None
        attributes = {}
        for name, attr in node.attributes.items():
            value = attr.value
            if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                return None
            if attr.type in (ir.AttributeType.INTS, ir.AttributeType.FLOATS, ir.AttributeType.STRINGS):
                value = tuple(value)
            elif attr.type is ir.AttributeType.TENSOR:
                if value.size > self.size_limit:
                    return None
                array = value.numpy()
                value = (array.shape, str(array.dtype), array.tobytes())
            attributes[name] = value
        return (
            node.op_identifier(),
            len(node.outputs),
            tuple(id(v) for v in node.inputs),
            tuple(sorted(attributes.items())),
        )


def _merge_into(graph: ir.Graph, node: ir.Node, existing: ir.Node, removal: NodeRemoval) -> None:
    """Replace ``node`` by ``existing`` (same computation): a graph output of node's keeps its name
    (through an Identity where existing's output is itself a graph input or output)."""
    olds, news = node.outputs, existing.outputs
    if any(v.is_graph_output() for v in olds):
        replacements = dict(zip(olds, news))
        for index, output in enumerate(graph.outputs):
            if output not in replacements:
                continue
            new = replacements[output]
            if new.is_graph_output() or new.is_graph_input():
                identity = ir.node(
                    "Identity", inputs=[new], outputs=[ir.Value(name=output.name, type=output.type, shape=output.shape)]
                )
                graph.outputs[index] = identity.outputs[0]
                graph.insert_before(node, identity)
            else:
                new.name = output.name
                graph.outputs[index] = new
    ir.convenience.replace_all_uses_with(olds, news)
    removal.remove(node)


class CleanupPass(ir.passes.Sequential):
    """Drop dead nodes and merge duplicated subexpressions."""

    def __init__(self):
        super().__init__(CommonSubexpressionEliminationPass(), RemoveUnusedNodesPass())
