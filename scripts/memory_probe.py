"""Peak device memory and step time of one training step: gradgen's planned memory against PyTorch.

    python3 scripts/memory_probe.py gpt2s resnet18 [--steps 20] [--varlen] [--out DIR]

For each model (a preset of gradgen.bench.models: plain-PyTorch GPT-2 / ResNet-18 layouts with
their loss), the parent exports it and builds its backward graph (on the CPU), then each
framework runs in its own child process: PyTorch eager (forward + loss.backward()) and gradgen
(Session on CUDA, graphs on). Memory is driver-level used memory (cuMemGetInfo) minus the value
right after the child created its context: after the timed steps, and the largest value sampled
after each step. gradgen's children also report ``Session.memory_stats()`` (planned arena, live-set
lower bound, peak held by the pool and the arena). ``--varlen`` adds the variable-length loop on
the GPT-2 layouts: a dynamic-length export, one step per length (T, T-16, ..., T-112), 3 passes.

fp32; TF32 off in both. Writes one JSON per model to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(os.environ.get("GRADGEN_PROBE_ROOT") or Path(__file__).resolve().parent.parent).resolve()
sys.path.insert(0, str(ROOT))  # GRADGEN_PROBE_ROOT: measure another copy of gradgen (e.g. an older one)


def _used(get_info) -> int:
    free, total = get_info()
    return total - free


def _timed(step, steps: int, sync, sample) -> tuple[list[float], int]:
    times, peak = [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        peak = max(peak, sample())
    return times, peak


def child_torch(task: dict) -> dict:
    import torch

    from gradgen.bench import models

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.zeros(1, device="cuda")
    base = _used(torch.cuda.mem_get_info)
    spec = models.ModelSpec.from_json(task["spec"])
    model = models.build_module(spec).cuda()

    def batch(inputs):
        return [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in inputs.values()]

    def step_on(tensors):
        for p in model.parameters():
            p.grad = None
        loss = model(*tensors)
        loss.backward()
        return loss

    result = {}
    if task.get("lengths"):
        full = models.make_inputs(spec)
        per_length = {t: batch({k: v[:, :t] for k, v in full.items()}) for t in task["lengths"]}
        result["varlen"] = _varlen(
            lambda t: step_on(per_length[t]),
            task["lengths"],
            torch.cuda.synchronize,
            lambda: _used(torch.cuda.mem_get_info) - base,
        )
        return result
    tensors = batch(models.make_inputs(spec))
    firsts = []
    for _ in range(3):
        t0 = time.perf_counter()
        step_on(tensors)
        torch.cuda.synchronize()
        firsts.append((time.perf_counter() - t0) * 1e3)
    times, peak = _timed(
        lambda: step_on(tensors), task["steps"], torch.cuda.synchronize, lambda: _used(torch.cuda.mem_get_info) - base
    )
    result.update(
        first_ms=firsts,
        median_ms=statistics.median(times),
        peak_sampled=peak,
        used_after=_used(torch.cuda.mem_get_info) - base,
        max_allocated=torch.cuda.max_memory_allocated(),
        loss=float(step_on(tensors)),
    )
    return result


def child_gradgen(task: dict) -> dict:
    from pycuda import driver

    from gradgen.cuda import runtime as rt
    from gradgen.executor import Session

    os.environ.pop("GRADGEN_ALLOW_TF32", None)
    rt.stream()
    base = _used(driver.mem_get_info)
    session = Session(task["model"], device="cuda")

    def sample():
        return _used(driver.mem_get_info) - base

    result = {"after_setup": sample()}
    full = dict(np.load(task["inputs"]))
    if task.get("lengths"):
        per_length = {t: {k: np.ascontiguousarray(v[:, :t]) for k, v in full.items()} for t in task["lengths"]}
        result["varlen"] = _varlen(
            lambda t: session.run(per_length[t], outputs=["loss"]), task["lengths"], rt.synchronize, sample
        )
        result["stats"] = session.memory_stats() if hasattr(session, "memory_stats") else None
        return result
    firsts, after = [], []
    for _ in range(3):  # traced, recorded, first replay
        t0 = time.perf_counter()
        loss = session.run(full, outputs=["loss"])["loss"]
        firsts.append((time.perf_counter() - t0) * 1e3)
        after.append(sample())
    times, peak = _timed(lambda: session.run(full, outputs=["loss"]), task["steps"], rt.synchronize, sample)
    stats = session.memory_stats() if hasattr(session, "memory_stats") else None
    if stats:
        stats["fallback_log"] = [
            (key, why, session.steps[key[0]].op_type if key[0] >= 0 else "feed") for key, why in stats.get("fallback_log", [])
        ]
    result.update(
        first_ms=firsts,
        used_after_first_runs=after,
        median_ms=statistics.median(times),
        peak_sampled=peak,
        used_after=sample(),
        stats=stats,
        loss=float(loss),
        pool_bytes=int(rt.memory_pool().managed_bytes),
        graph_pool_bytes=_graph_pool_bytes(),
    )
    if task.get("grads"):
        out = session.run(full)
        np.savez(task["grads"], **{k: v for k, v in out.items() if k.endswith("_grad")})
    return result


def _graph_pool_bytes():
    """Device memory the driver reserves for CUDA graphs' own allocations (memory nodes)."""
    try:
        from cuda.bindings import driver as cu

        _, device = cu.cuCtxGetDevice()
        _, value = cu.cuDeviceGetGraphMemAttribute(device, cu.CUgraphMem_attribute.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)
        return int(value)
    except Exception as exc:  # noqa: BLE001
        return f"unknown: {exc}"


def _varlen(step, lengths, sync, sample) -> list[dict]:
    passes = []
    for _ in range(3):
        times, peak = [], 0
        for t in lengths:
            t0 = time.perf_counter()
            step(t)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
            peak = max(peak, sample())
        passes.append({"ms": times, "mean_ms": statistics.mean(times), "peak_sampled": peak, "used_after": sample()})
    return passes


def _child(kind: str, task: dict, workdir: Path) -> dict:
    path = workdir / f"task_{kind}_{time.monotonic_ns()}.json"
    path.write_text(json.dumps(task))
    proc = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe(name: str, steps: int, varlen: bool, workdir: Path, frameworks=("torch", "gradgen")) -> dict:
    import onnx

    import gradgen
    from gradgen.bench import models

    spec = models.preset(name)
    module = models.build_module(spec)
    inputs = models.make_inputs(spec)
    t0 = time.perf_counter()
    built = gradgen.build_backward(models.export(module, inputs))
    model_path, inputs_path = workdir / f"{name}_grad.onnx", workdir / f"{name}_inputs.npz"
    import onnx_ir as ir

    ir.save(built.model, str(model_path))
    np.savez(inputs_path, **inputs)
    report = {"model": name, "build_s": time.perf_counter() - t0}
    task = {"spec": spec.to_json(), "steps": steps, "model": str(model_path), "inputs": str(inputs_path)}
    for fw in frameworks:
        report[fw] = _child(fw, task, workdir)
        print(summary(dict(report, model=f"{name} (so far)")), flush=True)
    if varlen and spec.kind == "gpt2":
        dyn = workdir / f"{name}_dyn_grad.onnx"
        ir.save(gradgen.build_backward(models.export(module, inputs, dynamic_seq=True)).model, str(dyn))
        lengths = [t for t in range(spec.size, spec.size - 8 * 16, -16) if t >= 2]
        vtask = dict(task, model=str(dyn), lengths=lengths)
        for fw in frameworks:
            report[f"varlen_{fw}"] = _child(fw, vtask, workdir)
    del onnx
    return report


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def summary(report: dict) -> str:
    lines = [f"== {report['model']} (export+build {report['build_s']:.1f} s)"]
    for fw in ("torch", "gradgen"):
        r = report.get(fw)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"{fw}: ERROR {r['error'][-600:]}")
            continue
        line = (
            f"{fw:8s} step {r['median_ms']:.2f} ms (first {', '.join(f'{x:.0f}' for x in r['first_ms'])} ms), "
            f"used after {_mib(r['used_after'])} MiB, max sampled {_mib(r['peak_sampled'])} MiB"
        )
        if fw == "gradgen":
            line += f", pool {_mib(r['pool_bytes'])} MiB, graph pool {r['graph_pool_bytes']}"
        s = r.get("stats") if fw == "gradgen" else None
        if s:
            line += (
                f", after runs 1-3 {', '.join(_mib(x) for x in r['used_after_first_runs'])} MiB; plan "
                f"{_mib(s['planned_bytes'])} MiB (live-set bound {_mib(s['peak_live_bytes'])}), arena "
                f"{_mib(s['arena_bytes'])}, peak held {_mib(s['peak_held_bytes'])}, served {s['served']}, "
                f"fallbacks {s['fallbacks']} {s.get('fallback_log')}, leaks {s['leaks']}, graphs {s['graphs']}"
            )
        elif fw == "torch":
            line += f", max_allocated {_mib(r['max_allocated'])} MiB"
        lines.append(line + f", loss {r.get('loss')}")
    for fw in ("varlen_torch", "varlen_gradgen"):
        r = report.get(fw)
        if not r:
            continue
        if "error" in r:
            lines.append(f"{fw}: ERROR {r['error'][-600:]}")
            continue
        for i, p in enumerate(r["varlen"]):
            lines.append(
                f"{fw} pass {i + 1}: mean {p['mean_ms']:.1f} ms/step, max sampled {_mib(p['peak_sampled'])} MiB,"
                f" after {_mib(p['used_after'])} MiB"
            )
        if "stats" in r:
            lines.append(f"{fw} stats {r['stats']}")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        task = json.loads(Path(sys.argv[3]).read_text())
        result = (child_torch if sys.argv[2] == "torch" else child_gradgen)(task)
        print(json.dumps(result, default=str))
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="+")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--varlen", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--frameworks", default="torch,gradgen")
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            report = probe(name, args.steps, args.varlen, Path(tmp), tuple(args.frameworks.split(",")))
            report["model"] += args.label
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"probe_{name}{args.label}.json").write_text(json.dumps(report, indent=1, default=str))
            print(summary(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
