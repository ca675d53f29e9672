"""If, Loop and Scan: each body runs as a Session of its own, on the device of the step.

The executor gives a node with subgraphs the outer-scope values they read as trailing arguments,
named by ``_captured`` (gradgen/executor/session.py). A subgraph becomes a standalone model whose
inputs are its own inputs plus those outer values (one copy per subgraph and device, planned once
and cached for the subgraph's lifetime), so nested control flow and every kernel run as they do at
top level.

The kernels are written once, against an ``Arrays`` adapter: ``HOST_ARRAYS`` here (numpy, a CPU
Session per body), the device adapter in gradgen/kernels/cuda/control.py (the body runs on the GPU
inside the step, ``Session.run_within``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir._cloner import Cloner

from gradgen.errors import KernelError
from gradgen.kernels.table import cpu_kernel
from gradgen.ops.control_flow import graph_outer_values

# subgraph -> {(opset, device): (Session, names of its own inputs, names of the outer values it reads)}
_SESSIONS: weakref.WeakKeyDictionary[ir.Graph, dict[tuple[int, str], Any]] = weakref.WeakKeyDictionary()


def _standalone(graph: ir.Graph, opset: int) -> tuple[ir.Model, list[str]]:
    """A copy of ``graph`` as a model whose inputs are its own, then the outer values it reads
    (one input per name: a subgraph output that names an outer value is a value of its own in
    onnx-ir, apart from the outer value its nodes read)."""
    inputs: dict[str | None, ir.Value] = {}
    value_map: dict[ir.Value, ir.Value | None] = {}
    for v in graph_outer_values(graph):
        value_map[v] = inputs.setdefault(v.name, ir.Value(name=v.name, type=v.type, shape=v.shape))
    cloner = Cloner(attr_map={}, value_map=value_map, metadata_props={}, allow_outer_scope_values=True)
    copy = cloner.clone_graph(graph)
    copy.inputs.extend(inputs.values())
    copy.opset_imports[""] = opset
    copy.opset_imports.setdefault("com.microsoft", 1)
    return ir.Model(copy, ir_version=10), [name for name in inputs if name]


def body_session(graph: ir.Graph, opset: int, inputs: list, scope: dict, device: str = "cpu"):
    """(the Session of ``graph`` on ``device``, its feeds: the body's own ``inputs`` in order, then
    the outer values it reads, from ``scope``)."""
    from gradgen.executor.session import Session

    sessions = _SESSIONS.setdefault(graph, {})
    key = (opset, device)
    if key not in sessions:
        model, outer = _standalone(graph, opset)
        sessions[key] = (Session(model, device=device), [v.name for v in graph.inputs], outer)
    session, names, outer = sessions[key]
    feeds = dict(zip(names, inputs))
    feeds.update({name: scope[name] for name in outer})
    return session, feeds


class HostArrays:
    """What the control-flow kernels do with arrays, on the CPU: numpy, and bodies run as CPU
    Sessions."""

    @staticmethod
    def run(graph: ir.Graph, inputs: list, scope: dict, opset: int) -> list:
        """The outputs of ``graph`` for its inputs (in order) and the outer values in ``scope``."""
        session, feeds = body_session(graph, opset, inputs, scope)
        results = session.run(feeds)
        return [results[name] for name in session.output_names]

    @staticmethod
    def host(value) -> np.ndarray:
        return np.asarray(value)

    @staticmethod
    def stack(elements: list):
        return np.stack(elements)

    @staticmethod
    def concatenate(parts: list):
        return np.concatenate(parts)

    @staticmethod
    def moveaxis(x, source: int, destination: int):
        return np.moveaxis(x, source, destination)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype)


HOST_ARRAYS = HostArrays()


def _first(arrays, value, what: str):
    """A condition's or trip count's value, on the host: ONNX wants exactly one element."""
    host = arrays.host(value)
    if host.size != 1:
        raise KernelError(f"the {what} must hold exactly one element; it has shape {list(host.shape)}")
    return host.reshape(-1)[0]


def _split_scope(args: tuple, captured: tuple) -> tuple[list, dict[str, Any]]:
    """The node's own arguments and the outer values (the trailing ``len(captured)`` arguments)."""
    own = len(args) - len(captured)
    return list(args[:own]), dict(zip(captured, args[own:]))


def _empty_like_declared(arrays, value: ir.Value):
    """A stack of zero elements of a scan output whose elements ``value`` declares."""
    dtype = np.dtype(value.dtype.numpy()) if value.dtype is not None else np.dtype(np.float32)
    dims = [d if isinstance(d, int) else 0 for d in value.shape] if value.shape is not None else []
    return arrays.zeros((0, *dims), dtype)


def run_if(arrays, cond, args: tuple, then_branch, else_branch, captured: tuple, opset: int) -> tuple:
    _, scope = _split_scope((cond, *args), captured)
    branch = then_branch if bool(_first(arrays, cond, "condition")) else else_branch
    return tuple(arrays.run(branch, [], scope, opset))


def run_loop(arrays, m, cond, args: tuple, body, captured: tuple, opset: int) -> tuple:
    initial, scope = _split_scope(args, captured)
    trip_count = None if m is None else int(_first(arrays, m, "trip count M"))
    go_on = True if cond is None else bool(_first(arrays, cond, "condition"))
    states = list(initial)
    num_scans = len(body.outputs) - 1 - len(states)
    scans: list[list[Any]] = [[] for _ in range(num_scans)]
    i = 0
    while go_on and (trip_count is None or i < trip_count):
        outputs = arrays.run(body, [np.array(i, dtype=np.int64), np.array(go_on), *states], scope, opset)
        go_on = bool(_first(arrays, outputs[0], "body's condition output"))
        states = outputs[1 : 1 + len(states)]
        for k, element in enumerate(outputs[1 + len(states) :]):
            if scans[k] and tuple(element.shape) != tuple(scans[k][0].shape):
                raise KernelError(
                    f"scan output {k} has shape {list(element.shape)} at iteration {i} and "
                    f"{list(scans[k][0].shape)} at iteration 0 (a Loop's scan outputs keep one shape)"
                )
            scans[k].append(element)
        i += 1
    stacked = [
        arrays.stack(series) if series else _empty_like_declared(arrays, body.outputs[1 + len(states) + k])
        for k, series in enumerate(scans)
    ]
    return tuple(states + stacked)


def run_scan(
    arrays,
    args: tuple,
    body,
    num_scan_inputs: int,
    scan_input_axes,
    scan_input_directions,
    scan_output_axes,
    scan_output_directions,
    captured: tuple,
    opset: int,
) -> tuple:
    own, scope = _split_scope(args, captured)
    num_states = len(own) - num_scan_inputs
    states, sequences = own[:num_states], own[num_states:]
    in_axes = scan_input_axes or [0] * num_scan_inputs
    in_reverse = scan_input_directions or [0] * num_scan_inputs
    sequences = [arrays.moveaxis(x, axis if axis >= 0 else axis + len(x.shape), 0) for x, axis in zip(sequences, in_axes)]
    lengths = {x.shape[0] for x in sequences}
    if len(lengths) != 1:
        raise KernelError(f"the scan inputs have different lengths along their scan axes ({sorted(lengths)})")
    (length,) = lengths
    num_outputs = len(body.outputs) - num_states
    series: list[list[Any]] = [[] for _ in range(num_outputs)]
    for t in range(length):
        slices = [x[length - 1 - t] if rev else x[t] for x, rev in zip(sequences, in_reverse)]
        outputs = arrays.run(body, [*states, *slices], scope, opset)
        states = outputs[:num_states]
        for k, element in enumerate(outputs[num_states:]):
            series[k].append(element)
    out_axes = scan_output_axes or [0] * num_outputs
    out_reverse = scan_output_directions or [0] * num_outputs
    stacked = []
    for k in range(num_outputs):
        elements = series[k][::-1] if out_reverse[k] else series[k]
        if not elements:
            stacked.append(_empty_like_declared(arrays, body.outputs[num_states + k]))
            continue
        whole = arrays.stack(elements)
        rank = len(whole.shape)
        axis = out_axes[k] + rank if out_axes[k] < 0 else out_axes[k]
        stacked.append(arrays.moveaxis(whole, 0, axis))
    return tuple(list(states) + stacked)


def run_scan_8(arrays, args: tuple, body: ir.Graph, num_scan_inputs: int, directions, captured: tuple) -> tuple:
    """Scan-8: a batch axis first on every state and scan input, optional sequence_lens first (a
    sequence's scan outputs are zero past its length); each batch entry runs as a Scan-9."""
    (lens, *own), scope = _split_scope(args, captured)
    scope_values = tuple(scope[name] for name in captured)
    num_states = len(own) - num_scan_inputs
    batch = own[0].shape[0]
    lengths = None if lens is None else arrays.host(lens).reshape(-1)  # one read of the device's lengths
    per_batch = []
    for b in range(batch):
        length = own[num_states].shape[1] if lengths is None else int(lengths[b])
        entry = tuple(x[b] for x in own[:num_states]) + tuple(x[b][:length] for x in own[num_states:])
        per_batch.append(run_scan(arrays, entry + scope_values, body, num_scan_inputs, None, directions, None, None, captured, 9))
    outputs = []
    for k in range(len(per_batch[0])):
        parts = [r[k] for r in per_batch]
        if k >= num_states:  # scan outputs: pad each sequence to the longest
            full = own[num_states].shape[1]
            parts = [
                p if p.shape[0] == full else arrays.concatenate([p, arrays.zeros((full - p.shape[0], *p.shape[1:]), p.dtype)])
                for p in parts
            ]
        outputs.append(arrays.stack(parts))
    return tuple(outputs)


def control_flow_kernels(arrays) -> dict:
    """If, Loop and Scan as kernels (the executor's calling convention) over ``arrays``: the
    CPU's here, the GPU's in gradgen/kernels/cuda/control.py."""

    def if_(cond, *args, then_branch, else_branch, _captured=(), _opset=1):
        return run_if(arrays, cond, args, then_branch, else_branch, _captured, _opset)

    def loop(m, cond, *args, body, _captured=(), _opset=1):
        return run_loop(arrays, m, cond, args, body, _captured, _opset)

    def scan(
        *args,
        body,
        num_scan_inputs,
        scan_input_axes=None,
        scan_input_directions=None,
        scan_output_axes=None,
        scan_output_directions=None,
        directions=None,
        _captured=(),
        _opset=1,
    ):
        if _opset < 9:
            return run_scan_8(arrays, args, body, num_scan_inputs, directions, _captured)
        axes_and_directions = (scan_input_axes, scan_input_directions, scan_output_axes, scan_output_directions)
        return run_scan(arrays, args, body, num_scan_inputs, *axes_and_directions, _captured, _opset)

    return {"If": if_, "Loop": loop, "Scan": scan}


for _op, _kernel in control_flow_kernels(HOST_ARRAYS).items():
    cpu_kernel(_op)(_kernel)
