"""Finite-difference cases: shape ops (reshaping, slicing, joining, padding, tiling)."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(2)
I64 = np.iinfo(np.int64)


def r(*shape):
    return rng.uniform(-2.0, 2.0, shape)


def ints(*values):
    return np.array(values, dtype=np.int64)


CASES = [
    GradCase("Reshape", [r(2, 3, 4), ints(4, -1)]),
    GradCase("Reshape", [r(2, 3, 4), ints(0, 12)], name="Reshape_zero"),
    GradCase("Reshape", [r(2, 6), ints(3, 2, 2)], opset=18, name="Reshape_op18"),
    GradCase("Flatten", [r(2, 3, 4)]),
    GradCase("Flatten", [r(2, 3, 4)], attrs={"axis": 0}, name="Flatten_0"),
    GradCase("Flatten", [r(2, 3, 4)], attrs={"axis": -1}, name="Flatten_-1"),
    GradCase("Transpose", [r(2, 3, 4)]),
    GradCase("Transpose", [r(2, 3, 4)], attrs={"perm": [1, 2, 0]}, name="Transpose_120"),
    GradCase("Transpose", [r(2, 3, 1, 2)], attrs={"perm": [3, 0, 2, 1]}, name="Transpose_3021"),
    GradCase("Squeeze", [r(2, 1, 3), ints(1)]),
    GradCase("Squeeze", [r(1, 3, 1), ints(-1, 0)], name="Squeeze_neg"),
    GradCase("Squeeze", [r(1, 3, 1)], name="Squeeze_all"),
    GradCase("Unsqueeze", [r(2, 3), ints(0, 3)]),
    GradCase("Unsqueeze", [r(2, 3), ints(-1)], opset=18, name="Unsqueeze_neg"),
    GradCase("Concat", [r(2, 3), r(2, 1), r(2, 4)], attrs={"axis": 1}),
    GradCase("Concat", [r(1, 3), r(3, 3)], attrs={"axis": 0}, name="Concat_0"),
    GradCase("Concat", [r(2, 2, 1), r(2, 2, 3)], attrs={"axis": -1}, const=(0,), name="Concat_-1_const"),
    GradCase("Concat", [r(2, 3)], attrs={"axis": 1}, name="Concat_single"),
    GradCase("Split", [r(2, 4), ints(1, 3)], attrs={"axis": 1}, num_outputs=2),
    GradCase("Split", [r(6, 2)], attrs={"axis": 0}, num_outputs=3, name="Split_equal"),
    GradCase("Split", [r(2, 6)], attrs={"axis": -1, "num_outputs": 3}, num_outputs=3, opset=18, name="Split_num_outputs"),
    GradCase("Split", [r(2, 7)], attrs={"axis": 1, "num_outputs": 3}, num_outputs=3, opset=18, name="Split_uneven"),
    # Slice: steps > 1, negative starts/ends, step -1, INT64_MAX ends, omitted axes/steps.
    GradCase("Slice", [r(4, 5), ints(1, 0), ints(3, I64.max), ints(0, 1), ints(1, 2)], name="Slice_step2"),
    GradCase("Slice", [r(4, 5), ints(-3), ints(-1), ints(1)], name="Slice_negative"),
    GradCase("Slice", [r(4, 5), ints(-1), ints(I64.min), ints(0), ints(-1)], name="Slice_reverse"),
    GradCase("Slice", [r(3, 6), ints(4, 0), ints(0, I64.max), ints(-1, 0), ints(-2, 1)], name="Slice_neg_step2"),
    GradCase("Slice", [r(4, 5), ints(1, 1), ints(3, 4)], name="Slice_no_axes"),
    GradCase("Slice", [r(4, 5), ints(0, 4), ints(I64.max, 0), None, ints(2, -1)], name="Slice_steps_no_axes"),
    GradCase("Slice", [r(2, 3, 4), ints(1), ints(100), ints(-1)], name="Slice_clamped_end"),
    GradCase("Expand", [r(3, 1), ints(2, 3, 4)]),
    GradCase("Expand", [r(1), ints(2, 3)], name="Expand_1"),
    GradCase("Expand", [r(2, 1, 3), ints(4, 1)], name="Expand_mixed"),
    GradCase("Expand", [r(2, 3), ints(2, 3)], name="Expand_noop"),
    GradCase("Tile", [r(2, 3), ints(2, 3)]),
    GradCase("Tile", [r(2, 1, 3), ints(1, 2, 2)], name="Tile_3d"),
    GradCase("Pad", [r(2, 3), ints(1, 0, 2, 1)]),
    GradCase("Pad", [r(3, 4), ints(-1, 1, 0, -2)], name="Pad_negative"),
    GradCase("Pad", [r(2, 3), ints(1, 2, 0, 1), np.array(0.7)], name="Pad_value"),
    GradCase("Pad", [r(2, 3, 2), ints(1, -1), None, ints(1)], opset=18, name="Pad_axes"),
    GradCase("Pad", [r(3, 4), ints(1, 2, 2, 1)], attrs={"mode": "edge"}, name="Pad_edge"),
    GradCase("Pad", [r(1, 4), ints(0, 2, 0, 3)], attrs={"mode": "edge"}, name="Pad_edge_narrow"),
    GradCase("Pad", [r(3, 4), ints(2, 1, 1, 3)], attrs={"mode": "reflect"}, name="Pad_reflect"),
    GradCase("Pad", [r(2, 5), ints(0, 4, 0, 4)], attrs={"mode": "reflect"}, name="Pad_reflect_wide"),
    GradCase("Pad", [r(3, 4), ints(1, 2, 2, 3)], attrs={"mode": "wrap"}, opset=19, name="Pad_wrap"),
    GradCase("DepthToSpace", [r(1, 8, 2, 3)], attrs={"blocksize": 2}),
    GradCase("DepthToSpace", [r(2, 8, 2, 1)], attrs={"blocksize": 2, "mode": "CRD"}, name="DepthToSpace_CRD"),
    GradCase("SpaceToDepth", [r(2, 2, 4, 6)], attrs={"blocksize": 2}),
    # opset 28's mode: the gradient is DepthToSpace of the same mode (it used to be DCR's always)
    GradCase("SpaceToDepth", [r(2, 2, 4, 6)], attrs={"blocksize": 2, "mode": "CRD"}, opset=28, name="SpaceToDepth_CRD"),
    GradCase("Trilu", [r(3, 4)]),
    GradCase("Trilu", [r(2, 3, 4), np.array(1, dtype=np.int64)], attrs={"upper": 0}, name="Trilu_lower_k1"),
    GradCase("Trilu", [r(4, 3), np.array(-1, dtype=np.int64)], name="Trilu_upper_k-1"),
]

# CenterCropPad: crop and pad, odd and even differences, on all or some (negative) axes.
CASES += [
    GradCase("CenterCropPad", [r(5, 6), np.array([3, 9], dtype=np.int64)], opset=18, name="CenterCropPad_all_axes"),
    GradCase(
        "CenterCropPad",
        [r(2, 5, 4), np.array([2, 7], dtype=np.int64)],
        {"axes": [1, -1]},
        opset=18,
        name="CenterCropPad_axes",
    ),
    GradCase("CenterCropPad", [r(3, 4), np.array([4], dtype=np.int64)], {"axes": [0]}, opset=18, name="CenterCropPad_pad_odd"),
    # Range: start and delta get sum(dY) and sum(i * dY); the limit only sets the length.
    GradCase("Range", [np.array(0.3), np.array(2.9), np.array(0.5)], name="Range_float", symbolic=False),
    GradCase("Range", [np.array(1.0), np.array(-2.2), np.array(-0.7)], name="Range_negative_delta", symbolic=False),
    # ReverseSequence: the first lengths[b] steps reversed, either axis the batch.
    GradCase("ReverseSequence", [r(4, 3, 2), np.array([4, 1, 2], np.int64)], name="ReverseSequence_time0"),
    GradCase(
        "ReverseSequence",
        [r(3, 4), np.array([1, 4, 2], np.int64)],
        attrs={"batch_axis": 0, "time_axis": 1},
        name="ReverseSequence_batch0",
    ),
]
