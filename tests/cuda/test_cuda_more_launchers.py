"""CUDA launchers of ops that used to run their numpy kernel on host copies (formerly declared in
gradgen.kernels.registry.CUDA_FALLBACKS): each runs on a GPU session and is compared with the CPU
session on the same model, for every dtype and attribute branch the launcher handles, edge cases
(empty tensors, negative axes, out-of-range values) and a configuration it hands back to the CPU
kernel. Every test checks that the launcher itself ran (not the executor's host path)."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import KernelError, ModelError, RunError
from gradgen.executor import Session
from gradgen.kernels import registry
from tests.fuzz_graphs import single_node_inputs

pytestmark = pytest.mark.cuda

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.float16, BF16, np.float32, np.float64]
MS = "com.microsoft"


def single_node(op_type, inputs, *, outputs=1, domain="", opset=None, const=(), **attrs):
    """(model, feeds) of one ``op_type`` node. ``inputs``: arrays (None for an omitted input); those
    at the positions in ``const`` are initializers, the others graph inputs (fed to the device)."""
    fed = {i for i, array in enumerate(inputs) if array is not None and i not in const}
    names, graph_inputs, initializers = single_node_inputs(inputs, fed)
    feeds = {f"in{i}": np.asarray(inputs[i]) for i in fed}
    out_names = [f"out{k}" for k in range(outputs)]
    node = helper.make_node(op_type, names, out_names, domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        op_type,
        graph_inputs,
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in out_names],
        initializer=initializers,
    )
    opsets = [helper.make_opsetid("", opset or 21)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets), feeds


def _run(model, feeds, device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallbacks' one-time notes
        return Session(model, device=device).run(feeds)


@pytest.fixture
def launches(monkeypatch):
    """``launches(op, domain)``: a list that grows by one each time the op's CUDA launcher runs.
    CUDA graphs stay on, so that integer feeds live on the device and reach the launchers."""
    registry.load_cuda_kernels()
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", "1")

    def watch(op_type, domain=""):
        entry = registry.lookup(domain, op_type)
        assert entry is not None and entry.cuda is not None, f"no CUDA launcher for {op_type}"
        calls = []
        launcher = entry.cuda

        def counted(*args, **kwargs):
            calls.append(op_type)
            return launcher(*args, **kwargs)

        monkeypatch.setattr(entry, "cuda", counted)
        return calls

    return watch


def _as_compared(a):
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype == BF16 or a.dtype.kind == "f" else a


def assert_same(got, want, *, exact=False, rtol=1e-6, atol=1e-6):
    for name, value in want.items():
        g = got[name]
        assert g.shape == value.shape and g.dtype == value.dtype, (name, g.shape, value.shape, g.dtype, value.dtype)
        if exact or value.dtype.kind in "iub":
            np.testing.assert_array_equal(_as_compared(g), _as_compared(value), err_msg=name)
        else:
            np.testing.assert_allclose(_as_compared(g), _as_compared(value), rtol=rtol, atol=atol, err_msg=name)


def check(launches, op_type, inputs, *, domain="", exact=False, rtol=1e-6, atol=1e-6, **kwargs):
    """Run the one-node model on the CPU and on the GPU (where the launcher must run); compare."""
    model, feeds = single_node(op_type, inputs, domain=domain, **kwargs)
    want = _run(model, feeds, "cpu")
    calls = launches(op_type, domain)
    got = _run(model, feeds, "cuda")
    assert calls, f"the {op_type} launcher did not run"
    assert_same(got, want, exact=exact, rtol=rtol, atol=atol)
    return got


def check_raises(launches, op_type, inputs, match, *, domain="", error=KernelError, **kwargs):
    """Both sessions raise ``error`` (the node named in its message) with a message that matches ``match``."""
    model, feeds = single_node(op_type, inputs, domain=domain, **kwargs)
    with pytest.raises(error, match=match):
        _run(model, feeds, "cpu")
    calls = launches(op_type, domain)
    with pytest.raises(error, match=match):
        _run(model, feeds, "cuda")
    assert calls, f"the {op_type} launcher did not run"


def check_refused_at_load(op_type, inputs, match, *, domain="", **kwargs):
    """Both devices' sessions refuse the model as it loads (a ModelError naming the node), before
    any launcher: a required attribute missing, or one the op does not have."""
    model, feeds = single_node(op_type, inputs, domain=domain, **kwargs)
    for device in ("cpu", "cuda"):
        with pytest.raises(ModelError, match=match):
            _run(model, feeds, device)


def rand(rng, shape, dtype=np.float32, low=None, high=None):
    x = rng.standard_normal(shape) if low is None else rng.uniform(low, high, shape)
    return np.asarray(x, np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else np.asarray(x, np.float64)


def _tol(dtype, *, bf16=2**-7, f16=2**-10, f32=1e-6, f64=1e-12):
    """Tolerances (rtol = atol) for one float type; by default the 16-bit types are within a
    rounding or two."""
    per_type = {BF16: bf16, np.dtype(np.float16): f16, np.dtype(np.float32): f32}
    bound = per_type.get(np.dtype(dtype), f64)
    return dict(rtol=bound, atol=bound)


def backward_matches(model, feeds, wrt=None, rtol=1e-5, atol=1e-6):
    """build_backward's graph of ``model`` runs on the GPU with the CPU session's gradients."""
    built = gradgen.build_backward(model, wrt=wrt).model
    want = _run(built, feeds, "cpu")
    got = _run(built, feeds, "cuda")
    assert_same(got, want, rtol=rtol, atol=atol)


def loss_model(op_type, inputs, *, domain="", opset=None, const=(), **attrs):
    """(model, feeds): loss = sum(op(inputs) * w) for a fixed w, the float inputs not in ``const`` fed."""
    model, feeds = single_node(op_type, inputs, domain=domain, opset=opset, const=const, **attrs)
    out = _run(model, feeds, "cpu")["out0"]
    w = np.random.default_rng(7).uniform(0.5, 1.5, out.shape).astype(out.dtype)
    graph = model.graph
    graph.initializer.append(numpy_helper.from_array(w, "w"))
    graph.node.extend(
        [
            helper.make_node("Mul", ["out0", "w"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ]
    )
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(out.dtype), []))
    return model, feeds


# ---------------------------------------------------------------- Mean


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "shapes",
    [[(3, 4)], [(3, 4), (3, 4)], [(3, 4), (3, 4), (3, 4)], [(2, 1, 3), (4, 1), (3,)], [(0, 3), (1, 3)], [(), (2, 2)]],
    ids=str,
)
def test_mean(launches, dtype, shapes):
    rng = np.random.default_rng(1)
    check(launches, "Mean", [rand(rng, s, dtype) for s in shapes], **_tol(dtype))


def test_mean_of_nine_inputs_and_float32_bits(launches):
    rng = np.random.default_rng(2)
    got = check(launches, "Mean", [rand(rng, (5, 7)) for _ in range(9)], exact=True)
    assert got["out0"].dtype == np.float32


def test_mean_of_integers_falls_back(launches):
    check(launches, "Mean", [np.arange(6, dtype=np.int32).reshape(2, 3), np.full((2, 3), 3, np.int32)])


def test_mean_shapes_that_do_not_broadcast_raise(launches):
    rng = np.random.default_rng(3)
    check_raises(launches, "Mean", [rand(rng, (2, 3)), rand(rng, (4,))], "broadcast", error=RunError)


def test_mean_backward(launches):
    rng = np.random.default_rng(4)
    model, feeds = loss_model("Mean", [rand(rng, (2, 3)), rand(rng, (3,)), rand(rng, (1, 1))])
    backward_matches(model, feeds)


# ---------------------------------------------------------------- ONNX Runtime's activation gradients


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op_type", ["SigmoidGrad", "TanhGrad"])
@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5), (0, 4), ()], ids=str)
def test_activation_output_grads(launches, op_type, dtype, shape):
    rng = np.random.default_rng(5)
    dy = rand(rng, shape, dtype)
    x = rng.standard_normal(shape)
    y = (1 / (1 + np.exp(-x)) if op_type == "SigmoidGrad" else np.tanh(x)).astype(np.float32).astype(dtype)
    check(launches, op_type, [dy, y], domain=MS, exact=True)  # computed as the CPU session does


@pytest.mark.parametrize("op_type", ["SigmoidGrad", "TanhGrad"])
def test_activation_output_grads_shape_mismatch_raises(launches, op_type):
    rng = np.random.default_rng(6)
    check_raises(launches, op_type, [rand(rng, (3, 4)), rand(rng, (4, 3))], "must match", domain=MS)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op_type", ["BiasGeluGrad_dX", "BiasFastGeluGrad_dX"])
@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 8), (0, 4)], ids=str)
def test_bias_gelu_grads(launches, op_type, dtype, shape):
    rng = np.random.default_rng(7)
    inputs = [rand(rng, shape, dtype), rand(rng, shape, dtype), rand(rng, shape[-1:], dtype)]
    tol = _tol(dtype) if np.dtype(dtype).itemsize == 2 else dict(rtol=1e-5, atol=1e-6)
    check(launches, op_type, inputs, domain=MS, **tol)


@pytest.mark.parametrize("op_type", ["BiasGeluGrad_dX", "BiasFastGeluGrad_dX"])
def test_bias_gelu_grads_bad_bias_raises(launches, op_type):
    rng = np.random.default_rng(8)
    check_raises(launches, op_type, [rand(rng, (3, 4)), rand(rng, (3, 4)), rand(rng, (3,))], "must be 1-D", domain=MS)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "scale_value,scale_down",
    [
        (np.array([1.7], np.float32), 0),
        (np.array([-0.6], np.float64), 1),
        (np.array(3, np.int64), 1),
        (np.array([2], np.int32), 0),
    ],
    ids=["f32", "f64_down", "i64_down", "i32"],
)
def test_scale(launches, dtype, scale_value, scale_down):
    rng = np.random.default_rng(9)
    check(launches, "Scale", [rand(rng, (3, 5), dtype), scale_value], domain=MS, const=(1,), scale_down=scale_down, exact=True)


def test_scale_fed_and_empty(launches):
    check(launches, "Scale", [np.zeros((0, 3), np.float32), np.array([2.5], np.float32)], domain=MS, exact=True)


@pytest.mark.parametrize(
    "value,match", [(np.array([0.0], np.float32), "must not be 0"), (np.array([1.0, 2.0], np.float32), "single value")]
)
def test_scale_bad_values_raise(launches, value, match):
    check_raises(launches, "Scale", [np.ones((2, 2), np.float32), value], match, domain=MS, const=(1,))


# ---------------------------------------------------------------- Range

RANGES = [(0.1, 1000.3, 0.7), (1.0, -2.2, -0.7), (3.0, 3.0, 1.0), (5.0, 1.0, 1.0), (-4.0, 5.0, 2.5)]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bounds", RANGES, ids=str)
def test_range_floats(launches, dtype, bounds):
    """The same bits as the CPU session: each element's product and sum rounded in the work type."""
    check(launches, "Range", [np.array(v).astype(dtype) for v in bounds], exact=True)


@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=str)
@pytest.mark.parametrize("bounds", [(2, 11, 3), (10, -7, -4), (0, 0, 1), (5, 1, 2), (-3, 100000, 7)], ids=str)
def test_range_integers(launches, dtype, bounds):
    check(launches, "Range", [np.array(v, dtype) for v in bounds])


def test_range_with_an_attribute_it_does_not_have_is_refused():
    inputs = [np.array(v, np.float16) for v in (0.5, 30.0, 0.3)]
    check_refused_at_load("Range", inputs, "has an attribute 'stash_type', which Range does not have", opset=21, stash_type=0)


def test_range_delta_zero_raises(launches):
    check_raises(launches, "Range", [np.array(v, np.float32) for v in (0.0, 1.0, 0.0)], "delta is 0")


def test_range_non_scalar_raises(launches):
    check_raises(
        launches, "Range", [np.array([0.0, 1.0], np.float32), np.array(3.0, np.float32), np.array(1.0, np.float32)], "scalar"
    )


def test_range_int16_falls_back(launches):
    check(launches, "Range", [np.array(v, np.int16) for v in (-5, 20, 3)])


def test_range_backward(launches):
    model, feeds = loss_model("Range", [np.array(0.3), np.array(2.9), np.array(0.5)], const=(1,))
    backward_matches(model, feeds, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- ReverseSequence


@pytest.mark.parametrize(
    "dtype", [np.float16, BF16, np.float32, np.float64, np.int64, np.int32, np.int8, np.bool_], ids=lambda d: np.dtype(d).name
)
@pytest.mark.parametrize("lens_dtype", [np.int32, np.int64], ids=str)
@pytest.mark.parametrize(
    "shape,lens,batch_axis,time_axis",
    [
        ((4, 3, 2), [4, 1, 2], 1, 0),
        ((3, 4), [1, 4, 0], 0, 1),
        ((5, 2, 3, 4), [5, 3], 1, 0),
        ((2, 6, 7), [6, 2], 0, 1),
        ((3, 2, 8), [0, 0], 1, 0),
    ],
    ids=str,
)
def test_reverse_sequence(launches, dtype, lens_dtype, shape, lens, batch_axis, time_axis):
    rng = np.random.default_rng(10)
    x = (rng.standard_normal(shape) * 10).astype(np.float32).astype(dtype)
    check(
        launches,
        "ReverseSequence",
        [x, np.array(lens, lens_dtype)],
        exact=True,
        batch_axis=batch_axis,
        time_axis=time_axis,
    )


def test_reverse_sequence_empty(launches):
    check(launches, "ReverseSequence", [np.zeros((3, 2, 0), np.float32), np.array([3, 1], np.int64)], exact=True)


@pytest.mark.parametrize("lens", [[5, 1, 2], [-1, 1, 2]], ids=str)
def test_reverse_sequence_length_out_of_range_raises(launches, lens):
    rng = np.random.default_rng(11)
    check_raises(launches, "ReverseSequence", [rng.standard_normal((4, 3, 2)), np.array(lens, np.int64)], "must lie in")


def test_reverse_sequence_wrong_count_raises(launches):
    rng = np.random.default_rng(12)
    check_raises(launches, "ReverseSequence", [rng.standard_normal((4, 3, 2)), np.array([1, 2], np.int64)], "entries for a batch")


def test_reverse_sequence_float_lengths_fall_back(launches):
    rng = np.random.default_rng(13)
    check(launches, "ReverseSequence", [rng.standard_normal((4, 3)), np.array([2.0, 4.0, 1.0])], exact=True)


def test_reverse_sequence_backward(launches):
    rng = np.random.default_rng(14)
    model, feeds = loss_model("ReverseSequence", [rng.standard_normal((4, 3, 2)), np.array([4, 1, 2], np.int64)], const=(1,))
    backward_matches(model, feeds, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- OneHot


@pytest.mark.parametrize(
    "values_dtype",
    [np.float16, BF16, np.float32, np.float64, np.int64, np.int32, np.uint8, np.bool_],
    ids=lambda d: np.dtype(d).name,
)
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64, np.int8, np.uint8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axis", [-1, 0, 1, -2], ids=str)
def test_one_hot(launches, values_dtype, index_dtype, axis):
    """Negative indices count from depth; indices outside [-depth, depth) give all-off lines."""
    signed = np.dtype(index_dtype).kind == "i"
    indices = np.array([[0, 2, -1, 5], [-4, 3, 1, -5]] if signed else [[0, 2, 9, 5], [4, 3, 1, 200]], index_dtype)
    values = np.array([0.25, -3.5] if np.dtype(values_dtype) != np.bool_ else [False, True]).astype(values_dtype)
    check(launches, "OneHot", [indices, np.array(4, np.int64), values], const=(1,), axis=axis)


@pytest.mark.parametrize("shape,axis", [((), 0), ((), -1), ((5,), 0), ((0, 3), 1), ((2, 0), -1)], ids=str)
def test_one_hot_scalar_and_empty_indices(launches, shape, axis):
    indices = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape) % 3
    check(launches, "OneHot", [indices, np.array(3, np.int64), np.array([1.0, 2.0], np.float32)], const=(1,), axis=axis)


def test_one_hot_depth_fed_as_a_float(launches):
    """depth of any numeric type, truncated; values fed to the device as a graph input."""
    check(launches, "OneHot", [np.array([1, 0, 3], np.int64), np.array([3.7], np.float32), np.array([0.0, 1.0], np.float32)])


@pytest.mark.parametrize(
    "depth,values,axis,match",
    [
        (np.array(0, np.int64), np.array([0.0, 1.0], np.float32), -1, "depth must be positive"),
        (np.array([2, 3], np.int64), np.array([0.0, 1.0], np.float32), -1, "depth must hold one value"),
        (np.array(3, np.int64), np.array([0.0, 1.0, 2.0], np.float32), -1, "values must hold"),
        (np.array(3, np.int64), np.array([0.0, 1.0], np.float32), 3, "out of range"),
    ],
    ids=["depth0", "depth2", "values3", "axis3"],
)
def test_one_hot_bad_arguments_raise(launches, depth, values, axis, match):
    check_raises(launches, "OneHot", [np.array([[1, 0]], np.int64), depth, values], match, const=(1,), axis=axis)


def test_one_hot_float_indices_fall_back(launches):
    indices = np.array([0.7, 2.2, -1.5, 3.9], np.float32)
    check(launches, "OneHot", [indices, np.array(4, np.int64), np.array([-1.0, 1.0], np.float32)], const=(1,))


def test_one_hot_backward(launches):
    indices = np.array([[0, 2], [-1, 5]], np.int64)
    model, feeds = loss_model("OneHot", [indices, np.array(3, np.int64), np.array([0.3, 1.7])], const=(0, 1))
    backward_matches(model, feeds, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- Resize

_TF_ROI = np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], np.float32)
RESIZE_GEOMETRIES = [
    # (scales, sizes, roi, attributes)
    ([1, 1, 2, 2], None, None, dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),
    ([1, 1, 0.6, 0.5], None, None, {}),
    ([1, 1, 1.7, 2.5], None, None, dict(coordinate_transformation_mode="align_corners")),
    ([1, 1, 1.7, 2.5], None, None, dict(coordinate_transformation_mode="pytorch_half_pixel", nearest_mode="round_prefer_ceil")),
    ([1, 1, 1.5, 0.8], None, None, dict(coordinate_transformation_mode="half_pixel_symmetric", nearest_mode="ceil")),
    (None, [2, 3, 7, 1], None, {}),
    (None, [5, 2], None, dict(axes=[-1, 2])),
    (None, [9, 9], None, dict(axes=[2, 3], keep_aspect_ratio_policy="not_larger")),
    (None, [2, 3, 6, 5], _TF_ROI, dict(coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=0.5)),
]


def _resize_inputs(x, scales, sizes, roi):
    return [
        x,
        roi,
        None if scales is None else np.array(scales, np.float32),
        None if sizes is None else np.array(sizes, np.int64),
    ]


@pytest.mark.parametrize(
    "dtype",
    [np.float16, BF16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_],
    ids=lambda d: np.dtype(d).name,
)
@pytest.mark.parametrize("geometry", RESIZE_GEOMETRIES, ids=lambda g: str(g[3] or g[0] or g[1]))
def test_resize_nearest(launches, dtype, geometry):
    """A gather: the same bits as the CPU session, extrapolated elements included."""
    scales, sizes, roi, attrs = geometry
    x = (np.random.default_rng(15).standard_normal((2, 3, 5, 4)) * 20).astype(np.float32).astype(dtype)
    check(launches, "Resize", _resize_inputs(x, scales, sizes, roi), const=(1, 2, 3), exact=True, mode="nearest", **attrs)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("mode", ["linear", "cubic"])
@pytest.mark.parametrize(
    "geometry",
    RESIZE_GEOMETRIES
    + [
        ([1, 1, 0.4, 0.7], None, None, dict(antialias=1)),
        ([1, 1, 2.3, 1.6], None, None, dict(exclude_outside=1, cubic_coeff_a=-0.5)),
    ],
    ids=lambda g: str(g[3] or g[0] or g[1]),
)
def test_resize_linear_and_cubic(launches, dtype, mode, geometry):
    """One pass per resized axis in double, the CPU kernel's matrices as taps."""
    scales, sizes, roi, attrs = geometry
    attrs = {k: v for k, v in attrs.items() if k != "nearest_mode"}
    x = rand(np.random.default_rng(16), (2, 3, 5, 4), dtype)
    tol = _tol(dtype) if np.dtype(dtype).itemsize == 2 else dict(rtol=1e-6, atol=1e-6)
    check(launches, "Resize", _resize_inputs(x, scales, sizes, roi), const=(1, 2, 3), mode=mode, **tol, **attrs)


def test_resize_10_and_fed_scales(launches):
    """Resize-10 (X, scales): asymmetric coordinates, nearest by floor; scales fed as a graph input."""
    x = rand(np.random.default_rng(17), (1, 2, 3, 4))
    check(launches, "Resize", [x, np.array([1, 1, 2, 1.5], np.float32)], opset=10, exact=True, mode="nearest")
    check(launches, "Resize", [x, np.array([1, 1, 2, 1.5], np.float32)], opset=10, mode="linear")


@pytest.mark.parametrize(
    "shape,scales",
    [
        ((2, 3, 4), [1, 1, 1]),
        ((2, 0, 3), [1, 2, 2]),
        ((2, 3, 4), [1, 0.2, 1]),
        ((5,), [0.4]),
        ((3, 1, 2, 2, 2), [1, 1, 2, 0.5, 3]),
    ],
    ids=str,
)
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_identity_empty_and_other_ranks(launches, shape, scales, mode):
    x = rand(np.random.default_rng(18), shape)
    check(launches, "Resize", [x, None, np.array(scales, np.float32)], const=(2,), exact=mode == "nearest", mode=mode)


def test_resize_integer_linear_falls_back(launches):
    x = np.arange(24, dtype=np.int32).reshape(1, 2, 3, 4)
    check(launches, "Resize", [x, None, np.array([1, 1, 2, 1.5], np.float32)], const=(2,), mode="linear")


@pytest.mark.parametrize(
    "scales,match",
    [([1, 1, 2], "scales has 3 value"), ([1, 1, -2, 1], "is not positive")],
    ids=["count", "negative"],
)
def test_resize_bad_scales_raise(launches, scales, match):
    x = rand(np.random.default_rng(19), (1, 2, 3, 4))
    check_raises(launches, "Resize", [x, None, np.array(scales, np.float32)], match, const=(2,))


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_backward(launches, mode):
    x = rand(np.random.default_rng(20), (1, 2, 3, 4), np.float64)
    model, feeds = loss_model("Resize", [x, None, np.array([1, 1, 1.6, 2.5], np.float32)], const=(2,), mode=mode)
    backward_matches(model, feeds, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- TopK

TOPK_TYPES = [np.float16, BF16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64]


def _topk_data(rng, shape, dtype, specials=True):
    """Small integers (many ties) in ``dtype``; floats also get NaN, +-inf and -0."""
    x = rng.integers(0 if np.dtype(dtype) == np.uint8 else -4, 5, shape)
    if np.dtype(dtype).kind in "iu":
        return x.astype(dtype)
    x = x.astype(np.float32)
    if specials:
        flat = x.reshape(-1)
        for value, share in ((np.nan, 0.15), (np.inf, 0.08), (-np.inf, 0.08), (-0.0, 0.1)):
            flat[rng.random(flat.size) < share] = value
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", TOPK_TYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,axis", [((5, 8), -1), ((4, 6, 3), 1), ((7, 5), 0), ((2, 3, 4), -3), ((9,), 0)], ids=str)
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("sorted_", [1, 0])
def test_top_k(launches, dtype, shape, axis, largest, sorted_):
    """Ties (the lower index first), NaN above +inf, -0 tied with +0: the CPU kernel's order, bit for bit."""
    rng = np.random.default_rng(21)
    x = _topk_data(rng, shape, dtype)
    length = shape[axis]
    for k in sorted({1, length // 2, length}):
        check(
            launches,
            "TopK",
            [x, np.array([k], np.int64)],
            outputs=2,
            const=(1,),
            exact=True,
            axis=axis,
            largest=largest,
            sorted=sorted_,
        )


@pytest.mark.parametrize("length", [1, 2, 3, 31, 64, 100, 1000, 2048, 2049, 4096])
@pytest.mark.parametrize("largest", [1, 0])
def test_top_k_axis_lengths(launches, length, largest):
    """Every power-of-two padding up to the 4,096 sorted in shared memory, with more lines than one."""
    rng = np.random.default_rng(22)
    x = rng.standard_normal((3, length)).astype(np.float32)
    x[:, ::7] = 0.5  # ties across the whole line
    for k in sorted({1, max(1, length // 3), length}):
        check(launches, "TopK", [x, np.array([k], np.int64)], outputs=2, const=(1,), exact=True, largest=largest)


def test_top_k_inner_axis_many_lines(launches):
    rng = np.random.default_rng(23)
    x = _topk_data(rng, (6, 33, 70), np.float32)
    check(launches, "TopK", [x, np.array([5], np.int64)], outputs=2, const=(1,), exact=True, axis=1)


@pytest.mark.parametrize("shape,axis,k", [((0, 5), -1, 2), ((3, 0), -1, 0), ((3, 5), 1, 0), ((4, 0, 2), 0, 3)], ids=str)
def test_top_k_empty(launches, shape, axis, k):
    x = np.zeros(shape, np.float32)
    check(launches, "TopK", [x, np.array([k], np.int64)], outputs=2, const=(1,), exact=True, axis=axis)


def test_top_k_fed_k(launches):
    """K fed as a graph input (read on the host)."""
    x = _topk_data(np.random.default_rng(24), (4, 9), np.float64)
    check(launches, "TopK", [x, np.array([4], np.int64)], outputs=2, exact=True)


def test_top_k_long_axis_falls_back(launches):
    x = np.random.default_rng(25).standard_normal((2, 5000)).astype(np.float32)
    check(launches, "TopK", [x, np.array([7], np.int64)], outputs=2, const=(1,), exact=True)


def test_top_k_other_dtype_falls_back(launches):
    x = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], np.uint16)
    check(launches, "TopK", [x, np.array([3], np.int64)], outputs=2, const=(1,), exact=True)


@pytest.mark.parametrize("k,match", [(6, "out of range"), (-1, "out of range")], ids=["6", "-1"])
def test_top_k_bad_k_raises(launches, k, match):
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    check_raises(launches, "TopK", [x, np.array([k], np.int64)], match, outputs=2, const=(1,))


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
@pytest.mark.parametrize("largest", [1, 0])
def test_top_k_backward(launches, dtype, largest):
    x = np.random.default_rng(26).permutation(24).reshape(2, 3, 4).astype(dtype) / 7
    model, feeds = loss_model("TopK", [x, np.array([2], np.int64)], outputs=2, const=(1,), axis=1, largest=largest)
    backward_matches(model, feeds, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- CumProd


def _cum_prod_data(rng, shape, dtype):
    """Factors near +-1 with some zeros (floats); small integers (integers)."""
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-3, 4, shape).astype(dtype)
    x = rng.uniform(0.5, 1.6, shape) * rng.choice([-1.0, 1.0], shape)
    x[rng.random(shape) < 0.1] = 0.0
    return x.astype(np.float32).astype(dtype) if np.dtype(dtype) != np.float64 else x


@pytest.mark.parametrize("dtype", [*FLOATS, np.int32, np.int64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,axis", [((5, 8), -1), ((4, 6, 3), 1), ((7, 5), 0), ((2, 3, 4), -3), ((33,), 0)], ids=str)
@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_prod(launches, dtype, shape, axis, exclusive, reverse):
    """The CPU backend's bits: products in order, 16-bit floats in float32 rounded once."""
    x = _cum_prod_data(np.random.default_rng(27), shape, dtype)
    check(launches, "CumProd", [x, np.array(axis, np.int64)], const=(1,), exact=True, exclusive=exclusive, reverse=reverse)


@pytest.mark.parametrize("axis_dtype", [np.int32, np.int64], ids=str)
def test_cum_prod_axis_fed(launches, axis_dtype):
    """The axis fed as a graph input (read on the host), of either index type."""
    x = _cum_prod_data(np.random.default_rng(28), (3, 4, 5), np.float32)
    check(launches, "CumProd", [x, np.array([-2], axis_dtype)], exact=True, reverse=1)


@pytest.mark.parametrize("shape,axis", [((0, 5), 1), ((3, 0), 1), ((3, 0), 0), ((2, 0, 4), -1)], ids=str)
def test_cum_prod_empty(launches, shape, axis):
    check(launches, "CumProd", [np.zeros(shape, np.float32), np.array(axis, np.int64)], const=(1,), exact=True, exclusive=1)


@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=str)
def test_cum_prod_integers_wrap(launches, dtype):
    x = np.array([[1000003, 77777, -65537, 99991, 123457, 3, -7, 1 << 20]], dtype)
    check(launches, "CumProd", [x, np.array(1, np.int64)], const=(1,), exact=True)


def test_cum_prod_overflow_inf_and_nan(launches):
    x = np.array([[3e20, 3e20, 0.0, 2.0], [np.nan, 1.0, 2.0, 3.0], [np.inf, 0.0, 1.0, -1.0]], np.float32)
    check(launches, "CumProd", [x, np.array(1, np.int64)], const=(1,), exact=True)


def test_cum_prod_other_dtype_falls_back(launches):
    x = np.array([[1, 2, 3], [4, 5, 6]], np.uint8)
    check(launches, "CumProd", [x, np.array(1, np.int64)], const=(1,), exact=True)


def test_cum_prod_bad_axis_raises(launches):
    check_raises(launches, "CumProd", [np.ones((2, 3), np.float32), np.array(2, np.int64)], "out of range", const=(1,))


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_prod_backward(launches, exclusive, reverse):
    """The gradient rule's CumProd, CumSum and Where, zeros included (before, at and after a first zero)."""
    x = _cum_prod_data(np.random.default_rng(29), (3, 6), np.float64)
    x[0, 2] = x[1, 0] = x[1, 4] = 0.0
    model, feeds = loss_model("CumProd", [x, np.array(1, np.int64)], const=(1,), exclusive=exclusive, reverse=reverse)
    backward_matches(model, feeds, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- Einsum

EINSUM_CASES = [
    ("ij,jk->ik", [(2, 3), (3, 4)]),
    ("ij,kj->ik", [(2, 3), (4, 3)]),
    ("ji,jk->ki", [(3, 2), (3, 4)]),
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("bij,bkj->bki", [(2, 3, 4), (2, 5, 4)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),
    ("abc,cd->abd", [(2, 3, 4), (4, 5)]),
    ("acbd,dcb->ab", [(2, 3, 4, 5), (5, 3, 4)]),
    ("ijk,jkl->li", [(2, 3, 4), (3, 4, 5)]),
    ("ij,ij->ij", [(3, 4), (3, 4)]),
    ("ij,ij->ji", [(3, 4), (1, 4)]),
    ("i,i->", [(7,), (7,)]),
    ("i,j->ij", [(3,), (4,)]),
    ("ij,j->i", [(3, 4), (4,)]),
    ("ij,jk", [(2, 3), (3, 4)]),
    ("ijk,jl->il", [(2, 3, 4), (3, 5)]),
    ("ij,kl->", [(2, 3), (4, 5)]),
    ("ij,kl->kj", [(2, 3), (4, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 5)]),
    ("...ij,jk->...ik", [(2, 2, 3, 4), (4, 5)]),
    ("bij,bjk->ik", [(2, 3, 4), (2, 4, 5)]),
    ("ij->ji", [(3, 4)]),
    ("ijk->ki", [(2, 3, 4)]),
    ("ij->", [(3, 4)]),
    ("ij->ij", [(3, 4)]),
    ("ijk->j", [(2, 3, 4)]),
    ("...ij->...ji", [(2, 3, 4)]),
    ("ij", [(3, 4)]),
]


def _einsum_tol(dtype):
    """A 16-bit result is one rounding of float32 sums on both devices, but a label summed before the
    matmul rounds once more on the GPU."""
    return _tol(dtype, bf16=2**-5, f16=2**-8, f32=1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("equation,shapes", EINSUM_CASES, ids=[f"{e}:{s}" for e, s in EINSUM_CASES])
def test_einsum(launches, dtype, equation, shapes):
    rng = np.random.default_rng(30)
    check(launches, "Einsum", [rand(rng, s, dtype) for s in shapes], equation=equation, **_einsum_tol(dtype))


def test_einsum_constant_operand_and_transposed_layouts(launches):
    """A constant operand, and operands whose dims merge as views (no copy) or do not (a copy)."""
    rng = np.random.default_rng(31)
    a, b = rand(rng, (4, 2, 3, 5)), rand(rng, (5, 3, 6))
    check(launches, "Einsum", [a, b], const=(1,), equation="bmcj,jcn->bnm", rtol=1e-5, atol=1e-5)
    check(launches, "Einsum", [a, b], equation="mbcj,jcn->bmn", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("ij,jk->ik", [(0, 3), (3, 4)]),
        ("ij,jk->ik", [(2, 0), (0, 4)]),
        ("bij,bjk->bik", [(0, 3, 4), (1, 4, 5)]),
        ("ij->i", [(0, 3)]),
        ("ij->j", [(0, 3)]),
        ("ij,kl->", [(2, 0), (4, 5)]),
    ],
    ids=str,
)
def test_einsum_empty(launches, equation, shapes):
    rng = np.random.default_rng(32)
    check(launches, "Einsum", [rand(rng, s) for s in shapes], equation=equation)


@pytest.mark.parametrize(
    "equation,shapes,dtype",
    [
        ("ii->i", [(3, 3)], np.float32),
        ("bii,bj->bj", [(2, 3, 3), (2, 4)], np.float32),
        ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)], np.float32),
        ("ij,jk->ik", [(2, 3), (3, 4)], np.int32),
        ("ij,jk->ik", [(2, 3), (3, 4)], np.int64),
        ("ij,j->i", [(2, 3), (1,)], np.float32),
    ],
    ids=str,
)
def test_einsum_falls_back(launches, equation, shapes, dtype):
    """Diagonals, three operands, integers and a contracted label broadcast: the CPU kernel."""
    rng = np.random.default_rng(33)
    inputs = [rand(rng, s) if np.dtype(dtype).kind == "f" else rng.integers(-5, 5, s).astype(dtype) for s in shapes]
    check(launches, "Einsum", inputs, equation=equation, rtol=1e-5, atol=1e-5)


def test_einsum_bad_shapes_raise(launches):
    rng = np.random.default_rng(34)
    check_raises(
        launches,
        "Einsum",
        [rand(rng, (2, 3)), rand(rng, (4, 5))],
        "label 'j' has size 3 in input 0 and 4 in input 1",
        equation="ij,jk->ik",
    )


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
        ("ijk,jl->li", [(2, 3, 4), (3, 5)]),
        ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 5)]),
        ("ijk->ki", [(2, 3, 4)]),
    ],
    ids=str,
)
def test_einsum_backward(launches, equation, shapes):
    rng = np.random.default_rng(35)
    model, feeds = loss_model("Einsum", [rand(rng, s, np.float64) for s in shapes], equation=equation)
    backward_matches(model, feeds, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------- normalizations composed of launchers


def _composed_tol(dtype):
    """Sums in another order than numpy's, then a subtraction or a division: float32 within a few ulps."""
    return _tol(dtype, f32=1e-5)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape,axis", [((3, 4), -1), ((2, 3, 5), 1), ((2, 3, 5), 0), ((0, 4), 1), ((3, 0), -1)], ids=str)
def test_lp_normalization(launches, dtype, p, shape, axis):
    rng = np.random.default_rng(40)
    check(launches, "LpNormalization", [rand(rng, shape, dtype)], axis=axis, p=p, **_composed_tol(dtype))


def test_lp_normalization_keeps_zero_lines_and_nans(launches):
    x = np.array([[0, 0, 0], [1, np.nan, 2], [3, 4, 0], [1e-40, 0, 0]], np.float32)
    out = check(launches, "LpNormalization", [x], axis=1, p=2)["out0"]
    assert np.all(out[0] == 0) and np.all(np.isnan(out[1])) and np.all(out[3] == 0)  # 1e-40 squared underflows


def test_lp_normalization_other_p_is_refused(launches):
    check_raises(launches, "LpNormalization", [np.ones((2, 3), np.float32)], "p must be 1 or 2", p=3)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    "shape,axes", [((2, 3, 4, 5), (0, 2, 3)), ((2, 3, 4), (2,)), ((3, 4), (0, 1)), ((2, 3, 4), (-1, 0))], ids=str
)
def test_mean_variance_normalization(launches, dtype, shape, axes):
    rng = np.random.default_rng(41)
    x = rand(rng, shape, dtype, -2, 2)
    check(launches, "MeanVarianceNormalization", [x], axes=list(axes), **_composed_tol(dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape,axis", [((2, 3, 8), -1), ((2, 3, 8), 1), ((4, 5), 0), ((2, 0, 3), -1)], ids=str)
def test_rms_normalization(launches, dtype, shape, axis):
    rng = np.random.default_rng(42)
    x, scale = rand(rng, shape, dtype), rand(rng, shape[axis % len(shape) :], dtype, 0.5, 1.5)
    check(launches, "RMSNormalization", [x, scale], axis=axis, epsilon=1e-5, opset=23, **_composed_tol(dtype))


def test_rms_normalization_other_stash_types_are_refused(launches):
    rng = np.random.default_rng(43)
    x, scale = rand(rng, (2, 4)), rand(rng, (4,))
    check_raises(launches, "RMSNormalization", [x, scale], "stash_type", opset=23, stash_type=0)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 7), (2, 2, 3, 0)], ids=str)
def test_global_lp_pool(launches, dtype, p, shape):
    rng = np.random.default_rng(44)
    check(launches, "GlobalLpPool", [rand(rng, shape, dtype)], p=p, **_composed_tol(dtype))


def test_global_lp_pool_of_other_p_runs_the_cpu_kernel(launches):
    rng = np.random.default_rng(45)
    check(launches, "GlobalLpPool", [rand(rng, (2, 3, 4, 4))], p=3, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op_type", ["SoftmaxGrad", "LogSoftmaxGrad"])
@pytest.mark.parametrize("shape,axis", [((3, 4), 1), ((2, 3, 5), 1), ((2, 3, 5), 0), ((2, 3, 5), -1), ((0, 4), 1)], ids=str)
def test_coerced_softmax_gradients(launches, dtype, op_type, shape, axis):
    """Softmax before opset 13: the sums run over every axis from ``axis`` on."""
    rng = np.random.default_rng(46)
    y = rand(rng, shape, dtype, 0.05, 1) if op_type == "SoftmaxGrad" else rand(rng, shape, dtype, -3, 0)
    check(launches, op_type, [rand(rng, shape, dtype), y], domain=MS, axis=axis, **_composed_tol(dtype))


def test_coerced_softmax_gradient_shape_mismatch_raises(launches):
    rng = np.random.default_rng(47)
    check_raises(launches, "SoftmaxGrad", [rand(rng, (3, 4)), rand(rng, (4, 3))], "must", domain=MS)


@pytest.mark.parametrize(
    "op_type,shape,attrs",
    [
        ("LpNormalization", (3, 4), {"axis": 1, "p": 2}),
        ("MeanVarianceNormalization", (2, 3, 4), {"axes": [0, 2]}),
        ("RMSNormalization", (2, 3, 4), {"axis": -1, "epsilon": 1e-5, "opset": 23}),
        ("GlobalLpPool", (2, 3, 4, 4), {"p": 2}),
    ],
)
def test_composed_normalizations_backward(launches, op_type, shape, attrs):
    rng = np.random.default_rng(48)
    inputs = [rand(rng, shape, np.float64, 0.5, 1.5)]
    if op_type == "RMSNormalization":
        inputs.append(rand(rng, shape[-1:], np.float64, 0.5, 1.5))
    model, feeds = loss_model(op_type, inputs, **attrs)
    calls = launches(op_type)
    backward_matches(model, feeds, wrt=list(feeds), rtol=1e-10, atol=1e-12)
    assert calls, f"the {op_type} launcher did not run in the backward graph"


# ---------------------------------------------------------------- Swish (opset 24)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("alpha", [1.0, 0.5, -1.5])
@pytest.mark.parametrize("shape", [(3, 4), (2, 0), ()], ids=str)
def test_swish(launches, dtype, alpha, shape):
    rng = np.random.default_rng(50)
    check(launches, "Swish", [rand(rng, shape, dtype, -6, 6)], opset=24, alpha=alpha, **_composed_tol(dtype))


def test_swish_backward(launches):
    rng = np.random.default_rng(51)
    model, feeds = loss_model("Swish", [rand(rng, (3, 5), np.float64, -4, 4)], opset=24, alpha=0.7)
    calls = launches("Swish")
    backward_matches(model, feeds, wrt=list(feeds), rtol=1e-10, atol=1e-12)
    assert calls
