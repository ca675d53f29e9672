"""Importing this package registers every gradient rule: one module per op family, with the same
family names as kernels/cpu and kernels/cuda."""

from gradgen.grads.rules import (  # noqa: F401
    conv,
    elementwise,
    indexing,
    loss,
    matmul,
    norm,
    pool,
    reduction,
    shape,
)
