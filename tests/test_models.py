"""Samples and fixture models end to end: gradients vs PyTorch's, forward vs onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import gradgen
from gradgen.executor import Session
from tests.model_dirs import ALL_DIRS, dir_id, load, with_symbolic_batch

RTOL, ATOL_OF_MAX = 1e-4, 1e-5


def _check_gradients(model: onnx.ModelProto, inputs, reference, where: str) -> None:
    grads = {k: v for k, v in reference.items() if k.endswith("_grad")}
    input_grads = [k[: -len("_grad")] for k in grads if k[: -len("_grad")] in inputs]
    built = gradgen.build_backward(model, wrt_inputs=bool(input_grads))
    onnx.checker.check_model(gradgen.api.ir.to_proto(built.model), full_check=True)
    outputs = Session(built.model).run(inputs)
    produced = {k for k in outputs if k.endswith("_grad")}
    assert set(grads) <= produced, f"{where}: missing gradients {sorted(set(grads) - produced)}"
    assert not produced - set(grads) - {f"{k}_grad" for k in inputs}, (
        f"{where}: gradients without a reference {sorted(produced - set(grads))}"
    )
    np.testing.assert_allclose(outputs[built.loss], reference["loss"], rtol=1e-5, err_msg=f"{where}: loss")
    for name, want in grads.items():
        got = outputs[name]
        assert got.shape == want.shape and got.dtype == want.dtype, f"{where}: {name} {got.shape}{got.dtype}"
        atol = ATOL_OF_MAX * max(float(np.abs(want).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=f"{where}: {name}")


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_gradients_match_torch(path):
    model, inputs, reference, _ = load(path)
    _check_gradients(model, inputs, reference, dir_id(path))


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_gradients_match_torch_with_symbolic_batch(path):
    model, inputs, reference, meta = load(path)
    symbolic = with_symbolic_batch(model, meta.get("batch_dim", []))
    _check_gradients(symbolic, inputs, reference, dir_id(path) + " (symbolic batch)")


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_forward_matches_onnxruntime(path):
    ort = pytest.importorskip("onnxruntime")
    model, inputs, _, _ = load(path)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))
    got = Session(model).run(inputs)
    for name, value in want.items():
        np.testing.assert_allclose(
            got[name],
            value,
            rtol=1e-4,
            atol=1e-5 * max(1.0, float(np.abs(value).max(initial=0))),
            err_msg=f"{dir_id(path)}: output {name}",
        )


def test_there_are_samples_and_fixtures():
    names = {p.name for p in ALL_DIRS}
    for required in ("mlp", "cnn", "embedding", "slicing", "gather_elements", "broadcast", "transformer"):
        assert required in names, f"sample {required!r} is missing"
