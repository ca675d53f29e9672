"""CUDA launchers: shape ops and data movement (shape.cu), and the com.microsoft SliceGrad.

Everything here is built on two kernels: a strided copy (``dst[...] = src[offset + sum c_k * s_k]``,
strides may be 0 or negative) and a one-pass "lattice" kernel (each output element is either read
from the input, when it lies on the lattice start + q * step of every axis, or a fill value): Slice,
Transpose, Expand, Tile, Concat and Split are strided copies; constant Pad, CenterCropPad (a Pad
whose negative widths crop) and SliceGrad (below) are lattices. The kernels move bits: they are
chosen by element width, and runs of contiguous elements are moved as 16-byte words where sizes and
alignment allow.

Reshape, Flatten, Squeeze and Unsqueeze copy nothing: they return a GPUArray that shares the
input's memory (``GPUArray.reshape`` keeps a reference to its base array in ``.base``, so the
executor dropping the input's name cannot free memory the view still uses). Identity returns its
input (Identity is registered with the elementwise launchers). Shape and Size answer on the host.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import shape as cpu_shape
from gradgen.kernels.cuda.launch import (
    INT32_LIMIT,
    coalesce,
    contiguous,
    copy_into,
    desc,
    element_strides,
    extent,
    fill,
    fill_bits,
    grid_for,
    host_key,
    kernel_of,
    launch,
    launch_packed,
    plan_cache,
    raw,
    runtime,
    strided_copy,
)
from gradgen.kernels.numeric import shape_arg
from gradgen.kernels.table import MICROSOFT, cuda_kernel
from gradgen.ops.axes import int_list, normalize_axes, normalize_axis
from gradgen.ops.shape import concat_shape, depth_to_space_plan, reshape_dims, shape_bounds, slice_geometry, space_to_depth_plan

_VECTOR = {2: 8, 4: 4, 8: 2}


def _magic(d: int) -> tuple[int, int] | None:
    """(multiplier, shift) with n // d == (umulhi(n, m) + n) >> shift for 0 <= n < 2**31, or None."""
    shift = max(0, (int(d) - 1).bit_length())
    m = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return (m, shift) if 0 < m < (1 << 32) else None


_PTRS2 = struct.Struct("=QQ")


def lattice_plan(shape, esize: int, starts, steps, counts, src_strides, fill, aligned: bool = True):
    """What a lattice launch over a C-contiguous output of ``shape`` needs besides the two addresses:
    (kernel, grid, the packed arguments after (dst, src)). ``aligned``: the output is 16-byte aligned."""
    rt = runtime()
    shape = [int(d) for d in shape] or [1]
    if len(shape) != len(starts):
        starts, steps, counts, src_strides = [0], [1], [1], [0]
    if len(shape) > rt.MAX_RANK:
        raise KernelError(f"rank {len(shape)} exceeds the CUDA kernels' maximum of {rt.MAX_RANK}")
    if esize not in (1, 2, 4, 8):
        raise KernelError(f"elements of {esize} bytes are not supported by the CUDA copy kernels")
    v = _VECTOR.get(esize, 1)
    if shape[-1] % v or not aligned:
        v = 1
    if math.prod(counts) == 0:
        counts = [0] * len(shape)
    size = math.prod(shape)
    n = size // v
    magic = [_magic(d) for d in shape[:-1] + [shape[-1] // v]]
    small = size <= INT32_LIMIT and extent(counts, src_strides) <= INT32_LIMIT and None not in magic
    pairs = [p for p in magic if p is not None] if small else [(0, 0)] * len(shape)
    kernel = kernel_of("shape", f"lattice_w{esize}_v{v}_{'int32' if small else 'int64'}")
    tail = b"".join(
        bytes(memoryview(d))
        for d in (desc(shape), desc(counts, src_strides), desc(starts, steps), desc([m for m, _ in pairs], [s for _, s in pairs]))
    )
    tail += struct.pack("=qq", int(fill), n)
    return kernel, grid_for(n), tail


def lattice(out, src, src_off, starts, steps, counts, src_strides, fill) -> None:
    """One pass over ``out``: element c = src[src_off + q . src_strides] where c_k = starts_k + q_k * steps_k
    (0 <= q_k < counts_k) on every axis, ``fill`` (an int64 of the value's bits) elsewhere."""
    if out.size == 0:
        return
    esize = out.dtype.itemsize
    kernel, grid, tail = lattice_plan(out.shape, esize, starts, steps, counts, src_strides, fill, int(out.gpudata) % 16 == 0)
    src_addr = 0 if math.prod(counts) == 0 else int(src.gpudata) + int(src_off) * esize
    launch_packed(kernel, grid, 256, _PTRS2.pack(int(out.gpudata), src_addr) + tail)


def reshaped(x, shape):
    """``x`` with a new shape, sharing memory (the view keeps ``x`` alive through ``.base``)."""
    shape = tuple(int(d) for d in shape)
    if x.size == 0:
        return runtime().empty(shape, x.dtype)
    return contiguous(x).reshape(shape)


# ---------------------------------------------------------------- no-copy ops


@cuda_kernel("Constant")
def constant(**attrs):
    """The CPU kernel's tensor, a float one uploaded (integer and bool ones stay on the host, as
    integer initializers do). A Session folds Constant nodes at plan time; this runs only where
    one was not folded."""
    value = cpu_shape.constant(**attrs)
    return runtime().to_device(value) if value.dtype.kind not in "biu" else value


@cuda_kernel("Shape")
def shape(data, *, start=0, end=None):
    start, end = shape_bounds(len(data.shape), start, end)
    return np.array(data.shape[start:end], dtype=np.int64)


@cuda_kernel("Size")
def size(data):
    return np.array(math.prod(data.shape), dtype=np.int64)


@cuda_kernel("Reshape", host_inputs=(1,))
def reshape(data, shape=None, *, allowzero=0):
    if shape is None:
        raise KernelError("Reshape needs the shape input")
    return reshaped(data, reshape_dims(data.shape, int_list(shape, "shape"), allowzero))


@cuda_kernel("Flatten")
def flatten(x, *, axis=1):
    rank = len(x.shape)
    if not -rank <= axis <= rank:
        raise KernelError(f"axis {axis} is out of range [{-rank}, {rank}]")
    axis = axis + rank if axis < 0 else axis
    return reshaped(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@cuda_kernel("Squeeze", host_inputs=(1,))
def squeeze(data, axes=None):
    if axes is None:
        return reshaped(data, [d for d in data.shape if d != 1])
    normalised = normalize_axes(int_list(axes, "axes"), len(data.shape))
    for a in normalised:
        if data.shape[a] != 1:
            raise KernelError(f"cannot squeeze axis {a} of size {data.shape[a]} (shape {list(data.shape)})")
    return reshaped(data, [d for k, d in enumerate(data.shape) if k not in normalised])


@cuda_kernel("Unsqueeze", host_inputs=(1,))
def unsqueeze(data, axes=None):
    if axes is None:
        raise KernelError("Unsqueeze needs axes")
    axes = int_list(axes, "axes")
    rank = len(data.shape) + len(axes)
    normalised = set(normalize_axes(axes, rank))
    dims, rest = [], iter(data.shape)
    for k in range(rank):
        dims.append(1 if k in normalised else next(rest))
    return reshaped(data, dims)


# ---------------------------------------------------------------- copies


@cuda_kernel("Transpose")
def transpose(data, *, perm=None):
    rt = runtime()
    rank = len(data.shape)
    perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
    if sorted(perm) != list(range(rank)):
        raise KernelError(f"perm {perm} is not a permutation of the {rank} axes")
    shape = [data.shape[p] for p in perm]
    strides = element_strides(data)
    out = rt.empty(shape, data.dtype)
    copy_into(out, data, shape, [strides[p] for p in perm])
    return out


@cuda_kernel("Slice", host_inputs=(1, 2, 3, 4))
def slice_(data, starts=None, ends=None, axes=None, steps=None):
    rt = runtime()
    if starts is None or ends is None:
        raise KernelError("Slice needs starts and ends")
    geometry = slice_geometry(data.shape, starts, ends, axes, steps)
    shape = [count for _, _, count in geometry]
    out = rt.empty(shape, data.dtype)
    if out.size:
        strides = element_strides(data)
        offset = sum(start * s for (start, _, _), s in zip(geometry, strides))
        copy_into(out, data, shape, [step * s for (_, step, _), s in zip(geometry, strides)], offset)
    return out


@cuda_kernel("Expand", host_inputs=(1,))
def expand(x, shape):
    rt = runtime()
    dims = int_list(shape, "shape")
    target = list(cpu_shape.broadcast_shape(tuple(x.shape), tuple(dims), "Expand"))
    if tuple(target) == tuple(x.shape):
        return x
    out = rt.empty(target, x.dtype)
    lead = len(target) - len(x.shape)
    strides = [0] * lead + [0 if d == 1 else s for d, s in zip(x.shape, element_strides(x))]
    copy_into(out, x, target, strides)
    return out


@cuda_kernel("Tile", host_inputs=(1,))
def tile(x, repeats):
    rt = runtime()
    reps = int_list(repeats, "repeats")
    rank = len(x.shape)
    if len(reps) != rank:
        raise KernelError(f"repeats has {len(reps)} entries, the input has rank {rank}")
    if any(r < 0 for r in reps):
        raise KernelError(f"repeats {reps} must be non-negative")
    out_shape = [d * r for d, r in zip(x.shape, reps)]
    out = rt.empty(out_shape, x.dtype)
    if out.size == 0:
        return out
    # The output viewed as (r0, d0, r1, d1, ...) is C-contiguous; read the input with stride 0 on r_k.
    shape, strides = [], []
    for d, r, s in zip(x.shape, reps, element_strides(x)):
        shape += [r, d]
        strides += [0, s]
    coalesced, _ = coalesce(shape, strides, rt.contiguous_strides(shape))
    if len(coalesced) <= rt.MAX_RANK:
        copy_into(out, x, shape, strides)
        return out
    current = x  # too many axes at once: tile one axis at a time
    for k, r in enumerate(reps):
        if r == 1:
            continue
        cur_shape = list(current.shape)
        nxt = rt.empty(cur_shape[:k] + [cur_shape[k] * r] + cur_shape[k + 1 :], x.dtype)
        view = cur_shape[:k] + [r] + cur_shape[k:]
        st = element_strides(current)
        copy_into(nxt, current, view, st[:k] + [0] + st[k:])
        current = nxt
    return current


@cuda_kernel("Concat")
def concat(*inputs, axis):
    rt = runtime()
    arrays = [x for x in inputs if x is not None]
    ax, out_shape = concat_shape([x.shape for x in arrays], [x.dtype for x in arrays], axis)
    out = rt.empty(out_shape, arrays[0].dtype)
    out_strides = rt.contiguous_strides(out_shape)
    offset = 0
    for x in arrays:
        if x.size:
            strided_copy(out, out_strides, offset * out_strides[ax], x, element_strides(x), 0, x.shape)
        offset += x.shape[ax]
    return out


@cuda_kernel("Split", host_inputs=(1,))
def split(x, split=None, *, axis=0, num_outputs=None, _num_outputs=1):
    rt = runtime()
    ax = normalize_axis(axis, len(x.shape))
    n = x.shape[ax]
    sizes = cpu_shape.split_sizes(n, ax, split, num_outputs, _num_outputs)
    strides = element_strides(x)
    outs, offset = [], 0
    for size_ in sizes:
        shape_ = list(x.shape)
        shape_[ax] = size_
        out = rt.empty(shape_, x.dtype)
        if out.size:
            copy_into(out, x, shape_, strides, offset * strides[ax])
        outs.append(out)
        offset += size_
    return tuple(outs)


@cuda_kernel("Pad", host_inputs=(1, 3))
def pad(data, pads=None, constant_value=None, axes=None, *, mode="constant", value=0.0, paddings=None):
    rt = runtime()
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode != "constant":
        from gradgen.kernels.cpu.shape import pad as cpu_pad

        cv = None if constant_value is None else rt.to_host(constant_value)
        return rt.to_device(cpu_pad(data.get(), pads, cv, axes, mode=mode, value=value, paddings=paddings))
    if pads is None:
        pads = paddings
    if pads is None:
        raise KernelError("Pad needs pads")
    width = cpu_shape.pad_widths(data.shape, pads, axes)
    cv = None if constant_value is None else rt.to_host(constant_value)
    fill_value = value if cv is None or np.size(cv) == 0 else np.asarray(cv).reshape(-1)[0]
    return _constant_pad(data, width, fill_value)


def _constant_pad(data, width, fill_value):
    """``data`` padded with ``fill_value`` by ``width`` ([begin, end] per axis; negative: cropped):
    one lattice pass over the output."""
    rt = runtime()
    rank = len(data.shape)
    x = contiguous(data)
    strides = element_strides(x) if rank else []
    starts, counts, out_shape, src_off = [], [], [], 0
    for d, (src, start, count, length) in enumerate(cpu_shape.pad_copy_geometry(x.shape, width)):
        src_off += src * strides[d]
        starts.append(start)
        counts.append(count)
        out_shape.append(length)
    out = rt.empty(out_shape, data.dtype)
    lattice(out, x, src_off, starts, [1] * rank, counts, strides, fill_bits(fill_value, data.dtype))
    return out


@cuda_kernel("CenterCropPad", host_inputs=(1,))
def center_crop_pad(x, shape, *, axes=None):
    """X cropped or zero-padded to ``shape`` along ``axes``, centred: a constant Pad with the CPU
    kernel's widths (negative ones crop), so one lattice pass."""
    return _constant_pad(x, cpu_shape.center_crop_pad_widths(x.shape, shape, axes), 0)


@cuda_kernel("Trilu", host_inputs=(1,))
def trilu(x, k=None, *, upper=1):
    rt = runtime()
    if len(x.shape) < 2:
        raise KernelError(f"Trilu needs rank >= 2, got {len(x.shape)}")
    kk = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    x = contiguous(x)
    out = rt.empty(x.shape, x.dtype)
    if out.size:
        rows, cols = x.shape[-2:]
        launch(
            kernel_of("shape", f"trilu_w{x.dtype.itemsize}"),
            out.size,
            out,
            x,
            np.int64(rows),
            np.int64(cols),
            np.int64(kk),
            np.int64(1 if upper else 0),
            np.int64(out.size),
        )
    return out


@cuda_kernel("ConstantOfShape", host_inputs=(0,))
def constant_of_shape(shape, *, value=None):
    rt = runtime()
    dims = int_list(shape, "shape")
    if any(d < 0 for d in dims):
        raise KernelError(f"shape {dims} has a negative dimension")
    if value is None:
        value = np.zeros(1, np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise KernelError(f"value must hold one element, got {value.size}")
    out = rt.empty(dims, value.dtype)
    fill(out, value.reshape(-1)[0])
    return out


# ---------------------------------------------------------------- block rearrangements


def _block_rearrange(x, blocked_shape, perm, out_shape):
    """Reshape to ``blocked_shape`` (a view), transpose by ``perm`` (one strided copy), reshape."""
    return reshaped(transpose(reshaped(x, blocked_shape), perm=perm), out_shape)


@cuda_kernel("DepthToSpace")
def depth_to_space(x, *, blocksize, mode="DCR"):
    return _block_rearrange(x, *depth_to_space_plan(x.shape, blocksize, mode))


@cuda_kernel("SpaceToDepth")
def space_to_depth(x, *, blocksize, mode="DCR"):
    return _block_rearrange(x, *space_to_depth_plan(x.shape, blocksize, mode))


# ---------------------------------------------------------------- SliceGrad


_SG_PLANS: dict = {}
_PTRS2 = struct.Struct("=QQ")


def _slice_grad_plan(dy_shape, dtype, shape, starts, ends, axes, steps, aligned=True):
    """(dX dims, lattice kernel or None, grid, packed arguments after (dX, dY)); validates everything."""
    dims = shape_arg(shape)
    geometry = slice_geometry(dims, starts, ends, axes, steps)
    lat_start, lat_step, counts = (list(column) for column in zip(*geometry)) if dims else ([], [], [])
    if math.prod(counts) != math.prod(dy_shape):
        raise KernelError(f"dY has shape {list(dy_shape)}, but the slice of shape {dims} has shape {counts}")
    if math.prod(dims) == 0:
        return tuple(dims), None, 0, b""
    kernel, grid, tail = lattice_plan(
        dims, np.dtype(dtype).itemsize, lat_start, lat_step, counts, runtime().contiguous_strides(counts), np.int64(0), aligned
    )
    return tuple(dims), raw(kernel), grid, tail


@cuda_kernel("SliceGrad", domain=MICROSOFT, host_inputs=(1, 2, 3, 4, 5))
def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    """One pass over dX (the lattice kernel with fill 0): every element written once, no memset."""
    rt = runtime()
    key = (dY.shape, dY.dtype, host_key(shape), host_key(starts), host_key(ends), host_key(axes), host_key(steps))
    dims, kernel, grid, tail = plan_cache(
        _SG_PLANS, key, lambda: _slice_grad_plan(dY.shape, dY.dtype, shape, starts, ends, axes, steps)
    )
    dX = rt.empty(dims, dY.dtype)
    if kernel is None:
        return dX
    src, dy = 0, dY
    if dY.size:
        dy = dY if dY.flags.c_contiguous else contiguous(dY)
        src = int(dy.gpudata)
    dst = int(dX.gpudata)
    if dst % 16:  # the plan assumed a 16-byte aligned dX (pool allocations are)
        _, kernel, grid, tail = _slice_grad_plan(dY.shape, dY.dtype, shape, starts, ends, axes, steps, False)
    launch_packed(kernel, grid, 256, _PTRS2.pack(dst, src) + tail)
    return dX


# ---------------------------------------------------------------- Range


_RANGE_TYPES = ("f16", "bf16", "f32", "f64", "i32", "i64")


@cuda_kernel("Range", host_inputs=(0, 1, 2))
def range_(start, limit, delta, *, stash_type=1):
    """start + i * delta for i < ceil((limit - start) / delta): the count on the host (the CPU
    kernel's arithmetic), the values on the device. 16-bit floats are computed in float32 and rounded
    once, as the CPU backend computes them."""
    from gradgen.kernels.cuda.launch import cpu_fallback, dtype_suffix

    rt = runtime()
    for v, name in ((start, "start"), (limit, "limit"), (delta, "delta")):
        if np.size(v) != 1:
            raise KernelError(f"{name} must be a scalar, got shape {list(np.shape(v))}")
    dtype = np.dtype(start.dtype)
    suffix = dtype_suffix(dtype)
    if suffix not in _RANGE_TYPES:
        return cpu_fallback("Range", start, limit, delta, stash_type=stash_type)
    work = np.float32 if suffix in ("f16", "bf16") else dtype
    s, l, d = (np.asarray(v).astype(work).reshape(()).item() for v in (start, limit, delta))
    if d == 0:
        raise KernelError("delta is 0")
    n = max(int(np.ceil((l - s) / d)), 0)
    out = rt.empty((n,), dtype)
    scalar = np.float64 if suffix[0] in "fb" else np.int64
    launch(kernel_of("shape", f"range_{suffix}"), n, out, scalar(s), scalar(d), np.int64(n))
    return out


# ---------------------------------------------------------------- ReverseSequence


def _word_width(esize: int, inner: int, *arrays) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes, a multiple of the element size) that runs of ``inner``
    elements split into and that every array's address is aligned to."""
    run = esize * inner
    for w in (16, 8, 4, 2, 1):
        if w % esize == 0 and run % w == 0 and all(int(a.gpudata) % w == 0 for a in arrays):
            return w
    return esize


@cuda_kernel("ReverseSequence")
def reverse_sequence(x, sequence_lens, *, batch_axis=1, time_axis=0):
    """The first sequence_lens[b] steps of each batch entry b reversed along the time axis: one gather
    pass moving contiguous runs of the trailing axes as wide words. A length outside [0, steps]
    raises the CPU kernel's error."""
    from gradgen.kernels.cuda.launch import cpu_fallback

    rt = runtime()
    if {int(batch_axis), int(time_axis)} != {0, 1}:
        raise KernelError(f"batch_axis and time_axis must be 0 and 1 in some order, got {batch_axis} and {time_axis}")
    if len(x.shape) < 2:
        raise KernelError(f"ReverseSequence needs rank >= 2, got {len(x.shape)}")
    steps, batch = int(x.shape[int(time_axis)]), int(x.shape[int(batch_axis)])
    count = math.prod(sequence_lens.shape)
    if count != batch:
        raise KernelError(f"sequence_lens has {count} entries for a batch of {batch}")
    esize = x.dtype.itemsize
    if sequence_lens.dtype not in (np.int32, np.int64) or esize not in (1, 2, 4, 8, 16):
        return cpu_fallback("ReverseSequence", x, sequence_lens, batch_axis=batch_axis, time_axis=time_axis)
    x = contiguous(x)
    lens = contiguous(sequence_lens)
    out = rt.empty(x.shape, x.dtype)
    if out.size == 0:
        lengths = rt.to_host(lens).astype(np.int64).reshape(-1)
        if lengths.size and (lengths.min() < 0 or lengths.max() > steps):
            raise KernelError(f"sequence_lens must lie in [0, {steps}] (the time axis' size), got {lengths.tolist()}")
        return out
    inner = math.prod(x.shape[2:])
    w = _word_width(esize, inner, x, out)
    inner = inner * esize // w
    n = steps * batch * inner
    flag = rt.zeros((1,), np.int64)
    suffix = "i32" if lens.dtype == np.int32 else "i64"
    launch(
        kernel_of("shape", f"reverse_sequence_w{w}_{suffix}"),
        n,
        out,
        x,
        lens,
        flag,
        np.int64(steps),
        np.int64(batch),
        np.int64(inner),
        np.int64(1 if int(time_axis) == 0 else 0),
        np.int64(n),
    )

    def message(_value):
        lengths = rt.to_host(lens).astype(np.int64).reshape(-1).tolist()
        return f"sequence_lens must lie in [0, {steps}] (the time axis' size), got {lengths}"

    rt.check_flag(flag, message)
    return out


_EYE_COLUMNS: dict = {}


@cuda_kernel("EyeLike")
def eye_like(x, *, dtype=None, k=0):
    """Ones on the k-th diagonal of a matrix of x's shape: OneHot of each row's diagonal column
    (a host table of row + k, a column outside the matrix made out of range, uploaded once per
    shape and k) with off / on values 0 / 1 of the output type."""
    from gradgen.kernels.cpu.elementwise import onnx_dtype
    from gradgen.kernels.cuda.elementwise import on_off_values
    from gradgen.kernels.cuda.indexing import one_hot
    from gradgen.kernels.cuda.launch import cpu_fallback

    if len(x.shape) != 2:
        raise KernelError(f"EyeLike needs a 2-D input, got rank {len(x.shape)}")
    out_dtype = np.dtype(x.dtype) if dtype is None else np.dtype(onnx_dtype(dtype))
    rows, cols = (int(d) for d in x.shape)
    rt = runtime()
    if out_dtype.itemsize not in (1, 2, 4, 8):
        return cpu_fallback("EyeLike", x, dtype=dtype, k=k)
    if rows * cols == 0:
        return rt.empty((rows, cols), out_dtype)

    def make():
        if not _EYE_COLUMNS:
            rt.drop_at_exit(_EYE_COLUMNS.clear)  # device arrays go while the context is current
        columns = np.arange(rows, dtype=np.int64) + int(k)
        columns[(columns < 0) | (columns >= cols)] = cols  # OneHot leaves an out-of-range line all off
        with rt.persistent():
            return rt.to_device(columns)

    columns = plan_cache(_EYE_COLUMNS, (rows, cols, int(k)), make)
    return one_hot(columns, np.array(cols, np.int64), on_off_values(out_dtype), axis=-1)


# ---------------------------------------------------------------- signal-processing tables
#
# The windows and MelWeightMatrix depend on scalar inputs only (a size, rates, edge frequencies),
# read on the host: the CPU kernel computes the table once per set of values, it is uploaded once,
# and each run copies it into the step's own output (which the memory plan may overwrite).

_SIGNAL_TABLES: dict = {}


def _register_signal_table(op_type: str, kernel_name: str, inputs: int) -> None:
    """A launcher for ``op_type`` serving the table that cpu/shape.py's ``kernel_name`` computes."""
    cpu_kernel = getattr(cpu_shape, kernel_name)

    def launcher(*args, **attrs):
        from gradgen.kernels.cuda.launch import copy

        rt = runtime()
        key = (op_type, tuple(host_key(a) for a in args), tuple(sorted(attrs.items())))

        def make():
            if not _SIGNAL_TABLES:
                rt.drop_at_exit(_SIGNAL_TABLES.clear)  # device arrays go while the context is current
            table = cpu_kernel(*args, **attrs)
            if table.size == 0:
                return table
            with rt.persistent():
                return rt.to_device(table)

        table = plan_cache(_SIGNAL_TABLES, key, make)
        return rt.empty(table.shape, table.dtype) if table.size == 0 else copy(table)

    launcher.__name__ = launcher.__qualname__ = kernel_name
    cuda_kernel(op_type, host_inputs=tuple(range(inputs)))(launcher)


for _op, _kernel, _inputs in (
    ("HannWindow", "hann_window", 1),
    ("HammingWindow", "hamming_window", 1),
    ("BlackmanWindow", "blackman_window", 1),
    ("MelWeightMatrix", "mel_weight_matrix", 5),
):
    _register_signal_table(_op, _kernel, _inputs)
