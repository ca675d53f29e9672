"""The emitted backward graph follows ONNX Runtime training's patterns for the com.microsoft ops.

For Slice, Gather, GatherElements and Conv: op type, domain, input order, attributes copied from the
forward node, omitted optional outputs, and a type on every com.microsoft output; the built model
passes ``onnx.checker.check_model(full_check=True)``.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session

MS = "com.microsoft"


def _model(nodes, inputs, initializers=(), opset=17):
    """Forward graph ``nodes`` producing ``y``; loss = ReduceSum(y * y)."""
    nodes = list(nodes) + [
        helper.make_node("Mul", ["y", "y"], ["y2"], name="square"),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0, name="total"),
    ]
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])], initializer=list(initializers)
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _build(model, wrt):
    built = gradgen.build_backward(model, wrt=wrt)
    proto = gradgen.api.ir.to_proto(built.model)
    onnx.checker.check_model(proto, full_check=True)
    return built, proto


def _only(proto, op_type):
    found = [n for n in proto.graph.node if n.op_type == op_type]
    assert len(found) == 1, f"expected one {op_type} node, got {len(found)}"
    return found[0]


def _attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _typed(proto):
    """Names that carry an element type in the serialized graph (value_info, inputs, outputs)."""
    typed = {}
    for vi in list(proto.graph.value_info) + list(proto.graph.output) + list(proto.graph.input):
        if vi.type.tensor_type.elem_type:
            typed[vi.name] = vi.type.tensor_type.elem_type
    return typed


def _producer(proto, name):
    for n in proto.graph.node:
        if name in n.output:
            return n
    return None


def _ms_outputs_typed(proto, elem_type=TensorProto.DOUBLE):
    typed = _typed(proto)
    for n in proto.graph.node:
        if n.domain == MS:
            for out in n.output:
                if out:
                    assert typed.get(out) == elem_type, f"{n.op_type} output {out!r} has no {elem_type} type"


def _opset(proto, domain):
    return {o.domain: o.version for o in proto.opset_import}.get(domain)


def _value_info(name, shape, elem=TensorProto.DOUBLE):
    return helper.make_tensor_value_info(name, elem, shape)


def _ints(name, values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


# ------------------------------------------------------------------------------ Slice


@pytest.mark.parametrize("symbolic", [False, True])
def test_slice_emits_slice_grad_with_forward_inputs_in_position(symbolic):
    shape = ["a", "b"] if symbolic else [4, 6]
    model = _model(
        [
            helper.make_node("Neg", ["x"], ["xn"], name="neg"),
            helper.make_node("Slice", ["xn", "starts", "ends", "axes", "steps"], ["y"], name="slice"),
        ],
        [_value_info("x", shape)],
        [_ints("starts", [1, -1]), _ints("ends", [np.iinfo(np.int64).max, -7]), _ints("axes", [0, -1]), _ints("steps", [2, -2])],
    )
    built, proto = _build(model, ["x"])
    node = _only(proto, "SliceGrad")
    assert node.domain == MS and _opset(proto, MS) == 1
    assert list(node.input[2:]) == ["starts", "ends", "axes", "steps"]
    assert node.input[0] == "y_grad"
    assert not node.attribute
    shape_input = node.input[1]
    if symbolic:
        producer = _producer(proto, shape_input)
        assert producer.op_type == "Shape" and list(producer.input) == ["xn"]
    else:
        init = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        assert init[shape_input].tolist() == [4, 6] and init[shape_input].dtype == np.int64
    assert node.output[0] == "xn_grad"  # an intermediate: it must carry a type (no shape inference)
    _ms_outputs_typed(proto)
    x = np.arange(24, dtype=np.float64).reshape(4, 6)
    got = Session(built.model).run({"x": x})["x_grad"]
    want = np.zeros_like(x)
    want[1::2, ::-2] = 2 * x[1::2, ::-2]
    np.testing.assert_allclose(got, want)


def test_slice_with_omitted_optional_inputs():
    model = _model(
        [helper.make_node("Slice", ["x", "starts", "ends"], ["y"], name="slice")],
        [_value_info("x", [3, 5])],
        [_ints("starts", [1]), _ints("ends", [3])],
    )
    _, proto = _build(model, ["x"])
    node = _only(proto, "SliceGrad")
    assert len(node.input) == 4 and list(node.input[2:]) == ["starts", "ends"]

    model = _model(
        [helper.make_node("Slice", ["x", "starts", "ends", "", "steps"], ["y"], name="slice")],
        [_value_info("x", [3, 5])],
        [_ints("starts", [0]), _ints("ends", [3]), _ints("steps", [2])],
    )
    _, proto = _build(model, ["x"])
    node = _only(proto, "SliceGrad")
    assert list(node.input[2:]) == ["starts", "ends", "", "steps"]


# ------------------------------------------------------------------------------ Gather


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("index_type", [np.int64, np.int32])
def test_gather_emits_gather_grad(symbolic, index_type):
    shape = ["a", "b", "c"] if symbolic else [2, 5, 3]
    indices = numpy_helper.from_array(np.array([[4, -1], [0, 4]], dtype=index_type), "idx")
    model = _model(
        [
            helper.make_node("Neg", ["x"], ["xn"], name="neg"),
            helper.make_node("Gather", ["xn", "idx"], ["y"], axis=-2, name="gather"),
        ],
        [_value_info("x", shape)],
        [indices],
    )
    built, proto = _build(model, ["x"])
    node = _only(proto, "GatherGrad")
    assert node.domain == MS
    assert node.input[1:] == ["idx", "y_grad"]
    assert _attrs(node) == {"axis": -2}
    producer = _producer(proto, node.input[0])
    if symbolic:
        assert producer.op_type == "Shape" and list(producer.input) == ["xn"]
    else:
        assert producer is None
        init = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
        assert init[node.input[0]].tolist() == [2, 5, 3]
    assert list(node.output) == ["xn_grad"]
    _ms_outputs_typed(proto)
    x = np.random.default_rng(0).uniform(-1, 1, (2, 5, 3))
    got = Session(built.model).run({"x": x})["x_grad"]
    want = np.zeros_like(x)
    for i in np.array([[4, -1], [0, 4]]).reshape(-1):
        want[:, i, :] += 2 * x[:, i, :]
    np.testing.assert_allclose(got, want)


# ------------------------------------------------------------------------------ GatherElements


@pytest.mark.parametrize("symbolic", [False, True])
def test_gather_elements_emits_gather_elements_grad(symbolic):
    shape = ["a", "b"] if symbolic else [3, 4]
    indices = numpy_helper.from_array(np.array([[1, 1, -1], [0, 3, 3], [2, 2, 2]], dtype=np.int64), "idx")
    model = _model(
        [
            helper.make_node("Neg", ["x"], ["xn"], name="neg"),
            helper.make_node("GatherElements", ["xn", "idx"], ["y"], axis=1, name="ge"),
        ],
        [_value_info("x", shape)],
        [indices],
    )
    _, proto = _build(model, ["x"])
    node = _only(proto, "GatherElementsGrad")
    assert node.domain == MS
    assert node.input[0] == "y_grad" and node.input[2] == "idx"
    assert _attrs(node) == {"axis": 1}
    producer = _producer(proto, node.input[1])
    assert (producer is not None and producer.op_type == "Shape") == symbolic
    assert list(node.output) == ["xn_grad"]
    _ms_outputs_typed(proto)


# ------------------------------------------------------------------------------ Conv

CONV_ATTRS = {
    "auto_pad": "NOTSET",
    "dilations": [1, 2],
    "group": 2,
    "kernel_shape": [2, 2],
    "pads": [1, 0, 0, 1],
    "strides": [2, 1],
}


def _conv_model(bias: bool, attrs: dict, symbolic: bool = False):
    x_shape = ["n", "c", "h", "w"] if symbolic else [1, 4, 5, 5]
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.uniform(-1, 1, (2, 2, 2, 2)), "W")]
    inputs = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.uniform(-1, 1, (2,)), "B"))
        inputs.append("B")
    return _model([helper.make_node("Conv", inputs, ["y"], name="conv", **attrs)], [_value_info("x", x_shape)], inits)


@pytest.mark.parametrize("symbolic", [False, True])
def test_conv_emits_one_conv_grad_with_forward_attributes(symbolic):
    model = _conv_model(True, CONV_ATTRS, symbolic)
    built, proto = _build(model, ["x", "W", "B"])
    node = _only(proto, "ConvGrad")
    assert node.domain == MS
    assert list(node.input) == ["y_grad", "x", "W"]
    forward = _attrs(_only(proto, "Conv"))
    assert _attrs(node) == forward
    assert {k: (v.decode() if isinstance(v, bytes) else v) for k, v in forward.items()} == CONV_ATTRS
    assert list(node.output) == ["x_grad", "W_grad", "B_grad"]
    _ms_outputs_typed(proto)
    assert {o.name for o in proto.graph.output} >= {"x_grad", "W_grad", "B_grad"}


def test_conv_without_bias_has_two_outputs():
    _, proto = _build(_conv_model(False, CONV_ATTRS), ["x", "W"])
    node = _only(proto, "ConvGrad")
    assert list(node.output) == ["x_grad", "W_grad"]
    _ms_outputs_typed(proto)


def test_conv_frozen_input_gives_empty_output_name():
    _, proto = _build(_conv_model(True, CONV_ATTRS), ["W", "B"])
    node = _only(proto, "ConvGrad")
    assert list(node.output) == ["", "W_grad", "B_grad"]
    _ms_outputs_typed(proto)


def test_conv_frozen_bias_drops_the_bias_output():
    _, proto = _build(_conv_model(True, CONV_ATTRS), ["x", "W"])
    node = _only(proto, "ConvGrad")
    assert list(node.output) == ["x_grad", "W_grad"]


def test_conv_only_bias():
    _, proto = _build(_conv_model(True, CONV_ATTRS), ["B"])
    node = _only(proto, "ConvGrad")
    assert list(node.output) == ["", "", "B_grad"]
    _ms_outputs_typed(proto)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv_auto_pad_is_copied(auto_pad):
    attrs = {"auto_pad": auto_pad, "group": 2, "strides": [2, 1]}
    built, proto = _build(_conv_model(True, attrs), ["x", "W", "B"])
    node = _only(proto, "ConvGrad")
    got = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in _attrs(node).items()}
    assert got == attrs
    Session(built.model).run({"x": np.ones((1, 4, 5, 5))})
