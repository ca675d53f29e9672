"""gradgen: build backward (gradient) graphs of ONNX models and run them on CPU or CUDA.

The public names below are imported on first use, so that ``gradgen --help`` starts fast.
"""

from gradgen.errors import GradgenError, KernelError, ModelError, RunError, UnsupportedOpsError, UsageError

__version__ = "0.1.0"

_FROM_API = {"BackwardModel", "Session", "backward_pipeline", "build_backward"}
_FROM_CUSTOM_OPS = {"register_gradient", "register_kernel", "unregister"}


def __getattr__(name: str):
    if name in _FROM_API:
        from gradgen import api

        return getattr(api, name)
    if name in _FROM_CUSTOM_OPS:
        from gradgen import custom_ops

        return getattr(custom_ops, name)
    if name in {
        "api",
        "custom_ops",
        "passes",
        "check",
        "executor",
        "kernels",
        "grads",
        "inputs",
        "model_io",
        "support",
        "training",
    }:
        import importlib

        return importlib.import_module(f"gradgen.{name}")
    raise AttributeError(f"module 'gradgen' has no attribute {name!r}")


__all__ = [
    "BackwardModel",
    "GradgenError",
    "KernelError",
    "ModelError",
    "RunError",
    "Session",
    "UnsupportedOpsError",
    "UsageError",
    "backward_pipeline",
    "build_backward",
    "register_gradient",
    "register_kernel",
    "unregister",
]
