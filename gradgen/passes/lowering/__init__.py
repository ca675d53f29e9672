"""LowerToStandardPass: rewrite the com.microsoft gradient ops into standard ONNX ops.

A backward graph built by gradgen (or by ONNX Runtime training) holds a few ops of the
``com.microsoft`` domain that stock ONNX runtimes do not have. This pass replaces each of them by
standard ONNX ops with the same meaning, so the graph runs anywhere ONNX runs:

- SliceGrad          -> Pad (constant starts/ends/axes, steps 1, known sliced dims), else
                        ScatterElements of dY into zeros at the flat positions a Slice of an
                        index grid picks (any steps, negative ones included).
- GatherGrad         -> ScatterND(reduction="add") of dY's rows into zeros, the indexed axis moved
                        first; negative indices normalised first, repeated ones accumulate.
- GatherElementsGrad -> ScatterElements(reduction="add") into zeros, indices normalised first.
- ConvGrad           -> dX: ConvTranspose; dW: Conv of X by dY with batch and channels swapped
                        (strides and dilations swapped, groups through a reshape), cropped to the
                        kernel; dB: ReduceSum over every axis but 1. auto_pad becomes explicit pads.
- BroadcastGradientArgs -> constant axes when both shapes are known, else shape arithmetic
                        (Concat, Equal, Less, Compress), axes in descending order.
- FusedMatMul        -> Transpose of each flagged operand, MatMul, Mul by alpha (when not 1).
- ReluGrad, SigmoidGrad, TanhGrad, GeluGrad, FastGeluGrad, BiasGeluGrad_dX, BiasFastGeluGrad_dX,
  SoftmaxGrad_13, LogSoftmaxGrad_13 (ONNX Runtime training's, which gradgen runs and differentiates)
                     -> their formulas in Where, Mul, Sub, Exp, Erf, Tanh and ReduceSum.

Lowerings live in a table keyed by (domain, op_type) (``register_lowering``), one module per op
family: shape.py (SliceGrad), indexing.py (GatherGrad, GatherElementsGrad), conv.py (ConvGrad),
elementwise.py (BroadcastGradientArgs and the activation gradients), matmul.py (FusedMatMul),
reduction.py (SoftmaxGrad_13, LogSoftmaxGrad_13); the table in table.py, the pass and the splicing in core.py;
lowerings build with gradgen.builder.GraphBuilder. The scatters with reduction="add" need opset 16:
a model below the opset its lowerings need is converted with ONNX's version converter to exactly
that opset (the smallest that works) before lowering; a model at or above it keeps its opset, so no
existing node changes meaning. The pass keeps the graph's inputs and outputs (names and types).
"""

from gradgen.passes.lowering.core import FAMILIES, LowerToStandardPass, lookup_lowering, lowerable_ops
from gradgen.passes.lowering.table import Lowering, register_lowering

__all__ = ["FAMILIES", "LowerToStandardPass", "Lowering", "lookup_lowering", "lowerable_ops", "register_lowering"]
