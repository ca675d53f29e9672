"""nn.Embedding's padding_idx and scale_grad_by_freq, which PyTorch's dynamo exporter records in a
Gather's metadata (``pkg.torch.onnx.fx_node``) but not in the graph: the Gather's gradient takes
them as PyTorch's embedding backward does, says so in a note, and falls back to the graph's own
gradient (with a note) where the exporter's optimizer merged other lookups into the node."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import gradgen
from gradgen.executor import Session
from gradgen.grads.torch_records import embedding_options as torch_embedding_options
from gradgen.model_io import load_model

ROWS, WIDTH = 6, 3
IDS = np.array([[1, 4, 4, 0], [4, 1, 5, 2]], np.int64)  # row 1 twice, row 4 three times


def _call(name: str, args: str, users: int = 1) -> str:
    """How the dynamo exporter records an FX call (the text of ``pkg.torch.onnx.fx_node``)."""
    return f"%{name} : [num_users={users}] = call_function[target=torch.ops.aten.{args}, kwargs = {{}})"


def _model(embedding_args: str, *, read_twice: bool = False) -> onnx.ModelProto:
    """loss = sum(Gather(W, ids) * C) (or sum(emb * emb * C) with ``read_twice``), the Gather and
    its reader carrying the exporter's records."""
    gather = helper.make_node("Gather", ["W", "ids"], ["embedding"], name="node_embedding")
    gather.metadata_props.add(
        key="pkg.torch.onnx.fx_node", value=_call("embedding", f"embedding.default](args = ({embedding_args})")
    )
    mul = helper.make_node("Mul", ["embedding", "embedding" if read_twice else "C"], ["mul"], name="node_mul")
    # read twice: the product of two lookups the optimizer merged (the record names the twin)
    mul_args = "%embedding, %embedding_1" if read_twice else "%embedding, %c"
    mul.metadata_props.add(key="pkg.torch.onnx.fx_node", value=_call("mul", f"mul.Tensor](args = ({mul_args})"))
    nodes = [gather, mul]
    if read_twice:
        nodes.append(helper.make_node("Mul", ["mul", "C"], ["mul_c"]))
    nodes.append(helper.make_node("ReduceSum", [nodes[-1].output[0]], ["loss"], keepdims=0))
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(IDS.shape))],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((ROWS, WIDTH)), "W"),
            numpy_helper.from_array(rng.standard_normal((*IDS.shape, WIDTH)), "C"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _gradient(model: onnx.ModelProto, **options) -> tuple[np.ndarray, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = gradgen.build_backward(model, **options)
    out = Session(built.model).run({"ids": IDS})
    return out["W_grad"], [str(w.message) for w in caught]


def _torch_gradient(model: onnx.ModelProto, *, read_twice: bool = False, **embedding) -> np.ndarray:
    torch = pytest.importorskip("torch")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight = torch.tensor(inits["W"], requires_grad=True)
    looked_up = torch.nn.functional.embedding(torch.tensor(IDS), weight, **embedding)
    product = looked_up * looked_up if read_twice else looked_up
    (product * torch.tensor(inits["C"])).sum().backward()
    return weight.grad.numpy()


@pytest.mark.parametrize(
    "args, embedding",
    [
        ("%p_w, %ids, 1", {"padding_idx": 1}),
        ("%p_w, %ids, -1, True", {"scale_grad_by_freq": True}),
        ("%p_w, %ids, 4, True", {"padding_idx": 4, "scale_grad_by_freq": True}),
    ],
    ids=["padding_idx", "scale_grad_by_freq", "both"],
)
def test_recorded_embedding_options_give_pytorchs_gradient(args, embedding):
    model = _model(args)
    got, notes = _gradient(model)
    want = _torch_gradient(model, **embedding)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert len(notes) == 1 and "node_embedding" in notes[0] and "as in PyTorch" in notes[0]
    if "padding_idx" in embedding:
        assert not got[embedding["padding_idx"]].any()
        assert f"row {embedding['padding_idx']} of 'W'" in notes[0]
    if "scale_grad_by_freq" in embedding:
        assert "scale_grad_by_freq" in notes[0]
    # the graph alone (no record) gives every row its share, unscaled: PyTorch's plain embedding
    plain, plain_notes = _gradient(_model("%p_w, %ids"))
    np.testing.assert_allclose(plain, _torch_gradient(model), rtol=1e-12, atol=1e-12)
    assert not plain_notes and not np.allclose(plain, got)


def test_the_portable_graph_takes_them_too():
    got, _ = _gradient(_model("%p_w, %ids, 4, True"), portable=True)
    np.testing.assert_allclose(got, _torch_gradient(_model("%p_w, %ids"), padding_idx=4, scale_grad_by_freq=True), atol=1e-12)


def test_a_lookup_the_optimizer_merged_keeps_the_graphs_gradient():
    """The reader's own record names the lookup once, but it reads the node's output twice: another
    lookup was merged into it, whose options may differ. The graph's gradient, and a note."""
    model = _model("%p_w, %ids, 1", read_twice=True)
    got, notes = _gradient(model)
    np.testing.assert_allclose(got, _torch_gradient(model, read_twice=True), rtol=1e-12, atol=1e-12)
    assert len(notes) == 1 and "merged" in notes[0] and "optimize=False" in notes[0]


def test_what_is_read_from_the_record():
    graph = load_model(_model("%p_w, %ids, 2, True")).graph
    assert torch_embedding_options(next(iter(graph))) == (2, True)
    for args, want in (("%p_w, %ids", (None, False)), ("%p_w, %ids, -1", (None, False)), ("%p_w, %ids, 0, False", (0, False))):
        assert torch_embedding_options(next(iter(load_model(_model(args)).graph))) == want
    other = _model("%p_w, %ids, 1")
    other.graph.node[0].metadata_props[0].value = _call("index", "index.Tensor](args = (%p_w, [%ids], 1)")
    assert torch_embedding_options(next(iter(load_model(other).graph))) == (None, False)


def test_a_dynamo_export_trains_like_pytorch():
    """A real export (optimize=False), in float64: every parameter's gradient is autograd's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnxscript")  # the dynamo exporter's dependency

    class Lookups(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Embedding(ROWS, WIDTH, padding_idx=1)
            self.b = torch.nn.Embedding(ROWS, WIDTH, padding_idx=-2, scale_grad_by_freq=True)
            self.c = torch.nn.Embedding(ROWS, WIDTH)

        def forward(self, ids):
            return ((self.a(ids) + 2 * self.b(ids)) * self.c(ids)).sum()

    torch.manual_seed(0)
    module = Lookups().double()
    ids = torch.tensor(IDS)
    module(ids).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = torch.onnx.export(module, (ids,), dynamo=True, optimize=False, verbose=False).model_proto
    built = gradgen.build_backward(proto)
    out = Session(built.model).run({"ids": IDS})
    for name, parameter in module.named_parameters():
        np.testing.assert_allclose(out[f"{name}_grad"], parameter.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


def test_gradgen_check_compares_the_graphs_own_gradient_of_such_a_lookup():
    """Finite differences of the graph see the pad row's share: the check leaves the record out
    (and says so) instead of failing a correct build."""
    from gradgen.check import check_gradients

    model = _model("%p_w, %ids, 1, True")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_gradients(model, inputs={"ids": IDS})
    assert report.passed, report.format()
    notes = [str(w.message) for w in caught]
    assert any("finite differences of the graph cannot see" in n and "'node_embedding'" in n for n in notes), notes
    assert model.graph.node[0].metadata_props, "the caller's model keeps its record"


def test_a_negative_index_of_the_pad_row_gets_nothing_either():
    """Gather reads row -1 as the last one: with padding_idx the last row, -1 is the pad row too."""
    model = _model(f"%p_w, %ids, {ROWS - 1}")
    ids = np.array([[ROWS - 1, -1, 2, 0], [1, -1, 3, 2]], np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = gradgen.build_backward(model)
    got = Session(built.model).run({"ids": ids})["W_grad"]
    torch = pytest.importorskip("torch")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weight = torch.tensor(inits["W"], requires_grad=True)
    looked_up = torch.nn.functional.embedding(torch.tensor(ids % ROWS), weight, padding_idx=ROWS - 1)
    (looked_up * torch.tensor(inits["C"])).sum().backward()
    np.testing.assert_allclose(got, weight.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert not got[ROWS - 1].any()


def test_a_lookup_merged_with_its_readers_keeps_the_graphs_gradient():
    """Two lookups and their two reductions merged: the reduction is read twice by a product whose
    record names it once; the merge is found downstream of the lookup."""
    gather = helper.make_node("Gather", ["W", "ids"], ["embedding"], name="node_embedding")
    gather.metadata_props.add(key="pkg.torch.onnx.fx_node", value=_call("embedding", "embedding.default](args = (%p_w, %ids, 1)"))
    total = helper.make_node("ReduceSum", ["embedding", "last"], ["sum_1"], name="node_sum_1")
    total.metadata_props.add(key="pkg.torch.onnx.fx_node", value=_call("sum_1", "sum.dim_IntList](args = (%embedding, [-1])"))
    product = helper.make_node("Mul", ["sum_1", "sum_1"], ["mul"], name="node_mul")
    product.metadata_props.add(key="pkg.torch.onnx.fx_node", value=_call("mul", "mul.Tensor](args = (%sum_1, %sum_2)"))
    loss = helper.make_node("ReduceSum", ["mul"], ["loss"], keepdims=0)
    graph = helper.make_graph(
        [gather, total, product, loss],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, list(IDS.shape))],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[
            numpy_helper.from_array(np.random.default_rng(0).standard_normal((ROWS, WIDTH)), "W"),
            numpy_helper.from_array(np.array([-1], np.int64), "last"),
        ],
    )
    got, notes = _gradient(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert len(notes) == 1 and "merged" in notes[0], notes
    assert got[1].any(), "the graph's gradient: the pad row's share kept"
