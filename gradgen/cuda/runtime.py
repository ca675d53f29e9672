"""The CUDA runtime gradgen's GPU kernels share: context, memory pool, compiled modules.

Everything here imports PyCUDA, so only the CUDA path imports this module. The context is the
device's primary context (``pycuda.autoprimaryctx``), so cuBLAS (nvmath-python) and cuDNN
(nvidia-cudnn-frontend) work in the same context. All work goes to the default stream, which the
libraries use too, so no cross-stream synchronisation is needed.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import numpy as np

import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as driver
import pycuda.gpuarray as gpuarray
import pycuda.tools
from pycuda.compiler import SourceModule

from gradgen.errors import KernelError

GPUArray = gpuarray.GPUArray
CUDA_SOURCES = Path(__file__).resolve().parent.parent / "kernels" / "cuda"
MAX_RANK = 8

# The C type name each supported numpy dtype has in the .cu sources (entry points end in it).
CTYPE = {
    np.dtype(np.float16): "f16", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64",
    np.dtype(np.int32): "i32", np.dtype(np.int64): "i64", np.dtype(np.bool_): "b8",
    np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8",
}


@functools.lru_cache(maxsize=1)
def memory_pool() -> pycuda.tools.DeviceMemoryPool:
    return pycuda.tools.DeviceMemoryPool()


def empty(shape, dtype) -> GPUArray:
    """An uninitialised device array from the pool."""
    return GPUArray(tuple(int(d) for d in shape), np.dtype(dtype), allocator=memory_pool().allocate)


def zeros(shape, dtype) -> GPUArray:
    out = empty(shape, dtype)
    if out.size:
        driver.memset_d8(out.gpudata, 0, out.nbytes)
    return out


def to_device(array: np.ndarray) -> GPUArray:
    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes 0-d 1-d
    out = empty(array.shape, array.dtype)
    if array.size:
        driver.memcpy_htod(out.gpudata, array)
    return out


def to_host(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    return array.get()


def is_device(value) -> bool:
    return isinstance(value, GPUArray)


def _arch() -> str:
    major, minor = driver.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


@functools.lru_cache(maxsize=None)
def module(name: str) -> SourceModule:
    """Compile ``gradgen/kernels/cuda/<name>.cu`` once per process (PyCUDA caches on disk too)."""
    source = (CUDA_SOURCES / f"{name}.cu").read_text()
    cache_dir = os.environ.get("GRADGEN_CUDA_CACHE") or None
    return SourceModule(source, no_extern_c=True, arch=_arch(), include_dirs=[str(CUDA_SOURCES)],
                        options=["-std=c++17", "-O3", "--extended-lambda"], cache_dir=cache_dir)


@functools.lru_cache(maxsize=None)
def function(name: str, entry: str):
    """The kernel ``entry`` of module ``name`` (``extern "C"``, dtype suffix included in ``entry``)."""
    return module(name).get_function(entry)


def suffix(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype not in CTYPE:
        raise KernelError(f"dtype {dtype} is not supported by the CUDA kernels")
    return CTYPE[dtype]


def launch(kernel, n: int, *args, block: int = 256, max_blocks: int = 65535 * 8) -> None:
    """Launch a grid-stride kernel over ``n`` items (no launch for n == 0)."""
    if n <= 0:
        return
    blocks = max(1, min(math.ceil(n / block), max_blocks))
    kernel(*args, block=(block, 1, 1), grid=(blocks, 1))


# -- tensor descriptors ---------------------------------------------------------------------
# A TensorDesc (see common.cuh) is passed by value: rank, then shape and strides (in elements)
# padded to MAX_RANK. All int64, so it packs without padding after any 8-byte argument.
DESC_DTYPE = np.dtype([("rank", np.int64), ("shape", np.int64, MAX_RANK), ("strides", np.int64, MAX_RANK)])


def desc(shape, strides=None) -> np.void:
    """A TensorDesc for a tensor of ``shape`` with element ``strides`` (C-contiguous by default)."""
    shape = [int(d) for d in shape]
    if len(shape) > MAX_RANK:
        raise KernelError(f"rank {len(shape)} exceeds the CUDA kernels' maximum of {MAX_RANK}")
    if strides is None:
        strides = contiguous_strides(shape)
    record = np.zeros((), dtype=DESC_DTYPE)
    record["rank"] = len(shape)
    record["shape"][: len(shape)] = shape
    record["strides"][: len(shape)] = [int(s) for s in strides]
    return record[()]


def contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for d in reversed(list(shape)):
        strides.append(step)
        step *= max(int(d), 1)
    return strides[::-1]


def broadcast_strides(shape, out_shape) -> list[int]:
    """Element strides that read a C-contiguous ``shape`` broadcast to ``out_shape`` (0 on broadcast axes)."""
    shape = [int(d) for d in shape]
    lead = len(out_shape) - len(shape)
    inner = contiguous_strides(shape)
    strides = [0] * lead
    for d, s in zip(shape, inner):
        strides.append(0 if d == 1 else s)
    return strides


def check_flag(flag: GPUArray, message) -> None:
    """Read an error flag a kernel wrote (0: fine); raise KernelError with ``message(value)`` otherwise."""
    value = int(flag.get()[0])
    if value:
        raise KernelError(message(value))


def synchronize() -> None:
    driver.Context.synchronize()
