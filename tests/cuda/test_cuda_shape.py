"""CUDA data-movement (shape family) launchers against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels import registry
from gradgen.kernels.registry import MICROSOFT
from tests.cuda.test_cuda_elementwise import FLOATS, one_node, same_on_both

pytestmark = pytest.mark.cuda

RNG = np.random.default_rng(7)


def poison(rt, nbytes: int, copies: int = 4) -> None:
    """Return NaN-filled blocks of about ``nbytes`` to the pool, so unwritten outputs show up."""
    if nbytes <= 0:
        return
    blocks = [rt.to_device(np.full(max(1, nbytes // 4), np.nan, np.float32)) for _ in range(copies)]
    del blocks


def upload(rt, a):
    a = np.asarray(a)
    d = rt.to_device(a)
    return d.reshape(a.shape) if d.shape != a.shape else d  # keep 0-d tensors 0-d


def run(rt, op, inputs, domain="", **attrs):
    """(CUDA results, CPU results) of ``op`` on ``inputs``, each a tuple of numpy arrays."""
    entry = registry.lookup(domain, op)
    assert entry is not None and entry.cuda is not None, op
    want = entry.cpu(*inputs, **attrs)
    want = want if isinstance(want, tuple) else (want,)
    for w in want:
        poison(rt, np.asarray(w).nbytes)
    args = [None if a is None else (a if i in entry.cuda_host_inputs else upload(rt, a)) for i, a in enumerate(inputs)]
    got = entry.cuda(*args, **attrs)
    got = got if isinstance(got, tuple) else (got,)
    return tuple(rt.to_host(g) for g in got), tuple(np.asarray(w) for w in want)


def check(rt, op, inputs, domain="", **attrs):
    got, want = run(rt, op, inputs, domain, **attrs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape, (op, g.shape, w.shape)
        assert g.dtype == w.dtype, (op, g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w)
    return got


def rand(shape, dtype=np.float32):
    if np.dtype(dtype).kind == "f":
        return RNG.standard_normal(shape).astype(dtype)
    return RNG.integers(-100, 100, size=shape).astype(dtype)


def entry(op):
    e = registry.lookup(MICROSOFT, op)
    assert e is not None and e.cuda is not None, op
    return e


def on_device(rt, e, inputs):
    return [None if a is None else (a if i in e.cuda_host_inputs else upload(rt, a)) for i, a in enumerate(inputs)]


def compare(rt, op, inputs, tol=0.0, cuda_attrs=None, **attrs):
    e = entry(op)
    want = np.asarray(e.cpu(*inputs, **attrs))
    poison(rt, want.nbytes)
    got = e.cuda(*on_device(rt, e, inputs), **attrs, **(cuda_attrs or {})).get()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not np.isnan(got).any()
    if tol:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(got, want)
    return got


DTYPES = [np.float16, np.float32, np.float64, np.int64, np.int32, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,perm",
    [
        ((2, 3, 4), (2, 0, 1)),
        ((2, 3, 4), None),
        ((1, 5, 1, 7), (3, 1, 0, 2)),
        ((0, 3), (1, 0)),
        ((64, 33), (1, 0)),
        ((4, 8, 16), (0, 2, 1)),
        ((5,), (0,)),
    ],
)
def test_transpose(rt, dtype, shape, perm):
    x = rand(shape, dtype)
    check(rt, "Transpose", [x], **({} if perm is None else {"perm": list(perm)}))


SLICES = [
    ((5, 6), [1, 0], [4, 6], None, None),
    ((5, 6), [-1], [-6], [0], [-1]),
    ((5, 6), [10, -100], [-100, 100], [0, 1], [-2, 3]),
    ((5, 6), [0], [100], [-1], [2]),
    ((5, 6, 7), [4, 2], [1, 5], [2, 0], [-1, 1]),
    ((4, 3), [3], [3], [0], [1]),
    ((0, 3), [0], [5], [0], [-1]),
    ((8, 16), [0, 4], [8, 16], [0, 1], [1, 1]),
    ((3, 1, 40), [0, 8], [1, 40], [1, 2], [1, 1]),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
@pytest.mark.parametrize("case", SLICES)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_slice(rt, dtype, case, itype):
    shape, starts, ends, axes, steps = case
    args = [
        rand(shape, dtype),
        np.array(starts, itype),
        np.array(ends, itype),
        None if axes is None else np.array(axes, itype),
        None if steps is None else np.array(steps, itype),
    ]
    while args[-1] is None and len(args) > 3:
        args.pop()
    check(rt, "Slice", args)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
@pytest.mark.parametrize(
    "shape,target", [((3, 1), (2, 3, 5)), ((1,), (4,)), ((2, 1, 4), (2, 3, 4)), ((4,), (0, 4)), ((1, 1), (1, 1))]
)
def test_expand(rt, dtype, shape, target):
    check(rt, "Expand", [rand(shape, dtype), np.array(target, np.int64)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize(
    "shape,reps",
    [
        ((2, 3), (2, 3)),
        ((3,), (4,)),
        ((2, 1, 3), (1, 5, 2)),
        ((2, 3), (0, 2)),
        ((2, 2, 2, 2, 2), (2, 2, 2, 2, 2)),
        ((4, 8), (1, 1)),
    ],
)
def test_tile(rt, dtype, shape, reps):
    check(rt, "Tile", [rand(shape, dtype), np.array(reps, np.int64)])


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_concat(rt, axis, dtype):
    base = [2, 3, 4]
    parts = []
    for n in (1, 0, 3, 2):
        s = list(base)
        s[axis] = n
        parts.append(rand(s, dtype))
    check(rt, "Concat", parts, axis=axis)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split(rt, dtype):
    x = rand((6, 7), dtype)
    check(rt, "Split", [x, np.array([2, 0, 4], np.int64)], axis=0, _num_outputs=3)
    check(rt, "Split", [x], axis=-1, num_outputs=3, _num_outputs=3)
    check(rt, "Split", [x[:, :6].copy()], axis=1, _num_outputs=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
def test_pad(rt, dtype):
    x = rand((3, 4, 5), dtype)
    check(rt, "Pad", [x, np.array([1, 0, 2, 0, 3, 1], np.int64)])
    check(rt, "Pad", [x, np.array([-1, 2, 1, -2], np.int64), None, np.array([0, -1], np.int64)])
    check(rt, "Pad", [x, np.array([0, 0, 0, 0, 0, 0], np.int64)])
    check(rt, "Pad", [x, np.array([2, -3, 0, 1, -1, 4], np.int64)])  # axis 1 cropped to nothing
    check(rt, "Pad", [x[:, :0], np.array([0, 1, 0, 0, -1, 0], np.int64)])  # pad then crop: still empty
    with pytest.raises(KernelError, match="negative size"):  # 4 - 3 - 3 < 0 (onnxruntime refuses it too)
        registry.lookup("", "Pad").cuda(rt.to_device(x), np.array([2, -3, 0, 1, -3, 4], np.int64))
    # The value as a device scalar (a float input lives on the device).
    entry = registry.lookup("", "Pad")
    value = np.array(2.5 if np.dtype(dtype).kind == "f" else 7, dtype)
    want = entry.cpu(x, np.array([1, 1], np.int64), value, np.array([1], np.int64))
    got = entry.cuda(rt.to_device(x), np.array([1, 1], np.int64), rt.to_device(value), np.array([1], np.int64))
    np.testing.assert_array_equal(got.get(), want)


def test_pad_other_modes_fall_back(rt):
    x = rand((3, 4))
    check(rt, "Pad", [x, np.array([1, 2, 1, 2], np.int64)], mode="reflect")


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 2, -1])
def test_trilu(rt, upper, k):
    x = rand((2, 5, 6))
    check(rt, "Trilu", [x] + ([] if k is None else [np.array(k, np.int64)]), upper=upper)


def test_constant_of_shape_shape_size(rt):
    check(rt, "ConstantOfShape", [np.array([3, 4], np.int64)])
    check(rt, "ConstantOfShape", [np.array([3, 0], np.int64)], value=np.array([2], np.int64))
    check(rt, "ConstantOfShape", [np.array([5], np.int64)], value=np.array([1.5], np.float16))
    x = rand((2, 3, 4))
    for attrs in ({}, {"start": 1}, {"end": -1}, {"start": -2, "end": 10}):
        got = registry.lookup("", "Shape").cuda(rt.to_device(x), **attrs)
        assert isinstance(got, np.ndarray)
        np.testing.assert_array_equal(got, registry.lookup("", "Shape").cpu(x, **attrs))
    check(rt, "Size", [x])


def test_views_share_memory_and_keep_base_alive(rt):
    x = rand((4, 6))
    dx = rt.to_device(x)
    entry = registry.lookup("", "Reshape")
    view = entry.cuda(dx, np.array([3, -1], np.int64))
    assert int(view.gpudata) == int(dx.gpudata)
    assert view.base is dx
    del dx  # the executor dropping the input's name
    for _ in range(8):  # reuse freed pool memory, if any was freed
        rt.to_device(np.full((4, 6), np.nan, np.float32))
    np.testing.assert_array_equal(view.get(), x.reshape(3, 8))


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_reshape_family(rt, dtype):
    x = rand((2, 1, 3, 4), dtype)
    check(rt, "Reshape", [x, np.array([0, -1], np.int64)])
    check(rt, "Flatten", [x], axis=2)
    check(rt, "Flatten", [x], axis=0)
    check(rt, "Squeeze", [x])
    check(rt, "Squeeze", [x, np.array([1], np.int64)])
    check(rt, "Unsqueeze", [x, np.array([0, -1], np.int64)])
    check(rt, "Reshape", [np.zeros((0, 3), dtype), np.array([3, 0], np.int64)], allowzero=1)
    with pytest.raises(KernelError):
        registry.lookup("", "Squeeze").cuda(rt.to_device(x), np.array([0], np.int64))


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(mode):
    x = RNG.standard_normal((2, 8, 3, 5)).astype(np.float32)
    same_on_both(one_node("DepthToSpace", {"x": x}, {}, {"blocksize": 2, "mode": mode}), {"x": x})
    y = RNG.standard_normal((2, 3, 4, 6)).astype(np.float32)
    same_on_both(one_node("SpaceToDepth", {"x": y}, {}, {"blocksize": 2}), {"x": y})


# ---------------------------------------------------------------- SliceGrad

SLICE_GRAD_CASES = [
    ((5, 6), [1, 0], [4, 6], None, None),
    ((5, 6), [-1], [-6], [0], [-1]),
    ((5, 6), [10, -100], [-100, 100], [0, 1], [-2, 3]),
    ((5, 8), [0], [100], [-1], [2]),
    ((5, 6, 7), [4, 2], [1, 5], [2, 0], [-1, 1]),
    ((4, 3), [3], [3], [0], [1]),
    ((0, 3), [0], [5], [0], [-1]),
    ((8, 16), [0, 4], [8, 16], [0, 1], [1, 1]),
    ((4, 64, 32), [16, 0], [48, 32], [1, 2], [1, 2]),
    ((3, 1, 40), [0, 8], [1, 40], [1, 2], [1, 3]),
    ((7,), [6], [-100], [0], [-3]),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", SLICE_GRAD_CASES)
@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_slice_grad(rt, dtype, case, itype):
    shape, starts, ends, axes, steps = case
    fwd = registry.lookup("", "Slice").cpu
    sl = [
        np.array(starts, itype),
        np.array(ends, itype),
        None if axes is None else np.array(axes, itype),
        None if steps is None else np.array(steps, itype),
    ]
    while sl[-1] is None:
        sl.pop()
    dy = RNG.standard_normal(fwd(np.zeros(shape, dtype), *sl).shape).astype(dtype)
    compare(rt, "SliceGrad", [dy, np.array(shape, np.int64)] + sl)


def test_slice_grad_shape_mismatch(rt):
    with pytest.raises(KernelError):
        entry("SliceGrad").cuda(rt.to_device(np.zeros((3,), np.float32)), np.array([5], np.int64), np.array([0]), np.array([2]))


@pytest.mark.parametrize("heads,size", [(3, 4), (12, 64)], ids=str)
def test_head_split_and_concat_folded_into_their_transposes_give_the_same_bits(heads, size, monkeypatch):
    """An attention head split and its gradient's concat with the executor's fusions off and on
    (eager, recorded, replayed): the fused plan has no Split / Concat step and the same bits."""
    from gradgen.executor.fused_copies import CONCAT, SPLIT
    from tests.cuda.test_cuda_fusion import assert_same_bits, runs_off_and_on
    from tests.fused_copy_models import attention_heads

    model, feeds = attention_heads(batch=2, seq=16, heads=heads, size=size)
    (off, off_ops), (on, on_ops) = runs_off_and_on(model, feeds, monkeypatch)
    assert "Split" in off_ops and SPLIT in on_ops and CONCAT in on_ops and "Concat" not in on_ops
    assert_same_bits(on, off)
