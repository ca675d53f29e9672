"""TF32 requests (gradgen.kernels.cuda.launch.math_mode / tf32_allowed): no GPU needed."""

from __future__ import annotations

import threading

from gradgen.kernels.cuda.launch import math_mode, tf32_allowed


def test_math_mode_allows_tf32_inside_the_block_only(monkeypatch):
    monkeypatch.delenv("GRADGEN_ALLOW_TF32", raising=False)
    assert not tf32_allowed()
    with math_mode(True):
        assert tf32_allowed()
        with math_mode(False):
            assert not tf32_allowed()
        assert tf32_allowed()
    assert not tf32_allowed()


def test_math_mode_is_per_thread(monkeypatch):
    monkeypatch.delenv("GRADGEN_ALLOW_TF32", raising=False)
    seen = []
    with math_mode(True):
        thread = threading.Thread(target=lambda: seen.append(tf32_allowed()))
        thread.start()
        thread.join()
    assert seen == [False]


def test_the_environment_allows_tf32_everywhere(monkeypatch):
    monkeypatch.setenv("GRADGEN_ALLOW_TF32", "1")
    with math_mode(False):
        assert tf32_allowed()


def test_a_cpu_session_runs_a_tf32_model_in_float32():
    import numpy as np

    from gradgen.executor import Session
    from tests.cuda.test_cuda_matmul import _matmul_model

    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((64, 4096)).astype(np.float32), "b": rng.standard_normal((4096, 64)).astype(np.float32)}
    with Session(_matmul_model("tf32"), device="cpu") as session:
        got = session.run(feeds)["y"]
    exact = feeds["a"].astype(np.float64) @ feeds["b"].astype(np.float64)
    # float32 products of 4,096 terms are off by about 1e-4 here; inputs rounded to TF32's 10-bit
    # mantissa would be off by about 7e-2
    assert got.dtype == np.float32 and np.abs(got - exact).max() < 1e-3
