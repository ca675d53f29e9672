"""CPU kernels: reductions, arg-reductions, CumSum/CumProd, Softmax/LogSoftmax/Hardmax, TopK and
TfIdfVectorizer's n-gram counts.

The Reduce* ops take ``axes`` as an attribute in older opsets (ReduceSum < 13, the others < 18)
and as an optional second input later; both forms bind to the kernel's ``axes`` parameter.
Every reduction keeps the input's dtype, as the spec says.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import onednn_eltwise, onednn_rows
from gradgen.kernels.cpu.prepared import constant_inputs, per_shape
from gradgen.kernels.numeric import accumulation_dtype, same_shape
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.attributes import text
from gradgen.ops.axes import normalize_axis
from gradgen.ops.schemas import FLOATS, Attribute, Formal, Schema


def reduce_axes(data: np.ndarray, axes, noop_with_empty_axes: int) -> tuple[int, ...]:
    """The normalised axes to reduce; () reduces nothing (noop_with_empty_axes)."""
    axes = None if axes is None else np.asarray(axes)
    if axes is None or axes.size == 0:
        return () if noop_with_empty_axes else tuple(range(data.ndim))
    return _normalised_axes(data.ndim, tuple(axes.reshape(-1).tolist()))


@functools.lru_cache(maxsize=1024)
def _normalised_axes(rank: int, axes: tuple) -> tuple[int, ...]:
    """Sorted, in-range, distinct reduction axes; worked out once per (rank, axes), errors not cached."""
    values = [int(a) for a in axes]
    normalised = tuple(normalize_axis(a, rank, "reduction axis") for a in values)
    if len(set(normalised)) != len(normalised):
        raise KernelError(f"repeated reduction axes {values}")
    return tuple(sorted(normalised))


def _reducer(name: str, fn, pre=None, post=None):
    """A Reduce* kernel: out = post(fn(pre(data), axes)), cast back to data's dtype."""

    def kernel(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        # No axes with noop_with_empty_axes=1 reduces nothing: the elementwise part (square,
        # abs, log...) still applies, as in the ONNX reference implementation.
        reduce_over = reduce_axes(data, axes, noop_with_empty_axes)
        x = pre(data) if pre is not None else data
        out = fn(x, reduce_over, bool(keepdims))
        if post is not None:
            out = post(out)
        return np.asarray(out).astype(data.dtype, copy=False)

    kernel.__name__ = name
    return kernel


def _planned_axes(constants: tuple, attrs: dict):
    """(shape -> the normalised axes to reduce, keepdims) of a Reduce* node whose axes are known at
    plan time (a constant input or the attribute), or None where they come at run time."""
    given = constant_inputs(constants, 1)
    if given is None:
        return None
    axes = given[0] if given[0] is not None else attrs.get("axes")
    noop = attrs.get("noop_with_empty_axes", 0)

    def axes_for(shape: tuple) -> tuple[int, ...]:
        return reduce_axes(np.empty((0,) * len(shape)), axes, noop)

    return axes_for, bool(attrs.get("keepdims", 1))


def _reducer_preparer(fn, pre=None, post=None):
    """The preparer of a ``_reducer`` kernel: its axes (constant input or attribute) normalised once
    per input rank; then the same calls as the kernel."""

    def prepare(constants: tuple, attrs: dict):
        planned = _planned_axes(constants, attrs)
        if planned is None:
            return None
        axes_for, keepdims = planned
        over = per_shape(axes_for)

        def run(data, axes=None):
            x = pre(data) if pre is not None else data
            out = fn(x, over(data.shape), keepdims)
            if post is not None:
                out = post(out)
            return np.asarray(out).astype(data.dtype, copy=False)

        return run

    return prepare


def _identity_for(dtype: np.dtype, largest: bool):
    if dtype.kind == "f":
        return -np.inf if largest else np.inf
    if dtype.kind == "b":
        return False if largest else True
    info = np.iinfo(dtype)
    return info.min if largest else info.max


def _max(x, axes, keepdims):
    return np.max(x, axis=axes, keepdims=keepdims, initial=_identity_for(x.dtype, True))


def _min(x, axes, keepdims):
    return np.min(x, axis=axes, keepdims=keepdims, initial=_identity_for(x.dtype, False))


def _sum(x, axes, keepdims):
    return np.add.reduce(x, axis=axes, keepdims=keepdims, dtype=x.dtype)  # np.sum without its Python wrapper


# the largest count each float type holds exactly (its significand's range)
_EXACT_COUNTS = {np.dtype(np.float32): 1 << 24, np.dtype(np.float64): 1 << 53}


def count_divisor(dtype: np.dtype, count: int):
    """What np.mean divides a sum of ``dtype`` by, as the cheaper scalar that gives the same bits.

    np.mean divides by the count as an intp, which makes numpy compute in float64 and round the
    quotient to float32 (about 2 us a call on a small array, for 1 us in float32). Rounding a
    float64 quotient to float32 gives the float32 quotient itself: float64 has more than twice
    float32's precision plus two bits, so the double rounding of a division is innocuous. So a
    float32 sum divided by the count as a float32 (exact below 2^24) has np.mean's bits; a float64
    one by the count as a float64 (exact below 2^53) is what numpy computes anyway."""
    exact_below = _EXACT_COUNTS.get(dtype)
    return dtype.type(count) if exact_below is not None and count < exact_below else np.intp(count)


def mean_over(x, axes, keepdims):
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        return np.full(np.sum(x, axis=axes, keepdims=keepdims).shape, np.nan)
    if x.dtype.kind in "iu":
        # Integer means truncate toward zero (the reference computes in float and casts back).
        return np.mean(x, axis=axes, keepdims=keepdims, dtype=np.float64)
    # np.mean's own steps (numpy/_core/_methods.py, _mean, with dtype given) without its Python layers
    # (a third of a small ReduceMean's time); the result is the same to the bit.
    total = np.add.reduce(x, axis=axes, dtype=x.dtype, keepdims=keepdims)
    if isinstance(total, np.ndarray):
        return np.true_divide(total, count_divisor(total.dtype, count), out=total, casting="unsafe")
    return total.dtype.type(total / np.intp(count))


def _prod(x, axes, keepdims):
    return np.prod(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _log_sum_exp(x, axes, keepdims):
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)
    with np.errstate(divide="ignore"):  # an empty or all -inf slice gives -inf
        out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axes)


def _square(x):
    return x * x


def _reduction(op_type: str, name: str, fn, pre=None, post=None):
    """Register a Reduce* op's kernel and its preparer."""
    cpu_prepare(op_type)(_reducer_preparer(fn, pre, post))
    return cpu_kernel(op_type)(_reducer(name, fn, pre, post))


reduce_sum = _reduction("ReduceSum", "reduce_sum", _sum)
reduce_mean = cpu_kernel("ReduceMean")(_reducer("reduce_mean", mean_over))


@cpu_prepare("ReduceMean")
def prepare_reduce_mean(constants: tuple, attrs: dict):
    """``mean_over``'s float arithmetic (a sum in the input's type, then a division by the count
    as an intp, in float64, rounded once) with the axes, the count and the output shape kept per
    input shape, and the sum kept as an array (the scalar of a full reduction costs a microsecond
    of numpy scalar arithmetic). Integer, empty and 0-d inputs run ``mean_over``."""
    planned = _planned_axes(constants, attrs)
    if planned is None:
        return None
    axes_for, keepdims = planned

    def geometry(shape: tuple) -> tuple:
        over = axes_for(shape)
        kept_shape = tuple(1 if a in over else d for a, d in enumerate(shape))
        out_shape = kept_shape if keepdims else tuple(d for a, d in enumerate(shape) if a not in over)
        return over, math.prod(shape[a] for a in over), out_shape

    plan = per_shape(geometry)

    def run(data, axes=None):
        over, count, out_shape = plan(data.shape)
        if data.dtype.kind != "f" or not count or not data.ndim:
            return np.asarray(mean_over(data, over, keepdims)).astype(data.dtype, copy=False)
        total = np.add.reduce(data, axis=over, dtype=data.dtype, keepdims=True)
        np.true_divide(total, count_divisor(total.dtype, count), out=total, casting="unsafe")
        return total.reshape(out_shape)

    return run


reduce_max = _reduction("ReduceMax", "reduce_max", _max)
reduce_min = _reduction("ReduceMin", "reduce_min", _min)
reduce_prod = _reduction("ReduceProd", "reduce_prod", _prod)
reduce_l1 = _reduction("ReduceL1", "reduce_l1", _sum, pre=np.abs)
reduce_l2 = _reduction("ReduceL2", "reduce_l2", _sum, pre=_square, post=np.sqrt)
reduce_sum_square = _reduction("ReduceSumSquare", "reduce_sum_square", _sum, pre=_square)
reduce_log_sum = _reduction("ReduceLogSum", "reduce_log_sum", _sum, post=np.log)
reduce_log_sum_exp = _reduction("ReduceLogSumExp", "reduce_log_sum_exp", _log_sum_exp)


def _arg(fn, data, axis, keepdims, select_last_index):
    axis = normalize_axis(axis, data.ndim)
    if data.shape[axis] == 0:
        raise KernelError(f"cannot take the arg-reduction of an empty axis {axis}")
    if select_last_index:
        flipped = np.flip(data, axis=axis)
        out = data.shape[axis] - 1 - fn(flipped, axis=axis)
    else:
        out = fn(data, axis=axis)
    out = out.astype(np.int64)
    return np.expand_dims(out, axis) if keepdims else out


@cpu_kernel("ArgMax")
def arg_max(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(np.argmax, data, axis, keepdims, select_last_index)


@cpu_kernel("ArgMin")
def arg_min(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(np.argmin, data, axis, keepdims, select_last_index)


def _cumulative(fn, identity, x, axis, exclusive, reverse):
    if np.size(axis) != 1:
        raise KernelError(f"axis must be a scalar, got shape {list(np.shape(axis))}")
    ax = normalize_axis(int(np.asarray(axis).reshape(-1)[0]), x.ndim)
    data = np.flip(x, axis=ax) if reverse else x
    out = fn(data, axis=ax, dtype=x.dtype)
    if exclusive and out.shape[ax]:
        first = np.full_like(np.take(out, [0], axis=ax), identity)
        out = np.concatenate([first, np.take(out, np.arange(out.shape[ax] - 1), axis=ax)], axis=ax)
    return np.flip(out, axis=ax) if reverse else out


@cpu_kernel("CumSum")
def cum_sum(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(np.cumsum, 0, x, axis, exclusive, reverse)


@cpu_kernel("CumProd")
def cum_prod(x, axis, *, exclusive=0, reverse=0):
    return _cumulative(np.cumprod, 1, x, axis, exclusive, reverse)


def _softmax_frame(x: np.ndarray, axis, opset: int):
    """(array to normalise over its last axis, function to restore x's layout)."""
    if opset >= 13:
        ax = normalize_axis(-1 if axis is None else axis, x.ndim)
        if ax == x.ndim - 1:  # already last: skip np.moveaxis' Python work (the arrays are the same)
            return x, _unchanged
        moved = np.moveaxis(x, ax, -1)
        return moved, lambda y: np.moveaxis(y, -1, ax)
    # opset < 13: coerce to 2-D [prod(shape[:axis]), prod(shape[axis:])].
    ax = normalize_axis(1 if axis is None else axis, x.ndim) if x.ndim else 0
    flat = x.reshape(math.prod(x.shape[:ax]), math.prod(x.shape[ax:]))
    return flat, lambda y: y.reshape(x.shape)


def _unchanged(y):
    return y


@cpu_kernel("Softmax")
def softmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    fast = onednn_rows.softmax(z)
    if fast is not None:
        return restore(fast)
    e = np.subtract(z, np.maximum.reduce(z, axis=-1, keepdims=True, initial=-np.inf))
    onednn_eltwise.exp(e, out=e)  # in place: one buffer instead of three (the bits of exp(e) out of place)
    np.divide(e, np.add.reduce(e, axis=-1, keepdims=True), out=e)
    return restore(e).astype(x.dtype, copy=False)


@cpu_kernel("LogSoftmax")
def log_softmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    shifted = np.subtract(z, np.maximum.reduce(z, axis=-1, keepdims=True, initial=-np.inf))
    if shifted.size == 0:  # an empty axis: nothing to normalise (and log(0) would warn)
        return restore(shifted).astype(x.dtype, copy=False)
    log_sum = np.log(np.add.reduce(onednn_eltwise.exp(shifted), axis=-1, keepdims=True))
    np.subtract(shifted, log_sum, out=shifted)
    return restore(shifted).astype(x.dtype, copy=False)


@cpu_kernel("Hardmax")
def hardmax(x, *, axis=None, _opset=13):
    z, restore = _softmax_frame(x, axis, _opset)
    out = np.zeros_like(z)
    if z.shape[-1]:
        np.put_along_axis(out, np.argmax(z, axis=-1)[..., None], 1, axis=-1)
    return restore(out)


def top_k_count(k, attrs: dict) -> int:
    """TopK's K: the input (since opset 10) or the attribute (opset 1), one value."""
    if k is None:
        k = attrs.get("k")  # opset 1: k is an attribute
        if k is None:
            raise KernelError("TopK needs K (an input since opset 10)")
    if np.size(k) != 1:
        raise KernelError(f"K must hold one value, got shape {list(np.shape(k))}")
    return int(np.asarray(k).reshape(-1)[0])


TOPK_PARTITION_AXIS = 64  # axis length from which a small K selects by partition, not a full sort


@cpu_kernel("TopK")
def top_k(x, k=None, *, axis=-1, largest=1, sorted=1, **attrs):
    """The K largest (or smallest) along ``axis``, in order, equal values by the lower index first
    (numpy's stable order; NaN above everything)."""
    k = top_k_count(k, attrs)
    ax = normalize_axis(axis, x.ndim)
    n = x.shape[ax]
    if not 0 <= k <= n:
        raise KernelError(f"K={k} is out of range for axis {ax} of size {n}")
    moved = np.moveaxis(x, ax, -1)
    partitioned = n >= TOPK_PARTITION_AXIS and 0 < 4 * k <= n and moved.size and x.dtype.kind in "fiu"
    if partitioned and not (x.dtype.kind == "f" and np.isnan(moved).any()):
        indices = _top_k_by_partition(moved, k, bool(largest))
    else:
        indices = _top_k_by_sort(moved, k, bool(largest))
    values = np.take_along_axis(moved, indices, axis=-1)
    return np.moveaxis(values, -1, ax), np.moveaxis(indices, -1, ax)


def _top_k_by_sort(rows: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """The first K positions of each row (last axis) in TopK's order: a stable sort of the whole row."""
    if largest:
        # descending, ties keep the lower index first: stable-sort the reversed row ascending, then
        # read it backwards
        order = np.argsort(np.flip(rows, axis=-1), axis=-1, kind="stable")
        order = rows.shape[-1] - 1 - np.flip(order, axis=-1)
    else:
        order = np.argsort(rows, axis=-1, kind="stable")
    return order[..., :k].astype(np.int64)


def _top_k_by_partition(rows: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """``_top_k_by_sort``'s positions, from a partition of each row (linear time) and a sort of the
    K selected only. A partition breaks ties at the K-th value arbitrarily, so a row holding more
    of that value than the selection takes is sorted whole instead. No NaN in ``rows``."""
    n = rows.shape[-1]
    chosen = np.argpartition(rows, n - k if largest else k - 1, axis=-1)
    chosen = chosen[..., n - k :] if largest else chosen[..., :k]
    chosen.sort(axis=-1)  # by position: the stable sort below keeps equal values in index order
    values = np.take_along_axis(rows, chosen, axis=-1)
    indices = np.take_along_axis(chosen, _top_k_by_sort(values, k, largest), axis=-1)
    boundary = values.min(axis=-1, keepdims=True) if largest else values.max(axis=-1, keepdims=True)
    ambiguous = np.count_nonzero(rows == boundary, axis=-1) > np.count_nonzero(values == boundary, axis=-1)
    if ambiguous.any():
        indices[ambiguous] = _top_k_by_sort(rows[ambiguous], k, largest)
    return indices


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's softmax gradients (com.microsoft)


def _softmax_axes(Y, axis: int, opset13: bool):
    """The reduction axes: the one axis (opset 13 semantics) or every axis from ``axis`` on."""
    axis = normalize_axis(axis, Y.ndim)
    return (axis,) if opset13 else tuple(range(axis, Y.ndim))


def _softmax_grad(dY, Y, axis, opset13):
    same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = accumulation_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    dot = (y * dy).sum(axis=axes, keepdims=True)
    return ((dy - dot) * y).astype(Y.dtype)


def _log_softmax_grad(dY, Y, axis, opset13):
    same_shape(dY, Y, "dY", "Y")
    axes = _softmax_axes(Y, axis, opset13)
    ct = accumulation_dtype(Y.dtype)
    y, dy = Y.astype(ct, copy=False), dY.astype(ct, copy=False)
    return (dy - np.exp(y) * dy.sum(axis=axes, keepdims=True)).astype(Y.dtype)


@cpu_kernel("SoftmaxGrad", domain=MICROSOFT)
def softmax_grad(dY, Y, *, axis=1):
    """Softmax (opset < 13) gradient: the input is coerced to 2-D at ``axis``."""
    return _softmax_grad(dY, Y, axis, opset13=False)


def _softmax_grad_13_schema(op_type: str, default_axis: int = -1) -> Schema:
    """ONNX Runtime training's contract (training_op_defs.cc) of SoftmaxGrad_13 / LogSoftmaxGrad_13:
    dY and the forward output Y, one axis (SoftmaxGrad / LogSoftmaxGrad: the same, axis 1 by
    default, the sums running over every axis from it)."""
    return schemas.declare(
        Schema(
            op_type,
            inputs=(Formal("dY", FLOATS), Formal("Y", FLOATS)),
            outputs=(Formal("dX", FLOATS),),
            attributes=(Attribute("axis", "int", default_axis),),
            infer=lambda i, a: [(i[0].dtype, i[0].shape)],
        )
    )


SOFTMAX_GRAD_13 = _softmax_grad_13_schema("SoftmaxGrad_13")
LOG_SOFTMAX_GRAD_13 = _softmax_grad_13_schema("LogSoftmaxGrad_13")
SOFTMAX_GRAD = _softmax_grad_13_schema("SoftmaxGrad", default_axis=1)
LOG_SOFTMAX_GRAD = _softmax_grad_13_schema("LogSoftmaxGrad", default_axis=1)


@cpu_kernel("SoftmaxGrad_13", domain=MICROSOFT)
def softmax_grad_13(dY, Y, *, axis=-1):
    """dX = Y * (dY - sum(dY * Y, axis)) along the single ``axis`` (Softmax-13)."""
    return _softmax_grad(dY, Y, axis, opset13=True)


@cpu_kernel("LogSoftmaxGrad", domain=MICROSOFT)
def log_softmax_grad(dY, Y, *, axis=1):
    return _log_softmax_grad(dY, Y, axis, opset13=False)


@cpu_kernel("LogSoftmaxGrad_13", domain=MICROSOFT)
def log_softmax_grad_13(dY, Y, *, axis=-1):
    """dX = dY - exp(Y) * sum(dY, axis), Y being LogSoftmax's output."""
    return _log_softmax_grad(dY, Y, axis, opset13=True)


# ---------------------------------------------------------------------------------------------
# TfIdfVectorizer

TFIDF_MODES = {"TF": 1, "IDF": 2, "TFIDF": 3}  # the codes reduction.cu's tfidf_weigh takes
# gradgen's required attributes: the spec's, and pool_int64s (pool_strings, its alternative, is refused)
_TFIDF_REQUIRED = ("mode", "min_gram_length", "max_gram_length", "max_skip_count", "ngram_counts", "ngram_indexes", "pool_int64s")


@dataclasses.dataclass(frozen=True, eq=False)
class NgramPool:
    """TfIdfVectorizer's attributes, checked, with the pool's n-grams of the counted lengths as a
    trie in sorted arrays (the tables of the CPU kernel and of the CUDA launcher). Node 0 is the
    root; the edge from node p by the value at position i of ``vocabulary`` has key
    p * len(vocabulary) + i in ``edge_keys`` and leads to ``edge_child``; ``node_output`` holds the
    output column of the n-gram spelled by the path to each node, -1 where none of the pool ends."""

    key: tuple  # the normalised attributes this pool was built from
    mode: int  # TFIDF_MODES' code
    min_gram_length: int
    max_gram_length: int
    max_skip_count: int
    output_size: int  # max(ngram_indexes) + 1
    weights: np.ndarray  # float32 [output_size], by output column; ones without the attribute (and for TF)
    vocabulary: np.ndarray  # int64, sorted, distinct: the values of the loaded n-grams
    edge_keys: np.ndarray  # int64, sorted
    edge_child: np.ndarray  # int64
    node_output: np.ndarray  # int64

    def shortest(self, skip_distance: int) -> int:
        """The shortest n-gram counted at a skip distance: unigrams count at distance 1 only (a
        unigram does not depend on the distance, and the reference counts it once)."""
        return self.min_gram_length if skip_distance == 1 else max(self.min_gram_length, 2)

    def skip_distances(self) -> range:
        """The distances between consecutive items of a counted n-gram (1: adjacent)."""
        return range(1, 2 if self.max_gram_length == 1 else self.max_skip_count + 2)

    def children(self, node: np.ndarray, value_ids: np.ndarray) -> np.ndarray:
        """The node the edge (node, value) leads to, elementwise; -1 where there is none (or where
        node or the value's vocabulary position is -1). Needs at least one edge."""
        keys = node * self.vocabulary.size + value_ids
        at = np.minimum(np.searchsorted(self.edge_keys, keys), self.edge_keys.size - 1)
        found = (node >= 0) & (value_ids >= 0) & (self.edge_keys[at] == keys)
        return np.where(found, self.edge_child[at], -1)


def ngram_pool(attrs: dict) -> NgramPool:
    """The ``NgramPool`` of TfIdfVectorizer's attributes (built once per attribute set)."""
    if attrs.get("pool_strings"):
        raise KernelError("TfIdfVectorizer: pool_strings is not supported (gradgen has no string tensors); use pool_int64s")
    missing = [name for name in _TFIDF_REQUIRED if attrs.get(name) is None]
    if missing:
        raise KernelError(f"TfIdfVectorizer needs the attribute(s) {', '.join(missing)}")
    weights = attrs.get("weights")
    key = (
        text(attrs["mode"], ""),
        *(int(attrs[name]) for name in ("min_gram_length", "max_gram_length", "max_skip_count")),
        *(tuple(int(v) for v in attrs[name]) for name in ("ngram_counts", "ngram_indexes", "pool_int64s")),
        None if weights is None else tuple(float(w) for w in weights),
    )
    return _build_ngram_pool(key)


@functools.lru_cache(maxsize=64)
def _build_ngram_pool(key: tuple) -> NgramPool:
    mode, shortest, longest, max_skip, counts, indexes, pool, weights = key
    if mode not in TFIDF_MODES:
        raise KernelError(f"TfIdfVectorizer: mode must be TF, IDF or TFIDF, got {mode!r}")
    if not 1 <= shortest <= longest or max_skip < 0:
        raise KernelError(
            f"TfIdfVectorizer needs 1 <= min_gram_length <= max_gram_length and max_skip_count >= 0, "
            f"got {shortest}, {longest}, {max_skip}"
        )
    if not indexes or min(indexes) < 0:
        raise KernelError(f"TfIdfVectorizer: ngram_indexes must be non-empty and non-negative, got {list(indexes)}")
    output_size = max(indexes) + 1
    if mode == "TF" or not weights:  # TF reads no weights
        weights = (1.0,) * output_size
    elif len(weights) < output_size:
        raise KernelError(f"TfIdfVectorizer: {len(weights)} weights for {output_size} output columns")
    grams = _pool_ngrams(counts, pool, shortest, longest)
    if grams and grams[-1][0] >= len(indexes):
        raise KernelError(f"TfIdfVectorizer: the pool holds {grams[-1][0] + 1} n-grams, ngram_indexes {len(indexes)}")
    vocabulary, edge_keys, edge_child, node_output = _trie(grams, indexes)
    return NgramPool(
        key,
        TFIDF_MODES[mode],
        shortest,
        longest,
        max_skip,
        output_size,
        np.asarray(weights[:output_size], np.float32),
        vocabulary,
        edge_keys,
        edge_child,
        node_output,
    )


def _pool_ngrams(counts: tuple, pool: tuple, shortest: int, longest: int) -> list[tuple[int, tuple]]:
    """(position among all the pool's n-grams, n-gram) of each n-gram of a length in [shortest,
    longest]: ngram_counts[n - 1] is where the n-grams of length n start in the pool (the next
    length's start, or the pool's end, is where they stop; a partial last n-gram is dropped)."""
    bounds = [*counts, len(pool)]
    if any(not 0 <= a <= b <= len(pool) for a, b in zip(bounds, bounds[1:])):
        raise KernelError(f"TfIdfVectorizer: ngram_counts {list(counts)} must rise within the pool of {len(pool)} values")
    grams, position = [], 0
    for length, (begin, end) in enumerate(zip(bounds, bounds[1:]), 1):
        number = (end - begin) // length
        if shortest <= length <= longest:
            grams += [(position + k, pool[begin + k * length : begin + (k + 1) * length]) for k in range(number)]
        position += number
    return grams


def _trie(grams: list[tuple[int, tuple]], indexes: tuple):
    """``NgramPool``'s (vocabulary, edge_keys, edge_child, node_output) of the n-grams; an n-gram
    listed twice keeps its last position's column, as the reference's trie does."""
    nodes: dict[tuple, int] = {(): 0}
    edges: list[tuple[int, int, int]] = []  # (parent, value, child)
    node_output = [-1]
    for position, gram in grams:
        node = 0
        for length in range(1, len(gram) + 1):
            child = nodes.get(gram[:length])
            if child is None:
                child = nodes[gram[:length]] = len(node_output)
                node_output.append(-1)
                edges.append((node, gram[length - 1], child))
            node = child
        node_output[node] = indexes[position]
    parent, value, child = np.array(edges, np.int64).reshape(-1, 3).T
    vocabulary = np.unique(value)
    keys = parent * vocabulary.size + np.searchsorted(vocabulary, value)
    order = np.argsort(keys)
    return vocabulary, keys[order], child[order], np.array(node_output, np.int64)


def tf_idf_rows(shape: tuple, dtype) -> tuple[int, int]:
    """(rows, row length) of TfIdfVectorizer's input: [C] is one row, [N, C] N > 0 rows."""
    if np.dtype(dtype) not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise KernelError(f"TfIdfVectorizer counts int32 or int64 ids, got {np.dtype(dtype)}")
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] == 0):
        raise KernelError(f"TfIdfVectorizer's input must be [C] or [N, C] with N > 0, got shape {list(shape)}")
    return (1, int(shape[0])) if len(shape) == 1 else (int(shape[0]), int(shape[1]))


def _count_ngrams(pool: NgramPool, rows: np.ndarray) -> np.ndarray:
    """int64 [N, output_size]: how often each pool n-gram occurs in each row of ``rows`` [N, C],
    at every skip distance. Walks the trie from every start position at once, one item a step."""
    n, length = rows.shape
    counts = np.zeros(n * pool.output_size, np.int64)
    if rows.size == 0 or pool.edge_keys.size == 0:
        return counts.reshape(n, pool.output_size)
    at = np.minimum(np.searchsorted(pool.vocabulary, rows), pool.vocabulary.size - 1)
    value_ids = np.where(pool.vocabulary[at] == rows, at, -1)
    row_base = np.arange(n, dtype=np.int64)[:, None] * pool.output_size
    for distance in pool.skip_distances():
        node = np.zeros((n, length), np.int64)  # the root, for every start
        for items in range(1, pool.max_gram_length + 1):
            offset = (items - 1) * distance
            if offset >= length:
                break
            node = pool.children(node[:, : length - offset], value_ids[:, offset:])
            if items >= pool.shortest(distance):
                column = np.where(node >= 0, pool.node_output[node], -1)
                counts += np.bincount((row_base + column)[column >= 0], minlength=counts.size)
            if not (node >= 0).any():
                break
    return counts.reshape(n, pool.output_size)


def weigh_ngram_counts(pool: NgramPool, counts: np.ndarray) -> np.ndarray:
    """float32 TfIdfVectorizer output of the counts: TF the counts, IDF the column's weight where
    the count is positive (else 0), TFIDF count * weight (computed in float64, as the reference)."""
    if pool.mode == TFIDF_MODES["TF"]:
        return counts.astype(np.float32)
    weights = pool.weights.astype(np.float64)
    if pool.mode == TFIDF_MODES["IDF"]:
        return np.where(counts > 0, weights, 0.0).astype(np.float32)
    return (weights * counts).astype(np.float32)


def _vectorize(pool: NgramPool, X) -> np.ndarray:
    rows, length = tf_idf_rows(X.shape, X.dtype)
    counts = _count_ngrams(pool, np.asarray(X, np.int64).reshape(rows, length))
    y = weigh_ngram_counts(pool, counts)
    return y.reshape(pool.output_size) if X.ndim == 1 else y


@cpu_kernel("TfIdfVectorizer")
def tf_idf_vectorizer(X, **attrs):
    """Counts of the pool's n-grams (pool_int64s) in each row of X, weighted by ``mode``.

    The n-grams of lengths min_gram_length .. max_gram_length are counted at every skip distance
    1 .. max_skip_count + 1 (items taken that far apart), unigrams once; column ngram_indexes[i]
    holds the i-th n-gram of the pool. X [C] gives [max(ngram_indexes) + 1], X [N, C] gives
    [N, max(ngram_indexes) + 1]."""
    return _vectorize(ngram_pool(attrs), X)


@cpu_prepare("TfIdfVectorizer")
def _prepare_tf_idf_vectorizer(constants: tuple, attrs: dict):
    """The kernel with its n-gram pool built once."""
    pool = ngram_pool(attrs)
    return functools.partial(_vectorize, pool)
