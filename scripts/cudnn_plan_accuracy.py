"""How accurate each cuDNN engine is: every float32 plan gradgen's convolution launcher may time
(deterministic, no TF32), run on ResNet-18's 3x3 geometries, against a float64 reference, with its
time and the numerical notes cuDNN gives it (reduced-precision reduction, Winograd, FFT).

gradgen's launcher keeps the fastest plan; if that is a Winograd or FFT engine its float32 results
can be far less exact than the heuristic choice (a ResNet-18 fp32 step differed from eager by
6e-4 on one tensor with the tuned plans and 4e-6 with the heuristic ones). Needs a GPU, PyTorch
and nvidia-cudnn-frontend::

    python scripts/cudnn_plan_accuracy.py [--batch 32]
"""

from __future__ import annotations

import argparse
import sys

import torch

# (channels, side, stride) of ResNet-18's 3x3 convolutions at 224x224
GEOMETRIES = [(64, 56, 1), (128, 28, 1), (256, 14, 1), (512, 7, 1), (128, 56, 2)]
NOTE_NAMES = ("REDUCED_PRECISION_REDUCTION", "FFT", "WINOGRAD", "WINOGRAD_TILE_4x4", "WINOGRAD_TILE_6x6", "WINOGRAD_TILE_13x13")


def _graph(cudnn, handle, kind, x_dims, w_dims, y_dims, stride, excluded):
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def tensor(name, dims):
        strides = [int(s) for s in torch.empty(dims).stride()]
        return graph.tensor(name=name, dim=list(dims), stride=strides, data_type=f32)

    conv = dict(pre_padding=[1, 1], post_padding=[1, 1], stride=[stride, stride], dilation=[1, 1], compute_data_type=f32)
    if kind == "fprop":
        a, b, out_dims = tensor("X", x_dims), tensor("W", w_dims), y_dims
        out = graph.conv_fprop(image=a, weight=b, **conv)
    elif kind == "dgrad":
        a, b, out_dims = tensor("dY", y_dims), tensor("W", w_dims), x_dims
        out = graph.conv_dgrad(loss=a, filter=b, **conv)
    else:
        a, b, out_dims = tensor("X", x_dims), tensor("dY", y_dims), w_dims
        out = graph.conv_wgrad(image=a, loss=b, **conv)
    out.set_output(True).set_data_type(f32).set_dim(list(out_dims)).set_stride([int(s) for s in torch.empty(out_dims).stride()])
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.deselect_numeric_notes(excluded)
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return graph, a, b, out


def _reference(kind, x, w, dy, stride):
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    if kind == "fprop":
        return torch.nn.functional.conv2d(x64, w64, stride=stride, padding=1)
    if kind == "dgrad":
        return torch.nn.grad.conv2d_input(x.shape, w64, dy64, stride=stride, padding=1)
    return torch.nn.grad.conv2d_weight(x64, w.shape, dy64, stride=stride, padding=1)


def main(argv: list[str] | None = None) -> int:
    import cudnn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = False
    handle = cudnn.create_handle()
    note = cudnn.numerical_note
    base = [note.NONDETERMINISTIC, note.TENSOR_CORE, note.DOWN_CONVERT_INPUTS]
    print(f"cuDNN {cudnn.backend_version()}; {torch.cuda.get_device_name()}; batch {args.batch}")
    print(f"{'conv':22s} {'pass':5s} {'plan':>4s} {'ms':>7s} {'rel err':>9s} {'notes':>8s}  engine")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for channels, side, stride in GEOMETRIES:
        out_side = (side + 2 - 3) // stride + 1
        c_in = channels // stride
        x_dims, w_dims = [args.batch, c_in, side, side], [channels, c_in, 3, 3]
        y_dims = [args.batch, channels, out_side, out_side]
        x = torch.randn(x_dims, device="cuda", generator=gen)
        w = torch.randn(w_dims, device="cuda", generator=gen) * 0.05
        dy = torch.randn(y_dims, device="cuda", generator=gen)
        for kind in ("fprop", "dgrad", "wgrad"):
            want = _reference(kind, x, w, dy, stride)
            scale = want.abs().max().item()
            without = {}  # note name -> the plans left when engines with that note are deselected
            for note_name in NOTE_NAMES:
                if not hasattr(note, note_name):
                    continue
                try:
                    g = _graph(cudnn, handle, kind, x_dims, w_dims, y_dims, stride, [*base, getattr(note, note_name)])[0]
                    without[note_name] = {g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())}
                except Exception:  # noqa: BLE001 - no plan left without that note
                    without[note_name] = set()
            graph, a, b, out = _graph(cudnn, handle, kind, x_dims, w_dims, y_dims, stride, base)
            inputs = {"fprop": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}[kind]
            got = torch.empty(want.shape, device="cuda", dtype=torch.float32)
            pack = {a: inputs[0].data_ptr(), b: inputs[1].data_ptr(), out: got.data_ptr()}
            for index in range(graph.get_execution_plan_count()):
                try:
                    name = graph.get_plan_name_at_index(index)
                    size = int(graph.get_workspace_size_plan_at_index(index))
                    workspace = torch.empty(size, device="cuda", dtype=torch.uint8)
                    graph.execute_plan_at_index(pack, workspace.data_ptr(), index, handle)
                    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(10):
                        graph.execute_plan_at_index(pack, workspace.data_ptr(), index, handle)
                    stop.record()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(f"{channels}x{side}/{stride}  {kind:5s} {index:4d}  failed: {exc}"[:160])
                    continue
                err = (got.double() - want).abs().max().item() / scale
                flag = ",".join(n.lower()[:8] for n, left in without.items() if name not in left) or "-"
                label = f"{c_in}->{channels} {side}x{side} s{stride}"
                print(f"{label:22s} {kind:5s} {index:4d} {start.elapsed_time(stop) / 10:7.3f} {err:9.2e} {flag:>8s}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
