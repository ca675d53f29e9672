"""The CPU backend keeps freed memory for the next run (glibc's malloc, see
``gradgen.executor.session.keep_freed_memory``): a second run of a model with a 64 MiB
intermediate touches no fresh pages; ``GRADGEN_CPU_KEEP_MEMORY=0`` leaves malloc as it is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource
    import numpy as np
    from onnx import TensorProto, helper
    from gradgen.executor.session import Session

    n = 16 * 1024 * 1024  # 64 MiB of float32: above glibc's largest mmap threshold
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["t"]), helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
    )
    sess = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    x = np.ones(n, dtype=np.float32)
    sess.run({"x": x})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    y = sess.run({"x": x})["y"]
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, float(y))
    """
)


def _faults_of_second_run(keep: str) -> tuple[int, float]:
    env = dict(os.environ, GRADGEN_CPU_KEEP_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout
    faults, value = out.split()
    return int(faults), float(value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_second_run_reuses_freed_memory():
    kept, value = _faults_of_second_run("1")
    plain, plain_value = _faults_of_second_run("0")
    assert value == plain_value == 2.0 * 16 * 1024 * 1024
    assert plain >= 32  # 64 MiB of fresh pages: 16,384 of 4 KiB, or 32 of 2 MiB (transparent huge pages)
    assert kept <= plain // 10
