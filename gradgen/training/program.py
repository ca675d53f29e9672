"""A training program: the graphs one optimizer step runs, built from a forward model.

``build_training(model, optimizer=...)`` returns a ``TrainingProgram`` holding

- ``train``: forward + backward + update (``OptimizerPass``), run once per optimizer step;
- ``accumulate``: forward + backward + gradient accumulation, run for the micro-batches before the
  last one of a step when ``accumulation`` > 1 (else None);
- ``evaluate``: forward + loss, for evaluation data;
- the trainable parameters (graph inputs of all three) and their initial values, the names the
  update reads and writes (``layout``), and a fingerprint of the forward model.

The trainable parameters are the float initializers the loss depends on through differentiable
paths, less ``freeze`` and less the running statistics of BatchNormalization nodes (buffers, not
parameters: an exported eval-mode BatchNorm keeps them fixed while its scale and bias train).
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from typing import Sequence

import numpy as np
import onnx_ir as ir

from gradgen.api import backward_pipeline, run_pipeline
from gradgen.errors import UsageError
from gradgen.model_io import ModelLike, load_model
from gradgen.names import value_name, value_names
from gradgen.passes import CleanupPass, GradientSpec, LowerToStandardPass, Pipeline, UpgradeOpsetPass
from gradgen.passes.autocast import AutocastPass, check_precision
from gradgen.training.graph_edit import ParamsAsInputsPass, keep_outputs, remove_unused_inputs
from gradgen.training.loss_scaling import LOSS_SCALING, LossScaling, ScaleGradientsPass, SkipOverflowPass
from gradgen.training.losses import AddLossPass, LossSpec
from gradgen.training.optimizers import AccumulateGradientsPass, Optimizer, OptimizerPass, UpdateLayout


@dataclasses.dataclass
class TrainingProgram:
    source: ir.Model
    train: ir.Model
    accumulate: ir.Model | None
    evaluate: ir.Model
    loss: str
    added_loss: LossSpec | None
    params: list[str]
    frozen: list[str]
    initial_params: dict[str, np.ndarray]
    layout: UpdateLayout
    accumulated: dict[str, tuple[str, str]]  # accumulate graph: parameter -> (input, output)
    data_inputs: list[ir.Value]
    optimizer: Optimizer
    clip_norm: float | None
    accumulation: int
    fingerprint: str
    precision: str = "fp32"
    loss_scaling: LossScaling | None = None
    accumulate_restart: str | None = None  # accumulate graph: the bool input that starts a step's sum

    def initial_states(self) -> dict[tuple[str, str], np.ndarray]:
        """Every optimizer state at the start, zeros, by (parameter, kind); the loss scaler's."""
        states = {
            (slot.param, slot.kind): np.zeros_like(self.initial_params[slot.param])
            for slot in self.layout.states
            if slot.param in self.initial_params
        }
        if self.loss_scaling is not None:
            states.update(self.loss_scaling.initial_states(counts_updates=self.optimizer.uses_step))
        return states

    @property
    def data_names(self) -> list[str]:
        return value_names(self.data_inputs)

    def state_bindings(self) -> dict[str, str]:
        """Each input of ``train`` that carries state between steps -> the output holding its next value
        (parameters and optimizer states): what a persistent, in-place device binding pairs up."""
        bindings = dict(self.layout.params)
        bindings.update({slot.input: slot.output for slot in self.layout.states})
        return bindings


def build_training(
    model: ModelLike,
    *,
    optimizer: Optimizer,
    loss: str | None = None,
    add_loss: LossSpec | None = None,
    freeze: Sequence[str] = (),
    clip_norm: float | None = None,
    accumulation: int = 1,
    precision: str = "fp32",
    loss_scaling: LossScaling | None = None,
    portable: bool = False,
) -> TrainingProgram:
    """Build the training graphs of ``model`` (not modified). ``loss`` names the loss output (default:
    the only scalar float output); ``add_loss`` appends one instead (``loss`` must then be None).

    ``precision`` (fp32, tf32, bf16, fp16) runs ``AutocastPass`` on the training and evaluation
    graphs; fp16 steps use dynamic loss scaling (``loss_scaling``, default ``LossScaling()``).
    ``portable=True`` lowers the com.microsoft gradient ops the backward graph holds to standard ONNX
    ops (``LowerToStandardPass``), so that any ONNX runtime runs the training step."""
    if add_loss is not None and loss is not None:
        raise UsageError("name either the model's loss output or a loss to add, not both")
    check_precision(precision)
    if precision == "fp16" and loss_scaling is None:
        loss_scaling = LossScaling()
    source = _copy(model) if isinstance(model, ir.Model) else load_model(model)
    fingerprint = model_fingerprint(source)

    forward = _copy(source)
    prepare: list[ir.passes.PassBase] = [UpgradeOpsetPass()]
    adder = AddLossPass(add_loss) if add_loss is not None else None
    if adder is not None:
        prepare.append(adder)
    run_pipeline(Pipeline(*prepare), forward)
    loss = adder.loss_name if adder is not None else loss

    frozen = list(dict.fromkeys([*freeze, *running_statistics(forward.graph)]))
    _note_training_batch_norms(forward.graph)
    backward = _copy(forward)
    pipeline, gradient = backward_pipeline(GradientSpec(loss=loss, freeze=frozen), precision)
    run_pipeline(pipeline, backward)
    if portable:
        run_pipeline(Pipeline(LowerToStandardPass(), CleanupPass()), backward)
    assert gradient.loss_name is not None  # the gradient pass sets it when it runs
    loss, params = gradient.loss_name, gradient.wrt_names

    as_inputs = ParamsAsInputsPass(params)
    run_pipeline(as_inputs, backward)

    accumulate, accumulated, accumulate_restart = None, {}, None
    if accumulation > 1:  # with loss scaling: each micro-batch's gradients unscaled by the step's scale, then summed
        accumulate = _copy(backward)
        accumulator = AccumulateGradientsPass(params, loss)
        passes = [ScaleGradientsPass(params, loss)] if loss_scaling is not None else []
        run_pipeline(Pipeline(*passes, accumulator, CleanupPass()), accumulate)
        remove_unused_inputs(accumulate.graph, keep=set(params))
        accumulated = accumulator.accumulated
        accumulate_restart = accumulator.restart

    update = OptimizerPass(optimizer, params, loss, clip_norm=clip_norm, accumulation=accumulation)
    if loss_scaling is None:
        run_pipeline(Pipeline(update, CleanupPass()), backward)
    else:
        scale = ScaleGradientsPass(params, loss)
        run_pipeline(Pipeline(scale, update), backward)
        assert scale.scale is not None and update.layout is not None  # set by the passes
        run_pipeline(Pipeline(SkipOverflowPass(loss_scaling, scale.scale, update.layout), CleanupPass()), backward)
    remove_unused_inputs(backward.graph, keep=set(params))

    evaluate = _evaluation_model(forward, params, loss)
    if precision != "fp32":
        run_pipeline(AutocastPass(precision), evaluate)
    layout = update.layout
    assert layout is not None  # the optimizer pass sets it when it runs
    reserved = set(params) | {layout.lr, layout.step} | {s.input for s in layout.states}
    reserved |= {name for name in value_names(backward.graph.inputs) if name.startswith(f"{LOSS_SCALING}.")}
    reserved |= set(layout.accumulated.values())
    data_inputs = [v for v in backward.graph.inputs if v.name not in reserved]
    return TrainingProgram(
        source=source,
        train=backward,
        accumulate=accumulate,
        evaluate=evaluate,
        loss=loss,
        added_loss=add_loss,
        params=params,
        frozen=frozen,
        initial_params=as_inputs.initial_values,
        layout=layout,
        accumulated=accumulated,
        data_inputs=data_inputs,
        optimizer=optimizer,
        clip_norm=clip_norm,
        accumulation=accumulation,
        fingerprint=fingerprint,
        precision=precision,
        loss_scaling=loss_scaling,
        accumulate_restart=accumulate_restart,
    )


def _evaluation_model(forward: ir.Model, params: list[str], loss: str) -> ir.Model:
    """The forward model (with its loss) whose parameters are inputs; its only output is the loss."""
    model = _copy(forward)
    graph = model.graph
    keep_outputs(graph, [v for v in graph.outputs if v.name == loss])
    run_pipeline(Pipeline(ParamsAsInputsPass(params), CleanupPass()), model)
    remove_unused_inputs(graph, keep=set(params))
    return model


def running_statistics(graph: ir.Graph) -> list[str]:
    """Initializers that BatchNormalization nodes read as running mean / variance (inputs 3, 4)."""
    names: list[str] = []
    for node in graph:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            for value in node.inputs[3:5]:
                if value is not None and value.name in graph.initializers:
                    names.append(value_name(value))
    return names


def _note_training_batch_norms(graph: ir.Graph) -> None:
    """Warn (the CLI says it as a note) where BatchNormalization runs in training mode: the steps use
    the batch statistics, as PyTorch's do, but do not update the running statistics, which PyTorch's
    would; an evaluation or export in inference mode reads them as exported."""
    from gradgen.grads.rules.norm import batch_norm_in_training

    count = sum(
        1
        for node in graph
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and batch_norm_in_training(node)
    )
    if count:
        warnings.warn(
            f"{count} BatchNormalization node(s) run in training mode (batch statistics); training does not update "
            "their running statistics, which stay as exported (an inference-mode evaluation or export reads them)",
            stacklevel=3,
        )


def model_fingerprint(model: ir.Model) -> str:
    """A hash of the model's structure and its initializers' names, types and shapes (not values):
    it tells whether a checkpoint's parameters belong to this model."""
    digest = hashlib.sha256()
    graph = model.graph
    for value in graph.inputs:
        digest.update(f"in {value.name} {value.dtype}\n".encode())
    for name, value in sorted(graph.initializers.items()):
        tensor = value.const_value
        shape = tuple(tensor.shape) if tensor is not None else tuple(value.shape or ())
        digest.update(f"init {name} {value.dtype} {shape}\n".encode())
    for node in graph:
        inputs = ",".join((v.name or "") if v is not None else "" for v in node.inputs)
        outputs = ",".join(v.name or "" for v in node.outputs)
        digest.update(f"node {node.domain}::{node.op_type} {inputs} -> {outputs}\n".encode())
    for value in graph.outputs:
        digest.update(f"out {value.name}\n".encode())
    return digest.hexdigest()[:16]


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))
