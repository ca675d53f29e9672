"""The build's own forms of onnx-ir passes give the graphs onnx-ir's give (they differ in speed only):
common-subexpression elimination, the topological sort, batched node removal, and the data-less
model shape inference reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import common as ir_common

from gradgen.model_io import load_model
from gradgen.passes import (
    CommonSubexpressionEliminationPass,
    EvaluateConstantsPass,
    GeluFusionPass,
    GradientPass,
    GradientSpec,
    NameNodesPass,
    Pipeline,
    TopologicalSortPass,
    TransposeFusionPass,
)
from gradgen.passes.rewrite import NodeRemoval
from gradgen.passes.standard import _infer_shapes, _proto_without_weights

SAMPLES = sorted(Path(__file__).resolve().parent.parent.joinpath("samples").glob("*/model.onnx"))


def _duplicates_model() -> onnx.ModelProto:
    """Duplicated computations of every kind CSE treats differently: plain, a graph output merged
    into a plain value, a graph output merged into another graph output (an Identity keeps its
    name), small equal Constants, large Constants and random ops (never merged)."""
    big = numpy_helper.from_array(np.arange(16, dtype=np.float32), "big")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"]),
        helper.make_node("Mul", ["x", "w"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["r1"]),
        helper.make_node("Relu", ["c"], ["out1"]),
        helper.make_node("Sigmoid", ["c"], ["out2"]),
        helper.make_node("Sigmoid", ["c"], ["out3"]),
        helper.make_node("Constant", [], ["k1"], value=numpy_helper.from_array(np.array([2.0], np.float32))),
        helper.make_node("Constant", [], ["k2"], value=numpy_helper.from_array(np.array([2.0], np.float32))),
        helper.make_node("Constant", [], ["k3"], value=big),
        helper.make_node("Constant", [], ["k4"], value=big),
        helper.make_node("RandomNormalLike", ["c"], ["n1"]),
        helper.make_node("RandomNormalLike", ["c"], ["n2"]),
        helper.make_node("Sum", ["r1", "k1", "k2", "n1", "n2"], ["s"]),
        helper.make_node("Concat", ["k3", "k4"], ["cat"], axis=0),
    ]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("s", "out1", "out2", "out3", "cat")]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        vi,
        initializer=[numpy_helper.from_array(np.array([3.0], np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _before_cleanup(path: Path) -> ir.Model:
    """A sample after the gradient pass and transpose fusion: what the build's clean-up receives."""
    model = load_model(str(path))
    Pipeline(
        NameNodesPass(),
        TopologicalSortPass(),
        EvaluateConstantsPass(),
        GeluFusionPass(),
        GradientPass(GradientSpec()),
        TransposeFusionPass(),
    )(model)
    return model


def _serialized(model: ir.Model) -> bytes:
    return ir.to_proto(model).SerializeToString(deterministic=True)


def test_cse_merges_what_onnx_ir_merges():
    ours, theirs = ir.from_proto(_duplicates_model()), ir.from_proto(_duplicates_model())
    assert CommonSubexpressionEliminationPass()(ours).modified
    assert ir_common.CommonSubexpressionEliminationPass()(theirs).modified
    assert _serialized(ours) == _serialized(theirs)
    kinds = [node.op_type for node in ours.graph]
    assert kinds.count("Mul") == 1 and kinds.count("RandomNormalLike") == 2 and "Identity" in kinds
    assert [v.name for v in ours.graph.outputs] == ["s", "out1", "out2", "out3", "cat"]


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.parent.name)
def test_cse_on_backward_graphs_as_onnx_ir(path):
    ours, theirs = _before_cleanup(path), _before_cleanup(path)
    assert CommonSubexpressionEliminationPass()(ours).modified == ir_common.CommonSubexpressionEliminationPass()(theirs).modified
    assert _serialized(ours) == _serialized(theirs)


def test_node_removal_takes_nodes_out_together_and_refuses_used_outputs():
    model = ir.from_proto(_duplicates_model())
    graph = model.graph
    by_output = {node.outputs[0].name: node for node in graph}
    removal = NodeRemoval()
    removal.remove(by_output["n1"])
    assert by_output["n1"] in removal and by_output["n1"].graph is graph  # dropped, not yet out
    assert by_output["n1"].inputs == (None,) and all(user is not by_output["n1"] for user, _ in by_output["c"].outputs[0].uses())
    with pytest.raises(ValueError, match="'n1' is still used"):
        removal.flush()  # Sum still reads n1
    removal = NodeRemoval()
    removal.remove(by_output["cat"])
    with pytest.raises(ValueError, match="'cat' is still used"):
        removal.flush()  # a graph output
    removal = NodeRemoval()
    for name in ("k4", "k3"):  # read only by Concat, removed with them
        removal.remove(by_output[name])
    graph.outputs.pop()
    removal.remove(by_output["cat"])
    removal.flush()
    assert not removal and {"k3", "k4", "cat"}.isdisjoint(o.name for node in graph for o in node.outputs)


def _reversed_model(proto: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    nodes = list(copy.graph.node)[::-1]
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.parent.name)
def test_topological_sort_as_onnx_ir(path):
    proto = onnx.load(str(path))
    for given in (proto, _reversed_model(proto)):
        ours, theirs = ir.from_proto(given), ir.from_proto(given)
        assert TopologicalSortPass()(ours).modified == ir_common.TopologicalSortPass()(theirs).modified
        assert _serialized(ours) == _serialized(theirs)
    unsorted = ir.from_proto(_reversed_model(proto))
    assert TopologicalSortPass()(unsorted).modified
    made: set[str] = {v.name for v in unsorted.graph.inputs} | set(unsorted.graph.initializers)
    for node in unsorted.graph:
        assert all(v is None or v.name in made for v in node.inputs), node.name
        made.update(o.name for o in node.outputs)


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.parent.name)
def test_inference_without_weights_infers_what_the_whole_model_does(path):
    model = load_model(str(path))
    Pipeline(NameNodesPass(), EvaluateConstantsPass(shape_inference=False))(model)
    lean = _proto_without_weights(model)
    assert all(len(t.raw_data) <= 1024 for t in lean.graph.initializer)
    inferred_lean, _ = _infer_shapes(lean)
    inferred_full, _ = _infer_shapes(ir.to_proto(model))
    types = {v.name: v.type for v in [*inferred_full.graph.value_info, *inferred_full.graph.output]}
    outputs = {o.name for node in model.graph for o in node.outputs}
    lean_types = {v.name: v.type for v in [*inferred_lean.graph.value_info, *inferred_lean.graph.output] if v.name in outputs}
    assert lean_types == {name: t for name, t in types.items() if name in outputs}


def test_model_local_functions_are_inlined():
    """An export with ``export_modules_as_functions`` calls local functions (here a Linear): the build
    and a Session inline their bodies, so the standard ops inside get their rules and kernels."""
    import onnx
    from onnx import TensorProto, helper

    import gradgen
    from gradgen.check import check_gradients
    from gradgen.executor import Session

    linear = helper.make_function(
        "mods",
        "Linear",
        ["x", "w", "b"],
        ["y"],
        [helper.make_node("MatMul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])],
        [helper.make_opsetid("", 17)],
    )
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Linear", ["x", "W", "B"], ["h"], domain="mods", name="fc"),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        [
            onnx.numpy_helper.from_array(rng.standard_normal((3, 4)), "W"),
            onnx.numpy_helper.from_array(rng.standard_normal(4), "B"),
        ],
    )
    model = helper.make_model(
        graph, functions=[linear], opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("mods", 1)]
    )
    x = rng.standard_normal((2, 3))
    w, b = (onnx.numpy_helper.to_array(t) for t in graph.initializer)
    np.testing.assert_allclose(Session(model).run({"x": x})["loss"], np.tanh(x @ w + b).sum())
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert set(built.wrt) == {"x", "W", "B"}
    report = check_gradients(model, wrt_inputs=True, inputs={"x": x})
    assert report.passed, report.format()
    assert [n.op_type for n in model.graph.node][0] == "Linear"  # the caller's model is as it was


def test_cse_keeps_two_training_dropouts_of_one_input_apart():
    """Each training-mode Dropout draws its own mask: merging two of one input would make them
    drop the same elements (a correlation the model does not have)."""
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "training"], ["d1"]),
        helper.make_node("Dropout", ["x", "ratio", "training"], ["d2"]),
        helper.make_node("Sub", ["d1", "d2"], ["diff"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [64])],
        [helper.make_tensor_value_info("diff", onnx.TensorProto.FLOAT, [64])],
        [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"), numpy_helper.from_array(np.array(True), "training")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    CommonSubexpressionEliminationPass()(model)
    assert [node.op_type for node in model.graph].count("Dropout") == 2
