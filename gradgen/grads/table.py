"""The declarations gradient rules are made of: ``GradRule`` and the decorators that record them.

Rule modules (gradgen/grads/rules/<family>.py) import this module only; the registry
(gradgen/grads/registry.py) imports the family modules it lists and reads the table. Nothing here
imports a rule module, so no import runs in a circle.

A rule is a small function ``rule(g) -> list`` registered with ``@grad_rule``. It receives a
``GradContext`` (see builder.py) holding the forward node and its output gradients, emits nodes
through it, and returns one entry per forward input: a gradient value, or None where that input
gets no gradient. Rules registered with ``broadcast=True`` return gradients in the shape of the
node's output; the walker undoes the broadcasting for each input, once, in shared code.

Ops whose outputs never carry a gradient (shape computations, comparisons, integer outputs,
random numbers) are declared with ``non_differentiable``; the walker stops at them.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from gradgen.ops.schemas import normalize_domain


@dataclasses.dataclass(frozen=True)
class GradRule:
    domain: str
    op_type: str
    fn: Callable | None  # None: non-differentiable
    broadcast: bool = False
    # Positions of inputs whose gradient is zero by the op's definition: integer or bool data
    # (indices, shapes, axes, conditions) and float inputs that do not change the output (CastLike's
    # target). The walker does not propagate "requires gradient" through them.
    nondiff_inputs: frozenset[int] = frozenset()
    # Positions of float inputs that do change the output but whose gradient gradgen does not
    # compute (Resize's roi and scales). A differentiated tensor reaching one is an error naming the
    # node, never a silent zero.
    unsupported_inputs: frozenset[int] = frozenset()
    # The module that declared the rule (gradgen.grads.rules.<family>).
    module: str = ""
    # Outputs that depend on only some of the inputs, as {output position: input positions}
    # (LayerNormalization's Mean and InvStdDev read X only); an output not listed depends on every
    # input. A loss reaching the node only through such outputs asks no gradient of the others.
    output_inputs: tuple[tuple[int, frozenset[int]], ...] = ()

    def reaches(self, output: int, input: int) -> bool:
        """Whether the node's output ``output`` depends on its input ``input``."""
        for position, inputs in self.output_inputs:
            if position == output:
                return input in inputs
        return True

    @property
    def differentiable(self) -> bool:
        return self.fn is not None

    @property
    def family(self) -> str:
        return self.module.rsplit(".", 1)[-1]


RULES: dict[tuple[str, str], GradRule] = {}


def _add(rule: GradRule) -> None:
    key = (rule.domain, rule.op_type)
    if key in RULES:
        raise RuntimeError(f"duplicate gradient rule for {key}")
    RULES[key] = rule


def grad_rule(
    *op_types: str, domain: str = "", broadcast: bool = False, nondiff_inputs=(), unsupported_inputs=(), output_inputs=None
):
    """Register ``fn`` as the gradient rule of ``op_types``; ``output_inputs``: {output position:
    input positions} for outputs that depend on only some inputs (see GradRule).

    A rule returns a gradient for every input the walker asks for (``g.needs(i)``), or raises a
    ModelError saying why it cannot; returning None for a wanted input is a bug the walker reports.
    """

    def register(fn: Callable) -> Callable:
        for op_type in op_types:
            _add(
                GradRule(
                    normalize_domain(domain),
                    op_type,
                    fn,
                    broadcast,
                    frozenset(nondiff_inputs),
                    frozenset(unsupported_inputs),
                    fn.__module__,
                    tuple((k, frozenset(v)) for k, v in sorted((output_inputs or {}).items())),
                )
            )
        return fn

    return register


def non_differentiable(*op_types: str, domain: str = "") -> None:
    """Declare ops whose outputs carry no gradient (the walker treats them as constants)."""
    module = sys._getframe(1).f_globals.get("__name__", "")  # the declaring family module
    for op_type in op_types:
        _add(GradRule(normalize_domain(domain), op_type, None, module=module))
