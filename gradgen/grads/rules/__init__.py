"""Importing this package registers every gradient rule."""

from gradgen.grads.rules import (  # noqa: F401
    conv,
    elementwise,
    indexing,
    loss,
    matmul,
    nondiff,
    norm,
    reduction,
    shape,
)
