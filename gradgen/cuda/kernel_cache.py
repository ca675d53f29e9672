"""The persistent cache of compiled CUDA kernels (cubins), safe for concurrent processes.

A source's build is stored under a key that hashes the source (with the headers it includes), the
GPU architecture and the compiler's identity (compiler, versions, options, header directories),
so any change compiles afresh and nothing stale is ever loaded. The directory is
``GRADGEN_CUDA_CACHE`` when set, else the user cache directory (platformdirs; e.g.
~/.cache/gradgen/cuda). One build is ``<source>-<arch>-<key>.index.json``, naming the kernels of
each of its cubins ``<source>-<arch>-<key>.<i>.cubin`` (one cubin of every kernel unless the
build is split, see below).

Concurrency (``pytest -n 8``, several training jobs): every file is written to a temporary file and
moved into place with ``os.replace``, the index last, so a reader sees a whole build or none;
building one key holds an exclusive ``fcntl`` lock on ``<key>.lock``, so processes that need the
same kernels at once build each source once and the others wait for it.

Speed: ``builds`` builds every missing source at once, on one pool of compile threads, one per
core (NVRTC releases the GIL); a source written in parts (compile.py, ``Source.parts``) compiles
its parts as separate jobs, so the cold start is about the total compile work over the cores,
not the largest source's compile. With
``GRADGEN_CUDA_SPLIT_COMPILE=1`` (opt-in, see compile.py) NVRTC writes each source's PTX once and
its kernels assemble in groups of about ``GROUP_SIZE`` on a shared pool, so that the largest
source's assembly spreads over the cores too. (Kernels of one source must then not share a
module-scope ``__device__`` or ``__constant__`` variable: each group's cubin holds its own copy.)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path

from gradgen.cuda import compile_pool, prebuilt
from gradgen.cuda.compile import Compiler, Source, compiler, cubin_kernels, find_source, source_names, split_ptx
from gradgen.cuda.compile_pool import compile_one
from gradgen.errors import KernelError

try:
    import fcntl
except ImportError:  # not POSIX: the atomic rename alone keeps readers safe; compiles may repeat
    fcntl = None  # type: ignore[assignment]  # the lock below is skipped where None

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


Build = list  # [(kernel names, or None for "every kernel of the source"; cubin bytes), ...]
GROUP_SIZE = 12  # kernels linked together: small enough to spread a large source over the cores


def groups_of(names: list[str], size: int | None = None) -> list[list[str]]:
    """``names`` dealt round-robin into groups of about ``size`` (default GROUP_SIZE): a family's
    variants, which cost alike and sit side by side in a source, spread over the groups."""
    count = max(1, -(-len(names) // (size or GROUP_SIZE)))
    return [names[i::count] for i in range(count) if names[i::count]]


def build_stem(directory: Path, source: Source, arch: str, identity: str) -> Path:
    return directory / f"{source.name}-{arch}-{cache_key(source, arch, identity)}"


def _index(stem: Path) -> Path:
    return stem.with_name(stem.name + ".index.json")


def read_build(stem: Path) -> Build | None:
    """The stored build at ``stem`` (index and cubins), or None where it is missing or incomplete."""
    try:
        groups = json.loads(_index(stem).read_text())["groups"]
        return [(names, stem.with_name(f"{stem.name}.{i}.cubin").read_bytes()) for i, names in enumerate(groups)]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def write_build(stem: Path, build: Build) -> None:
    for i, (_, cubin) in enumerate(build):
        atomic_write(stem.with_name(f"{stem.name}.{i}.cubin"), cubin)
    index = json.dumps({"groups": [names for names, _ in build]}).encode()
    atomic_write(_index(stem), index)  # last: the build is complete


def compile_build(
    source: Source, arch: str, using: Compiler, links: Executor | None = None, split: bool = True, output: str = "cubin"
) -> Build:
    """Compile ``source``: with ``split``, a source written in parts (``Source.parts``) compiles
    its parts side by side on ``links`` (a compile pool, see compile_pool.py, or any executor),
    one cubin each; any other source splits into kernel groups linked on ``links`` where the
    compiler can; else the source compiles whole. ``output="ptx"``: the same of PTX texts."""
    if split and source.parts > 1:
        return _compile_parts(source, arch, using, links, output)
    if output == "ptx" or not (split and using.can_split):
        if links is None:
            return [(None, compile_one(using, source, arch, None, output))]
        return [(None, _submit(links, using, source, arch, None, output).result())]  # on the pool: one compile per core
    common, kernels = split_ptx(using.ptx(source, arch))
    groups = groups_of(list(kernels))

    def assemble(names: list[str]) -> bytes:
        return using.assemble(common + "".join(kernels[name] for name in names), arch, source)

    if links is None:
        return [(names, assemble(names)) for names in groups]
    futures = [links.submit(assemble, names) for names in groups]
    return [(names, future.result()) for names, future in zip(groups, futures)]


def _submit(links: Executor, using: Compiler, source: Source, arch: str, part: int | None, output: str) -> Future:
    """One compile on ``links``: through its ``compile`` where it is a compile pool (which may run it
    in a worker process), else as a call on one of its threads."""
    compile_on = getattr(links, "compile", None)
    if compile_on is not None:
        return compile_on(using, source, arch, part, output)
    return links.submit(compile_one, using, source, arch, part, output)


def _compile_parts(source: Source, arch: str, using: Compiler, links: Executor | None, output: str) -> Build:
    """One cubin (or PTX) per part of ``source``, each listed with the kernels it holds (from its
    sections or entries), so a module finds a kernel's cubin without asking the driver."""

    def listed(data: bytes) -> tuple[list[str] | None, bytes]:
        names = cubin_kernels(data) if output == "cubin" else sorted(split_ptx(data.decode())[1])
        return names or None, data

    if links is None:
        return [listed(compile_one(using, source, arch, index, output)) for index in range(source.parts)]
    futures = [_submit(links, using, source, arch, index, output) for index in range(source.parts)]
    return [listed(future.result()) for future in futures]


def load_or_build(
    source: Source,
    arch: str,
    using: Compiler | None,
    directory: Path | None,
    links: Executor | None = None,
    split: bool = True,
    prebuilt_ok: bool = True,
) -> Build:
    """The build of ``source`` for ``arch``: shipped with the package (prebuilt.py), else from the
    cache, else compiled (once across processes) and stored. With ``directory`` None (the cache
    cannot be written) it is only compiled. ``using`` None: the default compiler, made only when
    a compile is needed; where there is none, the shipped PTX if any."""
    if prebuilt_ok:
        found = prebuilt.lookup(source, arch, whole=not split)
        if found is not None:
            return found
    if using is None:
        try:
            using = compiler()
        except KernelError:
            found = prebuilt.lookup_ptx(source, arch, whole=not split) if prebuilt_ok else None
            if found is None:
                raise
            return found
    if directory is None:
        return compile_build(source, arch, using, links, split)
    stem = build_stem(directory, source, arch, using.identity + ("" if split else "; whole"))
    build = read_build(stem)
    if build is not None:
        return build
    with file_lock(stem.with_name(stem.name + ".lock")):
        build = read_build(stem)  # another process built it while this one waited
        if build is None:
            build = compile_build(source, arch, using, links, split)
            write_build(stem, build)
        return build


def load_or_compile(source: Source, arch: str, using: Compiler | None, directory: Path | None) -> bytes:
    """One cubin of every kernel of ``source`` (for a module loaded whole, such as a source
    generated at run time), shipped, from the cache or compiled once across processes."""
    return load_or_build(source, arch, using, directory, split=False)[0][1]


def _usable_dir() -> Path | None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-")
        probe.close()
    except OSError as exc:
        print(
            f"gradgen: the CUDA kernel cache {directory} is not writable ({exc.strerror}); compiling "
            "without it (set GRADGEN_CUDA_CACHE to a writable directory)",
            file=sys.stderr,
        )
        return None
    return directory


def builds(
    arch: str,
    names: list[str] | None = None,
    *,
    using: Compiler | None = None,
    workers: int | None = None,
    on_done=None,
    prebuilt_ok: bool = True,
) -> dict[str, Build | KernelError]:
    """Builds of the named sources (default: all) for ``arch``: those shipped with the package
    (prebuilt.py) first, the others from the cache, compiling the missing ones at once.

    A source that fails to compile maps to its KernelError rather than failing the others: only
    the kernels it holds are unusable. ``on_done(name, seconds, how)`` hears of each source
    (``how``: "prebuilt", "cached" or "compiled"). ``prebuilt_ok=False`` ignores the shipped builds.
    """
    names = source_names() if names is None else list(names)
    sources = [find_source(name) for name in names]
    results: dict[str, Build | KernelError] = {}
    for source in sources:
        found = prebuilt.lookup(source, arch) if prebuilt_ok else None
        if found is not None:
            results[source.name] = found
            if on_done is not None:
                on_done(source.name, 0.0, "prebuilt")
    sources = [s for s in sources if s.name not in results]
    if not sources:
        return {name: results[name] for name in names}
    directory = _usable_dir()
    try:
        using = using or compiler()
    except KernelError as exc:  # no compiler: the shipped PTX where there is some, else this error
        for source in sources:
            found = prebuilt.lookup_ptx(source, arch) if prebuilt_ok else None
            results[source.name] = exc if found is None else found
        return {name: results[name] for name in names}
    missing = [s for s in sources if directory is None or not _index(build_stem(directory, s, arch, using.identity)).exists()]
    progress = _Progress(len(missing), arch, using, directory)
    workers = workers or os.cpu_count() or 1

    def one(source: Source, links: Executor) -> None:
        start = time.perf_counter()
        try:
            results[source.name] = load_or_build(source, arch, using, directory, links, prebuilt_ok=False)
        except KernelError as exc:
            results[source.name] = exc
        progress.done(source in missing)
        if on_done is not None:
            on_done(source.name, time.perf_counter() - start, "compiled" if source in missing else "cached")

    # Two pools: a thread per source (its cache lookup, then waiting on its compiles, or on another
    # process's lock) and the compile pool (whole sources, parts, kernel groups): one worker per
    # core (a process for NVRTC, see compile_pool.py), so compiles never oversubscribe the machine.
    # The largest sources start first, so their parts queue ahead of the small sources' compiles
    # (longest jobs first keeps the end short).
    sources_by_size = sorted(sources, key=lambda source: -len(source.text))
    with (
        progress,
        compile_pool.pool(using, workers) as links,  # its workers start at the first compile
        ThreadPoolExecutor(max_workers=max(1, len(sources)), thread_name_prefix="gradgen-cu") as per_source,
    ):
        list(per_source.map(lambda source: one(source, links), sources_by_size))
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
            print(
                f"gradgen: compiling {self.total} CUDA source(s) for {self.arch} with {self.using.kind} "
                f"{self.using.version} {where} (first use; later runs load them)...",
                file=sys.stderr,
                flush=True,
            )

    def done(self, compiled: bool) -> None:
        if compiled:
            with self._lock:
                self.count += 1

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.cancel()
        with self._lock:
            if self.said:
                print(
                    f"gradgen: compiled {self.count} CUDA source(s) in {time.perf_counter() - self.start:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
        return False
