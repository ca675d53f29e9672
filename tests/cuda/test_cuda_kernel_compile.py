"""The GPU kernels compile through NVRTC (no nvcc) into the persistent cache, and load from it."""

import json
import os
import subprocess
import sys

import pytest

from gradgen.cuda import compile as cc
from gradgen.cuda import kernel_cache

pytestmark = pytest.mark.cuda

SCRIPT = r"""
import json, sys, numpy as np
from onnx import TensorProto, helper
from gradgen.executor import Session
from gradgen.cuda import runtime as rt
from gradgen.cuda.compile import compiler
nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("ReduceSum", ["r"], ["y"], keepdims=0)]
graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 33])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
x = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
y = Session(model, device="cuda").run({"x": x})["y"]
print(json.dumps({"y": float(y), "want": float(np.maximum(x, 0).astype(np.float64).sum()),
                  "arch": rt._arch(), "compiler": compiler().kind}))
"""


def _without_nvcc(env):
    """PATH without any directory holding nvcc, and no CUDA_HOME: only NVRTC can compile."""
    path = [d for d in env.get("PATH", "").split(os.pathsep) if d and not os.path.exists(os.path.join(d, "nvcc"))]
    env = {k: v for k, v in env.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = os.pathsep.join(path)
    env["GRADGEN_CUDA_PREBUILT"] = "0"  # compiled here, not read from a wheel's prebuilt cubins
    return env


def test_kernels_compile_with_nvrtc_alone_and_are_cached():
    nvrtc, why = cc._make("nvrtc")
    if nvrtc is None:
        pytest.skip(why)
    env = _without_nvcc(dict(os.environ, GRADGEN_CUDA_COMPILER="nvrtc"))
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["compiler"] == "nvrtc"
    assert out["y"] == pytest.approx(out["want"], rel=1e-5)
    directory = kernel_cache.cache_dir()
    for name in cc.source_names():  # every source was fetched at the first use, compiled or cached
        build = kernel_cache.read_build(kernel_cache.build_stem(directory, cc.find_source(name), out["arch"], nvrtc.identity))
        assert build and all(cubin[:4] == b"\x7fELF" for _, cubin in build), name

    again = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "compiling" not in again.stderr  # the second process loads every cubin from the cache
