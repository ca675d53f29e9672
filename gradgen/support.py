"""What gradgen supports: the union of gradient rules and kernels, for ``gradgen ops``."""

from __future__ import annotations

from gradgen.grads import all_rules
from gradgen.kernels import all_kernels


def supported_ops() -> list[dict]:
    """One row per (domain, op_type): gradient "yes"/"no"/"non-differentiable", cpu, cuda."""
    rules = all_rules()
    kernels = all_kernels()
    rows = []
    for domain, op_type in sorted(set(rules) | set(kernels)):
        rule = rules.get((domain, op_type))
        kernel = kernels.get((domain, op_type))
        if rule is None:
            gradient = "no"
        else:
            gradient = "yes" if rule.differentiable else "non-differentiable"
        rows.append({
            "domain": domain or "ai.onnx",
            "op_type": op_type,
            "gradient": gradient,
            "cpu": bool(kernel and kernel.cpu),
            "cuda": bool(kernel and kernel.cuda),
        })
    return rows
