"""An attention-style head split and its gradient's concat: Split -> Reshape -> Transpose per head
tensor, and Transpose -> Reshape -> Concat in the backward graph."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import gradgen


def attention_heads(batch: int = 2, seq: int = 5, heads: int = 3, size: int = 4, seed: int = 0):
    """(backward model, feeds): x an input, qkv = x @ W split into q, k, v, each (B, T, H, D) -> (B, H, T, D);
    loss = sum((q @ k^T) @ v)^2), so the backward graph concatenates the three head gradients."""
    rng = np.random.default_rng(seed)
    d = heads * size
    x = rng.standard_normal((batch, seq, d)).astype(np.float32)
    inits = [
        numpy_helper.from_array((rng.standard_normal((d, 3 * d)) / np.sqrt(d)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([batch, seq, heads, size], np.int64), "head_shape"),
        numpy_helper.from_array(np.array([split_size := d] * 3, np.int64), "sizes"),
    ]
    del split_size
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["qkv"]),
        helper.make_node("Split", ["qkv", "sizes"], ["q0", "k0", "v0"], axis=2),
    ]
    for name in ("q", "k", "v"):
        nodes += [
            helper.make_node("Reshape", [f"{name}0", "head_shape"], [f"{name}1"]),
            helper.make_node("Transpose", [f"{name}1"], [name], perm=[0, 2, 1, 3]),
        ]
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("MatMul", ["s", "v"], ["y"]),
        helper.make_node("Mul", ["y", "y"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "heads",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return gradgen.build_backward(model, wrt=["W"], wrt_inputs=True).model, {"x": x}
