"""Lowering of BroadcastGradientArgs (the elementwise family: the reduction axes of a broadcasting
op's gradients) to standard ONNX ops."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder
from gradgen.errors import KernelError, ModelError
from gradgen.grads.rules.elementwise import gelu_slopes, tanh_gelu_logit
from gradgen.passes.lowering.table import CASTLIKE_OPSET, is_needed, node_input, node_where, register_lowering, zeros_opset


@register_lowering("BroadcastGradientArgs")
def lower_broadcast_gradient_args(e: GraphBuilder, node: ir.Node):
    """The axes each operand of a broadcasting op is reduced over, in descending order."""
    from gradgen.ops.elementwise import broadcast_gradient_axes

    a, b = node_input(node, 0), node_input(node, 1)
    if a is None or b is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs A, B")
    a_known, b_known = e.value_of(a), e.value_of(b)
    if a_known is not None and b_known is not None:
        try:
            a_axes, b_axes = broadcast_gradient_axes(a_known.reshape(-1).tolist(), b_known.reshape(-1).tolist())
        except KernelError as exc:
            raise ModelError(f"{node_where(node)}: {exc}") from None
        return [e.ints(a_axes), e.ints(b_axes)]
    a64, b64 = e.to_int64(a), e.to_int64(b)
    ra, rb = e.op("Shape", a64), e.op("Shape", b64)
    n = e.op("Max", ra, rb)
    one = ir.tensor(np.ones((1,), dtype=np.int64))
    lead_a, lead_b = e.op("Sub", n, ra), e.op("Sub", n, rb)
    a_full = e.op("Concat", e.op("ConstantOfShape", lead_a, value=one), a64, axis=0)
    b_full = e.op("Concat", e.op("ConstantOfShape", lead_b, value=one), b64, axis=0)
    # Output axes from the last to the first.
    k = e.op("Range", e.op("Sub", e.op("Reshape", n, e.ints([])), e.scalar(1)), e.scalar(-1), e.scalar(-1))
    a_dims, b_dims = e.op("Gather", a_full, k, axis=0), e.op("Gather", b_full, k, axis=0)
    a_one, b_one = e.op("Equal", a_dims, e.scalar(1)), e.op("Equal", b_dims, e.scalar(1))
    results: list[ir.Value | None] = [None, None]
    if is_needed(node.outputs[0] if node.outputs else None):
        take = e.op("Or", e.op("Less", k, lead_a), e.op("And", a_one, e.op("Not", b_one)))
        results[0] = e.op("Compress", k, take, axis=0)
    if len(node.outputs) > 1 and is_needed(node.outputs[1]):
        take = e.op("Or", e.op("Less", k, lead_b), e.op("And", b_one, e.op("Not", a_one)))
        results[1] = e.op("Compress", k, take, axis=0)
    return results


@register_lowering("ReluGrad", min_opset=lambda node: max(zeros_opset(0)(node), zeros_opset(1)(node)))
def lower_relu_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY where X > 0, else 0."""
    dy, x = node_input(node, 0), node_input(node, 1)
    if dy is None or x is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, X")
    return [e.op("Where", e.op("Greater", x, _zero_like(e, x)), dy, _zero_like(e, dy))]


def _zero_like(e: GraphBuilder, v: ir.Value) -> ir.Value:
    """A scalar 0 of v's type: a constant where the type is known, else ConstantOfShape(like v)."""
    return e.const_like(v, 0.0) if v.dtype is not None else e.zeros(e.ints([]), v)


def _dy_and_y(node: ir.Node) -> tuple[ir.Value, ir.Value]:
    dy, y = node_input(node, 0), node_input(node, 1)
    if dy is None or y is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, Y")
    return dy, y


def _one_like(e: GraphBuilder, y: ir.Value) -> ir.Value:
    """1 in Y's type (CastLike where that type is unknown: the lowerings' min_opset, zeros_opset(1))."""
    return e.const_like(y, 1.0) if y.dtype is not None else e.op("CastLike", e.const(np.array(1.0, np.float32)), y)


@register_lowering("SigmoidGrad", min_opset=zeros_opset(1))
def lower_sigmoid_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY * Y * (1 - Y), Y Sigmoid's output."""
    dy, y = _dy_and_y(node)
    return [e.op("Mul", e.op("Mul", dy, y), e.op("Sub", _one_like(e, y), y))]


@register_lowering("TanhGrad", min_opset=zeros_opset(1))
def lower_tanh_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY * (1 - Y * Y), Y Tanh's output."""
    dy, y = _dy_and_y(node)
    return [e.op("Mul", dy, e.op("Sub", _one_like(e, y), e.op("Mul", y, y)))]


def _lower_gelu_grad(e: GraphBuilder, node: ir.Node):
    """dX = dY Gelu'(X [+ B]): the derivative the Gelu rule spells (gradgen.grads.rules.elementwise)."""
    biased = node.op_type.startswith("Bias")
    dy, x = node_input(node, 0), node_input(node, 1)
    bias = node_input(node, 2) if biased else None
    if dy is None or x is None or (biased and bias is None):
        raise ModelError(f"{node_where(node)} lacks one of its inputs dY, X{', B' if biased else ''}")
    z = e.op("Add", x, bias) if bias is not None else x
    return [e.op("Mul", dy, gelu_slopes(e, z, "Fast" in node.op_type, x)[0])]


for _op_type in ("GeluGrad", "FastGeluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX"):
    register_lowering(_op_type)(_lower_gelu_grad)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime's transformer activations and BiasDropout (forward ops): their standard-op forms,
# which are also what DecomposePass differentiates (gradgen/kernels/cpu/elementwise.py has their
# kernels and schemas)


def _required(node: ir.Node, *positions: int) -> list[ir.Value]:
    values = [node_input(node, i) for i in positions]
    if any(v is None for v in values):
        raise ModelError(f"{node_where(node)} lacks one of its required inputs")
    return values  # type: ignore[return-value]


def _biased_input(e: GraphBuilder, node: ir.Node) -> ir.Value:
    """X [+ bias]: the second input, where present, is a bias over the last axis."""
    (x,) = _required(node, 0)
    bias = node_input(node, 1)
    return e.op("Add", x, bias) if bias is not None else x


def _exact_gelu(e: GraphBuilder, z: ir.Value, like: ir.Value) -> ir.Value:
    """z Phi(z) = z / 2 (1 + erf(z / sqrt 2)), constants in like's type."""
    cdf = e.op("Add", e.op("Erf", e.op("Mul", z, e.const_like(like, 1.0 / np.sqrt(2.0)))), e.const_like(like, 1.0))
    return e.op("Mul", e.op("Mul", z, e.const_like(like, 0.5)), cdf)


@register_lowering("Gelu")
@register_lowering("BiasGelu")
def lower_gelu(e: GraphBuilder, node: ir.Node):
    """Y = Gelu(X) or Gelu(A + B), the exact (erf) one."""
    if node.op_type == "BiasGelu":
        _required(node, 0, 1)
    return [_exact_gelu(e, _biased_input(e, node), _required(node, 0)[0])]


@register_lowering("FastGelu")
def lower_fast_gelu(e: GraphBuilder, node: ir.Node):
    """Y = z / 2 (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3))), z = X [+ bias], written as z S(v),
    S the sigmoid, v = 2 sqrt(2 / pi) (z + 0.044715 z^3) (``tanh_gelu_logit``)."""
    z, like = _biased_input(e, node), _required(node, 0)[0]
    return [e.op("Mul", z, e.op("Sigmoid", tanh_gelu_logit(e, z, e.op("Mul", z, z), like)))]


@register_lowering("QuickGelu")
def lower_quick_gelu(e: GraphBuilder, node: ir.Node):
    """Y = X Sigmoid(alpha X)."""
    (x,) = _required(node, 0)
    alpha = node.attributes["alpha"].value if "alpha" in node.attributes else 1.702
    return [e.op("Mul", x, e.op("Sigmoid", e.op("Mul", x, e.const_like(x, float(alpha)))))]


@register_lowering("BiasDropout")
def lower_bias_dropout(e: GraphBuilder, node: ir.Node):
    """Inference form: data + bias [+ residual], and an all-true mask. Training mode with ratio
    > 0 (or not known before running) is refused: its random mask is not this form."""
    from gradgen.kernels.cpu.elementwise import bias_dropout_is_training

    data, bias = _required(node, 0, 1)
    residual, ratio, training = (node_input(node, i) for i in (2, 3, 4))
    training_value = e.value_of(training) if training is not None else None
    ratio_value = e.value_of(ratio) if ratio is not None else None
    unknown = training is not None and (training_value is None or (ratio is not None and ratio_value is None))
    if unknown or bias_dropout_is_training(ratio_value, training_value):
        raise ModelError(
            f"{node_where(node)}: BiasDropout in training mode with ratio > 0 (or training_mode / ratio not "
            "constant) is not supported; gradgen runs it in inference mode only (a seeded dropout mask is not implemented)"
        )
    y = e.op("Add", data, bias)
    if residual is not None:
        y = e.op("Add", y, residual)
    mask = None
    if len(node.outputs) > 1 and is_needed(node.outputs[1]):
        mask = e.op("ConstantOfShape", e.shape_of(data), value=ir.tensor(np.array([True])))
    return [y, mask]


@register_lowering("Scale", min_opset=lambda node: CASTLIKE_OPSET)
def lower_scale(e: GraphBuilder, node: ir.Node):
    """output = input * scale, or with scale_down=1 input * (1 / scale), the reciprocal taken in
    float32 as ONNX Runtime's kernel takes it; the factor in the input's type."""
    x, factor = node_input(node, 0), node_input(node, 1)
    if x is None or factor is None:
        raise ModelError(f"{node_where(node)} lacks one of its inputs input, scale")
    down = node.attributes.get("scale_down")
    if down is not None and int(down.value):
        factor = e.op("Div", e.const(np.array(1.0, np.float32)), e.op("Cast", factor, to=ir.DataType.FLOAT))
    return [e.op("Mul", x, e.reshape(e.op("CastLike", factor, x), []))]
