"""Gradient rules (one small function per op, grouped by family) and the builder they use."""

from gradgen.grads.registry import all_rules, grad_rule, lookup_rule, non_differentiable

__all__ = ["all_rules", "grad_rule", "lookup_rule", "non_differentiable"]
