"""Precisions of the e2e and train groups (``--precision``), and how their accuracy is judged.

What each precision means on each side:

- fp32: float32 everywhere, TF32 off (PyTorch's ``allow_tf32`` flags off, gradgen's plain graph);
- tf32: float32 tensors, TF32 GEMMs and convolutions (PyTorch's ``allow_tf32`` flags on and
  ``set_float32_matmul_precision("high")``; gradgen's graph built with ``precision="tf32"``);
- bf16 / fp16: PyTorch runs the forward under ``torch.autocast(device, dtype)`` (the backward
  follows it, as users write it; TF32 stays off for what remains float32); gradgen's graph is built
  with ``precision="bf16" | "fp16"`` (``AutocastPass``). In the train group fp16 steps scale the
  loss: ``torch.amp.GradScaler`` in PyTorch, gradgen's dynamic loss scaling (``LossScaling``).

The mixed-precision criteria, computed here from arrays so that they are tested without a GPU:

- gradients: per parameter tensor the largest-element-relative error ``max|g - g_fp32| /
  max|g_fp32|`` against PyTorch eager's fp32 gradients, for gradgen's gradients and for eager's own
  autocast gradients; gradgen meets it where its error is no larger than eager's on every tensor;
- training: gradgen's loss curve at the precision against gradgen's fp32 curve (same weights,
  same batches): the largest absolute and relative difference over the steps and both final losses.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

CHOICES = ("fp32", "tf32", "bf16", "fp16")  # gradgen.passes.autocast.PRECISIONS (checked by a test)
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_list(text: str) -> list[str]:
    """``--precision``'s value: one precision or a comma list of them (argparse type)."""
    values = [t.strip().lower() for t in text.split(",")]
    bad = [v for v in values if v not in CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown precision {bad[0]!r}: choose from {', '.join(CHOICES)}")
    return values


def flatten(values: Iterable[Sequence[str]] | None) -> tuple[str, ...]:
    """The repeated ``--precision`` options as one list, each once, fp32 first (so that its results
    serve as the others' fp32 reference); default: fp32."""
    given = {p for group in values or [] for p in group}
    return tuple(p for p in CHOICES if p in given) or ("fp32",)


def describe(precision: str, *, train: bool = False) -> str:
    """What the precision means for PyTorch and gradgen, for the header line."""
    if precision == "fp32":
        return "fp32, TF32 off"
    if precision == "tf32":
        return "tf32: float32 tensors, TF32 GEMMs and convolutions (PyTorch allow_tf32; gradgen --precision tf32)"
    dtype = TORCH_DTYPES[precision]
    text = f"{precision}: PyTorch forward under torch.autocast({dtype}), gradgen AutocastPass ({precision}); TF32 off"
    if precision == "fp16":
        text += (
            "; loss scaling: torch.amp.GradScaler, gradgen's dynamic loss scaling"
            if train
            else "; no loss scaling on either side: gradients below fp16's smallest subnormal (6e-8) flush to zero"
        )
    return text


# ---------------------------------------------------------------------------------------------
# Gradients against fp32


def relative_errors(grads: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> tuple[dict[str, float], list[str]]:
    """Per tensor of ``reference`` that ``grads`` has: ``max|g - ref| / max|ref|`` (float64; the
    absolute difference where the reference is all zeros; inf for a shape mismatch). Also the names
    ``grads`` lacks."""
    errors: dict[str, float] = {}
    missing = []
    for name in reference:
        if name not in grads:
            missing.append(name)
            continue
        ref, got = np.asarray(reference[name], np.float64), np.asarray(grads[name], np.float64)
        if ref.shape != got.shape:
            errors[name] = math.inf
            continue
        scale = float(np.abs(ref).max()) if ref.size else 0.0
        diff = float(np.abs(got - ref).max()) if ref.size else 0.0
        errors[name] = diff / scale if scale > 0 else diff
    return errors, sorted(missing)


def _worst(errors: Mapping[str, float]) -> tuple[str | None, float | None]:
    if not errors:
        return None, None
    name = max(errors, key=lambda n: errors[n])
    return name, errors[name]


def criterion(gradgen: Mapping[str, float], eager: Mapping[str, float] | None) -> dict:
    """The mixed-precision gradient criterion from the per-tensor errors against fp32 of gradgen's and of
    eager's gradients: the worst of each, on how many tensors gradgen's error is above eager's and
    by what worst factor (inf where eager's is 0 and gradgen's is not). ``met``: on none."""
    out: dict = {"tensors": len(gradgen)}
    out["gradgen_worst_tensor"], out["gradgen_worst"] = _worst(gradgen)
    if eager is None:
        return out
    out["eager_worst_tensor"], out["eager_worst"] = _worst(eager)
    factors = {}
    for name, ours in gradgen.items():
        theirs = eager.get(name)
        if theirs is not None and ours > theirs:
            factors[name] = ours / theirs if theirs > 0 else math.inf
    out["above_eager"] = len(factors)
    out["worst_factor_tensor"], out["worst_factor"] = _worst(factors)
    out["met"] = not factors
    return out


def format_criterion(result: dict, precision: str) -> str:
    """The criterion as one printed line (two where eager was not measured)."""
    if result.get("error"):
        return f"  vs fp32: {result['error']}"
    c = result["criterion"]
    head = f"  vs eager fp32 gradients ({c['tensors']} tensors, max|g - g_fp32| / max|g_fp32| per tensor): "
    ours = f"gradgen {precision} worst {_e(c['gradgen_worst'])} ({c['gradgen_worst_tensor']})"
    missing = f"; missing from gradgen: {', '.join(result['missing'])}" if result.get("missing") else ""
    if "eager_worst" not in c:
        return head + ours + "; eager " + precision + " not measured" + missing
    theirs = f"eager {precision} worst {_e(c['eager_worst'])} ({c['eager_worst_tensor']})"
    if c["met"]:
        verdict = "gradgen's error is at most eager's on every tensor"
    else:
        verdict = (
            f"gradgen's error is above eager's on {c['above_eager']} of {c['tensors']} tensors, "
            f"at most {_factor(c['worst_factor'])} ({c['worst_factor_tensor']})"
        )
    return f"{head}{ours}, {theirs}; {verdict}{missing}"


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def _factor(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2f}x"


# ---------------------------------------------------------------------------------------------
# Loss curves against fp32


def curve_difference(losses: Sequence[float], reference: Sequence[float]) -> dict:
    """``losses`` against ``reference`` (the same framework's fp32 curve) over the steps both took:
    the largest absolute difference (with its step, 1-based), its relative form, the mean absolute
    difference and both final losses."""
    n = min(len(losses), len(reference))
    if n == 0:
        return {"steps": 0}
    ours, ref = np.asarray(losses[:n], np.float64), np.asarray(reference[:n], np.float64)
    absolute = np.abs(ours - ref)
    relative = absolute / np.maximum(np.abs(ref), 1e-30)
    worst = int(np.argmax(absolute))
    return {
        "steps": n,
        "max_abs": float(absolute.max()),
        "max_abs_step": worst + 1,
        "max_rel": float(relative.max()),
        "mean_abs": float(absolute.mean()),
        "final": float(ours[-1]),
        "final_fp32": float(ref[-1]),
    }


def format_curve(result: dict, precision: str, framework: str = "gradgen") -> str:
    head = f"  {framework} {precision} loss curve vs {framework} fp32"
    if result.get("error"):
        return f"{head}: {result['error']}"
    if not result.get("steps"):
        return f"{head}: no steps to compare"
    return (
        f"{head} ({result['steps']} steps, same weights and batches): largest difference "
        f"{result['max_abs']:.3e} (step {result['max_abs_step']}), relative {result['max_rel']:.2e}, mean "
        f"{result['mean_abs']:.3e}; final loss {precision} {result['final']:.6f}, fp32 {result['final_fp32']:.6f}"
    )


def tracking(ours: dict, eager: dict) -> dict:
    """Whether gradgen's curve stays as close to its fp32 curve as eager's stays to eager's (largest
    and mean absolute difference, each ``curve_difference``'s)."""
    if not ours.get("steps") or not eager.get("steps"):
        return {}
    return {
        "max_ratio": ours["max_abs"] / max(eager["max_abs"], 1e-30),
        "mean_ratio": ours["mean_abs"] / max(eager["mean_abs"], 1e-30),
        "tracks": ours["max_abs"] <= eager["max_abs"] and ours["mean_abs"] <= eager["mean_abs"],
    }


def format_tracking(ours: dict, eager: dict) -> str:
    verdict = tracking(ours, eager)
    if not verdict:
        return "  tracking: not compared (a curve is missing)"
    word = "as close as" if verdict["tracks"] else "further than"
    return (
        f"  tracking: gradgen's curve is {word} eager's to its fp32 curve (largest difference "
        f"{verdict['max_ratio']:.2f}x eager's, mean {verdict['mean_ratio']:.2f}x)"
    )


def over_seeds(report: dict, kind: str) -> dict[str, dict]:
    """For each (model, precision) of ``report`` run at two or more seeds (``--seed`` repeated): the
    verdict at each seed and on how many it holds. ``kind``: ``"tracking"`` (the train group's loss
    curves) or ``"criterion"`` (the e2e group's per-tensor gradient errors). One seed's verdict can
    be noise: a curve's distance from fp32 moved 3x between seeds for eager alone."""
    runs: dict[str, list[dict]] = {}
    for entry in report.get("models", {}).values():
        verdict = _seed_verdict(entry, kind)
        if verdict is not None:
            key = f"{entry['spec']['name']}/{entry['precision']}"
            runs.setdefault(key, []).append({"seed": entry["spec"].get("seed", 0), **verdict})
    return {key: _seeds_summary(seeds, kind) for key, seeds in runs.items() if len(seeds) > 1}


def _seed_verdict(entry: dict, kind: str) -> dict | None:
    if kind == "tracking":
        verdict = entry.get("tracking")
        return dict(verdict) if verdict else None
    c = (entry.get("fp32_reference") or {}).get("criterion") or {}
    if "eager_worst" not in c:
        return None
    keys = ("gradgen_worst", "eager_worst", "above_eager", "tensors", "met")
    return {**{k: c[k] for k in keys}, "worst_below": c["gradgen_worst"] <= c["eager_worst"]}


def _seeds_summary(seeds: list[dict], kind: str) -> dict:
    seeds = sorted(seeds, key=lambda s: s["seed"])
    if kind == "tracking":
        return {
            "seeds": seeds,
            "tracks_on": sum(s["tracks"] for s in seeds),
            "median_max_ratio": float(np.median([s["max_ratio"] for s in seeds])),
            "median_mean_ratio": float(np.median([s["mean_ratio"] for s in seeds])),
        }
    return {"seeds": seeds, "met_on": sum(s["met"] for s in seeds), "worst_below_on": sum(s["worst_below"] for s in seeds)}


def format_over_seeds(key: str, summary: dict, kind: str) -> str:
    """Two lines: the count over the seeds, then each seed's figures."""
    seeds = summary["seeds"]
    names = ", ".join(str(s["seed"]) for s in seeds)
    if kind == "tracking":
        head = (
            f"{key} over seeds {names}: gradgen's curve as close to its fp32 curve as eager's on "
            f"{summary['tracks_on']} of {len(seeds)} (median largest difference {summary['median_max_ratio']:.2f}x "
            f"eager's, mean {summary['median_mean_ratio']:.2f}x)"
        )
        each = "; ".join(f"seed {s['seed']}: {s['max_ratio']:.2f}x / {s['mean_ratio']:.2f}x" for s in seeds)
        return f"{head}\n  {each}"
    head = (
        f"{key} over seeds {names}: gradgen's error at most eager's on every tensor at {summary['met_on']} of "
        f"{len(seeds)} seeds; its worst tensor at most eager's worst at {summary['worst_below_on']} of {len(seeds)}"
    )
    each = "; ".join(
        f"seed {s['seed']}: worst {_e(s['gradgen_worst'])} vs {_e(s['eager_worst'])}, {s['above_eager']} of {s['tensors']} above"
        for s in seeds
    )
    return f"{head}\n  {each}"


def report_over_seeds(report: dict, kind: str) -> None:
    """Print and record (``report["over_seeds"]``) the summary of every (model, precision) run at
    several seeds; nothing where each ran at one."""
    summaries = over_seeds(report, kind)
    if not summaries:
        return
    report["over_seeds"] = summaries
    print("", flush=True)
    for key, summary in summaries.items():
        print(format_over_seeds(key, summary, kind), flush=True)
