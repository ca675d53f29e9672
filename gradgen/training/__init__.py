"""Training on gradgen's executor: loss blocks, optimizers as ONNX graphs, a Trainer, checkpoints.

- ``losses``: ``AddLossPass`` / ``LossSpec`` append a loss to a model ending in logits or predictions.
- ``optimizers``: ``SGD``, ``AdamW`` and ``OptimizerPass``, which turns a backward model into one
  training step (accumulation, global-norm clipping, the update) in standard ONNX ops.
- ``program``: ``build_training`` makes the training, accumulation and evaluation graphs of a model.
- ``schedules``: learning-rate schedules computed on the host.
- ``trainer``: ``Trainer`` (any iterable of dict-of-numpy batches), ``Callback``, the step runner.
- ``data``, ``checkpoint``, ``callbacks``, ``export``: data order, checkpoints, logging, export.
"""

import importlib

# Public name -> its module; imported on first use, so that the CLI (which imports
# gradgen.training.cli) starts without numpy or onnx.
_HOMES = {
    "CsvLog": "callbacks",
    "History": "callbacks",
    "Progress": "callbacks",
    "plot_loss_curve": "callbacks",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "ArrayDataset": "data",
    "Dataset": "data",
    "ShuffledBatches": "data",
    "check_arrays": "data",
    "load_arrays": "data",
    "open_data": "data",
    "sequential_batches": "data",
    "NpzShards": "shards",
    "export_trained": "export",
    "LOSS_KINDS": "losses",
    "AddLossPass": "losses",
    "LossSpec": "losses",
    "SGD": "optimizers",
    "AccumulateGradientsPass": "optimizers",
    "AdamW": "optimizers",
    "OptimizerPass": "optimizers",
    "TrainingProgram": "program",
    "build_training": "program",
    "Schedule": "schedules",
    "Callback": "trainer",
    "DeviceStepRunner": "trainer",
    "HostStepRunner": "trainer",
    "NonFiniteLossError": "trainer",
    "StepResult": "trainer",
    "TrainState": "trainer",
    "Trainer": "trainer",
}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"gradgen.training.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'gradgen.training' has no attribute {name!r}")


__all__ = [
    "LOSS_KINDS",
    "SGD",
    "AccumulateGradientsPass",
    "AdamW",
    "AddLossPass",
    "ArrayDataset",
    "Callback",
    "CsvLog",
    "Dataset",
    "DeviceStepRunner",
    "History",
    "HostStepRunner",
    "LossSpec",
    "NonFiniteLossError",
    "NpzShards",
    "OptimizerPass",
    "Progress",
    "Schedule",
    "ShuffledBatches",
    "StepResult",
    "TrainState",
    "Trainer",
    "TrainingProgram",
    "build_training",
    "check_arrays",
    "export_trained",
    "load_arrays",
    "load_checkpoint",
    "open_data",
    "plot_loss_curve",
    "save_checkpoint",
    "sequential_batches",
]
