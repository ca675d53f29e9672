"""The CUDA kernel cache and compiler choice (gradgen/cuda/kernel_cache.py, compile.py), without a GPU.

A fake compiler stands in for NVRTC/nvcc where the test is about the cache; the real compilers are
exercised where they are installed (NVRTC through cuda-core, nvcc from a toolkit).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from gradgen.cuda import compile as cc
from gradgen.cuda import kernel_cache
from gradgen.errors import KernelError

COMMON = '#pragma once\n#include "inner.h"\n'


@pytest.fixture(autouse=True)
def _fresh_compiler_choice(monkeypatch):
    monkeypatch.delenv("GRADGEN_CUDA_COMPILER", raising=False)
    cc.compiler.cache_clear()
    yield
    cc.compiler.cache_clear()


class FakeCompiler(cc.Compiler):
    """Returns the source's text as its 'cubin'; appends one line per compile to ``log``."""

    kind, version, identity = "fake", "1.0", "fake 1.0"

    def __init__(self, log: Path | None = None, delay: float = 0.0, barrier: threading.Barrier | None = None):
        self.log, self.delay, self.barrier = log, delay, barrier

    def compile(self, source, arch):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # every source compiles at the same time, or this times out
        time.sleep(self.delay)
        if "#error" in source.text:
            raise KernelError(f"CUDA source {source.path.name} does not compile")
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(f"{os.getpid()} {source.name}\n")
        return f"{arch}:{source.text}".encode()


class FakeSplitCompiler(FakeCompiler):
    """Splits like NVRTC + nvJitLink: the 'PTX' lists the kernels of a '// kernels:' line as
    entries, and an assembled 'cubin' names the entries it was given."""

    can_split = True
    identity = "fake-split 1.0"

    def ptx(self, source, arch):
        if self.log is not None:
            with open(self.log, "a") as out:
                out.write(f"{os.getpid()} {source.name}\n")
        line = next(line for line in source.text.splitlines() if line.startswith("// kernels:"))
        return ".version 9.0\n" + "".join(f".visible .entry {k}(\n)\n{{\n\tret;\n}}\n" for k in line.split(":")[1].split())

    def assemble(self, ptx, arch, source):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)
        assert ptx.startswith(".version 9.0\n")
        return f"{arch}:".encode() + " ".join(cc.split_ptx(ptx)[1]).encode()


def make_sources(directory: Path, names=("a", "b")) -> list[cc.Source]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "common.h").write_text(COMMON)
    (directory / "inner.h").write_text("#define X 1\n")
    for name in names:
        (directory / f"{name}.cu").write_text(f'#include "common.h"\n#include <cuda_fp16.h>\n// {name}\n')
    return [cc.find_source(name, directory) for name in names]


def test_the_key_follows_the_source_its_headers_the_arch_and_the_compiler(tmp_path):
    source = make_sources(tmp_path / "src", ["a"])[0]
    key = kernel_cache.cache_key(source, "sm_90", "nvrtc 13.0")
    assert kernel_cache.cache_key(cc.find_source("a", tmp_path / "src"), "sm_90", "nvrtc 13.0") == key
    assert kernel_cache.cache_key(source, "sm_80", "nvrtc 13.0") != key
    assert kernel_cache.cache_key(source, "sm_90", "nvrtc 13.1") != key
    (tmp_path / "src" / "inner.h").write_text("#define X 2\n")  # included through common.h
    assert kernel_cache.cache_key(cc.find_source("a", tmp_path / "src"), "sm_90", "nvrtc 13.0") != key


def test_local_headers_are_followed_transitively_and_once(tmp_path):
    make_sources(tmp_path, ["a"])
    (tmp_path / "inner.h").write_text('#include "common.h"\n')  # a cycle ends
    found = cc.local_headers((tmp_path / "a.cu").read_text(), (tmp_path,))
    assert [p.name for p in found] == ["common.h", "inner.h"]


def test_the_cubin_is_compiled_once_then_read_from_the_cache(tmp_path):
    sources = make_sources(tmp_path / "src")
    directory = tmp_path / "cache"
    directory.mkdir()
    log = tmp_path / "log"
    fake = FakeCompiler(log)
    first = [kernel_cache.load_or_build(s, "sm_90", fake, directory) for s in sources]
    again = [kernel_cache.load_or_build(s, "sm_90", fake, directory) for s in sources]
    assert first == again == [[(None, f"sm_90:{s.text}".encode())] for s in sources]
    assert len(log.read_text().splitlines()) == 2
    assert sorted(p.suffix for p in directory.iterdir()) == [".cubin", ".cubin", ".json", ".json", ".lock", ".lock"]


def test_a_split_source_links_its_kernels_in_groups_and_stores_an_index(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    kernels = [f"k{i}_f32" for i in range(30)]
    (src / "big.cu").write_text("// kernels: " + " ".join(kernels) + "\n")
    source = cc.find_source("big", src)
    directory = tmp_path / "cache"
    directory.mkdir()
    log = tmp_path / "log"
    with ThreadPoolExecutor(4) as links:
        build = kernel_cache.load_or_build(source, "sm_90", FakeSplitCompiler(log), directory, links)
    assert sorted(k for names, _ in build for k in names) == sorted(kernels)  # every kernel, once
    assert len(build) == 3 and all(len(names) == 10 for names, _ in build)
    assert all(cubin == b"sm_90:" + " ".join(names).encode() for names, cubin in build)
    assert kernel_cache.load_or_build(source, "sm_90", FakeSplitCompiler(log), directory) == build
    assert len(log.read_text().splitlines()) == 1  # the second came from the cache
    stem = kernel_cache.build_stem(directory, source, "sm_90", FakeSplitCompiler.identity)
    stem.with_name(stem.name + ".1.cubin").unlink()
    assert kernel_cache.read_build(stem) is None  # an incomplete build is no build


def test_split_ptx_keeps_the_common_part_and_cuts_each_entry():
    ptx = (
        ".version 9.0\n.target sm_90\n\n\t// .globl\tk1\n.global .align 4 .u32 g = 1;\n"
        ".visible .entry k1(\n\t.param .u64 p\n)\n{\n\tmov.b32 %r1, {%r2, %r3};\n\tret;\n\n}\n"
        ".func (.param .b32 r) helper(\n)\n{\n\tret;\n}\n"
        "\t// .globl\tk2\n.entry k2(\n)\n.maxntid 128\n{\n\t{\n\t.reg .b32 %t;\n\t}\n\tret;\n}\n"
    )
    common, kernels = cc.split_ptx(ptx)
    assert list(kernels) == ["k1", "k2"]
    assert kernels["k1"].startswith(".visible .entry k1(") and kernels["k1"].rstrip().endswith("}")
    assert "helper" in common and ".global .align 4 .u32 g" in common and ".entry" not in common
    assert kernels["k2"].count("{") == kernels["k2"].count("}")  # the nested block stays inside
    pieces = common + "".join(kernels.values())
    assert sorted(filter(None, pieces.splitlines())) == sorted(filter(None, ptx.splitlines()))  # nothing lost


class FakePartCompiler(FakeCompiler):
    """Compiles a source of '// part k: names' lines: part p's 'cubin' holds a code section
    (.text.<name>) for each name of the lines with k % parts == p; whole: every name."""

    identity = "fake-parts 1.0"

    def compile(self, source, arch, part=None):
        if self.barrier is not None:
            self.barrier.wait(timeout=30)  # the parts compile at the same time, or this times out
        names = []
        for line in source.text.splitlines():
            if line.startswith("// part "):
                k, listed = line[len("// part ") :].split(":")
                if part is None or int(k) % source.parts == part:
                    names += listed.split()
        return b"\x7fELF" + b"".join(b".text." + n.encode() + b"\x00" for n in names)


def test_a_source_in_parts_compiles_them_side_by_side_one_cubin_each(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.cu").write_text(
        "#define GG_PARTS 3  // a comment may follow\n// part 0: a b\n// part 1: c\n// part 2: d\n// part 3: e f\n"
    )
    source = cc.find_source("big", src)
    assert source.parts == 3
    (tmp_path / "cache").mkdir()
    with ThreadPoolExecutor(3) as links:
        build = kernel_cache.load_or_build(
            source, "sm_90", FakePartCompiler(barrier=threading.Barrier(3)), tmp_path / "cache", links
        )
    assert [names for names, _ in build] == [["a", "b", "e", "f"], ["c"], ["d"]]
    assert kernel_cache.load_or_build(source, "sm_90", FakePartCompiler(), tmp_path / "cache") == build  # from the cache
    whole = kernel_cache.load_or_compile(source, "sm_90", FakePartCompiler(), tmp_path / "cache")
    assert cc.cubin_kernels(whole) == ["a", "b", "c", "d", "e", "f"]  # a whole build holds every part


def test_a_source_without_parts_is_one_part():
    assert cc.Source("a", Path("a.cu"), "// no parts\n#define GG_PARTS_OF_SOMETHING 4\n", "0").parts == 1


def test_cubin_kernels_reads_the_code_sections():
    assert cc.cubin_kernels(b"\x7fELF.text.k2\x00.nv.info.k2\x00.text.k1\x00.text.k2\x00") == ["k1", "k2"]


def test_groups_deal_names_round_robin():
    assert kernel_cache.groups_of(["a", "b", "c", "d", "e"], size=2) == [["a", "d"], ["b", "e"], ["c"]]
    assert kernel_cache.groups_of(["a"], size=12) == [["a"]]
    assert kernel_cache.groups_of([], size=12) == []


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
    target = tmp_path / "k.cubin"
    seen = {}
    real_replace = os.replace

    def checking_replace(src, dst):
        seen["target_before"] = Path(dst).exists()
        seen["temp_complete"] = Path(src).read_bytes() == b"x" * 100_000
        return real_replace(src, dst)

    monkeypatch.setattr(kernel_cache.os, "replace", checking_replace)
    kernel_cache.atomic_write(target, b"x" * 100_000)
    assert seen == {"target_before": False, "temp_complete": True}
    assert target.read_bytes() == b"x" * 100_000

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(kernel_cache.os, "replace", failing_replace)
    with pytest.raises(OSError):
        kernel_cache.atomic_write(tmp_path / "other.cubin", b"y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.cubin"]  # no temp file, no half target


def _compile_in_process(args):
    src_dir, cache, log = args
    source = cc.find_source("a", Path(src_dir))
    return kernel_cache.load_or_build(source, "sm_90", FakeCompiler(Path(log), delay=0.5), Path(cache))


def test_processes_needing_the_same_kernel_compile_it_once(tmp_path):
    make_sources(tmp_path / "src", ["a"])
    (tmp_path / "cache").mkdir()
    log = tmp_path / "log"
    args = (str(tmp_path / "src"), str(tmp_path / "cache"), str(log))
    with ProcessPoolExecutor(4) as pool:
        results = list(pool.map(_compile_in_process, [args] * 4))
    assert all(result == results[0] for result in results)
    assert len(log.read_text().splitlines()) == 1, log.read_text()


def test_all_sources_compile_in_parallel_and_a_broken_one_fails_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "src"
    make_sources(src, ["a", "b", "c"])
    (src / "c.cu").write_text("#error broken\n")
    monkeypatch.setattr(kernel_cache, "find_source", lambda name: cc.find_source(name, src))
    fake = FakeCompiler(barrier=threading.Barrier(3))
    results = kernel_cache.builds("sm_90", ["a", "b", "c"], using=fake, workers=3)
    assert results["a"][0][1].startswith(b"sm_90:") and results["b"][0][1].startswith(b"sm_90:")
    assert isinstance(results["c"], KernelError) and "c.cu" in str(results["c"])


def test_an_unwritable_cache_still_compiles(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRADGEN_CUDA_CACHE", str(blocker / "cache"))  # under a file: mkdir fails
    src = tmp_path / "src"
    make_sources(src, ["a"])
    monkeypatch.setattr(kernel_cache, "find_source", lambda name: cc.find_source(name, src))
    assert kernel_cache.builds("sm_90", ["a"], using=FakeCompiler())["a"][0][1].startswith(b"sm_90:")
    assert "not writable" in capsys.readouterr().err


def test_the_default_cache_is_the_user_cache_dir(monkeypatch):
    platformdirs = pytest.importorskip("platformdirs")
    monkeypatch.delenv("GRADGEN_CUDA_CACHE", raising=False)
    assert kernel_cache.cache_dir() == Path(platformdirs.user_cache_dir("gradgen")) / "cuda"


# -- the compiler's choice -----------------------------------------------------------------------


@pytest.mark.parametrize("nvrtc, nvcc, expected", [(True, True, "nvrtc"), (True, False, "nvrtc"), (False, True, "nvcc")])
def test_nvrtc_first_then_nvcc(monkeypatch, nvrtc, nvcc, expected):
    tried = []

    def make(kind):
        tried.append(kind)
        return (FakeCompiler() if {"nvrtc": nvrtc, "nvcc": nvcc}[kind] else None), f"{kind}: not here"

    monkeypatch.setattr(cc, "_make", make)
    cc.compiler()
    assert tried[-1] == expected and tried[0] == "nvrtc"


def test_the_environment_picks_the_compiler(monkeypatch):
    tried = []
    monkeypatch.setattr(cc, "_make", lambda kind: (tried.append(kind), (FakeCompiler(), ""))[1])
    monkeypatch.setenv("GRADGEN_CUDA_COMPILER", "nvcc")
    cc.compiler()
    assert tried == ["nvcc"]
    monkeypatch.setenv("GRADGEN_CUDA_COMPILER", "clang")
    cc.compiler.cache_clear()
    with pytest.raises(KernelError, match="GRADGEN_CUDA_COMPILER='clang'"):
        cc.compiler()


def test_no_compiler_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(cc, "_make", lambda kind: (None, f"{kind}: not here"))
    with pytest.raises(KernelError) as caught:
        cc.compiler()
    message = str(caught.value)
    assert "\n" not in message
    assert "no CUDA compiler" in message and "nvrtc: not here" in message and "nvcc: not here" in message
    assert "gradgen[cuda]" in message


def test_without_cuda_core_nor_nvcc_the_real_probe_says_why(monkeypatch):
    monkeypatch.setattr(cc, "_cuda_core", lambda: (_ for _ in ()).throw(ImportError("No module named 'cuda'")))
    monkeypatch.setattr(cc, "_find_nvcc", lambda: None)
    with pytest.raises(KernelError, match=r"NVRTC: \w*Error.*nvcc: not on PATH"):
        cc.compiler()


def test_precompile_refuses_a_malformed_arch(capsys):
    from gradgen.cuda import precompile

    with pytest.raises(SystemExit):
        precompile.main(["--arch", "90"])
    assert "expected an architecture" in capsys.readouterr().err


# -- the real compilers, where installed -----------------------------------------------------------


def _real(kind):
    found, why = cc._make(kind)
    if found is None:
        pytest.skip(why)
    return found


@pytest.mark.parametrize("kind", ["nvrtc", "nvcc"])
def test_a_real_compiler_builds_a_source_with_gradgen_headers(kind, tmp_path):
    using = _real(kind)
    (tmp_path / "probe.cu").write_text(
        (cc.CUDA_SOURCES / "common.h").read_text().replace("#pragma once", "")
        + '\n#include <math_constants.h>\nextern "C" __global__ void probe(float* out, int64_t n) {\n'
        "    GG_GRID_STRIDE(i, n) { out[i] = -INFINITY + CUDART_PI_F; }\n}\n"
    )
    cubin = using.compile(cc.find_source("probe", tmp_path), "sm_90")
    assert cubin[:4] == b"\x7fELF" and b"probe" in cubin


@pytest.mark.parametrize("kind", ["nvrtc", "nvcc"])
def test_a_real_compile_error_names_the_source_and_line(kind, tmp_path):
    using = _real(kind)
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k() { undeclared_thing(); }\n')
    with pytest.raises(KernelError, match=r"(?s)broken\.cu does not compile .*\n.*undeclared_thing"):
        using.compile(cc.find_source("broken", tmp_path), "sm_90")


@pytest.mark.parametrize("kind", ["nvrtc", "nvcc"])
def test_a_real_compiler_builds_each_part_with_its_own_kernels(kind, tmp_path):
    using = _real(kind)
    (tmp_path / "common.h").write_text((cc.CUDA_SOURCES / "common.h").read_text())
    blocks = "".join(
        f'#if GG_PART({k})\nextern "C" __global__ void kern{k}(float* out) {{ out[threadIdx.x] = {k}.0f; }}\n#endif\n'
        for k in range(3)
    )
    (tmp_path / "parted.cu").write_text('#define GG_PARTS 2\n#include "common.h"\n' + blocks)
    source = cc.find_source("parted", tmp_path)
    build = kernel_cache.compile_build(source, "sm_90", using)
    assert [names for names, _ in build] == [["kern0", "kern2"], ["kern1"]]
    assert cc.cubin_kernels(using.compile(source, "sm_90")) == ["kern0", "kern1", "kern2"]


def test_nvrtc_splits_a_source_into_kernel_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_SPLIT_COMPILE", "1")
    using = _real("nvrtc")
    if not using.can_split:
        pytest.skip("nvJitLink is not installed")
    monkeypatch.setattr(kernel_cache, "GROUP_SIZE", 2)
    (tmp_path / "three.cu").write_text(
        '#include "common.h"\n'
        + "".join(
            f'extern "C" __global__ void kern{i}(float* out, TensorDesc d) {{ out[gg_offset(threadIdx.x, d, d)] = {i}.0f; }}\n'
            for i in range(3)
        )
    )
    (tmp_path / "common.h").write_text((cc.CUDA_SOURCES / "common.h").read_text())
    build = kernel_cache.compile_build(cc.find_source("three", tmp_path), "sm_90", using)
    assert [names for names, _ in build] == [["kern0", "kern2"], ["kern1"]]
    for names, cubin in build:
        assert cubin[:4] == b"\x7fELF"
        held = {f"kern{i}" for i in range(3) if f".text.kern{i}\0".encode() in cubin}  # a code section per kernel
        assert held == set(names)


def test_a_whole_module_is_one_cubin_even_from_a_splitting_compiler(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "gen.cu").write_text("// kernels: a b\n")
    source = cc.find_source("gen", src)
    split = FakeSplitCompiler()
    split.compile = lambda source, arch: b"whole:" + source.text.encode()
    (tmp_path / "cache").mkdir()
    assert kernel_cache.load_or_compile(source, "sm_90", split, tmp_path / "cache") == b"whole:// kernels: a b\n"
    assert kernel_cache.load_or_build(source, "sm_90", split, tmp_path / "cache") == [(["a", "b"], b"sm_90:a b")]


def test_a_compile_worker_closes_both_its_pipes():
    """A closed NVRTC worker leaves no open pipe for the collector to warn about (one
    'unclosed file' ResourceWarning per worker used to follow every compile)."""
    from gradgen.cuda.compile_pool import _Worker

    worker = _Worker()
    assert worker.alive()
    worker.close()
    assert not worker.alive()
    assert worker.process.stdin.closed and worker.process.stdout.closed
