"""SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss take int32 / int64 class indices. PyTorch's
dynamo exporter writes cross_entropy with probability targets as SoftmaxCrossEntropyLoss with float
labels (not valid ONNX): build-backward refuses it with one line naming the node, and the CLI
exits 3 (a model error) without a traceback."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.cli import main
from gradgen.errors import ModelError


def _loss_model(op_type: str, label_type: int):
    node = helper.make_node(op_type, ["scores", "target"], ["loss"], name="the_loss")
    graph = helper.make_graph(
        [node],
        "loss",
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("target", label_type, [2, 3] if label_type == TensorProto.FLOAT else [2]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op_type", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_float_labels_are_refused_at_build_time(op_type):
    with pytest.raises(ModelError, match=r"node 'the_loss'.*labels \('target'\) are FLOAT.*int32 or int64"):
        gradgen.build_backward(_loss_model(op_type, TensorProto.FLOAT), wrt_inputs=True)


@pytest.mark.parametrize("label_type", [TensorProto.INT32, TensorProto.INT64])
def test_integer_labels_build(label_type):
    built = gradgen.build_backward(_loss_model("SoftmaxCrossEntropyLoss", label_type), wrt_inputs=True)
    assert "scores_grad" in built.gradient_names


def test_the_cli_says_it_in_one_line(tmp_path, capsys):
    import onnx

    path = tmp_path / "model.onnx"
    onnx.save(_loss_model("SoftmaxCrossEntropyLoss", TensorProto.FLOAT), path)
    with pytest.raises(SystemExit) as exit_info:
        main(["build-backward", str(path), "-o", str(tmp_path / "out.onnx"), "--wrt-inputs"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 3
    assert "Traceback" not in err and "int32 or int64 class indices" in err
