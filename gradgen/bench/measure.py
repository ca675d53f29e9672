"""What the end-to-end and CPU groups share: step timing, device memory, child processes, output.

Every framework is measured in its own child process (``python -m gradgen.bench.worker TASK``), so
that its device memory is its own: the driver-level used memory (total - free) after the timed
steps minus the same figure right after the child created its CUDA context.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from gradgen.text_table import format_table

MIB = 1 << 20


def time_steps(step: Callable[[], object], *, warmup: int, steps: int, after: Callable[[], object] | None = None) -> list[float]:
    """Wall-clock milliseconds of ``steps`` calls of ``step`` after ``warmup`` calls.

    ``step`` must return only when its work is done (it reads the loss back, or synchronises), so
    host time is step time. ``after`` runs after each timed step, outside the timing.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after()
    return times


def time_adaptive(step: Callable[[], object], *, warmup: int, max_steps: int, budget_s: float, min_steps: int = 3) -> list[float]:
    """Like ``time_steps``, but stops early once ``budget_s`` seconds are spent (at least ``min_steps``)."""
    for _ in range(warmup):
        step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_steps and (len(times) < min_steps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class DeviceMemory:
    """Driver-level used device memory relative to a baseline taken at construction (right after the
    CUDA context exists). ``query`` returns (free, total) bytes, e.g. ``torch.cuda.mem_get_info``."""

    def __init__(self, query: Callable[[], tuple[int, int]]):
        self._query = query
        self.baseline = self._used()
        self.max_seen = 0

    def _used(self) -> int:
        free, total = self._query()
        return int(total) - int(free)

    def sample(self) -> int:
        """Used bytes above the baseline now (and remember the largest seen)."""
        used = self._used() - self.baseline
        self.max_seen = max(self.max_seen, used)
        return used


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether an exception (or its cause) says that the device ran out of memory."""
    current: BaseException | None = exc
    while current is not None:
        text = f"{type(current).__name__}: {current}".lower()
        if "out_of_memory" in text or "out of memory" in text or type(current).__name__ == "OutOfMemoryError":
            return True
        if type(current).__name__ == "MemoryError" and type(current).__module__.startswith("pycuda"):
            return True
        current = current.__cause__ or current.__context__
    return False


def error_text(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Child processes


def run_child(job: str, task: dict, workdir: Path, *, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """Run one worker job in a fresh Python process and return its result dict.

    The task is written to ``workdir`` as JSON; the worker writes its result next to it. A child
    that crashes, times out or writes no result gives ``{"error": ...}`` instead of raising, so
    the group goes on with the next measurement.
    """
    import gradgen

    workdir.mkdir(parents=True, exist_ok=True)
    stem = f"{job}-{task.get('label', 'task')}".replace("/", "_").replace(" ", "_")
    task_path, result_path = workdir / f"{stem}.task.json", workdir / f"{stem}.result.json"
    result_path.unlink(missing_ok=True)
    task_path.write_text(json.dumps({**task, "job": job, "result": str(result_path)}))
    child_env = dict(os.environ if env is None else env)
    child_env.pop("GRADGEN_ALLOW_TF32", None)  # fp32 everywhere: no TF32 for gradgen either
    child_env["PYTHONUNBUFFERED"] = "1"
    package_root = str(Path(gradgen.__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
    sys.stdout.flush()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "gradgen.bench.worker", str(task_path)], env=child_env, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if result_path.exists():
        return json.loads(result_path.read_text())
    return {"error": f"the child process exited with code {proc.returncode} without a result"}


def write_json_atomic(path: Path, data) -> None:
    """Write ``data`` as JSON to a temporary file beside ``path``, then rename it over ``path``;
    a failure (an OS error, data that is not JSON-able, Ctrl-C) removes the temporary file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1, default=_jsonable))
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---------------------------------------------------------------------------------------------
# Formatting


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.1f}" if ms >= 100 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3f}"


def fmt_mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:,.0f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den == 0:
        return "-"
    return f"{num / den:.2f}x"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width table (first column left-aligned, the others right-aligned)."""
    return format_table(headers, rows, figures=True)
