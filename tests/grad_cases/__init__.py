"""Finite-difference cases for the gradient rules, one module per family.

Each module defines ``CASES``: a list of ``tests.gradcheck.GradCase``. Every registered gradient
rule must have at least one case (tests/test_grad_rules.py enforces it).
"""
