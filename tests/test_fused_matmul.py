"""com.microsoft FusedMatMul: the CPU kernel against numpy and stock onnxruntime for every attribute
combination and batch-broadcasting case, its output types, its lowering to standard ONNX, the GEMM
planner of the CUDA launcher (emulated on the host), and the MatMul gradient that emits it."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import gradgen
from gradgen.errors import KernelError, ModelError
from gradgen.executor import Session
from gradgen.kernels.cpu.matmul import fused_matmul
from gradgen.kernels.cuda.matmul import MAX_GEMM_CALLS, GemmCall, plan_gemm
from gradgen.ops import schemas
from gradgen.ops.matmul import fused_operand_perm
from gradgen.passes.lowering import LowerToStandardPass

ort = pytest.importorskip("onnxruntime")
ort.set_default_logger_severity(3)

MS = "com.microsoft"
M, K, N = 3, 4, 5
# Logical shapes of op(A) and op(B) (what MatMul multiplies).
CASES = {
    "2d": ((M, K), (K, N)),
    "3d": ((2, M, K), (2, K, N)),
    "4d": ((2, 3, M, K), (2, 3, K, N)),
    "B shared": ((2, M, K), (K, N)),
    "A shared": ((M, K), (2, K, N)),
    "both broadcast": ((2, 1, M, K), (1, 3, K, N)),
    "rank broadcast": ((2, 3, M, K), (3, K, N)),
    "size-1 batch": ((2, M, K), (1, K, N)),
    "vector A": ((K,), (2, K, N)),
    "vector B": ((2, M, K), (K,)),
    "vectors": ((K,), (K,)),
    "vector A 2d": ((K,), (K, N)),
    "vector B 2d": ((M, K), (K,)),
}
FLAGS = list(itertools.product((0, 1), repeat=4))  # transA, transB, transBatchA, transBatchB


def stored(dims, trans, trans_batch):
    """The shape an operand is stored in so that op(X) has ``dims``."""
    if len(dims) < 2:
        return tuple(dims)
    d = list(dims)
    if trans:
        d[-2], d[-1] = d[-1], d[-2]
    if trans_batch and len(d) >= 3:
        d = [d[-2], *d[:-2], d[-1]]
    return tuple(d)


def operands(rng, case, flags, dtype=np.float32):
    (ad, bd), (ta, tb, tba, tbb) = CASES[case], flags
    a = rng.standard_normal(stored(ad, ta, tba)).astype(dtype)
    b = rng.standard_normal(stored(bd, tb, tbb)).astype(dtype)
    return a, b


def attrs_of(flags, alpha):
    return dict(zip(("transA", "transB", "transBatchA", "transBatchB"), flags), alpha=alpha)


def valid(case, flags):
    """ORT's rule: a transBatch flag needs both operands of one rank >= 3."""
    ad, bd = CASES[case]
    return not (flags[2] or flags[3]) or (len(ad) == len(bd) and len(ad) >= 3)


def reference(a, b, attrs):
    """alpha * MatMul(op(A), op(B)) in float64, op spelled with explicit copies."""

    def op(x, trans, batch):
        if x.ndim < 2:
            return x
        if batch:
            x = np.moveaxis(x, 0, -2)
        return np.swapaxes(x, -1, -2) if trans else x

    x = op(a.astype(np.float64), attrs["transA"], attrs["transBatchA"])
    y = op(b.astype(np.float64), attrs["transB"], attrs["transBatchB"])
    return attrs["alpha"] * np.matmul(x, y)


def one_node(attrs, a, b):
    node = helper.make_node("FusedMatMul", ["A", "B"], ["Y"], domain=MS, name="fmm", **attrs)
    dt = helper.np_dtype_to_tensor_dtype(a.dtype)
    ((y_type, y_shape),) = schemas.output_types("FusedMatMul", [(dt, a.shape), (dt, b.shape)], attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", dt, a.shape), helper.make_tensor_value_info("B", dt, b.shape)],
        [helper.make_tensor_value_info("Y", int(y_type), y_shape)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])


def ort_run(model, feeds, optimize=True):
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


# ====================================================================== the CPU kernel


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_against_numpy(case, dtype):
    rng = np.random.default_rng(0)
    for flags in FLAGS:
        if not valid(case, flags):
            continue
        a, b = operands(rng, case, flags, dtype)
        for alpha in (1.0, -0.5):
            attrs = attrs_of(flags, alpha)
            got = fused_matmul(a, b, **attrs)
            want = reference(a, b, attrs)
            assert got.dtype == dtype and got.shape == want.shape, (flags, got.shape, want.shape)
            tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[dtype]
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 4, err_msg=str(attrs))


# ONNX Runtime's CPU kernel (1.19 ... 1.32) ignores transA when B is a vector (its matmul helper lays
# A's rows out untransposed): its shape is right, its values are those of transA=0. gradgen follows
# the contract (its shape inference, and numpy's transpose): checked against numpy above.
def ort_gets_wrong(case, flags):
    return len(CASES[case][1]) == 1 and len(CASES[case][0]) >= 2 and flags[0] == 1


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_kernel_against_onnxruntime(case):
    rng = np.random.default_rng(1)
    for flags in FLAGS:
        a, b = operands(rng, case, flags)
        attrs = attrs_of(flags, 0.25 if flags[1] else 1.0)
        if not valid(case, flags):
            with pytest.raises(KernelError, match="needs inputs of one rank >= 3"):
                fused_matmul(a, b, **attrs)
            with pytest.raises(ModelError, match="needs inputs of one rank >= 3"):
                one_node(attrs, a, b)
            continue
        got = fused_matmul(a, b, **attrs)
        theirs = ort_run(one_node(attrs, a, b), {"A": a, "B": b})
        assert theirs.shape == got.shape, (case, flags)
        if ort_gets_wrong(case, flags):
            continue
        np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=1e-5, err_msg=f"{case} {attrs}")


def test_cpu_kernel_shape_errors():
    with pytest.raises(KernelError, match=r"FusedMatMul of shapes \[3, 4\] and \[3, 5\] .*inner dimensions differ"):
        fused_matmul(np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32))
    # transA makes them fit
    assert fused_matmul(np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32), transA=1).shape == (4, 5)
    with pytest.raises(KernelError, match="rank >= 1"):
        fused_matmul(np.zeros((), np.float32), np.zeros((3,), np.float32))


def test_executor_names_the_node():
    node = helper.make_node("FusedMatMul", ["A", "B"], ["Y"], domain=MS, name="fmm", transA=1)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, ["b", "m", "k"]),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, ["b", "k2", "n"]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    with pytest.raises(KernelError, match=r"'fmm'.*inner dimensions differ"):
        Session(model).run({"A": np.zeros((2, 3, 4), np.float32), "B": np.zeros((2, 4, 5), np.float32)})


# ====================================================================== schema and output types


def test_schema_matches_onnxruntime():
    sch = schemas.schema("FusedMatMul")
    assert [f.name for f in sch.inputs] == ["A", "B"] and [f.name for f in sch.outputs] == ["Y"]
    assert sch.defaults() == {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0, "transBatchB": 0}
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    theirs = [s for s in C.get_all_operator_schema() if s.name == "FusedMatMul" and s.domain == MS]
    if theirs:
        assert set(theirs[0].attributes) == {a.name for a in sch.attributes}
        assert [i.name for i in theirs[0].inputs] == ["A", "B"]


def test_output_types():
    F = TensorProto.FLOAT
    ot = schemas.output_types
    assert ot("FusedMatMul", [(F, (2, "t", 4)), (F, (2, 5, 4))], {"transB": 1}) == [(F, (2, "t", 5))]
    assert ot("FusedMatMul", [(F, (4, 2, 3)), (F, (2, 3, 5))], {"transBatchA": 1}) == [(F, (2, 4, 5))]
    assert ot("FusedMatMul", [(F, (4, 2, 3)), (F, (2, 5, 4))], {"transBatchA": 1, "transA": 1, "transB": 1}) == [(F, (2, 3, 5))]
    assert ot("FusedMatMul", [(F, (4,)), (F, (4, 5))], {"transA": 1}) == [(F, (5,))]
    assert ot("FusedMatMul", [(F, ("b", 1, 3, 4)), (F, (7, 4, 5))], {}) == [(F, ("b", 7, 3, 5))]
    assert ot("FusedMatMul", [(F, None), (F, (4, 5))], {}) == [(F, None)]
    with pytest.raises(ModelError, match="inner dimensions differ"):
        ot("FusedMatMul", [(F, (3, 4)), (F, (5, 6))], {})
    with pytest.raises(ModelError, match="input 'A' has type INT64"):
        ot("FusedMatMul", [(TensorProto.INT64, (3, 4)), (F, (4, 6))], {})


@pytest.mark.parametrize("case", list(CASES))
def test_output_types_match_the_kernel(case):
    rng = np.random.default_rng(2)
    for flags in FLAGS:
        if not valid(case, flags):
            continue
        a, b = operands(rng, case, flags)
        attrs = attrs_of(flags, 1.0)
        ((_, shape),) = schemas.output_types("FusedMatMul", [(TensorProto.FLOAT, a.shape), (TensorProto.FLOAT, b.shape)], attrs)
        assert shape == fused_matmul(a, b, **attrs).shape


# ====================================================================== the lowering (portable mode)


@pytest.mark.parametrize("case", list(CASES))
def test_lowering_runs_in_onnxruntime(case):
    rng = np.random.default_rng(3)
    for flags in FLAGS:
        if not valid(case, flags):
            continue
        a, b = operands(rng, case, flags)
        attrs = attrs_of(flags, 1.5 if flags[0] else 1.0)
        model = ir.from_proto(one_node(attrs, a, b))
        LowerToStandardPass()(model)
        proto = ir.to_proto(model)
        ops = {(n.domain, n.op_type) for n in proto.graph.node}
        assert all(d in ("", "ai.onnx") for d, _ in ops), ops
        assert MS not in {o.domain for o in proto.opset_import}
        transposes = sum(1 for n in proto.graph.node if n.op_type == "Transpose")
        assert transposes == sum(
            fused_operand_perm(x.ndim, bool(t), bool(tb)) is not None
            for x, t, tb in ((a, flags[0], flags[2]), (b, flags[1], flags[3]))
        )
        onnx.checker.check_model(proto, full_check=True)
        # ORT's graph optimizer fuses Transpose + MatMul back into its FusedMatMul, whose CPU kernel gets
        # a transposed A times a vector wrong (above): those run unoptimised, which computes them right.
        got = ort_run(proto, {"A": a, "B": b}, optimize=not ort_gets_wrong(case, flags))
        np.testing.assert_allclose(got, fused_matmul(a, b, **attrs), rtol=1e-5, atol=1e-5, err_msg=f"{case} {attrs}")


def test_lowering_needs_ranks():
    node = helper.make_node("FusedMatMul", ["A", "B"], ["Y"], domain=MS, name="fmm", transA=1)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, [3, 4]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)]))
    with pytest.raises(ModelError, match="FusedMatMul node 'fmm': the ranks of its inputs are unknown"):
        LowerToStandardPass()(model)


# ====================================================================== the CUDA launcher's GEMM plan


def emulate(calls, a_flat, b_flat, c_shape, alpha=1.0):
    """Run a plan the way gemm_rowmajor does, on flat host buffers (float64)."""
    c_flat = np.full(int(np.prod(c_shape)), np.nan)

    def matrix(flat, off, rows, cols, trans, ld):
        idx = (
            np.arange(rows)[:, None] * ld + np.arange(cols)[None, :]
            if not trans
            else np.arange(cols)[None, :] * ld + np.arange(rows)[:, None]
        )
        return flat[off + idx]

    for c in calls:
        assert isinstance(c, GemmCall)
        for i in range(c.batch):
            x = matrix(a_flat, c.a_off + i * c.stride_a, c.m, c.k, c.trans_a, c.lda)
            y = matrix(b_flat, c.b_off + i * c.stride_b, c.k, c.n, c.trans_b, c.ldb)
            start = c.c_off + i * c.stride_c
            assert np.isnan(c_flat[start : start + c.m * c.n]).all(), "a plan writes an output twice"
            c_flat[start : start + c.m * c.n] = (alpha * (x @ y)).reshape(-1)
    assert not np.isnan(c_flat).any(), "a plan leaves outputs unwritten"
    return c_flat.reshape(c_shape)


def view(x, perm, is_b):
    shape, strides = list(x.shape), [s // x.itemsize for s in x.strides]
    if perm is not None:
        shape, strides = [shape[p] for p in perm], [strides[p] for p in perm]
    if len(shape) == 1:
        return ([shape[0], 1], [strides[0], 0]) if is_b else ([1, shape[0]], [0, strides[0]])
    return shape, strides


@pytest.mark.parametrize("case", list(CASES))
def test_gemm_plan_reads_every_fused_operand_in_place(case):
    """Every FusedMatMul of contiguous operands plans without a copy, and the plan computes the product."""
    rng = np.random.default_rng(4)
    for flags in FLAGS:
        if not valid(case, flags):
            continue
        a, b = operands(rng, case, flags, np.float64)
        attrs = attrs_of(flags, 1.0)
        a_view = view(a, fused_operand_perm(a.ndim, bool(flags[0]), bool(flags[2])), False)
        b_view = view(b, fused_operand_perm(b.ndim, bool(flags[1]), bool(flags[3])), True)
        planned = plan_gemm(*a_view, *b_view)
        assert planned is not None, (case, flags)
        calls, c_shape = planned
        want = reference(a, b, attrs)
        got = emulate(calls, a.reshape(-1), b.reshape(-1), c_shape)
        np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12, err_msg=f"{case} {flags}")


def test_gemm_plan_shapes_of_calls():
    # B shared and A's rows stacked evenly: one plain GEMM over every row.
    (call,), _ = plan_gemm([8, 256, 64], [256 * 64, 64, 1], [64, 32], [32, 1])
    assert (call.m, call.n, call.k, call.batch) == (8 * 256, 32, 64, 1)
    # Attention's dK^T = Q^T dS: A transposed, one strided-batched call over the heads.
    (call,), _ = plan_gemm([2, 3, 16, 8], [3 * 8 * 16, 8 * 16, 1, 16], [2, 3, 8, 10], [240, 80, 10, 1])
    assert call.trans_a and not call.trans_b and call.batch == 6 and call.stride_a == 128 and call.lda == 16
    # Broadcast on both sides: the outer batch axis becomes separate calls, the inner one is batched.
    calls, c_shape = plan_gemm([2, 1, 3, 4], [12, 12, 4, 1], [1, 5, 4, 6], [120, 24, 6, 1])
    assert c_shape == (2, 5, 3, 6) and len(calls) == 2 and all(c.batch == 5 and c.stride_a == 0 for c in calls)
    # A matrix with no unit stride, or too many calls: None (the launcher copies first).
    assert plan_gemm([4, 5], [10, 2], [5, 3], [3, 1]) is None
    many = MAX_GEMM_CALLS + 1
    assert plan_gemm([many, 1, 3, 4], [12, 12, 4, 1], [1, 2, 4, 6], [48, 24, 6, 1]) is None


def test_gemm_plan_random_strided_views():
    """Random batch shapes, broadcasting and permuted (non-contiguous) views against numpy."""
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(200):
        rank = int(rng.integers(2, 5))
        batch = [int(rng.integers(1, 4)) for _ in range(rank - 2)]
        m, k, n = (int(v) for v in rng.integers(1, 6, size=3))
        a_batch = [d if rng.random() < 0.7 else 1 for d in batch][int(rng.integers(0, len(batch) + 1)) :]
        b_batch = [d if rng.random() < 0.7 else 1 for d in batch][int(rng.integers(0, len(batch) + 1)) :]
        a = rng.standard_normal(a_batch + [m, k])
        b = rng.standard_normal(b_batch + [k, n])
        # store each operand in a random axis order and view it back (strides permuted)
        a_perm, b_perm = rng.permutation(a.ndim), rng.permutation(b.ndim)
        a_store, b_store = np.ascontiguousarray(a.transpose(a_perm)), np.ascontiguousarray(b.transpose(b_perm))
        a_v = a_store.transpose(np.argsort(a_perm))
        b_v = b_store.transpose(np.argsort(b_perm))
        planned = plan_gemm(list(a_v.shape), [s // 8 for s in a_v.strides], list(b_v.shape), [s // 8 for s in b_v.strides])
        if planned is None:
            continue
        calls, c_shape = planned
        got = emulate(calls, a_store.reshape(-1), b_store.reshape(-1), c_shape, alpha=2.0)
        np.testing.assert_allclose(got, 2.0 * np.matmul(a, b), rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 100


# ====================================================================== the MatMul gradient


def _batched_matmul_model(a_shape, b_shape, dtype=TensorProto.FLOAT):
    node = helper.make_node("MatMul", ["a", "b"], ["y"])
    loss = helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)
    sq = helper.make_node("Mul", ["y", "y"], ["y2"])
    graph = helper.make_graph(
        [node, sq, loss],
        "bmm",
        [helper.make_tensor_value_info("a", dtype, a_shape), helper.make_tensor_value_info("b", dtype, b_shape)],
        [helper.make_tensor_value_info("loss", dtype, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((2, 3, 4, 5), (2, 3, 5, 6)), ((2, 1, 4, 5), (3, 5, 6)), ((4, 5), (2, 5, 6)), ((5,), (2, 5, 6)), ((2, 4, 5), (5,))],
)
def test_matmul_gradient_emits_fused_matmul_not_transpose(a_shape, b_shape):
    built = gradgen.build_backward(_batched_matmul_model(a_shape, b_shape), wrt_inputs=True)
    ops = [n.op_type for n in built.model.graph]
    assert "Transpose" not in ops and ops.count("FusedMatMul") == 2, ops
    rng = np.random.default_rng(6)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_shape).astype(np.float32)}
    ours = Session(built.model).run(feeds)
    # the same graph in stock onnxruntime (its CPU provider runs FusedMatMul for float32)
    theirs = ort_run(ir.to_proto(built.model), feeds)  # first output: the loss
    np.testing.assert_allclose(theirs, ours["loss"], rtol=1e-5)
    session = ort.InferenceSession(ir.to_proto(built.model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for name, value in zip(names, session.run(None, feeds)):
        np.testing.assert_allclose(value, ours[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # and against the analytic gradient
    a64, b64 = feeds["a"].astype(np.float64), feeds["b"].astype(np.float64)
    dy = 2 * np.matmul(a64, b64)
    a2 = a64[None, :] if a64.ndim == 1 else a64
    b2 = b64[:, None] if b64.ndim == 1 else b64
    dy2 = dy[..., None, :] if a64.ndim == 1 else (dy[..., None] if b64.ndim == 1 else dy)
    da = np.matmul(dy2, np.swapaxes(b2, -1, -2))
    db = np.matmul(np.swapaxes(a2, -1, -2), dy2)
    da = da.sum(axis=tuple(range(da.ndim - a2.ndim))).reshape(a64.shape) if da.ndim > a2.ndim else da
    db = db.sum(axis=tuple(range(db.ndim - b2.ndim))) if db.ndim > b2.ndim else db
    for axis, size in enumerate(a2.shape[:-2]):
        if size == 1:
            da = da.sum(axis=axis, keepdims=True)
    np.testing.assert_allclose(ours["a_grad"], da.reshape(a64.shape), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ours["b_grad"], db.reshape(b64.shape), rtol=1e-4, atol=1e-4)


def test_portable_matmul_gradient_is_standard_onnx():
    model = _batched_matmul_model((2, 3, 4, 5), (2, 3, 5, 6))
    default = gradgen.build_backward(model, wrt_inputs=True)
    portable = gradgen.build_backward(model, wrt_inputs=True, portable=True)
    proto = ir.to_proto(portable.model)
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert sum(n.op_type == "Transpose" for n in proto.graph.node) == 2
    rng = np.random.default_rng(7)
    feeds = {"a": rng.standard_normal((2, 3, 4, 5)).astype(np.float32), "b": rng.standard_normal((2, 3, 5, 6)).astype(np.float32)}
    ours = Session(default.model).run(feeds)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for out, value in zip(session.get_outputs(), session.run(None, feeds)):
        np.testing.assert_allclose(value, ours[out.name], rtol=1e-5, atol=1e-5, err_msg=out.name)
