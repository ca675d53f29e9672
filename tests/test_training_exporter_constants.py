"""Training a torch.export model trains its parameters only: buffers, the exporter's scalar constants
and what its optimizer folded from several values (attention masks, rotary tables) stay fixed, with
a note naming them; ``--train NAME`` trains one anyway. Models from other exporters are unchanged."""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import UsageError
from gradgen.model_io import load_model
from gradgen.training import SGD, AdamW, Trainer, build_training
from gradgen.training.exporter_constants import BUFFER, FOLDED, SCALAR, exporter_constants
from tests.test_cli import run_cli

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
RNG = np.random.default_rng(0)
# name -> (value, metadata) of a torch.export model's initializers, as the exporter writes them
WEIGHT = RNG.standard_normal((4, 3)).astype(np.float32)  # a parameter, as exported
WEIGHT_T = RNG.standard_normal((3, 4)).astype(np.float32)  # a parameter the optimizer transposed
MASK = np.array([0.0, 0.0, -3.4028235e38], np.float32)  # folded from arange, le, ...
OFFSET = RNG.standard_normal(3).astype(np.float32)  # a buffer
SCALE = np.array(0.5, np.float32)  # a scalar constant of the exporter's
SHIFT = RNG.standard_normal(3).astype(np.float32)  # no metadata, several values (a fused BatchNorm's bias)
INITIALIZERS = {
    "w": (WEIGHT, {KIND: "PARAMETER"}),
    "val_7": (WEIGHT_T, {FOLDED_FROM: "['layer.weight']"}),
    "val_9": (MASK, {FOLDED_FROM: "['arange', 'le', 'val_1', 'val_2']"}),
    "offset": (OFFSET, {KIND: "BUFFER"}),
    "val_3": (SCALE, {}),
    "shift": (SHIFT, {}),
}


def _model(with_metadata: bool = True) -> onnx.ModelProto:
    """loss = mean(softmax-free scores): h = relu(x @ w) @ val_7, s = (h + offset + shift) * val_3 +
    val_9; loss = mean(exp(s) * s) (the mask's -3.4e38 gives exp 0 there, as an attention mask does)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Relu", ["xw"], ["r"]),
        helper.make_node("MatMul", ["r", "val_7"], ["h4"]),
        helper.make_node("Slice", ["h4", "starts", "ends", "axes"], ["h"]),
        helper.make_node("Add", ["h", "offset"], ["a"]),
        helper.make_node("Add", ["a", "shift"], ["b"]),
        helper.make_node("Mul", ["b", "val_3"], ["c"]),
        helper.make_node("Add", ["c", "val_9"], ["s"]),
        helper.make_node("Exp", ["s"], ["e"]),
        helper.make_node("Mul", ["e", "s"], ["es"]),
        helper.make_node("ReduceMean", ["es"], ["loss"], keepdims=0),
    ]
    initializers = [numpy_helper.from_array(value, name) for name, (value, _) in INITIALIZERS.items()]
    initializers += [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("starts", 0), ("ends", 3), ("axes", 1))]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    graph = helper.make_graph(
        nodes, "exported", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializers
    )
    if with_metadata:
        helper.set_metadata_props(x, {KIND: "USER_INPUT"})
        for name, (_, metadata) in INITIALIZERS.items():
            if metadata:  # the exporter writes an initializer's metadata on its value_info
                info = helper.make_tensor_value_info(name, TensorProto.FLOAT, list(INITIALIZERS[name][0].shape))
                helper.set_metadata_props(info, metadata)
                graph.value_info.append(info)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_what_a_torch_export_model_leaves_out_and_why():
    assert exporter_constants(load_model(_model()).graph) == {"val_9": FOLDED, "offset": BUFFER, "val_3": SCALAR}


def _graph_of(initializers: dict[str, tuple[np.ndarray, dict]]) -> ir.Graph:
    """A torch.export-style graph reading each initializer through an Identity (for the classification alone)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    helper.set_metadata_props(x, {KIND: "USER_INPUT"})
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in initializers]
    outputs = [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None) for name in initializers]
    tensors = [numpy_helper.from_array(value, name) for name, (value, _) in initializers.items()]
    graph = helper.make_graph(nodes, "g", [x], outputs, tensors)
    for name, (value, metadata) in initializers.items():
        info = helper.make_tensor_value_info(name, TensorProto.FLOAT, list(value.shape))
        helper.set_metadata_props(info, metadata)
        graph.value_info.append(info)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])).graph


def test_a_fold_of_one_parameter_is_trained_unless_it_copies_it():
    token = RNG.standard_normal((1, 1, 8)).astype(np.float32)
    shape_constants = "['vit.cls_token', 'val_6', 'val_7']"
    graph = _graph_of(
        {
            # an Expand of a class token to the batch: equal rows of a non-constant tensor
            "expand": (np.repeat(token, 3, axis=0), {FOLDED_FROM: shape_constants}),
            # a GroupNorm scale reshaped to (C, 1, 1), as initialised (all ones) and as trained
            "val_55": (np.ones((16, 1, 1), np.float32), {FOLDED_FROM: "['norm1.weight', 'val_49', 'val_50']"}),
            "val_57": (RNG.standard_normal((16, 1, 1)).astype(np.float32), {FOLDED_FROM: "['norm1.bias', 'val_49']"}),
            # one value computed from another (an attention scale from a shape)
            "val_207": (np.array([0.35], np.float32), {FOLDED_FROM: "['transpose_3', 'val_184']"}),
            # constants alone (a ones scale an InstanceNormalization reads)
            "val_42": (np.ones(8, np.float32), {FOLDED_FROM: "['val_35', 'val_36']"}),
            # a causal mask from one op's output (torch.full, then triu): no dotted name, no parameter
            "triu": (np.triu(np.full((4, 4), -3.4e38, np.float32), 1), {FOLDED_FROM: "['full', 'val_3']"}),
        }
    )
    assert exporter_constants(graph) == {"expand": FOLDED, "val_207": FOLDED, "val_42": FOLDED, "triu": FOLDED}


def test_a_model_without_the_exporters_metadata_leaves_nothing_out():
    assert exporter_constants(load_model(_model(with_metadata=False)).graph) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = build_training(_model(with_metadata=False), optimizer=SGD())
    assert set(program.params) == set(INITIALIZERS)


def _sgd_reference(x_batches, lr: float, steps: int) -> dict[str, np.ndarray]:
    """SGD on w, val_7 and shift only, by hand in float64 (the constants as exported)."""
    w, wt, shift = WEIGHT.astype(np.float64), WEIGHT_T.astype(np.float64), SHIFT.astype(np.float64)
    scale, mask, offset = float(SCALE), MASK.astype(np.float64), OFFSET.astype(np.float64)
    for x in x_batches[:steps]:
        xw = x @ w
        r = np.maximum(xw, 0)
        h = (r @ wt)[:, :3]
        s = (h + offset + shift) * scale + mask
        d_s = np.exp(s) * (1 + s) / s.size  # d mean(exp(s) s) / ds
        d_b = d_s * scale
        d_h4 = np.concatenate([d_b, np.zeros((x.shape[0], 1))], axis=1)
        d_wt = r.T @ d_h4
        d_w = x.T @ ((d_h4 @ wt.T) * (xw > 0))
        w, wt, shift = w - lr * d_w, wt - lr * d_wt, shift - lr * d_b.sum(0)
    return {"w": w, "val_7": wt, "shift": shift}


def test_training_trains_the_parameters_and_keeps_the_constants():
    x_batches = [RNG.standard_normal((2, 4)) for _ in range(4)]
    with pytest.warns(UserWarning) as caught:
        program = build_training(_model(), optimizer=SGD())
    notes = [str(w.message) for w in caught]
    assert any(re.search(r"1 buffers .*'offset'.*1 folded .*'val_9'.*1 the exporter's single-value .*'val_3'", n) for n in notes)
    # trained, but said: an initializer with no metadata is one the optimizer rewrote (a fused BatchNorm)
    unmarked = "1 trained initializer(s) of this torch.export model are no parameter"
    assert any(n.startswith(unmarked) and "'shift'" in n for n in notes)
    assert program.params == ["w", "val_7", "shift"]
    trainer = Trainer(program, lr=0.1)
    trainer.fit([{"x": x.astype(np.float32)} for x in x_batches], 4)
    for name, want in _sgd_reference(x_batches, 0.1, 4).items():
        np.testing.assert_allclose(trainer.params[name], want, rtol=1e-4, atol=1e-5)


def test_also_train_trains_a_constant_anyway_and_refuses_other_names():
    with pytest.warns(UserWarning) as caught:
        program = build_training(_model(), optimizer=AdamW(), also_train=["offset"])
    assert "offset" in program.params and "'offset'" not in str(caught[0].message)
    with pytest.raises(UsageError, match=r"--train names no initializer .*'w'.*those are: 'val_9', 'offset', 'val_3'"):
        build_training(_model(), optimizer=AdamW(), also_train=["w"])


def test_onnx_runtime_artifacts_leave_the_same_constants_out():
    from gradgen.training.artifacts import generate_artifacts

    with pytest.warns(UserWarning, match="--requires-grad NAME"):
        made = generate_artifacts(_model(), optimizer=SGD())
    assert list(made.requires_grad) == ["w", "val_7", "shift"]


def test_the_cli_says_what_it_leaves_out_and_takes_train(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model.onnx"
    onnx.save(_model(), model)
    np.savez(tmp_path / "data.npz", x=RNG.standard_normal((8, 2, 4)).astype(np.float32).reshape(16, 4))
    common = ["train", model, "--data", tmp_path / "data.npz", "--lr", "0.01", "--steps", "2", "--batch-size", "2"]
    code, _, err = run_cli(capsys, monkeypatch, *common, "--train", "val_3")
    assert code == 0, err
    assert (
        "note: training leaves out" in err
        and "'val_9'" in err
        and "'val_3'" not in err.split("note: training leaves out")[1].split("\n")[0]
    )
    code, _, err = run_cli(capsys, monkeypatch, *common, "--train", "nosuch")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --train names no initializer")


@pytest.mark.slow  # the dynamo exporter takes seconds
def test_a_dynamo_export_with_a_buffer_and_a_folded_mask_trains_as_pytorch(tmp_path):
    """A rotary-style buffer and a causal mask, folded by the exporter's optimizer (its default):
    before, they were trained too (the mask's -3.4e38 under AdamW's weight decay gave a NaN loss at
    step 2 on a Llama export)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qk = torch.nn.Linear(8, 16, bias=False)
            self.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

        def forward(self, x):
            t = torch.arange(x.shape[1], dtype=torch.float32)
            angles = torch.outer(t, self.inv_freq)
            rot = torch.cat([angles.cos(), angles.sin()], dim=-1)
            q, k = self.qk(x).chunk(2, dim=-1)
            scores = (q * rot) @ (k * rot).transpose(1, 2)
            mask = torch.full((x.shape[1], x.shape[1]), torch.finfo(torch.float32).min).triu(1)
            return torch.softmax(scores + mask, dim=-1).square().mean()

    torch.manual_seed(0)
    module = Attention()
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.onnx.export(module, (x,), input_names=["x"], dynamo=True, verbose=False).model_proto
    with pytest.warns(UserWarning, match="training leaves out"):
        program = build_training(exported, optimizer=AdamW(weight_decay=0.01))
    assert len(program.params) == 1  # the Linear's weight (transposed by the exporter, or not)
    batches = [{"x": np.random.default_rng(i).standard_normal((2, 5, 8)).astype(np.float32)} for i in range(5)]
    ours = [r.loss for r in Trainer(program, lr=1e-2).fit(batches, 5)]
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    theirs = []
    for batch in batches:
        optimizer.zero_grad()
        loss = module(torch.from_numpy(batch["x"]))
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)


def test_a_checkpoint_that_trained_a_constant_names_the_way_back():
    from gradgen.errors import RunError
    from gradgen.training.trainer import check_state

    with pytest.warns(UserWarning):
        trained_it = Trainer(build_training(_model(), optimizer=SGD(), also_train=["offset"]), lr=0.1)
        program = build_training(_model(), optimizer=SGD())
    with pytest.raises(RunError, match=r"parameters the model does not train: 'offset' .*--train NAME"):
        check_state(program, trained_it.state)
