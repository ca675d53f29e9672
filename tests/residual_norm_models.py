"""A pre-norm residual block whose backward graph holds Sum(LayerNormalizationGrad's dX, residual)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import gradgen


def pre_norm_block(rows: int = 6, cols: int = 40, seed: int = 0, layers: int = 2):
    """(backward model, feeds): ``layers`` blocks h = h + LayerNorm(h) @ W_i, loss = sum(h * h); the
    starting h is a parameter, so every block's input gradient is the residual Sum."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((rows, cols)).astype(np.float32), "h0")]
    nodes = []
    h = "h0"
    for i in range(layers):
        inits += [
            numpy_helper.from_array((1 + 0.1 * rng.standard_normal(cols)).astype(np.float32), f"g{i}"),
            numpy_helper.from_array((0.1 * rng.standard_normal(cols)).astype(np.float32), f"b{i}"),
            numpy_helper.from_array((rng.standard_normal((cols, cols)) / np.sqrt(cols)).astype(np.float32), f"w{i}"),
        ]
        nodes += [
            helper.make_node("LayerNormalization", [h, f"g{i}", f"b{i}"], [f"n{i}"], axis=-1, epsilon=1e-5),
            helper.make_node("MatMul", [f"n{i}", f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [h, f"m{i}"], [f"h{i + 1}"]),
        ]
        h = f"h{i + 1}"
    nodes += [helper.make_node("Mul", [h, h], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "pre_norm", [], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    wrt = [t.name for t in inits]
    return gradgen.build_backward(model, wrt=wrt).model, {}
