"""gradgen.kernels.cpu.onednn_conv: grouped float32 Conv and ConvTranspose through oneDNN.

Each plan is checked against gradgen's own kernels (float64 references would say the same: the
kernels are checked against them elsewhere), over random geometries; the prepared steps must give
the same bits on every run (the first included), fall back where oneDNN does not apply, and the
gradients of a depthwise network must match PyTorch's.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.executor import Session
from gradgen.kernels.cpu import blas, onednn_conv
from gradgen.kernels.cpu.conv import conv, conv_grad, conv_transpose
from gradgen.ops.conv import conv_geometry, conv_transpose_geometry
from gradgen.ops.pool import spatial_geometry

pytestmark = pytest.mark.skipif(not blas.available(), reason="oneDNN is not installed or this CPU lacks AVX2")


def _close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6 * max(1.0, float(np.abs(want).max())))


def _random_geometry(rng, transpose: bool):
    """A grouped 2-D geometry of the kinds oneDNN has JIT kernels for on AVX2: depthwise (one
    channel per group) or eight channels per group, any strides, dilations and pads."""
    group = int(rng.choice([2, 3, 4, 16]))
    cg, mg = (1, 1) if rng.random() < 0.7 else (8, 8)
    attrs = {
        "group": group,
        "strides": [int(v) for v in rng.integers(1, 3, 2)],
        "dilations": [int(v) for v in rng.integers(1, 3, 2)],
        "pads": [int(v) for v in rng.integers(0, 3, 4)],
    }
    kernel = [int(v) for v in rng.integers(1, 4, 2)]
    x = rng.standard_normal((int(rng.integers(1, 3)), group * cg, *rng.integers(5, 12, 2))).astype(np.float32)
    w_shape = (group * cg, mg, *kernel) if transpose else (group * mg, cg, *kernel)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(group * mg).astype(np.float32) if rng.random() < 0.5 else None
    if transpose:
        attrs["output_padding"] = [int(rng.integers(0, min(s, d))) for s, d in zip(attrs["strides"], attrs["dilations"])]
    return x, w, b, attrs


def _plan(x, w, b, attrs, transpose: bool):
    ns = x.ndim - 2
    if transpose:
        geometry = {"auto_pad": "NOTSET", "output_shape": None, **attrs}
        _, begin, out = conv_transpose_geometry(x.shape, w.shape, geometry)
        return onednn_conv.plan_conv_transpose(
            x.shape, w.shape, attrs["group"], attrs["strides"], attrs["dilations"], begin, out, b is not None
        )
    _, s, d, begin, end, out = spatial_geometry(
        x.shape, w.shape[2:], attrs["strides"], attrs["dilations"], attrs["pads"], "NOTSET"
    )
    assert len(s) == ns
    return onednn_conv.plan_conv(x.shape, w.shape, attrs["group"], s, d, begin, end, out, b is not None)


@pytest.mark.parametrize("transpose", [False, True], ids=["Conv", "ConvTranspose"])
def test_plans_match_the_kernels_over_random_geometries(transpose):
    rng = np.random.default_rng(7 + transpose)
    planned = 0
    for _ in range(60):
        x, w, b, attrs = _random_geometry(rng, transpose)
        kernel = conv_transpose if transpose else conv
        want = kernel(x, w, b, **attrs)
        plan = _plan(x, w, b, attrs, transpose)
        if plan is None:  # a geometry oneDNN runs with its reference code or its own im2col
            continue
        planned += 1
        assert not plan.implementation.startswith("ref") and "gemm" not in plan.implementation
        _close(plan(x, w, b), want)
        _close(plan(x, w, b), want)  # the plan again, with new buffers
    assert planned >= 10  # many grouped 2-D geometries have a JIT kernel on an AVX2 CPU


@pytest.mark.parametrize("wanted", [(True, True, True), (True, False, True), (False, True, False)], ids=["all", "dx-db", "dw"])
def test_conv_grad_plans_match_the_kernel_over_random_geometries(wanted):
    rng = np.random.default_rng(11 + sum(wanted))
    by_onednn = [0, 0]  # dX and dW computed by oneDNN
    for _ in range(80):
        x, w, _, attrs = _random_geometry(rng, transpose=False)
        begin, end, strides, dilations, y_shape = conv_geometry(x.shape, w.shape, **attrs)
        if min(y_shape) <= 0:
            continue
        dy = rng.standard_normal(y_shape).astype(np.float32)
        want = conv_grad(dy, x, w, _wanted=wanted, _num_outputs=3, **attrs)
        plan = onednn_conv.plan_conv_grad(x.shape, w.shape, attrs["group"], strides, dilations, begin, end, y_shape[2:], wanted)
        if plan is None:
            continue
        got = plan(dy, x, w)
        assert len(got) == 3
        computed = (*(w and not missing for w, missing in zip(wanted, plan.missing)), True)  # dB: always, as the kernel
        for g, want_one, is_computed in zip(got, want, computed):
            if is_computed:
                _close(g, want_one)
            else:  # not wanted, or left to gradgen's path by the caller
                assert g is None
        by_onednn = [count + bool(c) for count, c in zip(by_onednn, computed)]
    assert all(count >= 2 for count, w in zip(by_onednn, wanted) if w)


def test_depthwise_kernels_are_taken_and_a_dense_conv_is_not():
    x_shape, w_shape = (2, 32, 8, 8), (32, 1, 3, 3)
    plan = onednn_conv.plan_conv(x_shape, w_shape, 32, [1, 1], [1, 1], [1, 1], [1, 1], [8, 8], False)
    assert plan is not None and "dw" in plan.implementation
    assert onednn_conv.plan_conv(x_shape, (32, 32, 3, 3), 1, [1, 1], [1, 1], [1, 1], [1, 1], [8, 8], False) is None
    # output_padding 2 beyond an end pad of 0 (output 11 from 3 at stride 3): a negative pad for oneDNN
    assert onednn_conv.plan_conv_transpose((1, 4, 3, 3), (4, 1, 3, 3), 4, [3, 3], [1, 1], [0, 0], [11, 11], False) is None


def _grouped_model(op: str, x_shape, w: np.ndarray, b: np.ndarray | None, attrs: dict, dtype=TensorProto.FLOAT):
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    node = helper.make_node(op, inputs, ["y"], **attrs)
    initializers = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else [])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", dtype, x_shape)],
        [helper.make_tensor_value_info("y", dtype, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_a_prepared_grouped_step_gives_the_same_bits_from_its_first_run(op):
    """The first run with a shape runs the kernel for its checks and then oneDNN's plan, whose
    result it returns: every run of the step gives the same bits."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 1, 3, 3)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    attrs = {"group": 16, "strides": [2, 2], "pads": [1, 1, 1, 1]}
    if op == "ConvTranspose":
        attrs["output_padding"] = [1, 1]
    x = rng.standard_normal((2, 16, 9, 9)).astype(np.float32)
    with Session(_grouped_model(op, [None, 16, None, None], w, b, attrs)) as session:
        runs = [session.run({"x": x})["y"] for _ in range(3)]
    kernel = conv_transpose if op == "ConvTranspose" else conv
    _close(runs[0], kernel(x, w, b, **attrs))
    assert runs[0].tobytes() == runs[1].tobytes() == runs[2].tobytes()


def test_no_plan_without_onednn_and_none_for_float64(monkeypatch):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 1, 3, 3))
    attrs = {"group": 8, "pads": [1, 1, 1, 1]}
    x = rng.standard_normal((1, 8, 6, 6))
    with Session(_grouped_model("Conv", [1, 8, 6, 6], w, None, attrs, TensorProto.DOUBLE)) as session:
        got = [session.run({"x": x})["y"] for _ in range(2)]  # float64: gradgen's own path, its bits
    assert got[1].tobytes() == conv(x, w, **attrs).tobytes()
    monkeypatch.setattr(blas, "_sgemm", False)  # as in a forked child, or with GRADGEN_CPU_GEMM=numpy
    assert onednn_conv.plan_conv((1, 8, 6, 6), (8, 1, 3, 3), 8, [1, 1], [1, 1], [1, 1], [1, 1], [6, 6], False) is None


def test_one_plan_run_from_several_threads():
    x_shape, w_shape = (2, 24, 10, 10), (24, 1, 3, 3)
    plan = onednn_conv.plan_conv(x_shape, w_shape, 24, [1, 1], [1, 1], [1, 1], [1, 1], [10, 10], False)
    rng = np.random.default_rng(5)
    cases = [(rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(w_shape).astype(np.float32)) for _ in range(4)]
    wanted = [conv(x, w, group=24, pads=[1, 1, 1, 1]) for x, w in cases]
    failures: list = []

    def work(i: int) -> None:
        for _ in range(20):
            try:
                _close(plan(*cases[i]), wanted[i])
            except AssertionError as exc:  # reported by the main thread
                failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


@pytest.mark.parametrize("portable", [True, False], ids=["portable", "default"])
def test_depthwise_network_gradients_match_pytorch(portable, monkeypatch):
    """A MobileNet-style block (depthwise and pointwise convolutions): its depthwise Conv runs
    through oneDNN, and so does its gradient (the default graph's ConvGrad; the portable graph's
    grouped ConvTranspose)."""
    torch = pytest.importorskip("torch")
    implementations: list = []
    for name in ("plan_conv", "plan_conv_grad", "plan_conv_transpose"):

        def recorded(*args, _plan=getattr(onednn_conv, name), _name=name):
            plan = _plan(*args)
            implementations.append((_name, plan and plan.implementation))
            return plan

        monkeypatch.setattr(onednn_conv, name, recorded)
    import gradgen
    from gradgen.bench.models import legacy_export

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 8, 1),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 5),
    )

    class WithLoss(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, labels):
            return torch.nn.functional.cross_entropy(self.net(x), labels)

    model = WithLoss()
    x, labels = torch.randn(2, 3, 8, 8), torch.tensor([1, 4])
    proto = legacy_export(model, (x, labels), ["x", "labels"])
    names = [n for n, _ in model.named_parameters()]
    built = gradgen.build_backward(proto, wrt=names, portable=portable)
    with Session(built.model) as session:
        results = [session.run({"x": x.numpy(), "labels": labels.numpy()}) for _ in range(2)]
    model.zero_grad()
    model(x, labels).backward()
    for name, parameter in model.named_parameters():
        got = results[1][f"{name}_grad"]
        assert got.tobytes() == results[0][f"{name}_grad"].tobytes()
        want = parameter.grad.numpy()
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max())), err_msg=name)
    backward = "plan_conv_transpose" if portable else "plan_conv_grad"
    assert {name for name, implementation in implementations if implementation} >= {"plan_conv", backward}


def test_a_conv_grad_part_that_onednn_refuses_is_the_kernels():
    """On a 2 x 2 image oneDNN has a JIT kernel for a depthwise dX but would compute dW with its
    own im2col: dW then comes from gradgen's kernel, in the same prepared step."""
    from gradgen.kernels import registry

    attrs = {"group": 64, "pads": [1, 1, 1, 1], "kernel_shape": [3, 3], "_num_outputs": 3, "_wanted": (True, True, True)}
    rng = np.random.default_rng(9)
    dy, x = (rng.standard_normal((2, 64, 2, 2)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((64, 1, 3, 3)).astype(np.float32)
    begin, end, strides, dilations, y_shape = conv_geometry(x.shape, w.shape, group=64, pads=[1, 1, 1, 1])
    plan = onednn_conv.plan_conv_grad(x.shape, w.shape, 64, strides, dilations, begin, end, y_shape[2:], (True, True, True))
    assert plan is not None and plan.missing == (False, True)
    step = registry.lookup("com.microsoft", "ConvGrad").cpu_prepare((), dict(attrs))
    runs = [step(dy, x, w) for _ in range(3)]
    want = conv_grad(dy, x, w, **attrs)
    for got in runs:
        assert [g.tobytes() for g in got] == [g.tobytes() for g in runs[0]]
    for got, want_one in zip(runs[0], want):
        _close(got, want_one)
    assert runs[0][1].tobytes() == want[1].tobytes()  # dW: the kernel's own sums
