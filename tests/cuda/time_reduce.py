"""Times gradgen's CUDA ReduceSum of (64, 256, 56, 56) f32 to (1, 256, 1, 1) against torch.sum in the
same process (CUDA events, median of 50 after warm-up), plus a few other launchers. Not a test:
run it with ``python3 tests/cuda/time_reduce.py`` where a GPU answers."""

from __future__ import annotations

import statistics

import numpy as np
import torch

from gradgen.cuda import runtime as rt
from gradgen.kernels import registry


def median_ms(fn, reps: int = 50, warmup: int = 10, hide_host: bool = True) -> float:
    """Median CUDA-event time of one call. hide_host: a ~2 ms GPU sleep is queued first, so the
    events time the GPU work alone, not the Python launch overhead in front of it."""
    for _ in range(warmup):
        fn()
    rt.synchronize()
    times = []
    for _ in range(reps):
        start, end = rt.driver.Event(), rt.driver.Event()
        if hide_host:
            torch.cuda._sleep(4_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(end.time_since(start))
    return statistics.median(times)


def host_ms(fn, reps: int = 50) -> float:
    """Median wall time of one call as the host sees it, synchronised (launch overhead included)."""
    import time

    fn()
    rt.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        rt.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def back_to_back_ms(fn, reps: int = 50) -> float:
    """Average over ``reps`` calls between one pair of events (host launch overhead overlapped)."""
    fn()
    rt.synchronize()
    start, end = rt.driver.Event(), rt.driver.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return end.time_since(start) / reps


def torch_median_ms(fn, reps: int = 50, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(4_000_000)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda(op):
    registry.load_cuda_kernels()
    return registry.lookup("", op).cuda


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256, 56, 56), dtype=np.float32)
    xd = rt.to_device(x)
    xt = torch.from_numpy(x).cuda()
    axes = np.array([0, 2, 3], np.int64)
    reduce_sum = cuda("ReduceSum")
    got = reduce_sum(xd, axes, keepdims=1).get()
    ref = xt.sum(dim=(0, 2, 3), keepdim=True).cpu().numpy()
    print(f"max |gradgen - torch| = {np.abs(got - ref).max():.3e} (sums of 200704 values)")
    fn = lambda: reduce_sum(xd, axes, keepdims=1)
    ours, ours_plain, ours_b2b, ours_host = median_ms(fn), median_ms(fn, hide_host=False), back_to_back_ms(fn), host_ms(fn)
    tfn = lambda: xt.sum(dim=(0, 2, 3), keepdim=True)
    theirs, theirs_plain = torch_median_ms(tfn), median_ms(tfn, hide_host=False)
    floor = x.nbytes / 2965e9 * 1e3
    print(f"ReduceSum (64,256,56,56)->(1,256,1,1) f32 (median of 50 CUDA-event timings after warm-up):\n"
          f"  gradgen {ours:.4f} ms GPU time ({x.nbytes / ours / 1e6:.0f} GB/s); {ours_plain:.4f} ms with launch "
          f"overhead in the events; {ours_b2b:.4f} ms back to back; {ours_host:.4f} ms host wall\n"
          f"  torch   {theirs:.4f} ms GPU time; {theirs_plain:.4f} ms with launch overhead\n"
          f"  floor   {floor:.4f} ms")

    # a few more launchers against their torch counterparts
    cases = []
    h = rng.standard_normal((8192, 768), dtype=np.float32)
    g, b = np.ones(768, np.float32), np.zeros(768, np.float32)
    hd, gd, bd = rt.to_device(h), rt.to_device(g), rt.to_device(b)
    ht, gt, bt = torch.from_numpy(h).cuda(), torch.from_numpy(g).cuda(), torch.from_numpy(b).cuda()
    ln = cuda("LayerNormalization")
    cases.append(("LayerNormalization (8192,768)", lambda: ln(hd, gd, bd, axis=-1, epsilon=1e-5),
                  lambda: torch.nn.functional.layer_norm(ht, (768,), gt, bt, 1e-5)))
    sm = rng.standard_normal((8192, 1024), dtype=np.float32)
    smd, smt = rt.to_device(sm), torch.from_numpy(sm).cuda()
    softmax = cuda("Softmax")
    cases.append(("Softmax (8192,1024) last axis", lambda: softmax(smd, axis=-1, _opset=13),
                  lambda: torch.softmax(smt, -1)))
    bias_grad = rng.standard_normal((8192, 768), dtype=np.float32)
    bgd, bgt = rt.to_device(bias_grad), torch.from_numpy(bias_grad).cuda()
    ax0 = np.array([0], np.int64)
    cases.append(("ReduceSum (8192,768) axis 0", lambda: reduce_sum(bgd, ax0, keepdims=0),
                  lambda: bgt.sum(0)))
    logits = rng.standard_normal((2048, 50257), dtype=np.float32)
    labels = rng.integers(0, 50257, 2048).astype(np.int64)
    ld, lbd = rt.to_device(logits), rt.to_device(labels)
    lt, lbt = torch.from_numpy(logits).cuda(), torch.from_numpy(labels).cuda()
    sce = cuda("SoftmaxCrossEntropyLoss")
    cases.append(("SoftmaxCrossEntropyLoss (2048,50257) mean", lambda: sce(ld, lbd, reduction="mean"),
                  lambda: torch.nn.functional.cross_entropy(lt, lbt)))
    add = cuda("Add")
    a = rng.standard_normal((64, 256, 56, 56), dtype=np.float32)
    ad, at = rt.to_device(a), torch.from_numpy(a).cuda()
    xd2 = rt.to_device(a)
    cb = rng.standard_normal((256, 1, 1), dtype=np.float32)
    cbd, cbt = rt.to_device(cb), torch.from_numpy(cb).cuda()
    cases.append(("Add (64,256,56,56)+(256,1,1)", lambda: add(ad, cbd), lambda: at + cbt))
    at2 = at.clone()
    cases.append(("Add (64,256,56,56)+(64,256,56,56)", lambda: add(ad, xd2), lambda: at + at2))
    for name, ours_fn, torch_fn in cases:
        print(f"{name}: gradgen {median_ms(ours_fn):.4f} ms GPU ({host_ms(ours_fn):.4f} host wall), "
              f"torch {torch_median_ms(torch_fn):.4f} ms GPU ({host_ms(torch_fn):.4f} host wall)")


if __name__ == "__main__":
    main()
