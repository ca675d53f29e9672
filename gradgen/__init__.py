"""gradgen: build backward (gradient) graphs of ONNX models and run them on CPU or CUDA."""

from gradgen.api import BackwardModel, Session, backward_pipeline, build_backward
from gradgen.errors import GradgenError, KernelError, ModelError, RunError, UnsupportedOpsError, UsageError

__version__ = "0.1.0"

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
]
