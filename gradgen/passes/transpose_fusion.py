"""TransposeFusionPass: matrix transposes folded into the GEMMs that read or make them.

An exported Linear layer multiplies by ``Transpose(W)`` (PyTorch's legacy exporter keeps the
transpose of every weight as a node), and the gradient of that Transpose transposes ``dW^T`` back:
two copies of every weight matrix per training step (GPT-2 small: 98 Transpose nodes, about 1 GB
copied). After the gradient pass this pass rewrites, in the main graph:

- a ``Transpose(W)`` of a matrix read by a Gemm: the Gemm reads W with its transpose flag flipped;
- read by a MatMul: a com.microsoft FusedMatMul with the flag set (ONNX Runtime's op, which its
  CPU provider runs; ``--portable`` lowers it back), except where the other operand is a vector
  and W would be A (ONNX Runtime's CPU kernel gets that form wrong);
- a ``Transpose`` of a Gemm's product (no C, nothing else reading it): the Gemm with its operands
  swapped and flags flipped, since (op(A) op(B))^T = op(B)^T op(A)^T.

A Transpose whose readers all went is removed. Values keep their names, types and shapes.
"""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import graph_names
from gradgen.names import unique_name
from gradgen.ops.schemas import MICROSOFT_DOMAIN, MICROSOFT_OPSET
from gradgen.passes.rewrite import NodeRemoval, replace_uses

_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16})


def _rank(value: ir.Value | None) -> int | None:
    return None if value is None or value.shape is None else len(value.shape)


def _int_attr(node: ir.Node, name: str, default: int = 0) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _is_matrix_transpose(node: ir.Node) -> bool:
    """A Transpose swapping the two axes of a matrix (a Gemm's product is one even when its value is untyped)."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return False
    x = node.inputs[0]
    producer = x.producer()
    is_matrix = _rank(x) == 2 or (producer is not None and producer.op_type == "Gemm" and producer.domain in ("", "ai.onnx"))
    perm = node.attributes.get("perm")
    return is_matrix and (perm is None or list(perm.value) == [1, 0])


def _is_plain_product(node: ir.Node) -> bool:
    """A Gemm without C whose one output only this pass's caller reads."""
    return node.op_type == "Gemm" and node.domain in ("", "ai.onnx") and (len(node.inputs) < 3 or node.inputs[2] is None)


class TransposeFusionPass(ir.passes.InPlacePass):
    """Fold matrix transposes into Gemm flags and FusedMatMul (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        self._names = graph_names(graph)
        self._removal = NodeRemoval()
        modified = False
        for node in list(graph):
            if node not in self._removal and _is_matrix_transpose(node):
                modified |= self._fold_product_into_gemm(graph, node) or self._fold_into_readers(model, node)
        self._removal.flush()
        return ir.passes.PassResult(model, modified=modified)

    def _fold_into_readers(self, model: ir.Model, transpose: ir.Node) -> bool:
        w, out = transpose.inputs[0], transpose.outputs[0]
        if out.is_graph_output() or w.dtype not in _FLOATS:
            return False
        changed = False
        for reader, index in list(out.uses()):
            if reader.domain not in ("", "ai.onnx") or index > 1:
                continue
            if reader.op_type == "Gemm":
                flag = "transA" if index == 0 else "transB"
                reader.replace_input_with(index, w)
                reader.attributes[flag] = ir.AttrInt64(flag, 1 - _int_attr(reader, flag))
                changed = True
            elif reader.op_type == "MatMul":
                other_rank = _rank(reader.inputs[1 - index])
                if other_rank is None or (index == 0 and other_rank < 2):
                    continue
                inputs = [w, reader.inputs[1]] if index == 0 else [reader.inputs[0], w]
                flag = "transA" if index == 0 else "transB"
                self._replace(
                    reader,
                    ir.Node(
                        MICROSOFT_DOMAIN,
                        "FusedMatMul",
                        inputs,
                        [ir.AttrInt64(flag, 1)],
                        name=unique_name(f"{reader.name or 'MatMul'}/fused_transpose", self._names),
                    ),
                )
                model.opset_imports.setdefault(MICROSOFT_DOMAIN, MICROSOFT_OPSET)
                changed = True
        if changed and not out.uses():
            self._removal.remove(transpose)
        return changed

    def _fold_product_into_gemm(self, graph: ir.Graph, transpose: ir.Node) -> bool:
        product = transpose.inputs[0].producer()
        made = transpose.inputs[0]
        if (
            product is None
            or product.graph is not graph
            or product in self._removal
            or not _is_plain_product(product)
            or made.is_graph_output()
        ):
            return False
        if len(made.uses()) != 1:
            return False
        a, b = product.inputs[0], product.inputs[1]
        attrs = [
            ir.AttrInt64("transA", 1 - _int_attr(product, "transB")),
            ir.AttrInt64("transB", 1 - _int_attr(product, "transA")),
        ]
        alpha = product.attributes.get("alpha")
        if alpha is not None:
            attrs.append(ir.AttrFloat32("alpha", float(alpha.value)))
        swapped = ir.Node("", "Gemm", [b, a], attrs, name=unique_name(f"{product.name or 'Gemm'}/transposed", self._names))
        self._replace(transpose, swapped)
        self._removal.remove(product)
        return True

    def _replace(self, old: ir.Node, new: ir.Node) -> None:
        """Put ``new`` where ``old`` was; its output takes the old output's name, type, shape and readers."""
        old_out, new_out = old.outputs[0], new.outputs[0]
        name = old_out.name
        old_out.name = unique_name(f"{name}/replaced", self._names)
        new_out.name = name
        new_out.type, new_out.shape = old_out.type, old_out.shape
        old.graph.insert_before(old, new)
        replace_uses(old_out, new_out)
        self._removal.remove(old)
