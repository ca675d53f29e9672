"""CPU kernels: indexing (Gather*, Scatter*, TensorScatter, OneHot, NonZero, Compress, and the
com.microsoft GatherGrad and GatherElementsGrad).

Conventions shared by every kernel here:

* Negative indices are normalised first (``i + dim`` for ``i < 0``); an index still outside
  ``[-dim, dim - 1]`` raises ``KernelError`` naming the index value, the axis and the valid range.
* Scatter reductions ``add``/``mul``/``max``/``min`` use numpy's unbuffered ``ufunc.at``, so
  repeated indices accumulate (``x[idx] += y`` would keep only one of them).
* ``reduction="none"`` with repeated indices is deterministic: the update that comes last in the
  row-major order of ``indices`` wins (ONNX leaves this undefined).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.prepared import constant_inputs, per_shape
from gradgen.kernels.numeric import accumulation_dtype, shape_arg
from gradgen.kernels.table import MICROSOFT, cpu_into, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.axes import normalize_axis
from gradgen.ops.indexing import check_gather_elements_grad, normalize_indices, tensor_scatter_positions
from gradgen.ops.schemas import FLOATS, INDICES, INT64, Attribute, Formal, Schema

_REDUCTIONS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def check_reduction(reduction: str) -> str:
    if reduction != "none" and reduction not in _REDUCTIONS:
        raise KernelError(f"unknown reduction {reduction!r}; expected none, add, mul, max or min")
    return reduction


def _writable_copy(data: np.ndarray) -> np.ndarray:
    """A C-ordered copy of ``data`` (the flat views of it that the scatters write through must be
    views) with numpy's own instance of its dtype: ``ufunc.at`` takes a path 15x slower on an
    array whose dtype is an equal but other instance ('<f4', as the tensors of a loaded ONNX model
    come, and every array computed from them)."""
    return data.astype(_canonical(data.dtype), order="C", copy=True)


def _canonical(dtype: np.dtype) -> np.dtype:
    return np.dtype(dtype.type) if dtype.kind in "biuf" and dtype.isnative else dtype


def _as_dtype_of(values: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``values`` in ``out``'s dtype instance (a view where the dtypes are equal, see
    ``_writable_copy``)."""
    if values.dtype is out.dtype:
        return values
    return values.view(out.dtype) if values.dtype == out.dtype else values.astype(out.dtype)


def _last_wins(flat_positions: np.ndarray) -> np.ndarray:
    """Positions (into the flattened update order) of the last update to each distinct target."""
    flat = flat_positions.ravel()
    reversed_positions = flat[::-1]
    _, first_in_reversed = np.unique(reversed_positions, return_index=True)
    return np.sort(flat.size - 1 - first_in_reversed)


@cpu_kernel("Gather")
def gather(data, indices, *, axis=0):
    axis = normalize_axis(axis, data.ndim, allow_scalar=True)
    idx = normalize_indices(indices, data.shape[axis], axis)
    return np.take(data, idx, axis=axis)


@cpu_kernel("GatherElements")
def gather_elements(data, indices, *, axis=0):
    axis = normalize_axis(axis, data.ndim, allow_scalar=True)
    if indices.ndim != data.ndim:
        raise KernelError(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
    idx = normalize_indices(indices, data.shape[axis], axis)
    # take_along_axis broadcasts the other axes; GatherElements only allows indices no larger.
    for d, (n, m) in enumerate(zip(idx.shape, data.shape)):
        if d != axis and n > m:
            raise KernelError(f"indices dimension {d} is {n}, larger than data's {m}")
    sliced = data[tuple(slice(0, n) if d != axis else slice(None) for d, n in enumerate(idx.shape))]
    return np.take_along_axis(sliced, idx, axis=axis)


def nd_tuple(data_shape, idx: np.ndarray, first_axis: int) -> tuple[np.ndarray, ...]:
    """Split the last dimension of GatherND/ScatterND indices into one normalised array per axis
    (indices[..., j] indexes data axis first_axis + j)."""
    k = idx.shape[-1]
    return tuple(normalize_indices(idx[..., j], data_shape[first_axis + j], first_axis + j, suffix=(j,)) for j in range(k))


@cpu_kernel("GatherND")
def gather_nd(data, indices, *, batch_dims=0):
    b = int(batch_dims)
    if indices.ndim < 1:
        raise KernelError("indices must have rank >= 1")
    k = indices.shape[-1]
    if b + k > data.ndim:
        raise KernelError(f"indices.shape[-1] ({k}) + batch_dims ({b}) exceeds data rank {data.ndim}")
    if data.shape[:b] != indices.shape[:b]:
        raise KernelError(f"the first {b} (batch) dimensions of data {list(data.shape)} and indices {list(indices.shape)} differ")
    batch = int(np.prod(data.shape[:b], dtype=np.int64))
    d = data.reshape((batch,) + data.shape[b:])
    if k == 0:  # every (empty) index tuple selects the whole slice
        slices = d.reshape((batch,) + (1,) * (indices.ndim - 1 - b) + data.shape[b:])
        out = np.broadcast_to(slices, (batch,) + indices.shape[b:-1] + data.shape[b:]).copy()
        return out.reshape(indices.shape[:-1] + data.shape[b:])
    parts = nd_tuple(data.shape, indices, b)
    parts = tuple(p.reshape((batch,) + p.shape[b:]) for p in parts)
    bidx = np.arange(batch).reshape((batch,) + (1,) * (indices.ndim - 1 - b))
    out = d[(bidx,) + parts]
    return out.reshape(indices.shape[:-1] + data.shape[b + k :])


@cpu_kernel("ScatterElements", "Scatter")  # Scatter: the deprecated (opset 9-10) name
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    reduction = check_reduction(reduction)
    axis = normalize_axis(axis, data.ndim, allow_scalar=True)
    if indices.shape != updates.shape or indices.ndim != data.ndim:
        raise KernelError(
            f"indices {list(indices.shape)} and updates {list(updates.shape)} must have the same shape "
            f"and data's rank {data.ndim}"
        )
    idx = normalize_indices(indices, data.shape[axis], axis)
    for d, (n, m) in enumerate(zip(idx.shape, data.shape)):
        if d != axis and n > m:
            raise KernelError(f"indices dimension {d} is {n}, larger than data's {m}")
    grid = list(np.indices(idx.shape, sparse=True))
    grid[axis] = idx
    target = tuple(grid)  # indexing broadcasts the sparse grid itself (np.broadcast_arrays: half the call)
    out = _writable_copy(data)
    upd = _as_dtype_of(updates, out)
    flat = np.ravel_multi_index(target, data.shape).ravel()
    if reduction == "none":
        keep = _last_wins(flat)
        out.reshape(-1)[flat[keep]] = upd.ravel()[keep]
    else:
        # ufunc.at on flat indices of the flat copy: the same element order as on the index tuple,
        # 3x faster (numpy's 1-D fast path)
        _REDUCTIONS[reduction].at(out.reshape(-1), flat, upd.ravel())
    return out


@cpu_kernel("ScatterND")
def scatter_nd(data, indices, updates, *, reduction="none"):
    reduction = check_reduction(reduction)
    if indices.ndim < 1:
        raise KernelError("indices must have rank >= 1")
    k = indices.shape[-1]
    if k > data.ndim:
        raise KernelError(f"indices.shape[-1] ({k}) exceeds data rank {data.ndim}")
    want = indices.shape[:-1] + data.shape[k:]
    if updates.shape != want:
        raise KernelError(f"updates shape {list(updates.shape)} should be {list(want)}")
    parts = nd_tuple(data.shape, indices, 0)
    out = _writable_copy(data)
    upd = _as_dtype_of(updates, out)
    if reduction == "none":
        lead = data.shape[:k]
        flat = np.ravel_multi_index(parts, lead) if k else np.zeros(indices.shape[:-1], np.int64)
        keep = _last_wins(flat)
        view = out.reshape((int(np.prod(lead, dtype=np.int64)),) + data.shape[k:])
        view[flat.ravel()[keep]] = upd.reshape((-1,) + data.shape[k:])[keep]
    else:
        if k == 0:
            for u in upd.reshape((-1,) + data.shape):
                out = _REDUCTIONS[reduction](out, u)
        else:
            _REDUCTIONS[reduction].at(out, parts, upd)
    return out


@cpu_kernel("TensorScatter")
def tensor_scatter(past_cache, update, write_indices=None, *, mode="linear", axis=-2):
    """``past_cache`` with ``update`` written along ``axis`` from ``write_indices[b]`` on in batch
    row b (opset 24: attention's KV-cache update; ``circular`` wraps around the axis)."""
    positions, axis = tensor_scatter_positions(past_cache.shape, update.shape, write_indices, mode, axis)
    present = past_cache.copy()
    np.put_along_axis(present, positions, update, axis)
    return present


def one_hot_depth(depth, values_size: int) -> int:
    """OneHot's depth as an int, after the checks of depth (one positive value) and of the values
    (two elements: off, on)."""
    depth_value = np.asarray(depth).reshape(-1)
    if depth_value.size != 1:
        raise KernelError(f"depth must hold one value, got shape {list(np.shape(depth))}")
    n = int(depth_value[0])
    if n < 1:
        raise KernelError(f"depth must be positive, got {n}")
    if values_size != 2:
        raise KernelError(f"values must hold [off_value, on_value], got {values_size} element(s)")
    return n


@cpu_kernel("OneHot")
def one_hot(indices, depth, values, *, axis=-1):
    values = np.asarray(values).reshape(-1)
    n = one_hot_depth(depth, values.size)
    rank = np.ndim(indices) + 1
    axis = normalize_axis(axis, rank, allow_scalar=True)
    idx = np.asarray(indices).astype(np.int64)
    # Per the spec, indices outside [-depth, depth-1] give an all-off row (not an error).
    idx = np.where(idx < 0, idx + n, idx)
    hot = np.expand_dims(idx, axis) == np.arange(n).reshape((n,) + (1,) * (rank - 1 - axis))
    return np.where(hot, values[1], values[0]).astype(values.dtype, copy=False)


@cpu_kernel("NonZero")
def non_zero(x):
    if x.ndim == 0:
        return np.zeros((0, int(np.count_nonzero(x))), dtype=np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@cpu_kernel("Compress")
def compress(data, condition, *, axis=None):
    cond = np.asarray(condition).reshape(-1).astype(bool)
    if axis is None:
        flat = data.reshape(-1)
        if cond.size > flat.size:
            raise KernelError(f"condition has {cond.size} entries but the flattened input only {flat.size}")
        return flat[: cond.size][cond]
    axis = normalize_axis(axis, data.ndim, allow_scalar=True)
    if cond.size > data.shape[axis]:
        raise KernelError(f"condition has {cond.size} entries but axis {axis} has size {data.shape[axis]}")
    return np.compress(cond, data, axis=axis)


# ---------------------------------------------------------------------------------------------
# GatherGrad, GatherElementsGrad (com.microsoft, ONNX Runtime training's input orders)

GATHER_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc).
        "GatherGrad",
        inputs=(Formal("shape", INT64), Formal("indices", INDICES), Formal("dY", FLOATS)),
        outputs=(Formal("dX", FLOATS),),
        attributes=(Attribute("axis", "int", 0),),
        infer=lambda i, a: [(i[2].dtype, schemas.shape_from_input(i[0]))],
    )
)

GATHER_ELEMENTS_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc).
        "GatherElementsGrad",
        inputs=(Formal("dY", FLOATS), Formal("shape", INT64), Formal("indices", INDICES)),
        outputs=(Formal("dX", FLOATS),),
        attributes=(Attribute("axis", "int", 0),),
        infer=lambda i, a: [(i[0].dtype, schemas.shape_from_input(i[1]))],
    )
)


@cpu_kernel("GatherGrad", domain=MICROSOFT)
def gather_grad(shape, indices, dY, *, axis=0):
    """dX of ``shape``: the slices of dY added at the gathered positions along ``axis``."""
    dX = np.zeros(shape_arg(shape), dtype=accumulation_dtype(np.asarray(dY).dtype))  # 0-d for an empty shape: refused there
    return _add_gathered(dX, indices, dY, axis, into_zeros=True).astype(dY.dtype, copy=False)


def gather_grad_added(data, shape, indices, dY, *, axis=0):
    """Sum(data, GatherGrad(shape, indices, dY, axis)) as one step (``executor.cpu_rewrites``: a
    tied embedding's Sum of its two gradients): dY's slices added into a copy of data where data
    has the table's shape and dY's float type (the additions into a row in another order than
    zeros, the slices, then data); else the Sum of the two, as before."""
    if not _adds_into(data, shape, dY):
        gathered = gather_grad(shape, indices, dY, axis=axis)
        if gathered.dtype != data.dtype:
            raise KernelError(f"Sum's inputs differ in type: {data.dtype} and {gathered.dtype}")
        return np.add(data, gathered)
    # a C-ordered copy: _add_gathered writes through a reshaped view of it (a copy of a transposed
    # data in its own order made that reshape a copy, and the additions were lost)
    return _add_gathered(np.array(data, copy=True, order="C"), indices, dY, axis)


def gather_grad_added_into(position, data, shape, indices, dY, *, axis=0):
    """``gather_grad_added`` written into data where it dies at the step (no copy of the
    vocabulary-sized array); None where it cannot be (another position, another shape or type)."""
    if position != 0 or not data.flags.writeable or not data.flags.c_contiguous or not _adds_into(data, shape, dY):
        return None
    return _add_gathered(data, indices, dY, axis)


def _adds_into(data: np.ndarray, shape, dY) -> bool:
    return data.dtype in (np.float32, np.float64) and data.dtype == np.asarray(dY).dtype and data.shape == tuple(shape_arg(shape))


def _add_gathered(out: np.ndarray, indices, dY, axis: int, into_zeros: bool = False) -> np.ndarray:
    """``out`` (C-ordered: its rows are written through a reshaped view) with dY's slices added at
    the positions ``indices`` names along ``axis`` (in place; ``into_zeros``: out holds zeros, so
    the per-position sums are stored rather than added)."""
    if not out.flags.c_contiguous:
        raise AssertionError("_add_gathered writes through a view: out must be C-ordered")
    dims = list(out.shape)
    if not dims:
        raise KernelError("shape is empty: Gather's data must have rank >= 1")
    axis = normalize_axis(axis, len(dims))
    size = dims[axis]
    idx = normalize_indices(indices, size, axis)
    dY = np.asarray(dY)
    want = tuple(dims[:axis]) + idx.shape + tuple(dims[axis + 1 :])
    if dY.shape != want:
        raise KernelError(
            f"dY has shape {list(dY.shape)}, but data shape {dims} gathered with indices of shape "
            f"{list(idx.shape)} along axis {axis} gives {list(want)}"
        )
    outer, inner, count = math.prod(dims[:axis]), math.prod(dims[axis + 1 :]), idx.size
    rows = out.reshape(outer, size, inner)
    if count and outer == 1 and inner:
        # rows of the first axis (an embedding's gradient): numpy's ufunc.at adds them in index
        # order, the order of the sort below (from a zero: only an all -0.0 row's sign differs)
        np.add.at(rows[0], idx.reshape(-1), dY.reshape(count, inner).astype(out.dtype, copy=False))
    elif count and outer and inner:
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")
        ordered = flat[order]
        first = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        parts = dY.reshape(outer, count, inner)[:, order, :].astype(out.dtype, copy=False)
        sums = np.add.reduceat(parts, first, axis=1)
        if into_zeros:
            rows[:, ordered[first], :] = sums
        else:
            rows[:, ordered[first], :] += sums
    return out


@cpu_kernel("GatherElementsGrad", domain=MICROSOFT)
def gather_elements_grad(dY, shape, indices, *, axis=0):
    """dX of ``shape``: dY[i] added at indices[i] along ``axis`` (the other coordinates kept)."""
    dims = shape_arg(shape)
    if not dims:
        raise KernelError("shape is empty: GatherElements' data must have rank >= 1")
    axis = normalize_axis(axis, len(dims))
    dY, indices = np.asarray(dY), np.asarray(indices)
    check_gather_elements_grad(dY.shape, dims, indices.shape, axis)
    idx = normalize_indices(indices, dims[axis], axis)
    strides = [math.prod(dims[d + 1 :]) for d in range(len(dims))]
    target = idx * strides[axis]
    for d, n in enumerate(indices.shape):
        if d != axis:
            view = [1] * len(dims)
            view[d] = n
            target = target + (np.arange(n, dtype=np.int64) * strides[d]).reshape(view)
    # bincount adds in float64, sequentially in element order: deterministic, and exact for double.
    sums = np.bincount(target.reshape(-1), weights=dY.reshape(-1).astype(np.float64), minlength=math.prod(dims))
    return sums.reshape(dims).astype(dY.dtype)


# ---------------------------------------------------------------------------------------------
# Prepared calls (kernels/table.py, ``cpu_prepare``) of the small-model indexing steps: the index
# arithmetic is kept per (data, indices) shape and the indices are checked with one reduction; a
# call whose indices are negative or out of range, or that the plan does not cover, runs the kernel
# (which wraps the negatives, or names the bad index). The same elements are read and written in
# the same order as by the kernels, so the results are the kernels' bit for bit.

SMALL_INDICES = 1 << 16  # index arrays up to this size get a kept flat offset per element (512 KiB)


def _all_below(indices: np.ndarray, size: int) -> bool:
    """Every entry of the integer array ``indices`` in [0, size): one reduction (negative entries
    read as huge unsigned ones)."""
    if indices.size == 0:
        return True
    unsigned = indices if indices.dtype.kind == "u" else indices.view(f"u{indices.dtype.itemsize}")
    return int(unsigned.max()) < size


@dataclasses.dataclass(frozen=True)
class _ElementsPlan:
    """GatherElements / ScatterElements for one (data, indices) shape: the flat position in the
    C-ordered data of element i is ``indices[i] * stride + base[i]``."""

    size: int  # data's length along the axis
    stride: int  # data's C stride along the axis, in elements
    base: np.ndarray  # int64, the indices' shape: the flat offset of the other coordinates
    distinct: bool  # one index per line along the axis: no two elements can hit the same target


def _elements_plan(key: tuple, axis: int) -> _ElementsPlan | None:
    """The plan for ``key`` = (data shape, indices shape), or None where the kernel must check."""
    data_shape, idx_shape = key
    rank = len(data_shape)
    if len(idx_shape) != rank or not -rank <= axis < rank or math.prod(idx_shape) > SMALL_INDICES:
        return None
    axis %= rank
    if any(n > m for d, (n, m) in enumerate(zip(idx_shape, data_shape)) if d != axis):
        return None
    strides = [math.prod(data_shape[d + 1 :]) for d in range(rank)]
    base = np.zeros(idx_shape, dtype=np.int64)
    for d, n in enumerate(idx_shape):
        if d != axis:
            base += (np.arange(n, dtype=np.int64) * strides[d]).reshape((n,) + (1,) * (rank - 1 - d))
    base.flags.writeable = False
    return _ElementsPlan(data_shape[axis], strides[axis], base, idx_shape[axis] == 1)


def _flat_targets(plan: _ElementsPlan, indices: np.ndarray) -> np.ndarray | None:
    """The flat positions the indices address, or None when one is negative or out of range."""
    if indices.dtype.kind not in "iu" or not _all_below(indices, plan.size):
        return None
    flat = np.multiply(indices, plan.stride, dtype=np.int64)
    flat += plan.base
    return flat.reshape(-1)


@cpu_prepare("Gather")
def prepare_gather(constants: tuple, attrs: dict):
    """np.take itself, which wraps negative indices as ONNX does and raises IndexError for the
    others (then the kernel names the bad one)."""
    axis = attrs.get("axis", 0)

    def run(data, indices):
        if indices.dtype.kind in "iu" and -data.ndim <= axis < data.ndim:
            try:
                return np.take(data, indices, axis=axis)
            except IndexError:
                pass
        return gather(data, indices, axis=axis)

    return run


GATHER_ND_PROBE_LIMIT = 1 << 20  # data elements up to which a constant-index GatherND keeps its positions


@cpu_prepare("GatherND")
def prepare_gather_nd(constants: tuple, attrs: dict):
    """With plan-time indices (a mask built by index arithmetic on shapes, as transformers builds
    attention masks): the flat positions it reads, per data shape, found by running the kernel once
    on the positions themselves (``arange``), so its checks and semantics stay the kernel's; a call
    is then one ``np.take``. Data above ``GATHER_ND_PROBE_LIMIT`` elements, and indices the kernel
    refuses, run the kernel (which raises its error)."""
    known = constant_inputs(constants, 1)
    fixed = known[0] if known is not None and isinstance(known[0], np.ndarray) else None
    if fixed is None:
        return None
    batch_dims = attrs.get("batch_dims", 0)

    def positions_for(shape: tuple):
        size = math.prod(shape)
        if size > GATHER_ND_PROBE_LIMIT:
            return False
        try:
            return gather_nd(np.arange(size, dtype=np.int64).reshape(shape), fixed, batch_dims=batch_dims)
        except KernelError:
            return False

    positions = per_shape(positions_for)

    def run(data, indices):
        found = positions(data.shape) if indices is fixed else False
        if found is False:
            return gather_nd(data, indices, batch_dims=batch_dims)
        return np.take(data.reshape(-1), found)

    return run


@cpu_prepare("GatherElements")
def prepare_gather_elements(constants: tuple, attrs: dict):
    axis = attrs.get("axis", 0)
    plans = per_shape(functools.partial(_elements_plan, axis=axis))

    def run(data, indices):
        plan = plans((data.shape, indices.shape))
        flat = _flat_targets(plan, indices) if plan is not None else None
        if flat is None:
            return gather_elements(data, indices, axis=axis)
        return np.take(data.reshape(-1), flat).reshape(indices.shape)

    return run


@cpu_prepare("ScatterElements", "Scatter")
def prepare_scatter_elements(constants: tuple, attrs: dict):
    axis, reduction = attrs.get("axis", 0), attrs.get("reduction", "none")
    if reduction != "none" and reduction not in _REDUCTIONS:
        return None  # the kernel says why
    plans = per_shape(functools.partial(_elements_plan, axis=axis))
    known = constant_inputs(constants, 1)
    fixed_indices = known[0] if known is not None and isinstance(known[0], np.ndarray) else None
    # plan-time indices (a lowered SliceGrad's): their targets and last writers, once per data shape
    fixed_targets = per_shape(lambda key: _last_writes(plans(key), fixed_indices))

    def run(data, indices, updates):
        plan = plans((data.shape, indices.shape)) if updates.shape == indices.shape else None
        if plan is not None and reduction == "none":
            key = (data.shape, indices.shape)
            targets = fixed_targets(key) if indices is fixed_indices else _last_writes(plan, indices)
            if targets is None:
                return scatter_elements(data, indices, updates, axis=axis, reduction=reduction)
            out = _writable_copy(data)
            out.reshape(-1)[targets[0]] = _as_dtype_of(updates, out).reshape(-1)[targets[1]]
            return out
        flat = _flat_targets(plan, indices) if plan is not None else None
        if flat is None:
            return scatter_elements(data, indices, updates, axis=axis, reduction=reduction)
        out = _writable_copy(data)
        _REDUCTIONS[reduction].at(out.reshape(-1), flat, _as_dtype_of(updates, out).reshape(-1))
        return out

    return run


def _last_writes(plan: _ElementsPlan | None, indices: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | slice] | None:
    """(flat targets, positions in the update order) of the update that lands last on each target
    (every update where no two share a target), or None where the indices are negative or out of
    range (the kernel then says which)."""
    flat = _flat_targets(plan, indices) if plan is not None and indices is not None else None
    if plan is None or flat is None:
        return None
    if plan.distinct:
        return flat, slice(None)
    keep = _last_wins(flat)
    return flat[keep], keep


def _row_size(data_shape: tuple) -> int:
    return math.prod(data_shape[1:])


# ScatterND's row indices up to this many are checked for repeats: distinct rows take one
# vectorised update of the rows (a ViT's q/k/v gradient, one (65, 2, 64) slab into three: 26-29 -> 9-12 us)
# instead of ``ufunc.at``'s element by element one
DISTINCT_ROWS_CHECKED = 64
_ROWS_ONE_BY_ONE = 8  # up to this many distinct rows are updated in place one by one, more by one gather


def _update_rows(ufunc, rows: np.ndarray, hit: list[int], updates: np.ndarray) -> None:
    """``rows[r] = ufunc(rows[r], update)`` for each distinct row ``r`` of ``hit`` and its update:
    in place row by row for a few rows (no gathered copy), else through one gather and scatter."""
    if len(hit) <= _ROWS_ONE_BY_ONE:
        for row, update in zip(hit, updates):
            target = rows[row]
            ufunc(target, update, out=target)
    else:
        rows[hit] = ufunc(rows[hit], updates)


def _distinct_rows(indices: np.ndarray, rows: int) -> list[int] | None:
    """The row indices (negative ones wrapped), where each is in [-rows, rows) and no two name the
    same row; else None (the general path applies the repeats in order, or says which is bad)."""
    wrapped = [r + rows if r < 0 else r for r in indices.reshape(-1).tolist()]
    if not all(0 <= r < rows for r in wrapped) or len(set(wrapped)) != len(wrapped):
        return None
    return wrapped


@cpu_prepare("ScatterND")
def prepare_scatter_nd(constants: tuple, attrs: dict):
    """ScatterND with a reduction and indices of one component (rows of the data, as an embedding's
    gradient has them): ``ufunc.at`` on the flat positions of the rows' elements, which applies the
    updates to each element in the kernel's order. A row index ``r`` in [-rows, rows) gives a flat
    position that numpy wraps to row ``r % rows`` and any other raises IndexError, as ONNX wants."""
    reduction = attrs.get("reduction", "none")
    if reduction not in _REDUCTIONS:
        return None
    ufunc = _REDUCTIONS[reduction]
    inner_size = per_shape(_row_size)

    def run(data, indices, updates):
        rows = indices.shape[:-1]
        if (
            indices.ndim >= 1
            and indices.shape[-1] == 1
            and data.ndim >= 1
            and indices.dtype.kind == "i"
            and updates.shape == rows + data.shape[1:]
        ):
            inner = inner_size(data.shape)
            rows_hit = _distinct_rows(indices, data.shape[0]) if indices.size <= DISTINCT_ROWS_CHECKED else None
            if rows_hit is not None:
                out = _writable_copy(data)
                _update_rows(ufunc, out.reshape(data.shape[0], inner), rows_hit, _as_dtype_of(updates, out).reshape(-1, inner))
                return out
            flat = np.multiply(indices, inner, dtype=np.int64)
            if inner > 1:
                flat = flat + np.arange(inner, dtype=np.int64)
            out = _writable_copy(data)
            try:
                ufunc.at(out.reshape(-1), flat.reshape(-1), _as_dtype_of(updates, out).reshape(-1))
                return out
            except IndexError:
                pass
        return scatter_nd(data, indices, updates, reduction=reduction)

    return run


@cpu_into("ScatterND")
def scatter_nd_into(position, data, indices, updates, *, reduction="none"):
    """ScatterND with a reduction written into ``data`` where it dies at the step (an embedding's
    gradient: the zeros it starts from are not copied), for row indices all in range and a data
    array of numpy's own dtype instance (``_writable_copy``); the kernel's ``ufunc.at`` call, so
    the same bits. None (nothing written) otherwise."""
    ufunc = _REDUCTIONS.get(reduction)
    rows = indices.shape[:-1]
    if (
        position != 0
        or ufunc is None
        or indices.ndim < 1
        or indices.shape[-1] != 1
        or data.ndim < 1
        or indices.dtype.kind != "i"
        or updates.shape != rows + data.shape[1:]
        or data.dtype is not _canonical(data.dtype)
        or not _rows_in_range(indices, data.shape[0])
    ):
        return None
    inner = _row_size(data.shape)
    flat = np.multiply(indices, inner, dtype=np.int64)
    if inner > 1:
        flat = flat + np.arange(inner, dtype=np.int64)
    ufunc.at(data.reshape(-1), flat.reshape(-1), _as_dtype_of(updates, data).reshape(-1))
    return data


def _rows_in_range(indices: np.ndarray, rows: int) -> bool:
    """Every index in [-rows, rows) (checked before an in-place scatter writes anything)."""
    return not indices.size or (-rows <= int(indices.min()) and int(indices.max()) < rows)


@cpu_kernel("Unique")
def unique(x, *, axis=None, sorted=1, _num_outputs=4):  # noqa: A002 - the ONNX attribute's name
    """Y, the first occurrence of each in X (``indices``), where each element of X went
    (``inverse_indices``) and the counts; in ascending order (sorted=1) or in the order of first
    occurrence (sorted=0). Without an axis, X is flattened."""
    data = np.asarray(x)
    if axis is not None:
        axis = normalize_axis(axis, data.ndim)
    values, first, inverse, counts = np.unique(
        data if axis is not None else data.reshape(-1), return_index=True, return_inverse=True, return_counts=True, axis=axis
    )
    inverse = inverse.reshape(-1)
    if not int(sorted):
        order = np.argsort(first, kind="stable")
        values = np.take(values, order, axis=axis if axis is not None else 0)
        first, counts = first[order], counts[order]
        inverse = np.argsort(order)[inverse]
    results = (values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64))
    return results[: int(_num_outputs)] if int(_num_outputs) > 1 else results[0]


# ---------------------------------------------------------------------------------------------
# NonMaxSuppression


@dataclasses.dataclass(frozen=True)
class NmsSettings:
    """NonMaxSuppression's scalar inputs and attribute, checked (numpy scalars keep the thresholds'
    dtypes, so that they compare as ONNX's reference compares them)."""

    limit: int  # boxes kept per (batch, class) at most
    iou_threshold: np.generic  # a candidate goes when its IoU with a kept box is above it
    score_threshold: np.generic | None  # boxes scoring no more are no candidates (None: all are)
    center_point_box: int  # 0: boxes are [y1, x1, y2, x2]; 1: [x_center, y_center, width, height]


def nms_settings(boxes_shape, scores_shape, max_output_boxes_per_class, iou_threshold, score_threshold, center_point_box):
    """The checked ``NmsSettings`` of boxes and scores of these shapes; an absent or empty scalar
    input takes the spec's default (no boxes, IoU threshold 0, no score threshold)."""
    if len(boxes_shape) != 3 or boxes_shape[2] != 4:
        raise KernelError(f"boxes must have shape [num_batches, spatial_dimension, 4], got {list(boxes_shape)}")
    if len(scores_shape) != 3 or (scores_shape[0], scores_shape[2]) != (boxes_shape[0], boxes_shape[1]):
        raise KernelError(
            f"scores must have shape [num_batches, num_classes, spatial_dimension] = [{boxes_shape[0]}, *, {boxes_shape[1]}] "
            f"for boxes {list(boxes_shape)}, got {list(scores_shape)}"
        )
    if int(center_point_box) not in (0, 1):
        raise KernelError(f"center_point_box must be 0 or 1, got {center_point_box}")
    limit = _nms_scalar(max_output_boxes_per_class, "max_output_boxes_per_class")
    iou = _nms_scalar(iou_threshold, "iou_threshold")
    return NmsSettings(
        limit=0 if limit is None else max(int(limit), 0),
        iou_threshold=np.float32(0) if iou is None else iou,
        score_threshold=_nms_scalar(score_threshold, "score_threshold"),
        center_point_box=int(center_point_box),
    )


def _nms_scalar(value, name: str) -> np.generic | None:
    """The one value of an optional scalar input; None where it is absent or empty."""
    if value is None or np.size(value) == 0:
        return None
    if np.size(value) != 1:
        raise KernelError(f"{name} must hold one value, got shape {list(np.shape(value))}")
    return np.asarray(value).reshape(-1)[0]


def _nms_corners(boxes: np.ndarray, center_point_box: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lows, highs, areas): each box's lower and upper (y, x) corners and its area, with ONNX's
    reference's arithmetic (so its bits): [y1, x1, y2, x2] boxes order the two ends of each axis
    (the reference's max_min), [x_center, y_center, width, height] ones are the centre -+ half the
    size; area = (x_max - x_min) * (y_max - y_min)."""
    if center_point_box:
        centre, half = boxes[..., 1::-1], boxes[..., :1:-1] / 2  # (y, x) order
        lows, highs = centre - half, centre + half
    else:
        first, second = boxes[..., :2], boxes[..., 2:]
        swap = first >= second
        lows, highs = np.where(swap, second, first), np.where(swap, first, second)
    with np.errstate(all="ignore"):
        extents = highs - lows
        return lows, highs, extents[..., 1] * extents[..., 0]


def _nms_overlapping(lows, highs, areas, top_low, top_high, top_area, threshold) -> np.ndarray:
    """The reference's suppress_by_iou(candidate, kept box) for every candidate (rows of lows,
    highs, areas) against one kept box: the intersection's extents, its area, both areas and the
    union positive, and intersection / union above the threshold. Python's max and min (the first
    argument unless the second is larger / smaller) keep the reference's results for NaN."""
    low = np.where(top_low > lows, top_low, lows)
    high = np.where(top_high < highs, top_high, highs)
    with np.errstate(all="ignore"):
        extents = high - low
        inter = extents[:, 1] * extents[:, 0]
        union = areas + top_area - inter
        ratio = inter / union
    positive = ~(high <= low).any(axis=1) & ~(inter <= 0) & ~(areas <= 0) & ~(top_area <= 0) & ~(union <= 0)
    return positive & (ratio > threshold)


def _nms_keep(lows, highs, areas, candidates: np.ndarray, settings: NmsSettings) -> np.ndarray:
    """The greedy selection over ``candidates`` (box indices, best first): each one not suppressed
    by a box kept before it is kept, up to the limit; a kept box suppresses the later candidates
    that overlap it (``_nms_overlapping``)."""
    alive = np.ones(candidates.size, dtype=bool)
    kept: list[int] = []
    for rank in range(candidates.size):
        if len(kept) == settings.limit:
            break
        if not alive[rank]:
            continue
        top = candidates[rank]
        kept.append(int(top))
        later = rank + 1 + np.flatnonzero(alive[rank + 1 :])
        boxes = candidates[later]
        overlap = _nms_overlapping(
            lows[boxes], highs[boxes], areas[boxes], lows[top], highs[top], areas[top], settings.iou_threshold
        )
        alive[later[overlap]] = False
    return np.array(kept, dtype=np.int64)


@cpu_kernel("NonMaxSuppression")
def non_max_suppression(
    boxes, scores, max_output_boxes_per_class=None, iou_threshold=None, score_threshold=None, *, center_point_box=0
):
    """int64 rows (batch, class, box) of the boxes kept, per batch, per class, best score first:
    ONNX's reference's greedy selection. A (batch, class) pair's candidates are its boxes scoring
    above score_threshold (all, without one) by descending score (equal scores by box index, NaN
    scores last); each is kept unless its IoU with a box kept before it is above iou_threshold,
    until max_output_boxes_per_class are kept. Corners and areas are computed once per box; a kept
    box is tested against all later candidates at once."""
    boxes, scores = np.asarray(boxes), np.asarray(scores)
    settings = nms_settings(
        boxes.shape, scores.shape, max_output_boxes_per_class, iou_threshold, score_threshold, center_point_box
    )
    rows = [np.zeros((0, 3), dtype=np.int64)]
    if settings.limit == 0:
        return rows[0]
    lows, highs, areas = _nms_corners(boxes, settings.center_point_box)
    for batch, cls in np.ndindex(scores.shape[:2]):
        line = scores[batch, cls]
        candidates = np.argsort(-line, kind="stable")  # -0 ties +0; NaN last
        if settings.score_threshold is not None:
            candidates = candidates[line[candidates] > settings.score_threshold]
        kept = _nms_keep(lows[batch], highs[batch], areas[batch], candidates, settings)
        rows.append(np.stack([np.full_like(kept, batch), np.full_like(kept, cls), kept], axis=1))
    return np.concatenate(rows)
