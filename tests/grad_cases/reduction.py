"""Finite-difference cases: Reduce*, Softmax/LogSoftmax, CumSum, CumProd (zeros included), TopK."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(7)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, shape)


def distinct(*shape):
    """Values at least 0.1 apart (no ties, away from kinks of Max/Min/TopK)."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.25 - n * 0.1).reshape(shape) + 0.03


def positive(*shape):
    return rng.uniform(0.5, 2.0, shape)


def away_from_zero(*shape):
    return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)


def axes_forms(op, axes, keepdims, opset):
    """(inputs tail, attrs) for the op's axes at this opset."""
    as_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is None:
        return [], {"keepdims": keepdims}
    if as_input:
        return [np.array(axes, dtype=np.int64)], {"keepdims": keepdims}
    return [], {"axes": list(axes), "keepdims": keepdims}


DATA = {
    "ReduceSum": lambda: r(2, 3, 4),
    "ReduceMean": lambda: r(2, 3, 4),
    "ReduceMax": lambda: distinct(2, 3, 4),
    "ReduceMin": lambda: distinct(2, 3, 4),
    "ReduceProd": lambda: away_from_zero(2, 3, 4) * 0.8,
    "ReduceL1": lambda: away_from_zero(2, 3, 4),
    "ReduceL2": lambda: r(2, 3, 4),
    "ReduceSumSquare": lambda: r(2, 3, 4),
    "ReduceLogSum": lambda: positive(2, 3, 4),
    "ReduceLogSumExp": lambda: r(2, 3, 4),
}

CASES = []
for op, make in DATA.items():
    for opset in (17, 18):
        for axes, keepdims in ((None, 1), (None, 0), ([1], 1), ([-1], 0), ([0, 2], 0), ([2, 0], 1), ([-3, 1, 2], 0)):
            tail, attrs = axes_forms(op, axes, keepdims, opset)
            CASES.append(GradCase(op, [make()] + tail, attrs, opset=opset, name=f"{op}-op{opset}-axes{axes}-k{keepdims}"))
    # noop_with_empty_axes (axes as an input: ReduceSum from opset 13, the others from 18): no axes
    # means "reduce nothing" (the elementwise part alone); an empty axes tensor without it, "all".
    input_opset = 17 if op == "ReduceSum" else 18
    CASES.append(GradCase(op, [make()], {"noop_with_empty_axes": 1, "keepdims": 0}, opset=input_opset, name=f"{op}-noop"))
    CASES.append(
        GradCase(
            op,
            [make(), np.zeros((0,), np.int64)],
            {"noop_with_empty_axes": 0, "keepdims": 0},
            opset=input_opset,
            name=f"{op}-emptyaxes-all",
        )
    )

CASES += [
    # Finite differences at a tie are one-sided; compare the even split on a shifted copy instead
    # (no ties) here, and check the tie split exactly in test_rules_vs_torch.
    GradCase("ReduceMax", [distinct(3, 4)], {"axes": [1], "keepdims": 1}, name="ReduceMax-2d"),
    # ReduceProd with one zero in a slice and two zeros in another (exact gradient, not P / x).
    GradCase(
        "ReduceProd",
        [np.array([[0.0, 1.5, -2.0, 0.7], [0.0, 0.0, 1.2, 0.9], [1.1, -0.8, 1.3, 0.6]])],
        {"axes": [1], "keepdims": 0},
        name="ReduceProd-zeros",
    ),
]

for axis, opset in ((None, 13), (-1, 17), (1, 17), (0, 18), (-2, 17)):
    attrs = {} if axis is None else {"axis": axis}
    tag = "default" if axis is None else axis
    CASES.append(GradCase("Softmax", [r(2, 3, 4)], attrs, opset=opset, name=f"Softmax-axis{tag}-op{opset}"))
    CASES.append(GradCase("LogSoftmax", [r(2, 3, 4)], attrs, opset=opset, name=f"LogSoftmax-axis{tag}-op{opset}"))

for axis in (0, 1, -1):
    for exclusive in (0, 1):
        for reverse in (0, 1):
            CASES.append(
                GradCase(
                    "CumSum",
                    [r(3, 4), np.array(axis, dtype=np.int64)],
                    {"exclusive": exclusive, "reverse": reverse},
                    name=f"CumSum-axis{axis}-ex{exclusive}-rev{reverse}",
                )
            )
CASES.append(GradCase("CumSum", [r(2, 3, 2), np.array([1], dtype=np.int32)], name="CumSum-int32axis"))


def with_zeros(*shape):
    """Values with exact zeros: none in some lines, one in others, two in one (the rule's three cases)."""
    x = r(*shape)
    flat = x.reshape(-1, shape[-1])
    flat[0, 1] = 0.0
    flat[-1, 0] = flat[-1, 2] = 0.0
    return x


for exclusive in (0, 1):
    for reverse in (0, 1):
        for axis in (-1, 0):
            CASES.append(
                GradCase(
                    "CumProd",
                    [with_zeros(3, 4), np.array(axis, dtype=np.int64)],
                    {"exclusive": exclusive, "reverse": reverse},
                    opset=26,
                    name=f"CumProd-axis{axis}-ex{exclusive}-rev{reverse}",
                )
            )
CASES.append(GradCase("CumProd", [r(2, 3, 2), np.array(1, dtype=np.int32)], opset=26, name="CumProd-int32axis"))

for axis, largest, k, opset in ((-1, 1, 2, 17), (1, 0, 3, 17), (0, 1, 1, 13), (2, 1, 4, 18), (-2, 0, 2, 15)):
    CASES.append(
        GradCase(
            "TopK",
            [distinct(3, 4, 5), np.array([k], dtype=np.int64)],
            {"axis": axis, "largest": largest},
            num_outputs=2,
            opset=opset,
            name=f"TopK-axis{axis}-largest{largest}-k{k}-op{opset}",
        )
    )
CASES.append(
    GradCase("TopK", [distinct(3, 5), np.array([3], dtype=np.int64)], {"sorted": 0}, num_outputs=2, name="TopK-unsorted")
)
