"""CenterCropPad: the CPU kernel against ONNX Runtime and ONNX's reference evaluator, its gradient
against torch.autograd of F.pad with the same centred (negative or positive) padding (finite
differences: tests/grad_cases/shape.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

rng = np.random.default_rng(18)
CASES = [((5, 6), (3, 9), None), ((2, 5, 6), (4, 3), [1, 2]), ((2, 5, 6), (7,), [-1]), ((4, 4, 3), (4, 1), [0, 1])]


@pytest.mark.parametrize("x_shape,sizes,axes", CASES)
def test_kernel_matches_onnxruntime_and_the_reference(x_shape, sizes, axes):
    ort = pytest.importorskip("onnxruntime")
    x = rng.normal(size=x_shape).astype(np.float32)
    node = helper.make_node("CenterCropPad", ["x", "s"], ["y"], **({} if axes is None else {"axes": axes}))
    graph = helper.make_graph(
        [node],
        "crop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("s", TensorProto.INT64, [len(sizes)], list(sizes))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, {"x": x})[0])
    np.testing.assert_array_equal(got, ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0])


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("x_shape,sizes,axes", CASES)
def test_gradient_matches_torch_pad(x_shape, sizes, axes, symbolic):
    torch = pytest.importorskip("torch")
    inputs = {"x": rng.normal(size=x_shape)}
    chosen = [a % len(x_shape) for a in axes] if axes is not None else list(range(len(x_shape)))
    out_shape = list(x_shape)
    pads = [0] * (2 * len(x_shape))  # F.pad's order: last axis first, (before, after)
    for axis, size in zip(chosen, sizes):
        out_shape[axis] = size
        begin = (size - x_shape[axis]) // 2 if size > x_shape[axis] else -((x_shape[axis] - size) // 2)
        after = size - x_shape[axis] - begin
        slot = 2 * (len(x_shape) - 1 - axis)
        pads[slot], pads[slot + 1] = begin, after
    consts = {"sizes": np.array(sizes, dtype=np.int64)}
    attrs = {} if axes is None else {"axes": axes}
    got, w = run_gradgen("CenterCropPad", inputs, consts, attrs, [tuple(out_shape)], opset=18, symbolic=symbolic)
    assert_close(got, torch_grads(lambda x: torch.nn.functional.pad(x, pads), inputs, w))
