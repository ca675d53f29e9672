"""CUDA launchers: shape ops and data movement (shape.cu), and the com.microsoft SliceGrad.

Everything here is built on two kernels: a strided copy (``dst[...] = src[offset + sum c_k * s_k]``,
strides may be 0 or negative) and a one-pass "lattice" kernel (each output element is either read
from the input, when it lies on the lattice start + q * step of every axis, or a fill value): Slice,
Transpose, Expand, Tile, Concat and Split are strided copies; constant Pad (and SliceGrad, below)
are lattices. The kernels move bits: they are chosen by element width, and runs of
contiguous elements are moved as 16-byte words where sizes and alignment allow.

Reshape, Flatten, Squeeze and Unsqueeze copy nothing: they return a GPUArray that shares the
input's memory (``GPUArray.reshape`` keeps a reference to its base array in ``.base``, so the
executor dropping the input's name cannot free memory the view still uses). Identity returns its
input (Identity is registered with the elementwise launchers). Shape and Size answer on the host.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import shape as cpu_shape
from gradgen.kernels.cuda.launch import host_key, plan_cache
from gradgen.kernels.numeric import int_list, normalize_axis, shape_arg
from gradgen.kernels.registry import MICROSOFT, cuda_kernel

_INT32_LIMIT = 2**31 - 1


def _rt():
    from gradgen.cuda import runtime as rt

    return rt


@functools.lru_cache(maxsize=4096)
def _desc_cached(shape: tuple, strides: tuple | None):
    return _rt().desc(list(shape), None if strides is None else list(strides))


def desc(shape, strides=None):
    """``runtime.desc``, cached by value (launches with the same shapes reuse the record; never mutated)."""
    return _desc_cached(tuple(int(d) for d in shape), None if strides is None else tuple(int(v) for v in strides))


def elem_strides(x) -> list[int]:
    """Element strides of a GPUArray (its .strides are in bytes)."""
    return [int(s) // x.dtype.itemsize for s in x.strides]


def ptr(x, offset_elements: int = 0) -> np.uintp:
    """The device address of ``x`` plus an element offset, as a kernel argument."""
    return np.uintp(int(x.gpudata) + int(offset_elements) * x.dtype.itemsize)


def _coalesce(shape, *stride_lists):
    """Drop size-1 axes and merge neighbours that are contiguous in every stride list."""
    dims, lists = [], [[] for _ in stride_lists]
    for k, d in enumerate(shape):
        if d == 1:
            continue
        if dims and all(st[-1] == s[k] * d for st, s in zip(lists, stride_lists)):
            dims[-1] *= d
            for st, s in zip(lists, stride_lists):
                st[-1] = s[k]
            continue
        dims.append(int(d))
        for st, s in zip(lists, stride_lists):
            st.append(int(s[k]))
    if not dims:
        dims, lists = [1], [[0] for _ in stride_lists]
    return dims, lists


def _extent(shape, strides) -> int:
    return sum((d - 1) * abs(s) for d, s in zip(shape, strides))


def strided_copy(dst, dst_strides, dst_off, src, src_strides, src_off, shape) -> None:
    """dst[dst_off + c . dst_strides] = src[src_off + c . src_strides] for every coordinate c of shape."""
    rt = _rt()
    n = math.prod(int(d) for d in shape)
    if n == 0:
        return
    if dst.dtype.itemsize != src.dtype.itemsize:
        raise KernelError(f"cannot copy {src.dtype} into {dst.dtype}")
    shape, (ss, ds) = _coalesce(shape, src_strides, dst_strides)
    esize = src.dtype.itemsize
    src_addr, dst_addr = int(src.gpudata) + src_off * esize, int(dst.gpudata) + dst_off * esize
    width = esize
    for w in (16, 8, 4):
        r = w // esize
        if w <= esize or w % esize:
            continue
        if (ss[-1] == 1 and ds[-1] == 1 and shape[-1] % r == 0 and src_addr % w == 0 and dst_addr % w == 0
                and all(s % r == 0 for s in ss[:-1] + ds[:-1])):
            shape = shape[:-1] + [shape[-1] // r]
            ss = [s // r for s in ss[:-1]] + [1]
            ds = [s // r for s in ds[:-1]] + [1]
            width = w
            break
    if len(shape) > rt.MAX_RANK:
        raise KernelError(f"copy of rank {len(shape)} exceeds the CUDA kernels' maximum of {rt.MAX_RANK}")
    n = math.prod(shape)
    small = n <= _INT32_LIMIT and _extent(shape, ss) <= _INT32_LIMIT and _extent(shape, ds) <= _INT32_LIMIT
    kernel = rt.function("shape", f"strided_copy_w{width}_{'i32' if small else 'i64'}")
    rt.launch(kernel, n, np.uintp(dst_addr), np.uintp(src_addr), desc(shape, ss), desc(shape, ds),
              np.int64(0), np.int64(0), np.int64(n))


def copy_into(dst, src, shape, src_strides, src_off=0) -> None:
    """Fill the contiguous ``dst`` (of ``shape``) from ``src`` read through element strides."""
    strided_copy(dst, _rt().contiguous_strides(shape), 0, src, src_strides, src_off, shape)


def contiguous(x):
    """``x`` itself when C-contiguous, else a contiguous copy."""
    if x.flags.c_contiguous:
        return x
    out = _rt().empty(x.shape, x.dtype)
    copy_into(out, x, x.shape, elem_strides(x))
    return out


def fill_bits(value, dtype) -> np.int64:
    """``value`` cast to ``dtype``, its bytes as an int64 kernel argument (little-endian, zero-padded)."""
    raw = np.zeros(8, np.uint8)
    data = np.asarray(value).astype(dtype).reshape(-1)[:1].view(np.uint8)
    raw[: data.size] = data
    return raw.view(np.int64)[0]


_VECTOR = {2: 8, 4: 4, 8: 2}


def _magic(d: int) -> tuple[int, int] | None:
    """(multiplier, shift) with n // d == (umulhi(n, m) + n) >> shift for 0 <= n < 2**31, or None."""
    shift = max(0, (int(d) - 1).bit_length())
    m = ((1 << 32) * ((1 << shift) - d)) // d + 1
    return (m, shift) if 0 < m < (1 << 32) else None


def stream():
    """The stream gradgen's GPU work goes to (runtime.stream() where the runtime has one, else None: the
    default stream)."""
    get = getattr(_rt(), "stream", None)
    return get() if get is not None else None


def raw(kernel):
    """The PyCUDA function behind a runtime.function() result (which may wrap it)."""
    return getattr(kernel, "fn", kernel)


def launch_packed(kernel, grid: int, block: int, args: bytes, shared: int = 0) -> None:
    """Launch ``kernel`` with an argument buffer packed by the caller (struct, C layout: pointers first,
    then descriptors, then 8-byte scalars), on gradgen's stream: no per-argument handling in Python.
    ``grid`` > 0 blocks of ``block`` threads."""
    raw(kernel)._launch_kernel((int(grid), 1, 1), (int(block), 1, 1), args, int(shared), stream())


def grid_for(n: int, block: int = 256, max_blocks: int = 65535 * 8) -> int:
    """Blocks of a grid-stride launch over ``n`` > 0 items (as runtime.launch sizes them)."""
    return max(1, min(-(-int(n) // block), max_blocks))


_PTRS2 = struct.Struct("=QQ")


def lattice_plan(shape, esize: int, starts, steps, counts, src_strides, fill, aligned: bool = True):
    """What a lattice launch over a C-contiguous output of ``shape`` needs besides the two addresses:
    (kernel, grid, the packed arguments after (dst, src)). ``aligned``: the output is 16-byte aligned."""
    rt = _rt()
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
    small = size <= _INT32_LIMIT and _extent(counts, src_strides) <= _INT32_LIMIT and None not in magic
    if not small:
        magic = [(0, 0)] * len(shape)
    kernel = rt.function("shape", f"lattice_w{esize}_v{v}_{'int32' if small else 'int64'}")
    tail = b"".join(bytes(memoryview(d)) for d in (desc(shape), desc(counts, src_strides), desc(starts, steps),
                                                    desc([m for m, _ in magic], [s for _, s in magic])))
    tail += struct.pack("=qq", int(fill), n)
    return kernel, grid_for(n), tail


def lattice(out, src, src_off, starts, steps, counts, src_strides, fill) -> None:
    """One pass over ``out``: element c = src[src_off + q . src_strides] where c_k = starts_k + q_k * steps_k
    (0 <= q_k < counts_k) on every axis, ``fill`` (an int64 of the value's bits) elsewhere."""
    if out.size == 0:
        return
    esize = out.dtype.itemsize
    kernel, grid, tail = lattice_plan(out.shape, esize, starts, steps, counts, src_strides, fill,
                                      int(out.gpudata) % 16 == 0)
    src_addr = 0 if math.prod(counts) == 0 else int(src.gpudata) + int(src_off) * esize
    launch_packed(kernel, grid, 256, _PTRS2.pack(int(out.gpudata), src_addr) + tail)


def fill(out, value) -> None:
    rt = _rt()
    if out.size:
        esize = out.dtype.itemsize
        rt.launch(rt.function("shape", f"fill_w{esize}"), out.size, out, fill_bits(value, out.dtype), np.int64(out.size))


def _view(x, shape):
    """``x`` with a new shape, sharing memory (the view keeps ``x`` alive through ``.base``)."""
    shape = tuple(int(d) for d in shape)
    if x.size == 0:
        return _rt().empty(shape, x.dtype)
    return contiguous(x).reshape(shape)


# ---------------------------------------------------------------- no-copy ops


@cuda_kernel("Shape")
def shape(data, *, start=0, end=None):
    rank = len(data.shape)
    dims = np.array(data.shape, dtype=np.int64)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = rank if end is None else end
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return dims[start:end]


@cuda_kernel("Size")
def size(data):
    return np.array(math.prod(data.shape), dtype=np.int64)


def reshape_dims(in_shape, dims, allowzero=0) -> list[int]:
    """Reshape's output shape (0 copies a dimension unless allowzero, one -1 is inferred)."""
    in_shape = list(in_shape)
    total = math.prod(in_shape)
    if allowzero and 0 in dims and -1 in dims:
        raise KernelError(f"shape {dims}: with allowzero=1 it may not contain both 0 and -1")
    out = []
    for i, d in enumerate(dims):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise KernelError(f"shape {dims}: 0 at position {i} copies a dimension the input (rank {len(in_shape)}) lacks")
            out.append(in_shape[i])
        elif d < -1:
            raise KernelError(f"shape {dims}: invalid dimension {d}")
        else:
            out.append(d)
    if out.count(-1) > 1:
        raise KernelError(f"shape {dims}: at most one dimension may be -1")
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or total % known:
            raise KernelError(f"cannot reshape input of shape {in_shape} ({total} elements) to {dims}")
        out[out.index(-1)] = total // known
    if math.prod(out) != total:
        raise KernelError(f"cannot reshape input of shape {in_shape} ({total} elements) to {dims}")
    return out


@cuda_kernel("Reshape", host_inputs=(1,))
def reshape(data, shape=None, *, allowzero=0):
    if shape is None:
        raise KernelError("Reshape needs the shape input")
    return _view(data, reshape_dims(data.shape, int_list(shape, "shape"), allowzero))


@cuda_kernel("Flatten")
def flatten(x, *, axis=1):
    rank = len(x.shape)
    if not -rank <= axis <= rank:
        raise KernelError(f"axis {axis} is out of range [{-rank}, {rank}]")
    axis = axis + rank if axis < 0 else axis
    return _view(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@cuda_kernel("Squeeze", host_inputs=(1,))
def squeeze(data, axes=None):
    if axes is None:
        return _view(data, [d for d in data.shape if d != 1])
    normalised = cpu_shape._unique_axes(int_list(axes, "axes"), len(data.shape))
    for a in normalised:
        if data.shape[a] != 1:
            raise KernelError(f"cannot squeeze axis {a} of size {data.shape[a]} (shape {list(data.shape)})")
    return _view(data, [d for k, d in enumerate(data.shape) if k not in normalised])


@cuda_kernel("Unsqueeze", host_inputs=(1,))
def unsqueeze(data, axes=None):
    if axes is None:
        raise KernelError("Unsqueeze needs axes")
    axes = int_list(axes, "axes")
    rank = len(data.shape) + len(axes)
    normalised = set(cpu_shape._unique_axes(axes, rank))
    dims, rest = [], iter(data.shape)
    for k in range(rank):
        dims.append(1 if k in normalised else next(rest))
    return _view(data, dims)


# ---------------------------------------------------------------- copies


@cuda_kernel("Transpose")
def transpose(data, *, perm=None):
    rt = _rt()
    rank = len(data.shape)
    perm = list(range(rank))[::-1] if perm is None else [int(p) for p in perm]
    if sorted(perm) != list(range(rank)):
        raise KernelError(f"perm {perm} is not a permutation of the {rank} axes")
    shape = [data.shape[p] for p in perm]
    strides = elem_strides(data)
    out = rt.empty(shape, data.dtype)
    copy_into(out, data, shape, [strides[p] for p in perm])
    return out


@cuda_kernel("Slice", host_inputs=(1, 2, 3, 4))
def slice_(data, starts=None, ends=None, axes=None, steps=None):
    rt = _rt()
    if starts is None or ends is None:
        raise KernelError("Slice needs starts and ends")
    geometry = cpu_shape.slice_geometry(data.shape, starts, ends, axes, steps)
    shape = [count for _, _, count in geometry]
    out = rt.empty(shape, data.dtype)
    if out.size:
        strides = elem_strides(data)
        offset = sum(start * s for (start, _, _), s in zip(geometry, strides))
        copy_into(out, data, shape, [step * s for (_, step, _), s in zip(geometry, strides)], offset)
    return out


@cuda_kernel("Expand", host_inputs=(1,))
def expand(x, shape):
    rt = _rt()
    dims = int_list(shape, "shape")
    target = list(cpu_shape._broadcast_shape(tuple(x.shape), tuple(dims), "Expand"))
    if tuple(target) == tuple(x.shape):
        return x
    out = rt.empty(target, x.dtype)
    lead = len(target) - len(x.shape)
    strides = [0] * lead + [0 if d == 1 else s for d, s in zip(x.shape, elem_strides(x))]
    copy_into(out, x, target, strides)
    return out


@cuda_kernel("Tile", host_inputs=(1,))
def tile(x, repeats):
    rt = _rt()
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
    for d, r, s in zip(x.shape, reps, elem_strides(x)):
        shape += [r, d]
        strides += [0, s]
    coalesced, _ = _coalesce(shape, strides, rt.contiguous_strides(shape))
    if len(coalesced) <= rt.MAX_RANK:
        copy_into(out, x, shape, strides)
        return out
    current = x  # too many axes at once: tile one axis at a time
    for k, r in enumerate(reps):
        if r == 1:
            continue
        cur_shape = list(current.shape)
        nxt = rt.empty(cur_shape[:k] + [cur_shape[k] * r] + cur_shape[k + 1:], x.dtype)
        view = cur_shape[:k] + [r] + cur_shape[k:]
        st = elem_strides(current)
        copy_into(nxt, current, view, st[:k] + [0] + st[k:])
        current = nxt
    return current


@cuda_kernel("Concat")
def concat(*inputs, axis):
    rt = _rt()
    arrays = [x for x in inputs if x is not None]
    if not arrays:
        raise KernelError("Concat needs at least one input")
    rank = len(arrays[0].shape)
    ax = normalize_axis(axis, rank)
    for i, x in enumerate(arrays[1:], 1):
        if len(x.shape) != rank:
            raise KernelError(f"input {i} has rank {len(x.shape)}, input 0 has rank {rank}")
        for d in range(rank):
            if d != ax and x.shape[d] != arrays[0].shape[d]:
                raise KernelError(f"input {i} has shape {list(x.shape)}, input 0 has {list(arrays[0].shape)}: "
                                  f"they must agree on every axis but {ax}")
        if x.dtype != arrays[0].dtype:
            raise KernelError(f"input {i} has dtype {x.dtype}, input 0 has {arrays[0].dtype}; Concat needs one type")
    out_shape = list(arrays[0].shape)
    out_shape[ax] = sum(x.shape[ax] for x in arrays)
    out = rt.empty(out_shape, arrays[0].dtype)
    out_strides = rt.contiguous_strides(out_shape)
    offset = 0
    for x in arrays:
        if x.size:
            strided_copy(out, out_strides, offset * out_strides[ax], x, elem_strides(x), 0, x.shape)
        offset += x.shape[ax]
    return out


@cuda_kernel("Split", host_inputs=(1,))
def split(x, split=None, *, axis=0, num_outputs=None, _num_outputs=1):
    rt = _rt()
    ax = normalize_axis(axis, len(x.shape))
    n = x.shape[ax]
    sizes = cpu_shape.split_sizes(n, ax, split, num_outputs, _num_outputs)
    strides = elem_strides(x)
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
    rt = _rt()
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
    rank = len(data.shape)
    width = cpu_shape.pad_widths(data.shape, pads, axes)
    cv = None if constant_value is None else rt.to_host(constant_value)
    fill_value = value if cv is None or np.size(cv) == 0 else np.asarray(cv).reshape(-1)[0]
    x = contiguous(data)
    strides = elem_strides(x) if rank else []
    starts, counts, out_shape, src_off = [], [], [], 0
    for d, (src, start, count, length) in enumerate(cpu_shape.pad_copy_geometry(x.shape, width)):
        src_off += src * strides[d]
        starts.append(start)
        counts.append(count)
        out_shape.append(length)
    out = rt.empty(out_shape, data.dtype)
    lattice(out, x, src_off, starts, [1] * rank, counts, strides, fill_bits(fill_value, data.dtype))
    return out


@cuda_kernel("Trilu", host_inputs=(1,))
def trilu(x, k=None, *, upper=1):
    rt = _rt()
    if len(x.shape) < 2:
        raise KernelError(f"Trilu needs rank >= 2, got {len(x.shape)}")
    kk = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    x = contiguous(x)
    out = rt.empty(x.shape, x.dtype)
    if out.size:
        rows, cols = x.shape[-2:]
        rt.launch(rt.function("shape", f"trilu_w{x.dtype.itemsize}"), out.size, out, x, np.int64(rows),
                  np.int64(cols), np.int64(kk), np.int64(1 if upper else 0), np.int64(out.size))
    return out


@cuda_kernel("ConstantOfShape", host_inputs=(0,))
def constant_of_shape(shape, *, value=None):
    rt = _rt()
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
    return _view(transpose(_view(x, blocked_shape), perm=perm), out_shape)


@cuda_kernel("DepthToSpace")
def depth_to_space(x, *, blocksize, mode="DCR"):
    if len(x.shape) != 4:
        raise KernelError(f"DepthToSpace needs a 4-D NCHW input, got rank {len(x.shape)}")
    b, c, h, w = x.shape
    bs = int(blocksize)
    if bs < 1 or c % (bs * bs):
        raise KernelError(f"channels ({c}) must be divisible by blocksize^2 ({bs * bs})")
    depth = c // (bs * bs)
    if mode == "DCR":
        blocked, perm = (b, bs, bs, depth, h, w), (0, 3, 4, 1, 5, 2)
    elif mode == "CRD":
        blocked, perm = (b, depth, bs, bs, h, w), (0, 1, 4, 2, 5, 3)
    else:
        raise KernelError(f"unknown mode {mode!r}; expected DCR or CRD")
    return _block_rearrange(x, blocked, perm, (b, depth, h * bs, w * bs))


@cuda_kernel("SpaceToDepth")
def space_to_depth(x, *, blocksize, mode="DCR"):
    if len(x.shape) != 4:
        raise KernelError(f"SpaceToDepth needs a 4-D NCHW input, got rank {len(x.shape)}")
    b, c, h, w = x.shape
    bs = int(blocksize)
    if bs < 1 or h % bs or w % bs:
        raise KernelError(f"height ({h}) and width ({w}) must be divisible by blocksize ({bs})")
    perms = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}
    if mode not in perms:
        raise KernelError(f"unknown mode {mode!r}; expected DCR or CRD")
    return _block_rearrange(x, (b, c, h // bs, bs, w // bs, bs), perms[mode], (b, c * bs * bs, h // bs, w // bs))


# ---------------------------------------------------------------- SliceGrad


_SG_PLANS: dict = {}
_PTRS2 = struct.Struct("=QQ")


def _slice_grad_plan(dy_shape, dtype, shape, starts, ends, axes, steps, aligned=True):
    """(dX dims, lattice kernel or None, grid, packed arguments after (dX, dY)); validates everything."""
    dims = shape_arg(shape)
    geometry = cpu_shape.slice_geometry(dims, starts, ends, axes, steps)
    lat_start, lat_step, counts = (list(column) for column in zip(*geometry)) if dims else ([], [], [])
    if math.prod(counts) != math.prod(dy_shape):
        raise KernelError(f"dY has shape {list(dy_shape)}, but the slice of shape {dims} has shape {counts}")
    if math.prod(dims) == 0:
        return tuple(dims), None, 0, b""
    kernel, grid, tail = lattice_plan(dims, np.dtype(dtype).itemsize, lat_start, lat_step, counts,
                                         _rt().contiguous_strides(counts), np.int64(0), aligned)
    return tuple(dims), raw(kernel), grid, tail


@cuda_kernel("SliceGrad", domain=MICROSOFT, host_inputs=(1, 2, 3, 4, 5))
def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    """One pass over dX (the lattice kernel with fill 0): every element written once, no memset."""
    rt = _rt()
    key = (dY.shape, dY.dtype, host_key(shape), host_key(starts), host_key(ends), host_key(axes),
           host_key(steps))
    dims, kernel, grid, tail = plan_cache(
        _SG_PLANS, key, lambda: _slice_grad_plan(dY.shape, dY.dtype, shape, starts, ends, axes, steps))
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
