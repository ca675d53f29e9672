"""Training data: arrays with a leading sample axis, named after the model's data inputs.

``check_arrays`` validates them against the graph inputs (names, dtypes, per-sample shapes, the
batch size a static batch dimension allows) with one-line errors. ``ShuffledBatches`` draws
batches in an order fixed by the seed alone: epoch ``e`` is a permutation drawn from
``numpy.random.default_rng([seed, e])``, each epoch yields its full batches (a remainder smaller
than the batch is left out of that epoch), so the batch at any position is known without replaying
the ones before it, and a resumed run sees exactly the batches an uninterrupted one would.

Data is a ``Dataset``: ``ArrayDataset`` (arrays in memory, as ``load_arrays`` reads one .npz) or
``NpzShards`` (a directory of .npz shards read lazily, see its docstring); ``open_data`` picks one
from a path. The permutation runs over all samples of the dataset, so a directory of shards gives
the batches of one .npz holding the same samples in the shards' order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping, Sequence, Union

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


def check_arrays(data: Data, inputs: list[ir.Value], batch_size: int, where: str = "--data") -> None:
    """The data fits the model's data inputs: same names, dtypes and per-sample shapes, enough samples."""
    data = as_dataset(data)
    wanted = value_names(inputs)
    problems = name_mismatch(wanted, data.specs, "no array for input(s) {}", "array(s) {} name no data input")
    if problems:
        raise RunError(f"{where}: {problems}; the model's data inputs are {quoted(wanted)}")
    for value in inputs:
        dtype, sample_shape = data.specs[value_name(value)]
        _check_one(dtype, sample_shape, value, batch_size, where)
    if data.count < batch_size:
        raise RunError(f"{where}: {data.count} sample(s), fewer than one batch of {batch_size}")


def _check_one(dtype: np.dtype, sample_shape: tuple[int, ...], value: ir.Value, batch_size: int, where: str) -> None:
    name = value.name
    if value.dtype is not None:
        want = np.dtype(value.dtype.numpy())
        if dtype != want:
            raise RunError(f"{where}: array {name!r} is {dtype}, but the model's input is {want}")
    if value.shape is None:
        return
    declared = [d if isinstance(d, int) else (d.value or "?") for d in value.shape]
    if len(sample_shape) + 1 != len(declared):
        raise RunError(
            f"{where}: array {name!r} has samples of shape {list(sample_shape)}, but the model's "
            f"input has shape {declared} (batch first)"
        )
    if isinstance(declared[0], int) and declared[0] != batch_size:
        raise RunError(
            f"batch size {batch_size}: the model's input {name!r} has a fixed batch dimension of "
            f"{declared[0]} (shape {declared}); use --batch-size {declared[0]}"
        )
    for axis, (size, dim) in enumerate(zip(sample_shape, declared[1:]), start=1):
        if isinstance(dim, int) and size != dim:
            raise RunError(
                f"{where}: array {name!r} has samples of shape {list(sample_shape)}, but the "
                f"model's input has shape {declared} (dimension {axis} is {dim})"
            )


class ShuffledBatches:
    """Endless seeded batches from ``data`` (arrays or a ``Dataset``), starting after ``start`` batches."""

    def __init__(self, data: Data, batch_size: int, seed: int, start: int = 0):
        self.data = as_dataset(data)
        self.batch_size = batch_size
        self.seed = seed
        self.position = start
        self.count = self.data.count
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
        batch = self.data.take(rows)
        self.position += 1
        return batch


class SequentialBatches(Sequence):
    """Every full batch of ``data`` in order, drawn when read (evaluation data); a remainder smaller
    than a batch is left out."""

    def __init__(self, data: Data, batch_size: int):
        self.data = as_dataset(data)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return self.data.count // self.batch_size

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        start = (index % len(self)) * self.batch_size
        return self.data.take(np.arange(start, start + self.batch_size))


def sequential_batches(data: Data, batch_size: int) -> SequentialBatches:
    """Every full batch in order (evaluation data); a remainder smaller than a batch is left out."""
    return SequentialBatches(data, batch_size)


class Dataset:
    """Samples along a leading axis under one name per data input, read by rows.

    ``specs`` maps each name to its dtype and per-sample shape; ``count`` is the number of samples;
    ``take(rows)`` returns ``{name: array}`` holding those samples in that order.
    """

    specs: dict[str, tuple[np.dtype, tuple[int, ...]]]
    count: int

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError


class ArrayDataset(Dataset):
    """Arrays in memory that share their leading (sample) dimension."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.specs = {name: (a.dtype, tuple(a.shape[1:])) for name, a in self.arrays.items()}
        self.count = len(next(iter(self.arrays.values())))

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {name: array[rows] for name, array in self.arrays.items()}


Data = Union[Dataset, Mapping[str, np.ndarray]]


def as_dataset(data: Data) -> Dataset:
    return data if isinstance(data, Dataset) else ArrayDataset(data)


def open_data(path: str | Path, what: str = "--data") -> Dataset:
    """The dataset at ``path``: one .npz file (read into memory) or a directory of .npz shards
    (``NpzShards``, read lazily)."""
    path = Path(path)
    if path.is_dir():
        from gradgen.training.shards import NpzShards

        return NpzShards(path, what)
    return ArrayDataset(load_arrays(path, what))
