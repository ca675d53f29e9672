"""The CPU backend keeps freed memory for the next run (glibc's malloc, see
``gradgen.executor.session.keep_freed_memory``): a second run of a model with a 64 MiB
intermediate touches no fresh pages; ``GRADGEN_CPU_KEEP_MEMORY=0`` leaves malloc as it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource
    import numpy as np
    from onnx import TensorProto, helper
    from gradgen.executor.session import Session

    n = 16 * 1024 * 1024  # 64 MiB of float32: above glibc's largest mmap threshold
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["t"]), helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    sess = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = np.ones(n, dtype=np.float32)
    sess.run({"x": x})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = sess.run({"x": x})["y"]
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, float(y))
    """
)


def _faults_of_second_run(keep: str) -> tuple[int, float]:
    env = dict(os.environ, GRADGEN_CPU_KEEP_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    faults, value = out.split()
    return int(faults), float(value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_second_run_reuses_freed_memory():
    kept, value = _faults_of_second_run("1")
    plain, plain_value = _faults_of_second_run("0")
    assert value == plain_value == 2.0 * 16 * 1024 * 1024
    assert plain >= 32  # 64 MiB of fresh pages: 16,384 of 4 KiB, or 32 of 2 MiB (transparent huge pages)
    assert kept <= plain // 10


# ---------------------------------------------------------------------------------------------
# in place: elementwise steps write their result over an input that dies at the step

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from gradgen.executor import cpu_program  # noqa: E402
from gradgen.executor import session as session_module  # noqa: E402
from gradgen.kernels import registry  # noqa: E402

SPECIAL = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-40, -3.5, 2.25], dtype=np.float64)


def _values(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    if x.dtype.kind == "f" and x.size >= SPECIAL.size:
        x.reshape(-1)[: SPECIAL.size] = SPECIAL.astype(dtype)
    return x if x.dtype.kind == "f" else (x * 1000).astype(dtype)


INTO_CASES = [
    # (domain, op, input shapes, dtype)
    ("", "Add", [(3, 4, 5), (3, 4, 5)], np.float32),
    ("", "Add", [(3, 4, 5), (4, 1)], np.float32),
    ("", "Sub", [(5,), (2, 3, 5)], np.float64),
    ("", "Mul", [(2, 3), (2, 3)], np.int64),
    ("", "Div", [(6, 7), (7,)], np.float32),
    ("", "Sum", [(4, 6), (4, 6), (6,), (1, 6)], np.float32),
    ("", "Sum", [(1, 6), (4, 6), (4, 6)], np.float64),
    ("", "Max", [(4, 6), (4, 6), (4, 6)], np.float32),
    ("", "Min", [(4, 6), (6,)], np.float32),
    ("", "Relu", [(3, 8)], np.float32),
]


@pytest.mark.parametrize(("domain", "op", "shapes", "dtype"), INTO_CASES)
def test_in_place_forms_give_the_kernels_result_bit_for_bit(domain, op, shapes, dtype):
    entry = registry.lookup(domain, op)
    full = np.broadcast_shapes(*shapes)
    for position, shape in enumerate(shapes):
        args = [_values(s, dtype, seed) for seed, s in enumerate(shapes)]
        expected = np.asarray(entry.cpu(*args))
        result = entry.cpu_into(position, *[a.copy() for a in args[:position]], args[position], *args[position + 1 :])
        if shape != full or (op == "Sum" or op in ("Max", "Min")) and position > 1:
            assert result is None, (op, position)  # nothing written: the kernel runs instead
            continue
        assert result is args[position]
        assert result.dtype == expected.dtype and result.shape == expected.shape
        assert result.flags.c_contiguous == expected.flags.c_contiguous
        assert result.tobytes() == expected.tobytes()


def test_in_place_forms_refuse_what_the_kernel_would_not_write_there():
    a = np.ones((4, 4), np.float32)
    assert registry.lookup("", "Add").cpu_into(0, a, np.ones((4, 4), np.float64)) is None  # another dtype
    assert registry.lookup("", "Add").cpu_into(0, a, np.ones((4, 4), np.float32).T) is None  # not C-contiguous
    assert registry.lookup("", "Mul").cpu_into(0, a, np.ones((5,), np.float32)) is None  # no broadcast: the kernel's error
    assert registry.lookup("", "Div").cpu_into(0, np.ones(3, np.int32), np.ones(3, np.int32)) is None  # C division
    assert np.all(a == 1)


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _reused_steps(sess, feeds):
    """Run once; the op types whose result took an input's memory."""
    reused = []

    def watch(step, args, result):
        if any(result is a for a in args):
            reused.append(step.op_type)

    sess.step_observer = watch
    return sess.run(feeds), reused


@pytest.fixture
def in_place_at_any_size(monkeypatch):
    monkeypatch.setattr(cpu_program, "IN_PLACE_MIN_BYTES", 0)


def test_a_step_writes_over_a_dying_intermediate_never_a_feed_a_constant_an_output_or_a_viewed_value(in_place_at_any_size):
    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    nodes = [
        helper.make_node("Mul", ["x", "x"], ["t"]),  # x is the caller's: never written
        helper.make_node("Add", ["t", "w"], ["u"]),  # t dies here: u takes its memory; w is a constant
        helper.make_node("Relu", ["u"], ["r"]),  # u dies here, r takes its memory
        helper.make_node("Shape", ["r"], ["shape"]),
        helper.make_node("Reshape", ["r", "shape"], ["view"]),  # a view of r, read below
        helper.make_node("Sub", ["r", "w"], ["s"]),  # r dies here but its view lives on: not overwritten
        helper.make_node("Add", ["s", "view"], ["out1"]),  # s dies: out1 takes it
        helper.make_node("Mul", ["out1", "x"], ["out2"]),  # out1 is a graph output: not overwritten
    ]
    model = _model(nodes, [("x", [3, 4])], ["out1", "out2"], [helper.make_tensor("w", TensorProto.FLOAT, [3, 4], w.ravel())])
    x = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    x_before = x.copy()
    sess = session_module.Session(model)
    for _ in range(2):  # the constant is unchanged by the first run
        out, reused = _reused_steps(sess, {"x": x})
        r = np.maximum(x * x + w, 0)
        assert out["out1"].tobytes() == ((r - w) + r).tobytes()
        assert out["out2"].tobytes() == (((r - w) + r) * x).tobytes()
        assert reused == ["Add", "Relu", "Add"]
        assert np.array_equal(x, x_before)


def test_only_a_large_array_nothing_else_refers_to_counts_as_overwritable():
    n = cpu_program.IN_PLACE_MIN_BYTES // 8
    values = [np.ones(n), np.ones(n), np.ones(n - 1)]
    args = (values[0], values[1], values[2])
    assert cpu_program.overwritable(args, 0)
    view = values[1][1:]  # noqa: F841 -- a view keeps b's memory in use
    assert not cpu_program.overwritable(args, 1)
    assert not cpu_program.overwritable((values[0][1:],), 0)  # a view owns no memory
    assert not cpu_program.overwritable(args, 2)  # small: a fresh result is cheaper than the checks


def test_small_intermediates_get_fresh_results_large_ones_are_written_over():
    nodes = [helper.make_node("Mul", ["x", "x"], ["t"]), helper.make_node("Relu", ["t"], ["r"])]
    model = _model(nodes, [("x", ["n"])], ["r"], [])
    sess = session_module.Session(model)
    for n, expected in ((1000, []), (cpu_program.IN_PLACE_MIN_BYTES // 4, ["Relu"])):
        x = np.linspace(-1, 1, n, dtype=np.float32)
        out, reused = _reused_steps(sess, {"x": x})
        assert reused == expected
        assert out["r"].tobytes() == np.maximum(x * x, 0).tobytes()


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_scatter_nd_in_place_gives_the_kernels_result_bit_for_bit(reduction):
    entry = registry.lookup("", "ScatterND")
    data = _values((7, 3, 4), np.float32, 0)
    indices = np.array([[2], [-1], [2], [0], [6]], np.int64)  # a repeated row and a negative one
    updates = _values((5, 3, 4), np.float32, 1)
    target = data.copy()
    with np.errstate(invalid="ignore"):  # max / min of the NaN in data
        expected = entry.cpu(data, indices, updates, reduction=reduction)
        result = entry.cpu_into(0, target, indices, updates, reduction=reduction)
    assert result is target
    assert result.dtype == expected.dtype and result.shape == expected.shape
    assert result.tobytes() == expected.tobytes()


def test_scatter_nd_in_place_refuses_what_it_cannot_write_whole():
    into = registry.lookup("", "ScatterND").cpu_into
    data = np.zeros((4, 3), np.float32)
    updates = np.ones((2, 3), np.float32)
    assert into(0, data, np.array([[1], [4]]), updates, reduction="add") is None  # out of range: the kernel says so
    assert into(0, data, np.array([[1], [2]]), updates, reduction="none") is None  # the last write wins: the kernel's path
    assert into(0, data, np.array([[1, 0], [2, 1]]), np.ones(2, np.float32), reduction="add") is None  # element indices
    assert into(2, data, np.array([[1], [2]]), updates, reduction="add") is None  # not the data input
    other = np.zeros((4, 3), np.dtype("<f4").newbyteorder("="))  # an equal dtype of another instance
    if other.dtype is not np.dtype(np.float32):
        assert into(0, other, np.array([[1], [2]]), updates, reduction="add") is None
    assert not data.any()


def test_an_embedding_gradient_scatters_into_its_zeros_in_place(in_place_at_any_size):
    nodes = [
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["zeros"],
            value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.0]),
        ),
        helper.make_node("ScatterND", ["zeros", "rows", "u"], ["g"], reduction="add"),
    ]
    initializers = [
        helper.make_tensor("shape", TensorProto.INT64, [2], [6, 3]),
        helper.make_tensor("rows", TensorProto.INT64, [4, 1], [5, 0, 5, -2]),
    ]
    model = _model(nodes, [("u", [4, 3])], ["g"], initializers)
    u = np.arange(12, dtype=np.float32).reshape(4, 3) / 3
    sess = session_module.Session(model)
    for _ in range(2):
        out, reused = _reused_steps(sess, {"u": u})
        expected = np.zeros((6, 3), np.float32)
        np.add.at(expected, np.array([5, 0, 5, -2]), u)
        assert out["g"].tobytes() == expected.tobytes()
        assert reused == ["ScatterND"]


@pytest.mark.parametrize("straight_after_runs", [0, 1000], ids=["straight-line", "closures"])
def test_the_unobserved_program_writes_large_two_input_results_over_dying_inputs(monkeypatch, straight_after_runs):
    """The prepared program's two-input in-place runner (no step observer), in both its forms: a
    chain of binary steps on 1 MiB arrays holds one intermediate at a time, not two, and computes
    the same bits."""
    import tracemalloc

    monkeypatch.setattr(cpu_program, "STRAIGHT_LINE_AFTER_RUNS", straight_after_runs)

    nodes = [
        helper.make_node("Mul", ["x", "x"], ["t"]),
        helper.make_node("Add", ["t", "x"], ["u"]),  # t dies here: u may take its memory
        helper.make_node("Sub", ["u", "x"], ["v"]),  # u dies here
        helper.make_node("Mul", ["v", "x"], ["y"]),
    ]
    model = onnx.shape_inference.infer_shapes(_model(nodes, [("x", ["n"])], ["y"], []))  # typed: no 16-bit checks
    x = np.linspace(-1, 1, 1 << 18, dtype=np.float32)
    want = (((x * x) + x) - x) * x

    def peak(min_bytes: int) -> int:
        monkeypatch.setattr(cpu_program, "IN_PLACE_MIN_BYTES", min_bytes)
        sess = session_module.Session(model)
        assert [step.may_read_low_precision for step in sess.steps] == [False] * 4
        sess.run({"x": x})  # warm-up (plans, caches)
        tracemalloc.start()
        out = sess.run({"x": x})["y"]
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert out.tobytes() == want.tobytes()
        assert (sess._program._straight is not None) == (straight_after_runs == 0)
        return peak_bytes

    assert peak(64 * 1024) < peak(1 << 40) - x.nbytes // 2
