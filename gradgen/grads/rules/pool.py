"""Gradient rules: pooling and resampling (MaxPool, AveragePool, the global pools, Resize).

Pools use standard ops plus ConvGrad with a ones kernel for the window transpose. Resize is
separable: its gradient applies the transposes of the per-axis matrices the kernel applies.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import onnx_ir as ir

from gradgen.builder import INT64_MAX, dims_of, is_static, numpy_dtype_of, same_dim
from gradgen.errors import KernelError, ModelError
from gradgen.grads.rules.conv import as_text, emit_conv_grad, forward_attrs, known_rank, node_where
from gradgen.grads.rules.shape import concat_ints, dims_value, folded_const, folded_dims
from gradgen.grads.table import grad_rule
from gradgen.ops.grid_sample import affine_base_grid


@grad_rule("MaxPool")
def max_pool(g):
    """Scatter-add dY at the argmax positions, one (n, c) plane per scatter line.

    MaxPool's Indices are flat over N*C*spatial, but each window's argmax lies in its own plane, so
    ``Indices mod plane_size`` indexes the plane: ScatterElements over [N*C, plane] along axis 1 gives
    N*C independent lines (one flat line of N*C*H*W was one serial scatter: 92 ms of a ResNet-18 step).
    """
    x = g.x(0)
    if g.opset < 16:
        raise ModelError(
            f"{node_where(g)}: its gradient needs ScatterElements reduction='add' (opset >= 16); the model has opset {g.opset}"
        )
    attrs = forward_attrs(g)
    has_indices = len(g.node.outputs) > 1 and g.node.outputs[1].name
    if has_indices and attrs.get("storage_order", 0) == 0:
        indices = g.y(1)
    elif attrs.get("storage_order", 0) == 0:  # the forward node computes them too: no second pooling pass
        indices = _saved_indices(g)
    else:  # recompute, always row-major so the flat index matches Reshape(X, [-1])
        attrs.pop("storage_order", None)
        indices = g.op_multi("MaxPool", [x], 2, **attrs)[1]
    x_shape, y_shape = g.shape_of(x), g.shape_of(indices)
    lines = g.prod(x_shape, 0, 2)
    plane = g.prod(x_shape, 2)
    by_plane = g.reshape(g.zeros_like(x), g.cat(lines, plane), exact=True)
    y_lines = g.cat(lines, g.prod(y_shape, 2))
    plane_indices = g.op("Mod", g.reshape(indices, y_lines, exact=True), plane)
    dx = g.op("ScatterElements", by_plane, plane_indices, g.reshape(g.dy(), y_lines, exact=True), axis=1, reduction="add")
    return [g.reshape_like(dx, x)]


def _saved_indices(g) -> ir.Value:
    """The forward MaxPool's Indices output (int64, Y's shape), added to the node, which then
    computes them in the pass that computes Y (a second MaxPool for them read X again)."""
    node, y = g.node, g.y(0)
    if len(node.outputs) < 2:
        node.resize_outputs(2)
    indices = node.outputs[1]
    g.rename(indices, f"{node.name or y.name}_Indices")
    indices.type = ir.TensorType(ir.DataType.INT64)
    indices.shape = y.shape
    return indices


@grad_rule("AveragePool")
def average_pool(g):
    """dX = S^T(dY / divisor), S the window sum: ConvGrad with a ones kernel on (N*C, 1, spatial)."""
    x, y, dy = g.x(0), g.y(), g.dy()
    attrs = forward_attrs(g)
    kernel = attrs["kernel_shape"]
    ceil_mode = int(attrs.get("ceil_mode", 0))
    include_pad = int(attrs.get("count_include_pad", 0))
    dtype = numpy_dtype_of(x)
    ones_kernel = g.const(np.ones([1, 1, *kernel], dtype=dtype))
    x1 = g.reshape(x, concat_ints(g, [[-1, 1], dims_value(g, x, 2)]))
    dy1 = g.reshape(dy, concat_ints(g, [[-1, 1], dims_value(g, y, 2)]))
    geometry = None if _ceil_windows_at_run_time(g, attrs) else _window_geometry(g, attrs)
    padded = geometry is None or "auto_pad" in geometry or any(geometry["pads"])
    if not padded or (include_pad and not ceil_mode):
        scaled = g.op("Mul", dy1, g.const_like(x, 1.0 / math.prod(kernel)))
    else:
        ones = g.op("ConstantOfShape", concat_ints(g, [[1, 1], dims_value(g, x, 2)]), value=_tensor(np.ones((1,), dtype=dtype)))
        if geometry is None:
            counts = _window_counts_at_run_time(g, ones, dy1, ones_kernel, attrs)
        else:
            counts = g.op("Conv", ones, ones_kernel, **geometry)  # taps inside the input, per window
        if include_pad:
            # divisor = counts / AveragePool(ones), whatever the divisor convention at the border
            scale = g.op("Div", g.op("AveragePool", ones, **attrs), counts)
        else:
            scale = g.op("Reciprocal", counts)
        scaled = g.op("Mul", dy1, scale)
    dx1 = _window_sum_transposed(g, scaled, x1, ones_kernel, attrs, geometry)
    return [g.reshape_like(dx1, x)]


def _ceil_windows_at_run_time(g, attrs: dict) -> bool:
    """Whether a pool's ceil_mode windows depend on spatial sizes known at run time only: its
    gradient then finds them at run time (``_window_counts_at_run_time``,
    ``_window_sum_transposed_at_run_time``) instead of as static end padding."""
    nd = len(attrs["kernel_shape"])
    if not int(attrs.get("ceil_mode", 0)) or as_text(attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        return False
    return not is_static((dims_of(g.x(0)) or [None] * (nd + 2))[2:])


def _static_window_attrs(attrs: dict) -> tuple[list[int], list[int], list[int], list[int]]:
    """(strides, dilations, begin pads, end pads) of a pool's windows (VALID: no pads)."""
    nd = len(attrs["kernel_shape"])
    pads = [0] * (2 * nd) if as_text(attrs.get("auto_pad", "NOTSET")) == "VALID" else list(attrs.get("pads", [0] * (2 * nd)))
    return list(attrs.get("strides", [1] * nd)), list(attrs.get("dilations", [1] * nd)), pads[:nd], pads[nd:]


def _window_counts_at_run_time(g, ones, dy1, ones_kernel, attrs: dict):
    """How many taps of each ceil_mode window lie inside the input, for spatial sizes known at run
    time: a window sum of ones whose end padding reaches past any overhang (stride - 1 beyond the
    explicit pads), cut to dY's windows."""
    strides, dilations, begin, end = _static_window_attrs(attrs)
    nd = len(strides)
    reach = [*begin, *(e + s - 1 for e, s in zip(end, strides))]
    counts = g.op("Conv", ones, ones_kernel, strides=strides, dilations=dilations, pads=reach)
    spatial = list(range(2, 2 + nd))
    return g.op("Slice", counts, g.ints([0] * nd), dims_value(g, dy1, 2), g.ints(spatial))


def _window_sum_transposed(g, dy1, x1, ones_kernel, attrs: dict, geometry: dict | None):
    """dY1 (N*C, 1, out) carried back through the window sum S of ``attrs``' windows: ConvGrad's dX
    with a ones kernel and ``geometry`` (``_window_geometry``), or, for ceil_mode windows over
    sizes known at run time (geometry None), ``_window_sum_transposed_at_run_time``."""
    if geometry is None:
        return _window_sum_transposed_at_run_time(g, dy1, x1, ones_kernel, attrs)
    return emit_conv_grad(g, dy1, x1, ones_kernel, [True], [x1], **geometry)[0]


def _window_sum_transposed_at_run_time(g, dy1, x1, ones_kernel, attrs: dict):
    """The transpose of a ceil_mode window sum, for spatial sizes known at run time: ConvTranspose
    with the begin padding only, then cut (an overhanging last window) or padded with zeros (inputs
    no window reaches) to X's spatial sizes."""
    strides, dilations, begin, _ = _static_window_attrs(attrs)
    nd = len(strides)
    full = g.op("ConvTranspose", dy1, ones_kernel, strides=strides, dilations=dilations, pads=[*begin, *[0] * nd])
    sizes = dims_value(g, x1, 2)
    missing = g.op("Max", g.op("Sub", sizes, dims_value(g, full, 2)), g.ints([0] * nd))
    padded = g.op("Pad", full, concat_ints(g, [[0] * (2 + nd), [0, 0], missing]))
    return g.op("Slice", padded, g.ints([0] * nd), sizes, g.ints(list(range(2, 2 + nd))))


def _window_geometry(g, attrs: dict) -> dict:
    """The strides, dilations and pads (or SAME auto_pad) of a pool's windows, for a Conv / ConvGrad
    with a ones kernel: ceil_mode windows become explicit end padding (from the pooled-shape rule
    the kernels use, which needs static spatial dims)."""
    from gradgen.ops.pool import pool_geometry

    x = g.x(0)
    nd = len(attrs["kernel_shape"])
    auto_pad = as_text(attrs.get("auto_pad", "NOTSET"))
    pads = list(attrs.get("pads", [0] * (2 * nd)))
    if int(attrs.get("ceil_mode", 0)) and auto_pad in ("NOTSET", "VALID"):
        if auto_pad == "VALID":
            pads = [0] * (2 * nd)
        spatial = (dims_of(x) or [None] * (nd + 2))[2:]
        if not is_static(spatial):
            raise ModelError(f"{node_where(g)}: {g.node.op_type} with ceil_mode=1 needs static spatial dims for its gradient")
        try:
            _, _, _, begin, end, _ = pool_geometry([1, 1, *spatial], {**attrs, "pads": pads})
        except KernelError as exc:
            raise ModelError(f"{node_where(g)}: {exc}") from None
        pads = list(begin) + list(end)
        auto_pad = "NOTSET"
    geometry = {"strides": attrs.get("strides", [1] * nd), "dilations": attrs.get("dilations", [1] * nd)}
    if auto_pad == "NOTSET":
        geometry["pads"] = pads
    else:
        geometry["auto_pad"] = auto_pad
    return geometry


def _tensor(array):
    return ir.tensor(array)


def _lp_input_factor(g, x, p: int):
    """d|x|^p / dx divided by p: sign(x) |x|^(p-1)."""
    if p == 1:
        return g.op("Sign", x)
    if p == 2:
        return x
    return g.op("Mul", g.op("Sign", x), g.op("Pow", g.op("Abs", x), g.const_like(x, p - 1.0)))


def _lp_output_factor(g, dy, y, p: int):
    """dY * dy/dz * p for y = z^(1/p): dY * y^(1-p), and 0 where y = 0 (every |x| in the window is
    0, where d|x|^p/dx is 0 for p > 1; the subgradient 0 for p = 1)."""
    if p == 1:
        return dy
    zero = g.op("Equal", y, g.const_like(y, 0.0))
    safe = g.op("Where", zero, g.const_like(y, 1.0), y)
    power = safe if p == 2 else g.op("Pow", safe, g.const_like(y, p - 1.0))
    return g.op("Where", zero, g.const_like(y, 0.0), g.op("Div", dy, power))


def _lp_order(g) -> int:
    p = int(g.attr("p", 2))
    if p < 1:
        raise ModelError(f"{node_where(g)}: p must be at least 1, got {p}")
    return p


@grad_rule("LpPool")
def lp_pool(g):
    """y = z^(1/p), z the window sum of |x|^p (padding adds 0): dX = sign(x) |x|^(p-1) * S^T(dY *
    y^(1-p)), S the window sum, transposed by ConvGrad with a ones kernel on (N*C, 1, spatial) as for
    AveragePool."""
    x, y = g.x(0), g.y()
    p = _lp_order(g)
    attrs = forward_attrs(g)
    ones_kernel = g.const(np.ones([1, 1, *attrs["kernel_shape"]], dtype=numpy_dtype_of(x)))
    x1 = g.reshape(x, concat_ints(g, [[-1, 1], dims_value(g, x, 2)]))
    dz1 = g.reshape(_lp_output_factor(g, g.dy(), y, p), concat_ints(g, [[-1, 1], dims_value(g, y, 2)]))
    geometry = None if _ceil_windows_at_run_time(g, attrs) else _window_geometry(g, attrs)
    spread = g.reshape_like(_window_sum_transposed(g, dz1, x1, ones_kernel, attrs, geometry), x)
    return [g.op("Mul", _lp_input_factor(g, x, p), spread)]


@grad_rule("GlobalLpPool")
def global_lp_pool(g):
    """y = (sum over the spatial axes of |x|^p)^(1/p): dX = sign(x) |x|^(p-1) * dY * y^(1-p)."""
    x = g.x(0)
    p = _lp_order(g)
    return [g.op("Mul", _lp_input_factor(g, x, p), _lp_output_factor(g, g.dy(), g.y(), p))]


@grad_rule("MaxUnpool", nondiff_inputs=(1, 2))
def max_unpool(g):
    """Y is zeros with X scattered at MaxPool's flat indices (into the inferred shape, which an
    output_shape only pads at the end): dX = Gather(the inferred part of dY, flattened, indices)."""
    x, indices, dy = g.x(0), g.x(1), g.dy()
    if g.x(2) is not None:
        dy = g.op("Slice", dy, g.ints([0] * known_rank(g, x)), _unpool_inferred_shape(g))
    return [g.op("Gather", g.reshape(dy, [-1]), indices, axis=0)]


def _unpool_inferred_shape(g):
    """MaxUnpool's inferred output shape, N, C, then (in - 1) * stride - pads + kernel per axis."""
    x = g.x(0)
    kernel = [int(k) for k in g.attr("kernel_shape")]
    nd = len(kernel)
    strides = [int(v) for v in g.attr("strides", [1] * nd)]
    pads = [int(v) for v in g.attr("pads", [0] * (2 * nd))]
    dims = dims_of(x)
    if dims is not None and is_static(dims):
        spatial = [(dims[2 + i] - 1) * strides[i] - pads[i] - pads[nd + i] + kernel[i] for i in range(nd)]
        return g.ints([*dims[:2], *spatial])
    offsets = [kernel[i] - strides[i] - pads[i] - pads[nd + i] for i in range(nd)]
    spatial = g.op("Add", g.op("Mul", dims_value(g, x, 2), g.ints(strides)), g.ints(offsets))
    return concat_ints(g, [dims_value(g, x, 0, 2), spatial])


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
    count = g.reduce_sum(mask, list(range(2, known_rank(g, x))), keepdims=1)
    return [g.op("Mul", mask, g.op("Div", g.dy(), count))]


@grad_rule("AffineGrid", nondiff_inputs=(1,))
def affine_grid(g):
    """grid (N, P, nd) = base (P, nd + 1) @ theta^T: dTheta = dGrid^T @ base, per batch entry; the
    base grid (gradgen.ops.grid_sample) is a constant of the spatial sizes where they are static,
    else made at run time (``_run_time_base_grid``)."""
    theta = g.x(0)
    size = folded_const(g, 1)
    if size is not None:
        spatial = [int(v) for v in np.asarray(size).reshape(-1)[2:]]
    else:
        dims = dims_of(g.y())
        spatial = dims[1:-1] if dims is not None and is_static(dims[1:-1]) else None
    if spatial is None:
        nd = _affine_rank(g)
        rows = g.reshape(g.dy(), [0, -1, nd])
        return [g.op("MatMul", g.transpose(rows, [0, 2, 1]), _run_time_base_grid(g, nd)), None]
    base = affine_base_grid(spatial, g.attr("align_corners", 0), numpy_dtype_of(theta))
    rows = g.reshape(g.dy(), [0, base.shape[0], len(spatial)])
    return [g.op("MatMul", g.transpose(rows, [0, 2, 1]), g.const(base)), None]


def _affine_rank(g) -> int:
    """AffineGrid's spatial rank: theta is (N, nd, nd + 1), size holds N, C and nd sizes."""
    theta, size = dims_of(g.x(0)), dims_of(g.x(1))
    if theta is not None and len(theta) == 3 and isinstance(theta[1], int):
        return int(theta[1])
    if theta is not None and len(theta) == 3 and isinstance(theta[2], int):
        return int(theta[2]) - 1
    if size is not None and len(size) == 1 and isinstance(size[0], int):
        return int(size[0]) - 2
    raise ModelError(f"{node_where(g)}: the gradient of theta needs its spatial rank: theta's shape or size's length")


def _run_time_base_grid(g, nd: int):
    """The base grid (P, nd + 1) for spatial sizes known at run time: AffineGrid is linear in theta,
    so the grid of the theta whose only 1 is at row 0, column k holds base[:, k] in its first
    coordinate; one AffineGrid call over a batch of those nd + 1 thetas gives every column."""
    dtype = numpy_dtype_of(g.x(0))
    units = np.zeros((nd + 1, nd, nd + 1), dtype)
    units[np.arange(nd + 1), 0, np.arange(nd + 1)] = 1
    size = g.op("Concat", g.ints([nd + 1]), g.op("Slice", g.x(1), g.ints([1]), g.ints([INT64_MAX])), axis=0)
    grids = g.op("AffineGrid", g.const(units), size, align_corners=int(g.attr("align_corners", 0)))
    columns = g.reshape(g.op("Gather", grids, g.ints([0]), axis=-1), [nd + 1, -1])
    return g.transpose(columns, [1, 0])


@grad_rule("GridSample")
def grid_sample(g):
    """GridSample is differentiated in its standard-op form (gradgen.passes.DecomposePass, in
    build_backward's pipeline): this entry makes it known as differentiable and turns a pipeline
    that left it in place into a one-line error."""
    raise ModelError(
        f"{node_where(g)} reached the gradient pass: GridSample is differentiated in its standard-op form; "
        "run gradgen.passes.DecomposePass before GradientPass (build_backward's pipeline does)"
    )


@grad_rule("RoiAlign", nondiff_inputs=(2,))
def roi_align(g):
    """RoiAlign with a fixed sampling_ratio is differentiated in its standard-op form
    (gradgen.passes.DecomposePass, in build_backward's pipeline), for X and the rois; an adaptive
    one (0, the default) samples each roi a number of times known only at run time."""
    if int(g.attr("sampling_ratio", 0)) <= 0:
        raise ModelError(
            f"{node_where(g)}: gradgen differentiates RoiAlign with a fixed sampling_ratio (> 0) only; this node "
            "samples adaptively (sampling_ratio 0), a number of points per roi known only at run time"
        )
    raise ModelError(
        f"{node_where(g)} reached the gradient pass: RoiAlign is differentiated in its standard-op form; "
        "run gradgen.passes.DecomposePass before GradientPass (build_backward's pipeline does)"
    )


def _warn_fractional_width(g, ctm, sizes, shape_in, shape_out, factors) -> None:
    """align_corners / tf_crop_and_resize with scales whose scale * n is fractional: gradgen spaces
    the samples by the fractional width, as ONNX's reference and conformance tests do; PyTorch (whose
    exporters write F.interpolate(scale_factor=..., align_corners=True) this way) and ONNX Runtime
    space them by the integer output length, so the forward and its gradient differ from theirs."""
    if sizes is not None or ctm not in ("align_corners", "tf_crop_and_resize"):
        return
    for n_in, n_out, s in zip(shape_in, shape_out, factors):
        if n_out > 1 and abs(n_in * s - n_out) > 1e-5 * n_out:
            warnings.warn(
                f"{node_where(g)}: Resize {ctm} with scale {s:g} on an axis of {n_in} (fractional width {n_in * s:g}): "
                f"gradgen follows ONNX's reference and spaces the samples by {n_in * s:g} - 1, PyTorch "
                f"(F.interpolate with scale_factor and align_corners=True) and ONNX Runtime by the output length "
                f"{n_out} - 1, so this node's values and gradient differ from theirs; export with size= instead of "
                "scale_factor= to agree",
                stacklevel=2,
            )
            return


@grad_rule("Resize", nondiff_inputs=(3,), unsupported_inputs=(1, 2))
def resize(g):
    """Resize is linear and separable: along each resized axis Y = M X with a fixed (out, in) matrix,
    so dX applies M^T axis by axis (a MatMul with M on dY moved to the last axis). The matrices are
    built at build time, so the resized axes need static sizes and constant scales/sizes, except
    for a symbolic axis upsampled by an integer factor s in a mode where output o reads input o // s
    (nearest with asymmetric/half-pixel coordinates, e.g. nn.Upsample(scale_factor=2)): its
    transpose sums dY over blocks of s (a Reshape to (..., -1, s) and a ReduceSum)."""
    from gradgen.ops.pool import resize_geometry, resize_matrices

    x = g.x(0)
    if not g.needs(0):
        return [None]
    ctm = as_text(g.attr("coordinate_transformation_mode", "half_pixel"))
    roi = folded_const(g, 1) if g.opset >= 11 and ctm == "tf_crop_and_resize" else None
    if ctm == "tf_crop_and_resize" and roi is None:
        raise ModelError(f"{node_where(g)}: Resize with tf_crop_and_resize needs a constant roi for its gradient")
    xd, yd = dims_of(x), dims_of(g.y())
    if xd is None:
        raise ModelError(f"{node_where(g)}: the rank of {x.name!r} is unknown; its gradient needs it")
    rank = len(xd)
    attrs = {
        k: g.attr(k)
        for k in ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside", "antialias")
    }
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
        if as_text(g.attr("keep_aspect_ratio_policy", "stretch")) != "stretch":
            # the output shape is the policy's rounded result; the scale it sampled with is not in it
            raise ModelError(
                f"{node_where(g)}: Resize with keep_aspect_ratio_policy="
                f"{as_text(g.attr('keep_aspect_ratio_policy'))!r} needs constant sizes for its gradient"
            )
    else:
        sizes = None
    if sizes is None and (scales is None or not np.asarray(scales).size):
        raise ModelError(f"{node_where(g)}: Resize needs constant scales or sizes (or a static output shape) for its gradient")
    policy = as_text(g.attr("keep_aspect_ratio_policy", "stretch"))
    blocks = {}  # symbolic axis -> integer factor whose transpose is a block sum
    runtime: dict[int, float | None] = {}  # axis of a size known at run time only -> its scale (None: sizes)
    if sizes is not None and policy != "stretch":
        if not is_static(xd) or not is_static(sizes):
            raise ModelError(
                f"{node_where(g)}: Resize with keep_aspect_ratio_policy={policy!r} needs static shapes for its gradient"
            )
        shape_in = list(xd)
        shape_out, factors = resize_geometry(shape_in, None, sizes, axes=chosen, keep_aspect_ratio_policy=policy)
    else:
        scale_list = None if sizes is not None else [float(v) for v in np.asarray(scales, np.float64).reshape(-1)]
        shape_in, shape_out, factors = [], [], []
        for a, n_in in enumerate(xd):
            k = chosen.index(a) if a in chosen else None
            n_out = n_in if k is None else (sizes[k] if sizes is not None else None)
            if k is not None and sizes is None:
                n_out = math.floor(n_in * scale_list[k]) if isinstance(n_in, int) else (n_in if scale_list[k] == 1.0 else None)
            identity = n_out is not None and same_dim(n_in, n_out) and (sizes is not None or k is None or scale_list[k] == 1.0)
            # Exporters write interpolate's sizes as the whole output shape, batch and channels
            # included, as constants at the export batch size: a symbolic batch/channel axis with a
            # constant size is taken as kept (the model only runs where it is).
            identity = identity or (a < 2 and sizes is not None and not isinstance(n_in, int) and isinstance(n_out, int))
            if identity and not isinstance(n_in, int):
                shape_in.append(1), shape_out.append(1), factors.append(1.0)
                continue
            block = (
                _block_factor(scale_list[k], attrs, roi)
                if (k is not None and sizes is None and not isinstance(n_in, int))
                else None
            )
            if block is not None:
                blocks[a] = block
                shape_in.append(1), shape_out.append(1), factors.append(1.0)
                continue
            if not isinstance(n_in, int) or not isinstance(n_out, int):
                if roi is not None:
                    raise ModelError(f"{node_where(g)}: Resize needs static sizes of axis {a} for its gradient")
                runtime[a] = None if k is None or sizes is not None else scale_list[k]
                shape_in.append(1), shape_out.append(1), factors.append(1.0)
                continue
            shape_in.append(n_in), shape_out.append(n_out)
            factors.append(n_out / n_in if sizes is not None or k is None else scale_list[k])
    _warn_fractional_width(g, ctm, sizes, shape_in, shape_out, factors)
    dtype = numpy_dtype_of(x)
    dx = g.dy()
    # Outputs set to extrapolation_value (tf_crop_and_resize) have zero rows: no gradient.
    mats = resize_matrices(shape_in, shape_out, factors, attrs, roi, g.attr("axes"))
    for axis, (m, _) in sorted(mats.items()):
        dx = _along_axis(g, dx, axis, rank, lambda v, m=m: g.op("MatMul", v, g.const(m.astype(dtype))))
    for axis, s in sorted(blocks.items()):  # output o of the block read input o // s: sum each block
        dx = _along_axis(
            g, dx, axis, rank, lambda v, s=s: g.reduce_sum(g.reshape(v, [0] * (rank - 1) + [-1, s]), [rank], keepdims=0)
        )
    for axis, scale in sorted(runtime.items()):
        matrix = _run_time_matrix(g, x, axis, scale, attrs, dtype)
        dx = _along_axis(g, dx, axis, rank, lambda v, m=matrix: g.op("MatMul", v, m))
    return [dx]


def _along_axis(g, value: ir.Value, axis: int, rank: int, transform) -> ir.Value:
    """``transform`` of ``value`` with ``axis`` swapped to the last place, swapped back after."""
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = value if axis == rank - 1 else g.transpose(value, perm)
    moved = transform(moved)
    return moved if axis == rank - 1 else g.transpose(moved, perm)


def _run_time_matrix(g, x: ir.Value, axis: int, scale: float | None, attrs: dict, dtype) -> ir.Value:
    """The (n_out, n_in) matrix of Resize along ``axis`` where its sizes are known at run time
    only (``F.interpolate(x, size=skip.shape[-2:])`` exported with dynamic axes): Resize is linear
    in its input, so resizing the n_in x n_in identity along its first axis, with the node's mode
    and coordinate attributes and the same scale (or the output's size, read from dY), gives the
    matrix whose transpose carries dY back."""
    work = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    n_in = g.part(g.shape_of(x), axis, axis + 1)
    square = g.op("ConstantOfShape", g.op("Concat", n_in, n_in, axis=0), value=ir.tensor(np.zeros((1,), work)))
    eye = g.op("EyeLike", square)
    kept = {k: v for k, v in attrs.items() if v is not None}
    if scale is not None:
        matrix = g.op("Resize", eye, None, g.const(np.array([scale, 1.0], np.float32)), **kept)
    else:
        n_out = g.part(g.shape_of(g.dy()), axis, axis + 1)
        matrix = g.op("Resize", eye, None, None, g.op("Concat", n_out, n_in, axis=0), **kept)
    return matrix if work == np.dtype(dtype) else g.op("Cast", matrix, to=ir.DataType.from_numpy(np.dtype(dtype)))


def _block_factor(scale: float, attrs: dict, roi) -> int | None:
    """s when an axis resized by ``scale`` maps output o to input o // s for every input size
    (an integer factor s > 1, one-hot rows in nearest blocks), else None. Checked on the matrices
    of a few sizes: for these modes the rows only depend on o mod s and o // s."""
    from gradgen.ops.pool import resize_matrices

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


@grad_rule("MaxRoiPool", nondiff_inputs=(1,))
def max_roi_pool(g):
    """dX: each bin's dY added at its arg-max (the first maximum in row-major order, as the kernel
    takes it), like MaxPool's; empty bins give nothing. The rois get no gradient: the bins are
    rounded pixel ranges, so Y is piecewise constant in the rois (zero derivative wherever one
    exists), as Floor's is in its input.

    The arg-max is found in standard ops over a dense (rois, C, PH, PW, H * W) masked copy of the
    rois' images: memory grows with rois x C x PH x PW x H x W (a ceiling for large detection
    models), in exchange for no custom op."""
    x, rois, dy = g.x(0), g.x(1), g.dy()
    attrs = forward_attrs(g)
    pooled_h, pooled_w = (int(v) for v in attrs["pooled_shape"])
    scale = float(attrs.get("spatial_scale", 1.0))
    f32 = lambda v: g.const(np.asarray(v, np.float32))  # noqa: E731
    shape = g.shape_of(x)
    coords = g.op(
        "Mul", g.op("Cast", g.op("Slice", rois, g.ints([1]), g.ints([5]), g.ints([1])), to=ir.DataType.FLOAT), f32(scale)
    )
    coords = g.op("Mul", g.op("Sign", coords), g.op("Floor", g.op("Add", g.op("Abs", coords), f32(0.5))))  # round half away

    def axis_mask(start_col: int, end_col: int, pooled: int, size_axis: int):
        """(rois, pooled, size) bool: pixel i of the axis lies in bin p of roi r; and (rois, pooled) non-empty."""
        start = g.op("Gather", coords, g.ints([start_col]), axis=1)  # (R, 1)
        end = g.op("Gather", coords, g.ints([end_col]), axis=1)
        step = g.op("Div", g.op("Max", g.op("Add", g.op("Sub", end, start), f32(1.0)), f32(1.0)), f32(float(pooled)))
        bins = f32(np.arange(pooled, dtype=np.float32)[None, :])
        size = g.op("Cast", g.part(shape, size_axis, size_axis + 1), to=ir.DataType.FLOAT)
        lo = g.op("Min", g.op("Max", g.op("Add", g.op("Floor", g.op("Mul", bins, step)), start), f32(0.0)), size)
        hi = g.op(
            "Min", g.op("Max", g.op("Add", g.op("Ceil", g.op("Mul", g.op("Add", bins, f32(1.0)), step)), start), f32(0.0)), size
        )
        pixels = g.op("Range", f32(0.0), g.squeeze(size, [0]), f32(1.0))
        inside = g.op("And", g.op("GreaterOrEqual", pixels, g.unsqueeze(lo, [2])), g.op("Less", pixels, g.unsqueeze(hi, [2])))
        return inside, g.op("Greater", hi, lo)

    rows, rows_full = axis_mask(1, 3, pooled_h, 2)  # (R, PH, H), (R, PH)
    cols, cols_full = axis_mask(0, 2, pooled_w, 3)  # (R, PW, W), (R, PW)
    mask = g.op("And", g.unsqueeze(rows, [2, 4]), g.unsqueeze(cols, [1, 3]))  # (R, PH, PW, H, W)
    full = g.op("And", g.unsqueeze(rows_full, [2]), g.unsqueeze(cols_full, [1]))  # (R, PH, PW)
    batch = g.op("Cast", g.op("Gather", rois, g.scalar(0), axis=1), to=ir.DataType.INT64)  # (R,)
    images = g.unsqueeze(g.op("Gather", x, batch, axis=0), [2, 3])  # (R, C, 1, 1, H, W)
    masked = g.op("Where", g.unsqueeze(mask, [1]), images, g.const_like(x, -np.inf))  # (R, C, PH, PW, H, W)
    arg = g.op("ArgMax", g.reshape(masked, [0, 0, 0, 0, -1]), axis=-1, keepdims=0)  # (R, C, PH, PW)
    plane = g.prod(shape, 2)
    where = g.op("Add", g.op("Mul", g.unsqueeze(batch, [1, 2, 3]), plane), arg)  # index into (N * H * W) per channel
    grads = g.op("Where", g.unsqueeze(full, [1]), dy, g.const_like(x, 0.0))
    channels = g.part(shape, 1, 2)
    lines = g.cat(channels, g.ints([-1]))
    by_channel = g.reshape(
        g.zeros(g.cat(channels, g.op("Mul", g.part(shape, 0, 1), plane)), like=x), g.cat(channels, g.ints([-1]))
    )
    dx = g.op(
        "ScatterElements",
        by_channel,
        g.reshape(g.transpose(where, [1, 0, 2, 3]), lines),
        g.reshape(g.transpose(grads, [1, 0, 2, 3]), lines),
        axis=1,
        reduction="add",
    )
    dx = g.reshape(dx, g.cat(channels, g.part(shape, 0, 1), g.part(shape, 2)), exact=True)
    return [g.transpose(dx, [1, 0, 2, 3]), None]


@grad_rule("MaxPoolGrad", nondiff_inputs=(1,))
def max_pool_grad(g):
    """ONNX Runtime training's MaxPoolGrad(dY, Indices): dY added at the flat positions Indices. It
    is linear in dY, and its adjoint reads the incoming gradient back at those positions."""
    return [g.op("Gather", g.reshape(g.dy(), [-1]), g.x(1), axis=0), None]


@grad_rule("AveragePoolGrad")
def average_pool_grad(g):
    """ONNX Runtime training's AveragePoolGrad(dY): each dY spread over its window, divided by the
    window's count. It is linear in dY, and its adjoint is the AveragePool with the same attributes."""
    names = ("auto_pad", "ceil_mode", "count_include_pad", "kernel_shape", "pads", "strides")
    attrs = {name: g.attr(name) for name in names if g.attr(name) is not None}
    return [g.op("AveragePool", g.dy(), **attrs)]
