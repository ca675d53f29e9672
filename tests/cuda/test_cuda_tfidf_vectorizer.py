"""TfIdfVectorizer's CUDA launcher (reduction.cu: tfidf_count_*, tfidf_weigh) against the CPU
kernel: every mode with and without weights, gram lengths and skip counts, int32 and int64 ids of
shape [C] and [N, C], empty rows, duplicate n-grams, a long batch (many atomics on a few counts),
two attribute sets in one process (the cached device tables), and the CPU kernel's errors."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import check, check_raises, launches, rand, single_node  # noqa: F401
from tests.test_tfidf_vectorizer import POOL, ROW, WEIGHTS

__all__ = ["launches"]

pytestmark = pytest.mark.cuda

OP = "TfIdfVectorizer"


def check_tfidf(launches, x, **attrs):
    """CPU and GPU outputs equal exactly (counts are exact; weights multiply once, in float64)."""
    return check(launches, OP, [x], exact=True, **attrs)


@pytest.mark.parametrize("weights", [None, WEIGHTS])
@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("grams", [(1, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("skip", [0, 1, 5])
def test_modes_gram_lengths_and_skips(launches, mode, weights, grams, skip):
    x = np.array([ROW, ROW[::-1]], np.int64)
    attrs = dict(mode=mode, min_gram_length=grams[0], max_gram_length=grams[1], max_skip_count=skip, **POOL)
    if weights is not None:
        attrs["weights"] = weights
    check_tfidf(launches, x, **attrs)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("shape", [(12,), (1, 12), (3, 4), (4, 3)])
def test_int32_and_int64_rows_of_both_ranks(launches, dtype, shape):
    x = np.array(ROW, dtype).reshape(shape)
    got = check_tfidf(launches, x, mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=2, **POOL)
    assert got["out0"].shape == ((7,) if len(shape) == 1 else (shape[0], 7))


def test_unigrams_count_once_whatever_the_skip(launches):
    got = check_tfidf(
        launches, np.array([2, 2, 3], np.int64), mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=3, **POOL
    )
    np.testing.assert_array_equal(got["out0"], [2, 1, 0, 0, 0, 0, 0])


@pytest.mark.parametrize("shape", [(0,), (2, 0), (3, 1)])
@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
def test_empty_and_short_rows(launches, shape, mode):
    x = np.full(shape, 9, np.int64)
    check_tfidf(launches, x, mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=1, weights=WEIGHTS, **POOL)


def test_no_ngram_of_the_counted_lengths(launches):
    # only unigrams in the pool, only bigrams counted: an empty trie, the counting kernel skipped
    pool = dict(ngram_counts=[0], ngram_indexes=[0, 1], pool_int64s=[1, 3])
    check_tfidf(launches, np.array(ROW, np.int64), mode="TFIDF", min_gram_length=2, max_gram_length=2, max_skip_count=1, **pool)


def test_duplicate_ngrams_and_shared_columns(launches):
    pool = dict(ngram_counts=[0, 1], ngram_indexes=[1, 0, 0, 2, 0], pool_int64s=[6, 5, 6, 6, 7, 5, 6, 7, 8, 9])
    x = np.array([[5, 6, 7, 8], [6, 7, 6, 7]], np.int32)
    got = check_tfidf(
        launches, x, mode="TFIDF", min_gram_length=1, max_gram_length=2, max_skip_count=1, weights=[2.0, 3.0, 5.0], **pool
    )
    np.testing.assert_array_equal(got["out0"], [[4, 3, 5], [4, 6, 0]])


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_long_batch_with_a_random_pool(launches, dtype):
    rng = np.random.default_rng(3)
    vocabulary = 12
    pool, counts = [], []
    for length, number in zip((1, 2, 3), (8, 60, 100)):
        counts.append(len(pool))
        pool += rng.integers(0, vocabulary, size=length * number).tolist()
    indexes = rng.permutation(168).tolist()
    weights = rand(rng, (168,), low=0.1, high=3.0).tolist()
    x = rng.integers(-2, vocabulary + 2, size=(64, 300)).astype(dtype)
    for mode in ("TF", "TFIDF"):
        check_tfidf(
            launches,
            x,
            mode=mode,
            min_gram_length=1,
            max_gram_length=3,
            max_skip_count=3,
            ngram_counts=counts,
            ngram_indexes=indexes,
            pool_int64s=pool,
            weights=weights,
        )


def test_ids_beyond_int32(launches):
    pool = dict(ngram_counts=[0, 2], ngram_indexes=[0, 1, 2], pool_int64s=[2**40, -(2**35), 2**40, -(2**35)])
    x = np.array([2**40, -(2**35), 7, 2**40, 2**40], np.int64)
    got = check_tfidf(launches, x, mode="TF", min_gram_length=1, max_gram_length=2, max_skip_count=2, **pool)
    np.testing.assert_array_equal(got["out0"], [3, 1, 1])


def test_two_attribute_sets_keep_their_own_tables(launches):
    x = np.array([ROW, ROW[::-1]], np.int64)
    base = dict(min_gram_length=1, max_gram_length=2, max_skip_count=1)
    check_tfidf(launches, x, mode="TF", **base, **POOL)
    other = dict(ngram_counts=[0, 2], ngram_indexes=[1, 0, 2], pool_int64s=[3, 8, 3, 7])
    check_tfidf(launches, x, mode="TF", **base, **other)
    check_tfidf(launches, x, mode="IDF", weights=WEIGHTS, **base, **POOL)


# a pool of strings with the attributes a model must have (a model without them is refused as it loads)
STRING_POOL = dict(pool_strings=["a", "b"], ngram_counts=[0, 1], ngram_indexes=[0, 1])


@pytest.mark.parametrize(
    "x,attrs,match",
    [
        (np.array(ROW, np.int64), dict(STRING_POOL), "pool_strings is not supported"),
        (np.array(ROW, np.int64), dict(mode="BM25", **POOL), "mode must be TF, IDF or TFIDF"),
        (np.array(ROW, np.int64), dict(weights=[1.0], **POOL), "1 weights for 7 output columns"),
        (np.zeros((0, 3), np.int64), dict(**POOL), r"\[C\] or \[N, C\] with N > 0"),
    ],
)
def test_errors(launches, x, attrs, match):
    attrs = {"mode": "TFIDF", "min_gram_length": 1, "max_gram_length": 2, "max_skip_count": 0, **attrs}
    check_raises(launches, OP, [x], match, **attrs)
