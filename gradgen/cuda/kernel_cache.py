"""The persistent cache of compiled CUDA kernels (cubins), safe for concurrent processes.

A cubin is stored under a key that hashes the source (with the headers it includes), the GPU
architecture and the compiler's identity (compiler, version, options, header directories), so any
change compiles afresh and nothing stale is ever loaded. The directory is ``GRADGEN_CUDA_CACHE``
when set, else the user cache directory (platformdirs; e.g. ~/.cache/gradgen/cuda).

Concurrency (``pytest -n 8``, several training jobs): a cubin is written to a temporary file and
moved into place with ``os.replace``, so a reader sees a whole file or none; compiling one key
holds an exclusive ``fcntl`` lock on ``<key>.lock``, so processes that need the same kernels at
once compile each source once and the others wait for it. ``cubins`` compiles every missing source
in a thread pool (NVRTC releases the GIL), so the first use costs the longest compile, not the sum.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gradgen.cuda.compile import Compiler, Source, compiler, find_source, source_names
from gradgen.errors import KernelError

try:
    import fcntl
except ImportError:  # not POSIX: the atomic rename alone keeps readers safe; compiles may repeat
    fcntl = None

PROGRESS_AFTER_S = 2.0  # a compile that takes longer than this says so on stderr


def cache_dir() -> Path:
    configured = os.environ.get("GRADGEN_CUDA_CACHE")
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("gradgen")) / "cuda"


def cache_key(source: Source, arch: str, identity: str) -> str:
    import hashlib

    return hashlib.sha256(f"{source.digest}\0{arch}\0{identity}".encode()).hexdigest()[:32]


def cubin_path(directory: Path, source: Source, arch: str, identity: str) -> Path:
    return directory / f"{source.name}-{arch}-{cache_key(source, arch, identity)}.cubin"


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep a cache directory shared by a team unreadable
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock between processes (and threads: each takes its own descriptor) on ``path``.
    The kernel drops it if the holder dies, so a killed compile never blocks the next one."""
    if fcntl is None:
        yield
        return
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def load_or_compile(source: Source, arch: str, using: Compiler, directory: Path | None) -> bytes:
    """The cubin of ``source`` for ``arch``: from the cache, else compiled (once across processes)
    and stored. With ``directory`` None (the cache cannot be written) it is only compiled."""
    if directory is None:
        return using.compile(source, arch)
    path = cubin_path(directory, source, arch, using.identity)
    with contextlib.suppress(FileNotFoundError):
        return path.read_bytes()
    with file_lock(path.with_suffix(".lock")):
        with contextlib.suppress(FileNotFoundError):
            return path.read_bytes()  # another process compiled it while this one waited
        data = using.compile(source, arch)
        atomic_write(path, data)
        return data


def _usable_dir() -> Path | None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-")
        probe.close()
    except OSError as exc:
        print(f"gradgen: the CUDA kernel cache {directory} is not writable ({exc.strerror}); compiling "
              "without it (set GRADGEN_CUDA_CACHE to a writable directory)", file=sys.stderr)
        return None
    return directory


def cubins(arch: str, names: list[str] | None = None, *, using: Compiler | None = None,
           workers: int | None = None, on_done=None) -> dict[str, bytes | KernelError]:
    """Cubins of the named sources (default: all) for ``arch``, compiling the missing ones in parallel.

    A source that fails to compile maps to its KernelError rather than failing the others: only
    the kernels it holds are unusable. ``on_done(name, seconds, compiled)`` hears of each source.
    """
    names = source_names() if names is None else list(names)
    sources = [find_source(name) for name in names]
    directory = _usable_dir()
    using = using or compiler()
    missing = [s for s in sources if directory is None or not cubin_path(directory, s, arch, using.identity).exists()]
    results: dict[str, bytes | KernelError] = {}
    progress = _Progress(len(missing), arch, using, directory)
    workers = workers or min(len(sources), os.cpu_count() or 1) or 1

    def one(source: Source) -> None:
        start = time.perf_counter()
        try:
            results[source.name] = load_or_compile(source, arch, using, directory)
        except KernelError as exc:
            results[source.name] = exc
        progress.done(source in missing)
        if on_done is not None:
            on_done(source.name, time.perf_counter() - start, source in missing)

    with progress, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gradgen-nvrtc") as pool:
        list(pool.map(one, sources))
    return {name: results[name] for name in names}


class _Progress:
    """A line on stderr when compiling takes longer than PROGRESS_AFTER_S, and one when it ends."""

    def __init__(self, total: int, arch: str, using: Compiler, directory: Path | None):
        self.total, self.count, self.arch, self.using, self.directory = total, 0, arch, using, directory
        self.start = time.perf_counter()
        self.timer = threading.Timer(PROGRESS_AFTER_S, self._say_started) if total else None
        self.said = False
        self._lock = threading.Lock()

    def __enter__(self):
        if self.timer is not None:
            self.timer.daemon = True
            self.timer.start()
        return self

    def _say_started(self) -> None:
        with self._lock:
            self.said = True
            where = f"into {self.directory}" if self.directory else "(no cache)"
            print(f"gradgen: compiling {self.total} CUDA source(s) for {self.arch} with {self.using.kind} "
                  f"{self.using.version} {where} (first use; later runs load them)...", file=sys.stderr, flush=True)

    def done(self, compiled: bool) -> None:
        if compiled:
            with self._lock:
                self.count += 1

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.cancel()
        with self._lock:
            if self.said:
                print(f"gradgen: compiled {self.count} CUDA source(s) in {time.perf_counter() - self.start:.1f} s",
                      file=sys.stderr, flush=True)
        return False
