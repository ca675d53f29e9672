"""Callbacks for ``Trainer.fit``: history, a CSV log, progress on a stream, a loss-curve PNG."""

from __future__ import annotations

import csv
import io
import math
import sys
import time
from pathlib import Path
from typing import TextIO

from gradgen.errors import UsageError
from gradgen.training.trainer import Callback, StepResult, Trainer

CSV_COLUMNS = ("step", "loss", "lr", "grad_norm", "eval_loss", "skipped")  # skipped: 1 where loss scaling skipped the update


class History(Callback):
    """Keeps every step's result and every evaluation."""

    def __init__(self):
        self.steps: list[StepResult] = []
        self.evaluations: list[tuple[int, float]] = []

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.steps.append(result)

    def on_evaluate(self, trainer: Trainer, step: int, loss: float) -> None:
        self.evaluations.append((step, loss))


class CsvLog(Callback):
    """One row per step (step, loss, lr, grad_norm, eval_loss, skipped), flushed as it is written.

    Continuing a run (``start_step`` > 0) keeps the rows up to that step and drops later ones
    (written after the checkpoint being resumed), so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str | Path, start_step: int = 0):
        self.path = Path(path)
        kept = read_log(self.path, up_to=start_step) if start_step and self.path.exists() else []
        try:
            self._file = open(self.path, "w", newline="")
        except OSError as exc:
            raise UsageError(f"{self.path}: cannot write the log: {exc.strerror or exc}") from None
        self._writer = csv.writer(self._file)
        self._writer.writerow(CSV_COLUMNS)
        for row in kept:  # a log written before the skipped column had none: its rows read as 0
            self._writer.writerow([row.get(c) or ("0" if c == "skipped" else "") for c in CSV_COLUMNS])
        self._file.flush()
        self._pending: StepResult | None = None

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self._flush_pending()
        self._pending = result  # written with the evaluation if one follows at this step

    def on_evaluate(self, trainer: Trainer, step: int, loss: float) -> None:
        if self._pending is not None and self._pending.step == step:
            self._write(self._pending, loss)
            self._pending = None

    def on_train_end(self, trainer: Trainer) -> None:
        self.close()

    def close(self) -> None:
        if not self._file.closed:
            self._flush_pending()
            self._file.close()

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self._write(self._pending, None)
            self._pending = None

    def _write(self, r: StepResult, eval_loss: float | None) -> None:
        evaluated = "" if eval_loss is None else repr(eval_loss)
        self._writer.writerow([r.step, repr(r.loss), repr(r.lr), repr(r.grad_norm), evaluated, int(r.skipped)])
        self._file.flush()


def read_log(path: str | Path, up_to: int | None = None) -> list[dict[str, str]]:
    """The rows of a CSV log (as strings), those up to step ``up_to`` when given."""
    with open(path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    return [r for r in rows if up_to is None or int(r["step"]) <= up_to]


class Progress(Callback):
    """``step 40/100  loss 0.4213  lr 1.0e-03  52.1 step/s  ETA 1s`` on ``stream`` (stderr), with
    ``3 skipped (overflow)`` once fp16 loss scaling has skipped an update: rewritten in place on a
    terminal, else one line every ``every_seconds`` and at the last step."""

    def __init__(self, total_steps: int, stream: TextIO | None = None, every_seconds: float = 1.0):
        self.total = total_steps
        self.stream = stream if stream is not None else sys.stderr
        self.every = every_seconds
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._started = self._last = 0.0
        self._first_step = 0
        self._eval: float | None = None
        self.skipped = 0  # steps loss scaling skipped (fp16 overflow) in this run

    def on_train_begin(self, trainer: Trainer) -> None:
        self._started = self._last = time.perf_counter()
        self._first_step = trainer.step

    def on_evaluate(self, trainer: Trainer, step: int, loss: float) -> None:
        self._eval = loss
        self._say(f"step {step}/{self.total}  eval loss {loss:.6g}", final=True)

    def on_step_end(self, trainer: Trainer, result: StepResult) -> None:
        self.skipped += result.skipped
        now = time.perf_counter()
        done = result.step - self._first_step
        rate = done / (now - self._started) if now > self._started else math.inf
        last = result.step >= self.total
        if not last and now - self._last < (0.1 if self.tty else self.every):
            return
        self._last = now
        eta = (self.total - result.step) / rate if rate > 0 else math.inf
        self._say(
            f"step {result.step}/{self.total}  loss {result.loss:.6g}  lr {result.lr:.3g}  "
            + (f"{self.skipped} skipped (overflow)  " if self.skipped else "")
            + f"{rate:.1f} step/s  ETA {_duration(eta)}",
            final=last,
        )

    def on_train_end(self, trainer: Trainer) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _say(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_loss_curve(log: str | Path, out: str | Path) -> Path:
    """A PNG of the training (and evaluation) loss of a CSV log, written atomically. Needs matplotlib
    (the ``plot`` extra)."""
    rows = read_log(log)
    training = [(int(r["step"]), float(r["loss"])) for r in rows]
    evaluated = [(int(r["step"]), float(r["eval_loss"])) for r in rows if r["eval_loss"]]
    return plot_losses(training, evaluated, out)


def plot_history(history: History, out: str | Path) -> Path:
    """A PNG of the training (and evaluation) loss a ``History`` kept (a run without a CSV log)."""
    return plot_losses([(r.step, r.loss) for r in history.steps], history.evaluations, out)


def plot_losses(training: list[tuple[int, float]], evaluated: list[tuple[int, float]], out: str | Path) -> Path:
    """A PNG of (step, loss) pairs, training and evaluation, written atomically. Needs matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    from gradgen.model_io import atomic_output

    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    axes.plot([s for s, _ in training], [v for _, v in training], label="training loss", linewidth=1)
    if evaluated:
        axes.plot([s for s, _ in evaluated], [v for _, v in evaluated], "o-", label="evaluation loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    with atomic_output(out) as tmp:
        tmp.write_bytes(buffer.getvalue())
    return Path(out)
