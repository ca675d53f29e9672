"""Convolution geometry: auto_pad, pads, strides, dilations and output shapes of Conv (and
ConvGrad, which keeps the forward Conv's attributes) and ConvTranspose.

The one definition the CPU kernels, the CUDA launchers, the lowering of ConvGrad and shape
inference's corrections share.
"""

from __future__ import annotations

import math
from typing import Sequence

from gradgen.errors import KernelError
from gradgen.ops.attributes import text
from gradgen.ops.axes import per_axis

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")


def effective_kernel(kernel: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """The span of each dilated kernel axis: (k - 1) * d + 1."""
    return [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]


def same_pads(
    spatial: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int], auto_pad: str
) -> tuple[list[int], list[int], list[int]]:
    """(begin, end, out) of SAME_UPPER / SAME_LOWER padding: out = ceil(n / s), the odd unit of
    padding at the end (UPPER) or the beginning (LOWER)."""
    out = [-(-n // s) for n, s in zip(spatial, strides)]
    span = effective_kernel(kernel, dilations)
    total = [max(0, (o - 1) * s + e - n) for o, s, e, n in zip(out, strides, span, spatial)]
    small, big = [t // 2 for t in total], [t - t // 2 for t in total]
    begin, end = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    return begin, end, out


def conv_geometry(x_shape, w_shape, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """Check a Conv's shapes and attributes; return (pads_begin, pads_end, strides, dilations, out_shape)."""
    auto_pad = text(auto_pad, "NOTSET")
    x_shape, w_shape = tuple(x_shape), tuple(w_shape)
    if len(x_shape) < 3 or len(w_shape) != len(x_shape):
        raise KernelError(f"Conv needs X of rank >= 3 and W of the same rank; got X {list(x_shape)}, W {list(w_shape)}")
    nd = len(x_shape) - 2
    kernel = list(w_shape[2:])
    if kernel_shape is not None and list(kernel_shape) != kernel:
        raise KernelError(f"kernel_shape {list(kernel_shape)} does not match W's spatial shape {kernel} (W {list(w_shape)})")
    strides = [1] * nd if strides is None else list(strides)
    dilations = [1] * nd if dilations is None else list(dilations)
    if len(strides) != nd or len(dilations) != nd:
        raise KernelError(f"strides {strides} and dilations {dilations} must have {nd} values")
    if min(strides + dilations, default=1) < 1:
        raise KernelError(f"strides {strides} and dilations {dilations} must be >= 1")
    channels, filters = x_shape[1], w_shape[0]
    if group < 1 or channels != w_shape[1] * group or filters % group:
        raise KernelError(
            f"group {group} does not fit X {list(x_shape)} and W {list(w_shape)}: X's channels must be "
            f"W.shape[1] * group and W.shape[0] a multiple of group"
        )
    spatial = x_shape[2:]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end, _ = same_pads(spatial, kernel, strides, dilations, auto_pad)
    elif auto_pad == "VALID":
        begin, end = [0] * nd, [0] * nd
    elif auto_pad == "NOTSET":
        pads = [0] * (2 * nd) if pads is None else list(pads)
        if len(pads) != 2 * nd or min(pads, default=0) < 0:
            raise KernelError(f"pads {pads} must be {2 * nd} non-negative values")
        begin, end = pads[:nd], pads[nd:]
    else:
        raise KernelError(f"unknown auto_pad {auto_pad!r} (NOTSET, SAME_UPPER, SAME_LOWER or VALID)")
    span = effective_kernel(kernel, dilations)
    out = [(n + b + e - sp) // s + 1 for n, b, e, sp, s in zip(spatial, begin, end, span, strides)]
    if min(out) < 1:
        raise KernelError(
            f"Conv output would be empty: X {list(x_shape)}, W {list(w_shape)}, pads {begin + end}, "
            f"strides {strides}, dilations {dilations}"
        )
    return begin, end, strides, dilations, (x_shape[0], filters, *out)


def conv_transpose_geometry(x_shape, w_shape, attrs):
    """(full, begin, out) per spatial axis of ConvTranspose: the length of the full (uncropped)
    result, where the output starts in it (negative: before it) and the output length. The one
    rule the kernel and shape inference share (ONNX's inference drops output_shape values of 1)."""
    get = attrs.get
    ns = len(x_shape) - 2
    spatial, kernel = list(x_shape[2:]), list(w_shape[2:])
    s = per_axis(get("strides"), ns, 1, "strides")
    d = per_axis(get("dilations"), ns, 1, "dilations")
    op = per_axis(get("output_padding"), ns, 0, "output_padding")
    effective = effective_kernel(kernel, d)
    full = [si * (size - 1) + op_i + e for si, size, op_i, e in zip(s, spatial, op, effective)]
    auto_pad = text(get("auto_pad"), "NOTSET") or "NOTSET"
    if auto_pad not in AUTO_PADS:
        raise KernelError(f"unknown auto_pad {auto_pad!r}")
    if get("output_shape") is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if get("output_shape") is not None:
            out = [int(v) for v in get("output_shape")][-ns:]
            if len(out) != ns:
                raise KernelError(f"output_shape {list(get('output_shape'))} does not have {ns} spatial dimensions")
        else:
            out = [size * si for size, si in zip(spatial, s)]
        total = [f - o for f, o in zip(full, out)]
        if auto_pad == "SAME_UPPER":
            begin = [t // 2 for t in total]
        else:
            begin = [t - t // 2 for t in total]
    else:
        p = [0] * (2 * ns) if auto_pad == "VALID" else per_axis(get("pads"), 2 * ns, 0, "pads")
        begin = p[:ns]
        out = [f - p[i] - p[ns + i] for i, f in enumerate(full)]
    if min(out) < 1:
        raise KernelError(f"the output spatial shape {out} is empty")
    return full, begin, out


def conv_transpose_as_conv(x_shape, w_shape, attrs) -> tuple[tuple[int, ...], dict] | None:
    """ConvTranspose as the input gradient of a Conv: (the Conv's input shape, its attributes), so
    that ConvTranspose(x, w) = dX of Conv(X, w) at dY = x (w's shape is a Conv weight's: x's channels
    as filters, the output's channels per group as input channels). None where that Conv would need
    negative padding (an output_shape or output_padding reaching past the full result) or would not
    give back x's spatial shape."""
    ns = len(x_shape) - 2
    full, begin, out = conv_transpose_geometry(x_shape, w_shape, attrs)
    end = [f - b - o for f, b, o in zip(full, begin, out)]
    if min(begin + end, default=0) < 0:
        return None
    group = int(attrs.get("group", 1) or 1)
    conv_attrs = {
        "group": group,
        "pads": [int(v) for v in begin + end],
        "strides": per_axis(attrs.get("strides"), ns, 1, "strides"),
        "dilations": per_axis(attrs.get("dilations"), ns, 1, "dilations"),
    }
    conv_x = (int(x_shape[0]), int(w_shape[1]) * group, *out)
    _, _, _, _, y_shape = conv_geometry(conv_x, w_shape, **conv_attrs)
    return (conv_x, conv_attrs) if tuple(y_shape) == tuple(x_shape) else None


def col2im_geometry(image, block, *, dilations=None, pads=None, strides=None):
    """Col2Im's (image, block, dilations, pads, strides, blocks per axis), checked: the input's L is
    the product of the blocks per axis, (image + pads - dilated block) // stride + 1 each."""
    image, block = [int(v) for v in image], [int(v) for v in block]
    n = len(image)
    if n == 0 or len(block) != n:
        raise KernelError(f"image_shape {image} and block_shape {block} must have the same, non-zero length")
    dilations = per_axis(dilations, n, 1, "dilations")
    strides = per_axis(strides, n, 1, "strides")
    pads = per_axis(pads, 2 * n, 0, "pads")
    if min(dilations) < 1 or min(strides) < 1 or min(block) < 1 or min(pads) < 0:
        raise KernelError("block_shape, dilations and strides must be positive and pads not negative")
    counts = []
    for i in range(n):
        room = image[i] + pads[i] + pads[n + i] - effective_kernel([block[i]], [dilations[i]])[0]
        if room < 0:
            raise KernelError(f"the block {block} does not fit the padded image {image} along axis {i}")
        counts.append(room // strides[i] + 1)
    return image, block, dilations, pads, strides, counts


def col2im_channels(x_shape, image, block, counts) -> int:
    """The image's channels C of Col2Im's input (N, C * prod(block), prod(counts)), checked."""
    taps, positions = math.prod(block), math.prod(counts)
    if len(x_shape) != 3 or x_shape[1] % taps or x_shape[2] != positions:
        raise KernelError(
            f"input of shape {list(x_shape)} does not fit: expected (N, C * {taps}, {positions}) for "
            f"blocks {block} over the image {image}"
        )
    return int(x_shape[1]) // taps


def deform_conv_geometry(
    x_shape, w_shape, offset_shape, *, dilations=None, group=1, kernel_shape=None, offset_group=1, pads=None, strides=None
):
    """DeformConv's geometry, checked (2-D): (kernel, strides, dilations, pads, output (oH, oW),
    group, offset_group); the output size is the offsets' spatial size, which must be the
    convolution's."""
    if len(x_shape) != 4 or len(w_shape) != 4 or len(offset_shape) != 4:
        raise KernelError(
            f"gradgen's DeformConv is 2-D: X, W and offset must be 4-D, "
            f"got {list(x_shape)}, {list(w_shape)}, {list(offset_shape)}"
        )
    kernel = per_axis(kernel_shape if kernel_shape is not None else w_shape[2:], 2, 1, "kernel_shape")
    strides, dilations, pads = (
        per_axis(strides, 2, 1, "strides"),
        per_axis(dilations, 2, 1, "dilations"),
        per_axis(pads, 4, 0, "pads"),
    )
    group, offset_group = int(group or 1), int(offset_group or 1)
    channels, out_channels = x_shape[1], w_shape[0]
    if channels != w_shape[1] * group or out_channels % group or channels % offset_group:
        raise KernelError(f"X's {channels} channels, W {list(w_shape)}, group {group} and offset_group {offset_group} do not fit")
    taps = kernel[0] * kernel[1]
    if offset_shape[1] != 2 * offset_group * taps:
        raise KernelError(f"offset has {offset_shape[1]} channels; expected 2 * {offset_group} * {taps}")
    out = [
        (x_shape[2 + i] + pads[i] + pads[2 + i] - effective_kernel([kernel[i]], [dilations[i]])[0]) // strides[i] + 1
        for i in range(2)
    ]
    if list(offset_shape[2:]) != out:
        raise KernelError(f"offset's spatial size {list(offset_shape[2:])} is not the convolution's output size {out}")
    return kernel, strides, dilations, pads, out, group, offset_group


def deform_conv_positions(kernel, strides, dilations, pads, out):
    """The undeformed sampling positions (h, w) of every kernel tap and output position, as two
    (taps, oH * oW) arrays: tap (i, j) of output (y, x) reads (y * stride - pad + i * dilation, ...)."""
    import numpy as np

    taps_h, taps_w = np.meshgrid(np.arange(kernel[0]) * dilations[0], np.arange(kernel[1]) * dilations[1], indexing="ij")
    out_h, out_w = np.meshgrid(np.arange(out[0]) * strides[0] - pads[0], np.arange(out[1]) * strides[1] - pads[1], indexing="ij")
    return taps_h.reshape(-1, 1) + out_h.reshape(1, -1), taps_w.reshape(-1, 1) + out_w.reshape(1, -1)
