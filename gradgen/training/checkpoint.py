"""Checkpoints: one .npz with the parameters, the optimizer states and a JSON record.

Arrays: ``param/<name>`` per parameter, ``state/<kind>/<name>`` per optimizer state, and
``meta``, a JSON string holding the format version, the step, the model fingerprint, the
optimizer kind, the loss, and whatever the caller adds (the data order's seed and batch size,
for instance). The record lists the names, so loading never parses array keys.

A checkpoint is written to a temporary file beside its final name, flushed to disk, and renamed
over it: a crash or Ctrl-C while saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from gradgen.errors import UsageError
from gradgen.training.program import TrainingProgram
from gradgen.training.trainer import TrainState, check_state

FORMAT = 1
FILE_NAME = "checkpoint.npz"


def checkpoint_path(path: str | os.PathLike) -> Path:
    """A checkpoint file, or the checkpoint file of a checkpoint directory."""
    path = Path(path)
    return path / FILE_NAME if path.is_dir() else path


def save_checkpoint(
    path: str | os.PathLike, program: TrainingProgram, state: TrainState, extra: dict[str, Any] | None = None
) -> Path:
    """Write ``state`` atomically to ``path``; ``extra`` (JSON-able) joins the record."""
    from gradgen.model_io import atomic_output

    path = Path(path)
    meta = {
        "format": FORMAT,
        "step": state.step,
        "fingerprint": program.fingerprint,
        "optimizer": program.optimizer.kind,
        "loss": program.loss,
        "added_loss": program.added_loss is not None,
        "params": list(state.params),
        "tied": [list(pair) for pair in program.tied],
        "states": [[param, kind] for param, kind in state.states],
        **(extra or {}),
    }
    arrays: dict[str, Any] = {f"param/{name}": value for name, value in state.params.items()}
    arrays.update({f"state/{kind}/{param}": value for (param, kind), value in state.states.items()})
    arrays["meta"] = np.array(json.dumps(meta))
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as stream:
            np.savez(stream, **arrays)
            stream.flush()
            os.fsync(stream.fileno())
    _sync_directory(path.parent)
    return path


def load_checkpoint(path: str | os.PathLike) -> tuple[TrainState, dict[str, Any]]:
    """The state and the record of a checkpoint written by ``save_checkpoint``."""
    path = checkpoint_path(path)
    if not path.exists():
        raise UsageError(f"{path}: no such checkpoint")
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            params = {name: data[f"param/{name}"] for name in meta["params"]}
            states = {(param, kind): data[f"state/{kind}/{param}"] for param, kind in meta["states"]}
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:  # cut short: a copy or a disk that was full
        raise UsageError(f"{path}: not a complete gradgen checkpoint (truncated or damaged: {exc})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a gradgen checkpoint ({type(exc).__name__}: {exc})") from None
    if meta.get("format") != FORMAT:
        raise UsageError(f"{path}: checkpoint format {meta.get('format')!r}, this gradgen reads {FORMAT}")
    return TrainState(params, states, int(meta["step"])), meta


def check_checkpoint(path: str | os.PathLike, meta: dict[str, Any], state: TrainState, program: TrainingProgram) -> None:
    """The checkpoint belongs to this model, optimizer and loss; one line naming the mismatch if not."""
    where = checkpoint_path(path)
    if meta["fingerprint"] != program.fingerprint:
        raise UsageError(
            f"{where}: the checkpoint is from another model (fingerprint {meta['fingerprint']}, "
            f"this model's is {program.fingerprint})"
        )
    if meta["optimizer"] != program.optimizer.kind:
        raise UsageError(f"{where}: the checkpoint holds {meta['optimizer']} state; this run uses {program.optimizer.kind}")
    if meta["loss"] != program.loss:
        raise UsageError(f"{where}: the checkpoint was trained on loss {meta['loss']!r}, this run on {program.loss!r}")
    if [tuple(pair) for pair in meta.get("tied", [])] != program.tied:
        trained_tied = bool(meta.get("tied"))
        raise UsageError(
            f"{where}: the checkpoint was trained {'with' if trained_tied else 'without'} --tie-weights, "
            f"this run is {'without' if trained_tied else 'with'} it"
        )
    try:
        check_state(program, state)
    except Exception as exc:
        raise UsageError(f"{where}: {exc}") from None


def _sync_directory(directory: Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
