"""The CUDA executor's head copies: Split -> Reshape -> Transpose and Transpose -> Reshape -> Concat
as one strided copy per tensor.

An attention block exports its heads as a Split of the fused QKV projection, a Reshape to (B, T,
heads, head size) and a Transpose to (B, heads, T, head size) per tensor; its gradient is the
mirror image, three Transposes back, Reshapes and a Concat. Each Split and Concat is a copy of its
own although the Transposes copy the same bytes anyway. ``fuse_head_copies`` replaces such a chain
by one step whose launcher reads each head tensor straight from the QKV buffer (the Split's slice,
viewed through the Reshape) or writes it straight into its place in the Concat's output: one pass
over the data instead of two, and the same bytes (copies do no arithmetic).

The rewrite needs each intermediate to be read by the next op only (and not to be a graph output),
and the Reshape targets to be made before the chain starts; at run time a Reshape that is not a view
of the slice (it never is for these shapes) makes the launcher copy the slice first, so any shape
still gives the unfused result. ``GRADGEN_CUDA_FUSION=0`` turns it off with the other fusions.
"""

from __future__ import annotations

import math

import numpy as np

from gradgen.executor.fusion import executor_step, value_readers

SPLIT = "SplitReshapeTranspose"
CONCAT = "TransposeReshapeConcat"


def reshaped_strides(shape, strides, new_shape) -> list[int] | None:
    """The element strides that view an array of ``shape`` / ``strides`` as ``new_shape`` without a
    copy, or None where no such view exists (numpy's rule: each group of axes that is merged or split
    must be contiguous within itself)."""
    shape, new_shape = [int(d) for d in shape], [int(d) for d in new_shape]
    if math.prod(shape) != math.prod(new_shape) or math.prod(shape) == 0:
        return None
    old = [(d, int(s)) for d, s in zip(shape, strides) if d != 1]
    new_strides = [0] * len(new_shape)
    kept = [k for k, d in enumerate(new_shape) if d != 1]
    oi = ni = 0
    while ni < len(kept) and oi < len(old):
        nj, oj = ni + 1, oi + 1
        n_size, o_size = new_shape[kept[ni]], old[oi][0]
        while n_size != o_size:
            if n_size < o_size:
                n_size *= new_shape[kept[nj]]
                nj += 1
            else:
                o_size *= old[oj][0]
                oj += 1
        if any(old[k][1] != old[k + 1][0] * old[k + 1][1] for k in range(oi, oj - 1)):
            return None
        stride = old[oj - 1][1]
        for k in reversed(range(ni, nj)):
            new_strides[kept[k]] = stride
            stride *= new_shape[kept[k]]
        ni, oi = nj, oj
    return new_strides


def fuse_head_copies(steps: list, keep: set[str]) -> list:
    """``steps`` with each Split -> Reshape -> Transpose fan-out and each Transpose -> Reshape ->
    Concat fan-in (see the module docstring) as one step."""
    readers = value_readers(steps)
    producer = {name: i for i, step in enumerate(steps) for name in step.outputs if name}

    def only_reader(name: str, op_type: str) -> int | None:
        """The one step that reads ``name`` if it is an ``op_type`` (reading it as its data input,
        input 0, unless it is a Concat) and ``name`` is not kept; else None."""
        found = readers.get(name, [])
        if name in keep or len(found) != 1 or steps[found[0]].domain or steps[found[0]].op_type != op_type:
            return None
        return found[0] if op_type == "Concat" or steps[found[0]].inputs[0] == name else None

    replaced: dict[int, object] = {}
    dropped: set[int] = set()
    for i, step in enumerate(steps):
        if step.domain or i in dropped or i in replaced:
            continue
        if step.op_type == "Split" and len(step.outputs) > 1 and all(step.outputs):
            chain = _split_chain(steps, i, only_reader, producer)
            if chain is not None:
                reshapes, transposes = chain
                replaced[i] = _split_step(step, [steps[r] for r in reshapes], [steps[t] for t in transposes])
                dropped.update(reshapes + transposes)
        elif step.op_type == "Concat" and len(step.inputs) > 1:
            chain = _concat_chain(steps, i, only_reader, producer)
            if chain is not None:
                reshapes, transposes = chain
                replaced[i] = _concat_step(step, [steps[r] for r in reshapes], [steps[t] for t in transposes])
                dropped.update(reshapes + transposes)
    return [replaced.get(i, s) for i, s in enumerate(steps) if i not in dropped]


def _split_chain(steps, i, only_reader, producer):
    """(Reshape positions, Transpose positions) of a Split at ``i`` whose every output goes through
    a Reshape into a Transpose, each read by the next only; None otherwise."""
    reshapes, transposes = [], []
    for name in steps[i].outputs:
        r = only_reader(name, "Reshape")
        if r is None or len(steps[r].inputs) < 2 or producer.get(steps[r].inputs[1], -1) >= i:
            return None
        t = only_reader(steps[r].outputs[0], "Transpose")
        if t is None:
            return None
        reshapes.append(r)
        transposes.append(t)
    return reshapes, transposes


def _concat_chain(steps, i, only_reader, producer):
    """(Reshape positions, Transpose positions) of a Concat at ``i`` each of whose inputs is a
    Reshape of a Transpose, each read by the next only; None otherwise."""
    reshapes, transposes = [], []
    for name in steps[i].inputs:
        r = producer.get(name) if name else None
        if r is None or steps[r].domain or steps[r].op_type != "Reshape" or only_reader(name, "Concat") != i:
            return None
        t = producer.get(steps[r].inputs[0])
        if t is None or steps[t].domain or steps[t].op_type != "Transpose" or only_reader(steps[t].outputs[0], "Reshape") != r:
            return None
        reshapes.append(r)
        transposes.append(t)
    return reshapes, transposes


def _split_step(split, reshapes, transposes):
    count = len(split.outputs)
    has_split_input = len(split.inputs) > 1 and bool(split.inputs[1])
    attributes = {k: v for k, v in split.attributes.items() if k not in ("_num_outputs", "split")}
    split_attribute = split.attributes.get("split")  # before opset 13 the sizes are an attribute

    def run_on_device(x, *rest):
        split_sizes = rest[0] if has_split_input else split_attribute
        targets = rest[1 if has_split_input else 0 :]
        return split_reshape_transpose(
            x,
            split_sizes,
            targets,
            [r.attributes for r in reshapes],
            [t.attributes.get("perm") for t in transposes],
            count=count,
            **attributes,
        )

    inputs = [split.inputs[0], *([split.inputs[1]] if has_split_input else []), *(r.inputs[1] for r in reshapes)]
    return executor_step(
        f"{split.node_name} (+ {count} reshapes and transposes)",
        SPLIT,
        run_on_device,
        inputs,
        [t.outputs[0] for t in transposes],
        [(t.output_dtypes or [None])[0] for t in transposes],
        cuda_host_inputs=frozenset(range(1, len(inputs))),
    )


def _concat_step(concat, reshapes, transposes):
    count = len(concat.inputs)
    axis = int(concat.attributes.get("axis", 0))

    def run_on_device(*args):
        return transpose_reshape_concat(
            list(args[:count]),
            [t.attributes.get("perm") for t in transposes],
            list(args[count:]),
            [r.attributes for r in reshapes],
            axis,
        )

    return executor_step(
        f"{concat.node_name} (+ {count} transposes and reshapes)",
        CONCAT,
        run_on_device,
        [*(t.inputs[0] for t in transposes), *(r.inputs[1] for r in reshapes)],
        concat.outputs,
        concat.output_dtypes,
        cuda_host_inputs=frozenset(range(count, 2 * count)),
    )


# -- launchers ---------------------------------------------------------------------------------------


def _target(shape, dims, attributes) -> list[int]:
    from gradgen.ops.shape import reshape_dims

    return [
        int(d)
        for d in reshape_dims(
            tuple(int(d) for d in shape), tuple(int(d) for d in np.asarray(dims).reshape(-1)), int(attributes.get("allowzero", 0))
        )
    ]


def split_reshape_transpose(x, split_sizes, targets, reshape_attributes, perms, *, count, axis=0, num_outputs=None):
    """Split ``x`` (the Split's inputs and attributes), Reshape each part to its target and Transpose
    it by its perm, reading each result straight from ``x``."""
    from gradgen.kernels.cpu import shape as cpu_shape
    from gradgen.kernels.cuda.launch import contiguous, copy_into, element_strides, runtime
    from gradgen.ops.axes import normalize_axis

    rt = runtime()
    x = contiguous(x)
    ax = normalize_axis(axis, len(x.shape))
    sizes = cpu_shape.split_sizes(int(x.shape[ax]), ax, split_sizes, num_outputs, count)
    strides = element_strides(x)
    outs, offset = [], 0
    for size, dims, attrs, perm in zip(sizes, targets, reshape_attributes, perms):
        part_shape = [int(d) for d in x.shape]
        part_shape[ax] = size
        target = _target(part_shape, dims, attrs)
        view = reshaped_strides(part_shape, strides, target)
        source, source_strides, source_offset = x, view, offset * strides[ax]
        if view is None:  # not a view of the slice: copy the slice first
            source = rt.empty(part_shape, x.dtype)
            copy_into(source, x, part_shape, strides, offset * strides[ax])
            source_strides, source_offset = list(rt.contiguous_strides(target)), 0
        order = list(range(len(target)))[::-1] if perm is None else [int(p) for p in perm]
        out_shape = [target[p] for p in order]
        out = rt.empty(out_shape, x.dtype)
        if out.size:
            copy_into(out, source, out_shape, [source_strides[p] for p in order], source_offset)
        outs.append(out)
        offset += size
    return tuple(outs)


def transpose_reshape_concat(ys, perms, targets, reshape_attributes, axis: int):
    """Concat (along ``axis``) of Reshape(Transpose(y, perm), target) for each y, each transposed
    copy written straight into its place in the output."""
    from gradgen.errors import KernelError
    from gradgen.kernels.cuda.launch import contiguous, copy_into, element_strides, runtime, strided_copy
    from gradgen.ops.axes import normalize_axis

    rt = runtime()
    ys = [contiguous(y) for y in ys]
    if len({y.dtype for y in ys}) > 1:
        raise KernelError(f"Concat inputs have different dtypes ({', '.join(str(y.dtype) for y in ys)})")
    parts = []
    for y, perm, dims, attrs in zip(ys, perms, targets, reshape_attributes):
        order = list(range(len(y.shape)))[::-1] if perm is None else [int(p) for p in perm]
        t_shape = [int(y.shape[p]) for p in order]
        parts.append((y, order, t_shape, _target(t_shape, dims, attrs)))
    rank = len(parts[0][3])
    ax = normalize_axis(axis, rank)
    out_shape = list(parts[0][3])
    out_shape[ax] = sum(p[3][ax] for p in parts)
    if any(len(p[3]) != rank or any(p[3][k] != out_shape[k] for k in range(rank) if k != ax) for p in parts):
        raise KernelError(f"Concat inputs of shapes {[p[3] for p in parts]} do not match along the axes other than {ax}")
    out = rt.empty(out_shape, ys[0].dtype)
    out_strides = list(rt.contiguous_strides(out_shape))
    offset = 0
    for y, order, t_shape, target in parts:
        y_strides = element_strides(y)
        into = reshaped_strides(target, out_strides, t_shape)
        if into is None:  # the transposed tensor is not a view of its place: transpose, then copy in
            t = rt.empty(t_shape, y.dtype)
            copy_into(t, y, t_shape, [y_strides[p] for p in order])
            strided_copy(out, out_strides, offset * out_strides[ax], t, list(rt.contiguous_strides(target)), 0, target)
        elif math.prod(t_shape):
            strided_copy(out, into, offset * out_strides[ax], y, [y_strides[p] for p in order], 0, t_shape)
        offset += target[ax]
    return out
