"""Gradient rules: shape."""

from __future__ import annotations

from gradgen.grads.registry import grad_rule
