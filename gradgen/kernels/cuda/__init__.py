"""CUDA launchers, registered next to the CPU kernels, one module per op family (the same family
names as grads/rules and kernels/cpu; each X.py compiles its kernels from X.cu). Importing them
needs no GPU: each imports gradgen.cuda.runtime (and so PyCUDA) only when it runs."""

from gradgen.kernels.cuda import (  # noqa: F401
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
