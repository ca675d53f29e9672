"""bfloat16 / float16 on the CPU backend: compute in float32, round on output.

numpy has no bfloat16 (``ml_dtypes`` provides the dtype, which onnx already depends on, but few
numpy routines accept it), and numpy's float16 arithmetic rounds every intermediate result. A
GPU kernel for a 16-bit float loads its inputs, computes and accumulates in float32 and rounds
once when it stores. The CPU backend does the same: a step that reads or writes a 16-bit float
runs its numpy kernel on float32 copies of its 16-bit inputs, and each float output is rounded to
the element type the graph declares for it (to the narrowest input float type where the graph
declares none). The products of two bfloat16 or float16 numbers are exact in float32, so a MatMul
computed this way is what a tensor core with float32 accumulation computes, up to summation order.
"""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT16 = np.dtype(np.float16)
LOW_PRECISION = (BFLOAT16, FLOAT16)
_ONNX_LOW = {int(ir.DataType.BFLOAT16), int(ir.DataType.FLOAT16)}


def is_low_precision(dtype) -> bool:
    return dtype is not None and np.dtype(dtype) in LOW_PRECISION


def is_float_dtype(dtype: np.dtype) -> bool:
    """Float types, bfloat16 included (``ml_dtypes``' dtypes are of numpy kind 'V')."""
    return dtype.kind == "f" or dtype == BFLOAT16


def declared_dtypes(node: ir.Node) -> list[np.dtype | None]:
    """The element type the graph declares for each output of ``node`` (None where unknown)."""
    out = []
    for value in node.outputs:
        try:
            out.append(np.dtype(value.dtype.numpy()) if value.dtype is not None else None)
        except (TypeError, ValueError):  # element types numpy cannot hold (strings, ...)
            out.append(None)
    return out


_LOW_SET = frozenset(LOW_PRECISION)


def may_read_low_precision(node: ir.Node, inferred: Mapping[str, int] | None = None) -> bool:
    """Whether an input of ``node`` can be a 16-bit float at run time: one the graph declares
    16-bit or leaves untyped (``inferred``: element types by value name for values the graph leaves
    untyped, from ONNX's inference). A Session checks the arguments of only such steps (feeds are
    checked against their declared types, and every kernel keeps the types the graph declares)."""
    for value in node.inputs:
        if value is None:
            continue
        dtype = int(value.dtype) if value.dtype is not None else (inferred or {}).get(value.name or "")
        if not dtype or dtype in _ONNX_LOW:
            return True
    return False


def untyped_value_types(model: ir.Model) -> dict[str, int]:
    """Element types ONNX's inference gives ``model``'s values, by name, where a value its nodes
    read is untyped (a model without value_info); empty where none is or inference fails (the
    model is not changed)."""
    if not any(v is not None and v.type is None for node in model.graph for v in node.inputs):
        return {}
    from gradgen.passes.standard import inferred_element_types

    try:
        return inferred_element_types(model)
    except Exception:  # noqa: BLE001 -- without them, those steps check their arguments at run time
        return {}


def needs_fp32(op_type: str, args: list, attributes: dict, out_dtypes: list | None) -> bool:
    """True when the step reads a 16-bit float or a Cast produces one."""
    return reads_low_precision(args) or always_fp32(op_type, attributes, out_dtypes)


def reads_low_precision(args) -> bool:
    """True when one of the arguments is a 16-bit float array (the per-run half of ``needs_fp32``)."""
    for a in args:
        if a is not None and getattr(a, "dtype", None) in _LOW_SET:
            return True
    return False


def always_fp32(op_type: str, attributes: dict, out_dtypes: list | None) -> bool:
    """True when a Cast produces a 16-bit float or the graph declares one as an output (known at plan time)."""
    if op_type == "Cast" and int(attributes.get("to", 0)) in _ONNX_LOW:
        return True
    return bool(out_dtypes) and any(is_low_precision(d) for d in out_dtypes if d is not None)


def run_in_fp32(kernel, op_type: str, args: list, attributes: dict, out_dtypes: list | None):
    """Run ``kernel`` on float32 copies of the 16-bit float inputs; round its float outputs to
    their declared element types (the narrowest 16-bit input type where none is declared)."""
    low = [a.dtype for a in args if a is not None and is_low_precision(getattr(a, "dtype", None))]
    fallback = low[0] if low else None
    wide = [a.astype(np.float32) if a is not None and is_low_precision(getattr(a, "dtype", None)) else a for a in args]
    attrs = dict(attributes)
    if op_type == "Cast":
        target = int(attrs.get("to", 0))
        fallback = np.dtype(ir.DataType(target).numpy()) if target in _ONNX_LOW else None
        if fallback is not None:
            attrs["to"] = int(ir.DataType.FLOAT)  # rounded to the target type below
    elif op_type == "CastLike":
        fallback = args[1].dtype if is_low_precision(args[1].dtype) else None
    with np.errstate(over="ignore", invalid="ignore"):  # float16 overflows are the loss scaler's to handle
        result = kernel(*wide, **attrs)
        return _round(result, out_dtypes, fallback)


def _round(result, out_dtypes: list | None, fallback):
    results = result if isinstance(result, tuple) else (result,)
    rounded = []
    for k, value in enumerate(results):
        want = out_dtypes[k] if out_dtypes and k < len(out_dtypes) else None
        if want is None:
            want = fallback
        array = np.asarray(value) if value is not None else None
        if (
            array is not None
            and want is not None
            and is_float_dtype(array.dtype)
            and is_float_dtype(want)
            and array.dtype != want
        ):
            array = array.astype(want)
        rounded.append(array)
    return tuple(rounded) if isinstance(result, tuple) else rounded[0]
