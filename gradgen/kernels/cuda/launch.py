"""The CUDA launcher toolkit every family's launchers use (importing it needs no GPU).

- module lookup and dtype dispatch: ``kernel_of(family, entry)`` (compiled and cached by
  ``gradgen.cuda.runtime.module``), ``dtype_suffix`` (the entry points' dtype suffix, None for a
  dtype the kernels do not cover) and the suffix groups ``FLOATS``, ``NUMBERS``, ``CASTABLE``;
- grid sizing and launching: ``grid_for``, ``launch`` (a grid-stride launch over n items),
  ``launch_packed`` (one pre-packed argument buffer), all on gradgen's stream unless told otherwise;
- device arrays: ``ptr``, ``element_strides``, ``desc`` (cached descriptors), ``coalesce``,
  ``is_contiguous``, ``contiguous`` (the input itself, or a C-contiguous copy: never a refusal),
  ``broadcast_to``, ``copy``, ``strided_copy``, ``fill`` (the copy and fill kernels are shape.cu's);
- the CPU fallback, with one meaning: ``cpu_fallback(op_type, ...)`` runs the op's registered numpy
  kernel on host copies and uploads the result(s), with one warning per op type;
- plan caches keyed by host values: ``host_key``, ``plan_cache``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings

import ml_dtypes
import numpy as np

from gradgen.errors import KernelError

BLOCK = 256  # threads per block of a grid-stride launch
MAX_BLOCKS = 65535 * 8  # blocks of a grid-stride launch at most
PLAN_CACHE_LIMIT = 4096  # plans per cache before it is cleared (shapes seen by one process)
INT32_LIMIT = 2**31 - 1

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # numpy has none: ml_dtypes' (kind 'V'), as on the CPU backend
ONNX_BFLOAT16 = 16  # its ONNX element type code
FLOATS = ("f16", "bf16", "f32", "f64")
NUMBERS = FLOATS + ("i32", "i64")
CASTABLE = FLOATS + ("i8", "u8", "i32", "i64", "b8")
# The C type name each supported numpy dtype has in the .cu sources (entry points end in it).
_SUFFIX = {
    np.dtype(np.float16): "f16",
    BFLOAT16: "bf16",  # computed in float32, as float16 is
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.bool_): "b8",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
}


def runtime():
    """gradgen.cuda.runtime, imported on first use (it imports PyCUDA, which needs a GPU)."""
    from gradgen.cuda import runtime as rt

    return rt


# ---------------------------------------------------------------------------------------------
# module lookup and dtype dispatch


def left_pad(values, n: int, fill: int) -> list[int]:
    """``values`` as ints, padded on the left with ``fill`` to ``n`` entries (the kernels' fixed
    spatial rank: lower ranks get unit axes)."""
    values = [int(v) for v in values]
    return [fill] * (n - len(values)) + values


def kernel_of(family: str, entry: str):
    """The kernel ``entry`` of ``<family>.cu`` (dtype suffix included in ``entry``)."""
    return runtime().function(family, entry)


def is_float(dtype) -> bool:
    """float16, bfloat16, float32 or float64: the floats every family's kernels cover."""
    return dtype_suffix(dtype) in FLOATS


@functools.lru_cache(maxsize=None)
def generated_module(name: str, text: str):
    """The loaded module of a CUDA source generated at run time (``text``; a family's table of
    kernels, e.g. elementwise's). It compiles like the .cu files (the same compiler and persistent
    cache), from a copy written under the cache directory with common.h inlined, so that its
    #includes resolve anywhere. Kernels from it are launched with ``launch`` (gradgen's stream)."""
    rt = runtime()
    major, minor = rt.driver.Context.get_device().compute_capability()
    cubin = generated_cubin(name, text, f"sm_{major}{minor}")
    try:
        return rt.driver.module_from_buffer(cubin)
    except rt.driver.Error as exc:
        raise KernelError(f"generated CUDA module {name} does not load: {exc}") from exc


def generated_cubin(name: str, text: str, arch: str) -> bytes:
    """The cubin of a generated source for ``arch``, from the persistent cache or compiled (needs
    no GPU context: sources may compile on other threads while ``generated_module`` loads them)."""
    import hashlib
    import tempfile
    from pathlib import Path

    from gradgen.cuda import compile as cuda_compile
    from gradgen.cuda import kernel_cache

    text = inline_common_header(text)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    cache = kernel_cache.cache_dir()
    directory: Path | None = cache
    try:
        (cache / "generated").mkdir(parents=True, exist_ok=True)
        path = cache / "generated" / f"{name}-{digest}.cu"
        if not path.exists():
            kernel_cache.atomic_write(path, text.encode())
    except OSError:  # no writable cache: compile from a temporary copy, without caching the cubin
        directory = None
        path = Path(tempfile.mkdtemp(prefix="gradgen-generated-")) / f"{name}.cu"
        path.write_text(text)
    source = cuda_compile.load_source(path)
    return kernel_cache.load_or_compile(source, arch, None, directory)  # the compiler only where nothing is shipped or cached


def inline_common_header(text: str) -> str:
    """``text`` with its ``#include "common.h"`` replaced by the header itself."""
    from pathlib import Path

    header = (Path(__file__).resolve().parent / "common.h").read_text().replace("#pragma once\n", "")
    return text.replace('#include "common.h"\n', header, 1)


def dtype_suffix(dtype) -> str | None:
    """The kernels' dtype suffix (f16, bf16, f32, ..., b8), or None for a dtype they do not cover."""
    return _SUFFIX.get(np.dtype(dtype))


def onnx_element_dtype(to: int) -> np.dtype:
    """The numpy dtype of an ONNX element type code as the CUDA kernels know them: the CPU
    kernels' table (``onnx_dtype``, KernelError for types gradgen lacks) and BFLOAT16 (16), which
    the CPU backend reaches through float32 (gradgen/executor/low_precision.py)."""
    from gradgen.kernels.cpu.elementwise import onnx_dtype

    return BFLOAT16 if int(to) == ONNX_BFLOAT16 else onnx_dtype(to)


def require_suffix(dtype) -> str:
    """The kernels' dtype suffix; KernelError for a dtype they do not cover."""
    suffix = dtype_suffix(dtype)
    if suffix is None:
        raise KernelError(f"dtype {np.dtype(dtype)} is not supported by the CUDA kernels")
    return suffix


# ---------------------------------------------------------------------------------------------
# math mode


_MATH = threading.local()


def tf32_allowed() -> bool:
    """Whether float32 GEMMs and convolutions may use TF32 tensor cores: a Session running a model
    built with ``--precision tf32`` asks for it (``math_mode``), or GRADGEN_ALLOW_TF32=1 for all."""
    return getattr(_MATH, "tf32", False) or os.environ.get("GRADGEN_ALLOW_TF32", "") == "1"


@contextlib.contextmanager
def math_mode(tf32: bool):
    """TF32 allowed (or not) for the float32 GEMMs and convolutions launched in this thread inside
    the block (CUDA graphs recorded inside it keep that choice)."""
    previous = getattr(_MATH, "tf32", False)
    _MATH.tf32 = tf32
    try:
        yield
    finally:
        _MATH.tf32 = previous


# ---------------------------------------------------------------------------------------------
# grid sizing and launching


def grid_for(n: int, block: int = BLOCK, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of a grid-stride launch over ``n`` > 0 items."""
    return max(1, min(-(-int(n) // block), max_blocks))


def launch(kernel, n: int, *args, block: int = BLOCK, stream=None) -> None:
    """A grid-stride launch of ``kernel`` over ``n`` items (nothing for n <= 0), on ``stream`` (None:
    gradgen's stream)."""
    if n <= 0:
        return
    if stream is None:
        stream = runtime().stream()
    kernel(*args, block=(block, 1, 1), grid=(grid_for(n, block), 1), stream=stream)


def stream():
    """The stream gradgen's GPU work goes to (runtime.stream() where the runtime has one, else None: the
    default stream)."""
    get = getattr(runtime(), "stream", None)
    return get() if get is not None else None


def raw(kernel):
    """The PyCUDA function behind a runtime.function() result (which may wrap it)."""
    return getattr(kernel, "fn", kernel)


def launch_packed(kernel, grid: int, block: int, args: bytes, shared: int = 0) -> None:
    """Launch ``kernel`` with an argument buffer packed by the caller (struct, C layout: pointers first,
    then descriptors, then 8-byte scalars), on gradgen's stream: no per-argument handling in Python.
    ``grid`` > 0 blocks of ``block`` threads."""
    raw(kernel)._launch_kernel((int(grid), 1, 1), (int(block), 1, 1), args, int(shared), stream())


# ---------------------------------------------------------------------------------------------
# device arrays: addresses, strides, descriptors, contiguity, copies and fills


def ptr(x, offset_elements: int = 0) -> np.uintp:
    """The device address of ``x`` plus an element offset, as a kernel argument."""
    return np.uintp(int(x.gpudata) + int(offset_elements) * x.dtype.itemsize)


def element_strides(x) -> list[int]:
    """Element strides of a GPUArray (its .strides are in bytes)."""
    return [int(s) // x.dtype.itemsize for s in x.strides]


@functools.lru_cache(maxsize=4096)
def _desc_cached(shape: tuple, strides: tuple | None):
    return runtime().desc(list(shape), None if strides is None else list(strides))


def desc(shape, strides=None):
    """``runtime.desc``, cached by value (launches with the same shapes reuse the record; never mutated)."""
    return _desc_cached(tuple(int(d) for d in shape), None if strides is None else tuple(int(v) for v in strides))


def coalesce(shape, *stride_lists):
    """Drop size-1 axes and merge neighbours that are contiguous in every stride list: the simplified
    shape (empty when every axis has size 1) and each list's strides over it."""
    dims, lists = [], [[] for _ in stride_lists]
    for k, d in enumerate(shape):
        if d == 1:
            continue
        if dims and all(st[-1] == s[k] * d for st, s in zip(lists, stride_lists)):
            dims[-1] *= d
            for st, s in zip(lists, stride_lists):
                st[-1] = s[k]
            continue
        dims.append(int(d))
        for st, s in zip(lists, stride_lists):
            st.append(int(s[k]))
    return dims, lists


def extent(shape, strides) -> int:
    """The span in elements, first to last, of a view of ``shape`` with ``strides``."""
    return sum((d - 1) * abs(s) for d, s in zip(shape, strides))


def is_contiguous(x) -> bool:
    """C-contiguous, ignoring the strides of size-1 axes (which PyCUDA's flags do not)."""
    if x.flags.c_contiguous or x.size <= 1:
        return True
    strides = runtime().contiguous_strides(x.shape)
    return all(s == c for s, c, d in zip(element_strides(x), strides, x.shape) if d != 1)


def strided_copy(dst, dst_strides, dst_off, src, src_strides, src_off, shape) -> None:
    """dst[dst_off + c . dst_strides] = src[src_off + c . src_strides] for every coordinate c of shape."""
    rt = runtime()
    n = math.prod(int(d) for d in shape)
    if n == 0:
        return
    if dst.dtype.itemsize != src.dtype.itemsize:
        raise KernelError(f"cannot copy {src.dtype} into {dst.dtype}")
    shape, (ss, ds) = coalesce(shape, src_strides, dst_strides)
    if not shape:
        shape, ss, ds = [1], [0], [0]
    esize = src.dtype.itemsize
    src_addr, dst_addr = int(src.gpudata) + src_off * esize, int(dst.gpudata) + dst_off * esize
    width = esize
    for w in (16, 8, 4):
        r = w // esize
        if w <= esize or w % esize:
            continue
        if (
            ss[-1] == 1
            and ds[-1] == 1
            and shape[-1] % r == 0
            and src_addr % w == 0
            and dst_addr % w == 0
            and all(s % r == 0 for s in ss[:-1] + ds[:-1])
        ):
            shape = shape[:-1] + [shape[-1] // r]
            ss = [s // r for s in ss[:-1]] + [1]
            ds = [s // r for s in ds[:-1]] + [1]
            width = w
            break
    if len(shape) > rt.MAX_RANK:
        raise KernelError(f"copy of rank {len(shape)} exceeds the CUDA kernels' maximum of {rt.MAX_RANK}")
    n = math.prod(shape)
    small = n <= INT32_LIMIT and extent(shape, ss) <= INT32_LIMIT and extent(shape, ds) <= INT32_LIMIT
    kernel = kernel_of("shape", f"strided_copy_w{width}_{'i32' if small else 'i64'}")
    launch(
        kernel, n, np.uintp(dst_addr), np.uintp(src_addr), desc(shape, ss), desc(shape, ds), np.int64(0), np.int64(0), np.int64(n)
    )


def copy_into(dst, src, shape, src_strides, src_off=0) -> None:
    """Fill the contiguous ``dst`` (of ``shape``) from ``src`` read through element strides."""
    strided_copy(dst, runtime().contiguous_strides(shape), 0, src, src_strides, src_off, shape)


def on_device(x):
    """``x`` itself when it is a device array, else a device copy of it (a host array or scalar)."""
    rt = runtime()
    return x if rt.is_device(x) else rt.to_device(np.asarray(x))


def contiguous(x):
    """``x`` itself when it is C-contiguous (size-1 axes aside), else a C-contiguous device copy.

    The one meaning of "contiguous" for every launcher: it never refuses an input."""
    if is_contiguous(x):
        return x
    out = runtime().empty(x.shape, x.dtype)
    copy_into(out, x, x.shape, element_strides(x))
    return out


def broadcast_to(x, shape):
    """A C-contiguous copy of ``x`` broadcast (numpy rules) to ``shape``."""
    shape = tuple(int(d) for d in shape)
    lead = len(shape) - x.ndim
    if lead < 0 or any(d not in (1, t) for d, t in zip(x.shape, shape[lead:])):
        raise KernelError(f"shape {list(x.shape)} does not broadcast to {list(shape)}")
    strides = [0] * lead + [0 if d == 1 and t != 1 else s for d, t, s in zip(x.shape, shape[lead:], element_strides(x))]
    out = runtime().empty(shape, x.dtype)
    if out.size:
        copy_into(out, x, shape, strides)
    return out


def copy(x):
    """A device copy of ``x`` (C-contiguous)."""
    rt = runtime()
    out = rt.empty(x.shape, x.dtype)
    if out.size and is_contiguous(x):
        rt.copy_device(out, x)
    elif out.size:
        copy_into(out, x, x.shape, element_strides(x))
    return out


def same_type(*xs) -> None:
    """A KernelError unless every array has the same dtype."""
    dtypes = {np.dtype(x.dtype) for x in xs}
    if len(dtypes) > 1:
        raise KernelError(f"inputs have different dtypes ({', '.join(str(x.dtype) for x in xs)}); this op needs one type")


def fill_bits(value, dtype) -> np.int64:
    """``value`` cast to ``dtype``, its bytes as an int64 kernel argument (little-endian, zero-padded)."""
    raw = np.zeros(8, np.uint8)
    data = np.asarray(value).astype(dtype).reshape(-1)[:1].view(np.uint8)
    raw[: data.size] = data
    return raw.view(np.int64)[0]


def fill(out, value) -> None:
    """Every element of ``out`` set to ``value`` (cast to out's dtype)."""
    if out.size:
        esize = out.dtype.itemsize
        launch(kernel_of("shape", f"fill_w{esize}"), out.size, out, fill_bits(value, out.dtype), np.int64(out.size))


# ---------------------------------------------------------------------------------------------
# the CPU fallback


_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """``warnings.warn(message)`` the first time ``key`` is seen in this process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)


def cpu_fallback(op_type: str, *args, domain: str = "", **attrs):
    """Run the op's registered numpy kernel on host copies of ``args`` and upload its result(s),
    with one warning per op type: the configuration (dtype, attribute, rank) has no CUDA kernel.
    16-bit float inputs run as the CPU backend runs them (gradgen/executor/low_precision.py:
    computed in float32, each float result rounded to the narrowest 16-bit input type)."""
    from gradgen.executor import low_precision
    from gradgen.kernels import registry

    entry = registry.lookup(domain, op_type)
    if entry is None or entry.cpu is None:
        raise KernelError(f"{op_type} has no CPU kernel to fall back to")
    warn_once(f"{domain}::{op_type}", f"{op_type}: this configuration has no CUDA kernel; running the numpy kernel")
    kernel = entry.cpu
    if any(a is not None and low_precision.is_low_precision(getattr(a, "dtype", None)) for a in args):

        def kernel(*host, **kw):
            return low_precision.run_in_fp32(entry.cpu, op_type, list(host), kw, None)

    return runtime().run_on_host(kernel, *args, **attrs)


# ---------------------------------------------------------------------------------------------
# plan caches keyed by host values


def host_key(a):
    """A hashable key for a small host array (shape, axes, starts, ...), None for an omitted input."""
    if a is None:
        return None
    a = np.asarray(a)
    return a.dtype.char, a.shape, a.tobytes()


def plan_cache(cache: dict, key, make):
    """``cache[key]``, made by ``make()`` on a miss (a bounded dict: cleared when it grows too big)."""
    plan = cache.get(key)
    if plan is None:
        plan = make()
        if len(cache) > PLAN_CACHE_LIMIT:
            cache.clear()
        cache[key] = plan
    return plan
