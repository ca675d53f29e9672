"""The child side of the benchmark groups: ``python -m gradgen.bench.worker TASK.json``.

One process measures one framework (so device memory is its own). The task (JSON, written by the
parent) names the job and its files; the result (JSON) goes to ``task["result"]``. Any exception
becomes ``{"error": ...}`` in the result, so the parent reports it and goes on.

Jobs:
- ``torch-step`` / ``gradgen-step``: one forward + backward step on a fixed batch, timed;
  optionally the gradients are saved for the parent's comparison.
- ``torch-varlen`` / ``gradgen-varlen``: the variable-length loop (a new sequence length each
  step, several passes over the lengths).
- ``torch-train`` / ``gradgen-train``: the train group's full AdamW step (forward, backward,
  update), timed, with every step's loss;
- ``gradgen-profile``: GPU time of one gradgen step by kernel and by op (torch.profiler);
- ``cpu-threads``: the CPU group at one thread count (PyTorch eager, ONNX Runtime, gradgen).

A task's ``precision`` (fp32, tf32, bf16, fp16; ``precision.py`` says what each means) sets
PyTorch's TF32 flags and autocast; gradgen's graphs are built with it (by the parent for a step).

A step reads the loss back to the host, so its wall-clock time is the whole step; the batch is
copied from host memory each step by every framework (gradgen's ``Session.run`` takes numpy).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

from gradgen.bench.measure import DeviceMemory, error_text, is_out_of_memory, median, time_adaptive, time_steps, write_json_atomic
from gradgen.bench.models import ModelSpec, build_module
from gradgen.bench.precision import TORCH_DTYPES

# ---------------------------------------------------------------------------------------------
# PyTorch


def _torch_setup(device: str, precision: str = "fp32"):
    """Import torch with TF32 off everywhere (on for ``precision="tf32"``); on CUDA create the context
    and return a memory probe."""
    import torch

    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if device != "cuda":
        return torch, None
    memory = DeviceMemory(torch.cuda.mem_get_info)  # the first call creates the context
    return torch, memory


def _torch_model(task: dict, torch, device: str):
    spec = ModelSpec.from_json(task["spec"])
    model = build_module(spec)
    model.load_state_dict(torch.load(task["state"], weights_only=True))
    return model.to(device)


def _autocast(torch, device: str, precision: str):
    """The forward's context: ``torch.autocast`` for bf16 / fp16, nothing otherwise."""
    dtype = TORCH_DTYPES.get(precision)
    return torch.autocast(device, dtype=getattr(torch, dtype)) if dtype else contextlib.nullcontext()


def _torch_step(torch, model, forward, host_inputs: dict, device: str, precision: str = "fp32"):
    """forward (under autocast for bf16 / fp16) + backward on a batch copied from host memory;
    returns the loss as a float."""
    params = list(model.parameters())
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in host_inputs.items()}

    def step():
        for p in params:
            p.grad = None
        with _autocast(torch, device, precision):
            loss = forward(*(t.to(device) for t in tensors.values()))
        loss.backward()
        value = loss.item()
        if device == "cuda":
            torch.cuda.synchronize()
        return value

    return step


def _torch_memory(torch, memory: DeviceMemory | None) -> dict:
    if memory is None:
        return {}
    return {
        "used_after_bytes": memory.sample(),
        "max_sampled_bytes": memory.max_seen,
        "torch_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "torch_max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }


def _device_info_torch(torch, device: str) -> dict:
    info = {"torch": torch.__version__}
    if device == "cuda":
        info.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return info


def job_torch_step(task: dict) -> dict:
    """One framework's timed steps; with ``grads_only`` (the fp32 reference) one step and its gradients."""
    device, precision = task["device"], task.get("precision", "fp32")
    torch, memory = _torch_setup(device, precision)
    model = _torch_model(task, torch, device)
    forward = torch.compile(model) if task["framework"] == "compile" else model
    inputs = dict(np.load(task["inputs"]))
    step = _torch_step(torch, model, forward, inputs, device, precision)
    t0 = time.perf_counter()
    loss = step()
    first_s = time.perf_counter() - t0
    if task.get("grads_only"):
        _save_torch_grads(task["grads"], model)
        return {"framework": task["framework"], "precision": precision, "loss": loss, "first_step_s": first_s}
    times = time_steps(
        step, warmup=max(0, task["warmup"] - 1), steps=task["steps"], after=None if memory is None else memory.sample
    )
    result = {
        "framework": task["framework"],
        "precision": precision,
        "loss": loss,
        "first_step_s": first_s,
        "step_ms": times,
        "median_ms": median(times),
        "memory": _torch_memory(torch, memory),
        "info": _device_info_torch(torch, device),
    }
    if task.get("grads"):
        _save_torch_grads(task["grads"], model)
    return result


def _save_torch_grads(path: str, model) -> None:
    """The parameters' gradients, as float32 (an autocast run leaves them float32 already)."""
    np.savez(path, **{name: p.grad.detach().float().cpu().numpy() for name, p in model.named_parameters() if p.grad is not None})


def _run_lengths(step_for_length, lengths: list[int], passes: int, memory: DeviceMemory | None) -> dict:
    """The variable-length loop: ``passes`` passes over ``lengths``, one step each, timed; stops at the
    first failure (recorded with where it happened and whether it was an out-of-memory)."""
    done = []
    for p in range(passes):
        record = {"pass": p + 1, "step_ms": [], "lengths": [], "max_used_bytes": None}
        done.append(record)
        for length in lengths:
            t0 = time.perf_counter()
            try:
                step_for_length(length)
            except Exception as exc:  # noqa: BLE001 - the failure is the measurement
                record["failure"] = {
                    "pass": p + 1,
                    "length": length,
                    "step": len(record["step_ms"]) + 1,
                    "out_of_memory": is_out_of_memory(exc),
                    "message": error_text(exc),
                }
                if memory is not None:
                    record["max_used_bytes"] = memory.max_seen
                return {"passes": done, "failure": record["failure"]}
            record["step_ms"].append((time.perf_counter() - t0) * 1e3)
            record["lengths"].append(length)
            if memory is not None:
                used = memory.sample()
                record["max_used_bytes"] = max(used, record["max_used_bytes"] or 0)
    return {"passes": done, "failure": None}


def _length_batches(task: dict) -> dict[int, dict[str, np.ndarray]]:
    master = dict(np.load(task["inputs"]))
    return {t: {k: np.ascontiguousarray(v[:, :t]) for k, v in master.items()} for t in task["lengths"]}


def job_torch_varlen(task: dict) -> dict:
    device, precision = task["device"], task.get("precision", "fp32")
    torch, memory = _torch_setup(device, precision)
    model = _torch_model(task, torch, device)
    forward = torch.compile(model, dynamic=True) if task["framework"] == "compile" else model
    steps = {t: _torch_step(torch, model, forward, batch, device, precision) for t, batch in _length_batches(task).items()}
    result = _run_lengths(lambda t: steps[t](), task["lengths"], task["passes"], memory)
    result.update(framework=task["framework"], memory=_torch_memory(torch, memory), info=_device_info_torch(torch, device))
    return result


GRAD_SCALER_INIT = 2.0**16  # GradScaler's default, stated: it has no getter for it


def job_torch_train(task: dict) -> dict:
    """The train group's PyTorch side: forward (under autocast for bf16 / fp16), backward and
    ``AdamW(fused=True)`` (on the GPU) per step; fp16 through ``torch.amp.GradScaler``."""
    device, precision = task["device"], task.get("precision", "fp32")
    torch, memory = _torch_setup(device, precision)
    model = _torch_model(task, torch, device)
    forward = torch.compile(model) if task["framework"] == "compile" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=task["lr"], fused=device == "cuda")
    scaler = torch.amp.GradScaler(device, init_scale=GRAD_SCALER_INIT) if precision == "fp16" else None
    batches = [[torch.from_numpy(v) for v in batch.values()] for batch in train_batches(task["inputs"])]
    losses: list[float] = []

    def step():
        optimizer.zero_grad(set_to_none=True)
        tensors = batches[len(losses) % len(batches)]
        with _autocast(torch, device, precision):
            loss = forward(*(t.to(device) for t in tensors))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(loss.item())
        if device == "cuda":
            torch.cuda.synchronize()

    result = _train_result(task, step, losses, memory, lambda: _torch_memory(torch, memory), _device_info_torch(torch, device))
    if scaler is not None:  # read once at the end: a per-step read would add a sync to the timed steps
        result["loss_scaling"] = scaled_steps(GRAD_SCALER_INIT, scaler.get_scale(), scaler.get_growth_interval(), len(losses))
    return result


def scaled_steps(initial: float, final: float, growth_interval: int, steps: int) -> dict:
    """The loss scale at the end and, where no growth could have happened (fewer steps than the
    growth interval), the number of skipped steps it implies: each halved the scale once."""
    skipped = round(math.log2(initial / final)) if steps < growth_interval and 0 < final <= initial else None
    return scaling_figures(initial, final, skipped)


def scaling_figures(initial: float, final: float, skipped: int | None) -> dict:
    """A train result's ``loss_scaling``: both scales and the skipped steps (None: not known)."""
    return {"initial_scale": float(initial), "final_scale": float(final), "skipped_steps": skipped}


def train_batches(path: str) -> list[dict[str, np.ndarray]]:
    """The train group's batches, saved stacked on a leading axis (``train._prepare``), one dict each."""
    stacked = dict(np.load(path))
    count = len(next(iter(stacked.values())))
    return [{name: np.ascontiguousarray(values[i]) for name, values in stacked.items()} for i in range(count)]


def _train_result(task: dict, step, losses: list[float], memory, memory_figures, info: dict) -> dict:
    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    times = time_steps(
        step, warmup=max(0, task["warmup"] - 1), steps=task["steps"], after=None if memory is None else memory.sample
    )
    return {
        "framework": task["framework"],
        "precision": task.get("precision", "fp32"),
        "loss": losses[-1],
        "losses": losses,
        "first_step_s": first_s,
        "step_ms": times,
        "median_ms": median(times),
        "memory": memory_figures(),
        "info": info,
    }


# ---------------------------------------------------------------------------------------------
# gradgen


def _gradgen_setup(device: str):
    """On CUDA: create gradgen's context and return a memory probe."""
    if device != "cuda":
        return None
    from pycuda import driver

    from gradgen.cuda import runtime as rt  # noqa: F401  (creates the primary context)

    return DeviceMemory(driver.mem_get_info)


def gradgen_memory(session, memory: DeviceMemory | None) -> dict:
    """Driver-level figures, the CUDA memory pool's, and whatever the session reports of its own
    (``Session.memory_stats()``, where the executor offers it)."""
    if memory is None:
        return {}
    from gradgen.cuda import runtime as rt

    pool = rt.memory_pool()
    figures = {
        "used_after_bytes": memory.sample(),
        "max_sampled_bytes": memory.max_seen,
        "pool_held_bytes": int(getattr(pool, "managed_bytes", 0)),
        "pool_active_bytes": int(getattr(pool, "active_bytes", 0)),
    }
    stats = getattr(session, "memory_stats", None)
    if callable(stats):
        figures["session"] = {k: v for k, v in stats().items() if isinstance(v, (int, float, str))}
    return figures


def _device_info_gradgen(device: str) -> dict:
    if device != "cuda":
        return {}
    from pycuda import driver

    version = driver.get_driver_version()
    return {"device": driver.Context.get_device().name(), "driver_cuda": f"{version // 1000}.{version % 1000 // 10}"}


def job_gradgen_step(task: dict) -> dict:
    from gradgen.executor import Session

    device = task["device"]
    memory = _gradgen_setup(device)
    t0 = time.perf_counter()
    session = Session(task["model"], device=device)
    setup_s = time.perf_counter() - t0
    feeds = dict(np.load(task["inputs"]))
    loss_name = task["loss"]

    def step():
        return float(session.run(feeds, outputs=[loss_name])[loss_name])

    firsts = []
    # first run: eager (kernel compilation; always apart from the timed steps); second: recording
    for _ in range(min(2, max(1, task["warmup"]))):
        t0 = time.perf_counter()
        loss = step()
        firsts.append(time.perf_counter() - t0)
    times = time_steps(
        step, warmup=max(0, task["warmup"] - 2), steps=task["steps"], after=None if memory is None else memory.sample
    )
    result = {
        "framework": "gradgen",
        "precision": task.get("precision", "fp32"),  # the parent built the graph with it
        "loss": loss,
        "setup_s": setup_s,
        "first_step_s": firsts[0],
        "second_step_s": firsts[1] if len(firsts) > 1 else None,
        "step_ms": times,
        "median_ms": median(times),
        "plan_steps": len(session.steps),
        "memory": gradgen_memory(session, memory),
        "info": _device_info_gradgen(device),
    }
    if task.get("grads"):
        names = task["wrt"]
        out = session.run(feeds, outputs=[f"{n}_grad" for n in names])
        np.savez(task["grads"], **{n: out[f"{n}_grad"] for n in names})
    return result


def job_gradgen_varlen(task: dict) -> dict:
    from gradgen.executor import Session

    device = task["device"]
    memory = _gradgen_setup(device)
    session = Session(task["model"], device=device)
    batches = _length_batches(task)
    loss_name = task["loss"]
    result = _run_lengths(lambda t: session.run(batches[t], outputs=[loss_name]), task["lengths"], task["passes"], memory)
    result.update(
        framework="gradgen",
        plan_steps=len(session.steps),
        memory=gradgen_memory(session, memory),
        info=_device_info_gradgen(device),
    )
    return result


def job_gradgen_train(task: dict) -> dict:
    """The train group's gradgen side: ``build_training(model, optimizer=AdamW(), precision=...)``
    stepped by the ``DeviceStepRunner`` (parameters and optimizer states stay on the device)."""
    from gradgen.training import AdamW, DeviceStepRunner, Trainer, build_training

    device = task["device"]
    memory = _gradgen_setup(device)
    t0 = time.perf_counter()
    program = build_training(task["model"], optimizer=AdamW(weight_decay=0.01), precision=task.get("precision", "fp32"))
    build_s = time.perf_counter() - t0
    runner = DeviceStepRunner(program, device)
    trainer = Trainer(program, lr=task["lr"], runner=runner)
    batches = train_batches(task["inputs"])
    losses: list[float] = []
    skipped: list[bool] = []

    def step():
        result = trainer.train_step([batches[len(losses) % len(batches)]])
        losses.append(result.loss)
        skipped.append(result.skipped)

    result = _train_result(task, step, losses, memory, lambda: gradgen_memory(runner.train, memory), _device_info_gradgen(device))
    result.update(build_s=build_s, plan_steps=len(runner.train.steps))
    if program.loss_scaling is not None:
        from gradgen.training.loss_scaling import LOSS_SCALING

        final = float(runner.snapshot().states[(LOSS_SCALING, "scale")])
        result["loss_scaling"] = scaling_figures(program.loss_scaling.init_scale, final, sum(skipped))
    return result


def _kernel_time_by_op(events) -> list[tuple[str, int, float]]:
    """(op, nodes, ms) of the kernels that ran inside each op's nodes, slowest op first.

    Each node's ``record_function`` range also appears on the GPU timeline (a user annotation
    spanning the kernels its launches started); a kernel belongs to the annotation whose interval
    holds its start. (The profiler's per-range device totals attribute kernels by launch
    correlation, which the driver-API launches of PyCUDA do not carry reliably.)"""
    import bisect

    from torch.autograd import DeviceType

    spans, kernels = [], []
    for e in events:
        if e.device_type != DeviceType.CUDA:
            continue
        (spans if e.name.startswith("onnx::") else kernels).append(e)
    spans.sort(key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in spans]
    total: dict[str, float] = {}
    nodes: dict[str, set] = {}
    for k in kernels:
        i = bisect.bisect_right(starts, k.time_range.start) - 1
        if i < 0 or k.time_range.start > spans[i].time_range.end:
            continue
        op = spans[i].name[len("onnx::") :]
        total[op] = total.get(op, 0.0) + (k.time_range.end - k.time_range.start) / 1e3
        nodes.setdefault(op, set()).add(i)
    return sorted(((op, len(nodes[op]), ms) for op, ms in total.items()), key=lambda r: -r[2])


def job_gradgen_profile(task: dict) -> dict:
    """GPU time by kernel and by ONNX op of one gradgen step, through torch.profiler (CUPTI).

    CUDA graphs are off (``GRADGEN_CUDA_GRAPHS=0``), so every kernel is its own activity; kernel
    durations are those of the replayed step, the host time between them is not. Each node runs
    inside a ``record_function`` range named after its op; ``_kernel_time_by_op`` attributes the
    kernels to ops by the ranges' GPU-timeline intervals.
    """
    os.environ["GRADGEN_CUDA_GRAPHS"] = "0"
    from torch.profiler import ProfilerActivity, profile, record_function

    from gradgen.executor import Session

    session = Session(task["model"], device="cuda")
    feeds = dict(np.load(task["inputs"]))
    backend_step = session.backend.run_step

    def labelled_step(step, args):
        with record_function(f"onnx::{step.op_type}"):
            return backend_step(step, args)

    session.backend.run_step = labelled_step
    for _ in range(2):
        session.run(feeds, outputs=[task["loss"]])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        session.run(feeds, outputs=[task["loss"]])
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.key_averages()

    def device_us(e, own: bool):
        name = "self_device_time_total" if own else "device_time_total"
        return getattr(e, name, getattr(e, name.replace("device", "cuda"), 0))

    kernels = sorted(
        ((e.key, e.count, device_us(e, True) / 1e3) for e in events if device_us(e, True) > 0 and not e.key.startswith("onnx::")),
        key=lambda r: -r[2],
    )
    by_op = _kernel_time_by_op(prof.events())
    total = sum(ms for _, _, ms in kernels)
    print(
        f"  gradgen profile (one eager step, {len(session.steps)} steps): GPU kernel time {total:.1f} ms, wall {wall_ms:.1f} ms",
        flush=True,
    )
    for title, rows in (("by ONNX op (kernels launched inside the node)", by_op), ("by kernel", kernels)):
        if rows and rows[0][2] > 0:
            print(f"  {title}:", flush=True)
            for name, count, ms in rows[:20]:
                print(f"    {ms:9.2f} ms {100 * ms / total:5.1f}%  x{count:<5d} {name[:90]}", flush=True)
    return {
        "framework": "gradgen",
        "gpu_kernel_ms": total,
        "wall_ms": wall_ms,
        "by_kernel": [list(r) for r in kernels[:60]],
        "by_op": [list(r) for r in by_op],
    }


# ---------------------------------------------------------------------------------------------
# The CPU group at one thread count (the parent set OMP_NUM_THREADS & co. for this process)


def _limit_threads(threads: int) -> str:
    """Limit the BLAS / OpenMP pools of this process; say how."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return "environment variables (OMP/OPENBLAS/MKL_NUM_THREADS) in a child process"
    threadpool_limits(threads)
    return "threadpoolctl, and environment variables in a child process"


def job_cpu_threads(task: dict) -> dict:
    threads = task["threads"]
    method = _limit_threads(threads)
    results = {"threads": threads, "thread_method": method, "cases": {}}
    for case in task["cases"]:
        print(f"  [{threads} thread(s)] {case['name']}", flush=True)
        results["cases"][case["name"]] = _cpu_case(case, threads, task)
        write_json_atomic(Path(task["result"]), results)  # partial results survive a timeout
    return results


def _cpu_case(case: dict, threads: int, task: dict) -> dict:
    from gradgen.executor import Session

    feeds = dict(np.load(case["inputs"]))
    timing = dict(warmup=task["warmup"], max_steps=case.get("steps", task["steps"]), budget_s=task["budget_s"])
    row = {}

    def measure(key, make_step):
        try:
            times = time_adaptive(make_step(), **timing)
            row[key], row[f"{key}_all"] = median(times), times  # every step: the minimum is robust to other load
        except Exception as exc:  # noqa: BLE001 - one failing runtime should not hide the rest
            row[key] = None
            row[f"{key}_error"] = error_text(exc)

    def ort_step():
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(case["portable"], options, providers=["CPUExecutionProvider"])
        names = {i.name for i in session.get_inputs()}
        ort_feeds = {k: v for k, v in feeds.items() if k in names}
        return lambda: session.run(None, ort_feeds)

    def gradgen_step(path):
        def make():
            session = Session(path, device="cpu")
            return lambda: session.run(feeds)

        return make

    _measure_paired(row, {"ort_ms": ort_step, "gradgen_portable_ms": gradgen_step(case["portable"])}, timing)
    if task.get("profile"):
        try:  # op type, steps, ms: every step timed over three runs (gradgen/executor/profile.py)
            by_op = Session(case["portable"], device="cpu").profile(feeds, runs=3).by_op()
            row["gradgen_by_op"] = [[op, steps, seconds * 1e3] for op, steps, seconds in by_op]
        except Exception as exc:  # noqa: BLE001 - the timings above stand without it
            row["gradgen_by_op_error"] = error_text(exc)
    measure("gradgen_ms", gradgen_step(case["default"]))
    measure("torch_ms", lambda: _torch_cpu_step(case, threads))
    return row


PAIRED_ROUNDS = 3  # alternating rounds of ONNX Runtime's and gradgen's portable step


def _measure_paired(row: dict, makers: dict, timing: dict, rounds: int = PAIRED_ROUNDS) -> None:
    """Time the steps ``makers`` make (ONNX Runtime's and gradgen's, on the same graph) in
    alternating rounds: a virtual machine's speed drifts over seconds (ONNX Runtime's own step
    ranged from 516 to 702 ms in one hour), and timing one runtime after the other put such a drift
    into their ratio. ``row[key]`` is the median of the key's pooled times; with both timed,
    ``row["ratio_rounds"]`` holds each round's ratio of medians (the second key over the first)."""
    steps: dict = {}
    for key, make in makers.items():
        try:
            steps[key] = make()
        except Exception as exc:  # noqa: BLE001 - one failing runtime should not hide the rest
            row[key] = None
            row[f"{key}_error"] = error_text(exc)
    per_round = dict(timing, max_steps=max(3, -(-timing["max_steps"] // rounds)), budget_s=timing["budget_s"] / rounds)
    times: dict = {key: [] for key in steps}
    ratios = []
    for index in range(rounds):
        medians = {}
        for key, step in list(steps.items()):
            try:
                taken = time_adaptive(step, **dict(per_round, warmup=per_round["warmup"] if index == 0 else 0))
            except Exception as exc:  # noqa: BLE001
                row[f"{key}_error"] = error_text(exc)
                del steps[key]
                continue
            times[key] += taken
            medians[key] = median(taken)
        if len(medians) == 2:
            first, second = medians.values()
            ratios.append(second / first)
    for key, taken in times.items():
        if f"{key}_error" not in row:
            row[key], row[f"{key}_all"] = median(taken), taken
        else:
            row[key] = None
    if len(ratios) == rounds:
        row["ratio_rounds"] = ratios


def _torch_cpu_step(case: dict, threads: int):
    import torch

    torch.set_num_threads(threads)
    if case["torch"]["kind"] == "spec":
        model = build_module(ModelSpec.from_json(case["torch"]["spec"]))
        inputs = [torch.from_numpy(v) for v in np.load(case["inputs"]).values()]
    else:  # a bundled sample: its model class from samples/make_samples.py
        from gradgen.bench.cpu import load_sample_case

        sample_case = load_sample_case(case["torch"]["script"], case["torch"]["family"])
        model, inputs = sample_case.model, list(sample_case.inputs.values())
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = None
        out = model(*inputs)
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        return loss.item()

    return step


# ---------------------------------------------------------------------------------------------

JOBS = {
    "torch-step": job_torch_step,
    "torch-varlen": job_torch_varlen,
    "gradgen-step": job_gradgen_step,
    "gradgen-varlen": job_gradgen_varlen,
    "gradgen-profile": job_gradgen_profile,
    "torch-train": job_torch_train,
    "gradgen-train": job_gradgen_train,
    "cpu-threads": job_cpu_threads,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    task = json.loads(Path(argv[0]).read_text())
    result_path = Path(task["result"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = JOBS[task["job"]](task)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
            if task.get("debug"):
                traceback.print_exc()
            result = {"error": error_text(exc), "out_of_memory": is_out_of_memory(exc)}
    notes = sorted(
        {
            str(w.message).splitlines()[0][:300]
            for w in caught
            if w.category is not DeprecationWarning and "gradgen" in (w.filename or "") + str(w.message)
        }
    )
    if notes:
        result["notes"] = notes
    write_json_atomic(result_path, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
