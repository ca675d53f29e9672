"""If, Loop, Scan and training-mode Dropout: the CPU executor runs them as ONNX Runtime does;
loops of a static length are unrolled and differentiated (finite differences in float64, PyTorch's
autograd); Dropout's gradient reads the mask the forward drew. An If chosen at run time, Loops
and Scans of a run-time length: tests/test_run_time_control_flow.py."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import ModelError, RunError
from gradgen.executor import Session
from tests.control_flow_models import (
    dropout_model,
    dropout_weights,
    if_model,
    loop_feeds,
    loop_model,
    nested_loop_model,
    scan_8_feeds,
    scan_8_model,
    scan_8_reference,
    scan_feeds,
    scan_model,
    weights,
)

SCANS = {
    "forward": {},
    "reversed in and out, axis 1 in, last axis out": dict(in_axis=1, in_reverse=1, out_axis=-1, out_reverse=1),
    "axis 2 in, axis 1 out": dict(in_axis=2, out_axis=1),
    "one step": dict(length=1),
}


def _ort(model: onnx.ModelProto, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["loss"], feeds)[0]


@pytest.mark.parametrize(
    "kw, steps",
    [({}, 3), ({"trip_count": None}, 3), ({"condition": "computed"}, 3), ({"trip_count": 0}, 0), ({"scan_output": False}, 2)],
)
def test_loop_runs_as_onnxruntime_runs_it(kw, steps):
    options = {"trip_count": steps} | kw
    model = loop_model(**options)
    feeds = loop_feeds(steps)
    if options["trip_count"] is None:
        feeds["M"] = np.array(steps, dtype=np.int64)
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], _ort(model, feeds), rtol=1e-12)


@pytest.mark.parametrize("kw", list(SCANS.values()), ids=list(SCANS))
def test_scan_runs_as_onnxruntime_runs_it(kw):
    model = scan_model(**kw)
    feeds = scan_feeds(model)
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], _ort(model, feeds), rtol=1e-12)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_if_runs_the_branch_its_condition_picks(sign):
    model = if_model("data")
    feeds = {"x": sign * (np.abs(np.random.default_rng(0).normal(size=(2, 4))) + 0.1)}
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], _ort(model, feeds), rtol=1e-12)


@pytest.mark.parametrize(
    "model, feeds",
    [
        (loop_model(), loop_feeds()),
        (loop_model(scan_output=False, trip_count=2), loop_feeds(2)),
        *[(scan_model(**kw), scan_feeds(scan_model(**kw))) for kw in SCANS.values()],
        (if_model("initializer"), {"x": np.random.default_rng(0).normal(size=(2, 4))}),
    ],
    ids=["loop", "loop without scan outputs", *[f"scan {k}" for k in SCANS], "if on an initializer"],
)
def test_static_control_flow_gradients_match_finite_differences(model, feeds):
    report = check_gradients(model, inputs=feeds, wrt_inputs=True)
    assert report.passed, report.format()
    assert {t.name for t in report.tensors} >= {"x"}


def test_nested_loops_run_and_unroll_into_gradients_that_match_finite_differences():
    model = nested_loop_model()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(2, 4)), "h0": rng.normal(size=(2, 4))}
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], _ort(model, feeds), rtol=1e-12)
    assert not {n.op_type for n in gradgen.build_backward(model, wrt_inputs=True).model.graph} & {"Loop"}
    report = check_gradients(model, inputs=feeds, wrt_inputs=True)
    assert report.passed, report.format()


def test_unrolled_backward_graph_holds_no_loop_and_passes_the_checker():
    built = gradgen.build_backward(loop_model(), wrt_inputs=True)
    ops = {n.op_type for n in built.model.graph}
    assert not ops & {"Loop", "Scan", "If"}
    assert built.wrt == ["W", "x", "h0"]  # the body's own float initializers are no parameters
    onnx.checker.check_model(ir.to_proto(built.model), full_check=True)


def test_loop_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    feeds = loop_feeds()
    w = torch.tensor(weights(), requires_grad=True)
    x = torch.tensor(feeds["x"], requires_grad=True)
    h = h0 = torch.tensor(feeds["h0"], requires_grad=True)
    loss = 0
    for i in range(3):
        h = torch.tanh(h @ w + x[i] * (i + 1))
        loss = loss + (2 * h).sum()
    (loss + h.sum()).backward()
    got = Session(gradgen.build_backward(loop_model(), wrt_inputs=True).model).run(feeds)
    for name, tensor in (("W", w), ("x", x), ("h0", h0)):
        np.testing.assert_allclose(got[f"{name}_grad"], tensor.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_scan_of_a_symbolic_length_stacking_an_output_of_unknown_rank_on_a_later_axis_is_a_model_error():
    model = scan_model(out_axis=1)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    body = model.graph.node[0].attribute[0].g
    body.output[1].type.tensor_type.ClearField("shape")
    with pytest.raises(
        gradgen.errors.ModelError, match=r"node 'scan' \(Scan\): the rank of its scan output 0, stacked along axis 1, is unknown"
    ):
        gradgen.build_backward(model, wrt_inputs=True)


def _untyped_scan_of_a_symbolic_length() -> onnx.ModelProto:
    """scan_model as ONNX's function bodies write it: a length known at run time only, body inputs
    and outputs without types (ONNX infers them from the Scan's inputs), and an outer Constant the
    body reads for Unsqueeze's axes (its MatMul's rank is known only through that constant)."""
    model = scan_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    scan = model.graph.node[0]
    body = scan.attribute[0].g
    for value in [*body.input, *body.output]:
        value.ClearField("type")
    matmul = body.node[0]
    matmul.input[0] = "s_col"
    matmul.output[0] = "sw_col"
    body.node.insert(0, onnx.helper.make_node("Unsqueeze", ["s_in", "axis0"], ["s_col"]))
    body.node.insert(2, onnx.helper.make_node("Squeeze", ["sw_col", "axis0"], ["sw"]))
    axis0 = onnx.helper.make_node("Constant", [], ["axis0"], value=onnx.numpy_helper.from_array(np.array([0], np.int64)))
    model.graph.node.insert(0, axis0)
    return model


def test_scan_of_a_symbolic_length_with_untyped_body_inputs_differentiates_as_a_loop():
    model = _untyped_scan_of_a_symbolic_length()
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert "Loop" in {node.op_type for node in built.model.graph}
    feeds = scan_feeds(scan_model(length=4))
    report = check_gradients(model, inputs=feeds, wrt_inputs=True)
    assert report.passed, report.format()


def test_loop_of_a_run_time_length_with_untyped_body_states_is_differentiated():
    """The body's loop-carried input takes the type of its initial value, as ONNX infers it."""
    model = loop_model(trip_count=None)
    body = model.graph.node[0].attribute[0].g
    body.input[2].ClearField("type")
    feeds = {**loop_feeds(), "M": np.array(3, dtype=np.int64)}
    report = check_gradients(model, inputs=feeds, wrt_inputs=["x", "h0"])
    assert report.passed, report.format()


# -- Dropout in training mode --------------------------------------------------------------------

X = np.random.default_rng(1).uniform(0.5, 1.5, (3, 5))


def test_seeded_training_dropout_is_deterministic_and_its_mask_matches_its_values():
    model = dropout_model(mask_output=True)
    first, second = Session(model).run({"x": X}), Session(model).run({"x": X})
    mask = first["mask"]
    assert mask.dtype == bool and 0 < mask.sum() < mask.size
    np.testing.assert_array_equal(second["mask"], mask)
    np.testing.assert_allclose(first["y"], np.where(mask, X / 0.7, 0.0), rtol=1e-15)
    other = Session(dropout_model(seed=8, mask_output=True)).run({"x": X})["mask"]
    assert not np.array_equal(other, mask)


def test_training_dropout_keeps_about_one_minus_ratio():
    y = Session(_large_dropout(0.25)).run({"x": np.ones((1000, 100))})["y"]
    assert abs((y != 0).mean() - 0.75) < 0.01
    np.testing.assert_allclose(y[y != 0], 1 / 0.75)


def _large_dropout(ratio: float) -> onnx.ModelProto:
    model = dropout_model(ratio=ratio, seed=None)
    for value in model.graph.input:
        value.type.tensor_type.shape.dim[0].dim_value, value.type.tensor_type.shape.dim[1].dim_value = 1000, 100
    model.graph.output[1].type.tensor_type.shape.dim[0].dim_value = 1000
    model.graph.output[1].type.tensor_type.shape.dim[1].dim_value = 100
    del model.graph.node[1:]
    del model.graph.output[0]
    return model


def test_unseeded_training_dropout_draws_a_new_mask_each_run():
    session = Session(_large_dropout(0.5))
    x = np.ones((1000, 100))
    assert not np.array_equal(session.run({"x": x})["y"], session.run({"x": x})["y"])


@pytest.mark.parametrize("ratio", [0.3, None], ids=["constant ratio", "ratio fed at run time"])
def test_training_dropout_gradient_is_dy_times_its_mask_over_keep(ratio):
    built = gradgen.build_backward(dropout_model(ratio=ratio), wrt_inputs=True, loss="loss")
    feeds = {"x": X} if ratio is not None else {"x": X, "ratio": np.array(0.4)}
    keep = 0.7 if ratio is not None else 0.6
    got = Session(built.model).run(feeds)
    mask = got["y"] != 0  # x > 0 everywhere: an element is 0 exactly where it was dropped
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(got["x_grad"], dropout_weights() * mask / keep, rtol=1e-15)
    np.testing.assert_allclose(got["w_grad"], got["y"], rtol=1e-15)
    onnx.checker.check_model(ir.to_proto(built.model), full_check=True)


@pytest.mark.parametrize("mask_output", [False, True])
def test_training_dropout_gradients_match_finite_differences(mask_output):
    report = check_gradients(dropout_model(mask_output=mask_output), inputs={"x": X}, wrt_inputs=True, loss="loss")
    assert report.passed, report.format()


def test_training_dropout_ratio_out_of_range_is_a_run_error():
    model = dropout_model(ratio=None)
    with pytest.raises(RunError, match=r"node 'drop' \(Dropout\).*ratio 1.0: the ratio must be in \[0, 1\)"):
        Session(model).run({"x": X, "ratio": np.array(1.0)})


@pytest.mark.cuda
def test_training_dropout_and_its_gradient_on_the_gpu_match_the_cpu():
    built = gradgen.build_backward(dropout_model(), wrt_inputs=True, loss="loss").model
    want = Session(built).run({"x": X})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = Session(built, device="cuda")
        for _ in range(3):  # eager, recorded, replayed: a host step keeps the run eager
            got = session.run({"x": X})
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "model, feeds", [(loop_model(), loop_feeds()), (scan_model(), scan_feeds(scan_model()))], ids=["loop", "scan"]
)
def test_unrolled_loop_gradients_on_the_gpu_match_the_cpu(model, feeds):
    built = gradgen.build_backward(model, wrt_inputs=True).model
    want = Session(built).run(feeds)
    got = Session(built, device="cuda").run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_an_inlined_branch_output_takes_its_inferred_shape_not_the_declared_one():
    """PyTorch's legacy exporter declares the shape of one If branch's output on both branches
    (scatter_reduce on an empty-or-not input: a flattened [6] on the [2, 3] branch). Once the
    constant condition inlines the branch, the output gets the shape its nodes give, so the
    gradients downstream are shaped right (they failed to broadcast before)."""
    from onnx import TensorProto, helper

    then_branch = helper.make_graph(
        [helper.make_node("Reshape", ["x", "flat"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.DOUBLE, [6])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.DOUBLE, [6])]
    )
    nodes = [
        helper.make_node("Size", ["x"], ["n"]),
        helper.make_node("Equal", ["n", "zero"], ["empty"]),
        helper.make_node("If", ["empty"], ["y"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("Mul", ["y2", "w"], ["wy"]),
        helper.make_node("ReduceSum", ["wy"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [
            onnx.numpy_helper.from_array(np.array(0, np.int64), "zero"),
            onnx.numpy_helper.from_array(np.array([-1], np.int64), "flat"),
            onnx.numpy_helper.from_array(np.arange(6.0).reshape(2, 3), "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(4).standard_normal((2, 3))
    out = Session(gradgen.build_backward(model, wrt_inputs=True).model).run({"x": x})
    np.testing.assert_allclose(out["x_grad"], 2 * x * np.arange(6.0).reshape(2, 3))
    report = check_gradients(model, wrt_inputs=True, inputs={"x": x})
    assert report.passed, report.format()


def test_scan_8_runs_each_batch_entry_to_its_length_and_pads_with_zeros():
    feeds = scan_8_feeds()
    got = Session(scan_8_model()).run(feeds)
    want_s, want_ys = scan_8_reference(feeds)
    np.testing.assert_allclose(got["sT"], want_s, rtol=1e-12)
    np.testing.assert_allclose(got["ys"], want_ys, rtol=1e-12)
    assert not got["ys"][2].any() and not got["ys"][1, 2:].any()


def test_scan_8_whose_conversion_drops_the_batch_axis_is_refused():
    """ONNX's test_scan_sum: a Scan-8 without sequence_lens converts to opset 9+ with the batch axis
    dropped from the graph's inputs and outputs (initial [1, 2] became [2]), so the backward graph
    no longer took the user's inputs. Refused, naming the input and its two shapes."""
    from onnx import TensorProto, helper

    f = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Add", ["sum_in", "next"], ["sum_out"]), helper.make_node("Identity", ["sum_out"], ["scan_out"])],
        "body",
        [helper.make_tensor_value_info("sum_in", f, [2]), helper.make_tensor_value_info("next", f, [2])],
        [helper.make_tensor_value_info("sum_out", f, [2]), helper.make_tensor_value_info("scan_out", f, [2])],
    )
    scan = helper.make_node("Scan", ["", "initial", "x"], ["y", "z"], body=body, num_scan_inputs=1, name="scan")
    graph = helper.make_graph(
        [scan],
        "g",
        [helper.make_tensor_value_info("initial", f, [1, 2]), helper.make_tensor_value_info("x", f, [1, 3, 2])],
        [helper.make_tensor_value_info("y", f, [1, 2]), helper.make_tensor_value_info("z", f, [1, 3, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    with pytest.raises(ModelError, match=r"changes the shape of 'initial' from \[1, 2\] to \[2\]"):
        gradgen.build_backward(model, wrt_inputs=True, loss="y")
