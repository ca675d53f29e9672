"""The CUDA executor's pointwise fusion pass, on the CPU: which steps group, the plan it makes
(run with the members' numpy kernels it gives the unfused results), and the generated source
(compiled with NVRTC where cuda.core is installed)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.executor import Session, fusion
from gradgen.executor import session as session_module
from gradgen.kernels.cuda import fused

F = TensorProto.FLOAT


def make_model(nodes, inputs, outputs, opset=18):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def groups_of(model) -> list[list[str]]:
    """The fused sets of the model's CPU plan, as lists of node names."""
    sess = Session(model)
    steps = sess.steps
    found = fusion.find_groups(steps, fusion.plan_dtypes(steps, sess.graph), set(sess.output_names))
    return [[steps[i].node_name for i in group] for group in found]


def fused_plan(model):
    """A CPU Session whose plan is the fused one (each fused step runs its members' numpy kernels)."""
    sess = Session(model)
    steps = fusion.fuse_pointwise(sess.steps, sess.graph, set(sess.output_names))
    for index, step in enumerate(steps):
        step.index, step.free_after = index, []
    session_module._assign_lifetimes(steps, keep=set(sess.output_names) | set(sess.initializers))
    session_module._prepare_steps(steps, sess.initializers)
    sess.steps = steps
    return sess


def node(op, ins, outs, name, **attrs):
    return helper.make_node(op, ins, outs, name=name, **attrs)


def test_a_chain_of_elementwise_steps_is_one_group():
    model = make_model(
        [node("Mul", ["x", "s"], ["a"], "mul"), node("Add", ["a", "b"], ["c"], "add"), node("Tanh", ["c"], ["y"], "tanh")],
        [("x", F, [2, 3, 4]), ("s", F, [4]), ("b", F, [3, 1])],
        [("y", F, [2, 3, 4])],
    )
    assert groups_of(model) == [["mul", "add", "tanh"]]
    sess = fused_plan(model)
    (step,) = [s for s in sess.steps if s.op_type == fusion.OP_TYPE]
    assert step.inputs == ["x", "s", "b"] and step.outputs == ["y"]
    assert [m.node_name for m in step.entry.cuda.members] == ["mul", "add", "tanh"]


def test_an_intermediate_read_outside_or_a_graph_output_is_written_out():
    model = make_model(
        [
            node("Mul", ["x", "x"], ["sq"], "sq"),
            node("MatMul", ["sq", "w"], ["mm"], "mm"),  # reads sq: sq must be written
            node("Exp", ["sq"], ["e"], "exp"),
            node("Neg", ["e"], ["ne"], "neg"),  # e is a graph output as well
            node("Add", ["ne", "mm"], ["y"], "add"),
        ],
        [("x", F, [3, 3]), ("w", F, [3, 3])],
        [("y", F, [3, 3]), ("e", F, [3, 3])],
    )
    assert groups_of(model) == [["sq", "exp", "neg"]]
    sess = fused_plan(model)
    (step,) = [s for s in sess.steps if s.op_type == fusion.OP_TYPE]
    assert set(step.outputs) == {"sq", "e", "ne"}


def test_a_path_through_a_non_elementwise_step_does_not_fuse_around_it():
    # mul -> matmul -> add and mul -> add: fusing mul with add would need matmul inside the set
    model = make_model(
        [node("Mul", ["x", "x"], ["a"], "mul"), node("MatMul", ["a", "w"], ["b"], "mm"), node("Add", ["a", "b"], ["y"], "add")],
        [("x", F, [3, 3]), ("w", F, [3, 3])],
        [("y", F, [3, 3])],
    )
    assert groups_of(model) == []


def test_two_sets_that_would_feed_each_other_do_not_both_fuse():
    # {mul, add} -> reduce -> {sqrt, mul2} and {sqrt, mul2} -> reshape -> {mul, add}: each set alone
    # is schedulable, the two together make a cycle, so one stays unfused
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [1, 3])
    model = make_model(
        [
            helper.make_node("Constant", [], ["shp"], name="c", value=shape),
            node("Mul", ["x", "x"], ["p"], "mul"),
            node("ReduceSum", ["p"], ["r"], "reduce", keepdims=0),
            node("Sqrt", ["w"], ["s"], "sqrt"),
            node("Reshape", ["s", "shp"], ["e"], "reshape"),
            node("Add", ["p", "e"], ["t"], "add"),
            node("Mul", ["s", "r"], ["z"], "mul2"),
        ],
        [("x", F, [2, 3]), ("w", F, [3])],
        [("t", F, [2, 3]), ("z", F, [3])],
    )
    assert groups_of(model) == [["mul", "add"], ["sqrt", "mul2"]]
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "w": np.array([1, 4, 9], np.float32)}
    want = Session(model).run(feeds)
    sess = fused_plan(model)
    assert sum(s.op_type == fusion.OP_TYPE for s in sess.steps) == 1
    got = sess.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_non_elementwise_ops_split_chains():
    shape = helper.make_tensor("shape", TensorProto.INT64, [1], [6])
    model = make_model(
        [
            helper.make_node("Constant", [], ["shp"], name="c", value=shape),
            node("Mul", ["x", "x"], ["a"], "mul"),
            node("Exp", ["a"], ["b"], "exp"),
            node("Reshape", ["b", "shp"], ["r"], "reshape"),
            node("Sigmoid", ["r"], ["s"], "sig"),
            node("Sqrt", ["s"], ["y"], "sqrt"),
        ],
        [("x", F, [2, 3])],
        [("y", F, [6])],
    )
    assert groups_of(model) == [["mul", "exp"], ["sig", "sqrt"]]


def test_integer_shape_arithmetic_does_not_fuse_but_int_values_from_floats_do():
    I64 = TensorProto.INT64
    model = make_model(
        [
            node("Add", ["i", "j"], ["k"], "int_add"),  # integers only: host shape work
            node("Mul", ["k", "j"], ["m"], "int_mul"),
            node("Cast", ["x"], ["xi"], "cast", to=I64),  # from a float: joins
            node("Less", ["xi", "m"], ["lt"], "less"),  # an int comparison of a fused value: joins
            node("Not", ["lt"], ["nt"], "not"),
            node("Where", ["nt", "x", "z"], ["y"], "where"),
        ],
        [("x", F, [4]), ("z", F, [4]), ("i", I64, [4]), ("j", I64, [4])],
        [("y", F, [4])],
    )
    assert groups_of(model) == [["cast", "less", "not", "where"]]


def test_a_fused_plan_computes_what_the_plan_computes():
    model = make_model(
        [
            node("Mul", ["x", "s"], ["a"], "mul"),
            node("Greater", ["a", "zero"], ["g"], "gt"),
            node("Where", ["g", "a", "zero"], ["r"], "relu_like"),
            node("MatMul", ["r", "w"], ["mm"], "mm"),
            node("Pow", ["mm", "two"], ["p"], "pow"),
            node("Sub", ["p", "b"], ["d"], "sub"),
            node("Div", ["d", "s"], ["q"], "div"),
            node("Sum", ["q", "mm", "x"], ["y"], "sum"),
        ],
        [("x", F, [2, 4, 4]), ("s", F, [4]), ("zero", F, []), ("w", F, [4, 4]), ("two", F, []), ("b", F, [4, 1])],
        [("y", F, [2, 4, 4]), ("g", TensorProto.BOOL, [2, 4, 4])],
    )
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal((2, 4, 4)).astype(np.float32),
        "s": rng.uniform(0.5, 2, 4).astype(np.float32),
        "zero": np.float32(0),
        "w": rng.standard_normal((4, 4)).astype(np.float32),
        "two": np.float32(2),
        "b": rng.standard_normal((4, 1)).astype(np.float32),
    }
    want = Session(model).run(feeds)
    sess = fused_plan(model)
    assert sum(s.op_type == fusion.OP_TYPE for s in sess.steps) == 2
    got = sess.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_signature_dtype_rules():
    add = (fused.FusedOp("Add", (0, 1)),)
    assert fused.Signature(("f32", "f32"), add, (2,)).dtypes == ("f32", "f32", "f32")
    for inputs, ops in (
        (("i64", "i64"), add),  # integer arithmetic has no fused form
        (("f32", "f64"), add),  # mixed types are the op's own error
        (("f16", "f16"), (fused.FusedOp("Sum", (0, 1)),)),  # float16 Sum keeps float partial sums
        (("f32", "f32", "f32"), (fused.FusedOp("Where", (0, 1, 2)),)),  # the condition must be bool
    ):
        with pytest.raises(fused.Unsupported):
            fused.Signature(inputs, ops, (len(inputs),)).dtypes  # noqa: B018
    cast = fused.Signature(("f32",), (fused.FusedOp("Cast", (0,), (("to", TensorProto.FLOAT16),)),), (1,))
    assert cast.dtypes == ("f32", "f16")


def test_generated_source_keeps_op_boundaries_exact():
    sig = fused.Signature(
        ("f32", "f32", "f16"),
        (
            fused.FusedOp("Mul", (0, 1)),
            fused.FusedOp("Tanh", (3,)),
            fused.FusedOp("Add", (4, 0)),
            fused.FusedOp("Cast", (2,), (("to", TensorProto.FLOAT),)),
            fused.FusedOp("Sub", (5, 6)),
            fused.FusedOp("Cast", (7,), (("to", TensorProto.FLOAT16),)),
        ),
        (7, 8),
    )
    text = fused.kernel_source(sig)
    assert "__fmul_rn(x0, x1)" in text and "__fadd_rn(t1, x0)" in text and "__fsub_rn(t2, t3)" in text
    assert "gg_fence((tanh(t0)))" in text  # a libdevice result never contracts with its reader
    assert "gg_round_half(" in text  # a float16 value is rounded as storing it would
    assert f'extern "C" __global__ void {sig.name}(' in text
    # the name is the signature's: sizes never enter it
    assert fused.Signature(sig.inputs, sig.ops, sig.outputs).name == sig.name


def test_generated_source_compiles_with_nvrtc(tmp_path):
    from gradgen.cuda.compile import Source
    from gradgen.kernels.cuda.launch import inline_common_header

    compiler = nvrtc_compiler()
    for name, text in fused.generated_sources().items():
        path = tmp_path / f"{name}.cu"
        path.write_text(inline_common_header(text))
        assert compiler.compile(Source(name, path, path.read_text(), "test"), "sm_90")


def test_the_switch(monkeypatch):
    monkeypatch.setenv(fusion.ENV, "0")
    assert not fusion.enabled()
    monkeypatch.setenv(fusion.ENV, "1")
    assert fusion.enabled()
    monkeypatch.delenv(fusion.ENV)
    assert fusion.enabled()


def test_dataclass_signature_is_hashable_and_value_equal():
    a = fused.Signature(("f32",), (fused.FusedOp("Exp", (0,)),), (1,))
    assert a == dataclasses.replace(a) and hash(a) == hash(dataclasses.replace(a))


# -- com.microsoft Gelu ops ---------------------------------------------------------------------------


def ms_node(op, ins, outs, name, **attrs):
    return helper.make_node(op, ins, outs, name=name, domain="com.microsoft", **attrs)


def gelu_ops_model(elem=F, rows=6, cols=12, opset=18):
    """FastGelu with a bias, Gelu, GeluGrad and FastGeluGrad (com.microsoft) around a MatMul
    (x: rows x 8, the others rows x cols, of element type ``elem``)."""
    model = make_model(
        [
            node("MatMul", ["x", "w"], ["h"], "mm"),
            ms_node("FastGelu", ["h", "b"], ["a"], "fast_gelu"),
            node("Mul", ["a", "k"], ["y"], "mul"),
            ms_node("Gelu", ["h"], ["e"], "gelu"),
            ms_node("GeluGrad", ["dy", "e"], ["ge"], "gelu_grad"),
            ms_node("FastGeluGrad", ["ge", "h"], ["z"], "fast_gelu_grad"),
        ],
        [("x", elem, [rows, 8]), ("w", elem, [8, cols]), ("b", elem, [cols]), ("k", elem, []), ("dy", elem, [rows, cols])],
        [("y", elem, [rows, cols]), ("z", elem, [rows, cols])],
        opset,
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_com_microsoft_gelu_ops_join_groups_and_compute_what_the_plan_computes():
    model = gelu_ops_model()
    assert groups_of(model) == [["fast_gelu", "mul"], ["gelu", "gelu_grad", "fast_gelu_grad"]]
    rng = np.random.default_rng(7)
    feeds = {
        "x": rng.standard_normal((6, 8)).astype(np.float32),
        "w": rng.standard_normal((8, 12)).astype(np.float32),
        "b": rng.standard_normal(12).astype(np.float32),
        "k": np.float32(1.5),
        "dy": rng.standard_normal((6, 12)).astype(np.float32),
    }
    want = Session(model).run(feeds)
    sess = fused_plan(model)
    steps = [s for s in sess.steps if s.op_type == fusion.OP_TYPE]
    assert [[op.op_type for op in s.entry.cuda.ops] for s in steps] == [
        ["FastGelu", "Mul"],
        ["Gelu", "GeluGrad", "FastGeluGrad"],
    ]
    got = sess.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def test_which_nodes_have_a_fused_form():
    ms = "com.microsoft"
    assert fused.rule_name(ms, "Gelu") == "Gelu" and fused.rule_name("", "Gelu") == "Gelu"
    assert fused.rule_name(ms, "FastGeluGrad") == "FastGeluGrad"
    assert fused.rule_name("", "FastGelu") is None  # not an ONNX op
    assert fused.rule_name(ms, "Add") is None and fused.rule_name("other.domain", "Add") is None
    assert fused.fusable_op("FastGelu", {}, 1, ms) and fused.fusable_op("FastGelu", {}, 2, ms)
    assert not fused.fusable_op("FastGelu", {}, 3, ms)
    assert fused.fusable_op("GeluGrad", {}, 2, ms) and not fused.fusable_op("GeluGrad", {}, 1, ms)
    assert not fused.fusable_op("Gelu", {"approximate": "tanh"}, 1, ms)  # an attribute it does not have
    assert fused.fusable_op("Gelu", {"approximate": "tanh"}, 1, "")


def test_shapes_the_gelu_kernels_refuse_leave_the_group_to_them():
    # value_shapes raises (layout then says no kernel, and the members' own kernels give the error)
    def shapes(op, in_shapes):
        sig = fused.Signature(("f32",) * len(in_shapes), (fused.FusedOp(op, tuple(range(len(in_shapes)))),), (len(in_shapes),))
        return fused.value_shapes(sig, in_shapes)[-1]

    assert shapes("FastGelu", [(2, 5), (5,)]) == (2, 5)
    assert shapes("FastGelu", [(2, 5)]) == (2, 5)
    assert shapes("GeluGrad", [(2, 5), (2, 5)]) == (2, 5)
    for op, bad in (
        ("FastGelu", [(2, 5), (1, 5)]),  # the bias must be 1-D
        ("FastGelu", [(2, 5), (2,)]),  # over the last axis
        ("FastGelu", [(), (1,)]),
        ("GeluGrad", [(2, 5), (5,)]),  # dY and X of one shape: no broadcasting
        ("FastGeluGrad", [(1, 5), (2, 5)]),
    ):
        with pytest.raises(ValueError):
            shapes(op, bad)


def test_gelu_sources_are_the_unfused_kernels_expressions():
    sig = fused.Signature(
        ("f16", "f16", "f32", "f32"),
        (
            fused.FusedOp("FastGelu", (0, 1)),
            fused.FusedOp("FastGelu", (2,)),
            fused.FusedOp("GeluGrad", (3, 5)),
            fused.FusedOp("FastGeluGrad", (6, 2)),
        ),
        (4, 7),
    )
    text = fused.kernel_source(sig)
    # the float16 sum is rounded before the Gelu, as storing it between two kernels does
    assert "gg_round_half(gg_gelu_tanh(gg_round_half(__fadd_rn(x0, x1))))" in text
    assert "gg_fence(gg_gelu_tanh(x2))" in text
    assert "gg_fence((x3 * gg_gelu_slope(t1)))" in text  # elementwise.cu: x * gg_gelu_slope(y), (dY, X)
    assert "gg_fence((t2 * gg_gelu_tanh_slope(x2)))" in text


# -- the quad variant and in-place outputs -----------------------------------------------------------


def test_index_modes_and_when_the_quad_variant_applies():
    from gradgen.kernels.cuda.launch import coalesce

    def modes(full, *strides):
        shape, lists = coalesce(full, *strides)
        return fused.index_modes(shape, lists)

    # same shape (contiguous), a bias over the last axis, a column broadcast along it, a scalar
    both = modes((6, 8), [8, 1], [0, 1], [1, 0], [0, 0])
    assert both == (0 | 2 << 2 | 2 << 4 | 1 << 6, 0 | 2 << 2 | 3 << 4 | 1 << 6)
    assert modes((6, 10), [10, 1], [0, 1])[1] is None  # innermost size not a multiple of 4
    assert modes((6, 8), [8, 1])[1] == 0  # merged to one axis of 48
    assert modes((3, 2, 2), [4, 2, 1])[1] == 0  # merged: 12 elements
    assert modes((3, 2, 2), [0, 2, 1], [4, 2, 1])[1] == 2  # innermost merged axis of 4
    assert modes((8, 3), [3, 1], [1, 0])[1] is None  # innermost 3
    assert modes((1, 1), [1, 1])[1] is None  # nothing left: one element
    assert modes((4, 4), [1, 4])[1] is None  # a transposed read along the innermost axis


def test_in_place_candidates_are_whole_shape_inputs_of_the_output_element_size():
    sig = fused.Signature(
        ("f32", "f32", "f32", "f16", "b8"),
        (
            fused.FusedOp("Mul", (0, 1)),  # 5
            fused.FusedOp("Add", (5, 2)),  # 6
            fused.FusedOp("Cast", (6,), (("to", TensorProto.FLOAT16),)),  # 7
            fused.FusedOp("Mul", (7, 3)),  # 8
            fused.FusedOp("Where", (4, 6, 6)),  # 9
            fused.FusedOp("Less", (6, 2)),  # 10
        ),
        (9, 8, 10),
    )
    full = (4, 8)
    # x0: whole, f32; x1: broadcast (a bias); x2: a scalar; x3: whole, f16; x4: whole, bool
    got = fused.in_place_candidates(sig, [full, (8,), (), full, full])
    assert got == [(0, (0,)), (1, (3,)), (2, (4,))]
    # the same count as one row, or an input of the group's shape with leading ones, reads element i
    assert fused.in_place_candidates(sig, [(1, 8), (8,), (), (1, 8), (8,)]) == [(0, (0, 1)), (1, (3,)), (2, (4,))]
    assert fused.in_place_candidates(sig, [(0, 8), (8,), (), (0, 8), (0, 8)]) == []  # nothing to write


def test_generated_source_has_the_quad_variant_and_restricts_only_what_cannot_alias():
    sig = fused.Signature(
        ("f32", "b8", "f16"),
        (
            fused.FusedOp("Where", (1, 0, 0)),
            fused.FusedOp("Cast", (2,), (("to", TensorProto.FLOAT),)),
            fused.FusedOp("Add", (3, 4)),
        ),
        (5,),
    )
    text = fused.kernel_source(sig)
    assert f"void {sig.name}(float* out0, const float* in0, const bool* __restrict__ in1, const __half* __restrict__ in2" in text
    assert f"void {sig.name}{fused.QUAD}(float* out0, const float* in0," in text
    assert "GgQuad<float> q0 = gg_load_quad(in0 + offs[0], modes >> 0);" in text
    assert "GgQuad<__half> q2 = gg_load_quad(in2 + offs[2], modes >> 4);" in text
    assert "*reinterpret_cast<GgQuad<float>*>(out0 + i) = r0;" in text
    # one element's code, the same in both kernels
    assert text.count("const float t2 = __fadd_rn(t0, t1);  // Add") == 2


def nvrtc_compiler():
    pytest.importorskip("cuda.core")
    from gradgen.cuda.compile import NvrtcCompiler

    try:
        return NvrtcCompiler()
    except Exception as exc:  # noqa: BLE001 - cuda.core without libnvrtc
        pytest.skip(f"no NVRTC: {exc}")


def test_the_quad_variant_moves_16_bytes_per_access(tmp_path):
    from gradgen.cuda.compile import Source, split_ptx
    from gradgen.kernels.cuda.launch import inline_common_header

    compiler = nvrtc_compiler()
    sig = fused.Signature(
        ("f32", "f32", "f32"),
        (fused.FusedOp("Mul", (0, 1)), fused.FusedOp("Tanh", (3,)), fused.FusedOp("Sub", (4, 2))),
        (3, 5),
    )
    path = tmp_path / f"{sig.name}.cu"
    path.write_text(inline_common_header(fused.kernel_source(sig)))
    _common, kernels = split_ptx(compiler.ptx(Source(sig.name, path, path.read_text(), "test"), "sm_90"))
    quad, element = kernels[sig.name + fused.QUAD], kernels[sig.name]
    assert "ld.global.v4.f32" in quad and quad.count("st.global.v4.f32") >= 2
    assert "v4" not in element


def test_scalar_arithmetic_read_elsewhere_stays_apart_from_tensor_chains():
    # an optimizer's step: d = 1 - lr * c (scalars) scales two parameters of different shapes;
    # one set holding both would have outputs of three shapes, which no single kernel writes
    model = make_model(
        [
            node("Mul", ["lr", "c"], ["m"], "mul"),
            node("Sub", ["one", "m"], ["d"], "sub"),
            node("Mul", ["w1", "d"], ["s1"], "scale1"),
            node("Add", ["s1", "g1"], ["y1"], "add1"),
            node("Mul", ["w2", "d"], ["y2"], "scale2"),
        ],
        [("lr", F, []), ("c", F, []), ("one", F, []), ("w1", F, [4, 8]), ("g1", F, [4, 8]), ("w2", F, [3, 5])],
        [("y1", F, [4, 8]), ("y2", F, [3, 5])],
    )
    sess = Session(model)
    shapes = fusion.static_shapes(sess.steps, sess.graph)
    assert shapes["m"] == shapes["d"] == () and shapes["s1"] == (4, 8)
    assert groups_of(model) == [["mul", "sub", "scale1", "add1", "scale2"]]  # without shapes
    found = fusion.find_groups(sess.steps, fusion.plan_dtypes(sess.steps, sess.graph), set(sess.output_names), shapes)
    assert [[sess.steps[i].node_name for i in g] for g in found] == [["mul", "sub"], ["scale1", "add1"]]
    rng = np.random.default_rng(9)
    feeds = {
        n: rng.standard_normal(s).astype(np.float32)
        for n, s in (("lr", ()), ("c", ()), ("one", ()), ("w1", (4, 8)), ("g1", (4, 8)), ("w2", (3, 5)))
    }
    want = Session(model).run(feeds)
    plan = fused_plan(model)
    assert sum(s.op_type == fusion.OP_TYPE for s in plan.steps) == 2
    got = plan.run(feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
