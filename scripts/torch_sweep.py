"""Sweep small PyTorch modules through both ONNX exporters and gradgen, against PyTorch autograd.

Usage::

    python scripts/torch_sweep.py --list
    python scripts/torch_sweep.py [CASE_OR_GROUP ...] [--out results.jsonl] [--dtype float64]
                                  [--exporters legacy,dynamo] [--no-rerun] [--device cuda]

Each case builds a tiny module whose ``forward`` returns a scalar loss (a loss function directly;
any other module as ``(out * w).sum()`` with a fixed random ``w``), and its inputs. For each exporter

- ``legacy``: ``torch.onnx.export(dynamo=False)``, opset 17, no constant folding, training=PRESERVE;
- ``dynamo``: ``torch.onnx.export(dynamo=True, optimize=False)`` (the dynamo optimizer folds parts of
  parameters into constants),

the harness exports the module, runs the exported forward on ONNX Runtime (an exporter problem shows
as ORT disagreeing with torch), builds the backward graph with ``gradgen.build_backward(wrt_inputs=True)``
(every float initializer and float graph input), runs it on gradgen's CPU ``Session`` and compares the
loss and every gradient with PyTorch autograd on the same inputs.

Gradient tensors are matched by name: graph inputs by the names given to the exporter, initializers by
the module's parameter / buffer names (float buffers get a reference gradient too); an initializer
stored transposed is compared transposed. The score of a tensor is ``max|g - g_ref| / max|g_ref|``;
tensors whose reference is (near) zero everywhere are scored by ``max|g|`` and reported separately
(``zero_ref``). Gradients gradgen gives that have no torch counterpart are listed as ``unmatched``.

In float32 a case whose worst score exceeds ``--rerun-above`` is rerun in float64 (module and inputs
cast) so that a real disagreement can be told from rounding. One JSON line per (case, exporter,
dtype) goes to ``--out``; a table goes to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    """A module returning a scalar loss, its example inputs (names -> tensors) and export options."""

    module: nn.Module
    inputs: dict[str, torch.Tensor]
    dynamic_axes: dict[str, dict[int, str]] | None = None
    exporters: tuple[str, ...] = ("legacy", "dynamo")
    note: str = ""
    # inputs fed to the ONNX model in place of the example ones (a dynamic-length check)
    run_inputs: dict[str, torch.Tensor] | None = None


CASES: dict[str, tuple[str, Callable[[], Case]]] = {}


def case(group: str):
    def register(fn: Callable[[], Case]) -> Callable[[], Case]:
        CASES[fn.__name__] = (group, fn)
        return fn

    return register


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(*shape, generator=_gen(seed))


def randint(high: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_gen(seed))


class Lambda(nn.Module):
    """``forward(*inputs) = fn(self, *inputs)``: parameters and buffers attached by ``setup``."""

    def __init__(self, fn: Callable[..., torch.Tensor], **tensors: torch.Tensor):
        super().__init__()
        self.fn = fn
        for name, t in tensors.items():
            self.register_parameter(name, nn.Parameter(t.clone()))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(self, *inputs)


class Weighted(nn.Module):
    """``(inner(*inputs) * w).sum()`` (tuple outputs: summed over each float output) with a fixed
    random ``w`` per output, held as a buffer (an initializer: its gradient is compared too)."""

    def __init__(self, inner: nn.Module, example: tuple[torch.Tensor, ...]):
        super().__init__()
        self.inner = inner
        with torch.no_grad():
            outs = inner(*example)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        self.n = len(outs)
        for k, o in enumerate(outs):
            self.register_buffer(f"w{k}", randn(*o.shape, seed=100 + k) if o.is_floating_point() else None)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        outs = self.inner(*inputs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        total = None
        for k, o in enumerate(outs):
            w = getattr(self, f"w{k}")
            if w is None:
                continue
            term = (o * w).sum()
            total = term if total is None else total + term
        assert total is not None
        return total


def fn_case(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], *, params=None, **kw) -> Case:
    """A case for ``fn(module, *inputs)``, weighted to a scalar unless it already returns one."""
    inner = Lambda(fn, **(params or {}))
    with torch.no_grad():
        out = inner(*inputs.values())
    module = inner if isinstance(out, torch.Tensor) and out.dim() == 0 else Weighted(inner, tuple(inputs.values()))
    return Case(module, inputs, **kw)


def loss_case(loss: nn.Module, inputs: dict[str, torch.Tensor], **kw) -> Case:
    """A loss module; ``reduction='none'`` outputs are weighted to a scalar."""
    with torch.no_grad():
        out = loss(*inputs.values())
    module = loss if out.dim() == 0 else Weighted(loss, tuple(inputs.values()))
    return Case(module, inputs, **kw)


# ---- losses ---------------------------------------------------------------------------------


def _nll(reduction: str, shape: tuple[int, ...], *, weight: bool = True, ignore: int = 1) -> Case:
    n, c, *rest = shape
    logits = randn(*shape)
    target = randint(c, n, *rest, seed=1)
    target.view(-1)[::3] = ignore  # some ignored positions
    w = rand(c, seed=2) + 0.5 if weight else None
    loss = nn.NLLLoss(weight=w, ignore_index=ignore, reduction=reduction)
    module = Lambda(lambda m, x, t: loss(F.log_softmax(x, 1), t))
    module.loss = loss
    with torch.no_grad():
        out = module(logits, target)
    if out.dim():
        module = Weighted(module, (logits, target))
    return Case(module, {"x": logits, "target": target})


for _red in ("mean", "sum", "none"):
    for _dims, _shape in (("2d", (8, 5)), ("3d", (2, 5, 3)), ("4d", (2, 4, 3, 2))):

        def _make(_red=_red, _shape=_shape) -> Case:
            return _nll(_red, _shape)

        _make.__name__ = f"nll_{_dims}_{_red}"
        case("loss")(_make)


@case("loss")
def nll_2d_mean_noweight() -> Case:
    return _nll("mean", (4, 5), weight=False, ignore=-100)


@case("loss")
def nll_mean_all_but_one_ignored() -> Case:
    x = randn(4, 5)
    t = torch.tensor([1, 1, 3, 1])
    loss = nn.NLLLoss(weight=rand(5, seed=2) + 0.5, ignore_index=1)
    return Case(Lambda(lambda m, x, t: loss(F.log_softmax(x, 1), t)), {"x": x, "target": t})


def _ce(reduction="mean", smoothing=0.0, shape=(8, 5), weight=True, ignore=1) -> Case:
    n, c, *rest = shape
    x = randn(*shape)
    t = randint(c, n, *rest, seed=1)
    t.view(-1)[::3] = ignore
    w = rand(c, seed=2) + 0.5 if weight else None
    return loss_case(
        nn.CrossEntropyLoss(weight=w, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction), {"x": x, "target": t}
    )


@case("loss")
def ce_weight_ignore_mean() -> Case:
    return _ce()


@case("loss")
def ce_weight_ignore_smooth_mean() -> Case:
    return _ce(smoothing=0.1)


@case("loss")
def ce_weight_ignore_smooth_sum() -> Case:
    return _ce(reduction="sum", smoothing=0.2)


@case("loss")
def ce_weight_ignore_smooth_none() -> Case:
    return _ce(reduction="none", smoothing=0.2)


@case("loss")
def ce_smooth_4d_mean() -> Case:
    return _ce(shape=(2, 4, 3, 2), smoothing=0.1)


@case("loss")
def ce_smooth_noweight_mean() -> Case:
    return _ce(smoothing=0.1, weight=False, ignore=-100)


@case("loss")
def ce_prob_target() -> Case:
    x = randn(4, 5)
    p = torch.softmax(randn(4, 5, seed=1), 1)
    return loss_case(nn.CrossEntropyLoss(), {"x": x, "target": p})


@case("loss")
def ce_prob_target_weight_smooth() -> Case:
    x = randn(4, 5)
    p = torch.softmax(randn(4, 5, seed=1), 1)
    return loss_case(nn.CrossEntropyLoss(weight=rand(5, seed=2) + 0.5, label_smoothing=0.1), {"x": x, "target": p})


@case("loss")
def bce() -> Case:
    p = torch.sigmoid(randn(4, 3))
    return loss_case(nn.BCELoss(weight=rand(4, 3, seed=2) + 0.5), {"p": p, "target": rand(4, 3, seed=1)})


@case("loss")
def bce_with_logits_pos_weight() -> Case:
    x = randn(4, 3)
    return loss_case(nn.BCEWithLogitsLoss(pos_weight=rand(3, seed=2) + 0.5), {"x": x, "target": rand(4, 3, seed=1)})


@case("loss")
def bce_with_logits_none() -> Case:
    x = randn(4, 3) * 4
    return loss_case(nn.BCEWithLogitsLoss(reduction="none", weight=rand(3, seed=3)), {"x": x, "target": rand(4, 3, seed=1)})


@case("loss")
def kldiv_batchmean() -> Case:
    x = F.log_softmax(randn(4, 5), 1)
    return loss_case(nn.KLDivLoss(reduction="batchmean"), {"x": x, "target": torch.softmax(randn(4, 5, seed=1), 1)})


@case("loss")
def kldiv_log_target() -> Case:
    x = F.log_softmax(randn(4, 5), 1)
    return loss_case(nn.KLDivLoss(reduction="sum", log_target=True), {"x": x, "target": F.log_softmax(randn(4, 5, seed=1), 1)})


@case("loss")
def smooth_l1_beta() -> Case:
    return loss_case(nn.SmoothL1Loss(beta=0.5), {"x": randn(4, 5), "target": randn(4, 5, seed=1)})


@case("loss")
def huber_delta() -> Case:
    return loss_case(nn.HuberLoss(delta=0.7, reduction="sum"), {"x": randn(4, 5), "target": randn(4, 5, seed=1)})


@case("loss")
def l1() -> Case:
    return loss_case(nn.L1Loss(), {"x": randn(4, 5), "target": randn(4, 5, seed=1)})


@case("loss")
def mse() -> Case:
    return loss_case(nn.MSELoss(), {"x": randn(4, 5), "target": randn(4, 5, seed=1)})


@case("loss")
def cosine_embedding() -> Case:
    y = torch.tensor([1.0, -1.0, 1.0, -1.0])
    return loss_case(nn.CosineEmbeddingLoss(margin=0.1), {"a": randn(4, 6), "b": randn(4, 6, seed=1), "y": y})


@case("loss")
def margin_ranking() -> Case:
    y = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    return loss_case(nn.MarginRankingLoss(margin=0.2), {"a": randn(5), "b": randn(5, seed=1), "y": y})


@case("loss")
def multi_margin() -> Case:
    return loss_case(
        nn.MultiMarginLoss(p=1, margin=0.8, weight=rand(5, seed=2) + 0.5), {"x": randn(4, 5), "target": randint(5, 4, seed=1)}
    )


@case("loss")
def multi_margin_p2() -> Case:
    return loss_case(nn.MultiMarginLoss(p=2), {"x": randn(4, 5), "target": randint(5, 4, seed=1)})


@case("loss")
def multilabel_soft_margin() -> Case:
    t = (rand(4, 5, seed=1) > 0.5).float()
    return loss_case(nn.MultiLabelSoftMarginLoss(weight=rand(5, seed=2) + 0.5), {"x": randn(4, 5), "target": t})


@case("loss")
def soft_margin() -> Case:
    t = torch.where(rand(4, 5, seed=1) > 0.5, 1.0, -1.0)
    return loss_case(nn.SoftMarginLoss(), {"x": randn(4, 5), "target": t})


@case("loss")
def hinge_embedding() -> Case:
    t = torch.where(rand(4, 5, seed=1) > 0.5, 1.0, -1.0)
    return loss_case(nn.HingeEmbeddingLoss(margin=1.5), {"x": randn(4, 5).abs(), "target": t})


@case("loss")
def poisson_nll_log() -> Case:
    return loss_case(nn.PoissonNLLLoss(log_input=True), {"x": randn(4, 5), "target": rand(4, 5, seed=1) * 3})


@case("loss")
def poisson_nll_full() -> Case:
    return loss_case(nn.PoissonNLLLoss(log_input=False, full=True), {"x": rand(4, 5) + 0.1, "target": rand(4, 5, seed=1) * 3})


@case("loss")
def gaussian_nll() -> Case:
    return loss_case(nn.GaussianNLLLoss(), {"x": randn(4, 5), "target": randn(4, 5, seed=1), "var": rand(4, 5, seed=2) + 0.1})


@case("loss")
def gaussian_nll_full_var1() -> Case:
    return loss_case(
        nn.GaussianNLLLoss(full=True), {"x": randn(4, 5), "target": randn(4, 5, seed=1), "var": rand(4, 1, seed=2) + 0.1}
    )


@case("loss")
def triplet_margin() -> Case:
    return loss_case(
        nn.TripletMarginLoss(margin=0.5, p=2), {"a": randn(4, 6), "p": randn(4, 6, seed=1), "n": randn(4, 6, seed=2)}
    )


@case("loss")
def triplet_margin_swap_p1() -> Case:
    return loss_case(
        nn.TripletMarginLoss(margin=2.0, p=1, swap=True), {"a": randn(4, 6), "p": randn(4, 6, seed=1), "n": randn(4, 6, seed=2)}
    )


@case("loss")
def ctc() -> Case:
    t, n, c, s = 6, 2, 4, 3
    logp = F.log_softmax(randn(t, n, c), 2)
    targets = torch.randint(1, c, (n, s), generator=_gen(1))
    il = torch.full((n,), t, dtype=torch.long)
    tl = torch.tensor([3, 2])
    return loss_case(nn.CTCLoss(), {"logp": logp, "targets": targets, "il": il, "tl": tl})


# ---- activations ------------------------------------------------------------------------------


def _act(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor | None = None) -> Case:
    x = randn(3, 8) * 3 if x is None else x
    return fn_case(lambda m, x: fn(x), {"x": x})


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softplus": F.softplus,
    "softplus_beta_threshold": lambda x: F.softplus(x, beta=2.0, threshold=3.0),
    "mish": F.mish,
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "silu": F.silu,
    "elu": lambda x: F.elu(x, alpha=0.7),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=1.3),
    "gelu_erf": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.15),
    "relu6": F.relu6,
    "hardtanh": lambda x: F.hardtanh(x, -1.5, 2.0),
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
    "hardshrink": lambda x: F.hardshrink(x, 0.7),
    "softshrink": lambda x: F.softshrink(x, 0.7),
    "logsigmoid": F.logsigmoid,
    "threshold": lambda x: F.threshold(x, 0.3, -2.0),
    "glu": lambda x: F.glu(x, -1),
    "softmin": lambda x: F.softmin(x, 1),
    "log_softmax": lambda x: F.log_softmax(x, 1),
    "softmax_dim0": lambda x: F.softmax(x, 0),
    "rrelu_eval": lambda x: F.rrelu(x, training=False),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
for _name, _fn in _ACTIVATIONS.items():

    def _make(_fn=_fn) -> Case:
        return _act(_fn)

    _make.__name__ = f"act_{_name}"
    case("activation")(_make)


@case("activation")
def act_prelu_one() -> Case:
    return Case(Weighted(nn.PReLU(init=0.3), (randn(3, 4, 5),)), {"x": randn(3, 4, 5)})


@case("activation")
def act_prelu_channel() -> Case:
    m = nn.PReLU(4)
    with torch.no_grad():
        m.weight.copy_(rand(4, seed=3))
    x = randn(3, 4, 5)
    return Case(Weighted(m, (x,)), {"x": x})


@case("activation")
def act_prelu_channel_4d() -> Case:
    m = nn.PReLU(4)
    with torch.no_grad():
        m.weight.copy_(rand(4, seed=3))
    x = randn(2, 4, 3, 3)
    return Case(Weighted(m, (x,)), {"x": x})


# ---- attention --------------------------------------------------------------------------------


def _sdpa(**kw: Any) -> Callable[..., torch.Tensor]:
    return lambda m, q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *(mask or ()), **kw)


@case("attention")
def sdpa_plain() -> Case:
    return fn_case(_sdpa(), {"q": randn(2, 2, 5, 4), "k": randn(2, 2, 6, 4, seed=1), "v": randn(2, 2, 6, 4, seed=2)})


@case("attention")
def sdpa_causal() -> Case:
    return fn_case(
        _sdpa(is_causal=True), {"q": randn(2, 2, 5, 4), "k": randn(2, 2, 5, 4, seed=1), "v": randn(2, 2, 5, 4, seed=2)}
    )


@case("attention")
def sdpa_causal_rect() -> Case:
    return fn_case(
        _sdpa(is_causal=True), {"q": randn(2, 2, 3, 4), "k": randn(2, 2, 5, 4, seed=1), "v": randn(2, 2, 5, 4, seed=2)}
    )


@case("attention")
def sdpa_bool_mask() -> Case:
    mask = rand(5, 6, seed=3) > 0.3
    mask[:, 0] = True
    return fn_case(
        lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        {"q": randn(2, 2, 5, 4), "k": randn(2, 2, 6, 4, seed=1), "v": randn(2, 2, 6, 4, seed=2), "mask": mask},
    )


@case("attention")
def sdpa_float_mask() -> Case:
    return fn_case(
        lambda m, q, k, v, mask: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        {
            "q": randn(2, 2, 5, 4),
            "k": randn(2, 2, 6, 4, seed=1),
            "v": randn(2, 2, 6, 4, seed=2),
            "mask": randn(2, 1, 5, 6, seed=3),
        },
    )


@case("attention")
def sdpa_scale() -> Case:
    return fn_case(_sdpa(scale=0.3), {"q": randn(2, 2, 5, 4), "k": randn(2, 2, 6, 4, seed=1), "v": randn(2, 2, 6, 4, seed=2)})


@case("attention")
def sdpa_gqa() -> Case:
    return fn_case(
        _sdpa(enable_gqa=True), {"q": randn(2, 4, 5, 4), "k": randn(2, 2, 6, 4, seed=1), "v": randn(2, 2, 6, 4, seed=2)}
    )


@case("attention")
def mha_kdim_vdim_float_mask() -> Case:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=5, batch_first=True)
    q, k, v = randn(2, 4, 8), randn(2, 3, 6, seed=1), randn(2, 3, 5, seed=2)
    mask = randn(4, 3, seed=3)
    inner = Lambda(lambda m, q, k, v, mask: m.mha(q, k, v, attn_mask=mask, need_weights=False)[0])
    inner.mha = mha
    ins = {"q": q, "k": k, "v": v, "mask": mask}
    return Case(Weighted(inner, tuple(ins.values())), ins)


@case("attention")
def mha_self_key_padding() -> Case:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = randn(2, 4, 8)
    pad = torch.tensor([[False, False, False, True], [False, False, True, True]])
    inner = Lambda(lambda m, x, pad: m.mha(x, x, x, key_padding_mask=pad, need_weights=True)[0])
    inner.mha = mha
    ins = {"x": x, "pad": pad}
    return Case(Weighted(inner, tuple(ins.values())), ins)


@case("attention")
def mha_need_weights_avg() -> Case:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, bias=False, add_bias_kv=True)
    x = randn(2, 4, 8)
    inner = Lambda(lambda m, x: m.mha(x, x, x, need_weights=True))
    inner.mha = mha
    return Case(Weighted(inner, (x,)), {"x": x})


# ---- math / indexing ------------------------------------------------------------------------


def _fn(name: str, fn: Callable[..., torch.Tensor], group: str = "math", **inputs: torch.Tensor) -> None:
    def make() -> Case:
        return fn_case(lambda m, *xs: fn(*xs), dict(inputs))

    make.__name__ = name
    case(group)(make)


_x = randn(3, 5)
_fn("norm_p3", lambda x: torch.linalg.vector_norm(x, 3, dim=1), x=_x)
_fn("norm_inf", lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1), x=_x)
_fn("norm_ninf", lambda x: torch.linalg.vector_norm(x, float("-inf"), dim=1), x=_x)
_fn("norm_fro_all", lambda x: torch.norm(x), x=_x)
_fn("norm_p1", lambda x: torch.norm(x, p=1, dim=0), x=_x)
_fn("cdist_p2", lambda a, b: torch.cdist(a, b), a=randn(2, 4, 3), b=randn(2, 5, 3, seed=1))
_fn("cdist_p1", lambda a, b: torch.cdist(a, b, p=1.0), a=randn(2, 4, 3), b=randn(2, 5, 3, seed=1))
_fn("normalize", lambda x: F.normalize(x, dim=1), x=_x)
_fn("normalize_p1_zero_row", lambda x: F.normalize(x * torch.tensor([[1.0], [0.0], [1.0]]), p=1, dim=1), x=_x)
_fn("std_unbiased", lambda x: torch.std(x, dim=1), x=_x)
_fn("std_biased", lambda x: torch.std(x, dim=1, unbiased=False), x=_x)
_fn("var_unbiased_all", lambda x: torch.var(x), x=_x)
_fn("var_correction0_keepdim", lambda x: torch.var(x, dim=0, correction=0, keepdim=True), x=_x)
_fn("var_mean", lambda x: torch.stack(torch.var_mean(x, dim=1)), x=_x)
_fn("logsumexp", lambda x: torch.logsumexp(x, dim=1), x=_x)
_fn("logsumexp_large", lambda x: torch.logsumexp(x * 100, dim=0), x=_x)
_fn("prod", lambda x: torch.prod(x, dim=1), x=_x)
_fn("prod_one_zero", lambda x: torch.prod(x * torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]), dim=1), x=_x)
_fn("prod_two_zeros", lambda x: torch.prod(x * torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]), dim=1), x=_x)
_fn("prod_all_with_zero", lambda x: torch.prod(x * torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])), x=_x)
_fn("cosine_similarity", lambda a, b: F.cosine_similarity(a, b, dim=1), a=_x, b=randn(3, 5, seed=1))
_fn("pairwise_distance", lambda a, b: F.pairwise_distance(a, b), a=_x, b=randn(3, 5, seed=1))
_fn("triu_tril", lambda x: torch.triu(x, 1) + torch.tril(x, -1) * 2, x=randn(4, 4))
_fn("roll", lambda x: torch.roll(x, (1, -2), (0, 1)), x=_x)
_fn("roll_flat", lambda x: torch.roll(x, 3), x=_x)
_fn("repeat_interleave", lambda x: torch.repeat_interleave(x, 2, dim=1), x=_x)
_fn("repeat_interleave_tensor", lambda x: torch.repeat_interleave(x, torch.tensor([1, 2, 3]), dim=0), x=_x)
_fn("chunk_cat", lambda x: torch.cat(list(reversed(torch.chunk(x, 3, dim=1))), dim=1), x=_x)
_fn("atan2", torch.atan2, y=_x, x=randn(3, 5, seed=1))
_fn("hypot", torch.hypot, a=_x, b=randn(3, 5, seed=1))
_fn("fmod", lambda a, b: torch.fmod(a * 3, b), a=_x, b=randn(3, 5, seed=1) + 2.0)
_fn("remainder", lambda a, b: torch.remainder(a * 3, b), a=_x, b=randn(3, 5, seed=1) + 2.0)
_fn("remainder_scalar", lambda a: torch.remainder(a * 3, 1.5), a=_x)
_fn("sign_abs_at_zero", lambda x: torch.abs(x * torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])) + torch.sign(x), x=_x)
_fn(
    "maximum_ties", lambda a, b: torch.maximum(a, b), a=torch.tensor([1.0, 2.0, 3.0, -1.0]), b=torch.tensor([1.0, 0.0, 3.0, -1.0])
)
_fn(
    "minimum_ties", lambda a, b: torch.minimum(a, b), a=torch.tensor([1.0, 2.0, 3.0, -1.0]), b=torch.tensor([1.0, 0.0, 3.0, -1.0])
)
_fn("max_reduce_ties", lambda x: torch.amax(x, dim=1), x=torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]))
_fn("max_dim_ties", lambda x: torch.max(x, dim=1).values, x=torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]))
_fn("max_all_ties", lambda x: torch.max(x), x=torch.tensor([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]))
_fn("clamp_equal_bounds", lambda x: torch.clamp(x, 0.5, 0.5), x=_x)
_fn("clamp_at_bound", lambda x: torch.clamp(x, -1.0, 1.0), x=torch.tensor([-1.0, -0.5, 1.0, 2.0, 0.0]))
_fn("relu_at_zero", F.relu, x=torch.tensor([-1.0, 0.0, 1.0]))
_fn(
    "clamp_tensor_bounds",
    lambda x, lo, hi: torch.clamp(x, lo, hi),
    x=_x,
    lo=randn(3, 5, seed=1) - 0.5,
    hi=randn(3, 5, seed=2) + 0.5,
)
_fn("det", torch.linalg.det, x=randn(2, 3, 3))
_fn("inverse", torch.linalg.inv, x=randn(2, 3, 3) + 3 * torch.eye(3))
_fn("matrix_power3", lambda x: torch.linalg.matrix_power(x, 3), x=randn(3, 3))
_fn("outer", torch.outer, a=randn(4), b=randn(3, seed=1))
_fn("kron", torch.kron, a=randn(2, 3), b=randn(2, 2, seed=1))
_fn("flip_narrow", lambda x: torch.flip(x, (0, 1)).narrow(1, 1, 3), x=_x)
_fn("unbind_stack", lambda x: torch.stack(list(reversed(torch.unbind(x, 1))), 0), x=_x)
_fn("take_along_dim", lambda x, i: torch.take_along_dim(x, i, dim=1), x=_x, i=randint(5, 3, 4, seed=1))
_fn("expand", lambda x: x.expand(2, 3, 5) * 1.0, x=randn(3, 1))
_fn("where_broadcast", lambda c, a, b: torch.where(c, a, b), c=rand(3, 1, seed=3) > 0.5, a=randn(1, 5), b=randn(3, 5, seed=1))
_fn("cumprod_zeros", lambda x: torch.cumprod(x * torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]), dim=1), x=_x)
_fn("cumprod", lambda x: torch.cumprod(x, dim=1), x=_x)
_fn(
    "einsum_bilinear",
    lambda a, w, b: torch.einsum("bi,ij,bj->b", a, w, b),
    a=randn(3, 4),
    w=randn(4, 5, seed=1),
    b=randn(3, 5, seed=2),
)
_fn("sqrt_rsqrt_pow", lambda x: torch.sqrt(x) + torch.rsqrt(x) + x**1.7 + torch.pow(1.3, x), x=rand(3, 5) + 0.1)
_fn("pow_tensor_tensor", torch.pow, a=rand(3, 5) + 0.5, b=randn(3, 5, seed=1))
_fn("log1p_expm1_erf", lambda x: torch.log1p(x.abs()) + torch.expm1(x) + torch.erf(x) + torch.erfinv(x.tanh() * 0.9), x=_x)
_fn(
    "trig",
    lambda x: (
        torch.sin(x) + torch.cos(x) + torch.tan(x * 0.3) + torch.asin(x.tanh() * 0.9) + torch.acos(x.tanh() * 0.9) + torch.atan(x)
    ),
    x=_x,
)
_fn(
    "hyperbolic",
    lambda x: torch.sinh(x) + torch.cosh(x) + torch.asinh(x) + torch.atanh(x.tanh() * 0.9) + torch.acosh(x.abs() + 1.5),
    x=_x,
)
_fn("reciprocal_div", lambda a, b: 1.0 / a + a / b, a=_x + 3.0, b=randn(3, 5, seed=1) + 3.0)
_fn("floor_round_frac", lambda x: torch.floor(x) + torch.round(x) + torch.frac(x) * x + torch.trunc(x), x=_x * 3)
_fn("min_max_reduce", lambda x: torch.amin(x, dim=0) + torch.amax(x, dim=0), x=_x)
_fn("argmax_gather", lambda x: x.gather(1, x.argmax(1, keepdim=True)), x=_x)
_fn("sort_values", lambda x: torch.sort(x, dim=1).values, x=_x)
_fn("topk", lambda x: torch.topk(x, 2, dim=1).values, x=_x)
_fn("cummax", lambda x: torch.cummax(x, dim=1).values, x=_x)
_fn("mean_dims_keepdim", lambda x: x.mean((0, 2), keepdim=True), x=randn(2, 3, 4))
_fn("index_select", lambda x, i: torch.index_select(x, 0, i), "indexing", x=_x, i=torch.tensor([2, 0, 2, 1]))
_fn("gather_dup_index", lambda x, i: torch.gather(x, 1, i), "indexing", x=_x, i=torch.tensor([[4, 0], [1, 1], [4, 4]]))
_fn(
    "gather_negative_via_mod",
    lambda x, i: torch.gather(x, 1, i % 5),
    "indexing",
    x=_x,
    i=torch.tensor([[-1, 0], [1, -2], [4, 4]]),
)
_fn("index_negative_tensor", lambda x, i: x[i], "indexing", x=_x, i=torch.tensor([-1, 0, -1]))
_fn("advanced_index_2d", lambda x, i, j: x[i, j], "indexing", x=_x, i=torch.tensor([0, 2, 2, 1]), j=torch.tensor([4, 0, 0, 3]))
_fn("advanced_index_slice", lambda x, i: x[:, i], "indexing", x=randn(3, 5, 2), i=torch.tensor([[0, 4], [4, 1]]))
_fn("advanced_index_bool", lambda x, m: x[m], "indexing", x=_x, m=rand(3, 5, seed=4) > 0.4)
_fn("masked_select", lambda x, m: torch.masked_select(x, m), "indexing", x=_x, m=rand(3, 5, seed=4) > 0.4)
_fn("masked_fill", lambda x, m: x.masked_fill(m, 0.5), "indexing", x=_x, m=rand(3, 5, seed=4) > 0.4)
_fn("masked_scatter", lambda x, m, s: x.masked_scatter(m, s), "indexing", x=_x, m=rand(3, 5, seed=4) > 0.4, s=randn(15, seed=5))


def _setitem(x: torch.Tensor, i: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x * 1.0
    x[i] = y
    return x


def _setitem_dup(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x * 1.0
    x[1:3, 2] = y
    return x


_fn("setitem_index", _setitem, "indexing", x=_x, i=torch.tensor([2, 0]), y=randn(2, 5, seed=1))
_fn("setitem_slice", _setitem_dup, "indexing", x=_x, y=randn(2, seed=1))
_fn("setitem_dup_index", _setitem, "indexing", x=_x, i=torch.tensor([1, 1]), y=randn(2, 5, seed=1))
_fn("index_put", lambda x, i, v: x.index_put((i,), v), "indexing", x=_x, i=torch.tensor([2, 0]), v=randn(2, 5, seed=1))
_fn(
    "index_put_accumulate",
    lambda x, i, v: x.index_put((i,), v, accumulate=True),
    "indexing",
    x=_x,
    i=torch.tensor([2, 0, 2]),
    v=randn(3, 5, seed=1),
)
_fn(
    "index_put_2d_acc",
    lambda x, i, j, v: x.index_put((i, j), v, accumulate=True),
    "indexing",
    x=_x,
    i=torch.tensor([2, 0, 2]),
    j=torch.tensor([1, 1, 1]),
    v=randn(3, seed=1),
)
_fn(
    "scatter",
    lambda x, i, s: x.scatter(1, i, s),
    "indexing",
    x=_x,
    i=torch.tensor([[0, 1], [2, 3], [4, 0]]),
    s=randn(3, 2, seed=1),
)
_fn(
    "scatter_add",
    lambda x, i, s: x.scatter_add(1, i, s),
    "indexing",
    x=_x,
    i=torch.tensor([[0, 0, 1], [2, 3, 2], [4, 4, 4]]),
    s=randn(3, 3, seed=1),
)
_fn(
    "index_add",
    lambda x, i, s: x.index_add(0, i, s, alpha=1.5),
    "indexing",
    x=_x,
    i=torch.tensor([2, 0, 2]),
    s=randn(3, 5, seed=1),
)
_fn("index_copy", lambda x, i, s: x.index_copy(0, i, s), "indexing", x=_x, i=torch.tensor([2, 0]), s=randn(2, 5, seed=1))
_IDX_SR = torch.tensor([[0, 0, 1, 3], [2, 2, 2, 4], [4, 0, 4, 0]])
for _reduce in ("sum", "prod", "amax", "amin", "mean"):
    for _inc in (True, False):

        def _make_sr(_reduce=_reduce, _inc=_inc) -> Case:
            return fn_case(
                lambda m, x, i, s: x.scatter_reduce(1, i, s, _reduce, include_self=_inc),
                {"x": randn(3, 5), "i": _IDX_SR, "s": randn(3, 4, seed=1)},
            )

        _make_sr.__name__ = f"scatter_reduce_{_reduce}_{'self' if _inc else 'noself'}"
        case("indexing")(_make_sr)


@case("indexing")
def scatter_reduce_amax_ties() -> Case:
    x = torch.tensor([[1.0, 2.0, 0.5], [0.0, 1.0, 3.0]])
    s = torch.tensor([[1.0, 2.0, 2.0], [3.0, 3.0, 1.0]])
    i = torch.tensor([[0, 1, 1], [2, 2, 0]])
    return fn_case(lambda m, x, i, s: x.scatter_reduce(1, i, s, "amax", include_self=True), {"x": x, "i": i, "s": s})


@case("indexing")
def embedding_padding_idx() -> Case:
    emb = nn.Embedding(6, 4, padding_idx=0)
    ids = torch.tensor([[0, 1, 2], [3, 0, 5]])
    return Case(Weighted(emb, (ids,)), {"ids": ids})


@case("indexing")
def embedding_scale_grad_by_freq() -> Case:
    emb = nn.Embedding(6, 4, padding_idx=2, scale_grad_by_freq=True)
    ids = torch.tensor([[0, 1, 2], [3, 0, 0]])
    return Case(Weighted(emb, (ids,)), {"ids": ids}, note="the legacy exporter keeps neither option")


@case("elementwise")
def straight_through_round() -> Case:
    """A straight-through estimator: round in the forward, the identity's gradient in the backward."""
    return fn_case(
        lambda m, x: ((x + (torch.round(x * 3) / 3 - x).detach()) ** 2).sum() + (x.detach() * x).sum(), {"x": randn(2, 5)}
    )


@case("indexing")
def embedding_bag_mean() -> Case:
    emb = nn.EmbeddingBag(6, 4, mode="mean")
    ids = torch.tensor([[0, 1, 2], [3, 0, 5]])
    return Case(Weighted(emb, (ids,)), {"ids": ids})


@case("indexing")
def embedding_max_norm() -> Case:
    emb = nn.Embedding(6, 4, max_norm=1.0)
    ids = torch.tensor([[0, 1, 2], [3, 0, 5]])
    return Case(Weighted(emb, (ids,)), {"ids": ids}, note="max_norm renormalises the weight in place")


# ---- control flow -------------------------------------------------------------------------------


class CondModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("w", randn(3, 4, seed=9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.lin(x)) * 2.0

        def false_fn(x: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(self.lin(x)) - x

        return (torch.cond(x.sum() > 0, true_fn, false_fn, (x,)) * self.w).sum()


@case("control")
def cond_true() -> Case:
    x = randn(3, 4).abs()
    return Case(CondModule(), {"x": x}, exporters=("dynamo",))


@case("control")
def cond_false() -> Case:
    x = -randn(3, 4).abs()
    return Case(CondModule(), {"x": x}, exporters=("dynamo",))


class ScriptedWhile(nn.Module):
    """A data-dependent while loop: the legacy exporter scripts it into an ONNX Loop."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(randn(4, 4, seed=3) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _while_body(x, self.w)


@torch.jit.script
def _while_body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    i = 0
    while x.abs().sum() < 100.0 and i < 10:
        x = torch.tanh(x @ w) * 3.0 + x
        i += 1
    return x.sum()


@case("control")
def while_loop_scripted() -> Case:
    return Case(ScriptedWhile(), {"x": randn(2, 4) * 0.1}, exporters=("legacy",))


class ScriptedFor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(randn(4, 4, seed=3) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _for_body(x, self.w)


@torch.jit.script
def _for_body(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.zeros(x.shape[0], 4)
    for t in range(x.shape[1]):
        h = torch.tanh(x[:, t] @ w + h)
    return (h * h).sum()


@case("control")
def for_loop_scripted_dynamic() -> Case:
    return Case(
        ScriptedFor(),
        {"x": randn(2, 3, 4)},
        exporters=("legacy",),
        dynamic_axes={"x": {1: "seq"}},
        run_inputs={"x": randn(2, 5, 4, seed=4)},
    )


class TracedLoop(nn.Module):
    """A Python loop over the sequence: traced, it is unrolled for the example length."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 4)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(torch.cat([x[:, t], h], 1)))
        return (h * h).sum()


@case("control")
def python_loop_dynamic_seq() -> Case:
    return Case(
        TracedLoop(),
        {"x": randn(2, 3, 4)},
        exporters=("legacy",),
        dynamic_axes={"x": {1: "seq"}},
        run_inputs={"x": randn(2, 5, 4, seed=4)},
        note="traced loop is unrolled for seq=3; the run feeds seq=5",
    )


@case("control")
def python_loop_static() -> Case:
    return Case(TracedLoop(), {"x": randn(2, 3, 4)})


class ScanModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(randn(4, 4, seed=3) * 0.5)
        self.register_buffer("wy", randn(2, 3, 4, seed=8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.scan import scan

        def step(h: torch.Tensor, xt: torch.Tensor):
            h2 = torch.tanh(xt @ self.w + h)
            return h2, h2 * 1.0

        h, ys = scan(step, torch.zeros(2, 4), x, dim=1)
        return (ys * self.wy).sum() + h.sum()


@case("control")
def scan_hop() -> Case:
    return Case(ScanModule(), {"x": randn(2, 3, 4)}, exporters=("dynamo",))


class GRUCase(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.gru(x)[0] ** 2).sum()


@case("control")
def gru_dynamic_seq() -> Case:
    return Case(
        GRUCase(),
        {"x": randn(2, 3, 4)},
        exporters=("legacy",),
        dynamic_axes={"x": {1: "seq"}},
        run_inputs={"x": randn(2, 5, 4, seed=4)},
    )


# --------------------------------------------------------------------------------------------
# Export, build, run, compare
# --------------------------------------------------------------------------------------------


def export(case_: Case, exporter: str):
    from gradgen.bench.models import dynamo_export, legacy_export

    names = list(case_.inputs)
    args = tuple(case_.inputs.values())
    if exporter == "legacy":
        with contextlib.redirect_stdout(io.StringIO()):  # the TorchScript graph dump of a failed export
            return legacy_export(case_.module, args, names, case_.dynamic_axes)
    dynamic_shapes = None
    if case_.dynamic_axes:
        dim = torch.export.Dim.AUTO
        dynamic_shapes = tuple({ax: dim for ax in case_.dynamic_axes.get(n, {})} or None for n in names)
        parameters = inspect.signature(case_.module.forward).parameters.values()
        if any(p.kind == p.VAR_POSITIONAL for p in parameters):  # forward(*args): one spec for the tuple
            dynamic_shapes = (dynamic_shapes,)
    return dynamo_export(case_.module, args, names, dynamic_shapes)


def torch_reference(module: nn.Module, inputs: dict[str, torch.Tensor]):
    """The loss and gradients w.r.t. every float input, parameter and float buffer (by name)."""
    ins = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
    notes: list[str] = []
    for name, t in ins.items():  # an input torch cannot differentiate (soft_margin_loss's target)
        if t.requires_grad:
            others = {n: u.detach() if n != name else u for n, u in ins.items()}
            try:
                module(*others.values())
            except RuntimeError as e:
                t.requires_grad_(False)
                notes.append(f"{name}: {str(e).splitlines()[0][:120]}")
    tensors: dict[str, torch.Tensor] = {n: t for n, t in ins.items() if t.is_floating_point()}
    saved = []
    for name, p in module.named_parameters():
        tensors[name] = p
    for name, b in module.named_buffers():
        if b is not None and b.is_floating_point():
            # a buffer torch cannot differentiate (a loss's class weights) gets no reference
            b.requires_grad_(True)
            try:
                module(*ins.values())
            except RuntimeError:
                b.requires_grad_(False)
                continue
            saved.append(b)
            tensors[name] = b
    module.zero_grad(set_to_none=True)
    try:
        loss = module(*ins.values())
        keys = [k for k, t in tensors.items() if t.requires_grad]
        try:
            grads = torch.autograd.grad(loss, [tensors[k] for k in keys], allow_unused=True)
            ref = {
                k: (g.detach().numpy() if g is not None else np.zeros(tuple(tensors[k].shape), tensors[k].detach().numpy().dtype))
                for k, g in zip(keys, grads)
            }
            missing: list[str] = notes
        except RuntimeError as e:  # a derivative torch does not implement (a loss's target)
            ref, missing = {}, [*notes, f"torch autograd: {str(e).splitlines()[0][:160]}"]
            for k in keys:
                try:
                    (g,) = torch.autograd.grad(module(*ins.values()), [tensors[k]], allow_unused=True)
                    ref[k] = (
                        g.detach().numpy()
                        if g is not None
                        else np.zeros(tuple(tensors[k].shape), tensors[k].detach().numpy().dtype)
                    )
                except RuntimeError:
                    missing.append(k)
    finally:
        for b in saved:
            b.requires_grad_(False)
    return float(loss.detach()), ref, missing


_ORT_CHILD = """
import sys, numpy as np, onnxruntime as ort
feeds = dict(np.load(sys.argv[2]))
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
print(repr(float(np.asarray(sess.run(None, feeds)[0]))))
"""


def ort_forward(proto, feeds: dict[str, np.ndarray]) -> float:
    """The loss ONNX Runtime computes, in a child process: ORT crashes on some exported models
    (a segmentation fault creating the session of dynamo's EmbeddingBag), which would end the sweep."""
    with tempfile.TemporaryDirectory() as tmp:
        path, npz = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "feeds.npz")
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())
        np.savez(npz, **feeds)
        done = subprocess.run([sys.executable, "-c", _ORT_CHILD, path, npz], capture_output=True, text=True, timeout=120)
    if done.returncode < 0:
        raise RuntimeError(f"onnxruntime crashed (signal {-done.returncode})")
    if done.returncode:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return float(done.stdout.strip().splitlines()[-1])


def fd_score(proto, feeds: dict[str, np.ndarray], name: str, grad: np.ndarray, eps: float = 1e-6) -> float:
    """``_score`` of ``grad`` against central differences of the exported model's loss (gradgen's
    forward, float64) in the initializer or input ``name``: for gradients torch does not define
    (a loss's class weights, targets)."""
    from onnx import numpy_helper

    from gradgen.executor import Session

    inits = {t.name: i for i, t in enumerate(proto.graph.initializer)}
    base = numpy_helper.to_array(proto.graph.initializer[inits[name]]) if name in inits else feeds[name]
    if base.dtype != np.float64 or base.size > 256:
        return math.nan

    def loss_at(value: np.ndarray) -> float:
        if name not in inits:
            return float(Session(proto).run({**feeds, name: value})["loss"])
        model = type(proto)()
        model.CopyFrom(proto)
        model.graph.initializer[inits[name]].CopyFrom(numpy_helper.from_array(value, name))
        return float(Session(model).run(feeds)["loss"])

    fd = np.zeros_like(base)
    for k in range(base.size):
        plus, minus = base.copy(), base.copy()
        plus.flat[k] += eps
        minus.flat[k] -= eps
        fd.flat[k] = (loss_at(plus) - loss_at(minus)) / (2 * eps)
    return _score(grad, fd, floor=1e-7)[0]  # central differences are exact to about 1e-9 here


def _score(g: np.ndarray, ref: np.ndarray, floor: float = 1e-12) -> tuple[float, bool]:
    """(score, zero_ref): max|g - ref| / max|ref|, or max|g| where ref is ~0 (below ``floor``) everywhere."""
    g = np.asarray(g, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(g)) or g.shape != ref.shape:
        return math.inf, False
    top = float(np.max(np.abs(ref))) if ref.size else 0.0
    if top < floor:
        return float(np.max(np.abs(g))) if g.size else 0.0, True
    return float(np.max(np.abs(g - ref)) / top), False


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().replace("\n", " | ")
    return text[:400]


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # pragma: no cover - signal handler
    raise _Timeout("case timed out")


def run_case(name: str, exporter: str, dtype: torch.dtype, timeout: int, device: str = "cpu") -> dict[str, Any]:
    import gradgen
    from gradgen.executor import Session

    rec: dict[str, Any] = {"case": name, "group": CASES[name][0], "exporter": exporter, "dtype": str(dtype).replace("torch.", "")}
    rec["device"] = device
    rec.update(
        built=False,
        ran=False,
        ort_ok=None,
        loss_err=None,
        ort_loss_err=None,
        worst=None,
        worst_tensor=None,
        zero_ref={},
        unmatched=[],
        errors={},
        stage=None,
        error=None,
    )
    start = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout)
    stage = "case"
    try:
        torch.manual_seed(0)
        c = CASES[name][1]()
        if exporter not in c.exporters:
            rec.update(stage="skipped", error=f"case is for {', '.join(c.exporters)} only")
            return rec
        rec["note"] = c.note
        module = c.module.to(dtype).eval()
        inputs = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in c.inputs.items()}
        run_inputs = {n: (t.to(dtype) if t.is_floating_point() else t) for n, t in (c.run_inputs or c.inputs).items()}
        stage = "torch"
        loss_ref, ref, missing = torch_reference(module, run_inputs)
        if missing:
            rec["torch_missing"] = missing
        stage = "export"
        proto = export(dataclasses.replace(c, module=module, inputs=inputs), exporter)
        graph_inputs = [i.name for i in proto.graph.input]
        init_names = {t.name for t in proto.graph.initializer}
        feeds = {n: t.numpy() for n, t in run_inputs.items() if n in graph_inputs}
        stage = "ort"
        try:
            ort_loss = ort_forward(proto, feeds)
            rec["ort_loss_err"] = abs(ort_loss - loss_ref) / max(abs(loss_ref), 1e-12)
            rec["ort_ok"] = rec["ort_loss_err"] < (1e-4 if dtype == torch.float32 else 1e-9)
        except Exception as e:  # ORT failing is recorded, not fatal
            rec["ort_ok"] = False
            rec["ort_error"] = _short(e)
        stage = "build"
        built = gradgen.build_backward(proto, wrt_inputs=True)
        rec["built"] = True
        rec["wrt"] = list(built.wrt)
        stage = "run"
        out = Session(built.model, device=device).run(feeds)
        rec["ran"] = True
        stage = "compare"
        loss = float(np.asarray(out[built.loss]))
        rec["loss_err"] = abs(loss - loss_ref) / max(abs(loss_ref), 1e-12)
        worst, worst_name = 0.0, None
        for wrt, gname in zip(built.wrt, built.gradient_names):
            g = out[gname]
            if wrt in ref:
                r = ref[wrt]
            else:
                rec["unmatched"].append(wrt)
                if dtype == torch.float64:  # no torch reference: central differences of the exported forward
                    rec.setdefault("fd_unmatched", {})[wrt] = fd_score(proto, feeds, wrt, g)
                continue
            if g.shape != r.shape and r.ndim == 2 and g.shape == r.T.shape:
                r = r.T
            s, zero = _score(g, r)
            if zero:
                rec["zero_ref"][wrt] = s
                if s > 1e-6:
                    rec["errors"][wrt] = s
            else:
                rec["errors"][wrt] = s
            rec["compared"] = rec.get("compared", 0) + 1
            if s > worst or (math.isinf(s) and worst_name is None):
                worst, worst_name = s, wrt
        not_built = sorted(
            k for k in ref if k not in built.wrt and (k in graph_inputs or k in init_names) and np.any(ref[k] != 0)
        )
        if not_built:
            rec["no_gradient"] = not_built
        rec.update(worst=worst, worst_tensor=worst_name)
        rec["stage"] = "done"
    except (Exception, _Timeout) as e:
        rec.update(stage=stage, error=_short(e))
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        rec["seconds"] = round(time.perf_counter() - start, 3)
    return rec


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2e}"


def row(rec: dict[str, Any]) -> str:
    notes = rec.get("error") or ""
    if rec.get("ort_ok") is False:
        notes = (
            f"ORT disagrees ({_fmt(rec.get('ort_loss_err'))}{'; ' + rec['ort_error'][:80] if 'ort_error' in rec else ''}) "
            + notes
        )
    if rec.get("fd_unmatched"):
        notes += " fd(no torch ref)=" + ",".join(f"{k}:{_fmt(v)}" for k, v in rec["fd_unmatched"].items())
    elif rec.get("unmatched"):
        notes += f" unmatched={rec['unmatched']}"
    if rec.get("no_gradient"):
        notes += f" no_gradient={rec['no_gradient']}"
    return (
        f"{rec['case']:<34} {rec['exporter']:<7} {rec['dtype']:<8} {'y' if rec['built'] else 'n'} {'y' if rec['ran'] else 'n'} "
        f"{_fmt(rec['loss_err']):>9} {_fmt(rec['worst']):>9} {str(rec['worst_tensor'] or '')[:22]:<22} "
        f"{rec['seconds']:>6.2f}s {notes[:200]}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", help="case names or group names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--out", help="append one JSON line per run to this file")
    parser.add_argument("--exporters", default="legacy,dynamo")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--rerun-above", type=float, default=1e-3, help="float32 worst score that triggers a float64 rerun")
    parser.add_argument("--no-rerun", action="store_true")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per case and exporter")
    parser.add_argument("--device", default="cpu", help="where gradgen runs the built graph (cpu or cuda)")
    args = parser.parse_args(argv)
    if args.list:
        for name, (group, _) in CASES.items():
            print(f"{group:<11} {name}")
        return 0
    groups = {g for g, _ in CASES.values()}
    names: list[str] = []
    for item in args.cases or list(CASES):
        if item in groups:
            names += [n for n, (g, _) in CASES.items() if g == item]
        elif item in CASES:
            names.append(item)
        else:
            parser.error(f"unknown case or group {item!r} (see --list)")
    dtype = getattr(torch, args.dtype)
    out = open(args.out, "a") if args.out else None
    print(f"{'case':<34} {'export':<7} {'dtype':<8} b r {'loss_err':>9} {'worst':>9} {'worst tensor':<22} {'time':>7} notes")
    bad = 0
    try:
        for name in names:
            for exporter in args.exporters.split(","):
                recs = [run_case(name, exporter, dtype, args.timeout, args.device)]
                worst = recs[0]["worst"]
                if (
                    dtype == torch.float32
                    and not args.no_rerun
                    and recs[0]["stage"] == "done"
                    and (
                        worst is None
                        or worst > args.rerun_above
                        or (recs[0]["loss_err"] or 0) > args.rerun_above
                        or recs[0]["unmatched"]
                    )
                ):
                    recs.append(run_case(name, exporter, torch.float64, args.timeout, args.device))
                for rec in recs:
                    if rec["stage"] == "skipped":
                        continue
                    print(row(rec), flush=True)
                    if out:
                        out.write(json.dumps(rec) + "\n")
                        out.flush()
                bad += recs[-1]["stage"] not in ("done", "skipped") or (recs[-1]["worst"] or 0) > args.rerun_above
    finally:
        if out:
            out.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
