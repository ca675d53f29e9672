"""Time ONNX Runtime training's C++ gradient graph builder on a model, in its own process.

Run as a script by an interpreter with onnxruntime-training (its last wheels, 1.19.2, stop at
Python 3.11), so it imports neither gradgen nor anything but onnx and onnxruntime::

    python ort_builder.py MODEL.onnx TASK.json RESULT.json

TASK.json holds ``{"loss": NAME, "wrt": [NAMES], "repeats": N}``. Each repeat constructs
``GradientGraphBuilder`` from the serialized model (ORT parses and resolves the graph) and calls
``build()``: the time of that is ``build_s``; ``get_model()`` (serializing the result) is timed
apart. The model is adapted as ORT's own tools do: its gradient builders read
SoftmaxCrossEntropyLoss's log_prob and LayerNormalization's mean and inverse standard deviation
outputs, so those optional outputs are declared where the model leaves them out.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def _declare_optional_outputs(model) -> None:
    for index, node in enumerate(model.graph.node):
        stem = node.name or f"node{index}"
        if node.op_type == "SoftmaxCrossEntropyLoss" and len(node.output) < 2:
            node.output.append(f"{stem}_log_prob")
        if node.op_type == "LayerNormalization" and len(node.output) < 3:
            node.output.extend([f"{stem}_mean", f"{stem}_inv_std_dev"][len(node.output) - 1 :])


def main(model_path: str, task_path: str, result_path: str) -> None:
    import onnx
    import onnxruntime
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    task = json.loads(open(task_path).read())
    model = onnx.load(model_path)
    _declare_optional_outputs(model)
    data = model.SerializeToString()
    build, serialize, nodes = [], [], 0
    for _ in range(task.get("repeats", 3)):
        t0 = time.perf_counter()
        builder = GradientGraphBuilder(data, {task["loss"]}, set(task["wrt"]), task["loss"])
        builder.build()
        t1 = time.perf_counter()
        out = builder.get_model()
        serialize.append(time.perf_counter() - t1)
        build.append(t1 - t0)
        del builder
    nodes = len(onnx.load_from_string(out).graph.node)
    result = {
        "onnxruntime": onnxruntime.__version__,
        "python": sys.version.split()[0],
        "build_s": min(build),
        "times_s": build,
        "get_model_s": min(serialize),
        "nodes": nodes,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    with open(result_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
