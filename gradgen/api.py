"""gradgen's Python API: build a backward graph, run a model."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import TYPE_CHECKING, Iterator, Sequence

import onnx_ir as ir

from gradgen.errors import GradgenError, ModelError
from gradgen.executor import Session
from gradgen.model_io import ModelLike, copy_model, inline_functions, invalid_onnx, load_model
from gradgen.passes import (
    AutocastPass,
    CleanupPass,
    DecomposePass,
    EvaluateConstantsPass,
    GeluFusionPass,
    GradientPass,
    GradientSpec,
    LowerToStandardPass,
    NameNodesPass,
    Pipeline,
    SequencesAsTensorsPass,
    ShapeInferencePass,
    TieEqualWeightsPass,
    TopologicalSortPass,
    TransposeFusionPass,
    UnrollLoopsPass,
    UnrollRecurrentPass,
    UpgradeOpsetPass,
)
from gradgen.passes.autocast import check_precision

if TYPE_CHECKING:
    from gradgen.training.losses import LossSpec


@dataclasses.dataclass
class BackwardModel:
    """A forward + backward model, with the loss, the tensors it differentiates and the names of
    their gradient outputs (``<x>_grad``; ``<x>_grad2``, ... where the model held that name)."""

    model: ir.Model
    loss: str
    wrt: list[str]
    gradient_names: list[str]


def backward_pipeline(spec: GradientSpec, precision: str = "fp32", tie_weights: bool = False) -> tuple[Pipeline, GradientPass]:
    """The default pipeline: prepare the forward graph (sequences and optionals the model fixes
    rewritten as the tensors they hold by ``SequencesAsTensorsPass``, Loop / Scan of a static length unrolled by
    ``UnrollLoopsPass``, LSTM / GRU / RNN unrolled into standard ops by ``UnrollRecurrentPass``,
    GridSample rewritten into them by ``DecomposePass``, exported GELU formulas fused into one node
    by ``GeluFusionPass``), add the backward
    graph, fold matrix transposes into GEMM flags (``TransposeFusionPass``), clean up.

    With a ``precision`` other than fp32, ``AutocastPass`` rewrites the prepared forward graph before
    the gradient pass, which then differentiates through its casts. A weight the exporter wrote
    twice (an initializer and its transpose: a tied LM head) is tied again with ``tie_weights``, and
    warned about without it (``TieEqualWeightsPass``)."""
    gradient = GradientPass(spec)
    prepare = [
        UpgradeOpsetPass(),
        NameNodesPass(),
        TopologicalSortPass(),
        EvaluateConstantsPass(),
        TieEqualWeightsPass(tie=tie_weights),
        SequencesAsTensorsPass(),
        UnrollLoopsPass(),
        UnrollRecurrentPass(),
        DecomposePass(),
        GeluFusionPass(),
    ]
    if precision != "fp32":
        prepare.append(AutocastPass(precision))
    pipeline = Pipeline(*prepare, gradient, TransposeFusionPass(), CleanupPass())
    return pipeline, gradient


def run_pipeline(pipeline: ir.passes.PassBase, model: ir.Model) -> ir.passes.PassResult:
    """Run passes; a gradgen error raised inside a pass surfaces as itself, not as a PassError."""
    try:
        return pipeline(model)
    except ir.passes.PassError as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, GradgenError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cycle collector off while a graph is built (and back as it was after).

    A build allocates a few objects per value and node and frees few of them; every so many
    allocations the collector walked all of them again, a third of the build time of a 5,000-node
    graph. The garbage the passes leave (removed nodes) is collected once it is back on: its first
    young collection walks every object the build made (40-80 ms for 5,000 nodes). Moving them to
    the oldest generation instead (``gc.freeze()`` then ``gc.unfreeze()``) saves that walk, but
    leaves the removed nodes to full collections, which a loop of builds hardly triggers: resident
    memory grew by 17 MB a build of the 48-layer GPT-2 layout."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_backward(
    model: ModelLike,
    *,
    loss: str | None = None,
    wrt: Sequence[str] | None = None,
    freeze: Sequence[str] = (),
    wrt_inputs: bool = False,
    portable: bool = False,
    add_loss: LossSpec | None = None,
    precision: str = "fp32",
    tie_weights: bool = False,
) -> BackwardModel:
    """Return ``model`` with its backward graph appended (the input model is not modified).

    ``portable=True`` lowers the com.microsoft gradient ops to standard ONNX ops
    (``passes.LowerToStandardPass``), so that any ONNX runtime can run the result.
    ``add_loss`` (a ``gradgen.training.LossSpec``) first appends a loss to a model that ends in
    logits or predictions, and differentiates that loss.
    ``precision`` (fp32, tf32, bf16, fp16) runs ``passes.AutocastPass`` on the forward graph first:
    bf16 / fp16 as torch.autocast computes, float32 parameters and gradients; tf32 is recorded in
    the model's metadata for the GPU backend.
    ``tie_weights`` ties an initializer and its transposed copy into one parameter (an exported tied
    LM head: PyTorch's gradient of the weight is the sum of both uses'); without it they are two
    parameters, and a warning names them.
    """
    check_precision(precision)
    with _collector_paused():
        return _build_backward(model, loss, wrt, freeze, wrt_inputs, portable, add_loss, precision, tie_weights)


def _build_backward(
    model: ModelLike,
    loss: str | None,
    wrt: Sequence[str] | None,
    freeze: Sequence[str],
    wrt_inputs: bool,
    portable: bool,
    add_loss: LossSpec | None,
    precision: str,
    tie_weights: bool = False,
) -> BackwardModel:
    # Passes work in place: copy a caller's ir.Model (its graph, not its weights, which the passes
    # never change); a model loaded here is already our own.
    forward = copy_model(model) if isinstance(model, ir.Model) else load_model(model)
    inline_functions(forward)
    if add_loss is not None:
        loss = _add_loss(forward, add_loss, loss)
    spec = GradientSpec(loss=loss, wrt=list(wrt) if wrt else None, freeze=list(freeze), wrt_inputs=wrt_inputs)
    pipeline, gradient = backward_pipeline(spec, precision, tie_weights)
    try:
        result = run_pipeline(pipeline, forward)
    except GradgenError:
        raise
    except Exception as exc:  # a gradgen bug, unless the model is not valid ONNX in the first place
        refusal = invalid_onnx(model)
        if refusal is None:
            raise
        raise ModelError(f"the model is not valid ONNX: {refusal} (gradgen failed on it: {_innermost(exc)})") from None
    if portable:
        result = run_pipeline(Pipeline(LowerToStandardPass(), CleanupPass(), ShapeInferencePass()), result.model)
    assert gradient.loss_name is not None  # the gradient pass sets it when it runs
    return BackwardModel(result.model, gradient.loss_name, gradient.wrt_names, gradient.gradient_names)


def _innermost(exc: BaseException) -> str:
    """The first cause of ``exc`` (a PassError wraps what a pass raised), as ``Type: message``."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _add_loss(forward: ir.Model, spec, loss: str | None) -> str:
    from gradgen.errors import UsageError
    from gradgen.training.losses import AddLossPass

    if loss is not None:
        raise UsageError("--loss names the model's own loss; --add-loss adds one: use one of them")
    adder = AddLossPass(spec)
    run_pipeline(Pipeline(UpgradeOpsetPass(), adder), forward)
    assert adder.loss_name is not None  # the pass sets it when it runs
    return adder.loss_name


__all__ = ["BackwardModel", "Session", "backward_pipeline", "build_backward", "run_pipeline"]
