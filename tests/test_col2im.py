"""Col2Im: the CPU kernel against ONNX Runtime, ONNX's reference evaluator and torch's fold; its
gradient against torch.autograd of fold (finite differences: tests/grad_cases/conv.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

rng = np.random.default_rng(21)
CASES = [
    ([5, 6], [2, 3], {}),
    ([6, 5], [3, 2], {"strides": [2, 1], "pads": [1, 1, 1, 1], "dilations": [1, 2]}),
    ([7, 4], [3, 1], {"strides": [2, 2], "pads": [0, 1, 0, 1]}),
]


def _columns(image, block, attrs, channels=2):
    nd = len(image)
    d, s, p = attrs.get("dilations", [1] * nd), attrs.get("strides", [1] * nd), attrs.get("pads", [0] * 2 * nd)
    count = math.prod((image[i] + p[i] + p[nd + i] - d[i] * (block[i] - 1) - 1) // s[i] + 1 for i in range(nd))
    return rng.normal(size=(2, channels * math.prod(block), count))


def _torch_fold(image, block, attrs):
    import torch

    nd = len(image)
    return lambda x: torch.nn.functional.fold(
        x,
        image,
        block,
        dilation=attrs.get("dilations", [1] * nd),
        padding=attrs.get("pads", [0] * 2 * nd)[:nd],
        stride=attrs.get("strides", [1] * nd),
    )


@pytest.mark.parametrize("image,block,attrs", CASES + [([4, 4, 3], [2, 2, 2], {}), ([7], [3], {"strides": [2]})])
def test_kernel_matches_onnxruntime_and_the_reference(image, block, attrs):
    ort = pytest.importorskip("onnxruntime")
    x = _columns(image, block, attrs).astype(np.float32)
    node = helper.make_node("Col2Im", ["x", "image", "block"], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        "col2im",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[
            helper.make_tensor("image", TensorProto.INT64, [len(image)], image),
            helper.make_tensor("block", TensorProto.INT64, [len(block)], block),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-6, atol=1e-6)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("image,block,attrs", CASES)
def test_kernel_and_gradient_match_torch_fold(image, block, attrs, symbolic):
    torch = pytest.importorskip("torch")
    inputs = {"x": _columns(image, block, attrs)}
    consts = {"image": np.array(image, dtype=np.int64), "block": np.array(block, dtype=np.int64)}
    fold = _torch_fold(image, block, attrs)
    out_shape = tuple(fold(torch.tensor(inputs["x"])).shape)
    got, w = run_gradgen("Col2Im", inputs, consts, attrs, [out_shape], opset=18, symbolic=symbolic)
    assert_close(got, torch_grads(fold, inputs, w))
