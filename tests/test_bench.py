"""gradgen bench's e2e and cpu groups, on tiny sizes on the CPU: the model builders export, gradgen's
gradients match PyTorch's, the child-process harness reports results and failures. No timings are
checked (the groups are benchmarks, not timed tests)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

import gradgen  # noqa: E402
from gradgen.bench import cpu, e2e, main, measure, models, worker  # noqa: E402


def _torch_grads(model, feeds: dict) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(*(torch.from_numpy(v) for v in feeds.values()))
    loss.backward()
    return loss.item(), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "name,dynamic,length", [("gpt2-tiny", False, None), ("gpt2-tiny", True, 11), ("resnet18-tiny", False, None)]
)
def test_models_export_and_gradgen_gradients_match_torch(name, dynamic, length):
    spec = models.preset(name)
    model = models.build_module(spec)
    inputs = models.make_inputs(spec)
    proto = models.export(model, inputs, dynamic_seq=dynamic)
    initializers = {t.name for t in proto.graph.initializer}
    assert set(models.parameter_names(model)) <= initializers
    built = gradgen.build_backward(proto, wrt=models.parameter_names(model))
    feeds = {k: np.ascontiguousarray(v[:, :length]) for k, v in inputs.items()} if length else inputs
    got = gradgen.Session(built.model).run(feeds)
    loss, want = _torch_grads(model, feeds)
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    for param, grad in want.items():
        err = np.abs(got[f"{param}_grad"] - grad).max() / np.abs(grad).max()
        assert err < 1e-5, (param, err)


def test_parameters_are_pairwise_distinct():
    """The legacy exporter merges equal initializers: no two parameters may hold equal values."""
    for name in ("gpt2-tiny", "resnet18-tiny"):
        model = models.build_module(models.preset(name))
        seen = {}
        for pname, p in model.state_dict().items():
            if not p.is_floating_point():
                continue
            key = (tuple(p.shape), p.numpy().tobytes())
            assert key not in seen, (pname, seen.get(key))
            seen[key] = pname


def test_presets_and_overrides():
    spec = models.preset("gpt2s")
    assert (spec.arch["layers"], spec.arch["d"], spec.arch["heads"], spec.arch["vocab"], spec.batch, spec.size) == (
        12,
        768,
        12,
        50257,
        8,
        256,
    )
    medium = models.preset("gpt2m")
    assert (medium.arch["layers"], medium.arch["d"], medium.arch["heads"], medium.batch, medium.size) == (24, 1024, 16, 4, 512)
    small = models.preset("gpt2s", batch=2, size=2048, layers=2)
    assert small.arch["max_len"] == 2048 and small.arch["layers"] == 2 and "2 x 768" in small.title
    assert models.ModelSpec.from_json(small.to_json()) == small
    with pytest.raises(gradgen.errors.UsageError, match="GPT-2"):
        models.preset("resnet18", layers=3)
    with pytest.raises(gradgen.errors.UsageError, match="multiple"):
        models.preset("gpt2s", heads=5)


def test_seed_chooses_the_parameters_and_the_batch():
    same = [models.preset("gpt2-tiny", seed=1) for _ in range(2)]
    other = models.preset("gpt2-tiny")
    weights = [models.build_module(s).state_dict()["wte.weight"].numpy() for s in (*same, other)]
    batches = [models.make_inputs(s)["ids"] for s in (*same, other)]
    assert np.array_equal(weights[0], weights[1]) and not np.array_equal(weights[0], weights[2])
    assert np.array_equal(batches[0], batches[1]) and not np.array_equal(batches[0], batches[2])
    assert "seed 1" in same[0].shape_text and "seed" not in other.shape_text
    assert models.ModelSpec.from_json(same[0].to_json()) == same[0]


@pytest.mark.parametrize("name", ["gpt2-tiny", "resnet18-tiny"])
def test_train_batches_are_a_learnable_task(name):
    """The train group's batches: distinct, seeded, stacked; labels a function of the input, so the
    loss can fall below the label entropy (random labels can only be memorised)."""
    spec = models.preset(name)
    batches = models.make_train_batches(spec, 3)
    again = models.make_train_batches(spec, 3)
    single = models.make_inputs(spec)
    for key, stacked in batches.items():
        assert stacked.shape == (3, *single[key].shape) and stacked.dtype == single[key].dtype
        np.testing.assert_array_equal(stacked, again[key])
        assert not np.array_equal(stacked[0], stacked[1])
    if spec.kind == "gpt2":
        ids, labels = batches["ids"], batches["labels"]
        np.testing.assert_array_equal(ids[:, :, 1:], labels[:, :, :-1])  # next-token labels
        successors: dict[int, set[int]] = {}
        for a, b in zip(ids.ravel(), labels.ravel()):
            successors.setdefault(int(a), set()).add(int(b))
        assert max(len(s) for s in successors.values()) <= models.TRAIN_SUCCESSORS
    else:
        labels = batches["labels"]
        assert labels.max() < models.TRAIN_CLASSES
        x = batches["x"].reshape(-1, *batches["x"].shape[2:])
        means = {c: x[labels.ravel() == c].mean(axis=0) for c in np.unique(labels)}
        nearest = [min(means, key=lambda c: np.sum((image - means[c]) ** 2)) for image in x]
        assert np.mean(np.array(nearest) == labels.ravel()) > 0.9  # the class templates show through the noise
    assert not np.array_equal(models.make_train_batches(models.preset(name, seed=1), 3)[key], batches[key])


def test_default_lengths_follow_the_issue():
    assert e2e.default_lengths(256) == (256, 240, 224, 208, 192, 176, 160, 144)
    assert all(t >= 2 for t in e2e.default_lengths(8))


def test_compare_gradients_names_the_worst_tensor(tmp_path):
    want = {
        "a": np.array([1.0, -4.0], np.float32),
        "b": np.array([2.0, 2.0], np.float32),
        "c": np.ones(3, np.float32),
        "d": np.zeros(2, np.float32),
    }
    got = {"a": np.array([1.0, -4.0], np.float32), "b": np.array([2.0, 2.5], np.float32), "c": np.ones(4, np.float32)}
    np.savez(tmp_path / "grads-gradgen.npz", **got)
    np.savez(tmp_path / "grads-eager.npz", **want)
    result = e2e.compare_gradients(tmp_path / "grads-gradgen.npz", tmp_path / "grads-eager.npz")
    assert result["missing"] == ["d"]
    assert result["per_tensor"]["a"] == 0 and result["per_tensor"]["b"] == pytest.approx(0.25)
    assert result["worst_tensor"] == "c" and result["worst_rel_err"] == float("inf")  # shape mismatch
    assert "gradgen" in e2e.compare_gradients(tmp_path / "none-gradgen.npz", tmp_path / "grads-eager.npz")["error"]


class _FakeCudaOom(Exception):
    pass


_FakeCudaOom.__name__ = "MemoryError"
_FakeCudaOom.__module__ = "pycuda._driver"


def test_variable_length_loop_reports_out_of_memory_and_stops():
    calls = []

    def step(length):
        calls.append(length)
        if len(calls) == 5:
            raise RuntimeError("node 'mm' failed") from _FakeCudaOom("cuMemAlloc failed: out of memory")

    result = worker._run_lengths(step, [8, 6, 4], passes=2, memory=None)
    assert calls == [8, 6, 4, 8, 6]
    failure = result["failure"]
    assert (failure["pass"], failure["length"], failure["step"], failure["out_of_memory"]) == (2, 6, 2, True)
    assert [p["lengths"] for p in result["passes"]] == [[8, 6, 4], [8]]
    other = worker._run_lengths(lambda t: (_ for _ in ()).throw(ValueError("bad")), [4], passes=1, memory=None)
    assert other["failure"]["out_of_memory"] is False and "ValueError: bad" in other["failure"]["message"]


def test_out_of_memory_is_recognised():
    assert measure.is_out_of_memory(RuntimeError("cuGraphLaunch failed: CUDA_ERROR_OUT_OF_MEMORY"))
    assert measure.is_out_of_memory(type("OutOfMemoryError", (RuntimeError,), {})("CUDA"))
    assert not measure.is_out_of_memory(MemoryError("host"))  # the host's MemoryError is not the device's
    assert not measure.is_out_of_memory(ValueError("shape mismatch"))


def test_device_memory_is_relative_to_its_baseline():
    state = {"free": 100}
    memory = measure.DeviceMemory(lambda: (state["free"], 1000))
    state["free"] = 40
    assert memory.sample() == 60
    state["free"] = 70
    assert memory.sample() == 30 and memory.max_seen == 60


@pytest.mark.slow
def test_e2e_group_on_cpu_tiny(tmp_path):
    """The whole group in child processes (about 10 s): eager and gradgen agree, the loop runs both passes."""
    spec = models.preset("gpt2-tiny")
    updates = []
    report = e2e.run(
        e2e.E2EOptions(
            specs=[spec],
            device="cpu",
            frameworks=("eager", "gradgen"),
            steps=2,
            warmup=2,
            lengths=(16, 12),
            passes=2,
            on_update=updates.append,
        )
    )
    entry = report["models"]["gpt2-tiny/fp32"]
    eager, ours = entry["frameworks"]["eager"], entry["frameworks"]["gradgen"]
    assert "error" not in eager and "error" not in ours, (eager, ours)
    assert len(eager["step_ms"]) == len(ours["step_ms"]) == 2
    assert ours["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    grads = entry["gradients"]
    assert grads["tensors"] == len(list(models.build_module(spec).parameters())) and not grads["missing"]
    assert grads["worst_rel_err"] < 1e-5
    for framework in ("eager", "gradgen"):
        loop = entry["varlen"][framework]
        assert loop["failure"] is None and [p["lengths"] for p in loop["passes"]] == [[16, 12], [16, 12]]
    assert updates and updates[-1] is report
    text = e2e.format_model(entry)
    assert "gradgen" in text and "variable-length loop" in text and "worst" in text


def test_batch_stats_exports_training_mode_batch_norm_whose_gradients_match_torch():
    """--batch-stats: ResNet-18's BatchNorm in training mode (how a CNN trains), exported so and
    built with ONNX Runtime training's BatchNormInternal / BatchNormalizationGrad; its gradients are
    those of the PyTorch module in training mode."""
    spec = models.preset("resnet18-tiny", batch=4, batch_stats=True)
    assert spec.batch_stats and "batch statistics" in spec.shape_text and "training-mode BatchNorm" in spec.title
    assert models.ModelSpec.from_json(spec.to_json()) == spec
    model = models.build_module(spec)
    assert model.training and not models.build_module(models.preset("resnet18-tiny")).training
    # float64 (float32 gradients of such tiny BatchNorm stacks differ by 3e-4 from PyTorch's, as the
    # standard-op gradient's do); the tolerance is the float32 epsilon attribute's (1e-5 rounded)
    model = model.double()
    inputs = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in models.make_inputs(spec).items()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    proto = models.export(model, inputs)
    model.load_state_dict(state)
    modes = {a.i for n in proto.graph.node if n.op_type == "BatchNormalization" for a in n.attribute if a.name == "training_mode"}
    assert modes == {1}
    built = gradgen.build_backward(proto, wrt=models.parameter_names(model))
    assert "BatchNormalizationGrad" in {n.op_type for n in built.model.graph}
    got = gradgen.Session(built.model).run(inputs)
    loss, want = _torch_grads(model, inputs)
    assert got["loss"] == pytest.approx(loss, rel=1e-9)
    for param, grad in want.items():
        err = np.abs(got[f"{param}_grad"] - grad).max() / max(np.abs(grad).max(), 1e-6)
        assert err < 1e-7, (param, err)


def test_batch_stats_needs_a_resnet(capsys):
    with pytest.raises(gradgen.errors.UsageError, match="ResNet-18"):
        models.preset("gpt2-tiny", batch_stats=True)
    assert main(["--only", "e2e", "--device", "cpu", "--model", "gpt2-tiny", "--batch-stats"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "--batch-stats" in err


def test_child_failure_is_a_result_not_a_crash(tmp_path):
    result = measure.run_child(
        "gradgen-step",
        {
            "label": "broken",
            "device": "cpu",
            "model": str(tmp_path / "no.onnx"),
            "inputs": str(tmp_path / "no.npz"),
            "loss": "loss",
            "steps": 1,
            "warmup": 1,
        },
        tmp_path,
        timeout_s=120,
    )
    assert "no such file" in result["error"]


def test_gradgen_step_without_warm_up_still_times_its_first_step_apart(tmp_path):
    """``--warmup 0``: the first (eager) run is the first step's time, the timed steps come after."""
    import onnx_ir as ir

    fixture = Path(__file__).resolve().parent / "fixtures/models/resnet_block_legacy"
    ir.save(gradgen.build_backward(fixture / "model.onnx").model, tmp_path / "model.onnx")
    task = {"label": "no warm-up", "device": "cpu", "model": str(tmp_path / "model.onnx"), "loss": "loss"}
    task.update(inputs=str(fixture / "inputs.npz"), steps=2, warmup=0)
    result = measure.run_child("gradgen-step", task, tmp_path, timeout_s=120)
    assert "error" not in result, result
    assert len(result["step_ms"]) == 2 and result["first_step_s"] > 0 and result["second_step_s"] is None
    assert np.isfinite(result["loss"])


@pytest.mark.slow
def test_cpu_group_tiny(tmp_path):
    """The CPU group in a child process (about 5 s): every runtime gives a time."""
    report = cpu.run(
        cpu.CpuOptions(
            specs=[models.preset("gpt2-tiny")],
            samples=["mlp"],
            threads=[1],
            steps=2,
            budget_s=1.0,
            build_layers=2,
            keep_dir=None,
            profile=True,
        )
    )
    cases = report["runs"]["1"]["cases"]
    assert set(cases) == {"sample mlp", "gpt2-tiny B=2, T=16"}
    for row in cases.values():
        assert not [k for k in row if k.endswith("_error")], row
        assert all(row[k] > 0 for k in ("torch_ms", "ort_ms", "gradgen_ms", "gradgen_portable_ms"))
        ops = [op for op, _, _ in row["gradgen_by_op"]]
        assert "Gemm" in ops or "MatMul" in ops
    assert "gradgen by op, sample mlp, 1 thread(s): " in cpu.format_report(report)
    assert "environment variables" in report["runs"]["1"]["thread_method"]
    assert report["build"]["layers"] == 2 and report["build"]["forward_nodes"] > 100


def test_cpu_report_lists_the_profile_and_names_a_failed_one():
    row = {"ort_ms": 1.0, "gradgen_portable_ms": 2.0, "gradgen_by_op": [["MatMul", 3, 1.5], ["Add", 2, 0.5]]}
    failed = {"ort_ms": 1.0, "gradgen_portable_ms": 2.0, "gradgen_by_op_error": "KernelError: no"}
    report = {"runs": {"1": {"cases": {"a": row, "b": failed}}}, "header": {"cores": 1}}
    text = cpu.format_report(report)
    assert "gradgen by op, a, 1 thread(s): MatMul 1.5 ms (75 %, 3), Add 0.5 ms (25 %, 2)" in text
    assert "failed: b, 1 thread(s), gradgen_by_op: KernelError: no" in text


def test_build_timing_without_ort_builder(monkeypatch):
    """The build is timed in-process; an interpreter that cannot run ORT's builder is named, not raised."""
    report = cpu.measure_build(1, repeats=1, ort_python="/nonexistent/python3")
    assert report["build_s"] > 0 and report["forward_nodes"] > 50
    assert "cannot run /nonexistent/python3" in report["ort_error"]
    assert "not timed: cannot run" in cpu.format_report({"runs": {}, "header": {"cores": 1}, "build": report})
    monkeypatch.setenv("GRADGEN_ORT_TRAINING_PYTHON", "/some/python")
    assert cpu.ort_training_python() == "/some/python"


@pytest.mark.skipif(not os.environ.get("GRADGEN_ORT_TRAINING_PYTHON"), reason="GRADGEN_ORT_TRAINING_PYTHON not set")
def test_build_timing_with_ort_builder():
    """ONNX Runtime training's C++ builder differentiates the same GPT-2 layout in its own process."""
    report = cpu.measure_build(1, repeats=1)
    assert "ort_error" not in report, report.get("ort_error")
    assert report["ort"]["build_s"] > 0 and report["ort"]["nodes"] > report["forward_nodes"]


def test_sample_selection():
    everything = cpu.sample_dirs(None)
    assert {"mlp", "cnn", "transformer"} <= {p.name for p in everything}
    assert cpu.sample_dirs([]) == []  # --no-samples
    assert [p.name for p in cpu.sample_dirs(["mlp"])] == ["mlp"]


def test_bench_usage_errors_are_one_line(capsys):
    assert main(["--only", "e2e", "--model", "nosuch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "nosuch" in err
    assert main(["--only", "cpu", "--sample", "nosuch", "--build-layers", "0"]) == 2
    assert "unknown sample" in capsys.readouterr().err
    assert main(["--only", "e2e", "--seed", "-1"]) == 2
    assert "--seed: must be at least 0" in capsys.readouterr().err


def test_cli_bench_help_lists_the_groups(capsys, monkeypatch):
    from gradgen.cli import main as cli_main

    monkeypatch.setattr(sys, "argv", ["gradgen", "bench", "--help"])
    with pytest.raises(SystemExit) as exc:
        cli_main()
    assert exc.value.code in (0, None)
    out = capsys.readouterr().out
    assert "e2e" in out and "cpu" in out and "--json" in out


@pytest.mark.slow
def test_train_group_on_cpu_tiny():
    """The train group in child processes (a few seconds): eager and gradgen take the same AdamW steps."""
    from gradgen.bench import train

    spec = models.preset("gpt2-tiny")
    updates = []
    report = train.run(
        train.TrainOptions(
            specs=[spec], device="cpu", frameworks=("eager", "gradgen"), steps=7, warmup=2, on_update=updates.append
        )
    )
    entry = report["models"]["gpt2-tiny/fp32"]
    eager, ours = entry["frameworks"]["eager"], entry["frameworks"]["gradgen"]
    assert "error" not in eager and "error" not in ours, (eager, ours)
    assert len(eager["losses"]) == len(ours["losses"]) == 9 and len(ours["step_ms"]) == 7
    assert eager["losses"][8] < eager["losses"][0]  # it trained: step 9 takes step 1's batch again (8 cycled)
    assert entry["loss_agreement"]["gradgen"] < 1e-5
    assert updates and updates[-1] is report
    assert "DeviceStepRunner" in train.format_model(entry)


def test_cpu_runtimes_are_timed_in_alternating_rounds():
    """ONNX Runtime's and gradgen's steps alternate round by round, and the report's ratio is the
    median of the rounds' ratios with their range (one runtime's failure leaves the other timed)."""
    from gradgen.bench import worker

    calls = []

    def maker(name, seconds):
        def make():
            def step():
                calls.append(name)
                time.sleep(seconds)

            return step

        return make

    row: dict = {}
    timing = dict(warmup=1, max_steps=6, budget_s=10.0)
    worker._measure_paired(row, {"ort_ms": maker("ort", 0.001), "gradgen_portable_ms": maker("gradgen", 0.002)}, timing)
    runs = [name for i, name in enumerate(calls) if i == 0 or calls[i - 1] != name]
    assert runs == ["ort", "gradgen"] * worker.PAIRED_ROUNDS
    assert len(row["ratio_rounds"]) == worker.PAIRED_ROUNDS and all(1.2 < r < 4 for r in row["ratio_rounds"])
    assert row["gradgen_portable_ms"] > row["ort_ms"] > 0
    shown = cpu._paired_ratio(row)
    assert shown.endswith(")") and f"({min(row['ratio_rounds']):.2f}-{max(row['ratio_rounds']):.2f})" in shown

    def broken():
        raise RuntimeError("no session")

    row = {}
    worker._measure_paired(row, {"ort_ms": broken, "gradgen_portable_ms": maker("gradgen", 0.0)}, timing)
    assert row["ort_ms"] is None and "no session" in row["ort_ms_error"]
    assert row["gradgen_portable_ms"] is not None and "ratio_rounds" not in row
    assert cpu._paired_ratio(row) == "-"
