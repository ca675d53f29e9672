"""ONNX backend node tests that gradgen's executor cannot pass, each with the reason.

``EXCLUDED`` maps an ONNX backend node test name to why it cannot pass; tests/test_backend_nodes.py
reports those tests as skipped with that reason. Only real limits belong here: element types
gradgen does not have (gradgen's tensors are bool, int8-int64, uint8-uint64, float16, float32
and float64), sequence/optional values, and randomness the expected output depends on. A kernel bug
is fixed, not excluded.

``TOLERANCES`` loosens the comparison for tests whose expected output is itself imprecise.

docs/BACKEND_TESTS.md lists the same entries; regenerate its tables with
``python tests/backend_exclusions.py --markdown``.
"""

from __future__ import annotations

_RANDOM_DROPOUT = "training-mode Dropout draws a random mask; gradgen's (numpy's PCG64) is not the expected output's"
_RANDOM_BERNOULLI = "Bernoulli draws random numbers; gradgen's (numpy's PCG64, seeded or not) are not the expected output's"


_BF16_ROUNDING = (
    "bfloat16: gradgen computes in float32 and rounds once; the expected values round to bfloat16 after "
    "each step (one bfloat16 ulp apart), and the harness compares bfloat16 exactly"
)
_NONPAD_KV = "Attention's nonpad_kv_seqlen input (opset 24): refused with a one-line error naming the node"
_WINDOW = (
    "sliding-window Attention (left_window_size / right_window_size, opset 25): refused with a one-line error naming the node"
)

_LOW_BIT_QUANT = "float8, 4-bit and 2-bit quantized types: refused with a one-line error naming the node"
EXCLUDED: dict[str, str] = {
    "test_quantizelinear_e4m3fn": _LOW_BIT_QUANT,
    "test_quantizelinear_e5m2": _LOW_BIT_QUANT,
    "test_quantizelinear_uint4": _LOW_BIT_QUANT,
    "test_quantizelinear_int4": _LOW_BIT_QUANT,
    "test_quantizelinear_uint2": _LOW_BIT_QUANT,
    "test_quantizelinear_int2": _LOW_BIT_QUANT,
    "test_quantizelinear_float4e2m1": _LOW_BIT_QUANT,
    "test_dequantizelinear_e4m3fn": _LOW_BIT_QUANT,
    "test_dequantizelinear_e4m3fn_float16": _LOW_BIT_QUANT,
    "test_dequantizelinear_e4m3fn_zero_point": _LOW_BIT_QUANT,
    "test_dequantizelinear_e5m2": _LOW_BIT_QUANT,
    "test_dequantizelinear_uint4": _LOW_BIT_QUANT,
    "test_dequantizelinear_int4": _LOW_BIT_QUANT,
    "test_dequantizelinear_uint2": _LOW_BIT_QUANT,
    "test_dequantizelinear_int2": _LOW_BIT_QUANT,
    "test_dequantizelinear_float4e2m1": _LOW_BIT_QUANT,
    "test_attention_4d_causal_bf16": _BF16_ROUNDING,
    "test_attention_4d_padded_kv_bf16": _BF16_ROUNDING,
    "test_attention_4d_causal_padded_kv_bf16": _BF16_ROUNDING,
    "test_attention_4d_attn_mask_causal_bf16": _BF16_ROUNDING,
    "test_attention_3d_causal_bf16": _BF16_ROUNDING,
    "test_attention_4d_diff_heads_mask4d_padded_kv": _NONPAD_KV,
    "test_attention_4d_gqa_causal_nonpad_decode": _NONPAD_KV,
    "test_attention_4d_gqa_causal_nonpad_decode_fp16": _NONPAD_KV,
    "test_attention_4d_causal_nonpad_continued_prefill": _NONPAD_KV,
    "test_attention_4d_causal_nonpad_negative_offset_structural_empty": _NONPAD_KV,
    "test_attention_4d_causal_nonpad_attn_mask_composition": _NONPAD_KV,
    "test_attention_4d_causal_nonpad_batch_prefill": _NONPAD_KV,
    "test_attention_local_window": _WINDOW,
    "test_attention_bidirectional_window": _WINDOW,
    "test_attention_local_window_rank1_boolean_mask": _WINDOW,
    "test_attention_local_window_with_past": _WINDOW,
    "test_attention_local_window_ext_cache_rank3_head_mask": _WINDOW,
    "test_attention_local_window_ext_cache_rank4_batch_mask": _WINDOW,
    "test_attention_local_window_ext_cache_rank2_mask": _WINDOW,
    "test_attention_local_window_ext_cache_float16_mask": _WINDOW,
    "test_attention_3d_local_window": _WINDOW,
    "test_attention_local_window_gqa_rank4_mask": _WINDOW,
    "test_attention_3d_causal_bf16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_attention_4d_attn_mask_causal_bf16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_attention_4d_causal_bf16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_attention_4d_causal_padded_kv_bf16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_attention_4d_padded_kv_bf16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_cast_BFLOAT16_to_FLOAT": "BFLOAT16 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_FLOAT4E2M1": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_INT2": "INT2 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_INT4": "INT4 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_UINT2": "UINT2 tensors: not a gradgen element type",
    "test_cast_FLOAT16_to_UINT4": "UINT4 tensors: not a gradgen element type",
    "test_cast_FLOAT4E2M1_to_FLOAT": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_cast_FLOAT4E2M1_to_FLOAT16": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_cast_FLOAT8E4M3FNUZ_to_FLOAT": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT8E4M3FNUZ_to_FLOAT16": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT8E4M3FN_to_FLOAT": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_FLOAT8E4M3FN_to_FLOAT16": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_FLOAT8E5M2FNUZ_to_FLOAT": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT8E5M2FNUZ_to_FLOAT16": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT_to_BFLOAT16": "BFLOAT16 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_FLOAT4E2M1": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_FLOAT_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_cast_FLOAT_to_INT2": "INT2 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_INT4": "INT4 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_UINT2": "UINT2 tensors: not a gradgen element type",
    "test_cast_FLOAT_to_UINT4": "UINT4 tensors: not a gradgen element type",
    "test_cast_INT2_to_FLOAT": "INT2 tensors: not a gradgen element type",
    "test_cast_INT2_to_FLOAT16": "INT2 tensors: not a gradgen element type",
    "test_cast_INT2_to_INT8": "INT2 tensors: not a gradgen element type",
    "test_cast_INT4_to_FLOAT": "INT4 tensors: not a gradgen element type",
    "test_cast_INT4_to_FLOAT16": "INT4 tensors: not a gradgen element type",
    "test_cast_INT4_to_INT8": "INT4 tensors: not a gradgen element type",
    "test_cast_UINT2_to_FLOAT": "UINT2 tensors: not a gradgen element type",
    "test_cast_UINT2_to_FLOAT16": "UINT2 tensors: not a gradgen element type",
    "test_cast_UINT2_to_UINT8": "UINT2 tensors: not a gradgen element type",
    "test_cast_UINT4_to_FLOAT": "UINT4 tensors: not a gradgen element type",
    "test_cast_UINT4_to_FLOAT16": "UINT4 tensors: not a gradgen element type",
    "test_cast_UINT4_to_UINT8": "UINT4 tensors: not a gradgen element type",
    "test_cast_e8m0_FLOAT16_to_FLOAT8E8M0": "FLOAT8E8M0 tensors: not a gradgen element type",
    "test_cast_e8m0_FLOAT8E8M0_to_FLOAT": "FLOAT8E8M0 tensors: not a gradgen element type",
    "test_cast_e8m0_FLOAT8E8M0_to_FLOAT16": "FLOAT8E8M0 tensors: not a gradgen element type",
    "test_cast_e8m0_FLOAT_to_FLOAT8E8M0": "FLOAT8E8M0 tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_cast_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_BFLOAT16_to_FLOAT": "BFLOAT16 tensors: not a gradgen element type",
    "test_castlike_BFLOAT16_to_FLOAT_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT4E2M1": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT4E2M1_expanded": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FNUZ_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E4M3FN_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E5M2FNUZ_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_FLOAT8E5M2_expanded": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_INT2": "INT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_INT2_expanded": "INT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_INT4": "INT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_INT4_expanded": "INT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_UINT2": "UINT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_UINT2_expanded": "UINT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_UINT4": "UINT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT16_to_UINT4_expanded": "UINT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT4E2M1_to_FLOAT": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT4E2M1_to_FLOAT16": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT4E2M1_to_FLOAT16_expanded": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT4E2M1_to_FLOAT_expanded": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT16_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FNUZ_to_FLOAT_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT16": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT16_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT8E4M3FN_to_FLOAT_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT16_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT8E5M2FNUZ_to_FLOAT_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_BFLOAT16": "BFLOAT16 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_BFLOAT16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT4E2M1": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT4E2M1_expanded": "FLOAT4E2M1 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E4M3FNUZ_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E4M3FN_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E5M2FNUZ_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_FLOAT8E5M2_expanded": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_INT2": "INT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_INT2_expanded": "INT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_INT4": "INT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_INT4_expanded": "INT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_UINT2": "UINT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_UINT2_expanded": "UINT2 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_UINT4": "UINT4 tensors: not a gradgen element type",
    "test_castlike_FLOAT_to_UINT4_expanded": "UINT4 tensors: not a gradgen element type",
    "test_castlike_INT2_to_FLOAT": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT2_to_FLOAT16": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT2_to_FLOAT16_expanded": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT2_to_FLOAT_expanded": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT2_to_INT8": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT2_to_INT8_expanded": "INT2 tensors: not a gradgen element type",
    "test_castlike_INT4_to_FLOAT": "INT4 tensors: not a gradgen element type",
    "test_castlike_INT4_to_FLOAT16": "INT4 tensors: not a gradgen element type",
    "test_castlike_INT4_to_FLOAT16_expanded": "INT4 tensors: not a gradgen element type",
    "test_castlike_INT4_to_FLOAT_expanded": "INT4 tensors: not a gradgen element type",
    "test_castlike_INT4_to_INT8": "INT4 tensors: not a gradgen element type",
    "test_castlike_INT4_to_INT8_expanded": "INT4 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_FLOAT": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_FLOAT16": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_FLOAT16_expanded": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_FLOAT_expanded": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_UINT8": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT2_to_UINT8_expanded": "UINT2 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_FLOAT": "UINT4 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_FLOAT16": "UINT4 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_FLOAT16_expanded": "UINT4 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_FLOAT_expanded": "UINT4 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_UINT8": "UINT4 tensors: not a gradgen element type",
    "test_castlike_UINT4_to_UINT8_expanded": "UINT4 tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FNUZ_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E4M3FN_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2FNUZ_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT16_to_FLOAT8E5M2_expanded": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FNUZ_expanded": "FLOAT8E4M3FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E4M3FN_expanded": "FLOAT8E4M3FN tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2FNUZ_expanded": "FLOAT8E5M2FNUZ tensors: not a gradgen element type",
    "test_castlike_no_saturate_FLOAT_to_FLOAT8E5M2_expanded": "FLOAT8E5M2 tensors: not a gradgen element type",
    "test_celu_bfloat16_expanded": "BFLOAT16 tensors: not a gradgen element type",
    "test_einsum_batch_matmul_bfloat16": "BFLOAT16 tensors: not a gradgen element type",
    "test_einsum_sum_bfloat16": "BFLOAT16 tensors: not a gradgen element type",
    "test_identity_opt": "optional-typed input and output: gradgen runs tensors only",
    "test_identity_sequence": "sequence-typed input and output: gradgen runs tensors only",
    "test_training_dropout": _RANDOM_DROPOUT,
    **{
        f"test_bernoulli{kind}{expanded}": _RANDOM_BERNOULLI
        for kind in ("", "_double", "_seed")
        for expanded in ("", "_expanded")
    },
    "test_training_dropout_default": _RANDOM_DROPOUT,
    "test_training_dropout_default_mask": _RANDOM_DROPOUT,
    "test_training_dropout_mask": _RANDOM_DROPOUT,
}

# test name -> (rtol, atol, why); replaces the per-dtype default tolerance for that test.
TOLERANCES: dict[str, tuple[float, float, str]] = {
    "test_averagepool_2d_ceil_last_window_starts_on_pad": (
        1e-3,
        1e-6,
        "the expected output is written by hand with 4 significant digits",
    ),
    "test_gridsample_bicubic": (1e-3, 1e-4, "the expected output is written by hand with 4 decimals"),
    "test_roialign_aligned_false": (1e-3, 1e-4, "the expected output is written by hand with 4 decimals"),
    "test_roialign_aligned_true": (1e-3, 1e-4, "the expected output is written by hand with 4 decimals"),
}


def markdown() -> str:
    """The exclusion and tolerance tables of docs/BACKEND_TESTS.md."""
    lines = ["| test | reason |", "| --- | --- |"]
    lines += [f"| `{name}` | {why} |" for name, why in sorted(EXCLUDED.items())]
    lines += ["", "| test with its own tolerance | rtol, atol: reason |", "| --- | --- |"]
    lines += [f"| {name} | {rtol:g}, {atol:g}: {why} |" for name, (rtol, atol, why) in sorted(TOLERANCES.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--markdown" in sys.argv:
        print(markdown())
    else:
        print(f"{len(EXCLUDED)} excluded tests, {len(TOLERANCES)} with their own tolerance")
