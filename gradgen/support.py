"""What gradgen supports: the union of gradient rules, kernels and com.microsoft schemas, for
``gradgen ops``."""

from __future__ import annotations

from gradgen.grads import all_rules
from gradgen.kernels import all_kernels
from gradgen.kernels.registry import CUDA_STANDARD_FORMS
from gradgen.ops import schemas
from gradgen.ops.non_tensor import NON_TENSOR_OPS


def rewritten_ops() -> dict[tuple[str, str], str]:
    """(domain, op_type) -> what build-backward turns the op into before the gradient pass, for ops
    that have no rule of their own because no graph reaching the rules holds them."""
    from gradgen.passes.sequences import REWRITTEN_OPS
    from gradgen.passes.standard import MIN_OPSET, RETIRED_OPS

    rewritten = {
        ("", op_type): "the tensors it holds, where the model fixes the list's structure (passes/sequences.py)"
        for op_type in REWRITTEN_OPS
    }
    for op_type, successor in RETIRED_OPS.items():
        rewritten[("", op_type)] = f"{successor}: models below opset {MIN_OPSET} are converted (passes/standard.py)"
    return rewritten


SESSION_FORM = (
    "the tensors it holds, where the model fixes the list's structure: a Session rewrites a copy before it plans "
    "(passes/sequences.py)"
)


def supported_ops() -> list[dict]:
    """One row per (domain, op_type): gradient "yes"/"no"/"non-differentiable"/"rewritten" (with
    ``rewritten_to`` saying into what), cpu, cuda (the com.microsoft ops gradgen emits are listed
    from their schemas even without a kernel), ``cuda_form``: for an op a GPU Session runs as
    its standard-op form, which pass writes it and when (``registry.CUDA_STANDARD_FORMS``), and
    ``session_form``: for a sequence or optional op, which every Session (CPU and GPU) runs as the
    tensors it holds."""
    from gradgen.passes.sequences import REWRITTEN_OPS

    rewritten = rewritten_ops()
    rules = all_rules()
    kernels = all_kernels()
    declared = {(schemas.MICROSOFT_DOMAIN, op_type) for op_type in schemas.SCHEMAS}
    declared |= {("", op_type) for op_type in NON_TENSOR_OPS}  # refused: gradgen runs tensors only
    rows = []
    for domain, op_type in sorted(set(rules) | set(kernels) | declared | set(rewritten)):
        rule = rules.get((domain, op_type))
        kernel = kernels.get((domain, op_type))
        if rule is None:
            gradient = "rewritten" if (domain, op_type) in rewritten else "no"
        else:
            gradient = "yes" if rule.differentiable else "non-differentiable"
        rows.append(
            {
                "domain": domain or "ai.onnx",
                "op_type": op_type,
                "gradient": gradient,
                "rewritten_to": rewritten.get((domain, op_type)) if rule is None else None,
                "cpu": bool(kernel and kernel.cpu),
                "cuda": bool(kernel and kernel.cuda),
                "cuda_form": CUDA_STANDARD_FORMS.get((domain, op_type)),
                "session_form": SESSION_FORM if not domain and op_type in REWRITTEN_OPS else None,
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
