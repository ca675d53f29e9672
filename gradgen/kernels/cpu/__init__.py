"""numpy CPU kernels, one small function per op, in one module per op family (the same family
names as grads/rules and kernels/cuda); importing registers them."""

from gradgen.kernels.cpu import (  # noqa: F401
    conv,
    elementwise,
    indexing,
    loss,
    matmul,
    norm,
    optimizer,
    pool,
    reduction,
    shape,
)
