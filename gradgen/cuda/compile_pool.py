"""Where CUDA compiles run: threads of this process, or worker processes.

NVRTC does not scale over threads of one process: on the 16-core H100 machine the same 38 compiles
took 16.9 s on 16 threads and 11.4 s on 16 processes. So a cold start compiles with NVRTC in
worker processes, one per core, each a fresh interpreter (``python -m gradgen.cuda.compile_pool``)
that reads compile jobs on stdin and writes the results on stdout. Fresh interpreters rather than
``multiprocessing``: a fork would copy a parent that may hold a CUDA context, and ``spawn`` would
re-import the user's ``__main__`` script in every worker. The workers start at the first compile
and end with the pool. ``GRADGEN_CUDA_COMPILE_PROCESSES=0`` compiles in threads instead.

Both pools are ``concurrent.futures`` executors (``submit`` runs a callable on a thread) with one
more method, ``compile(using, source, arch, part, output)``: the future of a cubin (or PTX text).
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from gradgen.cuda.compile import Compiler, Source, compiler
from gradgen.errors import KernelError

OUTPUTS = ("cubin", "ptx")
_FRAME = struct.Struct("<Q")


def compile_one(using: Compiler, source: Source, arch: str, part: int | None = None, output: str = "cubin") -> bytes:
    """The cubin (or the PTX text, as bytes) of ``source`` or one of its parts."""
    if output == "ptx":
        return using.ptx(source, arch, part).encode()
    return using.compile(source, arch) if part is None else using.compile(source, arch, part)


class ThreadCompiles(ThreadPoolExecutor):
    """Compiles on threads of this process (any compiler, including the tests' fakes)."""

    def __init__(self, workers: int):
        super().__init__(max_workers=workers, thread_name_prefix="gradgen-compile")

    def compile(self, using: Compiler, source: Source, arch: str, part: int | None = None, output: str = "cubin") -> Future:
        return self.submit(compile_one, using, source, arch, part, output)


class ProcessCompiles(ThreadCompiles):
    """Compiles in up to ``workers`` worker processes (each fed by one thread of this pool).

    The workers make their own compiler of the parent's kind (the same environment gives the same
    compiler); one whose identity differs refuses the job, so a cubin is never stored under
    another compiler's key."""

    def __init__(self, workers: int):
        super().__init__(workers)
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # started at its first job
        self._workers: list[_Worker] = []

    def compile(self, using: Compiler, source: Source, arch: str, part: int | None = None, output: str = "cubin") -> Future:
        return self.submit(self._in_a_worker, using, (output, using.kind, using.identity, source, arch, part))

    def _in_a_worker(self, using: Compiler, job: tuple) -> bytes:
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                if worker is not None:
                    worker.close()  # its pipes
                try:
                    worker = _Worker()
                except OSError:  # no interpreter to start (an embedded Python): compile here
                    output, _, _, source, arch, part = job
                    return compile_one(using, source, arch, part, output)
                self._workers.append(worker)
            return worker.call(job)
        except _WorkerUnfit:  # it cannot make the parent's compiler (another sys.path): compile here
            output, _, _, source, arch, part = job
            return compile_one(using, source, arch, part, output)
        finally:
            self._idle.put(worker)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=wait, cancel_futures=cancel_futures)
        for worker in self._workers:
            worker.close()


def pool(using: Compiler, workers: int) -> ThreadCompiles:
    """The pool for ``using``'s compiles: worker processes for NVRTC (unless
    ``GRADGEN_CUDA_COMPILE_PROCESSES=0``), threads otherwise (nvcc runs in processes of its own)."""
    if using.kind == "nvrtc" and os.environ.get("GRADGEN_CUDA_COMPILE_PROCESSES", "1") != "0":
        return ProcessCompiles(workers)
    return ThreadCompiles(workers)


class _WorkerUnfit(Exception):
    """The worker cannot make its parent's compiler."""


class _Worker:
    """One worker process and its pipes; used by one thread at a time. Its first message is the
    parent's ``sys.path``, so it imports what the parent imports (as multiprocessing's spawn does)."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[2])  # where this gradgen is imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gradgen.cuda.compile_pool"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        _write(self.process.stdin, list(sys.path))

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, job: tuple) -> bytes:
        source = job[3]
        try:
            _write(self.process.stdin, job)
            reply = _read(self.process.stdout)
        except (OSError, EOFError):
            reply = None
        if reply is None:
            status = self.process.wait()
            raise KernelError(f"the CUDA compile worker compiling {source.path.name} exited (status {status})")
        status, value = reply
        if status == "unfit":
            raise _WorkerUnfit(value)
        if status != "ok":
            raise KernelError(value)
        return value

    def close(self) -> None:
        """End the worker and close both pipes (an open pipe left to the collector is a ResourceWarning
        for every worker: 'unclosed file <_io.BufferedReader ...>')."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()
            self.process.wait()


def _write(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_FRAME.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(_FRAME.size)
    if len(head) < _FRAME.size:
        return None
    (size,) = _FRAME.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)  # noqa: S301 - the parent gradgen process is the only writer


def _serve(inp, out) -> None:
    """The worker's loop: the parent's sys.path, then one reply per job until stdin closes."""
    paths = _read(inp) or []
    sys.path[:0] = [path for path in paths if path not in sys.path]
    while (job := _read(inp)) is not None:
        _write(out, _answer(*job))


def _answer(output: str, kind: str, identity: str, source: Source, arch: str, part: int | None) -> tuple[str, bytes | str]:
    """("ok", the cubin or PTX bytes), ("error", the compile error) or ("unfit", why this process
    cannot make the parent's compiler)."""
    try:
        using = compiler(kind)
    except KernelError as exc:
        return "unfit", str(exc)
    if using.identity != identity:
        return "unfit", f"its compiler is {using.identity}, its parent's {identity}"
    try:
        return "ok", compile_one(using, source, arch, part, output)
    except KernelError as exc:
        return "error", str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure is the job's, reported to the parent
        return "error", f"CUDA source {source.path.name}: {type(exc).__name__}: {exc}"


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the replies' channel
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything printed goes to stderr
    try:
        _serve(sys.stdin.buffer, out)
    except (KeyboardInterrupt, BrokenPipeError):  # the parent was interrupted, or has gone
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
