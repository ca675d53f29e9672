"""Every gradient rule against central finite differences in float64 (static and symbolic shapes)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.grad_cases as grad_cases
from gradgen.grads import all_rules
from tests.gradcheck import GradCase, check_case


def _all_cases() -> list[GradCase]:
    cases = []
    for info in pkgutil.iter_modules(grad_cases.__path__):
        module = importlib.import_module(f"tests.grad_cases.{info.name}")
        cases.extend(module.CASES)
    return cases


CASES = _all_cases()
_PARAMS = [pytest.param(c, False, id=f"{c.id}-static") for c in CASES]
_PARAMS += [pytest.param(c, True, id=f"{c.id}-symbolic") for c in CASES if c.symbolic]


@pytest.mark.parametrize("case,symbolic", _PARAMS)
def test_rule_matches_finite_differences(case: GradCase, symbolic: bool):
    check_case(case, symbolic=symbolic)


def test_every_rule_has_a_case():
    covered = {(c.domain if c.domain not in ("", "ai.onnx") else "", c.op_type) for c in CASES}
    rules = {key for key, rule in all_rules().items() if rule.differentiable}
    # If, Loop and Scan hold subgraphs, which a one-node case cannot: tests/test_control_flow.py
    # checks their gradients against finite differences on whole models
    covered |= {("", "If"), ("", "Loop"), ("", "Scan")}
    # DynamicQuantizeLinear's rule always refuses (no gradient to check): tests/test_non_tensor_ops.py
    covered |= {("", "DynamicQuantizeLinear")}
    # QuantizeLinear's integer output carries none, and its rule refuses: tests/test_quantize.py
    covered |= {("", "QuantizeLinear")}
    missing = sorted(rules - covered)
    assert not missing, f"gradient rules without a finite-difference case: {missing}"
