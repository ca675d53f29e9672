"""The GPU kernel groups of ``gradgen bench`` (slice, gather, gather_elements, reduce, bga, conv) and the
small samples' training step (step): gradgen against PyTorch in the same process."""

from __future__ import annotations

import statistics
import time

import numpy as np


def _timer(fn, *, reps: int = 50, warmup: int = 5, before=None) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event timings (default stream) after ``warmup``
    calls; ``before()``, when given, runs before each start event."""
    from pycuda import driver

    from gradgen.cuda import runtime as rt  # noqa: F401  (makes the primary context current)

    for _ in range(warmup):
        fn()
    driver.Context.synchronize()
    start, end = driver.Event(), driver.Event()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.time_till(end))
    return statistics.median(times)


def _gpu_ms(fn, *, reps: int = 50, warmup: int = 5) -> float | None:
    """Median GPU time of ``fn()`` with its host launch overhead hidden: a ~2 ms GPU sleep (PyTorch's)
    is queued before the start event, so the events time the queued GPU work alone. None without
    PyTorch. Calls that synchronise inside (flag checks) still show the host time after their sync."""
    torch = _torch()
    if torch is None:
        return None
    return _timer(fn, reps=reps, warmup=warmup, before=lambda: torch.cuda._sleep(2_000_000))


def _host_us(fn, *, reps: int = 50) -> float:
    """Median host time of one call in microseconds (launches are asynchronous; syncs inside count)."""
    from pycuda import driver

    fn()
    driver.Context.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        driver.Context.synchronize()
    return statistics.median(times) * 1e6


def _detail(label: str, fn) -> None:
    gpu = _gpu_ms(fn)
    gpu_text = "n/a" if gpu is None else f"{gpu:.4f} ms"
    print(f"  [{label}] GPU time with host overhead hidden {gpu_text}; host time per call {_host_us(fn):.1f} us", flush=True)


# ---------------------------------------------------------------------------------------------
# ConvGrad and full training steps (GPU; PyTorch for the reference timings)


def bench_conv_grad(warmup: int = 10, iters: int = 50, rounds: int = 3) -> dict:
    """ConvGrad N=32, C=K=256, 14x14, 3x3, pad 1, float32 (dX + dW + dB) against PyTorch's
    aten.convolution_backward, without TF32 (and, for reference, with it on both sides).

    Each variant is timed ``rounds`` times, interleaved with PyTorch, and the best median is kept;
    the dX / dW / dB parts are timed alone too.
    """
    import os
    import time

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
    attrs = dict(pads=[1, 1, 1, 1], strides=[1, 1], dilations=[1, 1], group=1)
    geom = conv._Geometry(gx.shape, gw.shape, attrs)

    def ours():
        conv.conv_grad(gdy, gx, gw, **attrs)

    def theirs(mask=(True, True, True)):
        return lambda: torch.ops.aten.convolution_backward(
            tdy, tx, tw, [256], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, list(mask)
        )

    env_keys = ("GRADGEN_ALLOW_TF32", "GRADGEN_ALLOW_NONDETERMINISTIC", "GRADGEN_CUDNN_BENCHMARK")
    saved = {k: os.environ.get(k) for k in env_keys}

    def set_env(env):
        for key in env_keys:
            os.environ.pop(key, None)
        os.environ.update(env)
        conv._GRAPHS.clear()
        conv._STATE.pop("autotune_error", None)

    variants = [  # (label, environment, ordered execute, concurrent streams, direct backend call)
        ("gradgen deterministic, autotuned (default)", {}, True, False, True),
        ("gradgen deterministic, two streams", {}, True, True, True),
        ("gradgen deterministic, pygraph execute", {}, True, False, False),
        ("gradgen deterministic, cuDNN heuristics", {"GRADGEN_CUDNN_BENCHMARK": "0"}, True, False, True),
        (
            "gradgen non-deterministic allowed, heuristics",
            {"GRADGEN_ALLOW_NONDETERMINISTIC": "1", "GRADGEN_CUDNN_BENCHMARK": "0"},
            True,
            False,
            True,
        ),
        ("gradgen non-det., autotuned", {"GRADGEN_ALLOW_NONDETERMINISTIC": "1"}, True, False, True),
    ]
    results, notes = {}, {}
    try:
        torch.backends.cudnn.allow_tf32 = False
        torch_ms = []
        for label, env, fast, concurrent, native in variants:
            set_env(env)
            conv.FAST_EXECUTE, conv.CONCURRENT, conv.NATIVE_EXECUTE = fast, concurrent, native
            best = None
            for _ in range(rounds):
                torch_ms.append(_timer(theirs(), reps=iters, warmup=warmup))
                ms = _timer(ours, reps=iters, warmup=warmup)
                best = ms if best is None else min(best, ms)
            results[label] = best
            t0 = time.perf_counter()
            for _ in range(20):
                ours()
            host = (time.perf_counter() - t0) / 20 * 1e3
            rt.synchronize()
            notes[label] = f"host {host:.3f} ms/call; "
            notes[label] += "; ".join(
                f"{k[0]}: {p.name()} ({p.note}{', direct call' if p._native else ''})"
                for k, p in conv._GRAPHS.items()
                if p is not None
            )
            if "autotune_error" in conv._STATE:
                notes[label] += f"; autotune failed: {conv._STATE['autotune_error'][:300]}"
        conv.FAST_EXECUTE, conv.CONCURRENT, conv.NATIVE_EXECUTE = True, False, True
        results["pytorch (no TF32)"] = min(torch_ms)
        set_env({})
        parts = {
            "  gradgen dX only": lambda: conv._dgrad(gdy, gw, geom),
            "  gradgen dW only": lambda: conv._wgrad(gdy, gx, geom),
            "  gradgen dB only": lambda: conv.channel_sum(gdy),
            "  pytorch dX only": theirs((True, False, False)),
            "  pytorch dW only": theirs((False, True, False)),
            "  pytorch dB only": theirs((False, False, True)),
        }
        for label, fn in parts.items():
            results[label] = _timer(fn, reps=iters, warmup=warmup)
        for _ in range(5):
            ours()
        rt.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            ours()
        host = (time.perf_counter() - t0) / 20 * 1e3
        rt.synchronize()
        fn = theirs()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        torch_host = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        notes["host"] = f"host time per call (async): gradgen {host:.3f} ms, PyTorch {torch_host:.3f} ms"
        torch.backends.cudnn.allow_tf32 = True
        results["pytorch (TF32)"] = _timer(theirs(), reps=iters, warmup=warmup)
        set_env({"GRADGEN_ALLOW_TF32": "1"})
        results["gradgen (TF32)"] = _timer(ours, reps=iters, warmup=warmup)
    finally:
        torch.backends.cudnn.allow_tf32 = False
        conv.FAST_EXECUTE, conv.CONCURRENT, conv.NATIVE_EXECUTE = True, False, True
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        conv._GRAPHS.clear()
    base = results["pytorch (no TF32)"]
    print("ConvGrad N=32 C=K=256 14x14 3x3 pad 1 f32 (dX+dW+dB), median of 50 CUDA-event timings (best of rounds):")
    for label, ms in results.items():
        ref = results.get("pytorch (TF32)", base) if label.endswith("(TF32)") else base
        ratio = "" if label.startswith("  ") else f"   speed vs PyTorch {ref / ms:5.2f}x"
        print(f"  {label:44s} {ms:8.3f} ms{ratio}")
    for label, note in notes.items():
        print(f"  [{label}] {note}")
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

        return {
            "x": torch.from_numpy(rng.standard_normal((batch, 1, 14, 14)).astype("float32")),
            "labels": torch.from_numpy(rng.integers(0, 10, batch).astype("int64")),
        }


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

        return {
            "x": torch.from_numpy(rng.standard_normal((batch, seq, 16)).astype("float32")),
            "labels": torch.from_numpy(rng.integers(0, 4, batch).astype("int64")),
        }


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
    with torch.no_grad():  # no two parameters equal (the exporter would merge equal initializers)
        for p in model.parameters():
            p.add_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype("float32")) * 0.1)
    inputs = family.inputs(batch, rng)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            tuple(inputs.values()),
            buf,
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.PRESERVE,
            input_names=list(inputs),
            output_names=["loss", "logits"],
        )
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
    ms_ours = _timer(ours, reps=iters, warmup=warmup)
    ms_theirs = _timer(theirs, reps=iters, warmup=warmup)
    steps = len(session.steps)
    print(
        f"full step {name} batch {batch}: gradgen {ms_ours:.3f} ms ({steps} steps), PyTorch eager {ms_theirs:.3f} ms, "
        f"speed vs PyTorch {ms_theirs / ms_ours:.2f}x; max relative gradient difference {worst:.2e}"
    )
    for message in fallbacks:
        print(f"  fallback: {message}")
    return {"gradgen_ms": ms_ours, "pytorch_ms": ms_theirs, "steps": steps, "max_rel_diff": worst, "fallbacks": fallbacks}


# ---------------------------------------------------------------------------------------------
# The data-movement / scatter gradient kernels (SliceGrad, GatherGrad, GatherElementsGrad,
# BroadcastGradientArgs) on the shapes of ORT_CONTRACTS.md "Numbers to beat": gradgen's launcher
# and the PyTorch equivalent in one process, median of CUDA-event timings after warm-up; each
# prints ms, GB/s, the floor (bytes moved / copy bandwidth) and the speedup, and returns rows.

COPY_BANDWIDTH_GBS = 2965.0  # measured device-to-device copy bandwidth of the H100 (bytes read + written)


def _row(work: str, variant: str, ms: float, nbytes: int, reference_ms: float | None = None) -> dict:
    floor = nbytes / (COPY_BANDWIDTH_GBS * 1e9) * 1e3
    row = {
        "work": work,
        "variant": variant,
        "ms": ms,
        "GB/s": nbytes / (ms * 1e-3) / 1e9,
        "floor_ms": floor,
        "floor_ratio": floor / ms,
    }
    if reference_ms is not None:
        row["speedup"] = reference_ms / ms
    return row


def _print(rows: list[dict]) -> None:
    for r in rows:
        extra = f"  speedup {r['speedup']:.2f}x" if "speedup" in r else ""
        print(
            f"{r['work']:<20} {r['variant']:<34} {r['ms']:8.4f} ms  {r['GB/s']:7.0f} GB/s  "
            f"floor {r['floor_ms']:.4f} ms ({100 * r['floor_ratio']:.0f}% of it){extra}",
            flush=True,
        )


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def bench_slice_grad(reps: int = 50) -> list[dict]:
    """SliceGrad: X (64,1024,1024) f32, slice [:, 256:768, ::2] (torch: zeros + strided copy_)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.shape import slice_grad

    shape = (64, 1024, 1024)
    dy_host = np.random.default_rng(0).standard_normal((64, 512, 512)).astype(np.float32)
    dy = rt.to_device(dy_host)
    args = (
        np.array(shape, np.int64),
        np.array([256, 0], np.int64),
        np.array([768, 1024], np.int64),
        np.array([1, 2], np.int64),
        np.array([1, 2], np.int64),
    )
    nbytes = 4 * (np.prod(shape) + dy_host.size)
    rows, ref = [], None
    torch = _torch()
    if torch is not None:
        tdy = torch.from_numpy(dy_host).cuda()

        def torch_fn():
            dx = torch.zeros(shape, device="cuda")
            dx[:, 256:768, ::2] = tdy
            return dx

        ref = _timer(torch_fn, reps=reps)
        rows.append(_row("SliceGrad", "torch zeros + copy_", ref, nbytes))
        got = slice_grad(dy, *args).get()
        assert np.array_equal(got, torch_fn().cpu().numpy()), "SliceGrad differs from torch"
    rows.append(_row("SliceGrad", "gradgen (one pass)", _timer(lambda: slice_grad(dy, *args), reps=reps), nbytes, ref))
    _print(rows)
    _detail("gradgen SliceGrad", lambda: slice_grad(dy, *args))
    if torch is not None:
        _detail("torch zeros + copy_", torch_fn)
    return rows


def bench_gather_grad(reps: int = 50) -> list[dict]:
    """GatherGrad: embedding 50257x768 f32, 16384 int64 ids, a quarter drawn from 100 hot ids."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.indexing import gather_grad

    rng = np.random.default_rng(0)
    vocab, dim, n = 50257, 768, 16384
    hot = rng.integers(0, vocab, 100)
    ids = np.concatenate([rng.choice(hot, n // 4), rng.integers(0, vocab, n - n // 4)]).astype(np.int64)
    rng.shuffle(ids)
    dy_host = rng.standard_normal((n, dim)).astype(np.float32)
    dy, idx = rt.to_device(dy_host), rt.to_device(ids)
    shape = np.array([vocab, dim], np.int64)
    nbytes = 4 * (vocab * dim + n * dim) + 8 * n
    rows, ref = [], None
    torch = _torch()
    ours = gather_grad(shape, idx, dy).get()
    assert np.array_equal(ours, gather_grad(shape, idx, dy).get()), "GatherGrad is not bit-identical across runs"
    if torch is not None:
        tdy, tids = torch.from_numpy(dy_host).cuda(), torch.from_numpy(ids).cuda()
        atomic = _timer(lambda: torch.zeros(vocab, dim, device="cuda").index_add_(0, tids, tdy), reps=reps)
        rows.append(_row("GatherGrad", "torch index_add_ (atomic)", atomic, nbytes))
        ref = _timer(lambda: torch.ops.aten.embedding_dense_backward(tdy, tids, vocab, -1, False), reps=reps)
        rows.append(_row("GatherGrad", "torch embedding_dense_backward", ref, nbytes))
        want = torch.ops.aten.embedding_dense_backward(tdy, tids, vocab, -1, False).cpu().numpy()
        assert np.allclose(ours, want, rtol=1e-4, atol=1e-4), "GatherGrad differs from torch"
    ms = _timer(lambda: gather_grad(shape, idx, dy), reps=reps)
    rows.append(_row("GatherGrad", "gradgen (deterministic)", ms, nbytes, ref))
    if torch is not None:
        rows[-1]["speedup_vs_index_add"] = atomic / ms
        print(f"GatherGrad: gradgen vs index_add_ {atomic / ms:.2f}x, vs embedding_dense_backward {ref / ms:.2f}x")
    _print(rows)
    _detail("gradgen GatherGrad", lambda: gather_grad(shape, idx, dy))
    narrow = rt.to_device(dy_host[:, :1].copy())
    _detail(
        "gradgen GatherGrad, inner 1 (about the index scan alone)",
        lambda: gather_grad(np.array([vocab, 1], np.int64), idx, narrow),
    )
    if torch is not None:
        _detail("torch index_add_", lambda: torch.zeros(vocab, dim, device="cuda").index_add_(0, tids, tdy))
    return rows


def bench_gather_elements_grad(reps: int = 50) -> list[dict]:
    """GatherElementsGrad: data (4096,4096) f32, indices (4096,1024) int64, axis 1 (torch: zeros + scatter_add_)."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels.cuda.indexing import gather_elements_grad

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 4096, (4096, 1024)).astype(np.int64)
    dy_host = rng.standard_normal((4096, 1024)).astype(np.float32)
    dy, idx = rt.to_device(dy_host), rt.to_device(ids)
    shape = np.array([4096, 4096], np.int64)
    nbytes = 4 * (4096 * 4096 + dy_host.size) + 8 * ids.size
    rows, ref = [], None
    torch = _torch()
    ours = gather_elements_grad(dy, shape, idx, axis=1, deterministic=True).get()
    assert np.array_equal(ours, gather_elements_grad(dy, shape, idx, axis=1, deterministic=True).get()), (
        "GatherElementsGrad is not bit-identical across runs"
    )
    if torch is not None:
        tdy, tids = torch.from_numpy(dy_host).cuda(), torch.from_numpy(ids).cuda()
        ref = _timer(lambda: torch.zeros(4096, 4096, device="cuda").scatter_add_(1, tids, tdy), reps=reps)
        rows.append(_row("GatherElementsGrad", "torch zeros + scatter_add_", ref, nbytes))
        want = torch.zeros(4096, 4096, device="cuda").scatter_add_(1, tids, tdy).cpu().numpy()
        assert np.allclose(ours, want, rtol=1e-4, atol=1e-4), "GatherElementsGrad differs from torch"
    for variant, det in (("gradgen (deterministic)", True), ("gradgen (atomic)", False)):
        ms = _timer(lambda det=det: gather_elements_grad(dy, shape, idx, axis=1, deterministic=det), reps=reps)
        rows.append(_row("GatherElementsGrad", variant, ms, nbytes, ref))
    _print(rows)
    _detail("gradgen GatherElementsGrad deterministic", lambda: gather_elements_grad(dy, shape, idx, axis=1, deterministic=True))
    if torch is not None:
        _detail("torch zeros + scatter_add_", lambda: torch.zeros(4096, 4096, device="cuda").scatter_add_(1, tids, tdy))
    return rows


def bench_broadcast_gradient_args(reps: int = 1000) -> list[dict]:
    """BroadcastGradientArgs runs on the host (shapes live there): microseconds per call."""
    from gradgen.kernels.cuda.elementwise import broadcast_gradient_args

    a, b = np.array([2, 16, 1, 1024], np.int64), np.array([1, 1, 1024, 1024], np.int64)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        broadcast_gradient_args(a, b)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    row = {"work": "BroadcastGradientArgs", "variant": "gradgen (host)", "ms": ms}
    print(f"{'BroadcastGradientArgs':<20} {'gradgen (host, no device trip)':<34} {ms * 1e3:8.2f} us", flush=True)
    return [row]


def bench_broadcast_reduction(reps: int = 50) -> list[dict]:
    """ReduceSum of (64,256,56,56) f32 to (1,256,1,1) against torch.sum (GPU time with the host launch
    hidden, and the plain event timing), plus a few other launchers against their PyTorch counterparts."""
    from gradgen.cuda import runtime as rt
    from gradgen.kernels import registry

    registry.load_cuda_kernels()

    def cuda(op):
        return registry.lookup("", op).cuda

    torch = _torch()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256, 56, 56), dtype=np.float32)
    xd = rt.to_device(x)
    axes = np.array([0, 2, 3], np.int64)
    reduce_sum = cuda("ReduceSum")
    ours = lambda: reduce_sum(xd, axes, keepdims=1)
    rows, ref = [], None
    if torch is not None:
        xt = torch.from_numpy(x).cuda()
        theirs = lambda: xt.sum(dim=(0, 2, 3), keepdim=True)
        got, want = ours().get(), theirs().cpu().numpy()
        print(f"ReduceSum: max |gradgen - torch| = {np.abs(got - want).max():.3e} (sums of 200704 values)")
        ref = _gpu_ms(theirs, reps=reps)
        rows.append(_row("ReduceSum", "torch.sum (GPU time)", ref, x.nbytes))
        rows.append(_row("ReduceSum", "torch.sum (plain events)", _timer(theirs, reps=reps), x.nbytes))
        rows.append(_row("ReduceSum", "gradgen (GPU time)", _gpu_ms(ours, reps=reps), x.nbytes, ref))
    rows.append(
        _row("ReduceSum", "gradgen (plain events)", _timer(ours, reps=reps), x.nbytes, None if torch is None else rows[1]["ms"])
    )
    _print(rows)
    print(
        f"  [ReduceSum] host time per call: gradgen {_host_us(ours):.1f} us"
        + ("" if torch is None else f", torch {_host_us(theirs):.1f} us")
    )
    if torch is None:
        return rows
    cases = []
    h = rng.standard_normal((8192, 768), dtype=np.float32)
    g, b = np.ones(768, np.float32), np.zeros(768, np.float32)
    hd, gd, bd = rt.to_device(h), rt.to_device(g), rt.to_device(b)
    ht, gt, bt = torch.from_numpy(h).cuda(), torch.from_numpy(g).cuda(), torch.from_numpy(b).cuda()
    ln = cuda("LayerNormalization")
    cases.append(
        (
            "LayerNormalization (8192,768)",
            lambda: ln(hd, gd, bd, axis=-1, epsilon=1e-5),
            lambda: torch.nn.functional.layer_norm(ht, (768,), gt, bt, 1e-5),
            2 * h.nbytes,
        )
    )
    sm = rng.standard_normal((8192, 1024), dtype=np.float32)
    smd, smt = rt.to_device(sm), torch.from_numpy(sm).cuda()
    softmax = cuda("Softmax")
    cases.append(
        ("Softmax (8192,1024) last axis", lambda: softmax(smd, axis=-1, _opset=13), lambda: torch.softmax(smt, -1), 2 * sm.nbytes)
    )
    bgd, bgt = rt.to_device(h), ht
    ax0 = np.array([0], np.int64)
    cases.append(("ReduceSum (8192,768) axis 0", lambda: reduce_sum(bgd, ax0, keepdims=0), lambda: bgt.sum(0), h.nbytes))
    logits = rng.standard_normal((2048, 50257), dtype=np.float32)
    labels = rng.integers(0, 50257, 2048).astype(np.int64)
    ld, lbd = rt.to_device(logits), rt.to_device(labels)
    lt, lbt = torch.from_numpy(logits).cuda(), torch.from_numpy(labels).cuda()
    sce = cuda("SoftmaxCrossEntropyLoss")
    cases.append(
        (
            "SoftmaxCrossEntropyLoss (2048,50257)",
            lambda: sce(ld, lbd, reduction="mean"),
            lambda: torch.nn.functional.cross_entropy(lt, lbt),
            logits.nbytes,
        )
    )
    add = cuda("Add")
    cb = rng.standard_normal((256, 1, 1), dtype=np.float32)
    cbd, cbt = rt.to_device(cb), torch.from_numpy(cb).cuda()
    cases.append(("Add (64,256,56,56)+(256,1,1)", lambda: add(xd, cbd), lambda: xt + cbt, 2 * x.nbytes))
    x2d, x2t = rt.to_device(x), xt.clone()
    cases.append(("Add (64,256,56,56)+same", lambda: add(xd, x2d), lambda: xt + x2t, 3 * x.nbytes))
    for name, ours_fn, torch_fn, nbytes in cases:
        try:
            theirs_ms = _gpu_ms(torch_fn, reps=reps)
            case_rows = [
                _row(name, "torch (GPU time)", theirs_ms, nbytes),
                _row(name, "gradgen (GPU time)", _gpu_ms(ours_fn, reps=reps), nbytes, theirs_ms),
            ]
            _print(case_rows)
            print(f"  [{name}] host time per call: gradgen {_host_us(ours_fn):.1f} us, torch {_host_us(torch_fn):.1f} us")
            rows += case_rows
        except Exception as exc:  # noqa: BLE001 - one failing launcher should not hide the rest
            print(f"{name}: failed: {type(exc).__name__}: {exc}")
    return rows
