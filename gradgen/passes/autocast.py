"""AutocastPass: mixed precision as a graph transform, with torch.autocast's op lists and rules.

The pass rewrites a forward graph so that it computes what the same model computes under
``torch.autocast(dtype=bfloat16 | float16)``, with explicit ``Cast`` nodes anyone can inspect:

- ops that autocast runs in the lower precision (``lower_precision_fp``: matmul, linear, conv,
  conv_transpose, einsum, prelu; attention's matmuls are MatMuls) get their float32 inputs cast
  to bf16 / fp16 (Gemm's and Conv's bias too, as ``addmm`` / ``conv`` take it);
- ops autocast runs in float32 (its ``fp32`` and ``fp32_set_opt_dtype`` lists: exp, log, pow,
  reciprocal, softplus, the trigonometric ones, softmax, log_softmax, layer_norm, group_norm, the
  losses, sum / prod / cumsum, upsampling) get their 16-bit inputs cast back to float32. Every
  reduction that accumulates (ReduceSum, ReduceMean, ReduceL2, ...) and InstanceNormalization
  count as float32 ops here: PyTorch's kernel for mean takes 16-bit tensors but accumulates in
  float32, and in a graph the accumulation type is the tensor type;
- BatchNormalization runs in its input's type with its scale, bias and statistics left float32,
  as autocast runs batch_norm (not on its lists; cuDNN's kernel takes a 16-bit input with float32
  parameters, computes in float32 and returns the input's type), where the schema lets X's type
  differ from the parameters' (opset 15 and later); below, it is a float32 op;
- except that a BatchNormalization reading a lowered Conv's output runs in float32, on the Conv's
  output cast to float32, and its output is cast back to the lower type for its readers. On a
  runtime that rounds every value to its declared type this computes what autocast computes (the
  cast up is exact, the normalization computes in float32 either way and its output is rounded
  once); gradgen's executors run such a Conv and its Cast as one convolution with a float32
  output (gradgen/executor/excess_precision.py), so the normalization and its gradient see the
  convolution's float32 accumulator instead of its bf16 rounding. On ResNet-18 that is what takes
  the bf16 gradients' worst per-tensor error below autocast's (docs/BENCHMARKS.md, 2026-12-06);
- every other op runs in its inputs' type; when its inputs of one type variable mix types, they
  are promoted to the widest (bf16 + float32 -> float32), except that a rank-0 operand (a Python
  scalar in the exported code) follows the others, as in PyTorch's type promotion; the bias Add
  of an exported ``nn.Linear`` (MatMul then Add of a 1-D initializer) follows the MatMul, since
  autocast runs ``linear`` with its bias in the lower precision.

Float initializers stay float32 ("master weights"): a lowered one gets one ``Cast`` after it, shared
by its consumers, so its gradient (``Cast``'s gradient is the cast back) comes out float32. Graph
inputs and outputs keep their types (an output computed in 16 bits is cast back to its declared
type). An op whose schema, at the model's opset, has no bf16 / fp16 variant runs in float32; for
bf16, a model below opset 22 (the first opset whose Conv, ConvTranspose, pooling and Einsum take
bfloat16) is converted to opset 22 first when one of its lowered ops needs it.

``precision="tf32"`` leaves the graph float32 and only records the request. Every precision is
recorded in the model's metadata under ``gradgen.precision`` for the backends to read.
"""

from __future__ import annotations

import warnings

import onnx
import onnx_ir as ir

from gradgen.errors import UsageError
from gradgen.model_io import default_opset
from gradgen.names import unique_name

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
METADATA_KEY = "gradgen.precision"
LOW_DTYPES = {"bf16": ir.DataType.BFLOAT16, "fp16": ir.DataType.FLOAT16}
BF16_OPSET = 22  # Conv, ConvTranspose, MaxPool, AveragePool, GlobalAveragePool, Einsum take bfloat16 from here

# torch.autocast's lower_precision_fp list, as ONNX ops
LOWER_PRECISION_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "PRelu"})
# torch.autocast's fp32 and fp32_set_opt_dtype lists, as ONNX ops, and the accumulating reductions
# and normalizations (see the module docstring)
FLOAT32_OPS = frozenset(
    {
        "Exp",
        "Log",
        "Pow",
        "Reciprocal",
        "Softplus",
        "Acos",
        "Asin",
        "Cosh",
        "Sinh",
        "Tan",
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "LpNormalization",
        "MeanVarianceNormalization",
        "ReduceSum",
        "ReduceMean",
        "ReduceProd",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "CumSum",
        "SoftmaxCrossEntropyLoss",
        "NegativeLogLikelihoodLoss",
        "Resize",
        "Upsample",
    }
)
# ops that run in their input's type with float32 parameters where the schema gives the parameters
# a type variable of their own (see the module docstring), float32 ops where it does not
PARAMETERS_APART_OPS = frozenset({"BatchNormalization"})
# lowered ops whose output a BatchNormalization reads in float32 (see the module docstring)
WIDE_OUTPUT_OPS = frozenset({"Conv"})
# ops whose output type is not their inputs' (or that accept anything): left as they are
_UNTOUCHED_OPS = frozenset({"Cast", "CastLike", "Shape", "Size", "Identity"})
_AUTOCAST_FLOATS = {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16}
_TYPE_STR = {ir.DataType.FLOAT: "tensor(float)", ir.DataType.FLOAT16: "tensor(float16)", ir.DataType.BFLOAT16: "tensor(bfloat16)"}
_WIDTH = {ir.DataType.FLOAT16: 1, ir.DataType.BFLOAT16: 1, ir.DataType.FLOAT: 2}
_SUFFIX = {ir.DataType.FLOAT: "fp32", ir.DataType.FLOAT16: "fp16", ir.DataType.BFLOAT16: "bf16"}  # of cast values' names


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}: choose {', '.join(PRECISIONS)}")
    return precision


def model_precision(model: ir.Model) -> str:
    """The precision recorded by AutocastPass (``fp32`` when none was)."""
    return model.metadata_props.get(METADATA_KEY, "fp32")


class AutocastPass(ir.passes.InPlacePass):
    """Rewrite the forward graph for ``precision`` (fp32, tf32, bf16, fp16); see the module docstring.

    Run it after the preparing passes (types known) and before the gradient pass.
    ``placement`` maps each rewritten node's name to the element type it runs in (for reports and
    tests).
    """

    def __init__(self, precision: str = "bf16"):
        super().__init__()
        self.precision = check_precision(precision)
        self.placement: dict[str, ir.DataType] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        model.metadata_props[METADATA_KEY] = self.precision
        if self.precision not in LOW_DTYPES:
            return ir.passes.PassResult(model, modified=True)
        low = LOW_DTYPES[self.precision]
        if low == ir.DataType.BFLOAT16 and default_opset(model, 1) < BF16_OPSET and _needs_newer_opset(model, low):
            model = _convert_opset(model, BF16_OPSET)
        _Rewriter(model, low, self.placement).run()
        return ir.passes.PassResult(model, modified=True)


def _schema(node: ir.Node, opset: int):
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        return onnx.defs.get_schema(node.op_type, opset)
    except Exception:  # noqa: BLE001 - an unknown op: treated as a float32 op
        return None


def _needs_newer_opset(model: ir.Model, low: ir.DataType) -> bool:
    opset = default_opset(model, 1)
    for node in model.graph:
        if node.op_type in LOWER_PRECISION_OPS:
            schema = _schema(node, opset)
            if schema is not None and not _allows(schema, _input_type_strs(schema, 1)[0], low):
                return True
    return False


def _convert_opset(model: ir.Model, opset: int) -> ir.Model:
    """The model converted to ``opset`` by ONNX's version converter (in place); unchanged, with a
    note, when the converter cannot (the ops lacking bf16 then run in float32)."""
    from gradgen.passes.standard import ShapeInferencePass

    try:
        converted = onnx.version_converter.convert_version(ir.to_proto(model), opset)
    except Exception as exc:  # noqa: BLE001 - the converter's errors are of many kinds
        warnings.warn(
            f"bf16: the model's opset {default_opset(model, 1)} has no bfloat16 Conv / pooling / Einsum and "
            f"converting it to opset {opset} failed ({exc}); those ops run in float32",
            stacklevel=3,
        )
        return model
    model.graph = ir.from_proto(converted).graph  # the graph holds the opset imports
    ShapeInferencePass()(model)
    return model


def _input_type_strs(schema, count: int) -> list[str]:
    """The type string of each of ``count`` inputs (a variadic last input repeats)."""
    formals = list(schema.inputs)
    if not formals:
        return [""] * count
    return [formals[min(i, len(formals) - 1)].type_str for i in range(count)]


def _output_type_strs(schema, count: int) -> list[str]:
    formals = list(schema.outputs)
    if not formals:
        return [""] * count
    return [formals[min(i, len(formals) - 1)].type_str for i in range(count)]


def _allows(schema, type_str: str, dtype: ir.DataType) -> bool:
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return _TYPE_STR[dtype] in constraint.allowed_type_strs
    return type_str == _TYPE_STR[dtype]


class _Rewriter:
    """One walk over the graph in topological order, retyping values as casts are inserted."""

    def __init__(self, model: ir.Model, low: ir.DataType, placement: dict):
        self.model = model
        self.graph = model.graph
        self.opset = default_opset(model, 1)
        self.low = low
        self.placement = placement
        self.casts: dict[tuple[int, ir.DataType], ir.Value] = {}
        self.lowered: set[int] = set()  # ids of values made by a lowered op
        self.original_outputs = [(v, v.dtype) for v in self.graph.outputs]
        self.taken = (
            {v.name for v in self.graph.inputs}
            | set(self.graph.initializers)
            | {o.name for n in self.graph.all_nodes() for o in n.outputs if o.name}
        )

    def run(self) -> None:
        for node in list(self.graph):
            self.visit(node)
        self.restore_captured()
        self.restore_outputs()

    # -- per node --------------------------------------------------------------------------

    def visit(self, node: ir.Node) -> None:
        if node.op_type in _UNTOUCHED_OPS and node.domain in ("", "ai.onnx"):
            if node.op_type == "Identity" and node.inputs and node.inputs[0] is not None:
                node.outputs[0].dtype = node.inputs[0].dtype
            return
        schema = _schema(node, self.opset)
        has_subgraph = any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values())
        if schema is None or has_subgraph:
            self.to_float32(node)  # other domains and control flow run on what the original model gave them
            return
        inputs = _input_type_strs(schema, len(node.inputs))
        groups: dict[str, list[int]] = {}
        for index, value in enumerate(node.inputs):
            if value is not None and value.dtype is not None:
                groups.setdefault(inputs[index], []).append(index)
        main = inputs[0] if node.inputs else None
        # X and scale have type variables of their own (else X and the parameters share one type)
        parameters_apart = node.op_type in PARAMETERS_APART_OPS and len(set(inputs[:2])) == 2
        normalizes_wide = parameters_apart and self.reads_lowered_conv(node)
        float32_op = (
            node.op_type in FLOAT32_OPS or (node.op_type in PARAMETERS_APART_OPS and not parameters_apart) or normalizes_wide
        )
        retyped: dict[str, ir.DataType] = {}
        for type_str, indices in groups.items():
            dtypes = {node.inputs[i].dtype for i in indices}
            if not dtypes <= _AUTOCAST_FLOATS:
                continue  # integers, doubles: autocast leaves them alone
            target = self.target(node, type_str, type_str == main, indices, dtypes, float32_op)
            if target is None:
                continue
            if target != ir.DataType.FLOAT and not _allows(schema, type_str, target):
                target = ir.DataType.FLOAT
            for i in indices:
                if node.inputs[i].dtype != target:
                    node.replace_input_with(i, self.cast(node, node.inputs[i], target))
            retyped[type_str] = target
        outputs = _output_type_strs(schema, len(node.outputs))
        for value, type_str in zip(node.outputs, outputs):
            if type_str in retyped and value.dtype in _AUTOCAST_FLOATS | {None}:
                value.dtype = retyped[type_str]
                if node.op_type in LOWER_PRECISION_OPS and retyped[type_str] == self.low:
                    self.lowered.add(id(value))
        if retyped:
            self.placement[node.name or node.op_type] = retyped.get(main, next(iter(retyped.values())))
        if normalizes_wide:
            self.lower_output(node)

    def target(
        self, node: ir.Node, type_str: str, is_main: bool, indices: list[int], dtypes: set, float32_op: bool
    ) -> ir.DataType | None:
        """The element type the inputs of one type variable run in (None: as they are)."""
        if node.op_type in LOWER_PRECISION_OPS:
            return self.low if is_main and dtypes <= {ir.DataType.FLOAT, self.low} else None
        if float32_op:
            return ir.DataType.FLOAT if dtypes != {ir.DataType.FLOAT} else None
        if len(dtypes) == 1:
            return next(iter(dtypes))
        values = [node.inputs[i] for i in indices]
        followers = [v for v in values if _is_rank0(v) or self.is_linear_bias(node, v, values)]
        leaders = [v for v in values if v not in followers] or values
        return (
            max((v.dtype for v in leaders), key=lambda d: _WIDTH[d])
            if len({v.dtype for v in leaders}) == 1
            else ir.DataType.FLOAT
        )

    def is_linear_bias(self, node: ir.Node, value: ir.Value, values: list[ir.Value]) -> bool:
        """The 1-D initializer added to a lowered MatMul's output: ``nn.Linear``'s bias."""
        return (
            node.op_type == "Add"
            and len(values) == 2
            and value.name in self.graph.initializers
            and value.shape is not None
            and value.shape.rank() == 1
            and any(id(other) in self.lowered for other in values if other is not value)
        )

    def reads_lowered_conv(self, node: ir.Node) -> bool:
        """Whether ``node``'s X is the output of a lowered Conv (see the module docstring)."""
        x = node.inputs[0] if node.inputs else None
        producer = x.producer() if x is not None else None
        return producer is not None and id(x) in self.lowered and producer.op_type in WIDE_OUTPUT_OPS

    def lower_output(self, node: ir.Node) -> None:
        """Cast ``node``'s float32 output 0 to the lower type for its readers in this graph (a graph
        output and the subgraphs' reads keep the float32 value, as they would its declared type)."""
        value = node.outputs[0]
        uses = [use for use in value.uses() if use.node.graph is self.graph]  # before the Cast becomes one
        if value.dtype != ir.DataType.FLOAT or not uses:
            return
        cast = self.cast_node(value, self.low, self.fresh(f"{value.name}.{_SUFFIX[self.low]}"))
        self.graph.insert_after(node, cast)
        for use in uses:
            use.node.replace_input_with(use.idx, cast.outputs[0])

    def to_float32(self, node: ir.Node) -> None:
        for index, value in enumerate(node.inputs):
            if value is not None and value.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
                node.replace_input_with(index, self.cast(node, value, ir.DataType.FLOAT))

    # -- casts -----------------------------------------------------------------------------

    def cast(self, before: ir.Node, value: ir.Value, dtype: ir.DataType) -> ir.Value:
        """``value`` as ``dtype``: one Cast per (value, type), placed before its first consumer."""
        key = (id(value), dtype)
        if key not in self.casts:
            node = self.cast_node(value, dtype, self.fresh(f"{value.name}.{_SUFFIX[dtype]}"))
            self.graph.insert_before(before, node)
            self.casts[key] = node.outputs[0]
        return self.casts[key]

    def cast_node(self, value: ir.Value, dtype: ir.DataType, name: str) -> ir.Node:
        """A new Cast node (not yet in the graph) of ``value`` to ``dtype``, its output named ``name``."""
        out = ir.Value(name=name, type=ir.TensorType(dtype), shape=value.shape.copy() if value.shape else None)
        return ir.Node(
            "",
            "Cast",
            inputs=[value],
            attributes=[ir.AttrInt64("to", int(dtype))],
            outputs=[out],
            name=self.fresh(f"gradgen_autocast/{name}"),
        )

    def fresh(self, name: str) -> str:
        return unique_name(name, self.taken)

    def restore_captured(self) -> None:
        """Values of this graph read inside subgraphs (If / Loop / Scan bodies) keep their type."""
        for node in list(self.graph):
            for attr in node.attributes.values():
                if attr.type not in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                    continue
                for inner in _subgraph_nodes(attr):
                    for index, value in enumerate(inner.inputs):
                        producer = value.producer() if value is not None else None
                        if (
                            producer is not None
                            and producer.graph is self.graph
                            and value.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
                        ):
                            inner.replace_input_with(index, self.cast(node, value, ir.DataType.FLOAT))

    def restore_outputs(self) -> None:
        """Graph outputs keep their declared type: one computed in 16 bits is cast back."""
        for position, (value, dtype) in enumerate(self.original_outputs):
            if value.dtype == dtype or dtype is None:
                continue
            name = value.name
            value.name = self.fresh(f"{name}.{_SUFFIX.get(value.dtype, 'autocast')}")  # an untyped one too
            node = self.cast_node(value, dtype, name)
            self.graph.append(node)
            self.graph.outputs[position] = node.outputs[0]


def _is_rank0(value: ir.Value) -> bool:
    return value.shape is not None and value.shape.rank() == 0


def _subgraph_nodes(attr: ir.Attr):
    graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else list(attr.value)
    for graph in graphs:
        yield from graph.all_nodes()
