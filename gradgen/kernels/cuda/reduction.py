"""CUDA launchers: reductions (reduction.cu), Softmax/LogSoftmax and TfIdfVectorizer's n-gram counts.

A reduction is planned once per call on the host: size-1 dims are dropped and adjacent dims that
are all reduced or all kept are merged. If the innermost group is reduced, each output reduces
contiguous runs (``rows``: one block per output, 16-byte loads where aligned); if it is kept, 32
threads of a block read coalesced rows, each owning one output column or, for aligned float32 and
float64, 16 bytes of neighbouring columns (``cols``/``colsv``: a bias gradient's column sums over
[rows, C] read 512 bytes per warp and row, four rows in flight per thread). When there are too few
outputs to fill the GPU, each output's reduction is split into fixed chunks whose partial states
a second kernel combines in a fixed order, so results are bit-identical from run to run (no
atomics). The gradient pass's broadcast undoing, ReduceSum of (N, C, H, W) to (1, C, 1, 1), is
the ``rows`` case with a strided outer reduced dim. ``sorted_pairs`` is a device sort of any length
(a bitonic sort of (key, position) pairs in TopK's key order), Unique's.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import FLOATS, MAX_BLOCKS, contiguous, cpu_fallback, dtype_suffix, kernel_of, launch, plan_cache
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.axes import normalize_axis

_FLOAT_OPS = ("sum", "mean", "sum_square", "l1", "l2", "log_sum", "max", "min", "prod", "log_sum_exp")
_INT_OPS = ("sum", "max", "min", "prod")
_THREADS = 256
_STATE_BYTES = 16  # the largest reduction state (a pair of doubles for log-sum-exp)


@functools.lru_cache(maxsize=1)
def sm_count() -> int:
    from gradgen.cuda import runtime as rt

    device = rt.driver.Context.get_device()
    return int(device.get_attribute(rt.driver.device_attribute.MULTIPROCESSOR_COUNT))


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _merge(shape, reduced):
    """[(size, is_reduced, stride)] of the merged groups (size-1 dims dropped), C-contiguous input."""
    groups: list[list] = []
    for size, red in zip(shape, reduced):
        if size == 1:
            continue
        if groups and groups[-1][1] == red:
            groups[-1][0] *= size
        else:
            groups.append([size, red])
    stride = 1
    out = []
    for size, red in reversed(groups):
        out.append((size, red, stride))
        stride *= size
    return out[::-1]


def blocks_per_sm(kernel, threads: int) -> int:
    """Resident blocks of ``kernel`` per SM at ``threads`` per block (registers, threads, shared memory)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(int(kernel.num_regs), 1) * 32 // 256) * 256
    by_regs = 65536 // (warps * regs_per_warp)
    by_threads = 2048 // (warps * 32)
    smem = int(kernel.shared_size_bytes)
    by_smem = (227 * 1024) // smem if smem else 32
    return max(1, min(by_regs, by_threads, by_smem, 32))


@functools.lru_cache(maxsize=4096)
def _plan(op: str, s: str, itemsize: int, shape: tuple, axes: tuple, aligned: bool):
    """How to run one reduction: (kind, kernel, extra args, block, grid, splits). Cached per call signature."""
    from gradgen.cuda import runtime as rt

    reduced = [d in axes for d in range(len(shape))]
    total = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    out_size = int(np.prod([d for d, r in zip(shape, reduced) if not r], dtype=np.int64))
    groups = _merge(shape, reduced)
    kept = [(size, stride) for size, red, stride in groups if not red]
    if groups[-1][1]:  # innermost group reduced: rows
        length = groups[-1][0]
        outer_red = [(size, stride) for size, red, stride in groups[:-1] if red]
        v = 16 // itemsize if s in ("f32", "f64", "i32", "i64") else 1
        if v > 1 and (length % v or not aligned):
            v = 1
        threads = min(_THREADS, max(32, _next_pow2(math.ceil(total / v / 4))))
        kernel = kernel_of("reduction", f"{'rowsv' if v > 1 else 'rows'}_{op}_{s}")
        # Fill the GPU in one wave when there are few outputs: split each output's reduction.
        capacity = sm_count() * blocks_per_sm(kernel, threads)
        splits = max(1, min(capacity // out_size, total // 8192, 65535))
        chunk = -(-total // splits)
        chunk = -(-chunk // v) * v
        splits = -(-total // chunk)
        args = (
            rt.desc([k[0] for k in kept], [k[1] for k in kept]),
            rt.desc([r[0] for r in outer_red], [r[1] for r in outer_red]),
            np.int64(length),
            np.int64(total),
            np.int64(chunk),
        )
        return kernel, args, (threads, 1, 1), (out_size, splits), splits, total
    c = groups[-1][0]  # innermost group kept: cols
    outer_kept = kept[:-1]
    red = [(size, stride) for size, r, stride in groups if r]
    # 16 bytes of neighbouring columns per thread where they line up (every row then starts aligned).
    v = 16 // itemsize if s in ("f32", "f64") and aligned and c % (16 // itemsize) == 0 else 1
    tiles = -(-c // (32 * v))
    by = 8  # the kernels' shared memory holds at most 8 rows of partial states
    blocks = (out_size // c) * tiles
    kernel = kernel_of("reduction", f"{'colsv' if v > 1 else 'cols'}_{op}_{s}")
    capacity = sm_count() * blocks_per_sm(kernel, 32 * by)
    # Split the rows until the GPU is full, each thread keeping at least 8 rows (two unrolled rounds).
    splits = max(1, min(capacity // blocks, total // (by * 8), 65535))
    chunk = -(-total // splits)
    splits = -(-total // chunk)
    args = (
        rt.desc([k[0] for k in outer_kept], [k[1] for k in outer_kept]),
        rt.desc([r[0] for r in red], [r[1] for r in red]),
        np.int64(c),
        np.int64(tiles),
        np.int64(total),
        np.int64(chunk),
    )
    return kernel, args, (32, by, 1), (blocks, splits), splits, total


_COUNTERS: dict = {}
MAX_TILE_COUNTERS = 1 << 16


def tile_counters(tiles: int):
    """The zeroed per-tile counters with which a split kernel finishes in its last block
    (LayerNormalizationGrad's column sums: kernels/cuda/norm.py). One buffer for the process:
    launches on gradgen's one stream run one after another, and each leaves its counters at zero.
    None for more tiles than it holds (a separate launch then combines the splits). (The split
    reductions here finish with a fin_ launch: done in their last block, measured slower on GPT-2
    small's bias gradients, 0.67 ms against 0.30 + 0.19 ms, one thread a column is what fin_ has.)"""
    from gradgen.cuda import runtime as rt

    if tiles > MAX_TILE_COUNTERS:
        return None
    if "counters" not in _COUNTERS:
        with rt.persistent():
            _COUNTERS["counters"] = rt.zeros((MAX_TILE_COUNTERS,), np.uint32)
        rt.drop_at_exit(_COUNTERS.clear)
    return _COUNTERS["counters"]


def reduce(op: str, x, axes: tuple[int, ...], keepdims: bool, op_type: str = ""):
    """Reduce ``x`` over the normalised ``axes`` (() reduces nothing) with reducer ``op``."""
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    s = dtype_suffix(x.dtype)
    shape = tuple(int(d) for d in x.shape)
    if keepdims:
        out_shape = tuple(1 if d in axes else n for d, n in enumerate(shape))
    else:
        out_shape = tuple(n for d, n in enumerate(shape) if d not in axes)
    out = rt.empty(out_shape, x.dtype)
    if out.size == 0:
        return out
    total = int(np.prod([shape[a] for a in axes], dtype=np.int64))
    if total == 0:
        # Reducing an empty axis: every output is the reducer's identity (0, -inf, NaN for mean...).
        from gradgen.kernels import registry

        host = registry.lookup("", op_type).cpu(np.empty(shape, x.dtype), np.asarray(axes, np.int64), keepdims=int(keepdims))
        return rt.to_device(np.asarray(host, dtype=x.dtype).reshape(out_shape))
    if total == 1:
        launch(kernel_of("reduction", f"map_{op}_{s}"), out.size, out, x, np.int64(out.size))
        return out
    kernel, args, block, grid, splits, total = _plan(
        op, s, np.dtype(x.dtype).itemsize, shape, tuple(axes), int(x.gpudata) % 16 == 0
    )
    partial = rt.empty((out.size * splits * _STATE_BYTES,), np.uint8) if splits > 1 else None
    kernel(out, partial if partial is not None else np.intp(0), x, *args, block=block, grid=grid)
    if partial is not None:
        launch(
            kernel_of("reduction", f"fin_{op}_{s}"), out.size, out, partial, np.int64(out.size), np.int64(splits), np.int64(total)
        )
    return out


def _register_reduce(op_type: str, op: str):
    def launcher(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        from gradgen.kernels.cpu.reduction import reduce_axes  # the CPU kernel's axis rule

        s = dtype_suffix(data.dtype)
        if not ((s in FLOATS and op in _FLOAT_OPS) or (s in ("i32", "i64") and op in _INT_OPS)):
            return cpu_fallback(op_type, data, axes, keepdims=keepdims, noop_with_empty_axes=noop_with_empty_axes)
        axes_tuple = reduce_axes(np.empty((0,) * len(data.shape)), axes, noop_with_empty_axes)
        return reduce(op, data, axes_tuple, bool(keepdims), op_type)

    launcher.__name__ = f"reduce_{op}"
    launcher.__qualname__ = launcher.__name__
    cuda_kernel(op_type, host_inputs=(1,))(launcher)
    return launcher


for _op_type, _op in (
    ("ReduceSum", "sum"),
    ("ReduceMean", "mean"),
    ("ReduceSumSquare", "sum_square"),
    ("ReduceL1", "l1"),
    ("ReduceL2", "l2"),
    ("ReduceLogSum", "log_sum"),
    ("ReduceMax", "max"),
    ("ReduceMin", "min"),
    ("ReduceProd", "prod"),
    ("ReduceLogSumExp", "log_sum_exp"),
):
    _register_reduce(_op_type, _op)


# -- Softmax / LogSoftmax ------------------------------------------------------------------------


def softmax_3d(x, outer: int, length: int, inner: int, log: bool):
    """(Log)softmax of ``x`` viewed as (outer, length, inner) over the middle axis."""
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    s = dtype_suffix(x.dtype)
    out = rt.empty(x.shape, x.dtype)
    if out.size == 0:
        return out
    name = "log_softmax" if log else "softmax"
    if inner == 1 and 8 < length <= 1024:
        lanes = max(1, 1 << (-(-length // 32) - 1).bit_length())  # elements per lane: 1, 2, 4, ..., 32
        kernel_of("reduction", f"{name}_warp{lanes}_{s}")(
            out, x, np.int64(outer), np.int64(length), block=(128, 1, 1), grid=(-(-outer // 4), 1)
        )
    elif inner == 1 and length > 8:
        threads = min(1024, max(32, _next_pow2(math.ceil(length / 8))))
        kernel_of("reduction", f"{name}_rows_{s}")(out, x, np.int64(length), block=(threads, 1, 1), grid=(outer, 1))
    else:
        launch(
            kernel_of("reduction", f"{name}_cols_{s}"), outer * inner, out, x, np.int64(outer), np.int64(length), np.int64(inner)
        )
    return out


def _softmax(op_type: str, x, axis, opset: int, log: bool):
    if dtype_suffix(x.dtype) not in FLOATS:
        return cpu_fallback(op_type, x, axis=axis, _opset=opset)
    shape = [int(d) for d in x.shape]
    if opset >= 13:
        ax = normalize_axis(-1 if axis is None else axis, len(shape))
        outer = int(np.prod(shape[:ax], dtype=np.int64))
        inner = int(np.prod(shape[ax + 1 :], dtype=np.int64))
        return softmax_3d(x, outer, shape[ax], inner, log)
    ax = normalize_axis(1 if axis is None else axis, len(shape)) if shape else 0
    outer = int(np.prod(shape[:ax], dtype=np.int64))
    return softmax_3d(x, outer, int(np.prod(shape[ax:], dtype=np.int64)), 1, log)


def _softmax_grad(op_type: str, dY, Y, axis, log: bool):
    """SoftmaxGrad_13 / LogSoftmaxGrad_13 over one axis, viewed as (outer, L, inner) like the forward."""
    from gradgen.cuda import runtime as rt

    if tuple(dY.shape) != tuple(Y.shape) or dY.dtype != Y.dtype:
        raise KernelError(f"{op_type}: dY {dY.dtype}{list(dY.shape)} and Y {Y.dtype}{list(Y.shape)} must have one shape and type")
    s = dtype_suffix(Y.dtype)
    if s not in FLOATS:
        return cpu_fallback(op_type, dY, Y, domain=MICROSOFT, axis=axis)
    dY, Y = contiguous(dY), contiguous(Y)
    shape = [int(d) for d in Y.shape]
    out = rt.empty(Y.shape, Y.dtype)
    if out.size == 0:
        return out
    ax = normalize_axis(axis, len(shape))
    outer, length = int(np.prod(shape[:ax], dtype=np.int64)), shape[ax]
    inner = int(np.prod(shape[ax + 1 :], dtype=np.int64))
    name = "log_softmax_grad" if log else "softmax_grad"
    if inner == 1 and length <= 1024:
        lanes = max(1, 1 << (-(-length // 32) - 1).bit_length())  # elements per lane: 1, 2, 4, ..., 32
        kernel_of("reduction", f"{name}_warp{lanes}_{s}")(
            out, dY, Y, np.int64(outer), np.int64(length), block=(128, 1, 1), grid=(-(-outer // 4), 1)
        )
    elif inner == 1:
        threads = min(1024, max(32, _next_pow2(math.ceil(length / 8))))
        kernel_of("reduction", f"{name}_rows_{s}")(out, dY, Y, np.int64(length), block=(threads, 1, 1), grid=(outer, 1))
    else:
        launch(
            kernel_of("reduction", f"{name}_cols_{s}"),
            outer * inner,
            out,
            dY,
            Y,
            np.int64(outer),
            np.int64(length),
            np.int64(inner),
        )
    return out


@cuda_kernel("SoftmaxGrad_13", domain=MICROSOFT)
def softmax_grad_13(dY, Y, *, axis=-1):
    """dX = Y * (dY - sum(dY * Y, axis)) (ONNX Runtime training's SoftmaxGrad_13)."""
    return _softmax_grad("SoftmaxGrad_13", dY, Y, axis, log=False)


@cuda_kernel("LogSoftmaxGrad_13", domain=MICROSOFT)
def log_softmax_grad_13(dY, Y, *, axis=-1):
    """dX = dY - exp(Y) * sum(dY, axis) (ONNX Runtime training's LogSoftmaxGrad_13)."""
    return _softmax_grad("LogSoftmaxGrad_13", dY, Y, axis, log=True)


def _coerced_softmax_grad(op_type: str, dY, Y, axis, log: bool):
    """SoftmaxGrad / LogSoftmaxGrad (Softmax before opset 13): the sums run over every axis from
    ``axis`` on, so the operands are viewed as 2-D (rows, the rest) and reduced along axis 1."""
    if tuple(dY.shape) != tuple(Y.shape):
        raise KernelError(f"{op_type}: dY {dY.dtype}{list(dY.shape)} and Y {Y.dtype}{list(Y.shape)} must have one shape and type")
    shape = tuple(int(d) for d in Y.shape)
    ax = normalize_axis(axis, len(shape))
    rows = int(np.prod(shape[:ax], dtype=np.int64))
    flat = (rows, int(np.prod(shape[ax:], dtype=np.int64)))
    out = _softmax_grad(op_type, contiguous(dY).reshape(flat), contiguous(Y).reshape(flat), 1, log)
    return out.reshape(shape)


@cuda_kernel("SoftmaxGrad", domain=MICROSOFT)
def softmax_grad(dY, Y, *, axis=1):
    """dX = Y * (dY - sum(dY * Y)) over every axis from ``axis`` (ONNX Runtime training's SoftmaxGrad)."""
    return _coerced_softmax_grad("SoftmaxGrad", dY, Y, axis, log=False)


@cuda_kernel("LogSoftmaxGrad", domain=MICROSOFT)
def log_softmax_grad(dY, Y, *, axis=1):
    """dX = dY - exp(Y) * sum(dY) over every axis from ``axis`` (ONNX Runtime training's LogSoftmaxGrad)."""
    return _coerced_softmax_grad("LogSoftmaxGrad", dY, Y, axis, log=True)


@cuda_kernel("Softmax")
def softmax(x, *, axis=None, _opset=13):
    return _softmax("Softmax", x, axis, _opset, log=False)


@cuda_kernel("LogSoftmax")
def log_softmax(x, *, axis=None, _opset=13):
    return _softmax("LogSoftmax", x, axis, _opset, log=True)


@cuda_kernel("CumSum", host_inputs=(1,))
def cum_sum(x, axis, *, exclusive=0, reverse=0):
    """Inclusive/exclusive, forward/reverse running sums along one axis (one thread per line)."""
    return _scan("CumSum", "cumsum", x, axis, exclusive, reverse)


def _scan(op_type: str, kernel: str, x, axis, exclusive, reverse):
    """CumSum / CumProd through reduction.cu's ``<kernel>_<dtype>`` (scan_lines): one thread per line
    of x viewed as (outer, length, inner) around ``axis``; other dtypes run the CPU kernel."""
    from gradgen.cuda import runtime as rt

    s = dtype_suffix(x.dtype)
    if s not in FLOATS + ("i32", "i64"):
        return cpu_fallback(op_type, x, axis, exclusive=exclusive, reverse=reverse)
    if np.size(axis) != 1:
        raise KernelError(f"axis must be a scalar, got shape {list(np.shape(axis))}")
    ax = normalize_axis(int(np.asarray(axis).reshape(-1)[0]), len(x.shape))
    x = contiguous(x)
    outer, length, inner = math.prod(x.shape[:ax]), x.shape[ax], math.prod(x.shape[ax + 1 :])
    out = rt.empty(x.shape, x.dtype)
    launch(
        kernel_of("reduction", f"{kernel}_{s}"),
        outer * inner,
        out,
        x,
        np.int64(outer),
        np.int64(length),
        np.int64(inner),
        np.int64(1 if exclusive else 0),
        np.int64(1 if reverse else 0),
    )
    return out


# ---------------------------------------------------------------- TopK

_TOPK_TYPES = FLOATS + ("i8", "u8", "i32", "i64")
TOPK_MAX_AXIS = 4096  # the longest axis sorted in shared memory (keys and indices: 40 KiB)


@cuda_kernel("TopK", host_inputs=(1,))
def top_k(x, k=None, *, axis=-1, largest=1, sorted=1, **attrs):
    """The K largest (or smallest) elements along ``axis`` and their int64 indices, in the CPU
    kernel's order whatever ``sorted`` says: descending (ascending) with every NaN above +inf, -0
    tied with +0, ties by the lower index first. One block per line sorts (key, index) pairs in
    shared memory (reduction.cu: topk_*); an axis longer than 4,096 or another dtype runs the CPU
    kernel. K is read on the host (it sets the outputs' shape)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu.reduction import top_k_count

    count = top_k_count(k, attrs)
    shape = [int(d) for d in x.shape]
    ax = normalize_axis(axis, len(shape))
    length = shape[ax]
    if not 0 <= count <= length:
        raise KernelError(f"K={count} is out of range for axis {ax} of size {length}")
    s = dtype_suffix(x.dtype)
    if s not in _TOPK_TYPES or length > TOPK_MAX_AXIS:
        return cpu_fallback("TopK", x, k, axis=axis, largest=largest, sorted=sorted, **attrs)
    out_shape = [*shape[:ax], count, *shape[ax + 1 :]]
    values = rt.empty(out_shape, x.dtype)
    indices = rt.empty(out_shape, np.int64)
    outer, inner = math.prod(shape[:ax]), math.prod(shape[ax + 1 :])
    lines = outer * inner
    if count == 0 or lines == 0:
        return values, indices
    x = contiguous(x)
    padded = _next_pow2(length)
    threads = min(1024, max(32, padded // 2))
    kernel_of("reduction", f"topk_{s}")(
        values,
        indices,
        x,
        np.int64(outer),
        np.int64(length),
        np.int64(inner),
        np.int64(count),
        np.int64(padded),
        np.int64(1 if largest else 0),
        block=(threads, 1, 1),
        grid=(min(lines, 65535 * 16), 1),
        shared=padded * 10,
    )
    return values, indices


# ---------------------------------------------------------------- sort of any length

SORT_TILE = 2048  # pairs one block sorts in shared memory (SORT_TILE in reduction.cu)


def sorted_pairs(x):
    """(keys, positions): x's elements (C order) as uint64 keys in numpy's sort order (TopK's keys:
    -0 tied with +0, every NaN above +inf and tied with the others) and their int64 flat positions,
    sorted by key, equal keys by position (numpy's stable order). Both have P entries (x.size rounded
    up to a power of two, at least 2); the pairs after the first x.size are padding. A bitonic sort
    (reduction.cu: sort_keys, sort_tile, sort_step): tiles of SORT_TILE pairs in shared memory, the
    merge steps of longer strides over the whole array, about log2(P)^2 / 2 launches in all above a
    tile. x must be float16, bfloat16, float32, float64, int32 or int64, non-empty and contiguous."""
    from gradgen.cuda import runtime as rt

    n = int(x.size)
    padded = max(2, _next_pow2(n))
    keys = rt.empty((padded,), np.uint64)
    positions = rt.empty((padded,), np.int64)
    launch(
        kernel_of("reduction", f"sort_keys_{dtype_suffix(x.dtype)}"), padded, keys, positions, x, np.int64(n), np.int64(padded)
    )
    tile = min(padded, SORT_TILE)
    sort_tile, sort_step = kernel_of("reduction", "sort_tile"), kernel_of("reduction", "sort_step")

    def tiles(size: int) -> None:
        sort_tile(keys, positions, np.int64(tile), np.int64(size), block=(tile // 2, 1, 1), grid=(padded // tile, 1))

    tiles(0)
    size = 2 * tile
    while size <= padded:
        stride = size // 2
        while stride >= tile:
            launch(sort_step, padded // 2, keys, positions, np.int64(padded), np.int64(size), np.int64(stride))
            stride //= 2
        tiles(size)
        size *= 2
    return keys, positions


# ---------------------------------------------------------------- CumProd


@cuda_kernel("CumProd", host_inputs=(1,))
def cum_prod(x, axis, *, exclusive=0, reverse=0):
    """Inclusive/exclusive, forward/reverse running products along one axis (one thread per line, in
    order): float16/bfloat16 multiplied in float32 and rounded when stored (the CPU backend's
    float32 computation), float32/float64 in their own type, int32/int64 wrapping like numpy's.
    Other dtypes run the CPU kernel."""
    return _scan("CumProd", "cumprod", x, axis, exclusive, reverse)


# ---------------------------------------------------------------- ArgMax / ArgMin

_ARG_TYPES = FLOATS + ("i32", "i64")
_ARG_WARP_ROWS = 32  # inner == 1 and at least this long: one warp per line, else one thread per line


def _arg_extreme(op_type: str, name: str, data, axis, keepdims, select_last_index):
    """The int64 index of the first (select_last_index: last) largest or smallest element along
    ``axis``, as the CPU kernel's numpy argmax/argmin (NaN counts as the extreme; -0 ties +0):
    reduction.cu's argext kernels over the (outer, L, inner) view; other dtypes run the CPU kernel."""
    from gradgen.cuda import runtime as rt

    attrs = dict(axis=axis, keepdims=keepdims, select_last_index=select_last_index)
    shape = [int(d) for d in data.shape]
    ax = normalize_axis(axis, len(shape))
    length = shape[ax]
    if length == 0:
        raise KernelError(f"cannot take the arg-reduction of an empty axis {ax}")
    s = dtype_suffix(data.dtype)
    if s not in _ARG_TYPES:
        return cpu_fallback(op_type, data, **attrs)
    out_shape = [*shape[:ax], 1, *shape[ax + 1 :]] if keepdims else [*shape[:ax], *shape[ax + 1 :]]
    out = rt.empty(out_shape, np.int64)
    outer, inner = math.prod(shape[:ax]), math.prod(shape[ax + 1 :])
    if out.size == 0:
        return out
    x = contiguous(data)
    last = np.int64(1 if select_last_index else 0)
    if inner == 1 and length >= _ARG_WARP_ROWS:
        rows_per_block = _THREADS // 32
        grid = min(-(-outer // rows_per_block), MAX_BLOCKS)
        kernel_of("reduction", f"{name}_rows_{s}")(
            out, x, np.int64(outer), np.int64(length), last, block=(_THREADS, 1, 1), grid=(grid, 1)
        )
    else:
        launch(
            kernel_of("reduction", f"{name}_cols_{s}"),
            outer * inner,
            out,
            x,
            np.int64(outer),
            np.int64(length),
            np.int64(inner),
            last,
        )
    return out


@cuda_kernel("ArgMax")
def arg_max(data, *, axis=0, keepdims=1, select_last_index=0):
    """Indices of the largest elements along ``axis`` (``_arg_extreme``)."""
    return _arg_extreme("ArgMax", "argmax", data, axis, keepdims, select_last_index)


@cuda_kernel("ArgMin")
def arg_min(data, *, axis=0, keepdims=1, select_last_index=0):
    """Indices of the smallest elements along ``axis`` (``_arg_extreme``)."""
    return _arg_extreme("ArgMin", "argmin", data, axis, keepdims, select_last_index)


@cuda_kernel("Hardmax")
def hardmax(x, *, axis=None, _opset=13):
    """1 at the first largest element along the axis (NaN counts as the largest, as np.argmax), 0
    elsewhere: ArgMax's kernel, then OneHot's; below opset 13 over x seen as 2-D at the axis (the
    CPU kernel's frame). Dtypes ArgMax's kernel does not cover run the CPU kernel."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.elementwise import on_off_values
    from gradgen.kernels.cuda.indexing import one_hot
    from gradgen.kernels.cuda.shape import reshaped

    if dtype_suffix(x.dtype) not in FLOATS:
        return cpu_fallback("Hardmax", x, axis=axis, _opset=_opset)
    shape = tuple(int(d) for d in x.shape)
    if _opset >= 13:
        ax, view = normalize_axis(-1 if axis is None else axis, len(shape)), x
    else:
        split = normalize_axis(1 if axis is None else axis, len(shape)) if shape else 0
        ax, view = 1, reshaped(x, (math.prod(shape[:split]), math.prod(shape[split:])))
    if math.prod(shape) == 0:
        return rt.zeros(shape, x.dtype)
    index = _arg_extreme("ArgMax", "argmax", view, ax, 0, 0)
    y = one_hot(index, np.array(view.shape[ax], np.int64), on_off_values(x.dtype), axis=ax)
    return y if tuple(y.shape) == shape else reshaped(y, shape)


# ---------------------------------------------------------------- TfIdfVectorizer

_NGRAM_TABLES: dict = {}


def _ngram_tables(pool):
    """The device copies of an NgramPool's (vocabulary, edge_keys, edge_child, node_output,
    weights), uploaded once per attribute set."""
    from gradgen.cuda import runtime as rt

    def upload():
        if not _NGRAM_TABLES:
            rt.drop_at_exit(_NGRAM_TABLES.clear)  # device arrays go while the context is current
        with rt.persistent():
            return tuple(
                rt.to_device(table)
                for table in (pool.vocabulary, pool.edge_keys, pool.edge_child, pool.node_output, pool.weights)
            )

    return plan_cache(_NGRAM_TABLES, pool.key, upload)


@cuda_kernel("TfIdfVectorizer")
def tf_idf_vectorizer(X, **attrs):
    """The CPU kernel's n-gram counts, weighted by mode, from the same trie tables (NgramPool, on
    the device once per attribute set): reduction.cu's tfidf_count_* walks the trie from every
    (row, start, skip distance) and counts with integer atomics into zeroed uint32 counts, then
    tfidf_weigh writes the float32 output."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu.reduction import ngram_pool, tf_idf_rows

    pool = ngram_pool(attrs)
    rows, length = tf_idf_rows(tuple(X.shape), X.dtype)
    vocabulary, edge_keys, edge_child, node_output, weights = _ngram_tables(pool)
    counts = rt.zeros((rows * pool.output_size,), np.uint32)
    distances = len(pool.skip_distances())
    if rows * length and pool.edge_keys.size:
        launch(
            kernel_of("reduction", f"tfidf_count_{dtype_suffix(X.dtype)}"),
            rows * length * distances,
            counts,
            contiguous(X),
            vocabulary,
            np.int64(pool.vocabulary.size),
            edge_keys,
            edge_child,
            np.int64(pool.edge_keys.size),
            node_output,
            np.int64(rows),
            np.int64(length),
            np.int64(pool.output_size),
            np.int64(distances),
            np.int64(pool.max_gram_length),
            np.int64(pool.shortest(1)),
            np.int64(pool.shortest(2)),
        )
    y = rt.empty((pool.output_size,) if len(X.shape) == 1 else (rows, pool.output_size), np.float32)
    launch(
        kernel_of("reduction", "tfidf_weigh"),
        y.size,
        y,
        counts,
        weights,
        np.int64(y.size),
        np.int64(pool.output_size),
        np.int64(pool.mode),
    )
    return y
