"""gradgen's exceptions: every public error is one of these, with a message a user can act on.

The CLI maps each family to its own exit code (see README, "Exit codes"):
usage errors 2, model errors 3, run-time errors 4. Warnings the library raises reach a user as
notes (``warnings_said``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Iterator


@contextlib.contextmanager
def warnings_said(say: Callable[[str], None]) -> Iterator[None]:
    """The warnings raised inside the block, each distinct message once and in order, passed to
    ``say`` when the block ends, also when it raises (so they come before the error that follows)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for message in dict.fromkeys(str(warning.message) for warning in caught):
                say(message)


class GradgenError(Exception):
    """Base class of every error gradgen reports to a user."""

    exit_code = 1


class UsageError(GradgenError):
    """The command line or API call is wrong: bad option, missing file, bad output path."""

    exit_code = 2


class ModelError(GradgenError):
    """The model cannot be used: unreadable, malformed, unsupported ops, no loss."""

    exit_code = 3


class UnsupportedOpsError(ModelError):
    """Ops without a gradient rule or kernel; lists every offending node at once."""

    def __init__(self, what: str, offenders: list[tuple[str, str, str]]):
        # offenders: (domain, op_type, node name)
        self.offenders = offenders
        by_op: dict[tuple[str, str], list[str]] = {}
        for domain, op_type, node_name in offenders:
            by_op.setdefault((domain, op_type), []).append(node_name)
        lines = [f"{len(by_op)} op type(s) without {what}:"]
        for (domain, op_type), names in sorted(by_op.items()):
            qualified = f"{domain}::{op_type}" if domain not in ("", "ai.onnx") else op_type
            shown = ", ".join(repr(n) for n in names[:8])
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            lines.append(f"  {qualified}: node(s) {shown}{more}")
        super().__init__("\n".join(lines))


class RunError(GradgenError):
    """Running a model failed: wrong inputs, out-of-range indices, kernel failures."""

    exit_code = 4


class KernelError(RunError):
    """Raised inside a kernel; the executor adds the node name and op type."""
