"""SequencesAsTensorsPass: rewrite ONNX sequences and optionals whose structure the model fixes
into the tensors they hold, so that the gradient rules and both executors (which hold tensors
only) see ordinary ops.

Exporters use sequences as lists built in a fixed way, and those lists are tensors in disguise:

- straight-line lists: ``SequenceEmpty`` / ``SequenceConstruct`` followed by ``SequenceInsert`` and
  ``SequenceErase`` at constant positions, and ``SplitToSequence`` whose pieces the shapes or the
  ``split`` input fix, are resolved to their elements; ``SequenceAt`` at a constant position
  becomes that element, ``SequenceLength`` a constant, ``ConcatFromSequence`` a ``Concat`` (of
  ``Unsqueeze``-d elements with ``new_axis=1``);
- a list appended to once per iteration of a ``Loop`` (PyTorch's dynamo exporter writes
  ``nn.EmbeddingBag`` and list-building Python loops so: a ``SequenceEmpty`` carried through the
  loop, one ``SequenceInsert`` at the end per iteration, a ``ConcatFromSequence`` after the loop)
  becomes a scan output of the loop, stacked along a new first axis, and the ``Concat`` of the
  elements a ``Transpose`` / ``Reshape`` of it. This needs every element to have the same shape,
  which the pass proves from the element's inferred shape (each dimension a number or a symbolic
  dimension of the model's inputs); a loop whose elements may differ keeps its sequence;
- ``SequenceMap`` over such lists: its body copied once per element (extra tensor inputs go to
  every copy), each output a list of the copies' results;
- ``OptionalGetElement`` / ``OptionalHasElement`` of an ``Optional`` node;
- where a list remains, the Loops of a constant trip count are unrolled (``UnrollLoopsPass``) and
  the straight-line lists they leave are resolved in turn.

What stays (a position computed at run time, a list whose length the data decides and that is
read element by element, ...) is refused by the gradient pass and the Session with one line
naming the nodes (gradgen/ops/non_tensor.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of, graph_names
from gradgen.model_io import default_opset
from gradgen.ops.attributes import get_attr
from gradgen.ops.non_tensor import NON_TENSOR_OPS, is_non_tensor_op
from gradgen.passes.control_flow import BodyCopier
from gradgen.passes.rewrite import STANDARD_DOMAINS, replace_node_outputs

__all__ = ["REWRITTEN_OPS", "SequencesAsTensorsPass"]

# The ops this pass turns into tensors where the model fixes the list (``gradgen ops`` says so).
REWRITTEN_OPS = NON_TENSOR_OPS


class SequencesAsTensorsPass(ir.passes.InPlacePass):
    """Resolve every sequence and optional whose structure is static into tensors (in place, in
    the main graph and in every subgraph); see the module docstring."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if not _holds_non_tensors(model):
            return ir.passes.PassResult(model, modified=False)
        modified = self._rewrite(model)
        if _holds_non_tensors(model):
            # A list a Loop of a constant trip count builds and then is read otherwise than by
            # ConcatFromSequence (the legacy exporter's torch.tensor_split): unrolled, the loop
            # leaves a straight-line list
            from gradgen.passes.control_flow import UnrollLoopsPass

            if UnrollLoopsPass()(model).modified:
                modified = self._rewrite(model) or True
        return ir.passes.PassResult(model, modified=modified)

    @staticmethod
    def _rewrite(model: ir.Model) -> bool:
        opset = default_opset(model, 14)
        modified = _rewrite_graph(model.graph, opset, graph_names(model.graph), _BodyTypes(model))
        if modified:
            from gradgen.passes.standard import ShapeInferencePass

            ShapeInferencePass()(model)
        return modified


def _holds_non_tensors(model: ir.Model) -> bool:
    return any(_is_non_tensor(node) for node in ir.traversal.RecursiveGraphIterator(model.graph))


def _is_non_tensor(node: ir.Node) -> bool:
    return is_non_tensor_op(node.domain, node.op_type)


def _rewrite_graph(graph: ir.Graph, opset: int, names: set[str], body_types: _BodyTypes) -> bool:
    """One graph's sequences (and, first, those of its nodes' subgraphs); True if anything changed."""
    modified = False
    for node in list(graph):
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                modified = _rewrite_graph(attr.value, opset, names, body_types) or modified
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    modified = _rewrite_graph(sub, opset, names, body_types) or modified
    rewriter = _Rewriter(graph, opset, names, body_types)
    for node in list(graph):
        if node.graph is not graph:  # removed by an earlier rewrite
            continue
        if node.domain in STANDARD_DOMAINS and node.op_type == "Loop":
            modified = rewriter.loop(node) or modified
        elif _is_non_tensor(node):
            modified = rewriter.consumer(node) or modified
    return _remove_dead(graph) or modified


class _Rewriter:
    def __init__(self, graph: ir.Graph, opset: int, names: set[str], body_types: _BodyTypes):
        self.graph, self.opset, self.names = graph, opset, names
        self.body_types = body_types
        self.constants: dict = {}
        self.resolved: dict[ir.Value, list[ir.Value] | None] = {}
        self.mapped: dict[ir.Node, list[list[ir.Value]] | None] = {}

    def builder(self, node: ir.Node) -> GraphBuilder:
        return GraphBuilder(
            self.graph, self.opset, names=self.names, constants=self.constants, prefix=node.name or node.op_type, append=False
        )

    # -- a sequence's elements ---------------------------------------------------------------
    def elements(self, value: ir.Value | None) -> list[ir.Value] | None:
        """The tensors a sequence value holds, in order, where the graph fixes them; else None."""
        if value is None:
            return None
        if value not in self.resolved:
            self.resolved[value] = self._resolve(value)
        return self.resolved[value]

    def _resolve(self, value: ir.Value) -> list[ir.Value] | None:
        node = value.producer()
        if node is None or node.graph is not self.graph or not _is_non_tensor(node):
            return None
        inputs = list(node.inputs)
        if node.op_type == "SequenceEmpty":
            return []
        if node.op_type == "SequenceConstruct":
            present = [v for v in inputs if v is not None]
            return present if len(present) == len(inputs) else None
        if node.op_type == "SequenceInsert":
            base, tensor, at = self.elements(inputs[0]), inputs[1], _input(node, 2)
            position = None if base is None else self._position(node, at, len(base), len(base), inclusive=True)
            return None if base is None or position is None or tensor is None else [*base[:position], tensor, *base[position:]]
        if node.op_type == "SequenceErase":
            base, at = self.elements(inputs[0]), _input(node, 1)
            position = None if base is None else self._position(node, at, len(base) - 1, len(base), inclusive=False)
            return None if base is None or position is None else [*base[:position], *base[position + 1 :]]
        if node.op_type == "SplitToSequence":
            return self._split(node)
        if node.op_type == "SequenceMap":
            lists = self._map(node)
            return None if lists is None else lists[list(node.outputs).index(value)]
        return None

    def _position(self, node: ir.Node, at: ir.Value | None, default: int, length: int, inclusive: bool) -> int | None:
        """A constant position in a list of ``length`` (negative counts from the end), or None."""
        if at is None:
            return default if default >= 0 else None
        known = self.builder(node).value_of(at)
        if known is None or known.size != 1:
            return None
        position = int(known.reshape(-1)[0])
        position += length if position < 0 else 0
        top = length if inclusive else length - 1
        return position if 0 <= position <= top else None

    def _split(self, node: ir.Node) -> list[ir.Value] | None:
        """SplitToSequence as a Split (and Squeeze when keepdims=0 without split) where the number of
        pieces is fixed: by a 1-D split of a static length (its sizes may come at run time), or by
        the split axis's static size."""
        x = node.inputs[0]
        split = node.inputs[1] if len(node.inputs) > 1 else None
        dims = dims_of(x) if x is not None else None
        if x is None or dims is None:
            return None
        axis = int(get_attr(node, "axis") or 0)
        axis += len(dims) if axis < 0 else 0
        b = self.builder(node)
        sizes = b.value_of(split) if split is not None else None
        size = dims[axis] if 0 <= axis < len(dims) else None
        if split is None:
            if not isinstance(size, int):
                return None
            pieces = b.op_multi("Split", [x, b.ints([1] * size)], size, axis=axis) if size else []
            if not int(get_attr(node, "keepdims", 1)):
                pieces = [b.squeeze(p, [axis]) for p in pieces]
        elif sizes is not None and sizes.ndim == 1:
            pieces = b.op_multi("Split", [x, b.ints(sizes.tolist())], len(sizes), axis=axis) if len(sizes) else []
        elif sizes is None and _static_length(split) is not None:  # sizes known at run time only, but how many
            count = _static_length(split)
            assert count is not None and split is not None
            pieces = b.op_multi("Split", [x, b.op("Cast", split, to=ir.DataType.INT64)], count, axis=axis) if count else []
        elif sizes is not None and sizes.ndim == 0 and isinstance(size, int) and int(sizes) > 0:
            chunk = int(sizes)
            lengths = [chunk] * (size // chunk) + ([size % chunk] if size % chunk else [])
            pieces = b.op_multi("Split", [x, b.ints(lengths)], len(lengths), axis=axis) if lengths else []
        else:
            return None
        self.graph.insert_after(node, b.nodes)
        return list(pieces)

    def _map(self, node: ir.Node) -> list[list[ir.Value]] | None:
        """SequenceMap's outputs, one list each, where every sequence it reads is resolved and of
        one length: the body copied once per position (a tensor input goes to every copy)."""
        if node not in self.mapped:
            self.mapped[node] = None  # also while resolving, so that a cycle cannot recurse
            per_input = [self._map_operand(value) for value in node.inputs]
            lengths = {len(items) for items in per_input if isinstance(items, list)}
            if all(items is not None for items in per_input) and len(lengths) == 1:
                self.mapped[node] = self._copy_body(node, per_input, lengths.pop())
        return self.mapped[node]

    def _map_operand(self, value: ir.Value | None) -> list[ir.Value] | ir.Value | None:
        """A SequenceMap input: its elements (a sequence), itself (a tensor), or None (unknown)."""
        if value is None:
            return None
        items = self.elements(value)
        if items is not None:
            return items
        producer = value.producer()
        sequence = isinstance(value.type, ir.SequenceType) or (producer is not None and _is_non_tensor(producer))
        return None if sequence else value

    def _copy_body(self, node: ir.Node, per_input: list, length: int) -> list[list[ir.Value]]:
        b = self.builder(node)
        copier = BodyCopier(node, b)
        lists: list[list[ir.Value]] = [[] for _ in node.outputs]
        for position in range(length):
            inputs = [items[position] if isinstance(items, list) else items for items in per_input]
            for results, value in zip(lists, copier.iteration(position, inputs)):
                results.append(value)
        self.graph.insert_after(node, b.nodes)
        return lists

    # -- nodes that read a sequence ------------------------------------------------------------
    def consumer(self, node: ir.Node) -> bool:
        """Replace a node that reads a resolved sequence (or an Optional node's value) by tensors."""
        b = self.builder(node)
        op = node.op_type
        if op in ("OptionalGetElement", "OptionalHasElement"):
            source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
            if source is None or source.op_type != "Optional" or source.domain not in STANDARD_DOMAINS:
                return False
            held = source.inputs[0] if source.inputs else None
            if op == "OptionalHasElement":
                result = b.const(np.array(held is not None))
            elif held is None:
                return False
            else:
                result = b.op("Identity", held)
            return self._replace(node, b, result)
        items = self.elements(node.inputs[0]) if node.inputs else None
        if items is None:
            return False
        if op == "SequenceLength":
            return self._replace(node, b, b.const(np.array(len(items), np.int64)))
        if op == "SequenceAt":
            position = self._position(node, node.inputs[1], -1, len(items), inclusive=False)
            return position is not None and self._replace(node, b, b.op("Identity", items[position]))
        if op == "ConcatFromSequence" and items:
            axis = int(get_attr(node, "axis"))
            if int(get_attr(node, "new_axis", 0)):
                rank = _rank(items[0])
                if rank is None:
                    return False
                axis += rank + 1 if axis < 0 else 0
                items = [b.unsqueeze(item, [axis]) for item in items]
            result = b.op("Concat", *items, axis=axis) if len(items) > 1 else b.op("Identity", items[0])
            return self._replace(node, b, result)
        return False

    def _replace(self, node: ir.Node, b: GraphBuilder, result: ir.Value) -> bool:
        self.graph.insert_before(node, b.nodes)
        replace_node_outputs(self.graph, node, [result])
        return True

    # -- a list appended to by a loop ------------------------------------------------------------
    def loop(self, node: ir.Node) -> bool:
        """Turn each loop-carried sequence that starts empty, gets one element appended per
        iteration and is read only by ConcatFromSequence after the loop into a scan output."""
        changed = False
        while True:
            index = next((k for k in range(len(node.inputs) - 2) if self._appended_list(node, k)), None)
            if index is None:
                return changed
            node = self._as_scan_output(node, index)
            changed = True

    def _appended_list(self, node: ir.Node, k: int) -> bool:
        body: ir.Graph = get_attr(node, "body")
        initial, state_in, state_out, result = node.inputs[2 + k], body.inputs[2 + k], body.outputs[1 + k], node.outputs[k]
        if self.elements(initial) != []:
            return False
        insert = state_out.producer()
        if (
            insert is None
            or insert.op_type != "SequenceInsert"
            or len([v for v in insert.inputs if v is not None]) != 2
            or insert.inputs[0] is not state_in
            or len(state_in.uses()) != 1
            or state_out.uses()  # read by nothing in the body: only carried to the next iteration
            or body.outputs.count(state_out) != 1
        ):
            return False
        element = insert.inputs[1]
        if element is None:
            return False
        if element.shape is None or element.type is None:
            self.body_types.type_value(element)
        readers = [use.node for use in result.uses()]
        if result.is_graph_output() or not readers:
            return False
        for reader in readers:
            if reader.op_type != "ConcatFromSequence" or reader.domain not in STANDARD_DOMAINS or reader.graph is not self.graph:
                return False
            if int(get_attr(reader, "axis")) != 0 and _rank(element) is None:
                return False  # the axis needs the element's rank, which the model does not say
        return True

    def _as_scan_output(self, node: ir.Node, k: int) -> ir.Node:
        """The loop without state k, whose appended element becomes its last scan output; the
        ConcatFromSequence nodes after it read that output instead."""
        body: ir.Graph = get_attr(node, "body")
        state_in, state_out = body.inputs[2 + k], body.outputs[1 + k]
        insert = state_out.producer()
        assert insert is not None
        element = insert.inputs[1]
        assert element is not None
        body.outputs.pop(1 + k)
        body.outputs.append(element)
        body.remove(insert, safe=True)
        body.inputs.pop(2 + k)
        assert not state_in.uses()
        b = self.builder(node)
        inputs = [v for i, v in enumerate(node.inputs) if i != 2 + k]
        old_outputs = list(node.outputs)
        del node.attributes["body"]  # the body moves to the new node
        new_outputs = b.op_multi("Loop", inputs, len(old_outputs), body=body)
        new_loop = b.nodes[0]
        self.graph.insert_before(node, b.nodes)
        # the old outputs but the list, in order, are the new ones but the last (the stacked elements)
        kept = new_outputs[:-1]
        for reader in [use.node for use in old_outputs[k].uses()]:
            self._concat_of_stacked(reader, new_outputs[-1], element)
        replacements: list[ir.Value | None] = list(kept)
        replacements.insert(k, None)
        replace_node_outputs(self.graph, node, replacements)
        return new_loop

    def _concat_of_stacked(self, reader: ir.Node, stacked: ir.Value, element: ir.Value) -> None:
        """ConcatFromSequence of the loop's elements, from their stack (iterations, *element): the
        stacked axis moved to ``axis`` (new_axis=1), or merged into the element's axis ``axis``.
        Axis 0 needs no rank (``_appended_list`` checked that the others have one)."""
        b = self.builder(reader)
        axis = int(get_attr(reader, "axis"))
        new_axis = bool(int(get_attr(reader, "new_axis", 0)))
        if axis:
            rank = _rank(element)
            assert rank is not None
            axis += (rank + 1 if new_axis else rank) if axis < 0 else 0
            moved = b.transpose(stacked, [*range(1, axis + 1), 0, *range(axis + 1, rank + 1)]) if axis else stacked
        else:
            moved = stacked
        if new_axis:
            result = moved if moved is not stacked else b.op("Identity", stacked)
        else:
            # (..., iterations, d_axis, ...) -> (..., iterations * d_axis, ...)
            target = b.op("Concat", b.op("Shape", moved, end=axis), b.ints([-1]), b.op("Shape", moved, start=axis + 2), axis=0)
            result = b.op("Reshape", moved, target)
        self._replace(reader, b, result)


class _BodyTypes:
    """Types and shapes of values inside loop bodies, from ONNX shape inference of a copy of the
    model whose loop bodies' untyped state inputs take the types of the loops' inputs (exporters
    leave them untyped, and inference then knows nothing inside the body). Computed once, when a
    value first asks; the model itself is not changed."""

    def __init__(self, model: ir.Model):
        self.model = model
        self._types: dict[str, onnx.TypeProto] | None = None

    def type_value(self, value: ir.Value) -> None:
        """Set ``value``'s type and shape where inference found them (it keeps what it has)."""
        if self._types is None:
            self._types = self._infer()
        found = self._types.get(value.name or "")
        if found is None or not found.HasField("tensor_type"):
            return
        if value.type is None and found.tensor_type.elem_type:
            value.type = ir.TensorType(ir.DataType(found.tensor_type.elem_type))
        shape = ir.serde.deserialize_type_proto_for_shape(found)
        if value.shape is None and shape is not None:
            value.shape = shape

    def _infer(self) -> dict[str, onnx.TypeProto]:
        from gradgen.passes.standard import _infer_shapes, _proto_without_weights

        proto = _proto_without_weights(self.model)
        try:
            outer, _ = _infer_shapes(proto)
        except Exception:  # noqa: BLE001 - no shapes: the loops keep their sequences
            return {}
        known = {info.name: info.type for info in [*outer.graph.value_info, *outer.graph.input, *outer.graph.output]}
        for tensor in outer.graph.initializer:
            known.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims)))
        for node in proto.graph.node:
            if node.op_type != "Loop":
                continue
            for attr in node.attribute:
                if attr.name == "body":
                    for name, formal in zip(node.input[2:], attr.g.input[2:]):
                        if not formal.type.WhichOneof("value") and name in known:
                            formal.type.CopyFrom(_without_shape(known[name]))
        try:
            inferred = onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
        except Exception:  # noqa: BLE001
            return {}
        types: dict[str, onnx.TypeProto] = {}
        _collect_subgraph_types(inferred.graph, types, top=True)
        return types


def _without_shape(type_proto: onnx.TypeProto) -> onnx.TypeProto:
    """The type alone: a loop-carried value's shape may change from one iteration to the next."""
    copy = onnx.TypeProto()
    copy.CopyFrom(type_proto)
    if copy.HasField("tensor_type"):
        copy.tensor_type.ClearField("shape")
    elif copy.HasField("sequence_type") and copy.sequence_type.elem_type.HasField("tensor_type"):
        copy.sequence_type.elem_type.tensor_type.ClearField("shape")
    return copy


def _collect_subgraph_types(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto], top: bool = False) -> None:
    if not top:
        for info in [*graph.value_info, *graph.output]:
            types[info.name] = info.type
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                _collect_subgraph_types(sub, types)


def _static_length(value: ir.Value | None) -> int | None:
    """The length of a 1-D value whose shape the model fixes, else None."""
    dims = dims_of(value) if value is not None else None
    return dims[0] if dims is not None and len(dims) == 1 and isinstance(dims[0], int) else None


def _input(node: ir.Node, index: int) -> ir.Value | None:
    """The node's input ``index``, None when it is omitted."""
    return node.inputs[index] if len(node.inputs) > index else None


def _rank(value: ir.Value) -> int | None:
    dims = dims_of(value)
    return None if dims is None else len(dims)


def _remove_dead(graph: ir.Graph) -> bool:
    """Drop sequence and optional nodes whose outputs nothing reads (last to first)."""
    removed = False
    for node in reversed(list(graph)):
        if _is_non_tensor(node) and all(not v.uses() and not v.is_graph_output() for v in node.outputs):
            graph.remove(node, safe=True)
            removed = True
    return removed
