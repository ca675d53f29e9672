"""The optimizer's tags and the fused multi-tensor update's and gradient norm's plans
(gradgen/executor/fused_optimizer.py), on the CPU: which nodes are tagged and with what roles, which
steps the rewrites replace, what they leave alone, the launch arguments they pack, and the Session's
state guard. The GPU tests
(tests/cuda/test_cuda_fused_optimizer.py) run the kernel against the unfused steps and PyTorch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from gradgen.errors import UsageError
from gradgen.executor import Session
from gradgen.executor import fused_optimizer as fo
from gradgen.executor.fusion import DOMAIN, plan_dtypes
from gradgen.training import SGD, AdamW, build_training
from gradgen.training.loss_scaling import LOSS_SCALING, LossScaling
from gradgen.training.optimizers import CONFIG_KEY, NORM_KEY, PARAM_KEY, READS_KEY, SKIP_CONFIG, SKIP_ROLE, WRITES_KEY

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMER = ROOT / "samples/transformer/model.onnx"
OPTIMIZERS = [
    (AdamW(), 1.0),
    (AdamW(weight_decay=0.0, bias_correction=False), None),
    (SGD(momentum=0.9, nesterov=True, weight_decay=0.1), 1.0),
    (SGD(), None),
]


def _plan(program, guard=True):
    """The training step's CPU plan (tags on its steps) and that plan with the update fused."""
    guard_names = [program.loss, program.layout.grad_norm] if guard else []
    session = Session(program.train, state=program.state_bindings(), state_guard=guard_names)
    fused = fo.fuse_update(session.steps, session.graph, set(session.output_names), session.state_bindings, guard_names)
    return session, fused


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_every_update_node_is_tagged_with_its_parameter_and_roles(optimizer, clip):
    program = build_training(TRANSFORMER, optimizer=optimizer, clip_norm=clip)
    graph = ir.from_proto(ir.to_proto(program.train)).graph  # the tags survive saving
    config = json.loads(graph.metadata_props[CONFIG_KEY])
    assert config["kind"] == optimizer.kind and config["clip_norm"] == clip
    inputs = {v.name for v in graph.inputs}
    for param in program.params:
        nodes = [n for n in graph if n.metadata_props.get(PARAM_KEY) == param]
        reads = {}
        for node in nodes:
            roles = node.metadata_props[READS_KEY].split(",")
            assert len(roles) == len(node.inputs)
            for role, value in zip(roles, node.inputs):
                if role:
                    reads.setdefault(role, set()).add(value.name)
                elif value.name not in graph.initializers:  # made by the update itself
                    assert value.producer() in nodes, (param, node.name, value.name)
        assert reads["param"] == {param}
        assert reads["grad"] == {f"{param}_grad"}
        for kind in optimizer.state_kinds:
            assert reads[f"state:{kind}"] == {f"{param}.{kind}"} and f"{param}.{kind}" in inputs
        assert ("scalar:clip" in reads) == (clip is not None)
        writes = {n.metadata_props[WRITES_KEY]: n.outputs[0].name for n in nodes if WRITES_KEY in n.metadata_props}
        assert writes == {"param": f"{param}.next", **{f"state:{k}": f"{param}.{k}.next" for k in optimizer.state_kinds}}


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_the_plan_replaces_every_tagged_step_by_one_update_step_last(optimizer, clip):
    program = build_training(TRANSFORMER, optimizer=optimizer, clip_norm=clip)
    session, fused = _plan(program)
    tagged = [s for s in session.steps if s.metadata and PARAM_KEY in s.metadata]
    assert tagged and len(fused) == len(session.steps) - len(tagged) + 1
    assert not any(s.metadata and PARAM_KEY in s.metadata for s in fused)
    step = fused[-1]
    assert (step.domain, step.op_type) == (DOMAIN, fo.OP_TYPE)
    assert step.inputs[:2] == [program.loss, program.layout.grad_norm]
    assert sorted(step.outputs) == sorted(program.state_bindings().values())
    for param in program.params:  # each parameter's tensors in the kernel's order
        at = step.inputs.index(param)
        want = [param, f"{param}_grad", *(f"{param}.{k}" for k in optimizer.state_kinds)]
        assert step.inputs[at : at + len(want)] == want
    made_before = {n for s in fused[:-1] for n in s.outputs} | set(session.input_names) | set(session.initializers)
    assert all(n in made_before for n in step.inputs)
    assert not any(n in step.outputs for s in fused[:-1] for n in s.inputs)  # nothing reads what it writes


def test_without_a_guard_nothing_is_fused():
    program = build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0)
    session, fused = _plan(program, guard=False)
    assert fused == session.steps


def _loss_scaled_plan(program):
    """The plan of a loss-scaled step as DeviceStepRunner guards it (the loss alone), both fusions."""
    guard = [program.loss]
    session = Session(program.train, state=program.state_bindings(), state_guard=guard)
    keep = set(session.output_names)
    fused = fo.fuse_update(session.steps, session.graph, keep, session.state_bindings, guard)
    return session, fo.fuse_norm(fused, session.graph, keep)


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_loss_scaled_updates_tag_their_overflow_wheres(optimizer, clip):
    program = build_training(TRANSFORMER, optimizer=optimizer, clip_norm=clip, loss_scaling=LossScaling())
    graph = ir.from_proto(ir.to_proto(program.train)).graph
    assert json.loads(graph.metadata_props[CONFIG_KEY])[SKIP_CONFIG] is True
    flag = program.layout.found_inf
    found = next(v for v in graph.outputs if v.name == flag).producer().inputs[0]  # the Identity's input
    check = found.producer()  # IsNaN(norm - norm): the norm is not finite
    assert check.op_type == "IsNaN" and check.inputs[0].producer().op_type == "Sub"
    assert [v.name for v in check.inputs[0].producer().inputs] == [program.layout.grad_norm] * 2
    for param in program.params:
        nodes = [n for n in graph if n.metadata_props.get(PARAM_KEY) == param]
        writers = {n.metadata_props[WRITES_KEY]: n for n in nodes if WRITES_KEY in n.metadata_props}
        assert set(writers) == {"param", *(f"state:{k}" for k in optimizer.state_kinds)}
        for role, node in writers.items():  # Where(found, old, new): the old value's role, the new one made inside
            assert node.op_type == "Where" and node.inputs[0] is found
            assert node.metadata_props[READS_KEY] == f"{SKIP_ROLE},{role},"
            assert node.inputs[2].producer() in nodes and node.outputs[0].name in program.state_bindings().values()


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS)
def test_a_loss_scaled_update_fuses_with_its_overflow_flag(optimizer, clip):
    program = build_training(TRANSFORMER, optimizer=optimizer, clip_norm=clip, loss_scaling=LossScaling())
    session, fused = _loss_scaled_plan(program)
    assert not any(s.metadata and PARAM_KEY in s.metadata for s in fused)
    params = {p: program.layout.params[p] for p in program.params}
    written = [*params.values(), *(s.output for s in program.layout.states if s.param in params)]
    assert not any(s.op_type == "Where" and s.outputs[0] in written for s in fused)
    step = fused[-1]
    assert (step.domain, step.op_type) == (DOMAIN, fo.OP_TYPE) and step.entry.cuda.kind.skip
    found = next(s for s in session.steps if s.outputs == [program.layout.found_inf]).inputs[0]
    assert step.inputs[:2] == [program.loss, found]  # the guard, then the overflow flag
    assert sorted(step.outputs) == sorted(written)
    # the scaler's state stays graph ops, committed by the Session
    scaler = [s.output for s in program.layout.states if s.param == LOSS_SCALING]
    assert scaler and all(any(name in s.outputs for s in fused[:-1]) for name in scaler)
    assert _norm_step(fused) is not None


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_mixed_precision_steps_fuse_the_update_and_the_norm(precision, model):
    """bf16 (float32 master weights, gradients cast back to float32) and fp16 (loss-scaled): every
    parameter's update in the multi-tensor step, the norm in its reduction, as in float32."""
    program = build_training(ROOT / f"samples/{model}/model.onnx", optimizer=AdamW(), clip_norm=1.0, precision=precision)
    assert (program.layout.found_inf is not None) == (precision == "fp16")
    if precision == "fp16":
        session, fused = _loss_scaled_plan(program)
    else:
        session, fused = _plan(program)
        fused = fo.fuse_norm(fused, session.graph, set(session.output_names))
    step = fused[-1]
    assert step.op_type == fo.OP_TYPE and step.entry.cuda.n_params == len(program.params)
    assert _norm_step(fused) is not None and not any(s.op_type == "ReduceSumSquare" for s in fused)
    assert not any(s.metadata and PARAM_KEY in s.metadata for s in fused)


def test_every_op_of_a_loss_scaled_step_has_a_cuda_kernel():
    """A CPU fallback would keep the step from replaying as one CUDA graph (IsInf has no CUDA kernel:
    the overflow test is IsNaN(x - x))."""
    from gradgen.kernels import registry

    registry.load_cuda_kernels()  # importing the launchers needs no GPU
    program = build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0, precision="fp16", accumulation=2)
    assert program.accumulate is not None
    for graph in (program.train.graph, program.accumulate.graph):
        scaler = [n for n in graph if n.name.startswith(("gradgen_loss_scaling", "gradgen_accumulate"))]
        assert scaler and not any(n.op_type == "IsInf" for n in scaler)
        assert not {n.op_type for n in scaler if registry.lookup(n.domain, n.op_type).cuda is None}


def test_a_skip_flag_that_is_not_bool_keeps_the_steps():
    program = build_training(TRANSFORMER, optimizer=SGD(momentum=0.9), loss_scaling=LossScaling())
    session = Session(program.train, state=program.state_bindings(), state_guard=[program.loss])
    updates, problems = fo.tagged_updates(session.steps)
    assert not problems
    kind = fo.kind_of(json.loads(session.graph.metadata_props[CONFIG_KEY]))
    assert kind is not None and kind.skip and kind.shared == (SKIP_ROLE, "scalar:lr", "", "", "")
    readers: dict[str, set[int]] = {}
    for i, s in enumerate(session.steps):
        for n in s.inputs:
            readers.setdefault(n, set()).add(i)
    update = next(iter(updates.values()))
    dtypes = plan_dtypes(session.steps, session.graph)
    context = fo._Context(readers, set(session.output_names), set(session.initializers), program.state_bindings(), dtypes)
    assert fo.check_update(update, kind, session.steps, context) is None
    dtypes[update.reads[SKIP_ROLE]] = np.dtype(np.float32)
    assert "not declared bool" in fo.check_update(update, kind, session.steps, context)


def test_an_update_read_outside_or_unbound_keeps_its_steps():
    program = build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0)
    bindings = program.state_bindings()
    first, second = program.params[:2]
    del bindings[f"{first}.exp_avg"]  # not bound: written in place it would be lost
    session = Session(program.train, state=bindings, state_guard=[program.loss])
    steps = fo.fuse_update(session.steps, session.graph, set(session.output_names), session.state_bindings, [program.loss])
    left = {s.metadata[PARAM_KEY] for s in steps if s.metadata and PARAM_KEY in s.metadata}
    assert left == {first}
    assert first not in steps[-1].inputs and second in steps[-1].inputs

    updates, problems = fo.tagged_updates(session.steps)
    assert not problems
    kind = fo.kind_of(json.loads(session.graph.metadata_props[CONFIG_KEY]))
    readers: dict[str, set[int]] = {}
    for i, s in enumerate(session.steps):
        for n in s.inputs:
            readers.setdefault(n, set()).add(i)
    update = updates[second]
    inner = session.steps[update.members[2]].outputs[0]  # an intermediate value of the update
    readers.setdefault(inner, set()).add(-1)  # ... read by a step outside it
    context = fo._Context(readers, set(session.output_names), set(session.initializers), program.state_bindings(), {})
    assert "read outside the update" in fo.check_update(update, kind, session.steps, context)


class _FakeArray:
    def __init__(self, address: int, size: int):
        self.gpudata, self.size, self.dtype = address, size, np.dtype(np.float32)


def test_packed_arguments_follow_the_kernels_layout():
    """optimizer.cu's MultiTensorArgs: 7 pointers (guard[2], skip, scalar[4]), 8 floats, flags, GgChunks
    (2 int64, first_chunk[65], numel[64]), ptr[4][64]."""
    chunks = 8 * 2 + 8 * (fo.MAX_TENSORS + 1) + 8 * fo.MAX_TENSORS
    assert fo.CHUNKS.itemsize == chunks and fo.CHUNK % 4 == 0
    assert fo.ARGS.itemsize == 8 * 7 + 4 * 8 + 8 + chunks + 8 * 4 * fo.MAX_TENSORS
    assert fo.ARGS.fields["chunks"][1] == 8 * 7 + 4 * 8 + 8
    assert [fo.ARGS.fields[f][1] for f in ("guard", "skip", "scalar")] == [0, 16, 24]
    source = (ROOT / "gradgen/kernels/cuda/optimizer.cu").read_text()
    assert f"#define GG_MT_MAX {fo.MAX_TENSORS}\n" in source
    assert "const float* guard[2];" in source and "const bool* skip;" in source
    kind = fo.kind_of(
        json.loads(build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0).train.graph.metadata_props[CONFIG_KEY])
    )
    assert kind is not None
    sizes = [1, fo.CHUNK, fo.CHUNK + 1, 0, *([5] * 70)]
    groups = [[_FakeArray(1000 * t + k, n) for k in range(4)] for t, n in enumerate(sizes)]
    guard = [_FakeArray(7, 1), _FakeArray(9, 1)]
    scalars = [_FakeArray(11 + k, 1) for k in range(4)]
    launches = fo.MultiTensorUpdate(kind, 2, len(groups), [True] * 4).pack(guard, scalars, groups, _FakeArray(5, 1))
    live = [g for g in groups if g[0].size]  # the empty tensor takes no chunk
    assert len(launches) == 2
    blocks = [np.frombuffer(buffer, fo.ARGS)[0] for _, buffer in launches]
    assert [b["chunks"]["n_tensors"] for b in blocks] == [64, len(live) - 64]
    first = blocks[0]
    assert list(first["guard"]) == [7, 9] and first["skip"] == 5 and list(first["scalar"]) == [11, 12, 13, 14]
    assert fo.MultiTensorUpdate(kind, 1, 1, [True] * 4).pack(guard[:1], scalars, groups[:1])[0][1][16:24] == bytes(8)
    np.testing.assert_array_equal(first["consts"][:4], np.float32([1 - 0.9, 0.999, 1 - 0.999, 1e-8]))
    table = first["chunks"]
    assert table["chunk"] == fo.CHUNK
    assert list(table["first_chunk"][:5]) == [0, 1, 2, 4, 5] and list(table["numel"][:3]) == [1, fo.CHUNK, fo.CHUNK + 1]
    assert launches[0][0] == table["first_chunk"][64] and launches[1][0] == len(live) - 64
    assert first["ptr"][2, 1] == 1002 and blocks[1]["ptr"][3, 0] == 1000 * (64 + 1) + 3


def test_norm_packed_arguments_follow_the_kernels_layout():
    """optimizer.cu's SumSquaresArgs: the partials' pointer, GgChunks, ptr[1][64]; empty gradients take no block."""
    assert fo.NORM_ARGS.itemsize == 8 + fo.CHUNKS.itemsize + 8 * fo.MAX_TENSORS
    source = (ROOT / "gradgen/kernels/cuda/optimizer.cu").read_text()
    assert "struct SumSquaresArgs {\n    double* partial;" in source
    sizes = [fo.CHUNK + 1, 0, 3, *([fo.CHUNK] * 70)]
    grads = [_FakeArray(100 * t, n) for t, n in enumerate(sizes)]
    launches = fo.MultiTensorNorm.pack(grads)
    assert [blocks for blocks, _ in launches] == [2 + 1 + 62, 8]
    first, second = (args for _, args in launches)
    assert first["chunks"]["n_tensors"] == 64 and second["chunks"]["n_tensors"] == 8
    assert list(first["chunks"]["first_chunk"][:4]) == [0, 2, 3, 4]
    assert list(first["ptr"][0, :3]) == [0, 200, 300] and second["ptr"][0, 0] == 100 * 65  # the empty one skipped


def _norm_nodes(graph):
    return {role: [n for n in graph if n.metadata_props.get(NORM_KEY) == role] for role in ("square", "sum", "sqrt")}


@pytest.mark.parametrize("optimizer, clip", OPTIMIZERS[:3])
def test_the_norm_nodes_are_tagged(optimizer, clip):
    program = build_training(TRANSFORMER, optimizer=optimizer, clip_norm=clip)
    graph = ir.from_proto(ir.to_proto(program.train)).graph  # the tags survive saving
    nodes = _norm_nodes(graph)
    assert [n.op_type for n in nodes["sqrt"]] == ["Sqrt"] and nodes["sqrt"][0].outputs[0].name == program.layout.grad_norm
    assert [n.op_type for n in nodes["sum"]] == ["Sum"]
    assert sorted(n.inputs[0].name for n in nodes["square"]) == sorted(f"{p}_grad" for p in program.params)
    assert all(n.op_type == "ReduceSumSquare" for n in nodes["square"])
    assert [v.producer() for v in nodes["sum"][0].inputs] == nodes["square"]
    assert sum(NORM_KEY in n.metadata_props for n in graph) == len(program.params) + 2


def _norm_step(steps):
    found = [s for s in steps if (s.domain, s.op_type) == (DOMAIN, fo.NORM_OP_TYPE)]
    assert len(found) <= 1
    return found[0] if found else None


def test_the_plan_replaces_the_norm_by_one_step_in_its_sqrts_place():
    program = build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0)
    session = Session(program.train, state=program.state_bindings(), state_guard=[program.loss])
    steps = session.steps
    fused = fo.fuse_norm(steps, session.graph, set(session.output_names))
    squares = [s for s in steps if s.op_type == "ReduceSumSquare"]
    assert len(squares) == len(program.params) and len(fused) == len(steps) - len(squares) - 1
    step = _norm_step(fused)
    assert step is not None and step.outputs == [program.layout.grad_norm]
    total = next(s for s in steps if s.metadata and s.metadata.get(NORM_KEY) == "sum")
    assert step.inputs == [next(s.inputs[0] for s in squares if s.outputs[0] == name) for name in total.inputs]
    assert not any(s.op_type == "ReduceSumSquare" or (s.metadata or {}).get(NORM_KEY) for s in fused if s is not step)
    at = fused.index(step)
    made_before = {n for s in fused[:at] for n in s.outputs} | set(session.input_names) | set(session.initializers)
    assert all(n in made_before for n in step.inputs)
    assert not any(n in step.outputs for s in fused[:at] for n in s.inputs)  # its readers come after it
    # after the fused update: the update's step reads the norm (its guard and clipping) and stays last
    both = fo.fuse_norm(
        fo.fuse_update(steps, session.graph, set(session.output_names), session.state_bindings, [program.loss]),
        session.graph,
        set(session.output_names),
    )
    assert _norm_step(both) is not None and both[-1].op_type == fo.OP_TYPE


def test_a_one_gradient_norm_has_no_sum_and_is_fused():
    mlp = build_training(ROOT / "samples/mlp/model.onnx", optimizer=SGD())
    program = build_training(ROOT / "samples/mlp/model.onnx", optimizer=SGD(), freeze=mlp.params[1:])
    assert program.params == mlp.params[:1]
    nodes = _norm_nodes(program.train.graph)
    assert (len(nodes["square"]), len(nodes["sum"]), len(nodes["sqrt"])) == (1, 0, 1)
    session = Session(program.train)
    step = _norm_step(fo.fuse_norm(session.steps, session.graph, set(session.output_names)))
    assert step is not None and step.inputs == [f"{program.params[0]}_grad"]


def test_a_norm_whose_parts_are_read_elsewhere_keeps_its_steps():
    program = build_training(TRANSFORMER, optimizer=AdamW(), clip_norm=1.0)
    session = Session(program.train)
    steps, keep = session.steps, set(session.output_names)
    square = next(s for s in steps if s.op_type == "ReduceSumSquare")
    total = next(s for s in steps if s.op_type == "Sum" and (s.metadata or {}).get(NORM_KEY))
    assert fo.fuse_norm(steps, session.graph, keep | {square.outputs[0]}) == steps  # a graph output
    assert fo.fuse_norm(steps, session.graph, keep | {total.outputs[0]}) == steps
    reader = dataclasses.replace(steps[-1], inputs=[*steps[-1].inputs, square.outputs[0]])
    assert fo.fuse_norm([*steps[:-1], reader], session.graph, keep) == [*steps[:-1], reader]
    partial = dataclasses.replace(total, inputs=total.inputs[1:])  # a square not summed
    changed = [partial if s is total else s for s in steps]
    assert fo.fuse_norm(changed, session.graph, keep) == changed
    kept = dataclasses.replace(square, attributes={"keepdims": 1})
    changed = [kept if s is square else s for s in steps]
    assert fo.fuse_norm(changed, session.graph, keep) == changed


def test_the_norm_is_planned_only_where_switched_on(monkeypatch):
    monkeypatch.setenv(fo.ENV, "0")
    assert not fo.norm_enabled()
    monkeypatch.setenv(fo.ENV, "1")
    assert fo.norm_enabled()
    monkeypatch.setenv(fo.NORM_ENV, "0")
    assert not fo.norm_enabled() and fo.enabled()


def _guarded_accumulator():
    """total.next = total + x; out = ReduceSum(total.next)."""
    nodes = [
        helper.make_node("Add", ["total", "x"], ["total.next"]),
        helper.make_node("ReduceSum", ["total.next"], ["sum"], keepdims=0),
    ]
    shape = [2]
    graph = helper.make_graph(
        nodes,
        "acc",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, shape),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, shape),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("total.next", TensorProto.FLOAT, shape),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_the_state_guard_keeps_the_state_of_a_non_finite_run():
    with Session(_guarded_accumulator(), state={"total": "total.next"}, state_guard=["sum"]) as session:
        session.write_state({"total": np.float32([1, 2])})
        session.run({"x": np.float32([1, 1])})
        out = session.run({"x": np.float32([np.inf, 1])})
        assert out["sum"] == np.inf
        np.testing.assert_array_equal(session.read_state()["total"], [2, 3])
        assert not session.updates_in_place  # only the GPU plan updates in place
    with pytest.raises(UsageError, match="not graph outputs"):
        Session(_guarded_accumulator(), state={"total": "total.next"}, state_guard=["nope"])
    with pytest.raises(UsageError, match="no state to guard"):
        Session(_guarded_accumulator(), state_guard=["sum"])
