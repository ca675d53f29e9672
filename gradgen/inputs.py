"""Model inputs: loading and saving .npz files, and drawing random inputs from the declared types.

Random inputs follow the model's declared dtypes and shapes (symbolic dims from ``dims``, which
must name symbolic dims of the model's inputs). Each is drawn within its consumers' contract:
- floats: standard normal, drawn in float32 for float32 inputs (narrower floats through float32);
  uniform in [0.5, 2) for BatchNormalization's variance and the inputs of Sqrt and Log;
- indices of Gather / GatherElements / GatherND / ScatterElements / ScatterND: within the indexed
  axis (per index component for GatherND / ScatterND) when its size is known (looking through Cast,
  Reshape, Unsqueeze and the like); for ScatterElements / ScatterND with reduction='none', distinct
  (repeated indices are undefined there), or a usage error when they cannot be;
- labels of SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss: in [0, number of classes);
- sequence_lens of LSTM / GRU / RNN: in [0, sequence length];
- write_indices of TensorScatter: where the update fits (linear) or within the cache (circular);
- integers that are an op's shape, axes or count (Reshape's shape, Slice's starts, TopK's k, ...):
  refused with a usage error (random values would be meaningless);
- any other integer input: in [0, 10). Bools are fair coin flips.
Inputs whose total size passes the machine's physical memory are refused before anything is drawn.
"""

from __future__ import annotations

import math
import os
import warnings
import zipfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from gradgen.errors import UsageError
from gradgen.names import node_name, value_name

# (op type, position of the index input, position of the data input, attribute of the axis)
_INDEX_CONSUMERS = {
    "Gather": (1, 0, "axis"),
    "GatherElements": (1, 0, "axis"),
    "GatherND": (1, 0, None),
    "ScatterElements": (1, 0, "axis"),
    "ScatterND": (1, 0, None),
}
_LABEL_CONSUMERS = {"SoftmaxCrossEntropyLoss": 1, "NegativeLogLikelihoodLoss": 1}


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_file() and not zipfile.is_zipfile(path):  # np.load would take it for a pickle
        raise UsageError(f"{path}: not an .npz file (not a zip archive; save arrays with numpy.savez)")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as exc:
        raise UsageError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None


def save_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` to ``path`` (exactly that name) atomically, one .npy member per array.

    Unlike ``np.savez(file, **arrays)`` any name works (``file``, ``allow_pickle``, names with ``/``,
    ``:`` or non-ASCII letters) and reads back under the same key with ``np.load``; the few that
    cannot (see ``_npz_name_problems``) are refused before anything is written.
    """
    from gradgen.model_io import atomic_output

    path = Path(path)
    problems = _npz_name_problems(list(arrays))
    if problems:
        raise UsageError(f"{path}: cannot save {'; '.join(problems)} in an .npz file; nothing was written")
    with atomic_output(path) as tmp:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, array in arrays.items():
                with archive.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)
    return path


def _npz_name_problems(names: list[str]) -> list[str]:
    """Why some names would not read back from an .npz under the same key (empty when all do).

    ``np.load`` maps key ``k`` to the member ``k`` if there is one, else ``k.npy``; zip member names
    stop at a NUL and hold at most 65535 bytes of UTF-8.
    """
    members = {name + ".npy" for name in names}
    problems = []
    for name in names:
        if not name:
            problems.append("an output with an empty name")
        elif "\0" in name:
            problems.append(f"output {name!r} (its name holds a NUL character)")
        elif name in members:
            problems.append(f"output {name!r} (np.load would read the output {name[:-4]!r} under that key)")
        else:
            try:
                too_long = len((name + ".npy").encode("utf-8")) > 0xFFFF
            except UnicodeEncodeError:
                problems.append(f"output {name!r} (its name is not valid Unicode)")
                continue
            if too_long:
                problems.append(f"output {name[:40]!r}... (its name passes 65535 bytes)")
    return problems


def parse_dims(pairs: list[str]) -> dict[str, int]:
    """``["batch=4", "seq=16"]`` -> {"batch": 4, "seq": 16}."""
    dims: dict[str, int] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        digits = value.strip()
        if not sep or not name or not digits.isascii() or not digits.isdigit():
            raise UsageError(f"--dim {pair!r}: expected NAME=VALUE with a non-negative integer VALUE")
        if name.strip() in dims:
            raise UsageError(f"--dim {name.strip()} is given twice ({dims[name.strip()]} and {int(digits)}); give it once")
        dims[name.strip()] = int(digits)
    return dims


def model_symbols(model: ir.Model) -> list[str]:
    """The symbolic dimension names of the model's graph inputs (initializers excluded), in order."""
    graph = model.graph
    names: list[str] = []
    for value in graph.inputs:
        if value.name in graph.initializers or value.shape is None:
            continue
        names.extend(d.value for d in value.shape if not isinstance(d, int) and d.value)
    return list(dict.fromkeys(names))


def check_dims(model: ir.Model, dims: Mapping[str, int]) -> None:
    """Refuse a --dim naming no symbolic dimension of the model's inputs (a typo would be ignored)."""
    symbols = model_symbols(model)
    unknown = [name for name in dims if name not in symbols]
    if unknown:
        known = f"its symbolic dimensions are {', '.join(symbols)}" if symbols else "it has no symbolic dimensions"
        raise UsageError(f"--dim {', '.join(unknown)}: the model's inputs have no such dimension; {known}")


def random_feeds(
    model: ir.Model, seed: int = 0, dims: Mapping[str, int] | None = None, given: Mapping[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Random values for every graph input that is neither an initializer nor in ``given`` (see the
    module docstring). A symbolic dimension that ``dims`` does not set takes its size from a given
    array declared with it, so that the drawn inputs fit the given ones."""
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    check_dims(model, dims)
    given = dict(given or {})
    dims = {**dims_of_given(model, given, dims), **dims}
    graph = _with_shapes(model).graph
    wanted = []
    for value in graph.inputs:
        if value.name in graph.initializers or value.name in given:
            continue
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        wanted.append((value, _concrete_shape(value, dims), dtype))
    _check_fits_in_memory(wanted)
    feeds: dict[str, np.ndarray] = {}
    for value, shape, dtype in wanted:
        try:
            feeds[value_name(value)] = _draw(rng, value, shape, dtype, dims)
        except MemoryError:
            raise UsageError(
                f"input {value.name!r}: not enough memory for shape {list(shape)}; choose smaller --dim values"
            ) from None
    return feeds


def dims_of_given(model: ir.Model, given: Mapping[str, np.ndarray], dims: Mapping[str, int]) -> dict[str, int]:
    """The sizes the given arrays have where the model declares a symbolic dimension; one that
    contradicts ``dims`` (--dim) is a usage error: the drawn inputs would not fit the given ones."""
    found: dict[str, int] = {}
    for value in model.graph.inputs:
        array = given.get(str(value.name))
        if array is None or value.shape is None or len(value.shape) != np.ndim(array):
            continue  # a wrong rank is the run's error to report, naming the input
        for d, size in zip(value.shape, np.shape(array)):
            if isinstance(d, int) or not d.value:
                continue
            if d.value in dims and dims[d.value] != size:
                raise UsageError(
                    f"--dim {d.value}={dims[d.value]}, but the given input {value.name!r} has {size} there "
                    f"(shape {list(np.shape(array))}); drop --dim {d.value} or give it that size"
                )
            found.setdefault(d.value, int(size))
    return found


def tell_drawn(drawn: Mapping[str, np.ndarray], source: str) -> None:
    """Say (as a warning: the command line's note) which inputs were drawn at random when others
    were given, so that a mix of given and random inputs is never silent."""
    if drawn:
        warnings.warn(f"random values were drawn for {', '.join(drawn)}, which {source} does not give", stacklevel=2)
    else:
        warnings.warn(f"{source} gives every input: no random values were drawn", stacklevel=2)


def _check_fits_in_memory(wanted) -> None:
    """Refuse inputs whose total size passes the machine's physical memory (e.g. a mistyped --dim)."""
    sizes = {value.name: math.prod(shape) * dtype.itemsize for value, shape, dtype in wanted}
    total = sum(sizes.values())
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: let the allocation decide
        return
    if total > memory:
        name = max(sizes, key=sizes.__getitem__)
        shape = next(list(shape) for value, shape, _ in wanted if value.name == name)
        raise UsageError(
            f"the random inputs would take {_bytes(total)} (input {name!r}, shape {shape}: "
            f"{_bytes(sizes[name])}), more than this machine's {_bytes(memory)} of memory; "
            "choose smaller --dim values"
        )


def _bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _with_shapes(model: ir.Model) -> ir.Model:
    """A copy of the model with inferred shapes (index bounds need the indexed tensors' shapes)."""
    from gradgen.errors import ModelError
    from gradgen.passes import EvaluateConstantsPass

    # clone() shares the weights; a protobuf round trip would copy them all
    copy = model.clone() if hasattr(model, "clone") else ir.from_proto(ir.to_proto(model))
    try:
        EvaluateConstantsPass()(copy)
    except (ModelError, ir.passes.PassError):
        pass  # bounds fall back to [0, 10) where shapes stay unknown
    return copy


def _concrete_shape(value: ir.Value, dims: dict[str, int]) -> tuple[int, ...]:
    if value.shape is None:
        raise UsageError(f"input {value.name!r} has no declared shape; pass --inputs FILE.npz")
    shape = []
    for axis, d in enumerate(value.shape):
        if isinstance(d, int):
            shape.append(d)
        elif d.value and d.value in dims:
            shape.append(dims[d.value])
        else:
            label = repr(d.value) if d.value else "an unnamed dimension"
            hint = f"--dim {d.value}=<size>" if d.value else "--inputs FILE.npz"
            raise UsageError(f"input {value.name!r}: dimension {axis} is {label} with no value; pass {hint}")
    return tuple(shape)


def _draw(rng, value: ir.Value, shape, dtype: np.dtype, dims) -> np.ndarray:
    if dtype.kind in "fiu":  # floats too: OneHot's depth and Range's limits may be floats
        _refuse_shape_like(value)
    if dtype.kind == "f":
        positive = any(_POSITIVE_INPUTS.get(node.op_type) == position for node, position in _consumers(value))
        # float32 and float64 are drawn in their own precision; narrower floats through float32
        draw_dtype = dtype if dtype in (np.float32, np.float64) else np.float32
        if positive:
            values = rng.random(shape, dtype=draw_dtype)
            values *= 1.5
            values += 0.5
            return values.astype(dtype, copy=False)
        return rng.standard_normal(shape, dtype=draw_dtype).astype(dtype, copy=False)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        distinct = _distinct_index_draw(rng, value, shape, dims)
        if distinct is not None:
            return distinct.astype(dtype)
        high = _index_bound(value, shape, dims)
        if high is None:
            high = 10
        return rng.integers(0, high, shape).astype(dtype)
    raise UsageError(f"input {value.name!r}: cannot draw random values of type {dtype}; pass --inputs FILE.npz")


# Ops that pass an integer tensor's values through unchanged (looked through to find its consumers).
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"}
# ... and those of them that keep each element where it is (element positions still mean the same).
_SAME_LAYOUT = {"Cast", "Identity"}

# Float inputs whose contract or domain wants positive values: BatchNormalization's variance (and
# BatchNormInternal's; BatchNormalizationGrad's inverse deviation), Sqrt, Log.
_POSITIVE_INPUTS = {"BatchNormalization": 4, "BatchNormInternal": 4, "BatchNormalizationGrad": 4, "Sqrt": 0, "Log": 0}

# Integer inputs that are shapes, axes, counts or positions of an op: random values would be meaningless.
_SHAPE_LIKE_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "Tile": {1},
    "ConstantOfShape": {0},
    "Slice": {1, 2, 3, 4},
    "Pad": {1, 3},
    "Range": {0, 1, 2},
    "Resize": {3},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "ReduceSum": {1},
    "ReduceMean": {1},
    "ReduceMax": {1},
    "ReduceMin": {1},
    "ReduceProd": {1},
    "ReduceL1": {1},
    "ReduceL2": {1},
    "ReduceLogSum": {1},
    "ReduceLogSumExp": {1},
    "ReduceSumSquare": {1},
    "Split": {1},
    "TopK": {1},
    "OneHot": {1},
    "CumSum": {1},
    "CumProd": {1},
    "Trilu": {1},
    "CenterCropPad": {1, 2},
}


def _consumers(value: ir.Value, depth: int = 0, through=_PASS_THROUGH):
    """(node, input position) of every op reading the value's numbers, through pass-through ops."""
    for node, position in value.uses():
        if node.op_type in through and position == 0 and depth < 8:
            for out in node.outputs:
                yield from _consumers(out, depth + 1, through)
        else:
            yield node, position


def _refuse_shape_like(value: ir.Value) -> None:
    for node, position in _consumers(value):
        if position in _SHAPE_LIKE_INPUTS.get(node.op_type, ()) and node.domain in ("", "ai.onnx"):
            raise UsageError(
                f"input {value.name!r} feeds input {position} of {node.op_type} node "
                f"{node_name(node)!r} (a shape, axes or count): random values would be "
                "meaningless; pass it with --inputs FILE.npz"
            )


def _axis(node: ir.Node, rank: int | None) -> int:
    attr = node.attributes.get("axis")
    axis = attr.value if attr is not None else 0
    return axis + rank if rank is not None and axis < 0 else axis


def _reduction_is_none(node: ir.Node) -> bool:
    attr = node.attributes.get("reduction")
    return attr is None or attr.value == "none"


def _distinct_index_draw(rng, value: ir.Value, shape, dims) -> np.ndarray | None:
    """Indices of a ScatterElements / ScatterND with reduction='none': no position written twice.

    The spec leaves repeated indices undefined there, so random inputs must not repeat them. Only
    for a direct use (through Cast / Identity); None when the op or the shapes do not ask for it.
    """
    for node, position in _consumers(value, through=_SAME_LAYOUT):
        if position != 1 or node.op_type not in ("ScatterElements", "ScatterND") or not _reduction_is_none(node):
            continue
        data = _static_shape(node.inputs[0], dims)
        if data is None:
            return None
        where = f"input {value.name!r} (indices of {node.op_type} node {node_name(node)!r})"
        if node.op_type == "ScatterElements":
            axis = _axis(node, len(data))
            if len(shape) != len(data) or not 0 <= axis < len(data):
                return None
            if shape[axis] > data[axis]:
                raise UsageError(
                    f"{where}: {shape[axis]} distinct indices along axis {axis} cannot fit in "
                    f"{data[axis]} positions (reduction='none' forbids repeats); pass --inputs FILE.npz"
                )
            keys = rng.random((*shape[:axis], data[axis], *shape[axis + 1 :]))
            return np.argsort(keys, axis=axis).take(range(shape[axis]), axis=axis)
        if not shape or shape[-1] > len(data):
            return None
        rows, depth = math.prod(shape[:-1]), shape[-1]
        space = math.prod(data[:depth])
        if rows > space:
            raise UsageError(
                f"{where}: {rows} distinct index tuples cannot fit in the {space} positions of the "
                f"first {depth} axes (reduction='none' forbids repeats); pass --inputs FILE.npz"
            )
        flat = rng.choice(space, size=rows, replace=False)
        return np.stack(np.unravel_index(flat, data[:depth]), axis=-1).reshape(shape)
    return None


def _static_shape(value: ir.Value | None, dims) -> tuple[int, ...] | None:
    if value is None or value.shape is None:
        return None
    sizes = [_dim_size(value, axis, dims) for axis in range(len(value.shape))]
    known = [s for s in sizes if s is not None]
    return tuple(known) if len(known) == len(sizes) else None


def _index_bound(value: ir.Value, shape, dims) -> np.ndarray | int | None:
    """The exclusive upper bound valid for an integer input, from the ops that consume it.

    An int, or for the indices of GatherND / ScatterND (whose last axis walks the data's axes) an
    array of one bound per position along that last axis.
    """
    bounds: list[np.ndarray | int | None] = []
    for node, position in _consumers(value):
        if node.op_type in ("GatherND", "ScatterND") and position == 1 and shape:
            per_component = _nd_bounds(node, shape[-1], dims)
            if per_component is not None:
                bounds.append(per_component)
        elif node.op_type in _INDEX_CONSUMERS and _INDEX_CONSUMERS[node.op_type][0] == position:
            _, data_position, axis_attr = _INDEX_CONSUMERS[node.op_type]
            data = node.inputs[data_position]
            axis = node.attributes[axis_attr].value if axis_attr and axis_attr in node.attributes else 0
            bounds.append(_dim_size(data, axis, dims))
        elif _LABEL_CONSUMERS.get(node.op_type) == position:
            bounds.append(_dim_size(node.inputs[0], 1, dims))
        elif node.op_type in ("LSTM", "GRU", "RNN") and position == 4:  # sequence_lens: in [0, seq_length]
            steps = _dim_size(node.inputs[0], node.attributes["layout"].value if "layout" in node.attributes else 0, dims)
            bounds.append(None if steps is None else steps + 1)
        elif node.op_type == "RoiAlign" and position == 2:  # batch_indices: an image of X
            bounds.append(_dim_size(node.inputs[0], 0, dims))
        elif node.op_type == "TensorScatter" and position == 2:  # write_indices: the update fits after it
            bounds.append(_write_index_bound(node, dims))
    known = [b for b in bounds if b is not None and np.all(np.asarray(b) > 0)]
    if not known:
        return None
    return known[0] if len(known) == 1 else np.minimum.reduce(np.broadcast_arrays(*known))


def _write_index_bound(node: ir.Node, dims) -> int | None:
    """TensorScatter's write_indices: in [0, room - update length] (linear), [0, room) (circular)."""
    axis = node.attributes["axis"].value if "axis" in node.attributes else -2
    room, length = _dim_size(node.inputs[0], axis, dims), _dim_size(node.inputs[1], axis, dims)
    if room is None or length is None:
        return None
    circular = "mode" in node.attributes and node.attributes["mode"].value == "circular"
    return room if circular else room - length + 1


def _nd_bounds(node: ir.Node, depth: int, dims) -> np.ndarray | None:
    """GatherND / ScatterND: index component j addresses the data's axis batch_dims + j."""
    batch = node.attributes["batch_dims"].value if "batch_dims" in node.attributes else 0
    sizes = [_dim_size(node.inputs[0], batch + j, dims) for j in range(depth)]
    if any(s is None for s in sizes):
        return None
    return np.array(sizes, dtype=np.int64)


def _dim_size(value: ir.Value | None, axis: int, dims) -> int | None:
    if value is None or value.shape is None:
        return None
    rank = len(value.shape)
    if not -rank <= axis < rank:
        return None
    d = value.shape[axis]
    if isinstance(d, int):
        return d
    return dims.get(d.value) if d.value else None
