"""Every sample and fixture model, forward + backward, on the GPU vs the CPU (runs where a GPU answers)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gradgen
from gradgen.executor import Session
from tests.model_dirs import ALL_DIRS, SAMPLE_DIRS, dir_id, load

pytestmark = pytest.mark.cuda


def _built(path):
    model, inputs, reference, _ = load(path)
    wants_inputs = any(k[: -len("_grad")] in inputs for k in reference if k.endswith("_grad"))
    return gradgen.build_backward(model, wrt_inputs=wants_inputs).model, inputs


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_gpu_matches_cpu(path):
    model, inputs = _built(path)
    want = Session(model).run(inputs)
    got = Session(model, device="cuda").run(inputs)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        scale = max(float(np.abs(value).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5 * scale, err_msg=f"{dir_id(path)}: {name}")


@pytest.mark.parametrize("path", SAMPLE_DIRS, ids=dir_id)
def test_gpu_needs_no_cpu_fallback(path):
    """The bundled samples run entirely on the GPU (fixtures may use ops that fall back)."""
    model, inputs = _built(path)
    from gradgen.executor import cuda_backend

    cuda_backend._WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Session(model, device="cuda").run(inputs)
    fallbacks = sorted({str(w.message) for w in caught if "no CUDA kernel" in str(w.message)})
    assert not fallbacks, "\n".join(fallbacks)


def test_runs_are_repeatable_bit_for_bit():
    path = next(p for p in ALL_DIRS if p.name == "embedding")
    model, inputs = _built(path)
    session = Session(model, device="cuda")
    first, second = session.run(inputs), session.run(inputs)
    for name in first:
        assert np.array_equal(first[name], second[name]), name
