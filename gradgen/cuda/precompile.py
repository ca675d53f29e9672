"""Compile gradgen's CUDA kernels ahead of time: ``python -m gradgen.cuda.precompile [--arch sm_90 ...] [--into DIR]``.

Without ``--into`` it fills the kernel cache that gradgen's runs read (``GRADGEN_CUDA_CACHE``,
else the user cache directory): run it where the first training step must not wait for compiles
(a Docker image build, a job's set-up step). With ``--arch`` it needs no GPU, only a compiler
(NVRTC or nvcc); without, it compiles for the GPU it finds.

With ``--into DIR`` it writes a prebuilt directory instead (see gradgen/cuda/prebuilt.py): every
source, the generated ones included, for each ``--arch`` (default: sm_80, sm_86, sm_89, sm_90,
sm_100 and sm_120, those the compiler supports) plus the PTX of the oldest (unless ``--no-ptx``).
The wheel build runs it into gradgen/cuda/prebuilt/; ``GRADGEN_CUDA_PREBUILT=DIR`` points a run at
another directory.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from gradgen.cuda import kernel_cache, prebuilt
from gradgen.cuda.compile import COMPILERS, Compiler, compiler, source_names
from gradgen.errors import GradgenError, UsageError


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_\d{2,3}[af]?", text):
        raise argparse.ArgumentTypeError(f"expected an architecture such as sm_90, got {text!r}")
    return text


def current_arch() -> str:
    """The architecture of GPU 0, asked through cuda.core (no PyCUDA context needed)."""
    try:
        try:
            from cuda.core import Device
        except ImportError:
            from cuda.core.experimental import Device
        major, minor = Device(0).compute_capability
    except Exception as exc:  # noqa: BLE001 - no driver, no GPU, no cuda.core
        raise UsageError(f"no GPU answers ({type(exc).__name__}); name the architecture with --arch sm_XY") from None
    return f"sm_{major}{minor}"


def _say_done(name: str, seconds: float, how: str) -> None:
    print(f"  {name}.cu: {how} ({seconds:.1f} s)", flush=True)


def _prebuild_dir(text: str) -> Path:
    """``--into``'s directory: created or replaced as a whole, so its parent must be a writable
    directory and the path itself a directory if it exists."""
    path = Path(text).expanduser()
    parent = path.resolve().parent
    if path.exists() and not path.is_dir():
        raise UsageError(f"--into {text}: exists and is not a directory")
    if not parent.is_dir():
        raise UsageError(f"--into {text}: no directory {parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--into {text}: {parent} is not writable")
    return path


def _prebuild_archs(requested: list[str] | None, using: Compiler) -> list[str]:
    """The architectures to prebuild: those requested (each must be one the compiler supports),
    else the default list less those it does not."""
    supported = using.supported_archs()
    if requested:
        unknown = [arch for arch in requested if supported is not None and arch not in supported]
        if unknown:
            raise UsageError(
                f"{using.kind} {using.version} cannot compile for {', '.join(unknown)} (it supports {', '.join(supported or [])})"
            )
        return list(dict.fromkeys(requested))
    return [arch for arch in prebuilt.DEFAULT_ARCHS if supported is None or arch in supported]


def _prebuild(args, using: Compiler) -> int:
    into = _prebuild_dir(args.into)
    archs = _prebuild_archs(args.arch, using)
    if not archs:
        raise UsageError(f"{using.kind} {using.version} supports none of {', '.join(prebuilt.DEFAULT_ARCHS)}; name --arch")
    oldest = min(archs, key=prebuilt.arch_level)
    ptx = None if args.no_ptx else oldest.replace("sm_", "compute_")
    start = time.perf_counter()

    def say(source, arch: str) -> None:
        print(f"  {source.path.name} {arch}: done ({time.perf_counter() - start:.1f} s)", flush=True)

    index, note = prebuilt.build(into, archs, ptx, using, args.jobs or os.cpu_count() or 1, on_done=say)
    if note:
        print(f"note: {note}", file=sys.stderr)
    files = [p for p in into.rglob("*") if p.is_file()]
    print(
        f"{into}: {len(index['builds'])} architecture(s) ({', '.join(index['builds'])}), {len(files)} files, "
        f"{sum(p.stat().st_size for p in files) / 2**20:.1f} MiB ({using.kind} {using.version}, "
        f"{time.perf_counter() - start:.1f} s)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradgen.cuda.precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", type=_arch, help="GPU architecture (repeatable; default: GPU 0's)")
    parser.add_argument("--compiler", choices=COMPILERS, help="default: NVRTC where installed, else nvcc")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="compiles at once (worker processes for NVRTC; default: one per CPU core)",
    )
    parser.add_argument(
        "--into", metavar="DIR", help="write a prebuilt directory (cubins and index) instead of filling the cache"
    )
    parser.add_argument("--no-ptx", action="store_true", help="with --into: no PTX of the oldest architecture")
    args = parser.parse_args(argv)
    try:
        if args.no_ptx and args.into is None:
            raise UsageError("--no-ptx only goes with --into")
        if args.jobs is not None and args.jobs < 1:
            raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
        if args.into is not None:
            _prebuild_dir(args.into)  # a bad path is refused before the compiler is looked for
        using = compiler(args.compiler)
        if args.into is not None:
            return _prebuild(args, using)
        failed = 0
        for arch in args.arch or [current_arch()]:
            start = time.perf_counter()
            results = kernel_cache.builds(arch, source_names(), using=using, workers=args.jobs, on_done=_say_done)
            for name, result in results.items():
                if isinstance(result, Exception):
                    failed += 1
                    print(f"{name}.cu: {result}", file=sys.stderr)
            print(
                f"{arch}: {len(results) - failed} of {len(results)} CUDA sources ready in {kernel_cache.cache_dir()} "
                f"({using.kind} {using.version}, {time.perf_counter() - start:.1f} s)"
            )
    except GradgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 4 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
