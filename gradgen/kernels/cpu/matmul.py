"""CPU kernels: MatMul, Gemm, Einsum and com.microsoft FusedMatMul (with its schema).

Shapes are checked up front so that a mismatch names both operands' shapes rather than
surfacing as numpy's generic error.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from gradgen.errors import KernelError, ModelError
from gradgen.kernels.cpu import blas
from gradgen.kernels.cpu.prepared import kernel_first
from gradgen.kernels.numeric import accumulation_dtype, broadcasts_to
from gradgen.kernels.table import MICROSOFT, cpu_kernel, cpu_prepare
from gradgen.ops import schemas
from gradgen.ops.einsum import check_label_sizes, explicit_equation, parse_equation
from gradgen.ops.matmul import check_fused_ranks, fused_matmul_output_dims, fused_operand_perm
from gradgen.ops.schemas import FLOATS, Attribute, Formal, Schema


def check_matmul_shapes(a_shape, b_shape) -> None:
    """MatMul's shape rules (numpy matmul's, 1-D operands included); KernelError when broken."""
    a_shape, b_shape = tuple(a_shape), tuple(b_shape)
    if len(a_shape) >= 2 and len(a_shape) == len(b_shape) and a_shape[-1] == b_shape[-2] and a_shape[:-2] == b_shape[:-2]:
        return  # the common case, without np.broadcast_shapes (microseconds on small operands)
    if not a_shape or not b_shape:
        raise KernelError(f"MatMul inputs must have rank >= 1, got shapes {list(a_shape)} and {list(b_shape)}")
    k_a = a_shape[-1]
    k_b = b_shape[0] if len(b_shape) == 1 else b_shape[-2]
    if k_a != k_b:
        raise KernelError(f"inner dimensions differ: A {list(a_shape)} has {k_a} columns, B {list(b_shape)} has {k_b} rows")
    try:
        np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
    except ValueError:
        raise KernelError(f"batch dimensions of A {list(a_shape)} and B {list(b_shape)} are not broadcastable") from None


def qlinear_operand_shape(value_shape, count: int | None, side: str, what: str) -> tuple[int, ...]:
    """The broadcast shape of a QLinearMatMul scale or zero point: a scalar, or one value per row
    of A (``side`` 'row': a_*, y_*, viewed as a column) or per column of B ('column': b_*)."""
    size = math.prod(value_shape)
    if len(value_shape) == 0 or size == 1 and len(value_shape) == 1:
        return ()
    if len(value_shape) != 1 or count is None or size != count:
        where = f"{count} {side}s" if count is not None else f"no {side}s (a 1-D operand)"
        raise KernelError(f"QLinearMatMul's {what} has shape {list(value_shape)}: a scalar or one value per {side} ({where})")
    return (count, 1) if side == "row" else (count,)


def qlinear_matmul_shapes(
    a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point
) -> dict[str, tuple[int, ...]]:
    """Each present scale / zero point's broadcast shape by its input name
    (``qlinear_operand_shape``), after MatMul's shape checks: a per-row value is a column against
    A and against the product, or a vector against the product of a 1-D B. Arrays of either
    device."""
    check_matmul_shapes(a.shape, b.shape)
    rows = a.shape[-2] if len(a.shape) >= 2 else None
    columns = b.shape[-1] if len(b.shape) >= 2 else None
    per_row = dict(a_scale=a_scale, a_zero_point=a_zero_point, y_scale=y_scale, y_zero_point=y_zero_point)
    per_column = dict(b_scale=b_scale, b_zero_point=b_zero_point)
    shapes = {name: qlinear_operand_shape(tuple(v.shape), rows, "row", name) for name, v in per_row.items() if v is not None}
    if len(b.shape) == 1:  # the product has no column axis: its rows are its last axis
        shapes |= {name: shape[:-1] for name, shape in shapes.items() if name != "a_zero_point"}
    shapes |= {
        name: qlinear_operand_shape(tuple(v.shape), columns, "column", name) for name, v in per_column.items() if v is not None
    }
    return shapes


@cpu_kernel("QLinearMatMul")
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point=None):
    """(a - a_zero_point) @ (b - b_zero_point), exact in float64, requantized with the ratio
    a_scale * b_scale / y_scale (per tensor, per row of A, per column of B) and y_zero_point
    (gradgen/kernels/cpu/quantize.py's ``requantize``)."""
    from gradgen.kernels.cpu.quantize import check_linear_quantized, requantize, requantized_type

    check_linear_quantized("QLinearMatMul", a, a_zero_point, b, b_zero_point, y_zero_point, (a_scale, b_scale, y_scale))
    inputs = dict(a_scale=a_scale, a_zero_point=a_zero_point, b_scale=b_scale, b_zero_point=b_zero_point, y_scale=y_scale)
    shapes = qlinear_matmul_shapes(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)
    view = {name: np.asarray(value).reshape(shapes[name]) for name, value in inputs.items() if value is not None}
    a_wide, b_wide = a.astype(np.float64), b.astype(np.float64)
    if a_zero_point is not None:
        a_wide -= view["a_zero_point"]
    if b_zero_point is not None:
        b_wide -= view["b_zero_point"]
    ratio = view["a_scale"] * view["b_scale"] / view["y_scale"]
    y_zp = None if y_zero_point is None else np.asarray(y_zero_point).reshape(shapes["y_zero_point"])
    return requantize(np.matmul(a_wide, b_wide), ratio, y_zp, requantized_type(y_zero_point, a.dtype))


@cpu_kernel("MatMul")
def matmul(a, b):
    check_matmul_shapes(a.shape, b.shape)
    dtype = a.dtype if a.dtype is b.dtype else np.result_type(a, b)
    return blas.matmul(a, b).astype(dtype, copy=False)


@cpu_prepare("MatMul")
def prepare_matmul(constants: tuple, attrs: dict):
    """The kernel's checks once per input signature (its first call with one runs the kernel); then
    the product ``blas.matmul`` would make, chosen once: numpy's matmul below oneDNN's size (a stack
    times a matrix as one product of its rows, as ``blas.matmul`` does), ``blas.matmul`` above. On
    a transformer's small products the checks (``np.broadcast_shapes`` for a 3-D times a 2-D
    operand) and the dispatch cost three times the arithmetic."""

    def signature(a, b) -> tuple:
        return a.shape, b.shape, a.dtype, b.dtype

    def plan(a, b):
        dtype = a.dtype if a.dtype is b.dtype else np.result_type(a, b)
        if not blas.below_onednn(a, b):
            return blas.matmul, None, dtype
        if b.ndim == 2 and a.ndim > 2 and a.shape[-1] == b.shape[0]:  # blas.matmul's rows product
            return np.matmul, (math.prod(a.shape[:-1]), a.shape[-1], a.shape[:-1] + (b.shape[1],)), dtype
        return np.matmul, None, dtype

    def fast(chosen, a, b):
        product, rows, dtype = chosen
        if rows is None:
            return product(a, b).astype(dtype, copy=False)
        count, inner, shape = rows
        return product(a.reshape(count, inner), b).reshape(shape).astype(dtype, copy=False)

    return kernel_first(matmul, signature, plan, fast, limit=64)


@cpu_kernel("Gemm")
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    if a.ndim != 2 or b.ndim != 2:
        raise KernelError(f"Gemm needs 2-D A and B, got shapes {list(a.shape)} and {list(b.shape)}")
    a2 = a.T if transA else a
    b2 = b.T if transB else b
    if a2.shape[1] != b2.shape[0]:
        raise KernelError(
            f"inner dimensions differ: op(A) is {list(a2.shape)}, op(B) is {list(b2.shape)} (transA={transA}, transB={transB})"
        )
    out_shape = (a2.shape[0], b2.shape[1])
    if c is not None and beta != 0 and c.shape != out_shape and not broadcasts_to(c.shape, out_shape):
        raise KernelError(f"C of shape {list(c.shape)} does not broadcast to the output shape {list(out_shape)}")
    return _gemm_arithmetic(a2, b2, c, alpha, beta)


def _gemm_arithmetic(a2, b2, c, alpha, beta, product=blas.matmul):
    """alpha * op(A) @ op(B) + beta * C in A's dtype, on checked operands: the kernel's and its
    prepared call's arithmetic (``product``: numpy's matmul itself where blas.matmul would pass
    the product on to it)."""
    out = product(a2, b2)
    if alpha != 1.0:
        out = alpha * out
    if c is not None and beta != 0:
        addend = beta * c if beta != 1.0 else c
        if type(out) is np.ndarray and addend.dtype == out.dtype and addend.ndim <= out.ndim:
            np.add(out, addend, out=out)  # the product is a fresh array of the output's shape
        else:
            out = out + addend
    return np.asarray(out).astype(a2.dtype, copy=False)


@cpu_prepare("Gemm")
def prepare_gemm(constants: tuple, attrs: dict):
    """The kernel's checks once per input signature (its first call with one runs the kernel); then
    the same products and sums without them: a small Gemm's checks cost as much as its arithmetic."""
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    trans_a, trans_b = attrs.get("transA", 0), attrs.get("transB", 0)

    def signature(a, b, c=None) -> tuple:
        return a.shape, b.shape, a.dtype, b.dtype, None if c is None else (c.shape, c.dtype)

    def product_for(a, b, c=None):
        """numpy's matmul for a product below blas.matmul's oneDNN size, else blas.matmul."""
        return np.matmul if blas.below_onednn(a.T if trans_a else a, b.T if trans_b else b) else blas.matmul

    def fast(product, a, b, c=None):
        return _gemm_arithmetic(a.T if trans_a else a, b.T if trans_b else b, c, alpha, beta, product)

    return kernel_first(lambda *args: gemm(*args, **attrs), signature, product_for, fast, limit=64)


EINSUM_BLAS_ELEMENTS = 1 << 12  # operand size from which Einsum contracts through BLAS


@functools.lru_cache(maxsize=256)
def _parsed_equation(equation: str, ranks: tuple[int, ...]):
    """(the equation with every ellipsis made explicit for these operand ranks, its text), parsed
    once per equation and ranks; an invalid equation raises again on each call (not cached)."""
    explicit = explicit_equation(parse_equation(equation, len(ranks)), list(ranks))
    return explicit, str(explicit)


@cpu_kernel("Einsum")
def einsum(*inputs, equation):
    """Any equation (diagonals, ellipsis anywhere, implicit output: gradgen.ops.einsum), run by numpy
    in its explicit form; the result never shares memory with an input (numpy's diagonal is a view)."""
    ranks = tuple(x.ndim for x in inputs)
    explicit, text = _parsed_equation(equation, ranks)
    # optimize: contractions through BLAS (tensordot), not numpy's own loops (8x slower on a 1024^3
    # GEMM); its path search costs about 10 us a call, more than a small contraction itself
    optimize = len(inputs) > 1 and max(x.size for x in inputs) >= EINSUM_BLAS_ELEMENTS
    try:
        out = np.einsum(text, *inputs, optimize=optimize)
    except ValueError as exc:
        check_label_sizes(explicit, [x.shape for x in inputs])  # the clearer message, where it applies
        raise KernelError(f"equation {equation!r} with shapes {[list(x.shape) for x in inputs]}: {exc}") from None
    out = np.asarray(out).astype(np.result_type(*inputs), copy=False)
    return out.copy() if any(np.may_share_memory(out, x) for x in inputs) else out


# ---------------------------------------------------------------------------------------------
# FusedMatMul (com.microsoft)


def _fused_matmul_types(infos, attrs):
    """(dtype, shape) of Y: A's type, the output dims of ``gradgen.ops.matmul``."""
    a, b = infos
    dtype = a.dtype if a.dtype is not None else b.dtype
    if a.shape is None or b.shape is None:
        return [(dtype, None)]
    flags = {k: int(attrs.get(k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")}
    try:
        dims = fused_matmul_output_dims(a.shape, b.shape, **flags)
    except KernelError as exc:
        raise ModelError(f"com.microsoft::FusedMatMul of shapes {list(a.shape)} and {list(b.shape)} ({flags}): {exc}") from None
    return [(dtype, tuple(dims))]


FUSED_MATMUL = schemas.declare(
    Schema(
        # ONNX Runtime's contract (contrib_defs.cc); its CPU provider runs it for float32.
        "FusedMatMul",
        inputs=(Formal("A", FLOATS), Formal("B", FLOATS)),
        outputs=(Formal("Y", FLOATS),),
        attributes=(
            Attribute("alpha", "float", 1.0),
            Attribute("transA", "int", 0),
            Attribute("transB", "int", 0),
            Attribute("transBatchA", "int", 0),
            Attribute("transBatchB", "int", 0),
        ),
        infer=_fused_matmul_types,
    )
)


@cpu_kernel("FusedMatMul", domain=MICROSOFT)
def fused_matmul(A, B, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * MatMul(op(A), op(B)) (``gradgen.ops.matmul``): numpy's matmul on transposed views, no copy
    (16-bit floats accumulate in float32)."""
    check_fused_ranks(A.ndim, B.ndim, bool(transBatchA), bool(transBatchB))
    a = fused_operand(A, transA, transBatchA)
    b = fused_operand(B, transB, transBatchB)
    try:
        check_matmul_shapes(a.shape, b.shape)
    except KernelError as exc:
        raise KernelError(
            f"FusedMatMul of shapes {list(A.shape)} and {list(B.shape)} (transA={transA}, transB={transB}, "
            f"transBatchA={transBatchA}, transBatchB={transBatchB}): {exc}"
        ) from None
    ct = accumulation_dtype(A.dtype)
    y = np.asarray(blas.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)))
    if float(alpha) != 1.0:
        y = y * ct.type(alpha)
    return y.astype(A.dtype, copy=False)


@cpu_prepare("FusedMatMul", domain=MICROSOFT)
def prepare_fused_matmul(constants: tuple, attrs: dict):
    """The kernel's calls with the operands' transposes and the shape checks done once per pair of
    input shapes (the first call with a pair runs the kernel, which says what does not fit)."""
    flags = {k: int(attrs.get(k, 0)) for k in ("transA", "transB", "transBatchA", "transBatchB")}
    alpha = float(attrs.get("alpha", 1.0))

    def perms(A, B) -> tuple:
        return (
            fused_operand_perm(A.ndim, bool(flags["transA"]), bool(flags["transBatchA"])),
            fused_operand_perm(B.ndim, bool(flags["transB"]), bool(flags["transBatchB"])),
        )

    def fast(plan, A, B):
        perm_a, perm_b = plan
        ct = accumulation_dtype(A.dtype)
        a = A if perm_a is None else A.transpose(perm_a)
        b = B if perm_b is None else B.transpose(perm_b)
        y = np.asarray(blas.matmul(a.astype(ct, copy=False), b.astype(ct, copy=False)))
        if alpha != 1.0:
            y = y * ct.type(alpha)
        return y.astype(A.dtype, copy=False)

    return kernel_first(
        lambda A, B: fused_matmul(A, B, **attrs), lambda A, B: (A.shape, B.shape, A.dtype, B.dtype), perms, fast, limit=64
    )


def fused_operand(X, trans, trans_batch):
    """op(X) as a view of X (``gradgen.ops.matmul.fused_operand_perm``)."""
    perm = fused_operand_perm(X.ndim, bool(trans), bool(trans_batch))
    return X if perm is None else X.transpose(perm)


@cpu_kernel("Det")
def det(x):
    """Determinants of the trailing square matrices of X (..., M, M)."""
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise KernelError(f"X must end in square matrices, got shape {list(x.shape)}")
    ct = accumulation_dtype(x.dtype)
    return np.asarray(np.linalg.det(x.astype(ct, copy=False))).astype(x.dtype, copy=False)


def dft_axis_and_length(shape, dft_length, axis_value, axis, inverse, onesided) -> tuple[int, int]:
    """DFT's transformed axis (normalised) and transform length n, checked as the CPU kernel checks
    them (the CUDA launcher shares this): X ends in 1 or 2 (real, or real and imaginary parts); the
    axis is the input of opset 20, else the attribute of opset 17, default -2, and not the last; n is
    dft_length, by default the axis' size (2 * (size - 1) for a one-sided inverse)."""
    rank = len(shape)
    if rank < 2 or shape[-1] not in (1, 2):
        raise KernelError(f"X must end in a dimension of 1 (real) or 2 (complex), got shape {list(shape)}")
    chosen = int(np.asarray(axis_value).reshape(-1)[0]) if axis_value is not None else -2 if axis is None else int(axis)
    if not -rank <= chosen < rank:
        raise KernelError(f"axis {chosen} is out of range for X of rank {rank}")
    chosen %= rank
    if chosen == rank - 1:
        raise KernelError("axis may not be the last axis of X (the real / imaginary one)")
    size = int(shape[chosen])
    n = int(np.asarray(dft_length).reshape(-1)[0]) if dft_length is not None else 2 * (size - 1) if inverse and onesided else size
    if n < 1:
        raise KernelError(f"the transform length must be positive, got {n}")
    return chosen, n


@cpu_kernel("DFT")
def dft(x, dft_length=None, axis_value=None, *, axis=None, inverse=0, onesided=0):
    """The discrete Fourier transform of X (..., 1 or 2: real, or real and imaginary parts) along
    an axis (the input of opset 20, else the attribute of opset 17; default -2, which is opset 17's
    default 1 for the usual (batch, signal, 1 or 2) input), as ONNX's reference computes it: zero
    padding or truncation to dft_length; onesided keeps the first n // 2 + 1 frequencies of a
    forward transform, and makes an inverse one real (numpy's irfft)."""
    chosen, n = dft_axis_and_length(x.shape, dft_length, axis_value, axis, inverse, onesided)
    signal = x[..., 0] if x.shape[-1] == 1 else x[..., 0] + 1j * x[..., 1]
    if inverse and onesided:
        return np.fft.irfft(signal, n=n, axis=chosen)[..., None].astype(x.dtype)
    out = np.fft.ifft(signal, n=n, axis=chosen) if inverse else np.fft.fft(signal, n=n, axis=chosen)
    if onesided:
        out = np.take(out, np.arange(n // 2 + 1), axis=chosen)
    return np.stack([out.real, out.imag], axis=-1).astype(x.dtype)


@cpu_kernel("STFT")
def stft(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """Short-time Fourier transform of signal (batch, length, 1 or 2): frames of the window's
    length every frame_step samples, times the window, each transformed (DFT) over frame_length
    (the window's length when both are given; default: the signal's), one-sided by default (ONNX's
    reference)."""
    if signal.ndim != 3 or signal.shape[-1] not in (1, 2):
        raise KernelError(f"signal must be (batch, length, 1 or 2), got shape {list(signal.shape)}")
    step = int(np.asarray(frame_step).reshape(-1)[0])
    length = signal.shape[1]
    n = int(np.asarray(frame_length).reshape(-1)[0]) if frame_length is not None else None
    width = window.shape[0] if window is not None else n if n is not None else length
    if n is not None and n != width:
        raise KernelError(f"the window has {width} samples but frame_length is {n}; ONNX wants them equal")
    n = width
    if step < 1 or width < 1 or width > length:
        raise KernelError(f"frame_step {step} and a window of {width} do not fit a signal of {length} samples")
    starts = np.arange(1 + (length - width) // step) * step
    frames = signal[:, starts[:, None] + np.arange(width)[None, :]]  # (batch, frames, width, 1 or 2)
    if window is not None:
        frames = frames * window.reshape(1, 1, width, 1)
    return dft(frames, np.array(n), np.array(2), onesided=int(onesided))
