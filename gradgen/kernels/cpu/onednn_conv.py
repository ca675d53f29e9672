"""Grouped float32 convolutions (Conv, ConvTranspose) through oneDNN's convolution primitives.

gradgen's CPU convolution gathers columns and multiplies them (conv.py). A grouped convolution
(MobileNet's and EfficientNet's depthwise layers, and their data gradients, a grouped
ConvTranspose) is then one small product per group, and costs what the gathering costs: on the
2-core AVX2 machine of docs/BENCHMARKS.md, a depthwise 3 x 3 Conv on (2, 96, 16, 16) took 0.48 ms,
against 0.08 ms for oneDNN's depthwise kernel with its reorders. Dense convolutions stay on the
GEMM path: with the reorders to and from oneDNN's blocked layouts they were not reliably faster.

A plan per geometry holds the primitive (layouts of oneDNN's choice), the reorders from and to
numpy's strided arrays, and a lock: one run of a plan at a time (its memory objects are shared).
Blocked buffers are allocated per call, so a plan keeps no tensor memory. oneDNN comes from
``blas`` (the same library and OpenMP pool as the large products, and the same off switches:
no oneDNN, no AVX2, ``GRADGEN_CPU_GEMM=numpy``, a forked process). A geometry that oneDNN would
run with its reference code or its own im2col GEMM, or refuses, keeps gradgen's path
(``plan_conv`` and ``plan_conv_transpose`` return None).

The results are oneDNN's sums, in its order: equal to gradgen's path within float32 rounding, and
the same from run to run at a given thread count (the prepared Conv uses them from the first run).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any

import numpy as np

from gradgen.kernels.cpu import blas
from gradgen.kernels.cpu.prepared import OwnSums

# oneDNN 3.x's C API (dnnl_types.h): the values gradgen uses
_CPU_ENGINE, _IN_ORDER_STREAM = 1, 1
_F32, _ANY_LAYOUT = 3, 1
_FORWARD_INFERENCE = 96
_CONVOLUTION_DIRECT, _DECONVOLUTION_DIRECT = 1, 10
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_QUERY_IMPL_INFO, _QUERY_SRC, _QUERY_WEIGHTS, _QUERY_DST = 8, 129, 131, 133
_MAX_DIMS = 12
_REFUSED_IMPLEMENTATIONS = ("ref", "gemm")  # slower than (or the same as) gradgen's own path

_Dims = ctypes.c_int64 * _MAX_DIMS
_Handle = ctypes.c_void_p


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _Handle)]


class _Api:
    """The oneDNN library's functions with their C signatures (``dnnl_x`` as attribute ``x``), an
    engine and an in-order stream."""

    def __init__(self, library: ctypes.CDLL) -> None:
        h, out, i = _Handle, ctypes.POINTER(_Handle), ctypes.c_int
        signatures: dict[str, tuple[list, Any]] = {
            "dnnl_engine_create": ([out, i, ctypes.c_size_t], i),
            "dnnl_stream_create": ([out, h, ctypes.c_uint], i),
            "dnnl_stream_wait": ([h], i),
            "dnnl_memory_desc_create_with_strides": ([out, i, _Dims, i, _Dims], i),
            "dnnl_memory_desc_create_with_tag": ([out, i, _Dims, i, i], i),
            "dnnl_memory_desc_destroy": ([h], i),
            "dnnl_memory_desc_equal": ([h, h], i),
            "dnnl_memory_desc_get_size": ([h], ctypes.c_size_t),
            "dnnl_convolution_forward_primitive_desc_create": ([out, h, i, i, h, h, h, h, _Dims, _Dims, _Dims, _Dims, h], i),
            "dnnl_deconvolution_forward_primitive_desc_create": ([out, h, i, i, h, h, h, h, _Dims, _Dims, _Dims, _Dims, h], i),
            "dnnl_reorder_primitive_desc_create": ([out, h, h, h, h, h], i),
            "dnnl_primitive_desc_query": ([h, i, i, h], i),
            "dnnl_primitive_desc_query_md": ([h, i, i], h),
            "dnnl_primitive_desc_destroy": ([h], i),
            "dnnl_primitive_create": ([out, h], i),
            "dnnl_primitive_destroy": ([h], i),
            "dnnl_primitive_execute": ([h, h, i, ctypes.POINTER(_ExecArg)], i),
            "dnnl_memory_create": ([out, h, h, h], i),
            "dnnl_memory_set_data_handle": ([h, h], i),
            "dnnl_memory_destroy": ([h], i),
        }
        for name, (argtypes, restype) in signatures.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, restype
            setattr(self, name.removeprefix("dnnl_"), function)
        self.engine, self.stream = _Handle(), _Handle()
        _check(self.engine_create(ctypes.byref(self.engine), _CPU_ENGINE, 0))
        _check(self.stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER_STREAM))

    def __getattr__(self, name: str) -> Any:  # the functions set above (for type checkers)
        raise AttributeError(name)


class _Refused(Exception):
    """oneDNN answered a call with a status other than success."""


def _check(status: int) -> None:
    if status != 0:
        raise _Refused(status)


_api: Any = None  # the _Api once made, False where oneDNN cannot be used
_api_lock = threading.Lock()


def _loaded_api():
    """The _Api, or None where oneDNN is not used in this process (see ``blas.loaded``)."""
    global _api
    if not blas.loaded():  # also False in a forked child, whatever was made before the fork
        return None
    if _api is None:
        with _api_lock:
            if _api is None:
                try:
                    _api = _Api(blas.library())
                except (AttributeError, _Refused):  # an older library without these entry points
                    _api = False
    return _api or None


def _strided_desc(api: _Api, shape: tuple, strides: tuple | str | None = None) -> _Handle:
    """A float32 memory descriptor of ``shape`` with element ``strides`` (row-major by default), or
    oneDNN's "any" layout when ``strides`` is the string "any"."""
    desc = _Handle()
    if isinstance(strides, str):
        _check(api.memory_desc_create_with_tag(ctypes.byref(desc), len(shape), _Dims(*shape), _F32, _ANY_LAYOUT))
    else:
        steps = strides if strides is not None else _row_major(shape)
        _check(api.memory_desc_create_with_strides(ctypes.byref(desc), len(shape), _Dims(*shape), _F32, _Dims(*steps)))
    return desc


def _row_major(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


class _Operand:
    """One argument of the primitive: its plain (numpy) layout, the layout the primitive chose, and
    the reorder between them (None where they are the same)."""

    def __init__(self, api: _Api, arg: int, plain: _Handle, chosen: int, into_chosen: bool, owned: list) -> None:
        self.arg, self.plain_memory = arg, _Handle()
        _check(api.memory_create(ctypes.byref(self.plain_memory), plain, api.engine, None))
        owned.append(("memory_destroy", self.plain_memory))
        self.reorder = self.chosen_memory = None
        self.chosen_bytes = 0
        if api.memory_desc_equal(plain, chosen):
            return
        self.chosen_memory = _Handle()
        _check(api.memory_create(ctypes.byref(self.chosen_memory), chosen, api.engine, None))
        owned.append(("memory_destroy", self.chosen_memory))
        self.chosen_bytes = int(api.memory_desc_get_size(chosen))
        source, target = (plain, chosen) if into_chosen else (chosen, plain)
        reorder_desc = _Handle()
        _check(api.reorder_primitive_desc_create(ctypes.byref(reorder_desc), source, api.engine, target, api.engine, None))
        self.reorder = _Handle()
        status = api.primitive_create(ctypes.byref(self.reorder), reorder_desc)
        api.primitive_desc_destroy(reorder_desc)
        _check(status)
        owned.append(("primitive_destroy", self.reorder))
        self.reorder_args = (
            (_ExecArg * 2)(_ExecArg(_ARG_SRC, self.plain_memory), _ExecArg(_ARG_DST, self.chosen_memory))
            if into_chosen
            else (_ExecArg * 2)(_ExecArg(_ARG_SRC, self.chosen_memory), _ExecArg(_ARG_DST, self.plain_memory))
        )

    def memory(self) -> _Handle:
        return self.plain_memory if self.chosen_memory is None else self.chosen_memory


def _destroy(api: _Api, owned: list) -> None:
    for function, handle in reversed(owned):
        getattr(api, function)(handle)


class OneDnnPlan(OwnSums):
    """A forward (de)convolution primitive for one geometry: ``plan(x, w, b)`` returns the output
    as a new C-contiguous float32 array."""

    def __init__(self, api: _Api, create_desc, x_shape: tuple, w_dims: tuple, w_strides: tuple, y_shape: tuple, bias: bool):
        owned: list = []
        try:
            self._build(api, create_desc, x_shape, w_dims, w_strides, y_shape, bias, owned)
        except BaseException:
            _destroy(api, owned)
            raise
        self._api, self._lock = api, threading.Lock()
        weakref.finalize(self, _destroy, api, owned)

    def _build(self, api, create_desc, x_shape, w_dims, w_strides, y_shape, bias, owned) -> None:
        plain = [_strided_desc(api, x_shape), _strided_desc(api, w_dims, w_strides), _strided_desc(api, y_shape)]
        wanted = [_strided_desc(api, shape, "any") for shape in (x_shape, w_dims, y_shape)]
        bias_desc = _strided_desc(api, (y_shape[1],)) if bias else None
        owned.extend(("memory_desc_destroy", d) for d in (*plain, *wanted, *([bias_desc] if bias else [])))
        primitive_desc = _Handle()
        _check(create_desc(ctypes.byref(primitive_desc), wanted[0], wanted[1], bias_desc, wanted[2]))
        owned.append(("primitive_desc_destroy", primitive_desc))
        info = ctypes.c_char_p()
        _check(api.primitive_desc_query(primitive_desc, _QUERY_IMPL_INFO, 0, ctypes.byref(info)))
        self.implementation = (info.value or b"").decode()
        if self.implementation.startswith(_REFUSED_IMPLEMENTATIONS):
            raise _Refused(self.implementation)
        chosen = [api.primitive_desc_query_md(primitive_desc, query, 0) for query in (_QUERY_SRC, _QUERY_WEIGHTS, _QUERY_DST)]
        self.primitive = _Handle()
        _check(api.primitive_create(ctypes.byref(self.primitive), primitive_desc))
        owned.append(("primitive_destroy", self.primitive))
        self.x, self.w = (_Operand(api, a, plain[i], chosen[i], True, owned) for i, a in ((0, _ARG_SRC), (1, _ARG_WEIGHTS)))
        self.y = _Operand(api, _ARG_DST, plain[2], chosen[2], False, owned)
        self.bias_memory = None
        args = [_ExecArg(_ARG_SRC, self.x.memory()), _ExecArg(_ARG_WEIGHTS, self.w.memory()), _ExecArg(_ARG_DST, self.y.memory())]
        if bias:
            self.bias_memory = _Handle()
            _check(api.memory_create(ctypes.byref(self.bias_memory), bias_desc, api.engine, None))
            owned.append(("memory_destroy", self.bias_memory))
            args.append(_ExecArg(_ARG_BIAS, self.bias_memory))
        self.args, self.y_shape = (_ExecArg * len(args))(*args), y_shape

    def __call__(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        api = self._api
        x, w = np.ascontiguousarray(x, np.float32), np.ascontiguousarray(w, np.float32)
        y = np.empty(self.y_shape, np.float32)
        keep = [x, w, y]  # the arrays whose pointers oneDNN holds, alive until the stream is done
        if b is not None:
            keep.append(b := np.ascontiguousarray(b, np.float32))
        with self._lock:
            for operand, array in ((self.x, x), (self.w, w), (self.y, y)):
                api.memory_set_data_handle(operand.plain_memory, array.ctypes.data)
                if operand.chosen_memory is not None:
                    blocked = np.empty(operand.chosen_bytes // 4 + 1, np.float32)
                    keep.append(blocked)
                    api.memory_set_data_handle(operand.chosen_memory, blocked.ctypes.data)
            if b is not None:
                api.memory_set_data_handle(self.bias_memory, b.ctypes.data)
            for operand in (self.x, self.w):
                if operand.reorder is not None:
                    _check(api.primitive_execute(operand.reorder, api.stream, 2, operand.reorder_args))
            _check(api.primitive_execute(self.primitive, api.stream, len(self.args), self.args))
            if self.y.reorder is not None:
                _check(api.primitive_execute(self.y.reorder, api.stream, 2, self.y.reorder_args))
            _check(api.stream_wait(api.stream))
        del keep
        return y


def _plan_or_none(make) -> OneDnnPlan | None:
    api = _loaded_api()
    if api is None:
        return None
    try:
        return make(api)
    except _Refused:
        return None


def plan_conv(x_shape: tuple, w_shape: tuple, group: int, strides, dilations, begin, end, out, bias: bool) -> OneDnnPlan | None:
    """A plan for ONNX Conv of a float32 X (N, C, *spatial) and W (M, C / group, *kernel) with
    ``group`` > 1 and the geometry ``gradgen.ops.pool.spatial_geometry`` worked out; None where
    oneDNN is not used (see the module's docstring)."""
    if group <= 1 or not 1 <= len(x_shape) - 2 <= 3 or min(*x_shape, *w_shape) <= 0:
        return None
    m = w_shape[0]
    w_dims = (group, m // group, *w_shape[1:])  # W's own memory, seen per group
    y_shape = (x_shape[0], m, *out)

    def make(api: _Api) -> OneDnnPlan:
        def create(desc, x_desc, w_desc, b_desc, y_desc):
            return api.convolution_forward_primitive_desc_create(
                desc, api.engine, _FORWARD_INFERENCE, _CONVOLUTION_DIRECT, x_desc, w_desc, b_desc, y_desc,
                *_geometry(strides, dilations, begin, end), None,
            )  # fmt: skip

        return OneDnnPlan(api, create, tuple(x_shape), w_dims, _row_major(w_dims), y_shape, bias)

    return _plan_or_none(make)


def plan_conv_transpose(
    x_shape: tuple, w_shape: tuple, group: int, strides, dilations, begin, out, bias: bool
) -> OneDnnPlan | None:
    """A plan for ONNX ConvTranspose of a float32 X (N, C, *spatial) and W (C, M / group, *kernel)
    with ``group`` > 1, output spatial size ``out`` and leading crop ``begin`` (what
    ``gradgen.ops.conv.conv_transpose_geometry`` gives); None where oneDNN is not used, including
    a crop or trailing padding below zero (output_padding beyond the end pads)."""
    ns = len(x_shape) - 2
    if group <= 1 or not 1 <= ns <= 3 or min(*x_shape, *w_shape) <= 0:
        return None
    channels, m_per_group, kernel = x_shape[1], w_shape[1], w_shape[2:]
    # oneDNN's deconvolution: input = (output - extent + begin + end) / stride + 1 along each axis
    ends = [
        (n - 1) * s + (k - 1) * d + 1 - o - b for n, s, k, d, o, b in zip(x_shape[2:], strides, kernel, dilations, out, begin)
    ]
    if min(begin) < 0 or min(ends) < 0:
        return None
    cg = channels // group
    # oneDNN's weights are (group, out per group, in per group, *kernel); W's memory is (group, in
    # per group, out per group, *kernel): the same dims with the two channel strides swapped
    w_dims = (group, m_per_group, cg, *kernel)
    row_major = _row_major((group, cg, m_per_group, *kernel))
    w_strides = (row_major[0], row_major[2], row_major[1], *row_major[3:])
    y_shape = (x_shape[0], m_per_group * group, *out)

    def make(api: _Api) -> OneDnnPlan:
        def create(desc, x_desc, w_desc, b_desc, y_desc):
            return api.deconvolution_forward_primitive_desc_create(
                desc, api.engine, _FORWARD_INFERENCE, _DECONVOLUTION_DIRECT, x_desc, w_desc, b_desc, y_desc,
                *_geometry(strides, dilations, begin, ends), None,
            )  # fmt: skip

        return OneDnnPlan(api, create, tuple(x_shape), w_dims, w_strides, y_shape, bias)

    return _plan_or_none(make)


def _geometry(strides, dilations, begin, end) -> tuple:
    """strides, dilations (oneDNN counts the gaps: ONNX's dilation - 1), leading and trailing pads."""
    return _Dims(*strides), _Dims(*(d - 1 for d in dilations)), _Dims(*begin), _Dims(*end)
