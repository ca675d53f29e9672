"""The CUDA stack end to end on a tiny graph (runs only where a GPU answers)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.executor import Session

pytestmark = pytest.mark.cuda


def test_tiny_graph_matches_cpu():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((1, 4)).astype(np.float32)
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Sub", ["r", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 4)).astype(np.float32)
    want = Session(model).run({"x": x})["y"]
    got = Session(model, device="cuda").run({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-6)
