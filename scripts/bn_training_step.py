"""ResNet-18 with BatchNormalization in training mode (batch statistics), as a user who trains
exports it: one forward + backward step of gradgen on the GPU against PyTorch eager in train mode.

``gradgen bench``'s end-to-end group exports its models in eval mode; this measures the other form.
``--fallback`` runs training-mode BatchNormalization through the numpy kernel, as the CUDA backend
did before it had a device path, for a before / after in one process. ``--composed`` builds the
training-mode gradient from standard ops (batch statistics recomputed in the backward), the form
before the default build wrote ONNX Runtime training's BatchNormInternal / BatchNormalizationGrad.

    python scripts/bn_training_step.py [--batch 32] [--size 224] [--steps 20] [--fallback | --eval | --composed] [--profile]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fallback", action="store_true", help="training-mode BatchNormalization through the numpy kernel")
    parser.add_argument("--eval", action="store_true", help="export in eval mode (running statistics) instead")
    parser.add_argument("--composed", action="store_true", help="the training-mode gradient from standard ops")
    parser.add_argument("--profile", action="store_true", help="also print GPU time by op and by kernel (torch.profiler)")
    args = parser.parse_args()

    import torch

    import gradgen
    from gradgen.bench.measure import median, time_steps
    from gradgen.bench.models import build_module, export, make_inputs, parameter_names, preset
    from gradgen.executor import Session

    if args.fallback:
        from gradgen.kernels.cuda import launch, norm

        def on_the_host(x, params, suffix, epsilon, momentum, legacy_outputs):
            attrs = dict(epsilon=epsilon, momentum=momentum, training_mode=0 if legacy_outputs else 1)
            return launch.cpu_fallback("BatchNormalization", x, *params, **attrs, _num_outputs=5 if legacy_outputs else 3)

        norm._batch_norm_training = on_the_host

    if args.composed:
        from gradgen.grads.rules import norm as norm_rules

        norm_rules._saved_batch_stats_fit = lambda *_: False

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 against float32, as gradgen bench compares
    torch.backends.cudnn.allow_tf32 = False
    spec = preset("resnet18", batch=args.batch, size=args.size)
    model = build_module(spec).train(not args.eval)
    inputs = make_inputs(spec)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    proto = export(model, inputs)
    model.load_state_dict(state)  # the export's trace updated the running statistics
    built = gradgen.build_backward(proto, wrt=parameter_names(model))
    session = Session(built.model, device="cuda")

    def gradgen_step() -> float:
        return float(session.run(inputs, outputs=[built.loss])[built.loss])

    t0 = time.perf_counter()
    loss = gradgen_step()
    first = time.perf_counter() - t0
    times = time_steps(gradgen_step, warmup=3, steps=args.steps)

    model = model.cuda()
    params = list(model.parameters())
    host = {k: torch.from_numpy(v) for k, v in inputs.items()}

    def torch_step() -> float:
        for p in params:
            p.grad = None
        out = model(*(t.cuda() for t in host.values()))
        out.backward()
        value = out.item()
        torch.cuda.synchronize()
        return value

    torch.manual_seed(0)
    torch_loss = torch_step()
    torch_times = time_steps(torch_step, warmup=3, steps=args.steps)
    mode = "eval mode" if args.eval else "numpy fallback" if args.fallback else "composed gradient" if args.composed else "device"
    torch_mode = "eval" if args.eval else "train"
    bn = "BatchNormalization" if args.eval else "BatchNormalization in training mode"
    ratio = median(times) / median(torch_times)
    print(
        f"ResNet-18 B={args.batch} {args.size}x{args.size}, {bn} ({mode}), "
        f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(f"  gradgen: first step {first:.2f} s, median {median(times):.2f} ms; loss {loss:.6f}")
    print(f"  PyTorch eager ({torch_mode} mode): median {median(torch_times):.2f} ms; loss {torch_loss:.6f}")
    print(f"  gradgen / eager: {ratio:.2f}x; loss difference {abs(loss - torch_loss):.2e}")
    assert np.isfinite(loss)
    if args.profile:
        import tempfile

        import onnx_ir

        from gradgen.bench.worker import job_gradgen_profile

        del session
        with tempfile.TemporaryDirectory() as tmp:
            onnx_ir.save(built.model, f"{tmp}/model.onnx")
            np.savez(f"{tmp}/inputs.npz", **inputs)
            job_gradgen_profile({"model": f"{tmp}/model.onnx", "inputs": f"{tmp}/inputs.npz", "loss": built.loss})


if __name__ == "__main__":
    main()
