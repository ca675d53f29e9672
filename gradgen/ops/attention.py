"""Scaled dot-product attention: ONNX Attention (opset 23 / 24) and ONNX Runtime's com.microsoft
MultiHeadAttention, their attributes and their numpy semantics, shared by the CPU kernels
(gradgen/kernels/cpu/attention.py) and the standard-op forms that build_backward differentiates
(gradgen/passes/lowering/attention.py; tests compare the two).

Both ops come down to one core on 4-D tensors (batch, heads, sequence, head size): Q and K each
scaled by sqrt(scale), scores = Q K^T, optionally softcapped (c tanh(scores / c)), plus an additive
bias, a softmax over the keys (in ``softmax_precision`` when given), times V. K and V with fewer
heads than Q (grouped-query attention) are repeated head by head (kv head j serves q heads
j * r .. j * r + r - 1, r = q heads / kv heads), as ONNX's reference and PyTorch's ``enable_gqa``
do.

ONNX Attention's bias: a causal mask aligned bottom-right (query i attends key j iff
j <= i + past length) and attn_mask (bool: False masks a key with -inf; float: added), summed. A
query row that every key masks (all -inf) gives a zero output row, as the spec's errata and ONNX
Runtime say. Its qk_matmul_output follows the spec (mode 0: the scores before the softcap; ONNX's
reference gives them after it, ONNX Runtime as the spec).

MultiHeadAttention's bias (ONNX Runtime's CPU contract, checked against it): ``mask_filter_value``
(default -10000, finite) where key_padding_mask masks a key (0 in a (batch, total) or (batch,
sequence, total) mask, or at or past a key's length in a (batch,) one), plus attention_bias, plus
-inf where ``unidirectional`` (causal, aligned bottom-right) masks it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx

# ONNX Attention's attributes this implementation refuses (opset 25's sliding window), with the
# value that means "off"
_WINDOW_ATTRIBUTES = ("left_window_size", "right_window_size")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """ONNX Attention's attributes, checked."""

    is_causal: bool
    scale: float | None  # None: 1 / sqrt(head size)
    softcap: float  # 0: none
    q_num_heads: int | None  # 3-D inputs only
    kv_num_heads: int | None
    qk_mode: int  # qk_matmul_output_mode, 0..3
    softmax_dtype: np.dtype | None  # softmax_precision as a numpy type; None: the scores' own


def attention_spec(attrs: dict, where: str, error: type[Exception]) -> AttentionSpec:
    """The spec of an Attention node from its attributes (plain values); ``error`` (ModelError for
    the standard form, KernelError for the kernel) names ``where`` for what is refused."""
    for name in _WINDOW_ATTRIBUTES:
        if int(attrs.get(name, -1) if attrs.get(name) is not None else -1) != -1:
            raise error(f"{where}: attribute {name} (sliding-window attention) is not supported")
    mode = int(attrs.get("qk_matmul_output_mode") or 0)
    if mode not in (0, 1, 2, 3):
        raise error(f"{where}: attribute qk_matmul_output_mode is {mode}; it must be 0, 1, 2 or 3")
    precision = attrs.get("softmax_precision")
    softmax_dtype = None
    if precision is not None:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(int(precision))) if int(precision) in _FLOAT_TYPES else None
        if dtype is None:
            raise error(f"{where}: attribute softmax_precision is {precision}; gradgen supports float16, float and double")
        softmax_dtype = dtype
    scale = attrs.get("scale")
    softcap = float(attrs.get("softcap") or 0.0)
    if softcap < 0:
        raise error(f"{where}: attribute softcap is {softcap}; it must be >= 0")
    heads = [attrs.get(n) for n in ("q_num_heads", "kv_num_heads")]
    return AttentionSpec(
        is_causal=bool(int(attrs.get("is_causal") or 0)),
        scale=None if scale is None else float(scale),
        softcap=softcap,
        q_num_heads=None if heads[0] is None else int(heads[0]),
        kv_num_heads=None if heads[1] is None else int(heads[1]),
        qk_mode=mode,
        softmax_dtype=softmax_dtype,
    )


_FLOAT_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def check_heads(q_heads: int, kv_heads: int, where: str, error: type[Exception]) -> int:
    """How many q heads each kv head serves; ``error`` unless kv heads divide q heads."""
    if kv_heads <= 0 or q_heads % kv_heads:
        raise error(f"{where}: {q_heads} query heads are not a multiple of {kv_heads} key / value heads")
    return q_heads // kv_heads


def causal_allowed(q_len: int, total_len: int, offset: int) -> np.ndarray:
    """(q_len, total_len) bools: query i attends key j iff j <= i + offset (bottom-right aligned)."""
    return np.arange(total_len)[None, :] <= np.arange(q_len)[:, None] + offset


# -- numpy semantics (the CPU kernels) ------------------------------------------------------------


def split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def merge_heads(x: np.ndarray) -> np.ndarray:
    """(batch, heads, seq, size) -> (batch, seq, heads * size)."""
    b, h, s, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, s, h * d)


def attention_core(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    bias: np.ndarray | None,
    *,
    scale: float | None,
    softcap: float = 0.0,
    softmax_dtype: np.dtype | None = None,
    zero_masked_rows: bool = False,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Y (batch, q heads, q len, v size) and the scores' stages ("raw", "capped", "biased",
    "probs") of attention on 4-D q, k, v (k and v may have fewer heads, grouped-query), in q's
    type. ``zero_masked_rows``: rows whose bias is -inf everywhere give zeros (ONNX Attention)."""
    reps = q.shape[1] // k.shape[1]
    if reps > 1:
        k, v = np.repeat(k, reps, axis=1), np.repeat(v, reps, axis=1)
    dtype = q.dtype
    root = dtype.type(np.sqrt(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale))
    raw = np.matmul(q * root, np.swapaxes(k * root, -1, -2)).astype(dtype, copy=False)
    capped = (softcap * np.tanh(raw / dtype.type(softcap))).astype(dtype, copy=False) if softcap > 0 else raw
    biased = capped if bias is None else (capped + bias).astype(dtype, copy=False)
    masked_rows = None
    scores = biased
    if zero_masked_rows and bias is not None:
        masked_rows = np.isneginf(np.max(bias, axis=-1, keepdims=True))
        scores = np.where(masked_rows, dtype.type(0), biased)
    scores = scores.astype(softmax_dtype or dtype, copy=False)
    e = np.exp(scores - np.max(scores, axis=-1, keepdims=True))
    probs = (e / np.sum(e, axis=-1, keepdims=True)).astype(dtype, copy=False)
    if masked_rows is not None:
        probs = np.where(masked_rows, dtype.type(0), probs)
    y = np.matmul(probs, v.astype(dtype, copy=False)).astype(dtype, copy=False)
    return y, {"raw": raw, "capped": capped, "biased": biased, "probs": probs}


QK_STAGES = ("raw", "capped", "biased", "probs")  # qk_matmul_output_mode 0..3
