"""Training-mode BatchNormalization as PyTorch's legacy exporter writes it below opset 14: five
outputs (the saved batch mean and inverse deviation last), which opset 14 no longer has. The
build drops the two unread ones and keeps the node in training mode (ONNX's converter would
refuse them, and without them leaves training_mode out: inference mode, another function);
the gradients match PyTorch's train-mode ones."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import gradgen
from gradgen.executor import Session
from gradgen.passes.standard import UpgradeOpsetPass

torch = pytest.importorskip("torch")


class _ConvBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, dtype=torch.float64)
        self.bn = torch.nn.BatchNorm2d(4, dtype=torch.float64)

    def forward(self, x):
        return (torch.relu(self.bn(self.conv(x))) ** 2).mean()


def _export(model, x, opset: int) -> onnx.ModelProto:
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            buffer,
            dynamo=False,
            opset_version=opset,
            training=torch.onnx.TrainingMode.TRAINING,
            do_constant_folding=False,
            input_names=["x"],
        )
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize("opset", [9, 12, 13])
def test_training_batch_norm_below_opset_14_builds_and_matches_pytorch(opset):
    torch.manual_seed(0)
    model = _ConvBatchNorm().train()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    proto = _export(model, x, opset)
    assert [len(n.output) for n in proto.graph.node if n.op_type == "BatchNormalization"] == [5]
    upgraded = ir.from_proto(proto)
    UpgradeOpsetPass()(upgraded)
    (node,) = [n for n in upgraded.graph if n.op_type == "BatchNormalization"]
    assert len(node.outputs) == 3 and node.attributes["training_mode"].value == 1
    out = Session(gradgen.build_backward(proto).model).run({"x": x.numpy()})
    reference = _ConvBatchNorm()
    reference.load_state_dict(model.state_dict())
    loss = reference.train()(x)
    loss.backward()
    np.testing.assert_allclose(out[proto.graph.output[0].name], loss.item(), rtol=1e-12)
    for name, parameter in reference.named_parameters():
        np.testing.assert_allclose(out[f"{name}_grad"], parameter.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
