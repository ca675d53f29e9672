"""`gradgen run --device cuda` end to end on a sample: same gradients as PyTorch's reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_dirs import SAMPLE_DIRS

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["cnn", "transformer"])
def test_run_on_cuda_matches_the_reference(tmp_path, name):
    sample = next(p for p in SAMPLE_DIRS if p.name == name)
    built = tmp_path / "grad.onnx"
    subprocess.run(
        [sys.executable, "-m", "gradgen", "build-backward", str(sample / "model.onnx"), "-o", str(built), "--wrt-inputs"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradgen",
            "run",
            str(built),
            "--inputs",
            str(sample / "inputs.npz"),
            "--device",
            "cuda",
            "--compare",
            str(sample / "reference.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "ran on cuda" in result.stdout and "match the reference" in result.stdout
    memory = next(line for line in result.stdout.splitlines() if line.startswith("device memory: planned arena"))
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    words = memory.replace("(", " ").replace(")", " ").replace(",", " ").split()
    planned, bound, held = (float(w) * scale[u] for w, u in zip(words, words[1:]) if u in scale)
    assert 0 < bound <= planned and held > 0, memory


def test_a_script_holding_a_session_in_a_global_exits_cleanly(tmp_path):
    """Device memory is released before PyCUDA pops its context at exit (it used to abort)."""
    script = tmp_path / "hold.py"
    script.write_text(
        "import numpy as np, gradgen\n"
        "from gradgen.executor import Session\n"
        "built = gradgen.build_backward('samples/cnn/model.onnx', wrt_inputs=True).model\n"
        "session = Session(built, device='cuda')\n"
        "inputs = dict(np.load('samples/cnn/inputs.npz'))\n"
        "for _ in range(3):\n"
        "    grads = session.run(inputs)\n"
        "print('ran', len(grads))\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0 and "ran" in result.stdout, result.stderr
    assert "terminate called" not in result.stderr and "PyCUDA" not in result.stderr, result.stderr
