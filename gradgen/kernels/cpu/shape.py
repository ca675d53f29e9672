"""CPU kernels: shape manipulation, constants and index-free data movement.

Ops whose axes/pads/starts moved from attributes to inputs across opsets (Squeeze, Unsqueeze,
Split, Slice, Pad) accept both: the attribute arrives as a keyword argument bound to the same
parameter the input would use. numpy accepts several things ONNX forbids (reshaping with two -1,
broadcasting both ways in Expand...); those are checked here and raise ``KernelError``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu.elementwise import onnx_dtype
from gradgen.kernels.cpu.prepared import constant_inputs, per_shape
from gradgen.kernels.numeric import shape_arg
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.axes import int_list, normalize_axis
from gradgen.ops.schemas import ANY, INDICES, INT64, Formal, Schema
from gradgen.ops.shape import (
    concat_shape,
    depth_to_space_plan,
    reshape_dims,
    shape_bounds,
    slice_geometry,
    slice_index,
    space_to_depth_plan,
)


def _unique_axes(axes: list[int], rank: int, what: str = "axes") -> list[int]:
    normalised = [normalize_axis(a, rank, f"{what} entry") for a in axes]
    if len(set(normalised)) != len(normalised):
        raise KernelError(f"repeated {what} {axes}")
    return normalised


@cpu_kernel("Shape")
def shape(data, *, start=0, end=None):
    start, end = shape_bounds(data.ndim, start, end)
    return np.array(data.shape[start:end], dtype=np.int64)


@cpu_kernel("Size")
def size(data):
    return np.array(data.size, dtype=np.int64)


@cpu_kernel("Reshape")
def reshape(data, shape=None, *, allowzero=0):
    if shape is None:
        raise KernelError("Reshape needs the shape input")
    return data.reshape(_reshape_target(data.shape, tuple(int_list(shape, "shape")), allowzero))


@cpu_prepare("Reshape")
def prepare_reshape(constants: tuple, attrs: dict):
    shape = constant_inputs(constants, 1)
    if shape is None or shape[0] is None:
        return None
    dims, allowzero = tuple(int_list(shape[0], "shape")), attrs.get("allowzero", 0)
    target = per_shape(lambda in_shape: _reshape_target(in_shape, dims, allowzero))

    def run(data, shape=None):
        return data.reshape(target(data.shape))

    return run


@functools.lru_cache(maxsize=4096)
def _reshape_target(in_shape: tuple, dims: tuple, allowzero: int) -> tuple:
    """Reshape's target, worked out once per (input shape, shape input); errors are not cached."""
    return tuple(reshape_dims(in_shape, list(dims), allowzero))


@cpu_kernel("Flatten")
def flatten(x, *, axis=1):
    rank = x.ndim
    if not -rank <= axis <= rank:
        raise KernelError(f"axis {axis} is out of range [{-rank}, {rank}]")
    axis = axis + rank if axis < 0 else axis
    rows = math.prod(x.shape[:axis])
    cols = math.prod(x.shape[axis:])
    return x.reshape(rows, cols)


@cpu_kernel("Transpose")
def transpose(data, *, perm=None):
    if perm is None:
        return np.transpose(data)
    perm = [int(p) for p in perm]
    if sorted(perm) != list(range(data.ndim)):
        raise KernelError(f"perm {perm} is not a permutation of the {data.ndim} axes")
    return np.transpose(data, perm)


@cpu_prepare("Transpose")
def prepare_transpose(constants: tuple, attrs: dict):
    perm = attrs.get("perm")
    if perm is None:
        return None
    perm = tuple(int(p) for p in perm)
    if sorted(perm) != list(range(len(perm))):
        return None  # the kernel says why

    def run(data):
        return data.transpose(perm) if data.ndim == len(perm) else transpose(data, perm=perm)

    return run


def _squeezed_shape(shape: tuple, axes: list) -> tuple:
    """Squeeze's output shape (the checks of ``squeeze``)."""
    normalised = _unique_axes(axes, len(shape))
    for a in normalised:
        if shape[a] != 1:
            raise KernelError(f"cannot squeeze axis {a} of size {shape[a]} (shape {list(shape)})")
    return tuple(d for i, d in enumerate(shape) if i not in normalised)


def _unsqueezed_shape(shape: tuple, axes: list) -> tuple:
    """Unsqueeze's output shape (the checks of ``unsqueeze``)."""
    rank = len(shape) + len(axes)
    normalised = set(_unique_axes(axes, rank))
    rest = iter(shape)
    return tuple(1 if i in normalised else next(rest) for i in range(rank))


def _prepare_axes_reshape(shape_of):
    """A preparer for Squeeze / Unsqueeze with constant axes (input 1 or the attribute of older
    opsets): a reshape to the target shape, the view numpy's squeeze / expand_dims give."""

    def prepare(constants: tuple, attrs: dict):
        given = constant_inputs(constants, 1)
        if given is None:
            return None
        axes = given[0] if given[0] is not None else attrs.get("axes")
        if axes is None:
            return None
        axes = int_list(axes, "axes")
        target = per_shape(lambda in_shape: shape_of(in_shape, axes))

        def run(data, axes=None):
            return data.reshape(target(data.shape))

        return run

    return prepare


cpu_prepare("Squeeze")(_prepare_axes_reshape(_squeezed_shape))
cpu_prepare("Unsqueeze")(_prepare_axes_reshape(_unsqueezed_shape))


@cpu_kernel("Squeeze")
def squeeze(data, axes=None):
    if axes is None:
        return np.squeeze(data)
    normalised = _unique_axes(int_list(axes, "axes"), data.ndim)
    for a in normalised:
        if data.shape[a] != 1:
            raise KernelError(f"cannot squeeze axis {a} of size {data.shape[a]} (shape {list(data.shape)})")
    return np.squeeze(data, axis=tuple(normalised))


@cpu_kernel("Unsqueeze")
def unsqueeze(data, axes=None):
    if axes is None:
        raise KernelError("Unsqueeze needs axes")
    axes = int_list(axes, "axes")
    rank = data.ndim + len(axes)
    normalised = _unique_axes(axes, rank)
    return np.expand_dims(data, tuple(normalised)) if normalised else data


@cpu_kernel("Concat")
def concat(*inputs, axis):
    """np.concatenate of the inputs of one dtype, which checks ranks, dims and the axis itself (a
    few microseconds less a step than checking first); where it refuses, ``concat_shape`` raises
    the error that says why."""
    arrays = [x for x in inputs if x is not None]
    if arrays and all(x.dtype == arrays[0].dtype for x in arrays):
        try:
            return np.concatenate(arrays, axis=axis)
        except ValueError:  # numpy's AxisError is a ValueError too
            pass
    ax, _ = concat_shape([x.shape for x in arrays], [x.dtype for x in arrays], axis)
    return np.concatenate(arrays, axis=ax)


def split_sizes(n: int, ax: int, split, num_outputs, node_outputs: int) -> list[int]:
    """Split's part sizes along axis ``ax`` of size ``n``: from the ``split`` input, else
    ``num_outputs`` (opset 18: the last part may be smaller), else equal parts per node output."""
    if split is not None and np.size(split):
        sizes = int_list(split, "split")
        if any(s < 0 for s in sizes):
            raise KernelError(f"split sizes {sizes} must be non-negative")
        if sum(sizes) != n:
            raise KernelError(f"split sizes {sizes} sum to {sum(sizes)}, but axis {ax} has size {n}")
        if len(sizes) != node_outputs:
            raise KernelError(f"split has {len(sizes)} sizes but the node has {node_outputs} outputs")
        return sizes
    parts = int(num_outputs) if num_outputs is not None else node_outputs
    if num_outputs is not None and parts != node_outputs:
        raise KernelError(f"num_outputs={parts} but the node has {node_outputs} outputs")
    if parts < 1:
        raise KernelError(f"cannot split into {parts} parts")
    if num_outputs is None and n % parts:
        raise KernelError(f"axis {ax} of size {n} does not split evenly into {parts} outputs")
    chunk = -(-n // parts)  # ceil: the last chunk is smaller when uneven (opset 18)
    return [min(chunk, max(n - i * chunk, 0)) for i in range(parts)]


@cpu_kernel("Split")
def split(x, split=None, *, axis=0, num_outputs=None, _num_outputs=1):
    ax = normalize_axis(axis, x.ndim)
    sizes = split_sizes(x.shape[ax], ax, split, num_outputs, _num_outputs)
    bounds = np.cumsum(sizes)[:-1]
    return tuple(np.split(x, bounds, axis=ax))


@cpu_prepare("Split")
def prepare_split(constants: tuple, attrs: dict):
    given = constant_inputs(constants, 1)
    if given is None:
        return None
    split = given[0] if given[0] is not None else attrs.get("split")  # the attribute of opsets < 13
    axis, num_outputs, outputs = attrs.get("axis", 0), attrs.get("num_outputs"), attrs.get("_num_outputs", 1)

    def indices(shape: tuple) -> list:
        ax = normalize_axis(axis, len(shape))
        sizes = split_sizes(shape[ax], ax, split, num_outputs, outputs)
        starts = np.concatenate(([0], np.cumsum(sizes)))
        return [(slice(None),) * ax + (slice(int(a), int(b)),) for a, b in zip(starts[:-1], starts[1:])]

    parts = per_shape(indices)

    def run(x, split=None):
        return tuple([x[index] for index in parts(x.shape)])

    return run


@cpu_prepare("Slice")
def prepare_slice(constants: tuple, attrs: dict):
    given = constant_inputs(constants, 1, 2, 3, 4)
    if given is None:
        return None
    starts, ends, axes, steps = given
    if starts is None:  # opsets < 10: attributes
        starts, ends, axes = attrs.get("starts"), attrs.get("ends"), attrs.get("axes")
    if starts is None or ends is None:
        return None

    def index_for(shape: tuple) -> tuple:
        return slice_index(slice_geometry(shape, starts, ends, axes, steps))

    window = per_shape(index_for)

    def run(data, *rest):
        return data[window(data.shape)]

    return run


@cpu_kernel("Slice")
def slice_(data, starts=None, ends=None, axes=None, steps=None):
    if starts is None or ends is None:
        raise KernelError("Slice needs starts and ends")
    return data[slice_index(slice_geometry(data.shape, starts, ends, axes, steps))]


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...], what: str) -> tuple[int, ...]:
    try:
        return np.broadcast_shapes(a, b)
    except ValueError:
        raise KernelError(f"{what}: shapes {list(a)} and {list(b)} are not broadcastable") from None


@cpu_kernel("Expand")
def expand(x, shape):
    dims = int_list(shape, "shape")
    target = broadcast_shape(x.shape, tuple(dims), "Expand")
    return np.array(np.broadcast_to(x, target))


@cpu_prepare("Expand")
def prepare_expand(constants: tuple, attrs: dict):
    """A fresh array of the broadcast shape, filled by one copy: the output layout (``_layout_of``)
    is worked out on the first call per input layout and target shape. A target computed at run time
    (a backward graph's Shape -> Expand) joins the key as a tuple."""
    shape = constant_inputs(constants, 1)
    fixed = None if shape is None or shape[0] is None else tuple(int_list(shape[0], "shape"))
    layouts: dict = {}  # (input shape, input strides, dtype, target) -> (shape in memory order, transpose back) or None

    def run(x, shape=None):
        dims = fixed if fixed is not None else _dims_key(shape)
        if dims is None:
            return expand(x, shape)
        key = (x.shape, x.strides, x.dtype, dims)
        layout = layouts.get(key, False)
        if layout is False:
            if len(layouts) >= 64:
                layouts.clear()
            out = expand(x, dims)
            layouts[key] = _layout_of(out)
            return out
        if layout is None:
            return expand(x, dims)
        out = np.empty(layout[0], dtype=x.dtype).transpose(layout[1])
        np.copyto(out, x)
        return out

    return run


def _dims_key(shape) -> tuple | None:
    """A run-time Expand target as a hashable tuple of ints, or None for one the kernel must judge
    (not a 1-D integer array: its error message is the kernel's)."""
    if type(shape) is not np.ndarray or shape.ndim != 1 or shape.dtype.kind not in "iu":
        return None
    return tuple(shape.tolist())


def _layout_of(array: np.ndarray) -> tuple | None:
    """(shape in memory order, transpose back) that recreate ``array``'s strides from a fresh
    C-ordered array (``expand`` keeps the broadcast view's axis order, which is not always C's), or
    None when no such transpose has the very same strides."""
    order = sorted(range(array.ndim), key=lambda a: -array.strides[a])
    back = tuple(int(i) for i in np.argsort(order))
    stored = tuple(array.shape[a] for a in order)
    made = np.empty(stored, dtype=array.dtype).transpose(back)
    return (stored, back) if made.strides == array.strides else None


@cpu_kernel("Tile")
def tile(x, repeats):
    reps = int_list(repeats, "repeats")
    if len(reps) != x.ndim:
        raise KernelError(f"repeats has {len(reps)} entries, the input has rank {x.ndim}")
    if any(r < 0 for r in reps):
        raise KernelError(f"repeats {reps} must be non-negative")
    return np.tile(x, reps)


def pad_widths(shape, pads, axes=None) -> list[list[int]]:
    """[begin, end] per axis of a Pad (negative: cropped), checked: every output dim is >= 0. Shared
    by the CPU and CUDA kernels."""
    pads = int_list(pads, "pads")
    rank = len(shape)
    axes_list = list(range(rank)) if axes is None else _unique_axes(int_list(axes, "axes"), rank)
    if len(pads) != 2 * len(axes_list):
        raise KernelError(f"pads has {len(pads)} entries; expected 2 x {len(axes_list)} (one begin and end per axis)")
    width = [[0, 0] for _ in range(rank)]
    for i, ax in enumerate(axes_list):
        width[ax] = [pads[i], pads[i + len(axes_list)]]
    for d, (b, e) in enumerate(width):
        if int(shape[d]) + b + e < 0:
            raise KernelError(f"pads {b} and {e} of axis {d} (size {int(shape[d])}) leave a negative size")
    return width


def pad_copy_geometry(shape, width) -> list[tuple[int, int, int, int]]:
    """Per axis of a constant Pad: (source start, output start, count, output length). Padding and
    cropping at once read as "pad, then crop": input element i lands at output i + begin when that
    is inside [0, n + begin + end) (so a crop larger than the axis leaves no element, not a pad)."""
    out = []
    for n, (b, e) in zip(shape, width):
        length = int(n) + b + e
        src = max(0, -b)
        count = max(0, min(int(n), length - b) - src)
        out.append((src, max(0, b), count, length))
    return out


def _constant_pad(data, width, fill):
    """``data`` padded with ``fill`` by ``width`` ([begin, end] per axis; negative: cropped)."""
    geometry = pad_copy_geometry(data.shape, width)
    out = np.full([g[3] for g in geometry], np.asarray(fill).astype(data.dtype), dtype=data.dtype)
    out[tuple(slice(o, o + c) for _, o, c, _ in geometry)] = data[tuple(slice(s, s + c) for s, _, c, _ in geometry)]
    return out


@cpu_kernel("Pad")
def pad(data, pads=None, constant_value=None, axes=None, *, mode="constant", value=0.0, paddings=None):
    if pads is None:
        pads = paddings  # opset 1 spelling
    if pads is None:
        raise KernelError("Pad needs pads")
    width = pad_widths(data.shape, pads, axes)
    if mode == "constant":
        fill = value if constant_value is None or np.size(constant_value) == 0 else np.asarray(constant_value).reshape(-1)[0]
        return _constant_pad(data, width, fill)
    # Negative pads crop first.
    crop = tuple(slice(-min(b, 0), data.shape[d] + min(e, 0)) for d, (b, e) in enumerate(width))
    x = data[crop]
    width = [(max(b, 0), max(e, 0)) for b, e in width]
    if mode not in ("reflect", "edge", "wrap"):
        raise KernelError(f"unknown pad mode {mode!r}; expected constant, reflect, edge or wrap")
    for d, (b, e) in enumerate(width):
        if (b or e) and x.shape[d] == 0:
            raise KernelError(f"cannot {mode}-pad axis {d} of size 0")
        if mode == "reflect" and (b or e) and max(b, e) > x.shape[d] - 1:  # a reflection reaches the far end only once
            raise KernelError(f"reflect pads ({b}, {e}) of axis {d} exceed its size {x.shape[d]} minus 1")
    return np.pad(x, width, mode=mode)


@cpu_prepare("Pad")
def prepare_pad(constants: tuple, attrs: dict):
    """Constant-mode Pad with a constant fill value and axes: the kernel's fill and copy, its
    geometry worked out once per (input shape, dtype, pads)."""
    given = constant_inputs(constants, 2, 3)
    if attrs.get("mode", "constant") != "constant" or given is None or "paddings" in attrs:
        return None
    constant_value, axes = given
    fill = attrs.get("value", 0.0)
    if constant_value is not None and np.size(constant_value):
        fill = np.asarray(constant_value).reshape(-1)[0]

    def geometry(key: tuple) -> tuple:
        shape, dtype, pads = key
        copy = pad_copy_geometry(shape, pad_widths(shape, np.frombuffer(pads, dtype=np.int64), axes))
        into = tuple(slice(o, o + c) for _, o, c, _ in copy)
        source = tuple(slice(s, s + c) for s, _, c, _ in copy)
        return tuple(g[3] for g in copy), np.asarray(fill).astype(dtype), into, source

    plans = per_shape(geometry)

    def run(data, pads=None, constant_value=None, axes=None):
        if pads is None or pads.dtype != np.int64:
            return pad(data, pads, constant_value, axes, **attrs)
        shape, value, into, source = plans((data.shape, data.dtype, pads.tobytes()))
        out = np.full(shape, value, dtype=data.dtype)
        out[into] = data[source]
        return out

    return run


@cpu_kernel("ConstantOfShape")
def constant_of_shape(shape, *, value=None):
    dims = int_list(shape, "shape")
    if any(d < 0 for d in dims):
        raise KernelError(f"shape {dims} has a negative dimension")
    if value is None:
        return np.zeros(dims, dtype=np.float32)
    value = np.asarray(value)
    if value.size != 1:
        raise KernelError(f"value must hold one element, got {value.size}")
    fill = value.reshape(-1)[0]
    if value.dtype.kind in "biuf" and value.dtype.isnative and not fill and not (value.dtype.kind == "f" and np.signbit(fill)):
        return np.zeros(dims, dtype=value.dtype.type)  # calloc'd zeros: no fill pass (not for -0.0)
    return np.full(dims, fill, dtype=value.dtype)


@cpu_kernel("Constant")
def constant(
    *,
    value=None,
    value_float=None,
    value_floats=None,
    value_int=None,
    value_ints=None,
    value_string=None,
    value_strings=None,
    sparse_value=None,
):
    if value is not None:
        out = np.asarray(value)
        if out.dtype.kind not in "biuf" and out.dtype.name != "bfloat16":  # bfloat16: ml_dtypes' (kind V)
            raise KernelError(f"constant tensors of type {out.dtype} are not supported")
        return out.copy()
    if value_float is not None:
        return np.array(value_float, dtype=np.float32)
    if value_floats is not None:
        return np.array(value_floats, dtype=np.float32).reshape(-1)
    if value_int is not None:
        return np.array(value_int, dtype=np.int64)
    if value_ints is not None:
        return np.array(value_ints, dtype=np.int64).reshape(-1)
    if value_string is not None or value_strings is not None:
        raise KernelError("string constants are not supported")
    if sparse_value is not None:
        raise KernelError("sparse constants are not supported")
    raise KernelError("Constant has none of the value attributes")


@cpu_kernel("Range")
def range_(start, limit, delta, *, stash_type=1):
    for v, name in ((start, "start"), (limit, "limit"), (delta, "delta")):
        if np.size(v) != 1:
            raise KernelError(f"{name} must be a scalar, got shape {list(np.shape(v))}")
    dtype = start.dtype
    s, l, d = (np.asarray(v).reshape(()).item() for v in (start, limit, delta))
    if d == 0:
        raise KernelError("delta is 0")
    n = max(int(np.ceil((l - s) / d)), 0)
    if dtype.kind == "f":
        # start + i * delta in the input's precision, as the spec's loop does; float16 goes
        # through float32 when stash_type=1 (opset 27; the default).
        work = np.dtype(np.float32) if dtype == np.float16 and stash_type == 1 else dtype
        return (np.asarray(s, work) + np.arange(n, dtype=work) * np.asarray(d, work)).astype(dtype)
    return (s + np.arange(n, dtype=np.int64) * d).astype(dtype)


@cpu_kernel("Trilu")
def trilu(x, k=None, *, upper=1):
    if x.ndim < 2:
        raise KernelError(f"Trilu needs rank >= 2, got {x.ndim}")
    kk = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return np.triu(x, kk) if upper else np.tril(x, kk)


@cpu_kernel("EyeLike")
def eye_like(x, *, dtype=None, k=0):
    if x.ndim != 2:
        raise KernelError(f"EyeLike needs a 2-D input, got rank {x.ndim}")
    out_dtype = x.dtype if dtype is None else onnx_dtype(dtype)
    return np.eye(x.shape[0], x.shape[1], k=int(k), dtype=out_dtype)


@cpu_kernel("DepthToSpace")
def depth_to_space(x, *, blocksize, mode="DCR"):
    blocked, perm, out_shape = depth_to_space_plan(x.shape, blocksize, mode)
    return x.reshape(blocked).transpose(perm).reshape(out_shape)


@cpu_kernel("SpaceToDepth")
def space_to_depth(x, *, blocksize, mode="DCR"):
    blocked, perm, out_shape = space_to_depth_plan(x.shape, blocksize, mode)
    return x.reshape(blocked).transpose(perm).reshape(out_shape)


# ---------------------------------------------------------------------------------------------
# SliceGrad (com.microsoft)

SLICE_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc).
        "SliceGrad",
        inputs=(
            Formal("dY", ANY),
            Formal("shape", INT64),
            Formal("starts", INDICES),
            Formal("ends", INDICES),
            Formal("axes", INDICES, optional=True),
            Formal("steps", INDICES, optional=True),
        ),
        outputs=(Formal("dX", ANY),),
        infer=lambda i, a: [(i[0].dtype, schemas.shape_from_input(i[1]))],
    )
)


@cpu_kernel("SliceGrad", domain=MICROSOFT)
def slice_grad(dY, shape, starts, ends, axes=None, steps=None):
    """dX: zeros of ``shape`` with dY written where Slice(starts, ends, axes, steps) read from.

    dY must have as many elements as the slice; like ORT, its shape may differ (it is read in order).
    """
    dims = shape_arg(shape)
    slices = slice_index(slice_geometry(dims, starts, ends, axes, steps))
    dY = np.asarray(dY)
    dX = np.zeros(dims, dtype=dY.dtype)
    window = dX[tuple(slices)]
    if window.size != dY.size:
        raise KernelError(f"dY has shape {list(dY.shape)}, but the slice of shape {dims} has shape {list(window.shape)}")
    # ORT checks only the element count (its tests feed dY of shape (2,) for a (1, 2) slice).
    dX[tuple(slices)] = dY.reshape(window.shape)
    return dX


def center_crop_pad_widths(x_shape, shape, axes=None) -> list[list[int]]:
    """CenterCropPad as a constant Pad: [begin, end] per axis of X (negative: cropped), centred: the
    first floor(|difference| / 2) elements are cut or added before, the rest after. Checked: one
    size >= 0 for each of the distinct ``axes`` (default: all). Shared by the CPU and CUDA kernels."""
    rank = len(x_shape)
    axes_list = [normalize_axis(a, rank) for a in axes] if axes is not None else list(range(rank))
    sizes = [int(v) for v in np.asarray(shape).reshape(-1)]
    if len(sizes) != len(axes_list) or len(set(axes_list)) != len(axes_list) or min(sizes, default=0) < 0:
        raise KernelError(f"shape {sizes} must give one size >= 0 for each of the distinct axes {axes_list}")
    width = [[0, 0] for _ in range(rank)]
    for axis, size in zip(axes_list, sizes):
        have = int(x_shape[axis])
        begin = abs(have - size) // 2 * (1 if size >= have else -1)
        width[axis] = [begin, size - have - begin]
    return width


@cpu_kernel("CenterCropPad")
def center_crop_pad(x, shape, *, axes=None):
    """X cropped or zero-padded to ``shape`` along ``axes`` (default: all), centred (see
    ``center_crop_pad_widths``)."""
    return _constant_pad(x, center_crop_pad_widths(x.shape, shape, axes), 0)


@cpu_kernel("ReverseSequence")
def reverse_sequence(x, sequence_lens, *, batch_axis=1, time_axis=0):
    """The first sequence_lens[b] steps of each batch entry b reversed along the time axis."""
    if {int(batch_axis), int(time_axis)} != {0, 1}:
        raise KernelError(f"batch_axis and time_axis must be 0 and 1 in some order, got {batch_axis} and {time_axis}")
    lengths = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
    steps, batch = x.shape[time_axis], x.shape[batch_axis]
    if lengths.size != batch:
        raise KernelError(f"sequence_lens has {lengths.size} entries for a batch of {batch}")
    if lengths.size and (lengths.min() < 0 or lengths.max() > steps):
        raise KernelError(f"sequence_lens must lie in [0, {steps}] (the time axis' size), got {lengths.tolist()}")
    t = np.arange(steps)[:, None]
    source = np.where(t < lengths[None, :], lengths[None, :] - 1 - t, t)  # (time, batch)
    if time_axis == 1:
        source = source.T
    index = np.broadcast_to(source.reshape(source.shape + (1,) * (x.ndim - 2)), x.shape)
    return np.take_along_axis(x, index, axis=int(time_axis))


# ---------------------------------------------------------------------------------------------
# Signal-processing tables (opset 17): their values depend on scalar inputs only


def _scalar(value, name: str):
    """The one value of a scalar input (a size, a rate, an edge frequency)."""
    array = np.asarray(value)
    if array.size != 1:
        raise KernelError(f"{name} must hold one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _window(size, output_datatype, periodic, coefficients: tuple[float, ...]) -> np.ndarray:
    """sum_k (-1)^k a_k cos(2 pi k n / N) for n < size, N = size (periodic) or size - 1: the
    generalized cosine window of ONNX's three, computed in float64 and cast to ``output_datatype``.
    A symmetric window of one point (N = 0, where the formula divides 0 by 0) is 1, as in PyTorch
    and SciPy."""
    length = int(_scalar(size, "size"))
    if length < 0:
        raise KernelError(f"size must not be negative, got {length}")
    dtype = onnx_dtype(output_datatype)
    span = length if int(periodic) else length - 1
    if span == 0:
        return np.ones(length, dtype=dtype)
    phase = 2 * np.pi * np.arange(length, dtype=np.float64) / span
    values = sum((-1) ** k * a * np.cos(k * phase) for k, a in enumerate(coefficients))
    return np.asarray(values, dtype=np.float64).astype(dtype)


@cpu_kernel("HannWindow")
def hann_window(size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, (0.5, 0.5))


@cpu_kernel("HammingWindow")
def hamming_window(size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, (25.0 / 46.0, 21.0 / 46.0))


@cpu_kernel("BlackmanWindow")
def blackman_window(size, *, output_datatype=1, periodic=1):
    return _window(size, output_datatype, periodic, (0.42, 0.5, 0.08))


@cpu_kernel("MelWeightMatrix")
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *, output_datatype=1):
    """(dft_length // 2 + 1, num_mel_bins) triangular filters on the mel scale, ONNX's definition:
    num_mel_bins + 2 edges evenly spaced in mel between the two edge frequencies, each mapped to
    the DFT bin floor((dft_length + 1) * hertz / sample_rate); filter i rises from edge i to edge
    i + 1 and falls to edge i + 2."""
    bins, length = int(_scalar(num_mel_bins, "num_mel_bins")), int(_scalar(dft_length, "dft_length"))
    rate = float(_scalar(sample_rate, "sample_rate"))
    low, high = float(_scalar(lower_edge_hertz, "lower_edge_hertz")), float(_scalar(upper_edge_hertz, "upper_edge_hertz"))
    if bins < 1 or length < 1 or rate <= 0 or not 0 <= low <= high:
        raise KernelError(
            f"MelWeightMatrix needs num_mel_bins >= 1, dft_length >= 1, sample_rate > 0 and 0 <= lower <= upper edge, "
            f"got {bins}, {length}, {rate}, {low}, {high}"
        )
    spectrum = length // 2 + 1
    mel_low, mel_high = (2595 * np.log1p(hertz / 700) / np.log(10) for hertz in (low, high))
    mels = np.arange(bins + 2) * ((mel_high - mel_low) / (bins + 2)) + mel_low
    edges = (((length + 1) * (700 * np.expm1(mels / 2595 * np.log(10)))) // rate).astype(np.int64)
    if edges.max() >= spectrum:
        raise KernelError(f"upper_edge_hertz {high} reaches past the {spectrum} bins of a {length}-point DFT at {rate} Hz")
    out = np.zeros((spectrum, bins), dtype=np.float64)
    for i in range(bins):
        left, center, right = (int(e) for e in edges[i : i + 3])
        if center == left:
            out[center, i] = 1.0
        else:
            out[left : center + 1, i] = (np.arange(left, center + 1) - left) / (center - left)
        if right > center:
            out[center:right, i] = (right - np.arange(center, right)) / (right - center)
    return out.astype(onnx_dtype(output_datatype))
