"""UnrollRecurrentPass: rewrite LSTM, GRU and RNN nodes into standard ops over their static
sequence length, so that the gradient rules of those ops differentiate them and both executors
run them with the kernels they have. A sequence length known only at run time gets a Loop over the
time steps instead, whose body is one step (the same cell), differentiated by Loop's rule.

Per direction: one MatMul projects every time step's input at once (biases folded in), then each
step is a Gemm with the recurrent weights and the gates' elementwise ops. A missing initial state
is zero, so the first step leaves its recurrent terms out (no batch size is needed). With
``sequence_lens``, a Where per step keeps the state of a finished sequence and zeroes its outputs
(the final state of an empty sequence is 0, not the initial state, as ONNX Runtime computes it).
The node's outputs keep their names; attributes are read by ``gradgen.ops.recurrent``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from gradgen.builder import INT64_MIN, GraphBuilder, numpy_dtype_of
from gradgen.errors import ModelError
from gradgen.ops.attributes import node_attributes
from gradgen.ops.recurrent import RECURRENT_OPS, Activation, RecurrentSpec, recurrent_spec
from gradgen.passes.rewrite import STANDARD_DOMAINS, float_constant, rewrite_nodes

__all__ = ["UnrollRecurrentPass"]


class UnrollRecurrentPass(ir.passes.InPlacePass):
    """Replace every LSTM / GRU / RNN node of the main graph by its unrolled form (in place); shape
    inference runs afterwards when something was unrolled. With ``static_length_only``, nodes whose
    sequence length is known only at run time stay as they are (instead of becoming a Loop)."""

    def __init__(self, static_length_only: bool = False):
        super().__init__()
        self.static_length_only = static_length_only

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        nodes = [n for n in model.graph if n.domain in STANDARD_DOMAINS and n.op_type in RECURRENT_OPS]
        if self.static_length_only:
            nodes = [n for n in nodes if _static_length(n)]
        modified = rewrite_nodes(model, nodes, lambda node, builder: _Unroller(node, builder).outputs())
        return ir.passes.PassResult(model, modified=modified)


def _static_length(node: ir.Node) -> bool:
    """Whether the node's X has a known rank of 3 and a static length along its time axis."""
    x = node.inputs[0] if node.inputs else None
    if x is None or x.shape is None or x.shape.rank() != 3:
        return False
    layout = node.attributes.get_int("layout", 0)
    return isinstance(x.shape[1 if layout == 1 else 0], int)


@dataclasses.dataclass
class _Direction:
    """One direction's parameters, as values of the graph (None where the node has none)."""

    index: int
    reverse: bool
    w: ir.Value  # [gates*H, I]
    r: ir.Value  # [gates*H, H]
    wb: ir.Value | None  # [gates*H]
    rb: ir.Value | None
    h0: ir.Value | None  # [B, H]
    c0: ir.Value | None
    p: ir.Value | None  # [3H]


class _Unroller:
    def __init__(self, node: ir.Node, builder: GraphBuilder):
        self.node = node
        self.b = builder
        where = f"node {node.name!r} ({node.op_type})"
        self.where = where
        self.spec: RecurrentSpec = recurrent_spec(node.op_type, node_attributes(node), where)
        x = self._input(0)
        if x is None or x.shape is None or x.shape.rank() != 3:
            raise ModelError(f"{where}: gradgen unrolls recurrent ops and needs the rank of X (3); it is not known")
        time_axis = self.spec.layout
        steps = x.shape[time_axis]
        # a length known only at run time: one Loop over the steps (self.steps None)
        self.x, self.steps, self.time_axis = x, steps if isinstance(steps, int) else None, time_axis
        self.dtype = numpy_dtype_of(x)
        self.hidden = self._hidden_size()
        self._constants: dict = {}  # float_constant's cache
        self._masks: dict[int, ir.Value] = {}
        self._derived: dict[tuple, list[ir.Value]] = {}
        self.lens = self._sequence_lengths()

    # -- inputs ------------------------------------------------------------------------------
    def _input(self, i: int) -> ir.Value | None:
        return self.node.inputs[i] if i < len(self.node.inputs) else None

    def _hidden_size(self) -> int:
        if self.spec.hidden_size is not None:
            return self.spec.hidden_size
        r = self._input(2)
        last = None if r is None or r.shape is None else r.shape[-1]
        if not isinstance(last, int):
            raise ModelError(f"{self.where}: no hidden_size attribute and the shape of R is not static")
        return last

    def _sequence_lengths(self) -> ir.Value | None:
        """sequence_lens as int64, or None when absent or every entry is the full length."""
        lens = self._input(4)
        if lens is None:
            return None
        known = self.b.value_of(lens)
        if known is not None and self.steps is not None and np.all(np.asarray(known) == self.steps):
            return None
        return self.b.op("Cast", lens, to=ir.DataType.INT64)

    def _per_direction(self, i: int, axis: int) -> list[ir.Value | None]:
        """Input i split along its direction axis, that axis removed (None per direction if absent)."""
        value = self._input(i)
        count = len(self.spec.directions)
        if value is None:
            return [None] * count
        if count == 1:
            return [self.b.squeeze(value, [axis])]
        parts = self.b.op_multi("Split", [value, self.b.ints([1] * count)], count, axis=axis)
        return [self.b.squeeze(part, [axis]) for part in parts]

    def _directions(self) -> list[_Direction]:
        state_axis = 1 if self.spec.layout == 1 else 0
        w, r, bias = self._per_direction(1, 0), self._per_direction(2, 0), self._per_direction(3, 0)
        h0 = self._per_direction(5, state_axis)
        c0 = self._per_direction(6, state_axis) if self.node.op_type == "LSTM" else [None] * len(w)
        p = self._per_direction(7, 0) if self.node.op_type == "LSTM" else [None] * len(w)
        found = []
        for d, direction in enumerate(self.spec.directions):
            wb = rb = None
            bias_d, w_d, r_d = bias[d], w[d], r[d]
            if bias_d is not None:
                wb, rb = self._gate_split(bias_d, [self.spec.gates, self.spec.gates])
            if w_d is None or r_d is None:
                raise ModelError(f"{self.where}: W and R are required inputs")
            found.append(_Direction(d, direction == "reverse", w_d, r_d, wb, rb, h0[d], c0[d], p[d]))
        return found

    # -- helpers -----------------------------------------------------------------------------
    def _gate_split(self, value: ir.Value, sizes: list[int], axis: int = -1) -> list[ir.Value]:
        """Split ``value`` along ``axis`` into pieces of the given sizes (in units of H), once per
        value (the steps of a direction share the pieces of its weights)."""
        if len(sizes) == 1:
            return [value]
        key = (id(value), tuple(sizes), axis)
        if key not in self._derived:
            split = self.b.ints([s * self.hidden for s in sizes])
            self._derived[key] = self.b.op_multi("Split", [value, split], len(sizes), axis=axis)
        return self._derived[key]

    def _const(self, number: float) -> ir.Value:
        """A float scalar of X's type, as a Constant node (an initializer would read as a parameter)."""
        return float_constant(self.b, np.asarray(number, dtype=self.dtype), self._constants)

    def _add(self, first: ir.Value, *terms: ir.Value | None) -> ir.Value:
        """first + the terms that are present."""
        total = first
        for term in terms:
            if term is not None:
                total = self.b.op("Add", total, term)
        return total

    def _add_present(self, a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
        return b if a is None else self._add(a, b)

    def _mul(self, a: ir.Value | None, b: ir.Value | None) -> ir.Value | None:
        return None if a is None or b is None else self.b.op("Mul", a, b)

    def _clip(self, x: ir.Value) -> ir.Value:
        if self.spec.clip is None:
            return x
        return self.b.op("Clip", x, self._const(-self.spec.clip), self._const(self.spec.clip))

    def _activate(self, x: ir.Value, act: Activation) -> ir.Value:
        b, name = self.b, act.name
        if name in ("Relu", "Tanh", "Sigmoid", "Softsign", "Softplus"):
            return b.op(name, x)
        if name in ("LeakyRelu", "ThresholdedRelu", "Elu"):
            return b.op(name, x, alpha=act.alpha)
        if name == "HardSigmoid":
            return b.op(name, x, alpha=act.alpha, beta=act.beta)
        assert act.alpha is not None and act.beta is not None  # recurrent_spec requires them here
        if name == "Affine":
            return b.op("Add", b.op("Mul", x, self._const(act.alpha)), self._const(act.beta))
        if name == "ScaledTanh":
            return b.op("Mul", b.op("Tanh", b.op("Mul", x, self._const(act.beta))), self._const(act.alpha))
        raise AssertionError(name)

    def _gemm(self, h: ir.Value | None, weight: ir.Value, addend: ir.Value) -> ir.Value:
        """h @ weight^T + addend (h None: a zero state, so just the addend)."""
        if h is None:
            return addend
        return self.b.op("Gemm", h, weight, addend, transB=1)

    def _project(self, weight: ir.Value, bias: ir.Value | None) -> list[ir.Value]:
        """X @ weight^T + bias for every time step at once, then one [B, n] value per step."""
        b = self.b
        assert self.steps is not None  # the unrolled form; a run-time length takes _loop_direction
        projected = self._add(b.op("MatMul", self.x, b.transpose(weight, [1, 0])), bias)
        if self.steps == 1:
            return [b.squeeze(projected, [self.time_axis])]
        parts = b.op_multi("Split", [projected, b.ints([1] * self.steps)], self.steps, axis=self.time_axis)
        return [b.squeeze(part, [self.time_axis]) for part in parts]

    def _live(self, t: int) -> ir.Value | None:
        """[B, 1] bool: which sequences are still running at step t (None: all, always)."""
        if self.lens is None:
            return None
        if t not in self._masks:
            less = self.b.op("Less", self.b.const(np.asarray(t, dtype=np.int64)), self.lens)
            self._masks[t] = self.b.unsqueeze(less, [1])
        return self._masks[t]

    def _keep(self, live: ir.Value | None, new: ir.Value, old: ir.Value | None) -> ir.Value:
        """The state after a step: ``new`` where the sequence runs, else ``old`` (0 when None)."""
        if live is None:
            return new
        return self.b.op("Where", live, new, old if old is not None else self._const(0.0))

    # -- the cells ---------------------------------------------------------------------------
    def _lstm(self, d: _Direction, acts, steps_in, h, c):
        f_act, g_act, h_act = acts
        p_i = p_o = p_f = None
        if d.p is not None:
            p_i, p_o, p_f = self._gate_split(d.p, [1, 1, 1])
        gates = self._gemm(h, d.r, steps_in)
        if d.p is None:  # i, o, f are one activation of the first 3H gates (no peephole tells them apart)
            iof_pre, c_pre = self._gate_split(gates, [3, 1])
            i, o, f = self._gate_split(self._activate(self._clip(iof_pre), f_act), [1, 1, 1])
        else:
            i_pre, o_pre, f_pre, c_pre = self._gate_split(gates, [1, 1, 1, 1])
            i = self._activate(self._clip(self._add(i_pre, self._mul(p_i, c))), f_act)
            if not self.spec.input_forget:
                f = self._activate(self._clip(self._add(f_pre, self._mul(p_f, c))), f_act)
        if self.spec.input_forget:
            f = self.b.op("Sub", self._const(1.0), i)
        c_new = self._add(self.b.op("Mul", i, self._activate(self._clip(c_pre), g_act)), self._mul(f, c))
        if d.p is not None:
            o = self._activate(self._clip(self._add(o_pre, self._mul(p_o, c_new))), f_act)
        return self.b.op("Mul", o, self._activate(c_new, h_act)), c_new

    def _gru(self, d: _Direction, acts, steps_in, h, c):
        f_act, g_act = acts
        x_zr, x_h = steps_in
        r_zr, r_h = self._gate_split_rows(d.r)
        z, reset = self._gate_split(self._activate(self._clip(self._gemm(h, r_zr, x_zr)), f_act), [1, 1])
        if self.spec.linear_before_reset:
            rb_h = None if d.rb is None else self._gate_split(d.rb, [2, 1])[1]
            recurrent = rb_h if h is None else self.b.op("Gemm", h, r_h, rb_h, transB=1)
            candidate = self._add(x_h, self._mul(reset, recurrent))
        else:
            candidate = self._gemm(self._mul(reset, h), r_h, x_h)
        candidate = self._activate(self._clip(candidate), g_act)
        kept = self.b.op("Mul", self.b.op("Sub", self._const(1.0), z), candidate)
        return self._add(kept, self._mul(z, h)), c

    def _rnn(self, d: _Direction, acts, steps_in, h, c):
        return self._activate(self._clip(self._gemm(h, d.r, steps_in)), acts[0]), c

    def _gate_split_rows(self, weight: ir.Value) -> list[ir.Value]:
        """GRU's [3H, n] weights as the z, r rows [2H, n] and the h rows [H, n]."""
        return self._gate_split(weight, [2, 1], axis=0)

    def _projection_terms(self, d: _Direction) -> list[tuple[ir.Value, ir.Value | None]]:
        """(weight, bias) of what the steps add from X: one pair (gates*H), or GRU's zr and h parts
        apart (linear_before_reset keeps R's h bias for the cell)."""
        if self.node.op_type != "GRU":
            return [(d.w, self._add_present(d.wb, d.rb))]
        w_zr, w_h = self._gate_split_rows(d.w)
        wb_zr = wb_h = rb_zr = rb_h = None
        if d.wb is not None and d.rb is not None:
            wb_zr, wb_h = self._gate_split(d.wb, [2, 1])
            rb_zr, rb_h = self._gate_split(d.rb, [2, 1])
        h_bias = wb_h if self.spec.linear_before_reset else self._add_present(wb_h, rb_h)
        return [(w_zr, self._add_present(wb_zr, rb_zr)), (w_h, h_bias)]

    def _inputs_per_step(self, d: _Direction):
        """What each step adds from X: [B, gates*H] (GRU: the zr and h parts apart)."""
        per_term = [self._project(weight, bias) for weight, bias in self._projection_terms(d)]
        return per_term[0] if len(per_term) == 1 else list(zip(*per_term))

    # -- the unrolled node -------------------------------------------------------------------
    def _run_direction(self, d: _Direction):
        if self.steps is None:
            return self._loop_direction(d)
        cell = {"LSTM": self._lstm, "GRU": self._gru, "RNN": self._rnn}[self.node.op_type]
        per_step = self._inputs_per_step(d)
        acts = self.spec.activations[d.index]
        h, c = d.h0, d.c0
        ys: list[ir.Value | None] = [None] * self.steps
        order = range(self.steps - 1, -1, -1) if d.reverse else range(self.steps)
        for t in order:
            h_new, c_new = cell(d, acts, per_step[t], h, c)
            live = self._live(t)
            ys[t] = self._keep(live, h_new, None)
            h = ys[t] if h is None else self._keep(live, h_new, h)
            if self.node.op_type == "LSTM":
                c = self._keep(live, c_new, c)
        if self.lens is not None:  # an empty sequence ends in state 0, as in ONNX Runtime
            h = None if h is None else self._keep(self._live(0), h, None)
            c = None if c is None else self._keep(self._live(0), c, None)
        return ys, h, c

    def outputs(self) -> list[ir.Value | None]:
        """The unrolled values of Y, Y_h (and Y_c), None for outputs nobody reads."""
        wanted = [bool(o.name) and (bool(o.uses()) or o.is_graph_output()) for o in self.node.outputs]
        results = [self._run_direction(d) for d in self._directions()]
        layout1 = self.spec.layout == 1
        built: list[ir.Value | None] = [None] * len(self.node.outputs)
        if wanted[0]:
            # Y: [T, D, B, H] (layout 1: [B, T, D, H])
            per_direction = [self.b.unsqueeze(self._in_layout(ys), [1 + layout1]) for ys, _, _ in results]
            built[0] = self._concat(per_direction, 1 + layout1)
        for k in (1, 2):
            if k < len(wanted) and wanted[k]:
                # Y_h, Y_c: [D, B, H] (layout 1: [B, D, H])
                states = [result[k] for result in results]
                if any(s is None for s in states):
                    raise ModelError(
                        f"{self.where}: output {self.node.outputs[k].name!r} is read but the node has no "
                        "initial state and no time steps to compute it from"
                    )
                built[k] = self._concat([self.b.unsqueeze(s, [int(layout1)]) for s in states], int(layout1))
        return built

    def _concat(self, values: list[ir.Value], axis: int) -> ir.Value:
        return values[0] if len(values) == 1 else self.b.op("Concat", *values, axis=axis)

    def _in_layout(self, ys) -> ir.Value:
        """One direction's Y as [T, B, H] (layout 1: [B, T, H]), from its steps or from the Loop's
        stack of them ([T, B, H])."""
        if isinstance(ys, ir.Value):
            return self.b.transpose(ys, [1, 0, 2]) if self.time_axis else ys
        return self._concat([self.b.unsqueeze(y, [self.time_axis]) for y in ys], self.time_axis)

    # -- a length known at run time: one Loop over the steps --------------------------------------
    def _time_first(self, value: ir.Value) -> ir.Value:
        """A [T, B, n] / [B, T, n] value (per the layout) as [T, B, n]."""
        return self.b.transpose(value, [1, 0, 2]) if self.time_axis else value

    def _projected(self, weight: ir.Value, bias: ir.Value | None) -> ir.Value:
        """X @ weight^T + bias for every time step at once, time first: [T, B, n]."""
        return self._time_first(self._add(self.b.op("MatMul", self.x, self.b.transpose(weight, [1, 0])), bias))

    def _projections(self, d: _Direction) -> list[ir.Value]:
        """What the steps add from X, as whole [T, B, n] tensors (GRU: the zr and h parts)."""
        return [self._projected(weight, bias) for weight, bias in self._projection_terms(d)]

    def _zero_state(self) -> ir.Value:
        """Zeros [B, H] of X's type (a missing initial state; the Loop carries a state from the start)."""
        b = self.b
        batch_axis = 1 - self.time_axis
        batch = b.op("Slice", b.shape_of(self.x), b.ints([batch_axis]), b.ints([batch_axis + 1]))
        size = b.op("Concat", batch, b.ints([self.hidden]), axis=0)
        return b.op("ConstantOfShape", size, value=ir.tensor(np.zeros((1,), dtype=self.dtype)))

    def _loop_direction(self, d: _Direction):
        """(Y stacked [T, B, H], final h, final c) of one direction, as a Loop of T iterations whose
        body runs the cell on step t (T - 1 - i in reverse) and carries h (and c)."""
        b = self.b
        cell = {"LSTM": self._lstm, "GRU": self._gru, "RNN": self._rnn}[self.node.op_type]
        lstm = self.node.op_type == "LSTM"
        projections = self._projections(d)
        # the weights' pieces the cell takes, made once outside the body (the body reads them)
        if self.node.op_type == "GRU":
            self._gate_split_rows(d.r)
            if d.rb is not None:
                self._gate_split(d.rb, [2, 1])
        if d.p is not None:
            self._gate_split(d.p, [1, 1, 1])
        count = b.op("Gather", b.shape_of(projections[0]), b.scalar(0), axis=0)
        h0 = d.h0 if d.h0 is not None else self._zero_state()
        c0 = (d.c0 if d.c0 is not None else self._zero_state()) if lstm else None
        prefix = f"{self.node.name or self.node.op_type}/steps{d.index}"
        body = b.collector(prefix)
        state_type = ir.TensorType(ir.DataType.from_numpy(self.dtype))
        i = ir.Value(name=body.unique(f"{prefix}/i"), type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([]))
        go_on = ir.Value(name=body.unique(f"{prefix}/cond"), type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        h_in = ir.Value(name=body.unique(f"{prefix}/h"), type=state_type, shape=ir.Shape([None, self.hidden]))
        c_in = ir.Value(name=body.unique(f"{prefix}/c"), type=state_type, shape=ir.Shape([None, self.hidden])) if lstm else None
        outer, outer_constants, outer_derived = self.b, self._constants, dict(self._derived)
        self.b, self._constants = body, {}
        try:
            t = body.op("Sub", body.op("Sub", count, body.scalar(1)), i) if d.reverse else i
            steps_in = [body.op("Gather", p, t, axis=0) for p in projections]
            h_new, c_new = cell(
                d, self.spec.activations[d.index], steps_in[0] if len(steps_in) == 1 else tuple(steps_in), h_in, c_in
            )
            live = body.unsqueeze(body.op("Less", t, self.lens), [1]) if self.lens is not None else None
            y = self._keep(live, h_new, None)
            h_out = self._keep(live, h_new, h_in)
            carried = [h_out]
            if lstm:
                assert c_new is not None and c_in is not None  # an LSTM step keeps its cell state
                carried.append(self._keep(live, c_new, c_in))
            outputs = [body.op("Identity", go_on), *carried, y]
        finally:
            self.b, self._constants, self._derived = outer, outer_constants, outer_derived
        for value in outputs[1:]:
            value.type = state_type
        body_inputs = [i, go_on, h_in] + ([c_in] if c_in is not None else [])
        loop_body = ir.Graph(body_inputs, outputs, nodes=body.nodes, name=body.unique(f"{prefix}_body"))
        results = b.op_multi("Loop", [count, None, h0, *([c0] if lstm else [])], len(outputs) - 1, body=loop_body)
        h, c, stacked = results[0], (results[1] if lstm else None), results[-1]
        if d.reverse:  # iteration i ran step T - 1 - i
            stacked = b.op("Slice", stacked, b.ints([-1]), b.ints([INT64_MIN]), b.ints([0]), b.ints([-1]))
        if self.lens is not None:  # an empty sequence ends in state 0, as in ONNX Runtime
            empty_ok = b.unsqueeze(b.op("Less", b.scalar(0), self.lens), [1])
            h = self._keep(empty_ok, h, None)
            c = None if c is None else self._keep(empty_ok, c, None)
        return stacked, h, c
