#!/usr/bin/env python
"""Make the ONNX Runtime training fixtures: tests/fixtures/ort_artifacts/<sample>/.

For every sample model (samples/<name>/model.onnx, whose first output is the scalar ``loss``) this
script calls ``onnxruntime.training.artifacts.generate_artifacts`` with ``loss=None`` (the graph
already ends in its loss: ORT then differentiates the first graph output, ``loss``) and
``requires_grad`` = every float initializer that has a reference gradient in reference.npz
(``frozen_params`` = the other float initializers), and keeps only the training model. It then runs
that training model in ONNX Runtime training itself and records, next to it:

* ``training_model.onnx``  the training model exactly as generate_artifacts wrote it;
* ``meta.json``            ORT version, the sample's inputs, the parameters (requires_grad and
                           frozen), the gradient names ORT used, the accumulation buffer inputs, the
                           graph inputs and outputs, and the op types of the training graph;
* ``ort_outputs.npz``      what ORT training computed for the sample's inputs: every graph output
                           (``out/<name>``) and every parameter gradient as the training API
                           (``Module.train_step``) left it in the gradient buffer (``grad/<param>``);
* ``ort_nodes.npz``        the inputs and outputs of every node of the training graph whose op is not
                           in the ONNX standard (com.microsoft ops, and MaxPoolGrad/AveragePoolGrad,
                           which ORT registers in the default domain) as ORT computed them
                           (``<index>_<op>/in<i>``, ``<index>_<op>/out<i>``), for per-kernel tests.

A sample ORT cannot build or run gets a meta.json saying why (``generate_error``, ``run_error``).
At the top level, ``ort_ops.json`` and ``ort_ops.npz`` hold single-node cases of the same ops (and
a few related ones) with other attributes and optional inputs/outputs, computed by ORT.

It needs a separate environment with ONNX Runtime training, whose last wheels (1.19.2) stop at
Python 3.11 (ORT training's import also needs torch); make it outside the repository::

    python3.11 -m venv ../ortvenv
    ../ortvenv/bin/pip install "onnxruntime-training-cpu==1.19.2" "numpy<2" "onnx==1.16.*" torch
    ../ortvenv/bin/python scripts/make_ort_artifacts.py [--only NAME]... [--out DIR]

It does not import gradgen.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "ort_artifacts"
SAMPLE_NAMES = ["mlp", "cnn", "embedding", "slicing", "gather_elements", "broadcast", "transformer"]
STANDARD_DOMAINS = ("", "ai.onnx")


def is_standard(node: onnx.NodeProto) -> bool:
    """An op of the ONNX standard (ORT also puts MaxPoolGrad and friends in the default domain)."""
    return node.domain in STANDARD_DOMAINS and onnx.defs.has(node.op_type)


def load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def float_initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
    return [t for t in model.graph.initializer if t.data_type in floats]


def plain_session(model: onnx.ModelProto):
    """An InferenceSession of the training build with every graph optimization off."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def training_feeds(model: onnx.ModelProto, inputs: dict, params: dict) -> dict[str, np.ndarray]:
    """Feeds for the training model: sample inputs, parameters, zero gradient buffers, lazy_reset_grad."""
    feeds = {}
    for value in model.graph.input:
        name = value.name
        if name in inputs:
            feeds[name] = inputs[name]
        elif name in params:
            feeds[name] = params[name]
        elif name.endswith(".accumulation.buffer"):
            feeds[name] = np.zeros_like(params[name[: -len("_grad.accumulation.buffer")]])
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([True])
        else:
            raise RuntimeError(f"do not know how to feed training model input {name!r}")
    return feeds


def record_nodes(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Every input and output of the non-standard nodes, as ORT computes them (no graph optimization)."""
    wanted = []
    for node in model.graph.node:
        if not is_standard(node):
            wanted.extend(n for n in list(node.input) + list(node.output) if n)
    graph_inputs = {v.name for v in model.graph.input}
    existing = {v.name for v in model.graph.output}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name in dict.fromkeys(wanted):
        if name not in existing and name not in graph_inputs and name not in {t.name for t in model.graph.initializer}:
            copy.graph.output.append(helper.make_empty_tensor_value_info(name))
    session = plain_session(copy)
    names = [o.name for o in session.get_outputs()]
    # The accumulators write into their buffers: feed fresh copies.
    values = dict(zip(names, session.run(None, {k: np.array(v, copy=True) for k, v in feeds.items()})))
    values.update({k: v for k, v in feeds.items()})
    values.update({t.name: numpy_helper.to_array(t) for t in model.graph.initializer})
    record = {}
    for index, node in enumerate(model.graph.node):
        if is_standard(node):
            continue
        key = f"{index:03d}_{node.op_type}"
        for i, name in enumerate(node.input):
            if name:
                record[f"{key}/in{i}"] = np.asarray(values[name])
        for i, name in enumerate(node.output):
            if name:
                record[f"{key}/out{i}"] = np.asarray(values[name])
    return record


def train_step_gradients(workdir: Path, inputs: dict, user_inputs: list[str]) -> tuple[dict, list]:
    """Run one Module.train_step of the training API; return the gradient buffers and the outputs."""
    from onnxruntime.training import api

    state = api.CheckpointState.load_checkpoint(str(workdir / "checkpoint"))
    module = api.Module(str(workdir / "training_model.onnx"), state, str(workdir / "eval_model.onnx"), device="cpu")
    module.train()
    module.lazy_reset_grad()
    outputs = module(*[inputs[name] for name in user_inputs])
    if not isinstance(outputs, (list, tuple)):
        outputs = [outputs]
    grads = {}
    for name, parameter in state.parameters:
        if parameter.requires_grad:
            grads[name] = np.array(parameter.grad)
    return grads, [np.asarray(o) for o in outputs]


# Optional forward outputs that ORT training's gradient builders read (O(1), O(2)) and PyTorch's
# exporter leaves out: without them, building the gradient fails with
# "i < node_->OutputDefs().size() was false".
OPTIONAL_OUTPUTS = {
    "SoftmaxCrossEntropyLoss": ["log_prob"],
    "LayerNormalization": ["Mean", "InvStdDev"],
}


def add_optional_outputs(model: onnx.ModelProto) -> list[str]:
    """Give the nodes of OPTIONAL_OUTPUTS their missing optional outputs; return the names added.

    The values the graph computes (its loss included) are unchanged.
    """
    added = []
    for index, node in enumerate(model.graph.node):
        extra = OPTIONAL_OUTPUTS.get(node.op_type) if node.domain in STANDARD_DOMAINS else None
        if not extra:
            continue
        base = node.name or f"{node.op_type}_{index}"
        for position, suffix in enumerate(extra, start=1):
            if len(node.output) <= position:
                node.output.append(f"{base}_{suffix}")
                added.append(node.output[-1])
            elif not node.output[position]:
                node.output[position] = f"{base}_{suffix}"
                added.append(node.output[position])
    return added


def make_one(name: str, out_root: Path) -> dict:
    import onnxruntime
    from onnxruntime.training import artifacts

    sample = SAMPLES / name
    model = onnx.load(str(sample / "model.onnx"))
    inputs = load_npz(sample / "inputs.npz")
    reference = load_npz(sample / "reference.npz")
    meta = json.loads((sample / "meta.json").read_text())
    if model.graph.output[0].name != "loss":
        raise RuntimeError(f"{name}: the first graph output is {model.graph.output[0].name!r}, not 'loss'")
    prepared = add_optional_outputs(model)
    params = {t.name: numpy_helper.to_array(t) for t in float_initializers(model)}
    requires_grad = [p for p in params if f"{p}_grad" in reference]
    frozen = [p for p in params if p not in requires_grad]
    user_inputs = [v.name for v in model.graph.input if v.name not in {t.name for t in model.graph.initializer}]

    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    info = {
        "sample": name,
        "onnxruntime": onnxruntime.__version__,
        "onnx": onnx.__version__,
        "generate_artifacts": {"loss": None, "optimizer": None},
        "forward_opset": meta.get("opset"),
        "user_inputs": user_inputs,
        "optional_outputs_added": prepared,
        "requires_grad": requires_grad,
        "frozen_params": frozen,
    }
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        try:
            artifacts.generate_artifacts(
                model, requires_grad=requires_grad, frozen_params=frozen, loss=None, optimizer=None, artifact_directory=workdir
            )
        except Exception as exc:
            info["generate_error"] = first_line(exc)
            write_meta(out, info)
            return info
        training = onnx.load(str(workdir / "training_model.onnx"))
        shutil.copyfile(workdir / "training_model.onnx", out / "training_model.onnx")
        op_types = sorted({(n.domain, n.op_type, is_standard(n)) for n in training.graph.node})
        info.update(
            {
                "opset_imports": {o.domain or "ai.onnx": o.version for o in training.opset_import},
                "gradients": {p: f"{p}_grad" for p in requires_grad},
                "accumulation_buffers": [v.name for v in training.graph.input if v.name.endswith(".accumulation.buffer")],
                "graph_inputs": [v.name for v in training.graph.input],
                "graph_outputs": [v.name for v in training.graph.output],
                "ops": [[d, t] for d, t, _ in op_types],
                "non_standard_ops": [[d, t] for d, t, standard in op_types if not standard],
            }
        )
        try:
            grads, api_outputs = train_step_gradients(workdir, inputs, user_inputs)
        except Exception as exc:
            info["run_error"] = first_line(exc)
            write_meta(out, info)
            return info

    feeds = training_feeds(training, inputs, params)
    session = plain_session(training)
    output_names = [o.name for o in session.get_outputs()]
    run = dict(zip(output_names, session.run(None, {k: np.array(v, copy=True) for k, v in feeds.items()})))
    for api_value, output in zip(api_outputs, output_names):
        if not np.allclose(api_value, run[output], rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"{name}: output {output!r} differs between Module.train_step and InferenceSession")
    record = {f"out/{k}": v for k, v in run.items()}
    record.update({f"grad/{k}": v for k, v in grads.items()})
    np.savez_compressed(out / "ort_outputs.npz", **record)
    np.savez_compressed(out / "ort_nodes.npz", **record_nodes(training, feeds))
    write_meta(out, info)
    return info


# ---------------------------------------------------------------- single-node cases


def _rng_cases():
    """(case name, domain, op_type, inputs (None for an omitted one), attributes, output count)."""
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    ms = "com.microsoft"
    cases = []
    x, dy = f32(3, 4, 5), f32(3, 4, 5)
    for op in ("ReluGrad", "TanhGrad", "SigmoidGrad", "GeluGrad", "FastGeluGrad"):
        y = x if op in ("ReluGrad", "GeluGrad", "FastGeluGrad") else (np.tanh(x) if op == "TanhGrad" else 1 / (1 + np.exp(-x)))
        cases.append((op, ms, op, [dy, y.astype(np.float32)], {}, 1))
    for op in ("BiasGeluGrad_dX", "BiasFastGeluGrad_dX"):
        cases.append((op, ms, op, [dy, x, f32(5)], {}, 1))
    cases.append(("Scale_mul", ms, "Scale", [x, np.array(2.5, np.float32)], {}, 1))
    cases.append(("Scale_down_int", ms, "Scale", [x, np.array(3, np.int64)], {"scale_down": 1}, 1))
    cases.append(("Scale_down_float", ms, "Scale", [x, np.array([0.7], np.float32)], {"scale_down": 1}, 1))
    y = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    for axis in (0, 1, -1):
        ys = np.exp(x) / np.exp(x).sum(axis=axis, keepdims=True)
        cases.append((f"SoftmaxGrad_13_axis{axis}", ms, "SoftmaxGrad_13", [dy, ys.astype(np.float32)], {"axis": axis}, 1))
        cases.append(
            (f"LogSoftmaxGrad_13_axis{axis}", ms, "LogSoftmaxGrad_13", [dy, np.log(ys).astype(np.float32)], {"axis": axis}, 1)
        )
    y2 = np.exp(x) / np.exp(x).reshape(3, -1).sum(axis=1).reshape(3, 1, 1)
    cases.append(("SoftmaxGrad_axis1", ms, "SoftmaxGrad", [dy, y2.astype(np.float32)], {"axis": 1}, 1))
    cases.append(("LogSoftmaxGrad_axis1", ms, "LogSoftmaxGrad", [dy, np.log(y2).astype(np.float32)], {"axis": 1}, 1))
    del y
    # SoftmaxCrossEntropyLossGrad on (N, C, D) with weights and an ignored label.
    logits = f32(4, 5, 3)
    log_prob = (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)
    label = rng.integers(0, 5, size=(4, 3)).astype(np.int64)
    label[1, 2] = -1
    label[3, 0] = -1
    weight = rng.uniform(0.5, 2.0, size=5).astype(np.float32)
    scalar = np.array(0.8, np.float32)
    sce = "SoftmaxCrossEntropyLossGrad"
    cases.append(("SCEGrad_mean_weight", ms, sce, [scalar, log_prob, label, weight], {"ignore_index": -1}, 1))
    cases.append(("SCEGrad_sum", ms, sce, [scalar, log_prob, label], {"ignore_index": -1, "reduction": "sum"}, 1))
    cases.append(
        ("SCEGrad_none_weight", ms, sce, [f32(4, 3), log_prob, label, weight], {"ignore_index": -1, "reduction": "none"}, 1)
    )
    cases.append(("SCEGrad_mean_2d", ms, sce, [scalar, log_prob[:, :, 0], np.where(label[:, 0] < 0, 2, label[:, 0])], {}, 1))
    # FusedMatMul.
    fm = "FusedMatMul"
    cases.append(("FusedMatMul_tAtB_alpha", ms, fm, [f32(2, 5, 3), f32(2, 4, 5)], {"transA": 1, "transB": 1, "alpha": 0.5}, 1))
    cases.append(("FusedMatMul_tBatchA", ms, fm, [f32(3, 2, 4), f32(2, 4, 5)], {"transBatchA": 1}, 1))
    cases.append(("FusedMatMul_tBatchB_tB", ms, fm, [f32(2, 3, 4), f32(5, 2, 4)], {"transBatchB": 1, "transB": 1}, 1))
    cases.append(("FusedMatMul_broadcast_tA", ms, fm, [f32(4, 3), f32(2, 4, 5)], {"transA": 1}, 1))
    cases.append(("FusedMatMul_vector", ms, fm, [f32(3, 4), f32(4)], {"transA": 0, "alpha": 2.0}, 1))
    # LayerNormalizationGrad (axis 1 of a 3-D input), mean and inv_std_var as LayerNormalization stores them.
    xl = f32(2, 3, 4)
    mean = xl.reshape(2, -1).mean(axis=1).reshape(2, 1, 1).astype(np.float32)
    inv = (1 / np.sqrt(((xl - mean) ** 2).reshape(2, -1).mean(axis=1) + 1e-5)).reshape(2, 1, 1).astype(np.float32)
    gamma = f32(3, 4)
    cases.append(
        ("LayerNormalizationGrad_axis1", ms, "LayerNormalizationGrad", [f32(2, 3, 4), xl, gamma, mean, inv], {"axis": 1}, 3)
    )
    rms = (1 / np.sqrt((xl**2).reshape(2, -1).mean(axis=1) + 1e-5)).reshape(2, 1, 1).astype(np.float32)
    cases.append(
        (
            "SimplifiedLayerNormalizationGrad_axis1",
            ms,
            "SimplifiedLayerNormalizationGrad",
            [f32(2, 3, 4), xl, gamma, rms],
            {"axis": 1},
            2,
        )
    )
    # Gradient accumulation.
    acc = "InPlaceAccumulatorV2"
    cases.append(("InPlaceAccumulatorV2_add", ms, acc, [f32(3, 4), f32(3, 4), np.array([False])], {}, 2))
    cases.append(("InPlaceAccumulatorV2_overwrite", ms, acc, [f32(3, 4), f32(3, 4), np.array([True])], {}, 2))
    cases.append(("InPlaceAccumulatorV2_no_flag", ms, acc, [f32(3, 4), f32(3, 4)], {}, 2))
    cases.append(("ZeroGradient", ms, "ZeroGradient", [f32(3, 4), f32(2)], {}, 1))
    return cases


def _pool_cases():
    """MaxPoolGrad / AveragePoolGrad cases whose dY and Indices come from ORT's own MaxPool/AveragePool."""
    rng = np.random.default_rng(1)
    configs = [
        ("2d_pad_stride", [1, 2, 7, 7], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
        ("2d_rect", [2, 1, 6, 8], {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [0, 1, 0, 1]}),
        ("1d", [2, 3, 9], {"kernel_shape": [3], "strides": [3]}),
        ("3d", [1, 2, 4, 5, 4], {"kernel_shape": [2, 3, 2], "strides": [2, 2, 2], "pads": [0, 1, 0, 0, 1, 0]}),
    ]
    cases = []
    for name, shape, attrs in configs:
        x = rng.standard_normal(shape).astype(np.float32)
        y, indices = run_single("", "MaxPool", [x], attrs, 2)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        cases.append((f"MaxPoolGrad_{name}", "", "MaxPoolGrad", [dy, indices], attrs, 1))
        for include in (0, 1):
            avg_attrs = dict(attrs, count_include_pad=include)
            (y,) = run_single("", "AveragePool", [x], avg_attrs, 1)
            dy = rng.standard_normal(y.shape).astype(np.float32)
            cases.append((f"AveragePoolGrad_{name}_include{include}", "", "AveragePoolGrad", [dy], avg_attrs, 1))
    return cases


def single_node_model(domain, op_type, inputs, attrs, n_outputs, output_shapes=None):
    names = [f"in{i}" if value is not None else "" for i, value in enumerate(inputs)]
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for n, v in zip(names, inputs)
        if v is not None
    ]
    outs = [f"out{i}" for i in range(n_outputs)]
    if output_shapes is not None:
        graph_outputs = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, s) for n, s in zip(outs, output_shapes)]
    else:
        graph_outputs = [helper.make_empty_tensor_value_info(n) for n in outs]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **attrs)
    graph = helper.make_graph([node], op_type, graph_inputs, graph_outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def run_single(domain, op_type, inputs, attrs, n_outputs, output_shapes=None):
    model = single_node_model(domain, op_type, inputs, attrs, n_outputs, output_shapes)
    session = plain_session(model)
    feeds = {f"in{i}": np.array(v, copy=True) for i, v in enumerate(inputs) if v is not None}
    return session.run(None, feeds)


def make_op_cases(out_root: Path) -> list[str]:
    """Run the single-node cases in ORT; write ort_ops.npz and ort_ops.json; return the case names."""
    record, index = {}, {}
    for name, domain, op_type, inputs, attrs, n_outputs in _rng_cases() + _pool_cases():
        output_shapes = None
        if op_type in ("MaxPoolGrad", "AveragePoolGrad"):
            # ORT takes dX's shape from the graph: declare X's shape, as a training graph does.
            output_shapes = [list(_pool_x_shape(name))]
        outputs = run_single(domain, op_type, inputs, attrs, n_outputs, output_shapes)
        for i, value in enumerate(inputs):
            if value is not None:
                record[f"{name}/in{i}"] = value
        for i, value in enumerate(outputs):
            record[f"{name}/out{i}"] = np.asarray(value)
        index[name] = {
            "domain": domain,
            "op_type": op_type,
            "attributes": attrs,
            "num_inputs": len(inputs),
            "num_outputs": n_outputs,
        }
    np.savez_compressed(out_root / "ort_ops.npz", **record)
    (out_root / "ort_ops.json").write_text(json.dumps(index, indent=1) + "\n")
    return list(index)


def _pool_x_shape(case: str) -> list[int]:
    shapes = {"2d_pad_stride": [1, 2, 7, 7], "2d_rect": [2, 1, 6, 8], "1d": [2, 3, 9], "3d": [1, 2, 4, 5, 4]}
    for key, shape in shapes.items():
        if case.split("Grad_", 1)[1].startswith(key):
            return shape
    raise KeyError(case)


def first_line(exc: Exception) -> str:
    """The gist of an ORT error, without the C++ source location and signature."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    for marker in ("Non-zero status code", "The gradient builder", "i < node_->OutputDefs"):
        if marker in text:
            text = text[text.index(marker) :]
            break
    return f"{type(exc).__name__}: {text}"


def write_meta(out: Path, info: dict) -> None:
    (out / "meta.json").write_text(json.dumps(info, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=SAMPLE_NAMES, help="one sample (repeatable)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    args.out.mkdir(parents=True, exist_ok=True)
    cases = make_op_cases(args.out)
    print(f"single-node cases: {len(cases)} recorded")
    for name in args.only or SAMPLE_NAMES:
        info = make_one(name, args.out)
        if "generate_error" in info:
            print(f"{name}: generate_artifacts failed: {info['generate_error']}")
            continue
        ops = ", ".join(f"{d}::{t}" if d else t for d, t in info["non_standard_ops"])
        status = f"ORT run failed: {info['run_error']}" if "run_error" in info else "ORT outputs recorded"
        print(f"{name}: {len(info['requires_grad'])} gradients; non-standard ops: {ops or '-'}; {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
