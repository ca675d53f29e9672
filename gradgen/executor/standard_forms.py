"""A GPU Session runs the ops of ``registry.CUDA_STANDARD_FORMS`` as their standard-op forms.

Those ops (GridSample, RoiAlign, STFT, DeformConv, LSTM / GRU / RNN, Loop and Scan of a static
length, ONNX Runtime's forward ops such as SkipLayerNormalization or MultiHeadAttention) have no
CUDA launcher of their own, but build-backward already rewrites them into standard ops, whose
launchers exist, before the gradient pass. A forward model run as it is still holds them; here a
copy of it is rewritten by the same passes before the Session plans, so their steps run on the GPU
instead of on host copies. The forms are what the backward graphs compute, and tests compare
each with the op's own CPU kernel. Where a form does not apply (a length known only at run time,
an adaptive RoiAlign), the op stays and falls back to its numpy kernel, as before.
"""

from __future__ import annotations

import onnx_ir as ir

from gradgen.errors import GradgenError
from gradgen.kernels import registry
from gradgen.model_io import copy_model


def holds_standard_form_ops(model: ir.Model) -> bool:
    """Whether the main graph holds an op a GPU Session rewrites into its standard-op form."""
    return any((registry.normalize_domain(n.domain), n.op_type) in registry.CUDA_STANDARD_FORMS for n in model.graph)


def with_standard_forms(model: ir.Model) -> ir.Model:
    """``model``, or a copy of it with the ops of ``registry.CUDA_STANDARD_FORMS`` rewritten into
    their standard-op forms where those apply. ``model`` itself is never changed; where the passes
    refuse the model (a rank they need is unknown), it is returned as it is and its ops fall back."""
    if not holds_standard_form_ops(model):
        return model
    from gradgen.passes import DecomposePass, EvaluateConstantsPass, Pipeline, UnrollLoopsPass, UnrollRecurrentPass

    rewritten = copy_model(model)
    passes = Pipeline(
        EvaluateConstantsPass(),  # shapes, and the trip counts the model fixes
        UnrollLoopsPass(),
        UnrollRecurrentPass(static_length_only=True),  # a run-time length would become a Loop on the host
        DecomposePass(),
    )
    try:
        passes(rewritten)
    except (GradgenError, ir.passes.PassError):
        return model
    return rewritten
