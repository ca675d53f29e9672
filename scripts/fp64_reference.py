"""Which side of an fp32 gradient disagreement is off: gradgen's and PyTorch eager's fp32 gradients
against the same model's float64 gradients.

``gradgen bench --only e2e`` compares gradgen's fp32 gradients with eager's; where the two differ by
more than usual, this tells which of them moved away from the exact values. Run the e2e group with
``--keep DIR`` first; then::

    python scripts/fp64_reference.py DIR [--model resnet18] [--device cuda]

reads DIR's weights (``state.pt``), batch (``inputs-fixed.npz``) and both frameworks' fp32
gradients (``grads-fp32-{gradgen,eager}.npz``), runs the model's forward and backward in float64
with PyTorch, and prints per tensor ``max|g - g_fp64| / max|g_fp64|`` for each framework (the worst
ten of either, and each side's worst).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from gradgen.bench import models, precision


def float64_gradients(directory: Path, name: str, device: str) -> dict[str, np.ndarray]:
    spec = models.preset(name)
    model = models.build_module(spec)
    model.load_state_dict(torch.load(directory / "state.pt", weights_only=True))
    model = model.double().to(device)
    with np.load(directory / "inputs-fixed.npz") as batch:
        inputs = [torch.from_numpy(v.astype(np.float64) if v.dtype.kind == "f" else v).to(device) for v in batch.values()]
    model(*inputs).backward()
    return {n: p.grad.detach().cpu().numpy() for n, p in model.named_parameters() if p.grad is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory", type=Path, help="the --keep directory of a gradgen bench --only e2e run of one model (or its run's folder)"
    )
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    found = sorted(args.directory.glob("**/state.pt"))
    if len(found) != 1:
        parser.error(f"{args.directory} holds {len(found)} runs (state.pt); name the one to check")
    args.directory = found[0].parent
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    reference = float64_gradients(args.directory, args.model, args.device)
    errors = {}
    for framework in ("gradgen", "eager"):
        path = args.directory / f"grads-fp32-{framework}.npz"
        if not path.exists():
            print(f"{framework}: no {path.name}", file=sys.stderr)
            continue
        with np.load(path) as got:
            errors[framework] = precision.relative_errors(got, reference)[0]
    names = sorted({n for e in errors.values() for n in e}, key=lambda n: -max(e.get(n, 0.0) for e in errors.values()))
    print(f"{'tensor':40s} " + " ".join(f"{f:>10s}" for f in errors))
    for n in names[:10]:
        print(f"{n:40s} " + " ".join(f"{e.get(n, float('nan')):10.2e}" for e in errors.values()))
    for framework, e in errors.items():
        worst = max(e, key=e.__getitem__)
        print(f"{framework}: worst {e[worst]:.2e} ({worst}), median {np.median(list(e.values())):.2e} over {len(e)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
