"""--tie-weights in training: an LM head the exporter wrote as a transposed copy of its embedding
trains as one parameter (the sum of both uses' gradients, as PyTorch's tied weight), evaluation
reads the trained weight, and export writes it to both initializers."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.training import SGD, Trainer, build_training
from gradgen.training.checkpoint import load_checkpoint, save_checkpoint
from gradgen.training.export import export_trained
from tests.test_cli import run_cli

VOCAB, WIDTH = 20, 16
EMBEDDING = np.random.default_rng(0).standard_normal((VOCAB, WIDTH)).astype(np.float32)


def _model(copied: bool) -> onnx.ModelProto:
    """loss = cross_entropy(Gather(E, ids) @ E^T, labels): the head reads ``head`` (E^T stored as a
    copy, as exporters write a tied head) where ``copied``, else Transpose(E) of the one tensor."""
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["h"])]
    initializers = [numpy_helper.from_array(EMBEDDING, "embedding")]
    if copied:
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(EMBEDDING.T), "head"))
    else:
        nodes.append(helper.make_node("Transpose", ["embedding"], ["head"], perm=[1, 0]))
    nodes += [
        helper.make_node("MatMul", ["h", "head"], ["logits"]),
        helper.make_node("Reshape", ["logits", "rows"], ["flat_logits"]),
        helper.make_node("Reshape", ["labels", "flat"], ["flat_labels"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["flat_logits", "flat_labels"], ["loss"], reduction="mean"),
    ]
    initializers += [numpy_helper.from_array(np.array(s, np.int64), n) for n, s in (("rows", [-1, VOCAB]), ("flat", [-1]))]
    graph = helper.make_graph(
        nodes,
        "tied",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
            helper.make_tensor_value_info("labels", TensorProto.INT64, [2, 3]),
        ],
        [
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, VOCAB]),
        ],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _batches(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"ids": rng.integers(0, VOCAB, (2, 3)), "labels": rng.integers(0, VOCAB, (2, 3))} for _ in range(count)]


def _trained(model, steps: int = 4, **options) -> tuple:
    program = build_training(model, optimizer=SGD(momentum=0.9), loss="loss", **options)
    trainer = Trainer(program, lr=0.5)
    trainer.fit(_batches(steps), steps)
    return program, trainer


def test_a_tied_copy_trains_as_one_parameter_and_exports_to_both(tmp_path):
    reference_program, reference = _trained(_model(copied=False))
    program, trainer = _trained(_model(copied=True), tie_weights=True)
    assert program.params == ["embedding"] and program.tied == [("embedding", "head")]
    np.testing.assert_allclose(trainer.params["embedding"], reference.params["embedding"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(trainer.params["embedding"], EMBEDDING)
    evaluation = _batches(6)[4:]
    assert trainer.evaluate(evaluation) == pytest.approx(reference.evaluate(evaluation), rel=1e-5)

    checkpoint = save_checkpoint(tmp_path / "checkpoint.npz", program, trainer.state)
    exported = export_trained(_model(copied=True), checkpoint, keep_loss=True)
    head = exported.graph.initializers["head"].const_value.numpy()
    np.testing.assert_array_equal(head, trainer.params["embedding"].T)


def test_without_tie_weights_the_copies_train_apart_with_a_warning():
    with pytest.warns(UserWarning, match="'embedding' and 'head' hold the same values"):
        program, trainer = _trained(_model(copied=True))
    assert program.params == ["embedding", "head"] and program.tied == []
    assert not np.allclose(trainer.params["head"], trainer.params["embedding"].T)


def test_resuming_with_the_other_tie_setting_is_refused(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model.onnx"
    onnx.save(_model(copied=True), model)
    batches = _batches(8)
    np.savez(tmp_path / "data.npz", **{k: np.concatenate([b[k] for b in batches]) for k in ("ids", "labels")})
    common = [
        "train",
        model,
        "--data",
        tmp_path / "data.npz",
        "--lr",
        "0.1",
        "--loss",
        "loss",
        "--checkpoint-dir",
        tmp_path / "run",
    ]
    code, _, err = run_cli(capsys, monkeypatch, *common, "--steps", "2", "--tie-weights")
    assert code == 0, err
    code, _, err = run_cli(capsys, monkeypatch, *common, "--steps", "3", "--resume")
    assert code == 2 and "was trained with --tie-weights, this run is without it" in err.strip().splitlines()[-1]
    code, _, err = run_cli(capsys, monkeypatch, *common, "--steps", "3", "--resume", "--tie-weights")
    assert code == 0, err
    _, meta = load_checkpoint(tmp_path / "run")
    assert meta["step"] == 3 and meta["tied"] == [["embedding", "head"]]


def test_onnx_runtime_artifacts_tie_the_copy_too():
    from gradgen.training.artifacts import generate_artifacts

    made = generate_artifacts(_model(copied=True), optimizer=SGD(), tie_weights=True)
    assert list(made.requires_grad) == ["embedding"]
    for graph in (made.training.graph, made.eval.graph):
        assert "head" not in graph.initializers and "head" not in [v.name for v in graph.inputs]
        transposed = {n.outputs[0].name for n in graph if n.op_type == "Transpose" and n.inputs[0].name == "embedding"}
        products = [n for n in graph if n.op_type in ("MatMul", "FusedMatMul", "Gemm")]
        assert any(n.inputs[1].name in transposed | {"embedding"} for n in products)  # the head reads the one weight
