#!/usr/bin/env python
"""Variants of the sample families that gradgen has not seen, checked against PyTorch.

Every variant is a small PyTorch module (other sizes, activations, losses, pools, norms, tensor ops,
dtypes, output orders and dynamic batch axes than ``samples/make_samples.py``).  For each variant
and each exporter (legacy ``torch.onnx.export(dynamo=False, opset_version=17)`` and the default
dynamo exporter) this script

1. exports the model (post-processing and initializer mapping reused from make_samples.py),
2. computes torch autograd reference gradients for every float initializer the loss depends on
   and for every float graph input,
3. builds the backward graph with gradgen, runs it on the CPU executor and compares (rtol 1e-4,
   atol 1e-5 of the largest element), also with the batch dim made symbolic, and the forward
   outputs with onnxruntime;
4. for variants exported with a dynamic batch axis, repeats the gradient check at batch + 1 with a
   fresh torch reference.

Exports that PyTorch itself cannot do are reported as ``skip``.  ``--save NAME...`` writes the
named variants as fixture directories ``tests/fixtures/models/<name>_<exporter>/`` in the format
of make_samples.py, so that tests/test_models.py picks them up.

Usage::

    python tests/variants/make_variants.py [--only NAME]... [--exporter legacy|dynamo]
                                           [--save NAME]... [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import io
import math
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "samples"))
sys.path.insert(0, str(ROOT))
import make_samples as ms  # noqa: E402

from gradgen.executor import Session  # noqa: E402
from tests.model_dirs import with_symbolic_batch  # noqa: E402
from tests.test_models import _check_gradients  # noqa: E402

randn = ms.randn


@dataclass
class Variant:
    build: Callable[[], ms.Case]
    seed: int
    outputs: list[str] = field(default_factory=lambda: ["loss"])  # graph output order
    dynamic: bool = False  # export with a symbolic batch axis
    seq_dim: dict[str, int] = field(default_factory=dict)  # inputs with a symbolic sequence axis too
    skip: dict[str, str] = field(default_factory=dict)  # exporter -> why the variant is not exported with it
    expect_error: str = ""  # an op gradgen cannot differentiate: its error must name it and its node
    notes: str = ""


# --------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------
class ActsSmooth(nn.Module):
    """Smooth activations, L1 loss."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 10)
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 3)

    def forward(self, x, target):
        h = self.fc1(x)
        h = F.gelu(h) + F.silu(h) * 0.5 + F.mish(h) * 0.3
        h = self.fc2(h)
        h = F.elu(h, 0.7) + F.softplus(h, beta=2.0) + F.hardswish(h) + F.selu(h) * 0.2
        h = h + F.celu(h, 1.3) * 0.1 + F.logsigmoid(h) * 0.2 + F.softsign(h) * 0.3
        y = self.fc3(h)
        if self.legacy:  # the legacy exporter has no aten::l1_loss
            return (y - target).abs().mean(), y
        return F.l1_loss(y, target), y


class ActsPiecewise(nn.Module):
    """Piecewise activations (LeakyReLU, PReLU, Hardtanh, ReLU6, Hardsigmoid), smooth L1 + Huber."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 12)
        self.prelu = nn.PReLU(12)
        self.prelu1 = nn.PReLU()
        self.fc2 = nn.Linear(12, 12)
        self.fc3 = nn.Linear(12, 4)

    def forward(self, x, target):
        h = self.prelu(self.fc1(x))
        h = F.leaky_relu(h, 0.2) + self.prelu1(h) * 0.5
        h = self.fc2(h)
        h = F.hardtanh(h, -0.5, 0.8) + F.relu6(h * 4.0) * 0.1 + F.hardsigmoid(h * 2.0)
        h = h + torch.clamp(h, min=-0.2) * 0.3 + torch.clamp(h, -0.4, 0.3)
        y = self.fc3(h)
        if self.legacy:  # the legacy exporter has neither aten::smooth_l1_loss nor huber_loss
            d = (y - target).abs()
            loss = torch.where(d < 0.5, 0.5 * d * d / 0.5, d - 0.25).mean()
            loss = loss + torch.where(d < 0.7, 0.5 * d * d, 0.7 * (d - 0.35)).mean()
        else:
            loss = F.smooth_l1_loss(y, target, beta=0.5) + F.huber_loss(y, target, delta=0.7)
        return loss + F.mse_loss(y, target, reduction="sum") * 0.01, y


class ClsLosses(nn.Module):
    """nll_loss(log_softmax), label smoothing, ignore_index labels, kl_div, cosine similarity."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x, labels, labels_ign, target_prob):
        logits = self.fc2(torch.tanh(self.fc1(x)))
        lsm = F.log_softmax(logits, dim=-1)
        loss = F.nll_loss(lsm, labels)
        # label_smoothing written out: the legacy exporter refuses it and the dynamo exporter
        # silently drops it (its SoftmaxCrossEntropyLoss has no smoothing)
        loss = loss + 0.9 * F.nll_loss(lsm, labels) - 0.1 * lsm.mean(-1).mean()
        loss = loss + F.cross_entropy(logits, labels_ign)  # ignore_index=-100
        loss = loss + F.kl_div(lsm, target_prob, reduction="batchmean")
        loss = loss + (1 - F.cosine_similarity(logits, target_prob, dim=-1)).mean()
        return loss, logits


def build_cls_losses():
    n = 6
    return ms.Case(
        ClsLosses(),
        {
            "x": randn(n, 8),
            "labels": torch.tensor([0, 4, 4, 2, 1, 3]),
            "labels_ign": torch.tensor([1, -100, 4, -100, 0, 0]),
            "target_prob": torch.softmax(randn(n, 5), -1),
        },
        batch_dim=["x", "labels", "labels_ign", "target_prob"],
        extra_outputs=["logits"],
    )


class CnnPools(nn.Module):
    """MaxPool ceil_mode/padding/dilation, AvgPool count_include_pad=False, GroupNorm,
    InstanceNorm2d, Dropout (eval), AdaptiveAvgPool2d((2, 2)), cross-entropy."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool1 = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.gn = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.pool2 = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False, ceil_mode=True)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.drop = nn.Dropout(0.3)
        self.pool3 = nn.AdaptiveAvgPool2d((2, 2))
        self.fc = nn.Linear(32, 4)

    def forward(self, x, labels):
        h = self.pool1(torch.relu(self.conv1(x)))
        h = self.pool2(F.silu(self.conv2(self.gn(h))))
        h = self.pool3(self.drop(self.inorm(h)))
        logits = self.fc(torch.flatten(h, 1))
        return F.cross_entropy(logits, labels), logits


def build_cnn_pools():
    return ms.Case(
        CnnPools(),
        {"x": randn(2, 3, 11, 11), "labels": torch.tensor([3, 1])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
    )


class Pools1d3d(nn.Module):
    """MaxPool2d with dilation, MaxPool1d ceil_mode, AvgPool1d, AvgPool3d, AdaptiveMaxPool."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.w = nn.Parameter(torch.randn(4, 1))

    def forward(self, x):  # (N, 2, 12, 12)
        h = torch.tanh(self.conv(x))  # (N,4,10,10)
        a = F.max_pool2d(h, 3, stride=2, dilation=2, padding=1)  # (N,4,4,4)
        b = F.max_pool1d(h.flatten(2), 4, stride=3, ceil_mode=True)  # (N,4,34)
        c = F.avg_pool1d(h.flatten(2), 5, stride=4, padding=2, count_include_pad=True)
        d = F.avg_pool3d(h.unsqueeze(1), (2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), count_include_pad=False)
        e = F.adaptive_max_pool2d(h, 1)
        loss = (a * a).mean() + (b * self.w).sum() * 0.1 + c.pow(2).sum() + d.mean() + e.sum()
        return loss


class ConvVariants(nn.Module):
    """Conv1d 'valid' stride 3, depthwise multiplier, dilated 'same', padding modes, ConvTranspose,
    negative F.pad (cropping), reflect pad."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(3, 4, 3, stride=3, dilation=2, padding="valid")
        self.dw = nn.Conv2d(4, 8, 3, groups=4, padding="same", dilation=2, bias=False)
        self.refl = nn.Conv2d(8, 4, 3, padding=1, padding_mode="reflect")
        self.repl = nn.Conv2d(4, 4, (1, 3), padding=(0, 2), padding_mode="replicate")
        self.circ = nn.Conv2d(4, 2, 3, padding=1, padding_mode="circular", bias=False)
        self.up = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1)

    def forward(self, x, y):  # x: (N, 3, 20), y: (N, 4, 7, 7)
        a = self.c1(x)  # (N,4,6)
        z = y + a.unsqueeze(-1)[..., :1, :].mean()
        if self.legacy:  # legacy writes dilated 'same' as auto_pad=SAME_UPPER, which onnxruntime refuses
            h = torch.relu(F.conv2d(z, self.dw.weight, None, padding=2, dilation=2, groups=4))
        else:
            h = torch.relu(self.dw(z))
        h = self.refl(h)
        h = torch.tanh(self.repl(h))  # (N,4,7,9)
        h = F.pad(h, (-1, 0, 1, -2))  # crop + pad
        h = F.pad(h, (2, 1, 1, 1), mode="reflect")
        h = self.circ(h)
        u = self.up(h)
        return (u * u).mean() + (a**2).mean()


def build_conv_variants():
    return ms.Case(ConvVariants(), {"x": randn(2, 3, 20), "y": randn(2, 4, 7, 7)}, batch_dim=["x", "y"])


class Upsample(nn.Module):
    """F.interpolate (nearest, bilinear), PixelShuffle, ConvTranspose1d."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.ct = nn.ConvTranspose1d(2, 2, 4, stride=2)

    def forward(self, x):  # (N, 2, 4, 4)
        a = F.interpolate(x, scale_factor=2, mode="nearest")
        b = F.pixel_shuffle(self.conv(x), 2)  # (N,2,8,8)
        c = F.interpolate(x, size=(6, 6), mode="bilinear", align_corners=False)
        d = self.ct(x.flatten(2))
        return (a * b).mean() + c.pow(2).mean() + torch.tanh(d).sum()


class TensorOps(nn.Module):
    """einsum, bmm, masked_fill, tril/triu, var/std, rsqrt, normalize, norm, cumsum, topk, roll,
    repeat, logsumexp, amax, min."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.m = nn.Parameter(torch.randn(2, 6, 5))
        self.s = nn.Parameter(torch.randn(5))

    def forward(self, x, mask):  # x: (N, 4, 6), mask: (N, 4, 4) bool
        h = x * self.w
        e = torch.einsum("nij,kjl->nkil", h, self.m)  # (N,2,4,5)
        b = torch.bmm(h, h.transpose(1, 2)).masked_fill(mask, -1.5)  # (N,4,4)
        t = torch.tril(b) + torch.triu(b, 1) * 0.5 + torch.triu(b, -1) * 0.1
        r = torch.rsqrt(h.var(dim=-1, keepdim=True) + 1.0) + h.std(dim=1).mean()
        n = F.normalize(h, dim=-1) * torch.norm(h, dim=1, keepdim=True) + torch.norm(self.w)
        c = torch.cumsum(h, dim=2) + torch.cumsum(h.flip(1), dim=1).flip(1)
        tk = torch.topk(h, 2, dim=-1).values.sum() + torch.topk(h, 3, dim=1, largest=False).values.mean()
        ro = torch.roll(h, shifts=1, dims=2) + torch.roll(h, (2, -1), (1, 2))
        rp = self.s.repeat(2, 3)  # (2, 15)
        lse = torch.logsumexp(e, dim=-1).mean() + e.amax(dim=(1, 3)).sum() + h.min(dim=-1).values.sum()
        loss = (e * e).mean() + (t * t).sum() * 0.1 + (r * n).sum() + (c * ro).mean()
        return loss + tk + (rp * rp).sum() + lse + (h.repeat(1, 2, 1)[:, 3:6] ** 3).mean()


def build_tensor_ops():
    return ms.Case(TensorOps(), {"x": randn(2, 4, 6), "mask": torch.rand(2, 4, 4) > 0.6}, batch_dim=["x", "mask"])


class Indexing2(nn.Module):
    """Multi-axis advanced indexing, 2-D index tensors, index_select on dim -1, take_along_dim,
    index_add / scatter_add with repeated indices, movedim/permute/unflatten/uneven chunk."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 6))
        self.table = nn.Parameter(torch.randn(7, 3))

    def forward(self, x, i1, i2, idx2d, tidx):  # x: (N, 5, 6)
        h = torch.tanh(x * self.w)
        if self.legacy:  # legacy flattens multi-axis indices wrongly when they are negative
            a = h[:, i1.remainder(5), i2.remainder(6)]
        else:
            a = h[:, i1, i2]  # (N, K) multi-axis
        b = h[:, :, i2]  # negative ids on axis 2
        c = self.table[idx2d]  # (2, 3, 3) from a 2-D index
        d = torch.index_select(h, -1, tidx.clamp(min=0))  # dim -1
        eidx = tidx.clamp(min=0).view(1, 1, -1).expand(h.shape[0], 5, -1)
        # the legacy exporter has no aten::take_along_dim
        e = torch.gather(h, 2, eidx) if self.legacy else torch.take_along_dim(h, eidx, dim=2)
        # the legacy exporter refuses index_add with repeated indices
        f_idx = torch.tensor([4, 0, 3, 1, 2] if self.legacy else [0, 3, 3, 1, 0])
        f = torch.zeros(h.shape[0], 5, 6).index_add(1, f_idx, h)
        g = torch.zeros(h.shape[0], 5, 3).scatter_add(
            2, tidx.clamp(min=0).remainder(3).view(1, 1, -1).expand(h.shape[0], 5, -1)[..., :6], h
        )
        p = h.movedim(2, 1).unflatten(1, (2, 3)).permute(0, 3, 1, 2)  # (N,5,2,3)
        q1, q2, q3 = p.flatten(2).chunk(3, dim=-1)
        loss = (a * a).sum() + b.mean() + (c**2).sum() + (d * e).sum() + (f * f).mean()
        return loss + (g**2).sum() + (q1 * q3).sum() + q2.mean()


def build_indexing2():
    return ms.Case(
        Indexing2(),
        {
            "x": randn(3, 5, 6),
            "i1": torch.tensor([4, -1, 0, 2]),
            "i2": torch.tensor([-6, 5, 5, -2]),
            "idx2d": torch.tensor([[0, 6, 6], [2, 0, 1]]),
            "tidx": torch.tensor([5, 0, 5, 2, 1, 1]),
        },
        batch_dim=["x"],
    )


class BroadcastMore(nn.Module):
    """Broadcasting of (N,1) with (1,M), (C,1,1) divisors, scalars, maximum/minimum, pow with an
    input base and parameter exponent, reciprocal/abs/log1p/expm1/erf/sin/cos."""

    def __init__(self):
        super().__init__()
        self.row = nn.Parameter(torch.randn(1, 5))
        self.chan = nn.Parameter(torch.rand(3, 1, 1) + 0.5)
        self.scale = nn.Parameter(torch.tensor(0.7))
        self.expo = nn.Parameter(torch.rand(1, 3, 1, 1) + 0.5)

    def forward(self, x, u):  # x: (N, 3, 2, 5), u: (N, 1)
        a = u * self.row - self.row / (u.abs() + 1.0)  # (N,5)
        h = x / self.chan + a[:, None, None, :] * self.scale  # (N,3,2,5)
        m = torch.maximum(h, self.row) + torch.minimum(h, self.chan * 0.1)
        p = (h.abs() + 0.5) ** self.expo + torch.reciprocal(self.chan + h.pow(2))
        em1 = torch.exp(h * 0.2) - 1 if self.legacy else torch.expm1(h * 0.2)  # legacy: no expm1
        s = torch.log1p(h.abs()) + em1 + torch.erf(h) + torch.sin(h) * torch.cos(a[:, None, None, :])
        z = torch.where(h > 0, m, self.scale) + torch.sqrt(p)
        loss = (z * s).mean() + p.sum(dim=(0, 2)).pow(2).mean() + m.mean(dim=-1, keepdim=True).sum()
        return loss + torch.atan2(h, self.chan).mean() + (h.square() * self.scale).sum() * 0.01


def build_broadcast_more():
    return ms.Case(BroadcastMore(), {"x": randn(2, 3, 2, 5), "u": randn(2, 1)}, batch_dim=["x", "u"])


class EmbPad(nn.Module):
    """Embedding padding_idx=2, offset positions, LayerNorm without affine, RMSNorm,
    masked mean pooling, MSE + cross-entropy."""

    def __init__(self, vocab=10, dim=6, seq=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=2)
        self.pos = nn.Embedding(seq + 1, dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.rms = nn.RMSNorm(dim, eps=1e-5)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids, labels):
        positions = torch.arange(1, ids.shape[1] + 1)
        h = self.norm(self.tok(ids) + self.pos(positions))
        if self.legacy:  # the legacy exporter has no aten::rms_norm
            h = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5) * self.rms.weight
        else:
            h = self.rms(h)
        keep = (ids != 2).to(h.dtype).unsqueeze(-1)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        logits = self.head(pooled)
        return F.cross_entropy(logits, labels) + (h**2).mean() * 0.1, logits


def build_emb_pad():
    ids = torch.tensor([[2, 3, 3, 9, 2], [5, 5, 2, 1, 0], [7, 7, 7, 2, 2]])
    return ms.Case(
        EmbPad(), {"ids": ids, "labels": torch.tensor([2, 0, 2])}, batch_dim=["ids", "labels"], extra_outputs=["logits"]
    )


class DynMlp(nn.Module):
    """MLP with BatchNorm1d (eval) and Dropout (eval), exported with a dynamic batch axis."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x, target):
        h = self.drop(F.silu(self.bn(self.fc1(x))))
        y = self.fc2(h)
        return F.binary_cross_entropy_with_logits(y, target) + F.mse_loss(y.mean(0), target.mean(0)), y


def build_dyn_mlp():
    return ms.Case(
        DynMlp(),
        {"x": randn(3, 6), "target": (torch.rand(3, 2) > 0.5).float()},
        batch_dim=["x", "target"],
        extra_outputs=["logits"],
    )


class DynCnn(nn.Module):
    """Conv + BatchNorm2d + flatten(1) + Linear with a dynamic batch axis."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2)
        self.bn = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 3 * 3, 4)

    def forward(self, x, labels):
        h = torch.relu(self.bn(self.conv(x)))
        logits = self.fc(h.flatten(1))
        return F.cross_entropy(logits, labels), logits


def build_dyn_cnn():
    return ms.Case(
        DynCnn(), {"x": randn(3, 2, 7, 7), "labels": torch.tensor([0, 3, 1])}, batch_dim=["x", "labels"], extra_outputs=["logits"]
    )


class F64Mlp(nn.Module):
    """float64 parameters and inputs: Linear, LayerNorm, tanh, softmax, MSE."""

    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, target):  # x: (N, 2, 8)
        h = torch.tanh(self.ln(self.fc0(x)))
        y = torch.softmax(self.fc(h), -1)
        return F.mse_loss(y.mean(1), target), y


def build_f64():
    m = F64Mlp().double()
    return ms.Case(
        m, {"x": randn(2, 2, 8).double(), "target": torch.rand(2, 4).double()}, batch_dim=["x", "target"], extra_outputs=["probs"]
    )


class MultiOut(nn.Module):
    """Several outputs, the loss last."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x, labels):
        feats = torch.relu(self.fc1(x))
        logits = self.fc2(feats)
        return logits, feats.sum(-1), F.cross_entropy(logits, labels)


def build_multi_out():
    return ms.Case(MultiOut(), {"x": randn(4, 4), "labels": torch.tensor([2, 0, 1, 2])}, batch_dim=["x", "labels"])


class TransformerVar(nn.Module):
    """TransformerEncoder (2 layers, norm_first, gelu, batch_first=False) with a causal mask."""

    def __init__(self, d=12, classes=3):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=3, dim_feedforward=20, dropout=0.1, activation="gelu", norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x, labels):  # x: (T, N, d)
        t = x.shape[0]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.enc(x, mask=mask, is_causal=True)  # no data-dependent mask check in torch.export
        logits = self.head(h[-1])
        return F.cross_entropy(logits, labels), logits


def build_transformer_var():
    return ms.Case(
        TransformerVar(),
        {"x": randn(4, 2, 12), "labels": torch.tensor([2, 0])},
        batch_dim=[],
        extra_outputs=["logits"],
        notes="sequence-first input; no batch axis 0",
    )


class HfGpt2Var(nn.Module):
    """GPT2LMHeadModel, 1 layer, 3 heads, left padding in attention_mask and -100 labels."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=1,
            n_embd=24,
            n_head=3,
            vocab_size=40,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            activation_function="gelu",
            attn_implementation="eager",
        )
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask, labels):
        out = self.gpt(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        return out.loss, out.logits


def build_gpt2_hf_var():
    ids = torch.randint(0, 40, (2, 7))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    labels = ids.clone()
    labels[0, :2] = -100
    return ms.Case(
        HfGpt2Var(),
        {"input_ids": ids, "attention_mask": mask, "labels": labels},
        batch_dim=["input_ids", "attention_mask", "labels"],
        extra_outputs=["logits"],
    )


class ResnetDown(nn.Module):
    """Downsampling residual block: stride-2 conv, 1x1 projection shortcut with BN,
    AdaptiveAvgPool2d((2, 2)), AdaptiveMaxPool2d(1)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.proj = nn.Conv2d(3, 6, 1, stride=2, bias=False)
        self.bnp = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6 * 4 + 6, 5)

    def forward(self, x, labels):
        h = F.relu6(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h)) + self.bnp(self.proj(x))
        h = F.hardswish(h)
        a = F.adaptive_avg_pool2d(h, (2, 2)).flatten(1)
        m = F.adaptive_max_pool2d(h, 1).flatten(1)
        logits = self.fc(torch.cat([a, m], 1))
        lsm = F.log_softmax(logits, -1)  # label smoothing 0.05, written out (see ClsLosses)
        return 0.95 * F.nll_loss(lsm, labels) - 0.05 * lsm.mean(-1).mean(), logits


def build_resnet_down():
    return ms.Case(
        ResnetDown(),
        {"x": randn(2, 3, 8, 8), "labels": torch.tensor([4, 0])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
    )


def simple(model_cls, inputs, batch_dim, extra=()):
    return lambda: ms.Case(model_cls(), {k: v() for k, v in inputs.items()}, batch_dim=batch_dim, extra_outputs=list(extra))


VARIANTS: dict[str, Variant] = {
    "acts_smooth": Variant(
        simple(ActsSmooth, {"x": lambda: randn(5, 7), "target": lambda: randn(5, 3)}, ["x", "target"], ["pred"]),
        101,
        ["loss", "pred"],
    ),
    "acts_piecewise": Variant(
        simple(ActsPiecewise, {"x": lambda: randn(6, 5), "target": lambda: randn(6, 4)}, ["x", "target"], ["pred"]),
        102,
        ["loss", "pred"],
    ),
    "cls_losses": Variant(build_cls_losses, 103, ["loss", "logits"]),
    "cnn_pools": Variant(build_cnn_pools, 104, ["loss", "logits"]),
    "pools_1d3d": Variant(simple(Pools1d3d, {"x": lambda: randn(2, 2, 12, 12)}, ["x"]), 105),
    "conv_variants": Variant(build_conv_variants, 106),
    "upsample": Variant(simple(Upsample, {"x": lambda: randn(2, 2, 4, 4)}, ["x"]), 107),
    "tensor_ops": Variant(build_tensor_ops, 108),
    "indexing2": Variant(build_indexing2, 109),
    "broadcast_more": Variant(build_broadcast_more, 110),
    "emb_pad": Variant(build_emb_pad, 111, ["loss", "logits"]),
    "dyn_mlp": Variant(build_dyn_mlp, 112, ["loss", "logits"], dynamic=True),
    "dyn_cnn": Variant(build_dyn_cnn, 113, ["loss", "logits"], dynamic=True),
    "f64_mlp": Variant(build_f64, 114, ["loss", "probs"]),
    "multi_out": Variant(build_multi_out, 115, ["logits", "feat_sum", "loss"]),
    "transformer_var": Variant(build_transformer_var, 116, ["loss", "logits"]),
    "gpt2_hf_var": Variant(build_gpt2_hf_var, 117, ["loss", "logits"]),
    "resnet_down": Variant(build_resnet_down, 118, ["loss", "logits"]),
}


# --------------------------------------------------------------------------
# Second pass: attention, decoder blocks with symbolic sequence, convnet blocks, losses, misc ops
# --------------------------------------------------------------------------
class Sdpa(nn.Module):
    """F.scaled_dot_product_attention: is_causal=True, an additive float mask, a bool mask."""

    def __init__(self, d=8, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.bias = nn.Parameter(torch.randn(1, heads, 1, 5) * 0.1)

    def forward(self, x, fmask, bmask):  # x: (N, T, d), fmask: (N, 1, T, T) float, bmask: (N, 1, T, T) bool
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=fmask + self.bias)
        c = F.scaled_dot_product_attention(q, k * 0.5, v, attn_mask=bmask)
        h = (a + b * 0.5 + c * 0.3).transpose(1, 2).reshape(n, t, d)
        return (self.out(h) ** 2).mean()


def build_sdpa():
    n, t = 2, 5
    bmask = torch.rand(n, 1, t, t) > 0.4
    bmask[..., 0] = True  # every row attends somewhere
    return ms.Case(Sdpa(), {"x": randn(n, t, 8), "fmask": randn(n, 1, t, t), "bmask": bmask}, batch_dim=["x", "fmask", "bmask"])


class Mha(nn.Module):
    """nn.MultiheadAttention batch_first=True with key_padding_mask, batch_first=False self-attn."""

    def __init__(self, d=8):
        super().__init__()
        self.a1 = nn.MultiheadAttention(d, 2, batch_first=True)
        self.a2 = nn.MultiheadAttention(d, 4, batch_first=False, bias=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x, pad, labels):  # x: (N, T, d), pad: (N, T) bool (True = ignore)
        h, _ = self.a1(x, x, x, key_padding_mask=pad, need_weights=False)
        h = h + x
        s = h.transpose(0, 1)  # (T, N, d)
        g, _ = self.a2(s, s, s, need_weights=False)
        logits = self.head(g.mean(0))
        return F.cross_entropy(logits, labels), logits


def build_mha():
    pad = torch.tensor(
        [[False, False, False, True, True], [False, False, False, False, False], [False, True, False, False, True]]
    )
    return ms.Case(
        Mha(),
        {"x": randn(3, 5, 8), "pad": pad, "labels": torch.tensor([2, 0, 1])},
        batch_dim=["x", "pad", "labels"],
        extra_outputs=["logits"],
    )


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaLite(nn.Module):
    """LLaMA-style decoder: RMSNorm written out, rotary embeddings (sin/cos, rotate_half with
    slicing/concat/neg), ALiBi bias via arange, causal softmax attention, SwiGLU MLP, tied head,
    per-token cross-entropy on (N, C, L) logits; batch and sequence dims dynamic."""

    def __init__(self, vocab=20, d=8, heads=2, hidden=12):
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.emb = nn.Embedding(vocab, d)
        self.n1 = nn.Parameter(torch.ones(d))
        self.n2 = nn.Parameter(torch.ones(d))
        self.nf = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(hidden, d, bias=False)
        self.slopes = nn.Parameter(torch.tensor([0.5, 0.25]).view(1, heads, 1, 1), requires_grad=False)

    @staticmethod
    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def forward(self, ids, labels):  # ids, labels: (N, T)
        n, t = ids.shape
        x = self.emb(ids)
        h = self.rms(x, self.n1)
        q, k, v = self.qkv(h).view(n, t, 3, self.heads, self.hd).transpose(1, 3).unbind(2)  # (N,H,T,hd)
        pos = torch.arange(t, dtype=torch.float32)
        inv = 1.0 / (100.0 ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        ang = pos[:, None] * inv[None, :]
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rel = (pos[None, :] - pos[:, None]).clamp(max=0.0)  # ALiBi: -distance to the past
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        s = q @ k.transpose(-1, -2) / math.sqrt(self.hd) + self.slopes * rel
        s = s.masked_fill(~causal, float("-inf"))
        att = torch.softmax(s, -1) @ v  # (N,H,T,hd)
        x = x + self.o(att.transpose(1, 2).reshape(n, t, -1))
        h = self.rms(x, self.n2)
        x = x + self.w3(F.silu(self.w1(h)) * self.w2(h))
        logits = self.rms(x, self.nf) @ self.emb.weight.t()  # (N, T, V)
        return F.cross_entropy(logits.transpose(1, 2), labels), logits


def build_llama_lite():
    ids = torch.randint(0, 20, (2, 6))
    return ms.Case(
        LlamaLite(), {"ids": ids, "labels": torch.roll(ids, -1, 1)}, batch_dim=["ids", "labels"], extra_outputs=["logits"]
    )


class GptDynSeq(nn.Module):
    """GPT-like decoder (learned positions sliced to the sequence length, pre-LN, SDPA causal,
    GELU MLP, chunk of the fused qkv along the last dim), batch and sequence dims dynamic."""

    def __init__(self, vocab=16, d=8, heads=2, max_t=12):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, max_t, d) * 0.1)
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, labels):
        n, t = ids.shape
        x = self.tok(ids) + self.pos[:, :t]
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(n, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, -1))
        x = x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1)), logits


def build_gpt_dynseq():
    ids = torch.randint(0, 16, (2, 5))
    return ms.Case(
        GptDynSeq(), {"ids": ids, "labels": torch.randint(0, 16, (2, 5))}, batch_dim=["ids", "labels"], extra_outputs=["logits"]
    )


class MobileSE(nn.Module):
    """MobileNet-style depthwise-separable blocks (ReLU6), YOLO-style Conv+BN+SiLU, squeeze-and-
    excitation (global pool -> 1x1 convs -> sigmoid -> channel scaling), cross-entropy."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.pw = nn.Conv2d(8, 12, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(12)
        self.se1 = nn.Conv2d(12, 4, 1)
        self.se2 = nn.Conv2d(4, 12, 1)
        self.dw2 = nn.Conv2d(12, 12, 3, stride=2, padding=1, groups=12)
        self.fc = nn.Linear(12, 5)

    def forward(self, x, labels):
        h = F.silu(self.bn0(self.stem(x)))
        h = F.relu6(self.bn1(self.dw(h)))
        h = F.relu6(self.bn2(self.pw(h)))
        s = F.adaptive_avg_pool2d(h, 1)
        s = torch.sigmoid(self.se2(F.relu(self.se1(s))))
        h = h * s
        h = F.hardswish(self.dw2(h))
        logits = self.fc(h.mean((2, 3)))
        return F.cross_entropy(logits, labels), logits


def build_mobile_se():
    return ms.Case(
        MobileSE(),
        {"x": randn(2, 3, 10, 10), "labels": torch.tensor([4, 1])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
    )


class UnetLite(nn.Module):
    """UNet-lite: two conv downsamples, ConvTranspose2d decoder with concatenated skips,
    nn.Upsample (nearest and bilinear), per-pixel BCE-with-logits + MSE."""

    def __init__(self):
        super().__init__()
        self.e1 = nn.Conv2d(2, 4, 3, padding=1)
        self.e2 = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.e3 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.up1 = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.d1 = nn.Conv2d(16, 4, 3, padding=1)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
        self.up3 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.d2 = nn.Conv2d(8, 1, 1)

    def forward(self, x, target):  # x: (N, 2, 8, 8), target: (N, 1, 8, 8)
        s1 = F.relu(self.e1(x))  # 8x8
        s2 = F.relu(self.e2(s1))  # 4x4
        b = F.relu(self.e3(s2))  # 2x2
        u = self.up1(b)  # 4x4
        u = F.relu(self.d1(torch.cat([u, s2], 1)))
        u = self.up2(u) + self.up3(u) * 0.5  # 8x8
        y = self.d2(torch.cat([u, s1], 1))
        return F.binary_cross_entropy_with_logits(y, target) + F.mse_loss(torch.sigmoid(y), target), y


def build_unet_lite():
    return ms.Case(
        UnetLite(),
        {"x": randn(2, 2, 8, 8), "target": (torch.rand(2, 1, 8, 8) > 0.5).float()},
        batch_dim=["x", "target"],
        extra_outputs=["logits"],
    )


class Losses2(nn.Module):
    """cross_entropy on (N, C, L) logits, binary_cross_entropy on probabilities, mse_loss(sum),
    cosine_embedding_loss, triplet_margin_loss, log_softmax + gather NLL written by hand."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)
        self.emb = nn.Linear(6, 5)

    def forward(self, x, seq_labels, p_target, y_pm, labels):  # x: (N, L, 6)
        logits = self.fc(x)  # (N, L, 4)
        loss = F.cross_entropy(logits.transpose(1, 2), seq_labels)
        probs = torch.sigmoid(logits)
        if self.legacy:  # the legacy exporter has no aten::binary_cross_entropy
            loss = loss - (p_target * probs.log() + (1 - p_target) * (1 - probs).log()).mean()
        else:
            loss = loss + F.binary_cross_entropy(probs, p_target)
        loss = loss + F.mse_loss(logits.mean(1), p_target.mean(1), reduction="sum") * 0.1
        e = self.emb(x)  # (N, L, 5)
        a, p, n_ = e[:, 0], e[:, 1], e[:, 2]
        if self.legacy:  # the legacy exporter has neither aten::cosine_embedding_loss nor triplet_margin_loss
            cos = F.cosine_similarity(a, p, dim=-1)
            loss = loss + torch.where(y_pm > 0, 1 - cos, (cos - 0.1).clamp(min=0)).mean()
            d_ap = F.pairwise_distance(a, p, eps=1e-6)
            d_an = F.pairwise_distance(a, n_, eps=1e-6)
            loss = loss + (d_ap - d_an + 1.0).clamp(min=0).mean()
        else:
            loss = loss + F.cosine_embedding_loss(a, p, y_pm, margin=0.1)
            loss = loss + F.triplet_margin_loss(a, p, n_, margin=1.0)
        lsm = F.log_softmax(logits[:, -1], dim=-1)
        loss = loss - lsm.gather(1, labels.unsqueeze(1)).squeeze(1).mean()
        return loss


def build_losses2():
    n = 4
    return ms.Case(
        Losses2(),
        {
            "x": randn(n, 3, 6),
            "seq_labels": torch.randint(0, 4, (n, 3)),
            "p_target": torch.rand(n, 3, 4),
            "y_pm": torch.tensor([1.0, -1.0, 1.0, -1.0]),
            "labels": torch.tensor([3, 0, 0, 2]),
        },
        batch_dim=["x", "seq_labels", "p_target", "y_pm", "labels"],
    )


class MiscOps(nn.Module):
    """one_hot(int) feeding a matmul, argmax used to index, clamp_min, maximum with a parameter,
    where with scalar branches, sum(dim=(1,2)), mean(-1, keepdim) chains, view(-1, ...), expand_as,
    stack, unbind, chunk along the batch dim."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4))
        self.floor = nn.Parameter(torch.randn(4) * 0.3)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x, cls):  # x: (N, 3, 4), cls: (N,) int64
        oh = F.one_hot(cls, 5).to(x.dtype)  # (N, 5)
        e = oh @ self.table  # (N, 4)
        h = x @ self.w + e.unsqueeze(1)  # (N, 3, 4)
        best = h.sum(-1).argmax(dim=1)  # (N,) non-differentiable path
        picked = h[torch.arange(h.shape[0]), best]  # (N, 4)
        m = torch.maximum(h, self.floor) + h.clamp_min(0.1) * 0.5
        w = torch.where(h > 0, 1.0, -0.5) * h + torch.where(h < 0.3, h, 0.0)
        s = m.sum(dim=(1, 2))  # (N,)
        c = (h - h.mean(-1, keepdim=True)).mean(-1, keepdim=True).mean(-2, keepdim=True) + h.mean(-1, keepdim=True)
        v = h.reshape(-1, 4)  # (N*3, 4)
        ex = self.floor.expand_as(h) * h
        st = torch.stack([h, w, ex], dim=1)  # (N, 3, 3, 4)
        u0, u1, u2 = h.unbind(1)
        # uneven when the batch is odd; torch.export cannot keep a chunked batch dynamic (it
        # specializes the batch), so the dynamo export chunks the last (static) dim instead
        cs = x.chunk(3, dim=-1) if not self.legacy else x.chunk(2, dim=0)
        loss = (picked**2).mean() + s.pow(2).mean() * 0.1 + (c * c).sum() + (v @ self.w).tanh().mean()
        loss = loss + (st**2).mean() + (u0 * u2 - u1).mean() + (cs[0] ** 2).sum() * 0.1 + cs[-1].mean()
        return loss


def build_misc_ops():
    return ms.Case(MiscOps(), {"x": randn(4, 3, 4), "cls": torch.tensor([0, 4, 4, 2])}, batch_dim=["x", "cls"])


class F64Idx32(nn.Module):
    """float64 model with int32 indices: embedding, index_select, gather, scatter_add."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids, sel, x):  # ids: (N, 3) int32, sel: (2,) int32, x: (N, 3, 4) float64
        h = self.emb(ids) * x  # (N, 3, 4)
        a = torch.index_select(h, 1, sel)  # (N, 2, 4)
        g = torch.gather(h, 2, ids.remainder(4).unsqueeze(-1).expand(-1, -1, 2).to(torch.int64))
        y = torch.tanh(self.fc(a)).sum() + (g**2).mean()
        return y + (self.fc(h.mean(1)) ** 2).mean()


def build_f64_idx32():
    m = F64Idx32().double()
    return ms.Case(
        m,
        {
            "ids": torch.tensor([[1, 6, 6], [0, 3, 2]], dtype=torch.int32),
            "sel": torch.tensor([2, 0], dtype=torch.int32),
            "x": randn(2, 3, 4).double(),
        },
        batch_dim=["ids", "x"],
    )


class Recurrent(nn.Module):
    """nn.GRU (unsupported: expect a clear error naming the op)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5, batch_first=True)

    def forward(self, x):
        h, _ = self.rnn(x)
        return (h**2).mean()


VARIANTS.update(
    {
        "sdpa": Variant(build_sdpa, 201),
        "mha": Variant(build_mha, 202, ["loss", "logits"]),
        "llama_lite": Variant(build_llama_lite, 203, ["loss", "logits"], dynamic=True, seq_dim={"ids": 1, "labels": 1}),
        "gpt_dynseq": Variant(build_gpt_dynseq, 204, ["loss", "logits"], dynamic=True, seq_dim={"ids": 1, "labels": 1}),
        "mobile_se": Variant(build_mobile_se, 205, ["loss", "logits"]),
        "unet_lite": Variant(build_unet_lite, 206, ["loss", "logits"]),
        "losses2": Variant(build_losses2, 207),
        "misc_ops": Variant(build_misc_ops, 208, dynamic=True),
        "f64_idx32": Variant(build_f64_idx32, 209),
        "gru": Variant(simple(Recurrent, {"x": lambda: randn(2, 3, 4)}, ["x"]), 210, expect_error="GRU"),
    }
)


class SdpaDynSeq(nn.Module):
    """SDPA causal and with a bool key mask, the batch and sequence dims dynamic."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, bmask):  # x: (N, T, 8), bmask: (N, 1, 1, T) bool
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b = F.scaled_dot_product_attention(q, k, v, attn_mask=bmask)
        return ((a - b) ** 2).mean() + a.mean()


def build_sdpa_dynseq():
    bmask = torch.tensor([[True, True, False, True, False], [True, False, True, True, True]]).view(2, 1, 1, 5)
    return ms.Case(SdpaDynSeq(), {"x": randn(2, 5, 8), "bmask": bmask}, batch_dim=["x", "bmask"])


class AttnMore(nn.Module):
    """MultiheadAttention with need_weights (averaged weights used in the loss), a float attn_mask,
    kdim/vdim != embed_dim; grouped-query attention via repeat_interleave; SDPA with scale=."""

    def __init__(self, d=8):
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, kdim=6, vdim=5, batch_first=True)
        self.q = nn.Linear(d, 8)
        self.kv = nn.Linear(d, 8)  # 2 kv heads of 2, shared by 4 query heads of 2

    def forward(self, x, mem_k, mem_v, amask):  # x: (N, T, 8), mem_k: (N, S, 6), mem_v: (N, S, 5), amask: (T, S)
        h, w = self.mha(x, mem_k, mem_v, attn_mask=amask, need_weights=True, average_attn_weights=True)
        n, t, _ = x.shape
        q = self.q(h).view(n, t, 4, 2).transpose(1, 2)  # (N,4,T,2)
        k, v = self.kv(x).view(n, t, 2, 2, 2).permute(3, 0, 2, 1, 4)  # (N,2,T,2) each
        k = k.repeat_interleave(2, dim=1)
        v = v.repeat_interleave(2, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, scale=0.3)
        return (a**2).mean() + (w * w).sum() + (h * x).mean()


def build_attn_more():
    return ms.Case(
        AttnMore(),
        {"x": randn(2, 4, 8), "mem_k": randn(2, 3, 6), "mem_v": randn(2, 3, 5), "amask": randn(4, 3)},
        batch_dim=["x", "mem_k", "mem_v"],
    )


class Losses3(nn.Module):
    """cross_entropy on (N, C, H, W) with class weights and ignore_index, nll_loss weighted sum,
    weighted BCE, margin ranking, hinge embedding, soft margin, multilabel soft margin,
    Poisson NLL, Gaussian NLL (written out), kl_div(log_target=True)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, seg, lab, bits):  # x: (N, 2, 3, 3), seg: (N, 3, 3), lab: (N,), bits: (N, 3) int64
        t01 = bits.to(x.dtype)  # targets from an int input: torch has no target gradient for several losses
        ypm = t01 * 2 - 1
        cw = torch.tensor([1.0, 2.0, 0.5, 1.5])  # class weights: constants (torch has no weight grads)
        logits = self.conv(x)  # (N,4,3,3)
        loss = F.cross_entropy(logits, seg, weight=cw, ignore_index=1)
        z = self.fc(logits.mean((2, 3)))  # (N,3)
        lsm = F.log_softmax(z, -1)
        loss = loss + F.nll_loss(lsm, lab, weight=cw[:3], reduction="sum") * 0.1
        p = torch.sigmoid(z)
        if self.legacy:  # no aten::binary_cross_entropy, margin_ranking_loss, hinge/soft_margin
            loss = loss - ((t01 * p.log() + (1 - t01) * (1 - p).log()) * cw[1:]).mean()
            loss = loss + (-ypm[:, 0] * (z[:, 0] - z[:, 1]) + 0.2).clamp(min=0).mean()
            loss = loss + torch.where(ypm > 0, z, (1.0 - z).clamp(min=0)).mean()
            loss = loss + torch.log1p(torch.exp(-ypm * z)).mean()
        else:
            loss = loss + F.binary_cross_entropy(p, t01, weight=cw[1:])
            loss = loss + F.margin_ranking_loss(z[:, 0], z[:, 1], ypm[:, 0], margin=0.2)
            loss = loss + F.hinge_embedding_loss(z, ypm, margin=1.0)
            loss = loss + F.soft_margin_loss(z, ypm)
        loss = loss + F.multilabel_soft_margin_loss(z, t01)
        if self.legacy:  # no aten::poisson_nll_loss
            loss = loss + (torch.exp(z) - t01 * 3 * z).mean()
        else:
            loss = loss + F.poisson_nll_loss(z, t01 * 3, log_input=True)
        var = (p + 0.1).clamp(min=1e-6)  # gaussian_nll_loss written out: torch.export cannot trace it
        loss = loss + 0.5 * (var.log() + (z - t01) ** 2 / var).mean()
        loss = loss + F.kl_div(lsm, torch.log_softmax(t01, -1), reduction="batchmean", log_target=True)
        return loss


def build_losses3():
    n = 3
    seg = torch.randint(0, 4, (n, 3, 3))
    seg[0, 0, 0] = 1
    return ms.Case(
        Losses3(),
        {
            "x": randn(n, 2, 3, 3),
            "seg": seg,
            "lab": torch.tensor([2, 0, 2]),
            "bits": torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0]]),
        },
        batch_dim=["x", "seg", "lab", "bits"],
    )


class TensorOps2(nn.Module):
    """flip, cumsum of logs, sort values, index_put (assignment), scatter (no reduce), sign/round
    (zero gradient), glu, baddbmm, addmm, outer, diagonal, trace, masked_fill with a parameter."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x, idx):  # x: (N, 4, 4), idx: (2,) int64
        h = torch.baddbmm(x, x, self.w.expand(x.shape[0], 4, 4), beta=0.5, alpha=0.7)
        a = torch.addmm(self.b, h[:, 0], self.w)  # (N,4)
        f = h.flip(-1) * h
        # cumprod / prod: the legacy exporter has no aten::cumprod, the dynamo one no prims.prod
        cp = torch.exp(torch.cumsum(torch.log(torch.sigmoid(h) + 0.5), dim=-1))
        pr = torch.exp(torch.log(torch.sigmoid(h) + 0.5).sum(dim=1))
        so = torch.sort(h, dim=-1, descending=True).values
        g = F.glu(h, dim=-1)  # (N,4,2)
        o = torch.outer(self.v, self.b)
        if self.legacy:  # legacy writes diagonal with an If (empty-diagonal check), has no aten::trace
            eye = torch.eye(4)
            dg, tr = (h * eye).sum(-1), (self.w * o * eye).sum()
        else:
            dg, tr = torch.diagonal(h, dim1=1, dim2=2), torch.trace(self.w * o)  # (N,4), ()
        ip = h.clone()
        # index_put over rows; the legacy exporter reshapes unbroadcast values to the indexed shape
        # (an invalid Reshape that onnxruntime refuses too), so it gets them expanded
        ip[:, idx] = self.v.expand(ip.shape[0], 2, 4) if self.legacy else self.v
        sc = h.scatter(2, idx.view(1, 1, 2).expand(h.shape[0], 4, 2), g)
        sg = torch.sign(h).detach() * h + torch.round(h * 2.0) * self.b
        loss = (a**2).mean() + f.mean() + cp.mean() + pr.mean() + (so * self.v).sum() * 0.1
        return loss + (g**2).sum() + (dg**2).mean() + tr + (ip**2).mean() + (sc**2).mean() + sg.mean()


def build_tensor_ops2():
    return ms.Case(TensorOps2(), {"x": randn(2, 4, 4), "idx": torch.tensor([3, 1])}, batch_dim=["x"])


class ConvDynHw(nn.Module):
    """Conv + BN + SiLU, nearest upsample, depthwise conv, global average pool, with the batch and
    the image height dynamic."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.dw = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, labels):  # x: (N, 2, H, 5)
        h = F.silu(self.bn(self.c1(x)))
        h = self.dw(self.up(h)) + h
        logits = self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))
        return F.cross_entropy(logits, labels), logits


def build_conv_dyn_hw():
    return ms.Case(
        ConvDynHw(), {"x": randn(2, 2, 6, 5), "labels": torch.tensor([2, 1])}, batch_dim=["x", "labels"], extra_outputs=["logits"]
    )


VARIANTS.update(
    {
        "attn_more": Variant(build_attn_more, 211),
        "losses3": Variant(build_losses3, 212),
        "tensor_ops2": Variant(build_tensor_ops2, 213),
        "mha_dynseq": Variant(
            build_mha,
            215,
            ["loss", "logits"],
            dynamic=True,
            seq_dim={"x": 1, "pad": 1},
            notes="nn.MultiheadAttention (batch_first, key_padding_mask; seq-first self-attention) "
            "with the batch and sequence dims dynamic",
            skip={
                "legacy": "the legacy exporter bakes the sequence length into "
                "MultiheadAttention's Reshapes; onnxruntime fails at seq+1 too"
            },
        ),
        "sdpa_dynseq": Variant(build_sdpa_dynseq, 216, dynamic=True, seq_dim={"x": 1, "bmask": 3}),
        "conv_dyn_hw": Variant(build_conv_dyn_hw, 214, ["loss", "logits"], dynamic=True, seq_dim={"x": 2}),
    }
)


# --------------------------------------------------------------------------
# Torch reference (as make_samples.torch_reference, keeping the tensors' dtype and
# taking the loss from any output position)
# --------------------------------------------------------------------------
def torch_reference(model: nn.Module, inputs: dict, loss_index: int) -> ms.TorchReference:
    with torch.no_grad():
        plain = model(*inputs.values())
        plain_loss = (plain[loss_index] if isinstance(plain, tuple) else plain).item()
    m = ms.differentiable_copy(model)
    args = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    out = m(*args.values())
    loss = out[loss_index] if isinstance(out, tuple) else out
    assert math.isclose(loss.item(), plain_loss, rel_tol=1e-6, abs_tol=1e-7), (loss.item(), plain_loss)
    tensors = ms.named_float_tensors(m)
    canonical = {}
    for name, t in tensors.items():
        canonical.setdefault(id(t), name)
    owner = {name: canonical[id(t)] for name, t in tensors.items()}
    wrt = [tensors[n] for n in canonical.values()]
    float_inputs = [k for k, v in args.items() if v.is_floating_point()]
    wrt += [args[k] for k in float_inputs]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [np.zeros_like(t.detach().numpy()) if g is None else g.detach().numpy() for t, g in zip(wrt, grads)]
    n = len(canonical)
    return ms.TorchReference(
        loss=loss.item(),
        values={k: v.detach().numpy() for k, v in tensors.items()},
        owner=owner,
        grads=dict(zip(canonical.values(), grads[:n])),
        input_grads=dict(zip(float_inputs, grads[n:])),
    )


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------
def export(
    case: ms.Case,
    exporter: str,
    output_names: list[str],
    dynamic: bool,
    optimize: bool = True,
    seq_dim: dict[str, int] | None = None,
):
    seq_dim = seq_dim or {}
    args = tuple(case.inputs.values())
    if exporter == "legacy":
        settings = dict(
            dynamo=False,
            opset_version=ms.LEGACY_OPSET,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            export_params=True,
            keep_initializers_as_inputs=False,
        )
        if dynamic:
            settings["dynamic_axes"] = {k: {0: "batch"} for k in case.batch_dim}
            for k, axis in seq_dim.items():
                settings["dynamic_axes"].setdefault(k, {})[axis] = "seq"
        buf = io.BytesIO()
        with ms.quiet():
            torch.onnx.export(case.model, args, buf, input_names=list(case.inputs), output_names=output_names, **settings)
        settings["training"] = "PRESERVE"
        return onnx.load_from_string(buf.getvalue()), settings
    settings = dict(dynamo=True, optimize=optimize)
    kwargs = dict(settings)
    if dynamic:
        batch = torch.export.Dim("batch", min=2, max=1024)
        seq = torch.export.Dim("seq", min=2, max=12)
        kwargs["dynamic_shapes"] = tuple(
            ({0: batch} if k in case.batch_dim else {}) | ({seq_dim[k]: seq} if k in seq_dim else {}) or None for k in case.inputs
        )
        settings["dynamic_shapes"] = "batch axis 0 = torch.export.Dim('batch')"
        if seq_dim:
            settings["dynamic_shapes"] += ", " + ", ".join(f"{k} axis {a} = torch.export.Dim('seq')" for k, a in seq_dim.items())
    with ms.quiet():
        program = torch.onnx.export(case.model, args, input_names=list(case.inputs), output_names=output_names, **kwargs)
    if optimize:
        return program.model_proto, settings
    params = set(ms.named_float_tensors(case.model)) | {n for n, _ in case.model.named_buffers(remove_duplicate=False)}
    model = ms.initializers_to_constants(program.model_proto, keep=params)
    model = ms.initializers_to_constants(ms.fold_constants_keeping_params(model), keep=params)
    settings["post_process"] = "initializers_to_constants + fold_constants_keeping_params"
    return model, settings


def loss_first_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose first output is `loss` (for make_samples' initializer matching)."""
    view = copy.deepcopy(model)
    outs = list(view.graph.output)
    outs.sort(key=lambda o: o.name != "loss")
    del view.graph.output[:]
    view.graph.output.extend(outs)
    return view


def export_checked(case, exporter, ref, output_names, dynamic, seq_dim=None):
    attempts = [{}] if exporter == "legacy" else [{"optimize": True}, {"optimize": False}]
    error = None
    for kwargs in attempts:
        model, settings = export(case, exporter, output_names, dynamic, seq_dim=seq_dim, **kwargs)
        model = ms.inline_functions(model)
        ms.strip_node_metadata(model)
        try:
            return model, ms.match_initializers(loss_first_view(model), ref), settings
        except ms.MappingError as exc:
            error = exc
    raise error


# --------------------------------------------------------------------------
# gradgen checks
# --------------------------------------------------------------------------
def feeds_of(model: onnx.ModelProto, inputs: dict) -> dict[str, np.ndarray]:
    names = [vi.name for vi in model.graph.input]
    return {k: inputs[k].numpy() for k in names}


def check_forward_ort(model, feeds, where):
    session = ms.ort_session(model)
    want = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    got = Session(model).run(feeds)
    for name, value in want.items():
        np.testing.assert_allclose(
            got[name],
            value,
            rtol=1e-4,
            atol=1e-5 * max(1.0, float(np.abs(value).max(initial=0))),
            err_msg=f"{where}: output {name}",
        )


def run_one(name: str, variant: Variant, exporter: str, case, ref, save_dir: Path | None) -> str:
    where = f"{name}_{exporter}"
    loss_index = variant.outputs.index("loss")
    try:
        model, mapping, settings = export_checked(case, exporter, ref, variant.outputs, variant.dynamic, variant.seq_dim)
    except Exception as exc:  # noqa: BLE001
        return f"skip (export: {type(exc).__name__}: {str(exc).splitlines()[0][:150]})"
    feeds = feeds_of(model, case.inputs)
    if variant.expect_error:
        import gradgen

        try:
            gradgen.build_backward(model)
        except gradgen.errors.UnsupportedOpsError as exc:
            nodes = [n.name for n in model.graph.node if n.op_type == variant.expect_error]
            message = str(exc)
            assert variant.expect_error in message and nodes and all(repr(n) in message for n in nodes), message
            return f"ok (expected error: {' '.join(message.split())[:120]})"
        raise AssertionError(f"{where}: no error for the unsupported op {variant.expect_error}")
    ort_note = ""
    try:
        ms.check_forward(loss_first_view(model), feeds, ref.loss)
    except AssertionError:
        raise
    except Exception as exc:  # noqa: BLE001 - onnxruntime cannot run the model
        ort_note = f", onnxruntime cannot run it: {str(exc).splitlines()[0][:160]}"
    arrays = ms.reference_arrays(ref, mapping, feeds)
    batch_dim = [k for k in case.batch_dim if k in feeds]
    _check_gradients(model, feeds, arrays, where)
    _check_gradients(with_symbolic_batch(model, batch_dim), feeds, arrays, where + " (symbolic batch)")
    if not ort_note:
        check_forward_ort(model, feeds, where)
    extra = ort_note
    if variant.dynamic:
        bigger = {k: torch.cat([v, v[:1]]) if k in batch_dim else v for k, v in case.inputs.items()}
        ref2 = torch_reference(case.model, bigger, loss_index)
        feeds2 = feeds_of(model, bigger)
        _check_gradients(model, feeds2, ms.reference_arrays(ref2, mapping, feeds2), where + " (batch+1)")
        extra = ", batch+1 ok"
    if variant.seq_dim:  # sequence + 1 (the new position repeats the first one)
        longer = {
            k: torch.cat([v, v.narrow(a, 0, 1)], a) if (a := variant.seq_dim.get(k)) is not None else v
            for k, v in case.inputs.items()
        }
        ref3 = torch_reference(case.model, longer, loss_index)
        feeds3 = feeds_of(model, longer)
        _check_gradients(model, feeds3, ms.reference_arrays(ref3, mapping, feeds3), where + " (seq+1)")
        extra += ", seq+1 ok"
    if save_dir is not None:
        meta = {
            "family": name,
            "exporter": exporter,
            "opset": ms.opset_of(model),
            "inputs": {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()},
            "outputs": [o.name for o in model.graph.output],
            "ops": ms.op_list(model),
            "torch": torch.__version__.split("+")[0],
            "onnx": onnx.__version__,
            "batch_dim": batch_dim,
            "batch_symbolic_ok": ms.check_symbolic_batch(loss_first_view(model), feeds, batch_dim),
            "export_settings": settings,
            "initializer_to_torch": mapping,
            "notes": (variant.notes or (type(case.model).__doc__ or "").strip().replace("\n", " ")),
        }
        ms.save_dir(save_dir / where, model, feeds, arrays, meta)
        extra += ", saved"
    return f"ok ({len(ms.op_list(model))} ops{extra})"


# --------------------------------------------------------------------------
# Sequences: lists an exporter builds in a loop
# --------------------------------------------------------------------------
class EmbeddingBags(nn.Module):
    """nn.EmbeddingBag in its three modes, one bag empty, per-sample weights on the sum. The dynamo
    exporter writes each as a Loop appending one bag per iteration to a sequence that a
    ConcatFromSequence joins after the loop (SequencesAsTensorsPass's loop case); the legacy
    exporter as a Loop with a scan output."""

    def __init__(self):
        super().__init__()
        self.bag_sum = nn.EmbeddingBag(12, 6, mode="sum")
        self.bag_mean = nn.EmbeddingBag(12, 6, mode="mean")
        self.bag_max = nn.EmbeddingBag(12, 6, mode="max")
        self.fc = nn.Linear(18, 3)

    def forward(self, ids, offsets, weights, labels):
        h = torch.cat(
            [
                self.bag_sum(ids, offsets, per_sample_weights=weights),
                self.bag_mean(ids, offsets),
                self.bag_max(ids, offsets),
            ],
            -1,
        )
        return F.cross_entropy(self.fc(h), labels)


def build_embedding_bags(offsets=(0, 3, 3, 5, 8)):
    return ms.Case(
        EmbeddingBags(),
        {
            "ids": torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 11, 0]),
            "offsets": torch.tensor(offsets),
            "weights": torch.rand(10) + 0.5,
            "labels": torch.tensor([0, 2, 1, 1, 0]),
        },
        batch_dim=[],
    )


VARIANTS.update(
    {
        "embedding_bags": Variant(
            build_embedding_bags,
            301,
            skip={"legacy": "the legacy export's mean of an empty bag is NaN (a ReduceMean of nothing; torch gives 0)"},
        ),
        "embedding_bags_full": Variant(lambda: build_embedding_bags((0, 3, 4, 5, 8)), 302),
    }
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append")
    parser.add_argument("--exporter", choices=ms.EXPORTERS, action="append")
    parser.add_argument("--save", action="append", default=[], help="variant or variant_exporter to save as a fixture directory")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "models")
    parser.add_argument("--traceback", action="store_true")
    args = parser.parse_args(argv)
    failed = 0
    for name, variant in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        torch.manual_seed(variant.seed)
        case = variant.build()
        case.model.eval()
        ms.perturb_(case.model)
        for exporter in args.exporter or ms.EXPORTERS:
            case.model.legacy = exporter == "legacy"  # swaps ops the legacy exporter lacks
            ref = torch_reference(case.model, case.inputs, variant.outputs.index("loss"))
            save = args.out if {name, f"{name}_{exporter}"} & set(args.save) else None
            if exporter in variant.skip:
                print(f"{name:16s} {exporter:7s} skip ({variant.skip[exporter]})", flush=True)
                continue
            try:
                result = run_one(name, variant, exporter, case, ref, save)
            except Exception as exc:  # noqa: BLE001
                failed += 1
                result = f"FAIL {type(exc).__name__}: {str(exc).strip()[:600]}"
                if args.traceback:
                    traceback.print_exc()
            print(f"{name:16s} {exporter:7s} {result}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
