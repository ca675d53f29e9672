"""Det: the CPU kernel and its gradient (the cofactor matrix) against torch.linalg.det and
torch.autograd (finite differences: tests/grad_cases/matmul.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

torch = pytest.importorskip("torch")
rng = np.random.default_rng(99)


@pytest.mark.parametrize("shape", [(3, 3), (2, 4, 4), (2, 3, 2, 2), (5, 5)])
def test_det_vs_torch(shape):
    inputs = {"a": rng.normal(size=shape)}
    got, w = run_gradgen("Det", inputs, {}, {}, [shape[:-2]])
    assert_close(got, torch_grads(lambda a: torch.linalg.det(a), inputs, w), rtol=1e-9, atol=1e-10)
    forward = Session(_det_model([*shape], TensorProto.DOUBLE)).run(inputs)["d"]
    np.testing.assert_allclose(forward, torch.linalg.det(torch.tensor(inputs["a"])).numpy(), rtol=1e-12)


def _cofactors(a: np.ndarray) -> np.ndarray:
    """C[i, j] = (-1)^(i + j) det(a without row i and column j): det's gradient, singular a too."""
    n = a.shape[0]
    minor = lambda i, j: np.linalg.det(np.delete(np.delete(a, i, axis=0), j, axis=1))  # noqa: E731
    return np.array([[(-1) ** (i + j) * minor(i, j) for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("seed", range(6))
def test_det_gradient_of_a_singular_matrix_is_its_cofactors(seed):
    """Against the cofactors themselves: torch's LU-based backward gives zeros for about a third of
    such exactly singular matrices (58 of 200 draws with torch 2.13), so it is no reference here."""
    a = np.random.default_rng(seed).normal(size=(3, 3))
    a[2] = a[0] - a[1]
    got, w = run_gradgen("Det", {"a": a}, {}, {}, [()])
    assert np.abs(got["a"]).max() > 0.1
    np.testing.assert_allclose(got["a"], _cofactors(a) * np.asarray(w[0]), rtol=1e-9, atol=1e-10)


def _det_model(dims, dtype):
    graph = helper.make_graph(
        [helper.make_node("Det", ["a"], ["d"], name="det")],
        "det",
        [helper.make_tensor_value_info("a", dtype, dims)],
        [helper.make_tensor_value_info("d", dtype, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_det_of_a_matrix_of_unknown_size_is_a_model_error():
    model = _det_model(["n", "m", "m"], TensorProto.DOUBLE)
    model.graph.node.append(helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    with pytest.raises(gradgen.ModelError, match="Det node 'det': its gradient needs the matrix size"):
        gradgen.build_backward(model, wrt_inputs=True)


def test_det_kernel_refuses_non_square_matrices():
    with pytest.raises(gradgen.RunError, match="Det.*square matrices"):
        Session(_det_model([2, 3], TensorProto.DOUBLE)).run({"a": np.zeros((2, 3))})
