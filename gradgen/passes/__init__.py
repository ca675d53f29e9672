"""Passes over onnx_ir models. Each takes a model and returns an ``ir.passes.PassResult``;
compose them with ``Pipeline`` (an ``ir.passes.Sequential``) or ``ir.passes.PassManager``.
"""

import onnx_ir as ir

from gradgen.passes.gradient import GradientPass, GradientSpec
from gradgen.passes.lowering import LowerToStandardPass
from gradgen.passes.standard import (
    CleanupPass,
    CommonSubexpressionEliminationPass,
    FoldShapeArithmeticPass,
    InlineConstantIfPass,
    NameNodesPass,
    RemoveUnusedNodesPass,
    ShapeInferencePass,
    TopologicalSortPass,
    UpgradeOpsetPass,
)

Pipeline = ir.passes.Sequential

__all__ = [
    "CleanupPass",
    "CommonSubexpressionEliminationPass",
    "FoldShapeArithmeticPass",
    "InlineConstantIfPass",
    "GradientPass",
    "GradientSpec",
    "LowerToStandardPass",
    "NameNodesPass",
    "Pipeline",
    "RemoveUnusedNodesPass",
    "ShapeInferencePass",
    "TopologicalSortPass",
    "UpgradeOpsetPass",
]
