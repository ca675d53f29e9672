"""Static memory planning: offsets in one arena for buffers with known sizes and lifetimes.

A run of a plan executes its steps in a fixed order, so every buffer it allocates has a size and a
lifetime: the first step at which it exists and the last step at which it may still be read (both
inclusive). Two buffers may share bytes only when their lifetimes are disjoint. ``plan_offsets``
assigns each buffer an offset in one arena so that no two buffers that are live at the same step
overlap, and the arena is as small as the heuristic finds: greedy by size with best fit, the
scheme of TensorFlow Lite's and XLA's offset planners (the largest buffers are placed first; each
goes into the smallest gap, among the buffers already placed whose lifetimes meet its own, that
holds it, or on top of them). The order matters (on GPT-2's backward graph, four same-size buffers
placed by lifetime length took four slots where three suffice), so a few orders are tried, one of
them by birth rather than size, and the smallest arena kept. ``peak_live_bytes`` is the lower bound no plan can beat: the
largest sum of the sizes of the buffers live at one step.

``merge_aliases`` joins buffers that share their bytes on purpose (an elementwise op writing its
output over an input that dies at that step) into one buffer before planning.

Nothing here knows about devices: the CUDA backend plans its device arena with it, and the same
functions can plan host buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

DEFAULT_ALIGNMENT = 256  # bytes; what cudaMalloc guarantees, and more than any vectorised kernel needs


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer to place: ``size`` bytes, live from step ``first`` through step ``last``."""

    size: int
    first: int
    last: int

    def __post_init__(self):
        if self.size < 0:
            raise ValueError(f"buffer size {self.size} is negative")
        if self.last < self.first:
            raise ValueError(f"buffer lifetime [{self.first}, {self.last}] ends before it starts")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Where each buffer goes (``offsets[i]`` for ``buffers[i]``) and the arena size in bytes."""

    offsets: tuple[int, ...]
    size: int
    alignment: int


def aligned(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment`` (at least one unit for a non-empty buffer)."""
    return -(-int(nbytes) // alignment) * alignment


def plan_offsets(buffers: Sequence[Buffer], alignment: int = DEFAULT_ALIGNMENT) -> MemoryPlan:
    """Offsets (multiples of ``alignment``) such that buffers live at the same step never overlap:
    best fit in each of the orders of ``_ORDERS``; the smallest arena wins."""
    n = len(buffers)
    sizes = np.array([aligned(b.size, alignment) for b in buffers], dtype=np.int64)
    firsts = np.array([b.first for b in buffers], dtype=np.int64)
    lasts = np.array([b.last for b in buffers], dtype=np.int64)
    best = None
    for key in _ORDERS:
        order = sorted(range(n), key=lambda i: (*key(sizes[i], firsts[i], lasts[i]), i))
        offsets, top = _place(order, sizes, firsts, lasts)
        if best is None or top < best[1]:
            best = (offsets, top)
    offsets, top = best if best is not None else (np.zeros(0, dtype=np.int64), 0)
    return MemoryPlan(tuple(int(o) for o in offsets), int(top), alignment)


# The orders tried: the largest first, ties broken by the longest-lived, by the earliest (optimal for
# buffers of one size: interval colouring in order of start) or by the earliest death; and, not by
# size, the earliest first (the largest first among those born at one step), which packs buffers of
# different sizes born one after another where the size order leaves a gap too small to use (a case
# where the size orders take 22 bytes and the optimum, which this order finds, 14:
# tests/test_memory_plan.py).
_ORDERS = (
    lambda size, first, last: (-size, -(last - first), first),
    lambda size, first, last: (-size, first, -(last - first)),
    lambda size, first, last: (-size, last, first),
    lambda size, first, last: (first, -size, -(last - first)),
)


def _place(order, sizes: np.ndarray, firsts: np.ndarray, lasts: np.ndarray) -> tuple[np.ndarray, int]:
    """Best-fit placement of the buffers in ``order``: (offsets, arena size)."""
    n = len(sizes)
    offsets = np.zeros(n, dtype=np.int64)
    placed_first = np.empty(n, dtype=np.int64)
    placed_last = np.empty(n, dtype=np.int64)
    placed_start = np.empty(n, dtype=np.int64)
    placed_end = np.empty(n, dtype=np.int64)
    count, top = 0, 0
    for i in order:
        size = int(sizes[i])
        if size == 0:
            continue
        meets = (placed_first[:count] <= lasts[i]) & (placed_last[:count] >= firsts[i])
        offset = _best_fit(placed_start[:count][meets], placed_end[:count][meets], size)
        offsets[i] = offset
        placed_first[count], placed_last[count] = firsts[i], lasts[i]
        placed_start[count], placed_end[count] = offset, offset + size
        count += 1
        top = max(top, offset + size)
    return offsets, top


def merge_aliases(buffers: Sequence[Buffer], aliases: Sequence[tuple[int, int]]) -> tuple[list[Buffer], list[int]]:
    """Join buffers that must share their bytes: each pair (i, j) puts buffer j at buffer i's offset.

    Returns the joined buffers (one per group: the largest size, the union of the lifetimes) and,
    for each input buffer, the index of its group. A pair is only sound when i dies at the step
    where j is made (the caller checks: ``j``'s writer reads each element of ``i`` before writing
    the same element of ``j``)."""
    parent = list(range(len(buffers)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in aliases:
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[rj] = ri
    groups: dict[int, int] = {}
    joined: list[list[int]] = []
    member_of = []
    for index, b in enumerate(buffers):
        r = root(index)
        if r not in groups:
            groups[r] = len(joined)
            joined.append([b.size, b.first, b.last])
        g = joined[groups[r]]
        g[0], g[1], g[2] = max(g[0], b.size), min(g[1], b.first), max(g[2], b.last)
        member_of.append(groups[r])
    return [Buffer(*g) for g in joined], member_of


def _best_fit(starts: np.ndarray, ends: np.ndarray, size: int) -> int:
    """The start of the smallest free gap of at least ``size`` bytes below or between the occupied
    intervals [starts, ends) (which may overlap one another); above them all if none fits."""
    if starts.size == 0:
        return 0
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    reach = np.maximum.accumulate(ends)  # the highest byte covered by the intervals so far
    gap_start = np.concatenate(([0], reach[:-1]))
    gap = starts - gap_start
    fits = np.flatnonzero(gap >= size)
    if fits.size == 0:
        return int(reach[-1])
    best = fits[np.argmin(gap[fits])]  # argmin takes the lowest offset among equal gaps
    return int(gap_start[best])


def peak_live_bytes(buffers: Sequence[Buffer], alignment: int = DEFAULT_ALIGNMENT) -> int:
    """The largest total (aligned) size of the buffers live at one step: no plan is smaller."""
    if not buffers:
        return 0
    events: dict[int, int] = {}
    for b in buffers:
        size = aligned(b.size, alignment)
        events[b.first] = events.get(b.first, 0) + size
        events[b.last + 1] = events.get(b.last + 1, 0) - size
    live = peak = 0
    for step in sorted(events):
        live += events[step]
        peak = max(peak, live)
    return peak


def overlaps(buffers: Sequence[Buffer], plan: MemoryPlan) -> list[tuple[int, int]]:
    """Pairs (i, j) of buffers live at a common step whose planned bytes overlap (empty when the
    plan is sound); also flags offsets that are misaligned or reach past the arena as (i, i)."""
    bad = []
    spans = []
    for i, (b, offset) in enumerate(zip(buffers, plan.offsets)):
        size = aligned(b.size, plan.alignment)
        if size and (offset % plan.alignment or offset < 0 or offset + size > plan.size):
            bad.append((i, i))
        spans.append((offset, offset + size))
    for i in range(len(buffers)):
        for j in range(i + 1, len(buffers)):
            a, b = buffers[i], buffers[j]
            if a.first <= b.last and b.first <= a.last:
                (s1, e1), (s2, e2) = spans[i], spans[j]
                if s1 < e2 and s2 < e1:
                    bad.append((i, j))
    return bad
