"""gradgen bench --precision (e2e and train groups): option parsing, the mixed-precision gradient criterion and
loss-curve comparison computed from arrays, the printed tables, and tiny runs on the CPU (slow)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from gradgen.bench import build_parser, main
from gradgen.bench import precision as bp


def test_precision_choices_are_autocast_precisions():
    from gradgen.passes.autocast import PRECISIONS

    assert bp.CHOICES == PRECISIONS


def test_parse_list_and_flatten():
    assert bp.parse_list("bf16") == ["bf16"]
    assert bp.parse_list("fp16, BF16") == ["fp16", "bf16"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown precision 'fp8'"):
        bp.parse_list("bf16,fp8")
    assert bp.flatten(None) == ("fp32",)
    # fp32 first (the others' reference), each once, whatever the order given
    assert bp.flatten([["bf16"], ["fp32", "bf16"], ["tf32"]]) == ("fp32", "tf32", "bf16")
    args = build_parser().parse_args(["--only", "e2e", "--precision", "fp16", "--precision", "fp32,bf16"])
    assert bp.flatten(args.precision) == ("fp32", "bf16", "fp16")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--only", "e2e", "--precision", "bf17"], "unknown precision 'bf17'"),
        (["--only", "train", "--precision", "fp32,"], "unknown precision ''"),
        (["--only", "cpu", "--precision", "bf16"], "--precision applies to the e2e and train groups"),
        (["--precision", "bf16"], "--precision applies to the e2e and train groups"),
    ],
)
def test_bad_precision_is_a_one_line_usage_error(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_describe_names_both_sides():
    assert bp.describe("fp32") == "fp32, TF32 off"
    assert "allow_tf32" in bp.describe("tf32")
    assert "torch.autocast(bfloat16)" in bp.describe("bf16") and "AutocastPass (bf16)" in bp.describe("bf16")
    assert "no loss scaling" in bp.describe("fp16") and "GradScaler" in bp.describe("fp16", train=True)


def test_relative_errors_per_tensor():
    reference = {
        "w": np.array([[1.0, -4.0], [2.0, 0.5]], np.float32),
        "b": np.zeros(3, np.float32),
        "shape": np.ones(4, np.float32),
        "gone": np.ones(2, np.float32),
    }
    grads = {
        "w": np.array([[1.0, -3.0], [2.5, 0.5]], np.float32),  # max |diff| 1 over max |ref| 4
        "b": np.array([0.0, 1e-3, 0.0], np.float32),  # all-zero reference: the absolute difference
        "shape": np.ones(5, np.float32),
    }
    errors, missing = bp.relative_errors(grads, reference)
    assert errors["w"] == pytest.approx(0.25)
    assert errors["b"] == pytest.approx(1e-3)
    assert errors["shape"] == math.inf
    assert missing == ["gone"]


def test_criterion_counts_tensors_where_gradgen_is_worse():
    gradgen = {"a": 2e-3, "b": 1e-3, "c": 5e-4, "d": 1e-4}
    eager = {"a": 1e-3, "b": 2e-3, "c": 1e-4, "d": 1e-4}
    c = bp.criterion(gradgen, eager)
    assert c["tensors"] == 4
    assert (c["gradgen_worst_tensor"], c["gradgen_worst"]) == ("a", 2e-3)
    assert (c["eager_worst_tensor"], c["eager_worst"]) == ("b", 2e-3)
    assert c["above_eager"] == 2  # a (2x) and c (5x); d is equal, not above
    assert c["worst_factor_tensor"] == "c" and c["worst_factor"] == pytest.approx(5.0)
    assert c["met"] is False
    line = bp.format_criterion({"criterion": c, "missing": []}, "bf16")
    assert "gradgen bf16 worst 2.00e-03 (a)" in line and "eager bf16 worst 2.00e-03 (b)" in line
    assert "above eager's on 2 of 4 tensors, at most 5.00x (c)" in line


def test_criterion_met_and_edge_cases():
    met = bp.criterion({"a": 1e-3, "b": 1e-4}, {"a": 1e-3, "b": 2e-4})
    assert met["met"] is True and met["above_eager"] == 0 and met["worst_factor"] is None
    assert "at most eager's on every tensor" in bp.format_criterion({"criterion": met, "missing": ["x"]}, "fp16")
    assert "missing from gradgen: x" in bp.format_criterion({"criterion": met, "missing": ["x"]}, "fp16")
    exact = bp.criterion({"a": 1e-6}, {"a": 0.0})  # eager exact, gradgen not: an infinite factor
    assert exact["above_eager"] == 1 and exact["worst_factor"] == math.inf
    assert "at most inf (a)" in bp.format_criterion({"criterion": exact, "missing": []}, "tf32")
    alone = bp.criterion({"a": 1e-3}, None)  # eager not measured
    assert "met" not in alone and "eager bf16 not measured" in bp.format_criterion({"criterion": alone}, "bf16")
    assert bp.format_criterion({"error": "no gradients from gradgen"}, "bf16").endswith("no gradients from gradgen")


def test_curve_difference():
    fp32 = [4.0, 3.0, 2.0, 1.0]
    ours = [4.0, 3.1, 1.9, 1.05, 0.5]  # one step more: compared over the steps both took
    d = bp.curve_difference(ours, fp32)
    assert d["steps"] == 4
    assert d["max_abs"] == pytest.approx(0.1) and d["max_abs_step"] in (2, 3)
    assert d["max_rel"] == pytest.approx(0.05)  # step 3 (0.1 / 2) and step 4 (0.05 / 1)
    assert (d["final"], d["final_fp32"]) == (1.05, 1.0) and d["mean_abs"] == pytest.approx(0.0625)
    text = bp.format_curve(d, "bf16")
    assert text.startswith("  gradgen bf16 loss curve vs gradgen fp32") and "4 steps" in text
    assert "relative 5.00e-02" in text and "final loss bf16 1.050000, fp32 1.000000" in text
    assert bp.curve_difference([], fp32) == {"steps": 0}
    assert "no steps" in bp.format_curve({"steps": 0}, "bf16")


def _npz(path, **arrays):
    np.savez(path, **{k: np.asarray(v, np.float32) for k, v in arrays.items()})


def test_e2e_against_fp32_reads_the_reference_and_formats(tmp_path):
    """With the fp32 reference on disk no child runs; the entry's table names the precision."""
    from gradgen.bench import e2e, models

    spec = models.preset("gpt2-tiny")
    _npz(tmp_path / "grads-fp32-eager.npz", w=[1.0, 2.0], b=[4.0])
    _npz(tmp_path / "grads-bf16-gradgen.npz", w=[1.0, 2.1], b=[4.0])
    _npz(tmp_path / "grads-bf16-eager.npz", w=[1.0, 2.02], b=[4.1])
    grads = {f: tmp_path / f"grads-bf16-{f}.npz" for f in ("gradgen", "eager")}
    result = e2e._against_fp32(spec, grads, e2e.E2EOptions(specs=[spec], device="cpu"), tmp_path, {})
    assert result["gradgen"] == pytest.approx({"w": 0.05, "b": 0.0}, abs=1e-6)
    assert result["eager"] == pytest.approx({"w": 0.01, "b": 0.025}, abs=1e-6)
    assert result["criterion"]["above_eager"] == 1 and result["criterion"]["worst_factor_tensor"] == "w"
    entry = {"spec": spec.to_json(), "precision": "bf16", "frameworks": {}, "fp32_reference": result}
    text = e2e.format_model(entry)
    assert "gpt2-tiny [bf16]" in text and "above eager's on 1 of 2 tensors" in text
    failed = {"spec": spec.to_json(), "precision": "fp16", "error": "build-backward --precision fp16 failed: x"}
    assert e2e.format_model(failed).endswith("build-backward --precision fp16 failed: x")
    grads["gradgen"].unlink()
    assert e2e._against_fp32(spec, grads, e2e.E2EOptions(specs=[spec], device="cpu"), tmp_path, {}) == {
        "error": "no gradients from gradgen"
    }


def test_train_against_fp32_with_a_reference_curve(tmp_path):
    from gradgen.bench import models, train

    spec = models.preset("gpt2-tiny")
    ours = {"losses": [3.0, 2.5, 2.0], "median_ms": 1.5, "first_step_s": 0.1}
    entry = {"spec": spec.to_json(), "precision": "fp16", "frameworks": {"gradgen": ours}}
    options = train.TrainOptions(specs=[spec], device="cpu")
    curve = train._against_fp32(spec, {}, options, tmp_path, entry, "gradgen", [3.0, 2.4, 2.0])
    assert curve["max_abs"] == pytest.approx(0.1) and curve["max_abs_step"] == 2 and curve["reference"] == "gradgen fp32"
    entry["fp32_curves"] = {"gradgen": curve}
    text = train.format_model(entry)
    assert "gpt2-tiny [fp16]" in text and "gradgen fp16 loss curve vs gradgen fp32 (3 steps" in text
    assert "tracking" not in text  # no eager curve to compare with
    entry["fp32_curves"]["eager"] = bp.curve_difference([3.0, 2.2, 2.0], [3.0, 2.4, 2.0])
    assert "tracking: gradgen's curve is as close as eager's" in train.format_model(entry)
    failed = {**entry, "frameworks": {"gradgen": {"error": "boom"}}}
    assert "failed" in train._against_fp32(spec, {}, options, tmp_path, failed, "gradgen", [3.0])["error"]
    assert "eager at fp16 failed" in train._against_fp32(spec, {}, options, tmp_path, entry, "eager", [3.0])["error"]


def test_tracking_compares_each_framework_with_its_own_fp32_curve():
    eager = bp.curve_difference([3.0, 2.2, 1.0], [3.0, 2.4, 1.0])  # max 0.2, mean 0.2 / 3
    close = bp.curve_difference([3.0, 2.5, 1.05], [3.0, 2.4, 1.0])  # max 0.1, mean 0.05
    assert bp.tracking(close, eager)["tracks"] and bp.tracking(close, eager)["max_ratio"] == pytest.approx(0.5)
    far = bp.curve_difference([3.0, 2.4, 1.3], [3.0, 2.4, 1.0])  # max 0.3
    verdict = bp.tracking(far, eager)
    assert not verdict["tracks"] and verdict["max_ratio"] == pytest.approx(1.5)
    assert "further than eager's" in bp.format_tracking(far, eager) and "1.50x" in bp.format_tracking(far, eager)
    assert bp.tracking({"steps": 0}, eager) == {} and "not compared" in bp.format_tracking({"steps": 0}, eager)


@pytest.mark.slow
def test_e2e_group_bf16_on_cpu_tiny():
    """e2e at bf16 in child processes (about 10 s): eager under autocast, gradgen's bf16 graph and
    the fp32 reference child; both errors are those of bf16 (above fp32 rounding, below 5 %)."""
    from gradgen.bench import e2e, models

    spec = models.preset("gpt2-tiny")
    report = e2e.run(
        e2e.E2EOptions(
            specs=[spec], device="cpu", frameworks=("eager", "gradgen"), precisions=("bf16",), steps=1, warmup=1, varlen=False
        )
    )
    assert list(report["models"]) == ["gpt2-tiny/bf16"] and report["settings"]["precisions"] == ["bf16"]
    entry = report["models"]["gpt2-tiny/bf16"]
    assert all("error" not in r for r in entry["frameworks"].values()), entry["frameworks"]
    assert entry["frameworks"]["eager"]["precision"] == entry["frameworks"]["gradgen"]["precision"] == "bf16"
    reference = entry["fp32_reference"]
    c = reference["criterion"]
    n = len(list(models.build_module(spec).parameters()))
    assert c["tensors"] == n and not reference["missing"]
    assert 1e-4 < c["gradgen_worst"] < 5e-2 and 1e-4 < c["eager_worst"] < 5e-2
    assert "vs eager fp32 gradients" in e2e.format_model(entry)


@pytest.mark.slow
def test_train_group_fp16_on_cpu_tiny():
    """train at fp16 (about 10 s): eager with GradScaler, gradgen with its loss scaling, and
    gradgen's fp32 reference curve; the fp16 curve tracks it."""
    from gradgen.bench import models, train

    spec = models.preset("gpt2-tiny")
    report = train.run(
        train.TrainOptions(specs=[spec], device="cpu", frameworks=("eager", "gradgen"), precisions=("fp16",), steps=7, warmup=2)
    )
    entry = report["models"]["gpt2-tiny/fp16"]
    eager, ours = entry["frameworks"]["eager"], entry["frameworks"]["gradgen"]
    assert "error" not in eager and "error" not in ours, (eager, ours)
    # step 9 takes step 1's batch again (8 batches cycled): both trained
    assert eager["losses"][8] < eager["losses"][0] and ours["losses"][8] < ours["losses"][0]
    for framework in ("gradgen", "eager"):  # each against its own fp32 curve, from one more child each
        curve = entry["fp32_curves"][framework]
        assert curve["reference"] == f"{framework} fp32"
        assert curve["steps"] == 9 and len(curve["fp32_losses"]) == 9
        assert 0 < curve["max_rel"] < 1e-2
    assert "tracking: gradgen's curve is" in train.format_model(entry)
    assert set(entry["tracking"]) == {"max_ratio", "mean_ratio", "tracks"}
    assert entry["loss_agreement"]["gradgen"] < 1e-3
    for framework in ("gradgen", "eager"):  # both start at GradScaler's 65536; counts are whole steps
        figures = entry["frameworks"][framework]["loss_scaling"]
        assert figures["initial_scale"] == 65536.0 and 0 <= figures["skipped_steps"] <= 9
        assert figures["final_scale"] == 65536.0 / 2 ** figures["skipped_steps"]
    text = train.format_model(entry)
    assert "  loss scaling: " in text and "gradgen skipped" in text and "eager skipped" in text


def _entry(name: str, seed: int, precision: str = "bf16", **fields) -> dict:
    return {"spec": {"name": name, "seed": seed}, "precision": precision, **fields}


def test_tracking_over_seeds_counts_the_seeds_where_gradgen_tracks(capsys):
    verdicts = {0: (0.76, 0.51, True), 1: (0.68, 0.67, True), 2: (1.16, 1.35, False)}
    report = {
        "models": {
            **{
                f"gpt2s/bf16/seed{s}": _entry("gpt2s", s, tracking={"max_ratio": a, "mean_ratio": b, "tracks": t})
                for s, (a, b, t) in verdicts.items()
            },
            "gpt2s/fp32": _entry("gpt2s", 0, "fp32"),  # fp32 has no verdict
            "resnet18/bf16": _entry("resnet18", 0, tracking={"max_ratio": 0.1, "mean_ratio": 0.1, "tracks": True}),  # one seed
        }
    }
    summary = bp.over_seeds(report, "tracking")
    assert list(summary) == ["gpt2s/bf16"]
    assert summary["gpt2s/bf16"]["tracks_on"] == 2 and summary["gpt2s/bf16"]["median_max_ratio"] == pytest.approx(0.76)
    assert [s["seed"] for s in summary["gpt2s/bf16"]["seeds"]] == [0, 1, 2]
    bp.report_over_seeds(report, "tracking")
    out = capsys.readouterr().out
    assert "gpt2s/bf16 over seeds 0, 1, 2: gradgen's curve as close to its fp32 curve as eager's on 2 of 3" in out
    assert "seed 2: 1.16x / 1.35x" in out and report["over_seeds"] == summary


def test_criterion_over_seeds_counts_met_and_worst_tensor_seeds(capsys):
    def criterion(ours, theirs, above):
        return {
            "fp32_reference": {
                "criterion": bp.criterion({"w": ours, "b": 0.01}, {"w": theirs, "b": 0.01 if not above else 0.005})
            }
        }

    report = {
        "models": {
            "r/bf16": _entry("r", 0, **criterion(0.08, 0.1, True)),
            "r/bf16/seed1": _entry("r", 1, **criterion(0.09, 0.1, False)),
        }
    }
    summary = bp.over_seeds(report, "criterion")["r/bf16"]
    assert summary["met_on"] == 1 and summary["worst_below_on"] == 2
    bp.report_over_seeds(report, "criterion")
    out = capsys.readouterr().out
    assert "every tensor at 1 of 2 seeds; its worst tensor at most eager's worst at 2 of 2" in out
    assert "seed 0: worst 8.00e-02 vs 1.00e-01, 1 of 2 above" in out
    nothing = {"models": {"r/bf16": _entry("r", 0, **criterion(0.08, 0.1, True))}}
    bp.report_over_seeds(nothing, "criterion")
    assert "over_seeds" not in nothing and capsys.readouterr().out == ""


def test_repeated_seeds_run_each_model_at_each_seed():
    from gradgen.bench import _specs
    from gradgen.bench.e2e import entry_key

    args = build_parser().parse_args(["--only", "train", "--model", "gpt2-tiny", "--seed", "0", "--seed", "2", "--seed", "2"])
    assert [(s.name, s.seed) for s in _specs(args, [])] == [("gpt2-tiny", 0), ("gpt2-tiny", 2)]
    defaults = build_parser().parse_args(["--only", "e2e", "--seed", "3"])
    from gradgen.bench import models

    specs = _specs(defaults, [models.preset("gpt2s"), models.preset("resnet18")])
    assert [(s.name, s.seed) for s in specs] == [("gpt2s", 3), ("resnet18", 3)]
    assert entry_key("gpt2s", "bf16") == "gpt2s/bf16" and entry_key("gpt2s", "bf16", 3) == "gpt2s/bf16/seed3"


def test_several_seeds_are_refused_for_the_cpu_group(capsys):
    assert main(["--only", "cpu", "--seed", "0", "--seed", "1"]) == 2
    assert "several --seed values apply to the e2e and train groups" in capsys.readouterr().err


def test_scaled_steps_from_the_final_scale():
    from gradgen.bench.worker import scaled_steps

    assert scaled_steps(65536.0, 8192.0, 2000, 205) == {"initial_scale": 65536.0, "final_scale": 8192.0, "skipped_steps": 3}
    assert scaled_steps(65536.0, 65536.0, 2000, 205)["skipped_steps"] == 0
    assert scaled_steps(65536.0, 8192.0, 2000, 2500)["skipped_steps"] is None  # it may have grown in between
    assert scaled_steps(65536.0, 131072.0, 2000, 205)["skipped_steps"] is None


def test_train_table_says_what_loss_scaling_skipped():
    from gradgen.bench import models, train

    spec = models.preset("gpt2-tiny")
    result = {"median_ms": 2.0, "first_step_s": 0.1, "losses": [3.0, 2.9], "memory": {}}
    entry = {
        "spec": spec.to_json(),
        "precision": "fp16",
        "frameworks": {
            "gradgen": {**result, "loss_scaling": {"initial_scale": 65536.0, "final_scale": 8192.0, "skipped_steps": 3}},
            "eager": {**result, "loss_scaling": {"initial_scale": 65536.0, "final_scale": 65536.0, "skipped_steps": None}},
        },
    }
    text = train.format_model(entry)
    assert "loss scaling: gradgen skipped 3 step(s) (scale 65536 -> 8192); eager skipped ? step(s) (scale 65536 -> 65536)" in text
