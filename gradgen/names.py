"""Names of onnx-ir values: onnx-ir types them ``str | None`` (a value built in code may have none yet),
and fresh names that no other value or node of a graph holds.

Values read from a model or emitted by a GraphBuilder always have one; these helpers give the type
checker a ``str`` and turn a missing name into a model error instead of a later ``None`` crash.
"""

from __future__ import annotations

from typing import Iterable

import onnx_ir as ir

from gradgen.errors import ModelError


def node_names(nodes: Iterable[ir.Node]) -> dict[ir.Node, str]:
    """Each node's name; an unnamed node's is ``<op_type>_<position>`` (``_`` appended while another
    node holds it), the name build-backward's NameNodesPass gives it, so that every message names
    a node as the built model does. ``nodes``: a graph, in its order."""
    nodes = list(nodes)
    taken = {node.name for node in nodes if node.name}
    names: dict[ir.Node, str] = {}
    for index, node in enumerate(nodes):
        name = node.name
        if not name:
            name = f"{node.op_type}_{index}"
            while name in taken:
                name += "_"
            taken.add(name)
        names[node] = name
    return names


def node_name(node: ir.Node) -> str:
    """``node``'s name, or the one ``node_names`` gives it in its graph (a scan of the graph: for
    messages, not loops)."""
    if node.name:
        return node.name
    graph = node.graph
    if graph is None:  # a node not in a graph yet has no position
        return f"{node.op_type}_?"
    return node_names(graph)[node]


def value_name(value: ir.Value) -> str:
    """``value``'s name; a ModelError naming its producer when it has none."""
    if value.name is None:
        producer = value.producer()
        made_by = (
            f"output {value.index()} of {producer.op_type} node {node_name(producer)!r}"
            if producer is not None
            else "a value with no producer"
        )
        raise ModelError(f"{made_by} has no name: every graph input, output and intermediate value needs one")
    return value.name


def value_names(values: Iterable[ir.Value]) -> list[str]:
    """The names of ``values``, in order (see value_name)."""
    return [value_name(v) for v in values]


def unique_name(name: str, taken: set[str], *, sep: str = "_", first: int = 1) -> str:
    """``name``, or ``name_1``, ``name_2``, ... : the first not in ``taken``, which it joins
    (``sep`` and ``first`` spell the numbered ones: ``name2``, ``name3``, ... with "" and 2)."""
    candidate, n = name, first - 1
    while candidate in taken:
        n += 1
        candidate = f"{name}{sep}{n}"
    taken.add(candidate)
    return candidate


def gradient_name(name: str, taken: set[str]) -> str:
    """The name of the gradient of tensor ``name``: ``<name>_grad``, or where the model already holds
    that (a backward graph differentiated again) ``<name>_grad2``, ``<name>_grad3``, ...: the first
    not in ``taken``, which it joins."""
    return unique_name(f"{name}_grad", taken, sep="", first=2)


def quoted(names: Iterable[str]) -> str:
    """``'a', 'b'``: names as messages list them."""
    return ", ".join(map(repr, names))


def name_mismatch(wanted: Iterable[str], given: Iterable[str], missing: str, unknown: str) -> str:
    """What keeps ``given`` from naming exactly ``wanted`` ("" when nothing does): ``missing`` and
    ``unknown`` phrase the wanted names not given and the given names not wanted (sorted), with
    ``{}`` where the quoted names go; "; " joins the two."""
    wanted, given = list(wanted), set(given)
    lacking = [name for name in wanted if name not in given]
    extra = sorted(given - set(wanted))
    return "; ".join(phrase.format(quoted(names)) for phrase, names in ((missing, lacking), (unknown, extra)) if names)
