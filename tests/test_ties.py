"""A tied weight the exporter wrote twice (an LM head sharing its embedding): a warning names the
pair, and tie_weights / --tie-weights makes it one parameter again, with PyTorch's gradient."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session
from gradgen.passes.ties import equal_transposed_initializers

torch = pytest.importorskip("torch")


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(40, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.mix(self.emb(ids))))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1))


def _export(tmp_path):
    torch.manual_seed(0)
    net = TiedLM()
    ids, labels = torch.randint(0, 40, (2, 5)), torch.randint(0, 40, (2, 5))
    path = tmp_path / "tied.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (ids, labels), str(path), dynamo=False, input_names=["ids", "labels"], output_names=["loss"])
    net(ids, labels).backward()
    return path, {"ids": ids.numpy(), "labels": labels.numpy()}, net.emb.weight.grad.numpy()


def test_the_exported_copy_is_found_and_tied_again(tmp_path):
    path, feeds, want = _export(tmp_path)
    pairs = equal_transposed_initializers(gradgen.model_io.load_model(path).graph)
    assert len(pairs) == 1 and pairs[0][0] == "emb.weight"
    with pytest.warns(UserWarning, match=r"'emb.weight' and '.*' hold the same values .*--tie-weights"):
        untied = gradgen.build_backward(path)
    assert pairs[0][1] in untied.wrt  # two parameters: each gets a part of PyTorch's gradient
    got = Session(untied.model).run(feeds)
    assert not np.allclose(got["emb.weight_grad"], want, atol=1e-5)
    np.testing.assert_allclose(got["emb.weight_grad"] + got[f"{pairs[0][1]}_grad"].T, want, rtol=1e-4, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning once tied
        tied = gradgen.build_backward(path, tie_weights=True)
    assert pairs[0][1] not in tied.wrt and "emb.weight" in tied.wrt
    np.testing.assert_allclose(Session(tied.model).run(feeds)["emb.weight_grad"], want, rtol=1e-4, atol=1e-6)


def test_cli_notes_the_pair_and_ties_it_when_asked(tmp_path, capsys, monkeypatch):
    from tests.test_cli import run_cli

    path, _, _ = _export(tmp_path)
    code, out, err = run_cli(capsys, monkeypatch, "build-backward", path, "-o", tmp_path / "g.onnx")
    assert code == 0 and "note: initializers 'emb.weight' and" in err
    code, out, err = run_cli(capsys, monkeypatch, "build-backward", path, "-o", tmp_path / "t.onnx", "--tie-weights")
    assert code == 0 and "hold the same values" not in err
    assert "emb.weight_grad" in out


def test_constant_and_square_tensors_are_not_taken_for_ties():
    """Tensors equal by construction (all ones, as LayerNorm scales start) and square matrices whose
    transposes match are left alone; so are small ones."""
    rng = np.random.default_rng(0)
    sym = rng.standard_normal((20, 20))
    inits = {
        "ones_a": np.ones((16, 32)),
        "ones_b": np.ones((32, 16)),
        "sym": sym + sym.T,
        "sym_copy": sym + sym.T,
        "small": rng.standard_normal((4, 8)),
    }
    inits["small_t"] = inits["small"].T.copy()
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["loss"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = gradgen.model_io.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert equal_transposed_initializers(model.graph) == []
