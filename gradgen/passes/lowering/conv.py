"""Lowering of ConvGrad (the conv family) to standard ONNX ops."""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of
from gradgen.errors import ModelError
from gradgen.ops.attributes import get_attr
from gradgen.passes.lowering.table import is_needed, node_input, node_where, register_lowering


def _conv_pads(e: GraphBuilder, node: ir.Node, x: ir.Value, kernel, kernel_value, strides, dilations, nd):
    """(begin, end) pads of the forward Conv: lists of ints when static, else int64 vectors
    computed from X's shape (auto_pad SAME_* with X's spatial dims unknown)."""
    auto_pad = get_attr(node, "auto_pad", "NOTSET") or "NOTSET"
    if auto_pad == "NOTSET":
        pads = get_attr(node, "pads", [0] * (2 * nd))
        if len(pads) != 2 * nd:
            raise ModelError(f"{node_where(node)}: pads {pads} must have {2 * nd} values")
        return list(pads[:nd]), list(pads[nd:])
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ModelError(f"{node_where(node)}: unknown auto_pad {auto_pad!r}")
    x_dims = dims_of(x)
    spatial = None if x_dims is None else x_dims[2:]
    if kernel is not None and spatial is not None and all(isinstance(d, int) for d in spatial):
        span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        total = [max(0, (o - 1) * s + sp - n) for o, s, sp, n in zip(out, strides, span, spatial)]
        small, big = [t // 2 for t in total], [t - t // 2 for t in total]
        return (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    # The same arithmetic on X's runtime shape.
    n = e.part(e.shape_of(x), 2, 2 + nd)
    s_vec = e.ints(strides)
    if kernel is not None:
        span_vec = e.ints([(k - 1) * d + 1 for k, d in zip(kernel, dilations)])
    else:
        span_vec = e.op("Add", e.op("Mul", e.op("Sub", kernel_value, e.ints([1] * nd)), e.ints(dilations)), e.ints([1] * nd))
    out = e.op("Div", e.op("Add", n, e.ints([s - 1 for s in strides])), s_vec)
    reach = e.op("Add", e.op("Mul", e.op("Sub", out, e.ints([1] * nd)), s_vec), span_vec)
    total = e.op("Max", e.op("Sub", reach, n), e.ints([0] * nd))
    small = e.op("Div", total, e.ints([2] * nd))
    big = e.op("Sub", total, small)
    return (small, big) if auto_pad == "SAME_UPPER" else (big, small)


def _pads_vector(e: GraphBuilder, begin, end, lead: int = 2) -> ir.Value:
    """Pad's pads for a tensor with ``lead`` unpadded leading axes."""
    zeros = e.ints([0] * lead)
    as_value = lambda v: v if isinstance(v, ir.Value) else e.ints(v)
    return e.cat(zeros, as_value(begin), zeros, as_value(end))


@register_lowering("ConvGrad")
def lower_conv_grad(e: GraphBuilder, node: ir.Node):
    """dX by ConvTranspose, dW by a Conv of X with dY (batch and channels swapped), dB by ReduceSum."""
    dy, x, w = (node_input(node, i) for i in range(3))
    x_dims, w_dims, dy_dims = dims_of(x), dims_of(w), dims_of(dy)
    kernel = get_attr(node, "kernel_shape")
    if w_dims is not None and all(isinstance(d, int) for d in w_dims[2:]):
        kernel = list(w_dims[2:])
    nd = len(kernel) if kernel is not None else _conv_spatial_rank(node, x_dims, w_dims, dy_dims)
    kernel_value = e.ints(kernel) if kernel is not None else e.part(e.shape_of(w), 2, 2 + nd)
    group = int(get_attr(node, "group", 1))
    strides = list(get_attr(node, "strides", [1] * nd))
    dilations = list(get_attr(node, "dilations", [1] * nd))
    begin, end = _conv_pads(e, node, x, kernel, kernel_value, strides, dilations, nd)
    static_pads = not isinstance(begin, ir.Value)
    spatial = None if x_dims is None else x_dims[2:]
    static_spatial = spatial is not None and all(isinstance(d, int) for d in spatial)
    spatial_axes = list(range(2, 2 + nd))
    outs = list(node.outputs) + [None] * (3 - len(node.outputs))
    results: list[ir.Value | None] = [None, None, None]

    if is_needed(outs[0]):
        if static_pads and ((static_spatial and kernel is not None) or all(s == 1 for s in strides)):
            output_padding = [0] * nd
            if static_spatial and kernel is not None:
                span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
                output_padding = [(n + b + f - sp) % s for n, b, f, sp, s in zip(spatial, begin, end, span, strides)]
            results[0] = e.op(
                "ConvTranspose",
                dy,
                w,
                strides=strides,
                dilations=dilations,
                group=group,
                pads=begin + end,
                kernel_shape=kernel,
                output_padding=output_padding if any(output_padding) else None,
            )
        else:
            # Unpadded ConvTranspose covers padded-X positions [0, L); dX is positions
            # [begin, begin + X) of the padded X, zero past L.
            full = e.op("ConvTranspose", dy, w, strides=strides, dilations=dilations, group=group, kernel_shape=kernel)
            n = e.part(e.shape_of(x), 2, 2 + nd)
            starts = begin if isinstance(begin, ir.Value) else e.ints(begin)
            window = e.op("Slice", full, starts, e.op("Add", starts, n), e.ints(spatial_axes))
            short = e.op("Sub", n, e.part(e.op("Shape", window), 2, 2 + nd))
            results[0] = e.op("Pad", window, e.cat(e.ints([0] * (2 + nd)), e.ints([0, 0]), short))

    if is_needed(outs[1]):
        lead = [1, 0] + spatial_axes
        xs = x
        conv_pads = begin + end if static_pads else None
        if not static_pads:
            xs = e.op("Pad", x, _pads_vector(e, begin, end))
        if group == 1:
            xt = e.op("Transpose", xs, perm=lead)  # (C, N, *spatial)
            dyt = e.op("Transpose", dy, perm=lead)  # (M, N, *out)
        else:
            x_shape, dy_shape, w_shape = e.shape_of(xs), e.shape_of(dy), e.shape_of(w)
            cg, filters = e.part(w_shape, 1, 2), e.part(w_shape, 0, 1)
            per_group = (
                e.ints([w_dims[0] // group])
                if w_dims is not None and isinstance(w_dims[0], int)
                else e.op("Div", filters, e.ints([group]))
            )
            rest = list(range(3, 3 + nd))
            # X (N, G*Cg, *sp) -> (Cg, G*N, *sp): batch Cg, G groups of N channels.
            xg = e.op("Reshape", xs, e.cat(e.part(x_shape, 0, 1), e.ints([group]), cg, e.part(x_shape, 2, 2 + nd)))
            xt = e.op(
                "Reshape", e.op("Transpose", xg, perm=[2, 1, 0] + rest), e.cat(cg, e.ints([-1]), e.part(x_shape, 2, 2 + nd))
            )
            # dY (N, G*Mg, *out) -> (G*Mg, N, *out): G groups of Mg filters over N channels.
            dyg = e.op("Reshape", dy, e.cat(e.part(dy_shape, 0, 1), e.ints([group]), per_group, e.part(dy_shape, 2, 2 + nd)))
            dyt = e.op(
                "Reshape",
                e.op("Transpose", dyg, perm=[1, 2, 0] + rest),
                e.cat(filters, e.ints([-1]), e.part(dy_shape, 2, 2 + nd)),
            )
        full = e.op("Conv", xt, dyt, strides=dilations, dilations=strides, pads=conv_pads, group=group)
        dw = e.op("Transpose", full, perm=lead)  # (M, Cg, *k')
        if not (static_pads and kernel is not None and _crop_is_noop(x_dims, dy_dims, kernel, begin, end, strides, dilations)):
            dw = e.op("Slice", dw, e.ints([0] * nd), kernel_value, e.ints(spatial_axes))
        results[1] = dw

    if is_needed(outs[2]):
        results[2] = e.op("ReduceSum", dy, e.ints([0] + spatial_axes), keepdims=0)
    return results


def _conv_spatial_rank(node: ir.Node, *dims) -> int:
    for name in ("strides", "dilations"):
        if name in node.attributes:
            return len(get_attr(node, name))
    if "pads" in node.attributes:
        return len(get_attr(node, "pads")) // 2
    for d in dims:
        if d is not None:
            return len(d) - 2
    raise ModelError(
        f"{node_where(node)}: the number of spatial axes is unknown (no kernel_shape, strides, dilations "
        "or pads attribute, and X, W and dY have unknown ranks)"
    )


def _crop_is_noop(x_dims, dy_dims, kernel, begin, end, strides, dilations) -> bool:
    """True when the dW Conv's output is already kernel-sized (statically known)."""
    if x_dims is None or dy_dims is None:
        return False
    for i, k in enumerate(kernel):
        n, o = x_dims[2 + i], dy_dims[2 + i]
        if not isinstance(n, int) or not isinstance(o, int):
            return False
        size = (n + begin[i] + end[i] - ((o - 1) * strides[i] + 1)) // dilations[i] + 1
        if size != k:
            return False
    return True
