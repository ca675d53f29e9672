"""Finite-difference cases: elementwise ops, including every broadcasting pattern of CASES.md."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(1)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, shape)


def away_from_zero(*shape):
    return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


BROADCAST_SHAPES = [
    ((2, 3, 2, 3), (2, 3, 2, 3)), ((2, 3, 2, 3), ()), ((), (2, 3, 2, 3)), ((2, 3, 2, 3), (3,)),
    ((2, 3), (2, 3, 2, 3)), ((1, 2, 3), (2, 3, 1, 1)), ((3, 2, 1, 3), (2, 1, 1)), ((2, 1, 1, 3), (1, 3, 2, 1)),
]

CASES = []
for a, b in BROADCAST_SHAPES:
    for op in ("Add", "Sub", "Mul"):
        CASES.append(GradCase(op, [r(*a), r(*b)], name=f"{op}{a}{b}"))
CASES += [
    GradCase("Relu", [away_from_zero(3, 4)]),
]
