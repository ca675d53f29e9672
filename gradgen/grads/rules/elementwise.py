"""Gradient rules: elementwise ops. Broadcasting ops return output-shaped gradients (broadcast=True).

Conventions:
- Kinks take the subgradient PyTorch takes: LeakyRelu/PRelu/Elu/Selu take the negative branch's
  slope at 0 (PyTorch's backward kernels test x > 0: leaky_relu 0 -> negative_slope, prelu ->
  weight, elu -> alpha); Relu/Celu/ThresholdedRelu use the branch the forward op uses there; Abs
  gives 0 at 0 (Sign); Clip passes the gradient at the bounds (min <= x <= max).
- Max/Min (variadic): the gradient is split evenly among the inputs equal to the output (a tie of
  k inputs gives each dY / k). This is PyTorch's choice for maximum/minimum, a valid subgradient,
  and for a tie of two it equals the central difference.
- Pow differentiates both the base (dY * B * A^(B-1)) and the exponent (dY * Y * ln(A) where A > 0,
  0 elsewhere: a real power of a non-positive base has no derivative in the exponent).
- Floor, Ceil, Round, Sign have zero gradient almost everywhere: emitted as zeros.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from gradgen.builder import MICROSOFT
from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule, non_differentiable
from gradgen.ops.elementwise import TANH_GELU_CUBIC, TANH_GELU_SCALE


def _mul(g, *factors):
    out = factors[0]
    for f in factors[1:]:
        out = g.op("Mul", out, f)
    return out


def _c(g, like, value):
    return g.const_like(like, value)


def _mask(g, cond, dy, other=None):
    """Where(cond, dy, other or 0); dy has the type of the node's first output."""
    return g.op("Where", cond, dy, other if other is not None else _c(g, g.y(), 0.0))


def _unary(op_type):
    """Register a one-input rule given as ``fn(g, x, y, dy) -> dx``."""

    def register(fn):
        @grad_rule(op_type)
        def rule(g):
            return [fn(g, g.x(0), g.y(), g.dy())] if g.needs(0) else [None]

        return fn

    return register


def _same_type(g, value, like, value_type=None):
    """value cast to like's element type when the two differ (value_type: a value typed like value)."""
    return value if (value_type or value).dtype == like.dtype else g.cast_like(value, like)


# -- arithmetic --------------------------------------------------------------------------------


@grad_rule("Add", broadcast=True)
def add(g):
    return [g.dy(), g.dy()]


@grad_rule("Sub", broadcast=True)
def sub(g):
    return [g.dy(), g.op("Neg", g.dy()) if g.needs(1) else None]


@grad_rule("Mul", broadcast=True)
def mul(g):
    a, b = g.x(0), g.x(1)
    return [g.op("Mul", g.dy(), b) if g.needs(0) else None, g.op("Mul", g.dy(), a) if g.needs(1) else None]


@grad_rule("Div", broadcast=True)
def div(g):
    # dA = dY / B; dB = -dY * A / B^2 = -dY * Y / B
    b, dy = g.x(1), g.dy()
    da = g.op("Div", dy, b) if g.needs(0) else None
    db = g.op("Neg", g.op("Div", g.op("Mul", dy, g.y()), b)) if g.needs(1) else None
    return [da, db]


@grad_rule("Pow", broadcast=True)
def pow_(g):
    a, b, y, dy = g.x(0), g.x(1), g.y(), g.dy()
    da = db = None
    if g.needs(0):
        # A constant exponent (not trained, not overridable) gets a simpler formula.
        c = None if g.needs(1) or b.is_graph_input() else g.input_const(1)
        if c is not None and c.size == 1:
            c = float(np.asarray(c).reshape(()))
            if c == 1.0:
                da = dy
            elif c == 2.0:
                da = _mul(g, dy, a, _c(g, a, 2.0))
            elif c == 0.5:
                da = g.op("Div", _mul(g, dy, _c(g, a, 0.5)), y)  # 0.5 / sqrt(a)
            else:
                da = _mul(g, dy, _c(g, a, c), g.op("Pow", a, _c(g, a, c - 1.0)))
        else:
            bf = _same_type(g, b, a)
            da = _mul(g, dy, bf, g.op("Pow", a, g.op("Sub", bf, _c(g, a, 1.0))))
    if g.needs(1):
        positive = g.op("Greater", a, _c(g, a, 0.0))
        safe_a = g.op("Where", positive, a, _c(g, a, 1.0))
        db = _mask(g, positive, _mul(g, dy, y, g.op("Log", safe_a)))
        db = _same_type(g, db, b, value_type=a)
    return [da, db]


@grad_rule("Mod", broadcast=True)
def mod(g):
    """Float Mod: Y = A - B * trunc(A / B) with fmod=1, A - B * floor(A / B) with fmod=0 (floats
    allowed since opset 28), so dY/dB is minus the rounded quotient. Integer Mod carries no gradient."""
    a, b, dy = g.x(0), g.x(1), g.dy()
    db = None
    if g.needs(1):
        q = g.op("Div", a, b)
        if int(g.attr("fmod", 0)):
            rounded = g.op("Mul", g.op("Sign", q), g.op("Floor", g.op("Abs", q)))
        else:
            rounded = g.op("Floor", q)
        db = g.op("Neg", g.op("Mul", dy, rounded))
    return [dy if g.needs(0) else None, db]


@_unary("Neg")
def neg(g, x, y, dy):
    return g.op("Neg", dy)


@_unary("Abs")
def abs_(g, x, y, dy):
    return g.op("Mul", dy, g.op("Sign", x))


@_unary("Sqrt")
def sqrt(g, x, y, dy):
    return g.op("Div", g.op("Mul", dy, _c(g, x, 0.5)), y)


@_unary("Reciprocal")
def reciprocal(g, x, y, dy):
    return g.op("Neg", _mul(g, dy, y, y))


@_unary("Exp")
def exp(g, x, y, dy):
    return g.op("Mul", dy, y)


@_unary("Log")
def log(g, x, y, dy):
    return g.op("Div", dy, x)


# -- activations ---------------------------------------------------------------------------------


@_unary("Tanh")
def tanh(g, x, y, dy):
    return g.op("Mul", dy, g.op("Sub", _c(g, x, 1.0), g.op("Mul", y, y)))


@_unary("Sigmoid")
def sigmoid(g, x, y, dy):
    return _mul(g, dy, y, g.op("Sub", _c(g, x, 1.0), y))


# The types ONNX Runtime training's CPU ReluGrad kernel takes (float64 keeps the standard form, so
# backward graphs stay loadable there, as for LayerNormalizationGrad)
_FUSED_RELU_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


@_unary("Relu")
def relu(g, x, y, dy):
    """One com.microsoft ReluGrad(dY, Y) node where its kernels take the type (--portable lowers it
    to Where(Greater)): Y > 0 exactly where X > 0 (NaN neither), and Y, which the next layer's
    gradient usually keeps anyway, lets X go early (ONNX Runtime training passes Y too)."""
    if x.dtype in _FUSED_RELU_TYPES:
        return g.set_type_like(g.op("ReluGrad", dy, y, domain=MICROSOFT), x)
    return _mask(g, g.op("Greater", x, _c(g, x, 0.0)), dy)


@_unary("LeakyRelu")
def leaky_relu(g, x, y, dy):
    alpha = g.attr("alpha", 0.01)
    # negative_slope at 0, as PyTorch's leaky_relu_backward (x > 0 ? dy : dy * alpha)
    return _mask(g, g.op("Greater", x, _c(g, x, 0.0)), dy, g.op("Mul", dy, _c(g, x, alpha)))


@_unary("ThresholdedRelu")
def thresholded_relu(g, x, y, dy):
    return _mask(g, g.op("Greater", x, _c(g, x, g.attr("alpha", 1.0))), dy)


@_unary("Shrink")
def shrink(g, x, y, dy):
    # slope 1 outside [-lambd, lambd], 0 inside (bias only shifts the value)
    lambd = g.attr("lambd", 0.5)
    outside = g.op("Or", g.op("Less", x, _c(g, x, -lambd)), g.op("Greater", x, _c(g, x, lambd)))
    return _mask(g, outside, dy)


@_unary("Elu")
def elu(g, x, y, dy):
    # x < 0: alpha * (e^x - 1), derivative y + alpha
    alpha = g.attr("alpha", 1.0)
    neg_branch = g.op("Mul", dy, g.op("Add", y, _c(g, x, alpha)))
    # alpha at 0 (y = 0 there), as PyTorch's elu_backward (x <= 0: negative branch)
    return _mask(g, g.op("Greater", x, _c(g, x, 0.0)), dy, neg_branch)


@_unary("Selu")
def selu(g, x, y, dy):
    # x > 0: gamma * x; else gamma * alpha * (e^x - 1), derivative y + gamma * alpha
    alpha = g.attr("alpha", 1.67326319217681884765625)
    gamma = g.attr("gamma", 1.05070102214813232421875)
    neg_branch = g.op("Mul", dy, g.op("Add", y, _c(g, x, gamma * alpha)))
    return _mask(g, g.op("Greater", x, _c(g, x, 0.0)), g.op("Mul", dy, _c(g, x, gamma)), neg_branch)


@_unary("Celu")
def celu(g, x, y, dy):
    # x > 0: x; else alpha * (exp(x / alpha) - 1), derivative exp(x / alpha)
    alpha = g.attr("alpha", 1.0)
    e = g.op("Exp", g.op("Div", g.op("Min", x, _c(g, x, 0.0)), _c(g, x, alpha)))
    return _mask(g, g.op("Greater", x, _c(g, x, 0.0)), dy, g.op("Mul", dy, e))


@_unary("Softplus")
def softplus(g, x, y, dy):
    return g.op("Mul", dy, g.op("Sigmoid", x))


@_unary("Softsign")
def softsign(g, x, y, dy):
    d = g.op("Add", _c(g, x, 1.0), g.op("Abs", x))
    return g.op("Div", dy, g.op("Mul", d, d))


@_unary("HardSigmoid")
def hard_sigmoid(g, x, y, dy):
    alpha, beta = g.attr("alpha", 0.2), g.attr("beta", 0.5)
    z = g.op("Add", g.op("Mul", x, _c(g, x, alpha)), _c(g, x, beta))
    inside = g.op("And", g.op("Greater", z, _c(g, x, 0.0)), g.op("Less", z, _c(g, x, 1.0)))
    return _mask(g, inside, g.op("Mul", dy, _c(g, x, alpha)))


@_unary("HardSwish")
def hard_swish(g, x, y, dy):
    # y = x * HardSigmoid(x; 1/6, 1/2): dy/dx = 0 (x <= -3), (2x + 3) / 6 (-3 < x < 3), 1 (x >= 3)
    inside = g.op("And", g.op("Greater", x, _c(g, x, -3.0)), g.op("Less", x, _c(g, x, 3.0)))
    slope = g.op("Add", g.op("Mul", x, _c(g, x, 1.0 / 3.0)), _c(g, x, 0.5))
    d = g.op("Where", inside, slope, g.op("Where", g.op("Less", x, _c(g, x, 0.0)), _c(g, x, 0.0), _c(g, x, 1.0)))
    return g.op("Mul", dy, d)


@_unary("Mish")
def mish(g, x, y, dy):
    # y = x * tanh(sp(x)): dy/dx = t + x * (1 - t^2) * sigmoid(x)
    t = g.op("Tanh", g.op("Softplus", x))
    d = g.op("Add", t, _mul(g, x, g.op("Sub", _c(g, x, 1.0), g.op("Mul", t, t)), g.op("Sigmoid", x)))
    return g.op("Mul", dy, d)


@_unary("Swish")
def swish(g, x, y, dy):
    # y = x * s, s = sigmoid(alpha * x): dy/dx = s + alpha * x * s * (1 - s) = s + alpha * y * (1 - s)
    alpha = g.attr("alpha", 1.0)
    s = g.op("Sigmoid", g.op("Mul", x, _c(g, x, alpha)))
    d = g.op("Add", s, _mul(g, _c(g, x, alpha), y, g.op("Sub", _c(g, x, 1.0), s)))
    return g.op("Mul", dy, d)


@_unary("Gelu")
def gelu(g, x, y, dy):
    tanh = g.attr("approximate", "none") == "tanh"
    if x.dtype == ir.DataType.FLOAT:  # one fused node (ONNX Runtime training's op; --portable lowers it)
        return gelu_grad_op(g, dy, x, tanh)
    return g.op("Mul", dy, gelu_slopes(g, x, tanh, x)[0])


def tanh_gelu_logit(g, x, x2, like):
    """v = 2 k (x + c x^3) (k, c: ``TANH_GELU_SCALE``, ``TANH_GELU_CUBIC``): the tanh Gelu is
    x S(v), S the sigmoid. ``x2`` is x * x; ``g`` a rule context or a GraphBuilder (the lowering
    of FastGelu)."""
    return g.op(
        "Mul",
        g.op("Add", g.op("Mul", x2, _c(g, like, 2.0 * TANH_GELU_CUBIC * TANH_GELU_SCALE)), _c(g, like, 2.0 * TANH_GELU_SCALE)),
        x,
    )


def gelu_slopes(g, x, tanh: bool, like, second: bool = False):
    """(Gelu'(x), Gelu''(x) or None) in standard ops, constants in like's type: the exact Gelu
    y = x Phi(x) (Phi' = phi, phi' = -x phi), or the tanh one y = x/2 (1 + tanh(u)), u = k (x + 0.044715 x^3),
    k = sqrt(2 / pi), written as y = x S(v), S the sigmoid, v = 2u (1/2 (1 + tanh u) = S(2u): a
    Sigmoid is cheaper than a Tanh on CPUs, and no cancellation where tanh(u) nears -1)."""
    x2 = g.op("Mul", x, x)
    if tanh:
        v = tanh_gelu_logit(g, x, x2, like)
        s = g.op("Sigmoid", v)
        dv = g.op(
            "Add", g.op("Mul", x2, _c(g, like, 6.0 * TANH_GELU_CUBIC * TANH_GELU_SCALE)), _c(g, like, 2.0 * TANH_GELU_SCALE)
        )  # v'
        one_minus_s = g.op("Sigmoid", g.op("Neg", v))  # S(-v): 1 - S(v) without losing digits where S nears 1
        # y' = S + x S (1 - S) v' = S (1 + x (1 - S) v')
        d1 = g.op("Mul", s, g.op("Add", _c(g, like, 1.0), _mul(g, x, one_minus_s, dv)))
        if not second:
            return d1, None
        # y'' = S (1 - S) (2 v' + x ((1 - 2 S) v'^2 + v'')), v'' = 12 c k x
        one_minus_2s = g.op("Sub", one_minus_s, s)
        curvature = g.op(
            "Add", _mul(g, one_minus_2s, dv, dv), g.op("Mul", x, _c(g, like, 12.0 * TANH_GELU_CUBIC * TANH_GELU_SCALE))
        )
        inner = g.op("Add", g.op("Mul", dv, _c(g, like, 2.0)), g.op("Mul", x, curvature))
        return d1, _mul(g, s, one_minus_s, inner)
    cdf = g.op(
        "Mul", g.op("Add", g.op("Erf", g.op("Mul", x, _c(g, like, 1.0 / math.sqrt(2.0)))), _c(g, like, 1.0)), _c(g, like, 0.5)
    )
    pdf = g.op("Mul", g.op("Exp", g.op("Mul", x2, _c(g, like, -0.5))), _c(g, like, 1.0 / math.sqrt(2.0 * math.pi)))
    d1 = g.op("Add", cdf, g.op("Mul", x, pdf))
    # y' = Phi + x phi, y'' = 2 phi - x^2 phi
    return d1, (g.op("Mul", pdf, g.op("Sub", _c(g, like, 2.0), x2)) if second else None)


@_unary("Erf")
def erf(g, x, y, dy):
    e = g.op("Exp", g.op("Neg", g.op("Mul", x, x)))
    return _mul(g, dy, e, _c(g, x, 2.0 / math.sqrt(math.pi)))


@grad_rule("PRelu", broadcast=True)
def prelu(g):
    # y = x (x >= 0), slope * x (x < 0); slope broadcasts to x (the walker sums dSlope back).
    # At 0 the slope's branch, as PyTorch's prelu backward (x > 0 ? dy : slope * dy; dSlope is 0 there).
    x, slope, dy = g.x(0), g.x(1), g.dy()
    negative = g.op("Not", g.op("Greater", x, _c(g, x, 0.0)))
    dx = _mask(g, negative, g.op("Mul", dy, slope), dy) if g.needs(0) else None
    dslope = _mask(g, negative, g.op("Mul", dy, x)) if g.needs(1) else None
    return [dx, dslope]


# -- trigonometric and hyperbolic ------------------------------------------------------------


def _one_minus_x2(g, x):
    return g.op("Sub", _c(g, x, 1.0), g.op("Mul", x, x))


@_unary("Sin")
def sin(g, x, y, dy):
    return g.op("Mul", dy, g.op("Cos", x))


@_unary("Cos")
def cos(g, x, y, dy):
    return g.op("Neg", g.op("Mul", dy, g.op("Sin", x)))


@_unary("Tan")
def tan(g, x, y, dy):
    return g.op("Mul", dy, g.op("Add", _c(g, x, 1.0), g.op("Mul", y, y)))


@_unary("Asin")
def asin(g, x, y, dy):
    return g.op("Div", dy, g.op("Sqrt", _one_minus_x2(g, x)))


@_unary("Acos")
def acos(g, x, y, dy):
    return g.op("Neg", g.op("Div", dy, g.op("Sqrt", _one_minus_x2(g, x))))


@_unary("Atan")
def atan(g, x, y, dy):
    return g.op("Div", dy, g.op("Add", _c(g, x, 1.0), g.op("Mul", x, x)))


@_unary("Sinh")
def sinh(g, x, y, dy):
    return g.op("Mul", dy, g.op("Cosh", x))


@_unary("Cosh")
def cosh(g, x, y, dy):
    return g.op("Mul", dy, g.op("Sinh", x))


@_unary("Asinh")
def asinh(g, x, y, dy):
    return g.op("Div", dy, g.op("Sqrt", g.op("Add", g.op("Mul", x, x), _c(g, x, 1.0))))


@_unary("Acosh")
def acosh(g, x, y, dy):
    return g.op("Div", dy, g.op("Sqrt", g.op("Sub", g.op("Mul", x, x), _c(g, x, 1.0))))


@_unary("Atanh")
def atanh(g, x, y, dy):
    return g.op("Div", dy, _one_minus_x2(g, x))


# -- piecewise constant: zero gradient ------------------------------------------------------


@grad_rule("Floor", "Ceil", "Round", "Sign")
def piecewise_constant(g):
    return [g.zeros_like(g.x(0)) if g.needs(0) else None]


# -- selection ---------------------------------------------------------------------------------


@grad_rule("Where", broadcast=True, nondiff_inputs=(0,))
def where(g):
    cond, dy = g.x(0), g.dy()
    zero = _c(g, g.y(), 0.0)
    return [None, g.op("Where", cond, dy, zero) if g.needs(1) else None, g.op("Where", cond, zero, dy) if g.needs(2) else None]


@grad_rule("Max", "Min", broadcast=True)
def max_min(g):
    inputs, y, dy = list(g.node.inputs), g.y(), g.dy()
    if len(inputs) == 1:
        return [dy]
    # Ties split the gradient evenly: dX_i = dY * [x_i == y] / #{j: x_j == y}.
    hits = [g.cast_like(g.op("Equal", x, y), y) for x in inputs]
    share = g.op("Div", dy, g.sum(hits))
    return [g.op("Mul", share, hit) if g.needs(i) else None for i, hit in enumerate(hits)]


@grad_rule("Clip")
def clip(g):
    """Y = min(max(X, lo), hi); ONNX makes every output hi when lo > hi. Each element's gradient goes
    to exactly one of X (lo <= X <= hi), lo (X < lo <= hi) or hi (X > hi, or lo > hi), so the three
    sum to dY. The bounds are scalars: their gradients are sums over the elements they decide
    (learnable clip bounds, as in PACT quantisation; torch.clamp with tensor bounds agrees except
    at lo == hi, where it gives no one the gradient and this rule gives it to lo)."""
    x, dy = g.x(0), g.dy()
    lo = g.x(1) if g.x(1) is not None and g.x(1).name else None
    hi = g.x(2) if g.x(2) is not None and g.x(2).name else None
    result = [None, None, None]
    if g.needs(0):
        conds = []
        if lo is not None:
            conds.append(g.op("GreaterOrEqual", x, lo))
        if hi is not None:
            conds.append(g.op("LessOrEqual", x, hi))
        if not conds:
            result[0] = dy
        else:
            result[0] = _mask(g, conds[0] if len(conds) == 1 else g.op("And", *conds), dy)
    crossed = g.op("Greater", lo, hi) if lo is not None and hi is not None and (g.needs(1) or g.needs(2)) else None
    if g.needs(1):
        lo_decides = g.op("Less", x, lo)
        if crossed is not None:
            lo_decides = g.op("And", lo_decides, g.op("Not", crossed))
        result[1] = g.reshape_like(g.reduce_sum(_mask(g, lo_decides, dy), None, keepdims=0), lo)
    if g.needs(2):
        hi_decides = g.op("Greater", x, hi)
        if crossed is not None:
            hi_decides = g.op("Or", hi_decides, crossed)
        result[2] = g.reshape_like(g.reduce_sum(_mask(g, hi_decides, dy), None, keepdims=0), hi)
    return result[: len(g.node.inputs)]


# -- variadic sums ---------------------------------------------------------------------------


@grad_rule("Sum", broadcast=True)
def sum_(g):
    return [g.dy()] * len(g.node.inputs)


@grad_rule("Mean", broadcast=True)
def mean(g):
    n = len(g.node.inputs)
    dy = g.dy() if n == 1 else g.op("Mul", g.dy(), _c(g, g.dy(), 1.0 / n))
    return [dy] * n


# -- identity-like ---------------------------------------------------------------------------


@grad_rule("Identity")
def identity(g):
    return [g.dy()]


@grad_rule("Cast")
def cast(g):
    # Only float -> float casts carry a gradient (integer outputs never get one).
    return [_same_type(g, g.dy(), g.x(0)) if g.needs(0) else None]


@grad_rule("CastLike", nondiff_inputs=(1,))
def cast_like(g):
    return [_same_type(g, g.dy(), g.x(0)) if g.needs(0) else None, None]


@grad_rule("Dropout", nondiff_inputs=(1, 2))
def dropout(g):
    """Inference mode: the identity. Training mode (a constant training_mode true): dX = dY * mask /
    (1 - ratio), as ONNX Runtime training's DropoutGrad computes it, with the mask the forward node
    drew (its second output, which the node is given when it has none)."""
    training = g.input_const(2) if g.x(2) is not None and g.x(2).name else np.array(False)
    ratio = g.input_const(1) if g.x(1) is not None and g.x(1).name else np.array(0.5)
    name = g.node.name or "<unnamed>"
    if training is None:
        raise ModelError(
            f"Dropout node {name!r}: training_mode is not a constant; gradgen differentiates Dropout whose "
            "training_mode is a constant (true or false)"
        )
    rest = [None] * (len(g.node.inputs) - 1)
    if not bool(np.asarray(training).reshape(-1)[0]) or (ratio is not None and float(np.asarray(ratio).reshape(-1)[0]) == 0):
        return [g.dy()] + rest
    kept = g.op("Mul", g.dy(), g.op("CastLike", _dropout_mask(g), g.dy()))
    if ratio is not None:
        scale = g.const_like(g.x(0), 1.0 / (1.0 - float(np.asarray(ratio).reshape(-1)[0])))
        return [g.op("Mul", kept, scale)] + rest
    keep = g.op("Sub", g.const_like(g.x(0), 1.0), g.op("CastLike", g.x(1), g.dy()))
    return [g.op("Div", kept, keep)] + rest


def _dropout_mask(g) -> ir.Value:
    """The forward Dropout's mask output, which the node gets (named ``<Y>_mask``) when it has none,
    so that the backward reads the mask the forward drew."""
    node = g.node
    if len(node.outputs) < 2 or not node.outputs[1].name:
        node.resize_outputs(2)
        mask = node.outputs[1]
        mask.name = g.b.unique(f"{node.outputs[0].name}_mask")
        mask.type = ir.TensorType(ir.DataType.BOOL)
        mask.shape = node.outputs[0].shape
    return node.outputs[1]


@grad_rule("RotaryEmbedding", nondiff_inputs=(3,))
def rotary_embedding(g):
    """A rotation's transpose is the rotation by the opposite angle: dX = RotaryEmbedding(dY, cos,
    -sin). Per position and pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), so the caches get
    the sums over heads of dy1 x1 + dy2 x2 (cos) and dy2 x1 - dy1 x2 (sin): as they are without
    position_ids, else added into the rows position_ids picked (GatherGrad, Gather's gradient)."""
    x, cos, sin, positions, dy = g.x(0), g.x(1), g.x(2), g.x(3), g.dy()
    attrs = {name: g.attr(name) for name in ("interleaved", "num_heads", "rotary_embedding_dim")}
    grads: list = [None] * len(g.node.inputs)
    if g.needs(0):
        grads[0] = g.op("RotaryEmbedding", dy, cos, g.op("Neg", sin), positions, **attrs)
    if not (g.needs(1) or g.needs(2)):
        return grads
    x1, x2 = _rotary_pairs(g, x, attrs)
    d1, d2 = _rotary_pairs(g, dy, attrs)
    per_position = {
        1: g.op("Add", g.op("Mul", d1, x1), g.op("Mul", d2, x2)),
        2: g.op("Sub", g.op("Mul", d2, x1), g.op("Mul", d1, x2)),
    }
    for i, cache in ((1, cos), (2, sin)):
        if g.needs(i):
            used = g.reduce_sum(per_position[i], [2], keepdims=0)  # over the heads: (batch, seq, dim / 2)
            if positions is not None:
                used = g.set_type_like(g.op("GatherGrad", g.shape_of(cache), positions, used, domain=MICROSOFT, axis=0), cache)
            grads[i] = used
    return grads


def _rotary_pairs(g, v, attrs):
    """The two members of RotaryEmbedding's pairs in ``v`` (X's layout), each (batch, seq, heads, dim / 2)."""
    rank = g.rank(g.x(0))
    if rank not in (3, 4):
        raise ModelError(
            f"RotaryEmbedding node {g.node.name!r}: the gradient of its caches needs X's rank (3 or 4), "
            f"which is {'unknown' if rank is None else rank}"
        )
    heads = g.transpose(v, [0, 2, 1, 3]) if rank == 4 else g.reshape(v, [0, 0, int(attrs["num_heads"] or 0), -1])
    dim = int(attrs["rotary_embedding_dim"] or 0)
    rotated = g.op("Slice", heads, g.ints([0]), g.ints([dim]), g.ints([3])) if dim else heads
    # pairs of adjacent features (interleaved), or of the two halves
    shape, axis = ([0, 0, 0, -1, 2], 4) if int(attrs["interleaved"] or 0) else ([0, 0, 0, 2, -1], 3)
    pairs = g.reshape(rotated, shape)
    return g.op("Gather", pairs, g.scalar(0), axis=axis), g.op("Gather", pairs, g.scalar(1), axis=axis)


# Ops whose outputs never carry a gradient: bool outputs (comparisons, logic), integer bit
# operations and random samples. Mod is not among them: float Mod (fmod=1) is differentiable (its
# rule is above; integer Mod never reaches a rule).
non_differentiable(
    "Equal",
    "Less",
    "LessOrEqual",
    "Greater",
    "GreaterOrEqual",
    "Not",
    "And",
    "Or",
    "Xor",
    "IsNaN",
    "IsInf",
    "BitShift",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseNot",
    "BitwiseXor",
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
)

# BroadcastGradientArgs (a gradient op gradgen emits) computes int64 reduction axes from two shapes:
# integer data, no gradient.
non_differentiable("BroadcastGradientArgs", domain=MICROSOFT)


@grad_rule("ReluGrad", domain=MICROSOFT)
def relu_grad(g):
    """ReluGrad(dY, X) = dY where X > 0 (ONNX Runtime training's, differentiated again): linear in dY,
    whose gradient is the same mask of the incoming one; piecewise constant in X (zero gradient, as
    Relu's own second derivative)."""
    x = g.x(1)
    zero = _c(g, x, 0.0)  # dY and X have one type
    d_dy = g.op("Where", g.op("Greater", x, zero), g.dy(), zero) if g.needs(0) else None
    return [d_dy, g.zeros_like(x) if g.needs(1) else None]


@grad_rule("SigmoidGrad", domain=MICROSOFT)
def sigmoid_grad(g):
    """SigmoidGrad(dY, Y) = dY Y (1 - Y), Y Sigmoid's output (ONNX Runtime training's, differentiated
    again): d dY = P Y (1 - Y); d Y = P dY (1 - 2 Y)."""
    dy, y, p = g.x(0), g.x(1), g.dy()
    one = _c(g, y, 1.0)
    d_dy = g.op("Mul", g.op("Mul", p, y), g.op("Sub", one, y)) if g.needs(0) else None
    d_y = g.op("Mul", g.op("Mul", p, dy), g.op("Sub", one, g.op("Add", y, y))) if g.needs(1) else None
    return [d_dy, d_y]


@grad_rule("TanhGrad", domain=MICROSOFT)
def tanh_grad(g):
    """TanhGrad(dY, Y) = dY (1 - Y^2), Y Tanh's output (ONNX Runtime training's, differentiated
    again): d dY = P (1 - Y^2); d Y = -2 P dY Y."""
    dy, y, p = g.x(0), g.x(1), g.dy()
    d_dy = g.op("Mul", p, g.op("Sub", _c(g, y, 1.0), g.op("Mul", y, y))) if g.needs(0) else None
    d_y = g.op("Mul", g.op("Mul", p, dy), g.op("Mul", y, _c(g, y, -2.0))) if g.needs(1) else None
    return [d_dy, d_y]


@grad_rule("GeluGrad", "FastGeluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX", domain=MICROSOFT)
def gelu_grad(g):
    """ONNX Runtime training's Gelu gradients, differentiated again: dX = dY Gelu'(X [+ B]) (Fast*:
    the tanh Gelu; Bias*: B added along the last axis). With P the incoming gradient:
    d dY = P Gelu'(X + B), d X = P dY Gelu''(X + B), d B = that summed over the leading axes."""
    dy, x, bias, p = g.x(0), g.x(1), g.x(2), g.dy()
    tanh = "Fast" in g.node.op_type
    z = g.op("Add", x, bias) if bias is not None else x
    wants_x = g.needs(1) or (bias is not None and g.needs(2))
    d1, d2 = gelu_slopes(g, z, tanh, x, second=wants_x)
    grads = [g.op("Mul", p, d1) if g.needs(0) else None, None, None][: len(g.node.inputs)]
    if wants_x:
        dz = _mul(g, p, dy, d2)
        if g.needs(1):
            grads[1] = dz
        if bias is not None and g.needs(2):
            grads[2] = g.unbroadcast(dz, bias, x, None)
    return grads


def left_in_place(g, why: str = "") -> ModelError:
    """The error of an ONNX Runtime forward op that reached the gradient pass: build_backward's
    DecomposePass rewrites it into standard ops first (gradgen.ops.schemas.LOWERED_FORWARD_OPS),
    when its first input's type and rank are known."""
    where = f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"
    return ModelError(
        f"{where} reached the gradient pass: it is differentiated in its standard-op form, which "
        "gradgen.passes.DecomposePass (in build_backward's pipeline) makes when its first input's type and rank "
        f"are known{why}"
    )


@grad_rule("Gelu", "FastGelu", domain=MICROSOFT)
def ms_gelu(g):
    """ONNX Runtime's Gelu / FastGelu of one float32 input, as GeluFusionPass makes them from an
    exported formula: one GeluGrad / FastGeluGrad node. Other forms (a FastGelu bias, other types)
    are differentiated in their standard-op form (left_in_place)."""
    x = g.x(0)
    if len(g.node.inputs) > 1 and g.x(1) is not None or x.dtype != ir.DataType.FLOAT:
        raise left_in_place(g)
    return [gelu_grad_op(g, g.dy(), x, tanh=g.node.op_type == "FastGelu")]


def gelu_grad_op(g, dy, x, tanh: bool):
    """dY Gelu'(X) as one ONNX Runtime training GeluGrad / FastGeluGrad node."""
    dx = g.op("FastGeluGrad" if tanh else "GeluGrad", dy, x, domain=MICROSOFT)
    g.set_type_like(dx, x)
    return dx


@grad_rule("BiasGelu", "QuickGelu", domain=MICROSOFT)
def transformer_activation(g):
    """ONNX Runtime's other Gelu forms: differentiated in their standard-op form (left_in_place)."""
    raise left_in_place(g)


@grad_rule("BiasDropout", domain=MICROSOFT, nondiff_inputs=(3, 4))
def bias_dropout(g):
    """BiasDropout in inference mode (data + bias [+ residual]): differentiated in its standard-op
    form (left_in_place); training mode with ratio > 0 is refused by that form."""
    raise left_in_place(g)


@grad_rule("DynamicQuantizeLinear")
def dynamic_quantize_linear(g):
    """DynamicQuantizeLinear(x) -> (y, y_scale, y_zero_point): no gradient, by decision.

    y and y_zero_point are uint8: integer outputs carry no gradient (the walker never propagates
    through them), and their true derivative is zero wherever it exists anyway (they are piecewise
    constant in x, like Round). So a loss that reads only the integer outputs (say through a Cast)
    gets zero gradients for the tensors feeding x, as through any integer tensor, and as Round's
    rule gives: the true derivative wherever it exists. gradgen does not substitute a
    straight-through estimator: that is a training recipe, not a gradient (a model wanting one
    writes its fake quantization with float ops).

    y_scale is float and does depend on x ((max(0, max x) - min(0, min x)) / 255), but a loss
    reading it almost always reads the quantized y too (dequantization is y_scale * (y - zero
    point)), and a gradient through y_scale alone would not be that loss's gradient. A gradient
    reaching y_scale is therefore a model error naming the node, never a silent zero; this rule runs
    only then (the only float output), so it always refuses.
    """
    raise ModelError(
        f"DynamicQuantizeLinear node {g.node.name or '<unnamed>'!r}: a gradient reaches its y_scale output, "
        "which depends on x only together with the "
        "quantized (integer) y, whose gradient is none; gradgen does not differentiate DynamicQuantizeLinear "
        "(--freeze the tensors that feed it, or quantize with float ops)"
    )


@grad_rule("Scale", domain=MICROSOFT)
def scale(g):
    """ONNX Runtime training's Scale: Y = X * s (X / s with scale_down=1), s one element. dX is dY
    scaled the same way; s gets sum(dY X) (-sum(dY X) / s^2 when dividing)."""
    x, factor, dy = g.x(0), g.x(1), g.dy()
    down = bool(int(g.attr("scale_down", 0)))
    grads = [None, None]
    if g.needs(0):
        grads[0] = g.op("Div" if down else "Mul", dy, g.reshape(g.op("CastLike", factor, dy), []))
    if g.needs(1):
        total = g.op("CastLike", g.reduce_sum(g.op("Mul", dy, x), None, keepdims=0), factor)
        if down:
            total = g.op("Neg", g.op("Div", total, g.op("Mul", factor, factor)))
        grads[1] = g.reshape_like(total, factor)
    return grads
