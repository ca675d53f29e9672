"""Planned device memory on the GPU: traced first run, served later runs, one shared arena,
bounded graphs, close(), threads."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import KernelError, UsageError
from gradgen.executor import Session
from tests.cuda.test_cuda_graphs import gather_square_model
from tests.model_dirs import SAMPLE_DIRS, dir_id, load

pytestmark = pytest.mark.cuda


def _mlp(rows="n", hidden=64, seed=0):
    """loss = sum((relu(x @ W1) @ W2)^2) with a symbolic (or fixed) row count; its backward graph."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((16, hidden)).astype(np.float32)
    w2 = rng.standard_normal((hidden, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        helper.make_node("Mul", ["y", "y"], ["sq"], name="square"),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, 16])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return gradgen.build_backward(model, wrt_inputs=True).model


def _x(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)


def _assert_close(got, want):
    """float32 on the GPU against float32 on the CPU: the error scales with the tensor's largest
    element (sums of many products), not with each element."""
    for name, value in want.items():
        scale = float(np.abs(value).max(initial=0.0))
        error = float(np.abs(got[name].astype(np.float64) - value).max(initial=0.0))
        assert error <= 1e-5 * scale + 1e-30, f"{name}: max |gpu - cpu| {error:.3g}, max |cpu| {scale:.3g}"


@pytest.mark.parametrize("path", SAMPLE_DIRS, ids=dir_id)
def test_served_runs_are_bit_equal_to_the_traced_run(path, monkeypatch):
    """Without graphs: run 1 is traced (pool memory), runs 2 and 3 are served from the plan."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "0")
    model, inputs, _, _ = load(path)
    with Session(gradgen.build_backward(model).model, device="cuda") as session:
        runs = [session.run(inputs) for _ in range(3)]
        stats = session.memory_stats()
    for result in runs[1:]:
        for name, want in runs[0].items():
            assert np.array_equal(result[name], want), name
    assert stats["served"] > 0 and stats["fallbacks"] == 0 and stats["leaks"] == 0, stats
    assert 0 < stats["peak_live_bytes"] <= stats["planned_bytes"] <= stats["arena_bytes"], stats


def test_a_recorded_graph_holds_no_buffers_of_its_own(monkeypatch):
    from gradgen.cuda import runtime as rt

    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    sample = next(p for p in SAMPLE_DIRS if p.name == "transformer")
    model, inputs, _, _ = load(sample)
    with Session(gradgen.build_backward(model).model, device="cuda") as session:
        first = session.run(inputs)
        rt.memory_pool().free_held()
        pool_before = rt.memory_pool().managed_bytes
        for _ in range(4):  # recorded on the second run, replayed after
            for name, want in first.items():
                assert np.array_equal(session.run(inputs)[name], want), name
        stats = session.memory_stats()
        rt.memory_pool().free_held()
        grown = rt.memory_pool().managed_bytes - pool_before
    assert stats["graphs"] == 1 and stats["fallbacks"] == 0 and stats["leaks"] == 0, stats
    assert grown < 64 * 1024, f"the recorded graph took {grown} bytes from the pool"


def test_many_shapes_share_one_arena_and_a_bounded_graph_cache(monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    monkeypatch.setenv("GRADGEN_CUDA_GRAPH_CACHE", "2")
    built = _mlp()
    cpu = Session(built)
    with Session(built, device="cuda") as session:
        for step, rows in enumerate([256, 64, 192, 16, 256, 8, 64, 128, 256]):
            for repeat in range(3):
                x = _x(rows, 10 * step + repeat)
                _assert_close(session.run({"x": x}), cpu.run({"x": x}))
            stats = session.memory_stats()
            assert stats["graphs"] <= 2, stats
        plans = session.backend.memory.plans
        assert stats["arena_bytes"] >= max(p.size for p in plans.values())
        assert stats["arena_bytes"] < 2 * max(p.size for p in plans.values()) + (2 << 20)
        assert stats["leaks"] == 0 and stats["fallbacks"] == 0, stats


def test_two_sessions_share_one_arena():
    small, big = _mlp(rows=32, hidden=32, seed=1), _mlp(rows=4096, hidden=256, seed=2)
    cpu_small, cpu_big = Session(small), Session(big)
    with Session(small, device="cuda") as a, Session(big, device="cuda") as b:
        for seed in range(3):
            xs, xb = _x(32, seed), _x(4096, seed + 100)
            _assert_close(a.run({"x": xs}), cpu_small.run({"x": xs}))
            _assert_close(b.run({"x": xb}), cpu_big.run({"x": xb}))
        assert a.backend.memory.host is b.backend.memory.host
        assert a.memory_stats()["arena_bytes"] == b.memory_stats()["arena_bytes"] >= b.memory_stats()["planned_bytes"]


def test_close_releases_the_arena_and_refuses_later_runs():
    gc.collect()
    built = _mlp(rows=512)
    session = Session(built, device="cuda")
    for seed in range(3):
        session.run({"x": _x(512, seed)})
    host = session.backend.memory.host
    key = id(session.backend.memory)
    assert key in host.needs and host.arena is not None
    session.close()
    assert key not in host.needs
    if not host.needs:  # no other Session alive in this process: the arena is gone
        assert host.arena is None
    with pytest.raises(UsageError, match="closed"):
        session.run({"x": _x(512, 0)})
    with Session(built, device="cuda") as again:
        again.run({"x": _x(512, 0)})
    assert again.closed


def test_an_error_in_a_planned_run_keeps_the_arena(monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "0")
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    model = gather_square_model(table)
    with Session(model, device="cuda") as session:
        good = np.array([0, 1, 3, 2, -1], np.int64)
        for _ in range(2):
            np.testing.assert_array_equal(session.run({"ids": good})["y"], table[good] ** 2)
        with pytest.raises(KernelError, match="out of range"):
            session.run({"ids": np.array([0, 1, 7, 2, 3], np.int64)})
        np.testing.assert_array_equal(session.run({"ids": good})["y"], table[good] ** 2)
        stats = session.memory_stats()
    assert stats["leaks"] == 0 and stats["fallbacks"] == 0, stats


def thread_workout(graphs: str) -> None:
    """Four threads: each runs one shared Session and one of two other Sessions, alternating
    shapes, and checks every result against the CPU. Raises on the first mismatch or error."""
    import os

    os.environ["GRADGEN_CUDA_GRAPHS"] = graphs
    built = _mlp()
    cpu = Session(built)
    shared = Session(built, device="cuda")
    own = [Session(built, device="cuda") for _ in range(2)]
    failures = []

    def work(worker):
        try:
            for i in range(6):
                rows = (64, 128, 64)[i % 3]
                x = _x(rows, 1000 * worker + i)
                want = cpu.run({"x": x})
                for session in (shared, own[worker % 2]):
                    _assert_close(session.run({"x": x}), want)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(f"worker {worker}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    try:
        assert not failures, failures
        assert all(session.memory_stats()["leaks"] == 0 for session in [shared, *own])
    finally:
        for session in [shared, *own]:
            session.close()


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_threads_sharing_one_session_and_two_sessions_in_threads(graphs):
    """In a fresh process, so that the threads start from a process whose GPU was never used."""
    import subprocess
    import sys

    code = f"from tests.cuda.test_cuda_memory import thread_workout; thread_workout({graphs!r}); print('threads ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "threads ok" in result.stdout, (result.stdout + result.stderr)[-3000:]


def _in_place_model(rows=64, cols=128):
    """y = (exp(x + w) * c - tanh(...)) chains whose inputs die at each step, and a ScatterElements
    over a computed (dying) data tensor: every step can write its output over an input."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.1
    c = rng.standard_normal((cols,)).astype(np.float32)
    idx = rng.integers(0, cols, size=(rows, 4)).astype(np.int64)
    nodes = [
        helper.make_node("Add", ["x", "w"], ["t"], name="add"),
        helper.make_node("Exp", ["t"], ["e"], name="exp"),
        helper.make_node("Mul", ["e", "c"], ["m"], name="mul"),
        helper.make_node("Tanh", ["m"], ["h"], name="tanh"),
        helper.make_node("Sub", ["x", "w"], ["d"], name="data"),
        helper.make_node("Slice", ["h", "zero", "four", "one"], ["upd"], name="updates"),
        helper.make_node("ScatterElements", ["d", "idx", "upd"], ["s"], axis=1, name="scatter"),
        helper.make_node("Sub", ["s", "h"], ["y"], name="out"),
    ]
    inits = [
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(c, "c"),
        numpy_helper.from_array(idx, "idx"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([4], np.int64), "four"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "in_place",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, cols])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, cols])],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_outputs_written_over_dying_inputs_match_the_traced_run(graphs, monkeypatch):
    """The traced first run writes every output to new memory; planned runs (eager or replayed)
    put Exp, Mul, Tanh, ScatterElements and the last Sub over their dying inputs: same bits."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", graphs)
    monkeypatch.setenv("GRADGEN_CUDA_FUSION", "0")  # each elementwise op its own kernel, as described
    model = _in_place_model()
    x = np.random.default_rng(4).standard_normal((64, 128)).astype(np.float32)
    want = Session(model).run({"x": x})["y"]
    with Session(model, device="cuda") as session:
        runs = [session.run({"x": x})["y"] for _ in range(4)]
        stats = session.memory_stats()
    _assert_close({"y": runs[0]}, {"y": want})
    for got in runs[1:]:
        assert np.array_equal(got, runs[0])
    assert stats["in_place"] >= 4 and stats["fallbacks"] == 0 and stats["leaks"] == 0, stats
    assert 0 < stats["peak_live_bytes"] <= stats["planned_bytes"], stats


@pytest.mark.parametrize("path", SAMPLE_DIRS, ids=dir_id)
def test_in_place_plans_of_the_samples_backward_graphs_are_bit_equal(path, monkeypatch):
    """Backward graphs (gradient chains, Sum of contributions, Where masks): the planned runs with
    outputs over dying inputs give the traced run's bits, replayed or not."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    model, inputs, _, _ = load(path)
    with Session(gradgen.build_backward(model).model, device="cuda") as session:
        runs = [session.run(inputs) for _ in range(3)]
    for result in runs[1:]:
        for name, want in runs[0].items():
            assert np.array_equal(result[name], want), name


def test_a_variable_length_loop_replays_every_length_from_its_second_pass(monkeypatch):
    """Once a second shape comes, each new shape is recorded right after its traced run (and the
    first shape, with zero inputs): the second pass over the lengths only replays."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")
    built = _mlp()
    cpu = Session(built)
    lengths = [256, 192, 128, 64]
    with Session(built, device="cuda") as session:
        for rows in lengths:
            x = _x(rows, rows)
            _assert_close(session.run({"x": x}), cpu.run({"x": x}))
        assert session.memory_stats()["graphs"] == len(lengths)

        def no_recording(*args, **kwargs):
            raise AssertionError("the second pass recorded a graph")

        monkeypatch.setattr(session.backend, "_record", no_recording)
        for rows in lengths:
            x = _x(rows, rows + 1)
            _assert_close(session.run({"x": x}), cpu.run({"x": x}))
        stats = session.memory_stats()
    assert stats["leaks"] == 0 and stats["fallbacks"] == 0, stats
