"""DFT: the CPU kernel against ONNX's reference evaluator and ONNX Runtime, its gradients against
torch.fft under autograd (finite differences: tests/grad_cases/matmul.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, run_gradgen, torch_grads

torch = pytest.importorskip("torch")
rng = np.random.default_rng(20)

# (X's shape, attributes, dft_length or None, the torch function of (x, n))
FORMS = [
    ((2, 6, 2), {}, None, lambda x, n: torch.view_as_real(torch.fft.fft(torch.view_as_complex(x), n=n, dim=1))),
    ((2, 5, 1), {}, 7, lambda x, n: torch.view_as_real(torch.fft.fft(x[..., 0], n=n, dim=1))),
    ((2, 6, 1), {"onesided": 1}, None, lambda x, n: torch.view_as_real(torch.fft.rfft(x[..., 0], n=n, dim=1))),
    ((2, 5, 2), {"inverse": 1}, 3, lambda x, n: torch.view_as_real(torch.fft.ifft(torch.view_as_complex(x), n=n, dim=1))),
    (
        (2, 4, 2),
        {"inverse": 1, "onesided": 1},
        None,
        lambda x, n: torch.fft.irfft(torch.view_as_complex(x), n=n, dim=1)[..., None],
    ),
    ((2, 4, 2), {"inverse": 1, "onesided": 1}, 5, lambda x, n: torch.fft.irfft(torch.view_as_complex(x), n=n, dim=1)[..., None]),
]


def _consts(length):
    consts = {"dft_length": np.array(length, dtype=np.int64)} if length is not None else {"": None}
    consts["axis"] = np.array(1, dtype=np.int64)
    return consts


@pytest.mark.parametrize("x_shape,attrs,length,fn", FORMS)
def test_gradients_match_torch_fft(x_shape, attrs, length, fn):
    inputs = {"x": rng.normal(size=x_shape)}
    n = length or (2 * (x_shape[1] - 1) if attrs.get("inverse") and attrs.get("onesided") else x_shape[1])
    out_shape = tuple(fn(torch.tensor(inputs["x"]), n).shape)
    consts = _consts(length)
    order = ["x", "dft_length" if length is not None else "", "axis"]
    got, w = run_gradgen("DFT", inputs, {k: v for k, v in consts.items() if k}, attrs, [out_shape], opset=20, order=order)
    assert_close(got, torch_grads(lambda x: fn(x, n), inputs, w), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("x_shape,attrs,length,fn", FORMS)
def test_kernel_matches_the_reference_and_torch(x_shape, attrs, length, fn):
    x = rng.normal(size=x_shape)
    names = ["x", "dft_length" if length is not None else "", "axis"]
    inits = [helper.make_tensor("axis", TensorProto.INT64, [], [1])]
    if length is not None:
        inits.append(helper.make_tensor("dft_length", TensorProto.INT64, [], [length]))
    graph = helper.make_graph(
        [helper.make_node("DFT", names, ["y"], **attrs)],
        "dft",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    got = Session(model).run({"x": x})["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, {"x": x})[0], rtol=1e-12, atol=1e-12)
    n = length or (2 * (x_shape[1] - 1) if attrs.get("inverse") and attrs.get("onesided") else x_shape[1])
    np.testing.assert_allclose(got, fn(torch.tensor(x), n).numpy(), rtol=1e-12, atol=1e-12)


# -- STFT ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("onesided", [0, 1])
@pytest.mark.parametrize("length,step,width", [(16, 4, 8), (11, 3, 5)])
def test_stft_kernel_and_gradients_match_torch(length, step, width, onesided):
    inputs = {"signal": rng.normal(size=(2, length, 1)), "window": rng.uniform(0.2, 1.0, width)}

    def torch_stft(signal, window):
        spectrum = torch.stft(
            signal[..., 0], width, hop_length=step, window=window, center=False, onesided=bool(onesided), return_complex=True
        )
        return torch.view_as_real(spectrum.transpose(1, 2))  # (batch, frames, bins, 2)

    want_y = torch_stft(torch.tensor(inputs["signal"]), torch.tensor(inputs["window"]))
    consts = {"step": np.array(step, dtype=np.int64)}
    order = ["signal", "step", "window"]
    graph = helper.make_graph(
        [helper.make_node("STFT", order, ["y"], onesided=onesided)],
        "stft",
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, v.shape) for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, None)],
        initializer=[helper.make_tensor("step", TensorProto.INT64, [], [step])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    got_y = Session(model).run(inputs)["y"]
    np.testing.assert_allclose(got_y, want_y.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_y, ReferenceEvaluator(model).run(None, inputs)[0], rtol=1e-12, atol=1e-12)
    got, w = run_gradgen("STFT", inputs, consts, {"onesided": onesided}, [tuple(want_y.shape)], opset=17, order=order)
    assert_close(got, torch_grads(torch_stft, inputs, w), rtol=1e-9, atol=1e-10)


def test_stft_of_a_signal_of_unknown_length_is_left_in_place_and_its_gradient_refused():
    import gradgen

    graph = helper.make_graph(
        [
            helper.make_node("STFT", ["signal", "step"], ["y"], name="spectrum"),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ],
        "stft",
        [helper.make_tensor_value_info("signal", TensorProto.DOUBLE, [1, "samples", 1])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[helper.make_tensor("step", TensorProto.INT64, [], [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(gradgen.ModelError, match="STFT node 'spectrum' .*static signal length"):
        gradgen.build_backward(model, wrt_inputs=True)
