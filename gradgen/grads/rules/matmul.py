"""Gradient rules: MatMul, Gemm and Einsum.

MatMul follows numpy: 1-D operands get a unit axis (prepended for A, appended for B) that the
result drops, and batch dims broadcast. The gradient of each operand is a batched product over the
broadcast batch dims, then summed back to the operand's own batch dims: statically when the
shapes tell which dims were broadcast, else through Shape -> BroadcastGradientArgs on the batch
parts of the two shapes. A transposed operand is a flag of com.microsoft FusedMatMul (ONNX Runtime's
op; lowered back to Transpose + MatMul in portable mode), as Gemm's flags serve the 2-D products.
"""

from __future__ import annotations

import onnx_ir as ir

from gradgen.builder import MICROSOFT, dims_of, same_dim
from gradgen.errors import ModelError
from gradgen.grads.table import grad_rule

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
            f"MatMul node {g.node.name!r}: the ranks of its inputs are unknown; "
            "its gradient needs them (run shape inference or give the inputs shapes)"
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


def _parse_einsum(g) -> tuple[list[str], str]:
    """(operand subscripts, output subscripts), explicit; '...' kept as is."""
    equation = g.attr("equation").replace(" ", "")
    if "->" in equation:
        lhs, out = equation.split("->")
    else:
        lhs, out = equation, None
    terms = lhs.split(",")
    if len(terms) != len(g.node.inputs):
        raise ModelError(
            f"Einsum node {g.node.name!r}: equation {equation!r} has {len(terms)} operand(s) "
            f"but the node has {len(g.node.inputs)} input(s)"
        )
    if out is None:  # implicit output: letters used once, sorted; '...' first
        letters = "".join(t.replace("...", "") for t in terms)
        out = ("..." if any("..." in t for t in terms) else "") + "".join(
            sorted(ch for ch in set(letters) if letters.count(ch) == 1)
        )
    for term in terms + [out]:
        letters = term.replace("...", "")
        if len(set(letters)) != len(letters) or term.count("...") > 1 or "." in letters:
            raise ModelError(
                f"Einsum node {g.node.name!r}: equation {equation!r} repeats an index within one "
                "term (a diagonal); its gradient is not supported"
            )
    return terms, out


def _letters(term: str) -> list[str]:
    """The term as a list of labels, '...' being one label."""
    out, i = [], 0
    while i < len(term):
        if term.startswith("...", i):
            out.append("...")
            i += 3
        else:
            out.append(term[i])
            i += 1
    return out


@grad_rule("Einsum")
def einsum(g):
    """dX_i = einsum(dY, the other operands -> X_i's subscripts).

    A label of X_i found neither in the output nor in another operand (summed within X_i alone) is
    left out of that product and restored by Unsqueeze + Expand. An ellipsis must lead the
    operand's subscripts (its broadcast dims are then summed back like any broadcast).
    """
    terms, out = _parse_einsum(g)
    dy = g.dy()
    grads = []
    for i, term in enumerate(terms):
        if not g.needs(i):
            grads.append(None)
            continue
        x = g.x(i)
        labels = _letters(term)
        if "..." in labels and (labels[0] != "..." or "..." not in out):
            raise ModelError(
                f"Einsum node {g.node.name!r}: equation {g.attr('equation')!r}: an ellipsis that is not "
                "leading, or that is summed away, is not supported by its gradient"
            )
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(_letters(out))
        for t in others:
            available.update(_letters(t))
        kept = [lab for lab in labels if lab in available]
        missing = [k for k, lab in enumerate(labels) if lab not in available]
        # numpy (and so ONNX) cannot sum an ellipsis away in explicit mode: keep it, then sum it.
        sum_ellipsis = "..." in out and "..." not in labels
        result = ("..." if sum_ellipsis else "") + "".join(kept)
        equation = ",".join([out] + others) + "->" + result
        grad = g.op("Einsum", dy, *[g.x(j) for j in range(len(terms)) if j != i], equation=equation)
        if sum_ellipsis:
            out_rank = g.rank(g.y())
            if out_rank is not None:
                lead = out_rank - (len(_letters(out)) - 1)
                if lead > 0:
                    grad = g.reduce_sum(grad, list(range(lead)), keepdims=0)
            else:
                raise ModelError(f"Einsum node {g.node.name!r}: the rank of its output is unknown; its gradient needs it")
        if missing:
            # positions counted from the end (an ellipsis has a run-time length)
            grad = g.unsqueeze(grad, [k - len(labels) for k in missing])
        if "..." in labels:
            if missing:
                grad = g.op("Expand", grad, g.shape_of(x))
            grad = g.unbroadcast(grad, x, grad, None)
        elif missing:
            grad = g.expand_like(grad, x)
        grads.append(grad)
    return grads
