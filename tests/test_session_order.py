"""The Session's step order: shape reads move up to their input's producer, so a late Shape in the
backward does not keep a forward value alive."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from gradgen.executor import Session


def _late_shape_model():
    """big = x * x is used once, then its shape is read at the end (as a backward graph's
    un-broadcasting does); y = reshape(sum(big) + x, shape(big))."""
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["big"], name="square"),
        helper.make_node("ReduceSum", ["big"], ["total"], keepdims=1, name="sum"),
        helper.make_node("Add", ["x", "total"], ["shifted"], name="shift"),
        helper.make_node("Neg", ["shifted"], ["neg"], name="neg"),
        helper.make_node("Shape", ["big"], ["big_shape"], name="late_shape"),
        helper.make_node("Size", ["neg"], ["count"], name="late_size"),
        helper.make_node("Shape", ["big_shape"], ["rank"], name="shape_of_shape"),
        helper.make_node("Reshape", ["neg", "big_shape"], ["y"], name="reshape"),
    ]
    graph = helper.make_graph(
        nodes,
        "late_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8]),
            helper.make_tensor_value_info("count", TensorProto.INT64, []),
            helper.make_tensor_value_info("rank", TensorProto.INT64, [1]),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_late_shape_read_runs_right_after_its_input_is_made():
    session = Session(_late_shape_model())
    order = [step.node_name for step in session.steps]
    assert order == ["square", "late_shape", "shape_of_shape", "sum", "shift", "neg", "late_size", "reshape"]
    died = {name: step.node_name for step in session.steps for name in step.free_after}
    assert died["big"] == "sum"  # not kept until the reshape at the end
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    out = session.run({"x": x})
    np.testing.assert_array_equal(out["y"], -(x + (x * x).sum()))
    assert int(out["count"]) == 32 and out["rank"].tolist() == [2]
