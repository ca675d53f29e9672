"""Loading and saving models: clear errors for bad files, atomic writes, input never overwritten."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import onnx
import onnx_ir as ir
from onnx import external_data_helper

from gradgen.errors import ModelError, UsageError

ModelLike = Union[str, os.PathLike, onnx.ModelProto, ir.Model]

# Models whose protobuf would pass this size are written with their tensors as external data.
_EXTERNAL_DATA_THRESHOLD = 1 << 30
# ... and then every initializer of at least this many bytes goes to the external data file.
_EXTERNAL_TENSOR_MIN_BYTES = 1024


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
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning, ... on bad bytes
        raise ModelError(f"{path}: not a readable ONNX model, truncated or not ONNX "
                         f"({type(exc).__name__}: {exc})") from None
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise ModelError(f"{path}: not an ONNX model (no graph or no ir_version; truncated file?)")
    bad_opsets = [f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import if o.version < 1]
    if not proto.opset_import or bad_opsets:
        found = f"invalid opset import(s) {', '.join(bad_opsets)}" if bad_opsets else "no opset import"
        raise ModelError(f"{path}: not a valid ONNX model ({found}; truncated file?)")
    _load_external_data(proto, path)
    return _from_proto(proto, str(path))


def _load_external_data(proto: onnx.ModelProto, path: Path) -> None:
    """Read every tensor kept in external data files, relative to the model's directory."""
    base_dir = str(path.resolve().parent)
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        where = f"{path}: tensor {tensor.name!r} keeps its data in {location!r}"
        if location and not (path.resolve().parent / location).is_file():
            raise ModelError(f"{where}, which is not a file next to the model "
                             f"(external data is looked up relative to {base_dir})")
        try:
            external_data_helper.load_external_data_for_tensor(tensor, base_dir)
        except Exception as exc:
            raise ModelError(f"{where}, which cannot be read ({type(exc).__name__}: {exc})") from None


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
    """Write a model atomically: into a temporary directory beside ``out``, then rename.

    On failure nothing is left behind (an existing ``out`` is unchanged). Models whose tensors pass
    ``_EXTERNAL_DATA_THRESHOLD`` bytes in all (too large for one protobuf) get their initializers as
    external data in ``<out name>.data`` next to ``out``: the data file is renamed into place first,
    the model last.
    """
    out_path = Path(out)
    if isinstance(model, onnx.ModelProto):
        model = _from_proto(model, "<in-memory model>")
    data_name = out_path.name + ".data"
    external = _initializer_bytes(model) > _EXTERNAL_DATA_THRESHOLD
    parent = out_path.resolve().parent
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=parent))
    try:
        tmp_model = tmp_dir / out_path.name
        if external:
            ir.save(model, tmp_model, format="protobuf", external_data=data_name,
                    size_threshold_bytes=_EXTERNAL_TENSOR_MIN_BYTES)
        else:
            ir.save(model, tmp_model, format="protobuf")
        if not (tmp_dir / data_name).exists():
            os.replace(tmp_model, out_path)
            return out_path
        # Two renames: keep the previous data file until the model is in place, restore it if not.
        data_path, backup = parent / data_name, tmp_dir / (data_name + ".old")
        had_data = data_path.exists()
        if had_data:
            os.replace(data_path, backup)
        try:
            os.replace(tmp_dir / data_name, data_path)
            os.replace(tmp_model, out_path)
        except BaseException:
            if had_data:
                os.replace(backup, data_path)
            elif data_path.exists():
                data_path.unlink()
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_path


def _initializer_bytes(model: ir.Model) -> int:
    """Bytes held by the model's initializers (subgraphs included)."""
    total = 0
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
    return total
