"""Gradients of ONNX's own operator tests: every backend node test (``onnx.backend.test``) whose ops
gradgen has kernels for, one of them with a gradient rule, and which has float inputs and outputs,
checked by ``gradgen.check.check_gradients`` on the test's own inputs, once per float output taken
as the loss (a vector-Jacobian product with random weights), differentiating every float input.

The node tests exercise attribute variants nobody wrote a gradient case for (opset 28's
SpaceToDepth mode, float Mod with fmod=0, Resize's aspect-ratio policies were all wrong or refused
with "this is a gradgen bug" when this sweep first ran). ONNX's inputs often sit on kinks (integer
offsets of DeformConv, grid points of GridSample, ties of ReduceMin, zeros of LeakyRelu): a test
that fails there is checked again with its float inputs moved off them by 0.3-2 %, and passes as a
kink when it then passes.

Outcomes: ``pass``, ``kink`` (fails at ONNX's inputs only), ``refused`` (a one-line gradgen error:
an unsupported variant, a non-finite loss, an output whose shape moves with a float input),
``fail`` (a wrong or non-finite gradient off the kinks too) and ``crash`` (anything else). The test
accepts the first three, and ``fail`` only where EXPECTED_FAILURES says why. Run as a script for a
summary (``python tests/test_backend_gradients.py [--cuda] [SUBSTRING ...]``, ``--cuda``: the
backward graphs on the GPU executor); the whole sweep takes about 25 s on one core.
"""

from __future__ import annotations

import functools
import sys
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

if __name__ == "__main__":  # the repository root instead of tests/, whose cuda/ would shadow the cuda package
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from gradgen.check import check_gradients  # noqa: E402
from gradgen.errors import GradgenError  # noqa: E402
from gradgen.grads.registry import all_rules  # noqa: E402
from gradgen.kernels import registry  # noqa: E402
from tests.test_backend_nodes import NodeCase, _as_array, _graph_ops, _read_data_sets, all_cases  # noqa: E402

FLOAT_TYPES = (1, 10, 11, 16)  # float, float16, double, bfloat16

_NAN_THROUGH_WHERE = (
    "the expanded function body's Softmax over a fully masked row is NaN and the Where that zeroes "
    "it passes a zero gradient, but the Softmax gradient of a NaN row is NaN (0 * NaN), as in PyTorch "
    "and JAX; the Attention op itself is differentiated through gradgen's own form, which guards "
    "those rows (its non-expanded tests pass)"
)
_RANDOM = "random output: finite differences draw new samples"
EXPECTED_FAILURES = {
    "test_acosh_example": "x = 1, where acosh's derivative is infinite",
    "test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded": _NAN_THROUGH_WHERE,
    "test_attention_23_fullymasked_qk_matmul_output_mode3_zero_expanded": _NAN_THROUGH_WHERE,
    "test_attention_24_fullymasked_qk_matmul_output_mode3_zero_expanded": _NAN_THROUGH_WHERE,
    "test_attention_24_qk_matmul_output_mode3_softmax_precision_expanded": _NAN_THROUGH_WHERE,
    "test_attention_4d_causal_nonpad_negative_offset_structural_empty_expanded": _NAN_THROUGH_WHERE,
    "test_attention_4d_causal_padded_kv_bf16_expanded": _NAN_THROUGH_WHERE,
    "test_attention_causal_boolmask_nan_robustness_expanded": _NAN_THROUGH_WHERE,
    "test_attention_local_window_gqa_rank4_mask_expanded": _NAN_THROUGH_WHERE,
    "test_bernoulli": _RANDOM,
    "test_bernoulli_double": _RANDOM,
    "test_bernoulli_double_expanded": _RANDOM,
    "test_bernoulli_expanded": _RANDOM,
}


def _float_values(values) -> list:
    return [v for v in values if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in FLOAT_TYPES]


def sweepable(case: NodeCase) -> bool:
    """Every op has a CPU kernel, one has a gradient rule, and there are float inputs and outputs."""
    ops = _graph_ops(case.model.graph)
    kernels, rules = registry.all_kernels(), all_rules()
    if any(kernels.get(op) is None or kernels[op].cpu is None for op in ops) or not any(op in rules for op in ops):
        return False
    return bool(_float_values(case.model.graph.input)) and bool(_float_values(case.model.graph.output))


def _losses(case: NodeCase) -> list[str]:
    """The float outputs to take as the loss; LayerNormalization's Mean and InvStdDev are float32 by
    the schema (finite differences of a float32 value are noise at eps 1e-6)."""
    graph = case.model.graph
    names = [v.name for v in _float_values(graph.output)]
    if graph.node[-1].op_type == "LayerNormalization":
        names = names[:1]
    return names


def _feeds(case: NodeCase) -> dict[str, np.ndarray]:
    inputs, _ = case.load_data_sets()[0]
    return {v.name: _as_array(t) for v, t in zip(case.model.graph.input, inputs)}


def _moved_off_kinks(feeds: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    moved = {}
    for name, value in feeds.items():
        if value.dtype.kind == "f":
            step = rng.uniform(0.003, 0.02, value.shape) * rng.choice([-1.0, 1.0], value.shape)
            value = (value + step).astype(value.dtype)
        moved[name] = value
    return moved


def _failed_checks(case: NodeCase, feeds: dict[str, np.ndarray], device: str) -> list:
    """The failed tensor checks over every loss (empty: all passed)."""
    failed = []
    for loss in _losses(case):
        report = check_gradients(
            case.model, inputs=feeds, wrt_inputs=True, loss=loss, samples=3, device=device, elementwise_limit=0
        )
        failed += [(loss, t.name, t.max_rel_err, t.note) for t in report.tensors if not t.passed]
    return failed


def sweep_one(case: NodeCase, device: str = "cpu") -> tuple[str, str]:
    """(outcome, detail) of one node test."""
    try:
        feeds = _feeds(case)
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            failed = _failed_checks(case, feeds, device)
            if not failed:
                return "pass", ""
            try:
                again = _failed_checks(case, _moved_off_kinks(feeds), device)
            except GradgenError:
                again = failed
    except GradgenError as exc:
        return "refused", str(exc)
    except Exception:  # noqa: BLE001 - the sweep reports every other failure as a crash
        return "crash", traceback.format_exc(limit=-3)
    detail = "; ".join(f"loss {loss}: {name} rel err {err:.3g} {note}".strip() for loss, name, err, note in failed)
    return ("kink" if not again else "fail"), detail


def swept_names() -> list[str]:
    return [name for name, case in sorted(all_cases().items()) if sweepable(case)]


def with_symbolic_dims(case: NodeCase) -> NodeCase:
    """The node test with every dim of its inputs a symbol of its own (but the lengths of 1-D
    integer inputs: shape vectors), and its outputs' shapes left to inference: as an exporter
    with dynamic axes writes it. Nothing static to read: rules and inference must work from ranks."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    for i, value in enumerate(model.graph.input):
        tensor = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor.HasField("shape"):
            continue
        if tensor.elem_type not in FLOAT_TYPES and len(tensor.shape.dim) == 1:
            continue
        for k, dim in enumerate(tensor.shape.dim):
            dim.Clear()
            dim.dim_param = f"s{i}_{k}"
    for value in model.graph.output:
        value.type.tensor_type.ClearField("shape")
    del model.graph.value_info[:]
    return NodeCase(case.name, model, case.data_sets)


# Refusals that symbolic dims may add: what a gradient needs static or constant, said as such
_NEEDS_STATIC = ("static", "constant")


@pytest.mark.parametrize("test_name", swept_names())
def test_backend_node_gradient_with_symbolic_dims(test_name: str) -> None:
    """Where the test passes with its static shapes, it passes with symbolic ones too, or is refused
    for a reason that names what must be static (found: ONNX's Attention inference wrote 0 for
    symbolic sizes; Scan and Loop bodies with untyped inputs were not differentiated)."""
    outcome, detail = sweep_one(with_symbolic_dims(all_cases()[test_name]))
    if test_name in EXPECTED_FAILURES:
        assert outcome in ("fail", "refused"), f"{outcome}: {detail}"
    elif outcome == "refused" and not any(word in detail for word in _NEEDS_STATIC):
        static_outcome, _ = sweep_one(all_cases()[test_name])
        assert static_outcome == "refused", f"refused only with symbolic dims: {detail}"
    else:
        assert outcome in ("pass", "kink", "refused"), f"{outcome}: {detail}"


# ONNX's small whole-model tests, with their data: PyTorch's converted modules and operators
# (opset 6, so they also go through the opset conversion) and a few hand-made ones
MODEL_KINDS = ("simple", "pytorch-operator", "pytorch-converted")
_GARBAGE = "ONNX's input data for this test is uninitialised memory (values from 1e-316 to 1e199)"
EXPECTED_MODEL_FAILURES = {
    "pytorch-operator/test_operator_add_broadcast": _GARBAGE,
    "pytorch-operator/test_operator_add_size1_right_broadcast": _GARBAGE,
    "pytorch-operator/test_operator_add_size1_singleton_broadcast": _GARBAGE,
    "pytorch-operator/test_operator_addconstant": _GARBAGE,
}


@functools.lru_cache(maxsize=1)
def model_cases() -> dict[str, NodeCase]:
    """ONNX's whole-model tests of MODEL_KINDS by "kind/name", where the installed onnx ships their data."""
    import onnx

    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    cases = {}
    for kind in MODEL_KINDS:
        for case_dir in sorted((root / kind).glob("test_*")) if (root / kind).is_dir() else []:
            if (case_dir / "model.onnx").exists() and any(case_dir.glob("test_data_set_*")):
                model = onnx.load(str(case_dir / "model.onnx"))
                data = functools.partial(_read_data_sets, case_dir, model)
                cases[f"{kind}/{case_dir.name}"] = NodeCase(case_dir.name, model, data)
    return cases


def _assert_swept(case: NodeCase, expected_failure: str | None) -> None:
    """A pass, a kink or a one-line refusal; a failure only where ``expected_failure`` says why."""
    outcome, detail = sweep_one(case)
    if expected_failure is not None:
        assert outcome == "fail", f"expected to fail ({expected_failure}), got {outcome}: {detail}"
    else:
        assert outcome in ("pass", "kink", "refused"), f"{outcome}: {detail}"


@pytest.mark.parametrize("test_name", [n for n, case in model_cases().items() if sweepable(case)])
def test_backend_model_gradient(test_name: str) -> None:
    _assert_swept(model_cases()[test_name], EXPECTED_MODEL_FAILURES.get(test_name))


@pytest.mark.parametrize("test_name", swept_names())
def test_backend_node_gradient(test_name: str) -> None:
    _assert_swept(all_cases()[test_name], EXPECTED_FAILURES.get(test_name))


# ONNX Runtime's CPU provider lacks kernels these need (bfloat16 arithmetic, opsets newer than it
# knows, Swish) or its Python binding cannot take their arrays (bfloat16, float8).
_ORT_LACKS = ("bf16", "bfloat16", "BFLOAT16", "float8", "FLOAT8", "FLOAT4", "INT2", "INT4", "UINT2", "UINT4", "swiglu")


def portable_on_onnxruntime(case: NodeCase) -> str:
    """The --portable backward graph of the first float output run by ONNX Runtime against gradgen's
    executor: "" when they agree (or gradgen refuses the build), else what differs."""
    import onnx_ir as ir
    import onnxruntime as ort

    import gradgen
    from gradgen.executor import Session

    feeds, loss = _feeds(case), _losses(case)[0]
    try:
        built = gradgen.build_backward(case.model, wrt_inputs=True, loss=loss, portable=True)
        proto = ir.to_proto(built.model)
        session = Session(proto)
        with np.errstate(all="ignore"):
            if f"{loss}_grad" in session.input_names:
                value = Session(case.model).run(feeds)[loss]
                feeds[f"{loss}_grad"] = np.random.default_rng(0).uniform(-1, 1, value.shape).astype(value.dtype)
            feeds = {k: v for k, v in feeds.items() if k in session.input_names}
            want = session.run(feeds)
    except GradgenError:
        return ""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    runtime = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in runtime.get_outputs()]
    got = dict(zip(names, runtime.run(None, {i.name: feeds[i.name] for i in runtime.get_inputs()})))
    low = any(np.asarray(want[g]).dtype == np.float16 for g in built.gradient_names)
    rtol, atol = (2e-2, 2e-3) if low else (1e-4, 1e-5)  # float16: ONNX Runtime rounds after every op
    differ = []
    for name in built.gradient_names:
        a, b = np.asarray(want[name], np.float64), np.asarray(got[name], np.float64)
        if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            differ.append(name)
    return ", ".join(differ)


@pytest.mark.slow
@pytest.mark.parametrize("test_name", [n for n in swept_names() if not any(s in n for s in _ORT_LACKS)])
def test_portable_backward_graph_runs_on_onnxruntime(test_name: str) -> None:
    """About 20 s for all of them; slow-marked to keep the default suite short."""
    import onnxruntime as ort

    try:
        differ = portable_on_onnxruntime(all_cases()[test_name])
    except ort.capi.onnxruntime_pybind11_state.NotImplemented as exc:
        pytest.skip(f"ONNX Runtime has no kernel: {str(exc)[:200]}")
    assert not differ, f"gradgen and ONNX Runtime differ on {differ}"


def test_expected_failures_name_swept_tests() -> None:
    unknown = sorted(set(EXPECTED_FAILURES) - set(all_cases()))
    assert not unknown, f"EXPECTED_FAILURES names tests ONNX does not have: {unknown}"


if __name__ == "__main__":  # a summary: every outcome other than a pass, and a count of each
    import time

    device = "cuda" if "--cuda" in sys.argv else "cpu"
    only = [a for a in sys.argv[1:] if a != "--cuda"]
    counts: dict[str, int] = {}
    start = time.perf_counter()
    names = [n for n in swept_names() if not only or any(o in n for o in only)]
    for name in names:
        outcome, detail = sweep_one(all_cases()[name], device)
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome != "pass":
            print(f"{outcome:8s} {name}: {detail.splitlines()[-1] if detail else ''}"[:300], flush=True)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"{len(names)} node tests in {time.perf_counter() - start:.0f} s: {summary}")
