"""Compiling gradgen's CUDA sources (gradgen/kernels/cuda/*.cu) to cubin for one GPU architecture.

Two compilers, tried in this order (``GRADGEN_CUDA_COMPILER=nvrtc|nvcc`` picks one):

- NVRTC through cuda-python's ``cuda.core`` (``Program``): a library, so no CUDA toolkit is needed;
  the pip wheels nvidia-cuda-nvrtc, nvidia-cuda-runtime (headers) and nvidia-cuda-cccl (CUB)
  bring all of it, and ``cuda.pathfinder`` finds their headers (or a toolkit's).
- nvcc from a CUDA toolkit (on PATH, or under CUDA_HOME / CUDA_PATH / /usr/local/cuda), the fallback.

Nothing here imports PyCUDA or needs a GPU: a cubin for a named architecture can be built on any
machine (see gradgen/cuda/precompile.py). Loading and caching are in runtime.py and kernel_cache.py.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gradgen.errors import KernelError

CUDA_SOURCES = Path(__file__).resolve().parent.parent / "kernels" / "cuda"
NVRTC_INCLUDE = Path(__file__).resolve().parent / "nvrtc_include"  # what NVRTC lacks and nvcc has
NVRTC_PRELUDE = "gradgen_nvrtc.h"
STD = "c++17"
COMPILERS = ("nvrtc", "nvcc")
_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.MULTILINE)
_PARTS = re.compile(r"^\s*#\s*define\s+GG_PARTS\s+(\d+)\b", re.MULTILINE)
_KERNEL_SECTION = re.compile(rb"\.text\.([A-Za-z_$][\w$]*)\x00")


@dataclass(frozen=True)
class Source:
    """One .cu file: its module name (the file's stem), text, and a digest of the text and of every
    header it includes from gradgen's own include directories (so editing common.h recompiles)."""

    name: str
    path: Path
    text: str
    digest: str

    @property
    def parts(self) -> int:
        """How many parts the source is compiled in (``#define GG_PARTS n``; 1 when it says none).
        Part ``p`` keeps the kernel instantiations guarded by ``#if GG_PART(k)`` with ``k % n == p``
        (see common.h); the parts compile at once, so one large source does not bound the cold start."""
        found = _PARTS.search(self.text)
        return max(1, int(found.group(1))) if found else 1


def local_headers(text: str, directories: tuple[Path, ...]) -> list[Path]:
    """The headers ``text`` includes, directly or through each other, that live in ``directories``
    (CUDA's and the C++ library's own headers are covered by the compiler's identity instead)."""
    found: list[Path] = []
    pending = [text]
    while pending:
        for name in _INCLUDE.findall(pending.pop()):
            for directory in directories:
                path = directory / name
                if path.is_file() and path not in found:
                    found.append(path)
                    pending.append(path.read_text())
                    break
    return found


def load_source(path: Path) -> Source:
    text = path.read_text()
    digest = hashlib.sha256(text.encode())
    for header in local_headers(text, (path.parent,)):
        digest.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
    return Source(path.stem, path, text, digest.hexdigest())


def source_names(directory: Path = CUDA_SOURCES) -> list[str]:
    """The module names of every CUDA source (``module(name)`` in runtime.py compiles ``name.cu``)."""
    return sorted(path.stem for path in directory.glob("*.cu"))


def find_source(name: str, directory: Path = CUDA_SOURCES) -> Source:
    path = directory / f"{name}.cu"
    if not path.is_file():
        raise KernelError(f"no CUDA source {path.name} in {directory}")
    return load_source(path)


class Compiler:
    """Turns a Source into cubins for ``arch`` (``sm_90``). ``identity`` names the compiler, its
    version, options and header directories: everything besides the source that shapes the cubin.

    A compiler that ``can_split`` builds one source in two stages, so that one large source does
    not bound the cold start: ``ptx`` runs the front end and the optimiser once for the whole
    source, then ``assemble`` turns any subset of its kernels (see ``split_ptx``) into a cubin,
    and the subsets assemble in parallel. ptxas compiles each kernel on its own, so the machine
    code is the whole source's. Otherwise ``compile`` builds the whole source.
    """

    kind = ""
    version = ""
    identity = ""
    can_split = False

    def compile(self, source: Source, arch: str, part: int | None = None) -> bytes:
        """The cubin of ``source`` (with ``part``: only that part's kernels, see ``Source.parts``)."""
        raise NotImplementedError

    def ptx(self, source: Source, arch: str, part: int | None = None) -> str:
        """The PTX of ``source`` (or of one part) for a virtual architecture (``compute_80``), or, in
        split builds, for ``sm_XY``."""
        raise NotImplementedError

    def supported_archs(self) -> list[str] | None:
        """The ``sm_XY`` architectures this compiler can target, or None where it cannot say."""
        return None

    def assemble(self, ptx: str, arch: str, source: Source) -> bytes:
        raise NotImplementedError


class NvrtcCompiler(Compiler):
    kind = "nvrtc"

    def __init__(self):
        from cuda.bindings import nvrtc

        self._core = _cuda_core()
        result, major, minor = nvrtc.nvrtcVersion()
        if int(result) != 0:
            raise RuntimeError(f"nvrtcVersion failed: {result}")
        self.version = f"{major}.{minor}"
        self.include_path = [str(NVRTC_INCLUDE), *_cuda_header_dirs()]  # and the source's own directory
        # Split builds (PTX once, kernel groups assembled in parallel by nvJitLink) are opt-in until
        # measured on a GPU: nvJitLink's ptxas schedules differently from NVRTC's own (another
        # instruction count for the same PTX), so their speed is not the whole build's by
        # construction. An earlier split through LTO made GPT-2 small's step 4x slower.
        self.assembler = _nvjitlink_version()
        self.can_split = self.assembler is not None and os.environ.get("GRADGEN_CUDA_SPLIT_COMPILE") == "1"
        shims = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(NVRTC_INCLUDE.iterdir()))).hexdigest()
        split = f"split by nvjitlink {self.assembler}" if self.can_split else "whole"
        self.identity = f"nvrtc {self.version}; {split}; std={STD}; include={self.include_path}; shims {shims[:16]}"

    def _include_path(self, source: Source) -> list[str]:
        return [str(source.path.parent), *self.include_path]

    def compile(self, source: Source, arch: str, part: int | None = None) -> bytes:
        options = self._core.ProgramOptions(
            name=source.path.name,
            arch=arch,
            std=STD,
            pre_include=NVRTC_PRELUDE,
            include_path=self._include_path(source),
            define_macro=part_defines(part) or None,
        )
        program = self._core.Program(source.text, "c++", options=options)
        return self._run("NVRTC", source, arch, lambda: _code_bytes(program.compile("cubin")))

    def ptx(self, source: Source, arch: str, part: int | None = None) -> str:
        """The source's PTX, through NVRTC's own API: cuda.core's PTX path asks the driver whether
        it could load the result, and here no GPU may be present (a Docker build)."""
        from cuda.bindings import nvrtc

        options = [
            f"--gpu-architecture={arch}",
            f"--std={STD}",
            f"--pre-include={NVRTC_PRELUDE}",
            *(f"--include-path={d}" for d in self._include_path(source)),
            *(f"--define-macro={name}={value}" for name, value in part_defines(part)),
        ]
        err, program = nvrtc.nvrtcCreateProgram(source.text.encode(), source.path.name.encode(), 0, [], [])
        _nvrtc_check(err, source, arch, self.version, program=None)
        try:
            (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
            _nvrtc_check(err, source, arch, self.version, program)
            err, size = nvrtc.nvrtcGetPTXSize(program)
            buffer = b" " * size
            (err,) = nvrtc.nvrtcGetPTX(program, buffer)
            _nvrtc_check(err, source, arch, self.version, program)
        finally:
            nvrtc.nvrtcDestroyProgram(program)
        return buffer.rstrip(b"\0").decode()

    def supported_archs(self) -> list[str] | None:
        from cuda.bindings import nvrtc

        result, archs = nvrtc.nvrtcGetSupportedArchs()
        return [f"sm_{arch}" for arch in archs] if int(result) == 0 else None

    def assemble(self, ptx: str, arch: str, source: Source) -> bytes:
        core = self._core
        return self._run(
            "nvJitLink",
            source,
            arch,
            lambda: _code_bytes(
                core.Linker(core.ObjectCode.from_ptx(ptx.encode()), options=core.LinkerOptions(arch=arch)).link("cubin")
            ),
        )

    def _run(self, what: str, source: Source, arch: str, action) -> bytes:
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - cuda.core raises its own types; the log is in the message
            raise KernelError(_compile_failure(source, arch, f"{what} {self.version}", str(exc))) from exc


def _nvrtc_check(err, source: Source, arch: str, version: str, program) -> None:
    from cuda.bindings import nvrtc

    if int(err) == 0:
        return
    log = ""
    if program is not None:
        _, size = nvrtc.nvrtcGetProgramLogSize(program)
        buffer = b" " * size
        nvrtc.nvrtcGetProgramLog(program, buffer)
        log = buffer.rstrip(b"\0").decode(errors="replace")
    raise KernelError(_compile_failure(source, arch, f"NVRTC {version}", f"{err}\n{log}"))


_ENTRY = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)?\.entry[ \t]+([A-Za-z_$][\w$]*)", re.MULTILINE)


def split_ptx(ptx: str) -> tuple[str, dict[str, str]]:
    """``(common, {kernel: its text})``: a PTX module cut into its ``.entry`` definitions and
    everything else, in order (the header, global variables, device functions), so that ``common``
    followed by any subset of the kernels is a valid module. A definition ends at the first line
    that is a lone ``}`` (NVVM writes a function's braces alone on their lines at column 0, and
    indents everything inside)."""
    common, kernels, at = [], {}, 0
    for match in _ENTRY.finditer(ptx):
        if match.start() < at:
            continue
        end = ptx.index("\n}", ptx.index("{", match.end())) + 2
        common.append(ptx[at : match.start()])
        kernels[match.group(1)] = ptx[match.start() : end] + "\n"
        at = end
    common.append(ptx[at:])
    return "".join(common), kernels


class NvccCompiler(Compiler):
    kind = "nvcc"

    def __init__(self, nvcc: str):
        self.nvcc = nvcc
        result = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True)
        self.version = result.stdout.strip().splitlines()[-1]
        self.options = [f"-std={STD}", "-O3"]
        self.identity = f"nvcc {self.version}; {self.options}"

    def compile(self, source: Source, arch: str, part: int | None = None) -> bytes:
        return self._run(source, arch, part, "-cubin")

    def ptx(self, source: Source, arch: str, part: int | None = None) -> str:
        return self._run(source, arch, part, "-ptx").decode()

    def supported_archs(self) -> list[str] | None:
        result = subprocess.run([self.nvcc, "--list-gpu-code"], capture_output=True, text=True)
        return result.stdout.split() if result.returncode == 0 else None

    def _run(self, source: Source, arch: str, part: int | None, output: str) -> bytes:
        with tempfile.TemporaryDirectory(prefix="gradgen-nvcc-") as tmp:
            out = Path(tmp) / f"{source.name}.out"
            result = subprocess.run(
                [
                    self.nvcc,
                    output,
                    f"-arch={arch}",
                    *self.options,
                    *(f"-D{name}={value}" for name, value in part_defines(part)),
                    f"-I{source.path.parent}",
                    "-o",
                    str(out),
                    str(source.path),
                ],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise KernelError(_compile_failure(source, arch, "nvcc", result.stderr))
            return out.read_bytes()


def part_defines(part: int | None) -> list[tuple[str, str]]:
    """The macro that selects one part of a source compiled in parts (none: the whole source)."""
    return [] if part is None else [("GG_PART_INDEX", str(int(part)))]


def cubin_kernels(cubin: bytes) -> list[str]:
    """The functions a cubin holds code for, from its ELF section names (``.text.<name>``): the
    kernels, and any device function left out of line."""
    return sorted({name.decode() for name in _KERNEL_SECTION.findall(cubin)})


def _compile_failure(source: Source, arch: str, compiler: str, log: str) -> str:
    lines = [line for line in log.replace("\x00", "").splitlines() if line.strip()]
    shown = "\n".join(lines[:20]) + (f"\n... ({len(lines) - 20} more lines)" if len(lines) > 20 else "")
    return f"CUDA source {source.path.name} does not compile with {compiler} for {arch}:\n{shown}"


def _cuda_core():
    """cuda.core's namespace (its classes are top level since 0.4, under .experimental before)."""
    try:
        import cuda.core as core

        core.Program  # noqa: B018 - fails on versions that keep it under .experimental
    except (ImportError, AttributeError):
        import cuda.core.experimental as core
    return core


def _code_bytes(code) -> bytes:
    """The bytes of a cuda.core ObjectCode (``.code``; ``._module`` on old versions)."""
    return bytes(getattr(code, "code", None) or code._module)


def _nvjitlink_version() -> str | None:
    """nvJitLink's version where the library loads (the pip wheel or a toolkit's), else None."""
    try:
        from cuda.bindings import nvjitlink

        major, minor = nvjitlink.version()
    except Exception:  # noqa: BLE001 - no cuda.bindings.nvjitlink, or the library is missing
        return None
    return f"{major}.{minor}"


def _cuda_header_dirs() -> list[str]:
    """CUDA's headers (cuda_fp16.h, math_constants.h) and CCCL's (CUB), from the pip wheels or a
    toolkit, as cuda.pathfinder finds them; a toolkit's include dir where pathfinder is missing."""
    found = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        find_nvidia_header_directory = None
    if find_nvidia_header_directory is not None:
        for library in ("cudart", "cccl"):
            try:
                directory = find_nvidia_header_directory(library)
            except Exception:  # noqa: BLE001 - an unknown library name on an old pathfinder
                directory = None
            if directory:
                found.append(str(directory))
    home = _cuda_home()
    if home is not None:
        for sub in ("include", "include/cccl"):
            directory = home / sub
            if directory.is_dir() and str(directory) not in found:
                found.append(str(directory))
    return found


def _cuda_home() -> Path | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = _cuda_home()
    if home is not None and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return None


def _make(kind: str) -> tuple[Compiler | None, str]:
    """The compiler of ``kind``, or None and why it is not available."""
    if kind == "nvrtc":
        try:
            return NvrtcCompiler(), ""
        except Exception as exc:  # noqa: BLE001 - ImportError, a missing libnvrtc, ...
            return None, f"NVRTC: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    nvcc = _find_nvcc()
    if nvcc is None:
        return None, "nvcc: not on PATH nor under CUDA_HOME"
    try:
        return NvccCompiler(nvcc), ""
    except (OSError, subprocess.CalledProcessError) as exc:
        return None, f"nvcc: {exc}"


@functools.lru_cache(maxsize=None)
def compiler(preferred: str | None = None) -> Compiler:
    """The first available of NVRTC and nvcc (or only ``preferred``/``GRADGEN_CUDA_COMPILER``)."""
    preferred = preferred or os.environ.get("GRADGEN_CUDA_COMPILER") or None
    if preferred is not None and preferred not in COMPILERS:
        raise KernelError(f"GRADGEN_CUDA_COMPILER={preferred!r}: expected one of {', '.join(COMPILERS)}")
    reasons = []
    for kind in (preferred,) if preferred else COMPILERS:
        found, why = _make(kind)
        if found is not None:
            return found
        reasons.append(why)
    raise KernelError(
        "no CUDA compiler for gradgen's kernels (" + "; ".join(reasons) + "): install "
        "gradgen[cuda] (NVRTC through cuda-core and nvidia-cuda-nvrtc) or a CUDA toolkit with nvcc"
    )
