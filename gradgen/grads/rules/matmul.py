"""Gradient rules: MatMul and Gemm."""

from __future__ import annotations

from gradgen.grads.registry import grad_rule
