"""The CPU plan's rewrites of a tied embedding's gradient (gradgen/executor/cpu_rewrites.py):
Sum(A, ScatterND(ConstantOfShape(0), indices, updates, add)) runs as one ScatterND into A where
nothing else reads the zeros, the scatter or A; any other shape of the pattern is left as it is.
Sum(A, GatherGrad(shape, indices, dY)) (the default graph's form) runs as one step that adds into A.
Results are checked against numpy (bit for bit with distinct indices, to rounding with repeats)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import KernelError
from gradgen.executor import Session

ROWS, WIDTH = 80, 64  # zeros of 5,120 elements: above what the plan folds into a constant


def _model(*, fill=0.0, reduction="add", a_is_output=False, zeros_shape=(ROWS, WIDTH), a_rows=ROWS, scatter_read_twice=False):
    """y = Sum(A, ScatterND(ConstantOfShape(zeros_shape, fill), indices, updates)), A = x @ w."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"]),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=numpy_helper.from_array(np.array([fill], np.float32))),
        helper.make_node("ScatterND", ["zeros", "indices", "updates"], ["scattered"], reduction=reduction),
        helper.make_node("Sum", ["a", "scattered"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if a_is_output:
        outputs.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, None))
    if scatter_read_twice:
        nodes.append(helper.make_node("Neg", ["scattered"], ["minus"]))
        outputs.append(helper.make_tensor_value_info("minus", TensorProto.FLOAT, None))
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [a_rows, 16]),
        helper.make_tensor_value_info("indices", TensorProto.INT64, [12, 1]),
        helper.make_tensor_value_info("updates", TensorProto.FLOAT, [12, WIDTH]),
    ]
    constants = [
        numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, WIDTH)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(zeros_shape, np.int64), "shape"),
    ]
    graph = helper.make_graph(nodes, "tied", inputs, outputs, initializer=constants)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _feeds(indices, a_rows=ROWS):
    rng = np.random.default_rng(2)
    return {
        "x": rng.standard_normal((a_rows, 16)).astype(np.float32),
        "indices": np.asarray(indices, np.int64).reshape(12, 1),
        "updates": rng.standard_normal((12, WIDTH)).astype(np.float32),
    }


def _expected(model, feeds, fill=0.0):
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    zeros = np.full((ROWS, WIDTH), fill, np.float32)
    np.add.at(zeros, feeds["indices"][:, 0], feeds["updates"])
    return feeds["x"] @ w + zeros


def _ops(session) -> list[str]:
    return [step.op_type for step in session.steps]


def test_the_tied_embedding_sum_scatters_into_the_other_addend():
    model = _model()
    session = Session(model)
    assert _ops(session) == ["MatMul", "ScatterND"]
    distinct = _feeds(np.arange(12) * 5)
    np.testing.assert_array_equal(session.run(distinct)["y"], _expected(model, distinct))
    repeated = _feeds([3, 3, 7, 3, 0, 7, 79, 1, 1, 3, 5, 0])
    np.testing.assert_allclose(session.run(repeated)["y"], _expected(model, repeated), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "changed",
    [
        dict(fill=1.0),
        dict(fill=-0.0),
        dict(reduction="none"),
        dict(a_is_output=True),
        dict(scatter_read_twice=True),
        dict(a_rows=1),  # A broadcasts against the zeros: the scatter could not write into it
    ],
    ids=["fill 1", "fill -0", "reduction none", "A is an output", "the scatter read twice", "A broadcast"],
)
def test_other_shapes_of_the_pattern_are_left_alone(changed):
    model = _model(**changed)
    session = Session(model)
    assert "Sum" in _ops(session) and "ConstantOfShape" in _ops(session)
    feeds = _feeds(np.arange(12) * 5, a_rows=changed.get("a_rows", ROWS))
    got = session.run(feeds)["y"]
    assert got.shape == (ROWS, WIDTH)
    if "a_rows" not in changed:
        want = _expected(model, feeds, fill=changed.get("fill", 0.0))
        if changed.get("reduction") == "none":
            want = feeds["x"] @ numpy_helper.to_array(model.graph.initializer[0])
            want[feeds["indices"][:, 0]] += feeds["updates"]
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _gather_grad_model(*, a_rows=ROWS, gather_read_twice=False, axis=0, table=(ROWS, WIDTH)):
    """y = Sum(A, GatherGrad(shape, indices, dY)) (ONNX Runtime's contract, the default graph's
    embedding gradient), A = x @ w with no declared shape."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"]),
        helper.make_node("GatherGrad", ["shape", "indices", "dy"], ["gathered"], domain="com.microsoft", axis=axis),
        helper.make_node("Sum", ["a", "gathered"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if gather_read_twice:
        nodes.append(helper.make_node("Neg", ["gathered"], ["minus"]))
        outputs.append(helper.make_tensor_value_info("minus", TensorProto.FLOAT, None))
    dy_shape = [12, table[1]] if axis == 0 else [table[0], 12]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [a_rows, 16]),
        helper.make_tensor_value_info("indices", TensorProto.INT64, [12]),
        helper.make_tensor_value_info("dy", TensorProto.FLOAT, dy_shape),
    ]
    constants = [
        numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, table[1])).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(table, np.int64), "shape"),
    ]
    graph = helper.make_graph(nodes, "tied_default", inputs, outputs, initializer=constants)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _gather_feeds(indices, dy_shape=(12, WIDTH), a_rows=ROWS):
    rng = np.random.default_rng(3)
    return {
        "x": rng.standard_normal((a_rows, 16)).astype(np.float32),
        "indices": np.asarray(indices, np.int64),
        "dy": rng.standard_normal(dy_shape).astype(np.float32),
    }


def _gather_expected(model, feeds, axis=0):
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "w"))
    a = feeds["x"] @ w
    table = np.zeros((ROWS, w.shape[1]), np.float32)
    if axis == 0:
        np.add.at(table, feeds["indices"], feeds["dy"])
    else:
        np.add.at(table.T, feeds["indices"], feeds["dy"].T)
    return a + table


@pytest.mark.parametrize("axis", [0, 1])
def test_the_default_graphs_embedding_sum_adds_the_rows_into_the_other_addend(axis):
    """Sum(A, GatherGrad(...)) runs as one step that adds dY's slices into A, in place where A
    dies (the zeros of the table's size and the Sum's pass are gone), negative indices wrapped."""
    table = (ROWS, WIDTH) if axis == 0 else (ROWS, ROWS)
    model = _gather_grad_model(axis=axis, table=table)
    session = Session(model)
    assert _ops(session) == ["MatMul", "GatherGrad"]
    assert "(into" in session.steps[1].node_name
    assert session.steps[1].reuse == (0,)  # A dies at the step: written in place
    dy_shape = (12, WIDTH) if axis == 0 else (ROWS, 12)
    distinct = _gather_feeds(np.arange(12) * 5, dy_shape)
    np.testing.assert_array_equal(session.run(distinct)["y"], _gather_expected(model, distinct, axis))
    repeated = _gather_feeds([3, 3, 7, 3, 0, 7, 79, 1, 1, 3, 5, -1], dy_shape)
    want = _gather_expected(model, repeated | {"indices": repeated["indices"] % ROWS}, axis)
    np.testing.assert_allclose(session.run(repeated)["y"], want, rtol=1e-6, atol=1e-6)


def test_the_gather_grad_sum_keeps_its_meaning_where_it_cannot_add_in_place():
    """A that broadcasts against the table: the step sums as the two nodes did; a GatherGrad read
    elsewhere too is left as it is; an out-of-range index names the rewritten step."""
    model = _gather_grad_model(a_rows=1)
    session = Session(model)
    feeds = _gather_feeds(np.arange(12) * 5, a_rows=1)
    w = numpy_helper.to_array(model.graph.initializer[0])
    table = np.zeros((ROWS, WIDTH), np.float32)
    np.add.at(table, feeds["indices"], feeds["dy"])
    np.testing.assert_allclose(session.run(feeds)["y"], feeds["x"] @ w + table, rtol=1e-6, atol=1e-6)
    twice = Session(_gather_grad_model(gather_read_twice=True))
    assert "Sum" in _ops(twice)
    with pytest.raises(KernelError, match=r"\(into .*GatherGrad\): index 83 .* out of range"):
        Session(_gather_grad_model()).run(_gather_feeds([ROWS + 3] + list(range(11))))


def test_the_gather_grad_sum_adds_into_a_transposed_addend():
    """loss = sum(Transpose(x) * w) + sum(Gather(x, 0) * v): x's gradient is Sum(Transpose(...),
    GatherGrad(...)), whose first addend is a transposed view. The rewritten step added dY's rows
    into a copy in that view's order, through a reshape that was then a copy too: the Gather's
    share was lost, silently (found by the long fuzz profile, seed 32). Checked against the
    gradient worked out by hand, on the default graph (the rewrite) and the portable one."""
    import gradgen

    rng = np.random.default_rng(32)
    w, v = rng.uniform(0.5, 1.5, (2, 2, 1)), rng.uniform(0.5, 1.5, (2, 2))
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"]),
        helper.make_node("Mul", ["t", "w"], ["tw"]),
        helper.make_node("ReduceSum", ["tw"], ["a"], keepdims=0),
        helper.make_node("Gather", ["x", "index"], ["g"], axis=0),
        helper.make_node("Mul", ["g", "v"], ["gv"]),
        helper.make_node("ReduceSum", ["gv"], ["b"], keepdims=0),
        helper.make_node("Sum", ["a", "b"], ["loss"]),
    ]
    constants = {"w": w, "v": v, "index": np.array(0, np.int64)}
    graph = helper.make_graph(
        nodes,
        "transposed_addend",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 2, 2])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[numpy_helper.from_array(value, name) for name, value in constants.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    want = w.transpose(2, 1, 0) + v[None]
    x = rng.standard_normal((1, 2, 2))
    for portable in (False, True):
        built = gradgen.build_backward(model, wrt=["x"], portable=portable)
        got = Session(built.model).run({"x": x})["x_grad"]
        np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=f"portable={portable}")
