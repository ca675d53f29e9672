"""Where a device training step's host time goes after the GPU work: ResNet-18 in training mode
(B=32), AdamW on the device runner; the step's wall time and the time spent in the Session's
post-run bookkeeping (the guard check, the next-state checks, the commit's copy list), per step."""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from gradgen.bench import models
from gradgen.executor import session as session_module
from gradgen.training import AdamW, DeviceStepRunner, Trainer, build_training

SPENT: dict[str, list[float]] = collections.defaultdict(list)


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label].append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", type=int, default=None)
    args = parser.parse_args()
    spec = models.preset("resnet18", batch=args.batch, size=args.size, batch_stats=True)
    proto = models.export(models.build_module(spec), models.make_inputs(spec))
    batch = models.make_inputs(spec)
    program = build_training(proto, optimizer=AdamW(weight_decay=0.01))
    trainer = Trainer(program, lr=1e-4, runner=DeviceStepRunner(program, args.device))
    for _ in range(5):
        trainer.train_step([batch])
    backend = trainer.runner.train.backend
    timed(session_module.Session, "_guard_passed", "guard check")
    timed(session_module.Session, "_next_state", "next-state checks")
    timed(type(backend), "commit_state", "commit")
    timed(type(backend), "execute", "execute (replay)")
    walls = []
    for _ in range(args.steps):
        started = time.perf_counter()
        trainer.train_step([batch])
        walls.append(time.perf_counter() - started)
    print(f"{len(program.state_bindings())} bound values; median step {statistics.median(walls) * 1e3:.3f} ms")
    for label, values in SPENT.items():
        print(f"  {label}: median {statistics.median(values) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
