"""The ``gradgen train`` and ``gradgen export`` commands (registered on the app in gradgen/cli.py).

Only typer and the standard library are imported here at module level, so that ``gradgen --help``
stays fast; the training machinery is imported when a command runs.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional, overload

import typer

_LOSS_KINDS = "cross_entropy, mse, l1 or bce_with_logits"


@overload
def loss_kind(value: str) -> str: ...
@overload
def loss_kind(value: None) -> None: ...
def loss_kind(value: Optional[str]) -> Optional[str]:
    """--add-loss's value, with '-' accepted for '_' (cross-entropy)."""
    return value.replace("-", "_") if value is not None else None


def train(
    model: Path = typer.Argument(..., help="Forward ONNX model: it computes a scalar loss, or use --add-loss."),
    data: Path = typer.Option(
        ...,
        "--data",
        help=".npz of training data: one array per data input of the model (named after it), samples along the first axis; "
        "or a directory of such .npz shards (read lazily, in the order of their names).",
    ),
    optimizer: str = typer.Option("adamw", "--optimizer", help="sgd or adamw."),
    lr: float = typer.Option(..., "--lr", help="Peak learning rate."),
    steps: int = typer.Option(
        ..., "--steps", min=1, help="Train until this optimizer step (with --resume: the total, counting the checkpoint's steps)."
    ),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", min=1, help="Samples per micro-batch. Default: the model's fixed batch dimension."
    ),
    accumulate: int = typer.Option(
        1, "--accumulate", min=1, help="Micro-batches per optimizer step (their gradients are averaged)."
    ),
    momentum: float = typer.Option(0.0, "--momentum", help="SGD momentum."),
    nesterov: bool = typer.Option(False, "--nesterov", help="SGD with Nesterov momentum."),
    weight_decay: Optional[float] = typer.Option(
        None, "--weight-decay", help="SGD: L2 penalty added to the gradient (default 0); AdamW: decoupled decay (default 0.01)."
    ),
    beta1: float = typer.Option(0.9, "--beta1", help="AdamW beta1."),
    beta2: float = typer.Option(0.999, "--beta2", help="AdamW beta2."),
    eps: float = typer.Option(1e-8, "--eps", help="AdamW epsilon."),
    clip_norm: Optional[float] = typer.Option(None, "--clip-norm", help="Clip the global gradient norm to this."),
    schedule: str = typer.Option(
        "constant",
        "--schedule",
        help="Learning-rate schedule after warm-up: constant, linear or cosine (decay to --min-lr at --steps).",
    ),
    warmup_steps: int = typer.Option(0, "--warmup-steps", min=0, help="Linear warm-up from 0 over these steps."),
    min_lr: float = typer.Option(0.0, "--min-lr", help="Learning rate at the end of a linear or cosine decay."),
    loss: Optional[str] = typer.Option(None, "--loss", help="The model's loss output. Default: its only scalar float output."),
    add_loss: Optional[str] = typer.Option(
        None,
        "--add-loss",
        help=f"Append a loss ({_LOSS_KINDS}) to the output named by --loss-output; its target becomes a data input.",
    ),
    loss_output: Optional[str] = typer.Option(
        None, "--loss-output", help="With --add-loss: the output (logits, predictions) the loss reads."
    ),
    target: Optional[str] = typer.Option(
        None,
        "--target",
        help="With --add-loss: the name of the target input (default labels for cross_entropy, target otherwise).",
    ),
    ignore_index: Optional[int] = typer.Option(
        None, "--ignore-index", show_default=False, help="--add-loss cross_entropy: label value to ignore (default -100)."
    ),
    label_smoothing: Optional[float] = typer.Option(
        None, "--label-smoothing", show_default=False, help="--add-loss cross_entropy: label smoothing in [0, 1) (default 0)."
    ),
    class_axis: Optional[int] = typer.Option(
        None,
        "--class-axis",
        show_default=False,
        help="--add-loss cross_entropy: the classes' axis of the logits (default -1, the last).",
    ),
    freeze: Optional[List[str]] = typer.Option(None, "--freeze", help="Keep this parameter fixed (repeatable)."),
    also_train: Optional[List[str]] = typer.Option(
        None,
        "--train",
        help="Train this initializer although a torch.export model marks it as a buffer or its exporter folded it "
        "from several values (repeatable; a note names what is left out).",
    ),
    tie_weights: bool = typer.Option(
        False,
        "--tie-weights",
        help="Train a weight the exporter wrote twice (an initializer and its transpose: an LM head sharing its "
        "embedding) as one parameter, as PyTorch does; export writes both copies.",
    ),
    eval_data: Optional[Path] = typer.Option(
        None,
        "--eval-data",
        help=".npz or directory of .npz shards of evaluation data (as --data); "
        "its mean loss, in inference mode (BatchNormalization's running statistics, no Dropout), "
        "is reported at the end and every --eval-every steps.",
    ),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=1, help="Evaluate every this many steps."),
    checkpoint_dir: Optional[Path] = typer.Option(
        None,
        "--checkpoint-dir",
        help="Write checkpoint.npz (and "
        "log.csv, loss.png) here: every --checkpoint-every steps, at "
        "the end, on Ctrl-C and before a NaN step.",
    ),
    checkpoint_every: int = typer.Option(100, "--checkpoint-every", min=1, help="Steps between checkpoints."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint in --checkpoint-dir."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the data order."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda or auto."),
    precision: str = typer.Option(
        "fp32",
        "--precision",
        help="fp32, tf32, bf16 or fp16 (as build-backward "
        "--precision; parameters and optimizer states stay float32); fp16 uses dynamic "
        "loss scaling.",
    ),
    loss_scale: Optional[float] = typer.Option(
        None,
        "--loss-scale",
        help="--precision fp16: the initial loss scale (default 65536, as torch.amp.GradScaler); "
        "an Inf / NaN gradient skips the step and halves it, 2000 good steps double it.",
    ),
    log: Optional[Path] = typer.Option(
        None,
        "--log",
        help="CSV log (step, loss, lr, grad_norm, eval_loss, skipped). Default: log.csv in --checkpoint-dir.",
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Loss-curve PNG (needs matplotlib: the plot extra). Default: loss.png in --checkpoint-dir."
    ),
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, help="CPU: threads of numpy's BLAS (as gradgen run --threads). Default: the BLAS's choice."
    ),
    progress: Optional[bool] = typer.Option(
        None,
        "--progress/--no-progress",
        help="Say what is being done, and a line per step or so, on stderr. Default: only when stderr is a terminal.",
    ),
) -> None:
    """Train MODEL on DATA with gradgen's executor; checkpoints, a CSV log and a loss curve."""
    from gradgen.cli import _warnings_as_notes, progress_printer
    from gradgen.executor.threads import check_threads, cpu_threads
    from gradgen.training import command

    progress_line = progress_printer(progress)
    check_threads(threads)

    options = command.TrainOptions(
        model=model,
        data=data,
        optimizer=optimizer,
        lr=lr,
        steps=steps,
        batch_size=batch_size,
        accumulate=accumulate,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        clip_norm=clip_norm,
        schedule=schedule,
        warmup_steps=warmup_steps,
        min_lr=min_lr,
        loss=loss,
        add_loss=loss_kind(add_loss),
        loss_output=loss_output,
        target=target,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        class_axis=class_axis,
        freeze=list(freeze or []),
        also_train=list(also_train or []),
        tie_weights=tie_weights,
        eval_data=eval_data,
        eval_every=eval_every,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        seed=seed,
        device=device,
        log=log,
        plot=plot,
        precision=precision,
        loss_scale=loss_scale,
    )
    with _warnings_as_notes(), cpu_threads(threads):
        summary = command.run_training(options, say=lambda m: typer.echo(m, err=True), progress=progress_line)
    for line in summary:
        typer.echo(line)


def export(
    model: Path = typer.Argument(..., help="The forward ONNX model that was trained."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="A checkpoint .npz, or a --checkpoint-dir."),
    out: Path = typer.Option(..., "-o", "--output", help="Where to write the trained model (never MODEL)."),
    keep_loss: bool = typer.Option(False, "--keep-loss", help="Keep the loss output (and the targets it reads)."),
) -> None:
    """Write MODEL with the checkpoint's trained parameters, the training loss removed, for inference."""
    from gradgen.model_io import check_output_path, save_model
    from gradgen.names import value_names
    from gradgen.training.checkpoint import checkpoint_path
    from gradgen.training.export import export_trained

    check_output_path(out, model, checkpoint_path(checkpoint))
    started = time.perf_counter()
    trained = export_trained(model, checkpoint, keep_loss=keep_loss)
    save_model(trained, out)
    graph = trained.graph
    typer.echo(f"inputs: {', '.join(n for n in value_names(graph.inputs) if n not in graph.initializers)}")
    typer.echo(f"outputs: {', '.join(value_names(graph.outputs))}")
    typer.echo(f"wrote {out} in {time.perf_counter() - started:.2f} s")


def artifacts(
    model: Path = typer.Argument(..., help="Forward ONNX model: it computes a scalar loss, or use --loss KIND."),
    directory: Path = typer.Option(
        ...,
        "-o",
        "--artifact-dir",
        help="Directory to write training_model.onnx, "
        "eval_model.onnx, optimizer_model.onnx and checkpoint into (created if missing; "
        "existing artifacts are replaced).",
    ),
    requires_grad: Optional[List[str]] = typer.Option(
        None,
        "--requires-grad",
        help="Train this float initializer (repeatable). Default: every float initializer the loss depends on, less --frozen.",
    ),
    frozen: Optional[List[str]] = typer.Option(
        None, "--frozen", help="A float initializer the checkpoint holds but training keeps fixed (repeatable)."
    ),
    loss: Optional[str] = typer.Option(
        None,
        "--loss",
        help=f"Append a loss ({_LOSS_KINDS}) to the output named by "
        "--output; its target becomes an input. Default: the model's only scalar float "
        "output is the loss.",
    ),
    output: Optional[str] = typer.Option(
        None, "--output", help="With --loss: the output (logits, predictions) the loss reads. Default: the model's only output."
    ),
    target: Optional[str] = typer.Option(
        None, "--target", help="With --loss: the name of the target input (default labels for cross_entropy, target otherwise)."
    ),
    ignore_index: Optional[int] = typer.Option(
        None, "--ignore-index", show_default=False, help="--loss cross_entropy: label value to ignore (default -100)."
    ),
    label_smoothing: Optional[float] = typer.Option(
        None, "--label-smoothing", show_default=False, help="--loss cross_entropy: label smoothing in [0, 1) (default 0)."
    ),
    optimizer: str = typer.Option(
        "adamw",
        "--optimizer",
        help="adamw (AdamWOptimizer, PyTorch's AdamW), sgd (SGDOptimizerV2, plain SGD) or none (no optimizer model).",
    ),
    beta1: float = typer.Option(0.9, "--beta1", help="AdamW beta1."),
    beta2: float = typer.Option(0.999, "--beta2", help="AdamW beta2."),
    eps: float = typer.Option(1e-8, "--eps", help="AdamW epsilon."),
    weight_decay: Optional[float] = typer.Option(None, "--weight-decay", help="AdamW decoupled weight decay (default 0.01)."),
    clip_norm: Optional[float] = typer.Option(
        None, "--clip-norm", help="Clip the global gradient norm to this (InplaceClipGradNorm in the optimizer model)."
    ),
    tie_weights: bool = typer.Option(
        False,
        "--tie-weights",
        help="Train a weight the exporter wrote twice (an initializer and its transpose: an LM head sharing its "
        "embedding) as one parameter, as PyTorch does.",
    ),
) -> None:
    """Write ONNX Runtime training's artifacts for MODEL (what its generate_artifacts writes), for its
    Module / Optimizer / CheckpointState API."""
    from gradgen.cli import _warnings_as_notes
    from gradgen.errors import UsageError
    from gradgen.training.artifacts import generate_artifacts, optimizer_for, output_directory, save_artifacts
    from gradgen.training.losses import LossSpec, cross_entropy_only
    from gradgen.training.ort_checkpoint import require_flatbuffers

    require_flatbuffers()
    started = time.perf_counter()
    chosen = optimizer_for(optimizer, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    if loss is None and (output or target):
        raise UsageError("--output and --target go with --loss")
    cross_entropy_only(loss_kind(loss), "--loss", ignore_index=ignore_index, label_smoothing=label_smoothing)
    spec = (
        LossSpec(
            loss_kind(loss),
            output,
            target=target,
            ignore_index=-100 if ignore_index is None else ignore_index,
            label_smoothing=label_smoothing or 0.0,
        )
        if loss is not None
        else None
    )
    with output_directory(directory, model):
        with _warnings_as_notes():
            made = generate_artifacts(
                model,
                requires_grad=requires_grad or None,
                frozen=frozen or (),
                loss=spec,
                optimizer=chosen,
                clip_norm=clip_norm,
                tie_weights=tie_weights,
            )
        for note in made.compatibility_notes():
            typer.echo(f"note: {note}", err=True)
        paths = save_artifacts(made, directory, model)
    typer.echo(f"loss: {made.loss}; user inputs: {', '.join(made.user_inputs)}")
    for what, params in (("trainable", made.requires_grad), ("frozen", made.frozen)):
        count = sum(int(t.size) for t in params.values())
        names = ", ".join(list(params)[:8]) + (f" and {len(params) - 8} more" if len(params) > 8 else "")
        typer.echo(f"{what}: {len(params)} parameter(s), {count} values" + (f": {names}" if names else ""))
    typer.echo(f"wrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - started:.2f} s")
