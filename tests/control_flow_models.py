"""Small float64 models with If, Loop, Scan and training-mode Dropout nodes, and their feeds, for
tests/test_control_flow.py and the CUDA fallback tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

D = TensorProto.DOUBLE
OPSET = [helper.make_opsetid("", 17)]


def _info(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def weights(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(4, 4)) * 0.5


def loop_model(trip_count: int | None = 3, condition: str = "passed", scan_output: bool = True) -> onnx.ModelProto:
    """h_{i+1} = tanh(h_i @ W + x[i] * (i + 1)), y_i = 2 h_{i+1}; loss = sum(ys) + sum(h_M).

    W and x are outer-scope values of the body, 1 and 2 its own initializers. ``trip_count`` None:
    M is a graph input; ``condition`` 'passed' (the body passes it through) or 'computed' (the
    loop goes on while sum(h) < 10)."""
    body_nodes = [
        helper.make_node("Gather", ["x", "i"], ["xi"], axis=0),
        helper.make_node("Cast", ["i"], ["i_f"], to=D),
        helper.make_node("Add", ["i_f", "one"], ["ip1"]),
        helper.make_node("Mul", ["xi", "ip1"], ["xs"]),
        helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
        helper.make_node("Add", ["hw", "xs"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["h_out"]),
        helper.make_node("Mul", ["h_out", "two"], ["y"]),
    ]
    if condition == "passed":
        body_nodes.append(helper.make_node("Identity", ["c_in"], ["c_out"]))
    else:
        body_nodes += [
            helper.make_node("ReduceSum", ["h_out"], ["s"], keepdims=0),
            helper.make_node("Less", ["s", "ten"], ["c_out"]),
        ]
    body_init = [numpy_helper.from_array(np.array(v), n) for n, v in (("one", 1.0), ("two", 2.0), ("ten", 10.0))]
    body_outputs = [_info("c_out", TensorProto.BOOL, []), _info("h_out", D, [2, 4])]
    if scan_output:
        body_outputs.append(_info("y", D, [2, 4]))
    body_inputs = [_info("i", TensorProto.INT64, []), _info("c_in", TensorProto.BOOL, []), _info("h_in", D, [2, 4])]
    body = helper.make_graph(body_nodes, "body", body_inputs, body_outputs, initializer=body_init)
    steps = 3 if trip_count is None else trip_count
    inputs = [_info("x", D, [max(steps, 1), 2, 4]), _info("h0", D, [2, 4])]
    inits = [numpy_helper.from_array(weights(), "W"), numpy_helper.from_array(np.array(True), "c0")]
    if trip_count is None:
        inputs.append(_info("M", TensorProto.INT64, []))
    else:
        inits.append(numpy_helper.from_array(np.array(trip_count, dtype=np.int64), "M"))
    outputs = ["hT"] + (["ys"] if scan_output else [])
    nodes = [helper.make_node("Loop", ["M", "c0", "h0"], outputs, body=body, name="loop")]
    if scan_output:
        nodes += [
            helper.make_node("ReduceSum", ["ys"], ["s1"], keepdims=0),
            helper.make_node("ReduceSum", ["hT"], ["s2"], keepdims=0),
            helper.make_node("Add", ["s1", "s2"], ["loss"]),
        ]
    else:
        nodes.append(helper.make_node("ReduceSum", ["hT"], ["loss"], keepdims=0))
    graph = helper.make_graph(nodes, "loop", inputs, [_info("loss", D, [])], initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)


def loop_feeds(steps: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(max(steps, 1), 2, 4)), "h0": rng.normal(size=(2, 4)) * 0.5}


def scan_model(length=3, in_axis=0, in_reverse=0, out_axis=0, out_reverse=0) -> onnx.ModelProto:
    """s_{t+1} = tanh(s_t @ W + x_t), y_t = s_{t+1} * s_t; loss = sum(ys^2) + sum(s_T)."""
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["s_in", "W"], ["sw"]),
            helper.make_node("Add", ["sw", "xt"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["s_out"]),
            helper.make_node("Mul", ["s_out", "s_in"], ["y"]),
        ],
        "body",
        [_info("s_in", D, [2, 4]), _info("xt", D, [2, 4])],
        [_info("s_out", D, [2, 4]), _info("y", D, [2, 4])],
    )
    x_dims: list = [2, 4]
    x_dims.insert(in_axis, length)
    scan = helper.make_node(
        "Scan",
        ["s0", "x"],
        ["sT", "ys"],
        body=body,
        num_scan_inputs=1,
        scan_input_axes=[in_axis],
        scan_input_directions=[in_reverse],
        scan_output_axes=[out_axis],
        scan_output_directions=[out_reverse],
        name="scan",
    )
    nodes = [
        scan,
        helper.make_node("Mul", ["ys", "ys"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["a"], keepdims=0),
        helper.make_node("ReduceSum", ["sT"], ["b"], keepdims=0),
        helper.make_node("Add", ["a", "b"], ["loss"]),
    ]
    inputs = [_info("x", D, x_dims), _info("s0", D, [2, 4])]
    graph = helper.make_graph(
        nodes, "scan", inputs, [_info("loss", D, [])], initializer=[numpy_helper.from_array(weights(1), "W")]
    )
    return helper.make_model(graph, opset_imports=OPSET)


def scan_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return {"x": rng.normal(size=dims), "s0": rng.normal(size=(2, 4))}


def scan_8_model() -> onnx.ModelProto:
    """Scan-8 (opset 8: a batch axis first, sequence_lens first): per batch entry b, s <- tanh(s + x_t)
    for t < lens[b], y_t = s * x_t (zeros past lens[b]); outputs sT [B, 4] and ys [B, T, 4]."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["s_in", "xt"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["s_out"]),
            helper.make_node("Mul", ["s_out", "xt"], ["y"]),
        ],
        "body",
        [_info("s_in", D, [4]), _info("xt", D, [4])],
        [_info("s_out", D, [4]), _info("y", D, [4])],
    )
    scan = helper.make_node("Scan", ["lens", "s0", "x"], ["sT", "ys"], body=body, num_scan_inputs=1, name="scan8")
    inputs = [_info("lens", TensorProto.INT32, [3]), _info("s0", D, [3, 4]), _info("x", D, [3, 5, 4])]
    graph = helper.make_graph([scan], "scan8", inputs, [_info("sT", D, [3, 4]), _info("ys", D, [3, 5, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])


def scan_8_feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"lens": np.array([5, 2, 0], np.int32), "s0": rng.normal(size=(3, 4)), "x": rng.normal(size=(3, 5, 4))}


def scan_8_reference(feeds: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """scan_8_model's outputs, computed with numpy loops."""
    s, x = feeds["s0"].copy(), feeds["x"]
    ys = np.zeros_like(x)
    for b, length in enumerate(feeds["lens"]):
        for t in range(length):
            s[b] = np.tanh(s[b] + x[b, t])
            ys[b, t] = s[b] * x[b, t]
    return s, ys


def if_model(condition: str = "data") -> onnx.ModelProto:
    """y = If(c, then: x @ W, else: x - W); loss = sum(y * y). ``condition`` 'data': c = sum(x) > 0;
    'initializer': c is a constant true initializer."""
    then_branch = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"])], "then", [], [_info("t", D, [2, 4])])
    else_branch = helper.make_graph([helper.make_node("Sub", ["x", "W2"], ["e"])], "else", [], [_info("e", D, [2, 4])])
    nodes = [
        helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch, name="choose"),
        helper.make_node("Mul", ["y", "y"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(weights(), "W"), numpy_helper.from_array(weights(2)[:2], "W2")]
    if condition == "data":
        nodes[:0] = [
            helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
            helper.make_node("Greater", ["sx", "zero"], ["c"]),
        ]
        inits.append(numpy_helper.from_array(np.array(0.0), "zero"))
    else:
        inits.append(numpy_helper.from_array(np.array(True), "c"))
    graph = helper.make_graph(nodes, "if", [_info("x", D, [2, 4])], [_info("loss", D, [])], initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)


def dropout_model(ratio: float | None = 0.3, seed: int | None = 7, mask_output: bool = False) -> onnx.ModelProto:
    """y = Dropout(x, ratio, training_mode=true); loss = sum(y * w); y is an output too. ``ratio``
    None: a graph input."""
    attrs = {} if seed is None else {"seed": seed}
    outputs = ["y", "mask"] if mask_output else ["y"]
    nodes = [
        helper.make_node("Dropout", ["x", "ratio", "train"], outputs, name="drop", **attrs),
        helper.make_node("Mul", ["y", "w"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array(True), "train"), numpy_helper.from_array(dropout_weights(), "w")]
    inputs = [_info("x", D, [3, 5])]
    if ratio is None:
        inputs.append(_info("ratio", D, []))
    else:
        inits.append(numpy_helper.from_array(np.array(ratio), "ratio"))
    graph_outputs = [_info("loss", D, []), _info("y", D, [3, 5])]
    if mask_output:
        graph_outputs.append(_info("mask", TensorProto.BOOL, [3, 5]))
    graph = helper.make_graph(nodes, "dropout", inputs, graph_outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)


def dropout_weights() -> np.ndarray:
    return np.random.default_rng(3).normal(size=(3, 5))


def nested_loop_model() -> onnx.ModelProto:
    """An outer Loop (M = 2) whose body runs an inner Loop (M = 2): h <- tanh(h @ W + x) four times,
    W and x read from the main graph by the inner body; loss = sum(h)."""
    inner = helper.make_graph(
        [
            helper.make_node("MatMul", ["g_in", "W"], ["gw"]),
            helper.make_node("Add", ["gw", "x"], ["gp"]),
            helper.make_node("Tanh", ["gp"], ["g_out"]),
            helper.make_node("Identity", ["d_in"], ["d_out"]),
        ],
        "inner",
        [_info("j", TensorProto.INT64, []), _info("d_in", TensorProto.BOOL, []), _info("g_in", D, [2, 4])],
        [_info("d_out", TensorProto.BOOL, []), _info("g_out", D, [2, 4])],
    )
    outer = helper.make_graph(
        [
            helper.make_node("Loop", ["M", "", "h_in"], ["h_mid"], body=inner, name="inner"),
            helper.make_node("Identity", ["c_in"], ["c_out"]),
        ],
        "outer",
        [_info("i", TensorProto.INT64, []), _info("c_in", TensorProto.BOOL, []), _info("h_in", D, [2, 4])],
        [_info("c_out", TensorProto.BOOL, []), _info("h_mid", D, [2, 4])],
    )
    nodes = [
        helper.make_node("Loop", ["M", "", "h0"], ["hT"], body=outer, name="outer"),
        helper.make_node("ReduceSum", ["hT"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(weights(), "W"), numpy_helper.from_array(np.array(2, dtype=np.int64), "M")]
    graph = helper.make_graph(
        nodes, "nested", [_info("x", D, [2, 4]), _info("h0", D, [2, 4])], [_info("loss", D, [])], initializer=inits
    )
    return helper.make_model(graph, opset_imports=OPSET)


def if_reading_nothing_model() -> onnx.ModelProto:
    """y = If(sum(x) > 0, then: x @ W, else: a constant, reading no outer value); loss = sum(y * y)."""
    model = if_model("data")
    else_branch = helper.make_graph(
        [helper.make_node("Constant", [], ["e"], value=numpy_helper.from_array(np.full((2, 4), 0.5), "half"))],
        "else",
        [],
        [_info("e", D, [2, 4])],
    )
    choose = next(n for n in model.graph.node if n.op_type == "If")
    next(a for a in choose.attribute if a.name == "else_branch").g.CopyFrom(else_branch)
    del model.graph.initializer[1]  # W2
    return model


def nested_if_model() -> onnx.ModelProto:
    """y = If(sum(x) > 0, then: u = x @ W; If(sum(u) > 0, then: u * W2, else: u - x), else: tanh(x) * W2);
    loss = sum(y * y). The inner branches read u (the outer branch's) and x, W2 (the main graph's)."""
    inner_then = helper.make_graph([helper.make_node("Mul", ["u", "W2"], ["it"])], "inner_then", [], [_info("it", D, [2, 4])])
    inner_else = helper.make_graph([helper.make_node("Sub", ["u", "x"], ["ie"])], "inner_else", [], [_info("ie", D, [2, 4])])
    then_branch = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "W"], ["u"]),
            helper.make_node("ReduceSum", ["u"], ["su"], keepdims=0),
            helper.make_node("Greater", ["su", "zero"], ["cu"]),
            helper.make_node("If", ["cu"], ["t"], then_branch=inner_then, else_branch=inner_else, name="inner"),
        ],
        "then",
        [],
        [_info("t", D, [2, 4])],
    )
    else_branch = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["tx"]), helper.make_node("Mul", ["tx", "W2"], ["e"])],
        "else",
        [],
        [_info("e", D, [2, 4])],
    )
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
        helper.make_node("Greater", ["sx", "zero"], ["c"]),
        helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch, name="outer"),
        helper.make_node("Mul", ["y", "y"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
    ]
    inits = [
        numpy_helper.from_array(weights(), "W"),
        numpy_helper.from_array(weights(2)[:2], "W2"),
        numpy_helper.from_array(np.array(0.0), "zero"),
    ]
    graph = helper.make_graph(nodes, "nested_if", [_info("x", D, [2, 4])], [_info("loss", D, [])], initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)


def while_model(limit: float = 20.0) -> onnx.ModelProto:
    """A while loop (no trip count): while |h| < limit, h <- 2 h + If(sum(h) > 0, then: tanh(h @ W) * a,
    else: tanh(h @ W) - a), n <- n + 1, y_i = h * a (a scan output); the loop runs only if |x| < limit
    at the start. loss = sum(h_T * h_T) + sum(ys) + n_T. W and a are outer values the body and its
    If's branches read; n is an int64 loop-carried counter."""
    t = helper.make_node("Tanh", ["hw"], ["t"])
    branch_then = helper.make_graph([helper.make_node("Mul", ["t", "a"], ["g1"])], "then", [], [_info("g1", D, [2, 4])])
    branch_else = helper.make_graph([helper.make_node("Sub", ["t", "a"], ["g2"])], "else", [], [_info("g2", D, [2, 4])])
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
            t,
            helper.make_node("ReduceSum", ["h_in"], ["sh"], keepdims=0),
            helper.make_node("Greater", ["sh", "zero"], ["positive"]),
            helper.make_node("If", ["positive"], ["g"], then_branch=branch_then, else_branch=branch_else, name="sign"),
            helper.make_node("Mul", ["h_in", "two"], ["h2"]),
            helper.make_node("Add", ["h2", "g"], ["h_out"]),
            helper.make_node("Add", ["n_in", "one"], ["n_out"]),
            helper.make_node("Mul", ["h_out", "a"], ["y"]),
            helper.make_node("ReduceL2", ["h_out"], ["norm"], keepdims=0),
            helper.make_node("Less", ["norm", "limit"], ["c_out"]),
        ],
        "body",
        [
            _info("i", TensorProto.INT64, []),
            _info("c_in", TensorProto.BOOL, []),
            _info("h_in", D, [2, 4]),
            _info("n_in", TensorProto.INT64, []),
        ],
        [
            _info("c_out", TensorProto.BOOL, []),
            _info("h_out", D, [2, 4]),
            _info("n_out", TensorProto.INT64, []),
            _info("y", D, [2, 4]),
        ],
        initializer=[numpy_helper.from_array(np.array(2.0), "two"), numpy_helper.from_array(np.array(1, dtype=np.int64), "one")],
    )
    nodes = [
        helper.make_node("ReduceL2", ["x"], ["norm0"], keepdims=0),
        helper.make_node("Less", ["norm0", "limit"], ["c0"]),
        helper.make_node("Loop", ["", "c0", "x", "n0"], ["hT", "nT", "ys"], body=body, name="while"),
        helper.make_node("Mul", ["hT", "hT"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["a1"], keepdims=0),
        helper.make_node("ReduceSum", ["ys"], ["a2"], keepdims=0),
        helper.make_node("Cast", ["nT"], ["nf"], to=D),
        helper.make_node("Sum", ["a1", "a2", "nf"], ["loss"]),
    ]
    inits = [
        numpy_helper.from_array(weights(4), "W"),
        numpy_helper.from_array(np.random.default_rng(5).normal(size=4), "a"),
        numpy_helper.from_array(np.array(0.0), "zero"),
        numpy_helper.from_array(np.array(limit), "limit"),
        numpy_helper.from_array(np.array(0, dtype=np.int64), "n0"),
    ]
    graph = helper.make_graph(
        nodes, "while", [_info("x", D, [2, 4])], [_info("loss", D, []), _info("nT", TensorProto.INT64, [])], initializer=inits
    )
    return helper.make_model(graph, opset_imports=OPSET)


def nested_run_time_loops_model() -> onnx.ModelProto:
    """An outer Loop with a trip count M (a graph input) that also stops once sum(h) >= 10, whose
    body runs an inner Loop of N iterations (a graph input) of g <- sin(g * k) from g = h, then
    h <- h + g + k; k is a loop-carried float the body passes through unchanged.
    loss = sum(h_T * k_T)."""
    inner = helper.make_graph(
        [
            helper.make_node("Mul", ["g_in", "k"], ["g2"]),
            helper.make_node("Sin", ["g2"], ["g_out"]),
            helper.make_node("Identity", ["d_in"], ["d_out"]),
        ],
        "inner",
        [_info("j", TensorProto.INT64, []), _info("d_in", TensorProto.BOOL, []), _info("g_in", D, [2, 4])],
        [_info("d_out", TensorProto.BOOL, []), _info("g_out", D, [2, 4])],
    )
    outer = helper.make_graph(
        [
            helper.make_node("Loop", ["N", "", "h_in"], ["h_mid"], body=inner, name="inner"),
            helper.make_node("Add", ["h_mid", "k"], ["hk"]),
            helper.make_node("Add", ["hk", "h_in"], ["h_out"]),
            helper.make_node("ReduceSum", ["h_out"], ["sh"], keepdims=0),
            helper.make_node("Less", ["sh", "limit"], ["c_out"]),
        ],
        "outer",
        [_info("i", TensorProto.INT64, []), _info("c_in", TensorProto.BOOL, []), _info("h_in", D, [2, 4]), _info("k", D, [2, 4])],
        [_info("c_out", TensorProto.BOOL, []), _info("h_out", D, [2, 4]), _info("k", D, [2, 4])],
    )
    nodes = [
        helper.make_node("Loop", ["M", "c0", "h0", "k0"], ["hT", "kT"], body=outer, name="outer"),
        helper.make_node("Mul", ["hT", "kT"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
    ]
    inputs = [
        _info("h0", D, [2, 4]),
        _info("k0", D, [2, 4]),
        _info("M", TensorProto.INT64, []),
        _info("N", TensorProto.INT64, []),
    ]
    inits = [numpy_helper.from_array(np.array(True), "c0"), numpy_helper.from_array(np.array(10.0), "limit")]
    graph = helper.make_graph(nodes, "nested_loops", inputs, [_info("loss", D, [])], initializer=inits)
    return helper.make_model(graph, opset_imports=OPSET)
