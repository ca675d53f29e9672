"""The CUDA executor's head-copy fusion (gradgen/executor/fused_copies.py): the view rule and the
plan rewrite, on the CPU; its launchers run in tests/cuda/test_cuda_shape.py."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from gradgen.executor import Session
from gradgen.executor.fused_copies import CONCAT, SPLIT, fuse_head_copies, reshaped_strides
from tests.fused_copy_models import attention_heads


def _numpy_view(a: np.ndarray, new_shape):
    """numpy's own no-copy reshape, or None."""
    b = a.view()
    try:
        b.shape = new_shape
    except AttributeError:
        return None
    return b


@pytest.mark.parametrize("seed", range(300))
def test_reshaped_strides_agrees_with_numpy_views(seed):
    rng = np.random.default_rng(seed)
    base = rng.integers(1, 5, rng.integers(1, 5)).tolist()
    full = np.arange(int(np.prod(base)) * 4, dtype=np.float32).reshape([*base[:-1], base[-1] * 4])
    # a strided source: a slice along a random axis, sometimes transposed
    ax = int(rng.integers(0, full.ndim))
    stop = max(1, full.shape[ax] // int(rng.integers(1, 3)))
    src = full[(slice(None),) * ax + (slice(0, stop),)]
    if rng.random() < 0.3 and src.ndim > 1:
        src = np.swapaxes(src, 0, src.ndim - 1)
    dims = list(src.shape)
    # a random factorisation of the same size into a new shape
    factors = [f for d in dims for f in _factors(d, rng)]
    rng.shuffle(factors) if rng.random() < 0.2 else None
    new_shape = factors or [1]
    want = _numpy_view(src, new_shape)
    got = reshaped_strides(src.shape, [s // 4 for s in src.strides], new_shape)
    if want is None:
        assert got is None
        return
    assert got is not None
    view = as_strided(src, shape=new_shape, strides=[g * 4 for g in got])
    np.testing.assert_array_equal(view, want)


def _factors(d: int, rng) -> list[int]:
    out = []
    for p in (2, 3):
        while d % p == 0 and rng.random() < 0.7:
            out.append(p)
            d //= p
    return [*out, d] if d > 1 or not out else out


def test_reshaped_strides_refuses_a_merge_across_a_gap():
    # a (4, 6) slice of columns 0:6 of a (4, 12) array: its rows are not contiguous with each other
    assert reshaped_strides((4, 6), (12, 1), (24,)) is None
    assert reshaped_strides((4, 6), (12, 1), (4, 2, 3)) == [12, 3, 1]
    assert reshaped_strides((0, 3), (3, 1), (3, 0)) is None


def _plan(**kwargs):
    model, _ = attention_heads(**kwargs)
    with Session(model, device="cpu") as sess:
        return list(sess.steps), set(sess.output_names)


def test_heads_split_and_concat_become_one_step_each():
    steps, keep = _plan()
    fused = fuse_head_copies(steps, keep)
    ops = [s.op_type for s in fused]
    assert ops.count(SPLIT) == 1 and ops.count(CONCAT) == 1
    assert "Split" not in ops and "Concat" not in ops
    removed = len(steps) - len(fused)
    assert removed == 2 * 3 * 2  # three Reshapes and three Transposes folded into each of the two
    split = next(s for s in fused if s.op_type == SPLIT)
    transposes_after = {s.outputs[0] for s in steps if s.op_type == "Transpose"} - {n for s in fused for n in s.outputs}
    assert set(split.outputs) <= {s.outputs[0] for s in steps if s.op_type == "Transpose"}
    assert not transposes_after & set(split.outputs)
    produced: set[str] = set()
    made = {n for s in fused for n in s.outputs}
    for step in fused:  # every value read is made before
        assert all(n in produced for n in step.inputs if n and n in made), step.node_name
        produced.update(step.outputs)


def test_a_kept_or_shared_intermediate_leaves_the_chain_alone():
    steps, keep = _plan()
    split = next(s for s in steps if s.op_type == "Split")
    concat = next(s for s in steps if s.op_type == "Concat")
    fused = fuse_head_copies(steps, keep | {split.outputs[1], concat.inputs[0]})
    ops = [s.op_type for s in fused]
    assert SPLIT not in ops and CONCAT not in ops


class _HostRuntime:
    """numpy stand-ins for the device runtime the launchers use (empty arrays, strides)."""

    @staticmethod
    def empty(shape, dtype):
        return np.full(tuple(int(d) for d in shape), np.nan, dtype)

    @staticmethod
    def contiguous_strides(shape):
        strides, step = [], 1
        for d in reversed([int(d) for d in shape]):
            strides.append(step)
            step *= d
        return strides[::-1]


def _host_strided_copy(dst, dst_strides, dst_off, src, src_strides, src_off, shape):
    flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
    for index in np.ndindex(*[int(d) for d in shape]):
        flat_dst[dst_off + int(np.dot(index, dst_strides))] = flat_src[src_off + int(np.dot(index, src_strides))]


@pytest.fixture
def host_launch(monkeypatch):
    """The launchers' device helpers replaced by numpy ones, so their index arithmetic runs here."""
    from gradgen.kernels.cuda import launch

    monkeypatch.setattr(launch, "runtime", lambda: _HostRuntime)
    monkeypatch.setattr(launch, "contiguous", np.ascontiguousarray)
    monkeypatch.setattr(launch, "element_strides", lambda a: [s // a.itemsize for s in a.strides])
    monkeypatch.setattr(launch, "strided_copy", _host_strided_copy)
    monkeypatch.setattr(
        launch,
        "copy_into",
        lambda dst, src, shape, strides, off=0: _host_strided_copy(
            dst, _HostRuntime.contiguous_strides(shape), 0, src, strides, off, shape
        ),
    )


@pytest.mark.parametrize(
    "shape,axis,sizes,target,perm",
    [
        ((2, 5, 36), 2, [12, 12, 12], [2, 5, 3, 4], [0, 2, 1, 3]),
        ((2, 5, 36), -1, [8, 16, 12], [2, 5, -1, 4], [0, 2, 3, 1]),
        ((6, 10), 0, [2, 4], [0, 5, 2], None),  # a slice along the first axis, a 0 in the target, perm reversed
        ((3, 4, 6), 1, [1, 3], [-1, 6], [1, 0]),  # merging the rows across the slice's gap: the slice is copied first
    ],
    ids=str,
)
def test_split_reshape_transpose_matches_the_three_ops(shape, axis, sizes, target, perm, host_launch):
    from gradgen.executor.fused_copies import split_reshape_transpose

    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    parts = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    targets = [np.array([d if d != -1 else -1 for d in target], np.int64)] * len(sizes)
    got = split_reshape_transpose(
        x, np.array(sizes, np.int64), targets, [{}] * len(sizes), [perm] * len(sizes), count=len(sizes), axis=axis
    )
    for g, part in zip(got, parts):
        dims = [part.shape[k] if d == 0 else d for k, d in enumerate(target)]
        want = np.transpose(part.reshape(dims), perm)
        np.testing.assert_array_equal(g, want)


@pytest.mark.parametrize(
    "y_shape,perm,target,axis",
    [
        ((2, 3, 5, 4), [0, 2, 1, 3], [2, 5, 12], 2),
        ((2, 3, 4, 5), [0, 3, 1, 2], [2, 5, 12], -1),
        ((4, 6), [1, 0], [6, 4], 0),
        ((2, 3, 4), [2, 1, 0], [4, 6], 1),  # the transposed tensor is no view of its place: two copies
    ],
    ids=str,
)
def test_transpose_reshape_concat_matches_the_three_ops(y_shape, perm, target, axis, host_launch):
    from gradgen.executor.fused_copies import transpose_reshape_concat

    rng = np.random.default_rng(1)
    ys = [rng.standard_normal(y_shape).astype(np.float32) for _ in range(3)]
    got = transpose_reshape_concat(ys, [perm] * 3, [np.array(target, np.int64)] * 3, [{}] * 3, axis)
    want = np.concatenate([np.transpose(y, perm).reshape(target) for y in ys], axis=axis)
    np.testing.assert_array_equal(got, want)
