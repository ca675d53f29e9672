"""Finite-difference cases: ONNX Attention and com.microsoft MultiHeadAttention (differentiated in
their standard-op forms, DecomposePass): every float input, with causal masks, bool and float
masks, grouped-query heads, 3-D and 4-D layouts, past key / value, softcap and scale."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(23)


def r(*shape):
    return rng.uniform(-1.5, 1.5, shape)


def bools(*shape, p=0.7):
    mask = rng.random(shape) < p
    mask[..., 0] = True  # no row fully masked (its output is a constant zero)
    return mask


CASES = [
    GradCase("Attention", [r(2, 2, 3, 4), r(2, 2, 3, 4), r(2, 2, 3, 4)], opset=23, name="Attention_4d"),
    GradCase(
        "Attention",
        [r(1, 4, 3, 4), r(1, 2, 5, 4), r(1, 2, 5, 3)],
        {"is_causal": 1, "scale": 0.6},
        opset=23,
        name="Attention_4d_gqa_causal_cross",
    ),
    GradCase(
        "Attention",
        [r(2, 3, 8), r(2, 4, 4), r(2, 4, 6), r(2, 1, 3, 4)],
        {"q_num_heads": 2, "kv_num_heads": 1},
        opset=23,
        name="Attention_3d_mqa_float_mask",
    ),
    GradCase(
        "Attention",
        [r(1, 2, 3, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), bools(3, 5), r(1, 2, 2, 4), r(1, 2, 2, 4)],
        {"is_causal": 1, "softcap": 1.5},
        num_outputs=3,
        opset=23,
        name="Attention_past_causal_bool_mask_softcap",
    ),
    GradCase(
        "Attention",
        [r(1, 2, 3, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), r(3, 3)],
        {"qk_matmul_output_mode": 3},
        num_outputs=4,
        opset=23,
        name="Attention_qk_output_probs",
    ),
    GradCase(
        "MultiHeadAttention",
        [r(2, 3, 4), r(2, 5, 4), r(2, 5, 6), r(14), np.array([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1]], np.int32), r(1, 2, 3, 5)],
        {"num_heads": 2},
        domain="com.microsoft",
        name="MultiHeadAttention_bias_padding_attention_bias",
    ),
    GradCase(
        "MultiHeadAttention",
        [r(1, 3, 4), r(1, 3, 4), r(1, 3, 4), None, None, None, r(1, 2, 2, 2), r(1, 2, 2, 2)],
        {"num_heads": 2, "unidirectional": 1, "scale": 0.8},
        domain="com.microsoft",
        num_outputs=3,
        name="MultiHeadAttention_past_unidirectional",
    ),
    GradCase(
        "MultiHeadAttention",
        [r(2, 3, 4), r(2, 2, 4, 2), r(2, 2, 4, 2), None, np.array([3, 4], np.int32)],
        {"num_heads": 2},
        domain="com.microsoft",
        name="MultiHeadAttention_bnsh_key_lengths",
    ),
]
