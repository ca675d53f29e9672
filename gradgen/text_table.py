"""Fixed-width text tables, as gradgen's commands and benchmarks print them."""

from __future__ import annotations

from typing import Sequence


def format_table(header: Sequence[object], rows: Sequence[Sequence[object]], *, figures: bool = False) -> str:
    """``header`` over a rule of dashes, then ``rows``: columns two spaces apart, left-aligned (with
    ``figures``, every column but the first right-aligned), no trailing spaces."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if figures and i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths]), *(line(row) for row in cells[1:])])
