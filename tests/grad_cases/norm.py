"""Finite-difference cases: BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization,
RMSNormalization, LpNormalization, MeanVarianceNormalization, LRN."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(11)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, shape)


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


CASES = []

# BatchNormalization, inference: all five inputs differentiable.
for shape in ((3, 2), (2, 3, 4), (2, 3, 2, 2)):
    c = shape[1]
    for opset, attrs in ((15, {}), (17, {"epsilon": 0.3}), (9, {"epsilon": 1e-3}), (14, {"training_mode": 0})):
        if opset < 13:
            continue  # the harness needs opset >= 13
        CASES.append(
            GradCase(
                "BatchNormalization",
                [r(*shape), r(c), r(c), r(c), positive(c)],
                attrs,
                opset=opset,
                name=f"BatchNormalization-eval{shape}-op{opset}-{sorted(attrs.items())}",
            )
        )
# Constant running statistics (the usual case): only X, scale, B.
CASES.append(
    GradCase(
        "BatchNormalization", [r(2, 3, 4), r(3), r(3), r(3), positive(3)], const=(3, 4), name="BatchNormalization-eval-conststats"
    )
)
# Training mode: batch statistics; the running statistics outputs carry gradients too.
CASES.append(
    GradCase(
        "BatchNormalization",
        [r(4, 3, 2), r(3), r(3), r(3), positive(3)],
        {"training_mode": 1, "momentum": 0.8},
        num_outputs=3,
        opset=15,
        name="BatchNormalization-train-3out",
    )
)
CASES.append(
    GradCase(
        "BatchNormalization",
        [r(4, 3), r(3), r(3), r(3), positive(3)],
        {"training_mode": 1},
        num_outputs=3,
        const=(3, 4),
        opset=15,
        name="BatchNormalization-train-2d",
    )
)
# ONNX Runtime training's BatchNormInternal (the forward of a default build's training-mode
# BatchNormalization): all five outputs in the loss, the saved batch mean and inverse deviation too.
for shape in ((5, 2), (2, 3, 2, 2)):
    CASES.append(
        GradCase(
            "BatchNormInternal",
            [r(*shape), r(shape[1]), r(shape[1]), r(shape[1]), positive(shape[1])],
            {"epsilon": 1e-3, "momentum": 0.8, "training_mode": 1},
            domain="com.microsoft",
            num_outputs=5,
            name=f"BatchNormInternal-{len(shape)}d",
        )
    )

# LayerNormalization: axis, epsilon, optional B, Mean/InvStdDev outputs carrying gradients.
for shape, axis in (((2, 3, 4), -1), ((2, 3, 4), 1), ((2, 3, 4), -2), ((3, 4), 0), ((2, 2, 3), 2)):
    norm_shape = shape[axis % len(shape) :]
    CASES.append(
        GradCase(
            "LayerNormalization",
            [r(*shape), r(*norm_shape), r(*norm_shape)],
            {"axis": axis},
            name=f"LayerNormalization{shape}-axis{axis}",
        )
    )
CASES += [
    GradCase("LayerNormalization", [r(2, 5), r(5)], {"epsilon": 0.1}, name="LayerNormalization-nobias-eps"),
    GradCase(
        "LayerNormalization",
        [r(2, 3, 4), r(4), r(1)],
        {"axis": -1, "epsilon": 1e-3},
        opset=18,
        name="LayerNormalization-broadcast-scale-bias",
    ),
]

# InstanceNormalization.
for shape in ((2, 3, 4), (2, 2, 3, 2), (1, 3, 5)):
    CASES.append(
        GradCase(
            "InstanceNormalization",
            [r(*shape), r(shape[1]), r(shape[1])],
            {"epsilon": 1e-3},
            name=f"InstanceNormalization{shape}",
        )
    )

# GroupNormalization: opset 21 (per channel) and the opset 18 form (scale/bias per group). The
# checker refuses opset 18's deprecated schema, so the per-group form is checked at opset 21 with
# static shapes (the rule, like the kernel, tells the forms apart by the length of scale).
for shape, groups in (((2, 4, 3), 2), ((2, 6, 2, 2), 3), ((1, 4, 3), 1), ((2, 4, 2), 4)):
    c = shape[1]
    if groups != c:
        CASES.append(
            GradCase(
                "GroupNormalization",
                [r(*shape), r(groups), r(groups)],
                {"num_groups": groups, "epsilon": 1e-3},
                opset=21,
                symbolic=False,
                name=f"GroupNormalization-pergroup{shape}-g{groups}",
            )
        )
    CASES.append(
        GradCase(
            "GroupNormalization",
            [r(*shape), r(c), r(c)],
            {"num_groups": groups, "epsilon": 1e-3},
            opset=21,
            name=f"GroupNormalization-op21{shape}-g{groups}",
        )
    )

# RMSNormalization (opset 23): axis, epsilon, a scale of the normalized shape or broadcast to it.
for shape, axis, scale_shape in (
    ((2, 3, 4), -1, (4,)),
    ((2, 3, 4), 1, (3, 4)),
    ((2, 3, 4), -2, (1, 4)),
    ((3, 5), 0, (3, 5)),
    ((2, 2, 3), 2, (1,)),
):
    CASES.append(
        GradCase(
            "RMSNormalization",
            [r(*shape), r(*scale_shape)],
            {"axis": axis, "epsilon": 1e-3},
            opset=23,
            name=f"RMSNormalization{shape}-axis{axis}-scale{scale_shape}",
        )
    )

# LpNormalization: p 1 and 2, several axes (a row of zeros, where y jumps, is in tests/test_norm_rules.py).
for shape, axis, p in (((3, 4), -1, 2), ((2, 3, 4), 1, 2), ((2, 3, 4), 0, 1), ((3, 5), -1, 1)):
    CASES.append(GradCase("LpNormalization", [r(*shape)], {"axis": axis, "p": p}, name=f"LpNormalization{shape}-axis{axis}-p{p}"))
CASES.append(GradCase("LpNormalization", [r(2, 3)], {"p": 2}, opset=22, name="LpNormalization-op22"))

# MeanVarianceNormalization: the default axes (N, H, W) and others.
for shape, axes in (((2, 3, 2, 2), None), ((2, 3, 4), [1]), ((2, 3, 4), [0, 2]), ((3, 4), [-1])):
    CASES.append(
        GradCase(
            "MeanVarianceNormalization",
            [r(*shape)],
            {} if axes is None else {"axes": axes},
            opset=13,
            full_check=False,  # ONNX's function body adds a float epsilon to double data
            name=f"MeanVarianceNormalization{shape}-axes{axes}",
        )
    )

# LRN: odd and even window sizes, windows wider than the channels.
for shape, size, attrs in (
    ((2, 5, 3), 3, {}),
    ((1, 4, 2, 2), 2, {"alpha": 0.5, "beta": 0.6, "bias": 2.0}),
    ((2, 3, 2), 5, {"alpha": 0.3, "beta": 1.2}),
    ((1, 6), 4, {"alpha": 0.2, "bias": 1.5}),
):
    CASES.append(
        GradCase("LRN", [r(*shape)], {"size": size, **attrs}, opset=13, name=f"LRN{shape}-size{size}-{sorted(attrs.items())}")
    )

# ONNX Runtime's fused normalizations (differentiated in their standard-op form, DecomposePass):
# every float input and output (mean, inv_std_var, input_skip_bias_sum), skip broadcast.
_MS = "com.microsoft"
CASES += [
    GradCase(
        "SkipLayerNormalization",
        [r(2, 3, 4), r(2, 3, 4), r(4), r(4), r(4)],
        {"epsilon": 1e-5},
        domain=_MS,
        num_outputs=4,
        name="SkipLayerNormalization_all",
    ),
    GradCase(
        "SkipLayerNormalization", [r(2, 3, 4), r(3, 4), r(4)], domain=_MS, num_outputs=2, name="SkipLayerNormalization_2d_skip"
    ),
    GradCase(
        "SkipSimplifiedLayerNormalization",
        [r(2, 3, 4), r(1, 3, 4), r(4), r(4)],
        {"epsilon": 1e-5},
        domain=_MS,
        num_outputs=4,
        name="SkipSimplifiedLayerNormalization_all",
    ),
    # (its inv_std_var is float32 also for double X, as ONNX Runtime gives it: not finite-differenced)
    GradCase("SimplifiedLayerNormalization", [r(2, 3, 4), r(4)], name="SimplifiedLayerNormalization"),
    GradCase("SimplifiedLayerNormalization", [r(2, 3, 4), r(3, 4)], {"axis": 1}, name="SimplifiedLayerNormalization_axis1"),
]
