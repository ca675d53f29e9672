"""Tied weights the exporter wrote twice: find them, and tie them again on request.

A language model whose head shares its embedding matrix holds one parameter W used twice
(``Gather(W, ids)`` and ``h @ W^T``). PyTorch's exporters write the second use's operand as an
initializer of its own, W transposed (the legacy exporter's ``onnx::MatMul_*``, the dynamo
exporter's folded constant), so the ONNX model has two independent tensors: each gets its own
gradient, and PyTorch's gradient of W is their sum. ``equal_transposed_initializers`` finds such
pairs (2-D float initializers of transposed, different shapes holding transposed values);
``TieEqualWeightsPass`` replaces the copy by ``Transpose(W)`` so that W's gradient is the sum (the
transpose then folds into the GEMM's flag: no copy at run time).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, graph_names
from gradgen.model_io import default_opset

__all__ = ["TieEqualWeightsPass", "equal_transposed_initializers"]

MIN_ELEMENTS = 256  # smaller tensors may be equal by construction without being one parameter


def equal_transposed_initializers(graph: ir.Graph) -> list[tuple[str, str]]:
    """(W, copy) name pairs of 2-D float initializers where copy holds W transposed, W of shape
    (m, n) and copy of (n, m) with m != n (a square or constant tensor could match by chance);
    only tensors whose shapes pair up are read."""
    by_shape: dict[tuple[int, int], list[ir.Value]] = {}
    for value in graph.initializers.values():
        tensor = value.const_value
        if value.is_graph_input() or tensor is None or len(tensor.shape) != 2:
            continue
        rows, cols = tensor.shape.numpy()  # a tensor's shape is static
        if rows == cols or rows * cols < MIN_ELEMENTS or np.dtype(tensor.dtype.numpy()).kind != "f":
            continue
        by_shape.setdefault((int(rows), int(cols)), []).append(value)
    pairs = []
    order = None
    for (m, n), originals in by_shape.items():
        if m > n or (n, m) not in by_shape:
            continue  # each pair once: the (n, m) side is looked at from the (m, n) side
        # candidates by their corner values: a transposed copy's first row starts as the original's
        # first column does (one lookup per tensor, not a comparison per pair of them)
        candidates: dict[tuple, list[tuple[ir.Value, np.ndarray]]] = {}
        for b in by_shape[(n, m)]:
            y = _array(b)
            candidates.setdefault((y.dtype.str, y[0, 0].item(), y[0, -1].item()), []).append((b, y))
        for a in originals:
            x = _array(a)
            for b, y in candidates.get((x.dtype.str, x[0, 0].item(), x[-1, 0].item()), ()):
                if bool(np.ptp(x) > 0) and np.array_equal(x.T, y):
                    order = order or _use_order(graph)
                    first, second = sorted((a, b), key=order)
                    pairs.append((str(first.name), str(second.name)))
    return pairs


def _array(value: ir.Value) -> np.ndarray:
    assert value.const_value is not None
    return value.const_value.numpy()


def _use_order(graph: ir.Graph):
    """Sort key: the tensor read first in the graph comes first (the embedding, then the head)."""
    position = {}
    for index, node in enumerate(graph):
        for value in node.inputs:
            if value is not None and value.name not in position:
                position[value.name] = index
    return lambda value: position.get(value.name, len(position))


class TieEqualWeightsPass(ir.passes.InPlacePass):
    """Replace each transposed copy found by ``equal_transposed_initializers`` by a Transpose of its
    original, and drop the copy (``tie=True``); with ``tie=False`` only warn about each pair (the
    command line says it as a note), since two such tensors are most likely one tied parameter."""

    def __init__(self, tie: bool = True):
        super().__init__()
        self.tie = tie
        self.tied: list[tuple[str, str]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pairs = equal_transposed_initializers(graph)
        if not self.tie:
            for original_name, copy_name in pairs:
                warnings.warn(
                    f"initializers {original_name!r} and {copy_name!r} hold the same values ({copy_name!r} is "
                    f"{original_name!r} transposed): PyTorch's exporters write a tied weight (an LM head sharing its "
                    "embedding) twice, and each copy gets its own gradient; if they are one parameter, build with "
                    "--tie-weights (tie_weights=True)",
                    stacklevel=2,
                )
            return ir.passes.PassResult(model, modified=False)
        opset = default_opset(model, 14)
        names = graph_names(graph)
        for original_name, copy_name in pairs:
            original, copy = graph.initializers[original_name], graph.initializers[copy_name]
            b = GraphBuilder(graph, opset, names=names, prefix=f"{copy_name}/tied", append=False)
            tied = b.transpose(original, [1, 0])
            tied.type, tied.shape = copy.type, copy.shape
            if not copy.uses() or not len(graph):
                continue
            graph.insert_before(graph.node(0), b.nodes)  # it reads an initializer only: first is always in order
            copy.replace_all_uses_with(tied, replace_graph_outputs=True)
            graph.initializers.pop(copy_name)
            self.tied.append((original_name, copy_name))
        return ir.passes.PassResult(model, modified=bool(self.tied))
