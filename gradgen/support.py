"""What gradgen supports: the union of gradient rules, kernels and com.microsoft schemas, for
``gradgen ops``."""

from __future__ import annotations

from gradgen.grads import all_rules
from gradgen.kernels import all_kernels
from gradgen.ops import schemas
from gradgen.ops.non_tensor import NON_TENSOR_OPS


def supported_ops() -> list[dict]:
    """One row per (domain, op_type): gradient "yes"/"no"/"non-differentiable", cpu, cuda (the
    com.microsoft ops gradgen emits are listed from their schemas even without a kernel)."""
    rules = all_rules()
    kernels = all_kernels()
    declared = {(schemas.MICROSOFT_DOMAIN, op_type) for op_type in schemas.SCHEMAS}
    declared |= {("", op_type) for op_type in NON_TENSOR_OPS}  # refused: gradgen runs tensors only
    rows = []
    for domain, op_type in sorted(set(rules) | set(kernels) | declared):
        rule = rules.get((domain, op_type))
        kernel = kernels.get((domain, op_type))
        if rule is None:
            gradient = "no"
        else:
            gradient = "yes" if rule.differentiable else "non-differentiable"
        rows.append(
            {
                "domain": domain or "ai.onnx",
                "op_type": op_type,
                "gradient": gradient,
                "cpu": bool(kernel and kernel.cpu),
                "cuda": bool(kernel and kernel.cuda),
            }
        )
    return rows


def microsoft_signatures() -> list[str]:
    """The signature of every com.microsoft op gradgen emits, from ``gradgen.ops.schemas``."""
    return [signature(schemas.SCHEMAS[op_type]) for op_type in sorted(schemas.SCHEMAS)]


def signature(schema: schemas.Schema) -> str:
    """``Op(a, b, c?) -> y`` with optional inputs and outputs marked ``?``, then the attributes."""
    formal = lambda f: f.name + ("?" if f.optional else "")  # noqa: E731
    text = f"{schema.op_type}({', '.join(map(formal, schema.inputs))}) -> {', '.join(map(formal, schema.outputs))}"
    if schema.attributes:
        text += " [" + ", ".join(a.name for a in schema.attributes) + "]"
    return text
