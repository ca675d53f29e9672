"""Passes over onnx_ir models. Each takes a model and returns an ``ir.passes.PassResult``;
compose them with ``Pipeline`` (an ``ir.passes.Sequential``) or ``ir.passes.PassManager``.
"""

import onnx_ir as ir

from gradgen.passes.autocast import AutocastPass
from gradgen.passes.control_flow import UnrollLoopsPass
from gradgen.passes.decompose import DecomposePass
from gradgen.passes.evaluate import EvaluateConstantsPass
from gradgen.passes.gelu_fusion import GeluFusionPass
from gradgen.passes.gradient import GradientPass, GradientSpec
from gradgen.passes.lowering import LowerToStandardPass
from gradgen.passes.recurrent import UnrollRecurrentPass
from gradgen.passes.sequences import SequencesAsTensorsPass
from gradgen.passes.standard import (
    CleanupPass,
    CommonSubexpressionEliminationPass,
    NameNodesPass,
    RemoveUnusedNodesPass,
    ShapeInferencePass,
    TopologicalSortPass,
    UpgradeOpsetPass,
)
from gradgen.passes.ties import TieEqualWeightsPass
from gradgen.passes.transpose_fusion import TransposeFusionPass

Pipeline = ir.passes.Sequential

# The names of the two passes EvaluateConstantsPass replaced (it folds shape arithmetic and inlines
# constant Ifs, to a fixed point); kept so that pipelines written against them still run.
FoldShapeArithmeticPass = EvaluateConstantsPass
InlineConstantIfPass = EvaluateConstantsPass

__all__ = [
    "AutocastPass",
    "CleanupPass",
    "CommonSubexpressionEliminationPass",
    "DecomposePass",
    "EvaluateConstantsPass",
    "GeluFusionPass",
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
    "TransposeFusionPass",
    "SequencesAsTensorsPass",
    "TieEqualWeightsPass",
    "UnrollLoopsPass",
    "UnrollRecurrentPass",
    "UpgradeOpsetPass",
]
