"""Coverage meta-tests: an op with a gradient rule is either whole or these fail, naming what is missing.

For every differentiable rule: a finite-difference case (tests/test_grad_rules.py's
``test_every_rule_has_a_case``); a CPU kernel for the op and for every op its rule emits; a CUDA
launcher for each of those or a fallback declared in ``gradgen.kernels.registry.CUDA_FALLBACKS`` and
run on the GPU by tests/cuda/test_cuda_fallbacks.py; for an emitted com.microsoft op, a schema, a
CPU kernel taking the schema's inputs, and a lowering to standard ONNX; and the op's kernels in the
files of the rule's family.

The ops a rule emits are found two ways, both cheap: its backward graph built for its first
finite-difference case (static and symbolic shapes), and a scan of the rule modules and the graph
builder for the op names they pass to ``op``, ``op_multi`` and ``reduce`` (branches the cases do
not take).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import gradgen
from gradgen.grads.registry import all_rules
from gradgen.kernels.registry import CUDA_FALLBACKS, CUDA_STANDARD_FORMS, all_kernels
from gradgen.ops import schemas
from gradgen.passes.lowering import lookup_lowering
from tests.gradcheck import case_model
from tests.test_grad_rules import CASES

ROOT = Path(__file__).resolve().parents[1]
EMITTING_SOURCES = sorted((ROOT / "gradgen" / "grads" / "rules").glob("*.py")) + [ROOT / "gradgen" / "builder.py"]


def _domain(node: ast.Call) -> str:
    for keyword in node.keywords:
        if keyword.arg == "domain":
            value = keyword.value
            if isinstance(value, ast.Name) and value.id == "MICROSOFT":
                return schemas.MICROSOFT_DOMAIN
            if isinstance(value, ast.Constant):
                return schemas.normalize_domain(value.value)
            return "?"
    return ""


def scanned_ops(path: Path) -> dict[tuple[str, str], str]:
    """(domain, op) -> where, for every literal op name ``path`` passes to op / op_multi / reduce."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("op", "op_multi", "reduce")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.setdefault((_domain(node), node.args[0].value), f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def built_ops() -> dict[tuple[str, str], str]:
    """(domain, op) -> the rule's op, for every node of the backward graphs of each rule's first case."""
    found, seen = {}, set()
    for case in CASES:
        key = (schemas.normalize_domain(case.domain), case.op_type)
        if key in seen:
            continue
        seen.add(key)
        for symbolic in (False, True) if case.symbolic else (False,):
            try:
                model, _, wrt = case_model(case, symbolic=symbolic)
                graph = gradgen.build_backward(model, wrt=wrt).model.graph
            except gradgen.GradgenError:
                continue  # a missing kernel or rule: the tests below name it
            for node in graph:
                if node.op_type == "Constant" and not node.domain:
                    continue  # a Session evaluates Constant nodes when it plans the graph, on either device
                found.setdefault((schemas.normalize_domain(node.domain), node.op_type), case.op_type)
    return found


RULES = all_rules()
KERNELS = all_kernels()
SCANNED = {k: v for p in EMITTING_SOURCES for k, v in scanned_ops(p).items()}
BUILT = built_ops()
# every op a gradient graph can hold: the differentiable ops, and what their rules emit
NEEDED = {
    **{k: "a gradient rule" for k, r in RULES.items() if r.differentiable},
    **{k: f"emitted at {v}" for k, v in SCANNED.items()},
    **{k: f"in the backward graph of {v}" for k, v in BUILT.items()},
}


def test_the_scan_finds_what_rules_emit():
    assert ("com.microsoft", "SliceGrad") in SCANNED and ("", "ReduceSum") in SCANNED
    assert ("com.microsoft", "BroadcastGradientArgs") in BUILT  # from a symbolic-shape case
    assert not [k for k in SCANNED if k[0] == "?"], "an op emitted in a domain the scan cannot tell"


def test_every_op_of_a_gradient_graph_has_a_cpu_kernel():
    missing = sorted(
        f"{d or 'ai.onnx'}::{op} ({why})"
        for (d, op), why in NEEDED.items()
        if KERNELS.get((d, op)) is None or KERNELS[(d, op)].cpu is None
    )
    assert not missing, f"ops without a CPU kernel: {missing}"


def test_every_op_of_a_gradient_graph_has_a_cuda_kernel_or_a_declared_fallback():
    missing = sorted(
        f"{d or 'ai.onnx'}::{op} ({why})"
        for (d, op), why in NEEDED.items()
        if (KERNELS.get((d, op)) is None or KERNELS[(d, op)].cuda is None)
        and (d, op) not in CUDA_FALLBACKS
        and (d, op) not in CUDA_STANDARD_FORMS
    )
    assert not missing, (
        "ops without a CUDA launcher: write one, or declare the fallback in "
        f"gradgen.kernels.registry.CUDA_FALLBACKS and run it in tests/cuda/test_cuda_fallbacks.py: {missing}"
    )


def test_declared_fallbacks_are_current_and_run_on_the_gpu():
    from tests.cuda.test_cuda_fallbacks import MODELS

    stale = sorted(op for (d, op) in CUDA_FALLBACKS if KERNELS.get((d, op)) is not None and KERNELS[(d, op)].cuda)
    assert not stale, f"declared CUDA fallbacks that have a CUDA launcher now: {stale}"
    untested = sorted(op for (d, op) in CUDA_FALLBACKS if op not in MODELS)
    assert not untested, f"declared CUDA fallbacks without a GPU test in tests/cuda/test_cuda_fallbacks.py: {untested}"


def test_every_emitted_microsoft_op_has_a_schema_a_matching_cpu_kernel_and_a_lowering():
    problems = []
    for (domain, op), why in sorted(NEEDED.items()):
        if domain != schemas.MICROSOFT_DOMAIN:
            continue
        if op not in schemas.SCHEMAS:
            problems.append(f"{op} ({why}): no schema (schemas.declare next to its CPU kernel)")
            continue
        if lookup_lowering(domain, op) is None:
            problems.append(f"{op} ({why}): no lowering in gradgen/passes/lowering")
        kernel = KERNELS.get((domain, op))
        if kernel is not None and kernel.cpu is not None:
            positional = [
                p
                for p in inspect.signature(kernel.cpu).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            if len(positional) != len(schemas.SCHEMAS[op].inputs):
                problems.append(
                    f"{op}: the CPU kernel takes {len(positional)} inputs, the schema {len(schemas.SCHEMAS[op].inputs)}"
                )
    assert not problems, problems


def test_an_ops_kernels_live_in_its_rules_family():
    """The file that holds an op's kernels is named after its rule's family, in every tree."""
    misplaced = []
    for key, rule in sorted(RULES.items()):
        entry = KERNELS.get(key)
        if entry is None:
            continue
        for device, fn in (("cpu", entry.cpu), ("cuda", entry.cuda)):
            if fn is not None and fn.__module__.rsplit(".", 1)[-1] != rule.family:
                misplaced.append(f"{key[1]}: rule in {rule.family}, {device} kernel in {fn.__module__}")
    assert not misplaced, misplaced


@pytest.mark.parametrize("op", sorted(schemas.SCHEMAS))
def test_every_schema_names_a_lowered_op_with_a_cpu_kernel(op):
    assert lookup_lowering(schemas.MICROSOFT_DOMAIN, op) is not None
    assert KERNELS[(schemas.MICROSOFT_DOMAIN, op)].cpu is not None


def _float_typed_standard_ops(max_opset: int = 23) -> set[str]:
    """The standard ONNX ops up to ``max_opset`` with a float, double, float16 or bfloat16 tensor among
    their inputs' or outputs' types."""
    import onnx.defs

    floats = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}
    names = set()
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain or schema.since_version > max_opset or schema.deprecated:
            continue
        types = {t for c in schema.type_constraints for t in c.allowed_type_strs}
        types |= {f.type_str for f in [*schema.inputs, *schema.outputs]}
        if types & floats:
            names.add(schema.name)
    return names


def test_every_standard_float_op_has_a_rule_and_runs_on_the_gpu():
    """Issue-level coverage: every standard op up to opset 23 that reads or writes floats has a
    gradient rule, a non-differentiable mark or a rewrite, and a CUDA launcher or a form a GPU
    session runs; every com.microsoft op gradgen knows has a CPU kernel and a GPU path."""
    from gradgen.support import supported_ops

    rows = {(r["domain"], r["op_type"]): r for r in supported_ops()}

    def on_the_gpu(row) -> bool:
        return bool(row["cuda"] or row["cuda_form"] or row["session_form"])

    ops = _float_typed_standard_ops()
    assert len(ops) > 150  # the schema walk found the op set
    standard = [rows.get(("ai.onnx", op)) for op in sorted(ops)]
    missing = [op for op, row in zip(sorted(ops), standard) if row is None or row["gradient"] == "no" or not on_the_gpu(row)]
    assert not missing, f"standard float ops without a rule or a GPU path: {missing}"
    microsoft = [rows[(schemas.MICROSOFT_DOMAIN, op)] for op in sorted(schemas.SCHEMAS)]
    lacking = [row["op_type"] for row in microsoft if not (row["cpu"] and on_the_gpu(row))]
    assert not lacking, f"com.microsoft ops without a CPU kernel and a GPU path: {lacking}"
