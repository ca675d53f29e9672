"""Dynamic loss scaling as graph ops, for float16 training steps (``torch.amp.GradScaler``'s rule).

float16's smallest normal number is 6e-5: small activation gradients flush to zero. The loss
seed (``d loss / d loss``, 1) is replaced by the current scale S, so every gradient of the
backward graph is S times larger; the parameter gradients (float32: the parameters are float32
master weights) are multiplied by 1 / S before the optimizer sees them. When one of them is not
finite (an overflow in float16), the step is skipped: every parameter and optimizer state keeps
its value, S is multiplied by ``backoff_factor`` and the count of good steps restarts; after
``growth_interval`` good steps in a row S is multiplied by ``growth_factor`` (when the product is
finite). This is ``GradScaler.unscale_`` / ``step`` / ``update``, with its defaults.

The overflow test reads the global gradient norm the optimizer computes anyway (``grad_norm``,
the norm of the unscaled gradients): an infinite or NaN element makes it infinite or NaN, so
"the norm is not finite" is "some gradient is not finite" with no pass of its own over the
gradients. (It also skips a step whose gradients are finite but whose norm overflows float32,
above 3.4e38, where ``GradScaler`` would not: such a step could not be clipped or checked anyway.)
With gradient accumulation the scale is fixed over the micro-batches of a step (each micro-batch's
gradients are unscaled by it and summed) and the test is made once, at the step, as with
``GradScaler``.

The scaler's state lives in the step graph as optimizer-like states (inputs and ``.next``
outputs, so that the Trainer, the checkpoints and a persistent device binding carry it as they
carry the optimizer's): ``(LOSS_SCALING, "scale")``, ``(LOSS_SCALING, "good_steps")`` and, with an
optimizer that counts steps (AdamW's bias correction), ``(LOSS_SCALING, "updates")``: the number
of updates applied, which replaces the fed ``step`` input, since a skipped step is no update (as
PyTorch's AdamW, whose step count a skipped ``optimizer.step()`` leaves alone).

Two passes around ``OptimizerPass``: ``ScaleGradientsPass`` before it (seed and unscaling; the
accumulation graph gets it too), ``SkipOverflowPass`` after it (the overflow flag, the guarded
update and the new scale). The ``Where`` nodes that keep the old values on an overflow are tagged
as part of each parameter's update (role ``skip`` for the flag, see gradgen/training/optimizers.py),
so that the fused multi-tensor update on the GPU absorbs them: it reads the flag on the device and
writes nothing when it is set.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import UsageError
from gradgen.model_io import default_opset
from gradgen.names import value_name
from gradgen.training.graph_edit import as_output, scalar_input
from gradgen.training.optimizers import CONFIG_KEY, PARAM_KEY, READS_KEY, SKIP_CONFIG, SKIP_ROLE, WRITES_KEY

LOSS_SCALING = "loss_scaling"  # the "parameter" name its states are kept under
FOUND_INF = "found_inf"  # output: True when the step was skipped


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """``torch.amp.GradScaler``'s parameters (and defaults)."""

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self):
        if not (self.init_scale > 0 and np.isfinite(self.init_scale)):
            raise UsageError(f"loss scaling: initial scale {self.init_scale} is not a positive number")
        if not self.growth_factor > 1.0:
            raise UsageError(f"loss scaling: growth factor {self.growth_factor} is not > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            raise UsageError(f"loss scaling: backoff factor {self.backoff_factor} is not in (0, 1)")
        if self.growth_interval < 1:
            raise UsageError(f"loss scaling: growth interval {self.growth_interval} is not >= 1")

    def initial_states(self, counts_updates: bool) -> dict[tuple[str, str], np.ndarray]:
        states: dict[tuple[str, str], np.ndarray] = {
            (LOSS_SCALING, "scale"): np.array(self.init_scale, np.float32),
            (LOSS_SCALING, "good_steps"): np.array(0, np.int64),
        }
        if counts_updates:
            states[(LOSS_SCALING, "updates")] = np.array(0, np.int64)
        return states


class ScaleGradientsPass(ir.passes.InPlacePass):
    """Seed the backward graph with the scale (input ``loss_scaling.scale``, kept on the pass) and
    unscale the ``<p>_grad`` outputs."""

    def __init__(self, params: list[str], loss: str):
        super().__init__()
        self.params = list(params)
        self.loss = loss
        self.scale: ir.Value | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        b = GraphBuilder(graph, default_opset(model))
        b.prefix = "gradgen_loss_scaling"
        seed = graph.initializers.get(f"{self.loss}_grad")
        if seed is None:
            raise UsageError(f"loss scaling needs a scalar loss; {self.loss!r} has no constant seed")
        self.scale = scalar_input(b, f"{LOSS_SCALING}.scale", ir.DataType.FLOAT)
        scaled_seed = self.scale if seed.dtype == ir.DataType.FLOAT else b.op("Cast", self.scale, to=seed.dtype)
        seed.replace_all_uses_with(scaled_seed)
        graph.initializers.pop(value_name(seed))
        inverse = b.op("Reciprocal", self.scale)
        outputs = {v.name: i for i, v in enumerate(graph.outputs)}
        for name in self.params:
            position = outputs[f"{name}_grad"]
            grad = graph.outputs[position]
            factor = inverse if grad.dtype == ir.DataType.FLOAT else b.op("Cast", inverse, to=grad.dtype)
            unscaled = b.op("Mul", grad, factor)
            unscaled.type, unscaled.shape = grad.type, grad.shape
            out_name = grad.name
            grad.name = b.unique(f"{out_name}.scaled")
            unscaled.name = out_name
            graph.outputs[position] = unscaled
        return ir.passes.PassResult(model, modified=True)


class SkipOverflowPass(ir.passes.InPlacePass):
    """After ``OptimizerPass``: the overflow flag (the gradient norm is not finite); keep the old
    parameters and states when it is set (``Where`` nodes tagged as part of each update); the
    scaler's new state; AdamW's step from the count of applied updates. Updates ``layout`` in place."""

    def __init__(self, scaling: LossScaling, scale: ir.Value, layout):
        super().__init__()
        self.scaling = scaling
        self.scale = scale
        self.layout = layout

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from gradgen.training.optimizers import StateSlot

        graph = model.graph
        b = GraphBuilder(graph, default_opset(model))
        b.prefix = "gradgen_loss_scaling"
        inputs = {v.name: v for v in graph.inputs}
        positions = {v.name: i for i, v in enumerate(graph.outputs)}
        norm = graph.outputs[positions[self.layout.grad_norm]]
        found = _scalar_of(_not_finite(b, norm), ir.DataType.BOOL)
        guarded = [(p, p, "param", out) for p, out in self.layout.params.items()]
        guarded += [(slot.param, slot.input, f"state:{slot.kind}", slot.output) for slot in self.layout.states]
        for param, input_name, role, output_name in guarded:
            position = positions[output_name]
            new = graph.outputs[position]
            kept = b.op("Where", found, inputs[input_name], new)
            new.name = b.unique(f"{output_name}.unguarded")
            kept.name, kept.type, kept.shape = output_name, new.type, new.shape
            graph.outputs[position] = kept
            _tag_guard(kept, new, param, role)
        config = json.loads(graph.metadata_props[CONFIG_KEY])
        graph.metadata_props[CONFIG_KEY] = json.dumps({**config, SKIP_CONFIG: True}, sort_keys=True)

        s = self.scaling
        good = scalar_input(b, f"{LOSS_SCALING}.good_steps", ir.DataType.INT64)
        one = b.const(np.array(1, np.int64))
        zero = b.const(np.array(0, np.int64))
        good_next = b.op("Where", found, zero, b.op("Add", good, one))
        grown = b.op("Mul", self.scale, b.const(np.array(s.growth_factor, np.float32)))
        grow = b.op(
            "And", b.op("Equal", good_next, b.const(np.array(s.growth_interval, np.int64))), b.op("Not", _not_finite(b, grown))
        )
        backed_off = b.op("Mul", self.scale, b.const(np.array(s.backoff_factor, np.float32)))
        scale_next = b.op("Where", found, backed_off, b.op("Where", grow, grown, self.scale))
        good_next = b.op("Where", b.op("Equal", good_next, b.const(np.array(s.growth_interval, np.int64))), zero, good_next)
        slots = [
            StateSlot(
                LOSS_SCALING,
                "scale",
                value_name(self.scale),
                value_name(as_output(b, scale_next, f"{LOSS_SCALING}.scale.next", like=self.scale)),
            ),
            StateSlot(
                LOSS_SCALING,
                "good_steps",
                value_name(good),
                value_name(as_output(b, good_next, f"{LOSS_SCALING}.good_steps.next", like=good)),
            ),
        ]
        if self.layout.step is not None:  # the optimizer's step: updates applied so far, + 1
            step = inputs[self.layout.step]
            updates = scalar_input(b, f"{LOSS_SCALING}.updates", ir.DataType.INT64)
            step.replace_all_uses_with(_scalar_of(b.op("Add", updates, one), ir.DataType.INT64))
            updates_next = b.op("Where", found, updates, b.op("Add", updates, one))
            slots.append(
                StateSlot(
                    LOSS_SCALING,
                    "updates",
                    value_name(updates),
                    value_name(as_output(b, updates_next, f"{LOSS_SCALING}.updates.next", like=updates)),
                )
            )
            self.layout.step = None
        flag = as_output(b, b.op("Identity", found), FOUND_INF)
        flag.type, flag.shape = ir.TensorType(ir.DataType.BOOL), ir.Shape([])
        self.layout.states.extend(slots)
        self.layout.found_inf = flag.name
        return ir.passes.PassResult(model, modified=True)


def _not_finite(b: GraphBuilder, x: ir.Value) -> ir.Value:
    """True where ``x`` is Inf or NaN: ``IsNaN(x - x)`` (x - x is NaN exactly there, 0 elsewhere).
    Not ``IsInf(x) or IsNaN(x)``: the CUDA backend has no IsInf kernel, and a step with a CPU
    fallback cannot be replayed as one CUDA graph."""
    return b.op("IsNaN", b.op("Sub", x, x))


def _scalar_of(value: ir.Value, dtype: ir.DataType) -> ir.Value:
    """``value`` declared a scalar of ``dtype``: the plans of the step read declared types (the
    fused update checks its flag's and scalars' types)."""
    value.type, value.shape = ir.TensorType(dtype), ir.Shape([])
    return value


def _tag_guard(kept: ir.Value, new: ir.Value, param: str, role: str) -> None:
    """``kept = Where(found, old, new)`` joins ``param``'s update: it reads the flag (role ``skip``)
    and the old value (``role``) and makes the value written, in place of ``new``'s producer."""
    where, producer = kept.producer(), new.producer()
    assert where is not None and producer is not None  # made by the builder and the optimizer pass
    where.metadata_props[PARAM_KEY] = param
    where.metadata_props[READS_KEY] = f"{SKIP_ROLE},{role},"
    where.metadata_props[WRITES_KEY] = role
    producer.metadata_props.pop(WRITES_KEY, None)
