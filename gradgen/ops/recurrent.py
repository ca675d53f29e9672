"""The recurrent ops (LSTM, GRU, RNN): their attributes as one ``RecurrentSpec``.

One reading of the attributes for the CPU kernel (gradgen/kernels/cpu/recurrent.py) and the
unrolling pass (gradgen/passes/recurrent.py). The activation list and its ``activation_alpha`` /
``activation_beta`` values are read as ONNX Runtime reads them: one list of activations per
direction (f, g, h for LSTM; f, g for GRU; f for RNN), and the alpha / beta values consumed in that
order by the activations that take one, each other activation taking its ONNX default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from gradgen.errors import ModelError

RECURRENT_OPS = ("LSTM", "GRU", "RNN")

# gates per op, in the order of the rows of W and R: LSTM iofc, GRU zrh, RNN i
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}

# activation -> (default alpha, default beta); None where the activation takes no such value
ACTIVATION_PARAMETERS: dict[str, tuple[float | None, float | None]] = {
    "Relu": (None, None),
    "Tanh": (None, None),
    "Sigmoid": (None, None),
    "Affine": (1.0, 0.0),
    "LeakyRelu": (0.01, None),
    "ThresholdedRelu": (1.0, None),
    "ScaledTanh": (1.0, 1.0),
    "HardSigmoid": (0.2, 0.5),
    "Elu": (1.0, None),
    "Softsign": (None, None),
    "Softplus": (None, None),
}
# activations whose default values ONNX Runtime does not take from the spec (which names the ONNX
# operators' defaults, and Affine and ScaledTanh have no operator any more): they need theirs given
NEEDS_EXPLICIT_PARAMETERS = ("Affine", "ScaledTanh", "ThresholdedRelu")
_BY_LOWER = {name.lower(): name for name in ACTIVATION_PARAMETERS}


@dataclasses.dataclass(frozen=True)
class Activation:
    name: str  # one of ACTIVATION_PARAMETERS
    alpha: float | None = None
    beta: float | None = None


@dataclasses.dataclass(frozen=True)
class RecurrentSpec:
    op_type: str
    directions: tuple[str, ...]  # ("forward",), ("reverse",) or ("forward", "reverse")
    hidden_size: int | None
    layout: int  # 0: [seq, batch, ...]; 1: [batch, seq, ...]
    clip: float | None
    input_forget: bool  # LSTM: f = 1 - i
    linear_before_reset: bool  # GRU
    activations: tuple[tuple[Activation, ...], ...]  # per direction

    @property
    def gates(self) -> int:
        return GATES[self.op_type]


def recurrent_spec(op_type: str, attrs: Mapping[str, Any], where: str) -> RecurrentSpec:
    """The attributes of one LSTM / GRU / RNN node; ``where`` names the node in errors."""
    direction = _text(attrs.get("direction", "forward"))
    directions = {"forward": ("forward",), "reverse": ("reverse",), "bidirectional": ("forward", "reverse")}.get(direction)
    if directions is None:
        raise ModelError(f"{where}: direction {direction!r}: expected forward, reverse or bidirectional")
    layout = int(attrs.get("layout", 0))
    if layout not in (0, 1):
        raise ModelError(f"{where}: layout {layout}: expected 0 or 1")
    clip = attrs.get("clip")
    if clip is not None and not float(clip) > 0:
        raise ModelError(f"{where}: clip {clip}: expected a positive threshold")
    hidden = attrs.get("hidden_size")
    return RecurrentSpec(
        op_type,
        directions,
        None if hidden is None else int(hidden),
        layout,
        None if clip is None else float(clip),
        bool(attrs.get("input_forget", 0)),
        bool(attrs.get("linear_before_reset", 0)),
        _activations(op_type, attrs, len(directions), where),
    )


def _activations(op_type: str, attrs: Mapping[str, Any], num_directions: int, where: str) -> tuple[tuple[Activation, ...], ...]:
    per_direction = len(DEFAULT_ACTIVATIONS[op_type])
    names = [_text(n) for n in attrs.get("activations") or []] or list(DEFAULT_ACTIVATIONS[op_type]) * num_directions
    if len(names) != per_direction * num_directions:
        raise ModelError(
            f"{where}: {len(names)} activations for {num_directions} direction(s); {op_type} takes {per_direction} per direction"
        )
    unknown = [n for n in names if n.lower() not in _BY_LOWER]
    if unknown:
        raise ModelError(f"{where}: activation {unknown[0]!r} is not supported; supported: {', '.join(ACTIVATION_PARAMETERS)}")
    alphas = [float(a) for a in attrs.get("activation_alpha") or []]
    betas = [float(b) for b in attrs.get("activation_beta") or []]
    parsed = []
    for name in (_BY_LOWER[n.lower()] for n in names):
        alpha, beta = ACTIVATION_PARAMETERS[name]
        if name in NEEDS_EXPLICIT_PARAMETERS and (not alphas or (beta is not None and not betas)):
            raise ModelError(
                f"{where}: activation {name} needs its values in activation_alpha"
                + (" and activation_beta" if beta is not None else "")
                + " (its defaults differ between the ONNX spec and ONNX Runtime)"
            )
        if alpha is not None and alphas:
            alpha = alphas.pop(0)
        if beta is not None and betas:
            beta = betas.pop(0)
        parsed.append(Activation(name, alpha, beta))
    return tuple(tuple(parsed[d * per_direction : (d + 1) * per_direction]) for d in range(num_directions))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
