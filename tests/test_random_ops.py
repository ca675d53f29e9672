"""RandomNormal, RandomUniform, their Like forms, Bernoulli and Multinomial on the CPU: shapes and
types, the seed's contract (the same numbers at every run with a seed, fresh ones without), the
distributions' statistics on large draws, and the refusals (one-line errors)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from gradgen.errors import RunError
from gradgen.executor import Session


def _model(op_type: str, inputs=(), out_type=TensorProto.FLOAT, **attrs):
    node = helper.make_node(op_type, [name for name, _, _ in inputs], ["y"], **attrs)
    graph = helper.make_graph(
        [node],
        op_type,
        [helper.make_tensor_value_info(name, t, shape) for name, t, shape in inputs],
        [helper.make_tensor_value_info("y", out_type, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22)])


def test_random_normal_statistics_and_type():
    y = Session(_model("RandomNormal", shape=[200, 500], mean=2.0, scale=3.0, dtype=TensorProto.DOUBLE)).run({})["y"]
    assert y.shape == (200, 500) and y.dtype == np.float64
    assert abs(y.mean() - 2.0) < 0.05 and abs(y.std() - 3.0) < 0.05


def test_random_uniform_statistics_and_bounds():
    y = Session(_model("RandomUniform", shape=[100000], low=-2.0, high=6.0)).run({})["y"]
    assert y.dtype == np.float32 and y.min() >= -2.0 and y.max() < 6.0
    assert abs(y.mean() - 2.0) < 0.05


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, TensorProto.FLOAT])
def test_random_uniform_never_draws_high_after_rounding(dtype):
    """float64 draws just below high round up to it in a narrower type; the half-open bound holds."""
    model = _model("RandomUniform", shape=[400000], low=0.0, high=1.0, dtype=dtype, seed=3.0)
    y = Session(model).run({})["y"]
    assert y.min() >= 0.0 and y.max() < 1.0
    if dtype == TensorProto.FLOAT16:  # ~100 draws would have rounded to 1.0; they sit just below it
        assert (y == np.nextafter(np.float16(1), np.float16(0))).sum() > 20


@pytest.mark.parametrize("op_type", ["RandomNormalLike", "RandomUniformLike"])
def test_like_forms_take_the_input_shape_and_type(op_type):
    model = _model(op_type, [("x", TensorProto.FLOAT16, [3, 4])], TensorProto.FLOAT16, seed=5.0)
    y = Session(model).run({"x": np.full((3, 4), np.nan, np.float16)})["y"]
    assert y.shape == (3, 4) and y.dtype == np.float16 and np.isfinite(y).all()


def test_bernoulli_draws_ones_with_the_given_probabilities():
    p = np.tile(np.array([0.0, 0.25, 0.9, 1.0]), (20000, 1))
    y = Session(_model("Bernoulli", [("p", TensorProto.DOUBLE, [20000, 4])], TensorProto.DOUBLE)).run({"p": p})["y"]
    assert y.dtype == np.float64 and set(np.unique(y)) <= {0.0, 1.0}
    np.testing.assert_allclose(y.mean(axis=0), [0.0, 0.25, 0.9, 1.0], atol=0.015)


def test_multinomial_frequencies_follow_the_softmax():
    probabilities = np.array([[0.2, 0.5, 0.3], [0.98, 0.01, 0.01]])
    x = [("x", TensorProto.FLOAT, [2, 3])]
    model = _model("Multinomial", x, TensorProto.INT64, sample_size=30000, dtype=TensorProto.INT64)
    y = Session(model).run({"x": np.log(probabilities).astype(np.float32)})["y"]
    assert y.shape == (2, 30000) and y.dtype == np.int64 and y.min() >= 0 and y.max() <= 2
    for row, want in zip(y, probabilities):
        np.testing.assert_allclose(np.bincount(row, minlength=3) / row.size, want, atol=0.015)


@pytest.mark.parametrize("seeded", [True, False])
def test_a_seed_gives_the_same_numbers_at_every_run_and_none_fresh_ones(seeded):
    attrs = {"seed": 7.0} if seeded else {}
    session = Session(_model("RandomUniform", shape=[64], **attrs))
    first, second = session.run({})["y"], session.run({})["y"]
    assert np.array_equal(first, second) == seeded


@pytest.mark.parametrize(
    "model, feeds, match",
    [
        (_model("RandomNormal", shape=[2, -1]), {}, "cannot draw a random tensor of shape"),
        (_model("RandomUniform", shape=[1 << 20, 1 << 20]), {}, "cannot draw a random tensor of shape"),
        (_model("RandomNormal", (), TensorProto.INT32, shape=[2], dtype=TensorProto.INT32), {}, "must be a float type"),
        (_model("Multinomial", [("x", TensorProto.FLOAT, [3])], TensorProto.INT32), {"x": np.zeros(3, np.float32)}, "classes"),
    ],
    ids=["negative", "huge", "integer", "multinomial-rank"],
)
def test_impossible_draws_are_one_line_errors(model, feeds, match):
    with pytest.raises(RunError, match=match):
        Session(model).run(feeds)
