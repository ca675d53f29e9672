"""`gradgen run --device cuda` end to end on a sample: same gradients as PyTorch's reference."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.model_dirs import SAMPLE_DIRS

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_run_on_cuda_matches_the_reference(tmp_path, name):
    sample = next(p for p in SAMPLE_DIRS if p.name == name)
    built = tmp_path / "grad.onnx"
    subprocess.run([sys.executable, "-m", "gradgen", "build-backward", str(sample / "model.onnx"), "-o", str(built),
                    "--wrt-inputs"],
                   check=True, capture_output=True, timeout=300)
    result = subprocess.run([sys.executable, "-m", "gradgen", "run", str(built), "--inputs", str(sample / "inputs.npz"),
                             "--device", "cuda", "--compare", str(sample / "reference.npz")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ran on cuda" in result.stdout and "match the reference" in result.stdout
    memory = next(line for line in result.stdout.splitlines() if line.startswith("device memory: planned arena"))
    planned, bound, held = (float(word) for word in memory.replace("(", " ").split() if word.replace(".", "").isdigit())
    assert 0 < bound <= planned and held > 0, memory
