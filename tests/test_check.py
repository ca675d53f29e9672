"""``gradgen check`` and ``gradgen.check``: backward graphs against float64 finite differences."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from gradgen.check import check_gradients, to_float64
from gradgen.executor import Session
from gradgen.grads import registry
from tests.model_dirs import SAMPLE_DIRS, dir_id
from tests.test_cli import run_cli, tiny_model


@pytest.mark.parametrize("sample", SAMPLE_DIRS, ids=dir_id)
def test_every_sample_passes(sample):
    report = check_gradients(sample / "model.onnx", inputs=sample / "inputs.npz", wrt_inputs=True, samples=2)
    assert report.passed, report.format()
    assert report.tensors and all(t.max_rel_err < 1e-6 for t in report.tensors), report.format()


def test_cli_passes_and_prints_a_table(capsys, monkeypatch):
    sample = SAMPLE_DIRS[0]
    code, out, err = run_cli(
        capsys, monkeypatch, "check", sample / "model.onnx", "--inputs", sample / "inputs.npz", "--samples", "1"
    )
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("tensor"))
    for column in ("shape", "max abs err", "max rel err", "tolerance", "verdict"):
        assert column in header
    assert sum(line.rstrip().endswith("PASS") for line in lines) >= 1 and "FAIL" not in out


def _mul_model(path) -> None:
    """loss = sum(tanh(x * w) * v): the gradients of w and v go through Mul."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"], name="mul1"),
        helper.make_node("Tanh", ["a"], ["t"], name="tanh"),
        helper.make_node("Mul", ["t", "v"], ["b"], name="mul2"),
        helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "mul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[
            numpy_helper.from_array(rng.standard_normal((2, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal((3,)).astype(np.float32), "v"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.fixture
def broken_mul(monkeypatch):
    """Replace the Mul rule by one that forgets the other operand for input 0 (dA = dY)."""
    rules = registry.all_rules()  # loads the table
    good = rules[("", "Mul")]

    def wrong(g):
        return [g.dy() if g.needs(0) else None, g.op("Mul", g.dy(), g.x(0)) if g.needs(1) else None]

    monkeypatch.setitem(registry._RULES, ("", "Mul"), registry.GradRule("", "Mul", wrong, good.broadcast, good.nondiff_inputs))


def test_a_broken_rule_fails_naming_the_tensor(tmp_path, capsys, monkeypatch, broken_mul):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt_inputs=True)
    assert not report.passed
    failed = set(report.failures)
    assert "w" in failed and "x" in failed  # dL/dw and dL/dx both go through mul1's input 0 or 1
    assert "v" not in failed  # v is input 1 of mul2: its rule is still right
    code, out, err = run_cli(capsys, monkeypatch, "check", path, "--random-inputs")
    assert code == 4
    assert [line for line in out.splitlines() if line.startswith("w ")][0].rstrip().endswith("FAIL")
    assert err.strip().splitlines()[-1].startswith("error: gradient check failed") and "w" in err


def test_the_same_model_passes_with_the_real_rule(tmp_path):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt_inputs=True, samples=4)
    assert report.passed, report.format()
    assert [t.name for t in report.tensors] == ["w", "v", "x"]
    assert all("direction" in t.method and "element" in t.method for t in report.tensors)


def test_large_tensors_are_checked_along_directions_only(tmp_path):
    tiny = tmp_path / "t.onnx"
    tiny_model(tiny)  # w is 3x4: elements too; make x large
    report = check_gradients(tiny, inputs={"x": np.random.default_rng(0).standard_normal((40, 3))}, wrt_inputs=True)
    assert report.passed, report.format()
    by_name = {t.name: t for t in report.tensors}
    assert "element" in by_name["w"].method and "element" not in by_name["x"].method


def test_vector_jacobian_product(tmp_path, capsys, monkeypatch):
    path = tmp_path / "m.onnx"
    tiny_model(path, scalar_loss=False)
    code, out, err = run_cli(
        capsys, monkeypatch, "check", path, "--loss", "r", "--random-inputs", "--dim", "N=3", "--wrt-inputs", "--seed", "3"
    )
    assert code == 0, err
    assert "PASS" in out and "FAIL" not in out


def test_wrt_and_freeze_select_the_tensors(tmp_path):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt=["v", "x"], freeze=["x"])
    assert [t.name for t in report.tensors] == ["v"]


def test_to_float64_converts_types_casts_and_constants():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])
    nodes = [
        helper.make_node("Constant", [], ["c"], value_float=2.5),
        helper.make_node("Constant", [], ["cs"], value_floats=[1.0, 2.0]),
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([2], np.int64))),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.array([1.5], np.float32))),
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xf", "c"], ["a"]),
        helper.make_node("Add", ["a", "cs"], ["b"]),
        helper.make_node("Add", ["b", "ones"], ["d"]),
        helper.make_node("Mul", ["d", "w"], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [x],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.array([0.5, -1.0], np.float32), "w")],
        value_info=[helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    double = to_float64(model)
    assert model.SerializeToString() == before  # the input is not modified
    onnx.checker.check_model(double, full_check=True)
    assert double.graph.input[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.output[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.value_info[0].type.tensor_type.elem_type == TensorProto.DOUBLE
    assert double.graph.initializer[0].data_type == TensorProto.DOUBLE
    got = Session(double).run({"x": np.array([1.0, 3.0])})["loss"]
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, 0.5 * (2.5 + 1 + 1.5) - 1.0 * (7.5 + 2 + 1.5))
    report = check_gradients(model, inputs={"x": np.array([1.0, 3.0], np.float16)}, wrt_inputs=True)
    assert report.passed, report.format()


# -- inputs within each op's contract, non-finite losses, float32-only inputs, kinks ---------------


def _model(nodes, inputs, outputs=None, initializers=(), opset=17) -> onnx.ModelProto:
    """A one-graph model; ``outputs`` default to a float32 scalar ``loss``."""
    outputs = outputs or [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _save(path, nodes, inputs, initializers, opset=17):
    onnx.save(_model(nodes, inputs, initializers=initializers, opset=opset), str(path))


def _scatter_model(path, op: str) -> None:
    """loss = sum(scatter(data, idx, upd)^2) with reduction 'none' and integer indices drawn at random."""
    rng = np.random.default_rng(0)
    if op == "ScatterElements":
        data, idx, upd, attrs = (5, 3), [4, 3], (4, 3), {"axis": 0}
    else:
        data, idx, upd, attrs = (3, 4, 2), [6, 2], (6, 2), {}
    nodes = [
        helper.make_node(op, ["data", "idx", "upd"], ["s"], name="scatter", **attrs),
        helper.make_node("Mul", ["s", "s"], ["q"], name="square"),
        helper.make_node("ReduceSum", ["q"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(
        path,
        nodes,
        [helper.make_tensor_value_info("idx", TensorProto.INT64, idx)],
        [
            numpy_helper.from_array(rng.standard_normal(data).astype(np.float32), "data"),
            numpy_helper.from_array(rng.standard_normal(upd).astype(np.float32), "upd"),
        ],
    )


@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
def test_random_scatter_indices_are_distinct_for_reduction_none(tmp_path, capsys, monkeypatch, op):
    """Repeated indices are undefined for reduction='none'; drawing them failed correct models."""
    path = tmp_path / "m.onnx"
    _scatter_model(path, op)
    from gradgen.inputs import random_feeds
    from gradgen.model_io import load_model

    for seed in range(8):
        idx = random_feeds(load_model(path), seed=seed)["idx"]
        if op == "ScatterElements":  # distinct along the axis, per column
            assert all(len(set(idx[:, j])) == idx.shape[0] for j in range(idx.shape[1]))
            assert idx.min() >= 0 and idx.max() < 5
        else:  # distinct index tuples, each component within its axis
            assert len({tuple(row) for row in idx}) == len(idx)
            assert (idx[:, 0] < 3).all() and (idx[:, 1] < 4).all() and idx.min() >= 0
        code, out, err = run_cli(capsys, monkeypatch, "check", path, "--random-inputs", "--seed", str(seed))
        assert code == 0, out + err


def test_too_many_distinct_indices_is_a_usage_error(tmp_path, capsys, monkeypatch):
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("ScatterElements", ["data", "idx", "upd"], ["s"], name="scatter", axis=0),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(
        tmp_path / "m.onnx",
        nodes,
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [6, 3])],
        [
            numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "data"),
            numpy_helper.from_array(rng.standard_normal((6, 3)).astype(np.float32), "upd"),
        ],
    )
    code, _, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs")
    assert code == 2
    assert "'idx'" in err and "6 distinct indices along axis 0 cannot fit in 5" in err


def test_gather_nd_indices_are_drawn_per_component(tmp_path):
    from gradgen.inputs import random_feeds
    from gradgen.model_io import load_model

    nodes = [
        helper.make_node("GatherND", ["data", "idx"], ["g"], name="gnd"),
        helper.make_node("ReduceSum", ["g"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(
        tmp_path / "m.onnx",
        nodes,
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [50, 2])],
        [numpy_helper.from_array(np.ones((9, 2), np.float32), "data")],
    )
    idx = random_feeds(load_model(tmp_path / "m.onnx"))["idx"]
    assert idx[:, 0].max() < 9 and idx[:, 1].max() < 2 and idx[:, 0].max() >= 2  # not bounded by axis 1 only


def test_an_integer_shape_input_is_not_drawn_at_random(tmp_path, capsys, monkeypatch):
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(
        tmp_path / "m.onnx",
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [],
    )
    code, _, err = run_cli(capsys, monkeypatch, "run", tmp_path / "m.onnx", "--random-inputs", "--device", "cpu")
    assert code == 2
    assert "'shape'" in err and "Reshape node 'reshape'" in err and "--inputs" in err


@pytest.mark.parametrize(
    ("op", "count_type", "extra_inputs"),
    [("OneHot", TensorProto.FLOAT, ["vals"]), ("CumProd", TensorProto.INT64, []), ("Range", TensorProto.FLOAT, [])],
)
def test_a_float_or_integer_count_input_is_not_drawn_at_random(tmp_path, capsys, monkeypatch, op, count_type, extra_inputs):
    """OneHot's depth and Range's limits may be floats, CumProd's axis an integer: drawn at random
    they made a depth of 0 ("depth must be positive"), an axis out of range, or an output of
    another shape than the model declares."""
    f = TensorProto.FLOAT
    if op == "OneHot":
        inputs = [("idx", TensorProto.INT64, [3]), ("depth", count_type, []), ("vals", f, [2])]
        nodes = [helper.make_node("OneHot", ["idx", "depth", "vals"], ["y"], name="node")]
    elif op == "CumProd":
        inputs = [("x", f, [3]), ("depth", count_type, [])]
        nodes = [helper.make_node("CumProd", ["x", "depth"], ["y"], name="node")]
    else:
        inputs = [("start", f, []), ("depth", count_type, []), ("delta", f, [])]
        nodes = [helper.make_node("Range", ["start", "depth", "delta"], ["y"], name="node")]
    nodes.append(helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"))
    _save(tmp_path / "m.onnx", nodes, [helper.make_tensor_value_info(n, t, d) for n, t, d in inputs], [], opset=24)
    code, _, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs", "--wrt-inputs")
    assert code == 2, err
    assert f"{op} node 'node' (a shape, axes or count)" in err and "--inputs" in err


def test_roi_align_batch_indices_are_drawn_among_the_images(tmp_path):
    import onnx_ir as ir

    from gradgen.inputs import random_feeds

    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    nodes = [helper.make_node("RoiAlign", ["x", "rois", "batch"], ["y"], output_height=2, output_width=2)]
    inputs = [helper.make_tensor_value_info("x", f, [3, 2, 8, 8]), helper.make_tensor_value_info("rois", f, [40, 4])]
    inputs.append(helper.make_tensor_value_info("batch", i64, [40]))
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", f, [40, 2, 2, 2])])
    for seed in range(3):
        batch = random_feeds(ir.from_proto(model), seed=seed)["batch"]
        assert batch.min() >= 0 and batch.max() <= 2 and len(set(batch.tolist())) == 3


def test_a_loss_whose_shape_follows_drawn_values_is_one_line_naming_it(tmp_path):
    """Compress's condition drawn at random keeps another count of rows than the model declares;
    the backward graph's seed has the declared shape, and check said "input 'y_grad': dimension 0
    is 1, but the model declares 2"."""
    from gradgen.errors import RunError

    f = TensorProto.FLOAT
    nodes = [helper.make_node("Compress", ["x", "keep"], ["y"], axis=0)]
    inputs = [helper.make_tensor_value_info("x", f, [6, 2]), helper.make_tensor_value_info("keep", TensorProto.BOOL, [6])]
    model = _model(nodes, inputs, [helper.make_tensor_value_info("y", f, [2, 2])])
    keep = np.array([True, False, True, False, True, False])
    with pytest.raises(RunError, match=r"the loss 'y' has shape \[3, 2\] at these inputs, but the model declares \[2, 2\]"):
        check_gradients(model, inputs={"x": np.ones((6, 2), np.float32), "keep": keep}, wrt_inputs=True, loss="y")


def test_batchnorm_variance_is_drawn_positive(tmp_path, capsys, monkeypatch):
    names = ["x", "scale", "bias", "mean", "var"]
    shapes = [[2, 3, 4], [3], [3], [3], [3]]
    nodes = [
        helper.make_node("BatchNormalization", names, ["y"], name="bn"),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(tmp_path / "m.onnx", nodes, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)], [])
    for seed in range(4):
        code, out, err = run_cli(
            capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs", "--wrt-inputs", "--seed", str(seed)
        )
        assert code == 0, out + err


def test_batch_norm_internal_variance_is_drawn_positive(tmp_path, capsys, monkeypatch):
    """ONNX Runtime training's BatchNormInternal (what a default build makes of a training-mode
    BatchNormalization): its variance input is drawn positive too."""
    import onnx_ir as ir

    from gradgen.inputs import random_feeds

    names = ["x", "scale", "bias", "mean", "var"]
    shapes = [[4, 3, 2], [3], [3], [3], [3]]
    outputs = ["y", "rm", "rv", "saved_mean", "saved_inv_std"]
    nodes = [
        helper.make_node("BatchNormInternal", names, outputs, domain="com.microsoft", name="bn", training_mode=1),
        helper.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0, name="sum"),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in zip(names, shapes)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    graph.value_info.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, shapes[0]))  # (ONNX cannot infer it)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    for seed in range(4):
        assert (random_feeds(ir.from_proto(model), seed=seed)["var"] > 0).all()
    onnx.save(model, str(tmp_path / "m.onnx"))
    code, out, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs", "--wrt-inputs")
    assert code == 0, out + err


def test_a_non_finite_loss_is_named(tmp_path, capsys, monkeypatch):
    """An empty batch through ReduceMean: NaN, said as such instead of a comparison of NaNs."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["m"], name="mul"),
        helper.make_node("ReduceMean", ["m"], ["loss"], keepdims=0, name="mean"),
    ]
    _save(
        tmp_path / "m.onnx",
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")],
    )
    code, out, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs", "--dim", "N=0")
    assert code == 4
    [line] = err.strip().splitlines()
    assert line.startswith("error: the loss 'loss' is not finite at these inputs (it is nan; inputs: x float64[0, 3])")
    assert "max abs err" not in out


def _resize_model(path, opset: int = 19) -> None:
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c", "", "scales"], ["r"], name="resize", mode="linear"),
        helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0, name="sum"),
    ]
    _save(
        path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [
            numpy_helper.from_array(rng.standard_normal((3, 2, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        ],
        opset=opset,
    )


def test_float32_only_inputs_stay_float32_in_the_float64_copy(tmp_path, capsys, monkeypatch):
    """Resize's scales must be float32: the copy keeps them so and stays a valid model."""
    _resize_model(tmp_path / "m.onnx")
    double = to_float64(str(tmp_path / "m.onnx"))
    onnx.checker.check_model(double, full_check=True)
    types = {t.name: t.data_type for t in double.graph.initializer}
    assert types == {"w": TensorProto.DOUBLE, "scales": TensorProto.FLOAT}
    code, out, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--random-inputs", "--wrt-inputs")
    assert code == 0, out + err
    # a computed scales tensor gets a Cast to float32 instead
    model = onnx.load(str(tmp_path / "m.onnx"))
    model.graph.node.insert(0, helper.make_node("Identity", ["scales"], ["scales2"], name="copy"))
    model.graph.node[2].input[2] = "scales2"
    double = to_float64(model)
    onnx.checker.check_model(double, full_check=True)
    cast = next(n for n in double.graph.node if n.op_type == "Cast")
    assert list(cast.input) == ["scales2"] and cast.attribute[0].i == TensorProto.FLOAT


def test_a_failure_at_a_kink_says_so(tmp_path, capsys, monkeypatch):
    """relu(x + w) with one element 1e-7 above its kink: central differences straddle it."""
    nodes = [
        helper.make_node("Add", ["x", "w"], ["h"], name="add"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0, name="sum"),
    ]
    w = np.array([0.5, -1.0, 2.0], np.float32)
    _save(
        tmp_path / "m.onnx",
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(w, "w")],
    )
    x = np.array([1.0, 1.0 + 2**-23, 3.0], np.float32)  # x + w = [1.5, 1.2e-7, 5]
    np.savez(tmp_path / "x.npz", x=x)
    report = check_gradients(tmp_path / "m.onnx", inputs={"x": x})
    [tensor] = report.tensors
    assert not tensor.passed and tensor.kink and "at a kink" in tensor.note
    code, out, err = run_cli(capsys, monkeypatch, "check", tmp_path / "m.onnx", "--inputs", tmp_path / "x.npz")
    assert code == 4
    assert "w at a kink of the loss" in err.strip().splitlines()[-1]
    # away from the kink the same model passes, and a wrong rule is not mistaken for a kink
    away = check_gradients(tmp_path / "m.onnx", inputs={"x": np.array([1.0, 2.0, 3.0], np.float32)})
    assert away.passed, away.format()


def test_a_tie_shared_among_elements_is_called_a_kink():
    """ReduceMin over three tied elements gives each a third: between the one-sided differences (0
    and 1), not equal to either; ONNX's test_reduce_min_default_axes_keepdims_example failed without
    the note."""
    nodes = [helper.make_node("ReduceMin", ["x"], ["loss"], keepdims=0, name="min")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])])
    report = check_gradients(model, inputs={"x": np.array([1.0, 3.0, 1.0, 1.0], np.float32)}, wrt_inputs=True)
    [tensor] = report.tensors
    assert not tensor.passed and tensor.kink and "between them" in tensor.note, report.format()


def test_a_wrong_gradient_is_not_called_a_kink(tmp_path, broken_mul):
    path = tmp_path / "m.onnx"
    _mul_model(path)
    report = check_gradients(path, random_inputs=True, wrt_inputs=True)
    assert not report.passed and not any(t.kink for t in report.tensors)


def test_the_model_file_is_read_once(tmp_path, monkeypatch):
    """check reads MODEL once for its float64 copy and for judging the given inputs."""
    import gradgen.check as check_module
    import gradgen.model_io as model_io

    tiny_model(tmp_path / "m.onnx")
    np.savez(tmp_path / "in.npz", x=np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32))
    reads = []
    real = model_io.load_model

    def counted(model):
        if not isinstance(model, onnx.ModelProto) and not hasattr(model, "graph"):
            reads.append(model)
        return real(model)

    monkeypatch.setattr(check_module, "load_model", counted)
    report = check_gradients(tmp_path / "m.onnx", inputs=tmp_path / "in.npz")
    assert report.passed, report.format()
    assert reads == [tmp_path / "m.onnx"]


def test_attention_softmax_precision_is_lifted_to_float64():
    """A float32 softmax inside the float64 copy would round the finite differences away: the
    check of an Attention with softmax_precision=FLOAT reported Q's and K's gradients wrong."""
    rng = np.random.default_rng(0)
    shape = [1, 2, 3, 4]
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], softmax_precision=TensorProto.FLOAT)
    model = _model(
        [node],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT16, shape) for n in "QKV"],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT16, shape)],
        opset=23,
    )
    double = to_float64(model)
    assert helper.get_attribute_value(double.graph.node[0].attribute[0]) == TensorProto.DOUBLE
    feeds = {n: rng.standard_normal(shape).astype(np.float16) for n in "QKV"}
    report = check_gradients(model, inputs=feeds, wrt_inputs=True, loss="Y")
    assert report.passed and all(t.max_rel_err < 1e-6 for t in report.tensors), report.format()


def test_an_output_whose_shape_moves_with_a_float_input_is_one_line(tmp_path, capsys, monkeypatch):
    """OneHot's depth given as a float: 10 - eps has another floor, so the shifted output has
    another shape. This used to escape as a numpy broadcasting traceback."""
    node = helper.make_node("OneHot", ["indices", "depth", "values"], ["y"], name="onehot")
    model = _model(
        [node],
        [helper.make_tensor_value_info("depth", TensorProto.FLOAT, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 10])],
        [
            numpy_helper.from_array(np.array([1, 4, 9], np.int64), "indices"),
            numpy_helper.from_array(np.array([0.5, 2.0], np.float32), "values"),
        ],
    )
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "in.npz", depth=np.array(10.0, np.float32))
    code, out, err = run_cli(
        capsys, monkeypatch, "check", tmp_path / "m.onnx", "--inputs", tmp_path / "in.npz", "--wrt-inputs", "--loss", "y"
    )
    assert code == 4, out + err
    [line] = err.strip().splitlines()
    assert line.startswith("error: the shape of 'y' changes from [3, 10] to [3, 9] when 'depth' moves by 1e-06"), line


def test_constant_of_shape_without_a_value_makes_float64_zeros():
    """ConstantOfShape's default value is a float32 zero: the float64 copy of ONNX's expanded
    LinearAttention (a Scan state started from one) added float32 to float64 and failed to run."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Add", ["zeros", "x"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        initializers=[numpy_helper.from_array(np.array([2], np.int64), "shape")],
    )
    assert Session(to_float64(model)).run({"x": np.array([1.0, 2.0])})["loss"].dtype == np.float64
    report = check_gradients(model, inputs={"x": np.array([1.0, 2.0], np.float32)}, wrt_inputs=True)
    assert report.passed, report.format()


def test_bfloat16_inputs_are_taken_and_converted():
    """A bfloat16 array (numpy kind 'V') for a bfloat16 input: refused as 'dtype bfloat16, but the
    model declares float64' before."""
    import ml_dtypes

    nodes = [helper.make_node("Mul", ["x", "x"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [3])],
        [helper.make_tensor_value_info("loss", TensorProto.BFLOAT16, [])],
    )
    x = np.array([0.5, -1.25, 2.0], ml_dtypes.bfloat16)
    report = check_gradients(model, inputs={"x": x}, wrt_inputs=True)
    assert report.passed and report.tensors[0].name == "x", report.format()
