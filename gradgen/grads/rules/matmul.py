"""Gradient rules: MatMul, Gemm and Einsum.

MatMul follows numpy: 1-D operands get a unit axis (prepended for A, appended for B) that the
result drops, and batch dims broadcast. The gradient of each operand is a batched product over the
broadcast batch dims, then summed back to the operand's own batch dims: statically when the
shapes tell which dims were broadcast, else through Shape -> BroadcastGradientArgs on the batch
parts of the two shapes. A transposed operand is a flag of com.microsoft FusedMatMul (ONNX Runtime's
op; lowered back to Transpose + MatMul in portable mode), as Gemm's flags serve the 2-D products.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.builder import MICROSOFT, dims_of, numpy_dtype_of, same_dim
from gradgen.errors import KernelError, ModelError
from gradgen.grads.table import grad_rule, non_differentiable
from gradgen.ops.einsum import ELLIPSIS, Equation, explicit_equation, fresh_letters, parse_equation

_ABSENT = object()


def _product(g, a, b, *, trans_a: int = 0, trans_b: int = 0) -> ir.Value:
    """MatMul(op(a), op(b)) with op a transpose of the last two axes where asked: one com.microsoft
    FusedMatMul carrying the flags (a GEMM with transpose flags on either device, ONNX Runtime's op),
    not a materialised Transpose feeding a MatMul. The lowering (``--portable``) spells it out again."""
    if not (trans_a or trans_b):
        return g.op("MatMul", a, b)
    return g.op("FusedMatMul", a, b, domain=MICROSOFT, transA=trans_a or None, transB=trans_b or None)


def _batch_reduce_axes(mine: list, other: list) -> list[int] | None:
    """Axes of the broadcast batch shape to sum for the operand with batch dims ``mine``."""
    n = max(len(mine), len(other))
    axes = []
    for k in range(n):
        d = mine[k - (n - len(mine))] if k >= n - len(mine) else _ABSENT
        o = other[k - (n - len(other))] if k >= n - len(other) else _ABSENT
        if d is _ABSENT:
            axes.append(k)
        elif o is _ABSENT or same_dim(d, o) or o == 1:
            continue
        elif d == 1:
            axes.append(k)  # harmless if the other turns out to be 1 as well
        elif isinstance(d, int):
            continue  # a static size above 1 is the broadcast size itself
        else:
            return None
    return axes


def _sum_to(g, grad, x, x2_rank, mine, other, x2_shape, other2_shape):
    """Sum ``grad`` (broadcast batch dims + 2 matrix dims) down to operand ``x``'s shape."""
    axes = _batch_reduce_axes(mine, other) if mine is not None and other is not None else None
    if axes is not None:
        if axes:
            grad = g.reduce_sum(grad, axes, keepdims=1)
        n = max(len(mine), len(other))
        if x2_rank != g.rank(x) or n > len(mine):
            grad = g.reshape_like(grad, x)
        return grad
    # Shapes decide only at run time: BroadcastGradientArgs on the batch parts.
    start, stop = g.ints([0]), g.ints([-2])
    mine_shape = g.op("Slice", x2_shape, start, stop)
    other_shape = g.op("Slice", other2_shape, start, stop)
    axes_value, _ = g.op_multi("BroadcastGradientArgs", [mine_shape, other_shape], 2, domain=MICROSOFT)
    axes_value.type = ir.TensorType(ir.DataType.INT64)
    axes_value.shape = ir.Shape([None])
    grad = g.reduce_sum(grad, axes_value, keepdims=1, noop_with_empty_axes=1)
    return g.reshape_like(grad, x)


def _matmul_with_matrix(g, a, b, dy, ra):
    """A (..., K) times a plain matrix B (K, N), as a Linear layer is exported: the batch dims fold
    into rows, so dB = A2^T dY2 is one GEMM summing over every row (not a batched product of
    shape (..., K, N) summed afterwards, which for an LM head is gigabytes) and dA = dY2 B^T;
    Gemm's transpose flags replace materialised transposes."""
    grads = [None, None]
    rows_dy = g.op("Flatten", dy, axis=ra - 1)
    if g.needs(0):
        grads[0] = g.reshape_like(g.op("Gemm", rows_dy, b, transB=1), a)
    if g.needs(1):
        grads[1] = g.op("Gemm", g.op("Flatten", a, axis=ra - 1), rows_dy, transA=1)
    return grads


@grad_rule("MatMul")
def matmul(g):
    a, b, dy = g.x(0), g.x(1), g.dy()
    ra, rb = g.rank(a), g.rank(b)
    if ra is None or rb is None:
        raise ModelError(
            f"MatMul node {g.node.name!r}: the ranks of its inputs are unknown; its gradient needs them "
            "(give the model's inputs shapes; where they have shapes, shape inference stopped before this "
            "node, often because the model's shapes disagree: `gradgen run` on the forward model names the "
            "node that fails)"
        )
    if ra >= 3 and rb == 2:
        return _matmul_with_matrix(g, a, b, dy, ra)
    a2 = g.unsqueeze(a, [0]) if ra == 1 else a
    b2 = g.unsqueeze(b, [1]) if rb == 1 else b
    ra2, rb2 = max(ra, 2), max(rb, 2)
    if ra == 1 and rb == 1:
        dy2 = g.unsqueeze(dy, [0, 1])
    elif ra == 1:
        dy2 = g.unsqueeze(dy, [-2])
    elif rb == 1:
        dy2 = g.unsqueeze(dy, [-1])
    else:
        dy2 = dy
    da_dims, db_dims = dims_of(a), dims_of(b)
    batch_a = da_dims[:-2] if ra >= 2 else []
    batch_b = db_dims[:-2] if rb >= 2 else []
    shape_a2 = g.shape_of(a) if ra >= 2 else g.ints([1, 1])  # only the (empty) batch part is read
    shape_b2 = g.shape_of(b) if rb >= 2 else g.ints([1, 1])
    grads = [None, None]
    if g.needs(0):
        da = _product(g, dy2, b2, trans_b=1)  # dA = dY B^T
        grads[0] = _sum_to(g, da, a, ra2, batch_a, batch_b, shape_a2, shape_b2)
    if g.needs(1):
        db = _product(g, a2, dy2, trans_a=1)  # dB = A^T dY
        grads[1] = _sum_to(g, db, b, rb2, batch_b, batch_a, shape_b2, shape_a2)
    return grads


@grad_rule("Gemm")
def gemm(g):
    """Y = alpha * A' B' + beta * C, A' = A or A^T (transA), B' likewise; C broadcasts to (M, N)."""
    a, b, c, dy = g.x(0), g.x(1), g.x(2), g.dy()
    alpha, beta = float(g.attr("alpha", 1.0)), float(g.attr("beta", 1.0))
    ta, tb = int(g.attr("transA", 0)), int(g.attr("transB", 0))
    grads = [None, None, None]
    scale = None if alpha == 1.0 else alpha
    if g.needs(0):
        # dA' = dY B'^T; dA = dA' or its transpose.
        if ta:
            grads[0] = g.op("Gemm", b, dy, transA=tb, transB=1, alpha=scale)
        else:
            grads[0] = g.op("Gemm", dy, b, transA=0, transB=1 - tb, alpha=scale)
    if g.needs(1):
        # dB' = A'^T dY; dB = dB' or its transpose.
        if tb:
            grads[1] = g.op("Gemm", dy, a, transA=1, transB=ta, alpha=scale)
        else:
            grads[1] = g.op("Gemm", a, dy, transA=1 - ta, transB=0, alpha=scale)
    if c is not None and g.needs(2):
        dc = dy if beta == 1.0 else g.op("Mul", dy, g.const_like(c, beta))
        grads[2] = g.unbroadcast(dc, c, g.y(), None)
    return grads[: len(g.node.inputs)]


# -- Einsum -----------------------------------------------------------------------------------

# A diagonal's identity matrix up to this many elements is a constant; a larger one is built at run time.
_CONST_IDENTITY_ELEMENTS = 4096


def _explicit_einsum(g) -> Equation:
    """The node's equation with its output explicit and its ellipsis spelled out in fresh letters
    (which needs the operands' ranks)."""
    equation = g.attr("equation")
    try:
        parsed = parse_equation(equation, len(g.node.inputs))
        if not any(ELLIPSIS in t for t in (*parsed.inputs, parsed.output)):
            return parsed
        ranks = [g.rank(x) for x in g.node.inputs]
        unknown = [k for k, r in enumerate(ranks) if r is None]
        if unknown:
            raise ModelError(
                f"Einsum node {g.node.name!r}: equation {equation!r} has an ellipsis and the rank of input "
                f"{unknown[0]} is unknown; its gradient needs every operand's rank"
            )
        return explicit_equation(parsed, ranks)
    except KernelError as exc:
        raise ModelError(f"Einsum node {g.node.name!r}: {exc}") from None


def _broadcast_dim(dims: list):
    """The size numpy's broadcasting gives a label seen with these dims (int, symbol or None)."""
    big = {d for d in dims if d != 1}
    if not big:
        return 1
    known = {d for d in big if isinstance(d, int)}
    if len(known) == 1:
        return known.pop()
    return big.pop() if len(big) == 1 else None


@grad_rule("Einsum")
def einsum(g):
    """dX_i = einsum(dY, the other operands -> X_i's own labels), laid out as X_i's term.

    Any equation: the ellipsis becomes fresh letters and the output is made explicit first. A label
    repeated within X_i (a diagonal, 'bii->b') puts the gradient on that diagonal: one more Einsum
    with an identity matrix per extra occurrence. A label found only in X_i (summed within it) is
    restored by Unsqueeze + Expand. Dims that X_i broadcast (size 1 against a larger size) are
    summed back; dims broadcast against X_i are expanded.
    """
    equation = _explicit_einsum(g)
    term_dims = []  # per operand: its dims (int, symbol or None), one per label
    for term, x in zip(equation.inputs, g.node.inputs):
        x_dims = dims_of(x)
        term_dims.append(x_dims if x_dims is not None and len(x_dims) == len(term) else [None] * len(term))
    return [_einsum_operand_grad(g, equation, term_dims, i) if g.needs(i) else None for i in range(len(equation.inputs))]


def _einsum_operand_grad(g, equation: Equation, term_dims: list[list], i: int) -> ir.Value:
    x, term = g.x(i), equation.inputs[i]
    others = [t for j, t in enumerate(equation.inputs) if j != i]
    available = set(equation.output).union(*others)
    kept = [lab for lab in dict.fromkeys(term) if lab in available]

    def size(lab: str):
        """The label's size in the contraction: the broadcast of every operand's dims for an output
        label (that is dY's), else of the other operands' dims."""
        seen = [
            d
            for j, t in enumerate(equation.inputs)
            if j != i or lab in equation.output
            for lab2, d in zip(t, term_dims[j])
            if lab2 == lab
        ]
        return _broadcast_dim(seen)

    if not others and kept == list(equation.output):
        grad = g.dy()
    else:
        contraction = Equation((equation.output, *others), tuple(kept))
        grad = g.op("Einsum", g.dy(), *[g.x(j) for j in range(len(equation.inputs)) if j != i], equation=str(contraction))
    grad, sizes = _lay_out_as_term(g, equation, i, grad, kept, {lab: size(lab) for lab in kept}, term_dims[i])
    return _fit_to_operand(g, x, grad, sizes, term_dims[i])


def _lay_out_as_term(g, equation: Equation, i: int, grad: ir.Value, kept: list[str], kept_sizes: dict, x_dims: list):
    """``grad`` (labelled ``kept``) laid out as X_i's term: on the diagonal of a repeated label
    (times an identity matrix per extra occurrence), with a unit axis for a label found only in
    X_i. Returns it and its dims per axis (int, symbol or None)."""
    term = equation.inputs[i]
    x = g.x(i)
    extra = [k for k, lab in enumerate(term) if lab in term[:k]]
    fresh = dict(zip(extra, fresh_letters(equation.letters(), len(extra), equation))) if extra else {}
    layout, sizes, unit_axes, identities = [], [], [], []
    for k, lab in enumerate(term):
        first = term.index(lab)
        if lab in kept_sizes:
            dim = kept_sizes[lab]
        else:  # found only in X_i: its own size
            dim = _broadcast_dim([d for lab2, d in zip(term, x_dims) if lab2 == lab])
        if k != first:
            if lab in kept_sizes and not isinstance(dim, int):
                n = g.part(g.shape_of(grad), kept.index(lab), kept.index(lab) + 1)
            elif not isinstance(dim, int):
                n = g.part(g.shape_of(x), first, first + 1)
            else:
                n = dim
            identities.append((lab + fresh[k], _identity(g, n, x)))
            layout.append(fresh[k])
        elif lab in kept_sizes or term.count(lab) > 1:
            layout.append(lab)
        else:
            unit_axes.append(k)
            dim = 1
        sizes.append(dim)
    if identities:
        embed = Equation((tuple(kept), *(tuple(t) for t, _ in identities)), tuple(layout))
        grad = g.op("Einsum", grad, *[v for _, v in identities], equation=str(embed))
    if unit_axes:
        grad = g.unsqueeze(grad, unit_axes)
    return grad, sizes


def _identity(g, n: int | ir.Value, like: ir.Value) -> ir.Value:
    """An n x n identity matrix of like's element type (n an int or a 1-element int64 vector)."""
    dtype = numpy_dtype_of(like)
    if isinstance(n, int) and n * n <= _CONST_IDENTITY_ELEMENTS:
        return g.const(np.eye(n, dtype=dtype))
    count = g.scalar(n) if isinstance(n, int) else g.reshape(n, [])
    steps = g.op("Range", g.scalar(0), count, g.scalar(1))
    same = g.op("Equal", g.unsqueeze(steps, [1]), g.unsqueeze(steps, [0]))
    return g.op("Cast", same, to=ir.DataType.from_numpy(dtype))


def _fit_to_operand(g, x: ir.Value, grad: ir.Value, sizes: list, x_dims: list) -> ir.Value:
    """Sum the axes X broadcast (its size 1 against a larger one), expand those broadcast against
    it; decided from the dims where they tell, else at run time (BroadcastGradientArgs)."""
    reduce_axes, expand, dynamic = [], False, False
    for k, (d, s) in enumerate(zip(x_dims, sizes)):
        if same_dim(d, s):
            continue
        if d == 1:
            reduce_axes.append(k)
        elif s == 1 or isinstance(d, int):  # grad's size is 1 or d: Expand makes it d
            expand = True
        else:
            dynamic = True
    if dynamic:
        axes = g.op_multi("BroadcastGradientArgs", [g.shape_of(x), g.shape_of(grad)], 2, domain=MICROSOFT)[0]
        axes.type, axes.shape = ir.TensorType(ir.DataType.INT64), ir.Shape([None])
        return g.expand_like(g.reduce_sum(grad, axes, keepdims=1, noop_with_empty_axes=1), x)
    if reduce_axes:
        grad = g.reduce_sum(grad, reduce_axes, keepdims=1)
    return g.expand_like(grad, x) if expand else grad


# QLinearMatMul's output is an integer (quantized) tensor: no gradient leaves it, so none reaches its
# float scales.
non_differentiable("QLinearMatMul")


@grad_rule("FusedMatMul", domain=MICROSOFT)
def fused_matmul(g):
    """Y = alpha op(A) op(B), op a transpose of the last two axes where transA / transB ask (the op
    gradgen's own MatMul gradients emit, so a backward graph can be differentiated again):

        dA = alpha (transA ? op(B) dY^T : dY op(B)^T),   dB = alpha (transB ? dY^T op(A) : op(A)^T dY)

    each a FusedMatMul again, summed over broadcast batch dims as MatMul's are."""
    a, b, dy = g.x(0), g.x(1), g.dy()
    ta, tb = int(g.attr("transA", 0)), int(g.attr("transB", 0))
    ra, rb = g.rank(a), g.rank(b)
    if int(g.attr("transBatchA", 0)) or int(g.attr("transBatchB", 0)):
        raise ModelError(f"FusedMatMul node {g.node.name!r}: no gradient for transBatchA / transBatchB")
    if ra is None or rb is None or ra < 2 or rb < 2:
        raise ModelError(
            f"FusedMatMul node {g.node.name!r}: its gradient needs both inputs of known rank >= 2 (ranks {ra}, {rb})"
        )
    alpha = float(g.attr("alpha", 1.0))
    batch_a, batch_b = dims_of(a)[:-2], dims_of(b)[:-2]
    shape_a, shape_b = g.shape_of(a), g.shape_of(b)
    grads = [None, None]
    if g.needs(0):
        da = _product(g, b, dy, trans_a=tb, trans_b=1) if ta else _product(g, dy, b, trans_b=1 - tb)
        grads[0] = _sum_to(g, _scaled(g, da, alpha), a, ra, batch_a, batch_b, shape_a, shape_b)
    if g.needs(1):
        db = _product(g, dy, a, trans_a=1, trans_b=ta) if tb else _product(g, a, dy, trans_a=1 - ta)
        grads[1] = _sum_to(g, _scaled(g, db, alpha), b, rb, batch_b, batch_a, shape_b, shape_a)
    return grads


def _scaled(g, x, alpha: float):
    """x * alpha, in the type of the node's inputs."""
    return x if alpha == 1.0 else g.op("Mul", x, g.const_like(g.x(0), alpha))


@grad_rule("Det")
def det(g):
    """d det(A) / dA is A's cofactor matrix, C[i, j] = (-1)^(i+j) det(A without row i and column
    j): the minors are gathered (static M) and given to Det, which stays exact for a singular A,
    unlike det(A) * inverse(A)^T."""
    a = g.x(0)
    dims = dims_of(a)
    size = dims[-1] if dims is not None and len(dims) >= 2 else None
    if not isinstance(size, int):
        raise ModelError(f"Det node {g.node.name!r}: its gradient needs the matrix size (the last dimension of X) static")
    spread = g.unsqueeze(g.dy(), [-2, -1])
    if size == 1:
        return [spread]
    batch = len(dims) - 2
    others = g.const(np.array([[k for k in range(size) if k != i] for i in range(size)], dtype=np.int64))
    rows = g.op("Gather", a, others, axis=-2)  # (..., i, M-1, M)
    minors = g.op("Gather", rows, others, axis=-1)  # (..., i, M-1, j, M-1)
    minors = g.transpose(minors, [*range(batch), batch, batch + 2, batch + 1, batch + 3])
    signs = np.array([[(-1.0) ** (i + j) for j in range(size)] for i in range(size)], dtype=numpy_dtype_of(a))
    cofactors = g.op("Mul", g.op("Det", minors), g.const(signs))
    return [g.op("Mul", spread, cofactors)]


@grad_rule("DFT", nondiff_inputs=(1, 2))
def dft(g):
    """DFT is real-linear in X; its transpose, per form (n the transform length, F the forward DFT,
    F^H = n * inverse DFT):

    - forward: dX = F^H dY, with dY zero-padded to n first when onesided;
    - inverse (F^H / n): dX = F dY / n;
    - inverse onesided (irfft): dX = c / n * rfft(dY), c = 1 at frequency 0 (and n / 2 for an even
      n), 2 elsewhere: the Hermitian halves that irfft adds up;

    then the real part for a real X, and back to X's length along the axis (the transpose of the
    padding or truncation to n). dft_length and the axis must be constant, the length static."""
    x, dy = g.x(0), g.dy()
    dims = dims_of(x)
    if dims is None:
        raise ModelError(f"DFT node {g.node.name!r}: its gradient needs the rank of X")
    rank = len(dims)
    axis, n, size = _dft_geometry(g, dims)
    inverse, onesided = bool(g.attr("inverse", 0)), bool(g.attr("onesided", 0))
    kept = n // 2 + 1  # frequencies of a one-sided spectrum
    if inverse and onesided:
        weights = np.full(kept, 2.0)
        weights[0] = 1.0
        if n % 2 == 0:
            weights[-1] = 1.0
        shape = [1] * (rank - 1)
        shape[axis] = kept
        spectrum = _emit_dft(g, dy, n, axis, inverse=False, onesided=True)
        dx = g.op("Mul", spectrum, g.const((weights / n).reshape(*shape, 1).astype(numpy_dtype_of(x))))
        dx = _dft_fit_length(g, dx, axis, kept, size, rank)
    else:
        if onesided:  # forward one-sided: the dropped frequencies got no gradient
            dy = _dft_fit_length(g, dy, axis, kept, n, rank)
        dx = _emit_dft(g, dy, n, axis, inverse=not inverse, onesided=False)
        dx = g.op("Mul", dx, g.const_like(x, float(n) if not inverse else 1.0 / n))
        dx = _dft_fit_length(g, dx, axis, n, size, rank)
    if dims[-1] == 1:
        dx = g.op("Slice", dx, g.ints([0]), g.ints([1]), g.ints([-1]))
    return [dx] + [None] * (len(g.node.inputs) - 1)


def _dft_geometry(g, dims) -> tuple[int, int, int]:
    """(axis, transform length, X's length along the axis), all static."""
    where = f"DFT node {g.node.name!r}"
    rank = len(dims)
    if len(g.node.inputs) > 2 and g.x(2) is not None:
        axis_value = g.input_const(2)
        if axis_value is None:
            raise ModelError(f"{where}: its gradient needs the axis input constant")
        axis = int(np.asarray(axis_value).reshape(-1)[0])
    else:
        axis = int(g.attr("axis", 1 if g.opset < 20 else -2))
    axis %= rank
    size = dims[axis]
    if g.x(1) is not None:
        length = g.input_const(1)
        if length is None:
            raise ModelError(f"{where}: its gradient needs dft_length constant")
        n = int(np.asarray(length).reshape(-1)[0])
    elif isinstance(size, int):
        n = 2 * (size - 1) if g.attr("inverse", 0) and g.attr("onesided", 0) else size
    else:
        n = None
    if n is None or not isinstance(size, int):
        raise ModelError(f"{where}: its gradient needs the length of X along axis {axis} static")
    return axis, n, size


def _emit_dft(g, v, n: int, axis: int, *, inverse: bool, onesided: bool):
    """DFT(v) of length n along ``axis``, in the model's opset's form (axis an input from 20)."""
    attrs = {"inverse": int(inverse), "onesided": int(onesided)}
    if g.opset >= 20:
        return g.op("DFT", v, g.scalar(n), g.scalar(axis), **attrs)
    return g.op("DFT", v, g.scalar(n), axis=axis, **attrs)


def _dft_fit_length(g, v, axis: int, have: int, want: int, rank: int):
    """v (length ``have`` along axis) zero-padded at the end or cut to length ``want``."""
    if have == want:
        return v
    if have > want:
        return g.op("Slice", v, g.ints([0]), g.ints([want]), g.ints([axis]))
    pads = [0] * (2 * rank)
    pads[rank + axis] = want - have
    return g.op("Pad", v, g.ints(pads))


@grad_rule("STFT", nondiff_inputs=(1, 3))
def stft(g):
    """STFT is differentiated in its standard-op form (gradgen.passes.DecomposePass): framing by a
    Gather, the window by a Mul, then DFT, whose rule differentiates the signal and the window. The
    pass leaves in place a node whose frames are not known before running it."""
    raise ModelError(
        f"STFT node {g.node.name!r} reached the gradient pass: gradgen differentiates STFT in its standard-op "
        "form, which gradgen.passes.DecomposePass (in build_backward's pipeline) makes for a static signal length, "
        "a constant frame_step and a known frame length only"
    )
