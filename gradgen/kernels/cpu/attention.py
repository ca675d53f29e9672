"""CPU kernels: ONNX Attention (opset 23 / 24) and com.microsoft MultiHeadAttention (with its schema).

Both run gradgen.ops.attention's core; what they refuse (a sliding window, nonpad_kv_seqlen, packed
layouts with a bias, ...) is a KernelError naming the input or attribute.
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.table import MICROSOFT, cpu_kernel
from gradgen.ops import schemas
from gradgen.ops.attention import (
    QK_STAGES,
    attention_core,
    attention_spec,
    causal_allowed,
    check_heads,
    merge_heads,
    split_heads,
)
from gradgen.ops.schemas import DT, FLOATS, Attribute, Formal, Schema


@cpu_kernel("Attention")
def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None, **attrs):
    """(Y, present_key, present_value, qk_matmul_output) of ONNX Attention (gradgen.ops.attention)."""
    spec = attention_spec(attrs, "Attention", KernelError)
    if nonpad_kv_seqlen is not None:
        raise KernelError("Attention: input nonpad_kv_seqlen is not supported")
    if (past_key is None) != (past_value is None):
        raise KernelError("Attention: past_key and past_value must be given together")
    if not Q.ndim == K.ndim == V.ndim or Q.ndim not in (3, 4):
        raise KernelError(f"Attention: Q, K and V must all be 3-D or all 4-D, got ranks {Q.ndim}, {K.ndim}, {V.ndim}")
    if Q.ndim == 3:
        if spec.q_num_heads is None or spec.kv_num_heads is None:
            raise KernelError("Attention: 3-D inputs need the attributes q_num_heads and kv_num_heads")
        q, k, v = split_heads(Q, spec.q_num_heads), split_heads(K, spec.kv_num_heads), split_heads(V, spec.kv_num_heads)
    else:
        q, k, v = Q, K, V
    check_heads(q.shape[1], k.shape[1], "Attention", KernelError)
    past = 0 if past_key is None else past_key.shape[2]
    if past_key is not None:
        k, v = np.concatenate([past_key, k], axis=2), np.concatenate([past_value, v], axis=2)
    present_key, present_value = k, v
    dtype = q.dtype
    _check_broadcast("Attention", "attn_mask", attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    bias = None
    if spec.is_causal:
        bias = np.where(causal_allowed(q.shape[2], k.shape[2], past), dtype.type(0), dtype.type(-np.inf))
    if attn_mask is not None:
        if attn_mask.dtype == np.bool_:
            extra = np.where(attn_mask, dtype.type(0), dtype.type(-np.inf))
        elif attn_mask.dtype.kind == "f":
            extra = attn_mask.astype(dtype, copy=False)
        else:
            raise KernelError(f"Attention: attn_mask of type {attn_mask.dtype} is not supported (bool or float)")
        bias = extra if bias is None else bias + extra
    y, stages = attention_core(
        q,
        k,
        v,
        bias,
        scale=spec.scale,
        softcap=spec.softcap,
        softmax_dtype=spec.softmax_dtype,
        zero_masked_rows=True,
    )
    if Q.ndim == 3:
        y = merge_heads(y)
    return y, present_key, present_value, stages[QK_STAGES[spec.qk_mode]]


def _check_broadcast(where: str, name: str, value, scores: tuple) -> None:
    """KernelError unless ``value`` (when given) broadcasts to the scores' shape."""
    if value is None:
        return
    try:
        fits = np.broadcast_shapes(value.shape, scores) == scores
    except ValueError:
        fits = False
    if not fits:
        raise KernelError(f"{where}: {name} of shape {list(value.shape)} does not broadcast to the scores' shape {list(scores)}")


# -- com.microsoft MultiHeadAttention (ONNX Runtime's contract; gradgen.ops.attention) --------------


@cpu_kernel("MultiHeadAttention", domain=MICROSOFT)
def multi_head_attention(
    query,
    key=None,
    value=None,
    bias=None,
    key_padding_mask=None,
    attention_bias=None,
    past_key=None,
    past_value=None,
    past_sequence_length=None,
    cache_indirection=None,
    *,
    num_heads,
    scale=None,
    mask_filter_value=-10000.0,
    unidirectional=0,
    _wanted=(True,),
):
    """(output, present_key, present_value) of ONNX Runtime's MultiHeadAttention."""
    where = "MultiHeadAttention"
    if len(_wanted) > 3 and _wanted[3]:
        raise KernelError(f"{where}: output qk is not supported")
    q, k, v = mha_heads(query, key, value, bias, int(num_heads), where)
    if past_sequence_length is not None or cache_indirection is not None:
        raise KernelError(f"{where}: inputs past_sequence_length and cache_indirection (buffer sharing) are not supported")
    past = 0
    if past_key is not None or past_value is not None:
        if past_key is None or past_value is None or key is None or key.ndim != 3:
            raise KernelError(f"{where}: past_key and past_value go together, with a 3-D key and value")
        past = past_key.shape[2]
        k, v = np.concatenate([past_key, k], axis=2), np.concatenate([past_value, v], axis=2)
    masked = mha_masked(key_padding_mask, q.shape[0], q.shape[2], k.shape[2], where)
    dtype = q.dtype
    total = None if masked is None else np.where(masked, dtype.type(mask_filter_value), dtype.type(0))
    _check_broadcast(where, "attention_bias", attention_bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    if attention_bias is not None:
        total = attention_bias.astype(dtype, copy=False) if total is None else total + attention_bias
    if unidirectional:
        causal = np.where(causal_allowed(q.shape[2], k.shape[2], past), dtype.type(0), dtype.type(-np.inf))
        total = causal if total is None else total + causal
    y, _ = attention_core(q, k, v, total, scale=scale)
    return merge_heads(y), k, v


def mha_heads(query, key, value, bias, heads: int, where: str):
    """Q, K, V as (batch, heads, seq, size) from MultiHeadAttention's layouts: query (B, S, D) with key
    and value (B, L, D), or (B, N, L, H) without a bias. The packed layouts (5-D QKV or KV), which
    ONNX Runtime's CPU provider does not run either, are refused."""
    if query.ndim != 3 or key is None or value is None or key.ndim not in (3, 4):
        raise KernelError(f"{where}: gradgen supports a 3-D query with 3-D or 4-D key and value (no packed QKV / KV)")
    if key.ndim != value.ndim:
        raise KernelError(f"{where}: key and value must both be 3-D or both 4-D")
    if bias is not None:
        if key.ndim != 3:
            raise KernelError(f"{where}: a bias needs 3-D key and value")
        d, dv = query.shape[2], value.shape[2]
        query, key, value = query + bias[:d], key + bias[d : 2 * d], value + bias[2 * d : 2 * d + dv]
    if key.ndim == 3:
        return split_heads(query, heads), split_heads(key, heads), split_heads(value, heads)
    return split_heads(query, heads), key, value


def mha_masked(mask, batch: int, q_len: int, total: int, where: str):
    """Where key_padding_mask masks a key, as bools broadcastable to (batch, 1, q_len, total); None
    when there is no mask. Shapes: (batch,) key lengths, (batch, total), (batch, q_len, total)."""
    if mask is None:
        return None
    if mask.ndim == 1 and mask.shape[0] == batch:
        return (np.arange(total)[None, :] >= mask[:, None]).reshape(batch, 1, 1, total)
    if mask.ndim == 2 and mask.shape == (batch, total):
        return (mask == 0).reshape(batch, 1, 1, total)
    if mask.ndim == 3 and mask.shape == (batch, q_len, total):
        return (mask == 0).reshape(batch, 1, q_len, total)
    raise KernelError(
        f"{where}: key_padding_mask of shape {list(mask.shape)} is not supported "
        f"(({batch},), ({batch}, {total}) or ({batch}, {q_len}, {total}))"
    )


def _mha_types(infos, attrs):
    query, value = infos[0], infos[2] if len(infos) > 2 else None
    heads = int(attrs.get("num_heads") or 0)
    hidden_v = None
    if value is not None and value.shape is not None and len(value.shape) in (3, 4):
        v_shape = value.shape
        hidden_v = (
            v_shape[2]
            if len(v_shape) == 3
            else (v_shape[1] * v_shape[3] if isinstance(v_shape[3], int) and isinstance(v_shape[1], int) else None)
        )
    q_shape = query.shape
    out_shape = None if q_shape is None or len(q_shape) != 3 else (q_shape[0], q_shape[1], hidden_v)
    present = (query.dtype, None if q_shape is None else (q_shape[0], heads, None, None))
    return [(query.dtype, out_shape), present, present, (query.dtype, None)]


_MASK = frozenset({DT.INT32})

MULTI_HEAD_ATTENTION = schemas.declare(
    Schema(
        "MultiHeadAttention",
        inputs=(
            Formal("query", FLOATS),
            Formal("key", FLOATS, optional=True),
            Formal("value", FLOATS, optional=True),
            Formal("bias", FLOATS, optional=True),
            Formal("key_padding_mask", _MASK, optional=True),
            Formal("attention_bias", FLOATS, optional=True),
            Formal("past_key", FLOATS, optional=True),
            Formal("past_value", FLOATS, optional=True),
            Formal("past_sequence_length", _MASK, optional=True),
            Formal("cache_indirection", _MASK, optional=True),
        ),
        outputs=(
            Formal("output", FLOATS),
            Formal("present_key", FLOATS, optional=True),
            Formal("present_value", FLOATS, optional=True),
            Formal("qk", FLOATS, optional=True),
        ),
        attributes=(
            Attribute("num_heads", "int"),
            Attribute("scale", "float"),
            Attribute("mask_filter_value", "float", -10000.0),
            Attribute("unidirectional", "int", 0),
        ),
        infer=_mha_types,
    )
)
