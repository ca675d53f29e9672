#!/usr/bin/env python
"""gradgen's backward graphs against ONNX Runtime training's own training graph, on ORT's CPU runtime.

One forward + backward step of a benchmark model (``gradgen.bench.models``; default the ResNet-18
preset at batch 4, 224x224, eval-mode BatchNorm, exported as the e2e group exports it), run in
ONNX Runtime training's InferenceSession at one thread (``intra_op_num_threads`` =
``inter_op_num_threads`` = 1, sequential execution, default graph optimizations, every thread
variable set to 1), same inputs and parameters, median of several steps, the graphs taken in turn:

- ``ort``: the training model of ``onnxruntime.training.artifacts.generate_artifacts(loss=None)``
  (the exported graph already ends in its loss; parameters are graph inputs, gradients land in
  zeroed accumulation buffers with ``lazy_reset_grad`` true, i.e. overwritten);
- ``gradgen``: gradgen's default backward graph (``build_backward(model, wrt=parameters)``);
- ``portable``: the same with ``portable=True`` (standard ONNX only).

It also counts each graph's nodes by op type and compares every gradient with ORT's and with
gradgen's default graph's. ORT's training graph replaces an eval-mode BatchNormalization
(training_mode 0) by BatchNormInternal in training mode (batch statistics), so on a model with one
(the ResNet-18 preset) ORT's loss and gradients are those of another function.

Two interpreters take part: this script runs under the one where gradgen is installed (it exports
and builds), and runs itself again under ``--ort-python`` (Python <= 3.11 with
onnxruntime-training 1.19.2, numpy<2, onnx, torch: docs/ORT_ARTIFACTS.md), which imports no gradgen
and does the ORT part. Example::

    python scripts/ort_training_compare.py --ort-python ../ortvenv/bin/python --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def build(workdir: Path, model: str, batch: int, size: int | None) -> dict:
    """Export the model and build gradgen's graphs into ``workdir``; return the file names."""
    import gradgen
    from gradgen.bench import models
    from gradgen.model_io import save_model

    spec = models.preset(model, batch=batch, size=size)
    module = models.build_module(spec)
    inputs = models.make_inputs(spec)
    proto = models.export(module, inputs)
    wrt = models.parameter_names(module)
    files = {"forward": workdir / "forward.onnx", "inputs": workdir / "inputs.npz"}
    import onnx

    onnx.save(proto, files["forward"])
    np.savez(files["inputs"], **inputs)
    for name, portable in (("gradgen", False), ("portable", True)):
        files[name] = workdir / f"{name}.onnx"
        save_model(gradgen.build_backward(proto, wrt=wrt, portable=portable).model, files[name])
    return {"model": spec.title + f" ({spec.shape_text})", "wrt": wrt} | {k: str(v) for k, v in files.items()}


# ------------------------------------------------------------------ the ORT side (no gradgen)


def _ort_training_graph(forward_path: str, wrt: list[str], workdir: Path) -> str:
    import onnx
    from onnxruntime.training import artifacts

    model = onnx.load(forward_path)
    # ORT's gradient builder reads SoftmaxCrossEntropyLoss's log_prob output (scripts/make_ort_artifacts.py).
    for index, node in enumerate(model.graph.node):
        if node.op_type == "SoftmaxCrossEntropyLoss" and len(node.output) < 2:
            node.output.append(f"{node.name or index}_log_prob")
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE}
    frozen = [t.name for t in model.graph.initializer if t.data_type in floats and t.name not in wrt]
    out = workdir / "ort"
    out.mkdir(exist_ok=True)
    artifacts.generate_artifacts(
        model, requires_grad=wrt, frozen_params=frozen, loss=None, optimizer=None, artifact_directory=out
    )
    return str(out / "training_model.onnx")


def _session(path: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _feeds(session, model, inputs: dict) -> dict:
    from onnx import numpy_helper

    params = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    feeds = {}
    for value in session.get_inputs():
        name = value.name
        if name in inputs:
            feeds[name] = inputs[name]
        elif name in params:
            feeds[name] = params[name]
        elif name.endswith("_grad.accumulation.buffer"):
            feeds[name] = np.zeros_like(params[name[: -len("_grad.accumulation.buffer")]])
        elif name == "lazy_reset_grad":
            feeds[name] = np.array([True])
        else:
            raise RuntimeError(f"do not know how to feed {name!r}")
    return feeds


def measure(info: dict, steps: int, warmup: int) -> dict:
    import onnx
    import onnxruntime

    workdir = Path(info["forward"]).parent
    forward = onnx.load(info["forward"])
    with np.load(info["inputs"]) as data:
        inputs = {k: data[k] for k in data.files}
    paths = {"ort": _ort_training_graph(info["forward"], info["wrt"], workdir)}
    paths |= {name: info[name] for name in ("gradgen", "portable")}
    paths |= info.get("also", {})
    report: dict = {"onnxruntime": onnxruntime.__version__, "model": info["model"], "graphs": {}}
    sessions, feeds = {}, {}
    for name, path in paths.items():
        graph = onnx.load(path, load_external_data=False).graph
        counts = collections.Counter(
            (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}") for n in graph.node
        )
        sessions[name] = _session(path)
        feeds[name] = _feeds(sessions[name], forward, inputs)
        report["graphs"][name] = {"nodes": sum(counts.values()), "op_types": dict(counts.most_common()), "ms": []}
    outputs = {}
    for name, session in sessions.items():
        names = [o.name for o in session.get_outputs()]
        for _ in range(warmup):
            values = session.run(None, feeds[name])
        outputs[name] = dict(zip(names, values))
    for _ in range(steps):  # the graphs in turn, so that machine noise falls on all of them
        for name, session in sessions.items():
            t0 = time.perf_counter()
            session.run(None, feeds[name])
            report["graphs"][name]["ms"].append((time.perf_counter() - t0) * 1e3)
    for entry in report["graphs"].values():
        entry["median_ms"] = statistics.median(entry["ms"])
    report["gradients"] = _compare(outputs, info["wrt"])
    return report


def _compare(outputs: dict, wrt: list[str]) -> dict:
    """Per graph, the largest |difference| of a gradient from ORT's and from gradgen's default graph's,
    over that gradient's largest |element|. (ORT's training graph turns an eval-mode
    BatchNormalization into its training form, BatchNormInternal with batch statistics: where the
    model has one, ORT differentiates another function.)"""

    def worst(name: str, reference: str) -> dict:
        err, where = 0.0, None
        for param in wrt:
            want = outputs[reference][f"{param}_grad.accumulation.out" if reference == "ort" else f"{param}_grad"]
            got = outputs[name][f"{param}_grad"]
            e = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
            if e >= err:
                err, where = e, param
        return {"max_rel_to_scale": err, "at": where}

    result: dict = {
        name: {"vs_ort": worst(name, "ort"), "vs_gradgen": worst(name, "gradgen")} for name in outputs if name != "ort"
    }
    result["loss"] = {name: float(outputs[name]["loss"]) for name in outputs}
    return result


def print_report(report: dict) -> None:
    graphs = report["graphs"]
    base = graphs["ort"]["median_ms"]
    print(f"{report['model']}, onnxruntime {report['onnxruntime']}, 1 thread")
    for name, entry in graphs.items():
        top = ", ".join(f"{k} {v}" for k, v in list(entry["op_types"].items())[:12])
        print(f"  {name:9s} {entry['nodes']:4d} nodes  {entry['median_ms']:8.1f} ms  {entry['median_ms'] / base:.2f}x  ({top})")
    for name in graphs:
        if name == "ort":
            continue
        g = report["gradients"][name]
        print(
            f"  {name} gradients: max |diff| / scale vs ORT's {g['vs_ort']['max_rel_to_scale']:.2e} ({g['vs_ort']['at']}), "
            f"vs gradgen's default graph {g['vs_gradgen']['max_rel_to_scale']:.2e} ({g['vs_gradgen']['at']})"
        )
    print(f"  losses: {report['gradients']['loss']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ort-python", help="the interpreter with onnxruntime-training (Python <= 3.11)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="time another backward graph of the same export too (e.g. one built by an earlier tree)",
    )
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--keep", type=Path, help="keep the graphs in this directory")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the ORT side: a build's JSON
    args = parser.parse_args(argv)
    if args.measure:
        report = measure(json.loads(args.measure.read_text()), args.steps, args.warmup)
        args.measure.with_suffix(".report.json").write_text(json.dumps(report, indent=1))
        return
    if not args.ort_python:
        parser.error("--ort-python is required")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        info = build(workdir, args.model, args.batch, args.size)
        info["also"] = dict(item.split("=", 1) for item in args.also)
        job = workdir / "build.json"
        job.write_text(json.dumps(info))
        env = dict(os.environ) | {v: "1" for v in THREAD_VARIABLES}
        command = [args.ort_python, __file__, "--measure", str(job), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        subprocess.run(command, env=env, check=True)
        report = json.loads(job.with_suffix(".report.json").read_text())
    print_report(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
