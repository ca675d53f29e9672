"""CUDA launchers for CumSum, DepthToSpace, SpaceToDepth, PRelu and Dropout against the CPU kernels."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.executor import Session

pytestmark = pytest.mark.cuda
rng = np.random.default_rng(7)


def _one_node(op, inputs: dict, consts: dict, attrs: dict, num_outputs: int = 1):
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
                    for n, a in inputs.items()]
    outputs = [f"y{k}" for k in range(num_outputs)]
    node = helper.make_node(op, list(inputs) + list(consts), outputs, **attrs)
    graph = helper.make_graph([node], op, graph_inputs,
                              [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
                              initializer=[numpy_helper.from_array(a, n) for n, a in consts.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _same_on_both(model, feeds, rtol=1e-6):
    want = Session(model).run(feeds)
    got = Session(model, device="cuda").run(feeds)
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32])
@pytest.mark.parametrize("shape,axis", [((5, 7, 3), 1), ((5, 7, 3), -1), ((4,), 0), ((0, 3), 1), ((3, 1, 2), 1)])
@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(dtype, shape, axis, exclusive, reverse):
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    model = _one_node("CumSum", {"x": x}, {"axis": np.array(axis, np.int64)}, {"exclusive": exclusive, "reverse": reverse})
    _same_on_both(model, {"x": x}, rtol=1e-5)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(mode):
    x = rng.standard_normal((2, 8, 3, 5)).astype(np.float32)
    _same_on_both(_one_node("DepthToSpace", {"x": x}, {}, {"blocksize": 2, "mode": mode}), {"x": x})
    y = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    _same_on_both(_one_node("SpaceToDepth", {"x": y}, {}, {"blocksize": 2}), {"x": y})


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (4,), ()])
def test_prelu(slope_shape):
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    slope = rng.standard_normal(slope_shape).astype(np.float32)
    _same_on_both(_one_node("PRelu", {"x": x}, {"slope": slope}, {}), {"x": x})


def test_dropout_inference_with_mask():
    x = rng.standard_normal((3, 4)).astype(np.float32)
    model = _one_node("Dropout", {"x": x}, {"ratio": np.array(0.5, np.float32)}, {}, num_outputs=2)
    _same_on_both(model, {"x": x})
