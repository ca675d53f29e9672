"""The wheel build also compiles gradgen's CUDA kernels ahead of time into gradgen/cuda/prebuilt/
(gradgen/cuda/build_hook.py says how and its settings: GRADGEN_PREBUILD=0 skips it). Editable
installs never do."""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gradgen.cuda.build_hook import prebuild  # noqa: E402  (from this source tree; standard library only)


class BuildPyWithKernels(build_py):
    """build_py, then the prebuilt kernels into the build directory (wheels only)."""

    def run(self):
        super().run()
        if not self.editable_mode:
            prebuild(Path(self.build_lib).resolve() / "gradgen" / "cuda" / "prebuilt")


setup(cmdclass={"build_py": BuildPyWithKernels})
