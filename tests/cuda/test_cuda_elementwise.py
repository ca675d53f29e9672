"""CUDA elementwise launchers against their numpy CPU kernels (runs only where a GPU answers)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.errors import KernelError
from gradgen.executor import Session
from gradgen.kernels import registry
from gradgen.kernels.registry import MICROSOFT

pytestmark = pytest.mark.cuda

SHAPE_PAIRS = [
    ((3, 4), (3, 4)),
    ((2, 3, 4, 5), (3, 1, 1)),
    ((), (2, 3)),
    ((4, 1, 5), (1, 3, 1)),
    ((2, 1, 3), (2, 4, 1)),
    ((1, 7), (5, 1)),
    ((0, 3), (1, 3)),
    ((2, 1), (1, 0)),
    ((1, 1, 1), (1,)),
    ((2, 3, 4, 5, 6), (5, 1)),
    ((1000, 33), (33,)),
    ((6, 8, 16), (6, 1, 16)),
]
FLOATS = [np.float16, np.float32, np.float64]


def rt():
    from gradgen.cuda import runtime

    return runtime


def kernels(op):
    registry.load_cuda_kernels()
    entry = registry.lookup("", op)
    assert entry is not None and entry.cuda is not None, f"no CUDA launcher for {op}"
    return entry.cpu, entry.cuda


def poison(*nbytes):
    """Leave NaN-filled (0xFF bytes) blocks of these sizes in the pool, so fresh outputs start poisoned."""
    r = rt()
    blocks = []
    for n in nbytes:
        if n:
            b = r.empty((int(n),), np.uint8)
            r.driver.memset_d8(b.gpudata, 0xFF, int(n))
            blocks.append(b)
    r.synchronize()
    del blocks


def dev(a):
    from gradgen.cuda import runtime as rt

    return rt.to_device(np.asarray(a))  # keeps rank 0


def host(a):
    return rt().to_host(a)


def run(op, *args, **attrs):
    """(cuda result on the host, cpu result); inputs are numpy arrays (None stays None)."""
    cpu, cuda = kernels(op)
    want = cpu(*args, **attrs)
    outs = want if isinstance(want, tuple) else (want,)
    poison(*[np.asarray(o).nbytes for o in outs])
    got = cuda(*[None if a is None else dev(a) for a in args], **attrs)
    if isinstance(got, tuple):
        return tuple(host(g) for g in got), want
    return host(got), want


def check(got, want, rtol=0.0, atol=0.0):
    want = np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype.kind == "f":
        assert np.array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    else:
        np.testing.assert_array_equal(got, want)


def tol(dtype):
    return {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-13}[np.dtype(dtype)]


def rand(rng, shape, dtype, lo=-3.0, hi=3.0):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        return rng.integers(int(lo), int(hi) + 1, size=shape).astype(dtype)
    return rng.uniform(lo, hi, size=shape).astype(dtype)


def one_node(op, inputs: dict, consts: dict, attrs: dict, num_outputs: int = 1):
    """A model of one ``op`` node: ``inputs`` as graph inputs, ``consts`` as initializers."""
    graph_inputs = [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)) for n, a in inputs.items()
    ]
    outputs = [f"y{k}" for k in range(num_outputs)]
    node = helper.make_node(op, list(inputs) + list(consts), outputs, **attrs)
    graph = helper.make_graph(
        [node],
        op,
        graph_inputs,
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outputs],
        initializer=[numpy_helper.from_array(a, n) for n, a in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def same_on_both(model, feeds, rtol=1e-6):
    """Run ``model`` on the CPU and on the GPU executor and compare every output."""
    want = Session(model).run(feeds)
    got = Session(model, device="cuda").run(feeds)
    for name, w in want.items():
        assert got[name].shape == w.shape and got[name].dtype == w.dtype, name
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=1e-6)


# -- binary ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("dtype", FLOATS + [np.int32, np.int64])
@pytest.mark.parametrize("shapes", SHAPE_PAIRS, ids=str)
def test_arithmetic(op, dtype, shapes):
    rng = np.random.default_rng(zlib.crc32(repr((op, shapes)).encode()))
    a = rand(rng, shapes[0], dtype, -50, 50)
    b = rand(rng, shapes[1], dtype, -50, 50)
    if np.dtype(dtype).kind == "i" and op == "Div":
        b[b == 0] = 7
    elif op == "Div":
        b = np.where(np.abs(b) < 0.5, np.asarray(1.5, dtype), b).astype(dtype)
    got, want = run(op, a, b)
    check(got, want)  # IEEE add/sub/mul/div and integer arithmetic: bit-exact


def test_integer_division_truncates_and_checks_zero():
    a = np.array([7, -7, 7, -7, 0, -9], np.int64)
    b = np.array([2, 2, -2, -2, 3, 4], np.int64)
    got, want = run("Div", a, b)
    check(got, want)
    _, cuda = kernels("Div")
    with pytest.raises(KernelError, match="integer division by zero"):
        cuda(dev(a), dev(np.array([1, 2, 0, 1, 1, 1], np.int64)))


@pytest.mark.parametrize("fmod", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS + [np.int32, np.int64])
def test_mod(fmod, dtype):
    rng = np.random.default_rng(3)
    a = rand(rng, (4, 5, 6), dtype, -20, 20)
    b = rand(rng, (5, 1), dtype, -7, 7)
    b[b == 0] = 3
    got, want = run("Mod", a, b, fmod=fmod)
    check(got, want, rtol=tol(dtype) if np.dtype(dtype).kind == "f" else 0, atol=1e-2 if dtype == np.float16 else 1e-12)


def test_integer_mod_by_zero():
    _, cuda = kernels("Mod")
    with pytest.raises(KernelError, match="integer modulo by zero"):
        cuda(dev(np.array([1, 2], np.int32)), dev(np.array([0, 1], np.int32)))


@pytest.mark.parametrize("base", FLOATS)
@pytest.mark.parametrize("exp", FLOATS + [np.int32, np.int64])
def test_pow_float_base(base, exp):
    rng = np.random.default_rng(5)
    x = rng.uniform(0.1, 3.0, size=(3, 4, 5)).astype(base)
    y = rand(rng, (4, 1), exp, -3, 3)
    got, want = run("Pow", x, y)
    check(got, want, rtol=5 * tol(base))
    got, want = run("Pow", x, np.asarray(2, dtype=exp))
    check(got, want, rtol=tol(base))


@pytest.mark.parametrize("base", [np.int32, np.int64])
@pytest.mark.parametrize("exp", [np.int32, np.int64])
def test_pow_integer(base, exp):
    x = np.array([[2, -3, 0, 5, 1, -1]], base)
    y = np.array([[0], [1], [3], [7]], exp)
    got, want = run("Pow", x, y)
    check(got, want)


@pytest.mark.parametrize("op", ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", FLOATS + [np.int32, np.int64, np.bool_])
def test_comparisons(op, dtype):
    rng = np.random.default_rng(7)
    for sa, sb in SHAPE_PAIRS[:8]:
        a = rand(rng, sa, dtype, -2, 2)
        b = rand(rng, sb, dtype, -2, 2)
        if np.dtype(dtype).kind == "f" and a.size:
            a.reshape(-1)[0] = np.nan
        got, want = run(op, a, b)
        check(got, want)
        assert got.dtype == np.bool_ and set(np.unique(got.view(np.uint8))) <= {0, 1}


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    rng = np.random.default_rng(8)
    for sa, sb in SHAPE_PAIRS:
        got, want = run(op, rng.random(sa) < 0.5, rng.random(sb) < 0.5)
        check(got, want)


def test_dtype_mismatch_is_an_error():
    _, cuda = kernels("Add")
    with pytest.raises(KernelError, match="different dtypes"):
        cuda(dev(np.zeros(3, np.float32)), dev(np.zeros(3, np.float64)))
    with pytest.raises(KernelError, match="do not broadcast"):
        cuda(dev(np.zeros(3, np.float32)), dev(np.zeros(4, np.float32)))


@pytest.mark.parametrize("op, extra", [("Add", 1), ("Where", 2), ("Sum", 2), ("Sigmoid", 0), ("Clip", 0)])
def test_a_strided_input_is_read_as_strided(op, extra):
    """A non-contiguous device view gives the values of the view (launchers copy it first; a launcher
    that dropped the copy read the underlying buffer as if contiguous)."""
    cpu, cuda = kernels(op)
    rng = np.random.default_rng(4)
    full = rng.standard_normal((4, 6)).astype(np.float32)
    others = [rng.standard_normal((4, 3)).astype(np.float32) for _ in range(extra)]
    if op == "Where":
        others[0] = others[0] > 0
        args_host, args_dev = [others[0], full[:, ::2], others[1]], [dev(others[0]), dev(full)[:, ::2], dev(others[1])]
    else:
        args_host, args_dev = [full[:, ::2], *others], [dev(full)[:, ::2], *[dev(o) for o in others]]
    want = cpu(*[np.ascontiguousarray(a) for a in args_host])
    check(host(cuda(*args_dev)), want, rtol=1e-6)  # Sigmoid's CUDA exp may differ from numpy's by an ulp


# -- Where ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS + [np.int64, np.int32, np.bool_, np.int8])
@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 3, 4), (2, 3, 4), (2, 3, 4)),
        ((2, 1, 4), (3, 1), ()),
        ((1, 1, 8, 8), (2, 1, 1, 8), (1,)),
        ((5,), (0, 5), (1, 5)),
        ((3, 1, 1), (1, 4, 1), (1, 1, 5)),
    ],
    ids=str,
)
def test_where(dtype, shapes):
    rng = np.random.default_rng(9)
    c = rng.random(shapes[0]) < 0.5
    x = rand(rng, shapes[1], dtype)
    y = rand(rng, shapes[2], dtype)
    got, want = run("Where", c, x, y)
    check(got, want)


def test_where_needs_bool_condition():
    _, cuda = kernels("Where")
    with pytest.raises(KernelError, match="condition must be bool"):
        cuda(dev(np.ones(3, np.float32)), dev(np.ones(3, np.float32)), dev(np.ones(3, np.float32)))


# -- variadic -------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Sum", "Max", "Min"])
@pytest.mark.parametrize("count", [1, 2, 3, 8, 9, 17])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int32])
@pytest.mark.parametrize("shape", [(5, 7), (64, 36)], ids=["odd", "quads"])  # 4-byte types run in 16-byte words
def test_variadic_same_shape(op, count, dtype, shape):
    rng = np.random.default_rng(count)
    xs = [rand(rng, shape, dtype) for _ in range(count)]
    if np.dtype(dtype).kind == "f" and op != "Sum":
        xs[-1][0, 0] = np.nan
    got, want = run(op, *xs)
    if dtype == np.float16 and op == "Sum":
        # float32 accumulation, rounded once per 8 inputs; the CPU rounds after every add
        want = np.sum([x.astype(np.float64) for x in xs], axis=0).astype(np.float16)
        check(got, want, rtol=5e-3, atol=2e-2 * ((count + 6) // 7))
    else:
        check(got, want)


@pytest.mark.parametrize("op", ["Sum", "Max", "Min"])
def test_variadic_broadcast(op):
    rng = np.random.default_rng(11)
    xs = [rand(rng, s, np.float32) for s in [(2, 3, 4), (3, 1), (), (1, 1, 4)]]
    got, want = run(op, *xs)
    check(got, want)


def test_sum_of_empty_tensors():
    got, want = run("Sum", np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32))
    check(got, want)


# -- unary ----------------------------------------------------------------------------------------

UNARY = [
    ("Neg", {}, (-3, 3)),
    ("Abs", {}, (-3, 3)),
    ("Sqrt", {}, (0, 4)),
    ("Reciprocal", {}, (0.5, 4)),
    ("Exp", {}, (-5, 5)),
    ("Log", {}, (0.01, 5)),
    ("Tanh", {}, (-4, 4)),
    ("Sigmoid", {}, (-30, 30)),
    ("Relu", {}, (-3, 3)),
    ("LeakyRelu", {"alpha": 0.1}, (-3, 3)),
    ("Softplus", {}, (-30, 30)),
    ("Erf", {}, (-3, 3)),
    ("Gelu", {}, (-4, 4)),
    ("Gelu", {"approximate": "tanh"}, (-4, 4)),
    ("Sign", {}, (-3, 3)),
    ("Floor", {}, (-3, 3)),
    ("Ceil", {}, (-3, 3)),
    ("Round", {}, (-3, 3)),
    ("Sin", {}, (-3, 3)),
    ("Cos", {}, (-3, 3)),
    ("Atan", {}, (-3, 3)),
    ("Sinh", {}, (-3, 3)),
    ("Cosh", {}, (-3, 3)),
    ("Asin", {}, (-0.9, 0.9)),
    ("Acos", {}, (-0.9, 0.9)),
    ("Asinh", {}, (-3, 3)),
    ("Acosh", {}, (1.1, 4)),
    ("Atanh", {}, (-0.9, 0.9)),
    ("Elu", {"alpha": 0.7}, (-3, 3)),
    ("Selu", {}, (-3, 3)),
    ("Celu", {"alpha": 1.3}, (-3, 3)),
    ("Softsign", {}, (-3, 3)),
    ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, (-4, 4)),
    ("HardSwish", {}, (-5, 5)),
    ("Mish", {}, (-4, 4)),
    ("ThresholdedRelu", {"alpha": 0.5}, (-2, 2)),
]


@pytest.mark.parametrize("op,attrs,rng_range", UNARY, ids=[f"{u[0]}{u[1] or ''}" for u in UNARY])
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary(op, attrs, rng_range, dtype):
    rng = np.random.default_rng(13)
    for shape in [(4, 33, 5), (), (0, 3), (1,)]:
        x = rng.uniform(*rng_range, size=shape).astype(dtype)
        got, want = run(op, x, **attrs)
        t = tol(dtype)
        if op in ("Erf", "Gelu") and dtype == np.float32:
            t = 1e-6  # the CPU float32 erf is a 1e-7 approximation
        check(got, want, rtol=4 * t, atol=4 * t)


def _table_cases():
    """(op, attrs, range) for every op of the unary table (kernels generated from its CUDA expression),
    with the attribute sets of its test spec (tests/grad_cases/elementwise.py)."""
    from gradgen.kernels.cpu.elementwise import UNARY_TABLE
    from tests.grad_cases.elementwise import UNARY_SPECS

    cases = []
    for op in UNARY_TABLE:
        spec = UNARY_SPECS.get(op)
        for attrs in spec.attrs if spec else ({},):
            cases.append((op, attrs, (spec.low, spec.high) if spec else (-3, 3)))
    return cases


@pytest.mark.parametrize("op,attrs,rng_range", _table_cases(), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", FLOATS)
def test_unary_table(op, attrs, rng_range, dtype):
    rng = np.random.default_rng(17)
    for shape in [(4, 33, 5), (), (0, 3), (1,)]:
        x = rng.uniform(*rng_range, size=shape).astype(dtype)
        got, want = run(op, x, **attrs)
        check(got, want, rtol=4 * tol(dtype), atol=4 * tol(dtype))


def test_unary_table_integers_run_the_numpy_kernel():
    got, want = run("Shrink", np.arange(-6, 7, dtype=np.int64), lambd=1.5, bias=1.0)
    check(got, want)


@pytest.mark.parametrize("op", ["Neg", "Abs", "Sign", "Relu"])
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_unary_integers(op, dtype):
    got, want = run(op, np.arange(-6, 7, dtype=dtype).reshape(13, 1))
    check(got, want)


def test_nan_passes_through():
    x = np.array([np.nan, 1.0, -1.0, 0.0], np.float32)
    for op in ("Relu", "Sign", "Abs", "Neg", "Sigmoid", "Tanh", "Exp"):
        got, want = run(op, x)
        check(got, want, rtol=1e-6)


def test_not_and_isnan():
    got, want = run("Not", np.array([[True, False], [False, False]]))
    check(got, want)
    got, want = run("IsNaN", np.array([np.nan, 0.0, np.inf], np.float32))
    check(got, want)


def test_identity_is_a_copy():
    _, cuda = kernels("Identity")
    x = dev(np.arange(6, dtype=np.float32))
    y = cuda(x)
    assert int(y.gpudata) != int(x.gpudata)
    np.testing.assert_array_equal(host(y), np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("dtype", FLOATS + [np.int32, np.int64])
def test_clip(dtype):
    rng = np.random.default_rng(17)
    x = rand(rng, (6, 7), dtype, -10, 10)
    lo, hi = np.asarray(-2, dtype), np.asarray(3, dtype)
    for args in [(x, lo, hi), (x, lo, None), (x, None, hi), (x, None, None), (x, lo.reshape(1), hi.reshape(1, 1))]:
        got, want = run("Clip", *args)
        check(got, want)
    got, want = run("Clip", x, min=-1.0, max=2.0)  # opset < 11 attributes
    check(got, want)
    _, cuda = kernels("Clip")
    with pytest.raises(KernelError, match="min must be a scalar"):
        cuda(dev(x), dev(np.zeros(2, dtype)), None)


CAST_TYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int32, np.int64, np.bool_]
ONNX_CODE = {np.float16: 10, np.float32: 1, np.float64: 11, np.int8: 3, np.uint8: 2, np.int32: 6, np.int64: 7, np.bool_: 9}


@pytest.mark.parametrize("src", CAST_TYPES)
@pytest.mark.parametrize("dst", CAST_TYPES)
def test_cast(src, dst):
    rng = np.random.default_rng(19)
    if np.dtype(src).kind == "f":
        x = rng.uniform(0, 100, size=(5, 6)).astype(src)
        x[0, :3] = [0.0, 0.5, 99.75]
        if np.dtype(dst).kind != "u":
            x[1] = -x[1]  # negative fractions truncate toward zero
        if dst == np.bool_:
            x[2, 0] = np.nan  # NaN casts to True
    else:
        x = rand(rng, (5, 6), src, 0 if np.dtype(src).kind in "ub" else -100, 100)
    got, want = run("Cast", x, to=ONNX_CODE[dst])
    check(got, want)
    got, want = run("CastLike", x, np.zeros(1, dst))
    check(got, want)


def test_elementwise_results_are_deterministic():
    rng = np.random.default_rng(23)
    a = dev(rng.standard_normal((64, 1, 33)).astype(np.float32))
    b = dev(rng.standard_normal((17, 1)).astype(np.float32))
    _, cuda = kernels("Pow")
    first, second = host(cuda(a, b)), host(cuda(a, b))
    assert first.tobytes() == second.tobytes()


@pytest.mark.parametrize("slope_shape", [(1,), (3, 1, 1), (4,), ()])
def test_prelu(slope_shape):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    slope = rng.standard_normal(slope_shape).astype(np.float32)
    same_on_both(one_node("PRelu", {"x": x}, {"slope": slope}, {}), {"x": x})


def test_dropout_inference_with_mask():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    model = one_node("Dropout", {"x": x}, {"ratio": np.array(0.5, np.float32)}, {}, num_outputs=2)
    same_on_both(model, {"x": x})


# ---------------------------------------------------------------- BroadcastGradientArgs


@pytest.mark.parametrize("a,b", [([2, 16, 1, 1024], [1, 1, 1024, 1024]), ([2, 3, 4, 5], []), ([1, 4, 5], [2, 3, 1, 1])])
def test_broadcast_gradient_args(rt, a, b):
    e = registry.lookup(MICROSOFT, "BroadcastGradientArgs")
    assert e is not None and e.cuda is not None
    assert e.cuda_host_inputs == frozenset({0, 1})
    got = e.cuda(np.array(a, np.int64), np.array(b, np.int64))
    want = e.cpu(np.array(a, np.int64), np.array(b, np.int64))
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray)
        np.testing.assert_array_equal(g, w)
    with pytest.raises(KernelError):
        e.cuda(np.array([3, 4, 5], np.int64), np.array([2, 1, 6, 1], np.int64))
