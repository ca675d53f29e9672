"""Custom ops from Python: a gradient rule, a CPU kernel and output types for an op gradgen does not
know (or a replacement for one it does), registered with decorators, as ``torch.autograd.Function``
or JAX's ``custom_vjp`` let users define a function's backward.

::

    import numpy as np
    import gradgen

    @gradgen.register_kernel("SoftClip", domain="my.ops", infer=lambda inputs, attrs: [inputs[0]])
    def soft_clip(x, *, limit=1.0):  # inputs positional (numpy), attributes keyword
        return (limit * np.tanh(x / limit)).astype(x.dtype)

    @gradgen.register_gradient("SoftClip", domain="my.ops")
    def soft_clip_grad(g):  # one gradient per input, built from ONNX ops
        x, limit = g.x(0), g.attr("limit", 1.0)
        t = g.op("Tanh", g.op("Div", x, g.const_like(x, limit)))
        return [g.op("Mul", g.dy(), g.op("Sub", g.const_like(x, 1.0), g.op("Mul", t, t)))]

The rule receives what gradgen's own rules receive (``gradgen.grads.builder.GradContext``): ``g.x(i)``,
``g.y(i)``, ``g.dy(i)`` (the forward input, output, and the output's gradient), ``g.needs(i)``,
``g.attr(name, default)``, ``g.op(op_type, *inputs, domain="", **attributes)`` to emit a node, and
the graph builder's helpers (``g.const_like``, ``g.reduce_sum``, ``g.shape_of``, ...). It returns
one entry per forward input: a gradient value, or None where ``g.needs(i)`` is False; inputs listed
in ``nondiff_inputs`` never get one. The kernel follows gradgen's CPU kernels: inputs positional,
attributes keyword with their defaults.

ONNX's shape inference knows nothing of a custom op: ``infer(inputs, attributes)`` gives each
output's (element type, shape) from the inputs' ``gradgen.ops.schemas.TensorInfo`` (dtype as
``onnx_ir.DataType``, shape as a tuple of ints / symbol names / None, or None) and the node's
attributes, as gradgen's com.microsoft schemas do. Without it, the model must declare the outputs'
types in its value_info.

Registrations are process-wide; ``unregister`` removes them (restoring what a ``replace=True``
registration replaced).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import onnx_ir as ir

from gradgen.errors import UsageError
from gradgen.ops.attributes import node_attributes
from gradgen.ops.schemas import TensorInfo, normalize_domain

__all__ = ["register_gradient", "register_kernel", "unregister"]

Infer = Callable[[list, dict], list]

_INFER: dict[tuple[str, str], Infer] = {}
_MISSING = object()  # a registration that replaced nothing
_REPLACED_RULES: dict[tuple[str, str], object] = {}
_REPLACED_KERNELS: dict[tuple[str, str], object] = {}


def _key(op_type: str, domain: str) -> tuple[str, str]:
    if not isinstance(op_type, str) or not op_type:
        raise UsageError(f"a custom op needs a name (op_type), got {op_type!r}")
    return normalize_domain(domain), op_type


def _label(key: tuple[str, str]) -> str:
    return f"{key[0] or 'ai.onnx'}::{key[1]}"


def register_gradient(op_type: str, *, domain: str = "", nondiff_inputs: Sequence[int] = (), replace: bool = False):
    """Decorator: ``fn(g) -> list`` becomes the gradient rule of ``domain::op_type``.

    An op that already has a rule (gradgen's or an earlier registration) is refused unless
    ``replace=True``. ``nondiff_inputs`` lists the input positions that carry no gradient (indices,
    shapes, flags): the walker does not differentiate through them."""
    from gradgen.grads.registry import lookup_rule
    from gradgen.grads.table import RULES, GradRule

    key = _key(op_type, domain)

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise UsageError(f"register_gradient({_label(key)!r}) decorates a function, got {fn!r}")
        existing = lookup_rule(*key)  # loads gradgen's rules first, so that they never clash later
        if existing is not None and not replace:
            raise UsageError(f"{_label(key)} already has a gradient rule ({existing.module}); pass replace=True to replace it")
        _REPLACED_RULES.setdefault(key, _MISSING if existing is None else existing)
        RULES[key] = GradRule(key[0], op_type, fn, nondiff_inputs=frozenset(nondiff_inputs), module=fn.__module__)
        return fn

    return register


def register_kernel(op_type: str, *, domain: str = "", infer: Infer | None = None, replace: bool = False):
    """Decorator: a numpy function becomes the CPU kernel of ``domain::op_type`` (on a GPU session
    it runs on host copies, as gradgen's own ops without a CUDA launcher do).

    ``infer(inputs, attributes)`` returns each output's (element type, shape); see the module's
    docstring. An op that already has a CPU kernel is refused unless ``replace=True``."""
    from gradgen.kernels.registry import KERNELS, lookup
    from gradgen.kernels.table import KernelEntry, cpu_kernel

    key = _key(op_type, domain)

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise UsageError(f"register_kernel({_label(key)!r}) decorates a function, got {fn!r}")
        existing = lookup(*key)  # loads gradgen's kernels first
        if existing is not None and existing.cpu is not None and not replace:
            raise UsageError(f"{_label(key)} already has a CPU kernel ({existing.cpu_family}); pass replace=True to replace it")
        _REPLACED_KERNELS.setdefault(key, _MISSING if existing is None else dataclasses.replace(existing))
        if existing is not None:
            existing.cpu = None
        else:
            KERNELS[key] = KernelEntry(key[0], op_type)
        cpu_kernel(op_type, domain=key[0])(fn)
        if infer is not None:
            _INFER[key] = infer
        else:
            _INFER.pop(key, None)
        return fn

    return register


def unregister(op_type: str, *, domain: str = "") -> None:
    """Remove what ``register_gradient`` / ``register_kernel`` registered for ``domain::op_type``,
    restoring gradgen's own rule or kernel where a registration replaced one."""
    from gradgen.grads.table import RULES
    from gradgen.kernels.registry import KERNELS

    key = _key(op_type, domain)
    if key not in _REPLACED_RULES and key not in _REPLACED_KERNELS:
        raise UsageError(f"nothing is registered for {_label(key)}")
    for table, replaced in ((RULES, _REPLACED_RULES), (KERNELS, _REPLACED_KERNELS)):
        if key in replaced:
            previous = replaced.pop(key)
            if previous is _MISSING:
                table.pop(key, None)
            else:
                table[key] = previous  # type: ignore[assignment]  # the entry this table held
    _INFER.pop(key, None)


def type_custom_outputs(graph: ir.Graph) -> bool:
    """Give the outputs of registered custom ops the types and shapes their ``infer`` computes,
    where nothing is known yet; True if any changed. (Called by ``ShapeInferencePass``.)"""
    if not _INFER:
        return False
    changed = False
    for node in graph:
        infer = _INFER.get((normalize_domain(node.domain), node.op_type))
        if infer is None or all(o.type is not None and o.shape is not None for o in node.outputs if o.name):
            continue
        infos = [None if v is None else _info(v) for v in node.inputs]
        attrs = node_attributes(node)
        try:
            results = list(infer(infos, attrs))
        except Exception as exc:  # noqa: BLE001 - the user's function: say whose it is
            raise UsageError(
                f"the infer function of {_label((node.domain, node.op_type))} failed on node {node.name!r}: {exc}"
            ) from exc
        for value, result in zip(node.outputs, results):
            dtype, shape = result[0], result[1]  # a (dtype, shape) pair or an input's TensorInfo
            if value.type is None and dtype is not None:
                value.type = ir.TensorType(ir.DataType(int(dtype)))
                changed = True
            if value.shape is None and shape is not None:
                value.shape = ir.Shape(list(shape))
                changed = True
    return changed


def _info(value: ir.Value) -> TensorInfo:
    shape = None if value.shape is None else tuple(d if isinstance(d, int) else (d.value or None) for d in value.shape)
    constant = value.const_value.numpy() if value.const_value is not None and value.const_value.size <= 4096 else None
    return TensorInfo(value.dtype, shape, constant)
