"""Fill the CUDA kernel cache ahead of time: ``python -m gradgen.cuda.precompile [--arch sm_90 ...]``.

Run it where the first training step must not wait for compiles (a Docker image build, a job's
set-up step). With ``--arch`` it needs no GPU, only a compiler (NVRTC or nvcc); without, it
compiles for the GPU it finds. The cache is the one gradgen's runs read (``GRADGEN_CUDA_CACHE``,
else the user cache directory).
"""

from __future__ import annotations

import argparse
import re
import sys
import time

from gradgen.cuda import kernel_cache
from gradgen.cuda.compile import COMPILERS, compiler, source_names
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


def _say_done(name: str, seconds: float, compiled: bool) -> None:
    print(f"  {name}.cu: {'compiled' if compiled else 'cached'} ({seconds:.1f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradgen.cuda.precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", type=_arch, help="GPU architecture (repeatable; default: GPU 0's)")
    parser.add_argument("--compiler", choices=COMPILERS, help="default: NVRTC where installed, else nvcc")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="kernel groups assembled at once in split builds (default: one per CPU core); whole sources all compile at once",
    )
    args = parser.parse_args(argv)
    try:
        using = compiler(args.compiler)
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
