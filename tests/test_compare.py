"""``gradgen run --compare``: which keys are compared, the tolerance's scale, and kinks decided by rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.compare import compare_outputs, compare_precision, match_reference
from tests.model_dirs import SAMPLE_DIRS
from tests.test_cli import run_cli

MLP = next(p for p in SAMPLE_DIRS if p.name == "mlp")
CNN = next(p for p in SAMPLE_DIRS if p.name == "cnn")


def _compare(capsys, monkeypatch, model, inputs, reference, *options):
    """``gradgen run MODEL --inputs INPUTS --compare REFERENCE --device cpu [options]``: (code, out, err)."""
    return run_cli(capsys, monkeypatch, "run", model, "--inputs", inputs, "--compare", reference, "--device", "cpu", *options)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


@pytest.fixture(scope="module")
def mlp_fc1(tmp_path_factory):
    """The mlp sample built for --wrt fc1.weight only: its reference holds 8 gradients, the model 1."""
    out = tmp_path_factory.mktemp("mlp") / "fc1.onnx"
    import gradgen
    from gradgen.model_io import save_model

    save_model(gradgen.build_backward(MLP / "model.onnx", wrt=["fc1.weight"]).model, out)
    return out


def test_unmatched_reference_keys_fail_and_are_named(mlp_fc1, capsys, monkeypatch):
    code, out, err = _compare(capsys, monkeypatch, mlp_fc1, MLP / "inputs.npz", MLP / "reference.npz")
    assert code == 4, err
    skipped = ["fc1.bias_grad", "fc2.weight_grad", "fc2.bias_grad", "fc3.weight_grad", "fc3.bias_grad", "x_grad", "target_grad"]
    [line] = _error_lines(err)
    assert err.strip().splitlines()[-1] == line
    assert "7 reference key(s) match no output" in line and all(k in line for k in skipped)
    assert "match the reference" not in out  # never "all N compared" when some were skipped
    # the compared ones were compared and shown
    assert any(row.startswith("fc1.weight_grad") and row.rstrip().endswith("ok") for row in out.splitlines())


def test_skip_unmatched_lists_what_was_not_compared(mlp_fc1, capsys, monkeypatch):
    code, out, err = _compare(capsys, monkeypatch, mlp_fc1, MLP / "inputs.npz", MLP / "reference.npz", "--skip-unmatched")
    assert code == 0, err
    assert "not compared (no output of that name): fc1.bias_grad" in out
    assert "all 2 compared output(s) match the reference" in out and "7 reference key(s) not compared" in out


def _torch_style_reference(tmp_path):
    """The mlp reference saved under parameter names (``fc1.weight``), as from PyTorch's named_parameters."""
    reference = dict(np.load(MLP / "reference.npz"))
    path = tmp_path / "torch.npz"
    np.savez(path, **{k.removesuffix("_grad"): v for k, v in reference.items()})
    return path


def test_pytorch_names_only_when_asked(tmp_path, capsys, monkeypatch):
    built = tmp_path / "g.onnx"
    assert run_cli(capsys, monkeypatch, "build-backward", MLP / "model.onnx", "-o", built, "--wrt-inputs")[0] == 0
    reference = _torch_style_reference(tmp_path)
    args = ["run", built, "--inputs", MLP / "inputs.npz", "--compare", reference, "--device", "cpu"]
    code, out, err = run_cli(capsys, monkeypatch, *args)
    assert code == 4
    [line] = _error_lines(err)
    assert "fc1.weight" in line and "--torch-names" in line  # named, with the way out
    code, out, err = run_cli(capsys, monkeypatch, *args, "--torch-names")
    assert code == 0, err
    assert "all 9 compared output(s) match the reference" in out
    assert any(r.split()[:2] == ["fc1.weight_grad", "fc1.weight"] for r in out.splitlines())


def test_a_reference_naming_no_output_fails(tmp_path, capsys, monkeypatch):
    np.savez(tmp_path / "ref.npz", nothing=np.zeros(3))
    code, _, err = _compare(capsys, monkeypatch, MLP / "model.onnx", MLP / "inputs.npz", tmp_path / "ref.npz")
    assert code == 4
    [line] = _error_lines(err)
    assert "reference's keys (nothing) name none of the model's outputs (loss" in line


def test_a_mismatch_fails_naming_the_output(tmp_path, capsys, monkeypatch):
    reference = dict(np.load(MLP / "reference.npz"))
    reference["loss"] = reference["loss"] * 1.01
    np.savez(tmp_path / "ref.npz", loss=reference["loss"])
    code, out, err = _compare(capsys, monkeypatch, MLP / "model.onnx", MLP / "inputs.npz", tmp_path / "ref.npz")
    assert code == 4
    assert "1 output(s) differ from the reference: loss" in _error_lines(err)[0]


def test_match_reference():
    pairs, unmatched = match_reference(["loss", "w_grad", "b_grad"], ["loss", "w", "b_grad", "zz"], torch_names=True)
    assert pairs == [("loss", "loss"), ("w_grad", "w"), ("b_grad", "b_grad")] and unmatched == ["zz"]
    pairs, unmatched = match_reference(["loss", "w_grad"], ["w"], torch_names=False)
    assert pairs == [] and unmatched == ["w"]


def test_tolerance_scale_passes_a_zero_gradient_with_noise_but_not_a_wrong_one():
    """A conv bias before a training-mode BatchNorm: both sides are float noise around 0."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 3, 3, 3)) * 0.1
    bias_ref, bias_got = rng.standard_normal(16) * 2e-8, rng.standard_normal(16) * 2e-8
    reference = {"conv.weight_grad": weight, "conv.bias_grad": bias_ref}
    results = {"conv.weight_grad": (weight * (1 + 1e-7)).astype(np.float32), "conv.bias_grad": bias_got.astype(np.float32)}
    comparison = compare_outputs(results, reference, rtol=1e-4, atol=1e-5, floor=0.1)
    assert comparison.failures == []
    # the same noise fails the old per-tensor rule (atol * max|ref| of the bias itself)
    assert not compare_outputs(results, reference, rtol=1e-4, atol=1e-5, floor=0.0).rows[1].passed
    # a real error in the small tensor (1e-3 of the model's largest gradient) still fails
    results["conv.bias_grad"] = np.full(16, 1e-3 * np.abs(weight).max(), np.float32)
    assert compare_outputs(results, reference, rtol=1e-4, atol=1e-5, floor=0.1).failures == ["conv.bias_grad"]


def test_compare_fails_on_shape_and_nan():
    reference = {"a_grad": np.ones(3), "b_grad": np.array([1.0, np.nan])}
    results = {"a_grad": np.ones(4, np.float32), "b_grad": np.array([1.0, 2.0], np.float32)}
    comparison = compare_outputs(results, reference, rtol=1e-4, atol=1e-5, floor=0.1)
    assert comparison.failures == ["a_grad", "b_grad"]
    same_nan = compare_outputs(
        {"b_grad": np.array([1.0, np.nan])}, {"b_grad": np.array([1.0, np.nan])}, rtol=1e-4, atol=1e-5, floor=0.1
    )
    assert same_nan.failures == []


def _kink_model(path):
    """loss = sum(relu((x + w) - x)): for x = 1e8 and w = 1, relu's input is 0 in float32 and 1 in float64."""
    nodes = [
        helper.make_node("Add", ["x", "w"], ["a"], name="add"),
        helper.make_node("Sub", ["a", "x"], ["h"], name="sub"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "kink",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_mismatch_at_a_kink_decided_by_rounding_says_so(tmp_path, capsys, monkeypatch):
    _kink_model(tmp_path / "m.onnx")
    built = tmp_path / "g.onnx"
    assert run_cli(capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", built)[0] == 0
    np.savez(tmp_path / "in.npz", x=np.array([1e8, 1e8, 1.0], np.float32))
    # the reference computed in float64 (as a double-precision PyTorch run would): relu'(1) = 1
    np.savez(tmp_path / "ref.npz", w_grad=np.ones(3))
    code, out, err = _compare(capsys, monkeypatch, built, tmp_path / "in.npz", tmp_path / "ref.npz")
    assert code == 4
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert any(
        "2 input element(s) of non-smooth ops lie on the other side of their kink" in n and "Relu node 'relu': 2" in n
        for n in notes
    ), err
    assert any("the float64 run of this graph matches the reference for w_grad" in n for n in notes), err
    assert err.strip().splitlines()[-1].startswith("error: 1 output(s) differ")


def test_a_mismatch_without_kinks_says_they_are_not_the_cause(tmp_path, capsys, monkeypatch):
    _kink_model(tmp_path / "m.onnx")
    built = tmp_path / "g.onnx"
    assert run_cli(capsys, monkeypatch, "build-backward", tmp_path / "m.onnx", "-o", built)[0] == 0
    np.savez(tmp_path / "in.npz", x=np.array([1.0, 2.0, 3.0], np.float32))
    np.savez(tmp_path / "ref.npz", w_grad=np.full(3, 2.0))  # wrong by a factor 2
    code, _, err = _compare(capsys, monkeypatch, built, tmp_path / "in.npz", tmp_path / "ref.npz")
    assert code == 4
    assert "do not come from kinks decided by rounding" in err


def test_kinks_are_found_in_an_untyped_forward_model_with_external_data(tmp_path, capsys, monkeypatch):
    """No value_info on the intermediate values, weights in an external file: the same diagnosis."""
    _kink_model(tmp_path / "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"))
    onnx.save_model(model, str(tmp_path / "m.onnx"), save_as_external_data=True, size_threshold=0, location="m.bin")
    np.savez(tmp_path / "in.npz", x=np.array([1e8, 1e8, 1.0], np.float32))
    np.savez(tmp_path / "ref.npz", loss=np.array(3.0))
    monkeypatch.chdir(tmp_path.parent)
    code, _, err = _compare(capsys, monkeypatch, tmp_path / "m.onnx", tmp_path / "in.npz", tmp_path / "ref.npz")
    assert code == 4
    assert "(Relu node 'relu': 2)" in err and "the float64 run of this graph matches the reference for loss" in err


# -- default tolerances per precision ----------------------------------------------------------------


@pytest.fixture(scope="module")
def cnn_builds(tmp_path_factory):
    """The cnn sample's backward graph built in fp32, bf16 and fp16."""
    import gradgen
    from gradgen.model_io import save_model

    directory = tmp_path_factory.mktemp("cnn")
    paths = {}
    for precision in ("fp32", "bf16", "fp16"):
        paths[precision] = directory / f"{precision}.onnx"
        save_model(gradgen.build_backward(CNN / "model.onnx", precision=precision).model, paths[precision])
    return paths


def _run_compare(capsys, monkeypatch, model, reference, *options):
    return _compare(capsys, monkeypatch, model, CNN / "inputs.npz", reference, "--skip-unmatched", *options)


@pytest.mark.parametrize("precision,tolerance", [("bf16", "rtol=0.01, atol=0.05*scale"), ("fp16", "rtol=0.001, atol=0.01*scale")])
def test_a_low_precision_build_passes_with_its_defaults_but_a_wrong_gradient_fails(
    cnn_builds, precision, tolerance, tmp_path, capsys, monkeypatch
):
    """Against the float32 reference: rounding to 16 bits passes, a gradient 1.5 times too large does not."""
    code, out, err = _run_compare(capsys, monkeypatch, cnn_builds[precision], CNN / "reference.npz")
    assert code == 0, err
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith(f"all 7 compared output(s) match the reference ({tolerance}, floor=0.1; {precision} defaults)")
    )
    # the same build fails the float32 defaults: the wider ones are needed
    code, _, err = _run_compare(
        capsys, monkeypatch, cnn_builds[precision], CNN / "reference.npz", "--rtol", "1e-4", "--atol", "1e-5"
    )
    assert code == 4 and "conv1.weight_grad" in _error_lines(err)[0]
    reference = dict(np.load(CNN / "reference.npz"))
    reference["conv2.weight_grad"] = reference["conv2.weight_grad"] * 1.5
    np.savez(tmp_path / "wrong.npz", **reference)
    code, _, err = _run_compare(capsys, monkeypatch, cnn_builds[precision], tmp_path / "wrong.npz")
    assert code == 4
    [line] = _error_lines(err)
    assert (
        f"1 output(s) differ from the reference: conv2.weight_grad (beyond {tolerance}, floor=0.1; {precision} defaults)" in line
    )


def test_explicit_tolerances_override_the_precision_defaults(cnn_builds, capsys, monkeypatch):
    code, out, err = _run_compare(
        capsys, monkeypatch, cnn_builds["bf16"], CNN / "reference.npz", "--rtol", "0.02", "--atol", "0.06"
    )
    assert code == 0, err
    assert "(rtol=0.02, atol=0.06*scale, floor=0.1); 1 reference key(s) not compared" in out  # no defaults named
    # one given, the other the precision's default; the given one decides here
    code, _, err = _run_compare(capsys, monkeypatch, cnn_builds["bf16"], CNN / "reference.npz", "--atol", "1e-5")
    assert code == 4
    assert "(beyond rtol=0.01, atol=1e-05*scale, floor=0.1; rtol: bf16 default)" in _error_lines(err)[0]


def test_fp32_keeps_its_defaults(cnn_builds, tmp_path, capsys, monkeypatch):
    code, out, err = _run_compare(capsys, monkeypatch, cnn_builds["fp32"], CNN / "reference.npz")
    assert code == 0, err
    assert "match the reference (rtol=0.0001, atol=1e-05*scale, floor=0.1; fp32 defaults)" in out
    # an error that the bf16 defaults would accept (1% of the largest element) fails in fp32
    reference = dict(np.load(CNN / "reference.npz"))
    grad = reference["conv2.weight_grad"]
    reference["conv2.weight_grad"] = grad + 0.01 * np.abs(grad).max()
    np.savez(tmp_path / "off.npz", **reference)
    code, _, err = _run_compare(capsys, monkeypatch, cnn_builds["fp32"], tmp_path / "off.npz")
    assert code == 4 and "conv2.weight_grad (beyond rtol=0.0001, atol=1e-05*scale" in _error_lines(err)[0]


def _typed_model(*dtypes: int, precision: str | None = None):
    """x -> Cast(to=dtype) -> ... -> Cast(to=float): a float graph with values of the given types."""
    import onnx_ir as ir

    nodes, previous = [], "x"
    for i, dtype in enumerate([*dtypes, TensorProto.FLOAT]):
        nodes.append(helper.make_node("Cast", [previous], [f"v{i}"], to=dtype))
        previous = f"v{i}"
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [2])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])
    proto = onnx.shape_inference.infer_shapes(proto)
    if precision is not None:
        helper.set_model_props(proto, {"gradgen.precision": precision})
    return ir.from_proto(proto)


def test_compare_precision_reads_the_metadata_else_the_narrowest_float_type():
    assert compare_precision(_typed_model()) == "fp32"
    assert compare_precision(_typed_model(TensorProto.DOUBLE)) == "fp32"
    assert compare_precision(_typed_model(TensorProto.FLOAT16)) == "fp16"
    assert compare_precision(_typed_model(TensorProto.FLOAT16, TensorProto.BFLOAT16)) == "bf16"  # the coarser
    assert compare_precision(_typed_model(precision="tf32")) == "tf32"
    assert compare_precision(_typed_model(TensorProto.FLOAT16, precision="bf16")) == "bf16"  # metadata first
