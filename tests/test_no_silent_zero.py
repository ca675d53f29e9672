"""A gradient that is asked for is the true one or an error, never a silent zero (issue: Clip's bounds).

The walker distinguishes inputs whose gradient is zero by definition (indices, shapes, CastLike's
target) from float inputs that change the output but have no rule (Resize's roi and scales): a
differentiated tensor reaching one of those is an error naming the node. The default --wrt picks
only tensors with a differentiable path to the loss.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError
from gradgen.grads.registry import all_rules


def _resize_model():
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [
        helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear", name="up"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[scales],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_default_wrt_skips_tensors_that_only_configure_an_op():
    built = gradgen.build_backward(_resize_model(), wrt_inputs=True)
    assert built.gradient_names == ["x_grad"]


def test_asking_for_a_gradient_gradgen_cannot_give_is_an_error_naming_the_node():
    with pytest.raises(ModelError, match=r"input 2 \('scales'\) of Resize node 'up'"):
        gradgen.build_backward(_resize_model(), wrt=["scales"])


def _float_capable_inputs(op_type: str) -> set[int]:
    """Input positions whose ONNX type constraint admits a float type (newest schema); none for ONNX
    Runtime training's ops of the ONNX domain, which ONNX does not define (MaxPoolGrad's Indices
    are int64 there)."""
    if not onnx.defs.has(op_type):
        return set()
    schema = onnx.defs.get_schema(op_type)
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    positions = set()
    for i, formal in enumerate(schema.inputs):
        types = allowed.get(formal.type_str, {formal.type_str})
        if types & {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}:
            positions.add(i)
    return positions


# Float inputs a rule may mark non-differentiable, each with why its gradient is zero.
ZERO_BY_DEFINITION = {
    ("", "CastLike"): {1},  # only the element type of the target matters
    # the ratio does not act in inference mode; in training mode it draws the random mask (a step
    # function of it), and neither ONNX Runtime training nor PyTorch differentiates it
    ("", "Dropout"): {1},
    # the rois are rounded to whole pixels before the bins are cut, so the output is piecewise
    # constant in them (zero gradient almost everywhere; torchvision's roi_pool gives them none either)
    ("", "MaxRoiPool"): {1},
    # the limit only sets the integer number of steps: Range's output is piecewise constant in it
    ("", "Range"): {1},
    # OneHot's indices and depth may be floats, but they are rounded to positions and a count: the
    # output is piecewise constant in them
    ("", "OneHot"): {0, 1},
}


def test_float_inputs_marked_nondifferentiable_have_a_zero_gradient_by_definition():
    for (domain, op_type), rule in all_rules().items():
        if domain or not rule.nondiff_inputs:
            continue
        silent = rule.nondiff_inputs & _float_capable_inputs(op_type) - ZERO_BY_DEFINITION.get((domain, op_type), set())
        assert not silent, (
            f"{op_type} marks float input(s) {sorted(silent)} non-differentiable: give them a gradient, "
            "or list them in unsupported_inputs (an error when asked for)"
        )


def test_a_rule_that_gives_no_gradient_for_a_wanted_input_is_reported(monkeypatch):
    from gradgen.grads import registry

    rule = registry.lookup_rule("", "Relu")
    monkeypatch.setitem(registry._RULES, ("", "Relu"), registry.GradRule("", "Relu", lambda g: [None]))
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"], name="act"), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"node 'act' \(Relu\).*no gradient for input 0"):
        gradgen.build_backward(model, wrt_inputs=True)
    assert rule is not None


def test_an_unknown_element_type_is_a_model_error_naming_the_tensor_and_its_node():
    import onnx_ir as ir

    from gradgen.builder import numpy_dtype_of

    node = ir.Node("", "Relu", [ir.Value(name="x")], outputs=[ir.Value(name="y")], name="act")
    with pytest.raises(ModelError, match=r"'y' \(output of Relu node 'act'\) is unknown"):
        numpy_dtype_of(node.outputs[0])
