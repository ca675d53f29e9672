"""If, Loop and Scan on the GPU: the body runs on the device, inside the step.

The kernels are gradgen/kernels/cpu/control.py's, run with ``DEVICE_ARRAYS``: a body is a GPU
Session of its own (planned once per subgraph, its constants uploaded once), run with
``Session.run_within`` on the outer run's values as they are held (device arrays, and host arrays
for the shape values the outer run keeps on the host). It has no lock or CUDA graph of its own,
and its outputs stay on the device. Its allocations come from the pool, not from the outer run's
plan: a plan serves the k-th request of n bytes of a step at one offset, and every request of one
step would get its own offset (they all live during that step), so a loop of many iterations
would be planned the sum of its iterations' buffers where the pool reuses them as they die; and the
requests change with the branch or the trip count. Reading a condition or a trip count back to
the host is a copy a CUDA graph cannot record, so a run with such a step stays on the eager path
(a one-time note says so).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from gradgen.kernels.cpu.control import body_session, control_flow_kernels
from gradgen.kernels.cuda.launch import contiguous, on_device, runtime
from gradgen.kernels.cuda.shape import concat, reshaped, transpose
from gradgen.kernels.table import cuda_kernel


class DeviceArrays:
    """What the control-flow kernels do with arrays on a GPU Session: bodies run on the device;
    stacks and axis moves are device copies (numpy where every array is still on the host)."""

    @staticmethod
    def run(graph: ir.Graph, inputs: list, scope: dict, opset: int) -> list:
        rt = runtime()
        with rt.persistent():  # a body's constants outlive the run that first needs them
            session, feeds = body_session(graph, opset, inputs, scope, device="cuda")
        with rt.allocation_hook(None):  # the pool (see the module docstring)
            return session.run_within(feeds)

    @staticmethod
    def host(value) -> np.ndarray:
        return runtime().to_host(value)

    @staticmethod
    def stack(elements: list):
        rt = runtime()
        if not any(rt.is_device(e) for e in elements):
            return np.stack(elements)
        rows = [reshaped(on_device(e), (1, *e.shape)) for e in elements]
        return concat(*rows, axis=0)

    @staticmethod
    def concatenate(parts: list):
        rt = runtime()
        if not any(rt.is_device(p) for p in parts):
            return np.concatenate(parts)
        return concat(*[on_device(p) for p in parts], axis=0)

    @staticmethod
    def moveaxis(x, source: int, destination: int):
        if not runtime().is_device(x):
            return np.moveaxis(x, source, destination)
        if source == destination:
            return contiguous(x)  # a scan takes its steps as views of whole rows
        perm = [a for a in range(len(x.shape)) if a != source]
        perm.insert(destination, source)
        return transpose(x, perm=perm)

    @staticmethod
    def zeros(shape, dtype):
        return runtime().zeros(shape, dtype)


DEVICE_ARRAYS = DeviceArrays()


for _op, _kernel in control_flow_kernels(DEVICE_ARRAYS).items():
    cuda_kernel(_op, inputs_as_placed=True)(_kernel)
