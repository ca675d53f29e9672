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
(``plan_conv`` and ``plan_conv_transpose`` return None; ``plan_conv_grad`` decides dX and dW apart).

The results are oneDNN's sums, in its order: equal to gradgen's path within float32 rounding, and
the same from run to run at a given thread count (the prepared Conv uses them from the first run).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from typing import Any, Callable, TypeVar

import numpy as np

from gradgen.kernels.cpu import blas
from gradgen.kernels.cpu.prepared import OwnSums

# oneDNN 3.x's C API (dnnl_types.h): the values gradgen uses
_CPU_ENGINE, _IN_ORDER_STREAM = 1, 1
_F32, _ANY_LAYOUT = 3, 1
_FORWARD_INFERENCE = 96
_CONVOLUTION_DIRECT, _DECONVOLUTION_DIRECT = 1, 10
_FORWARD_TRAINING = 64  # the hint a backward primitive is made from
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS = 1, 17, 33, 41
_ARG_DIFF_SRC, _ARG_DIFF_DST, _ARG_DIFF_WEIGHTS = 129, 145, 161
_QUERY_IMPL_INFO, _QUERY_SRC, _QUERY_WEIGHTS, _QUERY_DST = 8, 129, 131, 133
_QUERY_DIFF_SRC, _QUERY_DIFF_WEIGHTS, _QUERY_DIFF_DST = 130, 132, 134
_MAX_DIMS = 12
# oneDNN's reference code (slow) and its im2col + GEMM ("x64:gemm:jit": what gradgen's own path does)
# are left to gradgen's path


def _refused(implementation: str) -> bool:
    return implementation.startswith("ref") or "gemm" in implementation


_Dims = ctypes.c_int64 * _MAX_DIMS
P = TypeVar("P")
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
            "dnnl_convolution_backward_data_primitive_desc_create": ([out, h, i, h, h, h, _Dims, _Dims, _Dims, _Dims, h, h], i),
            "dnnl_convolution_backward_weights_primitive_desc_create": (
                [out, h, i, h, h, h, h, _Dims, _Dims, _Dims, _Dims, h, h],
                i,
            ),
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
    """One array argument of a primitive: its plain (numpy) layout, the layout the primitive chose,
    and the reorder between them (None where they are the same)."""

    def __init__(self, api: _Api, arg: int, plain: _Handle, chosen: int, is_input: bool, owned: list) -> None:
        self.arg, self.is_input, self.plain_memory = arg, is_input, _Handle()
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
        source, target = (plain, chosen) if is_input else (chosen, plain)
        reorder_desc = _Handle()
        _check(api.reorder_primitive_desc_create(ctypes.byref(reorder_desc), source, api.engine, target, api.engine, None))
        self.reorder = _Handle()
        status = api.primitive_create(ctypes.byref(self.reorder), reorder_desc)
        api.primitive_desc_destroy(reorder_desc)
        _check(status)
        owned.append(("primitive_destroy", self.reorder))
        memories = (self.plain_memory, self.chosen_memory) if is_input else (self.chosen_memory, self.plain_memory)
        self.reorder_args = (_ExecArg * 2)(_ExecArg(_ARG_SRC, memories[0]), _ExecArg(_ARG_DST, memories[1]))

    def memory(self) -> _Handle:
        return self.plain_memory if self.chosen_memory is None else self.chosen_memory


def _destroy(api: _Api, owned: list) -> None:
    for function, handle in reversed(owned):
        getattr(api, function)(handle)


# (execution argument, query of its layout, logical dims, element strides or None (row-major),
# an input or the output): one array of a primitive
_Spec = tuple[int, int, tuple, "tuple | None", bool]


class _Primitive:
    """One oneDNN primitive for one geometry, with arrays in numpy's layouts: ``run(inputs, bias)``
    returns its output as a new C-contiguous float32 array. ``create(desc, any_layouts, bias)``
    makes its primitive descriptor from descriptors of oneDNN's "any" layout, one per spec."""

    def __init__(self, api: _Api, create, specs: list[_Spec], bias_size: int | None = None) -> None:
        owned: list = []
        try:
            self._build(api, create, specs, bias_size, owned)
        except BaseException:
            _destroy(api, owned)
            raise
        self._api, self._lock = api, threading.Lock()
        weakref.finalize(self, _destroy, api, owned)

    def _build(self, api: _Api, create, specs: list[_Spec], bias_size: int | None, owned: list) -> None:
        plain = [_strided_desc(api, dims, strides) for _, _, dims, strides, _ in specs]
        wanted = [_strided_desc(api, dims, "any") for _, _, dims, _, _ in specs]
        bias_desc = _strided_desc(api, (bias_size,)) if bias_size is not None else None
        owned.extend(("memory_desc_destroy", d) for d in (*plain, *wanted, *([bias_desc] if bias_desc else [])))
        primitive_desc = _Handle()
        _check(create(ctypes.byref(primitive_desc), wanted, bias_desc))
        owned.append(("primitive_desc_destroy", primitive_desc))
        info = ctypes.c_char_p()
        _check(api.primitive_desc_query(primitive_desc, _QUERY_IMPL_INFO, 0, ctypes.byref(info)))
        self.implementation = (info.value or b"").decode()
        if _refused(self.implementation):
            raise _Refused(self.implementation)
        self.operands = [
            _Operand(api, arg, desc, api.primitive_desc_query_md(primitive_desc, query, 0), is_input, owned)
            for (arg, query, _, _, is_input), desc in zip(specs, plain)
        ]
        self.primitive = _Handle()
        _check(api.primitive_create(ctypes.byref(self.primitive), primitive_desc))
        owned.append(("primitive_destroy", self.primitive))
        args = [_ExecArg(operand.arg, operand.memory()) for operand in self.operands]
        self.bias_memory = None
        if bias_desc is not None:
            self.bias_memory = _Handle()
            _check(api.memory_create(ctypes.byref(self.bias_memory), bias_desc, api.engine, None))
            owned.append(("memory_destroy", self.bias_memory))
            args.append(_ExecArg(_ARG_BIAS, self.bias_memory))
        self.args = (_ExecArg * len(args))(*args)
        self.out_shape = next(dims for _, _, dims, _, is_input in specs if not is_input)

    def run(self, inputs: list[np.ndarray], bias: np.ndarray | None = None) -> np.ndarray:
        api = self._api
        out = np.empty(self.out_shape, np.float32)
        arrays = [np.ascontiguousarray(a, np.float32) for a in inputs] + [out]
        keep = list(arrays)  # what oneDNN holds pointers to, alive until the stream is done
        if bias is not None:
            keep.append(bias := np.ascontiguousarray(bias, np.float32))
        with self._lock:
            for operand, array in zip(self.operands, arrays):
                api.memory_set_data_handle(operand.plain_memory, array.ctypes.data)
                if operand.chosen_memory is not None:
                    blocked = np.empty(operand.chosen_bytes // 4 + 1, np.float32)
                    keep.append(blocked)
                    api.memory_set_data_handle(operand.chosen_memory, blocked.ctypes.data)
            if bias is not None:
                api.memory_set_data_handle(self.bias_memory, bias.ctypes.data)
            for operand in self.operands:
                if operand.is_input and operand.reorder is not None:
                    _check(api.primitive_execute(operand.reorder, api.stream, 2, operand.reorder_args))
            _check(api.primitive_execute(self.primitive, api.stream, len(self.args), self.args))
            for operand in self.operands:
                if not operand.is_input and operand.reorder is not None:
                    _check(api.primitive_execute(operand.reorder, api.stream, 2, operand.reorder_args))
            _check(api.stream_wait(api.stream))
        del keep
        return out


class OneDnnPlan(OwnSums):
    """A forward (de)convolution for one geometry: ``plan(x, w, b)`` returns the output as a new
    C-contiguous float32 array."""

    def __init__(self, primitive: _Primitive) -> None:
        self.primitive, self.implementation = primitive, primitive.implementation

    def __call__(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        return self.primitive.run([x, w], b)


class OneDnnConvGrad(OwnSums):
    """ONNX Runtime training's ConvGrad for one grouped geometry: dX by oneDNN's backward-data
    convolution, dW by its backward-weights one (each where wanted), dB as numpy's sum of dY. A
    wanted part that oneDNN refused is None in the results and True in ``missing``: the caller
    computes it."""

    def __init__(self, data: _Primitive | None, weights: _Primitive | None, wanted: tuple) -> None:
        self.data, self.weights, self.outputs = data, weights, len(wanted)
        self.missing = tuple(bool(w) and p is None for w, p in zip(wanted[:2], (data, weights)))
        self.implementation = " / ".join(p.implementation if p is not None else "gradgen" for p in (data, weights))

    def __call__(self, dY: np.ndarray, X: np.ndarray, W: np.ndarray) -> tuple:
        results: list = [
            self.data.run([dY, W]) if self.data is not None else None,
            self.weights.run([X, dY]).reshape(W.shape) if self.weights is not None else None,
        ][: self.outputs]
        if self.outputs >= 3:
            results.append(dY.sum(axis=(0, *range(2, dY.ndim))).astype(dY.dtype))
        return tuple(results)


def _plan_or_none(make: Callable[[_Api], P]) -> P | None:
    api = _loaded_api()
    if api is None:
        return None
    try:
        return make(api)
    except _Refused:
        return None


def _grouped(x_shape: tuple, w_shape: tuple, group: int) -> bool:
    """The geometries planned here: grouped, 1 to 3 spatial axes, no empty axis."""
    return group > 1 and 1 <= len(x_shape) - 2 <= 3 and min(*x_shape, *w_shape) > 0


def _conv_specs(x_shape: tuple, w_shape: tuple, group: int, out) -> tuple[tuple, tuple, tuple]:
    """(X's dims, W's dims per group, Y's dims) of an ONNX Conv: W (M, C / group, *kernel) is
    (group, M / group, C / group, *kernel) in the same memory."""
    w_dims = (group, w_shape[0] // group, *w_shape[1:])
    return tuple(x_shape), w_dims, (x_shape[0], w_shape[0], *out)


def plan_conv(x_shape: tuple, w_shape: tuple, group: int, strides, dilations, begin, end, out, bias: bool) -> OneDnnPlan | None:
    """A plan for ONNX Conv of a float32 X (N, C, *spatial) and W (M, C / group, *kernel) with
    ``group`` > 1 and the geometry ``gradgen.ops.pool.spatial_geometry`` worked out; None where
    oneDNN is not used (see the module's docstring)."""
    if not _grouped(x_shape, w_shape, group):
        return None
    x_dims, w_dims, y_dims = _conv_specs(x_shape, w_shape, group, out)

    def make(api: _Api) -> OneDnnPlan:
        def create(desc, layouts, bias_desc):
            return api.convolution_forward_primitive_desc_create(
                desc, api.engine, _FORWARD_INFERENCE, _CONVOLUTION_DIRECT, *layouts[:2], bias_desc, layouts[2],
                *_geometry(strides, dilations, begin, end), None,
            )  # fmt: skip

        specs: list[_Spec] = [(_ARG_SRC, _QUERY_SRC, x_dims, None, True), (_ARG_WEIGHTS, _QUERY_WEIGHTS, w_dims, None, True)]
        specs.append((_ARG_DST, _QUERY_DST, y_dims, None, False))
        return OneDnnPlan(_Primitive(api, create, specs, y_dims[1] if bias else None))

    return _plan_or_none(make)


def plan_conv_grad(
    x_shape: tuple, w_shape: tuple, group: int, strides, dilations, begin, end, out, wanted: tuple
) -> OneDnnConvGrad | None:
    """A plan for ONNX Runtime training's ConvGrad (dY, X, W) -> (dX, dW, dB) of a grouped float32
    Conv with the geometry worked out; ``wanted`` says which of dX and dW are computed (dB is a
    sum). None where oneDNN is not used for either."""
    if not _grouped(x_shape, w_shape, group):
        return None
    x_dims, w_dims, y_dims = _conv_specs(x_shape, w_shape, group, out)
    geometry = (strides, dilations, begin, end)

    def make(api: _Api) -> OneDnnConvGrad:
        hint, hint_layouts = _Handle(), [_strided_desc(api, dims, "any") for dims in (x_dims, w_dims, y_dims)]
        try:
            _check(
                api.convolution_forward_primitive_desc_create(
                    ctypes.byref(hint),
                    api.engine,
                    _FORWARD_TRAINING,
                    _CONVOLUTION_DIRECT,
                    *hint_layouts[:2],
                    None,
                    hint_layouts[2],
                    *_geometry(*geometry),
                    None,
                )  # fmt: skip
            )

            def backward_data(desc, layouts, _bias):
                return api.convolution_backward_data_primitive_desc_create(
                    desc, api.engine, _CONVOLUTION_DIRECT, layouts[2], layouts[1], layouts[0], *_geometry(*geometry), hint, None
                )

            def backward_weights(desc, layouts, _bias):
                return api.convolution_backward_weights_primitive_desc_create(
                    desc, api.engine, _CONVOLUTION_DIRECT, layouts[0], layouts[2], None, layouts[1],
                    *_geometry(*geometry), hint, None,
                )  # fmt: skip

            data = weights = None
            if wanted[0]:  # dX from (dY, W)
                specs = [(_ARG_DIFF_DST, _QUERY_DIFF_DST, y_dims, None, True), (_ARG_WEIGHTS, _QUERY_WEIGHTS, w_dims, None, True)]
                data = _part(api, backward_data, [*specs, (_ARG_DIFF_SRC, _QUERY_DIFF_SRC, x_dims, None, False)])
            if len(wanted) > 1 and wanted[1]:  # dW from (X, dY)
                specs = [(_ARG_SRC, _QUERY_SRC, x_dims, None, True), (_ARG_DIFF_DST, _QUERY_DIFF_DST, y_dims, None, True)]
                weights = _part(api, backward_weights, [*specs, (_ARG_DIFF_WEIGHTS, _QUERY_DIFF_WEIGHTS, w_dims, None, False)])
            if data is None and weights is None:
                raise _Refused("neither gradient")
        finally:
            if hint:
                api.primitive_desc_destroy(hint)
            for desc in hint_layouts:
                api.memory_desc_destroy(desc)
        return OneDnnConvGrad(data, weights, wanted)

    return _plan_or_none(make)


def _part(api: _Api, create, specs: list[_Spec]) -> _Primitive | None:
    """One of ConvGrad's primitives, or None where oneDNN refuses it (its part runs gradgen's way)."""
    try:
        return _Primitive(api, create, specs)
    except _Refused:
        return None


def plan_conv_transpose(
    x_shape: tuple, w_shape: tuple, group: int, strides, dilations, begin, out, bias: bool
) -> OneDnnPlan | None:
    """A plan for ONNX ConvTranspose of a float32 X (N, C, *spatial) and W (C, M / group, *kernel)
    with ``group`` > 1, output spatial size ``out`` and leading crop ``begin`` (what
    ``gradgen.ops.conv.conv_transpose_geometry`` gives); None where oneDNN is not used, including
    a crop or trailing padding below zero (output_padding beyond the end pads)."""
    if not _grouped(x_shape, w_shape, group):
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
    y_dims = (x_shape[0], m_per_group * group, *out)

    def make(api: _Api) -> OneDnnPlan:
        def create(desc, layouts, bias_desc):
            return api.deconvolution_forward_primitive_desc_create(
                desc, api.engine, _FORWARD_INFERENCE, _DECONVOLUTION_DIRECT, *layouts[:2], bias_desc, layouts[2],
                *_geometry(strides, dilations, begin, ends), None,
            )  # fmt: skip

        specs = [(_ARG_SRC, _QUERY_SRC, tuple(x_shape), None, True), (_ARG_WEIGHTS, _QUERY_WEIGHTS, w_dims, w_strides, True)]
        specs.append((_ARG_DST, _QUERY_DST, y_dims, None, False))
        return OneDnnPlan(_Primitive(api, create, specs, y_dims[1] if bias else None))

    return _plan_or_none(make)


def _geometry(strides, dilations, begin, end) -> tuple:
    """strides, dilations (oneDNN counts the gaps: ONNX's dilation - 1), leading and trailing pads."""
    return _Dims(*strides), _Dims(*(d - 1 for d in dilations)), _Dims(*begin), _Dims(*end)
