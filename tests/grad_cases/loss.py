"""Finite-difference cases: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(5)


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, shape)


def labels(shape, c, ignore=None, dtype=np.int64):
    out = rng.integers(0, c, shape)
    if ignore is not None:
        out.reshape(-1)[::3] = ignore  # every third sample ignored
    return out.astype(dtype)


CASES = []
C = 4
for op in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"):
    for scores_shape in ((5, C), (3, C, 2), (2, C, 2, 2)):
        label_shape = (scores_shape[0],) + scores_shape[2:]
        for reduction in ("none", "sum", "mean"):
            for ignore, weighted in ((None, False), (None, True), (1, False), (-100, True), (2, True)):
                attrs = {"reduction": reduction}
                if ignore is not None:
                    attrs["ignore_index"] = ignore
                scores = r(*scores_shape) if op == "SoftmaxCrossEntropyLoss" else r(*scores_shape, low=-3.0, high=-0.1)
                inputs = [scores, labels(label_shape, C, ignore)]
                if weighted:
                    inputs.append(rng.uniform(0.3, 1.5, (C,)))
                outs = (1, 2) if op == "SoftmaxCrossEntropyLoss" and reduction != "sum" else (1,)
                # opset 13: the weights' gradient goes through GatherGrad (ScatterElements add from 16)
                opset = 13 if weighted and ignore == 2 else 17
                for num_outputs in outs:
                    tag = f"{reduction}-ign{ignore}-w{int(weighted)}-out{num_outputs}-op{opset}"
                    CASES.append(
                        GradCase(op, inputs, attrs, num_outputs=num_outputs, opset=opset, name=f"{op}{scores_shape}-{tag}")
                    )

CASES += [
    # int32 labels, constant (non-trained) weights.
    GradCase(
        "SoftmaxCrossEntropyLoss",
        [r(4, 3), np.array([1, 0, 2, 1], dtype=np.int32), rng.uniform(0.3, 1.5, (3,))],
        {"reduction": "mean", "ignore_index": 0},
        const=(2,),
        name="SoftmaxCrossEntropyLoss-int32-constweights",
    ),
    GradCase(
        "NegativeLogLikelihoodLoss",
        [r(4, 3, 2, low=-3.0, high=-0.1), labels((4, 2), 3, dtype=np.int32)],
        {"reduction": "sum"},
        opset=18,
        name="NegativeLogLikelihoodLoss-int32",
    ),
    GradCase("SoftmaxCrossEntropyLoss", [r(3, 5), labels((3,), 5)], name="SoftmaxCrossEntropyLoss-default"),
]
