"""CUDA launchers, registered next to the CPU kernels. Importing them needs no GPU: each imports
gradgen.cuda.runtime (and so PyCUDA) only when it runs."""

from gradgen.kernels.cuda import (  # noqa: F401
    conv,
    copy,
    elementwise,
    indexing,
    loss,
    matmul,
    microsoft,
    norm,
    pool,
    reduce,
)
