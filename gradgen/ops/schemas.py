"""The com.microsoft ops gradgen emits and runs: the schema type, the table of signatures, and
their output types.

Each op's schema is declared next to its reference CPU kernel, in its family's module
(``gradgen/kernels/cpu/<family>.py``, ``declare(Schema(...))``); this module holds the vocabulary
and the table they fill. The signatures are ONNX Runtime training's (domain com.microsoft, since
version 1), input order included, so that gradgen's graphs load there and ORT-built gradient graphs
run here. Every layer checks these nodes against the table (``check_node``): the graph builder when
it emits one, the executor when it plans one, the lowering before it rewrites one; ``gradgen ops
--signatures`` prints it. None of these ops has an ONNX shape-inference function: ``output_types``
gives the type and shape of each output (each schema's ``infer``).

Types are ``onnx_ir.DataType`` members (an IntEnum with ``onnx.TensorProto``'s numbers, so plain
ints work too). A shape is a tuple whose dims are ints, symbolic names (str) or None (unknown); a
shape of None means even the rank is unknown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, Sequence

import numpy as np
import onnx_ir as ir

from gradgen.errors import ModelError

MICROSOFT_DOMAIN = "com.microsoft"
MICROSOFT_OPSET = 1


# ONNX Runtime's forward ops of models optimized for its inference (com.microsoft, and its
# SimplifiedLayerNormalization of the ONNX domain): compositions of standard ops, whose standard
# form is their lowering (gradgen/passes/lowering; their kernels and schemas are in
# gradgen/kernels/cpu), which DecomposePass applies before the gradient pass, so the rules of
# those ops differentiate every float input; no CUDA launcher (kernels/registry.py)
LOWERED_FORWARD_OPS = frozenset(
    {
        *((MICROSOFT_DOMAIN, op) for op in ("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasDropout")),
        *((MICROSOFT_DOMAIN, op) for op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization")),
        ("", "SimplifiedLayerNormalization"),
        # attention (gradgen/passes/lowering/attention.py): ONNX's own Attention too
        ("", "Attention"),
        (MICROSOFT_DOMAIN, "MultiHeadAttention"),
    }
)


# Of those, the ones gradgen's passes also make (GeluFusionPass: an exported GELU formula becomes one
# node, differentiated by GeluGrad / FastGeluGrad): both executors run them.
FUSED_FORWARD_OPS = frozenset({(MICROSOFT_DOMAIN, "Gelu"), (MICROSOFT_DOMAIN, "FastGelu")})


def normalize_domain(domain: str) -> str:
    """The default domain as "" (ONNX spells it "" or "ai.onnx"); any other domain as it is."""
    return "" if domain in ("", "ai.onnx") else domain


DT = ir.DataType
FLOATS = frozenset({DT.FLOAT16, DT.FLOAT, DT.DOUBLE, DT.BFLOAT16})
FLOATS_NO_BF16 = frozenset({DT.FLOAT16, DT.FLOAT, DT.DOUBLE})
INDICES = frozenset({DT.INT32, DT.INT64})
INT64 = frozenset({DT.INT64})
ANY = None  # every tensor type


@dataclasses.dataclass(frozen=True)
class Formal:
    """One input or output: its name, whether it may be omitted, and the types it accepts."""

    name: str
    types: frozenset | None
    optional: bool = False


@dataclasses.dataclass(frozen=True)
class Attribute:
    """An attribute with its default (None: absent unless given).

    ``declared`` is False for attributes ORT's schema does not declare but the node carries all
    the same (ConvGrad keeps the forward Conv's attributes verbatim).
    """

    name: str
    type: str
    default: Any = None
    declared: bool = True


@dataclasses.dataclass(frozen=True)
class Schema:
    op_type: str
    inputs: tuple[Formal, ...]
    outputs: tuple[Formal, ...]
    attributes: tuple[Attribute, ...] = ()
    domain: str = MICROSOFT_DOMAIN
    since_version: int = MICROSOFT_OPSET
    # (dtype, shape) of each output from the inputs' TensorInfos and the attributes (see
    # output_types); ``declare`` requires it.
    infer: Callable[[list, dict], list] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def min_inputs(self) -> int:
        return sum(1 for f in self.inputs if not f.optional)

    def defaults(self) -> dict[str, Any]:
        return {a.name: a.default for a in self.attributes if a.default is not None}


# Filled by ``declare``: every op's schema sits with its family's CPU kernel.
_TABLE: dict[str, Schema] = {}


def declare(sch: Schema) -> Schema:
    """Add the schema of a com.microsoft op declared with its family's CPU kernel (its reference
    semantics; ``gradgen/kernels/cpu/<family>.py``), so that the op's contract, output types and
    kernel live in one file. Every layer reads it through ``SCHEMAS`` / ``schema``."""
    if sch.infer is None:
        raise ValueError(f"the schema of {sch.op_type} declares no output types (infer=)")
    if _TABLE.get(sch.op_type, sch) is not sch:
        raise RuntimeError(f"duplicate schema for {MICROSOFT_DOMAIN}::{sch.op_type}")
    _TABLE[sch.op_type] = sch
    return sch


class _Schemas(Mapping):
    """Every schema gradgen knows: those declared with their CPU kernels.

    The first read imports the CPU kernel families (through the kernel registry, which lists
    them), whose ``declare`` calls complete the table; nothing is imported before that, so this
    module stays importable by the kernel modules themselves."""

    def _complete(self) -> dict[str, Schema]:
        global _DECLARED_LOADED
        if not _DECLARED_LOADED:
            _DECLARED_LOADED = True
            from gradgen.kernels import registry  # the kernel families declare their ops' schemas

            registry.lookup(MICROSOFT_DOMAIN, "")
        return _TABLE

    def __getitem__(self, op_type: str) -> Schema:
        return self._complete()[op_type]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._complete()))

    def __len__(self) -> int:
        return len(self._complete())


_DECLARED_LOADED = False
SCHEMAS: Mapping[str, Schema] = _Schemas()


def microsoft_opset_import() -> tuple[str, int]:
    """The opset import a model holding these ops needs."""
    return (MICROSOFT_DOMAIN, MICROSOFT_OPSET)


def schema(op_type: str) -> Schema:
    """The schema of a com.microsoft op gradgen knows; ModelError naming the op otherwise."""
    try:
        return SCHEMAS[op_type]
    except KeyError:
        raise ModelError(
            f"{MICROSOFT_DOMAIN}::{op_type} is not one of the ops gradgen knows ({', '.join(sorted(SCHEMAS))})"
        ) from None


def check_node(op_type: str, num_inputs: int, num_outputs: int, attributes=(), where: str = "") -> Schema:
    """Check a com.microsoft node's input and output counts and attribute names against its schema.

    ``num_inputs`` counts up to the last given input (omitted optional ones in between count);
    ``where`` names the node in the error. Returns the schema. Every layer that emits, runs or
    rewrites these nodes calls it: the gradient builder, the executor's plan and the lowering.
    """
    sch = schema(op_type)
    label = f"{MICROSOFT_DOMAIN}::{op_type}" + (f" {where}" if where else "")
    if not sch.min_inputs <= num_inputs <= len(sch.inputs):
        raise ModelError(
            f"{label} takes {sch.min_inputs} to {len(sch.inputs)} inputs "
            f"({', '.join(f.name for f in sch.inputs)}), got {num_inputs}"
        )
    if not 1 <= num_outputs <= len(sch.outputs):
        raise ModelError(
            f"{label} has at most {len(sch.outputs)} outputs ({', '.join(f.name for f in sch.outputs)}), got {num_outputs}"
        )
    known = {a.name for a in sch.attributes}
    unknown = sorted(set(attributes) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise ModelError(f"{label} has unknown attribute(s) {', '.join(unknown)} (allowed: {allowed})")
    return sch


class TensorInfo(NamedTuple):
    """What is known of one input: its type, its shape and, for a constant, its value."""

    dtype: int | None
    shape: tuple | None
    value: np.ndarray | None = None


Shape = tuple | None
OutputType = tuple[ir.DataType | None, Shape]


def output_types(
    op_type: str, input_types_and_shapes: Sequence[Any], attributes: dict[str, Any] | None = None
) -> list[OutputType]:
    """(dtype, shape) of every output the schema declares, in order, from what is known of the inputs.

    ``input_types_and_shapes`` holds, per input in schema order, a ``TensorInfo`` or a tuple
    (dtype, shape) or (dtype, shape, value), or None for an omitted optional input. Raises
    ModelError for a wrong number of inputs or a type the schema does not allow.
    """
    sch = schema(op_type)
    infos = [_info(x) for x in input_types_and_shapes]
    if not sch.min_inputs <= len(infos) <= len(sch.inputs):
        raise ModelError(
            f"{MICROSOFT_DOMAIN}::{op_type} takes {sch.min_inputs} to {len(sch.inputs)} inputs "
            f"({', '.join(f.name for f in sch.inputs)}), got {len(infos)}"
        )
    for formal, info in zip(sch.inputs, infos):
        if info is None:
            if not formal.optional:
                raise ModelError(f"{MICROSOFT_DOMAIN}::{op_type}: input {formal.name!r} is required")
        elif formal.types is not None and info.dtype is not None and info.dtype not in formal.types:
            allowed = ", ".join(sorted(t.name for t in formal.types))
            raise ModelError(
                f"{MICROSOFT_DOMAIN}::{op_type}: input {formal.name!r} has type {_type_name(info.dtype)}; allowed: {allowed}"
            )
    attrs = {**sch.defaults(), **(attributes or {})}
    assert sch.infer is not None  # declare() refuses a schema without it
    return sch.infer(infos, attrs)


def _info(x: Any) -> TensorInfo | None:
    if x is None:
        return None
    info = x if isinstance(x, TensorInfo) else TensorInfo(*x)
    dtype = None if info.dtype is None else DT(int(info.dtype))
    shape = None if info.shape is None else tuple(info.shape)
    value = None if info.value is None else np.asarray(info.value)
    return TensorInfo(dtype, shape, value)


def _type_name(dtype: int) -> str:
    try:
        return DT(int(dtype)).name
    except ValueError:
        return str(dtype)


def shape_from_input(info: TensorInfo) -> Shape:
    """The shape a `shape` input describes: its value if constant, else its rank if known (the output
    shape of the com.microsoft gradients that take their input's shape: SliceGrad, GatherGrad, ...)."""
    if info.value is not None:
        return tuple(int(d) for d in np.asarray(info.value).reshape(-1))
    if info.shape is not None and len(info.shape) == 1 and isinstance(info.shape[0], int):
        return (None,) * info.shape[0]
    return None
