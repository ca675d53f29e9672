"""Fused pointwise kernels: one generated CUDA kernel computes a chain of elementwise ops.

The executor's fusion pass (gradgen/executor/fusion.py) groups elementwise steps; this module
turns a group into CUDA source and launches it. A ``Signature`` (the ops, their dtypes and which
values are written out; never the sizes) names one kernel: every launch of it passes the output
shape and each input's strides, so one kernel serves every shape and broadcast pattern. The source
is compiled like the families' generated tables (``launch.generated_module``: NVRTC, the persistent
cache keyed by the text), once per process.

Exactness: a fused chain gives the bits its ops' own kernels give one after the other. Each op is
the expression its elementwise.cu kernel computes (the shared scalar functions live in
pointwise.h), in the same compute type (float for float16 and bfloat16); a 16-bit float value is
rounded to its type after each op, as storing it would (``ROUND``); and no floating-point contraction crosses an op boundary:
NVRTC contracts a multiply and an add into an FMA by default (``--fmad=true``, which the .cu
kernels are compiled with), so Add / Sub / Mul / Div use the ``__f*_rn`` / ``__d*_rn`` intrinsics
(never contracted), and the result of every op whose expression holds other arithmetic (Exp, Pow,
Gelu, ...) passes through ``gg_fence``, an ``add.rn`` of -0.0 in inline PTX that neither NVVM nor
ptxas fuses with its neighbours (x + -0.0 is x, for every x but a NaN's payload).

Each signature has two kernels: one element a thread, and the quad variant (entry point
``name + QUAD``), four consecutive elements a thread, which moves each output and each input that
is contiguous along the innermost (merged) axis in one access of 4 elements (16 bytes for 4-byte
types) and reads an input broadcast along that axis once for the four. The launch takes it where
the innermost size is a multiple of 4, every input is contiguous or broadcast along it and those
arrays start at a multiple of 4 elements (``index_modes``, ``quads_aligned``); both compute each
element with the same code, so they give the same bits.

In place: an output may be written over an input of the group's shape and its element size
(``in_place_candidates``; the executor's memory plan decides). Every thread loads an element's
inputs before it stores that element's outputs, and the pointers of such pairs are not
``__restrict__``, so the compiler keeps that order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from gradgen.kernels.cuda.launch import CASTABLE, FLOATS, NUMBERS, dtype_suffix, onnx_element_dtype

MAX_INPUTS = 16  # external inputs of one fused kernel (each passes a 136-byte stride record)
MAX_OUTPUTS = 8
MODULE_PREFIX = "fused"

# storage and compute C types of each dtype suffix
STORAGE = {
    "f16": "__half",
    "bf16": "__nv_bfloat16",
    "f32": "float",
    "f64": "double",
    "i8": "int8_t",
    "u8": "uint8_t",
    "i32": "int32_t",
    "i64": "int64_t",
    "b8": "bool",
}
COMPUTE = {**STORAGE, "f16": "float", "bf16": "float"}
# the 16-bit floats, computed in float: the function (_PRELUDE) that rounds a value to the type
ROUND = {"f16": "gg_round_half", "bf16": "gg_round_bf16"}
# and the one that widens a value of the type back to float
WIDEN = {"f16": "__half2float", "bf16": "__bfloat162float"}


class Unsupported(Exception):
    """The dtypes (or attributes) of a group that no fused kernel covers: run its steps one by one."""


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """One op of a chain: ``args`` are value ids (0 .. n_inputs-1 the external inputs, n_inputs + k
    the result of op k); ``attrs`` the attributes that change its code, as sorted pairs."""

    op_type: str
    args: tuple[int, ...]
    attrs: tuple = ()


@dataclasses.dataclass(frozen=True)
class Signature:
    """What one generated kernel computes: input dtypes, the ops, and which values it writes."""

    inputs: tuple[str, ...]  # dtype suffix per external input
    ops: tuple[FusedOp, ...]
    outputs: tuple[int, ...]  # value ids written out, in order

    @functools.cached_property
    def dtypes(self) -> tuple[str, ...]:
        """The dtype suffix of every value (inputs, then each op's result); Unsupported if an op
        has no fused form for its operands' dtypes."""
        dtypes = list(self.inputs)
        for op in self.ops:
            out = RULES[op.op_type].out_dtype([dtypes[a] for a in op.args], dict(op.attrs))
            if out is None:
                raise Unsupported(f"{op.op_type} on {', '.join(dtypes[a] for a in op.args)}")
            dtypes.append(out)
        return tuple(dtypes)

    @property
    def name(self) -> str:
        return f"{MODULE_PREFIX}_{hashlib.sha256(repr(self).encode()).hexdigest()[:16]}"


# -- the ops ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """How an op computes in a fused kernel: its result's dtype (None: not covered), and its C
    expression from its operands' expressions (compute types), their dtypes and its own."""

    out_dtype: Callable[[list[str], dict], str | None]
    expr: Callable[[list[str], list[str], str, dict], str]
    fenced: bool = False  # its expression holds arithmetic a neighbour could contract with
    # its result's shape from its operands' shapes (None: numpy broadcasting); ValueError where the
    # op's own kernel refuses them (the group then runs its steps one by one, and that kernel says why)
    shape: Callable[[list[tuple[int, ...]]], tuple[int, ...]] | None = None


def _same_float(dts: list[str], _attrs) -> str | None:
    return dts[0] if dts[0] in FLOATS and all(d == dts[0] for d in dts) else None


def _same_float_not_half(dts: list[str], attrs) -> str | None:
    # the variadic Sum kernel keeps 16-bit partial sums in float: not one rounding per add
    out = _same_float(dts, attrs)
    return out if out not in ROUND else None


def _compare(dts: list[str], _attrs) -> str | None:
    return "b8" if dts[0] in NUMBERS + ("b8",) and dts[0] == dts[1] else None


def _bools(dts: list[str], _attrs) -> str | None:
    return "b8" if all(d == "b8" for d in dts) else None


def _rounded(name: str) -> Callable:
    """Add / Sub / Mul / Div through the round-to-nearest intrinsics: never contracted."""

    def expr(a: list[str], dts: list[str], out: str, _attrs) -> str:
        return f"__{'d' if out == 'f64' else 'f'}{name}_rn({a[0]}, {a[1]})"

    return expr


def _fold(name: str) -> Callable:
    """A variadic op folded left to right, as its kernel folds it."""
    add = _rounded("add")

    def expr(a: list[str], dts: list[str], out: str, attrs) -> str:
        acc = a[0]
        for b in a[1:]:
            acc = add([acc, b], dts, out, attrs) if name == "add" else f"gg_{name}({acc}, {b})"
        return acc

    return expr


def _unary(template: str, fenced: bool = True, dtypes=FLOATS) -> Rule:
    """A one-operand op on ``dtypes`` whose expression is ``template`` with {x} and {C}."""
    return Rule(
        lambda dts, _attrs: dts[0] if dts[0] in dtypes else None,
        lambda a, dts, out, _attrs: "(" + template.format(x=a[0], C=COMPUTE[out]) + ")",
        fenced,
    )


def _pow_dtype(dts: list[str], _attrs) -> str | None:
    return dts[0] if dts[0] in FLOATS and dts[1] in NUMBERS else None


def _pow_expr(a: list[str], dts: list[str], out: str, _attrs) -> str:
    c = "double" if "f64" in dts else "float"
    return f"(({COMPUTE[out]})gg_pow(({c}){a[0]}, ({c}){a[1]}))"


def _cast_dtype(dts: list[str], attrs) -> str | None:
    try:
        to = dtype_suffix(onnx_element_dtype(attrs["to"]))
    except Exception:  # noqa: BLE001 - an unknown type code: the op's own kernel says so
        return None
    return to if dts[0] in CASTABLE and to in CASTABLE else None


def _cast_expr(a: list[str], dts: list[str], out: str, _attrs) -> str:
    if dts[0] == out:
        return a[0]
    converted = f"Conv<{STORAGE[out]}, {COMPUTE[dts[0]]}>::go({a[0]})"
    return f"{WIDEN[out]}({converted})" if out in WIDEN else converted


def _gelu_expr(a: list[str], dts: list[str], out: str, attrs) -> str:
    return f"gg_gelu{'_tanh' if attrs.get('approximate', 'none') == 'tanh' else ''}({a[0]})"


def _gelu_dtype(dts: list[str], attrs) -> str | None:
    return dts[0] if dts[0] in FLOATS and attrs.get("approximate", "none") in ("none", "tanh") else None


def _fast_gelu_expr(a: list[str], dts: list[str], out: str, attrs) -> str:
    """com.microsoft FastGelu: the tanh Gelu of X, or of X + bias (its kernel's two launches: the
    sum is rounded to the storage type in between)."""
    x = a[0]
    if len(a) == 2:
        x = _rounded("add")(a, dts, out, attrs)
        if out in ROUND:
            x = f"{ROUND[out]}({x})"
    return f"gg_gelu_tanh({x})"


def _biased_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    x = shapes[0]
    if len(shapes) == 2 and (len(shapes[1]) != 1 or not x or x[-1] != shapes[1][0]):
        raise ValueError(f"bias {list(shapes[1])} is not 1-D over the last axis of X {list(x)}")
    return x


def _gelu_grad_expr(slope: str) -> Callable:
    """com.microsoft GeluGrad / FastGeluGrad (dY, X): dY times the slope, as elementwise.cu writes it."""
    return lambda a, dts, out, _attrs: f"({a[0]} * gg_{slope}({a[1]}))"


def _one_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if any(s != shapes[0] for s in shapes):
        raise ValueError(f"operands of shapes {' and '.join(str(list(s)) for s in shapes)} must have one shape")
    return shapes[0]


def _where_dtype(dts: list[str], _attrs) -> str | None:
    return dts[1] if dts[0] == "b8" and dts[1] == dts[2] and dts[1] in STORAGE else None


RULES: dict[str, Rule] = {
    "Add": Rule(_same_float, _rounded("add")),
    "Sub": Rule(_same_float, _rounded("sub")),
    "Mul": Rule(_same_float, _rounded("mul")),
    "Div": Rule(_same_float, _rounded("div")),
    "Sum": Rule(_same_float_not_half, _fold("add")),
    "Max": Rule(_same_float, _fold("max")),
    "Min": Rule(_same_float, _fold("min")),
    "Pow": Rule(_pow_dtype, _pow_expr, fenced=True),
    "Neg": _unary("-{x}", fenced=False),
    "Abs": _unary("fabs({x})", fenced=False),
    "Relu": _unary("{x} < {C}(0) ? {C}(0) : {x}", fenced=False),
    "Sqrt": _unary("sqrt({x})"),
    "Reciprocal": _unary("{C}(1) / {x}"),
    "Exp": _unary("exp({x})"),
    "Log": _unary("log({x})"),
    "Tanh": _unary("tanh({x})"),
    "Erf": _unary("erf({x})"),
    "Sigmoid": _unary("gg_sigmoid({x})"),
    "Softplus": _unary("gg_softplus({x})"),
    "Gelu": Rule(_gelu_dtype, _gelu_expr, fenced=True),
    "Where": Rule(_where_dtype, lambda a, dts, out, _attrs: f"({a[0]} ? {a[1]} : {a[2]})"),
    "Equal": Rule(_compare, lambda a, *_: f"({a[0]} == {a[1]})"),
    "Less": Rule(_compare, lambda a, *_: f"({a[0]} < {a[1]})"),
    "LessOrEqual": Rule(_compare, lambda a, *_: f"({a[0]} <= {a[1]})"),
    "Greater": Rule(_compare, lambda a, *_: f"({a[0]} > {a[1]})"),
    "GreaterOrEqual": Rule(_compare, lambda a, *_: f"({a[0]} >= {a[1]})"),
    "Not": Rule(_bools, lambda a, *_: f"(!{a[0]})"),
    "And": Rule(_bools, lambda a, *_: f"({a[0]} && {a[1]})"),
    "Or": Rule(_bools, lambda a, *_: f"({a[0]} || {a[1]})"),
    "Xor": Rule(_bools, lambda a, *_: f"({a[0]} != {a[1]})"),
    "Cast": Rule(_cast_dtype, _cast_expr),
    "Identity": Rule(lambda dts, _attrs: dts[0], lambda a, *_: a[0]),
    # com.microsoft (see MICROSOFT_RULES)
    "FastGelu": Rule(_same_float, _fast_gelu_expr, fenced=True, shape=_biased_shape),
    "GeluGrad": Rule(_same_float, _gelu_grad_expr("gelu_slope"), fenced=True, shape=_one_shape),
    "FastGeluGrad": Rule(_same_float, _gelu_grad_expr("gelu_tanh_slope"), fenced=True, shape=_one_shape),
}
MICROSOFT = "com.microsoft"
# com.microsoft ops with a fused form, and the rule each computes with (ONNX Runtime's Gelu is
# ONNX's exact Gelu); the other rules are the default domain's ops
MICROSOFT_RULES = {"Gelu": "Gelu", "FastGelu": "FastGelu", "GeluGrad": "GeluGrad", "FastGeluGrad": "FastGeluGrad"}
_MICROSOFT_ONLY = frozenset(MICROSOFT_RULES.values()) - {"Gelu"}

# the attributes that change an op's code (the rest, if any, do not reach the kernel)
CODE_ATTRS = {"Cast": ("to",), "Gelu": ("approximate",)}
# ops whose kernel is variadic (any number of operands); the others take a fixed count
VARIADIC = frozenset({"Sum", "Max", "Min"})
ARITY = {"Where": 3, "Pow": 2, "Add": 2, "Sub": 2, "Mul": 2, "Div": 2, "Equal": 2, "Less": 2, "LessOrEqual": 2}
ARITY.update({"Greater": 2, "GreaterOrEqual": 2, "And": 2, "Or": 2, "Xor": 2, "GeluGrad": 2, "FastGeluGrad": 2, "FastGelu": 2})
OPTIONAL_LAST = frozenset({"FastGelu"})  # ops whose last input (FastGelu's bias) may be left out


def rule_name(domain: str, op_type: str) -> str | None:
    """The rule (key of RULES) a node of ``domain`` / ``op_type`` computes with; None: no fused form."""
    if domain in ("", "ai.onnx"):
        return op_type if op_type in RULES and op_type not in _MICROSOFT_ONLY else None
    return MICROSOFT_RULES.get(op_type) if domain == MICROSOFT else None


def fusable_op(op_type: str, attrs: dict, n_inputs: int, domain: str = "") -> bool:
    """Whether a node of ``domain`` / ``op_type`` with ``n_inputs`` inputs has a fused form."""
    name = rule_name(domain, op_type)
    if name is None:
        return False
    if domain == MICROSOFT and attrs:  # none of these has attributes: leave the unknown to its kernel
        return False
    if name == "Cast" and set(attrs) - {"to", "saturate", "round_mode"}:
        return False
    if name == "Gelu" and attrs.get("approximate", "none") not in ("none", "tanh"):
        return False
    if name in VARIADIC:
        return 1 <= n_inputs <= MAX_INPUTS
    arity = ARITY.get(name, 1)
    return n_inputs == arity or (name in OPTIONAL_LAST and n_inputs == arity - 1)


def code_attrs(op_type: str, attrs: dict) -> tuple:
    """The attributes of rule ``op_type`` that change its code, as sorted pairs."""
    return tuple(sorted((k, attrs[k]) for k in CODE_ATTRS.get(op_type, ()) if k in attrs))


# -- code generation --------------------------------------------------------------------------------

_PRELUDE = r"""
// A barrier to floating-point contraction: x + (-0.0) rounded to nearest, in inline PTX.
__device__ __forceinline__ float gg_fence(float v) {
    float r;
    asm("add.rn.f32 %0, %1, 0f80000000;" : "=f"(r) : "f"(v));
    return r;
}
__device__ __forceinline__ double gg_fence(double v) {
    double r;
    asm("add.rn.f64 %0, %1, 0d8000000000000000;" : "=d"(r) : "d"(v));
    return r;
}
__device__ __forceinline__ float gg_round_half(float v) { return __half2float(__float2half(v)); }
__device__ __forceinline__ float gg_round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Element offsets of flat index i in each input: mode 0 reads element i, 1 element 0, 2 and 3
// through the input's strides over `shape` (2 bits per input in `modes`).
template <typename I, int K>
__device__ __forceinline__ void gg_fused_offsets(I i, const TensorDesc& shape, const TensorDesc* const* views,
                                                 int64_t modes, int64_t* offs) {
#pragma unroll
    for (int k = 0; k < K; ++k) offs[k] = ((modes >> (2 * k)) & 3) == 0 ? (int64_t)i : 0;
    if ((modes & 0xAAAAAAAAAAAAAAAAll) == 0) return;
    for (int d = (int)shape.rank - 1; d >= 0; --d) {
        const I size = (I)shape.shape[d];
        const I q = i / size;
        const int64_t coord = (int64_t)(i - q * size);
        i = q;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if ((modes >> (2 * k)) & 2) offs[k] += coord * views[k]->strides[d];
    }
}

// The quad variants: each thread computes 4 consecutive elements of the innermost axis (a
// multiple of 4). An input of odd mode (1: one element; 3: strides, broadcast along the innermost
// axis) is one element for all four; an input of even mode (0, 2) and every output move 4
// elements in one access (16 bytes for 4-byte types), aligned to their size (the launcher checks).
template <typename T> struct alignas(4 * sizeof(T)) GgQuad { T v[4]; };
template <typename T> __device__ __forceinline__ GgQuad<T> gg_load_quad(const T* p, int64_t mode) {
    GgQuad<T> q;
    if (mode & 1) {
        const T s = *p;
        q.v[0] = q.v[1] = q.v[2] = q.v[3] = s;
    } else {
        q = *reinterpret_cast<const GgQuad<T>*>(p);
    }
    return q;
}
"""


@functools.lru_cache(maxsize=1)
def _shared_header() -> str:
    text = (Path(__file__).resolve().parent / "pointwise.h").read_text()
    return text.replace("#pragma once\n", "")


def kernel_source(sig: Signature) -> str:
    """The CUDA source of ``sig``'s kernel (entry point ``sig.name``)."""
    return module_source([sig])


def module_source(sigs: list[Signature]) -> str:
    """One CUDA source holding the kernels of ``sigs`` (one compile for many: NVRTC spends about
    2 s on the headers of any source, and 0.1 s more per kernel)."""
    return "\n".join(['#include "common.h"', _shared_header(), _PRELUDE, *(_kernel_text(sig) for sig in sigs)])


def _kernel_text(sig: Signature) -> str:
    """Both kernels of ``sig``: ``sig.name`` (one element a thread) and ``sig.name + QUAD`` (four)."""
    return _variant_text(sig, quad=False) + _variant_text(sig, quad=True)


QUAD = "_q"  # the quad variant's entry point: the signature's name and this


def _op_lines(sig: Signature) -> tuple[list[str], list[str]]:
    """One element's computation: a line per op over the inputs' values x0, x1, ... (compute
    types), and the name of each value (inputs, then op results t0, t1, ...)."""
    dts = sig.dtypes
    n_in = len(sig.inputs)
    names = [f"x{k}" for k in range(n_in)]
    lines = []
    for index, op in enumerate(sig.ops):
        rule = RULES[op.op_type]
        out = dts[n_in + index]
        expr = rule.expr([names[a] for a in op.args], [dts[a] for a in op.args], out, dict(op.attrs))
        if out in ROUND:
            expr = f"{ROUND[out]}({expr})"
        elif rule.fenced and out in ("f32", "f64"):
            expr = f"gg_fence({expr})"
        names.append(f"t{index}")
        lines.append(f"const {COMPUTE[out]} t{index} = {expr};  // {op.op_type}")
    return lines, names


def _restricted(sig: Signature) -> tuple[list[bool], list[bool]]:
    """Which input and output pointers are ``__restrict__``: those that no pointer of the other side
    can share memory with. The memory plan may put an output over an input of its element size
    (``in_place_candidates``); each thread loads an element's inputs before it stores its outputs,
    and without ``__restrict__`` on both, the compiler keeps that order."""
    dts = sig.dtypes
    size = {d: np.dtype(NUMPY[d]).itemsize for d in STORAGE}
    out_sizes = {size[dts[v]] for v in sig.outputs}
    in_sizes = {size[d] for d in sig.inputs}
    return [size[d] not in out_sizes for d in sig.inputs], [size[dts[v]] not in in_sizes for v in sig.outputs]


def _variant_text(sig: Signature, quad: bool) -> str:
    dts = sig.dtypes
    n_in = len(sig.inputs)
    in_restrict, out_restrict = _restricted(sig)
    params = [f"{STORAGE[dts[v]]}*{' __restrict__' if out_restrict[j] else ''} out{j}" for j, v in enumerate(sig.outputs)]
    params += [f"const {STORAGE[d]}*{' __restrict__' if in_restrict[k] else ''} in{k}" for k, d in enumerate(sig.inputs)]
    params += ["TensorDesc shape", *(f"TensorDesc v{k}" for k in range(n_in)), "int64_t n", "int64_t modes"]
    ops, names = _op_lines(sig)
    if quad:
        body = [
            f"GgQuad<{STORAGE[d]}> q{k} = gg_load_quad(in{k} + offs[{k}], modes >> {2 * k});" for k, d in enumerate(sig.inputs)
        ]
        body += [f"GgQuad<{STORAGE[dts[v]]}> r{j};" for j, v in enumerate(sig.outputs)]
        body += ["#pragma unroll", "for (int e = 0; e < 4; ++e) {"]
        body += [f"    const {COMPUTE[d]} x{k} = gg_load(&q{k}.v[e]);" for k, d in enumerate(sig.inputs)]
        body += [f"    {line}" for line in ops]
        body += [f"    gg_store(&r{j}.v[e], {names[v]});" for j, v in enumerate(sig.outputs)]
        body += ["}"]
        body += [f"*reinterpret_cast<GgQuad<{STORAGE[dts[v]]}>*>(out{j} + i) = r{j};" for j, v in enumerate(sig.outputs)]
    else:
        body = [f"const {COMPUTE[d]} x{k} = gg_load(in{k} + offs[{k}]);" for k, d in enumerate(sig.inputs)]
        body += ops
        body += [f"gg_store(out{j} + i, {names[v]});" for j, v in enumerate(sig.outputs)]
    # quads: item q is elements 4q .. 4q+3 (n / 4 items); elements: item i is element i
    count, first = ("(n >> 2)", "4 * ") if quad else ("n", "")
    views = ", ".join(f"&v{k}" for k in range(n_in))
    lines = [
        f'extern "C" __global__ void {sig.name}{QUAD if quad else ""}({", ".join(params)}) {{',
        f"    const TensorDesc* const views[{n_in}] = {{{views}}};",
        "    auto element = [&](int64_t i, const int64_t* offs) {",
        *(f"        {line}" for line in body),
        "    };",
        f"    int64_t offs[{n_in}];",
        f"    const int64_t items = {count};",
        "    if (n <= 0xFFFFFFFFll) {",
        "        for (uint32_t q = blockIdx.x * blockDim.x + threadIdx.x; q < (uint32_t)items; q += blockDim.x * gridDim.x) {",
        f"            const uint32_t i = {first}q;",
        f"            gg_fused_offsets<uint32_t, {n_in}>(i, shape, views, modes, offs);",
        "            element((int64_t)i, offs);",
        "            if (q > 0xFFFFFFFFu - blockDim.x * gridDim.x) break;",
        "        }",
        "    } else {",
        "        GG_GRID_STRIDE(q, items) {",
        f"            const int64_t i = {first}q;",
        f"            gg_fused_offsets<int64_t, {n_in}>(i, shape, views, modes, offs);",
        "            element(i, offs);",
        "        }",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)


# -- launching ------------------------------------------------------------------------------------


BATCH = 12  # kernels per module when a Session's kernels compile together
_LOADED: dict[Signature, tuple] = {}  # signature -> its loaded kernels (element, quad)
_PENDING: dict[Signature, list[Signature]] = {}  # signature -> the batch it compiles with


def prepare(sigs) -> None:
    """Note the kernels a Session will launch, so that the first launch of any of them compiles
    them all at once: modules of BATCH kernels, compiled side by side, loaded once."""
    batch = sorted({s for s in sigs if s not in _LOADED and s not in _PENDING}, key=lambda s: s.name)
    for sig in batch:
        _PENDING[sig] = batch


def _kernel(sig: Signature, quad: bool = False):
    if sig not in _LOADED:
        _load(_PENDING.get(sig) or [sig])
    return _LOADED[sig][1 if quad else 0]


def _load(sigs: list[Signature]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from gradgen.kernels.cuda.launch import generated_cubin, generated_module

    valid = []
    for sig in sigs:
        try:
            sig.dtypes  # noqa: B018 - a predicted signature the run-time dtypes may never use
            valid.append(sig)
        except Unsupported:
            pass
    chunks = [valid[i : i + BATCH] for i in range(0, len(valid), BATCH)]
    modules = [(f"{MODULE_PREFIX}-{hashlib.sha256(' '.join(s.name for s in c).encode()).hexdigest()[:16]}", c) for c in chunks]
    from gradgen.cuda import runtime as rt

    major, minor = rt.driver.Context.get_device().compute_capability()
    arch = f"sm_{major}{minor}"
    if len(modules) > 1:  # compile on threads (NVRTC releases the GIL); load here, where the context is
        with ThreadPoolExecutor(max_workers=len(modules)) as pool:
            list(pool.map(lambda m: generated_cubin(m[0], module_source(m[1]), arch), modules))
    for name, chunk in modules:
        module = generated_module(name, module_source(chunk))
        for sig in chunk:
            _LOADED[sig] = (module.get_function(sig.name), module.get_function(sig.name + QUAD))
            _PENDING.pop(sig, None)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one launch indexes: the output shape, the simplified shape and each input's record."""

    out_shape: tuple[int, ...]
    n: int
    descs: tuple  # shape desc, then one strides desc per input
    modes: int
    quad_modes: int | None = None  # the quad variant's modes, where the shapes allow it (``index_modes``)


def value_shapes(sig: Signature, in_shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shape of every value of ``sig`` (numpy broadcasting); ValueError where shapes clash."""
    shapes = list(in_shapes)
    for op in sig.ops:
        operands = [shapes[a] for a in op.args]
        rule = RULES[op.op_type].shape
        shapes.append(rule(operands) if rule is not None else tuple(int(d) for d in np.broadcast_shapes(*operands)))
    return shapes


def in_place_candidates(sig: Signature, in_shapes: list[tuple[int, ...]]) -> list[tuple[int, tuple[int, ...]]]:
    """For each output of a launch on inputs of ``in_shapes`` (its position in ``sig.outputs``), the
    inputs whose buffer it may be written over: those with the group's whole shape (read only at
    the element the same thread writes; a broadcast input is read at many) and the output's element
    size. Only for a launch ``layout`` allows (outputs of the group's shape)."""
    dts = sig.dtypes
    shapes = value_shapes(sig, in_shapes)
    size = int(np.prod(shapes[sig.outputs[0]], dtype=np.int64)) if sig.outputs else 0
    found = []
    for j, v in enumerate(sig.outputs):
        itemsize = np.dtype(NUMPY[dts[v]]).itemsize
        same = tuple(
            k
            for k, shape in enumerate(in_shapes)
            if int(np.prod(shape, dtype=np.int64)) == size and np.dtype(NUMPY[dts[k]]).itemsize == itemsize
        )
        if same and size:
            found.append((j, same))
    return found


@functools.lru_cache(maxsize=4096)
def layout(sig: Signature, in_shapes: tuple[tuple[int, ...], ...]) -> Layout | None:
    """The launch layout for inputs of ``in_shapes``, or None where one kernel cannot compute the
    group: an output smaller than the group's shape (written once per element of the whole), or a
    rank past the kernels' records."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.launch import coalesce, desc

    try:
        shapes = value_shapes(sig, list(in_shapes))
    except ValueError:
        return None
    full = tuple(int(d) for d in np.broadcast_shapes(*shapes[len(in_shapes) :]))
    if any(shapes[v] != full for v in sig.outputs) or len(full) > rt.MAX_RANK:
        return None
    strides = [rt.broadcast_strides(list(s), list(full)) for s in in_shapes]
    shape, lists = coalesce(full, *strides)
    modes, quad_modes = index_modes(shape, lists)
    n = int(np.prod(full, dtype=np.int64))
    return Layout(full, n, (desc(shape), *[desc(shape, st) for st in lists]), modes, quad_modes)


def index_modes(shape: list[int], lists: list[list[int]]) -> tuple[int, int | None]:
    """How each input is read over the simplified ``shape`` (its element strides ``lists[k]``), 2
    bits per input: 0 contiguous (element i), 1 one element for all, 2 through its strides. And
    for the quad variant, where the innermost size is a multiple of 4 and every input is
    contiguous or broadcast along it: the same with 3 for strides broadcast along the innermost
    axis (one element per quad); None where the quad variant does not apply."""
    contiguous: list[int] = []
    step = 1
    for d in reversed(shape):
        contiguous.insert(0, step)
        step *= max(d, 1)
    modes, quad_modes = 0, 0
    quads = bool(shape) and shape[-1] % 4 == 0
    for k, st in enumerate(lists):
        mode = 0 if st == contiguous else (1 if not any(st) else 2)
        modes |= mode << (2 * k)
        if mode == 2 and st[-1] not in (0, 1):
            quads = False
        quad_modes |= (3 if mode == 2 and st[-1] == 0 else mode) << (2 * k)
    return modes, quad_modes if quads else None


def launch_fused(sig: Signature, inputs: list):
    """Run ``sig``'s kernel on device arrays ``inputs``: the outputs (new arrays), or None where
    their shapes do not allow one kernel (see ``layout``)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.launch import contiguous, launch

    plan = layout(sig, tuple(tuple(int(d) for d in x.shape) for x in inputs))
    if plan is None:
        return None
    dts = sig.dtypes
    outputs = [rt.empty(plan.out_shape, np.dtype(NUMPY[dts[v]])) for v in sig.outputs]
    if plan.n:
        inputs = [contiguous(x) for x in inputs]
        quad = plan.quad_modes is not None and quads_aligned(plan.quad_modes, outputs, inputs)
        modes = plan.quad_modes if quad and plan.quad_modes is not None else plan.modes
        launch(
            _kernel(sig, quad), plan.n // 4 if quad else plan.n, *outputs, *inputs, *plan.descs, np.int64(plan.n), np.int64(modes)
        )
    return outputs


def quads_aligned(quad_modes: int, outputs: list, inputs: list) -> bool:
    """Whether every array the quad variant moves 4 elements at a time (the outputs, the inputs
    of even quad mode) starts at a multiple of 4 elements' bytes."""
    moved = [*outputs, *(x for k, x in enumerate(inputs) if not (quad_modes >> (2 * k)) & 1)]
    return all(int(x.gpudata) % (4 * x.dtype.itemsize) == 0 for x in moved)


NUMPY = {
    "f16": np.float16,
    "bf16": ml_dtypes.bfloat16,
    "f32": np.float32,
    "f64": np.float64,
    "i8": np.int8,
    "u8": np.uint8,
    "i32": np.int32,
    "i64": np.int64,
    "b8": np.bool_,
}


def generated_sources() -> dict[str, str]:
    """A sample of the sources this module generates (module name -> text), for the compile test."""
    sample = Signature(
        ("f32", "f32", "b8", "f16"),
        (
            FusedOp("Mul", (0, 1)),
            FusedOp("Tanh", (4,)),
            FusedOp("Where", (2, 5, 0)),
            FusedOp("Cast", (3,), (("to", 1),)),
            FusedOp("Add", (6, 7)),
            FusedOp("Cast", (8,), (("to", 10),)),
        ),
        (8, 9),
    )
    gelus = Signature(  # com.microsoft ops, float64 and float16 values, a bool output
        ("f16", "f16", "f64", "f64"),
        (
            FusedOp("FastGelu", (0, 1)),
            FusedOp("FastGeluGrad", (4, 0)),
            FusedOp("Gelu", (2,)),
            FusedOp("GeluGrad", (3, 6)),
            FusedOp("Less", (7, 2)),
        ),
        (5, 7, 8),
    )
    bf16 = Signature(  # bfloat16 values: arithmetic, a Gelu, casts to and from float16 and float32
        ("bf16", "bf16", "f16"),
        (
            FusedOp("Mul", (0, 1)),
            FusedOp("FastGelu", (3, 1)),
            FusedOp("Cast", (2,), (("to", 16),)),
            FusedOp("Add", (4, 5)),
            FusedOp("Cast", (6,), (("to", 10),)),
            FusedOp("Cast", (6,), (("to", 1),)),
        ),
        (6, 7, 8),
    )
    return {sig.name: kernel_source(sig) for sig in (sample, gelus, bf16)}
