"""bfloat16 in the CUDA launchers' tables and generated kernels: what is checkable without a GPU
(the kernels themselves: tests/cuda/test_cuda_bf16.py; this file lives outside tests/cuda, whose
tests all count as GPU tests)."""

from __future__ import annotations

import types

import ml_dtypes
import numpy as np
import pytest

from gradgen.errors import KernelError
from gradgen.kernels.cuda import fused, launch

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_bfloat16_is_a_float_of_every_family():
    assert launch.BFLOAT16 == BF16
    assert launch.dtype_suffix(BF16) == "bf16" and launch.require_suffix(BF16) == "bf16"
    assert launch.is_float(BF16)
    for group in (launch.FLOATS, launch.NUMBERS, launch.CASTABLE):
        assert "bf16" in group
    assert fused.STORAGE["bf16"] == "__nv_bfloat16" and fused.COMPUTE["bf16"] == "float"
    assert np.dtype(fused.NUMPY["bf16"]) == BF16


def test_onnx_bfloat16_code_and_unknown_types():
    assert launch.onnx_element_dtype(16) == BF16
    assert launch.onnx_element_dtype(1) == np.float32
    with pytest.raises(KernelError, match="FLOAT8E4M3FN is not supported"):
        launch.onnx_element_dtype(17)
    with pytest.raises(KernelError, match="dtype uint16 is not supported by the CUDA kernels"):
        launch.require_suffix(np.uint16)


def test_fused_bf16_values_round_after_every_op():
    """A bf16 chain computes in float and rounds each op's value to bf16, as storing it would
    (so the fused kernel gives the unfused kernels' bits); casts widen back to float."""
    sig = fused.Signature(
        ("bf16", "bf16", "f32"),
        (
            fused.FusedOp("Mul", (0, 1)),
            fused.FusedOp("Exp", (3,)),
            fused.FusedOp("Cast", (2,), (("to", 16),)),
            fused.FusedOp("Add", (4, 5)),
            fused.FusedOp("Cast", (6,), (("to", 1),)),
        ),
        (6, 7),
    )
    assert sig.dtypes == ("bf16", "bf16", "f32", "bf16", "bf16", "bf16", "bf16", "f32")
    text = fused.kernel_source(sig)
    body = [line for line in text.splitlines() if line.strip().startswith("const float t")]
    assert len(body) == 2 * 5  # the element and the quad variants
    for line in body[:4]:  # the four bf16 results
        assert "= gg_round_bf16(" in line, line
    assert "__bfloat162float(Conv<__nv_bfloat16, float>::go(x2))" in body[2]
    assert "gg_round_bf16" not in body[4]  # the float32 Cast: exact
    assert "__nv_bfloat16* __restrict__ out0" in text or "__nv_bfloat16* out0" in text


def test_fused_sum_of_bf16_is_left_to_its_kernel():
    """The variadic Sum kernel keeps 16-bit partial sums in float (one rounding), which an op-by-op
    fused fold would not: bf16 Sum, like float16's, is not fused."""
    with pytest.raises(fused.Unsupported):
        fused.Signature(("bf16", "bf16", "bf16"), (fused.FusedOp("Sum", (0, 1, 2)),), (3,)).dtypes  # noqa: B018
    assert fused.Signature(("f32", "f32"), (fused.FusedOp("Sum", (0, 1)),), (2,)).dtypes[-1] == "f32"


def test_cpu_fallback_runs_bf16_as_the_cpu_backend_does(monkeypatch):
    """A configuration without a CUDA kernel runs the numpy kernel in float32 and rounds once to
    bf16, as the CPU backend (numpy has no bf16 arithmetic of its own)."""
    host = types.SimpleNamespace(run_on_host=lambda fn, *args, **kw: fn(*args, **kw))
    monkeypatch.setattr(launch, "runtime", lambda: host)
    monkeypatch.setattr(launch, "_WARNED", set())
    x = (np.linspace(-3, 3, 101, dtype=np.float32)).astype(BF16)
    with pytest.warns(UserWarning, match="no CUDA kernel"):
        got = launch.cpu_fallback("Exp", x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, np.exp(x.astype(np.float32)).astype(BF16))
    f16 = x.astype(np.float16)
    got16 = launch.cpu_fallback("Exp", f16)
    assert got16.dtype == np.float16
    np.testing.assert_array_equal(got16, np.exp(f16.astype(np.float32)).astype(np.float16))


def test_conv_and_gemm_types_of_bf16():
    """cuDNN gets BFLOAT16 data with float32 compute; cuBLAS CUDA_R_16BF (14) with COMPUTE_32F."""
    from gradgen.kernels.cuda import conv, matmul

    names = types.SimpleNamespace(HALF="half", BFLOAT16="bf16", FLOAT="float", DOUBLE="double")
    cudnn = types.SimpleNamespace(data_type=names)
    assert conv._data_types(cudnn, BF16) == ("bf16", "float")
    assert conv._data_types(cudnn, np.float16) == ("half", "float")
    fake = types.SimpleNamespace(ComputeType=types.SimpleNamespace(COMPUTE_32F=68, COMPUTE_32F_FAST_TF32=77, COMPUTE_64F=70))
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as patch:
        patch.setattr(matmul, "_cublas", lambda: (fake, None))
        assert matmul._types(BF16) == (14, 68, np.float32)
        assert matmul._types(np.float16) == (2, 68, np.float32)
