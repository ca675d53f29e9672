"""GridSample's attributes and sampling rule, shared by the CPU kernel and the standard-op form
that build_backward differentiates (gradgen/passes/decompose.py); AffineGrid's untransformed grid,
shared by its kernel and its gradient.

ONNX's rule (its reference implementation, PyTorch's CPU grid_sampler): grid[..., i] is the
normalized coordinate of spatial axis ``rank - 1 - i`` (x first). A coordinate is mapped to pixels
(``(g + 1) / 2 * (D - 1)`` with align_corners, else ``((g + 1) * D - 1) / 2``), rounded half to even
for nearest; one outside [lo, hi] (the corner pixels' centres with align_corners, else their outer
edges) is clamped to [0, D - 1] (border) or reflected into [lo, hi] (reflection). Linear and cubic
interpolation then read 2 or 4 taps per axis from floor(x): a tap outside the input reads 0
(zeros), the nearest edge pixel (border), or its reflection into [lo, hi] truncated to an integer
(reflection). One exception, where ONNX Runtime and PyTorch agree and the reference does not:
cubic interpolation with border padding clamps each tap, not the coordinate.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gradgen.errors import KernelError
from gradgen.ops.attributes import text

CUBIC_ALPHA = -0.75  # Keys' cubic convolution coefficient, as in Resize's cubic mode
# tap offsets from floor(x), per interpolation mode
TAP_OFFSETS = {"nearest": (0,), "linear": (0, 1), "cubic": (-1, 0, 1, 2)}
_MODE_NAMES = {"bilinear": "linear", "bicubic": "cubic"}  # opset 16's names


@dataclasses.dataclass(frozen=True)
class GridSampleSpec:
    mode: str  # nearest, linear or cubic
    padding_mode: str  # zeros, border or reflection
    align_corners: bool

    def bounds(self, size):
        """(lo, hi) of the coordinates that need no padding along an axis of ``size`` pixels."""
        return (0.0, size - 1.0) if self.align_corners else (-0.5, size - 0.5)


def grid_sample_spec(mode=None, padding_mode=None, align_corners=None) -> GridSampleSpec:
    mode_name = text(mode, "linear") or "linear"
    mode_name = _MODE_NAMES.get(mode_name, mode_name)
    padding = text(padding_mode, "zeros") or "zeros"
    if mode_name not in TAP_OFFSETS:
        raise KernelError(f"mode {mode_name!r} is not one of nearest, linear (bilinear), cubic (bicubic)")
    if padding not in ("zeros", "border", "reflection"):
        raise KernelError(f"padding_mode {padding!r} is not one of zeros, border, reflection")
    return GridSampleSpec(mode_name, padding, bool(int(align_corners or 0)))


def cubic_weights(t):
    """The four cubic weights of the taps at floor(x) - 1 .. floor(x) + 2, t = x - floor(x); written
    with + - * only, so it applies to numpy arrays and to the graph builder's wrappers alike."""
    a = CUBIC_ALPHA
    s = 1.0 - t
    return (
        ((a * (t + 1.0) - 5.0 * a) * (t + 1.0) + 8.0 * a) * (t + 1.0) - 4.0 * a,
        ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0,
        ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0,
        ((a * (s + 1.0) - 5.0 * a) * (s + 1.0) + 8.0 * a) * (s + 1.0) - 4.0 * a,
    )


def affine_base_grid(spatial, align_corners, dtype) -> np.ndarray:
    """AffineGrid's grid before the transform: (prod(spatial), nd + 1) rows of normalized homogeneous
    coordinates (x, y, [z,] 1), x along the last spatial axis; pixel centres (align_corners=0) or
    the corner pixels at -1 and 1 (align_corners=1), as ONNX's reference and PyTorch's affine_grid.
    An axis of one pixel is at 0 either way, as in PyTorch (the reference divides by zero there)."""
    axes = []
    for size in spatial:
        if bool(int(align_corners or 0)) and size > 1:
            axes.append(np.linspace(-1.0, 1.0, size))
        else:
            axes.append((np.arange(size) * 2.0 + 1.0) / size - 1.0)
    mesh = np.meshgrid(*axes, indexing="ij")  # one array per spatial axis, first axis first
    columns = [m.reshape(-1) for m in reversed(mesh)] + [np.ones(int(np.prod(spatial)))]
    return np.stack(columns, axis=1).astype(dtype)
