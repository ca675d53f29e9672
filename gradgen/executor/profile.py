"""Where a CPU run's time goes: every step of a Session timed over a few runs, summed by op type.

The CPU executor runs one step at a time, so the wall time between the end of one step and the end
of the next is that step's time (its kernel and the executor's few microseconds around it). The
Session's step observer reports each step's end; a run with it goes through the program's general
runner, so the times include a little more Python than an unobserved run; the first step's time
also holds the run's own setup (checking and placing the feeds).
On a GPU, kernels run asynchronously and the step would have to wait for the device after every
step; ``gradgen bench --only e2e --profile`` times the kernels there instead.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict

from gradgen.errors import UsageError


@dataclasses.dataclass(frozen=True)
class StepTime:
    """One step of the plan: its node, op and median time (seconds) over the timed runs."""

    node_name: str
    op_type: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Profile:
    """The steps of one Session, in plan order, and the median wall time of an unobserved run."""

    steps: list[StepTime]
    run_seconds: float
    runs: int

    def by_op(self) -> list[tuple[str, int, float]]:
        """(op type, steps, seconds) for each op type, the most expensive first."""
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for step in self.steps:
            totals[step.op_type] += step.seconds
            counts[step.op_type] += 1
        return sorted(((op, counts[op], s) for op, s in totals.items()), key=lambda row: -row[2])

    def slowest(self, n: int) -> list[StepTime]:
        return sorted(self.steps, key=lambda step: -step.seconds)[:n]


def require_cpu(session) -> None:
    """UsageError unless ``session`` runs on the CPU (what profiling times)."""
    if session.device != "cpu":
        raise UsageError(
            f"profiling times the CPU executor's steps; this model runs on {session.device} "
            "(use --device cpu, or on a GPU `gradgen bench --only e2e --profile`, which times the kernels)"
        )


def profile_run(session, feeds: dict, runs: int = 3) -> Profile:
    """Time every step of ``session`` (a CPU Session) on ``feeds``: one run to warm up, then
    ``runs`` observed runs (each step's median) and as many plain ones (the run's median)."""
    require_cpu(session)
    if runs < 1:
        raise UsageError(f"runs must be at least 1, got {runs}")
    if session.updates_in_place:
        raise UsageError("this Session updates its state in place at every run; profiling would take several steps")
    # bound state (a training step's parameters) stays as it was: no run of the profile commits it
    keep_state = (lambda _results: False) if session.state_bindings else None

    def run_once() -> None:
        session.run(feeds, commit=keep_state)

    run_once()
    plain = []
    for _ in range(runs):
        started = time.perf_counter()
        run_once()
        plain.append(time.perf_counter() - started)
    samples: list[list[float]] = [[] for _ in session.steps]
    position = {id(step): k for k, step in enumerate(session.steps)}
    last = [0.0]

    def observe(step, args, result) -> None:
        now = time.perf_counter()
        samples[position[id(step)]].append(now - last[0])
        last[0] = now

    previous = session.step_observer
    session.step_observer = observe
    try:
        for _ in range(runs):
            last[0] = time.perf_counter()
            run_once()
    finally:
        session.step_observer = previous
    steps = [
        StepTime(step.node_name, step.op_type, statistics.median(times))
        for step, times in zip(session.steps, samples)
        if times  # a step folded at plan time does not run
    ]
    return Profile(steps, statistics.median(plain), runs)


def format_profile(profile: Profile, top: int = 10) -> str:
    """The table ``gradgen run --profile`` prints: time by op type, then the slowest steps."""
    from gradgen.kernels.cpu import blas

    total = sum(step.seconds for step in profile.steps) or 1.0
    lines = [
        f"time by op (median of {profile.runs} observed run(s) after a warm-up; a plain run takes "
        f"{profile.run_seconds * 1e3:.3f} ms; float32 products: {blas.describe()}):",
        f"  {'op':<32} {'steps':>6} {'ms':>10} {'share':>7}",
    ]
    for op, count, seconds in profile.by_op():
        lines.append(f"  {op:<32} {count:>6} {seconds * 1e3:>10.3f} {100 * seconds / total:>6.1f}%")
    lines.append(f"slowest {min(top, len(profile.steps))} step(s):")
    for step in profile.slowest(top):
        lines.append(f"  {step.seconds * 1e3:>10.3f} ms  {step.op_type:<24} {step.node_name}")
    return "\n".join(lines)
