"""CPU kernels for convolution, pooling, normalization and losses against torch and onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from gradgen.errors import KernelError
from gradgen.executor.session import Session
from gradgen.kernels.cpu import conv as cpu_conv
from gradgen.kernels.cpu import loss as L
from gradgen.kernels.cpu import norm as cpu_norm
from gradgen.kernels.cpu import pool as cpu_pool

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(1234)


def rand(*shape, dtype=np.float64):
    return RNG.standard_normal(shape).astype(dtype)


def t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


def close(got, want, rtol=1e-10, atol=1e-10):
    want = want.detach().numpy() if hasattr(want, "detach") else np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def one_node_model(op, inputs, attrs=None, n_outputs=1, opset=21):
    """A one-node ONNX model with the given numpy inputs as graph inputs (None: omitted)."""
    names = [f"in{i}" if a is not None else "" for i, a in enumerate(inputs)]
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outs, name="the_node", **(attrs or {}))
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
        for n, a in zip(names, inputs)
        if a is not None
    ]
    graph_outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    feeds = {n: a for n, a in zip(names, inputs) if a is not None}
    return model, feeds


def ort(op, inputs, attrs=None, n_outputs=1, opset=21):
    ort_mod = pytest.importorskip("onnxruntime")
    model, feeds = one_node_model(op, inputs, attrs, n_outputs, opset)
    sess = ort_mod.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def gradgen_run(op, inputs, attrs=None, n_outputs=1, opset=21):
    model, feeds = one_node_model(op, inputs, attrs, n_outputs, opset)
    res = Session(model).run(feeds)
    return [res[f"out{i}"] for i in range(n_outputs)]


def torch_pad(x, pads):
    """ONNX pads [b1, b2, ..., e1, e2, ...] applied with F.pad (which wants last axis first)."""
    n = len(pads) // 2
    spec = []
    for axis in reversed(range(n)):
        spec += [pads[axis], pads[n + axis]]
    return F.pad(t(x), spec)


# ---------------------------------------------------------------------------------------------
# Conv

CONV_CASES = [
    # (x shape, w shape, attrs)
    ((2, 3, 11), (4, 3, 3), {}),
    ((2, 4, 13), (6, 2, 4), dict(strides=[2], dilations=[2], pads=[1, 3], group=2)),
    ((2, 3, 9, 10), (5, 3, 3, 3), dict(pads=[1, 1, 1, 1])),
    ((2, 3, 9, 10), (5, 3, 3, 2), dict(strides=[2, 3], pads=[0, 1, 2, 0])),
    ((1, 4, 12, 11), (8, 2, 3, 3), dict(dilations=[2, 1], group=2, pads=[2, 1, 0, 1])),
    ((2, 6, 8, 8), (6, 1, 3, 3), dict(group=6, pads=[1, 1, 1, 1], strides=[2, 2])),  # depthwise
    ((2, 4, 7, 7), (8, 1, 3, 3), dict(group=4)),  # depthwise, multiplier 2
    ((1, 2, 5, 6, 7), (3, 2, 2, 3, 2), dict(strides=[1, 2, 2], pads=[1, 0, 1, 0, 1, 1])),
    ((1, 4, 6, 6, 5), (4, 2, 3, 3, 3), dict(group=2, dilations=[2, 1, 1], pads=[2, 1, 1, 2, 1, 1])),
]


@pytest.mark.parametrize("xs,ws,attrs", CONV_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_matches_torch(xs, ws, attrs, bias):
    x, w = rand(*xs), rand(*ws)
    b = rand(ws[0]) if bias else None
    got = cpu_conv.conv(x, w, b, **attrs)
    n = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * n)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    want = conv(
        torch_pad(x, pads),
        t(w),
        None if b is None else t(b),
        stride=attrs.get("strides", 1),
        dilation=attrs.get("dilations", 1),
        groups=attrs.get("group", 1),
    )
    close(got, want)


def spec_auto_pads(auto_pad, spatial, kernel, strides, dilations):
    """ONNX's auto_pad rule, written out independently of the kernel."""
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        if auto_pad == "VALID":
            begin.append(0)
            end.append(0)
            continue
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin + end


AUTO_PAD_CASES = [
    ((1, 2, 7, 8), (3, 2, 3, 2), [2, 3], [1, 1]),
    ((2, 3, 10), (2, 3, 4), [3], [1]),
    ((1, 2, 9, 6), (4, 1, 2, 3), [1, 2], [2, 1]),
]


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("xs,ws,strides,dil", AUTO_PAD_CASES)
def test_conv_auto_pad_matches_torch(auto_pad, xs, ws, strides, dil):
    x, w = rand(*xs), rand(*ws)
    group = xs[1] // ws[1]
    got = cpu_conv.conv(x, w, auto_pad=auto_pad, strides=strides, dilations=dil, group=group)
    if auto_pad != "VALID":
        assert list(got.shape[2:]) == [-(-n // s) for n, s in zip(xs[2:], strides)]
    pads = spec_auto_pads(auto_pad, xs[2:], ws[2:], strides, dil)
    conv = {1: F.conv1d, 2: F.conv2d}[x.ndim - 2]
    close(got, conv(torch_pad(x, pads), t(w), stride=strides, dilation=dil, groups=group))


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize("xs,ws,strides,dil", [c for c in AUTO_PAD_CASES if max(c[3]) == 1])
def test_conv_auto_pad_matches_onnxruntime(auto_pad, xs, ws, strides, dil):
    x, w = rand(*xs, dtype=np.float32), rand(*ws, dtype=np.float32)
    attrs = dict(auto_pad=auto_pad, strides=strides, dilations=dil, group=xs[1] // ws[1])
    got = cpu_conv.conv(x, w, **attrs)
    (want,) = ort("Conv", [x, w], attrs)
    assert got.dtype == np.float32
    close(got, want, rtol=1e-5, atol=1e-5)


def test_conv_float32_stays_float32_and_is_fast():
    import time

    x = rand(32, 3, 32, 32, dtype=np.float32)
    w = rand(16, 3, 3, 3, dtype=np.float32)
    b = rand(16, dtype=np.float32)
    start = time.perf_counter()
    y = cpu_conv.conv(x, w, b, pads=[1, 1, 1, 1])
    assert time.perf_counter() - start < 1.0
    assert y.dtype == np.float32 and y.shape == (32, 16, 32, 32)
    want = F.conv2d(t(x).double(), t(w).double(), t(b).double(), padding=1)
    close(y, want, rtol=1e-4, atol=1e-4)


def test_conv_float16():
    x, w = rand(1, 2, 5, 5, dtype=np.float16), rand(3, 2, 3, 3, dtype=np.float16)
    y = cpu_conv.conv(x, w)
    assert y.dtype == np.float16
    want = F.conv2d(t(x.astype(np.float64)), t(w.astype(np.float64)))
    close(y.astype(np.float64), want, rtol=1e-2, atol=1e-2)


def test_conv_bad_group():
    with pytest.raises(KernelError, match="group"):
        cpu_conv.conv(rand(1, 4, 5, 5), rand(2, 3, 3, 3), group=2)


# ---------------------------------------------------------------------------------------------
# ConvTranspose

CONVT_CASES = [
    ((2, 3, 5), (3, 2, 3), dict()),
    ((2, 4, 5), (4, 3, 3), dict(strides=[2], pads=[1, 1], output_padding=[1], group=2)),
    ((1, 2, 4, 5), (2, 3, 3, 3), dict(strides=[2, 2])),
    ((2, 4, 4, 3), (4, 1, 3, 2), dict(strides=[3, 2], dilations=[2, 1], pads=[1, 0, 1, 0], group=2, output_padding=[2, 1])),
    ((1, 3, 3, 4), (3, 2, 2, 2), dict(dilations=[2, 2], pads=[1, 1, 1, 1])),
    ((1, 2, 3, 3, 3), (2, 2, 2, 3, 2), dict(strides=[2, 1, 2], pads=[0, 1, 0, 0, 1, 0])),
    # one input channel per group (a depthwise Conv's data gradient): products of one term
    ((2, 6, 5, 5), (6, 1, 3, 3), dict(group=6, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])),
    ((2, 3, 4, 4), (3, 2, 3, 3), dict(group=3)),  # multiplier 2
]


@pytest.mark.parametrize("xs,ws,attrs", CONVT_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_conv_transpose_matches_torch(xs, ws, attrs, bias):
    x, w = rand(*xs), rand(*ws)
    group = attrs.get("group", 1)
    b = rand(ws[1] * group) if bias else None
    got = cpu_conv.conv_transpose(x, w, b, **attrs)
    n = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * n)
    assert pads[:n] == pads[n:]  # torch only has symmetric padding
    fn = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[n]
    want = fn(
        t(x),
        t(w),
        None if b is None else t(b),
        stride=attrs.get("strides", 1),
        padding=pads[:n],
        output_padding=attrs.get("output_padding", 0),
        groups=group,
        dilation=attrs.get("dilations", 1),
    )
    close(got, want)


@pytest.mark.parametrize(
    "attrs",
    [
        dict(strides=[3, 2], output_shape=[10, 8]),
        dict(strides=[3, 2], output_shape=[9, 6]),
        dict(strides=[2, 2], auto_pad="SAME_UPPER"),
        dict(strides=[2, 2], auto_pad="SAME_LOWER"),
        dict(strides=[2, 1], pads=[0, 1, 2, 0]),  # asymmetric
        dict(strides=[2, 2], auto_pad="VALID", output_padding=[1, 0]),
    ],
)
def test_conv_transpose_matches_onnxruntime(attrs):
    x, w = rand(1, 2, 3, 3, dtype=np.float32), rand(2, 2, 3, 3, dtype=np.float32)
    b = rand(2, dtype=np.float32)
    got = cpu_conv.conv_transpose(x, w, b, **attrs)
    (want,) = ort("ConvTranspose", [x, w, b], attrs)
    assert got.dtype == np.float32
    close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# pooling


def onnx_indices_from_torch(idx, x_shape):
    """torch's max-pool indices are per (n, c) plane; ONNX's index the whole tensor."""
    n, c = x_shape[:2]
    plane = int(np.prod(x_shape[2:]))
    offset = (np.arange(n)[:, None] * c + np.arange(c)[None, :]) * plane
    return idx.numpy() + offset.reshape((n, c) + (1,) * (idx.ndim - 2))


@pytest.mark.parametrize(
    "xs,attrs",
    [
        ((2, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 1])),
        ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 2])),
        ((2, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1)),
        ((1, 2, 10, 9), dict(kernel_shape=[2, 3], dilations=[2, 2], strides=[1, 2], ceil_mode=1)),
        ((1, 2, 6, 7, 5), dict(kernel_shape=[2, 2, 2], strides=[2, 2, 1], pads=[1, 0, 1, 1, 0, 1])),
    ],
)
def test_max_pool_matches_torch(xs, attrs):
    x = rand(*xs)
    y, idx = cpu_pool.max_pool(x, **attrs, _num_outputs=2)
    n = x.ndim - 2
    fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
    pads = attrs.get("pads", [0] * 2 * n)
    want, want_idx = fn(
        t(x),
        attrs["kernel_shape"],
        stride=attrs.get("strides"),
        padding=pads[:n],
        dilation=attrs.get("dilations", 1),
        ceil_mode=bool(attrs.get("ceil_mode", 0)),
        return_indices=True,
    )
    close(y, want)
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(idx, onnx_indices_from_torch(want_idx, x.shape))
    assert y.dtype == x.dtype


@pytest.mark.parametrize(
    "attrs",
    [
        dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
        dict(kernel_shape=[2, 3], auto_pad="SAME_LOWER", strides=[2, 1]),
        dict(kernel_shape=[3, 2], auto_pad="VALID", strides=[2, 2]),
        dict(kernel_shape=[3, 3], pads=[0, 1, 2, 1], strides=[2, 2], storage_order=1),
        dict(kernel_shape=[2, 2], pads=[1, 0, 0, 1], ceil_mode=1, strides=[2, 2], storage_order=1),
    ],
)
def test_max_pool_matches_onnxruntime(attrs):
    x = rand(2, 3, 7, 8, dtype=np.float32)
    y, idx = cpu_pool.max_pool(x, **attrs, _num_outputs=2)
    want, want_idx = ort("MaxPool", [x], attrs, n_outputs=2)
    close(y, want, rtol=0, atol=0)
    np.testing.assert_array_equal(idx, want_idx)


def test_max_pool_int8():
    x = RNG.integers(-128, 127, size=(1, 2, 5, 5)).astype(np.int8)
    y = cpu_pool.max_pool(x, kernel_shape=[2, 2], pads=[1, 1, 1, 1])
    assert y.dtype == np.int8
    want = F.max_pool2d(t(x.astype(np.float64)), 2, stride=1, padding=1)
    close(y.astype(np.float64), want)


@pytest.mark.parametrize(
    "xs,attrs",
    [
        ((2, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 1], count_include_pad=1)),
        ((2, 3, 10), dict(kernel_shape=[3], strides=[2], pads=[1, 1], count_include_pad=0)),
        ((2, 3, 9, 8), dict(kernel_shape=[3, 2], strides=[2, 2])),
        ((2, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1)),
        ((2, 2, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=0)),
        ((1, 2, 6, 7, 5), dict(kernel_shape=[2, 3, 2], strides=[2, 2, 1], pads=[1, 1, 0, 1, 1, 0])),
    ],
)
def test_average_pool_matches_torch(xs, attrs):
    x = rand(*xs)
    y = cpu_pool.average_pool(x, **attrs)
    n = x.ndim - 2
    fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[n]
    pads = attrs.get("pads", [0] * 2 * n)
    want = fn(
        t(x),
        attrs["kernel_shape"],
        stride=attrs.get("strides"),
        padding=pads[:n],
        ceil_mode=bool(attrs.get("ceil_mode", 0)),
        count_include_pad=bool(attrs.get("count_include_pad", 0)),
    )
    close(y, want)


@pytest.mark.parametrize(
    "attrs",
    [
        dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2]),
        dict(kernel_shape=[3, 2], auto_pad="SAME_LOWER", strides=[1, 2], count_include_pad=1),
        dict(kernel_shape=[3, 3], auto_pad="VALID", strides=[2, 2]),
        dict(kernel_shape=[3, 3], pads=[0, 1, 2, 1], count_include_pad=1),
        dict(kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1], count_include_pad=0),
    ],
)
def test_average_pool_matches_onnxruntime(attrs):
    x = rand(2, 3, 7, 8, dtype=np.float32)
    y = cpu_pool.average_pool(x, **attrs)
    (want,) = ort("AveragePool", [x], attrs)
    assert y.dtype == np.float32
    close(y, want, rtol=1e-5, atol=1e-6)


def test_global_pools():
    x = rand(2, 3, 4, 5, dtype=np.float32)
    avg, mx = cpu_pool.global_average_pool(x), cpu_pool.global_max_pool(x)
    assert avg.dtype == mx.dtype == np.float32 and avg.shape == mx.shape == (2, 3, 1, 1)
    close(avg, x.mean(axis=(2, 3), keepdims=True), rtol=1e-6, atol=1e-6)
    close(mx, x.max(axis=(2, 3), keepdims=True))


# ---------------------------------------------------------------------------------------------
# normalization


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 5), (2, 3, 4, 5)])
def test_batch_norm_inference_and_training(shape):
    x = rand(*shape)
    c = shape[1]
    scale, bias, mean, var = rand(c), rand(c), rand(c), np.abs(rand(c)) + 0.5
    y = cpu_norm.batch_normalization(x, scale, bias, mean, var, epsilon=1e-3)
    close(y, F.batch_norm(t(x), t(mean), t(var), t(scale), t(bias), training=False, eps=1e-3))
    y, rm, rv = cpu_norm.batch_normalization(
        x, scale, bias, mean, var, epsilon=1e-3, momentum=0.8, training_mode=1, _num_outputs=3
    )
    close(y, F.batch_norm(t(x), None, None, t(scale), t(bias), training=True, eps=1e-3))
    axes = (0,) + tuple(range(2, x.ndim))
    close(rm, 0.8 * mean + 0.2 * x.mean(axis=axes))
    close(rv, 0.8 * var + 0.2 * x.var(axis=axes))  # ONNX: biased batch variance


@pytest.mark.parametrize("shape,axis", [((3, 4, 5), -1), ((3, 4, 5), 1), ((2, 3, 4, 5), -2), ((6, 7), 0)])
def test_layer_norm_matches_torch(shape, axis):
    x = rand(*shape)
    ax = axis % x.ndim
    norm_shape = shape[ax:]
    scale, bias = rand(*norm_shape), rand(*norm_shape)
    y, mean, inv_std = cpu_norm.layer_normalization(x, scale, bias, axis=axis, epsilon=1e-4)
    close(y, F.layer_norm(t(x), norm_shape, t(scale), t(bias), eps=1e-4))
    axes = tuple(range(ax, x.ndim))
    assert mean.dtype == inv_std.dtype == np.float32  # the schema's stash type, double inputs too
    close(mean, x.mean(axis=axes, keepdims=True), rtol=1e-6, atol=1e-7)
    close(inv_std, 1 / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-4), rtol=1e-6, atol=1e-7)
    y2 = cpu_norm.layer_normalization(x, scale, None, axis=axis, epsilon=1e-4)[0]
    close(y2, F.layer_norm(t(x), norm_shape, t(scale), None, eps=1e-4))


def test_layer_norm_float16_stashes_float32():
    x = rand(2, 8, dtype=np.float16)
    y, mean, inv_std = cpu_norm.layer_normalization(x, np.ones(8, np.float16), np.zeros(8, np.float16))
    assert y.dtype == np.float16 and mean.dtype == inv_std.dtype == np.float32
    y32 = cpu_norm.layer_normalization(x, np.ones(8, np.float16), np.zeros(8, np.float16), axis=-1)[0]
    close(y32.astype(np.float64), F.layer_norm(t(x.astype(np.float64)), (8,)), rtol=1e-2, atol=5e-3)


def test_instance_norm_matches_torch():
    x = rand(2, 3, 4, 5)
    scale, bias = rand(3), rand(3)
    close(
        cpu_norm.instance_normalization(x, scale, bias, epsilon=1e-3),
        F.instance_norm(t(x), weight=t(scale), bias=t(bias), eps=1e-3),
    )


@pytest.mark.parametrize("groups", [1, 2, 3, 6])
def test_group_norm_both_forms(groups):
    x = rand(2, 6, 4, 3)
    scale, bias = rand(6), rand(6)
    # opset 21 form: per-channel scale/bias
    close(
        cpu_norm.group_normalization(x, scale, bias, num_groups=groups, epsilon=1e-3),
        F.group_norm(t(x), groups, t(scale), t(bias), eps=1e-3),
    )
    # opset 18 form: per-group scale/bias
    gs, gb = rand(groups), rand(groups)
    rep = 6 // groups
    close(
        cpu_norm.group_normalization(x, gs, gb, num_groups=groups, epsilon=1e-3),
        F.group_norm(t(x), groups, t(np.repeat(gs, rep)), t(np.repeat(gb, rep)), eps=1e-3),
    )


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_normalization(p, axis):
    x = rand(3, 4, 5)
    x[0, 0, :] = 0.0
    x[:, 0, 0] = 0.0
    x[0, :, 0] = 0.0
    close(cpu_norm.lp_normalization(x, axis=axis, p=p), F.normalize(t(x), p=p, dim=axis, eps=0.0).nan_to_num(0.0))


@pytest.mark.parametrize("size", [3, 5])
def test_lrn_matches_torch(size):
    x = rand(2, 7, 3, 4)
    y = cpu_norm.lrn(x, size=size, alpha=0.02, beta=0.6, bias=1.5)
    close(y, F.local_response_norm(t(x), size, alpha=0.02, beta=0.6, k=1.5))


@pytest.mark.parametrize("size", [2, 4])
def test_lrn_even_size_matches_spec_loop(size):
    # ONNX sums channels [c - floor((size-1)/2), c + ceil((size-1)/2)] (torch and onnxruntime
    # only agree with it for odd sizes).
    x = rand(2, 7, 3, 4)
    y = cpu_norm.lrn(x, size=size, alpha=0.02, beta=0.6, bias=1.5)
    want = np.empty_like(x)
    for c in range(7):
        lo, hi = max(0, c - (size - 1) // 2), min(6, c + -(-(size - 1) // 2))
        sq = (x[:, lo : hi + 1] ** 2).sum(axis=1)
        want[:, c] = x[:, c] / (1.5 + 0.02 / size * sq) ** 0.6
    close(y, want)


# ---------------------------------------------------------------------------------------------
# losses


LOSS_CASES = [
    ((5, 4), None, None),
    ((5, 4), 2, None),
    ((5, 4), -1, True),
    ((3, 4, 6), 1, True),
    ((2, 3, 4, 5), None, True),
    ((2, 3, 4, 5), 0, None),
]


def make_labels(shape, ignore_index):
    n, c = shape[0], shape[1]
    labels = RNG.integers(0, c, size=(n,) + shape[2:]).astype(np.int64)
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index
    return labels


@pytest.mark.parametrize("shape,ignore_index,weighted", LOSS_CASES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_softmax_cross_entropy_matches_torch(shape, ignore_index, weighted, reduction):
    scores = rand(*shape)
    labels = make_labels(shape, ignore_index)
    weights = np.abs(rand(shape[1])) + 0.1 if weighted else None
    loss, log_prob = L.softmax_cross_entropy_loss(
        scores, labels, weights, ignore_index=ignore_index, reduction=reduction, _num_outputs=2
    )
    want = F.cross_entropy(
        t(scores),
        t(labels),
        weight=None if weights is None else t(weights),
        ignore_index=-100 if ignore_index is None else ignore_index,
        reduction=reduction,
    )
    close(loss, want)
    close(log_prob, F.log_softmax(t(scores), dim=1))


@pytest.mark.parametrize("shape,ignore_index,weighted", LOSS_CASES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_nll_loss_matches_torch(shape, ignore_index, weighted, reduction):
    inp = rand(*shape)
    labels = make_labels(shape, ignore_index)
    weights = np.abs(rand(shape[1])) + 0.1 if weighted else None
    got = L.negative_log_likelihood_loss(inp, labels, weights, ignore_index=ignore_index, reduction=reduction)
    want = F.nll_loss(
        t(inp),
        t(labels),
        weight=None if weights is None else t(weights),
        ignore_index=-100 if ignore_index is None else ignore_index,
        reduction=reduction,
    )
    close(got, want)


def test_losses_keep_float32():
    scores = rand(4, 3, dtype=np.float32)
    labels = np.array([0, 2, 1, 1], dtype=np.int32)
    loss, log_prob = L.softmax_cross_entropy_loss(scores, labels, _num_outputs=2)
    assert loss.dtype == log_prob.dtype == np.float32 and loss.shape == ()
    assert L.negative_log_likelihood_loss(log_prob, labels, reduction="none").dtype == np.float32
    assert L.softmax_cross_entropy_loss(scores, labels).dtype == np.float32


@pytest.mark.parametrize("bad", [3, -1, 7])
def test_loss_label_out_of_range(bad):
    scores = rand(4, 3)
    labels = np.array([0, bad, 1, 1])
    with pytest.raises(KernelError, match=rf"target value {bad} at position \[1\].*\[0, 2\]"):
        L.softmax_cross_entropy_loss(scores, labels)
    with pytest.raises(KernelError, match=rf"target value {bad}"):
        L.negative_log_likelihood_loss(scores, labels, reduction="none")
    # ...unless it is the ignore_index
    out = L.negative_log_likelihood_loss(scores, labels, ignore_index=bad, reduction="none")
    assert out[1] == 0.0


# ---------------------------------------------------------------------------------------------
# through the executor


def test_executor_conv_and_maxpool_with_indices():
    x, w, b = rand(1, 2, 6, 6, dtype=np.float32), rand(4, 1, 3, 3, dtype=np.float32), rand(4, dtype=np.float32)
    attrs = dict(group=2, strides=[2, 1], pads=[1, 0, 1, 2])
    (y,) = gradgen_run("Conv", [x, w, b], attrs)
    (want,) = ort("Conv", [x, w, b], attrs)
    assert y.dtype == np.float32
    close(y, want, rtol=1e-5, atol=1e-5)
    attrs = dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    y, idx = gradgen_run("MaxPool", [x], attrs, n_outputs=2)
    want, want_idx = ort("MaxPool", [x], attrs, n_outputs=2)
    close(y, want, rtol=0, atol=0)
    np.testing.assert_array_equal(idx, want_idx)


def test_executor_softmax_cross_entropy_two_outputs():
    scores = rand(3, 5, 2, dtype=np.float32)
    labels = np.array([[0, 4], [1, 2], [2, 3]], dtype=np.int64)
    weights = np.abs(rand(5, dtype=np.float32))
    attrs = dict(reduction="mean", ignore_index=2)
    got = gradgen_run("SoftmaxCrossEntropyLoss", [scores, labels, weights], attrs, n_outputs=2, opset=13)
    want = ort("SoftmaxCrossEntropyLoss", [scores, labels, weights], attrs, n_outputs=2, opset=13)
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        close(g, w, rtol=1e-5, atol=1e-6)


def test_executor_layer_norm_optional_outputs():
    x = rand(2, 3, 4, dtype=np.float32)
    s, b = rand(3, 4, dtype=np.float32), rand(3, 4, dtype=np.float32)
    got = gradgen_run("LayerNormalization", [x, s, b], dict(axis=1), n_outputs=3, opset=17)
    want = ort("LayerNormalization", [x, s, b], dict(axis=1), n_outputs=3, opset=17)
    for g, w in zip(got, want):
        close(g, w, rtol=1e-5, atol=1e-5)


def test_executor_bad_label_names_node():
    scores = rand(2, 3, dtype=np.float32)
    labels = np.array([0, 5], dtype=np.int64)
    with pytest.raises(KernelError, match=r"node 'the_node' \(NegativeLogLikelihoodLoss\).*target value 5"):
        gradgen_run("NegativeLogLikelihoodLoss", [scores, labels], opset=13)


# ---------------------------------------------------------------------------------------------
# smaller ops: RMSNormalization, MeanVarianceNormalization, LpPool, MaxUnpool


@pytest.mark.parametrize("axis", [-1, 1])
def test_rms_norm_matches_torch(axis):
    x = rand(2, 3, 4)
    shape = x.shape[axis % 3 :]
    scale = rand(*shape)
    y = cpu_norm.rms_normalization(x, scale, axis=axis, epsilon=1e-4)
    close(y, F.rms_norm(t(x), shape, t(scale), eps=1e-4))
    assert cpu_norm.rms_normalization(x.astype(np.float32), scale.astype(np.float32)).dtype == np.float32


def test_mean_variance_normalization():
    x = rand(2, 3, 4, 5)
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    close(cpu_norm.mean_variance_normalization(x), (x - mean) / (x.std(axis=(0, 2, 3), keepdims=True) + 1e-9), rtol=1e-8)
    close(
        cpu_norm.mean_variance_normalization(x, axes=[1]),
        (x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-9),
        rtol=1e-8,
    )


def test_mean_variance_normalization_of_close_and_equal_values():
    """The variance as the mean of squared deviations: float32 values 0.004 apart near -1.75 are
    +-1 as in float64 and ONNX Runtime (E[X^2] - E[X]^2 gave +-1.025), and a constant line is
    finite (the subtraction came out negative, and its square root NaN, on one line in seven)."""
    close_values = np.array([[-1.7494470293804403], [-1.745701672647653]], np.float32)
    (want,) = ort("MeanVarianceNormalization", [close_values], {"axes": [0]}, opset=13)
    got = cpu_norm.mean_variance_normalization(close_values, axes=[0])
    close(got, want, rtol=1e-5, atol=1e-6)
    close(got, cpu_norm.mean_variance_normalization(close_values.astype(np.float64), axes=[0]), rtol=1e-5, atol=1e-6)
    lines = np.repeat(np.random.default_rng(0).standard_normal((1, 500)).astype(np.float32), 3, axis=0)
    assert np.isfinite(cpu_norm.mean_variance_normalization(lines, axes=[0])).all()


@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_matches_torch(p):
    x = rand(2, 3, 7, 8)
    y = cpu_pool.lp_pool(x, kernel_shape=[3, 2], strides=[2, 2], p=p)
    close(y, F.lp_pool2d(t(x).abs(), p, (3, 2), stride=(2, 2)), rtol=1e-8, atol=1e-10)


def test_lp_pool_with_pads_matches_onnxruntime():
    x = rand(1, 2, 5, 6, dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], p=2, strides=[2, 2])
    (want,) = ort("LpPool", [x], attrs, opset=18)
    close(cpu_pool.lp_pool(x, **attrs), want, rtol=1e-5, atol=1e-6)


def test_max_unpool_inverts_max_pool_like_torch():
    x = rand(2, 3, 6, 8)
    y, idx = cpu_pool.max_pool(x, kernel_shape=[2, 2], strides=[2, 2], _num_outputs=2)
    got = cpu_pool.max_unpool(y, idx, kernel_shape=[2, 2], strides=[2, 2])
    assert got.shape == (2, 3, 6, 8)
    ty, tidx = F.max_pool2d(t(x), 2, return_indices=True)
    close(got, F.max_unpool2d(ty, tidx, 2))
    # output_shape only adds room after the inferred shape; indices keep addressing the inferred
    # layout (as ONNX's test_maxunpool_export_with_output_shape expects)
    bigger = cpu_pool.max_unpool(y, idx, np.array([2, 3, 7, 9]), kernel_shape=[2, 2], strides=[2, 2])
    close(bigger[:, :, :6, :8], got)
    assert not bigger[:, :, 6].any() and not bigger[..., 8].any()


def test_class_probabilities_as_targets_name_the_contract():
    """PyTorch's exporters write cross_entropy with probability targets as a SoftmaxCrossEntropyLoss
    reading float labels of the scores' shape (an invalid model): the error says the labels must be
    class indices, not that [5, 4] does not match [5, 4]."""
    scores = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    with pytest.raises(KernelError, match=r"integer class indices \(int32 / int64\), got float32 of shape \[5, 4\]"):
        L.softmax_cross_entropy_loss(scores, np.full((5, 4), 0.25, np.float32))
