"""Every CUDA source compiles for sm_90 with nvcc (no GPU needed), so a broken kernel fails CI.

Compiling all sources costs about 45 s of CPU, so the default suite compiles only the sources that
changed since they last compiled: tests/cuda_sources.sha256 records, per .cu file, the hash of its
text together with the shared headers. A source whose hash is recorded there compiled with these
exact contents; anything else is compiled here. ``GRADGEN_COMPILE_ALL_CUDA=1`` compiles every
source, and ``GRADGEN_RECORD_CUDA_HASHES=1`` rewrites the record after a run where all compiled
(do that when you commit a kernel change). The GPU tests compile everything at first use anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parent.parent / "gradgen" / "kernels" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
HEADERS = sorted(CUDA_DIR.glob("*.h"))
RECORD = Path(__file__).resolve().parent / "cuda_sources.sha256"
NVCC = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
COMPILE_ALL = os.environ.get("GRADGEN_COMPILE_ALL_CUDA") == "1"
REWRITE_RECORD = os.environ.get("GRADGEN_RECORD_CUDA_HASHES") == "1"


def generated_sources() -> dict[str, str]:
    """Sources the CUDA families generate at run time (file name -> text, common.h inlined)."""
    import importlib
    import pkgutil

    import gradgen.kernels.cuda as families
    from gradgen.kernels.cuda.launch import inline_common_header

    found = {}
    for info in pkgutil.iter_modules(families.__path__):
        generate = getattr(importlib.import_module(f"gradgen.kernels.cuda.{info.name}"), "generated_sources", None)
        if generate is not None:
            found.update({f"{name}.cu": inline_common_header(text) for name, text in generate().items()})
    return found


GENERATED = generated_sources()


def generated_hash(name: str) -> str:
    return hashlib.sha256(name.encode() + b"\0" + GENERATED[name].encode()).hexdigest()


def source_hash(source: Path) -> str:
    """The hash of a source's text and of every shared header (any of them changes what compiles)."""
    digest = hashlib.sha256()
    for path in [source, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def recorded_hashes() -> dict[str, str]:
    if not RECORD.exists():
        return {}
    pairs = (line.split() for line in RECORD.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {name: digest for digest, name in pairs}


def compile_for_sm90(source: Path, out_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-cubin", "-I", str(source.parent), "-o", str(out_dir / "out.cubin"), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_cuda_source_compiles_for_sm90(source, tmp_path):
    if not (COMPILE_ALL or REWRITE_RECORD) and recorded_hashes().get(source.name) == source_hash(source):
        pytest.skip("unchanged since it last compiled (tests/cuda_sources.sha256); GRADGEN_COMPILE_ALL_CUDA=1 compiles it")
    result = compile_for_sm90(source, tmp_path)
    assert result.returncode == 0, f"nvcc failed on {source.name}:\n{result.stderr[-4000:]}"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("name", sorted(GENERATED))
def test_generated_cuda_source_compiles_for_sm90(name, tmp_path):
    """A family's run-time generated source (the elementwise unary table) compiles too."""
    if not (COMPILE_ALL or REWRITE_RECORD) and recorded_hashes().get(name) == generated_hash(name):
        pytest.skip("unchanged since it last compiled (tests/cuda_sources.sha256)")
    path = tmp_path / name
    path.write_text(GENERATED[name])
    result = compile_for_sm90(path, tmp_path)
    assert result.returncode == 0, f"nvcc failed on the generated {name}:\n{result.stderr[-4000:]}"


@pytest.mark.skipif(not REWRITE_RECORD or NVCC is None, reason="only with GRADGEN_RECORD_CUDA_HASHES=1 and nvcc")
def test_record_the_hashes_of_sources_that_compile(tmp_path):
    lines = ["# sha256 of each CUDA source with the shared headers, as last compiled by tests/test_cuda_sources.py"]
    for source in SOURCES:
        result = compile_for_sm90(source, tmp_path)
        assert result.returncode == 0, f"nvcc failed on {source.name}; the record is not rewritten"
        lines.append(f"{source_hash(source)}  {source.name}")
    for name in sorted(GENERATED):
        path = tmp_path / name
        path.write_text(GENERATED[name])
        assert compile_for_sm90(path, tmp_path).returncode == 0, f"nvcc failed on the generated {name}"
        lines.append(f"{generated_hash(name)}  {name}")
    RECORD.write_text("\n".join(lines) + "\n")


def test_there_are_cuda_sources():
    assert SOURCES, "no .cu files found"


def test_the_record_names_only_existing_sources():
    known = {s.name for s in SOURCES} | set(GENERATED)
    assert set(recorded_hashes()) <= known, "tests/cuda_sources.sha256 names a removed source"


PARTED = [source for source in SOURCES if re.search(r"^#define GG_PARTS \d+", source.read_text(), re.MULTILINE)]
_GUARD = re.compile(r"^#if GG_PART\((\d+)\)$")
_INSTANCE = re.compile(r'^(GG_[A-Z0-9_]+\(|extern "C" __global__)')


def guarded_blocks(text: str) -> tuple[list[int], list[str]]:
    """The k of each ``#if GG_PART(k)`` in order, and the top-level kernel definitions outside them
    (a macro instantiation or an ``extern "C"`` kernel at column 0, not inside a #define)."""
    numbers, outside, inside, continued = [], [], False, False
    for line in text.splitlines():
        guard = _GUARD.match(line)
        if guard:
            numbers.append(int(guard.group(1)))
            inside = True
        elif line.startswith("#endif") and inside:
            inside = False
        elif not inside and not continued and _INSTANCE.match(line) and not line.startswith("GG_REDUCER("):
            outside.append(line)
        continued = line.rstrip().endswith("\\")
    return numbers, outside


@pytest.mark.parametrize("source", PARTED, ids=lambda p: p.name)
def test_a_source_in_parts_guards_every_kernel_and_fills_every_part(source):
    """Part p keeps the blocks with k % GG_PARTS == p (common.h): the blocks must be numbered 0, 1, 2, ...
    so that no part is empty, and no kernel may stand outside a block (it would compile in every part)."""
    text = source.read_text()
    parts = int(re.search(r"^#define GG_PARTS (\d+)", text, re.MULTILINE).group(1))
    numbers, outside = guarded_blocks(text)
    assert numbers == list(range(len(numbers))), f"{source.name}: GG_PART blocks numbered {numbers}"
    assert len(numbers) >= parts, f"{source.name}: {parts} parts but {len(numbers)} blocks"
    assert outside == [], f"{source.name}: kernels outside a GG_PART block: {outside[:3]}"
    assert text.index("#define GG_PARTS") < text.index('#include "common.h"')


def test_the_guard_check_finds_an_unguarded_kernel():
    text = "#define GG_PARTS 2\n#if GG_PART(0)\nGG_A(x)\n#endif\n#define GG_B(x) \\\n    GG_A(x)\nGG_A(y)\n"
    assert guarded_blocks(text) == ([0], ["GG_A(y)"])
