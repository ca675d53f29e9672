"""Where the bf16 gradient error of the benchmark ResNet-18 comes from (PyTorch only, on a GPU).

Usage::

    python scripts/bf16_error_sources.py [--seeds 0 1 2 3] [--json out.json]

Issue 14's criterion compares, per parameter tensor, ``max|g - g_fp32| / max|g_fp32|`` of a bf16
step's gradients with that of PyTorch eager under ``torch.autocast(bfloat16)``. This script runs
the bench's ResNet-18 (gradgen/bench/models.py, the same parameters and batch for a seed) with every
Conv2d and Linear replaced by an autograd function that rounds its inputs and weights to bf16 as
autocast does, and varies only what comes after:

- ``bf16``: output rounded to bf16, backward in bf16 (dY rounded; dX, dW from bf16 kernels) with
  BatchNorm, ReLU and the residual adds in float32: the rounding gradgen's AutocastPass graphs do;
- ``out32_bf16``: output kept in float32 (bf16 products summed in float32, no output rounding),
  backward as ``bf16``;
- ``out32_fp32``: output in float32 and the whole backward in float32 (TF32 off): only the forward's
  input and weight roundings are left.

For each it prints the worst tensor error, autocast's, on how many of the 62 tensors the error is
above autocast's, and the median ratio to autocast's. If even ``out32_fp32`` is above autocast on
many tensors, the per-tensor comparison is decided by the roundings both sides share (bf16 inputs and
weights of every convolution), not by anything after them.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--json", help="write every tensor's error here")
    args = parser.parse_args()
    results = {seed: errors_of_seed(seed) for seed in args.seeds}
    for seed, errors in results.items():
        report(seed, errors)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(s): e for s, e in results.items()}, f, indent=1)


VARIANTS = {"bf16": ("bf16", "bf16"), "out32_bf16": ("fp32", "bf16"), "out32_fp32": ("fp32", "fp32")}


def errors_of_seed(seed: int) -> dict[str, dict[str, float]]:
    from gradgen.bench import models

    spec = models.preset("resnet18", seed=seed)
    reference = gradients(spec, None)
    errors = {}
    for name, variant in [("autocast", "autocast"), *VARIANTS.items()]:
        got = gradients(spec, variant)
        errors[name] = {n: float((got[n] - reference[n]).abs().max() / reference[n].abs().max()) for n in reference}
    return errors


def gradients(spec, variant):
    """Parameter gradients (float64, on the host) of one step: float32 (variant None, TF32 off),
    autocast, or a (forward output, backward) pair of VARIANTS."""
    import torch

    from gradgen.bench import models

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = models.build_module(spec).cuda()
    inputs = models.make_inputs(spec)
    x, labels = torch.tensor(inputs["x"]).cuda(), torch.tensor(inputs["labels"]).cuda()
    if variant == "autocast":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels)
    else:
        if variant is not None:
            _round_like_autocast(model, *variant)
        loss = model(x, labels)
    loss.backward()
    return {n: p.grad.double().cpu() for n, p in model.named_parameters()}


def _round_like_autocast(model, output: str, backward: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.grad import conv2d_input, conv2d_weight

    def rounded_output(y):
        return y.float() if output == "bf16" else y

    class Conv(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, stride, padding):
            xb, wb = x.bfloat16(), w.bfloat16()
            ctx.save_for_backward(xb, w)
            ctx.geometry = (stride, padding)
            y = (
                F.conv2d(xb, wb, None, stride, padding)
                if output == "bf16"
                else F.conv2d(xb.float(), wb.float(), None, stride, padding)
            )
            return rounded_output(y)

        @staticmethod
        def backward(ctx, dy):
            xb, w = ctx.saved_tensors
            stride, padding = ctx.geometry
            if backward == "bf16":
                d, wb = dy.bfloat16(), w.bfloat16()
                return (
                    conv2d_input(xb.shape, wb, d, stride, padding).float(),
                    conv2d_weight(xb, w.shape, d, stride, padding).float(),
                    None,
                    None,
                )
            return (
                conv2d_input(xb.shape, w, dy, stride, padding),
                conv2d_weight(xb.float(), w.shape, dy, stride, padding),
                None,
                None,
            )

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            xb = x.bfloat16()
            ctx.save_for_backward(xb, w)
            if output == "bf16":
                return F.linear(xb, w.bfloat16(), b.bfloat16()).float()
            return F.linear(xb.float(), w.bfloat16().float(), b)

        @staticmethod
        def backward(ctx, dy):
            xb, w = ctx.saved_tensors
            if backward == "bf16":
                d = dy.bfloat16()
                return (d @ w.bfloat16()).float(), (d.t() @ xb).float(), d.float().sum(0).bfloat16().float()
            return dy @ w, dy.t() @ xb.float(), dy.sum(0)

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d):
            module.forward = lambda x, m=module: Conv.apply(x, m.weight, m.stride, m.padding)
        elif isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: Linear.apply(x, m.weight, m.bias)


def report(seed: int, errors: dict[str, dict[str, float]]) -> None:
    auto = errors["autocast"]
    names = list(auto)
    print(f"seed {seed}: autocast worst {max(auto.values()):.3e}")
    for variant in VARIANTS:
        mine = errors[variant]
        above = sum(mine[n] > auto[n] for n in names)
        ratio = float(np.median([mine[n] / auto[n] for n in names]))
        worst = max(names, key=lambda n: mine[n] / auto[n])
        print(
            f"  {variant:11s} worst {max(mine.values()):.3e}; above autocast on {above}/{len(names)} "
            f"(most {mine[worst] / auto[worst]:.2f}x, {worst}); median ratio {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
