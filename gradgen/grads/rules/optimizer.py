"""Gradient rules: ONNX Runtime training's gradient-accumulation ops (the training graphs that
``gradgen artifacts`` writes and gradgen runs), marked non-differentiable with their reasons.

- ZeroGradient returns zeros of its input's shape whatever the input holds: a zero gradient by
  definition.
- InPlaceAccumulatorV2 writes its buffer input in place (ONNX Runtime aliases its output to it):
  its result is training state carried from one step to the next, not a function of one run's
  inputs, so a gradient through it has no meaning a finite difference could check. A loss that
  reads a gradient should read the gradient, not its accumulation buffer.
"""

from __future__ import annotations

from gradgen.builder import MICROSOFT
from gradgen.grads.table import non_differentiable

non_differentiable("ZeroGradient", "InPlaceAccumulatorV2", domain=MICROSOFT)
