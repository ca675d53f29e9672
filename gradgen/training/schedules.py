"""Learning-rate schedules, computed on the host and fed to the training graph's ``lr`` input.

``Schedule(kind, lr, warmup_steps, total_steps, min_lr)(step)`` is the rate of the 1-based
optimizer step ``step``:

- warm-up (``warmup_steps`` > 0): ``lr * step / warmup_steps`` for ``step <= warmup_steps``;
- then ``constant``: ``lr``; ``linear``: from ``lr`` down to ``min_lr`` at ``total_steps``;
  ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``, with ``progress`` the
  fraction of the steps after warm-up done, reaching ``min_lr`` at ``total_steps``. Past
  ``total_steps`` the rate stays at ``min_lr``.
"""

from __future__ import annotations

import dataclasses
import math

from gradgen.errors import UsageError

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    lr: float = 1e-3
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise UsageError(f"unknown schedule {self.kind!r}: choose one of {', '.join(SCHEDULES)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UsageError(f"learning rate {self.lr} is not a finite number > 0")
        if not (math.isfinite(self.min_lr) and 0 <= self.min_lr <= self.lr):
            raise UsageError(f"minimum learning rate {self.min_lr} is not in [0, lr={self.lr}]")
        if self.warmup_steps < 0:
            raise UsageError(f"warm-up steps {self.warmup_steps} is negative")
        if self.kind != "constant":
            if self.total_steps is None or self.total_steps <= self.warmup_steps:
                raise UsageError(
                    f"a {self.kind} decay needs total steps ({self.total_steps}) greater than the "
                    f"warm-up steps ({self.warmup_steps})"
                )

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        if step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        assert self.total_steps is not None  # a decay's total steps are checked at construction
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.kind == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.lr - self.min_lr) * factor
