"""Finite-difference checking of gradient rules on one-node models, in float64.

A ``GradCase`` describes one forward node: op type, inputs (numpy arrays; float64 ones are
differentiated unless listed in ``const``), attributes. ``check_case`` builds a model whose loss is
sum(w_k * y_k) over the node's float outputs with fixed random weights w_k, builds its backward graph
with gradgen, runs it on gradgen's executor and compares every gradient with central differences.
With ``symbolic=True`` every input dimension is made symbolic, so shapes are only known at run time
(this exercises the Shape -> BroadcastGradientArgs path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

import gradgen
from gradgen.executor import Session


@dataclasses.dataclass
class GradCase:
    op_type: str
    inputs: list[Any]  # numpy arrays, or None for an omitted optional input
    attrs: dict[str, Any] = dataclasses.field(default_factory=dict)
    domain: str = ""
    const: tuple[int, ...] = ()  # float inputs held constant (become initializers, no gradient)
    num_outputs: int = 1
    opset: int = 17
    name: str = ""
    rtol: float = 1e-5
    atol: float = 1e-6  # relative to the largest |gradient| (or 1)
    eps: float = 1e-6
    symbolic: bool = True  # also check with every input dimension symbolic
    # False where ONNX's own shape inference rejects the forward node in float64 (the float
    # constants of MeanVarianceNormalization's function body): the backward graph is then checked
    # without it
    full_check: bool = True
    # False for ONNX Runtime training's ops of the ONNX domain (MaxPoolGrad, AveragePoolGrad), which
    # ONNX's checker does not know at all
    checked: bool = True

    @property
    def id(self) -> str:
        return self.name or self.op_type


def _value_info(name: str, array: np.ndarray, symbolic: bool) -> onnx.ValueInfoProto:
    dims = [f"{name}_d{i}" for i in range(array.ndim)] if symbolic else list(array.shape)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def case_model(case: GradCase, symbolic: bool = False, seed: int = 0) -> tuple[onnx.ModelProto, dict, list[str]]:
    """The forward model of a case, its feeds, and the names of the differentiated inputs."""
    rng = np.random.default_rng(seed)
    graph_inputs, initializers, feeds, input_names, diff = [], [], {}, [], []
    for i, array in enumerate(case.inputs):
        if array is None:
            input_names.append("")
            continue
        name = f"in{i}"
        input_names.append(name)
        array = np.asarray(array)
        if array.dtype.kind == "f" and i not in case.const:
            graph_inputs.append(_value_info(name, array, symbolic))
            feeds[name] = array
            diff.append(name)
        else:
            initializers.append(numpy_helper.from_array(array, name))
    outputs = [f"out{k}" for k in range(case.num_outputs)]
    nodes = [helper.make_node(case.op_type, input_names, outputs, domain=case.domain, name="node", **case.attrs)]
    # loss = sum_k sum(out_k * w_k) for float outputs; the weights are inputs of matching shape.
    probe = Session(_single_node_model(case, nodes, graph_inputs, initializers, outputs)).run(feeds)
    terms, loss_dtype = [], None
    for k, out in enumerate(outputs):
        value = probe[out]
        if value.dtype.kind != "f":
            continue
        w = rng.uniform(0.5, 1.5, value.shape).astype(value.dtype)
        initializers.append(numpy_helper.from_array(w, f"w{k}"))
        nodes += [
            helper.make_node("Mul", [out, f"w{k}"], [f"t{k}"]),
            helper.make_node("ReduceSum", [f"t{k}"], [f"s{k}"], keepdims=0),
        ]
        loss_dtype = loss_dtype or value.dtype
        if value.dtype != loss_dtype:
            nodes.append(helper.make_node("Cast", [f"s{k}"], [f"c{k}"], to=helper.np_dtype_to_tensor_dtype(loss_dtype)))
            terms.append(f"c{k}")
        else:
            terms.append(f"s{k}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    loss_type = helper.np_dtype_to_tensor_dtype(np.dtype(loss_dtype))
    graph = helper.make_graph(
        nodes, case.id, graph_inputs, [helper.make_tensor_value_info("loss", loss_type, [])], initializer=initializers
    )
    model = _make_model(case, graph)
    return model, feeds, diff


def _single_node_model(case, nodes, graph_inputs, initializers, outputs):
    graph = helper.make_graph(
        nodes,
        "probe",
        graph_inputs,
        [helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None) for o in outputs],
        initializer=initializers,
    )
    return _make_model(case, graph)


def _make_model(case, graph):
    opsets = [helper.make_opsetid("", case.opset)]
    if case.domain:
        opsets.append(helper.make_opsetid(case.domain, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def numeric_gradient(session: Session, feeds: dict, name: str, eps: float) -> np.ndarray:
    """Central differences of the scalar loss with respect to feeds[name], element by element."""
    base = feeds[name]
    grad = np.zeros_like(base)
    flat = grad.reshape(-1)
    for j in range(base.size):
        shifted = base.copy().reshape(-1)
        shifted[j] += eps
        plus = session.run({**feeds, name: shifted.reshape(base.shape)})["loss"]
        shifted[j] -= 2 * eps
        minus = session.run({**feeds, name: shifted.reshape(base.shape)})["loss"]
        flat[j] = (plus - minus) / (2 * eps)
    return grad


def check_case(case: GradCase, symbolic: bool = False) -> None:
    model, feeds, diff = case_model(case, symbolic)
    built = gradgen.build_backward(model, wrt=diff)
    proto = gradgen.api.ir.to_proto(built.model)
    if case.checked:
        onnx.checker.check_model(proto, full_check=case.full_check)
    got = Session(built.model).run(feeds)
    forward = Session(model)
    for name in diff:
        want = numeric_gradient(forward, feeds, name, case.eps)
        assert got[f"{name}_grad"].shape == feeds[name].shape, f"{case.id}: shape of {name}_grad"
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        np.testing.assert_allclose(
            got[f"{name}_grad"], want, rtol=case.rtol, atol=case.atol * scale, err_msg=f"{case.id}: gradient of input {name}"
        )
