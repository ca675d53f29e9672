"""The op-semantics layer (gradgen/ops): the shared rules every layer takes an op's meaning from."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.errors import KernelError, ModelError
from gradgen.ops import axes, conv, elementwise, indexing, pool, schemas, shape


def test_normalize_axis_counts_negative_axes_from_the_end():
    assert axes.normalize_axis(-1, 3) == 2
    assert axes.normalize_axis(0, 3) == 0
    with pytest.raises(KernelError, match=r"axis 3 is out of range for rank 3 \(valid range \[-3, 2\]\)"):
        axes.normalize_axis(3, 3)
    with pytest.raises(KernelError, match="out of range for rank 0"):
        axes.normalize_axis(0, 0)
    assert axes.normalize_axis(0, 0, allow_scalar=True) == 0


def test_normalize_axes_refuses_a_repeated_axis():
    assert axes.normalize_axes([-1, 0], 2) == [1, 0]
    with pytest.raises(KernelError, match=r"repeated axes \[1, -1\]"):
        axes.normalize_axes([1, -1], 2)


def test_broadcast_axes_static_and_runtime_agree():
    assert elementwise.broadcast_gradient_axes([3, 1], [2, 1, 4]) == ([2, 0], [1])
    assert elementwise.static_broadcast_axes([3, 1], [2, 3, 4]) == [0, 2]
    assert elementwise.static_broadcast_axes(["n", 4], ["n", 4]) == []
    assert elementwise.static_broadcast_axes([None, 4], [None, 4]) is None  # unknown dims never match
    with pytest.raises(KernelError, match="broadcast is not possible"):
        elementwise.broadcast_gradient_axes([3], [4])


@pytest.mark.parametrize(
    "dims, starts, ends, axes_, steps",
    [
        ([5, 6], [1, -2], [4, 100], None, None),
        ([5], [-1], [-100], [0], [-2]),
        ([4, 3], [9], [-9], [-2], [-1]),
    ],
)
def test_slice_geometry_matches_numpy(dims, starts, ends, axes_, steps):
    data = np.arange(int(np.prod(dims))).reshape(dims)
    index = [slice(None)] * len(dims)
    for i, axis in enumerate(axes_ if axes_ is not None else range(len(starts))):
        index[axis] = slice(starts[i], ends[i], 1 if steps is None else steps[i])
    expected = data[tuple(index)]
    got = data[shape.slice_index(shape.slice_geometry(dims, starts, ends, axes_, steps))]
    np.testing.assert_array_equal(got, expected)


def test_slice_window_pads_undo_a_plain_slice():
    assert shape.slice_window_pads([5, 6], [1, -2], [4, 100]) == [1, 4, 1, 0]
    assert shape.slice_window_pads([None, 6], [1], [3]) is None


def test_normalize_indices_wraps_negatives_and_names_a_bad_index():
    np.testing.assert_array_equal(indexing.normalize_indices(np.array([-1, 0]), 3, 0), [2, 0])
    with pytest.raises(KernelError, match=r"index 3 \(at position \[1\] of the indices\).*axis 0 of size 3"):
        indexing.normalize_indices(np.array([0, 3]), 3, 0)


def test_conv_and_pool_geometry_agree_on_same_padding():
    begin, end, strides, _, out = conv.conv_geometry((1, 2, 7, 7), (4, 2, 3, 3), auto_pad="SAME_LOWER", strides=[2, 2])
    *_, p_begin, p_end, p_out = pool.spatial_geometry((1, 2, 7, 7), [3, 3], [2, 2], None, None, "SAME_LOWER")
    assert (begin, end, list(out[2:])) == (p_begin, p_end, p_out) == ([1, 1], [1, 1], [4, 4])


def test_pool_ceil_mode_drops_a_window_starting_past_the_input():
    assert pool.pool_output_shape([1, 1, 2], {"kernel_shape": [1], "strides": [2], "ceil_mode": 1}) == [1, 1, 1]


def test_schemas_check_microsoft_nodes():
    schemas.check_node("SliceGrad", 4, 1)
    with pytest.raises(ModelError, match=r"SliceGrad node 'n' takes 4 to 6 inputs"):
        schemas.check_node("SliceGrad", 3, 1, where="node 'n'")
    with pytest.raises(ModelError, match="unknown attribute"):
        schemas.check_node("GatherGrad", 3, 1, ["axes"])
    with pytest.raises(ModelError, match="is not one of the ops gradgen knows"):
        schemas.check_node("NoSuchGrad", 1, 1)


def _slice_grad_model(num_inputs: int):
    import onnx_ir as ir
    from onnx import TensorProto, helper

    names = ["dy", "shape", "starts", "ends", "axes", "steps"][:num_inputs]
    node = helper.make_node("SliceGrad", names, ["dx"], domain="com.microsoft", name="sg")
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT if n == "dy" else TensorProto.INT64, None) for n in names]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)])
    return ir.from_proto(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    )


def test_executor_and_lowering_check_microsoft_nodes_against_their_schema():
    from gradgen.executor import Session
    from gradgen.passes import LowerToStandardPass

    Session(_slice_grad_model(4))  # a well-formed node plans
    with pytest.raises(ModelError, match=r"SliceGrad node 'sg'.* takes 4 to 6 inputs .*got 3"):
        Session(_slice_grad_model(3))
    with pytest.raises(ModelError, match=r"SliceGrad node 'sg' takes 4 to 6 inputs .*got 3"):
        LowerToStandardPass()(_slice_grad_model(3))


def test_builder_checks_the_microsoft_nodes_it_emits():
    import onnx_ir as ir

    from gradgen.builder import MICROSOFT, GraphBuilder

    graph = ir.Graph([], [], nodes=[])
    builder = GraphBuilder(graph, 17)
    shape = builder.ints([2, 3])
    with pytest.raises(ModelError, match=r"GatherGrad \(emitted by gradgen\) has unknown attribute\(s\) axes"):
        builder.op("GatherGrad", shape, shape, shape, domain=MICROSOFT, axes=[0])


def test_ops_signatures_come_from_the_schemas(capsys):
    from gradgen.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["ops", "--signatures"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "SliceGrad(dY, shape, starts, ends, axes?, steps?) -> dX" in lines
    assert len(lines) == len(schemas.SCHEMAS)


@pytest.mark.parametrize("blocksize", [1, 2, 3])
def test_depth_space_plans_match_torch_pixel_shuffle_and_invert_each_other(blocksize):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(blocksize).standard_normal((2, 3 * blocksize**2, 4, 5))

    def rearrange(a, plan):
        blocked, perm, out_shape = plan
        return a.reshape(blocked).transpose(perm).reshape(out_shape)

    crd = rearrange(x, shape.depth_to_space_plan(x.shape, blocksize, "CRD"))
    np.testing.assert_array_equal(crd, torch.pixel_shuffle(torch.from_numpy(x), blocksize).numpy())
    np.testing.assert_array_equal(rearrange(crd, shape.space_to_depth_plan(crd.shape, blocksize, "CRD")), x)
    np.testing.assert_array_equal(
        rearrange(crd, shape.space_to_depth_plan(crd.shape, blocksize, "CRD")),
        torch.pixel_unshuffle(torch.from_numpy(crd), blocksize).numpy(),
    )
    dcr = rearrange(x, shape.depth_to_space_plan(x.shape, blocksize, "DCR"))
    assert dcr.shape == crd.shape == (2, 3, 4 * blocksize, 5 * blocksize)
    np.testing.assert_array_equal(rearrange(dcr, shape.space_to_depth_plan(dcr.shape, blocksize, "DCR")), x)


def test_depth_space_plans_reject_bad_shapes_and_modes():
    with pytest.raises(KernelError, match="4-D NCHW input, got rank 3"):
        shape.depth_to_space_plan((1, 4, 2), 2)
    with pytest.raises(KernelError, match=r"channels \(6\) must be divisible by blocksize\^2 \(4\)"):
        shape.depth_to_space_plan((1, 6, 2, 2), 2)
    with pytest.raises(KernelError, match=r"height \(3\) and width \(4\) must be divisible by blocksize \(2\)"):
        shape.space_to_depth_plan((1, 1, 3, 4), 2)
    with pytest.raises(KernelError, match="unknown mode 'XYZ'"):
        shape.space_to_depth_plan((1, 1, 2, 2), 2, "XYZ")


def test_concat_shape_sums_the_axis_and_checks_the_rest():
    f32 = np.dtype(np.float32)
    assert shape.concat_shape([(2, 3, 4), (2, 5, 4)], [f32, f32], -2) == (1, [2, 8, 4])
    with pytest.raises(KernelError, match="needs at least one input"):
        shape.concat_shape([], [], 0)
    with pytest.raises(KernelError, match="input 1 has rank 2, input 0 has rank 3"):
        shape.concat_shape([(2, 3, 4), (2, 3)], [f32, f32], 1)
    with pytest.raises(KernelError, match=r"input 1 has shape \[2, 3, 5\], input 0 has \[2, 3, 4\]: .* every axis but 1"):
        shape.concat_shape([(2, 3, 4), (2, 3, 5)], [f32, f32], 1)
    with pytest.raises(KernelError, match="input 1 has dtype float64, input 0 has float32; Concat needs one type"):
        shape.concat_shape([(2, 3), (2, 3)], [f32, np.dtype(np.float64)], 0)
    with pytest.raises(KernelError, match="axis 3 is out of range for rank 2"):
        shape.concat_shape([(2, 3)], [f32], 3)


@pytest.mark.parametrize("op_type", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_window_needs_kernel_shape(op_type):
    from gradgen.kernels.registry import lookup

    assert pool.pool_window(op_type, (1, 1, 5), [2], [2], None, None, "NOTSET") == ([2], [2], [1], [0], [0], [2])
    with pytest.raises(KernelError, match=f"{op_type} needs the kernel_shape attribute"):
        pool.pool_window(op_type, (1, 1, 5), None, None, None, None, "NOTSET")
    with pytest.raises(KernelError, match=f"{op_type} needs the kernel_shape attribute"):
        lookup("", op_type).cpu(np.zeros((1, 1, 5), np.float32))
