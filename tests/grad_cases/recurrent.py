"""Finite-difference cases: LSTM, GRU, RNN, differentiated through their unrolled form (static
shapes) and through a Loop over the time steps (the symbolic-shape variant: a length known only at
run time). Every float input is differentiated: X, W, R, B, initial_h, initial_c, P.
"""

import numpy as np

from tests.gradcheck import GradCase

rng = np.random.default_rng(15)
T, B, I, H = 3, 2, 3, 2
LENS = np.array([2, 3], dtype=np.int32)  # a shorter sequence in the batch


def r(*shape, scale=0.6):
    return rng.uniform(-scale, scale, shape)


def inputs(op_type, directions=1, layout=0, lens=None, initial=True, bias=True, peepholes=False):
    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op_type]
    x = r(*((B, T, I) if layout else (T, B, I)), scale=1.5)
    state = (B, directions, H) if layout else (directions, B, H)
    found = [x, r(directions, gates * H, I), r(directions, gates * H, H), r(directions, 2 * gates * H) if bias else None, lens]
    found.append(r(*state) if initial else None)
    if op_type == "LSTM":
        found += [r(*state) if initial else None, r(directions, 3 * H) if peepholes else None]
    while found[-1] is None:
        found.pop()
    return found


def case(op_type, name, attrs=None, num_outputs=None, **kw):
    directions = 2 if (attrs or {}).get("direction") == "bidirectional" else 1
    layout = (attrs or {}).get("layout", 0)
    return GradCase(
        op_type,
        inputs(op_type, directions, layout, **kw),
        {"hidden_size": H, **(attrs or {})},
        num_outputs=num_outputs or (3 if op_type == "LSTM" else 2),
        opset=14,
        name=f"{op_type}-{name}",
    )


CASES = [
    case("LSTM", "forward-peepholes", peepholes=True),
    case("LSTM", "reverse-layout1", {"direction": "reverse", "layout": 1}),
    case("LSTM", "bidirectional-lens-peepholes", {"direction": "bidirectional"}, lens=LENS, peepholes=True),
    case("LSTM", "reverse-lens-layout1", {"direction": "reverse", "layout": 1}, lens=LENS),
    case("LSTM", "empty-sequence", {"direction": "bidirectional"}, lens=np.array([0, 3], dtype=np.int32)),
    case("LSTM", "clip-input_forget", {"clip": 0.8, "input_forget": 1}, peepholes=True),
    case("LSTM", "no-initial-no-bias", initial=False, bias=False),
    case("LSTM", "only-Y", {"direction": "bidirectional"}, num_outputs=1),
    case(
        "LSTM",
        "activations",
        {"activations": ["HardSigmoid", "Softsign", "Elu"], "activation_alpha": [0.3, 0.9], "activation_beta": [0.45]},
    ),
    case("GRU", "forward", initial=True),
    case("GRU", "linear_before_reset", {"linear_before_reset": 1}),
    case("GRU", "bidirectional-lens-lbr", {"direction": "bidirectional", "linear_before_reset": 1}, lens=LENS),
    case("GRU", "reverse-layout1-lens", {"direction": "reverse", "layout": 1}, lens=LENS),
    case("GRU", "clip-no-initial", {"clip": 0.7, "linear_before_reset": 1}, initial=False),
    case(
        "GRU",
        "activations",
        {"activations": ["Sigmoid", "ScaledTanh"], "activation_alpha": [1.2], "activation_beta": [0.7]},
    ),
    case("RNN", "forward"),
    case("RNN", "bidirectional-lens-layout1", {"direction": "bidirectional", "layout": 1}, lens=LENS),
    case(
        "RNN",
        "affine-no-initial",
        {"activations": ["Affine"], "activation_alpha": [0.8], "activation_beta": [0.1]},
        initial=False,
    ),
    case("RNN", "leakyrelu-clip", {"activations": ["LeakyRelu"], "activation_alpha": [0.2], "clip": 1.0}),
]
