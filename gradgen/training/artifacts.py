"""ONNX Runtime training artifacts, as ``onnxruntime.training.artifacts.generate_artifacts`` writes them.

ONNX Runtime's on-device training API (``Module``, ``Optimizer``, ``CheckpointState``) trains on
four files that its ``generate_artifacts`` writes; its Python package stopped at 1.19.2 (Python
<= 3.11). ``generate_artifacts`` here makes the same files with gradgen's gradient builder, on any
Python gradgen runs on, to the contracts that runtime checks:

- ``training_model.onnx``: the forward model, the loss, the backward graph, and one
  ``com.microsoft::InPlaceAccumulatorV2(<p>_grad.accumulation.buffer, <p>_grad, lazy_reset_grad)``
  per trainable parameter. Inputs, in this order: the user inputs the loss reads (the loss target last), the
  parameters (trainable and frozen, moved from initializers, in initializer order), one gradient
  buffer per trainable parameter, ``lazy_reset_grad`` (bool [1]). Outputs: the loss, then
  ``<p>_grad.accumulation.out`` (bool [1]) per trainable parameter. ``Module`` tells these roles
  apart by name: checkpoint parameters, the ``_grad.accumulation.buffer`` / ``.out`` suffixes,
  ``lazy_reset_grad``; the rest are user inputs and outputs.
- ``eval_model.onnx``: the forward model and the loss, parameters as inputs, Dropout and
  BatchNormalization out of training mode; its only output is the loss.
- ``optimizer_model.onnx``: inputs ``learning_rate`` (float [1]), ``step`` (int64 [1]), ``params``,
  ``gradients``, ``first_order_moments`` (and for AdamW ``second_order_moments``), sequences of
  tensors, in that order (``Optimizer`` checks the names); one ``com.microsoft`` node,
  ``AdamWOptimizer`` or ``SGDOptimizerV2``, optionally after ``InplaceClipGradNorm``; one bool
  output, the update flag. ``Optimizer`` feeds ``step`` as its count + 1.
- ``checkpoint``: the parameters in ONNX Runtime's flatbuffer format (``ort_checkpoint``).

Differences from ``generate_artifacts``, by design: the backward graph is gradgen's (standard ops
plus the com.microsoft gradient ops gradgen emits, all with ONNX Runtime's contracts), the loss
blocks are gradgen's (``LossSpec``: PyTorch's functional losses, mean reduction), and ``AdamW`` is
emitted with ``adam_mode=0``, PyTorch's ``torch.optim.AdamW``, with the hyper-parameters given
(onnxblock's ``AdamW()`` uses ``adam_mode=1``, the Hugging Face variant, eps 1e-6, no decay), so
that ``gradgen train`` and the ``Trainer`` compute the same steps. ``SGDOptimizerV2`` is plain SGD.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import onnx
import onnx_ir as ir

from gradgen.api import backward_pipeline, run_pipeline
from gradgen.errors import ModelError, UsageError
from gradgen.model_io import ModelLike, check_output_path, default_opset, load_model, output_error, save_model
from gradgen.names import value_names
from gradgen.passes import CleanupPass, GradientSpec, Pipeline, RemoveUnusedNodesPass, UpgradeOpsetPass
from gradgen.passes.ties import TieEqualWeightsPass
from gradgen.training.graph_edit import (
    ParamsAsInputsPass,
    gradient_outputs,
    keep_outputs,
    remove_unused_inputs,
    to_inference_mode,
)
from gradgen.training.losses import AddLossPass, LossSpec
from gradgen.training.optimizers import SGD, AdamW
from gradgen.training.ort_checkpoint import encode_checkpoint
from gradgen.training.program import not_trained_constants, running_statistics

TRAINING_MODEL = "training_model.onnx"
EVAL_MODEL = "eval_model.onnx"
OPTIMIZER_MODEL = "optimizer_model.onnx"
CHECKPOINT = "checkpoint"
RESET_GRAD = "lazy_reset_grad"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
ACCUMULATED_SUFFIX = "_grad.accumulation.out"
MICROSOFT = "com.microsoft"
# The newest ONNX Runtime training release (1.19.2) reads these at most.
ORT_TRAINING_MAX_OPSET = 21
ORT_TRAINING_MAX_IR_VERSION = 10
_FLOAT = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


@dataclasses.dataclass
class TrainingArtifacts:
    """The four artifacts in memory; ``save_artifacts`` writes them."""

    training: ir.Model
    eval: ir.Model
    optimizer: onnx.ModelProto | None
    requires_grad: dict[str, ir.TensorProtocol]  # initializer order
    frozen: dict[str, ir.TensorProtocol]
    loss: str
    user_inputs: list[str]

    def checkpoint(self) -> bytes:
        return encode_checkpoint(self.requires_grad, self.frozen)

    def compatibility_notes(self) -> list[str]:
        """Why ONNX Runtime training 1.19.2 would refuse these models, if it would."""
        notes = []
        opset = default_opset(self.training)
        if opset > ORT_TRAINING_MAX_OPSET:
            notes.append(
                f"the models use opset {opset}; ONNX Runtime training 1.19.2 reads opsets up to {ORT_TRAINING_MAX_OPSET}"
            )
        if (self.training.ir_version or 0) > ORT_TRAINING_MAX_IR_VERSION:
            notes.append(
                f"the models have IR version {self.training.ir_version}; ONNX Runtime training 1.19.2 reads "
                f"IR versions up to {ORT_TRAINING_MAX_IR_VERSION}"
            )
        return notes


_NAME_THEM = "--requires-grad NAME (repeatable) names the trainable initializers instead"


def generate_artifacts(
    model: ModelLike,
    *,
    requires_grad: Sequence[str] | None = None,
    frozen: Sequence[str] = (),
    loss: LossSpec | None = None,
    optimizer: SGD | AdamW | None = None,
    clip_norm: float | None = None,
    tie_weights: bool = False,
) -> TrainingArtifacts:
    """Build ONNX Runtime's training, eval and optimizer models and the checkpoint of ``model``.

    ``requires_grad`` names the trainable float initializers (default: every one the loss depends
    on through differentiable ops, less ``frozen``, BatchNormalization's running statistics and a
    torch.export model's constants, as ``build_training`` leaves them out);
    ``frozen`` names float initializers that become inputs held by the checkpoint but are not
    trained; other initializers stay constants of the graphs. ``loss`` appends a loss block to an
    output of a model that ends in logits or predictions; without it the model's loss is its only
    scalar float output; a ``loss`` whose ``output`` is None reads the model's only output.
    ``optimizer`` None writes no optimizer model. ``tie_weights`` trains a weight the exporter
    wrote twice (an LM head sharing its embedding) as one parameter, as ``build_training`` does: the
    graphs read the copy as a Transpose of it.
    """
    if clip_norm is not None and not (math.isfinite(clip_norm) and clip_norm > 0):
        raise UsageError(f"clip norm {clip_norm}: must be a finite number > 0")
    _check_optimizer(optimizer)
    forward = _copy(model) if isinstance(model, ir.Model) else load_model(model)
    trainable, frozen = _check_names(forward.graph, requires_grad, list(frozen))
    initializers = dict(forward.graph.initializers)  # before _add_loss prunes what only other outputs read
    loss_name = _add_loss(forward, loss)
    if trainable is not None:
        _check_loss_depends_on(forward.graph, loss_name, trainable)
    if tie_weights:
        run_pipeline(TieEqualWeightsPass(tie=True), forward)
    backward = _copy(forward)
    if trainable is None:
        running = running_statistics(forward.graph)
        freeze = [*frozen, *running, *not_trained_constants(forward.graph, running=running, hint=_NAME_THEM)]
    else:
        freeze = frozen
    pipeline, gradient = backward_pipeline(GradientSpec(loss=loss_name, wrt=trainable, freeze=list(dict.fromkeys(freeze))))
    run_pipeline(pipeline, backward)
    assert gradient.loss_name is not None  # the gradient pass sets it when it runs
    loss_name, trainable = gradient.loss_name, gradient.wrt_names

    order = [name for name in initializers if name in set(trainable) | set(frozen)]
    values = {name: _initializer_tensor(initializers[name]) for name in order}
    # A frozen parameter the loss does not read is in the checkpoint but in neither graph.
    training = _training_model(backward, loss_name, trainable, [n for n in order if n in backward.graph.initializers])
    evaluation = _eval_model(forward, loss_name, [n for n in order if n in forward.graph.initializers])
    trainable_set = set(trainable)
    requires = {name: values[name] for name in order if name in trainable_set}
    optimizer_model = None
    if optimizer is not None:
        optimizer_model = _optimizer_model(optimizer, requires, default_opset(forward), clip_norm)
    ir_version = _ir_version_for_ort(forward)
    for built in (training, evaluation):
        built.ir_version = ir_version
    if optimizer_model is not None:
        optimizer_model.ir_version = ir_version
    user_inputs = [
        name
        for name in value_names(training.graph.inputs)
        if name not in values and not name.endswith(BUFFER_SUFFIX) and name != RESET_GRAD
    ]
    return TrainingArtifacts(
        training=training,
        eval=evaluation,
        optimizer=optimizer_model,
        requires_grad=requires,
        frozen={name: values[name] for name in order if name not in trainable_set},
        loss=loss_name,
        user_inputs=user_inputs,
    )


def _initializer_tensor(value: ir.Value) -> ir.TensorProtocol:
    """An initializer's tensor; a ModelError when the model gives it none."""
    if value.const_value is None:
        raise ModelError(f"initializer {value.name!r} has no value")
    return value.const_value


def _add_loss(forward: ir.Model, loss: LossSpec | None) -> str | None:
    """Upgrade the opset and append ``loss`` (the name of the loss it adds; None: the model's own)."""
    if loss is None:
        _check_has_loss(forward.graph)
        run_pipeline(UpgradeOpsetPass(), forward)
        return None
    output = _loss_output(loss, forward.graph)
    _keep_only_output(forward, output)
    adder = AddLossPass(dataclasses.replace(loss, output=output))
    run_pipeline(Pipeline(UpgradeOpsetPass(), adder), forward)
    return adder.loss_name


def optimizer_for(
    kind: str, *, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float | None = None
) -> SGD | AdamW | None:
    """The optimizer of ``--optimizer KIND`` (adamw, sgd or none) and its options."""
    if len(betas) != 2:
        raise UsageError(f"betas {tuple(betas)}: expected two values (beta1, beta2)")
    betas = (betas[0], betas[1])  # a tuple, whatever sequence was passed
    adam_options = (betas, eps) != ((0.9, 0.999), 1e-8)
    if kind == "adamw":
        return AdamW(betas=betas, eps=eps, weight_decay=0.01 if weight_decay is None else weight_decay)
    if kind in ("sgd", "none") and adam_options:
        raise UsageError(f"--beta1, --beta2 and --eps are AdamW options; --optimizer is {kind}")
    if kind == "sgd":
        return SGD(weight_decay=weight_decay or 0.0)
    if kind == "none":
        if weight_decay is not None:
            raise UsageError("--weight-decay is an optimizer option; --optimizer is none")
        return None
    raise UsageError(f"unknown optimizer {kind!r}: choose adamw, sgd or none")


def _loss_output(spec: LossSpec, graph: ir.Graph) -> str:
    """The output ``spec`` reads: the one it names, else the model's only output."""
    if spec.output is not None:
        return spec.output
    names = value_names(graph.outputs)
    if len(names) != 1:
        raise UsageError(f"the model has {len(names)} outputs ({', '.join(names)}): name the one the loss reads with --output")
    return names[0]


def _keep_only_output(model: ir.Model, name: str) -> None:
    """Drop the outputs other than ``name`` (the model's own loss, say) and what only they read, so
    that the loss block's names (``loss``, ``labels``, ``target``) are free. An unknown ``name`` is
    left for the loss block to report."""
    graph = model.graph
    kept = [v for v in graph.outputs if v.name == name]
    if kept and len(graph.outputs) > 1:
        keep_outputs(graph, kept)
        run_pipeline(RemoveUnusedNodesPass(), model)
        remove_unused_inputs(graph)


def _copy(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def _check_optimizer(optimizer: SGD | AdamW | None) -> None:
    if isinstance(optimizer, SGD) and (optimizer.momentum or optimizer.weight_decay or optimizer.nesterov):
        raise UsageError(
            "ONNX Runtime's SGD optimizer (SGDOptimizerV2) is plain SGD: no momentum, Nesterov or "
            "weight decay; use --optimizer adamw, or plain sgd"
        )
    if optimizer is not None and not isinstance(optimizer, (SGD, AdamW)):
        raise UsageError(f"unknown optimizer {optimizer!r}: use SGD() or AdamW()")


def _check_loss_depends_on(graph: ir.Graph, loss: str | None, params: list[str]) -> None:
    """Every parameter to train feeds the loss (else its gradient would be zero: refused)."""
    outputs = (
        [v for v in graph.outputs if v.name == loss]
        if loss
        else [v for v in graph.outputs if v.shape is not None and v.shape.rank() == 0 and v.dtype in _FLOAT]
    )
    seen, stack = set(), list(outputs)
    while stack:
        value = stack.pop()
        if value.name in seen:
            continue
        seen.add(value.name)
        node = value.producer()
        if node is not None:
            stack.extend(v for v in node.inputs if v is not None)
            for attr in node.attributes.values():  # values a subgraph reads from this graph
                graphs = (
                    [attr.value]
                    if attr.type == ir.AttributeType.GRAPH
                    else attr.value
                    if attr.type == ir.AttributeType.GRAPHS
                    else []
                )
                for sub in graphs:
                    stack.extend(v for n in sub.all_nodes() for v in n.inputs if v is not None and v.graph is graph)
    unused = [name for name in params if name not in seen]
    if unused:
        raise UsageError(
            f"--requires-grad {', '.join(map(repr, unused))}: the loss does not depend on "
            f"{'it' if len(unused) == 1 else 'them'} (the gradient would be zero)"
        )


def _check_has_loss(graph: ir.Graph) -> None:
    """Without a loss block, the model must end in its loss: one scalar float output (as declared)."""
    floats = [v for v in graph.outputs if v.dtype in _FLOAT]
    scalars = [v for v in floats if v.shape is not None and v.shape.rank() == 0]
    unknown = [v for v in floats if v.shape is None]
    outputs = ", ".join(
        f"{v.name} {v.dtype.name if v.dtype else '?'} {list(v.shape) if v.shape is not None else '?'}" for v in graph.outputs
    )
    if not scalars and not unknown:
        raise ModelError(
            f"the model has no scalar float output to use as the loss (outputs: {outputs}); add a loss "
            "with --loss KIND (cross_entropy, mse, l1, bce_with_logits) and --output NAME"
        )
    if len(scalars) > 1:
        raise ModelError(
            f"the model has several scalar float outputs ({', '.join(value_names(scalars))}); "
            "training artifacts need one loss: keep only that output, or add a loss with --loss KIND"
        )


def _check_names(graph: ir.Graph, requires_grad: Sequence[str] | None, frozen: list[str]) -> tuple[list[str] | None, list[str]]:
    """The named parameters exist as float initializers and are either trainable or frozen."""
    floats = [name for name, value in graph.initializers.items() if value.dtype in _FLOAT]
    if not floats:
        raise ModelError("the model has no float initializer: there is no parameter to train")
    known = set(floats)
    listed = ", ".join(floats[:10]) + (f" and {len(floats) - 10} more" if len(floats) > 10 else "")
    for option, names in (("--requires-grad", requires_grad or []), ("--frozen", frozen)):
        unknown = [name for name in names if name not in known]
        if unknown:
            raise UsageError(
                f"{option} names no float initializer of the model: {', '.join(map(repr, unknown))} "
                f"(its float initializers: {listed})"
            )
    if requires_grad is not None:
        if not requires_grad:
            raise UsageError("--requires-grad: name at least one parameter to train")
        both = sorted(set(requires_grad) & set(frozen))
        if both:
            raise UsageError(
                f"{', '.join(map(repr, both))}: a parameter is either trainable (--requires-grad) or frozen (--frozen), not both"
            )
        return list(dict.fromkeys(requires_grad)), list(dict.fromkeys(frozen))
    return None, list(dict.fromkeys(frozen))


def _training_model(model: ir.Model, loss: str, trainable: list[str], order: list[str]) -> ir.Model:
    """Loss and gradient accumulators as outputs; parameters, gradient buffers and the reset flag as inputs."""
    graph = model.graph
    grads = gradient_outputs(graph, trainable)
    keep_outputs(graph, [v for v in graph.outputs if v.name == loss])
    run_pipeline(ParamsAsInputsPass(order), model)
    taken = {v.name for v in graph.inputs} | {v.name for node in graph for v in node.outputs} | set(graph.initializers)
    inputs = {v.name: v for v in graph.inputs}
    clashes = [n for p in trainable for n in (p + BUFFER_SUFFIX, p + ACCUMULATED_SUFFIX) if n in taken]
    if RESET_GRAD in taken:
        clashes.append(RESET_GRAD)
    if clashes:
        raise ModelError(
            f"the model already has tensor(s) named {', '.join(map(repr, clashes))}, which ONNX Runtime's "
            "training API reserves for its gradient buffers"
        )
    reset = ir.Value(name=RESET_GRAD, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1]))
    accumulated = []
    for index, name in enumerate(trainable):
        param = inputs[name]
        buffer = ir.Value(name=name + BUFFER_SUFFIX, type=param.type, shape=param.shape)
        graph.inputs.append(buffer)
        out = ir.Value(name=name + ACCUMULATED_SUFFIX, type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([1]))
        graph.append(
            ir.Node(
                MICROSOFT, "InPlaceAccumulatorV2", [buffer, grads[name], reset], outputs=[out], name=f"GradientAccumulator{index}"
            )
        )
        accumulated.append(out)
    graph.inputs.append(reset)
    graph.outputs.extend(accumulated)
    model.opset_imports.setdefault(MICROSOFT, 1)
    run_pipeline(CleanupPass(), model)
    remove_unused_inputs(graph)
    return model


def _eval_model(forward: ir.Model, loss: str, order: list[str]) -> ir.Model:
    """The forward model and its loss, parameters as inputs, in inference mode."""
    model = _copy(forward)
    graph = model.graph
    keep_outputs(graph, [v for v in graph.outputs if v.name == loss])
    run_pipeline(Pipeline(ParamsAsInputsPass(order), CleanupPass()), model)
    remove_unused_inputs(graph)
    to_inference_mode(graph)
    return model


def _ir_version_for_ort(model: ir.Model) -> int:
    """The model's IR version, lowered to what ONNX Runtime training 1.19.2 reads (10) when its opsets
    allow it: a recent onnx writes IR versions that runtime refuses although nothing else changed."""
    version = model.ir_version or ORT_TRAINING_MAX_IR_VERSION
    opsets = [onnx.helper.make_opsetid(domain, v) for domain, v in model.opset_imports.items()]
    try:
        needed = onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    except Exception:  # an opset this onnx does not know: keep the model's version
        return version
    return max(needed, min(version, ORT_TRAINING_MAX_IR_VERSION)) if needed <= ORT_TRAINING_MAX_IR_VERSION else version


def _optimizer_model(
    optimizer: SGD | AdamW, trainable: dict[str, ir.TensorProtocol], opset: int, clip_norm: float | None
) -> onnx.ModelProto:
    """onnxblock's optimizer graph: sequences of parameters, gradients and moments in, an update flag out."""
    not_float32 = [name for name, value in trainable.items() if value.dtype != ir.DataType.FLOAT]
    if not_float32:
        raise UsageError(
            f"ONNX Runtime's optimizer ops update float32 parameters only; {', '.join(map(repr, not_float32))} "
            "are not float32 (write no optimizer model with --optimizer none)"
        )
    h = onnx.helper
    float_seq = onnx.TensorProto.FLOAT
    inputs = [
        h.make_tensor_value_info("learning_rate", onnx.TensorProto.FLOAT, [1]),
        h.make_tensor_value_info("step", onnx.TensorProto.INT64, [1]),
    ]
    sequences = ["params", "gradients", "first_order_moments"]
    if isinstance(optimizer, AdamW):
        sequences.append("second_order_moments")
    inputs += [h.make_tensor_sequence_value_info(name, float_seq, None) for name in sequences]
    nodes, value_info, gradients = [], [], "gradients"
    if clip_norm is not None:
        nodes.append(
            h.make_node(
                "InplaceClipGradNorm",
                ["gradients"],
                ["clip_grad_norm_output"],
                name="InplaceClipGradNorm",
                domain=MICROSOFT,
                max_norm=float(clip_norm),
            )
        )
        value_info.append(h.make_tensor_sequence_value_info("clip_grad_norm_output", float_seq, None))
        gradients = "clip_grad_norm_output"
    if isinstance(optimizer, AdamW):
        flag = "adamw.updated_flag"
        nodes.append(
            h.make_node(
                "AdamWOptimizer",
                ["learning_rate", "step", "params", gradients, "first_order_moments", "second_order_moments"],
                [flag],
                name="AdamWOptimizer",
                domain=MICROSOFT,
                alpha=float(optimizer.betas[0]),
                beta=float(optimizer.betas[1]),
                epsilon=float(optimizer.eps),
                weight_decay=float(optimizer.weight_decay),
                correct_bias=int(optimizer.bias_correction),
                adam_mode=0,
            )
        )
    else:
        flag = "update_completed"
        nodes.append(
            h.make_node("SGDOptimizerV2", ["learning_rate", "params", gradients], [flag], name="SGDOptimizerV2", domain=MICROSOFT)
        )
    graph = h.make_graph(
        nodes, "optimizer", inputs, [h.make_tensor_value_info(flag, onnx.TensorProto.BOOL, [1])], value_info=value_info
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid(MICROSOFT, 1), h.make_opsetid("", opset)], producer_name="gradgen")
    return model


# ---------------------------------------------------------------- writing


def artifact_names(artifacts: TrainingArtifacts) -> list[str]:
    return [TRAINING_MODEL, EVAL_MODEL, *([OPTIMIZER_MODEL] if artifacts.optimizer is not None else []), CHECKPOINT]


@contextlib.contextmanager
def output_directory(directory: str | os.PathLike, *sources: str | os.PathLike) -> Iterator[Path]:
    """``directory``, created if missing, its artifact paths checked writable and none of ``sources``.

    A directory created here is removed again if the block fails before anything was written in it.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"{directory}: not a directory")
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{directory}: cannot create the output directory: {exc.strerror or exc}") from None
    try:
        for name in (TRAINING_MODEL, EVAL_MODEL, OPTIMIZER_MODEL, CHECKPOINT):
            check_output_path(directory / name, *sources)
        yield directory
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only if still empty
        raise


def save_artifacts(artifacts: TrainingArtifacts, directory: str | os.PathLike, *sources: str | os.PathLike) -> list[Path]:
    """Write the artifacts into ``directory`` (see ``output_directory``): all of them, or (on any error) none.

    Each file is written into a temporary directory inside ``directory`` first and renamed into
    place only when all are written; an existing artifact is replaced, as ``generate_artifacts``
    does. ``sources`` (the input model) are never overwritten.
    """
    checkpoint = artifacts.checkpoint()
    with output_directory(directory, *sources) as directory:
        try:
            staging = Path(tempfile.mkdtemp(prefix=".gradgen-artifacts.", suffix=".tmp", dir=directory))
        except OSError as exc:
            raise output_error(directory, exc) from exc
        try:
            for name, model in (
                (TRAINING_MODEL, artifacts.training),
                (EVAL_MODEL, artifacts.eval),
                (OPTIMIZER_MODEL, artifacts.optimizer),
            ):
                if model is not None:
                    save_model(model, staging / name)
            with open(staging / CHECKPOINT, "wb") as stream:
                stream.write(checkpoint)
                stream.flush()
                os.fsync(stream.fileno())
            written = sorted(staging.iterdir(), key=lambda p: (not p.name.endswith(".data"), p.name))
            for path in written:
                os.replace(path, directory / path.name)
        except OSError as exc:
            raise output_error(directory, exc) from exc
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return [directory / name for name in artifact_names(artifacts)]
