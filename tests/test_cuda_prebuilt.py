"""Kernels compiled ahead of time (gradgen/cuda/prebuilt.py), the wheel build's step that makes them
(build_hook.py), precompile's --into, and the compile workers (compile_pool.py), without a GPU.

A fake compiler stands in for NVRTC: its 'cubins' name the source, part and architecture, so a
test sees which build was loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradgen.cuda import build_hook, compile_pool, kernel_cache, prebuilt, precompile
from gradgen.cuda import compile as cc
from gradgen.errors import KernelError


class PartsCompiler(cc.Compiler):
    """A 'cubin' is an ELF-like blob with one code section per kernel (``<source>_p<part>``); PTX is
    one ``.entry`` per kernel. A source containing ``#error`` does not compile."""

    kind, version, identity = "fake", "1.0", "fake 1.0"

    def supported_archs(self):
        return ["sm_80", "sm_86", "sm_90"]

    def _names(self, source, part):
        if "#error" in source.text:
            raise KernelError(f"CUDA source {source.path.name} does not compile")
        parts = range(source.parts) if part is None else [part]
        return [f"{source.name.replace('-', '_')}_p{p}" for p in parts]

    def compile(self, source, arch, part=None):
        names = self._names(source, part)
        return f"\x7fELF {arch} {source.digest[:8]} ".encode() + b"".join(b".text." + n.encode() + b"\x00" for n in names)

    def ptx(self, source, arch, part=None):
        names = self._names(source, part)
        return f".version 9.0\n.target {arch}\n// {source.digest[:8]}\n" + "".join(
            f".visible .entry {n}(\n)\n{{\n\tret;\n}}\n" for n in names
        )


class NoCompiler(cc.Compiler):
    def compile(self, source, arch, part=None):
        raise AssertionError("compiled although a prebuilt build matches")


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """Two sources (one in 2 parts) standing in for gradgen/kernels/cuda, and no generated ones."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "common.h").write_text("#define X 1\n")
    (src / "a.cu").write_text('#include "common.h"\n// a\n')
    (src / "b.cu").write_text("#define GG_PARTS 2\n// b\n")
    monkeypatch.setattr(prebuilt, "CUDA_SOURCES", src)
    monkeypatch.setattr(prebuilt, "find_source", lambda name: cc.find_source(name, src))
    monkeypatch.setattr(kernel_cache, "find_source", lambda name: cc.find_source(name, src))
    monkeypatch.setattr(prebuilt, "generated_sources", lambda into: ([], ""))
    monkeypatch.setenv("GRADGEN_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GRADGEN_CUDA_PREBUILT", raising=False)
    return src


def make_prebuilt(tmp_path, monkeypatch, archs=("sm_90",), ptx="compute_80") -> Path:
    into = tmp_path / "prebuilt"
    prebuilt.build(into, list(archs), ptx, PartsCompiler(), workers=2)
    monkeypatch.setattr(prebuilt, "DIRECTORY", into)
    prebuilt.read_index.cache_clear()
    return into


def test_a_matching_prebuilt_build_is_used_without_any_compiler(sources, tmp_path, monkeypatch):
    into = make_prebuilt(tmp_path, monkeypatch)
    index = json.loads((into / "index.json").read_text())
    assert index["compiler"] == "fake 1.0" and sorted(index["builds"]) == ["compute_80", "sm_90"]
    monkeypatch.setattr(kernel_cache, "compiler", lambda *a: (_ for _ in ()).throw(AssertionError("no compiler needed")))
    heard = []
    found = kernel_cache.builds("sm_90", ["a", "b"], on_done=lambda name, s, how: heard.append((name, how)))
    assert [names for names, _ in found["b"]] == [["b_p0"], ["b_p1"]]  # one file per part, its kernels listed
    assert found["a"][0][1].startswith(b"\x7fELF sm_90 ") and isinstance(found["a"], prebuilt.Prebuilt)
    assert sorted(heard) == [("a", "prebuilt"), ("b", "prebuilt")]
    assert not (tmp_path / "cache").exists()  # nothing compiled, nothing cached
    a = cc.find_source("a", sources)
    assert kernel_cache.load_or_compile(a, "sm_90", None, None) == found["a"][0][1]  # a module loaded whole


def test_an_edited_source_or_header_or_another_arch_is_not_taken_from_the_prebuilt_build(sources, tmp_path, monkeypatch):
    make_prebuilt(tmp_path, monkeypatch)
    a = cc.find_source("a", sources)
    assert prebuilt.lookup(a, "sm_90") is not None
    assert prebuilt.lookup(a, "sm_86") is None and prebuilt.lookup(a, "sm_100") is None  # exact architecture only
    (sources / "common.h").write_text("#define X 2\n")  # the header a.cu includes
    edited = cc.find_source("a", sources)
    assert prebuilt.lookup(edited, "sm_90") is None
    fake = PartsCompiler()
    built = kernel_cache.builds("sm_90", ["a", "b"], using=fake)
    assert not isinstance(built["a"], prebuilt.Prebuilt) and edited.digest[:8].encode() in built["a"][0][1]  # compiled afresh
    assert isinstance(built["b"], prebuilt.Prebuilt)  # b did not change
    assert kernel_cache.builds("sm_86", ["b"], using=fake)["b"][0][1].startswith(b"\x7fELF sm_86")


def test_the_prebuilt_directory_can_be_switched_off_or_moved(sources, tmp_path, monkeypatch):
    into = make_prebuilt(tmp_path, monkeypatch)
    a = cc.find_source("a", sources)
    monkeypatch.setenv("GRADGEN_CUDA_PREBUILT", "0")
    assert prebuilt.lookup(a, "sm_90") is None
    moved = tmp_path / "elsewhere"
    into.rename(moved)
    monkeypatch.setenv("GRADGEN_CUDA_PREBUILT", str(moved))
    assert prebuilt.lookup(a, "sm_90") is not None
    with pytest.raises(AssertionError, match="compiled although"):  # the runtime's retry ignores it
        kernel_cache.builds("sm_90", ["a"], using=NoCompiler(), prebuilt_ok=False)


def test_prebuilt_is_ignored_after_a_build_does_not_load(sources, tmp_path, monkeypatch):
    make_prebuilt(tmp_path, monkeypatch)
    a = cc.find_source("a", sources)
    monkeypatch.setattr(prebuilt, "_DISABLED", [])
    prebuilt.disable("CUDA_ERROR_NO_BINARY_FOR_GPU")
    assert prebuilt.lookup(a, "sm_90") is None


@pytest.mark.parametrize(
    "damage",
    ["no index", "garbage index", "other format", "missing file"],
)
def test_a_damaged_prebuilt_directory_is_no_build(sources, tmp_path, monkeypatch, damage):
    into = make_prebuilt(tmp_path, monkeypatch)
    index = into / "index.json"
    if damage == "no index":
        index.unlink()
    elif damage == "garbage index":
        index.write_text("{not json")
    elif damage == "other format":
        index.write_text(json.dumps(dict(json.loads(index.read_text()), format=99)))
    else:
        next(into.glob("sm_90/a.*")).unlink()
    prebuilt.read_index.cache_clear()
    assert prebuilt.lookup(cc.find_source("a", sources), "sm_90") is None


def test_a_whole_module_takes_only_a_single_file_build(sources, tmp_path, monkeypatch):
    make_prebuilt(tmp_path, monkeypatch)
    b = cc.find_source("b", sources)
    assert prebuilt.lookup(b, "sm_90") is not None and prebuilt.lookup(b, "sm_90", whole=True) is None


def test_without_a_compiler_the_ptx_of_an_older_architecture_is_used(sources, tmp_path, monkeypatch):
    make_prebuilt(tmp_path, monkeypatch, archs=("sm_90",), ptx="compute_80")
    monkeypatch.setattr(kernel_cache, "compiler", lambda *a: (_ for _ in ()).throw(KernelError("no CUDA compiler")))
    found = kernel_cache.builds("sm_100", ["a", "b"])  # no cubin for sm_100
    assert [names for names, _ in found["b"]] == [["b_p0"], ["b_p1"]]
    ptx = found["a"][0][1]
    assert ptx.startswith(b".version 9.0\n.target compute_80") and ptx.endswith(b"\0")  # loads NUL-terminated
    older = kernel_cache.builds("sm_75", ["a"])["a"]  # PTX of compute_80 does not run on sm_75
    assert isinstance(older, KernelError) and "no CUDA compiler" in str(older)


def test_generated_sources_get_the_digest_the_run_computes(tmp_path):
    import hashlib

    from gradgen.kernels.cuda.launch import inline_common_header

    built, note = prebuilt.generated_sources(tmp_path / "staged")
    assert note == "" and built, "the families' generated sources"
    run_dir = tmp_path / "cache" / "generated"  # as launch.generated_module writes them
    run_dir.mkdir(parents=True)
    for source in built:
        text = source.text
        assert text == inline_common_header(text)  # common.h already inlined
        path = run_dir / f"{source.name}-{hashlib.sha256(text.encode()).hexdigest()[:20]}.cu"
        path.write_text(text)
        assert cc.load_source(path).digest == source.digest


def test_a_failed_compile_writes_nothing_and_keeps_the_old_directory(sources, tmp_path, monkeypatch):
    into = make_prebuilt(tmp_path, monkeypatch)
    before = sorted(p.relative_to(into) for p in into.rglob("*"))
    (sources / "b.cu").write_text("#error broken\n")
    with pytest.raises(KernelError, match="b.cu does not compile"):
        prebuilt.build(into, ["sm_90"], "compute_80", PartsCompiler(), workers=2)
    assert sorted(p.relative_to(into) for p in into.rglob("*")) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left


def test_a_rebuild_replaces_the_directory(sources, tmp_path, monkeypatch):
    into = make_prebuilt(tmp_path, monkeypatch, archs=("sm_80", "sm_90"))
    assert (into / "sm_80").is_dir()
    prebuilt.build(into, ["sm_90"], None, PartsCompiler(), workers=1)
    assert sorted(p.name for p in into.iterdir()) == ["index.json", "sm_90"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- precompile --into ---------------------------------------------------------------------------


@pytest.fixture
def fake_compiler(monkeypatch):
    monkeypatch.setattr(precompile, "compiler", lambda kind=None: PartsCompiler())


def test_precompile_into_writes_the_default_archs_the_compiler_supports_and_ptx(sources, tmp_path, fake_compiler, capsys):
    assert precompile.main(["--into", str(tmp_path / "out"), "--jobs", "2"]) == 0
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert sorted(index["builds"]) == ["compute_80", "sm_80", "sm_86", "sm_90"]  # sm_89/100/120 unsupported by the fake
    assert "4 architecture(s)" in capsys.readouterr().out
    assert precompile.main(["--into", str(tmp_path / "out"), "--arch", "sm_90", "--no-ptx"]) == 0
    assert sorted(json.loads((tmp_path / "out" / "index.json").read_text())["builds"]) == ["sm_90"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--into", "{tmp}/file"], "exists and is not a directory"),
        (["--into", "{tmp}/missing/dir"], "no directory"),
        (["--no-ptx"], "--no-ptx only goes with --into"),
        (["--into", "{tmp}/out", "--arch", "sm_120"], "cannot compile for sm_120"),
        (["--into", "{tmp}/out", "--jobs", "0"], "--jobs must be at least 1"),
    ],
)
def test_precompile_into_errors_are_one_line_exit_2(sources, tmp_path, fake_compiler, capsys, args, message):
    (tmp_path / "file").write_text("")
    code = precompile.main([a.replace("{tmp}", str(tmp_path)) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "out").exists()


def test_precompile_into_an_unwritable_parent_is_exit_2(tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert precompile.main(["--into", str(locked / "out")]) == 2
    assert "is not writable" in capsys.readouterr().err


# -- the wheel build's step ----------------------------------------------------------------------


def _no_nvrtc_here():
    try:
        import cuda.core  # noqa: F401
    except ImportError:
        return
    pytest.skip("NVRTC is installed here: the skip path needs an interpreter without a compiler")


def test_the_build_step_is_skipped_with_a_notice_where_no_compiler_exists(tmp_path, capsys):
    _no_nvrtc_here()
    environ = dict(os.environ, GRADGEN_CUDA_COMPILER="nvrtc", GRADGEN_PREBUILD_PYTHON=sys.executable)
    assert build_hook.prebuild(tmp_path / "prebuilt", environ) is False
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no prebuilt CUDA kernels in this build (no CUDA compiler" in err
    assert not (tmp_path / "prebuilt").exists()
    with pytest.raises(SystemExit, match="GRADGEN_PREBUILD=1 but no CUDA compiler"):
        build_hook.prebuild(tmp_path / "prebuilt", dict(environ, GRADGEN_PREBUILD="1"))


def test_the_build_step_is_switched_off_by_the_environment(tmp_path, capsys):
    environ = dict(os.environ, GRADGEN_PREBUILD="0", GRADGEN_PREBUILD_PYTHON="/nonexistent/python")
    assert build_hook.prebuild(tmp_path / "prebuilt", environ) is False
    assert "GRADGEN_PREBUILD=0" in capsys.readouterr().err and not (tmp_path / "prebuilt").exists()
    with pytest.raises(SystemExit, match="expected 0, 1 or auto"):
        build_hook.prebuild(tmp_path / "prebuilt", dict(environ, GRADGEN_PREBUILD="yes"))


def test_a_missing_build_interpreter_is_a_notice(tmp_path, capsys):
    environ = dict(os.environ, GRADGEN_PREBUILD_PYTHON=str(tmp_path / "no-python"))
    environ.pop("GRADGEN_PREBUILD", None)
    assert build_hook.prebuild(tmp_path / "prebuilt", environ) is False
    assert "cannot run it" in capsys.readouterr().err


# -- compile workers -----------------------------------------------------------------------------


class WorkerCompiler(PartsCompiler):
    """The compiler a test's worker processes make (a stub replaces gradgen's ``compiler`` there)."""

    kind = "nvrtc"  # the pool sends NVRTC's compiles to workers


def test_compiles_run_in_fresh_worker_processes(sources, tmp_path, monkeypatch):
    """The worker makes its own compiler by kind; here a stub module on the worker's sys.path
    replaces gradgen.cuda.compile.compiler with the fake (the parent's sys.path reaches it)."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sitecustomize.py").write_text(
        "import gradgen.cuda.compile as cc, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_cuda_prebuilt import WorkerCompiler\n"
        "cc.compiler = lambda kind=None: WorkerCompiler()\n"
        "with open(" + repr(str(tmp_path / "pids")) + ", 'a') as f: f.write(str(__import__('os').getpid()) + '\\n')\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")]))
    b = cc.find_source("b", sources)
    with compile_pool.ProcessCompiles(2) as links:
        build = kernel_cache.compile_build(b, "sm_90", WorkerCompiler(), links)
        ptx = kernel_cache.compile_build(b, "compute_80", WorkerCompiler(), links, output="ptx")
    assert build == kernel_cache.compile_build(b, "sm_90", WorkerCompiler())  # what this process compiles
    assert [names for names, _ in ptx] == [["b_p0"], ["b_p1"]]
    pids = {int(p) for p in (tmp_path / "pids").read_text().split()}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_a_worker_that_cannot_make_the_compiler_leaves_the_compile_to_the_parent(sources):
    with compile_pool.ProcessCompiles(1) as links:
        future = links.compile(BrokenNvrtc(), cc.find_source("a", sources), "sm_90")
        with pytest.raises(KernelError, match="a.cu does not compile with the test's compiler"):
            future.result(timeout=120)


class BrokenNvrtc(cc.Compiler):
    """An NVRTC whose worker-side twin cannot be made here (no cuda-core, or another identity):
    the job then compiles in the parent, and its error is the compile's own."""

    kind, version, identity = "nvrtc", "0", "nvrtc that no worker has"

    def compile(self, source, arch, part=None):
        raise KernelError(f"CUDA source {source.path.name} does not compile with the test's compiler")


def test_the_process_pool_is_nvrtcs_and_can_be_switched_off(monkeypatch):
    nvrtc = BrokenNvrtc()
    assert isinstance(compile_pool.pool(nvrtc, 2), compile_pool.ProcessCompiles)
    assert not isinstance(compile_pool.pool(PartsCompiler(), 2), compile_pool.ProcessCompiles)
    monkeypatch.setenv("GRADGEN_CUDA_COMPILE_PROCESSES", "0")
    assert not isinstance(compile_pool.pool(nvrtc, 2), compile_pool.ProcessCompiles)


def test_the_worker_answers_each_job_and_ends_with_its_input(tmp_path):
    """The worker program itself: a job for a compiler kind it cannot make is answered 'unfit',
    and it exits 0 when its input closes."""
    import pickle
    import struct

    frame = struct.Struct("<Q")
    source = cc.Source("a", tmp_path / "a.cu", "// a\n", "0" * 64)
    job = ("cubin", "nvrtc", "an identity no compiler has", source, "sm_90", None)
    data = b"".join(frame.pack(len(p)) + p for p in (pickle.dumps(list(sys.path)), pickle.dumps(job)))
    root = str(Path(compile_pool.__file__).resolve().parents[2])
    result = subprocess.run(
        [sys.executable, "-m", "gradgen.cuda.compile_pool"],
        input=data,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=root),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    (size,) = frame.unpack(result.stdout[: frame.size])
    status, why = pickle.loads(result.stdout[frame.size : frame.size + size])
    assert status == "unfit" and why
