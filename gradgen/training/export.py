"""Export: the forward model with trained parameters in place of its initializers, for inference.

The model given is the forward model that was trained (the one ``gradgen train`` read); the
checkpoint's fingerprint must match it. A weight trained tied to its transposed copy
(``--tie-weights``) is written to both initializers. The loss the training used is removed when it is one of
the model's outputs (with the nodes and inputs, such as labels, only it needed), unless
``keep_loss``; a loss added for training was never part of the model. No backward or optimizer
node is in the result: it is the original graph (shape computations on static shapes folded),
so any ONNX runtime runs it.
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError, UsageError
from gradgen.model_io import ModelLike, load_model
from gradgen.passes import EvaluateConstantsPass, Pipeline, RemoveUnusedNodesPass
from gradgen.training.checkpoint import checkpoint_path, load_checkpoint
from gradgen.training.graph_edit import remove_unused_inputs
from gradgen.training.program import model_fingerprint


def export_trained(model: ModelLike, checkpoint: str | os.PathLike, *, keep_loss: bool = False) -> ir.Model:
    """The forward ``model`` with the checkpoint's parameters, its training loss removed."""
    forward = ir.from_proto(ir.to_proto(model)) if isinstance(model, ir.Model) else load_model(model)
    state, meta = load_checkpoint(checkpoint)
    where = checkpoint_path(checkpoint)
    fingerprint = model_fingerprint(forward)
    if meta["fingerprint"] != fingerprint:
        raise UsageError(
            f"{where}: the checkpoint is from another model (fingerprint {meta['fingerprint']}, this model's is {fingerprint})"
        )
    set_initializers(forward.graph, state.params, where)
    set_initializers(forward.graph, {copy: state.params[param].T for param, copy in meta.get("tied", [])}, where)
    if not keep_loss and not meta["added_loss"]:
        remove_output(forward, meta["loss"])
    return forward


def set_initializers(graph: ir.Graph, params, where) -> None:
    for name, value in params.items():
        initializer = graph.initializers.get(name)
        if initializer is None:
            raise UsageError(f"{where}: parameter {name!r} is no initializer of the model")
        old = initializer.const_value
        if old is not None and (tuple(old.shape) != value.shape or old.dtype.numpy() != value.dtype):
            raise UsageError(
                f"{where}: parameter {name!r} is {value.dtype}{list(value.shape)}, the model's "
                f"initializer is {old.dtype.numpy()}{list(old.shape)}"
            )
        initializer.const_value = ir.Tensor(np.ascontiguousarray(value), name=name)


def remove_output(model: ir.Model, name: str) -> None:
    """Drop output ``name`` and what only it needed (nodes, initializers, graph inputs).

    Shapes of static tensors are folded first: an exporter may compute another output's shape
    from the target's (PyTorch's mse_loss broadcasts the prediction to it), which would keep the
    target as an input of the inference model for its shape alone.
    """
    graph = model.graph
    outputs = [v for v in graph.outputs if v.name != name]
    if len(outputs) == len(graph.outputs):
        return
    if not outputs:
        raise ModelError(
            f"the model's only output is its loss {name!r}: nothing would be left to export (keep it with --keep-loss)"
        )
    graph.outputs.clear()
    graph.outputs.extend(outputs)
    Pipeline(EvaluateConstantsPass(), RemoveUnusedNodesPass())(model)
    remove_unused_inputs(graph)
