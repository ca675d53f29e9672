"""Gradient rules (one small function per op, grouped by family) and the builder they use."""

from gradgen.grads.registry import all_rules, lookup_rule
from gradgen.grads.table import grad_rule, non_differentiable

__all__ = ["all_rules", "grad_rule", "lookup_rule", "non_differentiable"]
