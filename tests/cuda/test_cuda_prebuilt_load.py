"""Prebuilt kernels on the GPU (gradgen/cuda/prebuilt.py): a prebuilt directory's cubins are loaded
with nothing compiled, and cubins that do not load are compiled instead."""

import json
import os
import subprocess
import sys

import pytest

from gradgen.cuda import compile as cc
from gradgen.cuda import kernel_cache, prebuilt

pytestmark = pytest.mark.cuda

SCRIPT = r"""
import json, numpy as np
from onnx import TensorProto, helper
from gradgen.executor import Session
nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r"], ["y"], keepdims=0)]
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 33])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
y = Session(model, device="cuda").run({"x": x})["y"]
print(json.dumps({"y": float(y), "want": float(np.maximum(x, 0).astype(np.float64).sum())}))
"""


def _arch() -> str:
    from cuda.core import Device

    major, minor = Device(0).compute_capability
    return f"sm_{major}{minor}"


def _run(env) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["y"] == pytest.approx(out["want"], rel=1e-5)
    return result


def test_prebuilt_cubins_load_with_nothing_compiled(tmp_path):
    """A prebuilt directory holding every source's build for this GPU (taken from the warm cache)
    serves a run whose own cache is empty: nothing is compiled or written there."""
    arch = _arch()
    built = kernel_cache.builds(arch, prebuilt_ok=False)
    assert not [name for name, build in built.items() if isinstance(build, Exception)]
    prebuilt.write(tmp_path / "prebuilt", [(cc.find_source(name), arch, build) for name, build in built.items()], "test")
    env = dict(os.environ, GRADGEN_CUDA_PREBUILT=str(tmp_path / "prebuilt"), GRADGEN_CUDA_CACHE=str(tmp_path / "cache"))
    result = _run(env)
    assert "compiling" not in result.stderr
    assert not list((tmp_path / "cache").glob("*.cubin"))


def test_prebuilt_cubins_that_do_not_load_are_compiled_instead(tmp_path):
    """Damaged cubins (as from a compiler newer than the driver) for this GPU: said once on stderr,
    then every source comes from the cache or is compiled, and the result is right."""
    arch = _arch()
    damaged = [(cc.find_source(name), arch, [(None, b"\x7fELF not a cubin")]) for name in cc.source_names()]
    prebuilt.write(tmp_path / "prebuilt", damaged, "test")
    result = _run(dict(os.environ, GRADGEN_CUDA_PREBUILT=str(tmp_path / "prebuilt")))
    assert result.stderr.count("do not load") == 1, result.stderr[-3000:]
