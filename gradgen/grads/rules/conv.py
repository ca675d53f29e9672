"""Gradient rules: convolution and pooling.

Conv emits one com.microsoft ConvGrad(dY, X, W) carrying the forward attributes verbatim, as ONNX
Runtime training does. ConvTranspose is the input-gradient of a Conv, so its gradients are a Conv
(dX) and a ConvGrad with the roles of X and dY exchanged (dW). Pools use standard ops plus ConvGrad
with a ones kernel for the window transpose.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from gradgen.errors import KernelError, ModelError
from gradgen.grads.builder import MICROSOFT, dims_of, is_static, numpy_dtype_of, same_dim
from gradgen.grads.registry import grad_rule
from gradgen.grads.rules.shape import concat_ints, dims_value, folded_const, folded_dims

CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def _where(g) -> str:
    return f"{g.node.op_type} node {g.node.name or '<unnamed>'!r}"


def _forward_attrs(g, names=None) -> dict:
    """The forward node's attributes (all, or those in ``names``) as plain python values."""
    out = {}
    for name, attr in g.node.attributes.items():
        if names is None or name in names:
            value = attr.value
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _rank(g, x) -> int:
    rank = g.rank(x)
    if rank is None:
        raise ModelError(f"{_where(g)}: the rank of {x.name!r} is unknown; its gradient needs it")
    return rank


def _conv_grad(g, dy, x, w, want, likes, **attrs):
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
    return _conv_grad(g, g.dy(), x, w, want, [x, w, b], **_forward_attrs(g))


@grad_rule("ConvTranspose")
def conv_transpose(g):
    """Y = ConvTranspose(X, W) is the input-gradient of Conv(., W): dX = Conv(dY, W), and dW comes
    from ConvGrad of that Conv with X as its output gradient."""
    x, w, b = g.x(0), g.x(1), g.x(2)
    attrs = _forward_attrs(g)
    if "output_shape" in attrs or _str(attrs.get("auto_pad", "NOTSET")) in ("SAME_UPPER", "SAME_LOWER"):
        attrs = _explicit_transpose_pads(g, attrs)
    conv_attrs = {k: v for k, v in attrs.items() if k in CONV_ATTRS}
    dy = g.dy()
    dy_full = _crop_negative_pads(g, dy, conv_attrs) if "pads" in conv_attrs else dy
    dx = g.op("Conv", dy_full, w, **conv_attrs) if g.needs(0) else None
    dw = _conv_grad(g, x, dy_full, w, [False, True], [None, w], **conv_attrs)[1] if g.needs(1) else None
    db = None
    if b is not None and g.needs(2):  # every output position holds the bias, padding beyond the result too
        rank = g.rank(x) if g.rank(x) is not None else g.rank(w)  # W is (C, M/group, k1, ...)
        db = g.reduce_sum(dy, [0] + list(range(2, rank if rank is not None else _rank(g, x))), keepdims=0)
    return [dx, dw, db][: len(g.node.inputs)]


def _explicit_transpose_pads(g, attrs: dict) -> dict:
    """ConvTranspose's output_shape / SAME padding turned into explicit pads (needs static spatial dims)."""
    x, w = g.x(0), g.x(1)
    xd, wd = dims_of(x), dims_of(w)
    if xd is None or wd is None or not is_static(xd[2:]) or not is_static(wd[2:]):
        raise ModelError(f"{_where(g)}: ConvTranspose with output_shape or auto_pad SAME_* needs static spatial "
                         "dims of X and W for its gradient")
    nd = len(xd) - 2
    strides = attrs.get("strides", [1] * nd)
    dilations = attrs.get("dilations", [1] * nd)
    out_pad = attrs.get("output_padding", [0] * nd)
    full = [s * (n - 1) + op + (k - 1) * d + 1 for s, n, op, k, d in zip(strides, xd[2:], out_pad, wd[2:], dilations)]
    if "output_shape" in attrs:
        out = list(attrs["output_shape"])[-nd:]
    else:
        out = [n * s for n, s in zip(xd[2:], strides)]
    total = [f - o for f, o in zip(full, out)]
    upper = _str(attrs.get("auto_pad", "NOTSET")) == "SAME_UPPER"  # the spec: else-branch for NOTSET too
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
        raise ModelError(f"{_where(g)}: an output past ConvTranspose's full result needs static output dims for "
                         "its gradient")
    axes = [2 + i for i in range(nd) if pads[i] < 0 or pads[nd + i] < 0]
    starts = [max(0, -pads[a - 2]) for a in axes]
    ends = [out[a] - max(0, -pads[nd + a - 2]) for a in axes]
    conv_attrs["pads"] = [max(0, p) for p in pads]
    return g.op("Slice", dy, g.ints(starts), g.ints(ends), g.ints(axes))


@grad_rule("MaxPool")
def max_pool(g):
    """Scatter-add dY at the argmax positions (MaxPool's Indices, flat over N*C*spatial)."""
    x = g.x(0)
    if g.opset < 16:
        raise ModelError(f"{_where(g)}: its gradient needs ScatterElements reduction='add' (opset >= 16); "
                         f"the model has opset {g.opset}")
    attrs = _forward_attrs(g)
    has_indices = len(g.node.outputs) > 1 and g.node.outputs[1].name
    if has_indices and attrs.get("storage_order", 0) == 0:
        indices = g.y(1)
    else:  # recompute, always row-major so the flat index matches Reshape(X, [-1])
        attrs.pop("storage_order", None)
        indices = g.op_multi("MaxPool", [x], 2, **attrs)[1]
    flat = g.op("ScatterElements", g.reshape(g.zeros_like(x), [-1]), g.reshape(indices, [-1]),
                g.reshape(g.dy(), [-1]), axis=0, reduction="add")
    return [g.reshape_like(flat, x)]


@grad_rule("AveragePool")
def average_pool(g):
    """dX = S^T(dY / divisor), S the window sum: ConvGrad with a ones kernel on (N*C, 1, spatial)."""
    from gradgen.kernels.cpu.nn import pool_geometry

    x, y, dy = g.x(0), g.y(), g.dy()
    attrs = _forward_attrs(g)
    kernel = attrs["kernel_shape"]
    nd = len(kernel)
    auto_pad = _str(attrs.get("auto_pad", "NOTSET"))
    strides = attrs.get("strides", [1] * nd)
    dilations = attrs.get("dilations", [1] * nd)
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    ceil_mode = int(attrs.get("ceil_mode", 0))
    include_pad = int(attrs.get("count_include_pad", 0))
    if ceil_mode and auto_pad in ("NOTSET", "VALID"):
        if auto_pad == "VALID":
            pads = [0] * (2 * nd)
        spatial = (dims_of(x) or [None] * (nd + 2))[2:]
        if not is_static(spatial):
            raise ModelError(f"{_where(g)}: AveragePool with ceil_mode=1 needs static spatial dims for its gradient")
        # ceil_mode windows as explicit end padding, from the pooled-shape rule the kernels use
        try:
            _, _, _, begin, end, _ = pool_geometry([1, 1, *spatial], {**attrs, "pads": pads})
        except KernelError as exc:
            raise ModelError(f"{_where(g)}: {exc}") from None
        pads = list(begin) + list(end)
        auto_pad = "NOTSET"
    geometry = {"strides": strides, "dilations": dilations}
    if auto_pad == "NOTSET":
        geometry["pads"] = pads
    else:
        geometry["auto_pad"] = auto_pad
    dtype = numpy_dtype_of(x)
    ones_kernel = g.const(np.ones([1, 1, *kernel], dtype=dtype))
    x1 = g.reshape(x, concat_ints(g, [[-1, 1], dims_value(g, x, 2)]))
    dy1 = g.reshape(dy, concat_ints(g, [[-1, 1], dims_value(g, y, 2)]))
    padded = auto_pad in ("SAME_UPPER", "SAME_LOWER") or (auto_pad == "NOTSET" and any(pads))
    if not padded or (include_pad and not ceil_mode):
        scaled = g.op("Mul", dy1, g.const_like(x, 1.0 / math.prod(kernel)))
    else:
        ones = g.op("ConstantOfShape", concat_ints(g, [[1, 1], dims_value(g, x, 2)]),
                    value=_tensor(np.ones((1,), dtype=dtype)))
        counts = g.op("Conv", ones, ones_kernel, **geometry)  # taps inside the input, per window
        if include_pad:
            # divisor = counts / AveragePool(ones), whatever the divisor convention at the border
            scale = g.op("Div", g.op("AveragePool", ones, **attrs), counts)
        else:
            scale = g.op("Reciprocal", counts)
        scaled = g.op("Mul", dy1, scale)
    dx1 = _conv_grad(g, scaled, x1, ones_kernel, [True], [x1], **geometry)[0]
    return [g.reshape_like(dx1, x)]


def _tensor(array):
    return ir.tensor(array)


@grad_rule("GlobalAveragePool")
def global_average_pool(g):
    x = g.x(0)
    dims = dims_of(x)
    spread = g.expand_like(g.dy(), x)
    if dims is not None and is_static(dims[2:]):
        spatial = dims[2:]
        return [g.op("Mul", spread, g.const_like(x, 1.0 / max(1, math.prod(spatial))))]
    size = g.cast_like(g.reduce("ReduceProd", dims_value(g, x, 2), None, keepdims=1), x)
    return [g.op("Div", spread, size)]


@grad_rule("GlobalMaxPool")
def global_max_pool(g):
    """dY spread evenly over the positions that reach the maximum (ties share it)."""
    x = g.x(0)
    mask = g.cast_like(g.op("Equal", x, g.y()), x)
    count = g.reduce_sum(mask, list(range(2, _rank(g, x))), keepdims=1)
    return [g.op("Mul", mask, g.op("Div", g.dy(), count))]


@grad_rule("Resize", nondiff_inputs=(3,), unsupported_inputs=(1, 2))
def resize(g):
    """Resize is linear and separable: along each resized axis Y = M X with a fixed (out, in) matrix,
    so dX applies M^T axis by axis (a MatMul with M on dY moved to the last axis). The matrices are
    built at build time, so the resized axes need static sizes and constant scales/sizes, except
    for a symbolic axis upsampled by an integer factor s in a mode where output o reads input o // s
    (nearest with asymmetric/half-pixel coordinates, e.g. nn.Upsample(scale_factor=2)): its
    transpose sums dY over blocks of s (a Reshape to (..., -1, s) and a ReduceSum)."""
    from gradgen.kernels.cpu.nn import resize_geometry, resize_matrices

    x = g.x(0)
    if not g.needs(0):
        return [None]
    ctm = _str(g.attr("coordinate_transformation_mode", "half_pixel"))
    roi = folded_const(g, 1) if g.opset >= 11 and ctm == "tf_crop_and_resize" else None
    if ctm == "tf_crop_and_resize" and roi is None:
        raise ModelError(f"{_where(g)}: Resize with tf_crop_and_resize needs a constant roi for its gradient")
    xd, yd = dims_of(x), dims_of(g.y())
    if xd is None:
        raise ModelError(f"{_where(g)}: the rank of {x.name!r} is unknown; its gradient needs it")
    rank = len(xd)
    attrs = {k: g.attr(k) for k in ("mode", "coordinate_transformation_mode", "nearest_mode",
                                    "cubic_coeff_a", "exclude_outside", "antialias")}
    if g.opset < 11:
        scales, sizes = folded_const(g, 1), None
        attrs.update(coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    else:
        scales, sizes = folded_const(g, 2), folded_const(g, 3)
    chosen = list(range(rank)) if g.attr("axes") is None else [int(a) % rank for a in g.attr("axes")]
    has_sizes = g.opset >= 11 and len(g.node.inputs) > 3 and g.x(3) is not None
    if sizes is not None and np.asarray(sizes).size:
        sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
    elif has_sizes and folded_dims(g, g.x(3)) is not None:
        sizes = folded_dims(g, g.x(3))  # e.g. Concat(Slice(Shape(X), 0, 2), [h, w]): may hold symbols
    elif has_sizes and yd is not None:
        sizes = [yd[a] for a in chosen]  # the inferred output shape (may hold symbols)
    else:
        sizes = None
    if sizes is None and (scales is None or not np.asarray(scales).size):
        raise ModelError(f"{_where(g)}: Resize needs constant scales or sizes (or a static output shape) "
                         "for its gradient")
    policy = _str(g.attr("keep_aspect_ratio_policy", "stretch"))
    blocks = {}  # symbolic axis -> integer factor whose transpose is a block sum
    if sizes is not None and policy != "stretch":
        if not is_static(xd) or not is_static(sizes):
            raise ModelError(f"{_where(g)}: Resize with keep_aspect_ratio_policy={policy!r} needs static "
                             "shapes for its gradient")
        shape_in = list(xd)
        shape_out, factors = resize_geometry(shape_in, None, sizes, axes=chosen, keep_aspect_ratio_policy=policy)
    else:
        scale_list = None if sizes is not None else [float(v) for v in np.asarray(scales, np.float64).reshape(-1)]
        shape_in, shape_out, factors = [], [], []
        for a, n_in in enumerate(xd):
            k = chosen.index(a) if a in chosen else None
            n_out = n_in if k is None else (sizes[k] if sizes is not None else None)
            if k is not None and sizes is None:
                n_out = math.floor(n_in * scale_list[k]) if isinstance(n_in, int) else (
                    n_in if scale_list[k] == 1.0 else None)
            identity = n_out is not None and same_dim(n_in, n_out) and (
                sizes is not None or k is None or scale_list[k] == 1.0)
            # Exporters write interpolate's sizes as the whole output shape, batch and channels
            # included, as constants at the export batch size: a symbolic batch/channel axis with a
            # constant size is taken as kept (the model only runs where it is).
            identity = identity or (a < 2 and sizes is not None and not isinstance(n_in, int)
                                    and isinstance(n_out, int))
            if identity and not isinstance(n_in, int):
                shape_in.append(1), shape_out.append(1), factors.append(1.0)
                continue
            block = _block_factor(scale_list[k], attrs, roi) if (
                k is not None and sizes is None and not isinstance(n_in, int)) else None
            if block is not None:
                blocks[a] = block
                shape_in.append(1), shape_out.append(1), factors.append(1.0)
                continue
            if not isinstance(n_in, int) or not isinstance(n_out, int):
                raise ModelError(f"{_where(g)}: Resize needs static sizes of axis {a} for its gradient")
            shape_in.append(n_in), shape_out.append(n_out)
            factors.append(n_out / n_in if sizes is not None or k is None else scale_list[k])
    dtype = numpy_dtype_of(x)
    dx = g.dy()
    # Outputs set to extrapolation_value (tf_crop_and_resize) have zero rows: no gradient.
    mats = resize_matrices(shape_in, shape_out, factors, attrs, roi, g.attr("axes"))
    for axis, (m, _) in sorted(mats.items()):
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        moved = dx if axis == rank - 1 else g.transpose(dx, perm)
        moved = g.op("MatMul", moved, g.const(m.astype(dtype)))
        dx = moved if axis == rank - 1 else g.transpose(moved, perm)
    for axis, s in sorted(blocks.items()):
        perm = list(range(rank))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        moved = dx if axis == rank - 1 else g.transpose(dx, perm)
        moved = g.reduce_sum(g.reshape(moved, [0] * (rank - 1) + [-1, s]), [rank], keepdims=0)
        dx = moved if axis == rank - 1 else g.transpose(moved, perm)
    return [dx]


def _block_factor(scale: float, attrs: dict, roi) -> int | None:
    """s when an axis resized by ``scale`` maps output o to input o // s for every input size
    (an integer factor s > 1, one-hot rows in nearest blocks), else None. Checked on the matrices
    of a few sizes: for these modes the rows only depend on o mod s and o // s."""
    from gradgen.kernels.cpu.nn import resize_matrices

    s = int(round(scale))
    if s < 2 or scale != s or roi is not None:
        return None
    for n in (1, 2, 5):
        mats = resize_matrices([n], [n * s], [float(s)], attrs)
        m = mats[0][0] if 0 in mats else np.eye(n)
        if mats.get(0, (None, None))[1] is not None:
            return None
        want = np.zeros((n * s, n))
        want[np.arange(n * s), np.arange(n * s) // s] = 1.0
        if m.shape != want.shape or not np.array_equal(m, want):
            return None
    return s
