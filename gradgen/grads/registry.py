"""The table of gradient rules, keyed by (domain, op_type), filled from an explicit list of families.

``FAMILIES`` names the rule modules (gradgen/grads/rules/<family>.py, the same family names as
kernels/cpu, kernels/cuda and passes/lowering). They declare their rules with the decorators of
gradgen/grads/table.py and never import this module; the first lookup imports them, once.
"""

from __future__ import annotations

from gradgen.grads.table import RULES, GradRule
from gradgen.ops.schemas import normalize_domain
from gradgen.registration import Families

FAMILIES = (
    "attention",
    "control",
    "conv",
    "elementwise",
    "indexing",
    "loss",
    "matmul",
    "norm",
    "optimizer",
    "pool",
    "quantize",
    "recurrent",
    "reduction",
    "shape",
)
PACKAGE = "gradgen.grads.rules"
_FAMILIES = Families(PACKAGE, FAMILIES)
_RULES = RULES  # the table itself, under its former name (tests patch entries in it)

__all__ = ["FAMILIES", "GradRule", "all_rules", "lookup_rule"]


def lookup_rule(domain: str, op_type: str) -> GradRule | None:
    _FAMILIES.load()
    return RULES.get((normalize_domain(domain), op_type))


def all_rules() -> dict[tuple[str, str], GradRule]:
    _FAMILIES.load()
    return dict(RULES)
