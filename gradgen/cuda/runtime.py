"""The CUDA runtime gradgen's GPU kernels share: context, memory pool, compiled modules.

Everything here imports PyCUDA, so only the CUDA path imports this module. The context is the
device's primary context (``pycuda.autoprimaryctx``), so cuBLAS (nvmath-python) and cuDNN
(nvidia-cudnn-frontend) work in the same context. All work goes to one gradgen stream, which the
libraries use too, so no cross-stream synchronisation is needed.

Memory: every device array comes from ``empty`` (directly, or through ``to_device`` and PyCUDA's
array methods, which reuse the array's allocator). While the executor runs a plan it installs an
allocation hook (``ALLOCATION.hook``) that serves these requests from its planned arena (see
gradgen/executor/device_memory.py); otherwise, and for allocations made under ``persistent()``
(caches that outlive a run), they come from PyCUDA's memory pool. ``gpu_lock()`` serialises
gradgen's GPU work across threads: it all goes to one stream, and a CUDA-graph capture in progress
must not see another thread's work.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import sys
import threading
import traceback
import weakref
from typing import TypeAlias

import ml_dtypes
import numpy as np
import pycuda.autoprimaryctx  # noqa: F401  (makes the primary context current)
import pycuda.driver as driver
import pycuda.gpuarray as gpuarray
import pycuda.tools

from gradgen.cuda import kernel_cache, prebuilt
from gradgen.cuda.compile import CUDA_SOURCES, source_names  # noqa: F401  (CUDA_SOURCES: where the .cu files are)
from gradgen.errors import KernelError

GPUArray: TypeAlias = gpuarray.GPUArray
MAX_RANK = 8
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


# -- exit: device memory goes before PyCUDA pops its context ------------------------------------
# pycuda.autoprimaryctx pops the context in an atexit handler registered when it was imported
# (above), so handlers registered after it, like this one, run first. Device memory freed later,
# during interpreter teardown, finds no context and aborts the process ("terminate called after
# throwing an instance of 'pycuda::error'"): a script holding a CUDA Session in a global did.
_CLOSE_AT_EXIT: "weakref.WeakSet" = weakref.WeakSet()
_DROP_AT_EXIT: list = []


def close_at_exit(owner) -> None:
    """Call ``owner.close()`` at exit, while the context is still current (weakly held)."""
    _CLOSE_AT_EXIT.add(owner)


def drop_at_exit(drop) -> None:
    """Call ``drop()`` at exit: it releases a module's cached device arrays (a workspace, a flag)."""
    _DROP_AT_EXIT.append(drop)


def _release_device_memory() -> None:
    for owner in list(_CLOSE_AT_EXIT):
        with contextlib.suppress(Exception):
            owner.close()
    for drop in _DROP_AT_EXIT:
        with contextlib.suppress(Exception):
            drop()
    gc.collect()
    with contextlib.suppress(Exception):
        synchronize()
        memory_pool().free_held()


atexit.register(_release_device_memory)


@functools.lru_cache(maxsize=1)
def memory_pool() -> pycuda.tools.DeviceMemoryPool:
    return pycuda.tools.DeviceMemoryPool()


@functools.lru_cache(maxsize=1)
def stream() -> driver.Stream:
    """The one stream all of gradgen's GPU work goes to (kernels, cuBLAS, cuDNN, async copies).

    A blocking stream: synchronous copies on the legacy default stream still order with it, and
    unlike the legacy stream it can be captured into a CUDA graph.
    """
    return driver.Stream()


class CaptureError(RuntimeError):
    """An operation that cannot be recorded in a CUDA graph ran while capturing."""


class _Capture:
    """State of a CUDA-graph capture in progress: allocations to keep, flag checks to defer."""

    def __init__(self):
        self.active = False
        self.keep: list = []
        self.deferred: list = []


CAPTURE = _Capture()


class _Allocation:
    """Where ``empty`` gets its memory: the hook a running plan installed (in its own thread), else
    the pool. ``persistent`` counts the open ``persistent()`` blocks, which bypass the hook."""

    def __init__(self):
        self.hook = None
        self.thread = None
        self.persistent = 0


ALLOCATION = _Allocation()
_LOCK = threading.RLock()


def _allocate(nbytes: int):
    hook = ALLOCATION.hook
    if hook is not None and not ALLOCATION.persistent and ALLOCATION.thread == threading.get_ident():
        return hook(nbytes)
    return pool_allocate(nbytes)


def pool_allocate(nbytes: int):
    """Memory from PyCUDA's pool (kept alive by the CUDA graph being captured, if any)."""
    allocation = memory_pool().allocate(nbytes)
    if CAPTURE.active:
        CAPTURE.keep.append(allocation)  # the graph refers to it: it must outlive the capture
    return allocation


@contextlib.contextmanager
def allocation_hook(hook):
    """Serve this thread's ``empty`` calls with ``hook(nbytes)`` (an int-like device address) inside
    the block: the executor's planned memory during a run."""
    previous = (ALLOCATION.hook, ALLOCATION.thread)
    ALLOCATION.hook, ALLOCATION.thread = hook, threading.get_ident()
    try:
        yield
    finally:
        ALLOCATION.hook, ALLOCATION.thread = previous


@contextlib.contextmanager
def persistent():
    """Allocations inside the block outlive the run that makes them (caches of uploaded constants,
    flags reused by every op): they come from the pool, never from a run's planned arena."""
    ALLOCATION.persistent += 1
    try:
        yield
    finally:
        ALLOCATION.persistent -= 1


@contextlib.contextmanager
def gpu_lock():
    """Hold gradgen's process-wide GPU lock (re-entrant) with the primary context current in this
    thread. Sessions take it around construction, runs and close: their runs take turns."""
    with _LOCK:
        pushed = False
        if driver.Context.get_current() is None:
            pycuda.autoprimaryctx.context.push()
            pushed = True
        try:
            yield
        finally:
            if pushed:
                driver.Context.pop()


def empty(shape, dtype) -> GPUArray:
    """An uninitialised device array from the pool."""
    return GPUArray(tuple(int(d) for d in shape), np.dtype(dtype), allocator=_allocate)


def memset_zero(array: GPUArray) -> GPUArray:
    """Zero ``array`` on gradgen's stream (asynchronously)."""
    if array.nbytes:
        driver.memset_d8_async(array.gpudata, 0, array.nbytes, stream())
    return array


def copy_device(dst: GPUArray, src: GPUArray, nbytes: int | None = None) -> None:
    """Device-to-device copy on gradgen's stream (asynchronously)."""
    nbytes = src.nbytes if nbytes is None else nbytes
    if nbytes:
        driver.memcpy_dtod_async(dst.gpudata, src.gpudata, nbytes, stream())


def zeros(shape, dtype) -> GPUArray:
    return memset_zero(empty(shape, dtype))


def host_buffer(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous, as the buffer a host-to-device copy reads: a bfloat16 array as its
    uint16 bits (ml_dtypes' type is not one the buffer protocol or PyCUDA knows by format)."""
    array = np.ascontiguousarray(array)
    return array.view(np.uint16) if array.dtype == BFLOAT16 else array


def to_device(array: np.ndarray) -> GPUArray:
    if CAPTURE.active:
        raise CaptureError("a host-to-device upload cannot be captured")
    array = np.ascontiguousarray(array).reshape(np.shape(array))  # ascontiguousarray makes 0-d 1-d
    out = empty(array.shape, array.dtype)
    if array.size:
        driver.memcpy_htod(out.gpudata, host_buffer(array))
    return out


def to_host(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    if CAPTURE.active:
        raise CaptureError("a device-to-host copy cannot be captured")
    if array.dtype == BFLOAT16:  # its bits as uint16 (see host_buffer), then the type again
        if not array.size:
            return np.empty(array.shape, BFLOAT16)  # no device memory to view (pycuda refuses)
        bits = GPUArray(array.shape, np.uint16, gpudata=array.gpudata, strides=array.strides, base=array)
        return bits.get().view(BFLOAT16)
    return array.get()


def is_device(value) -> bool:
    return isinstance(value, gpuarray.GPUArray)


def run_on_host(fn, *args, **kwargs):
    """Run a numpy kernel on host copies of the device arrays in ``args``; upload its result(s)."""
    result = fn(*[to_host(a) if is_device(a) else a for a in args], **kwargs)
    if isinstance(result, tuple):
        return tuple(to_device(np.asarray(r)) for r in result)
    return to_device(np.asarray(result))


def _arch() -> str:
    major, minor = driver.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


_BUILDS: dict = {}  # source name -> its build (kernel groups and cubins), or the KernelError it raised
_BUILDS_LOCK = threading.Lock()


def _build(name: str) -> list:
    """The build of ``name.cu`` for this GPU. The first request fetches every source's at once,
    from the persistent cache or compiled in parallel (see gradgen/cuda/kernel_cache.py), so a cold
    start pays for all compiles together rather than one source at a time as each is first used."""
    with _BUILDS_LOCK:
        if name not in _BUILDS:
            wanted = [n for n in source_names() if n not in _BUILDS]
            _BUILDS.update(kernel_cache.builds(_arch(), wanted if name in wanted else [*wanted, name]))
        result = _BUILDS[name]
    if isinstance(result, Exception):
        raise result
    return result


class Module:
    """The kernels of one .cu source: its cubins (one per kernel group, see kernel_cache.py), all
    loaded into the context at once, as one module would be: loading later, at a group's first
    kernel, could fall inside a CUDA-graph capture, where loading a module is not allowed.
    ``get_function`` as on a PyCUDA module."""

    def __init__(self, name: str, build: list):
        self.name = name
        try:
            self._modules = [driver.module_from_buffer(cubin) for _, cubin in build]
        except driver.Error as exc:
            raise KernelError(f"CUDA module {name}.cu ({_arch()}) does not load: {exc}") from exc
        self._where = {kernel: i for i, (kernels, _) in enumerate(build) if kernels is not None for kernel in kernels}
        self._unlisted = [i for i, (kernels, _) in enumerate(build) if kernels is None]  # e.g. one whole cubin

    def get_function(self, entry: str):
        if entry not in self._where:
            self._where[entry] = self._search(entry)
        return self._modules[self._where[entry]].get_function(entry)

    def _search(self, entry: str) -> int:
        """The cubin holding ``entry`` among those whose kernels the build does not list."""
        for index in self._unlisted:
            try:
                self._modules[index].get_function(entry)
            except driver.Error:
                continue
            return index
        raise KernelError(f"no kernel {entry} in {self.name}.cu")


@functools.lru_cache(maxsize=None)
def module(name: str) -> Module:
    """The kernels of ``gradgen/kernels/cuda/<name>.cu``: shipped with the package for this GPU
    (gradgen/cuda/prebuilt.py), else compiled without nvcc by NVRTC where it is installed (see
    gradgen/cuda/compile.py), once per process."""
    build = _build(name)
    try:
        return Module(name, build)
    except KernelError as exc:
        if not isinstance(build, prebuilt.Prebuilt):
            raise
        return Module(name, _rebuild_without_prebuilt(name, exc))


def _rebuild_without_prebuilt(name: str, failure: KernelError) -> list:
    """The build of ``name.cu`` when its prebuilt cubins did not load (a driver older than the
    compiler that wrote them): no prebuilt build is used from now on, and every one fetched so far
    is replaced at once, from the cache or compiled."""
    with _BUILDS_LOCK:
        if prebuilt.location() is not None:
            print(f"gradgen: the prebuilt kernels of {name}.cu do not load ({failure}); compiling instead", file=sys.stderr)
            prebuilt.disable(str(failure))
        stale = [n for n, build in _BUILDS.items() if isinstance(build, prebuilt.Prebuilt)]
        if stale:
            _BUILDS.update(kernel_cache.builds(_arch(), stale, prebuilt_ok=False))
        result = _BUILDS[name]
    if isinstance(result, Exception):
        raise result from failure
    return result


class _Kernel:
    """A compiled kernel whose calls go to gradgen's stream unless given another."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        if kwargs.get("stream") is None:
            kwargs["stream"] = stream()
        return self.fn(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fn, name)


@functools.lru_cache(maxsize=None)
def function(name: str, entry: str) -> _Kernel:
    """The kernel ``entry`` of module ``name`` (``extern "C"``, dtype suffix included in ``entry``)."""
    return _Kernel(module(name).get_function(entry))


# -- tensor descriptors ---------------------------------------------------------------------
# A TensorDesc (see common.h) is passed by value: rank, then shape and strides (in elements)
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
    return record[()]  # type: ignore[return-value]  # a 0-d record array's [()] is its np.void scalar


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


def check_flag(flag: GPUArray, on_error) -> None:
    """Read an error flag a kernel wrote (0: fine). Otherwise ``on_error(value)`` either raises
    (e.g. a KernelError naming the bad index) or returns a message, raised as KernelError.

    While a CUDA graph is being captured the check is deferred: it runs after each replay, on a
    copy of the flag the graph makes in memory of its own (the flag itself may be planned memory
    that later steps of the run reuse).
    """
    if CAPTURE.active:
        with persistent():
            copy = empty((1,), flag.dtype)
        CAPTURE.keep.append(copy)
        copy_device(copy, flag, flag.dtype.itemsize)
        CAPTURE.deferred.append((copy, on_error))
        return
    _raise_if_set(flag, on_error)


def _raise_if_set(flag: GPUArray, on_error) -> None:
    value = int(flag.get().reshape(-1)[0])
    if value:
        message = on_error(value)
        raise KernelError(message)


def synchronize() -> None:
    driver.Context.synchronize()


class CapturedGraph:
    """A CUDA graph recorded from one run; replaying it repeats that run's GPU work.

    ``keep`` holds every device allocation the recorded work touches; ``deferred`` the flag checks
    to repeat after each replay.
    """

    def __init__(self, graph, exec_handle, keep: list, deferred: list):
        self.graph = graph
        self.exec_handle = exec_handle
        self.keep = keep
        self.deferred = deferred

    def replay(self) -> None:
        from cuda.bindings import driver as cu

        _check_cu(cu.cuGraphLaunch(self.exec_handle, stream().handle), "cuGraphLaunch")
        for flag, on_error in self.deferred:
            _raise_if_set(flag, on_error)

    def close(self) -> None:
        """Destroy the graph (after the work queued so far) and let go of its memory. While another
        graph is being captured (a collection can run at any point), the destruction waits for the
        capture to end."""
        exec_handle, graph = self.exec_handle, self.graph
        self.exec_handle = self.graph = None
        self.keep, self.deferred = [], []
        if exec_handle is None:
            return
        _DOOMED.append((exec_handle, graph))
        if not CAPTURE.active:
            _destroy_doomed()

    def __del__(self):
        self.close()


_DOOMED: list = []  # (exec handle, graph) of closed graphs, destroyed outside captures


def _destroy_doomed() -> None:
    try:
        from cuda.bindings import driver as cu

        with gpu_lock():
            if CAPTURE.active or not _DOOMED:
                return
            stream().synchronize()
            while _DOOMED:
                exec_handle, graph = _DOOMED.pop()
                cu.cuGraphExecDestroy(exec_handle)
                cu.cuGraphDestroy(graph)
    except Exception:  # noqa: BLE001 - at interpreter exit the context may already be gone
        pass


def capture(run) -> CapturedGraph:
    """Record the GPU work ``run()`` queues on gradgen's stream into a CUDA graph.

    Raises CaptureError when ``run`` does something a graph cannot hold (a device-to-host copy,
    work on the legacy default stream, ...); the caller then keeps running eagerly.
    """
    from cuda.bindings import driver as cu

    synchronize()
    handle = stream().handle
    _check_cu(cu.cuStreamBeginCapture(handle, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED), "cuStreamBeginCapture")
    CAPTURE.active, CAPTURE.keep, CAPTURE.deferred = True, [], []
    failure = None
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - any failure ends the capture; reported below
        failure = exc
    finally:
        CAPTURE.active = False
        keep, deferred = CAPTURE.keep, CAPTURE.deferred
        CAPTURE.keep, CAPTURE.deferred = [], []
        err, graph = cu.cuStreamEndCapture(handle)
    if _DOOMED:
        _destroy_doomed()
    if failure is not None:  # whatever it was, the eager run that follows reports real errors
        if err == cu.CUresult.CUDA_SUCCESS and graph is not None:
            cu.cuGraphDestroy(graph)
        traceback.clear_frames(failure.__traceback__)  # let go of the failed run's arrays now
        raise CaptureError(f"{type(failure).__name__}: {failure}") from failure
    _check_cu(err, "cuStreamEndCapture")
    err, exec_handle = cu.cuGraphInstantiate(graph, 0)
    if err != cu.CUresult.CUDA_SUCCESS:
        cu.cuGraphDestroy(graph)
    _check_cu(err, "cuGraphInstantiate")
    return CapturedGraph(graph, exec_handle, keep, deferred)


def _check_cu(result, what: str) -> None:
    from cuda.bindings import driver as cu

    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CaptureError(f"{what} failed: {err}")
