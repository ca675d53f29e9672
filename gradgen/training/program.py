"""A training program: the graphs one optimizer step runs, built from a forward model.

``build_training(model, optimizer=...)`` returns a ``TrainingProgram`` holding

- ``train``: forward + backward + update (``OptimizerPass``), run once per optimizer step;
- ``accumulate``: forward + backward + gradient accumulation, run for the micro-batches before the
  last one of a step when ``accumulation`` > 1 (else None);
- ``evaluate``: forward + loss, for evaluation data;
- the trainable parameters (graph inputs of all three) and their initial values, the names the
  update reads and writes (``layout``), and a fingerprint of the forward model.

The trainable parameters are the float initializers the loss depends on through differentiable
paths, less ``freeze``, less the running statistics of BatchNormalization nodes (buffers, not
parameters: an exported eval-mode BatchNorm keeps them fixed while its scale and bias train) and,
in a torch.export model, less what the exporter says or shows is not a parameter (buffers, masks
and tables its optimizer folded: ``exporter_constants``).

A BatchNormalization exported in training mode normalises with the batch's statistics, and each
training step updates its running statistics as ONNX defines it (``running = momentum * running +
(1 - momentum) * batch``, the batch variance biased; PyTorch's update uses the unbiased one, which
differs by a factor n / (n - 1) on the batch's share). They are step state like the parameters
(``running_statistics_updated``: graph inputs of every graph, fed and read back with the parameters,
saved in checkpoints, written by export) but get no gradient; the evaluation graph normalises with
them (inference mode, as PyTorch's ``eval()``; Dropout off too). With gradient accumulation they are
updated from the last micro-batch of each step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from typing import Sequence

import numpy as np
import onnx_ir as ir

from gradgen.api import backward_pipeline, run_pipeline
from gradgen.builder import GraphBuilder
from gradgen.errors import ModelError, UsageError
from gradgen.model_io import ModelLike, default_opset, load_model
from gradgen.names import value_name, value_names
from gradgen.passes import CleanupPass, GradientSpec, LowerToStandardPass, Pipeline, UpgradeOpsetPass
from gradgen.passes.autocast import AutocastPass, check_precision
from gradgen.passes.ties import TieEqualWeightsPass
from gradgen.training.exporter_constants import describe as describe_constants
from gradgen.training.exporter_constants import describe_unmarked, exporter_constants, unmarked_initializers
from gradgen.training.graph_edit import ParamsAsInputsPass, keep_outputs, remove_unused_inputs, to_inference_mode
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
    # BatchNormalization running statistics each step updates (in initial_params and layout.params
    # with the parameters, but not trained: no gradient, no optimizer state)
    running_statistics_updated: list[str] = dataclasses.field(default_factory=list)
    # (parameter, its transposed copy in the source model) pairs tied into one parameter (tie_weights)
    tied: list[tuple[str, str]] = dataclasses.field(default_factory=list)

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
        (parameters, BatchNormalization running statistics and optimizer states): what a persistent,
        in-place device binding pairs up."""
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
    also_train: Sequence[str] = (),
    tie_weights: bool = False,
) -> TrainingProgram:
    """Build the training graphs of ``model`` (not modified). ``loss`` names the loss output (default:
    the only scalar float output); ``add_loss`` appends one instead (``loss`` must then be None).

    ``precision`` (fp32, tf32, bf16, fp16) runs ``AutocastPass`` on the training and evaluation
    graphs; fp16 steps use dynamic loss scaling (``loss_scaling``, default ``LossScaling()``).
    ``portable=True`` lowers the com.microsoft gradient ops the backward graph holds to standard ONNX
    ops (``LowerToStandardPass``), so that any ONNX runtime runs the training step.
    From a torch.export model, initializers the exporter marked or made as constants are not trained
    (``exporter_constants``; a warning names them); ``also_train`` names some of them to train anyway.
    ``tie_weights`` trains a weight the exporter wrote twice (an LM head sharing its embedding, once
    transposed) as one parameter, as PyTorch does (``TieEqualWeightsPass``; the training and
    evaluation graphs read the copy as a Transpose of it, and export writes the copy back)."""
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
    ties = TieEqualWeightsPass(tie=True) if tie_weights else None
    if ties is not None:  # else the backward pipeline's own pass warns about each pair
        prepare.append(ties)
    run_pipeline(Pipeline(*prepare), forward)
    loss = adder.loss_name if adder is not None else loss

    running = running_statistics(forward.graph)
    constants = not_trained_constants(forward.graph, also_train, running)
    frozen = list(dict.fromkeys([*freeze, *running, *constants]))
    updated = updatable_running_statistics(forward.graph)
    updated_nodes = set(updated.values())
    _note_training_batch_norms(forward.graph, updated_nodes)
    _with_running_outputs(forward, updated_nodes)
    buffers = ParamsAsInputsPass(list(updated))  # inputs before any pass: nothing folds their values
    run_pipeline(buffers, forward)
    backward = _copy(forward)
    pipeline, gradient = backward_pipeline(GradientSpec(loss=loss, freeze=frozen), precision)
    run_pipeline(pipeline, backward)
    if portable:
        run_pipeline(Pipeline(LowerToStandardPass(), CleanupPass()), backward)
    assert gradient.loss_name is not None  # the gradient pass sets it when it runs
    loss, params = gradient.loss_name, gradient.wrt_names
    unmarked = [name for name in unmarked_initializers(forward.graph) if name in set(params)]
    if unmarked:
        warnings.warn(describe_unmarked(unmarked), stacklevel=2)

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
    layout = update.layout
    assert layout is not None  # the optimizer pass sets it when it runs
    layout.params.update(_running_statistics_outputs(backward, list(updated)))

    evaluate = _evaluation_model(forward, params, loss, list(updated))
    if precision != "fp32":
        run_pipeline(AutocastPass(precision), evaluate)
    reserved = set(params) | set(updated) | {layout.lr, layout.step} | {s.input for s in layout.states}
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
        initial_params={**as_inputs.initial_values, **buffers.initial_values},
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
        running_statistics_updated=list(updated),
        tied=list(ties.tied) if ties is not None else [],
    )


def _evaluation_model(forward: ir.Model, params: list[str], loss: str, updated: list[str]) -> ir.Model:
    """The forward model (with its loss) whose parameters are inputs; its only output is the loss.
    It runs in inference mode: Dropout off, and each BatchNormalization whose running statistics the
    steps update (``updated``, graph inputs by now) normalises with them."""
    model = _copy(forward)
    graph = model.graph
    keep_outputs(graph, [v for v in graph.outputs if v.name == loss])
    nodes = {node for node in training_batch_norms(graph) if {value_name(v) for v in node.inputs[3:5] if v} <= set(updated)}
    to_inference_mode(graph, nodes)
    run_pipeline(Pipeline(ParamsAsInputsPass(params), CleanupPass()), model)
    remove_unused_inputs(graph, keep=set(params))
    return model


def not_trained_constants(
    graph: ir.Graph, also_train: Sequence[str] = (), running: Sequence[str] = (), hint: str = "--train NAME trains one anyway"
) -> list[str]:
    """``exporter_constants`` of ``graph`` less ``also_train`` and the ``running`` statistics (which
    have their own handling), warned about (the CLI says it as a note); a name in ``also_train``
    that is none of them is a usage error."""
    constants = {name: why for name, why in exporter_constants(graph).items() if name not in set(running)}
    unknown = [name for name in also_train if name not in constants]
    if unknown:
        those = ", ".join(map(repr, list(constants)[:8])) + (" ..." if len(constants) > 8 else "")
        raise UsageError(
            f"--train names no initializer that training leaves out as an exporter's constant: {', '.join(map(repr, unknown))}"
            + (f" (those are: {those})" if constants else " (this model has none)")
        )
    left_out = {name: why for name, why in constants.items() if name not in set(also_train)}
    if left_out:
        warnings.warn(f"{describe_constants(left_out)}; {hint}", stacklevel=3)
    return list(left_out)


def running_statistics(graph: ir.Graph) -> list[str]:
    """Initializers that BatchNormalization nodes read as running mean / variance (inputs 3, 4)."""
    names: list[str] = []
    for node in graph:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx"):
            for value in node.inputs[3:5]:
                if value is not None and value.name in graph.initializers:
                    names.append(value_name(value))
    return names


def training_batch_norms(graph: ir.Graph) -> list[ir.Node]:
    """The BatchNormalization nodes of ``graph`` that normalise with the batch's statistics."""
    from gradgen.grads.rules.norm import batch_norm_in_training

    return [
        node
        for node in graph
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and batch_norm_in_training(node)
    ]


def updatable_running_statistics(graph: ir.Graph) -> dict[str, ir.Node]:
    """Running statistics a training step updates -> their node: the input_mean and input_var of a
    training-mode BatchNormalization that are initializers nothing else reads (a statistic two nodes
    share has no single next value)."""
    updated: dict[str, ir.Node] = {}
    for node in training_batch_norms(graph):
        stats = [v for v in node.inputs[3:5] if v is not None and v.name in graph.initializers and len(v.uses()) == 1]
        if len(stats) == 2:
            updated.update({value_name(v): node for v in stats})
    return updated


def _with_running_outputs(model: ir.Model, nodes: set[ir.Node]) -> None:
    """Give each of ``nodes`` (training-mode BatchNormalization) its running_mean and running_var
    outputs, named, where the export left them out."""
    names = GraphBuilder(model.graph, default_opset(model))
    for node in nodes:
        if len(node.outputs) >= 3:
            continue
        node.resize_outputs(3)
        for value, suffix in zip(node.outputs[1:3], ("running_mean", "running_var")):
            if not value.name:
                names.rename(value, f"{node.name or node.outputs[0].name}_{suffix}")


def _running_statistics_outputs(model: ir.Model, names: list[str]) -> dict[str, str]:
    """Each updated running statistic (a graph input of the training graph) -> the graph output that
    holds its next value: the running output of the training-mode BatchNormalization (or the
    BatchNormInternal the gradient pass made of it) that reads it, made a graph output here."""
    graph = model.graph
    builder = GraphBuilder(graph, default_opset(model))
    inputs = {v.name: v for v in graph.inputs}
    outputs: dict[str, str] = {}
    for name in names:
        readers = [(node, i) for node, i in inputs[name].uses() if node.op_type in ("BatchNormalization", "BatchNormInternal")]
        if len(readers) != 1 or readers[0][1] not in (3, 4) or len(readers[0][0].outputs) < 3:
            raise ModelError(f"the running statistic {name!r} is not read by one training-mode BatchNormalization")
        node, index = readers[0]
        value = node.outputs[index - 2]  # input_mean -> running_mean, input_var -> running_var
        if not value.is_graph_output():  # named as the parameters' next values are
            builder.rename(value, f"{name}.next")
            graph.outputs.append(value)
        outputs[name] = value_name(value)
    return outputs


def _note_training_batch_norms(graph: ir.Graph, updated: set[ir.Node]) -> None:
    """Warn (the CLI says it as a note) where a BatchNormalization runs in training mode but its
    running statistics cannot be updated (they are not initializers of their own): the steps use the
    batch statistics, and the running statistics stay as exported."""
    count = sum(1 for node in training_batch_norms(graph) if node not in updated)
    if count:
        warnings.warn(
            f"{count} BatchNormalization node(s) run in training mode (batch statistics) with running statistics "
            "that are not initializers of their own; training does not update those, which stay as exported",
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
