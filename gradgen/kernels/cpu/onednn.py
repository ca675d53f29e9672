"""gradgen's binding of oneDNN's C API (over ctypes), shared by the kernels that run oneDNN primitives.

oneDNN comes from ``blas``: the library (and OpenMP pool) that runs the large float32 products, with
the same off switches (no oneDNN, no AVX2, ``GRADGEN_CPU_GEMM=numpy``, a forked process).
``loaded_api()`` gives the functions with their C signatures, an engine and an in-order stream, or
None where oneDNN is not used. ``Primitive`` and ``PlanCache`` hold a primitive made once per
geometry. Users: ``onednn_conv`` (grouped convolutions), ``onednn_eltwise`` (elementwise functions of
large arrays) and ``onednn_rows`` (Softmax and LayerNormalization over rows).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import threading
import weakref
from typing import Any, Callable

import numpy as np

from gradgen.kernels.cpu import blas

# oneDNN 3.x's C API (dnnl_types.h): the values gradgen uses
CPU_ENGINE, IN_ORDER_STREAM = 1, 1
F32, ANY_LAYOUT = 3, 1
FORWARD_INFERENCE = 96
CONVOLUTION_DIRECT, DECONVOLUTION_DIRECT = 1, 10
FORWARD_TRAINING = 64  # the hint a backward primitive is made from
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_BIAS = 1, 17, 33, 41
ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS = 129, 145, 161
QUERY_IMPL_INFO, QUERY_SRC, QUERY_WEIGHTS, QUERY_DST = 8, 129, 131, 133
QUERY_DIFF_SRC, QUERY_DIFF_WEIGHTS, QUERY_DIFF_DST = 130, 132, 134
MAX_DIMS = 12

Dims = ctypes.c_int64 * MAX_DIMS
Handle = ctypes.c_void_p


class ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", Handle)]


# entry points one user needs and the others do not: a library without them keeps the rest
_OPTIONAL = frozenset(
    {
        "dnnl_eltwise_forward_primitive_desc_create",
        "dnnl_softmax_forward_primitive_desc_create",
        "dnnl_layer_normalization_forward_primitive_desc_create",
        "dnnl_layer_normalization_backward_primitive_desc_create",
    }
)


class Api:
    """The oneDNN library's functions with their C signatures (``dnnl_x`` as attribute ``x``), an
    engine and an in-order stream."""

    def __init__(self, library: ctypes.CDLL) -> None:
        h, out, i = Handle, ctypes.POINTER(Handle), ctypes.c_int
        signatures: dict[str, tuple[list, Any]] = {
            "dnnl_engine_create": ([out, i, ctypes.c_size_t], i),
            "dnnl_stream_create": ([out, h, ctypes.c_uint], i),
            "dnnl_stream_wait": ([h], i),
            "dnnl_memory_desc_create_with_strides": ([out, i, Dims, i, Dims], i),
            "dnnl_memory_desc_create_with_tag": ([out, i, Dims, i, i], i),
            "dnnl_memory_desc_destroy": ([h], i),
            "dnnl_memory_desc_equal": ([h, h], i),
            "dnnl_memory_desc_get_size": ([h], ctypes.c_size_t),
            "dnnl_convolution_forward_primitive_desc_create": ([out, h, i, i, h, h, h, h, Dims, Dims, Dims, Dims, h], i),
            "dnnl_deconvolution_forward_primitive_desc_create": ([out, h, i, i, h, h, h, h, Dims, Dims, Dims, Dims, h], i),
            "dnnl_convolution_backward_data_primitive_desc_create": ([out, h, i, h, h, h, Dims, Dims, Dims, Dims, h, h], i),
            "dnnl_convolution_backward_weights_primitive_desc_create": (
                [out, h, i, h, h, h, h, Dims, Dims, Dims, Dims, h, h],
                i,
            ),
            "dnnl_reorder_primitive_desc_create": ([out, h, h, h, h, h], i),
            "dnnl_eltwise_forward_primitive_desc_create": ([out, h, i, i, h, h, ctypes.c_float, ctypes.c_float, h], i),
            "dnnl_softmax_forward_primitive_desc_create": ([out, h, i, i, h, h, i, h], i),
            "dnnl_layer_normalization_forward_primitive_desc_create": (
                [out, h, i, h, h, h, ctypes.c_float, ctypes.c_uint, h],
                i,
            ),
            "dnnl_layer_normalization_backward_primitive_desc_create": (
                [out, h, i, h, h, h, h, ctypes.c_float, ctypes.c_uint, h, h],
                i,
            ),
            "dnnl_primitive_desc_query": ([h, i, i, h], i),
            "dnnl_primitive_desc_query_md": ([h, i, i], h),
            "dnnl_primitive_desc_destroy": ([h], i),
            "dnnl_primitive_create": ([out, h], i),
            "dnnl_primitive_destroy": ([h], i),
            "dnnl_primitive_execute": ([h, h, i, ctypes.POINTER(ExecArg)], i),
            "dnnl_memory_create": ([out, h, h, h], i),
            "dnnl_memory_set_data_handle": ([h, h], i),
            "dnnl_memory_destroy": ([h], i),
        }
        for name, (argtypes, restype) in signatures.items():
            function = getattr(library, name, None)
            if function is None and name in _OPTIONAL:
                setattr(self, name.removeprefix("dnnl_"), None)  # its users check for None
                continue
            if function is None:
                raise AttributeError(name)
            function.argtypes, function.restype = argtypes, restype
            setattr(self, name.removeprefix("dnnl_"), function)
        self.engine, self.stream = Handle(), Handle()
        check(self.engine_create(ctypes.byref(self.engine), CPU_ENGINE, 0))
        check(self.stream_create(ctypes.byref(self.stream), self.engine, IN_ORDER_STREAM))

    def __getattr__(self, name: str) -> Any:  # the functions set above (for type checkers)
        raise AttributeError(name)


class Refused(Exception):
    """oneDNN answered a call with a status other than success."""


def check(status: int) -> None:
    if status != 0:
        raise Refused(status)


_api: Any = None  # the Api once made, False where oneDNN cannot be used
_api_lock = threading.Lock()


def loaded_api():
    """The Api, or None where oneDNN is not used in this process (see ``blas.loaded``)."""
    global _api
    if not blas.loaded():  # also False in a forked child, whatever was made before the fork
        return None
    if _api is None:
        with _api_lock:
            if _api is None:
                try:
                    _api = Api(blas.library())
                except (AttributeError, Refused):  # an older library without these entry points
                    _api = False
    return _api or None


def implementation(api: Api, primitive_desc: Handle) -> str:
    """The implementation oneDNN chose for a primitive descriptor ("jit:avx2", "ref:any", ...)."""
    info = ctypes.c_char_p()
    check(api.primitive_desc_query(primitive_desc, QUERY_IMPL_INFO, 0, ctypes.byref(info)))
    return (info.value or b"").decode()


def strided_desc(api: Api, shape: tuple, strides: tuple | str | None = None) -> Handle:
    """A float32 memory descriptor of ``shape`` with element ``strides`` (row-major by default), or
    oneDNN's "any" layout when ``strides`` is the string "any"."""
    desc = Handle()
    if isinstance(strides, str):
        check(api.memory_desc_create_with_tag(ctypes.byref(desc), len(shape), Dims(*shape), F32, ANY_LAYOUT))
    else:
        steps = strides if strides is not None else row_major(shape)
        check(api.memory_desc_create_with_strides(ctypes.byref(desc), len(shape), Dims(*shape), F32, Dims(*steps)))
    return desc


def row_major(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def destroy(api: Api, owned: list) -> None:
    for function, handle in reversed(owned):
        getattr(api, function)(handle)


# below this many elements a primitive runs on the calling thread alone (``blas.caller_thread_only``)
POOL_FROM_ELEMENTS = 1 << 18


class Primitive:
    """One oneDNN primitive with a memory object per argument: ``primitive(*arrays)`` points each
    argument at its array's data (C-ordered float32, in ``arguments``' order) and executes it.

    ``describe(owned)`` makes the primitive descriptor and returns it with the (argument id, memory
    descriptor) pairs; every handle it makes goes to ``owned`` (destroyed with the Primitive, or at
    once if making it fails). oneDNN's reference implementations are refused (``Refused``): numpy is
    as fast. Calls are serialised (the memory objects are shared); a call whose first array has fewer
    than ``POOL_FROM_ELEMENTS`` elements runs on the caller's thread."""

    def __init__(self, api: Api, describe: Callable[[list], tuple[Handle, list[tuple[int, Handle]]]]) -> None:
        owned: list = []
        try:
            primitive_desc, arguments = describe(owned)
            self.implementation = implementation(api, primitive_desc)
            if self.implementation.startswith("ref"):
                raise Refused(self.implementation)
            self._primitive = Handle()
            check(api.primitive_create(ctypes.byref(self._primitive), primitive_desc))
            owned.append(("primitive_destroy", self._primitive))
            self._memories = []
            for _, desc in arguments:
                memory = Handle()
                check(api.memory_create(ctypes.byref(memory), desc, api.engine, None))
                owned.append(("memory_destroy", memory))
                self._memories.append(memory)
        except BaseException:
            destroy(api, owned)
            raise
        self._args = (ExecArg * len(arguments))(*(ExecArg(arg, m) for (arg, _), m in zip(arguments, self._memories)))
        self._api, self._lock = api, threading.Lock()
        weakref.finalize(self, destroy, api, owned)

    def __call__(self, *arrays: np.ndarray) -> None:
        api = self._api
        alone = blas.caller_thread_only() if arrays[0].size < POOL_FROM_ELEMENTS else contextlib.nullcontext()
        with self._lock, alone:
            for memory, array in zip(self._memories, arrays):
                api.memory_set_data_handle(memory, array.ctypes.data)
            check(api.primitive_execute(self._primitive, api.stream, len(self._memories), self._args))
            check(api.stream_wait(api.stream))


class PlanCache:
    """Plans made once per key by ``make`` (None where oneDNN refused one), the ``kept`` used last
    kept; safe from several threads."""

    def __init__(self, kept: int = 64) -> None:
        self.kept = kept
        self._plans: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], Any]):
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
            try:
                plan = make()
            except Refused:
                plan = None
            self._plans[key] = plan
            if len(self._plans) > self.kept:
                self._plans.popitem(last=False)
            return plan

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
