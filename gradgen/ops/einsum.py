"""Einsum semantics: parsing an equation, its implicit output and its ellipsis, once.

ONNX's Einsum is numpy's: a label repeated within one operand takes that operand's diagonal
('ii->i', 'bii->b'); a label absent from the output is summed; without '->' the output is every
label used exactly once in the whole equation, sorted by ASCII code (upper case first), after the
ellipsis. An ellipsis stands for the same leading batch dims in every term that has one,
right-aligned and broadcast as numpy broadcasts (so operands may give it different ranks); an
explicit output without '...' sums those dims (as torch.einsum does; numpy refuses that form).

``explicit_equation`` turns any equation into one without ellipsis or implicit output (fresh
letters for the ellipsis dims, given the operands' ranks): the CPU kernel runs that form with
numpy, and the gradient rule reasons on it.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Sequence

from gradgen.errors import KernelError

ELLIPSIS = "..."
LETTERS = string.ascii_uppercase + string.ascii_lowercase  # ONNX's labels, in ASCII order


@dataclasses.dataclass(frozen=True)
class Equation:
    """An Einsum equation, parsed: each term a tuple of labels, an ellipsis one '...' label."""

    inputs: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]

    def __str__(self) -> str:
        return ",".join("".join(t) for t in self.inputs) + "->" + "".join(self.output)

    def letters(self) -> set[str]:
        return {lab for term in (*self.inputs, self.output) for lab in term if lab != ELLIPSIS}


def _labels(term: str, equation: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(term):
        if term.startswith(ELLIPSIS, i):
            if ELLIPSIS in out:
                raise KernelError(f"Einsum equation {equation!r}: term {term!r} has more than one ellipsis")
            out.append(ELLIPSIS)
            i += 3
        elif term[i] in LETTERS:
            out.append(term[i])
            i += 1
        else:
            raise KernelError(f"Einsum equation {equation!r}: {term[i]!r} is not a label (letters a-z, A-Z, and '...')")
    return tuple(out)


def parse_equation(equation: str, num_inputs: int) -> Equation:
    """The equation's terms, the output made explicit; KernelError when it is malformed."""
    text = equation.replace(" ", "")
    if text.count("->") > 1:
        raise KernelError(f"Einsum equation {equation!r} has more than one '->'")
    lhs, arrow, rhs = text.partition("->")
    terms = tuple(_labels(t, equation) for t in lhs.split(","))
    if len(terms) != num_inputs:
        raise KernelError(f"Einsum equation {equation!r} has {len(terms)} operand(s), the node has {num_inputs} input(s)")
    if arrow:
        output = _labels(rhs, equation)
        used = {lab for t in terms for lab in t}
        for lab in output:
            if output.count(lab) > 1:
                raise KernelError(f"Einsum equation {equation!r}: output label {lab!r} appears more than once")
            if lab not in used:
                raise KernelError(f"Einsum equation {equation!r}: output label {lab!r} is in no operand")
    else:
        counts: dict[str, int] = {}
        for t in terms:
            for lab in t:
                counts[lab] = counts.get(lab, 0) + 1
        once = sorted(lab for lab, n in counts.items() if n == 1 and lab != ELLIPSIS)
        output = ((ELLIPSIS,) if ELLIPSIS in counts else ()) + tuple(once)
    return Equation(terms, output)


def ellipsis_ranks(equation: Equation, ranks: Sequence[int]) -> list[int]:
    """How many dims the ellipsis covers in each operand (0 where it has none); KernelError when
    an operand's rank does not fit its term."""
    covered = []
    for i, (term, rank) in enumerate(zip(equation.inputs, ranks)):
        named = len(term) - (ELLIPSIS in term)
        if (ELLIPSIS in term and named > rank) or (ELLIPSIS not in term and named != rank):
            raise KernelError(f"Einsum equation {equation}: operand {i} ({''.join(term)!r}) does not fit its rank {rank}")
        covered.append(rank - named)
    return covered


def fresh_letters(taken: set[str], count: int, equation: object) -> list[str]:
    """``count`` labels not in ``taken`` (KernelError when the 52 letters run out)."""
    free = [c for c in LETTERS if c not in taken]
    if count > len(free):
        raise KernelError(f"Einsum equation {equation}: more than 52 distinct labels are needed")
    return free[:count]


def check_label_sizes(equation: Equation, shapes: Sequence[Sequence[int]]) -> None:
    """KernelError unless every label of an explicit equation has one size across the operands
    (1 broadcasts against n, as numpy's einsum allows), each operand's rank its term's length."""
    text = str(equation)
    sizes: dict[str, tuple[int, int]] = {}  # label -> (its size other than 1, the input it is from)
    for k, (term, shape) in enumerate(zip(equation.inputs, shapes)):
        if len(term) != len(shape):
            raise KernelError(f"Einsum equation {text!r}: input {k} has rank {len(shape)}, its term {len(term)} labels")
        for label, size in zip(term, shape):
            seen = sizes.get(label)
            if size != 1 and seen is not None and seen[0] != size:
                raise KernelError(
                    f"Einsum equation {text!r}: label {label!r} has size {seen[0]} in input {seen[1]} and {size} in input {k}"
                )
            if size != 1 and seen is None:
                sizes[label] = (int(size), k)


def explicit_equation(equation: Equation, ranks: Sequence[int]) -> Equation:
    """The same contraction without an ellipsis: its dims get fresh letters, right-aligned."""
    covered = ellipsis_ranks(equation, ranks)
    if not any(ELLIPSIS in t for t in (*equation.inputs, equation.output)):
        return equation
    batch = fresh_letters(equation.letters(), max(covered), equation)

    def expand(term: tuple[str, ...], count: int) -> tuple[str, ...]:
        if ELLIPSIS not in term:
            return term
        k = term.index(ELLIPSIS)
        return term[:k] + tuple(batch[len(batch) - count :]) + term[k + 1 :]

    inputs = tuple(expand(t, n) for t, n in zip(equation.inputs, covered))
    return Equation(inputs, expand(equation.output, len(batch)))
