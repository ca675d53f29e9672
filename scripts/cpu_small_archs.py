"""Small real architectures nobody tuned gradgen for, on the CPU against ONNX Runtime.

Usage::

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python scripts/cpu_small_archs.py [NAME ...] [--profile] [--json out.json]

Each model (plain PyTorch, written here: a MobileNetV2, a tiny ViT, an EfficientNet-style network of
MBConv blocks with squeeze-and-excitation and SiLU, a small U-Net, a two-layer LSTM language model, a
GRU classifier, a 1-D convolutional audio classifier, an MLP-Mixer, a ConvNeXt-style network and a
full-width ResNet-18 on 32 x 32 images; batch 2, 32 x 32 images, 16 tokens or 1,024 samples) is
exported with its cross-entropy loss by the legacy exporter, built with
``gradgen.build_backward(portable=True)``, and one forward + backward step is timed on gradgen's CPU
Session and on ONNX Runtime (the same graph, one thread each, the median of 20 runs).
``--profile`` adds gradgen's costliest op types.
"""

from __future__ import annotations

import argparse
import json
import statistics

import onnx_ir as ir
import onnxruntime as ort
import torch
import torch.nn.functional as F
from torch import nn

import gradgen
from gradgen.bench.measure import time_steps
from gradgen.bench.models import legacy_export
from gradgen.executor import Session

BATCH = 2


def conv_bn_act(cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1, act=nn.ReLU6) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), act()
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = [conv_bn_act(cin, hidden, 1)] if expand != 1 else []
        layers += [conv_bn_act(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def mobilenet_v2(classes: int = 10) -> nn.Module:
    stages = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    layers, cin = [conv_bn_act(3, 32, 3, 2)], 32
    for expand, cout, repeats, stride in stages:
        for i in range(repeats):
            layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
            cin = cout
    layers += [conv_bn_act(cin, 1280, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes)]
    return nn.Sequential(*layers)


class TinyViT(nn.Module):
    def __init__(self, size: int = 32, patch: int = 4, width: int = 64, depth: int = 4, heads: int = 4, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, patch)
        self.position = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, width) * 0.02)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(tokens.shape[0], -1, -1), tokens], 1) + self.position
        return self.head(self.encoder(tokens)[:, 0])


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, channels // 4, 1), nn.Conv2d(channels // 4, channels, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(F.adaptive_avg_pool2d(x, 1)))))


class MBConv(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        hidden = cin * 4
        self.body = nn.Sequential(
            conv_bn_act(cin, hidden, 1, act=nn.SiLU),
            conv_bn_act(hidden, hidden, 3, stride, hidden, act=nn.SiLU),
            SqueezeExcite(hidden),
            nn.Conv2d(hidden, cout, 1, bias=False),
            nn.BatchNorm2d(cout),
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def efficientnet_style(classes: int = 10) -> nn.Module:
    blocks = [MBConv(16, 24, 2), MBConv(24, 24, 1), MBConv(24, 40, 2), MBConv(40, 40, 1), MBConv(40, 80, 2)]
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.SiLU(), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(80, classes)
    )


class SmallUNet(nn.Module):
    def __init__(self, width: int = 16, classes: int = 2):
        super().__init__()

        def block(cin, cout):
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1), nn.ReLU()
            )

        w = width
        self.down1, self.down2, self.middle = block(3, w), block(w, 2 * w), block(2 * w, 4 * w)
        self.up2, self.merge2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, 2), block(4 * w, 2 * w)
        self.up1, self.merge1 = nn.ConvTranspose2d(2 * w, w, 2, 2), block(2 * w, w)
        self.out = nn.Conv2d(w, classes, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        m = self.middle(F.max_pool2d(b, 2))
        b = self.merge2(torch.cat([self.up2(m), b], 1))
        return self.out(self.merge1(torch.cat([self.up1(b), a], 1)))


class LstmLanguageModel(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 64):
        super().__init__()
        self.embed, self.rnn, self.out = (
            nn.Embedding(vocab, width),
            nn.LSTM(width, width, 2, batch_first=True),
            nn.Linear(width, vocab),
        )

    def forward(self, ids):
        return self.out(self.rnn(self.embed(ids))[0])


class GruClassifier(nn.Module):
    def __init__(self, vocab: int = 100, width: int = 64, classes: int = 5):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, width), nn.Linear(width, classes)
        self.rnn = nn.GRU(width, width, batch_first=True)

    def forward(self, ids):
        return self.out(self.rnn(self.embed(ids))[0][:, -1])


def conv1d_audio(classes: int = 10) -> nn.Module:
    return nn.Sequential(
        *(nn.Conv1d(1, 32, 9, 2, 4), nn.BatchNorm1d(32), nn.GELU(), nn.Conv1d(32, 64, 9, 2, 4), nn.BatchNorm1d(64), nn.GELU()),
        *(nn.MaxPool1d(2), nn.Conv1d(64, 64, 5, 1, 2), nn.GELU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(64, classes)),
    )


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, width: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class MlpMixer(nn.Module):
    def __init__(self, width: int = 64, patch: int = 4, depth: int = 3, classes: int = 10):
        super().__init__()
        self.embed = nn.Conv2d(3, width, patch, patch)
        self.blocks = nn.Sequential(*(MixerBlock((32 // patch) ** 2, width) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.norm(self.blocks(self.embed(x).flatten(2).transpose(1, 2))).mean(1))


class ConvNeXtBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.depthwise = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.norm, self.expand, self.project = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.gamma = nn.Parameter(torch.full((width,), 0.1))

    def forward(self, x):
        y = self.norm(self.depthwise(x).permute(0, 2, 3, 1))
        return x + (self.project(F.gelu(self.expand(y))) * self.gamma).permute(0, 3, 1, 2)


def convnext_style(classes: int = 10) -> nn.Module:
    body = nn.Sequential(
        *(nn.Conv2d(3, 32, 4, 4), ConvNeXtBlock(32), ConvNeXtBlock(32)),
        *(nn.Conv2d(32, 64, 2, 2), ConvNeXtBlock(64), ConvNeXtBlock(64)),
    )
    return nn.Sequential(body, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def resnet18_small_images() -> nn.Module:
    """The benchmark's ResNet-18 layout (64..512 channels, 1,000 classes) on 32 x 32 images."""
    from gradgen.bench import models

    net = models.build_module(models.preset("resnet18", batch=BATCH, size=32))
    stem = nn.Sequential(net.conv1, net.bn1, nn.ReLU(), net.maxpool)
    return nn.Sequential(stem, net.layer1, net.layer2, net.layer3, net.layer4, nn.AdaptiveAvgPool2d(1), nn.Flatten(), net.fc)


def images(classes: int):
    return torch.randn(BATCH, 3, 32, 32), torch.randint(0, classes, (BATCH,))


MODELS = {
    "mobilenet_v2": (mobilenet_v2, lambda: images(10)),
    "vit_tiny": (TinyViT, lambda: images(10)),
    "efficientnet_style": (efficientnet_style, lambda: images(10)),
    "unet_small": (SmallUNet, lambda: (torch.randn(BATCH, 3, 32, 32), torch.randint(0, 2, (BATCH, 32, 32)))),
    "lstm_lm": (LstmLanguageModel, lambda: (torch.randint(0, 100, (BATCH, 16)), torch.randint(0, 100, (BATCH, 16)))),
    "gru_classifier": (GruClassifier, lambda: (torch.randint(0, 100, (BATCH, 16)), torch.randint(0, 5, (BATCH,)))),
    "conv1d_audio": (conv1d_audio, lambda: (torch.randn(BATCH, 1, 1024), torch.randint(0, 10, (BATCH,)))),
    "mlp_mixer": (MlpMixer, lambda: images(10)),
    "convnext_style": (convnext_style, lambda: images(10)),
    "resnet18_32px": (resnet18_small_images, lambda: images(1000)),
}


class WithLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        out = self.model(x)
        if out.ndim == 3:  # a language model: (batch, tokens, vocab)
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1))
        return F.cross_entropy(out, labels)


def median_ms(run, repeats: int = 20) -> float:
    return statistics.median(time_steps(run, warmup=3, steps=repeats))


def measure(name: str, profile: bool) -> dict:
    torch.manual_seed(0)
    build, make_inputs = MODELS[name]
    model = WithLoss(build().eval())
    x, labels = make_inputs()
    proto = legacy_export(model, (x, labels), ["x", "labels"])
    built = gradgen.build_backward(proto, wrt=[n for n, _ in model.named_parameters()], portable=True).model
    feeds = {"x": x.numpy(), "labels": labels.numpy()}
    session = Session(built)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    reference = ort.InferenceSession(ir.to_proto(built).SerializeToString(), options, providers=["CPUExecutionProvider"])
    row = {
        "model": name,
        "steps": len(session.steps),
        "ort_ms": median_ms(lambda: reference.run(None, feeds)),
        "gradgen_ms": median_ms(lambda: session.run(feeds)),
    }
    if profile:
        row["by_op"] = [(op, count, seconds * 1e3) for op, count, seconds in session.profile(feeds, runs=5).by_op()[:8]]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"models (default all): {', '.join(MODELS)}")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = []
    for name in args.names or list(MODELS):
        row = measure(name, args.profile)
        rows.append(row)
        ratio = row["gradgen_ms"] / row["ort_ms"]
        print(
            f"{name:20s} {row['steps']:5d} steps  ORT {row['ort_ms']:7.2f} ms  gradgen {row['gradgen_ms']:7.2f} ms  {ratio:.2f}x",
            flush=True,
        )
        for op, count, ms in row.get("by_op", []):
            print(f"    {op:24s} {count:4d} steps {ms:7.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
