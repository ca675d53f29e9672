"""The standard-op forms a GPU Session runs instead of the ops of registry.CUDA_STANDARD_FORMS
(gradgen/executor/standard_forms.py), checked on the CPU: the rewritten copy holds none of those
ops where the form applies, computes what the ops' own kernels compute, and the caller's model is
left as it was. tests/cuda/test_cuda_fallbacks.py runs them on a GPU Session."""

from __future__ import annotations

import numpy as np
import pytest

from gradgen.executor import Session
from gradgen.executor.standard_forms import holds_standard_form_ops, with_standard_forms
from gradgen.kernels import registry
from gradgen.model_io import load_model
from gradgen.ops.control_flow import CONTROL_FLOW_OPS
from tests.control_flow_models import loop_model
from tests.cuda.test_cuda_fallbacks import MODELS

FORM_OPS = sorted(op for _, op in registry.CUDA_STANDARD_FORMS)


def _form_ops_in(model) -> list[str]:
    return [n.op_type for n in model.graph if (registry.normalize_domain(n.domain), n.op_type) in registry.CUDA_STANDARD_FORMS]


@pytest.mark.parametrize("op_type", FORM_OPS)
def test_the_form_replaces_the_op_and_computes_what_its_kernel_computes(op_type):
    proto, feeds = MODELS[op_type]()
    model = load_model(proto)
    assert holds_standard_form_ops(model)
    rewritten = with_standard_forms(model)
    assert rewritten is not model
    assert _form_ops_in(rewritten) == [], f"{op_type} is still in its form"
    assert _form_ops_in(model), "the caller's model was changed"
    want = Session(model).run(feeds)
    got = Session(rewritten).run(feeds)
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


def test_a_model_without_those_ops_is_not_copied():
    proto, _ = MODELS["Einsum"]()
    model = load_model(proto)
    assert not holds_standard_form_ops(model)
    assert with_standard_forms(model) is model


def test_a_loop_of_a_run_time_length_stays_a_loop():
    model = load_model(loop_model(trip_count=None))
    rewritten = with_standard_forms(model)
    assert [n.op_type for n in rewritten.graph].count("Loop") == 1


def test_a_recurrent_op_of_a_run_time_length_stays_as_it_is():
    proto, feeds = MODELS["GRU"]()
    x = proto.graph.input[0]
    x.type.tensor_type.shape.dim[0].dim_param = "steps"  # the time axis of layout 0, now symbolic
    model = load_model(proto)
    rewritten = with_standard_forms(model)
    assert "GRU" in _form_ops_in(rewritten) and "Loop" not in [n.op_type for n in rewritten.graph]
    y = proto.graph.output[0].name
    np.testing.assert_allclose(Session(rewritten).run(feeds)[y], Session(model).run(feeds)[y])


def test_an_adaptive_roi_align_stays_as_it_is():
    proto, _ = MODELS["RoiAlign"]()
    node = next(n for n in proto.graph.node if n.op_type == "RoiAlign")
    for attribute in node.attribute:
        if attribute.name == "sampling_ratio":
            attribute.i = 0
    rewritten = with_standard_forms(load_model(proto))
    assert _form_ops_in(rewritten) == ["RoiAlign"]


def test_every_form_op_has_a_model_and_only_control_flow_has_a_launcher_too():
    """A form replaces a missing launcher; Loop and Scan have launchers (a run-time length runs its
    body step by step) and are still unrolled where the length is static: copies of the body can be
    fused and recorded in a CUDA graph, a step-by-step body cannot."""
    kernels = registry.all_kernels()
    assert set(FORM_OPS) <= set(MODELS)
    with_launcher = {op for (d, op) in registry.CUDA_STANDARD_FORMS if kernels.get((d, op)) is not None and kernels[(d, op)].cuda}
    assert with_launcher <= set(CONTROL_FLOW_OPS)
    assert not set(registry.CUDA_STANDARD_FORMS) & set(registry.CUDA_FALLBACKS)


def test_protos_are_not_changed():
    proto, _ = MODELS["LSTM"]()
    before = proto.SerializeToString()
    with_standard_forms(load_model(proto))
    assert proto.SerializeToString() == before
