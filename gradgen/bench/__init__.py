"""``gradgen bench`` (also ``python -m gradgen.bench``): gradgen against PyTorch and ONNX Runtime.

Groups (``--only``, repeatable; without it the GPU kernel groups and the small ``step`` run):

- slice, gather, gather_elements, reduce, bga, conv: GPU kernels against PyTorch (``kernels.py``);
- step: a training step of the small cnn and transformer samples on the GPU (``kernels.py``);
- e2e: real-size training steps, PyTorch eager / torch.compile / gradgen, each in its own process,
  with device memory, gradient agreement and a variable-length loop (``e2e.py``);
- train: a full AdamW training step (forward, backward, update), PyTorch eager and torch.compile
  with fused AdamW / gradgen's DeviceStepRunner, each in its own process (``train.py``);
- cpu: gradgen's CPU step against ONNX Runtime and PyTorch eager at 1 thread and all cores, and
  build-backward time (``cpu.py``).

e2e and train run at each precision of ``--precision`` (fp32, tf32, bf16, fp16; ``precision.py``).

Results and what limits them are recorded in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradgen.errors import GradgenError, UsageError

KERNEL_GROUPS = ("slice", "gather", "gather_elements", "reduce", "bga", "conv", "step")
GROUPS = (*KERNEL_GROUPS, "e2e", "train", "cpu")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other gradgen command
        raise UsageError(f"gradgen bench: {message}")


def _integer_from(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}: {text}")
        return value

    return parse


_positive = _integer_from(1)
_non_negative = _integer_from(0)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0: {text}")
    return value


def _precision_list(text: str) -> list[str]:
    from gradgen.bench.precision import parse_list

    return parse_list(text)


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"sequence lengths must be at least 2: {text}")
    return values


def build_parser() -> argparse.ArgumentParser:
    from gradgen.bench.models import PRESETS

    p = _Parser(
        prog="gradgen bench",
        description="Time gradgen against PyTorch and ONNX Runtime: GPU kernels, "
        "real-size training steps (e2e), the CPU path (cpu).",
        epilog="Examples: gradgen bench --only e2e --json e2e.json; "
        "gradgen bench --only e2e --model gpt2s --batch 2 --seq 64 --steps 5 (a quick try); "
        "gradgen bench --only cpu --threads 1",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--only",
        action="append",
        choices=GROUPS,
        metavar="GROUP",
        help=f"run only this group (repeatable): {', '.join(GROUPS)}; default: {', '.join(KERNEL_GROUPS)}",
    )
    e2e = p.add_argument_group("e2e, train and cpu: models")
    e2e.add_argument(
        "--model",
        action="append",
        choices=list(PRESETS),
        metavar="NAME",
        help=f"model (repeatable): {', '.join(PRESETS)}; e2e and train default: gpt2s and resnet18; "
        "cpu default: gpt2s at B=1, T=128 and resnet18 at B=4",
    )
    e2e.add_argument("--batch", type=_positive, help="batch size for every selected model")
    e2e.add_argument("--seq", type=_positive, help="sequence length of the GPT-2 layouts")
    e2e.add_argument("--image", type=_positive, help="image side of ResNet-18")
    e2e.add_argument("--layers", type=_positive, help="number of blocks of the GPT-2 layouts")
    e2e.add_argument("--width", type=_positive, help="model width of the GPT-2 layouts")
    e2e.add_argument("--heads", type=_positive, help="attention heads of the GPT-2 layouts")
    e2e.add_argument(
        "--batch-stats",
        action="store_true",
        help="ResNet-18's BatchNorm in training mode (normalising with the batch's statistics), as a CNN trains "
        "and is exported for training; default eval mode (running statistics)",
    )
    e2e.add_argument(
        "--seed",
        type=_non_negative,
        action="append",
        help="seed of the parameters and the batch (default 0); repeatable: each model runs once per seed, "
        "and below fp32 a summary says at how many seeds each verdict holds (one seed's can be noise)",
    )
    e2e.add_argument(
        "--steps",
        type=_positive,
        help="timed steps (e2e: median of 30 by default; train: 20; cpu: at most 20, within 10 s per measurement)",
    )
    e2e.add_argument("--warmup", type=_non_negative, help="warm-up steps before timing (e2e default 5, cpu 1)")
    e2e.add_argument("--json", type=Path, metavar="FILE", help="also write every e2e / train / cpu number to FILE (JSON)")
    e2e.add_argument("--keep", type=Path, metavar="DIR", help="keep the exported models and child results under DIR")
    e2e.add_argument(
        "--child-timeout",
        type=_positive_seconds,
        default=None,
        metavar="S",
        help="give up on one child process after S seconds (default 1800; cpu 3600)",
    )
    e2e.add_argument("--debug", action="store_true", help="children print tracebacks of failures")
    g = p.add_argument_group("e2e (and train: --framework, --device, --precision)")
    g.add_argument(
        "--framework",
        action="append",
        choices=["eager", "compile", "gradgen"],
        help="frameworks to measure (repeatable; default all three)",
    )
    g.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="where the e2e group runs (cpu: a quick functional try without memory figures)",
    )
    g.add_argument(
        "--precision",
        action="append",
        type=_precision_list,
        metavar="P[,P...]",
        help="fp32 (default; TF32 off), tf32, bf16 or fp16, repeatable or a comma list; each (model, precision) is its "
        "own table; PyTorch: allow_tf32 / the forward under torch.autocast (train fp16: GradScaler); gradgen: "
        "graphs built with the precision; below fp32 the gradients (e2e) and loss curve (train) are compared with fp32's",
    )
    g.add_argument("--no-varlen", action="store_true", help="skip the variable-length loop of the GPT-2 layouts")
    g.add_argument(
        "--lengths", type=_lengths, metavar="T1,T2,...", help="sequence lengths of the loop (default: T, T-16, ..., T-112)"
    )
    g.add_argument("--passes", type=_positive, default=2, help="passes over the lengths (default 2)")
    g.add_argument(
        "--profile",
        action="store_true",
        help="e2e: also print the GPU time of one gradgen step by kernel and by op (torch.profiler); cpu: gradgen's "
        "step time by op type (every step timed, Session.profile)",
    )
    c = p.add_argument_group("cpu only")
    c.add_argument(
        "--threads", action="append", type=_positive, metavar="N", help="thread counts (repeatable; default 1 and all cores)"
    )
    c.add_argument("--sample", action="append", metavar="NAME", help="bundled samples to time (repeatable; default all)")
    c.add_argument("--no-samples", action="store_true", help="skip the bundled samples")
    c.add_argument(
        "--build-layers",
        type=_non_negative,
        default=48,
        metavar="N",
        help="layers of the GPT-2 layout whose build-backward is timed (0: skip; default 48)",
    )
    c.add_argument(
        "--ort-python",
        metavar="PYTHON",
        help="an interpreter with onnxruntime-training, whose C++ gradient builder is timed on the same model "
        "(default $GRADGEN_ORT_TRAINING_PYTHON, else this one where it has the package)",
    )
    return p


def _specs(args, defaults: list) -> list:
    from gradgen.bench import models
    from gradgen.errors import UsageError

    seeds = list(dict.fromkeys(args.seed or [0]))
    if not args.model:
        overridden = args.batch or args.seq or args.image or args.layers or args.width or args.heads or args.batch_stats
        if not overridden and seeds == [0]:
            return defaults
        specs = [_override(spec, args, seed) for spec in defaults for seed in seeds]
    else:
        specs = [_override(models.preset(name), args, seed) for name in args.model for seed in seeds]
    if args.batch_stats and not any(spec.batch_stats for spec in specs):
        raise UsageError("--batch-stats applies to the ResNet-18 layouts (their BatchNorm); no --model selects one")
    return specs


def _override(spec, args, seed: int):
    from gradgen.bench import models

    gpt2 = spec.kind == "gpt2"
    return models.preset(
        spec.name,
        batch=args.batch or spec.batch,
        size=(args.seq if gpt2 else args.image) or spec.size,
        layers=args.layers if gpt2 else None,
        d=args.width if gpt2 else None,
        heads=args.heads if gpt2 else None,
        seed=seed,
        batch_stats=args.batch_stats and not gpt2,
    )


class _Results:
    """One JSON file for every group run: {group: report}, rewritten as results come in."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, Any] = {}
        if path is not None:  # a directory, a missing or read-only one: said before any work
            from gradgen.model_io import check_output_path

            try:
                check_output_path(path)
            except UsageError as exc:
                raise UsageError(f"--json {exc}") from None

    def update(self, group: str, report: dict) -> None:
        self.data[group] = report
        if self.path is not None:
            from gradgen.bench.measure import write_json_atomic

            write_json_atomic(self.path, self.data)


def run(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and run the chosen groups; errors are GradgenErrors (usage: exit 2)."""
    args = build_parser().parse_args(argv)
    groups = args.only or list(KERNEL_GROUPS)
    if args.precision and not {"e2e", "train"} & set(groups):
        raise UsageError("gradgen bench: --precision applies to the e2e and train groups (--only e2e, --only train)")
    if len(set(args.seed or [])) > 1 and "cpu" in groups:
        raise UsageError("gradgen bench: several --seed values apply to the e2e and train groups, not to cpu")
    from gradgen.bench.precision import flatten

    precisions = flatten(args.precision)
    results = _Results(args.json)
    gpu_groups = [g for g in groups if g in KERNEL_GROUPS or (g in ("e2e", "train") and args.device == "cuda")]
    if gpu_groups:
        from gradgen.executor.cuda_probe import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            raise UsageError(
                f"gradgen bench --only {gpu_groups[0]} needs a usable GPU: {reason}"
                + (" (the e2e and train groups run on the CPU with --device cpu)" if {"e2e", "train"} & set(gpu_groups) else "")
            )
    if any(g in KERNEL_GROUPS for g in groups):
        _run_kernel_groups([g for g in groups if g in KERNEL_GROUPS])
    if "e2e" in groups:
        from gradgen.bench import e2e, models

        options = e2e.E2EOptions(
            specs=_specs(args, [models.preset("gpt2s"), models.preset("resnet18")]),
            device=args.device,
            frameworks=tuple(dict.fromkeys(args.framework or e2e.FRAMEWORKS)),
            precisions=precisions,
            steps=args.steps or 30,
            warmup=5 if args.warmup is None else args.warmup,
            varlen=not args.no_varlen,
            lengths=args.lengths,
            passes=args.passes,
            child_timeout_s=args.child_timeout or 1800.0,
            keep_dir=_keep_dir(args.keep),
            debug=args.debug,
            profile=args.profile,
            on_update=lambda report: results.update("e2e", report),
        )
        e2e.run(options)
    if "train" in groups:
        from gradgen.bench import models, train

        train.run(
            train.TrainOptions(
                specs=_specs(args, [models.preset("gpt2s"), models.preset("resnet18")]),
                device=args.device,
                frameworks=tuple(dict.fromkeys(args.framework or train.FRAMEWORKS)),
                precisions=precisions,
                steps=args.steps or 20,
                warmup=5 if args.warmup is None else args.warmup,
                child_timeout_s=args.child_timeout or 1800.0,
                keep_dir=_keep_dir(args.keep),
                debug=args.debug,
                on_update=lambda report: results.update("train", report),
            )
        )
    if "cpu" in groups:
        from gradgen.bench import cpu

        cpu_options = cpu.CpuOptions(
            specs=_specs(args, cpu.default_specs()),
            samples=[] if args.no_samples else args.sample,
            threads=args.threads,
            warmup=1 if args.warmup is None else args.warmup,
            steps=args.steps or 20,
            build_layers=args.build_layers,
            ort_python=args.ort_python,
            child_timeout_s=args.child_timeout or 3600.0,
            keep_dir=_keep_dir(args.keep),
            debug=args.debug,
            profile=args.profile,
            on_update=lambda report: results.update("cpu", report),
        )
        cpu.run(cpu_options)


def _keep_dir(path: Path | None) -> Path | None:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
    return path


def _run_kernel_groups(groups: list[str]) -> None:
    import datetime

    import pycuda.autoprimaryctx  # noqa: F401
    from pycuda import driver

    from gradgen.bench import kernels

    print(f"device: {driver.Context.get_device().name()}; date: {datetime.date.today().isoformat()}")
    runners: dict[str, Callable[[], object]] = {
        "slice": kernels.bench_slice_grad,
        "gather": kernels.bench_gather_grad,
        "gather_elements": kernels.bench_gather_elements_grad,
        "reduce": kernels.bench_broadcast_reduction,
        "bga": kernels.bench_broadcast_gradient_args,
        "conv": kernels.bench_conv_grad,
        "step": lambda: (kernels.bench_full_step("cnn", 64), kernels.bench_full_step("transformer", 16)),
    }
    for group in groups:
        runners[group]()


def main(argv: list[str] | None = None) -> int:
    """``python -m gradgen.bench``: run, and turn gradgen errors into one line and their exit code."""
    try:
        run(argv)
    except GradgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


__all__ = ["GROUPS", "KERNEL_GROUPS", "build_parser", "main", "run"]
