"""Broadcasting, as ONNX (numpy) defines it, and which axes each operand was broadcast over.

The gradient of a broadcasting op is summed over those axes: the gradient builder does it
statically when the shapes tell (``static_broadcast_axes``), BroadcastGradientArgs does it at run
time (``broadcast_gradient_axes``), and the lowering folds it when both shapes are constant.
"""

from __future__ import annotations

import math
from typing import Sequence

from gradgen.errors import KernelError

# The tanh-approximate GELU, 0.5 x (1 + tanh(TANH_GELU_SCALE (x + TANH_GELU_CUBIC x^3))): its two
# constants, for the CPU kernels, the gradient rules and the pass that recognises the formula (the
# CUDA sources spell them out in pointwise.h)
TANH_GELU_SCALE = math.sqrt(2.0 / math.pi)
TANH_GELU_CUBIC = 0.044715


def broadcast_gradient_axes(a_shape: Sequence[int], b_shape: Sequence[int]) -> tuple[list[int], list[int]]:
    """The axes of the broadcast result that each operand must be reduced over, in descending order
    (BroadcastGradientArgs's outputs). KernelError when the shapes do not broadcast."""
    a, b = list(a_shape), list(b_shape)
    a_axes: list[int] = []
    b_axes: list[int] = []
    i, j, k = len(a) - 1, len(b) - 1, max(len(a), len(b)) - 1
    while i >= 0 and j >= 0:
        if a[i] != b[j]:
            if a[i] == 1:
                a_axes.append(k)
            elif b[j] == 1:
                b_axes.append(k)
            else:
                raise KernelError(
                    f"broadcast is not possible between shapes {a} and {b} (dimension {a[i]} against {b[j]} at output axis {k})"
                )
        i, j, k = i - 1, j - 1, k - 1
    (a_axes if i < 0 else b_axes).extend(range(k, -1, -1))
    return a_axes, b_axes


def same_dim(a, b) -> bool:
    """True only when two dims (int, symbol name or None) are provably equal; unknown never is."""
    return a is not None and b is not None and a == b


def static_broadcast_axes(x_dims: list | None, out_dims: list | None) -> list[int] | None:
    """Axes of ``out`` that broadcasting added to x (ascending), or None when the shapes cannot tell.

    Dims are ints, symbol names or None. A size-1 dim of x against an unknown output dim counts as
    broadcast: reducing a size-1 axis is harmless when the output's turns out to be 1 too.
    """
    if x_dims is None or out_dims is None or len(x_dims) > len(out_dims):
        return None
    lead = len(out_dims) - len(x_dims)
    axes = list(range(lead))
    for i, d in enumerate(x_dims):
        o = out_dims[lead + i]
        if same_dim(d, o):
            continue
        if d == 1:
            axes.append(lead + i)
        else:
            return None
    return axes
