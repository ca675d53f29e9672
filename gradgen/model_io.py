"""Loading and saving models: clear errors for bad files, atomic writes, input never overwritten."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

import onnx
import onnx_ir as ir

from gradgen.errors import ModelError, UsageError

ModelLike = Union[str, os.PathLike, onnx.ModelProto, ir.Model]

# Models whose protobuf would pass this size are written with their tensors as external data.
_EXTERNAL_DATA_THRESHOLD = 1 << 30


def load_model(model: ModelLike) -> ir.Model:
    """Return an onnx_ir model from a path, a ModelProto or an ir.Model (which is returned as is)."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return _from_proto(model, "<in-memory model>")
    path = Path(model)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, not an ONNX model file")
    try:
        proto = onnx.load(str(path), load_external_data=True)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning, ... on bad bytes
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise ModelError(f"{path}: not an ONNX model (no graph or no ir_version; truncated file?)")
    return _from_proto(proto, str(path))


def _from_proto(proto: onnx.ModelProto, where: str) -> ir.Model:
    try:
        return ir.from_proto(proto)
    except Exception as exc:
        raise ModelError(f"{where}: malformed ONNX model ({type(exc).__name__}: {exc})") from None


def check_output_path(out: str | os.PathLike, *inputs: str | os.PathLike) -> Path:
    """Refuse an output path that is one of the inputs or whose directory does not exist."""
    out_path = Path(out)
    for source in inputs:
        source_path = Path(source)
        if out_path.resolve() == source_path.resolve() or (
            out_path.exists() and source_path.exists() and os.path.samefile(out_path, source_path)
        ):
            raise UsageError(f"{out_path}: the output must not be the input model; choose another path")
    parent = out_path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{out_path}: output directory {parent} does not exist")
    if out_path.is_dir():
        raise UsageError(f"{out_path}: is a directory; give a file name for the output")
    return out_path


def save_model(model: ir.Model | onnx.ModelProto, out: str | os.PathLike) -> Path:
    """Write a model atomically: to a temporary file beside ``out``, then rename.

    On failure nothing is left behind. Models too large for one protobuf get their tensors as
    external data in ``<out>.data``.
    """
    out_path = Path(out)
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.resolve().parent)
    os.close(fd)
    try:
        if proto.ByteSize() > _EXTERNAL_DATA_THRESHOLD:
            onnx.save_model(proto, tmp_name, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=out_path.name + ".data")
        else:
            onnx.save_model(proto, tmp_name)
        os.replace(tmp_name, out_path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return out_path
