"""Loading registries from explicit lists of family modules.

A registry (gradient rules, CPU kernels, CUDA launchers, lowerings) names the modules that fill its
table; ``Families.load`` imports them once, on the first lookup. A failed import is remembered, so
that every later lookup reports it instead of calling every op unsupported.
"""

from __future__ import annotations

import importlib
from typing import Sequence


class Families:
    """The family modules ``package.<name>`` of one registry, imported once on demand."""

    def __init__(self, package: str, names: Sequence[str]):
        self.package = package
        self.names = tuple(names)
        self._loaded = False
        self._error: Exception | None = None

    def load(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"gradgen's registry failed to load: {self._error}") from self._error
        if self._loaded:
            return
        self._loaded = True
        try:
            for name in self.names:
                importlib.import_module(f"{self.package}.{name}")
        except Exception as exc:  # later lookups must not report every op as unsupported
            self._error = exc
            raise
