"""Kernels compiled ahead of time and shipped in the package (``gradgen/cuda/prebuilt/``).

A wheel build (setup.py) or ``python -m gradgen.cuda.precompile --into DIR`` compiles every CUDA
source (the .cu files, and the sources the kernel families generate at run time) for a list of
architectures (DEFAULT_ARCHS, those the compiler supports) plus the PTX of the oldest, into a
directory whose ``index.json`` names, per architecture, each source's digest (its text and the
headers it includes, as compile.Source computes it), the kernels of each file and the compiler::

    {"format": 1, "compiler": "nvrtc 13.5; ...",
     "builds": {"sm_90": {"<digest>": {"source": "reduction.cu", "groups": [["k1", ...], ...],
                                        "files": ["sm_90/reduction.0.cubin", ...]}, ...},
                "compute_80": {...PTX files...}}}

At run time (kernel_cache.load_or_build) a source's build comes from here when the index holds its
digest for exactly the GPU's architecture: an edited source, header or generated source misses, and
never loads a stale cubin. Otherwise it comes from the persistent cache or is compiled, as without
a prebuilt directory. The PTX is the last resort, where no compiler is installed: the driver
compiles it for any GPU at least as new as its architecture, if the driver is at least as new as
the compiler that wrote it. ``GRADGEN_CUDA_PREBUILT=0`` ignores the directory;
``GRADGEN_CUDA_PREBUILT=DIR`` reads another one.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import pkgutil
import re
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gradgen.cuda.compile import CUDA_SOURCES, Compiler, Source, find_source, load_source, source_names
from gradgen.errors import KernelError

DIRECTORY = Path(__file__).resolve().parent / "prebuilt"
INDEX = "index.json"
FORMAT = 1
DEFAULT_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")


class Prebuilt(list):
    """A build (kernel_cache.Build) read from the prebuilt directory: the runtime compiles the
    source instead when its cubins do not load (a driver older than the compiler that wrote them)."""


_DISABLED: list[str] = []  # why the prebuilt builds are not used in this process (see disable)


def disable(why: str) -> None:
    """Use no prebuilt build in this process from now on (one did not load: neither will the others)."""
    _DISABLED.append(why)


def location() -> Path | None:
    """The prebuilt directory in use, or None where ``GRADGEN_CUDA_PREBUILT=0`` or ``disable``d."""
    configured = os.environ.get("GRADGEN_CUDA_PREBUILT")
    if configured == "0" or _DISABLED:
        return None
    return Path(configured).expanduser() if configured else DIRECTORY


@functools.lru_cache(maxsize=None)
def read_index(directory: Path) -> dict:
    """The index's builds by architecture; empty where there is no index, or an unreadable one."""
    try:
        index = json.loads((directory / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict) or index.get("format") != FORMAT or not isinstance(index.get("builds"), dict):
        return {}
    return index["builds"]


def lookup(source: Source, arch: str, whole: bool = False) -> Prebuilt | None:
    """The prebuilt build of ``source`` for exactly ``arch`` (with ``whole``: only a single-file
    build, for a module loaded whole), or None."""
    return _read(source, arch, whole)


def lookup_ptx(source: Source, arch: str, whole: bool = False) -> Prebuilt | None:
    """The prebuilt PTX of ``source`` for the newest virtual architecture a GPU of ``arch`` runs."""
    directory = location()
    if directory is None:
        return None
    level = arch_level(arch)
    usable = [key for key in read_index(directory) if key.startswith("compute_") and arch_level(key) <= level]
    for key in sorted(usable, key=arch_level, reverse=True):
        found = _read(source, key, whole)
        if found is not None:
            return found
    return None


def arch_level(arch: str) -> int:
    """80 for sm_80 and compute_80 (a family's letter suffix ignored); -1 for anything else."""
    found = re.fullmatch(r"(?:sm|compute)_(\d+)[af]?", arch)
    return int(found.group(1)) if found else -1


def _read(source: Source, arch: str, whole: bool) -> Prebuilt | None:
    directory = location()
    if directory is None:
        return None
    entry = read_index(directory).get(arch, {}).get(source.digest)
    if not isinstance(entry, dict):
        return None
    try:
        groups, files = entry["groups"], entry["files"]
        if len(groups) != len(files) or (whole and len(files) != 1):
            return None
        return Prebuilt((names, (directory / name).read_bytes()) for names, name in zip(groups, files))
    except (OSError, KeyError, TypeError):
        return None


# -- building a prebuilt directory ---------------------------------------------------------------


def generated_sources(into: Path) -> tuple[list[Source], str]:
    """The sources the kernel families generate at run time (``generated_sources()`` of a module
    of gradgen.kernels.cuda), written under ``into`` as gradgen writes them at run time (common.h
    inlined), so that their digests are the ones the run computes; and a note where the families
    cannot be imported here (their dependencies are missing): then those compile at first use."""
    try:
        import gradgen.kernels.cuda as families
        from gradgen.kernels.cuda.launch import inline_common_header

        found: dict[str, str] = {}
        for info in pkgutil.iter_modules(families.__path__):
            generate = getattr(importlib.import_module(f"{families.__name__}.{info.name}"), "generated_sources", None)
            if generate is not None:
                found.update({name: inline_common_header(text) for name, text in generate().items()})
    except ImportError as exc:
        return [], f"the kernel families do not import here ({exc}): their generated sources are not prebuilt"
    into.mkdir(parents=True, exist_ok=True)
    sources = []
    for name, text in sorted(found.items()):
        (into / f"{name}.cu").write_text(text)
        sources.append(load_source(into / f"{name}.cu"))
    return sources, ""


def build(into: Path, archs: list[str], ptx_arch: str | None, using: Compiler, workers: int, on_done=None) -> tuple[dict, str]:
    """Compile every source for each of ``archs`` (cubins) and ``ptx_arch`` (PTX, if given) into the
    directory ``into``, replacing what it held; nothing is written unless every compile succeeds
    (the first KernelError is raised). ``on_done(source, arch)`` hears of each source.
    Returns (the index, a note about the generated sources, empty where they were built)."""
    from gradgen.cuda import compile_pool
    from gradgen.cuda.kernel_cache import compile_build

    with tempfile.TemporaryDirectory(prefix="gradgen-generated-") as staged:
        static = [find_source(name) for name in source_names(CUDA_SOURCES)]
        generated, note = generated_sources(Path(staged))
        targets = [(arch, "cubin") for arch in archs] + ([(ptx_arch, "ptx")] if ptx_arch else [])
        jobs = [(source, arch, output) for arch, output in targets for source in static + generated]
        lock = threading.Lock()

        def one(job) -> tuple:
            source, arch, output = job
            built = compile_build(source, arch, using, links, split=source not in generated, output=output)
            if on_done is not None:
                with lock:
                    on_done(source, arch)
            return source, arch, built

        jobs.sort(key=lambda job: -len(job[0].text))  # the largest first: their parts queue ahead
        with compile_pool.pool(using, workers) as links, ThreadPoolExecutor(max_workers=len(jobs)) as waiting:
            results = list(waiting.map(one, jobs))
    return write(into, results, using.identity), note


def write(into: Path, builds: list[tuple[Source, str, list]], compiler: str) -> dict:
    """Write a prebuilt directory at ``into`` (replacing what it held) from ``(source, arch,
    build)`` triples: cubins for ``sm_XY``, PTX for ``compute_XY``. Returns its index."""
    from gradgen.cuda.kernel_cache import atomic_write

    into = into.resolve()
    staging = Path(tempfile.mkdtemp(prefix=f".{into.name}.", dir=into.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would keep a shared directory unreadable
    try:
        by_arch: dict = {}
        for source, arch, built in builds:
            ptx = arch.startswith("compute_")
            (staging / arch).mkdir(exist_ok=True)
            files = []
            for i, (_, data) in enumerate(built):
                files.append(f"{arch}/{source.name}.{i}.{'ptx' if ptx else 'cubin'}")
                atomic_write(staging / files[-1], data + b"\0" if ptx else data)  # PTX loads NUL-terminated
            entry = {"source": source.path.name, "groups": [names for names, _ in built], "files": files}
            by_arch.setdefault(arch, {})[source.digest] = entry
        index = {"format": FORMAT, "compiler": compiler, "builds": by_arch}
        atomic_write(staging / INDEX, json.dumps(index, indent=1, sort_keys=True).encode())
        _replace_dir(staging, into)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    read_index.cache_clear()
    return index


def _replace_dir(new: Path, target: Path) -> None:
    """Put the directory ``new`` at ``target``, moving whatever was there out of the way first."""
    old = None
    if target.exists() or target.is_symlink():
        if not target.is_dir():
            raise KernelError(f"{target} is not a directory")
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(new, target)
    if old is not None:
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
