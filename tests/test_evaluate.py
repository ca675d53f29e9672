"""The build-time evaluator (gradgen.passes.evaluate): constants folded by gradgen's CPU kernels."""

from __future__ import annotations

import time
import warnings

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.evaluate import ConstantEvaluator
from gradgen.passes.evaluate import EvaluateConstantsPass


def _model(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _const(name, array):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(array)))


def _legacy_bilinear_resize():
    """What the legacy exporter writes for F.interpolate(scale_factor=2, mode="bilinear") when it
    does not fold constants: float scales computed from Constants."""
    nodes = [
        _const("ones", np.ones(2, np.float32)),
        _const("two", np.float32(2.0)),
        helper.make_node("Mul", ["ones", "two"], ["hw"]),
        helper.make_node("Concat", ["ones", "hw"], ["scales"], axis=0),
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="linear"),
        helper.make_node("Mul", ["y", "y"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((2, 2, 3, 3)).astype(np.float32), "w")
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [w],
    )


def test_float_constant_chain_becomes_one_constant_and_the_resize_builds():
    model = _legacy_bilinear_resize()
    EvaluateConstantsPass()(model)
    scales = next(n for n in model.graph if n.op_type == "Resize").inputs[2]
    assert scales.producer().op_type == "Constant"  # a Constant, not an initializer: not a parameter
    np.testing.assert_array_equal(scales.producer().attributes["value"].value.numpy(), [1, 1, 2, 2])
    assert "scales" not in model.graph.initializers
    assert [n.op_type for n in model.graph].count("Mul") == 1  # only the data Mul is left
    assert model.graph.node(-1).outputs[0].shape is not None

    from gradgen.api import build_backward
    from gradgen.check import check_gradients

    built = build_backward(_legacy_bilinear_resize(), wrt_inputs=True)
    assert set(built.wrt) == {"w", "x"}  # the folded scales did not become a parameter
    report = check_gradients(_legacy_bilinear_resize(), wrt_inputs=True, random_inputs=True)
    assert report.passed, report.format()


def test_a_parameter_is_never_folded_into_a_new_initializer():
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["y"]),
        helper.make_node("Shape", ["w"], ["w_shape"]),
        helper.make_node("Cast", ["w_shape"], ["w_shape_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [w],
    )
    EvaluateConstantsPass()(model)
    ops = [n.op_type for n in model.graph]
    assert "Transpose" in ops and "Shape" not in ops  # W stays a parameter; its static shape folds


def test_large_initializers_are_neither_folded_nor_copied():
    big = np.ones((3_000_000,), np.float32)
    nodes = [
        helper.make_node("Neg", ["big"], ["n"]),
        helper.make_node("Shape", ["big"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["n"], ["total"], keepdims=0),
        helper.make_node("Add", ["total", "sf"], ["out"]),
    ]
    model = _model(
        nodes, [], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])], [numpy_helper.from_array(big, "big")]
    )
    tensor = model.graph.initializers["big"].const_value
    start = time.perf_counter()
    EvaluateConstantsPass(shape_inference=False)(model)
    assert time.perf_counter() - start < 1.0
    assert model.graph.initializers["big"].const_value is tensor
    assert [n.op_type for n in model.graph] == ["Neg", "Constant", "ReduceSum", "Add"]  # Cast(Shape(big)) folds


def test_a_folded_chain_leaves_one_constant_per_value_a_remaining_node_reads():
    """An exporter's Reshape target (Constant -> Unsqueeze -> Concat): its links live only in the
    fold; the Shape of a folded value folds from the value's computed shape."""
    nodes = [
        _const("b", np.array(2, np.int64)),
        _const("axes", np.array([0], np.int64)),
        helper.make_node("Unsqueeze", ["b", "axes"], ["b1"]),
        _const("rest", np.array([-1], np.int64)),
        helper.make_node("Concat", ["b1", "rest"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("Shape", ["target"], ["target_len"]),
        helper.make_node("Cast", ["target_len"], ["target_len_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
        helper.make_node("Mul", ["s", "target_len_f"], ["loss"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [1])],
    )
    EvaluateConstantsPass()(model)
    assert [n.op_type for n in model.graph] == ["Reshape", "Constant", "ReduceSum", "Mul"]
    assert list(model.graph.initializers) == ["target"]  # not b, axes, b1 or rest
    np.testing.assert_array_equal(model.graph.initializers["target"].const_value.numpy(), [2, -1])
    length = model.graph.node(1).attributes["value"].value.numpy()
    np.testing.assert_array_equal(length, [2.0])
    assert list(model.graph.node(0).outputs[0].shape) == [2, 12]


def test_an_if_whose_condition_folds_is_inlined():
    then_graph = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["t"])], "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])]
    )
    else_graph = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["e"])], "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])]
    )
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        _const("two", np.array([2], np.int64)),
        helper.make_node("Equal", ["s", "two"], ["eq"]),
        helper.make_node("Squeeze", ["eq"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_graph, else_branch=else_graph),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    EvaluateConstantsPass()(model)
    assert [n.op_type for n in model.graph] == ["Neg", "Identity"]
    assert model.graph.outputs[0].name == "y"


def test_on_demand_evaluation_is_bounded_and_reads_parameters():
    nodes = [helper.make_node("Mul", ["s", "s"], ["s2"]), helper.make_node("Add", ["s2", "x"], ["y"])]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.array([3.0], np.float32), "s")],
    )
    s2, y = (n.outputs[0] for n in model.graph)
    np.testing.assert_array_equal(ConstantEvaluator(17).value(s2), [9.0])
    assert ConstantEvaluator(17, parameters=False).value(s2) is None
    assert ConstantEvaluator(17).value(y) is None  # x is a graph input
    assert ConstantEvaluator(17).value(s2, max_nodes=0) is None


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_random_ops_are_never_folded(op):
    nodes = [_const("c", np.ones(2, np.float32)), helper.make_node(op, ["c"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    EvaluateConstantsPass()(model)
    assert op in [n.op_type for n in model.graph]


def test_folding_log_of_zero_gives_minus_inf_without_a_numpy_warning():
    """T5's relative-position buckets take log(0) of constant positions: ONNX's answer is -inf, and
    numpy's RuntimeWarning would reach the user as a note about gradgen's own arithmetic."""
    nodes = [
        _const("positions", np.array([0.0, 1.0, 4.0], np.float32)),
        helper.make_node("Log", ["positions"], ["logs"]),
        helper.make_node("Max", ["logs", "x"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EvaluateConstantsPass()(model)
    (log_node,) = [n for n in model.graph if n.op_type == "Max"]
    folded = log_node.inputs[0]
    values = (
        folded.const_value.numpy()
        if folded.const_value is not None
        else folded.producer().attributes["value"].as_tensor().numpy()
    )
    np.testing.assert_array_equal(values, np.array([-np.inf, 0.0, np.log(np.float32(4.0))], np.float32))
