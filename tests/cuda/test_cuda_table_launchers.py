"""CUDA launchers of Hardmax, IsInf and EyeLike (composed of ArgMax's and OneHot's kernels and the
elementwise comparisons) and of the signal-processing tables (HannWindow, HammingWindow,
BlackmanWindow, MelWeightMatrix: the CPU kernel's table uploaded once per set of scalar inputs and
copied into each run's output): each runs a one-node model on the CPU and on the GPU (where the
launcher must run) and compares exactly."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from tests.cuda.test_cuda_more_launchers import FLOATS, check, launches, rand

__all__ = ["launches"]  # the fixture, used by name

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("opset, axis", [(13, None), (13, 0), (13, 1), (13, -2), (11, None), (11, 0), (11, 2)], ids=str)
def test_hardmax(launches, dtype, opset, axis):
    rng = np.random.default_rng(0)
    x = rand(rng, (3, 4, 5), dtype)
    x[0, 0, :2] = x[0, 0].max()  # a tie: the first largest wins
    x[1, 2, 3] = np.nan  # NaN counts as the largest, as np.argmax
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "Hardmax", [x], opset=opset, exact=True, **attrs)


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 0, 3)], ids=str)
def test_hardmax_of_empty_tensors(launches, shape):
    check(launches, "Hardmax", [np.zeros(shape, np.float32)], exact=True)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("negative, positive", [(1, 1), (1, 0), (0, 1), (0, 0)])
def test_is_inf(launches, dtype, negative, positive):
    x = np.array([[np.inf, -np.inf, np.nan, 0.0], [1.0, -2.0, np.inf, -0.0]]).astype(dtype)
    check(launches, "IsInf", [x], opset=20, exact=True, detect_negative=negative, detect_positive=positive)


def test_is_inf_of_integers_runs_the_cpu_kernel(launches):
    check(launches, "IsInf", [np.arange(6, dtype=np.int32).reshape(2, 3)], opset=20, exact=True)


@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (1, 1), (0, 3), (3, 0)], ids=str)
@pytest.mark.parametrize("k", [-5, -1, 0, 2, 7])
def test_eye_like(launches, shape, k):
    check(launches, "EyeLike", [np.zeros(shape, np.float32)], exact=True, k=k)


@pytest.mark.parametrize(
    "to", [TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL], ids=str
)
def test_eye_like_output_types(launches, to):
    check(launches, "EyeLike", [np.zeros((3, 5), np.int64)], exact=True, k=1, dtype=to)


@pytest.mark.parametrize("op_type", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("periodic", [0, 1])
@pytest.mark.parametrize("size", [0, 1, 9, 400])
def test_windows(launches, op_type, periodic, size):
    check(launches, op_type, [np.array(size, np.int64)], opset=17, exact=True, periodic=periodic)


def test_a_window_table_is_copied_into_each_run(launches):
    """The cached table is copied into the step's output: a consumer writing over it in place
    (Add may, in the memory plan) must not change the next run's window."""
    from onnx import helper

    from gradgen.executor import Session

    node = helper.make_node("HannWindow", ["size"], ["w"])
    twice = helper.make_node("Add", ["w", "w"], ["y"])
    graph = helper.make_graph(
        [node, twice],
        "hann_twice",
        [helper.make_tensor_value_info("size", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    calls = launches("HannWindow")
    session = Session(model, device="cuda")
    runs = [session.run({"size": np.array(16, np.int64)})["y"] for _ in range(4)]
    assert calls
    want = Session(model).run({"size": np.array(16, np.int64)})["y"]
    for got in runs:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("args", [(8, 64, 16000, 0.0, 8000.0), (40, 512, 22050, 20.0, 11000.0)])
def test_mel_weight_matrix(launches, args):
    bins, length, rate, low, high = args
    inputs = [np.array(bins, np.int64), np.array(length, np.int64), np.array(rate, np.int64)]
    inputs += [np.array(low, np.float32), np.array(high, np.float32)]
    check(launches, "MelWeightMatrix", inputs, opset=17, exact=True)


# ---------------------------------------------------------------- random generators: drawn on the
# host by the CPU kernels, so a seeded draw is the CPU session's, exactly


@pytest.mark.parametrize(
    "op_type, attrs",
    [("RandomNormal", dict(shape=[3, 5], mean=1.0, scale=2.0)), ("RandomUniform", dict(shape=[7], low=-1.0, high=3.0))],
)
def test_seeded_generators_without_inputs_draw_the_cpu_sessions_numbers(launches, op_type, attrs):
    """No inputs: the launcher draws on the host with the CPU kernel and uploads the draw."""
    check(launches, op_type, [], opset=22, exact=True, seed=3.0, **attrs)


def test_an_unfolded_constant_is_uploaded(launches):
    """A Session folds Constant nodes at plan time; the launcher (for one that is not folded)
    uploads a float tensor and keeps an integer one on the host."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels import registry

    calls = launches("Constant")
    launcher = registry.lookup("", "Constant").cuda
    floats = launcher(value=np.arange(6, dtype=np.float32).reshape(2, 3))
    ints = launcher(value_ints=[4, 5])
    assert calls == ["Constant", "Constant"]
    assert rt.is_device(floats) and not rt.is_device(ints)
    np.testing.assert_array_equal(rt.to_host(floats), np.arange(6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(ints, [4, 5])


@pytest.mark.parametrize(
    "op_type, inputs, attrs",
    [
        ("RandomNormalLike", [np.zeros((2, 3), np.float16)], {}),
        ("RandomUniformLike", [np.zeros((4, 2), np.float32)], dict(dtype=TensorProto.DOUBLE)),
        ("Bernoulli", [np.array([0.0, 0.3, 0.7, 1.0], np.float32)], {}),
        ("Multinomial", [np.log(np.array([[0.2, 0.8], [0.5, 0.5]], np.float32))], dict(sample_size=6)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_seeded_random_draws_are_the_cpu_sessions(launches, op_type, inputs, attrs):
    check(launches, op_type, inputs, opset=22, exact=True, seed=3.0, **attrs)
