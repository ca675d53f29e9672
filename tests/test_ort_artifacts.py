"""ONNX Runtime training's training models run on gradgen's executor, with the same gradients.

tests/fixtures/ort_artifacts/<sample>/ holds what scripts/make_ort_artifacts.py made with
onnxruntime-training 1.19.2 for samples/<sample>/model.onnx (docs/ORT_ARTIFACTS.md):
training_model.onnx, meta.json, and ORT's own results (ort_outputs.npz: graph outputs and the
gradients the training API accumulated; ort_nodes.npz: inputs and outputs of every non-standard node).
tests/fixtures/ort_artifacts/ort_ops.{json,npz} are single-node cases ORT computed. So the kernels are
compared with the incumbent even where onnxruntime-training is not installed; where it is, the
training models also run in it live.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gradgen.executor import Session
from gradgen.kernels import registry

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "ort_artifacts"
SAMPLE_DIRS = sorted(p.parent for p in FIXTURES.glob("*/meta.json"))
BUILT = [p for p in SAMPLE_DIRS if (p / "training_model.onnx").exists()]
WITH_ORT = [p for p in BUILT if (p / "ort_outputs.npz").exists()]
BUFFER_SUFFIX = "_grad.accumulation.buffer"


def _ids(paths):
    return [p.name for p in paths]


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _meta(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


def assert_close(actual, expected, what: str, rtol=1e-4, atol_scale=1e-5):
    """float32 comparison: rtol 1e-4, atol 1e-5 of the largest reference element."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    if expected.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected, err_msg=what)
        return
    atol = atol_scale * float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol, err_msg=what)


def training_feeds(model: onnx.ModelProto, sample: str, lazy_reset_grad: bool = True) -> dict[str, np.ndarray]:
    """The sample's inputs, its parameters (from the forward model), zero gradient buffers, the flag."""
    forward = onnx.load(str(ROOT / "samples" / sample / "model.onnx"))
    params = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    inputs = _npz(ROOT / "samples" / sample / "inputs.npz")
    feeds = {}
    for value in model.graph.input:
        name = value.name
        if name in inputs:
            feeds[name] = inputs[name]
        elif name in params:
            feeds[name] = params[name].copy()
        elif name.endswith(BUFFER_SUFFIX):
            feeds[name] = np.zeros_like(params[name[: -len(BUFFER_SUFFIX)]])
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([lazy_reset_grad])
        else:
            raise AssertionError(f"unexpected training model input {name!r}")
    return feeds


def _attributes(node: onnx.NodeProto) -> dict:
    attrs = {}
    for attr in node.attribute:
        value = onnx.helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        attrs[attr.name] = value
    return attrs


def call_kernel(domain: str, op_type: str, inputs: list, attrs: dict, num_outputs: int) -> tuple:
    entry = registry.lookup(domain, op_type)
    assert entry is not None and entry.cpu is not None, f"no CPU kernel for {domain}::{op_type}"
    attrs = dict(attrs)
    if entry.wants_num_outputs:
        attrs["_num_outputs"] = num_outputs
    result = entry.cpu(*inputs, **attrs)
    return result if isinstance(result, tuple) else (result,)


# ---------------------------------------------------------------- whole training models


@pytest.mark.parametrize("directory", SAMPLE_DIRS, ids=_ids(SAMPLE_DIRS))
def test_fixture_made(directory):
    meta = _meta(directory)
    if "generate_error" in meta:
        pytest.skip(f"ORT training could not build {directory.name}: {meta['generate_error']}")
    assert (directory / "training_model.onnx").exists()
    assert meta["onnxruntime"] == "1.19.2"


@pytest.mark.parametrize("directory", BUILT, ids=_ids(BUILT))
def test_training_model_gradients_match_torch(directory):
    """gradgen runs ORT's training model; the accumulated gradients equal PyTorch's."""
    meta = _meta(directory)
    model = onnx.load(str(directory / "training_model.onnx"))
    feeds = training_feeds(model, directory.name)
    outputs = Session(model).run(feeds)
    reference = _npz(ROOT / "samples" / directory.name / "reference.npz")
    assert_close(outputs["loss"], reference["loss"].astype(np.float32), "loss")
    for param in meta["requires_grad"]:
        # InPlaceAccumulatorV2 writes the gradient into the fed buffer, as in ORT.
        assert_close(feeds[param + BUFFER_SUFFIX], reference[f"{param}_grad"], f"{param} gradient")
        flag = outputs[f"{param}_grad.accumulation.out"]
        assert flag.dtype == np.bool_ and flag.all()
    assert meta["graph_outputs"] == list(outputs)


@pytest.mark.parametrize("directory", WITH_ORT, ids=_ids(WITH_ORT))
def test_training_model_matches_ort_recorded(directory):
    """gradgen's outputs and gradients equal what ORT training computed (recorded in the fixture)."""
    meta = _meta(directory)
    model = onnx.load(str(directory / "training_model.onnx"))
    feeds = training_feeds(model, directory.name)
    outputs = Session(model).run(feeds)
    recorded = _npz(directory / "ort_outputs.npz")
    for name, value in outputs.items():
        assert_close(value, recorded[f"out/{name}"], f"output {name}")
    for param in meta["requires_grad"]:
        assert_close(feeds[param + BUFFER_SUFFIX], recorded[f"grad/{param}"], f"{param} gradient (ORT Module.train_step)")


def test_gradients_accumulate_without_lazy_reset():
    """lazy_reset_grad=False adds the new gradient to the buffer; True overwrites it."""
    directory = FIXTURES / "mlp"
    model = onnx.load(str(directory / "training_model.onnx"))
    session = Session(model)
    feeds = training_feeds(model, "mlp")
    session.run(feeds)
    first = {k: v.copy() for k, v in feeds.items() if k.endswith(BUFFER_SUFFIX)}
    feeds["lazy_reset_grad"] = np.array([False])
    session.run(feeds)
    for name, value in first.items():
        assert_close(feeds[name], 2 * value, name)
    feeds["lazy_reset_grad"] = np.array([True])
    session.run(feeds)
    for name, value in first.items():
        assert_close(feeds[name], value, name)


@pytest.mark.parametrize("directory", BUILT, ids=_ids(BUILT))
def test_training_model_matches_ort_live(directory):
    """Where onnxruntime-training is installed: run the training model in ORT and in gradgen."""
    pytest.importorskip("onnxruntime.training")
    import onnxruntime as ort

    meta = _meta(directory)
    if "run_error" in meta:
        pytest.skip(f"ORT training cannot run {directory.name}: {meta['run_error']}")
    model = onnx.load(str(directory / "training_model.onnx"))
    ort_feeds = training_feeds(model, directory.name)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    grads = [f"{p}_grad" for p in meta["requires_grad"]]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(g) for g in grads)
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(None, ort_feeds)))
    feeds = training_feeds(model, directory.name)
    outputs = Session(model).run(feeds)
    for name, value in outputs.items():
        assert_close(value, expected[name], f"output {name}")
    for param, grad in zip(meta["requires_grad"], grads):
        assert_close(feeds[param + BUFFER_SUFFIX], expected[grad], f"{param} gradient")


# ---------------------------------------------------------------- kernels against ORT's recorded values


def _node_cases():
    cases = []
    for directory in WITH_ORT:
        model = onnx.load(str(directory / "training_model.onnx"))
        recorded = _npz(directory / "ort_nodes.npz")
        for index, node in enumerate(model.graph.node):
            key = f"{index:03d}_{node.op_type}"
            if f"{key}/out0" in recorded:
                cases.append(pytest.param(directory.name, node, key, recorded, id=f"{directory.name}/{key}"))
    return cases


@pytest.mark.parametrize("sample, node, key, recorded", _node_cases())
def test_node_matches_ort(sample, node, key, recorded):
    """Each non-standard node of the training models, on the inputs ORT fed it, gives ORT's outputs."""
    inputs = [np.array(recorded[f"{key}/in{i}"], copy=True) if name else None for i, name in enumerate(node.input)]
    outputs = call_kernel(node.domain, node.op_type, inputs, _attributes(node), len(node.output))
    for i, name in enumerate(node.output):
        if name:
            assert_close(outputs[i], recorded[f"{key}/out{i}"], f"{sample} {key} output {i}")


# ORT 1.19.2's CPU AveragePoolGrad for three spatial axes maps dX and dY with the wrong strides
# (and assigns where windows overlap instead of adding), so its result is not the gradient of
# AveragePool. gradgen computes the true gradient; these cases are checked as adjoints instead.
ORT_BUGS = {"AveragePoolGrad_3d_include0", "AveragePoolGrad_3d_include1"}


def _op_cases():
    index_path = FIXTURES / "ort_ops.json"
    if not index_path.exists():
        return []
    index = json.loads(index_path.read_text())
    recorded = _npz(FIXTURES / "ort_ops.npz")
    return [pytest.param(name, spec, recorded, id=name) for name, spec in index.items() if name not in ORT_BUGS]


@pytest.mark.parametrize("name, spec, recorded", _op_cases())
def test_op_case_matches_ort(name, spec, recorded):
    """Single-node cases (other attributes, optional inputs and outputs) against ORT's outputs."""
    inputs = [
        np.array(recorded[f"{name}/in{i}"], copy=True) if f"{name}/in{i}" in recorded else None for i in range(spec["num_inputs"])
    ]
    outputs = call_kernel(spec["domain"], spec["op_type"], inputs, spec["attributes"], spec["num_outputs"])
    assert len(outputs) == spec["num_outputs"]
    for i in range(spec["num_outputs"]):
        assert_close(outputs[i], recorded[f"{name}/out{i}"], f"{name} output {i}")


@pytest.mark.parametrize("name", sorted(ORT_BUGS) + ["AveragePoolGrad_2d_pad_stride_include0", "AveragePoolGrad_1d_include1"])
def test_average_pool_grad_is_the_adjoint(name):
    """<AveragePool(x), dy> == <x, AveragePoolGrad(dy)> for the recorded cases, ORT's 3-D ones included."""
    spec = json.loads((FIXTURES / "ort_ops.json").read_text())[name]
    recorded = _npz(FIXTURES / "ort_ops.npz")
    dy = recorded[f"{name}/in0"]
    (dx,) = call_kernel("", "AveragePoolGrad", [dy], spec["attributes"], 1)
    x = np.random.default_rng(3).standard_normal(dx.shape)
    (y,) = call_kernel("", "AveragePool", [x], spec["attributes"], 1)
    assert y.shape == dy.shape
    np.testing.assert_allclose(np.vdot(y, dy), np.vdot(x, dx), rtol=1e-5)
    if name in ORT_BUGS:
        assert not np.allclose(dx, recorded[f"{name}/out0"], rtol=1e-4, atol=1e-5), "ORT's 3-D AveragePoolGrad got fixed?"


def test_in_place_accumulator_writes_the_buffer():
    buffer = np.ones((2, 3), np.float32)
    value = np.full((2, 3), 2.0, np.float32)
    flag, out = call_kernel("com.microsoft", "InPlaceAccumulatorV2", [buffer, value, np.array([False])], {}, 2)
    assert flag.tolist() == [True] and out is buffer
    np.testing.assert_array_equal(buffer, np.full((2, 3), 3.0, np.float32))
    readonly = np.zeros(3, np.float32)
    readonly.flags.writeable = False
    (flag,) = call_kernel("com.microsoft", "InPlaceAccumulatorV2", [readonly, np.ones(3, np.float32)], {}, 1)
    assert flag.tolist() == [True] and not readonly.any()


def test_every_training_op_has_a_kernel():
    """Every op type of the fixtures' training models has a gradgen CPU kernel."""
    for directory in BUILT:
        for domain, op_type in _meta(directory)["ops"]:
            entry = registry.lookup(domain, op_type)
            assert entry is not None and entry.cpu is not None, f"{directory.name}: no CPU kernel for {domain}::{op_type}"
