"""CUDA MatMul, Gemm and FusedMatMul (cuBLAS, transposes as flags) against the numpy kernels: MatMul's
shapes and Gemm's cases, FusedMatMul for every attribute combination and broadcasting case of
tests/test_fused_matmul.py, plus strided views, float32 exactness (no TF32) and the absence of copies."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cpu import matmul as cpu
from tests.cuda.test_cuda_conv import check, rand
from tests.test_fused_matmul import CASES, FLAGS, attrs_of, operands, reference, valid

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("quiet_warnings")]

DTYPES = [np.float32, np.float64, np.float16]
TOL = {np.float64: 1e-11, np.float32: 2e-6, np.float16: 2e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_matmul_against_cpu(rt, case, dtype):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(0)
    for flags in FLAGS:
        if not valid(case, flags):
            continue
        a, b = operands(rng, case, flags, dtype)
        attrs = attrs_of(flags, 0.5 if flags[0] else 1.0)
        want = cpu.fused_matmul(a, b, **attrs)
        got = rt.to_host(matmul.fused_matmul(rt.to_device(a), rt.to_device(b), **attrs))
        assert got.dtype == want.dtype and got.shape == want.shape, (flags, got.shape, want.shape)
        exact = reference(a, b, attrs)
        scale = max(1.0, float(np.abs(exact).max(initial=0)))
        np.testing.assert_allclose(
            got.astype(np.float64), exact, rtol=TOL[dtype] * 10, atol=TOL[dtype] * 10 * scale, err_msg=f"{case} {attrs}"
        )


def test_fused_matmul_float32_is_exact_fp32(rt, monkeypatch):
    """TF32 off: a K=4096 product keeps float32's precision (TF32 would err by about 1e-3 relative)."""
    from gradgen.kernels.cuda import matmul

    monkeypatch.delenv("GRADGEN_ALLOW_TF32", raising=False)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((8, 4096, 64)).astype(np.float32)  # stored (K, M): transA
    b = rng.standard_normal((8, 48, 4096)).astype(np.float32)  # stored (N, K): transB
    got = rt.to_host(matmul.fused_matmul(rt.to_device(a), rt.to_device(b), transA=1, transB=1))
    want = np.matmul(np.swapaxes(a.astype(np.float64), -1, -2), np.swapaxes(b.astype(np.float64), -1, -2))
    err = np.abs(got - want).max() / np.abs(want).max()
    # float32 sums over K=4096 err by a few 1e-6 of the largest element (2.9e-6 measured on an H100);
    # TF32's 10-bit mantissa would be about 1e-3
    assert err < 2e-5, err


def test_fused_matmul_copies_nothing(rt, monkeypatch):
    """Transposed and batch-permuted operands go to cuBLAS as they are: no copy kernel runs."""
    from gradgen.kernels.cuda import matmul

    def no_copy(*args, **kwargs):
        raise AssertionError("an operand was copied")

    monkeypatch.setattr(matmul, "copy_into", no_copy)
    rng = np.random.default_rng(2)
    for case in ("4d", "both broadcast", "rank broadcast", "vector A"):
        for flags in FLAGS:
            if not valid(case, flags):
                continue
            a, b = operands(rng, case, flags)
            attrs = attrs_of(flags, 1.0)
            got = rt.to_host(matmul.fused_matmul(rt.to_device(a), rt.to_device(b), **attrs))
            np.testing.assert_allclose(got, cpu.fused_matmul(a, b, **attrs), rtol=1e-5, atol=1e-5)


def test_fused_matmul_deterministic_and_errors(rt):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(3)
    a = rt.to_device(rng.standard_normal((12, 6, 64)).astype(np.float32))
    b = rt.to_device(rng.standard_normal((6, 64, 33)).astype(np.float32))
    runs = [rt.to_host(matmul.fused_matmul(a, b, transBatchA=1)) for _ in range(3)]
    assert all(np.array_equal(runs[0], r) for r in runs[1:])
    with pytest.raises(KernelError, match="inner dimensions differ"):
        matmul.fused_matmul(a, b, transBatchA=1, transA=1)
    with pytest.raises(KernelError, match="needs inputs of one rank >= 3"):
        matmul.fused_matmul(rt.to_device(np.zeros((3, 4), np.float32)), rt.to_device(np.zeros((4, 5), np.float32)), transBatchB=1)


def test_matmul_strided_views_and_outer_broadcast(rt):
    """MatMul on a device view (a slice) and a broadcast needing several strided-batched calls."""
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    y = rng.standard_normal((1, 5, 6, 7)).astype(np.float32)
    got = rt.to_host(matmul.matmul(rt.to_device(x)[:, :1], rt.to_device(y)))  # a device view
    np.testing.assert_allclose(got, np.matmul(x[:, :1], y), rtol=1e-5, atol=1e-5)
    many = rng.standard_normal((matmul.MAX_GEMM_CALLS + 2, 1, 3, 4)).astype(np.float32)
    other = rng.standard_normal((1, 3, 4, 2)).astype(np.float32)
    got = rt.to_host(matmul.matmul(rt.to_device(many), rt.to_device(other)))  # materialised path
    np.testing.assert_allclose(got, np.matmul(many, other), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# MatMul / Gemm

MATMUL_SHAPES = [
    ((3, 4), (4, 5)),
    ((4,), (4, 5)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 5)),  # B shared: folded into one GEMM
    ((4, 5), (2, 5, 6)),  # A broadcast over B's batch (stride 0)
    ((2, 3, 4), (2, 4, 5)),  # both full
    ((2, 1, 3, 4), (3, 4, 5)),  # batch broadcast on both sides: materialised
    ((1, 3, 4), (2, 1, 4, 6)),
    ((5,), (2, 5, 3)),
    ((2, 3, 5), (5,)),
    ((0, 4), (4, 5)),  # empty
    ((3, 0), (0, 5)),  # K = 0: zeros
    ((2, 0, 3, 4), (4, 2)),
    ((1, 1), (1, 1)),
    ((65, 130), (130, 33)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
def test_matmul(rt, dtype, shapes):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(0)
    a, b = rand(rng, shapes[0], dtype), rand(rng, shapes[1], dtype)
    want = cpu.matmul(a, b)
    got = rt.to_host(matmul.matmul(rt.to_device(a), rt.to_device(b)))
    check(got, want, scale=np.sqrt(shapes[0][-1]) * 3 if want.size else None)


def test_matmul_non_contiguous_and_deterministic(rt):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(1)
    a = rand(rng, (6, 40))
    b = rand(rng, (20, 7))
    da = rt.to_device(a)[:, ::2]  # a strided view
    got1 = rt.to_host(matmul.matmul(da, rt.to_device(b)))
    got2 = rt.to_host(matmul.matmul(da, rt.to_device(b)))
    check(got1, cpu.matmul(np.ascontiguousarray(a[:, ::2]), b))
    assert np.array_equal(got1, got2)


def test_matmul_errors(rt):
    from gradgen.kernels.cuda import matmul

    a = rt.to_device(np.zeros((3, 4), np.float32))
    with pytest.raises(KernelError, match="inner dimensions differ"):
        matmul.matmul(a, rt.to_device(np.zeros((5, 2), np.float32)))
    with pytest.raises(KernelError, match="not broadcastable"):
        matmul.matmul(rt.to_device(np.zeros((2, 3, 4), np.float32)), rt.to_device(np.zeros((3, 4, 2), np.float32)))


GEMM_CASES = [
    dict(m=4, n=5, k=3, transA=0, transB=0, c=(5,), alpha=1.0, beta=1.0),
    dict(m=4, n=5, k=3, transA=1, transB=0, c=(4, 1), alpha=0.5, beta=2.0),
    dict(m=4, n=5, k=3, transA=0, transB=1, c=(4, 5), alpha=1.5, beta=-1.0),
    dict(m=4, n=5, k=3, transA=1, transB=1, c=(), alpha=1.0, beta=0.5),
    dict(m=4, n=5, k=3, transA=0, transB=1, c=None, alpha=2.0, beta=1.0),
    dict(m=4, n=5, k=3, transA=0, transB=0, c=(1, 5), alpha=1.0, beta=0.0),
    dict(m=4, n=5, k=0, transA=0, transB=0, c=(5,), alpha=1.0, beta=3.0),
    dict(m=4, n=5, k=0, transA=1, transB=1, c=None, alpha=1.0, beta=1.0),
    dict(m=0, n=5, k=3, transA=0, transB=0, c=(5,), alpha=1.0, beta=1.0),
    dict(m=70, n=129, k=33, transA=1, transB=1, c=(129,), alpha=1.0, beta=1.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GEMM_CASES, ids=str)
def test_gemm(rt, dtype, case):
    from gradgen.kernels.cuda import matmul

    rng = np.random.default_rng(2)
    m, n, k = case["m"], case["n"], case["k"]
    a = rand(rng, (k, m) if case["transA"] else (m, k), dtype)
    b = rand(rng, (n, k) if case["transB"] else (k, n), dtype)
    c = None if case["c"] is None else rand(rng, case["c"], dtype)
    attrs = dict(alpha=case["alpha"], beta=case["beta"], transA=case["transA"], transB=case["transB"])
    want = cpu.gemm(a, b, c, **attrs)
    got = rt.to_host(matmul.gemm(rt.to_device(a), rt.to_device(b), None if c is None else rt.to_device(c), **attrs))
    check(got, want, scale=np.sqrt(max(k, 1)) * 6)


def test_gemm_bad_c(rt):
    from gradgen.kernels.cuda import matmul

    a = rt.to_device(np.zeros((3, 4), np.float32))
    b = rt.to_device(np.zeros((4, 5), np.float32))
    with pytest.raises(KernelError, match="does not broadcast"):
        matmul.gemm(a, b, rt.to_device(np.zeros((3, 2), np.float32)))


def _matmul_model(precision: str | None):
    """y = a @ b for a (64, 4096) and b (4096, 64) fed as inputs; the ``gradgen.precision``
    metadata that ``--precision`` writes, when given."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")],
        "mm",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [64, 4096]),
            helper.make_tensor_value_info("b", TensorProto.FLOAT, [4096, 64]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if precision is not None:
        helper.set_model_props(model, {"gradgen.precision": precision})
    return model


def test_a_tf32_model_gets_tf32_gemms_and_an_fp32_model_does_not(rt, monkeypatch):
    """--precision tf32 is honoured on the GPU: its float32 GEMMs carry TF32's rounding (a 10-bit
    mantissa: about 1e-3 relative per product), while an fp32 model in the same process, before and
    after it, stays within float32's; GRADGEN_ALLOW_TF32 is not needed."""
    from gradgen.executor import Session

    monkeypatch.delenv("GRADGEN_ALLOW_TF32", raising=False)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((64, 4096)).astype(np.float32), "b": rng.standard_normal((4096, 64)).astype(np.float32)}
    want = feeds["a"].astype(np.float64) @ feeds["b"].astype(np.float64)

    def relative_error(precision):
        with Session(_matmul_model(precision), device="cuda") as session:
            got = [session.run(feeds)["y"] for _ in range(3)]  # traced, recorded, replayed
        return [float(np.abs(g - want).max() / np.abs(want).max()) for g in got]

    before, tf32, after = relative_error(None), relative_error("tf32"), relative_error("fp32")
    assert max(before + after) < 1e-5, (before, after)
    assert all(1e-4 < e < 1e-2 for e in tf32), tf32
