"""The CPU backend's run as a prepared program: one generated straight-line function (or, for very
large programs and observed runs, one closure per step over a list of value slots).

A Session's generic run loop (``Session._execute``, which the CUDA backend uses) looks every
argument up by name in a dict, asks the backend to run the step and stores each result by name:
about 1-2 us of Python per step, which on a small model (a few hundred nodes on tiny tensors) is
most of the step's time. Here everything that does not depend on the values is resolved once:
each value name becomes an index into a list, and each step becomes a closure specialised for
what it needs. A plain step (no 16-bit float can reach it, no input it may write over, one output)
is just ``v[out] = call(v[a], v[b])`` and the frees; the others go through the backend's
``run_step`` (float32 for 16-bit floats, results written over dying inputs) with the same
arguments the generic loop passes it, so both loops compute the same bits.

The straight-line function (``_StraightLineWriter``) makes the same calls in the same order with
local variables instead of list slots and closures: ``v7 = k12(v3, v5)`` then ``del v3``.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Callable

import numpy as np

from gradgen.kernels.cpu.blas import numpy_blas_single_threaded

# below this size a fresh result costs less than checking whether an input can take it (numpy keeps
# small blocks for reuse itself); in place pays on large arrays, whose memory is reused while hot
IN_PLACE_MIN_BYTES = 64 * 1024

# The straight-line function costs CPython's compiler about 50 us a step, once; it saves about 0.1-0.3
# us a step on every run. So a program runs as closures for its first STRAIGHT_LINE_AFTER_RUNS runs
# and is compiled at the next (a one-off `gradgen run` never pays for it; a training loop gets it
# early), and only up to STRAIGHT_LINE_MAX_STEPS steps (beyond that the kernels dominate a run
# and the compile would be a pause of a quarter of a second or more).
STRAIGHT_LINE_AFTER_RUNS = 256
STRAIGHT_LINE_MAX_STEPS = 5_000

_ABSENT = 0  # the slot of an omitted optional input: always None
_DISCARDED = 1  # where the outputs nobody names go


class CpuProgram:
    """``program(feeds) -> values``: every step of the plan, run on numpy arrays.

    ``steps`` are the Session's prepared steps (``Step.call``, ``free_after``, ``reuse``);
    ``run_step(step, args)`` is the backend's general path; ``fail(step, exc, args)`` raises the
    error that names the node; ``observer(step, args, result)``, if given, is called after every
    step (a slower program: every step goes through the general runner). The values returned are
    the constants, the feeds and the graph outputs (what a Session reads after a run).
    """

    def __init__(
        self,
        steps: list,
        constants: dict[str, np.ndarray],
        output_names: list[str],
        run_step: Callable,
        fail: Callable,
        observer: Callable | None = None,
    ) -> None:
        self._slots: dict[str, int] = {}
        self._template: list[Any] = [None, None]
        for name in constants:
            self._template[self._slot(name)] = constants[name]
        for step in steps:
            for name in [*step.inputs, *step.outputs]:
                if name:
                    self._slot(name)
        self._constants = constants
        self._steps = steps
        self._outputs = [(name, self._slots[name]) for name in output_names if name in self._slots]
        self._run_step = run_step
        self._fail = fail
        self._observer = observer
        self._runners = [self._runner(step) for step in steps]
        self._straight: Callable[[dict], tuple] | None = None
        eligible = observer is None and len(steps) <= STRAIGHT_LINE_MAX_STEPS
        self._runs_before_straight: int | None = STRAIGHT_LINE_AFTER_RUNS if eligible else None

    def _slot(self, name: str) -> int:
        index = self._slots.get(name)
        if index is None:
            index = self._slots[name] = len(self._template)
            self._template.append(None)
        return index

    def __call__(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._runs_before_straight is not None:
            self._count_run()
        if self._straight is not None:
            with numpy_blas_single_threaded():
                produced = self._straight(feeds)
            return self._result(feeds, produced)
        values = self._template.copy()
        slots = self._slots
        for name, value in feeds.items():
            index = slots.get(name)
            if index is not None:
                values[index] = value
        with numpy_blas_single_threaded():
            for position, run in enumerate(self._runners):
                try:
                    run(values)
                except Exception as exc:  # noqa: BLE001 -- fail() raises the error that names the node
                    step = self._steps[position]
                    self._fail(step, exc, tuple(values[slots[n]] if n else None for n in step.inputs))
                    raise
        return self._result(feeds, [values[index] for _, index in self._outputs])

    def _result(self, feeds: dict[str, np.ndarray], produced) -> dict[str, np.ndarray]:
        """What a run returns: the constants, the feeds and the graph outputs (``produced``, in
        ``self._outputs``' order)."""
        result = dict(self._constants)
        result.update(feeds)
        result.update(zip((name for name, _ in self._outputs), produced))
        return result

    def _runner(self, step) -> Callable[[list], None]:
        """The closure that runs ``step`` on the value list."""
        inputs = tuple(self._slots[name] if name else _ABSENT for name in step.inputs)
        outputs = tuple(self._slots[name] if name else _DISCARDED for name in step.outputs)
        frees = tuple(self._slots[name] for name in step.free_after)
        if _DISCARDED in outputs:
            frees += (_DISCARDED,)  # an output nobody reads dies at its step
        if step.low_precision or step.may_read_low_precision:
            execute = self._run_step
        elif step.reuse:
            if len(outputs) == 1 and len(inputs) == 2 and _ABSENT not in inputs and self._observer is None:
                return _in_place_runner(step, inputs, outputs[0], frees)
            execute = call_in_place
        elif len(outputs) == 1 and len(inputs) <= 2 and self._observer is None:
            return _plain_runner(step.call, inputs, outputs[0], frees)
        else:
            execute = _call_step
        if self._observer is not None:
            execute = _observed(execute, self._observer)
        return _general_runner(step, execute, _getter(inputs), outputs, frees)

    def _straight_line(self) -> Callable[[dict], tuple] | None:
        """The whole program as one generated Python function of local variables (``feeds ->``
        the produced graph outputs): each step is a line calling its prepared kernel, each free a
        ``del``. It computes what the runners compute, in the same order with the same calls,
        without a closure call and list accesses per step (about 0.3 us a step: a fifth of a
        small model's run). None where some step cannot be written so."""
        if _SOLE_REFERENCES != _sole_references_of_a_local():
            return None  # in-place steps count references; the counts must match the runners'
        writer = _StraightLineWriter(self._constants)
        for position, step in enumerate(self._steps):
            writer.add(position, step, self._run_step)
        writer.finish([name for name, _ in self._outputs])
        return writer.compile(_failure_reporter(self._steps, self._fail))

    def _count_run(self) -> None:
        """After STRAIGHT_LINE_AFTER_RUNS runs, compile the straight-line function (this run is the
        first to use it); a program that cannot be written so keeps its closures."""
        if self._runs_before_straight:
            self._runs_before_straight -= 1
            return
        self._runs_before_straight = None
        try:
            self._straight = self._straight_line()
        except Exception:  # noqa: BLE001 -- the closures compute the same: a failed compile loses only speed
            self._straight = None


def _failure_reporter(steps: list, fail: Callable) -> Callable:
    """``report(position, exc, local_values, names)``: the failure of the generated program's step at
    ``position`` reported as the runners report it. It holds the steps, not the program: the
    generated function's namespace must not lead back to the program (a cycle would keep the
    weights alive until the cyclic collector ran)."""

    def report(position: int | None, exc: Exception, local_values: dict, names: dict) -> None:
        try:
            if position is None:
                return
            step = steps[position]
            fail(step, exc, tuple(local_values.get(names[n]) if n else None for n in step.inputs))
        finally:
            # on Python 3.11 ``locals()`` is the frame's own dict, which now holds the exception,
            # whose traceback holds the frame: cleared, every array of the failed run dies with it
            local_values.clear()

    return report


def _getter(inputs: tuple[int, ...]) -> Callable[[list], tuple]:
    if not inputs:
        return lambda values: ()
    if len(inputs) == 1:
        only = inputs[0]
        return lambda values: (values[only],)
    return operator.itemgetter(*inputs)


def _as_array(result) -> np.ndarray:
    return result if type(result) is np.ndarray else np.asarray(result)


def _first_output(result) -> np.ndarray | None:
    """A kernel's result for a step of one output: a tuple's first element (kernels of
    multi-output ops return tuples), anything else as an array."""
    if isinstance(result, tuple):
        return _as_array(result[0]) if result else None
    return _as_array(result)


def _plain_runner(call, inputs: tuple[int, ...], out: int, frees: tuple[int, ...]) -> Callable[[list], None]:
    """A step of at most two inputs and one output that runs its prepared call as it is."""
    ndarray = np.ndarray
    if len(inputs) == 2:
        a, b = inputs

        def run(values: list) -> None:
            result = call(values[a], values[b])
            values[out] = result if type(result) is ndarray else _first_output(result)
            for index in frees:
                values[index] = None

    elif len(inputs) == 1:
        (a,) = inputs

        def run(values: list) -> None:
            result = call(values[a])
            values[out] = result if type(result) is ndarray else _first_output(result)
            for index in frees:
                values[index] = None

    else:

        def run(values: list) -> None:
            result = call()
            values[out] = result if type(result) is ndarray else _first_output(result)
            for index in frees:
                values[index] = None

    return run


def _in_place_runner(step, inputs: tuple[int, int], out: int, frees: tuple[int, ...]) -> Callable[[list], None]:
    """A two-input, one-output step that may write over a dying input (``Step.reuse``): below
    ``IN_PLACE_MIN_BYTES`` at every such input it runs as a plain step, without the general
    runner's calls (most steps of a small model); otherwise through ``call_in_place``."""
    ndarray = np.ndarray
    call = step.call
    a, b = inputs
    first, *others = (inputs[position] for position in step.reuse)
    second = others[0] if others else first  # both inputs watched, or the one twice

    def run(values: list) -> None:
        if getattr(values[first], "nbytes", 0) < IN_PLACE_MIN_BYTES and getattr(values[second], "nbytes", 0) < IN_PLACE_MIN_BYTES:
            result = call(values[a], values[b])
        else:  # no local names hold the arguments: overwritable() counts their references
            result = call_in_place(step, (values[a], values[b]))
        values[out] = result if type(result) is ndarray else _first_output(result)
        for index in frees:
            values[index] = None

    return run


def _call_step(step, args: tuple):
    return step.call(*args)


def call_in_place(step, args: tuple):
    """Run ``step`` on ``args``, its result written over an input that dies at it (``Step.reuse``)
    where that input is a large array nothing else refers to (``overwritable``)."""
    for position in step.reuse:
        if overwritable(args, position):
            result = step.into(position, *args)
            if result is not None:
                return result
    return step.call(*args)


def _observed(execute: Callable, observer: Callable) -> Callable:
    def run_and_tell(step, args: tuple):
        result = execute(step, args)
        observer(step, args, result)
        return result

    return run_and_tell


def _general_runner(step, run_step, gather, outputs: tuple[int, ...], frees: tuple[int, ...]) -> Callable[[list], None]:
    """Any step, through the backend's ``run_step``: a tuple result fills the outputs in order, a
    single result the first output."""
    first = outputs[0] if outputs else _DISCARDED

    def run(values: list) -> None:
        result = run_step(step, gather(values))
        if isinstance(result, tuple):
            for index, value in zip(outputs, result):
                values[index] = _as_array(value)
        else:
            values[first] = _as_array(result)
        for index in frees:
            values[index] = None

    return run


def _references(args: tuple, position: int) -> int:
    return sys.getrefcount(args[position])


def _references_of_a_sole_value() -> int:
    """What ``_references`` counts for an array that only the run's values and the step's
    arguments hold (measured, so that it holds for any interpreter's counting)."""
    values = [np.empty(1)]
    args = (values[0],)
    return _references(args, 0)


_SOLE_REFERENCES = _references_of_a_sole_value()


def overwritable(args: tuple, position: int) -> bool:
    """The argument at ``position`` (which dies at this step: ``Step.reuse``) may take the step's
    result: an array of at least ``IN_PLACE_MIN_BYTES`` that owns its memory, writable and
    C-contiguous, that nothing but the run's values and these arguments refers to (no view of it,
    no kernel cache, no caller)."""
    if getattr(args[position], "nbytes", 0) < IN_PLACE_MIN_BYTES or _references(args, position) != _SOLE_REFERENCES:
        return False
    value = args[position]
    return type(value) is np.ndarray and value.flags.owndata and value.flags.writeable and value.flags.c_contiguous


def _sole_references_of_a_local() -> int:
    """What ``_references`` counts for an array only a generated program's local variable and the
    step's arguments hold (it must equal ``_SOLE_REFERENCES`` for ``overwritable`` to hold there)."""
    namespace: dict = {"np": np, "_references": _references}
    exec("def probe():\n    value = np.empty(1)\n    return _references((value,), 0)\n", namespace)  # noqa: S102
    return namespace["probe"]()


class _StraightLineWriter:
    """Writes a ``CpuProgram`` as Python source: a local variable per value, a line per step.

    Kernels, steps and constants are names in the function's namespace (``k3``, ``s3``, ``c_v0``);
    a feed is read once with ``feeds.get``. A failure is reported for the step of the line that
    raised, with the locals alive then (the failing step's inputs are freed only after it)."""

    def __init__(self, constants: dict[str, np.ndarray]) -> None:
        self.namespace: dict[str, Any] = {
            "ndarray": np.ndarray,
            "first_output": _first_output,
            "call_in_place": call_in_place,
            "spread": _spread,
            "program_module": sys.modules[__name__],
        }
        self.names: dict[str, str] = {}  # value name -> its local variable
        self.head: list[str] = []  # reads of the constants and feeds
        self.body: list[str] = []
        self.body_steps: list[int] = []  # the step each body line belongs to
        self.constants = constants

    def _local(self, name: str | None) -> str:
        """The local variable of an input (None for an omitted optional input)."""
        if not name:
            return "None"
        local = self.names.get(name)
        if local is None:
            local = self.names[name] = f"v{len(self.names)}"
            if name in self.constants:
                self.namespace[f"c_{local}"] = self.constants[name]
                self.head.append(f"{local} = c_{local}")
            else:
                self.head.append(f"{local} = feeds.get({name!r})")
        return local

    def _target(self, name: str | None) -> str:
        """The local variable an output is written to ('_' for one nobody reads)."""
        if not name:
            return "_"
        local = self.names[name] = f"v{len(self.names)}"
        return local

    def add(self, position: int, step, run_step: Callable) -> None:
        """The lines of one step, chosen as ``CpuProgram._runner`` chooses its runner."""
        inputs = [self._local(name) for name in step.inputs]
        args = ", ".join(inputs)
        self.namespace[f"k{position}"] = step.call
        self.namespace[f"s{position}"] = step
        kernel, outputs = f"k{position}", list(step.outputs)
        single = len(outputs) == 1
        targets = [self._target(name) for name in outputs]
        lines: list[str] = []
        if step.low_precision or step.may_read_low_precision:
            lines += self._general(position, run_step, args, targets)
        elif step.reuse:
            if single and len(inputs) == 2 and "None" not in inputs:
                first, second = inputs[step.reuse[0]], inputs[step.reuse[-1]]  # both watched, or the one twice
                small = "program_module.IN_PLACE_MIN_BYTES"
                lines += [
                    f"if getattr({first}, 'nbytes', 0) < {small} and getattr({second}, 'nbytes', 0) < {small}:",
                    f"    {targets[0]} = {kernel}({args})",
                    "else:",
                    f"    {targets[0]} = call_in_place(s{position}, ({args}))",
                    *self._first_output(targets[0]),
                ]
            else:
                lines += self._general(position, call_in_place, args, targets)
        elif single and len(inputs) <= 2:
            lines += [f"{targets[0]} = {kernel}({args})", *self._first_output(targets[0])]
        else:
            lines += self._general(position, _call_step, args, targets)
        freed = [self.names[name] for name in step.free_after if name in self.names]
        if "_" in targets:
            freed.append("_")  # an output nobody reads dies at its step
        if freed:
            lines.append(f"del {', '.join(dict.fromkeys(freed))}")
        self.body += lines
        self.body_steps += [position] * len(lines)

    @staticmethod
    def _first_output(target: str) -> list[str]:
        return [f"if type({target}) is not ndarray:", f"    {target} = first_output({target})"]

    def _general(self, position: int, execute: Callable, args: str, targets: list[str]) -> list[str]:
        """Lines that run a step through ``execute(step, args)`` (``_general_runner``'s way)."""
        self.namespace[f"r{position}"] = execute
        packed = f"({args},)" if args and "," not in args else f"({args})"
        call = f"spread(r{position}(s{position}, {packed}), {len(targets)})"
        return [f"{', '.join(targets)}, = {call}" if targets else call]

    def finish(self, outputs: list[str]) -> None:
        self.returned = ", ".join(self._local(name) for name in outputs)

    def compile(self, fail_at: Callable) -> Callable[[dict], tuple]:
        """The function, whose failures are reported for the step of the line that raised (the
        first traceback entry is the generated function's own frame)."""
        indent = "        "
        lines = [
            "def straight_line_program(feeds):",
            "    try:",
            *(indent + line for line in self.head),
            *(indent + line for line in self.body),
            "    except Exception as exc:",
            "        fail_at(step_of_line(exc.__traceback__.tb_lineno), exc, locals(), value_names)",
            "        raise",
            f"    return ({self.returned}{',' if self.returned and ',' not in self.returned else ''})",
        ]
        first_body_line = 3 + len(self.head)  # 1-based: def, try, the head's lines
        steps = self.body_steps

        def step_of_line(line: int) -> int | None:
            index = line - first_body_line
            return steps[index] if 0 <= index < len(steps) else None

        self.namespace.update(fail_at=fail_at, value_names=dict(self.names), step_of_line=step_of_line)
        exec(compile("\n".join(lines), "<gradgen CPU program>", "exec"), self.namespace)  # noqa: S102 -- our own generated source
        # the function's globals are the namespace: kept there, it would refer to itself (a cycle)
        return self.namespace.pop("straight_line_program")


def _spread(result, count: int) -> tuple:
    """A general step's outputs: a tuple's elements in order (None past its end), or one result."""
    if isinstance(result, tuple):
        return tuple(_as_array(result[k]) if k < len(result) else None for k in range(count))
    return (_as_array(result),) + (None,) * (count - 1)
