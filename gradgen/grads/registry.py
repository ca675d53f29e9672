"""The table of gradient rules, keyed by (domain, op_type).

A rule is a small function ``rule(g) -> list`` registered with ``@grad_rule``. It receives a
``GradContext`` (see builder.py) holding the forward node and its output gradients, emits nodes
through it, and returns one entry per forward input: a gradient value, or None where that input
gets no gradient. Rules registered with ``broadcast=True`` return gradients in the shape of the
node's output; the walker undoes the broadcasting for each input, once, in shared code.

Ops whose outputs never carry a gradient (shape computations, comparisons, integer outputs,
random numbers) are registered with ``non_differentiable``; the walker stops at them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from gradgen.kernels.registry import normalize_domain


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

    @property
    def differentiable(self) -> bool:
        return self.fn is not None


_RULES: dict[tuple[str, str], GradRule] = {}


def grad_rule(*op_types: str, domain: str = "", broadcast: bool = False, nondiff_inputs=(), unsupported_inputs=()):
    """Register ``fn`` as the gradient rule of ``op_types``.

    A rule returns a gradient for every input the walker asks for (``g.needs(i)``), or raises a
    ModelError saying why it cannot; returning None for a wanted input is a bug the walker reports.
    """

    def register(fn: Callable) -> Callable:
        for op_type in op_types:
            key = (normalize_domain(domain), op_type)
            if key in _RULES:
                raise RuntimeError(f"duplicate gradient rule for {key}")
            _RULES[key] = GradRule(key[0], op_type, fn, broadcast, frozenset(nondiff_inputs),
                                   frozenset(unsupported_inputs))
        return fn

    return register


def non_differentiable(*op_types: str, domain: str = "") -> None:
    """Declare ops whose outputs carry no gradient (the walker treats them as constants)."""
    for op_type in op_types:
        key = (normalize_domain(domain), op_type)
        if key in _RULES:
            raise RuntimeError(f"duplicate gradient rule for {key}")
        _RULES[key] = GradRule(key[0], op_type, None)


def lookup_rule(domain: str, op_type: str) -> GradRule | None:
    _ensure_loaded()
    return _RULES.get((normalize_domain(domain), op_type))


def all_rules() -> dict[tuple[str, str], GradRule]:
    _ensure_loaded()
    return dict(_RULES)


_LOADED = False
_LOAD_ERRORS: list = []  # an import error of the modules that fill the registry


def _ensure_loaded() -> None:
    global _LOADED
    if _LOAD_ERRORS:
        raise RuntimeError(f"gradgen's registry failed to load: {_LOAD_ERRORS[0]}") from _LOAD_ERRORS[0]
    if _LOADED:
        return
    _LOADED = True
    try:
        from gradgen.grads import rules  # noqa: F401
    except Exception as exc:  # later calls must not report every op as unsupported
        _LOAD_ERRORS.append(exc)
        raise
