"""Gradients through control flow the data decides: an If whose condition is computed at run time
(nested too), a while loop with a data-dependent stop, a Loop whose trip count is a graph input
(loop-carried state, scan outputs, outer weights read in the body), a Scan of a run-time length,
zero iterations. Checked by
finite differences in float64, against PyTorch's autograd, and in ONNX Runtime (the portable
graphs give what gradgen's executor gives)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import gradgen
from gradgen.check import check_gradients
from gradgen.executor import Session
from tests.control_flow_models import (
    if_model,
    if_reading_nothing_model,
    loop_feeds,
    loop_model,
    nested_if_model,
    nested_run_time_loops_model,
    scan_feeds,
    scan_model,
    weights,
    while_model,
)
from tests.test_cli import run_cli
from tests.test_control_flow import SCANS


def _x(sign: float, seed: int = 0) -> np.ndarray:
    """A (2, 4) input whose sum has the given sign."""
    return sign * (np.abs(np.random.default_rng(seed).normal(size=(2, 4))) + 0.1)


def _while_x(scale: float) -> np.ndarray:
    return np.random.default_rng(0).normal(size=(2, 4)) * scale


def _m_feeds(steps: int) -> dict[str, np.ndarray]:
    return loop_feeds(3) | {"M": np.array(steps, dtype=np.int64)}


def _check(model: onnx.ModelProto, feeds: dict, loss: str | None = None) -> None:
    report = check_gradients(model, inputs=feeds, wrt_inputs=True, loss=loss)
    assert report.passed, report.format()


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["then", "else"])
@pytest.mark.parametrize("make", [if_model, if_reading_nothing_model], ids=["branches read W, W2", "else reads nothing"])
def test_if_chosen_by_the_data_matches_finite_differences(make, sign):
    _check(make(), {"x": _x(sign)})


def test_if_gradient_is_an_if_on_the_same_condition_whose_branches_agree():
    built = gradgen.build_backward(if_model("data"), wrt_inputs=True).model
    (backward,) = [n for n in built.graph if n.op_type == "If" and n.name != "choose"]
    assert backward.inputs[0].name == "c"
    then_branch, else_branch = backward.attributes["then_branch"].value, backward.attributes["else_branch"].value
    for a, b in zip(then_branch.outputs, else_branch.outputs, strict=True):
        assert (a.dtype, list(a.shape)) == (b.dtype, list(b.shape))
    onnx.checker.check_model(ir.to_proto(built), full_check=True)
    got = Session(built).run({"x": _x(-1.0)})
    np.testing.assert_array_equal(got["W_grad"], np.zeros((4, 4)))  # the else branch does not read W


def _nested_path(x: np.ndarray) -> str:
    if x.sum() <= 0:
        return "outer else"
    return "inner then" if (x @ weights()).sum() > 0 else "inner else"


# x > 0 along the rows of W that sum to more than zero: sum(x @ W) > 0
NESTED_FEEDS = [_x(1.0, 3) * np.where(weights().sum(axis=1) > 0, 1.0, 0.1), _x(1.0, 0), _x(-1.0, 1)]


def test_nested_if_matches_finite_differences_on_every_path():
    assert sorted(_nested_path(x) for x in NESTED_FEEDS) == ["inner else", "inner then", "outer else"]
    for x in NESTED_FEEDS:
        _check(nested_if_model(), {"x": x})


@pytest.mark.parametrize("scale", [1.0, 0.3, 30.0], ids=["a few iterations", "more iterations", "zero iterations"])
def test_while_loop_with_a_data_dependent_stop_matches_finite_differences(scale):
    x = _while_x(scale)
    iterations = Session(while_model()).run({"x": x})["nT"]
    assert (iterations == 0) == (scale == 30.0) and iterations < 20
    _check(while_model(), {"x": x}, loss="loss")


@pytest.mark.parametrize("steps", [3, 1, 0])
def test_loop_with_a_trip_count_fed_at_run_time_matches_finite_differences(steps):
    _check(loop_model(trip_count=None), _m_feeds(steps))


def test_loop_whose_body_computes_its_condition_matches_finite_differences():
    _check(loop_model(condition="computed"), loop_feeds(3))


def _nested_loops_feeds(m: int, n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(m + 10 * n)
    return {"h0": rng.normal(size=(2, 4)) * 0.1, "k0": np.abs(rng.normal(size=(2, 4))), "M": np.array(m), "N": np.array(n)}


def _outer_iterations(feeds: dict) -> int:
    """How many times nested_run_time_loops_model's outer loop runs (the same loop in numpy)."""
    h, k = feeds["h0"], feeds["k0"]
    for i in range(int(feeds["M"])):
        g = h
        for _ in range(int(feeds["N"])):
            g = np.sin(g * k)
        h = h + g + k
        if h.sum() >= 10.0:
            return i + 1
    return int(feeds["M"])


@pytest.mark.parametrize("m, n", [(2, 3), (2, 0), (0, 2), (50, 1)], ids=["2 x 3", "inner zero", "outer zero", "stops early"])
def test_run_time_loop_in_a_run_time_loop_matches_finite_differences(m, n):
    feeds = _nested_loops_feeds(m, n)
    assert (_outer_iterations(feeds) < m) == (m == 50)
    _check(nested_run_time_loops_model(), feeds)


def _symbolic_scan(length: int = 3, **kw) -> tuple[onnx.ModelProto, dict]:
    """scan_model with its sequence length a symbolic dimension T (known only at run time)."""
    model = scan_model(length=max(length, 1), **kw)
    feeds = scan_feeds(model)
    axis = kw.get("in_axis", 0)
    model.graph.input[0].type.tensor_type.shape.dim[axis].dim_param = "T"
    feeds["x"] = np.take(feeds["x"], range(length), axis=axis)
    return model, feeds


@pytest.mark.parametrize("kw", list(SCANS.values()), ids=list(SCANS))
def test_scan_of_a_run_time_length_becomes_a_loop_that_matches_finite_differences(kw):
    model, feeds = _symbolic_scan(**kw)
    assert "Scan" not in {n.op_type for n in gradgen.build_backward(model, wrt_inputs=True).model.graph}
    _check(model, feeds)


def test_run_time_loop_gradient_is_a_reverse_loop_and_leaves_the_model_alone():
    forward = ir.from_proto(loop_model(trip_count=None))
    built = gradgen.build_backward(forward, wrt_inputs=True).model
    loops = [n for n in built.graph if n.op_type == "Loop"]
    assert len(loops) == 2 and len(loops[0].outputs) == 2 + 2  # hT, ys, then the saved i and h
    assert len(next(n for n in forward.graph if n.op_type == "Loop").outputs) == 2
    onnx.checker.check_model(ir.to_proto(built), full_check=True)


def test_run_time_control_flow_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    # If: then x @ W, else x - W2
    for sign in (1.0, -1.0):
        x = torch.tensor(_x(sign), requires_grad=True)
        w = torch.tensor(weights(), requires_grad=True)
        w2 = torch.tensor(weights(2)[:2], requires_grad=True)
        y = x @ w if x.sum() > 0 else x - w2
        (y * y).sum().backward()
        got = Session(gradgen.build_backward(if_model("data"), wrt_inputs=True).model).run({"x": _x(sign)})
        for name, tensor in (("x", x), ("W", w), ("W2", w2)):
            want = np.zeros(tensor.shape) if tensor.grad is None else tensor.grad.numpy()  # the branch not taken
            np.testing.assert_allclose(got[f"{name}_grad"], want, rtol=1e-12, atol=1e-14)
    # the while loop, as a Python loop
    model = while_model()
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    x = torch.tensor(_while_x(0.3), requires_grad=True)
    w = torch.tensor(inits["W"], requires_grad=True)
    a = torch.tensor(inits["a"], requires_grad=True)
    h, n, ys = x, 0, []
    while torch.linalg.norm(h) < 20.0:
        t = torch.tanh(h @ w)
        h = 2 * h + (t * a if h.sum() > 0 else t - a)
        ys.append(h * a)
        n += 1
    ((h * h).sum() + torch.stack(ys).sum() + n).backward()
    got = Session(gradgen.build_backward(model, wrt_inputs=True, loss="loss").model).run({"x": _while_x(0.3)})
    assert got["nT"] == n > 1
    for name, tensor in (("x", x), ("W", w), ("a", a)):
        np.testing.assert_allclose(got[f"{name}_grad"], tensor.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "model, feeds, loss",
    [
        (if_model("data"), {"x": _x(1.0)}, None),
        (loop_model(trip_count=None), _m_feeds(3), None),
        (while_model(), {"x": _while_x(0.3)}, "loss"),
    ],
    ids=["if", "trip count M", "while with an if"],
)
def test_gradients_of_gradients_through_run_time_control_flow_match_finite_differences(model, feeds, loss):
    """loss2 = sum(W_grad * V) on the backward graph (its If / Loop nodes differentiated again)."""
    proto = ir.to_proto(gradgen.build_backward(model, wrt_inputs=True, loss=loss).model)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.random.default_rng(1).normal(size=(4, 4)), "V"))
    proto.graph.node.extend(
        [onnx.helper.make_node("Mul", ["W_grad", "V"], ["wv"]), onnx.helper.make_node("ReduceSum", ["wv"], ["loss2"], keepdims=0)]
    )
    proto.graph.output.append(onnx.helper.make_tensor_value_info("loss2", onnx.TensorProto.DOUBLE, []))
    report = check_gradients(proto, inputs=feeds, loss="loss2", wrt=["W", "x"])
    assert report.passed, report.format()


CASES = {
    "if then": (if_model("data"), {"x": _x(1.0)}, None),
    "if else": (if_model("data"), {"x": _x(-1.0)}, None),
    "nested if": (nested_if_model(), {"x": NESTED_FEEDS[1]}, None),
    "while": (while_model(), {"x": _while_x(0.3)}, "loss"),
    "while, zero iterations": (while_model(), {"x": _while_x(30.0)}, "loss"),
    "trip count M": (loop_model(trip_count=None), _m_feeds(3), None),
    "M = 0": (loop_model(trip_count=None), _m_feeds(0), None),
    "loop in a loop": (nested_run_time_loops_model(), _nested_loops_feeds(50, 1), None),
    "scan of length T": (*_symbolic_scan(**SCANS["reversed in and out, axis 1 in, last axis out"]), None),
    "scan of length 0": (*_symbolic_scan(0), None),
}


@pytest.mark.parametrize("model, feeds, loss", list(CASES.values()), ids=list(CASES))
def test_portable_graphs_run_in_onnxruntime_as_in_gradgen(model, feeds, loss):
    built = gradgen.build_backward(model, wrt_inputs=True, loss=loss)
    portable = gradgen.build_backward(model, wrt_inputs=True, loss=loss, portable=True).model
    assert not {n.domain for n in ir.traversal.RecursiveGraphIterator(portable.graph)} - {"", "ai.onnx"}
    proto = ir.to_proto(portable)
    onnx.checker.check_model(proto, full_check=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # ONNX Runtime warns about the unused initializers of a zero-iteration body
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    theirs = dict(zip(names, session.run(None, feeds)))
    ours, default = Session(portable).run(feeds), Session(built.model).run(feeds)
    for name in [built.loss, *built.gradient_names]:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=1e-13, err_msg=name)
        np.testing.assert_allclose(default[name], theirs[name], rtol=1e-12, atol=1e-13, err_msg=name)


def _with_custom_op(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` whose Loop body's Tanh is an op of a domain gradgen has no rule for."""
    body = next(a for a in model.graph.node[0].attribute if a.name == "body").g
    tanh = next(n for n in body.node if n.op_type == "Tanh")
    tanh.op_type, tanh.domain, tanh.name = "Squash", "test.custom", "squash"
    model.opset_import.append(onnx.helper.make_opsetid("test.custom", 1))
    return model


def test_a_body_op_without_a_rule_is_a_one_line_model_error(tmp_path, capsys, monkeypatch):
    path, out = tmp_path / "m.onnx", tmp_path / "g.onnx"
    onnx.save(_with_custom_op(loop_model(trip_count=None)), path)
    code, _, err = run_cli(capsys, monkeypatch, "build-backward", path, "-o", out, "--wrt-inputs")
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert "node 'loop' (Loop), its body: 1 op type(s) without a gradient rule: test.custom::Squash: node(s) 'squash'" in err
    assert not out.exists()


class _Cond:
    """torch.cond on the data: tanh(x @ w) or x * v."""

    @staticmethod
    def module(torch):
        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.tensor(weights()))
                self.v = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4, dtype=torch.float64))

            def forward(self, x):
                y = torch.cond(x.sum() > 0, lambda x, w, v: torch.tanh(x @ w), lambda x, w, v: x * v, (x, self.w, self.v))
                return (y * y).sum()

            def reference(self, x):
                return self(x)

        return Module()


class _While:
    """torch's while_loop: h <- 2 h + sin(h) * w while sum(h * h) < 100."""

    @staticmethod
    def module(torch):
        from torch._higher_order_ops.while_loop import while_loop

        class Module(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))

            def forward(self, x):
                (h,) = while_loop(lambda h: (h * h).sum() < 100.0, lambda h: (h * 2 + torch.sin(h) * self.w,), (x,))
                return (h * h).sum()

            def reference(self, x):
                """The same loop in Python: torch 2.13's eager while_loop gives w a nonzero gradient
                when the loop runs zero times."""
                h = x
                while (h * h).sum() < 100.0:
                    h = h * 2 + torch.sin(h) * self.w
                return (h * h).sum()

        return Module()


@pytest.mark.slow  # the dynamo exporter takes seconds
@pytest.mark.parametrize("kind", [_Cond, _While], ids=["torch.cond", "while_loop"])
def test_torch_exports_of_cond_and_while_loop_match_torch_autograd(kind, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")
    module = kind.module(torch)
    inputs = [_x(1.0), _x(-1.0)] if kind is _Cond else [_while_x(0.5), _while_x(0.05), _while_x(30.0)]
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation notes
        torch.onnx.export(module, (torch.tensor(inputs[0]),), path, dynamo=True, verbose=False)
    built = gradgen.build_backward(str(path), wrt_inputs=True)
    session = Session(built.model)
    params = dict(module.named_parameters())
    gradient_of = dict(zip(built.wrt, built.gradient_names))  # also torch's constants, exported as initializers
    assert set(params) | {"x"} <= set(gradient_of)
    for x in inputs:
        module.zero_grad()
        tensor = torch.tensor(x, requires_grad=True)
        module.reference(tensor).backward()
        got = session.run({"x": x})
        for name, value in [*params.items(), ("x", tensor)]:
            want = np.zeros(value.shape) if value.grad is None else value.grad.numpy()  # None: the branch not taken
            np.testing.assert_allclose(got[gradient_of[name]], want, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["if else", "while", "trip count M", "scan of length T"])
def test_run_time_control_flow_gradients_on_the_gpu_match_the_cpu(case):
    model, feeds, loss = CASES[case]
    built = gradgen.build_backward(model, wrt_inputs=True, loss=loss).model
    want = Session(built).run(feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bodies run on the host
        got = Session(built, device="cuda").run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
