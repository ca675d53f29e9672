"""Optimizers as ONNX graphs: ``OptimizerPass`` turns a backward model into a training step.

The pass takes a model built by the gradient pass whose trainable parameters are graph inputs
(``ParamsAsInputsPass``) and whose gradients are the ``<p>_grad`` outputs, and appends, with
standard ONNX ops only:

1. optionally, the gradients accumulated over earlier micro-batches (inputs ``<p>.grad_accum``):
   the step uses their mean, ``(accumulated + this micro-batch's) / k``;
2. the global gradient norm (output ``grad_norm``, before clipping) and, with ``clip_norm``,
   PyTorch's ``clip_grad_norm_``: every gradient times ``min(1, clip_norm / (norm + 1e-6))``;
3. the update of every parameter, as PyTorch's single-tensor ``SGD`` / ``AdamW`` compute it.

The learning rate (``lr``, float32 scalar) and the 1-based step count (``step``, int64 scalar,
AdamW only) are graph inputs, so that a schedule computed on the host feeds them each step. The
parameters and optimizer states are inputs; their new values are the outputs ``<p>.next`` and
``<p>.<state>.next`` (a numeric suffix is added should a name be taken; ``layout`` records the
names used). Scalar arithmetic (bias corrections, ``1 - lr * weight_decay``) is done in float64
and rounded once, as PyTorch does it in Python floats.

Relation to ONNX Runtime training's optimizer ops (com.microsoft, opset 1):

- ``AdamWOptimizer(lr: float, step: int64, weights, gradients, momentums_1, momentums_2:
  seq(tensor), [update_signal: bool]) -> (updated_flag, updated_weights, updated_momentums_1,
  updated_momentums_2)`` with attributes ``alpha`` (beta1), ``beta`` (beta2), ``epsilon``,
  ``weight_decay``, ``correct_bias`` and ``adam_mode`` (0: PyTorch's AdamW order, weight decay
  before the update). ``AdamW`` here computes what ``adam_mode=0`` computes, with the same
  meaning of ``lr`` and ``step`` (1-based, incremented before the update as PyTorch does);
  ``exp_avg`` / ``exp_avg_sq`` are its momentums_1 / momentums_2.
- ``SGDOptimizerV2(lr, weights, gradients: seq(tensor), [update_signal]) -> (update_completed,
  updated_weights)`` is plain SGD (no momentum, no weight decay): ``SGD()`` with the defaults.
- Their global-norm clipping is ``InplaceClipGradNorm(max_norm)``, a separate op on the
  gradient sequence, like step 2 above.

The step graph does not use those ops (they take sequences; gradgen's executor has no kernels for
them, and the standard-op form runs on any runtime); ``gradgen.training.artifacts`` emits them in
the optimizer model it writes for ONNX Runtime's training API.

Tags: the graph stays standard, but the pass records what its update nodes are, so that a backend
may run them as one multi-tensor kernel (gradgen/executor/fused_optimizer.py on the GPU). The graph's
metadata ``gradgen.optimizer`` holds the optimizer's settings (JSON); every node of one parameter's
update (its clipping Mul included) carries node metadata ``gradgen.optimizer.param`` (the
parameter), ``gradgen.optimizer.reads`` (per input position, the role of an input that comes from
outside the update, comma-separated: ``param``, ``grad``, ``state:<kind>``, ``scalar:<name>``,
``skip``; empty for a value the update makes or a constant) and, on the node making a new value,
``gradgen.optimizer.writes`` (``param`` or ``state:<kind>``). With loss scaling, the ``Where`` nodes
that keep the old values on an overflow are the nodes making the new values: they read the boolean
overflow flag as ``skip`` (gradgen/training/loss_scaling.py), and the settings say so
(``skip_on_overflow``). The scalars are float values of the
parameter's type made once per step: ``lr`` (SGD), ``decay``, ``step_size``, ``bc2_sqrt`` (AdamW)
and ``clip`` (the clipping factor). The global gradient norm's nodes carry ``gradgen.optimizer.norm``:
``square`` on each gradient's ReduceSumSquare, ``sum`` on the Sum of the squares (absent for one
gradient) and ``sqrt`` on the Sqrt making ``grad_norm`` (the CUDA plan runs them as one multi-tensor
reduction, gradgen/executor/fused_optimizer.py's ``fuse_norm``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import UsageError
from gradgen.model_io import default_opset
from gradgen.names import value_name
from gradgen.training.graph_edit import (
    as_output,
    gradient_outputs,
    keep_outputs,
    new_input,
    scalar_input,
)

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
CONFIG_KEY = "gradgen.optimizer"  # graph metadata: the optimizer's settings (see optimizer_config)
PARAM_KEY = "gradgen.optimizer.param"  # node metadata, see the module docstring
READS_KEY = "gradgen.optimizer.reads"
WRITES_KEY = "gradgen.optimizer.writes"
NORM_KEY = "gradgen.optimizer.norm"  # node metadata of the global gradient norm's nodes, see the module docstring
SKIP_ROLE = "skip"  # the role of loss scaling's overflow flag (a bool scalar): the update writes nothing when set
SKIP_CONFIG = "skip_on_overflow"  # in the settings: the updates are guarded by that flag


def _finite_at_least_0(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


@dataclasses.dataclass(frozen=True)
class SGD:
    """PyTorch's ``torch.optim.SGD`` (dampening 0): L2 weight decay added to the gradient,
    momentum buffer ``buf = momentum * buf + g`` (0 at the start), Nesterov's variant."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    kind: ClassVar[str] = "sgd"

    def __post_init__(self):
        _check(0.0 <= self.momentum < 1.0, f"momentum {self.momentum} is not in [0, 1)")
        _check(_finite_at_least_0(self.weight_decay), f"weight decay {self.weight_decay}: must be a finite number >= 0")
        _check(not self.nesterov or self.momentum > 0, "Nesterov momentum needs a momentum > 0")

    @property
    def state_kinds(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    @property
    def uses_step(self) -> bool:
        return False

    def update(self, e: "_Emitter", p: ir.Value, g: ir.Value, states: dict[str, ir.Value]):
        if self.weight_decay:
            g = e.b.op("Add", g, e.b.op("Mul", p, e.b.const_like(p, self.weight_decay)))
        new_states = {}
        if self.momentum:
            buf = e.b.op("Add", e.b.op("Mul", states["momentum"], e.b.const_like(p, self.momentum)), g)
            new_states["momentum"] = buf
            g = e.b.op("Add", g, e.b.op("Mul", buf, e.b.const_like(p, self.momentum))) if self.nesterov else buf
        return e.b.op("Sub", p, e.b.op("Mul", e.scalar("lr", p), g)), new_states

    def scalars(self, e: "_Emitter") -> dict[str, ir.Value]:
        return {"lr": e.lr64}


@dataclasses.dataclass(frozen=True)
class AdamW:
    """PyTorch's ``torch.optim.AdamW``: decoupled weight decay ``p *= 1 - lr * weight_decay``,
    then Adam with bias correction (``bias_correction=False`` drops it)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    bias_correction: bool = True
    kind: ClassVar[str] = "adamw"
    state_kinds: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    @property
    def uses_step(self) -> bool:
        return self.bias_correction

    def __post_init__(self):
        b1, b2 = self.betas
        _check(0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0, f"betas {self.betas} are not both in [0, 1)")
        _check(_finite_at_least_0(self.eps), f"eps {self.eps}: must be a finite number >= 0")
        _check(_finite_at_least_0(self.weight_decay), f"weight decay {self.weight_decay}: must be a finite number >= 0")

    def scalars(self, e: "_Emitter") -> dict[str, ir.Value]:
        b = e.b
        one = b.const(np.array(1.0))
        scalars = {"decay": b.op("Sub", one, b.op("Mul", e.lr64, b.const(np.array(self.weight_decay))))}
        if self.bias_correction:
            t = b.op("Cast", e.step, to=ir.DataType.DOUBLE)
            bc1 = b.op("Sub", one, b.op("Pow", b.const(np.array(self.betas[0])), t))
            bc2 = b.op("Sub", one, b.op("Pow", b.const(np.array(self.betas[1])), t))
            scalars["step_size"] = b.op("Div", e.lr64, bc1)
            scalars["bc2_sqrt"] = b.op("Sqrt", bc2)
        else:
            scalars["step_size"] = e.lr64
        return scalars

    def update(self, e: "_Emitter", p: ir.Value, g: ir.Value, states: dict[str, ir.Value]):
        b, like = e.b, p  # ``like``: the typed parameter input, for constants and casts
        b1, b2 = self.betas
        if self.weight_decay:
            p = b.op("Mul", p, e.scalar("decay", like))
        m, v = states["exp_avg"], states["exp_avg_sq"]
        m = b.op("Add", m, b.op("Mul", b.op("Sub", g, m), b.const_like(like, 1.0 - b1)))  # torch's lerp
        v = b.op("Add", b.op("Mul", v, b.const_like(like, b2)), b.op("Mul", b.op("Mul", g, g), b.const_like(like, 1.0 - b2)))
        root = b.op("Sqrt", v)
        if self.bias_correction:
            root = b.op("Div", root, e.scalar("bc2_sqrt", like))
        denom = b.op("Add", root, b.const_like(like, self.eps))
        p = b.op("Sub", p, b.op("Mul", e.scalar("step_size", like), b.op("Div", m, denom)))
        return p, {"exp_avg": m, "exp_avg_sq": v}


Optimizer = SGD | AdamW


@dataclasses.dataclass
class StateSlot:
    """One optimizer state tensor: the graph input it is read from and the output of its new value."""

    param: str
    kind: str
    input: str
    output: str


@dataclasses.dataclass
class UpdateLayout:
    """The names a training step's caller feeds and reads back."""

    lr: str
    step: str | None
    grad_norm: str
    params: dict[str, str]  # parameter input -> output of its updated value
    states: list[StateSlot]
    accumulated: dict[str, str]  # parameter -> input of its gradient accumulated over earlier micro-batches
    found_inf: str | None = None  # with loss scaling: the output that says the step was skipped


class _Emitter:
    """Shared scalars (float64, cast once per element type) for the per-parameter updates."""

    def __init__(self, builder: GraphBuilder, lr: ir.Value, step: ir.Value | None):
        self.b = builder
        self.step = step
        self.lr64 = builder.op("Cast", lr, to=ir.DataType.DOUBLE)
        self._scalars: dict[str, ir.Value] = {}
        self._cast: dict[tuple[str, ir.DataType], ir.Value] = {}

    def set_scalars(self, scalars: dict[str, ir.Value]) -> None:
        self._scalars = scalars

    @property
    def casts(self) -> dict[tuple[str, ir.DataType], ir.Value]:
        """The scalars cast so far, by (name, element type)."""
        return self._cast

    def scalar(self, name: str, like: ir.Value) -> ir.Value:
        dtype = like.dtype
        assert dtype is not None  # parameters and their states are typed (see graph_edit)
        key = (name, dtype)
        if key not in self._cast:
            self._cast[key] = self.b.op("Cast", self._scalars[name], to=dtype)
        return self._cast[key]


class OptimizerPass(ir.passes.InPlacePass):
    """Append gradient accumulation, norm, clipping and ``optimizer``'s update for ``params``.

    The model's outputs become: the loss, ``grad_norm``, then each parameter's and state's new
    value; the gradient outputs and other forward outputs are dropped.
    """

    def __init__(
        self, optimizer: Optimizer, params: list[str], loss: str, *, clip_norm: float | None = None, accumulation: int = 1
    ):
        super().__init__()
        _check(
            clip_norm is None or (math.isfinite(clip_norm) and clip_norm > 0),
            f"clip norm {clip_norm}: must be a finite number > 0",
        )
        _check(accumulation >= 1, f"gradient accumulation over {accumulation} micro-batches: need at least 1")
        self.optimizer = optimizer
        self.params = list(params)
        self.loss = loss
        self.clip_norm = clip_norm
        self.accumulation = accumulation
        self.layout: UpdateLayout | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        b = GraphBuilder(graph, default_opset(model))
        b.prefix = f"gradgen_optimizer/{self.optimizer.kind}"
        grads = gradient_outputs(graph, self.params)
        params = {v.name: v for v in graph.inputs if v.name in grads}
        loss = next(v for v in graph.outputs if v.name == self.loss)
        keep_outputs(graph, [loss])

        lr = scalar_input(b, "lr", ir.DataType.FLOAT)
        step = scalar_input(b, "step", ir.DataType.INT64) if self.optimizer.uses_step else None
        accumulated: dict[str, str] = {}
        if self.accumulation > 1:
            for name in self.params:
                acc = new_input(b, f"{name}.grad_accum", params[name])
                accumulated[name] = value_name(acc)
                grads[name] = b.op("Mul", b.op("Add", acc, grads[name]), b.const_like(params[name], 1.0 / self.accumulation))
        raw_grads = dict(grads)  # the gradients the updates read, before clipping
        clip_factors: dict[str, ir.Value] = {}
        norm = global_norm(b, list(grads.values()), [params[n] for n in grads])
        grad_norm = as_output(b, norm, "grad_norm")
        grad_norm.type, grad_norm.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([])
        if self.clip_norm is not None:
            coef = b.op(
                "Min",
                b.op(
                    "Div",
                    b.const(np.array(self.clip_norm, np.float32)),
                    b.op("Add", norm, b.const(np.array(CLIP_EPS, np.float32))),
                ),
                b.const(np.array(1.0, np.float32)),
            )
            for name, g in grads.items():
                p = params[name]
                factor = coef if p.dtype == ir.DataType.FLOAT else b.op("Cast", coef, to=p.dtype)
                grads[name] = b.op("Mul", g, factor)
                clip_factors[name] = factor

        emitter = _Emitter(b, lr, step)
        emitter.set_scalars(self.optimizer.scalars(emitter))
        new_params, slots = {}, []
        graph.metadata_props[CONFIG_KEY] = optimizer_config(self.optimizer, self.clip_norm)
        for name in self.params:
            p = params[name]
            states = {kind: new_input(b, f"{name}.{kind}", p) for kind in self.optimizer.state_kinds}
            b.prefix = f"gradgen_optimizer/{name}"
            first = len(b.nodes)
            new_p, new_states = self.optimizer.update(emitter, p, grads[name], states)
            written = {"param": as_output(b, new_p, f"{name}.next", like=p)}
            new_params[name] = value_name(written["param"])
            for kind, value in new_states.items():
                out = written[f"state:{kind}"] = as_output(b, value, f"{name}.{kind}.next", like=p)
                slots.append(StateSlot(name, kind, value_name(states[kind]), value_name(out)))
            roles = {p: "param", raw_grads[name]: "grad", **{v: f"state:{k}" for k, v in states.items()}}
            roles.update({value: f"scalar:{key[0]}" for key, value in emitter.casts.items()})
            nodes = b.nodes[first:]
            clip_node = grads[name].producer() if name in clip_factors else None
            if clip_node is not None:
                roles[clip_factors[name]] = "scalar:clip"
                nodes = [clip_node, *nodes]
            _tag_update(name, nodes, roles, written)
        self.layout = UpdateLayout(
            lr=value_name(lr),
            step=value_name(step) if step is not None else None,
            grad_norm=value_name(grad_norm),
            params=new_params,
            states=slots,
            accumulated=accumulated,
        )
        return ir.passes.PassResult(model, modified=True)


def optimizer_config(optimizer: Optimizer, clip_norm: float | None) -> str:
    """The settings a fused update needs, as the JSON kept in the graph's metadata."""
    fields = {f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)}
    return json.dumps({"kind": optimizer.kind, **fields, "clip_norm": clip_norm}, sort_keys=True)


def _tag_update(param: str, nodes: list[ir.Node], roles: dict[ir.Value, str], written: dict[str, ir.Value]) -> None:
    """Tag one parameter's update nodes (see the module docstring); the nodes that make a scalar
    shared by every update (its Cast) are not part of it."""
    makes = {value: role for role, value in written.items()}
    for node in nodes:
        if any(out in roles for out in node.outputs):
            continue
        node.metadata_props[PARAM_KEY] = param
        node.metadata_props[READS_KEY] = ",".join(roles.get(v, "") if v is not None else "" for v in node.inputs)
        if node.outputs[0] in makes:
            node.metadata_props[WRITES_KEY] = makes[node.outputs[0]]


def global_norm(b: GraphBuilder, grads: list[ir.Value], likes: list[ir.Value]) -> ir.Value:
    """sqrt(sum of squares of every gradient), in float32 (a float32 scalar). Its nodes are tagged
    (``NORM_KEY``: ``square``, ``sum``, ``sqrt``) so that a backend may run it as one reduction."""
    squares = []
    for g, like in zip(grads, likes):
        sq = b.reduce("ReduceSumSquare", g, None, keepdims=0)
        _tag_norm(sq, "square")
        squares.append(sq if like.dtype == ir.DataType.FLOAT else b.op("Cast", sq, to=ir.DataType.FLOAT))
    total = b.sum(squares)
    if len(squares) > 1:
        _tag_norm(total, "sum")
    norm = b.op("Sqrt", total)
    _tag_norm(norm, "sqrt")
    return norm


def _tag_norm(value: ir.Value, role: str) -> None:
    node = value.producer()
    assert node is not None  # made by the builder just now
    node.metadata_props[NORM_KEY] = role


class AccumulateGradientsPass(ir.passes.InPlacePass):
    """For the micro-batches before the last of a step: add this micro-batch's gradients to the
    accumulated ones (inputs ``<p>.grad_accum``, outputs ``<p>.grad_accum.next``), no update.
    The bool scalar input ``grad_accum.restart`` (``restart``: its name) starts a new sum, the
    first micro-batch's gradients (``Where``: whatever the inputs hold, Inf or NaN of an earlier
    step included), so that accumulators kept on the device need no reset between steps.

    Outputs: the loss, then the accumulated gradients; ``accumulated`` maps each parameter to
    its (input, output) names.
    """

    def __init__(self, params: list[str], loss: str):
        super().__init__()
        self.params = list(params)
        self.loss = loss
        self.accumulated: dict[str, tuple[str, str]] = {}
        self.restart: str | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        b = GraphBuilder(graph, default_opset(model))
        b.prefix = "gradgen_accumulate"
        grads = gradient_outputs(graph, self.params)
        params = {v.name: v for v in graph.inputs if v.name in grads}
        keep_outputs(graph, [next(v for v in graph.outputs if v.name == self.loss)])
        restart = scalar_input(b, "grad_accum.restart", ir.DataType.BOOL)
        self.restart = value_name(restart)
        for name in self.params:
            acc = new_input(b, f"{name}.grad_accum", params[name])
            total = b.op("Where", restart, grads[name], b.op("Add", acc, grads[name]))
            out = as_output(b, total, f"{name}.grad_accum.next", like=params[name])
            self.accumulated[name] = (value_name(acc), value_name(out))
        return ir.passes.PassResult(model, modified=True)
