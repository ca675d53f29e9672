"""The real-size benchmark models, in plain PyTorch (no torchvision), and their ONNX export.

Each model's forward takes the graph inputs and returns the scalar loss, so the exported graph
holds the loss and gradgen differentiates it as is. Models are described by a ``ModelSpec`` (a
JSON-serialisable recipe), so a child process rebuilds the very same module from the spec and a
state dict.

- ``gpt2``: a GPT-2 layout (nanoGPT's): token + position embeddings, pre-LayerNorm blocks of
  causal self-attention (one fused qkv Linear; a tril mask buffer sliced to the sequence length)
  and a tanh-GELU MLP, a final LayerNorm, an LM head tied to the token embedding, and the LM
  cross-entropy against a ``labels`` input (the next tokens) in the graph.
- ``resnet18``: torchvision's ResNet-18 layout (BasicBlocks 2-2-2-2, 64..512 channels, 7x7 stem,
  3x3 max pool, global average pool, 1000-way Linear) with BatchNorm in eval mode and a
  cross-entropy loss against ``labels``.

Parameters are drawn so that no two tensors are equal: PyTorch's legacy exporter merges equal
initializers, which would break the initializer -> parameter mapping the gradient comparison uses.
"""

from __future__ import annotations

import dataclasses
import io
import math
import warnings
from typing import Any

import numpy as np

# Standard layouts: name -> (kind, architecture, default batch, default sequence / image size).
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2s": {
        "kind": "gpt2",
        "arch": {"layers": 12, "d": 768, "heads": 12, "vocab": 50257, "max_len": 1024},
        "batch": 8,
        "size": 256,
        "title": "GPT-2 small layout (12 x 768, 12 heads, vocab 50257 tied)",
    },
    "gpt2m": {
        "kind": "gpt2",
        "arch": {"layers": 24, "d": 1024, "heads": 16, "vocab": 50257, "max_len": 1024},
        "batch": 4,
        "size": 512,
        "title": "GPT-2 medium layout (24 x 1024, 16 heads, vocab 50257 tied)",
    },
    "resnet18": {
        "kind": "resnet18",
        "arch": {"classes": 1000, "width": 64},
        "batch": 32,
        "size": 224,
        "title": "ResNet-18 (eval-mode BatchNorm, 1000 classes)",
    },
    # Tiny layouts for a quick try and for the tests (same code paths, seconds on a CPU).
    "gpt2-tiny": {
        "kind": "gpt2",
        "arch": {"layers": 2, "d": 32, "heads": 2, "vocab": 97, "max_len": 32},
        "batch": 2,
        "size": 16,
        "title": "GPT-2 layout, tiny (2 x 32, 2 heads, vocab 97 tied)",
    },
    "resnet18-tiny": {
        "kind": "resnet18",
        "arch": {"classes": 10, "width": 4},
        "batch": 2,
        "size": 32,
        "title": "ResNet-18 layout, tiny (width 4, 10 classes)",
    },
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What to build: a kind (gpt2 / resnet18), its architecture, batch and sequence or image size."""

    name: str
    kind: str
    arch: dict
    batch: int
    size: int  # sequence length (gpt2) or image side (resnet18)
    title: str = ""
    seed: int = 0  # of the parameters and the batch: a second seed shows which differences are noise
    # resnet18: BatchNorm in training mode (it normalises with the batch's statistics), as a CNN trains
    # and is exported for training; default eval mode (the running statistics)
    batch_stats: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ModelSpec":
        return cls(**data)

    @property
    def shape_text(self) -> str:
        seed = f", seed {self.seed}" if self.seed else ""
        if self.kind == "gpt2":
            return f"B={self.batch}, T={self.size}{seed}"
        mode = ", batch statistics" if self.batch_stats else ""
        return f"B={self.batch}, {self.size}x{self.size}{mode}{seed}"


def preset(
    name: str,
    *,
    batch: int | None = None,
    size: int | None = None,
    layers: int | None = None,
    d: int | None = None,
    heads: int | None = None,
    seed: int = 0,
    batch_stats: bool = False,
) -> ModelSpec:
    """A ``ModelSpec`` from a preset name, with optional overrides (smaller sizes for a quick try;
    ``batch_stats``: a ResNet-18's BatchNorm in training mode)."""
    from gradgen.errors import UsageError

    if name not in PRESETS:
        raise UsageError(f"unknown benchmark model {name!r}: choose from {', '.join(PRESETS)}")
    base = PRESETS[name]
    if batch_stats and base["kind"] != "resnet18":
        raise UsageError(f"--batch-stats applies to the ResNet-18 layouts (their BatchNorm), not to {name}")
    arch = dict(base["arch"])
    overrides = {"layers": layers, "d": d, "heads": heads}
    for key, value in overrides.items():
        if value is None:
            continue
        if base["kind"] != "gpt2":
            raise UsageError(f"--{key} applies to the GPT-2 layouts, not to {name}")
        arch[key] = value
    if base["kind"] == "gpt2":
        if arch["d"] % arch["heads"]:
            raise UsageError(f"model width {arch['d']} is not a multiple of the head count {arch['heads']}")
        if size is not None and size > arch["max_len"]:
            arch["max_len"] = size
    spec = ModelSpec(
        name=name,
        kind=base["kind"],
        arch=arch,
        batch=batch or base["batch"],
        size=size or base["size"],
        title=base["title"],
        seed=seed,
        batch_stats=batch_stats,
    )
    if spec.batch < 1 or spec.size < 2:
        raise UsageError(f"{name}: batch must be at least 1 and the sequence/image size at least 2")
    if [k for k, v in overrides.items() if v is not None] or size or batch or batch_stats:
        spec = dataclasses.replace(spec, title=_describe(spec))
    return spec


def _describe(spec: ModelSpec) -> str:
    a = spec.arch
    if spec.kind == "gpt2":
        return f"GPT-2 layout ({a['layers']} x {a['d']}, {a['heads']} heads, vocab {a['vocab']} tied)"
    mode = "training-mode BatchNorm: batch statistics" if spec.batch_stats else "eval-mode BatchNorm"
    return f"ResNet-18 layout (width {a['width']}, {a['classes']} classes, {mode})"


# ---------------------------------------------------------------------------------------------
# Modules (plain torch; torch is imported inside so that importing this file costs nothing)


def build_module(spec: ModelSpec):
    """The ``torch.nn.Module`` of ``spec`` with pairwise-distinct parameters seeded by ``spec.seed``,
    in eval mode (ResNet-18 with ``spec.batch_stats``: in training mode, its BatchNorm normalising
    with the batch's statistics)."""
    import torch

    seed = spec.seed
    classes = _module_classes()
    torch.manual_seed(seed)
    if spec.kind == "gpt2":
        model = classes["Gpt2"](**spec.arch)
    elif spec.kind == "resnet18":
        model = classes["ResNet18"](**spec.arch)
    else:
        raise ValueError(f"unknown model kind {spec.kind!r}")
    _distinct_init_(model, seed)
    return model.train(spec.batch_stats)


def _distinct_init_(model, seed: int) -> None:
    """GPT-2 style N(0, 0.02) weights, and small random offsets everywhere else (no equal tensors)."""
    import torch
    import torch.nn as nn

    gen = torch.Generator().manual_seed(seed + 1)

    def noise(t, scale):
        return torch.randn(t.shape, generator=gen, dtype=t.dtype) * scale

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and getattr(model, "gpt2_init", False):
                module.weight.copy_(noise(module.weight, 0.02))
            if isinstance(module, (nn.Linear, nn.Conv2d)) and module.bias is not None:
                module.bias.copy_(noise(module.bias, 0.02))
            if isinstance(module, (nn.LayerNorm, nn.BatchNorm2d)):
                module.weight.copy_(1 + noise(module.weight, 0.1))
                module.bias.copy_(noise(module.bias, 0.1))
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(noise(module.running_mean, 0.1))
                module.running_var.copy_(1 + torch.rand(module.running_var.shape, generator=gen) * 0.5)


def _module_classes() -> dict:
    """Define the torch module classes on first use (torch is imported lazily)."""
    if _CLASSES:
        return _CLASSES
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class CausalSelfAttention(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x, mask):
            b, t, d = x.shape
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.heads))
            att = att.masked_fill(mask[:, :, :t, :t] == 0, float("-inf"))
            y = torch.softmax(att, dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d))

    class Block(nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = CausalSelfAttention(d, heads)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.out = nn.Linear(4 * d, d)

        def forward(self, x, mask):
            x = x + self.attn(self.ln1(x), mask)
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt2(nn.Module):
        gpt2_init = True

        def __init__(self, layers, d, heads, vocab, max_len):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = nn.Embedding(max_len, d)
            self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
            self.ln_f = nn.LayerNorm(d)
            # nanoGPT's persistent mask buffer: exported as an initializer. (A non-persistent buffer, as
            # in Hugging Face's GPT-2, is traced into a Constant of the mask at the export's length.)
            self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

        def forward(self, ids, labels):
            t = ids.shape[1]
            h = self.wte(ids) + self.wpe(torch.arange(t, device=ids.device))
            for block in self.blocks:
                h = block(h, self.causal)
            logits = F.linear(self.ln_f(h), self.wte.weight)  # LM head tied to the token embedding
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = None
            if stride != 1 or cin != cout:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = F.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return F.relu(out + (x if self.downsample is None else self.downsample(x)))

    class ResNet18(nn.Module):
        def __init__(self, classes, width):
            super().__init__()
            w = width
            self.conv1 = nn.Conv2d(3, w, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(w)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            stages, cin = [], w
            for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
                stride = 1 if i == 0 else 2
                stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
                cin = cout
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.fc = nn.Linear(8 * w, classes)

        def forward(self, x, labels):
            h = self.maxpool(F.relu(self.bn1(self.conv1(x))))
            h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
            logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))
            return F.cross_entropy(logits, labels)

    _CLASSES.update(Gpt2=Gpt2, ResNet18=ResNet18)
    return _CLASSES


_CLASSES: dict = {}


# ---------------------------------------------------------------------------------------------
# Inputs and export


def make_inputs(spec: ModelSpec) -> dict[str, np.ndarray]:
    """The graph inputs (numpy, in the forward's argument order), seeded by ``spec.seed``: token ids and
    next-token labels for gpt2, standard-normal images and class labels for resnet18."""
    rng = np.random.default_rng(spec.seed)
    if spec.kind == "gpt2":
        vocab = spec.arch["vocab"]
        tokens = rng.integers(0, vocab, (spec.batch, spec.size + 1)).astype(np.int64)
        return {"ids": tokens[:, :-1].copy(), "labels": tokens[:, 1:].copy()}
    images = rng.standard_normal((spec.batch, 3, spec.size, spec.size), dtype=np.float32)
    return {"x": images, "labels": rng.integers(0, spec.arch["classes"], spec.batch).astype(np.int64)}


TRAIN_CLASSES = 16  # resnet18's training task: this many classes, each with its own image template
TRAIN_SUCCESSORS = 4  # gpt2's training task: each token is followed by one of this many tokens


def make_train_batches(spec: ModelSpec, count: int) -> dict[str, np.ndarray]:
    """``count`` distinct batches of a task the model can learn, stacked on a leading axis (the
    train group cycles through them), seeded by ``spec.seed``.

    Random labels on one batch (``make_inputs``) can only be memorised: the loss sits at a plateau and
    leaves it at a step that a rounding difference moves, so two runs' curves part for reasons that
    say nothing about either. A learnable task falls smoothly instead:

    - resnet18: ``TRAIN_CLASSES`` classes; an image is its class's low-frequency template plus
      standard-normal noise;
    - gpt2: token sequences of a fixed random Markov chain in which each token has
      ``TRAIN_SUCCESSORS`` equally likely successors (the best loss is log of that).
    """
    rng = np.random.default_rng(spec.seed + 1)
    if spec.kind == "gpt2":
        vocab = spec.arch["vocab"]
        successors = rng.integers(0, vocab, (vocab, TRAIN_SUCCESSORS))
        tokens = np.empty((count, spec.batch, spec.size + 1), np.int64)
        tokens[:, :, 0] = rng.integers(0, vocab, (count, spec.batch))
        choices = rng.integers(0, TRAIN_SUCCESSORS, tokens.shape)
        for t in range(1, spec.size + 1):
            tokens[:, :, t] = successors[tokens[:, :, t - 1], choices[:, :, t]]
        return {"ids": tokens[:, :, :-1].copy(), "labels": tokens[:, :, 1:].copy()}
    size, block = spec.size, max(1, spec.size // 16)
    coarse = rng.standard_normal((TRAIN_CLASSES, 3, -(-size // block), -(-size // block)), dtype=np.float32)
    templates = coarse.repeat(block, axis=2).repeat(block, axis=3)[:, :, :size, :size]
    labels = rng.integers(0, min(TRAIN_CLASSES, spec.arch["classes"]), (count, spec.batch))
    images = rng.standard_normal((count, spec.batch, 3, size, size), dtype=np.float32)
    images += templates[labels]
    return {"x": images, "labels": labels.astype(np.int64)}


def parameter_names(model) -> list[str]:
    """The names of the trainable parameters (tied ones once), as the exporter names the initializers."""
    return [name for name, _ in model.named_parameters()]


def legacy_export(model, args: tuple, names: list[str], dynamic_axes: dict | None = None):
    """``model`` (whose forward returns the loss) on the torch tensors ``args`` as an
    ``onnx.ModelProto``, with PyTorch's legacy exporter and the samples' settings: opset 17, no
    constant folding, parameters kept as initializers, the inputs named ``names``, the output
    ``loss``."""
    import onnx
    import torch

    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            buf,
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            input_names=names,
            output_names=["loss"],
            dynamic_axes=dynamic_axes,
        )
    return onnx.load_from_string(buf.getvalue())


def dynamo_export(model, args: tuple, names: list[str], dynamic_shapes: tuple | None = None, optimize: bool = False):
    """``model`` (whose forward returns the loss) as an ``onnx.ModelProto`` through PyTorch's dynamo
    exporter (torch.export; it needs onnxscript), unoptimised unless ``optimize`` (its optimizer,
    on by default in PyTorch, folds parts of the parameters into constants), the inputs named
    ``names``, the output ``loss``; the exporter's progress lines and warnings are kept out of the
    caller's output."""
    import contextlib

    import torch

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            args,
            dynamo=True,
            optimize=optimize,
            input_names=names,
            output_names=["loss"],
            dynamic_shapes=dynamic_shapes,
        )
    return program.model_proto


def export(model, inputs: dict[str, np.ndarray], *, dynamic_seq: bool = False):
    """Export ``model`` with its loss to an ``onnx.ModelProto`` with PyTorch's legacy exporter (the
    samples' settings: opset 17, no constant folding, parameters kept as initializers).

    ``dynamic_seq`` makes the sequence axis (axis 1 of every input) symbolic, ``seq``.
    """
    import torch

    names = list(inputs)
    dynamic_axes = {name: {1: "seq"} for name in names} if dynamic_seq else None
    proto = legacy_export(model, tuple(torch.from_numpy(a) for a in inputs.values()), names, dynamic_axes)
    missing = sorted(set(parameter_names(model)) - {t.name for t in proto.graph.initializer})
    if missing:
        raise RuntimeError(
            f"export of {type(model).__name__}: parameters without an initializer of the same name: {', '.join(missing[:5])}"
        )
    return proto
