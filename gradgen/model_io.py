"""Loading and saving models: clear errors for bad files, atomic writes, input never overwritten."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Union

import onnx
import onnx_ir as ir
import onnx_ir.passes.common
from onnx import external_data_helper, numpy_helper

from gradgen.errors import ModelError, UsageError
from gradgen.names import node_name, node_names

ModelLike = Union[str, os.PathLike, onnx.ModelProto, ir.Model]

# Models whose protobuf would pass this size are written with their tensors as external data.
_EXTERNAL_DATA_THRESHOLD = 1 << 30
# ... and then every initializer of at least this many bytes goes to the external data file.
_EXTERNAL_TENSOR_MIN_BYTES = 1024


def copy_model(model: ir.Model) -> ir.Model:
    """A copy of ``model`` sharing its tensors (onnx-ir >= 0.1.11 has ``clone``; older ones round-trip)."""
    clone = getattr(model, "clone", None)
    return clone() if clone is not None else ir.from_proto(ir.to_proto(model))


def inline_functions(model: ir.Model) -> bool:
    """Replace calls of the model's local functions (an exporter's ``export_modules_as_functions``)
    by their bodies, in place: gradgen's rules and kernels see standard ops. False when there are none."""
    if not model.functions:
        return False
    try:
        ir.passes.common.InlinePass()(model)
    except ir.passes.PreconditionError as exc:  # a function that calls itself, directly or not
        raise ModelError(f"the model's local functions cannot be inlined: {exc}") from None
    return True


def invalid_onnx(model: ModelLike) -> str | None:
    """What ONNX's full checker finds wrong with ``model`` (its first line), or None where it
    passes: asked after gradgen failed on a model, to tell a model error from a gradgen bug."""
    try:
        if isinstance(model, ir.Model):
            proto = ir.to_proto(model)
        elif isinstance(model, onnx.ModelProto):
            proto = model
        else:
            proto = onnx.load(str(model), load_external_data=False)
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # noqa: BLE001 -- ValidationError, InferenceError, ...
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def load_model(model: ModelLike) -> ir.Model:
    """Return an onnx_ir model from a path, a ModelProto or an ir.Model (which is returned as is)."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return _checked(_from_proto(model, "<in-memory model>"), "<in-memory model>")
    path = Path(model)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, not an ONNX model file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, RuntimeWarning, ... on bad bytes
        raise ModelError(f"{path}: not a readable ONNX model, truncated or not ONNX ({type(exc).__name__}: {exc})") from None
    if not proto.HasField("graph") or proto.ir_version == 0:
        raise ModelError(f"{path}: not an ONNX model (no graph or no ir_version; truncated file?)")
    bad_opsets = [f"{o.domain or 'ai.onnx'} {o.version}" for o in proto.opset_import if o.version < 1]
    if not proto.opset_import or bad_opsets:
        found = f"invalid opset import(s) {', '.join(bad_opsets)}" if bad_opsets else "no opset import"
        raise ModelError(f"{path}: not a valid ONNX model ({found}; truncated file?)")
    _check_external_data(proto, path)
    loaded = _checked(_from_proto(proto, str(path)), str(path))
    # External data stays in its files, memory-mapped when a tensor is first read: a model of
    # several GB costs no resident memory until its weights are used, and no copy.
    ir.external_data.set_base_dir(loaded.graph, str(path.resolve().parent))
    _load_external_attribute_tensors(loaded)
    return loaded


def _check_external_data(proto: onnx.ModelProto, path: Path) -> None:
    """Check every tensor kept in external data files before anything reads them.

    The files are looked up relative to the model's directory. A location that leaves that
    directory (an absolute path, ``..``, a symlink pointing out) is refused: a model file must not
    make gradgen read arbitrary files. A missing file or one too short for the tensor is an error
    naming the tensor and the file.
    """
    base = path.resolve().parent
    for tensor in external_data_helper._get_all_tensors(proto):
        if not external_data_helper.uses_external_data(tensor):
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        location = info.get("location", "")
        where = f"{path}: tensor {tensor.name!r} keeps its data in {location!r}"
        target = (base / location).resolve()
        if not location or Path(location).is_absolute() or not target.is_relative_to(base):
            raise ModelError(
                f"{where}, which is not inside the model's directory {base}; external data must be a relative path below it"
            )
        if not target.is_file():
            raise ModelError(f"{where}, which is not a file next to the model (external data is looked up relative to {base})")
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else _tensor_nbytes(tensor)
        except ValueError:
            raise ModelError(f"{where}, with a malformed offset or length ({info})") from None
        size = target.stat().st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise ModelError(
                f"{where}, which cannot be read: bytes {offset} to {offset + length} are wanted but the file holds {size}"
            )


def proto_subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs a NodeProto's attributes hold (an If's branches, a Loop's body)."""
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            yield attribute.g
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            yield from attribute.graphs


def _proto_node_label(node: onnx.NodeProto, index: int) -> str:
    """As ``_node_label``, before the model is loaded (an unnamed node by op type and position)."""
    return f"node {node.name or f'{node.op_type}_{index}'!r} ({node.op_type})"


def _check_names(graph: onnx.GraphProto, where: str) -> None:
    """Each name of a graph (and of its subgraphs) has one source: an initializer is declared once,
    and a value computed by a node is computed by no other node and is no graph input or initializer.
    onnx-ir refuses such a graph with an error that names neither; this walk of the proto (about
    3 us a node) runs only then, to say which (``_from_proto``)."""
    initializers = [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]
    seen: set[str] = set()
    for name in initializers:
        if name in seen:
            raise ModelError(f"{where}: initializer {name!r} is declared more than once")
        seen.add(name)
    sources = {value.name: "a graph input" for value in graph.input}
    sources.update({name: "an initializer" for name in initializers})
    for index, node in enumerate(graph.node):
        label = _proto_node_label(node, index)
        for name in node.output:
            if not name:
                continue
            if name in sources:
                raise ModelError(
                    f"{where}: {label} computes {name!r}, which is already {sources[name]}; every value has one source"
                )
            sources[name] = f"computed by {label}"
        for subgraph in proto_subgraphs(node):
            _check_names(subgraph, where)


def default_opset(model: ir.Model | ir.Graph, missing: int = 0) -> int:
    """The opset of the default domain ("" or "ai.onnx") a model or graph imports; ``missing``
    where it imports none."""
    imports = model.opset_imports
    return imports.get("", imports.get("ai.onnx", missing))


def _checked(model: ir.Model, where: str) -> ir.Model:
    """``model`` once its graphs' names and inline tensors are consistent (``_check_graph``)."""
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:  # no schema to check its nodes against, nothing to convert it to
        raise ModelError(
            f"{where}: the model imports opset {opset} of the default domain (ai.onnx); the highest opset "
            f"the installed onnx {onnx.__version__} supports is {newest}"
        )
    _check_graph(model.graph, where, opset, frozenset())
    return model


def _check_graph(graph: ir.Graph, where: str, opset: int, outer: frozenset) -> None:
    """A graph's names must tie each value to one source (graph inputs named once, every node input
    and graph output computed by a node or coming from a graph input or initializer, its own or an
    enclosing graph's), nodes' attributes must be ones their ONNX op has, and tensors kept in the
    model must hold their data. onnx-ir already refuses a value computed by two nodes."""
    names = [str(value.name) for value in graph.inputs]
    if len(set(names)) != len(names):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise ModelError(f"{where}: graph input {twice[0]!r} is declared more than once")
    for graph_input in graph.inputs:
        if graph_input.shape is not None and any(isinstance(d, int) and d < 0 for d in graph_input.shape):
            raise ModelError(
                f"{where}: graph input {graph_input.name!r} declares a negative dimension ({list(graph_input.shape)})"
            )
    sources = outer | set(graph.inputs) | set(graph.initializers.values())
    for initializer in graph.initializers.values():
        _check_tensor(initializer.const_value, where)
    placed: set[ir.Node] = set()  # the nodes before this one: a graph in order needs no search for cycles
    in_order = True
    for node in graph:
        for value in node.inputs:
            if value is None:
                continue
            producer = value.producer()
            if producer is None:
                if value not in sources:
                    raise ModelError(
                        f"{where}: {_node_label(node)} reads {value.name!r}, which no node, graph input or initializer provides"
                    )
            elif producer not in placed:
                in_order = False
        _check_node(node, where, opset, sources)
        placed.add(node)
    for value in graph.outputs:
        if value.producer() is None and value not in sources:
            raise ModelError(f"{where}: graph output {value.name!r} is computed by no node and is no graph input or initializer")
    if not in_order:
        _check_acyclic(graph, where)


def _check_acyclic(graph: ir.Graph, where: str) -> None:
    """The nodes of ``graph`` must not depend on themselves through their inputs (in any order:
    gradgen sorts them). A cycle is named by its nodes, in the order the data flows."""
    nodes = list(graph)
    members = set(nodes)
    waiting: dict[ir.Node, int] = {}
    readers: dict[ir.Node, list[ir.Node]] = {}
    for node in nodes:
        producers = {p for p in (v.producer() for v in node.inputs if v is not None) if p in members}
        waiting[node] = len(producers)
        for producer in producers:
            readers.setdefault(producer, []).append(node)
    ready = [node for node in nodes if not waiting[node]]
    while ready:
        for reader in readers.get(ready.pop(), ()):
            waiting[reader] -= 1
            if not waiting[reader]:
                ready.append(reader)
    stuck = [node for node in nodes if waiting[node]]
    if not stuck:
        return
    # Every stuck node reads a stuck node: walk back from one until a node repeats.
    path: list[ir.Node] = []
    node = stuck[0]
    while node not in path:
        path.append(node)
        node = next(p for p in (v.producer() for v in node.inputs if v is not None) if p in members and waiting[p])
    cycle = path[path.index(node) :][::-1]
    labels = node_names(nodes)
    names = [f"{labels[n]!r} ({n.op_type})" for n in cycle]
    shown = " -> ".join(names[:6] + (["..."] if len(names) > 6 else []) + names[:1])
    raise ModelError(f"{where}: the graph has a cycle: node {shown}; a node cannot depend on its own output")


def _node_label(node: ir.Node) -> str:
    """``node 'mm' (MatMul)``; an unnamed node by the name build-backward gives it (``node_name``)."""
    return f"node {node_name(node)!r} ({node.op_type})"


@functools.lru_cache(maxsize=1024)
def _schema_rules(op_type: str, opset: int) -> tuple[dict[str, int], frozenset, tuple[int, int]] | None:
    """({attribute: its type (AttributeProto's enum)}, the required ones, (fewest, most) inputs)
    that ONNX's schema of ``op_type`` at ``opset`` declares, or None for an op ONNX does not
    define there."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except Exception:  # noqa: BLE001 -- SchemaError: not an ONNX op at that opset
        return None
    # AttrType is an enum of AttributeProto's values (onnx's stubs do not say so)
    types = {name: int(attribute.type.value) for name, attribute in schema.attributes.items()}  # type: ignore[attr-defined]
    required = frozenset(name for name, attribute in schema.attributes.items() if attribute.required)
    return types, required, (schema.min_input, schema.max_input)


def _check_node(node: ir.Node, where: str, opset: int, sources: frozenset) -> None:
    """The node's tensors and subgraphs (checked in turn), and against ONNX's schema of its op: its
    number of inputs and its attributes' names and types, the required ones present."""
    for attribute in node.attributes.values():
        if attribute.type == ir.AttributeType.TENSOR:
            _check_tensor(attribute.value, where)
        elif attribute.type == ir.AttributeType.GRAPH:
            _check_graph(attribute.value, where, opset, sources)
        elif attribute.type == ir.AttributeType.GRAPHS:
            for subgraph in attribute.value:
                _check_graph(subgraph, where, opset, sources)
    schema = _schema_rules(node.op_type, opset) if node.domain in ("", "ai.onnx") and opset >= 1 else None
    if schema is None:
        return
    types, required, (fewest, most) = schema
    given = len(node.inputs)
    if not fewest <= given <= most:
        wanted = f"{fewest}" if fewest == most else f"{fewest} to {most}" if most < 2**31 - 1 else f"at least {fewest}"
        raise ModelError(f"{where}: {_node_label(node)} has {given} inputs, where {node.op_type} takes {wanted}")
    for name, attribute in node.attributes.items():
        if name not in types:
            raise ModelError(f"{where}: {_node_label(node)} has an attribute {name!r}, which {node.op_type} does not have")
        if types[name] != _UNDEFINED_ATTRIBUTE and int(attribute.type) != types[name]:
            raise ModelError(
                f"{where}: {_node_label(node)}: attribute {name!r} is {attribute.type.name.lower()}, "
                f"where {node.op_type} takes {onnx.AttributeProto.AttributeType.Name(types[name]).lower()}"
            )
    missing = sorted(required - set(node.attributes))
    if missing:
        raise ModelError(f"{where}: {_node_label(node)} lacks the attribute {missing[0]!r}, which {node.op_type} requires")


_UNDEFINED_ATTRIBUTE = int(onnx.AttributeProto.UNDEFINED)  # a schema attribute of any type


def _check_tensor(tensor, where: str) -> None:
    """A tensor read from the model's own bytes must have a known element type, no negative
    dimension, and as many elements as its dims say: one without its data read as zeros, which
    gave a silently wrong loss. (External data is checked by ``_check_external_data``.)"""
    proto = getattr(tensor, "raw", None)
    if not isinstance(proto, onnx.TensorProto) or external_data_helper.uses_external_data(proto):
        return
    problem = _inline_tensor_problem(proto)
    if problem:
        raise ModelError(f"{where}: tensor {proto.name!r} (dims {list(proto.dims)}) {problem}")


_DATA_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}


def _inline_tensor_problem(tensor: onnx.TensorProto) -> str | None:
    """What is wrong with an inline tensor's type, dims or amount of data, or None."""
    if tensor.data_type not in _DATA_TYPES:
        return f"has no valid element type (data_type {tensor.data_type})"
    if any(d < 0 for d in tensor.dims):
        return "has a negative dimension"
    if tensor.data_type == onnx.TensorProto.STRING:
        held = len(tensor.string_data)
        return None if held == math.prod(tensor.dims) else f"holds {held} strings for {math.prod(tensor.dims)} elements"
    if tensor.HasField("raw_data"):
        held, wanted = len(tensor.raw_data), _tensor_nbytes(tensor)
        return None if held == wanted else f"holds {held} bytes of data where its dims need {wanted}"
    try:  # data in the typed fields (small tensors): numpy_helper checks the count as it reshapes
        numpy_helper.to_array(tensor)
    except Exception as exc:  # noqa: BLE001 -- ValueError on a short field; others on odd types
        return f"holds data that does not fill its dims ({type(exc).__name__}: {exc})"
    return None


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    return (math.prod(tensor.dims) * _bitwidth(tensor.data_type) + 7) // 8


@functools.lru_cache(maxsize=64)
def _bitwidth(data_type: int) -> int:
    return ir.DataType(data_type).bitwidth


def _load_external_attribute_tensors(model: ir.Model) -> None:
    """Read external tensors held in node attributes (rare, small) into memory, as saving inline needs."""
    for graph in model.graphs():
        for node in graph:
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.TENSOR and isinstance(attr.value, ir.ExternalTensor):
                    node.attributes[attr.name] = ir.AttrTensor(attr.name, ir.Tensor(attr.value.numpy(), name=attr.value.name))


def _from_proto(proto: onnx.ModelProto, where: str) -> ir.Model:
    # onnx-ir logs a warning per node input that no value provides; ``_check_graph`` names the
    # first such input in the one-line error, so the log would only add lines before it.
    serde_log = logging.getLogger("onnx_ir.serde")
    level = serde_log.level
    serde_log.setLevel(logging.ERROR)
    try:
        model = ir.from_proto(proto)
    except Exception as exc:
        _check_names(proto.graph, where)  # names the value with two sources, where that is the fault
        while exc.__cause__ is not None:  # SerdeError wraps what went wrong
            exc = exc.__cause__  # type: ignore[assignment]
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(f"{where}: malformed ONNX model ({type(exc).__name__}: {first})") from None
    finally:
        serde_log.setLevel(level)
    if len(model.graph.initializers) != len(proto.graph.initializer) + len(proto.graph.sparse_initializer):
        _check_names(proto.graph, where)  # onnx-ir kept the last of an initializer declared twice
    return model


def check_output_path(out: str | os.PathLike, *inputs: str | os.PathLike) -> Path:
    """Refuse an output path that is one of the inputs or that cannot be written, before any work.

    ``inputs``: the model first, then any other file the command reads (inputs, reference, data,
    checkpoint), which the error names."""
    if os.fspath(out) in ("", "."):  # Path("") is "."; neither names a file
        raise UsageError("an empty output path (or '.') names the current directory, not a file; give a file name for the output")
    out_path = Path(out)
    for position, source in enumerate(inputs):
        source_path = Path(source)
        if out_path.resolve() == source_path.resolve() or (
            out_path.exists() and source_path.exists() and os.path.samefile(out_path, source_path)
        ):
            what = "the input model" if position == 0 else f"the input file {source_path}"
            raise UsageError(f"{out_path}: the output must not be {what}; choose another path")
    parent = out_path.resolve().parent
    if not parent.exists():
        raise UsageError(f"{out_path}: output directory {parent} does not exist")
    if not parent.is_dir():
        raise UsageError(f"{out_path}: {parent} is not a directory")
    if out_path.is_dir():
        raise UsageError(f"{out_path}: is a directory; give a file name for the output")
    if out_path.exists() and not out_path.is_file():  # the output replaces the path by a rename
        raise UsageError(f"{out_path}: is not a regular file (a device, pipe or socket); give a file name for the output")
    try:  # a read-only directory, /proc, a full disk: say so now, not after the work
        fd, probe = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise output_error(out_path, exc) from exc
    return out_path


def output_error(path: str | os.PathLike, exc: OSError) -> UsageError:
    """The one-line error for an OS error while writing ``path`` (or a temporary file beside it)."""
    return UsageError(f"{path}: cannot write the output: {exc.strerror or exc}")


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary file beside ``path``, renamed to ``path`` when the block succeeds, removed otherwise.

    The file is created with mode 0666 less the umask, as ``open`` would. Any exception, including
    KeyboardInterrupt and the CLI's SIGTERM / SIGHUP exception, removes it; an OS error becomes a
    one-line UsageError.
    """
    path = Path(path)
    parent = Path(os.path.abspath(path)).parent  # beside the name given, even if it is a symlink
    try:
        while True:
            tmp = parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
            try:
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                break
            except FileExistsError:
                continue
    except OSError as exc:
        raise output_error(path, exc) from exc
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise output_error(path, exc) from exc
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def save_model(model: ir.Model | onnx.ModelProto, out: str | os.PathLike) -> Path:
    """Write a model atomically: into a temporary directory beside ``out``, then rename.

    On failure nothing is left behind (an existing ``out`` is unchanged); an OS error is a one-line
    UsageError. Models whose tensors pass ``_EXTERNAL_DATA_THRESHOLD`` bytes in all (too large for
    one protobuf) get their initializers as external data in ``<out name>.data`` next to ``out``: the
    data file is renamed into place first, the model last.
    """
    out_path = Path(out)
    try:
        return _save_model(model, out_path)
    except OSError as exc:
        raise output_error(out_path, exc) from exc


def _save_model(model: ir.Model | onnx.ModelProto, out_path: Path) -> Path:
    if isinstance(model, onnx.ModelProto):
        model = _from_proto(model, "<in-memory model>")
    data_name = out_path.name + ".data"
    external = _initializer_bytes(model) > _EXTERNAL_DATA_THRESHOLD
    parent = out_path.resolve().parent
    if external:
        _refuse_overwriting_sources(model, parent / data_name)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=parent))
    try:
        tmp_model = tmp_dir / out_path.name
        if external:
            ir.save(model, tmp_model, format="protobuf", external_data=data_name, size_threshold_bytes=_EXTERNAL_TENSOR_MIN_BYTES)
        else:
            with external_tensors_inline(model):
                ir.save(model, tmp_model, format="protobuf")
        if not (tmp_dir / data_name).exists():
            os.replace(tmp_model, out_path)
            return out_path
        # Two renames: keep the previous data file until the model is in place, restore it if not.
        data_path, backup = parent / data_name, tmp_dir / (data_name + ".old")
        had_data = data_path.exists()
        if had_data:
            os.replace(data_path, backup)
        try:
            os.replace(tmp_dir / data_name, data_path)
            os.replace(tmp_model, out_path)
        except BaseException:
            if had_data:
                os.replace(backup, data_path)
            elif data_path.exists():
                data_path.unlink()
            raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_path


@contextlib.contextmanager
def external_tensors_inline(model: ir.Model) -> Iterator[None]:
    """For the duration of the block, initializers read from external data are plain tensors.

    ``ir.save`` without external data keeps an external tensor's reference to its file (here: the
    input model's data file, by a path relative to the input); a saved model must hold its data.
    The tensors wrap the memory-mapped arrays, so nothing is copied before serialisation.
    """
    swapped = []
    for graph in model.graphs():
        for value in graph.initializers.values():
            if isinstance(value.const_value, ir.ExternalTensor):
                swapped.append((value, value.const_value))
                value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
    try:
        yield
    finally:
        for value, tensor in swapped:
            value.const_value = tensor


def _refuse_overwriting_sources(model: ir.Model, data_path: Path) -> None:
    """The external data file about to be replaced must not be one the model still reads from."""
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) and Path(tensor.path).resolve() == data_path.resolve():
                raise UsageError(
                    f"{data_path}: writing it would overwrite the external data that tensor "
                    f"{value.name!r} of the input model is read from; choose another output name"
                )


def _initializer_bytes(model: ir.Model) -> int:
    """Bytes held by the model's initializers (subgraphs included)."""
    total = 0
    for graph in (model.graph, *model.graph.subgraphs()):
        for value in graph.initializers.values():
            if value.const_value is not None:
                total += value.const_value.nbytes
    return total
