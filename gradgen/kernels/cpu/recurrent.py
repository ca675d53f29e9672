"""CPU kernels of LSTM, GRU and RNN (forward only: build_backward unrolls them into standard ops,
gradgen/passes/recurrent.py, and differentiates those).

Semantics as ONNX Runtime computes them: gates as in the ONNX spec, ``clip`` applied to every
activation's input, ``sequence_lens`` ending each batch entry's sequence (its outputs past the end
are 0 and its Y_h / Y_c are those of its last valid step, 0 for an empty one; a reverse direction
starts at that step).
"""

from __future__ import annotations

import numpy as np

from gradgen.errors import KernelError
from gradgen.kernels.table import cpu_kernel
from gradgen.ops.recurrent import Activation, RecurrentSpec, recurrent_spec


def _sigmoid(x):
    return 0.5 * (np.tanh(0.5 * x) + 1.0)


def activate(x: np.ndarray, act: Activation) -> np.ndarray:
    # the activations that use them have both values set by recurrent_spec
    a = 0.0 if act.alpha is None else act.alpha
    b = 0.0 if act.beta is None else act.beta
    name = act.name
    if name == "Sigmoid":
        return _sigmoid(x)
    if name == "Tanh":
        return np.tanh(x)
    if name == "Relu":
        return np.maximum(x, 0)
    if name == "Affine":
        return a * x + b
    if name == "LeakyRelu":
        return np.where(x >= 0, x, a * x)
    if name == "ThresholdedRelu":
        return np.where(x > a, x, 0)
    if name == "ScaledTanh":
        return a * np.tanh(b * x)
    if name == "HardSigmoid":
        return np.clip(a * x + b, 0, 1)
    if name == "Elu":
        return np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1))
    if name == "Softsign":
        return x / (1 + np.abs(x))
    if name == "Softplus":
        return np.logaddexp(0, x)
    raise AssertionError(name)  # recurrent_spec accepts only the names above


def _lstm_cell(spec, acts, x_t, h, c, w, r, bias, p):
    f_act, g_act, h_act = acts
    gates = x_t @ w.T + h @ r.T + bias
    i_pre, o_pre, f_pre, c_pre = np.split(gates, 4, axis=-1)
    clip = _clipper(spec)
    i = activate(clip(i_pre + p[0] * c), f_act)
    f = 1 - i if spec.input_forget else activate(clip(f_pre + p[2] * c), f_act)
    c_new = f * c + i * activate(clip(c_pre), g_act)
    o = activate(clip(o_pre + p[1] * c_new), f_act)
    return o * activate(c_new, h_act), c_new


def _gru_cell(spec, acts, x_t, h, c, w, r, bias, p):
    f_act, g_act = acts
    hidden = h.shape[-1]
    wb, rb = np.split(bias, 2)
    clip = _clipper(spec)
    xg = x_t @ w.T + wb
    zr = activate(clip(xg[:, : 2 * hidden] + h @ r[: 2 * hidden].T + rb[: 2 * hidden]), f_act)
    z, reset = zr[:, :hidden], zr[:, hidden:]
    r_h, rb_h = r[2 * hidden :], rb[2 * hidden :]
    if spec.linear_before_reset:
        candidate = xg[:, 2 * hidden :] + reset * (h @ r_h.T + rb_h)
    else:
        candidate = xg[:, 2 * hidden :] + (reset * h) @ r_h.T + rb_h
    candidate = activate(clip(candidate), g_act)
    return (1 - z) * candidate + z * h, c


def _rnn_cell(spec, acts, x_t, h, c, w, r, bias, p):
    return activate(_clipper(spec)(x_t @ w.T + h @ r.T + bias), acts[0]), c


def _clipper(spec: RecurrentSpec):
    if spec.clip is None:
        return lambda x: x
    return lambda x: np.clip(x, -spec.clip, spec.clip)


_CELLS = {"LSTM": _lstm_cell, "GRU": _gru_cell, "RNN": _rnn_cell}


def _run(op_type, x, w, r, b, seq_lens, h0, c0, p, attrs, wanted):
    spec = recurrent_spec(op_type, attrs, op_type)
    if spec.layout == 1:  # compute in layout 0
        x = x.transpose(1, 0, 2)
        h0 = None if h0 is None else h0.transpose(1, 0, 2)
        c0 = None if c0 is None else c0.transpose(1, 0, 2)
    steps, batch = x.shape[:2]
    hidden = r.shape[-1]
    dtype = x.dtype
    lens = np.full(batch, steps) if seq_lens is None else np.asarray(seq_lens).astype(np.int64)
    if lens.shape != (batch,) or np.any(lens < 0) or np.any(lens > steps):
        raise KernelError(f"sequence_lens {lens.tolist()}: expected {batch} lengths within [0, {steps}] (the sequence length)")
    ys, hs, cs = [], [], []
    for d, direction in enumerate(spec.directions):
        h = np.zeros((batch, hidden), dtype) if h0 is None else h0[d]
        c = np.zeros((batch, hidden), dtype) if c0 is None else c0[d]
        bias = np.zeros(2 * spec.gates * hidden, dtype) if b is None else b[d]
        if op_type != "GRU":
            bias = bias[: spec.gates * hidden] + bias[spec.gates * hidden :]
        peep = np.zeros((3, hidden), dtype) if p is None else p[d].reshape(3, hidden)
        y = np.zeros((steps, batch, hidden), dtype)
        order = range(steps) if direction == "forward" else range(steps - 1, -1, -1)
        for t in order:
            h_new, c_new = _CELLS[op_type](spec, spec.activations[d], x[t], h, c, w[d], r[d], bias, peep)
            live = (t < lens)[:, None]
            y[t] = np.where(live, h_new, 0)
            h, c = np.where(live, h_new, h), np.where(live, c_new, c)
        empty = (lens == 0)[:, None]  # an empty sequence's final state is 0, as ONNX Runtime gives it
        ys.append(y)
        hs.append(np.where(empty, 0, h))
        cs.append(np.where(empty, 0, c))
    y_all, h_all, c_all = np.stack(ys, 1), np.stack(hs), np.stack(cs)
    if spec.layout == 1:
        y_all, h_all, c_all = y_all.transpose(2, 0, 1, 3), h_all.transpose(1, 0, 2), c_all.transpose(1, 0, 2)
    outputs = (y_all.astype(dtype), h_all.astype(dtype), c_all.astype(dtype))
    return tuple(out if want else None for out, want in zip(outputs, wanted))


@cpu_kernel("LSTM")
def lstm(
    x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None, *, _wanted=(True, True, True), **attributes
):
    """The node's attributes go to ``recurrent_spec`` (gradgen/ops/recurrent.py), which holds their
    defaults and checks, for the three ops alike."""
    return _run("LSTM", x, w, r, b, sequence_lens, initial_h, initial_c, p, attributes, _wanted)


@cpu_kernel("GRU")
def gru(x, w, r, b=None, sequence_lens=None, initial_h=None, *, _wanted=(True, True), **attributes):
    return _run("GRU", x, w, r, b, sequence_lens, initial_h, None, None, attributes, _wanted)


@cpu_kernel("RNN")
def rnn(x, w, r, b=None, sequence_lens=None, initial_h=None, *, _wanted=(True, True), **attributes):
    return _run("RNN", x, w, r, b, sequence_lens, initial_h, None, None, attributes, _wanted)
