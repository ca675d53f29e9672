"""Standard-op forms of ONNX Attention and com.microsoft MultiHeadAttention (the attention family):
what DecomposePass puts in their place before the gradient pass, so that the rules of MatMul,
Softmax, Add, Where, Tanh, Concat, Expand, ... differentiate Q, K, V, a float mask or bias and the
past key / value. The semantics are gradgen.ops.attention's (the CPU kernels'); tests compare the
two. Shapes may be symbolic: sizes the form needs and cannot read statically are taken with Shape.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.ops.attention import QK_STAGES, attention_spec, causal_allowed, check_heads
from gradgen.ops.attributes import node_attributes
from gradgen.passes.lowering.table import BASE_OPSET, MICROSOFT, is_needed, node_input, node_where, register_lowering

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
Size = int | ir.Value  # a size: static, or a rank-0 int64 value


def _ranked(node: ir.Node, i: int, name: str) -> tuple[ir.Value, list]:
    """Input i of the node and its dims; ModelError naming it when absent or of unknown rank."""
    value = node_input(node, i)
    dims = None if value is None else dims_of(value)
    if value is None or dims is None:
        raise ModelError(f"{node_where(node)}: its standard-op form needs input {name} and its rank")
    return value, dims


class _Form:
    """The emitter of one node's form: values in ``dtype`` (the query's type)."""

    def __init__(self, b: GraphBuilder, node: ir.Node, query: ir.Value):
        self.b, self.node, self.where = b, node, node_where(node)
        if query.dtype not in _FLOATS:
            raise ModelError(f"{self.where}: its standard-op form needs the (float) type of its query; it is not known")
        self.dtype = np.dtype(query.dtype.numpy())

        # the outputs' shapes are the form's to give (shape inference runs after the rewrite):
        # ONNX infers 0 for a 3-D Attention's symbolic hidden size, and DecomposePass gives the
        # query's shape to an output whose type is unknown (MultiHeadAttention's has V's hidden size)
        for out in node.outputs:
            if not out.is_graph_output():
                out.shape = None
            if out.type is None:
                out.type = query.type

    def const(self, value) -> ir.Value:
        return self.b.const(np.asarray(value, dtype=self.dtype))

    def size(self, x: ir.Value, dims: list | None, axis: int) -> Size:
        """Axis ``axis`` of x: an int when static, else a rank-0 int64 value."""
        if dims is not None and isinstance(dims[axis], int):
            return dims[axis]
        return self.b.op("Gather", self.b.shape_of(x), self.b.scalar(axis), axis=0)

    def split_heads(self, x: ir.Value, heads: int) -> ir.Value:
        """(batch, seq, heads * size) -> (batch, heads, seq, size)."""
        return self.b.transpose(self.b.reshape(x, [0, 0, heads, -1]), [0, 2, 1, 3])

    def merge_heads(self, y: ir.Value) -> ir.Value:
        return self.b.reshape(self.b.transpose(y, [0, 2, 1, 3]), [0, 0, -1])

    def as_type(self, x: ir.Value) -> ir.Value:
        return (
            x
            if x.dtype is not None and np.dtype(x.dtype.numpy()) == self.dtype
            else self.b.op("Cast", x, to=ir.DataType.from_numpy(self.dtype))
        )

    def repeat_kv(self, x: ir.Value, q: ir.Value, q_heads, kv_heads) -> ir.Value:
        """x (batch, kv heads, seq, size) with each head repeated for the q heads it serves."""
        b = self.b
        if isinstance(q_heads, int) and isinstance(kv_heads, int):
            reps = check_heads(q_heads, kv_heads, self.where, ModelError)
            if reps == 1:
                return x
            tiled = b.op("Expand", b.unsqueeze(x, [2]), b.ints([1, 1, reps, 1, 1]))
            return b.reshape(tiled, b.cat(b.ints([0, q_heads]), b.part(b.shape_of(x), 2, 4)))
        q_part, kv_part = b.part(b.shape_of(q), 1, 2), b.part(b.shape_of(x), 1, 2)
        reps_value = b.op("Div", q_part, kv_part)
        tiled = b.op("Expand", b.unsqueeze(x, [2]), b.cat(b.ints([1, 1]), reps_value, b.ints([1, 1])))
        return b.reshape(tiled, b.cat(b.ints([0]), q_part, b.part(b.shape_of(x), 2, 4)))

    def causal_allowed(self, q_len, total, past) -> ir.Value:
        """(q_len, total) bools: key j <= query i + past (static sizes: a constant)."""
        b = self.b
        if all(isinstance(v, int) for v in (q_len, total, past)):
            return b.const(causal_allowed(q_len, total, past))
        as_value = lambda v: b.scalar(v) if isinstance(v, int) else v  # noqa: E731
        rows = b.unsqueeze(b.op("Range", b.scalar(0), as_value(q_len), b.scalar(1)), [1])
        cols = b.op("Range", b.scalar(0), as_value(total), b.scalar(1))
        return b.op("LessOrEqual", cols, b.op("Add", rows, as_value(past)))

    def core(self, q, k, v, bias, *, head_size, scale, softcap=0.0, softmax_dtype=None, zero_masked_rows=False):
        """Y and the scores' stages of gradgen.ops.attention.attention_core, emitted (k, v already
        repeated for grouped-query attention)."""
        b = self.b
        if scale is not None:
            root = self.const(np.sqrt(scale))
        elif isinstance(head_size, int):
            root = self.const(np.sqrt(1.0 / np.sqrt(head_size)))
        else:
            size = b.op("Cast", head_size, to=ir.DataType.from_numpy(self.dtype))
            root = b.op("Pow", size, self.const(-0.25))
        raw = b.op("MatMul", b.op("Mul", q, root), b.transpose(b.op("Mul", k, root), [0, 1, 3, 2]))
        capped = raw
        if softcap > 0:
            capped = b.op("Mul", b.op("Tanh", b.op("Div", raw, self.const(softcap))), self.const(softcap))
        biased = capped if bias is None else b.op("Add", capped, bias)
        scores, rows = biased, None
        if zero_masked_rows and bias is not None:
            top = b.reduce("ReduceMax", bias, [-1], keepdims=1)
            rows = b.op("Equal", top, self.const(-np.inf))
            scores = b.op("Where", rows, self.const(0.0), biased)
        wide = softmax_dtype is not None and softmax_dtype != self.dtype
        if wide:
            scores = b.op("Cast", scores, to=ir.DataType.from_numpy(softmax_dtype))
        probs = b.op("Softmax", scores, axis=-1)
        if wide:
            probs = b.op("Cast", probs, to=ir.DataType.from_numpy(self.dtype))
        if rows is not None:
            probs = b.op("Where", rows, self.const(0.0), probs)
        y = b.op("MatMul", probs, v)
        return y, dict(zip(QK_STAGES, (raw, capped, biased, probs)))

    def output(self, k: int, value: ir.Value) -> ir.Value | None:
        """``value`` for output k when the graph uses it (an Identity where it is one of the node's
        inputs: the form's outputs take the node's output names)."""
        if k >= len(self.node.outputs) or not is_needed(self.node.outputs[k]):
            return None
        return self.b.op("Identity", value) if value in self.node.inputs else value


@register_lowering("Attention", domain="", min_opset=BASE_OPSET)
def lower_attention(b: GraphBuilder, node: ir.Node):
    """(Y, present_key, present_value, qk_matmul_output) of ONNX Attention in standard ops."""
    (q_in, q_dims), (k_in, k_dims), (v_in, v_dims) = (_ranked(node, i, name) for i, name in enumerate("QKV"))
    mask, past_k, past_v, nonpad = (node_input(node, i) for i in range(3, 7))
    f = _Form(b, node, q_in)
    spec = attention_spec(node_attributes(node), f.where, ModelError)
    if nonpad is not None:
        raise ModelError(f"{f.where}: input nonpad_kv_seqlen is not supported")
    if (past_k is None) != (past_v is None):
        raise ModelError(f"{f.where}: past_key and past_value must be given together")
    rank = len(q_dims)
    if not rank == len(k_dims) == len(v_dims) or rank not in (3, 4):
        raise ModelError(f"{f.where}: Q, K and V must all be 3-D or all 4-D (known ranks)")
    if rank == 3:
        if spec.q_num_heads is None or spec.kv_num_heads is None:
            raise ModelError(f"{f.where}: 3-D inputs need the attributes q_num_heads and kv_num_heads")
        q_heads, kv_heads = spec.q_num_heads, spec.kv_num_heads
        q, k, v = f.split_heads(q_in, q_heads), f.split_heads(k_in, kv_heads), f.split_heads(v_in, kv_heads)
        hidden = q_dims[2]
        head_size: Size
        head_size = hidden // q_heads if isinstance(hidden, int) else f.size(q, None, 3)
        q_len = f.size(q_in, q_dims, 1)
    else:
        q, k, v = q_in, k_in, v_in
        q_heads, kv_heads = q_dims[1], k_dims[1]
        head_size = f.size(q_in, q_dims, 3)
        q_len = f.size(q_in, q_dims, 2)
    k, v = f.as_type(k), f.as_type(v)
    past: Size = 0
    if past_k is not None and past_v is not None:
        past = f.size(past_k, dims_of(past_k), 2)
        k = b.op("Concat", f.as_type(past_k), k, axis=2)
        v = b.op("Concat", f.as_type(past_v), v, axis=2)
    present_k, present_v = k, v
    parts = []
    if spec.is_causal:
        kv_len = f.size(k_in, k_dims, 1 if rank == 3 else 2)
        total: Size
        if isinstance(kv_len, int) and isinstance(past, int):
            total = kv_len + past
        else:
            total = f.size(k, None, 2)
        parts.append(b.op("Where", f.causal_allowed(q_len, total, past), f.const(0.0), f.const(-np.inf)))
    if mask is not None:
        if mask.dtype == ir.DataType.BOOL:
            parts.append(b.op("Where", mask, f.const(0.0), f.const(-np.inf)))
        elif mask.dtype in _FLOATS:
            parts.append(f.as_type(mask))
        else:
            raise ModelError(f"{f.where}: attn_mask of type {mask.dtype} is not supported (bool or float)")
    bias = parts[0] if len(parts) == 1 else (b.op("Add", *parts) if parts else None)
    y, stages = f.core(
        q,
        f.repeat_kv(k, q, q_heads, kv_heads),
        f.repeat_kv(v, q, q_heads, kv_heads),
        bias,
        head_size=head_size,
        scale=spec.scale,
        softcap=spec.softcap,
        softmax_dtype=spec.softmax_dtype,
        zero_masked_rows=mask is not None,
    )
    if rank == 3:
        y = f.merge_heads(y)
    return [y, f.output(1, present_k), f.output(2, present_v), f.output(3, stages[QK_STAGES[spec.qk_mode]])]


@register_lowering("MultiHeadAttention", domain=MICROSOFT, min_opset=BASE_OPSET)
def lower_multi_head_attention(b: GraphBuilder, node: ir.Node):
    """(output, present_key, present_value) of ONNX Runtime's MultiHeadAttention in standard ops."""
    if node_input(node, 1) is None or node_input(node, 2) is None:
        raise ModelError(f"{node_where(node)}: gradgen supports query, key and value given apart (no packed QKV / KV)")
    (query, q_dims), (key, k_dims), (value, v_dims) = (_ranked(node, i, name) for i, name in enumerate(("query", "key", "value")))
    bias, padding, attention_bias, past_k, past_v, past_len, indirection = (node_input(node, i) for i in range(3, 10))
    f = _Form(b, node, query)
    if len(node.outputs) > 3 and is_needed(node.outputs[3]):
        raise ModelError(f"{f.where}: output qk is not supported")
    if past_len is not None or indirection is not None:
        raise ModelError(f"{f.where}: inputs past_sequence_length and cache_indirection (buffer sharing) are not supported")
    attrs = node_attributes(node)
    if attrs.get("num_heads") is None:
        raise ModelError(f"{f.where}: attribute num_heads is required")
    heads = int(attrs["num_heads"])
    if len(q_dims) != 3 or len(k_dims) not in (3, 4) or len(k_dims) != len(v_dims):
        raise ModelError(
            f"{f.where}: gradgen supports a 3-D query with 3-D or 4-D key and value (known ranks; no packed QKV / KV)"
        )
    q_in, k_in, v_in = query, f.as_type(key), f.as_type(value)
    if bias is not None:
        if len(k_dims) != 3:
            raise ModelError(f"{f.where}: a bias needs 3-D key and value")
        d = b.part(b.shape_of(query), 2, 3)
        two_d = b.op("Add", d, d)
        end = b.op("Add", two_d, b.part(b.shape_of(value), 2, 3))
        bias = f.as_type(bias)
        pieces = [(b.ints([0]), d), (d, two_d), (two_d, end)]
        q_in, k_in, v_in = (
            b.op("Add", x, b.op("Slice", bias, s, e, b.ints([0]))) for x, (s, e) in zip((q_in, k_in, v_in), pieces)
        )
    q = f.split_heads(q_in, heads)
    if len(k_dims) == 3:
        k, v = f.split_heads(k_in, heads), f.split_heads(v_in, heads)
        kv_len = f.size(key, k_dims, 1)
    else:
        k, v = k_in, v_in
        kv_len = f.size(key, k_dims, 2)
    past: Size = 0
    if past_k is not None or past_v is not None:
        if past_k is None or past_v is None or len(k_dims) != 3:
            raise ModelError(f"{f.where}: past_key and past_value go together, with a 3-D key and value")
        past = f.size(past_k, dims_of(past_k), 2)
        k = b.op("Concat", f.as_type(past_k), k, axis=2)
        v = b.op("Concat", f.as_type(past_v), v, axis=2)
    total: Size = kv_len + past if isinstance(kv_len, int) and isinstance(past, int) else f.size(k, None, 2)
    q_len = f.size(query, q_dims, 1)
    masked = _padding_masked(f, padding, q_dims[0], q_len, total)
    parts = []
    if masked is not None:
        fill = float(attrs.get("mask_filter_value", -10000.0))
        parts.append(b.op("Where", masked, f.const(fill), f.const(0.0)))
    if attention_bias is not None:
        parts.append(f.as_type(attention_bias))
    if int(attrs.get("unidirectional") or 0):
        parts.append(b.op("Where", f.causal_allowed(q_len, total, past), f.const(0.0), f.const(-np.inf)))
    bias_total = None
    for part in parts:
        bias_total = part if bias_total is None else b.op("Add", bias_total, part)
    head_size: Size | None = k_dims[3] if len(k_dims) == 4 else (q_dims[2] // heads if isinstance(q_dims[2], int) else None)
    if not isinstance(head_size, int):
        head_size = f.size(q, None, 3)
    y, _ = f.core(q, k, v, bias_total, head_size=head_size, scale=attrs.get("scale"))
    return [f.merge_heads(y), f.output(1, k), f.output(2, v)]


def _padding_masked(f: _Form, mask: ir.Value | None, batch, q_len, total) -> ir.Value | None:
    """key_padding_mask as bools (True: masked) broadcastable to (batch, heads, q_len, total)."""
    if mask is None:
        return None
    b = f.b
    dims = dims_of(mask)
    if dims is None or len(dims) not in (1, 2, 3):
        raise ModelError(f"{f.where}: key_padding_mask must be of rank 1, 2 or 3 (known); (3 * batch + 2) is not supported")
    if len(dims) == 1:
        if isinstance(dims[0], int) and isinstance(batch, int) and dims[0] != batch:
            raise ModelError(f"{f.where}: key_padding_mask of shape {dims} is not supported (key lengths of shape ({batch},))")
        keys = b.op("Range", b.scalar(0), total if not isinstance(total, int) else b.scalar(total), b.scalar(1))
        return b.unsqueeze(b.op("GreaterOrEqual", keys, b.unsqueeze(b.to_int64(mask), [1])), [1, 2])
    zero = b.const(np.zeros((), dtype=np.int32)) if mask.dtype == ir.DataType.INT32 else b.op("CastLike", b.scalar(0), mask)
    masked = b.op("Equal", mask, zero)
    return b.unsqueeze(masked, [1, 2] if len(dims) == 2 else [1])
