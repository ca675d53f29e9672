"""Finite-difference cases: elementwise ops, including every broadcasting pattern of CASES.md."""

import dataclasses
from typing import Callable

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(1)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, shape)


def away_from_zero(*shape, low=0.5, high=2.0):
    return rng.uniform(low, high, shape) * rng.choice([-1.0, 1.0], shape)


def pos(*shape, low=0.5, high=2.0):
    return rng.uniform(low, high, shape)


BROADCAST_SHAPES = [
    ((2, 3, 2, 3), (2, 3, 2, 3)),
    ((2, 3, 2, 3), ()),
    ((), (2, 3, 2, 3)),
    ((2, 3, 2, 3), (3,)),
    ((2, 3), (2, 3, 2, 3)),
    ((1, 2, 3), (2, 3, 1, 1)),
    ((3, 2, 1, 3), (2, 1, 1)),
    ((2, 1, 1, 3), (1, 3, 2, 1)),
]

CASES = []
for a, b in BROADCAST_SHAPES:
    for op in ("Add", "Sub", "Mul"):
        CASES.append(GradCase(op, [r(*a), r(*b)], name=f"{op}{a}{b}"))
    CASES.append(GradCase("Div", [r(*a), away_from_zero(*b)], name=f"Div{a}{b}"))
    # Pow: base > 0 so that the exponent's gradient (dY * Y * ln A) exists; both differentiated.
    CASES.append(GradCase("Pow", [pos(*a), r(*b, low=-1.5, high=2.5)], name=f"Pow{a}{b}"))
    # Pow with the exponent held constant (a parameter of the model, not trained).
    CASES.append(GradCase("Pow", [pos(*a), r(*b, low=-1.5, high=2.5)], const=(1,), name=f"PowConstExp{a}{b}"))

CASES += [
    # Pow: constant scalar exponents (the special-cased 1, 2, 0.5), an integer exponent with a
    # negative base, a float exponent with some negative bases (no exponent gradient there).
    GradCase("Pow", [r(3, 4), np.array(2.0)], const=(1,), name="Pow_sq"),
    GradCase("Pow", [r(3, 4), np.array(1.0)], const=(1,), name="Pow_one"),
    GradCase("Pow", [pos(3, 4), np.array(0.5)], const=(1,), name="Pow_sqrt"),
    GradCase("Pow", [pos(3, 4), np.array(-1.7)], const=(1,), name="Pow_neg_exp"),
    GradCase("Pow", [away_from_zero(3, 4), np.array(3, dtype=np.int64)], name="Pow_int_exp"),
    GradCase("Pow", [away_from_zero(3, 4), np.array([[2.0], [3.0], [1.0]])], const=(1,), name="Pow_neg_base"),
    GradCase("Div", [r(2, 3), away_from_zero(2, 3)], const=(0,), name="Div_only_b"),
    GradCase("Sub", [r(2, 3), r(3)], const=(0,), name="Sub_only_b"),
    # Mod (fmod=1, float): away from the jumps.
    GradCase(
        "Mod", [np.array([[3.7, -3.7, 5.2], [-1.3, 2.9, 7.4]]), np.array([1.5, 2.0, -2.5])], attrs={"fmod": 1}, name="Mod_fmod"
    ),
    # Float Mod with fmod=0 (opset 28): floor's quotient, which differs from trunc's where the signs
    # differ (the rule used trunc's for both)
    GradCase(
        "Mod",
        [np.array([[3.7, -3.7, 5.2], [-1.3, 2.9, 7.4]]), np.array([1.5, 2.0, -2.5])],
        opset=28,
        name="Mod_float_floor",
    ),
]

# Unary ops: (op, input, attrs)
UNARY = [
    ("Neg", r(3, 4), {}),
    ("Abs", away_from_zero(3, 4), {}),
    ("Sqrt", pos(3, 4), {}),
    ("Reciprocal", away_from_zero(3, 4), {}),
    ("Exp", r(3, 4), {}),
    ("Log", pos(3, 4), {}),
    ("Tanh", r(3, 4), {}),
    ("Sigmoid", r(3, 4, low=-4, high=4), {}),
    ("Relu", away_from_zero(3, 4), {}),
    ("LeakyRelu", away_from_zero(3, 4), {}),
    ("LeakyRelu", away_from_zero(3, 4), {"alpha": 0.3}),
    ("Elu", away_from_zero(3, 4), {}),
    ("Elu", away_from_zero(3, 4), {"alpha": 0.5}),
    ("Selu", away_from_zero(3, 4), {}),
    ("Selu", away_from_zero(3, 4), {"alpha": 1.2, "gamma": 0.8}),
    ("Softplus", r(3, 4, low=-5, high=5), {}),
    ("Softsign", away_from_zero(3, 4), {}),
    ("HardSigmoid", np.array([-4.0, -2.4, -1.0, 0.3, 1.7, 2.6, 3.5, -0.2]), {}),
    ("HardSigmoid", np.array([-4.0, -1.9, -1.0, 0.3, 1.1, 2.6, 3.5, -0.2]), {"alpha": 0.4, "beta": 0.6}),
    ("HardSwish", np.array([-5.0, -3.2, -2.5, -0.7, 0.4, 1.9, 2.8, 3.3, 6.0]), {}),
    ("Erf", r(3, 4), {}),
    ("Sin", r(3, 4, low=-4, high=4), {}),
    ("Cos", r(3, 4, low=-4, high=4), {}),
    ("Tan", r(3, 4, low=-1.2, high=1.2), {}),
    ("Asin", r(3, 4, low=-0.9, high=0.9), {}),
    ("Acos", r(3, 4, low=-0.9, high=0.9), {}),
    ("Atan", r(3, 4, low=-3, high=3), {}),
    ("Sinh", r(3, 4), {}),
    ("Cosh", r(3, 4), {}),
    ("Asinh", r(3, 4, low=-3, high=3), {}),
    ("Acosh", pos(3, 4, low=1.2, high=3.0), {}),
    ("Atanh", r(3, 4, low=-0.9, high=0.9), {}),
    ("ThresholdedRelu", np.array([-1.0, 0.4, 0.9, 1.3, 2.2, -0.3]), {}),
    ("ThresholdedRelu", np.array([-1.0, 0.4, 0.9, 1.3, 2.2, -0.3]), {"alpha": 0.5}),
    ("Floor", np.array([-1.5, -0.3, 0.2, 1.7, 2.4]), {}),
    ("Ceil", np.array([-1.5, -0.3, 0.2, 1.7, 2.4]), {}),
    ("Round", np.array([-1.3, -0.3, 0.2, 1.7, 2.4]), {}),
    ("Sign", away_from_zero(2, 3), {}),
    ("Identity", r(2, 3), {}),
]
for i, (op, x, attrs) in enumerate(UNARY):
    CASES.append(GradCase(op, [x], attrs=attrs, name=f"{op}_{i}"))


@dataclasses.dataclass(frozen=True)
class UnarySpec:
    """A unary op specified once for every test: its finite-difference cases (one per attribute
    set), its fuzz generator (tests/fuzz_ops.py) and its PyTorch reference ``torch(x, **attrs)``.
    Inputs are drawn in [low, high], away from ``kinks(attrs)`` (where it is not differentiable)."""

    low: float
    high: float
    attrs: tuple[dict, ...] = ({},)
    kinks: Callable[[dict], tuple] = lambda attrs: ()
    torch: Callable | None = None
    opset: int = 17


def _torch_shrink(x, lambd=0.5, bias=0.0):
    import torch.nn.functional as F

    hard = F.hardshrink(x, lambd)
    return hard - bias * hard.sign()


def _torch_swish(x, alpha=1.0):
    import torch

    return x * torch.sigmoid(alpha * x)


UNARY_SPECS = {
    "Swish": UnarySpec(-4.0, 4.0, ({}, {"alpha": 0.5}, {"alpha": -1.5}), torch=_torch_swish, opset=24),
    "Shrink": UnarySpec(
        -2.0,
        2.0,
        ({}, {"lambd": 1.0, "bias": 0.3}, {"lambd": 0.2, "bias": -0.4}),
        kinks=lambda a: (-a.get("lambd", 0.5), a.get("lambd", 0.5)),
        torch=_torch_shrink,
    ),
}


def spec_input(spec: UnarySpec, attrs: dict, shape, rng_=rng, margin=0.1) -> np.ndarray:
    """Values in [low, high] at least ``margin`` from every kink."""
    x = rng_.uniform(spec.low, spec.high, shape)
    for k in spec.kinks(attrs):
        near = np.abs(x - k) < margin
        x = np.where(near, k + np.where(x >= k, 2 * margin, -2 * margin), x)
    return x


for op, spec in UNARY_SPECS.items():
    for i, attrs in enumerate(spec.attrs):
        CASES.append(GradCase(op, [spec_input(spec, attrs, (3, 4))], attrs=attrs, opset=spec.opset, name=f"{op}_spec{i}"))

CASES += [
    GradCase("Mish", [r(3, 4, low=-4, high=4)], opset=18),
    GradCase("Celu", [away_from_zero(3, 4).astype(np.float32)], eps=1e-2, rtol=1e-3, atol=1e-3, name="Celu_f32"),
    GradCase("Gelu", [r(3, 4, low=-3, high=3)], opset=20, name="Gelu_none"),
    GradCase("Gelu", [r(3, 4, low=-3, high=3)], attrs={"approximate": "none"}, opset=20, name="Gelu_none_explicit"),
    GradCase("Gelu", [r(3, 4, low=-3, high=3)], attrs={"approximate": "tanh"}, opset=20, name="Gelu_tanh"),
    # PRelu: slope per channel (broadcast), scalar-like, and full-shaped.
    GradCase("PRelu", [away_from_zero(2, 3, 4), r(3, 1)], name="PRelu_channel"),
    GradCase("PRelu", [away_from_zero(2, 3, 4), r(1)], name="PRelu_scalar"),
    GradCase("PRelu", [away_from_zero(2, 3, 4), r(2, 3, 4)], name="PRelu_full"),
    GradCase("PRelu", [away_from_zero(2, 3, 4), r(4)], name="PRelu_last"),
    # Where: 3-way broadcasting; the condition never gets a gradient.
    GradCase("Where", [rng.random((2, 1, 3)) > 0.5, r(1, 4, 1), r(3)], name="Where_3way"),
    GradCase("Where", [rng.random((3, 4)) > 0.5, r(3, 4), r(3, 4)], name="Where_same"),
    GradCase("Where", [rng.random((4,)) > 0.5, r(3, 1), np.array(0.5)], const=(2,), name="Where_const_y"),
    GradCase("Where", [np.array(True), r(2, 3), r(3)], name="Where_scalar_cond"),
    # Max/Min: variadic with broadcasting (distinct values), one input, and a tie of two inputs
    # (split evenly: equals the central difference).
    GradCase("Max", [r(2, 3), r(3), r(1, 1)], name="Max3_bcast"),
    GradCase("Min", [r(2, 3), r(3), r(1, 1)], name="Min3_bcast"),
    GradCase("Max", [r(2, 1, 3), r(4, 1)], name="Max2_bcast"),
    GradCase("Min", [r(2, 1, 3), r(4, 1)], name="Min2_bcast"),
    GradCase("Max", [r(2, 3)], name="Max1"),
    GradCase("Min", [r(2, 3), r(2, 3), r(2, 3), r(2, 3)], name="Min4"),
    GradCase("Max", [np.array([1.0, 2.0, -0.5]), np.array([1.0, 0.5, 0.7])], name="Max_tie"),
    GradCase("Min", [np.array([1.0, 2.0, -0.5]), np.array([1.0, 0.5, 0.7])], name="Min_tie"),
    # Clip: both bounds, one bound (the other omitted), none; values away from the bounds.
    GradCase(
        "Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9, -1.2]), np.array(-1.0), np.array(1.0)], const=(1, 2), name="Clip_both"
    ),
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9]), np.array(0.0)], const=(1,), name="Clip_min"),
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9]), None, np.array(0.5)], const=(2,), name="Clip_max"),
    GradCase("Clip", [r(2, 3)], name="Clip_none"),
    # Learnable bounds (PACT-style): the bounds get the summed gradient of the elements they decide.
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9, -1.2]), np.array(-1.0), np.array(1.0)], name="Clip_bounds"),
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9]), np.array(0.0)], name="Clip_min_bound"),
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9]), None, np.array(0.5)], name="Clip_max_bound"),
    # min > max: every output is max, so only max gets a gradient.
    GradCase("Clip", [np.array([-2.0, -0.7, 0.1, 0.6, 1.9]), np.array(0.8), np.array(-0.3)], name="Clip_crossed_bounds"),
    # Sum/Mean: variadic with broadcasting.
    GradCase("Sum", [r(2, 3), r(3), r(1, 1)], name="Sum3_bcast"),
    GradCase("Sum", [r(2, 1, 3), r(4, 1)], name="Sum2_bcast"),
    GradCase("Sum", [r(2, 3)], name="Sum1"),
    GradCase("Mean", [r(2, 3), r(3), r(1, 1)], name="Mean3_bcast"),
    GradCase("Mean", [r(2, 1, 3), r(4, 1)], name="Mean2_bcast"),
    GradCase("Mean", [r(2, 3)], name="Mean1"),
    # Cast/CastLike to the same float type (float -> float32 -> float paths: tests/test_broadcast_undo.py).
    GradCase("Cast", [r(2, 3)], attrs={"to": 11}, name="Cast_double"),
    GradCase("CastLike", [r(2, 3), np.zeros((1,), dtype=np.float64)], const=(1,), name="CastLike_double"),
    # Dropout in inference mode: no ratio, explicit ratio with training_mode false, mask output.
    GradCase("Dropout", [r(2, 3)], name="Dropout_plain"),
    GradCase("Dropout", [r(2, 3), np.array(0.3), np.array(False)], const=(1,), name="Dropout_eval"),
    GradCase("Dropout", [r(2, 3), np.array(0.3)], const=(1,), num_outputs=2, name="Dropout_mask"),
    GradCase("Dropout", [r(2, 3), np.array(0.0), np.array(True)], const=(1,), name="Dropout_train_ratio0"),
]

# RotaryEmbedding (opset 23): 4-D and 3-D X, halves and interleaved pairs, a partial rotary
# dimension; caches per position, or rows picked by position_ids (repeated ids add up, unused rows
# get 0).
_POSITIONS = np.array([[0, 2, 2], [4, 1, 0]], dtype=np.int64)
for x_shape, attrs, with_ids in (
    ((2, 2, 3, 4), {}, False),
    ((2, 2, 3, 4), {"interleaved": 1}, True),
    ((2, 3, 8), {"num_heads": 2}, True),
    ((2, 2, 3, 6), {"rotary_embedding_dim": 4}, True),
    ((2, 3, 8), {"num_heads": 2, "rotary_embedding_dim": 2, "interleaved": 1}, False),
):
    head_size = x_shape[3] if len(x_shape) == 4 else x_shape[2] // attrs["num_heads"]
    half = (attrs.get("rotary_embedding_dim") or head_size) // 2
    cache_shape = (5, half) if with_ids else (2, 3, half)
    CASES.append(
        GradCase(
            "RotaryEmbedding",
            [r(*x_shape), r(*cache_shape), r(*cache_shape)] + ([_POSITIONS] if with_ids else []),
            attrs,
            opset=23,
            full_check=False,  # ONNX types RotaryEmbedding for float32, float16 and bfloat16 only
            name=f"RotaryEmbedding{x_shape}-{sorted(attrs.items())}-ids{with_ids}",
        )
    )

# ONNX Runtime's transformer activations and BiasDropout in inference mode (differentiated in
# their standard-op form, DecomposePass): every float input.
_MS = "com.microsoft"
CASES += [
    GradCase("Gelu", [r(2, 3)], domain=_MS, name="Gelu_com.microsoft"),
    GradCase("FastGelu", [r(2, 3, 4), r(4)], domain=_MS, name="FastGelu_bias"),
    GradCase("FastGelu", [r(3, 4)], domain=_MS, name="FastGelu_no_bias"),
    GradCase("BiasGelu", [r(2, 3, 4), r(4)], domain=_MS, name="BiasGelu"),
    GradCase("QuickGelu", [r(2, 5)], {"alpha": 1.5}, domain=_MS, name="QuickGelu"),
    GradCase("BiasDropout", [r(2, 3, 4), r(4), r(2, 3, 4)], domain=_MS, name="BiasDropout_residual"),
    GradCase(
        "BiasDropout",
        [r(2, 4), r(4), None, np.array(0.0), np.array(True)],
        domain=_MS,
        const=(3,),
        num_outputs=2,
        name="BiasDropout_training_ratio0",
    ),
]
