#!/usr/bin/env python
"""Build the ONNX sample models and test fixtures used by gradgen.

Every model family below is a small PyTorch module whose ``forward`` takes the
graph inputs (data, targets, indices, ...) and returns the scalar loss first
(optionally followed by other outputs such as logits).  Each family is
exported with both PyTorch ONNX exporters:

* ``legacy``: ``torch.onnx.export(..., dynamo=False, opset_version=17,
  do_constant_folding=False, training=TrainingMode.PRESERVE)`` with the model
  in eval mode, so that no parameter is folded, transposed or fused (Conv+BN).
* ``dynamo``: ``torch.onnx.export(..., dynamo=True)`` with its default opset.
  The default (``optimize=True``) export is tried first.  Its optimizer may
  fuse an eval BatchNorm into the preceding Conv/Gemm, fold slices or
  transposes of parameters and lift float constants to initializers, so when
  an initializer does not match a torch tensor the export is redone with
  ``optimize=False``, exporter constants are turned into Constant nodes and
  only constant folding that does not touch parameters is applied
  (``export_settings`` in meta.json says which path was used).
  Model-local functions are inlined; node doc strings/metadata are dropped.

Each exported model is saved as a directory holding

* ``model.onnx``     the forward graph; the first output is the scalar ``loss``;
* ``inputs.npz``     one array per graph input, keyed by the graph input name;
* ``reference.npz``  ``loss`` (float64) and torch.autograd gradients:
  ``<initializer>_grad`` for every float initializer the loss depends on and
  ``<input>_grad`` for every float graph input;
* ``meta.json``      family, exporter, opset, inputs, ops, versions, batch dims.

The reference gradients are the gradients of the function the ONNX graph
computes.  Two torch behaviours differ from that and are neutralised in the
copy of the model used for autograd:

* eval-mode BatchNorm is not differentiable w.r.t. its running statistics in
  torch, so it is replaced by the equivalent explicit formula;
* ``nn.Embedding(padding_idx=...)`` zeroes the gradient of the padding row, an
  ONNX ``Gather`` does not, so ``padding_idx`` is dropped for the gradient.

All parameters and float buffers are perturbed with random noise after
construction so that no two tensors hold equal values (the legacy exporter
de-duplicates equal initializers, e.g. a LayerNorm weight of ones and a BN
running_var of ones) and so that every initializer can be matched to its torch
tensor by value.  Every float initializer the loss depends on must match a
torch parameter/buffer, and every torch tensor with a non-zero gradient must
appear as an initializer; otherwise the script fails.

Usage::

    python samples/make_samples.py [--out-samples DIR] [--out-fixtures DIR]
                                   [--only NAME] [--exporter legacy|dynamo]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import math
import sys
import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx.inliner
import onnx.numpy_helper
import onnxruntime as ort
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ort.set_default_logger_severity(4)
LEGACY_OPSET = 17
LOSS_RTOL = 1e-5
MAX_MODEL_BYTES = 300_000


# --------------------------------------------------------------------------
# Model families
# --------------------------------------------------------------------------
@dataclass
class Case:
    """A model plus the example inputs it is exported with."""

    model: nn.Module
    inputs: dict[str, torch.Tensor]  # graph input name -> example tensor
    batch_dim: list[str]  # inputs whose axis 0 is a batch axis
    extra_outputs: list[str] = field(default_factory=list)  # names after "loss"
    notes: str = ""


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


# 1. mlp_mse -----------------------------------------------------------------
class MlpMse(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 12)
        self.fc3 = nn.Linear(12, 3)

    def forward(self, x, target):
        h = torch.relu(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        y = torch.sigmoid(self.fc3(h))
        return F.mse_loss(y, target), y


def build_mlp_mse():
    return Case(MlpMse(), {"x": randn(4, 6), "target": torch.rand(4, 3)}, batch_dim=["x", "target"], extra_outputs=["pred"])


# 2. mlp_bce -----------------------------------------------------------------
class MlpBce(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 10)
        self.fc2 = nn.Linear(10, 4)

    def forward(self, x, target):
        logits = self.fc2(F.leaky_relu(self.fc1(x), 0.1))
        return F.binary_cross_entropy_with_logits(logits, target), logits


def build_mlp_bce():
    target = (torch.rand(4, 4) > 0.5).float()
    return Case(MlpBce(), {"x": randn(4, 5), "target": target}, batch_dim=["x", "target"], extra_outputs=["logits"])


# 3. cnn (LeNet-style) ------------------------------------------------------
class LeNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.pool2 = nn.AvgPool2d(2)
        self.fc = nn.Linear(6 * 2 * 2, 10)

    def forward(self, x, labels):
        h = self.pool1(torch.relu(self.conv1(x)))
        h = self.pool2(torch.relu(self.conv2(h)))
        logits = self.fc(torch.flatten(h, 1))
        return F.cross_entropy(logits, labels), logits


def build_cnn():
    return Case(
        LeNet(),
        {"x": randn(3, 1, 14, 14), "labels": torch.tensor([3, 7, 3])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
    )


# 4. conv variants ------------------------------------------------------------
class Conv1dVariants(nn.Module):
    def __init__(self):
        super().__init__()
        self.strided = nn.Conv1d(4, 6, 3, stride=2, dilation=2, bias=False)
        self.depthwise = nn.Conv1d(6, 6, 3, groups=6)
        self.same = nn.Conv1d(6, 4, 4, padding="same", groups=2)

    def forward(self, x):
        h = torch.tanh(self.strided(x))
        h = F.pad(h, (1, 2))  # asymmetric padding
        h = self.depthwise(h)
        h = self.same(h)
        return (h * h).mean() + h.sum() * 0.01


def build_conv1d():
    return Case(
        Conv1dVariants(), {"x": randn(2, 4, 17)}, batch_dim=["x"], notes="padding='same' with an even kernel (asymmetric)"
    )


class Conv2dVariants(nn.Module):
    def __init__(self):
        super().__init__()
        self.strided = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8, dilation=2, bias=False)
        self.same = nn.Conv2d(8, 4, (3, 2), padding="same", groups=2)
        self.rect = nn.Conv2d(4, 2, (2, 3), stride=(2, 1), padding=(0, 1))

    def forward(self, x):
        h = torch.relu(self.strided(x))
        h = F.pad(h, (1, 0, 2, 1))  # left, right, top, bottom
        h = self.depthwise(h)
        h = torch.sigmoid(self.same(h))
        h = self.rect(h)
        return (h * h).sum() + h.mean()


def build_conv2d():
    return Case(Conv2dVariants(), {"x": randn(2, 4, 9, 9)}, batch_dim=["x"])


class Conv3dVariants(nn.Module):
    def __init__(self):
        super().__init__()
        self.strided = nn.Conv3d(2, 4, 3, stride=(1, 2, 2), padding=(1, 0, 1))
        self.depthwise = nn.Conv3d(4, 4, 3, groups=4, dilation=(1, 2, 1), bias=False)
        self.same = nn.Conv3d(4, 2, 3, padding="same")

    def forward(self, x):
        h = torch.tanh(self.strided(x))
        h = F.pad(h, (0, 1, 2, 0, 1, 1))
        h = torch.relu(self.depthwise(h))
        h = self.same(h)
        return (h * h).mean()


def build_conv3d():
    return Case(Conv3dVariants(), {"x": randn(2, 2, 5, 7, 7)}, batch_dim=["x"])


# 5. resnet_block -------------------------------------------------------------
class ResNetBlock(nn.Module):
    def __init__(self, c=4, classes=5):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x, labels):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        h = torch.relu(h + x)
        logits = self.fc(torch.flatten(self.pool(h), 1))
        return F.cross_entropy(logits, labels), logits


def build_resnet_block():
    return Case(
        ResNetBlock(),
        {"x": randn(2, 4, 6, 6), "labels": torch.tensor([4, 1])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
        notes="BatchNorm in eval mode: running_mean/var are initializers with reference gradients",
    )


# 6. embedding ----------------------------------------------------------------
class EmbeddingModel(nn.Module):
    def __init__(self, vocab=12, dim=8, seq=6, classes=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(seq, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids, labels):
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.norm(self.tok(ids) + self.pos(positions))
        logits = self.head(h)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss, logits


def build_embedding():
    ids = torch.tensor([[0, 3, 3, 7, 0, 11], [5, 5, 0, 1, 2, 3]])
    labels = torch.tensor([[0, 1, 2, 3, 4, 0], [4, 4, 1, 0, 2, 3]])
    return Case(
        EmbeddingModel(),
        {"ids": ids, "labels": labels},
        batch_dim=["ids", "labels"],
        extra_outputs=["logits"],
        notes="padding_idx=0 with id 0 in the input; the reference "
        "gradient of tok.weight includes row 0 (ONNX Gather "
        "semantics, torch would zero it)",
    )


# 7. slicing --------------------------------------------------------------------
class Slicing(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6))
        self.v = nn.Parameter(torch.randn(6))

    def forward(self, x):  # x: (N, 8, 6)
        h = x * self.w
        a = h[:, 1:5:2]  # step 2
        b = h[..., -3:-1]  # negative start/end
        c = h.flip(-1)  # step -1
        d = h.narrow(1, 2, 3)
        e1, e2 = h.chunk(2, dim=1)
        s1, s2, s3 = torch.split(h, [3, 4, 1], dim=1)
        r = h.flip(1)[:, ::2, 1:]  # step -1 then step 2
        loss = (a * a).sum() + (b * self.v[1:3]).sum() + (c * self.v).sum()
        loss = loss + torch.tanh(d).sum() + (e1 * e2).sum()
        loss = loss + s1.mean() + (s2**2).mean() + (s3 * self.v).sum()
        loss = loss + (r * r).mean()
        return loss


def build_slicing():
    return Case(Slicing(), {"x": randn(2, 8, 6)}, batch_dim=["x"])


# 8. gather_elements ------------------------------------------------------------
class GatherElements(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 5))

    def forward(self, x, idx0, idx1, idx2):  # x: (N, 4, 5)
        h = torch.tanh(x * self.w)
        g0 = torch.gather(h, 0, idx0)
        g1 = torch.gather(h, 1, idx1)
        g2 = torch.gather(h, -1, idx2)
        return (g0 * g0).sum() + (g1 * 2.0).sum() + (g2**3).mean()


def build_gather_elements():
    n = 3
    idx0 = torch.tensor([[[0, 2, 2, 1, 0]] * 4, [[1, 1, 0, 2, 2]] * 4])
    idx1 = torch.randint(0, 4, (n, 6, 5))  # longer than the axis: repeats
    idx2 = torch.randint(0, 5, (n, 4, 7))
    idx1[:, :2] = 3  # guaranteed repeated indices
    return Case(
        GatherElements(),
        {"x": randn(n, 4, 5), "idx0": idx0, "idx1": idx1, "idx2": idx2},
        batch_dim=["x", "idx1", "idx2"],
        notes="idx0 gathers along the batch axis (values < 3)",
    )


# 9. index_select ---------------------------------------------------------------
class IndexSelect(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 6))

    def forward(self, x, idx, neg_idx):  # x: (N, 5, 6)
        h = x * self.w
        a = torch.index_select(h, 1, idx)  # repeated idx, axis 1
        b = torch.index_select(h, 2, idx)  # axis 2
        c = h[neg_idx]  # axis 0, negative idx input
        d = h[:, neg_idx]  # axis 1, negative idx input
        e = h[..., [-1, 0, -2, -1]]  # constant negative indices
        f = self.w[neg_idx]  # parameter gather
        loss = (a * a).sum() + b.mean() + torch.tanh(c).sum()
        return loss + (d * 0.5).sum() + (e**2).mean() + (f * f).sum()


def build_index_select():
    return Case(
        IndexSelect(),
        {"x": randn(3, 5, 6), "idx": torch.tensor([4, 0, 4, 2]), "neg_idx": torch.tensor([-1, 0, -3, -1, 1])},
        batch_dim=["x"],
        notes="torch.index_select needs non-negative indices; the negative ones go through advanced indexing",
    )


# 10. broadcast -------------------------------------------------------------------
class Broadcast(nn.Module):
    def __init__(self, c=3, m=6, k=4, heads=2, n_out=5):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1, c, 1, 1))
        self.b = nn.Parameter(torch.randn(c, 1, 1))
        self.expo = nn.Parameter(torch.rand(c, 1, 1) + 0.5)
        self.p = nn.Parameter(torch.tensor(1.5))
        self.v = nn.Parameter(torch.randn(1, m))
        self.mat = nn.Parameter(torch.randn(heads, k, n_out))

    def forward(self, x, u):  # x: (N, C, H, W), u: (N, 1)
        t = x * self.a + self.b - 0.5  # (N,C,H,W)
        t = t / (F.softplus(self.b) + 1.0)
        base = F.softplus(t) + 0.1  # positive
        pw = base**self.expo  # param exponent
        ps = torch.exp(t * 0.3) ** self.p  # scalar param exp.
        two = torch.pow(2.0, torch.tanh(t))  # scalar base
        sq = torch.sqrt(base) * 3 - torch.log(base) / 2
        # where() with branches that agree at t == 0 (continuous loss)
        w = torch.where(t > 0, pw, pw * torch.exp(t)) + sq + ps * 0.1 + two - t**2
        r1 = w.sum(dim=(2, 3)) * 0.05  # (N,C)
        r2 = w.mean(dim=1, keepdim=True)  # (N,1,H,W)
        r3 = w.sum(dim=-1, keepdim=True).mean(dim=2)  # (N,C,1)
        sm = torch.softmax(w, dim=-1)
        lsm = torch.log_softmax(w, dim=1)
        uv = u * self.v + u / 2.0 - self.v  # (N,M)
        cat = torch.cat([r1, uv], dim=1)  # (N,C+M)
        c1, c2 = torch.split(cat, [4, cat.shape[1] - 4], dim=1)
        z = c1.unsqueeze(1).expand(-1, 3, -1)  # (N,3,4)
        z = z.transpose(1, 2).reshape(-1, 2, 6)  # (N,2,6)
        y = z.unsqueeze(1).reshape(-1, 1, 3, 4)  # (N,1,3,4)
        mm = torch.matmul(y, self.mat)  # (N,H,3,5)
        sqz = r2.squeeze(1) * r3.squeeze(-1).unsqueeze(-1)[:, :1]  # (N,H,W)
        loss = mm.pow(2).mean() + (sm * lsm).sum() + sqz.mean()
        return loss + (c2 * c2).sum() / 7.0 + r3.mean(dim=(1, 2), keepdim=True).sum()


def build_broadcast():
    return Case(Broadcast(), {"x": randn(2, 3, 4, 5), "u": randn(2, 1)}, batch_dim=["x", "u"])


# 11. transformer -----------------------------------------------------------------
class TransformerModel(nn.Module):
    def __init__(self, d=16, classes=4):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, x, labels):  # x: (N, T, d)
        h = self.layer(x)
        logits = self.head(h.mean(dim=1))
        return F.cross_entropy(logits, labels), logits


def build_transformer():
    return Case(
        TransformerModel(),
        {"x": randn(2, 5, 16), "labels": torch.tensor([1, 3])},
        batch_dim=["x", "labels"],
        extra_outputs=["logits"],
    )


# 12. gpt2_hand -------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.reshape(-1, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
        att = att.masked_fill(~causal, float("-inf"))
        y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(-1, t, d))


class Block(nn.Module):
    def __init__(self, d, heads, gelu_approximate):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.gelu_approximate = gelu_approximate

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = F.gelu(self.fc(self.ln2(x)), approximate=self.gelu_approximate)
        return x + self.out(h)


class HandGpt2(nn.Module):
    def __init__(self, vocab=32, d=16, heads=2, max_len=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList([Block(d, heads, "tanh"), Block(d, heads, "none")])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        for mod in self.modules():  # GPT-2 style init
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                nn.init.zeros_(mod.bias)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        return loss, logits


def build_gpt2_hand():
    ids = torch.randint(0, 32, (2, 8))
    ids[0, 3] = ids[0, 5] = ids[1, 0]  # repeated tokens
    return Case(
        HandGpt2(),
        {"ids": ids},
        batch_dim=["ids"],
        extra_outputs=["logits"],
        notes="tied wte/lm_head; causal mask built in forward from a "
        "bool tril and masked_fill(-inf); layer 0 uses tanh "
        "GELU, layer 1 erf GELU",
    )


# 13. gpt2_hf ------------------------------------------------------------------
class HfGpt2Loss(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, input_ids, attention_mask, labels):
        out = self.gpt(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        return out.loss, out.logits


def build_gpt2_hf():
    ids = torch.randint(0, 64, (2, 8))
    ids[1, 2] = ids[1, 6] = ids[0, 1]
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return Case(
        HfGpt2Loss(),
        inputs,
        extra_outputs=["logits"],
        batch_dim=["input_ids", "attention_mask", "labels"],
        notes="transformers GPT2LMHeadModel, random init, eager attention, use_cache=False, tied embeddings",
    )


@dataclass
class Family:
    build: Callable[[], Case]
    seed: int
    sample: str | None = None  # bundled sample directory name (legacy export)


FAMILIES: dict[str, Family] = {
    "mlp_mse": Family(build_mlp_mse, 1, sample="mlp"),
    "mlp_bce": Family(build_mlp_bce, 2),
    "cnn": Family(build_cnn, 3, sample="cnn"),
    "conv1d": Family(build_conv1d, 4),
    "conv2d": Family(build_conv2d, 5),
    "conv3d": Family(build_conv3d, 6),
    "resnet_block": Family(build_resnet_block, 7),
    "embedding": Family(build_embedding, 8, sample="embedding"),
    "slicing": Family(build_slicing, 9, sample="slicing"),
    "gather_elements": Family(build_gather_elements, 10, sample="gather_elements"),
    "index_select": Family(build_index_select, 11),
    "broadcast": Family(build_broadcast, 12, sample="broadcast"),
    "transformer": Family(build_transformer, 13, sample="transformer"),
    "gpt2_hand": Family(build_gpt2_hand, 14),
    "gpt2_hf": Family(build_gpt2_hf, 15),
}
EXPORTERS = ("legacy", "dynamo")


# --------------------------------------------------------------------------
# Torch side: parameter perturbation and reference gradients
# --------------------------------------------------------------------------
def named_float_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """All parameters and float buffers, including tied aliases."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for name, buf in model.named_buffers(remove_duplicate=False):
        if buf.is_floating_point():
            tensors[name] = buf
    return tensors


@torch.no_grad()
def perturb_(model: nn.Module) -> None:
    """Give every float tensor distinct random values (see module doc)."""
    seen = set()
    for name, t in named_float_tensors(model).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        if name.endswith("running_var"):
            t.uniform_(0.5, 1.5)
        else:
            t.add_(torch.randn_like(t) * 0.1)
    for mod in model.modules():
        if isinstance(mod, nn.Embedding) and mod.padding_idx is not None:
            mod.weight[mod.padding_idx].zero_()


def _explicit_batch_norm(self, x):
    shape = (1, -1) + (1,) * (x.dim() - 2)
    inv_std = torch.rsqrt(self.running_var.view(shape) + self.eps)
    y = (x - self.running_mean.view(shape)) * inv_std
    return y * self.weight.view(shape) + self.bias.view(shape)


def differentiable_copy(model: nn.Module) -> nn.Module:
    """Copy of `model` whose autograd gradients are those of the ONNX graph."""
    m = copy.deepcopy(model)
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            assert not mod.training and mod.track_running_stats
            mod.forward = types.MethodType(_explicit_batch_norm, mod)
        if isinstance(mod, nn.Embedding):
            mod.padding_idx = None  # ONNX Gather has no padding row
    for t in named_float_tensors(m).values():
        t.requires_grad_(True)
    return m


def first_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@dataclass
class TorchReference:
    loss: float
    values: dict[str, np.ndarray]  # torch name -> value (tied aliases too)
    owner: dict[str, str]  # torch name -> canonical name of its tensor
    grads: dict[str, np.ndarray]  # canonical name -> gradient
    input_grads: dict[str, np.ndarray]


def torch_reference(model: nn.Module, inputs: dict[str, torch.Tensor]) -> TorchReference:
    """Forward loss and autograd gradients w.r.t. all tensors and float inputs."""
    with torch.no_grad():
        plain_loss = first_output(model(*inputs.values())).item()
    m = differentiable_copy(model)
    args = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    loss = first_output(m(*args.values()))
    assert math.isclose(loss.item(), plain_loss, rel_tol=1e-6, abs_tol=1e-7), (loss.item(), plain_loss)

    tensors = named_float_tensors(m)
    canonical = {}  # id -> first name
    for name, t in tensors.items():
        canonical.setdefault(id(t), name)
    owner = {name: canonical[id(t)] for name, t in tensors.items()}
    wrt = [tensors[n] for n in canonical.values()]
    float_inputs = [k for k, v in args.items() if v.is_floating_point()]
    wrt += [args[k] for k in float_inputs]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    grads = [np.zeros(t.shape, np.float32) if g is None else g.detach().numpy().astype(np.float32) for t, g in zip(wrt, grads)]
    n = len(canonical)
    return TorchReference(
        loss=loss.item(),
        values={k: v.detach().numpy() for k, v in tensors.items()},
        owner=owner,
        grads=dict(zip(canonical.values(), grads[:n])),
        input_grads=dict(zip(float_inputs, grads[n:])),
    )


# --------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------
@contextlib.contextmanager
def quiet():
    """Silence exporter chatter (progress lines, deprecation warnings)."""
    logging.disable(logging.WARNING)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


def export_legacy(case: Case, output_names: list[str], **_) -> tuple[onnx.ModelProto, dict]:
    settings = dict(
        dynamo=False,
        opset_version=LEGACY_OPSET,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.PRESERVE,
        export_params=True,
        keep_initializers_as_inputs=False,
    )
    buf = io.BytesIO()
    with quiet():
        torch.onnx.export(
            case.model, tuple(case.inputs.values()), buf, input_names=list(case.inputs), output_names=output_names, **settings
        )
    settings["training"] = "PRESERVE"
    return onnx.load_from_string(buf.getvalue()), settings


def export_dynamo(case: Case, output_names: list[str], optimize: bool = True):
    """Default dynamo export; with ``optimize=False`` the raw graph is tidied
    by `fold_constants_keeping_params` instead of the exporter's optimizer."""
    settings = dict(dynamo=True, optimize=optimize)
    with quiet():
        program = torch.onnx.export(
            case.model, tuple(case.inputs.values()), input_names=list(case.inputs), output_names=output_names, **settings
        )
    if optimize:
        return program.model_proto, settings
    # Exporter constants (e.g. float scalars) come out as initializers: make
    # them Constant nodes so that only parameters/buffers are initializers.
    params = set(named_float_tensors(case.model)) | {n for n, _ in case.model.named_buffers(remove_duplicate=False)}
    model = initializers_to_constants(program.model_proto, keep=params)
    model = initializers_to_constants(fold_constants_keeping_params(model), keep=params)
    settings["post_process"] = "initializers_to_constants + fold_constants_keeping_params"
    return model, settings


def fold_constants_keeping_params(model: onnx.ModelProto) -> onnx.ModelProto:
    """The exporter's optimizer minus what breaks the parameter mapping.

    ``torch.onnx.export(optimize=True)`` runs onnxscript's optimizer, which
    also applies rewrite rules (e.g. fuses an eval BatchNorm into the Conv or
    Gemm before it, changing that weight), folds ops on parameters (slices,
    transposes) and lifts every Constant node to an initializer (float
    scalars would then look like parameters).  Here only constant folding of
    nodes that do not read an initializer (Shape/Size excepted), dead-code
    removal and common-subexpression elimination run.
    """
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import _constant_folding

    def should_fold(node):
        if node.op_type in ("Shape", "Size"):
            return None
        if any(v is not None and v.is_initializer() for v in node.inputs):
            return False
        return None

    ir_model = ir.serde.deserialize_model(model)
    ir.passes.Sequential(
        common.InlinePass(),
        ir.passes.PassManager(
            [
                _constant_folding.FoldConstantsPass(
                    shape_inference=True, input_size_limit=8192, output_size_limit=262144, should_fold=should_fold
                ),
                common.RemoveUnusedNodesPass(),
            ],
            steps=2,
            early_stop=True,
        ),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
    )(ir_model)
    return ir.serde.serialize_model(ir_model)


def initializers_to_constants(model: onnx.ModelProto, keep: set[str]) -> onnx.ModelProto:
    """Turn initializers that are not torch parameters/buffers (exporter
    constants such as scalars) into Constant nodes."""
    graph = model.graph
    constants = [t for t in graph.initializer if t.name not in keep]
    nodes = [onnx.helper.make_node("Constant", [], [t.name], value=t, name=f"constant_{t.name}") for t in constants]
    kept = [t for t in graph.initializer if t.name in keep]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    old_nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + old_nodes)
    return model


EXPORT_FUNCS = {"legacy": export_legacy, "dynamo": export_dynamo}


def inline_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
        del model.functions[:]
    return model


def strip_node_metadata(model: onnx.ModelProto) -> None:
    """Drop per-node doc strings and metadata (the dynamo exporter stores
    stack traces there, which triples the file size)."""
    for node in model.graph.node:
        node.doc_string = ""
        del node.metadata_props[:]


def rename_value(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    for vi in list(graph.output) + list(graph.value_info):
        if vi.name == old:
            vi.name = new


def ensure_loss_first(model: onnx.ModelProto) -> None:
    """The scalar loss must be the first graph output, named ``loss``."""
    graph = model.graph
    name = graph.output[0].name
    if name != "loss":
        used = {v for n in graph.node for v in [*n.input, *n.output]}
        assert "loss" not in used, "cannot rename the loss output"
        rename_value(graph, name, "loss")
    shape = graph.output[0].type.tensor_type.shape
    assert len(shape.dim) == 0, "the first output is not a scalar"


# --------------------------------------------------------------------------
# Matching initializers with torch tensors
# --------------------------------------------------------------------------
class MappingError(RuntimeError):
    pass


def loss_ancestors(graph: onnx.GraphProto) -> set[str]:
    """Names of all values the first output (the loss) depends on."""
    producer = {o: n for n in graph.node for o in n.output}
    needed, stack = set(), [graph.output[0].name]
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is not None:
            stack.extend(i for i in node.input if i)
            stack.extend(_subgraph_reads(node))  # values captured by subgraphs, nested ones too
    return needed


def _subgraph_reads(node: onnx.NodeProto) -> list[str]:
    """The names the node's subgraphs (and theirs, at any depth) read."""
    names = []
    for attr in node.attribute:
        for sub in [attr.g, *attr.graphs]:
            for inner in sub.node:
                names.extend(i for i in inner.input if i)
                names.extend(_subgraph_reads(inner))
    return names


FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def match_initializers(model: onnx.ModelProto, ref: TorchReference) -> dict[str, str]:
    """Map each float initializer the loss depends on to a torch tensor name.

    Raises MappingError if an initializer has no torch counterpart or if a
    torch tensor with a non-zero gradient does not appear as an initializer.
    """
    needed = loss_ancestors(model.graph)
    mapping: dict[str, str] = {}
    for init in model.graph.initializer:
        if init.name not in needed or init.data_type not in FLOAT_TYPES:
            continue
        value = onnx.numpy_helper.to_array(init)
        named = ref.values.get(init.name)
        if named is not None and np.array_equal(named, value):
            mapping[init.name] = ref.owner[init.name]
            continue
        hits = {ref.owner[n] for n, v in ref.values.items() if v.shape == value.shape and np.array_equal(v, value)}
        if len(hits) != 1:
            raise MappingError(f"float initializer {init.name!r} {value.shape} matches {len(hits)} torch parameters/buffers")
        mapping[init.name] = hits.pop()
    mapped = set(mapping.values())
    for name, grad in ref.grads.items():
        if name not in mapped and np.any(grad != 0):
            raise MappingError(f"torch tensor {name!r} has a gradient but no matching initializer (folded by the exporter?)")
    return mapping


# --------------------------------------------------------------------------
# Checks with onnx / onnxruntime
# --------------------------------------------------------------------------
NP_DTYPES = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.BOOL: np.bool_,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.DOUBLE: np.float64,
}


def graph_inputs(model: onnx.ModelProto, case: Case) -> dict[str, np.ndarray]:
    """The example inputs keyed by graph input name, in the declared dtype."""
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        array = case.inputs[vi.name].numpy()
        dtype = NP_DTYPES[tt.elem_type]
        assert array.dtype == dtype, (vi.name, array.dtype, dtype)
        shape = [d.dim_value for d in tt.shape.dim]
        assert list(array.shape) == shape, (vi.name, array.shape, shape)
        feeds[vi.name] = array.astype(dtype)
    return feeds


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def check_forward(model: onnx.ModelProto, feeds: dict, torch_loss: float) -> float:
    onnx.checker.check_model(model, full_check=True)
    assert not model.functions, "model-local functions left"
    loss = float(ort_session(model).run(["loss"], feeds)[0])
    if not math.isclose(loss, torch_loss, rel_tol=LOSS_RTOL):
        raise AssertionError(f"onnxruntime loss {loss} != torch loss {torch_loss}")
    return loss


def check_symbolic_batch(model: onnx.ModelProto, feeds: dict, batch_dim: list[str]) -> bool:
    """Does the graph also run with batch size + 1 (axis 0 made symbolic)?"""
    m = copy.deepcopy(model)
    del m.graph.value_info[:]
    for vi in m.graph.input:
        if vi.name in batch_dim:
            vi.type.tensor_type.shape.dim[0].dim_param = "N"
    for vi in m.graph.output[1:]:
        vi.type.tensor_type.ClearField("shape")
    bigger = {k: np.concatenate([v, v[:1]]) if k in batch_dim else v for k, v in feeds.items()}
    try:
        out = ort_session(m).run(["loss"], bigger)[0]
        return bool(np.isfinite(out).all())
    except Exception:  # noqa: BLE001 - only a diagnostic
        return False


# --------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------
def op_list(model: onnx.ModelProto) -> list[list[str]]:
    return sorted({(n.domain or "", n.op_type) for n in model.graph.node})


def opset_of(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def reference_arrays(ref: TorchReference, mapping: dict[str, str], feeds: dict) -> dict[str, np.ndarray]:
    arrays = {"loss": np.array(ref.loss, dtype=np.float64)}
    for init_name, torch_name in mapping.items():
        arrays[f"{init_name}_grad"] = ref.grads[torch_name]
    for name in feeds:
        if name in ref.input_grads:
            arrays[f"{name}_grad"] = ref.input_grads[name]
    return arrays


def save_dir(out: Path, model, feeds, arrays, meta) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    if len(data) > MAX_MODEL_BYTES:
        raise AssertionError(f"{out}: model.onnx is {len(data)} bytes")
    (out / "model.onnx").write_bytes(data)
    np.savez(out / "inputs.npz", **feeds)
    np.savez(out / "reference.npz", **arrays)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------
def build_case(name: str) -> Case:
    fam = FAMILIES[name]
    torch.manual_seed(fam.seed)
    case = fam.build()
    case.model.eval()
    perturb_(case.model)
    return case


def export_checked(case: Case, exporter: str, ref: TorchReference):
    """Export, post-process and map initializers; returns model, mapping, settings."""
    output_names = ["loss", *case.extra_outputs]
    attempts = [{}] if exporter == "legacy" else [{"optimize": True}, {"optimize": False}]
    error = None
    for kwargs in attempts:
        model, settings = EXPORT_FUNCS[exporter](case, output_names, **kwargs)
        model = inline_functions(model)
        strip_node_metadata(model)
        ensure_loss_first(model)
        try:
            return model, match_initializers(model, ref), settings
        except MappingError as exc:
            error = exc
            print(f"    {exporter} {kwargs}: {exc}; retrying", file=sys.stderr)
    raise error


def make_one(name: str, exporter: str, case: Case, ref: TorchReference, out_fixtures: Path, out_samples: Path) -> dict:
    model, mapping, settings = export_checked(case, exporter, ref)
    feeds = graph_inputs(model, case)
    ort_loss = check_forward(model, feeds, ref.loss)
    meta = {
        "family": name,
        "exporter": exporter,
        "opset": opset_of(model),
        "inputs": {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()},
        "outputs": [o.name for o in model.graph.output],
        "ops": op_list(model),
        "torch": torch.__version__.split("+")[0],
        "onnx": onnx.__version__,
        "batch_dim": [k for k in case.batch_dim if k in feeds],
        "batch_symbolic_ok": check_symbolic_batch(model, feeds, case.batch_dim),
        "export_settings": settings,
        "initializer_to_torch": mapping,
        "notes": case.notes,
    }
    arrays = reference_arrays(ref, mapping, feeds)
    save_dir(out_fixtures / f"{name}_{exporter}", model, feeds, arrays, meta)
    sample = FAMILIES[name].sample
    if sample and exporter == "legacy" and out_samples is not None:
        save_dir(out_samples / sample, model, feeds, arrays, meta)
    return {"ort_loss": ort_loss, **meta}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-samples", type=Path, default=HERE)
    parser.add_argument("--out-fixtures", type=Path, default=HERE.parent / "tests" / "fixtures" / "models")
    parser.add_argument("--only", action="append", help="family, family_exporter or sample name to rebuild; repeatable")
    parser.add_argument("--exporter", choices=EXPORTERS, action="append")
    parser.add_argument("--summary", type=Path, help="write a JSON summary here")
    args = parser.parse_args(argv)

    jobs = [(f, e) for f in FAMILIES for e in args.exporter or EXPORTERS]
    if args.only:
        wanted = lambda f, e: {f, f"{f}_{e}", FAMILIES[f].sample} & set(args.only)
        jobs = [(f, e) for f, e in jobs if wanted(f, e)]
        if not jobs:
            parser.error(f"unknown --only {args.only}; families: {', '.join(FAMILIES)}")

    summary, failures = {}, {}
    for name in dict.fromkeys(f for f, _ in jobs):
        case = build_case(name)
        ref = torch_reference(case.model, case.inputs)
        for exporter in [e for f, e in jobs if f == name]:
            key = f"{name}_{exporter}"
            try:
                summary[key] = make_one(name, exporter, case, ref, args.out_fixtures, args.out_samples)
                print(f"ok   {key:28s} opset {summary[key]['opset']:2d}  {len(summary[key]['ops'])} ops  loss {ref.loss:.6f}")
            except Exception as exc:  # noqa: BLE001 - reported at the end
                failures[key] = f"{type(exc).__name__}: {exc}"
                print(f"FAIL {key}: {failures[key]}", file=sys.stderr)
    if args.summary:
        args.summary.write_text(json.dumps({"models": summary, "failures": failures}, indent=1, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
