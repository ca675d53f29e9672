"""DecomposePass: rewrite ops whose gradient is easiest had through their standard-op form, before
the gradient pass, so that the rules of those ops differentiate them (every input, every mode)
and both executors run them with the kernels they have. Today: GridSample, RoiAlign with a fixed
sampling_ratio (its gradient reaches X and the rois; torchvision gives the rois none), and STFT
(frames gathered, windowed, then DFT, which has a rule).

GridSample becomes, per tap offset combination (2 per axis for linear, 4 for cubic, 1 for nearest),
a GatherElements of X (N, C, prod(spatial)) at the taps' flat indices times the taps' weights, so
its gradient reaches X (GatherElementsGrad) and the grid (through the weights: the interpolation
polynomials of x - floor(x), and the border / reflection mapping of the coordinates), as PyTorch's
grid_sampler backward computes it. The sampling rule is gradgen.ops.grid_sample's, as in the CPU
kernel (tests compare the two).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from gradgen.builder import GraphBuilder, dims_of, is_static, numpy_dtype_of
from gradgen.errors import KernelError, ModelError
from gradgen.ops.attributes import node_attributes
from gradgen.ops.conv import deform_conv_geometry, deform_conv_positions
from gradgen.ops.grid_sample import TAP_OFFSETS, GridSampleSpec, cubic_weights, grid_sample_spec
from gradgen.ops.pool import roi_align_spec
from gradgen.ops.schemas import LOWERED_FORWARD_OPS, normalize_domain
from gradgen.passes.rewrite import STANDARD_DOMAINS, float_constant, rewrite_nodes

__all__ = ["DecomposePass"]

_FLOATS = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


class DecomposePass(ir.passes.InPlacePass):
    """Replace every float node of the main graph that has a standard-op form here (GridSample;
    RoiAlign with a fixed sampling_ratio; STFT and DeformConv with static frames / shapes) by that
    form (in place); shape inference runs after each round of rewrites."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        from gradgen.passes.standard import ShapeInferencePass

        modified = False
        if any((normalize_domain(n.domain), n.op_type) in LOWERED_FORWARD_OPS for n in model.graph):
            ShapeInferencePass()(model)  # the lowered forms read their inputs' types and ranks
        # rounds: a form may hold another rewritable op (DeformConv's GridSample), typed by the
        # shape inference that ends each round
        for _ in range(3 + sum(1 for n in model.graph if (normalize_domain(n.domain), n.op_type) in LOWERED_FORWARD_OPS)):
            nodes = [
                n
                for n in model.graph
                if (n.domain in STANDARD_DOMAINS and n.op_type in _FORMS and _FORMS[n.op_type].applies(n))
                or ((normalize_domain(n.domain), n.op_type) in LOWERED_FORWARD_OPS and _typed_input(n))
            ]
            if not rewrite_nodes(model, nodes, _build_form):
                break
            modified = True
        return ir.passes.PassResult(model, modified=modified)


def _build_form(node: ir.Node, builder: GraphBuilder) -> Sequence[ir.Value | None]:
    if (normalize_domain(node.domain), node.op_type) in LOWERED_FORWARD_OPS:
        return _lowered_form(node, builder)
    return [_FORMS[node.op_type](node, builder).output()]


def _typed_input(node: ir.Node) -> bool:
    """Whether the node's first input has a known type and rank (a lowered form in a chain waits
    for the shape inference that ends the round which rewrote its producer)."""
    first = node.inputs[0] if node.inputs else None
    return first is not None and first.dtype is not None and dims_of(first) is not None


def _lowered_form(node: ir.Node, b: GraphBuilder) -> list[ir.Value | None]:
    """The node's lowering, its float constants made Constant nodes (float_constant's reason)."""
    from gradgen.passes.lowering import lookup_lowering

    lowering = lookup_lowering(node.domain, node.op_type)
    assert lowering is not None  # every op of LOWERED_FORWARD_OPS has one (tests/test_transformer_ops.py)
    first = node.inputs[0] if node.inputs else None
    for k in (0, 3):  # Y and SkipLayerNormalization's sum take the input's type; a form in a chain reads it
        if k < len(node.outputs) and node.outputs[k].type is None and first is not None:
            node.outputs[k].type, node.outputs[k].shape = first.type, first.shape
    before = set(b.graph.initializers)
    outputs = list(lowering.fn(b, node))
    cache = b._constants  # the builders' shared constant cache: a converted value leaves it
    for name in [n for n in b.graph.initializers if n not in before]:
        value = b.graph.initializers[name]
        if value.dtype not in _FLOATS or value.const_value is None:
            continue
        constant = b.op("Constant", value=ir.tensor(value.const_value.numpy()))
        b.nodes.insert(0, b.nodes.pop())  # before its users
        ir.convenience.replace_all_uses_with(value, constant)
        del b.graph.initializers[name]
        for key in [k for k, v in cache.items() if v is value]:
            del cache[key]
    return outputs


class _Emitted:
    """An emitted float value with + - * (python floats become constants of its type), so that
    formulas written for numpy arrays (gradgen.ops.grid_sample.cubic_weights) emit nodes."""

    def __init__(self, b: GraphBuilder, value: ir.Value, dtype: np.dtype, floats: dict):
        self.b, self.value, self.dtype, self.floats = b, value, dtype, floats

    def _lift(self, other) -> ir.Value:
        if isinstance(other, _Emitted):
            return other.value
        if isinstance(other, ir.Value):
            return other
        return float_constant(self.b, np.array(other, dtype=self.dtype), self.floats)

    def _new(self, op: str, a, b) -> _Emitted:
        return _Emitted(self.b, self.b.op(op, self._lift(a), self._lift(b)), self.dtype, self.floats)

    def __add__(self, other):
        return self._new("Add", self, other)

    __radd__ = __add__

    def __sub__(self, other):
        return self._new("Sub", self, other)

    def __rsub__(self, other):
        return self._new("Sub", other, self)

    def __mul__(self, other):
        return self._new("Mul", self, other)

    __rmul__ = __mul__


class _Rewrite:
    """One node's standard-op form: ``applies(node)`` says whether the pass rewrites it, ``output()``
    emits the form through the builder and returns the value that replaces the node's output."""

    def __init__(self, node: ir.Node, b: GraphBuilder):
        self.node, self.b = node, b
        self.floats: dict = {}  # float constants made, by value (float_constant)

    @staticmethod
    def applies(node: ir.Node) -> bool:
        return bool(node.inputs) and node.inputs[0] is not None and node.inputs[0].dtype in _FLOATS

    def output(self) -> ir.Value:
        raise NotImplementedError


class _Form(_Rewrite):
    """What the sampling forms share: X (N, C, *spatial) and its sizes, static where known, and
    float values of ``self.grid``'s type (the coordinates' tensor: GridSample's grid, RoiAlign's
    rois)."""

    op_type = ""

    def __init__(self, node: ir.Node, b: GraphBuilder):
        super().__init__(node, b)
        self.where = f"node {node.name!r} ({self.op_type})"
        x, grid = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if x is None or grid is None:
            raise ModelError(f"{self.where}: its first two inputs are required")
        self.x, self.grid = x, grid
        x_dims = dims_of(x)
        if x_dims is None or len(x_dims) < 3:
            raise ModelError(f"{self.where}: its standard-op form (for the gradient) needs the rank of X; it is not known")
        self.nd = len(x_dims) - 2
        self.spatial = x_dims[2:]
        self.dtype = numpy_dtype_of(self.grid)

    # -- sizes, static where known --------------------------------------------------------------
    def _size_int(self, axis: int) -> ir.Value:
        """Spatial axis ``axis`` of X as a rank-0 int64 value."""
        size = self.spatial[axis]
        if isinstance(size, int):
            return self.b.const(np.array(size, dtype=np.int64))
        return self.b.op("Gather", self.b.shape_of(self.x), self.b.scalar(2 + axis), axis=0)

    def _size(self, axis: int, offset: float = 0.0):
        """That size plus ``offset`` in the grid's type: a python float when static, else emitted."""
        size = self.spatial[axis]
        if isinstance(size, int):
            return float(size) + offset
        as_float = self._wrap(self.b.op("CastLike", self._size_int(axis), self.grid))
        return as_float + offset if offset else as_float

    def _value(self, v) -> ir.Value:
        return v.value if isinstance(v, _Emitted) else float_constant(self.b, np.array(v, dtype=self.dtype), self.floats)

    def _wrap(self, value: ir.Value) -> _Emitted:
        return _Emitted(self.b, value, self.dtype, self.floats)

    def _gather_taps(self, planes: ir.Value, flat: ir.Value) -> ir.Value:
        """planes (B, C, S) at the flat indices ``flat`` (B, 1, P), for every channel: (B, C, P)."""
        b = self.b
        channels = b.op("Concat", b.ints([1]), b.part(b.shape_of(self.x), 1, 2), b.ints([1]), axis=0)
        return b.op("GatherElements", planes, b.op("Expand", flat, channels), axis=2)


class _GridSample(_Form):
    """The standard-op form of one GridSample node (see the module docstring)."""

    op_type = "GridSample"

    def __init__(self, node: ir.Node, b: GraphBuilder):
        super().__init__(node, b)
        try:
            self.spec: GridSampleSpec = grid_sample_spec(**node_attributes(node))
        except KernelError as exc:
            raise ModelError(f"{self.where}: {exc}") from None

    # -- coordinates --------------------------------------------------------------------------------
    def _pixel(self, axis: int) -> _Emitted:
        """Grid coordinate of spatial axis ``axis`` in pixels, (N, 1, P), after the padding mode's
        mapping of coordinates outside [lo, hi]."""
        b = self.b
        by_point = b.reshape(self.grid, [0, 1, -1, self.nd])
        normalized = self._wrap(b.op("Gather", by_point, b.scalar(self.nd - 1 - axis), axis=3)) + 1.0
        if self.spec.align_corners:
            pixel = normalized * (self._size(axis, -1.0) * 0.5)
        else:
            pixel = (normalized * self._size(axis) - 1.0) * 0.5
        if self.spec.mode == "nearest":
            pixel = self._wrap(b.op("Round", pixel.value))
        lo, hi = self._bounds(axis)
        if self.spec.padding_mode == "reflection":
            return self._reflect(pixel, lo, hi)
        if self.spec.padding_mode == "border" and self.spec.mode != "cubic":  # cubic clamps its taps only
            outside = b.op("Or", b.op("Less", pixel.value, self._value(lo)), b.op("Greater", pixel.value, self._value(hi)))
            return self._wrap(b.op("Where", outside, self._clip(pixel, axis).value, pixel.value))
        return pixel

    def _clip(self, v: _Emitted, axis: int) -> _Emitted:
        last = self._size(axis, -1.0)
        return self._wrap(self.b.op("Clip", v.value, self._value(0.0), self._value(last)))

    def _reflect(self, v: _Emitted, lo, hi) -> _Emitted:
        """v reflected at lo and hi into [lo, hi] (unchanged inside); lo itself when the two meet
        (one pixel with align_corners), as the kernel does."""
        b = self.b
        width = hi - lo
        if not isinstance(width, _Emitted) and width <= 0:
            return v * 0.0 + lo
        span = self._value(width)
        if isinstance(width, _Emitted):  # a size known at run time: guard the division
            empty = b.op("LessOrEqual", span, self._value(0.0))
            span = b.op("Where", empty, self._value(1.0), span)

        def folded(distance: _Emitted, near, far, sign: float) -> ir.Value:
            turns = self._wrap(b.op("Floor", b.op("Div", distance.value, span)))
            rest = distance - turns * self._wrap(span)
            parity = turns - self._wrap(b.op("Floor", (turns * 0.5).value)) * 2.0
            even = b.op("Equal", parity.value, self._value(0.0))
            return b.op("Where", even, (rest * sign + near).value, (rest * -sign + far).value)

        below = b.op("Less", v.value, self._value(lo))
        above = b.op("Greater", v.value, self._value(hi))
        from_below = folded(v * -1.0 + lo, lo, hi, 1.0)
        from_above = folded(v - hi, hi, lo, -1.0)
        reflected = b.op("Where", below, from_below, b.op("Where", above, from_above, v.value))
        if isinstance(width, _Emitted):
            reflected = b.op("Where", empty, (v * 0.0 + lo).value, reflected)
        return self._wrap(reflected)

    # -- taps --------------------------------------------------------------------------------------
    def _tap_index(self, position: _Emitted, axis: int) -> tuple[ir.Value, ir.Value | None]:
        """(the tap's int64 index along ``axis``, its in-range mask in the grid's type or None)."""
        b = self.b
        valid = None
        if self.spec.padding_mode == "zeros":
            inside = b.op(
                "And",
                b.op("GreaterOrEqual", position.value, self._value(0.0)),
                b.op("Less", position.value, self._value(self._size(axis))),
            )
            valid = b.op("CastLike", inside, self.grid)
        elif self.spec.padding_mode == "reflection":
            position = self._reflect(position, *self._bounds(axis))
        return b.op("Cast", self._clip(position, axis).value, to=ir.DataType.INT64), valid

    def _bounds(self, axis: int):
        """(lo, hi) of gradgen.ops.grid_sample, hi emitted when the size is not static."""
        size = self.spatial[axis]
        if isinstance(size, int):
            return self.spec.bounds(size)
        lo = 0.0 if self.spec.align_corners else -0.5
        return lo, self._size(axis, -1.0 if self.spec.align_corners else -0.5)

    def output(self) -> ir.Value:
        b, nd = self.b, self.nd
        offsets = TAP_OFFSETS[self.spec.mode]
        bases: list[_Emitted] = []
        weights: list[tuple] = []
        for axis in range(nd):
            pixel = self._pixel(axis)
            if self.spec.mode == "nearest":
                bases.append(pixel)
                weights.append((None,))
                continue
            base = self._wrap(b.op("Floor", pixel.value))
            t = pixel - base
            bases.append(base)
            weights.append((1.0 - t, t) if self.spec.mode == "linear" else cubic_weights(t))
        x_shape = b.shape_of(self.x)
        flat_x = b.reshape(self.x, [0, 0, -1])
        terms = []
        for taps in itertools.product(range(len(offsets)), repeat=nd):
            flat, weight = None, None
            for axis, k in enumerate(taps):
                index, valid = self._tap_index(bases[axis] + float(offsets[k]), axis)
                flat = index if flat is None else b.op("Add", b.op("Mul", flat, self._size_int(axis)), index)
                for factor in (weights[axis][k], valid):
                    if factor is not None:
                        value = factor.value if isinstance(factor, _Emitted) else factor
                        weight = value if weight is None else b.op("Mul", weight, value)
            assert flat is not None  # nd >= 1
            gathered = self._gather_taps(flat_x, flat)
            if weight is not None:
                if self.x.dtype != self.grid.dtype:
                    weight = b.op("CastLike", weight, self.x)
                gathered = b.op("Mul", gathered, weight)
            terms.append(gathered)
        total = b.sum(terms)
        out_shape = b.op("Concat", b.part(x_shape, 0, 2), b.part(b.shape_of(self.grid), 1, -1), axis=0)
        return b.reshape(total, out_shape, exact=True)


class _RoiAlign(_Form):
    """The standard-op form of one RoiAlign node with a fixed sampling_ratio s: X's planes gathered
    by batch_indices (R, C, H * W); per roi, the s x s samples of every bin along each axis, with
    the kernel's edge rule (gradgen/kernels/cpu/pool.py); four weighted corner taps per sample;
    their sum (avg) or largest term (max), pooled per bin by ReduceMean / ReduceMax."""

    op_type = "RoiAlign"

    def __init__(self, node: ir.Node, b: GraphBuilder):
        super().__init__(node, b)
        try:
            self.half_pixel, self.mode, self.bins, self.ratio, self.scale = roi_align_spec(**node_attributes(node))
        except KernelError as exc:
            raise ModelError(f"{self.where}: {exc}") from None
        if self.nd != 2 or len(node.inputs) < 3 or node.inputs[2] is None:
            raise ModelError(f"{self.where}: X must be (N, C, H, W) and batch_indices given")
        self.batch_indices = node.inputs[2]

    @staticmethod
    def applies(node: ir.Node) -> bool:
        """Float X and a fixed sampling ratio: an adaptive one (0) takes a number of samples per roi
        known only at run time (the rule entry then explains why there is no gradient)."""
        attr = node.attributes.get("sampling_ratio")
        return _Form.applies(node) and attr is not None and int(attr.value) > 0

    def _corner(self, box: ir.Value, k: int) -> _Emitted:
        """Column k of the scaled, shifted rois, (R, 1)."""
        b = self.b
        column = self._wrap(b.op("Slice", box, b.ints([k]), b.ints([k + 1]), b.ints([1])))
        return column * self.scale - (0.5 if self.half_pixel else 0.0)

    def _axis_taps(self, start: _Emitted, end: _Emitted, axis: int):
        """(low, high, weight of high, in range) of the samples along spatial axis ``axis``,
        (R, bins * s), sample j of bin i at i * s + j."""
        b, s, bins = self.b, self.ratio, self.bins[axis]
        size = end - start
        if not self.half_pixel:
            size = self._wrap(b.op("Max", size.value, self._value(1.0)))
        steps = np.array([i + (j + 0.5) / s for i in range(bins) for j in range(s)], dtype=self.dtype)
        points = start + size * (1.0 / bins) * self._wrap(float_constant(b, steps, self.floats))
        extent, last = self._size(axis), self._size(axis, -1.0)
        inside = b.op(
            "And",
            b.op("GreaterOrEqual", points.value, self._value(-1.0)),
            b.op("LessOrEqual", points.value, self._value(extent)),
        )
        points = self._wrap(b.op("Max", points.value, self._value(0.0)))
        low = self._wrap(b.op("Floor", points.value))
        top = b.op("GreaterOrEqual", low.value, self._value(last))
        high = b.op("Where", top, self._value(last), (low + 1.0).value)
        low_index = b.op("Where", top, self._value(last), low.value)
        frac = b.op("Where", top, self._value(0.0), (points - low).value)
        as_int = [b.op("Cast", v, to=ir.DataType.INT64) for v in (low_index, high)]
        return as_int[0], as_int[1], self._wrap(frac), inside

    def output(self) -> ir.Value:
        b = self.b
        box = self.grid
        x1, y1, x2, y2 = (self._corner(box, k) for k in range(4))
        y_low, y_high, ly, y_in = self._axis_taps(y1, y2, 0)
        x_low, x_high, lx, x_in = self._axis_taps(x1, x2, 1)
        rows = [b.unsqueeze(v, [2]) for v in (y_low, y_high, ly.value, y_in)]  # (R, Ay, 1)
        cols = [b.unsqueeze(v, [1]) for v in (x_low, x_high, lx.value, x_in)]  # (R, 1, Ax)
        valid = b.op("CastLike", b.op("And", rows[3], cols[3]), box)
        ly_, lx_ = self._wrap(rows[2]), self._wrap(cols[2])
        planes = b.op("Gather", b.reshape(self.x, [0, 0, -1]), self.batch_indices, axis=0)  # (R, C, H * W)
        width = self._size_int(1)
        terms = []
        for row, col, weight in (
            (rows[0], cols[0], (1.0 - ly_) * (1.0 - lx_)),
            (rows[0], cols[1], (1.0 - ly_) * lx_),
            (rows[1], cols[0], ly_ * (1.0 - lx_)),
            (rows[1], cols[1], ly_ * lx_),
        ):
            flat = b.reshape(b.op("Add", b.op("Mul", row, width), col), [0, 1, -1])
            scaled = b.reshape((weight * valid).value, [0, 1, -1])
            terms.append(b.op("Mul", self._gather_taps(planes, flat), scaled))
        samples = b.op("Max", *terms) if self.mode == "max" else b.sum(terms)
        (out_h, out_w), s = self.bins, self.ratio
        per_bin = b.reshape(samples, [0, 0, out_h, s, out_w, s])
        return b.reduce("ReduceMax" if self.mode == "max" else "ReduceMean", per_bin, [3, 5], keepdims=0)


class _Stft(_Rewrite):
    """The standard-op form of one STFT node: the frames gathered from the signal by a constant
    index table (frames, window), times the window, then one DFT over the window axis, whose rule
    differentiates it. Only for a static signal length, a constant frame_step and a known frame
    length (the rule entry explains the others, when a gradient reaches them)."""

    def __init__(self, node: ir.Node, b: GraphBuilder):
        super().__init__(node, b)
        geometry = stft_geometry(node)
        assert geometry is not None  # applies() checked it
        self.signal, self.window = node.inputs[0], node.inputs[2] if len(node.inputs) > 2 else None
        self.samples, self.step, self.width = geometry

    @staticmethod
    def applies(node: ir.Node) -> bool:
        return _Rewrite.applies(node) and stft_geometry(node) is not None

    def output(self) -> ir.Value:
        b = self.b
        starts = np.arange(1 + (self.samples - self.width) // self.step) * self.step
        table = (starts[:, None] + np.arange(self.width)[None, :]).astype(np.int64)
        frames = b.op("Gather", self.signal, b.const(table), axis=1)  # (batch, frames, width, 1 or 2)
        if self.window is not None:
            frames = b.op("Mul", frames, b.reshape(self.window, [1, 1, -1, 1]))
        onesided = int(self.node.attributes["onesided"].value) if "onesided" in self.node.attributes else 1
        length = b.const(np.array(self.width, dtype=np.int64))
        if b.opset >= 20:
            return b.op("DFT", frames, length, b.const(np.array(2, dtype=np.int64)), onesided=onesided)
        return b.op("DFT", frames, length, axis=2, onesided=onesided)


class _DeformConv(_Rewrite):
    """The standard-op form of one 2-D DeformConv node, as its kernel computes it: the sampling
    positions (constant base positions plus the offsets) normalized for a GridSample (linear, zeros,
    align_corners 0) of X with the offset groups folded into the batch, which the pass rewrites in
    its next round; the mask multiplied in; then a grouped MatMul with W, plus B. Static shapes
    only (the rule entry explains the others, when a gradient reaches them)."""

    def __init__(self, node: ir.Node, b: GraphBuilder):
        super().__init__(node, b)
        inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
        x, w, offset = inputs[:3]
        assert x is not None and w is not None and offset is not None  # applies() checked their shapes
        self.x, self.w, self.offset, self.bias, self.mask = x, w, offset, inputs[3], inputs[4]
        geometry = deform_conv_static_geometry(node)
        assert geometry is not None  # applies() checked it
        self.geometry, self.x_shape = geometry

    @staticmethod
    def applies(node: ir.Node) -> bool:
        return _Rewrite.applies(node) and deform_conv_static_geometry(node) is not None

    def output(self) -> ir.Value:
        b = self.b
        kernel, strides, dilations, pads, out, group, offset_group = self.geometry
        n, channels, height, width = self.x_shape
        taps, points = kernel[0] * kernel[1], out[0] * out[1]
        dtype = numpy_dtype_of(self.offset)
        base_h, base_w = deform_conv_positions(kernel, strides, dilations, pads, out)
        shifts = b.reshape(self.offset, [n * offset_group, taps, 2, points])
        rows = b.op("Add", b.op("Gather", shifts, b.scalar(0), axis=2), float_constant(b, base_h.astype(dtype), self.floats))
        cols = b.op("Add", b.op("Gather", shifts, b.scalar(1), axis=2), float_constant(b, base_w.astype(dtype), self.floats))

        def normalized(v, size):  # pixel p -> (2p + 1) / size - 1, GridSample's align_corners=0
            scaled = b.op("Mul", v, float_constant(b, np.array(2.0 / size, dtype=dtype), self.floats))
            return b.op("Add", scaled, float_constant(b, np.array(1.0 / size - 1.0, dtype=dtype), self.floats))

        grid = b.op("Concat", b.unsqueeze(normalized(cols, width), [3]), b.unsqueeze(normalized(rows, height), [3]), axis=3)
        planes = b.reshape(self.x, [n * offset_group, channels // offset_group, height, width])
        samples = b.op("GridSample", planes, grid, mode="linear", padding_mode="zeros", align_corners=0)
        if self.mask is not None:
            samples = b.op("Mul", samples, b.reshape(self.mask, [n * offset_group, 1, taps, points]))
        columns = b.reshape(samples, [n, group, (channels // group) * taps, points])
        weights = b.reshape(self.w, [group, -1, (channels // group) * taps])
        y = b.reshape(b.op("MatMul", weights, columns), [n, -1, *out])
        if self.bias is not None:
            y = b.op("Add", y, b.reshape(self.bias, [1, -1, 1, 1]))
        return y


def deform_conv_static_geometry(node: ir.Node):
    """(DeformConv's geometry, X's shape) when X, W and offset have static shapes, else None."""
    shapes = [dims_of(v) if v is not None else None for v in list(node.inputs)[:3]]
    if len(shapes) < 3 or any(s is None or not is_static(s) for s in shapes):
        return None
    try:
        return deform_conv_geometry(*shapes, **node_attributes(node)), shapes[0]
    except KernelError:
        return None  # the kernel says what is wrong when it runs


_FORMS: dict[str, type[_Rewrite]] = {"GridSample": _GridSample, "RoiAlign": _RoiAlign, "STFT": _Stft, "DeformConv": _DeformConv}


def stft_geometry(node: ir.Node) -> tuple[int, int, int] | None:
    """(signal length, frame_step, frame length) of an STFT node when all are known before running
    it: a static length, constant frame_step and frame_length (or a window of static length)."""
    inputs = list(node.inputs) + [None] * (4 - len(node.inputs))
    signal, step, window, length = inputs[:4]
    dims = dims_of(signal) if signal is not None else None
    step_value, length_value = _constant(step), _constant(length)
    if dims is None or len(dims) != 3 or not isinstance(dims[1], int) or step_value is None:
        return None
    window_dims = dims_of(window) if window is not None else None
    if length_value is not None:
        width = int(length_value.reshape(-1)[0])
    elif window is None:
        width = dims[1]
    elif window_dims is not None and isinstance(window_dims[0], int):
        width = window_dims[0]
    else:
        return None
    return dims[1], int(step_value.reshape(-1)[0]), width


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """An initializer's or a Constant node's value (EvaluateConstantsPass has folded what it can)."""
    if value is None:
        return None
    if value.const_value is not None and not value.is_graph_input():
        return value.const_value.numpy()
    producer = value.producer()
    if (
        producer is not None
        and producer.op_type == "Constant"
        and producer.domain in STANDARD_DOMAINS
        and "value" in producer.attributes
    ):
        return producer.attributes["value"].value.numpy()
    return None
