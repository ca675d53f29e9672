"""Gradient rules: ops whose outputs never carry a gradient.

Integer or bool outputs (shapes, comparisons, logic, indices, bit operations), values that depend
only on a shape (ConstantOfShape, EyeLike) and random samples. Deliberately absent:
- Range: with float start/delta its output is differentiable in them;
- OneHot: its float ``values`` input (off/on) carries a gradient;
- Mod: float Mod (fmod=1) is differentiable, see elementwise.py (integer Mod never reaches a rule).
"""

from __future__ import annotations

from gradgen.grads.registry import non_differentiable

non_differentiable(
    # shapes and sizes
    "Shape", "Size", "ConstantOfShape", "EyeLike",
    # comparisons and logic (bool outputs)
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "IsNaN", "IsInf",
    # indices
    "ArgMax", "ArgMin", "NonZero",
    # random numbers
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
    # integer bit operations
    "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseNot", "BitwiseXor",
)
