"""Gradient rules: convolution, and Col2Im (its transpose is a Conv with one-hot kernels).

Conv emits one com.microsoft ConvGrad(dY, X, W) carrying the forward attributes verbatim, as ONNX
Runtime training does. ConvTranspose is the input-gradient of a Conv, so its gradients are a Conv
(dX) and a ConvGrad with the roles of X and dY exchanged (dW).
"""

from __future__ import annotations

import numpy as np

from gradgen.builder import MICROSOFT, dims_of, is_static, numpy_dtype_of
from gradgen.errors import KernelError, ModelError
from gradgen.grads.rules.shape import folded_const
from gradgen.grads.table import grad_rule, non_differentiable
from gradgen.ops.conv import col2im_geometry

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def node_where(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


def forward_attrs(g, names=None) -> dict:
    """The forward node's attributes (all, or those in ``names``) as plain python values."""
    out = {}
    for name, attr in g.node.attributes.items():
        if names is None or name in names:
            value = attr.value
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def as_text(value) -> str:
    """A string attribute as str (onnx-ir may hand it over as bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def known_rank(g, x) -> int:
    rank = g.rank(x)
    if rank is None:
        raise ModelError(f"{node_where(g)}: the rank of {x.name!r} is unknown; its gradient needs it")
    return rank


def emit_conv_grad(g, dy, x, w, want, likes, **attrs):
    """ConvGrad(dy, x, w) with outputs [dX, dW, dB] where wanted ("" for unwanted, trailing ones dropped)."""
    if not any(want):
        return [None] * len(want)
    last = max(i for i, flag in enumerate(want) if flag)
    names = [f"{g.prefix}/{n}" if want[i] else "" for i, n in enumerate(("dX", "dW", "dB")[: last + 1])]
    outs = g.op_multi("ConvGrad", [dy, x, w], len(names), domain=MICROSOFT, output_names=names, **attrs)
    return [g.set_type_like(o, like) if want[i] else None for i, (o, like) in enumerate(zip(outs, likes))]


@grad_rule("Conv")
def conv(g):
    """One ConvGrad(dY, X, W) with the forward attributes; dB only when a bias wants a gradient."""
    x, w, b = g.x(0), g.x(1), g.x(2)
    want = [g.needs(0), g.needs(1), b is not None and g.needs(2)]
    return emit_conv_grad(g, g.dy(), x, w, want, [x, w, b], **forward_attrs(g))


@grad_rule("ConvTranspose")
def conv_transpose(g):
    """Y = ConvTranspose(X, W) is the input-gradient of Conv(., W): dX = Conv(dY, W), and dW comes
    from ConvGrad of that Conv with X as its output gradient."""
    x, w, b = g.x(0), g.x(1), g.x(2)
    attrs = forward_attrs(g)
    if "output_shape" in attrs or as_text(attrs.get("auto_pad", "NOTSET")) in ("SAME_UPPER", "SAME_LOWER"):
        attrs = _explicit_transpose_pads(g, attrs)
    conv_attrs = {k: v for k, v in attrs.items() if k in CONV_ATTRS}
    dy = g.dy()
    dy_full = _crop_negative_pads(g, dy, conv_attrs) if "pads" in conv_attrs else dy
    dx = g.op("Conv", dy_full, w, **conv_attrs) if g.needs(0) else None
    dw = emit_conv_grad(g, x, dy_full, w, [False, True], [None, w], **conv_attrs)[1] if g.needs(1) else None
    db = None
    if b is not None and g.needs(2):  # every output position holds the bias, padding beyond the result too
        rank = g.rank(x) if g.rank(x) is not None else g.rank(w)  # W is (C, M/group, k1, ...)
        db = g.reduce_sum(dy, [0] + list(range(2, rank if rank is not None else known_rank(g, x))), keepdims=0)
    return [dx, dw, db][: len(g.node.inputs)]


def _explicit_transpose_pads(g, attrs: dict) -> dict:
    """ConvTranspose's output_shape / SAME padding turned into explicit pads. SAME pads come from W
    alone (the full result less X's size times the stride: op + (k - 1) * d + 1 - s, whatever X's
    size); output_shape's need X's spatial dims static too."""
    x, w = g.x(0), g.x(1)
    xd, wd = dims_of(x), dims_of(w)
    with_output_shape = "output_shape" in attrs
    if xd is None or wd is None or not is_static(wd[2:]) or (with_output_shape and not is_static(xd[2:])):
        raise ModelError(
            f"{node_where(g)}: ConvTranspose with "
            + (
                "output_shape needs static spatial dims of X and W"
                if with_output_shape
                else "auto_pad SAME_* needs static spatial dims of W"
            )
            + " for its gradient"
        )
    nd = len(xd) - 2
    strides = attrs.get("strides", [1] * nd)
    dilations = attrs.get("dilations", [1] * nd)
    out_pad = attrs.get("output_padding", [0] * nd)
    if with_output_shape:
        full = [s * (n - 1) + op + (k - 1) * d + 1 for s, n, op, k, d in zip(strides, xd[2:], out_pad, wd[2:], dilations)]
        total = [f - o for f, o in zip(full, list(attrs["output_shape"])[-nd:])]
    else:
        total = [op + (k - 1) * d + 1 - s for s, op, k, d in zip(strides, out_pad, wd[2:], dilations)]
    upper = as_text(attrs.get("auto_pad", "NOTSET")) == "SAME_UPPER"  # the spec: else-branch for NOTSET too
    begin = [t // 2 if upper else t - t // 2 for t in total]
    end = [t - b for t, b in zip(total, begin)]
    attrs = {k: v for k, v in attrs.items() if k not in ("output_shape", "auto_pad")}
    attrs["pads"] = begin + end  # negative where the output reaches past the full result
    return attrs


def _crop_negative_pads(g, dy, conv_attrs: dict):
    """An output larger than ConvTranspose's full result (output_shape or SAME padding past it) has
    negative pads: its extra positions hold only the bias. Crop them from dY (they feed no X or W)
    and make those pads 0, so the Conv / ConvGrad below see dY of the full result."""
    pads = conv_attrs["pads"]
    nd = len(pads) // 2
    if min(pads) >= 0:
        return dy
    out = dims_of(g.y())
    if out is None or not is_static(out[2:]):
        raise ModelError(f"{node_where(g)}: an output past ConvTranspose's full result needs static output dims for its gradient")
    axes = [2 + i for i in range(nd) if pads[i] < 0 or pads[nd + i] < 0]
    starts = [max(0, -pads[a - 2]) for a in axes]
    ends = [out[a] - max(0, -pads[nd + a - 2]) for a in axes]
    conv_attrs["pads"] = [max(0, p) for p in pads]
    return g.op("Slice", dy, g.ints(starts), g.ints(ends), g.ints(axes))


@grad_rule("ConvGrad", domain=MICROSOFT)
def conv_grad(g):
    """ConvGrad(dY, X, W) -> (dX, dW, dB) is bilinear: dX = C_W^T(dY), dW pairs dY with X, dB sums dY
    (C_W: the Conv with kernel W). With incoming gradients P, Q, R of dX, dW, dB (a backward graph
    differentiated again):

        d dY = Conv(P, W) + Conv(X, Q, R)     (R alone: broadcast over batch and space)
        d X  = ConvGrad(dY, X, Q).dX          (the input gradient of a Conv with kernel Q)
        d W  = ConvGrad(dY, P, W).dW          (the kernel gradient of a Conv of input P)
    """
    dy, x, w = g.x(0), g.x(1), g.x(2)
    p, q, r = g.dy(0), g.dy(1), g.dy(2)
    attrs = forward_attrs(g)
    grads = [None, None, None]
    if g.needs(0):
        parts = []
        if p is not None:
            parts.append(g.op("Conv", p, w, **attrs))
        if q is not None:
            parts.append(g.op("Conv", x, q, *([r] if r is not None else []), **attrs))
        elif r is not None:
            rank = known_rank(g, dy)
            parts.append(g.expand_like(g.unsqueeze(r, [0, *range(2, rank)]), dy))
        grads[0] = g.set_type_like(g.sum(parts), dy)
    if g.needs(1):
        grads[1] = emit_conv_grad(g, dy, x, q, [True], [x], **attrs)[0] if q is not None else g.zeros_like(x)
    if g.needs(2):
        grads[2] = emit_conv_grad(g, dy, p, w, [False, True], [None, w], **attrs)[1] if p is not None else g.zeros_like(w)
    return grads


@grad_rule("Col2Im", nondiff_inputs=(1, 2))
def col2im(g):
    """Col2Im sums blocks into an image; its transpose cuts them out again (im2col): a Conv of dY,
    as (N * C, 1, *image), with one one-hot kernel per block position, same pads, strides and
    dilations, gives (N * C, prod(block), *blocks per axis), which is dX's layout. image_shape and
    block_shape must be constant."""
    x = g.x(0)
    image, block = folded_const(g, 1), folded_const(g, 2)
    if image is None or block is None:
        raise ModelError(f"{node_where(g)}: its gradient needs image_shape and block_shape constant")
    try:
        image, block, dilations, pads, strides, _ = col2im_geometry(
            np.asarray(image).reshape(-1), np.asarray(block).reshape(-1), **forward_attrs(g, ("dilations", "pads", "strides"))
        )
    except KernelError as exc:
        raise ModelError(f"{node_where(g)}: {exc}") from None
    taps = int(np.prod(block))
    one_hot = np.eye(taps, dtype=numpy_dtype_of(x)).reshape(taps, 1, *block)
    planes = g.reshape(g.dy(), [-1, 1, *image])
    columns = g.op("Conv", planes, g.const(one_hot), dilations=dilations, pads=pads, strides=strides)
    return [g.reshape_like(columns, x), None, None]


@grad_rule("DeformConv")
def deform_conv(g):
    """DeformConv is differentiated in its standard-op form (gradgen.passes.DecomposePass: a
    GridSample of X at the offset positions, the mask, a grouped MatMul with W), for X, W, the
    offsets, B and the mask; the pass leaves in place a node whose shapes are not static."""
    raise ModelError(
        f"{node_where(g)} reached the gradient pass: gradgen differentiates DeformConv in its standard-op form, which "
        "gradgen.passes.DecomposePass (in build_backward's pipeline) makes for static shapes of X, W and offset only"
    )


# QLinearConv's output is an integer (quantized) tensor: no gradient leaves it, so none reaches its
# float scales.
non_differentiable("QLinearConv")
