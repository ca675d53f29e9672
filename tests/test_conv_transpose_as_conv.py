"""ConvTranspose is the input gradient of a Conv (``gradgen.ops.conv.conv_transpose_as_conv``): the
GPU runs it as cuDNN's dgrad. The mapping is checked here on the CPU kernels: ConvGrad's dX at
dY = x equals ConvTranspose(x, w) for strides, dilations, pads, output_padding, output_shape,
SAME padding and groups, and the cases the mapping cannot express say so (None)."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.kernels import registry
from gradgen.ops.conv import conv_transpose_as_conv

CASES = [
    ((2, 4, 5, 6), (4, 3, 3, 3), {}),
    ((2, 4, 5, 6), (4, 3, 3, 3), {"strides": [2, 2], "pads": [1, 0, 0, 1]}),
    ((1, 3, 4, 4), (3, 2, 3, 2), {"strides": [2, 1], "output_padding": [1, 0], "dilations": [1, 2]}),
    ((2, 4, 5, 5), (4, 2, 3, 3), {"group": 2, "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 2, 7), (2, 3, 4), {"strides": [3], "pads": [2, 1]}),
    ((1, 2, 3, 4), (2, 3, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 2, 3, 4), (2, 3, 2, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    ((1, 2, 3, 4), (2, 3, 3, 3), {"output_shape": [6, 8], "strides": [2, 2]}),
    ((1, 2, 2, 2, 3), (2, 2, 2, 2, 2), {"strides": [1, 2, 2], "pads": [0, 1, 0, 0, 1, 1]}),
]


@pytest.mark.parametrize(("x_shape", "w_shape", "attrs"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_conv_transpose_is_the_conv_input_gradient(x_shape, w_shape, attrs):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(x_shape)
    w = rng.standard_normal(w_shape)
    want = registry.lookup("", "ConvTranspose").cpu(x, w, **attrs)
    mapped = conv_transpose_as_conv(x_shape, w_shape, attrs)
    assert mapped is not None
    conv_x_shape, conv_attrs = mapped
    assert conv_x_shape == want.shape
    dx = registry.lookup("com.microsoft", "ConvGrad").cpu(x, np.zeros(conv_x_shape), w, _num_outputs=1, **conv_attrs)[0]
    np.testing.assert_allclose(dx, want, rtol=1e-12, atol=1e-12)


def test_outputs_past_the_full_result_are_not_mapped():
    # an output_shape longer than the full result: the Conv would need negative end padding
    assert conv_transpose_as_conv((1, 2, 3, 3), (2, 2, 3, 3), {"output_shape": [6, 6]}) is None
    # output_padding as large as the stride: a Conv of that input would give a longer output than x's
    assert conv_transpose_as_conv((1, 2, 3, 3), (2, 2, 3, 3), {"strides": [2, 2], "output_padding": [2, 2]}) is None
