"""LSTM, GRU and RNN: the CPU kernels and the unrolled form (UnrollRecurrentPass) against ONNX Runtime
on the original node, errors, and gradients of PyTorch-exported nn.LSTM / nn.GRU / nn.RNN against
PyTorch's autograd. The finite-difference cases are in tests/grad_cases/recurrent.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import ModelError, RunError
from gradgen.executor import Session
from gradgen.passes import EvaluateConstantsPass, GradientPass, GradientSpec, Pipeline, UnrollRecurrentPass
from tests.grad_cases.recurrent import LENS, inputs

INPUT_NAMES = ["X", "W", "R", "B", "sequence_lens", "initial_h", "initial_c", "P"]


def _node_model(op_type, arrays, attrs, num_outputs, time_dim=None):
    names, graph_inputs, feeds = [], [], {}
    for name, array in zip(INPUT_NAMES, arrays):
        if array is None:
            names.append("")
            continue
        names.append(name)
        shape = list(array.shape)
        if name == "X" and time_dim is not None:
            shape[attrs.get("layout", 0)] = time_dim
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), shape))
        feeds[name] = array
    outputs = ["Y", "Y_h", "Y_c"][:num_outputs]
    node = helper.make_node(op_type, names, outputs, name="rec", **attrs)
    graph = helper.make_graph(
        [node], "g", graph_inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), feeds


def _ort_reference(op_type, arrays, attrs, num_outputs):
    """ONNX Runtime's outputs; it has no layout 1, so that runs as layout 0 on transposed data."""
    import onnxruntime as ort

    layout = attrs.get("layout", 0)
    if layout:
        arrays = [a.transpose(1, 0, 2) if a is not None and k in (0, 5, 6) else a for k, a in enumerate(arrays)]
        attrs = {**attrs, "layout": 0}
    model, feeds = _node_model(op_type, arrays, attrs, num_outputs)
    outs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    if layout:
        outs = [o.transpose(2, 0, 1, 3) if o.ndim == 4 else o.transpose(1, 0, 2) for o in outs]
    return outs


def _unrolled(model):
    forward = ir.from_proto(model)
    Pipeline(EvaluateConstantsPass(), UnrollRecurrentPass())(forward)
    assert not [n.op_type for n in forward.graph if n.op_type in ("LSTM", "GRU", "RNN")]
    return forward


H = 2
FORWARD_CASES = [
    ("LSTM", {}, {}),
    ("LSTM", {"direction": "reverse"}, {"lens": LENS}),
    ("LSTM", {"direction": "bidirectional", "layout": 1}, {"lens": LENS, "peepholes": True}),
    ("LSTM", {"direction": "bidirectional"}, {"initial": False, "bias": False}),
    ("LSTM", {"direction": "bidirectional"}, {"lens": np.array([0, 3], dtype=np.int32)}),  # an empty sequence
    ("LSTM", {"clip": 0.5, "input_forget": 1}, {"peepholes": True}),
    ("LSTM", {"activations": ["HardSigmoid", "Tanh", "Softsign"], "activation_alpha": [0.3], "activation_beta": [0.4]}, {}),
    ("GRU", {}, {}),
    ("GRU", {"linear_before_reset": 1, "direction": "bidirectional"}, {"lens": LENS}),
    ("GRU", {"direction": "reverse", "layout": 1}, {"lens": LENS, "initial": False}),
    ("GRU", {"clip": 0.7, "linear_before_reset": 1}, {"bias": False}),
    ("GRU", {"activations": ["LeakyRelu", "Elu"], "activation_alpha": [0.2, 0.6]}, {}),
    ("GRU", {"activations": ["Sigmoid", "ScaledTanh"], "activation_alpha": [1.5], "activation_beta": [0.5]}, {}),
    ("RNN", {}, {}),
    ("RNN", {"direction": "bidirectional", "layout": 1, "activations": ["Relu", "Tanh"]}, {"lens": LENS}),
    ("RNN", {"activations": ["Affine"], "activation_alpha": [0.5], "activation_beta": [0.2]}, {"initial": False}),
    ("RNN", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.1], "clip": 1.0}, {}),
]


@pytest.mark.parametrize("time_dim", [None, "T"], ids=["static", "run-time-length"])
@pytest.mark.parametrize("op_type,attrs,kw", FORWARD_CASES, ids=lambda v: str(v))
def test_kernel_and_unrolled_form_match_onnxruntime(op_type, attrs, kw, time_dim):
    """A static length unrolls into its steps; a length known at run time becomes a Loop of them."""
    attrs = {"hidden_size": H, **attrs}
    directions = 2 if attrs.get("direction") == "bidirectional" else 1
    arrays = [
        a if a is None or a.dtype.kind != "f" else a.astype(np.float32)
        for a in inputs(op_type, directions, attrs.get("layout", 0), **kw)
    ]
    num_outputs = 3 if op_type == "LSTM" else 2
    want = _ort_reference(op_type, arrays, attrs, num_outputs)
    model, feeds = _node_model(op_type, arrays, attrs, num_outputs, time_dim)
    rewritten = _unrolled(model)
    assert any(n.op_type == "Loop" for n in rewritten.graph) == (time_dim is not None)
    for got in (Session(model).run(feeds), Session(rewritten).run(feeds)):
        for name, ref in zip(["Y", "Y_h", "Y_c"], want):
            assert got[name].shape == ref.shape, name
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_only_the_outputs_read_are_unrolled_and_names_are_kept():
    arrays = [a.astype(np.float32) if a is not None and a.dtype.kind == "f" else a for a in inputs("LSTM")]
    model, feeds = _node_model("LSTM", arrays, {"hidden_size": H}, 3)
    del model.graph.output[0]  # Y is not read
    forward = _unrolled(model)
    assert [v.name for v in forward.graph.outputs] == ["Y_h", "Y_c"]
    assert not any(n.op_type == "Concat" for n in forward.graph)  # Y would concatenate the steps
    got = Session(forward).run(feeds)
    want = _ort_reference("LSTM", arrays, {"hidden_size": H}, 3)
    np.testing.assert_allclose(got["Y_h"], want[1], rtol=1e-5, atol=1e-5)


def test_sequence_lengths_beyond_the_sequence_are_a_run_error():
    arrays = [a.astype(np.float32) if a is not None and a.dtype.kind == "f" else a for a in inputs("RNN", lens=LENS)]
    model, feeds = _node_model("RNN", arrays, {"hidden_size": H}, 2)
    with pytest.raises(RunError, match=r"sequence_lens \[2, 5\]: expected 2 lengths within \[0, 3\]"):
        Session(model).run({**feeds, "sequence_lens": np.array([2, 5], dtype=np.int32)})


def test_random_sequence_lengths_are_within_the_sequence():
    from gradgen.inputs import random_feeds

    arrays = [a.astype(np.float32) if a is not None and a.dtype.kind == "f" else a for a in inputs("GRU", layout=1, lens=LENS)]
    model, _ = _node_model("GRU", arrays, {"hidden_size": H, "layout": 1}, 2)
    drawn = np.concatenate([random_feeds(ir.from_proto(model), seed=seed)["sequence_lens"] for seed in range(40)])
    assert drawn.min() >= 0 and drawn.max() == 3  # T = 3, inclusive


def _loss_model(op_type, attrs, time_dim=None):
    arrays = inputs(op_type)
    model, _ = _node_model(op_type, arrays, {"hidden_size": H, **attrs}, 2, time_dim)
    graph = model.graph
    graph.node.append(helper.make_node("ReduceSum", ["Y_h"], ["loss"], keepdims=0))
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    return model


def test_a_sequence_length_known_at_run_time_takes_any_length():
    """The Loop form runs whatever length comes, zero included (the final state is the initial one)."""
    model = _loss_model("GRU", {"linear_before_reset": 1}, time_dim="T")
    built = gradgen.build_backward(model, wrt_inputs=True)
    arrays = inputs("GRU")
    for steps in (1, 5, 0):
        feeds = {name: a for name, a in zip(INPUT_NAMES, arrays) if a is not None}
        feeds["X"] = np.random.default_rng(steps).uniform(-1, 1, (steps, *arrays[0].shape[1:]))
        got = Session(built.model).run(feeds)
        if steps:
            report = check_gradients(model, wrt_inputs=True, inputs=feeds)
            assert report.passed, report.format()
        else:
            np.testing.assert_allclose(got["loss"], feeds["initial_h"].sum())
            np.testing.assert_array_equal(got["initial_h_grad"], np.ones_like(feeds["initial_h"]))


@pytest.mark.parametrize(
    "attrs,message",
    [
        ({"activations": ["Affine"]}, r"activation Affine needs its values in activation_alpha and activation_beta"),
        ({"activations": ["Gelu"]}, r"activation 'Gelu' is not supported"),
        ({"activations": ["Tanh", "Tanh"]}, r"2 activations for 1 direction\(s\); RNN takes 1 per direction"),
        ({"direction": "sideways"}, r"direction 'sideways'"),
    ],
)
def test_unsupported_attributes_are_one_line_model_errors(attrs, message):
    with pytest.raises(ModelError, match=message) as info:
        gradgen.build_backward(_loss_model("RNN", attrs), wrt_inputs=True)
    assert "\n" not in str(info.value) and "node 'rec' (RNN)" in str(info.value)


def test_a_pipeline_without_the_unrolling_names_the_pass():
    model = ir.from_proto(_loss_model("LSTM", {}))
    with pytest.raises(ModelError, match=r"node 'rec' \(LSTM\).*run gradgen.passes.UnrollRecurrentPass before GradientPass"):
        gradgen.api.run_pipeline(Pipeline(GradientPass(GradientSpec(wrt_inputs=True))), model)


def test_check_passes_on_a_recurrent_model():
    report = gradgen.check.check_gradients(_loss_model("GRU", {"linear_before_reset": 1}), random_inputs=True, wrt_inputs=True)
    assert report.passed, report.format()


# -- PyTorch ------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")

# ONNX's gate order, as indices of PyTorch's gate chunks (LSTM: torch i f g o, ONNX i o f c;
# GRU: torch r z n, ONNX z r h)
GATE_ORDER = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}


class _Net(torch.nn.Module):
    def __init__(self, kind, **options):
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(3, 4, **options)
        # a weight per output feature, a buffer so that it is exported in the model's float type
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4 * (2 if options.get("bidirectional") else 1)))

    def forward(self, x):
        y, _ = self.rnn(x)
        return (y * self.scale).sum()


def _reorder(kind, grad):
    return np.concatenate([np.split(grad, len(GATE_ORDER[kind]))[k] for k in GATE_ORDER[kind]])


def _expected_onnx_gradients(kind, net, graph):
    """The gradients of the W, R, B inputs of each recurrent node (layer k) from PyTorch's."""
    nodes = [n for n in graph.node if n.op_type == kind]
    params = dict(net.rnn.named_parameters())
    expected = {}
    for layer, node in enumerate(nodes):
        suffixes = ["", "_reverse"] if net.rnn.bidirectional else [""]
        grads = {what: [] for what in ("W", "R", "B")}
        for sfx in suffixes:
            g = {name: params[f"{name}_l{layer}{sfx}"].grad.numpy() for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
            grads["W"].append(_reorder(kind, g["weight_ih"]))
            grads["R"].append(_reorder(kind, g["weight_hh"]))
            grads["B"].append(np.concatenate([_reorder(kind, g["bias_ih"]), _reorder(kind, g["bias_hh"])]))
        for position, what in ((1, "W"), (2, "R"), (3, "B")):
            expected[node.input[position]] = np.stack(grads[what])
    return expected


EXPORTS = [
    ("LSTM", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    ("LSTM", {"num_layers": 1}),
    ("GRU", {"num_layers": 2, "bidirectional": True}),
    ("GRU", {"num_layers": 1, "batch_first": True}),
    ("RNN", {"num_layers": 2, "nonlinearity": "relu", "bidirectional": True}),
    ("RNN", {"num_layers": 1, "batch_first": True}),
]


@pytest.mark.parametrize("dynamo", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("kind,options", EXPORTS, ids=lambda v: str(v))
def test_exported_torch_layers_match_torch_autograd(kind, options, dynamo, tmp_path):
    if dynamo:
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    net = _Net(kind, **options).double()
    x = torch.randn((2, 5, 3) if options.get("batch_first") else (5, 2, 3), dtype=torch.float64, requires_grad=True)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporters' advice on batch sizes and on the legacy exporter
        torch.onnx.export(net, (x,), str(path), dynamo=dynamo, input_names=["x"], output_names=["loss"])
    loss = net(x)
    loss.backward()
    model = onnx.load(str(path))
    built = gradgen.build_backward(model, wrt_inputs=True)
    got = Session(built.model).run({"x": x.detach().numpy()})
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-10)
    np.testing.assert_allclose(got["x_grad"], x.grad.numpy(), rtol=1e-9, atol=1e-10)
    if any(n.op_type == kind for n in model.graph.node):
        expected = _expected_onnx_gradients(kind, net, model.graph)
        assert all(f"{name}_grad" in got for name in expected)
    else:
        # The exporter decomposed the layer (dynamo, nn.RNN) and folded the first step's use of
        # bias_hh into a constant, so the parameters' gradients differ from PyTorch's by design:
        # check them by finite differences.
        report = gradgen.check.check_gradients(model, inputs={"x": x.detach().numpy()})
        assert report.passed, report.format()
        expected = {}
    for name, want in expected.items():
        np.testing.assert_allclose(got[f"{name}_grad"], want, rtol=1e-9, atol=1e-10, err_msg=name)


class _WithStates(torch.nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = getattr(torch.nn, kind)(3, 4, num_layers=2, bidirectional=True)

    def forward(self, x, *states):
        y, last = self.rnn(x, states if len(states) > 1 else states[0])
        last = last if isinstance(last, tuple) else (last,)
        return y.pow(2).mean() + sum((s * s).sum() * 0.5 for s in last)


@pytest.mark.parametrize("dynamo", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["legacy", "dynamo"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_exported_initial_states_and_final_states_match_torch_autograd(kind, dynamo, tmp_path):
    """Given initial states (graph inputs) and a loss reading Y, Y_h and Y_c."""
    if dynamo:
        pytest.importorskip("onnxscript")
    torch.manual_seed(1)
    net = _WithStates(kind).double()
    tensors = {"x": torch.randn(5, 2, 3, dtype=torch.float64), "h0": torch.randn(4, 2, 4, dtype=torch.float64)}
    if kind == "LSTM":
        tensors["c0"] = torch.randn(4, 2, 4, dtype=torch.float64)
    for t in tensors.values():
        t.requires_grad_(True)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, tuple(tensors.values()), str(path), dynamo=dynamo, input_names=list(tensors), output_names=["loss"]
        )
    net(*tensors.values()).backward()
    built = gradgen.build_backward(str(path), wrt_inputs=True)
    got = Session(built.model).run({name: t.detach().numpy() for name, t in tensors.items()})
    for name, t in tensors.items():
        np.testing.assert_allclose(got[f"{name}_grad"], t.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def test_a_symbolic_batch_is_unrolled_and_a_symbolic_length_runs_as_a_loop(tmp_path):
    """Exports with dynamic axes: the batch may vary (no step needs its size), and so may the length
    (a Loop over the steps): both match PyTorch's autograd at other sizes than the export's."""
    torch.manual_seed(2)
    net = _Net("GRU", num_layers=2, bidirectional=True).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    built = {}
    for name, axes in (("batch", {1: "batch"}), ("length", {0: "T", 1: "batch"})):
        path = tmp_path / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (x,), str(path), dynamo=False, input_names=["x"], dynamic_axes={"x": axes})
        built[name] = gradgen.build_backward(str(path), wrt_inputs=True)
    assert any(n.op_type == "Loop" for n in built["length"].model.graph)
    for name, shape in (("batch", (5, 7, 3)), ("length", (8, 3, 3)), ("length", (2, 1, 3))):
        other = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        net(other).backward()
        got = Session(built[name].model).run({"x": other.detach().numpy()})
        np.testing.assert_allclose(got["x_grad"], other.grad.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{name} {shape}")


def test_a_gradient_penalty_through_the_loop_of_a_run_time_length():
    """Gradients of gradients through the Loop form: loss2 = sum(X_grad ** 2) of an RNN whose
    length is known at run time, against finite differences of the first backward graph."""
    first = gradgen.build_backward(_loss_model("RNN", {}, time_dim="T"), wrt_inputs=True)
    proto = ir.to_proto(first.model)
    proto.graph.node.extend(
        [helper.make_node("Mul", ["X_grad", "X_grad"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss2"], keepdims=0)]
    )
    proto.graph.output.append(helper.make_tensor_value_info("loss2", TensorProto.DOUBLE, []))
    feeds = {name: a for name, a in zip(INPUT_NAMES, inputs("RNN")) if a is not None}
    report = check_gradients(proto, loss="loss2", wrt_inputs=True, inputs=feeds)
    assert report.passed and {t.name for t in report.tensors} == {"X", "W", "R", "B", "initial_h"}, report.format()
