"""Training data: arrays with a leading sample axis, named after the model's data inputs.

``check_arrays`` validates them against the graph inputs (names, dtypes, per-sample shapes, the
batch size a static batch dimension allows) with one-line errors. ``ShuffledBatches`` draws
batches in an order fixed by the seed alone: epoch ``e`` is a permutation drawn from
``numpy.random.default_rng([seed, e])``, each epoch yields its full batches (a remainder smaller
than the batch is left out of that epoch), so the batch at any position is known without replaying
the ones before it, and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import onnx_ir as ir

from gradgen.errors import RunError, UsageError
from gradgen.names import name_mismatch, quoted, value_name, value_names


def load_arrays(path: str | Path, what: str = "--data") -> dict[str, np.ndarray]:
    """The arrays of an .npz file, which must share their leading (sample) dimension."""
    from gradgen.inputs import load_npz

    arrays = load_npz(path)
    if not arrays:
        raise UsageError(f"{what} {path}: the file holds no arrays")
    scalars = [name for name, a in arrays.items() if a.ndim == 0]
    if scalars:
        raise UsageError(f"{what} {path}: array(s) {', '.join(map(repr, scalars))} have no sample axis")
    counts = {name: a.shape[0] for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name!r} {count}" for name, count in counts.items())
        raise UsageError(f"{what} {path}: the arrays hold different numbers of samples ({listed})")
    return arrays


def default_batch_size(inputs: list[ir.Value]) -> int | None:
    """The static batch dimension the data inputs share, if they have one."""
    sizes = {v.shape[0] for v in inputs if v.shape is not None and len(v.shape) and isinstance(v.shape[0], int)}
    return sizes.pop() if len(sizes) == 1 else None


def check_arrays(arrays: Mapping[str, np.ndarray], inputs: list[ir.Value], batch_size: int, where: str = "--data") -> None:
    """The arrays fit the model's data inputs: same names, dtypes and per-sample shapes, enough samples."""
    wanted = value_names(inputs)
    problems = name_mismatch(wanted, arrays, "no array for input(s) {}", "array(s) {} name no data input")
    if problems:
        raise RunError(f"{where}: {problems}; the model's data inputs are {quoted(wanted)}")
    for value in inputs:
        _check_one(arrays[value_name(value)], value, batch_size, where)
    count = len(next(iter(arrays.values())))
    if count < batch_size:
        raise RunError(f"{where}: {count} sample(s), fewer than one batch of {batch_size}")


def _check_one(array: np.ndarray, value: ir.Value, batch_size: int, where: str) -> None:
    name = value.name
    if value.dtype is not None:
        want = np.dtype(value.dtype.numpy())
        if array.dtype != want:
            raise RunError(f"{where}: array {name!r} is {array.dtype}, but the model's input is {want}")
    if value.shape is None:
        return
    declared = [d if isinstance(d, int) else (d.value or "?") for d in value.shape]
    if array.ndim != len(declared):
        raise RunError(
            f"{where}: array {name!r} has samples of shape {list(array.shape[1:])}, but the model's "
            f"input has shape {declared} (batch first)"
        )
    if isinstance(declared[0], int) and declared[0] != batch_size:
        raise RunError(
            f"batch size {batch_size}: the model's input {name!r} has a fixed batch dimension of "
            f"{declared[0]} (shape {declared}); use --batch-size {declared[0]}"
        )
    for axis, (size, dim) in enumerate(zip(array.shape[1:], declared[1:]), start=1):
        if isinstance(dim, int) and size != dim:
            raise RunError(
                f"{where}: array {name!r} has samples of shape {list(array.shape[1:])}, but the "
                f"model's input has shape {declared} (dimension {axis} is {dim})"
            )


class ShuffledBatches:
    """Endless seeded batches from ``arrays``, starting after ``start`` batches."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, seed: int, start: int = 0):
        self.arrays = dict(arrays)
        self.batch_size = batch_size
        self.seed = seed
        self.position = start
        self.count = len(next(iter(self.arrays.values())))
        self.per_epoch = self.count // batch_size
        if self.per_epoch == 0:
            raise RunError(f"{self.count} sample(s), fewer than one batch of {batch_size}")
        self._epoch: int | None = None
        self._order: np.ndarray | None = None  # this epoch's sample order

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        epoch, index = divmod(self.position, self.per_epoch)
        if epoch != self._epoch or self._order is None:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.count)
        rows = self._order[index * self.batch_size : (index + 1) * self.batch_size]
        self.position += 1
        return {name: array[rows] for name, array in self.arrays.items()}


def sequential_batches(arrays: Mapping[str, np.ndarray], batch_size: int) -> list[dict[str, np.ndarray]]:
    """Every full batch in order (evaluation data); a remainder smaller than a batch is left out."""
    count = len(next(iter(arrays.values())))
    return [{name: a[i : i + batch_size] for name, a in arrays.items()} for i in range(0, count - batch_size + 1, batch_size)]
