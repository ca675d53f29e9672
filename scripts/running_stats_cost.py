"""What updating BatchNormalization's running statistics costs a training step: ResNet-18 exported
in training mode (B=32, 224 x 224), one AdamW step on the device runner, built as `gradgen train`
builds it and built with the update switched off (the running statistics frozen, as before
2026-12-07), the two runners alternating in one process. Prints the median step of each."""

from __future__ import annotations

import argparse
import statistics
import time

from gradgen.bench import models
from gradgen.training import AdamW, DeviceStepRunner, Trainer, build_training
from gradgen.training import program as program_module


def build(proto, update: bool):
    if update:
        return build_training(proto, optimizer=AdamW(weight_decay=0.01))
    original = program_module.updatable_running_statistics
    program_module.updatable_running_statistics = lambda graph: {}
    try:
        return build_training(proto, optimizer=AdamW(weight_decay=0.01))
    finally:
        program_module.updatable_running_statistics = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="default 32")
    parser.add_argument("--size", type=int, default=None, help="image side, default 224")
    args = parser.parse_args()
    spec = models.preset("resnet18", batch=args.batch, size=args.size, batch_stats=True)
    proto = models.export(models.build_module(spec), models.make_inputs(spec))
    batch = models.make_inputs(spec)
    trainers = {}
    for update in (True, False):
        program = build(proto, update)
        trainers[update] = Trainer(program, lr=1e-4, runner=DeviceStepRunner(program, args.device))
        for _ in range(3):
            trainers[update].train_step([batch])
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for update, trainer in trainers.items():
            for _ in range(args.steps):
                started = time.perf_counter()
                trainer.train_step([batch])
                times[update].append(time.perf_counter() - started)
    for update in (True, False):
        label = "running statistics updated" if update else "running statistics frozen"
        print(f"{label}: median step {statistics.median(times[update]) * 1e3:.2f} ms over {len(times[update])} steps")


if __name__ == "__main__":
    main()
