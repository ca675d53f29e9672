"""Loss blocks: append a loss to a model that ends in logits or predictions.

``AddLossPass`` takes a graph output (logits, predictions), adds a graph input for the target and
a scalar output for the loss, computed with standard ONNX ops, as PyTorch computes it with the
default ``reduction="mean"``:

- ``cross_entropy``: ``F.cross_entropy(logits, labels, ignore_index=, label_smoothing=)``; int64
  labels; the classes lie on ``class_axis`` of the logits (default the last axis, the layout of
  language-model logits ``(batch, time, vocab)``; 1 for ``(batch, classes, ...)``).
- ``mse``: ``F.mse_loss``; ``l1``: ``F.l1_loss``; ``bce_with_logits``:
  ``F.binary_cross_entropy_with_logits``; the target has the output's shape and float type.

The pass needs opset 13 or more (run ``UpgradeOpsetPass`` before it, as every gradgen pipeline does).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError, UsageError
from gradgen.model_io import default_opset
from gradgen.names import value_name

LOSS_KINDS = ("cross_entropy", "mse", "l1", "bce_with_logits")
_FLOAT = {ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """Which loss to append, on which output; ``target`` names the new graph input.

    ``target`` defaults to ``labels`` (cross-entropy) or ``target`` (the others), with a numeric
    suffix if the model already uses that name; a ``target`` given explicitly must be free.
    ``ignore_index`` and ``label_smoothing`` apply to cross-entropy only (PyTorch's defaults).
    """

    kind: str
    output: str | None  # None: the model's only output (generate_artifacts); AddLossPass needs a name
    target: str | None = None
    ignore_index: int | None = -100
    label_smoothing: float = 0.0
    class_axis: int = -1
    # how errors name ``output``: the option that gave it (train / build-backward --loss-output)
    output_option: str = dataclasses.field(default="--output", compare=False)

    def __post_init__(self):
        if self.kind not in LOSS_KINDS:
            raise UsageError(f"unknown loss {self.kind!r}: choose one of {', '.join(LOSS_KINDS)}")
        if not 0.0 <= self.label_smoothing < 1.0:  # at 1 the labels would not count at all (nan: refused too)
            raise UsageError(f"label smoothing {self.label_smoothing} is not in [0, 1): it must be a number >= 0 and < 1")
        if self.kind != "cross_entropy" and self.label_smoothing:
            raise UsageError("label smoothing applies to the cross_entropy loss only")

    @property
    def default_target(self) -> str:
        return "labels" if self.kind == "cross_entropy" else "target"


def cross_entropy_only(kind: str | None, loss_option: str, **given: object) -> None:
    """Options of the cross_entropy loss (those not None) are a usage error with another loss or none:
    they would be ignored."""
    named = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is not None]
    if not named or kind == "cross_entropy":
        return
    if kind is None:
        raise UsageError(
            f"{named[0]} applies to an added cross_entropy loss: pass {loss_option} cross_entropy or drop {named[0]}"
        )
    raise UsageError(f"{named[0]} applies to the cross_entropy loss only ({loss_option} is {kind}); drop {named[0]}")


class AddLossPass(ir.passes.InPlacePass):
    """Append ``spec``'s loss to the model: a new target input and a scalar float output.

    After the pass, ``loss_name`` and ``target_name`` hold the names it used (``loss``, or
    ``loss_1``... when taken).
    """

    def __init__(self, spec: LossSpec):
        super().__init__()
        self.spec = spec
        self.loss_name: str | None = None
        self.target_name: str | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        opset = default_opset(model)
        if opset < 13:
            raise ModelError(f"adding a loss needs opset 13 or more; the model has opset {opset} (run UpgradeOpsetPass first)")
        if self.spec.output is None:
            raise UsageError(
                f"the {self.spec.kind} loss names no output to read: name the model output (logits, predictions) it applies to"
            )
        output = _chosen_output(graph, self.spec.output, self.spec.output_option)
        builder = GraphBuilder(graph, opset)
        builder.prefix = f"gradgen_loss/{self.spec.kind}"
        target = _new_target(builder, graph, self.spec, output)
        existing = set(graph.initializers)
        loss = _EMITTERS[self.spec.kind](builder, output, target, self.spec)
        _constants_as_nodes(graph, [name for name in graph.initializers if name not in existing])
        builder.rename(loss, "loss")
        assert output.dtype is not None  # _chosen_output checked it is a float type
        loss.type = ir.TensorType(output.dtype)
        loss.shape = ir.Shape([])
        graph.outputs.append(loss)
        self.loss_name, self.target_name = loss.name, target.name
        return ir.passes.PassResult(model, modified=True)


def _constants_as_nodes(graph: ir.Graph, names: list[str]) -> None:
    """Make the loss block's constant initializers Constant nodes (at the top of the graph).

    A float initializer is a parameter to every gradgen pass and tool (build-backward's default
    --wrt, training, ONNX Runtime artifacts): the loss's own constants (the 1 of
    bce_with_logits' log(1 + exp(-|x|)), label smoothing's weights) must not be trained.
    """
    first = next(iter(graph), None)
    for name in names:
        value = graph.initializers.pop(name)
        tensor, value.const_value = value.const_value, None
        assert tensor is not None  # an initializer the loss block's builder made
        node = ir.Node("", "Constant", [], [ir.AttrTensor("value", tensor)], outputs=[value], name=f"{name}/Constant")
        if first is None:
            graph.append(node)
        else:
            graph.insert_before(first, node)


def _chosen_output(graph: ir.Graph, name: str, option: str = "--output") -> ir.Value:
    outputs = {value_name(v): v for v in graph.outputs}
    if name not in outputs:
        raise UsageError(f"{option} {name!r} is not a graph output; outputs are: {', '.join(outputs)}")
    value = outputs[name]
    if value.dtype not in _FLOAT:
        raise ModelError(f"output {name!r} has element type {value.dtype}; a loss needs float logits or predictions")
    if value.shape is None:
        raise ModelError(f"output {name!r} has no declared shape; a loss needs at least its rank")
    return value


def _new_target(builder: GraphBuilder, graph: ir.Graph, spec: LossSpec, output: ir.Value) -> ir.Value:
    """The target graph input: int64 labels without the class axis, or a tensor like the output."""
    if spec.target is not None:
        if not builder.name_is_free(spec.target):
            raise UsageError(f"target name {spec.target!r} is already a tensor of the model; choose another")
        builder.reserve(spec.target)
        name = spec.target
    else:
        name = builder.unique(spec.default_target)
    assert output.shape is not None  # _chosen_output checked it is declared
    if spec.kind == "cross_entropy":
        dims = list(output.shape)
        if len(dims) < 2:
            raise ModelError(
                f"cross-entropy needs logits of rank 2 or more (batch, classes, ...); output {output.name!r} has shape {dims}"
            )
        del dims[_class_axis(spec, len(dims))]
        target = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(dims))
    else:
        target = ir.Value(name=name, type=output.type, shape=output.shape)
    graph.inputs.append(target)
    return target


def _class_axis(spec: LossSpec, rank: int) -> int:
    axis = spec.class_axis + rank if spec.class_axis < 0 else spec.class_axis
    if not 1 <= axis < rank:
        raise UsageError(f"class axis {spec.class_axis} does not fit logits of rank {rank} (axis 0 is the batch)")
    return axis


def _mean(b: GraphBuilder, x: ir.Value) -> ir.Value:
    return b.reduce("ReduceMean", x, None, keepdims=0)


def _mse(b: GraphBuilder, pred: ir.Value, target: ir.Value, spec: LossSpec) -> ir.Value:
    diff = b.op("Sub", pred, target)
    return _mean(b, b.op("Mul", diff, diff))


def _l1(b: GraphBuilder, pred: ir.Value, target: ir.Value, spec: LossSpec) -> ir.Value:
    return _mean(b, b.op("Abs", b.op("Sub", pred, target)))


def _bce_with_logits(b: GraphBuilder, x: ir.Value, target: ir.Value, spec: LossSpec) -> ir.Value:
    """mean(softplus(x) - x * t), softplus(x) = max(x, 0) + log(1 + exp(-|x|)).

    max(x, 0) and -|x| are written as Where(x >= 0, ...) with the same branch at 0, so that the
    gradient is exactly sigmoid(x) - t everywhere, x = 0 included (an Abs and a Relu would each
    give 0 there and sum to the wrong value).
    """
    zero = b.const_like(x, 0.0)
    non_negative = b.op("GreaterOrEqual", x, zero)
    positive_part = b.op("Where", non_negative, x, zero)
    minus_abs = b.op("Where", non_negative, b.op("Neg", x), x)
    log_term = b.op("Log", b.op("Add", b.const_like(x, 1.0), b.op("Exp", minus_abs)))
    softplus = b.op("Add", positive_part, log_term)
    return _mean(b, b.op("Sub", softplus, b.op("Mul", x, target)))


def _cross_entropy(b: GraphBuilder, logits: ir.Value, labels: ir.Value, spec: LossSpec) -> ir.Value:
    """SoftmaxCrossEntropyLoss over the class axis, or, with label smoothing, PyTorch's mix
    ``(1 - eps) * nll + eps * mean over kept samples of (-mean over classes of log p)``."""
    typed = logits  # builder outputs carry no type yet: constants take the logits' type from here
    dims = dims_of(logits)
    assert dims is not None  # _chosen_output checked the output's shape is declared
    rank = len(dims)
    axis = _class_axis(spec, rank)
    if axis != 1:  # move the classes to axis 1, as the ONNX losses want them
        perm = [0, axis] + [i for i in range(1, rank) if i != axis]
        logits = b.transpose(logits, perm)
    ignore = spec.ignore_index
    if not spec.label_smoothing:
        return b.op("SoftmaxCrossEntropyLoss", logits, labels, ignore_index=ignore, reduction="mean")
    log_prob = b.op("LogSoftmax", logits, axis=1)
    nll = b.op("NegativeLogLikelihoodLoss", log_prob, labels, ignore_index=ignore, reduction="mean")
    smooth = b.op("Neg", b.reduce("ReduceMean", log_prob, [1], keepdims=0))  # per sample
    if ignore is None:
        smooth_loss = _mean(b, smooth)
    else:
        kept = b.cast_like(b.op("Not", b.op("Equal", labels, b.const(np.array(ignore, dtype=np.int64)))), typed)
        smooth_loss = b.op("Div", b.reduce_sum(b.op("Mul", smooth, kept), None, keepdims=0), b.reduce_sum(kept, None, keepdims=0))
    eps = spec.label_smoothing
    return b.op("Add", b.op("Mul", nll, b.const_like(typed, 1.0 - eps)), b.op("Mul", smooth_loss, b.const_like(typed, eps)))


_EMITTERS = {"cross_entropy": _cross_entropy, "mse": _mse, "l1": _l1, "bce_with_logits": _bce_with_logits}
