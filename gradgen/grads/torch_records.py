"""What PyTorch's dynamo exporter records with each node, where the graph itself loses it.

``torch.onnx.export(..., dynamo=True)`` keeps the FX call a node came from in its metadata
(``pkg.torch.onnx.fx_node``), e.g. ``%embedding : [num_users=1] = call_function[target=
torch.ops.aten.embedding.default](args = (%p_w, %ids, 0), kwargs = {})``. Two things PyTorch's
autograd does that an ONNX graph cannot say survive there:

- ``aten.embedding``'s ``padding_idx`` and ``scale_grad_by_freq`` (a plain Gather in the graph):
  the Gather's gradient rule applies them (gradgen/grads/rules/indexing.py), except where
  ``merged_lookup`` finds that the exporter's optimizer merged another lookup into the node;
- ``aten.detach`` (an Identity in the graph): no gradient flows through it; the gradient pass
  treats such an Identity as a constant (gradgen/passes/gradient.py). The exporter's optimizer
  removes Identities, detaches included; the readers' records still name the detached value, and
  ``removed_detaches`` finds them, for a note.

And one thing the exporter gets wrong that its record shows: a BatchNorm of a module in train mode
(``aten._native_batch_norm_legit_functional(..., training=True, ...)``) written as an inference
BatchNormalization (torch 2.13's dynamo exporter): ``trained_as_inference`` finds them, for a note.

The legacy exporter records nothing: its graphs carry none of this.
"""

from __future__ import annotations

import re

import onnx_ir as ir

FX_CALL_KEY = "pkg.torch.onnx.fx_node"

# an embedding lookup's call: weight, indices, then the optional padding_idx (normalised to a row,
# -1 for none), scale_grad_by_freq and sparse
_EMBEDDING_CALL = re.compile(r"target=torch\.ops\.aten\.embedding\.default\]\(args = \(([^)]*)\)")
_DETACH_CALL = re.compile(r"target=torch\.ops\.aten\.detach\.default\]")
# a batch norm call's sixth argument is ``training``
_TRAINING_BATCH_NORM_CALL = re.compile(
    r"target=torch\.ops\.aten\.(?:_native_batch_norm_legit_functional|_native_batch_norm_legit|native_batch_norm)"
    r"\.default\]\(args = \((?:[^,()]+, ){5}True\b"
)
_OWN_NAME = re.compile(r"%(\S+) :")
_NAMED_VALUE = re.compile(r"%(\w+)")
# FX names a detach's result detach, detach_1, ...
_DETACHED_ARGUMENT = re.compile(r"%(detach(?:_\d+)?)\b")


def fx_call(node: ir.Node) -> str:
    """The node's recorded FX call ("" where there is none)."""
    return node.metadata_props.get(FX_CALL_KEY, "")


def fx_name(node: ir.Node) -> str | None:
    """The FX name of the node's recorded call (``embedding_1``), or None."""
    match = _OWN_NAME.match(fx_call(node))
    return match.group(1) if match else None


def fx_arguments(call: str) -> str:
    """What a recorded call reads: what follows ``](args = ``, its positional arguments and its
    keyword arguments."""
    return call.partition("](args = ")[2]


def embedding_options(node: ir.Node) -> tuple[int | None, bool]:
    """(padding_idx or None, scale_grad_by_freq) of a Gather recorded as ``aten.embedding``;
    (None, False) for any other node."""
    return embedding_options_of_call(fx_call(node))


def embedding_options_of_call(call: str) -> tuple[int | None, bool]:
    """``embedding_options`` from the text of a record."""
    match = _EMBEDDING_CALL.search(call)
    if match is None:
        return None, False
    args = [a.strip() for a in match.group(1).split(",")]
    padding = int(args[2]) if len(args) > 2 and re.fullmatch(r"-?\d+", args[2]) else -1
    return (padding if padding >= 0 else None), len(args) > 3 and args[3] == "True"


def changes_the_gradient(op_type: str, call: str) -> bool:
    """Whether a node of ``op_type`` with this record gets a gradient other than its graph's: a
    Gather recorded with embedding options, an Identity recorded as a detach."""
    if op_type == "Gather":
        return embedding_options_of_call(call) != (None, False)
    return op_type == "Identity" and _DETACH_CALL.search(call) is not None


def is_detach(node: ir.Node) -> bool:
    """An Identity recorded as PyTorch's ``detach``: its output carries no gradient."""
    return node.op_type == "Identity" and node.domain in ("", "ai.onnx") and _DETACH_CALL.search(fx_call(node)) is not None


def read_fx_names(node: ir.Node) -> set[str]:
    """The FX values ``node``'s record reads (``%name`` in its call's arguments)."""
    return set(_NAMED_VALUE.findall(fx_arguments(fx_call(node))))


def defined_fx_names(nodes) -> set[str]:
    """The FX values that nodes of ``nodes`` still compute (their records' own names)."""
    return {name for name in map(fx_name, nodes) if name}


def removed_detaches(nodes: list[ir.Node]) -> list[tuple[ir.Node, str]]:
    """(reader, detached FX value) for each node whose record reads a ``detach`` result that no
    node of ``nodes`` computes any more: the exporter's optimizer removed that detach, so the graph
    lets a gradient through where PyTorch's did not."""
    defined = defined_fx_names(nodes)
    found = []
    for node in nodes:
        for name in _DETACHED_ARGUMENT.findall(fx_arguments(fx_call(node))):
            if name not in defined:
                found.append((node, name))
    return found


def trained_as_inference(node: ir.Node) -> bool:
    """A BatchNormalization in inference mode whose record is PyTorch's train-mode batch norm: the
    graph normalises with the running statistics where PyTorch's module used the batch's."""
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    attribute = node.attributes.get("training_mode")
    return (attribute is None or attribute.value == 0) and _TRAINING_BATCH_NORM_CALL.search(fx_call(node)) is not None


def _op_of(fx_value: str) -> str:
    """The op an FX value is named after: ``embedding`` for ``embedding_3``."""
    return re.sub(r"_\d+$", "", fx_value)


def merged_lookup(node: ir.Node, skip: set[ir.Node]) -> bool:
    """Whether the exporter's optimizer may have merged another lookup into ``node``: two Gathers
    of the same table and indices become one node with one call's record, and so may the nodes
    that read them (two ReduceSums of them, ...). A merged twin leaves a trace: a node downstream,
    on a float path, whose record names a value of the same op as the node it reads (``%sum_2``
    where it reads the node recorded as ``sum_1``) that no node computes any more and that is no
    initializer. (Values the optimizer removed as no-ops, ``%alias``, ``%type_as_3``, are of other
    ops.) ``skip``: nodes not to follow (the gradient nodes built so far, which read forward
    values but are not what the exporter wrote)."""
    own = fx_name(node)
    if own is None or not node.outputs or node.graph is None:
        return True
    # computed by a node, or folded by the optimizer into an initializer of that name (BERT's
    # position embeddings): not merged away
    defined = defined_fx_names(node.graph) | set(node.graph.initializers)
    stack, seen = [node], {node}
    while stack:
        current = stack.pop()
        own = fx_name(current)
        for out in current.outputs:
            if out.dtype is not None and not out.dtype.is_floating_point():
                continue  # indices and shapes carry no gradient
            for usage in out.uses():
                reader = usage.node
                if reader in skip or reader in seen:
                    continue
                seen.add(reader)
                stack.append(reader)
                if own is None or fx_name(reader) == own:
                    continue  # no record, or another node of the same call's decomposition
                for name in read_fx_names(reader):
                    if name != own and name not in defined and _op_of(name) == _op_of(own):
                        return True
    return False
