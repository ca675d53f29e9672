"""The wheel build compiles gradgen's CUDA kernels ahead of time into gradgen/cuda/prebuilt/.

It runs ``python -m gradgen.cuda.precompile --into <build>/gradgen/cuda/prebuilt`` from this source
tree (see gradgen/cuda/prebuilt.py), so a fresh machine's first GPU step loads cubins instead of
compiling. Settings (environment variables):

- ``GRADGEN_PREBUILD``: ``0`` skips it, ``1`` requires it (the build fails without a compiler);
  by default it runs where a CUDA compiler is found and is skipped with a one-line notice where
  none is (the kernels then compile at first use, as from a source checkout).
- ``GRADGEN_PREBUILD_PYTHON``: the interpreter that compiles, one with the ``cuda`` extra's
  cuda-core and NVRTC (or with nvcc on PATH); default: the build's own (in an isolated build that
  has neither, unless nvcc is on PATH). The generated sources are prebuilt where gradgen's own
  dependencies import in it too.
- ``GRADGEN_PREBUILD_ARCHS``: the architectures (``sm_80 sm_90``, spaces or commas); default:
  precompile's list, those the compiler supports, plus the PTX of the oldest.

Editable installs never prebuild.
"""

import os
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _say(message: str) -> None:
    print(f"gradgen: {message}", file=sys.stderr, flush=True)


def prebuild(into: Path) -> None:
    mode = os.environ.get("GRADGEN_PREBUILD", "auto")
    if mode == "0":
        _say("GRADGEN_PREBUILD=0: no prebuilt CUDA kernels in this build")
        return
    python = os.environ.get("GRADGEN_PREBUILD_PYTHON") or sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    probe = subprocess.run(
        [python, "-c", "from gradgen.cuda.compile import compiler; compiler()"], env=env, capture_output=True, text=True
    )
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or [f"{python} exited with status {probe.returncode}"])[-1]
        if mode == "1":
            raise SystemExit(f"gradgen: GRADGEN_PREBUILD=1 but no CUDA compiler in {python}: {why}")
        _say(f"no prebuilt CUDA kernels in this build (no CUDA compiler in {python}: {why}); they compile at first use")
        return
    archs = os.environ.get("GRADGEN_PREBUILD_ARCHS", "").replace(",", " ").split()
    command = [python, "-m", "gradgen.cuda.precompile", "--into", str(into)]
    command += [option for arch in archs for option in ("--arch", arch)]
    _say(f"compiling the CUDA kernels into {into} (GRADGEN_PREBUILD=0 skips this)")
    subprocess.run(command, env=env, cwd=ROOT, check=True)


class BuildPyWithKernels(build_py):
    """build_py, then the prebuilt kernels into the build directory (wheels only)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            prebuild(Path(self.build_lib).resolve() / "gradgen" / "cuda" / "prebuilt")


setup(cmdclass={"build_py": BuildPyWithKernels})
