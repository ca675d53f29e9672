"""Finite-difference cases: BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization."""

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
