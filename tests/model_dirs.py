"""The sample and fixture models: a directory each with model.onnx, inputs.npz, reference.npz, meta.json."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DIRS = sorted(p.parent for p in (ROOT / "samples").glob("*/model.onnx"))
FIXTURE_DIRS = sorted(p.parent for p in (ROOT / "tests" / "fixtures" / "models").glob("*/model.onnx"))
ALL_DIRS = SAMPLE_DIRS + FIXTURE_DIRS


def dir_id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def load(path: Path):
    """(model proto, inputs dict, reference dict, meta dict) of one model directory."""
    model = onnx.load(str(path / "model.onnx"))
    with np.load(path / "inputs.npz") as data:
        inputs = {k: data[k] for k in data.files}
    with np.load(path / "reference.npz") as data:
        reference = {k: data[k] for k in data.files}
    meta = json.loads((path / "meta.json").read_text())
    return model, inputs, reference, meta


def with_symbolic_batch(model: onnx.ModelProto, batch_inputs: list[str]) -> onnx.ModelProto:
    """A copy whose batch inputs have dimension 0 named 'batch'; inferred shapes are dropped."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for value in copy.graph.input:
        if value.name in batch_inputs:
            value.type.tensor_type.shape.dim[0].dim_param = "batch"
    del copy.graph.value_info[:]
    for value in copy.graph.output:
        dims = value.type.tensor_type.shape.dim
        if len(dims):
            for d in dims:
                d.Clear()
    return copy


def make_samples():
    """The module samples/make_samples.py: the PyTorch classes the samples were exported from (one
    definition for the tests that rebuild them in PyTorch)."""
    if "make_samples" not in sys.modules:
        spec = importlib.util.spec_from_file_location("make_samples", ROOT / "samples" / "make_samples.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["make_samples"] = module
        spec.loader.exec_module(module)
    return sys.modules["make_samples"]
