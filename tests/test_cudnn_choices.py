"""The cuDNN plan choices autotuning makes are kept on disk and reused (CPU test with a stand-in
graph): every process on a machine then runs the plan the first one timed fastest, so results do
not depend on which deterministic engine a noisy timing happened to favour."""

from __future__ import annotations

import json
import types

import pytest

from gradgen.kernels.cuda import conv


class FakeGraph:
    def __init__(self, names):
        self.names = names
        self.selected = None
        self.built = 0

    def build_plans(self, policy=None):
        self.built += 1

    def get_execution_plan_count(self):
        return len(self.names)

    def get_plan_name_at_index(self, index):
        return self.names[index]

    def select_plan(self, index):
        self.selected = index

    def get_workspace_size(self):
        return 0 if self.selected is None else 1024 * (self.selected + 1)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADGEN_CUDA_CACHE", str(tmp_path))
    monkeypatch.setattr(conv, "_machine_key", lambda: "Some GPU|cudnn 91900")
    fake_cudnn = types.SimpleNamespace(build_plan_policy=types.SimpleNamespace(ALL="all"))
    monkeypatch.setattr(conv, "_cudnn", lambda: (fake_cudnn, None))
    monkeypatch.setattr(conv, "FAST_EXECUTE", False)
    monkeypatch.setattr(conv, "_STATE", {})
    return tmp_path


def test_a_remembered_choice_is_selected_by_its_name(machine):
    conv._remember_choice("('wgrad', ...)", "eng17_k25=0")
    stored = json.loads((machine / "cudnn-plans.json").read_text())
    assert stored == {"Some GPU|cudnn 91900|('wgrad', ...)": "eng17_k25=0"}
    conv._STATE.clear()  # a new process reads the file
    graph = FakeGraph(["eng0", "eng50", "eng17_k25=0"])
    plan = conv._tuned_earlier(graph, None, None, None, None, "('wgrad', ...)")
    assert plan is not None and graph.selected == 2 and plan.workspace == 3072
    assert "eng17_k25=0" in plan.note


def test_no_choice_for_another_key_gpu_or_a_vanished_engine(machine, monkeypatch):
    conv._remember_choice("('fprop', ...)", "eng70")
    assert conv._tuned_earlier(FakeGraph(["eng70"]), None, None, None, None, "('dgrad', ...)") is None
    assert conv._tuned_earlier(FakeGraph(["eng1", "eng2"]), None, None, None, None, "('fprop', ...)") is None
    monkeypatch.setattr(conv, "_machine_key", lambda: "Other GPU|cudnn 91900")
    assert conv._tuned_earlier(FakeGraph(["eng70"]), None, None, None, None, "('fprop', ...)") is None


def test_choices_of_other_processes_are_kept_and_an_unwritable_cache_is_no_error(machine, tmp_path, monkeypatch):
    (machine / "cudnn-plans.json").write_text(json.dumps({"Some GPU|cudnn 91900|k0": "eng3"}))
    conv._remember_choice("k1", "eng4")
    assert json.loads((machine / "cudnn-plans.json").read_text()) == {
        "Some GPU|cudnn 91900|k0": "eng3",
        "Some GPU|cudnn 91900|k1": "eng4",
    }
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("GRADGEN_CUDA_CACHE", str(blocker / "sub"))  # a directory under a file
    conv._STATE.clear()
    conv._remember_choice("k2", "eng5")  # no exception; held in memory for this process
    assert conv._STATE["choices"]["Some GPU|cudnn 91900|k2"] == "eng5"


@pytest.mark.cuda  # gradgen.cuda.runtime makes the GPU's primary context current
def test_autotuning_is_on_by_default_and_off_during_capture(monkeypatch):
    from gradgen.cuda import runtime as rt

    monkeypatch.delenv("GRADGEN_CUDNN_BENCHMARK", raising=False)
    assert conv._autotune_wanted()
    monkeypatch.setattr(rt.CAPTURE, "active", True)
    assert not conv._autotune_wanted()
    monkeypatch.setattr(rt.CAPTURE, "active", False)
    monkeypatch.setenv("GRADGEN_CUDNN_BENCHMARK", "0")
    assert not conv._autotune_wanted()
