"""gradgen's executor: plans a model once and runs it on the CPU (numpy) or, later, CUDA."""

from gradgen.executor.session import Session

__all__ = ["Session"]
