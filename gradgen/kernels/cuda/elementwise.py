"""CUDA launchers: elementwise ops (elementwise.cu)."""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.registry import cuda_kernel


def _binary(name: str, a, b):
    from gradgen.cuda import runtime as rt

    if a.dtype != b.dtype:
        raise KernelError(f"input dtypes differ: {a.dtype} and {b.dtype}")
    try:
        out_shape = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise KernelError(f"shapes {list(a.shape)} and {list(b.shape)} do not broadcast") from None
    out = rt.empty(out_shape, a.dtype)
    kernel = rt.function("elementwise", f"{name}_{rt.suffix(a.dtype)}")
    rt.launch(kernel, out.size, out, a, b, rt.desc(out_shape),
              rt.desc(out_shape, rt.broadcast_strides(a.shape, out_shape)),
              rt.desc(out_shape, rt.broadcast_strides(b.shape, out_shape)), np.int64(out.size))
    return out


def _unary(name: str, x):
    from gradgen.cuda import runtime as rt

    out = rt.empty(x.shape, x.dtype)
    rt.launch(rt.function("elementwise", f"{name}_{rt.suffix(x.dtype)}"), out.size, out, x, np.int64(out.size))
    return out


@cuda_kernel("Add")
def add(a, b):
    return _binary("add", a, b)


@cuda_kernel("Sub")
def sub(a, b):
    return _binary("sub", a, b)


@cuda_kernel("Mul")
def mul(a, b):
    return _binary("mul", a, b)


@cuda_kernel("Div")
def div(a, b):
    return _binary("div", a, b)


@cuda_kernel("Relu")
def relu(x):
    return _unary("relu", x)
