"""Model inputs: loading them from .npz and drawing random ones from the declared types.

Random inputs follow the model's declared dtypes and shapes (symbolic dims from ``dims``).
Floats are standard normal. Integer inputs are drawn where they can be valid:
- indices of Gather / GatherElements / GatherND / ScatterElements / ScatterND: in [0, size of the
  indexed axis) when that size is known (looking through Cast, Reshape, Unsqueeze and the like);
- labels of SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss: in [0, number of classes);
- any other integer input: in [0, 10). Bools are fair coin flips.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from gradgen.errors import UsageError

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
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except Exception as exc:
        raise UsageError(f"{path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None


def save_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> Path:
    """Write ``arrays`` to ``path`` (exactly that name) atomically: a temporary file, then rename."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.resolve().parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


def parse_dims(pairs: list[str]) -> dict[str, int]:
    """``["batch=4", "seq=16"]`` -> {"batch": 4, "seq": 16}."""
    dims = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value.strip().lstrip("-").isdigit() or int(value) < 0:
            raise UsageError(f"--dim {pair!r}: expected NAME=VALUE with a non-negative integer VALUE")
        dims[name.strip()] = int(value)
    return dims


def random_feeds(model: ir.Model, seed: int = 0, dims: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random values for every graph input that is not an initializer."""
    rng = np.random.default_rng(seed)
    dims = dict(dims or {})
    graph = _with_shapes(model).graph
    feeds = {}
    for value in graph.inputs:
        if value.name in graph.initializers:
            continue
        shape = _concrete_shape(value, dims)
        dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
        feeds[value.name] = _draw(rng, value, shape, dtype, dims)
    return feeds


def _with_shapes(model: ir.Model) -> ir.Model:
    """A copy of the model with inferred shapes (index bounds need the indexed tensors' shapes)."""
    from gradgen.errors import ModelError
    from gradgen.passes import FoldShapeArithmeticPass, ShapeInferencePass

    copy = ir.from_proto(ir.to_proto(model))
    try:
        ShapeInferencePass()(FoldShapeArithmeticPass()(copy).model)
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
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        high = _index_bound(value, dims) or 10
        return rng.integers(0, high, shape).astype(dtype)
    raise UsageError(f"input {value.name!r}: cannot draw random values of type {dtype}; pass --inputs FILE.npz")


# Ops that pass an integer tensor's values through unchanged (looked through to find its consumers).
_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Expand", "Transpose"}


def _consumers(value: ir.Value, depth: int = 0):
    """(node, input position) of every op reading the value's numbers, through pass-through ops."""
    for node, position in value.uses():
        if node.op_type in _PASS_THROUGH and position == 0 and depth < 8:
            for out in node.outputs:
                yield from _consumers(out, depth + 1)
        else:
            yield node, position


def _index_bound(value: ir.Value, dims) -> int | None:
    """The exclusive upper bound valid for an integer input, from the ops that consume it."""
    bounds = []
    for node, position in _consumers(value):
        if node.op_type in _INDEX_CONSUMERS and _INDEX_CONSUMERS[node.op_type][0] == position:
            _, data_position, axis_attr = _INDEX_CONSUMERS[node.op_type]
            data = node.inputs[data_position]
            axis = node.attributes[axis_attr].value if axis_attr and axis_attr in node.attributes else 0
            bounds.append(_dim_size(data, axis, dims))
        elif _LABEL_CONSUMERS.get(node.op_type) == position:
            bounds.append(_dim_size(node.inputs[0], 1, dims))
    known = [b for b in bounds if b]
    return min(known) if known else None


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
