"""Bilinear and bicubic upsampling as PyTorch's legacy exporter writes it without constant folding:
Resize's (or opset 9's Upsample's) float scales are a Concat of float Constants, which the build-time
evaluator folds before the Resize rule reads them. The models build and match PyTorch's gradients."""

from __future__ import annotations

import warnings

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.passes.evaluate import EvaluateConstantsPass

torch = pytest.importorskip("torch")


class _UpsampleNet(torch.nn.Module):
    def __init__(self, mode: str, align_corners: bool | None):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1, dtype=torch.float64)
        self.up = torch.nn.Upsample(scale_factor=2, mode=mode, align_corners=align_corners)

    def forward(self, x):
        return (self.up(self.conv(x)) ** 2).mean()


@pytest.mark.parametrize(
    "mode,align_corners,opset",
    [
        ("bilinear", None, 9),  # Upsample-9, scales an input
        ("bilinear", None, 11),
        ("bilinear", True, 13),
        ("bilinear", None, 17),
        ("bicubic", None, 11),
        ("bicubic", True, 17),
    ],
)
def test_legacy_export_builds_and_matches_torch(tmp_path, mode, align_corners, opset):
    torch.manual_seed(0)
    net = _UpsampleNet(mode, align_corners)
    x = torch.randn(2, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (x,),
            str(path),
            dynamo=False,
            opset_version=opset,
            do_constant_folding=False,
            input_names=["x"],
            output_names=["loss"],
            dynamic_axes={"x": {0: "batch"}},
        )
    exported = ir.load(str(path))
    scaler = next(n for n in exported.graph if n.op_type in ("Resize", "Upsample"))
    scales = scaler.inputs[1 if scaler.op_type == "Upsample" else 2]
    assert scales is not None and scales.producer() is not None and scales.producer().op_type == "Concat"  # the case at hand

    net(x).backward()
    built = gradgen.build_backward(str(path), wrt_inputs=True)
    assert set(built.wrt) == {"x", "conv.weight", "conv.bias"}  # the folded scales are no parameter
    got = gradgen.Session(built.model).run({"x": x.detach().numpy()})
    if opset < 11:
        # Upsample-9 cannot say align_corners=False (the exporter warns): the model is asymmetric
        # bilinear, as ONNX defines Upsample and onnxruntime computes it, not PyTorch's function.
        # The built graph differentiates the model's own function (it took PyTorch's half-pixel
        # one before, through the version converter's Resize defaults).
        own = gradgen.Session(str(path)).run({"x": x.detach().numpy()})["loss"]
        np.testing.assert_allclose(got["loss"], own, rtol=1e-12)
        assert not np.allclose(got["loss"], net(x).item())
        report = gradgen.check.check_gradients(str(path), wrt_inputs=True, inputs={"x": x.detach().numpy()})
        assert report.passed, report.format()
        return
    want = {"x": x.grad, "conv.weight": net.conv.weight.grad, "conv.bias": net.conv.bias.grad}
    for name, grad in want.items():
        np.testing.assert_allclose(got[f"{name}_grad"], grad.numpy(), rtol=1e-10, atol=1e-12)


def test_cast_div_unsqueeze_chains_on_float_constants_fold_into_one_constant():
    """Other chains exporters build scales with: Unsqueeze, Cast, Div and Concat of float Constants."""

    def const(name, array):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array)))

    nodes = [
        const("four", np.float64(4.0)),
        const("two", np.float32(2.0)),
        const("axes", np.array([0], np.int64)),
        const("ones", np.ones(2, np.float32)),
        helper.make_node("Cast", ["four"], ["four_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["four_f", "two"], ["s"]),
        helper.make_node("Unsqueeze", ["s", "axes"], ["s1"]),
        helper.make_node("Concat", ["ones", "s1", "s1"], ["scales"], axis=0),
        helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear"),
        helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = ir.from_proto(proto)
    EvaluateConstantsPass()(model)
    resize = next(n for n in model.graph if n.op_type == "Resize")
    folded = resize.inputs[2].producer()
    assert folded.op_type == "Constant"
    np.testing.assert_array_equal(folded.attributes["value"].value.numpy(), [1, 1, 2, 2])
    assert {n.op_type for n in model.graph} == {"Constant", "Resize", "ReduceSumSquare"}  # CleanupPass drops the dead Constants

    from gradgen.check import check_gradients

    report = check_gradients(ir.from_proto(proto), wrt_inputs=True, random_inputs=True)
    assert report.passed, report.format()
