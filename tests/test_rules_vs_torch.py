"""gradgen's gradients against torch.autograd on the same data (float64).

Each test builds a small ONNX model whose loss is sum_k sum(w_k * out_k) over the node's outputs,
builds its backward graph with gradgen, runs it on gradgen's executor, and compares with the same
computation written in torch. Where a torch op refuses a gradient (the running statistics of
F.batch_norm, the class weights of F.cross_entropy) the same formula is written out in torch ops.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.errors import ModelError
from gradgen.executor import Session

torch = pytest.importorskip("torch")
F = torch.nn.functional

rng = np.random.default_rng(2024)


def _vi(name, array, symbolic):
    dims = [f"{name}_d{i}" for i in range(array.ndim)] if symbolic else list(array.shape)
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(array.dtype), dims)


def run_gradgen(
    op_type, inputs: dict, consts: dict, attrs: dict, out_shapes: list, opset=17, symbolic=False, out_casts=(), order=None
):
    """Gradients of sum_k sum(w_k * out_k) w.r.t. every entry of ``inputs``, by gradgen.

    ``out_shapes`` gives each output's shape (for the weights w_k); ``out_casts`` lists outputs to
    Cast to double before weighting (outputs typed in a stash type); ``order`` the node's input
    names in order (default: inputs, then consts). Returns (grads, weights).
    """
    outs = [f"out{k}" for k in range(len(out_shapes))]
    names = order or list(inputs) + list(consts)
    nodes = [helper.make_node(op_type, [n if n else "" for n in names], outs, name="node", **attrs)]
    weights, terms, inits = [], [], [numpy_helper.from_array(v, n) for n, v in consts.items() if n]
    for k, shape in enumerate(out_shapes):
        w = rng.uniform(0.5, 1.5, shape)
        weights.append(w)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        src = outs[k]
        if k in out_casts:
            nodes.append(helper.make_node("Cast", [src], [f"c{k}"], to=TensorProto.DOUBLE))
            src = f"c{k}"
        nodes += [
            helper.make_node("Mul", [src, f"w{k}"], [f"t{k}"]),
            helper.make_node("ReduceSum", [f"t{k}"], [f"s{k}"], keepdims=0),
        ]
        terms.append(f"s{k}")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph = helper.make_graph(
        nodes,
        "g",
        [_vi(n, v, symbolic) for n, v in inputs.items()],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    built = gradgen.build_backward(model, wrt=list(inputs))
    got = Session(built.model).run(dict(inputs))
    return {n: got[f"{n}_grad"] for n in inputs}, weights


def torch_grads(fn, inputs: dict, weights: list):
    ts = {n: torch.tensor(v, requires_grad=True) for n, v in inputs.items()}
    outs = fn(**ts)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    loss = sum((o * torch.tensor(w)).sum() for o, w in zip(outs, weights))
    loss.backward()
    return {n: t.grad.numpy() for n, t in ts.items()}


def assert_close(got, want, rtol=1e-9, atol=1e-11):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=atol, err_msg=name)


# -- BatchNormalization (inference) --------------------------------------------------------------


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 4, 4), (4, 3), (2, 3, 5)])
def test_batch_norm_eval(shape, symbolic):
    c = shape[1]
    inputs = {
        "x": rng.normal(size=shape),
        "scale": rng.normal(size=c),
        "b": rng.normal(size=c),
        "mean": rng.normal(size=c),
        "var": rng.uniform(0.5, 2.0, c),
    }
    eps = 1e-3
    got, w = run_gradgen("BatchNormalization", inputs, {}, {"epsilon": eps}, [shape], opset=15, symbolic=symbolic)
    view = (1, c) + (1,) * (len(shape) - 2)

    def explicit(x, scale, b, mean, var):  # running stats differentiable, as in ONNX eval mode
        return (x - mean.reshape(view)) / torch.sqrt(var.reshape(view) + eps) * scale.reshape(view) + b.reshape(view)

    assert_close(got, torch_grads(explicit, inputs, w))

    # torch's own batch_norm for X, scale and B (it refuses gradients for the running stats).
    def native(x, scale, b):
        return F.batch_norm(x, torch.tensor(inputs["mean"]), torch.tensor(inputs["var"]), scale, b, training=False, eps=eps)

    sub = {k: inputs[k] for k in ("x", "scale", "b")}
    assert_close({k: got[k] for k in sub}, torch_grads(native, sub, w))


# -- LayerNormalization ----------------------------------------------------------------------------


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("shape,axis", [((2, 3, 4), -1), ((2, 3, 4), 1), ((3, 5), 0), ((2, 2, 3, 2), -2)])
def test_layer_norm(shape, axis, symbolic):
    norm_shape = shape[axis % len(shape) :]
    inputs = {"x": rng.normal(size=shape), "scale": rng.normal(size=norm_shape), "b": rng.normal(size=norm_shape)}
    eps = 1e-4
    got, w = run_gradgen("LayerNormalization", inputs, {}, {"axis": axis, "epsilon": eps}, [shape], symbolic=symbolic)
    want = torch_grads(lambda x, scale, b: F.layer_norm(x, norm_shape, scale, b, eps), inputs, w)
    assert_close(got, want)


@pytest.mark.parametrize("symbolic", [False, True])
def test_layer_norm_stat_outputs_carry_gradients(symbolic):
    """Mean and InvStdDev feeding the loss: their gradients reach X (recomputed, not read back)."""
    shape, axis, eps = (2, 3, 4), 1, 1e-3
    inputs = {"x": rng.normal(size=shape), "scale": rng.normal(size=(3, 4))}
    stat_shape = (2, 1, 1)
    got, w = run_gradgen(
        "LayerNormalization",
        inputs,
        {},
        {"axis": axis, "epsilon": eps},
        [shape, stat_shape, stat_shape],
        symbolic=symbolic,
        out_casts=(1, 2),
    )

    def ln(x, scale):
        mean = x.mean(dim=(1, 2), keepdim=True)
        rstd = 1 / torch.sqrt(((x - mean) ** 2).mean(dim=(1, 2), keepdim=True) + eps)
        return (x - mean) * rstd * scale, mean, rstd

    # Mean/InvStdDev are typed float32 (stash_type=1), so their gradients pass through float32.
    assert_close(got, torch_grads(ln, inputs, w), rtol=1e-6, atol=1e-7)


# -- SoftmaxCrossEntropyLoss ---------------------------------------------------------------------


def _sce_torch(labels, ignore_index, reduction):
    def fn(scores, weights=None):
        kwargs = {"reduction": reduction}
        if ignore_index is not None:
            kwargs["ignore_index"] = ignore_index
        loss = F.cross_entropy(scores, torch.tensor(labels), weight=None if weights is None else weights.detach(), **kwargs)
        return loss, F.log_softmax(scores, dim=1)

    return fn


def _sce_explicit(labels, ignore_index, reduction):
    """The ONNX definition written in torch ops, so that the weights get a gradient too."""

    def fn(scores, weights):
        logp = F.log_softmax(scores, dim=1)
        lab = torch.tensor(labels)
        used = torch.ones_like(lab, dtype=torch.bool) if ignore_index is None else lab != ignore_index
        safe = torch.where(used, lab, torch.zeros_like(lab))
        w = torch.where(used, weights[safe], torch.zeros((), dtype=scores.dtype))
        loss = -logp.gather(1, safe.unsqueeze(1)).squeeze(1) * w
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":
            loss = loss.sum() / w.sum()
        return loss, logp

    return fn


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("scores_shape", [(6, 4), (3, 4, 2, 2)])
@pytest.mark.parametrize("ignore_index", [None, 1, -100])
def test_softmax_cross_entropy(scores_shape, reduction, ignore_index, symbolic):
    n, c = scores_shape[:2]
    label_shape = (n,) + scores_shape[2:]
    labels = rng.integers(0, c, label_shape).astype(np.int64)
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index
    scores, weights = rng.normal(size=scores_shape), rng.uniform(0.3, 1.5, c)
    attrs = {"reduction": reduction}
    if ignore_index is not None:
        attrs["ignore_index"] = ignore_index
    loss_shape = () if reduction != "none" else label_shape
    out_shapes = [loss_shape, scores_shape]  # the log_prob output carries a gradient too

    # With weights: gradgen vs F.cross_entropy for the scores, vs the explicit formula for both.
    got, w = run_gradgen(
        "SoftmaxCrossEntropyLoss",
        {"scores": scores},
        {"labels": labels, "weights": weights},
        attrs,
        out_shapes,
        symbolic=symbolic,
    )
    native = torch_grads(
        lambda scores: _sce_torch(labels, ignore_index, reduction)(scores, torch.tensor(weights)), {"scores": scores}, w
    )
    assert_close(got, native)
    got2, w2 = run_gradgen(
        "SoftmaxCrossEntropyLoss",
        {"scores": scores, "weights": weights},
        {"labels": labels},
        attrs,
        out_shapes,
        symbolic=symbolic,
        order=["scores", "labels", "weights"],
    )
    assert_close(got2, torch_grads(_sce_explicit(labels, ignore_index, reduction), {"scores": scores, "weights": weights}, w2))

    # Without weights.
    got3, w3 = run_gradgen(
        "SoftmaxCrossEntropyLoss", {"scores": scores}, {"labels": labels}, attrs, out_shapes, symbolic=symbolic
    )
    assert_close(got3, torch_grads(lambda scores: _sce_torch(labels, ignore_index, reduction)(scores), {"scores": scores}, w3))


# -- MatMul with broadcast batch dims ------------------------------------------------------------


@pytest.mark.parametrize("symbolic", [False, True])
@pytest.mark.parametrize(
    "a_shape,b_shape",
    [
        ((2, 1, 3, 4), (5, 4, 2)),
        ((1, 3, 4), (2, 5, 4, 2)),
        ((4,), (2, 3, 4, 2)),
        ((2, 3, 3, 4), (4,)),
        ((3, 1, 2, 4), (1, 5, 4, 3)),
    ],
)
def test_matmul_broadcast(a_shape, b_shape, symbolic):
    inputs = {"a": rng.normal(size=a_shape), "b": rng.normal(size=b_shape)}
    out_shape = np.matmul(inputs["a"], inputs["b"]).shape
    got, w = run_gradgen("MatMul", inputs, {}, {}, [out_shape], symbolic=symbolic)
    assert_close(got, torch_grads(lambda a, b: torch.matmul(a, b), inputs, w))


# -- a few more checks against torch ---------------------------------------------------------------


@pytest.mark.parametrize("opset", [17, 18])
def test_reduce_max_ties_split_evenly(opset):
    x = np.array([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, -1.0]])
    axes = {"axes": [1]} if opset < 18 else {}
    consts = {"axes": np.array([1], np.int64)} if opset >= 18 else {}
    got, w = run_gradgen("ReduceMax", {"x": x}, consts, {"keepdims": 0, **axes}, [(2,)], opset=opset)
    assert_close(got, torch_grads(lambda x: torch.amax(x, dim=1), {"x": x}, w))


def test_reduce_dynamic_axes():
    """Axes given as a graph input (known only at run time), keepdims=0."""
    x, axes = rng.normal(size=(2, 3, 4)), np.array([0, -1], np.int64)
    outs = ["y"]
    node = helper.make_node("ReduceLogSumExp", ["x", "axes"], outs, keepdims=0)
    w = rng.uniform(0.5, 1.5, (3,))
    graph = helper.make_graph(
        [node, helper.make_node("Mul", ["y", "w"], ["t"]), helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)],
        "g",
        [_vi("x", x, False), helper.make_tensor_value_info("axes", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    built = gradgen.build_backward(model, wrt=["x"])
    got = Session(built.model).run({"x": x, "axes": axes})["x_grad"]
    assert_close({"x": got}, torch_grads(lambda x: torch.logsumexp(x, dim=(0, 2)), {"x": x}, [w]))


def test_group_norm_opset18_per_group_symbolic():
    """The opset 18 form (scale/bias per group) with every dim symbolic (form chosen by opset)."""
    x, s, b = rng.normal(size=(2, 6, 2)), rng.normal(size=3), rng.normal(size=3)
    inputs = {"x": x, "s": s, "b": b}
    eps = 1e-3
    outs = ["y"]
    wy = rng.uniform(0.5, 1.5, x.shape)
    graph = helper.make_graph(
        [
            helper.make_node("GroupNormalization", ["x", "s", "b"], outs, num_groups=3, epsilon=eps),
            helper.make_node("Mul", ["y", "w"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ],
        "g",
        [_vi(n, v, True) for n, v in inputs.items()],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[numpy_helper.from_array(wy, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    built = gradgen.build_backward(model, wrt=list(inputs))
    res = Session(built.model).run(inputs)

    def gn(x, s, b):
        xg = x.reshape(2, 3, -1)
        mean = xg.mean(dim=2, keepdim=True)
        var = ((xg - mean) ** 2).mean(dim=2, keepdim=True)
        return (((xg - mean) / torch.sqrt(var + eps)) * s[None, :, None] + b[None, :, None]).reshape(x.shape)

    # Groups of 4 elements: the normalisation is ill-conditioned enough to cost a few more digits.
    assert_close({n: res[f"{n}_grad"] for n in inputs}, torch_grads(gn, inputs, [wy]), rtol=1e-7, atol=1e-9)


def test_group_norm_opset21_vs_torch():
    x, s, b = rng.normal(size=(2, 6, 3)), rng.normal(size=6), rng.normal(size=6)
    inputs = {"x": x, "s": s, "b": b}
    got, w = run_gradgen("GroupNormalization", inputs, {}, {"num_groups": 2, "epsilon": 1e-3}, [x.shape], opset=21, symbolic=True)
    assert_close(got, torch_grads(lambda x, s, b: F.group_norm(x, 2, s, b, 1e-3), inputs, w))


def test_instance_norm_vs_torch():
    x, s, b = rng.normal(size=(2, 3, 4, 2)), rng.normal(size=3), rng.normal(size=3)
    inputs = {"x": x, "s": s, "b": b}
    got, w = run_gradgen("InstanceNormalization", inputs, {}, {"epsilon": 1e-3}, [x.shape], symbolic=True)
    assert_close(got, torch_grads(lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-3), inputs, w))


@pytest.mark.parametrize(
    "equation,shapes",
    [
        ("bhqd,bhkd->bhqk", [(2, 2, 3, 4), (2, 2, 5, 4)]),
        ("...ij,...jk->...ik", [(1, 3, 4), (2, 4, 2)]),
        ("...ij,jk->...i", [(2, 3, 4), (4, 5)]),
        ("bii->b", [(2, 3, 3)]),
        ("ii", [(4, 4)]),
        ("iij->j", [(3, 3, 2)]),
        ("bij,bjj->bi", [(2, 3, 4), (2, 4, 4)]),
        ("i...i", [(3, 2, 3)]),
        ("...i->i", [(2, 3, 4)]),
        ("ij,ij->i", [(3, 4), (1, 4)]),
    ],
)
def test_einsum_vs_torch(equation, shapes):
    inputs = {f"x{i}": rng.normal(size=s) for i, s in enumerate(shapes)}
    out_shape = torch.einsum(equation, *[torch.tensor(v) for v in inputs.values()]).shape
    got, w = run_gradgen("Einsum", inputs, {}, {"equation": equation}, [tuple(out_shape)], opset=17)
    assert_close(got, torch_grads(lambda **kw: torch.einsum(equation, *kw.values()), inputs, w))


@pytest.mark.parametrize(
    "equation,message",
    [("ij,jk->ik", "2 operand"), ("ij->ii", "more than once"), ("ij->k", "in no operand"), ("i1->i", "not a label")],
)
def test_einsum_malformed_equation_is_refused_by_name(equation, message):
    with pytest.raises(ModelError, match=f"'node'.*{message}"):
        run_gradgen("Einsum", {"x": rng.normal(size=(3, 3))}, {}, {"equation": equation}, [(3,)])


@pytest.fixture(autouse=True)
def _own_random_stream(request):
    """Each test draws from its own seeded stream, so results do not depend on test order or workers."""
    import zlib

    global rng
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))


# -- Clip with learnable bounds (a silent zero gradient before) -----------------------------------


@pytest.mark.parametrize("bounds", [(-0.5, 0.7), (0.4, -0.2), (None, 0.3), (-0.1, None)])
def test_clip_bounds_vs_torch_clamp(bounds):
    x = rng.standard_normal((3, 7))
    inputs = {"x": x}
    order = ["x", "", ""]
    for k, (name, value) in enumerate(zip(("lo", "hi"), bounds)):
        if value is not None:
            inputs[name] = np.array(value)
            order[k + 1] = name
    got, weights = run_gradgen("Clip", inputs, {}, {}, [x.shape], order=order)
    want = torch_grads(lambda x, lo=None, hi=None: torch.clamp(x, lo, hi), inputs, weights)
    assert_close(got, want)
    for name in ("lo", "hi"):
        if name in inputs:
            assert np.any(got[name] != 0) or name == "lo" and bounds[0] > (bounds[1] if bounds[1] is not None else np.inf)
