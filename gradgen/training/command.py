"""What ``gradgen train`` does, apart from parsing: checks, training, checkpoints, log and plot.

``run_training(TrainOptions(...), say, progress)`` returns the summary lines for stdout; notes go
through ``say``, progress lines (and the per-step ``Progress`` callback) only when ``progress`` is
given (the CLI: on a terminal or with --progress). Every check that can fail (options, the data
files, the checkpoint directory, the data against the model's inputs, a checkpoint to resume) runs
before the first step; the files before the training graphs are built.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Callable, Optional

from gradgen.errors import RunError, UsageError, warnings_said
from gradgen.training.callbacks import CsvLog, History, Progress, plot_available, plot_history, plot_loss_curve
from gradgen.training.checkpoint import FILE_NAME, check_checkpoint, load_checkpoint, save_checkpoint
from gradgen.training.data import (
    Dataset,
    SequentialBatches,
    ShuffledBatches,
    check_arrays,
    default_batch_size,
    open_data,
    sequential_batches,
)
from gradgen.training.exporter_constants import marked_parameter
from gradgen.training.loss_scaling import LossScaling
from gradgen.training.losses import LossSpec, cross_entropy_only
from gradgen.training.optimizers import SGD, AdamW
from gradgen.training.program import TrainingProgram, build_training
from gradgen.training.schedules import Schedule
from gradgen.training.shards import NpzShards, ShardReadError
from gradgen.training.trainer import Callback, NonFiniteLossError, Trainer


@dataclasses.dataclass
class TrainOptions:
    model: Path
    data: Path
    lr: float
    steps: int
    optimizer: str = "adamw"
    batch_size: Optional[int] = None
    accumulate: int = 1
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: Optional[float] = None
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_norm: Optional[float] = None
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    loss: Optional[str] = None
    add_loss: Optional[str] = None
    loss_output: Optional[str] = None
    target: Optional[str] = None
    ignore_index: Optional[int] = None  # the cross_entropy options; None: not given (-100, 0, -1)
    label_smoothing: Optional[float] = None
    class_axis: Optional[int] = None
    freeze: list[str] = dataclasses.field(default_factory=list)
    also_train: list[str] = dataclasses.field(default_factory=list)
    tie_weights: bool = False
    eval_data: Optional[Path] = None
    eval_every: Optional[int] = None
    checkpoint_dir: Optional[Path] = None
    checkpoint_every: int = 100
    resume: bool = False
    seed: int = 0
    device: str = "cpu"
    log: Optional[Path] = None
    plot: Optional[Path] = None
    precision: str = "fp32"
    loss_scale: Optional[float] = None  # fp16: the initial loss scale (None: LossScaling's default)


def _loss_scaling(o: TrainOptions) -> LossScaling | None:
    """``--loss-scale``: fp16's initial scale (GradScaler's 65536 when not given)."""
    if o.loss_scale is None:
        return None
    if o.precision != "fp16":
        raise UsageError(f"--loss-scale applies to --precision fp16 (this run is {o.precision}, which has no loss scaling)")
    if not (math.isfinite(o.loss_scale) and o.loss_scale > 0):
        raise UsageError(f"--loss-scale {o.loss_scale}: expected a positive, finite number (such as 65536)")
    return LossScaling(init_scale=o.loss_scale)


def make_optimizer(o: TrainOptions) -> SGD | AdamW:
    if o.optimizer == "sgd":
        if (o.beta1, o.beta2, o.eps) != (0.9, 0.999, 1e-8):
            raise UsageError("--beta1, --beta2 and --eps are AdamW options; --optimizer is sgd")
        return SGD(momentum=o.momentum, nesterov=o.nesterov, weight_decay=o.weight_decay or 0.0)
    if o.optimizer == "adamw":
        if o.momentum or o.nesterov:
            raise UsageError("--momentum and --nesterov are SGD options; --optimizer is adamw")
        weight_decay = 0.01 if o.weight_decay is None else o.weight_decay
        return AdamW(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=weight_decay)
    raise UsageError(f"unknown optimizer {o.optimizer!r}: choose sgd or adamw")


def make_loss_spec(o: TrainOptions) -> LossSpec | None:
    cross_entropy_only(
        o.add_loss, "--add-loss", ignore_index=o.ignore_index, label_smoothing=o.label_smoothing, class_axis=o.class_axis
    )
    if o.add_loss is None:
        if o.loss_output or o.target:
            raise UsageError("--loss-output and --target go with --add-loss")
        return None
    if o.loss is not None:
        raise UsageError("--loss names the model's own loss; --add-loss adds one: use one of them")
    if not o.loss_output:
        raise UsageError("--add-loss needs --loss-output NAME: the output (logits, predictions) the loss reads")
    return LossSpec(
        o.add_loss,
        o.loss_output,
        target=o.target,
        ignore_index=-100 if o.ignore_index is None else o.ignore_index,
        label_smoothing=o.label_smoothing or 0.0,
        class_axis=-1 if o.class_axis is None else o.class_axis,
        output_option="--loss-output",
    )


def prepare_checkpoint_dir(o: TrainOptions) -> Path | None:
    """The checkpoint file to write (and read with --resume); the directory is created and probed."""
    from gradgen.model_io import check_output_path

    if o.checkpoint_dir is None:
        if o.resume:
            raise UsageError("--resume needs --checkpoint-dir (the directory holding the checkpoint)")
        return None
    directory = o.checkpoint_dir
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--checkpoint-dir {directory}: not a directory")
    for what, data in (("--data", o.data), ("--eval-data", o.eval_data)):
        if data is not None and data.is_dir() and directory.resolve() == data.resolve():
            raise UsageError(f"--checkpoint-dir {directory} is the {what} directory: its checkpoint.npz would be read as a shard")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--checkpoint-dir {directory}: cannot create it: {exc.strerror or exc}") from None
    path = directory / FILE_NAME
    check_output_path(path, o.model, o.data)  # writable? (a probe file, removed at once)
    if o.resume and not path.exists():
        raise UsageError(f"--resume: {directory} holds no {FILE_NAME} to continue from")
    if not o.resume and path.exists():
        raise UsageError(
            f"{path} exists: pass --resume to continue that training, or choose another "
            "--checkpoint-dir (it would be overwritten)"
        )
    return path


class PeriodicCheckpoint(Callback):
    def __init__(self, every: int, save: Callable[[], None]):
        self.every, self.save = every, save

    def on_step_end(self, trainer: Trainer, result) -> None:
        if result.step % self.every == 0:
            self.save()


def _build(o: TrainOptions, optimizer, add_loss: LossSpec | None) -> TrainingProgram:
    return build_training(
        o.model,
        optimizer=optimizer,
        loss=o.loss,
        add_loss=add_loss,
        freeze=o.freeze,
        also_train=o.also_train,
        tie_weights=o.tie_weights,
        clip_norm=o.clip_norm,
        accumulation=o.accumulate,
        precision=o.precision,
        loss_scaling=_loss_scaling(o),
    )


def run_training(o: TrainOptions, say: Callable[[str], None], progress: Optional[Callable[[str], None]] = None) -> list[str]:
    """Train per ``o``; return the summary lines. Notes go to ``say``; progress (what is being done,
    a line per step or so) to ``progress``, none when it is None."""
    optimizer = make_optimizer(o)
    add_loss = make_loss_spec(o)
    schedule = Schedule(
        o.schedule,
        lr=o.lr,
        warmup_steps=o.warmup_steps,
        total_steps=o.steps if o.schedule != "constant" else None,
        min_lr=o.min_lr,
    )
    if o.eval_every and o.eval_data is None:
        raise UsageError("--eval-every needs --eval-data")
    data = _open_data(o.data, "--data", say)  # a missing or unreadable file is said before any work
    eval_data = _open_data(o.eval_data, "--eval-data", say) if o.eval_data is not None else None
    checkpoint = prepare_checkpoint_dir(o)
    directory = o.checkpoint_dir
    log_path = o.log or (directory / "log.csv" if directory else None)
    plot_path = o.plot or (directory / "loss.png" if directory else None)
    _check_writable(o, log_path, plot_path)
    if o.plot is not None and not plot_available():  # an explicit --plot would be ignored
        raise UsageError("--plot needs matplotlib, which is not installed (pip install 'gradgen[plot]')")

    resumed = load_checkpoint(checkpoint) if o.resume and checkpoint is not None else None  # readable?
    tell = progress or (lambda message: None)
    tell(f"building the training graphs of {o.model}")
    with warnings_said(lambda message: say(f"note: {message}")):  # before the first step, not after the last
        program = _build(o, optimizer, add_loss)
    initializers = program.source.graph.initializers
    scalars = [
        name
        for name in program.params
        if program.initial_params[name].size == 1 and not (name in initializers and marked_parameter(initializers[name]))
    ]
    if scalars:
        say(
            f"note: training single-value initializer(s) {', '.join(map(repr, scalars[:5]))}"
            f"{' and more' if len(scalars) > 5 else ''}; exporters store constants as initializers too: "
            "--freeze those that are not parameters"
        )
    batch_size = o.batch_size or default_batch_size(program.data_inputs)
    if batch_size is None:
        raise UsageError("pass --batch-size: the model's data inputs have no common fixed batch dimension")
    check_arrays(data, program.data_inputs, batch_size, f"--data {o.data}")
    eval_batches = _eval_batches(o, eval_data, program, batch_size, say)
    data_record = {"seed": o.seed, "batch_size": batch_size, "accumulation": o.accumulate, "samples": data.count}

    history = History()
    trainer = Trainer(program, lr=schedule, device=o.device, callbacks=[history])
    start = 0
    if resumed is not None:
        assert checkpoint is not None  # prepare_checkpoint_dir refuses --resume without a directory
        state, meta = resumed
        check_checkpoint(checkpoint, meta, state, program)
        _check_same_data_order(checkpoint, meta.get("data", {}), data_record)
        if meta.get("schedule") != dataclasses.asdict(schedule):
            say(
                f"note: the learning-rate schedule differs from the checkpoint's ({_describe(meta.get('schedule'))} "
                f"-> {_describe(dataclasses.asdict(schedule))}); the run continues with the new one"
            )
        trainer.load_state(state)
        start = state.step
        if start >= o.steps:
            return [f"nothing to do: the checkpoint is at step {start}, and --steps is {o.steps}"]
        tell(f"resuming from {checkpoint} at step {start}")

    def save() -> None:
        assert checkpoint is not None  # called only with --checkpoint-dir
        state = trainer.state
        extra = {
            "data": data_record,
            "rng": _rng_record(o.seed, state.step * o.accumulate),
            "schedule": dataclasses.asdict(schedule),
        }
        save_checkpoint(checkpoint, program, state, extra)

    csv_log = CsvLog(log_path, start_step=start) if log_path else None
    trainer.callbacks += [c for c in (csv_log, Progress(o.steps) if progress else None) if c is not None]
    if checkpoint is not None:
        trainer.callbacks.append(PeriodicCheckpoint(o.checkpoint_every, save))
    batches = ShuffledBatches(data, batch_size, o.seed, start=start * o.accumulate)
    running = len(program.running_statistics_updated) // 2
    tell(
        f"training {len(program.params)} parameter tensor(s) with {optimizer.kind} on {trainer.runner.device}, "
        f"batch size {batch_size}"
        + (f" x {o.accumulate} micro-batches" if o.accumulate > 1 else "")
        + (f"; updating the running statistics of {running} BatchNormalization node(s)" if running else "")
    )
    started = time.perf_counter()
    try:
        trainer.fit(batches, o.steps - start, eval_batches=eval_batches, eval_every=o.eval_every)
    except NonFiniteLossError as exc:
        if checkpoint is None:
            raise RunError(f"{exc} (no --checkpoint-dir: nothing saved)") from None
        save()
        raise RunError(f"{exc}, saved in {checkpoint}") from None
    except ShardReadError as exc:
        if checkpoint is None:
            raise
        save()
        raise ShardReadError(f"{exc}; step {trainer.step} saved in {checkpoint}") from None
    except KeyboardInterrupt:
        if checkpoint is not None:
            save()
            say(f"interrupted after step {trainer.step}; checkpoint saved to {checkpoint}")
        else:
            say(f"interrupted after step {trainer.step}; no --checkpoint-dir, nothing saved")
        raise
    finally:
        if csv_log is not None:
            csv_log.close()
    seconds = time.perf_counter() - started
    if checkpoint is not None:
        save()
    return _summary(
        o, history, start, seconds, trainer.runner.device, checkpoint, log_path, _plot(history, log_path, plot_path, say)
    )


def _check_writable(o: TrainOptions, *paths: Path | None) -> None:
    from gradgen.model_io import check_output_path

    for path in paths:
        if path is not None:
            check_output_path(path, o.model, o.data, *([o.eval_data] if o.eval_data else []))


def _eval_batches(
    o: TrainOptions, data: Dataset | None, program: TrainingProgram, batch_size: int, say
) -> SequentialBatches | None:
    if data is None:
        return None
    check_arrays(data, program.data_inputs, batch_size, f"--eval-data {o.eval_data}")
    batches = sequential_batches(data, batch_size)
    count = data.count
    if count % batch_size:
        say(
            f"note: evaluation uses {len(batches) * batch_size} of the {count} samples of {o.eval_data} "
            f"(whole batches of {batch_size})"
        )
    return batches


def _open_data(path: Path, what: str, say) -> Dataset:
    """The dataset of --data / --eval-data (an .npz, or a directory of .npz shards); notes what a
    directory holds besides its shards, and compressed shards larger than the cache."""
    data = open_data(path, what)
    if isinstance(data, NpzShards):
        if data.ignored:
            names = ", ".join(data.ignored[:5]) + (f" and {len(data.ignored) - 5} more" if len(data.ignored) > 5 else "")
            say(f"note: {what} {path}: ignoring what is not an .npz shard: {names}")
        if data.compressed_bytes > data.cache_bytes:
            say(
                f"note: {what} {path}: the compressed shards hold {data.compressed_bytes / 2**20:.0f} MiB, more than the "
                f"{data.cache_bytes / 2**20:.0f} MiB cache: shuffled batches decompress shards again and again; "
                "shards saved uncompressed (numpy.savez) are memory-mapped instead"
            )
    return data


def _check_same_data_order(checkpoint: Path, saved: dict, now: dict) -> None:
    """The data order the checkpoint recorded is this run's (a record without a sample count,
    from before it was recorded, is not checked on it)."""
    flags = {"accumulation": "--accumulate", "samples": "samples in --data"}
    changed = [
        f"{flags.get(k, '--' + k.replace('_', '-'))} {saved.get(k)} -> {now[k]}"
        for k in now
        if saved.get(k) != now[k] and (k in saved or k != "samples")
    ]
    if changed:
        raise UsageError(
            f"{checkpoint}: resuming with another data order ({', '.join(changed)}); use the checkpoint's settings to continue it"
        )


def _describe(schedule: dict | None) -> str:
    if not schedule:
        return "none recorded"
    return ", ".join(f"{k}={v}" for k, v in schedule.items())


def _rng_record(seed: int, batches_drawn: int) -> dict:
    """The data order's random state: epoch e is numpy.random.default_rng([seed, e]).permutation(n)."""
    return {"generator": "numpy.random.default_rng([seed, epoch]).permutation", "seed": seed, "batches_drawn": batches_drawn}


def _plot(history: History, log_path: Path | None, plot_path: Path | None, say) -> Path | None:
    """The loss curve: from the CSV log (which holds the steps before a --resume too), else from
    this run's own history."""
    if plot_path is None:
        return None
    if not plot_available():
        say("note: no loss curve: matplotlib is not installed (pip install 'gradgen[plot]')")
        return None
    if log_path is None:
        return plot_history(history, plot_path)
    return plot_loss_curve(log_path, plot_path)


def _summary(o, history: History, start: int, seconds: float, device: str, checkpoint, log_path, plot_path) -> list:
    steps = history.steps
    lines = []
    if steps:
        lines.append(f"trained steps {start + 1} to {steps[-1].step}: loss {steps[0].loss:.6g} -> {steps[-1].loss:.6g}")
        lines.append(f"{len(steps)} step(s) in {seconds:.2f} s ({len(steps) / seconds:.1f} step/s) on {device}")
        skipped = sum(r.skipped for r in steps)
        if skipped:
            lines.append(f"{skipped} of them skipped by loss scaling (an Inf / NaN float16 gradient: no update, scale halved)")
    if history.evaluations:
        step, loss = history.evaluations[-1]
        lines.append(f"evaluation loss at step {step}: {loss:.6g}")
    for what, path in (("checkpoint", checkpoint), ("log", log_path), ("loss curve", plot_path)):
        if path is not None:
            lines.append(f"{what}: {path}")
    return lines
