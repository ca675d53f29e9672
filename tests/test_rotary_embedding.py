"""RotaryEmbedding (opset 23): the CPU kernel against ONNX Runtime and ONNX's reference evaluator,
and its gradients against torch.autograd through the rotation Hugging Face's Llama writes
(``q * cos + rotate_half(q) * sin``). Finite differences: tests/grad_cases/elementwise.py."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import gradgen
from gradgen.executor import Session
from tests.test_rules_vs_torch import assert_close, torch_grads

rng = np.random.default_rng(23)


def _model(x_shape, cache_shape, attrs, with_ids, dtype=TensorProto.FLOAT):
    names = ["x", "cos", "sin"] + (["ids"] if with_ids else [])
    inputs = [helper.make_tensor_value_info(n, dtype, s) for n, s in (("x", x_shape), ("cos", cache_shape), ("sin", cache_shape))]
    if with_ids:
        seq = x_shape[2] if len(x_shape) == 4 else x_shape[1]
        inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [x_shape[0], seq]))
    node = helper.make_node("RotaryEmbedding", names, ["y"], **attrs)
    graph = helper.make_graph([node], "rotary", inputs, [helper.make_tensor_value_info("y", dtype, x_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


LAYOUTS = [
    ((2, 3, 5, 8), {}, False),
    ((2, 3, 5, 8), {"interleaved": 1}, True),
    ((2, 5, 12), {"num_heads": 3}, True),
    ((2, 5, 12), {"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, False),
    ((2, 3, 5, 8), {"rotary_embedding_dim": 4}, True),
]


def _feeds(x_shape, attrs, with_ids, dtype=np.float32):
    head_size = x_shape[3] if len(x_shape) == 4 else x_shape[2] // attrs["num_heads"]
    half = (attrs.get("rotary_embedding_dim") or head_size) // 2
    seq = x_shape[2] if len(x_shape) == 4 else x_shape[1]
    cache_shape = (7, half) if with_ids else (x_shape[0], seq, half)
    feeds = {"x": rng.normal(size=x_shape), "cos": rng.normal(size=cache_shape), "sin": rng.normal(size=cache_shape)}
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    if with_ids:
        feeds["ids"] = rng.integers(0, 7, (x_shape[0], seq)).astype(np.int64)
    return feeds, list(cache_shape)


@pytest.mark.parametrize("x_shape,attrs,with_ids", LAYOUTS)
def test_kernel_matches_onnxruntime_and_the_reference(x_shape, attrs, with_ids):
    ort = pytest.importorskip("onnxruntime")
    feeds, cache_shape = _feeds(x_shape, attrs, with_ids)
    model = _model(list(x_shape), cache_shape, attrs, with_ids)
    got = Session(model).run(feeds)["y"]
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_out_of_range_position_id_is_a_run_error():
    feeds, cache_shape = _feeds((1, 2, 3, 4), {}, True)
    feeds["ids"][0, 1] = 7
    with pytest.raises(gradgen.RunError, match="RotaryEmbedding.*position id 7 is out of range for cos_cache of 7 rows"):
        Session(_model([1, 2, 3, 4], cache_shape, {}, True)).run(feeds)


@pytest.mark.parametrize("symbolic", [False, True])
def test_gradients_match_torch_llama_rotation(symbolic):
    """Hugging Face's apply_rotary_pos_emb on (batch, heads, seq, head) with caches gathered by
    position ids: the same function as RotaryEmbedding with halves (interleaved=0)."""
    torch = pytest.importorskip("torch")
    batch, heads, seq, head, positions = 2, 3, 4, 6, 9
    inputs = {
        "x": rng.normal(size=(batch, heads, seq, head)),
        "cos": rng.normal(size=(positions, head // 2)),
        "sin": rng.normal(size=(positions, head // 2)),
    }
    ids = np.array([[0, 3, 3, 8], [5, 1, 2, 0]], dtype=np.int64)
    w = rng.uniform(0.5, 1.5, (batch, heads, seq, head))
    dims = lambda name, shape: [f"{name}{i}" for i in range(len(shape))] if symbolic else list(shape)  # noqa: E731
    graph = helper.make_graph(
        [
            helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "ids"], ["y"]),
            helper.make_node("Mul", ["y", "w"], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
        ],
        "rotary",
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, dims(n, v.shape)) for n, v in inputs.items()],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        initializer=[helper.make_tensor("ids", TensorProto.INT64, ids.shape, ids.reshape(-1)), _tensor("w", w)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    built = gradgen.build_backward(model, wrt=list(inputs))
    got = Session(built.model).run(inputs)

    def llama(x, cos, sin):
        def rotate_half(v):
            return torch.cat((-v[..., head // 2 :], v[..., : head // 2]), dim=-1)

        c = torch.cat((cos, cos), dim=-1)[torch.tensor(ids)].unsqueeze(1)  # (batch, 1, seq, head)
        s = torch.cat((sin, sin), dim=-1)[torch.tensor(ids)].unsqueeze(1)
        return x * c + rotate_half(x) * s

    assert_close({n: got[f"{n}_grad"] for n in inputs}, torch_grads(llama, inputs, [w]))


def _tensor(name, array):
    return helper.make_tensor(name, TensorProto.DOUBLE, array.shape, array.reshape(-1))
