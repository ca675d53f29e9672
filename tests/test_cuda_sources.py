"""Every CUDA source compiles for sm_90 with nvcc (no GPU needed), so a broken kernel fails CI."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCES = sorted((Path(__file__).resolve().parent.parent / "gradgen" / "kernels" / "cuda").glob("*.cu"))
NVCC = shutil.which("nvcc") or (shutil.which("/usr/local/cuda/bin/nvcc"))


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    result = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-cubin", "-I", str(source.parent),
         "-o", str(tmp_path / "out.cubin"), str(source)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr[-4000:]}"


def test_there_are_cuda_sources():
    assert SOURCES, "no .cu files found"
