"""The CPU group: gradgen's CPU step against ONNX Runtime and PyTorch eager, and build-backward time.

For the bundled samples, a GPT-2-small-layout model (B=1, T=128) and a ResNet-18 (B=4, 224x224):
one forward + backward step (median after warm-up) of

- ONNX Runtime (CPU provider) on gradgen's ``--portable`` backward graph,
- gradgen on the same portable graph (the ratio the issue asks for) and on its default graph,
- PyTorch eager (forward + ``loss.backward()``) on the model itself (a sample's model class comes
  from ``samples/make_samples.py``),

at one thread and at all cores. Each thread count runs in its own child process whose environment
sets ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` (numpy's BLAS, PyTorch's
and ONNX Runtime's OpenMP); inside it ``torch.set_num_threads`` and ONNX Runtime's
``intra_op_num_threads`` are set, and threadpoolctl limits the BLAS too where it is installed.
Then the in-process build-backward time of a 48-layer GPT-2 layout (small width: the graph, not
the weights, is what the builder walks).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from gradgen.bench import models
from gradgen.bench.measure import fmt_ms, fmt_ratio, run_child, table

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "samples"
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
)


@dataclasses.dataclass
class CpuOptions:
    specs: list[models.ModelSpec]
    samples: list[str] | None = None  # sample directory names; None: every bundled sample
    threads: list[int] | None = None  # default: 1 and every core
    warmup: int = 1
    steps: int = 20  # at most, per measurement ...
    budget_s: float = 10.0  # ... and stop after this many seconds (at least 3 steps)
    sample_steps: int = 50
    build_layers: int = 48
    ort_python: str | None = None  # an interpreter with onnxruntime-training, for its gradient builder
    on_update: Callable[[dict], None] | None = None  # called with the report as results come in
    child_timeout_s: float = 3600.0
    keep_dir: Path | None = None
    debug: bool = False
    profile: bool = False  # also time gradgen's portable graph step by step (Session.profile), by op type


def all_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_specs() -> list[models.ModelSpec]:
    return [models.preset("gpt2s", batch=1, size=128), models.preset("resnet18", batch=4)]


@functools.lru_cache(maxsize=None)
def _samples_script(path: str):
    name = "gradgen_bench_make_samples"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def load_sample_case(script: str, family: str):
    """The PyTorch model and inputs of a sample family, built by samples/make_samples.py."""
    return _samples_script(script).build_case(family)


def sample_dirs(names: list[str] | None) -> list[Path]:
    """Bundled sample directories: all for None, those named otherwise (none for []); an unknown name is
    a usage error."""
    from gradgen.errors import UsageError

    if not SAMPLES_DIR.is_dir():
        if names:
            raise UsageError(f"no bundled samples at {SAMPLES_DIR} (a source checkout has them)")
        return []
    found = {p.name: p for p in sorted(SAMPLES_DIR.iterdir()) if (p / "model.onnx").is_file()}
    unknown = [n for n in names or [] if n not in found]
    if unknown:
        raise UsageError(f"unknown sample(s) {', '.join(unknown)}: choose from {', '.join(found)}")
    return list(found.values()) if names is None else [found[n] for n in names]


def _write_graphs(proto_or_path, workdir: Path, name: str, wrt=None) -> dict:
    """Build the default and the portable backward graphs and save both."""
    import gradgen
    from gradgen.model_io import save_model

    paths = {"default": workdir / f"{name}-grad.onnx", "portable": workdir / f"{name}-grad-portable.onnx"}
    t0 = time.perf_counter()
    save_model(gradgen.build_backward(proto_or_path, wrt=wrt).model, paths["default"])
    build_s = time.perf_counter() - t0
    save_model(gradgen.build_backward(proto_or_path, wrt=wrt, portable=True).model, paths["portable"])
    return {k: str(v) for k, v in paths.items()} | {"build_s": build_s}


def _prepare_cases(options: CpuOptions, workdir: Path) -> list[dict]:
    cases = []
    script = SAMPLES_DIR / "make_samples.py"
    for directory in sample_dirs(options.samples):
        family = json.loads((directory / "meta.json").read_text())["family"]
        case = {
            "name": f"sample {directory.name}",
            "inputs": str(directory / "inputs.npz"),
            "steps": options.sample_steps,
            "torch": {"kind": "sample", "script": str(script), "family": family},
        }
        cases.append(case | _write_graphs(directory / "model.onnx", workdir, directory.name))
    for spec in options.specs:
        model = models.build_module(spec)
        inputs = models.make_inputs(spec)
        np.savez(workdir / f"{spec.name}-inputs.npz", **inputs)
        proto = models.export(model, inputs)
        case = {
            "name": f"{spec.name} {spec.shape_text}",
            "inputs": str(workdir / f"{spec.name}-inputs.npz"),
            "torch": {"kind": "spec", "spec": spec.to_json()},
        }
        cases.append(case | _write_graphs(proto, workdir, spec.name, wrt=models.parameter_names(model)))
    return cases


def thread_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({name: str(threads) for name in THREAD_VARIABLES})
    return env


def measure_build(layers: int, *, repeats: int = 3, ort_python: str | None = None, workdir: Path | None = None) -> dict:
    """In-process build-backward time of a ``layers``-deep GPT-2 layout of small width (the fastest
    of ``repeats``), and ONNX Runtime training's C++ gradient builder on the same model and
    parameters where an interpreter with it is found (``ort_training_python``): in its own process,
    the same way (from the model in memory, the fastest of ``repeats``)."""
    import gradgen

    spec = models.preset("gpt2s", batch=1, size=32, layers=layers, d=64, heads=4)
    spec = dataclasses.replace(spec, arch={**spec.arch, "vocab": 512, "max_len": 64})
    model = models.build_module(spec)
    proto = models.export(model, models.make_inputs(spec))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        built = gradgen.build_backward(proto)
        times.append(time.perf_counter() - t0)
    nodes = len(proto.graph.node)
    report = {
        "layers": layers,
        "forward_nodes": nodes,
        "build_s": min(times),
        "times_s": times,
        "us_per_forward_node": min(times) / nodes * 1e6,
        "width": spec.arch["d"],
    }
    python = ort_training_python(ort_python)
    if python is None:
        report["ort_error"] = "no interpreter with onnxruntime-training (--ort-python or GRADGEN_ORT_TRAINING_PYTHON)"
        return report
    with tempfile.TemporaryDirectory(prefix="gradgen-bench-build-", dir=workdir) as tmp:
        import onnx

        paths = {k: Path(tmp) / f"{k}.json" for k in ("task", "result")}
        onnx.save(proto, Path(tmp) / "model.onnx")
        paths["task"].write_text(json.dumps({"loss": built.loss, "wrt": built.wrt, "repeats": repeats}))
        script = Path(__file__).with_name("ort_builder.py")
        command = [python, str(script), str(Path(tmp) / "model.onnx"), str(paths["task"]), str(paths["result"])]
        try:
            proc = subprocess.run(command, env=thread_env(1), capture_output=True, text=True, check=False)
        except OSError as exc:
            report["ort_error"] = f"cannot run {python}: {exc.strerror}"
            return report
        if proc.returncode != 0 or not paths["result"].exists():
            lines = (proc.stderr or "").strip().splitlines()
            report["ort_error"] = f"{python} exited with code {proc.returncode}: {lines[-1] if lines else 'no output'}"
        else:
            report["ort"] = json.loads(paths["result"].read_text())
    return report


def ort_training_python(given: str | None = None) -> str | None:
    """An interpreter with onnxruntime-training: ``given``, else $GRADGEN_ORT_TRAINING_PYTHON, else
    this one where it has the package."""
    given = given or os.environ.get("GRADGEN_ORT_TRAINING_PYTHON")
    if given:
        return given
    return sys.executable if importlib.util.find_spec("onnxruntime.training") is not None else None


def run(options: CpuOptions) -> dict:
    import platform

    import onnxruntime
    import torch

    from gradgen.kernels.cpu import blas

    threads = options.threads or sorted({1, all_cores()})
    report = {
        "group": "cpu",
        "header": {
            "date": time.strftime("%Y-%m-%dT%H:%M"),
            "cpu": _cpu_name(),
            "cores": all_cores(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__,
            "float32_products": blas.describe(),
            "load_before": _load(),
        },
        "runs": {},
    }
    h = report["header"]
    print(
        f"cpu: {h['cpu']}, {h['cores']} cores; numpy {h['numpy']}, onnxruntime {h['onnxruntime']}, torch "
        f"{h['torch']}; {h['date']}; one forward + backward step, median after warm-up; load average "
        f"{h['load_before']} before; float32 products: {h['float32_products']}",
        flush=True,
    )
    workdir = Path(tempfile.mkdtemp(prefix="gradgen-bench-cpu-", dir=options.keep_dir))
    try:
        cases = _prepare_cases(options, workdir)
        report["build_backward_s"] = {c["name"]: c["build_s"] for c in cases}
        for n in threads:
            print(f"-- {n} thread(s)", flush=True)
            task = {
                "label": f"cpu-{n}",
                "threads": n,
                "cases": cases,
                "warmup": options.warmup,
                "steps": options.steps,
                "budget_s": options.budget_s,
                "debug": options.debug,
                "profile": options.profile,
            }
            report["runs"][str(n)] = run_child("cpu-threads", task, workdir, timeout_s=options.child_timeout_s, env=thread_env(n))
            _save(options, report)
    finally:
        if options.keep_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report["header"]["load_after_steps"] = _load()
    if options.build_layers:
        print(f"-- build-backward of a {options.build_layers}-layer GPT-2 layout", flush=True)
        report["build"] = measure_build(options.build_layers, ort_python=options.ort_python, workdir=options.keep_dir)
    _save(options, report)
    print(format_report(report), flush=True)
    return report


def _load() -> float | None:
    """The 1-minute load average: other work on the machine shows in it (and in the timings)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _save(options: CpuOptions, report: dict) -> None:
    if options.on_update is not None:
        options.on_update(report)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def format_report(report: dict) -> str:
    rows, methods, failures = [], [], []
    for n, run in report["runs"].items():
        if run.get("error"):
            failures.append(f"{n} thread(s): the child failed: {run['error']}")
        method = run.get("thread_method")
        if method and method not in methods:
            methods.append(method)
        for name, r in run.get("cases", {}).items():
            errors = {k[: -len("_error")].removesuffix("_ms"): v for k, v in r.items() if k.endswith("_error")}
            failures += [f"{name}, {n} thread(s), {what}: {v}" for what, v in errors.items()]
            rows.append(
                [
                    name,
                    n,
                    fmt_ms(r.get("torch_ms")),
                    fmt_ms(r.get("ort_ms")),
                    fmt_ms(r.get("gradgen_portable_ms")),
                    _paired_ratio(r),
                    fmt_ratio(r.get("gradgen_portable_ms"), r.get("torch_ms")),
                    fmt_ms(r.get("gradgen_ms")),
                ]
            )
    lines = [
        "\nCPU step (ms); gradgen/ORT and gradgen/torch: gradgen on the portable graph ORT runs (above 1: gradgen slower);"
        " gradgen/ORT: the median of alternating rounds (their range)",
        table(
            ["model", "threads", "torch eager", "ORT", "gradgen", "gradgen/ORT", "gradgen/torch", "gradgen default graph"], rows
        ),
    ]
    lines += [f"  threads set by: {m}" for m in methods]
    h = report["header"]
    lines.append(
        f"  1-minute load average: {h.get('load_before')} before, {h.get('load_after_steps')} after the steps "
        f"({h['cores']} cores; the benchmark itself adds about its thread count)"
    )
    lines += [f"  failed: {f}" for f in failures]
    lines += _format_profiles(report)
    build = report.get("build")
    if build:
        lines.append(
            f"build-backward, GPT-2 layout {build['layers']} layers (width {build['width']}): "
            f"{build['build_s']:.2f} s for {build['forward_nodes']} forward nodes "
            f"({build['us_per_forward_node']:.0f} us per node), in-process, fastest of {len(build['times_s'])}"
        )
        ort = build.get("ort")
        if ort:
            lines.append(
                f"  ONNX Runtime training {ort['onnxruntime']}'s C++ gradient builder on the same model: {ort['build_s']:.2f} s "
                f"(+ {ort['get_model_s']:.2f} s to serialize it), fastest of {len(ort['times_s'])}; "
                f"gradgen/ORT {fmt_ratio(build['build_s'], ort['build_s'])}"
            )
        else:
            lines.append(f"  ONNX Runtime's gradient builder not timed: {build.get('ort_error')}")
    return "\n".join(lines)


def _paired_ratio(row: dict) -> str:
    """gradgen over ONNX Runtime: the median of the alternating rounds' ratios with their range, or
    the ratio of the two medians for a report without rounds."""
    rounds = row.get("ratio_rounds")
    if not rounds:
        return fmt_ratio(row.get("gradgen_portable_ms"), row.get("ort_ms"))
    return f"{statistics.median(rounds):.2f}x ({min(rounds):.2f}-{max(rounds):.2f})"


def _format_profiles(report: dict, top: int = 6) -> list[str]:
    """``--profile``: where gradgen's portable step spends its time, the costliest op types first."""
    lines = []
    for n, run in report["runs"].items():
        for name, r in run.get("cases", {}).items():
            by_op = r.get("gradgen_by_op")
            if not by_op:
                continue
            total = sum(ms for _, _, ms in by_op) or 1.0
            shown = ", ".join(f"{op} {ms:.3g} ms ({100 * ms / total:.0f} %, {steps})" for op, steps, ms in by_op[:top])
            lines.append(f"  gradgen by op, {name}, {n} thread(s): {shown}")
    return lines
