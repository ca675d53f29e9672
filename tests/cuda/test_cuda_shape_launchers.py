"""CUDA launchers of CenterCropPad, QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear,
RotaryEmbedding, TensorScatter and ONNX Runtime's SimplifiedLayerNormalizationGrad (formerly
declared in gradgen.kernels.registry.CUDA_FALLBACKS): each runs on a GPU session and is compared
with the CPU session on the same one-node model, for every dtype and attribute branch the launcher
handles, edge cases (empty tensors, negative axes, bad indices) and the configurations it hands
back to the CPU kernel. Every test checks that the launcher itself ran."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.test_cuda_more_launchers import BF16, FLOATS, MS, _tol, check, check_raises, launches, rand

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture, imported into this module's namespace for its tests


def _composed_tol(dtype):
    """A few elementwise steps (and a sum in another order than numpy's): float32 within a few ulps."""
    return _tol(dtype, f32=1e-5)


# ---------------------------------------------------------------- CenterCropPad


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64, np.int64, np.int8, np.bool_], ids=str)
@pytest.mark.parametrize(
    "shape,sizes,axes",
    [
        ((5, 6), [3, 9], None),  # crop one axis, pad the other
        ((4, 7, 3), [6, 2], [0, 1]),
        ((4, 7, 3), [5], [-1]),  # a negative axis
        ((2, 3, 4, 5), [2, 3, 4, 5], None),  # nothing to do
        ((3, 4), [0, 6], None),  # an empty output
        ((0, 4), [2, 1], None),  # an empty input padded
        ((6,), [1], None),
    ],
    ids=str,
)
def test_center_crop_pad(launches, dtype, shape, sizes, axes):
    rng = np.random.default_rng(60)
    x = rand(rng, shape) * 10
    x = (x > 0) if dtype == np.bool_ else x.astype(dtype)
    attrs = {} if axes is None else {"axes": axes}
    check(launches, "CenterCropPad", [x, np.array(sizes, np.int64)], const=(1,), exact=True, opset=18, **attrs)


def test_center_crop_pad_repeated_axes_raise(launches):
    x = np.ones((3, 4), np.float32)
    check_raises(launches, "CenterCropPad", [x, np.array([2, 2], np.int64)], "distinct axes", const=(1,), opset=18, axes=[0, -2])


# ---------------------------------------------------------------- QuantizeLinear / DequantizeLinear


def _scale(rng, per_axis_size, dtype):
    return rng.uniform(0.02, 0.2, per_axis_size or ()).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("zero_point", [None, np.uint8, np.int8], ids=str)
@pytest.mark.parametrize("axis", [None, 1, -1], ids=str)  # None: per tensor
def test_quantize_linear(launches, dtype, zero_point, axis):
    rng = np.random.default_rng(61)
    x = rand(rng, (2, 3, 4), dtype, -30, 30)
    size = None if axis is None else x.shape[axis]
    inputs = [x, _scale(rng, size, dtype)]
    if zero_point is not None:
        info = np.iinfo(zero_point)
        inputs.append(rng.integers(info.min // 2, info.max // 2, size or ()).astype(zero_point))
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "QuantizeLinear", inputs, opset=19, **attrs)


def test_quantize_linear_rounds_half_to_even_and_saturates(launches):
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1000.0, -1000.0, 254.5], np.float32)
    for zero_point in (np.array(0, np.uint8), np.array(-3, np.int8)):
        check(launches, "QuantizeLinear", [x, np.array(1.0, np.float32), zero_point], opset=19)


@pytest.mark.parametrize("shape", [(0, 3), ()], ids=str)
def test_quantize_linear_empty_and_scalar(launches, shape):
    rng = np.random.default_rng(62)
    check(launches, "QuantizeLinear", [rand(rng, shape), np.array([0.1], np.float32), np.array([4], np.uint8)], opset=19)


def test_quantize_linear_output_dtype_without_zero_point(launches):
    rng = np.random.default_rng(63)
    x = rand(rng, (3, 4), np.float32, -20, 20)
    check(launches, "QuantizeLinear", [x, np.array(0.1, np.float32)], opset=21, output_dtype=3)


@pytest.mark.parametrize("case", ["int16", "blocks"])
def test_quantize_linear_hands_other_configurations_to_the_cpu_kernel(launches, case):
    rng = np.random.default_rng(64)
    x = rand(rng, (2, 4), np.float32, -20, 20)
    if case == "int16":
        check(launches, "QuantizeLinear", [x, np.array(0.01, np.float32), np.array(7, np.int16)], opset=19)
    else:
        scale = rng.uniform(0.05, 0.2, (2, 2)).astype(np.float32)
        check(launches, "QuantizeLinear", [x, scale, np.zeros((2, 2), np.int8)], opset=21, axis=1, block_size=2)


def test_quantize_linear_scale_of_another_length_raises(launches):
    x = np.ones((3, 4), np.float32)
    check_raises(launches, "QuantizeLinear", [x, np.ones(3, np.float32)], "neither a scalar", opset=19, axis=1)


@pytest.mark.parametrize("scale_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("x_dtype", [np.uint8, np.int8, np.int32], ids=str)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("axis", [None, 0, -2], ids=str)
def test_dequantize_linear(launches, scale_dtype, x_dtype, zero_point, axis):
    rng = np.random.default_rng(65)
    info = np.iinfo(x_dtype)
    low, high = (info.min, info.max) if x_dtype != np.int32 else (-(2**30), 2**30)
    x = rng.integers(low, high, (3, 5), endpoint=True).astype(x_dtype)
    size = None if axis is None else x.shape[axis]
    inputs = [x, _scale(rng, size, scale_dtype)]
    if zero_point:
        inputs.append(rng.integers(low // 2, high // 2, size or ()).astype(x_dtype))
    attrs = {} if axis is None else {"axis": axis}
    check(launches, "DequantizeLinear", inputs, exact=True, opset=19, **attrs)


def test_dequantize_linear_empty(launches):
    check(launches, "DequantizeLinear", [np.zeros((0, 4), np.int8), np.array(0.5, np.float32)], opset=19)


@pytest.mark.parametrize("case", ["uint16", "blocks"])
def test_dequantize_linear_hands_other_configurations_to_the_cpu_kernel(launches, case):
    rng = np.random.default_rng(66)
    if case == "uint16":
        x = rng.integers(0, 60000, (2, 4)).astype(np.uint16)
        check(launches, "DequantizeLinear", [x, np.array(0.01, np.float32), np.array(300, np.uint16)], opset=19)
    else:
        x = rng.integers(-100, 100, (2, 4)).astype(np.int8)
        scale = rng.uniform(0.05, 0.2, (2, 2)).astype(np.float32)
        check(launches, "DequantizeLinear", [x, scale], opset=21, axis=1, block_size=2)


def test_dequantize_linear_zero_point_of_another_type_raises(launches):
    x = np.ones((3,), np.int8)
    check_raises(launches, "DequantizeLinear", [x, np.array(1.0, np.float32), np.array(0, np.uint8)], "one type", opset=19)


# ---------------------------------------------------------------- DynamicQuantizeLinear


@pytest.mark.parametrize(
    "values",
    [
        lambda rng: rand(rng, (3, 4)) * 5,
        lambda rng: rand(rng, (2, 3, 5), np.float32, 0.5, 4),  # all positive: the range starts at 0
        lambda rng: rand(rng, (7,), np.float32, -4, -0.5),  # all negative
        lambda rng: np.zeros((2, 3), np.float32),  # scale 1
        lambda rng: np.zeros((0, 3), np.float32),
        lambda rng: np.array(1.25, np.float32),
        lambda rng: np.array([0.0, 2.55, -2.55, 1.275], np.float32),  # near ties of the rounding
    ],
    ids=["mixed", "positive", "negative", "zeros", "empty", "scalar", "ties"],
)
def test_dynamic_quantize_linear(launches, values):
    x = values(np.random.default_rng(67))
    got = check(launches, "DynamicQuantizeLinear", [x], outputs=3, exact=True, opset=20)
    assert got["out1"].dtype == np.float32 and got["out2"].dtype == np.uint8 and got["out1"].shape == ()


def test_dynamic_quantize_linear_of_an_infinity_raises(launches):
    x = np.array([1.0, np.inf, -2.0], np.float32)
    check_raises(launches, "DynamicQuantizeLinear", [x], "NaN or an infinity", outputs=3, opset=20)


# ---------------------------------------------------------------- RotaryEmbedding (opset 23)


def _rotary_inputs(rng, dtype, x_shape, heads_axis, dim, with_ids, max_positions=12):
    """(x, cos, sin[, position_ids]) with angles of a real rotation."""
    batch, seq = x_shape[0], x_shape[2] if heads_axis == 1 else x_shape[1]
    x = rand(rng, x_shape, dtype)
    angle_shape = (max_positions, dim // 2) if with_ids else (batch, seq, dim // 2)
    angles = rng.uniform(-np.pi, np.pi, angle_shape)
    inputs = [x, np.cos(angles).astype(np.float32).astype(dtype), np.sin(angles).astype(np.float32).astype(dtype)]
    if with_ids:
        inputs.append(rng.integers(0, max_positions, (batch, seq)).astype(np.int64))
    return inputs


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("rotary_dim", [0, 4])  # 0: the whole head
def test_rotary_embedding_4d(launches, dtype, interleaved, with_ids, rotary_dim):
    rng = np.random.default_rng(68)
    head_size = 8
    inputs = _rotary_inputs(rng, dtype, (2, 3, 5, head_size), 1, rotary_dim or head_size, with_ids)
    attrs = dict(interleaved=interleaved, rotary_embedding_dim=rotary_dim)
    check(launches, "RotaryEmbedding", inputs, opset=23, **attrs, **_composed_tol(dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("with_ids", [False, True])
def test_rotary_embedding_3d(launches, dtype, interleaved, with_ids):
    rng = np.random.default_rng(69)
    heads, head_size, rotary_dim = 3, 6, 4
    inputs = _rotary_inputs(rng, dtype, (2, 5, heads * head_size), 2, rotary_dim, with_ids)
    attrs = dict(interleaved=interleaved, num_heads=heads, rotary_embedding_dim=rotary_dim)
    check(launches, "RotaryEmbedding", inputs, opset=23, **attrs, **_composed_tol(dtype))


def test_rotary_embedding_empty_batch(launches):
    rng = np.random.default_rng(70)
    inputs = _rotary_inputs(rng, np.float32, (0, 2, 5, 8), 1, 8, True)
    check(launches, "RotaryEmbedding", inputs, opset=23)


@pytest.mark.parametrize("bad_id", [12, -1])
def test_rotary_embedding_position_id_out_of_range_raises(launches, bad_id):
    rng = np.random.default_rng(71)
    inputs = _rotary_inputs(rng, np.float32, (1, 2, 3, 4), 1, 4, True)
    inputs[3][0, 1] = bad_id
    check_raises(launches, "RotaryEmbedding", inputs, f"position id {bad_id} is out of range", opset=23)


def test_rotary_embedding_with_int16_ids_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(72)
    inputs = _rotary_inputs(rng, np.float32, (1, 2, 3, 4), 1, 4, True)
    inputs[3] = inputs[3].astype(np.int16)
    check(launches, "RotaryEmbedding", inputs, opset=23)


# ---------------------------------------------------------------- TensorScatter (opset 24)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.float64, np.int64, np.bool_], ids=str)
@pytest.mark.parametrize(
    "cache_shape,length,axis,mode,starts",
    [
        ((2, 3, 8, 4), 3, -2, "linear", [1, 5]),
        ((2, 3, 8, 4), 3, 2, "circular", [6, 7]),  # wraps around
        ((2, 3, 8, 4), 2, -2, "linear", None),  # no write indices: from 0
        ((3, 6), 4, 1, "circular", [5, 0, 2]),  # the last axis: runs of one element
        ((2, 5, 3), 5, 1, "linear", [0, 0]),  # the whole axis
        ((2, 4, 3), 0, 1, "linear", [4, 1]),  # an empty update
    ],
    ids=str,
)
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32], ids=str)
def test_tensor_scatter(launches, dtype, cache_shape, length, axis, mode, starts, index_dtype):
    rng = np.random.default_rng(73)
    update_shape = list(cache_shape)
    update_shape[axis] = length
    cache, update = rand(rng, cache_shape) * 5, rand(rng, update_shape) * 5
    cache, update = ((t > 0) if dtype == np.bool_ else t.astype(dtype) for t in (cache, update))
    inputs = [cache, update] + ([] if starts is None else [np.array(starts, index_dtype)])
    check(launches, "TensorScatter", inputs, exact=True, opset=24, axis=axis, mode=mode)


@pytest.mark.parametrize(
    "mode,starts,match", [("linear", [1, 6], "outside axis"), ("linear", [0, -1], "negative"), ("circular", [-2, 0], "negative")]
)
def test_tensor_scatter_bad_write_indices_raise(launches, mode, starts, match):
    rng = np.random.default_rng(74)
    cache, update = rand(rng, (2, 8, 4)), rand(rng, (2, 3, 4))
    check_raises(launches, "TensorScatter", [cache, update, np.array(starts, np.int64)], match, opset=24, axis=1, mode=mode)


def test_tensor_scatter_negative_index_with_an_empty_update_raises(launches):
    rng = np.random.default_rng(75)
    cache, update = rand(rng, (2, 8, 4)), rand(rng, (2, 0, 4))
    check_raises(launches, "TensorScatter", [cache, update, np.array([0, -1], np.int64)], "negative", opset=24, axis=1)


def test_tensor_scatter_with_uint8_indices_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(76)
    cache, update = rand(rng, (2, 8, 4)), rand(rng, (2, 3, 4))
    check(launches, "TensorScatter", [cache, update, np.array([2, 5], np.uint8)], exact=True, opset=24, axis=1)


# ---------------------------------------------------------------- SimplifiedLayerNormalizationGrad


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape,axis", [((2, 3, 8), -1), ((2, 3, 8), 1), ((4, 5), 0), ((0, 6), 1)], ids=str)
def test_simplified_layer_normalization_grad(launches, dtype, shape, axis):
    rng = np.random.default_rng(77)
    ax = axis % len(shape)
    rows = int(np.prod(shape[:ax], dtype=np.int64))
    dy, x, scale = rand(rng, shape, dtype), rand(rng, shape, dtype), rand(rng, shape[ax:], dtype, 0.5, 1.5)
    inv_std_var = rng.uniform(0.5, 2, shape[:ax] + (1,) * (len(shape) - ax)).astype(np.float32).reshape(-1)[:rows]
    inputs = [dy, x, scale, inv_std_var.reshape(shape[:ax] + (1,) * (len(shape) - ax))]
    got = check(launches, "SimplifiedLayerNormalizationGrad", inputs, domain=MS, outputs=2, axis=axis, **_composed_tol(dtype))
    assert got["out0"].dtype == np.dtype(dtype) and got["out1"].shape == scale.shape


def test_simplified_layer_normalization_grad_with_float64_statistics(launches):
    rng = np.random.default_rng(78)
    dy, x, scale = rand(rng, (3, 5), np.float32), rand(rng, (3, 5), np.float32), rand(rng, (5,), np.float32, 0.5, 1.5)
    inv_std_var = rng.uniform(0.5, 2, (3, 1))  # float64: cast to X's float32, as on the CPU
    check(launches, "SimplifiedLayerNormalizationGrad", [dy, x, scale, inv_std_var], domain=MS, outputs=2, rtol=1e-5, atol=1e-5)


def test_simplified_layer_normalization_grad_of_one_column_raises(launches):
    rng = np.random.default_rng(79)
    inputs = [rand(rng, (3, 1)), rand(rng, (3, 1)), rand(rng, (1,)), rand(rng, (3, 1))]
    check_raises(launches, "SimplifiedLayerNormalizationGrad", inputs, "one element", domain=MS, outputs=2)
