"""numpy CPU kernels, one small function per op, grouped by family; importing registers them."""

from gradgen.kernels.cpu import (  # noqa: F401
    elementwise,
    indexing,
    loss,
    matmul,
    microsoft,
    nn,
    ort_training,
    reduction,
    shape,
)
