"""Finite-difference cases: MatMul (1-D, batched, broadcast batch dims), Gemm, Einsum."""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(3)


def r(*shape):
    return rng.uniform(-2.0, 2.0, shape)


MATMUL_SHAPES = [
    ((3, 4), (4, 2)),
    ((4,), (4, 2)),
    ((3, 4), (4,)),
    ((4,), (4,)),
    ((2, 3, 4), (4, 2)),
    ((3, 4), (2, 4, 2)),
    ((2, 3, 4), (2, 4, 2)),
    ((2, 1, 3, 4), (3, 4, 2)),
    ((1, 3, 4), (2, 1, 4, 2)),
    ((4,), (2, 3, 4, 2)),
    ((2, 2, 3, 4), (4,)),
    ((1, 1, 2, 3), (1, 3, 2)),
    ((2, 1, 3, 4), (1, 2, 4, 3)),
]

CASES = [GradCase("MatMul", [r(*a), r(*b)], name=f"MatMul{a}{b}") for a, b in MATMUL_SHAPES]
CASES.append(GradCase("MatMul", [r(2, 1, 3, 4), r(3, 4, 2)], opset=18, name="MatMul-op18-broadcast"))
CASES.append(GradCase("MatMul", [r(3, 4), r(4, 2)], const=(1,), name="MatMul-constB"))

for ta in (0, 1):
    for tb in (0, 1):
        for alpha, beta in ((1.0, 1.0), (0.7, -1.3)):
            for c_shape in (None, (3, 5), (5,), (1, 5), (3, 1), ()):
                a = r(4, 3) if ta else r(3, 4)
                b = r(5, 4) if tb else r(4, 5)
                inputs = [a, b] + ([] if c_shape is None else [r(*c_shape)])
                attrs = {"transA": ta, "transB": tb}
                if alpha != 1.0:
                    attrs.update(alpha=alpha, beta=beta)
                CASES.append(GradCase("Gemm", inputs, attrs, name=f"Gemm-tA{ta}-tB{tb}-a{alpha}-b{beta}-C{c_shape}"))

EINSUM = [
    ("ij,jk->ik", [(3, 4), (4, 2)]),
    ("ij,jk", [(3, 4), (4, 2)]),  # implicit output
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
    ("ij,kj->ik", [(3, 4), (2, 4)]),
    ("i,j->ij", [(3,), (4,)]),  # outer product
    ("i,i->", [(4,), (4,)]),  # dot
    ("ij,j->i", [(3, 4), (4,)]),
    ("ijk,k->ij", [(2, 3, 4), (4,)]),
    ("ij,k->k", [(3, 4), (2,)]),  # i, j summed within operand 0 alone
    ("abc,cd->bd", [(2, 3, 4), (4, 2)]),  # a summed within operand 0 alone
    ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 2, 4)]),
    ("ij->ji", [(3, 4)]),  # one operand
    ("ij->i", [(3, 4)]),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),  # three operands
    ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 2)]),
    ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 2)]),  # broadcast ellipsis
    ("...ij,jk->...ik", [(2, 2, 3, 4), (4, 2)]),
    ("... i j , j k -> ... i k", [(2, 3, 4), (4, 2)]),  # spaces
    ("ii->i", [(3, 3)]),  # diagonal
    ("ii", [(3, 3)]),  # trace (implicit output)
    ("bii->b", [(2, 3, 3)]),
    ("iij->j", [(3, 3, 2)]),
    ("iii->i", [(2, 2, 2)]),
    ("iij,jk->ik", [(3, 3, 2), (2, 4)]),
    ("ii,ij->ij", [(3, 3), (3, 2)]),  # diagonal against a kept label
    ("ij,jj->i", [(3, 2), (2, 2)]),
    ("bij,bkk->bij", [(2, 3, 2), (2, 4, 4)]),  # the trace summed within operand 1
    ("...ii->...i", [(2, 3, 3)]),
    ("i...i", [(3, 2, 3)]),  # ellipsis in the middle, implicit output
    ("...i->i", [(2, 3, 4)]),  # the ellipsis summed away
    ("i...,i...->...", [(3, 2), (3, 1)]),  # trailing ellipsis, broadcast
    ("ij,ij->ij", [(3, 4), (3, 1)]),  # a named label broadcast
    ("ij,ij->i", [(3, 4), (1, 4)]),  # broadcast label summed: its gradient expanded
    ("Ba,aB", [(2, 3), (3, 2)]),  # upper case sorts first
]
CASES += [
    GradCase("Einsum", [r(*s) for s in shapes], {"equation": eq}, name=f"Einsum-{eq.replace(' ', '')}") for eq, shapes in EINSUM
]

# Det: 1x1 to 4x4, a batch of matrices, a singular matrix (its gradient, the cofactors, is not 0).
# The rule needs the matrix size static (tests/test_linalg_rules.py checks the error otherwise).
_singular = rng.uniform(-1, 1, (3, 3))
_singular[2] = _singular[0] + 2 * _singular[1]
CASES += [
    GradCase("Det", [rng.uniform(-1, 1, (1, 1))], symbolic=False, name="Det_1x1"),
    GradCase("Det", [rng.uniform(-1, 1, (2, 2))], symbolic=False, name="Det_2x2"),
    GradCase("Det", [rng.uniform(-1, 1, (2, 3, 3))], symbolic=False, name="Det_batch_3x3"),
    GradCase("Det", [rng.uniform(-1, 1, (4, 4))], symbolic=False, name="Det_4x4"),
    GradCase("Det", [_singular], symbolic=False, name="Det_singular"),
]

# DFT: real and complex X, forward and inverse, one-sided, dft_length padding and truncating, the
# axis as an attribute (opset 17) and as an input (opset 20); ONNX wants one-sided forward transforms
# of real X and one-sided inverse ones of complex X. The rule needs static lengths.
_DFT_AXIS = np.array(1, dtype=np.int64)
for _x_shape, _attrs, _length, _opset in (
    ((2, 5, 1), {}, None, 20),
    ((2, 4, 2), {}, None, 20),
    ((2, 6, 1), {"onesided": 1}, None, 20),
    ((2, 5, 1), {"onesided": 1}, None, 20),
    ((2, 5, 2), {"inverse": 1}, None, 20),
    ((2, 4, 2), {"inverse": 1, "onesided": 1}, None, 20),
    ((1, 3, 2), {"inverse": 1, "onesided": 1}, 5, 20),
    ((1, 4, 2), {"inverse": 1, "onesided": 1}, 4, 20),
    ((2, 6, 2), {}, 4, 20),
    ((2, 3, 1), {"onesided": 1}, 6, 20),
    ((3, 2, 4, 2), {"axis": 2}, None, 17),
):
    _inputs = [rng.uniform(-1, 1, _x_shape)]
    if _length is not None:
        _inputs.append(np.array(_length, dtype=np.int64))
    if _opset >= 20:
        _inputs += [None] if _length is None else []
        _inputs.append(_DFT_AXIS)
    CASES.append(
        GradCase("DFT", _inputs, _attrs, opset=_opset, symbolic=False, name=f"DFT{_x_shape}_{sorted(_attrs.items())}_n{_length}")
    )

# STFT (differentiated in its standard-op form: Gather, Mul, DFT): the signal and the window, real
# and complex signals, one- and two-sided, no window.
for _length, _parts, _step, _window, _onesided in ((9, 1, 2, 4, 1), (8, 2, 3, 3, 0), (7, 1, 2, None, 1)):
    _inputs = [rng.uniform(-1, 1, (2, _length, _parts)), np.array(_step, dtype=np.int64)]
    _inputs += [rng.uniform(0.2, 1, _window)] if _window else [None, np.array(4, dtype=np.int64)]
    CASES.append(
        GradCase(
            "STFT",
            _inputs,
            {"onesided": _onesided},
            symbolic=False,
            name=f"STFT_len{_length}_parts{_parts}_step{_step}_window{_window}_onesided{_onesided}",
        )
    )
