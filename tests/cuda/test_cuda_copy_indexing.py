"""CUDA data-movement and indexing launchers against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels import registry

pytestmark = pytest.mark.cuda

RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def rt():
    from gradgen.cuda import runtime

    registry.load_cuda_kernels()
    return runtime


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


DTYPES = [np.float16, np.float32, np.float64, np.int64, np.int32, np.bool_]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,perm", [((2, 3, 4), (2, 0, 1)), ((2, 3, 4), None), ((1, 5, 1, 7), (3, 1, 0, 2)),
                                        ((0, 3), (1, 0)), ((64, 33), (1, 0)), ((4, 8, 16), (0, 2, 1)),
                                        ((5,), (0,))])
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
    args = [rand(shape, dtype), np.array(starts, itype), np.array(ends, itype),
            None if axes is None else np.array(axes, itype), None if steps is None else np.array(steps, itype)]
    while args[-1] is None and len(args) > 3:
        args.pop()
    check(rt, "Slice", args)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
@pytest.mark.parametrize("shape,target", [((3, 1), (2, 3, 5)), ((1,), (4,)), ((2, 1, 4), (2, 3, 4)), ((4,), (0, 4)),
                                          ((1, 1), (1, 1))])
def test_expand(rt, dtype, shape, target):
    check(rt, "Expand", [rand(shape, dtype), np.array(target, np.int64)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("shape,reps", [((2, 3), (2, 3)), ((3,), (4,)), ((2, 1, 3), (1, 5, 2)), ((2, 3), (0, 2)),
                                        ((2, 2, 2, 2, 2), (2, 2, 2, 2, 2)), ((4, 8), (1, 1))])
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


# ---------------------------------------------------------------- indexing


@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64])
@pytest.mark.parametrize("shape,axis,ishape", [((5, 4), 0, (7,)), ((5, 4), 1, (2, 3)), ((3, 6, 8), -2, ()),
                                               ((3, 6, 8), 1, (0,)), ((10, 12), 0, (4,)), ((7,), 0, (3, 2))])
def test_gather(rt, itype, dtype, shape, axis, ishape):
    size = shape[axis]
    idx = RNG.integers(-size, size, size=ishape).astype(itype)
    check(rt, "Gather", [rand(shape, dtype), idx], axis=axis)


def test_gather_out_of_range_matches_cpu_message(rt):
    x = rand((5, 3))
    idx = np.array([0, 4, -6, 5], np.int64)
    entry = registry.lookup("", "Gather")
    with pytest.raises(KernelError) as cpu_error:
        entry.cpu(x, idx)
    with pytest.raises(KernelError) as gpu_error:
        entry.cuda(rt.to_device(x), rt.to_device(idx))
    assert str(gpu_error.value) == str(cpu_error.value)


@pytest.mark.parametrize("itype", [np.int64, np.int32])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(rt, itype, axis):
    x = rand((4, 5, 6))
    ishape = [3, 4, 6]
    ishape[axis] = 9
    idx = RNG.integers(-x.shape[axis], x.shape[axis], size=ishape).astype(itype)
    check(rt, "GatherElements", [x, idx], axis=axis)


@pytest.mark.parametrize("itype", [np.int64, np.int32])
def test_gather_nd(rt, itype):
    x = rand((4, 5, 6))
    idx = np.stack([RNG.integers(-4, 4, 7), RNG.integers(-5, 5, 7)], axis=-1).astype(itype)
    check(rt, "GatherND", [x, idx])
    check(rt, "GatherND", [x, idx[:, :1].reshape(7, 1)])
    bidx = RNG.integers(-5, 5, size=(4, 3, 1)).astype(itype)
    check(rt, "GatherND", [x, bidx], batch_dims=1)
    with pytest.raises(KernelError):
        registry.lookup("", "GatherND").cuda(rt.to_device(x), rt.to_device(np.array([[4, 0]], itype)))


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_scatter_elements(rt, reduction, axis, dtype):
    data = rand((6, 5), dtype)
    ishape = [4, 5] if axis == 0 else [6, 9]
    idx = RNG.integers(-data.shape[axis], data.shape[axis], size=ishape).astype(np.int64)
    upd = rand(ishape, dtype)
    got, want = run(rt, "ScatterElements", [data, idx, upd], axis=axis, reduction=reduction)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)


@pytest.mark.parametrize("reduction", ["none", "add", "mul"])
@pytest.mark.parametrize("k", [1, 2, 0])
def test_scatter_nd(rt, reduction, k):
    data = rand((5, 4, 3))
    count = 12
    idx = np.stack([RNG.integers(-d, d, count) for d in data.shape[:k]], axis=-1).astype(np.int64) if k else \
        np.zeros((count, 0), np.int64)
    upd = rand((count,) + data.shape[k:])
    got, want = run(rt, "ScatterND", [data, idx, upd], reduction=reduction)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)


def test_scatter_nd_many_repeats_deterministic(rt):
    data = rand((3, 8))
    idx = RNG.integers(0, 3, size=(5000, 1)).astype(np.int64)
    upd = rand((5000, 8))
    entry = registry.lookup("", "ScatterND")
    first = entry.cuda(rt.to_device(data), rt.to_device(idx), rt.to_device(upd), reduction="add").get()
    second = entry.cuda(rt.to_device(data), rt.to_device(idx), rt.to_device(upd), reduction="add").get()
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, entry.cpu(data, idx, upd, reduction="add"), rtol=1e-4, atol=1e-4)
