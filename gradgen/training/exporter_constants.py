"""Float initializers of a PyTorch export that are not parameters of the module, so not trained.

A model exported through torch.export (``torch.onnx.export(..., dynamo=True)``) says what each
initializer was in the PyTorch program: ``pkg.torch.export.graph_signature.InputSpec.kind`` in its
metadata (PARAMETER, BUFFER, CONSTANT_TENSOR; USER_INPUT on the graph inputs). The exporter's
optimizer (on by default) then folds constant subgraphs into new initializers, each with
``pkg.onnxscript.optimizer.folded_from``: the names of the values folded into it. Training takes a
parameter to be what PyTorch would train, so from such a model it leaves out

- buffers and constant tensors (a rotary embedding's inverse frequencies);
- folds of constants alone or of several computed values: attention masks, rotary cos / sin tables,
  scales, but also parameters combined with other values (position embeddings gathered at fixed
  positions);
- folds of one parameter that copy it along an axis (a class token expanded to the batch: equal
  slices along an axis of a tensor whose values are not all equal). Training those would train
  another model than PyTorch's (one class token per sample of the batch); an export with
  ``optimize=False`` keeps the parameters themselves;
- single-value initializers: the exporter's scalar constants (a softmax scale).

It keeps the parameters, folds of one parameter with constant operands that do not copy it (a
weight transposed for its MatMul, a GroupNorm's scale reshaped to (C, 1, 1): training the fold
trains the parameter) and several-value initializers with no metadata (a convolution with a
BatchNormalization folded into it). In ``folded_from`` the exporter names its own constants
``val_<n>`` and the values its ops computed after the op (``full``, ``triu``, ``mul_1``: no dot);
a module's parameters have dotted names (``layers.0.norm.weight``). So a fold is a parameter's
when every name but one is a ``val_<n>`` and that one is dotted; a parameter of the top-level
module (no dot) folded so is left out, and ``--train`` takes it in. A model from another
exporter carries none of this metadata, and nothing is left out of it here.
"""

from __future__ import annotations

import ast
import re

import numpy as np
import onnx_ir as ir

KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED_FROM_KEY = "pkg.onnxscript.optimizer.folded_from"
PARAMETER = "PARAMETER"

# why an initializer is not trained, as the note groups them
BUFFER = "buffers or constants of the PyTorch module"
FOLDED = "folded by the exporter's optimizer from constants, several values or copies of a parameter"
SCALAR = "the exporter's single-value constants"


def exported_by_torch_export(graph: ir.Graph) -> bool:
    """Whether ``graph`` carries torch.export's input kinds (on a graph input or an initializer)."""
    return any(KIND_KEY in value.metadata_props for value in (*graph.inputs, *graph.initializers.values()))


def marked_parameter(value: ir.Value) -> bool:
    """Whether the exporter said ``value`` is a parameter of the module."""
    return value.metadata_props.get(KIND_KEY) == PARAMETER


def exporter_constants(graph: ir.Graph) -> dict[str, str]:
    """The float initializers of a torch.export model that are not parameters -> why (``BUFFER``,
    ``FOLDED`` or ``SCALAR``), in graph order; empty for a model from any other exporter."""
    if not exported_by_torch_export(graph):
        return {}
    found: dict[str, str] = {}
    for name, value in graph.initializers.items():
        if value.dtype is None or not value.dtype.is_floating_point():
            continue
        reason = _reason(value)
        if reason is not None:
            found[name] = reason
    return found


def unmarked_initializers(graph: ir.Graph) -> list[str]:
    """Float initializers of several values of a torch.export model that carry no metadata at all:
    tensors the exporter's optimizer rewrote (a convolution with a BatchNormalization folded into
    it), trained as parameters though PyTorch trains others; empty for other exporters' models."""
    if not exported_by_torch_export(graph):
        return []
    return [
        name
        for name, value in graph.initializers.items()
        if value.dtype is not None
        and value.dtype.is_floating_point()
        and KIND_KEY not in value.metadata_props
        and FOLDED_FROM_KEY not in value.metadata_props
        and _reason(value) is None
    ]


def _some(names: list[str]) -> str:
    """The first five names, quoted, and how many more."""
    return ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def describe_unmarked(names: list[str]) -> str:
    return (
        f"{len(names)} trained initializer(s) of this torch.export model are no parameter of the module ({_some(names)}): "
        "the exporter's optimizer made them (a BatchNormalization folded into its convolution, say), so training "
        "changes another parametrization than PyTorch's; export with torch.onnx.export(..., dynamo=True, "
        "optimize=False) to train the module's own parameters"
    )


def _reason(value: ir.Value) -> str | None:
    kind = value.metadata_props.get(KIND_KEY)
    if kind is not None:
        return None if kind == PARAMETER else BUFFER
    tensor = value.const_value
    folded = value.metadata_props.get(FOLDED_FROM_KEY)
    if folded is not None:
        computed = [name for name in _sources(folded) if not _EXPORTER_CONSTANT.fullmatch(name)]
        one_parameter = len(computed) == 1 and "." in computed[0]
        if not one_parameter or tensor is None or tensor.size == 1 or _copies_along_an_axis(tensor.numpy()):
            return FOLDED
        return None
    return SCALAR if tensor is not None and tensor.size == 1 else None


_EXPORTER_CONSTANT = re.compile(r"val_\d+")


def _copies_along_an_axis(array: np.ndarray) -> bool:
    """Whether ``array`` repeats one slice along an axis of size > 1 without being constant: what an
    Expand or Tile of a parameter makes (a constant tensor, a ones-initialised scale say, is
    taken for a reshape)."""
    if array.size == 0:
        return False
    for axis, size in enumerate(array.shape):
        if size > 1:
            first = np.take(array, [0], axis=axis)
            # the first two slices decide cheaply; only where they agree is the whole tensor read
            if bool((np.take(array, [1], axis=axis) == first).all()) and bool((array == first).all()):
                flat = array.reshape(-1)
                return not bool((flat == flat[0]).all())
    return False


def _sources(folded_from: str) -> list[str]:
    """The names in a ``folded_from`` entry (a Python list literal); unreadable: treated as several."""
    try:
        names = ast.literal_eval(folded_from)
    except (ValueError, SyntaxError):
        return ["?", "?"]
    return list(names) if isinstance(names, (list, tuple)) else ["?", "?"]


def describe(constants: dict[str, str]) -> str:
    """One line naming what ``exporter_constants`` left out, grouped by reason (five names each)."""
    parts = []
    for reason in (BUFFER, FOLDED, SCALAR):
        names = [name for name, why in constants.items() if why == reason]
        if names:
            parts.append(f"{len(names)} {reason} ({_some(names)})")
    text = f"training leaves out float initializers that are not parameters of the exported module: {'; '.join(parts)}"
    if any(why == FOLDED for why in constants.values()):
        text += (
            "; in a model optimised for inference these may hold parameters folded with constants: export with "
            "torch.onnx.export(..., dynamo=True, optimize=False) to train every parameter as PyTorch does"
        )
    return text
