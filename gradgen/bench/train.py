"""The train group: a full AdamW training step (forward, backward, update), gradgen against PyTorch.

For each model (``models.PRESETS``; GPT-2 small at B=8, T=256 and ResNet-18 at B=32 by default):
export it with its loss as e2e does, then, each in its own child process (``worker.py``):

- eager: PyTorch eager with ``torch.optim.AdamW(fused=True)``;
- compile: ``torch.compile`` of the model, the same fused AdamW;
- gradgen: ``build_training(model, optimizer=AdamW())`` stepped by ``DeviceStepRunner``
  (parameters and optimizer states stay in device memory; the step replays as a CUDA graph).

Every framework takes the same steps on the same batches (``models.make_train_batches``: a task the
model can learn, ``TRAIN_BATCHES`` distinct batches cycled, from host memory each step) from the same
initial weights, with the same hyper-parameters (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight
decay 0.01), and reads the loss back to the host each step. Reported: the median step time, device
memory as e2e measures it, and the loss of the first steps of each, side by side (they must agree:
the same training).

Each precision of ``--precision`` (``precision.py``; default fp32, TF32 off) is its own table:
PyTorch's forward under ``torch.autocast`` (fp16 with ``torch.amp.GradScaler``), gradgen's
training graphs built with the precision (fp16 with its dynamic loss scaling). Below fp32, each of
gradgen's and eager's loss curves is compared with the same framework's fp32 curve (the fp32 table's,
else one more child): same weights, same batches, same steps (``--steps 200`` for a 200-step curve).
Eager's distance from its own fp32 curve is the yardstick for gradgen's: two fp32 runs already part
by rounding, so "tracks the fp32 curve" means "no further from it than PyTorch's autocast is".
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gradgen.bench import models, precision
from gradgen.bench.e2e import entry_key, gpu_line, header
from gradgen.bench.measure import fmt_mib, fmt_ms, fmt_ratio, run_child, table

FRAMEWORKS = ("eager", "compile", "gradgen")
LR = 1e-4
SHOWN_LOSSES = 5  # the first steps' losses printed side by side
TRAIN_BATCHES = 8  # distinct batches, cycled
CURVE_FRAMEWORKS = ("gradgen", "eager")  # whose curves below fp32 are compared with their own fp32 curve


@dataclasses.dataclass
class TrainOptions:
    specs: list[models.ModelSpec]
    device: str = "cuda"
    frameworks: tuple[str, ...] = FRAMEWORKS
    precisions: tuple[str, ...] = ("fp32",)
    steps: int = 20
    warmup: int = 5
    on_update: Callable[[dict], None] | None = None
    child_timeout_s: float = 1800.0
    keep_dir: Path | None = None
    debug: bool = False


def run(options: TrainOptions) -> dict:
    """Run the group; print one table per model; return the report (every number)."""
    report: dict[str, Any] = {"group": "train", "header": header(options.device), "settings": _settings(options), "models": {}}
    h = report["header"]
    print(
        f"train: {gpu_line(h)}; torch {h['torch']}; {h['date']}; "
        f"{'; '.join(precision.describe(p, train=True) for p in options.precisions)}; step = batch from host memory, "
        f"forward + backward + AdamW update (lr {LR}), loss to host; median of {options.steps} after "
        f"{options.warmup} warm-up steps",
        flush=True,
    )
    for spec in options.specs:
        workdir = Path(tempfile.mkdtemp(prefix=f"gradgen-train-{spec.name}-", dir=options.keep_dir))
        try:
            _run_model(spec, options, workdir, report)
        finally:
            if options.keep_dir is None:
                shutil.rmtree(workdir, ignore_errors=True)
    precision.report_over_seeds(report, "tracking")
    if options.on_update is not None:
        options.on_update(report)
    return report


def _settings(options: TrainOptions) -> dict:
    return {
        "frameworks": list(options.frameworks),
        "precisions": list(options.precisions),
        "steps": options.steps,
        "warmup": options.warmup,
        "lr": LR,
    }


def _prepare(spec: models.ModelSpec, workdir: Path) -> dict:
    """Export the forward model with its loss; save the initial weights and the batches (stacked on
    a leading axis)."""
    import torch

    from gradgen.model_io import save_model

    model = models.build_module(spec)
    batches = models.make_train_batches(spec, TRAIN_BATCHES)
    files = {"state": workdir / "state.pt", "inputs": workdir / "inputs.npz", "model": workdir / "model.onnx"}
    torch.save(model.state_dict(), files["state"])
    np.savez(files["inputs"], **batches)  # type: ignore[arg-type]
    t0 = time.perf_counter()
    save_model(models.export(model, {name: stacked[0] for name, stacked in batches.items()}), files["model"])
    return {
        **{k: str(v) for k, v in files.items()},
        "export_s": time.perf_counter() - t0,
        "parameters": int(sum(p.numel() for p in model.parameters())),
    }


def _run_model(spec: models.ModelSpec, options: TrainOptions, workdir: Path, report: dict) -> None:
    print(f"\n== {spec.name}: {spec.title}, {spec.shape_text}", flush=True)
    prepared = _prepare(spec, workdir)
    print(f"   {prepared['parameters']:,} parameters; export {prepared['export_s']:.1f} s", flush=True)
    fp32_curves: dict[str, list[float]] = {}  # each framework's fp32 losses, the reference of its other precisions
    for precision_name in options.precisions:
        entry: dict[str, Any] = {"spec": spec.to_json(), "precision": precision_name}
        report["models"][entry_key(spec.name, precision_name, spec.seed)] = entry
        entry["prepare"] = {k: prepared[k] for k in ("export_s", "parameters")}
        print(f"-- {spec.name} {precision_name}", flush=True)
        _run_precision(spec, precision_name, prepared, options, workdir, entry)
        if precision_name == "fp32":
            fp32_curves.update({fw: r["losses"] for fw, r in entry["frameworks"].items() if r.get("losses")})
        else:
            entry["fp32_curves"] = curves = {}
            for framework in (fw for fw in CURVE_FRAMEWORKS if fw in options.frameworks):
                curves[framework] = _against_fp32(spec, prepared, options, workdir, entry, framework, fp32_curves.get(framework))
                if "fp32_losses" in curves[framework]:  # one reference child per model and framework
                    fp32_curves[framework] = curves[framework]["fp32_losses"]
            if "gradgen" in curves and "eager" in curves:
                entry["tracking"] = precision.tracking(curves["gradgen"], curves["eager"])
        print(format_model(entry), flush=True)
        if options.on_update is not None:
            options.on_update(report)


def _common_task(spec: models.ModelSpec, precision_name: str, prepared: dict, options: TrainOptions) -> dict:
    return {
        "spec": spec.to_json(),
        "device": options.device,
        "precision": precision_name,
        "state": prepared["state"],
        "inputs": prepared["inputs"],
        "model": prepared["model"],
        "steps": options.steps,
        "warmup": options.warmup,
        "lr": LR,
        "debug": options.debug,
    }


def _run_precision(
    spec: models.ModelSpec, precision_name: str, prepared: dict, options: TrainOptions, workdir: Path, entry: dict
) -> None:
    common = _common_task(spec, precision_name, prepared, options)
    results = entry["frameworks"] = {}
    for framework in options.frameworks:
        job = "gradgen-train" if framework == "gradgen" else "torch-train"
        task = {**common, "label": f"{spec.name}-train-{precision_name}-{framework}", "framework": framework}
        t0 = time.perf_counter()
        results[framework] = result = run_child(job, task, workdir, timeout_s=options.child_timeout_s)
        result["wall_s"] = time.perf_counter() - t0
        print(f"   {framework}: {_one_line(result)}", flush=True)
    entry["loss_agreement"] = loss_agreement(results)


def _against_fp32(
    spec: models.ModelSpec,
    prepared: dict,
    options: TrainOptions,
    workdir: Path,
    entry: dict,
    framework: str,
    fp32_curve: list[float] | None,
) -> dict:
    """``framework``'s loss curve at the entry's precision against its own fp32 curve (one more child
    when this run has no fp32 table)."""
    ours = entry["frameworks"].get(framework, {})
    if ours.get("error") or not ours.get("losses"):
        return {"error": f"{framework} at {entry['precision']} failed"}
    if fp32_curve is None:
        task = {**_common_task(spec, "fp32", prepared, options), "label": f"{spec.name}-train-fp32-{framework}-reference"}
        job = "gradgen-train" if framework == "gradgen" else "torch-train"
        reference = run_child(job, {**task, "framework": framework}, workdir, timeout_s=options.child_timeout_s)
        if reference.get("error"):
            return {"error": f"the fp32 reference ({framework}) failed: {reference['error']}"}
        fp32_curve = reference["losses"]
    return {"reference": f"{framework} fp32", "fp32_losses": fp32_curve, **precision.curve_difference(ours["losses"], fp32_curve)}


def _one_line(result: dict) -> str:
    if result.get("error"):
        return "failed: " + result["error"]
    mem = result.get("memory", {}).get("used_after_bytes")
    text = f"{fmt_ms(result['median_ms'])} ms/step, first step {result['first_step_s']:.1f} s"
    return text + (f", {fmt_mib(mem)} MiB used" if mem is not None else "") + f" ({result['wall_s']:.0f} s in all)"


def loss_agreement(results: dict) -> dict:
    """Per framework, the largest relative difference of its per-step losses from eager's (over the
    steps both took)."""
    eager = results.get("eager", {}).get("losses")
    out: dict[str, float | None] = {}
    if not eager:
        return out
    for framework, r in results.items():
        losses = r.get("losses")
        if framework == "eager" or not losses:
            continue
        n = min(len(losses), len(eager))
        ours, theirs = np.array(losses[:n]), np.array(eager[:n])
        out[framework] = float(np.max(np.abs(ours - theirs) / np.maximum(np.abs(theirs), 1e-30))) if n else None
    return out


def _format_scaling(framework: str, figures: dict) -> str:
    """``gradgen skipped 3 steps (scale 65536 -> 8192)``; eager's count is implied by its final scale."""
    skipped = figures.get("skipped_steps")
    count = "?" if skipped is None else str(skipped)
    return f"{framework} skipped {count} step(s) (scale {figures['initial_scale']:g} -> {figures['final_scale']:g})"


def format_model(entry: dict) -> str:
    spec = models.ModelSpec.from_json(entry["spec"])
    results = entry.get("frameworks", {})
    eager = results.get("eager", {})
    eager_mem = eager.get("memory", {}).get("used_after_bytes")
    rows = []
    for framework, r in results.items():
        if r.get("error"):
            what = "out of memory" if r.get("out_of_memory") else "failed"
            rows.append([framework, f"{what}: {r['error'][:80]}", "", "", "", "", ""])
            continue
        used = r.get("memory", {}).get("used_after_bytes")
        shown = ", ".join(f"{v:.6f}" for v in r.get("losses", [])[:SHOWN_LOSSES])
        rows.append(
            [
                framework,
                fmt_ms(r["median_ms"]),
                fmt_ratio(r["median_ms"], eager.get("median_ms")),
                fmt_mib(used),
                fmt_ratio(used, eager_mem),
                f"{r['first_step_s']:.1f} s",
                shown,
            ]
        )
    precision_name = entry.get("precision", "fp32")
    lines = [f"\n{spec.name} [{precision_name}]: {spec.title}, {spec.shape_text}, AdamW"]
    lines.append(
        table(
            ["framework", "step ms", "time/eager", "peak MiB", "mem/eager", "first step", f"loss, steps 1-{SHOWN_LOSSES}"], rows
        )
    )
    lines.append(
        "  peak MiB: driver-level used memory after the timed steps minus the baseline after context creation; "
        "eager and compile: torch.optim.AdamW(fused=True); gradgen: DeviceStepRunner"
    )
    scaled = {fw: r["loss_scaling"] for fw, r in results.items() if r.get("loss_scaling")}
    if scaled:
        lines.append("  loss scaling: " + "; ".join(_format_scaling(fw, figures) for fw, figures in scaled.items()))
    curves = entry.get("fp32_curves", {})
    lines.extend(precision.format_curve(result, precision_name, framework) for framework, result in curves.items())
    if "gradgen" in curves and "eager" in curves:
        lines.append(precision.format_tracking(curves["gradgen"], curves["eager"]))
    for framework, worst in entry.get("loss_agreement", {}).items():
        if worst is not None:
            lines.append(f"  {framework} vs eager: largest relative loss difference over the steps taken {worst:.2e}")
    for framework, r in results.items():
        for note in r.get("notes", []):
            lines.append(f"  note ({framework}): {note}")
    return "\n".join(lines)
