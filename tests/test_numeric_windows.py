"""The window and padding helpers the pooling and convolution kernels share build their views and
arrays directly (numpy's sliding_window_view and np.pad cost tens of microseconds of Python per
call); they must give what numpy's generic routines give, for contiguous and strided inputs."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from gradgen.kernels.numeric import pad_spatial, sliding_windows


def _reference_windows(xp, kernel, strides, dilations, out):
    effective = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    view = sliding_window_view(xp, effective, axis=tuple(range(2, 2 + len(kernel))))
    index = (slice(None), slice(None))
    index += tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))
    index += tuple(slice(None, None, d) for d in dilations)
    return view[index]


@pytest.mark.parametrize(
    ("shape", "kernel", "strides", "dilations"),
    [
        ((2, 3, 9, 8), (3, 2), (2, 3), (2, 1)),
        ((1, 4, 7), (3,), (1,), (3,)),
        ((2, 1, 4, 5, 6), (2, 2, 3), (1, 2, 1), (1, 1, 2)),
        ((3, 2, 4, 4), (4, 4), (1, 1), (1, 1)),
    ],
)
def test_windows_are_numpys_sliding_windows(shape, kernel, strides, dilations):
    rng = np.random.default_rng(0)
    spatial = shape[2:]
    out = tuple((n - ((k - 1) * d + 1)) // s + 1 for n, k, s, d in zip(spatial, kernel, strides, dilations))
    x = rng.standard_normal(shape).astype(np.float32)
    for xp in (x, np.asfortranarray(x), x[:, ::-1]):
        got = sliding_windows(xp, kernel, strides, dilations, out)
        want = _reference_windows(xp, kernel, strides, dilations, out)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
        assert not got.flags.writeable  # windows overlap: a write through one would change others
        sums = got.sum(axis=tuple(range(2 + len(kernel), 2 + 2 * len(kernel))))
        assert sums.tobytes() == want.sum(axis=tuple(range(2 + len(kernel), 2 + 2 * len(kernel)))).tobytes()


@pytest.mark.parametrize("value", [0, -np.inf, 2.5])
def test_spatial_padding_is_numpys_constant_pad(value):
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    for begin, end in (((1, 0), (2, 3)), ((0, 0), (0, 1)), ((0, 0), (0, 0))):
        want = np.pad(x, [(0, 0), (0, 0), *zip(begin, end)], mode="constant", constant_values=value)
        got = pad_spatial(x[:, ::-1], begin, end, value)
        np.testing.assert_array_equal(got, np.pad(x[:, ::-1], [(0, 0), (0, 0), *zip(begin, end)], constant_values=value))
        assert pad_spatial(x, begin, end, value).tobytes() == want.tobytes()
    ints = np.arange(24, dtype=np.int32).reshape(1, 2, 3, 4)
    assert (
        pad_spatial(ints, (1, 1), (0, 2), -7).tobytes()
        == np.pad(ints, [(0, 0), (0, 0), (1, 0), (1, 2)], constant_values=-7).tobytes()
    )
