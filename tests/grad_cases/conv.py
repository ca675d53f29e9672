"""Finite-difference cases: convolution and pooling."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(4)


def r(*shape):
    return rng.uniform(-1.0, 1.0, shape)


def distinct(*shape):
    """Values at least 0.05 apart (MaxPool without ties, finite differences stay on one side)."""
    n = int(np.prod(shape))
    return (rng.permutation(n) * 0.05 - 1.0).reshape(shape)


def conv(name, x, w, b=None, **attrs):
    inputs = [x, w] + ([b] if b is not None else [])
    return GradCase("Conv", inputs, attrs=attrs, name=f"Conv_{name}")


CASES = [
    conv("1d", r(2, 2, 7), r(3, 2, 3), r(3)),
    conv("1d_stride_dil", r(1, 2, 9), r(2, 2, 2), strides=[2], dilations=[2], pads=[1, 2]),
    conv("2d", r(1, 2, 4, 5), r(3, 2, 3, 2), r(3), pads=[1, 0, 1, 1]),
    conv("2d_stride", r(2, 1, 5, 5), r(2, 1, 3, 3), strides=[2, 2], pads=[1, 1, 1, 1]),
    conv("2d_dilation", r(1, 2, 5, 6), r(2, 2, 2, 2), r(2), dilations=[2, 3]),
    conv("2d_group", r(1, 4, 4, 4), r(6, 2, 2, 2), r(6), group=2, kernel_shape=[2, 2]),
    conv("2d_depthwise", r(2, 3, 4, 4), r(3, 1, 3, 3), r(3), group=3, pads=[1, 1, 1, 1]),
    conv("2d_asym_pads", r(1, 2, 4, 4), r(2, 2, 3, 3), pads=[0, 2, 1, 0], strides=[1, 2]),
    conv("2d_same_upper", r(1, 2, 5, 4), r(2, 2, 2, 3), r(2), auto_pad="SAME_UPPER", strides=[2, 1]),
    conv("2d_same_lower", r(1, 2, 5, 4), r(2, 2, 2, 3), auto_pad="SAME_LOWER", strides=[2, 1]),
    conv("2d_valid", r(1, 2, 5, 4), r(2, 2, 3, 2), r(2), auto_pad="VALID", strides=[2, 1]),
    conv("3d", r(1, 2, 3, 3, 3), r(2, 2, 2, 2, 2), r(2), pads=[1, 0, 0, 0, 1, 1]),
    conv("3d_group_stride", r(1, 2, 4, 3, 3), r(2, 1, 2, 2, 1), group=2, strides=[2, 1, 2]),
    GradCase("Conv", [r(1, 2, 4, 4), r(2, 2, 3, 3), r(2)], const=(0,), name="Conv_x_frozen"),
    GradCase("Conv", [r(1, 2, 4, 4), r(2, 2, 3, 3), r(2)], const=(1, 2), name="Conv_only_x"),
    GradCase("Conv", [r(1, 2, 4, 4), r(2, 2, 3, 3), r(2)], const=(0, 1), name="Conv_only_bias"),
    GradCase("ConvTranspose", [r(1, 2, 3, 3), r(2, 3, 2, 2), r(3)]),
    GradCase(
        "ConvTranspose",
        [r(2, 2, 3, 2), r(2, 2, 3, 3)],
        name="ConvTranspose_stride_pads",
        attrs={"strides": [2, 2], "pads": [1, 0, 0, 1], "output_padding": [1, 0]},
    ),
    GradCase(
        "ConvTranspose", [r(1, 4, 3), r(4, 1, 2), r(2)], attrs={"group": 2, "dilations": [2]}, name="ConvTranspose_1d_group"
    ),
    GradCase(
        "ConvTranspose",
        [r(1, 2, 3, 2), r(2, 1, 3, 3)],
        attrs={"strides": [2, 2], "auto_pad": "SAME_UPPER"},
        symbolic=False,
        name="ConvTranspose_same_upper",
    ),
    GradCase(
        "ConvTranspose",
        [r(1, 2, 3, 2), r(2, 1, 3, 2)],
        attrs={"strides": [2, 2], "auto_pad": "SAME_LOWER"},
        symbolic=False,
        name="ConvTranspose_same_lower",
    ),
    GradCase(
        "ConvTranspose",
        [r(1, 2, 3, 3), r(2, 2, 3, 3), r(2)],
        attrs={"strides": [2, 2], "output_shape": [6, 5]},
        symbolic=False,
        name="ConvTranspose_output_shape",
    ),
    GradCase("MaxPool", [distinct(1, 2, 4, 5)], attrs={"kernel_shape": [2, 2]}),
    GradCase(
        "MaxPool",
        [distinct(2, 1, 5, 5)],
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        name="MaxPool_stride_pad",
    ),
    GradCase(
        "MaxPool", [distinct(1, 2, 5, 4)], attrs={"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}, name="MaxPool_ceil"
    ),
    GradCase("MaxPool", [distinct(1, 1, 6, 6)], attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}, name="MaxPool_dilation"),
    GradCase(
        "MaxPool",
        [distinct(1, 2, 7)],
        attrs={"kernel_shape": [3], "auto_pad": "SAME_UPPER", "strides": [2]},
        name="MaxPool_1d_same",
    ),
    GradCase(
        "MaxPool",
        [distinct(1, 2, 4, 4)],
        attrs={"kernel_shape": [2, 2], "storage_order": 1},
        num_outputs=2,
        name="MaxPool_indices_col_major",
    ),
    GradCase(
        "MaxPool",
        [distinct(2, 2, 4, 3)],
        attrs={"kernel_shape": [2, 2], "pads": [0, 1, 1, 0]},
        num_outputs=2,
        name="MaxPool_indices",
    ),
    GradCase("AveragePool", [r(1, 2, 4, 5)], attrs={"kernel_shape": [2, 2]}),
    GradCase(
        "AveragePool",
        [r(2, 1, 5, 5)],
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        name="AveragePool_pads_exclude",
    ),
    GradCase(
        "AveragePool",
        [r(2, 1, 5, 5)],
        name="AveragePool_pads_include",
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 2, 1], "count_include_pad": 1},
    ),
    GradCase(
        "AveragePool",
        [r(1, 2, 5, 4)],
        attrs={"kernel_shape": [2, 3], "strides": [2, 2], "ceil_mode": 1},
        symbolic=False,
        name="AveragePool_ceil",
    ),
    GradCase(
        "AveragePool",
        [r(1, 1, 6, 5)],
        symbolic=False,
        name="AveragePool_ceil_pads_include",
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 0], "ceil_mode": 1, "count_include_pad": 1},
    ),
    GradCase(
        "AveragePool",
        [r(1, 1, 6, 5)],
        symbolic=False,
        name="AveragePool_ceil_pads_exclude",
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 0], "ceil_mode": 1},
    ),
    GradCase(
        "AveragePool",
        [r(1, 2, 7)],
        attrs={"kernel_shape": [3], "strides": [2], "auto_pad": "SAME_LOWER"},
        name="AveragePool_1d_same_lower",
    ),
    GradCase(
        "AveragePool",
        [r(1, 2, 6)],
        name="AveragePool_1d_same_upper_include",
        attrs={"kernel_shape": [4], "strides": [1], "auto_pad": "SAME_UPPER", "count_include_pad": 1},
    ),
    GradCase(
        "AveragePool", [r(1, 1, 3, 3, 4)], attrs={"kernel_shape": [2, 2, 2], "pads": [0, 1, 0, 1, 0, 1]}, name="AveragePool_3d"
    ),
    GradCase(
        "AveragePool",
        [r(1, 1, 7, 6)],
        opset=19,
        name="AveragePool_dilation",
        attrs={"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 0, 0, 1]},
    ),
    GradCase("GlobalAveragePool", [r(2, 3, 2, 3)]),
    GradCase("GlobalAveragePool", [r(2, 3, 4)], name="GlobalAveragePool_1d"),
    GradCase("GlobalMaxPool", [distinct(2, 3, 2, 3)]),
    GradCase("GlobalMaxPool", [distinct(1, 2, 3, 2, 2)], name="GlobalMaxPool_3d"),
]


def resize(name, x, scales=None, sizes=None, opset=13, **attrs):
    """Resize with constant scales or sizes (the resized axes need static sizes: no symbolic run)."""
    inputs = [x, None, None if scales is None else np.array(scales, dtype=np.float32)]
    if sizes is not None:
        inputs.append(np.array(sizes, dtype=np.int64))
    return GradCase("Resize", inputs, attrs=attrs, const=(2,), opset=opset, symbolic=False, name=f"Resize_{name}")


CASES += [
    # torch F.interpolate(nearest) as the legacy exporter writes it, and the ONNX default nearest.
    resize(
        "nearest_asym_floor",
        r(1, 2, 3, 4),
        scales=[1, 1, 2, 2],
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    ),
    resize("nearest_default_down", r(1, 1, 5, 7), scales=[1, 1, 0.6, 0.5]),
    resize("nearest_round_ceil_sizes", r(2, 1, 4, 3), sizes=[2, 1, 7, 5], nearest_mode="round_prefer_ceil"),
    # bilinear: torch's align_corners=False (pytorch_half_pixel) and True, up and down.
    resize(
        "linear_pytorch_half_pixel",
        r(1, 2, 3, 4),
        sizes=[1, 2, 6, 5],
        mode="linear",
        coordinate_transformation_mode="pytorch_half_pixel",
    ),
    resize(
        "linear_align_corners",
        r(1, 1, 4, 3),
        scales=[1, 1, 1.5, 2.0],
        mode="linear",
        coordinate_transformation_mode="align_corners",
    ),
    resize("linear_half_pixel_down", r(1, 1, 6, 5), sizes=[1, 1, 4, 2], mode="linear"),
    resize("linear_1d_axes", r(2, 3, 5), sizes=[8], mode="linear", axes=[2], opset=18),
    resize("cubic", r(1, 1, 4, 4), scales=[1, 1, 2, 1.5], mode="cubic"),
    resize("cubic_exclude_outside", r(1, 1, 5, 3), sizes=[1, 1, 7, 4], mode="cubic", exclude_outside=1, cubic_coeff_a=-0.5),
    resize(
        "linear_half_pixel_symmetric",
        r(1, 1, 3, 5),
        scales=[1, 1, 1.7, 0.6],
        mode="linear",
        coordinate_transformation_mode="half_pixel_symmetric",
        opset=19,
    ),
    resize("nearest_not_larger", r(1, 1, 4, 6), sizes=[3, 5], axes=[2, 3], keep_aspect_ratio_policy="not_larger", opset=18),
]

CASES += [
    resize("linear_antialias_down", r(1, 1, 6, 7), scales=[1, 1, 0.5, 0.6], mode="linear", antialias=1, opset=18),
    resize("cubic_antialias_down", r(1, 1, 7, 5), sizes=[1, 1, 3, 4], mode="cubic", antialias=1, opset=18),
    # tf_crop_and_resize: outputs outside the crop take extrapolation_value (no gradient there).
    GradCase(
        "Resize",
        [
            r(1, 1, 4, 5),
            np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], dtype=np.float32),
            None,
            np.array([1, 1, 5, 4], dtype=np.int64),
        ],
        attrs=dict(mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=0.5),
        const=(1,),
        symbolic=False,
        name="Resize_tf_crop_and_resize",
    ),
]

# Nearest upsampling by integer scales also differentiates with symbolic resized axes (a block
# sum), as exported nn.Upsample(scale_factor=k) with a dynamic image size needs.
for _name, _scales, _attrs in [
    ("nearest_int_asymmetric", [1, 1, 2, 3], dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    ("nearest_int_half_pixel", [1, 1, 2, 2], {}),
    (
        "nearest_int_pytorch_half_pixel_ceil",
        [1, 3, 1, 2],
        dict(coordinate_transformation_mode="pytorch_half_pixel", nearest_mode="round_prefer_ceil"),
    ),
]:
    CASES.append(
        GradCase(
            "Resize",
            [r(2, 2, 3, 2), None, np.array(_scales, dtype=np.float32)],
            attrs=dict(mode="nearest", **_attrs),
            const=(2,),
            name=f"Resize_{_name}",
        )
    )

# LpPool and GlobalLpPool: p 1, 2 and 3, padding, ceil_mode, 1-D and 2-D windows.
CASES += [
    GradCase("LpPool", [r(1, 2, 4, 5)], attrs={"kernel_shape": [2, 2], "p": 2}, name="LpPool_p2"),
    GradCase(
        "LpPool",
        [r(2, 2, 5, 4)],
        attrs={"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1], "p": 1},
        name="LpPool_p1_stride_pad",
    ),
    GradCase(
        "LpPool",
        [r(1, 2, 5)],
        attrs={"kernel_shape": [2], "strides": [2], "ceil_mode": 1, "p": 3},
        opset=18,
        symbolic=False,
        name="LpPool_p3_ceil_1d",
    ),
    GradCase("LpPool", [r(1, 1, 4, 4)], attrs={"kernel_shape": [2, 2], "dilations": [2, 2]}, opset=18, name="LpPool_dilated"),
    GradCase("GlobalLpPool", [r(2, 3, 4, 3)], name="GlobalLpPool_p2"),
    GradCase("GlobalLpPool", [r(2, 2, 5)], attrs={"p": 1}, name="GlobalLpPool_p1"),
    GradCase("GlobalLpPool", [r(1, 2, 2, 3)], attrs={"p": 3}, name="GlobalLpPool_p3"),
]

# MaxUnpool: X scattered at distinct flat indices of the inferred shape (as MaxPool's are); an
# output_shape only adds room after it.
_unpool_indices = rng.permutation(2 * 16)[:8].reshape(1, 2, 2, 2).astype(np.int64)
CASES += [
    GradCase("MaxUnpool", [r(1, 2, 2, 2), _unpool_indices], attrs={"kernel_shape": [2, 2], "strides": [2, 2]}, name="MaxUnpool"),
    GradCase(
        "MaxUnpool",
        [r(1, 2, 2, 2), _unpool_indices, np.array([1, 2, 5, 6], dtype=np.int64)],
        attrs={"kernel_shape": [2, 2], "strides": [2, 2]},
        name="MaxUnpool_output_shape",
    ),
    GradCase(
        "MaxUnpool",
        [r(1, 1, 3), rng.permutation(5)[:3].reshape(1, 1, 3).astype(np.int64)],
        attrs={"kernel_shape": [3], "strides": [2], "pads": [1, 1]},
        name="MaxUnpool_1d_pads",
    ),
]

# GridSample (differentiated in its standard-op form, gradgen.passes.DecomposePass): X and the grid,
# every mode and padding mode, both corner conventions, 1-D to 3-D; grid points beyond [-1, 1]
# (padding) and far enough to reflect more than once.
for _mode, _pad, _ac, _x_shape, _out in (
    ("linear", "zeros", 0, (1, 2, 4, 5), (3, 2)),
    ("linear", "border", 1, (2, 1, 3, 4), (2, 3)),
    ("linear", "reflection", 0, (1, 2, 4, 3), (3, 3)),
    ("cubic", "zeros", 1, (1, 1, 5, 4), (2, 2)),
    ("cubic", "border", 0, (1, 1, 4, 4), (2, 3)),
    ("cubic", "reflection", 1, (1, 2, 3, 4), (2, 2)),
    ("nearest", "reflection", 0, (1, 2, 4, 4), (2, 3)),
    ("linear", "zeros", 1, (1, 2, 5), (4,)),
    ("linear", "reflection", 1, (1, 1, 3, 2, 3), (2, 1, 2)),
):
    CASES.append(
        GradCase(
            "GridSample",
            [r(*_x_shape), rng.uniform(-1.6, 1.6, (_x_shape[0], *_out, len(_x_shape) - 2))],
            attrs={"mode": _mode, "padding_mode": _pad, "align_corners": _ac},
            opset=20,
            name=f"GridSample_{_mode}_{_pad}_ac{_ac}_{len(_x_shape) - 2}d",
        )
    )
CASES.append(
    GradCase(
        "GridSample",
        [r(1, 2, 3, 4), rng.uniform(-1.2, 1.2, (1, 2, 2, 2))],
        attrs={"mode": "bilinear", "padding_mode": "border"},
        opset=16,
        name="GridSample_op16_bilinear",
    )
)

# AffineGrid: 2-D and 3-D, both corner conventions, an axis of one pixel.
for _size, _ac in (((2, 3, 4, 5), 0), ((1, 2, 3, 2), 1), ((2, 1, 2, 3, 2), 0), ((1, 1, 3, 1), 1)):
    _nd = len(_size) - 2
    CASES.append(
        GradCase(
            "AffineGrid",
            [r(_size[0], _nd, _nd + 1), np.array(_size, dtype=np.int64)],
            attrs={"align_corners": _ac},
            opset=20,
            name=f"AffineGrid{_size}_ac{_ac}",
        )
    )

# Col2Im: 1-D to 3-D, strides, asymmetric pads, dilations (image_shape and block_shape constant).
for _image, _block, _attrs in (
    ([4, 5], [2, 3], {}),
    ([6, 5], [3, 2], {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}),
    ([7], [3], {"strides": [2]}),
    ([3, 3, 2], [2, 2, 1], {}),
):
    _nd = len(_image)
    _d, _s, _p = _attrs.get("dilations", [1] * _nd), _attrs.get("strides", [1] * _nd), _attrs.get("pads", [0] * 2 * _nd)
    _count = int(np.prod([(_image[i] + _p[i] + _p[_nd + i] - _d[i] * (_block[i] - 1) - 1) // _s[i] + 1 for i in range(_nd)]))
    CASES.append(
        GradCase(
            "Col2Im",
            [r(1, 2 * int(np.prod(_block)), _count), np.array(_image, dtype=np.int64), np.array(_block, dtype=np.int64)],
            attrs=_attrs,
            opset=18,
            name=f"Col2Im{_image}_block{_block}_{sorted(_attrs)}",
        )
    )

# RoiAlign with a fixed sampling_ratio (differentiated in its standard-op form): X and the rois,
# avg and max, both coordinate modes, rois partly outside the image.
_ROIS = np.array([[0.3, 0.2, 4.6, 3.7], [1.4, 2.1, 3.3, 4.6], [-1.6, -0.7, 2.2, 1.3]])
_BATCH = np.array([0, 1, 1], dtype=np.int64)
for _attrs in (
    {"sampling_ratio": 2, "output_height": 2, "output_width": 2},
    {"sampling_ratio": 1, "output_height": 3, "output_width": 2, "mode": "max"},
    {"sampling_ratio": 2, "coordinate_transformation_mode": "output_half_pixel", "spatial_scale": 0.75},
):
    CASES.append(
        GradCase(
            "RoiAlign",
            [r(2, 2, 5, 6), _ROIS + rng.uniform(-0.05, 0.05, _ROIS.shape), _BATCH],
            attrs=_attrs,
            opset=16,
            name=f"RoiAlign_{sorted(_attrs.items())}",
        )
    )

# MaxRoiPool: X only (the rois get none); rois partly outside the image, overlapping, one empty bin
# (the roi past the right edge), spatial_scale.
_MAX_ROIS = np.array([[0, 0.4, 0.2, 4.6, 3.7], [1, 1.4, 2.1, 3.3, 4.6], [1, -1.6, -0.7, 2.2, 1.3], [0, 4.6, 1.0, 9.0, 3.0]])
for _attrs in ({"pooled_shape": [2, 2]}, {"pooled_shape": [3, 2], "spatial_scale": 0.75}):
    CASES.append(
        GradCase("MaxRoiPool", [r(2, 2, 5, 6), _MAX_ROIS], attrs=_attrs, const=(1,), name=f"MaxRoiPool_{sorted(_attrs.items())}")
    )

# DeformConv (differentiated in its standard-op form): X, W, the offsets, B and the mask; groups,
# offset groups, pads, strides, dilations.
for _x_shape, _w_shape, _attrs, _bias, _mask in (
    ((1, 2, 4, 4), (2, 2, 2, 2), {}, True, False),
    ((1, 4, 4, 3), (2, 2, 2, 2), {"group": 2, "offset_group": 2, "pads": [1, 0, 0, 1]}, False, True),
    ((1, 1, 5, 4), (1, 1, 2, 2), {"strides": [2, 1], "dilations": [1, 2]}, True, True),
):
    _og = _attrs.get("offset_group", 1)
    _s, _d, _p = _attrs.get("strides", [1, 1]), _attrs.get("dilations", [1, 1]), _attrs.get("pads", [0, 0, 0, 0])
    _out = [(_x_shape[2 + i] + _p[i] + _p[2 + i] - _d[i] * (_w_shape[2 + i] - 1) - 1) // _s[i] + 1 for i in range(2)]
    _taps = _w_shape[2] * _w_shape[3]
    _inputs = [r(*_x_shape), r(*_w_shape), rng.uniform(-0.8, 0.8, (_x_shape[0], 2 * _og * _taps, *_out))]
    _inputs.append(r(_w_shape[0]) if _bias else None)
    if _mask:
        _inputs.append(rng.uniform(0.2, 1.0, (_x_shape[0], _og * _taps, *_out)))
    CASES.append(
        GradCase(
            "DeformConv", _inputs, attrs=_attrs, opset=19, symbolic=False, name=f"DeformConv{_x_shape}_{sorted(_attrs.items())}"
        )
    )
