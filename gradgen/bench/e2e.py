"""The end-to-end group: real-size training steps, PyTorch eager / torch.compile / gradgen.

For each model (``models.PRESETS``): build it in plain PyTorch, export it with its loss to ONNX,
build the backward graph with gradgen (with respect to the model's parameters), then measure each
framework in its own child process (``worker.py``): step time (median after warm-up) and device
memory (driver-level used memory after the timed steps minus the baseline right after the
child's context creation; plus ``torch.cuda.max_memory_allocated`` and gradgen's pool figures).
gradgen's gradients are compared with PyTorch eager's: max |gradgen - torch| over max |torch| per
tensor, worst tensor named. For the GPT-2 layouts a variable-length loop follows (a dynamic-length
export; a new sequence length each step; several passes), eager and gradgen.

Each precision of ``--precision`` (``precision.py``: fp32 with TF32 off by default, tf32, bf16,
fp16) is its own table: gradgen's backward graph built with it, PyTorch with its TF32 flags or the
forward under ``torch.autocast``. Below fp32, one more child computes PyTorch eager's fp32
gradients (the reference) and the mixed-precision criterion compares gradgen's and eager's errors against
them per tensor. ``GRADGEN_ALLOW_TF32`` is removed from the children's environment (gradgen's
tf32 comes from the graph). The parent never touches the GPU (so it holds no device memory of its own).
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from gradgen.bench import models, precision
from gradgen.bench.measure import fmt_mib, fmt_ms, fmt_ratio, run_child, table

FRAMEWORKS = ("eager", "compile", "gradgen")


@dataclasses.dataclass
class E2EOptions:
    """What the group runs (the command line's ``--model``, ``--steps``, ... end up here)."""

    specs: list[models.ModelSpec]
    device: str = "cuda"
    frameworks: tuple[str, ...] = FRAMEWORKS
    precisions: tuple[str, ...] = ("fp32",)
    steps: int = 30
    warmup: int = 5
    varlen: bool = True
    lengths: tuple[int, ...] | None = None  # default: T, T-16, ..., T-112 (256 -> 144 for gpt2s)
    passes: int = 2
    on_update: Callable[[dict], None] | None = None  # called with the report as results come in
    child_timeout_s: float = 1800.0
    keep_dir: Path | None = None
    debug: bool = False
    profile: bool = False  # a GPU-time breakdown of gradgen's step (torch.profiler), after the timings


def default_lengths(seq: int) -> tuple[int, ...]:
    """The issue's loop: 256, 240, ..., 144 for T=256 (eight lengths, 16 apart), scaled down for small T."""
    step = 16 if seq >= 128 else max(1, seq // 8)
    return tuple(t for t in range(seq, seq - 8 * step, -step) if t >= 2)


def gpu_line(h: dict) -> str:
    """The device as a group's first line names it: the GPU with its driver and memory where known."""
    return f"{h['gpu']} (driver {h['driver']}, {h['gpu_memory']})" if "driver" in h else h["gpu"]


def header(device: str) -> dict:
    """Device name, driver, torch version and date (the GPU is asked through nvidia-smi, so the parent
    creates no CUDA context)."""
    import platform

    import torch

    info = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
    }
    if device == "cuda":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            ).stdout.splitlines()[0]
            name, driver, memory = (s.strip() for s in out.split(","))
            info.update(gpu=name, driver=driver, gpu_memory=memory)
        except (OSError, subprocess.SubprocessError, IndexError, ValueError) as exc:
            info["gpu"] = f"unknown (nvidia-smi: {type(exc).__name__})"
    else:
        info["gpu"] = "none (CPU run)"
    return info


def run(options: E2EOptions) -> dict:
    """Run the group; print one table per model; return (and write, with --json) every number."""
    report = {"group": "e2e", "header": header(options.device), "settings": _settings(options), "models": {}}
    h = report["header"]
    print(
        f"e2e: {gpu_line(h)}; torch {h['torch']}; "
        f"{h['date']}; {'; '.join(precision.describe(p) for p in options.precisions)}; "
        "step = batch from host memory, forward + backward, loss to host; "
        f"median of {options.steps} after {options.warmup} warm-up steps",
        flush=True,
    )
    for spec in options.specs:
        workdir = Path(tempfile.mkdtemp(prefix=f"gradgen-bench-{spec.name}-", dir=options.keep_dir))
        try:
            _run_model(spec, options, workdir, report)
        finally:
            if options.keep_dir is None:
                shutil.rmtree(workdir, ignore_errors=True)
        _save(options, report)
    precision.report_over_seeds(report, "criterion")
    _save(options, report)
    return report


def _settings(options: E2EOptions) -> dict:
    return {
        "frameworks": list(options.frameworks),
        "precisions": list(options.precisions),
        "steps": options.steps,
        "warmup": options.warmup,
        "varlen": options.varlen,
        "passes": options.passes,
    }


def _save(options: E2EOptions, report: dict) -> None:
    if options.on_update is not None:
        options.on_update(report)


def entry_key(name: str, precision: str, seed: int = 0) -> str:
    """The report's key of one (model, precision) table: ``model/precision``, and ``/seedN`` for a
    seed other than 0 (``--seed`` repeated runs each model once per seed)."""
    return f"{name}/{precision}" + (f"/seed{seed}" if seed else "")


def _export(spec: models.ModelSpec, workdir: Path, *, dynamic_seq: bool = False) -> dict:
    """Export the model; save the weights and the batch the children read. Returns the forward
    model (``proto``), file names and figures."""
    import torch

    tag = "varlen" if dynamic_seq else "fixed"
    model = models.build_module(spec)
    inputs = models.make_inputs(spec)
    files = {"state": workdir / "state.pt", "inputs": workdir / f"inputs-{tag}.npz"}
    if not files["state"].exists():
        torch.save(model.state_dict(), files["state"])
    np.savez(files["inputs"], **inputs)
    t0 = time.perf_counter()
    proto = models.export(model, inputs, dynamic_seq=dynamic_seq)
    return {
        **{k: str(v) for k, v in files.items()},
        "proto": proto,
        "tag": tag,
        "export_s": time.perf_counter() - t0,
        "forward_nodes": len(proto.graph.node),
        "wrt": models.parameter_names(model),
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }


def _build(exported: dict, workdir: Path, precision_name: str) -> dict:
    """Build the backward graph of an exported model at a precision and save it for the children."""
    import gradgen
    from gradgen.model_io import save_model

    t0 = time.perf_counter()
    built = gradgen.build_backward(exported["proto"], wrt=exported["wrt"], precision=precision_name)
    build_s = time.perf_counter() - t0
    path = workdir / f"model-{exported['tag']}-{precision_name}-grad.onnx"
    save_model(built.model, path)
    return {"model": str(path), "loss": built.loss, "build_s": build_s, "backward_model_nodes": len(list(built.model.graph))}


def _run_model(spec: models.ModelSpec, options: E2EOptions, workdir: Path, report: dict) -> None:
    print(f"\n== {spec.name}: {spec.title}, {spec.shape_text}", flush=True)
    exported = _export(spec, workdir)
    print(
        f"   {exported['parameters']:,} parameters; export {exported['export_s']:.1f} s ({exported['forward_nodes']} nodes)",
        flush=True,
    )
    for precision_name in options.precisions:
        entry = {"spec": spec.to_json(), "precision": precision_name}
        report["models"][entry_key(spec.name, precision_name, spec.seed)] = entry
        _run_precision(spec, precision_name, exported, options, workdir, entry, report)
        _save(options, report)


def _run_precision(
    spec: models.ModelSpec, precision_name: str, exported: dict, options: E2EOptions, workdir: Path, entry: dict, report: dict
) -> None:
    """One (model, precision) table: build, each framework's child, the gradient comparisons, the loop."""
    from gradgen.errors import GradgenError

    try:
        built = _build(exported, workdir, precision_name)
    except GradgenError as exc:  # one precision that does not build is a result, not the end of the group
        entry["error"] = f"build-backward --precision {precision_name} failed: {exc}"
        print(f"-- {spec.name} {precision_name}: {entry['error']}", flush=True)
        return
    entry["prepare"] = {
        **{k: exported[k] for k in ("export_s", "forward_nodes", "parameters")},
        **{k: built[k] for k in ("build_s", "backward_model_nodes")},
    }
    print(
        f"-- {spec.name} {precision_name}: build-backward {built['build_s']:.1f} s ({built['backward_model_nodes']} nodes)",
        flush=True,
    )
    common = {
        "spec": spec.to_json(),
        "device": options.device,
        "precision": precision_name,
        "state": exported["state"],
        "inputs": exported["inputs"],
        "steps": options.steps,
        "warmup": options.warmup,
        "debug": options.debug,
    }
    grads = {f: workdir / f"grads-{precision_name}-{f}.npz" for f in ("gradgen", "eager")}
    results = entry["frameworks"] = {}
    for framework in options.frameworks:
        task = {**common, "label": f"{spec.name}-{precision_name}-{framework}", "framework": framework}
        if framework == "gradgen":
            task.update(model=built["model"], loss=built["loss"], wrt=exported["wrt"], grads=str(grads["gradgen"]))
            job = "gradgen-step"
        else:
            job = "torch-step"
            if framework == "eager":
                task["grads"] = str(grads["eager"])
        t0 = time.perf_counter()
        results[framework] = result = run_child(job, task, workdir, timeout_s=options.child_timeout_s)
        result["wall_s"] = time.perf_counter() - t0
        print(f"   {framework}: {_one_line(result)}", flush=True)
        _save(options, report)
    if options.profile and "gradgen" in options.frameworks and options.device == "cuda":
        entry["profile"] = run_child(
            "gradgen-profile",
            {**common, "label": f"{spec.name}-{precision_name}-profile", "model": built["model"], "loss": built["loss"]},
            workdir,
            timeout_s=options.child_timeout_s,
        )
        if entry["profile"].get("error"):
            print(f"   profile: failed: {entry['profile']['error']}", flush=True)
    if "eager" in options.frameworks and "gradgen" in options.frameworks:
        entry["gradients"] = compare_gradients(grads["gradgen"], grads["eager"])
    if precision_name != "fp32" and "gradgen" in options.frameworks:
        entry["fp32_reference"] = _against_fp32(spec, grads, options, workdir, common)
    if options.varlen and spec.kind == "gpt2":
        entry["varlen"] = _run_varlen(spec, options, workdir, common, exported)
    print(format_model(entry), flush=True)


def _against_fp32(spec: models.ModelSpec, grads: dict[str, Path], options: E2EOptions, workdir: Path, common: dict) -> dict:
    """The mixed-precision gradient criterion: gradgen's and eager's gradients at the precision against
    PyTorch eager's fp32 gradients (the fp32 table's, else one more child that computes only them)."""
    reference = workdir / "grads-fp32-eager.npz"
    if not reference.exists():
        task = {
            **common,
            "precision": "fp32",
            "framework": "eager",
            "label": f"{spec.name}-fp32-reference",
            "grads_only": True,
            "grads": str(reference),
        }
        result = run_child("torch-step", task, workdir, timeout_s=options.child_timeout_s)
        if result.get("error"):
            return {"error": f"the fp32 reference (eager) failed: {result['error']}"}
    if not grads["gradgen"].exists():
        return {"error": "no gradients from gradgen"}
    with np.load(reference) as ref, np.load(grads["gradgen"]) as ours:
        gradgen_errors, missing = precision.relative_errors(ours, ref)
        eager_errors = None
        if grads["eager"].exists():
            with np.load(grads["eager"]) as theirs:
                eager_errors = precision.relative_errors(theirs, ref)[0]
    return {
        "reference": "eager fp32",
        "missing": missing,
        "gradgen": gradgen_errors,
        "eager": eager_errors,
        "criterion": precision.criterion(gradgen_errors, eager_errors),
    }


def _one_line(result: dict) -> str:
    if result.get("error"):
        return "failed: " + result["error"]
    mem = result.get("memory", {}).get("used_after_bytes")
    text = f"{fmt_ms(result['median_ms'])} ms/step, first step {result['first_step_s']:.1f} s"
    return text + (f", {fmt_mib(mem)} MiB used" if mem is not None else "") + f" ({result['wall_s']:.0f} s in all)"


def compare_gradients(got_path: Path, want_path: Path) -> dict:
    """max |got - want| / max |want| per tensor; the worst one named. Missing files give an error entry."""
    if not (got_path.exists() and want_path.exists()):
        return {
            "error": "no gradients from " + " and ".join(p.stem.split("-")[-1] for p in (got_path, want_path) if not p.exists())
        }
    with np.load(got_path) as got, np.load(want_path) as want:
        per_tensor, missing = precision.relative_errors(got, want)
    worst = max(per_tensor, key=per_tensor.get) if per_tensor else None
    return {
        "tensors": len(per_tensor),
        "missing": missing,
        "worst_tensor": worst,
        "worst_rel_err": per_tensor.get(worst),
        "per_tensor": per_tensor,
    }


def _run_varlen(spec: models.ModelSpec, options: E2EOptions, workdir: Path, common: dict, exported: dict) -> dict:
    """The variable-length loop at ``common["precision"]``; the dynamic-length export is made once
    per model (kept in ``exported``, the fixed export's record)."""
    lengths = list(options.lengths or default_lengths(spec.size))
    out = {"lengths": lengths, "passes": options.passes}
    precision_name = common["precision"]
    try:
        if "dynamic" not in exported:
            exported["dynamic"] = _export(spec, workdir, dynamic_seq=True)
        dynamic = exported["dynamic"]
        built = _build(dynamic, workdir, precision_name)
    except Exception as exc:  # noqa: BLE001 - a failed dynamic export is a result, not the end of the group
        out["error"] = f"dynamic-length export/build failed: {type(exc).__name__}: {exc}"
        print("   varlen: " + out["error"], flush=True)
        return out
    out["build_s"] = built["build_s"]
    task = {**common, "inputs": dynamic["inputs"], "lengths": lengths, "passes": options.passes}
    for framework in [f for f in options.frameworks if f != "compile"]:
        job = "gradgen-varlen" if framework == "gradgen" else "torch-varlen"
        extra = {"model": built["model"], "loss": built["loss"]} if framework == "gradgen" else {}
        t0 = time.perf_counter()
        result = run_child(
            job,
            {**task, **extra, "label": f"{spec.name}-{precision_name}-varlen-{framework}", "framework": framework},
            workdir,
            timeout_s=options.child_timeout_s,
        )
        result["wall_s"] = time.perf_counter() - t0
        out[framework] = result
        print(f"   varlen {framework}: " + _varlen_line(result), flush=True)
    return out


def _varlen_line(result: dict) -> str:
    if result.get("error"):
        return "failed: " + result["error"]
    parts = []
    for p in result["passes"]:
        mean = sum(p["step_ms"]) / len(p["step_ms"]) if p["step_ms"] else None
        parts.append(
            f"pass {p['pass']}: {len(p['step_ms'])} steps, {fmt_ms(mean)} ms/step, max {fmt_mib(p['max_used_bytes'])} MiB"
        )
    if result.get("failure"):
        f = result["failure"]
        what = "out of memory" if f["out_of_memory"] else "failed"
        parts.append(f"{what} at T={f['length']} (pass {f['pass']}, step {f['step']}): {f['message']}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# The printed table


def format_model(entry: dict) -> str:
    spec = models.ModelSpec.from_json(entry["spec"])
    results = entry.get("frameworks", {})
    eager = results.get("eager", {})
    precision_name = entry.get("precision", "fp32")
    lines = [f"\n{spec.name} [{precision_name}]: {spec.title}, {spec.shape_text}"]
    if entry.get("error"):
        return "\n".join(lines + [f"  {entry['error']}"])
    rows = []
    for framework, r in results.items():
        if r.get("error"):
            what = "out of memory" if r.get("out_of_memory") else "failed"
            rows.append([framework, f"{what}: {r['error'][:80]}", "", "", "", "", "", ""])
            continue
        mem = r.get("memory", {})
        own = mem.get("torch_max_allocated_bytes", mem.get("pool_held_bytes"))
        first = f"{r['first_step_s']:.1f} s"
        if r.get("second_step_s") is not None:
            first += f" / {r['second_step_s']:.1f} s"
        rows.append(
            [
                framework,
                fmt_ms(r["median_ms"]),
                fmt_ratio(r["median_ms"], eager.get("median_ms")),
                fmt_mib(mem.get("used_after_bytes")),
                fmt_ratio(mem.get("used_after_bytes"), eager.get("memory", {}).get("used_after_bytes")),
                fmt_mib(own),
                first,
                f"{r['loss']:.6f}",
            ]
        )
    lines.append(table(["framework", "step ms", "time/eager", "peak MiB", "mem/eager", "own MiB", "first steps", "loss"], rows))
    lines.append(
        "  peak MiB: driver-level used memory after the timed steps minus the baseline after context "
        "creation; own MiB: torch.cuda.max_memory_allocated, gradgen's pool (held bytes); first steps: "
        "the first (and, gradgen, the second: CUDA-graph recording) step's wall time"
    )
    gradgen, compiled = results.get("gradgen", {}), results.get("compile", {})
    if gradgen.get("median_ms") and compiled.get("median_ms"):
        lines.append(
            f"  gradgen vs torch.compile: time {fmt_ratio(gradgen['median_ms'], compiled['median_ms'])}, "
            f"memory {fmt_ratio(gradgen['memory'].get('used_after_bytes'), compiled['memory'].get('used_after_bytes'))}"
        )
    if gradgen.get("plan_steps"):
        pool = gradgen.get("memory", {})
        held = (
            (f"; pool holds {fmt_mib(pool['pool_held_bytes'])} MiB ({fmt_mib(pool.get('pool_active_bytes'))} MiB active)")
            if "pool_held_bytes" in pool
            else ""
        )
        lines.append(f"  gradgen: {gradgen['plan_steps']} steps in its plan{held}")
    grads = entry.get("gradients")
    if grads:
        if grads.get("error"):
            lines.append(f"  gradients: {grads['error']}")
        else:
            missing = f"; missing from gradgen: {', '.join(grads['missing'])}" if grads["missing"] else ""
            lines.append(
                f"  gradients ({grads['tensors']} tensors): worst max|gradgen - eager| / max|eager| = "
                f"{grads['worst_rel_err']:.2e} ({grads['worst_tensor']}){missing}"
            )
    if "fp32_reference" in entry:
        lines.append(precision.format_criterion(entry["fp32_reference"], precision_name))
    for framework, r in results.items():
        for note in r.get("notes", []):
            lines.append(f"  note ({framework}): {note}")
    if "varlen" in entry:
        lines.append(_format_varlen(entry["varlen"]))
    return "\n".join(lines)


def _format_varlen(v: dict) -> str:
    lines = [f"  variable-length loop: T = {', '.join(map(str, v['lengths']))}, {v['passes']} passes (dynamic export)"]
    if v.get("error"):
        return "\n".join(lines + [f"    {v['error']}"])
    rows = []
    for framework in ("eager", "gradgen"):
        r = v.get(framework)
        if r is None:
            continue
        if r.get("error"):
            rows.append([framework, "", "", "", f"failed: {r['error'][:90]}"])
            continue
        for p in r["passes"]:
            mean = sum(p["step_ms"]) / len(p["step_ms"]) if p["step_ms"] else None
            failure = p.get("failure")
            status = ""
            if failure:
                what = "OUT OF MEMORY" if failure["out_of_memory"] else "FAILED"
                status = f"{what} at T={failure['length']} (step {failure['step']}): {failure['message'][:90]}"
            rows.append(
                [f"{framework} pass {p['pass']}", str(len(p["step_ms"])), fmt_ms(mean), fmt_mib(p["max_used_bytes"]), status]
            )
    lines.append("    " + table(["", "steps", "ms/step (mean)", "peak MiB", ""], rows).replace("\n", "\n    "))
    return "\n".join(lines)
