"""CUDA launchers: elementwise ops (elementwise.cu).

One broadcasting binary kernel body serves every binary op (arithmetic, Pow, Mod, comparisons,
logic), one ternary body serves Where, one unary body every unary op. Before a launch the shapes
are simplified: size-1 dims are dropped and adjacent dims that are contiguous for every operand are
merged, so same-shape operands (and a scalar against a tensor) run as rank-1 loops without index
arithmetic. dtypes the kernels do not cover (rare: uint16, int8 arithmetic, ...) run through the
op's CPU kernel, so the result is still right.
"""

from __future__ import annotations

import functools

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cuda.launch import (
    CASTABLE,
    FLOATS,
    NUMBERS,
    coalesce,
    contiguous,
    copy,
    cpu_fallback,
    dtype_suffix,
    generated_module,
    kernel_of,
    launch,
    onnx_element_dtype,
    runtime,
    same_type,
)
from gradgen.kernels.table import MICROSOFT, cuda_kernel

# -- shared helpers (the other launcher modules use them too) ------------------------------------


def broadcast_descs(out_shape, *in_shapes):
    """(shape desc, one strides desc per input) for inputs broadcast to ``out_shape``."""
    from gradgen.cuda import runtime as rt

    shape, strides = coalesce(out_shape, *[rt.broadcast_strides(s, out_shape) for s in in_shapes])
    return rt.desc(shape), [rt.desc(shape, st) for st in strides]


def broadcast_shape(*shapes):
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        listed = " and ".join(str(list(s)) for s in shapes)
        raise KernelError(f"shapes {listed} do not broadcast") from None


def _null():
    return np.intp(0)


# -- binary ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _binary_plan(a_shape: tuple, b_shape: tuple, four_bytes: bool):
    """(out shape, (n, descs) plain, (n, descs) in quads or None), cached per shape pair."""
    from gradgen.cuda import runtime as rt

    out_shape = broadcast_shape(a_shape, b_shape)
    shape, strides = coalesce(out_shape, *[rt.broadcast_strides(s, out_shape) for s in (a_shape, b_shape)])
    n = int(np.prod(out_shape, dtype=np.int64))
    plain = (n, (rt.desc(shape), *[rt.desc(shape, st) for st in strides]))
    quads = None
    if four_bytes and shape and shape[-1] % 4 == 0 and all(st[-1] in (0, 1) for st in strides):
        shape4 = shape[:-1] + [shape[-1] // 4]
        strides4 = [st[:-1] + [st[-1] * 4] for st in strides]
        quads = (n // 4, (rt.desc(shape4), *[rt.desc(shape4, st) for st in strides4]))
    return out_shape, plain, quads


def binary(entry: str, a, b, out_dtype, error: str | None = None):
    """Launch elementwise.cu's broadcasting binary kernel ``entry``; ``error``: message if the flag is set.

    Where the innermost (merged) dim is a multiple of 4 and every operand is contiguous or
    broadcast along it, 4-byte types run in quads (16-byte loads and stores).
    """
    from gradgen.cuda import runtime as rt

    a, b = contiguous(a), contiguous(b)
    four = all(np.dtype(t).itemsize == 4 for t in (a.dtype, b.dtype, out_dtype))
    out_shape, plain, quads = _binary_plan(tuple(int(d) for d in a.shape), tuple(int(d) for d in b.shape), four)
    out = rt.empty(out_shape, out_dtype)
    if out.size == 0:
        return out
    vec = quads is not None and all(int(t.gpudata) % 16 == 0 for t in (a, b, out))
    n, descs = quads if vec else plain
    flag = rt.zeros((1,), np.int64) if error else None
    launch(
        kernel_of("elementwise", entry),
        n,
        out,
        a,
        b,
        flag if flag is not None else _null(),
        *descs,
        np.int64(n),
        np.int64(1 if vec else 0),
    )
    if flag is not None:
        rt.check_flag(flag, lambda _v: error)
    return out


def _register_binary(op_type: str, name: str, suffixes, out_dtype=None, one_type: bool = True):
    """Register ``op_type`` as kernel ``name`` for operands of one dtype whose suffix is in
    ``suffixes`` (others run the CPU kernel); ``out_dtype``: None for the operands' dtype;
    ``one_type``: the op takes ONNX's single type T, so mixed dtypes are refused."""

    def launcher(a, b):
        if one_type:
            same_type(a, b)
        s = dtype_suffix(a.dtype)
        if s not in suffixes or dtype_suffix(b.dtype) != s:
            return cpu_fallback(op_type, a, b)
        return binary(f"{name}_{s}", a, b, a.dtype if out_dtype is None else out_dtype)

    launcher.__name__ = name
    launcher.__qualname__ = name
    cuda_kernel(op_type)(launcher)
    return launcher


add = _register_binary("Add", "add", NUMBERS)
sub = _register_binary("Sub", "sub", NUMBERS)
mul = _register_binary("Mul", "mul", NUMBERS)


@cuda_kernel("Div")
def div(a, b):
    same_type(a, b)
    s = dtype_suffix(a.dtype)
    if s not in NUMBERS:
        return cpu_fallback("Div", a, b)
    return binary(f"div_{s}", a, b, a.dtype, error="integer division by zero" if s[0] == "i" else None)


@cuda_kernel("Mod")
def mod(a, b, *, fmod=0):
    same_type(a, b)
    s = dtype_suffix(a.dtype)
    if s not in NUMBERS:
        return cpu_fallback("Mod", a, b, fmod=fmod)
    name = "fmod" if fmod else "mod"
    return binary(f"{name}_{s}", a, b, a.dtype, error="integer modulo by zero" if s[0] == "i" else None)


@cuda_kernel("Pow")
def pow_(x, y):
    sx, sy = dtype_suffix(x.dtype), dtype_suffix(y.dtype)
    ok = (sx in FLOATS and sy in NUMBERS) or (sx in ("i32", "i64") and sy in ("i32", "i64"))
    if not ok:
        return cpu_fallback("Pow", x, y)
    return binary(f"pow_{sx}_{sy}", x, y, x.dtype)


_COMPARABLE = NUMBERS + ("b8",)
equal = _register_binary("Equal", "equal", _COMPARABLE, np.bool_)
less = _register_binary("Less", "less", _COMPARABLE, np.bool_)
less_or_equal = _register_binary("LessOrEqual", "less_equal", _COMPARABLE, np.bool_)
greater = _register_binary("Greater", "greater", _COMPARABLE, np.bool_)
greater_or_equal = _register_binary("GreaterOrEqual", "greater_equal", _COMPARABLE, np.bool_)

# logic: the kernels take bool operands (other dtypes run the CPU kernel)
and_ = _register_binary("And", "and", ("b8",), np.bool_, one_type=False)
or_ = _register_binary("Or", "or", ("b8",), np.bool_, one_type=False)
xor = _register_binary("Xor", "xor", ("b8",), np.bool_, one_type=False)


# -- Where ----------------------------------------------------------------------------------------


@cuda_kernel("Where")
def where(condition, x, y):
    from gradgen.cuda import runtime as rt

    if condition.dtype != np.bool_:
        raise KernelError(f"condition must be bool, got {condition.dtype}")
    same_type(x, y)
    out_shape = broadcast_shape(condition.shape, x.shape, y.shape)
    condition, x, y = (contiguous(t) for t in (condition, x, y))
    out = rt.empty(out_shape, x.dtype)
    if out.size == 0:
        return out
    size = np.dtype(x.dtype).itemsize
    if size not in (1, 2, 4, 8):
        return cpu_fallback("Where", condition, x, y)
    shape, (cv, xv, yv) = broadcast_descs(out_shape, condition.shape, x.shape, y.shape)
    launch(kernel_of("elementwise", f"where_{size}"), out.size, out, condition, x, y, shape, cv, xv, yv, np.int64(out.size))
    return out


# -- variadic -------------------------------------------------------------------------------------


def _variadic(op: str, binary_op: str, op_type: str, xs):
    from gradgen.cuda import runtime as rt

    xs = [x for x in xs if x is not None]
    if not xs:
        raise KernelError(f"{op_type} needs at least one input")
    same_type(*xs)
    s = dtype_suffix(xs[0].dtype)
    if s not in NUMBERS:
        return cpu_fallback(op_type, *xs)
    out_shape = broadcast_shape(*[x.shape for x in xs])
    if len(xs) == 1:
        return copy(xs[0])
    if any(tuple(x.shape) != out_shape for x in xs):
        out = xs[0]
        for x in xs[1:]:  # left to right, like the CPU kernel
            out = binary(f"{binary_op}_{s}", out, x, out.dtype)
        return out
    xs = [contiguous(x) for x in xs]
    out = rt.empty(out_shape, xs[0].dtype)
    if out.size == 0:
        return out
    # 16-byte words where every operand allows (4-byte types, aligned, a multiple of 4 elements)
    quads = s in ("f32", "i32") and out.size % 4 == 0 and all(int(t.gpudata) % 16 == 0 for t in (out, *xs))
    kernel = kernel_of("elementwise", f"{op}_n_{s}_q" if quads else f"{op}_n_{s}")
    first, rest = xs[0], xs[1:]
    while True:
        chunk, rest = rest[:7], rest[7:]
        ptrs = [first] + chunk + [_null()] * (7 - len(chunk))
        launch(kernel, out.size // 4 if quads else out.size, out, *ptrs, np.int64(1 + len(chunk)), np.int64(out.size))
        if not rest:
            return out
        first = out  # in place: each element reads its own inputs before writing


@cuda_kernel("Sum")
def sum_(*xs):
    return _variadic("sum", "add", "Sum", xs)


@cuda_kernel("Max")
def max_(*xs):
    return _variadic("max", "max", "Max", xs)


@cuda_kernel("Min")
def min_(*xs):
    return _variadic("min", "min", "Min", xs)


# -- unary ----------------------------------------------------------------------------------------


def unary(entry: str, x, out_dtype=None, alpha: float = 0.0, beta: float = 0.0):
    from gradgen.cuda import runtime as rt

    x = contiguous(x)
    out = rt.empty(x.shape, out_dtype if out_dtype is not None else x.dtype)
    launch(kernel_of("elementwise", entry), out.size, out, x, np.float64(alpha), np.float64(beta), np.int64(out.size))
    return out


def _register_unary(op_type: str, name: str, suffixes=FLOATS, out_dtype=None, attrs=()):
    """Register ``op_type`` as kernel ``name``; ``attrs``: (attribute, default) pairs -> alpha, beta."""

    def launcher(x, **kwargs):
        s = dtype_suffix(x.dtype)
        if s not in suffixes:
            return cpu_fallback(op_type, x, **kwargs)
        values = [float(kwargs.get(attr, default)) for attr, default in attrs]
        return unary(f"{name}_{s}", x, out_dtype, *values)

    launcher.__name__ = name
    launcher.__qualname__ = name
    cuda_kernel(op_type)(launcher)
    return launcher


for _op, _name in (
    ("Sqrt", "sqrt"),
    ("Reciprocal", "reciprocal"),
    ("Exp", "exp"),
    ("Log", "log"),
    ("Tanh", "tanh"),
    ("Sigmoid", "sigmoid"),
    ("Softplus", "softplus"),
    ("Erf", "erf"),
    ("Floor", "floor"),
    ("Ceil", "ceil"),
    ("Round", "round"),
    ("Sin", "sin"),
    ("Cos", "cos"),
    ("Tan", "tan"),
    ("Asin", "asin"),
    ("Acos", "acos"),
    ("Atan", "atan"),
    ("Sinh", "sinh"),
    ("Cosh", "cosh"),
    ("Asinh", "asinh"),
    ("Acosh", "acosh"),
    ("Atanh", "atanh"),
    ("Softsign", "softsign"),
    ("HardSwish", "hard_swish"),
    ("Mish", "mish"),
):
    _register_unary(_op, _name)
for _op, _name in (("Neg", "neg"), ("Abs", "abs"), ("Sign", "sign"), ("Relu", "relu")):
    _register_unary(_op, _name, suffixes=NUMBERS)
_register_unary("LeakyRelu", "leaky_relu", attrs=(("alpha", 0.01),))
_register_unary("Elu", "elu", attrs=(("alpha", 1.0),))
_register_unary("Celu", "celu", attrs=(("alpha", 1.0),))
_register_unary("Selu", "selu", attrs=(("alpha", 1.67326319217681884765625), ("gamma", 1.05070102214813232421875)))
_register_unary("HardSigmoid", "hard_sigmoid", attrs=(("alpha", 0.2), ("beta", 0.5)))
_register_unary("ThresholdedRelu", "thresholded_relu", attrs=(("alpha", 1.0),))
_register_unary("IsNaN", "isnan", out_dtype=np.bool_)
_register_unary("Not", "not", suffixes=("b8",))


# -- the unary table (kernels/cpu/elementwise.py): each op's kernel generated from its CUDA expression

TABLE_MODULE = "elementwise_table"
_TABLE_TYPES = (("f16", "__half"), ("bf16", "__nv_bfloat16"), ("f32", "float"), ("f64", "double"))


@functools.lru_cache(maxsize=1)
def table_source() -> str:
    """The CUDA source of the unary table: one kernel ``<name>_<f16|bf16|f32|f64>(out, in, <attrs as
    double>..., n)`` per op and float type, computing in float (double for float64)."""
    from gradgen.kernels.cpu.elementwise import UNARY_TABLE

    parts = ['#include "common.h"\n']
    for op in UNARY_TABLE.values():
        params = "".join(f"double {name}, " for name, _ in op.attrs)
        for s, T in _TABLE_TYPES:
            parts.append(
                f'extern "C" __global__ void {op.name}_{s}({T}* out, const {T}* in, {params}int64_t n) {{\n'
                f"    using C = typename Acc<{T}>::type;\n"
                f"    GG_GRID_STRIDE(i, n) {{\n"
                f"        const C x = gg_load(in + i);\n"
                f"        gg_store(out + i, (C)({op.cuda}));\n"
                f"    }}\n"
                f"}}\n"
            )
    return "\n".join(parts)


def generated_sources() -> dict[str, str]:
    """The CUDA sources this family generates at run time (module name -> text), for the compile test."""
    return {TABLE_MODULE: table_source()}


@functools.lru_cache(maxsize=None)
def _table_kernel(entry: str):
    return generated_module(TABLE_MODULE, table_source()).get_function(entry)


def _register_table_op(op) -> None:
    def launcher(x, **attrs):
        s = dtype_suffix(x.dtype)
        if s not in FLOATS:
            return cpu_fallback(op.op_type, x, **attrs)
        out = runtime().empty(x.shape, x.dtype)
        values = [np.float64(attrs.get(name, default)) for name, default in op.attrs]
        launch(_table_kernel(f"{op.name}_{s}"), out.size, out, contiguous(x), *values, np.int64(out.size))
        return out

    launcher.__name__ = launcher.__qualname__ = op.name
    cuda_kernel(op.op_type)(launcher)


def _register_table() -> None:
    from gradgen.kernels.cpu.elementwise import UNARY_TABLE

    for op in UNARY_TABLE.values():
        _register_table_op(op)


_register_table()


@cuda_kernel("Gelu")
def gelu(x, *, approximate="none"):
    if approximate not in ("none", "tanh"):
        raise KernelError(f"unknown approximate={approximate!r}; expected 'none' or 'tanh'")
    s = dtype_suffix(x.dtype)
    if s not in FLOATS:
        return cpu_fallback("Gelu", x, approximate=approximate)
    return unary(f"{'gelu_tanh' if approximate == 'tanh' else 'gelu'}_{s}", x)


@cuda_kernel("Gelu", domain=MICROSOFT)
def ms_gelu(X):
    """ONNX Runtime's Gelu: the exact (erf) one."""
    return gelu(X)


@cuda_kernel("FastGelu", domain=MICROSOFT)
def fast_gelu(X, bias=None):
    """ONNX Runtime's FastGelu: the tanh Gelu of X (+ bias along the last axis)."""
    if bias is not None:
        if len(bias.shape) != 1 or not X.shape or X.shape[-1] != bias.shape[0]:
            raise KernelError(
                f"FastGelu: bias (shape {list(bias.shape)}) must be 1-D and match the last dimension of X {list(X.shape)}"
            )
        X = add(X, bias)
    return gelu(X, approximate="tanh")


def _activation_grad(name: str, op_type: str, dY, X):
    same_type(dY, X)
    if tuple(dY.shape) != tuple(X.shape):
        raise KernelError(f"{op_type}: dY {list(dY.shape)} and X {list(X.shape)} must have one shape")
    s = dtype_suffix(X.dtype)
    if s not in FLOATS:
        return cpu_fallback(op_type, dY, X, domain=MICROSOFT)
    return binary(f"{name}_{s}", dY, X, X.dtype)


@cuda_kernel("GeluGrad", domain=MICROSOFT)
def gelu_grad(dY, X):
    """dY Gelu'(X), the exact Gelu (ONNX Runtime training's GeluGrad)."""
    return _activation_grad("gelu_grad", "GeluGrad", dY, X)


@cuda_kernel("FastGeluGrad", domain=MICROSOFT)
def fast_gelu_grad(dY, X):
    """dY Gelu'(X), the tanh Gelu (ONNX Runtime training's FastGeluGrad)."""
    return _activation_grad("gelu_tanh_grad", "FastGeluGrad", dY, X)


@cuda_kernel("ReluGrad", domain=MICROSOFT)
def relu_grad(dY, X):
    """dY where X > 0, else 0 (ONNX Runtime training's ReluGrad; X may be Relu's output)."""
    return _activation_grad("relu_grad", "ReluGrad", dY, X)


@cuda_kernel("Identity")
def identity(x):
    return copy(x)


@cuda_kernel("Clip")
def clip(x, lo=None, hi=None, **attrs):
    from gradgen.cuda import runtime as rt

    lo = attrs.get("min", lo) if lo is None else lo
    hi = attrs.get("max", hi) if hi is None else hi
    for bound, name in ((lo, "min"), (hi, "max")):
        if bound is not None and int(np.prod(np.shape(bound), dtype=np.int64)) != 1:
            raise KernelError(f"{name} must be a scalar, got shape {list(np.shape(bound))}")
    s = dtype_suffix(x.dtype)
    if s not in NUMBERS:
        return cpu_fallback("Clip", x, lo, hi)

    def as_device(bound):
        if bound is None:
            return _null()
        if rt.is_device(bound):
            return bound if bound.dtype == x.dtype else cast_to(bound, x.dtype)
        return rt.to_device(np.asarray(bound, dtype=x.dtype).reshape(1))

    x = contiguous(x)
    out = rt.empty(x.shape, x.dtype)
    launch(kernel_of("elementwise", f"clip_{s}"), out.size, out, x, as_device(lo), as_device(hi), np.int64(out.size))
    return out


# -- Cast -----------------------------------------------------------------------------------------


def cast_to(x, dtype):
    """``x`` converted to ``dtype`` on the device (a copy when the dtype is the same)."""
    from gradgen.cuda import runtime as rt

    dtype = np.dtype(dtype)
    if np.dtype(x.dtype) == dtype:
        return copy(x)
    sa, sb = dtype_suffix(x.dtype), dtype_suffix(dtype)
    if sa not in CASTABLE or sb not in CASTABLE:
        return None
    x = contiguous(x)
    out = rt.empty(x.shape, dtype)
    launch(kernel_of("elementwise", f"cast_{sa}_{sb}"), out.size, out, x, np.int64(out.size))
    return out


@cuda_kernel("Cast")
def cast(x, *, to, saturate=1, round_mode="up"):
    out = cast_to(x, onnx_element_dtype(to))
    return out if out is not None else cpu_fallback("Cast", x, to=to, saturate=saturate, round_mode=round_mode)


@cuda_kernel("CastLike")
def cast_like(x, target, *, saturate=1, round_mode="up"):
    out = cast_to(x, target.dtype)
    return out if out is not None else cpu_fallback("CastLike", x, target, saturate=saturate, round_mode=round_mode)


@cuda_kernel("PRelu")
def prelu(x, slope):
    """where(x < 0, x * slope, x), slope broadcast to x."""
    from gradgen.cuda import runtime as rt

    try:
        np.broadcast_shapes(tuple(slope.shape), tuple(x.shape))
    except ValueError:
        raise KernelError(f"slope shape {list(slope.shape)} does not broadcast to X shape {list(x.shape)}") from None
    if x.dtype != slope.dtype:
        raise KernelError(f"input dtypes differ: {x.dtype} and {slope.dtype}")
    negative = less(x, rt.zeros((), x.dtype))
    return where(negative, mul(x, slope), x)


@cuda_kernel("Dropout", host_inputs=(1, 2))
def dropout(data, ratio=None, training_mode=None, *, seed=None, is_test=None, _num_outputs=1, **attrs):
    """Inference mode: the input itself (and an all-true mask); training mode draws the CPU kernel's
    mask on the host (the same mask as on the CPU for a given seed)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu import elementwise as cpu
    from gradgen.kernels.cuda.launch import fill

    if cpu.dropout_ratio(ratio, training_mode, is_test, attrs):
        return rt.run_on_host(
            cpu.dropout, data, ratio, training_mode, seed=seed, is_test=is_test, _num_outputs=_num_outputs, **attrs
        )
    if _num_outputs >= 2:
        mask = rt.empty(data.shape, np.bool_)
        fill(mask, True)
        return data, mask
    return data


# ---------------------------------------------------------------- random generators
#
# Drawn on the host by the CPU kernels (numpy's PCG64) and uploaded, as training-mode Dropout's
# mask is, so that a GPU session draws the same numbers as a CPU one for a given seed. The Like
# ops read only their input's shape and type (no download); Bernoulli and Multinomial read its
# values; RandomNormal and RandomUniform have no inputs. An upload cannot be recorded, so a run
# holding one of them stays on the eager path.


def _register_host_drawn(op_type: str, reads_values: bool = False) -> None:
    from gradgen.kernels.cpu import elementwise as cpu

    cpu_fn = getattr(cpu, _HOST_DRAWN[op_type])

    def launcher(*args, **attrs):
        from gradgen.cuda import runtime as rt

        if not reads_values:  # a zero-strided stand-in of the input's shape and type
            args = tuple(np.broadcast_to(np.zeros((), a.dtype), tuple(a.shape)) for a in args)
        return rt.run_on_host(cpu_fn, *args, **attrs)

    launcher.__name__ = launcher.__qualname__ = _HOST_DRAWN[op_type]
    cuda_kernel(op_type)(launcher)


_HOST_DRAWN = {
    "RandomNormal": "random_normal",
    "RandomUniform": "random_uniform",
    "RandomNormalLike": "random_normal_like",
    "RandomUniformLike": "random_uniform_like",
    "Bernoulli": "bernoulli",
    "Multinomial": "multinomial",
}
for _op in _HOST_DRAWN:
    _register_host_drawn(_op, reads_values=_op in ("Bernoulli", "Multinomial"))


# ---------------------------------------------------------------- BroadcastGradientArgs


@cuda_kernel("BroadcastGradientArgs", domain=MICROSOFT, host_inputs=(0, 1))
def broadcast_gradient_args(a_shape, b_shape):
    """The axes are host data computed from host shapes: the CPU kernel's result, as is."""
    from gradgen.kernels.cpu.elementwise import broadcast_gradient_args as cpu_broadcast_gradient_args

    return cpu_broadcast_gradient_args(a_shape, b_shape)


# ---------------------------------------------------------------- ops composed of the launchers above


def device_scalar(value, dtype):
    """A 0-d device array holding ``value`` cast to ``dtype`` (a fill: no upload, so capturable)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.launch import fill

    out = rt.empty((), dtype)
    fill(out, value)
    return out


def in_float32(fn, *xs):
    """``fn(*xs)`` computed as the CPU backend computes a 16-bit float op (gradgen/executor/
    low_precision.py): on float32 copies, the result rounded once to the inputs' type. Other float
    types run as they are."""
    dtype = np.dtype(xs[0].dtype)
    if dtype.itemsize != 2:
        return fn(*xs)
    out = fn(*[cast_to(x, np.float32) for x in xs])
    return cast_to(out, dtype)


def widened(x):
    """``x`` as the CPU backend hands it to a numpy kernel (gradgen/executor/low_precision.py): a
    16-bit float as a float32 copy, anything else as it is."""
    return cast_to(x, np.float32) if dtype_suffix(x.dtype) in ("f16", "bf16") else x


@cuda_kernel("Swish")
def swish(x, *, alpha=1.0):
    """x * sigmoid(alpha * x) (opset 24), in the CPU kernel's order (float32 for 16-bit x)."""
    if dtype_suffix(x.dtype) not in FLOATS:
        return cpu_fallback("Swish", x, alpha=alpha)

    def run(xc):
        s = dtype_suffix(xc.dtype)
        scaled = binary(f"mul_{s}", xc, device_scalar(alpha, xc.dtype), xc.dtype)
        return binary(f"mul_{s}", xc, unary(f"sigmoid_{s}", scaled), xc.dtype)

    return in_float32(run, x)


@cuda_kernel("DynamicQuantizeLinear")
def dynamic_quantize_linear(x):
    """(y, y_scale, y_zero_point): x quantized to uint8 over [min(0, min x), max(0, max x)] as the
    CPU kernel computes it: the reduction launchers' min and max, then its scalar arithmetic on the
    device (rint: half to even). A scale that is not finite (an infinity in x) raises the CPU
    kernel's error, read from a device flag."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.reduction import reduce

    xw = widened(x)
    if xw.dtype != np.float32:
        return cpu_fallback("DynamicQuantizeLinear", x)  # the CPU kernel's error
    zero, one = device_scalar(0, np.float32), device_scalar(1, np.float32)
    low = high = zero
    if xw.size:
        axes = tuple(range(len(xw.shape)))
        least, most = reduce("min", xw, axes, False, "ReduceMin"), reduce("max", xw, axes, False, "ReduceMax")
        # Python's min(0, m) and max(0, m): m only where it is below (above) 0, so a NaN gives 0
        low, high = where(less(least, zero), least, zero), where(greater(most, zero), most, zero)
    scale = where(equal(high, low), one, div(sub(high, low), device_scalar(255, np.float32)))
    not_finite = unary("isnan_f32", sub(scale, scale), np.bool_)  # inf - inf and NaN - NaN are NaN
    rt.check_flag(not_finite, lambda _value: "DynamicQuantizeLinear: the input holds a NaN or an infinity")
    top = device_scalar(255, np.float32)
    zero_point = clip(unary("round_f32", div(unary("neg_f32", low), scale)), zero, top)
    y = clip(add(unary("round_f32", div(xw, scale)), zero_point), zero, top)
    return cast_to(y, np.uint8), scale, cast_to(zero_point, np.uint8)


@cuda_kernel("RotaryEmbedding")
def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0):
    """Rotates the first rotary_embedding_dim features of each head (opset 23), as the CPU kernel:
    the caches' rows gathered at position_ids (ids out of range raise its error, read from a device
    flag), viewed to broadcast over the heads; the pairs' halves sliced out, rotated with the mul /
    add launchers (cos x1 - sin x2, sin x1 + cos x2) and copied back in place of X's features
    (float32 for 16-bit X, rounded once)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu.elementwise import rotary_geometry, rotary_pairs
    from gradgen.kernels.cuda.indexing import gather
    from gradgen.kernels.cuda.launch import strided_copy
    from gradgen.kernels.cuda.shape import reshaped, slice_

    attrs = dict(interleaved=interleaved, num_heads=num_heads, rotary_embedding_dim=rotary_embedding_dim)
    ids_shape = None if position_ids is None else tuple(position_ids.shape)
    geometry = rotary_geometry(x.shape, cos_cache.shape, sin_cache.shape, ids_shape, int(num_heads), int(rotary_embedding_dim))
    batch, seq, heads, head_size, dim = geometry
    if any(dtype_suffix(t.dtype) not in FLOATS for t in (x, cos_cache, sin_cache)) or (
        position_ids is not None and dtype_suffix(position_ids.dtype) not in ("i32", "i64")
    ):
        return cpu_fallback("RotaryEmbedding", x, cos_cache, sin_cache, position_ids, **attrs)
    cos, sin = cos_cache, sin_cache
    if position_ids is not None:
        if position_ids.size:
            _check_position_ids(position_ids, int(cos_cache.shape[0]), int(sin_cache.shape[0]))
        cos, sin = gather(cos_cache, position_ids, axis=0), gather(sin_cache, position_ids, axis=0)
    xc = widened(x)
    compute = xc.dtype
    four_d = len(x.shape) == 4
    heads_view = xc if four_d else reshaped(xc, (batch, seq, heads, head_size))
    angles = (batch, 1, seq, dim // 2) if four_d else (batch, seq, 1, dim // 2)
    cos, sin = (reshaped(t if t.dtype == compute else cast_to(t, compute), angles) for t in (cos, sin))
    first, second = rotary_pairs(dim, int(interleaved))

    def features(part: slice):
        axis, step = np.array([-1]), np.array([part.step or 1])
        return slice_(heads_view, np.array([part.start]), np.array([part.stop]), axis, step)

    x1, x2 = features(first), features(second)
    rotated = ((first, sub(mul(cos, x1), mul(sin, x2))), (second, add(mul(sin, x1), mul(cos, x2))))
    out = copy(heads_view) if dim < head_size else rt.empty(heads_view.shape, compute)
    strides = rt.contiguous_strides(out.shape)
    for part, values in rotated:
        along = strides[:-1] + [strides[-1] * (part.step or 1)]
        strided_copy(out, along, part.start, values, rt.contiguous_strides(values.shape), 0, values.shape)
    out = reshaped(out, x.shape)
    return out if out.dtype == x.dtype else cast_to(out, x.dtype)


def _check_position_ids(ids, cos_rows: int, sin_rows: int) -> None:
    """RotaryEmbedding's CPU error for an id outside a cache's rows (negative ones too, which
    Gather would take from the end), from a device flag: the ids' min and max against the rows."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cpu.elementwise import check_position_ids
    from gradgen.kernels.cuda.reduction import reduce

    axes = tuple(range(len(ids.shape)))
    least, most = reduce("min", ids, axes, False, "ReduceMin"), reduce("max", ids, axes, False, "ReduceMax")
    below = less(least, device_scalar(0, ids.dtype))
    bad = or_(below, greater_or_equal(most, device_scalar(min(cos_rows, sin_rows), ids.dtype)))

    def message(_value):
        check_position_ids(rt.to_host(ids), cos_rows, sin_rows)  # raises the CPU kernel's error
        return "a position id is out of range for the caches' rows"

    rt.check_flag(bad, message)


@cuda_kernel("Mean")
def mean(*xs):
    """The inputs' sum (left to right, broadcast) divided by their count, as the CPU kernel does."""
    xs = tuple(x for x in xs if x is not None)
    if not xs:
        raise KernelError("Mean needs at least one input")
    same_type(*xs)
    if dtype_suffix(xs[0].dtype) not in FLOATS:
        return cpu_fallback("Mean", *xs)

    def run(*ys):
        total = _variadic("sum", "add", "Mean", ys)
        if len(ys) == 1:
            return total
        return binary(f"div_{dtype_suffix(total.dtype)}", total, device_scalar(len(ys), total.dtype), total.dtype)

    return in_float32(run, *xs)


def _same_shape(a, b, a_name: str, b_name: str) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise KernelError(f"{a_name} has shape {list(a.shape)} but {b_name} has shape {list(b.shape)}; they must match")


def _output_grad(op_type: str, dY, Y, slope):
    """dY * slope(Y) for the com.microsoft gradients of an activation given its output Y."""
    _same_shape(dY, Y, "dY", "Y")
    same_type(dY, Y)
    if dtype_suffix(Y.dtype) not in FLOATS:
        return cpu_fallback(op_type, dY, Y, domain=MICROSOFT)
    return in_float32(slope, dY, Y)


@cuda_kernel("SigmoidGrad", domain=MICROSOFT)
def sigmoid_grad(dY, Y):
    """dX = dY * Y * (1 - Y), from Sigmoid's output Y (the CPU kernel's order of operations)."""

    def slope(dy, y):
        one = device_scalar(1, y.dtype)
        return mul(mul(dy, y), sub(one, y))

    return _output_grad("SigmoidGrad", dY, Y, slope)


@cuda_kernel("TanhGrad", domain=MICROSOFT)
def tanh_grad(dY, Y):
    """dX = dY * (1 - Y * Y), from Tanh's output Y (the CPU kernel's order of operations)."""

    def slope(dy, y):
        one = device_scalar(1, y.dtype)
        return mul(dy, sub(one, mul(y, y)))

    return _output_grad("TanhGrad", dY, Y, slope)


def _bias_gelu_grad(op_type: str, grad, dY, X, B):
    _same_shape(dY, X, "dY", "X")
    if len(B.shape) != 1 or not X.shape or X.shape[-1] != B.shape[0]:
        raise KernelError(f"B (shape {list(B.shape)}) must be 1-D and match the last dimension of X {list(X.shape)}")
    same_type(dY, X, B)
    if dtype_suffix(X.dtype) not in FLOATS:
        return cpu_fallback(op_type, dY, X, B, domain=MICROSOFT)
    return in_float32(lambda dy, x, b: grad(dy, add(x, b)), dY, X, B)


@cuda_kernel("BiasGeluGrad_dX", domain=MICROSOFT)
def bias_gelu_grad_dx(dY, X, B):
    """GeluGrad(dY, X + B), B along the last axis."""
    return _bias_gelu_grad("BiasGeluGrad_dX", gelu_grad, dY, X, B)


@cuda_kernel("BiasFastGeluGrad_dX", domain=MICROSOFT)
def bias_fast_gelu_grad_dx(dY, X, B):
    """FastGeluGrad(dY, X + B), B along the last axis."""
    return _bias_gelu_grad("BiasFastGeluGrad_dX", fast_gelu_grad, dY, X, B)


@cuda_kernel("Scale", domain=MICROSOFT, host_inputs=(1,))
def scale(input, scale_value, *, scale_down=0):
    """input * scale, or input * (1 / float32(scale)) with scale_down=1: the CPU kernel's factor."""
    from gradgen.kernels.cpu.elementwise import scale_factor

    factor = scale_factor(scale_value, scale_down)
    if dtype_suffix(input.dtype) not in FLOATS:
        return cpu_fallback("Scale", input, np.asarray(scale_value), domain=MICROSOFT, scale_down=scale_down)

    def run(x):
        return mul(x, device_scalar(x.dtype.type(factor), x.dtype))

    return in_float32(run, input)


@cuda_kernel("IsInf")
def is_inf(x, *, detect_negative=1, detect_positive=1):
    """x == +inf and / or x == -inf (as the two detect flags ask), from the equal and or launchers;
    an integer x (never infinite) runs the CPU kernel."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.launch import fill

    if dtype_suffix(x.dtype) not in FLOATS:
        return cpu_fallback("IsInf", x, detect_negative=detect_negative, detect_positive=detect_positive)
    wanted = [value for value, on in ((np.inf, detect_positive), (-np.inf, detect_negative)) if int(on)]
    tests = [equal(x, device_scalar(value, x.dtype)) for value in wanted]
    if not tests:
        out = rt.empty(tuple(x.shape), np.bool_)
        fill(out, False)
        return out
    return tests[0] if len(tests) == 1 else or_(*tests)


def on_off_values(dtype):
    """A device array [0, 1] of ``dtype`` (OneHot's off / on values), made by fills (capturable)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.launch import fill

    values = rt.empty((2,), dtype)
    fill(values, 1)
    fill(values[:1], 0)
    return values
