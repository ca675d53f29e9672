"""Portable mode: LowerToStandardPass turns the com.microsoft gradient ops into standard ONNX.

Every sample and fixture model built with ``portable=True`` runs on stock onnxruntime and gives
the gradients of gradgen's executor (on the non-portable graph) and of PyTorch. Each lowering is
checked on one-node models with the CASES.md data: the lowered model runs in onnxruntime and must
give the values gradgen's com.microsoft kernels give (and the expected values where CASES.md has
them), with constant and with runtime parameters, static and symbolic shapes.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError, UnsupportedOpsError
from gradgen.executor import Session
from gradgen.kernels import registry
from gradgen.ops import schemas
from gradgen.ops.conv import conv_geometry
from gradgen.ops.schemas import LOWERED_FORWARD_OPS, MICROSOFT_DOMAIN
from gradgen.passes import LowerToStandardPass, ShapeInferencePass
from tests.model_dirs import ALL_DIRS, dir_id, load, with_symbolic_batch
from tests.test_cli import run_cli, tiny_model
from tests.test_microsoft_ops import BGA_CASES, SLICE_CASES  # the cases of CASES.md, run here on the lowered forms

ort = pytest.importorskip("onnxruntime")

MS = "com.microsoft"
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
RTOL, ATOL_OF_MAX = 1e-4, 1e-5
STANDARD = {"", "ai.onnx"}


def kernel(op_type):
    return registry.lookup(MS, op_type).cpu


def ort_run(proto: onnx.ModelProto, feeds: dict) -> dict:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))


def lower(proto: onnx.ModelProto, forget_shapes: bool = False) -> onnx.ModelProto:
    """Lower, then infer shapes as build_backward(portable=True) does; ``forget_shapes``: the pass
    sees graph inputs of unknown rank (the checker wants declared ranks on graph inputs)."""
    model = ir.from_proto(proto)
    saved = {v.name: v.shape for v in model.graph.inputs}
    if forget_shapes:
        for v in model.graph.inputs:
            v.shape = None
    LowerToStandardPass()(model)
    for v in model.graph.inputs:
        v.shape = saved[v.name]
    ShapeInferencePass()(model)
    lowered = ir.to_proto(model)
    onnx.checker.check_model(lowered, full_check=True)
    assert {n.domain for n in lowered.graph.node} <= STANDARD, sorted({n.op_type for n in lowered.graph.node})
    assert MS not in {o.domain for o in lowered.opset_import}
    return lowered


def _dims(shape, mode: str, name: str):
    if mode == "static":
        return list(shape)
    return [f"{name}_{i}" for i in range(len(shape))]  # symbolic (or, for the pass, unknown rank)


def one_node(op_type, inputs, outputs, *, const=(), mode="static", opset=17, **attrs) -> tuple[onnx.ModelProto, dict]:
    """A model of one com.microsoft node. ``inputs``: (name, array or None for an omitted input);
    names in ``const`` become initializers, the others graph inputs (shapes per ``mode``);
    ``outputs``: (name or "" for an omitted output, element type, shape)."""
    graph_inputs, initializers, feeds = [], [], {}
    for name, array in inputs:
        if array is None:
            continue
        array = np.asarray(array)
        if name in const:
            initializers.append(numpy_helper.from_array(array, name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(array.dtype)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, _dims(array.shape, mode, name)))
            feeds[name] = array
    node = helper.make_node(
        op_type, [n if a is not None else "" for n, a in inputs], [o[0] for o in outputs], domain=MS, name=op_type, **attrs
    )
    graph_outputs = [helper.make_tensor_value_info(n, t, _dims(shape, mode, n)) for n, t, shape in outputs if n]
    graph = helper.make_graph([node], op_type, graph_inputs, graph_outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)])
    return model, feeds


def op_types(proto: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in proto.graph.node}


def close(got, want, dtype=np.float32):
    tol = 1e-12 if np.dtype(dtype) == np.float64 else 1e-5
    assert got.shape == np.shape(want) and got.dtype == np.dtype(dtype), (got.shape, np.shape(want), got.dtype)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max(initial=0))))


# ====================================================================== models end to end


def _reference_grads(reference, inputs):
    grads = {k: v for k, v in reference.items() if k.endswith("_grad")}
    return grads, any(k[: -len("_grad")] in inputs for k in grads)


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_portable_model_matches_executor_and_torch(path):
    model, inputs, reference, _ = load(path)
    grads, wrt_inputs = _reference_grads(reference, inputs)
    plain = gradgen.build_backward(model, wrt_inputs=wrt_inputs)
    portable = gradgen.build_backward(model, wrt_inputs=wrt_inputs, portable=True)
    proto, plain_proto = ir.to_proto(portable.model), ir.to_proto(plain.model)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= STANDARD
    assert [(v.name, v.type) for v in proto.graph.input] == [(v.name, v.type) for v in plain_proto.graph.input]
    assert [(v.name, v.type) for v in proto.graph.output] == [(v.name, v.type) for v in plain_proto.graph.output]
    got = ort_run(proto, inputs)
    executor = Session(plain.model).run(inputs)
    assert set(got) == set(executor)
    np.testing.assert_allclose(got[portable.loss], reference["loss"], rtol=1e-5)
    for name, want in grads.items():
        atol = ATOL_OF_MAX * max(float(np.abs(want).max(initial=0.0)), 1e-30)
        assert got[name].shape == want.shape and got[name].dtype == want.dtype, name
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=atol, err_msg=f"{dir_id(path)}: {name} vs torch")
        np.testing.assert_allclose(
            got[name], executor[name], rtol=RTOL, atol=atol, err_msg=f"{dir_id(path)}: {name} vs the executor"
        )


@pytest.mark.parametrize("path", ALL_DIRS, ids=dir_id)
def test_portable_model_with_symbolic_batch(path):
    model, inputs, reference, meta = load(path)
    grads, wrt_inputs = _reference_grads(reference, inputs)
    symbolic = with_symbolic_batch(model, meta.get("batch_dim", []))
    portable = gradgen.build_backward(symbolic, wrt_inputs=wrt_inputs, portable=True)
    proto = ir.to_proto(portable.model)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= STANDARD
    got = ort_run(proto, inputs)
    for name, want in grads.items():
        atol = ATOL_OF_MAX * max(float(np.abs(want).max(initial=0.0)), 1e-30)
        np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=atol, err_msg=f"{dir_id(path)}: {name}")


# ONNX Runtime training's gradient ops, which gradgen runs and differentiates but never emits, and
# those it emits for ops these samples do not hold (GELU: tests/test_gelu_fusion.py)
RUN_NOT_EMITTED = {
    "SigmoidGrad",
    "TanhGrad",
    "GeluGrad",
    "FastGeluGrad",
    "BiasGeluGrad_dX",
    "BiasFastGeluGrad_dX",
    "SoftmaxGrad",
    "LogSoftmaxGrad",
    "SimplifiedLayerNormalizationGrad",
    "Scale",
    # a training-mode BatchNormalization's pair, which these samples (eval mode) do not hold:
    # tests/test_batch_norm_pair.py
    "BatchNormInternal",
    "BatchNormalizationGrad",
    # ONNX Runtime's forward ops of models optimized for its inference, rewritten into standard ops
    # before the gradient pass
    *(op for domain, op in LOWERED_FORWARD_OPS if domain == MICROSOFT_DOMAIN),
}


def test_only_default_domain_ops_remain():
    """Models whose plain backward graphs hold every com.microsoft op gradgen knows (with a symbolic
    batch: with static shapes the build-time evaluator makes slicing's broadcasts static too)."""
    emitted, chosen = set(), ("broadcast", "slicing", "cnn", "embedding", "gather_elements")
    for path in [p for p in ALL_DIRS if p.parent.name == "samples" and p.name in chosen]:
        model, inputs, reference, meta = load(path)
        model = with_symbolic_batch(model, meta.get("batch_dim", []))
        _, wrt_inputs = _reference_grads(reference, inputs)
        plain = ir.to_proto(gradgen.build_backward(model, wrt_inputs=wrt_inputs).model)
        proto = ir.to_proto(gradgen.build_backward(model, wrt_inputs=wrt_inputs, portable=True).model)
        emitted |= {n.op_type for n in plain.graph.node if n.domain == MS}
        assert all(n.domain in STANDARD for n in proto.graph.node), dir_id(path)
        assert all(o.domain in STANDARD for o in proto.opset_import), dir_id(path)
        # models at opset >= 16 keep their opset
        assert [o.version for o in proto.opset_import if o.domain == ""] == [
            o.version for o in plain.opset_import if o.domain == ""
        ]
    assert emitted == set(schemas.SCHEMAS) - RUN_NOT_EMITTED


def test_cli_build_backward_portable(tmp_path, capsys, monkeypatch):
    model, inputs, reference, _ = load(next(p for p in ALL_DIRS if p.name == "cnn"))
    src, out = tmp_path / "cnn.onnx", tmp_path / "cnn_portable.onnx"
    onnx.save(model, str(src))
    code, stdout, _ = run_cli(capsys, monkeypatch, "build-backward", src, "-o", out, "--portable", "--wrt-inputs")
    assert code == 0, stdout
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= STANDARD
    got = ort_run(proto, inputs)
    for name, want in reference.items():
        if name.endswith("_grad"):
            np.testing.assert_allclose(got[name], want, rtol=RTOL, atol=ATOL_OF_MAX * float(np.abs(want).max()))
    # without --portable the file holds com.microsoft ops that stock onnxruntime cannot load
    plain = tmp_path / "cnn_grad.onnx"
    code, _, _ = run_cli(capsys, monkeypatch, "build-backward", src, "-o", plain)
    assert code == 0 and any(n.domain == MS for n in onnx.load(str(plain)).graph.node)
    code, stdout, _ = run_cli(capsys, monkeypatch, "build-backward", "--help")
    assert code == 0 and "--portable" in stdout


def test_cli_portable_on_a_model_without_gradient_ops(tmp_path, capsys, monkeypatch):
    src, out = tmp_path / "tiny.onnx", tmp_path / "tiny_portable.onnx"
    tiny_model(src)
    code, stdout, _ = run_cli(capsys, monkeypatch, "build-backward", src, "-o", out, "--portable")
    assert code == 0 and "w_grad" in stdout
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    assert ort_run(proto, {"x": x})["w_grad"].shape == (3, 4)


# ====================================================================== SliceGrad


def slice_grad_model(dy, shape, starts, ends, axes, steps, const, mode="static", index_dtype=np.int64):
    as_index = lambda v: None if v is None else np.asarray(v, index_dtype)
    inputs = [("dY", dy), ("shape", np.asarray(shape, np.int64)), ("starts", as_index(starts)), ("ends", as_index(ends))]
    if axes is not None or steps is not None:
        inputs.append(("axes", as_index(axes)))
    if steps is not None:
        inputs.append(("steps", as_index(steps)))
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(dy).dtype)
    return one_node("SliceGrad", inputs, [("dX", elem, shape)], const=const, mode=mode)


@pytest.mark.parametrize("params", ["constant", "runtime"])
@pytest.mark.parametrize("case", SLICE_CASES, ids=[f"case{i}" for i in range(len(SLICE_CASES))])
def test_slice_grad_cases(case, params):
    dy, shape, starts, ends, axes, steps, want = case
    dy = np.asarray(dy, np.float32)
    const = ("shape", "starts", "ends", "axes", "steps") if params == "constant" else ()
    model, feeds = slice_grad_model(dy, shape, starts, ends, axes, steps, const)
    lowered = lower(model)
    if params == "constant":
        expected_op = "Pad" if all(s == 1 for s in steps) else "ScatterElements"
        assert expected_op in op_types(lowered) or op_types(lowered) == {"Identity"}
    got = ort_run(lowered, feeds)["dX"]
    assert got.shape == tuple(shape)
    assert got.reshape(-1).tolist() == want


def onnx_slice_length(size, start, end, step):
    """Elements ONNX's Slice takes from an axis of ``size`` (it clamps unlike Python's slices)."""
    start, end = start + size if start < 0 else start, end + size if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), size), min(max(end, 0), size)
        return max(0, -(-(end - start) // step))
    start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
    return max(0, -(-(start - end) // -step))


def test_slice_grad_random_against_kernel():
    """Steps -1, 2, -3, negative and out-of-range bounds, omitted axes/steps, int32 parameters,
    constant and runtime parameters, static and symbolic dY shapes."""
    rng = np.random.default_rng(0)
    fn = kernel("SliceGrad")
    cases = 0
    for trial in range(40):
        rank = int(rng.integers(1, 4))
        shape = rng.integers(1, 6, size=rank).tolist()
        k = int(rng.integers(1, rank + 1))
        axes = rng.permutation(rank)[:k]
        axes = [int(a) - (rank if rng.random() < 0.3 else 0) for a in axes]
        steps = [int(rng.choice([1, 1, 2, -1, -2, 3])) for _ in axes]
        starts = [int(rng.integers(-7, 8)) for _ in axes]
        ends = [int(rng.choice([rng.integers(-7, 8), INT64_MAX if s > 0 else INT64_MIN])) for s in steps]
        window = list(shape)
        for a, s, e, st in zip(axes, starts, ends, steps):
            window[a] = onnx_slice_length(shape[a], s, e, st)
        dy = rng.standard_normal(window).astype(np.float32)
        use_axes = trial % 5 != 0 or sorted(a % rank for a in axes) != list(range(k))
        use_steps = trial % 7 != 0 or any(s != 1 for s in steps)
        if not use_axes:  # axes omitted means 0..k-1
            order = np.argsort([a % rank for a in axes])
            starts, ends, steps = [starts[i] for i in order], [ends[i] for i in order], [steps[i] for i in order]
        a_arg, s_arg = (axes if use_axes else None), (steps if use_steps else None)
        index_dtype = np.int32 if trial % 3 == 0 else np.int64
        low, high = np.iinfo(index_dtype).min, np.iinfo(index_dtype).max
        starts, ends = [int(np.clip(v, low, high)) for v in starts], [int(np.clip(v, low, high)) for v in ends]
        args = [np.asarray(v, index_dtype) if v is not None else None for v in (starts, ends, a_arg, s_arg)]
        want = fn(dy, np.asarray(shape, np.int64), *args)
        const = ("shape", "starts", "ends", "axes", "steps") if trial % 2 else ()
        mode = "symbolic" if trial % 4 == 1 else "static"
        model, feeds = slice_grad_model(dy, shape, starts, ends, a_arg, s_arg, const, mode, index_dtype)
        got = ort_run(lower(model), feeds)["dX"]
        close(got, want)
        cases += 1
    assert cases == 40


def test_slice_grad_pad_path_and_double():
    dy = np.arange(8, dtype=np.float64).reshape(2, 4)
    model, feeds = slice_grad_model(dy, [4, 5], [-3, 1], [-1, 100], [0, -1], None, ("shape", "starts", "ends", "axes"))
    lowered = lower(model)
    assert "Pad" in op_types(lowered) and "ScatterElements" not in op_types(lowered)
    want = kernel("SliceGrad")(dy, np.array([4, 5]), np.array([-3, 1]), np.array([-1, 100]), np.array([0, -1]))
    close(ort_run(lowered, feeds)["dX"], want, np.float64)


# ====================================================================== GatherGrad


def gather_grad_model(shape, indices, dy, axis, *, const=(), mode="static", opset=17):
    elem = helper.np_dtype_to_tensor_dtype(np.asarray(dy).dtype)
    return one_node(
        "GatherGrad",
        [("shape", np.asarray(shape, np.int64)), ("indices", indices), ("dY", dy)],
        [("dX", elem, shape)],
        const=const,
        mode=mode,
        opset=opset,
        axis=axis,
    )


@pytest.mark.parametrize(
    "indices,want",
    [
        ([[0, 1], [0, 1]], [[0, 2, 4], [6, 8, 10], [0, 0, 0]]),
        ([[0, -1], [0, -2]], [[0, 2, 4], [3, 4, 5], [3, 4, 5]]),
    ],
)
@pytest.mark.parametrize("const", [(), ("shape", "indices")])
def test_gather_grad_cases(indices, want, const):
    dy = np.concatenate([np.arange(6), np.arange(6)]).reshape(2, 2, 3).astype(np.float32)
    model, feeds = gather_grad_model([3, 3], np.asarray(indices, np.int64), dy, 0, const=const)
    lowered = lower(model)
    assert "ScatterND" in op_types(lowered)
    assert ort_run(lowered, feeds)["dX"].tolist() == want


def test_gather_grad_aliasing_negatives():
    model, feeds = gather_grad_model([3, 2], np.array([2, -1, 0], np.int64), np.ones((3, 2), np.float32), 0)
    got = ort_run(lower(model), feeds)["dX"]
    assert got[2].tolist() == [2, 2] and got[0].tolist() == [1, 1] and got[1].tolist() == [0, 0]


@pytest.mark.parametrize(
    "data_shape,index_shape,axis",
    [
        ((3, 4), (6, 128), 1),
        ((3, 4), (6, 128), 0),
        ((2, 32), (6, 128), 1),
        ((5, 4, 3), (2, 3), 1),
        ((5, 4, 3), (7,), -1),
        ((5, 4, 3), (), 2),
        ((5, 4, 3), (2, 2), -3),
        ((50, 8), (40,), 0),
        ((4,), (3, 2, 2), 0),
    ],
)
@pytest.mark.parametrize("mode", ["static", "symbolic", "unknown rank"])
def test_gather_grad_random_against_kernel(data_shape, index_shape, axis, mode):
    rng = np.random.default_rng(1)
    size = data_shape[axis]
    indices = rng.integers(-size, size, size=index_shape)
    if mode == "symbolic":
        indices = indices.astype(np.int32)
    a = axis % len(data_shape)
    dy = rng.standard_normal(data_shape[:a] + tuple(index_shape) + data_shape[a + 1 :]).astype(np.float32)
    want = kernel("GatherGrad")(np.asarray(data_shape), indices, dy, axis=axis)
    model, feeds = gather_grad_model(data_shape, indices, dy, axis, mode=mode)
    close(ort_run(lower(model, forget_shapes=mode == "unknown rank"), feeds)["dX"], want)


def test_gather_grad_double_and_constant_shape():
    rng = np.random.default_rng(2)
    indices = rng.integers(-6, 6, size=(4, 5))
    dy = rng.standard_normal((3, 4, 5, 2)).astype(np.float64)
    want = kernel("GatherGrad")(np.array([3, 6, 2]), indices, dy, axis=1)
    model, feeds = gather_grad_model([3, 6, 2], indices, dy, 1, const=("shape",))
    close(ort_run(lower(model), feeds)["dX"], want, np.float64)


# ====================================================================== GatherElementsGrad

GATHER_ELEMENTS_CASES = [  # data, indices, axis, index dtype (CASES.md)
    ((2, 3), (1, 2), 0, np.int32),
    ((2, 2), (2, 2), 1, np.int32),
    ((2, 2), (2, 2), -1, np.int64),
    ((2, 2, 2), (1, 2, 1), 1, np.int32),
    ((2, 2, 2), (1, 2, 1), 2, np.int64),
    ((3, 3), (3, 2), 1, np.int32),
    ((3,), (2,), 0, np.int32),
    ((2, 2, 2), (3, 2, 2), 0, np.int64),
    ((2, 2, 2, 3), (3, 2, 2, 2), 0, np.int32),
    ((2, 2, 3, 3, 2), (2, 2, 3, 2, 2), 0, np.int64),
    ((2, 3, 2), (2, 3, 2), -2, np.int64),
    ((2, 2, 2), (2, 2, 3), 2, np.int64),
    ((2, 1, 2, 3, 1, 2), (2, 1, 2, 2, 1, 2), 5, np.int64),
    ((2, 1, 2, 2, 3, 2, 2), (2, 1, 2, 3, 2, 2, 2), 3, np.int32),
    ((2, 1, 1, 2, 3, 2, 3), (2, 1, 1, 2, 3, 2, 2), -5, np.int64),
]


def gather_elements_grad_model(dy, shape, indices, axis, *, const=(), mode="static"):
    elem = helper.np_dtype_to_tensor_dtype(dy.dtype)
    return one_node(
        "GatherElementsGrad",
        [("dY", dy), ("shape", np.asarray(shape, np.int64)), ("indices", indices)],
        [("dX", elem, shape)],
        const=const,
        mode=mode,
        axis=axis,
    )


@pytest.mark.parametrize("mode", ["static", "symbolic", "unknown rank"])
@pytest.mark.parametrize("case", GATHER_ELEMENTS_CASES, ids=[f"case{i}" for i in range(len(GATHER_ELEMENTS_CASES))])
def test_gather_elements_grad_cases(case, mode):
    data_shape, index_shape, axis, index_dtype = case
    rng = np.random.default_rng(len(data_shape) * 7 + axis)
    size = data_shape[axis]
    indices = rng.integers(-size, size, size=index_shape).astype(index_dtype)
    dy = np.ones(index_shape, np.float32) if mode == "static" else rng.standard_normal(index_shape).astype(np.float32)
    want = kernel("GatherElementsGrad")(dy, np.asarray(data_shape), indices, axis=axis)
    model, feeds = gather_elements_grad_model(dy, data_shape, indices, axis, mode=mode)
    lowered = lower(model, forget_shapes=mode == "unknown rank")
    assert "ScatterElements" in op_types(lowered)
    close(ort_run(lowered, feeds)["dX"], want)


@pytest.mark.parametrize(
    "shape,indices,axis,want",
    [
        ((3, 3), [[1, 2, 0], [2, 0, 0]], 0, [[0, 1, 2], [1, 0, 0], [1, 1, 0]]),
        ((2, 3), [[1, 1, 1], [1, 1, 1]], 1, [[0, 3, 0], [0, 3, 0]]),
        ((2, 2), [[0, 1, -1, -2], [1, 1, 1, 0]], 1, [[2, 2], [1, 3]]),
    ],
)
def test_gather_elements_grad_fixed_values(shape, indices, axis, want):
    indices = np.asarray(indices, np.int64)
    dy = np.ones(indices.shape, np.float64)
    model, feeds = gather_elements_grad_model(dy, shape, indices, axis, const=("shape",))
    got = ort_run(lower(model), feeds)["dX"]
    assert got.tolist() == want == kernel("GatherElementsGrad")(dy, np.asarray(shape), indices, axis=axis).tolist()


# ====================================================================== ConvGrad

CONV_CASES = [  # X, W, attributes, bias (CASES.md, then groups, auto_pad, 1x1 strided)
    ((2, 2, 5), (2, 2, 3), {"pads": [1, 1]}, False),
    ((2, 1, 7), (1, 1, 3), {"pads": [1, 1], "strides": [2]}, False),
    ((2, 1, 5), (1, 1, 1), {"pads": [1, 1]}, False),
    ((3, 1, 8), (2, 1, 2), {"pads": [2, 2], "strides": [2], "dilations": [2]}, False),
    ((2, 2, 9), (1, 2, 1), {"pads": [1, 1], "strides": [3], "dilations": [2]}, True),
    ((1, 3, 4, 4), (3, 3, 1, 1), {}, False),
    ((2, 1, 7, 5), (1, 1, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}, False),
    ((2, 1, 5, 5), (1, 1, 3, 3), {"dilations": [2, 2]}, False),
    ((2, 1, 7, 5), (1, 1, 3, 3), {"pads": [1, 1, 1, 1], "dilations": [2, 2]}, False),
    ((2, 1, 5, 5, 5), (1, 1, 3, 3, 3), {"pads": [1] * 6}, False),
    ((2, 1, 7, 5, 5), (1, 1, 3, 3, 3), {"pads": [1] * 6, "strides": [2, 2, 2]}, False),
    ((2, 1, 4, 4, 4), (2, 1, 2, 2, 2), {"pads": [2] * 6, "strides": [2] * 3, "dilations": [2] * 3}, True),
    ((2, 6, 7, 6), (4, 3, 3, 2), {"group": 2, "pads": [1, 0, 2, 1], "strides": [2, 1]}, True),  # grouped
    ((2, 4, 9), (8, 1, 3), {"group": 4, "pads": [1, 1], "strides": [2], "dilations": [2]}, True),  # depthwise x2
    ((1, 3, 6, 6), (3, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}, False),  # depthwise
    ((2, 3, 7, 6), (4, 3, 1, 1), {"strides": [2, 3]}, True),  # 1x1 strided
    ((2, 2, 7, 6), (3, 2, 3, 2), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, True),
    ((2, 2, 7, 6), (3, 2, 3, 2), {"auto_pad": "SAME_LOWER", "strides": [2, 1], "dilations": [1, 2]}, False),
    ((2, 2, 8, 6), (4, 1, 3, 3), {"auto_pad": "SAME_UPPER", "group": 2, "strides": [3, 2]}, True),
    ((2, 2, 7, 6), (3, 2, 3, 2), {"auto_pad": "VALID", "strides": [2, 2]}, False),
]


def conv_grad_model(dy, x, w, attrs, outputs=("dX", "dW", "dB"), *, const=(), mode="static", dtype=np.float32):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shapes = {"dX": x.shape, "dW": w.shape, "dB": w.shape[:1]}
    return one_node(
        "ConvGrad", [("dY", dy), ("X", x), ("W", w)], [(n, elem, shapes.get(n)) for n in outputs], const=const, mode=mode, **attrs
    )


def conv_inputs(x_shape, w_shape, attrs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal(w_shape).astype(dtype)
    y_shape = conv_geometry(x_shape, w_shape, **attrs)[4]
    dy = rng.standard_normal(y_shape).astype(dtype)
    return dy, x, w


@pytest.mark.parametrize("mode", ["static", "symbolic"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[f"case{i}" for i in range(len(CONV_CASES))])
def test_conv_grad_cases(case, mode):
    x_shape, w_shape, attrs, bias = case
    dtype = np.float32  # onnxruntime's CPU ConvTranspose is float-only
    dy, x, w = conv_inputs(x_shape, w_shape, attrs, dtype)
    outputs = ("dX", "dW", "dB") if bias else ("dX", "dW")
    want = kernel("ConvGrad")(dy, x, w, _num_outputs=len(outputs), **attrs)
    model, feeds = conv_grad_model(dy, x, w, attrs, outputs, const=("W",), mode=mode, dtype=dtype)
    lowered = lower(model)
    assert {"ConvTranspose", "Conv"} <= op_types(lowered)
    got = ort_run(lowered, feeds)
    for name, value in zip(outputs, want):
        close(got[name], value, dtype)


def test_conv_grad_known_values():
    x = np.array([2.0349, -1.8088, -0.1171, 1.1849, -0.6590, -2.0404, -1.2810], np.float32).reshape(1, 1, 7)
    w = np.array([[[0.5081]]], np.float32)
    model, feeds = conv_grad_model(np.ones((1, 1, 7), np.float32), x, w, {})
    got = ort_run(lower(model), feeds)
    np.testing.assert_allclose(got["dX"], np.full((1, 1, 7), 0.5081), rtol=1e-6)
    np.testing.assert_allclose(got["dW"].reshape(-1), [-2.6865], rtol=1e-4)


@pytest.mark.parametrize("attrs", [{"pads": [1, 1, 1, 1]}, {"auto_pad": "SAME_UPPER"}])
@pytest.mark.parametrize("mode", ["static", "symbolic"])
def test_conv_grad_auto_pad_known_values(attrs, mode):
    ones = np.ones((1, 1, 4, 4), np.float32)
    model, feeds = conv_grad_model(ones, ones, np.ones((1, 1, 3, 3), np.float32), attrs, ("", "dW"), mode=mode)
    got = ort_run(lower(model), feeds)
    assert got["dW"].reshape(-1).tolist() == [9, 12, 9, 12, 16, 12, 9, 12, 9]


@pytest.mark.parametrize("outputs", [("", "dW", "dB"), ("dX", "", ""), ("dX",), ("", "", "dB")])
def test_conv_grad_optional_outputs(outputs):
    attrs = {"group": 2, "pads": [1, 1], "strides": [2]}
    dy, x, w = conv_inputs((2, 4, 9), (6, 2, 3), attrs, np.float32, seed=3)
    want = dict(zip(("dX", "dW", "dB"), kernel("ConvGrad")(dy, x, w, **attrs)))
    model, feeds = conv_grad_model(dy, x, w, attrs, outputs)
    got = ort_run(lower(model), feeds)
    assert set(got) == {n for n in outputs if n}
    for name in got:
        close(got[name], want[name])


# ====================================================================== BroadcastGradientArgs


def bga_model(a, b, *, const=(), mode="symbolic", outputs=("a_axes", "b_axes")):
    return one_node(
        "BroadcastGradientArgs",
        [("a", np.asarray(a, np.int64)), ("b", np.asarray(b, np.int64))],
        [(n, TensorProto.INT64, [None]) for n in outputs],
        const=const,
        mode=mode,
    )


@pytest.mark.parametrize("const", [(), ("a", "b"), ("a",)], ids=["runtime", "constant", "mixed"])
@pytest.mark.parametrize("a,b,a_axes,b_axes", BGA_CASES)
def test_broadcast_gradient_args_cases(a, b, a_axes, b_axes, const):
    model, feeds = bga_model(a, b, const=const, mode="symbolic")
    lowered = lower(model)
    if const == ("a", "b"):
        assert op_types(lowered) <= {"Identity"}
    got = ort_run(lowered, feeds)
    assert got["a_axes"].dtype == np.int64 and got["b_axes"].dtype == np.int64
    assert got["a_axes"].tolist() == a_axes and got["b_axes"].tolist() == b_axes


def test_broadcast_gradient_args_random_against_kernel():
    rng = np.random.default_rng(7)
    fn = kernel("BroadcastGradientArgs")
    model, _ = bga_model([1], [1])
    session = ort.InferenceSession(lower(model).SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(200):
        out = rng.integers(0, 4, size=rng.integers(0, 6)).tolist()

        def operand(out=out):
            s = out[len(out) - rng.integers(0, len(out) + 1) :]
            return [1 if rng.random() < 0.4 else d for d in s]

        a, b = np.asarray(operand(), np.int64), np.asarray(operand(), np.int64)
        want = fn(a, b)
        got = session.run(None, {"a": a, "b": b})
        assert [g.tolist() for g in got] == [w.tolist() for w in want], (a, b)


def test_broadcast_gradient_args_one_output_and_not_broadcastable():
    model, feeds = bga_model([3, 1, 5], [2, 3, 4, 1], outputs=("", "b_axes"))
    assert ort_run(lower(model), feeds)["b_axes"].tolist() == [3]
    model, _ = bga_model([3, 4, 5], [2, 1, 6, 1], const=("a", "b"))
    with pytest.raises(ModelError, match="broadcast is not possible"):
        lower(model)


def test_dynamic_broadcast_in_a_gradient_graph():
    """A gradgen graph whose broadcast shapes are only known at run time keeps its
    BroadcastGradientArgs; portable mode lowers it to shape arithmetic."""
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["p", "q"])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["r"])
    nodes = [helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [a, b], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    plain = gradgen.build_backward(model, wrt_inputs=True)
    assert any(n.op_type == "BroadcastGradientArgs" for n in plain.model.graph)
    proto = ir.to_proto(gradgen.build_backward(model, wrt_inputs=True, portable=True).model)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= STANDARD
    rng = np.random.default_rng(0)
    for a_shape, b_shape in (((3, 4), (4,)), ((3, 4), (1,)), ((3, 1), (5,)), ((1, 1), (1,))):
        feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_shape).astype(np.float32)}
        got, want = ort_run(proto, feeds), Session(plain.model).run(feeds)
        for name in ("a_grad", "b_grad"):
            close(got[name], want[name])


# ====================================================================== opsets, errors, graph interface


@pytest.mark.parametrize("opset", [13, 14, 15])
def test_low_opset_is_converted_to_16_for_scatter_add(opset):
    indices = np.array([[0, -1], [2, 2]], np.int64)
    dy = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    model, feeds = gather_grad_model([4, 3], indices, dy, 0, opset=opset)
    lowered = lower(model)
    assert {o.domain: o.version for o in lowered.opset_import}[""] == 16
    close(ort_run(lowered, feeds)["dX"], kernel("GatherGrad")(np.array([4, 3]), indices, dy))


def test_low_opset_converted_model_keeps_meaning_of_other_nodes():
    """An opset-13 model with a BatchNormalization (changed in opsets 14 and 15) and a
    GatherElementsGrad: after the conversion to 16 both give the same values."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    stats = [numpy_helper.from_array(rng.random(3).astype(np.float32) + 0.5, n) for n in ("sc", "bi", "me", "va")]
    nodes = [
        helper.make_node("BatchNormalization", ["x", "sc", "bi", "me", "va"], ["y"]),
        helper.make_node("Shape", ["y"], ["s"]),
        helper.make_node("GatherElementsGrad", ["y", "s", "idx"], ["dx"], domain=MS, axis=1),
    ]
    idx = rng.integers(-3, 3, size=(2, 3, 4))
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("idx", TensorProto.INT64, [2, 3, 4]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4]),
            helper.make_tensor_value_info("dx", TensorProto.FLOAT, [2, 3, 4]),
        ],
        initializer=stats,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS, 1)])
    want = Session(model).run({"x": x, "idx": idx})
    lowered = lower(model)
    assert {o.domain: o.version for o in lowered.opset_import}[""] == 16
    got = ort_run(lowered, {"x": x, "idx": idx})
    for name in ("y", "dx"):
        close(got[name], want[name])


@pytest.mark.parametrize("opset", [13, 17, 20])
def test_opset_kept_when_no_scatter_add_is_needed(opset):
    attrs = {"pads": [1, 1], "strides": [2]}
    dy, x, w = conv_inputs((2, 1, 7), (1, 1, 3), attrs, np.float32)
    model, feeds = conv_grad_model(dy, x, w, attrs)
    model.opset_import[0].version = opset
    lowered = lower(model)
    assert {o.domain: o.version for o in lowered.opset_import}[""] == opset
    for name, value in zip(("dX", "dW"), kernel("ConvGrad")(dy, x, w, _num_outputs=2, **attrs)):
        close(ort_run(lowered, feeds)[name], value)


def test_unknown_non_standard_ops_are_all_listed():
    nodes = [
        helper.make_node("DropoutGrad", ["a", "b"], ["c"], domain=MS, name="sm"),
        helper.make_node("FancyOp", ["c"], ["d"], domain="my.domain", name="fancy"),
        helper.make_node("SliceGrad", ["d", "s", "st", "en"], ["e"], domain=MS, name="sg"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "ab"]
        + [helper.make_tensor_value_info(n, TensorProto.INT64, [1]) for n in ("s", "st", "en")],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1), helper.make_opsetid("my.domain", 1)]
    )
    with pytest.raises(UnsupportedOpsError) as info:
        LowerToStandardPass()(ir.from_proto(model))
    message = str(info.value)
    assert "com.microsoft::DropoutGrad" in message and "my.domain::FancyOp" in message and "'sm'" in message
    assert "SliceGrad" not in message and "lowering to standard ONNX" in message
    assert isinstance(info.value, ModelError)


def test_graph_output_names_and_types_are_kept():
    """A com.microsoft op whose output is a graph output: the lowered graph has the same outputs."""
    dy, x, w = conv_inputs((2, 2, 5), (2, 2, 3), {"pads": [1, 1]}, np.float32)
    model, _ = conv_grad_model(dy, x, w, {"pads": [1, 1]})
    before = [(o.name, o.type.tensor_type.elem_type) for o in model.graph.output]
    lowered = lower(model)
    assert [(o.name, o.type.tensor_type.elem_type) for o in lowered.graph.output] == before
    assert [i.name for i in lowered.graph.input] == [i.name for i in model.graph.input]


def test_pass_is_a_no_op_on_standard_models():
    model, _, _, _ = load(next(p for p in ALL_DIRS if p.name == "mlp"))
    ir_model = ir.from_proto(model)
    assert not LowerToStandardPass()(ir_model).modified


def test_lowering_names_a_missing_broadcast_gradient_args_input():
    node = helper.make_node("BroadcastGradientArgs", ["", "b"], ["ra", "rb"], domain=MS, name="bga")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("b", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in ("ra", "rb")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    with pytest.raises(ModelError, match=r"BroadcastGradientArgs node 'bga' lacks one of its inputs A, B"):
        LowerToStandardPass()(ir.from_proto(model))


def test_portable_matmul_with_one_dimensional_operands_runs_on_onnxruntime():
    """MatMul of a vector on either side (numpy's rules, which PyTorch's exports keep): the gradient
    products transpose an unsqueezed operand, whose rank the lowering needs."""
    rng = np.random.default_rng(0)
    w, v = rng.standard_normal((4, 5)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w_t"], ["h"]),  # (3, 5) @ (5, 4)
        helper.make_node("MatMul", ["h", "v"], ["hv"]),  # (3, 4) @ (4,)
        helper.make_node("MatMul", ["v", "w"], ["vw"]),  # (4,) @ (4, 5)
        helper.make_node("ReduceSum", ["hv"], ["s1"], keepdims=0),
        helper.make_node("MatMul", ["x", "vw"], ["xv"]),  # (3, 5) @ (5,)
        helper.make_node("ReduceSum", ["xv"], ["s2"], keepdims=0),
        helper.make_node("Add", ["s1", "s2"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes,
        "vectors",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 5])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(w.T.copy(), "w_t"), numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((3, 5)).astype(np.float32)
    portable = gradgen.build_backward(model, portable=True).model
    proto = ir.to_proto(portable)
    assert {n.domain for n in proto.graph.node} <= STANDARD
    got = ort_run(proto, {"x": x})
    want = Session(gradgen.build_backward(model).model).run({"x": x})
    assert set(want) <= set(got)
    for name, value in want.items():
        close(got[name], value)
    # d loss / d v: the column sums of h, plus w times the column sums of x
    np.testing.assert_allclose(got["v_grad"], (x @ w.T).sum(axis=0) + w @ x.sum(axis=0), rtol=1e-5)
