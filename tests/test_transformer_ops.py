"""ONNX Runtime's transformer forward ops (com.microsoft Gelu, FastGelu, BiasGelu, QuickGelu,
SkipLayerNormalization, SkipSimplifiedLayerNormalization, BiasDropout; SimplifiedLayerNormalization
of the ONNX domain): the CPU kernels against onnxruntime, their standard-op forms (DecomposePass)
against the kernels, BiasDropout's training mode refused, and a BERT-like block built with them
whose gradients match the same block written with standard ops. Finite-difference cases are in
tests/grad_cases (elementwise, norm)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import GradgenError, ModelError
from gradgen.executor import Session
from gradgen.ops.schemas import FUSED_FORWARD_OPS, LOWERED_FORWARD_OPS
from gradgen.passes.lowering import lookup_lowering

ort = pytest.importorskip("onnxruntime")
MS = "com.microsoft"
rng = np.random.default_rng(5)


def r(*shape):
    return rng.uniform(-2, 2, shape).astype(np.float32)


def _model(op, domain, inputs, num_outputs, attrs, dtype=TensorProto.FLOAT, opset=17):
    names = [f"i{k}" if a is not None else "" for k, a in enumerate(inputs)]
    outputs = [f"o{k}" for k in range(num_outputs)]
    node = helper.make_node(op, names, outputs, domain=domain, name="node", **attrs)
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, inputs) if n
    ]
    graph = helper.make_graph(
        [node],
        op,
        graph_inputs,
        [
            helper.make_tensor_value_info(o, TensorProto.BOOL if op == "BiasDropout" and k else dtype, None)
            for k, o in enumerate(outputs)
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)], ir_version=8)
    return model, {n: a for n, a in zip(names, inputs) if n}


FORWARD = [
    ("Gelu", MS, [r(2, 3, 4)], 1, {}),
    ("FastGelu", MS, [r(2, 3, 4), r(4)], 1, {}),
    ("FastGelu", MS, [r(3, 4)], 1, {}),
    ("BiasGelu", MS, [r(2, 3, 4), r(4)], 1, {}),
    ("QuickGelu", MS, [r(2, 5)], 1, {}),
    ("QuickGelu", MS, [r(2, 5)], 1, {"alpha": 1.3}),
    ("SkipLayerNormalization", MS, [r(2, 3, 4), r(2, 3, 4), r(4), r(4), r(4)], 4, {"epsilon": 1e-5}),
    ("SkipLayerNormalization", MS, [r(2, 3, 4), r(3, 4), r(4)], 4, {}),
    ("SkipLayerNormalization", MS, [r(2, 3, 4), r(1, 3, 4), r(4), None, r(4)], 4, {}),
    ("SkipSimplifiedLayerNormalization", MS, [r(2, 3, 4), r(2, 3, 4), r(4), r(4)], 4, {"epsilon": 1e-5}),
    ("SimplifiedLayerNormalization", "", [r(2, 3, 4), r(4)], 2, {"epsilon": 1e-5}),
    ("SimplifiedLayerNormalization", "", [r(2, 3, 4), r(3, 4)], 2, {"axis": 1}),
    ("BiasDropout", MS, [r(2, 3, 4), r(4), r(2, 3, 4)], 2, {}),
]


@pytest.mark.parametrize("op,domain,inputs,num_outputs,attrs", FORWARD, ids=[f"{c[0]}-{k}" for k, c in enumerate(FORWARD)])
def test_kernel_and_standard_form_match_onnxruntime(op, domain, inputs, num_outputs, attrs):
    model, feeds = _model(op, domain, inputs, num_outputs, attrs)
    if op == "BiasDropout":  # ONNX Runtime has no CPU kernel for it: its inference-mode definition
        total = inputs[0] + inputs[1] + (inputs[2] if inputs[2] is not None else 0)
        want = [total, np.ones(total.shape, dtype=bool)]
    else:
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = Session(model).run(feeds)
    # the standard-op form, as build_backward differentiates it
    standard = _standard_form(model)
    assert not [n for n in standard.graph.node if n.op_type == op], "the pass left the op in place"
    formed = Session(standard).run(feeds)
    for k, expected in enumerate(want):
        if op == "SkipSimplifiedLayerNormalization" and k == 1:
            continue  # the mean: ONNX Runtime does not compute it (gradgen gives zeros)
        for result in (got, formed):
            value = result[f"o{k}"]
            assert value.shape == expected.shape and value.dtype == expected.dtype, (k, value.shape, expected.shape)
            np.testing.assert_allclose(value, expected, rtol=2e-5, atol=2e-5)


def _standard_form(model):
    import onnx_ir as ir

    from gradgen.passes import DecomposePass
    from gradgen.passes.standard import ShapeInferencePass

    lowered = ir.serde.deserialize_model(model)
    ShapeInferencePass()(lowered)
    DecomposePass()(lowered)
    return ir.serde.serialize_model(lowered)


@pytest.mark.parametrize(
    "op,domain,inputs,num_outputs",
    [
        ("SkipLayerNormalization", MS, [r(2, 3, 4), r(2, 3, 4), r(4), r(4), r(4)], 4),
        ("SkipSimplifiedLayerNormalization", MS, [r(2, 3, 4), r(3, 4), r(4)], 3),
        ("SimplifiedLayerNormalization", "", [r(2, 3, 4), r(4)], 2),
        ("FastGelu", MS, [r(2, 3, 4), r(4)], 1),
    ],
)
def test_float16_statistics_are_float32_as_in_onnxruntime(op, domain, inputs, num_outputs):
    inputs = [a.astype(np.float16) for a in inputs]
    model, feeds = _model(op, domain, inputs, num_outputs, {}, dtype=TensorProto.FLOAT16)
    for k in range(1, min(num_outputs, 3)):  # mean, inv_std_var
        model.graph.output[k].type.tensor_type.elem_type = TensorProto.FLOAT
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got, formed = Session(model).run(feeds), Session(_standard_form(model)).run(feeds)
    for k, expected in enumerate(want):
        if op == "SkipSimplifiedLayerNormalization" and k == 1:
            continue  # the mean: ONNX Runtime does not compute it
        assert got[f"o{k}"].dtype == formed[f"o{k}"].dtype == expected.dtype, k
        np.testing.assert_allclose(got[f"o{k}"].astype(np.float32), expected, rtol=1e-3, atol=1e-3)
        # the form rounds each step to float16 (one ulp near 4 is 2e-3)
        np.testing.assert_allclose(formed[f"o{k}"].astype(np.float32), expected, rtol=2e-3, atol=4e-3)


def test_every_lowered_forward_op_has_a_lowering_and_a_cpu_kernel():
    from gradgen.kernels import registry

    for domain, op in LOWERED_FORWARD_OPS:
        assert lookup_lowering(domain, op) is not None, op
        assert registry.lookup(domain, op).cpu is not None, op


def test_bias_dropout_in_training_mode_is_refused_naming_the_node():
    model, feeds = _model("BiasDropout", MS, [r(2, 4), r(4), None, np.array(0.1, np.float32), np.array(True)], 1, {})
    model.graph.input.pop()  # training_mode becomes an initializer: a constant true
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "i4"))
    del feeds["i4"]
    loss = helper.make_node("ReduceSum", ["o0"], ["loss"], keepdims=0)
    model.graph.node.append(loss)
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    with pytest.raises(ModelError, match="'node'.*training mode"):
        gradgen.build_backward(model, wrt=["i0"])
    with pytest.raises(GradgenError, match="training mode"):
        Session(model).run(feeds)


# -- a BERT-like block: ORT's fused ops vs the same block in standard ops ------------------------

H, S, B = 4, 3, 2


def _bert_block(fused: bool):
    """x -> SkipLayerNorm(x, x W1 + b1) -> FFN (Gelu) -> SkipLayerNorm -> RMS norm -> BiasDropout, summed."""
    d = TensorProto.DOUBLE
    n = helper.make_node
    nodes = [n("MatMul", ["x", "W1"], ["h"])]
    if fused:
        nodes += [
            n("SkipLayerNormalization", ["x", "h", "g1", "be1", "b1"], ["ln1"], domain=MS, epsilon=1e-5),
            n("MatMul", ["ln1", "W2"], ["f"]),
            n("FastGelu", ["f", "b2"], ["a"], domain=MS),
            n("BiasGelu", ["a", "b3"], ["a2"], domain=MS),
            n("QuickGelu", ["a2"], ["a3"], domain=MS),
            n("SkipSimplifiedLayerNormalization", ["a3", "ln1", "g2"], ["ln2"], domain=MS, epsilon=1e-5),
            n("SimplifiedLayerNormalization", ["ln2", "g3"], ["ln3"], epsilon=1e-5),
            n("BiasDropout", ["ln3", "b4", "x"], ["y"], domain=MS),
        ]
    else:
        c = lambda name, v: n("Constant", [], [name], value=numpy_helper.from_array(np.array(v, dtype=np.float64)))  # noqa: E731
        nodes += [
            c("half", 0.5),
            c("one", 1.0),
            c("k", np.sqrt(2 / np.pi)),
            c("cub", 0.044715),
            c("rs2", 1 / np.sqrt(2)),
            c("alpha", 1.702),
            c("eps", 1e-5),
            n("Add", ["x", "h"], ["s0"]),
            n("Add", ["s0", "b1"], ["s1"]),
            n("LayerNormalization", ["s1", "g1", "be1"], ["ln1"], epsilon=1e-5),
            n("MatMul", ["ln1", "W2"], ["f"]),
            n("Add", ["f", "b2"], ["z"]),
            n("Gelu", ["z"], ["a"], approximate="tanh"),
            n("Add", ["a", "b3"], ["z2"]),
            n("Gelu", ["z2"], ["a2"]),
            n("Mul", ["a2", "alpha"], ["qa"]),
            n("Sigmoid", ["qa"], ["qs"]),
            n("Mul", ["a2", "qs"], ["a3"]),
            n("Add", ["a3", "ln1"], ["s2"]),
            n("RMSNormalization", ["s2", "g2"], ["ln2"], epsilon=1e-5),
            n("RMSNormalization", ["ln2", "g3"], ["ln3"], epsilon=1e-5),
            n("Add", ["ln3", "b4"], ["y0"]),
            n("Add", ["y0", "x"], ["y"]),
        ]
    nodes += [n("Mul", ["y", "w"], ["yw"]), n("ReduceSum", ["yw"], ["loss"], keepdims=0)]
    params = {
        "W1": rng.uniform(-1, 1, (H, H)),
        "W2": rng.uniform(-1, 1, (H, H)),
        **{k: rng.uniform(0.5, 1.5, H) for k in ("g1", "g2", "g3")},
        **{k: rng.uniform(-1, 1, H) for k in ("be1", "b1", "b2", "b3", "b4")},
        "w": rng.uniform(-1, 1, (B, S, H)),
    }
    inits = [numpy_helper.from_array(v, k) for k, v in params.items()]
    graph = helper.make_graph(
        nodes, "bert", [helper.make_tensor_value_info("x", d, [B, S, H])], [helper.make_tensor_value_info("loss", d, [])], inits
    )
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10), [k for k in params if k != "w"]


def test_bert_block_with_fused_ops_has_the_gradients_of_its_standard_form():
    x = np.random.default_rng(9).uniform(-1, 1, (B, S, H))
    results = []
    for fused in (True, False):
        global rng
        rng = np.random.default_rng(3)  # the same parameters for both blocks
        model, params = _bert_block(fused)
        backward = gradgen.build_backward(model, wrt=["x", *params])
        results.append(Session(backward.model).run({"x": x}))
    fused, standard = results
    assert set(fused) == set(standard)
    for name in fused:
        np.testing.assert_allclose(fused[name], standard[name], rtol=1e-9, atol=1e-10, err_msg=name)


def test_bias_dropout_with_a_run_time_training_mode_is_refused_naming_the_node():
    model, _ = _model("BiasDropout", MS, [r(2, 4), r(4), None, np.array(0.0, np.float32), np.array(True)], 1, {})
    model.graph.node.append(helper.make_node("ReduceSum", ["o0"], ["loss"], keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    with pytest.raises(ModelError, match="'node'.*not constant"):
        gradgen.build_backward(model, wrt=["i0"])


@pytest.mark.parametrize("domain,op", sorted(LOWERED_FORWARD_OPS - FUSED_FORWARD_OPS))
def test_a_node_left_in_place_reaching_the_gradient_pass_is_a_one_line_error(domain, op):
    from types import SimpleNamespace

    from gradgen.grads.registry import lookup_rule

    rule = lookup_rule(domain, op)
    assert rule is not None and rule.differentiable
    with pytest.raises(ModelError, match=rf"^{op} node 'n' reached the gradient pass: .*DecomposePass") as caught:
        rule.fn(SimpleNamespace(node=SimpleNamespace(op_type=op, name="n")))
    assert "\n" not in str(caught.value)
