"""Pointwise fusion on the GPU: models run with GRADGEN_CUDA_FUSION on and off give the same bits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.executor import Session, fusion
from gradgen.kernels.cuda import fused
from tests.test_fusion import gelu_ops_model, make_model, node

pytestmark = pytest.mark.cuda

F, H, I64, B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL
BF = TensorProto.BFLOAT16


def runs_off_and_on(model, feeds, monkeypatch, runs: int = 3):
    """((outputs, op types of the plan) with the executor's fusions off, the same with them on): the
    outputs of the last of ``runs`` runs (eager, recorded, replayed), each run checked to give the
    bits of the first."""
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv(fusion.ENV, switch)
        with Session(model, device="cuda") as sess:
            ops = [s.op_type for s in sess.steps]
            outs = [sess.run(feeds) for _ in range(runs)]
        for later in outs[1:]:
            assert_same_bits(later, outs[0])
        results.append((outs[-1], ops))
    return results[0], results[1]


def run_both(model, feeds, monkeypatch, runs: int = 3):
    """Outputs with fusion off and on (``runs_off_and_on``), and the fused Session's number of fused
    steps."""
    (off, off_ops), (on, on_ops) = runs_off_and_on(model, feeds, monkeypatch, runs)
    assert fusion.OP_TYPE not in off_ops
    return off, on, on_ops.count(fusion.OP_TYPE)


def assert_same_bits(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), f"{name} differs in its bits"


def test_broadcasting_chain(monkeypatch):
    model = make_model(
        [
            node("Mul", ["x", "s"], ["a"], "mul"),
            node("Add", ["a", "b"], ["c"], "add"),
            node("Tanh", ["c"], ["t"], "tanh"),
            node("Mul", ["t", "x"], ["m"], "mul2"),
            node("Sub", ["m", "k"], ["y"], "sub"),
        ],
        [("x", F, [8, 64, 96]), ("s", F, [96]), ("b", F, [64, 1]), ("k", F, [])],
        [("y", F, [8, 64, 96])],
    )
    rng = np.random.default_rng(1)
    feeds = {
        "x": rng.standard_normal((8, 64, 96)).astype(np.float32),
        "s": rng.standard_normal(96).astype(np.float32),
        "b": rng.standard_normal((64, 1)).astype(np.float32),
        "k": np.float32(0.3),
    }
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1
    assert_same_bits(on, off)


def test_where_and_int_bool_comparisons(monkeypatch):
    model = make_model(
        [
            node("Greater", ["x", "zero"], ["g"], "gt"),
            node("Where", ["g", "dy", "zero"], ["r"], "where"),
            node("Cast", ["x"], ["xi"], "cast", to=I64),
            node("Equal", ["xi", "lab"], ["eq"], "eq"),
            node("Not", ["eq"], ["ne"], "not"),
            node("And", ["ne", "g"], ["both"], "and"),
            node("Where", ["both", "r", "dy"], ["y"], "where2"),
        ],
        [("x", F, [4, 1000]), ("dy", F, [4, 1000]), ("zero", F, []), ("lab", I64, [1000])],
        [("y", F, [4, 1000]), ("both", B, [4, 1000])],
    )
    rng = np.random.default_rng(2)
    feeds = {
        "x": (rng.standard_normal((4, 1000)) * 3).astype(np.float32),
        "dy": rng.standard_normal((4, 1000)).astype(np.float32),
        "zero": np.float32(0),
        "lab": rng.integers(-3, 4, 1000),
    }
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1
    assert_same_bits(on, off)


def gelu_tanh_model():
    """A tanh-GELU spelled in elementwise nodes (as exporters write it), summed into a loss."""
    c = helper.make_tensor
    consts = [
        helper.make_node("Constant", [], [n], name=f"c_{n}", value=c(n, F, [], [v]))
        for n, v in (("half", 0.5), ("one", 1.0), ("k0", 0.7978845608), ("k1", 0.044715), ("three", 3.0))
    ]
    nodes = consts + [
        node("MatMul", ["x", "w"], ["h"], "mm"),
        node("Pow", ["h", "three"], ["h3"], "pow"),
        node("Mul", ["h3", "k1"], ["a"], "m1"),
        node("Add", ["h", "a"], ["b"], "add1"),
        node("Mul", ["b", "k0"], ["c"], "m2"),
        node("Tanh", ["c"], ["t"], "tanh"),
        node("Add", ["t", "one"], ["u"], "add2"),
        node("Mul", ["h", "half"], ["v"], "m3"),
        node("Mul", ["v", "u"], ["g"], "m4"),
        node("ReduceSum", ["g"], ["loss"], "sum", keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu",
        [helper.make_tensor_value_info("x", F, [64, 128])],
        [helper.make_tensor_value_info("loss", F, [])],
        [helper.make_tensor("w", F, [128, 256], np.random.default_rng(3).standard_normal(128 * 256).astype(np.float32) * 0.1)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_gelu_gradient_chain(monkeypatch):
    built = gradgen.build_backward(gelu_tanh_model(), portable=True)  # the gradient in standard ops
    feeds = {"x": np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)}
    off, on, count = run_both(built.model, feeds, monkeypatch)
    assert count >= 1
    assert_same_bits(on, off)


def test_gelu_op_and_float16(monkeypatch):
    model = make_model(
        [
            node("Gelu", ["x"], ["g"], "gelu", approximate="tanh"),
            node("Cast", ["g"], ["gh"], "cast", to=H),
            node("Mul", ["gh", "s"], ["m"], "mul"),
            node("Sigmoid", ["m"], ["y"], "sig"),
            node("Gelu", ["x"], ["e"], "gelu_erf"),
            node("Exp", ["e"], ["z"], "exp"),
        ],
        [("x", F, [3, 777]), ("s", H, [777])],
        [("y", H, [3, 777]), ("z", F, [3, 777])],
        opset=20,
    )
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((3, 777)).astype(np.float32), "s": rng.standard_normal(777).astype(np.float16)}
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 2
    assert_same_bits(on, off)


def test_gpt2_tiny_backward(monkeypatch):
    pytest.importorskip("torch")
    from gradgen.bench import models

    spec = models.preset("gpt2-tiny")
    module = models.build_module(spec)
    inputs = models.make_inputs(spec)
    built = gradgen.build_backward(models.export(module, inputs), wrt=models.parameter_names(module))
    off, on, count = run_both(built.model, inputs, monkeypatch)
    assert count >= 4  # the GELU itself is one FastGelu node (GeluFusionPass)
    assert_same_bits(on, off)


# -- the quad variant ----------------------------------------------------------------------------------

NP = {F: np.float32, H: np.float16, TensorProto.DOUBLE: np.float64, BF: ml_dtypes.bfloat16}


@pytest.fixture
def variants(monkeypatch):
    """The variant of every fused launch (True: quads), in launch order."""
    seen: list[bool] = []
    real = fused._kernel

    def spy(sig, quad=False):
        seen.append(quad)
        return real(sig, quad)

    monkeypatch.setattr(fused, "_kernel", spy)
    return seen


def broadcast_chain(elem, rows: int, cols: int):
    """x (rows x cols) with a bias over the last axis, a column broadcast along it and a scalar; a
    Where on a bool of the same shape; two outputs (one a float16 Cast for float types)."""
    model = make_model(
        [
            node("Mul", ["x", "s"], ["a"], "mul"),  # s: (cols,), contiguous along the innermost axis
            node("Add", ["a", "c"], ["b"], "add"),  # c: (rows, 1), broadcast along it
            node("Tanh", ["b"], ["t"], "tanh"),
            node("Greater", ["x", "k"], ["g"], "gt"),  # k: a scalar
            node("Where", ["g", "t", "x"], ["w"], "where"),
            node("Sub", ["w", "k"], ["y"], "sub"),
            node("Cast", ["y"], ["yh"], "cast", to=H),
        ],
        [("x", elem, [rows, cols]), ("s", elem, [cols]), ("c", elem, [rows, 1]), ("k", elem, [])],
        [("y", elem, [rows, cols]), ("yh", H, [rows, cols]), ("g", B, [rows, cols])],
    )
    rng = np.random.default_rng(rows * 1000 + cols)
    dt = NP[elem]
    feeds = {
        "x": rng.standard_normal((rows, cols)).astype(dt),
        "s": rng.standard_normal(cols).astype(dt),
        "c": rng.standard_normal((rows, 1)).astype(dt),
        "k": dt(0.25),
    }
    return model, feeds


@pytest.mark.parametrize("elem", [F, H, TensorProto.DOUBLE, BF], ids=["f32", "f16", "f64", "bf16"])
@pytest.mark.parametrize("rows, cols", [(64, 96), (3, 4), (5, 1028), (64, 95), (7, 6), (1, 3)])
def test_quad_variant_gives_the_unfused_bits(elem, rows, cols, monkeypatch, variants):
    """Innermost size a multiple of 4 (quads) or not (one element a thread); every input mode."""
    model, feeds = broadcast_chain(elem, rows, cols)
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1
    assert_same_bits(on, off)
    assert variants and all(v == (cols % 4 == 0) for v in variants), variants


def test_quad_variant_with_the_group_shape_merged_across_axes(monkeypatch, variants):
    # (8, 3, 4) with a (3, 4) input: one merged innermost axis of 12 for both
    model = make_model(
        [node("Mul", ["x", "s"], ["a"], "mul"), node("Exp", ["a"], ["e"], "exp"), node("Add", ["e", "x"], ["y"], "add")],
        [("x", F, [8, 3, 4]), ("s", F, [3, 4])],
        [("y", F, [8, 3, 4])],
    )
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((8, 3, 4)).astype(np.float32), "s": rng.standard_normal((3, 4)).astype(np.float32)}
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 1 and variants and all(variants)
    assert_same_bits(on, off)


def test_misaligned_views_run_one_element_a_thread(monkeypatch, variants):
    """Inputs that start 4 bytes into their buffer (views) cannot move 16 bytes at a time: the
    element variant runs, with the same bits as the quads on aligned copies and as the unfused ops."""
    from gradgen.cuda import runtime as rt

    n = 4096
    model = make_model(
        [node("Mul", ["x", "z"], ["a"], "mul"), node("Tanh", ["a"], ["t"], "tanh"), node("Sub", ["t", "z"], ["y"], "sub")],
        [("x", F, [n]), ("z", F, [n])],
        [("y", F, [n])],
    )
    rng = np.random.default_rng(12)
    xs = rng.standard_normal(n + 1).astype(np.float32)
    zs = rng.standard_normal(n + 1).astype(np.float32)
    off, _on, _count = run_both(model, {"x": xs[1:], "z": zs[1:]}, monkeypatch)
    monkeypatch.setenv(fusion.ENV, "1")
    with Session(model, device="cuda") as sess:
        (step,) = [s for s in sess.steps if s.op_type == fusion.OP_TYPE]
        kernel = step.entry.cuda
        x_view, z_view = rt.to_device(xs)[1:], rt.to_device(zs)[1:]
        assert int(x_view.gpudata) % 16 == 4 and int(z_view.gpudata) % 16 == 4
        del variants[:]
        from_views = rt.to_host(kernel(x_view, z_view))
        from_copies = rt.to_host(kernel(rt.to_device(xs[1:]), rt.to_device(zs[1:])))
    assert variants == [False, True]
    assert from_views.tobytes() == from_copies.tobytes() == off["y"].tobytes()


# -- in place --------------------------------------------------------------------------------------


def matmul_then_chain(rows: int, cols: int, bias_shape):
    """h = x @ w (dies at the fused step), then y = tanh(h * s + b) - h: y may take h's buffer."""
    model = make_model(
        [
            node("MatMul", ["x", "w"], ["h"], "mm"),
            node("Mul", ["h", "s"], ["a"], "mul"),
            node("Add", ["a", "b"], ["c"], "add"),
            node("Tanh", ["c"], ["t"], "tanh"),
            node("Sub", ["t", "h"], ["y"], "sub"),
        ],
        [("x", F, [rows, 16]), ("w", F, [16, cols]), ("s", F, [cols]), ("b", F, list(bias_shape))],
        [("y", F, [rows, cols])],
    )
    rng = np.random.default_rng(rows + cols)
    feeds = {
        "x": rng.standard_normal((rows, 16)).astype(np.float32),
        "w": rng.standard_normal((16, cols)).astype(np.float32),
        "s": rng.standard_normal(cols).astype(np.float32),
        "b": rng.standard_normal(bias_shape).astype(np.float32),
    }
    return model, feeds


def runs_and_stats(model, feeds, runs: int = 4):
    with Session(model, device="cuda") as sess:
        outs = [sess.run(feeds) for _ in range(runs)]
        return outs, sess.memory_stats()


@pytest.mark.parametrize("graphs", ["0", "1"])
@pytest.mark.parametrize("cols", [128, 130])
def test_a_fused_output_over_a_dying_input_gives_the_traced_bits(graphs, cols, monkeypatch):
    """The traced first run writes y to new memory; planned runs (eager or recorded and
    replayed) write it over h, which dies at the fused step: the same bits, and fusion's."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", graphs)
    model, feeds = matmul_then_chain(64, cols, (1, cols))
    monkeypatch.setenv(fusion.ENV, "0")
    (want, *_), _ = runs_and_stats(model, feeds, runs=1)
    monkeypatch.setenv(fusion.ENV, "1")
    outs, stats = runs_and_stats(model, feeds)
    assert stats["in_place"] == 1 and stats["fallbacks"] == 0 and stats["leaks"] == 0, stats
    for got in outs:
        assert_same_bits(got, want)


@pytest.mark.parametrize("switch", ["0", "1"])
def test_a_broadcast_input_is_never_written_over(switch, monkeypatch):
    """A dying input read at many elements (h: 4 x 1 under a 4 x 8 output, both within one
    256-byte unit of the plan): no output is planned over it, fused or not."""
    monkeypatch.setenv(fusion.ENV, switch)
    axes = helper.make_tensor("axes", I64, [1], [1])
    model = make_model(
        [
            helper.make_node("Constant", [], ["axes"], name="c", value=axes),
            node("ReduceSum", ["x", "axes"], ["h"], "sum", keepdims=1),
            node("Mul", ["z", "h"], ["a"], "mul"),  # a is an output: it never dies, Exp may not take it
            node("Exp", ["a"], ["y"], "exp"),
        ],
        [("x", F, [4, 8]), ("z", F, [4, 8])],
        [("y", F, [4, 8]), ("a", F, [4, 8])],
    )
    rng = np.random.default_rng(13)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "z": rng.standard_normal((4, 8)).astype(np.float32)}
    want = Session(model).run(feeds)
    outs, stats = runs_and_stats(model, feeds)
    assert stats["in_place"] == 0, stats
    for got in outs:
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
        assert_same_bits(got, outs[0])


# -- com.microsoft Gelu ops ---------------------------------------------------------------------------


@pytest.mark.parametrize("elem", [F, H, TensorProto.DOUBLE, BF], ids=["f32", "f16", "f64", "bf16"])
@pytest.mark.parametrize("cols", [12, 13])
def test_gelu_ops_fused_give_their_kernels_bits(elem, cols, monkeypatch, variants):
    model = gelu_ops_model(elem, rows=40, cols=cols)
    dt = NP[elem]
    rng = np.random.default_rng(cols)
    feeds = {
        "x": rng.standard_normal((40, 8)).astype(dt),
        "w": (rng.standard_normal((8, cols)) * 0.5).astype(dt),
        "b": rng.standard_normal(cols).astype(dt),
        "k": dt(1.5),
        "dy": rng.standard_normal((40, cols)).astype(dt),
    }
    off, on, count = run_both(model, feeds, monkeypatch)
    assert count == 2  # [FastGelu, Mul] and [Gelu, GeluGrad, FastGeluGrad]
    assert_same_bits(on, off)
    # the (40, cols) group takes the 16-byte kernel only where cols % 4 == 0; the group over x (40, 8)
    # always does
    assert variants and any(variants) and all(variants) == (cols % 4 == 0), variants


def test_a_gelu_grad_of_mismatched_shapes_is_its_kernels_error(monkeypatch):
    """Fused or not, GeluGrad's dY and X must have one shape (no broadcasting): one error."""
    from gradgen.errors import GradgenError

    model = make_model(
        [
            helper.make_node("Gelu", ["x"], ["e"], name="gelu", domain="com.microsoft"),
            helper.make_node("GeluGrad", ["dy", "e"], ["z"], name="gelu_grad", domain="com.microsoft"),
        ],
        [("x", F, [4, 8]), ("dy", F, [8])],
        [("z", F, [4, 8])],
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    feeds = {"x": np.ones((4, 8), np.float32), "dy": np.ones(8, np.float32)}
    messages = []
    for switch in ("0", "1"):
        monkeypatch.setenv(fusion.ENV, switch)
        with Session(model, device="cuda") as sess:
            assert sum(s.op_type == fusion.OP_TYPE for s in sess.steps) == int(switch)
            with pytest.raises(GradgenError) as caught:
                sess.run(feeds)
        messages.append(str(caught.value))
    assert all("must have one shape" in m for m in messages), messages
