"""torchvision's classification architectures, exported as users export them, against PyTorch.

Usage::

    pip install torchvision   # the release made for the installed torch (not a dependency of gradgen)
    python scripts/torchvision_models.py [NAME ...] [--modes eval,train] [--exporters legacy,dynamo]
                                         [--steps 10] [--json out.json]

Each model is a torchvision classifier with 5 classes, built small where its constructor allows
(narrower, shallower: ResNet-50, ResNeXt and Wide ResNet as one bottleneck block per stage, a
DenseNet of four 2-layer dense blocks, RegNetY, EfficientNet-B0, ConvNeXt, Swin and MaxViT at small
widths and depths, a 2-layer ViT on 32x32 images with 8x8 patches), with dropout and stochastic
depth at 0, its parameters perturbed by 0.05 N(0, 1) so that no two are equal (the legacy exporter
would merge equal initializers), and its BatchNorm running statistics set to the average of two batches of
random images in train mode. The loss is the cross-entropy of its logits on a fixed batch of 4
images (32x32; SqueezeNet 64x64) against fixed labels. Each model runs in two modes,

- ``eval``: BatchNorm normalises with its running statistics (which get a gradient too: they are
  float initializers of the export);
- ``train``: BatchNorm normalises with the batch's statistics (the export has training-mode
  BatchNormalization nodes; dropout is off by p = 0, so the run is deterministic),

and through two exporters, ``legacy`` (``torch.onnx.export(dynamo=False)``, opset 17, no constant
folding, training=PRESERVE) and ``dynamo`` (``dynamo=True, optimize=False``). For each:

- the gradient of every parameter and of the input images against PyTorch autograd, by
  ``scripts/torch_sweep.py``'s comparison (float32, rerun in float64 when a tensor is off by more
  than 1e-3); gradgen's gradients of the eval-mode running statistics have no PyTorch reference
  (``unmatched``; torch_sweep's central differences of them are left out: minutes a model);
- ``--steps`` steps of ``gradgen.training`` (SGD, momentum 0.9, lr 1e-5; ``--adamw``: AdamW, lr
  1e-4, weight decay 0.01) against ``torch.optim`` on the same batches, from the same weights: the
  largest relative difference of the losses and of the parameters at the end (``max|p - p_torch| /
  max|p_torch|`` over tensors). The rates are small because these perturbed models on random labels
  have gradient norms in the hundreds: at SGD's lr 1e-3 ResNet-18's losses rise and its steps turn
  chaotic, gradgen's and PyTorch's losses agreeing to 1e-7 at step 1 and parting by 0.3 at step 10.
  In train mode also the running statistics gradgen's steps update,
  against PyTorch's running means and against its running variances with ONNX's rule: ONNX's
  BatchNormalization blends in the biased batch variance where PyTorch blends in the unbiased one
  (a factor n / (n - 1), n the values per channel), so the reference variance replays PyTorch's
  momentum with each batch's biased variance, recorded by a hook (the raw difference to PyTorch's
  running variance is recorded as well, as ``running_var_vs_torch``).

The CPU wheel of torchvision is not on PyPI; the CUDA one installs on a CPU torch with ``--no-deps``
but its C++ operators (detection's nms, roi_align) cannot load, and its import then fails on
registering their fake kernels. ``_import_torchvision`` declares the two schemas it registers at
import so that the (pure Python) classification models import; no model here uses those operators.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_models  # noqa: E402  (batches, exports, the silenced legacy exporter)
import torch_sweep  # noqa: E402  (the gradient comparison)

BATCH = 4
CLASSES = 5
MODES = ("eval", "train")
EXPORTERS = ("legacy", "dynamo")


def _import_torchvision():
    """``import torchvision``, also where its C++ extension cannot load (a CUDA wheel on a CPU torch):
    torchvision then registers fake kernels for ``torchvision::nms`` and ``qnms`` that no library
    defines, and its import fails. Their schemas, declared here, let it import."""
    try:
        import torchvision
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]
        _import_torchvision.library = torch.library.Library("torchvision", "DEF")  # type: ignore[attr-defined]
        for op in ("nms", "qnms"):
            _import_torchvision.library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")  # type: ignore[attr-defined]
        import torchvision
    return torchvision


class Classify(nn.Module):
    """``cross_entropy(model(images), labels)``, the model in train mode (batch statistics) when
    ``batch_statistics`` whatever ``.train()`` / ``.eval()`` asks of the wrapper: torch_sweep puts
    the module it compares in eval mode."""

    def __init__(self, model: nn.Module, batch_statistics: bool):
        super().__init__()
        self.model = model
        self.batch_statistics = batch_statistics
        self.train(batch_statistics)

    def train(self, mode: bool = True) -> Classify:
        super().train(mode)
        self.model.train(self.batch_statistics)
        return self

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(images), labels)


def _images(size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size, generator=torch.Generator().manual_seed(seed))


def _prepared(model: nn.Module, size: int) -> nn.Module:
    """``model`` with dropout and stochastic depth at 0, parameters moved by 0.05 N(0, 1) and running
    statistics averaged over two train-mode passes over random images."""
    tv = _import_torchvision()
    for module in model.modules():
        if isinstance(module, (nn.Dropout, tv.ops.StochasticDepth)):
            module.p = 0.0
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        norms = {m: m.momentum for m in _batch_norms(model).values()}
        for norm in norms:  # a cumulative average: the running statistics fit these weights
            norm.reset_running_stats()
            norm.momentum = None
        model.train()
        for seed in (10, 11):
            model(_images(size, seed))
        for norm, momentum in norms.items():
            norm.momentum = momentum
    return model


# name -> (the model, its image size)
def _tv(make: Callable[[Any], nn.Module], size: int = 32) -> Callable[[], tuple[nn.Module, int]]:
    def build() -> tuple[nn.Module, int]:
        torch.manual_seed(0)
        return make(_import_torchvision().models), size

    return build


def _efficientnet_b0(m: Any) -> nn.Module:
    setting, last = m.efficientnet._efficientnet_conf("efficientnet_b0", width_mult=0.5, depth_mult=0.5)
    return m.EfficientNet(setting, dropout=0.0, stochastic_depth_prob=0.0, num_classes=CLASSES, last_channel=last)


def _regnet_y(m: Any) -> nn.Module:
    params = m.regnet.BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8, se_ratio=0.25)
    return m.RegNet(params, num_classes=CLASSES)


def _convnext(m: Any) -> nn.Module:
    config = m.convnext.CNBlockConfig
    blocks = [config(16, 32, 1), config(32, 64, 1), config(64, None, 1)]
    return m.ConvNeXt(blocks, stochastic_depth_prob=0.0, num_classes=CLASSES)


MODELS: dict[str, Callable[[], tuple[nn.Module, int]]] = {
    "resnet18": _tv(lambda m: m.resnet18(num_classes=CLASSES)),
    "resnet50": _tv(lambda m: m.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], num_classes=CLASSES)),
    "resnext50_32x4d": _tv(
        lambda m: m.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], groups=32, width_per_group=4, num_classes=CLASSES)
    ),
    "wide_resnet50_2": _tv(lambda m: m.ResNet(m.resnet.Bottleneck, [1, 1, 1, 1], width_per_group=128, num_classes=CLASSES)),
    "mobilenet_v2": _tv(lambda m: m.mobilenet_v2(width_mult=0.5, dropout=0.0, num_classes=CLASSES)),
    "mobilenet_v3_small": _tv(lambda m: m.mobilenet_v3_small(width_mult=0.5, dropout=0.0, num_classes=CLASSES)),
    "efficientnet_b0": _tv(_efficientnet_b0),
    "regnet_y_400mf": _tv(_regnet_y),
    "shufflenet_v2_x0_5": _tv(lambda m: m.shufflenet_v2_x0_5(num_classes=CLASSES)),
    "squeezenet1_1": _tv(lambda m: m.squeezenet1_1(num_classes=CLASSES, dropout=0.0), 64),
    "densenet121": _tv(
        lambda m: m.DenseNet(
            growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2, drop_rate=0.0, num_classes=CLASSES
        )
    ),
    "googlenet": _tv(
        lambda m: m.GoogLeNet(num_classes=CLASSES, aux_logits=False, transform_input=False, init_weights=False, dropout=0.0)
    ),
    "mnasnet0_5": _tv(lambda m: m.mnasnet0_5(num_classes=CLASSES, dropout=0.0)),
    "convnext_tiny": _tv(_convnext),
    "vit_b_16": _tv(
        lambda m: m.VisionTransformer(
            image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=CLASSES
        )
    ),
    "swin_t": _tv(
        lambda m: m.SwinTransformer(
            patch_size=[4, 4],
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 2],
            window_size=[2, 2],
            stochastic_depth_prob=0.0,
            num_classes=CLASSES,
        )
    ),
    "maxvit_t": _tv(
        lambda m: m.MaxVit(
            input_size=(32, 32),
            stem_channels=8,
            partition_size=2,
            block_channels=[16, 32],
            block_layers=[1, 1],
            head_dim=8,
            stochastic_depth_prob=0.0,
            num_classes=CLASSES,
        )
    ),
}


def make_case(name: str, mode: str) -> torch_sweep.Case:
    model, size = MODELS[name]()
    labels = torch.tensor([4, 1, 3, 0])[:BATCH]
    module = Classify(_prepared(model, size), batch_statistics=mode == "train")
    return torch_sweep.Case(module, {"images": _images(size), "labels": labels})


def _batch_norms(module: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats}


class OnnxRunningVar:
    """Replays each BatchNorm's running variance as ONNX updates it (PyTorch's momentum, the biased
    batch variance) from a forward pre-hook on the torch module."""

    def __init__(self, module: nn.Module):
        self.values: dict[str, torch.Tensor] = {}
        self.handles = []
        for name, bn in _batch_norms(module).items():
            assert bn.running_var is not None
            self.values[name] = bn.running_var.detach().clone().double()
            self.handles.append(bn.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(bn: nn.modules.batchnorm._BatchNorm, args: tuple[torch.Tensor, ...]) -> None:
            if bn.training:
                x = args[0].detach().double()
                dims = [d for d in range(x.dim()) if d != 1]
                momentum = bn.momentum if bn.momentum is not None else 0.1
                self.values[name] = (1 - momentum) * self.values[name] + momentum * x.var(dims, unbiased=False)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    top = float(np.abs(theirs).max()) if theirs.size else 0.0
    return float(np.abs(ours.astype(np.float64) - theirs.astype(np.float64)).max()) / max(top, 1e-12)


def _worst(pairs: list[tuple[str, float]]) -> dict[str, Any]:
    if not pairs:
        return {"worst": None, "tensor": None, "compared": 0}
    name, value = max(pairs, key=lambda p: p[1])
    return {"worst": value, "tensor": name, "compared": len(pairs)}


def compare_training(case: torch_sweep.Case, proto, steps: int, adamw: bool) -> dict[str, Any]:
    """``steps`` optimizer steps of gradgen's trainer and of PyTorch's on the same batches, from the
    same weights: losses, parameters at the end and, in train mode, the running statistics."""
    from gradgen.training import SGD, AdamW, Trainer, build_training

    batches = hf_models._batches(case, [i.name for i in proto.graph.input], steps)
    optimizer, lr = (AdamW(weight_decay=0.01), 1e-4) if adamw else (SGD(momentum=0.9), 1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = build_training(proto, optimizer=optimizer)
    trainer = Trainer(program, lr=lr)
    ours = np.array([r.loss for r in trainer.fit(batches, steps)])
    module = case.module
    replay = OnnxRunningVar(module.model)
    params = list(module.parameters())
    torch_optimizer = (
        torch.optim.AdamW(params, lr=lr, weight_decay=0.01) if adamw else torch.optim.SGD(params, lr=lr, momentum=0.9)
    )
    theirs = []
    for batch in batches:
        torch_optimizer.zero_grad()
        loss = module(*[torch.from_numpy(batch[name]) if name in batch else case.inputs[name] for name in case.inputs])
        loss.backward()
        torch_optimizer.step()
        theirs.append(loss.item())
    replay.remove()
    got = trainer.params
    torch_params = dict(module.named_parameters())
    record: dict[str, Any] = {
        "params": len(program.params),
        "torch_params": len(torch_params),
        "loss_first_last": [theirs[0], theirs[-1]],
        "max_rel_loss_diff": float((np.abs(ours - np.array(theirs)) / np.abs(np.array(theirs))).max()),
        "params_after": _worst([(n, _rel(got[n], p.detach().numpy())) for n, p in torch_params.items() if n in got]),
        "untrained": sorted(n for n in torch_params if n not in got),
        "notes": [str(w.message)[:300] for w in caught],
    }
    updated = set(program.running_statistics_updated)
    if module.model.training:
        means, variances, raw = [], [], []
        for name, bn in _batch_norms(module.model).items():
            key = f"model.{name}"
            assert bn.running_mean is not None and bn.running_var is not None
            if f"{key}.running_mean" in updated:
                means.append((key, _rel(got[f"{key}.running_mean"], bn.running_mean.numpy())))
            if f"{key}.running_var" in updated:
                var = got[f"{key}.running_var"]
                variances.append((key, _rel(var, replay.values[name].numpy())))
                raw.append((key, _rel(var, bn.running_var.numpy())))
        record["running_stats_updated"] = len(updated)
        record["running_stats_torch"] = 2 * len(_batch_norms(module.model))
        record["running_mean"] = _worst(means)
        record["running_var_onnx_rule"] = _worst(variances)
        record["running_var_vs_torch"] = _worst(raw)
    return record


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in module.named_buffers()}


def _from_export(module: nn.Module, proto, before: dict[str, torch.Tensor], record: dict[str, Any]) -> None:
    """PyTorch's buffers set to the export's initializers of the same name (what gradgen starts from):
    the legacy exporter runs the module, so a train-mode BatchNorm's running statistics moved by one
    update (or two) and the export holds the moved ones. ``record`` counts the buffers export moved."""
    from onnx import numpy_helper

    initializers = {t.name: t for t in proto.graph.initializer}
    moved = 0
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if buffer.is_floating_point() and not torch.equal(buffer, before[name]):
                moved += 1
            if name in initializers and buffer.is_floating_point():
                buffer.copy_(torch.from_numpy(numpy_helper.to_array(initializers[name]).copy()))
            else:
                buffer.copy_(before[name])
    if moved:
        record["export_moved_buffers"] = moved


def _no_finite_differences(*args: Any, **kwargs: Any) -> float:
    """torch_sweep's float64 rerun scores a gradient PyTorch has no reference for (here the running
    statistics: PyTorch's batch_norm does not differentiate them) by central differences, two
    sessions per value: minutes per model. Left out."""
    return math.nan


def run(name: str, mode: str, exporter: str, steps: int, adamw: bool) -> dict[str, Any]:
    record: dict[str, Any] = {"model": name, "mode": mode, "exporter": exporter}
    key = f"{name}:{mode}"
    started = time.perf_counter()
    try:
        torch_sweep.CASES[key] = ("torchvision", lambda: make_case(name, mode))
        torch_sweep.fd_score = _no_finite_differences
        for dtype in (torch.float32, torch.float64):
            with hf_models._stdout_silenced():
                gradients = torch_sweep.run_case(key, exporter, dtype, 900)
            real = {k: v for k, v in gradients.get("errors", {}).items() if k not in gradients.get("zero_ref", {})}
            worst = max(real.values(), default=0.0)
            record[f"gradients_{str(dtype)[6:]}"] = {
                "stage": gradients["stage"],
                "error": gradients.get("error"),
                "traceback": gradients.get("traceback"),
                "compared": gradients.get("compared"),
                "loss_err": gradients.get("loss_err"),
                "ort_ok": gradients.get("ort_ok"),
                "worst": worst,
                "worst_tensor": max(real, key=real.__getitem__) if real else None,
                "zero_ref_above_1e-6": {k: v for k, v in gradients.get("zero_ref", {}).items() if v > 1e-6},
                "unmatched": gradients.get("unmatched"),
                "no_gradient": gradients.get("no_gradient"),
            }
            if gradients["stage"] != "done" or (worst <= 1e-3 and (gradients.get("loss_err") or 0) <= 1e-3):
                break
        if gradients["stage"] == "export":
            return record
        case = make_case(name, mode)
        before = _buffers(case.module)
        with hf_models._stdout_silenced():
            proto = torch_sweep.export(case, exporter)
        _from_export(case.module, proto, before, record)
        norms = [n for n in proto.graph.node if n.op_type == "BatchNormalization"]
        training_mode = sum(any(a.name == "training_mode" and a.i for a in n.attribute) for n in norms)
        record["batch_norms"] = {"nodes": len(norms), "training_mode": training_mode}
        record["training"] = compare_training(dataclasses.replace(case), proto, steps, adamw)
    except Exception as exc:  # noqa: BLE001 -- a row of the table, not the end of the run
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        record["seconds"] = round(time.perf_counter() - started, 1)
    return record


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def row(record: dict[str, Any]) -> str:
    cells = [f"{record['model']:18s} {record['mode']:5s} {record['exporter']:6s}"]
    for dtype in ("float32", "float64"):
        g = record.get(f"gradients_{dtype}")
        if g:
            what = (
                f"{g['worst']:.1e} ({g['compared']} tensors, {g['worst_tensor']})"
                if g["stage"] == "done"
                else f"{g['stage']} failed"
            )
            cells.append(f"grad {dtype} {what}")
    t = record.get("training")
    if t:
        cells.append(
            f"train {t['params']}/{t['torch_params']} params, loss diff {t['max_rel_loss_diff']:.1e}, "
            f"params {_fmt(t['params_after']['worst'])}"
        )
        if "running_mean" in t:
            cells.append(
                f"running stats {t['running_stats_updated']}/{t['running_stats_torch']}: "
                f"mean {_fmt(t['running_mean']['worst'])}, "
                f"var {_fmt(t['running_var_onnx_rule']['worst'])} (vs torch's {_fmt(t['running_var_vs_torch']['worst'])})"
            )
        cells.extend(f"\n    note: {note[:220]}" for note in t["notes"])
    g = record.get("gradients_float32") or {}
    if g.get("ort_ok") is False:
        cells.append(f"ONNX Runtime disagrees with torch too (loss {_fmt(g.get('loss_err'))}): the export")
    norms = record.get("batch_norms")
    if record["mode"] == "train" and norms and norms["training_mode"] < norms["nodes"]:
        cells.append(f"{norms['nodes'] - norms['training_mode']}/{norms['nodes']} BatchNormalization exported in inference mode")
    if record.get("export_moved_buffers"):
        cells.append(f"export moved {record['export_moved_buffers']} buffers")
    if record.get("error"):
        cells.append(f"error: {record['error'][:200]}")
    for dtype in ("float32", "float64"):
        error = (record.get(f"gradients_{dtype}") or {}).get("error")
        if error:
            cells.append(f"\n    {dtype}: {error[:300]}")
    return "  ".join(cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"models (default all): {', '.join(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--exporters", default=",".join(EXPORTERS), help=f"comma-separated, of {', '.join(EXPORTERS)}")
    parser.add_argument("--steps", type=int, default=10, help="training steps compared (default 10)")
    parser.add_argument("--adamw", action="store_true", help="train with AdamW (lr 1e-4, weight decay 0.01), not SGD")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    torch.set_num_threads(1)
    _quiet()
    records = []
    for name in args.names or list(MODELS):
        for mode in args.modes.split(","):
            for exporter in args.exporters.split(","):
                record = run(name, mode, exporter, args.steps, args.adamw)
                print(row(record), flush=True)
                records.append(record)
                if args.json:  # after every row: a long sweep keeps what it has
                    hf_models.write_records(args.json, records)
    return 0


def _quiet() -> None:
    """torch.export's registration warnings, once per model, are noise here."""
    import logging

    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    with contextlib.suppress(Exception):
        _import_torchvision()


if __name__ == "__main__":
    raise SystemExit(main())
