"""Einsum with any equation: diagonals, ellipsis anywhere, implicit output, on the CPU kernel and
through the gradient rule, against torch.einsum (forward and autograd). Finite differences of the
rule are in tests/grad_cases/matmul.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

import gradgen
from gradgen.errors import KernelError
from gradgen.kernels.cpu.matmul import einsum
from gradgen.ops.einsum import explicit_equation, parse_equation

torch = pytest.importorskip("torch")

FORWARD = [
    ("ii->i", [(3, 3)]),
    ("ii", [(3, 3)]),
    ("bii->b", [(2, 3, 3)]),
    ("iij->j", [(3, 3, 2)]),
    ("iii", [(2, 2, 2)]),
    ("i...i", [(3, 2, 4, 3)]),
    ("...ii->...i", [(2, 3, 3)]),
    ("...i->i", [(2, 3, 4)]),
    ("i...,i...->...", [(3, 2), (3, 1)]),
    ("...ij,jk", [(2, 3, 4), (4, 5)]),
    ("Ba,aB", [(2, 3), (3, 2)]),
    ("ij,ij->ij", [(3, 4), (3, 1)]),
]


@pytest.mark.parametrize("equation,shapes", FORWARD)
def test_kernel_matches_torch(equation, shapes):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=s) for s in shapes]
    want = torch.einsum(equation, *[torch.tensor(x) for x in xs]).numpy()
    got = einsum(*xs, equation=equation)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_diagonal_is_a_new_array_not_a_view_of_the_input():
    x = np.arange(9.0).reshape(3, 3)
    y = einsum(x, equation="ii->i")
    y[0] = 100.0
    assert x[0, 0] == 0.0


def test_implicit_output_and_ellipsis_are_made_explicit():
    parsed = parse_equation("b...ii, Bj", 2)
    assert str(parsed) == "b...ii,Bj->...Bbj"  # labels used once, ASCII order, after the ellipsis
    assert str(explicit_equation(parsed, [5, 2])) == "bACii,Bj->ACBbj"  # fresh letters skip the taken B


@pytest.mark.parametrize(
    "equation,shapes,message",
    [
        ("ij,jk->ik", [(2, 3)], "2 operand"),
        ("ijk->i", [(2, 3)], "does not fit its rank 2"),
        ("i......->i", [(2, 3)], "more than one ellipsis"),
        ("ii->i", [(2, 3)], "ii->i"),  # numpy's own message about the unequal diagonal, with the shapes
    ],
)
def test_kernel_refuses_with_a_clear_error(equation, shapes, message):
    with pytest.raises(KernelError, match=message):
        einsum(*[np.ones(s) for s in shapes], equation=equation)


class _Diagonals(torch.nn.Module):
    """What models write with einsum: a batched trace, a diagonal, an ellipsis contraction."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
        self.v = torch.nn.Parameter(torch.randn(4, 3, dtype=torch.float64))

    def forward(self, x):
        h = torch.einsum("...ij,jk->...ik", x, self.w)  # (N, 4, 4)
        trace = torch.einsum("bii->b", h)
        diag = torch.einsum("bii,ik->bk", h, self.v)
        return (trace**2).sum() + (diag.tanh()).sum() + torch.einsum("ii", self.w)


def test_exported_model_with_diagonals_builds_and_matches_torch(tmp_path):
    torch.manual_seed(0)
    model, x = _Diagonals(), torch.randn(2, 4, 4, dtype=torch.float64, requires_grad=True)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"], output_names=["loss"])
    assert {"bii->b", "bii,ik->bk", "ii"} <= {
        n.attribute[0].s.decode() for n in onnx.load(path).graph.node if n.op_type == "Einsum"
    }
    model(x).backward()
    built = gradgen.build_backward(str(path), wrt_inputs=True)
    got = gradgen.Session(built.model).run({"x": x.detach().numpy()})
    for name, want in {"x": x.grad, "w": model.w.grad, "v": model.v.grad}.items():
        np.testing.assert_allclose(got[f"{name}_grad"], want.numpy(), rtol=1e-10, atol=1e-10)


def test_large_diagonal_builds_its_identity_at_run_time():
    """Above 4,096 elements the identity matrix is not stored in the model (Range -> Equal)."""
    from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

    x = np.random.default_rng(1).normal(size=(2, 65, 65))
    got, w = run_gradgen("Einsum", {"x": x}, {}, {"equation": "bii->b"}, [(2,)])
    assert_close(got, torch_grads(lambda x: torch.einsum("bii->b", x), {"x": x}, w))


@pytest.mark.parametrize("equation", ["i.j->i", "i-j", "ij->k"])
def test_a_malformed_equation_is_one_error_before_shape_inference(equation, tmp_path, capsys, monkeypatch):
    """ONNX's shape inference never returns on some malformed equations ('i.j->i'): gradgen checks
    the equation first and names the node, in the API and as the CLI's one-line error (exit 3)."""
    from onnx import TensorProto, helper

    from tests.test_cli import run_cli

    graph = helper.make_graph(
        [helper.make_node("Einsum", ["x"], ["y"], equation=equation, name="bad_einsum")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(gradgen.errors.ModelError, match="bad_einsum"):
        gradgen.build_backward(model)
    path = tmp_path / "bad.onnx"
    onnx.save(model, path)
    code, out, err = run_cli(capsys, monkeypatch, "build-backward", path, "-o", tmp_path / "out.onnx")
    assert code == 3 and "bad_einsum" in err and "Traceback" not in err, (code, err)
    assert not (tmp_path / "out.onnx").exists()
