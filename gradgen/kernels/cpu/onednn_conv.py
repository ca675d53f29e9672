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
from typing import Callable, TypeVar

import numpy as np

from gradgen.kernels.cpu import onednn
from gradgen.kernels.cpu.onednn import (  # noqa: F401 -- the binding's names as this module used them
    Api as _Api,
)
from gradgen.kernels.cpu.prepared import OwnSums

# oneDNN's reference code (slow) and its im2col + GEMM ("x64:gemm:jit": what gradgen's own path does)
# are left to gradgen's path


def _refused(implementation: str) -> bool:
    return implementation.startswith("ref") or "gemm" in implementation


P = TypeVar("P")


class _Operand:
    """One array argument of a primitive: its plain (numpy) layout, the layout the primitive chose,
    and the reorder between them (None where they are the same)."""

    def __init__(self, api: onednn.Api, arg: int, plain: onednn.Handle, chosen: int, is_input: bool, owned: list) -> None:
        self.arg, self.is_input, self.plain_memory = arg, is_input, onednn.Handle()
        onednn.check(api.memory_create(ctypes.byref(self.plain_memory), plain, api.engine, None))
        owned.append(("memory_destroy", self.plain_memory))
        self.reorder = self.chosen_memory = None
        self.chosen_bytes = 0
        if api.memory_desc_equal(plain, chosen):
            return
        self.chosen_memory = onednn.Handle()
        onednn.check(api.memory_create(ctypes.byref(self.chosen_memory), chosen, api.engine, None))
        owned.append(("memory_destroy", self.chosen_memory))
        self.chosen_bytes = int(api.memory_desc_get_size(chosen))
        source, target = (plain, chosen) if is_input else (chosen, plain)
        reorder_desc = onednn.Handle()
        onednn.check(api.reorder_primitive_desc_create(ctypes.byref(reorder_desc), source, api.engine, target, api.engine, None))
        self.reorder = onednn.Handle()
        status = api.primitive_create(ctypes.byref(self.reorder), reorder_desc)
        api.primitive_desc_destroy(reorder_desc)
        onednn.check(status)
        owned.append(("primitive_destroy", self.reorder))
        memories = (self.plain_memory, self.chosen_memory) if is_input else (self.chosen_memory, self.plain_memory)
        self.reorder_args = (onednn.ExecArg * 2)(
            onednn.ExecArg(onednn.ARG_SRC, memories[0]), onednn.ExecArg(onednn.ARG_DST, memories[1])
        )

    def memory(self) -> onednn.Handle:
        return self.plain_memory if self.chosen_memory is None else self.chosen_memory


# (execution argument, query of its layout, logical dims, element strides or None (row-major),
# an input or the output): one array of a primitive
_Spec = tuple[int, int, tuple, "tuple | None", bool]


class _Primitive:
    """One oneDNN primitive for one geometry, with arrays in numpy's layouts: ``run(inputs, bias)``
    returns its output as a new C-contiguous float32 array. ``create(desc, any_layouts, bias)``
    makes its primitive descriptor from descriptors of oneDNN's "any" layout, one per spec."""

    def __init__(self, api: onednn.Api, create, specs: list[_Spec], bias_size: int | None = None) -> None:
        owned: list = []
        try:
            self._build(api, create, specs, bias_size, owned)
        except BaseException:
            onednn.destroy(api, owned)
            raise
        self._api, self._lock = api, threading.Lock()
        weakref.finalize(self, onednn.destroy, api, owned)

    def _build(self, api: onednn.Api, create, specs: list[_Spec], bias_size: int | None, owned: list) -> None:
        plain = [onednn.strided_desc(api, dims, strides) for _, _, dims, strides, _ in specs]
        wanted = [onednn.strided_desc(api, dims, "any") for _, _, dims, _, _ in specs]
        bias_desc = onednn.strided_desc(api, (bias_size,)) if bias_size is not None else None
        owned.extend(("memory_desc_destroy", d) for d in (*plain, *wanted, *([bias_desc] if bias_desc else [])))
        primitive_desc = onednn.Handle()
        onednn.check(create(ctypes.byref(primitive_desc), wanted, bias_desc))
        owned.append(("primitive_desc_destroy", primitive_desc))
        self.implementation = onednn.implementation(api, primitive_desc)
        if _refused(self.implementation):
            raise onednn.Refused(self.implementation)
        self.operands = [
            _Operand(api, arg, desc, api.primitive_desc_query_md(primitive_desc, query, 0), is_input, owned)
            for (arg, query, _, _, is_input), desc in zip(specs, plain)
        ]
        self.primitive = onednn.Handle()
        onednn.check(api.primitive_create(ctypes.byref(self.primitive), primitive_desc))
        owned.append(("primitive_destroy", self.primitive))
        args = [onednn.ExecArg(operand.arg, operand.memory()) for operand in self.operands]
        self.bias_memory = None
        if bias_desc is not None:
            self.bias_memory = onednn.Handle()
            onednn.check(api.memory_create(ctypes.byref(self.bias_memory), bias_desc, api.engine, None))
            owned.append(("memory_destroy", self.bias_memory))
            args.append(onednn.ExecArg(onednn.ARG_BIAS, self.bias_memory))
        self.args = (onednn.ExecArg * len(args))(*args)
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
                    onednn.check(api.primitive_execute(operand.reorder, api.stream, 2, operand.reorder_args))
            onednn.check(api.primitive_execute(self.primitive, api.stream, len(self.args), self.args))
            for operand in self.operands:
                if not operand.is_input and operand.reorder is not None:
                    onednn.check(api.primitive_execute(operand.reorder, api.stream, 2, operand.reorder_args))
            onednn.check(api.stream_wait(api.stream))
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


def _plan_or_none(make: Callable[[onednn.Api], P]) -> P | None:
    api = onednn.loaded_api()
    if api is None:
        return None
    try:
        return make(api)
    except onednn.Refused:
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

    def make(api: onednn.Api) -> OneDnnPlan:
        def create(desc, layouts, bias_desc):
            return api.convolution_forward_primitive_desc_create(
                desc, api.engine, onednn.FORWARD_INFERENCE, onednn.CONVOLUTION_DIRECT, *layouts[:2], bias_desc, layouts[2],
                *_geometry(strides, dilations, begin, end), None,
            )  # fmt: skip

        specs: list[_Spec] = [
            (onednn.ARG_SRC, onednn.QUERY_SRC, x_dims, None, True),
            (onednn.ARG_WEIGHTS, onednn.QUERY_WEIGHTS, w_dims, None, True),
        ]
        specs.append((onednn.ARG_DST, onednn.QUERY_DST, y_dims, None, False))
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

    def make(api: onednn.Api) -> OneDnnConvGrad:
        hint, hint_layouts = onednn.Handle(), [onednn.strided_desc(api, dims, "any") for dims in (x_dims, w_dims, y_dims)]
        try:
            onednn.check(
                api.convolution_forward_primitive_desc_create(
                    ctypes.byref(hint),
                    api.engine,
                    onednn.FORWARD_TRAINING,
                    onednn.CONVOLUTION_DIRECT,
                    *hint_layouts[:2],
                    None,
                    hint_layouts[2],
                    *_geometry(*geometry),
                    None,
                )  # fmt: skip
            )

            def backward_data(desc, layouts, _bias):
                return api.convolution_backward_data_primitive_desc_create(
                    desc,
                    api.engine,
                    onednn.CONVOLUTION_DIRECT,
                    layouts[2],
                    layouts[1],
                    layouts[0],
                    *_geometry(*geometry),
                    hint,
                    None,
                )

            def backward_weights(desc, layouts, _bias):
                return api.convolution_backward_weights_primitive_desc_create(
                    desc, api.engine, onednn.CONVOLUTION_DIRECT, layouts[0], layouts[2], None, layouts[1],
                    *_geometry(*geometry), hint, None,
                )  # fmt: skip

            data = weights = None
            if wanted[0]:  # dX from (dY, W)
                specs = [
                    (onednn.ARG_DIFF_DST, onednn.QUERY_DIFF_DST, y_dims, None, True),
                    (onednn.ARG_WEIGHTS, onednn.QUERY_WEIGHTS, w_dims, None, True),
                ]
                data = _part(api, backward_data, [*specs, (onednn.ARG_DIFF_SRC, onednn.QUERY_DIFF_SRC, x_dims, None, False)])
            if len(wanted) > 1 and wanted[1]:  # dW from (X, dY)
                specs = [
                    (onednn.ARG_SRC, onednn.QUERY_SRC, x_dims, None, True),
                    (onednn.ARG_DIFF_DST, onednn.QUERY_DIFF_DST, y_dims, None, True),
                ]
                weights = _part(
                    api, backward_weights, [*specs, (onednn.ARG_DIFF_WEIGHTS, onednn.QUERY_DIFF_WEIGHTS, w_dims, None, False)]
                )
            if data is None and weights is None:
                raise onednn.Refused("neither gradient")
        finally:
            if hint:
                api.primitive_desc_destroy(hint)
            for desc in hint_layouts:
                api.memory_desc_destroy(desc)
        return OneDnnConvGrad(data, weights, wanted)

    return _plan_or_none(make)


def _part(api: onednn.Api, create, specs: list[_Spec]) -> _Primitive | None:
    """One of ConvGrad's primitives, or None where oneDNN refuses it (its part runs gradgen's way)."""
    try:
        return _Primitive(api, create, specs)
    except onednn.Refused:
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
    row_major = onednn.row_major((group, cg, m_per_group, *kernel))
    w_strides = (row_major[0], row_major[2], row_major[1], *row_major[3:])
    y_dims = (x_shape[0], m_per_group * group, *out)

    def make(api: onednn.Api) -> OneDnnPlan:
        def create(desc, layouts, bias_desc):
            return api.deconvolution_forward_primitive_desc_create(
                desc, api.engine, onednn.FORWARD_INFERENCE, onednn.DECONVOLUTION_DIRECT, *layouts[:2], bias_desc, layouts[2],
                *_geometry(strides, dilations, begin, ends), None,
            )  # fmt: skip

        specs = [
            (onednn.ARG_SRC, onednn.QUERY_SRC, tuple(x_shape), None, True),
            (onednn.ARG_WEIGHTS, onednn.QUERY_WEIGHTS, w_dims, w_strides, True),
        ]
        specs.append((onednn.ARG_DST, onednn.QUERY_DST, y_dims, None, False))
        return OneDnnPlan(_Primitive(api, create, specs, y_dims[1] if bias else None))

    return _plan_or_none(make)


def _geometry(strides, dilations, begin, end) -> tuple:
    """strides, dilations (oneDNN counts the gaps: ONNX's dilation - 1), leading and trailing pads."""
    return onednn.Dims(*strides), onednn.Dims(*(d - 1 for d in dilations)), onednn.Dims(*begin), onednn.Dims(*end)
