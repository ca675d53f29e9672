"""Benchmarks of gradgen kernels and training steps against PyTorch (run on a GPU machine)."""

from __future__ import annotations


# ---------------------------------------------------------------------------------------------
# ConvGrad and full training steps (GPU; PyTorch for the reference timings)


def _cuda_median_ms(fn, warmup: int = 10, iters: int = 50) -> float:
    """Median over ``iters`` runs of ``fn`` timed with CUDA events on the default stream."""
    import statistics

    import pycuda.driver as driver

    for _ in range(warmup):
        fn()
    driver.Context.synchronize()
    start, stop = driver.Event(), driver.Event()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(stop.time_since(start))
    return statistics.median(times)


def bench_conv_grad(warmup: int = 10, iters: int = 50) -> dict:
    """ConvGrad N=32, C=K=256, 14x14, 3x3, pad 1, float32 (dX + dW + dB) against PyTorch's
    aten.convolution_backward, without TF32 (and, for reference, with it on both sides)."""
    import os

    import numpy as np
    import torch

    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda import conv

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 256, 14, 14)).astype(np.float32)
    w = (rng.standard_normal((256, 256, 3, 3)) * 0.05).astype(np.float32)
    dy = rng.standard_normal((32, 256, 14, 14)).astype(np.float32)
    gx, gw, gdy = rt.to_device(x), rt.to_device(w), rt.to_device(dy)
    tx, tw, tdy = (torch.from_numpy(a).cuda() for a in (x, w, dy))

    def ours():
        conv.conv_grad(gdy, gx, gw, pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)

    def theirs():
        torch.ops.aten.convolution_backward(tdy, tx, tw, [256], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                            [True, True, True])

    results = {}
    saved = {k: os.environ.get(k) for k in ("GRADGEN_ALLOW_TF32", "GRADGEN_ALLOW_NONDETERMINISTIC",
                                            "GRADGEN_CUDNN_BENCHMARK")}
    variants = [
        ("gradgen (deterministic, no TF32)", {}),
        ("gradgen (deterministic, autotuned)", {"GRADGEN_CUDNN_BENCHMARK": "1"}),
        ("gradgen (non-deterministic allowed)", {"GRADGEN_ALLOW_NONDETERMINISTIC": "1"}),
        ("gradgen (non-deterministic, autotuned)", {"GRADGEN_ALLOW_NONDETERMINISTIC": "1", "GRADGEN_CUDNN_BENCHMARK": "1"}),
    ]
    try:
        torch.backends.cudnn.allow_tf32 = False
        results["pytorch (no TF32)"] = _cuda_median_ms(theirs, warmup, iters)
        for label, env in variants:
            for key in saved:
                os.environ.pop(key, None)
            os.environ.update(env)
            conv._GRAPHS.clear()
            results[label] = _cuda_median_ms(ours, warmup, iters)
        for key in saved:
            os.environ.pop(key, None)
        torch.backends.cudnn.allow_tf32 = True
        results["pytorch (TF32)"] = _cuda_median_ms(theirs, warmup, iters)
        os.environ["GRADGEN_ALLOW_TF32"] = "1"
        conv._GRAPHS.clear()
        results["gradgen (TF32)"] = _cuda_median_ms(ours, warmup, iters)
    finally:
        torch.backends.cudnn.allow_tf32 = False
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        conv._GRAPHS.clear()
    base = results["pytorch (no TF32)"]
    print("ConvGrad N=32 C=K=256 14x14 3x3 pad 1 f32 (dX+dW+dB), median of CUDA-event timings:")
    for label, ms in results.items():
        ref = results["pytorch (TF32)"] if "TF32)" in label and "no TF32" not in label else base
        print(f"  {label:42s} {ms:8.3f} ms   speed vs PyTorch {ref / ms:5.2f}x")
    return results


class _BenchLeNet:
    """The cnn sample's model (samples/make_samples.py: LeNet-style, 1x14x14 images, 10 classes)."""

    @staticmethod
    def make():
        import torch
        import torch.nn as nn
        import torch.nn.functional as F

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

        return LeNet()

    @staticmethod
    def inputs(batch, rng):
        import torch

        return {"x": torch.from_numpy(rng.standard_normal((batch, 1, 14, 14)).astype("float32")),
                "labels": torch.from_numpy(rng.integers(0, 10, batch).astype("int64"))}


class _BenchTransformer:
    """The transformer sample's model (nn.TransformerEncoderLayer d_model 16, 2 heads, mean pool, Linear)."""

    @staticmethod
    def make():
        import torch.nn as nn
        import torch.nn.functional as F

        class TransformerModel(nn.Module):
            def __init__(self, d=16, classes=4):
                super().__init__()
                self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
                self.head = nn.Linear(d, classes)

            def forward(self, x, labels):
                h = self.layer(x)
                logits = self.head(h.mean(dim=1))
                return F.cross_entropy(logits, labels), logits

        return TransformerModel()

    @staticmethod
    def inputs(batch, rng, seq=128):
        import torch

        return {"x": torch.from_numpy(rng.standard_normal((batch, seq, 16)).astype("float32")),
                "labels": torch.from_numpy(rng.integers(0, 4, batch).astype("int64"))}


def bench_full_step(name: str = "cnn", batch: int | None = None, warmup: int = 5, iters: int = 50) -> dict:
    """One forward + backward step of a sample model: gradgen's backward graph on Session(device="cuda")
    against the same model (same weights) in PyTorch eager (forward + loss.backward()).

    The model is exported at the requested batch with PyTorch's legacy exporter (the samples'
    settings), so the shapes are static: cnn at 64 images, transformer at 16 sequences of 128 tokens
    by default.
    """
    import io
    import warnings

    import numpy as np
    import onnx
    import torch

    import gradgen
    from gradgen.executor import Session

    families = {"cnn": (_BenchLeNet, 64), "transformer": (_BenchTransformer, 16)}
    if name not in families:
        raise ValueError(f"unknown model {name!r}: choose {', '.join(families)}")
    family, default_batch = families[name]
    batch = batch or default_batch
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = family.make().eval()
    inputs = family.inputs(batch, rng)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(inputs.values()), buf, dynamo=False, opset_version=17,
                          do_constant_folding=False, training=torch.onnx.TrainingMode.PRESERVE,
                          input_names=list(inputs), output_names=["loss", "logits"])
    built = gradgen.build_backward(onnx.load_from_string(buf.getvalue()))
    feeds = {k: v.numpy() for k, v in inputs.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = Session(built.model, device="cuda")
        session.run(feeds)
    fallbacks = sorted({str(w.message) for w in caught if "CPU" in str(w.message) or "numpy" in str(w.message)})

    def ours():
        session.run(feeds, outputs=["loss"])

    cuda_model = model.cuda().train()
    cuda_inputs = {k: v.cuda() for k, v in inputs.items()}
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    def theirs():
        for p in cuda_model.parameters():
            p.grad = None
        loss, _ = cuda_model(*cuda_inputs.values())
        loss.backward()

    # Agreement check: gradgen's gradients against PyTorch's, once.
    theirs()
    got = session.run(feeds)
    params = dict(cuda_model.named_parameters())
    worst = 0.0
    for grad_name in built.gradient_names:
        key = grad_name[: -len("_grad")]
        if key in params and params[key].grad is not None and grad_name in got:
            want = params[key].grad.detach().cpu().numpy()
            worst = max(worst, float(np.abs(got[grad_name] - want).max() / (np.abs(want).max() + 1e-12)))
    ms_ours = _cuda_median_ms(ours, warmup, iters)
    ms_theirs = _cuda_median_ms(theirs, warmup, iters)
    steps = len(session.steps)
    print(f"full step {name} batch {batch}: gradgen {ms_ours:.3f} ms ({steps} steps), PyTorch eager {ms_theirs:.3f} ms, "
          f"speed vs PyTorch {ms_theirs / ms_ours:.2f}x; max relative gradient difference {worst:.2e}")
    for message in fallbacks:
        print(f"  fallback: {message}")
    return {"gradgen_ms": ms_ours, "pytorch_ms": ms_theirs, "steps": steps, "max_rel_diff": worst,
            "fallbacks": fallbacks}
