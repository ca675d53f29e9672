"""``gradgen run --compare``: compare a model's outputs with a reference .npz (e.g. PyTorch's gradients).

Matching: a reference key is compared with the output of the same name; with ``torch_names`` a key
``w`` that names no output is compared with ``w_grad`` (references saved from PyTorch's
``named_parameters``). A key that matches no output is reported, never silently skipped.

Tolerance: element by element, ``|got - ref| <= atol * scale + rtol * |ref|``, where a tensor's
``scale`` is ``max(max|ref|, max|got|, floor * G)`` and ``G`` is the largest |value| of all compared
gradients (outputs named ``*_grad``; all compared outputs when there are none). The floor keeps a
gradient that is mathematically zero (a conv bias before a training-mode BatchNorm) from failing on
float32 rounding noise, which scales with the model's gradients, not with the tensor's own noise.

Default tolerances depend on the precision the model computes in (``compare_precision``: the
``gradgen.precision`` metadata that AutocastPass writes, else the narrowest float type among the
graph's values): ``DEFAULT_TOLERANCES`` keeps float32's for fp32 and tf32 and widens them for fp16
and bf16, whose 11- and 8-bit significands round every GEMM input by about 5e-4 and 4e-3
(PyTorch's own bf16 autocast gradient of LeNet's first conv weight is off by 4.2e-2 of its scale).

Kinks: when outputs differ, ``kink_flips`` looks for inputs of non-smooth ops (Relu, LeakyRelu,
PRelu, Abs, Clip, Max, Min and comparisons) whose side of the switching point differs between a
float32 and a float64 run of the same graph: float rounding decides those elements, so a reference
computed elsewhere may legitimately take the other side.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.errors import GradgenError, RunError, UsageError
from gradgen.names import node_name, value_name
from gradgen.passes.autocast import METADATA_KEY
from gradgen.text_table import format_table

# Non-smooth ops: input positions compared with a switching point (0 for one input; each other for two).
_KINK_AT_ZERO = {"Relu", "LeakyRelu", "PRelu", "Abs", "ThresholdedRelu"}
_KINK_BETWEEN = {"Max", "Min", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"}


@dataclasses.dataclass
class TensorComparison:
    """One compared output."""

    output: str
    key: str  # the reference key it was compared with
    max_abs_err: float
    scale: float
    passed: bool
    note: str = ""

    @property
    def rel_err(self) -> float:
        return self.max_abs_err / self.scale if self.scale else (0.0 if self.max_abs_err == 0 else float("inf"))


@dataclasses.dataclass
class Comparison:
    """The result of ``compare_outputs``."""

    rows: list[TensorComparison]
    unmatched: list[str]  # reference keys that match no output
    unreferenced: list[str]  # outputs that the reference does not name
    rtol: float
    atol: float
    floor: float
    hint: str = ""  # e.g. "--torch-names would match them"
    defaults: str = ""  # which of rtol / atol are defaults, and for which precision (``Tolerance.source``)

    @property
    def tolerance(self) -> str:
        """``rtol=0.01, atol=0.05*scale, floor=0.1; bf16 defaults``: the tolerance as the output states it."""
        said = f"rtol={self.rtol:g}, atol={self.atol:g}*scale, floor={self.floor:g}"
        return f"{said}; {self.defaults}" if self.defaults else said

    @property
    def failures(self) -> list[str]:
        return [row.output for row in self.rows if not row.passed]

    def format(self) -> str:
        header = ("output", "reference key", "max abs err", "err / scale", "scale", "verdict")
        rows = [
            (
                r.output,
                r.key,
                f"{r.max_abs_err:.3g}",
                f"{r.rel_err:.3g}",
                f"{r.scale:.3g}",
                ("ok" if r.passed else "FAIL") + (f" ({r.note})" if r.note else ""),
            )
            for r in self.rows
        ]
        return format_table(header, rows)


def match_reference(
    outputs: Sequence[str], keys: Sequence[str], torch_names: bool = False
) -> tuple[list[tuple[str, str]], list[str]]:
    """(output, key) pairs and the keys that match no output."""
    names = set(outputs)
    pairs, unmatched = [], []
    for key in keys:
        if key in names:
            pairs.append((key, key))
        elif torch_names and f"{key}_grad" in names:
            pairs.append((f"{key}_grad", key))
        else:
            unmatched.append(key)
    return pairs, unmatched


# -- default tolerances per precision ------------------------------------------------------------

# (rtol, atol) per precision; fp32's are ``gradgen run``'s historical defaults
DEFAULT_TOLERANCES = {"fp32": (1e-4, 1e-5), "tf32": (1e-4, 1e-5), "fp16": (1e-3, 1e-2), "bf16": (1e-2, 5e-2)}
_LOW_PRECISION = {ir.DataType.BFLOAT16: "bf16", ir.DataType.FLOAT16: "fp16"}  # coarsest first


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """The rtol / atol a comparison uses, and where they come from."""

    rtol: float
    atol: float
    precision: str  # the model's precision (``compare_precision``)
    defaulted: tuple[str, ...] = ()  # "rtol" / "atol": the ones not given by the user

    @property
    def source(self) -> str:
        """``bf16 defaults`` or ``atol: fp16 default``; empty when the user gave both."""
        if not self.defaulted:
            return ""
        if len(self.defaulted) == 2:
            return f"{self.precision} defaults"
        return f"{self.defaulted[0]}: {self.precision} default"


def compare_precision(model: ir.Model) -> str:
    """The precision ``model`` computes in: its ``gradgen.precision`` metadata, else the coarsest
    16-bit float type among its values (bf16 before fp16), else fp32."""
    recorded = model.metadata_props.get(METADATA_KEY)
    if recorded in DEFAULT_TOLERANCES:
        return recorded
    graph = model.graph
    values = [
        *graph.inputs,
        *graph.outputs,
        *graph.initializers.values(),
        *(v for node in ir.traversal.RecursiveGraphIterator(graph) for v in node.outputs),
    ]
    found = {v.dtype for v in values}
    return next((name for dtype, name in _LOW_PRECISION.items() if dtype in found), "fp32")


def resolve_tolerance(model: ir.Model, rtol: float | None, atol: float | None) -> Tolerance:
    """The given rtol / atol, with the model's precision's defaults for those that are None."""
    precision = compare_precision(model)
    default_rtol, default_atol = DEFAULT_TOLERANCES[precision]
    defaulted = tuple(name for name, given in (("rtol", rtol), ("atol", atol)) if given is None)
    return Tolerance(default_rtol if rtol is None else rtol, default_atol if atol is None else atol, precision, defaulted)


# -- comparison ------------------------------------------------------------------------------------


def compare_outputs(
    results: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    *,
    rtol: float,
    atol: float,
    floor: float,
    torch_names: bool = False,
    defaults: str = "",
) -> Comparison:
    """Compare every output that a reference key names (see the module docstring for the tolerance).

    ``defaults`` says which tolerances are defaults (``Tolerance.source``), for the messages."""
    pairs, unmatched = match_reference(list(results), list(reference), torch_names)
    hint = ""
    if unmatched and not torch_names and any(f"{key}_grad" in results for key in unmatched):
        hint = "--torch-names compares a key w with the output w_grad"
    for _, key in pairs:
        _require_real(key, np.asarray(reference[key]))
    compared = {output for output, _ in pairs}
    unreferenced = [name for name in results if name not in compared]
    got = {output: np.asarray(results[output]) for output, _ in pairs}
    want = {output: np.asarray(reference[key]) for output, key in pairs}
    grads = [o for o in got if o.endswith("_grad")] or list(got)
    largest = max((_max_abs(want[o]) for o in grads if want[o].shape == got[o].shape), default=0.0)
    rows = [_compare_one(output, key, got[output], want[output], rtol, atol, floor * largest) for output, key in pairs]
    return Comparison(rows, unmatched, unreferenced, rtol, atol, floor, hint, defaults)


def _require_real(key: str, array: np.ndarray) -> None:
    """A reference holds real numbers (booleans, integers, floats of any width): a complex one's
    imaginary part would be dropped, and strings or dates cannot be compared."""
    if array.dtype.kind in "biuf" or array.dtype.type.__module__.startswith("ml_dtypes"):  # bfloat16, 8-bit floats
        return
    raise UsageError(f"--compare: reference key {key!r} holds {array.dtype} values; it must hold real numbers")


def _max_abs(array: np.ndarray) -> float:
    finite = np.abs(array[np.isfinite(array)]) if array.dtype.kind in "fc" else np.abs(array)
    return float(finite.max(initial=0.0))


def _compare_one(
    output: str, key: str, got: np.ndarray, want: np.ndarray, rtol: float, atol: float, floor: float
) -> TensorComparison:
    if got.shape != want.shape:
        return TensorComparison(output, key, float("inf"), 0.0, False, f"shape {list(got.shape)}, reference {list(want.shape)}")
    g, w = got.astype(np.float64), want.astype(np.float64)
    scale = max(_max_abs(w), _max_abs(g), floor)
    same_special = (np.isnan(g) & np.isnan(w)) | (np.isinf(g) & (g == w))
    diff = np.where(same_special, 0.0, np.abs(g - w))
    diff = np.where(np.isnan(diff), np.inf, diff)
    passed = bool(np.all(diff <= atol * scale + rtol * np.where(np.isfinite(w), np.abs(w), 0.0)))
    note = ""
    if not np.all(np.isfinite(g) == np.isfinite(w)) or not np.all(same_special | np.isfinite(g)):
        note = "non-finite values differ"
    return TensorComparison(output, key, float(diff.max(initial=0.0)), scale, passed, note)


# -- kinks ------------------------------------------------------------------------------------------


@dataclasses.dataclass
class KinkFlips:
    """Elements whose side of a kink differs between float32 and float64 runs of the same graph."""

    by_node: dict[str, int]  # "Relu node 'r1'" -> number of elements
    float64: dict[str, np.ndarray]  # the float64 run's outputs (for the compared ones)

    @property
    def total(self) -> int:
        return sum(self.by_node.values())


def _kink_operands(graph: ir.Graph) -> list[tuple[str, list[ir.Value]]]:
    """(label, values) per non-smooth node: one value (kink at 0) or two (kink where they are equal).

    Clip's bounds count when they are inputs (opset 11 and later), not attributes.
    """
    found = []
    for node in graph:
        if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None:
            continue
        label = f"{node.op_type} node {node_name(node)!r}"
        x = node.inputs[0]
        if node.op_type in _KINK_AT_ZERO:
            found.append((label, [x]))
        elif node.op_type in _KINK_BETWEEN and len(node.inputs) == 2 and node.inputs[1] is not None:
            found.append((label, [x, node.inputs[1]]))
        elif node.op_type == "Clip":
            found.extend((label, [x, bound]) for bound in node.inputs[1:3] if bound is not None)
    # A backward graph repeats the forward's kinks (Relu's gradient is a Greater of the same input
    # against 0): count each set of non-constant operands once.
    constant = {v.name for v in graph.initializers.values()} | {
        n.outputs[0].name for n in graph if n.op_type == "Constant" and n.outputs
    }
    kept, seen = [], set()
    for label, values in found:
        if any(v.dtype is not None and not v.dtype.is_floating_point() for v in values):
            continue  # integers are the same in both runs
        key = frozenset(v.name for v in values if v.name not in constant)
        if key not in seen:
            seen.add(key)
            kept.append((label, values))
    return kept


def _side(values: list[np.ndarray]) -> np.ndarray:
    a = values[0].astype(np.float64)
    b = values[1].astype(np.float64) if len(values) > 1 else 0.0
    return np.sign(a - b)


def _run_with_values(session, feeds: Mapping[str, np.ndarray], names: Sequence[str], outputs: Sequence[str]) -> dict:
    """The named outputs plus the named values (graph outputs, inputs, or initializers of ``session``)."""
    fetch = [n for n in dict.fromkeys([*outputs, *names]) if n not in feeds and n not in session.initializers]
    values = dict(session.run(feeds, outputs=fetch))
    for name in names:
        if name not in values:
            values[name] = feeds[name] if name in feeds else session.initializers[name]
    return values


def kink_flips(model: ir.Model, feeds: Mapping[str, np.ndarray], outputs: Sequence[str], device: str = "cpu") -> KinkFlips | None:
    """Run ``model`` in its own precision and as a float64 copy; count elements on different sides.

    Returns None when the model has no non-smooth op on floats. Raises GradgenError when the float64
    copy cannot run.
    """
    from gradgen.check import to_float64
    from gradgen.executor import Session

    copy = model.clone() if hasattr(model, "clone") else ir.from_proto(ir.to_proto(model))  # shares the weights
    operands = _kink_operands(copy.graph)
    if not operands:
        return None
    present = {v.name for v in copy.graph.outputs}
    for _, values in operands:
        for value in values:
            if value.name not in present and not value.is_graph_input() and not value.is_initializer():
                copy.graph.outputs.append(value)
                present.add(value.name)
    names = list(dict.fromkeys(value_name(v) for _, values in operands for v in values))
    low = _run_with_values(Session(copy, device=device), feeds, names, outputs)
    high_feeds = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    high = _run_with_values(Session(to_float64(copy), device=device), high_feeds, names, outputs)
    by_node: dict[str, int] = {}
    for label, values in operands:
        flipped = int(np.count_nonzero(_side([low[v.name] for v in values]) != _side([high[v.name] for v in values])))
        if flipped:
            by_node[label] = by_node.get(label, 0) + flipped
    return KinkFlips(by_node, {name: high[name] for name in outputs})


def diagnose_kinks(
    model: ir.Model,
    feeds: Mapping[str, np.ndarray],
    comparison: Comparison,
    reference: Mapping[str, np.ndarray],
    device: str = "cpu",
) -> list[str]:
    """Notes saying whether failed outputs may come from kinks decided by float rounding."""
    failed = [row for row in comparison.rows if not row.passed and not row.note.startswith("shape")]
    if not failed:
        return []
    try:
        flips = kink_flips(model, feeds, [row.output for row in failed], device=device)
    except GradgenError as exc:
        return [f"could not run a float64 copy of the model to look for kinks ({exc})"]
    if flips is None:
        return []
    if not flips.total:
        return [
            "no input of a non-smooth op (Relu, Max, Abs, Clip, ...) changes side between float32 and "
            "float64 runs: the differences do not come from kinks decided by rounding"
        ]
    shown = sorted(flips.by_node.items(), key=lambda item: -item[1])
    listed = ", ".join(f"{label}: {count}" for label, count in shown[:5])
    more = f" and {len(shown) - 5} more node(s)" if len(shown) > 5 else ""
    notes = [
        f"{flips.total} input element(s) of non-smooth ops lie on the other side of their kink in a float64 run "
        f"of this graph ({listed}{more}): rounding decides them, so the gradients may legitimately differ there"
    ]
    agree = []
    for row in failed:
        rerun = _compare_one(
            row.output,
            row.key,
            flips.float64[row.output],
            np.asarray(reference[row.key]),
            comparison.rtol,
            comparison.atol,
            row.scale,
        )
        if rerun.passed:
            agree.append(row.output)
    if agree:
        notes.append(f"the float64 run of this graph matches the reference for {', '.join(agree)}")
    return notes


def require_match(comparison: Comparison, skip_unmatched: bool) -> None:
    """Raise RunError naming every failed output and, unless skipped, every unmatched key."""
    problems = []
    if comparison.failures:
        problems.append(
            f"{len(comparison.failures)} output(s) differ from the reference: "
            f"{', '.join(comparison.failures)} (beyond {comparison.tolerance})"
        )
    if comparison.unmatched and not skip_unmatched:
        hint = f"; {comparison.hint}" if comparison.hint else ""
        problems.append(
            f"{len(comparison.unmatched)} reference key(s) match no output and were not compared: "
            f"{', '.join(comparison.unmatched)} (--skip-unmatched accepts that{hint})"
        )
    if problems:
        raise RunError("; ".join(problems))


__all__ = [
    "DEFAULT_TOLERANCES",
    "Comparison",
    "TensorComparison",
    "Tolerance",
    "compare_outputs",
    "compare_precision",
    "diagnose_kinks",
    "kink_flips",
    "match_reference",
    "require_match",
    "resolve_tolerance",
]
