"""One op at a time on the CPU: gradgen's Session against ONNX Runtime on the same one-node model.

Usage::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python scripts/cpu_op_speed.py [--json out.json]

Each common op runs on a 1024 x 1024 float32 input (1 M elements; the inputs are graph feeds, not
constants), one thread on both sides, the fastest of 5 runs after a warm-up. The table is sorted by
gradgen's time over ONNX Runtime's, so kernels far off ONNX Runtime's speed show first: a kernel
that is slow only at real sizes does not show on the bundled samples.
"""

from __future__ import annotations

import argparse
import json
import warnings

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from gradgen.bench.measure import time_steps
from gradgen.executor import Session

UNARY = (
    "Abs Neg Exp Log Sqrt Reciprocal Tanh Sigmoid Relu Softplus Softsign Erf Sin Cos Tan Asin Acos Atan Sinh Cosh "
    "Asinh Acosh Atanh Floor Ceil Round Sign HardSwish Mish Elu Selu Celu LeakyRelu HardSigmoid ThresholdedRelu IsNaN IsInf"
).split()


def cases() -> list[tuple[str, list, dict, int]]:
    """(op, inputs (None: omitted), attributes, opset)."""
    rng = np.random.default_rng(0)
    shape = (1024, 1024)
    x = rng.standard_normal(shape).astype(np.float32)
    positive = (np.abs(x) + 0.1).astype(np.float32)
    unit = np.clip(x / 4, -0.99, 0.99).astype(np.float32)
    domain = {
        "Log": positive,
        "Sqrt": positive,
        "Reciprocal": positive,
        "Acosh": positive + 1,
        "Asin": unit,
        "Acos": unit,
        "Atanh": unit,
    }
    out = [(op, [domain.get(op, x)], {}, 18 if op in ("Mish", "HardSwish") else 17) for op in UNARY]
    axis1 = np.array([1], np.int64)
    out += [
        ("Gelu", [x], {}, 20),
        ("Gelu", [x], {"approximate": "tanh"}, 20),
        ("Softmax", [x], {"axis": -1}, 17),
        ("LogSoftmax", [x], {"axis": -1}, 17),
        ("ReduceSum", [x, axis1], {"keepdims": 1}, 17),
        ("ReduceMean", [x, axis1], {}, 18),
        ("ReduceMax", [x, axis1], {}, 18),
        ("ReduceL2", [x, axis1], {}, 18),
        ("ReduceLogSumExp", [x, axis1], {}, 18),
        ("Pow", [positive, np.array(3.0, np.float32)], {}, 17),
        ("Pow", [positive, x], {}, 17),
        ("Div", [x, positive], {}, 17),
        ("Mod", [x, positive], {"fmod": 1}, 17),
        ("Where", [x > 0, x, positive], {}, 17),
        ("Max", [x, positive], {}, 17),
        ("Clip", [x, np.array(-1, np.float32), np.array(1, np.float32)], {}, 17),
        ("Transpose", [x], {"perm": [1, 0]}, 17),
        ("CumSum", [x, np.array(1, np.int64)], {}, 17),
        ("ArgMax", [x], {"axis": 1}, 17),
        ("TopK", [x, np.array([8], np.int64)], {"axis": 1}, 17),
        ("LayerNormalization", [x, np.ones(1024, np.float32), np.zeros(1024, np.float32)], {"axis": -1}, 17),
        ("Gather", [x, rng.integers(0, 1024, 512).astype(np.int64)], {"axis": 0}, 17),
        ("GatherElements", [x, rng.integers(0, 1024, shape).astype(np.int64)], {"axis": 1}, 17),
        (
            "ScatterElements",
            [x, rng.integers(0, 1024, (1024, 64)).astype(np.int64), x[:, :64].copy()],
            {"axis": 1, "reduction": "add"},
            18,
        ),
        ("Expand", [x[:1].copy(), np.array(shape, np.int64)], {}, 17),
        ("Pad", [x, np.array([1, 1, 1, 1], np.int64)], {"mode": "reflect"}, 17),
        ("Einsum", [x, x], {"equation": "ij,jk->ik"}, 17),
        ("Cast", [x], {"to": TensorProto.FLOAT16}, 17),
        ("Resize", [x.reshape(1, 1, *shape), None, np.array([1, 1, 0.5, 0.5], np.float32)], {"mode": "linear"}, 18),
    ]
    return out


def fastest_ms(run, repeats: int = 5) -> float:
    return min(time_steps(run, warmup=1, steps=repeats))


def one_node_model(op: str, inputs: list, attrs: dict, opset: int):
    """(model, feeds), the outputs typed from gradgen's own run (ONNX Runtime wants them typed)."""
    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    feeds = {n: v for n, v in zip(names, inputs) if v is not None}
    infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in feeds.items()]
    outs = ["y", "indices"] if op == "TopK" else ["y"]
    node = helper.make_node(op, names, outs, **attrs)

    def model(outputs):
        graph = helper.make_graph([node], op, infos, outputs)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    results = Session(model([helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs])).run(feeds)
    typed = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(results[o].dtype), results[o].shape) for o in outs]
    return model(typed), feeds


def measure(op: str, inputs: list, attrs: dict, opset: int) -> dict:
    model, feeds = one_node_model(op, inputs, attrs, opset)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    ort_session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    ours = Session(model)
    return {
        "op": op,
        "attributes": dict(attrs),
        "gradgen_ms": fastest_ms(lambda: ours.run(feeds)),
        "ort_ms": fastest_ms(lambda: ort_session.run(None, feeds)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases():
            rows.append(measure(*case))
    rows.sort(key=lambda r: -r["gradgen_ms"] / r["ort_ms"])
    for r in rows:
        ratio = r["gradgen_ms"] / r["ort_ms"]
        print(f"{ratio:6.2f}x  gradgen {r['gradgen_ms']:8.2f} ms  ORT {r['ort_ms']:7.2f} ms  {r['op']} {r['attributes'] or ''}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
