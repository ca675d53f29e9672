"""CPU kernels: convolution (Conv, ConvTranspose) and ONNX Runtime training's ConvGrad.

Convolution gathers the receptive fields with ``sliding_window_view`` (a strided view; the
contraction with the weights copies it once, im2col style) and contracts with ``tensordot``/
``einsum``, so the heavy work runs in BLAS. float16 inputs are computed in float32 and cast back;
every output has its input's dtype. Padding follows ONNX (see pool.py).

ConvGrad follows ONNX Runtime training's contract: (dY, X, W) in, (dX, dW, dB) out, each output
optional; float16 (and bfloat16) accumulate in float32.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import blas, onednn_conv
from gradgen.kernels.cpu.prepared import kernel_first
from gradgen.kernels.numeric import accumulation_dtype, float_compute_dtype, pad_spatial, sliding_windows
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.axes import per_axis
from gradgen.ops.conv import (
    col2im_channels,
    col2im_geometry,
    conv_geometry,
    conv_transpose_geometry,
    deform_conv_geometry,
    deform_conv_positions,
)
from gradgen.ops.pool import spatial_geometry
from gradgen.ops.schemas import FLOATS_NO_BF16, Attribute, Formal, Schema, TensorInfo

# ---------------------------------------------------------------- ConvGrad


def _conv_grad_types(infos: list, attrs: dict) -> list:
    """(dtype, shape) of dX (X's), dW (W's) and dB (W's output channels); a missing dtype is dY's."""
    dy, x, w = infos
    return [
        (x.dtype if x.dtype is not None else dy.dtype, x.shape),
        (w.dtype if w.dtype is not None else dy.dtype, w.shape),
        (dy.dtype if dy.dtype is not None else w.dtype, (_dim(w, 0),)),
    ]


def _dim(info: TensorInfo | None, axis: int):
    if info is None or info.shape is None or len(info.shape) <= axis:
        return None
    return info.shape[axis]


CONV_GRAD = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc); the node keeps the forward Conv's
        # attributes verbatim, which ORT's schema does not declare.
        "ConvGrad",
        inputs=(Formal("dY", FLOATS_NO_BF16), Formal("X", FLOATS_NO_BF16), Formal("W", FLOATS_NO_BF16)),
        outputs=(
            Formal("dX", FLOATS_NO_BF16, optional=True),
            Formal("dW", FLOATS_NO_BF16, optional=True),
            Formal("dB", FLOATS_NO_BF16, optional=True),
        ),
        attributes=(
            Attribute("auto_pad", "string", "NOTSET", declared=False),
            Attribute("dilations", "ints", declared=False),
            Attribute("group", "int", 1, declared=False),
            Attribute("kernel_shape", "ints", declared=False),
            Attribute("pads", "ints", declared=False),
            Attribute("strides", "ints", declared=False),
        ),
        infer=_conv_grad_types,
    )
)


@cpu_kernel("ConvGrad", domain=MICROSOFT)
def conv_grad(
    dY,
    X,
    W,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    pads=None,
    strides=None,
    _num_outputs=3,
    _wanted=None,
):
    """(dX, dW, dB) of Conv(X, W[, B]) by im2col and batched matmuls, one per group.

    Outputs the node leaves unnamed (``_wanted`` False) are not computed (None in their place).
    """
    wanted = _wanted or (True,) * _num_outputs
    dY, X, W = np.asarray(dY), np.asarray(X), np.asarray(W)
    if not dY.dtype == X.dtype == W.dtype:
        raise KernelError(f"dY, X and W must have one dtype; got {dY.dtype}, {X.dtype}, {W.dtype}")
    begin, end, strides, dilations, y_shape = conv_geometry(
        X.shape,
        W.shape,
        auto_pad=auto_pad,
        dilations=dilations,
        group=group,
        kernel_shape=kernel_shape,
        pads=pads,
        strides=strides,
    )
    if dY.shape != y_shape:
        raise KernelError(f"dY has shape {list(dY.shape)}, but Conv's output shape is {list(y_shape)}")
    acc = accumulation_dtype(X.dtype)
    n, m = X.shape[0], W.shape[0]
    g, mg, nd = group, m // group, X.ndim - 2
    out = y_shape[2:]
    p = math.prod(out)
    spatial_axes = tuple(range(2, 2 + nd))
    dy = dY.astype(acc, copy=False)
    # dY as (G, Mg, N*P): one matrix per group.
    dy_g = dy.reshape(n, g, mg, p).transpose(1, 2, 0, 3).reshape(g, mg, n * p)
    geometry = (g, begin, end, strides, dilations, out)
    results = []
    # dX and dW in their own functions: each one's scratch (a GEMM result or im2col the size of
    # (Cg*K, N*P)) is freed before the next is built
    if _num_outputs >= 1:
        results.append(_conv_grad_dx(dy_g, X, W, acc, geometry) if wanted[0] else None)
    if _num_outputs >= 2:
        results.append(_conv_grad_dw(dy_g, X, W, acc, geometry) if wanted[1] else None)
    if _num_outputs >= 3:
        results.append(dy.sum(axis=(0, *spatial_axes)).astype(dY.dtype))
    return tuple(results)


def _conv_grad_dx(dy_g, X, W, acc, geometry):
    """dX: W^T @ dY per group (the columns), then col2im, each tap added in the kernel's order."""
    g, begin, end, strides, dilations, out = geometry
    n, c = X.shape[:2]
    mg, cg, kernel = W.shape[0] // g, W.shape[1], W.shape[2:]
    k, nd = math.prod(kernel), len(kernel)
    w_t = W.astype(acc, copy=False).reshape(g, mg, cg * k).transpose(0, 2, 1)
    cols = blas.matmul(w_t, dy_g)  # (G, Cg*K, N*P)
    # each tap's (N, C, *out) as a strided view of cols: col2im reads it in place (no reordered copy)
    taps = cols.reshape(g, cg, k, n, *out).transpose(2, 3, 0, 1, *range(4, 4 + nd)).reshape(k, n, c, *out)
    padded = [s + b + e for s, b, e in zip(X.shape[2:], begin, end)]
    dxp = np.zeros((n, c, *padded), dtype=acc)
    for position, offset in enumerate(np.ndindex(*kernel)):
        window = tuple(slice(o * d, o * d + (q - 1) * s + 1, s) for o, d, q, s in zip(offset, dilations, out, strides))
        dxp[(slice(None), slice(None)) + window] += taps[position]
    crop = tuple(slice(b, b + s) for b, s in zip(begin, X.shape[2:]))
    return dxp[(slice(None), slice(None)) + crop].astype(X.dtype)


def _conv_grad_dw(dy_g, X, W, acc, geometry):
    """dW: dY @ im2col(X)^T per group."""
    g, begin, end, strides, dilations, out = geometry
    n = X.shape[0]
    cg, kernel = W.shape[1], W.shape[2:]
    k, nd, p = math.prod(kernel), len(kernel), math.prod(out)
    xp = pad_spatial(X.astype(acc, copy=False), begin, end, 0)
    view = sliding_windows(xp, kernel, strides, dilations, out)  # (N, C, *out, *kernel)
    # im2col: (N, G, Cg, *out, *kernel) -> (G, Cg*K, N*P), one copy with the output positions
    # innermost (they run along X's rows, which keeps the copy fast).
    view = view.reshape(n, g, cg, *view.shape[2:])
    order = (1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd))
    im2col = view.transpose(order).reshape(g, cg * k, n * p)
    return blas.matmul(dy_g, im2col.transpose(0, 2, 1)).reshape(W.shape).astype(W.dtype)


@cpu_prepare("ConvGrad", domain=MICROSOFT)
def prepare_conv_grad(constants: tuple, attrs: dict):
    """ConvGrad of small images with its geometry, im2col and col2im worked out once per shape:
    dW's columns gathered by a kept index (the kernel's im2col, so the same GEMM), dX's col2im as
    one gather by a kept table, its taps in the kernel's order after a zero and added by one
    reduction over them (the kernel's sums, bit for bit). A shape seen for the first time, and
    large ones, run ``conv_grad`` itself."""
    num_outputs = attrs.get("_num_outputs", 3)
    wanted = attrs.get("_wanted") or (True,) * num_outputs

    def onednn_parts(plan, dY, X, W) -> tuple:
        """oneDNN's parts of ConvGrad, and the kernel's for the parts oneDNN refused."""
        results = list(plan(dY, X, W))
        if any(plan.missing):
            rest = conv_grad(dY, X, W, **{**attrs, "_wanted": plan.missing + (False,) * (num_outputs - 2)})
            results[:2] = [kept if missing else r for r, kept, missing in zip(results, rest, plan.missing)]
        return tuple(results)

    def fast(plan, dY, X, W):
        if isinstance(plan, onednn_conv.OneDnnConvGrad):
            return onednn_parts(plan, dY, X, W)
        acc, g, mg, p, dx_table, padded, interior, dw_index, spatial_axes = plan
        n = X.shape[0]
        dy = dY.astype(acc, copy=False)
        dy_g = dy.reshape(n, g, mg, p).transpose(1, 2, 0, 3).reshape(g, mg, n * p)
        results = []
        if num_outputs >= 1:
            results.append(_planned_dx(dy_g, X, W, acc, g, dx_table) if wanted[0] else None)
        if num_outputs >= 2:
            results.append(_planned_dw(dy_g, X, W, acc, padded, interior, dw_index) if wanted[1] else None)
        if num_outputs >= 3:
            results.append(dy.sum(axis=(0, *spatial_axes)).astype(dY.dtype))
        return tuple(results)

    return kernel_first(
        lambda dY, X, W: conv_grad(dY, X, W, **attrs),
        lambda dY, X, W: (dY.shape, X.shape, W.shape, dY.dtype, X.dtype, W.dtype),
        lambda dY, X, W: (
            _onednn_conv_grad_plan(dY, X, W, attrs, tuple(wanted[:num_outputs]))
            or _conv_grad_plan(X.shape, W.shape, X.dtype, attrs)
        ),
        fast,
    )


def _conv_grad_geometry(x_shape: tuple, w_shape: tuple, attrs: dict) -> tuple:
    """ConvGrad's forward geometry: (begin pads, end pads, strides, dilations, Y's shape)."""
    geometry = {k: attrs[k] for k in ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides") if k in attrs}
    return conv_geometry(x_shape, w_shape, **geometry)


def _onednn_conv_grad_plan(dY, X, W, attrs: dict, wanted: tuple) -> onednn_conv.OneDnnConvGrad | None:
    """oneDNN's backward primitives for a grouped float32 ConvGrad that computes dX or dW
    (``conv_grad`` has checked the shapes), else None."""
    group = int(attrs.get("group", 1))
    if group <= 1 or not any(wanted[:2]) or not _all_float32(dY, X, W):
        return None
    begin, end, strides, dilations, y_shape = _conv_grad_geometry(X.shape, W.shape, attrs)
    if tuple(y_shape) != dY.shape:
        return None
    return onednn_conv.plan_conv_grad(X.shape, W.shape, group, strides, dilations, begin, end, y_shape[2:], wanted)


def _planned_dx(dy_g, X, W, acc, g, table) -> np.ndarray:
    w_t = W.astype(acc, copy=False).reshape(g, W.shape[0] // g, -1).transpose(0, 2, 1)
    cols = blas.matmul(w_t, dy_g)  # (G, Cg*K, N*P), as the kernel makes it
    return _sums_by_table(cols, table).reshape(X.shape).astype(X.dtype)


def _sums_by_table(cols: np.ndarray, table: np.ndarray) -> np.ndarray:
    """A col2im by a kept gather table of (1 + taps, outputs): per output, a zero and then its taps
    of ``cols`` (the position past the end reads the zero) added in the table's order."""
    extended = np.zeros(cols.size + 1, dtype=cols.dtype)  # the last slot: the zero each sum starts from
    extended[:-1] = cols.reshape(-1)
    return np.add.reduce(extended[table], axis=0)


def _padded_flat(x: np.ndarray, dtype, padded: tuple | None, interior: tuple) -> np.ndarray:
    """x in ``dtype``, zero-padded to ``padded`` (None: no padding), flattened (what a kept im2col
    index reads)."""
    if padded is None:
        return x.astype(dtype, copy=False).reshape(-1)
    xp = np.zeros(padded, dtype=dtype)
    xp[interior] = x
    return xp.reshape(-1)


def _planned_dw(dy_g, X, W, acc, padded, interior, index) -> np.ndarray:
    im2col = _padded_flat(X, acc, padded, interior)[index]  # (G, Cg*K, N*P): the kernel's im2col copy
    return blas.matmul(dy_g, im2col.transpose(0, 2, 1)).reshape(W.shape).astype(W.dtype)


def _conv_grad_plan(x_shape: tuple, w_shape: tuple, dtype, attrs: dict):
    """What ``prepare_conv_grad`` needs for these shapes (the kernel has checked them), or False
    when its tables would be large: (accumulation type, groups, Mg, P, dX's (1 + K, X.size) gather
    table, the padded shape or None, the interior of the padding, dW's im2col index, X's spatial
    axes)."""
    begin, end, strides, dilations, y_shape = _conv_grad_geometry(x_shape, w_shape, attrs)
    g = int(attrs.get("group", 1))
    n, c = x_shape[:2]
    m, cg, kernel = w_shape[0], w_shape[1], tuple(w_shape[2:])
    k, nd, out = math.prod(kernel), len(kernel), tuple(y_shape[2:])
    p, x_size = math.prod(out), math.prod(x_shape)
    if (k + 1) * x_size > SMALL_CONV_COLUMNS or g * cg * k * n * p > SMALL_CONV_COLUMNS:
        return False
    padded = tuple(x_shape[:2]) + tuple(s + b + e for s, b, e in zip(x_shape[2:], begin, end))
    interior = (slice(None), slice(None)) + tuple(slice(b, b + s) for b, s in zip(begin, x_shape[2:]))
    # dX: replay the kernel's col2im on the columns' positions
    n_cols = g * cg * k * n * p
    taps = np.arange(n_cols, dtype=np.intp).reshape(g, cg, k, n, *out)
    taps = taps.transpose(2, 3, 0, 1, *range(4, 4 + nd)).reshape(k, n, c, *out)
    rows = [np.full(x_size, n_cols, dtype=np.intp)]  # the zero first
    for position, offset in enumerate(np.ndindex(*kernel)):
        source = np.full(padded, n_cols, dtype=np.intp)
        window = tuple(slice(o * d, o * d + (q - 1) * s + 1, s) for o, d, q, s in zip(offset, dilations, out, strides))
        source[(slice(None), slice(None)) + window] = taps[position]
        rows.append(source[interior].reshape(-1))
    # dW: the kernel's im2col on the padded image's positions
    positions = np.arange(math.prod(padded), dtype=np.intp).reshape(padded)
    view = sliding_windows(positions, kernel, strides, dilations, out).reshape(n, g, cg, *out, *kernel)
    order = (1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd))
    index = np.ascontiguousarray(view.transpose(order).reshape(g, cg * k, n * p))
    has_pad = any(begin) or any(end)
    return (
        accumulation_dtype(dtype),
        g,
        m // g,
        p,
        np.stack(rows),
        padded if has_pad else None,
        interior,
        index,
        tuple(range(2, 2 + nd)),
    )


# ---------------------------------------------------------------- Conv, ConvTranspose


@cpu_kernel("Conv")
def conv(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"X {list(x.shape)} and W {list(w.shape)} must have the same rank >= 3")
    group = int(group)
    n_batch, channels = x.shape[:2]
    m, c_per_group = w.shape[:2]
    if group < 1 or channels % group or m % group or c_per_group * group != channels:
        raise KernelError(
            f"group={group} does not fit X with {channels} channels and W of shape {list(w.shape)} "
            f"(W.shape[1] * group must equal the channel count; group must divide W.shape[0])"
        )
    if kernel_shape is not None and list(kernel_shape) != list(w.shape[2:]):
        raise KernelError(f"kernel_shape {list(kernel_shape)} differs from W's spatial shape {list(w.shape[2:])}")
    kernel, s, d, begin, end, out = spatial_geometry(x.shape, w.shape[2:], strides, dilations, pads, auto_pad)
    ct = float_compute_dtype(x.dtype)
    xp = pad_spatial(x.astype(ct, copy=False), begin, end, 0)
    win = sliding_windows(xp, kernel, s, d, out)  # (N, C, *out, *k)
    ns, k, p = len(kernel), math.prod(kernel), math.prod(out)
    w_g = w.astype(ct, copy=False).reshape(group, m // group, c_per_group * k)
    # im2col, one copy whose innermost axis is the longer of the output positions and the kernel
    # taps (both run along X's rows; a weight gradient lowered to a Conv has a kernel as large as
    # the image), then one GEMM per group; large images one at a time (see _conv_per_image).
    if group == 1 and n_batch > 1 and p >= PER_IMAGE_POSITIONS and channels * k * n_batch * p > SMALL_CONV_COLUMNS:
        y = _conv_per_image(win, w_g[0], ns, p)
    elif p >= k:
        win = win.reshape((n_batch, group, c_per_group) + win.shape[2:])
        order = (1, 2, *range(3 + ns, 3 + 2 * ns), 0, *range(3, 3 + ns))
        cols = win.transpose(order).reshape(group, c_per_group * k, n_batch * p)
        y = blas.matmul(w_g, cols).reshape(m, n_batch, p).transpose(1, 0, 2)  # (N, M, P), a view
    else:
        win = win.reshape((n_batch, group, c_per_group) + win.shape[2:])
        order = (1, 0, *range(3, 3 + ns), 2, *range(3 + ns, 3 + 2 * ns))
        cols = win.transpose(order).reshape(group, n_batch * p, c_per_group * k)
        y = blas.matmul(cols, w_g.transpose(0, 2, 1))  # (G, N*P, Mg)
        y = y.reshape(group, n_batch, p, m // group).transpose(1, 0, 3, 2).reshape(n_batch, m, p)
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape(-1, 1)
    return np.ascontiguousarray(y, dtype=x.dtype).reshape((n_batch, m) + tuple(out))


def qlinear_conv_channel_shape(value_shape, rank: int, channels: int, what: str) -> tuple[int, ...]:
    """The broadcast shape of QLinearConv's w_scale / w_zero_point against the output: a scalar,
    or one value per output channel."""
    size = math.prod(value_shape)
    if len(value_shape) == 0 or size == 1 and len(value_shape) == 1:
        return ()
    if len(value_shape) != 1 or size != channels:
        raise KernelError(
            f"QLinearConv's {what} has shape {list(value_shape)}: a scalar or one value per output channel ({channels})"
        )
    return (1, channels) + (1,) * (rank - 2)


def check_qlinear_conv_scalars(named: dict) -> None:
    for name, value in named.items():
        if value is not None and math.prod(value.shape) != 1:
            raise KernelError(f"QLinearConv's {name} must be a scalar, got shape {list(value.shape)}")


@cpu_kernel("QLinearConv")
def qlinear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, b=None, **attrs):
    """Conv of (x - x_zero_point) and (w - w_zero_point) plus the int32 bias B, exact in float64,
    requantized with x_scale * w_scale / y_scale (w's per output channel or not) and y_zero_point
    (gradgen/kernels/cpu/quantize.py's ``requantize``). ``attrs``: Conv's."""
    from gradgen.kernels.cpu.quantize import check_linear_quantized, requantize, requantized_type

    check_linear_quantized("QLinearConv", x, x_zero_point, w, w_zero_point, y_zero_point, (x_scale, w_scale, y_scale))
    check_qlinear_conv_scalars(dict(x_scale=x_scale, x_zero_point=x_zero_point, y_scale=y_scale, y_zero_point=y_zero_point))
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"X {list(x.shape)} and W {list(w.shape)} must have the same rank >= 3")
    channels = w.shape[0]
    per_channel = {
        name: qlinear_conv_channel_shape(tuple(v.shape), x.ndim, channels, name)
        for name, v in (("w_scale", w_scale), ("w_zero_point", w_zero_point))
        if v is not None
    }
    x_wide, w_wide = x.astype(np.float64), w.astype(np.float64)
    if x_zero_point is not None:
        x_wide -= np.asarray(x_zero_point).astype(np.float64).reshape(())
    if w_zero_point is not None:
        zero_point = np.asarray(w_zero_point).astype(np.float64)
        w_wide -= zero_point.reshape((channels,) + (1,) * (w.ndim - 1)) if per_channel["w_zero_point"] else zero_point.reshape(())
    if b is not None and (b.dtype != np.int32 or b.shape != (channels,)):
        raise KernelError(f"QLinearConv's B must be int32 of shape [{channels}], got {b.dtype}{list(b.shape)}")
    acc = conv(x_wide, w_wide, None if b is None else b.astype(np.float64), **attrs)
    ratio = (
        np.asarray(x_scale).reshape(()) * np.asarray(w_scale).reshape(per_channel["w_scale"]) / np.asarray(y_scale).reshape(())
    )
    y_zp = None if y_zero_point is None else np.asarray(y_zero_point).reshape(())
    return requantize(acc, ratio, y_zp, requantized_type(y_zero_point, x.dtype))


SMALL_CONV_COLUMNS = 1 << 17  # im2col elements up to which a prepared Conv gathers by a kept index (1 MiB of it)
PER_IMAGE_POSITIONS = 512  # output positions per image from which a large Conv runs image by image
TRANSPOSE_AS_CONV_POSITIONS = 100  # output positions per image from which a large ConvTranspose of stride 1 runs as a Conv


def _conv_per_image(win: np.ndarray, w2: np.ndarray, ns: int, p: int) -> np.ndarray:
    """Conv of group 1 as im2col and one GEMM per image, each written into the output's own rows.

    ``win`` is the padded input's window view (N, C, *out, *kernel) and ``w2`` the weight as (M,
    C * K). One image's columns stay in cache and the result needs no transpose: at 56 x 56 with
    64 channels this took 11.4 ms against 14.1 ms for one im2col of the whole batch; at 7 x 7 the
    batched form is faster, hence ``PER_IMAGE_POSITIONS``.
    """
    n_batch, channels = win.shape[:2]
    y = np.empty((n_batch, w2.shape[0], p), dtype=w2.dtype)
    to_columns = (0, *range(1 + ns, 1 + 2 * ns), *range(1, 1 + ns))  # (C, *kernel, *out)
    cols = np.empty((channels, *win.shape[2 + ns :], *win.shape[2 : 2 + ns]), dtype=w2.dtype)
    for image in range(n_batch):
        np.copyto(cols, win[image].transpose(to_columns))
        blas.matmul(w2, cols.reshape(w2.shape[1], p), out=y[image])
    return y


@cpu_prepare("Conv")
def prepare_conv(constants: tuple, attrs: dict):
    """Conv with its geometry worked out once per (X, W) shape and, for small images (where numpy's
    padding and window views cost more than the arithmetic), im2col as one gather by a kept flat
    index: the same columns, so the same GEMM and the same bits as ``conv``. A shape seen for the
    first time, and large convolutions, run ``conv`` itself."""
    return kernel_first(
        lambda x, w, b=None: conv(x, w, b, **attrs),
        lambda x, w, b=None: (x.shape, w.shape, x.dtype, w.dtype),
        lambda x, w, b=None: _onednn_conv_plan(x, w, b, attrs) or _conv_plan(x.shape, w.shape, x.dtype, attrs),
        _planned_conv,
    )


def _all_float32(*arrays) -> bool:
    return all(a is None or a.dtype == np.float32 for a in arrays)


def _conv_spatial_geometry(x_shape: tuple, w_shape: tuple, attrs: dict) -> tuple:
    """Conv's (kernel, strides, dilations, begin pads, end pads, output size) from its attributes."""
    return spatial_geometry(
        x_shape, w_shape[2:], attrs.get("strides"), attrs.get("dilations"), attrs.get("pads"), attrs.get("auto_pad", "NOTSET")
    )


def _onednn_conv_plan(x, w, b, attrs: dict) -> onednn_conv.OneDnnPlan | None:
    """oneDNN's primitive for a grouped float32 Conv (``conv`` has checked the shapes), else None."""
    group = int(attrs.get("group", 1))
    if group <= 1 or not _all_float32(x, w, b):
        return None
    _, s, d, begin, end, out = _conv_spatial_geometry(x.shape, w.shape, attrs)
    return onednn_conv.plan_conv(x.shape, w.shape, group, s, d, begin, end, out, b is not None)


def _planned_conv(plan, x, w, b=None):
    if isinstance(plan, onednn_conv.OneDnnPlan):
        return plan(x, w, b)
    ct, padded, interior, index, group, w_shape, cols_first, y_shape, out_shape = plan
    cols = _padded_flat(x, ct, padded, interior)[index]
    w_g = w.astype(ct, copy=False).reshape(w_shape)
    n_batch, m, p, mg = y_shape
    if cols_first:
        y = blas.matmul(w_g, cols).reshape(m, n_batch, p).transpose(1, 0, 2)
    else:
        y = blas.matmul(cols, w_g.transpose(0, 2, 1))
        y = y.reshape(group, n_batch, p, mg).transpose(1, 0, 3, 2).reshape(n_batch, m, p)
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape(-1, 1)
    return np.ascontiguousarray(y, dtype=x.dtype).reshape(out_shape)


def _conv_plan(x_shape: tuple, w_shape: tuple, dtype, attrs: dict):
    """What ``prepare_conv``'s fast path needs for these shapes (``conv`` has checked them), or
    False when the columns are too many to gather by index."""
    group = int(attrs.get("group", 1))
    n_batch, m, c_per_group = x_shape[0], w_shape[0], w_shape[1]
    kernel, s, d, begin, end, out = _conv_spatial_geometry(x_shape, w_shape, attrs)
    ns, k, p = len(kernel), math.prod(kernel), math.prod(out)
    if c_per_group * k * n_batch * p * group > SMALL_CONV_COLUMNS:
        return False
    ct = float_compute_dtype(dtype)
    padded_shape = tuple(x_shape[:2]) + tuple(n + bg + e for n, bg, e in zip(x_shape[2:], begin, end))
    # the kernel's own window view and im2col layout, over the positions of the padded image
    positions = np.arange(math.prod(padded_shape), dtype=np.intp).reshape(padded_shape)
    win = sliding_windows(positions, kernel, s, d, out)
    win = win.reshape((n_batch, group, c_per_group) + win.shape[2:])
    cols_first = p >= k
    if cols_first:
        order = (1, 2, *range(3 + ns, 3 + 2 * ns), 0, *range(3, 3 + ns))
        index = win.transpose(order).reshape(group, c_per_group * k, n_batch * p)
    else:
        order = (1, 0, *range(3, 3 + ns), 2, *range(3 + ns, 3 + 2 * ns))
        index = win.transpose(order).reshape(group, n_batch * p, c_per_group * k)
    has_pad = any(begin) or any(end)
    interior = (slice(None), slice(None)) + tuple(slice(bg, bg + n) for bg, n in zip(begin, x_shape[2:]))
    return (
        ct,
        padded_shape if has_pad else None,
        interior,
        np.ascontiguousarray(index),
        group,
        (group, m // group, c_per_group * k),
        cols_first,
        (n_batch, m, p, m // group),
        (n_batch, m) + tuple(out),
    )


@cpu_kernel("ConvTranspose")
def conv_transpose(
    x,
    w,
    b=None,
    *,
    auto_pad="NOTSET",
    dilations=None,
    group=1,
    kernel_shape=None,
    output_padding=None,
    output_shape=None,
    pads=None,
    strides=None,
):
    if x.ndim < 3 or w.ndim != x.ndim:
        raise KernelError(f"X {list(x.shape)} and W {list(w.shape)} must have the same rank >= 3")
    group = int(group)
    n_batch, channels = x.shape[:2]
    if group < 1 or channels % group or w.shape[0] != channels:
        raise KernelError(f"group={group} does not fit X with {channels} channels and W of shape {list(w.shape)}")
    m = w.shape[1] * group
    ns = x.ndim - 2
    spatial = list(x.shape[2:])
    kernel = list(w.shape[2:])
    if kernel_shape is not None and list(kernel_shape) != kernel:
        raise KernelError(f"kernel_shape {list(kernel_shape)} differs from W's spatial shape {kernel}")
    s = per_axis(strides, ns, 1, "strides")
    d = per_axis(dilations, ns, 1, "dilations")
    full, begin, out = conv_transpose_geometry(
        x.shape,
        w.shape,
        dict(
            auto_pad=auto_pad,
            dilations=dilations,
            output_padding=output_padding,
            output_shape=output_shape,
            pads=pads,
            strides=strides,
        ),
    )
    if (
        group == 1
        and set(s) == {1}
        and math.prod(out) >= TRANSPOSE_AS_CONV_POSITIONS
        and n_batch * m * math.prod(out) * (math.prod(kernel) + 1) > SMALL_CONV_COLUMNS
    ):
        y = _stride_one_transpose_as_conv(x, w, d, begin, out)
        if b is not None:
            y = y + b.astype(y.dtype, copy=False).reshape((-1,) + (1,) * ns)
        return np.ascontiguousarray(y, dtype=x.dtype)
    ct = float_compute_dtype(x.dtype)
    xc = x.astype(ct, copy=False)
    wc = w.astype(ct, copy=False)
    cg, mg = channels // group, m // group
    # cols: (M, *kernel, N, *in), contiguous -- every input pixel times every kernel tap, one GEMM
    # per group: (Mg*K, Cg) @ (Cg, N*P_in).
    k, p_in = math.prod(kernel), math.prod(spatial)
    w_t = wc.reshape(group, cg, mg * k).transpose(0, 2, 1)
    x_t = xc.reshape(n_batch, group, cg, p_in).transpose(1, 2, 0, 3).reshape(group, cg, n_batch * p_in)
    # one input channel per group (a depthwise Conv's data gradient): each product has one term, so
    # a broadcast multiply gives the same values without a matmul call per group (82 against 22 us
    # for 64 groups of (9 x 1) @ (1 x 128))
    cols = w_t * x_t if cg == 1 else blas.matmul(w_t, x_t)
    cols = cols.reshape((m, *kernel, n_batch, *spatial))
    # col2im into a (M, N, ...) buffer that covers both the full (uncropped) result and the
    # requested window onto it.
    lo = [max(0, -bg) for bg in begin]
    size = [max(f, bg + o) + lw for f, bg, o, lw in zip(full, begin, out, lo)]
    buf = np.zeros((m, n_batch) + tuple(size), dtype=ct)
    for taps in np.ndindex(*kernel):
        target = (slice(None), slice(None)) + tuple(
            slice(lw + t * di, lw + t * di + (n_in - 1) * si + 1, si) for lw, t, di, n_in, si in zip(lo, taps, d, spatial, s)
        )
        buf[target] += cols[(slice(None),) + taps]
    crop = (slice(None), slice(None)) + tuple(slice(lw + bg, lw + bg + o) for lw, bg, o in zip(lo, begin, out))
    y = buf[crop].transpose(1, 0, *range(2, 2 + ns))
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape((-1,) + (1,) * ns)
    return np.ascontiguousarray(y, dtype=x.dtype)


def _stride_one_transpose_as_conv(x, w, dilations, begin, out) -> np.ndarray:
    """ConvTranspose of stride 1 and group 1 as a Conv: output o along an axis sums x[begin + o - t d]
    w[t] over the taps t, which is a correlation of x shifted by L = (K - 1) d - begin (zeros
    outside) with the kernel flipped and its two channel axes swapped. Large ones run this way: a
    Conv's im2col and GEMM cost less than the GEMM and the scattered tap sums of the general form
    (12.3 against 15.7 ms at 56 x 56 with 64 channels, 10.9 against 14.0 at 14 x 14; at 7 x 7 the
    general form is as fast). In the computation type; the caller casts."""
    ns = x.ndim - 2
    kernel = w.shape[2:]
    lefts = [(k - 1) * d - bg for k, d, bg in zip(kernel, dilations, begin)]
    rights = [o + (k - 1) * d - n - left for o, k, d, n, left in zip(out, kernel, dilations, x.shape[2:], lefts)]
    ct = float_compute_dtype(x.dtype)
    shifted = pad_spatial(x.astype(ct, copy=False), [max(v, 0) for v in lefts], [max(v, 0) for v in rights], 0)
    shifted = shifted[
        (slice(None), slice(None)) + tuple(slice(max(-a, 0), n - max(-z, 0)) for a, z, n in zip(lefts, rights, shifted.shape[2:]))
    ]
    flipped = w.astype(ct, copy=False).swapaxes(0, 1)[(slice(None), slice(None)) + (slice(None, None, -1),) * ns]
    return conv(shifted, np.ascontiguousarray(flipped), dilations=list(dilations))


@cpu_prepare("ConvTranspose")
def prepare_conv_transpose(constants: tuple, attrs: dict):
    """ConvTranspose with its col2im worked out once per (X, W) shape for small outputs: every output
    element gathers its taps' products by a kept index, in the kernel's tap order, after a zero, and
    one reduction over the taps adds them in that order -- the kernel's sums, bit for bit. A shape
    seen for the first time, and large outputs, run ``conv_transpose`` itself."""
    return kernel_first(
        lambda x, w, b=None: conv_transpose(x, w, b, **attrs),
        lambda x, w, b=None: (x.shape, w.shape, x.dtype, w.dtype),
        lambda x, w, b=None: _onednn_conv_transpose_plan(x, w, b, attrs) or _conv_transpose_plan(x.shape, w.shape, attrs),
        _planned_conv_transpose,
    )


def _conv_transpose_attrs_geometry(x_shape: tuple, w_shape: tuple, attrs: dict) -> tuple:
    """ConvTranspose's (strides, dilations, full size, leading crop, output size) from its attributes."""
    ns = len(x_shape) - 2
    strides = per_axis(attrs.get("strides"), ns, 1, "strides")
    dilations = per_axis(attrs.get("dilations"), ns, 1, "dilations")
    geometry = {k: attrs.get(k) for k in ("auto_pad", "dilations", "output_padding", "output_shape", "pads", "strides")}
    geometry["auto_pad"] = geometry["auto_pad"] or "NOTSET"
    full, begin, out = conv_transpose_geometry(x_shape, w_shape, geometry)
    return strides, dilations, full, begin, out


def _onednn_conv_transpose_plan(x, w, b, attrs: dict) -> onednn_conv.OneDnnPlan | None:
    """oneDNN's primitive for a grouped float32 ConvTranspose (``conv_transpose`` has checked the
    shapes), else None."""
    group = int(attrs.get("group", 1))
    if group <= 1 or not _all_float32(x, w, b):
        return None
    strides, dilations, _, begin, out = _conv_transpose_attrs_geometry(x.shape, w.shape, attrs)
    return onednn_conv.plan_conv_transpose(x.shape, w.shape, group, strides, dilations, begin, out, b is not None)


def _planned_conv_transpose(plan, x, w, b=None):
    if isinstance(plan, onednn_conv.OneDnnPlan):
        return plan(x, w, b)
    group, cg, mg_k, p_in, table, y_shape, ns = plan
    ct = float_compute_dtype(x.dtype)
    n_batch = x.shape[0]
    w_t = w.astype(ct, copy=False).reshape(group, cg, mg_k).transpose(0, 2, 1)
    x_t = x.astype(ct, copy=False).reshape(n_batch, group, cg, p_in).transpose(1, 2, 0, 3).reshape(group, cg, n_batch * p_in)
    y = _sums_by_table(blas.matmul(w_t, x_t), table).reshape(y_shape)
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape((-1,) + (1,) * ns)
    return np.ascontiguousarray(y, dtype=x.dtype)


def _conv_transpose_plan(x_shape: tuple, w_shape: tuple, attrs: dict):
    """(group, Cg, Mg*K, P_in, the (1 + K, output) gather table, output shape, spatial rank) for
    ``prepare_conv_transpose``, replaying the kernel's col2im on positions; False when large."""
    group = int(attrs.get("group", 1))
    n_batch, channels = x_shape[:2]
    m, ns = w_shape[1] * group, len(x_shape) - 2
    spatial, kernel = list(x_shape[2:]), list(w_shape[2:])
    s, d, full, begin, out = _conv_transpose_attrs_geometry(x_shape, w_shape, attrs)
    k, p_in = math.prod(kernel), math.prod(spatial)
    outputs = n_batch * m * math.prod(out)
    if (k + 1) * outputs > SMALL_CONV_COLUMNS:
        return False
    cols = m * k * n_batch * p_in
    positions = np.arange(cols, dtype=np.intp).reshape((m, *kernel, n_batch, *spatial))
    lo = [max(0, -bg) for bg in begin]
    size = [max(f, bg + o) + lw for f, bg, o, lw in zip(full, begin, out, lo)]
    crop = (slice(None), slice(None)) + tuple(slice(lw + bg, lw + bg + o) for lw, bg, o in zip(lo, begin, out))
    rows = [np.full(outputs, cols, dtype=np.intp)]  # the zero first
    for taps in np.ndindex(*kernel):
        source = np.full((m, n_batch) + tuple(size), cols, dtype=np.intp)
        target = (slice(None), slice(None)) + tuple(
            slice(lw + t * di, lw + t * di + (n_in - 1) * si + 1, si) for lw, t, di, n_in, si in zip(lo, taps, d, spatial, s)
        )
        source[target] = positions[(slice(None),) + taps]
        rows.append(source[crop].transpose(1, 0, *range(2, 2 + ns)).reshape(-1))
    cg, mg = channels // group, m // group
    return group, cg, mg * k, p_in, np.stack(rows), (n_batch, m, *out), ns


@cpu_kernel("Col2Im")
def col2im(x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Sums the columns of X (N, C * prod(block), L) into an image (N, C, *image_shape): column l
    holds the block at the l-th sliding position (row-major), C outer in the second axis."""
    image, block, dil, pads, strides, counts = col2im_geometry(
        np.asarray(image_shape).reshape(-1), np.asarray(block_shape).reshape(-1), dilations=dilations, pads=pads, strides=strides
    )
    nd = len(image)
    n, c = x.shape[0], col2im_channels(x.shape, image, block, counts)
    ct = accumulation_dtype(x.dtype)
    columns = x.astype(ct, copy=False).reshape(n, c, *block, *counts)
    padded = np.zeros((n, c, *[image[i] + pads[i] + pads[nd + i] for i in range(nd)]), dtype=ct)
    for tap in np.ndindex(*block):
        window = tuple(slice(tap[i] * dil[i], tap[i] * dil[i] + (counts[i] - 1) * strides[i] + 1, strides[i]) for i in range(nd))
        padded[_ALL2 + window] += columns[_ALL2 + tuple(tap)]
    inside = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
    return np.ascontiguousarray(padded[_ALL2 + inside]).astype(x.dtype, copy=False)


_ALL2 = (slice(None), slice(None))  # the batch and channel axes, whole


@cpu_kernel("DeformConv")
def deform_conv(x, w, offset, b=None, mask=None, **attrs):
    """2-D deformable convolution (ONNX's reference): each kernel tap of each output position reads
    X bilinearly (0 outside) at its position plus its offset (per offset group), times the mask;
    then the grouped convolution sum with W, plus B."""
    from gradgen.kernels.cpu.pool import grid_sample

    kernel, strides, dilations, pads, out, group, offset_group = deform_conv_geometry(x.shape, w.shape, offset.shape, **attrs)
    n, channels, height, width = x.shape
    taps, points = kernel[0] * kernel[1], out[0] * out[1]
    ct = accumulation_dtype(x.dtype)
    base_h, base_w = deform_conv_positions(kernel, strides, dilations, pads, out)
    shifts = offset.astype(ct, copy=False).reshape(n * offset_group, taps, 2, points)
    rows, cols = base_h + shifts[:, :, 0], base_w + shifts[:, :, 1]  # (N * og, taps, points)
    # normalized for GridSample with align_corners=0: pixel p -> (2p + 1) / size - 1
    grid = np.stack([(2 * cols + 1) / width - 1, (2 * rows + 1) / height - 1], axis=-1)
    planes = x.astype(ct, copy=False).reshape(n * offset_group, channels // offset_group, height, width)
    samples = grid_sample(planes, grid, mode="linear", padding_mode="zeros", align_corners=0)  # (N * og, C / og, taps, points)
    if mask is not None:
        samples = samples * mask.astype(ct, copy=False).reshape(n * offset_group, 1, taps, points)
    columns = samples.reshape(n, group, (channels // group) * taps, points)
    weights = w.astype(ct, copy=False).reshape(group, w.shape[0] // group, -1)
    y = blas.matmul(weights, columns).reshape(n, w.shape[0], *out)
    if b is not None:
        y = y + b.astype(ct, copy=False).reshape(1, -1, 1, 1)
    return y.astype(x.dtype, copy=False)
