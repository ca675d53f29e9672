"""Sequences and optionals as the tensors they hold (SequencesAsTensorsPass): straight-line lists,
a list appended to by a loop of a run-time length, optionals; forward against onnxruntime on the
original model, gradients against finite differences in float64; what stays is refused in one line.
The exported models (nn.EmbeddingBag from both exporters) are fixtures in tests/fixtures/models/."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.check import check_gradients
from gradgen.errors import ModelError, RunError
from gradgen.executor import Session
from gradgen.ops.non_tensor import NON_TENSOR_OPS

F64 = TensorProto.DOUBLE
SEQ_F64 = helper.make_tensor_sequence_value_info


def _model(nodes, inputs, initializers=(), opset=18):
    graph = helper.make_graph(
        nodes,
        "g",
        inputs,
        [helper.make_tensor_value_info("loss", F64, [])],
        [onnx.numpy_helper.from_array(a, n) for n, a in initializers],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ints(name, values):
    return (name, np.asarray(values, np.int64))


def _loss_of(parts: list[str], nodes: list) -> None:
    """loss = sum over parts p of ReduceSum(Tanh(p)) (each part a float64 tensor)."""
    for p in parts:
        nodes.append(helper.make_node("Tanh", [p], [f"{p}_t"]))
        nodes.append(helper.make_node("ReduceSum", [f"{p}_t"], [f"{p}_s"], keepdims=0))
    nodes.append(helper.make_node("Sum", [f"{p}_s" for p in parts], ["loss"]))


def _no_sequences(model: ir.Model) -> bool:
    return not any(n.op_type in NON_TENSOR_OPS for n in ir.traversal.RecursiveGraphIterator(model.graph))


def _check(model: onnx.ModelProto, feeds: dict) -> None:
    """The pass leaves no sequence op, the forward loss is onnxruntime's on the original model,
    and every float input's gradient matches finite differences."""
    ort = pytest.importorskip("onnxruntime")
    built = gradgen.build_backward(model, wrt_inputs=True)
    assert _no_sequences(built.model)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["loss"], feeds)[0]
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], want, rtol=1e-12)
    np.testing.assert_allclose(Session(built.model).run(feeds)["loss"], want, rtol=1e-12)
    report = check_gradients(model, wrt_inputs=True, inputs=feeds, rtol=1e-6, atol=1e-8)
    assert report.passed, report.format()
    assert {t.name for t in report.tensors} == {k for k, v in feeds.items() if v.dtype == np.float64}


def test_straight_line_lists():
    """Construct, insert, erase at constant positions; At (negative), Length, Concat (along an axis
    and along a new one), SplitToSequence by a split list, by a scalar chunk and in ones without keepdims."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3)), "y": rng.standard_normal((2, 3))}
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "y"], ["s"]),
        helper.make_node("Mul", ["x", "y"], ["xy"]),
        helper.make_node("SequenceInsert", ["s", "xy", "one"], ["s2"]),  # [x, xy, y]
        helper.make_node("SequenceErase", ["s2", "minus_one"], ["s3"]),  # [x, xy]
        helper.make_node("SequenceAt", ["s3", "minus_one"], ["last"]),  # xy
        helper.make_node("SequenceLength", ["s2"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=F64),
        helper.make_node("Mul", ["last", "nf"], ["scaled"]),
        helper.make_node("ConcatFromSequence", ["s2"], ["rows"], axis=0),  # (6, 3)
        helper.make_node("ConcatFromSequence", ["s3"], ["stacked"], axis=-1, new_axis=1),  # (2, 3, 2)
        helper.make_node("SplitToSequence", ["rows", "split"], ["pieces"], axis=0),  # (2, 3), (4, 3)
        helper.make_node("SequenceAt", ["pieces", "one"], ["piece"]),
        helper.make_node("SplitToSequence", ["rows", "two"], ["chunks"], axis=1),  # (6, 2), (6, 1)
        helper.make_node("SequenceAt", ["chunks", "one"], ["chunk"]),
        helper.make_node("SplitToSequence", ["x"], ["columns"], axis=1, keepdims=0),  # three (2,)
        helper.make_node("ConcatFromSequence", ["columns"], ["flat"], axis=0),  # (6,)
        helper.make_node("Mul", ["flat", "flat"], ["flat2"]),
    ]
    _loss_of(["scaled", "stacked", "piece", "chunk", "flat2"], nodes)
    inputs = [helper.make_tensor_value_info(n, F64, [2, 3]) for n in feeds]
    model = _model(nodes, inputs, [_ints("one", 1), _ints("minus_one", -1), _ints("two", 2), _ints("split", [2, 4])])
    _check(model, feeds)


def _appending_loop(element_nodes: list, readers: list, extra_inputs=()) -> onnx.ModelProto:
    """for i in range(m): s.append(element(i, x)); then the readers of the final s: the shape of
    PyTorch's dynamo export of nn.EmbeddingBag (a sequence state that starts empty)."""
    body = helper.make_graph(
        [
            *element_nodes,
            helper.make_node("SequenceInsert", ["s_in", "element"], ["s_out"]),
            helper.make_node("Identity", ["c_in"], ["c_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            onnx.ValueInfoProto(name="s_in"),  # untyped, as exporters leave it
        ],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []), onnx.ValueInfoProto(name="s_out")],
    )
    nodes = [
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=F64),
        helper.make_node("Loop", ["m", "", "empty"], ["s"], body=body),
        *readers,
    ]
    inputs = [
        helper.make_tensor_value_info("x", F64, [3, 2]),
        helper.make_tensor_value_info("m", TensorProto.INT64, []),
        *extra_inputs,
    ]
    return nodes, inputs


def test_a_list_appended_to_by_a_loop_becomes_a_scan_output():
    """Three readers of one loop's list: along axis 0, along the last axis, stacked on a new axis 1;
    the trip count is fed at run time, so the loop stays a Loop and its gradient rule runs."""
    element = [
        helper.make_node("Cast", ["i"], ["fi"], to=F64),
        helper.make_node("Mul", ["x", "fi"], ["xi"]),
        helper.make_node("Sin", ["x"], ["sx"]),
        helper.make_node("Add", ["xi", "sx"], ["element"]),
    ]
    readers = [
        helper.make_node("ConcatFromSequence", ["s"], ["rows"], axis=0),  # (3m, 2)
        helper.make_node("ConcatFromSequence", ["s"], ["cols"], axis=-1),  # (3, 2m)
        helper.make_node("ConcatFromSequence", ["s"], ["stack"], axis=1, new_axis=1),  # (3, m, 2)
        helper.make_node("Mul", ["cols", "cols"], ["cols2"]),
    ]
    nodes, inputs = _appending_loop(element, readers)
    _loss_of(["rows", "cols2", "stack"], nodes)
    model = _model(nodes, inputs)
    built = gradgen.build_backward(model, wrt_inputs=True)
    loops = [n for n in built.model.graph if n.op_type == "Loop"]
    assert loops and _no_sequences(built.model)
    rng = np.random.default_rng(1)
    for m in (1, 4):
        _check(model, {"x": rng.standard_normal((3, 2)), "m": np.array(m, np.int64)})


def test_elements_of_different_shapes_are_a_one_line_run_error():
    """A loop appending a growing slice: the rewrite needs one shape per element, which the run checks."""
    element = [
        helper.make_node("Add", ["i", "one"], ["stop"]),
        helper.make_node("Unsqueeze", ["stop", "zero"], ["stop1"]),
        helper.make_node("Slice", ["x", "zero", "stop1"], ["element"]),
    ]
    readers = [helper.make_node("ConcatFromSequence", ["s"], ["rows"], axis=0)]
    nodes, inputs = _appending_loop(element, readers)
    _loss_of(["rows"], nodes)
    model = _model(nodes, inputs, [_ints("one", 1), _ints("zero", [0])])
    built = gradgen.build_backward(model, wrt_inputs=True)
    feeds = {"x": np.ones((3, 2)), "m": np.array(2, np.int64)}
    with pytest.raises(
        RunError, match=r"Loop.*scan output 0 has shape \[2, 2\] at iteration 1 and \[1, 2\] at iteration 0"
    ) as info:
        Session(built.model).run(feeds)
    assert "\n" not in str(info.value)


def test_a_position_known_only_at_run_time_is_refused_naming_the_node():
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
        helper.make_node("SequenceAt", ["s", "k"], ["picked"], name="pick"),
    ]
    _loss_of(["picked"], nodes)
    model = _model(
        nodes, [helper.make_tensor_value_info("x", F64, [2]), helper.make_tensor_value_info("k", TensorProto.INT64, [])]
    )
    with pytest.raises(ModelError, match=r"'pick' \(SequenceAt\).*tensors only"):
        gradgen.build_backward(model, wrt_inputs=True)
    with pytest.raises(ModelError, match=r"'pick' \(SequenceAt\)"):
        Session(model)


def test_optionals():
    nodes = [
        helper.make_node("Optional", ["x"], ["ox"]),
        helper.make_node("OptionalHasElement", ["ox"], ["has"]),
        helper.make_node("OptionalGetElement", ["ox"], ["got"]),
        helper.make_node("Where", ["has", "got", "zero"], ["kept"]),
        helper.make_node("Mul", ["kept", "kept"], ["sq"]),
    ]
    _loss_of(["sq"], nodes)
    model = _model(nodes, [helper.make_tensor_value_info("x", F64, [4])], [("zero", np.zeros(4))])
    feeds = {"x": np.random.default_rng(2).standard_normal(4)}
    report = check_gradients(model, wrt_inputs=True, inputs=feeds, rtol=1e-6, atol=1e-8)
    assert report.passed and {t.name for t in report.tensors} == {"x", "zero"}  # zero: a float initializer, a parameter
    assert _no_sequences(gradgen.build_backward(model, wrt_inputs=True).model)


def test_the_callers_model_is_left_as_it_is():
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
        helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0),
    ]
    _loss_of(["c"], nodes)
    model = ir.from_proto(_model(nodes, [helper.make_tensor_value_info("x", F64, [2])]))
    before = [n.op_type for n in model.graph]
    out = Session(model).run({"x": np.array([0.5, -1.0])})
    np.testing.assert_allclose(out["loss"], 2 * np.tanh([0.5, -1.0]).sum())
    assert [n.op_type for n in model.graph] == before


def test_split_sizes_fed_at_run_time():
    """SplitToSequence by a 1-D split of a fixed length whose sizes are an input: a Split of as many
    pieces, however long each is."""
    nodes = [
        helper.make_node("SplitToSequence", ["x", "sizes"], ["parts"], axis=0),
        helper.make_node("SequenceAt", ["parts", "one"], ["second"]),
        helper.make_node("SequenceAt", ["parts", "zero"], ["first"]),
        helper.make_node("Mul", ["second", "second"], ["sq"]),
    ]
    _loss_of(["sq", "first"], nodes)
    inputs = [helper.make_tensor_value_info("x", F64, ["n", 2]), helper.make_tensor_value_info("sizes", TensorProto.INT64, [2])]
    model = _model(nodes, inputs, [_ints("one", 1), _ints("zero", 0)])
    rng = np.random.default_rng(3)
    for n, sizes in ((5, [2, 3]), (4, [3, 1])):
        _check(model, {"x": rng.standard_normal((n, 2)), "sizes": np.array(sizes, np.int64)})


def test_sequence_map_copies_its_body_once_per_element():
    """SequenceMap over two lists of one length and a tensor input every copy reads: two output
    lists, read by ConcatFromSequence (a new axis) and SequenceAt."""
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((2, 3)), "y": rng.standard_normal(3), "w": rng.standard_normal(3)}
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["e", "wb"], ["ew"]),
            helper.make_node("Add", ["ew", "f"], ["out_a"]),
            helper.make_node("Tanh", ["e"], ["out_b"]),
        ],
        "body",
        [helper.make_tensor_value_info(n, F64, [3]) for n in ("e", "f", "wb")],
        [helper.make_tensor_value_info(n, F64, [3]) for n in ("out_a", "out_b")],
    )
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
        helper.make_node("Mul", ["y", "y"], ["yy"]),
        helper.make_node("SequenceConstruct", ["y", "yy"], ["ys"]),
        helper.make_node("SequenceMap", ["rows", "ys", "w"], ["as", "bs"], body=body),
        helper.make_node("ConcatFromSequence", ["as"], ["stacked"], axis=0, new_axis=1),
        helper.make_node("SequenceAt", ["bs", "minus_one"], ["last"]),
    ]
    _loss_of(["stacked", "last"], nodes)
    inputs = [helper.make_tensor_value_info("x", F64, [2, 3])] + [helper.make_tensor_value_info(n, F64, [3]) for n in ("y", "w")]
    model = _model(nodes, inputs, [_ints("minus_one", -1)])
    stacked = feeds["x"] * feeds["w"] + np.stack([feeds["y"], feeds["y"] ** 2])
    want = np.tanh(stacked).sum() + np.tanh(np.tanh(feeds["x"][1])).sum()
    np.testing.assert_allclose(Session(model).run(feeds)["loss"], want, rtol=1e-12)
    _check(model, feeds)


def test_sequence_map_over_lists_of_different_lengths_is_refused_naming_the_node():
    body = helper.make_graph(
        [helper.make_node("Add", ["e", "f"], ["o"])],
        "body",
        [helper.make_tensor_value_info(n, F64, [2]) for n in ("e", "f")],
        [helper.make_tensor_value_info("o", F64, [2])],
    )
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "x"], ["two"]),
        helper.make_node("SequenceConstruct", ["x"], ["one"]),
        helper.make_node("SequenceMap", ["two", "one"], ["mapped"], body=body, name="map"),
        helper.make_node("ConcatFromSequence", ["mapped"], ["c"], axis=0),
    ]
    _loss_of(["c"], nodes)
    model = _model(nodes, [helper.make_tensor_value_info("x", F64, [2])])
    with pytest.raises(ModelError, match=r"'map' \(SequenceMap\).*tensors only"):
        gradgen.build_backward(model, wrt_inputs=True)


def test_a_list_built_by_a_loop_of_a_constant_trip_count_then_read_by_position():
    """The legacy exporter's torch.tensor_split: a Loop of a constant trip count appends slices to
    a list (the Loop's output left untyped, its body's output a sequence of float64), one more
    slice is inserted after it, and the pieces are read by position. The loop unrolls, and the
    straight-line list it leaves resolves to its slices (it was refused naming the sequence ops)."""
    body = helper.make_graph(
        [
            helper.make_node("Mul", ["i", "two"], ["start"]),
            helper.make_node("Add", ["start", "two"], ["end"]),
            helper.make_node("Slice", ["x", "start", "end", "one"], ["piece"]),
            helper.make_node("SequenceInsert", ["seq_in", "piece"], ["seq_out"]),
            helper.make_node("Identity", ["cond"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, [1]),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_in", F64, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_out", F64, None),
        ],
    )
    nodes = [
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=F64),
        helper.make_node("Loop", ["trips", "yes", "empty"], ["built"], body=body),
        helper.make_node("Slice", ["x", "four", "six", "one"], ["last"]),
        helper.make_node("SequenceInsert", ["built", "last"], ["all"]),
        *(helper.make_node("SequenceAt", ["all", f"at{k}"], [f"part{k}"]) for k in range(3)),
        helper.make_node("Mul", ["part0", "part1"], ["product"]),
    ]
    _loss_of(["product", "part2"], nodes)
    constants = [_ints("trips", 2), ("yes", np.array(True)), _ints("two", [2]), _ints("one", [1])]
    constants += [_ints("four", [4]), _ints("six", [6]), *(_ints(f"at{k}", k) for k in range(3))]
    model = _model(nodes, [helper.make_tensor_value_info("x", F64, [3, 6])], constants)
    _check(model, {"x": np.random.default_rng(2).standard_normal((3, 6))})
