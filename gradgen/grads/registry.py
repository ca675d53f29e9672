"""The table of gradient rules, keyed by (domain, op_type), filled from an explicit list of families.

``FAMILIES`` names the rule modules (gradgen/grads/rules/<family>.py, the same family names as
kernels/cpu, kernels/cuda and passes/lowering). They declare their rules with the decorators of
gradgen/grads/table.py and never import this module; the first lookup imports them, once.
"""

from __future__ import annotations

import importlib

from gradgen.grads.table import RULES, GradRule

FAMILIES = ("conv", "elementwise", "indexing", "loss", "matmul", "norm", "pool", "reduction", "shape")
PACKAGE = "gradgen.grads.rules"
_RULES = RULES  # the table itself, under its former name (tests patch entries in it)

__all__ = ["FAMILIES", "GradRule", "all_rules", "lookup_rule"]


def lookup_rule(domain: str, op_type: str) -> GradRule | None:
    from gradgen.ops.schemas import normalize_domain

    _ensure_loaded()
    return RULES.get((normalize_domain(domain), op_type))


def all_rules() -> dict[tuple[str, str], GradRule]:
    _ensure_loaded()
    return dict(RULES)


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
        for family in FAMILIES:
            importlib.import_module(f"{PACKAGE}.{family}")
    except Exception as exc:  # later calls must not report every op as unsupported
        _LOAD_ERRORS.append(exc)
        raise
