"""The wheel build's step that compiles the CUDA kernels ahead of time (setup.py calls ``prebuild``).

It runs ``python -m gradgen.cuda.precompile --into <build>/gradgen/cuda/prebuilt`` on the source
tree being built (see prebuilt.py), so that a fresh machine's first GPU step loads cubins instead
of compiling them. Standard library only: it runs inside the build, before anything is installed.
Settings (environment variables):

- ``GRADGEN_PREBUILD``: ``0`` skips it, ``1`` requires it (the build fails without a compiler);
  by default it runs where a CUDA compiler is found and is skipped with a one-line notice where
  none is (the kernels then compile at first use, as from a source checkout).
- ``GRADGEN_PREBUILD_PYTHON``: the interpreter that compiles, one with the ``cuda`` extra's
  cuda-core and NVRTC (or with nvcc on PATH); default: the build's own, which in an isolated
  build has neither (nvcc aside). The generated sources are prebuilt where gradgen's own
  dependencies import in it too.
- ``GRADGEN_PREBUILD_ARCHS``: the architectures (``sm_80 sm_90``, spaces or commas); default:
  precompile's list, those the compiler supports; plus the PTX of the oldest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the source tree being built


def _say(message: str) -> None:
    print(f"gradgen: {message}", file=sys.stderr, flush=True)


def prebuild(into: Path, environ: dict[str, str] | None = None) -> bool:
    """Compile the kernels into ``into``; False where skipped (said in one line on stderr)."""
    environ = dict(os.environ if environ is None else environ)
    mode = environ.get("GRADGEN_PREBUILD", "auto")
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"gradgen: GRADGEN_PREBUILD={mode!r}: expected 0, 1 or auto")
    if mode == "0":
        _say("GRADGEN_PREBUILD=0: no prebuilt CUDA kernels in this build")
        return False
    python = environ.get("GRADGEN_PREBUILD_PYTHON") or sys.executable
    env = dict(environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])))
    why = _no_compiler(python, env)
    if why:
        if mode == "1":
            raise SystemExit(f"gradgen: GRADGEN_PREBUILD=1 but no CUDA compiler in {python}: {why}")
        _say(f"no prebuilt CUDA kernels in this build (no CUDA compiler in {python}: {why}); they compile at first use")
        return False
    archs = environ.get("GRADGEN_PREBUILD_ARCHS", "").replace(",", " ").split()
    command = [python, "-m", "gradgen.cuda.precompile", "--into", str(into)]
    command += [option for arch in archs for option in ("--arch", arch)]
    _say(f"compiling the CUDA kernels into {into} (GRADGEN_PREBUILD=0 skips this)")
    result = subprocess.run(command, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"gradgen: compiling the CUDA kernels failed (status {result.returncode}; see above)")
    return True


def _no_compiler(python: str, env: dict[str, str]) -> str:
    """Why ``python`` has no CUDA compiler for gradgen ('' where it has one)."""
    try:
        probe = subprocess.run(
            [python, "-c", "from gradgen.cuda.compile import compiler; compiler()"], env=env, capture_output=True, text=True
        )
    except OSError as exc:
        return f"cannot run it: {exc.strerror}"
    if probe.returncode == 0:
        return ""
    return (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
