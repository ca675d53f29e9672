"""Random PyTorch models, exported as a user would export them, against PyTorch's own gradients.

The graph and op fuzzers (fuzz_graphs.py, fuzz_ops.py) build ONNX by hand, one op or a few at a time.
The CPU and CUDA executors also rewrite the patterns exporters write: a Linear's MatMul + Add, a
GELU's Erf chain, a tied embedding's Gather and MatMul, batch statistics, attention's masked
Softmax. A rewrite can be wrong only when such a pattern meets another, so here random stacks of
real layers (a sequence family and an image family) go through PyTorch's legacy exporter and
``gradgen.build_backward``, and every parameter's and input's gradient is compared with PyTorch
autograd in float64 on the same values: gradgen in float64 (tight) and in float32 (the float32-only
fast paths, to float32's accuracy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from hypothesis import strategies as st

SEQ_BLOCKS = [
    "linear",
    "layer_norm",
    "rms_norm",
    "activation",
    "mlp_residual",
    "glu",
    "attention",
    "torch_attention",
    "sdpa",
    "transpose_mix",
    "conv1d",
    "gru",
    "lstm",
    "cumsum",
    "functional",
]
IMAGE_BLOCKS = [
    "conv",
    "depthwise",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "activation",
    "pool",
    "res_block",
    "conv_transpose",
    "upsample",
    "dense_concat",
    "squeeze_excite",
    "pixel_shuffle",
    "dilated_conv",
    "strided_transpose",
    "exclusive_avg_pool",
    "reflect_conv",
    "channel_shuffle",
    "lp_pool",
]
ACTIVATIONS = [
    "relu",
    "gelu",
    "gelu_tanh",
    "silu",
    "tanh",
    "sigmoid",
    "hardswish",
    "leaky_relu",
    "softplus",
    "elu",
    "mish",
    "relu6",
    "hardtanh",
    "selu",
    "celu",
    "softsign",
    "hardsigmoid",
    "logsigmoid",
]
# tensor functions a model's forward writes between layers, on the (B, T, C) sequence
FUNCTIONS = [
    "index_select",
    "flip",
    "roll",
    "reflect_pad",
    "log_softmax",
    "normalize",
    "clamp",
    "where",
    "einsum",
    "topk",
    "amax",
    "std",
    "stack",
    "logsumexp",
    "cosine",
    "square_abs",
]
HEADS = ["weighted_sum", "cross_entropy", "mse", "smooth_ce", "tied_logits", "ignore_ce"]  # the last two need token ids


@dataclasses.dataclass
class ModuleCase:
    family: str  # "seq" | "image"
    blocks: list[tuple[str, dict[str, Any]]]
    head: str
    batch: int
    length: int  # sequence length, or image side
    width: int  # channels
    vocab: int  # token ids for the seq family's embedding (0: float input)
    seed: int
    exporter: str = "legacy"  # "legacy" (TorchScript) or "dynamo" (torch.export)

    def describe(self) -> str:
        size = f"B={self.batch}, {'T' if self.family == 'seq' else 'HxW'}={self.length}, C={self.width}"
        vocab = f", vocab {self.vocab}" if self.vocab else ""
        blocks = " -> ".join(f"{kind}{attrs or ''}" for kind, attrs in self.blocks)
        return f"{self.family} ({size}{vocab}, seed {self.seed}, {self.exporter} export): {blocks} -> {self.head}"

    def __repr__(self) -> str:
        return f"ModuleCase({self.describe()})"


def _activation(draw) -> dict[str, Any]:
    return {"fn": draw(st.sampled_from(ACTIVATIONS))}


def _seq_block(draw, kind: str, width: int) -> dict[str, Any]:
    if kind == "linear":
        return {"bias": draw(st.booleans()), "act": draw(st.sampled_from([None, *ACTIVATIONS]))}
    if kind in ("layer_norm", "rms_norm"):
        return {"affine": draw(st.booleans())}
    if kind == "activation":
        return _activation(draw)
    if kind == "sdpa":
        return {"heads": draw(st.sampled_from([h for h in (1, 2, 4) if width % h == 0])), "causal": draw(st.booleans())}
    if kind == "conv1d":
        return {"kernel": draw(st.sampled_from([1, 3])), "groups": draw(st.sampled_from([1, 2, width]))}
    if kind in ("gru", "lstm"):
        return {"bidirectional": draw(st.booleans())}
    if kind == "functional":
        return {"fn": draw(st.sampled_from(FUNCTIONS))}
    if kind == "mlp_residual":
        return {"hidden": draw(st.sampled_from([width, 2 * width, 4 * width])), "act": draw(st.sampled_from(ACTIVATIONS))}
    if kind in ("attention", "torch_attention"):
        heads = draw(st.sampled_from([h for h in (1, 2, 4) if width % h == 0]))
        # the legacy exporter refuses MultiheadAttention's float64 masks: torch_attention's causal
        # masks come only in the hand-written attention block
        causal = draw(st.booleans()) if kind == "attention" else False
        return {"heads": heads, "causal": causal, "bias": draw(st.booleans())}
    return {}  # transpose_mix (a Linear across the sequence axis), glu, cumsum


def _image_block(draw, kind: str) -> dict[str, Any]:
    if kind == "conv":
        return {"kernel": draw(st.sampled_from([1, 3])), "stride": draw(st.sampled_from([1, 2])), "bias": draw(st.booleans())}
    if kind == "depthwise":
        return {"stride": draw(st.sampled_from([1, 2]))}
    if kind == "batch_norm":
        return {"affine": draw(st.booleans())}
    if kind == "group_norm":
        return {"groups": draw(st.sampled_from([1, 2]))}
    if kind == "activation":
        return _activation(draw)
    if kind == "pool":
        return {"kind": draw(st.sampled_from(["max", "avg"]))}
    if kind == "upsample":
        return {"mode": draw(st.sampled_from(["nearest", "bilinear", "bilinear_corners"]))}
    return {}  # res_block, conv_transpose, instance_norm, dense_concat, squeeze_excite, pixel_shuffle


@st.composite
def module_cases(draw, exporters: tuple[str, ...] = ("legacy",)) -> ModuleCase:
    family = draw(st.sampled_from(["seq", "image"]))
    count = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    if family == "seq":
        width = draw(st.sampled_from([4, 8, 12]))
        kinds = [draw(st.sampled_from(SEQ_BLOCKS)) for _ in range(count)]
        blocks = [(k, _seq_block(draw, k, width)) for k in kinds]
        vocab = draw(st.sampled_from([0, 7]))
        head = draw(st.sampled_from(HEADS if vocab else HEADS[:4]))
        case = ModuleCase("seq", blocks, head, draw(st.integers(1, 3)), draw(st.integers(1, 6)), width, vocab, seed)
    else:
        kinds = [draw(st.sampled_from(IMAGE_BLOCKS)) for _ in range(count)]
        blocks = [(k, _image_block(draw, k)) for k in kinds]
        side = draw(st.sampled_from([4, 5, 8]))
        batch = draw(st.integers(2, 3))  # batch statistics of one image and a 1x1 map are degenerate
        case = ModuleCase("image", blocks, draw(st.sampled_from(HEADS[:4])), batch, side, draw(st.sampled_from([2, 4])), 0, seed)
    case.exporter = draw(st.sampled_from(exporters))
    return case


# -- the PyTorch model of a case ---------------------------------------------------------------


def build_module(case: ModuleCase):
    """(module, inputs): a torch module whose forward returns the scalar loss, and its inputs by name
    (float32; the caller casts)."""
    import torch
    from torch import nn

    torch.manual_seed(case.seed)

    def act(name: str) -> nn.Module:
        return {
            "relu": nn.ReLU(),
            "gelu": nn.GELU(),
            "gelu_tanh": nn.GELU(approximate="tanh"),
            "silu": nn.SiLU(),
            "tanh": nn.Tanh(),
            "sigmoid": nn.Sigmoid(),
            "hardswish": nn.Hardswish(),
            "leaky_relu": nn.LeakyReLU(0.1),
            "softplus": nn.Softplus(),
            "elu": nn.ELU(),
            "mish": nn.Mish(),
            "relu6": nn.ReLU6(),
            "hardtanh": nn.Hardtanh(-0.5, 0.5),
            "selu": nn.SELU(),
            "celu": nn.CELU(0.7),
            "softsign": nn.Softsign(),
            "hardsigmoid": nn.Hardsigmoid(),
            "logsigmoid": nn.LogSigmoid(),
        }[name]

    def functional(name: str, c: int, t: int) -> nn.Module:
        """A tensor function on (B, T, C), with whatever weights it needs as parameters."""
        gen = torch.Generator().manual_seed(case.seed + 1)
        index = torch.randint(0, t, (t,), generator=gen)  # repeats: the gradient adds them up
        if name == "einsum":
            return EinsumMix(c)
        fns = {
            "index_select": lambda x: x.index_select(1, index),
            "flip": lambda x: x.flip(1) * 0.5 + x,
            "roll": lambda x: torch.roll(x, 1, dims=2) - x,
            # shifted by one, reflected at the start (the length stays t for the layers after it)
            "reflect_pad": lambda x: (
                nn.functional.pad(x.transpose(1, 2), (1, 1), mode="reflect")[..., :t].transpose(1, 2) if t > 1 else x
            ),
            "log_softmax": lambda x: torch.log_softmax(x, dim=-1),
            "normalize": lambda x: nn.functional.normalize(x, dim=-1),
            "clamp": lambda x: x.clamp(-0.6, 0.7),
            "where": lambda x: torch.where(x > 0, x, 0.1 * x * x),
            "topk": lambda x: x.topk(max(1, c // 2), dim=-1).values.repeat_interleave(2, dim=-1)[..., :c],
            "amax": lambda x: x + x.amax(dim=1, keepdim=True),
            "std": lambda x: x / (x.std(dim=-1, keepdim=True) + 1.0),
            "stack": lambda x: torch.stack([x, x * x], dim=2).sum(dim=2),
            "logsumexp": lambda x: x - torch.logsumexp(x, dim=-1, keepdim=True),
            "cosine": lambda x: nn.functional.cosine_similarity(x, x.roll(1, dims=1), dim=-1).unsqueeze(-1) * x,
            "square_abs": lambda x: x.abs() * x + x.pow(3) * 0.1,
        }
        return Lambda(fns[name])

    class Attention(nn.Module):
        """GPT-2's layout: one qkv Linear, heads split by view, a scaled, optionally causal, softmax."""

        def __init__(self, width: int, heads: int, causal: bool, bias: bool):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width, bias=bias)
            self.out = nn.Linear(width, width, bias=bias)
            self.heads, self.causal = heads, causal

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(x).split(c, dim=-1)
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
            scores = q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5
            if self.causal:
                mask = torch.ones(t, t, dtype=torch.bool).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            y = torch.softmax(scores, dim=-1) @ v
            return x + self.out(y.transpose(1, 2).reshape(b, t, c))

    class TorchAttention(nn.Module):
        def __init__(self, width: int, heads: int, causal: bool, bias: bool):
            super().__init__()
            self.mha = nn.MultiheadAttention(width, heads, bias=bias, batch_first=True)
            self.causal = causal

        def forward(self, x):
            t = x.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).triu(1) if self.causal else None
            return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]

    class Residual(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return x + self.inner(x)

    class SelfAttention(nn.Module):
        """F.scaled_dot_product_attention on heads split from one qkv Linear."""

        def __init__(self, width: int, heads: int, causal: bool):
            super().__init__()
            self.qkv = nn.Linear(width, 3 * width)
            self.heads, self.causal = heads, causal

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
            return y.transpose(1, 2).reshape(b, t, c)

    class RmsNorm(nn.Module):
        """LLaMA's RMSNorm as its code writes it (the legacy exporter has no aten::rms_norm)."""

        def __init__(self, width: int, affine: bool):
            super().__init__()
            self.weight = nn.Parameter(torch.rand(width) + 0.5) if affine else None

        def forward(self, x):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return y * self.weight if self.weight is not None else y

    class Glu(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.proj = nn.Linear(width, 2 * width)

        def forward(self, x):
            a, b = self.proj(x).chunk(2, dim=-1)
            return a * torch.sigmoid(b)

    class Channels(nn.Module):
        """A (B, C, T) layer on the (B, T, C) sequence."""

        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x.transpose(1, 2)).transpose(1, 2)

    class Recurrent(nn.Module):
        def __init__(self, rnn: nn.Module, width: int, bidirectional: bool):
            super().__init__()
            self.rnn = rnn
            self.merge = nn.Linear(2 * width, width) if bidirectional else None

        def forward(self, x):
            y = self.rnn(x)[0]
            return self.merge(y) if self.merge is not None else y

    class Lambda(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    class EinsumMix(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.mix = nn.Parameter(torch.randn(width, width) / width**0.5)

        def forward(self, x):
            return torch.einsum("btc,cd->btd", x, self.mix)

    class DenseConcat(nn.Module):
        """DenseNet's growth: the input and a convolution of it side by side, then a 1x1 back to C."""

        def __init__(self, width: int):
            super().__init__()
            self.grow = nn.Conv2d(width, width, 3, padding=1)
            self.back = nn.Conv2d(2 * width, width, 1)

        def forward(self, x):
            return self.back(torch.cat([x, torch.relu(self.grow(x))], dim=1))

    class SqueezeExcite(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(width, max(1, width // 2)), nn.Linear(max(1, width // 2), width)

        def forward(self, x):
            s = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean(dim=(2, 3))))))
            return x * s[:, :, None, None]

    class SeqMix(nn.Module):
        def __init__(self, length: int):
            super().__init__()
            self.mix = nn.Linear(length, length)

        def forward(self, x):
            return self.mix(x.transpose(1, 2)).transpose(1, 2)

    def seq_layer(kind: str, attrs: dict[str, Any], c: int, t: int) -> nn.Module:
        if kind == "linear":
            layers = [nn.Linear(c, c, bias=attrs["bias"])]
            return nn.Sequential(*layers, act(attrs["act"])) if attrs["act"] else layers[0]
        if kind == "layer_norm":
            return nn.LayerNorm(c, elementwise_affine=attrs["affine"])
        if kind == "rms_norm":
            return RmsNorm(c, attrs["affine"])
        if kind == "activation":
            return act(attrs["fn"])
        if kind == "sdpa":
            return SelfAttention(c, attrs["heads"], attrs["causal"])
        if kind == "glu":
            return Glu(c)
        if kind == "conv1d":
            k = attrs["kernel"]
            return Channels(nn.Conv1d(c, c, k, padding=k // 2, groups=attrs["groups"]))
        if kind in ("gru", "lstm"):
            rnn = (nn.GRU if kind == "gru" else nn.LSTM)(c, c, batch_first=True, bidirectional=attrs["bidirectional"])
            return Recurrent(rnn, c, attrs["bidirectional"])
        if kind == "cumsum":
            return Lambda(lambda x: x.cumsum(dim=1))
        if kind == "functional":
            return functional(attrs["fn"], c, t)
        if kind == "mlp_residual":
            return Residual(nn.Sequential(nn.Linear(c, attrs["hidden"]), act(attrs["act"]), nn.Linear(attrs["hidden"], c)))
        if kind == "attention":
            return Attention(c, attrs["heads"], attrs["causal"], attrs["bias"])
        if kind == "torch_attention":
            return TorchAttention(c, attrs["heads"], attrs["causal"], attrs["bias"])
        return SeqMix(t)

    def image_layer(kind: str, attrs: dict[str, Any], c: int) -> nn.Module:
        if kind == "conv":
            k = attrs["kernel"]
            return nn.Conv2d(c, c, k, stride=attrs["stride"], padding=k // 2, bias=attrs["bias"])
        if kind == "depthwise":
            return nn.Conv2d(c, c, 3, stride=attrs["stride"], padding=1, groups=c)
        if kind == "batch_norm":
            return nn.BatchNorm2d(c, affine=attrs["affine"])
        if kind == "group_norm":
            return nn.GroupNorm(attrs["groups"], c)
        if kind == "instance_norm":
            return nn.InstanceNorm2d(c, affine=True)
        if kind == "upsample":
            mode = attrs["mode"]
            if mode == "nearest":
                return nn.Upsample(scale_factor=2, mode="nearest")
            return nn.Upsample(scale_factor=2, mode="bilinear", align_corners=mode == "bilinear_corners")
        if kind == "dense_concat":
            return DenseConcat(c)
        if kind == "squeeze_excite":
            return SqueezeExcite(c)
        if kind == "dilated_conv":
            return nn.Conv2d(c, c, 3, padding=2, dilation=2)
        if kind == "strided_transpose":
            return nn.ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=1)
        if kind == "exclusive_avg_pool":
            return nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
        if kind == "reflect_conv":
            return nn.Conv2d(c, c, 3, padding=1, padding_mode="reflect")
        if kind == "channel_shuffle":
            return Lambda(lambda x: x.reshape(x.shape[0], 2, x.shape[1] // 2, *x.shape[2:]).transpose(1, 2).reshape(x.shape))
        if kind == "lp_pool":
            return nn.LPPool2d(2, 2, ceil_mode=True)
        if kind == "pixel_shuffle":
            return nn.Sequential(nn.Conv2d(c, 4 * c, 1), nn.PixelShuffle(2))
        if kind == "activation":
            return act(attrs["fn"])
        if kind == "pool":
            return nn.MaxPool2d(2, ceil_mode=True) if attrs["kind"] == "max" else nn.AvgPool2d(2, ceil_mode=True)
        if kind == "res_block":
            return Residual(
                nn.Sequential(
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c),
                    nn.ReLU(),
                    nn.Conv2d(c, c, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c),
                )
            )
        return nn.ConvTranspose2d(c, c, 2, stride=2)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            c, n = case.width, case.length
            self.embed = nn.Embedding(case.vocab, c) if case.vocab else None
            if case.family == "seq":
                self.body = nn.Sequential(*(seq_layer(k, a, c, n) for k, a in case.blocks))
                classes = case.vocab or 5
            else:
                self.body = nn.Sequential(*(image_layer(k, a, c) for k, a in case.blocks))
                classes = 5
            self.classifier = nn.Linear(c, classes) if case.head in ("cross_entropy", "mse", "smooth_ce", "ignore_ce") else None

        def forward(self, x, target, weight):
            h = self.body(self.embed(x) if self.embed is not None else x)
            if case.family == "image":
                # (B, C) through a tanh: the plain mean of a batch-normalised map is 0 for every
                # input, a loss whose gradients are all rounding
                h = torch.tanh(h).mean(dim=(2, 3))
            if case.head == "weighted_sum":
                return (h * weight[..., : h.shape[-1]].expand_as(h)).sum()
            if case.head == "tied_logits":
                logits = h @ self.embed.weight.t()
                return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
            logits = self.classifier(h)
            if case.head == "mse":
                return nn.functional.mse_loss(logits, weight[..., : logits.shape[-1]].expand_as(logits))
            flat, labels = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
            if case.head == "smooth_ce":  # label_smoothing=0.1 as its formula (the legacy exporter has no label_smoothing)
                # the weights as a 1-d tensor of the model's type: the legacy exporter casts a
                # float64 loss times a Python float (or a 0-d tensor) to float32
                logp = nn.functional.log_softmax(flat, dim=-1)
                terms = torch.stack([nn.functional.nll_loss(logp, labels), -logp.mean(dim=-1).mean()])
                return (terms * logp.new_tensor([0.9, 0.1])).sum()
            if case.head == "ignore_ce":  # class 0 is padding
                return nn.functional.cross_entropy(flat, labels, ignore_index=0)
            return nn.functional.cross_entropy(flat, labels)

    model = Model().train()
    g = torch.Generator().manual_seed(case.seed)
    if case.family == "seq":
        if case.vocab:
            x = torch.randint(0, case.vocab, (case.batch, case.length), generator=g)
        else:
            x = torch.randn(case.batch, case.length, case.width, generator=g)
        target_shape: tuple[int, ...] = (case.batch, case.length)
    else:
        x = torch.randn(case.batch, case.width, case.length, case.length, generator=g)
        target_shape = (case.batch,)
    classes = case.vocab if case.head == "tied_logits" else 5
    target = torch.randint(0, classes, target_shape, generator=g)
    target.view(-1)[0] = 1  # ignore_ce: at least one target that counts
    weight = torch.rand(16, generator=g) + 0.5  # at least every width and class count
    return model, {"x": x, "target": target, "weight": weight}


def reference(module, inputs: dict[str, Any]) -> tuple[float, dict[str, np.ndarray]]:
    """PyTorch's loss and gradients (float64 module and inputs) by parameter and input name."""
    import torch

    ins = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
    tensors = {n: t for n, t in ins.items() if t.requires_grad}
    tensors.update(dict(module.named_parameters()))
    loss = module(*ins.values())
    grads = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)
    ref = {}
    for (name, t), grad in zip(tensors.items(), grads):
        ref[name] = np.zeros(tuple(t.shape)) if grad is None else grad.detach().numpy()
    return float(loss.detach()), ref


def score(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    """max|got - want| / max(max|want|, floor): relative to the tensor's largest element, or to
    ``floor`` for a tensor whose gradient is (near) zero, such as one that cancels exactly."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    if not want.size:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), floor))


class InvalidCase(Exception):
    """A drawn model PyTorch refuses to run: not a case to judge gradgen by."""


def export(module, inputs: dict[str, Any], exporter: str):
    """The module as an ``onnx.ModelProto``: PyTorch's legacy exporter with the samples' settings, or
    the dynamo exporter unoptimised, as ``torch.onnx.export`` gives it by default."""
    from gradgen.bench.models import dynamo_export, legacy_export

    to_proto = legacy_export if exporter == "legacy" else dynamo_export
    return to_proto(module, tuple(inputs.values()), list(inputs))


def check(case: ModuleCase, device: str = "cpu", portable: bool = False, bf16: bool = False) -> None:
    """The case's model in float64 and float32, exported and built by gradgen and run on ``device``:
    the loss and every gradient within tolerance of PyTorch's float64 autograd (AssertionError).
    ``portable``: the float32 model's portable backward graph on ONNX Runtime too. ``bf16``: the
    float32 model built with ``precision="bf16"`` (AutocastPass) too, within 0.5 or ten times the
    error of PyTorch's own bf16 autocast gradients, whichever is larger: a coarse check that catches
    a wrong cast or a lost term, not rounding. Tiny models with training-mode BatchNorm on two images
    amplify rounding either way: on one architecture gradgen's worst tensor was 0.219 against
    autocast's 0.031 at one seed and 0.022 against 0.189 at another."""
    import copy

    import torch

    import gradgen
    from gradgen.errors import GradgenError
    from gradgen.executor import Session

    module, inputs = build_module(case)
    if case.exporter == "dynamo":
        # the dynamo exporter writes a training-mode BatchNorm as an inference one (running
        # statistics), so its models are compared in eval mode
        module.eval()
    module64 = copy.deepcopy(module).double()
    inputs64 = {n: t.double() if t.is_floating_point() else t for n, t in inputs.items()}
    try:
        loss_ref, ref = reference(module64, inputs64)
    except ValueError as exc:  # a model PyTorch itself refuses (InstanceNorm2d of a 1 x 1 map in training)
        raise InvalidCase(str(exc)) from None
    # a gradient that cancels to zero (a bias before a LayerNormalization; a whole model whose loss
    # is a batch-normalised mean, 0 for every input) is as exact as the terms it sums: its error is
    # judged against the largest gradient of the model, and at least against the losses' scale (1);
    # in float32 a tensor may also be as far off as ten times PyTorch's own float32 gradient is
    largest = max((float(np.max(np.abs(g))) for g in ref.values() if g.size), default=1.0)
    _, ref32 = reference(copy.deepcopy(module), inputs)
    floors = {torch.float64: max(1e-6 * largest, 1e-8), torch.float32: max(1e-2 * largest, 1e-5)}
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 2e-3)):
        floor = floors[dtype]
        m = module64 if dtype == torch.float64 else module
        ins = inputs64 if dtype == torch.float64 else inputs
        # the exporter traces the module once (in training mode, so batch statistics stay batch
        # statistics): a copy keeps the reference module's running statistics out of it
        proto = export(copy.deepcopy(m), ins, case.exporter)
        feeds = {n: t.numpy() for n, t in ins.items() if n in {i.name for i in proto.graph.input}}
        try:
            built = gradgen.build_backward(proto, wrt_inputs=True)
            out = Session(built.model, device=device).run(feeds)
        except GradgenError:
            _raise_if_the_export_is_invalid(export(copy.deepcopy(module), inputs, case.exporter), inputs)
            raise
        where = f"{case.describe()} [{str(dtype).removeprefix('torch.')}, {device}]"
        _compare(built, out, loss_ref, ref, ref32 if dtype == torch.float32 else None, tol, floor, where)
        if bf16 and dtype == torch.float32:
            try:
                with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                    _, ref_bf16 = reference(copy.deepcopy(module), inputs)
            except RuntimeError:  # PyTorch's CPU autocast has no bf16 LSTM (oneDNN refuses it)
                ref_bf16 = None
            built = gradgen.build_backward(proto, wrt_inputs=True, precision="bf16")
            out = Session(built.model, device=device).run(feeds)
            floor16 = max(5e-2 * largest, 1e-3)
            _compare(built, out, loss_ref, ref, ref_bf16, 0.5, floor16, f"{where} [bf16 autocast]")
        if portable and dtype == torch.float32:
            # the portable graph (standard ops only) on ONNX Runtime, as a user without gradgen runs it
            built = gradgen.build_backward(proto, wrt_inputs=True, portable=True)
            _compare(
                built,
                _run_on_onnxruntime(built.model, feeds),
                loss_ref,
                ref,
                ref32,
                tol,
                floor,
                f"{where} [portable, onnxruntime]",
            )


def _raise_if_the_export_is_invalid(proto, inputs) -> None:
    """InvalidCase where ONNX Runtime cannot run the exported float32 forward model either: the
    exporter wrote an invalid model (the legacy exporter dropped a transpose of attention's keys
    after a TopK), which gradgen rightly refuses."""
    import onnxruntime as ort

    feeds = {n: t.numpy() for n, t in inputs.items() if n in {i.name for i in proto.graph.input}}
    try:
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception as exc:  # any refusal: onnxruntime's errors have no common base class
        raise InvalidCase(f"onnxruntime cannot run the exported model either: {exc}") from None


def _run_on_onnxruntime(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    from gradgen.api import ir

    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return dict(zip(names, session.run(names, {n: v for n, v in feeds.items() if n in wanted})))


def _compare(built, out, loss_ref, ref, ref32, tol, floor, where) -> None:
    """The loss and every gradient of ``out`` (a run of ``built``) against PyTorch's float64 ``ref``;
    below float64 (``ref32``, PyTorch's own gradients at that precision, given) a tensor may also be
    as far off as ten times PyTorch's gradient is."""
    loss = float(np.asarray(out[built.loss]))
    assert abs(loss - loss_ref) <= tol * max(1.0, abs(loss_ref)), f"loss {loss} vs torch {loss_ref}: {where}"
    matched = set()
    for wrt, grad_name in zip(built.wrt, built.gradient_names):
        if wrt not in ref:
            continue
        want = ref[wrt]
        got = out[grad_name]
        transposed = got.shape != want.shape and want.ndim == 2 and got.shape == want.T.shape
        if transposed:
            want = want.T  # an initializer the exporter stored transposed
        err = score(got, want, floor)
        allowed = tol
        if ref32 is not None and err > tol:
            allowed = max(tol, 10 * score(ref32[wrt].T if transposed else ref32[wrt], want, floor))
        assert err <= allowed, f"gradient of {wrt}: {err:.3g} from torch's (tolerance {allowed:.3g}): {where}"
        matched.add(wrt)
    missing = sorted(n for n, g in ref.items() if n not in matched and np.any(g != 0))
    assert not missing, f"no gradient compared for {missing} (gradgen's: {list(built.wrt)}): {where}"
