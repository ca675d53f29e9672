"""CPU kernels: elementwise math with numpy broadcasting (which is ONNX's multidirectional one).

Every kernel returns the dtype ONNX specifies. Attribute values arrive as Python scalars, which
numpy 2 treats as "weak", so ``alpha * x`` keeps a float32 ``x`` float32; where a computation has
to go through another dtype (integer Div, Pow, Erf) the result is cast back explicitly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.cpu import onednn_eltwise
from gradgen.kernels.numeric import accumulation_dtype, broadcasts_to, float_compute_dtype, same_shape
from gradgen.kernels.table import MICROSOFT, cpu_into, cpu_kernel
from gradgen.ops import schemas
from gradgen.ops.axes import int_list
from gradgen.ops.elementwise import TANH_GELU_CUBIC, TANH_GELU_SCALE, broadcast_gradient_axes
from gradgen.ops.schemas import DT, FLOATS, INT64, Attribute, Formal, Schema

# ONNX TensorProto.DataType -> numpy dtype, for the types gradgen supports.
ONNX_TO_NUMPY = {
    1: np.dtype(np.float32),
    2: np.dtype(np.uint8),
    3: np.dtype(np.int8),
    4: np.dtype(np.uint16),
    5: np.dtype(np.int16),
    6: np.dtype(np.int32),
    7: np.dtype(np.int64),
    9: np.dtype(np.bool_),
    10: np.dtype(np.float16),
    11: np.dtype(np.float64),
    12: np.dtype(np.uint32),
    13: np.dtype(np.uint64),
}
_UNSUPPORTED_TYPE_NAMES = {
    0: "UNDEFINED",
    8: "STRING",
    14: "COMPLEX64",
    15: "COMPLEX128",
    16: "BFLOAT16",
    17: "FLOAT8E4M3FN",
    18: "FLOAT8E4M3FNUZ",
    19: "FLOAT8E5M2",
    20: "FLOAT8E5M2FNUZ",
    21: "UINT4",
    22: "INT4",
    23: "FLOAT4E2M1",
    24: "FLOAT8E8M0",
    25: "UINT2",
    26: "INT2",
}


def onnx_dtype(to: int) -> np.dtype:
    """The numpy dtype of an ONNX element type code; KernelError for types gradgen lacks."""
    try:
        return ONNX_TO_NUMPY[int(to)]
    except KeyError:
        name = _UNSUPPORTED_TYPE_NAMES.get(int(to), f"code {int(to)}")
        raise KernelError(f"element type {name} is not supported by gradgen's CPU kernels") from None


def _float_like(x: np.ndarray) -> np.ndarray:
    """x itself when it is floating point, else x as float64 (for integer inputs of float math)."""
    return x if x.dtype.kind == "f" else x.astype(np.float64)


def _same_type(*xs: np.ndarray) -> None:
    """ONNX's binary and variadic ops take one type T; numpy would silently promote mixes."""
    first = xs[0].dtype
    for x in xs:
        if x.dtype is not first and x.dtype != first:  # numpy's built-in dtypes are singletons
            break
    else:
        return
    raise KernelError(f"inputs have different dtypes ({', '.join(str(x.dtype) for x in xs)}); this op needs one type")


def _unary(fn):
    """Wrap a numpy float function so that the result keeps the input dtype."""

    def kernel(x):
        return fn(x).astype(x.dtype, copy=False)

    return kernel


def _as_is(fn):
    """A one-input kernel that is numpy's ``fn`` itself: its result has the type ONNX specifies."""

    def kernel(x):
        return fn(x)

    return kernel


def _binary(fn, *, one_type: bool = True):
    """A two-input kernel that is numpy's ``fn`` with broadcasting; ``one_type``: the op takes
    ONNX's single type T, so mixed dtypes are refused rather than promoted."""

    def kernel(a, b):
        if one_type and a.dtype is not b.dtype:
            _same_type(a, b)
        return fn(a, b)

    return kernel


# ---------------------------------------------------------------------------------------------
# arithmetic


for _op, _fn in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply)):
    cpu_kernel(_op)(_binary(_fn))


@cpu_kernel("Div")
def div(a, b):
    _same_type(a, b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        if np.any(b == 0):
            raise KernelError("integer division by zero")
        # C semantics: the quotient is truncated toward zero (numpy's // floors).
        q = np.floor_divide(a, b)
        if a.dtype.kind == "i" or b.dtype.kind == "i":
            fix = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
            q = q + fix.astype(q.dtype)
        return q.astype(np.result_type(a, b), copy=False)
    return a / b


@cpu_kernel("Mod")
def mod(a, b, *, fmod=0):
    _same_type(a, b)
    if a.dtype.kind in "iu" and b.dtype.kind in "iu" and np.any(b == 0):
        raise KernelError("integer modulo by zero")
    if fmod:
        return np.fmod(a, b)  # the result takes the sign of the dividend, like C's fmod
    # fmod=0: the result takes the sign of the divisor, like Python's % (opset 28 spells out the
    # float special cases, which are numpy's: inf % y and x % 0 give NaN).
    return np.mod(a, b)


@cpu_kernel("Pow")
def pow_(x, y):
    if x.dtype.kind in "iu" and y.dtype.kind in "iu" and not np.any(y < 0):
        return np.power(x, y.astype(x.dtype, copy=False)).astype(x.dtype, copy=False)
    if x.dtype.kind == "f" and y.dtype.kind != "f":
        return np.power(x, y.astype(x.dtype)).astype(x.dtype, copy=False)
    if x.dtype.kind == "f" and y.dtype.kind == "f" and x.dtype.itemsize >= y.dtype.itemsize:
        return np.power(x, y.astype(x.dtype, copy=False))
    # The output has the base's dtype whatever the exponent's.
    return np.power(x.astype(np.float64), y.astype(np.float64)).astype(x.dtype)


for _op, _fn in (
    ("Neg", np.negative),
    ("Abs", np.abs),
    ("Reciprocal", np.reciprocal),
    ("Sign", np.sign),
    ("Floor", np.floor),
    ("Ceil", np.ceil),
    ("Round", np.round),  # round half to even, like the spec
):
    cpu_kernel(_op)(_as_is(_fn))


def _variadic(fn, name):
    def kernel(*xs):
        xs = [x for x in xs if x is not None]
        if not xs:
            raise KernelError(f"{name} needs at least one input")
        _same_type(*xs)
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return np.array(out, copy=True) if len(xs) == 1 else out

    return kernel


cpu_kernel("Max")(_variadic(np.maximum, "Max"))
cpu_kernel("Min")(_variadic(np.minimum, "Min"))
cpu_kernel("Sum")(_variadic(np.add, "Sum"))


# ---------------------------------------------------------------------------------------------
# in place: the same ufunc calls with ``out=`` an input that dies at the step (see ``cpu_into``)


def fits_in(out: np.ndarray, *xs: np.ndarray) -> bool:
    """``out`` can take the result of an elementwise op of ``xs`` (one of which it is), as the
    kernel would make it: every input has out's dtype and broadcasts to out's shape, and each
    input of out's whole shape is C-contiguous (so the fresh result would be C-contiguous too)."""
    target = out.shape
    for x in xs:
        if x.dtype != out.dtype:
            return False
        if x.shape == target:
            if not x.flags.c_contiguous:
                return False
        elif not broadcasts_to(x.shape, target):
            return False
    return True


def _binary_into(fn):
    def into(position, a, b):
        out = (a, b)[position]
        return fn(a, b, out=out) if fits_in(out, a, b) else None

    return into


def _variadic_into(fn):
    """The kernel's left-to-right fold, each partial result written over the first or second input
    (a later input cannot take it: the first partial result would overwrite it before it is read)."""

    def into(position, *xs):
        if position > 1 or len(xs) < 2 or any(x is None for x in xs):
            return None
        out = xs[position]
        if not fits_in(out, *xs):
            return None
        fn(xs[0], xs[1], out=out)
        for x in xs[2:]:
            fn(out, x, out=out)
        return out

    return into


for _op, _fn in (("Add", np.add), ("Sub", np.subtract), ("Mul", np.multiply)):
    cpu_into(_op)(_binary_into(_fn))
for _op, _fn in (("Max", np.maximum), ("Min", np.minimum), ("Sum", np.add)):
    cpu_into(_op)(_variadic_into(_fn))


@cpu_into("Div")
def div_into(position, a, b):
    if a.dtype.kind != "f":
        return None  # integer division takes the kernel's own path
    return _binary_into(np.true_divide)(position, a, b)


@cpu_kernel("Mean")
def mean(*xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        raise KernelError("Mean needs at least one input")
    _same_type(*xs)
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return (out / len(xs)).astype(xs[0].dtype, copy=False)


@cpu_kernel("Clip")
def clip(x, lo=None, hi=None, **attrs):
    # opset < 11: min/max attributes; opset >= 11: optional inputs.
    lo = attrs.get("min", lo) if lo is None else lo
    hi = attrs.get("max", hi) if hi is None else hi
    for bound, name in ((lo, "min"), (hi, "max")):
        if bound is not None and np.size(bound) != 1:
            raise KernelError(f"{name} must be a scalar, got shape {list(np.shape(bound))}")
    out = x
    if lo is not None:
        out = np.maximum(out, np.asarray(lo, dtype=x.dtype).reshape(()))
    if hi is not None:
        out = np.minimum(out, np.asarray(hi, dtype=x.dtype).reshape(()))
    return np.array(out, dtype=x.dtype, copy=True) if out is x else out


# ---------------------------------------------------------------------------------------------
# the unary table: one-input ops defined once for both devices


@dataclasses.dataclass(frozen=True)
class UnaryOp:
    """A one-input op defined once for the CPU and the GPU.

    ``numpy(x, **attrs)`` is its CPU kernel. ``cuda`` is a CUDA C expression in ``x`` (of type
    ``C``: float for float16 and float32 inputs, double for float64) and the float attributes by
    name; kernels/cuda/elementwise.py generates the GPU kernel from it (floats only; other dtypes run
    ``numpy``). ``attrs``: (attribute, ONNX default) pairs.
    """

    op_type: str
    name: str
    cuda: str
    attrs: tuple[tuple[str, float], ...]
    numpy: Callable


UNARY_TABLE: dict[str, UnaryOp] = {}


def unary_op(op_type: str, *, cuda: str, **attrs: float):
    """Register ``fn`` as the CPU kernel of ``op_type`` and add the op to the unary table, from which
    its CUDA kernel is generated; ``attrs`` are its float attributes with their defaults."""

    def register(fn):
        UNARY_TABLE[op_type] = UnaryOp(op_type, fn.__name__, cuda, tuple(attrs.items()), fn)
        return cpu_kernel(op_type)(fn)

    return register


@unary_op("Shrink", cuda="x < C(-lambd) ? x + C(bias) : (x > C(lambd) ? x - C(bias) : C(0))", bias=0.0, lambd=0.5)
def shrink(x, *, bias=0.0, lambd=0.5):
    """x + bias below -lambd, x - bias above lambd, 0 in between (in x's dtype)."""
    zero = np.zeros((), x.dtype)
    inner = select(x > lambd, np.asarray(x - bias, x.dtype), zero)
    return select(x < -lambd, np.asarray(x + bias, x.dtype), inner)


# ---------------------------------------------------------------------------------------------
# unary float math


for _op, _fn in (("Sqrt", np.sqrt), ("Log", np.log)):
    cpu_kernel(_op)(_as_is(_fn))


@cpu_kernel("Exp")
def exp(x):
    return onednn_eltwise.exp(x)


for _op, _fn in (
    ("Tanh", np.tanh),
    ("Sin", np.sin),
    ("Cos", np.cos),
    ("Tan", np.tan),
    ("Asin", np.arcsin),
    ("Acos", np.arccos),
    ("Atan", np.arctan),
    ("Sinh", np.sinh),
    ("Cosh", np.cosh),
    ("Asinh", np.arcsinh),
    ("Acosh", np.arccosh),
    ("Atanh", np.arctanh),
):
    cpu_kernel(_op)(_unary(_fn))


# the lowest input from which Sigmoid's four-pass form runs: exp(-x) below the dtype's largest
# finite value over e, so 1 + exp(-x) stays finite too (float32: about -87.7)
_SIGMOID_DIRECT_FROM = {np.dtype(t): -(math.log(float(np.finfo(t).max)) - 1) for t in (np.float32, np.float64)}


@cpu_kernel("Sigmoid")
def sigmoid(x):
    fast = onednn_eltwise.apply("logistic", x)
    if fast is not None:
        return fast
    if x.dtype in _SIGMOID_DIRECT_FROM and x.size and np.minimum.reduce(x, axis=None) >= _SIGMOID_DIRECT_FROM[x.dtype]:
        # 1 / (1 + exp(-x)) in four passes, in place: exp(-x) stays finite from this bound on (a
        # NaN fails the test). Within 3.4 ulp of the float64 truth on a dense float32 sweep (the
        # eight-pass form below: 3.2), at about half its time.
        e = np.negative(x, out=np.empty_like(x))  # an array also for a 0-d x
        np.exp(e, out=e)
        e += 1
        return np.reciprocal(e, out=e)
    # exp of a non-positive number only: no overflow warnings for large |x| (eight passes).
    e = np.exp(-np.abs(x))
    d = 1 + e
    return select(x >= 0, np.asarray(1 / d, x.dtype), np.asarray(e / d, x.dtype))


# elements per pass of erf's float64 formula (its 26 passes run over three reused buffers). Each
# numpy call costs about a microsecond, which the chunk's arithmetic has to dwarf: per element,
# 8.9 ns at 8,192, 7.0 at 32,768, 6.0 at 65,536 (a ViT's 33,280-element GELU; 2-core AVX2 EPYC)
ERF_CHUNK = 65536

# erf(x) = x P(x^2) / Q(x^2) on [-4, 4] (beyond, erf rounds to +-1 in float32): the rational fit
# XLA and Eigen use for float32 erf, highest power first. Evaluated in float64 it stays within
# 1.6 ulp of float32's rounding of math.erf (1.25e-7 relative), as CUDA's erff (2 ulp) does.
_ERF_NUMERATOR = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_DENOMINATOR = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)


def erf_array(x: np.ndarray) -> np.ndarray:
    """erf elementwise, in x's dtype: exact (math.erf) for float64, ~1e-7 relative otherwise.

    The float32 / float16 path evaluates its float64 formula (``_erf_chunk``) over chunks of
    ``ERF_CHUNK`` elements into buffers it reuses, so its passes run in the cache."""
    if x.dtype == np.float64 or x.dtype.kind != "f":
        return np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype, copy=False)
    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.size <= ERF_CHUNK:  # one chunk: no output to assemble (most calls, on small arrays)
        buffers = [np.empty(flat.size) for _ in range(3)]
        return _erf_chunk(flat, *buffers).astype(x.dtype).reshape(x.shape)
    out = np.empty(flat.shape, x.dtype)
    buffers = [np.empty(ERF_CHUNK) for _ in range(3)]
    for start in range(0, flat.size, ERF_CHUNK):
        stop = min(start + ERF_CHUNK, flat.size)
        out[start:stop] = _erf_chunk(flat[start:stop], *(b[: stop - start] for b in buffers))
    return out.reshape(x.shape)


def _erf_chunk(x: np.ndarray, z: np.ndarray, numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """erf of ``x`` in float64, in the other arguments (buffers of x's length): the rational fit on
    x clipped to [-4, 4] (NaN stays NaN, -0 stays -0; np.maximum and np.minimum are np.clip without
    its Python layers)."""
    np.minimum(np.maximum(x, -4.0, out=z), 4.0, out=z)
    squares = np.multiply(z, z, out=denominator)
    _horner(_ERF_NUMERATOR, squares, out=numerator)
    numerator *= z
    _horner(_ERF_DENOMINATOR, squares, out=z)  # the clipped x is spent
    return np.divide(numerator, z, out=numerator)


def _horner(coefficients: tuple[float, ...], t: np.ndarray, out: np.ndarray) -> np.ndarray:
    """sum_k coefficients[k] t^(K - 1 - k) into ``out`` (the highest power's coefficient first)."""
    np.multiply(t, coefficients[0], out=out)
    for coefficient in coefficients[1:-1]:
        out += coefficient
        out *= t
    out += coefficients[-1]
    return out


@cpu_kernel("Erf")
def erf(x):
    return erf_array(x)


@cpu_kernel("Relu")
def relu(x):
    return np.maximum(x, np.zeros((), dtype=x.dtype))


@cpu_into("Relu")
def relu_into(position, x):
    return np.maximum(x, np.zeros((), dtype=x.dtype), out=x)


@cpu_kernel("LeakyRelu")
def leaky_relu(x, *, alpha=0.01):
    return select(x < 0, np.asarray(x * alpha, x.dtype), x)


@cpu_kernel("PRelu")
def prelu(x, slope):
    try:
        np.broadcast_shapes(slope.shape, x.shape)
    except ValueError:
        raise KernelError(f"slope shape {list(slope.shape)} does not broadcast to X shape {list(x.shape)}") from None
    _same_type(x, slope)
    return select(x < 0, x * slope, x)


@cpu_kernel("Elu")
def elu(x, *, alpha=1.0):
    return select(x < 0, np.asarray(alpha * np.expm1(np.minimum(x, 0)), x.dtype), x)


@cpu_kernel("Selu")
def selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    neg_part = np.asarray(alpha * np.expm1(np.minimum(x, 0)), x.dtype)
    return np.asarray(gamma * select(x > 0, x, neg_part), x.dtype)


@cpu_kernel("Celu")
def celu(x, *, alpha=1.0):
    out = np.maximum(x, 0) + np.minimum(0, alpha * np.expm1(np.minimum(x, 0) / alpha))
    return out.astype(x.dtype, copy=False)


@cpu_kernel("Softplus")
def softplus(x):
    return np.logaddexp(np.zeros((), dtype=x.dtype), x)


@cpu_kernel("Softsign")
def softsign(x):
    return x / (1 + np.abs(x))


@cpu_kernel("HardSigmoid")
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    return np.clip(alpha * x + beta, 0, 1).astype(x.dtype, copy=False)


@cpu_kernel("HardSwish")
def hard_swish(x):
    return (x * np.clip(x / 6 + 0.5, 0, 1)).astype(x.dtype, copy=False)


@cpu_kernel("Mish")
def mish(x):
    return (x * np.tanh(np.logaddexp(np.zeros((), dtype=x.dtype), x))).astype(x.dtype, copy=False)


@cpu_kernel("Swish")
def swish(x, *, alpha=1.0):
    """x * sigmoid(alpha * x) (opset 24; SiLU at alpha 1)."""
    return (x * sigmoid(x * x.dtype.type(alpha))).astype(x.dtype, copy=False)


@cpu_kernel("ThresholdedRelu")
def thresholded_relu(x, *, alpha=1.0):
    return select(x > alpha, x, np.zeros((), x.dtype))


def _tanh_gelu_logit(x: np.ndarray) -> np.ndarray:
    """2 k (x + c x^3) (k, c: ``TANH_GELU_SCALE``, ``TANH_GELU_CUBIC``), a new array: the
    tanh-approximate GELU is x * sigmoid of it, since 0.5 (1 + tanh(u)) = sigmoid(2u). A sigmoid
    costs a fraction of numpy's tanh (oneDNN's logistic of (128, 3072) 0.28 ms, numpy's tanh 1.0 ms
    on an AVX2 EPYC), and the form does not cancel where tanh(u) nears -1."""
    logit = np.multiply(x, x, out=np.empty_like(x))  # an array also for a 0-d x (numpy gives a scalar)
    logit *= x.dtype.type(2 * TANH_GELU_SCALE * TANH_GELU_CUBIC)
    logit += x.dtype.type(2 * TANH_GELU_SCALE)
    logit *= x
    return logit


@cpu_kernel("Gelu")
def gelu(x, *, approximate="none"):
    if approximate == "tanh":
        xc = x.astype(float_compute_dtype(x.dtype), copy=False)
        half_one_plus_tanh = sigmoid(_tanh_gelu_logit(xc))
        return np.multiply(xc, half_one_plus_tanh, out=half_one_plus_tanh).astype(x.dtype, copy=False)
    if approximate != "none":
        raise KernelError(f"unknown approximate={approximate!r}; expected 'none' or 'tanh'")
    # 0.5 * x * (1 + erf(x / sqrt(2))), the sum and the product written into erf's fresh result
    one_plus_erf = erf_array(x / math.sqrt(2))
    one_plus_erf += 1
    return np.multiply(0.5 * x, one_plus_erf, out=one_plus_erf).astype(x.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# comparison and logic (all give bool)


for _op, _fn in (
    ("Equal", np.equal),
    ("Less", np.less),
    ("LessOrEqual", np.less_equal),
    ("Greater", np.greater),
    ("GreaterOrEqual", np.greater_equal),
):
    cpu_kernel(_op)(_binary(_fn))

for _op, _fn in (("And", np.logical_and), ("Or", np.logical_or), ("Xor", np.logical_xor)):
    cpu_kernel(_op)(_binary(_fn, one_type=False))

for _op, _fn in (("Not", np.logical_not), ("IsNaN", np.isnan)):
    cpu_kernel(_op)(_as_is(_fn))


@cpu_kernel("IsInf")
def is_inf(x, *, detect_negative=1, detect_positive=1):
    out = np.zeros(x.shape, dtype=bool)
    if detect_positive:
        out |= np.isposinf(x)
    if detect_negative:
        out |= np.isneginf(x)
    return out


BIT_SELECT_ELEMENTS = 1 << 14  # outputs from which Where selects by bit masks instead of np.where
_SAME_WIDTH_INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


@cpu_kernel("Where")
def where(condition, x, y):
    if condition.dtype != np.bool_:
        raise KernelError(f"condition must be bool, got {condition.dtype}")
    _same_type(x, y)
    return select(condition, x, y)


def select(condition: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``np.where(condition, x, y)`` bit for bit, for x and y of one dtype (either may be 0-d):
    from ``BIT_SELECT_ELEMENTS`` elements by bit masks (``_bit_select``), which do not branch per
    element (np.where of 1 M float32 elements: 3.8 ms, about ten times an exp)."""
    # sizes, not the broadcast shape, decide (np.broadcast_shapes costs microseconds a small step lacks)
    large = max(condition.size, x.size, y.size) >= BIT_SELECT_ELEMENTS
    if large and x.dtype == y.dtype and x.dtype.kind in "fiubV" and x.dtype.itemsize in _SAME_WIDTH_INTS:
        return _bit_select(condition, x, y, np.broadcast_shapes(condition.shape, x.shape, y.shape))
    return np.where(condition, x, y)


def _bit_select(condition, x, y, shape: tuple[int, ...]):
    """``np.where(condition, x, y)`` bit for bit, as ``y ^ ((x ^ y) & mask)`` on the elements' bits
    with a mask of all ones where the condition holds (``x & mask`` when y is a zero scalar, as in
    a ReLU gradient). np.where branches per element: on a ReLU mask of 3.2 M elements, half of
    them true, it took 20 ms here and this 2.2 ms."""
    ints = _SAME_WIDTH_INTS[x.dtype.itemsize]
    mask = np.negative(condition, dtype=ints, casting="unsafe")  # True -> -1: all bits set
    x_bits, y_bits = x.view(ints), y.view(ints)
    if y.size == 1 and not y_bits.any():
        out = np.asarray(np.bitwise_and(x_bits, mask))
    else:
        out = np.asarray(np.bitwise_xor(x_bits, y_bits))
        out = np.bitwise_and(out, mask, out=out if out.shape == shape else None)
        np.bitwise_xor(out, y_bits, out=out)
    if out.shape != shape:  # a zero y of a higher rank than x and the condition
        out = np.broadcast_to(out, shape).copy()
    return out.view(x.dtype)


for _op, _fn in (("BitwiseAnd", np.bitwise_and), ("BitwiseOr", np.bitwise_or), ("BitwiseXor", np.bitwise_xor)):
    cpu_kernel(_op)(_binary(_fn))

cpu_kernel("BitwiseNot")(_as_is(np.bitwise_not))


@cpu_kernel("BitShift")
def bit_shift(x, y, *, direction):
    _same_type(x, y)
    if x.dtype.kind not in "iu":
        raise KernelError(f"BitShift needs integers, got {x.dtype}")
    if direction not in ("LEFT", "RIGHT"):
        raise KernelError(f"unknown direction {direction!r}; expected LEFT or RIGHT")
    # Opset 28: signed types shift arithmetically; a shift that is negative or >= the bit width
    # leaves only the sign extension (-1 for a right shift of a negative x, else 0).
    bits = x.dtype.itemsize * 8
    valid = (y >= 0) & (y < bits)
    amount = np.where(valid, y, 0).astype(x.dtype)
    if direction == "LEFT":
        return np.where(valid, np.left_shift(x, amount), 0).astype(x.dtype)
    fill = np.where(x < 0, -1, 0) if x.dtype.kind == "i" else 0
    return np.where(valid, np.right_shift(x, amount), fill).astype(x.dtype)


# ---------------------------------------------------------------------------------------------
# type and identity


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if x.dtype.kind not in "biuf":
        raise KernelError(f"cannot cast from {x.dtype}: the type is not supported by gradgen's CPU kernels")
    if dtype.kind in "iu" and x.dtype.kind == "f":
        # Out-of-range and NaN casts are undefined in ONNX; keep numpy quiet about them.
        with np.errstate(invalid="ignore", over="ignore"):
            return x.astype(dtype)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@cpu_kernel("Cast")
def cast(x, *, to, saturate=1, round_mode="up"):
    return _cast(x, onnx_dtype(to))


@cpu_kernel("CastLike")
def cast_like(x, target, *, saturate=1, round_mode="up"):
    if target.dtype.kind not in "biuf":
        raise KernelError(f"cannot cast to {target.dtype}: the type is not supported by gradgen's CPU kernels")
    return _cast(x, target.dtype)


@cpu_kernel("Identity")
def identity(x):
    return x


@cpu_kernel("Dropout")
def dropout(data, ratio=None, training_mode=None, *, seed=None, is_test=None, _num_outputs=1, **attrs):
    drop = dropout_ratio(ratio, training_mode, is_test, attrs)
    if drop:
        y, mask = _training_dropout(data, drop, seed)
        return (y, mask) if _num_outputs >= 2 else y
    if _num_outputs >= 2:
        return data, np.ones(data.shape, dtype=bool)
    return data


def dropout_ratio(ratio, training_mode, is_test, attrs: dict) -> float:
    """The fraction a Dropout drops: its ratio in training mode, 0 in inference mode."""
    # opset < 12 (and the attribute forms of older opsets) put ratio in an attribute.
    if ratio is None:
        ratio = attrs.get("ratio", 0.5)
    ratio = float(np.asarray(ratio).reshape(-1)[0]) if np.size(ratio) else 0.5
    training = bool(np.asarray(training_mode).reshape(-1)[0]) if training_mode is not None else False
    if is_test is not None and not is_test:
        training = True
    if not training:
        return 0.0
    if not 0.0 <= ratio < 1.0:
        raise KernelError(f"training-mode Dropout with ratio {ratio}: the ratio must be in [0, 1)")
    return ratio


def _training_dropout(data: np.ndarray, ratio: float, seed) -> tuple[np.ndarray, np.ndarray]:
    """Y = X * mask / (1 - ratio) and the mask (True: kept), each element kept with probability
    1 - ratio. With the ``seed`` attribute, every run draws the same mask (numpy's PCG64 from that
    seed); without it, a fresh one."""
    rng = np.random.default_rng(None if seed is None else int(seed))
    mask = rng.random(data.shape) >= ratio
    scale = np.asarray(1.0 / (1.0 - ratio), dtype=data.dtype)
    return select(mask, np.asarray(data * scale, data.dtype), np.zeros((), data.dtype)), mask


# ---------------------------------------------------------------------------------------------
# Random generators: numpy's PCG64, as Dropout draws its mask. With the ``seed`` attribute every
# run draws the same numbers (and a GPU session the same as a CPU one: it draws them on the host);
# without it, fresh ones.

RANDOM_ELEMENTS_LIMIT = 1 << 31  # draws per node at most (a larger shape is an error, not an allocation)


def _generator(seed) -> np.random.Generator:
    return np.random.default_rng(None if seed is None else int(seed))


def _random_shape(shape) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims) or math.prod(dims) > RANDOM_ELEMENTS_LIMIT:
        raise KernelError(f"cannot draw a random tensor of shape {list(dims)} (at most {RANDOM_ELEMENTS_LIMIT} elements)")
    return dims


def _float_output(dtype) -> np.dtype:
    out = dtype if isinstance(dtype, np.dtype) else onnx_dtype(dtype)
    if out.kind != "f":
        raise KernelError(f"a random normal or uniform tensor must be a float type, got {out}")
    return out


@cpu_kernel("RandomNormal")
def random_normal(*, shape, dtype=1, mean=0.0, scale=1.0, seed=None):
    dims = _random_shape(shape)
    return (_generator(seed).standard_normal(dims) * float(scale) + float(mean)).astype(_float_output(dtype))


@cpu_kernel("RandomUniform")
def random_uniform(*, shape, dtype=1, high=1.0, low=0.0, seed=None):
    """Uniform on [low, high) in ``dtype``. The draws are float64; a draw just below ``high`` can round
    up to it in a narrower type (float32 one in ~10^7 draws, float16 one in ~4,000), so those are
    clamped to the type's largest value below ``high``."""
    out = _float_output(dtype)
    y = _generator(seed).uniform(float(low), float(high), _random_shape(shape)).astype(out)
    if float(low) < float(high):
        below_high = out.type(high)
        if float(below_high) >= float(high):
            below_high = np.nextafter(below_high, out.type(-np.inf))
        np.minimum(y, max(below_high, out.type(low)), out=y)
    return y


@cpu_kernel("RandomNormalLike")
def random_normal_like(x, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    """RandomNormal of x's shape, in ``dtype`` (x's type by default); x's values are not read."""
    return random_normal(shape=x.shape, dtype=x.dtype if dtype is None else dtype, mean=mean, scale=scale, seed=seed)


@cpu_kernel("RandomUniformLike")
def random_uniform_like(x, *, dtype=None, high=1.0, low=0.0, seed=None):
    """RandomUniform of x's shape, in ``dtype`` (x's type by default); x's values are not read."""
    return random_uniform(shape=x.shape, dtype=x.dtype if dtype is None else dtype, high=high, low=low, seed=seed)


@cpu_kernel("Bernoulli")
def bernoulli(x, *, dtype=None, seed=None):
    """1 with probability x (per element), else 0, in ``dtype`` (x's type by default)."""
    if x.dtype.kind != "f":
        raise KernelError(f"Bernoulli's probabilities must be floats, got {x.dtype}")
    draws = _generator(seed).random(_random_shape(x.shape))
    return (draws < x.astype(np.float64)).astype(x.dtype if dtype is None else onnx_dtype(dtype))


@cpu_kernel("Multinomial")
def multinomial(x, *, dtype=6, sample_size=1, seed=None):
    """``sample_size`` class indices per row of x (batch, classes), drawn from softmax(row): x
    holds unnormalized log-probabilities. int32 (the default) or int64."""
    if x.ndim != 2 or x.shape[1] < 1:
        raise KernelError(f"Multinomial needs a (batch, classes) input with at least one class, got shape {list(x.shape)}")
    out = onnx_dtype(dtype)
    if out not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise KernelError(f"Multinomial draws int32 or int64 indices, not {out}")
    logits = x.astype(np.float64)
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    cumulative = np.cumsum(probabilities, axis=1)
    draws = _generator(seed).random((x.shape[0], int(sample_size))) * cumulative[:, -1:]
    indices = np.stack([np.searchsorted(row, u, side="right") for row, u in zip(cumulative, draws)]) if x.shape[0] else draws
    return np.minimum(indices, x.shape[1] - 1).astype(out).reshape(x.shape[0], int(sample_size))


# ---------------------------------------------------------------------------------------------
# BroadcastGradientArgs (com.microsoft): the reduction axes of a broadcasting op's gradients

BROADCAST_GRADIENT_ARGS = schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc).
        "BroadcastGradientArgs",
        inputs=(Formal("a_shape", INT64), Formal("b_shape", INT64)),
        outputs=(Formal("a_axes", INT64, optional=True), Formal("b_axes", INT64, optional=True)),
        infer=lambda i, a: [(schemas.DT.INT64, (None,)), (schemas.DT.INT64, (None,))],
    )
)


@cpu_kernel("BroadcastGradientArgs", domain=MICROSOFT)
def broadcast_gradient_args(a_shape, b_shape):
    a_axes, b_axes = broadcast_gradient_axes(int_list(a_shape, "a_shape"), int_list(b_shape, "b_shape"))
    return np.array(a_axes, dtype=np.int64), np.array(b_axes, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# ONNX Runtime training's activation gradients (com.microsoft)


def _activation_grad_schema(op_type: str, *forward: str) -> Schema:
    """ONNX Runtime training's contract (training_op_defs.cc) of an activation's gradient op:
    (dY, the forward input or output[, the bias]) -> dX."""
    return schemas.declare(
        Schema(
            op_type,
            inputs=(Formal("dY", FLOATS), *(Formal(name, FLOATS) for name in forward)),
            outputs=(Formal("dX", FLOATS),),
            infer=lambda i, a: [(i[0].dtype, i[0].shape)],
        )
    )


RELU_GRAD = _activation_grad_schema("ReluGrad", "X")
SIGMOID_GRAD = _activation_grad_schema("SigmoidGrad", "Y")
TANH_GRAD = _activation_grad_schema("TanhGrad", "Y")
GELU_GRAD = _activation_grad_schema("GeluGrad", "X")
FAST_GELU_GRAD = _activation_grad_schema("FastGeluGrad", "X")
BIAS_GELU_GRAD_DX = _activation_grad_schema("BiasGeluGrad_dX", "X", "B")
BIAS_FAST_GELU_GRAD_DX = _activation_grad_schema("BiasFastGeluGrad_dX", "X", "B")


@cpu_kernel("ReluGrad", domain=MICROSOFT)
def relu_grad(dY, X):
    """dX = dY where X > 0, else 0."""
    same_shape(dY, X, "dY", "X")
    return select(X > 0, dY, np.zeros((), dtype=dY.dtype))


@cpu_kernel("SigmoidGrad", domain=MICROSOFT)
def sigmoid_grad(dY, Y):
    """dX = dY * Y * (1 - Y), from Sigmoid's output Y."""
    same_shape(dY, Y, "dY", "Y")
    one = Y.dtype.type(1)
    return (dY * Y * (one - Y)).astype(dY.dtype, copy=False)


@cpu_kernel("TanhGrad", domain=MICROSOFT)
def tanh_grad(dY, Y):
    """dX = dY * (1 - Y * Y), from Tanh's output Y."""
    same_shape(dY, Y, "dY", "Y")
    one = Y.dtype.type(1)
    return (dY * (one - Y * Y)).astype(dY.dtype, copy=False)


def _gelu_grad(dY, X, approximate: bool):
    ct = accumulation_dtype(X.dtype)
    x = X.astype(ct, copy=False)
    if approximate:
        # with s = sigmoid(v) = 0.5 (1 + tanh(u)), v = 2u, u = alpha (x + gamma x^3), the
        # derivative of x s is s (1 + x (1 - s) v') (see _tanh_gelu_logit), in place; 1 - s is
        # sigmoid(-v), not a subtraction (which loses its digits where s nears 1: twice the error
        # of the tanh form for x in [1, 5])
        logit = _tanh_gelu_logit(x)
        s = sigmoid(logit)
        d = np.multiply(x, x, out=np.empty_like(x))
        d *= ct.type(2 * TANH_GELU_SCALE * 3 * TANH_GELU_CUBIC)
        d += ct.type(2 * TANH_GELU_SCALE)
        d *= x
        d *= sigmoid(np.negative(logit, out=logit))
        d += ct.type(1)
        d *= s
    else:
        k_alpha = ct.type(2.0 / math.sqrt(math.pi) * math.sqrt(0.5) * 0.5)
        scaled = x.astype(np.float64) * math.sqrt(0.5)
        erf_values = erf_array(scaled if ct == np.float64 else scaled.astype(ct)).astype(ct, copy=False)
        d = ct.type(0.5) * (erf_values + ct.type(1)) + x * k_alpha * np.exp(ct.type(-0.5) * x * x)
    return (dY.astype(ct, copy=False) * d).astype(dY.dtype)


@cpu_kernel("GeluGrad", domain=MICROSOFT)
def gelu_grad(dY, X):
    """Gradient of the exact (erf) Gelu."""
    same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, X, approximate=False)


@cpu_kernel("FastGeluGrad", domain=MICROSOFT)
def fast_gelu_grad(dY, X):
    """Gradient of the tanh approximation of Gelu."""
    same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, X, approximate=True)


def _biased(X, B):
    if B.ndim != 1 or X.ndim < 1 or X.shape[-1] != B.shape[0]:
        raise KernelError(f"B (shape {list(B.shape)}) must be 1-D and match the last dimension of X {list(X.shape)}")
    return X + B


@cpu_kernel("BiasGeluGrad_dX", domain=MICROSOFT)
def bias_gelu_grad_dx(dY, X, B):
    same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, _biased(X, B), approximate=False)


@cpu_kernel("BiasFastGeluGrad_dX", domain=MICROSOFT)
def bias_fast_gelu_grad_dx(dY, X, B):
    same_shape(dY, X, "dY", "X")
    return _gelu_grad(dY, _biased(X, B), approximate=True)


schemas.declare(
    Schema(
        # ONNX Runtime training's contract (training_op_defs.cc): output = input * scale, or
        # input / scale with scale_down=1; scale holds one value
        "Scale",
        inputs=(Formal("input", FLOATS), Formal("scale", frozenset({*FLOATS, schemas.DT.INT64, schemas.DT.INT32}))),
        outputs=(Formal("output", FLOATS),),
        attributes=(Attribute("scale_down", "int", 0),),
        infer=lambda i, a: [(i[0].dtype, i[0].shape)],
    )
)


def scale_factor(scale_value, scale_down) -> float:
    """Scale's multiplier: the one-element ``scale_value``, or float32(1) / float32(it) with
    scale_down=1 (ONNX Runtime's kernel); a KernelError for another size or a zero."""
    value = np.asarray(scale_value)
    if value.size != 1:
        raise KernelError(f"scale must have a single value, got shape {list(value.shape)}")
    factor = float(value.reshape(-1)[0])
    if factor == 0.0:
        raise KernelError("scale must not be 0")
    if int(scale_down):
        factor = float(np.float32(1.0) / np.float32(factor))
    return factor


@cpu_kernel("Scale", domain=MICROSOFT)
def scale(input, scale_value, *, scale_down=0):
    """input * scale, or input / scale with scale_down=1; scale is a one-element tensor."""
    factor = scale_factor(scale_value, scale_down)
    return (input * input.dtype.type(factor)).astype(input.dtype, copy=False)


# ---------------------------------------------------------------------------------------------
# RotaryEmbedding (opset 23)


def _rotary_heads(x, num_heads: int):
    """X as (batch, seq, heads, head_size): a 4-D X is (batch, heads, seq, head_size), a 3-D one
    (batch, seq, hidden) with hidden = num_heads * head_size."""
    if x.ndim == 4:
        return x.transpose(0, 2, 1, 3)
    return x.reshape(x.shape[0], x.shape[1], num_heads, x.shape[2] // num_heads)


def rotary_geometry(x_shape, cos_shape, sin_shape, position_ids_shape, num_heads: int, rotary_embedding_dim: int):
    """(batch, seq, heads, head_size, dim) of a RotaryEmbedding, after the checks of its inputs'
    shapes (``position_ids_shape`` None when absent; the ids' values are ``check_position_ids``').
    Shared by the CPU and CUDA kernels."""
    x_shape = tuple(int(d) for d in x_shape)
    if len(x_shape) == 4:
        batch, heads, seq, head_size = x_shape
    elif len(x_shape) != 3:
        raise KernelError(f"X must be 3-D or 4-D, got shape {list(x_shape)}")
    elif num_heads <= 0 or x_shape[2] % num_heads:
        raise KernelError(f"a 3-D X (shape {list(x_shape)}) needs num_heads dividing its last dimension, got {num_heads}")
    else:
        batch, seq, heads, head_size = x_shape[0], x_shape[1], num_heads, x_shape[2] // num_heads
    dim = int(rotary_embedding_dim) or head_size
    if dim % 2 or dim > head_size:
        raise KernelError(f"rotary_embedding_dim {dim} must be even and at most the head size {head_size}")
    caches = (("cos_cache", tuple(int(d) for d in cos_shape)), ("sin_cache", tuple(int(d) for d in sin_shape)))
    if position_ids_shape is not None:
        if tuple(position_ids_shape) != (batch, seq):
            raise KernelError(f"position_ids must have shape {[batch, seq]}, got {list(position_ids_shape)}")
        for name, cache in caches:
            if len(cache) != 2:
                raise KernelError(f"with position_ids, {name} must be 2-D (max_position, dim / 2), got {list(cache)}")
        caches = tuple((name, (batch, seq) + cache[1:]) for name, cache in caches)  # the rows picked
    for name, cache in caches:
        if cache != (batch, seq, dim // 2):
            raise KernelError(f"{name} gives shape {list(cache)} per position; expected {[batch, seq, dim // 2]}")
    return batch, seq, heads, head_size, dim


def check_position_ids(position_ids, cos_rows: int, sin_rows: int) -> None:
    """A KernelError naming the first of RotaryEmbedding's position ids outside a cache's rows."""
    for name, rows in (("cos_cache", cos_rows), ("sin_cache", sin_rows)):
        bad = (position_ids < 0) | (position_ids >= rows)
        if bad.any():
            raise KernelError(f"position id {int(position_ids[bad][0])} is out of range for {name} of {rows} rows")


@cpu_kernel("RotaryEmbedding")
def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0):
    """Rotates the first rotary_embedding_dim (default: all) features of each head by the angles
    whose cosines and sines the caches hold: per position (batch, seq, dim / 2), or rows picked by
    position_ids (batch, seq) from (max_position, dim / 2). Pairs are the two halves, or adjacent
    features with interleaved=1 (ONNX's reference semantics)."""
    pos_shape = None if position_ids is None else position_ids.shape
    *_, dim = rotary_geometry(x.shape, cos_cache.shape, sin_cache.shape, pos_shape, int(num_heads), int(rotary_embedding_dim))
    heads = _rotary_heads(x, int(num_heads))
    if position_ids is not None:
        check_position_ids(position_ids, cos_cache.shape[0], sin_cache.shape[0])
        cos, sin = cos_cache[position_ids], sin_cache[position_ids]
    else:
        cos, sin = cos_cache, sin_cache
    cos, sin = cos[:, :, None, :].astype(x.dtype, copy=False), sin[:, :, None, :].astype(x.dtype, copy=False)
    first, second = rotary_pairs(dim, int(interleaved))
    x1, x2 = heads[..., first], heads[..., second]
    out = heads.copy()
    out[..., first] = cos * x1 - sin * x2
    out[..., second] = sin * x1 + cos * x2
    return out.transpose(0, 2, 1, 3) if x.ndim == 4 else out.reshape(x.shape)


def rotary_pairs(dim: int, interleaved: int) -> tuple[slice, slice]:
    """The slices of the features that pair up in a rotation of ``dim`` features: the two halves, or
    the even and the odd ones (interleaved)."""
    return (slice(0, dim, 2), slice(1, dim, 2)) if interleaved else (slice(0, dim // 2), slice(dim // 2, dim))


# ---------------------------------------------------------------------------------------------
# ONNX Runtime's transformer activations and BiasDropout (com.microsoft, contrib_defs.cc /
# bert_defs.cc): forward ops of models optimized for ORT inference. build_backward rewrites them
# into standard ops first (gradgen.passes.DecomposePass, with their lowerings as the form).


def _same_as_first_output(infos, attrs):
    return [(infos[0].dtype, infos[0].shape)]


def _activation_schema(op_type: str, *inputs: Formal, attributes=()) -> Schema:
    return schemas.declare(
        Schema(op_type, inputs=inputs, outputs=(Formal("Y", FLOATS),), attributes=attributes, infer=_same_as_first_output)
    )


MS_GELU = _activation_schema("Gelu", Formal("X", FLOATS))
FAST_GELU = _activation_schema("FastGelu", Formal("X", FLOATS), Formal("bias", FLOATS, optional=True))
BIAS_GELU = _activation_schema("BiasGelu", Formal("A", FLOATS), Formal("B", FLOATS))
QUICK_GELU = _activation_schema("QuickGelu", Formal("X", FLOATS), attributes=(Attribute("alpha", "float", 1.702),))


def _plus_bias(X, bias, op_type: str):
    """X + bias, bias 1-D over X's last axis (ORT's contract)."""
    if bias is None:
        return X
    if bias.ndim != 1 or X.ndim < 1 or X.shape[-1] != bias.shape[0]:
        raise KernelError(
            f"{op_type}: bias (shape {list(bias.shape)}) must be 1-D and match the last dimension of X {list(X.shape)}"
        )
    return X + bias


@cpu_kernel("Gelu", domain=MICROSOFT)
def ms_gelu(X):
    """The exact (erf) Gelu, as ONNX's Gelu."""
    return gelu(X)


@cpu_kernel("FastGelu", domain=MICROSOFT)
def fast_gelu(X, bias=None):
    """The tanh approximation of Gelu of X [+ bias]."""
    return gelu(_plus_bias(X, bias, "FastGelu"), approximate="tanh")


@cpu_kernel("BiasGelu", domain=MICROSOFT)
def bias_gelu(A, B):
    """The exact Gelu of A + B."""
    return gelu(_plus_bias(A, B, "BiasGelu"))


@cpu_kernel("QuickGelu", domain=MICROSOFT)
def quick_gelu(X, *, alpha=1.702):
    """X * Sigmoid(alpha * X)."""
    ct = accumulation_dtype(X.dtype)
    x = X.astype(ct, copy=False)
    return (x / (ct.type(1) + np.exp(-ct.type(alpha) * x))).astype(X.dtype, copy=False)


def _bias_dropout_types(infos, attrs):
    return [(infos[0].dtype, infos[0].shape), (DT.BOOL, infos[0].shape)]


BIAS_DROPOUT = schemas.declare(
    Schema(
        "BiasDropout",
        inputs=(
            Formal("data", FLOATS),
            Formal("bias", FLOATS),
            Formal("residual", FLOATS, optional=True),
            Formal("ratio", FLOATS, optional=True),
            Formal("training_mode", frozenset({DT.BOOL}), optional=True),
        ),
        outputs=(Formal("output", FLOATS), Formal("mask", frozenset({DT.BOOL}), optional=True)),
        attributes=(Attribute("seed", "int"),),
        infer=_bias_dropout_types,
    )
)


def bias_dropout_is_training(ratio, training_mode) -> bool:
    """Whether a BiasDropout with these (constant) inputs drops anything: training_mode true and
    ratio > 0 (ratio defaults to 0.5)."""
    training = training_mode is not None and bool(np.asarray(training_mode).reshape(-1)[0])
    rate = 0.5 if ratio is None or not np.size(ratio) else float(np.asarray(ratio).reshape(-1)[0])
    return training and rate > 0


@cpu_kernel("BiasDropout", domain=MICROSOFT)
def bias_dropout(data, bias, residual=None, ratio=None, training_mode=None, *, seed=None, _num_outputs=1):
    """Inference form: (data + bias [+ residual], an all-true mask); training mode with ratio > 0
    (a random mask) is refused."""
    if bias_dropout_is_training(ratio, training_mode):
        raise KernelError("BiasDropout in training mode with ratio > 0 is not supported (gradgen runs it in inference mode only)")
    y = _plus_bias(data, bias, "BiasDropout")
    if residual is not None:
        y = y + residual
    y = y.astype(data.dtype, copy=False)
    return (y, np.ones(y.shape, dtype=bool)) if _num_outputs >= 2 else y


@cpu_kernel("DynamicQuantizeLinear")
def dynamic_quantize_linear(x):
    """(y, y_scale, y_zero_point): x quantized to uint8 over [min(0, min x), max(0, max x)], as the
    ONNX spec and ONNX Runtime compute it (rounding half to even)."""
    if x.dtype != np.float32:
        raise KernelError(f"DynamicQuantizeLinear takes float32 input, got {x.dtype}")
    low = min(np.float32(0), x.min()) if x.size else np.float32(0)
    high = max(np.float32(0), x.max()) if x.size else np.float32(0)
    # an all-zero x: scale 1 (ONNX Runtime's, and the spec's C++ comment; the reference evaluator gives 1/255)
    scale = np.float32(1) if high == low else np.float32((high - low) / np.float32(255))
    if not np.isfinite(scale):
        raise KernelError("DynamicQuantizeLinear: the input holds a NaN or an infinity")
    zero_point = np.uint8(np.clip(np.rint(-low / scale), 0, 255))
    y = np.clip(np.rint(x / scale) + zero_point.astype(np.float32), 0, 255).astype(np.uint8)
    return y, np.array(scale, np.float32), np.array(zero_point, np.uint8)
