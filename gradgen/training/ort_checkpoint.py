"""ONNX Runtime training's checkpoint file: the flatbuffer ``ort_training_checkpoint.fbs`` describes.

ONNX Runtime training (``onnxruntime.training.api.CheckpointState``) keeps a model's parameters,
and after training its optimizer state and user properties, in one flatbuffer file with the file
identifier ``ODTC``. Its tables, with their field slots (the order of the schema):

- ``Checkpoint``: version (int32), module_state, optimizer_groups ([OptimizerGroup]), property_bag;
- ``ModuleState``: requires_grad_params ([Tensor]), frozen_params ([Tensor]), is_nominal_state
  (bool), has_external_data (bool);
- ``OptimizerGroup``: group_name, step (int64), initial_learning_rate (float32), optimizer_states
  ([ParameterOptimizerState]); ``ParameterOptimizerState``: param_name, momentums ([Tensor]);
- ``PropertyBag``: ints, floats, strings, each a list of (name, value) tables;
- ``Tensor`` (shared with the ORT model format): name, doc_string, dims ([int64]), data_type (the
  ONNX ``TensorProto`` element type code), raw_data ([uint8], little-endian), string_data
  ([string]), external_data_offset (int64, -1: the data is inline).

``generate_artifacts`` writes version 2 with the module state only: the trainable parameters,
then the frozen ones, each list in the model's initializer order; ``encode_checkpoint`` writes the
same. ``read_checkpoint`` reads any of these files, including the ones ONNX Runtime saves after
training (optimizer groups, properties) and those whose tensors live in the external data file
``<checkpoint>.data`` (tensor data at ``external_data_offset``).

The ``flatbuffers`` package does the encoding (``pip install 'gradgen[artifacts]'``); no
generated code is needed for so few tables.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from gradgen.errors import UsageError

FILE_IDENTIFIER = b"ODTC"
VERSION = 2  # what ONNX Runtime training 1.19.2 writes and reads
_FLATBUFFER_LIMIT = 2**31 - 1  # flatbuffers' offsets are 32-bit signed

# Field slots of each table (the index of the field in the schema).
_CHECKPOINT = {"version": 0, "module_state": 1, "optimizer_groups": 2, "property_bag": 3}
_MODULE_STATE = {"requires_grad_params": 0, "frozen_params": 1, "is_nominal_state": 2, "has_external_data": 3}
_OPTIMIZER_GROUP = {"group_name": 0, "step": 1, "initial_learning_rate": 2, "optimizer_states": 3}
_PARAMETER_STATE = {"param_name": 0, "momentums": 1}
_PROPERTY_BAG = {"ints": 0, "floats": 1, "strings": 2}
_PROPERTY = {"name": 0, "value": 1}
_TENSOR = {"name": 0, "doc_string": 1, "dims": 2, "data_type": 3, "raw_data": 4, "string_data": 5, "external_data_offset": 6}


@dataclasses.dataclass
class OptimizerGroup:
    """One optimizer group: its step count, initial learning rate and per-parameter states
    (parameter -> state name (``momentum0``, ``momentum1``) -> array)."""

    name: str
    step: int
    initial_learning_rate: float
    states: dict[str, dict[str, np.ndarray]]


@dataclasses.dataclass
class OrtCheckpoint:
    """What an ONNX Runtime training checkpoint holds, as numpy arrays."""

    requires_grad: dict[str, np.ndarray]
    frozen: dict[str, np.ndarray]
    version: int = VERSION
    nominal: bool = False
    optimizer_groups: list[OptimizerGroup] = dataclasses.field(default_factory=list)
    properties: dict[str, int | float | str] = dataclasses.field(default_factory=dict)


def require_flatbuffers():
    """The flatbuffers module, or a one-line error saying how to install it."""
    try:
        import flatbuffers
    except ImportError:
        raise UsageError("ONNX Runtime checkpoints need the flatbuffers package: pip install 'gradgen[artifacts]'") from None
    return flatbuffers


# ---------------------------------------------------------------- writing


def encode_checkpoint(
    requires_grad: Mapping[str, ir.TensorProtocol | np.ndarray],
    frozen: Mapping[str, ir.TensorProtocol | np.ndarray] | None = None,
) -> bytes:
    """The checkpoint file's bytes for these parameters, as ``generate_artifacts`` writes them."""
    frozen = frozen or {}
    tensors = [*requires_grad.items(), *frozen.items()]
    names = [name for name, _ in tensors]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise UsageError(f"parameter(s) {', '.join(map(repr, repeated))} are both trainable and frozen")
    size = sum(_as_tensor(name, value).nbytes for name, value in tensors)
    if size > _FLATBUFFER_LIMIT - (1 << 20):
        raise UsageError(
            f"the parameters take {size / 2**30:.2f} GiB, past the 2 GiB a flatbuffer checkpoint holds "
            "(ONNX Runtime's external-data checkpoints are not written by gradgen)"
        )
    flatbuffers = require_flatbuffers()
    builder = flatbuffers.Builder(max(1024, size + 1024 * (len(tensors) + 1)))
    trainable = _table_vector(builder, [_write_tensor(builder, n, v) for n, v in requires_grad.items()])
    fixed = _table_vector(builder, [_write_tensor(builder, n, v) for n, v in frozen.items()])
    builder.StartObject(len(_MODULE_STATE))
    builder.PrependUOffsetTRelativeSlot(_MODULE_STATE["requires_grad_params"], trainable, 0)
    builder.PrependUOffsetTRelativeSlot(_MODULE_STATE["frozen_params"], fixed, 0)
    module_state = builder.EndObject()
    builder.StartObject(len(_CHECKPOINT))
    builder.PrependInt32Slot(_CHECKPOINT["version"], VERSION, 0)
    builder.PrependUOffsetTRelativeSlot(_CHECKPOINT["module_state"], module_state, 0)
    builder.Finish(builder.EndObject(), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def _as_tensor(name: str, value: ir.TensorProtocol | np.ndarray) -> ir.TensorProtocol:
    if isinstance(value, np.ndarray):  # (np.ascontiguousarray would make a 0-d array 1-d)
        return ir.Tensor(value if value.flags.c_contiguous else value.copy(), name=name)
    return value


def _write_tensor(builder, name: str, value: ir.TensorProtocol | np.ndarray) -> int:
    tensor = _as_tensor(name, value)
    if tensor.dtype == ir.DataType.STRING:
        raise UsageError(f"parameter {name!r} is a string tensor; a checkpoint holds numeric parameters")
    raw = np.frombuffer(tensor.tobytes(), dtype=np.uint8)  # ONNX's raw layout: little-endian
    name_offset = builder.CreateString(name)
    dims = builder.CreateNumpyVector(np.asarray(tensor.shape.numpy(), dtype=np.int64))
    data = builder.CreateNumpyVector(raw)
    builder.StartObject(len(_TENSOR))
    builder.PrependUOffsetTRelativeSlot(_TENSOR["name"], name_offset, 0)
    builder.PrependUOffsetTRelativeSlot(_TENSOR["dims"], dims, 0)
    builder.PrependInt32Slot(_TENSOR["data_type"], int(tensor.dtype), 0)
    builder.PrependUOffsetTRelativeSlot(_TENSOR["raw_data"], data, 0)
    return builder.EndObject()


def _table_vector(builder, offsets: list[int]) -> int:
    builder.StartVector(4, len(offsets), 4)
    for offset in reversed(offsets):
        builder.PrependUOffsetTRelative(offset)
    return builder.EndVector()


# ---------------------------------------------------------------- reading


class _Table:
    """A flatbuffer table: fields by slot, with their schema defaults when absent."""

    def __init__(self, buf: bytes, pos: int):
        from flatbuffers.table import Table

        self._table = Table(buf, pos)

    def _offset(self, slot: int) -> int:
        return self._table.Offset(4 + 2 * slot)

    def scalar(self, slot: int, flags, default):
        offset = self._offset(slot)
        return self._table.Get(flags, offset + self._table.Pos) if offset else default

    def string(self, slot: int) -> str | None:
        offset = self._offset(slot)
        return self._table.String(offset + self._table.Pos).decode("utf-8") if offset else None

    def table(self, slot: int) -> _Table | None:
        offset = self._offset(slot)
        return _Table(self._table.Bytes, self._table.Indirect(offset + self._table.Pos)) if offset else None

    def tables(self, slot: int) -> list[_Table] | None:
        offset = self._offset(slot)
        if not offset:
            return None
        start = self._table.Vector(offset)
        return [_Table(self._table.Bytes, self._table.Indirect(start + 4 * i)) for i in range(self._table.VectorLen(offset))]

    def strings(self, slot: int) -> list[str]:
        offset = self._offset(slot)
        if not offset:
            return []
        start = self._table.Vector(offset)
        return [self._table.String(start + 4 * i).decode("utf-8") for i in range(self._table.VectorLen(offset))]

    def numbers(self, slot: int, flags) -> np.ndarray | None:
        offset = self._offset(slot)
        return self._table.GetVectorAsNumpy(flags, offset) if offset else None


def read_checkpoint(path: str | os.PathLike) -> OrtCheckpoint:
    """Read an ONNX Runtime training checkpoint (gradgen's or ONNX Runtime's own)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such checkpoint file")
    buf = path.read_bytes()
    if len(buf) < 8 or buf[4:8] != FILE_IDENTIFIER:
        raise UsageError(f"{path}: not an ONNX Runtime training checkpoint (no {FILE_IDENTIFIER.decode()} identifier)")
    require_flatbuffers()
    try:
        return _decode(buf, path)
    except (struct.error, IndexError, ValueError, UnicodeDecodeError, OverflowError) as exc:
        raise UsageError(f"{path}: malformed ONNX Runtime training checkpoint ({type(exc).__name__}: {exc})") from None


def _decode(buf: bytes, path: Path) -> OrtCheckpoint:
    from flatbuffers import number_types as n

    root = _Table(buf, n.UOffsetTFlags.py_type(struct.unpack_from("<I", buf, 0)[0]))
    version = root.scalar(_CHECKPOINT["version"], n.Int32Flags, 0)
    checkpoint = OrtCheckpoint(requires_grad={}, frozen={}, version=version)
    external = _ExternalData(Path(f"{path}.data"))
    module_state = root.table(_CHECKPOINT["module_state"])
    if module_state is not None:
        checkpoint.nominal = bool(module_state.scalar(_MODULE_STATE["is_nominal_state"], n.BoolFlags, False))
        for field, target in (("requires_grad_params", checkpoint.requires_grad), ("frozen_params", checkpoint.frozen)):
            for tensor in module_state.tables(_MODULE_STATE[field]) or []:
                name, array = _read_tensor(tensor, external, checkpoint.nominal)
                target[name] = array
    for group in root.tables(_CHECKPOINT["optimizer_groups"]) or []:
        states: dict[str, dict[str, np.ndarray]] = {}
        for state in group.tables(_OPTIMIZER_GROUP["optimizer_states"]) or []:
            momentums = [_read_tensor(t, external, False) for t in state.tables(_PARAMETER_STATE["momentums"]) or []]
            states[state.string(_PARAMETER_STATE["param_name"]) or ""] = dict(momentums)
        checkpoint.optimizer_groups.append(
            OptimizerGroup(
                name=group.string(_OPTIMIZER_GROUP["group_name"]) or "",
                step=group.scalar(_OPTIMIZER_GROUP["step"], n.Int64Flags, 0),
                initial_learning_rate=group.scalar(_OPTIMIZER_GROUP["initial_learning_rate"], n.Float32Flags, 0.0),
                states=states,
            )
        )
    bag = root.table(_CHECKPOINT["property_bag"])
    if bag is not None:
        for kind, flags in (("ints", n.Int64Flags), ("floats", n.Float32Flags), ("strings", None)):
            for prop in bag.tables(_PROPERTY_BAG[kind]) or []:
                value = (prop.string(_PROPERTY["value"]) or "") if flags is None else prop.scalar(_PROPERTY["value"], flags, 0)
                checkpoint.properties[prop.string(_PROPERTY["name"]) or ""] = value
    return checkpoint


class _ExternalData:
    """The ``<checkpoint>.data`` file that checkpoints of large models keep their tensors in."""

    def __init__(self, path: Path):
        self.path = path
        self._data: np.ndarray | None = None

    def read(self, offset: int, nbytes: int, name: str) -> np.ndarray:
        if self._data is None:
            if not self.path.is_file():
                raise ValueError(f"tensor {name!r} is in the external data file {self.path}, which does not exist")
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        if offset + nbytes > len(self._data):
            raise ValueError(f"tensor {name!r} lies past the end of {self.path}")
        return np.array(self._data[offset : offset + nbytes])


def _read_tensor(table: _Table, external: _ExternalData, nominal: bool) -> tuple[str, np.ndarray]:
    from flatbuffers import number_types as n

    name = table.string(_TENSOR["name"]) or ""
    dims = table.numbers(_TENSOR["dims"], n.Int64Flags)
    shape = tuple(int(d) for d in dims) if dims is not None else ()
    code = table.scalar(_TENSOR["data_type"], n.Int32Flags, 0)
    try:
        dtype = ir.DataType(code)
    except ValueError:
        raise ValueError(f"tensor {name!r} has an unknown element type code {code}") from None
    if dtype == ir.DataType.STRING:
        return name, np.array(table.strings(_TENSOR["string_data"]), dtype=object).reshape(shape)
    numpy_dtype = dtype.numpy()
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * np.dtype(numpy_dtype).itemsize
    offset = table.scalar(_TENSOR["external_data_offset"], n.Int64Flags, -1)
    raw: np.ndarray | None
    if offset >= 0:
        raw = external.read(offset, nbytes, name)
    else:
        raw = table.numbers(_TENSOR["raw_data"], n.Uint8Flags)
        if raw is None:
            if nominal:  # a nominal checkpoint names its tensors without their data
                return name, np.zeros(shape, dtype=numpy_dtype)
            raise ValueError(f"tensor {name!r} has no data")
    if len(raw) != nbytes:
        raise ValueError(f"tensor {name!r} of shape {list(shape)} and type {dtype.name} holds {len(raw)} bytes, not {nbytes}")
    array = np.frombuffer(raw.tobytes(), dtype=numpy_dtype).reshape(shape)
    return name, array.byteswap() if sys.byteorder == "big" else array
