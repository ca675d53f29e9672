"""A directory of .npz shards as one dataset, read lazily.

Every ``*.npz`` file in the directory (not in subdirectories; names starting with ``.``, such as
temporary files, are left out) is a shard, in the order of the sorted file names; the samples of
all shards, in that order, form the dataset. Other files are ignored and listed in ``ignored``
(``gradgen train`` notes them). Each shard holds the same array names, dtypes and per-sample
shapes as the first; sample counts may differ (an empty shard is allowed).

Opening the dataset reads only each array's .npy header (name, dtype, shape) from each shard, so
a mismatch or an unreadable file is reported before any step without reading the data.
``np.load(mmap_mode="r")`` does not map an .npz, so arrays are read by hand:

- an array stored uncompressed (``np.savez``, ``gradgen.inputs.save_npz``) is memory-mapped at its
  offset in the file: a batch reads only the pages of its samples, and the operating system's page
  cache, not this process, holds what has been read;
- an array stored compressed (``np.savez_compressed``) cannot be read in parts: the shard's arrays
  are decompressed whole when a batch first needs one of its samples and kept in a cache of
  recently used shards, at most ``cache_bytes`` of decompressed arrays (the shard in use is kept
  even if it alone is larger).

At most ``max_open`` shards are open at once (memory maps hold a file descriptor each); the least
recently used is closed first. With a global shuffle a batch takes samples from many shards, so
compressed shards whose total exceeds the cache are decompressed again and again: store shards
uncompressed for random access.
"""

from __future__ import annotations

import collections
import struct
import zipfile
from pathlib import Path
from typing import Literal

import numpy as np

from gradgen.errors import UsageError
from gradgen.training.data import Dataset

DEFAULT_CACHE_BYTES = 1 << 30
DEFAULT_MAX_OPEN = 64
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local file header (30 bytes)


class ShardReadError(UsageError):
    """A shard could not be read while training (it was readable when the dataset was opened)."""


class _Member:
    """One array of a shard: dtype, shape, order, and its data offset if it is stored uncompressed."""

    def __init__(self, key: str, dtype: np.dtype, shape: tuple[int, ...], fortran: bool, offset: int | None):
        self.key, self.dtype, self.shape, self.fortran, self.offset = key, dtype, shape, fortran, offset

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class NpzShards(Dataset):
    """The samples of every .npz shard in ``directory``; ``what`` names the option in errors."""

    def __init__(
        self,
        directory: str | Path,
        what: str = "--data",
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        max_open: int = DEFAULT_MAX_OPEN,
    ):
        self.directory = Path(directory)
        self.what = what
        self.cache_bytes = cache_bytes
        self.max_open = max(1, max_open)
        entries = sorted(self.directory.iterdir(), key=lambda p: p.name)
        self.files = [p for p in entries if p.suffix == ".npz" and not p.name.startswith(".") and p.is_file()]
        self.ignored = [p.name for p in entries if p not in self.files]
        if not self.files:
            others = f" (it holds {len(self.ignored)} other file(s) or directories)" if self.ignored else ""
            raise UsageError(f"{what} {self.directory}: the directory holds no .npz shards{others}")
        self.members = [_read_members(path, what) for path in self.files]
        self.counts = [self._count(i) for i in range(len(self.files))]
        self._check_alike()
        first = self.members[0]
        self.specs = {name: (m.dtype, m.shape[1:]) for name, m in first.items()}
        self.starts = np.cumsum([0] + self.counts)
        self.count = int(self.starts[-1])
        self._open: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()

    @property
    def compressed_bytes(self) -> int:
        """The decompressed size of the arrays that are stored compressed (they go through the cache)."""
        return sum(m.nbytes for members in self.members for m in members.values() if m.offset is None)

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        rows = np.asarray(rows)
        if rows.size and (rows.min() < 0 or rows.max() >= self.count):
            raise IndexError(f"rows out of range for {self.count} samples")
        shard_of = np.searchsorted(self.starts, rows, side="right") - 1
        out = {name: np.empty((len(rows), *shape), dtype) for name, (dtype, shape) in self.specs.items()}
        for shard in np.unique(shard_of):
            picked = np.flatnonzero(shard_of == shard)
            local = rows[picked] - self.starts[shard]
            for name, array in self._shard(int(shard)).items():
                out[name][picked] = array[local]
        return out

    def close(self) -> None:
        self._open.clear()

    def _count(self, index: int) -> int:
        path, members = self.files[index], self.members[index]
        if not members:
            raise UsageError(f"{self.what} {path}: the file holds no arrays")
        scalars = [name for name, m in members.items() if not m.shape]
        if scalars:
            raise UsageError(f"{self.what} {path}: array(s) {', '.join(map(repr, scalars))} have no sample axis")
        counts = {name: m.shape[0] for name, m in members.items()}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"{name!r} {count}" for name, count in counts.items())
            raise UsageError(f"{self.what} {path}: the arrays hold different numbers of samples ({listed})")
        return next(iter(counts.values()))

    def _check_alike(self) -> None:
        """Every shard has the first one's names, dtypes and per-sample shapes."""
        first_path, first = self.files[0], self.members[0]
        for path, members in zip(self.files[1:], self.members[1:]):
            where = f"{self.what} {self.directory}: shards {path.name} and {first_path.name}"
            missing = [name for name in first if name not in members]
            extra = [name for name in members if name not in first]
            if missing or extra:
                parts = [f"{path.name} lacks {', '.join(map(repr, missing))}"] if missing else []
                parts += [f"{path.name} adds {', '.join(map(repr, extra))}"] if extra else []
                raise UsageError(f"{where} hold different arrays: {'; '.join(parts)}")
            for name, want in first.items():
                got = members[name]
                if got.dtype != want.dtype:
                    raise UsageError(
                        f"{where} differ: array {name!r} is {got.dtype} in {path.name}, {want.dtype} in {first_path.name}"
                    )
                if got.shape[1:] != want.shape[1:]:
                    raise UsageError(
                        f"{where} differ: array {name!r} has samples of shape {list(got.shape[1:])} in {path.name}, "
                        f"{list(want.shape[1:])} in {first_path.name}"
                    )

    def _shard(self, index: int) -> dict[str, np.ndarray]:
        """The arrays of shard ``index`` (memory-mapped or decompressed), through the LRU cache."""
        if index in self._open:
            self._open.move_to_end(index)
            return self._open[index]
        arrays = self._read(index)
        self._open[index] = arrays
        while len(self._open) > 1 and (len(self._open) > self.max_open or self._cached_bytes() > self.cache_bytes):
            self._open.popitem(last=False)
        return arrays

    def _cached_bytes(self) -> int:
        return sum(a.nbytes for arrays in self._open.values() for a in arrays.values() if not isinstance(a, np.memmap))

    def _read(self, index: int) -> dict[str, np.ndarray]:
        path, members = self.files[index], self.members[index]
        arrays: dict[str, np.ndarray] = {}
        try:
            compressed = [name for name, m in members.items() if m.offset is None]
            if compressed:
                with np.load(path, allow_pickle=False) as data:
                    arrays.update({name: data[members[name].key] for name in compressed})
            for name, m in members.items():
                if m.offset is not None:
                    order: Literal["F", "C"] = "F" if m.fortran else "C"
                    if m.nbytes == 0:
                        arrays[name] = np.empty(m.shape, m.dtype, order=order)
                    else:
                        arrays[name] = np.memmap(path, m.dtype, mode="r", offset=m.offset, shape=m.shape, order=order)
        except Exception as exc:
            raise ShardReadError(f"{self.what} {path}: shard no longer readable ({type(exc).__name__}: {exc})") from None
        for name, m in members.items():
            if arrays[name].shape != m.shape or arrays[name].dtype != m.dtype:
                raise ShardReadError(f"{self.what} {path}: array {name!r} changed since the dataset was opened")
        return arrays


def _read_members(path: Path, what: str) -> dict[str, _Member]:
    """Each array's header in the .npz at ``path``; a one-line error if it is not one."""
    try:
        with zipfile.ZipFile(path) as archive, open(path, "rb") as raw:
            members = {}
            for info in archive.infolist():
                if info.is_dir():
                    continue
                name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
                members[name] = _read_member(archive, raw, info)
            return members
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} {path}: not a readable .npz file ({type(exc).__name__}: {exc})") from None


def _read_member(archive: zipfile.ZipFile, raw, info: zipfile.ZipInfo) -> _Member:
    with archive.open(info) as stream:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f"member {info.filename!r}: .npy format version {version} is not supported")
        header_size = stream.tell()
    if dtype.hasobject:
        raise ValueError(f"member {info.filename!r} holds Python objects")
    offset = None
    if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
        raw.seek(info.header_offset)
        fields = _LOCAL_HEADER.unpack(raw.read(_LOCAL_HEADER.size))
        if fields[0] != b"PK\x03\x04":
            raise ValueError(f"member {info.filename!r}: bad local header")
        name_length, extra_length = fields[-2], fields[-1]
        offset = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length + header_size
    return _Member(info.filename, dtype, tuple(shape), fortran, offset)
