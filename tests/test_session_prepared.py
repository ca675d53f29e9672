"""What the Session prepares once (feed checks, argument fetching, float32 promotion, cached
reshape targets and reduction axes) must behave per run exactly as if worked out on every run."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.errors import RunError
from gradgen.executor import Session


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(nodes, "prepared", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _symbolic_add():
    """y = a + b with a: [batch, 3], b: [batch, 3] (one symbol shared by two inputs)."""
    return _model(
        [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
    )


def test_feeds_are_checked_on_every_run_whatever_came_before():
    session = Session(_symbolic_add())
    ones = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(session.run({"a": ones, "b": ones})["y"], 2 * ones)
    five = np.ones((5, 3), np.float32)
    np.testing.assert_array_equal(session.run({"a": five, "b": five})["y"], 2 * five)  # a new binding of batch
    bad = [
        ({"a": ones, "b": five}, "dimension 0 ('batch') is 5, but input 'a' set 'batch' to 2"),
        ({"a": ones.astype(np.float64), "b": ones}, "dtype float64, but the model declares float32"),
        ({"a": np.ones((2, 4), np.float32), "b": ones}, "dimension 1 is 4, but the model declares 3"),
        ({"a": np.ones(3, np.float32), "b": ones}, "rank 1"),
        ({"a": ones}, "missing input(s) 'b'"),
        ({"a": ones, "b": ones, "c": ones}, "unknown input name(s) 'c'"),
        ({"a": ones, "c": ones}, "missing input(s) 'b'; unknown input name(s) 'c'"),
    ]
    for feeds, message in bad:
        with pytest.raises(RunError, match=None) as info:
            session.run(feeds)
        assert message in str(info.value), (feeds.keys(), str(info.value))
    np.testing.assert_array_equal(session.run({"a": ones, "b": ones})["y"], 2 * ones)


def test_absent_optional_inputs_reach_the_kernel_as_none():
    """Clip(x, <absent min>, max): the empty input name is fetched as None, not looked up."""
    top = helper.make_tensor("top", TensorProto.FLOAT, [], [0.5])
    session = Session(
        _model(
            [helper.make_node("Clip", ["x", "", "top"], ["y"], name="clip")],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
            [top],
        )
    )
    x = np.array([-2.0, 0.0, 0.25, 3.0], np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(session.run({"x": x})["y"], np.minimum(x, 0.5))


def test_a_float16_input_still_runs_in_float32_when_nothing_is_declared_low():
    """The step's declared output says nothing of float16; its argument does, at run time. ReduceL2 of
    [300, 400] squares in float16 to inf (past 65504); in float32, rounded once at the end: 500."""
    session = Session(
        _model(
            [helper.make_node("ReduceL2", ["x"], ["y"], keepdims=0, name="norm")],
            [helper.make_tensor_value_info("x", TensorProto.FLOAT16, None)],
            [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
        )
    )
    assert not session.steps[0].low_precision
    x = np.array([300, 400], np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(np.sqrt(np.add.reduce(x * x)))  # what a float16 computation would give
    for _ in range(2):
        y = session.run({"x": x})["y"]
        assert y.dtype == np.float16 and y == 500


def _reshape_and_reduce():
    """y = ReduceSum(Reshape(x, shape), axes); shape and axes are inputs, so they may change per run."""
    return _model(
        [
            helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
            helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0, name="sum"),
        ],
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [None]),
            helper.make_tensor_value_info("axes", TensorProto.INT64, [None]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )


def test_cached_reshape_targets_and_axes_follow_their_inputs_and_errors_repeat():
    session = Session(_reshape_and_reduce())
    x = np.arange(12, dtype=np.float32).reshape(2, 6)

    def run(shape, axes):
        return session.run({"x": x, "shape": np.array(shape, np.int64), "axes": np.array(axes, np.int64)})["y"]

    for _ in range(2):
        np.testing.assert_array_equal(run([3, -1], [1]), x.reshape(3, 4).sum(axis=1))
        np.testing.assert_array_equal(run([0, 3, 2], [-1, 0]), x.reshape(2, 3, 2).sum(axis=(0, 2)))
        with pytest.raises(RunError, match="at most one dimension may be -1"):
            run([-1, -1], [0])
        with pytest.raises(RunError, match="repeated reduction axes"):
            run([3, 4], [1, -1])
