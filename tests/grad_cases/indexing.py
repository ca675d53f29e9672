"""Finite-difference cases: indexing ops (repeated and negative indices, int32 and int64)."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(3)


def r(*shape):
    return rng.uniform(-2.0, 2.0, shape)


def i64(*values, shape=None):
    a = np.array(values, dtype=np.int64)
    return a.reshape(shape) if shape is not None else a


def i32(*values, shape=None):
    return i64(*values, shape=shape).astype(np.int32)


CASES = [
    # Gather: several axes, repeated and negative indices, indices of rank 0, 1 and 2, int64 and int32.
    GradCase("Gather", [r(5, 3), i64(0, 2, 2, -1)], name="Gather_axis0"),
    GradCase("Gather", [r(2, 4, 3), i32(3, -4, 1, 1, -1, 0, shape=(2, 3))], attrs={"axis": 1}, name="Gather_axis1_i32_2d"),
    GradCase("Gather", [r(2, 3, 4), np.array(-2, dtype=np.int64)], attrs={"axis": -1}, name="Gather_axis-1_scalar"),
    GradCase("Gather", [r(4, 3), np.array(2, dtype=np.int32)], name="Gather_scalar_i32"),
    GradCase("Gather", [r(3, 4), i64(1, 1, 1, -3, shape=(2, 2))], attrs={"axis": 1}, name="Gather_repeated_2d"),
    # GatherElements on dims 0, 1, -1 with repeated indices.
    GradCase("GatherElements", [r(3, 4), i64(0, 2, 2, 1, -1, 0, 0, 0, shape=(2, 4))], name="GatherElements_0"),
    GradCase(
        "GatherElements", [r(3, 4), i32(3, 3, -1, 0, 1, 1, 2, 0, 0, shape=(3, 3))], attrs={"axis": 1}, name="GatherElements_1_i32"
    ),
    GradCase(
        "GatherElements",
        [r(2, 2, 3), i64(0, 0, 2, 1, -1, 1, 2, 2, shape=(2, 2, 2))],
        attrs={"axis": -1},
        name="GatherElements_-1",
    ),
    GradCase("GatherElements", [r(2, 3), i64(1, 0, 1, 1, 1, 0, 0, 1, shape=(4, 2))], name="GatherElements_longer"),
    # GatherND: full and partial index tuples, repeated and negative.
    GradCase("GatherND", [r(3, 4), i64(0, 1, 2, -1, 0, 1, shape=(3, 2))], name="GatherND_elements"),
    GradCase("GatherND", [r(3, 2, 2), i64(2, -1, 2, 0, shape=(2, 2, 1))], name="GatherND_slices"),
    GradCase("GatherND", [r(2, 3, 2), i64(1, 1, 2, -1, 0, 0, shape=(2, 3, 1))], attrs={"batch_dims": 1}, name="GatherND_batch1"),
    GradCase(
        "GatherND",
        [r(2, 2, 3, 2), i64(1, 0, 2, 1, 2, 1, 0, 0, shape=(2, 2, 1, 2))],
        attrs={"batch_dims": 2},
        name="GatherND_batch2",
    ),
    # Scatter*: reduction none (distinct indices) and add (repeated).
    GradCase(
        "ScatterElements", [r(3, 4), i64(1, 0, 2, 3, 2, 1, shape=(2, 3)), r(2, 3)], attrs={"axis": 1}, name="ScatterElements_none"
    ),
    GradCase(
        "ScatterElements",
        [r(3, 4), i64(0, 0, -1, 2, 0, 1, shape=(2, 3)), r(2, 3)],
        attrs={"reduction": "add"},
        opset=18,
        name="ScatterElements_add",
    ),
    GradCase("ScatterND", [r(4, 3), i64(1, -1, shape=(2, 1)), r(2, 3)], name="ScatterND_none"),
    GradCase("ScatterND", [r(3, 3), i64(0, 1, 0, 1, 2, 2, shape=(3, 2)), r(3)], attrs={"reduction": "add"}, name="ScatterND_add"),
    # max / min: distinct values (no ties: a tie is a kink); the updates land on data and on each other.
    GradCase(
        "ScatterElements",
        [
            np.array([[0.5, -1.0, 2.0], [1.5, 0.2, -0.7]]),
            i64(0, 0, 2, 1, 1, 1, shape=(2, 3)),
            np.array([[0.9, 0.1, 1.1], [-0.3, 0.4, 1.3]]),
        ],
        attrs={"axis": 1, "reduction": "max"},
        opset=18,
        name="ScatterElements_max",
    ),
    GradCase(
        "ScatterND",
        [
            np.array([[0.5, -1.0], [1.5, 0.2], [0.3, 0.8]]),
            i64(2, 0, 2, shape=(3, 1)),
            np.array([[0.1, 0.9], [0.7, -0.4], [-0.2, 1.1]]),
        ],
        attrs={"reduction": "min"},
        opset=18,
        name="ScatterND_min",
    ),
    GradCase(
        "Scatter", [r(3, 4), i64(1, 0, 2, 3, 2, 1, shape=(2, 3)), r(2, 3)], attrs={"axis": 1}, opset=10, name="Scatter_deprecated"
    ),
    # OneHot: the values get the sums of dY where hot / not hot; out-of-range indices are all off.
    GradCase("OneHot", [i64(0, 2, -1, 5, shape=(2, 2)), np.array(3, np.int64), r(2)], name="OneHot_last_axis"),
    GradCase("OneHot", [i64(1, 0, 2), np.array(4, np.int64), r(2)], attrs={"axis": 0}, name="OneHot_axis0"),
    # Compress: along an axis, and of the flattened input with a shorter condition.
    GradCase("Compress", [r(3, 4), np.array([True, False, True])], attrs={"axis": 0}, name="Compress_axis0"),
    GradCase("Compress", [r(3, 4), np.array([False, True, True, False])], attrs={"axis": -1}, name="Compress_axis-1"),
    GradCase("Compress", [r(2, 3), np.array([1, 0, 1, 1, 0], dtype=bool)], name="Compress_flat"),
    # Unique of distinct values: sorted or in first-occurrence order, flat or along an axis.
    GradCase("Unique", [np.array([0.7, -1.2, 1.9, 0.1, -0.4])], attrs={"sorted": 1}, name="Unique_sorted"),
    GradCase(
        "Unique",
        [np.array([[0.7, -1.2], [1.9, 0.1], [-0.5, 0.3]])],
        attrs={"sorted": 0},
        num_outputs=4,
        name="Unique_flat_unsorted",
    ),
    GradCase("Unique", [np.array([[0.7, -1.2], [-0.5, 0.1], [-0.9, 0.3]])], attrs={"axis": 0}, num_outputs=2, name="Unique_rows"),
]

# TensorScatter (opset 24): prefill (no write_indices), decode at per-row positions, circular wrap,
# a sequence axis in the middle
CASES += [
    GradCase("TensorScatter", [r(2, 3, 5, 4), r(2, 3, 2, 4)], opset=24, name="TensorScatter_prefill"),
    GradCase("TensorScatter", [r(2, 3, 5, 4), r(2, 3, 1, 4), i64(4, 1)], opset=24, name="TensorScatter_decode"),
    GradCase(
        "TensorScatter",
        [r(2, 5, 3), r(2, 3, 3), i64(3, 6)],
        attrs={"mode": "circular", "axis": 1},
        opset=24,
        name="TensorScatter_circular",
    ),
]
