"""ONNX's backend node tests, run through gradgen's executor.

Every node test whose model uses only ops with a gradgen CPU kernel is collected (one pytest
test per ONNX test name); the others are not collected (run this file as a script to list them).
Tests that cannot pass for a documented reason are skipped via ``EXCLUDED`` in
``backend_exclusions.py``; docs/BACKEND_TESTS.md lists the same entries.

The test data comes from ``onnx/backend/test/data/node`` when the installed onnx wheel ships it;
newer wheels ship only the generators (``onnx.backend.test.case.node``), which are then run in
memory once per session (a few seconds).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from gradgen.executor import session as session_module
from gradgen.kernels import registry
from tests.backend_exclusions import EXCLUDED, TOLERANCES, markdown

NODE_DATA_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "node"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "BACKEND_TESTS.md"

# (rtol, atol) per float dtype; integers and bools must match exactly.
FLOAT_TOLERANCES = {
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float64): (1e-7, 1e-9),
}


@dataclasses.dataclass
class NodeCase:
    name: str
    model: onnx.ModelProto
    data_sets: list  # [(inputs, outputs)] or a callable returning it (lazy file reading)

    def load_data_sets(self):
        return self.data_sets() if callable(self.data_sets) else self.data_sets


def _read_data_sets(case_dir: Path, model: onnx.ModelProto):
    data_sets = []
    for set_dir in sorted(case_dir.glob("test_data_set_*")):

        def read(prefix, n):
            out = []
            for i in range(n):
                path = set_dir / f"{prefix}_{i}.pb"
                if not path.exists():
                    break
                tensor = onnx.TensorProto()
                tensor.ParseFromString(path.read_bytes())
                out.append(tensor)
            return out

        data_sets.append((read("input", len(model.graph.input)), read("output", len(model.graph.output))))
    return data_sets


@functools.lru_cache(maxsize=1)
def all_cases() -> dict[str, NodeCase]:
    """Every ONNX backend node test by name (from the shipped data, else generated in memory)."""
    cases: dict[str, NodeCase] = {}
    if NODE_DATA_DIR.is_dir() and any(NODE_DATA_DIR.iterdir()):
        for case_dir in sorted(NODE_DATA_DIR.iterdir()):
            model_path = case_dir / "model.onnx"
            if not model_path.exists():
                continue
            model = onnx.load(str(model_path))
            cases[case_dir.name] = NodeCase(case_dir.name, model, functools.partial(_read_data_sets, case_dir, model))
        return cases
    from onnx.backend.test.case import node as node_cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with np.errstate(all="ignore"):
            for case in node_cases.collect_testcases(None):
                if case.kind == "node" and case.model is not None:
                    cases[case.name] = NodeCase(case.name, case.model, list(case.data_sets))
    return cases


def _graph_ops(graph: onnx.GraphProto) -> set[tuple[str, str]]:
    ops = set()
    for node in graph.node:
        ops.add((registry.normalize_domain(node.domain), node.op_type))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                ops |= _graph_ops(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    ops |= _graph_ops(g)
    return ops


def missing_ops(case: NodeCase) -> list[str]:
    """Op types of the case's model without a gradgen CPU kernel (qualified by domain)."""
    kernels = registry.all_kernels()
    missing = []
    for domain, op_type in sorted(_graph_ops(case.model.graph)):
        entry = kernels.get((domain, op_type))
        if entry is None or entry.cpu is None:
            missing.append(f"{domain}::{op_type}" if domain else op_type)
    return missing


def collected_names() -> list[str]:
    return [name for name, case in all_cases().items() if not missing_ops(case)]


def _params():
    params = []
    for name in collected_names():
        marks = [pytest.mark.skip(reason=EXCLUDED[name])] if name in EXCLUDED else []
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def _as_array(value) -> np.ndarray:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (np.generic, int, float, bool)):
        return np.asarray(value)
    raise TypeError(f"non-tensor test value of type {type(value).__name__} (sequence, map or optional)")


def assert_close(name: str, got: np.ndarray, want: np.ndarray, tolerance=None) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)}, expected {list(want.shape)}"
    if want.dtype in FLOAT_TOLERANCES:
        rtol, atol = tolerance or FLOAT_TOLERANCES[want.dtype]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("test_name", _params())
def test_backend_node(test_name: str) -> None:
    case = all_cases()[test_name]
    sess = session_module.Session(case.model)
    graph_inputs = [v.name for v in case.model.graph.input]
    graph_outputs = [v.name for v in case.model.graph.output]
    tolerance = TOLERANCES[test_name][:2] if test_name in TOLERANCES else None
    for inputs, outputs in case.load_data_sets():
        feeds = {name: _as_array(value) for name, value in zip(graph_inputs, inputs) if name in sess.input_names}
        with np.errstate(all="ignore"):
            got = sess.run(feeds)
        for name, want in zip(graph_outputs, outputs):
            assert_close(name, got[name], _as_array(want), tolerance)


def test_exclusions_are_documented() -> None:
    if not DOCS.exists():
        pytest.skip("docs/BACKEND_TESTS.md is not in this checkout")
    assert markdown() in DOCS.read_text(), (
        "docs/BACKEND_TESTS.md is out of date with tests/backend_exclusions.py; "
        "regenerate it with `python tests/backend_exclusions.py --markdown`"
    )


def test_exclusions_name_real_tests() -> None:
    unknown = sorted((set(EXCLUDED) | set(TOLERANCES)) - set(all_cases()))
    assert not unknown, f"backend_exclusions.py names tests ONNX does not have: {unknown}"


if __name__ == "__main__":  # coverage summary: what runs, what is excluded, what lacks kernels
    by_missing: dict[str, list[str]] = {}
    for name, case in all_cases().items():
        for op in missing_ops(case):
            by_missing.setdefault(op, []).append(name)
    collected = collected_names()
    excluded = [n for n in collected if n in EXCLUDED]
    print(f"{len(all_cases())} node tests; {len(collected)} collected ({len(excluded)} excluded)")
    for op, names in sorted(by_missing.items(), key=lambda item: -len(item[1])):
        print(f"  no kernel for {op}: {len(names)} test(s)")
