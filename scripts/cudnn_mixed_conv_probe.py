"""Can cuDNN run bf16-input convolutions with float32 outputs (fprop, dgrad, wgrad), and what do
they cost against bf16 outputs? ResNet-18 layer shapes (batch 32), NCHW and NHWC strides; each
output's largest error relative to a float64 convolution of the same bf16 values.

Usage (a CUDA machine with torch and nvidia-cudnn-frontend)::

    python scripts/cudnn_mixed_conv_probe.py   # prints one JSON line per case; $OUT/conv_mixed_probe.json

Why: ResNet-18's bf16 gradients are judged per tensor against PyTorch autocast's, and rounding every
convolution's output to bf16 is one of the roundings gradgen could drop (docs/BENCHMARKS.md).
"""

import json
import os

import cudnn
import torch

handle = cudnn.create_handle()
BF16, F32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT


def strides(dims, nhwc):
    n, c, h, w = dims
    return [c * h * w, 1, w * c, c] if nhwc else [c * h * w, h * w, w, 1]


def torch_like(t, nhwc):
    return t.contiguous(memory_format=torch.channels_last) if nhwc else t.contiguous()


def build(kind, a_dims, b_dims, out_dims, out_type, nhwc, pad, stride):
    g = cudnn.pygraph(io_data_type=BF16, intermediate_data_type=F32, compute_data_type=F32, handle=handle)
    a = g.tensor(name="A", dim=a_dims, stride=strides(a_dims, nhwc), data_type=BF16)
    b = g.tensor(name="B", dim=b_dims, stride=strides(b_dims, nhwc), data_type=BF16)
    conv = dict(pre_padding=[pad, pad], post_padding=[pad, pad], stride=[stride, stride], dilation=[1, 1], compute_data_type=F32)
    if kind == "fprop":
        y = g.conv_fprop(image=a, weight=b, **conv)
    elif kind == "dgrad":
        y = g.conv_dgrad(loss=a, filter=b, **conv)
    else:
        y = g.conv_wgrad(image=a, loss=b, **conv)
    y.set_output(True).set_data_type(out_type).set_dim(out_dims).set_stride(strides(out_dims, nhwc))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.deselect_numeric_notes([cudnn.numerical_note.NONDETERMINISTIC])
    g.check_support()
    g.build_plans()
    return g, a, b, y


def timed(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(kind, a, b, out_shape, out_type, out_dtype, nhwc, pad, stride, reference) -> dict:
    """One convolution through cuDNN: its time and its error against ``reference``, or why not."""
    try:
        graph, ta, tb, ty = build(kind, list(a.shape), list(b.shape), list(out_shape), out_type, nhwc, pad, stride)
    except Exception as exc:  # noqa: BLE001 -- the answer may be "no engine"
        return {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    out = torch_like(torch.empty(out_shape, device="cuda", dtype=out_dtype), nhwc)
    workspace = torch.empty(max(1, graph.get_workspace_size()), device="cuda", dtype=torch.uint8)
    pointers = {ta: a.data_ptr(), tb: b.data_ptr(), ty: out.data_ptr()}
    ms = timed(lambda: graph.execute(pointers, workspace.data_ptr(), handle=handle))
    error = float((out.double() - reference).abs().max() / reference.abs().max())
    return {"ms": round(ms, 4), "max_rel_err": error}


def main() -> None:
    results = []
    torch.manual_seed(0)
    for n, c, k, hw, pad, stride in [(32, 64, 64, 56, 1, 1), (32, 128, 256, 28, 1, 2), (32, 256, 256, 14, 1, 1)]:
        ho = (hw + 2 * pad - 3) // stride + 1
        x = torch.randn(n, c, hw, hw, device="cuda").to(torch.bfloat16)
        w = (torch.randn(k, c, 3, 3, device="cuda") * 0.05).to(torch.bfloat16)
        dy = torch.randn(n, k, ho, ho, device="cuda").to(torch.bfloat16)
        reference = {
            "fprop": torch.nn.functional.conv2d(x.double(), w.double(), padding=pad, stride=stride),
            "dgrad": torch.nn.grad.conv2d_input((n, c, hw, hw), w.double(), dy.double(), padding=pad, stride=stride),
            "wgrad": torch.nn.grad.conv2d_weight(x.double(), (k, c, 3, 3), dy.double(), padding=pad, stride=stride),
        }
        for nhwc in (False, True):
            xs, ws, dys = torch_like(x, nhwc), torch_like(w, nhwc), torch_like(dy, nhwc)
            operands = {"fprop": (xs, ws, (n, k, ho, ho)), "dgrad": (dys, ws, (n, c, hw, hw)), "wgrad": (xs, dys, (k, c, 3, 3))}
            for kind, (a, b, out_shape) in operands.items():
                row: dict = {"shape": [n, c, k, hw, stride], "nhwc": nhwc, "kind": kind}
                for name, out_type, out_dtype in (("bf16_out", BF16, torch.bfloat16), ("f32_out", F32, torch.float32)):
                    row[name] = measure(kind, a, b, out_shape, out_type, out_dtype, nhwc, pad, stride, reference[kind])
                results.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "conv_mixed_probe.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
