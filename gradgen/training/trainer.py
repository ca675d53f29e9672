"""Trainer: runs a TrainingProgram over batches, one training graph per optimizer step.

>>> program = build_training("model.onnx", optimizer=AdamW(), clip_norm=1.0)
>>> trainer = Trainer(program, lr=Schedule("cosine", lr=1e-3, warmup_steps=10, total_steps=100))
>>> history = trainer.fit(batches, steps=100)   # any iterable of {input name: numpy array}

A torch ``DataLoader`` whose batches are dicts of tensors works too (they are turned into numpy
arrays). Where parameters live between steps is the business of a ``StepRunner``: the
``HostStepRunner`` keeps them in host memory and feeds them to the executor's ``Session`` each
step (the CPU's runner); the ``DeviceStepRunner`` binds them as the training Session's state
(``TrainingProgram.state_bindings()``), so on the GPU they stay in device memory and each step
updates them there, with only the batch going up and the loss and gradient norm coming back
(the GPU's runner, ``default_runner``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
import warnings
from typing import Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from gradgen.errors import RunError
from gradgen.training.program import TrainingProgram
from gradgen.training.schedules import Schedule


class NonFiniteLossError(RunError):
    """The loss or the gradient norm of a step is NaN or infinite; the state is the last good one."""

    def __init__(self, step: int, what: str, value: float):
        self.step = step
        super().__init__(f"step {step}: the {what} is {value}; training stopped, the parameters are those after step {step - 1}")


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Host copy of everything a step updates: parameters (``params`` also holds the running
    statistics the program updates), optimizer states, steps taken."""

    params: Mapping[str, np.ndarray]
    states: Mapping[tuple[str, str], np.ndarray]  # (parameter, kind) -> value
    step: int


@dataclasses.dataclass(frozen=True)
class StepResult:
    step: int  # the 1-based optimizer step just taken
    loss: float  # mean over the step's micro-batches
    lr: float
    grad_norm: float  # global gradient norm before clipping
    seconds: float
    skipped: bool = False  # fp16 loss scaling found an Inf / NaN gradient: no update, the scale halved


class Callback:
    """Hooks called by ``Trainer.fit``; override those you need."""

    def on_train_begin(self, trainer: "Trainer") -> None: ...

    def on_step_end(self, trainer: "Trainer", result: StepResult) -> None: ...

    def on_evaluate(self, trainer: "Trainer", step: int, loss: float) -> None: ...

    def on_train_end(self, trainer: "Trainer") -> None: ...


class StepRunner(Protocol):
    """Runs a program's graphs and owns the parameters and optimizer states between steps.

    ``step`` must leave the state unchanged when the loss or gradient norm is not finite (the
    trainer then stops with the last good state). It returns (loss, gradient norm, skipped): whether
    loss scaling skipped the update (a runner that returns the first two is read as never skipping).
    """

    device: str  # where the steps run, as reports name it

    def load(self, state: TrainState) -> None: ...

    def snapshot(self) -> TrainState: ...

    def step(self, micro_batches: Sequence[Mapping[str, np.ndarray]], lr: float) -> tuple[float, float, bool]: ...

    def evaluate(self, batch: Mapping[str, np.ndarray]) -> float: ...


class HostStepRunner:
    """Parameters and states in host memory, fed to a ``Session`` each step; the updated values
    the graph returns replace them (one assignment, so an interrupt never leaves half a step)."""

    def __init__(self, program: TrainingProgram, device: str = "cpu"):
        from gradgen.executor import Session

        self.program = program
        self.train = Session(program.train, device=device)
        self.accumulate = Session(program.accumulate, device=device) if program.accumulate is not None else None
        self.evaluator = Session(program.evaluate, device=device)
        self.device = self.train.device
        self._state = TrainState(dict(program.initial_params), program.initial_states(), 0)
        # states the accumulation graph reads (loss scaling's scale: fixed over the micro-batches of a step)
        read = set(self.accumulate.input_names) if self.accumulate is not None else set()
        self._accumulate_states = [slot for slot in program.layout.states if slot.input in read]

    def load(self, state: TrainState) -> None:
        self._state = TrainState(dict(state.params), dict(state.states), state.step)

    def snapshot(self) -> TrainState:
        return self._state

    def step(self, micro_batches, lr: float) -> tuple[float, float, bool]:
        program, layout, state = self.program, self.program.layout, self._state
        step = state.step + 1
        losses = []
        accumulated = {p: np.zeros_like(state.params[p]) for p in program.accumulated} if self.accumulate else {}
        for k, batch in enumerate(micro_batches[:-1]):
            assert self.accumulate is not None  # train_step passes `accumulation` micro-batches: > 1 has the graph
            assert program.accumulate_restart is not None
            feeds = {**batch, **state.params, program.accumulate_restart: np.asarray(k == 0)}
            feeds.update({slot.input: state.states[(slot.param, slot.kind)] for slot in self._accumulate_states})
            feeds.update({program.accumulated[p][0]: value for p, value in accumulated.items()})
            out = self.accumulate.run(feeds)
            losses.append(float(out[program.loss]))
            accumulated = {p: out[program.accumulated[p][1]] for p in accumulated}
        feeds = {**micro_batches[-1], **state.params, layout.lr: np.asarray(lr, dtype=np.float32)}
        if layout.step is not None:
            feeds[layout.step] = np.asarray(step, dtype=np.int64)
        feeds.update({slot.input: state.states[(slot.param, slot.kind)] for slot in layout.states})
        feeds.update({layout.accumulated[p]: value for p, value in accumulated.items()})
        out = self.train.run(feeds)
        losses.append(float(out[program.loss]))
        loss, grad_norm = float(np.mean(losses)), float(out[layout.grad_norm])
        skipped = layout.found_inf is not None and bool(out[layout.found_inf])  # loss scaling's overflow: no update
        for what, value in (("loss", loss), ("gradient norm", grad_norm)):
            if not math.isfinite(value) and not (skipped and what == "gradient norm"):
                raise NonFiniteLossError(step, what, value)
        params = {p: out[name] for p, name in layout.params.items()}
        states = {(slot.param, slot.kind): out[slot.output] for slot in layout.states}
        self._state = TrainState(params, states, step)
        return loss, grad_norm, skipped

    def evaluate(self, batch) -> float:
        return float(self.evaluator.run({**batch, **self._state.params})[self.program.loss])


class DeviceStepRunner:
    """Parameters and optimizer states bound as the training Session's state: on the GPU they live
    in device memory between steps and each step's update is committed there (``Session(...,
    state=...)``), only when the loss and gradient norm are finite. That rule is the Session's
    ``state_guard``, so the GPU runs the update of every parameter as one fused multi-tensor step
    written in place (gradgen/executor/fused_optimizer.py). With loss scaling the guard is the loss
    alone: a step whose gradient norm is not finite is an overflow, whose update the graph (and the
    fused kernel, reading its flag) skips while the scaler's state is committed.

    With gradient accumulation the micro-batches before the last run the accumulation graph in a
    second Session, whose bound state is the accumulated gradients (summed in place on the device;
    its first micro-batch restarts the sum): it reads the parameters (and the loss scale) from the
    training Session's state and the training Session reads the sums from its state
    (``Session.read_state_from``), so nothing but the batches goes up.
    ``snapshot`` downloads the state (once per step, when something reads it: checkpoints,
    evaluation)."""

    def __init__(self, program: TrainingProgram, device: str = "cuda"):
        from gradgen.executor import Session

        self.program = program
        layout = program.layout
        guard = [program.loss, layout.grad_norm] if layout.found_inf is None else [program.loss]
        self.train = Session(program.train, device=device, state=program.state_bindings(), state_guard=guard)
        self.accumulate = None
        if program.accumulate is not None:
            self.accumulate = Session(program.accumulate, device=device, state=dict(program.accumulated.values()))
            bound = program.state_bindings()
            read = {name: name for name in self.accumulate.input_names if name in bound}  # parameters, loss scale
            self.accumulate.read_state_from(self.train, read)
            self.train.read_state_from(
                self.accumulate, {layout.accumulated[p]: program.accumulated[p][0] for p in program.accumulated}
            )
        self.evaluator = Session(program.evaluate, device=device)
        self.device = self.train.device
        self._outputs = [program.loss, layout.grad_norm] + ([layout.found_inf] if layout.found_inf is not None else [])
        self._step = 0
        self._snapshot: TrainState | None = None
        self.load(TrainState(program.initial_params, program.initial_states(), 0))

    def load(self, state: TrainState) -> None:
        values = {name: state.params[name] for name in self.program.layout.params}
        values.update({slot.input: state.states[(slot.param, slot.kind)] for slot in self.program.layout.states})
        self.train.write_state(values)
        if self.accumulate is not None:  # once: each step's first micro-batch restarts the sums
            self.accumulate.write_state({acc: np.zeros_like(state.params[p]) for p, (acc, _) in self.program.accumulated.items()})
        self._step, self._snapshot = state.step, None

    def snapshot(self) -> TrainState:
        if self._snapshot is None or self._snapshot.step != self._step:
            layout, download = self.program.layout, _StateDownload(self.train)
            params = _LazyMapping(download, {name: name for name in layout.params})
            states = _LazyMapping(download, {(slot.param, slot.kind): slot.input for slot in layout.states})
            self._snapshot = TrainState(params, states, self._step)
        return self._snapshot

    def step(self, micro_batches, lr: float) -> tuple[float, float, bool]:
        program, layout = self.program, self.program.layout
        step = self._step + 1
        feeds = {**micro_batches[-1], layout.lr: np.asarray(lr, dtype=np.float32)}
        if layout.step is not None:
            feeds[layout.step] = np.asarray(step, dtype=np.int64)
        losses = []
        for k, batch in enumerate(micro_batches[:-1]):
            assert self.accumulate is not None and program.accumulate_restart is not None  # accumulation > 1
            restart = {program.accumulate_restart: np.asarray(k == 0)}
            losses.append(float(self.accumulate.run({**batch, **restart}, outputs=[program.loss])[program.loss]))
            if not math.isfinite(losses[-1]):  # before the update: the state stays as it was
                raise NonFiniteLossError(step, "loss", float(np.mean(losses)))
        out = self.train.run(feeds, outputs=self._outputs)  # committed by the state guard's rule
        losses.append(float(out[program.loss]))
        skipped = layout.found_inf is not None and bool(out[layout.found_inf])  # then the norm is not finite
        loss = float(np.mean(losses))
        checks = [("loss", loss)]
        if not skipped:
            checks.append(("gradient norm", float(out[layout.grad_norm])))
        for what, value in checks:
            if not math.isfinite(value):
                raise NonFiniteLossError(step, what, value)
        self._step = step
        return loss, float(out[layout.grad_norm]), skipped

    def evaluate(self, batch) -> float:
        return float(self.evaluator.run({**batch, **self.snapshot().params})[self.program.loss])


class _StateDownload:
    """The bound state of a Session, downloaded the first time a snapshot's value is read."""

    def __init__(self, session):
        self.session = session
        self.values: dict[str, np.ndarray] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        if self.values is None:
            self.values = self.session.read_state()
        return self.values[name]


class _LazyMapping(Mapping):
    """key -> a state input's value, read through a shared ``_StateDownload``."""

    def __init__(self, download: _StateDownload, names: dict):
        self._download, self._names = download, names

    def __getitem__(self, key):
        return self._download[self._names[key]]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def default_runner(program: TrainingProgram, device: str) -> StepRunner:
    """On the GPU the device runner (state stays in device memory); on the CPU the host runner."""
    from gradgen.executor.session import resolve_device

    device = resolve_device(device)
    if device == "cuda":
        return DeviceStepRunner(program, device)
    return HostStepRunner(program, device)


class Trainer:
    """Trains a ``TrainingProgram``: ``lr`` is a float or a ``Schedule`` of the 1-based step."""

    def __init__(
        self,
        program: TrainingProgram,
        *,
        lr: float | Schedule,
        device: str = "cpu",
        callbacks: Sequence[Callback] = (),
        runner: StepRunner | None = None,
    ):
        self.program = program
        self.schedule = lr if isinstance(lr, Schedule) else Schedule("constant", lr=float(lr))
        self.callbacks = list(callbacks)
        self.runner = runner if runner is not None else default_runner(program, device)
        self._data_names = program.data_names

    # -- state -------------------------------------------------------------------------
    @property
    def state(self) -> TrainState:
        return self.runner.snapshot()

    @property
    def step(self) -> int:
        return self.runner.snapshot().step

    @property
    def params(self) -> Mapping[str, np.ndarray]:
        return self.runner.snapshot().params

    def load_state(self, state: TrainState) -> None:
        """Continue from ``state`` (a checkpoint's); its parameters and states must fit the program."""
        state = with_running_statistics(self.program, state)
        check_state(self.program, state)
        self.runner.load(state)

    # -- training ------------------------------------------------------------------------
    def train_step(self, micro_batches: Sequence[Mapping]) -> StepResult:
        """One optimizer step over ``accumulation`` micro-batches."""
        if len(micro_batches) != self.program.accumulation:
            raise RunError(f"a step takes {self.program.accumulation} micro-batch(es), got {len(micro_batches)}")
        batches = [self._checked(b) for b in micro_batches]
        started = time.perf_counter()
        lr = self.schedule(self.step + 1)
        # with loss scaling an Inf / NaN gradient is expected now and then, and handled (the step is
        # skipped and reported): numpy's floating-point warnings about it would only alarm
        quiet = np.errstate(all="ignore") if self.program.loss_scaling is not None else contextlib.nullcontext()
        with quiet:
            loss, grad_norm, *skipped = self.runner.step(batches, lr)
        return StepResult(self.step, loss, lr, grad_norm, time.perf_counter() - started, bool(skipped and skipped[0]))

    def fit(
        self,
        batches: Iterable[Mapping],
        steps: int,
        *,
        eval_batches: Sequence[Mapping] | None = None,
        eval_every: int | None = None,
    ) -> list[StepResult]:
        """Take ``steps`` optimizer steps (fewer if ``batches`` runs out); evaluate on ``eval_batches``
        every ``eval_every`` steps and at the end. Returns the results of the steps taken."""
        results = []
        source = iter(batches)
        for callback in self.callbacks:
            callback.on_train_begin(self)
        for _ in range(steps):
            micro = _take(source, self.program.accumulation)
            if micro is None:
                break
            with _interrupt_at_step_end():
                result = self.train_step(micro)
                results.append(result)
                for callback in self.callbacks:
                    callback.on_step_end(self, result)
            if eval_batches is not None and eval_every and result.step % eval_every == 0:
                self._evaluate_and_report(eval_batches)
        if eval_batches is not None and results and not (eval_every and results[-1].step % eval_every == 0):
            self._evaluate_and_report(eval_batches)
        for callback in self.callbacks:
            callback.on_train_end(self)
        return results

    def evaluate(self, batches: Iterable[Mapping]) -> float:
        """Mean loss over ``batches`` with the current parameters."""
        losses = [self.runner.evaluate(self._checked(b)) for b in batches]
        if not losses:
            raise RunError("no evaluation batch")
        return float(np.mean(losses))

    def _evaluate_and_report(self, batches) -> None:
        loss = self.evaluate(batches)
        for callback in self.callbacks:
            callback.on_evaluate(self, self.step, loss)

    def _checked(self, batch: Mapping) -> dict[str, np.ndarray]:
        """The batch as numpy arrays; its names must be exactly the program's data inputs."""
        names = set(batch)
        wanted = set(self._data_names)
        if names != wanted:
            problems = []
            if wanted - names:
                problems.append(f"missing {', '.join(repr(n) for n in self._data_names if n not in names)}")
            if names - wanted:
                problems.append(f"unknown {', '.join(repr(n) for n in sorted(names - wanted))}")
            raise RunError(
                f"batch arrays: {'; '.join(problems)}; the model's data inputs are {', '.join(map(repr, self._data_names))}"
            )
        return {name: _as_numpy(value) for name, value in batch.items()}


def with_running_statistics(program: TrainingProgram, state: TrainState) -> TrainState:
    """``state`` with the running statistics the program updates that it lacks (a checkpoint written
    before they were step state) at the model's values, with a warning."""
    missing = [name for name in program.running_statistics_updated if name not in state.params]
    if not missing:
        return state
    warnings.warn(
        f"the state holds no value for {len(missing)} BatchNormalization running statistic(s) "
        f"({', '.join(map(repr, missing[:2]))}{', ...' if len(missing) > 2 else ''}): they start from the model's values",
        stacklevel=3,
    )
    params = {**state.params, **{name: program.initial_params[name] for name in missing}}
    return dataclasses.replace(state, params=params)


def check_state(program: TrainingProgram, state: TrainState) -> None:
    """The state holds every parameter and optimizer state of the program, with their shapes and dtypes."""
    problems = []
    expected = program.initial_params
    optional = set(program.running_statistics_updated)  # a checkpoint from before they were state
    for name, initial in expected.items():
        value = state.params.get(name)
        if value is None and name in optional:
            continue  # load_state starts them from the model's values
        if value is None:
            problems.append(f"no parameter {name!r}")
        elif value.shape != initial.shape or value.dtype != initial.dtype:
            problems.append(
                f"parameter {name!r} is {value.dtype}{list(value.shape)}, the model's is {initial.dtype}{list(initial.shape)}"
            )
    extra = sorted(set(state.params) - set(expected))
    if extra:
        problems.append(
            f"parameters the model does not train: {', '.join(map(repr, extra))} (a run that trained an exporter's "
            "constant, before training left those out: --train NAME)"
        )
    for key, initial in program.initial_states().items():
        value = state.states.get(key)
        if value is None or value.shape != initial.shape or value.dtype != initial.dtype:
            problems.append(f"no {key[1]} state of shape {list(initial.shape)} for {key[0]!r}")
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise RunError(f"the state does not fit this model and optimizer: {shown}")


@contextlib.contextmanager
def _interrupt_at_step_end():
    """Ctrl-C during a step takes effect once the step and its callbacks are done, so that the state,
    the log and a checkpoint saved on the interrupt agree; a second Ctrl-C interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def defer(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    try:
        previous = signal.signal(signal.SIGINT, defer)
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _take(source: Iterator, n: int) -> list | None:
    taken = []
    for _ in range(n):
        try:
            taken.append(next(source))
        except StopIteration:
            return None
    return taken


def _as_numpy(value) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return np.asarray(value)
