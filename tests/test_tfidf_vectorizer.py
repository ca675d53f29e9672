"""TfIdfVectorizer's CPU kernel against ONNX's reference evaluator on one-node models: every mode
with and without weights, gram lengths and skip counts, int32 and int64 ids of shape [C] and
[N, C], empty rows, pools with duplicate n-grams or lengths outside the counted range, random
pools; and the KernelErrors of bad attributes and inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import AttributeProto, TensorProto, helper
from onnx.reference import ReferenceEvaluator

from gradgen.errors import KernelError, ModelError
from gradgen.executor import Session
from gradgen.kernels.cpu.reduction import tf_idf_vectorizer

# The backend tests' pool: unigrams 2, 3, 5, 4; bigrams (5, 6), (7, 8), (6, 7).
POOL = dict(ngram_counts=[0, 4], ngram_indexes=[0, 1, 2, 3, 4, 5, 6], pool_int64s=[2, 3, 5, 4, 5, 6, 7, 8, 6, 7])
ROW = [1, 1, 3, 3, 3, 7, 8, 6, 7, 5, 6, 8]
WEIGHTS = [0.5, 1.25, 2.0, 3.0, 0.75, 1.5, 4.0]


def tfidf_model(x: np.ndarray, **attrs):
    """A one-node TfIdfVectorizer model over the graph input x (list attributes may be empty)."""
    node = helper.make_node("TfIdfVectorizer", ["x"], ["y"])
    for name, value in attrs.items():
        kind = {"weights": AttributeProto.FLOATS, "pool_strings": AttributeProto.STRINGS}.get(name, AttributeProto.INTS)
        typed = isinstance(value, list) and not value
        node.attribute.append(helper.make_attribute(name, value, attr_type=kind if typed else None))
    graph = helper.make_graph(
        [node],
        "tfidf",
        [helper.make_tensor_value_info("x", helper.np_dtype_to_tensor_dtype(x.dtype), list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])


def run_gradgen(x: np.ndarray, **attrs) -> np.ndarray:
    return Session(tfidf_model(x, **attrs)).run({"x": x})["y"]


def assert_matches_reference(x: np.ndarray, **attrs) -> np.ndarray:
    """gradgen's output equals the reference's, dtype and shape included. The reference needs the
    weights of IDF and TFIDF (it fails without them): it gets ones there, which is what no weights means."""
    got = run_gradgen(x, **attrs)
    reference_attrs = dict(attrs)
    if attrs["mode"] != "TF" and "weights" not in attrs:
        reference_attrs["weights"] = [1.0] * (max(attrs["ngram_indexes"]) + 1)
    want = ReferenceEvaluator(tfidf_model(x, **reference_attrs)).run(None, {"x": x})[0]
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    return got


@pytest.mark.parametrize("weights", [None, WEIGHTS])
@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("grams", [(1, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("skip", [0, 1, 5])
def test_modes_gram_lengths_and_skips_match_the_reference(mode, weights, grams, skip):
    x = np.array([ROW, ROW[::-1]], np.int64)
    attrs = dict(mode=mode, min_gram_length=grams[0], max_gram_length=grams[1], max_skip_count=skip, **POOL)
    if weights is not None:
        attrs["weights"] = weights
    assert_matches_reference(x, **attrs)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(12,), (1, 12), (3, 4), (4, 3)])
def test_int32_and_int64_rows_of_both_ranks(dtype, shape):
    x = np.array(ROW, dtype).reshape(shape)
    y = assert_matches_reference(x, mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=2, **POOL)
    assert y.shape == ((7,) if len(shape) == 1 else (shape[0], 7))


def test_unigrams_count_once_whatever_the_skip():
    y = run_gradgen(np.array([2, 2, 3], np.int64), mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=3, **POOL)
    np.testing.assert_array_equal(y, [2, 1, 0, 0, 0, 0, 0])


def test_bigrams_count_at_every_skip_distance():
    # (5, 6) adjacent, one apart and two apart; (6, 7) adjacent
    x = np.array([5, 6, 6, 6, 7], np.int64)
    y = run_gradgen(x, mode="TF", min_gram_length=2, max_gram_length=2, max_skip_count=2, **POOL)
    np.testing.assert_array_equal(y, [0, 0, 0, 0, 3, 0, 3])
    assert_matches_reference(x, mode="TF", min_gram_length=2, max_gram_length=2, max_skip_count=2, **POOL)


@pytest.mark.parametrize("shape", [(0,), (2, 0), (3, 1)])
@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_empty_and_short_rows_give_zeros(shape, mode):
    x = np.full(shape, 9, np.int64)  # 9 is in no n-gram
    y = assert_matches_reference(x, mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=1, weights=WEIGHTS, **POOL)
    assert not y.any()


def test_empty_weights_mean_unit_weights():
    x = np.array(ROW, np.int64)
    attrs = dict(min_gram_length=1, max_gram_length=2, max_skip_count=1, **POOL)
    y = assert_matches_reference(x, mode="TFIDF", weights=[], **attrs)
    np.testing.assert_array_equal(y, run_gradgen(x, mode="TF", **attrs))
    np.testing.assert_array_equal(assert_matches_reference(x, mode="IDF", weights=[], **attrs), y > 0)


def test_lengths_outside_the_range_keep_their_positions():
    # no unigrams at all (ngram_counts [0, 0]); then trigrams that max_gram_length 2 leaves out
    pool = dict(ngram_counts=[0, 0, 6], ngram_indexes=[2, 0, 1, 3, 4], pool_int64s=[5, 6, 7, 8, 6, 7, 1, 1, 3, 3, 3, 7])
    x = np.array(ROW, np.int32)
    assert_matches_reference(x, mode="TF", min_gram_length=2, max_gram_length=2, max_skip_count=0, **pool)
    y = assert_matches_reference(x, mode="TF", min_gram_length=2, max_gram_length=3, max_skip_count=0, **pool)
    np.testing.assert_array_equal(y, [1, 1, 1, 1, 1])


def test_duplicate_ngrams_and_shared_columns():
    # (5, 6) listed twice, in columns 0 and 2: the last wins; (6, 7) and (7, 8) share column 0; the
    # partial last bigram (9) is dropped
    pool = dict(ngram_counts=[0, 1], ngram_indexes=[1, 0, 0, 2, 0], pool_int64s=[6, 5, 6, 6, 7, 5, 6, 7, 8, 9])
    x = np.array([[5, 6, 7, 8], [6, 7, 6, 7]], np.int64)
    y = assert_matches_reference(
        x, mode="TFIDF", min_gram_length=1, max_gram_length=2, max_skip_count=1, weights=[2.0, 3.0, 5.0], **pool
    )
    np.testing.assert_array_equal(y, [[4, 3, 5], [4, 6, 0]])


def test_random_pools_match_the_reference():
    rng = np.random.default_rng(7)
    for _ in range(150):
        longest = int(rng.integers(1, 5))
        shortest = int(rng.integers(1, longest + 1))
        vocabulary = int(rng.integers(1, 6))
        pool, counts = [], []
        for length in range(1, int(rng.integers(1, 5)) + 1):
            counts.append(len(pool))
            pool += rng.integers(0, vocabulary, size=length * int(rng.integers(0, 5))).tolist()
        total = sum((b - a) // n for n, (a, b) in enumerate(zip(counts, [*counts[1:], len(pool)]), 1))
        if total == 0:
            continue
        attrs = dict(
            mode=str(rng.choice(["TF", "IDF", "TFIDF"])),
            min_gram_length=shortest,
            max_gram_length=longest,
            max_skip_count=int(rng.integers(0, 4)),
            ngram_counts=counts,
            ngram_indexes=rng.integers(0, total + 2, size=total).tolist(),
            pool_int64s=pool,
        )
        if rng.random() < 0.5:
            attrs["weights"] = rng.uniform(0.1, 3, size=max(attrs["ngram_indexes"]) + 1).astype(np.float32).tolist()
        shape = (int(rng.integers(0, 12)),) if rng.random() < 0.5 else (int(rng.integers(1, 4)), int(rng.integers(0, 12)))
        assert_matches_reference(rng.integers(0, vocabulary + 1, size=shape).astype(rng.choice([np.int32, np.int64])), **attrs)


def test_tf_reads_no_weights():
    x = np.array(ROW, np.int64)
    assert_matches_reference(x, mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=0, weights=[3.0], **POOL)


def test_the_kernel_called_directly_matches_the_session():
    x = np.array([ROW, ROW], np.int64)
    attrs = dict(mode="TFIDF", min_gram_length=1, max_gram_length=2, max_skip_count=1, weights=WEIGHTS, **POOL)
    np.testing.assert_array_equal(tf_idf_vectorizer(x, **attrs), run_gradgen(x, **attrs))


BASE = dict(mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=0, **POOL)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(pool_strings=["a", "b"], pool_int64s=None), "pool_strings is not supported"),
        (dict(pool_int64s=None), r"needs the attribute\(s\) pool_int64s"),
        (dict(mode="BM25"), "mode must be TF, IDF or TFIDF"),
        (dict(min_gram_length=0), "1 <= min_gram_length <= max_gram_length"),
        (dict(min_gram_length=3), "1 <= min_gram_length <= max_gram_length"),
        (dict(max_skip_count=-1), "max_skip_count >= 0"),
        (dict(ngram_indexes=[0, 1, -1, 3, 4, 5, 6]), "non-negative"),
        (dict(ngram_indexes=[0, 1, 2, 3, 4, 5]), "the pool holds 7 n-grams, ngram_indexes 6"),
        (dict(ngram_counts=[0, 12]), "must rise within the pool"),
        (dict(ngram_counts=[4, 0]), "must rise within the pool"),
        (dict(mode="IDF", weights=[1.0, 2.0]), "2 weights for 7 output columns"),
    ],
)
def test_bad_attributes_raise(change, match):
    attrs = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(KernelError, match=match):
        run_gradgen(np.array(ROW, np.int64), **attrs)


def test_a_model_without_a_required_attribute_is_refused_as_it_loads():
    attrs = {k: v for k, v in BASE.items() if k != "ngram_counts"}
    with pytest.raises(ModelError, match="lacks the attribute 'ngram_counts', which TfIdfVectorizer requires"):
        run_gradgen(np.array(ROW, np.int64), **attrs)


@pytest.mark.parametrize(
    "x,match",
    [
        (np.zeros((0, 3), np.int64), r"\[C\] or \[N, C\] with N > 0"),
        (np.zeros((2, 2, 3), np.int64), r"\[C\] or \[N, C\] with N > 0"),
        (np.zeros(3, np.float32), "counts int32 or int64 ids, got float32"),
    ],
)
def test_bad_inputs_raise(x, match):
    with pytest.raises(KernelError, match=match):
        tf_idf_vectorizer(x, **BASE)
    with pytest.raises(KernelError, match=match):
        run_gradgen(x, **BASE)
