"""If, Loop and Scan on the GPU (gradgen/kernels/cuda/control.py, formerly CUDA_FALLBACKS): the
body runs on the device inside the step. Each case runs the forward model and its built backward
graph on the CPU and on a GPU session, checks that the control-flow launcher ran and that no step
fell back to the host, and compares: data-dependent If (nested too, a branch reading nothing), a
while loop with an If in its body (zero iterations too), a run-time trip count, a condition the body
computes, run-time loops nested, Scan of a run-time length (axes and directions) and Scan-8 with
sequence lengths. One session then alternates branches and loop lengths: every run matches and
no planned block leaks."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gradgen
from gradgen.executor import Session
from tests.control_flow_models import (
    if_model,
    if_reading_nothing_model,
    loop_feeds,
    loop_model,
    nested_if_model,
    nested_run_time_loops_model,
    scan_8_feeds,
    scan_8_model,
    scan_8_reference,
    while_model,
)
from tests.cuda.test_cuda_more_launchers import launches
from tests.test_control_flow import SCANS
from tests.test_run_time_control_flow import NESTED_FEEDS, _m_feeds, _nested_loops_feeds, _symbolic_scan, _while_x, _x

pytestmark = pytest.mark.cuda

__all__ = ["launches"]  # the fixture these tests take, imported into this module

CASES = {
    "if then": ("If", lambda: (if_model("data"), {"x": _x(1.0)}, None)),
    "if else": ("If", lambda: (if_model("data"), {"x": _x(-1.0)}, None)),
    "if, else reads nothing": ("If", lambda: (if_reading_nothing_model(), {"x": _x(-1.0)}, None)),
    **{f"nested if {k}": ("If", lambda k=k: (nested_if_model(), {"x": NESTED_FEEDS[k]}, None)) for k in range(3)},
    **{
        f"while x{scale}": ("Loop", lambda scale=scale: (while_model(), {"x": _while_x(scale)}, "loss"))
        for scale in (1.0, 0.3, 30.0)
    },
    **{f"trip count {m}": ("Loop", lambda m=m: (loop_model(trip_count=None), _m_feeds(m), None)) for m in (3, 0)},
    "computed condition": ("Loop", lambda: (loop_model(condition="computed"), loop_feeds(3), None)),
    **{
        f"nested loops {m}x{n}": ("Loop", lambda m=m, n=n: (nested_run_time_loops_model(), _nested_loops_feeds(m, n), None))
        for m, n in [(2, 3), (0, 2), (50, 1)]
    },
}
SCAN_CASES = {name: kw for name, kw in SCANS.items()}


def _run(model, feeds, device):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = Session(model, device=device).run(feeds)
    fallbacks = [str(w.message) for w in caught if "no CUDA kernel" in str(w.message)]
    return results, fallbacks


def _same(got, want):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_control_flow_runs_on_the_gpu_forward_and_backward(launches, case):
    op_type, make = CASES[case]
    model, feeds, loss = make()
    built = gradgen.build_backward(model, wrt_inputs=True, loss=loss).model
    calls = launches(op_type)
    for graph in (model, built):
        want, _ = _run(graph, feeds, "cpu")
        got, fallbacks = _run(graph, feeds, "cuda")
        assert not fallbacks, fallbacks
        _same(got, want)
    assert calls, f"the {op_type} launcher did not run"


@pytest.mark.parametrize("kw", list(SCAN_CASES.values()), ids=list(SCAN_CASES))
def test_scan_of_a_run_time_length_runs_on_the_gpu(launches, kw):
    """A GPU Session writes it as a Loop (UnrollLoopsPass), whose launcher runs the body."""
    model, feeds = _symbolic_scan(**kw)
    calls = launches("Loop")
    want, _ = _run(model, feeds, "cpu")
    got, fallbacks = _run(model, feeds, "cuda")
    assert calls and not fallbacks, fallbacks
    _same(got, want)
    built = gradgen.build_backward(model, wrt_inputs=True).model  # written as a Loop
    _same(_run(built, feeds, "cuda")[0], _run(built, feeds, "cpu")[0])


def test_scan_8_runs_on_the_gpu(launches):
    calls = launches("Scan")
    feeds = scan_8_feeds()
    got, fallbacks = _run(scan_8_model(), feeds, "cuda")
    assert calls and not fallbacks, fallbacks
    want_s, want_ys = scan_8_reference(feeds)
    np.testing.assert_allclose(got["sT"], want_s, rtol=1e-12)
    np.testing.assert_allclose(got["ys"], want_ys, rtol=1e-12)


@pytest.mark.parametrize("graphs", ["1", "0"], ids=["graphs on", "graphs off"])
def test_one_session_alternating_branches_and_lengths_matches_and_leaks_nothing(monkeypatch, graphs):
    """The outer plan was traced on one branch; runs on the other branch and other trip counts are
    served by it where it fits and by the pool where it does not, never wrongly."""
    monkeypatch.setenv("GRADGEN_CUDA_GRAPHS", graphs)
    for model, feed_list, loss in [
        (if_model("data"), [{"x": _x(s, k)} for k in range(3) for s in (1.0, -1.0)], None),
        (nested_if_model(), [{"x": x} for x in NESTED_FEEDS * 2], None),
        (while_model(), [{"x": _while_x(s)} for s in (1.0, 0.3, 30.0, 0.3, 1.0)], "loss"),
        (loop_model(trip_count=None), [_m_feeds(m) for m in (3, 0, 2, 1, 3)], None),
    ]:
        built = gradgen.build_backward(model, wrt_inputs=True, loss=loss).model
        cpu = Session(built)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gpu = Session(built, device="cuda")
            for feeds in feed_list:
                _same(gpu.run(feeds), cpu.run(feeds))
        assert gpu.memory_stats()["leaks"] == 0
        gpu.close()
